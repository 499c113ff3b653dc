//! [`ScaLayer`]: a size-changing layer around any [`Codec`]. Upper files show decoded bytes
//! and sizes; the lower files hold the encoded records and the index.
//!
//! Each open file has one [`ScaFile`] shared by all its handles and hard links, reading and
//! writing the lower file through a handle the layer opens for itself below. Everything that
//! is not about file data bypasses to the layer below, without the upper handle: the lower
//! directory has handles of its own, numbered alike, and would answer for another file.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use parking_lot::{Mutex, RwLock};
use plyfs_stack::{
    bypass, Attr, BuildArgs, Caller, DataPath, Error, ExtOpInfo, FileHandle, FileKind, Layer, Level, NodeId, Op, Opened,
    Reply, Result, SetAttr, TimeSet,
};
use plyfs_stack::shared::{LaterInvalidation, LockKind};
use plyfs_stack::spec::{ParamSpec, Params};
use serde_json::Value;

use crate::codec::Codec;
use crate::file::{Engine, Fault, LowerIo, ScaFile};
use crate::format::{FileHeader, Slot, DATA_START, MAX_CHUNK_SHIFT, MIN_CHUNK_SHIFT};

pub const CHUNK_PARAM: ParamSpec = ParamSpec {
    name: "chunk",
    help: "chunk size for new files: a power of two from 4k to 1m (larger chunks compress better)",
    default: Some("4k"),
};

pub const FAST_TAILS_PARAM: ParamSpec = ParamSpec {
    name: "fast_tails",
    help: "keep the last partial chunk unencoded, so small appends do not re-encode it (on/off)",
    default: Some("off"),
};

pub const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo { name: "verify", args: "", help: "decode every chunk of the file and check its index" },
    ExtOpInfo { name: "recover-index", args: "", help: "rebuild the file's index from its data" },
    ExtOpInfo { name: "compact", args: "", help: "move the file's live records together and cut the dead space" },
    ExtOpInfo { name: "sca-stats", args: "", help: "decoded size, encoded size, ratio, dead space" },
];

/// Parse a chunk size (`4k`, `64k`, `1m`, `65536`) into its power of two.
pub fn parse_chunk_size(params: &Params, value: &str) -> Result<u8> {
    let v = value.trim().to_ascii_lowercase();
    let (digits, unit) = match v.strip_suffix(['k', 'm']) {
        Some(d) => (d, if v.ends_with('k') { 1u64 << 10 } else { 1 << 20 }),
        None => (v.as_str(), 1),
    };
    let bytes = digits.parse::<u64>().ok().and_then(|n| n.checked_mul(unit));
    match bytes {
        Some(b) if b.is_power_of_two() && (MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT).contains(&(b.trailing_zeros() as u8)) => {
            Ok(b.trailing_zeros() as u8)
        }
        _ => Err(params.bad(CHUNK_PARAM.name, value, "expected a power of two from 4k to 1m")),
    }
}

/// Build a size-changing layer of kind `kind` around `codec`, reading the framework's own
/// parameters (`chunk`, `fast_tails`) from `args`.
pub fn build_sca_layer(args: BuildArgs, kind: &'static str, codec: Arc<dyn Codec>) -> Result<Arc<dyn Layer>> {
    build_sca_layer_padded(args, kind, codec, false)
}

/// [`build_sca_layer`], padding the size of new files with PADMÉ when `pad` (see
/// [`crate::file`]).
pub fn build_sca_layer_padded(args: BuildArgs, kind: &'static str, codec: Arc<dyn Codec>, pad: bool) -> Result<Arc<dyn Layer>> {
    let chunk_shift = match args.params.get(CHUNK_PARAM.name) {
        Some(v) => parse_chunk_size(&args.params, v)?,
        None => MIN_CHUNK_SHIFT,
    };
    let fast_tails = args.params.flag(FAST_TAILS_PARAM.name, false)?;
    if fast_tails && !codec.plaintext_safe() {
        return Err(Error::config(format!(
            "layer '{}': fast_tails=on is refused: '{kind}' must never leave unencoded data in the lower file",
            args.name
        )));
    }
    let mut ops = EXT_OPS.to_vec();
    ops.extend(codec.info_op());
    Ok(Arc::new(ScaLayer {
        ops,
        name: args.name,
        engine: Arc::new(Engine::new(kind, codec, chunk_shift, fast_tails).sharing(plyfs_stack::shared::mode()).padding(pad)),
        lower: [args.lower],
        open: Mutex::new(HashMap::new()),
        idle: Mutex::new(std::collections::VecDeque::new()),
        next_fh: AtomicU64::new(1),
        sizes: Mutex::new(HashMap::new()),
        appenders: Mutex::new(std::collections::HashSet::new()),
        invalidate: LaterInvalidation::default(),
    }))
}

