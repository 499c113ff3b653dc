//! Each operation, answered with system calls on the lower directory: the one place where an
//! [`Op`] becomes a system call.

use std::ffi::OsStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::layer::unsupported;
use crate::op::{Op, Reply};
use crate::types::*;

use super::{DirStream, LowerDir};
use super::sys::{check, check_size, cstr, fd_path, fstat, proc_path};

/// The lower lock's file (see [`crate::lowerlock`]) is not there for anyone above: looking it
/// up or removing it finds nothing, and making or renaming anything to its name is refused.
fn hide_lock_file(op: &Op<'_>) -> Result<()> {
    let at_top = |parent: NodeId, name: &OsStr| parent == NodeId::ROOT && crate::lowerlock::is_lock_file(name);
    match *op {
        Op::Lookup { parent, name } | Op::Unlink { parent, name } | Op::RmDir { parent, name } if at_top(parent, name) => {
            Err(Error::Os(libc::ENOENT))
        }
        Op::Rename { parent, name, .. } if at_top(parent, name) => Err(Error::Os(libc::ENOENT)),
        Op::MkNod { parent, name, .. }
        | Op::MkDir { parent, name, .. }
        | Op::SymLink { parent, name, .. }
        | Op::Create { parent, name, .. }
        | Op::Rename { new_parent: parent, new_name: name, .. }
        | Op::Link { new_parent: parent, new_name: name, .. }
            if at_top(parent, name) =>
        {
            Err(Error::Os(libc::EPERM))
        }
        _ => Ok(()),
    }
}

impl LowerDir {
    /// For a confined caller: the directories `op` names must still be inside the lower
    /// directory. One moved out of it while a client held it is `ESTALE`, as is its `..`.
    /// (A file with another name outside the tree cannot be told from one inside, so files are
    /// not checked; the caller's own rights still apply to them.)
    pub(super) fn check_within_export(&self, op: &Op<'_>) -> Result<()> {
        if let Op::Forget { .. } = op {
            return Ok(());
        }
        let mut named = vec![op.node()];
        if let Op::Rename { new_parent, .. } | Op::Link { new_parent, .. } = *op {
            named.push(new_parent);
        }
        let mut root: Option<Vec<u8>> = None;
        for id in named {
            let n = self.node(id)?;
            if n.kind != FileKind::Dir || n.key == self.root_key {
                continue;
            }
            let root = match &root {
                Some(r) => r,
                None => root.insert(fd_path(self.node(NodeId::ROOT)?.fd.as_raw_fd())?),
            };
            let path = fd_path(n.fd.as_raw_fd())?;
            let inside = path.len() > root.len() && path.starts_with(root) && (path[root.len()] == b'/' || root == b"/");
            if !inside || path.ends_with(b" (deleted)") {
                return Err(Error::Os(libc::ESTALE));
            }
        }
        Ok(())
    }

