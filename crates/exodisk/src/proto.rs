//! What clients and the service say over the Unix socket: frames of a 32-bit length and a
//! MessagePack message. Bulk data never crosses the socket: it is in the client's shared memory
//! (a memfd handed over at `Hello`), at offsets the requests name.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::core::{Persistence, Target};
use crate::object::{Caps, Entry, Exonode};

pub const VERSION: u32 = 3;
/// The largest frame.
pub const MAX_FRAME: usize = 16 << 20;
/// The most bytes of the free map one reply carries (32 GiB of sectors): well within a frame.
pub const FREE_MAP_PAGE: u64 = 8 << 20;
/// The largest frame before a client is admitted (its `Hello`): a few KiB, so that a client that
/// has not even said hello cannot make the service allocate more (#28).
pub const MAX_HELLO: usize = 4 << 10;
/// What the lists of one message may take in memory beyond the message's own bytes: a list
/// element can be much larger decoded than encoded (a request of 5 bytes is a hundred in
/// memory), so the lists of a request are counted as they are decoded, and one over this is
/// refused.
pub const MAX_DECODED: usize = 8 << 20;
/// How deep lists may nest in a request (a batch of data requests naming exonodes by path is 3).
const MAX_NESTING: usize = 4;

/// A capability on the wire: two 64-bit halves (low, high).
pub type WCap = [u64; 2];

pub fn wcap(c: u128) -> WCap {
    [c as u64, (c >> 64) as u64]
}

