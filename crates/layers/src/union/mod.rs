//! `union`: several branches seen as one tree (Unionfs and overlayfs semantics, `seeds/002`
//! §4.5), each branch a stack of its own.
//!
//! - **Lookup** finds a name on the highest-priority branch holding it. A directory merges every
//!   branch holding it, down to the first *opaque* one.
//! - **The first branch takes every change** when it is read-write (the *upper* branch). An object
//!   on a lower branch is *copied up* to it before it changes: data, mode, owner, times and
//!   extended attributes, under a temporary name renamed into place, so a crash leaves the
//!   original visible and no partial file. Writes and attribute changes to a file on a lower
//!   read-write branch happen in place; removing it removes it there.
//! - **Whiteouts** hide names of lower branches: a symbolic link to [`WHITEOUT_TARGET`]. An opaque
//!   directory ([`OPAQUE_XATTR`]) hides the directories of the same name below it.
//! - **Inode numbers** come from where an object originated (see [`nodes`]), so they are unique
//!   across branches and stay the same through a copy-up and across remounts.
//! - **Renaming a directory** that lower branches also hold fails with `EXDEV`, as in overlayfs
//!   without `redirect_dir`: `mv` then copies it.
//!
//! A branch is marked ([`MARK_XATTR`] on its root) once the union writes whiteouts, origins or
//! opaque flags in it; until then none of them is looked for there, so a plain branch costs no
//! extra system call.

mod copyup;
mod dir;

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use plyfs_stack::spec::{BranchMode, BranchSpec};
use plyfs_stack::{
    Branch, BranchBuilder, Build, Caller, DataPath, Entry, Error, ExtOpInfo, FanOutArgs, FileHandle, FileKind, Layer, LayerFactory,
    Level, NodeId, Op, Opened, Reply, Result, XattrReply,
};
use serde_json::{json, Value};

use crate::ids::{NodeTable, Place, MAX_BRANCH_NUMBERS};
use crate::transfer::TempNames;

/// Records where a copied-up object came from: its union inode number.
pub const ORIGIN_XATTR: &str = "user.plyfs.union.origin";
/// Marks a directory that hides the directories of the same name on lower branches.
pub const OPAQUE_XATTR: &str = "user.plyfs.union.opaque";
/// On a branch's root once the union has written whiteouts, origins or opaque flags in it.
pub const MARK_XATTR: &str = "user.plyfs.union";
/// Every attribute the union keeps for itself starts so; none is shown through the mount.
const XATTR_PREFIX: &[u8] = b"user.plyfs.union";
/// The target of a whiteout symlink. A user symlink to exactly this is refused.
pub const WHITEOUT_TARGET: &str = "(plyfs union whiteout)";
/// Names of copies in progress; never shown, removed when found left over by a crash.
pub const TEMP_PREFIX: &str = ".plyfs-union.";

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo { name: "branch-list", args: "", help: "the branches in priority order: name, directory, mode, open files" },
    ExtOpInfo {
        name: "branch-add",
        args: "PATH [ro|rw] [POSITION]",
        help: "add a directory as a branch (default rw, lowest priority; POSITION 0 is the top)",
    },
    ExtOpInfo {
        name: "branch-remove",
        args: "NAME",
        help: "remove a branch (refused while files on it are open, or if it is the last)",
    },
];

/// One branch as the union keeps it.
struct BranchState {
    branch: Branch,
    /// Stable for the life of the mount; part of inode numbers.
    number: u32,
    /// The union has written (or found) whiteouts, origins or opaque flags here.
    marked: AtomicBool,
    /// Files and directories open on it.
    opens: AtomicU64,
}

impl BranchState {
    fn top(&self) -> &Level {
        self.branch.top()
    }

    fn writable(&self) -> bool {
        self.branch.writable()
    }
}

/// One object the kernel knows.
struct UNode {
    kind: FileKind,
    /// Lookups the layer above holds.
    lookups: u64,
    /// Where the object is, top priority first. A file, link or special file has one place; a
    /// directory has one per branch holding it, down to the first opaque one. The union holds
    /// one lookup on each place.
    places: Vec<Place>,
    /// The directory and name it was last seen under (the root has none): the path a copy-up
    /// recreates on the upper branch.
    parent: Option<(u64, OsString)>,
}

impl crate::ids::Named for UNode {
    fn seen_as(&self) -> Option<&(u64, OsString)> {
        self.parent.as_ref()
    }
}

#[derive(Clone, Copy)]
struct OpenFile {
    place: Place,
    fh: FileHandle,
}

/// A name found on the branches: where it is (top first, one lookup held on each) and what
/// the top one is.
struct Found {
    places: Vec<Place>,
    entry: Entry,
}

pub struct Union {
    name: String,
    branches: RwLock<Vec<Arc<BranchState>>>,
    builder: Arc<dyn BranchBuilder>,
    next_number: AtomicU32,
    nodes: Mutex<NodeTable<UNode>>,
    files: Mutex<HashMap<u64, OpenFile>>,
    dirs: Mutex<HashMap<u64, Arc<Mutex<dir::Listing>>>>,
    next_fh: AtomicU64,
    /// One copy-up at a time: two writers of one lower file must not copy it twice.
    copy_up: Mutex<()>,
    /// Names of copies in progress; others found are left over from a crash.
    temps: TempNames,
}

fn daemon() -> Caller {
    Caller::daemon()
}

fn is_temp(name: &OsStr) -> bool {
    name.as_bytes().starts_with(TEMP_PREFIX.as_bytes())
}

