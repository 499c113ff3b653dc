//! The kernel's set-user-ID and set-group-ID rules, for what keeps its own attributes instead of
//! letting a kernel file system apply them: the FUSE front end (on write and truncate, which the
//! kernel leaves to the daemon under `FUSE_HANDLE_KILLPRIV_V2`) and bottom layers that are not a
//! lower directory (exofs).
//!
//! As Linux's `fs/attr.c` (`setattr_prepare`, `setattr_should_drop_sgid`, `notify_change`) and
//! `fs/open.c` (`chown_common`), checked against tmpfs by `crates/cli/tests/adversary_exodisk.rs`:
//! - a write, a truncate or a chown of a non-directory clears set-user-ID, and set-group-ID when
//!   the file is group-executable or its group is not one of the caller's (chown clears them even
//!   for root; write and truncate only for a caller without CAP_FSETID, which the kernel decides);
//! - a chmod by a caller outside the file's group (and not root) drops set-group-ID;
//! - only root gives a file away; its owner may change its group only to one of its own groups.

use crate::{Caller, Error, FileKind, Result, SetAttr};

/// Whether `cx` is in group `gid` (its own or a supplementary one), or is root (the kernel's
/// `in_group_or_capable`). A confined caller (a client `plyfs serve` maps) has the groups the
/// server gave it, and its pid, which a remote client chose, is never looked at; a caller the
/// kernel sent has its process's groups; one without a process (pid 0) only its own group.
pub fn in_group(cx: &Caller, gid: u32) -> bool {
    if cx.gid == gid || cx.uid == 0 {
        return true;
    }
    if let Some(groups) = cx.confined {
        return groups.contains(gid);
    }
    if cx.pid == 0 {
        return false;
    }
    std::fs::read_to_string(format!("/proc/{}/status", cx.pid)).ok().is_some_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("Groups:"))
            .is_some_and(|groups| groups.split_whitespace().any(|g| g.parse() == Ok(gid)))
    })
}

/// `mode` once a change of the file's contents or owner has dropped its privileges: no
/// set-user-ID, and no set-group-ID when group-executable or the caller is not in its group.
pub fn without_privileges(mode: u32, caller_in_group: bool) -> u32 {
    let mut kept = mode & !libc::S_ISUID;
    if mode & libc::S_ISGID != 0 && (mode & libc::S_IXGRP != 0 || !caller_in_group) {
        kept &= !libc::S_ISGID;
    }
    kept
}

/// A file's kind, permission bits and owner, as a setattr finds them.
#[derive(Clone, Copy, Debug)]
pub struct Owned {
    pub kind: FileKind,
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
}

/// The permission bits `set` leaves on `file` when `cx` asks for it (`None`: unchanged), or
/// `EPERM` for a change of owner or group the caller may not make.
pub fn setattr_perm(cx: &Caller, file: Owned, set: &SetAttr) -> Result<Option<u32>> {
    let chown = set.uid.is_some() || set.gid.is_some();
    if cx.uid != 0 {
        if set.uid.is_some_and(|u| u != file.uid) {
            return Err(Error::Os(libc::EPERM));
        }
        if set.gid.is_some_and(|g| g != file.gid && (cx.uid != file.uid || !in_group(cx, g))) {
            return Err(Error::Os(libc::EPERM));
        }
    }
    let mut perm = set.mode.map(|m| m & 0o7777);
    if let Some(m) = perm {
        let gid = set.gid.unwrap_or(file.gid);
        if m & libc::S_ISGID != 0 && !in_group(cx, gid) {
            perm = Some(m & !libc::S_ISGID);
        }
    }
    if chown && file.kind != FileKind::Dir {
        let from = perm.unwrap_or(file.perm);
        let kept = without_privileges(from, in_group(cx, file.gid));
        if kept != from || perm.is_some() {
            perm = Some(kept);
        }
    }
    Ok(perm)
}

#[cfg(test)]
mod tests {
    use super::*;

    const USER: Caller = Caller::new(1000, 1000, u32::MAX);
    const ROOT: Caller = Caller::new(0, 0, u32::MAX);

    fn file(perm: u32, gid: u32) -> Owned {
        Owned { kind: FileKind::File, perm, uid: 1000, gid }
    }

    #[test]
    fn chown_drops_privileges_as_linux_does() {
        let chgrp = SetAttr { gid: Some(1000), ..SetAttr::default() };
        // Even root's chown clears set-user-ID, and set-group-ID of a group-executable file.
        assert_eq!(setattr_perm(&ROOT, file(0o6755, 1000), &chgrp).unwrap(), Some(0o755));
        assert_eq!(setattr_perm(&ROOT, file(0o6745, 1000), &chgrp).unwrap(), Some(0o2745));
        assert_eq!(setattr_perm(&USER, file(0o6755, 1000), &chgrp).unwrap(), Some(0o755));
        // A directory keeps them.
        let dir = Owned { kind: FileKind::Dir, ..file(0o2755, 1000) };
        assert_eq!(setattr_perm(&USER, dir, &chgrp).unwrap(), None);
        // A user gives nothing away, and chooses only its own groups.
        assert!(setattr_perm(&USER, file(0o644, 1000), &SetAttr { uid: Some(0), ..SetAttr::default() }).is_err());
        assert!(setattr_perm(&USER, file(0o644, 1000), &SetAttr { gid: Some(0), ..SetAttr::default() }).is_err());
    }

    #[test]
    fn chmod_g_s_outside_the_group_is_dropped() {
        let chmod = SetAttr { mode: Some(0o2755), ..SetAttr::default() };
        assert_eq!(setattr_perm(&USER, file(0o755, 0), &chmod).unwrap(), Some(0o755));
        assert_eq!(setattr_perm(&USER, file(0o755, 1000), &chmod).unwrap(), Some(0o2755));
        assert_eq!(setattr_perm(&ROOT, file(0o755, 5), &chmod).unwrap(), Some(0o2755));
    }

    #[test]
    fn a_write_keeps_set_group_id_only_without_group_execute_and_in_the_group() {
        assert_eq!(without_privileges(0o6755, true), 0o755);
        assert_eq!(without_privileges(0o6745, true), 0o2745);
        assert_eq!(without_privileges(0o6745, false), 0o745);
    }
}
