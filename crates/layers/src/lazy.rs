//! `lazy`: a disk's volatile write cache, for power-cut tests (the model of LazyFS, which finds
//! the bugs of databases that trust an unsynced write).
//!
//! It sits at the bottom of a chain, just above the lower directory, and holds the file DATA the
//! layers above write (`write`, size changes by `setattr`, `open` with `O_TRUNC`, `fallocate`) in
//! memory, in pages per lower file, keyed by the file's node (the lower inode, so renames and
//! hard links keep it). Reads, sizes and `lseek` see the held data. Only `fsync`/`fdatasync` of a
//! file writes its held data and size to the lower file and syncs it there; `flush` and `release`
//! persist nothing. Metadata (create, mkdir, unlink, rename, link, symlink, modes, owners, times,
//! xattrs) goes straight through and is durable at once: as in LazyFS, only data waits.
//!
//! Held data above `max=SIZE` is written back early, oldest file first and without a sync, as a
//! kernel flushes dirty pages; a clean unmount writes everything back and syncs it.
//!
//! `power-cut [keep=FRACTION] [seed=N]` drops the held data of every lazy layer in the process at
//! once (a machine loses power everywhere), after writing a random `keep` fraction of the held
//! pages in random order (what the disk had flushed by chance). From then on every operation of
//! those layers fails with `EIO`: the machine is dead, and nothing more reaches the lower
//! directories. The lower bytes are not the file's bytes, so the layer never allows passthrough.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use plyfs_stack::glob::parse_size;
use plyfs_stack::spec::ParamSpec;
use plyfs_stack::{
    bypass, Attr, Build, BuildArgs, Caller, DataPath, Entry, Error, ExtOpInfo, FileHandle, Layer, LayerFactory, Level,
    NodeId, Op, Reply, Result, SetAttr,
};
use serde_json::{json, Value};

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo {
        name: "power-cut",
        args: "[keep=FRACTION] [seed=N]",
        help: "drop the unsynced data of every lazy layer of the mount (after writing a random fraction of its pages); then every operation fails with EIO",
    },
    ExtOpInfo { name: "lazy-status", args: "", help: "the files and bytes held unsynced, and whether the power was cut" },
];

const MAX: ParamSpec = ParamSpec { name: "max", help: "held data above which the oldest file is written back (unsynced)", default: Some("256M") };

/// The unit data is held in, and the unit `keep=` writes back by chance.
const PAGE_BYTES: u64 = 4096;
const MASK_WORDS: usize = PAGE_BYTES as usize / 64;

/// The part of one page that a byte range covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PagePiece {
    page: u64,
    offset_in_page: usize,
    len: usize,
    /// Where the piece starts in the range.
    offset_in_range: usize,
}

/// The pages the `len` bytes at `offset` fall in, one piece each.
fn page_pieces(offset: u64, len: u64) -> impl Iterator<Item = PagePiece> {
    let end = offset.saturating_add(len);
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let page = at / PAGE_BYTES;
        let offset_in_page = (at % PAGE_BYTES) as usize;
        let piece_len = (PAGE_BYTES - at % PAGE_BYTES).min(end - at) as usize;
        let piece = PagePiece { page, offset_in_page, len: piece_len, offset_in_range: (at - offset) as usize };
        at += piece_len as u64;
        Some(piece)
    })
}

/// One held page: its bytes, and which of them are held (the others are the lower file's).
#[derive(Clone)]
struct Page {
    bytes: Box<[u8; PAGE_BYTES as usize]>,
    held: [u64; MASK_WORDS],
}

impl Page {
    fn new() -> Page {
        Page { bytes: Box::new([0; PAGE_BYTES as usize]), held: [0; MASK_WORDS] }
    }

    fn is_held(&self, i: usize) -> bool {
        self.held[i / 64] & (1 << (i % 64)) != 0
    }

    fn set_held(&mut self, i: usize, on: bool) {
        if on {
            self.held[i / 64] |= 1 << (i % 64);
        } else {
            self.held[i / 64] &= !(1 << (i % 64));
        }
    }

    fn put(&mut self, offset_in_page: usize, data: &[u8]) {
        self.bytes[offset_in_page..offset_in_page + data.len()].copy_from_slice(data);
        for i in offset_in_page..offset_in_page + data.len() {
            self.set_held(i, true);
        }
    }

    /// Forget the bytes from `offset_in_page` on (a truncation).
    fn cut_from(&mut self, offset_in_page: usize) {
        for i in offset_in_page..PAGE_BYTES as usize {
            self.set_held(i, false);
        }
    }

