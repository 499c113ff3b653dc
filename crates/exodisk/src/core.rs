//! The service's protection core: the thesis's operations on extents and exonodes, each checked
//! against the capabilities presented, over the volume, the free map and the metadata cache.
//!
//! It does not know who its clients are or how they reach it (the socket service wraps it); tests
//! and offline tools use it directly.
//!
//! Ordering on disk keeps the invariants through any crash:
//! - allocating: the free-map bits first, then the record;
//! - freeing: the record that gives sectors up first (overwritten, or rewritten without them), the
//!   free-map bits after;
//! - a descendant: the child's record before the parent names it, and the parent's record without
//!   it before the child is overwritten (an exonode its parent does not name is an orphan the scan
//!   reclaims);
//! - extent data: a data sector's seal before its bytes, and sectors allocated as extent data have
//!   their seals emptied first, so that they read as zeros, not as an earlier owner's data
//!   (`content`).

use std::collections::{BTreeSet, HashMap};

use crate::disk::{Aligned, Disk, SECTOR};
use crate::freemap::FreeMap;
use crate::layout::{Superblock, BITS_PER_BLOCK};
use crate::content::DataSeal;
use crate::object::{Cap, Caps, Entry, Exonode, ExtentHeader, MAX_EXONODE_SECTORS};
use crate::seal::VolumeKey;

/// When an object's changes reach the disk (thesis §5.4.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persistence {
    /// Metadata stays in the service's memory; the object is gone after a restart.
    Memory,
    /// Metadata is written and flushed before a change is answered; data writes are not flushed.
    Metadata,
    /// Metadata and data are written and flushed before they are answered.
    Data,
}

impl Persistence {
    /// Its code in a record.
    pub fn code(self) -> u8 {
        match self {
            Persistence::Memory => 0,
            Persistence::Metadata => 1,
            Persistence::Data => 2,
        }
    }

    pub fn from_code(c: u8) -> Persistence {
        match c {
            0 => Persistence::Memory,
            2 => Persistence::Data,
            _ => Persistence::Metadata,
        }
    }
}

/// An error for the client: an errno and one line saying why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExoError {
    pub errno: i32,
    pub msg: String,
}

impl std::fmt::Display for ExoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

pub type Result<T> = std::result::Result<T, ExoError>;

fn err<T>(errno: i32, msg: impl Into<String>) -> Result<T> {
    Err(ExoError { errno, msg: msg.into() })
}

/// A data sector whose seal did not open: `EIO`, as a disk's unreadable sector.
pub fn unsealed(u: crate::content::Unsealed) -> ExoError {
    ExoError { errno: libc::EIO, msg: format!("sector {}: its data fail authentication (altered, or torn by a crash)", u.sector) }
}

fn io_err(e: std::io::Error) -> ExoError {
    ExoError { errno: e.raw_os_error().unwrap_or(libc::EIO), msg: format!("volume: {e}") }
}

/// What an operation names: an extent (by its first sector), or an exonode reached from the
/// exonode at `at` through the descendant entries of `path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Extent(u64),
    Exonode { at: u64, path: Vec<u32> },
    Proxy(u64),
}

/// The access an operation needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

#[derive(Clone, Debug)]
enum Obj {
    Extent(ExtentHeader),
    Exonode(Exonode),
}

struct Cached {
    obj: Obj,
    persistence: Persistence,
    /// Its record was written since it was allocated (so freeing must overwrite it).
    on_disk: bool,
    /// Changed since last written.
    dirty: bool,
    /// For LRU replacement (a counter).
    used: u64,
    /// Sectors it gave up while its record on the disk still names them (a `memory`-model
    /// object written before, changed since): freed only once the record is written again or
    /// overwritten, so that a crash never leaves a record naming free sectors.
    stale_frees: Vec<(u64, u64)>,
}

/// A proxy (thesis §2.2.3, unbuilt there): part of an object under new capabilities, in memory
/// only.
#[derive(Clone, Debug)]
pub struct Proxy {
    pub target: Target,
    pub caps: Caps,
    /// The most it may do: what the capability it was made with allowed.
    pub access: Access,
    /// Sectors it covers (an extent's or an exonode's extents, intersected at each use).
    pub sectors: Option<(u64, u64)>,
    /// The exonode's entries it grants, when it grants only some: I/O on their extents, and
    /// `MAP` and `READ_DATA` showing only them. No other entry operation goes through it.
    pub entries: Option<Vec<u32>>,
}

pub struct Core {
    disk: Disk,
    key: VolumeKey,
    /// Extent data's seals (shared with the service's disk queue, which opens what it reads).
    content: std::sync::Arc<DataSeal>,
    pub sb: Superblock,
    map: FreeMap,
    map_dirty: BTreeSet<u64>,
    cache: HashMap<u64, Cached>,
    clock: u64,
    proxies: HashMap<u64, Proxy>,
    next_proxy: u64,
    /// In a batch: records are written without a flush each, and sectors given up are freed in
    /// the map only after the one flush at its end (so that a cleared bit never reaches the
    /// disk before the record that gave the sectors up).
    batch: Option<Batch>,
    /// Something a record may depend on (free-map blocks, emptied data seals) was written since
    /// the last flush: the next record waits for a flush, since the disk may otherwise take
    /// the record first.
    unflushed_deps: bool,
}

#[derive(Default)]
struct Batch {
    unflushed: bool,
    freed: Vec<(u64, u64)>,
}

/// The sectors an extent's data takes: after its header.
fn extent_data(at: u64, h: &ExtentHeader) -> (u64, u64) {
    (at + 1, at + h.sectors)
}

impl Core {
    /// Take over a volume whose map the start-up scan reconciled.
    pub fn new(disk: Disk, key: VolumeKey, sb: Superblock, map: FreeMap) -> Core {
        let content = DataSeal::new(key.data_key(), disk.fd(), disk.write_log(), sb.tags_start, sb.tag_sectors);
        Core {
            disk,
            key,
            content: std::sync::Arc::new(content),
            sb,
            map,
            map_dirty: BTreeSet::new(),
            cache: HashMap::new(),
            clock: 0,
            proxies: HashMap::new(),
            next_proxy: 1,
            batch: None,
            unflushed_deps: false,
        }
    }

