//! The errors of putting a stack together and running it. Each prints as one line that names
//! what it is about (a directory, a file inside a stack, an address) and the cause.

use std::fmt;
use std::path::PathBuf;

#[derive(Debug)]
pub enum Error {
    /// A directory or file the command was given cannot be used: `WHAT PATH: cause` ("lower
    /// directory /srv/a: not a directory").
    Path { what: String, path: PathBuf, cause: String },
    /// The stack as given (its layers, branches, rules, LOWER) cannot be built.
    Spec(String),
    /// A directory the stack stores in is in use by a mount or tool it would corrupt, or the
    /// reverse.
    InUse(String),
    /// A mount point inside a directory the stack stores in, or the reverse.
    Nested(String),
    /// An object inside the stack, met by an offline tool: `PATH: what was done: cause`.
    File { path: PathBuf, op: &'static str, cause: String },
    /// Something of this process that failed while it ran: a mount, a server, a listener.
    Run(String),
    /// An error of a crate below (transport, layers, exodisk, exofs), which names its object
    /// itself.
    Below(Box<dyn std::error::Error + Send + Sync>),
    /// A message from a crate that reports its errors in words.
    Msg(String),
}

impl Error {
    pub fn path(what: impl Into<String>, path: impl Into<PathBuf>, cause: impl fmt::Display) -> Error {
        Error::Path { what: what.into(), path: path.into(), cause: cause.to_string() }
    }

    pub fn file(path: impl Into<PathBuf>, op: &'static str, cause: impl fmt::Display) -> Error {
        Error::File { path: path.into(), op, cause: cause.to_string() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Path { what, path, cause } if what.is_empty() => write!(f, "{}: {cause}", path.display()),
            Error::Path { what, path, cause } => write!(f, "{what} {}: {cause}", path.display()),
            Error::File { path, op, cause } => write!(f, "{}: {op}: {cause}", path.display()),
            Error::Spec(m) | Error::InUse(m) | Error::Nested(m) | Error::Run(m) | Error::Msg(m) => f.write_str(m),
            Error::Below(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Below(e) => e.source(),
            _ => None,
        }
    }
}

macro_rules! from_below {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Error {
                Error::Below(Box::new(e))
            }
        }
    )*};
}

from_below!(plyfs_transport::Error, plyfs_layers::Error, plyfs_exodisk::Error, plyfs_exofs::Error, plyfs_fuse::Error);

impl From<String> for Error {
    fn from(m: String) -> Error {
        Error::Msg(m)
    }
}

impl From<&str> for Error {
    fn from(m: &str) -> Error {
        Error::Msg(m.to_owned())
    }
}

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn each_error_is_one_line_naming_its_object() {
        assert_eq!(Error::path("lower directory", "/srv/a", "not a directory").to_string(), "lower directory /srv/a: not a directory");
        assert_eq!(Error::path("", "/srv/a", "gone").to_string(), "/srv/a: gone");
        let e = Error::file("docs/a.txt", "reading", "Input/output error (os error 5)");
        assert_eq!(e.to_string(), "docs/a.txt: reading: Input/output error (os error 5)");
        assert!(!e.to_string().contains('\n'));
    }
}
