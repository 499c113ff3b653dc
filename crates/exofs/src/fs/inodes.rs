//! Inodes: made a batch at a time into a pool (thesis §5.3: a directory's small files sit
//! together), loaded from their exonodes, and freed when nothing names, holds or knows them
//! (back to the pool if they never reached the disk).

use plyfs_exodisk::object::Caps;
use plyfs_exodisk::proto::{wcap, Reply, Request, WEntry, WExonode, WPersistence, WTarget};
use plyfs_stack::{Error, Result};
use serde_bytes::ByteBuf;
use crate::format::{decode_map, decode_xattrs, Inode, Xattrs, ATTRS, IMMEDIATE, MAP};

use super::{Ext, Freeing, Fs, Node, State, HELD, INODE_SECTORS, POOL, TABLE_SECTORS};

impl Fs {
    pub(super) fn new_inode(&self, st: &mut State, attrs: Inode, near: u64) -> Result<u64> {
        if st.pool.is_empty() {
            self.refill_pool(st, near)?;
        }
        let (at, path) = st.pool.pop().expect("refilled");
        st.nodes.insert(at, Node::new(path, attrs));
        Ok(at)
    }

    /// Make [`POOL`] inodes in one request, in a run of sectors near `near` (a directory's small
    /// files then sit together, thesis §5.3), each with empty entries ATTRS, IMMEDIATE and MAP.
    fn refill_pool(&self, st: &mut State, near: u64) -> Result<()> {
        self.retrying_races(st, |st| self.refill_pool_once(st, near))
    }

    fn refill_pool_once(&self, st: &mut State, near: u64) -> Result<()> {
        let cap = (plyfs_exodisk::object::Exonode::capacity(TABLE_SECTORS) / 9) as u32;
        let table = match st.tables.iter().position(|(_, _, n)| *n + POOL as u32 <= cap) {
            Some(i) => i,
            None => {
                let (k, at) = self.add_exonode(st, &self.under_root(&[]), TABLE_SECTORS, self.r, Vec::new())?;
                st.tables.push((k, at, 0));
                st.tables.len() - 1
            }
        };
        let k = st.tables[table].0;
        let run = match self.find(st, POOL as u64 * INODE_SECTORS as u64, near) {
            Ok(run) => Some(run),
            Err(Error::Os(libc::ENOSPC)) => None,
            Err(e) => return Err(e),
        };
        let sectors: Vec<u64> = match run {
            Some(run) => (0..POOL as u64).map(|i| run + i * INODE_SECTORS as u64).collect(),
            None => {
                let mut one = Vec::new();
                for _ in 0..POOL {
                    match self.find(st, INODE_SECTORS as u64, near) {
                        Ok(at) => one.push(at),
                        Err(_) => break,
                    }
                }
                one
            }
        };
        if sectors.is_empty() {
            return Err(Error::Os(libc::ENOSPC));
        }
        let table_target = WTarget::from(&self.under_root(&[k]));
        let reqs = sectors
            .iter()
            .map(|&at| Request::AddExonode {
                target: table_target.clone(),
                wcap: wcap(self.caps.write),
                idx: None,
                child: at,
                sectors: INODE_SECTORS,
                caps: Caps::random().into(),
                persistence: Some(WPersistence::Memory),
                data: vec![ByteBuf::new(), ByteBuf::new(), ByteBuf::new()],
            })
            .collect();
        let (done, failed) = self.client.batch(reqs);
        for (at, rep) in sectors.iter().zip(&done) {
            if let Reply::Entry(j) = rep {
                st.pool.push((*at, [k, *j]));
            }
        }
        st.tables[table].2 += done.len() as u32;
        st.tables_dirty |= !done.is_empty();
        st.pool.reverse();
        match run {
            Some(run) => Self::given(st, run, sectors.len() as u64 * INODE_SECTORS as u64),
            None => sectors.iter().for_each(|&at| Self::given(st, at, INODE_SECTORS as u64)),
        }
        // The rest were not made: their sectors are free again, but one the service refused as
        // another client's (EEXIST).
        if let Some(e) = failed {
            let e = self.exo("making new inodes")(e);
            Self::not_made(st, sectors[done.len()..].iter().map(|&at| (at, INODE_SECTORS as u64)), &e);
            if done.is_empty() {
                return Err(e);
            }
        }
        Ok(())
    }

