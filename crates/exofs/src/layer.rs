//! exofs as a plyfs bottom layer: `plyfs mount exodisk:SOCKET MNT --stack ...`.
//!
//! Node ids are inode numbers (exonode sectors); node 1, the mount's root, stands for the root
//! directory's inode. The kernel checks permissions (`default_permissions`); this layer keeps
//! the attributes that make those checks right, as a kernel file system's `inode_init_owner`
//! does for new objects.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use plyfs_stack::setid;
use plyfs_stack::{
    Attr, Caller, DirEntry, Entry, Error, ExtOpInfo, FileHandle, FileKind, Invalidator, Layer, Level, NodeId, Op, Opened, Reply,
    Result, StatFs, TimeSet, XattrReply,
};

use crate::format::Inode;
use crate::fs::Fs;

pub struct Exofs {
    name: String,
    fs: std::sync::Arc<Fs>,
    next_fh: AtomicU64,
    /// Each open directory's entries as they were at `opendir`: offsets into it stay valid
    /// while entries are removed (as `rm -rf` does between reads), and it is copied once per
    /// open, not once per read.
    listings: parking_lot::Mutex<std::collections::HashMap<u64, std::sync::Arc<Listing>>>,
    /// The front end's, to drop the kernel's cache of a file changed by an extended operation.
    invalidator: parking_lot::Mutex<Option<std::sync::Arc<dyn Invalidator>>>,
}

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo {
        name: "insert",
        args: "OFFSET DATA",
        help: "put DATA before byte OFFSET of a file without copying what follows (constant time whatever the size)",
    },
    ExtOpInfo {
        name: "punch",
        args: "OFFSET LENGTH",
        help: "remove LENGTH bytes at OFFSET of a file, moving what follows down without copying it",
    },
];

/// A directory's entries in order: name, inode, kind.
type Listing = Vec<(std::ffi::OsString, u64, FileKind)>;

/// How often changed metadata is written back (as ext4's commit interval).
const WRITE_BACK: std::time::Duration = std::time::Duration::from_secs(5);

impl Exofs {
    pub fn new(name: &str, fs: Fs) -> Exofs {
        let fs = std::sync::Arc::new(fs);
        let weak = std::sync::Arc::downgrade(&fs);
        let _ = std::thread::Builder::new().name("exofs-writeback".into()).spawn(move || loop {
            std::thread::sleep(WRITE_BACK);
            let Some(fs) = weak.upgrade() else { return };
            if let Err(e) = fs.sync() {
                tracing::error!("exofs: {}: periodic write-back: {e}", fs.socket().display());
            }
        });
        Exofs {
            name: name.to_owned(),
            fs,
            next_fh: AtomicU64::new(1),
            listings: Default::default(),
            invalidator: Default::default(),
        }
    }

    pub fn level(self) -> Level {
        Level::new(std::sync::Arc::new(self))
    }

    /// A directory's entries, in order.
    fn listing(&self, ino: u64) -> Result<Listing> {
        Ok(self.fs.read_dir(ino)?.into_iter().map(|(n, (i, k))| (n, i, k)).collect())
    }

    /// A file's bytes moved behind the kernel's back: what it caches of them goes.
    fn moved(&self, node: NodeId, attrs: &Inode) -> Result<Reply> {
        if let Some(inv) = self.invalidator.lock().as_ref() {
            inv.node(node);
        }
        Ok(Reply::Extended(serde_json::json!({ "size": attrs.size })))
    }

    fn ino(&self, n: NodeId) -> u64 {
        if n == NodeId::ROOT {
            self.fs.root()
        } else {
            n.0
        }
    }

    fn node(&self, ino: u64) -> NodeId {
        if ino == self.fs.root() {
            NodeId::ROOT
        } else {
            NodeId(ino)
        }
    }

    fn attr(i: &Inode) -> Attr {
        Attr {
            size: i.size,
            blocks: i.size.div_ceil(512),
            atime: i.atime,
            mtime: i.mtime,
            ctime: i.ctime,
            kind: i.kind,
            perm: i.perm,
            nlink: i.nlink,
            uid: i.uid,
            gid: i.gid,
            rdev: i.rdev,
            blksize: 4096,
        }
    }

    /// An entry for the layer above, which then holds one more lookup of it.
    fn entry(&self, ino: u64, i: &Inode) -> Entry {
        self.fs.looked_up(ino);
        Entry { node: self.node(ino), attr: Self::attr(i), generation: i.generation }
    }

