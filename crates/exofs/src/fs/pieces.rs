//! Insertion and removal in the middle (the thesis's indexed insert, §5.4.1): a file becomes
//! pieces of its store, so that bytes are put in or taken out without copying what follows.

use std::time::SystemTime;
use plyfs_stack::{Error, FileKind, Result};
use crate::format::{Inode, Seg};

use super::sectors::sectors_spanning;
use super::{Fs, Node, State, MAX_PIECES, SECTOR};

/// File bytes `file_byte..file_byte + bytes`, within one piece, and the store byte they start
/// at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PieceSpan {
    file_byte: u64,
    bytes: u64,
    store_byte: u64,
}

impl Fs {
    /// Put `data` before byte `off` of file `ino` (`off` = its size appends), moving what follows
    /// without copying it: the file becomes pieces of its store, and the new bytes a piece of
    /// their own at the store's end. The cost does not depend on the file's size.
    pub fn insert(&self, ino: u64, off: u64, data: &[u8]) -> Result<Inode> {
        let mut st = self.lock();
        Self::forget_ahead(&mut st, ino);
        let n = self.node(&mut st, ino)?;
        if n.attrs.kind != FileKind::File {
            return Err(Error::Os(if n.attrs.kind == FileKind::Dir { libc::EISDIR } else { libc::EINVAL }));
        }
        let size = n.attrs.size;
        if off > size {
            return Err(Error::Os(libc::EINVAL));
        }
        let len = data.len() as u64;
        if len > 0 {
            self.with_room(&mut st, |st| self.insert_at(st, ino, off, data, size))?;
        }
        let attrs = self.changed(&mut st, ino, size + len)?;
        self.settle(&mut st, ino, true)?;
        Ok(attrs)
    }

    /// Put `data` before byte `off` of `ino`, of `size` bytes; on a failure the file is left as
    /// it was (its bytes are written before any piece names them).
    fn insert_at(&self, st: &mut State, ino: u64, off: u64, data: &[u8], size: u64) -> Result<()> {
        let len = data.len() as u64;
        if self.node(st, ino)?.segs.is_none() && Self::may_buffer(st, st.nodes.get(&ino).expect("loaded"), size + len) {
            // Held in memory: spliced there.
            self.reserve(st, ino, (size + len) as usize)?;
            return self.edit_immediate(st, ino, |imm| {
                imm.resize(size as usize, 0);
                imm.splice(off as usize..off as usize, data.iter().copied());
            });
        }
        Self::room_for_pieces(st.nodes.get(&ino).expect("loaded"), ino)?;
        let top = self.make_pieces(st, ino)?;
        self.write_store(st, ino, top, data)?;
        let segs = self.node(st, ino)?.segs.as_mut().expect("in pieces");
        Self::cut(segs, off);
        let at = segs.partition_point(|s| s.logical < off);
        for s in &mut segs[at..] {
            s.logical += len;
        }
        segs.insert(at, Seg { logical: off, len, store: top });
        Ok(())
    }

    /// Remove bytes `off..off + len` of file `ino`, moving what follows down without copying
    /// it; the store's whole sectors no piece uses any more are freed.
    pub fn remove_range(&self, ino: u64, off: u64, len: u64) -> Result<Inode> {
        let mut st = self.lock();
        let attrs = self.remove_range_at(&mut st, ino, off, len)?;
        self.settle(&mut st, ino, true)?;
        Ok(attrs)
    }

    fn remove_range_at(&self, st: &mut State, ino: u64, off: u64, len: u64) -> Result<Inode> {
        Self::forget_ahead(st, ino);
        let n = self.node(st, ino)?;
        if n.attrs.kind != FileKind::File {
            return Err(Error::Os(if n.attrs.kind == FileKind::Dir { libc::EISDIR } else { libc::EINVAL }));
        }
        let size = n.attrs.size;
        if off > size {
            return Err(Error::Os(libc::EINVAL));
        }
        let len = len.min(size - off);
        if len == 0 {
            return Ok(n.attrs.clone());
        }
        if n.segs.is_none() && n.extents.is_empty() {
            self.edit_immediate(st, ino, |imm| {
                imm.resize(size as usize, 0);
                imm.drain(off as usize..(off + len) as usize);
            })?;
            return self.changed(st, ino, size - len);
        }
        Self::room_for_pieces(n, ino)?;
        self.make_pieces(st, ino)?;
        let segs = self.node(st, ino)?.segs.as_mut().expect("in pieces");
        Self::cut(segs, off);
        Self::cut(segs, off + len);
        let gone: Vec<Seg> = segs.iter().filter(|s| s.logical >= off && s.logical < off + len).copied().collect();
        segs.retain(|s| s.logical < off || s.logical >= off + len);
        for s in segs.iter_mut().filter(|s| s.logical >= off + len) {
            s.logical -= len;
        }
        Self::merge(segs);
        for g in gone {
            self.free_store(st, ino, g.store.div_ceil(SECTOR), (g.store + g.len) / SECTOR)?;
        }
        self.changed(st, ino, size - len)
    }

