//! The FUSE adapter: each kernel request becomes one [`Op`] entering the stack at the top (or at
//! the level a `.plyfs/NAME` path selects), and the answer goes back to the kernel.
//!
//! The handlers here know nothing of how requests arrive: they take plain arguments and return
//! plain answers ([`NodeOut`], [`OpenOut`], ...). Two transports carry them: plyfs's
//! `/dev/fuse` loop ([`crate::devloop`]) and FUSE over io_uring ([`crate::uring`]).
//!
//! - `options` holds what the front end is told and tells back;
//! - `inode`, how a node of one view packs into an inode number;
//! - `backing`, the kernel passthrough references of the fast path;
//! - `requests`, one handler per request; this module, the state they share.

mod backing;
mod inode;
mod options;
mod requests;

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use plyfs_stack::{
    Attr, Caller, DataPath, DirEntry, Error, FileHandle, FileKind, Level, NodeId, Op, Opened, Reply, SetAttr, Stack, XattrReply,
};

use backing::{have_cap_sys_admin, Backing, BackingTable};
use inode::{pack_ino, unpack_ino, LEVELS_DIR_INO};
pub(crate) use backing::{BackingMap, BACKING_CLOSE, BACKING_OPEN};
pub use options::{FanIn, FrontOptions, FrontStatus, IoMode};

/// The reserved name, at the root of the mount, of the directory that holds one view per level.
pub const LEVELS_DIR: &str = ".plyfs";

/// `FOPEN_*` flags of an open's answer (`include/uapi/linux/fuse.h`).
pub(crate) mod fopen {
    pub const DIRECT_IO: u32 = 1 << 0;
    pub const KEEP_CACHE: u32 = 1 << 1;
    pub const CACHE_DIR: u32 = 1 << 3;
    pub const NOFLUSH: u32 = 1 << 5;
    pub const PASSTHROUGH: u32 = 1 << 7;
}

/// An errno, as the kernel gets it back.
pub(crate) type Res<T> = Result<T, i32>;

/// A node as the kernel sees it. Inode number 0 is a negative entry: the kernel remembers that
/// the name is absent.
pub(crate) struct NodeOut {
    pub ino: u64,
    pub generation: u64,
    pub attr: Attr,
}

/// The answer to `open`, `opendir` and the open half of `create`.
pub(crate) struct OpenOut {
    pub fh: u64,
    /// `FOPEN_*` flags; [`fopen::PASSTHROUGH`] when `backing` is set.
    pub flags: u32,
    pub backing: Option<Arc<Backing>>,
}

/// Where `readdir` and `readdirplus` put their entries: the transport's reply buffer.
pub(crate) trait DirSink {
    /// Add one entry, with `node` and `ttl` for `readdirplus`. False when it does not fit (it
    /// was not added).
    fn push(&mut self, ino: u64, offset: u64, kind: FileKind, name: &OsStr, node: &NodeOut, ttl: Duration) -> bool;
}

/// The FUSE front end of a stack, shared by the transports that carry its requests.
pub struct FuseFs {
    stack: Arc<Stack>,
    pub(crate) options: FrontOptions,
    passthrough: AtomicBool,
    status: Arc<FrontStatus>,
    /// `/dev/fuse`, for passthrough references.
    dev: Arc<OwnedFd>,
    backing: Mutex<BackingTable>,
    /// How many passthrough opens for writing live (spares the lock in [`FuseFs::attr_ttl`]).
    writable_passthrough: AtomicUsize,
    /// Entries fetched for `readdirplus` that did not fit the kernel's buffer, kept (with their
    /// lookups) for the next call so no lookup is wasted.
    dir_pending: Mutex<HashMap<(u64, u64), VecDeque<DirEntry>>>,
    started: SystemTime,
    /// POSIX ACLs negotiated (see [`FuseFs::new_mode`]).
    posix_acl: AtomicBool,
    /// The user the daemon runs as: the mount's owner (for `-o fanin=owner`).
    owner: u32,
    /// Tells the kernel to drop what it caches, once the session is up: the same handle the
    /// stack's layers use for the changes they see behind the kernel's back.
    kernel: std::sync::OnceLock<Arc<KernelCache>>,
}