    /// A new object's attributes, as `inode_init_owner`: the caller's ids, or the directory's
    /// group when it is set-group-ID (which a new directory inherits).
    fn new_inode(&self, cx: &Caller, parent: u64, kind: FileKind, mode: u32, rdev: u32) -> Result<Inode> {
        let p = self.fs.getattr(parent)?;
        let mut perm = (mode & 0o7777) as u16;
        let gid = if p.perm & libc::S_ISGID as u16 != 0 {
            if kind == FileKind::Dir {
                perm |= libc::S_ISGID as u16;
            }
            p.gid
        } else {
            cx.gid
        };
        if kind != FileKind::Dir
            && perm & libc::S_ISGID as u16 != 0
            && perm & libc::S_IXGRP as u16 != 0
            && !setid::in_group(cx, gid)
        {
            perm &= !(libc::S_ISGID as u16);
        }
        let now = SystemTime::now();
        Ok(Inode {
            kind,
            perm,
            uid: cx.uid,
            gid,
            nlink: if kind == FileKind::Dir { 2 } else { 1 },
            rdev,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            generation: 1,
        })
    }

    /// Make `name`: `what` is its kind, mode and device number.
    fn make(&self, cx: &Caller, parent: NodeId, name: &OsStr, what: (FileKind, u32, u32), content: &[u8]) -> Result<Entry> {
        let (kind, mode, rdev) = what;
        let parent = self.ino(parent);
        let attrs = self.new_inode(cx, parent, kind, mode, rdev)?;
        let ino = self.fs.make(parent, name, attrs, content)?;
        let attrs = self.fs.getattr(ino)?;
        Ok(self.entry(ino, &attrs))
    }

    fn opened(&self, ino: u64) -> Opened {
        self.fs.opened(ino);
        Opened { fh: FileHandle(self.next_fh.fetch_add(1, Ordering::Relaxed)), backing: None, direct_io: false, flush_on_close: false }
    }
}

fn when(t: TimeSet) -> SystemTime {
    match t {
        TimeSet::Now => SystemTime::now(),
        TimeSet::At(t) => t,
    }
}

