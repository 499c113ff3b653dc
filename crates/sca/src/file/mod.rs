//! One encoded file: reads, writes, truncation, recovery and compaction over its lower file.
//!
//! Writes never change a record in place. A rewritten chunk is appended to the log as a new
//! record and the old one becomes dead space (the "decoupled order" of Fast Indexing §9), so a
//! write in the middle costs one chunk of work however long the file is. [`ScaFile::compact`]
//! reclaims the dead space; it runs by itself once the dead space outgrows the live data.
//!
//! This module holds the file's state and its core; each concern has a module of its own:
//! `load` (open: header, slot, checkpoint), `rebuild` (an index from the records alone), `read`,
//! `write` (with fast tails), `encode` (the codec and the encoder pool), `log` (appending
//! records, the checkpoint and the slot), `truncate`, `fallocate`, `pad` (padded files),
//! `persist` (sync and close), `compact`, `verify`, and `share` (files other mounts share).
//!
//! **Padded files** (an engine with `pad`, for ciphers: `crypt:pad=padme`) hide their size from
//! whoever reads the lower file. Everything stored in the clear (record headers, slots, the
//! checkpoint, the number of records) describes the *stored* content: the file's bytes, zeros,
//! and a 16-byte trailer holding the real size, sealed like any other data. At the last close
//! (and at `fsync`) the stored content is brought to `padme(size + 16)` bytes with zeros
//! written as data, not as holes, so nothing below tells the real size to less than what
//! PADMÉ leaves (O(log log size) bits). While a file is open and growing, its stored size is
//! its size plus the trailer. A padded file says so in its header and is read as one whatever
//! the mount's setting.

mod compact;
mod encode;
mod fallocate;
mod load;
mod log;
mod pad;
mod persist;
mod read;
mod rebuild;
mod share;
mod truncate;
mod verify;
mod write;

pub use compact::COMPACT_SLACK_BYTES;
pub use fallocate::reserve_bytes;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;
use plyfs_stack::shared::{LockKind, SharedMode};
use plyfs_stack::{Error, Result};
use serde_json::{json, Value};

use crate::codec::Codec;
use crate::format::{FileHeader, HEADER_PADDED};
use crate::index::FileIndex;

use encode::EncodedChunk;
use share::Seen;

/// The lower file under an encoded file. The layer implements it with operations on the layer
/// below; tests implement it in memory.
pub trait LowerIo {
    /// Up to `len` bytes at `off` (fewer at the end of the file).
    fn read_at(&self, off: u64, len: usize) -> Result<Vec<u8>>;
    fn write_at(&self, off: u64, data: &[u8]) -> Result<()>;
    fn set_len(&self, len: u64) -> Result<()>;
    fn len(&self) -> Result<u64>;
    fn sync(&self) -> Result<()>;
    /// Whether the file can be written (repairs are skipped when it cannot).
    fn writable(&self) -> bool;
    /// The file, for messages.
    fn describe(&self) -> String;
    /// Take a lock on the file against other mounts sharing it (see
    /// [`plyfs_stack::shared`]). Only called when the engine shares its files.
    fn lock(&self, _kind: LockKind) -> Result<()> {
        Ok(())
    }
    fn unlock(&self, _kind: LockKind) -> Result<()> {
        Ok(())
    }
    /// Set aside room for `len` more bytes past the file's end (`fallocate` with
    /// `FALLOC_FL_KEEP_SIZE`): `ENOSPC` when the file system below has not that much.
    fn reserve(&self, _len: u64) -> Result<()> {
        Ok(())
    }
}

/// Per-layer settings and shared state: the codec and what it encodes a zero chunk to.
pub struct Engine {
    pub kind: &'static str,
    pub codec: Arc<dyn Codec>,
    /// Chunk size for new files, as a power of two.
    pub chunk_shift: u8,
    pub fast_tails: bool,
    /// Other mounts may change the files (`-o shared`): every change is made under the lower
    /// file's lock, after catching up with theirs.
    pub shared: Option<SharedMode>,
    /// New files are padded (see the module documentation).
    pub pad: bool,
    zero_chunks: Mutex<HashMap<u8, Arc<EncodedChunk>>>,
}

impl Engine {
    pub fn new(kind: &'static str, codec: Arc<dyn Codec>, chunk_shift: u8, fast_tails: bool) -> Engine {
        encode::start_encoder_pool();
        Engine { kind, codec, chunk_shift, fast_tails, shared: None, pad: false, zero_chunks: Mutex::new(HashMap::new()) }
    }

    /// The same engine, padding the size of new files (PADMÉ).
    pub fn padding(self, pad: bool) -> Engine {
        Engine { pad, ..self }
    }

