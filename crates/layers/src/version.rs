//! `version`: every overwritten or removed file keeps its previous content as a version
//! (Versionfs; the operation-transforming class of `seeds/002` §4.4).
//!
//! - **When.** Opening a file to write it (not to append), truncating it, removing it, and
//!   renaming another file over it each keep what it held. Removing and renaming over move the
//!   file into the store (no copy); the others copy it first, by `copy_file_range` when nothing
//!   below transforms data, so by reflink on XFS and btrfs. A version taken at an open that then
//!   changed nothing is dropped at release. Once the version is taken, writes may go by
//!   passthrough.
//! - **Where.** In the level below, under [`STORE`]: `STORE/PATH/@N` is version N of the file at
//!   PATH. The store is never listed, but its path works: `cat MNT/.plyfs-versions/docs/a.txt/@3`
//!   reads version 3 with ordinary tools. Nothing in it can be changed through the mount. Below
//!   a compressor or a cipher (`version,zstd`), versions are stored compressed or encrypted too.
//!   A number that went (a version dropped or pruned) is not given again by the mount: the
//!   kernel may still hold its name.
//! - **Pruning.** `keep=N` versions per file and `max_age=` per file, `max_space=` for the whole
//!   mount (oldest first), after every new version and on `version-prune`. Space is what the
//!   versions take on disk (a sparse file's holes take none). `keep` alone does not bound the
//!   store (fsstress grew one to 27 GiB over a 2 GiB tree, #29), so `max_space` defaults to a
//!   tenth of the file system below. The store's size is measured by a full prune and kept up
//!   to date as versions come and go, so a new version walks the store only when over the limit.
//! - **Operations.** `versions` (on a file), `version-restore N` (the current content becomes a
//!   version first, so a restore can be undone), `deleted` and `undelete NAME` (on a directory).

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use plyfs_stack::glob::parse_size;
use plyfs_stack::spec::ParamSpec;
use plyfs_stack::{
    bypass, Attr, Build, BuildArgs, Caller, DataPath, Entry, Error, ExtOpInfo, FileHandle, FileKind, Layer, LayerFactory, Level,
    NodeId, Op, Reply, Result, SetAttr,
};
use serde_json::{json, Value};

use crate::paths::PathTable;
use crate::transfer::{copy_data, copy_meta, copy_object, Data, TempNames};

/// The store's name at the root of the level below.
pub const STORE: &str = ".plyfs-versions";
/// Versions are `@1`, `@2`, ... in a file's store directory.
const VERSION_MARK: &str = "@";

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo { name: "versions", args: "", help: "the versions of a file: number, when saved, when last modified, size" },
    ExtOpInfo { name: "version-restore", args: "N", help: "make version N the file's content (what it held becomes a version first)" },
    ExtOpInfo { name: "deleted", args: "", help: "the files removed from a directory that have versions" },
    ExtOpInfo { name: "undelete", args: "NAME", help: "bring back a removed file of a directory, from its latest version" },
    ExtOpInfo { name: "version-prune", args: "", help: "apply keep=, max_age= and max_space= to every version now" },
];

const KEEP: ParamSpec = ParamSpec { name: "keep", help: "versions kept per file (0: no limit)", default: Some("20") };
const MAX_AGE: ParamSpec = ParamSpec { name: "max_age", help: "versions older than this go (e.g. 30d, 12h)", default: None };
const MAX_SPACE: ParamSpec = ParamSpec {
    name: "max_space",
    help: "space all versions may take on disk (e.g. 10G; 0: no limit); the oldest go first",
    default: Some("a tenth of the file system below"),
};
/// The share of the file system below that versions may take unless `max_space=` says.
const DEFAULT_SPACE_DIVISOR: u64 = 10;

fn daemon() -> Caller {
    Caller::daemon()
}

/// `30d`, `12h`, `90m`, `45s`.
fn parse_age(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| c.is_ascii_alphabetic())?;
    let n: f64 = text[..split].parse().ok()?;
    let unit = match &text[split..] {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        "w" => 7.0 * 86400.0,
        _ => return None,
    };
    (n >= 0.0).then(|| Duration::from_secs_f64(n * unit))
}

fn version_number(name: &OsStr) -> Option<u32> {
    name.to_str()?.strip_prefix(VERSION_MARK)?.parse().ok()
}

#[derive(Clone, Copy)]
struct Limits {
    keep: u32,
    max_age: Option<Duration>,
    max_space: Option<u64>,
}

/// One version, as found in the store.
#[derive(Clone, Debug)]
struct Saved {
    number: u32,
    attr: Attr,
}

/// A version taken when a file was opened for writing; dropped at release if nothing changed.
#[derive(Clone)]
struct Pending {
    path: String,
    number: u32,
    /// The space the version takes.
    space: u64,
    size: u64,
    mtime: SystemTime,
    /// Its release found the file unchanged and is dropping it: no open shares it, no truncate
    /// counts on it, no listing names it.
    dropping: bool,
}

impl Pending {
    /// The file (now `attr`) is still what the version holds.
    fn unchanged(&self, attr: &Attr) -> bool {
        attr.size == self.size && attr.mtime == self.mtime
    }
}

