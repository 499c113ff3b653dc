//! The errors of managing a volume: formatting, opening, serving, connecting, replaying a write
//! log. Each names the file or socket and says what was being done, on one line.
//!
//! The errors of the operations a client asks of the service are [`ExoError`]: an errno and a
//! line, as the wire protocol carries them (`docs/exodisk.md`).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::core::ExoError;
use crate::seal::SealError;

#[derive(Debug)]
pub enum Error {
    /// A system call on `path` (a volume, a key file, a write log, a socket) failed while `op`.
    Io { op: &'static str, path: PathBuf, source: io::Error },
    /// A write to or a read from the volume at `path`, at `sector`, failed while `op`.
    Sector { op: &'static str, path: PathBuf, sector: u64, source: io::Error },
    /// An operation of the service's core on the volume at `path` failed while `op`.
    Exo { op: &'static str, path: PathBuf, source: ExoError },
    /// Formatting refused: `path` is an exodisk volume already.
    AlreadyAVolume { path: PathBuf },
    /// Formatting refused: a key file is already at `path`.
    KeyFileThere { path: PathBuf },
    /// Formatting refused: the image at `path` does not exist and no size was given.
    NoSize { path: PathBuf },
    /// Formatting refused: `bytes` leave no room for a volume (which needs `min_bytes`).
    TooSmall { path: PathBuf, bytes: u64, min_bytes: u64 },
    /// Formatting refused: `--size` asks more of the device at `path` than it has.
    LargerThanDevice { path: PathBuf, size: u64, available: u64 },
    /// Formatting could not reserve the image's `bytes` at `path`.
    Reserve { path: PathBuf, bytes: u64, source: io::Error },
    /// `path` holds no exodisk superblock.
    NotAVolume { path: PathBuf },
    /// The file at `path` is not an exodisk key file.
    BadKeyFile { path: PathBuf },
    /// The superblock of the volume at `path` does not open under the key file `key`, or is of
    /// a version this plyfs does not serve.
    Superblock { path: PathBuf, key: PathBuf, why: SuperblockFault },
    /// The superblock of the volume at `path` claims more sectors than the volume has.
    Truncated { path: PathBuf, claimed: u64, sectors: u64 },
    /// The volume at `path` breaks its invariants (the first `problem` of `count`): not served.
    Inconsistent { path: PathBuf, problem: String, count: usize },
    /// The write log at `path` is not one, or is out of shape: `why` says where.
    WriteLog { path: PathBuf, why: String },
    /// The volume at `path` has `sectors`, the write log at `log` was taken of `logged`.
    LogOfAnotherVolume { path: PathBuf, sectors: u64, log: PathBuf, logged: u64 },
    /// Connecting to the service at `socket` failed: nothing listens there, or the socket is
    /// missing.
    Unreachable { socket: PathBuf, source: io::Error },
    /// Connecting to the service at `socket`: it refused, saying `why`.
    Refused { socket: PathBuf, why: String },
    /// Connecting to `socket`: what answered is not an exodisk service.
    NotAService { socket: PathBuf },
    /// Serving on `socket`: another service answers there.
    SocketInUse { socket: PathBuf },
    /// Serving on `socket`: the service stopped before it listened.
    NotListening { socket: PathBuf },
}

/// Why a superblock was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SuperblockFault {
    /// Its seal does not open: altered, or another volume's key.
    Unsealed(SealError),
    /// A version 1 volume, which kept extent data in clear.
    Version1,
    /// A version this plyfs does not know.
    Version(u8),
    /// Authentic, but its layout is not the one its size gives.
    Inconsistent,
}

impl fmt::Display for SuperblockFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SuperblockFault::Unsealed(e) => write!(f, "superblock: {e}"),
            SuperblockFault::Version1 => f.write_str(
                "superblock: a version 1 volume (extent data stored in clear); this plyfs serves version 2 only, \
                 which seals extent data: copy its files out with the plyfs that made it, then format a new volume",
            ),
            SuperblockFault::Version(v) => {
                write!(f, "superblock: version {v} is not supported (this plyfs knows {})", crate::layout::VERSION)
            }
            SuperblockFault::Inconsistent => f.write_str("superblock: authentic but inconsistent layout"),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { op, path, source } => write!(f, "{}: {op}: {source}", path.display()),
            Error::Sector { op, path, sector, source } => write!(f, "{}: {op} sector {sector}: {source}", path.display()),
            Error::Exo { op, path, source } => write!(f, "{}: {op}: {source}", path.display()),
            Error::AlreadyAVolume { path } => write!(f, "{}: already an exodisk volume; nothing changed", path.display()),
            Error::KeyFileThere { path } => {
                write!(f, "{}: a key file is already there (another volume's?); remove it or choose --key", path.display())
            }
            Error::NoSize { path } => write!(f, "{}: no such file; give --size to make an image", path.display()),
            Error::TooSmall { path, bytes, min_bytes } => write!(
                f,
                "{}: {bytes} bytes is too small for a volume (at least {} KiB)",
                path.display(),
                min_bytes.div_ceil(1024)
            ),
            Error::LargerThanDevice { path, size, available } => {
                write!(f, "{}: --size {size} is larger than the device ({available} bytes)", path.display())
            }
            Error::Reserve { path, bytes, source } => write!(f, "{}: reserving {bytes} bytes: {source}", path.display()),
            Error::NotAVolume { path } => write!(f, "{}: not an exodisk volume (no superblock)", path.display()),
            Error::BadKeyFile { path } => write!(f, "{}: not an exodisk key file", path.display()),
            Error::Superblock { path, key, why: why @ SuperblockFault::Unsealed(_) } => {
                write!(f, "{}: {why} (is {} its key?)", path.display(), key.display())
            }
            Error::Superblock { path, why, .. } => write!(f, "{}: {why}", path.display()),
            Error::Truncated { path, claimed, sectors } => {
                write!(f, "{}: the superblock says {claimed} sectors, the volume has {sectors}", path.display())
            }
            Error::Inconsistent { path, problem, count } => write!(
                f,
                "{}: {problem} (and {} more); not serving it: see `plyfs exodisk fsck {}`",
                path.display(),
                count - 1,
                path.display()
            ),
            Error::WriteLog { path, why } => write!(f, "{}: {why}", path.display()),
            Error::LogOfAnotherVolume { path, sectors, log, logged } => write!(
                f,
                "{}: {sectors} sectors, but {} records a volume of {logged}",
                path.display(),
                log.display()
            ),
            Error::Unreachable { socket, source } => write!(f, "{}: connecting: {source}", socket.display()),
            Error::Refused { socket, why } => write!(f, "{}: refused: {why}", socket.display()),
            Error::NotAService { socket } => write!(f, "{}: not an exodisk service", socket.display()),
            Error::SocketInUse { socket } => write!(f, "{}: another service listens there", socket.display()),
            Error::NotListening { socket } => write!(f, "{}: the service did not start listening", socket.display()),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } | Error::Sector { source, .. } | Error::Reserve { source, .. } | Error::Unreachable { source, .. } => {
                Some(source)
            }
            Error::Exo { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

/// `map_err(io("reading the key file", path))`: an I/O error on `path` while `op`.
pub(crate) fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io { op, path: path.to_owned(), source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_file_and_the_operation() {
        let e = io("reading the key file", Path::new("/srv/v.key"))(io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(e.to_string(), "/srv/v.key: reading the key file: Permission denied (os error 13)");
        let e = Error::Sector {
            op: "writing",
            path: "/srv/v.img".into(),
            sector: 9,
            source: io::Error::from_raw_os_error(libc::EIO),
        };
        assert!(e.to_string().starts_with("/srv/v.img: writing sector 9: "), "{e}");
        let e = Error::Superblock { path: "/v".into(), key: "/k".into(), why: SuperblockFault::Unsealed(SealError::Forged) };
        assert!(e.to_string().starts_with("/v: superblock: ") && e.to_string().ends_with("(is /k its key?)"), "{e}");
        let e = Error::Superblock { path: "/v".into(), key: "/k".into(), why: SuperblockFault::Version(7) };
        assert!(!e.to_string().contains("/k"), "{e}");
    }
}
