//! The transport's errors: each names the socket, peer or file it is about and what was being
//! done, then the cause, on one line.
//!
//! Errors of operations carried over a connection stay `plyfs_stack::Error` (they travel as an
//! errno); this type is for setting up, accepting and keeping connections.

use std::fmt;
use std::io;
use std::path::PathBuf;

#[derive(Debug)]
pub enum Error {
    /// A system call on a socket, a listener or a file failed. `object` names it (`unix:PATH`,
    /// `tcp:HOST:PORT`, a peer).
    Io { object: String, op: &'static str, source: io::Error },
    /// The path where a Unix socket is to be bound is taken.
    SocketTaken { path: PathBuf, why: &'static str },
    /// A local user the server's policy does not admit.
    NotAllowed { uid: u32 },
    /// The pre-shared key file cannot be used.
    BadKeyFile { path: PathBuf, why: String },
    /// TLS could not be set up (`op`: what was being made).
    Tls { op: &'static str, why: String },
    /// The other end broke the protocol or the handshake, or the connection failed under it.
    Peer { peer: String, why: String },
}

impl Error {
    /// `Error::Io` for a failed `op` on `object`, for `map_err`.
    pub fn io(op: &'static str, object: impl fmt::Display) -> impl FnOnce(io::Error) -> Error {
        move |source| Error::Io { object: object.to_string(), op, source }
    }

    /// `Error::Peer` for what went wrong with `peer`, for `map_err`.
    pub fn peer<E: fmt::Display>(peer: &str) -> impl FnOnce(E) -> Error + '_ {
        move |why| Error::Peer { peer: peer.to_owned(), why: why.to_string() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { object, op, source } => write!(f, "{object}: {op}: {source}"),
            Error::SocketTaken { path, why } => write!(f, "{}: {why}", path.display()),
            Error::NotAllowed { uid } => write!(f, "user {uid} may not use this server (allow it with --allow-uid {uid})"),
            Error::BadKeyFile { path, why } => write!(f, "key file {}: {why}", path.display()),
            Error::Tls { op, why } => write!(f, "TLS: {op}: {why}"),
            Error::Peer { peer, why } => write!(f, "{peer}: {why}"),
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
    use super::*;

    #[test]
    fn names_the_object_and_the_operation() {
        let e = Error::io("accepting a client", "unix:/run/plyfs.sock")(io::Error::from_raw_os_error(libc::EMFILE));
        let shown = e.to_string();
        assert!(shown.starts_with("unix:/run/plyfs.sock: accepting a client: "), "{shown}");
        assert!(std::error::Error::source(&e).is_some());
        let e = Error::BadKeyFile { path: "/srv/key.psk".into(), why: "not a regular file".into() };
        assert_eq!(String::from(e), "key file /srv/key.psk: not a regular file");
        let e = Error::peer("tcp:10.0.0.1:7000")("the server closed the connection");
        assert_eq!(e.to_string(), "tcp:10.0.0.1:7000: the server closed the connection");
        assert!(!Error::NotAllowed { uid: 7 }.to_string().contains('\n'));
    }
}
