//! Self-protected extents: allocating, deallocating and resizing an extent that holds its own
//! capabilities in a header sector.

use crate::disk::{Aligned, SECTOR};
use crate::object::{Cap, Caps, ExtentHeader};

use super::{err, io_err, Access, Cached, Core, Obj, Persistence, Result};

impl Core {
    /// EXTENT_ALLOCATE: `sectors` sectors from `at` (the first holds the header).
    pub fn extent_allocate(&mut self, at: u64, sectors: u64, caps: Caps, persistence: Persistence) -> Result<()> {
        if sectors < 2 {
            return err(libc::EINVAL, "an extent needs a header sector and at least one data sector");
        }
        if caps.read == 0 || caps.write == 0 {
            return err(libc::EINVAL, "capabilities must not be 0");
        }
        self.check_free(at, sectors)?;
        self.forget_data(at + 1, sectors - 1)?;
        self.mark(at, sectors, true);
        self.clock += 1;
        let obj = Obj::Extent(ExtentHeader { sectors, caps, model: persistence.code() });
        self.cache.insert(at, Cached { obj, persistence, on_disk: false, dirty: true, used: self.clock, stale_frees: Vec::new() });
        self.persist(at, false)
    }

    pub(super) fn extent(&mut self, at: u64, cap: Cap, want: Access) -> Result<ExtentHeader> {
        self.load(at)?;
        match &self.cache[&at].obj {
            Obj::Extent(h) => {
                let h = h.clone();
                Self::check_cap(&h.caps, cap, want, &format!("the extent at {at}"))?;
                Ok(h)
            }
            Obj::Exonode(_) => err(libc::EINVAL, format!("sector {at}: an exonode, not an extent")),
        }
    }

    /// EXTENT_DEALLOCATE.
    pub fn extent_deallocate(&mut self, at: u64, wcap: Cap) -> Result<()> {
        let h = self.extent(at, wcap, Access::Write)?;
        let stale_frees = std::mem::take(&mut self.cache.get_mut(&at).expect("cached").stale_frees);
        self.drop_record(at, 1)?;
        for (start, sectors) in stale_frees {
            self.mark(start, sectors, false);
        }
        self.release(at, at, h.sectors, true)
    }

    /// Overwrite the record at `at` (if it was ever written) and forget it.
    pub(super) fn drop_record(&mut self, at: u64, sectors: u32) -> Result<()> {
        let c = self.cache.remove(&at).expect("cached");
        if c.on_disk {
            self.disk.write(at, &Aligned::zeroed(sectors as usize * SECTOR)).map_err(io_err)?;
            self.settle()?;
        }
        Ok(())
    }

    /// EXTENT_GROW (by `by` sectors, which must be free) and EXTENT_SHRINK (by `-by`).
    pub fn extent_resize(&mut self, at: u64, wcap: Cap, by: i64) -> Result<u64> {
        let h = self.extent(at, wcap, Access::Write)?;
        let new = h.sectors as i64 + by;
        if new < 2 {
            return err(libc::EINVAL, format!("the extent at {at}: cannot shrink below one data sector"));
        }
        let new = new as u64;
        if by > 0 {
            self.check_free(at + h.sectors, by as u64)?;
            self.forget_data(at + h.sectors, by as u64)?;
            self.mark(at + h.sectors, by as u64, true);
        }
        if let Obj::Extent(e) = &mut self.cache.get_mut(&at).expect("cached").obj {
            e.sectors = new;
        }
        self.cache.get_mut(&at).expect("cached").dirty = true;
        self.persist(at, false)?;
        if by < 0 {
            let persistent = self.persistence(at) != Persistence::Memory;
            self.release(at, at + new, (-by) as u64, persistent)?;
        }
        Ok(new)
    }
}
