//! Sharing the file with other mounts (`-o shared`, see [`plyfs_stack::shared`]): an operation
//! runs under the lower file's lock, after catching up with what other mounts wrote, and
//! everything it changed is written before the lock is dropped.

use plyfs_stack::shared::LockKind;
use plyfs_stack::{Error, Result};

use crate::format::{FileHeader, Kind, Slot, DATA_START};
use crate::index::FileIndex;

use super::{fault_to_error, LowerIo, ScaFile};

/// What a shared file looked like the last time this mount checked it under its lock: any
/// change by another mount changes the slot in force (its sequence number only grows) or the
/// length.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Seen {
    pub(super) head: Vec<u8>,
    pub(super) len: u64,
    pub(super) at: std::time::Instant,
}

impl Seen {
    /// This mount wrote `data` at `off` (under the write lock): the start of the file follows.
    pub(super) fn wrote(&mut self, off: u64, data: &[u8]) {
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
    /// Run `op` on a file other mounts share: under the lower file's lock of `kind`, after
    /// catching up with what they wrote, and with everything `op` changed (slot included)
    /// written before the lock is dropped. A repair found needed under a read lock runs the
    /// whole again under the write lock. Without sharing, just `op`.
    pub(super) fn locked<T>(&mut self, kind: LockKind, mut op: impl FnMut(&mut Self) -> Result<T>) -> Result<T> {
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
                return Err(fault_to_error(&self.lower, e));
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
    pub(super) fn write_lower(&mut self, off: u64, data: &[u8]) -> Result<()> {
        self.lower.write_at(off, data)?;
        if let Some(seen) = &mut self.seen {
            seen.wrote(off, data);
        }
        Ok(())
    }

    /// Set the lower file's length, keeping the start of it last seen in step.
    pub(super) fn set_lower_len(&mut self, len: u64) -> Result<()> {
        self.lower.set_len(len)?;
        if let Some(seen) = &mut self.seen {
            seen.resized(len);
        }
        Ok(())
    }

    /// Whether repairs and cut logs may be written now.
    pub(super) fn may_write(&self) -> bool {
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

    /// The decoded size, checked against the lower file when it was not lately.
    pub fn current_size(&mut self) -> Result<u64> {
        if !self.is_fresh() {
            self.revalidate()?;
        }
        Ok(self.ix.size)
    }

    /// Whether another mount changed the file since the last call: the kernel's pages of it
    /// are then stale.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed_outside)
    }
}
