//! The requests, one handler each, as the transports call them: plain arguments in, plain
//! answers out ([`NodeOut`], [`OpenOut`], ...), each entering the stack as one [`Op`].

use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use plyfs_stack::{Caller, Error, FileHandle, FileKind, Level, NodeId, Op, Reply, SetAttr, StatFs, XattrReply};

use super::inode::{pack_ino, unpack_ino, LEVELS_DIR_INO};
use super::{blank, errno, expect, fopen, DirSink, FuseFs, NodeOut, OpenOut, RequestOn, Res};

/// The requests, one method each, as the transports call them.
impl FuseFs {
    pub(crate) fn lookup(&self, cx: &Caller, parent: u64, name: &OsStr) -> Res<NodeOut> {
        if self.is_levels_dir_name(parent, name) {
            self.may_fan_in(cx)?;
            return Ok(self.levels_dir_attr());
        }
        if parent == LEVELS_DIR_INO || unpack_ino(parent).0 != 0 {
            self.may_fan_in(cx)?;
        }
        if parent == LEVELS_DIR_INO {
            let Some((view, level)) = name.to_str().and_then(|n| self.stack.view_named(n)).and_then(|v| Some((v, self.stack.view(v)?))) else {
                return Err(libc::ENOENT);
            };
            // The kernel will forget this root like any looked-up node; take the lookup that
            // forget will drop.
            let request = RequestOn::new("lookup", &level, NodeId::ROOT);
            return expect(level.call(cx, &Op::GetAttr { node: NodeId::ROOT, fh: None }), request, |r| match r {
                Reply::Attr(attr) => Some(Self::node_out(view, plyfs_stack::Entry { node: NodeId::ROOT, attr, generation: 0 })),
                _ => None,
            });
        }
        let (level, view, node) = self.level_of(parent)?;
        match level.lookup(cx, node, name) {
            Ok(e) => Ok(Self::node_out(view, e)),
            // A negative entry: the kernel remembers the name is absent for the entry TTL.
            Err(Error::Os(libc::ENOENT)) => Ok(blank(0)),
            Err(e) => Err(errno(&e, RequestOn::new("lookup", &level, node).entry(name))),
        }
    }

    pub(crate) fn forget(&self, ino: u64, nlookup: u64) {
        if ino == LEVELS_DIR_INO {
            return;
        }
        if let Ok((level, _, node)) = self.level_of(ino) {
            // Roots of views are never counted below (the root cannot be forgotten).
            level.forget(&Caller::daemon(), node, nlookup);
        }
    }

    pub(crate) fn getattr(&self, cx: &Caller, ino: u64, fh: Option<u64>) -> Res<NodeOut> {
        if ino == LEVELS_DIR_INO {
            return Ok(self.levels_dir_attr());
        }
        let (level, _, node) = self.level_of_unless_root(ino)?;
        let request = RequestOn::new("getattr", &level, node);
        expect(level.call(cx, &Op::GetAttr { node, fh: fh.map(FileHandle) }), request, |r| match r {
            Reply::Attr(attr) => Some(NodeOut { ino, generation: 0, attr }),
            _ => None,
        })
    }

    pub(crate) fn setattr(&self, cx: &Caller, ino: u64, fh: Option<u64>, set: SetAttr) -> Res<NodeOut> {
        if ino == LEVELS_DIR_INO {
            return Err(libc::EPERM);
        }
        let (level, _, node) = self.level_of(ino)?;
        let fh = fh.map(FileHandle);
        let unprivileged = cx.uid != 0;
        if set == SetAttr::default() || (set.size.is_some() && unprivileged) {
            self.kill_privileges(&level, cx, node).map_err(|e| errno(&e, RequestOn::new("setattr", &level, node)))?;
        }
        expect(level.call(cx, &Op::SetAttr { node, fh, set }), RequestOn::new("setattr", &level, node), |r| match r {
            Reply::Attr(attr) => Some(NodeOut { ino, generation: 0, attr }),
            _ => None,
        })
    }

    pub(crate) fn readlink(&self, cx: &Caller, ino: u64) -> Res<Vec<u8>> {
        let (level, _, node) = self.level_of(ino)?;
        expect(level.call(cx, &Op::ReadLink { node }), RequestOn::new("readlink", &level, node), |r| match r {
            Reply::Data(d) => Some(d),
            _ => None,
        })
    }

