//! Compaction: the live records moved together at the front of the log and the dead space after
//! them cut off, with every live record intact somewhere at every moment.

use std::collections::HashMap;

use plyfs_stack::shared::LockKind;
use plyfs_stack::{Error, Result};
use serde_json::{json, Value};

use crate::chunkmap::RecordRef;
use crate::format::{record_bytes, DATA_START};

use super::{LowerIo, ScaFile, IO_WINDOW_BYTES};

/// Compaction runs once dead space exceeds both the live bytes and this much, so that small
/// files do not pay its fsyncs for every few appends.
pub const COMPACT_SLACK_BYTES: u64 = 64 << 10;

impl<L: LowerIo> ScaFile<L> {
    /// Compact when dead space exceeds both the live bytes and the slack.
    pub(super) fn compact_if_due(&mut self) -> Result<()> {
        if self.ix.dead_bytes() > self.ix.live_bytes().max(COMPACT_SLACK_BYTES) {
            self.compact_now()?;
        }
        Ok(())
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
}