pub struct Version {
    name: String,
    lower: [Level; 1],
    limits: Limits,
    /// Where each node the kernel holds was last seen.
    paths: PathTable,
    /// Nodes inside the store, which nothing may change.
    store_nodes: Mutex<HashSet<NodeId>>,
    pending: Mutex<HashMap<(NodeId, FileHandle), Pending>>,
    /// Keys for the versions held by opens still under way, which have no handle yet, and by
    /// truncates under way that a pending version covers.
    opening: AtomicU64,
    /// Held by an open while it saves its version and makes it pending, and by `versions` while
    /// it reads what is pending and then the store: else a listing could find the version saved
    /// and not yet pending, and name it, and the release drop it (CI, issue #34). A listing may
    /// so wait for a copy in progress.
    taking: Mutex<()>,
    /// Versions are numbered and pruned one file at a time.
    saving: Mutex<()>,
    /// For each file whose newest version this mount may have removed (dropped at release, or
    /// pruned) and that has had no version since, the highest number removed: never given
    /// again. The kernel may still hold the name `@N`, for up to the entry timeout, as the
    /// removed version or as absent (a read of it after it went); a new version named so would
    /// read as that, and a listing naming it would give `ENOENT` (a CI failure, issue #34) or
    /// the removed version's content.
    retired: Mutex<HashMap<String, u32>>,
    temps: TempNames,
    /// The space the store takes, as far as this mount knows: measured by the last full prune,
    /// plus what was saved since, less what was pruned. `None` until first measured.
    store_space: Mutex<Option<u64>>,
    /// Which limits were not given, for the mount's note.
    defaults: Defaults,
}

#[derive(Clone, Copy)]
struct Defaults {
    keep: bool,
    max_space: bool,
}

/// The space a file takes on disk.
fn space_of(attr: &Attr) -> u64 {
    attr.blocks * 512
}

impl Version {
    fn below(&self) -> &Level {
        &self.lower[0]
    }

    fn in_store(&self, node: NodeId) -> bool {
        self.store_nodes.lock().contains(&node)
    }

    fn remember(&self, parent: NodeId, name: &OsStr, entry: &Entry) {
        self.paths.seen(parent, name, entry.node);
        if (parent == NodeId::ROOT && name == STORE) || self.in_store(parent) {
            self.store_nodes.lock().insert(entry.node);
        }
    }

    fn forget(&self, node: NodeId, nlookup: u64) {
        if self.paths.forget(node, nlookup) {
            self.store_nodes.lock().remove(&node);
        }
    }

    // --- The store ----------------------------------------------------------------------------

