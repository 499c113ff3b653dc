//! The file system itself, over the exodisk client: inodes, directories and file data. The
//! plyfs `Layer` on top of it maps operations to these calls.
//!
//! Everything is reached with the capabilities of the user's named root `exofs` (R): R's entry 0
//! is the superblock, its entries 1.. are inode tables, and each inode hangs below a table.
//! Inodes are `memory`-model exonodes written back by [`Fs::sync`], as ext4 commits its journal.
//!
//! Small work stays in memory until then, as a kernel file system's page cache and delayed
//! allocation keep it: new inodes come from a pool made a batch at a time; a file's bytes live
//! in its inode (up to [`BUFFER_MAX`]) and get extents only at write-back, all at once and
//! ordered on the disk; inodes removed go back to the pool if they never reached the disk, and
//! are deallocated together at write-back otherwise. A write-back is a few batched requests
//! whatever the number of files. Larger files are written through at once.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use plyfs_exodisk::client::Client;
use plyfs_exodisk::core::{ExoError, Persistence, Target};

use plyfs_exodisk::object::{Caps, Exonode};
use plyfs_exodisk::proto::{wcap, Reply, Request, WEntry, WExonode, WPersistence, WTarget};
use plyfs_stack::{Error, FileKind, Result};
use serde_bytes::ByteBuf;

use crate::format::{
    decode_dir, decode_map, decode_xattrs, encode_dir, encode_map, encode_xattrs, valid_name, Dir, Inode, Seg, Xattrs, ATTRS,
    IMMEDIATE, MAP,
};

/// Sectors of an inode exonode (4 KiB: room for about 130 extents), and of an inode table.
pub const INODE_SECTORS: u32 = 8;
pub const TABLE_SECTORS: u32 = 32;
/// Bytes kept inside the inode on the volume.
pub const IMMEDIATE_MAX: usize = 480;
/// Bytes of a file kept in memory until write-back (beyond this it is written through)...
pub const BUFFER_MAX: usize = 256 << 10;
/// ... while all files' bytes kept in memory stay under this.
const BUFFER_TOTAL: usize = 64 << 20;
/// Sectors of an inode's extent holder: the descendant that takes a file's extents and its map
/// once they outgrow the inode (64 KiB: room for about 2,000 extents and pieces).
const HOLDER_SECTORS: u32 = 128;
/// An extent map item naming an extent of the holder rather than of the inode.
const HELD: u32 = 1 << 30;
/// Bytes of extended attributes an inode holds (names and values together).
pub const XATTR_MAX: usize = 2048;
/// The extended attribute that picks a file's persistence model (and its new files', on a
/// directory).
pub const PERSISTENCE_XATTR: &[u8] = b"user.exofs.persistence";
/// The most an append takes ahead of what it writes (8 MiB).
const PREALLOC_SECTORS: u64 = 16384;
/// Files read ahead at a time, the largest read ahead, and the bytes kept read ahead at most.
const READ_AHEAD: usize = 64;
const READ_AHEAD_MAX: u64 = 64 << 10;
const AHEAD_TOTAL: usize = 32 << 20;
/// Pieces a file may be cut into by insertions and removals (its map must fit its holder).
const MAX_PIECES: usize = 1500;
/// Inodes made per request when the pool is empty.
const POOL: usize = 32;
/// Inodes written back per batched request.
const BATCH_NODES: usize = 1024;
/// The first extent of a file, in sectors (64 KiB); later ones double, up to `MAX_EXTENT`.
const MAX_EXTENT_SECTORS: u64 = 65536;
/// Holes are filled a whole aligned chunk at a time (32 KiB), so that random writes do not make
/// an extent each.
const CHUNK_SECTORS: u64 = 64;
const SECTOR: u64 = 512;
/// The superblock (entry 0 of the named root): this magic, then the root directory's inode.
pub const MAGIC: &[u8; 8] = b"EXOFS\0\0\x01";

fn exo(e: ExoError) -> Error {
    if e.errno == libc::EIO {
        tracing::error!("exofs: {}", e.msg);
    }
    Error::Os(e.errno)
}

/// An extent of a file: its entry in the inode, where it is on the volume, and where in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ext {
    entry: u32,
    start: u64,
    sectors: u64,
    logical: u64,
    /// The entry is in the inode's holder, not in the inode.
    held: bool,
}

#[derive(Clone, Debug)]
struct Node {
    /// Entry numbers from R: the table, then the inode.
    path: [u32; 2],
    attrs: Inode,
    immediate: Vec<u8>,
    /// Extents by the file sector they start at (holes between them read as zeros).
    extents: Vec<Ext>,
    dirty: bool,
    /// A directory's entries, decoded, once read.
    dir: Option<Dir>,
    /// Its entries changed since they were last written.
    dir_dirty: bool,
    /// Its immediate bytes (entry IMMEDIATE) or extent map (entry MAP) changed since the last
    /// write-back.
    imm_dirty: bool,
    map_dirty: bool,
    /// The service's exonode is still as the pool made it (nothing written to it yet), so the
    /// inode can go back to the pool when removed.
    fresh: bool,
    /// For a file with bytes inserted or removed in the middle: its pieces, in file order,
    /// covering `0..size` (its extents then hold the *store* the pieces point into).
    segs: Option<Vec<Seg>>,
    /// The descendant holding extents and the extent map once they outgrow the inode: its
    /// entry in the inode and its sector.
    holder: Option<(u32, u64)>,
    /// The holder's entries changed since the last write-back.
    holder_dirty: bool,
    /// Extended attributes (kept after the attributes, in entry ATTRS).
    xattrs: Xattrs,
}