fn is_hidden_xattr(name: &OsStr) -> bool {
    name.as_bytes().starts_with(XATTR_PREFIX)
}

fn enoent() -> Error {
    Error::Os(libc::ENOENT)
}

impl Union {
    fn new(args: FanOutArgs) -> Result<Union> {
        if args.branches.len() > MAX_BRANCH_NUMBERS as usize {
            return Err(Error::config(format!("union '{}': at most {MAX_BRANCH_NUMBERS} branches", args.name)));
        }
        let branches: Vec<Arc<BranchState>> =
            args.branches.into_iter().enumerate().map(|(i, branch)| Arc::new(BranchState::found(branch, i as u32))).collect();
        let union = Union {
            name: args.name,
            next_number: AtomicU32::new(branches.len() as u32),
            branches: RwLock::new(branches),
            builder: args.builder,
            nodes: Mutex::new(NodeTable::new()),
            files: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            copy_up: Mutex::new(()),
            temps: TempNames::new(TEMP_PREFIX),
        };
        union.reset_root();
        Ok(union)
    }

    /// The root merges every branch's root (which the branches never forget).
    fn reset_root(&self) {
        let places = self.snapshot().iter().map(|b| Place { branch: b.number, node: NodeId::ROOT }).collect();
        let root = UNode { kind: FileKind::Dir, lookups: u64::MAX / 2, places, parent: None };
        self.nodes.lock().nodes.insert(NodeId::ROOT.0, root);
    }

    fn snapshot(&self) -> Vec<Arc<BranchState>> {
        self.branches.read().clone()
    }

    fn branch(&self, number: u32) -> Result<Arc<BranchState>> {
        self.branches.read().iter().find(|b| b.number == number).cloned().ok_or(Error::Os(libc::ESTALE))
    }

    /// The branch that takes every change: the first, when it is read-write.
    fn upper(&self) -> Result<Arc<BranchState>> {
        self.branches.read().first().filter(|b| b.writable()).cloned().ok_or(Error::Os(libc::EROFS))
    }

    fn node(&self, id: NodeId) -> Result<(FileKind, Vec<Place>)> {
        let nodes = self.nodes.lock();
        let n = nodes.nodes.get(&id.0).ok_or(Error::Os(libc::ESTALE))?;
        Ok((n.kind, n.places.clone()))
    }

    fn top_place(&self, id: NodeId) -> Result<Place> {
        let nodes = self.nodes.lock();
        nodes.nodes.get(&id.0).and_then(|n| n.places.first().copied()).ok_or(Error::Os(libc::ESTALE))
    }

    fn dir_places(&self, id: NodeId) -> Result<Vec<Place>> {
        match self.node(id)? {
            (FileKind::Dir, places) if !places.is_empty() => Ok(places),
            (FileKind::Dir, _) => Err(Error::Os(libc::ESTALE)),
            _ => Err(Error::Os(libc::ENOTDIR)),
        }
    }

    fn forget_places(&self, places: &[Place]) {
        for p in places.iter().filter(|p| p.node != NodeId::ROOT) {
            if let Ok(b) = self.branch(p.branch) {
                b.top().forget(&daemon(), p.node, 1);
            }
        }
    }

    fn new_fh(&self) -> u64 {
        self.next_fh.fetch_add(1, Ordering::Relaxed)
    }

    // --- Finding names ------------------------------------------------------------------

    fn readlink(&self, b: &BranchState, node: NodeId) -> Option<Vec<u8>> {
        match b.top().call(&daemon(), &Op::ReadLink { node }) {
            Ok(Reply::Data(d)) => Some(d),
            _ => None,
        }
    }

    fn is_whiteout(&self, b: &BranchState, e: &Entry) -> bool {
        b.marked.load(Ordering::Relaxed)
            && e.attr.kind == FileKind::Symlink
            && self.readlink(b, e.node).is_some_and(|t| t == WHITEOUT_TARGET.as_bytes())
    }

    fn has_xattr(&self, b: &BranchState, node: NodeId, name: &str) -> Option<Vec<u8>> {
        let op = Op::GetXattr { node, name: OsStr::new(name), size: 64 };
        match b.top().call(&daemon(), &op) {
            Ok(Reply::Xattr(XattrReply::Data(d))) => Some(d),
            _ => None,
        }
    }

    fn is_opaque(&self, b: &BranchState, node: NodeId) -> bool {
        b.marked.load(Ordering::Relaxed) && self.has_xattr(b, node, OPAQUE_XATTR).is_some()
    }

    /// The union inode number a copy recorded, if the object at `place` is one.
    fn origin_of(&self, place: Place, kind: FileKind) -> Option<u64> {
        let b = self.branch(place.branch).ok()?;
        if !b.marked.load(Ordering::Relaxed) || kind == FileKind::Symlink {
            return None;
        }
        let value = self.has_xattr(&b, place.node, ORIGIN_XATTR)?;
        std::str::from_utf8(&value).ok()?.parse().ok().filter(|id| *id <= NodeId::MAX)
    }