/// A request as it entered the stack: its name (`read`, `lookup`...) and the object it was
/// on (`node`, or `entry` in directory `node`), to name them if it meets a corrupt object.
#[derive(Clone, Copy)]
pub(crate) struct RequestOn<'a> {
    request: &'a str,
    level: &'a Level,
    node: NodeId,
    entry: Option<&'a OsStr>,
}

impl<'a> RequestOn<'a> {
    pub(crate) fn new(request: &'a str, level: &'a Level, node: NodeId) -> Self {
        RequestOn { request, level, node, entry: None }
    }

    /// The request is on the entry `name` of directory `node`.
    pub(crate) fn entry(self, name: &'a OsStr) -> Self {
        RequestOn { entry: Some(name), ..self }
    }
}

/// The errno a failed request answers. A corrupt object is logged, naming the request and the
/// object; other errors (`ENOENT`, `EACCES`...) are ordinary answers and log nothing.
fn errno(e: &Error, on: RequestOn<'_>) -> i32 {
    if let Error::Corrupt(msg) = e {
        tracing::error!("{}: {}: {msg}", object_name(&on), on.request);
    }
    e.errno()
}

/// How a log line names the object of a request: its path in the mount, as the bottom layer's
/// `lower-info` gives it (translated by the layers between), else its path in the lower
/// directory, else its inode number. Asked only when something is to be logged.
fn object_name(on: &RequestOn<'_>) -> String {
    let node = on.node.0;
    let info = on.level.extended(&Caller::daemon(), on.node, "lower-info", &[]).ok();
    let field = |name| info.as_ref().and_then(|v| v.get(name)).and_then(serde_json::Value::as_str);
    let dir = match (field("path"), field("lower_path")) {
        (Some(path), _) if !path.is_empty() || on.node == NodeId::ROOT => Some(format!("/{path}")),
        (_, Some(lower)) if !lower.is_empty() => Some(lower.to_owned()),
        _ => None,
    };
    match (dir, on.entry) {
        (Some(dir), Some(name)) => {
            format!("{}/{} (in directory inode {node})", dir.trim_end_matches('/'), name.to_string_lossy())
        }
        (Some(path), None) => format!("{path} (inode {node})"),
        (None, Some(name)) => format!("{} in directory inode {node}", name.to_string_lossy()),
        (None, None) => format!("inode {node}"),
    }
}

/// The kernel's caches of a mount, dropped for changes made behind its back: by the layers
/// (through [`plyfs_stack::Invalidator`]; node ids of the top level are the mount's inode
/// numbers) and by the front end itself.
pub(crate) struct KernelCache(pub(crate) fuser::Notifier);

impl KernelCache {
    /// The attributes of `ino` only, not its pages.
    fn attributes(&self, ino: u64) {
        // Offset -1: the attributes only, not the page cache. ENOENT: the kernel has
        // forgotten the inode; nothing to drop.
        let _ = self.0.inval_inode(fuser::INodeNo(ino), -1, 0);
    }
}

impl plyfs_stack::Invalidator for KernelCache {
    fn node(&self, node: NodeId) {
        // ENOENT: the kernel does not know the inode (any more); nothing to drop.
        let _ = self.0.inval_inode(fuser::INodeNo(node.0), 0, 0);
    }

    fn entry(&self, parent: NodeId, name: &std::ffi::OsStr) {
        let _ = self.0.inval_entry(fuser::INodeNo(parent.0), name);
    }
}

/// Attributes for answers whose attributes the kernel ignores: negative entries, and `.` and
/// `..` in `readdirplus`.
fn blank(ino: u64) -> NodeOut {
    let attr = Attr {
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        kind: FileKind::Dir,
        perm: 0,
        nlink: 1,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
    };
    NodeOut { ino, generation: 0, attr }
}

fn expect<T>(r: plyfs_stack::Result<Reply>, request: RequestOn<'_>, pick: impl FnOnce(Reply) -> Option<T>) -> Res<T> {
    match r {
        Ok(reply) => pick(reply).ok_or(libc::EIO),
        Err(e) => Err(errno(&e, request)),
    }
}