    pub(crate) fn mknod(&self, cx: &Caller, parent: u64, name: &OsStr, mode: u32, umask: u32, rdev: u32) -> Res<NodeOut> {
        let mode = self.new_mode(cx, parent, mode, umask);
        self.entry_op(cx, parent, name, |parent| Op::MkNod { parent, name, mode, rdev })
    }

    pub(crate) fn mkdir(&self, cx: &Caller, parent: u64, name: &OsStr, mode: u32, umask: u32) -> Res<NodeOut> {
        let mode = self.new_mode(cx, parent, mode, umask);
        self.entry_op(cx, parent, name, |parent| Op::MkDir { parent, name, mode })
    }

    /// The mode a new object is made with. With POSIX ACLs negotiated the kernel leaves the
    /// caller's umask to the file system, as a local one does: a directory with a default ACL
    /// gives its new objects that ACL (the lower file system applies it to the mode it is
    /// given, the daemon's own umask being 0), and any other applies the umask. Without them
    /// the kernel has masked the mode already, and masking again changes nothing.
    fn new_mode(&self, cx: &Caller, parent: u64, mode: u32, umask: u32) -> u32 {
        if self.posix_acl.load(Ordering::Relaxed) && self.has_default_acl(cx, parent) {
            return mode;
        }
        mode & !(umask & 0o777)
    }

    fn has_default_acl(&self, cx: &Caller, parent: u64) -> bool {
        let Ok((level, _, node)) = self.level_of(parent) else { return false };
        let op = Op::GetXattr { node, name: OsStr::new("system.posix_acl_default"), size: 0 };
        matches!(level.call(cx, &op), Ok(Reply::Xattr(XattrReply::Size(n))) if n > 0)
    }

    /// POSIX ACLs were negotiated with the kernel (`FUSE_POSIX_ACL`): it enforces them.
    pub(crate) fn set_posix_acl(&self, on: bool) {
        self.posix_acl.store(on, Ordering::Relaxed);
    }

    pub(crate) fn unlink(&self, cx: &Caller, parent: u64, name: &OsStr) -> Res<()> {
        self.name_op(cx, parent, name, |parent| Op::Unlink { parent, name })
    }

    pub(crate) fn rmdir(&self, cx: &Caller, parent: u64, name: &OsStr) -> Res<()> {
        self.name_op(cx, parent, name, |parent| Op::RmDir { parent, name })
    }

    pub(crate) fn symlink(&self, cx: &Caller, parent: u64, name: &OsStr, target: &Path) -> Res<NodeOut> {
        self.entry_op(cx, parent, name, |parent| Op::SymLink { parent, name, target })
    }

    pub(crate) fn rename(&self, cx: &Caller, parent: u64, name: &OsStr, newparent: u64, newname: &OsStr, flags: u32) -> Res<()> {
        if self.is_levels_dir_name(parent, name) || self.is_levels_dir_name(newparent, newname) {
            return Err(libc::EBUSY);
        }
        let (level, view, parent) = self.level_of(parent)?;
        let (_, new_view, new_parent) = self.level_of(newparent)?;
        if view != new_view {
            return Err(libc::EXDEV);
        }
        let op = Op::Rename { parent, name, new_parent, new_name: newname, flags };
        level.call(cx, &op).map(drop).map_err(|e| errno(&e, RequestOn::new("rename", &level, parent).entry(name)))
    }

    pub(crate) fn link(&self, cx: &Caller, ino: u64, newparent: u64, newname: &OsStr) -> Res<NodeOut> {
        let (_, view, node) = self.level_of(ino)?;
        match self.level_of(newparent) {
            Ok((_, new_view, _)) if new_view != view => return Err(libc::EXDEV),
            _ => {}
        }
        self.entry_op(cx, newparent, newname, |new_parent| Op::Link { node, new_parent, new_name: newname })
    }

    pub(crate) fn open(&self, cx: &Caller, ino: u64, flags: i32) -> Res<OpenOut> {
        let (level, view, node) = self.level_of(ino)?;
        let opened = level.open(cx, node, flags).map_err(|e| errno(&e, RequestOn::new("open", &level, node)))?;
        self.status.opened(1);
        Ok(self.open_out(ino, view, &opened, flags, false))
    }

