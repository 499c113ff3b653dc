//! The extent map: where a file's sectors are on the volume, reading and writing whole
//! sectors there, and giving holes extents (or taking them away). An extent is in the inode
//! while it has room, in the inode's holder after that.

use plyfs_exodisk::core::Target;
use plyfs_exodisk::object::Exonode;
use plyfs_stack::{Error, Result};

use super::sectors::whole_blocks;
use super::{Ext, Fs, Shape, State, CHUNK_SECTORS, HOLDER_SECTORS, INODE_SECTORS, MAX_EXTENT_SECTORS, PREALLOC_SECTORS, SECTOR};

/// File sectors `file_sector..file_sector + sectors`, and where they are on the volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SectorRun {
    pub(super) file_sector: u64,
    pub(super) sectors: u64,
    /// `None` for a hole.
    pub(super) on_volume: Option<OnVolume>,
}

/// Where a run of file sectors starts on the volume, and whether its extent is in the inode's
/// holder (rather than in the inode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct OnVolume {
    pub(super) sector: u64,
    pub(super) held: bool,
}

impl Ext {
    /// The volume sector holding `file_sector`, which lies in this extent.
    pub(super) fn volume_sector(&self, file_sector: u64) -> u64 {
        self.start + (file_sector - self.logical)
    }
}

impl Shape {
    /// File sectors `s0..s1` cut into runs, in order: each within one extent, or a hole between
    /// them.
    pub(super) fn sector_runs(&self, s0: u64, s1: u64) -> Vec<SectorRun> {
        let run = |file_sector, sectors, on_volume| SectorRun { file_sector, sectors, on_volume };
        let mut out = Vec::new();
        let mut at = s0;
        for e in &self.extents {
            if at >= s1 {
                break;
            }
            let (lo, hi) = (e.logical, e.logical + e.sectors);
            if hi <= at {
                continue;
            }
            if lo >= s1 {
                break;
            }
            if lo > at {
                out.push(run(at, lo - at, None));
                at = lo;
            }
            let end = hi.min(s1);
            out.push(run(at, end - at, Some(OnVolume { sector: e.volume_sector(at), held: e.held })));
            at = end;
        }
        if at < s1 {
            out.push(run(at, s1 - at, None));
        }
        out
    }
}

impl Fs {
    /// The exonode that holds an extent of a file: its inode, or its holder.
    pub(super) fn extent_home(&self, n: &Shape, held: bool) -> Target {
        match (held, n.holder) {
            (true, Some(h)) => self.under_root(&[n.path[0], n.path[1], h]),
            _ => self.under_root(&n.path),
        }
    }

    /// A new extent for file `ino` (sectors `start..start + sectors`, already taken in the
    /// map): in its inode while the inode has room, in its holder after that. Returns the entry
    /// and whether it is in the holder.
    fn new_extent(&self, st: &mut State, ino: u64, start: u64, sectors: u64) -> Result<(u32, bool)> {
        let n = self.node(st, ino)?;
        let in_inode = n.extents.iter().filter(|e| !e.held).count();
        let (all, pieces) = (n.extents.len(), n.segs.as_ref().map_or(0, |s| s.len()));
        // What the inode would hold: attributes, immediate bytes, its extents, and the map while
        // there is no holder; with room left for the pieces an insertion adds.
        let map_here = if n.holder.is_none() { 12 * (all + 1) + 24 * (pieces + 4) + 32 } else { 9 };
        let inode_use = 128 + n.immediate.len() + 17 * (in_inode + 1) + map_here;
        let held = n.holder.is_some() || inode_use > Exonode::capacity(INODE_SECTORS);
        if held {
            self.ensure_holder(st, ino)?;
            let n = self.node(st, ino)?;
            let in_holder = n.extents.iter().filter(|e| e.held).count();
            if 17 * (in_holder + 1) + 12 * (all + 1) + 24 * pieces + 64 > Exonode::capacity(HOLDER_SECTORS) {
                tracing::warn!("exofs: inode {ino}: too fragmented for more extents ({all})");
                return Err(Error::Os(libc::ENOSPC));
            }
        }
        let shape = self.node(st, ino)?.shape();
        let entry = self.client.add_extent(&self.extent_home(&shape, held), self.caps.write, None, start, sectors).map_err(self.exo_at(ino, "adding an extent"))?;
        let n = self.node(st, ino)?;
        n.fresh = false;
        n.map_dirty = true;
        n.holder_dirty |= held;
        Ok((entry, held))
    }

