//! The free map: one bit per sector, set when allocated (thesis §2.2.4).
//!
//! It is conservative: a sector is marked allocated when it is allocated, and marked free only
//! once the metadata write that gives it up is on disk. So after a crash the map may claim
//! sectors nobody owns, never the reverse; the start-up scan gives those back. On disk it is a
//! row of sealed blocks, so an edit made offline is detected (and the scan rebuilds the map).

use std::io;

use crate::disk::{Aligned, Disk, SECTOR};
use crate::layout::{Superblock, BITS_PER_BLOCK, MAP_BLOCK};
use crate::seal::{self, body_len, VolumeKey};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreeMap {
    words: Vec<u64>,
    sectors: u64,
    /// Sectors allocated (kept as bits change, so that asking costs nothing).
    used: u64,
}

impl FreeMap {
    /// All free.
    pub fn new(sectors: u64) -> FreeMap {
        FreeMap { words: vec![0; sectors.div_ceil(64) as usize], sectors, used: 0 }
    }

    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    pub fn is_allocated(&self, s: u64) -> bool {
        s >= self.sectors || self.words[(s / 64) as usize] & (1 << (s % 64)) != 0
    }

    /// Whether every sector of `start..start + len` is free (and on the volume).
    pub fn is_free(&self, start: u64, len: u64) -> bool {
        start.checked_add(len).is_some_and(|end| end <= self.sectors) && (start..start + len).all(|s| !self.is_allocated(s))
    }

    /// Mark `start..start + len` allocated or free.
    pub fn set(&mut self, start: u64, len: u64, allocated: bool) {
        for s in start..start.saturating_add(len).min(self.sectors) {
            let (w, b) = ((s / 64) as usize, s % 64);
            let was = self.words[w];
            if allocated {
                self.words[w] |= 1 << b;
            } else {
                self.words[w] &= !(1 << b);
            }
            self.used = self.used + self.words[w].count_ones() as u64 - was.count_ones() as u64;
        }
    }

    pub fn allocated(&self) -> u64 {
        self.used
    }

    /// The first run of `len` free sectors at or after `near` (wrapping round), if any.
    pub fn find_free(&self, len: u64, near: u64) -> Option<u64> {
        if len == 0 || len > self.sectors {
            return None;
        }
        let scan = |from: u64, to: u64| -> Option<u64> {
            let mut run = 0;
            let mut s = from;
            while s < to {
                // Whole allocated words are skipped at once.
                if s.is_multiple_of(64) && self.words[(s / 64) as usize] == u64::MAX {
                    run = 0;
                    s += 64;
                    continue;
                }
                if self.is_allocated(s) {
                    run = 0;
                } else {
                    run += 1;
                    if run == len {
                        return Some(s + 1 - len);
                    }
                }
                s += 1;
            }
            None
        };
        let near = near.min(self.sectors);
        scan(near, self.sectors).or_else(|| scan(0, (near + len).min(self.sectors)))
    }

    /// The whole map as bytes, sector `s` at bit `s % 8` of byte `s / 8` (as `GET_FREE_MAP`
    /// sends it).
    pub fn to_bits(&self) -> Vec<u8> {
        let mut out: Vec<u8> = self.words.iter().flat_map(|w| w.to_le_bytes()).collect();
        out.truncate(self.sectors.div_ceil(8) as usize);
        out
    }

    /// Bytes `from..from + len` of [`FreeMap::to_bits`] (fewer at the end of the map).
    pub fn bits_range(&self, from: u64, len: u64) -> Vec<u8> {
        let end = self.sectors.div_ceil(8).min(from.saturating_add(len));
        (from..end).map(|i| self.words[(i / 8) as usize].to_le_bytes()[(i % 8) as usize]).collect()
    }

    /// A map of `sectors` sectors from [`FreeMap::to_bits`]'s bytes; `None` if too few.
    pub fn from_bits(sectors: u64, bits: &[u8]) -> Option<FreeMap> {
        if (bits.len() as u64) < sectors.div_ceil(8) {
            return None;
        }
        let mut map = FreeMap::new(sectors);
        for (i, w) in map.words.iter_mut().enumerate() {
            let mut b = [0u8; 8];
            let chunk = bits.get(i * 8..).unwrap_or(&[]);
            let n = chunk.len().min(8);
            b[..n].copy_from_slice(&chunk[..n]);
            *w = u64::from_le_bytes(b);
        }
        // Nothing past the end.
        if !sectors.is_multiple_of(64) {
            if let Some(last) = map.words.last_mut() {
                *last &= (1u64 << (sectors % 64)) - 1;
            }
        }
        map.used = map.words.iter().map(|w| w.count_ones() as u64).sum();
        Some(map)
    }

