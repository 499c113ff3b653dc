//! `cache`: a fast branch in front of a slow one (an SSD before a disk, a local disk before a
//! remote stack), and the tier of mergerfs-style setups.
//!
//! `--stack 'cache[@/ssd/cache | remote:addr=tcp:nas:7070]'`, or `--stack cache --branch
//! /hdd/data` with the mount's lower as the fast branch. The first branch is the fast one.
//!
//! - **The slow branch is the file system.** Names, directories, attributes and extended
//!   attributes are its own: every operation on them goes to it, with its node ids, so inode
//!   numbers are the slow branch's and stay the same across remounts. The fast branch holds
//!   only copies of file data, in `.plyfs-cache/` ([`store`]), keyed by the slow file's node id
//!   (hard links share a copy; renames keep it).
//! - **Reads.** Opening a file whose whole copy is as fresh as the slow file (same size, mtime
//!   and ctime) is served from the copy by passthrough: the daemon is off the data path. A file
//!   not cached yet is filled a range at a time as it is read, with the next ranges fetched
//!   ahead in parallel ([`fill`]); once whole, later opens use passthrough.
//! - **Writes.** `mode=write-through` (the default): every write reaches the slow branch before
//!   it is answered, and the copy with it; a writer next to readers of the copy by passthrough
//!   (the kernel gives it the same copy) reaches it at close and `fsync`. `mode=write-back`: a
//!   file opened for writing is written in its copy (by passthrough), noted in the write-back
//!   log first, and copied to the slow branch after `delay` once no one writes it, at `fsync`,
//!   at `cache-flush` and at unmount. A restart writes back what the log names before anything else.
//! - **Coherence.** Every open compares the copy with the slow file's attributes as the slow
//!   branch gives them now (a remote branch's change notices drop its cached attributes first):
//!   a change made there by another mount or machine is never served from an old copy (one that
//!   live opens read by passthrough is fetched again in place).
//!   A copy that holds unwritten changes wins (last writer wins, as with NFS).
//! - **Eviction** keeps the copies under `max_size` and the fast file system's free space above
//!   `min_free`, and drops copies unused for `max_age`, least recently used first; never a copy
//!   that is open, filling, pinned or not yet written back.
//! - **Pins.** `user.plyfs.cache=pin|never|auto` on a file or a directory (and everything under
//!   it), or `plyfs op PATH pin|unpin`: `pin` fetches and keeps, `never` always goes to the slow
//!   branch.
//!
//! A caller confined by `plyfs serve` (checked by the slow branch, not the kernel) is always
//! served by the slow branch.

mod fill;
mod store;

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::{Condvar, Mutex, RwLock};
use plyfs_stack::glob::parse_size;
use plyfs_stack::spec::{BranchMode, ParamSpec};
use plyfs_stack::{
    from_unix_time, unix_time, Attr, Branch, Build, Caller, DataPath, Error, ExtOpInfo, FanOutArgs, FileHandle, FileKind, Invalidator, Layer,
    LayerFactory, Level, NodeId, Op, Opened, Reply, Result, SetAttr, TimeSet,
};
use serde_json::{json, Value};

use crate::paths::PathTable;
use fill::Fill;
use store::{now_secs, Copy, Pin, Stamp, Store};

pub use store::DIR_NAME;

/// The extended attribute that pins a file or directory.
pub const PIN_XATTR: &str = "user.plyfs.cache";

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo { name: "cache-status", args: "", help: "size of the cache, hit rate, files and bytes waiting to be written back" },
    ExtOpInfo { name: "cache-flush", args: "", help: "write back every change the slow branch does not have yet" },
    ExtOpInfo { name: "cache-evict", args: "", help: "drop the copies of PATH (a file, or everything under a directory), written back first" },
    ExtOpInfo { name: "cache-warm", args: "", help: "fetch PATH (a file, or everything under a directory) into the cache" },
    ExtOpInfo { name: "pin", args: "", help: "keep PATH (and what is under it) in the cache: fetched now, never evicted" },
    ExtOpInfo { name: "unpin", args: "", help: "let PATH be evicted again" },
];

const PARAMS: &[ParamSpec] = &[
    ParamSpec { name: "mode", help: "write-through (the slow branch is always complete) or write-back", default: Some("write-through") },
    ParamSpec { name: "max_size", help: "copies above this size are evicted, least recently used first (0: no limit)", default: Some("0") },
    ParamSpec { name: "min_free", help: "free space kept on the fast branch's file system (SIZE or N%)", default: Some("5%") },
    ParamSpec { name: "max_age", help: "copies unused for this long are evicted (e.g. 7d, 12h; 0: never)", default: Some("0") },
    ParamSpec { name: "delay", help: "write-back: how long after the last writer closes a file it is written back", default: Some("5s") },
    ParamSpec { name: "range", help: "files are fetched in ranges of this size", default: Some("1M") },
    ParamSpec { name: "ahead", help: "ranges fetched ahead of a reader, in parallel", default: Some("4") },
    ParamSpec { name: "pin", help: "paths (globs from the mount's root, separated by ;) kept once fetched, as user.plyfs.cache=pin", default: None },
    ParamSpec { name: "never", help: "paths (globs, separated by ;) never cached, as user.plyfs.cache=never", default: None },
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    WriteThrough,
    WriteBack,
}

#[derive(Clone, Copy, Debug)]
enum Free {
    Bytes(u64),
    Percent(u64),
}

struct Settings {
    mode: Mode,
    max_size: u64,
    min_free: Free,
    max_age: Option<Duration>,
    delay: Duration,
    range: u64,
    ahead: usize,
    pin: Vec<plyfs_stack::glob::Glob>,
    never: Vec<plyfs_stack::glob::Glob>,
}

/// `30s`, `5m`, `12h`, `7d`, `250ms`; `0` is none.
fn parse_duration(text: &str) -> Option<Duration> {
    let t = text.trim();
    if t == "0" {
        return Some(Duration::ZERO);
    }
    let split = t.find(|c: char| c.is_ascii_alphabetic())?;
    let value: f64 = t[..split].parse().ok()?;
    let unit = match &t[split..] {
        "ms" => 1e-3,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        _ => return None,
    };
    let secs = value * unit;
    (secs.is_finite() && (0.0..=1e9).contains(&secs)).then(|| Duration::from_secs_f64(secs))
}

impl Settings {
    fn from(p: &plyfs_stack::spec::Params) -> Result<Settings> {
        let mode = match p.get("mode").unwrap_or("write-through") {
            "write-through" => Mode::WriteThrough,
            "write-back" => Mode::WriteBack,
            other => return Err(p.bad("mode", other, "expected write-through or write-back")),
        };
        let size = |key: &str, default: &str| -> Result<u64> {
            let v = p.get(key).unwrap_or(default);
            parse_size(v).ok_or_else(|| p.bad(key, v, "expected a size such as 10G"))
        };
        let min_free = match p.get("min_free").unwrap_or("5%") {
            v if v.ends_with('%') => match v[..v.len() - 1].trim().parse::<u64>() {
                Ok(n) if n <= 90 => Free::Percent(n),
                _ => return Err(p.bad("min_free", v, "expected a size or a percentage from 0% to 90%")),
            },
            v => Free::Bytes(parse_size(v).ok_or_else(|| p.bad("min_free", v, "expected a size or a percentage"))?),
        };
        let duration = |key: &str, default: &str| -> Result<Duration> {
            let v = p.get(key).unwrap_or(default);
            parse_duration(v).ok_or_else(|| p.bad(key, v, "expected a duration such as 30s, 5m, 12h or 7d"))
        };
        let max_age = duration("max_age", "0")?;
        let range = size("range", "1M")?;
        if !(4096..=(64 << 20)).contains(&range) || range % 4096 != 0 {
            return Err(p.bad("range", p.get("range").unwrap_or_default(), "expected a multiple of 4k from 4k to 64M"));
        }
        let globs = |key: &str| -> Result<Vec<plyfs_stack::glob::Glob>> {
            p.get(key)
                .unwrap_or_default()
                .split(';')
                .map(str::trim)
                .filter(|g| !g.is_empty())
                .map(|g| plyfs_stack::glob::Glob::new(g.trim_start_matches('/')).map_err(|e| p.bad(key, g, &e)))
                .collect()
        };
        Ok(Settings {
            pin: globs("pin")?,
            never: globs("never")?,
            mode,
            max_size: size("max_size", "0")?,
            min_free,
            max_age: (!max_age.is_zero()).then_some(max_age),
            delay: duration("delay", "5s")?,
            range,
            ahead: p.int_in("ahead", 4, 0..=64)? as usize,
        })
    }
}

/// How the kernel reaches an open file's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// Through the daemon.
    Daemon,
    /// Passthrough to a copy, of this generation.
    Fast(u64),
    /// Passthrough to the slow branch's own file.
    Slow,
}

/// The opens of one file in this mount, by how they are served. The kernel gives an inode
/// one backing file while any passthrough open of it lives, refuses an open without
/// passthrough then, and refuses passthrough while an open through the daemon lives: so every
/// open of a file is served the way its first live open is.
#[derive(Default)]
struct Opens {
    fast: u32,
    /// The copy the passthrough opens read (what a new open of the file must be given too).
    fast_copy: Option<(u64, Arc<File>)>,
    /// The copy opens through the daemon use, if any: once the file is removed from the slow
    /// branch, it is the file for them and for new opens (see [`Cache::open_gone_copy`]).
    daemon_copy: Option<(u64, Arc<File>)>,
    /// The slow file's stamp that copy was last fetched again for in place, if it was.
    fast_stamp: Option<Stamp>,
    slow: u32,
    daemon: u32,
    /// Opens for writing.
    writers: u32,
}

impl Opens {
    fn any(&self) -> bool {
        self.fast + self.slow + self.daemon > 0
    }
}

enum Kind {
    /// The slow branch's handle; a write-through writer's writes reach the copy too.
    Slow { fh: FileHandle, fill: Option<Arc<Fill>> },
    /// A copy being filled (or whole), read through the daemon.
    Filling(Arc<Fill>),
    /// A whole copy (write-back writers, and readers of whole copies).
    Copy { file: Arc<File> },
}

struct CFile {
    kind: Kind,
    writes: bool,
    side: Side,
    /// Write-through by way of the copy (the file was open by passthrough when this writer
    /// came): written back at every close, `fsync` and release.
    through: bool,
}

/// The files whose opens, releases or write-back decisions are under way, one lock per file:
/// an open may fetch a whole file again (see [`Cache::refresh_in_place`]), and the opens and
/// closes of other files must not wait for it, as they did behind 64 shared locks.
#[derive(Default)]
struct OpenLocks {
    busy: Mutex<HashSet<u64>>,
    freed: Condvar,
}

/// One file's open lock (see [`Cache::open_lock`]).
struct OpenLock<'a> {
    locks: &'a OpenLocks,
    key: u64,
}

impl<'a> OpenLock<'a> {
    fn lock(self) -> OpenGuard<'a> {
        let mut busy = self.locks.busy.lock();
        while busy.contains(&self.key) {
            self.locks.freed.wait(&mut busy);
        }
        busy.insert(self.key);
        OpenGuard { locks: self.locks, key: self.key }
    }

    fn try_lock(self) -> Option<OpenGuard<'a>> {
        // The guard is made only when the key was free, and after `busy` is unlocked: one made
        // for a busy key would unlock it for its holder when dropped (and dropping it while
        // `busy` is held would wait for itself).
        let free = self.locks.busy.lock().insert(self.key);
        free.then(|| OpenGuard { locks: self.locks, key: self.key })
    }
}

struct OpenGuard<'a> {
    locks: &'a OpenLocks,
    key: u64,
}

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.locks.busy.lock().remove(&self.key);
        self.locks.freed.notify_all();
    }
}

/// Handles this layer gives out start here, far from the slow branch's directory handles,
/// which pass through unchanged.
const FIRST_FH: u64 = 1 << 62;
/// Write-through writes and the start of a fill on one file exclude each other by one of these.
const GATES: usize = 64;

#[derive(Default)]
struct Stats {
    hits: AtomicU64,
    misses: AtomicU64,
    fetched: Arc<AtomicU64>,
    written_back: AtomicU64,
}

/// A change to a copy not written back: how many, and when the last one was.
struct Change {
    seq: u64,
    at: Instant,
}

/// The copies with changes not written back, and a time before which none of them is due: the
/// keeper looks through them only then. It used to look at every wake-up, and an untar makes
/// thousands of them while it wakes the keeper at each close: a tenth of the daemon's time.
///
/// With them, the names under which those copies were written or renamed (more, not fewer): a
/// removal of any other name cannot lose such a copy its file, nor the name its write-back
/// finds it by, and costs no lookup on the slow branch.
///
/// And where this mount last saw each of those files (its directory's node and its name): a
/// removal of that entry needs no lookup to know what it removes.
#[derive(Default)]
struct Changes {
    of: HashMap<u64, Change>,
    first_due: Option<Instant>,
    names_of: HashMap<u64, Vec<OsString>>,
    names: HashMap<OsString, u32>,
    bound_of: HashMap<u64, Vec<(NodeId, OsString)>>,
    bound: HashMap<(NodeId, OsString), u64>,
    /// Copies that lost a name and still hold changes (a writer had them open, or writing back
    /// failed): the name their write-back knows them by may be gone, so a removal of any name
    /// may take their last one, and is looked up while there are any.
    loose: HashSet<u64>,
}

