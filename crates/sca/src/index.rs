//! The per-file index (Fast Indexing §3): the decoded size, which record holds each chunk, the
//! fast tail, and how much of the log is live.
//!
//! The index changes only by [`FileIndex::apply`]ing records, in sequence order. The writer
//! applies each record it appends, and recovery applies the records it finds, so the two cannot
//! disagree about what a record means.

use std::collections::HashMap;

use crate::chunkmap::{ChunkMap, Displaced, RecordRef};
use crate::chunks;
use crate::Error;
use crate::format::{record_bytes, varint, Kind, RecordHeader, DATA_START, FLAG_RAW};

/// A fast tail (§4.2): the last, partial chunk kept unencoded. Its content is the first `keep`
/// bytes of `base` (decoded) followed by `bytes`.
#[derive(Clone, Debug, Default)]
pub struct Tail {
    pub chunk: u64,
    pub base: Option<RecordRef>,
    pub keep: u32,
    pub bytes: Vec<u8>,
    /// The `Tail` records the content was built from, all still needed to rebuild it.
    pub fragments: Vec<RecordRef>,
}

impl Tail {
    pub fn len(&self) -> u64 {
        u64::from(self.keep) + self.bytes.len() as u64
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub off: u64,
    pub seq: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug)]
pub struct FileIndex {
    pub chunk_shift: u8,
    /// The decoded file size: what `stat` reports.
    pub size: u64,
    pub map: ChunkMap,
    pub tail: Option<Tail>,
    pub next_seq: u64,
    /// Where the next record goes.
    pub log_end: u64,
    pub checkpoint: Option<Checkpoint>,
    /// Records appended since the checkpoint.
    pub since_checkpoint: u64,
    live_record_bytes: u64,
    /// How many chunks still use each `Run` record.
    run_refs: HashMap<u64, u64>,
}

impl FileIndex {
    pub fn new(chunk_shift: u8) -> FileIndex {
        FileIndex {
            chunk_shift,
            size: 0,
            map: ChunkMap::default(),
            tail: None,
            next_seq: 1,
            log_end: DATA_START,
            checkpoint: None,
            since_checkpoint: 0,
            live_record_bytes: 0,
            run_refs: HashMap::new(),
        }
    }

    pub fn chunk_bytes(&self) -> u64 {
        chunks::chunk_bytes(self.chunk_shift)
    }

    /// The number of chunks the decoded size spans.
    pub fn chunks(&self) -> u64 {
        chunks::chunk_count(self.chunk_shift, self.size)
    }

    /// Bytes of the lower file still needed: header, live records, the current checkpoint.
    pub fn live_bytes(&self) -> u64 {
        DATA_START + self.live_record_bytes + self.checkpoint.map_or(0, |c| c.bytes)
    }

    /// Bytes of the log that compaction could reclaim.
    pub fn dead_bytes(&self) -> u64 {
        self.log_end.saturating_sub(self.live_bytes())
    }

    /// How many decoded bytes chunk `chunk` holds within the file.
    pub fn chunk_len(&self, chunk: u64) -> u64 {
        chunks::chunk_len(self.chunk_shift, self.size, chunk)
    }

    /// Apply one record found at `off`. `payload` is needed for `Tail` records only.
    pub fn apply(&mut self, off: u64, h: &RecordHeader, payload: &[u8]) -> Result<(), Error> {
        let rec = RecordRef {
            off,
            seq: h.seq,
            kind: h.kind,
            raw: h.flags & FLAG_RAW != 0,
            payload_len: h.payload_len,
            decoded_len: h.decoded_len,
        };
        self.next_seq = self.next_seq.max(h.seq + 1);
        self.log_end = self.log_end.max(off + h.bytes());
        match h.kind {
            Kind::Data | Kind::Run => {
                let count = if h.kind == Kind::Run { u64::from(h.count) } else { 1 };
                self.drop_tail_within(h.chunk, h.chunk + count);
                let displaced = self.map.set(h.chunk, count, rec);
                self.release(displaced);
                self.live_record_bytes += rec.bytes();
                if h.kind == Kind::Run {
                    self.run_refs.insert(off, count);
                }
            }
            Kind::Tail => self.apply_tail(rec, h.chunk, h.count, payload)?,
            Kind::Size => {}
            Kind::Index => {
                self.checkpoint = Some(Checkpoint { off, seq: h.seq, bytes: h.bytes() });
                self.since_checkpoint = 0;
            }
        }
        if h.kind != Kind::Index {
            self.since_checkpoint += 1;
        }
        self.set_size(h.file_size);
        Ok(())
    }

