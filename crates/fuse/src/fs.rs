//! The FUSE adapter: each kernel request becomes one [`Op`] entering the stack at the top (or at
//! the level a `.plyfs/NAME` path selects), and the answer goes back to the kernel.
//!
//! The handlers here know nothing of how requests arrive: they take plain arguments and return
//! plain answers ([`NodeOut`], [`OpenOut`], ...). Two transports carry them: the classic
//! `/dev/fuse` loop of fuser ([`crate::classic`]) and FUSE over io_uring ([`crate::uring`]).
//!
//! Inode numbers: FUSE node id and `st_ino` are one number here (fuser sends the same value for
//! both). The top view uses the stack's node ids as they are; the view below layer `i` puts
//! `i + 1` in the top byte. `.plyfs` itself has the reserved top byte `0xff`.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use plyfs_stack::{
    Attr, Caller, DataPath, DirEntry, Error, FileHandle, FileKind, Level, NodeId, Op, Opened, Reply, SetAttr, Stack,
    StatFs, XattrReply,
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
    /// Who may use the fan-in paths under `.plyfs/` (`-o fanin=owner|all|none`).
    pub fanin: FanIn,
}

/// Who may reach the fan-in views under `MNT/.plyfs/` (`-o fanin=`). The views go below layers
/// (a `trace` audit, a per-file policy), so they are the mount owner's to hand out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FanIn {
    /// The mount's owner and root (the default): `.plyfs` is mode 0500, owned by the owner;
    /// anyone else gets `EACCES`.
    #[default]
    Owner,
    /// Every user the mount lets in (`allow_other`), as far as the files' own modes allow.
    All,
    /// No one: `.plyfs` does not resolve (`ENOENT`); `OP@LAYER` through `plyfs op` still works.
    None,
}

impl FanIn {
    pub fn parse(text: &str) -> Option<FanIn> {
        match text {
            "owner" => Some(FanIn::Owner),
            "all" => Some(FanIn::All),
            "none" => Some(FanIn::None),
            _ => None,
        }
    }
}

impl Default for FrontOptions {
    fn default() -> Self {
        FrontOptions {
            entry_ttl: Duration::from_secs(1),
            attr_ttl: Duration::from_secs(1),
            passthrough: true,
            no_passthrough_because: None,
            shared: false,
            fanin: FanIn::Owner,
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
    /// A request was served since [`FrontStatus::take_active`] last looked.
    active: AtomicBool,
    /// Files and directories open now.
    open: std::sync::atomic::AtomicI64,
}

impl FrontStatus {
    /// Whether any request was served since the last call (for `-o idle`).
    pub fn take_active(&self) -> bool {
        self.active.swap(false, Ordering::Relaxed)
    }

    /// How many files and directories are open through the mount.
    pub fn open_count(&self) -> i64 {
        self.open.load(Ordering::Relaxed)
    }

    fn opened(&self, by: i64) {
        self.open.fetch_add(by, Ordering::Relaxed);
    }

    pub fn io_mode(&self) -> Option<IoMode> {
        self.io_mode.lock().clone()
    }

    /// Passthrough cannot serve this mount's files: every file uses FUSE I/O.
    pub(crate) fn refuse_passthrough(&self, reason: String) {
        self.passthrough_refused.store(true, Ordering::Relaxed);
        *self.io_mode.lock() = Some(IoMode::Cached { reason });
    }
}

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

/// A kernel passthrough reference to a lower file (`FUSE_DEV_IOC_BACKING_OPEN`), closed when
/// the last open of its inode is released.
pub(crate) struct Backing {
    dev: Arc<OwnedFd>,
    pub(crate) id: u32,
}

// _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t).
pub(crate) const BACKING_OPEN: libc::c_ulong = 0x4010_e501;
pub(crate) const BACKING_CLOSE: libc::c_ulong = 0x4004_e502;

#[repr(C)]
pub(crate) struct BackingMap {
    pub fd: i32,
    pub flags: u32,
    pub padding: u64,
}

impl Backing {
    fn open(dev: &Arc<OwnedFd>, file: &OwnedFd) -> std::io::Result<Backing> {
        let map = BackingMap { fd: file.as_raw_fd(), flags: 0, padding: 0 };
        let id = unsafe { libc::ioctl(dev.as_raw_fd(), BACKING_OPEN, &map) };
        if id <= 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Backing { dev: dev.clone(), id: id as u32 })
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        // Fails harmlessly once the connection is gone, which closes every backing file.
        unsafe { libc::ioctl(self.dev.as_raw_fd(), BACKING_CLOSE, &self.id) };
    }
}

/// Kernel passthrough references, one per inode while any open of it lives.
#[derive(Default)]
struct BackingTable {
    by_inode: HashMap<u64, Weak<Backing>>,
    by_open: HashMap<(u64, u64), Arc<Backing>>,
    /// The lower file of each open that goes through passthrough, for `copy_file_range`.
    files: HashMap<(u64, u64), Arc<OwnedFd>>,
    /// The passthrough opens for writing, and how many each inode has: while an inode has one,
    /// its attributes are given without a timeout (see [`FuseFs::attr_ttl`]).
    writable_opens: std::collections::HashSet<(u64, u64)>,
    writers: HashMap<u64, u32>,
}

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
    /// Tells the kernel to drop what it caches, once the session is up.
    kernel: std::sync::OnceLock<fuser::Notifier>,
}