    pub(crate) fn create(&self, cx: &Caller, parent: u64, name: &OsStr, mode: u32, umask: u32, flags: i32) -> Res<(NodeOut, OpenOut)> {
        if self.is_levels_dir_name(parent, name) {
            return Err(libc::EEXIST);
        }
        let mode = self.new_mode(cx, parent, mode, umask);
        let (level, view, parent) = self.level_of(parent)?;
        let (entry, opened) =
            level.create(cx, parent, name, mode, flags).map_err(|e| errno(&e, RequestOn::new("create", &level, parent).entry(name)))?;
        self.status.opened(1);
        let node = Self::node_out(view, entry);
        let open = self.open_out(node.ino, view, &opened, flags, true);
        Ok((node, open))
    }

    pub(crate) fn read(&self, cx: &Caller, ino: u64, fh: u64, offset: u64, size: u32) -> Res<Vec<u8>> {
        let (level, _, node) = self.level_of(ino)?;
        level.read(cx, node, FileHandle(fh), offset, size).map_err(|e| errno(&e, RequestOn::new("read", &level, node)))
    }

    pub(crate) fn write(&self, cx: &Caller, ino: u64, fh: u64, offset: u64, data: &[u8], kill_suidgid: bool) -> Res<u32> {
        let (level, _, node) = self.level_of(ino)?;
        if kill_suidgid {
            self.kill_privileges(&level, cx, node).map_err(|e| errno(&e, RequestOn::new("write", &level, node)))?;
        }
        level.write(cx, node, FileHandle(fh), offset, data).map_err(|e| errno(&e, RequestOn::new("write", &level, node)))
    }

    pub(crate) fn flush(&self, cx: &Caller, ino: u64, fh: u64) -> Res<()> {
        self.empty_op(cx, ino, |node| Op::Flush { node, fh: FileHandle(fh) })
    }

    pub(crate) fn release(&self, cx: &Caller, ino: u64, fh: u64) -> Res<()> {
        self.status.opened(-1);
        self.release_backing(ino, fh);
        self.empty_op(cx, ino, |node| Op::Release { node, fh: FileHandle(fh) })
    }

    pub(crate) fn fsync(&self, cx: &Caller, ino: u64, fh: u64, datasync: bool) -> Res<()> {
        self.empty_op(cx, ino, |node| Op::Fsync { node, fh: FileHandle(fh), datasync })
    }

    pub(crate) fn opendir(&self, cx: &Caller, ino: u64) -> Res<OpenOut> {
        if ino == LEVELS_DIR_INO {
            return Ok(OpenOut { fh: 0, flags: 0, backing: None });
        }
        let (level, view, node) = self.level_of_unless_root(ino)?;
        expect(level.call(cx, &Op::OpenDir { node }), RequestOn::new("opendir", &level, node), |r| match r {
            Reply::Opened(o) => {
                // The kernel may cache the listing; it drops it when the directory changes
                // through this mount or its mtime moves.
                let flags = if view == 0 { fopen::CACHE_DIR } else { 0 };
                self.status.opened(1);
                Some(OpenOut { fh: o.fh.0, flags, backing: None })
            }
            _ => None,
        })
    }

    /// `readdir`, or `readdirplus` when `plus`: entries from `offset` on, as many as `sink`
    /// takes. Entries fetched that do not fit are kept for the next call.
    pub(crate) fn readdir(&self, cx: &Caller, ino: u64, fh: u64, offset: u64, plus: bool, sink: &mut dyn DirSink) -> Res<()> {
        if ino == LEVELS_DIR_INO {
            for (i, (ino, name)) in self.levels_dir_entries().into_iter().enumerate().skip(offset as usize) {
                let (view, _) = unpack_ino(ino);
                let node = match plus.then(|| self.stack.view(view).map(|l| l.getattr(cx, NodeId::ROOT))).flatten() {
                    Some(Ok(attr)) if name != "." && name != ".." => NodeOut { ino, generation: 0, attr },
                    _ => blank(ino),
                };
                // Each level's root is counted by the kernel like a lookup; its forget reaches
                // the root, which is never forgotten.
                if !sink.push(ino, (i + 1) as u64, FileKind::Dir, OsStr::new(&name), &node, self.options.entry_ttl) {
                    break;
                }
            }
            return Ok(());
        }
        let (view, mut batch) = self.dir_batch(cx, ino, fh, offset, plus)?;
        let level = if plus { Some(self.stack.view(view).ok_or(libc::ESTALE)?) } else { None };
        while let Some(e) = batch.pop_front() {
            if self.hides(view, ino, &e.name) {
                if let Some(level) = &level {
                    self.forget_entries(level, [e]);
                }
                continue;
            }
            let fits = match &e.entry {
                Some(entry) => {
                    let node = Self::node_out(view, *entry);
                    sink.push(node.ino, e.next_offset, e.kind, &e.name, &node, self.options.entry_ttl)
                }
                // `.` and `..` (and every entry of a plain readdir): the kernel never links
                // these, so no lookup is counted.
                None => {
                    let ino = pack_ino(view, e.node);
                    sink.push(ino, e.next_offset, e.kind, &e.name, &blank(ino), Duration::ZERO)
                }
            };
            if !fits {
                batch.push_front(e);
                break;
            }
        }
        if !batch.is_empty() {
            self.dir_pending.lock().insert((ino, fh), batch);
        }
        Ok(())
    }

