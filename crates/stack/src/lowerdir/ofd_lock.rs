//! The lock a shared mount takes on a lower file (`lower-lock`): an open-file-description lock,
//! which on a network file system also makes the client's view of the file current.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::shared::{LockFile, LockKind};

use super::sys::check;

/// The lock on a lower file: an open-file-description lock on a descriptor of its own.
///
/// On a network file system, taking the lock also makes the client's caches of the file
/// current (the attributes are fetched again, which drops stale pages), and dropping a write
/// lock first pushes what this client wrote to the servers. NFS does both by itself at locks;
/// FUSE clients such as GlusterFS's do not.
///
/// Pushing is not syncing: other mounts need the writes on the servers, not on their disks. The
/// kernel's dirty pages of the file are written back, then its attributes are fetched from the
/// servers, which a client answers only after the writes it holds back reached them (GlusterFS's
/// write-behind orders a stat after every pending write to the file, from any descriptor; NFS
/// flushes at getattr). An `fdatasync` would also wait for the servers' disks (a millisecond
/// per write on GlusterFS), and on GlusterFS it would not even wait for writes made through
/// another descriptor than the lock's.
pub(super) struct OfdLock {
    pub(super) fd: Arc<OwnedFd>,
    pub(super) network: bool,
}

/// Fetch a file's attributes from the servers of a network file system, not from the client's
/// cache: its size, and with it how much of the file the client's reads reach, become current.
pub(super) fn refresh_from_servers(fd: RawFd) -> Result<()> {
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let flags = libc::AT_EMPTY_PATH | libc::AT_STATX_FORCE_SYNC;
    check(unsafe { libc::statx(fd, c"".as_ptr(), flags, libc::STATX_BASIC_STATS, &mut stx) }).map(|_| ())
}

impl OfdLock {
    fn refresh(&self) -> Result<()> {
        refresh_from_servers(self.fd.as_raw_fd())
    }

    fn fcntl(&self, l_type: libc::c_int) -> Result<()> {
        self.fcntl_or_not(l_type, true)
    }

    /// Set the lock, waiting for other processes if `wait`, else failing with `EWOULDBLOCK`.
    fn fcntl_or_not(&self, l_type: libc::c_int, wait: bool) -> Result<()> {
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = l_type as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        let cmd = if wait { libc::F_OFD_SETLKW } else { libc::F_OFD_SETLK };
        loop {
            match check(unsafe { libc::fcntl(self.fd.as_raw_fd(), cmd, &fl) }) {
                Err(Error::Os(libc::EINTR)) => continue,
                Err(Error::Os(libc::EAGAIN | libc::EACCES)) if !wait => return Err(Error::Os(libc::EWOULDBLOCK)),
                other => return other.map(|_| ()),
            }
        }
    }
}

impl LockFile for OfdLock {
    fn take(&self, kind: LockKind, wait: bool) -> Result<()> {
        let l_type = match kind {
            LockKind::Shared => libc::F_RDLCK,
            LockKind::Exclusive => libc::F_WRLCK,
        };
        self.fcntl_or_not(l_type, wait)?;
        if self.network {
            if let Err(e) = self.refresh() {
                let _ = self.fcntl(libc::F_UNLCK);
                return Err(e);
            }
        }
        Ok(())
    }

    fn release(&self, held: LockKind) -> Result<()> {
        let pushed = if self.network && held == LockKind::Exclusive {
            let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            check(unsafe { libc::sync_file_range(self.fd.as_raw_fd(), 0, 0, flags) }).and_then(|_| self.refresh())
        } else {
            Ok(())
        };
        let unlocked = self.fcntl(libc::F_UNLCK);
        pushed.and(unlocked)
    }
}
