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

use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::creds::RunAs;
use crate::error::{Error, Result};
use crate::layer::{unsupported, ExtOpInfo, Layer, Level};
use crate::op::{Op, Reply};
use crate::shared::{LockFile, LockKind, LockTable};
use crate::watch::Watch;
use crate::types::*;

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

const CAP_DAC_READ_SEARCH: u32 = 2;

/// Whether this process has capability number `cap` in its effective set.
pub fn has_capability(cap: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|h| u64::from_str_radix(h.trim(), 16).ok()))
        .is_some_and(|caps| caps & (1 << cap) != 0)
}

fn open_files_limit() -> libc::rlimit {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    lim
}

/// The `struct file_handle` of the object `fd` refers to, in a buffer aligned for the kernel.
fn handle_of(fd: RawFd) -> Option<Box<[u64]>> {
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

/// The lock on a lower file: an open-file-description lock on a descriptor of its own.
///
/// On a network file system, taking the lock also makes the client's caches of the file
/// current (the attributes are fetched again, which drops stale pages), and dropping a write
/// lock first pushes what this client wrote to the servers. NFS does both by itself at locks;
/// FUSE clients such as GlusterFS's do not.
///
/// Pushing is not syncing: other mounts need the writes on the servers, not on their disks. The
/// kernel's dirty pages of the file are written back, then its attributes are fetched from the
/// servers, which a client answers only after the writes it holds back reached them (GlusterFS's
/// write-behind orders a stat after every pending write to the file, from any descriptor; NFS
/// flushes at getattr). An `fdatasync` would also wait for the servers' disks (a millisecond
/// per write on GlusterFS), and on GlusterFS it would not even wait for writes made through
/// another descriptor than the lock's.
struct OfdLock {
    fd: Arc<OwnedFd>,
    network: bool,
}

/// Fetch a file's attributes from the servers of a network file system, not from the client's
/// cache: its size, and with it how much of the file the client's reads reach, become current.
fn refresh_from_servers(fd: RawFd) -> Result<()> {
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let flags = libc::AT_EMPTY_PATH | libc::AT_STATX_FORCE_SYNC;
    check(unsafe { libc::statx(fd, c"".as_ptr(), flags, libc::STATX_BASIC_STATS, &mut stx) }).map(|_| ())
}

impl OfdLock {
    fn refresh(&self) -> Result<()> {
        refresh_from_servers(self.fd.as_raw_fd())
    }

    fn fcntl(&self, l_type: libc::c_int) -> Result<()> {
        self.fcntl_or_not(l_type, true)
    }

    /// Set the lock, waiting for other processes if `wait`, else failing with `EWOULDBLOCK`.
    fn fcntl_or_not(&self, l_type: libc::c_int, wait: bool) -> Result<()> {
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = l_type as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        let cmd = if wait { libc::F_OFD_SETLKW } else { libc::F_OFD_SETLK };
        loop {
            match check(unsafe { libc::fcntl(self.fd.as_raw_fd(), cmd, &fl) }) {
                Err(Error::Os(libc::EINTR)) => continue,
                Err(Error::Os(libc::EAGAIN | libc::EACCES)) if !wait => return Err(Error::Os(libc::EWOULDBLOCK)),
                other => return other.map(|_| ()),
            }
        }
    }
}

impl LockFile for OfdLock {
    fn take(&self, kind: LockKind, wait: bool) -> Result<()> {
        let l_type = match kind {
            LockKind::Shared => libc::F_RDLCK,
            LockKind::Exclusive => libc::F_WRLCK,
        };
        self.fcntl_or_not(l_type, wait)?;
        if self.network {
            if let Err(e) = self.refresh() {
                let _ = self.fcntl(libc::F_UNLCK);
                return Err(e);
            }
        }
        Ok(())
    }

    fn release(&self, held: LockKind) -> Result<()> {
        let pushed = if self.network && held == LockKind::Exclusive {
            let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            check(unsafe { libc::sync_file_range(self.fd.as_raw_fd(), 0, 0, flags) }).and_then(|_| self.refresh())
        } else {
            Ok(())
        };
        let unlocked = self.fcntl(libc::F_UNLCK);
        pushed.and(unlocked)
    }
}

/// The node descriptors of every bottom layer of this process share one budget: a tree has a
/// bottom layer per branch, and together they must stay within the process's open-files limit.
/// When the count passes the budget, idle descriptors are closed in whichever bottom layer
/// holds them.
struct FdBudget {
    open: AtomicU64,
    budget: std::sync::OnceLock<u64>,
    tables: Mutex<Vec<std::sync::Weak<Mutex<NodeTable>>>>,
}

fn fd_budget() -> &'static FdBudget {
    static BUDGET: std::sync::OnceLock<FdBudget> = std::sync::OnceLock::new();
    BUDGET.get_or_init(|| FdBudget { open: AtomicU64::new(0), budget: std::sync::OnceLock::new(), tables: Mutex::new(Vec::new()) })
}

