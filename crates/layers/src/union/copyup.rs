//! Copy-up: an object of a lower branch becomes the upper branch's before it changes (see
//! [`crate::transfer`] for how a copy is made safe against crashes). Directories on the way are
//! copied the same way. A file opened with `O_TRUNC` is copied without its data. The copy
//! records its union inode number (its origin), so the number does not change.

use std::ffi::{OsStr, OsString};

use plyfs_stack::{Entry, Error, FileHandle, FileKind, NodeId, Op, Reply, Result, SetAttr, TimeSet};

use super::{daemon, is_hidden_xattr, BranchState, Union, ORIGIN_XATTR};
use crate::ids::Place;
use crate::transfer::{copy_meta, copy_object, Data};

/// Copies at least this large are logged as they start and end.
const LOG_COPIES_FROM: u64 = 256 << 20;

impl Union {
    /// The directory `id` on the upper branch, copied up (with its parents) if it is not there.
    pub(super) fn ensure_dir_on_upper(&self, id: NodeId) -> Result<Place> {
        let upper = self.upper()?;
        if let Some(p) = self.node(id)?.1.first().filter(|p| p.branch == upper.number) {
            return Ok(*p);
        }
        let _one_at_a_time = self.copy_up.lock();
        self.dir_on_upper(id)
    }

    /// The object `id` on the upper branch, copied there; `truncating` skips the data.
    pub(super) fn copy_up(&self, id: NodeId, truncating: bool) -> Result<Place> {
        let result = self.copy_up_locked(id, truncating);
        if let Err(e) = &result {
            if !matches!(e, Error::Os(libc::EROFS | libc::ESTALE)) {
                let path = self.nodes.lock().path_of(id.0);
                tracing::error!(
                    "union '{}': copy-up of {path} failed: {e}; it still shows from its lower branch, unchanged",
                    self.name
                );
            }
        }
        result
    }

    fn copy_up_locked(&self, id: NodeId, truncating: bool) -> Result<Place> {
        let upper = self.upper()?;
        let _one_at_a_time = self.copy_up.lock();
        let (kind, places) = self.node(id)?;
        let src = *places.first().ok_or(Error::Os(libc::ESTALE))?;
        if src.branch == upper.number {
            return Ok(src);
        }
        if kind == FileKind::Dir {
            return self.dir_on_upper(id);
        }
        let (parent, name) = self.parent_of(id)?;
        let dir = self.dir_on_upper(parent)?;
        let from = self.branch(src.branch)?;
        let attr = from.top().getattr(&daemon(), src.node)?;
        let logged = kind == FileKind::File && !truncating && attr.size >= LOG_COPIES_FROM;
        if logged {
            tracing::info!("union '{}': copying up {} ({} MiB)", self.name, name.to_string_lossy(), attr.size >> 20);
        }
        let copy = keeping_times(&upper, dir.node, || {
            self.temps.place_new(upper.top(), dir.node, &name, |temp| {
                let e = copy_object(
                    from.top(),
                    src.node,
                    &attr,
                    upper.top(),
                    dir.node,
                    temp,
                    if truncating { Data::Skipped } else { Data::Durable },
                )?;
                self.copy_meta(&from, src.node, &upper, e.node, &attr, id)?;
                Ok(e)
            })
        });
        let copy = match copy {
            Err(Error::Os(libc::EEXIST)) => self.made_meanwhile(&upper, dir.node, &name, kind)?,
            other => other?,
        };
        if logged {
            tracing::info!("union '{}': copy-up of {} done", self.name, name.to_string_lossy());
        }
        let place = Place { branch: upper.number, node: copy.node };
        let old = {
            let mut table = self.nodes.lock();
            let n = table.nodes.get_mut(&id.0).ok_or(Error::Os(libc::ESTALE))?;
            std::mem::replace(&mut n.places, vec![place])
        };
        self.forget_places(&old);
        Ok(place)
    }

    /// The copy-up found `name` taken on the upper branch: another mount sharing the tree (`-o
    /// shared`) copied the object up first, or removed it (a whiteout), or put something else
    /// there. Its copy is used, never replaced, so that nothing it wrote there is lost; an
    /// object removed or replaced meanwhile is stale here (`ESTALE`, as on NFS).
    fn made_meanwhile(&self, upper: &BranchState, dir: NodeId, name: &OsStr, kind: FileKind) -> Result<Entry> {
        let e = upper.top().lookup(&daemon(), dir, name)?;
        if e.attr.kind != kind || self.is_whiteout(upper, &e) {
            upper.top().forget(&daemon(), e.node, 1);
            return Err(Error::Os(libc::ESTALE));
        }
        tracing::debug!("union '{}': {} was copied up meanwhile by another mount", self.name, name.to_string_lossy());
        Ok(e)
    }

    fn parent_of(&self, id: NodeId) -> Result<(NodeId, OsString)> {
        let table = self.nodes.lock();
        let n = table.nodes.get(&id.0).ok_or(Error::Os(libc::ESTALE))?;
        n.parent.as_ref().map(|(p, name)| (NodeId(*p), name.clone())).ok_or(Error::Os(libc::ESTALE))
    }

