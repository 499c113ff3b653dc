//! The bottom layer: it owns the lower directory and answers every operation with system calls
//! on it. No other layer touches the lower directory.
//!
//! Each node keeps an `O_PATH` descriptor of its lower object, and every call works relative to
//! such descriptors (`*at` calls, or `/proc/self/fd/N` where the kernel has no `*at` form). So
//! renames above a node never break it, and a file deleted while open stays reachable.
//!
//! The kernel decides how many nodes it remembers, and each needs a descriptor. A daemon that
//! may open files by handle (CAP_DAC_READ_SEARCH, as root has) keeps a file handle per node and
//! only a bounded number of descriptors, closing the least recently used and reopening them on
//! demand; the number of files it can serve is then not bounded by the open-files limit.
//!
//! A node's id is the lower inode number, so hard links share one node, and `st_ino` is stable
//! for the life of the mount and beyond. The exceptions get an id of their own, kept for the
//! life of the mount: the root (FUSE wants id 1), objects on other file systems mounted inside
//! the lower directory, and inode numbers too large for 56 bits.
//!
//! `dispatch` answers each operation; this module keeps the nodes, open files and directory
//! streams it works on. `sys` wraps the system calls, `budget` shares the node descriptors'
//! budget among the bottom layers, and `ofd_lock` is the lock of `lower-lock`.

mod budget;
mod dispatch;
mod ofd_lock;
mod sys;

use std::collections::HashMap;
use std::ffi::{CStr, OsStr, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::creds::RunAs;
use crate::error::{Error, Result};
use crate::layer::{ExtOpInfo, Layer, Level};
use crate::op::{Op, Reply};
use crate::shared::{LockFile, LockKind, LockTable};
use crate::watch::Watch;
use crate::types::*;

use budget::{close_idle_node_fds, fd_budget};
use ofd_lock::{refresh_from_servers, OfdLock};
use sys::{check, check_size, cstr, fstat, handle_of, kind_of, proc_path, reports_at_close, timespec, FsCreds, CAP_DAC_READ_SEARCH};
pub use sys::{has_capability, raise_fd_limit};

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo { name: "lower-info", args: "", help: "where the object lives in the lower directory (path, device, inode)" },
    ExtOpInfo {
        name: crate::shared::LOCK_OP,
        args: "[unlock] shared|exclusive",
        help: "lock the lower file against other mounts sharing it (an OFD lock, counted per owner in this process)",
    },
    ExtOpInfo {
        name: "lower-sync",
        args: "",
        help: "make everything written to the lower file system durable (syncfs), as after many writes not synced one by one",
    },
];

struct LowerNode {
    key: (u64, u64),
    kind: FileKind,
    /// A handle to reopen the object by (`open_by_handle_at`), where this daemon may.
    handle: Option<Box<[u64]>>,
    /// The `O_PATH` descriptor, while open; nodes without a handle always keep theirs.
    fd: Mutex<Option<Arc<OwnedFd>>>,
    /// Used since the last eviction pass (second chance).
    used: AtomicBool,
    /// Its name was removed through this layer: the descriptor stays open until the node is
    /// forgotten, so the lower file system cannot give its inode number to a new object while
    /// the kernel still knows this one by that number.
    pinned: AtomicBool,
    /// A descriptor of the file open for reading and writing by a handle, if one is: a lock
    /// (`lower-lock`) is taken on a duplicate of it rather than on a new open, which costs a
    /// round trip on a network file system and fails there once the file is removed.
    open_rw: Mutex<std::sync::Weak<OwnedFd>>,
}

/// A node ready for use: its descriptor stays open while the reference lives.
struct NodeRef {
    fd: Arc<OwnedFd>,
    key: (u64, u64),
    kind: FileKind,
}

/// Ids handed out where the lower inode number cannot serve (see the module documentation).
const SYNTHETIC_IDS: u64 = 1 << 55;

struct NodeTable {
    /// Each known node with the number of lookups the layer above holds on it.
    by_id: HashMap<u64, (Arc<LowerNode>, u64)>,
    /// `(st_dev, st_ino)` of objects with synthetic ids. Never shrinks, so ids stay stable.
    synthetic: HashMap<(u64, u64), u64>,
    next_synthetic: u64,
}

struct DirStream {
    /// A snapshot of the directory, taken when reading starts at offset 0.
    entries: Vec<(OsString, u64, FileKind)>,
}