    /// Give file `ino` its holder if it has none.
    pub(super) fn ensure_holder(&self, st: &mut State, ino: u64) -> Result<()> {
        if self.node(st, ino)?.holder.is_some() {
            return Ok(());
        }
        let path = self.node(st, ino)?.path;
        let (entry, at) = self.add_exonode(st, &self.under_root(&path), HOLDER_SECTORS, ino, vec![Vec::new()])?;
        let n = self.node(st, ino)?;
        n.holder = Some((entry, at));
        (n.holder_dirty, n.map_dirty, n.dirty, n.fresh) = (true, true, true, false);
        Ok(())
    }

    /// Read file sectors from `first` into `buf` (holes are zeros).
    pub(super) fn read_sectors(&self, n: &Shape, first: u64, buf: &mut [u8]) -> Result<()> {
        let count = buf.len() as u64 / SECTOR;
        for SectorRun { file_sector: at, sectors: len, on_volume } in n.sector_runs(first, first + count) {
            let range = ((at - first) * SECTOR) as usize..((at - first + len) * SECTOR) as usize;
            match on_volume {
                Some(OnVolume { sector: d, held }) => self.client.read(&self.extent_home(n, held), self.caps.read, d, &mut buf[range]).map_err(self.exo("reading file data"))?,
                None => buf[range].fill(0),
            }
        }
        Ok(())
    }

    /// Write `data` (whole sectors) at file sector `first`; every sector must be covered.
    pub(super) fn write_sectors(&self, n: &Shape, first: u64, data: &[u8]) -> Result<()> {
        let count = data.len() as u64 / SECTOR;
        for SectorRun { file_sector: at, sectors: len, on_volume } in n.sector_runs(first, first + count) {
            let range = ((at - first) * SECTOR) as usize..((at - first + len) * SECTOR) as usize;
            match on_volume {
                Some(OnVolume { sector: d, held }) => self.client.write(&self.extent_home(n, held), self.caps.write, d, &data[range]).map_err(self.exo("writing file data"))?,
                None => return Err(Error::Corrupt(format!("exofs: writing into a hole at file sector {at}"))),
            }
        }
        Ok(())
    }

    /// Give the holes in file sectors `s0..s1` extents of their own, near what comes before:
    /// the file sectors given them, for [`uncover`](Self::uncover) if what follows fails. On a
    /// failure (the volume full) the file is left as it was.
    pub(super) fn cover(&self, st: &mut State, ino: u64, s0: u64, s1: u64) -> Result<Vec<(u64, u64)>> {
        let mut added = Vec::new();
        match self.cover_holes(st, ino, s0, s1, &mut added) {
            Ok(()) => Ok(added),
            Err(e) => {
                self.uncover(st, ino, &added);
                Err(e)
            }
        }
    }

    /// Holes again where [`cover`](Self::cover) gave extents: what they hold was never written,
    /// and must not be read as the file's.
    pub(super) fn uncover(&self, st: &mut State, ino: u64, added: &[(u64, u64)]) {
        for &(at, n) in added {
            if let Err(e) = self.free_store(st, ino, at, at + n) {
                tracing::warn!("exofs: inode {ino}: sectors {at}..{} left allocated after a failed write: {e}", at + n);
            }
        }
    }