impl Changes {
    fn name(&mut self, key: u64, name: OsString) {
        let mine = self.names_of.entry(key).or_default();
        if !mine.contains(&name) {
            mine.push(name.clone());
            *self.names.entry(name).or_default() += 1;
        }
    }

    /// `key`'s file is entry `name` of directory `parent`, and no longer `was`.
    fn bind(&mut self, key: u64, parent: NodeId, name: OsString, was: Option<(NodeId, OsString)>) {
        if let Some(old) = was {
            if self.bound.get(&old) == Some(&key) {
                self.bound.remove(&old);
            }
        }
        self.name(key, name.clone());
        let mine = self.bound_of.entry(key).or_default();
        let entry = (parent, name);
        if !mine.contains(&entry) {
            mine.push(entry.clone());
        }
        self.bound.insert(entry, key);
    }

    /// Entry `name` of `parent` was removed or now names another file.
    fn unbind(&mut self, parent: NodeId, name: &OsStr) {
        self.bound.remove(&(parent, name.to_owned()));
    }

    /// `key`'s copy holds no changes any more (written back, or given up).
    fn remove(&mut self, key: u64) {
        self.of.remove(&key);
        self.loose.remove(&key);
        for name in self.names_of.remove(&key).unwrap_or_default() {
            if let Some(n) = self.names.get_mut(&name) {
                *n -= 1;
                if *n == 0 {
                    self.names.remove(&name);
                }
            }
        }
        for entry in self.bound_of.remove(&key).unwrap_or_default() {
            if self.bound.get(&entry) == Some(&key) {
                self.bound.remove(&entry);
            }
        }
    }
}

/// What a removal or a rename over a name removes, when that may be a file with unwritten
/// changes.
#[derive(Clone, Copy)]
enum Victim {
    /// A file with unwritten changes that this mount last saw under that name: its node is
    /// kept (forgets held back) until it is looked at, after the removal, in the background.
    Seen(NodeId),
    /// Looked up on the slow branch before the removal (one lookup to give back).
    Looked(NodeId),
}

/// Files a removal took a name from, being looked at in the background: how many such looks
/// are under way, and the forgets the kernel sent meanwhile (passed on after them).
#[derive(Default)]
struct Held {
    looks: u32,
    forgets: u64,
}

type Job = Box<dyn FnOnce() + Send>;

/// The largest file a write-back writer's open fetches whole when no whole copy is here.
const FETCH_TO_WRITE_MAX: u64 = 64 << 20;

/// How soon a write-back that failed (or that a writer kept from being made) is tried again,
/// at most.
const RETRY_AFTER: Duration = Duration::from_secs(2);

/// The keeper's shortest sleep between rounds (its longest is half a second).
const KEEPER_TICK_MIN: Duration = Duration::from_millis(100);

pub struct Cache {
    name: String,
    fast: Branch,
    slow: Branch,
    cfg: Settings,
    store: Store,
    paths: PathTable,
    files: Mutex<HashMap<u64, Arc<CFile>>>,
    next_fh: AtomicU64,
    opens: Mutex<HashMap<u64, Opens>>,
    fills: Mutex<HashMap<u64, Weak<Fill>>>,
    gates: Vec<RwLock<()>>,
    open_locks: OpenLocks,
    /// Copies are given to the kernel for passthrough (not with `-o shared`, where a copy can
    /// go stale under an open that the kernel would serve every later open from). In
    /// write-through, a writer that comes while no copy is open by passthrough writes through
    /// the daemon, and the kernel then refuses passthrough to the file's next opens: readers
    /// share the kernel's page cache with it until it closes.
    copy_passthrough: bool,
    changes: Mutex<Changes>,
    /// The slow branch's latest attributes of files whose copies hold unwritten changes (what
    /// a change of their times or size alone answers with, without asking it).
    slow_attrs: Mutex<HashMap<u64, Attr>>,
    /// Extended attributes the slow branch said such files do not have (the kernel asks for
    /// `security.capability` at every write and change of owner): forgotten at any change of
    /// their attributes through this mount, and once written back.
    absent_xattrs: Mutex<HashMap<u64, HashSet<OsString>>>,
    flushing: Mutex<HashSet<u64>>,
    flushed: Condvar,
    /// See [`Held`].
    held: Mutex<HashMap<u64, Held>>,
    /// The layer itself, for work done in the background.
    me: std::sync::OnceLock<Weak<Cache>>,
    jobs: Mutex<Option<Sender<Job>>>,
    stop: AtomicBool,
    /// A fetch finished: the cache may be over its limits.
    evict_soon: AtomicBool,
    /// The front end's, to drop the kernel's pages of a file whose copy went stale.
    invalidator: Mutex<Option<Arc<dyn Invalidator>>>,
    wake: (Mutex<bool>, Condvar),
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    stats: Stats,
    /// Keys whose write-back failed, so the failure is said once.
    failing: Mutex<HashSet<u64>>,
}

fn daemon() -> Caller {
    Caller::daemon()
}

/// The last name of a path the index keeps.
fn leaf_of(path: &str) -> OsString {
    store::decode_name(path.rsplit('/').next().unwrap_or_default())
}

fn is_dirty(copy: Option<&Copy>) -> bool {
    copy.is_some_and(|c| c.dirty)
}

impl Cache {
    fn new(args: FanOutArgs) -> Result<Cache> {
        let cfg = Settings::from(&args.params)?;
        let copy_passthrough = plyfs_stack::shared::mode().is_none();
        let [fast, slow]: [Branch; 2] = args.branches.try_into().map_err(|b: Vec<Branch>| {
            Error::config(format!(
                "cache '{}': {} branches; a cache has two, the fast one first (e.g. --stack cache --branch SLOW_DIR, with the lower as the fast one)",
                args.name,
                b.len()
            ))
        })?;
        if fast.mode == BranchMode::ReadOnly {
            return Err(Error::config(format!("cache '{}': the fast branch '{}' holds the copies and cannot be read-only", args.name, fast.name)));
        }
        let Some(fast_dir) = fast.lower.dir().map(Path::to_owned) else {
            return Err(Error::config(format!(
                "cache '{}': the fast branch '{}' stands on a server ({}); its copies need a directory of this machine",
                args.name, fast.name, fast.lower
            )));
        };
        if fast.stack.levels().iter().any(|l| !matches!(l.layer().kind(), "lower" | "policy")) {
            return Err(Error::config(format!(
                "cache '{}': the fast branch '{}' holds plain copies; put layers above the cache, or on the slow branch",
                args.name, fast.name
            )));
        }
        let read_only = plyfs_stack::readonly::read_only() || slow.mode == BranchMode::ReadOnly;
        if read_only && cfg.mode == Mode::WriteBack {
            return Err(Error::config(format!("cache '{}': mode=write-back over a read-only slow branch writes nothing back", args.name)));
        }
        let store = Store::open(&args.name, &fast_dir, read_only)?;
        let dirty = store.index.lock().copies.values().filter(|c| c.dirty).count();
        if dirty > 0 {
            tracing::info!("cache '{}': {dirty} file(s) from before the restart are not on the slow branch yet; writing them back", args.name);
        }
        let now = Instant::now();
        let at = now.checked_sub(cfg.delay).unwrap_or(now);
        let of: HashMap<u64, Change> = store.index.lock().copies.iter().filter(|(_, c)| c.dirty).map(|(k, _)| (*k, Change { seq: 1, at })).collect();
        let mut changes = Changes { first_due: (!of.is_empty()).then_some(now), of, ..Changes::default() };
        for (key, c) in store.index.lock().copies.iter().filter(|(_, c)| c.dirty) {
            changes.name(*key, leaf_of(&c.path));
        }
        Ok(Cache {
            name: args.name,
            fast,
            slow,
            cfg,
            store,
            paths: PathTable::new(),
            files: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(FIRST_FH),
            opens: Mutex::new(HashMap::new()),
            fills: Mutex::new(HashMap::new()),
            gates: (0..GATES).map(|_| RwLock::new(())).collect(),
            open_locks: OpenLocks::default(),
            copy_passthrough,
            changes: Mutex::new(changes),
            slow_attrs: Mutex::new(HashMap::new()),
            absent_xattrs: Mutex::new(HashMap::new()),
            flushing: Mutex::new(HashSet::new()),
            flushed: Condvar::new(),
            held: Mutex::new(HashMap::new()),
            me: std::sync::OnceLock::new(),
            jobs: Mutex::new(None),
            stop: AtomicBool::new(false),
            evict_soon: AtomicBool::new(false),
            invalidator: Mutex::new(None),
            wake: (Mutex::new(false), Condvar::new()),
            threads: Mutex::new(Vec::new()),
            stats: Stats::default(),
            failing: Mutex::new(HashSet::new()),
        })
    }

    fn start(self: &Arc<Self>) {
        let _ = self.me.set(Arc::downgrade(self));
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(std::sync::Mutex::new(rx));
        *self.jobs.lock() = Some(tx);
        let mut threads = self.threads.lock();
        for i in 0..self.cfg.ahead.max(1) {
            let rx: Arc<std::sync::Mutex<Receiver<Job>>> = rx.clone();
            let t = std::thread::Builder::new().name(format!("cache-fetch-{i}")).spawn(move || loop {
                let job = match rx.lock() {
                    Ok(r) => r.recv(),
                    Err(_) => return,
                };
                match job {
                    Ok(job) => job(),
                    Err(_) => return,
                }
            });
            if let Ok(t) = t {
                threads.push(t);
            }
        }
        let me = Arc::downgrade(self);
        if let Ok(t) = std::thread::Builder::new().name("cache-keeper".into()).spawn(move || keeper(me)) {
            threads.push(t);
        }
    }

    /// The path of `node` as the index and the log keep it: names that are not UTF-8 escaped
    /// ([`store::encode_name`]), so a write-back finds them again.
    fn path_of(&self, node: NodeId) -> Option<String> {
        self.paths.path_with(node, store::encode_name)
    }

    fn child_path(&self, parent: NodeId, name: &OsStr) -> Option<String> {
        self.paths.child_path_with(parent, name, store::encode_name)
    }

    fn slow(&self) -> &Level {
        self.slow.top()
    }

    fn gate(&self, key: u64) -> &RwLock<()> {
        &self.gates[(key as usize) % GATES]
    }

    fn wake_keeper(&self) {
        *self.wake.0.lock() = true;
        self.wake.1.notify_all();
    }

    /// Whether `key`'s copy holds unwritten changes (without copying its entry).
    fn dirty(&self, key: u64) -> bool {
        is_dirty(self.store.index.lock().copies.get(&key))
    }

    fn copy_of(&self, key: u64) -> Option<Copy> {
        self.store.index.lock().copies.get(&key).cloned()
    }

    fn live_fill(&self, key: u64) -> Option<Arc<Fill>> {
        self.fills.lock().get(&key).and_then(Weak::upgrade).filter(|f| !f.detached.load(Ordering::Acquire))
    }

    fn writers(&self, key: u64) -> u32 {
        self.opens.lock().get(&key).map_or(0, |o| o.writers)
    }

    fn pin_of_node(&self, node: NodeId) -> Option<Pin> {
        let path = self.path_of(node)?;
        let pin = self.store.index.lock().pin_of(&path);
        pin.or_else(|| self.pin_by_rule(&path))
    }

    /// What the `pin=` and `never=` globs say about `path`.
    fn pin_by_rule(&self, path: &str) -> Option<Pin> {
        if self.cfg.never.iter().any(|g| g.matches(path)) {
            Some(Pin::Never)
        } else if self.cfg.pin.iter().any(|g| g.matches(path)) {
            Some(Pin::Pin)
        } else {
            None
        }
    }

    /// Whether opens by `cx` of `node` go through the cache at all.
    fn caches_for(&self, cx: &Caller, node: NodeId) -> bool {
        cx.confined.is_none() && self.pin_of_node(node) != Some(Pin::Never)
    }

    /// The copy of `key` that may be served for a slow file with attributes `attr`: whole, and
    /// either holding unwritten changes or as fresh as the slow file.
    fn fresh_copy(&self, key: u64, attr: &Attr) -> Option<Copy> {
        let writers = self.writers(key) > 0;
        let idx = self.store.index.lock();
        let c = idx.copies.get(&key)?;
        (c.complete && (c.dirty || writers || c.stamp == Stamp::of(attr))).then(|| c.clone())
    }

    /// Give up `key`'s copy (unless it holds unwritten changes): the slow file changed, or the
    /// copy is evicted; readers through the daemon then read the slow file. With `gone`, the
    /// file was removed from the slow branch: the copy goes with its unwritten changes, and the
    /// file's opens go on reading and writing it, as the file it is for them.
    fn drop_copy(&self, key: u64, gone: bool) -> bool {
        // Locks are never nested here: the fills lock is let go before the index is taken.
        let fill = self.fills.lock().get(&key).and_then(Weak::upgrade);
        if let Some(fill) = fill {
            if !gone && !is_dirty(self.store.index.lock().copies.get(&key)) {
                fill.detach();
            }
        }
        let removed = {
            let mut idx = self.store.index.lock();
            match idx.copies.get(&key) {
                Some(c) if !c.dirty || gone => {
                    let c = idx.copies.remove(&key).expect("present");
                    idx.changed = true;
                    Some(c)
                }
                _ => None,
            }
        };
        match removed {
            Some(c) => {
                if c.dirty {
                    let _ = self.store.log(key, None);
                    self.changes.lock().remove(key);
                    self.slow_attrs.lock().remove(&key);
                    self.absent_xattrs.lock().remove(&key);
                }
                self.store.remove_copy(key, c.gen);
                true
            }
            None => false,
        }
    }

