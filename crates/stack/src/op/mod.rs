//! Operations and their descriptors (the Heidemann–Popek "operation descriptor", §3.2 of
//! `seeds/000`): every operation that crosses a layer is an [`Op`], which can tell its name and
//! list its typed arguments. That is what lets a generic bypass, a monitoring layer or a transport
//! handle operations it was never written for.
//!
//! The operations are declared once, below; `Op`, its kinds, its descriptor and its owned form
//! for the wire ([`OpHeader`]) all come from that one list (`declare.rs`, `header.rs`).

use std::borrow::Cow;
use std::ffi::OsStr;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::types::*;

#[macro_use]
mod declare;
pub mod header;

use header::{ByteBuf, OpArg, Payload, SetAttrHeader};

// Every operation, once: what comes of this is in `declare.rs`. A new operation is one entry
// here and its handlers (the FUSE front end, the layers that answer it).
declare_operations! {
    Lookup "lookup" { parent: Node, name: Name },
    /// The caller drops `nlookup` references gained by `lookup`, `create`, `mknod`, `mkdir`,
    /// `symlink`, `link` or `readdirplus`.
    Forget "forget" { node: Node, nlookup: u64 },
    GetAttr "getattr" { node: Node, fh: MaybeHandle },
    SetAttr "setattr" { node: Node, fh: MaybeHandle, #[serde(flatten)] set: SetAttr },
    ReadLink "readlink" { node: Node },
    MkNod "mknod" { parent: Node, name: Name, mode: u32 as octal, rdev: u32 },
    MkDir "mkdir" { parent: Node, name: Name, mode: u32 as octal },
    Unlink "unlink" { parent: Node, name: Name },
    RmDir "rmdir" { parent: Node, name: Name },
    SymLink "symlink" { parent: Node, name: Name, target: Path },
    /// `flags` are `RENAME_NOREPLACE` / `RENAME_EXCHANGE` as in `renameat2(2)`.
    Rename "rename" { parent: Node, name: Name, new_parent: Node, new_name: Name, flags: u32 },
    Link "link" { node: Node, new_parent: Node, new_name: Name },
    /// `flags` are the `open(2)` flags.
    Open "open" { node: Node, flags: i32 as open_flags },
    Create "create" { parent: Node, name: Name, mode: u32 as octal, flags: i32 as open_flags },
    Read "read" { node: Node, fh: Handle, offset: u64, size: u32 },
    Write "write" { node: Node, fh: Handle, offset: u64, #[serde(skip)] data: Payload },
    Flush "flush" { node: Node, fh: Handle },
    Fsync "fsync" { node: Node, fh: Handle, datasync: bool },
    Release "release" { node: Node, fh: Handle },
    OpenDir "opendir" { node: Node },
    /// Entries from `offset` on (0 starts over), at most `max_entries`. With `plus`, each entry
    /// other than `.` and `..` is looked up as well.
    ReadDir "readdir" { node: Node, fh: Handle, offset: u64, max_entries: u32, plus: bool },
    ReleaseDir "releasedir" { node: Node, fh: Handle },
    FsyncDir "fsyncdir" { node: Node, fh: Handle, datasync: bool },
    StatFs "statfs" { node: Node },
    Access "access" { node: Node, mask: i32 },
    /// With `size == 0` the reply is only the value's size.
    GetXattr "getxattr" { node: Node, name: Name, size: u32 },
    SetXattr "setxattr" { node: Node, name: Name, #[serde(skip)] value: Payload, flags: i32 },
    ListXattr "listxattr" { node: Node, size: u32 },
    RemoveXattr "removexattr" { node: Node, name: Name },
    Fallocate "fallocate" { node: Node, fh: Handle, offset: u64, length: u64, mode: i32 },
    /// `whence` is `SEEK_DATA` or `SEEK_HOLE` (the kernel answers the others itself).
    Lseek "lseek" { node: Node, fh: Handle, offset: i64, whence: i32 },
    /// An ioctl on an open file: `cmd` with its input `data`; the reply is `out_size` bytes of
    /// output ([`Reply::Data`]). The front end lets through only the file-attribute flags
    /// (`FS_IOC_GETFLAGS`, `FS_IOC_SETFLAGS`, `FS_IOC_FSGETXATTR`, `FS_IOC_FSSETXATTR`).
    Ioctl "ioctl" { node: Node, fh: Handle, cmd: u32 as hex, #[serde(skip)] data: Payload, out_size: u32 },
    /// An operation defined by some layer (`stats`, `verify`, ...). It travels down the stack
    /// like any other until a layer that knows `name` answers it.
    Extended "extended" { node: Node, name: Str as "op", args: Strs },
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

impl<'a> Op<'a> {
    /// The operation's name. For extended operations, the name the defining layer gave it.
    pub fn name(&self) -> &str {
        match self {
            Op::Extended { name, .. } => name,
            other => other.kind().name(),
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
}

impl OpHeader {
    /// The operation's name on the wire. For extended operations, the name the defining layer
    /// gave it.
    pub fn name(&self) -> &str {
        match self {
            OpHeader::Extended { name, .. } => name,
            other => other.kind().name(),
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
