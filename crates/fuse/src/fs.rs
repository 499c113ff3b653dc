//! The FUSE adapter: each kernel request becomes one [`Op`] entering the stack at the top (or at
//! the level a `.plyfs/NAME` path selects), and the reply goes back to the kernel.
//!
//! Inode numbers: FUSE node id and `st_ino` are one number here (fuser sends the same value for
//! both). The top view uses the stack's node ids as they are; the view below layer `i` puts
//! `i + 1` in the top byte. `.plyfs` itself has the reserved top byte `0xff`.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BackingId, BsdFileFlags, Errno, FileAttr, FileHandle as FuseFh, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;
use plyfs_stack::{
    Attr, Caller, DataPath, DirEntry, Error, FileHandle, FileKind, Level, NodeId, Op, Opened, Reply, SetAttr, Stack,
    TimeSet, XattrReply,
};

/// The reserved name, at the root of the mount, of the directory that holds one view per level.
pub const LEVELS_DIR: &str = ".plyfs";
const LEVELS_DIR_INO: u64 = (0xff << 56) | 1;
const VIEW_SHIFT: u32 = 56;

/// Tunables of the front end.
#[derive(Clone, Debug)]
pub struct FrontOptions {
    pub entry_ttl: Duration,
    pub attr_ttl: Duration,
    /// Use FUSE passthrough where the stack allows it.
    pub passthrough: bool,
    /// Why passthrough is off when the mount knows better than `-o passthrough=off`.
    pub no_passthrough_because: Option<String>,
    /// Other mounts share the lowers (`-o shared`): pages are not kept from one open to the
    /// next (close-to-open consistency, as NFS gives).
    pub shared: bool,
}

impl Default for FrontOptions {
    fn default() -> Self {
        FrontOptions {
            entry_ttl: Duration::from_secs(1),
            attr_ttl: Duration::from_secs(1),
            passthrough: true,
            no_passthrough_because: None,
            shared: false,
        }
    }
}

/// How file data moves, as decided when the kernel and the daemon agreed on features.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// Reads and writes go from the kernel to the lower files; the daemon is not on the path.
    Passthrough,
    /// Passthrough for files that no data layer encodes; the files a per-file chain (or the
    /// default chain) encodes use FUSE I/O with the page cache kept.
    Mixed,
    /// Reads and writes reach the daemon; the kernel page cache is kept across opens.
    Cached { reason: String },
}

impl std::fmt::Display for IoMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoMode::Passthrough => f.write_str("passthrough (the kernel reads and writes the lower files directly)"),
            IoMode::Mixed => f.write_str(
                "passthrough for files that no data layer encodes (the kernel reads and writes the lower files directly); FUSE I/O with the page cache kept for the files a data layer encodes",
            ),
            IoMode::Cached { reason } => write!(f, "FUSE I/O with the page cache kept ({reason})"),
        }
    }
}

/// What the front end shares with whoever mounted it.
pub struct FrontStatus {
    io_mode: Mutex<Option<IoMode>>,
    passthrough_failed: AtomicBool,
    /// The kernel refuses the lower file system's files for passthrough (found at mount).
    passthrough_refused: AtomicBool,
}

impl FrontStatus {
    pub fn io_mode(&self) -> Option<IoMode> {
        self.io_mode.lock().clone()
    }

    /// Passthrough cannot serve this mount's files: every file uses FUSE I/O.
    pub(crate) fn refuse_passthrough(&self, reason: String) {
        self.passthrough_refused.store(true, Ordering::Relaxed);
        *self.io_mode.lock() = Some(IoMode::Cached { reason });
    }
}

/// Kernel passthrough references, one per inode while any open of it lives.
#[derive(Default)]
struct BackingTable {
    by_inode: HashMap<u64, Weak<BackingId>>,
    by_open: HashMap<(u64, u64), Arc<BackingId>>,
}

pub struct FuseFs {
    stack: Arc<Stack>,
    options: FrontOptions,
    passthrough: bool,
    status: Arc<FrontStatus>,
    backing: Mutex<BackingTable>,
    /// Entries fetched for `readdirplus` that did not fit the kernel's buffer, kept (with their
    /// lookups) for the next call so no lookup is wasted.
    dir_pending: Mutex<HashMap<(u64, u64), VecDeque<DirEntry>>>,
    started: SystemTime,
}