pub struct LowerDir {
    root: PathBuf,
    /// The root's path as the kernel names it (absolute, no symlinks), for `lower-info`.
    root_real: PathBuf,
    root_key: (u64, u64),
    nodes: Arc<Mutex<NodeTable>>,
    files: Mutex<HashMap<u64, Arc<OwnedFd>>>,
    /// Handles opened with `O_APPEND` by a shared mount over a network file system: their
    /// writes are made under the file's lock (see [`LowerDir::append_locked`]).
    appenders: Mutex<std::collections::HashSet<u64>>,
    dirs: Mutex<HashMap<u64, Arc<Mutex<DirStream>>>>,
    next_fh: AtomicU64,
    /// Running as root: create objects with the caller's fsuid/fsgid so they get the right owner.
    switch_creds: bool,
    /// The lower file system reports errors at close (network file systems), so `flush` must
    /// reach it.
    flush_on_close: bool,
    out_of_descriptors: AtomicBool,
    /// A plain (not `O_PATH`) descriptor of the lower root: the mount reference
    /// `open_by_handle_at` needs, which it refuses as `O_PATH`.
    mount_fd: OwnedFd,
    /// Whether nodes get handles (the daemon may call `open_by_handle_at`).
    reopen_by_handle: bool,
    /// Locks on lower files, for mounts that share them (`lower-lock`).
    locks: LockTable,
    /// The watch for changes made behind the mount's back (`-o shared`, local lowers).
    watch: std::sync::OnceLock<Arc<Watch>>,
}

