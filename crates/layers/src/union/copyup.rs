//! Copy-up: an object of a lower branch becomes the upper branch's before it changes.
//!
//! The copy is written under a temporary name in the target directory, with its data made
//! durable and its mode, owner, times, extended attributes and origin (its union inode number)
//! set, and only then renamed to its name: a crash leaves the lower object visible and at most
//! a temporary file, which is never shown and is removed when found. Directories on the way are
//! copied the same way. A file opened with `O_TRUNC` is copied without its data. Data moves by
//! `copy_file_range` between the branches' files when neither branch transforms it (so reflinks
//! where the file system has them), else through the branches' stacks, once.

use std::ffi::{OsStr, OsString};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

use plyfs_stack::{Attr, Entry, Error, FileKind, NodeId, Op, Opened, Reply, Result, SetAttr, TimeSet, XattrReply};

use super::nodes::Place;
use super::{daemon, is_hidden_xattr, BranchState, Union, ORIGIN_XATTR, TEMP_PREFIX};

/// Data is copied through the stacks in pieces of this size.
const COPY_CHUNK: u32 = 1 << 20;
/// Copies at least this large are logged as they start and end.
const LOG_COPIES_FROM: u64 = 256 << 20;

fn mode_bits(kind: FileKind) -> u32 {
    match kind {
        FileKind::File => libc::S_IFREG,
        FileKind::Dir => libc::S_IFDIR,
        FileKind::Symlink => libc::S_IFLNK,
        FileKind::Fifo => libc::S_IFIFO,
        FileKind::Socket => libc::S_IFSOCK,
        FileKind::CharDevice => libc::S_IFCHR,
        FileKind::BlockDevice => libc::S_IFBLK,
    }
}

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
        let copy = self.copy_under_temp_name(&upper, dir.node, &name, |temp| {
            let e = match kind {
                FileKind::File => self.copy_file(&from, src.node, &upper, dir.node, temp, &attr, truncating, &name)?,
                FileKind::Symlink => {
                    let target = self.readlink(&from, src.node).ok_or(Error::Os(libc::EIO))?;
                    let target = std::path::PathBuf::from(<OsString as std::os::unix::ffi::OsStringExt>::from_vec(target));
                    entry_of(upper.top().call(&daemon(), &Op::SymLink { parent: dir.node, name: temp, target: &target })?)?
                }
                other => {
                    let op = Op::MkNod { parent: dir.node, name: temp, mode: mode_bits(other) | 0o600, rdev: attr.rdev };
                    entry_of(upper.top().call(&daemon(), &op)?)?
                }
            };
            self.copy_meta(&from, src.node, &upper, e.node, &attr, id)?;
            Ok(e)
        })?;
        let place = Place { branch: upper.number, node: copy.node };
        let old = {
            let mut table = self.nodes.lock();
            let n = table.nodes.get_mut(&id.0).ok_or(Error::Os(libc::ESTALE))?;
            std::mem::replace(&mut n.places, vec![place])
        };
        self.forget_places(&old);
        Ok(place)
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
        let copy = self.copy_under_temp_name(&upper, dir.node, &name, |temp| {
            let e = entry_of(upper.top().call(&daemon(), &Op::MkDir { parent: dir.node, name: temp, mode: 0o700 })?)?;
            self.copy_meta(&from, src.node, &upper, e.node, &attr, id)?;
            Ok(e)
        })?;
        let place = Place { branch: upper.number, node: copy.node };
        let mut table = self.nodes.lock();
        if let Some(n) = table.nodes.get_mut(&id.0) {
            n.places.insert(0, place);
        }
        Ok(place)
    }

    /// Make an object under a fresh temporary name in `dir` of `upper` with `make`, then rename
    /// it to `name`. On failure nothing is left behind.
    fn copy_under_temp_name(
        &self,
        upper: &BranchState,
        dir: NodeId,
        name: &OsStr,
        make: impl FnOnce(&OsStr) -> Result<Entry>,
    ) -> Result<Entry> {
        let n = self.temp_counter.fetch_add(1, Ordering::Relaxed);
        let temp = OsString::from(format!("{TEMP_PREFIX}{}.{n}", std::process::id()));
        self.in_progress.lock().insert(temp.clone());
        let result = make(&temp).and_then(|e| {
            let rename = Op::Rename { parent: dir, name: &temp, new_parent: dir, new_name: name, flags: 0 };
            match upper.top().call(&daemon(), &rename) {
                Ok(_) => Ok(e),
                Err(err) => {
                    upper.top().forget(&daemon(), e.node, 1);
                    Err(err)
                }
            }
        });
        if result.is_err() {
            let _ = upper.top().call(&daemon(), &Op::Unlink { parent: dir, name: &temp });
            let _ = upper.top().call(&daemon(), &Op::RmDir { parent: dir, name: &temp });
        }
        self.in_progress.lock().remove(&temp);
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn copy_file(
        &self,
        from: &BranchState,
        src: NodeId,
        upper: &BranchState,
        dir: NodeId,
        temp: &OsStr,
        attr: &Attr,
        truncating: bool,
        name: &OsStr,
    ) -> Result<Entry> {
        let create = Op::Create { parent: dir, name: temp, mode: 0o600, flags: libc::O_WRONLY | libc::O_EXCL };
        let (e, dst) = match upper.top().call(&daemon(), &create)? {
            Reply::Created(e, o) => (e, o),
            _ => return Err(Error::Os(libc::EIO)),
        };
        let logged = !truncating && attr.size >= LOG_COPIES_FROM;
        if logged {
            tracing::info!("union '{}': copying up {} ({} MiB)", self.name, name.to_string_lossy(), attr.size >> 20);
        }
        let copied = if truncating { Ok(()) } else { self.copy_data(from, src, upper, e.node, &dst, attr.size) };
        let synced = copied.and_then(|()| upper.top().call(&daemon(), &Op::Fsync { node: e.node, fh: dst.fh, datasync: false }));
        let _ = upper.top().release(&daemon(), e.node, dst.fh);
        if logged {
            tracing::info!("union '{}': copy-up of {} done", self.name, name.to_string_lossy());
        }
        match synced {
            Ok(_) => Ok(e),
            Err(err) => {
                upper.top().forget(&daemon(), e.node, 1);
                Err(err)
            }
        }
    }

    fn copy_data(
        &self,
        from: &BranchState,
        src: NodeId,
        upper: &BranchState,
        dst_node: NodeId,
        dst: &Opened,
        size: u64,
    ) -> Result<()> {
        let source = from.top().open(&daemon(), src, libc::O_RDONLY)?;
        let result = match (&source.backing, &dst.backing) {
            (Some(s), Some(d)) => copy_file_range(s.as_raw_fd(), d.as_raw_fd(), size),
            _ => (|| {
                let mut offset = 0u64;
                loop {
                    let data = from.top().read(&daemon(), src, source.fh, offset, COPY_CHUNK)?;
                    if data.is_empty() {
                        return Ok(());
                    }
                    let mut done = 0;
                    while done < data.len() {
                        done += upper.top().write(&daemon(), dst_node, dst.fh, offset + done as u64, &data[done..])? as usize;
                    }
                    offset += data.len() as u64;
                }
            })(),
        };
        let _ = from.top().release(&daemon(), src, source.fh);
        result
    }

    /// Extended attributes, origin, owner, mode and times of `src` onto its copy `dst`.
    fn copy_meta(&self, from: &BranchState, src: NodeId, upper: &BranchState, dst: NodeId, attr: &Attr, id: NodeId) -> Result<()> {
        let cx = daemon();
        if attr.kind != FileKind::Symlink {
            let names = match from.top().call(&cx, &Op::ListXattr { node: src, size: 65536 })? {
                Reply::Xattr(XattrReply::Data(d)) => d,
                _ => Vec::new(),
            };
            for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()).map(std::os::unix::ffi::OsStrExt::from_bytes) {
                let name: &OsStr = name;
                if is_hidden_xattr(name) {
                    continue;
                }
                let value = match from.top().call(&cx, &Op::GetXattr { node: src, name, size: 65536 }) {
                    Ok(Reply::Xattr(XattrReply::Data(v))) => v,
                    _ => continue,
                };
                upper.top().call(&cx, &Op::SetXattr { node: dst, name, value: &value, flags: 0 }).map_err(|e| {
                    Error::Corrupt(format!("union '{}': copy-up cannot keep attribute {}: {e}", self.name, name.to_string_lossy()))
                })?;
            }
            self.set_flag(upper, dst, ORIGIN_XATTR, id.0.to_string().as_bytes())?;
        }
        let owner = SetAttr { uid: Some(attr.uid), gid: Some(attr.gid), ..SetAttr::default() };
        let owned = upper.top().call(&cx, &Op::SetAttr { node: dst, fh: None, set: owner });
        if attr.kind == FileKind::Symlink {
            // Not every lower file system lets a symlink's owner change; the link still works.
            return Ok(());
        }
        owned?;
        let rest = SetAttr {
            mode: Some(u32::from(attr.perm)),
            atime: Some(TimeSet::At(attr.atime)),
            mtime: Some(TimeSet::At(attr.mtime)),
            ..SetAttr::default()
        };
        upper.top().call(&cx, &Op::SetAttr { node: dst, fh: None, set: rest })?;
        Ok(())
    }
}

fn entry_of(reply: Reply) -> Result<Entry> {
    match reply {
        Reply::Entry(e) => Ok(e),
        _ => Err(Error::Os(libc::EIO)),
    }
}

/// Copy `size` bytes in the kernel (a reflink where the file system can).
fn copy_file_range(from: i32, to: i32, size: u64) -> Result<()> {
    let (mut off_in, mut off_out): (i64, i64) = (0, 0);
    while (off_in as u64) < size {
        let want = (size - off_in as u64).min(1 << 30) as usize;
        let n = unsafe { libc::copy_file_range(from, &mut off_in, to, &mut off_out, want, 0) };
        if n < 0 {
            return Err(Error::last_os());
        }
        if n == 0 {
            break;
        }
    }
    Ok(())
}