    pub(super) fn node<'a>(&self, st: &'a mut State, ino: u64) -> Result<&'a mut Node> {
        if !st.nodes.contains_key(&ino) {
            let path = *st.paths.get(&ino).ok_or(Error::Os(libc::ESTALE))?;
            let x = self.client.map(&self.under_root(&path), self.caps.read).map_err(self.exo_at(ino, "reading the inode"))?;
            let loaded = self.decode_node(ino, path, &x)?;
            st.buffered += loaded.immediate.len();
            st.nodes.insert(ino, loaded);
        }
        Ok(st.nodes.get_mut(&ino).expect("loaded"))
    }

    /// An inode as its exonode holds it (and its holder, read when it has one).
    pub(super) fn decode_node(&self, ino: u64, path: [u32; 2], x: &WExonode) -> Result<Node> {
        let corrupt = |what: &str| Error::Corrupt(format!("exofs inode {ino}: {what}"));
        let attrs = match x.entries.get(ATTRS as usize) {
            Some(WEntry::Data(d)) if d.len() >= Inode::ENCODED_LEN => {
                Inode::decode(&d[..Inode::ENCODED_LEN]).map_err(|e| corrupt(&e.to_string()))?
            }
            _ => return Err(corrupt("no attributes")),
        };
        let xattrs = match x.entries.get(ATTRS as usize) {
            Some(WEntry::Data(d)) => decode_xattrs(&d[Inode::ENCODED_LEN..]).map_err(|e| corrupt(&e.to_string()))?,
            _ => Xattrs::new(),
        };
        let immediate = match x.entries.get(IMMEDIATE as usize) {
            Some(WEntry::Data(d)) => d.to_vec(),
            _ => return Err(corrupt("no immediate data")),
        };
        // A file with many extents keeps them and its map in a descendant, its holder.
        let holder = x.entries.iter().enumerate().find_map(|(i, e)| match e {
            WEntry::Descendant { at } => Some((i as u32, *at)),
            _ => None,
        });
        let held = match holder {
            Some((h, _)) => Some(self.client.map(&self.under_root(&[path[0], path[1], h]), self.caps.read).map_err(self.exo_at(ino, "reading the inode's extent holder"))?),
            None => None,
        };
        let map_bytes = match held.as_ref().map_or(x.entries.get(MAP as usize), |h| h.entries.first()) {
            Some(WEntry::Data(d)) => d,
            _ => return Err(corrupt("no extent map")),
        };
        let (map, segs) = decode_map(map_bytes).map_err(|e| corrupt(&e.to_string()))?;
        let mut extents = Vec::new();
        for (item, logical) in map {
            let (in_holder, entry) = (item & HELD != 0, item & !HELD);
            let from = if in_holder { held.as_ref().map(|h| &h.entries) } else { Some(&x.entries) };
            match from.and_then(|e| e.get(entry as usize)) {
                Some(WEntry::Extent { start, sectors }) => {
                    extents.push(Ext { entry, start: *start, sectors: *sectors, logical, held: in_holder })
                }
                _ => return Err(corrupt("the extent map names an entry that is not an extent")),
            }
        }
        extents.sort_by_key(|e| e.logical);
        if extents.windows(2).any(|w| w[0].logical + w[0].sectors > w[1].logical) {
            return Err(corrupt("overlapping extents"));
        }
        if segs.as_ref().is_some_and(|s| s.last().map_or(0, |l| l.logical + l.len) != attrs.size) {
            return Err(corrupt("the pieces do not cover the file"));
        }
        Ok(Node {
            immediate,
            extents,
            segs,
            holder,
            xattrs,
            dirty: false,
            imm_dirty: false,
            map_dirty: false,
            fresh: false,
            ..Node::new(path, attrs)
        })
    }

    pub(super) fn free_inode(&self, st: &mut State, ino: u64) -> Result<()> {
        let n = st.nodes.remove(&ino).ok_or(Error::Os(libc::ESTALE))?;
        st.buffered -= n.immediate.len();
        Self::note_placed(st, ino);
        Self::forget_ahead(st, ino);
        st.paths.remove(&ino);
        if n.fresh {
            // Never written: the service's exonode is as the pool made it.
            st.pool.push((ino, n.path));
        } else {
            st.freeing.push(Freeing { at: ino, path: n.path, extents: n.extents, holder: n.holder });
        }
        Ok(())
    }

    /// Free `ino` if nothing names, holds or knows it any more.
    pub(super) fn maybe_free(&self, st: &mut State, ino: u64) -> Result<()> {
        let unlinked = st.nodes.get(&ino).is_some_and(|n| n.attrs.nlink == 0);
        if unlinked && !st.open.contains_key(&ino) && !st.lookups.contains_key(&ino) {
            self.free_inode(st, ino)?;
        }
        Ok(())
    }

    /// The layer above holds one more lookup of `ino`.
    pub fn looked_up(&self, ino: u64) {
        *self.lock().lookups.entry(ino).or_default() += 1;
    }

    /// The layer above dropped `n` lookups of `ino`.
    pub fn forget(&self, ino: u64, n: u64) -> Result<()> {
        let mut st = self.lock();
        match st.lookups.get_mut(&ino) {
            Some(l) if *l > n => {
                *l -= n;
                Ok(())
            }
            Some(_) => {
                st.lookups.remove(&ino);
                self.maybe_free(&mut st, ino)
            }
            None => Ok(()),
        }
    }

    /// A descriptor of `ino` opened.
    pub fn opened(&self, ino: u64) {
        *self.lock().open.entry(ino).or_default() += 1;
    }

    /// A descriptor of `ino` closed: an inode without links goes with its last one.
    pub fn closed(&self, ino: u64) -> Result<()> {
        let mut st = self.lock();
        let last = match st.open.get_mut(&ino) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                st.open.remove(&ino);
                true
            }
            None => false,
        };
        if last {
            self.maybe_free(&mut st, ino)?;
        }
        Ok(())
    }
}
