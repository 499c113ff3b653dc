//! The wire protocol (`docs/protocol.md` is its specification).
//!
//! A connection opens with an 8-byte preamble from each side, then carries frames. A frame is a
//! 4-byte header length and a 4-byte payload length (both big-endian), the header, a MessagePack
//! map, and the payload, raw bytes (file data, an attribute value). Bulk data never passes
//! through the serialiser: it is read straight into the buffer the layer receives, and written
//! from the buffer a layer returned.
//!
//! A request names its operation and its arguments by name (the operation's descriptor,
//! `seeds/000` §5.4), so a peer that does not know an operation still reads the message and
//! answers "unknown operation" rather than losing the connection. Extended operations travel as a
//! name with string arguments and come back as JSON: any layer's extended operation crosses
//! without the transport knowing it.

use std::ffi::OsStr;
use std::io::{self, IoSlice, Read, Write};
use std::os::unix::ffi::OsStrExt;

use plyfs_stack::{Attr, Caller, DirEntry, Entry, Error, FileHandle, FileKind, NodeId, Op, Opened, Reply, StatFs, XattrReply};
use serde::{Deserialize, Serialize};

/// Sent first by both sides. The last byte is the frame format's version, which has no reason to
/// change; protocol versions are negotiated in the handshake.
pub const PREAMBLE: [u8; 8] = *b"plyfs\r\n\x01";

/// Protocol versions this build speaks, newest last.
pub const VERSIONS: &[u32] = &[1];

/// Limits every peer enforces on what it receives. A frame over them closes the connection; an
/// argument over them gets an error reply.
pub mod limits {
    /// The largest header: a `readdirplus` reply of [`MAX_DIR_ENTRIES`] long names fits.
    pub const MAX_HEADER: usize = 4 << 20;
    /// The largest payload: a read or write of [`MAX_IO`] bytes.
    pub const MAX_PAYLOAD: usize = MAX_IO;
    /// The most bytes one `read` or `write` moves.
    pub const MAX_IO: usize = 8 << 20;
    /// The longest name of a directory entry or an extended attribute (`NAME_MAX`, `XATTR_NAME_MAX`).
    pub const MAX_NAME: usize = 255;
    /// The longest symlink target (`PATH_MAX`).
    pub const MAX_PATH: usize = 4096;
    /// The largest extended attribute value (`XATTR_SIZE_MAX`).
    pub const MAX_XATTR: usize = 64 << 10;
    /// The most entries one `readdir` returns.
    pub const MAX_DIR_ENTRIES: u32 = 4096;
    /// The most arguments of an extended operation, and the longest of them.
    pub const MAX_EXT_ARGS: usize = 64;
    pub const MAX_EXT_ARG: usize = 4096;
    /// The largest `hello` (and anything a server reads before the peer is authenticated, or
    /// for a Unix peer admitted): a few KiB, no payload. A peer that has not proved anything
    /// cannot make the server allocate more than this (#28).
    pub const MAX_HELLO_HEADER: usize = 4 << 10;
}

/// The sizes a reader accepts for a frame's header and payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    pub header: usize,
    pub payload: usize,
}

impl FrameLimits {
    /// Frames of an established connection.
    pub const SESSION: FrameLimits = FrameLimits { header: limits::MAX_HEADER, payload: limits::MAX_PAYLOAD };
    /// The first frame a server reads (`hello`), before the peer proved anything.
    pub const HELLO: FrameLimits = FrameLimits { header: limits::MAX_HELLO_HEADER, payload: 0 };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireCaller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl From<&Caller> for WireCaller {
    fn from(c: &Caller) -> WireCaller {
        WireCaller { uid: c.uid, gid: c.gid, pid: c.pid }
    }
}

impl From<WireCaller> for Caller {
    fn from(c: WireCaller) -> Caller {
        Caller::new(c.uid, c.gid, c.pid)
    }
}

type Bytes = serde_bytes::ByteBuf;

fn bytes(b: &[u8]) -> Bytes {
    Bytes::from(b.to_vec())
}

pub use plyfs_stack::op_header::{Payload, SetAttrHeader, WireTime, WireTimeSet};
pub use plyfs_stack::OpHeader;

/// What a hosted codec is asked: not a stack operation (the mount asks a codec process,
/// `py:script=`). The chunk travels as the payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "args", rename_all = "lowercase")]
pub enum CodecOp {
    /// The codec's encoding of the chunk in the payload.
    Encode { chunk: u64 },
    /// The codec's decoding of the payload, which must decode to `decoded_len` bytes.
    Decode { chunk: u64, decoded_len: u64 },
}

/// What a server composes from stack operations, to spare a client the crossings it would
/// make one by one. A server that does not know one answers `ENOSYS`, and the client asks
/// for the stack operations instead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "args", rename_all = "lowercase")]
pub enum CompoundOp {
    /// `opendir`, then `readdir` with `plus` from the start until the end or `max_entries`:
    /// a directory opened and listed in one crossing.
    ListDir { node: u64, max_entries: u32 },
}

impl CompoundOp {
    /// Their names on the wire.
    pub const NAMES: &[&str] = &["listdir"];
}

/// The operation of a request, by name with named arguments: one of the stack's (its
/// [`OpHeader`]), a compound one, or a hosted codec's. All spell the name as `op` and the
/// arguments as `args`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RequestOp {
    Stack(OpHeader),
    Compound(CompoundOp),
    Codec(CodecOp),
}

