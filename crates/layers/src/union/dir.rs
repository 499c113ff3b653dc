//! Merged directories: one listing from every branch holding a directory, without duplicates,
//! whiteouts or copies in progress.
//!
//! A listing is taken when reading starts at offset 0 and kept with the open directory, so
//! offsets are positions in it and `telldir`/`seekdir` resume where they left off, however
//! large the directory.

use std::collections::HashSet;
use std::ffi::OsString;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;
use plyfs_stack::{Caller, DirEntry, Error, FileHandle, FileKind, NodeId, Op, Opened, Reply, Result};

use super::{daemon, is_temp, BranchState, Union};
use crate::ids::Place;

/// The entries of one open directory, as of the last read from offset 0.
#[derive(Default)]
pub struct Listing {
    entries: Vec<(OsString, u64, FileKind)>,
}

/// One name of a merged directory: where it shows from.
pub struct Merged {
    pub name: OsString,
    pub place: Place,
    pub kind: FileKind,
}

impl Union {
    /// The names a directory shows (its places, top first), without `.` and `..`.
    pub(super) fn merged(&self, cx: &Caller, places: &[Place]) -> Result<Vec<Merged>> {
        let mut seen: HashSet<OsString> = HashSet::new();
        let mut out = Vec::new();
        for p in places {
            let b = self.branch(p.branch)?;
            let marked = b.marked.load(Ordering::Relaxed);
            for e in b.top().list_dir(cx, p.node)? {
                if is_temp(&e.name) {
                    self.remove_leftover(&b, p.node, &e.name);
                    continue;
                }
                if !seen.insert(e.name.clone()) {
                    continue;
                }
                if marked && e.kind == FileKind::Symlink && self.whiteout_named(&b, p.node, &e.name) {
                    continue;
                }
                out.push(Merged { name: e.name, place: Place { branch: p.branch, node: e.node }, kind: e.kind });
            }
        }
        Ok(out)
    }

    fn whiteout_named(&self, b: &BranchState, dir: NodeId, name: &std::ffi::OsStr) -> bool {
        match b.top().lookup(&daemon(), dir, name) {
            Ok(e) => {
                let whiteout = self.is_whiteout(b, &e);
                b.top().forget(&daemon(), e.node, 1);
                whiteout
            }
            Err(_) => false,
        }
    }

    /// A temporary name that no copy-up is writing is left over from a crash (see
    /// [`crate::transfer::TempNames::is_leftover`]).
    fn remove_leftover(&self, b: &BranchState, dir: NodeId, name: &std::ffi::OsStr) {
        let changed = || {
            let e = b.top().lookup(&daemon(), dir, name).ok()?;
            b.top().forget(&daemon(), e.node, 1);
            Some(e.attr.mtime.max(e.attr.ctime))
        };
        if !b.writable() || !self.temps.is_leftover(name, changed) {
            return;
        }
        match b.top().unlink(&daemon(), dir, name) {
            Ok(()) => tracing::info!(
                "union '{}': removed {} in branch '{}', left by an interrupted copy-up",
                self.name,
                name.to_string_lossy(),
                b.branch.name
            ),
            Err(e) => tracing::debug!("union '{}': cannot remove leftover {}: {e}", self.name, name.to_string_lossy()),
        }
    }

    /// Remove the whiteouts (and leftovers) in a directory of a writable branch, which the
    /// union shows as empty, so that the branch can remove or replace it.
    pub(super) fn clear_hidden(&self, b: &BranchState, dir: NodeId) -> Result<()> {
        if !b.marked.load(Ordering::Relaxed) {
            return Ok(());
        }
        for e in b.top().list_dir(&daemon(), dir)? {
            let hidden = is_temp(&e.name) || (e.kind == FileKind::Symlink && self.whiteout_named(b, dir, &e.name));
            if hidden {
                b.top().unlink(&daemon(), dir, &e.name)?;
            }
        }
        Ok(())
    }

    pub(super) fn open_dir(&self, node: NodeId) -> Result<Reply> {
        self.dir_places(node)?;
        let fh = self.new_fh();
        self.dirs.lock().insert(fh, Arc::new(Mutex::new(Listing::default())));
        Ok(Reply::Opened(Opened { fh: FileHandle(fh), backing: None, direct_io: false, flush_on_close: false }))
    }

    /// The union number of a merged entry as `stat` would show it.
    fn entry_id(&self, m: &Merged) -> u64 {
        let b = self.branch(m.place.branch);
        let may_have_origin = b.as_ref().is_ok_and(|b| b.marked.load(Ordering::Relaxed)) && m.kind != FileKind::Symlink;
        if may_have_origin {
            if let Some(origin) = self.origin_of(m.place, m.kind) {
                return origin;
            }
        }
        self.nodes.lock().id_of(m.place)
    }

    pub(super) fn read_dir(
        &self,
        cx: &Caller,
        node: NodeId,
        fh: FileHandle,
        offset: u64,
        max: u32,
        plus: bool,
    ) -> Result<Vec<DirEntry>> {
        let listing = self.dirs.lock().get(&fh.0).cloned().ok_or(Error::Os(libc::EBADF))?;
        let mut listing = listing.lock();
        if offset == 0 {
            let places = self.dir_places(node)?;
            let parent = self.nodes.lock().nodes.get(&node.0).and_then(|n| n.parent.as_ref().map(|p| p.0)).unwrap_or(NodeId::ROOT.0);
            let merged = self.merged(cx, &places)?;
            let mut entries = Vec::with_capacity(merged.len() + 2);
            entries.push((".".into(), node.0, FileKind::Dir));
            entries.push(("..".into(), parent, FileKind::Dir));
            for m in &merged {
                entries.push((m.name.clone(), self.entry_id(m), m.kind));
            }
            listing.entries = entries;
        }
        let start = offset as usize;
        let mut out = Vec::new();
        let places = if plus { self.dir_places(node)? } else { Vec::new() };
        for (i, (name, id, kind)) in listing.entries.iter().enumerate().skip(start).take(max as usize) {
            let dots = name == "." || name == "..";
            let entry = if plus && !dots {
                match self.find(cx, &places, name).and_then(|f| f.ok_or(Error::Os(libc::ENOENT))) {
                    Ok(found) => Some(self.remember(node, name, found)),
                    // Gone since the listing was taken: leave it out, as a fresh listing would.
                    Err(Error::Os(libc::ENOENT)) => continue,
                    Err(e) => return Err(e),
                }
            } else {
                None
            };
            let (node, kind) = entry.map_or((NodeId(*id), *kind), |e| (e.node, e.attr.kind));
            out.push(DirEntry { name: name.clone(), node, kind, next_offset: (i + 1) as u64, entry });
        }
        Ok(out)
    }

    pub(super) fn fsync_dir(&self, cx: &Caller, node: NodeId, datasync: bool) -> Result<Reply> {
        let place = self.top_place(node)?;
        let b = self.branch(place.branch)?;
        let fh = match b.top().call(cx, &Op::OpenDir { node: place.node })? {
            Reply::Opened(o) => o.fh,
            _ => return Err(Error::Os(libc::EIO)),
        };
        let result = b.top().call(cx, &Op::FsyncDir { node: place.node, fh, datasync });
        let _ = b.top().call(cx, &Op::ReleaseDir { node: place.node, fh });
        result
    }
}