    fn apply_tail(&mut self, rec: RecordRef, chunk: u64, keep: u32, payload: &[u8]) -> Result<(), Error> {
        if let Some(t) = self.tail.as_mut().filter(|t| t.chunk == chunk) {
            if u64::from(keep) > t.len() {
                return Err(Error::index(format!("a fast-tail record keeps {keep} bytes of chunk {chunk}, which has {}", t.len())));
            }
            if keep == 0 {
                let old = std::mem::take(t);
                self.release_tail(old);
                self.tail = Some(Tail { chunk, ..Default::default() });
            } else if keep <= t.keep {
                t.keep = keep;
                t.bytes.clear();
            } else {
                t.bytes.truncate((keep - t.keep) as usize);
            }
        } else {
            if let Some(other) = self.tail.take() {
                self.release_tail(other);
            }
            let base = if keep == 0 {
                let displaced = self.map.remove(chunk);
                self.release(displaced);
                None
            } else {
                match self.map.get(chunk) {
                    Some(r) if keep <= r.decoded_len => {
                        // The record moves from the map to the tail and stays live.
                        self.map.remove(chunk);
                        Some(r)
                    }
                    _ => return Err(Error::index(format!("a fast-tail record keeps {keep} bytes of chunk {chunk}, which has no such record"))),
                }
            };
            self.tail = Some(Tail { chunk, base, keep, bytes: Vec::new(), fragments: Vec::new() });
        }
        let t = self.tail.as_mut().expect("set above");
        t.bytes.extend_from_slice(payload);
        t.fragments.push(rec);
        self.live_record_bytes += rec.bytes();
        Ok(())
    }

    /// Cut or extend the decoded size; chunks past the end are dropped.
    /// Grow the size to `size` without adding records: the chunks past the old end have no
    /// data (the caller marks them lost).
    pub fn extend_without_data(&mut self, size: u64) {
        if size > self.size {
            self.size = size;
        }
    }

    fn set_size(&mut self, size: u64) {
        self.size = size;
        let chunks = self.chunks();
        let displaced = self.map.truncate(chunks);
        self.release(displaced);
        self.drop_tail_within(chunks, u64::MAX);
    }

    fn drop_tail_within(&mut self, start: u64, end: u64) {
        if let Some(t) = self.tail.take_if(|t| (start..end).contains(&t.chunk)) {
            self.release_tail(t);
        }
    }

    fn release_tail(&mut self, t: Tail) {
        if let Some(base) = t.base {
            self.release(vec![(base, 1)]);
        }
        for f in t.fragments {
            self.live_record_bytes -= f.bytes();
        }
    }

    /// Account for chunks that stopped using their records.
    fn release(&mut self, displaced: Displaced) {
        for (rec, chunks) in displaced {
            let now_dead = match rec.kind {
                Kind::Run => {
                    let refs = self.run_refs.get_mut(&rec.off).expect("every run record is counted");
                    *refs -= chunks;
                    *refs == 0
                }
                _ => true,
            };
            if now_dead {
                self.run_refs.remove(&rec.off);
                self.live_record_bytes -= rec.bytes();
            }
        }
    }

    /// Follow records that compaction moved (old offset → new offset).
    pub fn relocate(&mut self, moved: &HashMap<u64, u64>) {
        self.map.relocate(moved);
        self.run_refs = self.run_refs.drain().map(|(off, n)| (moved.get(&off).copied().unwrap_or(off), n)).collect();
        if let Some(t) = &mut self.tail {
            for r in t.base.iter_mut().chain(t.fragments.iter_mut()) {
                if let Some(to) = moved.get(&r.off) {
                    r.off = *to;
                }
            }
        }
    }

    /// Every live record once, in log order (what compaction must keep).
    pub fn live_records(&self) -> Vec<RecordRef> {
        let mut seen = std::collections::HashSet::new();
        let mut all: Vec<RecordRef> = self.map.iter().map(|(_, _, r)| r).filter(|r| seen.insert(r.off)).collect();
        if let Some(t) = &self.tail {
            all.extend(t.base.iter().copied().filter(|r| seen.insert(r.off)));
            all.extend(t.fragments.iter().copied());
        }
        all.sort_by_key(|r| r.off);
        all
    }

