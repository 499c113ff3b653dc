//! Write-back: what is held in memory reaches the volume in a few batched requests, ordered so
//! that an interrupted write-back never leaves a name without its record nor a record naming
//! data not yet written; and the persistence models that ask for it at once.

use std::collections::HashMap;
use plyfs_exodisk::core::{Persistence, Target};
use plyfs_exodisk::object::Exonode;
use plyfs_exodisk::proto::{wcap, Reply, Request, WTarget};
use plyfs_stack::{FileKind, Result};
use serde_bytes::ByteBuf;
use crate::format::{encode_dir, encode_map, encode_xattrs, ATTRS, IMMEDIATE, MAP};

use super::sectors::{placed_sectors, whole_blocks};
use super::{Ext, Freeing, Fs, Node, State, BATCH_NODES, HELD, HOLDER_SECTORS, IMMEDIATE_MAX, INODE_SECTORS, PERSISTENCE_XATTR, SECTOR};

impl Fs {
    /// Write back everything changed: removed inodes are deallocated; directories' entries are
    /// encoded; files held in memory get their extents and their bytes are written (all at once,
    /// so that the service orders them on the disk); then the changed inodes are written
    /// (`EXONODE_WRITE`), files first, then directories, then the tables. An interrupted
    /// write-back thus leaves only records nothing names yet (which the volume's scan gives back),
    /// never a name without its record, and never a record naming data not yet written.
    pub fn sync(&self) -> Result<()> {
        let mut st = self.lock();
        self.write_back(&mut st)
    }

    /// Write back, then give the unused inodes of the pool back: the file system is left as a
    /// clean unmount leaves it.
    pub fn close(&self) -> Result<()> {
        let mut st = self.lock();
        let pool = std::mem::take(&mut st.pool);
        st.freeing.extend(pool.into_iter().map(|(at, path)| Freeing { at, path, extents: Vec::new(), holder: None }));
        self.write_back(&mut st)
    }

    pub(super) fn write_back(&self, st: &mut State) -> Result<()> {
        st.writing_back = true;
        let done = self.retrying_races(st, |st| self.write_back_inodes(st));
        st.writing_back = false;
        done?;
        if std::mem::take(&mut st.map_behind) {
            self.reread_map(st)?;
        }
        Ok(())
    }

    /// Deallocate the inodes removed since the last write-back, with their extents and
    /// holders: the first step of a write-back.
    fn free_removed(&self, st: &mut State) -> Result<()> {
        if st.freeing.is_empty() {
            return Ok(());
        }
        let wc = wcap(self.caps.write);
        let freeing = std::mem::take(&mut st.freeing);
        // A holder goes before its inode (an exonode with descendants cannot go); the index
        // of each inode's own request tells which were done.
        let mut reqs = Vec::new();
        let mut own = Vec::new();
        for f in &freeing {
            if let Some((h, _)) = f.holder {
                let t = self.under_root(&[f.path[0], f.path[1], h]);
                reqs.push(Request::ExonodeDeallocate { target: WTarget::from(&t), wcap: wc });
            }
            own.push(reqs.len());
            reqs.push(Request::ExonodeDeallocate { target: WTarget::from(&self.under_root(&f.path)), wcap: wc });
        }
        let (done, failed) = self.client.batch(reqs);
        for (f, &i) in freeing.iter().zip(&own) {
            if i < done.len() {
                if let Some(t) = st.tables.iter_mut().find(|t| t.0 == f.path[0]) {
                    t.2 -= 1;
                }
                st.map.set(f.at, INODE_SECTORS as u64, false);
                if let Some((_, at)) = f.holder {
                    st.map.set(at, HOLDER_SECTORS as u64, false);
                }
                for e in &f.extents {
                    st.map.set(e.start, e.sectors, false);
                }
            } else {
                // Again at the next write-back (without its holder if that went).
                let holder_gone = f.holder.is_some() && i > 0 && i - 1 < done.len();
                let mut again = f.clone();
                if holder_gone {
                    // Its extents went with it.
                    st.map.set(f.holder.expect("held").1, HOLDER_SECTORS as u64, false);
                    for e in f.extents.iter().filter(|e| e.held) {
                        st.map.set(e.start, e.sectors, false);
                    }
                    again.extents.retain(|e| !e.held);
                    again.holder = None;
                }
                st.freeing.push(again);
            }
        }
        st.tables_dirty |= !done.is_empty();
        if let Some(e) = failed {
            return Err(self.exo("deallocating removed inodes")(e));
        }
        Ok(())
    }

