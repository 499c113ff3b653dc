//! Copying objects from one level to another: the union's copy-up and the mirror's resync.
//!
//! A copy is made under a temporary name in its target directory, complete (data made durable,
//! extended attributes, owner, mode, times) before it is renamed to its name, so a crash leaves
//! either the old object or the new one and at most a temporary file, which is never shown and is
//! removed when found. Data moves by `copy_file_range` between the two levels' files when neither
//! transforms it (so by reflink where the file system can), else through the stacks. Either way
//! only the source's data extents are copied (`SEEK_DATA`/`SEEK_HOLE`) and the length is set
//! last, so a sparse file's copy keeps its holes: a version of a 1 GiB file holding 8 bytes
//! takes 8 bytes' blocks, not 1 GiB (#29).

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use plyfs_stack::shared::NoReplace;
use plyfs_stack::{Attr, Caller, Entry, Error, FileHandle, FileKind, Level, NodeId, Op, Opened, Reply, Result, SetAttr, TimeSet, XattrReply};

/// Data is copied through the stacks in pieces of this size.
const COPY_CHUNK: u32 = 1 << 20;

fn daemon() -> Caller {
    Caller::daemon()
}

pub fn entry_of(reply: Reply) -> Result<Entry> {
    match reply {
        Reply::Entry(e) | Reply::Created(e, _) => Ok(e),
        _ => Err(Error::Os(libc::EIO)),
    }
}

/// Temporary names for copies in progress: `PREFIX.PID.TOKEN.N`, the token random per process
/// (mounts on other machines sharing the tree may have the same process ids). Names with the
/// prefix that no copy is writing are leftovers of a crash.
pub struct TempNames {
    prefix: &'static str,
    /// `PREFIX.PID.TOKEN.`: this process's names.
    mine: String,
    counter: AtomicU64,
    in_progress: Mutex<HashSet<OsString>>,
    /// How [`Self::place_new`] renames.
    no_replace: NoReplace,
}

/// Another process's temporary name is left over (not a copy in progress in another mount of a
/// shared tree) once unchanged for this long: a copy in progress writes its data or its metadata
/// all along.
pub const OTHERS_LEFTOVER_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

impl TempNames {
    pub fn new(prefix: &'static str) -> TempNames {
        let mut token = [0u8; 4];
        getrandom::getrandom(&mut token).expect("the system's random number generator failed");
        let mine = format!("{prefix}{}.{:08x}.", std::process::id(), u32::from_le_bytes(token));
        TempNames {
            prefix,
            mine,
            counter: AtomicU64::new(0),
            in_progress: Mutex::new(HashSet::new()),
            no_replace: NoReplace::default(),
        }
    }

    pub fn is_temp(&self, name: &OsStr) -> bool {
        name.as_bytes().starts_with(self.prefix.as_bytes())
    }

    /// A temporary name no copy is writing now, judging by the name: one of this process's not
    /// in progress, or, unless other mounts share the tree (`-o shared`), any other process's.
    /// With sharing, another process's name is a leftover only once [`OTHERS_LEFTOVER_AFTER`]
    /// passed since it last changed: `changed` gives that time, asked only then.
    pub fn is_leftover(&self, name: &OsStr, changed: impl FnOnce() -> Option<std::time::SystemTime>) -> bool {
        if !self.is_temp(name) {
            return false;
        }
        if name.as_bytes().starts_with(self.mine.as_bytes()) {
            return !self.in_progress.lock().contains(name);
        }
        plyfs_stack::shared::mode().is_none()
            || changed().and_then(|t| t.elapsed().ok()).is_some_and(|age| age >= OTHERS_LEFTOVER_AFTER)
    }

    fn next_name(&self) -> OsString {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let temp = OsString::from(format!("{}{n}", self.mine));
        self.in_progress.lock().insert(temp.clone());
        temp
    }

    /// Like [`Self::place`], but the object only takes `name` if nothing has it: otherwise the
    /// copy goes and the result is `EEXIST` (another mount sharing the tree was first).
    /// (See [`NoReplace`].)
    pub fn place_new(&self, to: &Level, dir: NodeId, name: &OsStr, make: impl FnOnce(&OsStr) -> Result<Entry>) -> Result<Entry> {
        self.place_by(to, dir, make, |temp, e| self.rename_new(to, (dir, temp), (dir, name), e.node, e.attr.kind))
    }

    /// Rename `from` (the object `node`, of kind `kind`) to `to`, unless `to` exists (`EEXIST`).
    pub fn rename_new(&self, level: &Level, from: (NodeId, &OsStr), to: (NodeId, &OsStr), node: NodeId, kind: FileKind) -> Result<()> {
        self.no_replace.rename(level, &daemon(), from, to, node, kind)
    }