fn errno(e: &Error) -> Errno {
    if let Error::Corrupt(msg) = e {
        tracing::error!("{msg}");
    }
    Errno::from_i32(e.errno())
}

fn caller(req: &Request) -> Caller {
    Caller { uid: req.uid(), gid: req.gid(), pid: req.pid() }
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

/// Attributes for replies whose attributes the kernel ignores: negative entries, and `.` and
/// `..` in `readdirplus`.
fn blank_attr(ino: u64) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: FileType::Directory,
        perm: 0,
        nlink: 1,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

fn time_set(t: Option<TimeOrNow>) -> Option<TimeSet> {
    t.map(|t| match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(t) => TimeSet::At(t),
    })
}

/// Whether the caller belongs to `gid`, by its primary or a supplementary group.
fn in_group(cx: &Caller, gid: u32) -> bool {
    if cx.gid == gid || cx.uid == 0 {
        return true;
    }
    std::fs::read_to_string(format!("/proc/{}/status", cx.pid)).ok().is_some_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("Groups:"))
            .is_some_and(|groups| groups.split_whitespace().any(|g| g.parse() == Ok(gid)))
    })
}

/// Whether this process may register passthrough files (`FUSE_DEV_IOC_BACKING_OPEN` needs
/// CAP_SYS_ADMIN).
fn have_cap_sys_admin() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    plyfs_stack::has_capability(CAP_SYS_ADMIN)
}

impl FuseFs {
    pub fn new(stack: Arc<Stack>, options: FrontOptions) -> (FuseFs, Arc<FrontStatus>) {
        let status = Arc::new(FrontStatus {
            io_mode: Mutex::new(None),
            passthrough_failed: AtomicBool::new(false),
            passthrough_refused: AtomicBool::new(false),
        });
        let fs = FuseFs {
            stack,
            options,
            passthrough: false,
            status: status.clone(),
            backing: Mutex::new(BackingTable::default()),
            dir_pending: Mutex::new(HashMap::new()),
            started: SystemTime::now(),
        };
        (fs, status)
    }

    fn encode(view: usize, node: NodeId) -> u64 {
        ((view as u64) << VIEW_SHIFT) | node.0
    }

    /// The level and node a FUSE inode number stands for. A view whose level is gone (a
    /// removed branch) answers ESTALE. The top view, which nearly every request names, is
    /// borrowed; the others are looked up in the stack's views.
    fn decode(&self, ino: INodeNo) -> Result<(Cow<'_, Level>, usize, NodeId), Errno> {
        let view = (ino.0 >> VIEW_SHIFT) as usize;
        let node = NodeId(ino.0 & NodeId::MAX);
        if view == 0 {
            return Ok((Cow::Borrowed(self.stack.top()), 0, node));
        }
        match self.stack.view(view) {
            Some(level) => Ok((Cow::Owned(level), view, node)),
            None => Err(Errno::ESTALE),
        }
    }

    fn is_levels_dir_name(&self, parent: INodeNo, name: &OsStr) -> bool {
        parent.0 == NodeId::ROOT.0 && name == LEVELS_DIR
    }