    /// Start a batch of requests: what they write is flushed once, by [`Core::end_batch`]. With
    /// `records`, what was written before (file data) is flushed first, so that no record
    /// written in the batch reaches the disk before the data it describes.
    pub fn begin_batch(&mut self, records: bool) -> Result<()> {
        if records {
            self.sync_disk()?;
        }
        self.batch = Some(Batch::default());
        Ok(())
    }

    /// End a batch: one flush, then the sectors its requests gave up are freed.
    pub fn end_batch(&mut self) -> Result<()> {
        let Some(b) = self.batch.take() else { return Ok(()) };
        if b.unflushed {
            self.sync_disk()?;
        }
        for (start, len) in b.freed {
            self.mark(start, len, false);
        }
        if !self.map_dirty.is_empty() {
            self.flush_map()?;
        }
        Ok(())
    }

    /// Make what was just written durable now, or at the end of the batch.
    fn settle(&mut self) -> Result<()> {
        match &mut self.batch {
            Some(b) => {
                b.unflushed = true;
                Ok(())
            }
            None => self.sync_disk(),
        }
    }

    pub fn free_map(&self) -> &FreeMap {
        &self.map
    }

    pub fn disk(&self) -> &Disk {
        &self.disk
    }

    /// Extent data's seals: data is sealed before it is written and opened after it is read.
    pub fn content(&self) -> std::sync::Arc<DataSeal> {
        self.content.clone()
    }

    /// Sectors just allocated as extent data read as zeros until written.
    fn forget_data(&mut self, start: u64, len: u64) -> Result<()> {
        self.unflushed_deps = true;
        self.content.forget(start, len).map_err(io_err)
    }

    /// Flush the volume.
    fn sync_disk(&mut self) -> Result<()> {
        self.disk.sync().map_err(io_err)?;
        self.unflushed_deps = false;
        Ok(())
    }

    // ---- the metadata cache --------------------------------------------------------------

    /// Bring the record at `at` into the cache (EXTENT_READ / EXONODE_READ).
    pub fn load(&mut self, at: u64) -> Result<()> {
        self.clock += 1;
        if let Some(c) = self.cache.get_mut(&at) {
            c.used = self.clock;
            return Ok(());
        }
        if !self.map.is_allocated(at) || at < self.sb.data_start || at >= self.sb.sectors {
            return err(libc::ENOENT, format!("sector {at}: no extent or exonode there"));
        }
        let mut first = Aligned::zeroed(SECTOR);
        self.disk.read(at, &mut first).map_err(io_err)?;
        let obj = if let Some(n) = crate::seal::record_sectors(&first, crate::seal::EXONODE) {
            if at + n as u64 > self.sb.sectors {
                return err(libc::EIO, format!("sector {at}: an exonode past the end of the volume"));
            }
            let mut whole = Aligned::zeroed(n as usize * SECTOR);
            self.disk.read(at, &mut whole).map_err(io_err)?;
            Obj::Exonode(
                Exonode::open(&self.key, at, &whole)
                    .map_err(|e| ExoError { errno: libc::EIO, msg: format!("the exonode at {at}: {e}") })?,
            )
        } else if crate::seal::record_sectors(&first, crate::seal::EXTENT).is_some() {
            Obj::Extent(
                ExtentHeader::open(&self.key, at, &first)
                    .map_err(|e| ExoError { errno: libc::EIO, msg: format!("the extent at {at}: {e}") })?,
            )
        } else {
            return err(libc::ENOENT, format!("sector {at}: no extent or exonode there"));
        };
        let persistence = Persistence::from_code(match &obj {
            Obj::Extent(h) => h.model,
            Obj::Exonode(x) => x.model,
        });
        self.cache.insert(at, Cached { obj, persistence, on_disk: true, dirty: false, used: self.clock, stale_frees: Vec::new() });
        Ok(())
    }

    /// Whether the record at `at` is cached (IN_CACHE).
    pub fn in_cache(&self, at: u64) -> bool {
        self.cache.contains_key(&at)
    }

    /// Make the record at `at` the next to be replaced (MARK_REPLACEMENT).
    pub fn mark_replacement(&mut self, at: u64) -> bool {
        match self.cache.get_mut(&at) {
            Some(c) => {
                c.used = 0;
                true
            }
            None => false,
        }
    }

    /// Drop clean records beyond `keep`, least recently used first (records of `memory`
    /// objects and dirty ones stay: they exist nowhere else).
    pub fn trim_cache(&mut self, keep: usize) {
        if self.cache.len() <= keep {
            return;
        }
        let mut clean: Vec<(u64, u64)> =
            self.cache.iter().filter(|(_, c)| !c.dirty && c.persistence != Persistence::Memory).map(|(a, c)| (c.used, *a)).collect();
        clean.sort_unstable();
        for (_, at) in clean.into_iter().take(self.cache.len() - keep) {
            self.cache.remove(&at);
        }
    }

    // ---- writing metadata ----------------------------------------------------------------

    fn seal(&self, at: u64, obj: &Obj) -> Vec<u8> {
        match obj {
            Obj::Extent(h) => h.seal(&self.key, at),
            Obj::Exonode(x) => x.seal(&self.key, at),
        }
    }

    /// Write the record at `at` if its model says so now (or `force`: EXTENT_WRITE /
    /// EXONODE_WRITE), with the free-map blocks it depends on first.
    fn persist(&mut self, at: u64, force: bool) -> Result<()> {
        let Some(c) = self.cache.get(&at) else { return Ok(()) };
        if !c.dirty || (c.persistence == Persistence::Memory && !force) {
            return Ok(());
        }
        let bytes = self.seal(at, &c.obj);
        self.flush_map()?;
        // The free-map bits and the emptied seals first, then the record (a disk may reorder
        // the writes between two flushes).
        if self.unflushed_deps {
            self.sync_disk()?;
        }
        self.disk.write(at, &Aligned::from_bytes(&bytes)).map_err(io_err)?;
        self.settle()?;
        let c = self.cache.get_mut(&at).expect("cached");
        c.dirty = false;
        c.on_disk = true;
        let freed = std::mem::take(&mut c.stale_frees);
        self.free_now(&freed)
    }

