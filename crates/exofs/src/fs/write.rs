//! Writing a file's bytes and setting its size: held in memory (in its inode) while small,
//! spilled into extents and written through once large.

use plyfs_exodisk::core::Persistence;
use plyfs_stack::Result;

use super::extents::SectorRun;
use super::sectors::sectors_spanning;
use super::{Fs, Node, State, BUFFER_MAX, BUFFER_TOTAL, IMMEDIATE_MAX, SECTOR};

impl Fs {
    /// Write `data` at `off`.
    pub fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<()> {
        let mut st = self.lock();
        let grew = data.len() as u64 + off > self.node(&mut st, ino)?.attrs.size;
        self.with_room(&mut st, |st| self.write_at(st, ino, off, data))?;
        self.settle(&mut st, ino, grew)
    }

    /// Replace the whole content of `ino` with `bytes`.
    pub(super) fn set_content(&self, st: &mut State, ino: u64, bytes: &[u8]) -> Result<()> {
        self.truncate_at(st, ino, 0)?;
        self.write_at(st, ino, 0, bytes)
    }

    pub(super) fn write_at(&self, st: &mut State, ino: u64, off: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        Self::forget_ahead(st, ino);
        if self.node(st, ino)?.segs.is_some() {
            return self.write_segmented(st, ino, off, data);
        }
        let end = off + data.len() as u64;
        let n = self.node(st, ino)?;
        let size = n.attrs.size.max(end);
        if Self::may_buffer(st, st.nodes.get(&ino).expect("loaded"), size) {
            self.reserve(st, ino, end as usize)?;
            self.edit_immediate(st, ino, |imm| {
                if imm.len() < end as usize {
                    imm.resize(end as usize, 0);
                }
                imm[off as usize..end as usize].copy_from_slice(data);
            })?;
            let n = self.node(st, ino)?;
            n.attrs.size = size;
            return Ok(());
        }
        // Out of memory: the bytes held go first, into extents of their own.
        self.spill(st, ino)?;
        let old = self.node(st, ino)?.attrs.size;
        if off > old {
            self.zero_past_end(st, ino, old, off)?;
        }
        self.write_store(st, ino, off, data)?;
        let n = self.node(st, ino)?;
        n.attrs.size = size;
        n.dirty = true;
        Ok(())
    }

    /// Write `data` at byte `off` of the extents (the file itself, or the store of a file in
    /// pieces), giving holes extents of their own.
    pub(super) fn write_store(&self, st: &mut State, ino: u64, off: u64, data: &[u8]) -> Result<()> {
        let end = off + data.len() as u64;
        let (s0, s1) = sectors_spanning(off, end);
        if off.is_multiple_of(SECTOR) && end.is_multiple_of(SECTOR) {
            // Whole sectors: written as they are.
            let added = self.cover(st, ino, s0, s1)?;
            let node = self.node(st, ino)?.shape();
            if let Err(e) = self.write_sectors(&node, s0, data) {
                self.uncover(st, ino, &added);
                return Err(e);
            }
            self.node(st, ino)?.dirty = true;
            return Ok(());
        }
        // What was there before (for partial sectors), then the new extents.
        let before = self.node(st, ino)?.shape();
        let mut buf = vec![0u8; ((s1 - s0) * SECTOR) as usize];
        if !off.is_multiple_of(SECTOR) {
            self.read_sectors(&before, s0, &mut buf[..SECTOR as usize])?;
        }
        if !end.is_multiple_of(SECTOR) && (s1 - 1 > s0 || off.is_multiple_of(SECTOR)) {
            let last = buf.len() - SECTOR as usize;
            self.read_sectors(&before, s1 - 1, &mut buf[last..])?;
        }
        let skip = (off - s0 * SECTOR) as usize;
        buf[skip..skip + data.len()].copy_from_slice(data);
        let added = self.cover(st, ino, s0, s1)?;
        let node = self.node(st, ino)?.shape();
        if let Err(e) = self.write_sectors(&node, s0, &buf) {
            self.uncover(st, ino, &added);
            return Err(e);
        }
        self.node(st, ino)?.dirty = true;
        Ok(())
    }

    /// Change the bytes held in the inode (in memory; stored at write-back).
    pub(super) fn edit_immediate(&self, st: &mut State, ino: u64, edit: impl FnOnce(&mut Vec<u8>)) -> Result<()> {
        let n = self.node(st, ino)?;
        let old = n.immediate.len();
        edit(&mut n.immediate);
        let new = n.immediate.len();
        n.imm_dirty = true;
        n.dirty = true;
        st.buffered = st.buffered + new - old;
        Self::note_placed(st, ino);
        Ok(())
    }

    /// Whether `ino`'s content may be held in memory at `size` bytes.
    pub(super) fn may_buffer(st: &State, n: &Node, size: u64) -> bool {
        if matches!(Self::model(n), Some(Persistence::Data | Persistence::Metadata)) {
            return size as usize <= IMMEDIATE_MAX && n.extents.is_empty();
        }
        let limit = if st.buffered + size as usize <= BUFFER_TOTAL + n.immediate.len() { BUFFER_MAX } else { IMMEDIATE_MAX };
        n.extents.is_empty() && size as usize <= limit
    }