    /// Copy the held bytes of `offset_in_page..+dst.len()` over `dst`.
    fn overlay(&self, offset_in_page: usize, dst: &mut [u8]) {
        for (k, b) in dst.iter_mut().enumerate() {
            if self.is_held(offset_in_page + k) {
                *b = self.bytes[offset_in_page + k];
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.held.iter().all(|w| *w == 0)
    }

    /// The held byte ranges, `start..end` in the page, in order.
    fn held_runs(&self) -> Vec<(usize, usize)> {
        let mut runs = Vec::new();
        let mut start = None;
        for i in 0..=PAGE_BYTES as usize {
            let held = i < PAGE_BYTES as usize && self.is_held(i);
            match (held, start) {
                (true, None) => start = Some(i),
                (false, Some(s)) => {
                    runs.push((s, i));
                    start = None;
                }
                _ => {}
            }
        }
        runs
    }
}

/// The unsynced state of one lower file.
struct HeldFile {
    /// The file's size as the layers above see it.
    size: u64,
    /// The smallest size it was truncated to since it was last written back: lower bytes from
    /// here on are gone (they read as zeros).
    floor: Option<u64>,
    pages: BTreeMap<u64, Page>,
    /// When it was first held, for writing back the oldest first.
    since: u64,
    /// Forgets of the node kept back while data is held, so that the lower directory keeps the
    /// node (and its inode number) until the data is written back.
    kept_forgets: u64,
}

impl HeldFile {
    fn new(size: u64, since: u64) -> HeldFile {
        HeldFile { size, floor: None, pages: BTreeMap::new(), since, kept_forgets: 0 }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        for p in page_pieces(offset, data.len() as u64) {
            let page = self.pages.entry(p.page).or_insert_with(Page::new);
            page.put(p.offset_in_page, &data[p.offset_in_range..p.offset_in_range + p.len]);
        }
        self.size = self.size.max(offset + data.len() as u64);
    }

    fn truncate(&mut self, size: u64) {
        self.pages.retain(|&page, _| page * PAGE_BYTES < size);
        if let Some((&last, page)) = self.pages.iter_mut().next_back() {
            if (last + 1) * PAGE_BYTES > size {
                page.cut_from((size - last * PAGE_BYTES) as usize);
            }
        }
        self.pages.retain(|_, p| !p.is_empty());
        self.floor = Some(self.floor.map_or(size, |f| f.min(size)));
        self.size = size;
    }

    /// Bytes `offset..offset+len` (clipped to the size), given how to read the lower file's.
    fn read(&self, offset: u64, len: u64, read_lower: impl FnOnce(u64, u64) -> Result<Vec<u8>>) -> Result<Vec<u8>> {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return Ok(Vec::new());
        }
        let lower_end = end.min(self.floor.unwrap_or(u64::MAX));
        let mut buf = if offset < lower_end { read_lower(offset, lower_end - offset)? } else { Vec::new() };
        buf.resize((end - offset) as usize, 0);
        for p in page_pieces(offset, end - offset) {
            if let Some(page) = self.pages.get(&p.page) {
                page.overlay(p.offset_in_page, &mut buf[p.offset_in_range..p.offset_in_range + p.len]);
            }
        }
        Ok(buf)
    }

    fn held_bytes(&self) -> u64 {
        self.pages.len() as u64 * PAGE_BYTES
    }
}

/// Every lazy layer of the process, for `power-cut` (the power fails everywhere at once).
static ALL_LAZY: Mutex<Vec<Weak<Lazy>>> = Mutex::new(Vec::new());

#[derive(Default)]
struct Held {
    files: HashMap<NodeId, HeldFile>,
    next_since: u64,
}

pub struct Lazy {
    name: String,
    lower: [Level; 1],
    max_bytes: u64,
    held: Mutex<Held>,
    cut: AtomicBool,
}

fn dead() -> Error {
    Error::Os(libc::EIO)
}

impl Lazy {
    fn below(&self) -> &Level {
        &self.lower[0]
    }

    fn lower_size(&self, cx: &Caller, node: NodeId) -> Result<u64> {
        Ok(self.below().getattr(cx, node)?.size)
    }

