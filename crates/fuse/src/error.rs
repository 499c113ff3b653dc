//! The front end's errors: mounting, unmounting and the transports, each naming the mount point
//! (or the device, or the transport) and what was being done, then the cause, on one line.
//!
//! Requests that fail inside the stack answer the kernel with an errno (`plyfs_stack::Error`);
//! this type is for what fails around them.

use std::fmt;
use std::path::PathBuf;

#[derive(Debug)]
pub enum Error {
    /// The mount point cannot take a mount (missing, not a directory, unreadable).
    MountPoint { path: PathBuf, why: String },
    /// Something is mounted at the mount point already.
    MountPointBusy { path: PathBuf, fstype: String },
    /// The mount point holds files a mount would hide.
    MountPointNotEmpty { path: PathBuf },
    /// A `-o` option that is neither plyfs's nor a kernel mount flag.
    UnknownOption { flag: String },
    /// `/dev/fuse` cannot be opened or duplicated.
    Device { why: String },
    /// Mounting failed (`mount(2)`, `fusermount3`, the FUSE handshake).
    Mount { mountpoint: PathBuf, why: String },
    /// Unmounting failed.
    Unmount { mountpoint: PathBuf, why: String },
    /// The kernel refuses passthrough to the lower files: they use FUSE I/O.
    Passthrough { why: String },
    /// FUSE over io_uring cannot be used: the reason, which names the ring or queue, and
    /// requests go through `/dev/fuse`.
    Uring { why: String },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::MountPoint { path, why } => write!(f, "mount point {}: {why}", path.display()),
            Error::MountPointBusy { path, fstype } => write!(f, "mount point {} is busy: {fstype} is already mounted there", path.display()),
            Error::MountPointNotEmpty { path } => {
                write!(f, "mount point {} is not empty: mounting would hide what it holds (-o nonempty mounts over it)", path.display())
            }
            Error::UnknownOption { flag } => write!(f, "unknown mount option '{flag}'"),
            Error::Device { why } => write!(f, "/dev/fuse: {why}"),
            Error::Mount { mountpoint, why } => write!(f, "mount {}: {why}", mountpoint.display()),
            Error::Unmount { mountpoint, why } => write!(f, "unmount {}: {why}", mountpoint.display()),
            Error::Passthrough { why } | Error::Uring { why } => f.write_str(why),
        }
    }
}

impl std::error::Error for Error {}

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_mount_point_and_the_operation() {
        let e = Error::Mount { mountpoint: "/mnt/a".into(), why: "fusermount3: permission denied".into() };
        assert_eq!(String::from(e), "mount /mnt/a: fusermount3: permission denied");
        let e = Error::Unmount { mountpoint: "/mnt/a".into(), why: "not a mount point".into() };
        assert_eq!(e.to_string(), "unmount /mnt/a: not a mount point");
        let e = Error::MountPointBusy { path: "/mnt/a".into(), fstype: "fuse.plyfs".into() };
        assert!(e.to_string().contains("/mnt/a is busy: fuse.plyfs is already mounted there"));
    }
}