    fn cover_holes(&self, st: &mut State, ino: u64, s0: u64, s1: u64, added: &mut Vec<(u64, u64)>) -> Result<()> {
        // The holes, widened to whole chunks (as far as the extents around them allow).
        let n = self.node(st, ino)?;
        let (plain, size) = (n.segs.is_none(), n.attrs.size);
        let node = n.shape();
        let last = node.extents.iter().map(|e| e.logical + e.sectors).max().unwrap_or(0);
        // Appending to a plain file: room for as much again as it holds (up to 8 MiB) is taken
        // with what is written, so that a file written in order needs an allocation only now
        // and then. What lies past the end is not written (nor read: growing the file zeroes
        // what it exposes, see `zero_past_end`).
        let appending = s0 >= last && plain;
        let (c0, c1) = if appending {
            let ahead = (size / SECTOR).clamp(8, PREALLOC_SECTORS);
            (s0, whole_blocks(s1.max(s0 + ahead)))
        } else if s0 >= last {
            (s0, whole_blocks(s1))
        } else {
            (s0 / CHUNK_SECTORS * CHUNK_SECTORS, s1.div_ceil(CHUNK_SECTORS) * CHUNK_SECTORS)
        };
        let holes: Vec<(u64, u64)> =
            node.sector_runs(c0, c1).into_iter().filter(|r| r.on_volume.is_none()).map(|r| (r.file_sector, r.sectors)).collect();
        for (mut at, mut len) in holes {
            // A chunk piece entirely outside what is written stays a hole.
            if at + len <= s0 || at >= s1 {
                continue;
            }
            while len > 0 {
                let n = self.node(st, ino)?.shape();
                let prev = n.extents.iter().filter(|e| e.logical + e.sectors <= at).max_by_key(|e| e.logical).copied();
                let near = prev.map_or(ino, |p| p.start + p.sectors);
                let taken = self.retrying_races(st, |st| {
                    let mut want = len.min(MAX_EXTENT_SECTORS);
                    let start = loop {
                        match self.find(st, want, near) {
                            Ok(s) => break s,
                            Err(_) if want > 8 => want = want.div_ceil(2),
                            // Only room taken ahead is left to cover: it is not needed.
                            Err(_) if at >= s1 => return Ok(None),
                            Err(e) => return Err(e),
                        }
                    };
                    match self.new_extent(st, ino, start, want) {
                        Ok((entry, held)) => {
                            Self::given(st, start, want);
                            Ok(Some((start, want, entry, held)))
                        }
                        Err(e) => {
                            Self::refused(st, start, want, &e);
                            Err(e)
                        }
                    }
                })?;
                let Some((start, want, entry, held)) = taken else { return Ok(()) };
                let n = self.node(st, ino)?.shape();
                let t = self.extent_home(&n, held);
                let mut ext = Ext { entry, start, sectors: want, logical: at, held };
                // Right after the previous extent on the volume and in the file: one extent.
                let mut merged = None;
                if let Some(p) = prev.filter(|p| p.start + p.sectors == start && p.logical + p.sectors == at && p.held == held) {
                    if self.client.combine(&t, self.caps.write, p.entry, entry).is_ok() {
                        ext = Ext { sectors: p.sectors + want, ..p };
                        merged = Some(p.entry);
                    }
                }
                let node = self.node(st, ino)?;
                if let Some(m) = merged {
                    node.extents.retain(|e| (e.entry, e.held) != (m, held));
                }
                node.extents.push(ext);
                node.extents.sort_by_key(|e| e.logical);
                node.map_dirty = true;
                node.fresh = false;
                added.push((at, want));
                // What the write will not cover reads as zeros.
                let zero = |from: u64, to: u64| -> Result<()> {
                    if from < to {
                        let zeros = vec![0u8; ((to - from) * SECTOR) as usize];
                        self.client.write(&t, self.caps.write, start + (from - at), &zeros).map_err(self.exo_at(ino, "zeroing a new extent"))?;
                    }
                    Ok(())
                };
                zero(at, s0.clamp(at, at + want))?;
                // After what is written: zeros up to the file's end (a file made longer by
                // truncate), and room taken ahead past it left as it is.
                let z0 = s1.clamp(at, at + want);
                let z1 = if appending { (at + want).min(size.div_ceil(SECTOR)).max(z0) } else { at + want };
                zero(z0, z1)?;
                at += want;
                len -= want;
            }
        }
        Ok(())
    }

