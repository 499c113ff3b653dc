//! `mirror`: RAID-1 for file trees, the UCLA mirror of `seeds/000` §3.2.
//!
//! - **Writes and namespace changes go to every in-sync branch.** The branch that serves reads
//!   (the first in-sync branch, in order) does each change first and its answer is the answer:
//!   an ordinary error (`EEXIST`, `ENOTEMPTY`, ...) stops there. Then the others follow; data
//!   writes of 256 KiB and more reach them in parallel.
//! - **Every branch sees the changes in one order.** Changes of names (create, rename, unlink,
//!   link...) hold the mount's names lock alone: two of them running at once could reach the
//!   branches in different orders, and a later change would then find on one branch a name that
//!   is not there, and fail a healthy branch. Changes to one object's data or attributes hold
//!   that object's lock (one of [`OBJECT_STRIPES`]), so writes to different files stay
//!   parallel. An object is found by name on the branches other than the reading one only under
//!   the names lock, and before a change of names takes a name away, so that it is never found
//!   by a name that is changing or gone.
//! - **Reads come from one branch**, the first in-sync one. On `EIO`, `ENOTCONN` and the like, or
//!   when its directory is gone, it fails and the next one serves, for the same request.
//! - **A failed branch degrades the mount**, which goes on working and says so (a log line,
//!   `mirror-status`). Every change made while it is failed is noted in the write-intent log
//!   ([`log`]), so `resync` copies only that; `scrub` compares everything and repairs. A failed
//!   branch serves nothing until it is resynced, even after a remount.
//! - **A killed daemon** leaves `W` lines without their `C` in the log: at the next mount those
//!   paths are made the same on every branch before anything is served.
//! - **No passthrough**, not even for files opened read-only: the kernel refuses (`EIO`) to open
//!   a file with passthrough while another open of it goes through the daemon, as writes here
//!   must, and the other way round.
//! - **Shared (`-o shared`)**: several mounts, here or on other machines, may mirror the same
//!   branches. Each change runs under a lock that every mount honours, so every branch sees the
//!   changes in one order: a change to a file's data or attributes under the lock of that file
//!   on the reading branch, a change of names under the lock of `.plyfs-mirror.lock` there.
//!   Each mount keeps its own write-intent log (in `.plyfs-mirror.logs`) and holds its lock
//!   while it runs; a log whose
//!   lock can be taken is a stopped mount's, and a running mount takes it over within seconds
//!   (at its own start at once): its changes in flight are made the same on every branch, its
//!   failed branches and stale paths become this mount's. A branch one mount finds failed is
//!   named in `.plyfs-mirror.failed` on the others, and every mount stops using it within a
//!   second. `resync` and `scrub` run only where no other mount is running.

mod log;
mod sync;

use std::collections::{BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard, RwLock, RwLockWriteGuard};
use plyfs_stack::shared::{self, LockKind};
use plyfs_stack::spec::BranchMode;
use plyfs_stack::{
    Branch, Build, Caller, DataPath, DirEntry, Entry, Error, ExtOpInfo, FanOutArgs, FileHandle, FileKind, Layer, LayerFactory, Level,
    NodeId, Op, Opened, Reply, Result,
};
use serde_json::{json, Value};

use crate::ids::{NodeTable, Place};
use crate::transfer::{Data, TempNames};
use log::{is_log_name, IntentLog, Unreached, LOGS_DIR, LOG_NAME};

/// Names of copies a resync is writing; never shown, removed when found left over.
pub const TEMP_PREFIX: &str = ".plyfs-mirror-copy.";
/// With `-o shared`: the file at each branch's root whose lock guards changes of names.
const LOCK_NAME: &str = ".plyfs-mirror.lock";
/// With `-o shared`: the names of branches a mount found failed, one per line, on the others.
const FAILED_NAME: &str = ".plyfs-mirror.failed";
/// How often a shared mount looks for branches other mounts found failed.
const WATCH_EVERY: Duration = Duration::from_secs(1);
/// ... and for the logs of stopped mounts, in turns of [`WATCH_EVERY`].
const ADOPT_EVERY: u32 = 5;
/// An empty log younger than this may be a mount's that is starting: it is left alone.
const YOUNG: Duration = Duration::from_secs(60);
/// Data writes at least this large reach the branches in parallel.
const PARALLEL_FROM: usize = 256 << 10;
/// How many locks the objects' changes share, by number.
const OBJECT_STRIPES: usize = 64;

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo { name: "mirror-status", args: "", help: "each branch: in sync or failed, and how many paths a resync would copy" },
    ExtOpInfo {
        name: "resync",
        args: "[BRANCH]",
        help: "bring failed branches (or one) up to date: copies what changed while they were failed",
    },
    ExtOpInfo {
        name: "scrub",
        args: "",
        help: "compare every object on every in-sync branch with the reading branch, and repair differences",
    },
];

/// Errors that say a branch, not the request, is at fault.
const BRANCH_FAILURES: &[i32] = &[
    libc::EIO,
    libc::ENOTCONN,
    libc::ENODEV,
    libc::ENXIO,
    libc::ETIMEDOUT,
    libc::ESHUTDOWN,
    libc::EHOSTDOWN,
    libc::EHOSTUNREACH,
    libc::ECONNABORTED,
    libc::ECONNRESET,
];

fn daemon() -> Caller {
    Caller::daemon()
}

struct MBranch {
    branch: Branch,
    failed: AtomicBool,
}

impl MBranch {
    fn top(&self) -> &Level {
        self.branch.top()
    }
}

/// One object the kernel knows.
struct MNode {
    kind: FileKind,
    lookups: u64,
    /// Its node on each branch, where known (the mirror holds one lookup on each); found by
    /// name from its parent when first needed.
    places: Vec<Option<NodeId>>,
    /// The directory and name it was last seen under (none for the root).
    parent: Option<(u64, OsString)>,
}

impl crate::ids::Named for MNode {
    fn seen_as(&self) -> Option<&(u64, OsString)> {
        self.parent.as_ref()
    }
}

/// An open file: its handle on each branch that has one.
struct MFile {
    node: NodeId,
    flags: i32,
    writes: bool,
    handles: Mutex<Vec<Option<(NodeId, FileHandle)>>>,
    /// Its path, for the write-intent log (set when it opens for writing).
    path: String,
    /// A change reached some branch (logged `W`; `C` at release).
    in_flight: AtomicBool,
}

pub struct Mirror {
    name: String,
    branches: Vec<MBranch>,
    nodes: Mutex<NodeTable<MNode>>,
    files: Mutex<HashMap<u64, Arc<MFile>>>,
    dirs: Mutex<HashMap<u64, (usize, NodeId, FileHandle)>>,
    next_fh: AtomicU64,
    /// Changes hold it shared; a resync takes it alone to let a branch back in.
    membership: RwLock<()>,
    /// Changes of names hold it alone; finding objects by name on the branches holds it shared.
    names: RwLock<()>,
    /// A change to an object's data or attributes holds the one its number picks.
    objects: Vec<Mutex<()>>,
    log: IntentLog,
    temps: TempNames,
    /// One resync or scrub at a time.
    repairing: Mutex<()>,
    /// With `-o shared`.
    sharing: Option<Sharing>,
}

/// What sharing the branches with other mounts takes.
struct Sharing {
    /// Each branch's [`LOCK_NAME`], once looked up (the lookup is held).
    lock_files: Mutex<Vec<Option<NodeId>>>,
    /// The size of each branch's [`FAILED_NAME`] when last read.
    failed_seen: Mutex<Vec<u64>>,
    stop: Mutex<bool>,
    wake: Condvar,
    watcher: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// What a change must hold: nothing, the lock of changes of names, or the lock of one object
/// (across mounts a file's own; other objects change under the names lock there).
#[derive(Clone, Copy)]
enum Guard {
    None,
    Names,
    Object(NodeId),
}

/// What a change holds while it runs: the lock other mounts honour (released first), then
/// this mount's own.
#[derive(Default)]
struct Holding<'a> {
    _shared: Option<Locked<'a>>,
    _names: Option<RwLockWriteGuard<'a, ()>>,
    _object: Option<MutexGuard<'a, ()>>,
}