    /// Make an object under a fresh temporary name in `dir` of `to` with `make`, then rename it
    /// to `name` (replacing what is there). On failure nothing is left behind.
    pub fn place(&self, to: &Level, dir: NodeId, name: &OsStr, make: impl FnOnce(&OsStr) -> Result<Entry>) -> Result<Entry> {
        self.place_by(to, dir, make, |temp, _| {
            to.call(&daemon(), &Op::Rename { parent: dir, name: temp, new_parent: dir, new_name: name, flags: 0 }).map(|_| ())
        })
    }

    /// `make` the object under a temporary name in `dir`, then `rename` it from there; on
    /// failure nothing is left behind.
    fn place_by(
        &self,
        to: &Level,
        dir: NodeId,
        make: impl FnOnce(&OsStr) -> Result<Entry>,
        rename: impl FnOnce(&OsStr, &Entry) -> Result<()>,
    ) -> Result<Entry> {
        let temp = self.next_name();
        let result = make(&temp).and_then(|e| match rename(&temp, &e) {
            Ok(()) => Ok(e),
            Err(err) => {
                to.forget(&daemon(), e.node, 1);
                Err(err)
            }
        });
        if result.is_err() {
            let _ = to.call(&daemon(), &Op::Unlink { parent: dir, name: &temp });
            let _ = to.call(&daemon(), &Op::RmDir { parent: dir, name: &temp });
        }
        self.in_progress.lock().remove(&temp);
        result
    }
}

/// How a file's data is copied.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Data {
    /// Copied and made durable before the copy is used (it may replace the only other copy).
    Durable,
    /// Copied; the caller makes everything durable later in one go (`lower-sync`), and can
    /// redo the copy if a crash loses it meanwhile.
    Deferred,
    /// Not copied at all (an `O_TRUNC` copy-up).
    Skipped,
}

/// A copy of `src` (attributes `attr`) of `from`, made as `name` in `dir` of `to`: a file with
/// its data as `data` says, a symlink, a special file, or an empty directory. Its metadata is
/// [`copy_meta`]'s to set.
pub fn copy_object(from: &Level, src: NodeId, attr: &Attr, to: &Level, dir: NodeId, name: &OsStr, data: Data) -> Result<Entry> {
    let cx = daemon();
    match attr.kind {
        FileKind::File => {
            let create = Op::Create { parent: dir, name, mode: 0o600, flags: libc::O_WRONLY | libc::O_EXCL };
            let (e, dst) = match to.call(&cx, &create)? {
                Reply::Created(e, o) => (e, o),
                _ => return Err(Error::Os(libc::EIO)),
            };
            let copied = if data == Data::Skipped { Ok(()) } else { copy_data(from, src, to, e.node, &dst, attr.size) };
            let synced = copied.and_then(|()| match data {
                Data::Deferred => Ok(Reply::Empty),
                _ => to.call(&cx, &Op::Fsync { node: e.node, fh: dst.fh, datasync: false }),
            });
            let _ = to.release(&cx, e.node, dst.fh);
            match synced {
                Ok(_) => Ok(e),
                Err(err) => {
                    to.forget(&cx, e.node, 1);
                    Err(err)
                }
            }
        }
        FileKind::Dir => entry_of(to.call(&cx, &Op::MkDir { parent: dir, name, mode: 0o700 })?),
        FileKind::Symlink => {
            let target = match from.call(&cx, &Op::ReadLink { node: src })? {
                Reply::Data(d) => PathBuf::from(OsString::from_vec(d)),
                _ => return Err(Error::Os(libc::EIO)),
            };
            entry_of(to.call(&cx, &Op::SymLink { parent: dir, name, target: &target })?)
        }
        other => entry_of(to.call(&cx, &Op::MkNod { parent: dir, name, mode: other.mode_bits() | 0o600, rdev: attr.rdev })?),
    }
}

/// The data of `src` (`size` bytes) into the open, empty file `dst`, holes kept.
pub fn copy_data(from: &Level, src: NodeId, to: &Level, dst_node: NodeId, dst: &Opened, size: u64) -> Result<()> {
    let cx = daemon();
    let source = from.open(&cx, src, libc::O_RDONLY)?;
    let copied = match (&source.backing, &dst.backing) {
        (Some(s), Some(d)) => {
            let (s, d) = (s.as_raw_fd(), d.as_raw_fd());
            for_each_data_extent(size, seek_fd(s), |start, end| copy_file_range(s, d, start, end))
        }
        _ => for_each_data_extent(size, seek_level(from, src, source.fh), |start, end| {
            copy_through_stacks(from, (src, source.fh), to, (dst_node, dst.fh), start, end)
        }),
    };
    // The length last: a hole at the end is no data extent.
    let result = copied.and_then(|()| {
        let length = SetAttr { size: Some(size), ..SetAttr::default() };
        to.call(&cx, &Op::SetAttr { node: dst_node, fh: Some(dst.fh), set: length }).map(|_| ())
    });
    let _ = from.release(&cx, src, source.fh);
    result
}