/// File sector, sectors, and where they are (volume sector and whether the extent is in the
/// holder), or `None` for a hole.
type Piece = (u64, u64, Option<(u64, bool)>);

/// Where a file's bytes are: what reading and writing its sectors needs (cheap to copy, unlike
/// a node with its bytes held in memory).
#[derive(Clone, Debug)]
struct Shape {
    path: [u32; 2],
    extents: Vec<Ext>,
    holder: Option<u32>,
}

impl Node {
    fn shape(&self) -> Shape {
        Shape { path: self.path, extents: self.extents.clone(), holder: self.holder.map(|h| h.0) }
    }

    fn new(path: [u32; 2], attrs: Inode) -> Node {
        Node {
            path,
            attrs,
            immediate: Vec::new(),
            extents: Vec::new(),
            dirty: true,
            dir: None,
            dir_dirty: false,
            imm_dirty: true,
            map_dirty: true,
            fresh: true,
            segs: None,
            holder: None,
            holder_dirty: false,
            xattrs: Xattrs::new(),
        }
    }
}

/// An inode removed, deallocated at the next write-back (its sectors stay taken in the map
/// until then).
#[derive(Clone, Debug)]
struct Freeing {
    at: u64,
    path: [u32; 2],
    extents: Vec<Ext>,
    /// Its holder: entry in the inode, sector.
    holder: Option<(u32, u64)>,
}

struct State {
    nodes: HashMap<u64, Node>,
    /// Inode number to its path, for those not loaded yet.
    paths: HashMap<u64, [u32; 2]>,
    /// Tables: (entry in R, sector, inodes in it).
    tables: Vec<(u32, u64, u32)>,
    root: u64,
    /// Where the next allocation starts looking (free-map snapshot kept by the client).
    map: plyfs_exodisk::freemap::FreeMap,
    /// Open descriptors per inode: an inode whose last link goes while open lives until closed.
    open: HashMap<u64, u32>,
    /// Lookups the layer above holds per inode: an inode without links lives until they are
    /// forgotten, so that its number is not reused while the kernel still knows it.
    lookups: HashMap<u64, u64>,
    /// An inode was added to or removed from a table since the last write-back.
    tables_dirty: bool,
    /// Inodes made (in a table, with empty entries) and not used yet: sector and path.
    pool: Vec<(u64, [u32; 2])>,
    /// Inodes removed since the last write-back, deallocated by it: sector, path, extents
    /// (their sectors stay taken in the map until then).
    freeing: Vec<Freeing>,
    /// Bytes of file contents held in memory (immediate data, written back or not).
    buffered: usize,
    /// The files of the directory listed last, in its order: reading one reads ahead the next.
    recent: Vec<u64>,
    /// Small files' bytes read ahead, until they change, and how many bytes that is.
    ahead: HashMap<u64, Vec<u8>>,
    ahead_bytes: usize,
    /// Sectors were given up that the service frees at the next write-back: `map` holds them
    /// as taken until it is read again after it.
    map_behind: bool,
    /// Runs taken in `map` by the operation under way and not yet given to the service: kept
    /// taken when the map is read again meanwhile (the service does not know of them yet).
    claimed: Vec<(u64, u64)>,
    /// Sectors kept for the bytes held in memory that write-back is to place, per inode and in
    /// all (as delayed allocation reserves its blocks): a write is refused for lack of room
    /// when it is made, never later at write-back.
    reserved: HashMap<u64, u64>,
    reserved_total: u64,
    /// A write-back is under way: it may take the room kept for it.
    writing_back: bool,
    /// When `map` was last read from the service.
    map_read: Instant,
}

pub struct Fs {
    client: Client,
    r: u64,
    caps: Caps,
    state: Mutex<State>,
}

impl Fs {
    /// The file system in the caller's root `name` on the service behind `client`, made if new.
    pub fn open(client: Client, name: &str) -> std::result::Result<Fs, String> {
        let (r, caps) = client.root_exclusive(name).map_err(|e| e.msg)?;
        let map = client.free_map().map_err(|e| e.msg)?;
        let fs = Fs {
            client,
            r,
            caps,
            state: Mutex::new(State {
                nodes: HashMap::new(),
                paths: HashMap::new(),
                tables: Vec::new(),
                root: 0,
                map,
                open: HashMap::new(),
                lookups: HashMap::new(),
                tables_dirty: false,
                pool: Vec::new(),
                freeing: Vec::new(),
                buffered: 0,
                recent: Vec::new(),
                ahead: HashMap::new(),
                ahead_bytes: 0,
                map_behind: false,
                claimed: Vec::new(),
                reserved: HashMap::new(),
                reserved_total: 0,
                writing_back: false,
                map_read: Instant::now(),
            }),
        };
        let x = fs.client.map(&fs.under_root(&[]), caps.read).map_err(|e| e.msg)?;
        if !x.entries.is_empty() {
            fs.load_tables(&x.entries)?;
        }
        if x.entries.is_empty() || fs.mkfs_was_cut_short() {
            fs.mkfs().map_err(|e| format!("making the file system: {e:?}"))?;
        }
        let st = fs.state.lock();
        if !st.paths.contains_key(&st.root) && !st.nodes.contains_key(&st.root) {
            return Err(format!("the root directory's inode {} is not on the volume", st.root));
        }
        drop(st);
        Ok(fs)
    }