    fn write_back_inodes(&self, st: &mut State) -> Result<()> {
        let wc = wcap(self.caps.write);
        // Removed inodes (with their extents) go first: a directory on disk still naming one
        // loses that name at its next read.
        self.free_removed(st)?;
        let mut dirty: Vec<(bool, u64)> =
            st.nodes.iter().filter(|(_, n)| n.dirty).map(|(i, n)| (n.attrs.kind == FileKind::Dir, *i)).collect();
        if dirty.is_empty() && !st.tables_dirty {
            return Ok(());
        }
        dirty.sort();
        for &(is_dir, ino) in &dirty {
            // A directory's entries first (its size is then right in the record).
            let n = st.nodes.get_mut(&ino).expect("listed");
            if is_dir && n.dir_dirty {
                let bytes = encode_dir(n.dir.as_ref().expect("a dirty directory is cached"));
                let old = n.attrs.size;
                self.write_at(st, ino, 0, &bytes)?;
                if (bytes.len() as u64) < old {
                    self.truncate_at(st, ino, bytes.len() as u64)?;
                }
                st.nodes.get_mut(&ino).expect("listed").dir_dirty = false;
            }
        }
        let big: Vec<u64> = dirty
            .iter()
            .map(|d| d.1)
            .filter(|i| st.nodes[i].extents.is_empty() && st.nodes[i].immediate.len() > IMMEDIATE_MAX)
            .collect();
        self.place_buffered(st, &big)?;
        // A map grown past what the inode holds (pieces added by removals in the middle) moves
        // to a holder.
        for &(_, ino) in &dirty {
            let n = &st.nodes[&ino];
            let map_len = 12 * n.extents.len() + n.segs.as_ref().map_or(0, |s| 24 * s.len() + 12);
            let inode_use = 128 + n.immediate.len() + 17 * n.extents.iter().filter(|e| !e.held).count() + map_len;
            if n.holder.is_none() && inode_use > Exonode::capacity(INODE_SECTORS) {
                self.ensure_holder(st, ino)?;
            }
        }
        for chunk in dirty.chunks(BATCH_NODES) {
            let mut reqs = Vec::new();
            for &(_, ino) in chunk {
                let n = &st.nodes[&ino];
                let target = WTarget::from(&self.under_root(&n.path));
                let map = || {
                    let items: Vec<(u32, u64)> =
                        n.extents.iter().map(|e| (e.entry | if e.held { HELD } else { 0 }, e.logical)).collect();
                    encode_map(&items, n.segs.as_deref())
                };
                // The holder first (a child before its parent), with the map when there is one.
                // A file of the memory model is never written: it lives in the service's memory.
                let durable = Self::model(n) != Some(Persistence::Memory);
                if let Some((h, _)) = n.holder.filter(|_| n.holder_dirty || n.map_dirty) {
                    let ht = WTarget::from(&self.under_root(&[n.path[0], n.path[1], h]));
                    reqs.push(Request::AddData { target: ht.clone(), wcap: wc, idx: Some(0), data: ByteBuf::from(map()) });
                    if durable {
                        reqs.push(Request::WriteRecord { target: ht, wcap: wc });
                    }
                }
                let data = |idx: u32, bytes: Vec<u8>| Request::AddData {
                    target: target.clone(),
                    wcap: wc,
                    idx: Some(idx),
                    data: ByteBuf::from(bytes),
                };
                let mut attrs = n.attrs.encode();
                attrs.extend_from_slice(&encode_xattrs(&n.xattrs));
                reqs.push(data(ATTRS, attrs));
                if n.imm_dirty {
                    reqs.push(data(IMMEDIATE, n.immediate.clone()));
                }
                if n.map_dirty {
                    reqs.push(data(MAP, if n.holder.is_some() { Vec::new() } else { map() }));
                }
                if durable {
                    reqs.push(Request::WriteRecord { target: target.clone(), wcap: wc });
                }
            }
            let (_, failed) = self.client.batch(reqs);
            if let Some(e) = failed {
                return Err(self.exo("writing back inodes")(e));
            }
            for &(_, ino) in chunk {
                let n = st.nodes.get_mut(&ino).expect("listed");
                (n.dirty, n.imm_dirty, n.map_dirty, n.holder_dirty, n.fresh) = (false, false, false, false, false);
            }
        }
        if st.tables_dirty {
            let reqs = st.tables.iter().map(|t| Request::WriteRecord { target: WTarget::from(&self.under_root(&[t.0])), wcap: wc }).collect();
            if let (_, Some(e)) = self.client.batch(reqs) {
                return Err(self.exo("writing back the inode tables")(e));
            }
            st.tables_dirty = false;
        }
        Ok(())
    }