/// A lock on a branch's file, dropped with this.
struct Locked<'a> {
    level: &'a Level,
    node: NodeId,
    kind: LockKind,
    /// The lookup of `node` was taken for the lock, and goes with it.
    forget: bool,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let _ = shared::unlock(self.level, self.node, self.kind);
        if self.forget {
            self.level.forget(&daemon(), self.node, 1);
        }
    }
}

/// What a change did: the reading branch and its reply, then each other branch that followed.
type Changed = (usize, Reply, Vec<(usize, Reply)>);

fn entry_of(reply: &Reply) -> Option<Entry> {
    match reply {
        Reply::Entry(e) | Reply::Created(e, _) => Some(*e),
        _ => None,
    }
}

impl Mirror {
    fn new(args: FanOutArgs) -> Result<Mirror> {
        if let Some(b) = args.branches.iter().find(|b| b.mode == BranchMode::ReadOnly) {
            return Err(Error::config(format!(
                "mirror '{}': branch '{}' is read-only, but every branch of a mirror takes every write",
                args.name, b.name
            )));
        }
        if args.branches.len() == 1 {
            tracing::warn!("mirror '{}' has one branch: nothing is mirrored until another is added", args.name);
        }
        let names: Vec<String> = args.branches.iter().map(|b| b.name.clone()).collect();
        let tops: Vec<Level> = args.branches.iter().map(|b| b.top().clone()).collect();
        // A read-only mount changes nothing, so it takes no lock and writes no log: it serves
        // the branches as they are.
        let read_only = plyfs_stack::readonly::read_only();
        let sharing = shared::mode().is_some() && !read_only;
        let (log, replayed) = IntentLog::open(names, tops, sharing, read_only)?;
        let n = args.branches.len();
        let branches: Vec<MBranch> = args
            .branches
            .into_iter()
            .enumerate()
            .map(|(i, branch)| MBranch { branch, failed: AtomicBool::new(replayed.failed[i]) })
            .collect();
        let mut nodes = NodeTable::new();
        nodes.nodes.insert(
            NodeId::ROOT.0,
            MNode { kind: FileKind::Dir, lookups: u64::MAX / 2, places: vec![Some(NodeId::ROOT); n], parent: None },
        );
        let mirror = Mirror {
            name: args.name,
            branches,
            nodes: Mutex::new(nodes),
            files: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            membership: RwLock::new(()),
            names: RwLock::new(()),
            objects: (0..OBJECT_STRIPES).map(|_| Mutex::new(())).collect(),
            log,
            temps: TempNames::new(TEMP_PREFIX),
            repairing: Mutex::new(()),
            sharing: sharing.then(|| Sharing {
                lock_files: Mutex::new(vec![None; n]),
                failed_seen: Mutex::new(vec![0; n]),
                stop: Mutex::new(false),
                wake: Condvar::new(),
                watcher: Mutex::new(None),
            }),
        };
        for (i, b) in mirror.branches.iter().enumerate() {
            if b.failed.load(Ordering::Relaxed) {
                tracing::warn!(
                    "mirror '{}': branch '{}' ({}) failed before and is not in sync ({} paths to copy); it serves nothing until `resync`",
                    mirror.name,
                    b.branch.name,
                    b.branch.dir.display(),
                    replayed.stale[i].len()
                );
            }
        }
        if read_only {
            if !replayed.in_flight.is_empty() {
                tracing::warn!(
                    "mirror '{}': {} changes were in flight when the daemon stopped, and a read-only mount cannot make the branches the same; it serves them from '{}'. Mount it read-write to repair them",
                    mirror.name,
                    replayed.in_flight.len(),
                    mirror.branches[mirror.reader()?].branch.name
                );
            }
            return Ok(mirror);
        }
        mirror.recover(&replayed.in_flight)?;
        // Other mounts' logs: a stopped mount's is taken over; one that is running refuses an
        // unshared mount. With sharing, branches other mounts found failed are left out.
        {
            let _names = mirror.lock_names()?;
            mirror.watch_failed();
            mirror.adopt()?;
        }
        Ok(mirror)
    }

    /// Make the changes that were in flight when a mount stopped (this one before, or another
    /// sharing the branches) the same on every branch, from the reading one.
    fn recover(&self, in_flight: &BTreeSet<String>) -> Result<()> {
        if in_flight.is_empty() {
            return Ok(());
        }
        let reader = self.reader()?;
        tracing::warn!(
            "mirror '{}': {} changes were in flight when the daemon stopped; making them the same on every branch from '{}'",
            self.name,
            in_flight.len(),
            self.branches[reader].branch.name
        );
        {
            let _names = self.lock_names()?;
            for b in self.in_sync().into_iter().filter(|b| *b != reader) {
                // Synced once at the end: the `W` lines stay until then, so a crash redoes it all.
                let synced = in_flight.iter().try_for_each(|path| {
                    let _file = self.lock_path(reader, path)?;
                    self.sync_path(reader, b, path, Data::Deferred).map(|_| ())
                });
                if let Err(e) = synced.and_then(|()| self.sync_branch(b)) {
                    self.fail(b, &e);
                }
            }
        }
        for path in in_flight {
            self.note(self.log.end(path));
        }
        Ok(())
    }

    // --- Sharing with other mounts -------------------------------------------------------------