    /// The exonode at `path` below the file system's named root (R): `[]` is R itself, `[k]`
    /// inode table k, `[k, j]` an inode, `[k, j, h]` an inode's extent holder.
    fn under_root(&self, path: &[u32]) -> Target {
        Target::Exonode { at: self.r, path: path.to_vec() }
    }

    fn mkfs(&self) -> Result<()> {
        let mut st = self.lock();
        let mut sb = MAGIC.to_vec();
        sb.extend_from_slice(&0u64.to_le_bytes());
        self.client.add_data(&self.under_root(&[]), self.caps.write, Some(0), &sb).map_err(exo)?;
        let root = Inode::new(FileKind::Dir, 0o755, unsafe { libc::geteuid() }, unsafe { libc::getegid() });
        let ino = self.new_inode(&mut st, root, self.r)?;
        st.root = ino;
        let mut sb = MAGIC.to_vec();
        sb.extend_from_slice(&ino.to_le_bytes());
        self.client.add_data(&self.under_root(&[]), self.caps.write, Some(0), &sb).map_err(exo)?;
        drop(st);
        self.sync()
    }

    /// Whether the file system was never finished: [`Fs::mkfs`] writes the superblock, in R
    /// (whose changes are durable at once), before the root's inode and table reach the disk
    /// (at its write-back), so a crash in between leaves a superblock and no inode at all.
    /// Making it again then loses nothing.
    fn mkfs_was_cut_short(&self) -> bool {
        let st = self.lock();
        st.root == 0 || st.paths.is_empty()
    }

    fn load_tables(&self, entries: &[WEntry]) -> std::result::Result<(), String> {
        let mut st = self.lock();
        match entries.first() {
            Some(WEntry::Data(d)) if d.len() == 16 && &d[..8] == MAGIC => {
                st.root = u64::from_le_bytes(d[8..16].try_into().expect("8"))
            }
            _ => return Err("the root exonode does not hold an exofs file system".into()),
        }
        for (k, e) in entries.iter().enumerate().skip(1) {
            if let WEntry::Descendant { at } = e {
                let t = self.client.map(&self.under_root(&[k as u32]), self.caps.read).map_err(|e| e.msg)?;
                let mut count = 0;
                for (j, ie) in t.entries.iter().enumerate() {
                    if let WEntry::Descendant { at: ino } = ie {
                        st.paths.insert(*ino, [k as u32, j as u32]);
                        count += 1;
                    }
                }
                st.tables.push((k as u32, *at, count));
            }
        }
        Ok(())
    }