    /// Free `ranges` (in a batch, after its flush) and write the map.
    fn free_now(&mut self, ranges: &[(u64, u64)]) -> Result<()> {
        for &(start, len) in ranges {
            self.mark(start, len, false);
        }
        if !ranges.is_empty() {
            self.flush_map()?;
        }
        Ok(())
    }

    /// Write the free-map blocks changed since last time.
    fn flush_map(&mut self) -> Result<()> {
        for b in std::mem::take(&mut self.map_dirty) {
            self.unflushed_deps = true;
            let from = b * BITS_PER_BLOCK;
            self.map.store_range(&self.disk, &self.key, &self.sb, from, from + 1).map_err(io_err)?;
        }
        Ok(())
    }

    fn mark(&mut self, start: u64, len: u64, allocated: bool) {
        if let (false, Some(b)) = (allocated, &mut self.batch) {
            b.freed.push((start, len));
            return;
        }
        self.map.set(start, len, allocated);
        if len > 0 {
            for b in start / BITS_PER_BLOCK..=(start + len - 1) / BITS_PER_BLOCK {
                self.map_dirty.insert(b);
            }
        }
    }

    /// Sectors `start..start + len` given up by the object at `owner`: freed now if its record
    /// on the disk no longer names them (rewritten, or never written), else when it is.
    fn release(&mut self, owner: u64, start: u64, len: u64, persistent: bool) -> Result<()> {
        if let Some(c) = self.cache.get_mut(&owner).filter(|c| c.on_disk && c.dirty) {
            c.stale_frees.push((start, len));
            return Ok(());
        }
        self.mark(start, len, false);
        if persistent {
            self.flush_map()?;
        }
        Ok(())
    }

    fn check_free(&self, start: u64, len: u64) -> Result<()> {
        if len == 0 || start < self.sb.data_start || start.checked_add(len).is_none_or(|e| e > self.sb.sectors) {
            return err(libc::EINVAL, format!("sectors {start}..{}: not in the volume's object area", start.saturating_add(len)));
        }
        if !self.map.is_free(start, len) {
            return err(libc::EEXIST, format!("sectors {start}..{}: already allocated", start + len));
        }
        Ok(())
    }

    // ---- access checks ---------------------------------------------------------------------

    fn check_cap(caps: &Caps, cap: Cap, want: Access, what: &str) -> Result<()> {
        let ok = cap != 0
            && match want {
                Access::Read => cap == caps.read || cap == caps.write,
                Access::Write => cap == caps.write,
            };
        if ok {
            return Ok(());
        }
        err(libc::EACCES, format!("{what}: wrong {} capability", if want == Access::Read { "read" } else { "write" }))
    }

    /// The exonode `target` names, after checking `cap` for `want` at its first exonode: its
    /// sector. Access to an ancestor reaches its descendants.
    fn exonode_at(&mut self, target: &Target, cap: Cap, want: Access) -> Result<u64> {
        let (mut at, path) = match target {
            Target::Exonode { at, path } => (*at, path.clone()),
            Target::Extent(at) => return err(libc::EINVAL, format!("sector {at}: an extent, not an exonode")),
            Target::Proxy(id) => {
                let p = self.proxy(*id, cap, want)?;
                if p.sectors.is_some() {
                    return err(libc::EACCES, format!("proxy {id} grants sectors, not the exonode's entries"));
                }
                if let Some(e) = &p.entries {
                    return err(libc::EACCES, format!("proxy {id} grants entries {e:?} only: I/O on them, MAP and READ_DATA"));
                }
                // The proxy's capability was checked: reach the original with its own.
                let real = self.real_caps(&p.target)?;
                let cap = if want == Access::Write { real.write } else { real.read };
                return self.exonode_at(&p.target, cap, want);
            }
        };
        self.load(at)?;
        let caps = match &self.cache[&at].obj {
            Obj::Exonode(x) => x.caps,
            Obj::Extent(_) => return err(libc::EINVAL, format!("sector {at}: an extent, not an exonode")),
        };
        Self::check_cap(&caps, cap, want, &format!("the exonode at {at}"))?;
        for (depth, idx) in path.iter().enumerate() {
            let next = match &self.cache[&at].obj {
                Obj::Exonode(x) => match x.entries.get(*idx as usize) {
                    Some(Entry::Descendant { at }) => *at,
                    _ => {
                        return err(
                            libc::ENOENT,
                            format!("the exonode at {at}: entry {idx} (step {depth} of the path) is not a descendant"),
                        )
                    }
                },
                Obj::Extent(_) => unreachable!("descendants are exonodes"),
            };
            self.load(next)?;
            at = next;
        }
        Ok(at)
    }

    fn exonode(&self, at: u64) -> &Exonode {
        match &self.cache[&at].obj {
            Obj::Exonode(x) => x,
            Obj::Extent(_) => unreachable!("checked to be an exonode"),
        }
    }

    fn exonode_mut(&mut self, at: u64) -> &mut Exonode {
        let c = self.cache.get_mut(&at).expect("cached");
        c.dirty = true;
        match &mut c.obj {
            Obj::Exonode(x) => x,
            Obj::Extent(_) => unreachable!("checked to be an exonode"),
        }
    }

    fn persistence(&self, at: u64) -> Persistence {
        self.cache.get(&at).map_or(Persistence::Metadata, |c| c.persistence)
    }

