//! One encoded file: reads, writes, truncation, recovery and compaction over its lower file.
//!
//! Writes never change a record in place. A rewritten chunk is appended to the log as a new
//! record and the old one becomes dead space (the "decoupled order" of Fast Indexing §9), so a
//! write in the middle costs one chunk of work however long the file is. [`ScaFile::compact`]
//! reclaims the dead space; it runs by itself once the dead space outgrows the live data.
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

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;
use plyfs_stack::shared::{LockKind, SharedMode};
use plyfs_stack::{Error, Result};
use serde_json::{json, Value};

use crate::chunkmap::RecordRef;
use crate::codec::{tag_name, Codec, Place};
use crate::format::*;
use crate::index::FileIndex;

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

/// Writes covering at least this much in whole chunks may encode them on several threads...
const PARALLEL_ENCODE_BYTES: u64 = 256 << 10;
/// ...when encoding them all on one would take at least this long. A cipher's chunks encode
/// too fast for it: handing half of them over costs more than it saves.
const PARALLEL_ENCODE_TIME: std::time::Duration = std::time::Duration::from_millis(1);

/// Long-lived threads that encode chunks of large writes beside the thread that got the write,
/// so that what codecs keep per thread (compression contexts, nonce pools) is made once.
struct EncoderPool {
    jobs: Mutex<std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>>,
    threads: usize,
}

impl EncoderPool {
    fn run(&self, job: Box<dyn FnOnce() + Send>) {
        let _ = self.jobs.lock().send(job);
    }
}

/// The pool: one thread fewer than the CPUs this process may run on, at most three; none on a
/// single CPU.
fn encoder_pool() -> Option<&'static EncoderPool> {
    static POOL: std::sync::OnceLock<Option<EncoderPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(4) - 1;
        if threads == 0 {
            return None;
        }
        let (jobs, queue) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..threads {
            let queue = queue.clone();
            let spawned = std::thread::Builder::new().name(format!("sca-encode-{i}")).spawn(move || loop {
                let job = queue.lock().recv();
                let Ok(job) = job else { return };
                // A panicking codec loses its group (the write fails), not the thread.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            });
            if spawned.is_err() {
                return None;
            }
        }
        Some(EncoderPool { jobs: Mutex::new(jobs), threads })
    })
    .as_ref()
}

struct EncodedChunk {
    payload: Vec<u8>,
    raw: bool,
}

/// Chunks encoded ahead of the loop that stores them: `(chunk, encoding)`, in order.
type Encoded = Vec<(u64, EncodedChunk)>;

