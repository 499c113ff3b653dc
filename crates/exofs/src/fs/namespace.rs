//! The namespace: directories (read once, then kept and changed in memory), lookup, making,
//! removing, linking and renaming names.

use std::ffi::{OsStr, OsString};
use std::time::SystemTime;
use plyfs_stack::{Error, FileKind, Result};
use crate::format::{decode_dir, valid_name, Dir, Inode};

use super::{Fs, State, PERSISTENCE_XATTR};

impl Fs {
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<(u64, Inode)> {
        let mut st = self.lock();
        let (ino, _) = *self.dir(&mut st, parent)?.get(name).ok_or(Error::Os(libc::ENOENT))?;
        let attrs = self.node(&mut st, ino)?.attrs.clone();
        Ok((ino, attrs))
    }

    /// The directory `ino`'s entries.
    pub fn read_dir(&self, ino: u64) -> Result<Dir> {
        let mut st = self.lock();
        let d = self.dir(&mut st, ino)?.clone();
        st.recent = d.values().filter(|(_, k)| *k == FileKind::File).map(|(i, _)| *i).collect();
        Ok(d)
    }

    /// The directory `ino`'s entries, read once and then kept (and changed) in memory.
    fn dir<'a>(&self, st: &'a mut State, ino: u64) -> Result<&'a mut Dir> {
        let n = self.node(st, ino)?;
        if n.attrs.kind != FileKind::Dir {
            return Err(Error::Os(libc::ENOTDIR));
        }
        if n.dir.is_none() {
            let size = n.attrs.size as usize;
            let bytes = self.read_at(st, ino, 0, size)?;
            let mut d = decode_dir(&bytes).map_err(|e| Error::Corrupt(format!("exofs directory {ino}: {e}")))?;
            // A record whose inode did not reach the disk before a crash names nothing: it goes.
            let before = d.len();
            d.retain(|_, (i, _)| st.paths.contains_key(i) || st.nodes.contains_key(i));
            let dropped = before - d.len();
            self.node(st, ino)?.dir = Some(d);
            if dropped > 0 {
                tracing::warn!("exofs: directory {ino}: dropped {dropped} entries whose inodes were lost in a crash");
                self.dir_changed(st, ino)?;
            }
        }
        Ok(self.node(st, ino)?.dir.as_mut().expect("read"))
    }

    /// A directory's entries changed (in memory): they are written back with its inode
    /// ([`Fs::sync`]).
    fn dir_changed(&self, st: &mut State, ino: u64) -> Result<()> {
        let n = self.node(st, ino)?;
        n.dir_dirty = true;
        n.attrs.mtime = SystemTime::now();
        n.attrs.ctime = n.attrs.mtime;
        n.dirty = true;
        Ok(())
    }

    /// A directory's entries replaced.
    fn store_dir(&self, st: &mut State, ino: u64, d: Dir) -> Result<()> {
        *self.dir(st, ino)? = d;
        self.dir_changed(st, ino)
    }

    /// Make `name` in `parent` (a file, directory, symlink or special file).
    pub fn make(&self, parent: u64, name: &OsStr, attrs: Inode, content: &[u8]) -> Result<u64> {
        if !valid_name(name) {
            return Err(Error::Os(if name.len() > 255 { libc::ENAMETOOLONG } else { libc::EINVAL }));
        }
        let mut st = self.lock();
        if self.dir(&mut st, parent)?.contains_key(name) {
            return Err(Error::Os(libc::EEXIST));
        }
        let kind = attrs.kind;
        let is_dir = kind == FileKind::Dir;
        let inherited = self.node(&mut st, parent)?.xattrs.get(PERSISTENCE_XATTR).cloned();
        let ino = self.with_room(&mut st, |st| {
            let ino = self.new_inode(st, attrs.clone(), parent)?;
            if let Some(model) = &inherited {
                // A directory's persistence model goes to what is made in it.
                self.node(st, ino)?.xattrs.insert(PERSISTENCE_XATTR.to_vec(), model.clone());
            }
            if !content.is_empty() {
                if let Err(e) = self.set_content(st, ino, content) {
                    // Nothing names it: it goes back.
                    self.free_inode(st, ino)?;
                    return Err(e);
                }
            }
            Ok(ino)
        })?;
        self.dir(&mut st, parent)?.insert(name.to_owned(), (ino, kind));
        self.dir_changed(&mut st, parent)?;
        if is_dir {
            self.node(&mut st, parent)?.attrs.nlink += 1;
        }
        self.settle(&mut st, ino, true)?;
        Ok(ino)
    }

    /// Remove `name` from `parent`; the inode goes when its last link does.
    pub fn remove(&self, parent: u64, name: &OsStr, dir: bool) -> Result<()> {
        let mut st = self.lock();
        let (ino, kind) = *self.dir(&mut st, parent)?.get(name).ok_or(Error::Os(libc::ENOENT))?;
        match (dir, kind == FileKind::Dir) {
            (true, false) => return Err(Error::Os(libc::ENOTDIR)),
            (false, true) => return Err(Error::Os(libc::EISDIR)),
            (true, true) if !self.dir(&mut st, ino)?.is_empty() => return Err(Error::Os(libc::ENOTEMPTY)),
            _ => {}
        }
        self.dir(&mut st, parent)?.remove(name);
        self.dir_changed(&mut st, parent)?;
        if dir {
            self.node(&mut st, parent)?.attrs.nlink -= 1;
        }
        let n = self.node(&mut st, ino)?;
        n.attrs.nlink = n.attrs.nlink.saturating_sub(if dir { 2 } else { 1 });
        n.attrs.ctime = SystemTime::now();
        n.dirty = true;
        self.maybe_free(&mut st, ino)?;
        self.settle(&mut st, parent, true)
    }

    /// A second name for `ino`.
    pub fn link(&self, ino: u64, parent: u64, name: &OsStr) -> Result<Inode> {
        if !valid_name(name) {
            return Err(Error::Os(libc::ENAMETOOLONG));
        }
        let mut st = self.lock();
        let kind = self.node(&mut st, ino)?.attrs.kind;
        if kind == FileKind::Dir {
            return Err(Error::Os(libc::EPERM));
        }
        let d = self.dir(&mut st, parent)?;
        if d.contains_key(name) {
            return Err(Error::Os(libc::EEXIST));
        }
        d.insert(name.to_owned(), (ino, kind));
        self.dir_changed(&mut st, parent)?;
        let n = self.node(&mut st, ino)?;
        n.attrs.nlink += 1;
        n.attrs.ctime = SystemTime::now();
        n.dirty = true;
        let attrs = n.attrs.clone();
        self.settle(&mut st, parent, true)?;
        Ok(attrs)
    }

    /// `rename(2)`, with `RENAME_NOREPLACE`, `RENAME_EXCHANGE` and `RENAME_WHITEOUT`: with
    /// `whiteout` (the new inode's attributes: a character device 0:0), the old name is left to a
    /// whiteout in the same change, as overlayfs needs of its upper directory. Any other flag,
    /// or `RENAME_EXCHANGE` with another, is refused with `EINVAL` (xfstests generic/078 found
    /// `RENAME_WHITEOUT` ignored).
    pub fn rename(&self, parent: u64, name: &OsStr, new_parent: u64, new_name: &OsStr, flags: u32, whiteout: Option<Inode>) -> Result<()> {
        let (noreplace, exchange, white) = (libc::RENAME_NOREPLACE, libc::RENAME_EXCHANGE, libc::RENAME_WHITEOUT);
        if flags & !(noreplace | exchange | white) != 0
            || flags & exchange != 0 && flags != exchange
            || (flags & white != 0) != whiteout.is_some()
        {
            return Err(Error::Os(libc::EINVAL));
        }
        if !valid_name(new_name) {
            return Err(Error::Os(libc::ENAMETOOLONG));
        }
        let mut st = self.lock();
        let mut from = self.dir(&mut st, parent)?.clone();
        let (ino, kind) = *from.get(name).ok_or(Error::Os(libc::ENOENT))?;
        let mut to = if new_parent == parent { from.clone() } else { self.dir(&mut st, new_parent)?.clone() };
        let existing = to.get(new_name).copied();
        if flags & libc::RENAME_EXCHANGE != 0 {
            let (other, okind) = existing.ok_or(Error::Os(libc::ENOENT))?;
            if new_parent == parent {
                from.insert(name.to_owned(), (other, okind));
                from.insert(new_name.to_owned(), (ino, kind));
                self.store_dir(&mut st, parent, from)?;
            } else {
                from.insert(name.to_owned(), (other, okind));
                to.insert(new_name.to_owned(), (ino, kind));
                self.store_dir(&mut st, parent, from)?;
                self.store_dir(&mut st, new_parent, to)?;
                let moved_dirs = (kind == FileKind::Dir) as i32 - (okind == FileKind::Dir) as i32;
                self.adjust_links(&mut st, parent, -moved_dirs)?;
                self.adjust_links(&mut st, new_parent, moved_dirs)?;
            }
            for i in [ino, other] {
                let n = self.node(&mut st, i)?;
                n.attrs.ctime = SystemTime::now();
                n.dirty = true;
            }
            self.settle(&mut st, parent, true)?;
            return self.settle(&mut st, new_parent, true);
        }
        if let Some((other, okind)) = existing {
            if other == ino {
                return Ok(());
            }
            if flags & libc::RENAME_NOREPLACE != 0 {
                return Err(Error::Os(libc::EEXIST));
            }
            match (kind == FileKind::Dir, okind == FileKind::Dir) {
                (true, false) => return Err(Error::Os(libc::ENOTDIR)),
                (false, true) => return Err(Error::Os(libc::EISDIR)),
                (true, true) if !self.dir(&mut st, other)?.is_empty() => return Err(Error::Os(libc::ENOTEMPTY)),
                _ => {}
            }
        }
        from.remove(name);
        if let Some(attrs) = whiteout {
            let w = self.new_inode(&mut st, attrs, parent)?;
            from.insert(name.to_owned(), (w, FileKind::CharDevice));
            self.settle(&mut st, w, true)?;
        }
        if new_parent == parent {
            from.insert(new_name.to_owned(), (ino, kind));
            self.store_dir(&mut st, parent, from)?;
        } else {
            to.insert(new_name.to_owned(), (ino, kind));
            self.store_dir(&mut st, parent, from)?;
            self.store_dir(&mut st, new_parent, to)?;
            if kind == FileKind::Dir {
                self.adjust_links(&mut st, parent, -1)?;
                self.adjust_links(&mut st, new_parent, 1)?;
            }
        }
        let n = self.node(&mut st, ino)?;
        n.attrs.ctime = SystemTime::now();
        n.dirty = true;
        if let Some((other, okind)) = existing {
            let n = self.node(&mut st, other)?;
            n.attrs.nlink = n.attrs.nlink.saturating_sub(if okind == FileKind::Dir { 2 } else { 1 });
            n.attrs.ctime = SystemTime::now();
            n.dirty = true;
            if okind == FileKind::Dir {
                self.adjust_links(&mut st, new_parent, -1)?;
            }
            self.maybe_free(&mut st, other)?;
        }
        self.settle(&mut st, parent, true)?;
        self.settle(&mut st, new_parent, true)
    }

    fn adjust_links(&self, st: &mut State, ino: u64, by: i32) -> Result<()> {
        let n = self.node(st, ino)?;
        n.attrs.nlink = (n.attrs.nlink as i64 + by as i64).max(0) as u32;
        n.dirty = true;
        Ok(())
    }

    /// The directory's entries, for tests and tools: names and inode numbers.
    pub fn names(&self, ino: u64) -> Result<Vec<(OsString, u64)>> {
        Ok(self.read_dir(ino)?.into_iter().map(|(n, (i, _))| (n, i)).collect())
    }
}