fn errno(e: &Error) -> i32 {
    if let Error::Corrupt(msg) = e {
        tracing::error!("{msg}");
    }
    e.errno()
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

/// Whether this process may register passthrough files (`FUSE_DEV_IOC_BACKING_OPEN` needs
/// CAP_SYS_ADMIN).
fn have_cap_sys_admin() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    plyfs_stack::has_capability(CAP_SYS_ADMIN)
}

fn expect<T>(r: plyfs_stack::Result<Reply>, pick: impl FnOnce(Reply) -> Option<T>) -> Res<T> {
    match r {
        Ok(reply) => pick(reply).ok_or(libc::EIO),
        Err(e) => Err(errno(&e)),
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

    pub(crate) fn set_notifier(&self, notifier: fuser::Notifier) {
        let _ = self.kernel.set(notifier);
    }

    /// Make the kernel ask for `ino`'s attributes again, for a change it did not see: an ioctl
    /// that sets file flags changes the ctime without a setattr, and a passthrough open for
    /// writing lets writes through a shared mapping change the times without any request. Sent
    /// before the reply, so that the caller's next `stat` sees the change (a kernel file
    /// system's times change at once).
    fn drop_cached_attributes(&self, ino: u64) {
        if let Some(n) = self.kernel.get() {
            // Offset -1: the attributes only, not the page cache. ENOENT: the kernel has
            // forgotten the inode; nothing to drop.
            let _ = n.inval_inode(fuser::INodeNo(ino), -1, 0);
        }
    }

    fn encode(view: usize, node: NodeId) -> u64 {
        ((view as u64) << VIEW_SHIFT) | node.0
    }

    /// The level and node a FUSE inode number stands for. A view whose level is gone (a
    /// removed branch) answers ESTALE. The top view, which nearly every request names, is
    /// borrowed; the others are looked up in the stack's views.
    fn decode(&self, ino: u64) -> Res<(Cow<'_, Level>, usize, NodeId)> {
        // Nearly every request names an inode: it counts as use of the mount. Written only
        // when the flag was cleared, so requests on several CPUs do not fight over it.
        if !self.status.active.load(Ordering::Relaxed) {
            self.status.active.store(true, Ordering::Relaxed);
        }
        let view = (ino >> VIEW_SHIFT) as usize;
        let node = NodeId(ino & NodeId::MAX);
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
        NodeOut { ino: Self::encode(view, entry.node), generation: entry.generation, attr: entry.attr }
    }

    fn entry_op<'a>(&self, cx: &Caller, parent: u64, name: &OsStr, op: impl FnOnce(NodeId) -> Op<'a>) -> Res<NodeOut> {
        if self.is_levels_dir_name(parent, name) {
            return Err(libc::EEXIST);
        }
        let (level, view, node) = self.decode(parent)?;
        expect(level.call(cx, &op(node)), |r| match r {
            Reply::Entry(e) => Some(Self::node_out(view, e)),
            _ => None,
        })
    }

    fn empty_op<'a>(&self, cx: &Caller, ino: u64, op: impl FnOnce(NodeId) -> Op<'a>) -> Res<()> {
        let (level, _, node) = self.decode(ino)?;
        level.call(cx, &op(node)).map(drop).map_err(|e| errno(&e))
    }

    /// `getxattr` or `listxattr`: the answer is a value, or only its size.
    fn xattr_op<'a>(&self, cx: &Caller, ino: u64, op: impl FnOnce(NodeId) -> Op<'a>) -> Res<XattrReply> {
        let (level, _, node) = self.decode(ino)?;
        expect(level.call(cx, &op(node)), |r| match r {
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
        self.empty_op(cx, parent, op)
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
                        tracing::warn!("passthrough refused by the kernel ({e}); such files use FUSE I/O");
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
            entries.push((Self::encode(view, NodeId::ROOT), name));
        }
        entries
    }

    /// Fetch directory entries for the kernel, first from what the last call left over.
    fn dir_batch(&self, cx: &Caller, ino: u64, fh: u64, offset: u64, plus: bool) -> Res<(usize, VecDeque<DirEntry>)> {
        let (level, view, node) = self.decode(ino)?;
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
        expect(level.call(cx, &op), |r| match r {
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

/// The requests, one method each, as the transports call them.
impl FuseFs {
    pub(crate) fn lookup(&self, cx: &Caller, parent: u64, name: &OsStr) -> Res<NodeOut> {
        if self.is_levels_dir_name(parent, name) {
            self.may_fan_in(cx)?;
            return Ok(self.levels_dir_attr());
        }
        if parent == LEVELS_DIR_INO || parent >> VIEW_SHIFT != 0 {
            self.may_fan_in(cx)?;
        }
        if parent == LEVELS_DIR_INO {
            let Some((view, level)) = name.to_str().and_then(|n| self.stack.view_named(n)).and_then(|v| Some((v, self.stack.view(v)?))) else {
                return Err(libc::ENOENT);
            };
            // The kernel will forget this root like any looked-up node; take the lookup that
            // forget will drop.
            return expect(level.call(cx, &Op::GetAttr { node: NodeId::ROOT, fh: None }), |r| match r {
                Reply::Attr(attr) => Some(Self::node_out(view, plyfs_stack::Entry { node: NodeId::ROOT, attr, generation: 0 })),
                _ => None,
            });
        }
        let (level, view, node) = self.decode(parent)?;
        match level.lookup(cx, node, name) {
            Ok(e) => Ok(Self::node_out(view, e)),
            // A negative entry: the kernel remembers the name is absent for the entry TTL.
            Err(Error::Os(libc::ENOENT)) => Ok(blank(0)),
            Err(e) => Err(errno(&e)),
        }
    }

    pub(crate) fn forget(&self, ino: u64, nlookup: u64) {
        if ino == LEVELS_DIR_INO {
            return;
        }
        if let Ok((level, _, node)) = self.decode(ino) {
            // Roots of views are never counted below (the root cannot be forgotten).
            level.forget(&Caller::daemon(), node, nlookup);
        }
    }

    pub(crate) fn getattr(&self, cx: &Caller, ino: u64, fh: Option<u64>) -> Res<NodeOut> {
        if ino == LEVELS_DIR_INO {
            return Ok(self.levels_dir_attr());
        }
        let (level, _, node) = self.decode(ino)?;
        expect(level.call(cx, &Op::GetAttr { node, fh: fh.map(FileHandle) }), |r| match r {
            Reply::Attr(attr) => Some(NodeOut { ino, generation: 0, attr }),
            _ => None,
        })
    }

    pub(crate) fn setattr(&self, cx: &Caller, ino: u64, fh: Option<u64>, set: SetAttr) -> Res<NodeOut> {
        if ino == LEVELS_DIR_INO {
            return Err(libc::EPERM);
        }
        let (level, _, node) = self.decode(ino)?;
        let fh = fh.map(FileHandle);
        let unprivileged = cx.uid != 0;
        if set == SetAttr::default() || (set.size.is_some() && unprivileged) {
            self.kill_privileges(&level, cx, node).map_err(|e| errno(&e))?;
        }
        expect(level.call(cx, &Op::SetAttr { node, fh, set }), |r| match r {
            Reply::Attr(attr) => Some(NodeOut { ino, generation: 0, attr }),
            _ => None,
        })
    }

    pub(crate) fn readlink(&self, cx: &Caller, ino: u64) -> Res<Vec<u8>> {
        let (level, _, node) = self.decode(ino)?;
        expect(level.call(cx, &Op::ReadLink { node }), |r| match r {
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
        let Ok((level, _, node)) = self.decode(parent) else { return false };
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
        let (level, view, parent) = self.decode(parent)?;
        let (_, new_view, new_parent) = self.decode(newparent)?;
        if view != new_view {
            return Err(libc::EXDEV);
        }
        let op = Op::Rename { parent, name, new_parent, new_name: newname, flags };
        level.call(cx, &op).map(drop).map_err(|e| errno(&e))
    }

    pub(crate) fn link(&self, cx: &Caller, ino: u64, newparent: u64, newname: &OsStr) -> Res<NodeOut> {
        let (_, view, node) = self.decode(ino)?;
        match self.decode(newparent) {
            Ok((_, new_view, _)) if new_view != view => return Err(libc::EXDEV),
            _ => {}
        }
        self.entry_op(cx, newparent, newname, |new_parent| Op::Link { node, new_parent, new_name: newname })
    }

    pub(crate) fn open(&self, cx: &Caller, ino: u64, flags: i32) -> Res<OpenOut> {
        let (level, view, node) = self.decode(ino)?;
        let opened = level.open(cx, node, flags).map_err(|e| errno(&e))?;
        self.status.opened(1);
        Ok(self.open_out(ino, view, &opened, flags, false))
    }

    pub(crate) fn create(&self, cx: &Caller, parent: u64, name: &OsStr, mode: u32, umask: u32, flags: i32) -> Res<(NodeOut, OpenOut)> {
        if self.is_levels_dir_name(parent, name) {
            return Err(libc::EEXIST);
        }
        let mode = self.new_mode(cx, parent, mode, umask);
        let (level, view, parent) = self.decode(parent)?;
        let (entry, opened) = level.create(cx, parent, name, mode, flags).map_err(|e| errno(&e))?;
        self.status.opened(1);
        let node = Self::node_out(view, entry);
        let open = self.open_out(node.ino, view, &opened, flags, true);
        Ok((node, open))
    }

    pub(crate) fn read(&self, cx: &Caller, ino: u64, fh: u64, offset: u64, size: u32) -> Res<Vec<u8>> {
        let (level, _, node) = self.decode(ino)?;
        level.read(cx, node, FileHandle(fh), offset, size).map_err(|e| errno(&e))
    }

    pub(crate) fn write(&self, cx: &Caller, ino: u64, fh: u64, offset: u64, data: &[u8], kill_suidgid: bool) -> Res<u32> {
        let (level, _, node) = self.decode(ino)?;
        if kill_suidgid {
            self.kill_privileges(&level, cx, node).map_err(|e| errno(&e))?;
        }
        level.write(cx, node, FileHandle(fh), offset, data).map_err(|e| errno(&e))
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
        let (level, view, node) = self.decode(ino)?;
        expect(level.call(cx, &Op::OpenDir { node }), |r| match r {
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
                let view = (ino >> VIEW_SHIFT) as usize;
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
                    let ino = Self::encode(view, e.node);
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
        if let Some(pending) = self.dir_pending.lock().remove(&(ino, fh)) {
            if let Ok((level, _, _)) = self.decode(ino) {
                self.forget_entries(&level, pending);
            }
        }
        self.empty_op(cx, ino, |node| Op::ReleaseDir { node, fh: FileHandle(fh) })
    }

    pub(crate) fn fsyncdir(&self, cx: &Caller, ino: u64, fh: u64, datasync: bool) -> Res<()> {
        if ino == LEVELS_DIR_INO {
            return Ok(());
        }
        self.empty_op(cx, ino, |node| Op::FsyncDir { node, fh: FileHandle(fh), datasync })
    }

    pub(crate) fn statfs(&self, cx: &Caller, ino: u64) -> Res<StatFs> {
        let ino = if ino == LEVELS_DIR_INO { NodeId::ROOT.0 } else { ino };
        let (level, _, node) = self.decode(ino)?;
        expect(level.call(cx, &Op::StatFs { node }), |r| match r {
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
            let (level, _, node) = self.decode(ino)?;
            if self.acl_drops_setgid(&level, cx, node).map_err(|e| errno(&e))? {
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
        let (level, _, node) = self.decode(ino)?;
        let out = expect(level.call(cx, &Op::Ioctl { node, fh: FileHandle(fh), cmd, data, out_size }), |r| match r {
            Reply::Data(d) => Some(d),
            _ => None,
        });
        if out.is_ok() && plyfs_stack::ioctl::sets(cmd) {
            self.drop_cached_attributes(ino);
        }
        out
    }

    pub(crate) fn lseek(&self, cx: &Caller, ino: u64, fh: u64, offset: i64, whence: i32) -> Res<u64> {
        let (level, _, node) = self.decode(ino)?;
        expect(level.call(cx, &Op::Lseek { node, fh: FileHandle(fh), offset, whence }), |r| match r {
            Reply::Offset(o) => Some(o),
            _ => None,
        })
    }
}