pub struct ScaLayer {
    name: String,
    /// The framework's extended operations, and the codec's own.
    ops: Vec<ExtOpInfo>,
    engine: Arc<Engine>,
    lower: [Level; 1],
    /// Files open through this layer (or held by an extended operation), and recently closed
    /// ones kept idle.
    open: Mutex<HashMap<NodeId, Arc<OpenFile>>>,
    /// Idle files, oldest first.
    idle: Mutex<std::collections::VecDeque<NodeId>>,
    next_fh: AtomicU64,
    /// Decoded sizes of closed files, valid while the lower attributes are unchanged.
    sizes: Mutex<HashMap<NodeId, CachedSize>>,
    /// Handles opened with `O_APPEND` on a shared mount: their writes go to the end of the
    /// file as it is under the lock, wherever the kernel (which may not know that end) put them.
    appenders: Mutex<std::collections::HashSet<u64>>,
    /// For files another mount changed: the kernel's pages and attributes are dropped.
    invalidate: LaterInvalidation,
}

/// What identifies a version of a lower file's content: any write through this layer or from
/// outside changes its size or mtime. (ctime is left out: chmod and chown change it, and
/// `setattr` here keeps the cache current for utime.)
#[derive(Clone, Copy, PartialEq, Eq)]
struct LowerStamp {
    size: u64,
    mtime: SystemTime,
}

impl LowerStamp {
    fn of(a: &Attr) -> LowerStamp {
        LowerStamp { size: a.size, mtime: a.mtime }
    }
}

#[derive(Clone, Copy)]
struct CachedSize {
    stamp: LowerStamp,
    decoded: u64,
}

struct OpenFile {
    users: Mutex<Users>,
    file: RwLock<ScaFile<LowerFile>>,
    /// The layer's handle on the lower file (also inside `file`), to release it without
    /// taking the file's lock.
    lower_fh: FileHandle,
    /// The lower file as the state last matched it (loaded, or closed); `None` for a file this
    /// layer created. Without `-o shared`, an open that shares the state of an open not yet
    /// released checks it, so a rewrite from outside is not hidden by a release still in
    /// flight.
    seen: Mutex<Option<LowerStamp>>,
    /// Reloading after such a rewrite failed: the state serves nothing, and goes at the last
    /// release.
    broken: std::sync::atomic::AtomicBool,
    /// Without `-o shared`: times set while the file is open and not written since (`tar`,
    /// `cp -p` and `rsync -t` set them on the open file just before closing it). The last
    /// release writes to the lower file, which moves its mtime, so it sets them again afterwards.
    times: Mutex<Option<SetAttr>>,
}

#[derive(Default)]
struct Users {
    /// Upper handles plus extended operations in progress.
    count: usize,
    /// Set once the last user has closed the file: the lower file as it was then. The state
    /// is kept (Fast Indexing §3: the index stays cached as long as possible) and reused by
    /// the next open if the lower file is unchanged.
    idle: Option<LowerStamp>,
}

/// How many closed files keep their index in memory.
const IDLE_FILES: usize = 64;

/// The lower file under an open encoded file: the layer's own handle on the level below.
struct LowerFile {
    level: Level,
    node: NodeId,
    fh: FileHandle,
    writable: bool,
    label: OnceLock<String>,
}

fn internal() -> Caller {
    Caller::daemon()
}