    fn proxy(&self, id: u64, cap: Cap, want: Access) -> Result<Proxy> {
        let p = self.proxies.get(&id).ok_or(ExoError { errno: libc::ENOENT, msg: format!("proxy {id}: no such proxy") })?;
        Self::check_cap(&p.caps, cap, want, &format!("proxy {id}"))?;
        if want == Access::Write && p.access == Access::Read {
            return err(libc::EACCES, format!("proxy {id}: read only"));
        }
        Ok(p.clone())
    }

    // ---- self-protected extents ------------------------------------------------------------

    /// EXTENT_ALLOCATE: `sectors` sectors from `at` (the first holds the header).
    pub fn extent_allocate(&mut self, at: u64, sectors: u64, caps: Caps, persistence: Persistence) -> Result<()> {
        if sectors < 2 {
            return err(libc::EINVAL, "an extent needs a header sector and at least one data sector");
        }
        if caps.read == 0 || caps.write == 0 {
            return err(libc::EINVAL, "capabilities must not be 0");
        }
        self.check_free(at, sectors)?;
        self.forget_data(at + 1, sectors - 1)?;
        self.mark(at, sectors, true);
        self.clock += 1;
        let obj = Obj::Extent(ExtentHeader { sectors, caps, model: persistence.code() });
        self.cache.insert(at, Cached { obj, persistence, on_disk: false, dirty: true, used: self.clock, stale_frees: Vec::new() });
        self.persist(at, false)
    }

    fn extent(&mut self, at: u64, cap: Cap, want: Access) -> Result<ExtentHeader> {
        self.load(at)?;
        match &self.cache[&at].obj {
            Obj::Extent(h) => {
                let h = h.clone();
                Self::check_cap(&h.caps, cap, want, &format!("the extent at {at}"))?;
                Ok(h)
            }
            Obj::Exonode(_) => err(libc::EINVAL, format!("sector {at}: an exonode, not an extent")),
        }
    }

    /// EXTENT_DEALLOCATE.
    pub fn extent_deallocate(&mut self, at: u64, wcap: Cap) -> Result<()> {
        let h = self.extent(at, wcap, Access::Write)?;
        let stale_frees = std::mem::take(&mut self.cache.get_mut(&at).expect("cached").stale_frees);
        self.drop_record(at, 1)?;
        for (start, sectors) in stale_frees {
            self.mark(start, sectors, false);
        }
        self.release(at, at, h.sectors, true)
    }

    /// Overwrite the record at `at` (if it was ever written) and forget it.
    fn drop_record(&mut self, at: u64, sectors: u32) -> Result<()> {
        let c = self.cache.remove(&at).expect("cached");
        if c.on_disk {
            self.disk.write(at, &Aligned::zeroed(sectors as usize * SECTOR)).map_err(io_err)?;
            self.settle()?;
        }
        Ok(())
    }

    /// EXTENT_GROW (by `by` sectors, which must be free) and EXTENT_SHRINK (by `-by`).
    pub fn extent_resize(&mut self, at: u64, wcap: Cap, by: i64) -> Result<u64> {
        let h = self.extent(at, wcap, Access::Write)?;
        let new = h.sectors as i64 + by;
        if new < 2 {
            return err(libc::EINVAL, format!("the extent at {at}: cannot shrink below one data sector"));
        }
        let new = new as u64;
        if by > 0 {
            self.check_free(at + h.sectors, by as u64)?;
            self.forget_data(at + h.sectors, by as u64)?;
            self.mark(at + h.sectors, by as u64, true);
        }
        if let Obj::Extent(e) = &mut self.cache.get_mut(&at).expect("cached").obj {
            e.sectors = new;
        }
        self.cache.get_mut(&at).expect("cached").dirty = true;
        self.persist(at, false)?;
        if by < 0 {
            let persistent = self.persistence(at) != Persistence::Memory;
            self.release(at, at + new, (-by) as u64, persistent)?;
        }
        Ok(new)
    }

    // ---- exonodes ------------------------------------------------------------------------

    /// EXONODE_ALLOCATE: a top-level exonode of `sectors` sectors at `at`.
    pub fn exonode_allocate(&mut self, at: u64, sectors: u32, caps: Caps, persistence: Persistence) -> Result<()> {
        self.new_exonode(at, sectors, caps, 0, persistence)
    }

    fn new_exonode(&mut self, at: u64, sectors: u32, caps: Caps, parent: u64, persistence: Persistence) -> Result<()> {
        if sectors == 0 || sectors > MAX_EXONODE_SECTORS {
            return err(libc::EINVAL, format!("an exonode takes 1 to {MAX_EXONODE_SECTORS} sectors"));
        }
        if caps.read == 0 || caps.write == 0 {
            return err(libc::EINVAL, "capabilities must not be 0");
        }
        self.check_free(at, sectors as u64)?;
        self.mark(at, sectors as u64, true);
        self.clock += 1;
        let obj = Obj::Exonode(Exonode { sectors, caps, model: persistence.code(), parent, entries: Vec::new() });
        self.cache.insert(at, Cached { obj, persistence, on_disk: false, dirty: true, used: self.clock, stale_frees: Vec::new() });
        self.persist(at, false)
    }

