//! Unmounting a plyfs mount, and cleaning up after a daemon that died.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use plyfs_fuse::{control, mountinfo, unmount, Unmounted};

use crate::Error;

/// What [`umount`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Umounted {
    /// Unmounted; the daemon has finished.
    Done,
    /// Detached (`lazy`): the daemon exits when the last open file is closed.
    Lazily,
    /// The daemon had died: its stale mount (detached lazily, or not) and control socket are
    /// gone.
    Stale { lazily: bool },
}

/// The absolute form of a mount point, without looking through it (a stale mount cannot be
/// looked through).
pub fn mountpoint_path(path: &Path) -> crate::Result<PathBuf> {
    let abs = std::path::absolute(path).map_err(|e| Error::path("", path, e))?;
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => {
            let parent = parent.canonicalize().map_err(|e| Error::path("", parent, e))?;
            Ok(parent.join(name))
        }
        _ => Ok(abs),
    }
}

/// Unmount the plyfs mount at `path` (`lazy`: detach it now even if files are open). A mount
/// whose daemon died is cleaned up too. Without `lazy`, returns once the daemon has finished
/// (flushed its logs and removed its socket), or after 10 s.
pub fn umount(path: &Path, lazy: bool) -> crate::Result<Umounted> {
    let mountpoint = mountpoint_path(path)?;
    let entry = mountinfo::mount_at(&mountpoint).ok_or_else(|| Error::path("", &mountpoint, "not mounted"))?;
    if !entry.is_plyfs() {
        return Err(Error::path("", &mountpoint, format!("not a plyfs mount (it is {})", entry.fstype)));
    }
    // A dead daemon's mount answers ENOTCONN; when its requests went over io_uring, ECONNABORTED,
    // or ECANCELED while the kernel is still taking its rings down.
    // None: the runtime directory is not one the mount's owner could have used (its socket
    // cannot be there).
    let socket = control::socket_path(entry.user_id.unwrap_or(0), &mountpoint).ok();
    // The kernel may still answer a stat of the root from its cache; a control socket nobody
    // listens on tells of a dead daemon too.
    let unanswered = socket.as_ref().is_some_and(|s| s.exists() && std::os::unix::net::UnixStream::connect(s).is_err());
    let stale = unanswered
        || matches!(std::fs::metadata(&mountpoint),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED)));
    let done = unmount(&mountpoint, lazy)?;
    if stale {
        if let Some(socket) = &socket {
            let _ = std::fs::remove_file(socket);
        }
        return Ok(Umounted::Stale { lazily: done == Unmounted::Lazily });
    }
    if done == Unmounted::Lazily {
        return Ok(Umounted::Lazily);
    }
    if let (false, Some(socket)) = (lazy, &socket) {
        // Return once the daemon has finished (flushed its logs and removed its socket).
        let deadline = Instant::now() + Duration::from_secs(10);
        while socket.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(Umounted::Done)
}
