//! What each kind of operation argument does: how a descriptor shows it, how it follows a
//! readdressed operation, and its form in an [`OpHeader`](super::OpHeader), the owned,
//! serialisable operation a transport sends. The forms here are the protocol's
//! (`docs/protocol.md`): changing one changes the bytes on the wire.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
pub use serde_bytes::ByteBuf;

use super::Arg;
use crate::types::{from_unix_time, unix_time, FileHandle, NodeId, SetAttr, TimeSet};

/// Where an argument that travels as the request's payload stands in an [`OpHeader`](super::OpHeader):
/// it has no header form (the declaration skips it), so forgetting to skip one fails to compile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Payload;

/// A time as seconds and nanoseconds since the epoch (seconds may be negative).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireTime(pub i64, pub u32);

impl WireTime {
    pub fn from_system(t: SystemTime) -> WireTime {
        let (secs, nanos) = unix_time(t);
        WireTime(secs, nanos)
    }

    pub fn to_system(self) -> SystemTime {
        from_unix_time(self.0, self.1)
    }
}

/// A time to set: `"now"` or a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireTimeSet {
    Now,
    At(WireTime),
}

impl From<TimeSet> for WireTimeSet {
    fn from(t: TimeSet) -> WireTimeSet {
        match t {
            TimeSet::Now => WireTimeSet::Now,
            TimeSet::At(t) => WireTimeSet::At(WireTime::from_system(t)),
        }
    }
}

impl From<WireTimeSet> for TimeSet {
    fn from(t: WireTimeSet) -> TimeSet {
        match t {
            WireTimeSet::Now => TimeSet::Now,
            WireTimeSet::At(t) => TimeSet::At(t.to_system()),
        }
    }
}

/// What `setattr` changes, as its header carries it (its fields sit among the operation's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAttrHeader {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<WireTimeSet>,
    pub mtime: Option<WireTimeSet>,
}

/// One kind of operation argument, as its `Op` type.
pub(super) trait OpArg<'a>: Copy + 'a {
    /// Its form in an `OpHeader`.
    type Header: 'a;

    /// Its header form; an argument that travels as the payload puts itself in `payload`.
    fn to_header(self, payload: &mut &'a [u8]) -> Self::Header;

    /// Back from its header form, or from `payload`.
    fn from_header(header: &'a Self::Header, payload: &'a [u8]) -> Self;

    /// Its descriptor entries, under `key`.
    fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>);

    /// The argument of the same operation on another level, whose handle is `handle` if given
    /// (see `Op::at` and `Op::on_open`). Only handles change.
    fn readdressed(self, _handle: Option<FileHandle>) -> Self {
        self
    }
}

/// Numbers and flags travel and show as they are.
macro_rules! plain_args {
    ($($t:ty => $arg:ident),*) => {$(
        impl<'a> OpArg<'a> for $t {
            type Header = $t;
            fn to_header(self, _: &mut &'a [u8]) -> $t {
                self
            }
            fn from_header(header: &'a $t, _: &'a [u8]) -> $t {
                *header
            }
            fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>) {
                args.push((key, Arg::$arg(self.into())));
            }
        }
    )*};
}

plain_args!(u64 => U64, u32 => U64, i64 => I64, i32 => I64, bool => Bool);

impl<'a> OpArg<'a> for NodeId {
    type Header = u64;
    fn to_header(self, _: &mut &'a [u8]) -> u64 {
        self.0
    }
    fn from_header(header: &'a u64, _: &'a [u8]) -> NodeId {
        NodeId(*header)
    }
    fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>) {
        args.push((key, Arg::U64(self.0)));
    }
}

impl<'a> OpArg<'a> for FileHandle {
    type Header = u64;
    fn to_header(self, _: &mut &'a [u8]) -> u64 {
        self.0
    }
    fn from_header(header: &'a u64, _: &'a [u8]) -> FileHandle {
        FileHandle(*header)
    }
    fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>) {
        args.push((key, Arg::U64(self.0)));
    }
    fn readdressed(self, handle: Option<FileHandle>) -> FileHandle {
        handle.unwrap_or(self)
    }
}