/// Bytes `start..end` of `src` to the same place in `dst`, read and written through the stacks.
fn copy_through_stacks(
    from: &Level,
    src: (NodeId, FileHandle),
    to: &Level,
    (dst, dst_fh): (NodeId, FileHandle),
    start: u64,
    end: u64,
) -> Result<()> {
    read_range(from, src, start, end, |offset, data| {
        let mut done = 0;
        while done < data.len() {
            done += to.write(&daemon(), dst, dst_fh, offset + done as u64, &data[done..])? as usize;
        }
        Ok(())
    })
}

/// Read bytes `start..end` of the open file `node` of `level` in pieces, each handed to `sink`
/// with its offset; less if the file ends sooner.
pub fn read_range(
    level: &Level,
    (node, fh): (NodeId, FileHandle),
    start: u64,
    end: u64,
    mut sink: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    let mut offset = start;
    while offset < end {
        let data = level.read(&daemon(), node, fh, offset, (end - offset).min(u64::from(COPY_CHUNK)) as u32)?;
        if data.is_empty() {
            return Ok(());
        }
        sink(offset, &data)?;
        offset += data.len() as u64;
    }
    Ok(())
}

/// Call `copy(start, end)` for each stretch of data in the first `size` bytes of a file, in
/// order, skipping its holes as `seek` (an `lseek` with `SEEK_DATA` or `SEEK_HOLE`; `None` for
/// `ENXIO`, no data past the offset) finds them. A file whose file system cannot tell is data
/// throughout. Holes are only kept, never made: zeros the source stores are data.
pub fn for_each_data_extent(
    size: u64,
    mut seek: impl FnMut(u64, i32) -> Result<Option<u64>>,
    mut copy: impl FnMut(u64, u64) -> Result<()>,
) -> Result<()> {
    let mut offset = 0;
    while offset < size {
        let start = match seek(offset, libc::SEEK_DATA) {
            Ok(Some(start)) if start < size => start,
            Ok(_) => return Ok(()),
            Err(e) if offset == 0 && matches!(e.errno(), libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => return copy(0, size),
            Err(e) => return Err(e),
        };
        // A hole at or before `start` means the file changed meanwhile: the rest is taken as data.
        let end = seek(start, libc::SEEK_HOLE)?.filter(|&hole| hole > start).map_or(size, |hole| hole.min(size));
        copy(start, end)?;
        offset = end;
    }
    Ok(())
}

/// `lseek` on an open file, as [`for_each_data_extent`] asks it.
pub fn seek_fd(fd: RawFd) -> impl FnMut(u64, i32) -> Result<Option<u64>> {
    move |offset, whence| match unsafe { libc::lseek(fd, offset as i64, whence) } {
        pos if pos >= 0 => Ok(Some(pos as u64)),
        _ => match Error::last_os() {
            Error::Os(libc::ENXIO) => Ok(None),
            e => Err(e),
        },
    }
}

/// `lseek` through a level on its open file `fh`, as [`for_each_data_extent`] asks it.
pub fn seek_level(level: &Level, node: NodeId, fh: FileHandle) -> impl FnMut(u64, i32) -> Result<Option<u64>> + '_ {
    move |offset, whence| match level.call(&daemon(), &Op::Lseek { node, fh, offset: offset as i64, whence }) {
        Ok(Reply::Offset(pos)) => Ok(Some(pos)),
        Ok(_) => Err(Error::Os(libc::EIO)),
        Err(Error::Os(libc::ENXIO)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Extended attributes (those `keep` accepts), owner, mode and times of `src` onto `dst`.
pub fn copy_meta(from: &Level, src: NodeId, to: &Level, dst: NodeId, attr: &Attr, keep: impl Fn(&OsStr) -> bool) -> Result<()> {
    let cx = daemon();
    if attr.kind != FileKind::Symlink {
        let names = match from.call(&cx, &Op::ListXattr { node: src, size: 65536 })? {
            Reply::Xattr(XattrReply::Data(d)) => d,
            _ => Vec::new(),
        };
        for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()).map(OsStr::from_bytes) {
            if !keep(name) {
                continue;
            }
            let value = match from.call(&cx, &Op::GetXattr { node: src, name, size: 65536 }) {
                Ok(Reply::Xattr(XattrReply::Data(v))) => v,
                _ => continue,
            };
            to.call(&cx, &Op::SetXattr { node: dst, name, value: &value, flags: 0 })
                .map_err(|e| Error::Corrupt(format!("a copy cannot keep the attribute {}: {e}", name.to_string_lossy())))?;
        }
    }
    let owner = SetAttr { uid: Some(attr.uid), gid: Some(attr.gid), ..SetAttr::default() };
    let owned = to.call(&cx, &Op::SetAttr { node: dst, fh: None, set: owner });
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
    to.call(&cx, &Op::SetAttr { node: dst, fh: None, set: rest })?;
    Ok(())
}

/// Copy bytes `start..end` in the kernel to the same place (a reflink where the file system can).
fn copy_file_range(from: RawFd, to: RawFd, start: u64, end: u64) -> Result<()> {
    let (mut off_in, mut off_out) = (start as i64, start as i64);
    while (off_in as u64) < end {
        let want = (end - off_in as u64).min(1 << 30) as usize;
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