    /// Check the index against itself and the lower file (Fast Indexing §5: offsets, entry
    /// count, size, flags). `Err` names the first inconsistency.
    pub fn validate(&self, lower_len: u64) -> Result<(), Error> {
        let cs = self.chunk_bytes();
        let chunks = self.chunks();
        if lower_len == 0 {
            // An empty lower file is an empty upper file.
            return match self.size == 0 && self.map.is_empty() && self.tail.is_none() {
                true => Ok(()),
                false => Err(Error::index(format!("the lower file is empty but the index says {} bytes", self.size))),
            };
        }
        if self.log_end > lower_len {
            return Err(Error::index(format!("the log ends at {} but the lower file has only {lower_len} bytes", self.log_end)));
        }
        let tail_chunk = self.tail.as_ref().map(|t| t.chunk);
        if let Some(t) = &self.tail {
            if t.chunk + 1 != chunks {
                return Err(Error::index(format!("the fast tail is chunk {} but the file has {chunks} chunks", t.chunk)));
            }
            if t.len() < self.chunk_len(t.chunk) || t.len() >= cs {
                return Err(Error::index(format!("the fast tail holds {} bytes for a last chunk of {}", t.len(), self.chunk_len(t.chunk))));
            }
            if let Some(b) = t.base.filter(|b| b.decoded_len < t.keep) {
                return Err(Error::index(format!("the fast tail keeps {} bytes of a record of {}", t.keep, b.decoded_len)));
            }
        }
        let expected = chunks - u64::from(tail_chunk.is_some());
        if self.map.mapped() != expected || self.map.end() > expected {
            return Err(Error::index(format!("the index maps {} chunks; the size {} needs {expected}", self.map.mapped(), self.size)));
        }
        for (first, count, rec) in self.map.iter() {
            let last = first + count - 1;
            let needed = if last + 1 == chunks { self.chunk_len(last) } else { cs };
            let short_inside = count > 1 && u64::from(rec.decoded_len) != cs;
            if u64::from(rec.decoded_len) < needed || short_inside {
                return Err(Error::index(format!("chunk {last} decodes to {} bytes but needs {needed}", rec.decoded_len)));
            }
        }
        let mut records = self.live_records();
        if let Some(c) = self.checkpoint {
            records.push(RecordRef { off: c.off, seq: c.seq, kind: Kind::Index, raw: false, payload_len: 0, decoded_len: 0 });
            records.sort_by_key(|r| r.off);
        }
        let mut prev_end = DATA_START;
        for r in &records {
            let bytes = if r.kind == Kind::Index { self.checkpoint.map_or(0, |c| c.bytes) } else { r.bytes() };
            if r.off < prev_end || r.off % 8 != 0 {
                return Err(Error::index(format!("record at {} overlaps the one before it", r.off)));
            }
            if r.seq >= self.next_seq {
                return Err(Error::index(format!("record at {} has sequence number {} beyond the log's {}", r.off, r.seq, self.next_seq)));
            }
            prev_end = r.off + bytes;
        }
        if prev_end > self.log_end {
            return Err(Error::index(format!("a record ends at {prev_end}, past the end of the log at {}", self.log_end)));
        }
        Ok(())
    }

    // The checkpoint payload: varints, offsets and sequence numbers as deltas from what a
    // sequentially written file would have, so a typical entry takes about 8 bytes.