    /// `dir_on_upper` with the copy-up lock held.
    fn dir_on_upper(&self, id: NodeId) -> Result<Place> {
        let upper = self.upper()?;
        let (kind, places) = self.node(id)?;
        if kind != FileKind::Dir {
            return Err(Error::Os(libc::ENOTDIR));
        }
        let src = *places.first().ok_or(Error::Os(libc::ESTALE))?;
        if src.branch == upper.number {
            return Ok(src);
        }
        let (parent, name) = self.parent_of(id)?;
        let dir = self.dir_on_upper(parent)?;
        let from = self.branch(src.branch)?;
        let attr = from.top().getattr(&daemon(), src.node)?;
        let copy = keeping_times(&upper, dir.node, || {
            self.temps.place_new(upper.top(), dir.node, &name, |temp| {
                let e = copy_object(from.top(), src.node, &attr, upper.top(), dir.node, temp, Data::Durable)?;
                self.copy_meta(&from, src.node, &upper, e.node, &attr, id)?;
                Ok(e)
            })
        });
        let copy = match copy {
            Err(Error::Os(libc::EEXIST)) => self.made_meanwhile(&upper, dir.node, &name, FileKind::Dir)?,
            other => other?,
        };
        let place = Place { branch: upper.number, node: copy.node };
        let mut table = self.nodes.lock();
        if let Some(n) = table.nodes.get_mut(&id.0) {
            n.places.insert(0, place);
        }
        Ok(place)
    }

    /// The copy's metadata, and its origin: the number the object has in the union.
    fn copy_meta(
        &self,
        from: &BranchState,
        src: NodeId,
        upper: &BranchState,
        dst: NodeId,
        attr: &plyfs_stack::Attr,
        id: NodeId,
    ) -> Result<()> {
        copy_meta(from.top(), src, upper.top(), dst, attr, |name| !is_hidden_xattr(name))
            .map_err(|e| Error::Corrupt(format!("union '{}': copy-up: {e}", self.name)))?;
        if attr.kind != FileKind::Symlink {
            self.set_flag(upper, dst, ORIGIN_XATTR, id.0.to_string().as_bytes())?;
        }
        copy_file_flags(from, src, upper, dst, attr.kind);
        Ok(())
    }
}

/// Run `place` (which puts a copy into the upper directory `dir`) and give `dir` back the times
/// it had: a copy-up changes no directory, the object was in it already (overlayfs restores its
/// parent's times too). Found by the differential fuzzer (`difffuzz.rs`): a write to a file of
/// a directory that `utimes` had set changed the directory's mtime.
fn keeping_times(upper: &BranchState, dir: NodeId, place: impl FnOnce() -> Result<Entry>) -> Result<Entry> {
    let before = upper.top().getattr(&daemon(), dir)?;
    let placed = place();
    let times = SetAttr {
        atime: Some(TimeSet::At(before.atime)),
        mtime: Some(TimeSet::At(before.mtime)),
        ..SetAttr::default()
    };
    if let Err(e) = upper.top().call(&daemon(), &Op::SetAttr { node: dir, fh: None, set: times }) {
        tracing::debug!("copy-up: the directory keeps the times the copy gave it ({e})");
    }
    placed
}

/// The file-attribute flags a copy-up carries, as overlayfs's do: `noatime` (`chattr +A`) and
/// `sync` (`+S`). Immutable and append-only would stop the copy being changed, which is what it
/// is made for; the others belong to the object's place on its file system.
const COPIED_FLAGS: u32 = plyfs_stack::ioctl::FS_NOATIME_FL | plyfs_stack::ioctl::FS_SYNC_FL;

/// The file-attribute flags (`lsattr`) of `node` on branch `b`, where the branch has them.
pub(super) fn file_flags(b: &BranchState, node: NodeId, kind: FileKind) -> Option<u32> {
    let get = Op::Ioctl { node, fh: FileHandle(0), cmd: plyfs_stack::ioctl::FS_IOC_GETFLAGS, data: &[], out_size: 4 };
    match b.top().ioctl_opened(&daemon(), &get, node, kind) {
        Ok(Reply::Data(d)) if d.len() >= 4 => Some(u32::from_le_bytes([d[0], d[1], d[2], d[3]])),
        _ => None,
    }
}

/// Give the copy `dst` the [`COPIED_FLAGS`] of `src`, where both branches have flags; a branch
/// without them (an encoding layer, a file system without flags) leaves the copy as it is.
fn copy_file_flags(from: &BranchState, src: NodeId, upper: &BranchState, dst: NodeId, kind: FileKind) {
    use plyfs_stack::ioctl::FS_IOC_SETFLAGS;
    if !matches!(kind, FileKind::File | FileKind::Dir) {
        return;
    }
    let Some(wanted) = file_flags(from, src, kind).map(|f| f & COPIED_FLAGS).filter(|f| *f != 0) else { return };
    let Some(now) = file_flags(upper, dst, kind) else { return };
    let flags = ((now & !COPIED_FLAGS) | wanted).to_le_bytes();
    let set = Op::Ioctl { node: dst, fh: FileHandle(0), cmd: FS_IOC_SETFLAGS, data: &flags, out_size: 0 };
    if let Err(e) = upper.top().ioctl_opened(&daemon(), &set, dst, kind) {
        tracing::debug!("copy-up: the copy keeps its own file-attribute flags ({e})");
    }
}
