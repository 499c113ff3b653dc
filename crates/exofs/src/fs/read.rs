//! Reading a file's bytes, and reading ahead the small files of the directory listed last.

use plyfs_exodisk::core::Target;
use plyfs_exodisk::proto::{wcap, Reply, Request, WTarget};
use plyfs_stack::{FileKind, Result};

use super::extents::{OnVolume, SectorRun};
use super::sectors::sectors_spanning;
use super::{Fs, State, AHEAD_TOTAL, READ_AHEAD, READ_AHEAD_MAX, SECTOR};

impl Fs {
    /// Bytes `off..off + len` of `ino` (clipped at its size).
    pub fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        let mut st = self.lock();
        self.read_at(&mut st, ino, off, len)
    }

    pub(super) fn read_at(&self, st: &mut State, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        if self.node(st, ino)?.segs.is_some() {
            return self.read_segmented(st, ino, off, len);
        }
        let n = self.node(st, ino)?;
        let end = (off + len as u64).min(n.attrs.size);
        if off >= end {
            return Ok(Vec::new());
        }
        if n.extents.is_empty() {
            let imm = &n.immediate;
            let mut out = imm.get(off as usize..(end as usize).min(imm.len())).unwrap_or(&[]).to_vec();
            out.resize((end - off) as usize, 0);
            return Ok(out);
        }
        // Only a small file's read starts a read-ahead (a large one is not read ahead, and
        // would look over its siblings again at every read).
        if n.attrs.size <= READ_AHEAD_MAX && !st.ahead.contains_key(&ino) {
            self.read_ahead(st, ino);
        }
        if let Some(b) = st.ahead.get(&ino) {
            let (a, z) = ((off as usize).min(b.len()), (end as usize).min(b.len()));
            return Ok(b[a..z].to_vec());
        }
        let n = self.node(st, ino)?.shape();
        let (s0, s1) = sectors_spanning(off, end);
        let mut buf = vec![0u8; ((s1 - s0) * SECTOR) as usize];
        self.read_sectors(&n, s0, &mut buf)?;
        // The bytes asked for, without another copy when they start on a sector.
        buf.drain(..(off - s0 * SECTOR) as usize);
        buf.truncate((end - off) as usize);
        Ok(buf)
    }

    /// `ino`'s bytes changed: what was read ahead of them goes.
    pub(super) fn forget_ahead(st: &mut State, ino: u64) {
        if let Some(b) = st.ahead.remove(&ino) {
            st.ahead_bytes -= b.len();
        }
    }

    /// Read ahead the small files that follow `ino` in the directory listed last (as `tar`,
    /// `cp -r` or a build read a directory's files in turn): their inodes in one request, their
    /// bytes in one queue of reads, which the service orders on the disk (the thesis's
    /// disk-directed I/O, used by the library for itself). Best effort: a failure here only
    /// means the reads go one at a time.
    fn read_ahead(&self, st: &mut State, ino: u64) {
        let Some(p) = st.recent.iter().position(|&i| i == ino) else { return };
        let next: Vec<u64> = st.recent[p..].iter().take(READ_AHEAD).copied().filter(|i| !st.ahead.contains_key(i)).collect();
        let missing: Vec<(u64, [u32; 2])> =
            next.iter().filter(|i| !st.nodes.contains_key(i)).filter_map(|i| st.paths.get(i).map(|p| (*i, *p))).collect();
        if !missing.is_empty() {
            let reqs = missing
                .iter()
                .map(|(_, path)| Request::Map { target: WTarget::from(&self.under_root(path)), rcap: wcap(self.caps.read) })
                .collect();
            let (done, _) = self.client.batch(reqs);
            for ((i, path), rep) in missing.iter().zip(done) {
                if let Reply::Exonode(x) = rep {
                    if let Ok(n) = self.decode_node(*i, *path, &x) {
                        st.buffered += n.immediate.len();
                        st.nodes.insert(*i, n);
                    }
                }
            }
        }
        // Whole small files, plain and without holes.
        let mut pieces: Vec<(Target, u128, u64, usize)> = Vec::new();
        let mut files: Vec<(u64, usize, usize, u64)> = Vec::new();
        for i in next {
            let Some(n) = st.nodes.get(&i) else { continue };
            if n.attrs.kind != FileKind::File || n.segs.is_some() || n.extents.is_empty() || n.attrs.size > READ_AHEAD_MAX {
                continue;
            }
            let shape = n.shape();
            let parts = shape.sector_runs(0, n.attrs.size.div_ceil(SECTOR));
            if parts.iter().any(|p| p.on_volume.is_none()) {
                continue;
            }
            files.push((i, pieces.len(), parts.len(), n.attrs.size));
            for SectorRun { sectors: len, on_volume, .. } in parts {
                let OnVolume { sector: at, held } = on_volume.expect("no holes");
                pieces.push((self.extent_home(&shape, held), self.caps.read, at, (len * SECTOR) as usize));
            }
        }
        if pieces.is_empty() {
            return;
        }
        let Ok(bytes) = self.client.read_many(&pieces) else { return };
        if st.ahead_bytes > AHEAD_TOTAL {
            st.ahead.clear();
            st.ahead_bytes = 0;
        }
        for (i, first, count, size) in files {
            let mut b: Vec<u8> = bytes[first..first + count].concat();
            b.truncate(size as usize);
            st.ahead_bytes += b.len();
            st.ahead.insert(i, b);
        }
    }
}