    /// The held state of `node`, made from the lower file's size on first use.
    fn held_file<'a>(&self, cx: &Caller, held: &'a mut Held, node: NodeId) -> Result<&'a mut HeldFile> {
        if !held.files.contains_key(&node) {
            let size = self.lower_size(cx, node)?;
            held.next_since += 1;
            held.files.insert(node, HeldFile::new(size, held.next_since));
        }
        Ok(held.files.get_mut(&node).expect("just inserted"))
    }

    fn patch_attr(&self, node: NodeId, attr: &mut Attr) {
        if let Some(f) = self.held.lock().files.get(&node) {
            attr.size = f.size;
        }
    }

    fn patch_entry(&self, entry: &mut Entry) {
        self.patch_attr(entry.node, &mut entry.attr);
    }

    fn patch_reply(&self, node: NodeId, mut reply: Reply) -> Reply {
        match &mut reply {
            Reply::Attr(a) => self.patch_attr(node, a),
            Reply::Entry(e) | Reply::Created(e, _) => self.patch_entry(e),
            Reply::Dir(entries) => {
                for e in entries.iter_mut().filter_map(|d| d.entry.as_mut()) {
                    self.patch_entry(e);
                }
            }
            _ => {}
        }
        reply
    }

    /// Write `file`'s held data and size to the lower file `node` through a handle of our own,
    /// then sync it if asked.
    fn write_back(&self, node: NodeId, file: &HeldFile, sync: Option<bool>) -> Result<()> {
        let cx = Caller::daemon();
        let below = self.below();
        let opened = below.open(&cx, node, libc::O_WRONLY)?;
        let fh = opened.fh;
        let result = (|| {
            let set_size = |size| {
                below.call(&cx, &Op::SetAttr { node, fh: Some(fh), set: SetAttr { size: Some(size), ..Default::default() } })
            };
            if let Some(floor) = file.floor {
                set_size(floor)?;
            }
            for (&index, page) in &file.pages {
                write_page(below, &cx, node, fh, index, page, file.size)?;
            }
            if below.getattr(&cx, node)?.size != file.size {
                set_size(file.size)?;
            }
            if let Some(datasync) = sync {
                below.call(&cx, &Op::Fsync { node, fh, datasync })?;
            }
            Ok(())
        })();
        let _ = below.release(&cx, node, fh);
        result
    }

    /// Write back `node`'s held data (syncing it if asked) and let it go, with the forgets kept
    /// for it.
    fn settle(&self, cx: &Caller, held: &mut Held, node: NodeId, sync: Option<bool>) -> Result<()> {
        let Some(file) = held.files.get(&node) else { return Ok(()) };
        self.write_back(node, file, sync)?;
        let file = held.files.remove(&node).expect("present");
        if file.kept_forgets > 0 {
            self.below().forget(cx, node, file.kept_forgets);
        }
        Ok(())
    }

    /// Write back the oldest files, unsynced, until what is held fits `max`.
    fn enforce_max(&self, cx: &Caller, held: &mut Held) -> Result<()> {
        while held.files.values().map(HeldFile::held_bytes).sum::<u64>() > self.max_bytes {
            let Some(oldest) = held.files.iter().min_by_key(|(_, f)| f.since).map(|(n, _)| *n) else { break };
            self.settle(cx, held, oldest, None)?;
        }
        Ok(())
    }

    fn status(&self) -> Value {
        let held = self.held.lock();
        let bytes: u64 = held.files.values().map(HeldFile::held_bytes).sum();
        json!({ "layer": self.name, "files": held.files.len(), "bytes": bytes, "cut": self.cut.load(Ordering::SeqCst) })
    }

    fn data_op(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let mut held = self.held.lock();
        match *op {
            Op::Write { node, offset, data, .. } => {
                self.held_file(cx, &mut held, node)?.write(offset, data);
                self.enforce_max(cx, &mut held)?;
                Ok(Reply::Written(data.len() as u32))
            }
            Op::Read { node, fh, offset, size } => match held.files.get(&node) {
                Some(file) => file.read(offset, size.into(), |at, len| self.below().read(cx, node, fh, at, len as u32)).map(Reply::Data),
                None => bypass(self, cx, op),
            },
            Op::Fsync { node, fh, datasync } => {
                if held.files.contains_key(&node) {
                    self.settle(cx, &mut held, node, Some(datasync))?;
                    Ok(Reply::Empty)
                } else {
                    self.below().call(cx, &Op::Fsync { node, fh, datasync })
                }
            }
            Op::Fallocate { node, offset, length, mode, .. } => {
                let file = self.held_file(cx, &mut held, node)?;
                fallocate(file, offset, length, mode)?;
                self.enforce_max(cx, &mut held)?;
                Ok(Reply::Empty)
            }
            Op::Lseek { node, offset, whence, .. } if held.files.contains_key(&node) => {
                let size = held.files[&node].size;
                // Held data has no holes: all of it is data, and the one hole is the end.
                match (offset < 0, u64::try_from(offset).unwrap_or(0) >= size, whence) {
                    (true, _, _) | (_, true, _) => Err(Error::Os(libc::ENXIO)),
                    (_, _, libc::SEEK_DATA) => Ok(Reply::Offset(offset as u64)),
                    (_, _, libc::SEEK_HOLE) => Ok(Reply::Offset(size)),
                    _ => Err(Error::Os(libc::EINVAL)),
                }
            }
            Op::Lseek { .. } => {
                drop(held);
                bypass(self, cx, op)
            }
            Op::Forget { node, nlookup } => {
                if let Some(file) = held.files.get_mut(&node) {
                    file.kept_forgets += nlookup;
                    return Ok(Reply::Empty);
                }
                drop(held);
                bypass(self, cx, op)
            }
            _ => unreachable!("not a data operation: {}", op.name()),
        }
    }

    fn setattr(&self, cx: &Caller, node: NodeId, fh: Option<FileHandle>, set: SetAttr) -> Result<Reply> {
        if let Some(size) = set.size {
            let mut held = self.held.lock();
            self.held_file(cx, &mut held, node)?.truncate(size);
            self.enforce_max(cx, &mut held)?;
        }
        let rest = SetAttr { size: None, ..set };
        let reply = if rest == SetAttr::default() {
            self.below().call(cx, &Op::GetAttr { node, fh })?
        } else {
            self.below().call(cx, &Op::SetAttr { node, fh, set: rest })?
        };
        Ok(self.patch_reply(node, reply))
    }

    /// `open`/`create` without `O_TRUNC`, which would cut the lower file at once: the truncation
    /// is held instead.
    fn open_held_trunc(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let (stripped, truncating) = match *op {
            Op::Open { node, flags } => (Op::Open { node, flags: flags & !libc::O_TRUNC }, flags & libc::O_TRUNC != 0),
            Op::Create { parent, name, mode, flags } => {
                (Op::Create { parent, name, mode, flags: flags & !libc::O_TRUNC }, flags & libc::O_TRUNC != 0)
            }
            _ => unreachable!(),
        };
        let reply = self.below().call(cx, &stripped)?;
        let node = match (&reply, *op) {
            (Reply::Created(e, _), _) => e.node,
            (_, Op::Open { node, .. }) => node,
            _ => return Ok(reply),
        };
        if truncating {
            let mut held = self.held.lock();
            self.held_file(cx, &mut held, node)?.truncate(0);
        }
        Ok(self.patch_reply(node, reply))
    }

    fn power_cut(&self, args: &[String]) -> Result<Value> {
        let (keep, seed) = parse_cut_args(args).map_err(|e| Error::BadArgs(e.to_string()))?;
        let layers: Vec<Arc<Lazy>> = ALL_LAZY.lock().iter().filter_map(Weak::upgrade).collect();
        // Everything stops first, so no layer takes a write after another has lost power.
        let mut states: Vec<(Arc<Lazy>, Held)> = Vec::new();
        for layer in &layers {
            let mut held = layer.held.lock();
            if !layer.cut.swap(true, Ordering::SeqCst) {
                states.push((layer.clone(), std::mem::take(&mut *held)));
            }
        }
        let mut rng = seed | 1;
        let mut pages: Vec<(usize, NodeId, u64)> = Vec::new();
        for (i, (_, held)) in states.iter().enumerate() {
            for (node, file) in &held.files {
                pages.extend(file.pages.keys().map(|&p| (i, *node, p)));
            }
        }
        pages.sort();
        // A random fraction of the pages, in random order (a Fisher-Yates shuffle, then a prefix).
        for i in (1..pages.len()).rev() {
            pages.swap(i, (next_random(&mut rng) % (i as u64 + 1)) as usize);
        }
        let kept = (pages.len() as f64 * keep).round() as usize;
        let cx = Caller::daemon();
        for &(i, node, index) in &pages[..kept] {
            let (layer, held) = &states[i];
            let file = &held.files[&node];
            // A page that fails to land is a page the disk had not flushed: nothing to report.
            if let Ok(opened) = layer.below().open(&cx, node, libc::O_WRONLY) {
                let _ = write_page(layer.below(), &cx, node, opened.fh, index, &file.pages[&index], file.size);
                let _ = layer.below().release(&cx, node, opened.fh);
            }
        }
        let dropped_files: usize = states.iter().map(|(_, h)| h.files.len()).sum();
        tracing::warn!("power cut: {} lazy layer(s) dead, {dropped_files} file(s) lost unsynced data, {kept} of {} page(s) landed", states.len(), pages.len());
        Ok(json!({ "layers": states.len(), "files": dropped_files, "pages": pages.len(), "pages_kept": kept }))
    }
}