    /// Extents for files whose bytes are held in memory (more than fit in an inode), near their
    /// inodes, and the bytes written there: a batch of `ADD_EXTENT` and one queue of writes.
    fn place_buffered(&self, st: &mut State, inos: &[u64]) -> Result<()> {
        if inos.is_empty() {
            return Ok(());
        }
        let wc = wcap(self.caps.write);
        // (inode, volume sector, sectors, file sector) for each new extent.
        let mut planned: Vec<(u64, u64, u64, u64)> = Vec::new();
        let mut reqs = Vec::new();
        for &ino in inos {
            let path = st.nodes[&ino].path;
            let total = placed_sectors(st.nodes[&ino].immediate.len() as u64);
            let (mut logical, mut want) = (0u64, total);
            while logical < total {
                want = want.min(total - logical);
                let start = match self.find(st, want, ino) {
                    Ok(s) => s,
                    Err(_) if want > 8 => {
                        want = whole_blocks(want / 2);
                        continue;
                    }
                    Err(e) => {
                        for p in &planned {
                            Self::unclaim(st, p.1, p.2);
                        }
                        return Err(e);
                    }
                };
                planned.push((ino, start, want, logical));
                reqs.push(Request::AddExtent { target: WTarget::from(&self.under_root(&path)), wcap: wc, idx: None, start, sectors: want });
                logical += want;
            }
        }
        let (done, failed) = self.client.batch(reqs);
        let mut added: HashMap<u64, Vec<Ext>> = HashMap::new();
        for (p, rep) in planned.iter().zip(&done) {
            Self::given(st, p.1, p.2);
            if let Reply::Entry(entry) = rep {
                added.entry(p.0).or_default().push(Ext { entry: *entry, start: p.1, sectors: p.2, logical: p.3, held: false });
            }
        }
        // On a failure the extents added are removed again (the bytes stay in memory, for the
        // next write-back to try again). The service frees their sectors only once the inode
        // is written (its record on the disk may name sectors there), so the map keeps them
        // taken until it is read again after that write-back.
        let undo = |st: &mut State, added: HashMap<u64, Vec<Ext>>| {
            for (ino, exts) in added {
                let path = st.nodes[&ino].path;
                for x in exts {
                    if self.client.remove_entry(&self.under_root(&path), self.caps.write, x.entry).is_ok() {
                        st.map_behind = true;
                    }
                }
            }
        };
        if let Some(e) = failed {
            let e = self.exo("allocating extents for buffered files")(e);
            Self::not_made(st, planned[done.len()..].iter().map(|p| (p.1, p.2)), &e);
            undo(st, added);
            return Err(e);
        }
        // The bytes, padded to whole extents (what follows the end reads as zeros).
        let mut bufs: Vec<(Target, u64, Vec<u8>)> = Vec::new();
        for (&ino, exts) in &added {
            let n = &st.nodes[&ino];
            for x in exts {
                let mut b = vec![0u8; (x.sectors * SECTOR) as usize];
                let from = (x.logical * SECTOR) as usize;
                let to = (from + b.len()).min(n.immediate.len());
                b[..to - from].copy_from_slice(&n.immediate[from..to]);
                bufs.push((self.under_root(&n.path), x.start, b));
            }
        }
        let pieces: Vec<(Target, plyfs_exodisk::object::Cap, u64, &[u8])> =
            bufs.iter().map(|(t, at, b)| (t.clone(), self.caps.write, *at, &b[..])).collect();
        if let Err(e) = self.client.write_many(&pieces) {
            drop(pieces);
            undo(st, added);
            return Err(self.exo("writing buffered files")(e));
        }
        for (ino, mut exts) in added {
            exts.sort_by_key(|e| e.logical);
            let n = st.nodes.get_mut(&ino).expect("listed");
            n.extents = exts;
            (n.map_dirty, n.fresh) = (true, false);
            let held = std::mem::take(&mut n.immediate);
            st.buffered -= held.len();
            let n = st.nodes.get_mut(&ino).expect("listed");
            n.imm_dirty = true;
            Self::note_placed(st, ino);
        }
        Ok(())
    }

    /// A change to `ino` made durable before it is answered when its model asks for that:
    /// `data`, any change; `metadata`, a change to more than the bytes of a file (`meta`). The
    /// whole file system is written back then, as a journal commits (the directory naming a
    /// new file, and the table naming its inode, go with it).
    pub(super) fn settle(&self, st: &mut State, ino: u64, meta: bool) -> Result<()> {
        let n = self.node(st, ino)?;
        let now = match Self::model(n) {
            Some(Persistence::Data) => true,
            Some(Persistence::Metadata) => meta || n.map_dirty,
            _ => false,
        };
        if now {
            self.write_back(st)?;
        }
        Ok(())
    }

    /// The persistence model an inode's extended attribute picks (none: written back every 5 s).
    pub(super) fn model(n: &Node) -> Option<Persistence> {
        match n.xattrs.get(PERSISTENCE_XATTR).map(|v| v.as_slice()) {
            Some(b"data") => Some(Persistence::Data),
            Some(b"metadata") => Some(Persistence::Metadata),
            Some(b"memory") => Some(Persistence::Memory),
            _ => None,
        }
    }
}
