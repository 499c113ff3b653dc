//! The service's protection core: the thesis's operations on extents and exonodes, each checked
//! against the capabilities presented, over the volume, the free map and the metadata cache.
//!
//! It does not know who its clients are or how they reach it (the socket service wraps it); tests
//! and offline tools use it directly.
//!
//! Ordering on disk keeps the invariants through any crash:
//! - allocating: the free-map bits first, then the record;
//! - freeing: the record that gives sectors up first (overwritten, or rewritten without them), the
//!   free-map bits after;
//! - a descendant: the child's record before the parent names it, and the parent's record without
//!   it before the child is overwritten (an exonode its parent does not name is an orphan the scan
//!   reclaims);
//! - extent data: a data sector's seal before its bytes, and sectors allocated as extent data have
//!   their seals emptied first, so that they read as zeros, not as an earlier owner's data
//!   (`content`).

use std::collections::{BTreeSet, HashMap};

use crate::disk::Disk;
use crate::freemap::FreeMap;
use crate::layout::Superblock;
use crate::content::DataSeal;
use crate::object::{Caps, Exonode, ExtentHeader};
use crate::seal::VolumeKey;

mod access;
mod cache;
mod exonodes;
mod extents;
mod io;
mod proxies;
mod records;

/// When an object's changes reach the disk (thesis §5.4.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persistence {
    /// Metadata stays in the service's memory; the object is gone after a restart.
    Memory,
    /// Metadata is written and flushed before a change is answered; data writes are not flushed.
    Metadata,
    /// Metadata and data are written and flushed before they are answered.
    Data,
}

impl Persistence {
    /// Its code in a record.
    pub fn code(self) -> u8 {
        match self {
            Persistence::Memory => 0,
            Persistence::Metadata => 1,
            Persistence::Data => 2,
        }
    }

    pub fn from_code(c: u8) -> Persistence {
        match c {
            0 => Persistence::Memory,
            2 => Persistence::Data,
            _ => Persistence::Metadata,
        }
    }
}

/// An error for the client: an errno and one line saying why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExoError {
    pub errno: i32,
    pub msg: String,
}

impl std::fmt::Display for ExoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for ExoError {}

pub type Result<T> = std::result::Result<T, ExoError>;

fn err<T>(errno: i32, msg: impl Into<String>) -> Result<T> {
    Err(ExoError { errno, msg: msg.into() })
}

/// A data sector whose seal did not open: `EIO`, as a disk's unreadable sector.
pub fn unsealed(u: crate::content::Unsealed) -> ExoError {
    ExoError { errno: libc::EIO, msg: format!("sector {}: its data fail authentication (altered, or torn by a crash)", u.sector) }
}

fn io_err(e: std::io::Error) -> ExoError {
    ExoError { errno: e.raw_os_error().unwrap_or(libc::EIO), msg: format!("volume: {e}") }
}

/// What an operation names: an extent (by its first sector), or an exonode reached from the
/// exonode at `at` through the descendant entries of `path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Extent(u64),
    Exonode { at: u64, path: Vec<u32> },
    Proxy(u64),
}

/// The access an operation needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

#[derive(Clone, Debug)]
enum Obj {
    Extent(ExtentHeader),
    Exonode(Exonode),
}

struct Cached {
    obj: Obj,
    persistence: Persistence,
    /// Its record was written since it was allocated (so freeing must overwrite it).
    on_disk: bool,
    /// Changed since last written.
    dirty: bool,
    /// For LRU replacement (a counter).
    used: u64,
    /// Sectors it gave up while its record on the disk still names them (a `memory`-model
    /// object written before, changed since): freed only once the record is written again or
    /// overwritten, so that a crash never leaves a record naming free sectors.
    stale_frees: Vec<(u64, u64)>,
}

