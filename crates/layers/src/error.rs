//! The errors of this crate outside the layer interface (where layers return
//! [`plyfs_stack::Error`]): making, unlocking and re-keying crypt volumes, starting a hosted
//! layer's process, reading fault rules. Each names its object (a file, a volume, a process)
//! and what was being done; a codec's errors are [`plyfs_sca::Error`], named by the framework.

use std::fmt;
use std::io;
use std::path::PathBuf;

#[derive(Debug)]
pub enum Error {
    /// Reading, writing or listing `path` failed.
    Io { op: &'static str, path: PathBuf, source: io::Error },
    /// `--cipher` names no cipher this build has.
    UnknownCipher { name: String },
    /// A master key as typed (recovery text) cannot be read; `why` completes "the master key ...".
    BadMasterKey { why: String },
    /// A new password or key file is not acceptable (empty, too short, too little memory).
    BadSecret { why: String },
    /// Settings that contradict each other.
    BadSettings { why: &'static str },
    /// The volume configuration `path` is damaged.
    Corrupt { path: String, why: String },
    /// The volume configuration `path` asks for what this build does not know.
    Unsupported { path: String, why: String },
    /// A volume id that is not 32 hex digits.
    BadVolumeId { id: String },
    /// Deriving the key-encryption key from the volume `path`'s settings failed.
    Kdf { path: String, why: String },
    /// The secret (`secret` says which kind) does not unwrap, or is not, the master key of the
    /// volume `path`.
    WrongSecret { path: String, secret: &'static str },
    /// The volume `path` is unlocked with another kind of secret than the one given.
    WrongSecretKind { path: String, takes: &'static str, given: &'static str },
    /// The volume `path` predates key-check values, so a master key cannot unlock it.
    MasterKeyUnchecked { path: String },
    /// Sealing the master key for the volume `path` failed.
    Seal { path: String },
    /// `dir` is not a crypt volume: `file` is missing; `plyfs init {dir}{init_flag}` makes one.
    NotAVolume { dir: PathBuf, file: String, init_flag: String },
    /// `dir` is already a crypt volume (`file` exists).
    AlreadyAVolume { dir: PathBuf, file: String },
    /// `dir` holds names that would not decrypt.
    NotEmpty { dir: PathBuf },
    /// The hosted process `peer` (a socket, or a script run by a Python) could not be reached
    /// or started.
    Connect { peer: String, why: String },
    /// A fault rule cannot be read; `why` names the word at fault. Whoever read the rule (from
    /// a rules file, or `fault-add`) says where it came from.
    BadRule { why: String },
    /// An argument of the extended operation `op` cannot be read.
    BadArgument { op: &'static str, why: String },
}

impl Error {
    /// For `map_err`: the `io::Error` of `op` on `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { op, path, source } => write!(f, "{}: {op}: {source}", path.display()),
            Error::UnknownCipher { name } => write!(f, "unknown cipher '{name}': use aes-256-gcm (the default) or xchacha20-poly1305"),
            Error::BadMasterKey { why } => write!(f, "the master key {why}"),
            Error::BadSecret { why } => f.write_str(why),
            Error::BadSettings { why } => f.write_str(why),
            Error::Corrupt { path, why } => write!(f, "{path}: corrupt: {why}"),
            Error::Unsupported { path, why } => write!(f, "{path}: {why}"),
            Error::BadVolumeId { id } => write!(f, "corrupt: volume_id '{id}' is not 32 hex digits"),
            Error::Kdf { path, why } => write!(f, "{path}: deriving the key from the secret: {why}"),
            Error::WrongSecret { path, secret: "master key" } => write!(f, "{path}: wrong master key: it is not this volume's"),
            Error::WrongSecret { path, secret } => write!(f, "{path}: wrong {secret} (or the file was altered)"),
            Error::WrongSecretKind { path, takes, given } => write!(f, "{path}: this volume is unlocked with a {takes}, not a {given}"),
            Error::MasterKeyUnchecked { path } => write!(
                f,
                "{path}: this volume was made before master keys could be checked, so it cannot be unlocked with one; \
                 unlock it with its password or key file"
            ),
            Error::Seal { path } => write!(f, "{path}: sealing the master key failed"),
            Error::NotAVolume { dir, file, init_flag } => write!(
                f,
                "{}: not a crypt volume ({file} is missing); create one with `plyfs init {}{init_flag}`",
                dir.display(),
                dir.display()
            ),
            Error::AlreadyAVolume { dir, file } => write!(f, "{}: already a crypt volume ({file} exists)", dir.display()),
            Error::NotEmpty { dir } => write!(
                f,
                "{}: not empty: with encrypted names the names already there would not decrypt (use an empty directory, or --plaintext-names)",
                dir.display()
            ),
            // The transport's reason leaves the peer out (`ConnectError`): it is named here, once.
            Error::Connect { peer, why } => write!(f, "{peer}: {why}"),
            Error::BadRule { why } => f.write_str(why),
            Error::BadArgument { op, why } => write!(f, "{op}: {why}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn messages_name_the_object_and_the_operation() {
        let e = Error::io("reading the volume configuration", "/v/plyfs.crypt.toml")(std::io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(e.to_string(), "/v/plyfs.crypt.toml: reading the volume configuration: Permission denied (os error 13)");
        assert!(std::error::Error::source(&e).is_some());
        let e = Error::WrongSecret { path: "/v/plyfs.crypt.toml".into(), secret: "password" };
        assert_eq!(e.to_string(), "/v/plyfs.crypt.toml: wrong password (or the file was altered)");
        let e = Error::Kdf { path: "/v/c.toml".into(), why: "kdf salt: bad".into() };
        assert_eq!(e.to_string(), "/v/c.toml: deriving the key from the secret: kdf salt: bad");
        let e = Error::NotAVolume { dir: "/v".into(), file: "plyfs.crypt.toml".into(), init_flag: " --layer crypt".into() };
        assert_eq!(e.to_string(), "/v: not a crypt volume (plyfs.crypt.toml is missing); create one with `plyfs init /v --layer crypt`");
    }
}