pub fn cap(w: WCap) -> u128 {
    w[0] as u128 | (w[1] as u128) << 64
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct WCaps {
    pub read: WCap,
    pub write: WCap,
}

impl From<Caps> for WCaps {
    fn from(c: Caps) -> WCaps {
        WCaps { read: wcap(c.read), write: wcap(c.write) }
    }
}

impl From<WCaps> for Caps {
    fn from(c: WCaps) -> Caps {
        Caps { read: cap(c.read), write: cap(c.write) }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum WTarget {
    Extent(u64),
    Exonode {
        at: u64,
        #[serde(deserialize_with = "bounded")]
        path: Vec<u32>,
    },
    Proxy(u64),
}

impl From<&WTarget> for Target {
    fn from(t: &WTarget) -> Target {
        match t {
            WTarget::Extent(a) => Target::Extent(*a),
            WTarget::Exonode { at, path } => Target::Exonode { at: *at, path: path.clone() },
            WTarget::Proxy(id) => Target::Proxy(*id),
        }
    }
}

impl From<&Target> for WTarget {
    fn from(t: &Target) -> WTarget {
        match t {
            Target::Extent(a) => WTarget::Extent(*a),
            Target::Exonode { at, path } => WTarget::Exonode { at: *at, path: path.clone() },
            Target::Proxy(id) => WTarget::Proxy(*id),
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WPersistence {
    Memory,
    Metadata,
    Data,
}

impl From<WPersistence> for Persistence {
    fn from(p: WPersistence) -> Persistence {
        match p {
            WPersistence::Memory => Persistence::Memory,
            WPersistence::Metadata => Persistence::Metadata,
            WPersistence::Data => Persistence::Data,
        }
    }
}

impl From<Persistence> for WPersistence {
    fn from(p: Persistence) -> WPersistence {
        match p {
            Persistence::Memory => WPersistence::Memory,
            Persistence::Metadata => WPersistence::Metadata,
            Persistence::Data => WPersistence::Data,
        }
    }
}

/// One data request: `count` sectors from `sector`, to or from the shared memory at `offset`.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct IoReq {
    pub id: u64,
    pub target: WTarget,
    pub cap: WCap,
    pub write: bool,
    pub sector: u64,
    pub count: u32,
    pub offset: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub enum Request {
    /// The first message; the shared memory's descriptor rides along with it.
    Hello {
        version: u32,
        shm: u64,
    },
    /// The caller's named root exonode (made on first use): the exonode server of §4.3.
    Root {
        name: String,
        uid: Option<u32>,
        /// Hold the root for this connection alone (a file system mounted on it): another
        /// exclusive holder waits until the first connection ends (at most 10 s, then EBUSY).
        #[serde(default)]
        exclusive: bool,
    },
    /// Up to [`FREE_MAP_PAGE`] bytes of the free map (as [`crate::freemap::FreeMap::to_bits`]
    /// lays it out), from byte `from`: a whole map of a large volume is larger than a frame.
    FreeMap {
        from: u64,
    },
    ExtentAllocate {
        at: u64,
        sectors: u64,
        caps: WCaps,
        persistence: WPersistence,
    },
    ExtentDeallocate {
        at: u64,
        wcap: WCap,
    },
    ExtentResize {
        at: u64,
        wcap: WCap,
        by: i64,
    },
    ExonodeAllocate {
        at: u64,
        sectors: u32,
        caps: WCaps,
        persistence: WPersistence,
    },
    ExonodeDeallocate {
        target: WTarget,
        wcap: WCap,
    },
    AddExtent {
        target: WTarget,
        wcap: WCap,
        idx: Option<u32>,
        start: u64,
        sectors: u64,
    },
    AddExonode {
        target: WTarget,
        wcap: WCap,
        idx: Option<u32>,
        child: u64,
        sectors: u32,
        caps: WCaps,
        /// The descendant's own persistence model (its parent's when absent).
        #[serde(default)]
        persistence: Option<WPersistence>,
        /// Data entries it starts with (entries 0, 1, ...), saving a request each.
        #[serde(default, deserialize_with = "bounded")]
        data: Vec<ByteBuf>,
    },
    AddData {
        target: WTarget,
        wcap: WCap,
        idx: Option<u32>,
        data: ByteBuf,
    },
    ReadData {
        target: WTarget,
        rcap: WCap,
        idx: u32,
    },
    RemoveEntry {
        target: WTarget,
        wcap: WCap,
        idx: u32,
    },
    Combine {
        target: WTarget,
        wcap: WCap,
        a: u32,
        b: u32,
    },
    Split {
        target: WTarget,
        wcap: WCap,
        idx: u32,
        at_sector: u64,
        new_idx: Option<u32>,
    },
    CapDiscover {
        target: WTarget,
        cap: WCap,
        idx: u32,
    },
    Load {
        at: u64,
    },
    WriteRecord {
        target: WTarget,
        wcap: WCap,
    },
    Map {
        target: WTarget,
        rcap: WCap,
    },
    Proxy {
        target: WTarget,
        cap: WCap,
        range: Option<(u64, u64)>,
        caps: WCaps,
    },
    /// A proxy of some entries of an exonode (the thesis's proxy of part of an exonode).
    ProxyEntries {
        target: WTarget,
        cap: WCap,
        #[serde(deserialize_with = "bounded")]
        entries: Vec<u32>,
        caps: WCaps,
    },
    RemoveProxy {
        id: u64,
        cap: WCap,
    },
    MarkReplacement {
        at: u64,
    },
    InCache {
        at: u64,
    },
    /// Data requests, answered at once with how many were queued; each completes with a
    /// `Done` message (and in its slot of the shared memory).
    Io {
        #[serde(deserialize_with = "bounded")]
        reqs: Vec<IoReq>,
    },
    Poll,
    Shutdown,
    /// Requests done in order in one round trip, stopping at the first that fails (a compound
    /// request, as NFSv4's): a library file system writes back many objects at once. `Hello`,
    /// `Root`, `Shutdown` and `Batch` itself are refused inside.
    Batch {
        #[serde(deserialize_with = "bounded")]
        reqs: Vec<Request>,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum WEntry {
    Empty,
    Extent { start: u64, sectors: u64 },
    Descendant { at: u64 },
    Data(ByteBuf),
}

impl From<&Entry> for WEntry {
    fn from(e: &Entry) -> WEntry {
        match e {
            Entry::Empty => WEntry::Empty,
            Entry::Extent { start, sectors } => WEntry::Extent { start: *start, sectors: *sectors },
            Entry::Descendant { at } => WEntry::Descendant { at: *at },
            Entry::Data(d) => WEntry::Data(ByteBuf::from(d.clone())),
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct WExonode {
    pub sectors: u32,
    pub parent: u64,
    pub entries: Vec<WEntry>,
}

impl From<&Exonode> for WExonode {
    fn from(x: &Exonode) -> WExonode {
        WExonode { sectors: x.sectors, parent: x.parent, entries: x.entries.iter().map(Into::into).collect() }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Ok,
    Welcome {
        version: u32,
        sectors: u64,
        data_start: u64,
        client: u64,
    },
    Root {
        at: u64,
        caps: WCaps,
    },
    FreeMap {
        sectors: u64,
        bits: ByteBuf,
    },
    Entry(u32),
    Sectors(u64),
    Caps(WCaps),
    Data(ByteBuf),
    Exonode(WExonode),
    Id(u64),
    Bool(bool),
    Queued(u32),
    /// Requests pending in the service, and its queue in order: sector, sectors, whether it is
    /// the caller's.
    Poll {
        pending: u64,
        queue: Vec<(u64, u32, bool)>,
    },
    /// The results of a batch's requests, in order, up to and including the first failure.
    Batch(Vec<Result<Reply, (i32, String)>>),
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub enum Message {
    Req {
        id: u64,
        req: Request,
    },
    Rep {
        id: u64,
        result: Result<Reply, (i32, String)>,
    },
    /// A data request completed: bytes done, or a negative errno.
    Done {
        id: u64,
        result: i32,
    },
}

pub fn write_message(w: &mut impl Write, m: &Message) -> io::Result<()> {
    w.write_all(&frame_message(m)?)
}

/// A message as it goes on the socket: its length, then its MessagePack.
pub fn frame_message(m: &Message) -> io::Result<Vec<u8>> {
    let mut frame = vec![0u8; 4];
    rmp_serde::encode::write(&mut frame, m).map_err(io::Error::other)?;
    let len = (frame.len() - 4) as u32;
    frame[..4].copy_from_slice(&len.to_le_bytes());
    Ok(frame)
}

pub fn read_message(r: &mut impl Read) -> io::Result<Message> {
    read_message_within(r, MAX_FRAME)
}

/// Read a message of at most `max` bytes; nothing is allocated for a longer one, and its lists
/// may take at most [`MAX_DECODED`] bytes more once decoded.
pub fn read_message_within(r: &mut impl Read, max: usize) -> io::Result<Message> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a frame of {len} bytes (at most {max} here)")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    decode_message(&body)
}

/// Decode a message's MessagePack, within [`MAX_DECODED`].
pub fn decode_message(body: &[u8]) -> io::Result<Message> {
    DECODE_LEFT.with(|left| left.set((MAX_DECODED, 0)));
    rmp_serde::from_slice(body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

thread_local! {
    /// The bytes the lists of the message being decoded may still take, and how deep they nest.
    static DECODE_LEFT: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((MAX_DECODED, 0)) };
}

/// A list, counted against [`MAX_DECODED`] element by element as it is decoded (never reserved
/// from the length the message claims).
fn bounded<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Bounded<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Bounded<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            use serde::de::Error;
            let (left, depth) = DECODE_LEFT.with(|l| l.get());
            if depth >= MAX_NESTING {
                return Err(A::Error::custom("lists nested too deep"));
            }
            DECODE_LEFT.with(|l| l.set((left, depth + 1)));
            let mut out = Vec::new();
            let each = std::mem::size_of::<T>().max(1);
            let result = loop {
                let (left, depth) = DECODE_LEFT.with(|l| l.get());
                let Some(left) = left.checked_sub(each) else {
                    break Err(A::Error::custom(format!("lists over {MAX_DECODED} bytes decoded")));
                };
                DECODE_LEFT.with(|l| l.set((left, depth)));
                match seq.next_element() {
                    Ok(Some(e)) => out.push(e),
                    Ok(None) => break Ok(out),
                    Err(e) => break Err(e),
                }
            };
            DECODE_LEFT.with(|l| {
                let (left, depth) = l.get();
                l.set((left, depth - 1));
            });
            result
        }
    }
    d.deserialize_seq(Bounded(std::marker::PhantomData))
}