/// Write the held runs of page `index` of a file of `size` bytes through handle `fh`.
fn write_page(below: &Level, cx: &Caller, node: NodeId, fh: FileHandle, index: u64, page: &Page, size: u64) -> Result<()> {
    for (start, end) in page.held_runs() {
        let offset = index * PAGE_BYTES + start as u64;
        let end = (index * PAGE_BYTES + end as u64).min(size);
        if offset < end {
            below.write(cx, node, fh, offset, &page.bytes[start..start + (end - offset) as usize])?;
        }
    }
    Ok(())
}

/// `fallocate(2)` on held data: allocation only changes the size; punching a hole or zeroing a
/// range holds zeros.
fn fallocate(file: &mut HeldFile, offset: u64, length: u64, mode: i32) -> Result<()> {
    let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
    let end = offset.checked_add(length).ok_or(Error::Os(libc::EFBIG))?;
    match mode & !libc::FALLOC_FL_KEEP_SIZE {
        0 => {}
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE => {
            let zero_end = if keep_size { end.min(file.size) } else { end };
            if offset < zero_end {
                let size = file.size;
                file.write(offset, &vec![0; (zero_end - offset) as usize]);
                file.size = size.max(if keep_size { size } else { zero_end });
            }
        }
        _ => return Err(Error::Os(libc::EOPNOTSUPP)),
    }
    if !keep_size {
        file.size = file.size.max(end);
    }
    Ok(())
}

