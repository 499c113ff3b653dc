//! The errors of opening exofs on a service and of running the benchmarks: each names the
//! service's socket and says what was being done, on one line. Operations on files, once the
//! file system is open, return the layer interface's `plyfs_stack::Error`.

use std::fmt;
use std::path::PathBuf;

use plyfs_exodisk::core::ExoError;

#[derive(Debug)]
pub enum Error {
    /// A request to the exodisk service at `socket` failed while `op`.
    Exo { socket: PathBuf, op: &'static str, source: ExoError },
    /// A file system operation over the service at `socket` failed while `op`.
    Fs { socket: PathBuf, op: &'static str, source: plyfs_stack::Error },
    /// The named root `root` on the service at `socket` holds something other than exofs.
    NotExofs { socket: PathBuf, root: String },
    /// The superblock names root directory inode `ino`, which is not on the volume.
    RootLost { socket: PathBuf, ino: u64 },
    /// The benchmarks found no run of `sectors` free sectors on the volume behind `socket`.
    NoRoom { socket: PathBuf, sectors: u64 },
    /// `plyfs exodisk bench` was given a group it does not know.
    UnknownGroup { group: String },
    /// A benchmark's client thread panicked.
    Panicked { socket: PathBuf, group: &'static str },
    /// An error of the exodisk client library (connecting, mostly): it names the socket.
    Exodisk(plyfs_exodisk::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Exo { socket, op, source } => write!(f, "{}: {op}: {source}", socket.display()),
            Error::Fs { socket, op, source } => write!(f, "{}: {op}: {source}", socket.display()),
            Error::NotExofs { socket, root } => {
                write!(f, "{}: the root exonode '{root}' does not hold an exofs file system", socket.display())
            }
            Error::RootLost { socket, ino } => {
                write!(f, "{}: the root directory's inode {ino} is not on the volume", socket.display())
            }
            Error::NoRoom { socket, sectors } => write!(f, "{}: no {sectors} free sectors in a row", socket.display()),
            Error::UnknownGroup { group } => {
                write!(f, "unknown group '{group}' (small, large, two, insert, ddio, persist)")
            }
            Error::Panicked { socket, group } => {
                write!(f, "{}: benchmark {group}: a client thread panicked", socket.display())
            }
            Error::Exodisk(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Exo { source, .. } => Some(source),
            Error::Fs { source, .. } => Some(source),
            Error::Exodisk(e) => Some(e),
            _ => None,
        }
    }
}

impl From<plyfs_exodisk::Error> for Error {
    fn from(e: plyfs_exodisk::Error) -> Error {
        Error::Exodisk(e)
    }
}

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_socket_and_the_operation() {
        let source = ExoError { errno: libc::EACCES, msg: "wrong write capability".into() };
        let e = Error::Exo { socket: "/run/exo.sock".into(), op: "claiming the named root 'exofs'", source };
        assert_eq!(e.to_string(), "/run/exo.sock: claiming the named root 'exofs': wrong write capability");
        let e = Error::Fs { socket: "/run/exo.sock".into(), op: "making the file system", source: plyfs_stack::Error::Os(libc::ENOSPC) };
        assert!(e.to_string().starts_with("/run/exo.sock: making the file system: "), "{e}");
    }
}