    /// Whether `n` may be cut into two more pieces.
    fn room_for_pieces(n: &Node, ino: u64) -> Result<()> {
        if n.segs.as_ref().is_some_and(|s| s.len() + 2 > MAX_PIECES) {
            tracing::warn!("exofs: inode {ino}: cut into {MAX_PIECES} pieces already; copy it to join them");
            return Err(Error::Os(libc::ENOSPC));
        }
        Ok(())
    }

    /// The new size and times of a file whose bytes moved.
    fn changed(&self, st: &mut State, ino: u64, size: u64) -> Result<Inode> {
        let n = self.node(st, ino)?;
        n.attrs.size = size;
        n.attrs.mtime = SystemTime::now();
        n.attrs.ctime = n.attrs.mtime;
        n.dirty = true;
        n.map_dirty = true;
        if size == 0 && n.segs.is_some() {
            // Nothing left: back to a plain file, every extent given back.
            n.segs = None;
            self.free_store(st, ino, 0, u64::MAX)?;
        }
        Ok(self.node(st, ino)?.attrs.clone())
    }

    /// Make `ino` a file in pieces (one piece for all of it if it was plain; bytes held in
    /// memory go to extents first). Returns the store's first byte that nothing uses, 4 KiB
    /// aligned: above every piece and every extent.
    fn make_pieces(&self, st: &mut State, ino: u64) -> Result<u64> {
        self.spill(st, ino)?;
        let n = self.node(st, ino)?;
        if n.segs.is_none() {
            let size = n.attrs.size;
            n.segs = Some(if size > 0 { vec![Seg { logical: 0, len: size, store: 0 }] } else { Vec::new() });
        }
        let extents = n.extents.iter().map(|e| (e.logical + e.sectors) * SECTOR).max().unwrap_or(0);
        let pieces = n.segs.iter().flatten().map(|s| s.store + s.len).max().unwrap_or(0);
        Ok(extents.max(pieces).div_ceil(4096) * 4096)
    }

    /// Split the piece that `at` falls inside, so that a piece starts at `at`.
    fn cut(segs: &mut Vec<Seg>, at: u64) {
        if let Some(i) = segs.iter().position(|s| s.logical < at && at < s.logical + s.len) {
            let s = segs[i];
            let head = at - s.logical;
            segs[i].len = head;
            segs.insert(i + 1, Seg { logical: at, len: s.len - head, store: store_byte(&s, at) });
        }
    }

    /// Join pieces that follow each other in the store too.
    fn merge(segs: &mut Vec<Seg>) {
        let mut out: Vec<Seg> = Vec::with_capacity(segs.len());
        for s in segs.drain(..) {
            match out.last_mut() {
                Some(l) if l.store + l.len == s.store && l.logical + l.len == s.logical => l.len += s.len,
                _ => out.push(s),
            }
        }
        *segs = out;
    }

    /// File bytes `off..end` cut where the pieces are.
    fn seg_pieces(segs: &[Seg], off: u64, end: u64) -> Vec<PieceSpan> {
        let first = segs.partition_point(|s| s.logical + s.len <= off);
        let mut out = Vec::new();
        for s in &segs[first..] {
            if s.logical >= end {
                break;
            }
            let (a, b) = (off.max(s.logical), end.min(s.logical + s.len));
            out.push(PieceSpan { file_byte: a, bytes: b - a, store_byte: store_byte(s, a) });
        }
        out
    }

    /// Store bytes `off..off + len` (holes read as zeros).
    fn read_store(&self, st: &mut State, ino: u64, off: u64, len: u64) -> Result<Vec<u8>> {
        let shape = self.node(st, ino)?.shape();
        let (s0, s1) = sectors_spanning(off, off + len);
        let mut buf = vec![0u8; ((s1 - s0) * SECTOR) as usize];
        self.read_sectors(&shape, s0, &mut buf)?;
        let skip = (off - s0 * SECTOR) as usize;
        Ok(buf[skip..skip + len as usize].to_vec())
    }

    pub(super) fn read_segmented(&self, st: &mut State, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        let n = self.node(st, ino)?;
        let end = (off + len as u64).min(n.attrs.size);
        if off >= end {
            return Ok(Vec::new());
        }
        let pieces = Self::seg_pieces(n.segs.as_deref().expect("in pieces"), off, end);
        let mut out = Vec::with_capacity((end - off) as usize);
        for PieceSpan { bytes, store_byte, .. } in pieces {
            out.extend_from_slice(&self.read_store(st, ino, store_byte, bytes)?);
        }
        Ok(out)
    }

    pub(super) fn write_segmented(&self, st: &mut State, ino: u64, off: u64, data: &[u8]) -> Result<()> {
        let end = off + data.len() as u64;
        if end > self.node(st, ino)?.attrs.size {
            self.extend_pieces(st, ino, end)?;
        }
        let n = self.node(st, ino)?;
        let pieces = Self::seg_pieces(n.segs.as_deref().expect("in pieces"), off, end);
        for PieceSpan { file_byte, bytes, store_byte } in pieces {
            let from = (file_byte - off) as usize;
            self.write_store(st, ino, store_byte, &data[from..from + bytes as usize])?;
        }
        let n = self.node(st, ino)?;
        n.attrs.size = n.attrs.size.max(end);
        n.dirty = true;
        Ok(())
    }

