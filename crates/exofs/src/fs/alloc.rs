//! Allocation: sectors found in the local free map, kept for write-back, and given to the
//! service. A run taken in the map is *claimed* until the service has it (or it goes back), so
//! that reading the map again meanwhile does not lose it. The bytes held in memory have their
//! room *reserved* when written, as delayed allocation reserves its blocks: a write is refused
//! for lack of room when it is made, never later at write-back.

use std::time::{Duration, Instant};
use plyfs_exodisk::core::{Persistence, Target};
use plyfs_exodisk::object::Caps;
use plyfs_stack::{Error, Result};

use super::sectors::placed_sectors;
use super::{Ext, Fs, State, IMMEDIATE_MAX};

impl Fs {
    /// Sectors for `n` near `near`, taken from the local map (the service refuses a run another
    /// client took meanwhile; the map is then refreshed). Outside write-back the room kept for
    /// it stays free.
    pub(super) fn find(&self, st: &mut State, n: u64, near: u64) -> Result<u64> {
        self.with_map_room(st, |st| {
            if Self::free(st) < n + Self::kept(st) {
                return None;
            }
            let at = st.map.find_free(n, near)?;
            st.map.set(at, n, true);
            st.claimed.push((at, n));
            Some(at)
        })
    }

    /// What `take` finds in the map; when it finds nothing, the map is read again (unless that
    /// was within the last second, outside a write-back: a full volume's every write would read
    /// it, a bit per sector) and `take` tries once more; ENOSPC then.
    fn with_map_room<T>(&self, st: &mut State, mut take: impl FnMut(&mut State) -> Option<T>) -> Result<T> {
        if let Some(found) = take(st) {
            return Ok(found);
        }
        if st.writing_back || st.map_read.elapsed() >= Duration::from_secs(1) {
            self.reread_map(st)?;
            if let Some(found) = take(st) {
                return Ok(found);
            }
        }
        Err(Error::Os(libc::ENOSPC))
    }

    /// Run `op` (which leaves the file system as it was when it fails); if it finds no room
    /// while write-back has some to give (inodes removed, extents cut off: the service frees
    /// them once the records naming them are written), write back and run it again, as ext4
    /// commits its journal to free blocks before it answers ENOSPC.
    pub(super) fn with_room<T>(&self, st: &mut State, mut op: impl FnMut(&mut State) -> Result<T>) -> Result<T> {
        match op(st) {
            Err(Error::Os(libc::ENOSPC)) if !st.writing_back && (!st.freeing.is_empty() || st.map_behind) => {
                self.write_back(st)?;
                op(st)
            }
            done => done,
        }
    }

    /// What is kept for `ino` brought to what its bytes held in memory now need (none once
    /// placed, or gone).
    pub(super) fn note_placed(st: &mut State, ino: u64) {
        let now = st.nodes.get(&ino).map_or(0, |n| Self::to_place(&n.extents, n.immediate.len()));
        let had = if now == 0 { st.reserved.remove(&ino) } else { st.reserved.insert(ino, now) };
        st.reserved_total = (st.reserved_total + now).saturating_sub(had.unwrap_or(0));
    }

    /// Free sectors, as the local map has them.
    fn free(st: &State) -> u64 {
        st.map.sectors() - st.map.allocated().min(st.map.sectors())
    }

    /// Sectors only write-back may take: what it places for bytes held in memory, and room for
    /// the metadata it writes (directories grown, extent holders): 1% of the volume, at least
    /// 256 KiB.
    fn kept(st: &State) -> u64 {
        if st.writing_back {
            return 0;
        }
        st.reserved_total + Self::metadata_room(st)
    }

    fn metadata_room(st: &State) -> u64 {
        (st.map.sectors() / 100).max(512)
    }

    /// Sectors write-back takes for a file's `len` bytes held in memory (as `place_buffered`
    /// rounds them; none while they fit in the inode, or once the file has extents).
    fn to_place(extents: &[Ext], len: usize) -> u64 {
        if extents.is_empty() && len > IMMEDIATE_MAX {
            placed_sectors(len as u64)
        } else {
            0
        }
    }

