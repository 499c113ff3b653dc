//! Kernel passthrough references (`FUSE_DEV_IOC_BACKING_OPEN`): the lower file the kernel reads
//! and writes itself for an open that takes the fast path, and the table of them by inode.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Weak};

/// A kernel passthrough reference to a lower file (`FUSE_DEV_IOC_BACKING_OPEN`), closed when
/// the last open of its inode is released.
pub(crate) struct Backing {
    dev: Arc<OwnedFd>,
    pub(crate) id: u32,
}

// _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t).
pub(crate) const BACKING_OPEN: libc::c_ulong = 0x4010_e501;
pub(crate) const BACKING_CLOSE: libc::c_ulong = 0x4004_e502;

#[repr(C)]
pub(crate) struct BackingMap {
    pub fd: i32,
    pub flags: u32,
    pub padding: u64,
}

impl Backing {
    pub(super) fn open(dev: &Arc<OwnedFd>, file: &OwnedFd) -> std::io::Result<Backing> {
        let map = BackingMap { fd: file.as_raw_fd(), flags: 0, padding: 0 };
        let id = unsafe { libc::ioctl(dev.as_raw_fd(), BACKING_OPEN, &map) };
        if id <= 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Backing { dev: dev.clone(), id: id as u32 })
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        // Fails harmlessly once the connection is gone, which closes every backing file.
        unsafe { libc::ioctl(self.dev.as_raw_fd(), BACKING_CLOSE, &self.id) };
    }
}

/// Kernel passthrough references, one per inode while any open of it lives.
#[derive(Default)]
pub(super) struct BackingTable {
    pub(super) by_inode: HashMap<u64, Weak<Backing>>,
    pub(super) by_open: HashMap<(u64, u64), Arc<Backing>>,
    /// The lower file of each open that goes through passthrough, for `copy_file_range`.
    pub(super) files: HashMap<(u64, u64), Arc<OwnedFd>>,
    /// The passthrough opens for writing, and how many each inode has: while an inode has one,
    /// its attributes are given without a timeout (see [`FuseFs::attr_ttl`]).
    pub(super) writable_opens: HashSet<(u64, u64)>,
    pub(super) writers: HashMap<u64, u32>,
}

/// Whether this process may register passthrough files (`FUSE_DEV_IOC_BACKING_OPEN` needs
/// CAP_SYS_ADMIN).
pub(super) fn have_cap_sys_admin() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    plyfs_stack::has_capability(CAP_SYS_ADMIN)
}
