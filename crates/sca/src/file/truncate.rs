//! Setting the decoded size (Fast Indexing §4.4): on a chunk boundary, inside a chunk, inside a
//! fast tail, or past the end.

use plyfs_stack::shared::LockKind;
use plyfs_stack::Result;

use crate::chunks::{chunk_of, offset_in_chunk};
use crate::format::{Kind, RecordHeader};

use super::{Fault, LowerIo, ScaFile};

impl<L: LowerIo> ScaFile<L> {
    /// Set the decoded size (§4.4): on a chunk boundary, inside a chunk, inside a fast tail,
    /// or past the end.
    pub fn truncate(&mut self, size: u64) -> Result<()> {
        self.locked(LockKind::Exclusive, |f| f.truncate_now(size))
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

    pub(super) fn truncate_chunks(&mut self, size: u64) -> std::result::Result<(), Fault> {
        if size > self.ix.size {
            return self.extend(size);
        }
        let shift = self.ix.chunk_shift;
        let chunk = chunk_of(shift, size);
        let keep = offset_in_chunk(shift, size) as u32;
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
}
