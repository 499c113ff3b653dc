//! Making the file durable: `fsync`, and at the last close a checkpoint when many records
//! followed the last one.

use plyfs_stack::shared::LockKind;
use plyfs_stack::Result;

use super::{LowerIo, ScaFile};

/// A checkpoint is written at close once this many records followed the last one.
const CHECKPOINT_EVERY_RECORDS: u64 = 32;

impl<L: LowerIo> ScaFile<L> {
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
}