    fn levels_dir_attr(&self) -> FileAttr {
        let root = self.stack.top().getattr(&Caller::daemon(), NodeId::ROOT).ok();
        FileAttr {
            ino: INodeNo(LEVELS_DIR_INO),
            size: 0,
            blocks: 0,
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: FileType::Directory,
            perm: 0o555,
            nlink: 2,
            uid: root.map_or(0, |a| a.uid),
            gid: root.map_or(0, |a| a.gid),
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn reply_entry(&self, reply: ReplyEntry, view: usize, entry: plyfs_stack::Entry) {
        let attr = fuse_attr(Self::encode(view, entry.node), &entry.attr);
        reply.entry_with_ttls(&self.options.attr_ttl, &self.options.entry_ttl, &attr, Generation(entry.generation));
    }

    fn entry_op<'a>(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry, op: impl FnOnce(NodeId) -> Op<'a>) {
        if self.is_levels_dir_name(parent, name) {
            return reply.error(Errno::EEXIST);
        }
        let (level, view, node) = match self.decode(parent) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        match level.call(&caller(req), &op(node)) {
            Ok(Reply::Entry(e)) => self.reply_entry(reply, view, e),
            Ok(_) => reply.error(Errno::EIO),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn empty_op<'a>(&self, req: &Request, ino: INodeNo, reply: ReplyEmpty, op: impl FnOnce(NodeId) -> Op<'a>) {
        match self.decode(ino) {
            Ok((level, _, node)) => match level.call(&caller(req), &op(node)) {
                Ok(_) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            },
            Err(e) => reply.error(e),
        }
    }

    /// `getxattr` or `listxattr`: the reply is a value, or only its size.
    fn xattr_op<'a>(&self, req: &Request, ino: INodeNo, reply: ReplyXattr, op: impl FnOnce(NodeId) -> Op<'a>) {
        match self.decode(ino) {
            Ok((level, _, node)) => match level.call(&caller(req), &op(node)) {
                Ok(Reply::Xattr(XattrReply::Size(n))) => reply.size(n),
                Ok(Reply::Xattr(XattrReply::Data(d))) => reply.data(&d),
                Ok(_) => reply.error(Errno::EIO),
                Err(e) => reply.error(errno(&e)),
            },
            Err(e) => reply.error(e),
        }
    }

    /// An operation on a name in a directory that answers nothing. The reserved `.plyfs` is busy,
    /// like a mount point.
    fn name_op<'a>(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty, op: impl FnOnce(NodeId) -> Op<'a>) {
        if self.is_levels_dir_name(parent, name) {
            return reply.error(Errno::EBUSY);
        }
        self.empty_op(req, parent, reply, op)
    }

    /// Open flags for a file opened without passthrough.
    fn cache_flags(&self, view: usize, opened: &Opened) -> FopenFlags {
        let cache = if opened.direct_io {
            FopenFlags::FOPEN_DIRECT_IO
        } else if view == 0 && !self.options.shared {
            // The page cache stays valid across opens: all changes come through this mount,
            // and FUSE_AUTO_INVAL_DATA drops it when the attributes show an outside change.
            FopenFlags::FOPEN_KEEP_CACHE
        } else {
            // Lower views share files with the top one; start each open from fresh pages.
            FopenFlags::empty()
        };
        cache | Self::flush_flags(opened)
    }

    /// Spare the `flush` round trip at every close when nothing in the stack needs it.
    fn flush_flags(opened: &Opened) -> FopenFlags {
        if opened.flush_on_close { FopenFlags::empty() } else { FopenFlags::FOPEN_NOFLUSH }
    }

    /// The kernel passthrough reference for this open, if passthrough applies.
    fn backing_for(&self, ino: u64, opened: &Opened, open_backing: impl FnOnce(&std::os::fd::OwnedFd) -> std::io::Result<BackingId>) -> Option<Arc<BackingId>> {
        if !self.passthrough || self.status.passthrough_refused.load(Ordering::Relaxed) {
            return None;
        }
        let fd = opened.backing.as_ref()?;
        let mut table = self.backing.lock();
        let id = match table.by_inode.get(&ino).and_then(Weak::upgrade) {
            Some(id) => id,
            None => match open_backing(fd) {
                Ok(id) => {
                    let id = Arc::new(id);
                    table.by_inode.insert(ino, Arc::downgrade(&id));
                    id
                }
                Err(e) => {
                    if !self.status.passthrough_failed.swap(true, Ordering::Relaxed) {
                        tracing::warn!("passthrough refused by the kernel ({e}); such files use FUSE I/O");
                    }
                    return None;
                }
            },
        };
        table.by_open.insert((ino, opened.fh.0), id.clone());
        Some(id)
    }

    fn release_backing(&self, ino: u64, fh: u64) {
        let mut table = self.backing.lock();
        if table.by_open.remove(&(ino, fh)).is_some()
            && table.by_inode.get(&ino).is_some_and(|w| w.strong_count() == 0)
        {
            table.by_inode.remove(&ino);
        }
    }

