//! Operations and their descriptors (the Heidemann–Popek "operation descriptor", §3.2 of
//! `seeds/000`): every operation that crosses a layer is an [`Op`], which can tell its name and
//! list its typed arguments. That is what lets a generic bypass, a monitoring layer or a transport
//! handle operations it was never written for.

use std::borrow::Cow;
use std::ffi::OsStr;
use std::fmt;
use std::path::Path;

use crate::types::*;

/// One file-system operation with its arguments.
///
/// Operations on open files carry the node as well as the handle, so a layer that keeps per-node
/// state need not map handles back to nodes.
#[derive(Clone, Copy, Debug)]
pub enum Op<'a> {
    Lookup { parent: NodeId, name: &'a OsStr },
    /// The caller drops `nlookup` references gained by `lookup`, `create`, `mknod`, `mkdir`,
    /// `symlink`, `link` or `readdirplus`.
    Forget { node: NodeId, nlookup: u64 },
    GetAttr { node: NodeId, fh: Option<FileHandle> },
    SetAttr { node: NodeId, fh: Option<FileHandle>, set: SetAttr },
    ReadLink { node: NodeId },
    MkNod { parent: NodeId, name: &'a OsStr, mode: u32, rdev: u32 },
    MkDir { parent: NodeId, name: &'a OsStr, mode: u32 },
    Unlink { parent: NodeId, name: &'a OsStr },
    RmDir { parent: NodeId, name: &'a OsStr },
    SymLink { parent: NodeId, name: &'a OsStr, target: &'a Path },
    /// `flags` are `RENAME_NOREPLACE` / `RENAME_EXCHANGE` as in `renameat2(2)`.
    Rename { parent: NodeId, name: &'a OsStr, new_parent: NodeId, new_name: &'a OsStr, flags: u32 },
    Link { node: NodeId, new_parent: NodeId, new_name: &'a OsStr },
    /// `flags` are the `open(2)` flags.
    Open { node: NodeId, flags: i32 },
    Create { parent: NodeId, name: &'a OsStr, mode: u32, flags: i32 },
    Read { node: NodeId, fh: FileHandle, offset: u64, size: u32 },
    Write { node: NodeId, fh: FileHandle, offset: u64, data: &'a [u8] },
    Flush { node: NodeId, fh: FileHandle },
    Fsync { node: NodeId, fh: FileHandle, datasync: bool },
    Release { node: NodeId, fh: FileHandle },
    OpenDir { node: NodeId },
    /// Entries from `offset` on (0 starts over), at most `max_entries`. With `plus`, each entry
    /// other than `.` and `..` is looked up as well.
    ReadDir { node: NodeId, fh: FileHandle, offset: u64, max_entries: u32, plus: bool },
    ReleaseDir { node: NodeId, fh: FileHandle },
    FsyncDir { node: NodeId, fh: FileHandle, datasync: bool },
    StatFs { node: NodeId },
    Access { node: NodeId, mask: i32 },
    /// With `size == 0` the reply is only the value's size.
    GetXattr { node: NodeId, name: &'a OsStr, size: u32 },
    SetXattr { node: NodeId, name: &'a OsStr, value: &'a [u8], flags: i32 },
    ListXattr { node: NodeId, size: u32 },
    RemoveXattr { node: NodeId, name: &'a OsStr },
    Fallocate { node: NodeId, fh: FileHandle, offset: u64, length: u64, mode: i32 },
    /// `whence` is `SEEK_DATA` or `SEEK_HOLE` (the kernel answers the others itself).
    Lseek { node: NodeId, fh: FileHandle, offset: i64, whence: i32 },
    /// An ioctl on an open file: `cmd` with its input `data`; the reply is `out_size` bytes of
    /// output ([`Reply::Data`]). The front end lets through only the file-attribute flags
    /// (`FS_IOC_GETFLAGS`, `FS_IOC_SETFLAGS`, `FS_IOC_FSGETXATTR`, `FS_IOC_FSSETXATTR`).
    Ioctl { node: NodeId, fh: FileHandle, cmd: u32, data: &'a [u8], out_size: u32 },
    /// An operation defined by some layer (`stats`, `verify`, ...). It travels down the stack
    /// like any other until a layer that knows `name` answers it.
    Extended { node: NodeId, name: &'a str, args: &'a [String] },
}

/// A typed argument value, for descriptors.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg<'a> {
    U64(u64),
    I64(i64),
    Bool(bool),
    Str(Cow<'a, str>),
    /// A byte buffer, described by its length only.
    Bytes(usize),
    Strs(&'a [String]),
}

impl fmt::Display for Arg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arg::U64(v) => write!(f, "{v}"),
            Arg::I64(v) => write!(f, "{v}"),
            Arg::Bool(v) => write!(f, "{v}"),
            Arg::Str(s) => write!(f, "{s:?}"),
            Arg::Bytes(n) => write!(f, "<{n} bytes>"),
            Arg::Strs(v) => write!(f, "{v:?}"),
        }
    }
}

macro_rules! op_kinds {
    ($($variant:ident => $name:literal),* $(,)?) => {
        /// The kind of an [`Op`], without its arguments: a small index for per-operation tables.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum OpKind { $($variant),* }

        impl OpKind {
            pub const ALL: &'static [OpKind] = &[$(OpKind::$variant),*];

            /// The operation's name as it appears in logs and statistics.
            pub fn name(self) -> &'static str {
                match self { $(OpKind::$variant => $name),* }
            }
        }

        impl Op<'_> {
            pub fn kind(&self) -> OpKind {
                match self { $(Op::$variant { .. } => OpKind::$variant),* }
            }
        }
    };
}

op_kinds! {
    Lookup => "lookup", Forget => "forget", GetAttr => "getattr", SetAttr => "setattr",
    ReadLink => "readlink", MkNod => "mknod", MkDir => "mkdir", Unlink => "unlink",
    RmDir => "rmdir", SymLink => "symlink", Rename => "rename", Link => "link", Open => "open",
    Create => "create", Read => "read", Write => "write", Flush => "flush", Fsync => "fsync",
    Release => "release", OpenDir => "opendir", ReadDir => "readdir", ReleaseDir => "releasedir",
    FsyncDir => "fsyncdir", StatFs => "statfs", Access => "access", GetXattr => "getxattr",
    SetXattr => "setxattr", ListXattr => "listxattr", RemoveXattr => "removexattr",
    Fallocate => "fallocate", Lseek => "lseek", Ioctl => "ioctl", Extended => "extended",
}

fn name_arg(name: &OsStr) -> Arg<'_> {
    Arg::Str(name.to_string_lossy())
}

impl<'a> Op<'a> {
    /// The operation's name. For extended operations, the name the defining layer gave it.
    pub fn name(&self) -> &str {
        match self {
            Op::Extended { name, .. } => name,
            other => other.kind().name(),
        }
    }

    /// The node the operation addresses (the parent directory for name operations).
    pub fn node(&self) -> NodeId {
        use Op::*;
        match *self {
            Lookup { parent, .. } | MkNod { parent, .. } | MkDir { parent, .. }
            | Unlink { parent, .. } | RmDir { parent, .. } | SymLink { parent, .. }
            | Rename { parent, .. } | Create { parent, .. } => parent,
            Forget { node, .. } | GetAttr { node, .. } | SetAttr { node, .. }
            | ReadLink { node } | Link { node, .. } | Open { node, .. } | Read { node, .. }
            | Write { node, .. } | Flush { node, .. } | Fsync { node, .. }
            | Release { node, .. } | OpenDir { node } | ReadDir { node, .. }
            | ReleaseDir { node, .. } | FsyncDir { node, .. } | StatFs { node }
            | Access { node, .. } | GetXattr { node, .. } | SetXattr { node, .. }
            | ListXattr { node, .. } | RemoveXattr { node, .. } | Fallocate { node, .. }
            | Lseek { node, .. } | Ioctl { node, .. } | Extended { node, .. } => node,
        }
    }

    /// The same operation addressed to `node` of another level, as a layer that maps its nodes
    /// onto those below it sends it down: name operations in directory `node`, the others on
    /// object `node`. An optional handle (`getattr`, `setattr`) is dropped; `rename` and `link`
    /// keep their second directory, which the caller maps itself.
    pub fn at(&self, node: NodeId) -> Op<'a> {
        self.readdressed(node, None)
    }

    /// The same operation on an open file, addressed to `node` and handle `fh` of another level.
    pub fn on_open(&self, node: NodeId, fh: FileHandle) -> Op<'a> {
        self.readdressed(node, Some(fh))
    }

    fn readdressed(&self, to: NodeId, handle: Option<FileHandle>) -> Op<'a> {
        use Op::*;
        let keep = |fh: FileHandle| handle.unwrap_or(fh);
        match *self {
            Lookup { name, .. } => Lookup { parent: to, name },
            Forget { nlookup, .. } => Forget { node: to, nlookup },
            GetAttr { .. } => GetAttr { node: to, fh: handle },
            SetAttr { set, .. } => SetAttr { node: to, fh: handle, set },
            ReadLink { .. } => ReadLink { node: to },
            MkNod { name, mode, rdev, .. } => MkNod { parent: to, name, mode, rdev },
            MkDir { name, mode, .. } => MkDir { parent: to, name, mode },
            Unlink { name, .. } => Unlink { parent: to, name },
            RmDir { name, .. } => RmDir { parent: to, name },
            SymLink { name, target, .. } => SymLink { parent: to, name, target },
            Rename { name, new_parent, new_name, flags, .. } => Rename { parent: to, name, new_parent, new_name, flags },
            Link { new_parent, new_name, .. } => Link { node: to, new_parent, new_name },
            Open { flags, .. } => Open { node: to, flags },
            Create { name, mode, flags, .. } => Create { parent: to, name, mode, flags },
            Read { fh, offset, size, .. } => Read { node: to, fh: keep(fh), offset, size },
            Write { fh, offset, data, .. } => Write { node: to, fh: keep(fh), offset, data },
            Flush { fh, .. } => Flush { node: to, fh: keep(fh) },
            Fsync { fh, datasync, .. } => Fsync { node: to, fh: keep(fh), datasync },
            Release { fh, .. } => Release { node: to, fh: keep(fh) },
            OpenDir { .. } => OpenDir { node: to },
            ReadDir { fh, offset, max_entries, plus, .. } => ReadDir { node: to, fh: keep(fh), offset, max_entries, plus },
            ReleaseDir { fh, .. } => ReleaseDir { node: to, fh: keep(fh) },
            FsyncDir { fh, datasync, .. } => FsyncDir { node: to, fh: keep(fh), datasync },
            StatFs { .. } => StatFs { node: to },
            Access { mask, .. } => Access { node: to, mask },
            GetXattr { name, size, .. } => GetXattr { node: to, name, size },
            SetXattr { name, value, flags, .. } => SetXattr { node: to, name, value, flags },
            ListXattr { size, .. } => ListXattr { node: to, size },
            RemoveXattr { name, .. } => RemoveXattr { node: to, name },
            Fallocate { fh, offset, length, mode, .. } => Fallocate { node: to, fh: keep(fh), offset, length, mode },
            Lseek { fh, offset, whence, .. } => Lseek { node: to, fh: keep(fh), offset, whence },
            Ioctl { fh, cmd, data, out_size, .. } => Ioctl { node: to, fh: keep(fh), cmd, data, out_size },
            Extended { name, args, .. } => Extended { node: to, name, args },
        }
    }

    /// The operation's typed arguments, in order, with their names: its descriptor.
    pub fn args(&self) -> Vec<(&'static str, Arg<'_>)> {
        use Arg::*;
        use Op::*;
        let node = ("node", U64(self.node().0));
        match self {
            Lookup { name, .. } | Unlink { name, .. } | RmDir { name, .. } => {
                vec![("parent", U64(self.node().0)), ("name", name_arg(name))]
            }
            Forget { nlookup, .. } => vec![node, ("nlookup", U64(*nlookup))],
            GetAttr { fh, .. } => vec![node, ("fh", fh.map_or(I64(-1), |f| U64(f.0)))],
            SetAttr { fh, set, .. } => {
                let mut v = vec![node, ("fh", fh.map_or(I64(-1), |f| U64(f.0)))];
                if let Some(m) = set.mode {
                    v.push(("mode", Str(format!("{m:o}").into())));
                }
                if let Some(u) = set.uid {
                    v.push(("uid", U64(u.into())));
                }
                if let Some(g) = set.gid {
                    v.push(("gid", U64(g.into())));
                }
                if let Some(s) = set.size {
                    v.push(("size", U64(s)));
                }
                if set.atime.is_some() {
                    v.push(("atime", Bool(true)));
                }
                if set.mtime.is_some() {
                    v.push(("mtime", Bool(true)));
                }
                v
            }
            ReadLink { .. } | OpenDir { .. } | StatFs { .. } => vec![node],
            MkNod { name, mode, rdev, .. } => vec![
                ("parent", U64(self.node().0)),
                ("name", name_arg(name)),
                ("mode", Str(format!("{mode:o}").into())),
                ("rdev", U64((*rdev).into())),
            ],
            MkDir { name, mode, .. } => vec![
                ("parent", U64(self.node().0)),
                ("name", name_arg(name)),
                ("mode", Str(format!("{mode:o}").into())),
            ],
            SymLink { name, target, .. } => vec![
                ("parent", U64(self.node().0)),
                ("name", name_arg(name)),
                ("target", Str(target.to_string_lossy())),
            ],
            Rename { name, new_parent, new_name, flags, .. } => vec![
                ("parent", U64(self.node().0)),
                ("name", name_arg(name)),
                ("new_parent", U64(new_parent.0)),
                ("new_name", name_arg(new_name)),
                ("flags", U64((*flags).into())),
            ],
            Link { new_parent, new_name, .. } => {
                vec![node, ("new_parent", U64(new_parent.0)), ("new_name", name_arg(new_name))]
            }
            Open { flags, .. } => vec![node, ("flags", Str(format!("{flags:#o}").into()))],
            Create { name, mode, flags, .. } => vec![
                ("parent", U64(self.node().0)),
                ("name", name_arg(name)),
                ("mode", Str(format!("{mode:o}").into())),
                ("flags", Str(format!("{flags:#o}").into())),
            ],
            Read { fh, offset, size, .. } => {
                vec![node, ("fh", U64(fh.0)), ("offset", U64(*offset)), ("size", U64((*size).into()))]
            }
            Write { fh, offset, data, .. } => {
                vec![node, ("fh", U64(fh.0)), ("offset", U64(*offset)), ("data", Bytes(data.len()))]
            }
            Flush { fh, .. } | Release { fh, .. } | ReleaseDir { fh, .. } => {
                vec![node, ("fh", U64(fh.0))]
            }
            Fsync { fh, datasync, .. } | FsyncDir { fh, datasync, .. } => {
                vec![node, ("fh", U64(fh.0)), ("datasync", Bool(*datasync))]
            }
            ReadDir { fh, offset, max_entries, plus, .. } => vec![
                node,
                ("fh", U64(fh.0)),
                ("offset", U64(*offset)),
                ("max_entries", U64((*max_entries).into())),
                ("plus", Bool(*plus)),
            ],
            Access { mask, .. } => vec![node, ("mask", I64((*mask).into()))],
            GetXattr { name, size, .. } => {
                vec![node, ("name", name_arg(name)), ("size", U64((*size).into()))]
            }
            SetXattr { name, value, flags, .. } => vec![
                node,
                ("name", name_arg(name)),
                ("value", Bytes(value.len())),
                ("flags", I64((*flags).into())),
            ],
            ListXattr { size, .. } => vec![node, ("size", U64((*size).into()))],
            RemoveXattr { name, .. } => vec![node, ("name", name_arg(name))],
            Fallocate { fh, offset, length, mode, .. } => vec![
                node,
                ("fh", U64(fh.0)),
                ("offset", U64(*offset)),
                ("length", U64(*length)),
                ("mode", I64((*mode).into())),
            ],
            Lseek { fh, offset, whence, .. } => {
                vec![node, ("fh", U64(fh.0)), ("offset", I64(*offset)), ("whence", I64((*whence).into()))]
            }
            Ioctl { fh, cmd, data, out_size, .. } => vec![
                node,
                ("fh", U64(fh.0)),
                ("cmd", Str(format!("{cmd:#x}").into())),
                ("data", Bytes(data.len())),
                ("out_size", U64((*out_size).into())),
            ],
            Extended { name, args, .. } => vec![node, ("op", Str((*name).into())), ("args", Strs(args))],
        }
    }
}

/// The reply to an [`Op`]. Which variant comes back is fixed by the operation; the typed helpers
/// on [`crate::Level`] unwrap it.
#[derive(Debug)]
pub enum Reply {
    Empty,
    Entry(Entry),
    Attr(Attr),
    /// File data, or a symlink target for `readlink`.
    Data(Vec<u8>),
    Written(u32),
    Opened(Opened),
    Created(Entry, Opened),
    Dir(Vec<DirEntry>),
    StatFs(StatFs),
    Xattr(XattrReply),
    Offset(u64),
    /// The answer of an extended operation, as JSON.
    Extended(serde_json::Value),
}

impl Reply {
    /// A short description for logs: the variant and its most telling field.
    pub fn summary(&self) -> String {
        match self {
            Reply::Empty => "ok".into(),
            Reply::Entry(e) => format!("node={}", e.node.0),
            Reply::Attr(a) => format!("size={}", a.size),
            Reply::Data(d) => format!("{} bytes", d.len()),
            Reply::Written(n) => format!("wrote {n}"),
            Reply::Opened(o) => format!("fh={}", o.fh.0),
            Reply::Created(e, o) => format!("node={} fh={}", e.node.0, o.fh.0),
            Reply::Dir(v) => format!("{} entries", v.len()),
            Reply::StatFs(_) => "ok".into(),
            Reply::Xattr(XattrReply::Data(d)) => format!("{} bytes", d.len()),
            Reply::Xattr(XattrReply::Size(n)) => format!("size {n}"),
            Reply::Offset(o) => format!("offset={o}"),
            Reply::Extended(_) => "ok".into(),
        }
    }
}