    /// Look `name` up in the directory at `parent` (its places, top first).
    fn find(&self, cx: &Caller, parent: &[Place], name: &OsStr) -> Result<Option<Found>> {
        if is_temp(name) {
            return Ok(None);
        }
        let mut found: Option<Found> = None;
        for p in parent {
            let Ok(b) = self.branch(p.branch) else {
                continue;
            };
            let e = match b.top().lookup(cx, p.node, name) {
                Ok(e) => e,
                Err(Error::Os(libc::ENOENT)) => continue,
                Err(e) => {
                    if let Some(f) = found {
                        self.forget_places(&f.places);
                    }
                    return Err(e);
                }
            };
            let place = Place { branch: p.branch, node: e.node };
            let is_dir = e.attr.kind == FileKind::Dir;
            match &mut found {
                _ if self.is_whiteout(&b, &e) => {
                    self.forget_places(&[place]);
                    break;
                }
                None => {
                    found = Some(Found { places: vec![place], entry: e });
                    if !is_dir || self.is_opaque(&b, e.node) {
                        break;
                    }
                }
                Some(f) => {
                    if !is_dir {
                        self.forget_places(&[place]);
                        break;
                    }
                    f.places.push(place);
                    if self.is_opaque(&b, e.node) {
                        break;
                    }
                }
            }
        }
        if let Some(f) = found.as_mut().filter(|f| f.places.len() > 1) {
            f.entry.attr.nlink = self.merged_links(cx, &f.places)?;
        }
        Ok(found)
    }

    /// A merged directory's link count as a kernel file system counts it: two, and one for each
    /// subdirectory it shows. The top branch's own count misses the subdirectories that are
    /// only below it (found by the differential fuzzer, `difffuzz.rs`).
    fn merged_links(&self, cx: &Caller, places: &[Place]) -> Result<u32> {
        let subdirs = self.merged(cx, places)?.iter().filter(|m| m.kind == FileKind::Dir).count();
        Ok(2 + subdirs as u32)
    }

    /// `reply` (attributes of `node`, from where it shows from) with a merged directory's link
    /// count counted.
    fn with_merged_links(&self, cx: &Caller, node: NodeId, reply: Reply) -> Result<Reply> {
        match (reply, self.node(node)?) {
            (Reply::Attr(mut attr), (FileKind::Dir, places)) if places.len() > 1 => {
                attr.nlink = self.merged_links(cx, &places)?;
                Ok(Reply::Attr(attr))
            }
            (reply, _) => Ok(reply),
        }
    }

    /// Whether `name` shows in `parent` on a branch below `below` (its number).
    fn exists_below(&self, cx: &Caller, parent: &[Place], name: &OsStr, below: u32) -> Result<bool> {
        let Some(start) = parent.iter().position(|p| p.branch == below) else {
            // The directory is not on that branch (it is being created there): all its places
            // are below.
            return self.find(cx, parent, name).map(|f| f.inspect(|f| self.forget_places(&f.places)).is_some());
        };
        let found = self.find(cx, &parent[start + 1..], name)?;
        Ok(found.inspect(|f| self.forget_places(&f.places)).is_some())
    }

    /// Keep a found object: its number, its places and where it was seen. Returns its entry.
    fn remember(&self, parent: NodeId, name: &OsStr, found: Found) -> Entry {
        let kind = found.entry.attr.kind;
        let origin = self.origin_of(found.places[0], kind);
        let mut table = self.nodes.lock();
        let id = origin.unwrap_or_else(|| table.id_of(found.places[0]));
        let seen = Some((parent.0, name.to_owned()));
        let old = match table.nodes.get_mut(&id) {
            Some(n) => {
                n.lookups += 1;
                n.kind = kind;
                n.parent = seen;
                std::mem::replace(&mut n.places, found.places)
            }
            None => {
                table.nodes.insert(id, UNode { kind, lookups: 1, places: found.places, parent: seen });
                Vec::new()
            }
        };
        drop(table);
        self.forget_places(&old);
        Entry { node: NodeId(id), ..found.entry }
    }