    /// Clear the set-user-ID bit, and the set-group-ID bit of a group-executable file, as a
    /// kernel file system does when an unprivileged caller writes or truncates a file. With
    /// FUSE_HANDLE_KILLPRIV_V2 the kernel leaves this to us: it says so with an empty SETATTR
    /// before a write (also one through passthrough, which never reaches us), with
    /// FUSE_WRITE_KILL_SUIDGID on a write, and by truncating as an unprivileged caller.
    fn kill_privileges(&self, level: &Level, cx: &Caller, node: NodeId, fh: Option<FileHandle>) -> plyfs_stack::Result<()> {
        let attr = match level.call(cx, &Op::GetAttr { node, fh })? {
            Reply::Attr(a) => a,
            _ => return Err(Error::Os(libc::EIO)),
        };
        if attr.kind != FileKind::File {
            return Ok(());
        }
        let mode = u32::from(attr.perm);
        let mut kept = mode & !libc::S_ISUID;
        // As the kernel's setattr_should_drop_sgid: a group-executable file always loses
        // set-group-ID; another one only when the caller is not in the file's group.
        if mode & libc::S_ISGID != 0 && (mode & libc::S_IXGRP != 0 || !in_group(cx, attr.gid)) {
            kept &= !libc::S_ISGID;
        }
        if kept != mode {
            let set = SetAttr { mode: Some(kept), ..SetAttr::default() };
            level.call(&Caller::daemon(), &Op::SetAttr { node, fh, set })?;
        }
        Ok(())
    }

    fn decide_io_mode(&self, kernel_has_passthrough: bool) -> IoMode {
        // Levels below a per-file router are not on every file's path: they strip passthrough
        // for their own files (see `Level::call`).
        let blocking = self.stack.shared_levels().iter().find(|l| l.layer().data_path() != DataPath::Transparent);
        let reason = if !self.options.passthrough {
            self.options.no_passthrough_because.clone().unwrap_or_else(|| "passthrough turned off with -o passthrough=off".to_owned())
        } else if let Some(level) = blocking {
            format!("layer '{}' {} file data", level.name(), level.layer().data_path())
        } else if !kernel_has_passthrough {
            "the kernel offers no FUSE passthrough (needs Linux 6.9 or later)".to_owned()
        } else if !have_cap_sys_admin() {
            "passthrough needs CAP_SYS_ADMIN".to_owned()
        } else {
            return IoMode::Passthrough;
        };
        IoMode::Cached { reason }
    }

    fn levels_dir_entries(&self) -> Vec<(u64, FileType, String)> {
        let mut entries = vec![
            (LEVELS_DIR_INO, FileType::Directory, ".".to_owned()),
            (NodeId::ROOT.0, FileType::Directory, "..".to_owned()),
        ];
        self.stack.refresh_views();
        for (view, name) in self.stack.views() {
            entries.push((Self::encode(view, NodeId::ROOT), FileType::Directory, name));
        }
        entries
    }

    /// Fetch directory entries for the kernel, first from what the last call left over.
    fn dir_batch(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: u64, plus: bool) -> Result<(usize, VecDeque<DirEntry>), Errno> {
        let (level, view, node) = self.decode(ino)?;
        if let Some(pending) = self.dir_pending.lock().remove(&(ino.0, fh.0)) {
            let continues = match pending.front() {
                Some(first) => offset == first.next_offset.saturating_sub(1) || offset == 0 && first.next_offset == 1,
                None => false,
            };
            if continues {
                return Ok((view, pending));
            }
            self.forget_entries(&level, pending);
        }
        let max_entries = if plus { 128 } else { 512 };
        let op = Op::ReadDir { node, fh: FileHandle(fh.0), offset, max_entries, plus };
        match level.call(&caller(req), &op) {
            Ok(Reply::Dir(entries)) => Ok((view, entries.into())),
            Ok(_) => Err(Errno::EIO),
            Err(e) => Err(errno(&e)),
        }
    }

    fn forget_entries(&self, level: &Level, entries: impl IntoIterator<Item = DirEntry>) {
        let cx = Caller::daemon();
        for e in entries {
            if let Some(entry) = e.entry {
                level.forget(&cx, entry.node, 1);
            }
        }
    }