    /// A fill of `key`'s copy for a slow file with attributes `attr`: the one under way, or a
    /// new one.
    fn fill_for(&self, key: u64, attr: &Attr) -> Result<Arc<Fill>> {
        if !Fill::fits(attr.size, self.cfg.range) {
            return Err(Error::Os(libc::EFBIG));
        }
        let stamp = Stamp::of(attr);
        let _gate = self.gate(key).write();
        if let Some(f) = self.live_fill(key) {
            let current = self.copy_of(key).is_some_and(|c| c.gen == f.gen);
            if current && (self.writers(key) > 0 || *f.start.lock() == stamp || self.dirty(key)) {
                return Ok(f);
            }
            f.detach();
        }
        let (gen, complete) = match self.copy_of(key) {
            Some(c) if c.complete && (c.dirty || c.stamp == stamp) => (c.gen, true),
            Some(c) if c.dirty => return Err(Error::Os(libc::EIO)),
            _ => {
                self.drop_copy(key, false);
                let mut idx = self.store.index.lock();
                let gen = idx.new_gen();
                let path = self.path_of(NodeId(key)).unwrap_or_default();
                idx.copies.insert(key, Copy { gen, path, stamp, complete: false, dirty: false, used: now_secs(), bytes: 0, shown_ctime: None });
                idx.changed = true;
                (gen, false)
            }
        };
        let file = if complete { self.store.open_copy(key, gen, true)? } else { self.store.create_copy(key, gen)? };
        let size = if complete { file.metadata()?.len() } else { attr.size };
        let fill = Arc::new(Fill::new(key, gen, file, size, self.cfg.range, self.slow().clone(), stamp, complete, self.stats.fetched.clone()));
        self.fills.lock().insert(key, Arc::downgrade(&fill));
        Ok(fill)
    }

    /// A fill that has every range: record its copy as whole, if the slow file did not change
    /// while it filled (or changed only by this mount's writes, which reached the copy too).
    fn record_complete(&self, fill: &Fill) {
        if !fill.is_complete() || fill.detached.load(Ordering::Acquire) || fill.recorded.swap(true, Ordering::AcqRel) {
            return;
        }
        let attr = self.slow().getattr(&daemon(), NodeId(fill.key));
        let ok = match &attr {
            Ok(a) => self.writers(fill.key) > 0 || Stamp::of(a) == *fill.start.lock(),
            Err(_) => false,
        };
        if !ok {
            tracing::debug!("cache '{}': node {} changed on the slow branch while it was fetched; fetched again when next read", self.name, fill.key);
            fill.detach();
            self.drop_copy(fill.key, false);
            return;
        }
        let bytes = fill.file.metadata().map(|m| m.blocks() * 512).unwrap_or(0);
        {
            let mut idx = self.store.index.lock();
            if let Some(c) = idx.copies.get_mut(&fill.key).filter(|c| c.gen == fill.gen) {
                c.complete = true;
                c.bytes = bytes;
                if !c.dirty {
                    c.stamp = Stamp::of(attr.as_ref().expect("checked"));
                }
                if c.path.is_empty() {
                    c.path = self.path_of(NodeId(fill.key)).unwrap_or_default();
                }
                idx.changed = true;
            }
        }
        // The pages the filling reads left in the kernel serve no one now (later opens read the
        // copy by passthrough), and measured to slow those reads down: dropped.
        self.invalidate_later(NodeId(fill.key));
        self.evict_soon.store(true, Ordering::Release);
        self.wake_keeper();
    }

    /// Hand the ranges after `last` to the fetchers.
    fn read_ahead(&self, fill: &Arc<Fill>, last: usize) {
        if self.cfg.ahead == 0 {
            return;
        }
        let claimed = fill.claim_ahead(last, self.cfg.ahead);
        for r in claimed {
            let f = fill.clone();
            self.in_background(Box::new(move || f.fetch_claimed(r)));
        }
    }

    /// Have the kernel drop what it caches of `node`, from a fetcher thread (never from a
    /// thread serving a request).
    fn invalidate_later(&self, node: NodeId) {
        let Some(inv) = self.invalidator.lock().clone() else { return };
        let job: Job = Box::new(move || inv.node(node));
        if let Some(tx) = self.jobs.lock().as_ref() {
            let _ = tx.send(job);
        }
    }

    /// Release a slow branch's handle on a fetcher thread.
    fn release_later(&self, node: NodeId, fh: FileHandle) {
        let slow = self.slow().clone();
        self.in_background(Box::new(move || {
            let _ = slow.release(&daemon(), node, fh);
        }));
    }

    /// Run `job` on a fetcher thread, or here once they are gone (at unmount).
    fn in_background(&self, job: Job) {
        let tx = self.jobs.lock().clone();
        match tx {
            Some(tx) => {
                if let Err(e) = tx.send(job) {
                    (e.0)();
                }
            }
            None => job(),
        }
    }

    fn new_fh(&self, file: CFile) -> FileHandle {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.files.lock().insert(fh, Arc::new(file));
        FileHandle(fh)
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<CFile>> {
        self.files.lock().get(&fh.0).cloned().ok_or(Error::Os(libc::EBADF))
    }

    /// How the live opens of `key` are served: by passthrough to a copy (which), to the slow
    /// file, or through the daemon; `None` when it has none.
    fn served(&self, key: u64) -> Option<Side> {
        let opens = self.opens.lock();
        let o = opens.get(&key)?;
        if o.fast > 0 {
            o.fast_copy.as_ref().map(|(gen, _)| Side::Fast(*gen))
        } else if o.slow > 0 {
            Some(Side::Slow)
        } else if o.daemon > 0 {
            Some(Side::Daemon)
        } else {
            None
        }
    }

    /// Count an open of `key` served from `side`.
    fn count_open(&self, key: u64, side: Side, writes: bool, copy: Option<(u64, &Arc<File>)>) {
        let mut opens = self.opens.lock();
        let o = opens.entry(key).or_default();
        match side {
            Side::Fast(gen) => {
                o.fast += 1;
                if let Some((_, f)) = copy {
                    if o.fast_copy.is_none() {
                        o.fast_copy = Some((gen, f.clone()));
                    }
                }
            }
            Side::Slow => o.slow += 1,
            Side::Daemon => {
                o.daemon += 1;
                // The latest: a copy given up as stale is followed by the slow file's new one.
                if let Some((gen, f)) = copy {
                    o.daemon_copy = Some((gen, f.clone()));
                }
            }
        }
        if writes {
            o.writers += 1;
        }
    }

    fn uncount_open(&self, key: u64, side: Side, writes: bool) {
        let mut opens = self.opens.lock();
        if let Some(o) = opens.get_mut(&key) {
            match side {
                Side::Fast(_) => {
                    o.fast = o.fast.saturating_sub(1);
                    if o.fast == 0 {
                        o.fast_copy = None;
                        o.fast_stamp = None;
                    }
                }
                Side::Slow => o.slow = o.slow.saturating_sub(1),
                Side::Daemon => {
                    o.daemon = o.daemon.saturating_sub(1);
                    if o.daemon == 0 {
                        o.daemon_copy = None;
                    }
                }
            }
            if writes {
                o.writers = o.writers.saturating_sub(1);
            }
            if !o.any() {
                opens.remove(&key);
            }
        }
    }

    fn touch(&self, key: u64) {
        let mut idx = self.store.index.lock();
        if let Some(c) = idx.copies.get_mut(&key) {
            c.used = now_secs();
            idx.changed = true;
        }
    }

    /// The lock that one file's opens and releases take in turn, so that each is served the
    /// way the kernel allows next to the others.
    fn open_lock(&self, key: u64) -> OpenLock<'_> {
        OpenLock { locks: &self.open_locks, key }
    }

    /// A whole copy, served by passthrough (unless this open must go through the daemon).
    fn serve_copy(&self, node: NodeId, gen: u64, file: File, writes: bool, through: bool) -> Result<Reply> {
        let file = Arc::new(file);
        let side = match self.served(node.0) {
            Some(Side::Daemon) => Side::Daemon,
            _ if !self.copy_passthrough => Side::Daemon,
            _ => Side::Fast(gen),
        };
        self.count_open(node.0, side, writes, Some((gen, &file)));
        let backing = match side {
            Side::Fast(_) => Some(Arc::new(OwnedFd::from(file.try_clone()?))),
            _ => None,
        };
        // A reader through the daemon reads by a fill of the whole copy: if the copy is given up
        // while it is open (a writer found it stale), the fill sends it to the slow branch,
        // where a descriptor of the copy would go on reading a removed file.
        let kind = match (side, writes) {
            (Side::Daemon, false) => Kind::Filling(self.fill_of_copy(node.0, gen, &file)?),
            _ => Kind::Copy { file },
        };
        let fh = self.new_fh(CFile { kind, writes, side, through });
        let flush_on_close = through || (writes && side == Side::Daemon);
        Ok(Reply::Opened(Opened { fh, backing, direct_io: false, flush_on_close }))
    }