    /// The same engine for files other mounts share.
    pub fn sharing(self, mode: Option<SharedMode>) -> Engine {
        Engine { shared: mode, ..self }
    }
}

/// Why a read could not be served from the index as it stands.
#[derive(Debug)]
pub enum Fault {
    /// The index disagrees with the lower file: rebuild it and try again.
    Stale(String),
    Fail(Error),
}

impl From<Error> for Fault {
    fn from(e: Error) -> Fault {
        Fault::Fail(e)
    }
}

/// Largest lower read or write the file issues at once.
const IO_WINDOW_BYTES: u64 = 4 << 20;

pub struct ScaFile<L: LowerIo> {
    engine: Arc<Engine>,
    lower: L,
    ix: FileIndex,
    header_on_disk: bool,
    /// The file's identity from its header (zeros when its codec uses none).
    file_id: [u8; 16],
    slot_seq: u64,
    slot_dirty: bool,
    /// Chunks whose newest data is gone: they read as EIO until rewritten whole.
    lost: BTreeSet<u64>,
    /// Records appended but not yet written to the lower file.
    pending: Vec<u8>,
    pending_start: u64,
    /// The start of the lower file, read once while loading. Reads of a small file are served
    /// from it until the file is first written to or closed.
    prefetched: Vec<u8>,
    /// The records in this range of `prefetched` had their checksums checked while loading.
    verified: std::ops::Range<u64>,
    /// Whether this open changed the file.
    modified: bool,
    /// The partial chunk last stored, decoded, with its record's sequence number: the next
    /// write into it (a program writing in pieces that are not whole chunks) needs neither to
    /// read nor to decode it.
    hot: Option<(u64, u64, Vec<u8>)>,
    /// A chunk-sized buffer for read-modify-write.
    scratch: Vec<u8>,
    /// For a shared file: the lower file as last seen under its lock.
    seen: Option<Seen>,
    /// Within an operation under a shared (read) lock: nothing may be written.
    read_locked: bool,
    /// Why loading the file had to rebuild its index, until `verify` reports it (`fsck`
    /// counts the indexes it rebuilt).
    rebuilt_at_load: Option<String>,
    /// A repair was needed under a read lock: the operation must run again under the write lock.
    needs_write_lock: bool,
    /// Another mount changed the file since this was last told (see [`Self::take_changed`]).
    changed_outside: bool,
    /// The log said that the lower file cannot be locked.
    told_no_locks: bool,
    /// The file is padded: its real size is in the trailer.
    padded: bool,
    /// The real size of a padded file, once read from its trailer ([`NOT_KNOWN`] before).
    real_size: std::sync::atomic::AtomicU64,
}

/// [`ScaFile::real_size`] not read yet.
const NOT_KNOWN: u64 = u64::MAX;

impl<L: LowerIo> ScaFile<L> {
    /// Open the encoded file in `lower`, loading and checking its index, and rebuilding it from
    /// the records if it is missing or inconsistent.
    pub fn open(engine: Arc<Engine>, lower: L) -> Result<ScaFile<L>> {
        let shared = engine.shared.is_some();
        let mut f = ScaFile::new_empty(engine, lower);
        if shared {
            f.revalidate()?;
        } else {
            f.load()?;
        }
        Ok(f)
    }

    /// The state of a file just created empty below: nothing to read.
    pub fn new_empty(engine: Arc<Engine>, lower: L) -> ScaFile<L> {
        ScaFile {
            ix: FileIndex::new(engine.chunk_shift),
            lower,
            header_on_disk: false,
            file_id: [0; 16],
            slot_seq: 0,
            slot_dirty: false,
            lost: BTreeSet::new(),
            pending: Vec::new(),
            pending_start: 0,
            prefetched: Vec::new(),
            verified: 0..0,
            modified: false,
            hot: None,
            scratch: Vec::new(),
            seen: None,
            read_locked: false,
            rebuilt_at_load: None,
            needs_write_lock: false,
            changed_outside: false,
            told_no_locks: false,
            // A file with nothing stored yet is padded if the engine pads new files.
            padded: engine.pad,
            real_size: std::sync::atomic::AtomicU64::new(0),
            engine,
        }
    }

    fn header_flags(&self) -> u8 {
        if self.padded {
            HEADER_PADDED
        } else {
            0
        }
    }

    /// The header of this file as it stands, for `chunk_shift`.
    fn header(&self, chunk_shift: u8) -> FileHeader {
        let file_id = (self.file_id != [0; 16]).then_some(self.file_id);
        FileHeader { codec: self.engine.codec.tag(), chunk_shift, file_id, flags: self.header_flags() }
    }

