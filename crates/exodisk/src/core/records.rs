//! Writing metadata: sealing and persisting records, and the free map, in the order the
//! invariants above ask (the bits first when allocating, the record first when freeing).

use crate::disk::Aligned;
use crate::layout::BITS_PER_BLOCK;

use super::{err, io_err, Core, Obj, Persistence, Result};

impl Core {
    fn seal(&self, at: u64, obj: &Obj) -> Vec<u8> {
        match obj {
            Obj::Extent(h) => h.seal(&self.key, at),
            Obj::Exonode(x) => x.seal(&self.key, at),
        }
    }

    /// Write the record at `at` if its model says so now (or `force`: EXTENT_WRITE /
    /// EXONODE_WRITE), with the free-map blocks it depends on first.
    pub(super) fn persist(&mut self, at: u64, force: bool) -> Result<()> {
        let Some(c) = self.cache.get(&at) else { return Ok(()) };
        if !c.dirty || (c.persistence == Persistence::Memory && !force) {
            return Ok(());
        }
        let bytes = self.seal(at, &c.obj);
        self.flush_map()?;
        // The free-map bits and the emptied seals first, then the record (a disk may reorder
        // the writes between two flushes).
        if self.unflushed_deps {
            self.sync_disk()?;
        }
        self.disk.write(at, &Aligned::from_bytes(&bytes)).map_err(io_err)?;
        self.settle()?;
        let c = self.cache.get_mut(&at).expect("cached");
        c.dirty = false;
        c.on_disk = true;
        let freed = std::mem::take(&mut c.stale_frees);
        self.free_now(&freed)
    }

    /// Free `ranges` (in a batch, after its flush) and write the map.
    fn free_now(&mut self, ranges: &[(u64, u64)]) -> Result<()> {
        for &(start, len) in ranges {
            self.mark(start, len, false);
        }
        if !ranges.is_empty() {
            self.flush_map()?;
        }
        Ok(())
    }

    /// Write the free-map blocks changed since last time.
    pub(super) fn flush_map(&mut self) -> Result<()> {
        for b in std::mem::take(&mut self.map_dirty) {
            self.unflushed_deps = true;
            let from = b * BITS_PER_BLOCK;
            self.map.store_range(&self.disk, &self.key, &self.sb, from, from + 1).map_err(io_err)?;
        }
        Ok(())
    }

    pub(super) fn mark(&mut self, start: u64, len: u64, allocated: bool) {
        if let (false, Some(b)) = (allocated, &mut self.batch) {
            b.freed.push((start, len));
            return;
        }
        self.map.set(start, len, allocated);
        if len > 0 {
            for b in start / BITS_PER_BLOCK..=(start + len - 1) / BITS_PER_BLOCK {
                self.map_dirty.insert(b);
            }
        }
    }

    /// Sectors `start..start + len` given up by the object at `owner`: freed now if its record
    /// on the disk no longer names them (rewritten, or never written), else when it is.
    pub(super) fn release(&mut self, owner: u64, start: u64, len: u64, persistent: bool) -> Result<()> {
        if let Some(c) = self.cache.get_mut(&owner).filter(|c| c.on_disk && c.dirty) {
            c.stale_frees.push((start, len));
            return Ok(());
        }
        self.mark(start, len, false);
        if persistent {
            self.flush_map()?;
        }
        Ok(())
    }

    pub(super) fn check_free(&self, start: u64, len: u64) -> Result<()> {
        if len == 0 || start < self.sb.data_start || start.checked_add(len).is_none_or(|e| e > self.sb.sectors) {
            return err(libc::EINVAL, format!("sectors {start}..{}: not in the volume's object area", start.saturating_add(len)));
        }
        if !self.map.is_free(start, len) {
            return err(libc::EEXIST, format!("sectors {start}..{}: already allocated", start + len));
        }
        Ok(())
    }

    /// Write what is dirty and persistent, and the free map (at shutdown).
    pub fn flush(&mut self) -> Result<()> {
        let dirty: Vec<u64> =
            self.cache.iter().filter(|(_, c)| c.dirty && c.persistence != Persistence::Memory).map(|(a, _)| *a).collect();
        for at in dirty {
            self.persist(at, false)?;
        }
        self.flush_map()?;
        self.sync_disk()
    }
}
