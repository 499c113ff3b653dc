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
//! - **Inode numbers** come from where an object originated (see [`crate::ids`]), so they are unique
//!   across branches and stay the same through a copy-up and across remounts.
//! - **Renaming a directory** that lower branches also hold fails with `EXDEV`, as in overlayfs
//!   without `redirect_dir`: `mv` then copies it.
//!
//! A branch is marked ([`MARK_XATTR`] on its root) once the union writes whiteouts, origins or
//! opaque flags in it; until then none of them is looked for there, so a plain branch costs no
//! extra system call.

mod branches;
mod copyup;
mod dir;
mod lookup;
mod rename;
mod whiteout;

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use plyfs_stack::{
    Branch, BranchBuilder, Build, Caller, DataPath, Entry, Error, ExtOpInfo, FanOutArgs, FileHandle, FileKind, Layer, LayerFactory,
    Level, NodeId, Op, Opened, Reply, Result, XattrReply,
};

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
    ExtOpInfo { name: "branch-list", args: "", help: "the branches in priority order: name, directory or server, mode, open files" },
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
        let mut last = Error::UnsupportedOp { op: name.to_owned(), layers: vec![], handled_below: vec![] };
        for b in self.snapshot() {
            match b.top().call(cx, &op) {
                Err(e @ Error::UnsupportedOp { .. }) => last = e,
                other => return other,
            }
        }
        Err(last)
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