    pub(crate) fn releasedir(&self, cx: &Caller, ino: u64, fh: u64) -> Res<()> {
        if ino == LEVELS_DIR_INO {
            return Ok(());
        }
        self.status.opened(-1);
        let pending = self.dir_pending.lock().remove(&(ino, fh));
        let (level, _, node) = self.level_of_unless_root(ino)?;
        if let Some(pending) = pending {
            self.forget_entries(&level, pending);
        }
        let op = Op::ReleaseDir { node, fh: FileHandle(fh) };
        level.call(cx, &op).map(drop).map_err(|e| errno(&e, RequestOn::new(op.name(), &level, node)))
    }

    pub(crate) fn fsyncdir(&self, cx: &Caller, ino: u64, fh: u64, datasync: bool) -> Res<()> {
        if ino == LEVELS_DIR_INO {
            return Ok(());
        }
        self.empty_op(cx, ino, |node| Op::FsyncDir { node, fh: FileHandle(fh), datasync })
    }

    pub(crate) fn statfs(&self, cx: &Caller, ino: u64) -> Res<StatFs> {
        let ino = if ino == LEVELS_DIR_INO { NodeId::ROOT.0 } else { ino };
        let (level, _, node) = self.level_unused(ino)?;
        expect(level.call(cx, &Op::StatFs { node }), RequestOn::new("statfs", &level, node), |r| match r {
            Reply::StatFs(s) => Some(s),
            _ => None,
        })
    }

    pub(crate) fn setxattr(&self, cx: &Caller, ino: u64, name: &OsStr, value: &[u8], flags: i32) -> Res<()> {
        if ino == LEVELS_DIR_INO {
            return Err(libc::EPERM);
        }
        self.empty_op(cx, ino, |node| Op::SetXattr { node, name, value, flags })?;
        if self.posix_acl.load(Ordering::Relaxed) && name == "system.posix_acl_access" {
            let (level, _, node) = self.level_of(ino)?;
            if self.acl_drops_setgid(&level, cx, node).map_err(|e| errno(&e, RequestOn::new("setxattr", &level, node)))? {
                self.drop_cached_attributes(ino);
            }
        }
        Ok(())
    }

    /// Setting an access ACL sets the group bits of the mode, and a kernel file system then
    /// clears the set-group-ID bit when the caller is not in the file's group (and not root), as
    /// chmod does. The kernel asks that of a FUSE daemon with FUSE_SETXATTR_ACL_KILL_SGID, which
    /// fuser cannot negotiate, and the lower file system cannot know it: it sees the daemon set
    /// the ACL. So the front end does it (xfstests generic/375).
    fn acl_drops_setgid(&self, level: &Level, cx: &Caller, node: NodeId) -> plyfs_stack::Result<bool> {
        let attr = level.getattr(cx, node)?;
        let mode = u32::from(attr.perm);
        if mode & libc::S_ISGID != 0 && !plyfs_stack::setid::in_group(cx, attr.gid) {
            let set = SetAttr { mode: Some(mode & !libc::S_ISGID), ..SetAttr::default() };
            level.call(&Caller::daemon(), &Op::SetAttr { node, fh: None, set })?;
            return Ok(true);
        }
        Ok(false)
    }