impl Engine {
    pub fn new(kind: &'static str, codec: Arc<dyn Codec>, chunk_shift: u8, fast_tails: bool) -> Engine {
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

    fn encode(&self, place: &Place, chunk: &[u8]) -> Result<EncodedChunk> {
        let mut payload = Vec::with_capacity(chunk.len() / 2 + 64);
        let raw = self.encode_into(place, chunk, &mut payload)?;
        Ok(EncodedChunk { payload, raw })
    }

    /// Append the encoding of `chunk` (for `place`) to `out`, or the chunk itself when the
    /// codec stores chunks it cannot shrink as they are; returns whether it did the latter
    /// (raw). On failure `out` is left as it was.
    fn encode_into(&self, place: &Place, chunk: &[u8], out: &mut Vec<u8>) -> Result<bool> {
        if self.codec.store_raw_if_larger() && crate::codec::looks_incompressible(chunk) {
            out.extend_from_slice(chunk);
            return Ok(true);
        }
        let start = out.len();
        if let Err(e) = self.codec.encode_at(place, chunk, out) {
            out.truncate(start);
            return Err(Error::Corrupt(format!("{}: encoding failed: {e}", self.kind)));
        }
        if self.codec.store_raw_if_larger() && out.len() - start >= chunk.len() {
            out.truncate(start);
            out.extend_from_slice(chunk);
            return Ok(true);
        }
        Ok(false)
    }

    /// A zero chunk encoded once, for runs of holes, for a deterministic codec whose output
    /// does not depend on its place.
    fn zero_chunk(&self, chunk_shift: u8) -> Result<Arc<EncodedChunk>> {
        if let Some(z) = self.zero_chunks.lock().get(&chunk_shift) {
            return Ok(z.clone());
        }
        let anywhere = Place { file_id: [0; 16], chunk: 0, count: 1 };
        let z = Arc::new(self.encode(&anywhere, &vec![0; 1 << chunk_shift])?);
        self.zero_chunks.lock().insert(chunk_shift, z.clone());
        Ok(z)
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

/// Compaction runs once dead space exceeds both the live bytes and this much, so that small
/// files do not pay its fsyncs for every few appends.
pub const COMPACT_SLACK_BYTES: u64 = 64 << 10;
/// A checkpoint is written at close once this many records followed the last one.
const CHECKPOINT_EVERY_RECORDS: u64 = 32;
/// Largest lower read or write the file issues at once.
const IO_WINDOW_BYTES: u64 = 4 << 20;
/// Opening reads this much from the start of the lower file in one request: for most files,
/// header, slots and every record.
const OPEN_READ_BYTES: usize = 64 << 10;
/// The buffer of records to write is kept between operations up to this size.
const KEEP_BUFFER_BYTES: usize = 256 << 10;

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
/// A padded file's first write, from its start, up to this far is padded at once.
const EAGER_PAD_BYTES: u64 = 1 << 20;

/// What a shared file looked like the last time this mount checked it under its lock: any
/// change by another mount changes the slot in force (its sequence number only grows) or the
/// length.
#[derive(Clone, PartialEq, Eq)]
struct Seen {
    head: Vec<u8>,
    len: u64,
    at: std::time::Instant,
}

impl Seen {
    /// This mount wrote `data` at `off` (under the write lock): the start of the file follows.
    fn wrote(&mut self, off: u64, data: &[u8]) {
        let end = (off + data.len() as u64).min(DATA_START) as usize;
        if self.head.len() < end {
            // The file grew: whatever lay between its old end and the write reads as zeros.
            self.head.resize(end, 0);
        }
        if off < DATA_START {
            let off = off as usize;
            self.head[off..end].copy_from_slice(&data[..end - off]);
        }
    }

    /// This mount set the file's length to `len`.
    fn resized(&mut self, len: u64) {
        self.head.resize(len.min(DATA_START) as usize, 0);
    }
}

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

    fn load(&mut self) -> Result<()> {
        let first = self.lower.read_at(0, OPEN_READ_BYTES)?;
        let len = if first.len() < OPEN_READ_BYTES { first.len() as u64 } else { self.lower.len()? };
        self.prefetched = first;
        self.verified = 0..0;
        let result = self.load_with(len);
        if result.is_err() {
            self.drop_prefetched();
        }
        result
    }

    /// Forget the state and load the lower file again, as an open would (it changed from
    /// outside the mount).
    pub fn reload(&mut self) -> Result<()> {
        self.drop_prefetched();
        self.load()
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

    fn forget_real_size(&self) {
        let v = if self.padded && self.ix.size > 0 { NOT_KNOWN } else { 0 };
        self.real_size.store(v, std::sync::atomic::Ordering::Relaxed);
    }

    // Sharing the file with other mounts.

    /// Run `op` on a file other mounts share: under the lower file's lock of `kind`, after
    /// catching up with what they wrote, and with everything `op` changed (slot included)
    /// written before the lock is dropped. A repair found needed under a read lock runs the
    /// whole again under the write lock. Without sharing, just `op`.
    fn locked<T>(&mut self, kind: LockKind, mut op: impl FnMut(&mut Self) -> Result<T>) -> Result<T> {
        if self.engine.shared.is_none() {
            return op(self);
        }
        let kind = if kind == LockKind::Shared || self.lower.writable() { kind } else { LockKind::Shared };
        match self.locked_once(kind, &mut op) {
            Err(_) if std::mem::take(&mut self.needs_write_lock) && self.lower.writable() => {
                self.locked_once(LockKind::Exclusive, &mut op)
            }
            other => other,
        }
    }

    fn locked_once<T>(&mut self, kind: LockKind, op: &mut impl FnMut(&mut Self) -> Result<T>) -> Result<T> {
        if let Err(e) = self.lower.lock(kind) {
            return Err(self.lock_failed(e));
        }
        self.read_locked = kind == LockKind::Shared;
        self.needs_write_lock = false;
        let result = self.catch_up().and_then(|()| op(self));
        let result = match result {
            Ok(v) if kind == LockKind::Exclusive => self.publish().map(|()| v),
            other => other,
        };
        self.read_locked = false;
        if result.is_err() {
            // Whatever the failure left in memory is not to be trusted at the next operation.
            self.seen = None;
        }
        let unlocked = self.lower.unlock(kind);
        let value = result?;
        unlocked.map(|()| value)
    }

    /// The lower file could not be locked. Where locks are not to be had there, the caller gets
    /// `ENOLCK`, as from a file system without them, and the log one line (once per file).
    fn lock_failed(&mut self, e: Error) -> Error {
        if !matches!(e, Error::UnsupportedOp { .. } | Error::Os(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS)) {
            return e;
        }
        if !std::mem::replace(&mut self.told_no_locks, true) {
            tracing::error!(
                "{}: the lower file cannot be locked ({e}), so it cannot be shared with other mounts (-o shared): its reads and changes fail with ENOLCK",
                self.lower.describe()
            );
        }
        Error::Os(libc::ENOLCK)
    }

    /// The lower file's start and length as they are now.
    fn observe(&self) -> Result<Seen> {
        let head = self.lower.read_at(0, DATA_START as usize)?;
        let len = self.lower.len()?;
        Ok(Seen { head, len, at: std::time::Instant::now() })
    }

    /// Under the lock: bring the state up to what the lower file holds now. Records other
    /// mounts appended are applied to the index; anything else (a new checkpoint, compaction,
    /// truncation, a file replaced) loads the file afresh.
    fn catch_up(&mut self) -> Result<()> {
        let now = self.observe()?;
        if let Some(seen) = &self.seen {
            if seen.head == now.head && seen.len == now.len {
                self.seen = Some(now);
                return Ok(());
            }
        }
        let first_look = self.seen.is_none() && !self.modified && !self.header_on_disk;
        self.changed_outside |= !first_look;
        self.drop_prefetched();
        self.hot = None;
        let before = (self.ix.log_end, self.ix.size, self.slot_seq);
        let by_appends = if now.len == 0 {
            // Empty (a new file, or emptied): nothing to read.
            self.start_empty();
            true
        } else {
            self.catch_up_by_appends(&now)?
        };
        if !by_appends {
            self.load()?;
        }
        tracing::debug!(
            "{}: caught up ({}): slot {:?}, length {}; was log end {} size {} slot {}; now log end {} size {}",
            self.lower.describe(),
            if by_appends { "appended records" } else { "reloaded" },
            Slot::newest_in(&now.head).map(|s| (s.slot_seq, s.log_end, s.file_size)),
            now.len,
            before.0,
            before.1,
            before.2,
            self.ix.log_end,
            self.ix.size
        );
        self.forget_real_size();
        // Loading may have cut an interrupted append: look again.
        self.seen = Some(self.observe()?);
        Ok(())
    }

    /// Apply the records appended since this state was current, if that is all that happened.
    fn catch_up_by_appends(&mut self, now: &Seen) -> Result<bool> {
        if self.seen.is_none() || !self.header_on_disk || !self.pending.is_empty() || !self.lost.is_empty() {
            return Ok(false);
        }
        let Some(header) = FileHeader::decode(&now.head) else { return Ok(false) };
        let slot = Slot::newest_in(&now.head);
        let same_file = header.codec == self.engine.codec.tag()
            && header.chunk_shift == self.ix.chunk_shift
            && header.file_id.unwrap_or_default() == self.file_id;
        if !same_file || now.len < self.ix.log_end || slot.is_none_or(|s| s.slot_seq < self.slot_seq || s.log_end < self.ix.log_end) {
            return Ok(false);
        }
        let mut ix = std::mem::replace(&mut self.ix, FileIndex::new(header.chunk_shift));
        let from = ix.log_end;
        let mut broken = false;
        let end = self.scan(from, now.len, false, |off, h, payload, _| {
            // Only plain appends continue the log: the next number, no new checkpoint (which
            // may come with records moved).
            if broken || h.seq != ix.next_seq || h.kind == Kind::Index || h.chunk_shift != ix.chunk_shift {
                broken = true;
            } else if ix.apply(off, h, payload).is_err() {
                broken = true;
            }
        });
        let end = match end {
            Ok(end) => end,
            Err(e) => {
                self.ix = ix;
                return Err(fault_to_error(e));
            }
        };
        let slot = slot.expect("checked above");
        let consistent = !broken && slot.covered_seq < ix.next_seq && ix.log_end >= slot.log_end;
        self.ix = ix;
        if !consistent {
            return Ok(false);
        }
        if end < now.len && self.may_write() {
            // An append interrupted by a mount that died: the next writer would overwrite it.
            self.set_lower_len(end)?;
        }
        self.slot_seq = slot.slot_seq;
        Ok(true)
    }

    /// After a change under the write lock: everything written, the slot too, so that the
    /// next mount to take the lock sees it.
    fn publish(&mut self) -> Result<()> {
        self.flush_pending()?;
        if self.slot_dirty {
            self.write_slot()?;
        }
        // The start and length are what this mount left, not asked of the lower file: on a
        // network file system that would wait for the writes still in the client's cache. The
        // start is the one seen under the lock with this mount's writes since applied.
        let head = match self.seen.take() {
            Some(seen) => seen.head,
            None => self.lower.read_at(0, DATA_START as usize)?,
        };
        #[cfg(debug_assertions)]
        debug_assert_eq!(head, self.lower.read_at(0, DATA_START as usize)?, "{}: the start of the file as tracked", self.lower.describe());
        let len = if self.header_on_disk { self.ix.log_end } else { 0 };
        self.seen = Some(Seen { head, len, at: std::time::Instant::now() });
        Ok(())
    }

    /// Write to the lower file, keeping the start of it last seen in step.
    fn write_lower(&mut self, off: u64, data: &[u8]) -> Result<()> {
        self.lower.write_at(off, data)?;
        if let Some(seen) = &mut self.seen {
            seen.wrote(off, data);
        }
        Ok(())
    }

    /// Set the lower file's length, keeping the start of it last seen in step.
    fn set_lower_len(&mut self, len: u64) -> Result<()> {
        self.lower.set_len(len)?;
        if let Some(seen) = &mut self.seen {
            seen.resized(len);
        }
        Ok(())
    }

    /// Whether repairs and cut logs may be written now.
    fn may_write(&self) -> bool {
        self.lower.writable() && !self.read_locked
    }

    /// Whether the state in memory may serve a read without checking the lower file: not
    /// shared, or checked within the mount's revalidation time.
    pub fn is_fresh(&self) -> bool {
        match (&self.engine.shared, &self.seen) {
            (None, _) => true,
            (Some(mode), Some(seen)) => seen.at.elapsed() < mode.revalidate,
            (Some(_), None) => false,
        }
    }

    /// Check the state against the lower file under its read lock (a shared file at open).
    pub fn revalidate(&mut self) -> Result<()> {
        self.locked(LockKind::Shared, |_| Ok(()))
    }

    /// A read that checks the state against the lower file first when it is shared.
    pub fn read_current(&mut self, offset: u64, size: usize) -> Result<Vec<u8>> {
        self.locked(LockKind::Shared, |f| f.with_rebuild(|f| f.read(offset, size)))
    }

    /// The decoded size, checked against the lower file when it was not lately.
    pub fn current_size(&mut self) -> Result<u64> {
        if !self.is_fresh() {
            self.revalidate()?;
        }
        Ok(self.ix.size)
    }

    /// Where `SEEK_DATA` (`data`) or `SEEK_HOLE` from `offset` lands: the first offset at or
    /// after it in data, or in a hole; `None` when no data follows. Holes are the chunks written
    /// as a run of zeros; a fast tail is data, and so is a lost chunk (a copy must fail on it,
    /// not skip it). The end of the file is a hole.
    pub fn seek_data_or_hole(&mut self, offset: u64, data: bool) -> Result<Option<u64>> {
        let size = self.current_size()?;
        if offset >= size {
            return Ok(None);
        }
        let (shift, chunks) = (self.ix.chunk_shift, self.ix.chunks());
        let mut chunk = offset >> shift;
        while chunk < chunks {
            let hole_end = self.hole_end(chunk);
            if hole_end.is_some() != data {
                return Ok(Some((chunk << shift).max(offset)));
            }
            chunk = hole_end.unwrap_or(chunk + 1);
        }
        Ok(if data { None } else { Some(size) })
    }

    /// One past the last chunk of the hole that starts at `chunk`, if one does: a run of zero
    /// chunks, up to the fast tail or a lost chunk within it.
    fn hole_end(&self, chunk: u64) -> Option<u64> {
        let tail = self.ix.tail.as_ref().map(|t| t.chunk);
        let run_end = self.ix.map.run_end(chunk).filter(|_| tail != Some(chunk) && !self.lost.contains(&chunk))?;
        let lost = self.lost.range(chunk..run_end).next().copied();
        let tail = tail.filter(|&t| t > chunk && t < run_end);
        Some([lost, tail].into_iter().flatten().fold(run_end, u64::min))
    }

    /// Whether another mount changed the file since the last call: the kernel's pages of it
    /// are then stale.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed_outside)
    }

    fn load_with(&mut self, len: u64) -> Result<()> {
        self.start_over(len > 0);
        if len == 0 {
            return Ok(());
        }
        let head = self.read_cached(0, DATA_START as usize)?;
        let Some(header) = FileHeader::decode(&head) else {
            return self.rebuild_without_header(len);
        };
        if header.codec != self.engine.codec.tag() {
            return Err(Error::Corrupt(format!(
                "{}: encoded by '{}', not by this '{}' layer",
                self.lower.describe(),
                tag_name(header.codec),
                self.engine.kind
            )));
        }
        if header.flags & !KNOWN_HEADER_FLAGS != 0 {
            return Err(Error::Corrupt(format!(
                "{}: its header has flags {:#04x} this plyfs does not know (written by a newer one?)",
                self.lower.describe(),
                header.flags
            )));
        }
        self.padded = header.flags & HEADER_PADDED != 0;
        self.replace_index(FileIndex::new(header.chunk_shift));
        self.file_id = header.file_id.unwrap_or_default();
        let slot = Slot::newest_in(&head);
        self.slot_seq = slot.map_or(0, |s| s.slot_seq);
        if slot.is_none() && len > DATA_START {
            tracing::warn!("{}: the index is missing; rebuilding it from the data", self.lower.describe());
            return self.rebuild(header.chunk_shift, None);
        }
        match self.load_from_checkpoint(slot, len) {
            Ok(()) => Ok(()),
            Err(Fault::Stale(why)) => {
                tracing::warn!("{}: the index is inconsistent ({why}); rebuilding it from the data", self.lower.describe());
                self.rebuild(header.chunk_shift, None)
            }
            Err(Fault::Fail(e)) => Err(e),
        }
    }

    /// The normal path: the checkpoint the slot names, then the records written after it.
    fn load_from_checkpoint(&mut self, slot: Option<Slot>, len: u64) -> std::result::Result<(), Fault> {
        let shift = self.ix.chunk_shift;
        let mut ix = match slot.filter(|s| s.checkpoint_off != 0) {
            None => FileIndex::new(shift),
            Some(s) => {
                let (h, payload) = self
                    .read_record(s.checkpoint_off, len)?
                    .ok_or_else(|| Fault::Stale(format!("no valid checkpoint at {}", s.checkpoint_off)))?;
                if h.kind != Kind::Index || h.seq != s.checkpoint_seq || h.chunk_shift != shift {
                    return Err(Fault::Stale(format!("the record at {} is not the checkpoint the header names", s.checkpoint_off)));
                }
                FileIndex::from_checkpoint(shift, s.checkpoint_off, &h, &payload).map_err(Fault::Stale)?
            }
        };
        let after = ix.checkpoint.map_or(0, |c| c.seq);
        let mut failure = None;
        let scan_from = ix.log_end;
        let end = self.scan(scan_from, len, false, |off, h, payload, ok| {
            if failure.is_some() || h.seq <= after || h.chunk_shift != shift {
                return; // copies left behind by compaction, already covered by the checkpoint
            }
            if !ok {
                failure = Some(format!("the record at {off} has a bad checksum"));
            } else if let Err(e) = ix.apply(off, h, payload) {
                failure = Some(e);
            }
        })?;
        if let Some(why) = failure {
            return Err(Fault::Stale(why));
        }
        if let Some(s) = slot.filter(|s| s.covered_seq >= ix.next_seq) {
            // The slot was written after records that are gone: the log was cut short.
            return Err(Fault::Stale(format!("the log ends before record {}, which the header says was written", s.covered_seq)));
        }
        self.verified = scan_from..end.min(self.prefetched.len() as u64);
        if end < len {
            // Something after the last whole record: an interrupted append is harmless, but
            // whole records further on mean damage in the middle of the log.
            let mut later = false;
            self.scan(end, len, true, |_, h, _, _| later |= h.seq > after)?;
            if later {
                return Err(Fault::Stale(format!("unreadable bytes at {end} before later records")));
            }
            if self.may_write() {
                tracing::warn!(
                    "{}: dropping {} bytes after the last whole record (an interrupted write)",
                    self.lower.describe(),
                    len - end
                );
                self.drop_prefetched();
                self.set_lower_len(end)?;
            }
        }
        ix.log_end = ix.log_end.max(end);
        ix.validate(ix.log_end).map_err(Fault::Stale)?;
        self.replace_index(ix);
        Ok(())
    }

    /// The file header is unreadable: rebuild from the records if there are any, else this is
    /// not an encoded file.
    fn rebuild_without_header(&mut self, len: u64) -> Result<()> {
        let mut shift = None;
        self.scan(DATA_START, len, true, |_, h, _, _| {
            shift.get_or_insert(h.chunk_shift);
        })
        .map_err(fault_to_error)?;
        match shift {
            Some(shift) => {
                tracing::warn!("{}: the file header is damaged; rebuilding it and the index from the data", self.lower.describe());
                // Whether the file was padded went with the header: its trailer tells.
                self.padded = false;
                self.rebuild(shift, None)?;
                let n = self.ix.size;
                if n >= PAD_TRAILER_BYTES {
                    let trailer = self.read_stored(n - PAD_TRAILER_BYTES, PAD_TRAILER_BYTES as usize);
                    if trailer.is_ok_and(|t| parse_trailer(&t, n).is_ok()) {
                        self.padded = true;
                        self.forget_real_size();
                        if self.lower.writable() {
                            self.write_lower(0, &self.header(shift).encode())?;
                        }
                    }
                }
                Ok(())
            }
            None => Err(Error::Corrupt(format!(
                "{}: not a '{}' file (no plyfs header); convert existing files with `plyfs encode`",
                self.lower.describe(),
                self.engine.kind
            ))),
        }
    }

    /// Rebuild the index from the records alone (Fast Indexing §5), replaying every valid
    /// record in sequence order. Chunks whose newest record is gone, judged against `known`
    /// (the index in memory) or else the newest checkpoint found, become lost: EIO, not stale
    /// data.
    fn rebuild(&mut self, shift: u8, known: Option<&FileIndex>) -> Result<()> {
        if self.read_locked {
            // Other mounts may be reading too: the repair waits for the write lock.
            self.needs_write_lock = true;
            return Err(Error::Os(libc::EAGAIN));
        }
        // From the file as it is now: the bytes read at open may be of a file since replaced.
        self.drop_prefetched();
        let len = self.lower.len()?;
        let mut found: Vec<(RecordHeader, u64, Vec<u8>, bool)> = Vec::new();
        self.scan(DATA_START, len, true, |off, h, payload, ok| {
            if h.chunk_shift == shift {
                let keep = matches!(h.kind, Kind::Tail | Kind::Index);
                found.push((*h, off, if keep { payload.to_vec() } else { Vec::new() }, ok));
            }
        })
        .map_err(fault_to_error)?;
        let sound = found.iter().any(|(_, _, _, ok)| *ok);
        if !sound && self.lower.read_at(0, DATA_START as usize).ok().and_then(|h| FileHeader::decode(&h)).is_none() {
            // Neither a header nor a sound record: the file is no longer an encoded file
            // (rewritten in place from outside the mount, say). Nothing to rebuild, and its
            // bytes are not ours to overwrite.
            return Err(Error::Corrupt(format!(
                "{}: not a '{}' file any more (no plyfs header, no records): it was rewritten from outside the mount",
                self.lower.describe(),
                self.engine.kind
            )));
        }
        // Compaction may leave copies of a record: keep one, a sound one if there is one.
        found.sort_by_key(|(h, off, _, ok)| (h.seq, !*ok, *off));
        found.dedup_by_key(|(h, _, _, _)| h.seq);

        let newest_checkpoint = found
            .iter()
            .rev()
            .filter(|(h, _, _, ok)| h.kind == Kind::Index && *ok)
            .find_map(|(h, off, payload, _)| FileIndex::from_checkpoint(shift, *off, h, payload).ok());
        let bound = known.cloned().or(newest_checkpoint);
        // The slot in force, if readable, says how far the log went and how large the file was.
        let slot = self.lower.read_at(0, DATA_START as usize).ok().and_then(|head| Slot::newest_in(&head));

        let mut ix = FileIndex::new(shift);
        let mut lost = BTreeSet::new();
        for (h, off, payload, ok) in &found {
            if h.kind == Kind::Index {
                ix.log_end = ix.log_end.max(off + h.bytes());
                ix.next_seq = ix.next_seq.max(h.seq + 1);
                continue;
            }
            let zeros;
            let payload = if *ok || h.kind != Kind::Tail {
                payload.as_slice()
            } else {
                lost.insert(h.chunk);
                zeros = vec![0; h.payload_len as usize];
                zeros.as_slice()
            };
            if let Err(e) = ix.apply(*off, h, payload) {
                tracing::warn!("{}: skipping record at {off}: {e}", self.lower.describe());
            }
        }
        ix.checkpoint = None;
        let cut = slot.filter(|s| s.covered_seq >= ix.next_seq && s.file_size > ix.size);
        if let Some(s) = cut {
            // Records the slot vouches for are gone (the file was cut): the end of the file is
            // lost, not silently shorter.
            tracing::warn!(
                "{}: the log ends before record {}: the file was {} bytes, its records reach {}",
                self.lower.describe(),
                s.covered_seq,
                s.file_size,
                ix.size
            );
            let old_chunks = ix.chunks();
            ix.extend_without_data(s.file_size);
            // A chunk the records leave shorter than the vouched size needs was completed by a
            // record that is gone.
            for chunk in old_chunks.saturating_sub(1)..ix.chunks() {
                let have = match ix.tail.as_ref().filter(|t| t.chunk == chunk) {
                    Some(t) => t.len(),
                    None => ix.map.get(chunk).map_or(0, |r| u64::from(r.decoded_len)),
                };
                if have < ix.chunk_len(chunk) {
                    lost.insert(chunk);
                }
            }
        }
        if let Some(bound) = &bound {
            for chunk in 0..ix.chunks().min(bound.chunks()) {
                if newest_seq(&ix, chunk) < newest_seq(bound, chunk) {
                    lost.insert(chunk);
                }
            }
        }
        for chunk in 0..ix.chunks() {
            let has_data = ix.map.get(chunk).is_some() || ix.tail.as_ref().is_some_and(|t| t.chunk == chunk);
            if !has_data {
                lost.insert(chunk);
            }
        }
        lost.retain(|c| *c < ix.chunks());
        if !lost.is_empty() {
            tracing::error!(
                "{}: the newest data of {} chunk(s) is missing or damaged (first at offset {}); they read as I/O errors until rewritten",
                self.lower.describe(),
                lost.len(),
                lost.first().map_or(0, |c| c << shift)
            );
        }
        self.replace_index(ix);
        self.lost = lost;
        self.header_on_disk = true;
        if self.lower.writable() {
            self.drop_prefetched();
            if self.ix.log_end < len {
                self.set_lower_len(self.ix.log_end)?;
            }
            self.write_lower(0, &self.header(shift).encode())?;
            // A cut log keeps the slot that vouches for what is gone, so that every open finds
            // the damage again (until the lost chunks are rewritten, which records the size).
            if cut.is_none() {
                self.write_checkpoint()?;
                // Both slots, so that no older slot can name an older checkpoint.
                self.write_slot()?;
            }
            self.lower.sync()?;
        }
        tracing::warn!(
            "{}: index rebuilt from {} records: {} bytes in {} chunks",
            self.lower.describe(),
            found.len(),
            self.ix.size,
            self.ix.chunks()
        );
        Ok(())
    }

    /// Walk the records from `start`: each valid header with its payload and whether the
    /// payload checks out. Without `resync` the walk stops at the first unreadable record;
    /// with it, it searches on for the next one. Returns where the last valid record ends.
    fn scan(
        &self,
        start: u64,
        len: u64,
        resync: bool,
        mut visit: impl FnMut(u64, &RecordHeader, &[u8], bool),
    ) -> std::result::Result<u64, Fault> {
        let mut window = Window { start: 0, bytes: self.prefetched.as_slice().into() };
        let mut pos = start;
        let mut valid_end = start;
        while pos + RECORD_HEADER_BYTES <= len {
            let header = window.get(&self.lower, pos, RECORD_HEADER_BYTES, len)?.and_then(RecordHeader::decode);
            let whole = header.filter(|h| pos + h.bytes() <= len);
            match whole {
                Some(h) => {
                    let payload_at = pos + RECORD_HEADER_BYTES;
                    let payload = window.get(&self.lower, payload_at, h.payload_len.into(), len)?.unwrap_or(&[]);
                    let ok = payload_ok(&h, payload);
                    if !ok && !resync {
                        break;
                    }
                    visit(pos, &h, payload, ok);
                    pos += h.bytes();
                    valid_end = pos;
                }
                None if resync => pos += RECORD_ALIGN,
                None => break,
            }
        }
        Ok(valid_end)
    }

    /// One record at `off`: its header and payload if both are valid.
    fn read_record(&self, off: u64, len: u64) -> std::result::Result<Option<(RecordHeader, Vec<u8>)>, Fault> {
        let head = self.read_cached(off, RECORD_HEADER_BYTES as usize)?;
        let Some(h) = RecordHeader::decode(&head).filter(|h| off + h.bytes() <= len) else {
            return Ok(None);
        };
        let payload = self.read_cached(off + RECORD_HEADER_BYTES, h.payload_len as usize)?;
        Ok(payload_ok(&h, &payload).then_some((h, payload)))
    }

    /// Bytes of the lower file, from what was read at open when it covers them.
    fn read_cached(&self, off: u64, len: usize) -> Result<Vec<u8>> {
        self.log_bytes(off, len).map(Cow::into_owned)
    }

    fn log_bytes(&self, off: u64, len: usize) -> Result<Cow<'_, [u8]>> {
        match self.prefetched.get(off as usize..off as usize + len) {
            Some(bytes) => Ok(Cow::Borrowed(bytes)),
            None => self.lower.read_at(off, len).map(Cow::Owned),
        }
    }

    // Reading.

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

    /// The real size of a padded file, from the last bytes stored. A trailer that does not
    /// read as one (a crash in the middle of a size change) leaves all that is stored visible,
    /// padding included: nothing is hidden that may be the owner's.
    fn read_trailer(&self) -> u64 {
        let stored = self.ix.size;
        if stored == 0 {
            return 0;
        }
        let bad = |why: &str| {
            tracing::error!("{}: the size of this padded file cannot be read ({why}); showing all {stored} bytes stored", self.lower.describe());
            stored
        };
        if stored < PAD_TRAILER_BYTES {
            return bad("shorter than its trailer");
        }
        match self.read_stored(stored - PAD_TRAILER_BYTES, PAD_TRAILER_BYTES as usize) {
            Ok(t) => parse_trailer(&t, stored).unwrap_or_else(bad),
            Err(Fault::Fail(e)) => bad(&e.to_string()),
            Err(Fault::Stale(why)) => bad(&why),
        }
    }

    fn trailer(size: u64) -> [u8; PAD_TRAILER_BYTES as usize] {
        let mut t = [0u8; PAD_TRAILER_BYTES as usize];
        t[..8].copy_from_slice(&size.to_le_bytes());
        t[8..].copy_from_slice(&PAD_MAGIC);
        t
    }

    fn set_real_size(&self, n: u64) {
        self.real_size.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn index(&self) -> &FileIndex {
        &self.ix
    }

    pub fn lower(&self) -> &L {
        &self.lower
    }

    /// Decoded bytes `off..off + len`, clipped to the file size.
    pub fn read(&self, off: u64, len: usize) -> std::result::Result<Vec<u8>, Fault> {
        let len = if self.padded { (self.size().saturating_sub(off)).min(len as u64) as usize } else { len };
        self.read_stored(off, len)
    }

    /// Stored bytes `off..off + len` (a padded file's padding and trailer included).
    fn read_stored(&self, off: u64, len: usize) -> std::result::Result<Vec<u8>, Fault> {
        let end = (off + len as u64).min(self.ix.size);
        if off >= end {
            return Ok(Vec::new());
        }
        let shift = self.ix.chunk_shift;
        let cs = self.ix.chunk_bytes();
        let mut out = Vec::with_capacity((end - off) as usize);
        let mut chunk = off >> shift;
        let last = (end - 1) >> shift;
        let range_in = |c: u64| {
            let start = c << shift;
            ((off.max(start) - start) as usize, (end.min(start + cs) - start) as usize)
        };
        while chunk <= last {
            self.check_not_lost(chunk)?;
            if self.ix.tail.as_ref().is_some_and(|t| t.chunk == chunk) {
                let content = self.tail_content()?;
                let (s, e) = range_in(chunk);
                copy_padded(&mut out, &content, s, e);
                chunk += 1;
                continue;
            }
            // Chunks whose records sit back to back in the log are read with one request.
            let first = self.record_of(chunk)?;
            let mut span = vec![(chunk, first)];
            let (span_start, mut span_end) = (first.off, first.off + first.bytes());
            while chunk + (span.len() as u64) <= last {
                let next = chunk + span.len() as u64;
                if self.lost.contains(&next) || self.ix.tail.as_ref().is_some_and(|t| t.chunk == next) {
                    break;
                }
                let rec = self.record_of(next)?;
                let same_run = rec.off == span.last().expect("not empty").1.off;
                if !same_run && (rec.off != span_end || span_end - span_start >= IO_WINDOW_BYTES) {
                    break;
                }
                span_end = span_end.max(rec.off + rec.bytes());
                span.push((next, rec));
            }
            let bytes = self.log_bytes(span_start, (span_end - span_start) as usize)?;
            let mut run_cache: Option<(u64, Vec<u8>)> = None;
            for (c, rec) in &span {
                let at = (rec.off - span_start) as usize;
                let (s, e) = range_in(*c);
                if rec.kind == Kind::Run {
                    if run_cache.as_ref().is_none_or(|(o, _)| *o != rec.off) {
                        let payload = self.check_record(*c, rec, bytes.get(at..).unwrap_or(&[]))?;
                        let mut decoded = Vec::with_capacity(cs as usize);
                        self.decode_into(*c, rec, payload, &mut decoded)?;
                        run_cache = Some((rec.off, decoded));
                    }
                    copy_padded(&mut out, &run_cache.as_ref().expect("filled").1, s, e);
                    continue;
                }
                let payload = self.check_record(*c, rec, bytes.get(at..).unwrap_or(&[]))?;
                if s == 0 && e == rec.decoded_len as usize {
                    self.decode_into(*c, rec, payload, &mut out)?;
                } else {
                    let mut decoded = Vec::with_capacity(rec.decoded_len as usize);
                    self.decode_into(*c, rec, payload, &mut decoded)?;
                    copy_padded(&mut out, &decoded, s, e);
                }
            }
            chunk += span.len() as u64;
        }
        Ok(out)
    }

    fn check_not_lost(&self, chunk: u64) -> std::result::Result<(), Fault> {
        if self.lost.contains(&chunk) {
            return Err(Fault::Fail(Error::Corrupt(format!(
                "{}: data at offset {} is lost (its newest record is missing or damaged)",
                self.lower.describe(),
                chunk << self.ix.chunk_shift
            ))));
        }
        Ok(())
    }

    fn record_of(&self, chunk: u64) -> std::result::Result<RecordRef, Fault> {
        self.ix.map.get(chunk).ok_or_else(|| Fault::Stale(format!("chunk {chunk} has no record")))
    }

    /// Check that `bytes` (starting at the record) hold the record the index expects for
    /// `chunk`, and return its payload.
    fn check_record<'b>(&self, chunk: u64, rec: &RecordRef, bytes: &'b [u8]) -> std::result::Result<(&'b [u8], Place), Fault> {
        let stale = || Fault::Stale(format!("the record at {} is not chunk {chunk}'s", rec.off));
        let h = RecordHeader::decode(bytes).ok_or_else(stale)?;
        let count = if h.kind == Kind::Run { u64::from(h.count) } else { 1 };
        if h.kind != rec.kind
            || h.seq != rec.seq
            || h.payload_len != rec.payload_len
            || h.decoded_len != rec.decoded_len
            || !(h.chunk..h.chunk + count).contains(&chunk)
        {
            return Err(stale());
        }
        let payload = bytes.get(RECORD_HEADER_BYTES as usize..(RECORD_HEADER_BYTES + u64::from(h.payload_len)) as usize);
        // Bytes still as they were checked while loading need no second check.
        let checked = self.verified.start <= rec.off && rec.off + rec.bytes() <= self.verified.end;
        let place = Place { file_id: self.file_id, chunk: h.chunk, count };
        match payload {
            Some(p) if checked || payload_ok(&h, p) => Ok((p, place)),
            _ => Err(Fault::Fail(self.corrupt(chunk, rec.off, "checksum mismatch"))),
        }
    }

    fn decode_into(&self, chunk: u64, rec: &RecordRef, (payload, place): (&[u8], Place), out: &mut Vec<u8>) -> std::result::Result<(), Fault> {
        let before = out.len();
        if rec.raw && !self.engine.codec.store_raw_if_larger() {
            // This codec never stores a chunk as it is (a cipher): the flag was forged.
            return Err(Fault::Fail(self.corrupt(chunk, rec.off, "a record marked unencoded, which this codec never writes")));
        }
        if rec.raw {
            out.extend_from_slice(payload);
        } else if let Err(e) = self.engine.codec.decode_at(&place, payload, rec.decoded_len as usize, out) {
            out.truncate(before);
            return Err(Fault::Fail(self.corrupt(chunk, rec.off, &e)));
        }
        if out.len() - before != rec.decoded_len as usize {
            let got = out.len() - before;
            out.truncate(before);
            return Err(Fault::Fail(self.corrupt(chunk, rec.off, &format!("decoded to {got} bytes, not {}", rec.decoded_len))));
        }
        Ok(())
    }

    /// The error for a damaged chunk: the file, the upper offset, the lower offset, the cause.
    /// Whoever reports the error logs it (the FUSE front end logs every one it turns into EIO).
    fn corrupt(&self, chunk: u64, lower_off: u64, why: &str) -> Error {
        Error::Corrupt(format!(
            "{}: corrupt data at offset {} (record at lower offset {lower_off}): {why}",
            self.lower.describe(),
            chunk << self.ix.chunk_shift
        ))
    }

    fn tail_content(&self) -> std::result::Result<Vec<u8>, Fault> {
        let t = self.ix.tail.as_ref().expect("caller checked");
        if !self.engine.codec.plaintext_safe() {
            // A codec that may not leave plaintext below never writes a fast tail: it was forged.
            let at = t.fragments.last().map_or(0, |f| f.off);
            return Err(Fault::Fail(self.corrupt(t.chunk, at, "an unencoded fast tail, which this codec never writes")));
        }
        let mut content = Vec::with_capacity(t.len() as usize);
        if let Some(base) = &t.base {
            let bytes = self.lower.read_at(base.off, base.bytes() as usize)?;
            let payload = self.check_record(t.chunk, base, &bytes)?;
            self.decode_into(t.chunk, base, payload, &mut content)?;
            content.truncate(t.keep as usize);
        }
        content.extend_from_slice(&t.bytes);
        Ok(content)
    }

    /// The decoded content of one chunk (empty past the end of the file).
    fn chunk_content(&mut self, chunk: u64) -> std::result::Result<Vec<u8>, Fault> {
        let mut content = Vec::new();
        self.chunk_content_into(chunk, &mut content)?;
        Ok(content)
    }

    /// [`Self::chunk_content`] into `out`, which is cleared first.
    fn chunk_content_into(&mut self, chunk: u64, out: &mut Vec<u8>) -> std::result::Result<(), Fault> {
        out.clear();
        let start = chunk << self.ix.chunk_shift;
        let len = self.ix.chunk_len(chunk) as usize;
        if len == 0 {
            return Ok(());
        }
        let current_seq = self.ix.map.get(chunk).map(|r| r.seq);
        match &self.hot {
            Some((c, seq, content)) if *c == chunk && Some(*seq) == current_seq => {
                out.extend_from_slice(&content[..len.min(content.len())]);
                out.resize(len, 0);
            }
            _ => *out = self.read_stored(start, len)?,
        }
        Ok(())
    }

    // Writing.

    /// Run `op`, rebuilding the index once if it turns out stale.
    fn with_rebuild<T>(&mut self, mut op: impl FnMut(&mut Self) -> std::result::Result<T, Fault>) -> Result<T> {
        match op(self) {
            Ok(v) => Ok(v),
            Err(Fault::Fail(e)) => Err(e),
            Err(Fault::Stale(why)) => {
                // Records already appended by the failed attempt are valid: keep them.
                self.flush_pending()?;
                tracing::warn!("{}: the index is inconsistent ({why}); rebuilding it from the data", self.lower.describe());
                let known = self.ix.clone();
                self.rebuild(self.ix.chunk_shift, Some(&known))?;
                op(self).map_err(|f| match f {
                    Fault::Fail(e) => e,
                    Fault::Stale(why) => Error::Corrupt(format!("{}: {why}", self.lower.describe())),
                })
            }
        }
    }

    /// A read that rebuilds a stale index (unless a reader before it already has) and tries
    /// again.
    pub fn read_repairing(&mut self, offset: u64, size: usize) -> Result<Vec<u8>> {
        self.with_rebuild(|f| f.read(offset, size))
    }

    /// Write `data` at `off`, extending the file with zeros if `off` is past its end.
    pub fn write(&mut self, off: u64, data: &[u8]) -> Result<usize> {
        self.locked(LockKind::Exclusive, |f| f.write_now(off, data))
    }

    /// Append `data` at the end of the file as it is now, across mounts (`O_APPEND`); returns
    /// where it went.
    pub fn append(&mut self, data: &[u8]) -> Result<u64> {
        self.locked(LockKind::Exclusive, |f| {
            let at = f.size();
            f.write_now(at, data).map(|_| at)
        })
    }

    fn write_now(&mut self, off: u64, data: &[u8]) -> Result<usize> {
        if data.is_empty() {
            return Ok(0);
        }
        let result = if self.padded {
            self.with_rebuild(|f| f.write_padded(off, data))
        } else {
            self.with_rebuild(|f| f.write_chunks(off, data))
        };
        self.finish(result.map(|()| data.len()))
    }

    /// Write to a padded file: the bytes between its end and `off` become zeros, and the
    /// trailer follows the new end, or stays at the end of the padding the new end is still in.
    fn write_padded(&mut self, off: u64, data: &[u8]) -> std::result::Result<(), Fault> {
        let n = self.size();
        let end = off + data.len() as u64;
        if end <= n {
            return self.write_chunks(off, data);
        }
        let stored = self.ix.size;
        if off > n + EAGER_PAD_BYTES {
            // A far jump (a sparse file): the padding and trailer go, and the gap becomes a hole,
            // as in any file; the data and its trailer follow.
            self.truncate_chunks(n)?;
            self.flush_pending()?;
            let mut buf = Vec::with_capacity(data.len() + PAD_TRAILER_BYTES as usize);
            buf.extend_from_slice(data);
            buf.extend_from_slice(&Self::trailer(end));
            self.write_chunks(off, &buf)?;
            self.set_real_size(end);
            return Ok(());
        }
        // What goes from the old end on: zeros up to `off`, then the data.
        let from = off.min(n);
        let mut buf = vec![0u8; (end - from) as usize];
        buf[(off - from) as usize..].copy_from_slice(data);
        let cs = self.ix.chunk_bytes();
        if end + PAD_TRAILER_BYTES <= stored && stored - end <= cs {
            // Inside the padding, near its end: data, zeros and the trailer in one write.
            buf.resize((stored - PAD_TRAILER_BYTES - from) as usize, 0);
            buf.extend_from_slice(&Self::trailer(end));
            self.write_chunks(from, &buf)?;
        } else if end + PAD_TRAILER_BYTES <= stored {
            // Still inside the padding: the trailer stays where it is, and says more. (The
            // records go out first: the trailer's chunk may be one just written.)
            self.write_chunks(from, &buf)?;
            self.flush_pending()?;
            self.write_chunks(stored - PAD_TRAILER_BYTES, &Self::trailer(end))?;
        } else if stored == 0 && end <= EAGER_PAD_BYTES {
            // A new file written from the start, as most small files are: padded at once, so
            // that closing it writes nothing more.
            let target = padme(end + PAD_TRAILER_BYTES);
            buf.resize((target - PAD_TRAILER_BYTES - from) as usize, 0);
            buf.extend_from_slice(&Self::trailer(end));
            self.write_chunks(from, &buf)?;
        } else {
            buf.extend_from_slice(&Self::trailer(end));
            self.write_chunks(from, &buf)?;
        }
        self.set_real_size(end);
        Ok(())
    }

    /// Set a padded file's size: what lay past the new size goes, and the trailer follows it.
    fn truncate_padded(&mut self, size: u64) -> std::result::Result<(), Fault> {
        let n = self.size();
        // The trailer is written first, so that the last bytes stored always name the size.
        if size < n {
            self.write_chunks(size, &Self::trailer(size))?;
            self.flush_pending()?;
            self.truncate_chunks(size + PAD_TRAILER_BYTES)?;
        } else {
            self.write_padded(size - 1, &[0])?;
        }
        self.set_real_size(size);
        Ok(())
    }

    /// Bring a padded file's stored size to `padme(size + 16)`, the padding written as data.
    fn pad_out(&mut self) -> std::result::Result<(), Fault> {
        let n = self.size();
        let stored = self.ix.size;
        if n == 0 && stored == 0 {
            return Ok(());
        }
        let target = padme(n + PAD_TRAILER_BYTES);
        if stored == target {
            return Ok(());
        }
        if stored < target && target - n <= self.ix.chunk_bytes() {
            // Little to add: the zeros and the trailer in one write.
            let mut buf = vec![0u8; (target - n) as usize];
            buf[(target - n - PAD_TRAILER_BYTES) as usize..].copy_from_slice(&Self::trailer(n));
            self.write_chunks(n, &buf)?;
            self.set_real_size(n);
            return Ok(());
        }
        // The trailer first, at the padded end; then zeros over everything between.
        self.write_chunks(target - PAD_TRAILER_BYTES, &Self::trailer(n))?;
        self.flush_pending()?;
        if stored > target {
            self.truncate_chunks(target)?;
            self.flush_pending()?;
        }
        // A file that ends in a hole (but for its last chunk) shows no end of data for the
        // padding to hide: its padding joins the hole (a sparse image of a terabyte is not to be followed by gigabytes of
        // sealed zeros).
        let last = (n - 1) >> self.ix.chunk_shift;
        let is_hole = |c: u64| self.ix.map.get(c).is_some_and(|r| r.kind == Kind::Run);
        if is_hole(last) || (last > 0 && is_hole(last - 1)) {
            self.set_real_size(n);
            return Ok(());
        }
        let mut at = n;
        while at < target - PAD_TRAILER_BYTES {
            let len = (target - PAD_TRAILER_BYTES - at).min(IO_WINDOW_BYTES);
            self.write_chunks(at, &vec![0u8; len as usize])?;
            self.flush_pending()?;
            at += len;
        }
        self.set_real_size(n);
        Ok(())
    }

    /// [`Self::pad_out`] before the file is left or synced, when this open changed it.
    fn pad_if_changed(&mut self) -> Result<()> {
        if !self.padded || !self.modified || !self.lower.writable() {
            return Ok(());
        }
        let result = self.with_rebuild(|f| f.pad_out());
        self.finish(result)
    }

    fn write_chunks(&mut self, off: u64, data: &[u8]) -> std::result::Result<(), Fault> {
        if off > self.ix.size {
            self.extend(off)?;
        }
        let shift = self.ix.chunk_shift;
        let cs = self.ix.chunk_bytes();
        let end = off + data.len() as u64;
        let chunks = ((end - 1) >> shift) - (off >> shift) + 1;
        self.pending.reserve(DATA_START as usize + data.len() + chunks as usize * (RECORD_HEADER_BYTES as usize + 8));
        let mut ready = self.encode_whole_chunks(off, data)?.into_iter();
        for chunk in (off >> shift)..=((end - 1) >> shift) {
            let start = chunk << shift;
            let s = (off.max(start) - start) as usize;
            let e = (end.min(start + cs) - start) as usize;
            let piece = &data[(start + s as u64 - off) as usize..(start + e as u64 - off) as usize];
            let current = self.ix.chunk_len(chunk) as usize;
            let new_size = self.ix.size.max(start + e as u64);
            if self.engine.fast_tails && s == current && (e as u64) < cs {
                // An append inside the last chunk: store the bytes as they are (§4.2).
                self.check_not_lost(chunk)?;
                self.append_tail(chunk, s as u32, piece, new_size)?;
            } else if s == 0 && e >= current {
                self.lost.remove(&chunk);
                match ready.next().filter(|(c, _)| *c == chunk) {
                    Some((_, encoded)) => self.store_encoded(chunk, encoded, new_size)?,
                    None => self.store_chunk(chunk, piece, new_size)?,
                }
            } else {
                // Read-modify-write, in a buffer kept for the purpose.
                let mut content = std::mem::take(&mut self.scratch);
                self.chunk_content_into(chunk, &mut content)?;
                content.resize(current.max(e), 0);
                content[s..e].copy_from_slice(piece);
                let stored = self.store_chunk(chunk, &content, new_size);
                self.scratch = content;
                stored?;
            }
        }
        Ok(())
    }

    /// Grow the file to `size` with zeros, encoding them too (§4.4, case 4).
    fn extend(&mut self, size: u64) -> std::result::Result<(), Fault> {
        let shift = self.ix.chunk_shift;
        let cs = self.ix.chunk_bytes();
        let old = self.ix.size;
        if old % cs != 0 {
            // Fill out the partial last chunk (as far as the new size reaches into it).
            let chunk = old >> shift;
            let current = (old % cs) as usize;
            let target = (size - (chunk << shift)).min(cs) as usize;
            let new_size = (chunk << shift) + target as u64;
            if self.engine.fast_tails && (target as u64) < cs {
                self.append_tail(chunk, current as u32, &vec![0; target - current], new_size)?;
            } else {
                let mut content = self.chunk_content(chunk)?;
                content.resize(target, 0);
                self.store_chunk(chunk, &content, new_size)?;
            }
        }
        let first_hole = self.ix.size.div_ceil(cs);
        let full_end = size >> shift;
        if full_end > first_hole {
            self.zero_run(first_hole, full_end - first_hole, None)?;
        }
        if size > self.ix.size {
            let chunk = size >> shift;
            let zeros = vec![0; (size - (chunk << shift)) as usize];
            if self.engine.fast_tails {
                self.append_tail(chunk, 0, &zeros, size)?;
            } else {
                self.store_chunk(chunk, &zeros, size)?;
            }
        }
        Ok(())
    }

    /// Zero chunks `first..first + count` with `Run` records: one encoded zero chunk stands for
    /// each run. A deterministic codec shares one encoding among all runs; any other (a
    /// cipher) encodes one per run, bound to the run's place.
    /// `size`: the file's size the records leave, if not the end of the run (a run inside it).
    fn zero_run(&mut self, first: u64, count: u64, size: Option<u64>) -> std::result::Result<(), Fault> {
        let shift = self.ix.chunk_shift;
        let shared = self.engine.codec.deterministic();
        let mut chunk = first;
        while chunk < first + count {
            let n = (first + count - chunk).min(u64::from(u32::MAX));
            let z = if shared {
                self.engine.zero_chunk(shift)?
            } else {
                let place = self.place(chunk, n);
                Arc::new(self.engine.encode(&place, &vec![0; 1 << shift])?)
            };
            let header = RecordHeader {
                kind: Kind::Run,
                flags: if z.raw { FLAG_RAW } else { 0 },
                count: n as u32,
                decoded_len: 1 << shift,
                ..self.header_for(chunk, size.unwrap_or((chunk + n) << shift))
            };
            self.append_record(header, &z.payload)?;
            chunk += n;
        }
        Ok(())
    }

    /// The chunks that `data`, written at `off`, covers whole and that [`Self::write_chunks`]
    /// need not encode itself: `(chunk, encoding)`, in order. For a large write of a codec slow
    /// enough to pay for it (judged by the time its first chunk took), all of them, encoded
    /// on this thread and the encoder pool's at once; otherwise the first one only, or none.
    fn encode_whole_chunks(&mut self, off: u64, data: &[u8]) -> Result<Encoded> {
        let cs = self.ix.chunk_bytes();
        let first = off.div_ceil(cs);
        let last = (off + data.len() as u64) / cs; // exclusive
        let Some(pool) = encoder_pool() else { return Ok(Vec::new()) };
        if last <= first || (last - first) * cs < PARALLEL_ENCODE_BYTES {
            return Ok(Vec::new());
        }
        let place = self.place(first, 1);
        let bytes_of = |c: u64| (c * cs - off) as usize..((c + 1) * cs - off) as usize;
        let started = std::time::Instant::now();
        let mut all = vec![(first, self.engine.encode(&place, &data[bytes_of(first)])?)];
        if started.elapsed() * ((last - first) as u32) < PARALLEL_ENCODE_TIME {
            return Ok(all);
        }
        // Contiguous groups: the first for this thread, one for each pool thread.
        let rest = first + 1..last;
        if rest.is_empty() {
            return Ok(all);
        }
        let groups = pool.threads + 1;
        let per = (rest.end - rest.start).div_ceil(groups as u64);
        let ranges: Vec<std::ops::Range<u64>> =
            rest.clone().step_by(per as usize).map(|start| start..(start + per).min(rest.end)).collect();
        let (done, results) = std::sync::mpsc::channel();
        for (i, range) in ranges.iter().enumerate().skip(1) {
            let (engine, done, range) = (self.engine.clone(), done.clone(), range.clone());
            let copy = data[bytes_of(range.start).start..bytes_of(range.end - 1).end].to_vec();
            pool.run(Box::new(move || {
                let encoded: Result<Encoded> = range
                    .clone()
                    .zip(copy.chunks(cs as usize))
                    .map(|(c, chunk)| Ok((c, engine.encode(&Place { chunk: c, ..place }, chunk)?)))
                    .collect();
                let _ = done.send((i, encoded));
            }));
        }
        drop(done);
        for c in ranges[0].clone() {
            all.push((c, self.engine.encode(&Place { chunk: c, ..place }, &data[bytes_of(c)])?));
        }
        let mut theirs: Vec<(usize, Result<Encoded>)> = results.iter().collect();
        if theirs.len() != ranges.len() - 1 {
            return Err(Error::Corrupt(format!("{}: an encoder thread failed", self.engine.kind)));
        }
        theirs.sort_by_key(|(i, _)| *i);
        for (_, encoded) in theirs {
            all.extend(encoded?);
        }
        Ok(all)
    }

    /// Store a whole chunk encoded ahead of time.
    fn store_encoded(&mut self, chunk: u64, encoded: EncodedChunk, new_size: u64) -> std::result::Result<(), Fault> {
        let header =
            RecordHeader { kind: Kind::Data, count: 1, decoded_len: self.ix.chunk_bytes() as u32, ..self.header_for(chunk, new_size) };
        self.append_with(header, |out| {
            out.extend_from_slice(&encoded.payload);
            Ok(if encoded.raw { FLAG_RAW } else { 0 })
        })?;
        Ok(())
    }

    /// Store a chunk's whole content: encoded, or raw as the fast tail when it is the partial
    /// last chunk and fast tails are on.
    fn store_chunk(&mut self, chunk: u64, content: &[u8], new_size: u64) -> std::result::Result<(), Fault> {
        let is_partial_last = (content.len() as u64) < self.ix.chunk_bytes() && new_size >> self.ix.chunk_shift == chunk;
        if self.engine.fast_tails && is_partial_last {
            return self.append_tail(chunk, 0, content, new_size);
        }
        let header = RecordHeader { kind: Kind::Data, count: 1, decoded_len: content.len() as u32, ..self.header_for(chunk, new_size) };
        let engine = self.engine.clone();
        let place = self.place(chunk, 1);
        self.append_with(header, |out| Ok(if engine.encode_into(&place, content, out)? { FLAG_RAW } else { 0 }))?;
        if is_partial_last {
            // Reuse the buffer of the chunk last kept.
            let mut kept = self.hot.take().map(|(_, _, v)| v).unwrap_or_default();
            kept.clear();
            kept.extend_from_slice(content);
            self.hot = Some((chunk, self.ix.next_seq - 1, kept));
        }
        Ok(())
    }

    fn append_tail(&mut self, chunk: u64, keep: u32, bytes: &[u8], new_size: u64) -> std::result::Result<(), Fault> {
        let header = RecordHeader { kind: Kind::Tail, count: keep, decoded_len: bytes.len() as u32, ..self.header_for(chunk, new_size) };
        self.append_record(header, bytes)?;
        // Many small appends leave many fragments: fold them into one now and then.
        let fragments = self.ix.tail.as_ref().map_or(0, |t| t.fragments.len());
        if fragments > 64 {
            let content = self.tail_content()?;
            let t = self.ix.tail.as_ref().expect("just appended");
            let header = RecordHeader { kind: Kind::Tail, count: 0, decoded_len: content.len() as u32, ..self.header_for(t.chunk, self.ix.size) };
            self.append_record(header, &content)?;
        }
        Ok(())
    }

    /// Where a payload for chunks `chunk..chunk + count` belongs. The file gets its header
    /// (and identity) first if it has none yet.
    fn place(&mut self, chunk: u64, count: u64) -> Place {
        self.start_file();
        Place { file_id: self.file_id, chunk, count }
    }

    /// Begin the log of a file that has none with its header, made up by the next flush.
    fn start_file(&mut self) {
        if self.header_on_disk {
            return;
        }
        self.pending_start = 0;
        self.pending.clear();
        let file_id = self.engine.codec.new_file_id();
        self.file_id = file_id.unwrap_or_default();
        let header = FileHeader { codec: self.engine.codec.tag(), chunk_shift: self.ix.chunk_shift, file_id, flags: self.header_flags() };
        self.pending.extend_from_slice(&header.encode());
        self.pending.resize(DATA_START as usize, 0);
        self.header_on_disk = true;
    }

    fn header_for(&self, chunk: u64, file_size: u64) -> RecordHeader {
        RecordHeader {
            kind: Kind::Data,
            flags: 0,
            chunk_shift: self.ix.chunk_shift,
            seq: self.ix.next_seq,
            chunk,
            count: 0,
            decoded_len: 0,
            payload_len: 0,
            payload_crc: 0,
            file_size,
        }
    }

    /// Add a record at the end of the log and to the index. It reaches the lower file at the
    /// next [`Self::flush_pending`], at the latest when the operation ends.
    fn append_record(&mut self, header: RecordHeader, payload: &[u8]) -> Result<()> {
        self.append_with(header, |out| {
            out.extend_from_slice(payload);
            Ok(0)
        })
    }

    /// Append a record whose payload `fill` appends to the log buffer (so that an encoder
    /// writes straight into it); `fill` returns flags to add to the header.
    fn append_with(&mut self, header: RecordHeader, fill: impl FnOnce(&mut Vec<u8>) -> Result<u8>) -> Result<()> {
        self.start_file();
        let off = self.ix.log_end;
        if self.pending.is_empty() {
            self.pending_start = off;
        }
        debug_assert_eq!(self.pending_start + self.pending.len() as u64, off);
        let start = begin_record(&mut self.pending);
        let flags = match fill(&mut self.pending) {
            Ok(flags) => flags,
            Err(e) => {
                self.pending.truncate(start);
                return Err(e);
            }
        };
        let written = finish_record(RecordHeader { flags: header.flags | flags, ..header }, &mut self.pending, start);
        let payload_at = start + RECORD_HEADER_BYTES as usize;
        let payload = &self.pending[payload_at..payload_at + written.payload_len as usize];
        self.ix.apply(off, &written, payload).map_err(|e| Error::Corrupt(format!("{}: {e}", self.lower.describe())))?;
        self.slot_dirty = true;
        self.modified = true;
        if self.pending.len() as u64 >= IO_WINDOW_BYTES {
            self.flush_pending()?;
        }
        Ok(())
    }

    /// Write the records appended since the last flush. The buffer is kept for the next ones
    /// unless it grew large.
    fn flush_pending(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        if self.pending_start == 0 {
            // A new file: its first slot goes out with the header, sparing a write at close.
            self.slot_seq += 1;
            let at = Slot::offset_for(self.slot_seq) as usize;
            let slot = self.current_slot().encode();
            self.pending[at..at + slot.len()].copy_from_slice(&slot);
            self.slot_dirty = false;
        }
        self.drop_prefetched();
        let result = self.lower.write_at(self.pending_start, &self.pending);
        if let (Ok(()), Some(seen)) = (&result, &mut self.seen) {
            seen.wrote(self.pending_start, &self.pending);
        }
        self.pending.clear();
        if self.pending.capacity() > KEEP_BUFFER_BYTES {
            self.pending = Vec::new();
        }
        result
    }

    /// End a modifying operation: write what is pending, compact if it is time. On a lower
    /// failure the index in memory may be ahead of the file, so it is reloaded.
    fn finish<T>(&mut self, result: Result<T>) -> Result<T> {
        let result = result.and_then(|v| self.flush_pending().map(|()| v));
        match result {
            Ok(v) => {
                self.compact_if_due()?;
                Ok(v)
            }
            Err(e) => {
                self.pending.clear();
                if let Err(reload) = self.load() {
                    tracing::error!("{}: reloading the index after a failed write: {reload}", self.lower.describe());
                }
                Err(e)
            }
        }
    }

    /// Set the decoded size (§4.4): on a chunk boundary, inside a chunk, inside a fast tail,
    /// or past the end.
    pub fn truncate(&mut self, size: u64) -> Result<()> {
        self.locked(LockKind::Exclusive, |f| f.truncate_now(size))
    }

    /// `fallocate` of `length` bytes at `offset`: the file below sets aside room for a record of
    /// every chunk the range touches, at the most its codec can encode a chunk to (a write into
    /// a chunk writes the whole chunk again), for the checkpoint that lists them, and for the
    /// header if the file has none yet. Writing the range later then does not run out of space,
    /// and a request larger than the free space fails with `ENOSPC`, as on a kernel file system.
    pub fn reserve(&mut self, offset: u64, length: u64) -> Result<()> {
        let header = if self.header_on_disk { 0 } else { DATA_START };
        let need = reserve_bytes(self.ix.chunk_shift, offset, length, |n| self.engine.codec.max_payload(n));
        self.lower.reserve(need.saturating_add(header))
    }

    /// Grow the file to `size` if it is smaller, across mounts.
    pub fn grow_to(&mut self, size: u64) -> Result<()> {
        self.locked(LockKind::Exclusive, |f| if size > f.size() { f.truncate_now(size) } else { Ok(()) })
    }

    fn truncate_now(&mut self, size: u64) -> Result<()> {
        if size == self.size() {
            return Ok(());
        }
        if size == 0 {
            self.pending.clear();
            self.modified = true;
            self.drop_prefetched();
            self.set_lower_len(0)?;
            self.start_empty();
            return Ok(());
        }
        let shrinking = size < self.size();
        let result = if self.padded {
            self.with_rebuild(|f| f.truncate_padded(size))
        } else {
            self.with_rebuild(|f| f.truncate_chunks(size))
        };
        self.finish(result)?;
        if shrinking {
            // Room `reserve` set aside past the lower file's end goes with what was cut off:
            // setting its length, even to what it is, makes ext4 and XFS free what lies past it.
            let len = self.lower.len()?;
            self.set_lower_len(len)?;
        }
        Ok(())
    }

    fn truncate_chunks(&mut self, size: u64) -> std::result::Result<(), Fault> {
        if size > self.ix.size {
            return self.extend(size);
        }
        let shift = self.ix.chunk_shift;
        let chunk = size >> shift;
        let keep = (size - (chunk << shift)) as u32;
        let in_tail = self.ix.tail.as_ref().is_some_and(|t| t.chunk == chunk);
        if keep == 0 {
            let header = RecordHeader { kind: Kind::Size, ..self.header_for(chunk, size) };
            self.append_record(header, &[])?;
        } else if in_tail || (self.engine.fast_tails && !self.lost.contains(&chunk)) {
            // Keep a prefix of the chunk as it is stored: no decoding, no encoding.
            if !in_tail && self.ix.map.get(chunk).is_none_or(|r| r.decoded_len < keep) {
                let content = self.chunk_content(chunk)?;
                return self.store_chunk(chunk, &content[..keep as usize], size);
            }
            self.append_tail(chunk, keep, &[], size)?;
        } else {
            let content = self.chunk_content(chunk)?;
            self.store_chunk(chunk, &content[..keep as usize], size)?;
        }
        self.lost.retain(|c| *c < self.ix.chunks());
        Ok(())
    }

    /// Zero `off..off + len` inside the file (hole punching).
    pub fn zero_range(&mut self, off: u64, len: u64) -> Result<()> {
        self.locked(LockKind::Exclusive, |f| {
            let end = (off + len).min(f.size());
            let cs = f.ix.chunk_bytes();
            // The chunks the range covers whole become a run of zero chunks, as a truncate's
            // zeros do: a hole to SEEK_HOLE, and no data to store (xfstests generic/539).
            let (first, last) = (off.div_ceil(cs), end / cs);
            let (whole_from, whole_to) = if f.padded || last <= first { (end, end) } else { (first * cs, last * cs) };
            let zeros = |f: &mut Self, from: u64, to: u64| -> Result<()> {
                let mut at = from;
                while at < to {
                    let n = (to - at).min(IO_WINDOW_BYTES);
                    f.write_now(at, &vec![0; n as usize])?;
                    at += n;
                }
                Ok(())
            };
            zeros(f, off, whole_from)?;
            if whole_to > whole_from {
                let size = f.ix.size;
                let result = f.with_rebuild(|f| {
                    for chunk in first..last {
                        f.lost.remove(&chunk);
                    }
                    f.zero_run(first, last - first, Some(size))
                });
                f.finish(result)?;
            }
            zeros(f, whole_to, end)
        })
    }

    // Persistence.

    /// Make everything written so far durable.
    pub fn sync(&mut self) -> Result<()> {
        if self.engine.shared.is_some() {
            if self.padded && self.modified {
                self.locked(LockKind::Exclusive, |f| f.pad_if_changed())?;
            }
            // Every change was written out, slot included, before its lock was dropped.
            return self.lower.sync();
        }
        self.pad_if_changed()?;
        self.flush_pending()?;
        if self.slot_dirty {
            self.write_slot()?;
        }
        self.lower.sync()
    }

    /// Called at the last close: leave a checkpoint if many records followed the last one,
    /// and the slot up to date, so the next open reads little.
    pub fn close(&mut self) -> Result<()> {
        if self.engine.shared.is_some() {
            self.drop_prefetched();
            let pad = self.padded && self.modified;
            if !self.modified || (self.ix.since_checkpoint < CHECKPOINT_EVERY_RECORDS && !pad) {
                return Ok(());
            }
            return self.locked(LockKind::Exclusive, |f| f.close_now());
        }
        self.close_now()
    }

    fn close_now(&mut self) -> Result<()> {
        self.drop_prefetched();
        if !self.lower.writable() {
            // Opened read-only (a read-only mount): nothing was written, and an index rebuilt
            // in memory stays there.
            return Ok(());
        }
        self.pad_if_changed()?;
        self.flush_pending()?;
        if self.ix.since_checkpoint >= CHECKPOINT_EVERY_RECORDS {
            // The new checkpoint leaves the old one dead, which may be the byte too many.
            self.write_checkpoint()?;
            self.compact_if_due()?;
        } else if self.slot_dirty {
            self.write_slot()?;
        }
        Ok(())
    }

    /// Compact when dead space exceeds both the live bytes and the slack.
    fn compact_if_due(&mut self) -> Result<()> {
        if self.ix.dead_bytes() > self.ix.live_bytes().max(COMPACT_SLACK_BYTES) {
            self.compact_now()?;
        }
        Ok(())
    }

    fn write_checkpoint(&mut self) -> Result<()> {
        if !self.header_on_disk {
            return Ok(());
        }
        let payload = self.ix.checkpoint_payload();
        let header = RecordHeader { kind: Kind::Index, ..self.header_for(0, self.ix.size) };
        self.append_record(header, &payload)?;
        self.flush_pending()?;
        self.write_slot()
    }

    fn write_slot(&mut self) -> Result<()> {
        if !self.header_on_disk {
            return Ok(());
        }
        self.flush_pending()?;
        self.drop_prefetched();
        self.slot_seq += 1;
        let slot = self.current_slot().encode();
        self.write_lower(Slot::offset_for(self.slot_seq), &slot)?;
        self.slot_dirty = false;
        Ok(())
    }

    /// The slot describing the index as it is now, numbered `slot_seq`.
    fn current_slot(&self) -> Slot {
        let checkpoint = self.ix.checkpoint;
        Slot {
            slot_seq: self.slot_seq,
            file_size: self.ix.size,
            covered_seq: self.ix.next_seq - 1,
            log_end: self.ix.log_end,
            checkpoint_off: checkpoint.map_or(0, |c| c.off),
            checkpoint_seq: checkpoint.map_or(0, |c| c.seq),
        }
    }

    /// Whether this open wrote to the file.
    pub fn modified(&self) -> bool {
        self.modified
    }

    /// Move the live records together at the front of the log and cut the file after them.
    ///
    /// Crash safety: a checkpoint of the current state is made durable first, so the records
    /// written after it (none) are all the normal load reads. Records then move only into dead
    /// space, directly when they all fit into the first gap, otherwise through a copy after
    /// the end of the log that is made durable before anything it came from is overwritten.
    /// Every live record thus exists intact somewhere at every moment, and the newest
    /// checkpoint is never overwritten before a newer one is durable.
    pub fn compact(&mut self) -> Result<Value> {
        if !self.lower.writable() {
            // A read-only mount, or a lower file this daemon may not write.
            return Err(Error::Os(libc::EROFS));
        }
        self.locked(LockKind::Exclusive, |f| f.compact_now())
    }

    fn compact_now(&mut self) -> Result<Value> {
        let before = self.lower.len()?;
        if !self.header_on_disk || !self.lower.writable() {
            return Ok(json!({ "before": before, "after": before }));
        }
        self.drop_prefetched();
        self.flush_pending()?;
        self.write_checkpoint()?;
        self.lower.sync()?;
        let live = self.ix.live_records();
        let mut w = DATA_START;
        let mut settled = 0;
        while settled < live.len() && live[settled].off == w {
            w += live[settled].bytes();
            settled += 1;
        }
        let movers = &live[settled..];
        let moved_bytes: u64 = movers.iter().map(|r| r.bytes()).sum();
        let mut relocation = HashMap::new();
        if !movers.is_empty() {
            if w + moved_bytes <= movers[0].off {
                self.copy_records(movers, w, &mut relocation)?;
            } else {
                let scratch = self.ix.log_end;
                let mut via_scratch = HashMap::new();
                self.copy_records(movers, scratch, &mut via_scratch)?;
                self.lower.sync()?;
                let staged: Vec<RecordRef> = movers.iter().map(|r| RecordRef { off: via_scratch[&r.off], ..*r }).collect();
                let mut down = HashMap::new();
                self.copy_records(&staged, w, &mut down)?;
                for r in movers {
                    relocation.insert(r.off, down[&via_scratch[&r.off]]);
                }
            }
            self.lower.sync()?;
        }
        let old_checkpoint = self.ix.checkpoint.expect("written above");
        let compacted_end = w + moved_bytes;
        self.ix.relocate(&relocation);
        // The next checkpoint may not overwrite the one in force (see above).
        let next_bytes = record_bytes(self.ix.checkpoint_payload().len() as u32);
        let overlaps = compacted_end + next_bytes > old_checkpoint.off && compacted_end < old_checkpoint.off + old_checkpoint.bytes;
        self.ix.log_end = if overlaps { old_checkpoint.off + old_checkpoint.bytes } else { compacted_end };
        self.ix.checkpoint = None;
        self.write_checkpoint()?;
        self.lower.sync()?;
        self.set_lower_len(self.ix.log_end)?;
        let after = self.ix.log_end;
        tracing::debug!("{}: compacted from {before} to {after} bytes", self.lower.describe());
        Ok(json!({ "before": before, "after": after }))
    }

    /// Copy `records` (in log order) to consecutive places from `to`, recording old → new.
    fn copy_records(&self, records: &[RecordRef], mut to: u64, moved: &mut HashMap<u64, u64>) -> Result<()> {
        let mut i = 0;
        while i < records.len() {
            // A group of records adjacent in the log, up to the I/O window.
            let start = records[i].off;
            let mut end = start + records[i].bytes();
            let mut j = i + 1;
            while j < records.len() && records[j].off == end && end - start < IO_WINDOW_BYTES {
                end += records[j].bytes();
                j += 1;
            }
            let bytes = self.lower.read_at(start, (end - start) as usize)?;
            if bytes.len() as u64 != end - start {
                return Err(Error::Corrupt(format!("{}: the log is shorter than its index says", self.lower.describe())));
            }
            // Records lie past the start of the file: what was seen of it stays true.
            debug_assert!(to >= DATA_START);
            self.lower.write_at(to, &bytes)?;
            for r in &records[i..j] {
                moved.insert(r.off, to + (r.off - start));
            }
            to += end - start;
            i = j;
        }
        Ok(())
    }

    // Extended operations.

    /// Decode every chunk and check the index: a report of what is wrong, if anything.
    ///
    /// An index that disagrees with the records (a daemon killed in the middle of a compaction
    /// leaves the slot naming the checkpoint from before it) is rebuilt from the data, as any
    /// read would, and the check starts again; only what is wrong after that is a problem.
    pub fn verify(&mut self) -> Result<Value> {
        self.locked(LockKind::Exclusive, |f| f.verify_now())
    }

    fn verify_now(&mut self) -> Result<Value> {
        let mut rebuilt = None;
        loop {
            let len = self.lower.len()?;
            let mut problems = Vec::new();
            // Lost chunks have no records, which the index check would call inconsistent: the
            // reads below report them instead.
            let mut stale = if self.lost.is_empty() { self.ix.validate(len).err() } else { None };
            let cs = self.ix.chunk_bytes();
            let mut chunk = 0;
            while stale.is_none() && chunk < self.ix.chunks() {
                match self.read_stored(chunk * cs, cs as usize) {
                    Ok(_) => {}
                    Err(Fault::Stale(why)) => stale = Some(why),
                    Err(Fault::Fail(e)) => problems.push(json!({ "offset": chunk * cs, "error": e.to_string() })),
                }
                chunk += 1;
            }
            match stale {
                Some(why) if rebuilt.is_none() => {
                    tracing::warn!("{}: the index is inconsistent ({why}); rebuilding it from the data", self.lower.describe());
                    self.flush_pending()?;
                    let known = self.ix.clone();
                    self.rebuild(self.ix.chunk_shift, Some(&known))?;
                    rebuilt = Some(why);
                    continue;
                }
                Some(why) => problems.push(json!({ "offset": Value::Null, "error": format!("index: {why}") })),
                None => {}
            }
            return Ok(json!({
                "ok": problems.is_empty(),
                "chunks": self.ix.chunks(),
                "size": self.ix.size,
                "index_rebuilt": rebuilt,
                "problems": problems,
            }));
        }
    }

    /// Rebuild the index from the data, whatever state it is in.
    pub fn recover_index(&mut self) -> Result<Value> {
        self.locked(LockKind::Exclusive, |f| f.recover_index_now())
    }

    fn recover_index_now(&mut self) -> Result<Value> {
        self.flush_pending()?;
        let known = self.ix.clone();
        self.rebuild(self.ix.chunk_shift, Some(&known))?;
        Ok(json!({ "size": self.ix.size, "chunks": self.ix.chunks(), "lost_chunks": self.lost.len() }))
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

fn fault_to_error(f: Fault) -> Error {
    match f {
        Fault::Fail(e) => e,
        Fault::Stale(why) => Error::Corrupt(why),
    }
}

/// The newest record sequence number behind `chunk` in `ix`.
fn newest_seq(ix: &FileIndex, chunk: u64) -> u64 {
    if let Some(t) = ix.tail.as_ref().filter(|t| t.chunk == chunk) {
        return t.fragments.iter().map(|f| f.seq).max().unwrap_or(0);
    }
    ix.map.get(chunk).map_or(0, |r| r.seq)
}

/// The real size a padded file's trailer `t` (its last stored bytes, of `stored`) names, or why
/// it names none.
fn parse_trailer(t: &[u8], stored: u64) -> std::result::Result<u64, &'static str> {
    if t.len() != PAD_TRAILER_BYTES as usize || t[8..] != PAD_MAGIC {
        return Err("no trailer at the end");
    }
    let n = u64::from_le_bytes(t[..8].try_into().expect("8 bytes"));
    if n > stored - PAD_TRAILER_BYTES {
        return Err("the size it names is past the end");
    }
    Ok(n)
}

/// Append `content[s..e]` to `out`, with zeros for whatever `content` lacks.
fn copy_padded(out: &mut Vec<u8>, content: &[u8], s: usize, e: usize) {
    let have = content.len().min(e);
    if s < have {
        out.extend_from_slice(&content[s..have]);
    }
    out.resize(out.len() + (e - s.max(have)), 0);
}

/// A sliding read window over the lower file, for scans. It starts on the bytes read at open.
struct Window<'p> {
    start: u64,
    bytes: std::borrow::Cow<'p, [u8]>,
}

impl Window<'_> {
    /// `len` bytes at `off`, or `None` if the file ends first.
    fn get<'w, L: LowerIo>(&'w mut self, lower: &L, off: u64, len: u64, file_len: u64) -> Result<Option<&'w [u8]>> {
        if off + len > file_len {
            return Ok(None);
        }
        let have = off >= self.start && off + len <= self.start + self.bytes.len() as u64;
        if !have {
            let want = len.max(1 << 20).min(file_len - off);
            self.bytes = lower.read_at(off, want as usize)?.into();
            self.start = off;
            if (self.bytes.len() as u64) < len {
                return Ok(None);
            }
        }
        let at = (off - self.start) as usize;
        Ok(Some(&self.bytes[at..at + len as usize]))
    }
}

/// The bytes of the file below that writing `length` bytes at `offset` may take: a record for
/// each chunk (of `1 << shift` bytes) the range touches, with the largest payload
/// `max_payload` allows for a chunk, and a checkpoint record naming each of them apart.
pub fn reserve_bytes(shift: u8, offset: u64, length: u64, max_payload: impl Fn(usize) -> usize) -> u64 {
    /// A checkpoint's bytes per extent, at the most: varints of the chunk gap and count, and the
    /// record's place, length and sequence.
    const CHECKPOINT_EXTENT_BYTES: u64 = 48;
    if length == 0 {
        return 0;
    }
    let last = offset.saturating_add(length - 1);
    let chunks = (last >> shift) - (offset >> shift) + 1;
    let payload = u32::try_from(max_payload(1 << shift)).unwrap_or(u32::MAX);
    let checkpoint = u32::try_from(chunks.saturating_mul(CHECKPOINT_EXTENT_BYTES).saturating_add(64)).unwrap_or(u32::MAX);
    chunks.saturating_mul(record_bytes(payload)).saturating_add(record_bytes(checkpoint))
}