    /// Grow a file in pieces to `size`: its last piece grows when it is the store's last (what
    /// lies above it in the store is made to read as zeros first), otherwise a new piece takes
    /// fresh store.
    fn extend_pieces(&self, st: &mut State, ino: u64, size: u64) -> Result<()> {
        let top = self.make_pieces(st, ino)?;
        let n = self.node(st, ino)?;
        let old = n.attrs.size;
        let segs = n.segs.as_ref().expect("in pieces");
        let highest = segs.iter().map(|s| s.store + s.len).max().unwrap_or(0);
        match segs.last().copied() {
            Some(last) if last.store + last.len == highest => {
                if !highest.is_multiple_of(SECTOR) {
                    let rest = vec![0u8; (SECTOR - highest % SECTOR) as usize];
                    self.write_store(st, ino, highest, &rest)?;
                }
                self.free_store(st, ino, highest.div_ceil(SECTOR), u64::MAX)?;
                self.node(st, ino)?.segs.as_mut().expect("in pieces").last_mut().expect("last").len += size - old;
            }
            _ => self.node(st, ino)?.segs.as_mut().expect("in pieces").push(Seg { logical: old, len: size - old, store: top }),
        }
        let n = self.node(st, ino)?;
        n.attrs.size = size;
        n.map_dirty = true;
        n.dirty = true;
        Ok(())
    }

    pub(super) fn truncate_segmented(&self, st: &mut State, ino: u64, size: u64) -> Result<()> {
        let old = self.node(st, ino)?.attrs.size;
        if size > old {
            return self.extend_pieces(st, ino, size);
        }
        if size < old {
            self.remove_range_at(st, ino, size, old - size)?;
        }
        Ok(())
    }
}

/// The store byte holding `file_byte`, which lies in piece `s`.
fn store_byte(s: &Seg, file_byte: u64) -> u64 {
    s.store + (file_byte - s.logical)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Pieces following each other from file byte 0, of the given lengths and store bytes.
    fn segs_of(parts: &[(u64, u64)]) -> Vec<Seg> {
        let mut logical = 0;
        parts
            .iter()
            .map(|&(len, store)| {
                let s = Seg { logical, len, store };
                logical += len;
                s
            })
            .collect()
    }

    /// The store byte of every file byte, as the pieces say.
    fn byte_map(segs: &[Seg]) -> Vec<u64> {
        segs.iter().flat_map(|s| s.store..s.store + s.len).collect()
    }

    fn follow_each_other(segs: &[Seg]) -> bool {
        segs.first().is_none_or(|s| s.logical == 0)
            && segs.windows(2).all(|w| w[0].logical + w[0].len == w[1].logical)
            && segs.iter().all(|s| s.len > 0)
    }

    fn parts() -> impl Strategy<Value = Vec<(u64, u64)>> {
        prop::collection::vec((1u64..300, 0u64..5000), 0..12)
    }

    proptest! {
        #[test]
        fn cutting_makes_a_piece_start_there_and_moves_no_byte(parts in parts(), at in 0u64..4000) {
            let mut segs = segs_of(&parts);
            let before = byte_map(&segs);
            Fs::cut(&mut segs, at);
            prop_assert_eq!(byte_map(&segs), before.clone());
            prop_assert!(follow_each_other(&segs));
            if at > 0 && at < before.len() as u64 {
                prop_assert!(segs.iter().any(|s| s.logical == at));
            }
        }

        #[test]
        fn merging_joins_neighbours_in_the_store_and_moves_no_byte(parts in parts()) {
            let mut segs = segs_of(&parts);
            let before = byte_map(&segs);
            Fs::merge(&mut segs);
            prop_assert_eq!(byte_map(&segs), before);
            prop_assert!(follow_each_other(&segs));
            prop_assert!(segs.windows(2).all(|w| w[0].store + w[0].len != w[1].store));
        }

        #[test]
        fn the_pieces_of_a_range_map_each_byte_as_the_file_does(parts in parts(), off in 0u64..4000, len in 0u64..4000) {
            let segs = segs_of(&parts);
            let map = byte_map(&segs);
            let end = (off + len).min(map.len() as u64);
            let mut at = off;
            let mut got = Vec::new();
            for PieceSpan { file_byte, bytes, store_byte } in Fs::seg_pieces(&segs, off, end) {
                prop_assert_eq!(file_byte, at);
                prop_assert!(bytes > 0);
                got.extend(store_byte..store_byte + bytes);
                at += bytes;
            }
            let want = if off < end { map[off as usize..end as usize].to_vec() } else { Vec::new() };
            prop_assert_eq!(got, want);
        }
    }
}
