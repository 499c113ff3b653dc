//! Running an operation as its caller: the thread's file-system ids and supplementary groups.
//!
//! A caller that nobody checked before the stack (a client that `plyfs serve` maps to an
//! identity, see [`crate::Caller::confined`]) has each of its operations run by the bottom layer
//! with the caller's fsuid, fsgid and groups. The kernel then applies its own rules, exactly as
//! for a local process: permission bits, ACLs and supplementary groups, the sticky bit,
//! `protected_hardlinks`, who may chown and chgrp, and clearing set-user-ID and set-group-ID
//! bits. With an fsuid other than 0 the kernel drops the file-system capabilities
//! (CAP_CHOWN, CAP_MKNOD, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_FSETID) from
//! the thread, and gives them back when it returns to 0.
//!
//! All three are per thread at the system-call level. glibc's `setgroups()` changes every
//! thread of the process, so the groups are set with the raw system call.

use crate::error::{Error, Result};

/// The thread runs as a caller until this is dropped; then as it ran before.
pub(crate) struct RunAs {
    fsuid: u32,
    fsgid: u32,
    groups: Vec<u32>,
}

impl RunAs {
    /// Run as `uid`, `gid` and `groups`. Fails closed: if the thread does not hold the ids
    /// afterwards, nothing runs.
    pub(crate) fn caller(uid: u32, gid: u32, groups: &[u32]) -> Result<RunAs> {
        let saved = RunAs { fsuid: fsuid_now(), fsgid: fsgid_now(), groups: groups_now()? };
        set_groups(groups)?;
        unsafe {
            libc::setfsgid(gid);
            libc::setfsuid(uid);
        }
        // Dropping `saved` on a failure below puts the thread back as it was.
        if fsuid_now() != uid || fsgid_now() != gid {
            return Err(Error::Os(libc::EPERM));
        }
        Ok(saved)
    }

    /// Run as the daemon (fsuid 0, with its capabilities) for a step that is the daemon's own,
    /// not the caller's: reopening a node by handle, which needs CAP_DAC_READ_SEARCH.
    pub(crate) fn daemon_step() -> DaemonStep {
        let fsuid = unsafe { libc::setfsuid(0) } as u32;
        DaemonStep { fsuid }
    }
}

impl Drop for RunAs {
    fn drop(&mut self) {
        unsafe {
            libc::setfsuid(self.fsuid);
            libc::setfsgid(self.fsgid);
        }
        // Cannot fail for a list the thread held a moment ago, with fsuid back to the daemon's.
        let _ = set_groups(&self.groups);
    }
}

/// See [`RunAs::daemon_step`].
pub(crate) struct DaemonStep {
    fsuid: u32,
}

impl Drop for DaemonStep {
    fn drop(&mut self) {
        unsafe { libc::setfsuid(self.fsuid) };
    }
}

fn fsuid_now() -> u32 {
    // setfsuid(-1) changes nothing and answers the current fsuid.
    unsafe { libc::setfsuid(u32::MAX) as u32 }
}

fn fsgid_now() -> u32 {
    unsafe { libc::setfsgid(u32::MAX) as u32 }
}

fn groups_now() -> Result<Vec<u32>> {
    let n = unsafe { libc::syscall(libc::SYS_getgroups, 0, std::ptr::null_mut::<libc::gid_t>()) };
    if n < 0 {
        return Err(Error::last_os());
    }
    let mut groups = vec![0u32; n as usize];
    let n = unsafe { libc::syscall(libc::SYS_getgroups, groups.len(), groups.as_mut_ptr()) };
    if n < 0 {
        return Err(Error::last_os());
    }
    groups.truncate(n as usize);
    Ok(groups)
}

fn set_groups(groups: &[u32]) -> Result<()> {
    if unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) } < 0 {
        return Err(Error::last_os());
    }
    Ok(())
}
