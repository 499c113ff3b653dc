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

mod change;
mod failover;
mod log;
mod objects;
mod share;
mod sync;

use std::collections::{BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use plyfs_stack::shared;
use plyfs_stack::spec::BranchMode;
use plyfs_stack::{
    Branch, Build, Caller, DataPath, DirEntry, Entry, Error, ExtOpInfo, FanOutArgs, FileHandle, FileKind, Layer, LayerFactory, Level,
    NodeId, Op, Opened, Reply, Result,
};
use serde_json::{json, Value};

use crate::ids::{NodeTable, Place};
use crate::transfer::{Data, TempNames};
use change::Guard;
use log::{is_log_name, IntentLog};
use share::{Sharing, FAILED_NAME, LOCK_NAME};

/// Names of copies a resync is writing; never shown, removed when found left over.
pub const TEMP_PREFIX: &str = ".plyfs-mirror-copy.";
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

/// A path as the log shows it: control characters (a terminal escape, a newline that would
/// forge a log line) become `\xNN`, and a backslash `\\`, so a name made of any bytes stays
/// one readable line.
fn printable(path: &str) -> String {
    let mut shown = String::with_capacity(path.len());
    for c in path.chars() {
        match c {
            '\\' => shown.push_str("\\\\"),
            c if c.is_control() => shown.push_str(&format!("\\x{:02x}", c as u32)),
            c => shown.push(c),
        }
    }
    shown
}

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
            sharing: sharing.then(|| Sharing::new(n)),
        };
        for (i, b) in mirror.branches.iter().enumerate() {
            if b.failed.load(Ordering::Relaxed) {
                tracing::warn!(
                    "mirror '{}': branch '{}' ({}) failed before and is not in sync ({} paths to copy); it serves nothing until `resync`",
                    mirror.name,
                    b.branch.name,
                    b.branch.lower,
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
                let mut row = json!({
                    "name": b.branch.name,
                    "state": if self.is_failed(i) { "failed" } else { "in-sync" },
                    "stale_paths": self.log.stale_count(i),
                    "serves_reads": reader == Some(i),
                });
                let (place, at) = b.branch.lower.field();
                row[place] = at.into();
                row
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
        self.stop_sharing();
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