    pub(super) fn dispatch(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        crate::readonly::check(op)?;
        hide_lock_file(op)?;
        let empty = c"";
        match *op {
            Op::Lookup { parent, name } => {
                let parent = self.node(parent)?;
                // `..` of the lower root is outside the tree this layer owns.
                if name == ".." && parent.key == self.root_key {
                    return Err(Error::Os(libc::EPERM));
                }
                self.lookup_at(&parent, name).map(Reply::Entry)
            }
            Op::Forget { node, nlookup } => {
                if self.forget(node, nlookup) {
                    self.locks.forget(node);
                }
                Ok(Reply::Empty)
            }
            Op::GetAttr { node, fh } => {
                let st = match fh.and_then(|fh| self.file(fh).ok()) {
                    Some(file) => fstat(file.as_raw_fd())?,
                    None => fstat(self.node(node)?.fd.as_raw_fd())?,
                };
                Ok(Reply::Attr(Self::attr(&st)))
            }
            Op::SetAttr { node, fh, ref set } => self.setattr(node, fh, set).map(Reply::Attr),
            Op::ReadLink { node } => {
                let n = self.node(node)?;
                let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
                let len = check_size(unsafe {
                    libc::readlinkat(n.fd.as_raw_fd(), empty.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
                })?;
                buf.truncate(len);
                Ok(Reply::Data(buf))
            }
            Op::MkNod { parent, name, mode, rdev } => self
                .make_node(cx, parent, name, |pfd, c| unsafe { libc::mknodat(pfd, c.as_ptr(), mode, rdev.into()) })
                .map(Reply::Entry),
            Op::MkDir { parent, name, mode } => self
                .make_node(cx, parent, name, |pfd, c| unsafe { libc::mkdirat(pfd, c.as_ptr(), mode) })
                .map(Reply::Entry),
            Op::SymLink { parent, name, target } => {
                let target = cstr(target.as_os_str())?;
                self.make_node(cx, parent, name, |pfd, c| unsafe { libc::symlinkat(target.as_ptr(), pfd, c.as_ptr()) })
                    .map(Reply::Entry)
            }
            Op::Unlink { parent, name } => {
                let (p, name) = (self.node(parent)?, cstr(name)?);
                self.pin_victim(&p, &name);
                check(unsafe { libc::unlinkat(p.fd.as_raw_fd(), name.as_ptr(), 0) })?;
                Ok(Reply::Empty)
            }
            Op::RmDir { parent, name } => {
                let (p, name) = (self.node(parent)?, cstr(name)?);
                self.pin_victim(&p, &name);
                check(unsafe { libc::unlinkat(p.fd.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) })?;
                Ok(Reply::Empty)
            }
            Op::Rename { parent, name, new_parent, new_name, flags } => {
                let (p, np) = (self.node(parent)?, self.node(new_parent)?);
                let (from, to) = (cstr(name)?, cstr(new_name)?);
                if flags & libc::RENAME_EXCHANGE == 0 {
                    self.pin_victim(&np, &to);
                }
                check(unsafe {
                    libc::renameat2(p.fd.as_raw_fd(), from.as_ptr(), np.fd.as_raw_fd(), to.as_ptr(), flags)
                })?;
                Ok(Reply::Empty)
            }
            Op::Link { node, new_parent, new_name } => {
                let (n, np) = (self.node(node)?, self.node(new_parent)?);
                let to = cstr(new_name)?;
                // linkat(AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH; the /proc path does not.
                check(unsafe {
                    libc::linkat(
                        libc::AT_FDCWD,
                        proc_path(n.fd.as_raw_fd()).as_ptr(),
                        np.fd.as_raw_fd(),
                        to.as_ptr(),
                        libc::AT_SYMLINK_FOLLOW,
                    )
                })?;
                self.lookup_at(&np, new_name).map(Reply::Entry)
            }
            Op::Open { node, flags } => {
                let n = self.node(node)?;
                // The kernel resolved the path (O_NOFOLLOW included) before it sent the open;
                // reopening through the /proc link with O_NOFOLLOW would fail with ELOOP.
                let flags = (flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_NOCTTY | libc::O_DIRECT | libc::O_NOFOLLOW)) | libc::O_CLOEXEC;
                let fd = check(unsafe { libc::open(proc_path(n.fd.as_raw_fd()).as_ptr(), flags) })?;
                let opened = self.register_file(unsafe { OwnedFd::from_raw_fd(fd) }, flags)?;
                self.note_open_rw(node, flags, &opened);
                Ok(Reply::Opened(opened))
            }
            Op::Create { parent, name, mode, flags } => {
                let p = self.node(parent)?;
                let c = cstr(name)?;
                let flags = (flags & !(libc::O_NOCTTY | libc::O_DIRECT)) | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW;
                let pfd = p.fd.as_raw_fd();
                let file = self.create_as(
                    cx,
                    &p,
                    || Ok(unsafe { OwnedFd::from_raw_fd(check(libc::openat(pfd, c.as_ptr(), flags, mode))?) }),
                    |fd| fd.as_raw_fd(),
                )?;
                // The node's descriptor is opened through the new file's /proc link, not by
                // name: the same file for sure, and no second lookup in the lower directory
                // (a round trip to the servers on a network file system).
                let path_fd = check(unsafe { libc::open(proc_path(file.as_raw_fd()).as_ptr(), libc::O_PATH | libc::O_CLOEXEC) })?;
                let entry = self.remember(unsafe { OwnedFd::from_raw_fd(path_fd) })?;
                let opened = self.register_file(file, flags)?;
                self.note_open_rw(entry.node, flags, &opened);
                Ok(Reply::Created(entry, opened))
            }
            Op::Read { fh, offset, size, .. } => {
                let file = self.file(fh)?;
                // Read into uninitialised capacity: zeroing a buffer the read then overwrites
                // costs as much as a small read itself.
                let mut buf: Vec<u8> = Vec::with_capacity(size as usize);
                while buf.len() < size as usize {
                    let spare = buf.spare_capacity_mut();
                    let at = offset + (size as usize - spare.len()) as u64;
                    let n = check_size(unsafe { libc::pread(file.as_raw_fd(), spare.as_mut_ptr().cast(), spare.len(), at as i64) })?;
                    if n == 0 {
                        break;
                    }
                    // SAFETY: pread initialised the first n bytes of the spare capacity.
                    unsafe { buf.set_len(buf.len() + n) };
                }
                Ok(Reply::Data(buf))
            }
            Op::Write { fh, offset, data, .. } => {
                let file = self.file(fh)?;
                // (Appenders exist only over a network file system: a local lower's writes
                // take no lock for it.)
                let done = if self.flush_on_close && self.appenders.lock().contains(&fh.0) {
                    self.append_locked(file, data)?
                } else {
                    Self::write_all_at(file.as_raw_fd(), data, offset)?
                };
                Ok(Reply::Written(done as u32))
            }
            Op::Flush { fh, .. } => {
                // Closing a duplicate reports errors a close would (NFS, quota) at close time.
                let file = self.file(fh)?;
                let dup = check(unsafe { libc::dup(file.as_raw_fd()) })?;
                check(unsafe { libc::close(dup) })?;
                Ok(Reply::Empty)
            }
            Op::Fsync { fh, datasync, .. } => {
                let file = self.file(fh)?;
                check(unsafe { if datasync { libc::fdatasync(file.as_raw_fd()) } else { libc::fsync(file.as_raw_fd()) } })?;
                Ok(Reply::Empty)
            }
            Op::Release { fh, .. } => {
                self.files.lock().remove(&fh.0);
                if self.flush_on_close {
                    self.appenders.lock().remove(&fh.0);
                }
                Ok(Reply::Empty)
            }
            Op::OpenDir { node } => {
                let n = self.node(node)?;
                if n.kind != FileKind::Dir {
                    return Err(Error::Os(libc::ENOTDIR));
                }
                let fh = self.new_fh();
                self.dirs.lock().insert(fh, Arc::new(Mutex::new(DirStream { entries: Vec::new() })));
                Ok(Reply::Opened(Opened { fh: FileHandle(fh), backing: None, direct_io: false, flush_on_close: false }))
            }
            Op::ReadDir { node, fh, offset, max_entries, plus } => {
                self.readdir(node, fh, offset, max_entries, plus).map(Reply::Dir)
            }
            Op::ReleaseDir { fh, .. } => {
                self.dirs.lock().remove(&fh.0);
                Ok(Reply::Empty)
            }
            Op::FsyncDir { node, datasync, .. } => {
                let n = self.node(node)?;
                let fd = check(unsafe { libc::open(proc_path(n.fd.as_raw_fd()).as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) })?;
                let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                check(unsafe { if datasync { libc::fdatasync(fd.as_raw_fd()) } else { libc::fsync(fd.as_raw_fd()) } })?;
                Ok(Reply::Empty)
            }
            Op::StatFs { node } => {
                let n = self.node(node)?;
                let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
                check(unsafe { libc::fstatvfs(n.fd.as_raw_fd(), &mut st) })?;
                Ok(Reply::StatFs(StatFs {
                    blocks: st.f_blocks,
                    bfree: st.f_bfree,
                    bavail: st.f_bavail,
                    files: st.f_files,
                    ffree: st.f_ffree,
                    bsize: st.f_bsize as u32,
                    namelen: st.f_namemax as u32,
                    frsize: st.f_frsize as u32,
                }))
            }
            Op::Access { node, mask } => {
                let n = self.node(node)?;
                check(unsafe { libc::faccessat(libc::AT_FDCWD, proc_path(n.fd.as_raw_fd()).as_ptr(), mask, 0) })?;
                Ok(Reply::Empty)
            }
            // Through `/proc/self/fd/N`, which (unlike a path) names a symlink itself when the
            // descriptor is one: the kernel then allows what it allows on symlinks (`trusted.*`,
            // `security.*`; `user.*` is refused, as on any file system).
            Op::GetXattr { node, name, size } => {
                let n = self.node(node)?;
                let (path, name) = (proc_path(n.fd.as_raw_fd()), cstr(name)?);
                Self::xattr_reply(size, |buf, len| unsafe { libc::getxattr(path.as_ptr(), name.as_ptr(), buf, len) })
                    .map(Reply::Xattr)
            }
            Op::ListXattr { node, size } => {
                let n = self.node(node)?;
                let path = proc_path(n.fd.as_raw_fd());
                Self::xattr_reply(size, |buf, len| unsafe { libc::listxattr(path.as_ptr(), buf.cast(), len) })
                    .map(Reply::Xattr)
            }
            Op::SetXattr { node, name, value, flags } => {
                let n = self.node(node)?;
                let (path, name) = (proc_path(n.fd.as_raw_fd()), cstr(name)?);
                check(unsafe { libc::setxattr(path.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), flags) })?;
                Ok(Reply::Empty)
            }
            Op::RemoveXattr { node, name } => {
                let n = self.node(node)?;
                let (path, name) = (proc_path(n.fd.as_raw_fd()), cstr(name)?);
                check(unsafe { libc::removexattr(path.as_ptr(), name.as_ptr()) })?;
                Ok(Reply::Empty)
            }
            Op::Fallocate { fh, offset, length, mode, .. } => {
                let file = self.file(fh)?;
                check(unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as i64, length as i64) })?;
                Ok(Reply::Empty)
            }
            Op::Ioctl { node, fh, cmd, data, out_size } => self.ioctl(node, fh, cmd, data, out_size).map(Reply::Data),
            Op::Lseek { fh, offset, whence, .. } => {
                let file = self.file(fh)?;
                let pos = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
                if pos < 0 {
                    return Err(Error::last_os());
                }
                Ok(Reply::Offset(pos as u64))
            }
            Op::Extended { node, name: "lower-info", .. } => self.lower_info(node).map(Reply::Extended),
            Op::Extended { node, name: crate::shared::LOCK_OP, args } => self.lower_lock(node, args),
            Op::Extended { node, name: "lower-sync", .. } => {
                let n = self.node(node)?;
                let fd = check(unsafe { libc::open(proc_path(n.fd.as_raw_fd()).as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) })?;
                let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                check(unsafe { libc::syncfs(fd.as_raw_fd()) })?;
                Ok(Reply::Extended(serde_json::json!({ "synced": self.root.display().to_string() })))
            }
            Op::Extended { .. } => Err(unsupported(op)),
        }
    }
}
