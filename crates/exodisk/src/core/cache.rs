//! The metadata cache: records brought in from the volume, and the least recently used ones
//! dropped when it is full.

use crate::disk::{Aligned, SECTOR};
use crate::object::{Exonode, ExtentHeader};

use super::{err, io_err, Cached, Core, ExoError, Obj, Persistence, Result};

impl Core {
    /// Bring the record at `at` into the cache (EXTENT_READ / EXONODE_READ).
    pub fn load(&mut self, at: u64) -> Result<()> {
        self.clock += 1;
        if let Some(c) = self.cache.get_mut(&at) {
            c.used = self.clock;
            return Ok(());
        }
        if !self.map.is_allocated(at) || at < self.sb.data_start || at >= self.sb.sectors {
            return err(libc::ENOENT, format!("sector {at}: no extent or exonode there"));
        }
        let mut first = Aligned::zeroed(SECTOR);
        self.disk.read(at, &mut first).map_err(io_err)?;
        let obj = if let Some(n) = crate::seal::record_sectors(&first, crate::seal::EXONODE) {
            if at + n as u64 > self.sb.sectors {
                return err(libc::EIO, format!("sector {at}: an exonode past the end of the volume"));
            }
            let mut whole = Aligned::zeroed(n as usize * SECTOR);
            self.disk.read(at, &mut whole).map_err(io_err)?;
            Obj::Exonode(
                Exonode::open(&self.key, at, &whole)
                    .map_err(|e| ExoError { errno: libc::EIO, msg: format!("the exonode at {at}: {e}") })?,
            )
        } else if crate::seal::record_sectors(&first, crate::seal::EXTENT).is_some() {
            Obj::Extent(
                ExtentHeader::open(&self.key, at, &first)
                    .map_err(|e| ExoError { errno: libc::EIO, msg: format!("the extent at {at}: {e}") })?,
            )
        } else {
            return err(libc::ENOENT, format!("sector {at}: no extent or exonode there"));
        };
        let persistence = Persistence::from_code(match &obj {
            Obj::Extent(h) => h.model,
            Obj::Exonode(x) => x.model,
        });
        self.cache.insert(at, Cached { obj, persistence, on_disk: true, dirty: false, used: self.clock, stale_frees: Vec::new() });
        Ok(())
    }

    /// Whether the record at `at` is cached (IN_CACHE).
    pub fn in_cache(&self, at: u64) -> bool {
        self.cache.contains_key(&at)
    }

    /// Make the record at `at` the next to be replaced (MARK_REPLACEMENT).
    pub fn mark_replacement(&mut self, at: u64) -> bool {
        match self.cache.get_mut(&at) {
            Some(c) => {
                c.used = 0;
                true
            }
            None => false,
        }
    }

    /// Drop clean records beyond `keep`, least recently used first (records of `memory`
    /// objects and dirty ones stay: they exist nowhere else).
    pub fn trim_cache(&mut self, keep: usize) {
        if self.cache.len() <= keep {
            return;
        }
        let mut clean: Vec<(u64, u64)> =
            self.cache.iter().filter(|(_, c)| !c.dirty && c.persistence != Persistence::Memory).map(|(a, c)| (c.used, *a)).collect();
        clean.sort_unstable();
        for (_, at) in clean.into_iter().take(self.cache.len() - keep) {
            self.cache.remove(&at);
        }
    }
}