    /// The live fill of whole copy `gen` of `key`, or a new one over `file`.
    fn fill_of_copy(&self, key: u64, gen: u64, file: &File) -> Result<Arc<Fill>> {
        let _gate = self.gate(key).write();
        if let Some(f) = self.live_fill(key).filter(|f| f.gen == gen) {
            return Ok(f);
        }
        let stamp = self.copy_of(key).map(|c| c.stamp).unwrap_or_default();
        let size = file.metadata()?.len();
        // Its own descriptor, for writing: a write-through writer's writes and truncates reach
        // the copy through the fill (the reader's descriptor is read-only). Reopened by that
        // descriptor, since the copy may have no name left (its file was removed).
        let own = File::options().read(true).write(true).open(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
        let fill = Arc::new(Fill::new(key, gen, own, size, self.cfg.range, self.slow().clone(), stamp, true, self.stats.fetched.clone()));
        self.fills.lock().insert(key, Arc::downgrade(&fill));
        Ok(fill)
    }

    /// An open of the slow branch's file itself.
    fn open_slow(&self, cx: &Caller, node: NodeId, flags: i32, cached: bool) -> Result<Reply> {
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let opened = self.slow().open(cx, node, flags)?;
        self.wrap_slow(node, opened, writes, cached, flags & libc::O_TRUNC != 0)
    }

    fn wrap_slow(&self, node: NodeId, opened: Opened, writes: bool, cached: bool, truncated: bool) -> Result<Reply> {
        let key = node.0;
        let served = self.served(key);
        let mut fill = None;
        if writes && cached && served != Some(Side::Slow) {
            // Writes reach the copy too, through a fill of it.
            if let Some(c) = self.copy_of(key).filter(|c| c.complete && !c.dirty) {
                let attr = self.slow().getattr(&daemon(), node)?;
                if truncated || c.stamp.same_bytes(&Stamp::of(&attr)) {
                    fill = self.fill_for(key, &attr).ok();
                } else {
                    self.drop_copy(key, false);
                }
            } else {
                fill = self.live_fill(key);
            }
            if truncated {
                if let Some(f) = &fill {
                    let _held = f.hold(0, f.size().max(1));
                    f.set_size(0)?;
                }
            }
        }
        let has_copy = fill.is_some() || self.live_fill(key).is_some();
        let side = match served {
            Some(Side::Slow) => Side::Slow,
            Some(_) => Side::Daemon,
            None if opened.backing.is_some() && !has_copy => Side::Slow,
            None => Side::Daemon,
        };
        if side == Side::Slow && opened.backing.is_none() {
            let _ = self.slow().release(&daemon(), node, opened.fh);
            return Err(Error::Os(libc::EIO));
        }
        self.count_open(key, side, writes, None);
        let backing = if side == Side::Slow { opened.backing.clone() } else { None };
        let fh = self.new_fh(CFile { kind: Kind::Slow { fh: opened.fh, fill }, writes, side, through: false });
        // A writer through the daemon may leave pages written by mmap in the kernel; without a
        // flush at close they are written back later, and a passthrough open of the copy made
        // after the close would not see them.
        let flush_on_close = opened.flush_on_close || (writes && side == Side::Daemon);
        Ok(Reply::Opened(Opened { fh, backing, direct_io: opened.direct_io, flush_on_close }))
    }

    fn open(&self, cx: &Caller, node: NodeId, flags: i32) -> Result<Reply> {
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        // The slow file's attributes are taken under the open lock: a write-back deciding that
        // the copy is clean (under the same lock) then cannot come between them and the choice
        // they make (an old size would fill a new copy short).
        let _open = self.open_lock(node.0).lock();
        let attr = self.slow().call(cx, &Op::GetAttr { node, fh: None }).and_then(|r| match r {
            Reply::Attr(a) => Ok(a),
            _ => Err(Error::Os(libc::EIO)),
        })?;
        if attr.kind != FileKind::File {
            return self.open_slow(cx, node, flags, false);
        }
        // Every open of a file is served the way its live opens are, whatever pins say.
        match self.served(node.0) {
            // The kernel gives this open the slow file too.
            Some(Side::Slow) => return self.open_slow(cx, node, flags, false),
            // ... or the copy the other opens read.
            Some(Side::Fast(gen)) => return self.open_next_to_copy(cx, node, flags, &attr, gen),
            // ... or, once the file is gone from the slow branch, the copy opens through the
            // daemon use.
            Some(Side::Daemon) => {
                if let Some(reply) = self.open_gone_copy(node, flags, &attr)? {
                    return Ok(reply);
                }
            }
            None => {}
        }
        if !self.caches_for(cx, node) {
            return self.open_slow(cx, node, flags, false);
        }
        match (self.cfg.mode, writes) {
            (_, false) => self.open_read(cx, node, flags, &attr),
            // A copy with unwritten changes (its write-back at a close failed, or it is from
            // before a restart) is the file: written in, and written back at close. Written
            // around, its later write-back would undo these writes.
            (Mode::WriteThrough, true) if self.dirty(node.0) => self.open_dirty(cx, node, flags, &attr, true),
            (Mode::WriteThrough, true) => self.open_slow(cx, node, flags, true),
            (Mode::WriteBack, true) if self.fetch_to_write(node.0, &attr) => self.open_dirty(cx, node, flags, &attr, false),
            // Written through for this open, as in write-through.
            (Mode::WriteBack, true) => self.open_slow(cx, node, flags, true),
        }
    }

    /// Whether a write-back writer may wait at its open for the whole file to be fetched (it
    /// writes in a whole copy). Not for a large file with no whole copy here: the open would
    /// wait for all of it, holding the file's open lock, and `> file` (an open, then a
    /// truncation of its own) would fetch all the bytes it then throws away. Nor for a file
    /// the cache could not keep under `max_size`.
    ///
    /// A copy with unwritten changes is the file: always written in. Next to a writer writing
    /// through (the only writer of a file in write-back whose copy holds no unwritten changes),
    /// this one writes through too: the other's writes reach a copy only through a fill alive
    /// when it writes, and would miss the copy this open makes, whose write-back then undoes them.
    fn fetch_to_write(&self, key: u64, attr: &Attr) -> bool {
        if self.dirty(key) {
            return true;
        }
        if self.writers(key) > 0 {
            return false;
        }
        let small = attr.size <= FETCH_TO_WRITE_MAX && (self.cfg.max_size == 0 || attr.size <= self.cfg.max_size);
        small || self.fresh_copy(key, attr).is_some()
    }

    /// An open of a file that other opens read by passthrough from copy `gen`: the kernel
    /// serves it from the same copy. A writer writes in the copy, written back at once
    /// (write-through) or later (write-back).
    fn open_next_to_copy(&self, cx: &Caller, node: NodeId, flags: i32, attr: &Attr, gen: u64) -> Result<Reply> {
        let key = node.0;
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let mut current = self.fresh_copy(key, attr).is_some_and(|c| c.gen == gen);
        let (refreshed, file) = match self.opens.lock().get(&key) {
            Some(o) => (o.fast_stamp == Some(Stamp::of(attr)), o.fast_copy.as_ref().map(|(_, f)| f.clone())),
            None => (false, None),
        };
        if writes {
            if let Some(f) = file.as_ref().filter(|_| !current && self.copy_of(key).is_some_and(|c| c.gen == gen && !c.dirty)) {
                // Fetched again where it is, the copy is the file again, to write in.
                self.refresh_in_place(node, gen, f, attr)?;
                current = self.fresh_copy(key, attr).is_some_and(|c| c.gen == gen);
            }
            if !current {
                // The copy the others read is older than the slow file: written in and then
                // written back, it would undo the change made there.
                tracing::warn!(
                    "cache '{}': '{}' changed on the slow branch while open here; it can be opened for writing once its readers close it",
                    self.name,
                    self.path_of(node).unwrap_or_default()
                );
                return Err(Error::Os(libc::ETXTBSY));
            }
            return self.open_dirty(cx, node, flags, attr, self.cfg.mode == Mode::WriteThrough);
        }
        let Some(file) = file else { return self.open_read(cx, node, flags, attr) };
        // A copy that this mount's writers write in, or whose file is gone from the slow branch
        // (its copy left the index, unwritten changes and all), is the file for the opens that
        // hold it: the slow branch's bytes fetched into it would overwrite their writes.
        let own = attr.nlink == 0 || self.writers(key) > 0;
        if current || refreshed || own {
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            self.touch(key);
        } else {
            self.stats.misses.fetch_add(1, Ordering::Relaxed);
            self.refresh_in_place(node, gen, &file, attr)?;
        }
        self.serve_copy(node, gen, file.try_clone()?, false, false)
    }

    /// A new open of a file removed from the slow branch (`attr`), whose opens through the daemon
    /// use a copy that left the index with it, unwritten changes and all: that copy is the file
    /// for them, and for this open too (the slow file's bytes would be older than their
    /// writes). `None` when that is not the case.
    fn open_gone_copy(&self, node: NodeId, flags: i32, attr: &Attr) -> Result<Option<Reply>> {
        let key = node.0;
        let theirs = self.opens.lock().get(&key).and_then(|o| o.daemon_copy.clone());
        let Some((gen, file)) = theirs else { return Ok(None) };
        if attr.nlink != 0 || self.copy_of(key).is_some_and(|c| c.gen == gen) {
            return Ok(None);
        }
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        // Their descriptor may be read-only, and the copy has no name left.
        let file = File::options().read(true).write(writes).open(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        self.serve_copy(node, gen, file, writes, false).map(Some)
    }

    /// Copy `gen`, which the file's live opens read by passthrough, is older than the slow file
    /// (changed there by another mount or machine). The kernel serves every new open of the file
    /// from that copy, so its bytes are fetched again, in place: the new open reads the slow
    /// file as it is now, and the open readers see the new bytes as they arrive, as readers of
    /// a local file do when another process rewrites it.
    fn refresh_in_place(&self, node: NodeId, gen: u64, file: &File, attr: &Attr) -> Result<()> {
        let key = node.0;
        if !Fill::fits(attr.size, self.cfg.range) {
            return Err(Error::Os(libc::EFBIG));
        }
        // The readers' descriptor is read-only, and the copy may be unlinked already (given up
        // when a change notice came): reopened by its descriptor, it is the same file.
        let rw = File::options().read(true).write(true).open(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
        rw.set_len(attr.size)?;
        let stamp = Stamp::of(attr);
        let fill = Fill::new(key, gen, rw, attr.size, self.cfg.range, self.slow().clone(), stamp, false, self.stats.fetched.clone());
        if let Err(e) = fill.fill_all(&|_| {}) {
            tracing::warn!(
                "cache '{}': '{}' changed on the slow branch while open here, and could not be fetched again ({e})",
                self.name,
                self.path_of(node).unwrap_or_default()
            );
            return Err(Error::Os(libc::EIO));
        }
        // A change made while it was fetched shows in the stamp taken before: the next open
        // fetches again.
        if let Some(o) = self.opens.lock().get_mut(&key) {
            o.fast_stamp = Some(stamp);
        }
        let bytes = fill.file.metadata().map(|m| m.blocks() * 512).unwrap_or(0);
        let mut idx = self.store.index.lock();
        if let Some(c) = idx.copies.get_mut(&key).filter(|c| c.gen == gen && !c.dirty) {
            c.stamp = stamp;
            c.complete = true;
            c.bytes = bytes;
            idx.changed = true;
        }
        Ok(())
    }

    fn open_read(&self, cx: &Caller, node: NodeId, flags: i32, attr: &Attr) -> Result<Reply> {
        let key = node.0;
        // A copy that is no longer the file's: the kernel may hold its pages too (kept across
        // opens, and dropped by the kernel itself only when the mtime or size moved). This open
        // reads past them, and they are dropped for the next ones.
        let stale = self.copy_of(key).is_some_and(|c| c.complete && !c.dirty && c.stamp != Stamp::of(attr)) && self.writers(key) == 0;
        if stale {
            self.drop_copy(key, false);
            self.invalidate_later(node);
        }
        if let Some(c) = self.fresh_copy(key, attr) {
            match self.store.open_copy(key, c.gen, false) {
                Ok(file) => {
                    self.stats.hits.fetch_add(1, Ordering::Relaxed);
                    self.touch(key);
                    return self.serve_copy(node, c.gen, file, false, false);
                }
                Err(e) => {
                    tracing::warn!("cache '{}': the copy of '{}' is gone from the cache directory ({e}); read from the slow branch", self.name, c.path);
                    self.drop_copy(key, false);
                }
            }
        }
        if attr.size == 0 {
            return self.open_slow(cx, node, flags, false);
        }
        self.stats.misses.fetch_add(1, Ordering::Relaxed);
        let fill = match self.fill_for(key, attr) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("cache '{}': node {key}: cannot cache ({e}); read from the slow branch", self.name);
                return self.open_slow(cx, node, flags, false);
            }
        };
        self.count_open(key, Side::Daemon, false, None);
        let fh = self.new_fh(CFile { kind: Kind::Filling(fill), writes: false, side: Side::Daemon, through: false });
        Ok(Reply::Opened(Opened { fh, backing: None, direct_io: stale, flush_on_close: false }))
    }

    /// A whole copy to write in, noted in the write-back log before it is written.
    fn open_dirty(&self, cx: &Caller, node: NodeId, flags: i32, attr: &Attr, through: bool) -> Result<Reply> {
        let key = node.0;
        let truncate = flags & libc::O_TRUNC != 0;
        if through {
            // Write-through: the slow branch refuses a writer it would refuse alone (permissions
            // it checks itself, an immutable or append-only file, a read-only file system), at
            // its open, before a byte lands in the copy that readers are served.
            let opened = self.slow().open(cx, node, flags & !(libc::O_TRUNC | libc::O_CREAT | libc::O_EXCL))?;
            self.release_later(node, opened.fh);
        }
        let (gen, file) = match self.fresh_copy(key, attr) {
            Some(c) => {
                let file = self.store.open_copy(key, c.gen, true)?;
                if truncate {
                    file.set_len(0)?;
                }
                (c.gen, file)
            }
            None if truncate => self.new_copy(key, attr)?,
            None => {
                let fill = self.fill_for(key, attr)?;
                fill.fill_all(&|_| {})?;
                self.record_complete(&fill);
                match self.copy_of(key) {
                    Some(c) if c.complete && c.gen == fill.gen => (c.gen, self.store.open_copy(key, c.gen, true)?),
                    // It changed on the slow branch while it was fetched: serve this open there.
                    _ => return self.open_slow(cx, node, flags, false),
                }
            }
        };
        self.mark_dirty(key, gen, node)?;
        self.serve_copy(node, gen, file, true, through)
    }

    /// A new, empty, whole copy of `key`, opened for reading and writing.
    fn new_copy(&self, key: u64, attr: &Attr) -> Result<(u64, File)> {
        self.drop_copy(key, false);
        let gen = self.store.index.lock().new_gen();
        let file = self.store.create_copy(key, gen)?;
        let path = self.path_of(NodeId(key)).unwrap_or_default();
        let mut idx = self.store.index.lock();
        idx.copies.insert(key, Copy { gen, path, stamp: Stamp::of(attr), complete: true, dirty: false, used: now_secs(), bytes: 0, shown_ctime: None });
        idx.changed = true;
        Ok((gen, file))
    }

    /// Note that `key`'s copy is about to hold changes the slow branch does not have: in the
    /// write-back log first.
    fn mark_dirty(&self, key: u64, gen: u64, node: NodeId) -> Result<()> {
        let path = self.path_of(node);
        let log = {
            let mut idx = self.store.index.lock();
            let c = idx.copies.get_mut(&key).ok_or(Error::Os(libc::EIO))?;
            if let Some(p) = &path {
                c.path = p.clone();
            }
            let log = (!c.dirty).then(|| c.path.clone());
            c.dirty = true;
            c.used = now_secs();
            idx.changed = true;
            log
        };
        if let Some(p) = log {
            if path.is_none() {
                tracing::warn!("cache '{}': node {key} is written with no known path; a restart before it is written back keeps it under {}/orphans", self.name, self.store.root().display());
            }
            self.store.log(key, Some((gen, &p)))?;
        }
        self.changed(key);
        let seen = self.paths.parent_of(node);
        let logged = self.copy_of(key).map(|c| leaf_of(&c.path));
        let mut ch = self.changes.lock();
        if let Some((parent, name)) = seen {
            ch.bind(key, parent, name, None);
        }
        if let Some(name) = logged {
            ch.name(key, name);
        }
        Ok(())
    }

    fn changed(&self, key: u64) {
        let now = Instant::now();
        let mut ch = self.changes.lock();
        let c = ch.of.entry(key).or_insert(Change { seq: 0, at: now });
        c.seq += 1;
        c.at = now;
        let due = now + self.cfg.delay;
        ch.first_due = Some(ch.first_due.map_or(due, |d| d.min(due)));
    }

    /// `attr` as the user sees it: a copy holding changes gives the size and times.
    fn patch(&self, node: NodeId, attr: &mut Attr) {
        // Write-through has copies with unwritten changes too (a write-back at close that
        // failed, or one from before a restart).
        if attr.kind != FileKind::File {
            return;
        }
        let gen = match self.store.index.lock().copies.get(&node.0) {
            Some(c) if c.dirty => {
                self.slow_attrs.lock().insert(node.0, *attr);
                c.gen
            }
            Some(c) => {
                if let Some(shown) = c.shown_ctime.filter(|_| unix_time(attr.ctime) == c.stamp.ctime) {
                    attr.ctime = from_unix_time(shown.0, shown.1);
                }
                return;
            }
            None => return,
        };
        if let Ok(m) = std::fs::metadata(self.store.copy_path(node.0, gen)) {
            attr.size = m.len();
            attr.blocks = m.blocks();
            attr.mtime = from_unix_time(m.mtime(), m.mtime_nsec() as u32);
            attr.ctime = attr.ctime.max(from_unix_time(m.ctime(), m.ctime_nsec() as u32));
            attr.atime = from_unix_time(m.atime(), m.atime_nsec() as u32);
        }
    }

    fn patch_reply(&self, reply: &mut Reply) {
        match reply {
            Reply::Entry(e) | Reply::Created(e, _) => self.patch(e.node, &mut e.attr),
            Reply::Attr(_) => {}
            Reply::Dir(entries) => {
                for d in entries.iter_mut() {
                    if let Some(e) = d.entry.as_mut() {
                        self.patch(e.node, &mut e.attr);
                    }
                }
            }
            _ => {}
        }
    }

    /// After a change of this mount's that moved the slow file's ctime (and perhaps its mtime)
    /// but not its bytes, from `before` to `after`: a copy that was the file's bytes before it
    /// still is. One that was not (the file changed outside since) is left to be found stale.
    fn kept_bytes(&self, key: u64, before: &Attr, after: &Attr) {
        let (before, after) = (Stamp::of(before), Stamp::of(after));
        {
            let mut idx = self.store.index.lock();
            if let Some(c) = idx.copies.get_mut(&key).filter(|c| !c.dirty && c.stamp == before && c.stamp.size == after.size) {
                c.stamp = after;
                // The ctime is one a user's change gave it now, not a write-back's.
                c.shown_ctime = None;
                idx.changed = true;
            }
        }
        if let Some(f) = self.live_fill(key) {
            let mut s = f.start.lock();
            if *s == before && s.size == after.size {
                *s = after;
            }
        }
    }

    /// The slow file's attributes before a change of this mount's, when it has a copy whose
    /// stamp the change would move (see [`Cache::kept_bytes`]).
    fn before_change(&self, node: NodeId) -> Option<Attr> {
        if !self.has_copy(node.0) || self.dirty(node.0) {
            return None;
        }
        self.slow().getattr(&daemon(), node).ok()
    }

    fn has_copy(&self, key: u64) -> bool {
        self.store.index.lock().copies.contains_key(&key)
    }

    fn slow_fh(&self, fh: Option<FileHandle>) -> Option<FileHandle> {
        let fh = fh?;
        match self.files.lock().get(&fh.0) {
            Some(f) => match &f.kind {
                Kind::Slow { fh, .. } => Some(*fh),
                _ => None,
            },
            None => Some(fh),
        }
    }

    fn set_attr(&self, cx: &Caller, node: NodeId, fh: Option<FileHandle>, set: SetAttr) -> Result<Reply> {
        let key = node.0;
        // Not while a write-back decides whether the copy is clean (see `write_back_now`).
        let _open = self.open_lock(key).lock();
        let copy = self.copy_of(key);
        let dirty = is_dirty(copy.as_ref());
        if dirty {
            // Size and times are the copy's until it is written back; the rest is the slow file's.
            let rest = SetAttr { size: None, atime: None, mtime: None, ..set };
            let known = self.known_slow_attrs(key);
            let mut attr = if rest == SetAttr::default() {
                match known {
                    Some(a) => a,
                    None => self.slow().getattr(cx, node)?,
                }
            } else {
                match self.slow().call(cx, &Op::SetAttr { node, fh: None, set: rest })? {
                    Reply::Attr(a) => a,
                    _ => return Err(Error::Os(libc::EIO)),
                }
            };
            if set.size.is_some() || set.atime.is_some() || set.mtime.is_some() {
                let gen = self.copy_of(key).ok_or(Error::Os(libc::EIO))?.gen;
                self.mark_dirty(key, gen, node)?;
                let file = self.store.open_copy(key, gen, true)?;
                if let Some(size) = set.size {
                    file.set_len(size)?;
                }
                let when = |t: Option<TimeSet>| t.map(|t| match t {
                    TimeSet::Now => SystemTime::now(),
                    TimeSet::At(t) => t,
                });
                let mut times = std::fs::FileTimes::new();
                if let Some(t) = when(set.atime) {
                    times = times.set_accessed(t);
                }
                if let Some(t) = when(set.mtime) {
                    times = times.set_modified(t);
                }
                file.set_times(times)?;
                // Once more after the change: a write-back that copied before it must not mark
                // the copy clean.
                self.changed(key);
            }
            self.patch(node, &mut attr);
            return Ok(Reply::Attr(attr));
        }
        let before = self.before_change(node);
        let mut fill = set.size.and_then(|_| self.live_fill(key));
        if let (Some(f), Some(size)) = (&fill, set.size) {
            if !Fill::fits(size, self.cfg.range) {
                // Too large to follow range by range: given up, and read from the slow branch.
                f.detach();
                self.drop_copy(key, false);
                fill = None;
            }
        }
        let held = fill.as_ref().map(|f| f.hold(0, f.size().max(set.size.unwrap_or(0)).max(1)));
        let reply = self.slow().call(cx, &Op::SetAttr { node, fh: self.slow_fh(fh), set })?;
        let Reply::Attr(attr) = reply else { return Err(Error::Os(libc::EIO)) };
        if let Some(size) = set.size {
            match &fill {
                Some(f) => {
                    f.set_size(size)?;
                    drop(held);
                    let mut idx = self.store.index.lock();
                    if let Some(c) = idx.copies.get_mut(&key).filter(|c| c.gen == f.gen) {
                        c.stamp = Stamp::of(&attr);
                        idx.changed = true;
                    }
                    *f.start.lock() = Stamp::of(&attr);
                }
                // A whole copy (perhaps read by passthrough now) follows the slow file.
                None => match copy
                    .filter(|c| c.complete && before.is_some_and(|b| Stamp::of(&b) == c.stamp) && Fill::fits(size, self.cfg.range))
                    .map(|c| self.store.open_copy(key, c.gen, true).and_then(|f| Ok(f.set_len(size)?)))
                {
                    Some(Ok(())) => {
                        let mut idx = self.store.index.lock();
                        if let Some(c) = idx.copies.get_mut(&key).filter(|c| !c.dirty) {
                            c.stamp = Stamp::of(&attr);
                            c.shown_ctime = None;
                            idx.changed = true;
                        }
                    }
                    _ => {
                        self.drop_copy(key, false);
                    }
                },
            }
        } else if let Some(before) = before {
            // The bytes did not change: only the stamp moves (mtime too, for a utimes).
            self.kept_bytes(key, &before, &attr);
        }
        Ok(Reply::Attr(attr))
    }

    fn read(&self, cx: &Caller, node: NodeId, fh: FileHandle, offset: u64, size: u32) -> Result<Reply> {
        let f = self.file(fh)?;
        match &f.kind {
            Kind::Slow { fh, .. } => self.slow().call(cx, &Op::Read { node, fh: *fh, offset, size }),
            Kind::Copy { file, .. } => {
                let mut buf = vec![0u8; size as usize];
                let mut got = 0;
                while got < buf.len() {
                    let n = file.read_at(&mut buf[got..], offset + got as u64)?;
                    if n == 0 {
                        break;
                    }
                    got += n;
                }
                buf.truncate(got);
                Ok(Reply::Data(buf))
            }
            Kind::Filling(fill) => {
                let (data, last) = fill.read(offset, size)?;
                if let Some(last) = last {
                    self.read_ahead(fill, last);
                }
                if fill.is_complete() {
                    self.record_complete(fill);
                }
                Ok(Reply::Data(data))
            }
        }
    }

    fn write(&self, cx: &Caller, node: NodeId, fh: FileHandle, offset: u64, data: &[u8]) -> Result<Reply> {
        let f = self.file(fh)?;
        match &f.kind {
            Kind::Slow { fh, .. } => {
                let _gate = self.gate(node.0).read();
                let Some(fill) = self.live_fill(node.0) else {
                    let reply = self.slow().call(cx, &Op::Write { node, fh: *fh, offset, data })?;
                    // No fill takes the write to the copy, which `fresh_copy` trusts while a
                    // writer is open (a reader may have filled it whole since this one opened):
                    // it is no longer the file.
                    if self.has_copy(node.0) {
                        self.drop_copy(node.0, false);
                    }
                    return Ok(reply);
                };
                let _held = fill.hold(offset, data.len() as u64);
                let reply = self.slow().call(cx, &Op::Write { node, fh: *fh, offset, data })?;
                if let Reply::Written(n) = reply {
                    if let Err(e) = fill.write(offset, &data[..(n as usize).min(data.len())]) {
                        // The slow branch has the write; the copy cannot follow.
                        tracing::warn!("cache '{}': node {}: the copy cannot take a write ({e}); dropped", self.name, node.0);
                        fill.detach();
                        self.drop_copy(node.0, false);
                    }
                }
                Ok(reply)
            }
            Kind::Copy { file, .. } if f.writes => {
                file.write_all_at(data, offset)?;
                self.changed(node.0);
                Ok(Reply::Written(data.len() as u32))
            }
            _ => Err(Error::Os(libc::EBADF)),
        }
    }

    fn release(&self, cx: &Caller, node: NodeId, fh: FileHandle) -> Result<Reply> {
        let Some(f) = self.files.lock().remove(&fh.0) else { return Err(Error::Os(libc::EBADF)) };
        let key = node.0;
        let result = match &f.kind {
            Kind::Slow { fh, fill } => {
                let r = self.slow().call(cx, &Op::Release { node, fh: *fh });
                if f.writes && self.writers(key) <= 1 && (fill.is_some() || self.has_copy(key)) {
                    // The copy has this mount's writes, but a change made on the slow branch
                    // while they went on would not show in its stamp: the copy is fetched again
                    // when next read rather than trusted, and the kernel's pages of it dropped.
                    self.drop_copy(key, false);
                    self.invalidate_later(node);
                }
                r.map(|_| Reply::Empty)
            }
            Kind::Filling(fill) => {
                self.record_complete(fill);
                Ok(Reply::Empty)
            }
            Kind::Copy { .. } => {
                // (A copy that left the index with its removed file has nothing to write back.)
                if f.writes && self.dirty(key) {
                    self.changed(key);
                }
                Ok(Reply::Empty)
            }
        };
        {
            let _open = self.open_lock(key).lock();
            self.uncount_open(key, f.side, f.writes);
        }
        if f.through {
            if let Err(e) = self.write_back(key) {
                tracing::warn!("cache '{}': node {key}: not written back at release ({e}); it stays in the cache and is tried again", self.name);
            }
        }
        // The keeper wakes at least every KEEPER_TICK_MIN: woken at each close only when the
        // delay is shorter than that (a wake-up per created file cost an untar a context switch
        // each).
        if f.writes && self.cfg.delay < KEEPER_TICK_MIN {
            self.wake_keeper();
        }
        result
    }

    fn fsync(&self, cx: &Caller, op: &Op<'_>, node: NodeId, fh: FileHandle, datasync: bool) -> Result<Reply> {
        let f = self.file(fh)?;
        match &f.kind {
            Kind::Slow { fh, .. } => self.slow().call(cx, &op.on_open(node, *fh)),
            Kind::Filling(_) => Ok(Reply::Empty),
            Kind::Copy { file, .. } => {
                if datasync {
                    file.sync_data()?;
                } else {
                    file.sync_all()?;
                }
                if self.dirty(node.0) {
                    self.store.sync_log()?;
                    // Durable here; the slow branch gets it now too, or as soon as it can.
                    if let Err(e) = self.write_back(node.0) {
                        tracing::warn!("cache '{}': node {}: fsync: not written back yet ({e}); it is safe in the cache and will be", self.name, node.0);
                    }
                }
                Ok(Reply::Empty)
            }
        }
    }

    /// The slow branch's node of `key` for a write-back: itself while the kernel holds it, else
    /// found by its path (after a restart). Returns the node and the lookups to give back.
    fn slow_node(&self, key: u64, path: &str) -> Result<(NodeId, Vec<NodeId>)> {
        if self.path_of(NodeId(key)).is_some() {
            return Ok((NodeId(key), Vec::new()));
        }
        if path.is_empty() || !store::sane_path(path) {
            return Err(Error::Os(libc::ENOENT));
        }
        let mut held = Vec::new();
        let mut at = NodeId::ROOT;
        for part in path.split('/') {
            match self.slow().lookup(&daemon(), at, &store::decode_name(part)) {
                Ok(e) => {
                    held.push(e.node);
                    at = e.node;
                }
                Err(e) => {
                    for n in held {
                        self.slow().forget(&daemon(), n, 1);
                    }
                    return Err(e);
                }
            }
        }
        if at.0 != key {
            for n in held {
                self.slow().forget(&daemon(), n, 1);
            }
            return Err(Error::Os(libc::ENOENT));
        }
        Ok((at, held))
    }

    /// Copy `key`'s changes to the slow branch. It stays marked dirty if it changed meanwhile.
    fn write_back(&self, key: u64) -> Result<()> {
        self.write_back_at(key, None)
    }

    /// [`Cache::write_back`], to the slow branch's node `node` when the caller holds it.
    fn write_back_at(&self, key: u64, node: Option<NodeId>) -> Result<()> {
        {
            let mut busy = self.flushing.lock();
            while busy.contains(&key) {
                self.flushed.wait(&mut busy);
            }
            busy.insert(key);
        }
        let result = self.write_back_now(key, node);
        self.flushing.lock().remove(&key);
        self.flushed.notify_all();
        result
    }

    fn write_back_now(&self, key: u64, known: Option<NodeId>) -> Result<()> {
        let Some(copy) = self.copy_of(key).filter(|c| c.dirty) else { return Ok(()) };
        let seq = self.changes.lock().of.get(&key).map_or(0, |c| c.seq);
        let found = match known {
            Some(n) => Ok((n, Vec::new())),
            None => self.slow_node(key, &copy.path),
        };
        let (node, held) = match found {
            Ok(found) => found,
            // Its name leads nowhere or to another file: kept aside. (ESTALE from a server is
            // not this: tried again later.)
            Err(Error::Os(libc::ENOENT)) => {
                let kept = self.store.orphan(key, copy.gen);
                tracing::error!(
                    "cache '{}': '{}' is no longer on the slow branch; its unwritten bytes are kept in {}",
                    self.name,
                    copy.path,
                    kept.display()
                );
                self.store.index.lock().copies.remove(&key);
                self.store.index.lock().changed = true;
                self.changes.lock().remove(key);
                let _ = self.store.log(key, None);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let known = self.slow_attrs.lock().get(&key).copied();
        let shown = match known {
            Some(a) => Ok(a),
            None => self.slow().getattr(&daemon(), node),
        }
        .map(|mut a| {
            self.patch(node, &mut a);
            unix_time(a.ctime)
        });
        let result = self.copy_to_slow(key, node, &copy);
        for n in held {
            self.slow().forget(&daemon(), n, 1);
        }
        let attr = result?;
        // Decided under the file's open lock: an open for writing in progress has marked the
        // copy dirty but is not counted as a writer yet.
        let _open = self.open_lock(key).lock();
        let clean = {
            let mut ch = self.changes.lock();
            let unchanged = ch.of.get(&key).map_or(0, |c| c.seq) == seq && self.writers(key) == 0;
            if unchanged {
                ch.remove(key);
            }
            unchanged
        };
        if clean {
            let logged = {
                let mut idx = self.store.index.lock();
                match idx.copies.get_mut(&key).filter(|c| c.gen == copy.gen && c.dirty) {
                    Some(c) => {
                        self.slow_attrs.lock().remove(&key);
                        self.absent_xattrs.lock().remove(&key);
                        c.dirty = false;
                        c.stamp = Stamp::of(&attr);
                        c.shown_ctime = shown.as_ref().ok().copied();
                        idx.changed = true;
                        true
                    }
                    None => false,
                }
            };
            if logged {
                self.store.log(key, None)?;
            }
        }
        self.failing.lock().remove(&key);
        Ok(())
    }

    fn copy_to_slow(&self, key: u64, node: NodeId, copy: &Copy) -> Result<Attr> {
        let cx = daemon();
        let file = self.store.open_copy(key, copy.gen, false)?;
        let meta = file.metadata()?;
        let opened = self.slow().open(&cx, node, libc::O_WRONLY)?;
        let fh = opened.fh;
        let copied = (|| -> Result<Attr> {
            let mut buf = vec![0u8; 1 << 20];
            let mut at = 0u64;
            loop {
                let n = file.read_at(&mut buf, at)?;
                if n == 0 {
                    break;
                }
                let mut done = 0;
                while done < n {
                    let w = self.slow().write(&cx, node, fh, at + done as u64, &buf[done..n])? as usize;
                    if w == 0 {
                        return Err(Error::Os(libc::EIO));
                    }
                    done += w;
                }
                at += n as u64;
                self.stats.written_back.fetch_add(n as u64, Ordering::Relaxed);
            }
            let mtime = from_unix_time(meta.mtime(), meta.mtime_nsec() as u32);
            let atime = from_unix_time(meta.atime(), meta.atime_nsec() as u32);
            let size = SetAttr { size: Some(at), ..SetAttr::default() };
            let with_times = SetAttr { mtime: Some(TimeSet::At(mtime)), atime: Some(TimeSet::At(atime)), ..size };
            // The times are the copy's; a slow branch that does not let the daemon set them on
            // another's file gets the size alone.
            let reply = match self.slow().call(&cx, &Op::SetAttr { node, fh: Some(fh), set: with_times }) {
                Err(Error::Os(libc::EPERM)) => self.slow().call(&cx, &Op::SetAttr { node, fh: Some(fh), set: size })?,
                other => other?,
            };
            self.slow().call(&cx, &Op::Fsync { node, fh, datasync: false })?;
            match reply {
                Reply::Attr(a) => Ok(a),
                _ => self.slow().getattr(&cx, node),
            }
        })();
        let _ = self.slow().release(&cx, node, fh);
        copied
    }

    /// Write back every copy that waited long enough (or all of them).
    fn write_back_due(&self, all: bool) -> (usize, Vec<String>) {
        // Every copy with unwritten changes has an entry in `changes`: the keeper looks there
        // only, not through the whole index at every tick.
        let due: Vec<u64> = if all {
            self.store.index.lock().copies.iter().filter(|(_, c)| c.dirty).map(|(k, _)| *k).collect()
        } else {
            let waited = self.due_changes();
            let idx = self.store.index.lock();
            waited.into_iter().filter(|k| is_dirty(idx.copies.get(k))).collect()
        };
        let mut done = 0;
        let mut errors = Vec::new();
        for key in due {
            if !all && self.writers(key) > 0 {
                continue;
            }
            // A removal took a name from it, and it is being looked at: gone, it is not written.
            if self.held.lock().contains_key(&key) {
                continue;
            }
            match self.write_back(key) {
                Ok(()) => done += 1,
                Err(e) => {
                    let path = self.copy_of(key).map(|c| c.path).unwrap_or_default();
                    if self.failing.lock().insert(key) {
                        tracing::warn!("cache '{}': '{path}': cannot write back yet ({e}); it stays in the cache and is tried again", self.name);
                    }
                    errors.push(format!("{path}: {e}"));
                }
            }
        }
        (done, errors)
    }

    /// The copies whose last change is `delay` old, when the first due time has come. Those it
    /// returns that stay (a writer holds them, or writing back failed) are looked at again
    /// within [`RETRY_AFTER`].
    fn due_changes(&self) -> Vec<u64> {
        let now = Instant::now();
        let mut ch = self.changes.lock();
        if ch.first_due.is_none_or(|d| d > now) {
            return Vec::new();
        }
        let (mut due, mut next) = (Vec::new(), None::<Instant>);
        for (key, c) in &ch.of {
            let at = c.at + self.cfg.delay;
            if at <= now {
                due.push(*key);
            } else {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        }
        if !due.is_empty() {
            let again = now + self.cfg.delay.clamp(KEEPER_TICK_MIN, RETRY_AFTER);
            next = Some(next.map_or(again, |n| n.min(again)));
        }
        ch.first_due = next;
        due
    }

    /// Whether `key`'s copy is in use (open, filling, being written back).
    fn in_use(&self, key: u64) -> bool {
        self.opens.lock().contains_key(&key)
            || self.fills.lock().get(&key).is_some_and(|w| w.strong_count() > 0)
            || self.flushing.lock().contains(&key)
    }

    /// Evict copies: past `max_age`, then the least recently used while over `max_size` or
    /// under `min_free`.
    fn evict(&self) {
        self.fills.lock().retain(|_, w| w.strong_count() > 0);
        let (free, total) = self.store.space();
        let min_free = match self.cfg.min_free {
            Free::Bytes(b) => b,
            Free::Percent(p) => total / 100 * p,
        };
        let filling: u64 = self.fills.lock().values().filter_map(Weak::upgrade).map(|f| f.fetched.load(Ordering::Relaxed)).sum();
        let mut candidates: Vec<(u64, u64, u64, u64)> = {
            let idx = self.store.index.lock();
            idx.copies
                .iter()
                .filter(|(_, c)| c.complete && !c.dirty && idx.pin_of(&c.path).or_else(|| self.pin_by_rule(&c.path)) != Some(Pin::Pin))
                .map(|(k, c)| (c.used, *k, c.gen, c.bytes))
                .collect()
        };
        let mut used: u64 = self.store.index.lock().copies.values().fold(filling, |a, c| a.saturating_add(c.bytes));
        let mut free = free;
        candidates.sort();
        let old = self.cfg.max_age.map(|a| now_secs().saturating_sub(a.as_secs()));
        for (when, key, gen, bytes) in candidates {
            let over = (self.cfg.max_size > 0 && used > self.cfg.max_size) || free < min_free;
            let aged = old.is_some_and(|o| when < o);
            if !over && !aged {
                continue;
            }
            // An open of the file in progress holds its lock: not now.
            let Some(_open) = self.open_lock(key).try_lock() else { continue };
            if self.in_use(key) {
                continue;
            }
            let removed = {
                let mut idx = self.store.index.lock();
                match idx.copies.get(&key) {
                    Some(c) if c.gen == gen && !c.dirty => {
                        idx.copies.remove(&key);
                        idx.changed = true;
                        true
                    }
                    _ => false,
                }
            };
            if removed {
                self.store.remove_copy(key, gen);
                used = used.saturating_sub(bytes);
                free = free.saturating_add(bytes);
            }
        }
    }

    /// The slow branch says `key` changed (a remote server's notice, which also follows this
    /// mount's own write-backs). The copy is not dropped here: the next open compares it with
    /// the slow file's attributes, which the notice refreshed, and the kernel's pages are
    /// dropped by the notice passed on.
    fn outside_change(&self, key: u64) {
        if self.dirty(key) && self.flushing.lock().contains(&key) {
            return;
        }
        if self.dirty(key) {
            tracing::debug!("cache '{}': node {key} changed on the slow branch while this mount holds unwritten changes to it; this mount's changes win", self.name);
        }
    }

    // The extended operations.

    fn status(&self) -> Value {
        let idx = self.store.index.lock();
        let whole: Vec<&Copy> = idx.copies.values().filter(|c| c.complete).collect();
        let dirty: Vec<&Copy> = idx.copies.values().filter(|c| c.dirty).collect();
        let dirty_bytes: u64 = idx
            .copies
            .iter()
            .filter(|(_, c)| c.dirty)
            .map(|(k, c)| std::fs::metadata(self.store.copy_path(*k, c.gen)).map_or(0, |m| m.len()))
            .sum();
        let hits = self.stats.hits.load(Ordering::Relaxed);
        let misses = self.stats.misses.load(Ordering::Relaxed);
        let (free, _) = self.store.space();
        json!({
            "mode": match self.cfg.mode { Mode::WriteThrough => "write-through", Mode::WriteBack => "write-back" },
            "fast": self.fast.lower.to_string(),
            "slow": self.slow.name,
            "files": whole.len(),
            "bytes": whole.iter().fold(0u64, |a, c| a.saturating_add(c.bytes)),
            "max_size": self.cfg.max_size,
            "fast_free": free,
            "hits": hits,
            "misses": misses,
            "hit_rate": if hits + misses == 0 { Value::Null } else { json!((hits as f64) / ((hits + misses) as f64)) },
            "fetched_bytes": self.stats.fetched.load(Ordering::Relaxed),
            "dirty_files": dirty.len(),
            "dirty_bytes": dirty_bytes,
            "written_back_bytes": self.stats.written_back.load(Ordering::Relaxed),
            "pins": idx.pins.iter().map(|(p, v)| json!({"path": p, "pin": match v { Pin::Pin => "pin", Pin::Never => "never" }})).collect::<Vec<_>>(),
        })
    }

    /// The regular files at and under `node`; `held` gets every node looked up on the way
    /// (directories too, so that paths stay known), for [`Cache::forget_all`].
    fn files_under(&self, cx: &Caller, node: NodeId, out: &mut Vec<(NodeId, u64)>, held: &mut Vec<NodeId>) -> Result<()> {
        let attr = self.slow().getattr(cx, node)?;
        match attr.kind {
            FileKind::File => {
                out.push((node, attr.size));
                Ok(())
            }
            FileKind::Dir => {
                for e in self.slow().list_dir(cx, node)? {
                    let Ok(entry) = self.slow().lookup(cx, node, &e.name) else { continue };
                    self.paths.seen(node, &e.name, entry.node);
                    held.push(entry.node);
                    match entry.attr.kind {
                        FileKind::File => out.push((entry.node, entry.attr.size)),
                        FileKind::Dir => self.files_under(cx, entry.node, out, held)?,
                        _ => {}
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn forget_all(&self, held: Vec<NodeId>) {
        for n in held.into_iter().rev() {
            self.forget_held(n);
        }
    }

    fn forget_held(&self, node: NodeId) {
        self.paths.forget(node, 1);
        self.slow().forget(&daemon(), node, 1);
    }

    fn warm(&self, cx: &Caller, node: NodeId) -> Result<Value> {
        let (mut files, mut held) = (Vec::new(), Vec::new());
        let found = self.files_under(cx, node, &mut files, &mut held);
        if let Err(e) = found {
            self.forget_all(held);
            return Err(e);
        }
        let total: u64 = files.iter().map(|f| f.1).sum();
        let progress = plyfs_stack::progress::start("fetching into the cache", "bytes", total);
        let (mut fetched, mut already, mut failed) = (0u64, 0u64, Vec::new());
        for (n, _) in &files {
            let r = (|| -> Result<bool> {
                let attr = self.slow().getattr(cx, *n)?;
                if attr.size == 0 || self.fresh_copy(n.0, &attr).is_some() {
                    progress.add(attr.size);
                    return Ok(false);
                }
                let fill = self.fill_for(n.0, &attr)?;
                fill.fill_all(&|b| progress.add(b))?;
                self.record_complete(&fill);
                Ok(true)
            })();
            match r {
                Ok(true) => fetched += 1,
                Ok(false) => already += 1,
                Err(e) => failed.push(format!("{}: {e}", self.path_of(*n).unwrap_or_else(|| format!("node {}", n.0)))),
            }
        }
        self.forget_all(held);
        Ok(json!({"fetched": fetched, "already_cached": already, "failed": failed}))
    }

    fn evict_path(&self, cx: &Caller, node: NodeId) -> Result<Value> {
        let (mut files, mut held) = (Vec::new(), Vec::new());
        let found = self.files_under(cx, node, &mut files, &mut held);
        if let Err(e) = found {
            self.forget_all(held);
            return Err(e);
        }
        let (mut evicted, mut busy) = (0, Vec::new());
        for (n, _) in &files {
            if self.dirty(n.0) {
                if let Err(e) = self.write_back(n.0) {
                    busy.push(format!("{}: not written back yet ({e})", self.path_of(*n).unwrap_or_default()));
                }
            }
            if self.has_copy(n.0) {
                // The kernel sends a release after the close has returned: one in flight is
                // waited for a moment.
                let deadline = Instant::now() + Duration::from_secs(1);
                while self.in_use(n.0) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if self.in_use(n.0) {
                    busy.push(format!("{}: open", self.path_of(*n).unwrap_or_default()));
                } else if self.drop_copy(n.0, false) {
                    evicted += 1;
                }
            }
        }
        self.forget_all(held);
        Ok(json!({"evicted": evicted, "kept": busy}))
    }

    fn set_pin(&self, cx: &Caller, node: NodeId, pin: Option<Pin>) -> Result<()> {
        let path = self.path_of(node).ok_or(Error::Os(libc::ESTALE))?;
        {
            let mut idx = self.store.index.lock();
            match pin {
                Some(p) => idx.pins.insert(path.clone(), p),
                None => idx.pins.remove(&path),
            };
            idx.changed = true;
        }
        if pin == Some(Pin::Never) {
            let (mut files, mut held) = (Vec::new(), Vec::new());
            if self.files_under(cx, node, &mut files, &mut held).is_ok() {
                for (n, _) in files {
                    if !self.in_use(n.0) {
                        self.drop_copy(n.0, false);
                    }
                }
            }
            self.forget_all(held);
        }
        let _ = self.store.save();
        Ok(())
    }

    fn extended(&self, cx: &Caller, op: &Op<'_>, node: NodeId, name: &str, args: &[String]) -> Result<Reply> {
        let no_args = || if args.is_empty() { Ok(()) } else { Err(Error::BadArgs(format!("{name} takes no arguments"))) };
        let v = match name {
            "cache-status" => {
                no_args()?;
                self.status()
            }
            "cache-flush" => {
                no_args()?;
                let n = self.store.index.lock().copies.values().filter(|c| c.dirty).count() as u64;
                let progress = plyfs_stack::progress::start("writing back", "files", n);
                let (done, errors) = self.write_back_due(true);
                progress.add(done as u64);
                let _ = self.store.save();
                if !errors.is_empty() {
                    return Err(Error::BadArgs(format!("cache-flush: {} file(s) not written back: {}", errors.len(), errors.join("; "))));
                }
                json!({"written_back": done})
            }
            "cache-evict" => {
                no_args()?;
                self.evict_path(cx, node)?
            }
            "cache-warm" => {
                no_args()?;
                self.warm(cx, node)?
            }
            "pin" | "unpin" => {
                no_args()?;
                let value: &[u8] = if name == "pin" { b"pin" } else { b"auto" };
                self.call(cx, &Op::SetXattr { node, name: OsStr::new(PIN_XATTR), value, flags: 0 })?;
                if name == "pin" {
                    self.warm(cx, node)?
                } else {
                    json!({"unpinned": self.path_of(node)})
                }
            }
            _ => return self.slow().call(cx, op),
        };
        Ok(Reply::Extended(v))
    }

    /// Names that are about to mean something else on the slow branch: the node that `name` in
    /// `parent` is now (to drop its copy if it goes), when write-back copies could be affected.
    fn victim(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Option<Victim> {
        {
            let ch = self.changes.lock();
            if let Some(&key) = ch.bound.get(&(parent, name.to_owned())) {
                drop(ch);
                self.held.lock().entry(key).or_default().looks += 1;
                return Some(Victim::Seen(NodeId(key)));
            }
            if !ch.names.contains_key(name) && ch.loose.is_empty() {
                return None;
            }
        }
        self.slow().lookup(cx, parent, name).ok().map(|e| Victim::Looked(e.node))
    }

    /// The slow branch's attributes of a file with unwritten changes, as this mount last saw
    /// them; not while a removal's look at it is under way (its link count and change time are
    /// the slow branch's to say: `fstat` of an open file just removed shows no links).
    fn known_slow_attrs(&self, key: u64) -> Option<Attr> {
        if self.held.lock().contains_key(&key) {
            return None;
        }
        self.slow_attrs.lock().get(&key).copied()
    }

    /// The removal or rename that `victim` was found for failed.
    fn spare(&self, victim: Option<Victim>) {
        match victim {
            Some(Victim::Seen(v)) => self.unhold(v),
            Some(Victim::Looked(v)) => self.slow().forget(&daemon(), v, 1),
            None => {}
        }
    }

    /// One look at `node` after a removal is done: the forgets held back meanwhile go on.
    fn unhold(&self, node: NodeId) {
        let forgets = {
            let mut held = self.held.lock();
            let Some(h) = held.get_mut(&node.0) else { return };
            h.looks -= 1;
            if h.looks > 0 {
                return;
            }
            held.remove(&node.0).map_or(0, |h| h.forgets)
        };
        if forgets > 0 {
            self.slow().forget(&daemon(), node, forgets);
        }
    }

    /// After `victim` lost a name: if it is gone, so is its copy (unwritten changes included).
    fn lost_name(&self, victim: Option<Victim>) {
        match victim {
            None => {}
            Some(Victim::Looked(v)) => {
                self.look_after_removal(v);
                self.slow().forget(&daemon(), v, 1);
            }
            // A file with other names: its write-back may have to find it by one of them after a
            // restart, so it is written back before the removal returns.
            Some(Victim::Seen(v)) if self.slow_attrs.lock().get(&v.0).is_none_or(|a| a.nlink != 1) => {
                self.look_after_removal(v);
                self.unhold(v);
            }
            // Else in the background: an `rm -rf` of files just written would wait a round trip
            // per file for it. Meanwhile neither the keeper nor the kernel's forgets can lose the
            // node, and the file's write-back waits.
            Some(Victim::Seen(v)) => {
                let me = self.me.get().and_then(Weak::upgrade);
                self.in_background(Box::new(move || {
                    if let Some(me) = me {
                        me.look_after_removal(v);
                        me.unhold(v);
                    }
                }));
            }
        }
    }

    /// `v` lost a name: if it is gone, so is its copy (unwritten changes included).
    fn look_after_removal(&self, v: NodeId) {
        let gone = match self.slow().getattr(&daemon(), v) {
            Ok(a) => a.nlink == 0,
            Err(_) => true,
        };
        if gone {
            self.drop_copy(v.0, true);
        } else if self.dirty(v.0) {
            // The name its write-back would find it by may be the one that went (a hard link
            // removed): written back now, by the node held.
            if let Err(e) = self.write_back_at(v.0, Some(v)) {
                tracing::warn!("cache '{}': node {}: lost a name before it was written back ({e}); tried again later", self.name, v.0);
            }
            // Still holding changes (a writer has it open): its next removal may be its last,
            // by a name no copy was written under.
            if self.dirty(v.0) {
                let mut ch = self.changes.lock();
                if ch.of.contains_key(&v.0) {
                    ch.loose.insert(v.0);
                }
            }
        }
    }
}

/// The cache's own thread: writes back what is due, evicts, and saves the index.
fn keeper(me: Weak<Cache>) {
    let (mut last_evict, mut last_save) = (Instant::now(), Instant::now());
    loop {
        let Some(cache) = me.upgrade() else { return };
        if cache.stop.load(Ordering::Acquire) {
            return;
        }
        // Write-through leaves dirty copies too: when a write-back at close failed, or before a
        // restart.
        cache.write_back_due(false);
        // Eviction soon after a fetch (at most five times a second), else every two seconds;
        // the index is written every two seconds, whatever happens in between.
        let soon = cache.evict_soon.swap(false, Ordering::AcqRel);
        if last_evict.elapsed() >= Duration::from_secs(2) || (soon && last_evict.elapsed() >= Duration::from_millis(200)) {
            cache.evict();
            last_evict = Instant::now();
        } else if soon {
            cache.evict_soon.store(true, Ordering::Release);
        }
        if last_save.elapsed() >= Duration::from_secs(2) {
            let _ = cache.store.save();
            last_save = Instant::now();
        }
        let tick = cache.cfg.delay.clamp(KEEPER_TICK_MIN, Duration::from_millis(500));
        let mut woken = cache.wake.0.lock();
        if !*woken {
            cache.wake.1.wait_for(&mut woken, tick);
        }
        *woken = false;
    }
}

struct CacheInvalidator {
    inner: Arc<dyn Invalidator>,
    cache: Weak<Cache>,
}

impl Invalidator for CacheInvalidator {
    fn node(&self, node: NodeId) {
        if let Some(c) = self.cache.upgrade() {
            c.outside_change(node.0);
        }
        self.inner.node(node);
    }

    fn entry(&self, parent: NodeId, name: &OsStr) {
        self.inner.entry(parent, name);
    }
}

/// The operations, as [`CacheHandle`] (the layer the stack holds) passes them on.
impl Cache {
    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        match *op {
            Op::Lookup { .. } | Op::MkNod { .. } | Op::MkDir { .. } | Op::SymLink { .. } | Op::Link { .. } | Op::ReadDir { plus: true, .. } => {
                let mut reply = self.slow().call(cx, op)?;
                self.paths.learn(op, &reply);
                self.patch_reply(&mut reply);
                Ok(reply)
            }
            Op::Forget { node, nlookup } => {
                self.paths.forget(node, nlookup);
                if let Some(h) = self.held.lock().get_mut(&node.0) {
                    h.forgets += nlookup;
                    return Ok(Reply::Empty);
                }
                self.slow().call(cx, op)
            }
            Op::GetAttr { node, fh } => {
                // A file with unwritten changes: its slow attributes change only through this
                // mount, which saw them last.
                let known = self.known_slow_attrs(node.0);
                if let Some(mut a) = known.filter(|_| self.dirty(node.0)) {
                    self.patch(node, &mut a);
                    return Ok(Reply::Attr(a));
                }
                let reply = self.slow().call(cx, &Op::GetAttr { node, fh: self.slow_fh(fh) })?;
                match reply {
                    Reply::Attr(mut a) => {
                        self.patch(node, &mut a);
                        Ok(Reply::Attr(a))
                    }
                    other => Ok(other),
                }
            }
            Op::SetAttr { node, fh, set } => self.set_attr(cx, node, fh, set),
            Op::Unlink { parent, name } => {
                let victim = self.victim(cx, parent, name);
                let r = self.slow().call(cx, op);
                if r.is_ok() {
                    self.changes.lock().unbind(parent, name);
                    self.lost_name(victim);
                } else {
                    self.spare(victim);
                }
                r
            }
            Op::Rename { parent, name, new_parent, new_name, flags } => {
                let from = self.child_path(parent, name);
                let to = self.child_path(new_parent, new_name);
                let victim = if flags & libc::RENAME_EXCHANGE == 0 { self.victim(cx, new_parent, new_name) } else { None };
                let r = self.slow().call(cx, op);
                if r.is_err() {
                    self.spare(victim);
                    return r;
                }
                // Neither entry names what it was bound to any more (the dirty files found
                // under them are bound again below).
                {
                    let mut ch = self.changes.lock();
                    ch.unbind(parent, name);
                    ch.unbind(new_parent, new_name);
                }
                self.lost_name(victim);
                if let Ok(e) = self.slow().lookup(cx, new_parent, new_name) {
                    self.paths.moved(e.node, new_parent, new_name);
                    if self.dirty(e.node.0) {
                        self.changes.lock().bind(e.node.0, new_parent, new_name.to_owned(), Some((parent, name.to_owned())));
                    }
                    self.slow().forget(cx, e.node, 1);
                }
                if flags & libc::RENAME_EXCHANGE != 0 {
                    if let Ok(e) = self.slow().lookup(cx, parent, name) {
                        self.paths.moved(e.node, parent, name);
                        if self.dirty(e.node.0) {
                            self.changes.lock().bind(e.node.0, parent, name.to_owned(), None);
                        }
                        self.slow().forget(cx, e.node, 1);
                    }
                }
                if let (Some(from), Some(to)) = (from, to) {
                    let dirty = if flags & libc::RENAME_EXCHANGE != 0 {
                        let tmp = format!("\0{from}");
                        let mut idx = self.store.index.lock();
                        let mut d = idx.renamed(&from, &tmp);
                        d.extend(idx.renamed(&to, &from));
                        d.extend(idx.renamed(&tmp, &to));
                        d
                    } else {
                        self.store.index.lock().renamed(&from, &to)
                    };
                    {
                        let mut ch = self.changes.lock();
                        for (key, _, path) in &dirty {
                            ch.name(*key, leaf_of(path));
                        }
                    }
                    for (key, gen, path) in dirty {
                        if store::sane_path(&path) {
                            let _ = self.store.log(key, Some((gen, &path)));
                        }
                    }
                }
                r
            }
            Op::Open { node, flags } => self.open(cx, node, flags),
            Op::Create { name, flags, .. } => {
                let reply = self.slow().call(cx, op)?;
                self.paths.learn(op, &reply);
                let Reply::Created(mut entry, opened) = reply else { return Err(Error::Os(libc::EIO)) };
                let (node, key) = (entry.node, entry.node.0);
                let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
                let _open = self.open_lock(key).lock();
                let served = self.served(key);
                // A create may open a file that exists (without O_EXCL). A clean copy whose stamp
                // is not this file's is an earlier file's with the same inode number.
                if served.is_none() && self.copy_of(key).is_some_and(|c| !c.dirty && c.stamp != Stamp::of(&entry.attr)) {
                    self.drop_copy(key, false);
                }
                let cached = self.caches_for(cx, node);
                let result = match served {
                    _ if !cached => self.wrap_slow(node, opened, writes, false, false),
                    Some(Side::Slow) => self.wrap_slow(node, opened, writes, false, false),
                    Some(Side::Fast(gen)) => {
                        let _ = self.slow().release(cx, node, opened.fh);
                        self.open_next_to_copy(cx, node, flags, &entry.attr, gen)
                    }
                    // Next to a writer writing through: see `fetch_to_write`.
                    _ if self.cfg.mode == Mode::WriteBack && writes && self.writers(key) > 0 && !self.dirty(key) => {
                        self.wrap_slow(node, opened, writes, true, flags & libc::O_TRUNC != 0)
                    }
                    _ if self.cfg.mode == Mode::WriteBack => {
                        // The copy takes the writes: the slow branch's handle is let go in the
                        // background, sparing a round trip per created file (an untar's).
                        self.release_later(node, opened.fh);
                        let made = if self.has_copy(key) {
                            self.open_dirty(cx, node, flags, &entry.attr, false)
                        } else {
                            self.new_copy(key, &entry.attr).and_then(|(gen, file)| {
                                self.mark_dirty(key, gen, node)?;
                                self.serve_copy(node, gen, file, true, false)
                            })
                        };
                        made.or_else(|e| {
                            tracing::warn!("cache '{}': '{}': cannot make a copy ({e}); written to the slow branch", self.name, name.to_string_lossy());
                            self.open_slow(cx, node, (flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC)) | libc::O_WRONLY, false)
                        })
                    }
                    _ => self.wrap_slow(node, opened, writes, true, flags & libc::O_TRUNC != 0),
                };
                self.patch(node, &mut entry.attr);
                match result? {
                    Reply::Opened(o) => Ok(Reply::Created(entry, o)),
                    _ => Err(Error::Os(libc::EIO)),
                }
            }
            Op::Read { node, fh, offset, size } => self.read(cx, node, fh, offset, size),
            Op::Write { node, fh, offset, data } => self.write(cx, node, fh, offset, data),
            Op::Flush { node, fh } => {
                let f = self.file(fh)?;
                match &f.kind {
                    Kind::Slow { fh, .. } => self.slow().call(cx, &Op::Flush { node, fh: *fh }),
                    // Write-through by way of the copy: on the slow branch when close returns.
                    Kind::Copy { .. } if f.through => self.write_back(node.0).map(|()| Reply::Empty),
                    _ => Ok(Reply::Empty),
                }
            }
            Op::Fsync { node, fh, datasync } => self.fsync(cx, op, node, fh, datasync),
            Op::Release { node, fh } => self.release(cx, node, fh),
            Op::Fallocate { node, fh, offset, length, mode } => {
                let f = self.file(fh)?;
                match &f.kind {
                    Kind::Slow { fh, .. } => {
                        // As a write: on the slow branch, then on the copy that readers read.
                        let _gate = self.gate(node.0).read();
                        let Some(fill) = self.live_fill(node.0) else {
                            let r = self.slow().call(cx, &op.on_open(node, *fh));
                            if r.is_ok() && self.has_copy(node.0) {
                                self.drop_copy(node.0, false);
                            }
                            return r;
                        };
                        let held = fill.hold(offset, length.max(1));
                        let r = self.slow().call(cx, &op.on_open(node, *fh))?;
                        // SAFETY: fallocate on a descriptor we own.
                        let rc = unsafe { libc::fallocate(fill.file.as_raw_fd(), mode, offset as i64, length as i64) };
                        let grown = mode & libc::FALLOC_FL_KEEP_SIZE == 0;
                        if rc != 0 || (grown && fill.set_size(fill.size().max(offset.saturating_add(length))).is_err()) {
                            drop(held);
                            fill.detach();
                            self.drop_copy(node.0, false);
                        }
                        Ok(r)
                    }
                    Kind::Copy { file, .. } if f.writes => {
                        // SAFETY: fallocate on a descriptor we own.
                        let rc = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as i64, length as i64) };
                        if rc != 0 {
                            return Err(Error::last_os());
                        }
                        self.changed(node.0);
                        Ok(Reply::Empty)
                    }
                    _ => Err(Error::Os(libc::EBADF)),
                }
            }
            Op::Lseek { node, fh, offset, whence } => {
                let f = self.file(fh)?;
                let file = match &f.kind {
                    Kind::Slow { fh, .. } => return self.slow().call(cx, &op.on_open(node, *fh)),
                    Kind::Copy { file, .. } => file.clone(),
                    Kind::Filling(fill) if fill.is_complete() => fill.file.clone(),
                    Kind::Filling(fill) => {
                        // Not all here yet: the whole file counts as data.
                        let size = fill.size();
                        if offset < 0 || offset as u64 >= size {
                            return Err(Error::Os(libc::ENXIO));
                        }
                        return Ok(Reply::Offset(if whence == libc::SEEK_DATA { offset as u64 } else { size }));
                    }
                };
                // SAFETY: lseek on a descriptor we own (our own offset does not matter).
                let at = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
                if at < 0 {
                    return Err(Error::last_os());
                }
                Ok(Reply::Offset(at as u64))
            }
            Op::Ioctl { node, fh, .. } => match self.files.lock().get(&fh.0).cloned() {
                Some(f) => match &f.kind {
                    Kind::Slow { fh, .. } => self.slow().call(cx, &op.on_open(node, *fh)),
                    _ => self.slow().ioctl_opened(cx, op, node, FileKind::File),
                },
                None => self.slow().call(cx, op),
            },
            Op::GetXattr { node, name, .. } if self.absent_xattrs.lock().get(&node.0).is_some_and(|a| a.contains(name)) => {
                Err(Error::Os(libc::ENODATA))
            }
            Op::GetXattr { node, name, .. } => {
                let r = self.slow().call(cx, op);
                if matches!(r, Err(Error::Os(libc::ENODATA))) && self.dirty(node.0) {
                    self.absent_xattrs.lock().entry(node.0).or_default().insert(name.to_owned());
                }
                r
            }
            Op::SetXattr { node, name, value, .. } if name == PIN_XATTR => {
                self.absent_xattrs.lock().remove(&node.0);
                let pin = Pin::parse(value).ok_or(Error::Os(libc::EINVAL))?;
                self.slow().call(cx, op)?;
                self.set_pin(cx, node, pin)?;
                Ok(Reply::Empty)
            }
            Op::RemoveXattr { node, name } if name == PIN_XATTR => {
                self.absent_xattrs.lock().remove(&node.0);
                let r = self.slow().call(cx, op);
                if r.is_ok() || matches!(r, Err(Error::Os(libc::ENODATA))) {
                    self.set_pin(cx, node, None)?;
                }
                r
            }
            Op::SetXattr { node, .. } | Op::RemoveXattr { node, .. } => {
                self.absent_xattrs.lock().remove(&node.0);
                let before = self.before_change(node);
                let r = self.slow().call(cx, op)?;
                if let Some(before) = before {
                    if let Ok(a) = self.slow().getattr(&daemon(), node) {
                        self.kept_bytes(node.0, &before, &a);
                    }
                }
                Ok(r)
            }
            Op::Extended { node, name, args } => self.extended(cx, op, node, name, args),
            _ => self.slow().call(cx, op),
        }
    }

    fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake_keeper();
        *self.jobs.lock() = None;
        let threads: Vec<_> = self.threads.lock().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
        if self.cfg.mode == Mode::WriteBack {
            let (_, errors) = self.write_back_due(true);
            for e in &errors {
                tracing::error!("cache '{}': at unmount, not written back: {e}; it stays in the cache and is written back at the next mount", self.name);
            }
        }
        let _ = self.store.save();
        self.fast.stack.shutdown();
        self.slow.stack.shutdown();
    }
}

/// The layer as the stack holds it: the cache, shared with its threads, and the one that
/// passes the slow branch's change notices up with the copies dropped first.
struct CacheHandle(Arc<Cache>);

impl Layer for CacheHandle {
    fn name(&self) -> &str {
        &self.0.name
    }
    fn kind(&self) -> &'static str {
        "cache"
    }
    fn data_path(&self) -> DataPath {
        DataPath::Transparent
    }
    fn lower(&self) -> &[Level] {
        &[]
    }
    fn branches(&self) -> Vec<Branch> {
        vec![self.0.fast.clone(), self.0.slow.clone()]
    }
    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }
    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        self.0.call(cx, op)
    }
    fn shutdown(&self) {
        self.0.shutdown()
    }
    fn mount_note(&self) -> Option<String> {
        let c = &self.0;
        let dirty = c.store.index.lock().copies.values().filter(|c| c.dirty).count();
        Some(format!(
            "cache '{}': copies in {}, {}{}",
            c.name,
            c.store.root().display(),
            match c.cfg.mode {
                Mode::WriteThrough => "write-through".to_owned(),
                Mode::WriteBack => format!("write-back after {:?}", c.cfg.delay),
            },
            if dirty > 0 { format!("; {dirty} file(s) to write back from before") } else { String::new() }
        ))
    }
    fn set_invalidator(&self, inv: Arc<dyn Invalidator>) {
        *self.0.invalidator.lock() = Some(inv.clone());
        let wrapped: Arc<dyn Invalidator> = Arc::new(CacheInvalidator { inner: inv, cache: Arc::downgrade(&self.0) });
        self.0.slow().layer().set_invalidator(wrapped);
    }
}

fn build(args: FanOutArgs) -> Result<Arc<dyn Layer>> {
    let cache = Arc::new(Cache::new(args)?);
    cache.start();
    Ok(Arc::new(CacheHandle(cache)))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "cache",
    summary: "fan-out: a fast branch caching a slow one (whole copies served by passthrough), write-through or write-back, eviction, pins",
    params: PARAMS,
    ext_ops: EXT_OPS,
    build: Build::FanOut(build),
    absorbs: &[],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("7d"), Some(Duration::from_secs(7 * 86400)));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        for bad in ["", "5", "-1s", "1e300s", "NaNs", "5 weeks"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    /// The keeper's `try_lock` on a file whose open holds its lock: it gives up, without
    /// waiting and without freeing the holder's lock (it once did both: it hung the daemon).
    #[test]
    fn try_lock_of_a_busy_file_gives_up_and_leaves_it_locked() {
        let locks = Arc::new(OpenLocks::default());
        let lock = |key| OpenLock { locks: &locks, key };
        let held = lock(7).lock();
        let (tx, rx) = std::sync::mpsc::channel();
        let other = locks.clone();
        std::thread::spawn(move || {
            let tried = OpenLock { locks: &other, key: 7 }.try_lock().is_some();
            let still_busy = other.busy.lock().contains(&7);
            let _ = tx.send((tried, still_busy));
        });
        let Ok((tried, still_busy)) = rx.recv_timeout(Duration::from_secs(10)) else {
            // Its drop would wait on the hung thread's lock too.
            std::mem::forget(held);
            panic!("try_lock of a busy key hung");
        };
        assert!(!tried, "a busy key was locked twice");
        assert!(still_busy, "try_lock freed the holder's lock");
        assert!(lock(8).try_lock().is_some(), "another key is free");
        drop(held);
        assert!(lock(7).try_lock().is_some(), "free once its holder is done");
    }
}
