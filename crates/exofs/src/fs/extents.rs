//! The extent map: where a file's sectors are on the volume, reading and writing whole
//! sectors there, and giving holes extents (or taking them away). An extent is in the inode
//! while it has room, in the inode's holder after that.

use plyfs_exodisk::core::Target;
use plyfs_exodisk::object::Exonode;
use plyfs_stack::{Error, Result};

use super::{exo, Ext, Fs, Piece, Shape, State, CHUNK_SECTORS, HOLDER_SECTORS, INODE_SECTORS, MAX_EXTENT_SECTORS, PREALLOC_SECTORS, SECTOR};

impl Fs {
    /// The pieces of file sectors `s0..s1`: (file sector, count, volume sector or `None` for a
    /// hole).
    pub(super) fn pieces(n: &Shape, s0: u64, s1: u64) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut at = s0;
        for e in &n.extents {
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
                out.push((at, lo - at, None));
                at = lo;
            }
            let end = hi.min(s1);
            out.push((at, end - at, Some((e.start + (at - lo), e.held))));
            at = end;
        }
        if at < s1 {
            out.push((at, s1 - at, None));
        }
        out
    }

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
        let entry = self.client.add_extent(&self.extent_home(&shape, held), self.caps.write, None, start, sectors).map_err(exo)?;
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
        for (at, len, disk) in Self::pieces(n, first, first + count) {
            let range = ((at - first) * SECTOR) as usize..((at - first + len) * SECTOR) as usize;
            match disk {
                Some((d, held)) => self.client.read(&self.extent_home(n, held), self.caps.read, d, &mut buf[range]).map_err(exo)?,
                None => buf[range].fill(0),
            }
        }
        Ok(())
    }

    /// Write `data` (whole sectors) at file sector `first`; every sector must be covered.
    pub(super) fn write_sectors(&self, n: &Shape, first: u64, data: &[u8]) -> Result<()> {
        let count = data.len() as u64 / SECTOR;
        for (at, len, disk) in Self::pieces(n, first, first + count) {
            let range = ((at - first) * SECTOR) as usize..((at - first + len) * SECTOR) as usize;
            match disk {
                Some((d, held)) => self.client.write(&self.extent_home(n, held), self.caps.write, d, &data[range]).map_err(exo)?,
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
                tracing::warn!("exofs: inode {ino}: sectors {at}..{} left allocated after a failed write: {e:?}", at + n);
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
            (s0, (s1.max(s0 + ahead)).div_ceil(8) * 8)
        } else if s0 >= last {
            (s0, s1.div_ceil(8) * 8)
        } else {
            (s0 / CHUNK_SECTORS * CHUNK_SECTORS, s1.div_ceil(CHUNK_SECTORS) * CHUNK_SECTORS)
        };
        let holes: Vec<(u64, u64)> = Self::pieces(&node, c0, c1).into_iter().filter(|p| p.2.is_none()).map(|p| (p.0, p.1)).collect();
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
                        self.client.write(&t, self.caps.write, start + (from - at), &zeros).map_err(exo)?;
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
                middle = self.client.split(&t, w, e.entry, lo - l, None).map_err(exo)?;
                kept.push(Ext { sectors: lo - l, ..e });
            }
            if hi < h {
                let tail = self.client.split(&t, w, middle, hi - lo, None).map_err(exo)?;
                kept.push(Ext { entry: tail, start: e.start + (hi - l), sectors: h - hi, logical: hi, held: e.held });
            }
            self.client.remove_entry(&t, w, middle).map_err(exo)?;
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