impl From<OpHeader> for RequestOp {
    fn from(op: OpHeader) -> RequestOp {
        RequestOp::Stack(op)
    }
}

impl From<CodecOp> for RequestOp {
    fn from(op: CodecOp) -> RequestOp {
        RequestOp::Codec(op)
    }
}

impl From<CompoundOp> for RequestOp {
    fn from(op: CompoundOp) -> RequestOp {
        RequestOp::Compound(op)
    }
}

impl RequestOp {
    /// The operation's name on the wire.
    pub fn name(&self) -> &str {
        match self {
            RequestOp::Stack(op) => op.name(),
            RequestOp::Compound(CompoundOp::ListDir { .. }) => "listdir",
            RequestOp::Codec(CodecOp::Encode { .. }) => "encode",
            RequestOp::Codec(CodecOp::Decode { .. }) => "decode",
        }
    }

    /// The stack operation this asks for, borrowing its names and `payload`, once it is checked
    /// against the protocol's limits ([`checked_op`]).
    pub fn stack_op<'a>(&'a self, payload: &'a [u8]) -> Result<Op<'a>, Error> {
        match self {
            RequestOp::Stack(op) => checked_op(op, payload),
            RequestOp::Compound(_) => Err(Error::BadArgs(format!("'{}' is for a server, not a stack", self.name()))),
            RequestOp::Codec(_) => Err(Error::BadArgs(format!("'{}' is for a hosted codec, not a stack", self.name()))),
        }
    }
}

/// The operation `header` describes, borrowing its names and `payload`. Arguments over the
/// protocol's limits are refused here, before any layer sees them.
pub fn checked_op<'a>(header: &'a OpHeader, payload: &'a [u8]) -> Result<Op<'a>, Error> {
    use limits::*;
    let name = |n: &'a OsStr| -> Result<&'a OsStr, Error> {
        let b = n.as_bytes();
        if b.len() > MAX_NAME {
            return Err(Error::Os(libc::ENAMETOOLONG));
        }
        if b.is_empty() || b.contains(&0) {
            return Err(Error::BadArgs(format!("bad name of {} bytes", b.len())));
        }
        Ok(n)
    };
    let entry_name = |n: &'a OsStr| -> Result<&'a OsStr, Error> {
        let n = name(n)?;
        let b = n.as_bytes();
        // One component inside its directory: never a way up or out of the exported tree.
        if b.contains(&b'/') || b == b"." || b == b".." {
            return Err(Error::Os(libc::EPERM));
        }
        Ok(n)
    };
    if !header.takes_payload() && !payload.is_empty() {
        return Err(Error::BadArgs("this operation takes no payload".into()));
    }
    Ok(match header.to_op(payload) {
        // `..` is looked up (the per-file policy climbs directories that way); the server
        // refuses it at the root of the export.
        Op::Lookup { parent, name } if name == ".." => Op::Lookup { parent, name },
        Op::Lookup { parent, name } => Op::Lookup { parent, name: entry_name(name)? },
        Op::MkNod { parent, name, mode, rdev } => Op::MkNod { parent, name: entry_name(name)?, mode, rdev },
        Op::MkDir { parent, name, mode } => Op::MkDir { parent, name: entry_name(name)?, mode },
        Op::Unlink { parent, name } => Op::Unlink { parent, name: entry_name(name)? },
        Op::RmDir { parent, name } => Op::RmDir { parent, name: entry_name(name)? },
        Op::SymLink { parent, name, target } => {
            let t = target.as_os_str().as_bytes();
            if t.len() >= MAX_PATH {
                return Err(Error::Os(libc::ENAMETOOLONG));
            }
            if t.is_empty() || t.contains(&0) {
                return Err(Error::BadArgs(format!("bad symlink target of {} bytes", t.len())));
            }
            Op::SymLink { parent, name: entry_name(name)?, target }
        }
        Op::Rename { parent, name, new_parent, new_name, flags } => {
            Op::Rename { parent, name: entry_name(name)?, new_parent, new_name: entry_name(new_name)?, flags }
        }
        Op::Link { node, new_parent, new_name } => Op::Link { node, new_parent, new_name: entry_name(new_name)? },
        Op::Create { parent, name, mode, flags } => Op::Create { parent, name: entry_name(name)?, mode, flags },
        Op::Read { size, .. } if size as usize > MAX_IO => {
            return Err(Error::BadArgs(format!("a read of {size} bytes (at most {MAX_IO})")));
        }
        Op::ReadDir { node, fh, offset, max_entries, plus } => {
            Op::ReadDir { node, fh, offset, max_entries: max_entries.min(MAX_DIR_ENTRIES), plus }
        }
        Op::GetXattr { node, name: x, size } => Op::GetXattr { node, name: name(x)?, size: size.min(MAX_XATTR as u32) },
        Op::SetXattr { node, name: x, value, flags } => {
            if value.len() > MAX_XATTR {
                return Err(Error::Os(libc::E2BIG));
            }
            Op::SetXattr { node, name: name(x)?, value, flags }
        }
        Op::ListXattr { node, size } => Op::ListXattr { node, size: size.min(MAX_XATTR as u32) },
        Op::RemoveXattr { node, name: x } => Op::RemoveXattr { node, name: name(x)? },
        Op::Ioctl { cmd, data, out_size, .. } if !plyfs_stack::ioctl::known(cmd) || data.len() > 64 || out_size > 64 => {
            return Err(Error::BadArgs(format!("ioctl {cmd:#x}: not one a stack answers")));
        }
        Op::Extended { name, args, .. } if args.len() > MAX_EXT_ARGS || args.iter().any(|a| a.len() > MAX_EXT_ARG) || name.len() > MAX_NAME => {
            return Err(Error::BadArgs(format!("extended operation '{name}': too many or too long arguments")));
        }
        // The others carry nothing a limit applies to. They are named, not caught by a
        // wildcard, so that a new operation does not pass unchecked: the compiler asks for it
        // here, where its names and sizes get their limits.
        op @ (Op::Forget { .. }
        | Op::GetAttr { .. }
        | Op::SetAttr { .. }
        | Op::ReadLink { .. }
        | Op::Open { .. }
        | Op::Read { .. }
        | Op::Write { .. }
        | Op::Flush { .. }
        | Op::Fsync { .. }
        | Op::Release { .. }
        | Op::OpenDir { .. }
        | Op::ReleaseDir { .. }
        | Op::FsyncDir { .. }
        | Op::StatFs { .. }
        | Op::Access { .. }
        | Op::Fallocate { .. }
        | Op::Lseek { .. }
        | Op::Ioctl { .. }
        | Op::Extended { .. }) => op,
    })
}