    /// Take the lock of changes of names (on the reading branch), with `-o shared`.
    fn lock_names(&self) -> Result<Option<Locked<'_>>> {
        self.lock_names_as(LockKind::Exclusive)
    }

    /// The names lock as `kind`: shared to look names up on every branch while no other mount
    /// is halfway through changing one.
    fn lock_names_as(&self, kind: LockKind) -> Result<Option<Locked<'_>>> {
        let Some(sharing) = &self.sharing else { return Ok(None) };
        let r = self.reader()?;
        let top = self.top(r);
        let known = sharing.lock_files.lock()[r];
        let node = match known {
            Some(node) => node,
            None => {
                let name = OsStr::new(LOCK_NAME);
                let e = match top.lookup(&daemon(), NodeId::ROOT, name) {
                    Err(Error::Os(libc::ENOENT)) => match top.create(&daemon(), NodeId::ROOT, name, 0o600, libc::O_RDWR) {
                        Ok((e, o)) => {
                            let _ = top.release(&daemon(), e.node, o.fh);
                            e
                        }
                        // Another mount made it meanwhile.
                        Err(Error::Os(libc::EEXIST)) => top.lookup(&daemon(), NodeId::ROOT, name)?,
                        Err(e) => return Err(e),
                    },
                    other => other?,
                };
                let mut files = sharing.lock_files.lock();
                match files[r] {
                    Some(node) => {
                        top.forget(&daemon(), e.node, 1);
                        node
                    }
                    None => *files[r].insert(e.node),
                }
            }
        };
        shared::lock(top, node, kind)?;
        Ok(Some(Locked { level: top, node, kind, forget: false }))
    }

    /// Find object `id` on every in-sync branch it is not known on yet, under the names lock
    /// (shared; with `-o shared` other mounts' too). A name another thread or mount is making
    /// may be on the reading branch (where the object was looked up) and not yet on the others:
    /// found by name in that moment, it would be missing there, and the branch judged failed.
    /// Taken before any object's lock, as every holder of the names lock takes those after it.
    fn settle(&self, id: NodeId) -> Result<()> {
        let in_sync = self.in_sync();
        let missing = {
            let table = self.nodes.lock();
            table.nodes.get(&id.0).is_some_and(|n| in_sync.iter().any(|b| n.places[*b].is_none()))
        };
        if !missing {
            return Ok(());
        }
        let _names = self.names.read();
        let _shared = self.lock_names_as(LockKind::Shared)?;
        for b in in_sync {
            // One missing here is the change's to find, and fails the branch there.
            let _ = self.resolve(id, b);
        }
        Ok(())
    }

    /// Take what `guard` says: this mount's lock, then, with `-o shared`, the one every mount
    /// honours.
    fn guard(&self, guard: Guard) -> Result<Holding<'_>> {
        match guard {
            Guard::None => Ok(Holding::default()),
            Guard::Names => {
                let names = self.names.write();
                Ok(Holding { _shared: self.lock_names()?, _names: Some(names), _object: None })
            }
            Guard::Object(id) => {
                self.settle(id)?;
                let object = self.objects[id.0 as usize % OBJECT_STRIPES].lock();
                Ok(Holding { _shared: self.lock_object(id)?, _names: None, _object: Some(object) })
            }
        }
    }

    /// With `-o shared`, the lock of object `id` that every mount honours: a file's own, or the
    /// names lock for other objects.
    fn lock_object(&self, id: NodeId) -> Result<Option<Locked<'_>>> {
        if self.sharing.is_none() {
            return Ok(None);
        }
        let file = self.nodes.lock().nodes.get(&id.0).is_some_and(|n| n.kind == FileKind::File);
        if !file {
            return self.lock_names();
        }
        let r = self.reader()?;
        let node = self.resolve(id, r)?;
        match shared::lock(self.top(r), node, LockKind::Exclusive) {
            Ok(()) => Ok(Some(Locked { level: self.top(r), node, kind: LockKind::Exclusive, forget: false })),
            // A file the daemon may not open for writing (a write lock needs that): its
            // attributes change under the names lock instead, which every mount takes too
            // for such a file.
            Err(Error::Os(libc::EBADF | libc::EACCES | libc::EPERM)) => self.lock_names(),
            Err(e) => Err(e),
        }
    }

    /// Lock the file at `path` on branch `r`, if it is one, with `-o shared`.
    fn lock_path(&self, r: usize, path: &str) -> Result<Option<Locked<'_>>> {
        if self.sharing.is_none() {
            return Ok(None);
        }
        let top = self.top(r);
        let Some(e) = sync::find(top, path)? else { return Ok(None) };
        if e.attr.kind != FileKind::File {
            top.forget(&daemon(), e.node, 1);
            return Ok(None);
        }
        if let Err(err) = shared::lock(top, e.node, LockKind::Exclusive) {
            top.forget(&daemon(), e.node, 1);
            return Err(err);
        }
        Ok(Some(Locked { level: top, node: e.node, kind: LockKind::Exclusive, forget: true }))
    }

    /// Tell the other mounts that branch `b` failed: its name goes into [`FAILED_NAME`] on every
    /// branch still in sync.
    fn publish_failed(&self, b: usize) {
        let line = format!("{}\n", self.branches[b].branch.name);
        for c in self.in_sync() {
            let top = self.top(c);
            let name = OsStr::new(FAILED_NAME);
            let appended = (|| {
                let (e, fh) = match top.lookup(&daemon(), NodeId::ROOT, name) {
                    Ok(e) => (e, top.open(&daemon(), e.node, libc::O_RDWR).inspect_err(|_| top.forget(&daemon(), e.node, 1))?.fh),
                    Err(Error::Os(libc::ENOENT)) => {
                        let (e, o) = top.create(&daemon(), NodeId::ROOT, name, 0o644, libc::O_RDWR)?;
                        (e, o.fh)
                    }
                    Err(e) => return Err(e),
                };
                let result = shared::lock(top, e.node, LockKind::Exclusive).and_then(|()| {
                    let written =
                        top.getattr(&daemon(), e.node).and_then(|a| top.write(&daemon(), e.node, fh, a.size, line.as_bytes()));
                    let _ = shared::unlock(top, e.node, LockKind::Exclusive);
                    written
                });
                let _ = top.release(&daemon(), e.node, fh);
                top.forget(&daemon(), e.node, 1);
                result
            })();
            if let Err(e) = appended {
                tracing::warn!(
                    "mirror '{}': could not tell other mounts on branch '{}' that branch '{}' failed: {e}",
                    self.name,
                    self.branches[c].branch.name,
                    self.branches[b].branch.name
                );
            }
        }
    }

    /// Leave out the branches other mounts found failed (named in [`FAILED_NAME`] on a branch
    /// in sync here).
    fn watch_failed(&self) {
        let Some(sharing) = &self.sharing else { return };
        for c in self.in_sync() {
            let top = self.top(c);
            let name = OsStr::new(FAILED_NAME);
            let size = match top.lookup(&daemon(), NodeId::ROOT, name) {
                Ok(e) => {
                    top.forget(&daemon(), e.node, 1);
                    e.attr.size
                }
                Err(_) => 0,
            };
            if std::mem::replace(&mut sharing.failed_seen.lock()[c], size) == size || size == 0 {
                continue;
            }
            let Ok(text) = top.read_small_file(&daemon(), NodeId::ROOT, name, 1 << 20) else { continue };
            for line in String::from_utf8_lossy(&text).lines() {
                if let Some(b) = self.branches.iter().position(|br| br.branch.name == line) {
                    if !self.is_failed(b) {
                        let why = Error::BadArgs(format!(
                            "another mount found it failed (see {FAILED_NAME} on '{}')",
                            self.branches[c].branch.name
                        ));
                        self.fail_as(b, &why, false);
                    }
                }
            }
        }
    }

    /// After a resync: [`FAILED_NAME`] names only the branches still failed, on every branch.
    fn rewrite_failed(&self) -> Result<()> {
        let text: String =
            (0..self.branches.len()).filter(|b| self.is_failed(*b)).map(|b| format!("{}\n", self.branches[b].branch.name)).collect();
        for c in self.in_sync() {
            let top = self.top(c);
            let e = match top.lookup(&daemon(), NodeId::ROOT, OsStr::new(FAILED_NAME)) {
                Ok(e) => e,
                Err(Error::Os(libc::ENOENT)) => continue,
                Err(e) => return Err(e),
            };
            let result = (|| {
                let o = top.open(&daemon(), e.node, libc::O_RDWR | libc::O_TRUNC)?;
                let written = if text.is_empty() { Ok(0) } else { top.write(&daemon(), e.node, o.fh, 0, text.as_bytes()) };
                let _ = top.release(&daemon(), e.node, o.fh);
                written.map(|_| ())
            })();
            top.forget(&daemon(), e.node, 1);
            result?;
            if let Some(sharing) = &self.sharing {
                sharing.failed_seen.lock()[c] = text.len() as u64;
            }
        }
        Ok(())
    }

    /// Take over the logs of stopped mounts (their lock is free): what they had in flight is
    /// made the same on every branch, what they found failed and stale is this mount's now,
    /// and their logs go. Returns how many other mounts are running. An unshared mount refuses
    /// to run beside a shared one.
    fn adopt(&self) -> Result<usize> {
        let own = OsStr::new(self.log.own_name());
        // `(in LOGS_DIR, name)`; at the root, a mount's log from before it was shared.
        let mut logs: BTreeSet<(bool, OsString)> = BTreeSet::new();
        for b in self.in_sync() {
            let top = self.top(b);
            if self.sharing.is_some() {
                if let Ok(e) = top.lookup(&daemon(), NodeId::ROOT, OsStr::new(LOG_NAME)) {
                    top.forget(&daemon(), e.node, 1);
                    logs.insert((false, LOG_NAME.into()));
                }
            }
            let Ok(dir) = top.lookup(&daemon(), NodeId::ROOT, OsStr::new(LOGS_DIR)) else { continue };
            if let Ok(entries) = top.list_dir(&daemon(), dir.node) {
                logs.extend(entries.into_iter().filter(|e| e.name != own).map(|e| (true, e.name)));
            }
            top.forget(&daemon(), dir.node, 1);
        }
        let mut running = 0;
        for (in_dir, name) in logs {
            if !self.adopt_one(in_dir, &name)? {
                running += 1;
            }
        }
        Ok(running)
    }

    /// Take over one other log (in [`LOGS_DIR`] or at the root) if its mount stopped: whether it
    /// did (or the log needed nothing).
    fn adopt_one(&self, in_dir: bool, name: &OsStr) -> Result<bool> {
        // `(branch, directory, the log there)`.
        let mut copies: Vec<(usize, NodeId, Entry)> = Vec::new();
        let mut dirs: Vec<(usize, NodeId)> = Vec::new();
        let mut locked: Vec<Locked<'_>> = Vec::new();
        let mut running = false;
        for b in self.in_sync() {
            let top = self.top(b);
            let dir = if in_dir {
                let Ok(d) = top.lookup(&daemon(), NodeId::ROOT, OsStr::new(LOGS_DIR)) else { continue };
                dirs.push((b, d.node));
                d.node
            } else {
                NodeId::ROOT
            };
            let Ok(e) = top.lookup(&daemon(), dir, name) else { continue };
            copies.push((b, dir, e));
            match shared::try_lock(top, e.node, LockKind::Exclusive) {
                Ok(true) => locked.push(Locked { level: top, node: e.node, kind: LockKind::Exclusive, forget: false }),
                Ok(false) => running = true,
                // A lower without locks: nothing tells a running mount from a stopped one. A
                // shared mount leaves the log be; an unshared one was told it is alone.
                Err(_) => running = self.sharing.is_some(),
            }
        }
        let shown = if in_dir { format!("{LOGS_DIR}/{}", name.to_string_lossy()) } else { name.to_string_lossy().into_owned() };
        let result = (|| {
            if running {
                if self.sharing.is_none() {
                    return Err(Error::config(format!(
                        "mirror '{}': another mount is using this mirror with -o shared (its log {shown} is locked); mount with -o shared too",
                        self.name
                    )));
                }
                return Ok(false);
            }
            let empty = copies.iter().all(|(_, _, e)| e.attr.size == 0);
            let young = copies.iter().any(|(_, _, e)| e.attr.mtime.elapsed().map_or(true, |age| age < YOUNG));
            if copies.is_empty() || (empty && young) {
                return Ok(true);
            }
            let places: Vec<(Level, NodeId)> = copies.iter().map(|(b, dir, _)| (self.top(*b).clone(), *dir)).collect();
            let names: Vec<String> = self.branches.iter().map(|b| b.branch.name.clone()).collect();
            let said = log::read_copies(&places, name, &names)?;
            let failed = said.failed.iter().filter(|f| **f).count();
            if !said.in_flight.is_empty() || failed > 0 {
                tracing::warn!(
                    "mirror '{}': taking over the log {shown} of a mount that stopped: {} changes in flight, {failed} branches failed",
                    self.name,
                    said.in_flight.len(),
                );
            }
            // Noted here before the log goes, so a crash meanwhile loses nothing.
            for (b, failed) in said.failed.iter().enumerate() {
                if *failed && !self.is_failed(b) {
                    self.fail_as(b, &Error::BadArgs(format!("it failed in a mount that stopped (log {shown})")), true);
                }
                if !said.stale[b].is_empty() {
                    self.note(self.log.stale(b, &said.stale[b].iter().cloned().collect::<Vec<_>>()));
                }
            }
            for p in &said.in_flight {
                self.note(self.log.begin(p));
            }
            self.note(self.log.sync());
            for (b, dir, _) in &copies {
                self.top(*b).unlink(&daemon(), *dir, name)?;
            }
            self.recover(&said.in_flight)?;
            Ok(true)
        })();
        drop(locked);
        for (b, _, e) in copies {
            self.top(b).forget(&daemon(), e.node, 1);
        }
        for (b, dir) in dirs {
            self.top(b).forget(&daemon(), dir, 1);
        }
        result
    }

    /// With `-o shared`, a thread that looks every [`WATCH_EVERY`] for branches other mounts
    /// found failed, and now and then for logs of stopped mounts.
    fn start_watch(self: &Arc<Self>) {
        let Some(sharing) = &self.sharing else { return };
        let weak: Weak<Mirror> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("mirror-watch".into()).spawn(move || {
            let mut turn = 0u32;
            loop {
                let Some(m) = weak.upgrade() else { return };
                let Some(sharing) = &m.sharing else { return };
                {
                    let mut stop = sharing.stop.lock();
                    if !*stop {
                        sharing.wake.wait_for(&mut stop, WATCH_EVERY);
                    }
                    if *stop {
                        return;
                    }
                }
                m.watch_failed();
                turn += 1;
                if turn.is_multiple_of(ADOPT_EVERY) {
                    if let Err(e) = m.adopt() {
                        tracing::warn!("mirror '{}': taking over the logs of stopped mounts: {e}", m.name);
                    }
                }
            }
        });
        match spawned {
            Ok(handle) => *sharing.watcher.lock() = Some(handle),
            Err(e) => tracing::warn!("mirror '{}': no thread to watch other mounts: {e}", self.name),
        }
    }

    /// Whether this is the only mount running: `resync` and `scrub`, which compare and copy,
    /// must not race other mounts' changes.
    fn require_alone(&self, what: &str) -> Result<()> {
        if self.sharing.is_none() {
            return Ok(());
        }
        match self.adopt()? {
            0 => Ok(()),
            n => Err(Error::BadArgs(format!(
                "{what}: {n} other mount(s) of this mirror are running; {what} compares and copies what they may be changing, so it runs only where no other mount does"
            ))),
        }
    }

    fn top(&self, b: usize) -> &Level {
        self.branches[b].top()
    }

    fn is_failed(&self, b: usize) -> bool {
        self.branches[b].failed.load(Ordering::Acquire)
    }

    fn in_sync(&self) -> Vec<usize> {
        (0..self.branches.len()).filter(|b| !self.is_failed(*b)).collect()
    }

    /// The branch that serves reads: the first in sync.
    fn reader(&self) -> Result<usize> {
        (0..self.branches.len()).find(|b| !self.is_failed(*b)).ok_or(Error::Os(libc::EIO))
    }

    /// Take branch `b` out of the mirror.
    fn fail(&self, b: usize, why: &dyn std::fmt::Display) {
        self.fail_as(b, why, true)
    }

    /// Take branch `b` out of the mirror; with `-o shared` and `publish`, tell the other mounts.
    fn fail_as(&self, b: usize, why: &dyn std::fmt::Display, publish: bool) {
        if self.branches[b].failed.swap(true, Ordering::AcqRel) {
            return;
        }
        let serving = self
            .reader()
            .map(|r| format!("reads now come from '{}'", self.branches[r].branch.name))
            .unwrap_or_else(|_| "no branch is left".into());
        tracing::error!(
            "mirror '{}': branch '{}' ({}) failed: {why}; the mirror is degraded and {serving}; once the branch is back, `plyfs op MOUNT resync` brings it up to date",
            self.name,
            self.branches[b].branch.name,
            self.branches[b].branch.dir.display()
        );
        self.note(self.log.failed(b));
        if publish && self.sharing.is_some() {
            self.publish_failed(b);
        }
    }

    /// Fail the branches a log write could not reach.
    fn note(&self, unreached: Unreached) {
        for (b, e) in unreached {
            self.fail(b, &e);
        }
    }

    /// What the log could not note of a change about to be made: the branches that could not
    /// note it fail, unless none of the in-sync branches could (a full file system under all
    /// of them): then the change is refused with that error, and no branch fails for it.
    fn note_or_refuse(&self, unreached: Unreached) -> Result<()> {
        let Some((_, first)) = unreached.first() else { return Ok(()) };
        if self.in_sync().iter().all(|b| unreached.iter().any(|(u, _)| u == b)) {
            return Err(Error::Os(first.errno()));
        }
        self.note(unreached);
        Ok(())
    }

    /// Whether branch `b` still has its directory (a removed one answers ENOENT everywhere).
    fn alive(&self, b: usize) -> bool {
        self.top(b).getattr(&daemon(), NodeId::ROOT).is_ok_and(|a| a.nlink > 0)
    }

    /// Whether `e`, from the reading branch `b`, is the branch's fault.
    fn branch_failure(&self, b: usize, e: &Error) -> bool {
        match e.errno() {
            errno if BRANCH_FAILURES.contains(&errno) => true,
            libc::ENOENT | libc::ESTALE => self.in_sync().len() > 1 && !self.alive(b),
            _ => false,
        }
    }

    /// Run `f` on the reading branch, failing over to the next in-sync branch when the branch
    /// is at fault.
    fn on_reader<T>(&self, f: impl Fn(usize) -> Result<T>) -> Result<(usize, T)> {
        loop {
            let r = self.reader()?;
            match f(r) {
                Err(e) if self.branch_failure(r, &e) => self.fail(r, &e),
                other => return other.map(|v| (r, v)),
            }
        }
    }

    /// Run a change on every in-sync branch: the reading one first (its answer is the answer;
    /// an ordinary error stops there), then the others. A branch that cannot follow fails; for
    /// failed branches the change's `paths` are noted stale.
    fn change(&self, guard: Guard, paths: &dyn Fn() -> Vec<String>, f: impl Fn(usize) -> Result<Reply>) -> Result<Changed> {
        let _members = self.membership.read();
        let _held = self.guard(guard)?;
        self.apply(paths, f)
    }

    /// A change that takes names away (unlink, rmdir, rename): under the names lock, the objects
    /// `named` now are first found on every branch, as they cannot be found by these names
    /// after; `then` runs when it succeeded, before the lock goes.
    fn change_names(
        &self,
        named: &[(NodeId, &OsStr)],
        paths: &dyn Fn() -> Vec<String>,
        f: impl Fn(usize) -> Result<Reply>,
        then: impl FnOnce(),
    ) -> Result<Changed> {
        let _members = self.membership.read();
        let _held = self.guard(Guard::Names)?;
        for (parent, name) in named {
            self.pin(*parent, name);
        }
        self.apply(paths, f).inspect(|_| then())
    }

    /// [`Mirror::change`] once its locks are held.
    fn apply(&self, paths: &dyn Fn() -> Vec<String>, f: impl Fn(usize) -> Result<Reply>) -> Result<Changed> {
        let path_list = paths();
        for (i, p) in path_list.iter().enumerate() {
            if let Err(e) = self.note_or_refuse(self.log.begin(p)) {
                for begun in &path_list[..=i] {
                    let _ = self.note_or_refuse(self.log.end(begun));
                }
                return Err(e);
            }
        }
        let result = self.on_reader(&f);
        let mut others = Vec::new();
        if let Ok((r, _)) = &result {
            for b in (0..self.branches.len()).filter(|b| b != r) {
                if self.is_failed(b) {
                    continue;
                }
                match f(b) {
                    Ok(reply) => others.push((b, reply)),
                    Err(e) if path_list.is_empty() => self.fail(b, &e),
                    Err(e) => self.fail(b, &format!("{}: {e}", path_list.join(" -> "))),
                }
            }
        }
        for b in (0..self.branches.len()).filter(|b| self.is_failed(*b)) {
            self.note(self.log.stale(b, &path_list));
        }
        for p in &path_list {
            self.note(self.log.end(p));
        }
        result.map(|(r, reply)| (r, reply, others))
    }

    // --- Objects ---------------------------------------------------------------------------

    /// The object's node on branch `b`, found by name from its parent if not known yet.
    fn resolve(&self, id: NodeId, b: usize) -> Result<NodeId> {
        let (parent, name) = {
            let table = self.nodes.lock();
            let n = table.nodes.get(&id.0).ok_or(Error::Os(libc::ESTALE))?;
            if let Some(node) = n.places[b] {
                return Ok(node);
            }
            n.parent.clone().ok_or(Error::Os(libc::ESTALE))?
        };
        self.place_by_name(id, b, NodeId(parent), &name)
    }

    /// Find object `id` on branch `b` as `name` in `parent`, and keep its place there.
    fn place_by_name(&self, id: NodeId, b: usize, parent: NodeId, name: &OsStr) -> Result<NodeId> {
        let dir = self.resolve(parent, b)?;
        let e = self.top(b).lookup(&daemon(), dir, name)?;
        let mut table = self.nodes.lock();
        match table.nodes.get_mut(&id.0) {
            Some(n) if n.places[b].is_none() => {
                n.places[b] = Some(e.node);
                Ok(e.node)
            }
            Some(n) => {
                let known = n.places[b].expect("checked");
                drop(table);
                self.top(b).forget(&daemon(), e.node, 1);
                Ok(known)
            }
            None => {
                drop(table);
                self.top(b).forget(&daemon(), e.node, 1);
                Err(Error::Os(libc::ESTALE))
            }
        }
    }

    /// Under the names lock: if the object named `name` in `parent` is one the mirror knows,
    /// find it on every in-sync branch it is not known on yet. Where it cannot be found, the
    /// change that follows finds the branch's fault.
    fn pin(&self, parent: NodeId, name: &OsStr) {
        let Ok(r) = self.reader() else { return };
        let Ok(e) = self.resolve(parent, r).and_then(|dir| self.top(r).lookup(&daemon(), dir, name)) else { return };
        self.top(r).forget(&daemon(), e.node, 1);
        let missing: Vec<(NodeId, usize)> = {
            let mut table = self.nodes.lock();
            let id = table.id_of(Place { branch: r as u32, node: e.node });
            let Some(n) = table.nodes.get(&id) else { return };
            self.in_sync().into_iter().filter(|b| n.places[*b].is_none()).map(|b| (NodeId(id), b)).collect()
        };
        for (id, b) in missing {
            let _ = self.place_by_name(id, b, parent, name);
        }
    }

    /// Keep an object found (or made) as `name` in `parent`: `found` is where, on which branch;
    /// each such place carries one lookup, which the mirror keeps or drops.
    fn remember(&self, parent: NodeId, name: &OsStr, reader: usize, found: &[(usize, Entry)]) -> Entry {
        let (_, top) = found.iter().find(|(b, _)| *b == reader).copied().unwrap_or(found[0]);
        let mut table = self.nodes.lock();
        let id = table.id_of(Place { branch: reader as u32, node: top.node });
        let n = self.branches.len();
        let node =
            table.nodes.entry(id).or_insert_with(|| MNode { kind: top.attr.kind, lookups: 0, places: vec![None; n], parent: None });
        node.lookups += 1;
        node.kind = top.attr.kind;
        node.parent = Some((parent.0, name.to_owned()));
        let mut extra = Vec::new();
        for (b, e) in found {
            match node.places[*b] {
                None => node.places[*b] = Some(e.node),
                Some(known) if known == e.node => extra.push((*b, e.node)),
                Some(old) => {
                    node.places[*b] = Some(e.node);
                    extra.push((*b, old));
                }
            }
        }
        drop(table);
        for (b, node) in extra {
            self.top(b).forget(&daemon(), node, 1);
        }
        Entry { node: NodeId(id), ..top }
    }

    fn forget(&self, id: NodeId, nlookup: u64) {
        if id == NodeId::ROOT {
            return;
        }
        let mut table = self.nodes.lock();
        let Some(n) = table.nodes.get_mut(&id.0) else { return };
        n.lookups = n.lookups.saturating_sub(nlookup);
        if n.lookups > 0 {
            return;
        }
        let places = table.nodes.remove(&id.0).map(|n| n.places).unwrap_or_default();
        drop(table);
        for (b, node) in places.into_iter().enumerate() {
            if let Some(node) = node {
                self.top(b).forget(&daemon(), node, 1);
            }
        }
    }

    /// The object's path from the root, for the log ("" is the root).
    fn path_of(&self, id: NodeId) -> String {
        self.nodes.lock().path_of(id.0)
    }

    fn child_path(&self, parent: NodeId, name: &OsStr) -> String {
        let p = self.path_of(parent);
        if p.is_empty() {
            name.to_string_lossy().into_owned()
        } else {
            format!("{p}/{}", name.to_string_lossy())
        }
    }

    fn hidden(&self, parent: NodeId, name: &OsStr) -> bool {
        (parent == NodeId::ROOT && (is_log_name(name) || name == LOCK_NAME || name == FAILED_NAME)) || self.temps.is_temp(name)
    }

    fn lookup(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Result<Entry> {
        if self.hidden(parent, name) {
            return Err(Error::Os(libc::ENOENT));
        }
        let (r, e) = self.on_reader(|r| self.top(r).lookup(cx, self.resolve(parent, r)?, name))?;
        Ok(self.remember(parent, name, r, &[(r, e)]))
    }

    /// A change that makes `name` in `parent` (mkdir, create, ...), on every branch.
    fn make(&self, parent: NodeId, name: &OsStr, f: impl Fn(usize, NodeId) -> Result<Reply>) -> Result<Reply> {
        if self.hidden(parent, name) {
            return Err(Error::Os(libc::EPERM));
        }
        let (r, reply, others) =
            self.change(Guard::Names, &|| vec![self.child_path(parent, name)], |b| f(b, self.resolve(parent, b)?))?;
        let mut found: Vec<(usize, Entry)> = entry_of(&reply).map(|e| (r, e)).into_iter().collect();
        found.extend(others.iter().filter_map(|(b, rep)| entry_of(rep).map(|e| (*b, e))));
        let entry = self.remember(parent, name, r, &found);
        Ok(match reply {
            Reply::Created(_, opened) => {
                let mut handles = vec![None; self.branches.len()];
                handles[r] = Some((found[0].1.node, opened.fh));
                for (b, rep) in &others {
                    if let (Some(e), Reply::Created(_, o)) = (entry_of(rep), rep) {
                        handles[*b] = Some((e.node, o.fh));
                    }
                }
                let flush_on_close =
                    opened.flush_on_close || others.iter().any(|(_, rep)| matches!(rep, Reply::Created(_, o) if o.flush_on_close));
                let path = self.child_path(parent, name);
                let file = MFile {
                    node: entry.node,
                    flags: libc::O_RDWR,
                    writes: true,
                    handles: Mutex::new(handles),
                    path,
                    in_flight: AtomicBool::new(false),
                };
                let fh = self.register(file);
                Reply::Created(entry, Opened { fh: FileHandle(fh), backing: None, direct_io: opened.direct_io, flush_on_close })
            }
            _ => Reply::Entry(entry),
        })
    }

    fn register(&self, file: MFile) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.files.lock().insert(fh, Arc::new(file));
        fh
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<MFile>> {
        self.files.lock().get(&fh.0).cloned().ok_or(Error::Os(libc::EBADF))
    }

    /// The file's handle on branch `b`, opened there now if it has none.
    fn handle_on(&self, file: &MFile, b: usize) -> Result<(NodeId, FileHandle)> {
        if let Some(h) = file.handles.lock()[b] {
            return Ok(h);
        }
        let node = self.resolve(file.node, b)?;
        let flags = file.flags & !(libc::O_TRUNC | libc::O_CREAT | libc::O_EXCL);
        let opened = self.top(b).open(&daemon(), node, flags)?;
        let mut handles = file.handles.lock();
        match handles[b] {
            Some(h) => {
                drop(handles);
                let _ = self.top(b).release(&daemon(), node, opened.fh);
                Ok(h)
            }
            None => {
                handles[b] = Some((node, opened.fh));
                Ok((node, opened.fh))
            }
        }
    }

    fn open(&self, cx: &Caller, id: NodeId, flags: i32) -> Result<Reply> {
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
        let n = self.branches.len();
        if !writes {
            // One branch serves it.
            let (r, opened) = self.on_reader(|r| self.top(r).open(cx, self.resolve(id, r)?, flags))?;
            let mut handles = vec![None; n];
            handles[r] = Some((self.resolve(id, r)?, opened.fh));
            let file = MFile {
                node: id,
                flags,
                writes: false,
                handles: Mutex::new(handles),
                path: String::new(),
                in_flight: AtomicBool::new(false),
            };
            return Ok(Reply::Opened(Opened { fh: FileHandle(self.register(file)), backing: None, ..opened }));
        }
        self.settle(id)?;
        let path = self.path_of(id);
        let truncates = flags & libc::O_TRUNC != 0;
        let paths = || if truncates { vec![path.clone()] } else { Vec::new() };
        let guard = if truncates { Guard::Object(id) } else { Guard::None };
        let (r, reply, others) =
            self.change(guard, &paths, |b| self.top(b).call(cx, &Op::Open { node: self.resolve(id, b)?, flags }))?;
        let mut handles = vec![None; n];
        let mut first: Option<Opened> = None;
        for (b, reply) in std::iter::once((r, reply)).chain(others) {
            if let Reply::Opened(o) = reply {
                handles[b] = Some((self.resolve(id, b)?, o.fh));
                if first.is_none() {
                    first = Some(o);
                }
            }
        }
        let opened = first.ok_or(Error::Os(libc::EIO))?;
        let file = MFile { node: id, flags, writes: true, handles: Mutex::new(handles), path, in_flight: AtomicBool::new(false) };
        // Writes must come here to reach every branch: no passthrough.
        Ok(Reply::Opened(Opened { fh: FileHandle(self.register(file)), backing: None, ..opened }))
    }

    /// `op` on object `node`, from the reading branch (failing over).
    fn read_at(&self, cx: &Caller, op: &Op<'_>, node: NodeId) -> Result<Reply> {
        self.on_reader(|r| self.top(r).call(cx, &op.at(self.resolve(node, r)?))).map(|(_, reply)| reply)
    }

    /// `op` on an open file, from the reading branch (opened there if needed; failing over).
    fn read_open(&self, cx: &Caller, op: &Op<'_>, file: &MFile) -> Result<Reply> {
        // `lseek`'s ENXIO (no data, or no hole, past the offset) is its answer, not the
        // branch's fault (xfstests generic/285 failed both branches with it).
        let enxio_answers = matches!(op, Op::Lseek { .. });
        self.on_reader(|r| {
            let (node, bfh) = self.handle_on(file, r)?;
            match self.top(r).call(cx, &op.on_open(node, bfh)) {
                Err(e) if enxio_answers && e.errno() == libc::ENXIO => Ok(Err(e)),
                other => other.map(Ok),
            }
        })
        .and_then(|(_, reply)| reply)
    }

    /// An operation on an open file that changes it: on every in-sync branch (opened there if
    /// needed), in parallel when `parallel`.
    fn file_change(
        &self,
        file: &MFile,
        parallel: bool,
        f: impl Fn(usize, NodeId, FileHandle) -> Result<Reply> + Sync,
    ) -> Result<Reply> {
        let _members = self.membership.read();
        let _held = self.guard(Guard::Object(file.node))?;
        if !file.in_flight.swap(true, Ordering::AcqRel) {
            if let Err(e) = self.note_or_refuse(self.log.begin(&file.path)) {
                let _ = self.note_or_refuse(self.log.end(&file.path));
                file.in_flight.store(false, Ordering::Release);
                return Err(e);
            }
        }
        let targets = self.in_sync();
        let run = |b: usize| self.handle_on(file, b).and_then(|(node, bfh)| f(b, node, bfh));
        let results: Vec<(usize, Result<Reply>)> = if parallel && targets.len() > 1 {
            std::thread::scope(|s| {
                let spawned: Vec<_> = targets[1..].iter().map(|&b| (b, s.spawn(move || run(b)))).collect();
                let mut results = vec![(targets[0], run(targets[0]))];
                for (b, h) in spawned {
                    results.push((b, h.join().unwrap_or(Err(Error::Os(libc::EIO)))));
                }
                results
            })
        } else {
            targets.iter().map(|&b| (b, run(b))).collect()
        };
        self.judge(file, results)
    }

    /// The answer to a change of `file` from the branches' `results`: the first branch whose
    /// answer is not its own fault answers, and a branch that answered otherwise fails. An error
    /// every branch gives (a full disk everywhere, a bad argument) is the operation's answer.
    fn judge(&self, file: &MFile, results: Vec<(usize, Result<Reply>)>) -> Result<Reply> {
        // The first branch whose answer is not its own fault answers.
        let answer = results.iter().position(|(b, r)| !matches!(r, Err(e) if self.branch_failure(*b, e)));
        let Some(answer) = answer else {
            let (b, first) = results.into_iter().next().ok_or(Error::Os(libc::EIO))?;
            let err = first.err().unwrap_or(Error::Os(libc::EIO));
            self.fail(b, &format!("{}: {err}", file.path));
            return Err(err);
        };
        let summary = |r: &Result<Reply>| match r {
            Ok(Reply::Written(n)) => Ok(Some(*n)),
            Ok(_) => Ok(None),
            Err(e) => Err(e.errno()),
        };
        let expected = summary(&results[answer].1);
        for (i, (b, r)) in results.iter().enumerate() {
            if i != answer && summary(r) != expected {
                let why = match r {
                    Err(e) => Error::Os(e.errno()),
                    Ok(_) => Error::Corrupt("it did not do what the reading branch did".into()),
                };
                self.fail(*b, &format!("{}: {why}", file.path));
            }
        }
        for b in (0..self.branches.len()).filter(|b| self.is_failed(*b)) {
            self.note(self.log.stale(b, std::slice::from_ref(&file.path)));
        }
        results.into_iter().nth(answer).expect("found above").1
    }

    fn release(&self, cx: &Caller, fh: FileHandle) -> Result<Reply> {
        let file = self.files.lock().remove(&fh.0).ok_or(Error::Os(libc::EBADF))?;
        let handles = std::mem::take(&mut *file.handles.lock());
        for (b, h) in handles.into_iter().enumerate() {
            if let Some((node, bfh)) = h {
                let _ = self.top(b).call(cx, &Op::Release { node, fh: bfh });
            }
        }
        if file.in_flight.load(Ordering::Acquire) {
            self.note(self.log.end(&file.path));
        }
        Ok(Reply::Empty)
    }

    fn read_dir(&self, cx: &Caller, id: NodeId, fh: FileHandle, offset: u64, max_entries: u32, plus: bool) -> Result<Vec<DirEntry>> {
        let (r, node, bfh) = *self.dirs.lock().get(&fh.0).ok_or(Error::Os(libc::EBADF))?;
        let entries = match self.top(r).call(cx, &Op::ReadDir { node, fh: bfh, offset, max_entries, plus })? {
            Reply::Dir(d) => d,
            _ => return Err(Error::Os(libc::EIO)),
        };
        let mut out = Vec::with_capacity(entries.len());
        for mut e in entries {
            if e.name != "." && e.name != ".." && self.hidden(id, &e.name) {
                if let Some(entry) = e.entry {
                    self.top(r).forget(&daemon(), entry.node, 1);
                }
                continue;
            }
            e.node = match (&e.entry, e.name.to_str()) {
                (Some(entry), _) => {
                    let kept = self.remember(id, &e.name, r, &[(r, *entry)]);
                    e.entry = Some(kept);
                    kept.node
                }
                (None, Some(".")) => id,
                (None, Some("..")) => {
                    NodeId(self.nodes.lock().nodes.get(&id.0).and_then(|n| n.parent.as_ref().map(|p| p.0)).unwrap_or(NodeId::ROOT.0))
                }
                (None, _) => NodeId(self.nodes.lock().id_of(Place { branch: r as u32, node: e.node })),
            };
            out.push(e);
        }
        Ok(out)
    }

    fn rename(&self, cx: &Caller, parent: NodeId, name: &OsStr, new_parent: NodeId, new_name: &OsStr, flags: u32) -> Result<Reply> {
        if self.hidden(parent, name) || self.hidden(new_parent, new_name) {
            return Err(Error::Os(libc::EPERM));
        }
        let moved = self.lookup(cx, parent, name)?;
        let paths = || vec![self.child_path(parent, name), self.child_path(new_parent, new_name)];
        let op = |b: usize| {
            let (p, np) = (self.resolve(parent, b)?, self.resolve(new_parent, b)?);
            self.top(b).call(cx, &Op::Rename { parent: p, name, new_parent: np, new_name, flags })
        };
        // Its new name is noted before another change of names may look for it by name.
        let renamed = || {
            if let Some(n) = self.nodes.lock().nodes.get_mut(&moved.node.0) {
                n.parent = Some((new_parent.0, new_name.to_owned()));
            }
        };
        let result = self.change_names(&[(parent, name), (new_parent, new_name)], &paths, op, renamed);
        self.forget(moved.node, 1);
        result.map(|_| Reply::Empty)
    }

    fn status(&self) -> Value {
        let reader = self.reader().ok();
        let branches: Vec<Value> = self
            .branches
            .iter()
            .enumerate()
            .map(|(i, b)| {
                json!({
                    "name": b.branch.name,
                    "dir": b.branch.dir.display().to_string(),
                    "state": if self.is_failed(i) { "failed" } else { "in-sync" },
                    "stale_paths": self.log.stale_count(i),
                    "serves_reads": reader == Some(i),
                })
            })
            .collect();
        json!({
            "degraded": self.branches.iter().enumerate().any(|(i, _)| self.is_failed(i)),
            "reads_from": reader.map(|r| self.branches[r].branch.name.clone()),
            "changes_in_flight": self.log.in_flight(),
            "branches": branches,
        })
    }
}

