//! The stack's error type. Every error maps to an errno at the FUSE boundary, and prints as one
//! line that names the cause.

use std::fmt;
use std::io;

#[derive(Debug)]
pub enum Error {
    /// A system error from the lower file system or the kernel.
    Os(i32),
    /// An extended operation that no layer in the stack handles. `layers` are the levels it
    /// went through; `handled_below` the addresses (`OP@NAME`) of levels below a fan-out layer,
    /// which it does not reach by itself, that would handle it.
    UnsupportedOp { op: String, layers: Vec<String>, handled_below: Vec<String> },
    /// A stack specification, layer parameter or configuration file that cannot be used.
    Config(String),
    /// Something a layer found wrong with stored data (corrupt, inconsistent): reads as EIO.
    Corrupt(String),
    /// A bad argument to an extended operation.
    BadArgs(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn errno(&self) -> i32 {
        match self {
            Error::Os(e) => *e,
            Error::UnsupportedOp { .. } => libc::EOPNOTSUPP,
            Error::Config(_) | Error::BadArgs(_) => libc::EINVAL,
            Error::Corrupt(_) => libc::EIO,
        }
    }

    /// The error of the last failed system call.
    pub fn last_os() -> Error {
        Error::Os(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO))
    }

    pub fn config(msg: impl Into<String>) -> Error {
        Error::Config(msg.into())
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Error {
        Error::Os(e.raw_os_error().unwrap_or(libc::EIO))
    }
}

impl From<nix::errno::Errno> for Error {
    fn from(e: nix::errno::Errno) -> Error {
        Error::Os(e as i32)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Os(e) => write!(f, "{}", io::Error::from_raw_os_error(*e)),
            Error::UnsupportedOp { op, layers, handled_below } => {
                write!(f, "unsupported operation '{op}': no layer of the stack ({}) handles it", layers.join(", "))?;
                match handled_below.as_slice() {
                    [] => Ok(()),
                    [one] => write!(f, "; a level below a fan-out layer does: {one}"),
                    several => write!(f, "; levels below a fan-out layer do, each for itself: {}", several.join(", ")),
                }
            }
            Error::Config(m) | Error::Corrupt(m) | Error::BadArgs(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}