    /// Give a file whose bytes are held in memory extents for them and write them there now.
    /// On a failure the bytes stay in memory, and the file without extents.
    pub(super) fn spill(&self, st: &mut State, ino: u64) -> Result<()> {
        let n = self.node(st, ino)?;
        if !n.extents.is_empty() || n.immediate.is_empty() {
            return Ok(());
        }
        let imm = n.immediate.clone();
        let old = n.attrs.size;
        // The room kept for these bytes is theirs to take now.
        if let Some(r) = st.reserved.remove(&ino) {
            st.reserved_total -= r;
        }
        let added = match self.cover(st, ino, 0, (imm.len() as u64).div_ceil(SECTOR)) {
            Ok(a) => a,
            Err(e) => {
                Self::note_placed(st, ino);
                return Err(e);
            }
        };
        let mut buf = imm;
        buf.resize(buf.len().div_ceil(SECTOR as usize) * SECTOR as usize, 0);
        let node = self.node(st, ino)?.shape();
        if let Err(e) = self.write_sectors(&node, 0, &buf) {
            self.uncover(st, ino, &added);
            Self::note_placed(st, ino);
            return Err(e);
        }
        self.edit_immediate(st, ino, |b| *b = Vec::new())?;
        self.node(st, ino)?.attrs.size = old;
        Ok(())
    }

    /// A plain file grows from `from` to `to` bytes without those bytes being written: what its
    /// extents hold there (room taken ahead by appends, never written) is zeroed.
    fn zero_past_end(&self, st: &mut State, ino: u64, from: u64, to: u64) -> Result<()> {
        let shape = self.node(st, ino)?.shape();
        let end = shape.extents.iter().map(|e| (e.logical + e.sectors) * SECTOR).max().unwrap_or(0);
        let to = to.min(end);
        if from >= to {
            return Ok(());
        }
        let (s0, s1) = sectors_spanning(from, to);
        for SectorRun { file_sector: at, sectors: len, on_volume } in shape.sector_runs(s0, s1) {
            if on_volume.is_none() {
                continue;
            }
            // Whole sectors, keeping the bytes before `from` in the first one.
            let mut buf = vec![0u8; (len * SECTOR) as usize];
            if at * SECTOR < from {
                self.read_sectors(&shape, at, &mut buf[..SECTOR as usize])?;
                buf[(from - at * SECTOR) as usize..SECTOR as usize].fill(0);
            }
            for chunk in 0..len.div_ceil(2048) {
                let (c0, c1) = (chunk * 2048, (chunk * 2048 + 2048).min(len));
                self.write_sectors(&shape, at + c0, &buf[(c0 * SECTOR) as usize..(c1 * SECTOR) as usize])?;
            }
        }
        Ok(())
    }

    /// Set the size of `ino`.
    pub fn truncate(&self, ino: u64, size: u64) -> Result<()> {
        let mut st = self.lock();
        self.with_room(&mut st, |st| self.truncate_at(st, ino, size))?;
        self.settle(&mut st, ino, true)
    }

    pub(super) fn truncate_at(&self, st: &mut State, ino: u64, size: u64) -> Result<()> {
        Self::forget_ahead(st, ino);
        if self.node(st, ino)?.segs.is_some() {
            return self.truncate_segmented(st, ino, size);
        }
        let n = self.node(st, ino)?;
        if size >= n.attrs.size {
            // Longer: a hole (immediate data is zero-filled in place).
            if Self::may_buffer(st, st.nodes.get(&ino).expect("loaded"), size) {
                self.reserve(st, ino, size as usize)?;
                self.edit_immediate(st, ino, |imm| imm.resize(size as usize, 0))?;
            } else {
                // Move the bytes out first, as a write does.
                self.spill(st, ino)?;
                let old = self.node(st, ino)?.attrs.size;
                self.zero_past_end(st, ino, old, size)?;
            }
            let node = self.node(st, ino)?;
            node.attrs.size = size;
            node.dirty = true;
            return Ok(());
        }
        if n.extents.is_empty() {
            self.edit_immediate(st, ino, |imm| imm.truncate(size as usize))?;
            let node = self.node(st, ino)?;
            node.attrs.size = size;
            node.dirty = true;
            return Ok(());
        }
        // Extents wholly past the end go; one that straddles it is split there; the rest of the
        // last sector kept is zeroed (so that a later extension reads zeros).
        self.free_store(st, ino, size.div_ceil(SECTOR), u64::MAX)?;
        let node = self.node(st, ino)?;
        node.attrs.size = size;
        node.dirty = true;
        node.map_dirty = true;
        let node = node.shape();
        if !size.is_multiple_of(SECTOR) {
            let s = size / SECTOR;
            if node.sector_runs(s, s + 1)[0].on_volume.is_some() {
                let mut buf = vec![0u8; SECTOR as usize];
                self.read_sectors(&node, s, &mut buf)?;
                buf[(size % SECTOR) as usize..].fill(0);
                self.write_sectors(&node, s, &buf)?;
            }
        }
        Ok(())
    }
}