impl LowerDir {
    pub fn open(root: &Path) -> Result<LowerDir> {
        let path = cstr(root.as_os_str())?;
        let fd = check(unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) })
            .map_err(|e| Error::config(format!("lower directory {}: {e}", root.display())))?;
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let st = fstat(fd.as_raw_fd())?;
        let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
        check(unsafe { libc::fstatfs(fd.as_raw_fd(), &mut sfs) })?;
        let mount_fd = check(unsafe {
            libc::openat(fd.as_raw_fd(), c".".as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC)
        })
        .map_err(|e| Error::config(format!("lower directory {}: {e}", root.display())))?;
        let mount_fd = unsafe { OwnedFd::from_raw_fd(mount_fd) };
        let root_real = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap_or_else(|_| root.to_owned());
        let fd = Arc::new(fd);
        let root_node = LowerNode {
            key: (st.st_dev, st.st_ino),
            kind: FileKind::Dir,
            handle: None,
            fd: Mutex::new(Some(fd.clone())),
            used: AtomicBool::new(true),
            pinned: AtomicBool::new(true),
            open_rw: Mutex::new(std::sync::Weak::new()),
        };
        let mut by_id = HashMap::new();
        // The root is never forgotten: give it a lookup count no forget can exhaust.
        by_id.insert(NodeId::ROOT.0, (Arc::new(root_node), u64::MAX / 2));
        let nodes = Arc::new(Mutex::new(NodeTable { by_id, synthetic: HashMap::new(), next_synthetic: SYNTHETIC_IDS }));
        let budget = fd_budget();
        budget.tables.lock().push(Arc::downgrade(&nodes));
        budget.open.fetch_add(1, Ordering::Relaxed);
        budget.budget();
        Ok(LowerDir {
            root: root.to_owned(),
            root_real,
            root_key: (st.st_dev, st.st_ino),
            nodes,
            files: Mutex::new(HashMap::new()),
            appenders: Mutex::new(std::collections::HashSet::new()),
            dirs: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            switch_creds: unsafe { libc::geteuid() } == 0,
            flush_on_close: reports_at_close(sfs.f_type),
            out_of_descriptors: AtomicBool::new(false),
            mount_fd,
            reopen_by_handle: has_capability(CAP_DAC_READ_SEARCH),
            locks: LockTable::default(),
            watch: std::sync::OnceLock::new(),
        })
    }

    /// Start watching the lower directory for changes made behind the mount's back, told to
    /// `inv` (see [`crate::watch`]). Only for a shared mount over a local file system, by a
    /// daemon that may use fanotify.
    fn start_watch(&self, inv: Arc<dyn crate::layer::Invalidator>) {
        const CAP_SYS_ADMIN: u32 = 21;
        if crate::shared::mode().is_none() || self.flush_on_close || !has_capability(CAP_SYS_ADMIN) {
            return;
        }
        let watch = match Watch::new() {
            Ok(w) => Arc::new(w),
            Err(e) => {
                tracing::warn!("{}: cannot watch for outside changes (fanotify: {e}); they show within the timeouts", self.root.display());
                return;
            }
        };
        let dirs: Vec<(NodeId, Option<Arc<OwnedFd>>)> = self
            .nodes
            .lock()
            .by_id
            .iter()
            .filter(|(_, (n, _))| n.kind == FileKind::Dir)
            .map(|(id, (n, _))| (NodeId(*id), n.fd.lock().clone()))
            .collect();
        for (id, fd) in dirs {
            if let Some(fd) = fd {
                watch.add(id, fd.as_raw_fd());
            }
        }
        if self.watch.set(watch.clone()).is_ok() {
            let _ = std::thread::Builder::new().name("lower-watch".into()).spawn(move || watch.run(inv));
        }
    }

    /// `lower-lock`: take or drop a lock on the node's lower file for the calling owner.
    fn lower_lock(&self, node: NodeId, args: &[String]) -> Result<Reply> {
        let crate::shared::LockRequest { kind, take, wait } = crate::shared::parse_lock_args(args)?;
        if !take {
            return self.locks.unlock(node, kind).map(|()| Reply::Extended(serde_json::Value::Null));
        }
        self.locks.lock_or_not(node, kind, wait, || {
            let n = self.node(node)?;
            if n.kind != FileKind::File {
                return Err(Error::Os(libc::EINVAL));
            }
            let open_rw = self.nodes.lock().by_id.get(&node.0).and_then(|(l, _)| l.open_rw.lock().upgrade());
            let fd = match open_rw {
                Some(file) => check(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) })?,
                None => {
                    let path = proc_path(n.fd.as_raw_fd());
                    let open = |mode| check(unsafe { libc::open(path.as_ptr(), mode | libc::O_CLOEXEC | libc::O_NOCTTY) });
                    // A write lock needs a descriptor open for writing; a file this daemon may
                    // only read can still be read-locked.
                    open(libc::O_RDWR).or_else(|e| match e {
                        Error::Os(libc::EACCES | libc::EROFS | libc::EPERM) => open(libc::O_RDONLY),
                        e => Err(e),
                    })?
                }
            };
            let fd = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
            Ok(Arc::new(OfdLock { fd, network: self.flush_on_close }) as Arc<dyn LockFile>)
        })?;
        // Removed or replaced by another mount (a `policy apply` there renames the re-encoded
        // file over this one): changes here would go to a file no name leads to any more, and
        // be lost. Stale, as on NFS. (A file removed through this mount stays writable while
        // open, as everywhere.)
        let removed_here = self.nodes.lock().by_id.get(&node.0).is_some_and(|(l, _)| l.pinned.load(Ordering::Relaxed));
        // (A network file system may not stat a removed file by its node at all.)
        let gone = || self.node(node).and_then(|n| fstat(n.fd.as_raw_fd())).map_or(true, |st| st.st_nlink == 0);
        if !removed_here && gone() {
            let _ = self.locks.unlock(node, kind);
            return Err(Error::Os(libc::ESTALE));
        }
        Ok(Reply::Extended(serde_json::Value::Null))
    }

    /// Open `root` and make it the bottom level of a stack.
    pub fn level(root: &Path) -> Result<Level> {
        Ok(Level::new(Arc::new(LowerDir::open(root)?)))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn node(&self, id: NodeId) -> Result<NodeRef> {
        let node = match self.nodes.lock().by_id.get(&id.0) {
            Some((node, _)) => node.clone(),
            None => return Err(Error::Os(libc::ESTALE)),
        };
        let fd = self.fd_of(&node)?;
        Ok(NodeRef { fd, key: node.key, kind: node.kind })
    }

    /// The node's descriptor, reopened by handle if it was closed.
    fn fd_of(&self, node: &LowerNode) -> Result<Arc<OwnedFd>> {
        node.used.store(true, Ordering::Relaxed);
        let mut slot = node.fd.lock();
        if let Some(fd) = &*slot {
            return Ok(fd.clone());
        }
        let handle = node.handle.as_ref().ok_or(Error::Os(libc::ESTALE))?;
        // Reopening is the daemon's own step, whoever the call runs as: open_by_handle_at
        // needs CAP_DAC_READ_SEARCH.
        let daemon = RunAs::daemon_step();
        // The kernel only reads the handle, whatever the binding's `*mut` says.
        let raw = check(unsafe {
            libc::open_by_handle_at(self.mount_fd.as_raw_fd(), handle.as_ptr() as *mut libc::file_handle, libc::O_PATH | libc::O_CLOEXEC)
        })?;
        drop(daemon);
        let fd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let st = fstat(fd.as_raw_fd())?;
        if (st.st_dev, st.st_ino) != node.key {
            return Err(Error::Os(libc::ESTALE));
        }
        *slot = Some(fd.clone());
        drop(slot);
        self.count_open_node_fd();
        Ok(fd)
    }

    /// Count one more open node descriptor, closing idle ones when over budget. Called with no
    /// node table locked.
    fn count_open_node_fd(&self) {
        let budget = fd_budget();
        if budget.open.fetch_add(1, Ordering::Relaxed) + 1 > budget.budget() {
            close_idle_node_fds();
        }
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<OwnedFd>> {
        self.files.lock().get(&fh.0).cloned().ok_or(Error::Os(libc::EBADF))
    }

    fn attr(st: &libc::stat) -> Attr {
        Attr {
            size: st.st_size as u64,
            blocks: st.st_blocks as u64,
            atime: from_unix_time(st.st_atime, st.st_atime_nsec as u32),
            mtime: from_unix_time(st.st_mtime, st.st_mtime_nsec as u32),
            ctime: from_unix_time(st.st_ctime, st.st_ctime_nsec as u32),
            kind: FileKind::from_mode(st.st_mode).unwrap_or(FileKind::File),
            perm: (st.st_mode & 0o7777) as u16,
            nlink: st.st_nlink as u32,
            uid: st.st_uid,
            gid: st.st_gid,
            rdev: st.st_rdev as u32,
            blksize: st.st_blksize as u32,
        }
    }

    /// The id of the lower object `(dev, ino)`, if its inode number can serve as one.
    fn natural_id(&self, dev: u64, ino: u64) -> Option<u64> {
        if (dev, ino) == self.root_key {
            Some(NodeId::ROOT.0)
        } else if dev == self.root_key.0 && ino != NodeId::ROOT.0 && ino < SYNTHETIC_IDS {
            Some(ino)
        } else {
            None
        }
    }

    fn id_of(&self, table: &mut NodeTable, key: (u64, u64)) -> u64 {
        if let Some(id) = self.natural_id(key.0, key.1) {
            return id;
        }
        let next = &mut table.next_synthetic;
        *table.synthetic.entry(key).or_insert_with(|| {
            *next += 1;
            *next
        })
    }

    /// Register the object `fd` refers to as a node, or count one more lookup of its node.
    fn remember(&self, fd: OwnedFd) -> Result<Entry> {
        let st = fstat(fd.as_raw_fd())?;
        let key = (st.st_dev, st.st_ino);
        let mut table = self.nodes.lock();
        let id = self.id_of(&mut table, key);
        let new_node = match table.by_id.get_mut(&id) {
            Some((_, count)) => {
                *count += 1;
                false
            }
            None => {
                let kind = FileKind::from_mode(st.st_mode).unwrap_or(FileKind::File);
                // Directories and regular files, the bulk of any tree, can be reopened by handle;
                // symlinks and special files keep their descriptors (reopening a symlink by
                // handle fails with ESTALE here).
                let reopenable = matches!(kind, FileKind::Dir | FileKind::File) && key.0 == self.root_key.0;
                let handle = (self.reopen_by_handle && reopenable).then(|| handle_of(fd.as_raw_fd())).flatten();
                if let (FileKind::Dir, Some(watch)) = (kind, self.watch.get()) {
                    watch.add(NodeId(id), fd.as_raw_fd());
                }
                let node = LowerNode {
                    key,
                    kind,
                    handle,
                    fd: Mutex::new(Some(Arc::new(fd))),
                    used: AtomicBool::new(true),
                    pinned: AtomicBool::new(false),
                    open_rw: Mutex::new(std::sync::Weak::new()),
                };
                table.by_id.insert(id, (Arc::new(node), 1));
                true
            }
        };
        drop(table);
        if new_node {
            self.count_open_node_fd();
        }
        Ok(Entry { node: NodeId(id), attr: Self::attr(&st), generation: 0 })
    }

    fn lookup_at(&self, parent: &NodeRef, name: &OsStr) -> Result<Entry> {
        let c = cstr(name)?;
        let fd = check(unsafe {
            libc::openat(parent.fd.as_raw_fd(), c.as_ptr(), libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        })?;
        self.remember(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Before a name is removed (unlink, rmdir, rename over it), hold the inode it names open if
    /// the kernel knows it as a node: node ids are inode numbers, and a freed inode's number may
    /// go to the next object created while the kernel still holds the old node.
    fn pin_victim(&self, parent: &NodeRef, name: &CStr) {
        let Ok(raw) = check(unsafe {
            libc::openat(parent.fd.as_raw_fd(), name.as_ptr(), libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        }) else {
            return;
        };
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let Ok(st) = fstat(fd.as_raw_fd()) else { return };
        let key = (st.st_dev, st.st_ino);
        let node = {
            let table = self.nodes.lock();
            // Synthetic ids are never given again, but a shared mount must still know that this
            // file was removed here (see `lower_lock`).
            let Some(id) = self.natural_id(key.0, key.1).or_else(|| table.synthetic.get(&key).copied()) else { return };
            match table.by_id.get(&id) {
                Some((node, _)) if node.key == key => node.clone(),
                _ => return,
            }
        };
        node.pinned.store(true, Ordering::Relaxed);
        let mut slot = node.fd.lock();
        if slot.is_none() {
            *slot = Some(Arc::new(fd));
            drop(slot);
            self.count_open_node_fd();
        }
    }

    /// Say once, clearly, why operations fail when the descriptors run out.
    fn warn_if_out_of_descriptors(&self, e: &Error) {
        if matches!(e, Error::Os(libc::EMFILE | libc::ENFILE))
            && !self.out_of_descriptors.swap(true, Ordering::Relaxed)
        {
            let held = self.nodes.lock().by_id.len();
            tracing::error!(
                "{}: out of file descriptors with {held} files known to the kernel; raise the open-files limit (ulimit -Hn)",
                self.root.display()
            );
        }
    }

    /// Drop `nlookup` references; whether the node is gone.
    fn forget(&self, id: NodeId, nlookup: u64) -> bool {
        let mut table = self.nodes.lock();
        let gone = match table.by_id.get_mut(&id.0) {
            Some((_, count)) => {
                *count = count.saturating_sub(nlookup);
                *count == 0
            }
            None => false,
        };
        if gone {
            if let Some((node, _)) = table.by_id.remove(&id.0) {
                let fd = node.fd.lock().clone();
                if let (FileKind::Dir, Some(watch), Some(fd)) = (node.kind, self.watch.get(), &fd) {
                    watch.remove(id, fd.as_raw_fd());
                }
                if fd.is_some() {
                    fd_budget().open.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        gone
    }

    /// Create an object as the caller, so it gets the caller's owner and group (and the
    /// directory's group where it is set-group-ID), as a kernel file system would.
    ///
    /// The caller's supplementary groups are not known here; when only they would have granted
    /// the access (the kernel already checked it, with `default_permissions`), the object is
    /// created by the daemon and then given to the caller.
    fn create_as<T>(
        &self,
        cx: &Caller,
        parent: &NodeRef,
        make: impl Fn() -> Result<T>,
        fixup: impl FnOnce(&T) -> RawFd,
    ) -> Result<T> {
        // A confined caller already runs as itself (see `call`), and gets no fallback: what
        // the kernel refuses it stays refused.
        if !self.switch_creds || cx.confined.is_some() || (cx.uid == 0 && cx.gid == 0) || cx.pid == 0 {
            return make();
        }
        let first = {
            let _creds = FsCreds::assume(cx.uid, cx.gid);
            make()
        };
        match first {
            Err(Error::Os(libc::EACCES)) => {
                let made = make()?;
                let parent_st = fstat(parent.fd.as_raw_fd())?;
                let gid = if parent_st.st_mode & libc::S_ISGID != 0 { parent_st.st_gid } else { cx.gid };
                let empty = c"";
                check(unsafe {
                    libc::fchownat(fixup(&made), empty.as_ptr(), cx.uid, gid, libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW)
                })?;
                Ok(made)
            }
            other => other,
        }
    }

    /// Make a named object with `make(parent_fd, name)` and look it up.
    fn make_node(
        &self,
        cx: &Caller,
        parent: NodeId,
        name: &OsStr,
        make: impl Fn(RawFd, &CStr) -> libc::c_int,
    ) -> Result<Entry> {
        let parent = self.node(parent)?;
        let c = cstr(name)?;
        let pfd = parent.fd.as_raw_fd();
        let made = self.create_as(
            cx,
            &parent,
            || {
                check(make(pfd, &c))?;
                // Open the new object at once so the fix-up and lookup see this object.
                let fd = check(unsafe { libc::openat(pfd, c.as_ptr(), libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC) })?;
                Ok(unsafe { OwnedFd::from_raw_fd(fd) })
            },
            |fd| fd.as_raw_fd(),
        )?;
        self.remember(made)
    }

    fn new_fh(&self) -> u64 {
        self.next_fh.fetch_add(1, Ordering::Relaxed)
    }

    /// Remember a handle's descriptor of `node` open for reading and writing (see
    /// [`LowerNode::open_rw`]).
    fn note_open_rw(&self, node: NodeId, flags: i32, opened: &Opened) {
        if flags & libc::O_ACCMODE != libc::O_RDWR {
            return;
        }
        if let (Some((n, _)), Some(fd)) = (self.nodes.lock().by_id.get(&node.0), &opened.backing) {
            *n.open_rw.lock() = Arc::downgrade(fd);
        }
    }

    fn register_file(&self, fd: OwnedFd, flags: i32) -> Result<Opened> {
        if self.flush_on_close && crate::shared::mode().is_some() {
            // Close-to-open, as NFS gives it: an open sees what other clients wrote and closed
            // (a FUSE client such as GlusterFS's would read up to the size it last saw).
            refresh_from_servers(fd.as_raw_fd())?;
        }
        let fd = Arc::new(fd);
        let fh = self.new_fh();
        self.files.lock().insert(fh, fd.clone());
        if self.appends_need_lock(flags) {
            // Neither passthrough nor the page cache: every append must reach the daemon whole.
            self.appenders.lock().insert(fh);
            return Ok(Opened { fh: FileHandle(fh), backing: None, direct_io: true, flush_on_close: true });
        }
        let backing = (!self.flush_on_close || Self::reopenable(&fd, flags)).then_some(fd);
        Ok(Opened { fh: FileHandle(fh), backing, direct_io: false, flush_on_close: self.flush_on_close })
    }

    /// Whether the kernel's passthrough can open the file again for `flags`. It opens the lower
    /// file anew with this daemon's credentials, and a network file system decides by the file's
    /// permission bits alone, root or not: a file a user created with mode 0 (the open that
    /// created it may still write it) is refused there, and the caller's open would fail with
    /// EIO (pjdfstest over GlusterFS). Such opens are served by the daemon instead.
    fn reopenable(fd: &OwnedFd, flags: i32) -> bool {
        let Ok(st) = fstat(fd.as_raw_fd()) else { return false };
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let bits = if st.st_uid == uid {
            st.st_mode >> 6
        } else if st.st_gid == gid {
            st.st_mode >> 3
        } else {
            st.st_mode
        } & 0o7;
        let need = match flags & libc::O_ACCMODE {
            libc::O_RDONLY => 0o4,
            libc::O_WRONLY => 0o2,
            _ => 0o6,
        };
        bits & need == need
    }

    /// Whether an open with `flags` appends to a file that other clients of a network file
    /// system may append to at the same time. Such a client places an `O_APPEND` write at the
    /// end of the file as it last saw it (GlusterFS does, from two clients: records overwrite
    /// each other), so this mount's appends are made under the file's lock instead.
    fn appends_need_lock(&self, flags: i32) -> bool {
        self.flush_on_close
            && flags & libc::O_APPEND != 0
            && flags & libc::O_ACCMODE != libc::O_RDONLY
            && crate::shared::mode().is_some()
    }

    /// Append `data` to the file of an `O_APPEND` descriptor under the file's write lock: the
    /// lock makes the client fetch the file's size from the servers, the write goes to that end
    /// (the descriptor appends), and the lock is dropped only once the write reached the
    /// servers (see [`OfdLock`]). Other mounts do the same, and so do the encoding layers.
    fn append_locked(&self, file: Arc<OwnedFd>, data: &[u8]) -> Result<usize> {
        let lock = OfdLock { fd: file, network: true };
        lock.take(LockKind::Exclusive, true)?;
        let written = Self::write_all_at(lock.fd.as_raw_fd(), data, 0);
        let released = lock.release(LockKind::Exclusive);
        let written = written?;
        released.map(|()| written)
    }

    fn write_all_at(fd: RawFd, data: &[u8], offset: u64) -> Result<usize> {
        let mut done = 0;
        while done < data.len() {
            let n = check_size(unsafe {
                libc::pwrite(fd, data[done..].as_ptr().cast(), data.len() - done, (offset + done as u64) as i64)
            })?;
            done += n;
        }
        Ok(done)
    }

    fn setattr(&self, node: NodeId, fh: Option<FileHandle>, set: &SetAttr) -> Result<Attr> {
        let n = self.node(node)?;
        let fd = n.fd.as_raw_fd();
        let empty = c"";
        if set.uid.is_some() || set.gid.is_some() {
            let uid = set.uid.unwrap_or(u32::MAX);
            let gid = set.gid.unwrap_or(u32::MAX);
            check(unsafe { libc::fchownat(fd, empty.as_ptr(), uid, gid, libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW) })?;
        }
        if let Some(mode) = set.mode {
            if n.kind == FileKind::Symlink {
                return Err(Error::Os(libc::EOPNOTSUPP));
            }
            check(sys::chmod_fd(fd, mode & 0o7777))?;
        }
        let mut mtime = set.mtime;
        if let Some(size) = set.size {
            match fh.and_then(|fh| self.file(fh).ok()) {
                Some(file) => {
                    check(unsafe { libc::ftruncate(file.as_raw_fd(), size as i64) })?;
                }
                None => {
                    check(unsafe { libc::truncate(proc_path(fd).as_ptr(), size as i64) })?;
                    // The kernel sends `open(O_TRUNC)` as a size without a handle, like
                    // truncate(2), and the file is then modified whatever its size was; truncate(2)
                    // on tmpfs leaves an unchanged size's times (found by `difffuzz.rs`).
                    mtime = mtime.or(Some(TimeSet::Now));
                }
            };
        }
        if set.atime.is_some() || mtime.is_some() {
            let times = [timespec(set.atime), timespec(mtime)];
            check(unsafe { libc::utimensat(fd, empty.as_ptr(), times.as_ptr(), libc::AT_EMPTY_PATH) })?;
        }
        Ok(Self::attr(&fstat(fd)?))
    }

    /// The file-attribute ioctls ([`crate::ioctl`]) on the lower file or directory, through a
    /// descriptor of its own (the node's is `O_PATH`, which ioctl refuses).
    fn ioctl(&self, node: NodeId, fh: FileHandle, cmd: u32, data: &[u8], out_size: u32) -> Result<Vec<u8>> {
        if !crate::ioctl::known(cmd) {
            return Err(Error::Os(libc::ENOTTY));
        }
        let n = self.node(node)?;
        if !matches!(n.kind, FileKind::File | FileKind::Dir) {
            return Err(Error::Os(libc::ENOTTY));
        }
        // The file's open descriptor serves (the flag calls check no access mode); a directory
        // handle has none, so the directory is opened for the call.
        let fd = match self.files.lock().get(&fh.0).cloned() {
            Some(fd) => fd,
            None => {
                let fd = check(unsafe {
                    libc::open(proc_path(n.fd.as_raw_fd()).as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
                })?;
                Arc::new(unsafe { OwnedFd::from_raw_fd(fd) })
            }
        };
        // Large enough for either form; the kernel reads or writes what the command says.
        let mut buf = [0u8; 64];
        let len = data.len().min(buf.len());
        buf[..len].copy_from_slice(&data[..len]);
        check(unsafe { libc::ioctl(fd.as_raw_fd(), cmd as _, buf.as_mut_ptr()) })?;
        Ok(buf[..(out_size as usize).min(buf.len())].to_vec())
    }

    fn read_dir_snapshot(&self, node: &NodeRef) -> Result<Vec<(OsString, u64, FileKind)>> {
        let fd = check(unsafe {
            libc::openat(node.fd.as_raw_fd(), c".".as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC)
        })?;
        let mut dir = nix::dir::Dir::from_fd(unsafe { OwnedFd::from_raw_fd(fd) })?;
        let mut entries = Vec::new();
        for entry in dir.iter() {
            let entry = entry?;
            let name = OsStr::from_bytes(entry.file_name().to_bytes()).to_owned();
            let kind = match entry.file_type() {
                Some(t) => kind_of(t),
                None => FileKind::File,
            };
            entries.push((name, entry.ino(), kind));
        }
        Ok(entries)
    }

    fn readdir(&self, node: NodeId, fh: FileHandle, offset: u64, max: u32, plus: bool) -> Result<Vec<DirEntry>> {
        let stream = self.dirs.lock().get(&fh.0).cloned().ok_or(Error::Os(libc::EBADF))?;
        let n = self.node(node)?;
        let mut stream = stream.lock();
        if offset == 0 {
            stream.entries = self.read_dir_snapshot(&n)?;
        }
        let start = (offset as usize).min(stream.entries.len());
        let end = start.saturating_add(max.max(1) as usize).min(stream.entries.len());
        let mut out = Vec::with_capacity(end - start);
        for (i, (name, ino, kind)) in stream.entries[start..end].iter().enumerate() {
            if node == NodeId::ROOT && crate::lowerlock::is_lock_file(name) {
                continue;
            }
            let dots = name == "." || name == "..";
            let entry = if plus && !dots {
                match self.lookup_at(&n, name) {
                    Ok(e) => Some(e),
                    // Removed since the snapshot: leave it out, as a fresh readdir would.
                    Err(Error::Os(libc::ENOENT)) => continue,
                    Err(e) => return Err(e),
                }
            } else {
                None
            };
            let node = match entry {
                Some(e) => e.node,
                // `d_ino` carries no device; an entry that is a mount point shows the inode
                // under it, as `readdir` on the lower directory does.
                None => NodeId(self.natural_id(self.root_key.0, *ino).unwrap_or(*ino)),
            };
            let kind = entry.map_or(*kind, |e| e.attr.kind);
            out.push(DirEntry { name: name.clone(), node, kind, next_offset: (start + i + 1) as u64, entry });
        }
        Ok(out)
    }

    fn xattr_reply(size: u32, fill: impl Fn(*mut libc::c_void, usize) -> libc::ssize_t) -> Result<XattrReply> {
        if size == 0 {
            return Ok(XattrReply::Size(check_size(fill(std::ptr::null_mut(), 0))? as u32));
        }
        let mut buf = vec![0u8; size as usize];
        let n = check_size(fill(buf.as_mut_ptr().cast(), buf.len()))?;
        buf.truncate(n);
        Ok(XattrReply::Data(buf))
    }

    fn lower_info(&self, node: NodeId) -> Result<serde_json::Value> {
        let n = self.node(node)?;
        let path = std::fs::read_link(format!("/proc/self/fd/{}", n.fd.as_raw_fd()))?;
        // A file with no name left: the kernel shows its last one followed by " (deleted)",
        // which is also a name a file could have. Say which it is.
        let removed = n.kind != FileKind::Dir && fstat(n.fd.as_raw_fd())?.st_nlink == 0;
        // The same path relative to the lower directory: what the layers above call it, unless
        // one of them renames things (a crypt volume's names layer translates it).
        let rel = path.strip_prefix(&self.root_real).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(serde_json::json!({
            "path": rel,
            "removed": removed,
            "lower_path": path.to_string_lossy(),
            "dev": n.key.0,
            "ino": n.key.1,
        }))
    }
}

impl Layer for LowerDir {
    fn name(&self) -> &str {
        "lower"
    }

    fn kind(&self) -> &'static str {
        "lower"
    }

    fn lower(&self) -> &[Level] {
        &[]
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        // A confined caller's operation runs as the caller from its first system call to its
        // last, so the kernel checks all of it (see `crate::creds`). A daemon that is not root
        // cannot switch, and acts with no more than its own user's rights anyway.
        let _as_caller = match cx.confined {
            Some(groups) if self.switch_creds => Some(RunAs::caller(cx.uid, cx.gid, groups.as_slice())?),
            _ => None,
        };
        if cx.confined.is_some() {
            self.check_within_export(op)?;
        }
        self.dispatch(cx, op).inspect_err(|e| self.warn_if_out_of_descriptors(e))
    }

    fn set_invalidator(&self, inv: Arc<dyn crate::layer::Invalidator>) {
        self.start_watch(inv);
    }
}