/// A file type, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireKind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    Char,
    Block,
}

impl From<FileKind> for WireKind {
    fn from(k: FileKind) -> WireKind {
        match k {
            FileKind::File => WireKind::File,
            FileKind::Dir => WireKind::Dir,
            FileKind::Symlink => WireKind::Symlink,
            FileKind::Fifo => WireKind::Fifo,
            FileKind::Socket => WireKind::Socket,
            FileKind::CharDevice => WireKind::Char,
            FileKind::BlockDevice => WireKind::Block,
        }
    }
}

impl From<WireKind> for FileKind {
    fn from(k: WireKind) -> FileKind {
        match k {
            WireKind::File => FileKind::File,
            WireKind::Dir => FileKind::Dir,
            WireKind::Symlink => FileKind::Symlink,
            WireKind::Fifo => FileKind::Fifo,
            WireKind::Socket => FileKind::Socket,
            WireKind::Char => FileKind::CharDevice,
            WireKind::Block => FileKind::BlockDevice,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireAttr {
    pub size: u64,
    pub blocks: u64,
    pub atime: WireTime,
    pub mtime: WireTime,
    pub ctime: WireTime,
    pub kind: WireKind,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
}

impl From<&Attr> for WireAttr {
    fn from(a: &Attr) -> WireAttr {
        WireAttr {
            size: a.size,
            blocks: a.blocks,
            atime: WireTime::from_system(a.atime),
            mtime: WireTime::from_system(a.mtime),
            ctime: WireTime::from_system(a.ctime),
            kind: a.kind.into(),
            perm: a.perm,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev,
            blksize: a.blksize,
        }
    }
}

impl From<&WireAttr> for Attr {
    fn from(a: &WireAttr) -> Attr {
        Attr {
            size: a.size,
            blocks: a.blocks,
            atime: a.atime.to_system(),
            mtime: a.mtime.to_system(),
            ctime: a.ctime.to_system(),
            kind: a.kind.into(),
            perm: a.perm & 0o7777,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev,
            blksize: a.blksize,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireEntry {
    pub node: u64,
    pub attr: WireAttr,
    pub generation: u64,
    /// A server's hint: `false` when the object has no extended attributes at all, which
    /// spares the client asking for each one (`ls -l` asks for two per file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xattrs: Option<bool>,
}

impl From<&Entry> for WireEntry {
    fn from(e: &Entry) -> WireEntry {
        WireEntry { node: e.node.0, attr: (&e.attr).into(), generation: e.generation, xattrs: None }
    }
}

impl From<&WireEntry> for Entry {
    fn from(e: &WireEntry) -> Entry {
        Entry { node: NodeId(e.node), attr: (&e.attr).into(), generation: e.generation }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireOpened {
    pub fh: u64,
    pub direct_io: bool,
    pub flush_on_close: bool,
}

impl From<&Opened> for WireOpened {
    fn from(o: &Opened) -> WireOpened {
        WireOpened { fh: o.fh.0, direct_io: o.direct_io, flush_on_close: o.flush_on_close }
    }
}

impl From<&WireOpened> for Opened {
    fn from(o: &WireOpened) -> Opened {
        Opened { fh: FileHandle(o.fh), backing: None, direct_io: o.direct_io, flush_on_close: o.flush_on_close }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireDirEntry {
    pub name: Bytes,
    pub node: u64,
    pub kind: WireKind,
    pub next: u64,
    pub entry: Option<WireEntry>,
}

impl From<&DirEntry> for WireDirEntry {
    fn from(d: &DirEntry) -> WireDirEntry {
        WireDirEntry {
            name: bytes(d.name.as_bytes()),
            node: d.node.0,
            kind: d.kind.into(),
            next: d.next_offset,
            entry: d.entry.as_ref().map(Into::into),
        }
    }
}

impl From<&WireDirEntry> for DirEntry {
    fn from(d: &WireDirEntry) -> DirEntry {
        DirEntry {
            name: OsStr::from_bytes(&d.name).to_owned(),
            node: NodeId(d.node),
            kind: d.kind.into(),
            next_offset: d.next,
            entry: d.entry.as_ref().map(Into::into),
        }
    }
}

/// The reply to `listdir`: the directory's handle, as `opendir` gives it, and its entries
/// from the start, each with its entry (one lookup), as `readdir` with `plus` gives them;
/// `complete` when they reach the end. Reading on from the last entry's `next` with that
/// handle gives what a `readdir` would.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireListing {
    pub fh: u64,
    pub entries: Vec<WireDirEntry>,
    pub complete: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireStatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// `From` both ways between a stack type and its wire twin, which have the same fields.
macro_rules! convert_both_ways {
    ($a:ident, $b:ident { $($f:ident),* }) => {
        impl From<$a> for $b {
            fn from(s: $a) -> $b {
                $b { $($f: s.$f),* }
            }
        }
        impl From<$b> for $a {
            fn from(s: $b) -> $a {
                $a { $($f: s.$f),* }
            }
        }
    };
}

convert_both_ways!(StatFs, WireStatFs { blocks, bfree, bavail, files, ffree, bsize, namelen, frsize });

/// An error: the errno every peer understands, and the one line that explains it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    pub errno: i32,
    pub msg: String,
    /// `"unsupported"` for an extended operation no layer answers, `"corrupt"` for damaged
    /// data, `"config"` or `"args"`; absent for a plain system error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
}

impl From<&Error> for WireError {
    fn from(e: &Error) -> WireError {
        let class = match e {
            Error::Os(_) => None,
            Error::UnsupportedOp { .. } => Some("unsupported"),
            Error::Config(_) => Some("config"),
            Error::Corrupt(_) => Some("corrupt"),
            Error::BadArgs(_) => Some("args"),
        };
        WireError { errno: e.errno(), msg: e.to_string(), class: class.map(str::to_owned) }
    }
}

impl WireError {
    /// Back to a stack error. An unsupported extended operation keeps its class, so the
    /// client's stack can name its own layers in the message.
    pub fn to_error(&self, op: &str) -> Error {
        match self.class.as_deref() {
            Some("unsupported") => Error::UnsupportedOp { op: op.to_owned(), layers: vec!["the remote stack".into()], handled_below: vec![] },
            Some("corrupt") => Error::Corrupt(self.msg.clone()),
            Some("args") => Error::BadArgs(self.msg.clone()),
            Some("config") => Error::Config(self.msg.clone()),
            _ if self.errno > 0 && self.errno < 4096 => Error::Os(self.errno),
            _ => Error::Os(libc::EIO),
        }
    }
}

/// A reply's header. `data` and `xattr` replies carry their bytes as the frame's payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "r", content = "v", rename_all = "lowercase")]
pub enum WireReply {
    Empty,
    Entry(WireEntry),
    Attr(WireAttr),
    Data,
    Written(u32),
    Opened(WireOpened),
    Created(WireEntry, WireOpened),
    Dir(Vec<WireDirEntry>),
    Listing(WireListing),
    StatFs(WireStatFs),
    Xattr,
    XattrSize(u32),
    Offset(u64),
    Extended(serde_json::Value),
    Error(WireError),
}

impl WireReply {
    /// The entries of this reply (to add hints to, or read them).
    pub fn entries_mut(&mut self) -> Vec<&mut WireEntry> {
        match self {
            WireReply::Entry(e) | WireReply::Created(e, _) => vec![e],
            WireReply::Dir(d) | WireReply::Listing(WireListing { entries: d, .. }) => {
                d.iter_mut().filter_map(|x| x.entry.as_mut()).collect()
            }
            _ => Vec::new(),
        }
    }

    /// The wire form of a reply, and its payload.
    pub fn from_result(result: Result<Reply, Error>) -> (WireReply, Vec<u8>) {
        let reply = match result {
            Ok(r) => r,
            Err(e) => return (WireReply::Error((&e).into()), Vec::new()),
        };
        let wire = match reply {
            Reply::Empty => WireReply::Empty,
            Reply::Entry(e) => WireReply::Entry((&e).into()),
            Reply::Attr(a) => WireReply::Attr((&a).into()),
            Reply::Data(d) => return (WireReply::Data, d),
            Reply::Written(n) => WireReply::Written(n),
            Reply::Opened(o) => WireReply::Opened((&o).into()),
            Reply::Created(e, o) => WireReply::Created((&e).into(), (&o).into()),
            Reply::Dir(entries) => WireReply::Dir(entries.iter().map(Into::into).collect()),
            Reply::StatFs(s) => WireReply::StatFs(WireStatFs::from(s)),
            Reply::Xattr(XattrReply::Data(d)) => return (WireReply::Xattr, d),
            Reply::Xattr(XattrReply::Size(n)) => WireReply::XattrSize(n),
            Reply::Offset(o) => WireReply::Offset(o),
            Reply::Extended(v) => WireReply::Extended(v),
        };
        (wire, Vec::new())
    }

    /// The stack's reply, taking `payload`. `op` names the operation, for error messages.
    pub fn into_result(self, payload: Vec<u8>, op: &str) -> Result<Reply, Error> {
        Ok(match self {
            WireReply::Empty => Reply::Empty,
            WireReply::Entry(e) => Reply::Entry((&e).into()),
            WireReply::Attr(a) => Reply::Attr((&a).into()),
            WireReply::Data => Reply::Data(payload),
            WireReply::Written(n) => Reply::Written(n),
            WireReply::Opened(o) => Reply::Opened((&o).into()),
            WireReply::Created(e, o) => Reply::Created((&e).into(), (&o).into()),
            WireReply::Dir(entries) => Reply::Dir(entries.iter().map(Into::into).collect()),
            WireReply::StatFs(s) => Reply::StatFs(s.into()),
            WireReply::Xattr => Reply::Xattr(XattrReply::Data(payload)),
            WireReply::XattrSize(n) => Reply::Xattr(XattrReply::Size(n)),
            WireReply::Offset(o) => Reply::Offset(o),
            WireReply::Extended(v) => Reply::Extended(v),
            // Only `listdir`, which is no stack operation, is answered with a listing.
            WireReply::Listing(_) => return Err(Error::BadArgs(format!("{op}: a listing is no reply of a stack"))),
            WireReply::Error(e) => return Err(e.to_error(op)),
        })
    }
}

/// A layer of the peer's stack, as the handshake lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireLayer {
    pub name: String,
    pub kind: String,
}

/// An extended operation the peer's stack answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireExtOp {
    pub name: String,
    pub args: String,
    pub help: String,
    /// The level that answers it.
    pub level: String,
}

impl WireExtOp {
    /// A layer's extended operation, answered at `level`.
    pub fn of(op: &plyfs_stack::ExtOpInfo, level: &str) -> WireExtOp {
        WireExtOp { name: op.name.into(), args: op.args.into(), help: op.help.into(), level: level.into() }
    }

    /// The description a layer gives of it, with `help` for its help line. Layers describe their
    /// operations statically, so the strings are leaked: once per connection made at mount
    /// time, never per request.
    pub fn to_static(&self, help: &str) -> plyfs_stack::ExtOpInfo {
        let leak = |s: &str| -> &'static str { Box::leak(s.to_owned().into_boxed_str()) };
        plyfs_stack::ExtOpInfo { name: leak(&self.name), args: leak(&self.args), help: leak(help) }
    }
}

/// What a process that hosts one layer (`ext:`, `py:`) offers, in its welcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hosted {
    /// `"layer"`: a layer that answers the operations in `ops` and bypasses the rest; or
    /// `"codec"`: a size-changing codec that answers `encode` and `decode`.
    pub kind: String,
    /// The operations a hosted layer answers; the mount sends it no others.
    #[serde(default)]
    pub ops: Vec<String>,
    /// For a layer: `"transparent"`, `"observes"` or `"transforms"` (what it does to file data).
    #[serde(default)]
    pub data: Option<String>,
    /// For a codec: the four bytes stored in every file it writes.
    #[serde(default)]
    pub tag: Option<Bytes>,
    /// For a codec: equal chunks always encode alike (it may stand for a run of zeros).
    #[serde(default)]
    pub deterministic: Option<bool>,
    /// For a codec: it compresses, so a chunk it cannot shrink is stored as it is.
    #[serde(default)]
    pub compresses: Option<bool>,
}

/// A change on the server that a client's caches must forget.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Change {
    /// The object's attributes or data changed.
    Node { node: u64 },
    /// The name in the directory now means something else, or nothing.
    Entry { parent: u64, name: Bytes },
}

/// Every message's header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "lowercase")]
pub enum Message {
    /// The client's opening: the versions it speaks and who it is.
    Hello {
        versions: Vec<u32>,
        software: String,
        /// Proof of the pre-shared key, bound to this TLS session (TCP only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        auth: Option<Bytes>,
    },
    /// The server's answer: the version chosen, its stack and its identity. `instance` changes
    /// whenever the server restarts, which tells a client to find its nodes again.
    Welcome {
        version: u32,
        software: String,
        instance: u64,
        layers: Vec<WireLayer>,
        ext_ops: Vec<WireExtOp>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        auth: Option<Bytes>,
        /// A process hosting one layer or codec says what it offers.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hosted: Option<Hosted>,
    },
    /// The server will not talk to this client; the connection closes after it.
    Refused { reason: String },
    /// A request. `id` 0 asks for no reply (`forget`).
    Req {
        id: u64,
        caller: WireCaller,
        #[serde(flatten)]
        op: RequestOp,
    },
    Rep {
        id: u64,
        #[serde(flatten)]
        reply: WireReply,
    },
    /// Changes the server saw, for the client's caches.
    Changed { changes: Vec<Change> },
}

/// Just the id of a request, read from a header whose operation could not be decoded, so the
/// error can be answered rather than the connection closed.
#[derive(Deserialize)]
pub struct JustId {
    pub t: String,
    pub id: u64,
    #[serde(default)]
    pub op: Option<String>,
}

/// A frame as received: the header bytes and the payload.
pub struct Frame {
    pub header: Vec<u8>,
    pub payload: Vec<u8>,
}

/// Encode a header.
pub fn encode(msg: &Message) -> Vec<u8> {
    rmp_serde::to_vec_named(msg).expect("every message serialises")
}

/// Decode a header.
pub fn decode(header: &[u8]) -> Result<Message, String> {
    check_shape(header)?;
    rmp_serde::from_slice(header).map_err(|e| {
        // A request's operation has two forms (`RequestOp` is untagged), so serde's reason is
        // only that neither fits. For a stack operation, the stack's form says what is wrong.
        let stack_op = matches!(rmp_serde::from_slice::<JustId>(header),
            Ok(JustId { t, op: Some(op), .. }) if t == "req" && op != "encode" && op != "decode");
        match stack_op.then(|| rmp_serde::from_slice::<StackOpOnly>(header)) {
            Some(Err(why)) => why.to_string(),
            _ => e.to_string(),
        }
    })
}

/// Decode MessagePack `bytes` as a `T`, once [`check_shape`] found them sound.
pub fn from_msgpack<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, String> {
    check_shape(bytes)?;
    rmp_serde::from_slice(bytes).map_err(|e| e.to_string())
}

/// Refuse MessagePack whose arrays, maps, strings and binaries announce more than the bytes
/// there are. Decoding reserves room for what a length announces (serde caps it at 1 MiB per
/// array), so a 60-byte hello saying "2 billion elements" cost the server 1 MiB before the
/// peer proved anything. Every value takes at least one byte, so here the values still to be
/// read may never outnumber the bytes left: all that decoding reserves is then bounded by the
/// size of the input.
pub fn check_shape(bytes: &[u8]) -> Result<(), String> {
    let mut at = 0usize;
    // Values still to be read.
    let mut pending = 1usize;
    let take = |at: &mut usize, n: usize| -> Result<usize, String> {
        let end = at.checked_add(n).filter(|&e| e <= bytes.len()).ok_or("a message cut short")?;
        let start = *at;
        *at = end;
        Ok(start)
    };
    let length = |at: &mut usize, n: usize| -> Result<usize, String> {
        let start = take(at, n)?;
        Ok(bytes[start..start + n].iter().fold(0usize, |acc, &b| (acc << 8) | usize::from(b)))
    };
    while pending > 0 {
        pending -= 1;
        let marker = bytes[take(&mut at, 1)?];
        // (values it holds, bytes it holds)
        let (values, skip) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (2 * usize::from(marker & 0x0f), 0),
            0x90..=0x9f => (usize::from(marker & 0x0f), 0),
            0xa0..=0xbf => (0, usize::from(marker & 0x1f)),
            0xc1 => return Err("a malformed message: byte 0xc1 is no MessagePack".into()),
            0xc4 | 0xd9 => (0, length(&mut at, 1)?),
            0xc5 | 0xda => (0, length(&mut at, 2)?),
            0xc6 | 0xdb => (0, length(&mut at, 4)?),
            0xc7 => (0, length(&mut at, 1)? + 1),
            0xc8 => (0, length(&mut at, 2)? + 1),
            0xc9 => (0, length(&mut at, 4)? + 1),
            0xca => (0, 4),
            0xcb => (0, 8),
            0xcc | 0xd0 => (0, 1),
            0xcd | 0xd1 => (0, 2),
            0xce | 0xd2 => (0, 4),
            0xcf | 0xd3 => (0, 8),
            0xd4 => (0, 2),
            0xd5 => (0, 3),
            0xd6 => (0, 5),
            0xd7 => (0, 9),
            0xd8 => (0, 17),
            0xdc => (length(&mut at, 2)?, 0),
            0xdd => (length(&mut at, 4)?, 0),
            0xde => (2 * length(&mut at, 2)?, 0),
            0xdf => (2 * length(&mut at, 4)?, 0),
        };
        take(&mut at, skip)?;
        pending += values;
        if pending > bytes.len() - at {
            return Err(format!("a malformed message: {pending} values announced in the {} bytes left", bytes.len() - at));
        }
    }
    Ok(())
}

/// A request's stack operation alone, decoded for its error.
#[derive(Deserialize)]
struct StackOpOnly {
    #[serde(flatten)]
    _op: OpHeader,
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum FrameError {
    /// The peer closed the connection between frames.
    Closed,
    Io(io::Error),
    /// Sizes over the limits: the peer is broken or hostile, and the connection must close.
    TooLarge {
        header: usize,
        payload: usize,
        limits: FrameLimits,
    },
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Closed => f.write_str("connection closed"),
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::TooLarge { header, payload, limits } => write!(
                f,
                "a frame of {header} header and {payload} payload bytes, over the limits (1 to {} and {})",
                limits.header, limits.payload
            ),
        }
    }
}

/// Read one frame of an established connection. Memory is only reserved for sizes within the
/// limits.
pub fn read_frame<R: Read + ?Sized>(r: &mut R) -> Result<Frame, FrameError> {
    read_frame_within(r, FrameLimits::SESSION)
}

/// Read one frame whose sizes are within `limits`.
pub fn read_frame_within<R: Read + ?Sized>(r: &mut R, limits: FrameLimits) -> Result<Frame, FrameError> {
    let (header, payload) = read_lengths(r, limits)?;
    read_body(r, header, payload)
}

/// Read a frame's two lengths and check them against `limits`: nothing is allocated for a frame
/// over them. A reader that accounts for its memory takes its share between this and
/// [`read_body`].
pub fn read_lengths<R: Read + ?Sized>(r: &mut R, limits: FrameLimits) -> Result<(usize, usize), FrameError> {
    let mut lens = [0u8; 8];
    let mut got = 0;
    while got < lens.len() {
        match r.read(&mut lens[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let header = u32::from_be_bytes(lens[..4].try_into().expect("4 bytes")) as usize;
    let payload = u32::from_be_bytes(lens[4..].try_into().expect("4 bytes")) as usize;
    if header == 0 || header > limits.header || payload > limits.payload {
        return Err(FrameError::TooLarge { header, payload, limits });
    }
    Ok((header, payload))
}

/// Read the header and payload of a frame whose lengths [`read_lengths`] checked.
pub fn read_body<R: Read + ?Sized>(r: &mut R, header: usize, payload: usize) -> Result<Frame, FrameError> {
    let mut h = vec![0u8; header];
    r.read_exact(&mut h).map_err(FrameError::Io)?;
    let mut p = vec![0u8; payload];
    r.read_exact(&mut p).map_err(FrameError::Io)?;
    Ok(Frame { header: h, payload: p })
}

/// Write one frame with a single vectored write where the transport allows: the payload is
/// not copied into the header's buffer.
pub fn write_frame<W: Write + ?Sized>(w: &mut W, header: &[u8], payload: &[u8]) -> io::Result<()> {
    let mut lens = [0u8; 8];
    lens[..4].copy_from_slice(&(header.len() as u32).to_be_bytes());
    lens[4..].copy_from_slice(&(payload.len() as u32).to_be_bytes());
    let parts = [&lens[..], header, payload];
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut done = 0;
    while done < total {
        // Skip what is already written, part by part.
        let mut skip = done;
        let mut slices = Vec::with_capacity(3);
        for p in parts {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            slices.push(IoSlice::new(&p[skip..]));
            skip = 0;
        }
        match w.write_vectored(&slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    w.flush()
}

/// Read the peer's preamble and check it.
pub fn read_preamble<R: Read + ?Sized>(r: &mut R) -> io::Result<()> {
    let mut got = [0u8; 8];
    r.read_exact(&mut got)?;
    if got != PREAMBLE {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "the peer does not speak the plyfs protocol"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(msg: &Message) -> Message {
        decode(&encode(msg)).expect("decodes")
    }

    #[test]
    fn requests_and_replies_round_trip() {
        let req = Message::Req {
            id: 7,
            caller: WireCaller { uid: 1, gid: 2, pid: 3 },
            op: OpHeader::Rename { parent: 1, name: bytes(b"a"), new_parent: 9, new_name: bytes(b"\xffb"), flags: 1 }.into(),
        };
        assert_eq!(round_trip(&req), req);
        let ext = Message::Req {
            id: 8,
            caller: WireCaller { uid: 0, gid: 0, pid: 0 },
            op: OpHeader::Extended { node: 1, name: "stats".into(), args: vec!["x".into()] }.into(),
        };
        assert_eq!(round_trip(&ext), ext);
        let attr = WireAttr {
            size: 1,
            blocks: 2,
            atime: WireTime(-5, 3),
            mtime: WireTime(7, 0),
            ctime: WireTime(8, 999_999_999),
            kind: WireKind::Symlink,
            perm: 0o4755,
            nlink: 2,
            uid: 3,
            gid: 4,
            rdev: 5,
            blksize: 4096,
        };
        let rep = Message::Rep {
            id: 7,
            reply: WireReply::Created(
                WireEntry { node: 5, attr, generation: 1, xattrs: Some(false) },
                WireOpened { fh: 3, direct_io: true, flush_on_close: false },
            ),
        };
        assert_eq!(round_trip(&rep), rep);
        let ext_rep = Message::Rep { id: 8, reply: WireReply::Extended(serde_json::json!({"a": [1, "b", null]})) };
        assert_eq!(round_trip(&ext_rep), ext_rep);
    }

    #[test]
    fn headers_are_named_maps() {
        // Another language reads the operation and its arguments by name.
        let req = Message::Req { id: 1, caller: WireCaller { uid: 0, gid: 0, pid: 0 }, op: OpHeader::GetAttr { node: 1, fh: None }.into() };
        let value: rmpv::Value = rmp_serde::from_slice(&encode(&req)).unwrap();
        let map = value.as_map().expect("a map");
        let get = |k: &str| map.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v.clone());
        assert_eq!(get("t").unwrap().as_str(), Some("req"));
        assert_eq!(get("op").unwrap().as_str(), Some("getattr"));
        assert!(get("args").unwrap().is_map());
    }

    #[test]
    fn times_round_trip_before_and_after_the_epoch() {
        for t in [WireTime(0, 0), WireTime(1, 5), WireTime(-1, 0), WireTime(-2, 500)] {
            assert_eq!(WireTime::from_system(t.to_system()), t);
        }
    }

    #[test]
    fn an_unknown_operation_still_gives_its_id() {
        let mut raw = std::collections::BTreeMap::new();
        raw.insert("t", rmpv::Value::from("req"));
        raw.insert("id", rmpv::Value::from(42));
        raw.insert("op", rmpv::Value::from("teleport"));
        let bytes = rmp_serde::to_vec_named(&raw).unwrap();
        assert!(decode(&bytes).is_err());
        let just: JustId = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!((just.id, just.op.as_deref()), (42, Some("teleport")));
    }

    #[test]
    fn a_malformed_operation_says_what_is_wrong() {
        let caller = rmpv::Value::Map(vec![("uid".into(), 0.into()), ("gid".into(), 0.into()), ("pid".into(), 0.into())]);
        let request = |op: &str, args: Vec<(rmpv::Value, rmpv::Value)>| {
            let fields = [("t", "req".into()), ("id", 42.into()), ("caller", caller.clone()), ("op", op.into()), ("args", rmpv::Value::Map(args))];
            let raw = rmpv::Value::Map(fields.into_iter().map(|(k, v)| (k.into(), v)).collect());
            decode(&rmp_serde::to_vec_named(&raw).unwrap()).unwrap_err()
        };
        assert!(request("lookup", vec![("parent".into(), 1.into())]).contains("name"));
        assert!(request("teleport", vec![]).contains("teleport"));
    }

    #[test]
    fn oversized_frames_are_refused_before_allocating() {
        let mut frame = Vec::new();
        frame.extend_from_slice(&u32::MAX.to_be_bytes());
        frame.extend_from_slice(&0u32.to_be_bytes());
        assert!(matches!(read_frame(&mut &frame[..]), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn bad_names_are_refused() {
        for name in [&b""[..], b"a/b", b"a\0b", b"..", b".", &[b'x'; 256]] {
            let op = OpHeader::MkDir { parent: 1, name: bytes(name), mode: 0o755 };
            assert!(checked_op(&op, &[]).is_err(), "{name:?}");
            if name == b".." {
                continue;
            }
            let op = OpHeader::Lookup { parent: 1, name: bytes(name) };
            assert!(checked_op(&op, &[]).is_err(), "{name:?}");
        }
    }

    /// Lengths that announce more values or bytes than follow are refused before decoding;
    /// every message this side writes passes.
    #[test]
    fn messages_announcing_more_than_they_hold_are_refused() {
        let hello = encode(&Message::Hello { versions: vec![1, 2], software: "x".into(), auth: Some(serde_bytes::ByteBuf::from(vec![7; 40])) });
        assert!(check_shape(&hello).is_ok());
        assert!(decode(&hello).is_ok());
        let bad: &[&[u8]] = &[
            // An array of 2^31 elements, a map of 65535 entries, in a few bytes.
            &[0xdd, 0x80, 0, 0, 0, 1, 2, 3],
            &[0x81, 0xa1, b'v', 0xde, 0xff, 0xff, 1, 2],
            // A string and a binary longer than the message.
            &[0xdb, 0, 0, 0x10, 0, b'a'],
            &[0xc5, 0x01, 0x00, 0],
            // Arrays each within the bytes left, together over them.
            &[0x92, 0x9f, 0x9f, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
            // Cut short, and a byte that is no MessagePack.
            &[0x92, 0x01],
            &[0xc1],
            &[],
        ];
        for b in bad {
            assert!(check_shape(b).is_err(), "{b:02x?}");
            assert!(decode(b).is_err(), "{b:02x?}");
        }
        // Right at the limit: 15 values in 15 bytes.
        let mut full = vec![0x9f];
        full.extend(1..=15u8);
        assert!(check_shape(&full).is_ok());
    }
}