    /// The bits of block `b`, as stored.
    fn block_bytes(&self, b: u64) -> Vec<u8> {
        let mut out = vec![0u8; body_len(MAP_BLOCK)];
        let first = b * BITS_PER_BLOCK;
        for i in 0..BITS_PER_BLOCK.min(self.sectors.saturating_sub(first)) {
            if self.is_allocated(first + i) {
                out[(i / 8) as usize] |= 1 << (i % 8);
            }
        }
        out
    }

    /// Write the blocks that hold sectors `from..to` (all of them for `0..u64::MAX`).
    pub fn store_range(&self, disk: &Disk, key: &VolumeKey, sb: &Superblock, from: u64, to: u64) -> io::Result<()> {
        let first = from / BITS_PER_BLOCK;
        let last = (to.min(self.sectors).max(from + 1) - 1) / BITS_PER_BLOCK;
        for b in first..=last.min(sb.map_blocks - 1) {
            let at = sb.map_start + b * MAP_BLOCK as u64;
            disk.write(at, &Aligned::from_bytes(&key.seal(seal::FREE_MAP, at, MAP_BLOCK, &self.block_bytes(b))))?;
        }
        Ok(())
    }

    pub fn store(&self, disk: &Disk, key: &VolumeKey, sb: &Superblock) -> io::Result<()> {
        self.store_range(disk, key, sb, 0, u64::MAX)
    }

    /// Read the map. Blocks that do not open (edited offline, torn) count as all allocated,
    /// which is safe; their numbers come back for the report.
    pub fn load(disk: &Disk, key: &VolumeKey, sb: &Superblock) -> io::Result<(FreeMap, Vec<u64>)> {
        let mut map = FreeMap::new(sb.sectors);
        let mut bad = Vec::new();
        let mut buf = Aligned::zeroed(MAP_BLOCK as usize * SECTOR);
        for b in 0..sb.map_blocks {
            let at = sb.map_start + b * MAP_BLOCK as u64;
            disk.read(at, &mut buf)?;
            let first = b * BITS_PER_BLOCK;
            let n = BITS_PER_BLOCK.min(sb.sectors - first);
            match key.open(seal::FREE_MAP, at, &buf) {
                Ok(bits) => {
                    for i in 0..n {
                        if bits[(i / 8) as usize] & (1 << (i % 8)) != 0 {
                            map.set(first + i, 1, true);
                        }
                    }
                }
                Err(_) => {
                    bad.push(b);
                    map.set(first, n, true);
                }
            }
        }
        Ok((map, bad))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_found_and_set() {
        let mut m = FreeMap::new(1000);
        m.set(0, 100, true);
        assert_eq!(m.find_free(10, 0), Some(100));
        m.set(105, 1, true);
        assert_eq!(m.find_free(10, 0), Some(106));
        assert_eq!(m.find_free(5, 0), Some(100));
        assert_eq!(m.find_free(10, 995), Some(106));
        assert!(m.is_free(106, 10) && !m.is_free(104, 2) && !m.is_free(995, 10));
        assert_eq!(m.allocated(), 101);
        // The count follows bits that change, not the runs asked for.
        m.set(95, 20, true);
        m.set(90, 10, false);
        assert_eq!(m.allocated(), 90 + 15);
        assert_eq!(FreeMap::from_bits(1000, &m.to_bits()).unwrap().allocated(), 105);
        m.set(0, 1000, true);
        assert_eq!(m.allocated(), 1000);
        assert_eq!(m.find_free(1, 0), None);
    }

    #[test]
    fn the_map_as_bytes_round_trips() {
        let mut m = FreeMap::new(1001);
        for s in [0, 7, 8, 63, 64, 500, 1000] {
            m.set(s, 1, true);
        }
        let bits = m.to_bits();
        assert_eq!(bits.len(), 126);
        assert_eq!(bits[0], 0x81);
        assert_eq!(FreeMap::from_bits(1001, &bits).unwrap(), m);
        assert!(FreeMap::from_bits(1001, &bits[..125]).is_none());
        // Bits past the end are not taken for sectors.
        let mut padded = bits.clone();
        padded[125] = 0xff;
        assert_eq!(FreeMap::from_bits(1001, &padded).unwrap().allocated(), m.allocated());
        // In pages of any size, the same bytes.
        for page in [1, 7, 8, 64, 125, 200] {
            let paged: Vec<u8> = (0..bits.len() as u64).step_by(page).flat_map(|from| m.bits_range(from, page as u64)).collect();
            assert_eq!(paged, bits, "pages of {page}");
        }
        assert!(m.bits_range(126, 10).is_empty());
    }
}