impl FuseFs {
    pub fn new(stack: Arc<Stack>, options: FrontOptions, dev: Arc<OwnedFd>) -> (FuseFs, Arc<FrontStatus>) {
        let status = Arc::new(FrontStatus {
            io_mode: Mutex::new(None),
            passthrough_failed: AtomicBool::new(false),
            passthrough_refused: AtomicBool::new(false),
            active: AtomicBool::new(true),
            open: std::sync::atomic::AtomicI64::new(0),
        });
        let fs = FuseFs {
            stack,
            options,
            passthrough: AtomicBool::new(false),
            status: status.clone(),
            dev,
            backing: Mutex::new(BackingTable::default()),
            writable_passthrough: AtomicUsize::new(0),
            dir_pending: Mutex::new(HashMap::new()),
            started: SystemTime::now(),
            posix_acl: AtomicBool::new(false),
            owner: unsafe { libc::geteuid() },
            kernel: std::sync::OnceLock::new(),
        };
        (fs, status)
    }

    pub(crate) fn set_kernel_cache(&self, cache: Arc<KernelCache>) {
        let _ = self.kernel.set(cache);
    }

    /// Make the kernel ask for `ino`'s attributes again, for a change it did not see: an ioctl
    /// that sets file flags changes the ctime without a setattr, and a passthrough open for
    /// writing lets writes through a shared mapping change the times without any request. Sent
    /// before the reply, so that the caller's next `stat` sees the change (a kernel file
    /// system's times change at once).
    fn drop_cached_attributes(&self, ino: u64) {
        if let Some(cache) = self.kernel.get() {
            cache.attributes(ino);
        }
    }

    /// The level and node a FUSE inode number stands for. A view whose level is gone (a
    /// removed branch) answers ESTALE. The top view, which nearly every request names, is
    /// borrowed; the others are looked up in the stack's views.
    fn level_of(&self, ino: u64) -> Res<(Cow<'_, Level>, usize, NodeId)> {
        // Nearly every request names an inode: it counts as use of the mount. Written only
        // when the flag was cleared, so requests on several CPUs do not fight over it.
        if !self.status.active.load(Ordering::Relaxed) {
            self.status.active.store(true, Ordering::Relaxed);
        }
        self.level_unused(ino)
    }

    /// [`FuseFs::level_of`] for requests that only look at the mount as a whole when they name
    /// its root: `df` and desktop monitors stat the mount point, open and close it, and ask how
    /// full it is every few seconds, and an idle mount must still go (`-o idle`), as
    /// gocryptfs's `-idle` does. Reading the root's listing, or anything below it, is use.
    fn level_of_unless_root(&self, ino: u64) -> Res<(Cow<'_, Level>, usize, NodeId)> {
        if ino == NodeId::ROOT.0 {
            self.level_unused(ino)
        } else {
            self.level_of(ino)
        }
    }

    /// [`FuseFs::level_of`] without counting the request as use of the mount (`statfs`, and
    /// see [`FuseFs::level_of_unless_root`]).
    fn level_unused(&self, ino: u64) -> Res<(Cow<'_, Level>, usize, NodeId)> {
        let (view, node) = unpack_ino(ino);
        if view == 0 {
            return Ok((Cow::Borrowed(self.stack.top()), 0, node));
        }
        match self.stack.view(view) {
            Some(level) => Ok((Cow::Owned(level), view, node)),
            None => Err(libc::ESTALE),
        }
    }

    /// Whether `cx` may use the fan-in paths (`-o fanin=`): `EACCES` for others, `ENOENT` for
    /// everyone when they are off.
    fn may_fan_in(&self, cx: &Caller) -> Res<()> {
        match self.options.fanin {
            FanIn::All => Ok(()),
            FanIn::Owner if cx.uid == self.owner || cx.uid == 0 => Ok(()),
            FanIn::Owner => Err(libc::EACCES),
            FanIn::None => Err(libc::ENOENT),
        }
    }

    fn is_levels_dir_name(&self, parent: u64, name: &OsStr) -> bool {
        parent == NodeId::ROOT.0 && name == LEVELS_DIR
    }

