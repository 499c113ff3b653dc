//! The classic transport: fuser reads requests from `/dev/fuse` and [`Classic`] hands them to
//! the [`FuseFs`] handlers. It always runs: it agrees on features with the kernel (INIT),
//! and carries what never travels over io_uring (FORGET, INTERRUPT, notifications).

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    AccessFlags, BsdFileFlags, Errno, FileAttr, FileHandle as FuseFh, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use plyfs_stack::{Attr, Caller, FileKind, SetAttr, TimeSet, XattrReply};

use crate::fs::{DirSink, FuseFs, IoMode, NodeOut, OpenOut, Res};

/// The largest write the kernel sends in one request (and so the size of a ring entry's
/// payload buffer).
pub(crate) const MAX_WRITE: u32 = 1 << 20;

/// The fuser side of a mount.
pub struct Classic {
    pub(crate) fs: Arc<FuseFs>,
    /// Ask the kernel for FUSE over io_uring at INIT.
    pub(crate) want_uring: bool,
    /// Set at INIT: the kernel agreed to FUSE over io_uring.
    pub(crate) uring_agreed: Arc<std::sync::atomic::AtomicBool>,
}

fn caller(req: &Request) -> Caller {
    Caller::new(req.uid(), req.gid(), req.pid())
}

fn err(e: i32) -> Errno {
    Errno::from_i32(e)
}

fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
    }
}

fn fuse_attr(ino: u64, a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: a.size,
        blocks: a.blocks,
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.ctime,
        crtime: a.ctime,
        kind: file_type(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: a.blksize,
        flags: 0,
    }
}

fn time_set(t: Option<TimeOrNow>) -> Option<TimeSet> {
    t.map(|t| match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(t) => TimeSet::At(t),
    })
}

impl Classic {
    fn entry(&self, reply: ReplyEntry, r: Res<NodeOut>) {
        match r {
            Ok(n) => {
                let o = &self.fs.options;
                reply.entry_with_ttls(&self.fs.attr_ttl(n.ino), &o.entry_ttl, &fuse_attr(n.ino, &n.attr), Generation(n.generation))
            }
            Err(e) => reply.error(err(e)),
        }
    }

    fn attr(&self, reply: ReplyAttr, r: Res<NodeOut>) {
        match r {
            Ok(n) => reply.attr(&self.fs.attr_ttl(n.ino), &fuse_attr(n.ino, &n.attr)),
            Err(e) => reply.error(err(e)),
        }
    }

    fn empty(reply: ReplyEmpty, r: Res<()>) {
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn xattr(reply: ReplyXattr, r: Res<XattrReply>) {
        match r {
            Ok(XattrReply::Size(n)) => reply.size(n),
            Ok(XattrReply::Data(d)) => reply.data(&d),
            Err(e) => reply.error(err(e)),
        }
    }

    /// The open flags of `o` for fuser, which adds FOPEN_PASSTHROUGH itself.
    fn fopen_flags(o: &OpenOut) -> FopenFlags {
        FopenFlags::from_bits_retain(o.flags & !crate::fs::fopen::PASSTHROUGH)
    }

    fn opened(reply: ReplyOpen, r: Res<OpenOut>) {
        let o = match r {
            Ok(o) => o,
            Err(e) => return reply.error(err(e)),
        };
        let flags = Self::fopen_flags(&o);
        match &o.backing {
            Some(b) => {
                // SAFETY: the reference stays open while `o.backing` lives; fuser gives it back
                // untouched (`into_raw`), so it is closed once, by its owner.
                let id = unsafe { reply.wrap_backing(b.id) };
                reply.opened_passthrough(FuseFh(o.fh), flags, &id);
                id.into_raw();
            }
            None => reply.opened(FuseFh(o.fh), flags),
        }
    }
}

struct Plain<'a>(&'a mut ReplyDirectory);

impl DirSink for Plain<'_> {
    fn push(&mut self, ino: u64, offset: u64, kind: FileKind, name: &OsStr, _: &NodeOut, _: Duration) -> bool {
        !self.0.add(INodeNo(ino), offset, file_type(kind), name)
    }
}

struct Plus<'a>(&'a mut ReplyDirectoryPlus);