impl FdBudget {
    /// Half the open-files limit as it is when first needed (the daemon raises it first).
    fn budget(&self) -> u64 {
        *self.budget.get_or_init(|| (open_files_limit().rlim_cur / 2).max(64))
    }
}

/// File systems whose `close` can fail or publishes data to other clients.
fn reports_at_close(fs_type: i64) -> bool {
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

fn cstr(name: &OsStr) -> Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| Error::Os(libc::EINVAL))
}

fn check(ret: libc::c_int) -> Result<libc::c_int> {
    if ret < 0 {
        Err(Error::last_os())
    } else {
        Ok(ret)
    }
}

fn check_size(ret: libc::ssize_t) -> Result<usize> {
    if ret < 0 {
        Err(Error::last_os())
    } else {
        Ok(ret as usize)
    }
}

/// The `/proc/self/fd/N` path of a descriptor, for calls that have no `*at` form taking
/// `AT_EMPTY_PATH`.
fn proc_path(fd: RawFd) -> CString {
    CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL in a number")
}

/// Where the kernel says `fd` is now, in this process's view of the file systems.
fn fd_path(fd: RawFd) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    let len = check_size(unsafe { libc::readlink(proc_path(fd).as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
    buf.truncate(len);
    Ok(buf)
}

fn fstat(fd: RawFd) -> Result<libc::stat> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let empty = c"";
    check(unsafe { libc::fstatat(fd, empty.as_ptr(), &mut st, libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

fn timespec(t: Option<TimeSet>) -> libc::timespec {
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
struct FsCreds;

impl FsCreds {
    fn assume(uid: u32, gid: u32) -> FsCreds {
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
            check(unsafe { libc::chmod(proc_path(fd).as_ptr(), mode & 0o7777) })?;
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
            if n.kind == FileKind::Symlink {
                check(unsafe { libc::utimensat(fd, empty.as_ptr(), times.as_ptr(), libc::AT_EMPTY_PATH) })?;
            } else {
                check(unsafe { libc::utimensat(libc::AT_FDCWD, proc_path(fd).as_ptr(), times.as_ptr(), 0) })?;
            }
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
        // The same path relative to the lower directory: what the layers above call it, unless
        // one of them renames things (a crypt volume's names layer translates it).
        let rel = path.strip_prefix(&self.root_real).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(serde_json::json!({
            "path": rel,
            "lower_path": path.to_string_lossy(),
            "dev": n.key.0,
            "ino": n.key.1,
        }))
    }
}

/// Close the descriptors of nodes not used since the last pass (second chance), in every
/// bottom layer of the process, until a quarter of the budget is free. Only nodes that can be
/// reopened by handle are closed. One table is locked at a time.
fn close_idle_node_fds() {
    let budget = fd_budget();
    let target = budget.budget() * 3 / 4;
    let tables: Vec<Arc<Mutex<NodeTable>>> = {
        let mut tables = budget.tables.lock();
        tables.retain(|t| t.strong_count() > 0);
        tables.iter().filter_map(std::sync::Weak::upgrade).collect()
    };
    for table in tables {
        let table = table.lock();
        for (node, _) in table.by_id.values() {
            if budget.open.load(Ordering::Relaxed) <= target {
                return;
            }
            if node.handle.is_none() || node.pinned.load(Ordering::Relaxed) || node.used.swap(false, Ordering::Relaxed) {
                continue;
            }
            if let Some(mut slot) = node.fd.try_lock() {
                if slot.as_ref().is_some_and(|fd| Arc::strong_count(fd) == 1) {
                    *slot = None;
                    budget.open.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }
}

impl Drop for LowerDir {
    fn drop(&mut self) {
        // Its descriptors close with it: they no longer count against the budget.
        let open = self.nodes.lock().by_id.values().filter(|(n, _)| n.fd.lock().is_some()).count() as u64;
        fd_budget().open.fetch_sub(open.min(fd_budget().open.load(Ordering::Relaxed)), Ordering::Relaxed);
    }
}

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

fn kind_of(t: nix::dir::Type) -> FileKind {
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

impl LowerDir {
    /// For a confined caller: the directories `op` names must still be inside the lower
    /// directory. One moved out of it while a client held it is `ESTALE`, as is its `..`.
    /// (A file with another name outside the tree cannot be told from one inside, so files are
    /// not checked; the caller's own rights still apply to them.)
    fn check_within_export(&self, op: &Op<'_>) -> Result<()> {
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

    fn dispatch(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
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