impl Layer for Mirror {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "mirror"
    }

    fn data_path(&self) -> DataPath {
        // Every read and write comes here, none through passthrough: writes must reach every
        // branch, and the kernel refuses (EIO) to open a file with passthrough while it is open
        // without, or the other way round, so read-only opens cannot use it either.
        DataPath::Observes
    }

    fn lower(&self) -> &[Level] {
        &[]
    }

    fn branches(&self) -> Vec<Branch> {
        self.branches.iter().map(|b| b.branch.clone()).collect()
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        match *op {
            Op::Lookup { parent, name } => self.lookup(cx, parent, name).map(Reply::Entry),
            Op::Forget { node, nlookup } => {
                self.forget(node, nlookup);
                Ok(Reply::Empty)
            }
            Op::GetAttr { node, fh } => match fh.and_then(|fh| self.file(fh).ok()) {
                Some(file) => self.read_open(cx, op, &file),
                None => self.read_at(cx, op, node),
            },
            Op::SetAttr { node, fh, .. } => {
                let file = fh.and_then(|fh| self.file(fh).ok());
                let change = |b: usize| match &file {
                    Some(f) => {
                        let (bn, bfh) = self.handle_on(f, b)?;
                        self.top(b).call(cx, &op.on_open(bn, bfh))
                    }
                    None => self.top(b).call(cx, &op.at(self.resolve(node, b)?)),
                };
                self.change(Guard::Object(node), &|| vec![self.path_of(node)], change).map(|(_, reply, _)| reply)
            }
            Op::ReadLink { node } | Op::Access { node, .. } | Op::GetXattr { node, .. } | Op::ListXattr { node, .. } => {
                self.read_at(cx, op, node)
            }
            Op::SetXattr { node, .. } | Op::RemoveXattr { node, .. } => self
                .change(Guard::Object(node), &|| vec![self.path_of(node)], |b| self.top(b).call(cx, &op.at(self.resolve(node, b)?)))
                .map(|(_, reply, _)| reply),
            Op::MkNod { parent, name, .. }
            | Op::MkDir { parent, name, .. }
            | Op::SymLink { parent, name, .. }
            | Op::Create { parent, name, .. } => self.make(parent, name, |b, p| self.top(b).call(cx, &op.at(p))),
            Op::Link { node, new_parent, new_name } => {
                if self.hidden(new_parent, new_name) {
                    return Err(Error::Os(libc::EPERM));
                }
                let paths = || vec![self.child_path(new_parent, new_name)];
                let (r, reply, others) = self.change(Guard::Names, &paths, |b| {
                    self.top(b)
                        .call(cx, &Op::Link { node: self.resolve(node, b)?, new_parent: self.resolve(new_parent, b)?, new_name })
                })?;
                // The same object: the places the mirror holds stay; the new lookups go.
                for (b, rep) in std::iter::once((r, &reply)).chain(others.iter().map(|(b, r)| (*b, r))) {
                    if let Some(e) = entry_of(rep) {
                        self.top(b).forget(&daemon(), e.node, 1);
                    }
                }
                let mut table = self.nodes.lock();
                let m = table.nodes.get_mut(&node.0).ok_or(Error::Os(libc::ESTALE))?;
                m.lookups += 1;
                let e = entry_of(&reply).ok_or(Error::Os(libc::EIO))?;
                Ok(Reply::Entry(Entry { node, ..e }))
            }
            Op::Unlink { parent, name } | Op::RmDir { parent, name } => {
                if self.hidden(parent, name) {
                    return Err(Error::Os(libc::EPERM));
                }
                let paths = || vec![self.child_path(parent, name)];
                self.change_names(&[(parent, name)], &paths, |b| self.top(b).call(cx, &op.at(self.resolve(parent, b)?)), || ())
                    .map(|(_, reply, _)| reply)
            }
            Op::Rename { parent, name, new_parent, new_name, flags } => self.rename(cx, parent, name, new_parent, new_name, flags),
            Op::Open { node, flags } => self.open(cx, node, flags),
            Op::Read { fh, .. } | Op::Lseek { fh, .. } => self.read_open(cx, op, &*self.file(fh)?),
            // Flags are read from the reading branch and set on every branch, as a write. A
            // directory's are read through the branch its handle was opened on, and set on every
            // branch through a handle opened there for the purpose.
            Op::Ioctl { node, fh, cmd, .. } if self.dirs.lock().contains_key(&fh.0) => {
                if !plyfs_stack::ioctl::sets(cmd) {
                    let (r, bnode, bfh) = *self.dirs.lock().get(&fh.0).ok_or(Error::Os(libc::EBADF))?;
                    return self.top(r).call(cx, &op.on_open(bnode, bfh));
                }
                self.change(Guard::Object(node), &|| vec![self.path_of(node)], |b| {
                    self.top(b).ioctl_opened(cx, op, self.resolve(node, b)?, FileKind::Dir)
                })
                .map(|(_, reply, _)| reply)
            }
            Op::Ioctl { fh, cmd, .. } if !plyfs_stack::ioctl::sets(cmd) => self.read_open(cx, op, &*self.file(fh)?),
            Op::Ioctl { fh, .. } => {
                let file = self.file(fh)?;
                self.file_change(&file, false, |b, node, bfh| self.top(b).call(cx, &op.on_open(node, bfh)))
            }
            Op::Write { fh, data, .. } => {
                let file = self.file(fh)?;
                self.file_change(&file, data.len() >= PARALLEL_FROM, |b, node, bfh| self.top(b).call(cx, &op.on_open(node, bfh)))
            }
            Op::Fallocate { fh, .. } => {
                let file = self.file(fh)?;
                self.file_change(&file, false, |b, node, bfh| self.top(b).call(cx, &op.on_open(node, bfh)))
            }
            Op::Flush { fh, .. } | Op::Fsync { fh, .. } => {
                let file = self.file(fh)?;
                if !file.writes {
                    return self.read_open(cx, op, &file);
                }
                if matches!(op, Op::Fsync { .. }) {
                    // What the log says must be durable before the data it covers.
                    self.note(self.log.sync());
                }
                let handles = file.handles.lock().clone();
                let results = self.in_sync().into_iter().filter_map(|b| {
                    let (node, bfh) = handles[b]?;
                    Some((b, self.top(b).call(cx, &op.on_open(node, bfh))))
                });
                self.judge(&file, results.collect())
            }
            Op::Release { fh, .. } => self.release(cx, fh),
            Op::OpenDir { node } => {
                let (r, (bnode, opened)) = self.on_reader(|r| {
                    let bnode = self.resolve(node, r)?;
                    match self.top(r).call(cx, &Op::OpenDir { node: bnode })? {
                        Reply::Opened(o) => Ok((bnode, o)),
                        _ => Err(Error::Os(libc::EIO)),
                    }
                })?;
                let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
                self.dirs.lock().insert(fh, (r, bnode, opened.fh));
                Ok(Reply::Opened(Opened { fh: FileHandle(fh), ..opened }))
            }
            Op::ReadDir { node, fh, offset, max_entries, plus } => {
                self.read_dir(cx, node, fh, offset, max_entries, plus).map(Reply::Dir)
            }
            Op::ReleaseDir { fh, .. } => {
                if let Some((r, node, bfh)) = self.dirs.lock().remove(&fh.0) {
                    let _ = self.top(r).call(cx, &Op::ReleaseDir { node, fh: bfh });
                }
                Ok(Reply::Empty)
            }
            Op::FsyncDir { node, datasync, .. } => {
                for b in self.in_sync() {
                    let bnode = self.resolve(node, b)?;
                    if let Ok(Reply::Opened(o)) = self.top(b).call(cx, &Op::OpenDir { node: bnode }) {
                        let result = self.top(b).call(cx, &Op::FsyncDir { node: bnode, fh: o.fh, datasync });
                        let _ = self.top(b).call(cx, &Op::ReleaseDir { node: bnode, fh: o.fh });
                        if let Err(e) = result {
                            self.fail(b, &e);
                        }
                    }
                }
                Ok(Reply::Empty)
            }
            Op::StatFs { .. } => self.read_at(cx, op, NodeId::ROOT),
            Op::Extended { name: "mirror-status", .. } => Ok(Reply::Extended(self.status())),
            Op::Extended { name: "resync", args, .. } => self.resync(args).map(Reply::Extended),
            Op::Extended { name: "scrub", .. } => self.scrub().map(Reply::Extended),
            Op::Extended { node, .. } => self.read_at(cx, op, node),
        }
    }

    fn shutdown(&self) {
        if let Some(sharing) = &self.sharing {
            *sharing.stop.lock() = true;
            sharing.wake.notify_all();
            if let Some(h) = sharing.watcher.lock().take() {
                if h.thread().id() != std::thread::current().id() {
                    let _ = h.join();
                }
            }
            let files = std::mem::take(&mut *sharing.lock_files.lock());
            for (b, node) in files.into_iter().enumerate() {
                if let Some(node) = node {
                    self.top(b).forget(&daemon(), node, 1);
                }
            }
        }
        self.log.close();
        for b in &self.branches {
            b.branch.stack.shutdown();
        }
    }
}

fn build(args: FanOutArgs) -> Result<Arc<dyn Layer>> {
    let mirror = Arc::new(Mirror::new(args)?);
    mirror.start_watch();
    Ok(mirror)
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "mirror",
    summary: "fan-out: every change to every branch, reads from the first in sync with failover; write-intent log, resync, scrub",
    params: &[],
    ext_ops: EXT_OPS,
    build: Build::FanOut(build),
    absorbs: &[],
};