impl DirSink for Plus<'_> {
    fn push(&mut self, ino: u64, offset: u64, _: FileKind, name: &OsStr, node: &NodeOut, ttl: Duration) -> bool {
        !self.0.add(INodeNo(ino), offset, name, &ttl, &fuse_attr(node.ino, &node.attr), Generation(node.generation))
    }
}

impl Filesystem for Classic {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let caps = config.capabilities();
        for flag in [
            InitFlags::FUSE_DO_READDIRPLUS,
            InitFlags::FUSE_READDIRPLUS_AUTO,
            InitFlags::FUSE_PARALLEL_DIROPS,
            // The daemon clears set-user/group-ID bits itself (see `kill_privileges`). In
            // return the kernel stops asking for security.capability before every write and
            // refreshing attributes before every chown (it may mark inodes S_NOSEC).
            InitFlags::FUSE_HANDLE_KILLPRIV_V2,
            InitFlags::FUSE_AUTO_INVAL_DATA,
            InitFlags::FUSE_CACHE_SYMLINKS,
            // Not FUSE_ASYNC_DIO: with it, an asynchronous O_DIRECT write to a file kept in the
            // page cache completes without dropping the pages a concurrent buffered read filled
            // during the write (this kernel has no invalidation at completion), and later reads
            // return the old data (xfstests generic/451). Without it the kernel sends the write
            // at submission and drops those pages after it. Passthrough files are not affected
            // either way: the kernel hands their I/O to the lower file.
        ] {
            if caps.contains(flag) {
                let _ = config.add_capabilities(flag);
            }
        }
        // POSIX ACLs enforced by the kernel, as on a local file system: it caches them from
        // the lower files' system.posix_acl_* attributes and leaves the umask to the daemon.
        // FUSE_DONT_MASK with it: the kernel would otherwise apply the umask even where a
        // default ACL must rule instead.
        let acl = caps.contains(InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK)
            && config.add_capabilities(InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK).is_ok();
        self.fs.set_posix_acl(acl);
        if self.want_uring && config.add_capabilities(InitFlags::FUSE_OVER_IO_URING).is_ok() {
            self.uring_agreed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        // FUSE_ATOMIC_O_TRUNC is not requested: with it the kernel checks ETXTBSY only after the
        // lower file was opened with O_TRUNC, so opening a running program O_RDONLY|O_TRUNC
        // would fail and still destroy it. Without it the kernel checks first, then truncates
        // with a separate setattr.
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);

