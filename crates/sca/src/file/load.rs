//! Loading a file at open: the header, the slot in force, the checkpoint it names and the
//! records written after it, mostly from one read of the start of the lower file.

use std::borrow::Cow;

use plyfs_stack::{Error, Result};

use crate::codec::tag_name;
use crate::format::{payload_ok, FileHeader, Kind, RecordHeader, Slot, DATA_START, HEADER_PADDED, KNOWN_HEADER_FLAGS, RECORD_ALIGN, RECORD_HEADER_BYTES};
use crate::index::FileIndex;

use super::{Fault, LowerIo, ScaFile};

/// Opening reads this much from the start of the lower file in one request: for most files,
/// header, slots and every record.
const OPEN_READ_BYTES: usize = 64 << 10;

impl<L: LowerIo> ScaFile<L> {
    pub(super) fn load(&mut self) -> Result<()> {
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
            self.rebuilt_at_load = Some("it was missing".into());
            return self.rebuild(header.chunk_shift, None);
        }
        match self.load_from_checkpoint(slot, len) {
            Ok(()) => Ok(()),
            Err(Fault::Stale(why)) => {
                tracing::warn!("{}: the index is inconsistent ({why}); rebuilding it from the data", self.lower.describe());
                self.rebuilt_at_load = Some(why);
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
                FileIndex::from_checkpoint(shift, s.checkpoint_off, &h, &payload).map_err(|e| Fault::Stale(e.to_string()))?
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
                failure = Some(e.to_string());
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
        ix.validate(ix.log_end).map_err(|e| Fault::Stale(e.to_string()))?;
        self.replace_index(ix);
        Ok(())
    }

    /// Walk the records from `start`: each valid header with its payload and whether the
    /// payload checks out. Without `resync` the walk stops at the first unreadable record;
    /// with it, it searches on for the next one. Returns where the last valid record ends.
    pub(super) fn scan(
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

    pub(super) fn log_bytes(&self, off: u64, len: usize) -> Result<Cow<'_, [u8]>> {
        match self.prefetched.get(off as usize..off as usize + len) {
            Some(bytes) => Ok(Cow::Borrowed(bytes)),
            None => self.lower.read_at(off, len).map(Cow::Owned),
        }
    }
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
