//! Attributes and extended attributes.

use std::time::SystemTime;
use plyfs_stack::{Error, Result};
use crate::format::Inode;

use super::{Fs, PERSISTENCE_XATTR, XATTR_MAX};

impl Fs {
    pub fn getattr(&self, ino: u64) -> Result<Inode> {
        let mut st = self.lock();
        Ok(self.node(&mut st, ino)?.attrs.clone())
    }

    /// Change attributes (the caller checked who may).
    pub fn set_attrs(&self, ino: u64, change: impl FnOnce(&mut Inode)) -> Result<Inode> {
        let mut st = self.lock();
        let n = self.node(&mut st, ino)?;
        change(&mut n.attrs);
        n.dirty = true;
        let attrs = n.attrs.clone();
        self.settle(&mut st, ino, true)?;
        Ok(attrs)
    }

    /// A read of `ino` moves its access time as Linux's default `relatime` does: when it is not
    /// later than the last modification or change, or is a day old (xfstests generic/192).
    /// Otherwise nothing changes, so reading stays free of write-back.
    pub fn note_read(&self, ino: u64) -> Result<()> {
        let mut st = self.lock();
        let n = self.node(&mut st, ino)?;
        let now = SystemTime::now();
        let a = &n.attrs;
        let day_old = now.duration_since(a.atime).is_ok_and(|d| d >= std::time::Duration::from_secs(24 * 3600));
        if a.atime <= a.mtime || a.atime <= a.ctime || day_old {
            n.attrs.atime = now;
            n.dirty = true;
            self.settle(&mut st, ino, true)?;
        }
        Ok(())
    }

    pub fn get_xattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        let mut st = self.lock();
        self.node(&mut st, ino)?.xattrs.get(name).cloned().ok_or(Error::Os(libc::ENODATA))
    }

    pub fn list_xattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        let mut st = self.lock();
        Ok(self.node(&mut st, ino)?.xattrs.keys().cloned().collect())
    }

    /// Set (`value`) or remove (`None`) an extended attribute, with `XATTR_CREATE` and
    /// `XATTR_REPLACE`. `user.exofs.persistence` takes `data`, `metadata` or `memory`.
    pub fn set_xattr(&self, ino: u64, name: &[u8], value: Option<&[u8]>, flags: i32) -> Result<()> {
        if name.is_empty() || name.len() > 255 {
            return Err(Error::Os(libc::ERANGE));
        }
        if name == PERSISTENCE_XATTR && value.is_some_and(|v| !matches!(v, b"data" | b"metadata" | b"memory")) {
            return Err(Error::BadArgs(format!(
                "{}: '{}' is not a persistence model (data, metadata or memory)",
                String::from_utf8_lossy(PERSISTENCE_XATTR),
                String::from_utf8_lossy(value.unwrap_or_default())
            )));
        }
        let mut st = self.lock();
        let n = self.node(&mut st, ino)?;
        let exists = n.xattrs.contains_key(name);
        match value {
            Some(v) => {
                if flags & libc::XATTR_CREATE != 0 && exists {
                    return Err(Error::Os(libc::EEXIST));
                }
                if flags & libc::XATTR_REPLACE != 0 && !exists {
                    return Err(Error::Os(libc::ENODATA));
                }
                let others: usize = n.xattrs.iter().filter(|(k, _)| k.as_slice() != name).map(|(k, v)| 3 + k.len() + v.len()).sum();
                if others + 3 + name.len() + v.len() > XATTR_MAX {
                    return Err(Error::Os(libc::ENOSPC));
                }
                n.xattrs.insert(name.to_vec(), v.to_vec());
            }
            None => {
                if n.xattrs.remove(name).is_none() {
                    return Err(Error::Os(libc::ENODATA));
                }
            }
        }
        n.attrs.ctime = SystemTime::now();
        n.dirty = true;
        self.settle(&mut st, ino, true)
    }
}