fn next_random(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// `keep=FRACTION` (0 to 1, default 0) and `seed=N` (default: from the clock).
fn parse_cut_args(args: &[String]) -> std::result::Result<(f64, u64), crate::Error> {
    let bad = |why: String| crate::Error::BadArgument { op: "power-cut", why };
    let mut keep = 0.0;
    let mut seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos() as u64;
    for arg in args {
        match arg.split_once('=') {
            Some(("keep", v)) => {
                keep = v.parse::<f64>().ok().filter(|k| (0.0..=1.0).contains(k)).ok_or_else(|| bad(format!("keep={v}: a fraction from 0 to 1")))?
            }
            Some(("seed", v)) => seed = v.parse().map_err(|_| bad(format!("seed={v}: expected a number")))?,
            _ => return Err(bad(format!("'{arg}': expected keep=FRACTION or seed=N"))),
        }
    }
    Ok((keep, seed))
}

impl Layer for Lazy {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "lazy"
    }

    fn data_path(&self) -> DataPath {
        DataPath::Transforms
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }

    fn holds_data(&self) -> bool {
        true
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        if self.cut.load(Ordering::SeqCst) {
            return match op {
                Op::Extended { name: "lazy-status", .. } => Ok(Reply::Extended(self.status())),
                Op::Forget { .. } | Op::Release { .. } | Op::ReleaseDir { .. } => Ok(Reply::Empty),
                _ => Err(dead()),
            };
        }
        match *op {
            Op::Extended { name: "power-cut", args, .. } => self.power_cut(args).map(Reply::Extended),
            Op::Extended { name: "lazy-status", .. } => Ok(Reply::Extended(self.status())),
            Op::Write { .. } | Op::Read { .. } | Op::Fsync { .. } | Op::Fallocate { .. } | Op::Lseek { .. } | Op::Forget { .. } => {
                self.data_op(cx, op)
            }
            Op::SetAttr { node, fh, set } => self.setattr(cx, node, fh, set),
            Op::Open { .. } | Op::Create { .. } => self.open_held_trunc(cx, op),
            _ => {
                let reply = bypass(self, cx, op)?;
                Ok(self.patch_reply(op.node(), reply))
            }
        }
    }

    /// A clean shutdown: everything held reaches the lower files, synced.
    fn shutdown(&self) {
        if self.cut.load(Ordering::SeqCst) {
            return;
        }
        let cx = Caller::daemon();
        let mut held = self.held.lock();
        let nodes: Vec<NodeId> = held.files.keys().copied().collect();
        for node in nodes {
            if let Err(e) = self.settle(&cx, &mut held, node, Some(false)) {
                tracing::error!("lazy '{}': writing back node {} at unmount: {e}", self.name, node.0);
            }
        }
    }
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let max = args.params.get(MAX.name).unwrap_or("256M");
    let max_bytes = parse_size(max).ok_or_else(|| args.params.bad(MAX.name, max, "expected a size such as 64M"))?;
    let layer = Arc::new(Lazy {
        name: args.name,
        lower: [args.lower],
        max_bytes,
        held: Mutex::new(Held::default()),
        cut: AtomicBool::new(false),
    });
    let mut all = ALL_LAZY.lock();
    all.retain(|w| w.strong_count() > 0);
    all.push(Arc::downgrade(&layer));
    Ok(layer)
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "lazy",
    summary: "a volatile write cache for power-cut tests: holds unsynced file data in memory; power-cut drops it",
    params: &[MAX],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_at_page_bounds() {
        let v: Vec<PagePiece> = page_pieces(4090, 10).collect();
        assert_eq!(
            v,
            [
                PagePiece { page: 0, offset_in_page: 4090, len: 6, offset_in_range: 0 },
                PagePiece { page: 1, offset_in_page: 0, len: 4, offset_in_range: 6 },
            ]
        );
        assert_eq!(page_pieces(8192, 0).count(), 0);
        assert_eq!(page_pieces(0, 3 * PAGE_BYTES).map(|p| p.len).sum::<usize>(), 3 * PAGE_BYTES as usize);
    }

    #[test]
    fn runs_of_held_bytes() {
        let mut p = Page::new();
        p.put(10, b"abc");
        p.put(100, b"x");
        p.put(4095, b"z");
        assert_eq!(p.held_runs(), [(10, 13), (100, 101), (4095, 4096)]);
        p.cut_from(11);
        assert_eq!(p.held_runs(), [(10, 11)]);
    }

    /// Held bytes over a lower file of `lower`: what a reader sees.
    fn view(f: &HeldFile, lower: &[u8]) -> Vec<u8> {
        f.read(0, 1 << 20, |at, len| Ok(lower[at as usize..(at + len).min(lower.len() as u64) as usize].to_vec())).unwrap()
    }

    #[test]
    fn reads_overlay_held_bytes_and_truncation_zeroes_the_lower() {
        let lower = b"0123456789".to_vec();
        let mut f = HeldFile::new(10, 1);
        f.write(2, b"ab");
        assert_eq!(view(&f, &lower), b"01ab456789");
        f.truncate(3);
        assert_eq!(view(&f, &lower), b"01a");
        f.write(5, b"Z");
        assert_eq!(view(&f, &lower), b"01a\0\0Z");
        f.truncate(0);
        f.truncate(4);
        assert_eq!(view(&f, &lower), b"\0\0\0\0");
        let mut g = HeldFile::new(0, 2);
        g.write(PAGE_BYTES * 2 + 1, b"q");
        assert_eq!(view(&g, &[]).len() as u64, PAGE_BYTES * 2 + 2);
        assert_eq!(g.held_bytes(), PAGE_BYTES);
    }

    #[test]
    fn fallocate_modes() {
        let mut f = HeldFile::new(4, 1);
        fallocate(&mut f, 0, 10, 0).unwrap();
        assert_eq!(f.size, 10);
        fallocate(&mut f, 8, 10, libc::FALLOC_FL_KEEP_SIZE).unwrap();
        assert_eq!(f.size, 10);
        fallocate(&mut f, 1, 2, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE).unwrap();
        assert_eq!(view(&f, b"abcd"), b"a\0\0d\0\0\0\0\0\0");
        fallocate(&mut f, 9, 3, libc::FALLOC_FL_ZERO_RANGE).unwrap();
        assert_eq!(f.size, 12);
        assert!(fallocate(&mut f, 0, 1, libc::FALLOC_FL_COLLAPSE_RANGE).is_err());
    }

    #[test]
    fn cut_arguments() {
        assert_eq!(parse_cut_args(&["keep=0.5".into(), "seed=7".into()]).unwrap(), (0.5, 7));
        assert_eq!(parse_cut_args(&["keep=2".into()]).unwrap_err().to_string(), "power-cut: keep=2: a fraction from 0 to 1");
        assert!(parse_cut_args(&["now".into()]).is_err());
    }
}