impl LowerIo for LowerFile {
    fn read_at(&self, off: u64, len: usize) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        while out.len() < len {
            let want = (len - out.len()).min(u32::MAX as usize >> 1) as u32;
            let got = self.level.read(&internal(), self.node, self.fh, off + out.len() as u64, want)?;
            if got.is_empty() {
                break;
            }
            if out.is_empty() {
                out = got;
            } else {
                out.extend_from_slice(&got);
            }
        }
        Ok(out)
    }

    fn write_at(&self, off: u64, data: &[u8]) -> Result<()> {
        let mut done = 0;
        while done < data.len() {
            let n = self.level.write(&internal(), self.node, self.fh, off + done as u64, &data[done..])? as usize;
            if n == 0 {
                return Err(Error::Os(libc::EIO));
            }
            done += n;
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<()> {
        let set = SetAttr { size: Some(len), ..Default::default() };
        self.level.call(&internal(), &Op::SetAttr { node: self.node, fh: Some(self.fh), set }).map(|_| ())
    }

    fn len(&self) -> Result<u64> {
        match self.level.call(&internal(), &Op::GetAttr { node: self.node, fh: Some(self.fh) })? {
            Reply::Attr(a) => Ok(a.size),
            _ => Err(Error::Os(libc::EIO)),
        }
    }

    fn sync(&self) -> Result<()> {
        self.level.call(&internal(), &Op::Fsync { node: self.node, fh: self.fh, datasync: true }).map(|_| ())
    }

    fn writable(&self) -> bool {
        self.writable
    }

    fn reserve(&self, len: u64) -> Result<()> {
        let offset = self.len()?;
        let op = Op::Fallocate { node: self.node, fh: self.fh, offset, length: len, mode: libc::FALLOC_FL_KEEP_SIZE };
        match self.level.call(&internal(), &op) {
            // A file system below that cannot set space aside: the size alone, as before.
            Err(e) if e.errno() == libc::EOPNOTSUPP => Ok(()),
            other => other.map(|_| ()),
        }
    }

    fn lock(&self, kind: LockKind) -> Result<()> {
        plyfs_stack::shared::lock(&self.level, self.node, kind)
    }

    fn unlock(&self, kind: LockKind) -> Result<()> {
        plyfs_stack::shared::unlock(&self.level, self.node, kind)
    }

    fn describe(&self) -> String {
        self.label
            .get_or_init(|| {
                self.level
                    .extended(&internal(), self.node, "lower-info", &[])
                    .ok()
                    .and_then(|v| v.get("lower_path").and_then(Value::as_str).map(str::to_owned))
                    .unwrap_or_else(|| format!("inode {}", self.node.0))
            })
            .clone()
    }
}

impl ScaLayer {
    fn below(&self) -> &Level {
        &self.lower[0]
    }

    /// Open the node's lower file for the layer's own use: read-write when possible.
    fn open_lower(&self, node: NodeId) -> Result<LowerFile> {
        let cx = internal();
        let (opened, writable) = match self.below().open(&cx, node, libc::O_RDWR) {
            Ok(o) => (o, true),
            Err(Error::Os(libc::EACCES | libc::EROFS | libc::EPERM)) => (self.below().open(&cx, node, libc::O_RDONLY)?, false),
            Err(e) => return Err(e),
        };
        Ok(LowerFile { level: self.below().clone(), node, fh: opened.fh, writable, label: OnceLock::new() })
    }

    /// Close the layer's own handle on a lower file.
    fn release_lower(&self, node: NodeId, fh: FileHandle) {
        let _ = self.below().release(&internal(), node, fh);
    }

    /// The open state of `node`, opening it if needed, with one more user.
    /// `created`: the layer's handle on a file `create` just opened below, and whether the
    /// file is new and empty there (then nothing needs reading).
    fn acquire(&self, node: NodeId, created: Option<(LowerFile, bool)>) -> Result<Arc<OpenFile>> {
        let mut open = self.open.lock();
        if let Some(f) = open.get(&node).cloned() {
            let mut users = f.users.lock();
            let reusable = match users.idle {
                _ if f.broken.load(Ordering::Relaxed) && users.idle.is_none() => return Err(Error::Os(libc::EIO)),
                None => true, // open, or being closed
                // The content is checked below, under the lock; but the file kept may be gone,
                // and its inode number given to another.
                Some(_) if self.engine.shared.is_some() => self.same_file(node, f.lower_fh),
                Some(stamp) => self.below().getattr(&internal(), node).is_ok_and(|a| LowerStamp::of(&a) == stamp),
            };
            if reusable {
                let was_in_use = users.idle.is_none();
                users.count += 1;
                if users.idle.take().is_some() {
                    self.idle.lock().retain(|n| *n != node);
                }
                if let Some((extra, _)) = created {
                    self.release_lower(extra.node, extra.fh);
                }
                drop(users);
                drop(open);
                if was_in_use && self.engine.shared.is_none() {
                    if let Err(e) = self.recheck(node, &f) {
                        f.broken.store(true, Ordering::Relaxed);
                        let _ = self.relinquish(node);
                        return Err(e);
                    }
                }
                if self.engine.shared.is_some() {
                    // Close-to-open: what other mounts wrote before this open is seen.
                    let checked = self.checked(node, &mut f.file.write(), |file| file.revalidate());
                    if let Err(e) = checked {
                        let _ = self.relinquish(node);
                        return Err(e);
                    }
                }
                return Ok(f.clone());
            }
            // Changed from outside since it was closed: load it afresh.
            drop(users);
            let stale = self.evict(&mut open, node);
            if let Some((node, fh)) = stale {
                self.release_lower(node, fh);
            }
        }
        let (lower, empty) = match created {
            Some(c) => c,
            None => (self.open_lower(node)?, false),
        };
        let fh = lower.fh;
        let file = if empty {
            ScaFile::created(self.engine.clone(), lower)
        } else {
            ScaFile::open(self.engine.clone(), lower).inspect_err(|e| {
                tracing::error!("{}: inode {}: opening: {e}", self.name, node.0);
                self.release_lower(node, fh);
            })?
        };
        let users = Users { count: 1, idle: None };
        let seen = if empty { None } else { self.below().getattr(&internal(), node).ok().map(|a| LowerStamp::of(&a)) };
        let f = Arc::new(OpenFile {
            users: Mutex::new(users),
            file: RwLock::new(file),
            lower_fh: fh,
            seen: Mutex::new(seen),
            broken: std::sync::atomic::AtomicBool::new(false),
            times: Mutex::new(None),
        });
        open.insert(node, f.clone());
        Ok(f)
    }

    /// A state shared with an open not yet released: if the lower file changed since the state
    /// last matched it, and not by writes through this state, load it again (and drop the
    /// kernel's pages of it).
    fn recheck(&self, node: NodeId, f: &OpenFile) -> Result<()> {
        let Some(last) = *f.seen.lock() else { return Ok(()) };
        let now = LowerStamp::of(&self.below().getattr(&internal(), node)?);
        if now == last {
            return Ok(());
        }
        let mut file = f.file.write();
        if file.modified() {
            return Ok(());
        }
        *f.seen.lock() = Some(now);
        let reloaded = file.reload();
        drop(file);
        self.invalidate.node(node);
        reloaded.inspect_err(|e| tracing::error!("{}: inode {}: reloading after another mount changed it: {e}", self.name, node.0))
    }

    /// Run `op` on an open file; if it found that another mount had changed the file, the
    /// kernel's pages and attributes of it are dropped.
    fn checked<T>(&self, node: NodeId, file: &mut ScaFile<LowerFile>, op: impl FnOnce(&mut ScaFile<LowerFile>) -> Result<T>) -> Result<T> {
        let result = op(file);
        if file.take_changed() {
            self.invalidate.node(node);
        }
        result
    }

    /// Whether the layer's handle `fh` on node `node`'s lower file is still on the file the node
    /// names, and that file is not deleted.
    fn same_file(&self, node: NodeId, fh: FileHandle) -> bool {
        let below = self.below();
        let by_handle = below.call(&internal(), &Op::GetAttr { node, fh: Some(fh) });
        let by_node = below.getattr(&internal(), node);
        match (by_handle, by_node) {
            (Ok(Reply::Attr(h)), Ok(n)) => {
                h.nlink > 0 && (h.size, h.mtime, h.ctime, h.nlink) == (n.size, n.mtime, n.ctime, n.nlink)
            }
            _ => false,
        }
    }

    /// Drop an idle file's state.
    ///
    /// Returns the lower handle to release once the table is unlocked (closing a descriptor
    /// under the lock would hold up every open). A file in use is left alone.
    fn evict(&self, open: &mut HashMap<NodeId, Arc<OpenFile>>, node: NodeId) -> Option<(NodeId, FileHandle)> {
        let idle = open.get(&node).is_some_and(|f| f.users.lock().idle.is_some());
        if !idle {
            return None;
        }
        let f = open.remove(&node)?;
        self.idle.lock().retain(|n| *n != node);
        Some((node, f.lower_fh))
    }

    /// Drop one user; the last one closes the file, which then stays idle in the table.
    ///
    /// The file stays in the table while it is being closed, so that an `open` arriving
    /// meanwhile (the kernel sends `release` asynchronously, often after the next `open` of the
    /// same file) shares this state instead of loading a second one from a file still being
    /// written. If it was reopened during the close, it simply stays open.
    fn relinquish(&self, node: NodeId) -> Result<()> {
        let f = {
            let open = self.open.lock();
            let Some(f) = open.get(&node).cloned() else { return Ok(()) };
            let remaining = {
                let mut users = f.users.lock();
                users.count -= 1;
                users.count
            };
            if remaining > 0 {
                return Ok(());
            }
            f
        };
        let file = f.file.write();
        let result = file_close(file);
        if let Some(set) = f.times.lock().take() {
            if let Err(e) = self.below().call(&internal(), &Op::SetAttr { node, fh: None, set }) {
                tracing::warn!("{}: inode {}: setting the times again after the last close: {e}", self.name, node.0);
            }
        }
        let stamp = self.below().getattr(&internal(), node).map(|a| LowerStamp::of(&a));
        let mut open = self.open.lock();
        let mut users = f.users.lock();
        if users.count > 0 {
            return result.map(|_| ());
        }
        match (&result, stamp) {
            (Ok(modified), Ok(stamp)) if !f.broken.load(Ordering::Relaxed) => {
                *f.seen.lock() = Some(stamp);
                users.idle = Some(stamp);
                drop(users);
                if *modified {
                    self.remember_size(node, stamp, f.file.read().size());
                }
                let oldest = {
                    let mut idle = self.idle.lock();
                    idle.push_back(node);
                    if idle.len() > IDLE_FILES { idle.pop_front() } else { None }
                };
                let evicted = oldest.and_then(|old| self.evict(&mut open, old));
                drop(open);
                if let Some((old, fh)) = evicted {
                    self.release_lower(old, fh);
                }
            }
            _ => {
                drop(users);
                if open.get(&node).is_some_and(|current| Arc::ptr_eq(current, &f)) {
                    open.remove(&node);
                }
                self.release_lower(node, f.lower_fh);
            }
        }
        result.map(|_| ())
    }

    fn file_of(&self, node: NodeId) -> Result<Arc<OpenFile>> {
        let f = self.open.lock().get(&node).cloned();
        let f = f.filter(|f| f.users.lock().count > 0).ok_or(Error::Os(libc::EBADF))?;
        if f.broken.load(Ordering::Relaxed) {
            return Err(Error::Os(libc::EIO));
        }
        Ok(f)
    }

    /// Run `op` on the node's file, opening it for the duration if it is not open.
    fn with_file<T>(&self, node: NodeId, op: impl FnOnce(&mut ScaFile<LowerFile>) -> Result<T>) -> Result<T> {
        let f = self.acquire(node, None)?;
        let result = self.checked(node, &mut f.file.write(), op);
        let closed = self.relinquish(node);
        let value = result?;
        closed.map(|()| value)
    }

    /// Report the decoded size of regular files, without decoding any data, and the chunk as
    /// their block size: the unit in which they are written, and in which zeros are holes
    /// (`SEEK_HOLE`), as a kernel file system's block is.
    fn fix_attr(&self, node: NodeId, attr: &mut Attr) {
        if attr.kind != FileKind::File {
            return;
        }
        attr.blksize = 1 << self.engine.chunk_shift;
        let open = self.open.lock().get(&node).cloned();
        if let Some(f) = open {
            let idle = f.users.lock().idle;
            if self.engine.shared.is_some() && idle.is_none() {
                let size = {
                    let file = f.file.read();
                    file.is_fresh().then(|| file.size())
                };
                match size.map_or_else(|| self.checked(node, &mut f.file.write(), |file| file.current_size()), Ok) {
                    Ok(size) => attr.size = size,
                    Err(e) => tracing::warn!("{}: inode {}: cannot tell the decoded size: {e}", self.name, node.0),
                }
                return;
            }
            if idle.is_none_or(|stamp| stamp == LowerStamp::of(attr)) {
                attr.size = f.file.read().size();
                return;
            }
        }
        if attr.size == 0 {
            return;
        }
        let stamp = LowerStamp::of(attr);
        if let Some(c) = self.sizes.lock().get(&node).filter(|c| c.stamp == stamp) {
            attr.size = c.decoded;
            return;
        }
        match self.size_from_header(node, stamp.size).or_else(|_| self.with_file(node, |f| Ok(f.size()))) {
            Ok(decoded) => {
                self.remember_size(node, stamp, decoded);
                attr.size = decoded;
            }
            Err(e) => tracing::warn!("{}: inode {}: cannot tell the decoded size: {e}", self.name, node.0),
        }
    }

    /// Cache a closed file's decoded size; the cache starts over when it grows large.
    fn remember_size(&self, node: NodeId, stamp: LowerStamp, decoded: u64) {
        let mut sizes = self.sizes.lock();
        if sizes.len() > 1 << 16 {
            sizes.clear();
        }
        sizes.insert(node, CachedSize { stamp, decoded });
    }

    /// The decoded size recorded in the file's slots, if they describe the lower file as it is
    /// (a clean close).
    fn size_from_header(&self, node: NodeId, lower_size: u64) -> Result<u64> {
        let lower = self.open_lower(node)?;
        let head = lower.read_at(0, DATA_START as usize);
        self.release_lower(lower.node, lower.fh);
        let head = head?;
        let unclean = || Error::Corrupt("not closed cleanly".into());
        // A padded file's size is sealed in its data: its slots hold the padded size.
        FileHeader::decode(&head)
            .filter(|h| h.codec == self.engine.codec.tag() && h.flags & crate::format::HEADER_PADDED == 0)
            .ok_or_else(unclean)?;
        match Slot::newest_in(&head) {
            Some(s) if s.log_end == lower_size => Ok(s.file_size),
            _ => Err(unclean()),
        }
    }

    fn reply_with_attr(&self, node: NodeId, reply: Reply) -> Reply {
        match reply {
            Reply::Attr(mut a) => {
                self.fix_attr(node, &mut a);
                Reply::Attr(a)
            }
            Reply::Entry(mut e) => {
                self.fix_attr(e.node, &mut e.attr);
                Reply::Entry(e)
            }
            Reply::Created(mut e, o) => {
                self.fix_attr(e.node, &mut e.attr);
                Reply::Created(e, o)
            }
            Reply::Dir(mut entries) => {
                for entry in entries.iter_mut().filter_map(|d| d.entry.as_mut()) {
                    self.fix_attr(entry.node, &mut entry.attr);
                }
                Reply::Dir(entries)
            }
            other => other,
        }
    }

    fn new_handle(&self) -> Opened {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        Opened { fh: FileHandle(fh), backing: None, direct_io: false, flush_on_close: false }
    }

    fn open(&self, node: NodeId, flags: i32) -> Result<Opened> {
        let f = self.acquire(node, None)?;
        let wants_write = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let mut result = Ok(());
        if wants_write && !f.file.read().lower().writable {
            result = Err(Error::Os(libc::EACCES));
        } else if flags & libc::O_TRUNC != 0 && wants_write {
            result = f.file.write().truncate(0);
        }
        match result {
            Ok(()) => Ok(self.new_handle_for(flags)),
            Err(e) => {
                let _ = self.relinquish(node);
                Err(e)
            }
        }
    }

    /// A new handle; on a shared mount, an `O_APPEND` one is remembered, and bypasses the
    /// kernel's page cache: through the cache, the kernel splits a write that ends in a page it
    /// does not hold whole, and another mount's append could land between the pieces.
    fn new_handle_for(&self, flags: i32) -> Opened {
        let mut opened = self.new_handle();
        if self.engine.shared.is_some() && flags & libc::O_APPEND != 0 {
            self.appenders.lock().insert(opened.fh.0);
            opened.direct_io = true;
        }
        opened
    }

    fn create(&self, cx: &Caller, parent: NodeId, name: &std::ffi::OsStr, mode: u32, flags: i32) -> Result<Reply> {
        // The layer's own handle must be able to read and write whatever the caller asked for.
        let lower_flags = (flags & !(libc::O_ACCMODE | libc::O_APPEND | libc::O_TRUNC)) | libc::O_RDWR;
        let (mut entry, opened) = self.below().create(cx, parent, name, mode, lower_flags)?;
        let lower = LowerFile { level: self.below().clone(), node: entry.node, fh: opened.fh, writable: true, label: OnceLock::new() };
        let f = self.acquire(entry.node, Some((lower, entry.attr.size == 0)))?;
        if flags & libc::O_TRUNC != 0 {
            // The guard goes before `relinquish`, which takes it again.
            let truncated = f.file.write().truncate(0);
            if let Err(e) = truncated {
                let _ = self.relinquish(entry.node);
                return Err(e);
            }
        }
        entry.attr.size = f.file.read().size();
        Ok(Reply::Created(entry, self.new_handle_for(flags)))
    }

    fn read(&self, node: NodeId, offset: u64, size: u32) -> Result<Vec<u8>> {
        let f = self.file_of(node)?;
        if self.engine.shared.is_some() {
            // The state checked lately serves; anything else, a failure included (another
            // mount may be moving records), is read again after checking.
            let first = {
                let file = f.file.read();
                file.is_fresh().then(|| file.read(offset, size as usize))
            };
            return match first {
                Some(Ok(data)) => Ok(data),
                _ => self.checked(node, &mut f.file.write(), |file| file.read_current(offset, size as usize)),
            };
        }
        let first = f.file.read().read(offset, size as usize);
        match first {
            Ok(data) => Ok(data),
            Err(Fault::Fail(e)) => Err(e),
            Err(Fault::Stale(_)) => f.file.write().read_repairing(offset, size as usize),
        }
    }

    fn write(&self, node: NodeId, fh: FileHandle, offset: u64, data: &[u8]) -> Result<Reply> {
        let f = self.file_of(node)?;
        *f.times.lock() = None;
        let mut file = f.file.write();
        if self.engine.shared.is_some() && self.appenders.lock().contains(&fh.0) {
            let at = self.checked(node, &mut file, |file| file.append(data))?;
            if at != offset {
                // The kernel wrote its copy of the data where it thought the end was.
                self.invalidate.node(node);
            }
            return Ok(Reply::Written(data.len() as u32));
        }
        let n = self.checked(node, &mut file, |file| file.write(offset, data))?;
        Ok(Reply::Written(n as u32))
    }

    fn setattr(&self, cx: &Caller, node: NodeId, set: &SetAttr) -> Result<Reply> {
        if let Some(size) = set.size {
            self.with_file(node, |f| f.truncate(size))?;
        }
        // A truncate marks the file modified even when its size stays as it was (`O_TRUNC` on
        // an empty file), as truncate(2) does; the lower file then did not change, so its time
        // is set here (found by the differential fuzzer, `difffuzz.rs`).
        let mtime = set.mtime.or(set.size.map(|_| TimeSet::Now));
        let rest = SetAttr { size: None, mtime, ..*set };
        let reply = self.below().call(cx, &Op::SetAttr { node, fh: None, set: rest })?;
        let state = self.open.lock().get(&node).cloned();
        // Shared mounts write changes out before they let go of the file's lock, so the last
        // release has nothing to write; setting the times then could undo another mount's.
        let in_use = state.as_ref().filter(|f| self.engine.shared.is_none() && f.users.lock().count > 0);
        if let Some(f) = in_use {
            let mut times = f.times.lock();
            if set.size.is_some() {
                *times = None;
            }
            if let (Reply::Attr(a), Some(_)) = (&reply, set.mtime) {
                // As the lower file has them now (`TimeSet::Now` resolved).
                let at = |t| Some(TimeSet::At(t));
                *times = Some(SetAttr { atime: set.atime.and(at(a.atime)), mtime: at(a.mtime), ..Default::default() });
            }
        }
        if let (Reply::Attr(a), None) = (&reply, set.size) {
            // Only metadata changed: what is cached about the content still holds, under the
            // lower file's new stamp.
            if let Some(c) = self.sizes.lock().get_mut(&node).filter(|c| c.stamp.size == a.size) {
                c.stamp = LowerStamp::of(a);
            }
            if let Some(f) = &state {
                let mut users = f.users.lock();
                if let Some(stamp) = users.idle.as_mut().filter(|s| s.size == a.size) {
                    *stamp = LowerStamp::of(a);
                }
            }
        }
        Ok(self.reply_with_attr(node, reply))
    }

    fn fallocate(&self, node: NodeId, offset: u64, length: u64, mode: i32) -> Result<Reply> {
        let f = self.file_of(node)?;
        *f.times.lock() = None;
        let mut file = f.file.write();
        let end = offset.checked_add(length).ok_or(Error::Os(libc::EFBIG))?;
        let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        match mode & !libc::FALLOC_FL_KEEP_SIZE {
            0 => {
                file.reserve(offset, length)?;
                if !keep_size {
                    let old = file.size();
                    self.checked(node, &mut file, |file| file.grow_to(end))?;
                    // Growing wrote at the end of the file below, into the room just set aside:
                    // set it aside again from the new end (where the range's writes will go).
                    // That takes only what growing used; should even that fail, the file keeps
                    // its new size (zeros) rather than be cut back under another mount's writes.
                    if file.size() != old {
                        file.reserve(offset, length)?;
                    }
                }
            }
            libc::FALLOC_FL_PUNCH_HOLE if keep_size => self.checked(node, &mut file, |file| file.zero_range(offset, length))?,
            libc::FALLOC_FL_ZERO_RANGE => {
                self.checked(node, &mut file, |file| file.zero_range(offset, length))?;
                if !keep_size {
                    self.checked(node, &mut file, |file| file.grow_to(end))?;
                }
            }
            _ => return Err(Error::Os(libc::EOPNOTSUPP)),
        }
        Ok(Reply::Empty)
    }

    /// `SEEK_DATA` and `SEEK_HOLE` over the decoded file: runs of zero chunks are its holes, so
    /// copies of it (versions, decode) keep them.
    fn lseek(&self, node: NodeId, offset: i64, whence: i32) -> Result<Reply> {
        let f = self.file_of(node)?;
        // A negative offset finds nothing, as lseek(2) says of SEEK_DATA and SEEK_HOLE past the
        // end (xfstests generic/448).
        let offset = u64::try_from(offset).map_err(|_| Error::Os(libc::ENXIO))?;
        let data = match whence {
            libc::SEEK_DATA => true,
            libc::SEEK_HOLE => false,
            _ => return Err(Error::Os(libc::EINVAL)),
        };
        let found = self.checked(node, &mut f.file.write(), |file| file.seek_data_or_hole(offset, data))?;
        found.map(Reply::Offset).ok_or(Error::Os(libc::ENXIO))
    }

    fn extended(&self, cx: &Caller, op: &Op<'_>, node: NodeId, name: &str) -> Result<Reply> {
        let attr = self.below().getattr(&internal(), node)?;
        if attr.kind != FileKind::File {
            return match bypass(self, cx, op) {
                Err(Error::UnsupportedOp { .. }) => {
                    Err(Error::BadArgs(format!("{name}: not a regular file (run it on a file of the '{}' layer)", self.name)))
                }
                other => other,
            };
        }
        let value = self.with_file(node, |f| match name {
            "verify" => f.verify(),
            "recover-index" => f.recover_index(),
            "compact" => f.compact(),
            "sca-stats" => f.stats(),
            _ => Ok(self.engine.codec.info(&f.facts())),
        })?;
        Ok(Reply::Extended(value))
    }
}

/// Close a file (see [`ScaFile::close`]); `Ok(true)` if it was written while open.
fn file_close(mut file: parking_lot::RwLockWriteGuard<'_, ScaFile<LowerFile>>) -> Result<bool> {
    let modified = file.modified();
    file.close().map(|()| modified)
}

impl Layer for ScaLayer {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        self.engine.kind
    }

    fn data_path(&self) -> DataPath {
        DataPath::Transforms
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        &self.ops
    }

    /// A codec that must never leave plaintext below (a cipher) takes every lower file as its
    /// own: serving a plain file would let whoever writes the lower directory pass off content
    /// as authentic. It refuses such a file (EIO) instead.
    fn file_test(&self) -> Option<fn(&[u8]) -> bool> {
        let test: fn(&[u8]) -> bool = crate::format::looks_encoded;
        self.engine.codec.plaintext_safe().then_some(test)
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        match *op {
            // The handle is this layer's, not the lower's: the lower answers by node.
            Op::GetAttr { node, fh: Some(_) } => {
                let reply = bypass(self, cx, &Op::GetAttr { node, fh: None })?;
                Ok(self.reply_with_attr(node, reply))
            }
            Op::Lookup { .. } | Op::MkNod { .. } | Op::Link { .. } | Op::GetAttr { .. } | Op::ReadDir { plus: true, .. } => {
                let reply = bypass(self, cx, op)?;
                Ok(self.reply_with_attr(op.node(), reply))
            }
            Op::SetAttr { node, ref set, .. } => self.setattr(cx, node, set),
            Op::Open { node, flags } => self.open(node, flags).map(Reply::Opened),
            Op::Create { parent, name, mode, flags } => self.create(cx, parent, name, mode, flags),
            Op::Read { node, offset, size, .. } => self.read(node, offset, size).map(Reply::Data),
            Op::Write { node, fh, offset, data } => self.write(node, fh, offset, data),
            Op::Flush { .. } => Ok(Reply::Empty),
            Op::Fsync { node, .. } => self.file_of(node)?.file.write().sync().map(|()| Reply::Empty),
            Op::Release { node, fh } => {
                if self.engine.shared.is_some() {
                    self.appenders.lock().remove(&fh.0);
                }
                self.relinquish(node).map(|()| Reply::Empty)
            }
            Op::Forget { node, .. } => {
                // The kernel no longer knows the file: keep no idle state for it.
                let evicted = self.evict(&mut self.open.lock(), node);
                if let Some((node, fh)) = evicted {
                    self.release_lower(node, fh);
                }
                bypass(self, cx, op)
            }
            Op::Fallocate { node, offset, length, mode, .. } => self.fallocate(node, offset, length, mode),
            Op::Lseek { node, offset, whence, .. } => self.lseek(node, offset, whence),
            // The lower file's flags are not this file's: an encoded file refuses them (the
            // kernel tells `lsattr` and `chattr` "Operation not supported"). Directories pass.
            Op::Ioctl { node, .. } if self.open.lock().contains_key(&node) => {
                tracing::debug!("{}: inode {}: file-attribute flags refused on an encoded file", self.name, node.0);
                Err(Error::Os(libc::ENOTTY))
            }
            Op::Extended { node, name, .. } if self.ops.iter().any(|e| e.name == name) => self.extended(cx, op, node, name),
            _ => bypass(self, cx, op),
        }
    }

    fn set_invalidator(&self, inv: Arc<dyn plyfs_stack::Invalidator>) {
        if self.engine.shared.is_some() {
            self.invalidate.set(inv.clone());
        }
        self.below().layer().set_invalidator(inv);
    }

    fn shutdown(&self) {
        let files: Vec<(NodeId, Arc<OpenFile>)> = self.open.lock().drain().collect();
        for (node, f) in files {
            if let Err(e) = f.file.write().close() {
                tracing::error!("{}: inode {}: closing at shutdown: {e}", self.name, node.0);
            }
            self.release_lower(node, f.lower_fh);
        }
    }
}