    fn hides(&self, view: usize, dir: INodeNo, name: &OsStr) -> bool {
        view == 0 && dir.0 == NodeId::ROOT.0 && name == LEVELS_DIR
    }
}

impl Filesystem for FuseFs {
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
            InitFlags::FUSE_ASYNC_DIO,
        ] {
            if caps.contains(flag) {
                let _ = config.add_capabilities(flag);
            }
        }
        // FUSE_ATOMIC_O_TRUNC is not requested: with it the kernel checks ETXTBSY only after the
        // lower file was opened with O_TRUNC, so opening a running program O_RDONLY|O_TRUNC
        // would fail and still destroy it. Without it the kernel checks first, then truncates
        // with a separate setattr.
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);

        let mode = self.decide_io_mode(caps.contains(InitFlags::FUSE_PASSTHROUGH));
        if mode == IoMode::Passthrough {
            // Passthrough and writeback caching exclude each other (the kernel drops
            // passthrough silently); writeback caching is never requested here.
            let ok = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok() && config.set_max_stack_depth(1).is_ok();
            self.passthrough = ok;
        }
        let mode = if self.passthrough || mode != IoMode::Passthrough {
            mode
        } else {
            IoMode::Cached { reason: "the kernel refused the passthrough settings".into() }
        };
        // Below a per-file router (levels not every file passes), files may have data layers
        // of their own, now or once a policy gives them some.
        let per_file = self.stack.shared_levels().len() < self.stack.levels().len()
            || self.stack.levels().last().is_some_and(|l| !l.layer().branches().is_empty());
        let mode = if mode == IoMode::Passthrough && per_file { IoMode::Mixed } else { mode };
        tracing::info!("file I/O: {mode}");
        *self.status.io_mode.lock() = Some(mode);
        Ok(())
    }

    fn destroy(&mut self) {
        self.stack.shutdown();
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if self.is_levels_dir_name(parent, name) {
            return reply.entry(&self.options.entry_ttl, &self.levels_dir_attr(), Generation(0));
        }
        if parent.0 == LEVELS_DIR_INO {
            let Some((view, level)) = name.to_str().and_then(|n| self.stack.view_named(n)).and_then(|v| Some((v, self.stack.view(v)?))) else {
                return reply.error(Errno::ENOENT);
            };
            let cx = caller(req);
            // The kernel will forget this root like any looked-up node; take the lookup that
            // forget will drop.
            return match level.call(&cx, &Op::GetAttr { node: NodeId::ROOT, fh: None }) {
                Ok(Reply::Attr(attr)) => {
                    let entry = plyfs_stack::Entry { node: NodeId::ROOT, attr, generation: 0 };
                    self.reply_entry(reply, view, entry)
                }
                Ok(_) => reply.error(Errno::EIO),
                Err(e) => reply.error(errno(&e)),
            };
        }
        let (level, view, node) = match self.decode(parent) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        match level.lookup(&caller(req), node, name) {
            Ok(e) => self.reply_entry(reply, view, e),
            Err(Error::Os(libc::ENOENT)) => {
                // A negative entry: the kernel remembers the name is absent for the entry TTL.
                reply.entry(&self.options.entry_ttl, &blank_attr(0), Generation(0));
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        if ino.0 == LEVELS_DIR_INO {
            return;
        }
        if let Ok((level, _, node)) = self.decode(ino) {
            // Roots of views are never counted below (the root cannot be forgotten).
            level.forget(&Caller::daemon(), node, nlookup);
        }
    }

    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FuseFh>, reply: ReplyAttr) {
        if ino.0 == LEVELS_DIR_INO {
            return reply.attr(&self.options.attr_ttl, &self.levels_dir_attr());
        }
        let (level, _, node) = match self.decode(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        match level.call(&caller(req), &Op::GetAttr { node, fh: fh.map(|f| FileHandle(f.0)) }) {
            Ok(Reply::Attr(a)) => reply.attr(&self.options.attr_ttl, &fuse_attr(ino.0, &a)),
            Ok(_) => reply.error(Errno::EIO),
            Err(e) => reply.error(errno(&e)),
        }
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
        if ino.0 == LEVELS_DIR_INO {
            return reply.error(Errno::EPERM);
        }
        let (level, _, node) = match self.decode(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        let cx = caller(req);
        let fh = fh.map(|f| FileHandle(f.0));
        let set = SetAttr { mode, uid, gid, size, atime: time_set(atime), mtime: time_set(mtime) };
        let unprivileged = cx.uid != 0;
        if set == SetAttr::default() || (size.is_some() && unprivileged) {
            if let Err(e) = self.kill_privileges(&level, &cx, node, fh) {
                return reply.error(errno(&e));
            }
        }
        match level.call(&cx, &Op::SetAttr { node, fh, set }) {
            Ok(Reply::Attr(a)) => reply.attr(&self.options.attr_ttl, &fuse_attr(ino.0, &a)),
            Ok(_) => reply.error(Errno::EIO),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        let (level, _, node) = match self.decode(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        match level.call(&caller(req), &Op::ReadLink { node }) {
            Ok(Reply::Data(d)) => reply.data(&d),
            Ok(_) => reply.error(Errno::EIO),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, _umask: u32, rdev: u32, reply: ReplyEntry) {
        self.entry_op(req, parent, name, reply, |parent| Op::MkNod { parent, name, mode, rdev })
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, _umask: u32, reply: ReplyEntry) {
        self.entry_op(req, parent, name, reply, |parent| Op::MkDir { parent, name, mode })
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.name_op(req, parent, name, reply, |parent| Op::Unlink { parent, name })
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.name_op(req, parent, name, reply, |parent| Op::RmDir { parent, name })
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        self.entry_op(req, parent, link_name, reply, |parent| Op::SymLink { parent, name: link_name, target })
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
        if self.is_levels_dir_name(parent, name) || self.is_levels_dir_name(newparent, newname) {
            return reply.error(Errno::EBUSY);
        }
        let ((level, view, parent), (_, new_view, new_parent)) = match (self.decode(parent), self.decode(newparent)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return reply.error(e),
        };
        if view != new_view {
            return reply.error(Errno::EXDEV);
        }
        let op = Op::Rename { parent, name, new_parent, new_name: newname, flags: flags.bits() };
        match level.call(&caller(req), &op) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn link(&self, req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let (node, view) = match self.decode(ino) {
            Ok((_, view, node)) => (node, view),
            Err(e) => return reply.error(e),
        };
        match self.decode(newparent) {
            Ok((_, new_view, _)) if new_view != view => return reply.error(Errno::EXDEV),
            _ => {}
        }
        self.entry_op(req, newparent, newname, reply, |new_parent| Op::Link { node, new_parent, new_name: newname })
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let (level, view, node) = match self.decode(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        let opened = match level.open(&caller(req), node, flags.0) {
            Ok(o) => o,
            Err(e) => return reply.error(errno(&e)),
        };
        match self.backing_for(ino.0, &opened, |fd| reply.open_backing(fd)) {
            Some(id) => reply.opened_passthrough(FuseFh(opened.fh.0), Self::flush_flags(&opened), &id),
            None => reply.opened(FuseFh(opened.fh.0), self.cache_flags(view, &opened)),
        }
    }

    fn create(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, _umask: u32, flags: i32, reply: ReplyCreate) {
        if self.is_levels_dir_name(parent, name) {
            return reply.error(Errno::EEXIST);
        }
        let (level, view, parent) = match self.decode(parent) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        let (entry, opened) = match level.create(&caller(req), parent, name, mode, flags) {
            Ok(r) => r,
            Err(e) => return reply.error(errno(&e)),
        };
        let ino = Self::encode(view, entry.node);
        let attr = fuse_attr(ino, &entry.attr);
        let generation = Generation(entry.generation);
        match self.backing_for(ino, &opened, |fd| reply.open_backing(fd)) {
            Some(id) => reply.created_passthrough(&self.options.entry_ttl, &attr, generation, FuseFh(opened.fh.0), Self::flush_flags(&opened), &id),
            None => reply.created(&self.options.entry_ttl, &attr, generation, FuseFh(opened.fh.0), self.cache_flags(view, &opened)),
        }
    }

    fn read(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: u64, size: u32, _flags: OpenFlags, _lock: Option<LockOwner>, reply: ReplyData) {
        let (level, _, node) = match self.decode(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        match level.read(&caller(req), node, FileHandle(fh.0), offset, size) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(errno(&e)),
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
        let (level, _, node) = match self.decode(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        let cx = caller(req);
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            if let Err(e) = self.kill_privileges(&level, &cx, node, Some(FileHandle(fh.0))) {
                return reply.error(errno(&e));
            }
        }
        match level.write(&cx, node, FileHandle(fh.0), offset, data) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn flush(&self, req: &Request, ino: INodeNo, fh: FuseFh, _lock_owner: LockOwner, reply: ReplyEmpty) {
        self.empty_op(req, ino, reply, |node| Op::Flush { node, fh: FileHandle(fh.0) })
    }

    fn release(&self, req: &Request, ino: INodeNo, fh: FuseFh, _flags: OpenFlags, _lock: Option<LockOwner>, _flush: bool, reply: ReplyEmpty) {
        self.release_backing(ino.0, fh.0);
        self.empty_op(req, ino, reply, |node| Op::Release { node, fh: FileHandle(fh.0) })
    }

    fn fsync(&self, req: &Request, ino: INodeNo, fh: FuseFh, datasync: bool, reply: ReplyEmpty) {
        self.empty_op(req, ino, reply, |node| Op::Fsync { node, fh: FileHandle(fh.0), datasync })
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino.0 == LEVELS_DIR_INO {
            return reply.opened(FuseFh(0), FopenFlags::empty());
        }
        let (level, view, node) = match self.decode(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        match level.call(&caller(req), &Op::OpenDir { node }) {
            Ok(Reply::Opened(o)) => {
                // The kernel may cache the listing; it drops it when the directory changes
                // through this mount or its mtime moves.
                let flags = if view == 0 { FopenFlags::FOPEN_CACHE_DIR } else { FopenFlags::empty() };
                reply.opened(FuseFh(o.fh.0), flags)
            }
            Ok(_) => reply.error(Errno::EIO),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: u64, mut reply: ReplyDirectory) {
        if ino.0 == LEVELS_DIR_INO {
            for (i, (ino, kind, name)) in self.levels_dir_entries().into_iter().enumerate().skip(offset as usize) {
                if reply.add(INodeNo(ino), (i + 1) as u64, kind, name) {
                    break;
                }
            }
            return reply.ok();
        }
        let (view, mut batch) = match self.dir_batch(req, ino, fh, offset, false) {
            Ok(b) => b,
            Err(e) => return reply.error(e),
        };
        while let Some(e) = batch.pop_front() {
            if self.hides(view, ino, &e.name) {
                continue;
            }
            if reply.add(INodeNo(Self::encode(view, e.node)), e.next_offset, file_type(e.kind), &e.name) {
                batch.push_front(e);
                break;
            }
        }
        if !batch.is_empty() {
            self.dir_pending.lock().insert((ino.0, fh.0), batch);
        }
        reply.ok()
    }

    fn readdirplus(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: u64, mut reply: ReplyDirectoryPlus) {
        if ino.0 == LEVELS_DIR_INO {
            let cx = caller(req);
            for (i, (ino, _, name)) in self.levels_dir_entries().into_iter().enumerate().skip(offset as usize) {
                let view = (ino >> VIEW_SHIFT) as usize;
                let attr = match self.stack.view(view).map(|l| l.getattr(&cx, NodeId::ROOT)) {
                    Some(Ok(a)) if name != "." && name != ".." => fuse_attr(ino, &a),
                    _ => blank_attr(ino),
                };
                // Each level's root is counted by the kernel like a lookup; its forget reaches
                // the root, which is never forgotten.
                if reply.add(INodeNo(ino), (i + 1) as u64, name, &self.options.entry_ttl, &attr, Generation(0)) {
                    break;
                }
            }
            return reply.ok();
        }
        let (view, mut batch) = match self.dir_batch(req, ino, fh, offset, true) {
            Ok(b) => b,
            Err(e) => return reply.error(e),
        };
        let Some(level) = self.stack.view(view) else {
            return reply.error(Errno::ESTALE);
        };
        while let Some(e) = batch.pop_front() {
            if self.hides(view, ino, &e.name) {
                self.forget_entries(&level, [e]);
                continue;
            }
            let full = match &e.entry {
                Some(entry) => {
                    let attr = fuse_attr(Self::encode(view, entry.node), &entry.attr);
                    reply.add(attr.ino, e.next_offset, &e.name, &self.options.entry_ttl, &attr, Generation(entry.generation))
                }
                None => {
                    // `.` and `..`: the kernel never links these, so no lookup is counted.
                    let attr = blank_attr(Self::encode(view, e.node));
                    reply.add(attr.ino, e.next_offset, &e.name, &Duration::ZERO, &attr, Generation(0))
                }
            };
            if full {
                batch.push_front(e);
                break;
            }
        }
        if !batch.is_empty() {
            self.dir_pending.lock().insert((ino.0, fh.0), batch);
        }
        reply.ok()
    }

    fn releasedir(&self, req: &Request, ino: INodeNo, fh: FuseFh, _flags: OpenFlags, reply: ReplyEmpty) {
        if ino.0 == LEVELS_DIR_INO {
            return reply.ok();
        }
        if let Some(pending) = self.dir_pending.lock().remove(&(ino.0, fh.0)) {
            if let Ok((level, _, _)) = self.decode(ino) {
                self.forget_entries(&level, pending);
            }
        }
        self.empty_op(req, ino, reply, |node| Op::ReleaseDir { node, fh: FileHandle(fh.0) })
    }

    fn fsyncdir(&self, req: &Request, ino: INodeNo, fh: FuseFh, datasync: bool, reply: ReplyEmpty) {
        if ino.0 == LEVELS_DIR_INO {
            return reply.ok();
        }
        self.empty_op(req, ino, reply, |node| Op::FsyncDir { node, fh: FileHandle(fh.0), datasync })
    }

    fn statfs(&self, req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        let ino = if ino.0 == LEVELS_DIR_INO { INodeNo(NodeId::ROOT.0) } else { ino };
        let (level, _, node) = match self.decode(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        match level.call(&caller(req), &Op::StatFs { node }) {
            Ok(Reply::StatFs(s)) => reply.statfs(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize),
            Ok(_) => reply.error(Errno::EIO),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, value: &[u8], flags: i32, _position: u32, reply: ReplyEmpty) {
        if ino.0 == LEVELS_DIR_INO {
            return reply.error(Errno::EPERM);
        }
        self.empty_op(req, ino, reply, |node| Op::SetXattr { node, name, value, flags })
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if ino.0 == LEVELS_DIR_INO {
            return reply.error(Errno::ENODATA);
        }
        self.xattr_op(req, ino, reply, |node| Op::GetXattr { node, name, size })
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        if ino.0 == LEVELS_DIR_INO {
            return if size == 0 { reply.size(0) } else { reply.data(&[]) };
        }
        self.xattr_op(req, ino, reply, |node| Op::ListXattr { node, size })
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        if ino.0 == LEVELS_DIR_INO {
            return reply.error(Errno::EPERM);
        }
        self.empty_op(req, ino, reply, |node| Op::RemoveXattr { node, name })
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        if ino.0 == LEVELS_DIR_INO {
            return reply.ok();
        }
        self.empty_op(req, ino, reply, |node| Op::Access { node, mask: mask.bits() })
    }

    fn fallocate(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: u64, length: u64, mode: i32, reply: ReplyEmpty) {
        self.empty_op(req, ino, reply, |node| Op::Fallocate { node, fh: FileHandle(fh.0), offset, length, mode })
    }

    /// No layer defines ioctls (extended operations travel through the control socket), so
    /// answer as a file system without ioctls does.
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FuseFh,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }

    fn lseek(&self, req: &Request, ino: INodeNo, fh: FuseFh, offset: i64, whence: i32, reply: ReplyLseek) {
        let (level, _, node) = match self.decode(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        match level.call(&caller(req), &Op::Lseek { node, fh: FileHandle(fh.0), offset, whence }) {
            Ok(Reply::Offset(o)) => reply.offset(o as i64),
            Ok(_) => reply.error(Errno::EIO),
            Err(e) => reply.error(errno(&e)),
        }
    }
}