/// A proxy (thesis §2.2.3, unbuilt there): part of an object under new capabilities, in memory
/// only.
#[derive(Clone, Debug)]
pub struct Proxy {
    pub target: Target,
    pub caps: Caps,
    /// The most it may do: what the capability it was made with allowed.
    pub access: Access,
    /// Sectors it covers (an extent's or an exonode's extents, intersected at each use).
    pub sectors: Option<(u64, u64)>,
    /// The exonode's entries it grants, when it grants only some: I/O on their extents, and
    /// `MAP` and `READ_DATA` showing only them. No other entry operation goes through it.
    pub entries: Option<Vec<u32>>,
}

pub struct Core {
    disk: Disk,
    key: VolumeKey,
    /// Extent data's seals (shared with the service's disk queue, which opens what it reads).
    content: std::sync::Arc<DataSeal>,
    pub sb: Superblock,
    map: FreeMap,
    map_dirty: BTreeSet<u64>,
    cache: HashMap<u64, Cached>,
    clock: u64,
    proxies: HashMap<u64, Proxy>,
    next_proxy: u64,
    /// In a batch: records are written without a flush each, and sectors given up are freed in
    /// the map only after the one flush at its end (so that a cleared bit never reaches the
    /// disk before the record that gave the sectors up).
    batch: Option<Batch>,
    /// Something a record may depend on (free-map blocks, emptied data seals) was written since
    /// the last flush: the next record waits for a flush, since the disk may otherwise take
    /// the record first.
    unflushed_deps: bool,
}

#[derive(Default)]
struct Batch {
    unflushed: bool,
    freed: Vec<(u64, u64)>,
}

/// The sectors an extent's data takes: after its header.
fn extent_data(at: u64, h: &ExtentHeader) -> (u64, u64) {
    (at + 1, at + h.sectors)
}

impl Core {
    /// Take over a volume whose map the start-up scan reconciled.
    pub fn new(disk: Disk, key: VolumeKey, sb: Superblock, map: FreeMap) -> Core {
        let content = DataSeal::new(key.data_key(), disk.fd(), disk.write_log(), sb.tags_start, sb.tag_sectors);
        Core {
            disk,
            key,
            content: std::sync::Arc::new(content),
            sb,
            map,
            map_dirty: BTreeSet::new(),
            cache: HashMap::new(),
            clock: 0,
            proxies: HashMap::new(),
            next_proxy: 1,
            batch: None,
            unflushed_deps: false,
        }
    }

    /// Start a batch of requests: what they write is flushed once, by [`Core::end_batch`]. With
    /// `records`, what was written before (file data) is flushed first, so that no record
    /// written in the batch reaches the disk before the data it describes.
    pub fn begin_batch(&mut self, records: bool) -> Result<()> {
        if records {
            self.sync_disk()?;
        }
        self.batch = Some(Batch::default());
        Ok(())
    }

    /// End a batch: one flush, then the sectors its requests gave up are freed.
    pub fn end_batch(&mut self) -> Result<()> {
        let Some(b) = self.batch.take() else { return Ok(()) };
        if b.unflushed {
            self.sync_disk()?;
        }
        for (start, len) in b.freed {
            self.mark(start, len, false);
        }
        if !self.map_dirty.is_empty() {
            self.flush_map()?;
        }
        Ok(())
    }

    /// Make what was just written durable now, or at the end of the batch.
    fn settle(&mut self) -> Result<()> {
        match &mut self.batch {
            Some(b) => {
                b.unflushed = true;
                Ok(())
            }
            None => self.sync_disk(),
        }
    }

    pub fn free_map(&self) -> &FreeMap {
        &self.map
    }

    pub fn disk(&self) -> &Disk {
        &self.disk
    }

    /// Extent data's seals: data is sealed before it is written and opened after it is read.
    pub fn content(&self) -> std::sync::Arc<DataSeal> {
        self.content.clone()
    }

    /// Sectors just allocated as extent data read as zeros until written.
    fn forget_data(&mut self, start: u64, len: u64) -> Result<()> {
        self.unflushed_deps = true;
        self.content.forget(start, len).map_err(io_err)
    }

    /// Flush the volume.
    fn sync_disk(&mut self) -> Result<()> {
        self.disk.sync().map_err(io_err)?;
        self.unflushed_deps = false;
        Ok(())
    }
}