    pub fn checkpoint_payload(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.map.mapped().min(1 << 20) as usize * 8);
        varint::put(&mut out, 1); // payload version
        varint::put(&mut out, self.size);
        let extents: Vec<_> = self.map.iter().collect();
        varint::put(&mut out, extents.len() as u64);
        let mut prev = Prev::default();
        for (first, count, rec) in extents {
            varint::put(&mut out, first - prev.chunk_end);
            varint::put(&mut out, count);
            prev.put_ref(&mut out, &rec);
            prev.chunk_end = first + count;
        }
        match &self.tail {
            None => out.push(0),
            Some(t) => {
                out.push(1);
                varint::put(&mut out, t.chunk);
                match &t.base {
                    Some(b) => {
                        out.push(1);
                        prev.put_ref(&mut out, b);
                    }
                    None => out.push(0),
                }
                varint::put(&mut out, t.keep.into());
                varint::put(&mut out, t.bytes.len() as u64);
                out.extend_from_slice(&t.bytes);
                varint::put(&mut out, t.fragments.len() as u64);
                for f in &t.fragments {
                    prev.put_ref(&mut out, f);
                }
            }
        }
        out
    }

    /// Rebuild an index from a checkpoint found at `off`. The records after it still have to be
    /// applied, and the result validated.
    pub fn from_checkpoint(chunk_shift: u8, off: u64, h: &RecordHeader, payload: &[u8]) -> Result<FileIndex, Error> {
        let bad = |why: &'static str| Error::Checkpoint { off, why };
        let mut ix = FileIndex::new(chunk_shift);
        let mut at = 0;
        let get = |at: &mut usize| varint::get(payload, at).ok_or_else(|| bad("truncated"));
        if get(&mut at)? != 1 {
            return Err(bad("unknown version"));
        }
        let size = get(&mut at)?;
        let extents = get(&mut at)?;
        let mut prev = Prev::default();
        for _ in 0..extents {
            let first = prev.chunk_end.checked_add(get(&mut at)?).ok_or_else(|| bad("chunk overflow"))?;
            let count = get(&mut at)?;
            let rec = prev.get_ref(payload, &mut at).ok_or_else(|| bad("bad entry"))?;
            if count == 0 || (rec.kind == Kind::Data && count != 1) || !matches!(rec.kind, Kind::Data | Kind::Run) {
                return Err(bad("bad extent"));
            }
            prev.chunk_end = first.checked_add(count).ok_or_else(|| bad("chunk overflow"))?;
            if !ix.map.set(first, count, rec).is_empty() {
                return Err(bad("extents overlap"));
            }
            ix.count_live(&rec, count);
        }
        match payload.get(at) {
            Some(0) => at += 1,
            Some(1) => {
                at += 1;
                let chunk = get(&mut at)?;
                let base = match payload.get(at) {
                    Some(0) => {
                        at += 1;
                        None
                    }
                    Some(1) => {
                        at += 1;
                        let b = prev.get_ref(payload, &mut at).ok_or_else(|| bad("bad tail base"))?;
                        ix.count_live(&b, 1);
                        Some(b)
                    }
                    _ => return Err(bad("bad tail")),
                };
                let keep = u32::try_from(get(&mut at)?).map_err(|_| bad("bad tail"))?;
                let len = get(&mut at)? as usize;
                let bytes = payload.get(at..at + len).ok_or_else(|| bad("truncated tail"))?.to_vec();
                at += len;
                let n = get(&mut at)?;
                let mut fragments = Vec::new();
                for _ in 0..n {
                    let f = prev.get_ref(payload, &mut at).ok_or_else(|| bad("bad tail fragment"))?;
                    if f.kind != Kind::Tail {
                        return Err(bad("bad tail fragment"));
                    }
                    ix.live_record_bytes += f.bytes();
                    fragments.push(f);
                }
                ix.tail = Some(Tail { chunk, base, keep, bytes, fragments });
            }
            _ => return Err(bad("truncated")),
        }
        if at != payload.len() {
            return Err(bad("trailing bytes"));
        }
        ix.size = size;
        if size != h.file_size {
            return Err(bad("its size disagrees with its header"));
        }
        ix.next_seq = h.seq + 1;
        ix.log_end = off + h.bytes();
        ix.checkpoint = Some(Checkpoint { off, seq: h.seq, bytes: h.bytes() });
        Ok(ix)
    }

    fn count_live(&mut self, rec: &RecordRef, chunks: u64) {
        if rec.kind == Kind::Run {
            let refs = self.run_refs.entry(rec.off).or_insert(0);
            if *refs == 0 {
                self.live_record_bytes += rec.bytes();
            }
            *refs += chunks;
        } else {
            self.live_record_bytes += rec.bytes();
        }
    }
}

/// Delta state of the checkpoint encoding.
#[derive(Default)]
struct Prev {
    chunk_end: u64,
    off_end: u64,
    seq: u64,
}

impl Prev {
    fn put_ref(&mut self, out: &mut Vec<u8>, r: &RecordRef) {
        let expected_off = self.off_end.max(DATA_START);
        out.push(r.kind as u8 | if r.raw { 0x80 } else { 0 });
        varint::put_signed(out, r.off as i64 - expected_off as i64);
        varint::put_signed(out, r.seq as i64 - self.seq as i64);
        varint::put(out, r.payload_len.into());
        varint::put(out, r.decoded_len.into());
        self.off_end = r.end();
        self.seq = r.seq;
    }

    fn get_ref(&mut self, input: &[u8], at: &mut usize) -> Option<RecordRef> {
        let tag = *input.get(*at)?;
        *at += 1;
        let kind = match tag & 0x7f {
            1 => Kind::Data,
            2 => Kind::Run,
            3 => Kind::Tail,
            _ => return None,
        };
        let expected_off = self.off_end.max(DATA_START);
        let off = u64::try_from(expected_off as i64 + varint::get_signed(input, at)?).ok()?;
        let seq = u64::try_from(self.seq as i64 + varint::get_signed(input, at)?).ok()?;
        let payload_len = u32::try_from(varint::get(input, at)?).ok()?;
        let decoded_len = u32::try_from(varint::get(input, at)?).ok()?;
        let r = RecordRef { off, seq, kind, raw: tag & 0x80 != 0, payload_len, decoded_len };
        self.off_end = off + record_bytes(payload_len);
        self.seq = seq;
        Some(r)
    }
}
