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
use std::time::Instant;

use parking_lot::Mutex;
use plyfs_exodisk::client::Client;
use plyfs_exodisk::core::{ExoError, Target};

use plyfs_exodisk::object::Caps;
use plyfs_exodisk::proto::WEntry;
use plyfs_stack::{Error, FileKind, Result};

use crate::format::{Dir, Inode, Seg, Xattrs};

mod alloc;
mod attrs;
mod extents;
mod inodes;
mod namespace;
mod pieces;
mod read;
mod sectors;
mod write;
mod writeback;

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
    pub fn open(client: Client, name: &str) -> std::result::Result<Fs, crate::Error> {
        let socket = client.socket().to_owned();
        let exo = |op| {
            let socket = &socket;
            move |source| crate::Error::Exo { socket: socket.clone(), op, source }
        };
        let (r, caps) = client.root_exclusive(name).map_err(exo("claiming the named root"))?;
        let map = client.free_map().map_err(exo("reading the free map"))?;
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
        let socket = || socket.clone();
        let x = fs
            .client
            .map(&fs.under_root(&[]), caps.read)
            .map_err(|source| crate::Error::Exo { socket: socket(), op: "reading the named root", source })?;
        if !x.entries.is_empty() {
            fs.load_tables(name, &x.entries)?;
        }
        if x.entries.is_empty() || fs.mkfs_was_cut_short() {
            fs.mkfs().map_err(|source| crate::Error::Fs { socket: socket(), op: "making the file system", source })?;
        }
        let st = fs.state.lock();
        if !st.paths.contains_key(&st.root) && !st.nodes.contains_key(&st.root) {
            return Err(crate::Error::RootLost { socket: socket(), ino: st.root });
        }
        drop(st);
        Ok(fs)
    }

    /// `map_err(self.exo("writing file data"))`: a request's error as the layer's errno. A
    /// failing volume (`EIO`) is logged, naming the service and what was being done.
    fn exo(&self, op: &'static str) -> impl FnOnce(ExoError) -> Error + '_ {
        move |e| self.exo_error(None, op, e)
    }

    /// [`Fs::exo`] for a request on inode `ino`.
    fn exo_at(&self, ino: u64, op: &'static str) -> impl FnOnce(ExoError) -> Error + '_ {
        move |e| self.exo_error(Some(ino), op, e)
    }

    fn exo_error(&self, ino: Option<u64>, op: &'static str, e: ExoError) -> Error {
        if e.errno == libc::EIO {
            let socket = self.client.socket().display();
            match ino {
                Some(ino) => tracing::error!("exofs: {socket}: inode {ino}: {op}: {}", e.msg),
                None => tracing::error!("exofs: {socket}: {op}: {}", e.msg),
            }
        }
        Error::Os(e.errno)
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
        self.client.add_data(&self.under_root(&[]), self.caps.write, Some(0), &sb).map_err(self.exo("writing the superblock"))?;
        let root = Inode::new(FileKind::Dir, 0o755, unsafe { libc::geteuid() }, unsafe { libc::getegid() });
        let ino = self.new_inode(&mut st, root, self.r)?;
        st.root = ino;
        let mut sb = MAGIC.to_vec();
        sb.extend_from_slice(&ino.to_le_bytes());
        self.client.add_data(&self.under_root(&[]), self.caps.write, Some(0), &sb).map_err(self.exo("writing the superblock"))?;
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

    fn load_tables(&self, name: &str, entries: &[WEntry]) -> std::result::Result<(), crate::Error> {
        let socket = || self.client.socket().to_owned();
        let mut st = self.lock();
        match entries.first() {
            Some(WEntry::Data(d)) if d.len() == 16 && &d[..8] == MAGIC => {
                st.root = u64::from_le_bytes(d[8..16].try_into().expect("8"))
            }
            _ => return Err(crate::Error::NotExofs { socket: socket(), root: name.to_owned() }),
        }
        for (k, e) in entries.iter().enumerate().skip(1) {
            if let WEntry::Descendant { at } = e {
                let t = self
                    .client
                    .map(&self.under_root(&[k as u32]), self.caps.read)
                    .map_err(|source| crate::Error::Exo { socket: socket(), op: "reading an inode table", source })?;
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

    /// The socket of the exodisk service the file system is on.
    pub fn socket(&self) -> &std::path::Path {
        self.client.socket()
    }

    /// The root directory's inode number.
    pub fn root(&self) -> u64 {
        self.lock().root
    }
}