impl Layer for Exofs {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "exofs"
    }

    fn lower(&self) -> &[Level] {
        &[]
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        plyfs_stack::readonly::check(op)?;
        match *op {
            Op::Lookup { parent, name } => {
                if name.len() > 255 {
                    return Err(Error::Os(libc::ENAMETOOLONG));
                }
                let (ino, attrs) = self.fs.lookup(self.ino(parent), name)?;
                Ok(Reply::Entry(self.entry(ino, &attrs)))
            }
            Op::Forget { node, nlookup } => {
                if node != NodeId::ROOT {
                    self.fs.forget(node.0, nlookup)?;
                }
                Ok(Reply::Empty)
            }
            Op::GetAttr { node, .. } => Ok(Reply::Attr(Self::attr(&self.fs.getattr(self.ino(node))?))),
            Op::SetAttr { node, set, .. } => {
                let ino = self.ino(node);
                let before = self.fs.getattr(ino)?;
                // The set-ID rules a kernel file system applies (the kernel leaves the ones of
                // chown to us under FUSE_HANDLE_KILLPRIV_V2); write and truncate are the front
                // end's, which knows whether the caller has CAP_FSETID.
                let owned = setid::Owned { kind: before.kind, perm: before.perm.into(), uid: before.uid, gid: before.gid };
                let perm = setid::setattr_perm(cx, owned, &set)?;
                if let Some(size) = set.size {
                    if before.kind == FileKind::Dir {
                        return Err(Error::Os(libc::EISDIR));
                    }
                    self.fs.truncate(ino, size)?;
                }
                let now = SystemTime::now();
                let attrs = self.fs.set_attrs(ino, |a| {
                    if let Some(p) = perm {
                        a.perm = p as u16;
                    }
                    if let Some(u) = set.uid {
                        a.uid = u;
                    }
                    if let Some(g) = set.gid {
                        a.gid = g;
                    }
                    if let Some(t) = set.atime {
                        a.atime = when(t);
                    }
                    if let Some(t) = set.mtime {
                        a.mtime = when(t);
                    }
                    if set.size.is_some() && set.mtime.is_none() {
                        a.mtime = now;
                    }
                    a.ctime = now;
                })?;
                Ok(Reply::Attr(Self::attr(&attrs)))
            }
            Op::ReadLink { node } => {
                let ino = self.ino(node);
                let a = self.fs.getattr(ino)?;
                if a.kind != FileKind::Symlink {
                    return Err(Error::Os(libc::EINVAL));
                }
                Ok(Reply::Data(self.fs.read(ino, 0, a.size as usize)?))
            }
            Op::MkNod { parent, name, mode, rdev } => {
                let kind = FileKind::from_mode(mode).ok_or(Error::Os(libc::EINVAL))?;
                Ok(Reply::Entry(self.make(cx, parent, name, (kind, mode, rdev), &[])?))
            }
            Op::MkDir { parent, name, mode } => Ok(Reply::Entry(self.make(cx, parent, name, (FileKind::Dir, mode, 0), &[])?)),
            Op::SymLink { parent, name, target } => {
                let t = target.as_os_str().as_bytes();
                if t.is_empty() || t.len() >= libc::PATH_MAX as usize {
                    return Err(Error::Os(if t.is_empty() { libc::ENOENT } else { libc::ENAMETOOLONG }));
                }
                Ok(Reply::Entry(self.make(cx, parent, name, (FileKind::Symlink, 0o777, 0), t)?))
            }
            Op::Unlink { parent, name } => self.fs.remove(self.ino(parent), name, false).map(|()| Reply::Empty),
            Op::RmDir { parent, name } => self.fs.remove(self.ino(parent), name, true).map(|()| Reply::Empty),
            Op::Rename { parent, name, new_parent, new_name, flags } => {
                // A whiteout is a character device 0:0 of the caller's, as the kernel makes it.
                let whiteout = if flags & libc::RENAME_WHITEOUT != 0 {
                    Some(self.new_inode(cx, self.ino(parent), FileKind::CharDevice, 0, 0)?)
                } else {
                    None
                };
                self.fs.rename(self.ino(parent), name, self.ino(new_parent), new_name, flags, whiteout).map(|()| Reply::Empty)
            }
            Op::Link { node, new_parent, new_name } => {
                let ino = self.ino(node);
                let attrs = self.fs.link(ino, self.ino(new_parent), new_name)?;
                Ok(Reply::Entry(self.entry(ino, &attrs)))
            }
            Op::Open { node, .. } => Ok(Reply::Opened(self.opened(self.ino(node)))),
            Op::Create { parent, name, mode, .. } => {
                let e = self.make(cx, parent, name, (FileKind::File, mode, 0), &[])?;
                let o = self.opened(self.ino(e.node));
                Ok(Reply::Created(e, o))
            }
            Op::Read { node, offset, size, .. } => {
                let ino = self.ino(node);
                let data = self.fs.read(ino, offset, size as usize)?;
                self.fs.note_read(ino)?;
                Ok(Reply::Data(data))
            }
            Op::Write { node, offset, data, .. } => {
                let ino = self.ino(node);
                self.fs.write(ino, offset, data)?;
                let now = SystemTime::now();
                self.fs.set_attrs(ino, |a| {
                    a.mtime = now;
                    a.ctime = now;
                })?;
                Ok(Reply::Written(data.len() as u32))
            }
            Op::Flush { .. } => Ok(Reply::Empty),
            Op::Fsync { .. } | Op::FsyncDir { .. } => self.fs.sync().map(|()| Reply::Empty),
            Op::Release { node, .. } => self.fs.closed(self.ino(node)).map(|()| Reply::Empty),
            Op::OpenDir { node } => {
                let ino = self.ino(node);
                if self.fs.getattr(ino)?.kind != FileKind::Dir {
                    return Err(Error::Os(libc::ENOTDIR));
                }
                let fh = FileHandle(self.next_fh.fetch_add(1, Ordering::Relaxed));
                Ok(Reply::Opened(Opened { fh, backing: None, direct_io: false, flush_on_close: false }))
            }
            Op::ReadDir { node, fh, offset, max_entries, plus } => {
                let ino = self.ino(node);
                // Listed afresh from the start (`rewinddir` sees what changed), then kept.
                let listed = if offset == 0 { None } else { self.listings.lock().get(&fh.0).cloned() };
                let dir = match listed {
                    Some(d) => d,
                    None => {
                        let d = std::sync::Arc::new(self.listing(ino)?);
                        if fh.0 != 0 {
                            self.listings.lock().insert(fh.0, d.clone());
                        }
                        d
                    }
                };
                let mut out = Vec::new();
                let dots = [(".", node), ("..", node)];
                let all = dots
                    .iter()
                    .map(|(n, id)| (OsStr::new(n).to_owned(), *id, FileKind::Dir, true))
                    .chain(dir.iter().map(|(n, i, k)| (n.clone(), self.node(*i), *k, false)));
                for (i, (name, id, kind, dot)) in all.enumerate().skip(offset as usize) {
                    if out.len() as u32 >= max_entries {
                        break;
                    }
                    let entry = if plus && !dot {
                        match self.fs.getattr(self.ino(id)) {
                            Ok(a) => Some(self.entry(self.ino(id), &a)),
                            Err(_) => continue,
                        }
                    } else {
                        None
                    };
                    out.push(DirEntry { name, node: id, kind, next_offset: i as u64 + 1, entry });
                }
                Ok(Reply::Dir(out))
            }
            Op::ReleaseDir { fh, .. } => {
                self.listings.lock().remove(&fh.0);
                Ok(Reply::Empty)
            }
            Op::StatFs { .. } => {
                let (sectors, free, avail, inodes) = self.fs.statfs()?;
                Ok(Reply::StatFs(StatFs {
                    blocks: sectors / 8,
                    bfree: free / 8,
                    bavail: avail / 8,
                    files: inodes + free / 2,
                    ffree: free / 2,
                    bsize: 4096,
                    namelen: 255,
                    frsize: 4096,
                }))
            }
            Op::Access { .. } => Ok(Reply::Empty),
            Op::GetXattr { node, name, size } => {
                let value = self.fs.get_xattr(self.ino(node), name.as_bytes())?;
                xattr_reply(value, size)
            }
            Op::ListXattr { node, size } => {
                let mut names = Vec::new();
                for n in self.fs.list_xattr(self.ino(node))? {
                    names.extend_from_slice(&n);
                    names.push(0);
                }
                xattr_reply(names, size)
            }
            // POSIX ACLs are more than stored values: setting one changes the mode, chmod changes
            // the ACL, and a directory's default ACL shapes what is made in it. exofs does none
            // of that, and an ACL kept beside a mode it disagrees with would grant what the ACL
            // denies (xfstests generic/099). It refuses them, as a file system mounted `noacl`.
            Op::SetXattr { name, .. } if plyfs_stack::is_posix_acl_xattr(name) => Err(Error::Os(libc::EOPNOTSUPP)),
            Op::SetXattr { node, name, value, flags } => {
                self.fs.set_xattr(self.ino(node), name.as_bytes(), Some(value), flags).map(|()| Reply::Empty)
            }
            Op::RemoveXattr { node, name } => self.fs.set_xattr(self.ino(node), name.as_bytes(), None, 0).map(|()| Reply::Empty),
            Op::Fallocate { .. } => Err(Error::Os(libc::EOPNOTSUPP)),
            Op::Lseek { .. } => Err(Error::Os(libc::ENOSYS)),
            // No file-attribute flags in exofs.
            Op::Ioctl { .. } => Err(Error::Os(libc::ENOTTY)),
            Op::Extended { node, name: "insert", args } => {
                let [off, data] = args else { return Err(Error::BadArgs("usage: insert OFFSET DATA".into())) };
                let off = off.parse().map_err(|_| Error::BadArgs(format!("insert: offset {off:?} is not a number")))?;
                let attrs = self.fs.insert(self.ino(node), off, data.as_bytes())?;
                self.moved(node, &attrs)
            }
            Op::Extended { node, name: "punch", args } => {
                let [off, len] = args else { return Err(Error::BadArgs("usage: punch OFFSET LENGTH".into())) };
                let num = |v: &String| v.parse().map_err(|_| Error::BadArgs(format!("punch: {v:?} is not a number")));
                let attrs = self.fs.remove_range(self.ino(node), num(off)?, num(len)?)?;
                self.moved(node, &attrs)
            }
            // A volume's file system is served by one mount at a time: there is no other mount
            // to keep out, and this one's requests on a file are already in order.
            Op::Extended { name: plyfs_stack::shared::LOCK_OP, args, .. } => {
                plyfs_stack::shared::parse_lock_args(args).map(|_| Reply::Extended(serde_json::Value::Null))
            }
            Op::Extended { name, .. } => Err(Error::UnsupportedOp { op: name.to_owned(), layers: vec![self.name.clone()], handled_below: vec![] }),
        }
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }

    fn set_invalidator(&self, inv: std::sync::Arc<dyn Invalidator>) {
        *self.invalidator.lock() = Some(inv);
    }

    fn shutdown(&self) {
        if let Err(e) = self.fs.close() {
            tracing::error!("exofs: {}: writing back at unmount: {e}", self.fs.socket().display());
        }
    }
}

/// A value (or list of names) for a request that gave `size` bytes of room (0: only the size).
fn xattr_reply(value: Vec<u8>, size: u32) -> Result<Reply> {
    Ok(Reply::Xattr(match size {
        0 => XattrReply::Size(value.len() as u32),
        n if (n as usize) < value.len() => return Err(Error::Os(libc::ERANGE)),
        _ => XattrReply::Data(value),
    }))
}