    /// Walk `path` in the store from its root; `create` makes missing directories. Returns the
    /// directory's node (with one lookup held, which the caller forgets).
    fn store_dir(&self, path: &str, create: bool) -> Result<Option<NodeId>> {
        let cx = daemon();
        let below = self.below();
        let mut at = NodeId::ROOT;
        let mut held: Option<NodeId> = None;
        for part in std::iter::once(STORE).chain(path.split('/').filter(|p| !p.is_empty())) {
            let name = OsStr::new(part);
            let next = match below.lookup(&cx, at, name) {
                Ok(e) if e.attr.kind == FileKind::Dir => e.node,
                Ok(e) => {
                    below.forget(&cx, e.node, 1);
                    return Err(Error::Corrupt(format!("version '{}': {STORE}/{path} is not a directory", self.name)));
                }
                Err(Error::Os(libc::ENOENT)) if create => match below.mkdir(&cx, at, name, 0o700) {
                    Ok(e) => e.node,
                    // Made meanwhile by another mount sharing the tree.
                    Err(Error::Os(libc::EEXIST)) => below.lookup(&cx, at, name)?.node,
                    Err(e) => return Err(e),
                },
                Err(Error::Os(libc::ENOENT)) => {
                    if let Some(h) = held {
                        below.forget(&cx, h, 1);
                    }
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            if let Some(h) = held.replace(next) {
                below.forget(&cx, h, 1);
            }
            at = next;
        }
        Ok(held)
    }

    /// The versions of the file at `path`, oldest first.
    fn list(&self, path: &str) -> Result<Vec<Saved>> {
        let Some(dir) = self.store_dir(path, false)? else { return Ok(Vec::new()) };
        let result = self.list_in(dir);
        self.below().forget(&daemon(), dir, 1);
        result
    }

    fn list_in(&self, dir: NodeId) -> Result<Vec<Saved>> {
        let cx = daemon();
        let mut out = Vec::new();
        for e in self.below().list_dir(&cx, dir)? {
            let Some(number) = version_number(&e.name) else { continue };
            let entry = match self.below().lookup(&cx, dir, &e.name) {
                Ok(entry) => entry,
                // Dropped since the listing (a release finding its file unchanged, pruning).
                Err(Error::Os(libc::ENOENT)) => continue,
                Err(e) => return Err(e),
            };
            self.below().forget(&cx, entry.node, 1);
            out.push(Saved { number, attr: entry.attr });
        }
        out.sort_by_key(|s| s.number);
        Ok(out)
    }

    /// Keep what `node` (the file `name` in `parent`) holds as its next version: moved there
    /// when `moving`, else copied. Returns the version's number.
    fn save(&self, parent: NodeId, name: &OsStr, node: NodeId, attr: &Attr, moving: bool) -> Result<u32> {
        let path = self.paths.child_path(parent, name).ok_or(Error::Os(libc::ESTALE))?;
        self.save_as(&path, (parent, name), node, attr, moving)
    }

    /// [`Self::save`] of the object at `from` as a version of the file at `path`, which may be
    /// another name (a rename over a file exchanges the two first).
    fn save_as(&self, path: &str, (parent, name): (NodeId, &OsStr), node: NodeId, attr: &Attr, moving: bool) -> Result<u32> {
        let path = path.to_owned();
        let _one = self.saving.lock();
        let dir = self.store_dir(&path, true)?.ok_or(Error::Os(libc::EIO))?;
        let result = (|| {
            let below = self.below();
            // The next number, never taking one that exists: another mount sharing the tree
            // (`-o shared`) may save a version of the same file at the same time. Nor one this
            // mount has removed.
            let retired = self.retired.lock().get(&path).copied().unwrap_or(0);
            let mut number = self.list_in(dir)?.last().map_or(0, |s| s.number).max(retired) + 1;
            loop {
                let vname = OsString::from(format!("{VERSION_MARK}{number}"));
                let placed = if moving {
                    self.temps.rename_new(below, (parent, name), (dir, &vname), node, FileKind::File)
                } else {
                    let copy = self.temps.place_new(below, dir, &vname, |temp| {
                        let e = copy_object(below, node, attr, below, dir, temp, Data::Durable)?;
                        copy_meta(below, node, below, e.node, attr, |_| true)?;
                        Ok(e)
                    });
                    copy.map(|c| below.forget(&daemon(), c.node, 1))
                };
                match placed {
                    Err(Error::Os(libc::EEXIST)) => number += 1,
                    other => break other?,
                }
            }
            // A higher number is in the store now: the listing gives the next.
            self.retired.lock().remove(&path);
            // A copy keeps the holes, so it takes what the file does.
            self.stored(space_of(attr) as i64);
            self.prune_dir(dir, &path)?;
            Ok(number)
        })();
        self.below().forget(&daemon(), dir, 1);
        if let Err(e) = &result {
            tracing::error!("version '{}': {path}: the previous content could not be kept: {e}", self.name);
        }
        result
    }

    /// Drop version `number` of `path` (a version that turned out to hold nothing new).
    fn drop_version(&self, path: &str, number: u32, space: u64) {
        let _one = self.saving.lock();
        if let Ok(Some(dir)) = self.store_dir(path, false) {
            if self.below().unlink(&daemon(), dir, OsStr::new(&format!("{VERSION_MARK}{number}"))).is_ok() {
                self.stored(-(space as i64));
                self.retire(path, number);
            }
            self.below().forget(&daemon(), dir, 1);
        }
    }

    /// Never give `number` to another version of `path` (see `retired`): it was removed, and
    /// may have been the newest.
    fn retire(&self, path: &str, number: u32) {
        let mut retired = self.retired.lock();
        let highest = retired.entry(path.to_owned()).or_default();
        *highest = (*highest).max(number);
    }

    /// Apply `keep` and `max_age` to one file's versions.
    fn prune_dir(&self, dir: NodeId, path: &str) -> Result<u64> {
        let versions = self.list_in(dir)?;
        let now = SystemTime::now();
        let excess = if self.limits.keep == 0 { 0 } else { versions.len().saturating_sub(self.limits.keep as usize) };
        let mut freed = 0;
        for (i, v) in versions.iter().enumerate() {
            let too_old = self.limits.max_age.is_some_and(|age| now.duration_since(v.attr.ctime).unwrap_or_default() > age);
            if i < excess || too_old {
                self.below().unlink(&daemon(), dir, OsStr::new(&format!("{VERSION_MARK}{}", v.number)))?;
                self.stored(-(space_of(&v.attr) as i64));
                if i + 1 == versions.len() {
                    self.retire(path, v.number);
                }
                freed += space_of(&v.attr);
                tracing::debug!("version '{}': {path}: version {} pruned", self.name, v.number);
            }
        }
        Ok(freed)
    }

    /// Every version in the store: (saved, path, number, space taken).
    fn all_versions(&self) -> Result<Vec<(SystemTime, String, u32, u64)>> {
        fn walk(v: &Version, dir: NodeId, path: &str, out: &mut Vec<(SystemTime, String, u32, u64)>) -> Result<()> {
            let cx = daemon();
            for e in v.below().list_dir(&cx, dir)? {
                if let Some(number) = version_number(&e.name) {
                    let entry = v.below().lookup(&cx, dir, &e.name)?;
                    v.below().forget(&cx, entry.node, 1);
                    out.push((entry.attr.ctime, path.to_owned(), number, space_of(&entry.attr)));
                } else if e.kind == FileKind::Dir {
                    let sub = v.below().lookup(&cx, dir, &e.name)?;
                    let child = if path.is_empty() {
                        e.name.to_string_lossy().into_owned()
                    } else {
                        format!("{path}/{}", e.name.to_string_lossy())
                    };
                    let r = walk(v, sub.node, &child, out);
                    v.below().forget(&cx, sub.node, 1);
                    r?;
                }
            }
            Ok(())
        }
        let mut out = Vec::new();
        if let Some(root) = self.store_dir("", false)? {
            let r = walk(self, root, "", &mut out);
            self.below().forget(&daemon(), root, 1);
            r?;
        }
        out.sort();
        Ok(out)
    }

    /// Apply every limit to the whole store.
    fn prune_all(&self) -> Result<Value> {
        let _one = self.saving.lock();
        let mut versions = self.all_versions()?;
        let (mut removed, mut freed) = (0u64, 0u64);
        let mut paths: Vec<String> = versions.iter().map(|v| v.1.clone()).collect();
        paths.dedup();
        paths.sort();
        paths.dedup();
        for p in &paths {
            if let Some(dir) = self.store_dir(p, false)? {
                let before = self.list_in(dir)?.len();
                freed += self.prune_dir(dir, p)?;
                removed += (before - self.list_in(dir)?.len()) as u64;
                self.below().forget(&daemon(), dir, 1);
            }
        }
        if let Some(max) = self.limits.max_space {
            versions = self.all_versions()?;
            let mut total: u64 = versions.iter().map(|v| v.3).sum();
            for (_, path, number, size) in versions {
                if total <= max {
                    break;
                }
                if let Some(dir) = self.store_dir(&path, false)? {
                    self.below().unlink(&daemon(), dir, OsStr::new(&format!("{VERSION_MARK}{number}")))?;
                    self.below().forget(&daemon(), dir, 1);
                    self.retire(&path, number);
                    total -= size;
                    freed += size;
                    removed += 1;
                }
            }
            *self.store_space.lock() = Some(total);
        }
        Ok(json!({ "removed": removed, "bytes_freed": freed }))
    }

    /// Whether the store may be over `max_space`: then [`Self::prune_all`] measures and prunes.
    fn over_space(&self) -> bool {
        self.limits.max_space.is_some_and(|max| self.store_space.lock().is_none_or(|space| space > max))
    }

    /// Apply `max_space` if the store may be over it. A failure is logged, not returned: the
    /// operation that made the version has happened (a file opened, or moved into the store).
    fn prune_if_over(&self) {
        if self.over_space() {
            if let Err(e) = self.prune_all() {
                tracing::error!("version '{}': {STORE}: pruning the store to max_space: {e}", self.name);
            }
        }
    }

    /// Count `change` bytes more (or fewer) in the store, once it has been measured.
    fn stored(&self, change: i64) {
        if let Some(space) = self.store_space.lock().as_mut() {
            *space = space.saturating_add_signed(change);
        }
    }

    // --- Events ---------------------------------------------------------------------------------

    /// The file `name` in `parent`, if its going (unlink, or a rename over it) keeps a version:
    /// a regular file with no other link, and something in it.
    fn to_keep(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Option<Entry> {
        let e = self.below().lookup(cx, parent, name).ok()?;
        self.below().forget(cx, e.node, 1);
        // Another link keeps the data; an empty file has nothing to keep.
        let keep = e.attr.kind == FileKind::File && e.attr.nlink == 1 && e.attr.size > 0 && self.paths.path_of(parent).is_some();
        keep.then_some(e)
    }

    /// Before `name` in `parent` goes (unlink, or a rename over it): move a regular file with no
    /// other link into the store instead. Returns whether it was moved.
    fn keep_removed(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Result<bool> {
        let Some(e) = self.to_keep(cx, parent, name) else { return Ok(false) };
        self.save(parent, name, e.node, &e.attr, true)?;
        self.prune_if_over();
        Ok(true)
    }

    /// A rename of the file `from` over the file `to` that keeps what `to` held, without `to`'s
    /// name ever missing (as `rename(2)` promises): the two are exchanged, then what `to` held
    /// is moved into the store from `from`'s name. Returns whether it was done; when the level
    /// below cannot exchange, `false`, and the caller moves `to` into the store and renames.
    /// (A crash between the two steps leaves what `to` held under `from`'s name, not lost.)
    fn rename_over_keeping(&self, cx: &Caller, from: (NodeId, &OsStr), to: (NodeId, &OsStr)) -> Result<bool> {
        let Some(target) = self.to_keep(cx, to.0, to.1) else { return Ok(false) };
        let path = self.paths.child_path(to.0, to.1).ok_or(Error::Os(libc::ESTALE))?;
        let exchange = Op::Rename { parent: from.0, name: from.1, new_parent: to.0, new_name: to.1, flags: libc::RENAME_EXCHANGE };
        match self.below().call(cx, &exchange) {
            Ok(_) => {}
            Err(Error::Os(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) => return Ok(false),
            Err(e) => return Err(e),
        }
        if let Err(e) = self.save_as(&path, from, target.node, &target.attr, true) {
            // Undone: the rename fails as a whole.
            let _ = self.below().call(cx, &exchange);
            return Err(e);
        }
        self.prune_if_over();
        Ok(true)
    }

    fn open(&self, cx: &Caller, node: NodeId, flags: i32) -> Result<Reply> {
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
        if writes && self.in_store(node) {
            return Err(Error::Os(libc::EROFS));
        }
        let keep = writes && flags & libc::O_APPEND == 0;
        let before = if keep { Some(self.below().getattr(cx, node)?) } else { None };
        let seen = self.paths.parent_of(node);
        // The version is pending under this key until the open has its handle.
        let opening = (node, FileHandle(u64::MAX - self.opening.fetch_add(1, Ordering::Relaxed)));
        let taken = match (before, seen) {
            (Some(attr), Some((parent, name))) if attr.kind == FileKind::File && attr.size > 0 => {
                let path = self.paths.child_path(parent, &name).unwrap_or_default();
                // An open not yet released whose version is the file as it is now shares it
                // with this one. Another would be a copy, and kept too: that open's release may
                // come after this open has changed the file (the kernel sends it after close
                // returns), and find the file changed.
                // Only an open of this file: another now at its path (the file renamed away or
                // removed, another put there) may look the same, and hold other content.
                let shared = {
                    let mut pending = self.pending.lock();
                    let same = pending
                        .iter()
                        .find(|((n, _), p)| *n == node && !p.dropping && p.path == path && p.unchanged(&attr))
                        .map(|(_, p)| p.clone());
                    same.map(|p| pending.insert(opening, p)).is_some()
                };
                if !shared {
                    let _taking = self.taking.lock();
                    let number = self.save(parent, &name, node, &attr, false)?;
                    let p = Pending { path, number, space: space_of(&attr), size: attr.size, mtime: attr.mtime, dropping: false };
                    self.pending.lock().insert(opening, p);
                }
                true
            }
            _ => false,
        };
        let reply = self.below().call(cx, &Op::Open { node, flags });
        if taken {
            let mut pending = self.pending.lock();
            let p = pending.remove(&opening);
            // Dropped at release if the file is then what it was (never, once truncated).
            if let (Ok(Reply::Opened(o)), Some(p), 0) = (&reply, p, flags & libc::O_TRUNC) {
                pending.insert((node, o.fh), p);
            }
        }
        self.prune_if_over();
        reply
    }

    fn release(&self, cx: &Caller, op: &Op<'_>, node: NodeId, fh: FileHandle) -> Result<Reply> {
        let reply = bypass(self, cx, op);
        // Decided under the lock, done outside it (dropping a version waits for any save in
        // progress, which may copy a large file): the version stays pending, marked, until it is
        // dropped, so no open shares it, no truncate counts on it and `versions` never names it
        // meanwhile. The file is compared under the lock too, so that the mark means the version
        // goes: a listing must hide it whatever the file holds by then, as a later open may have
        // changed it already (a listing that hid only versions of an unchanged file named one
        // about to go: a CI failure, issue #34).
        let to_drop = {
            let mut pending = self.pending.lock();
            let shared = pending.get(&(node, fh)).is_some_and(|p| {
                pending.iter().any(|(key, q)| *key != (node, fh) && q.path == p.path && q.number == p.number)
            });
            match pending.get_mut(&(node, fh)) {
                Some(p) if !shared && self.below().getattr(&daemon(), node).is_ok_and(|a| p.unchanged(&a)) => {
                    p.dropping = true;
                    Some(p.clone())
                }
                Some(_) => {
                    pending.remove(&(node, fh));
                    None
                }
                None => None,
            }
        };
        if let Some(p) = to_drop {
            self.drop_version(&p.path, p.number, p.space);
            self.pending.lock().remove(&(node, fh));
        }
        reply
    }

    fn set_attr(&self, cx: &Caller, op: &Op<'_>, node: NodeId, set: &SetAttr) -> Result<Reply> {
        if self.in_store(node) {
            return Err(Error::Os(libc::EROFS));
        }
        if let Some(size) = set.size {
            let attr = self.below().getattr(cx, node)?;
            // A version taken at an open of the file that has changed nothing since holds what
            // the file holds now, and covers this truncate (the kernel truncates for O_TRUNC
            // after the open, without naming the handle). One whose file changed since does not:
            // its release may simply not have come yet (the kernel sends it after close returns).
            // The version that covers it is held under a key of this truncate's until it is
            // done, as an open holds one it shares: a release of that open meanwhile, finding
            // the file not yet truncated, would drop it.
            let held = (node, FileHandle(u64::MAX - self.opening.fetch_add(1, Ordering::Relaxed)));
            let covered = {
                let mut pending = self.pending.lock();
                let cover = pending.iter().find(|((n, _), p)| *n == node && !p.dropping && p.unchanged(&attr)).map(|(_, p)| p.clone());
                cover.map(|p| pending.insert(held, p)).is_some()
            };
            let parent = self.paths.parent_of(node);
            if covered {
                let reply = bypass(self, cx, op);
                self.pending.lock().remove(&held);
                return reply;
            }
            if attr.kind == FileKind::File && attr.size > 0 && size != attr.size {
                if let Some((parent, name)) = parent {
                    self.save(parent, &name, node, &attr, false)?;
                }
            }
        }
        bypass(self, cx, op)
    }

    // --- Operations -------------------------------------------------------------------------------

    fn file_path(&self, node: NodeId) -> Result<String> {
        if self.in_store(node) {
            return Err(Error::BadArgs("this is a version already; name the file it belongs to".into()));
        }
        self.paths.path_of(node).ok_or(Error::Os(libc::ESTALE))
    }

    fn versions(&self, node: NodeId) -> Result<Value> {
        let path = self.file_path(node)?;
        // A version taken at an open that has changed nothing yet is the file as it is, and goes
        // at release; not shown, so a listing right after a close (whose release the kernel
        // sends later) does not name a version about to vanish. Nor one its release is
        // dropping, whatever the file holds now (a later open may have changed it already).
        // Found by their path, not by `node`: the versions listed are the path's, and the file
        // opened may be another than `node` (renamed over it since it was looked up).
        // Each file is compared under the lock, as a release compares it, so that no release
        // decides in between.
        let _taking = self.taking.lock();
        let hidden: HashSet<u32> = self
            .pending
            .lock()
            .iter()
            .filter(|((n, _), p)| p.path == path && (p.dropping || self.below().getattr(&daemon(), *n).is_ok_and(|a| p.unchanged(&a))))
            .map(|(_, p)| p.number)
            .collect();
        let list: Vec<Value> = self
            .list(&path)?
            .into_iter()
            .filter(|s| !hidden.contains(&s.number))
            .map(|s| {
                let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
                json!({ "number": s.number, "saved": secs(s.attr.ctime), "modified": secs(s.attr.mtime), "size": s.attr.size,
                        "path": format!("{STORE}/{path}/{VERSION_MARK}{}", s.number) })
            })
            .collect();
        Ok(Value::Array(list))
    }

    fn restore(&self, cx: &Caller, node: NodeId, args: &[String]) -> Result<Value> {
        let [n] = args else { return Err(Error::BadArgs("usage: version-restore N".into())) };
        let path = self.file_path(node)?;
        let number: u32 = n.parse().map_err(|_| Error::BadArgs(format!("version-restore: '{n}' is not a version number")))?;
        let versions = self.list(&path)?;
        if !versions.iter().any(|v| v.number == number) {
            let have = match (versions.first(), versions.last()) {
                (Some(a), Some(b)) => format!("it has versions {} to {}", a.number, b.number),
                _ => "it has none".into(),
            };
            return Err(Error::BadArgs(format!("{path}: no version {number} ({have})")));
        }
        let attr = self.below().getattr(cx, node)?;
        if attr.kind != FileKind::File {
            return Err(Error::BadArgs(format!("{path}: not a regular file")));
        }
        let (parent, name) = self.paths.parent_of(node).ok_or(Error::Os(libc::ESTALE))?;
        let kept = self.save(parent, &name, node, &attr, false)?;
        let dir = self.store_dir(&path, false)?.ok_or(Error::Os(libc::EIO))?;
        let result = (|| {
            let below = self.below();
            let v = below.lookup(&daemon(), dir, OsStr::new(&format!("{VERSION_MARK}{number}")))?;
            let opened = below.open(&daemon(), node, libc::O_WRONLY | libc::O_TRUNC);
            let copied = opened.and_then(|o| {
                let r = copy_data(below, v.node, below, node, &o, v.attr.size);
                let _ = below.release(&daemon(), node, o.fh);
                r
            });
            below.forget(&daemon(), v.node, 1);
            copied
        })();
        self.below().forget(&daemon(), dir, 1);
        result?;
        tracing::info!("version '{}': {path}: version {number} restored (what it held is version {kept})", self.name);
        Ok(json!({ "restored": number, "previous_content_is_version": kept }))
    }

    fn deleted(&self, cx: &Caller, dir: NodeId) -> Result<Value> {
        let path = self.file_path(dir)?;
        let Some(store) = self.store_dir(&path, false)? else { return Ok(Value::Array(Vec::new())) };
        let result = (|| {
            let mut out = Vec::new();
            for e in self.below().list_dir(&daemon(), store)? {
                if e.kind != FileKind::Dir || version_number(&e.name).is_some() {
                    continue;
                }
                match self.below().lookup(cx, dir, &e.name) {
                    Ok(live) => {
                        self.below().forget(cx, live.node, 1);
                        continue;
                    }
                    Err(Error::Os(libc::ENOENT)) => {}
                    Err(err) => return Err(err),
                }
                let sub = self.below().lookup(&daemon(), store, &e.name)?;
                let versions = self.list_in(sub.node);
                self.below().forget(&daemon(), sub.node, 1);
                let versions = versions?;
                if let Some(last) = versions.last() {
                    out.push(json!({ "name": e.name.to_string_lossy(), "versions": versions.len(), "latest": last.number, "size": last.attr.size }));
                }
            }
            Ok(Value::Array(out))
        })();
        self.below().forget(&daemon(), store, 1);
        result
    }

    fn undelete(&self, cx: &Caller, dir: NodeId, args: &[String]) -> Result<Value> {
        let [name] = args else { return Err(Error::BadArgs("usage: undelete NAME".into())) };
        self.file_path(dir)?;
        let name = OsStr::new(name.as_str());
        let path = self.paths.child_path(dir, name).ok_or(Error::Os(libc::ESTALE))?;
        if let Ok(live) = self.below().lookup(cx, dir, name) {
            self.below().forget(cx, live.node, 1);
            return Err(Error::BadArgs(format!("{path} exists: remove or rename it first")));
        }
        let latest = self.list(&path)?.pop().ok_or_else(|| Error::BadArgs(format!("{path}: no versions to bring back")))?;
        let store = self.store_dir(&path, false)?.ok_or(Error::Os(libc::EIO))?;
        let result = (|| {
            let below = self.below();
            let v = below.lookup(&daemon(), store, OsStr::new(&format!("{VERSION_MARK}{}", latest.number)))?;
            // Never over a file of that name made meanwhile (by another mount, say).
            let made = self.temps.place_new(below, dir, name, |temp| {
                let e = copy_object(below, v.node, &v.attr, below, dir, temp, Data::Durable)?;
                copy_meta(below, v.node, below, e.node, &v.attr, |_| true)?;
                Ok(e)
            });
            below.forget(&daemon(), v.node, 1);
            let made = made?;
            below.forget(&daemon(), made.node, 1);
            Ok(json!({ "undeleted": path, "from_version": latest.number }))
        })();
        self.below().forget(&daemon(), store, 1);
        result
    }
}

impl Layer for Version {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "version"
    }

    fn mount_note(&self) -> Option<String> {
        let default = |yes: bool| if yes { " (the default)" } else { "" };
        let count = match self.limits.keep {
            0 => "every version of each file".to_owned(),
            keep => format!("{keep} versions per file"),
        };
        let space = self.limits.max_space.map_or("no limit on their space".to_owned(), |max| format!("at most {} MiB of them in all", max >> 20));
        Some(format!(
            "version '{}' keeps {count}{}, {space}{} (keep=, max_space=)",
            self.name,
            default(self.defaults.keep),
            default(self.defaults.max_space)
        ))
    }

    fn data_path(&self) -> DataPath {
        // Versions are taken at open, truncate and removal; the bytes pass untouched.
        DataPath::Transparent
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let store_name = |parent: NodeId, name: &OsStr| parent == NodeId::ROOT && name == STORE;
        match *op {
            Op::Lookup { parent, name } => {
                let reply = bypass(self, cx, op)?;
                if let Reply::Entry(e) = &reply {
                    self.remember(parent, name, e);
                }
                Ok(reply)
            }
            Op::Forget { node, nlookup } => {
                self.forget(node, nlookup);
                bypass(self, cx, op)
            }
            Op::Create { parent, name, .. }
            | Op::MkDir { parent, name, .. }
            | Op::MkNod { parent, name, .. }
            | Op::SymLink { parent, name, .. } => {
                if store_name(parent, name) || self.in_store(parent) {
                    return Err(Error::Os(if self.in_store(parent) { libc::EROFS } else { libc::EPERM }));
                }
                let reply = bypass(self, cx, op)?;
                if let Reply::Entry(e) | Reply::Created(e, _) = &reply {
                    self.remember(parent, name, e);
                }
                Ok(reply)
            }
            Op::Link { node, new_parent, new_name } => {
                if store_name(new_parent, new_name) || self.in_store(new_parent) || self.in_store(node) {
                    return Err(Error::Os(libc::EROFS));
                }
                let reply = bypass(self, cx, op)?;
                if let Reply::Entry(e) = &reply {
                    self.remember(new_parent, new_name, e);
                }
                Ok(reply)
            }
            Op::Unlink { parent, name } => {
                if store_name(parent, name) || self.in_store(parent) {
                    return Err(Error::Os(libc::EROFS));
                }
                if self.keep_removed(cx, parent, name)? {
                    return Ok(Reply::Empty);
                }
                bypass(self, cx, op)
            }
            Op::RmDir { parent, name } => {
                if store_name(parent, name) || self.in_store(parent) {
                    return Err(Error::Os(libc::EROFS));
                }
                bypass(self, cx, op)
            }
            Op::Rename { parent, name, new_parent, new_name, flags } => {
                if store_name(parent, name) || store_name(new_parent, new_name) || self.in_store(parent) || self.in_store(new_parent) {
                    return Err(Error::Os(libc::EROFS));
                }
                let mut renamed = false;
                if flags & (libc::RENAME_EXCHANGE | libc::RENAME_NOREPLACE) == 0 {
                    // What the target held is kept.
                    let src = self.below().lookup(cx, parent, name)?;
                    self.below().forget(cx, src.node, 1);
                    let same = self.below().lookup(cx, new_parent, new_name).map(|d| {
                        self.below().forget(cx, d.node, 1);
                        d.node == src.node
                    });
                    if src.attr.kind == FileKind::File && matches!(same, Ok(false)) {
                        renamed = self.rename_over_keeping(cx, (parent, name), (new_parent, new_name))?;
                        if !renamed {
                            // Moved into the store; the rename then lands on a free name.
                            self.keep_removed(cx, new_parent, new_name)?;
                        }
                    }
                }
                let reply = if renamed { Reply::Empty } else { bypass(self, cx, op)? };
                if let Ok(e) = self.below().lookup(&daemon(), new_parent, new_name) {
                    self.below().forget(&daemon(), e.node, 1);
                    self.paths.moved(e.node, new_parent, new_name);
                }
                Ok(reply)
            }
            Op::Open { node, flags } => self.open(cx, node, flags),
            Op::Release { node, fh } => self.release(cx, op, node, fh),
            Op::SetAttr { node, ref set, .. } => self.set_attr(cx, op, node, set),
            Op::SetXattr { node, .. } | Op::RemoveXattr { node, .. } if self.in_store(node) => Err(Error::Os(libc::EROFS)),
            Op::ReadDir { node: NodeId::ROOT, .. } => match bypass(self, cx, op)? {
                Reply::Dir(mut entries) => {
                    entries.retain(|e| {
                        let hide = e.name == STORE;
                        if let (true, Some(entry)) = (hide, &e.entry) {
                            self.below().forget(&daemon(), entry.node, 1);
                        }
                        !hide
                    });
                    for e in &entries {
                        if let Some(entry) = &e.entry {
                            self.remember(NodeId::ROOT, &e.name, entry);
                        }
                    }
                    Ok(Reply::Dir(entries))
                }
                other => Ok(other),
            },
            Op::ReadDir { node, plus: true, .. } => {
                let reply = bypass(self, cx, op)?;
                if let Reply::Dir(entries) = &reply {
                    for e in entries {
                        if let Some(entry) = &e.entry {
                            self.remember(node, &e.name, entry);
                        }
                    }
                }
                Ok(reply)
            }
            Op::Extended { node, name: "versions", .. } => self.versions(node).map(Reply::Extended),
            Op::Extended { node, name: "version-restore", args } => self.restore(cx, node, args).map(Reply::Extended),
            Op::Extended { node, name: "deleted", .. } => self.deleted(cx, node).map(Reply::Extended),
            Op::Extended { node, name: "undelete", args } => self.undelete(cx, node, args).map(Reply::Extended),
            Op::Extended { name: "version-prune", .. } => self.prune_all().map(Reply::Extended),
            _ => bypass(self, cx, op),
        }
    }
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let keep = args.params.int_in(KEEP.name, 20, 0..=1_000_000)? as u32;
    let max_age = match args.params.get(MAX_AGE.name) {
        None => None,
        Some(v) => Some(parse_age(v).ok_or_else(|| args.params.bad(MAX_AGE.name, v, "expected an age such as 30d, 12h or 90m"))?),
    };
    let max_space = match args.params.get(MAX_SPACE.name) {
        None => default_max_space(&args.lower),
        Some(v) => Some(parse_size(v).ok_or_else(|| args.params.bad(MAX_SPACE.name, v, "expected a size such as 10G"))?).filter(|&max| max > 0),
    };
    let defaults = Defaults { keep: args.params.get(KEEP.name).is_none(), max_space: args.params.get(MAX_SPACE.name).is_none() };
    Ok(Arc::new(Version {
        name: args.name,
        lower: [args.lower],
        limits: Limits { keep, max_age, max_space },
        paths: PathTable::new(),
        store_nodes: Mutex::new(HashSet::new()),
        pending: Mutex::new(HashMap::new()),
        opening: AtomicU64::new(0),
        taking: Mutex::new(()),
        saving: Mutex::new(()),
        retired: Mutex::new(HashMap::new()),
        temps: TempNames::new(".plyfs-version-copy."),
        store_space: Mutex::new(None),
        defaults,
    }))
}

/// `max_space` unless given: a tenth of the file system below, so versions can never fill it.
fn default_max_space(lower: &Level) -> Option<u64> {
    match lower.call(&daemon(), &Op::StatFs { node: NodeId::ROOT }) {
        Ok(Reply::StatFs(fs)) => {
            let unit = if fs.frsize > 0 { fs.frsize } else { fs.bsize };
            Some(fs.blocks * u64::from(unit) / DEFAULT_SPACE_DIVISOR).filter(|&max| max > 0)
        }
        _ => None,
    }
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "version",
    summary:
        "keeps what files held before they were overwritten, truncated or removed, as versions to list, read, restore and undelete",
    params: &[KEEP, MAX_AGE, MAX_SPACE],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_and_version_names() {
        assert_eq!(parse_age("30d"), Some(Duration::from_secs(30 * 86400)));
        assert_eq!(parse_age("1.5h"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_age("soon"), None);
        assert_eq!(parse_age("3y"), None);
        assert_eq!(version_number(OsStr::new("@12")), Some(12));
        assert_eq!(version_number(OsStr::new("12")), None);
        assert_eq!(version_number(OsStr::new("@x")), None);
    }
}
