//! The log: records appended to a buffer and applied to the index, written out at the end of
//! each operation; the checkpoint and the slot that let the next open find them.

use plyfs_stack::{Error, Result};

use crate::format::{begin_record, finish_record, FileHeader, Kind, RecordHeader, Slot, DATA_START, RECORD_HEADER_BYTES};

use super::{LowerIo, ScaFile, IO_WINDOW_BYTES};

/// The buffer of records to write is kept between operations up to this size.
const KEEP_BUFFER_BYTES: usize = 256 << 10;

impl<L: LowerIo> ScaFile<L> {
    /// Begin the log of a file that has none with its header, made up by the next flush.
    pub(super) fn start_file(&mut self) {
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

    pub(super) fn header_for(&self, chunk: u64, file_size: u64) -> RecordHeader {
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
    pub(super) fn append_record(&mut self, header: RecordHeader, payload: &[u8]) -> Result<()> {
        self.append_with(header, |out| {
            out.extend_from_slice(payload);
            Ok(0)
        })
    }

    /// Append a record whose payload `fill` appends to the log buffer (so that an encoder
    /// writes straight into it); `fill` returns flags to add to the header.
    pub(super) fn append_with(&mut self, header: RecordHeader, fill: impl FnOnce(&mut Vec<u8>) -> Result<u8>) -> Result<()> {
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
    pub(super) fn flush_pending(&mut self) -> Result<()> {
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

    pub(super) fn write_checkpoint(&mut self) -> Result<()> {
        if !self.header_on_disk {
            return Ok(());
        }
        let payload = self.ix.checkpoint_payload();
        let header = RecordHeader { kind: Kind::Index, ..self.header_for(0, self.ix.size) };
        self.append_record(header, &payload)?;
        self.flush_pending()?;
        self.write_slot()
    }

    pub(super) fn write_slot(&mut self) -> Result<()> {
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
}