    pub(crate) fn getxattr(&self, cx: &Caller, ino: u64, name: &OsStr, size: u32) -> Res<XattrReply> {
        if ino == LEVELS_DIR_INO {
            return Err(libc::ENODATA);
        }
        let reply = self.xattr_op(cx, ino, |node| Op::GetXattr { node, name, size });
        // With POSIX ACLs negotiated the kernel asks for them at every permission check; a
        // lower file system without ACLs (GlusterFS mounted without `acl`) says EOPNOTSUPP,
        // which the kernel would return from that check. It means "no ACL".
        match reply {
            Err(libc::EOPNOTSUPP) if self.posix_acl.load(Ordering::Relaxed) && plyfs_stack::is_posix_acl_xattr(name) => Err(libc::ENODATA),
            other => other,
        }
    }

    pub(crate) fn listxattr(&self, cx: &Caller, ino: u64, size: u32) -> Res<XattrReply> {
        if ino == LEVELS_DIR_INO {
            return Ok(if size == 0 { XattrReply::Size(0) } else { XattrReply::Data(Vec::new()) });
        }
        self.xattr_op(cx, ino, |node| Op::ListXattr { node, size })
    }

    pub(crate) fn removexattr(&self, cx: &Caller, ino: u64, name: &OsStr) -> Res<()> {
        if ino == LEVELS_DIR_INO {
            return Err(libc::EPERM);
        }
        self.empty_op(cx, ino, |node| Op::RemoveXattr { node, name })
    }

    pub(crate) fn access(&self, cx: &Caller, ino: u64, mask: i32) -> Res<()> {
        if ino == LEVELS_DIR_INO {
            return Ok(());
        }
        self.empty_op(cx, ino, |node| Op::Access { node, mask })
    }

    pub(crate) fn fallocate(&self, cx: &Caller, ino: u64, fh: u64, offset: u64, length: u64, mode: i32) -> Res<()> {
        self.empty_op(cx, ino, |node| Op::Fallocate { node, fh: FileHandle(fh), offset, length, mode })
    }

    /// `copy_file_range` between two files the kernel reads and writes directly (passthrough:
    /// no layer changes or watches their data), done between their lower files, so that a
    /// lower file system that shares extents (XFS, btrfs) makes a reflink of a plain `cp`.
    /// Anything else is `EOPNOTSUPP`, and the kernel copies through reads and writes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_file_range(&self, ino_in: u64, fh_in: u64, off_in: u64, ino_out: u64, fh_out: u64, off_out: u64, len: u64) -> Res<u32> {
        let (src, dst) = {
            let table = self.backing.lock();
            match (table.files.get(&(ino_in, fh_in)), table.files.get(&(ino_out, fh_out))) {
                (Some(a), Some(b)) => (a.clone(), b.clone()),
                _ => return Err(libc::EOPNOTSUPP),
            }
        };
        let (mut a, mut b) = (off_in as i64, off_out as i64);
        let len = len.min(u64::from(u32::MAX) & !0xfff) as usize;
        let n = unsafe { libc::copy_file_range(src.as_raw_fd(), &mut a, dst.as_raw_fd(), &mut b, len, 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO));
        }
        Ok(n as u32)
    }

    /// The file-attribute ioctls the kernel sends for `lsattr`/`chattr` ([`plyfs_stack::ioctl`]);
    /// any other is not a file system's (`ENOTTY`).
    pub(crate) fn ioctl(&self, cx: &Caller, ino: u64, fh: u64, cmd: u32, data: &[u8], out_size: u32) -> Res<Vec<u8>> {
        if !plyfs_stack::ioctl::known(cmd) || out_size > 64 || data.len() > 64 {
            return Err(libc::ENOTTY);
        }
        let (level, _, node) = self.level_of(ino)?;
        let request = RequestOn::new("ioctl", &level, node);
        let out = expect(level.call(cx, &Op::Ioctl { node, fh: FileHandle(fh), cmd, data, out_size }), request, |r| match r {
            Reply::Data(d) => Some(d),
            _ => None,
        });
        if out.is_ok() && plyfs_stack::ioctl::sets(cmd) {
            self.drop_cached_attributes(ino);
        }
        out
    }

    pub(crate) fn lseek(&self, cx: &Caller, ino: u64, fh: u64, offset: i64, whence: i32) -> Res<u64> {
        let (level, _, node) = self.level_of(ino)?;
        let request = RequestOn::new("lseek", &level, node);
        expect(level.call(cx, &Op::Lseek { node, fh: FileHandle(fh), offset, whence }), request, |r| match r {
            Reply::Offset(o) => Some(o),
            _ => None,
        })
    }
}