        let mode = self.fs.decide_io_mode(caps.contains(InitFlags::FUSE_PASSTHROUGH));
        let mut passthrough = false;
        if mode == IoMode::Passthrough {
            // Passthrough and writeback caching exclude each other (the kernel drops
            // passthrough silently); writeback caching is never requested here.
            passthrough = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok() && config.set_max_stack_depth(1).is_ok();
        }
        self.fs.settle_io_mode(mode, passthrough);
        Ok(())
    }

    fn destroy(&mut self) {
        self.fs.destroy();
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.entry(reply, self.fs.lookup(&caller(req), parent.0, name))
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(ino.0, nlookup)
    }

    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FuseFh>, reply: ReplyAttr) {
        self.attr(reply, self.fs.getattr(&caller(req), ino.0, fh.map(|f| f.0)))
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FuseFh>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let set = SetAttr { mode, uid, gid, size, atime: time_set(atime), mtime: time_set(mtime) };
        self.attr(reply, self.fs.setattr(&caller(req), ino.0, fh.map(|f| f.0), set))
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.fs.readlink(&caller(req), ino.0) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(err(e)),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        self.entry(reply, self.fs.mknod(&caller(req), parent.0, name, mode, umask, rdev))
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        self.entry(reply, self.fs.mkdir(&caller(req), parent.0, name, mode, umask))
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.unlink(&caller(req), parent.0, name))
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.rmdir(&caller(req), parent.0, name))
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        self.entry(reply, self.fs.symlink(&caller(req), parent.0, link_name, target))
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        Self::empty(reply, self.fs.rename(&caller(req), parent.0, name, newparent.0, newname, flags.bits()))
    }

    fn link(&self, req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        self.entry(reply, self.fs.link(&caller(req), ino.0, newparent.0, newname))
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        Self::opened(reply, self.fs.open(&caller(req), ino.0, flags.0))
    }

    fn create(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, flags: i32, reply: ReplyCreate) {
        let (node, o) = match self.fs.create(&caller(req), parent.0, name, mode, umask, flags) {
            Ok(r) => r,
            Err(e) => return reply.error(err(e)),
        };
        // The attributes of a file just made are current (see `FuseFs::open_out`).
        let ttl = &self.fs.options.entry_ttl;
        let attr = fuse_attr(node.ino, &node.attr);
        let generation = Generation(node.generation);
        let flags = Self::fopen_flags(&o);
        match &o.backing {
            Some(b) => {
                // SAFETY: as in `opened`.
                let id = unsafe { reply.wrap_backing(b.id) };
                reply.created_passthrough(ttl, &attr, generation, FuseFh(o.fh), flags, &id);
                id.into_raw();
            }
            None => reply.created(ttl, &attr, generation, FuseFh(o.fh), flags),
        }
    }

    fn read(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: u64, size: u32, _flags: OpenFlags, _lock: Option<LockOwner>, reply: ReplyData) {
        match self.fs.read(&caller(req), ino.0, fh.0, offset, size) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(err(e)),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FuseFh,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let kill = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        match self.fs.write(&caller(req), ino.0, fh.0, offset, data, kill) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(err(e)),
        }
    }

    fn flush(&self, req: &Request, ino: INodeNo, fh: FuseFh, _lock_owner: LockOwner, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.flush(&caller(req), ino.0, fh.0))
    }

    fn release(&self, req: &Request, ino: INodeNo, fh: FuseFh, _flags: OpenFlags, _lock: Option<LockOwner>, _flush: bool, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.release(&caller(req), ino.0, fh.0))
    }

    fn fsync(&self, req: &Request, ino: INodeNo, fh: FuseFh, datasync: bool, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.fsync(&caller(req), ino.0, fh.0, datasync))
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        Self::opened(reply, self.fs.opendir(&caller(req), ino.0))
    }

    fn readdir(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: u64, mut reply: ReplyDirectory) {
        match self.fs.readdir(&caller(req), ino.0, fh.0, offset, false, &mut Plain(&mut reply)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn readdirplus(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: u64, mut reply: ReplyDirectoryPlus) {
        match self.fs.readdir(&caller(req), ino.0, fh.0, offset, true, &mut Plus(&mut reply)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn releasedir(&self, req: &Request, ino: INodeNo, fh: FuseFh, _flags: OpenFlags, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.releasedir(&caller(req), ino.0, fh.0))
    }

    fn fsyncdir(&self, req: &Request, ino: INodeNo, fh: FuseFh, datasync: bool, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.fsyncdir(&caller(req), ino.0, fh.0, datasync))
    }

    fn statfs(&self, req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        match self.fs.statfs(&caller(req), ino.0) {
            Ok(s) => reply.statfs(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize),
            Err(e) => reply.error(err(e)),
        }
    }

    fn setxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, value: &[u8], flags: i32, _position: u32, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.setxattr(&caller(req), ino.0, name, value, flags))
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        Self::xattr(reply, self.fs.getxattr(&caller(req), ino.0, name, size))
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        Self::xattr(reply, self.fs.listxattr(&caller(req), ino.0, size))
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.removexattr(&caller(req), ino.0, name))
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.access(&caller(req), ino.0, mask.bits()))
    }

    fn fallocate(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: u64, length: u64, mode: i32, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.fallocate(&caller(req), ino.0, fh.0, offset, length, mode))
    }

    #[allow(clippy::too_many_arguments)]
    fn copy_file_range(
        &self,
        _req: &Request,
        ino_in: INodeNo,
        fh_in: FuseFh,
        offset_in: u64,
        ino_out: INodeNo,
        fh_out: FuseFh,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        match self.fs.copy_file_range(ino_in.0, fh_in.0, offset_in, ino_out.0, fh_out.0, offset_out, len) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(err(e)),
        }
    }

    /// The file-attribute flags (`lsattr`, `chattr`); other ioctls are not a file system's.
    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FuseFh,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        match self.fs.ioctl(&caller(req), ino.0, fh.0, cmd, in_data, out_size) {
            Ok(out) => reply.ioctl(0, &out),
            Err(e) => reply.error(err(e)),
        }
    }

    fn lseek(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: i64, whence: i32, reply: ReplyLseek) {
        match self.fs.lseek(&caller(req), ino.0, fh.0, offset, whence) {
            Ok(o) => reply.offset(o as i64),
            Err(e) => reply.error(err(e)),
        }
    }
}