    /// EXONODE_DEALLOCATE: it must have no descendants left; its extents are freed with it.
    pub fn exonode_deallocate(&mut self, target: &Target, wcap: Cap) -> Result<()> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        let x = self.exonode(at).clone();
        if x.entries.iter().any(|e| matches!(e, Entry::Descendant { .. })) {
            return err(libc::ENOTEMPTY, format!("the exonode at {at}: remove its descendants first"));
        }
        if x.parent != 0 {
            // Unnamed in the parent first: an interrupted removal leaves an orphan.
            let parent = x.parent;
            self.load(parent)?;
            let px = self.exonode_mut(parent);
            for e in px.entries.iter_mut() {
                if *e == (Entry::Descendant { at }) {
                    *e = Entry::Empty;
                }
            }
            self.persist(parent, false)?;
        }
        let persistent = self.persistence(at) != Persistence::Memory;
        let stale_frees = std::mem::take(&mut self.cache.get_mut(&at).expect("cached").stale_frees);
        self.drop_record(at, x.sectors)?;
        for (start, sectors) in stale_frees {
            self.mark(start, sectors, false);
        }
        self.mark(at, x.sectors as u64, false);
        for e in &x.entries {
            if let Entry::Extent { start, sectors } = *e {
                self.mark(start, sectors, false);
            }
        }
        if persistent {
            self.flush_map()?;
        }
        Ok(())
    }

    /// Put `entry` in slot `idx` (an empty one, or the end), or in the first empty slot.
    fn place(x: &mut Exonode, idx: Option<u32>, entry: Entry) -> Result<u32> {
        let i = match idx {
            Some(i) => i as usize,
            None => x.entries.iter().position(|e| *e == Entry::Empty).unwrap_or(x.entries.len()),
        };
        if i > x.entries.len() {
            return err(libc::EINVAL, format!("entry {i}: past the end ({} entries)", x.entries.len()));
        }
        if i < x.entries.len() && x.entries[i] != Entry::Empty {
            return err(libc::EEXIST, format!("entry {i} is in use"));
        }
        Self::fits_with(x, i, &entry)?;
        if i == x.entries.len() {
            x.entries.push(entry);
        } else if x.entries[i] == Entry::Empty {
            x.entries[i] = entry;
        } else {
            return err(libc::EEXIST, format!("entry {i} is in use"));
        }
        debug_assert!(x.fits());
        Ok(i as u32)
    }

    /// The sectors a deallocation of `target` (or, with `entry`, a removal of that entry) would
    /// give up, for the service to wait until no data request on them is still queued. Empty
    /// when the request would be refused anyway.
    pub fn sectors_given_up(&mut self, target: &Target, wcap: Cap, entry: Option<u32>) -> Vec<(u64, u64)> {
        match target {
            Target::Extent(at) => match self.extent(*at, wcap, Access::Write) {
                Ok(h) => vec![(*at, *at + h.sectors)],
                Err(_) => Vec::new(),
            },
            _ => {
                let Ok(at) = self.exonode_at(target, wcap, Access::Write) else { return Vec::new() };
                let x = self.exonode(at);
                let extent = |e: &Entry| match *e {
                    Entry::Extent { start, sectors } => Some((start, start + sectors)),
                    _ => None,
                };
                match entry {
                    Some(i) => x.entries.get(i as usize).and_then(extent).into_iter().collect(),
                    None => x.entries.iter().filter_map(extent).chain([(at, at + x.sectors as u64)]).collect(),
                }
            }
        }
    }

    /// Change the exonode at `at` and persist it by its model. `edit` checks before it changes
    /// anything: on an error the exonode is as it was (no copy is kept to restore it, so that an
    /// edit of a large exonode costs no more than the change).
    fn edit<T>(&mut self, at: u64, edit: impl FnOnce(&mut Exonode) -> Result<T>) -> Result<T> {
        let was_dirty = self.cache[&at].dirty;
        match edit(self.exonode_mut(at)) {
            Ok(v) => {
                self.persist(at, false)?;
                Ok(v)
            }
            Err(e) => {
                self.cache.get_mut(&at).expect("cached").dirty = was_dirty;
                Err(e)
            }
        }
    }

    /// Whether `x` still fits its sectors with entry `i` replaced by (or, past the end,
    /// extended with) `entry`.
    fn fits_with(x: &Exonode, i: usize, entry: &Entry) -> Result<()> {
        let old = x.entries.get(i).map_or(0, Entry::encoded_len);
        let used = x.used() - old + entry.encoded_len();
        if used > Exonode::capacity(x.sectors) {
            return err(libc::ENOSPC, format!("the exonode is full ({used} bytes of entries): allocate a larger one or a descendant"));
        }
        Ok(())
    }

    /// ADD_EXTENT: allocate `start..start + sectors` into the exonode. Returns the entry number.
    pub fn add_extent(&mut self, target: &Target, wcap: Cap, idx: Option<u32>, start: u64, sectors: u64) -> Result<u32> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        self.check_free(start, sectors)?;
        self.forget_data(start, sectors)?;
        self.mark(start, sectors, true);
        let r = self.edit(at, |x| Self::place(x, idx, Entry::Extent { start, sectors }));
        if r.is_err() {
            self.mark(start, sectors, false);
        }
        r
    }

    /// ADD_EXONODE: allocate a descendant exonode at `child` with capabilities of its own.
    pub fn add_exonode(&mut self, target: &Target, wcap: Cap, idx: Option<u32>, child: u64, sectors: u32, caps: Caps) -> Result<u32> {
        self.add_exonode_as(target, wcap, idx, child, sectors, caps, None, Vec::new())
    }

    /// ADD_EXONODE with the descendant's own persistence model (its parent's by default).
    #[allow(clippy::too_many_arguments)]
    pub fn add_exonode_as(
        &mut self,
        target: &Target,
        wcap: Cap,
        idx: Option<u32>,
        child: u64,
        sectors: u32,
        caps: Caps,
        model: Option<Persistence>,
        data: Vec<Vec<u8>>,
    ) -> Result<u32> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        let persistence = model.unwrap_or(self.persistence(at));
        // Room in the parent first, so a full parent leaves nothing behind.
        let mut probe = self.exonode(at).clone();
        Self::place(&mut probe, idx, Entry::Descendant { at: child })?;
        // And in the child for the data entries it starts with.
        let first = Exonode { sectors, caps, model: 0, parent: at, entries: data.iter().cloned().map(Entry::Data).collect() };
        if sectors == 0 || sectors > MAX_EXONODE_SECTORS || !first.fits() {
            return err(libc::ENOSPC, "the new exonode's first entries do not fit it");
        }
        self.new_exonode(child, sectors, caps, at, persistence)?;
        if !data.is_empty() {
            self.edit(child, |x| {
                x.entries = data.into_iter().map(Entry::Data).collect();
                Ok(())
            })?;
        }
        self.edit(at, |x| Self::place(x, idx, Entry::Descendant { at: child }))
    }

    /// ADD_DATA: put (or replace) application data in entry `idx` (or the first empty one).
    pub fn add_data(&mut self, target: &Target, wcap: Cap, idx: Option<u32>, data: &[u8]) -> Result<u32> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        let data = data.to_vec();
        self.edit(at, |x| match idx.map(|i| i as usize) {
            Some(i) if matches!(x.entries.get(i), Some(Entry::Data(_))) => {
                let entry = Entry::Data(data);
                Self::fits_with(x, i, &entry)?;
                x.entries[i] = entry;
                Ok(i as u32)
            }
            _ => Self::place(x, idx, Entry::Data(data)),
        })
    }

    /// READ_DATA.
    pub fn read_data(&mut self, target: &Target, rcap: Cap, idx: u32) -> Result<Vec<u8>> {
        let at = match self.entries_proxy(target, rcap, Access::Read)? {
            Some((_, entries)) if !entries.contains(&idx) => {
                return err(libc::EACCES, format!("entry {idx}: not granted by the proxy"))
            }
            Some((at, _)) => at,
            None => self.exonode_at(target, rcap, Access::Read)?,
        };
        match self.exonode(at).entries.get(idx as usize) {
            Some(Entry::Data(d)) => Ok(d.clone()),
            _ => err(libc::ENOENT, format!("the exonode at {at}: entry {idx} holds no data")),
        }
    }

    /// REMOVE_ENTRY: an extent's sectors are freed (after the exonode is written without it); a
    /// descendant must be deallocated itself.
    pub fn remove_entry(&mut self, target: &Target, wcap: Cap, idx: u32) -> Result<()> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        let entry = self.exonode(at).entries.get(idx as usize).cloned();
        match entry {
            None | Some(Entry::Empty) => err(libc::ENOENT, format!("the exonode at {at}: no entry {idx}")),
            Some(Entry::Descendant { at: d }) => {
                err(libc::ENOTEMPTY, format!("entry {idx} is the descendant at {d}: deallocate it (EXONODE_DEALLOCATE) instead"))
            }
            Some(e) => {
                self.edit(at, |x| {
                    x.entries[idx as usize] = Entry::Empty;
                    Ok(())
                })?;
                if let Entry::Extent { start, sectors } = e {
                    let persistent = self.persistence(at) != Persistence::Memory;
                    self.release(at, start, sectors, persistent)?;
                }
                Ok(())
            }
        }
    }

    /// COMBINE: extent entries `a` and `b` (b right after a on disk) become one, in `a`.
    pub fn combine(&mut self, target: &Target, wcap: Cap, a: u32, b: u32) -> Result<()> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        self.edit(at, |x| {
            let (ea, eb) = (x.entries.get(a as usize).cloned(), x.entries.get(b as usize).cloned());
            match (ea, eb) {
                (Some(Entry::Extent { start, sectors }), Some(Entry::Extent { start: s2, sectors: n2 }))
                    if a != b && start + sectors == s2 =>
                {
                    x.entries[a as usize] = Entry::Extent { start, sectors: sectors + n2 };
                    x.entries[b as usize] = Entry::Empty;
                    Ok(())
                }
                _ => err(libc::EINVAL, format!("entries {a} and {b}: not two extents, the second right after the first")),
            }
        })
    }

    /// SPLIT: extent entry `idx` keeps its first `at_sector` sectors; the rest goes to entry
    /// `new_idx` (or the first empty one). Returns that entry's number.
    pub fn split(&mut self, target: &Target, wcap: Cap, idx: u32, at_sector: u64, new_idx: Option<u32>) -> Result<u32> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        self.edit(at, |x| match x.entries.get(idx as usize).cloned() {
            Some(Entry::Extent { start, sectors }) if at_sector > 0 && at_sector < sectors => {
                // The tail first: if it has no room, nothing has changed.
                let tail = Self::place(x, new_idx, Entry::Extent { start: start + at_sector, sectors: sectors - at_sector })?;
                x.entries[idx as usize] = Entry::Extent { start, sectors: at_sector };
                Ok(tail)
            }
            _ => err(libc::EINVAL, format!("entry {idx}: not an extent longer than {at_sector} sectors")),
        })
    }

    /// CAP_DISCOVER: the capabilities of the descendant in entry `idx`. The ancestor's read
    /// capability reveals the read capability, its write capability both.
    pub fn cap_discover(&mut self, target: &Target, cap: Cap, idx: u32) -> Result<Caps> {
        let writer = self.access_of(target, cap) == Some(Access::Write);
        let at = self.exonode_at(target, cap, Access::Read)?;
        let child = match self.exonode(at).entries.get(idx as usize) {
            Some(Entry::Descendant { at }) => *at,
            _ => return err(libc::ENOENT, format!("the exonode at {at}: entry {idx} is not a descendant")),
        };
        self.load(child)?;
        let caps = self.exonode(child).caps;
        Ok(if writer { caps } else { Caps { read: caps.read, write: 0 } })
    }

    /// EXTENT_WRITE / EXONODE_WRITE: write the record now, whatever its model. A `memory`
    /// object stays one: its later changes wait for the next write (a library that writes its
    /// metadata back now and then, as a file system with a commit interval does).
    pub fn write_record(&mut self, target: &Target, wcap: Cap) -> Result<()> {
        let at = match target {
            Target::Extent(at) => {
                self.extent(*at, wcap, Access::Write)?;
                *at
            }
            _ => self.exonode_at(target, wcap, Access::Write)?,
        };
        self.persist(at, true)
    }

    /// MAP: the exonode as it is (entries and data), for a holder of its read capability.
    pub fn map(&mut self, target: &Target, rcap: Cap) -> Result<Exonode> {
        if let Some((at, entries)) = self.entries_proxy(target, rcap, Access::Read)? {
            // Only what the proxy grants shows.
            let mut x = self.exonode(at).clone();
            for (i, e) in x.entries.iter_mut().enumerate() {
                if !entries.contains(&(i as u32)) {
                    *e = Entry::Empty;
                }
            }
            return Ok(x);
        }
        let at = self.exonode_at(target, rcap, Access::Read)?;
        Ok(self.exonode(at).clone())
    }

    // ---- proxies ---------------------------------------------------------------------------

    /// PROXY: all of `target`, or its sectors `range` (absolute sector numbers, inside what it
    /// covers), under `caps`, with at most the access `cap` gives on it. A proxy of a proxy is
    /// no wider than that proxy, in sectors or in rights.
    pub fn make_proxy(&mut self, target: &Target, cap: Cap, range: Option<(u64, u64)>, caps: Caps) -> Result<u64> {
        if caps.read == 0 {
            return err(libc::EINVAL, "a proxy needs a read capability");
        }
        let access = match self.access_of(target, cap) {
            Some(a) => a,
            None => return err(libc::EACCES, "a proxy needs the read or write capability of what it grants"),
        };
        let (original, sectors) = match target {
            Target::Proxy(id) => {
                let parent = self.proxy(*id, cap, Access::Read)?;
                if parent.entries.is_some() {
                    return err(libc::EACCES, format!("proxy {id} grants entries: it can be narrowed only to fewer entries"));
                }
                let sectors = match (parent.sectors, range) {
                    (Some(p), None) => Some(p),
                    (Some((lo, hi)), Some((a, b))) if lo <= a && a < b && b <= hi => Some((a, b)),
                    (Some((lo, hi)), Some((a, b))) => {
                        return err(libc::EACCES, format!("range {a}..{b}: wider than proxy {id}'s {lo}..{hi}"))
                    }
                    (None, r) => {
                        if let Some((a, b)) = r {
                            let real = self.real_caps(&parent.target)?;
                            if a >= b || !self.covered(&parent.target, real.read, a, b)? {
                                return err(libc::EINVAL, format!("range {a}..{b}: not covered by proxy {id}"));
                            }
                        }
                        r
                    }
                };
                (parent.target, sectors)
            }
            Target::Extent(at) => {
                let h = self.extent(*at, cap, Access::Read)?;
                let (lo, hi) = extent_data(*at, &h);
                let (a, b) = range.unwrap_or((lo, hi));
                if a >= b || a < lo || b > hi {
                    return err(libc::EINVAL, format!("range {a}..{b}: not inside the extent's data {lo}..{hi}"));
                }
                (target.clone(), Some((a, b)))
            }
            _ => {
                if let Some((a, b)) = range {
                    if a >= b || !self.covered(target, cap, a, b)? {
                        return err(libc::EINVAL, format!("range {a}..{b}: not covered by the exonode"));
                    }
                }
                (target.clone(), range)
            }
        };
        let id = self.next_proxy;
        self.next_proxy += 1;
        let access = if caps.write == 0 { Access::Read } else { access };
        self.proxies.insert(id, Proxy { target: original, caps, access, sectors, entries: None });
        Ok(id)
    }

    /// PROXY of some entries of an exonode (or of an entries proxy, narrowed to fewer), under
    /// `caps`, with at most the access `cap` gives.
    pub fn make_entries_proxy(&mut self, target: &Target, cap: Cap, entries: Vec<u32>, caps: Caps) -> Result<u64> {
        if caps.read == 0 {
            return err(libc::EINVAL, "a proxy needs a read capability");
        }
        if entries.is_empty() {
            return err(libc::EINVAL, "a proxy of no entries");
        }
        let access = match self.access_of(target, cap) {
            Some(a) => a,
            None => return err(libc::EACCES, "a proxy needs the read or write capability of what it grants"),
        };
        let original = match target {
            Target::Proxy(id) => {
                let parent = self.proxy(*id, cap, Access::Read)?;
                match &parent.entries {
                    Some(have) if entries.iter().all(|e| have.contains(e)) => parent.target,
                    Some(have) => return err(libc::EACCES, format!("entries {entries:?}: wider than proxy {id}'s {have:?}")),
                    None => return err(libc::EACCES, format!("proxy {id} does not grant entries")),
                }
            }
            Target::Extent(at) => return err(libc::EINVAL, format!("sector {at}: an extent has no entries")),
            _ => {
                let at = self.exonode_at(target, cap, Access::Read)?;
                let n = self.exonode(at).entries.len() as u32;
                if let Some(e) = entries.iter().find(|e| **e >= n) {
                    return err(libc::EINVAL, format!("entry {e}: the exonode has {n} entries"));
                }
                target.clone()
            }
        };
        let id = self.next_proxy;
        self.next_proxy += 1;
        let access = if caps.write == 0 { Access::Read } else { access };
        self.proxies.insert(id, Proxy { target: original, caps, access, sectors: None, entries: Some(entries) });
        Ok(id)
    }

    /// The original exonode behind an entries proxy, and the entries it grants.
    fn entries_proxy(&mut self, target: &Target, cap: Cap, want: Access) -> Result<Option<(u64, Vec<u32>)>> {
        let Target::Proxy(id) = target else { return Ok(None) };
        let p = self.proxy(*id, cap, want)?;
        let Some(entries) = p.entries else { return Ok(None) };
        let real = self.real_caps(&p.target)?;
        let at = self.exonode_at(&p.target, if want == Access::Write { real.write } else { real.read }, want)?;
        Ok(Some((at, entries)))
    }

    /// Remove a proxy (its maker's job; proxies also die with the service).
    pub fn remove_proxy(&mut self, id: u64, cap: Cap) -> Result<()> {
        self.proxy(id, cap, Access::Read)?;
        self.proxies.remove(&id);
        Ok(())
    }

    /// What `cap` allows on `target`, if anything.
    fn access_of(&mut self, target: &Target, cap: Cap) -> Option<Access> {
        for want in [Access::Write, Access::Read] {
            let ok = match target {
                Target::Extent(at) => self.extent(*at, cap, want).is_ok(),
                Target::Proxy(id) => self.proxy(*id, cap, want).is_ok(),
                _ => self.exonode_at(target, cap, want).is_ok(),
            };
            if ok {
                return Some(want);
            }
        }
        None
    }

    // ---- data I/O --------------------------------------------------------------------------

    /// Whether `a..b` lies in sectors `target` covers.
    fn covered(&mut self, target: &Target, cap: Cap, a: u64, b: u64) -> Result<bool> {
        match target {
            Target::Extent(at) => {
                let h = self.extent(*at, cap, Access::Read)?;
                let (lo, hi) = extent_data(*at, &h);
                Ok(a >= lo && b <= hi)
            }
            _ => {
                let at = self.exonode_at(target, cap, Access::Read)?;
                Ok(self
                    .exonode(at)
                    .entries
                    .iter()
                    .any(|e| matches!(*e, Entry::Extent { start, sectors } if a >= start && b <= start + sectors)))
            }
        }
    }

    /// Check an IO of sectors `at..at + len` on `target` with `cap` for `want` (thesis `IO`).
    /// Returns the persistence model that governs it.
    pub fn check_io(&mut self, target: &Target, cap: Cap, want: Access, at: u64, len: u64) -> Result<Persistence> {
        let end = at.checked_add(len).ok_or(ExoError { errno: libc::EINVAL, msg: "sector range overflows".into() })?;
        if len == 0 {
            return err(libc::EINVAL, "an IO of no sectors");
        }
        match target {
            Target::Proxy(id) => {
                let p = self.proxy(*id, cap, want)?;
                if let Some((lo, hi)) = p.sectors {
                    if at < lo || end > hi {
                        return err(libc::EACCES, format!("sectors {at}..{end}: outside what proxy {id} grants ({lo}..{hi})"));
                    }
                }
                // Within the original as it is now (it may have shrunk), with its own rights.
                let real_cap = self.real_caps(&p.target)?;
                let cap = if want == Access::Write { real_cap.write } else { real_cap.read };
                if let Some(es) = &p.entries {
                    let xn = self.exonode_at(&p.target, cap, want)?;
                    let x = self.exonode(xn);
                    let inside = es.iter().any(|e| {
                        matches!(x.entries.get(*e as usize), Some(Entry::Extent { start, sectors }) if at >= *start && end <= start + sectors)
                    });
                    if !inside {
                        return err(libc::EACCES, format!("sectors {at}..{end}: not in the entries proxy {id} grants"));
                    }
                }
                self.check_io(&p.target, cap, want, at, len)
            }
            Target::Extent(x) => {
                let h = self.extent(*x, cap, want)?;
                let (lo, hi) = extent_data(*x, &h);
                if at < lo || end > hi {
                    return err(libc::EACCES, format!("sectors {at}..{end}: outside the extent's data {lo}..{hi}"));
                }
                Ok(self.persistence(*x))
            }
            _ => {
                let xn = self.exonode_at(target, cap, want)?;
                let inside = self
                    .exonode(xn)
                    .entries
                    .iter()
                    .any(|e| matches!(*e, Entry::Extent { start, sectors } if at >= start && end <= start + sectors));
                if !inside {
                    return err(libc::EACCES, format!("sectors {at}..{end}: not in an extent of the exonode at {xn}"));
                }
                Ok(self.persistence(xn))
            }
        }
    }

    fn real_caps(&mut self, target: &Target) -> Result<Caps> {
        match target {
            Target::Extent(at) => {
                self.load(*at)?;
                match &self.cache[at].obj {
                    Obj::Extent(h) => Ok(h.caps),
                    _ => err(libc::EINVAL, "not an extent"),
                }
            }
            Target::Exonode { at, .. } => {
                self.load(*at)?;
                match &self.cache[at].obj {
                    Obj::Exonode(x) => Ok(x.caps),
                    _ => err(libc::EINVAL, "not an exonode"),
                }
            }
            Target::Proxy(_) => err(libc::EINVAL, "a proxy of a proxy names its original"),
        }
    }

    /// Read sectors `at..` into `buf` after checking (synchronous; the service batches through
    /// its queue instead).
    pub fn read(&mut self, target: &Target, rcap: Cap, at: u64, buf: &mut Aligned) -> Result<()> {
        self.check_io(target, rcap, Access::Read, at, (buf.len() / SECTOR) as u64)?;
        self.disk.read(at, buf).map_err(io_err)?;
        self.content.open(at, buf).map_err(unsealed)
    }

    /// Write `buf` at sector `at` after checking, flushed when the model is `data`.
    pub fn write(&mut self, target: &Target, wcap: Cap, at: u64, buf: &Aligned) -> Result<()> {
        let model = self.check_io(target, wcap, Access::Write, at, (buf.len() / SECTOR) as u64)?;
        let mut sealed = Aligned::from_bytes(buf);
        self.content.seal(at, &mut sealed, model == Persistence::Data).map_err(io_err)?;
        self.disk.write(at, &sealed).map_err(io_err)?;
        if model == Persistence::Data {
            self.sync_disk()?;
        }
        Ok(())
    }

    /// Drop descendant entries that name exonodes that are gone (found by the start-up scan),
    /// and write their exonodes.
    pub fn drop_dangling(&mut self, dangling: &[(u64, u32)]) -> Result<()> {
        for &(at, idx) in dangling {
            self.load(at)?;
            if let Obj::Exonode(x) = &mut self.cache.get_mut(&at).expect("loaded").obj {
                if let Some(e @ Entry::Descendant { .. }) = x.entries.get_mut(idx as usize) {
                    *e = Entry::Empty;
                }
            }
            self.cache.get_mut(&at).expect("loaded").dirty = true;
            self.persist(at, true)?;
        }
        Ok(())
    }

    /// Write what is dirty and persistent, and the free map (at shutdown).
    pub fn flush(&mut self) -> Result<()> {
        let dirty: Vec<u64> =
            self.cache.iter().filter(|(_, c)| c.dirty && c.persistence != Persistence::Memory).map(|(a, _)| *a).collect();
        for at in dirty {
            self.persist(at, false)?;
        }
        self.flush_map()?;
        self.sync_disk()
    }
}