    /// The state of a file this mount just created, empty: on a shared file, as good as seen
    /// under the lock now (an empty file has nothing to catch up with), so that the first
    /// look at its size or content needs no lock.
    pub fn created(engine: Arc<Engine>, lower: L) -> ScaFile<L> {
        let mut f = ScaFile::new_empty(engine, lower);
        if f.engine.shared.is_some() {
            f.seen = Some(Seen { head: Vec::new(), len: 0, at: std::time::Instant::now() });
        }
        f
    }

    /// Stop serving reads from the bytes read at open: the lower file is about to change.
    fn drop_prefetched(&mut self) {
        self.prefetched = Vec::new();
        self.verified = 0..0;
    }

    /// Forget all state about the file's content: as if empty, or about to be loaded.
    fn start_over(&mut self, header_on_disk: bool) {
        self.pending.clear();
        self.lost.clear();
        self.header_on_disk = header_on_disk;
        self.file_id = [0; 16];
        self.slot_seq = 0;
        self.slot_dirty = false;
        self.replace_index(FileIndex::new(self.engine.chunk_shift));
        // Until a header says otherwise: as a new file.
        self.padded = self.engine.pad;
        self.real_size.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// Forget the content of a file that is now empty. On a shared file, record and slot numbers
    /// keep growing, so that no other mount can take the new log for the continuation of the one
    /// it knew.
    fn start_empty(&mut self) {
        let (next_seq, slot_seq) = (self.ix.next_seq, self.slot_seq);
        self.start_over(false);
        if self.engine.shared.is_some() {
            self.ix.next_seq = next_seq;
            self.slot_seq = slot_seq;
        }
    }

    /// Put a new index in place. What was remembered about records of the old one goes: an
    /// emptied file numbers its records from 1 again.
    fn replace_index(&mut self, ix: FileIndex) {
        self.ix = ix;
        self.hot = None;
        self.forget_real_size();
    }

    /// The decoded size, as `stat` shows it.
    pub fn size(&self) -> u64 {
        if !self.padded {
            return self.ix.size;
        }
        let known = self.real_size.load(std::sync::atomic::Ordering::Relaxed);
        if known != NOT_KNOWN {
            return known;
        }
        let n = self.read_trailer();
        self.real_size.store(n, std::sync::atomic::Ordering::Relaxed);
        n
    }

    /// Whether the file's size is padded below.
    pub fn is_padded(&self) -> bool {
        self.padded
    }

    pub fn index(&self) -> &FileIndex {
        &self.ix
    }

    pub fn lower(&self) -> &L {
        &self.lower
    }

    /// Whether this open wrote to the file.
    pub fn modified(&self) -> bool {
        self.modified
    }

    pub fn facts(&self) -> crate::codec::FileFacts {
        crate::codec::FileFacts {
            tag: self.engine.codec.tag(),
            file_id: (self.file_id != [0; 16]).then_some(self.file_id),
            chunk_bytes: self.ix.chunk_bytes(),
            chunks: self.ix.chunks(),
            size: self.size(),
        }
    }

    pub fn stats(&mut self) -> Result<Value> {
        self.locked(LockKind::Shared, |f| f.stats_now())
    }

    fn stats_now(&self) -> Result<Value> {
        let lower = self.lower.len()?;
        let ix = &self.ix;
        Ok(json!({
            "codec": self.engine.kind,
            "chunk_bytes": ix.chunk_bytes(),
            "decoded_size": self.size(),
            "padded_size": self.padded.then_some(ix.size),
            "encoded_size": lower,
            "ratio": if ix.size == 0 { Value::Null } else { json!((lower as f64) / (self.size().max(1) as f64)) },
            "live_bytes": if lower == 0 { 0 } else { ix.live_bytes() },
            "dead_bytes": ix.dead_bytes(),
            "chunks": ix.chunks(),
            "fast_tail_bytes": ix.tail.as_ref().map_or(0, |t| t.bytes.len()),
            "lost_chunks": self.lost.len(),
            "index": ix.checkpoint.map(|c| json!({ "offset": c.off, "bytes": c.bytes, "seq": c.seq })),
            "records_since_checkpoint": ix.since_checkpoint,
        }))
    }
}

/// A fault as the layer interface reports it, naming the file.
fn fault_to_error(lower: &impl LowerIo, f: Fault) -> Error {
    match f {
        Fault::Fail(e) => e,
        Fault::Stale(why) => Error::Corrupt(format!("{}: {why}", lower.describe())),
    }
}