    fn lookup(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Result<Entry> {
        let places = self.dir_places(parent)?;
        let found = self.find(cx, &places, name)?.ok_or_else(enoent)?;
        Ok(self.remember(parent, name, found))
    }

    fn forget(&self, node: NodeId, nlookup: u64) {
        if node == NodeId::ROOT {
            return;
        }
        let mut table = self.nodes.lock();
        let Some(n) = table.nodes.get_mut(&node.0) else {
            return;
        };
        n.lookups = n.lookups.saturating_sub(nlookup);
        if n.lookups > 0 {
            return;
        }
        let gone = table.nodes.remove(&node.0).map(|n| n.places).unwrap_or_default();
        drop(table);
        self.forget_places(&gone);
    }

    // --- Marks, whiteouts, opaque directories ----------------------------------------------

    /// Mark `b` before the first whiteout, origin or opaque flag is written there.
    fn mark(&self, b: &BranchState) {
        if b.marked.swap(true, Ordering::AcqRel) {
            return;
        }
        let op = Op::SetXattr { node: NodeId::ROOT, name: OsStr::new(MARK_XATTR), value: b"1", flags: 0 };
        if let Err(e) = b.top().call(&daemon(), &op) {
            tracing::warn!(
                "union '{}': cannot mark branch '{}' ({}): {e}; its whiteouts will not be recognised after a remount",
                self.name,
                b.branch.name,
                b.branch.dir.display()
            );
        }
    }

    fn set_flag(&self, b: &BranchState, node: NodeId, name: &str, value: &[u8]) -> Result<()> {
        self.mark(b);
        b.top().call(&daemon(), &Op::SetXattr { node, name: OsStr::new(name), value, flags: 0 }).map(|_| ())
    }

    fn whiteout(&self, b: &BranchState, dir: NodeId, name: &OsStr) -> Result<()> {
        self.mark(b);
        let e = match b.top().call(&daemon(), &Op::SymLink { parent: dir, name, target: Path::new(WHITEOUT_TARGET) })? {
            Reply::Entry(e) => e,
            _ => return Err(Error::Os(libc::EIO)),
        };
        b.top().forget(&daemon(), e.node, 1);
        Ok(())
    }

    /// Remove a whiteout of `name` in `dir` on `b`, if there is one. Returns whether there was.
    fn remove_whiteout(&self, b: &BranchState, dir: NodeId, name: &OsStr) -> Result<bool> {
        if !b.marked.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let e = match b.top().lookup(&daemon(), dir, name) {
            Ok(e) => e,
            Err(Error::Os(libc::ENOENT)) => return Ok(false),
            Err(e) => return Err(e),
        };
        let whiteout = self.is_whiteout(b, &e);
        b.top().forget(&daemon(), e.node, 1);
        if whiteout {
            b.top().unlink(&daemon(), dir, name)?;
        }
        Ok(whiteout)
    }

    // --- Changes ----------------------------------------------------------------------------

    /// The place to change the object `id` at: where it is, on a read-write branch; else its
    /// copy on the upper branch (without its data when `truncating`).
    fn writable_place(&self, id: NodeId, truncating: bool) -> Result<Place> {
        let place = self.top_place(id)?;
        if self.branch(place.branch)?.writable() {
            return Ok(place);
        }
        self.copy_up(id, truncating)
    }

    /// The object `id` on the upper branch, copied up if it is elsewhere.
    fn upper_place(&self, id: NodeId, truncating: bool) -> Result<Place> {
        let upper = self.upper()?;
        let place = self.top_place(id)?;
        if place.branch == upper.number {
            return Ok(place);
        }
        self.copy_up(id, truncating)
    }

    /// Create an object named `name` in `parent`, on the upper branch: `make` runs there with
    /// the directory's node on it.
    fn make(&self, parent: NodeId, name: &OsStr, make: impl FnOnce(&Level, NodeId) -> Result<Reply>) -> Result<Reply> {
        if is_temp(name) {
            return Err(Error::Os(libc::EPERM));
        }
        let upper = self.upper()?;
        let dir = self.ensure_dir_on_upper(parent)?;
        let replaced_whiteout = self.remove_whiteout(&upper, dir.node, name)?;
        let mut reply = make(upper.top(), dir.node)?;
        let entry = match &mut reply {
            Reply::Entry(e) | Reply::Created(e, _) => e,
            _ => return Err(Error::Os(libc::EIO)),
        };
        let place = Place { branch: upper.number, node: entry.node };
        if entry.attr.kind == FileKind::Dir && replaced_whiteout {
            // A directory of this name below was removed: it must not show through.
            self.set_flag(&upper, entry.node, OPAQUE_XATTR, b"y")?;
        }
        let found = Found { places: vec![place], entry: *entry };
        *entry = self.remember(parent, name, found);
        if let Reply::Created(_, opened) = &mut reply {
            *opened = self.register_open(place, opened.clone(), &upper);
        }
        Ok(reply)
    }

    fn register_open(&self, place: Place, opened: Opened, b: &BranchState) -> Opened {
        let fh = self.new_fh();
        self.files.lock().insert(fh, OpenFile { place, fh: opened.fh });
        b.opens.fetch_add(1, Ordering::Relaxed);
        Opened { fh: FileHandle(fh), ..opened }
    }

    fn open_file(&self, fh: FileHandle) -> Result<(OpenFile, Arc<BranchState>)> {
        let of = *self.files.lock().get(&fh.0).ok_or(Error::Os(libc::EBADF))?;
        Ok((of, self.branch(of.place.branch)?))
    }

    fn unlink(&self, cx: &Caller, parent: NodeId, name: &OsStr, dir: bool) -> Result<Reply> {
        let places = self.dir_places(parent)?;
        if let ([only], false) = (places.as_slice(), is_temp(name)) {
            // A directory on one writable branch with no whiteouts or opaque flags: nothing below
            // can show through, so the branch removes the name itself (and refuses a non-empty
            // directory itself).
            let b = self.branch(only.branch)?;
            if b.writable() && !b.marked.load(Ordering::Relaxed) {
                let op = if dir { Op::RmDir { parent: only.node, name } } else { Op::Unlink { parent: only.node, name } };
                return b.top().call(cx, &op);
            }
        }
        let found = self.find(cx, &places, name)?.ok_or_else(enoent)?;
        let result = self.remove_found(cx, parent, &places, name, &found, dir);
        self.forget_places(&found.places);
        result.map(|()| Reply::Empty)
    }

    fn remove_found(&self, cx: &Caller, parent_id: NodeId, parent: &[Place], name: &OsStr, found: &Found, dir: bool) -> Result<()> {
        // A kernel file system refuses first to take a name out of an immutable or append-only
        // directory, or to remove such an object (EPERM), before it looks at the object's kind
        // or whether a directory is empty. Flags live on the writable branch (chattr copies up).
        use plyfs_stack::ioctl::{FS_APPEND_FL, FS_IMMUTABLE_FL};
        let pinned = |places: &[Place], kind: FileKind| {
            places.first().is_some_and(|p| {
                let flags = |b: &BranchState| copyup::file_flags(b, p.node, kind).unwrap_or(0);
                self.branch(p.branch).is_ok_and(|b| b.writable() && flags(&b) & (FS_IMMUTABLE_FL | FS_APPEND_FL) != 0)
            })
        };
        if pinned(parent, FileKind::Dir) || pinned(&found.places, found.entry.attr.kind) {
            return Err(Error::Os(libc::EPERM));
        }
        match (dir, found.entry.attr.kind == FileKind::Dir) {
            (true, false) => return Err(Error::Os(libc::ENOTDIR)),
            (false, true) => return Err(Error::Os(libc::EISDIR)),
            _ => {}
        }
        if dir && !self.merged(cx, &found.places)?.is_empty() {
            return Err(Error::Os(libc::ENOTEMPTY));
        }
        let top = found.places[0];
        let b = self.branch(top.branch)?;
        let below = found.places.len() > 1 || self.exists_below(cx, parent, name, top.branch)?;
        if !b.writable() {
            // Nothing can be removed there: hide it.
            return self.whiteout_in(parent_id, name);
        }
        if below {
            // The whiteout must be possible before anything is removed.
            self.upper()?;
        }
        let dir_node = parent.iter().find(|p| p.branch == top.branch).ok_or(Error::Os(libc::ESTALE))?.node;
        if dir {
            self.clear_hidden(&b, top.node)?;
            b.top().call(cx, &Op::RmDir { parent: dir_node, name })?;
        } else {
            b.top().call(cx, &Op::Unlink { parent: dir_node, name })?;
        }
        if below {
            self.whiteout_in(parent_id, name)?;
        }
        Ok(())
    }

    /// A whiteout of `name` in the directory `parent`, on the upper branch.
    fn whiteout_in(&self, parent: NodeId, name: &OsStr) -> Result<()> {
        let upper = self.upper()?;
        let dir = self.ensure_dir_on_upper(parent)?;
        self.whiteout(&upper, dir.node, name)
    }

    fn rename(&self, cx: &Caller, parent: NodeId, name: &OsStr, new_parent: NodeId, new_name: &OsStr, flags: u32) -> Result<Reply> {
        if flags & !(libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE | libc::RENAME_WHITEOUT) != 0 {
            return Err(Error::Os(libc::EINVAL));
        }
        if is_temp(new_name) {
            return Err(Error::Os(libc::EPERM));
        }
        if flags & libc::RENAME_EXCHANGE != 0 {
            return self.exchange(cx, parent, name, new_parent, new_name);
        }
        let from_dir = self.dir_places(parent)?;
        let to_dir = self.dir_places(new_parent)?;
        let src = self.find(cx, &from_dir, name)?.ok_or_else(enoent)?;
        let dst = match self.find(cx, &to_dir, new_name) {
            Ok(d) => d,
            Err(e) => {
                self.forget_places(&src.places);
                return Err(e);
            }
        };
        // The union keeps the source's places (and the lookups held on them) while it moves it.
        let src_entry = self.remember(parent, name, Found { places: src.places.clone(), entry: src.entry });
        let result =
            self.rename_found(cx, parent, name, &from_dir, new_parent, new_name, &to_dir, &src, src_entry.node, dst.as_ref(), flags);
        if result.is_ok() {
            if let Some(n) = self.nodes.lock().nodes.get_mut(&src_entry.node.0) {
                n.parent = Some((new_parent.0, new_name.to_owned()));
            }
        }
        self.forget(src_entry.node, 1);
        if let Some(d) = &dst {
            self.forget_places(&d.places);
        }
        result.map(|()| Reply::Empty)
    }

    /// `RENAME_EXCHANGE`: both objects on the upper branch (files are copied up), swapped there.
    /// A directory with contents below, or one that would land on a lower directory of the same
    /// name, cannot be swapped in one step: `EXDEV`.
    fn exchange(&self, cx: &Caller, parent: NodeId, name: &OsStr, new_parent: NodeId, new_name: &OsStr) -> Result<Reply> {
        let a = self.lookup(cx, parent, name)?;
        let b = match self.lookup(cx, new_parent, new_name) {
            Ok(b) => b,
            Err(e) => {
                self.forget(a.node, 1);
                return Err(e);
            }
        };
        let result = (|| {
            let upper = self.upper()?;
            let (from_dir, to_dir) = (self.dir_places(parent)?, self.dir_places(new_parent)?);
            for (e, lands_in, lands_as) in [(&a, &to_dir, new_name), (&b, &from_dir, name)] {
                if e.attr.kind != FileKind::Dir {
                    continue;
                }
                let places = self.node(e.node)?.1;
                if places.len() > 1 || places[0].branch != upper.number || self.exists_below(cx, lands_in, lands_as, upper.number)? {
                    return Err(Error::Os(libc::EXDEV));
                }
            }
            self.upper_place(a.node, false)?;
            self.upper_place(b.node, false)?;
            let (from, to) = (self.ensure_dir_on_upper(parent)?, self.ensure_dir_on_upper(new_parent)?);
            let op = Op::Rename { parent: from.node, name, new_parent: to.node, new_name, flags: libc::RENAME_EXCHANGE };
            upper.top().call(cx, &op)?;
            let mut table = self.nodes.lock();
            for (id, seen) in [(a.node, (new_parent.0, new_name)), (b.node, (parent.0, name))] {
                if let Some(n) = table.nodes.get_mut(&id.0) {
                    n.parent = Some((seen.0, seen.1.to_owned()));
                }
            }
            Ok(Reply::Empty)
        })();
        self.forget(a.node, 1);
        self.forget(b.node, 1);
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn rename_found(
        &self,
        cx: &Caller,
        parent: NodeId,
        name: &OsStr,
        from_dir: &[Place],
        new_parent: NodeId,
        new_name: &OsStr,
        to_dir: &[Place],
        src: &Found,
        src_id: NodeId,
        dst: Option<&Found>,
        flags: u32,
    ) -> Result<()> {
        let src_is_dir = src.entry.attr.kind == FileKind::Dir;
        if let Some(d) = dst {
            if flags & libc::RENAME_NOREPLACE != 0 {
                return Err(Error::Os(libc::EEXIST));
            }
            if d.places[0] == src.places[0] {
                return Ok(()); // the same object: nothing to do, as rename(2) says
            }
            match (src_is_dir, d.entry.attr.kind == FileKind::Dir) {
                (true, false) => return Err(Error::Os(libc::ENOTDIR)),
                (false, true) => return Err(Error::Os(libc::EISDIR)),
                (true, true) if !self.merged(cx, &d.places)?.is_empty() => return Err(Error::Os(libc::ENOTEMPTY)),
                _ => {}
            }
        }
        let upper = self.upper()?;
        if src_is_dir
            && (src.places.len() > 1 || src.places[0].branch != upper.number || self.exists_below(cx, from_dir, name, upper.number)?)
        {
            // Its contents (or a shadowed object) lie on a lower branch: let `mv` copy it.
            return Err(Error::Os(libc::EXDEV));
        }
        let place = self.upper_place(src_id, false)?;
        let from = self.ensure_dir_on_upper(parent)?;
        let to = self.ensure_dir_on_upper(new_parent)?;
        match dst {
            Some(d) if d.entry.attr.kind == FileKind::Dir && d.places[0].branch == upper.number => {
                self.clear_hidden(&upper, d.places[0].node)?;
            }
            None => {
                self.remove_whiteout(&upper, to.node, new_name)?;
            }
            _ => {}
        }
        // RENAME_WHITEOUT (overlayfs asks it of its upper file system, which this union may be)
        // leaves a character device 0/0 under the old name on the upper branch: an object of
        // the user's, not one of the union's whiteouts, and it hides what lies below as any
        // object there does.
        upper.top().call(cx, &Op::Rename { parent: from.node, name, new_parent: to.node, new_name, flags })?;
        if src_is_dir && self.exists_below(cx, to_dir, new_name, upper.number)? {
            self.set_flag(&upper, place.node, OPAQUE_XATTR, b"y")?;
        }
        if flags & libc::RENAME_WHITEOUT == 0 && self.exists_below(cx, from_dir, name, upper.number)? {
            self.whiteout(&upper, from.node, name)?;
        }
        Ok(())
    }

    fn link(&self, cx: &Caller, node: NodeId, new_parent: NodeId, new_name: &OsStr) -> Result<Reply> {
        if is_temp(new_name) {
            return Err(Error::Os(libc::EPERM));
        }
        let upper = self.upper()?;
        let place = self.upper_place(node, false)?;
        let to = self.ensure_dir_on_upper(new_parent)?;
        self.remove_whiteout(&upper, to.node, new_name)?;
        let e = match upper.top().call(cx, &Op::Link { node: place.node, new_parent: to.node, new_name })? {
            Reply::Entry(e) => e,
            _ => return Err(Error::Os(libc::EIO)),
        };
        let mut table = self.nodes.lock();
        let n = table.nodes.get_mut(&node.0).ok_or(Error::Os(libc::ESTALE))?;
        n.lookups += 1;
        drop(table);
        // The union holds one lookup per place; the link's is extra.
        upper.top().forget(&daemon(), e.node, 1);
        Ok(Reply::Entry(Entry { node, ..e }))
    }

    /// Send `op` to where object `node` shows from.
    fn on_top(&self, cx: &Caller, op: &Op<'_>, node: NodeId) -> Result<Reply> {
        let place = self.top_place(node)?;
        self.branch(place.branch)?.top().call(cx, &op.at(place.node))
    }

    fn list_xattr(&self, cx: &Caller, node: NodeId, size: u32) -> Result<Reply> {
        let place = self.top_place(node)?;
        let b = self.branch(place.branch)?;
        let all = match b.top().call(cx, &Op::ListXattr { node: place.node, size: 65536 })? {
            Reply::Xattr(XattrReply::Data(d)) => d,
            _ => return Err(Error::Os(libc::EIO)),
        };
        let shown: Vec<u8> = all
            .split_inclusive(|b| *b == 0)
            .filter(|n| !is_hidden_xattr(OsStr::from_bytes(n.strip_suffix(&[0]).unwrap_or(n))))
            .flatten()
            .copied()
            .collect();
        Ok(Reply::Xattr(match size {
            0 => XattrReply::Size(shown.len() as u32),
            s if (s as usize) < shown.len() => return Err(Error::Os(libc::ERANGE)),
            _ => XattrReply::Data(shown),
        }))
    }

    /// An extended operation on an object goes to the branch it is on; on the root, to the
    /// first branch that answers it.
    fn extended(&self, cx: &Caller, node: NodeId, name: &str, args: &[String]) -> Result<Reply> {
        match name {
            "branch-list" => return Ok(Reply::Extended(self.branch_list())),
            "branch-add" => return self.branch_add(args).map(Reply::Extended),
            "branch-remove" => return self.branch_remove(args).map(Reply::Extended),
            _ => {}
        }
        let op = Op::Extended { node, name, args };
        if node != NodeId::ROOT {
            return self.on_top(cx, &op, node);
        }
        let mut last = Error::UnsupportedOp { op: name.to_owned(), layers: vec![] };
        for b in self.snapshot() {
            match b.top().call(cx, &op) {
                Err(e @ Error::UnsupportedOp { .. }) => last = e,
                other => return other,
            }
        }
        Err(last)
    }

    // --- Branches at run time -----------------------------------------------------------------

    fn branch_list(&self) -> Value {
        let list: Vec<Value> = self
            .snapshot()
            .iter()
            .enumerate()
            .map(|(i, b)| {
                json!({
                    "position": i,
                    "name": b.branch.name,
                    "dir": b.branch.dir.display().to_string(),
                    "mode": b.branch.mode.as_str(),
                    "open_files": b.opens.load(Ordering::Relaxed),
                })
            })
            .collect();
        Value::Array(list)
    }

    fn branch_add(&self, args: &[String]) -> Result<Value> {
        let usage = || Error::BadArgs("usage: branch-add PATH [ro|rw] [POSITION]".into());
        let path = args.first().ok_or_else(usage)?;
        let mut mode = BranchMode::ReadWrite;
        let mut position = None;
        for a in &args[1..] {
            match (BranchMode::parse(a), a.parse::<usize>()) {
                (Some(m), _) => mode = m,
                (None, Ok(p)) => position = Some(p),
                _ => return Err(Error::BadArgs(format!("branch-add: '{a}' is neither ro, rw nor a position"))),
            }
        }
        let number = self.next_number.fetch_add(1, Ordering::Relaxed);
        if number > MAX_BRANCH_NUMBERS {
            return Err(Error::BadArgs(format!("branch-add: this mount has had {MAX_BRANCH_NUMBERS} branches; remount to add more")));
        }
        let name = format!("{}.{number}", self.name);
        let spec = BranchSpec { name: Some(name.clone()), dir: Some(path.into()), mode: Some(mode), layers: Vec::new() };
        let branch = self.builder.build(&name, &spec).map_err(|e| Error::BadArgs(e.to_string()))?;
        let current: Vec<Branch> = self.snapshot().iter().map(|b| b.branch.clone()).collect();
        plyfs_stack::check_branch_dirs(&current, &branch).map_err(|e| Error::BadArgs(e.to_string()))?;
        let state = Arc::new(BranchState::found(branch, number));
        {
            let mut branches = self.branches.write();
            let at = position.unwrap_or(branches.len()).min(branches.len());
            branches.insert(at, state);
        }
        self.refresh_root_places();
        tracing::info!("union '{}': branch '{name}' ({path}, {}) added", self.name, mode.as_str());
        Ok(self.branch_list())
    }

    fn branch_remove(&self, args: &[String]) -> Result<Value> {
        let [name] = args else {
            return Err(Error::BadArgs("usage: branch-remove NAME".into()));
        };
        // The kernel sends a file's release after its last close has returned: a removal right
        // after closing the last file waits a moment for releases in flight.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while std::time::Instant::now() < deadline {
            let busy = self
                .branches
                .read()
                .iter()
                .any(|b| (b.branch.name == *name || b.branch.dir.as_os_str() == name.as_str()) && b.opens.load(Ordering::Relaxed) > 0);
            if !busy {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let removed = {
            let mut branches = self.branches.write();
            let at = branches
                .iter()
                .position(|b| b.branch.name == *name || b.branch.dir.as_os_str() == name.as_str())
                .ok_or_else(|| Error::BadArgs(format!("branch-remove: no branch named '{name}'")))?;
            if branches.len() == 1 {
                return Err(Error::BadArgs(format!("branch-remove: '{name}' is the last branch")));
            }
            let opens = branches[at].opens.load(Ordering::Relaxed);
            if opens > 0 {
                return Err(Error::BadArgs(format!("branch-remove: {opens} files are open on branch '{name}'")));
            }
            branches.remove(at)
        };
        // Objects known only there go stale; merged directories lose that place.
        let dropped: Vec<Place> = {
            let mut table = self.nodes.lock();
            let mut dropped = Vec::new();
            for n in table.nodes.values_mut() {
                n.places.retain(|p| {
                    let keep = p.branch != removed.number;
                    if !keep {
                        dropped.push(*p);
                    }
                    keep
                });
            }
            dropped
        };
        for p in dropped.iter().filter(|p| p.node != NodeId::ROOT) {
            removed.top().forget(&daemon(), p.node, 1);
        }
        self.refresh_root_places();
        removed.branch.stack.shutdown();
        tracing::info!("union '{}': branch '{name}' removed", self.name);
        Ok(self.branch_list())
    }

    fn refresh_root_places(&self) {
        let places = self.snapshot().iter().map(|b| Place { branch: b.number, node: NodeId::ROOT }).collect();
        if let Some(root) = self.nodes.lock().nodes.get_mut(&NodeId::ROOT.0) {
            root.places = places;
        }
    }
}

impl BranchState {
    /// A branch as found: marked if the union wrote there before.
    fn found(branch: Branch, number: u32) -> BranchState {
        let op = Op::GetXattr { node: NodeId::ROOT, name: OsStr::new(MARK_XATTR), size: 16 };
        let marked = branch.top().call(&daemon(), &op).is_ok();
        BranchState { branch, number, marked: AtomicBool::new(marked), opens: AtomicU64::new(0) }
    }
}

impl Layer for Union {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "union"
    }

    fn data_path(&self) -> DataPath {
        // File data is the branch's: its passthrough file, if it has one, passes up.
        DataPath::Transparent
    }

    fn lower(&self) -> &[Level] {
        &[]
    }

    fn branches(&self) -> Vec<Branch> {
        self.snapshot().iter().map(|b| b.branch.clone()).collect()
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
            // Operations on open files go to the branch the file was opened on.
            Op::GetAttr { fh: Some(fh), .. }
            | Op::Read { fh, .. }
            | Op::Write { fh, .. }
            | Op::Flush { fh, .. }
            | Op::Fsync { fh, .. }
            | Op::Fallocate { fh, .. }
            | Op::Lseek { fh, .. } => {
                let (of, b) = self.open_file(fh)?;
                b.top().call(cx, &op.on_open(of.place.node, of.fh))
            }
            // Flags are read where the object is, and set where it is writable.
            Op::Ioctl { node, fh, cmd, .. } => {
                let sets = plyfs_stack::ioctl::sets(cmd);
                match self.open_file(fh) {
                    Ok((of, b)) if b.writable() || !sets => b.top().call(cx, &op.on_open(of.place.node, of.fh)),
                    // A directory (its handle is the union's own), or flags set on a file open
                    // on a read-only branch: they go to the object's copy on a writable branch,
                    // as any change does, through a handle opened there for the purpose.
                    _ => {
                        let (kind, _) = self.node(node)?;
                        let place = if sets { self.writable_place(node, false)? } else { self.top_place(node)? };
                        self.branch(place.branch)?.top().ioctl_opened(cx, op, place.node, kind)
                    }
                }
            }
            Op::GetAttr { node, fh: None } => {
                let reply = self.on_top(cx, op, node)?;
                self.with_merged_links(cx, node, reply)
            }
            Op::ReadLink { node } | Op::Access { node, .. } => self.on_top(cx, op, node),
            Op::GetXattr { name, .. } if is_hidden_xattr(name) => Err(Error::Os(libc::ENODATA)),
            Op::GetXattr { node, .. } => self.on_top(cx, op, node),
            Op::SetAttr { node, fh, set } => {
                let open = fh.and_then(|fh| self.open_file(fh).ok()).filter(|(_, b)| b.writable());
                let (place, fh) = match open {
                    Some((of, _)) => (of.place, Some(of.fh)),
                    None => (self.writable_place(node, set.size == Some(0))?, None),
                };
                let op = match fh {
                    Some(fh) => op.on_open(place.node, fh),
                    None => op.at(place.node),
                };
                let reply = self.branch(place.branch)?.top().call(cx, &op)?;
                self.with_merged_links(cx, node, reply)
            }
            Op::ListXattr { node, size } => self.list_xattr(cx, node, size),
            Op::SetXattr { name, .. } if is_hidden_xattr(name) => Err(Error::Os(libc::EPERM)),
            Op::RemoveXattr { name, .. } if is_hidden_xattr(name) => Err(Error::Os(libc::ENODATA)),
            Op::SetXattr { node, .. } | Op::RemoveXattr { node, .. } => {
                let place = self.writable_place(node, false)?;
                self.branch(place.branch)?.top().call(cx, &op.at(place.node))
            }
            Op::SymLink { target, .. } if target.as_os_str() == WHITEOUT_TARGET => Err(Error::Os(libc::EINVAL)),
            Op::MkNod { parent, name, .. }
            | Op::MkDir { parent, name, .. }
            | Op::SymLink { parent, name, .. }
            | Op::Create { parent, name, .. } => self.make(parent, name, |l, dir| l.call(cx, &op.at(dir))),
            Op::Unlink { parent, name } => self.unlink(cx, parent, name, false),
            Op::RmDir { parent, name } => self.unlink(cx, parent, name, true),
            Op::Rename { parent, name, new_parent, new_name, flags } => self.rename(cx, parent, name, new_parent, new_name, flags),
            Op::Link { node, new_parent, new_name } => self.link(cx, node, new_parent, new_name),
            Op::Open { node, flags } => {
                let writes = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
                let place = if writes { self.writable_place(node, flags & libc::O_TRUNC != 0)? } else { self.top_place(node)? };
                let b = self.branch(place.branch)?;
                let opened = b.top().open(cx, place.node, flags)?;
                Ok(Reply::Opened(self.register_open(place, opened, &b)))
            }
            Op::Release { fh, .. } => {
                let of = self.files.lock().remove(&fh.0).ok_or(Error::Os(libc::EBADF))?;
                let b = self.branch(of.place.branch)?;
                b.opens.fetch_sub(1, Ordering::Relaxed);
                b.top().call(cx, &op.on_open(of.place.node, of.fh))
            }
            Op::OpenDir { node } => self.open_dir(node),
            Op::ReadDir { node, fh, offset, max_entries, plus } => {
                self.read_dir(cx, node, fh, offset, max_entries, plus).map(Reply::Dir)
            }
            Op::ReleaseDir { fh, .. } => {
                self.dirs.lock().remove(&fh.0);
                Ok(Reply::Empty)
            }
            Op::FsyncDir { node, datasync, .. } => self.fsync_dir(cx, node, datasync),
            Op::StatFs { .. } => {
                let b = self.upper().or_else(|_| self.snapshot().first().cloned().ok_or(Error::Os(libc::EIO)))?;
                b.top().call(cx, &Op::StatFs { node: NodeId::ROOT })
            }
            Op::Extended { node, name, args } => self.extended(cx, node, name, args),
        }
    }

    fn shutdown(&self) {
        for b in self.snapshot() {
            b.branch.stack.shutdown();
        }
    }
}

fn build(args: FanOutArgs) -> Result<Arc<dyn Layer>> {
    Ok(Arc::new(Union::new(args)?))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "union",
    summary: "fan-out: branches in priority order seen as one tree, with copy-up, whiteouts and opaque directories",
    params: &[],
    ext_ops: EXT_OPS,
    build: Build::FanOut(build),
    absorbs: &[],
};