    /// The state, for one operation: every run it takes is given to the service (or back to
    /// the map) before the lock goes.
    fn lock(&self) -> parking_lot::MutexGuard<'_, State> {
        let mut st = self.state.lock();
        st.claimed.clear();
        st
    }

    /// Sectors for `n` near `near`, taken from the local map (the service refuses a run another
    /// client took meanwhile; the map is then refreshed). Outside write-back the room kept for
    /// it stays free.
    fn find(&self, st: &mut State, n: u64, near: u64) -> Result<u64> {
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
    fn with_room<T>(&self, st: &mut State, mut op: impl FnMut(&mut State) -> Result<T>) -> Result<T> {
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
    fn note_placed(st: &mut State, ino: u64) {
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
            (len as u64).div_ceil(SECTOR).div_ceil(8) * 8
        } else {
            0
        }
    }

    /// Room for `ino`'s bytes held in memory to grow to `len`, kept for write-back; ENOSPC when
    /// the volume has not got it.
    fn reserve(&self, st: &mut State, ino: u64, len: usize) -> Result<()> {
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
    fn unclaim(st: &mut State, at: u64, n: u64) {
        st.map.set(at, n, false);
        st.claimed.retain(|c| *c != (at, n));
    }

    /// A run the service has now (ours, or another client's when it refused it with EEXIST):
    /// taken in the map, as the service's own map has it.
    fn given(st: &mut State, at: u64, n: u64) {
        st.claimed.retain(|c| *c != (at, n));
    }

    /// A run the service refused with `e`.
    fn refused(st: &mut State, at: u64, n: u64, e: &Error) {
        if matches!(e, Error::Os(libc::EEXIST)) {
            Self::given(st, at, n);
        } else {
            Self::unclaim(st, at, n);
        }
    }

    /// The runs of a batch from the request that failed with `e` on: that one refused, those
    /// after it never tried.
    fn not_made(st: &mut State, runs: impl IntoIterator<Item = (u64, u64)>, e: &Error) {
        for (i, (at, n)) in runs.into_iter().enumerate() {
            if i == 0 {
                Self::refused(st, at, n, e);
            } else {
                Self::unclaim(st, at, n);
            }
        }
    }

    /// The service's free map, with the runs this operation took and has not given it yet.
    fn reread_map(&self, st: &mut State) -> Result<()> {
        st.map = self.client.free_map().map_err(exo)?;
        st.map_read = Instant::now();
        for &(at, n) in &st.claimed {
            st.map.set(at, n, true);
        }
        Ok(())
    }

    fn new_inode(&self, st: &mut State, attrs: Inode, near: u64) -> Result<u64> {
        if st.pool.is_empty() {
            self.refill_pool(st, near)?;
        }
        let (at, path) = st.pool.pop().expect("refilled");
        st.nodes.insert(at, Node::new(path, attrs));
        Ok(at)
    }

    /// A `memory`-model exonode of `sectors` below `parent`, near `near`: its entry and sector.
    fn add_exonode(&self, st: &mut State, parent: &Target, sectors: u32, near: u64, data: Vec<Vec<u8>>) -> Result<(u32, u64)> {
        self.retrying_races(st, |st| {
            let at = self.find(st, sectors as u64, near)?;
            let made =
                self.client.add_exonode_as(parent, self.caps.write, None, at, sectors, Caps::random(), Some(Persistence::Memory), data.clone());
            match made.map_err(exo) {
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
    fn retrying_races<T>(&self, st: &mut State, mut op: impl FnMut(&mut State) -> Result<T>) -> Result<T> {
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
            let e = exo(e);
            Self::not_made(st, sectors[done.len()..].iter().map(|&at| (at, INODE_SECTORS as u64)), &e);
            if done.is_empty() {
                return Err(e);
            }
        }
        Ok(())
    }

    /// The root directory's inode number.
    pub fn root(&self) -> u64 {
        self.lock().root
    }

    fn node<'a>(&self, st: &'a mut State, ino: u64) -> Result<&'a mut Node> {
        if !st.nodes.contains_key(&ino) {
            let path = *st.paths.get(&ino).ok_or(Error::Os(libc::ESTALE))?;
            let x = self.client.map(&self.under_root(&path), self.caps.read).map_err(exo)?;
            let loaded = self.decode_node(ino, path, &x)?;
            st.buffered += loaded.immediate.len();
            st.nodes.insert(ino, loaded);
        }
        Ok(st.nodes.get_mut(&ino).expect("loaded"))
    }

    /// An inode as its exonode holds it (and its holder, read when it has one).
    fn decode_node(&self, ino: u64, path: [u32; 2], x: &WExonode) -> Result<Node> {
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
            Some((h, _)) => Some(self.client.map(&self.under_root(&[path[0], path[1], h]), self.caps.read).map_err(exo)?),
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

    pub fn getattr(&self, ino: u64) -> Result<Inode> {
        let mut st = self.lock();
        Ok(self.node(&mut st, ino)?.attrs.clone())
    }

    /// The directory `ino`'s entries.
    pub fn read_dir(&self, ino: u64) -> Result<Dir> {
        let mut st = self.lock();
        let d = self.dir(&mut st, ino)?.clone();
        st.recent = d.values().filter(|(_, k)| *k == FileKind::File).map(|(i, _)| *i).collect();
        Ok(d)
    }

    /// The directory `ino`'s entries, read once and then kept (and changed) in memory.
    fn dir<'a>(&self, st: &'a mut State, ino: u64) -> Result<&'a mut Dir> {
        let n = self.node(st, ino)?;
        if n.attrs.kind != FileKind::Dir {
            return Err(Error::Os(libc::ENOTDIR));
        }
        if n.dir.is_none() {
            let size = n.attrs.size as usize;
            let bytes = self.read_at(st, ino, 0, size)?;
            let mut d = decode_dir(&bytes).map_err(|e| Error::Corrupt(format!("exofs directory {ino}: {e}")))?;
            // A record whose inode did not reach the disk before a crash names nothing: it goes.
            let before = d.len();
            d.retain(|_, (i, _)| st.paths.contains_key(i) || st.nodes.contains_key(i));
            let dropped = before - d.len();
            self.node(st, ino)?.dir = Some(d);
            if dropped > 0 {
                tracing::warn!("exofs: directory {ino}: dropped {dropped} entries whose inodes were lost in a crash");
                self.dir_changed(st, ino)?;
            }
        }
        Ok(self.node(st, ino)?.dir.as_mut().expect("read"))
    }

    /// A directory's entries changed (in memory): they are written back with its inode
    /// ([`Fs::sync`]).
    fn dir_changed(&self, st: &mut State, ino: u64) -> Result<()> {
        let n = self.node(st, ino)?;
        n.dir_dirty = true;
        n.attrs.mtime = SystemTime::now();
        n.attrs.ctime = n.attrs.mtime;
        n.dirty = true;
        Ok(())
    }

    /// A directory's entries replaced.
    fn store_dir(&self, st: &mut State, ino: u64, d: Dir) -> Result<()> {
        *self.dir(st, ino)? = d;
        self.dir_changed(st, ino)
    }

    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<(u64, Inode)> {
        let mut st = self.lock();
        let (ino, _) = *self.dir(&mut st, parent)?.get(name).ok_or(Error::Os(libc::ENOENT))?;
        let attrs = self.node(&mut st, ino)?.attrs.clone();
        Ok((ino, attrs))
    }

    /// Make `name` in `parent` (a file, directory, symlink or special file).
    pub fn make(&self, parent: u64, name: &OsStr, attrs: Inode, content: &[u8]) -> Result<u64> {
        if !valid_name(name) {
            return Err(Error::Os(if name.len() > 255 { libc::ENAMETOOLONG } else { libc::EINVAL }));
        }
        let mut st = self.lock();
        if self.dir(&mut st, parent)?.contains_key(name) {
            return Err(Error::Os(libc::EEXIST));
        }
        let kind = attrs.kind;
        let is_dir = kind == FileKind::Dir;
        let inherited = self.node(&mut st, parent)?.xattrs.get(PERSISTENCE_XATTR).cloned();
        let ino = self.with_room(&mut st, |st| {
            let ino = self.new_inode(st, attrs.clone(), parent)?;
            if let Some(model) = &inherited {
                // A directory's persistence model goes to what is made in it.
                self.node(st, ino)?.xattrs.insert(PERSISTENCE_XATTR.to_vec(), model.clone());
            }
            if !content.is_empty() {
                if let Err(e) = self.set_content(st, ino, content) {
                    // Nothing names it: it goes back.
                    self.free_inode(st, ino)?;
                    return Err(e);
                }
            }
            Ok(ino)
        })?;
        self.dir(&mut st, parent)?.insert(name.to_owned(), (ino, kind));
        self.dir_changed(&mut st, parent)?;
        if is_dir {
            self.node(&mut st, parent)?.attrs.nlink += 1;
        }
        self.settle(&mut st, ino, true)?;
        Ok(ino)
    }

    /// Remove `name` from `parent`; the inode goes when its last link does.
    pub fn remove(&self, parent: u64, name: &OsStr, dir: bool) -> Result<()> {
        let mut st = self.lock();
        let (ino, kind) = *self.dir(&mut st, parent)?.get(name).ok_or(Error::Os(libc::ENOENT))?;
        match (dir, kind == FileKind::Dir) {
            (true, false) => return Err(Error::Os(libc::ENOTDIR)),
            (false, true) => return Err(Error::Os(libc::EISDIR)),
            (true, true) if !self.dir(&mut st, ino)?.is_empty() => return Err(Error::Os(libc::ENOTEMPTY)),
            _ => {}
        }
        self.dir(&mut st, parent)?.remove(name);
        self.dir_changed(&mut st, parent)?;
        if dir {
            self.node(&mut st, parent)?.attrs.nlink -= 1;
        }
        let n = self.node(&mut st, ino)?;
        n.attrs.nlink = n.attrs.nlink.saturating_sub(if dir { 2 } else { 1 });
        n.attrs.ctime = SystemTime::now();
        n.dirty = true;
        self.maybe_free(&mut st, ino)?;
        self.settle(&mut st, parent, true)
    }

    /// Free `ino` if nothing names, holds or knows it any more.
    fn maybe_free(&self, st: &mut State, ino: u64) -> Result<()> {
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

    /// A second name for `ino`.
    pub fn link(&self, ino: u64, parent: u64, name: &OsStr) -> Result<Inode> {
        if !valid_name(name) {
            return Err(Error::Os(libc::ENAMETOOLONG));
        }
        let mut st = self.lock();
        let kind = self.node(&mut st, ino)?.attrs.kind;
        if kind == FileKind::Dir {
            return Err(Error::Os(libc::EPERM));
        }
        let d = self.dir(&mut st, parent)?;
        if d.contains_key(name) {
            return Err(Error::Os(libc::EEXIST));
        }
        d.insert(name.to_owned(), (ino, kind));
        self.dir_changed(&mut st, parent)?;
        let n = self.node(&mut st, ino)?;
        n.attrs.nlink += 1;
        n.attrs.ctime = SystemTime::now();
        n.dirty = true;
        let attrs = n.attrs.clone();
        self.settle(&mut st, parent, true)?;
        Ok(attrs)
    }

    /// `rename(2)`, with `RENAME_NOREPLACE`, `RENAME_EXCHANGE` and `RENAME_WHITEOUT`: with
    /// `whiteout` (the new inode's attributes: a character device 0:0), the old name is left to a
    /// whiteout in the same change, as overlayfs needs of its upper directory. Any other flag,
    /// or `RENAME_EXCHANGE` with another, is refused with `EINVAL` (xfstests generic/078 found
    /// `RENAME_WHITEOUT` ignored).
    pub fn rename(&self, parent: u64, name: &OsStr, new_parent: u64, new_name: &OsStr, flags: u32, whiteout: Option<Inode>) -> Result<()> {
        let (noreplace, exchange, white) = (libc::RENAME_NOREPLACE, libc::RENAME_EXCHANGE, libc::RENAME_WHITEOUT);
        if flags & !(noreplace | exchange | white) != 0
            || flags & exchange != 0 && flags != exchange
            || (flags & white != 0) != whiteout.is_some()
        {
            return Err(Error::Os(libc::EINVAL));
        }
        if !valid_name(new_name) {
            return Err(Error::Os(libc::ENAMETOOLONG));
        }
        let mut st = self.lock();
        let mut from = self.dir(&mut st, parent)?.clone();
        let (ino, kind) = *from.get(name).ok_or(Error::Os(libc::ENOENT))?;
        let mut to = if new_parent == parent { from.clone() } else { self.dir(&mut st, new_parent)?.clone() };
        let existing = to.get(new_name).copied();
        if flags & libc::RENAME_EXCHANGE != 0 {
            let (other, okind) = existing.ok_or(Error::Os(libc::ENOENT))?;
            if new_parent == parent {
                from.insert(name.to_owned(), (other, okind));
                from.insert(new_name.to_owned(), (ino, kind));
                self.store_dir(&mut st, parent, from)?;
            } else {
                from.insert(name.to_owned(), (other, okind));
                to.insert(new_name.to_owned(), (ino, kind));
                self.store_dir(&mut st, parent, from)?;
                self.store_dir(&mut st, new_parent, to)?;
                let moved_dirs = (kind == FileKind::Dir) as i32 - (okind == FileKind::Dir) as i32;
                self.adjust_links(&mut st, parent, -moved_dirs)?;
                self.adjust_links(&mut st, new_parent, moved_dirs)?;
            }
            for i in [ino, other] {
                let n = self.node(&mut st, i)?;
                n.attrs.ctime = SystemTime::now();
                n.dirty = true;
            }
            self.settle(&mut st, parent, true)?;
            return self.settle(&mut st, new_parent, true);
        }
        if let Some((other, okind)) = existing {
            if other == ino {
                return Ok(());
            }
            if flags & libc::RENAME_NOREPLACE != 0 {
                return Err(Error::Os(libc::EEXIST));
            }
            match (kind == FileKind::Dir, okind == FileKind::Dir) {
                (true, false) => return Err(Error::Os(libc::ENOTDIR)),
                (false, true) => return Err(Error::Os(libc::EISDIR)),
                (true, true) if !self.dir(&mut st, other)?.is_empty() => return Err(Error::Os(libc::ENOTEMPTY)),
                _ => {}
            }
        }
        from.remove(name);
        if let Some(attrs) = whiteout {
            let w = self.new_inode(&mut st, attrs, parent)?;
            from.insert(name.to_owned(), (w, FileKind::CharDevice));
            self.settle(&mut st, w, true)?;
        }
        if new_parent == parent {
            from.insert(new_name.to_owned(), (ino, kind));
            self.store_dir(&mut st, parent, from)?;
        } else {
            to.insert(new_name.to_owned(), (ino, kind));
            self.store_dir(&mut st, parent, from)?;
            self.store_dir(&mut st, new_parent, to)?;
            if kind == FileKind::Dir {
                self.adjust_links(&mut st, parent, -1)?;
                self.adjust_links(&mut st, new_parent, 1)?;
            }
        }
        let n = self.node(&mut st, ino)?;
        n.attrs.ctime = SystemTime::now();
        n.dirty = true;
        if let Some((other, okind)) = existing {
            let n = self.node(&mut st, other)?;
            n.attrs.nlink = n.attrs.nlink.saturating_sub(if okind == FileKind::Dir { 2 } else { 1 });
            n.attrs.ctime = SystemTime::now();
            n.dirty = true;
            if okind == FileKind::Dir {
                self.adjust_links(&mut st, new_parent, -1)?;
            }
            self.maybe_free(&mut st, other)?;
        }
        self.settle(&mut st, parent, true)?;
        self.settle(&mut st, new_parent, true)
    }

    fn adjust_links(&self, st: &mut State, ino: u64, by: i32) -> Result<()> {
        let n = self.node(st, ino)?;
        n.attrs.nlink = (n.attrs.nlink as i64 + by as i64).max(0) as u32;
        n.dirty = true;
        Ok(())
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

    fn free_inode(&self, st: &mut State, ino: u64) -> Result<()> {
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

    // ---- contents --------------------------------------------------------------------------

    /// Bytes `off..off + len` of `ino` (clipped at its size).
    pub fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        let mut st = self.lock();
        self.read_at(&mut st, ino, off, len)
    }

    fn read_at(&self, st: &mut State, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
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
        let (s0, s1) = (off / SECTOR, end.div_ceil(SECTOR));
        let mut buf = vec![0u8; ((s1 - s0) * SECTOR) as usize];
        self.read_sectors(&n, s0, &mut buf)?;
        // The bytes asked for, without another copy when they start on a sector.
        buf.drain(..(off - s0 * SECTOR) as usize);
        buf.truncate((end - off) as usize);
        Ok(buf)
    }

    /// `ino`'s bytes changed: what was read ahead of them goes.
    fn forget_ahead(st: &mut State, ino: u64) {
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
            let parts = Self::pieces(&shape, 0, n.attrs.size.div_ceil(SECTOR));
            if parts.iter().any(|p| p.2.is_none()) {
                continue;
            }
            files.push((i, pieces.len(), parts.len(), n.attrs.size));
            for (_, len, disk) in parts {
                let (at, held) = disk.expect("no holes");
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

    /// The pieces of file sectors `s0..s1`: (file sector, count, volume sector or `None` for a
    /// hole).
    fn pieces(n: &Shape, s0: u64, s1: u64) -> Vec<Piece> {
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
    fn extent_home(&self, n: &Shape, held: bool) -> Target {
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
    fn ensure_holder(&self, st: &mut State, ino: u64) -> Result<()> {
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
    fn read_sectors(&self, n: &Shape, first: u64, buf: &mut [u8]) -> Result<()> {
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
    fn write_sectors(&self, n: &Shape, first: u64, data: &[u8]) -> Result<()> {
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

    /// Replace the whole content of `ino` with `bytes`.
    fn set_content(&self, st: &mut State, ino: u64, bytes: &[u8]) -> Result<()> {
        self.truncate_at(st, ino, 0)?;
        self.write_at(st, ino, 0, bytes)
    }

    /// Write `data` at `off`.
    pub fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<()> {
        let mut st = self.lock();
        let grew = data.len() as u64 + off > self.node(&mut st, ino)?.attrs.size;
        self.with_room(&mut st, |st| self.write_at(st, ino, off, data))?;
        self.settle(&mut st, ino, grew)
    }

    /// A change to `ino` made durable before it is answered when its model asks for that:
    /// `data`, any change; `metadata`, a change to more than the bytes of a file (`meta`). The
    /// whole file system is written back then, as a journal commits (the directory naming a
    /// new file, and the table naming its inode, go with it).
    fn settle(&self, st: &mut State, ino: u64, meta: bool) -> Result<()> {
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
    fn model(n: &Node) -> Option<Persistence> {
        match n.xattrs.get(PERSISTENCE_XATTR).map(|v| v.as_slice()) {
            Some(b"data") => Some(Persistence::Data),
            Some(b"metadata") => Some(Persistence::Metadata),
            Some(b"memory") => Some(Persistence::Memory),
            _ => None,
        }
    }

    // ---- extended attributes ----------------------------------------------------------------

    pub fn get_xattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        let mut st = self.lock();
        self.node(&mut st, ino)?.xattrs.get(name).cloned().ok_or(Error::Os(libc::ENODATA))
    }

    pub fn list_xattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        let mut st = self.lock();
        Ok(self.node(&mut st, ino)?.xattrs.keys().cloned().collect())
    }

    /// Set (`value`) or remove (`None`) an extended attribute, with `XATTR_CREATE` and
    /// `XATTR_REPLACE`. `user.exofs.persistence` takes `data`, `metadata` or `memory`.
    pub fn set_xattr(&self, ino: u64, name: &[u8], value: Option<&[u8]>, flags: i32) -> Result<()> {
        if name.is_empty() || name.len() > 255 {
            return Err(Error::Os(libc::ERANGE));
        }
        if name == PERSISTENCE_XATTR && value.is_some_and(|v| !matches!(v, b"data" | b"metadata" | b"memory")) {
            return Err(Error::BadArgs(format!(
                "{}: '{}' is not a persistence model (data, metadata or memory)",
                String::from_utf8_lossy(PERSISTENCE_XATTR),
                String::from_utf8_lossy(value.unwrap_or_default())
            )));
        }
        let mut st = self.lock();
        let n = self.node(&mut st, ino)?;
        let exists = n.xattrs.contains_key(name);
        match value {
            Some(v) => {
                if flags & libc::XATTR_CREATE != 0 && exists {
                    return Err(Error::Os(libc::EEXIST));
                }
                if flags & libc::XATTR_REPLACE != 0 && !exists {
                    return Err(Error::Os(libc::ENODATA));
                }
                let others: usize = n.xattrs.iter().filter(|(k, _)| k.as_slice() != name).map(|(k, v)| 3 + k.len() + v.len()).sum();
                if others + 3 + name.len() + v.len() > XATTR_MAX {
                    return Err(Error::Os(libc::ENOSPC));
                }
                n.xattrs.insert(name.to_vec(), v.to_vec());
            }
            None => {
                if n.xattrs.remove(name).is_none() {
                    return Err(Error::Os(libc::ENODATA));
                }
            }
        }
        n.attrs.ctime = SystemTime::now();
        n.dirty = true;
        self.settle(&mut st, ino, true)
    }

    /// Change the bytes held in the inode (in memory; stored at write-back).
    fn edit_immediate(&self, st: &mut State, ino: u64, edit: impl FnOnce(&mut Vec<u8>)) -> Result<()> {
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
    fn may_buffer(st: &State, n: &Node, size: u64) -> bool {
        if matches!(Self::model(n), Some(Persistence::Data | Persistence::Metadata)) {
            return size as usize <= IMMEDIATE_MAX && n.extents.is_empty();
        }
        let limit = if st.buffered + size as usize <= BUFFER_TOTAL + n.immediate.len() { BUFFER_MAX } else { IMMEDIATE_MAX };
        n.extents.is_empty() && size as usize <= limit
    }

    /// Give a file whose bytes are held in memory extents for them and write them there now.
    /// On a failure the bytes stay in memory, and the file without extents.
    fn spill(&self, st: &mut State, ino: u64) -> Result<()> {
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

    fn write_at(&self, st: &mut State, ino: u64, off: u64, data: &[u8]) -> Result<()> {
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
    fn write_store(&self, st: &mut State, ino: u64, off: u64, data: &[u8]) -> Result<()> {
        let end = off + data.len() as u64;
        let (s0, s1) = (off / SECTOR, end.div_ceil(SECTOR));
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

    /// A plain file grows from `from` to `to` bytes without those bytes being written: what its
    /// extents hold there (room taken ahead by appends, never written) is zeroed.
    fn zero_past_end(&self, st: &mut State, ino: u64, from: u64, to: u64) -> Result<()> {
        let shape = self.node(st, ino)?.shape();
        let end = shape.extents.iter().map(|e| (e.logical + e.sectors) * SECTOR).max().unwrap_or(0);
        let to = to.min(end);
        if from >= to {
            return Ok(());
        }
        let (s0, s1) = (from / SECTOR, to.div_ceil(SECTOR));
        for (at, len, disk) in Self::pieces(&shape, s0, s1) {
            if disk.is_none() {
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

    /// Give the holes in file sectors `s0..s1` extents of their own, near what comes before:
    /// the file sectors given them, for [`uncover`](Self::uncover) if what follows fails. On a
    /// failure (the volume full) the file is left as it was.
    fn cover(&self, st: &mut State, ino: u64, s0: u64, s1: u64) -> Result<Vec<(u64, u64)>> {
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
    fn uncover(&self, st: &mut State, ino: u64, added: &[(u64, u64)]) {
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

    // ---- insertion and removal in the middle (the thesis's indexed insert, §5.4.1) ---------

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
            segs.insert(i + 1, Seg { logical: at, len: s.len - head, store: s.store + head });
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

    /// The pieces of file bytes `off..end`: (file byte, bytes, store byte).
    fn seg_pieces(segs: &[Seg], off: u64, end: u64) -> Vec<(u64, u64, u64)> {
        let first = segs.partition_point(|s| s.logical + s.len <= off);
        let mut out = Vec::new();
        for s in &segs[first..] {
            if s.logical >= end {
                break;
            }
            let (a, b) = (off.max(s.logical), end.min(s.logical + s.len));
            out.push((a, b - a, s.store + (a - s.logical)));
        }
        out
    }

    /// Store bytes `off..off + len` (holes read as zeros).
    fn read_store(&self, st: &mut State, ino: u64, off: u64, len: u64) -> Result<Vec<u8>> {
        let shape = self.node(st, ino)?.shape();
        let (s0, s1) = (off / SECTOR, (off + len).div_ceil(SECTOR));
        let mut buf = vec![0u8; ((s1 - s0) * SECTOR) as usize];
        self.read_sectors(&shape, s0, &mut buf)?;
        let skip = (off - s0 * SECTOR) as usize;
        Ok(buf[skip..skip + len as usize].to_vec())
    }

    fn read_segmented(&self, st: &mut State, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        let n = self.node(st, ino)?;
        let end = (off + len as u64).min(n.attrs.size);
        if off >= end {
            return Ok(Vec::new());
        }
        let pieces = Self::seg_pieces(n.segs.as_deref().expect("in pieces"), off, end);
        let mut out = Vec::with_capacity((end - off) as usize);
        for (_, l, at) in pieces {
            out.extend_from_slice(&self.read_store(st, ino, at, l)?);
        }
        Ok(out)
    }

    fn write_segmented(&self, st: &mut State, ino: u64, off: u64, data: &[u8]) -> Result<()> {
        let end = off + data.len() as u64;
        if end > self.node(st, ino)?.attrs.size {
            self.extend_pieces(st, ino, end)?;
        }
        let n = self.node(st, ino)?;
        let pieces = Self::seg_pieces(n.segs.as_deref().expect("in pieces"), off, end);
        for (at, l, store) in pieces {
            let from = (at - off) as usize;
            self.write_store(st, ino, store, &data[from..from + l as usize])?;
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

    fn truncate_segmented(&self, st: &mut State, ino: u64, size: u64) -> Result<()> {
        let old = self.node(st, ino)?.attrs.size;
        if size > old {
            return self.extend_pieces(st, ino, size);
        }
        if size < old {
            self.remove_range_at(st, ino, size, old - size)?;
        }
        Ok(())
    }

    /// Free the store's sectors `s0..s1` (no piece uses them): extents inside go, extents
    /// across an end are split there.
    fn free_store(&self, st: &mut State, ino: u64, s0: u64, s1: u64) -> Result<()> {
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

    /// Set the size of `ino`.
    pub fn truncate(&self, ino: u64, size: u64) -> Result<()> {
        let mut st = self.lock();
        self.with_room(&mut st, |st| self.truncate_at(st, ino, size))?;
        self.settle(&mut st, ino, true)
    }

    fn truncate_at(&self, st: &mut State, ino: u64, size: u64) -> Result<()> {
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
            if Self::pieces(&node, s, s + 1)[0].2.is_some() {
                let mut buf = vec![0u8; SECTOR as usize];
                self.read_sectors(&node, s, &mut buf)?;
                buf[(size % SECTOR) as usize..].fill(0);
                self.write_sectors(&node, s, &buf)?;
            }
        }
        Ok(())
    }

    /// A read of `ino` moves its access time as Linux's default `relatime` does: when it is not
    /// later than the last modification or change, or is a day old (xfstests generic/192).
    /// Otherwise nothing changes, so reading stays free of write-back.
    pub fn note_read(&self, ino: u64) -> Result<()> {
        let mut st = self.lock();
        let n = self.node(&mut st, ino)?;
        let now = SystemTime::now();
        let a = &n.attrs;
        let day_old = now.duration_since(a.atime).is_ok_and(|d| d >= std::time::Duration::from_secs(24 * 3600));
        if a.atime <= a.mtime || a.atime <= a.ctime || day_old {
            n.attrs.atime = now;
            n.dirty = true;
            self.settle(&mut st, ino, true)?;
        }
        Ok(())
    }

    /// Change attributes (the caller checked who may).
    pub fn set_attrs(&self, ino: u64, change: impl FnOnce(&mut Inode)) -> Result<Inode> {
        let mut st = self.lock();
        let n = self.node(&mut st, ino)?;
        change(&mut n.attrs);
        n.dirty = true;
        let attrs = n.attrs.clone();
        self.settle(&mut st, ino, true)?;
        Ok(attrs)
    }

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

    fn write_back(&self, st: &mut State) -> Result<()> {
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
            return Err(exo(e));
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
                return Err(exo(e));
            }
            for &(_, ino) in chunk {
                let n = st.nodes.get_mut(&ino).expect("listed");
                (n.dirty, n.imm_dirty, n.map_dirty, n.holder_dirty, n.fresh) = (false, false, false, false, false);
            }
        }
        if st.tables_dirty {
            let reqs = st.tables.iter().map(|t| Request::WriteRecord { target: WTarget::from(&self.under_root(&[t.0])), wcap: wc }).collect();
            if let (_, Some(e)) = self.client.batch(reqs) {
                return Err(exo(e));
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
            let total = (st.nodes[&ino].immediate.len() as u64).div_ceil(SECTOR).div_ceil(8) * 8;
            let (mut logical, mut want) = (0u64, total);
            while logical < total {
                want = want.min(total - logical);
                let start = match self.find(st, want, ino) {
                    Ok(s) => s,
                    Err(_) if want > 8 => {
                        want = (want / 2).div_ceil(8) * 8;
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
            let e = exo(e);
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
            return Err(exo(e));
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

    /// The directory's entries, for tests and tools: names and inode numbers.
    pub fn names(&self, ino: u64) -> Result<Vec<(OsString, u64)>> {
        Ok(self.read_dir(ino)?.into_iter().map(|(n, (i, _))| (n, i)).collect())
    }
}
