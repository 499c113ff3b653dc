//! The system calls the bottom layer makes, wrapped: errors as [`Error`], paths of descriptors,
//! file handles, capabilities and the open-files limit, and the caller's fsuid for a creation.

use std::ffi::{CString, OsStr};
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::types::*;

pub(super) const CAP_DAC_READ_SEARCH: u32 = 2;

/// Whether this process has capability number `cap` in its effective set.
pub fn has_capability(cap: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|h| u64::from_str_radix(h.trim(), 16).ok()))
        .is_some_and(|caps| caps & (1 << cap) != 0)
}

pub(super) fn open_files_limit() -> libc::rlimit {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    lim
}

/// The `struct file_handle` of the object `fd` refers to, in a buffer aligned for the kernel.
pub(super) fn handle_of(fd: RawFd) -> Option<Box<[u64]>> {
    let header = std::mem::size_of::<libc::file_handle>();
    let mut buf = vec![0u64; (header + libc::MAX_HANDLE_SZ as usize).div_ceil(8)];
    let fh = buf.as_mut_ptr() as *mut libc::file_handle;
    let mut mount_id = 0;
    unsafe { (*fh).handle_bytes = libc::MAX_HANDLE_SZ as u32 };
    let rc = unsafe { libc::name_to_handle_at(fd, c"".as_ptr(), fh, &mut mount_id, libc::AT_EMPTY_PATH) };
    if rc != 0 {
        return None;
    }
    let len = header + unsafe { (*fh).handle_bytes } as usize;
    buf.truncate(len.div_ceil(8));
    Some(buf.into_boxed_slice())
}

/// Raise this process's open-files limit as far as it may go, and return the new soft limit.
///
/// The bottom layer holds one descriptor per node the kernel remembers, so a daemon serving a
/// large tree needs many more than the usual soft limit of 1024.
pub fn raise_fd_limit() -> u64 {
    let lim = open_files_limit();
    // Above the hard limit needs CAP_SYS_RESOURCE; try the kernel's ceiling, then settle.
    let ceiling = std::fs::read_to_string("/proc/sys/fs/nr_open").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(lim.rlim_max);
    for target in [ceiling.max(lim.rlim_max), lim.rlim_max] {
        let want = libc::rlimit { rlim_cur: target, rlim_max: target };
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            return target;
        }
    }
    lim.rlim_cur
}

/// File systems whose `close` can fail or publishes data to other clients.
pub(super) fn reports_at_close(fs_type: i64) -> bool {
    const NETWORK_FS: &[i64] = &[
        0x6969,              // NFS
        0x517B,              // SMB
        0xFF53_4D42,         // CIFS
        0xFE53_4D42,         // SMB2
        0x6573_5546,         // FUSE
        0x0102_1997,         // 9P
        0x00C3_6400,         // Ceph
        0x6B41_4653,         // AFS
        0x0BD0_0BD0,         // Lustre
        0x0116_1970,         // GFS2
        0x7461_636F,         // OCFS2
    ];
    NETWORK_FS.contains(&fs_type)
}

pub(super) fn cstr(name: &OsStr) -> Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| Error::Os(libc::EINVAL))
}

pub(super) fn check(ret: libc::c_int) -> Result<libc::c_int> {
    if ret < 0 {
        Err(Error::last_os())
    } else {
        Ok(ret)
    }
}

pub(super) fn check_size(ret: libc::ssize_t) -> Result<usize> {
    if ret < 0 {
        Err(Error::last_os())
    } else {
        Ok(ret as usize)
    }
}

/// The `/proc/self/fd/N` path of a descriptor, for calls that have no `*at` form taking
/// `AT_EMPTY_PATH`.
pub(super) fn proc_path(fd: RawFd) -> CString {
    CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL in a number")
}

/// Where the kernel says `fd` is now, in this process's view of the file systems.
pub(super) fn fd_path(fd: RawFd) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    let len = check_size(unsafe { libc::readlink(proc_path(fd).as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
    buf.truncate(len);
    Ok(buf)
}

pub(super) fn fstat(fd: RawFd) -> Result<libc::stat> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let empty = c"";
    check(unsafe { libc::fstatat(fd, empty.as_ptr(), &mut st, libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

pub(super) fn timespec(t: Option<TimeSet>) -> libc::timespec {
    match t {
        None => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
        Some(TimeSet::Now) => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
        Some(TimeSet::At(t)) => {
            let (secs, nanos) = unix_time(t);
            libc::timespec { tv_sec: secs, tv_nsec: i64::from(nanos) }
        }
    }
}

/// Sets the thread's fsuid/fsgid to the caller's for the guard's life. fsuid is per thread on
/// Linux, so other requests are unaffected.
pub(super) struct FsCreds;

impl FsCreds {
    pub(super) fn assume(uid: u32, gid: u32) -> FsCreds {
        unsafe {
            libc::setfsgid(gid);
            libc::setfsuid(uid);
        }
        FsCreds
    }
}

impl Drop for FsCreds {
    fn drop(&mut self) {
        unsafe {
            libc::setfsuid(0);
            libc::setfsgid(0);
        }
    }
}

pub(super) fn kind_of(t: nix::dir::Type) -> FileKind {
    use nix::dir::Type;
    match t {
        Type::Fifo => FileKind::Fifo,
        Type::CharacterDevice => FileKind::CharDevice,
        Type::Directory => FileKind::Dir,
        Type::BlockDevice => FileKind::BlockDevice,
        Type::File => FileKind::File,
        Type::Symlink => FileKind::Symlink,
        Type::Socket => FileKind::Socket,
    }
}

/// chmod of what the `O_PATH` descriptor `fd` names, which must not be a symlink (the callers
/// refuse those first): `fchmodat2` with `AT_EMPTY_PATH` (Linux 6.6), which costs no walk of
/// `/proc/self/fd/N`; on an older kernel the first call gets ENOSYS, and the `/proc` path
/// serves from then on.
pub(super) fn chmod_fd(fd: RawFd, mode: libc::mode_t) -> libc::c_int {
    // The same number on every architecture: Linux numbers its system calls alike on all of
    // them from 424 on.
    const SYS_FCHMODAT2: libc::c_long = 452;
    static NO_FCHMODAT2: AtomicBool = AtomicBool::new(false);
    if !NO_FCHMODAT2.load(Ordering::Relaxed) {
        let ret = unsafe { libc::syscall(SYS_FCHMODAT2, fd, c"".as_ptr(), mode, libc::AT_EMPTY_PATH) };
        if ret >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOSYS) {
            return ret as libc::c_int;
        }
        NO_FCHMODAT2.store(true, Ordering::Relaxed);
    }
    unsafe { libc::chmod(proc_path(fd).as_ptr(), mode) }
}