    /// Room for `ino`'s bytes held in memory to grow to `len`, kept for write-back; ENOSPC when
    /// the volume has not got it.
    pub(super) fn reserve(&self, st: &mut State, ino: u64, len: usize) -> Result<()> {
        let n = self.node(st, ino)?;
        let want = Self::to_place(&n.extents, len.max(n.immediate.len()));
        let had = st.reserved.get(&ino).copied().unwrap_or(0);
        if want <= had {
            return Ok(());
        }
        self.with_map_room(st, |st| {
            (Self::free(st) >= want - had + Self::kept(st)).then(|| {
                st.reserved.insert(ino, want);
                st.reserved_total += want - had;
            })
        })
    }

    /// A run [`find`](Self::find) took and the service did not get, back in the map.
    pub(super) fn unclaim(st: &mut State, at: u64, n: u64) {
        st.map.set(at, n, false);
        st.claimed.retain(|c| *c != (at, n));
    }

    /// A run the service has now (ours, or another client's when it refused it with EEXIST):
    /// taken in the map, as the service's own map has it.
    pub(super) fn given(st: &mut State, at: u64, n: u64) {
        st.claimed.retain(|c| *c != (at, n));
    }

    /// A run the service refused with `e`.
    pub(super) fn refused(st: &mut State, at: u64, n: u64, e: &Error) {
        if matches!(e, Error::Os(libc::EEXIST)) {
            Self::given(st, at, n);
        } else {
            Self::unclaim(st, at, n);
        }
    }

    /// The runs of a batch from the request that failed with `e` on: that one refused, those
    /// after it never tried.
    pub(super) fn not_made(st: &mut State, runs: impl IntoIterator<Item = (u64, u64)>, e: &Error) {
        for (i, (at, n)) in runs.into_iter().enumerate() {
            if i == 0 {
                Self::refused(st, at, n, e);
            } else {
                Self::unclaim(st, at, n);
            }
        }
    }

    /// The service's free map, with the runs this operation took and has not given it yet.
    pub(super) fn reread_map(&self, st: &mut State) -> Result<()> {
        st.map = self.client.free_map().map_err(self.exo("reading the free map"))?;
        st.map_read = Instant::now();
        for &(at, n) in &st.claimed {
            st.map.set(at, n, true);
        }
        Ok(())
    }

    /// A `memory`-model exonode of `sectors` below `parent`, near `near`: its entry and sector.
    pub(super) fn add_exonode(&self, st: &mut State, parent: &Target, sectors: u32, near: u64, data: Vec<Vec<u8>>) -> Result<(u32, u64)> {
        self.retrying_races(st, |st| {
            let at = self.find(st, sectors as u64, near)?;
            let made =
                self.client.add_exonode_as(parent, self.caps.write, None, at, sectors, Caps::random(), Some(Persistence::Memory), data.clone());
            match made.map_err(self.exo("making an exonode")) {
                Ok(entry) => {
                    Self::given(st, at, sectors as u64);
                    Ok((entry, at))
                }
                Err(e) => {
                    Self::refused(st, at, sectors as u64, &e);
                    Err(e)
                }
            }
        })
    }

    /// `op`, again (up to three times, with the map read again) while the service refuses
    /// sectors another client took since the map was read (EEXIST).
    pub(super) fn retrying_races<T>(&self, st: &mut State, mut op: impl FnMut(&mut State) -> Result<T>) -> Result<T> {
        let mut tries = 0;
        loop {
            match op(st) {
                Err(Error::Os(libc::EEXIST)) if tries < 3 => {
                    tries += 1;
                    self.reread_map(st)?;
                }
                done => return done,
            }
        }
    }

    /// Space: sectors in all; sectors free (less what bytes held in memory will take at
    /// write-back); sectors a file may still take (less the room kept for write-back's
    /// metadata too, as ext4 keeps blocks for root); and inodes in use.
    pub fn statfs(&self) -> Result<(u64, u64, u64, u64)> {
        let mut st = self.lock();
        self.reread_map(&mut st)?;
        let inodes = st.tables.iter().map(|t| t.2 as u64).sum();
        let free = Self::free(&st);
        Ok((st.map.sectors(), free.saturating_sub(st.reserved_total), free.saturating_sub(Self::kept(&st)), inodes))
    }
}