    fn levels_dir_attr(&self) -> NodeOut {
        let root = self.stack.top().getattr(&Caller::daemon(), NodeId::ROOT).ok();
        // With `fanin=owner`, the kernel (default_permissions) keeps everyone but the owner and
        // root out of `.plyfs`, even through a cached entry; the daemon checks again.
        let (perm, uid) = match self.options.fanin {
            FanIn::All => (0o555, root.map_or(0, |a| a.uid)),
            FanIn::Owner | FanIn::None => (0o500, self.owner),
        };
        let attr = Attr {
            size: 0,
            blocks: 0,
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            kind: FileKind::Dir,
            perm,
            nlink: 2,
            uid,
            gid: root.map_or(0, |a| a.gid),
            rdev: 0,
            blksize: 4096,
        };
        NodeOut { ino: LEVELS_DIR_INO, generation: 0, attr }
    }

    fn node_out(view: usize, entry: plyfs_stack::Entry) -> NodeOut {
        NodeOut { ino: pack_ino(view, entry.node), generation: entry.generation, attr: entry.attr }
    }

    fn entry_op<'a>(&self, cx: &Caller, parent: u64, name: &OsStr, op: impl FnOnce(NodeId) -> Op<'a>) -> Res<NodeOut> {
        if self.is_levels_dir_name(parent, name) {
            return Err(libc::EEXIST);
        }
        let (level, view, node) = self.level_of(parent)?;
        let op = op(node);
        expect(level.call(cx, &op), RequestOn::new(op.name(), &level, node).entry(name), |r| match r {
            Reply::Entry(e) => Some(Self::node_out(view, e)),
            _ => None,
        })
    }

    fn empty_op<'a>(&self, cx: &Caller, ino: u64, op: impl FnOnce(NodeId) -> Op<'a>) -> Res<()> {
        let (level, _, node) = self.level_of(ino)?;
        let op = op(node);
        level.call(cx, &op).map(drop).map_err(|e| errno(&e, RequestOn::new(op.name(), &level, node)))
    }

    /// `getxattr` or `listxattr`: the answer is a value, or only its size.
    fn xattr_op<'a>(&self, cx: &Caller, ino: u64, op: impl FnOnce(NodeId) -> Op<'a>) -> Res<XattrReply> {
        let (level, _, node) = self.level_of(ino)?;
        let op = op(node);
        expect(level.call(cx, &op), RequestOn::new(op.name(), &level, node), |r| match r {
            Reply::Xattr(x) => Some(x),
            _ => None,
        })
    }

    /// An operation on a name in a directory that answers nothing. The reserved `.plyfs` is busy,
    /// like a mount point.
    fn name_op<'a>(&self, cx: &Caller, parent: u64, name: &OsStr, op: impl FnOnce(NodeId) -> Op<'a>) -> Res<()> {
        if self.is_levels_dir_name(parent, name) {
            return Err(libc::EBUSY);
        }
        let (level, _, node) = self.level_of(parent)?;
        let op = op(node);
        level.call(cx, &op).map(drop).map_err(|e| errno(&e, RequestOn::new(op.name(), &level, node).entry(name)))
    }

    /// Open flags for a file opened without passthrough.
    fn cache_flags(&self, view: usize, opened: &Opened) -> u32 {
        let cache = if opened.direct_io {
            fopen::DIRECT_IO
        } else if view == 0 && !self.options.shared {
            // The page cache stays valid across opens: all changes come through this mount,
            // and FUSE_AUTO_INVAL_DATA drops it when the attributes show an outside change.
            fopen::KEEP_CACHE
        } else {
            // Lower views share files with the top one; start each open from fresh pages.
            0
        };
        cache | Self::flush_flags(opened)
    }

    /// Spare the `flush` round trip at every close when nothing in the stack needs it.
    fn flush_flags(opened: &Opened) -> u32 {
        if opened.flush_on_close { 0 } else { fopen::NOFLUSH }
    }

    /// The answer to an open: passthrough where it applies, the page cache otherwise.
    ///
    /// A write through a shared mapping of a passthrough file changes the lower file's mtime
    /// and ctime, and no request tells us (nor the kernel's copy of the attributes). So while a
    /// passthrough open for writing lives (a mapping keeps its open alive), the inode's
    /// attributes are given without a timeout, the ones the kernel held from before the open
    /// are dropped, and so are those it holds when the open ends: a `stat` then asks, as
    /// xfstests generic/080 and 215 expect. A file just created keeps the attributes its
    /// creation gave for the mount's timeout, as dropping them costs a request per file on an
    /// untar (a mapped write to it shows at its release). Keeping the `flush` at close to drop
    /// them there cost 30–50% on an untar. `write(2)` through passthrough needs none of it: the
    /// kernel drops the times itself after a write.
    fn open_out(&self, ino: u64, view: usize, opened: &Opened, flags: i32, created: bool) -> OpenOut {
        match self.backing_for(ino, opened) {
            Some(b) => {
                if flags & libc::O_ACCMODE != libc::O_RDONLY {
                    let first = {
                        let mut table = self.backing.lock();
                        table.writable_opens.insert((ino, opened.fh.0));
                        let n = table.writers.entry(ino).or_insert(0);
                        *n += 1;
                        *n == 1
                    };
                    self.writable_passthrough.fetch_add(1, Ordering::Relaxed);
                    if first && !created {
                        self.drop_cached_attributes(ino);
                    }
                }
                OpenOut { fh: opened.fh.0, flags: Self::flush_flags(opened) | fopen::PASSTHROUGH, backing: Some(b) }
            }
            None => OpenOut { fh: opened.fh.0, flags: self.cache_flags(view, opened), backing: None },
        }
    }

    /// How long the kernel may keep `ino`'s attributes: the mount's timeout, or none while a
    /// passthrough open for writing lives (see [`FuseFs::open_out`]).
    pub(crate) fn attr_ttl(&self, ino: u64) -> Duration {
        if self.writable_passthrough.load(Ordering::Relaxed) > 0 && self.backing.lock().writers.contains_key(&ino) {
            Duration::ZERO
        } else {
            self.options.attr_ttl
        }
    }

    /// The kernel passthrough reference for this open, if passthrough applies.
    fn backing_for(&self, ino: u64, opened: &Opened) -> Option<Arc<Backing>> {
        if !self.passthrough.load(Ordering::Relaxed) || self.status.passthrough_refused.load(Ordering::Relaxed) {
            return None;
        }
        let fd = opened.backing.as_ref()?;
        let mut table = self.backing.lock();
        let id = match table.by_inode.get(&ino).and_then(Weak::upgrade) {
            Some(id) => id,
            None => match Backing::open(&self.dev, fd) {
                Ok(id) => {
                    let id = Arc::new(id);
                    table.by_inode.insert(ino, Arc::downgrade(&id));
                    id
                }
                Err(e) => {
                    if !self.status.passthrough_failed.swap(true, Ordering::Relaxed) {
                        tracing::warn!("inode {ino}: passthrough refused by the kernel ({e}); such files use FUSE I/O");
                    }
                    return None;
                }
            },
        };
        table.by_open.insert((ino, opened.fh.0), id.clone());
        table.files.insert((ino, opened.fh.0), fd.clone());
        Some(id)
    }

    fn release_backing(&self, ino: u64, fh: u64) {
        let mut table = self.backing.lock();
        table.files.remove(&(ino, fh));
        let mut last_writer = false;
        if table.writable_opens.remove(&(ino, fh)) {
            self.writable_passthrough.fetch_sub(1, Ordering::Relaxed);
            if let Some(n) = table.writers.get_mut(&ino) {
                *n -= 1;
                last_writer = *n == 0;
            }
            if last_writer {
                table.writers.remove(&ino);
            }
        }
        if table.by_open.remove(&(ino, fh)).is_some()
            && table.by_inode.get(&ino).is_some_and(|w| w.strong_count() == 0)
        {
            table.by_inode.remove(&ino);
        }
        drop(table);
        if last_writer {
            // Whatever a mapping wrote shows at the next `stat` (see `open_out`).
            self.drop_cached_attributes(ino);
        }
    }

    /// Clear the set-user-ID bit, and the set-group-ID bit of a group-executable file, as a
    /// kernel file system does when an unprivileged caller writes or truncates a file. With
    /// FUSE_HANDLE_KILLPRIV_V2 the kernel leaves this to us: it says so with an empty SETATTR
    /// before a write (also one through passthrough, which never reaches us), with
    /// FUSE_WRITE_KILL_SUIDGID on a write, and by truncating as an unprivileged caller.
    ///
    /// By node, never by the kernel's file handle: a data layer hands its own handles up, and
    /// one that passes a getattr's handle down unchanged (sca, crypt) had the level below answer
    /// with another open file's attributes, whose mode was then set on this file (#28).
    fn kill_privileges(&self, level: &Level, cx: &Caller, node: NodeId) -> plyfs_stack::Result<()> {
        let attr = level.getattr(cx, node)?;
        if attr.kind != FileKind::File {
            return Ok(());
        }
        let mode = u32::from(attr.perm);
        let kept = plyfs_stack::setid::without_privileges(mode, plyfs_stack::setid::in_group(cx, attr.gid));
        if kept != mode {
            let set = SetAttr { mode: Some(kept), ..SetAttr::default() };
            level.call(&Caller::daemon(), &Op::SetAttr { node, fh: None, set })?;
        }
        Ok(())
    }

    /// How file data moves, given what the kernel offers. Passthrough is then asked for only
    /// when the answer is [`IoMode::Passthrough`].
    pub(crate) fn decide_io_mode(&self, kernel_has_passthrough: bool) -> IoMode {
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

    /// Record what the kernel and the daemon agreed on: whether passthrough is on, and so how
    /// file data moves.
    pub(crate) fn settle_io_mode(&self, mode: IoMode, passthrough: bool) {
        self.passthrough.store(passthrough, Ordering::Relaxed);
        let mode = if passthrough || mode != IoMode::Passthrough {
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
    }

    pub(crate) fn destroy(&self) {
        self.stack.shutdown();
    }

    fn levels_dir_entries(&self) -> Vec<(u64, String)> {
        let mut entries = vec![(LEVELS_DIR_INO, ".".to_owned()), (NodeId::ROOT.0, "..".to_owned())];
        self.stack.refresh_views();
        for (view, name) in self.stack.views() {
            entries.push((pack_ino(view, NodeId::ROOT), name));
        }
        entries
    }

    /// Fetch directory entries for the kernel, first from what the last call left over.
    fn dir_batch(&self, cx: &Caller, ino: u64, fh: u64, offset: u64, plus: bool) -> Res<(usize, VecDeque<DirEntry>)> {
        let (level, view, node) = self.level_of(ino)?;
        if let Some(pending) = self.dir_pending.lock().remove(&(ino, fh)) {
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
        let op = Op::ReadDir { node, fh: FileHandle(fh), offset, max_entries, plus };
        let request = RequestOn::new(if plus { "readdirplus" } else { "readdir" }, &level, node);
        expect(level.call(cx, &op), request, |r| match r {
            Reply::Dir(entries) => Some((view, entries.into())),
            _ => None,
        })
    }

    fn forget_entries(&self, level: &Level, entries: impl IntoIterator<Item = DirEntry>) {
        let cx = Caller::daemon();
        for e in entries {
            if let Some(entry) = e.entry {
                level.forget(&cx, entry.node, 1);
            }
        }
    }

    fn hides(&self, view: usize, dir: u64, name: &OsStr) -> bool {
        view == 0 && dir == NodeId::ROOT.0 && name == LEVELS_DIR
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_corrupt_object_is_named_by_its_path_else_its_inode() {
        let dir = std::env::temp_dir().join(format!("plyfs-fuse-object-name-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("docs")).unwrap();
        std::fs::write(dir.join("docs/a.txt"), b"x").unwrap();
        let level = Level::new(Arc::new(plyfs_stack::LowerDir::open(&dir).unwrap()));
        let cx = Caller::daemon();
        let docs = level.lookup(&cx, NodeId::ROOT, OsStr::new("docs")).unwrap();
        let file = level.lookup(&cx, docs.node, OsStr::new("a.txt")).unwrap();
        let named = |node, entry| object_name(&RequestOn { request: "read", level: &level, node, entry });
        assert_eq!(named(file.node, None), format!("/docs/a.txt (inode {})", file.node.0));
        assert_eq!(named(docs.node, Some(OsStr::new("b"))), format!("/docs/b (in directory inode {})", docs.node.0));
        assert_eq!(named(NodeId::ROOT, None), format!("/ (inode {})", NodeId::ROOT.0));
        assert_eq!(named(NodeId::ROOT, Some(OsStr::new("c"))), format!("/c (in directory inode {})", NodeId::ROOT.0));
        assert_eq!(named(NodeId(999_999), None), "inode 999999");
        assert_eq!(named(NodeId(999_999), Some(OsStr::new("d"))), "d in directory inode 999999");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