    /// Free the store's sectors `s0..s1` (no piece uses them): extents inside go, extents
    /// across an end are split there.
    pub(super) fn free_store(&self, st: &mut State, ino: u64, s0: u64, s1: u64) -> Result<()> {
        if s0 >= s1 {
            return Ok(());
        }
        let shape = self.node(st, ino)?.shape();
        let w = self.caps.write;
        let mut kept = Vec::new();
        let mut held_changed = false;
        for e in shape.extents.iter().copied() {
            let (l, h) = (e.logical, e.logical + e.sectors);
            let (lo, hi) = (l.max(s0), h.min(s1));
            if lo >= hi {
                kept.push(e);
                continue;
            }
            // The part before `lo` stays as `e`; the part after `hi` becomes an extent of its own.
            let t = self.extent_home(&shape, e.held);
            held_changed |= e.held;
            let mut middle = e.entry;
            if lo > l {
                middle = self.client.split(&t, w, e.entry, lo - l, None).map_err(self.exo_at(ino, "splitting an extent"))?;
                kept.push(Ext { sectors: lo - l, ..e });
            }
            if hi < h {
                let tail = self.client.split(&t, w, middle, hi - lo, None).map_err(self.exo_at(ino, "splitting an extent"))?;
                kept.push(Ext { entry: tail, start: e.volume_sector(hi), sectors: h - hi, logical: hi, held: e.held });
            }
            self.client.remove_entry(&t, w, middle).map_err(self.exo_at(ino, "freeing part of an extent"))?;
            // The service frees these sectors only once the inode is written back (its record
            // on the disk names them until then): the map is read again after that.
            st.map_behind = true;
        }
        kept.sort_by_key(|e| e.logical);
        let n = self.node(st, ino)?;
        n.extents = kept;
        n.map_dirty = true;
        n.holder_dirty |= held_changed;
        n.fresh = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Extents in file order from (hole before, sectors, volume sector, held) each.
    fn shape_of(parts: &[(u64, u64, u64, bool)]) -> Shape {
        let mut logical = 0;
        let extents = parts
            .iter()
            .enumerate()
            .map(|(i, &(gap, sectors, start, held))| {
                logical += gap;
                let e = Ext { entry: i as u32, start, sectors, logical, held };
                logical += sectors;
                e
            })
            .collect();
        Shape { path: [1, 1], extents, holder: Some(3) }
    }

    /// Where file sector `s` is, as the extents have it.
    fn where_is(shape: &Shape, s: u64) -> Option<(u64, bool)> {
        shape.extents.iter().find(|e| e.logical <= s && s < e.logical + e.sectors).map(|e| (e.start + (s - e.logical), e.held))
    }

    proptest! {
        #[test]
        fn sector_runs_cover_the_range_and_place_each_sector_as_the_extents_do(
            parts in prop::collection::vec((0u64..40, 1u64..40, 0u64..100_000, any::<bool>()), 0..10),
            s0 in 0u64..500,
            len in 0u64..500,
        ) {
            let shape = shape_of(&parts);
            let s1 = s0 + len;
            let runs = shape.sector_runs(s0, s1);
            let mut at = s0;
            for (i, r) in runs.iter().enumerate() {
                prop_assert_eq!(r.file_sector, at);
                prop_assert!(r.sectors > 0);
                for k in 0..r.sectors {
                    let placed = r.on_volume.map(|v| (v.sector + k, v.held));
                    prop_assert_eq!(placed, where_is(&shape, at + k));
                }
                // A hole is one run, however it falls.
                if i > 0 && r.on_volume.is_none() {
                    prop_assert!(runs[i - 1].on_volume.is_some());
                }
                at += r.sectors;
            }
            prop_assert_eq!(at, s1);
        }
    }
}