/// An optional handle (`getattr`, `setattr`) only speeds things up: on another level it is that
/// level's handle, or none.
impl<'a> OpArg<'a> for Option<FileHandle> {
    type Header = Option<u64>;
    fn to_header(self, _: &mut &'a [u8]) -> Option<u64> {
        self.map(|f| f.0)
    }
    fn from_header(header: &'a Option<u64>, _: &'a [u8]) -> Option<FileHandle> {
        header.map(FileHandle)
    }
    fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>) {
        args.push((key, self.map_or(Arg::I64(-1), |f| Arg::U64(f.0))));
    }
    fn readdressed(self, handle: Option<FileHandle>) -> Option<FileHandle> {
        handle
    }
}

impl<'a> OpArg<'a> for &'a OsStr {
    type Header = ByteBuf;
    fn to_header(self, _: &mut &'a [u8]) -> ByteBuf {
        ByteBuf::from(self.as_bytes().to_vec())
    }
    fn from_header(header: &'a ByteBuf, _: &'a [u8]) -> &'a OsStr {
        OsStr::from_bytes(header)
    }
    fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>) {
        args.push((key, Arg::Str(self.to_string_lossy())));
    }
}

impl<'a> OpArg<'a> for &'a Path {
    type Header = ByteBuf;
    fn to_header(self, _: &mut &'a [u8]) -> ByteBuf {
        ByteBuf::from(self.as_os_str().as_bytes().to_vec())
    }
    fn from_header(header: &'a ByteBuf, _: &'a [u8]) -> &'a Path {
        Path::new(OsStr::from_bytes(header))
    }
    fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>) {
        args.push((key, Arg::Str(self.to_string_lossy())));
    }
}

impl<'a> OpArg<'a> for &'a str {
    type Header = String;
    fn to_header(self, _: &mut &'a [u8]) -> String {
        self.to_owned()
    }
    fn from_header(header: &'a String, _: &'a [u8]) -> &'a str {
        header
    }
    fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>) {
        args.push((key, Arg::Str(self.into())));
    }
}

impl<'a> OpArg<'a> for &'a [String] {
    type Header = Vec<String>;
    fn to_header(self, _: &mut &'a [u8]) -> Vec<String> {
        self.to_vec()
    }
    fn from_header(header: &'a Vec<String>, _: &'a [u8]) -> &'a [String] {
        header
    }
    fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>) {
        args.push((key, Arg::Strs(self)));
    }
}

/// Bulk data: the payload, described by its length.
impl<'a> OpArg<'a> for &'a [u8] {
    type Header = Payload;
    fn to_header(self, payload: &mut &'a [u8]) -> Payload {
        *payload = self;
        Payload
    }
    fn from_header(_: &'a Payload, payload: &'a [u8]) -> &'a [u8] {
        payload
    }
    fn describe(self, key: &'static str, args: &mut Vec<(&'static str, Arg<'a>)>) {
        args.push((key, Arg::Bytes(self.len())));
    }
}

/// The changes of `setattr` show as one entry each, only those it makes.
impl<'a> OpArg<'a> for SetAttr {
    type Header = SetAttrHeader;
    fn to_header(self, _: &mut &'a [u8]) -> SetAttrHeader {
        SetAttrHeader {
            mode: self.mode,
            uid: self.uid,
            gid: self.gid,
            size: self.size,
            atime: self.atime.map(Into::into),
            mtime: self.mtime.map(Into::into),
        }
    }
    fn from_header(h: &'a SetAttrHeader, _: &'a [u8]) -> SetAttr {
        SetAttr {
            mode: h.mode,
            uid: h.uid,
            gid: h.gid,
            size: h.size,
            atime: h.atime.map(Into::into),
            mtime: h.mtime.map(Into::into),
        }
    }
    fn describe(self, _: &'static str, v: &mut Vec<(&'static str, Arg<'a>)>) {
        if let Some(m) = self.mode {
            v.push(("mode", Arg::Str(format!("{m:o}").into())));
        }
        if let Some(u) = self.uid {
            v.push(("uid", Arg::U64(u.into())));
        }
        if let Some(g) = self.gid {
            v.push(("gid", Arg::U64(g.into())));
        }
        if let Some(s) = self.size {
            v.push(("size", Arg::U64(s)));
        }
        if self.atime.is_some() {
            v.push(("atime", Arg::Bool(true)));
        }
        if self.mtime.is_some() {
            v.push(("mtime", Arg::Bool(true)));
        }
    }
}
