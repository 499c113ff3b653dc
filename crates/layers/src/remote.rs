//! The `remote` bottom layer: a stack served by another process or machine, reached through
//! the protocol.
//!
//! The layer keeps its own node ids and file handles, each mapped to the server's. Node ids are
//! the server's wherever they are free, so inode numbers read the same on both sides. A node
//! also remembers its parent and name. When the connection breaks, the layer reconnects by
//! itself; the server's ids of the old connection are then void (the server may have restarted),
//! and each node and open file is found again on first use: the node by walking its path from
//! the root, checked to be the same object (the same server id), the file by opening that node
//! again. So handles outlive a server restart without the server keeping any state, as NFS file
//! handles do. A request in flight when the connection broke is sent again when doing it twice is
//! harmless; otherwise it fails with `EIO`. Every wait is bounded by the layer's timeout.

use std::collections::{HashMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use plyfs_stack::{Caller, DirEntry, Error, ExtOpInfo, Invalidator, Layer, Level, NodeId, Op, Opened, Reply, Result};

use plyfs_transport::client::{CallError, Connection, OnChange, Ticket};
use plyfs_transport::Connector;
use plyfs_transport::wire::{Change, CompoundOp, OpHeader, WireCaller, WireReply};

/// Nodes (with a name: an entry of the directory) whose cached state must go.
type Notices = Vec<(u64, Option<OsString>)>;

/// Ids the layer makes up when the server's id is taken by another node.
const OWN_IDS: u64 = 1 << 55;

struct RNode {
    /// The server's id in connection `epoch`.
    server: u64,
    epoch: u64,
    /// Lookups of `server` this layer holds on the server (in `epoch`).
    server_lookups: u64,
    /// Lookups the layer above holds on this node.
    lookups: u64,
    /// Where the node was last seen, to find it again.
    parent: u64,
    name: OsString,
}

struct RFile {
    node: u64,
    server_fh: u64,
    epoch: u64,
    flags: i32,
    dir: bool,
    /// The server asked to hear of every close (`flush`).
    server_flush: bool,
}

/// A directory's entries, read with its opening (`listdir`) and handed to the readdirs that
/// follow in order: a directory costs one crossing rather than an opendir and two readdirs.
/// Each entry holds one lookup of its node until it is handed on.
struct Listing {
    entries: VecDeque<DirEntry>,
    /// The offset the next readdir asks for, when it reads on in order.
    offset: u64,
    /// The entries reach the end of the directory.
    complete: bool,
    /// Something changed since the listing was read (through this mount, or a server's
    /// notice): what is left is not handed on, and readdirs read on from the server's handle,
    /// which gives what is still there (with `plus`) with its attributes now.
    stale: bool,
}

/// The most entries a listing holds; a larger directory is read on from the server.
const LISTING_ENTRIES: u32 = 1024;

#[derive(Default)]
struct Table {
    nodes: HashMap<u64, RNode>,
    /// Server id (current epoch) to own id.
    by_server: HashMap<u64, u64>,
    next_own: u64,
}

/// A write sent ahead: the writer got its reply at once, and the server's is collected later
/// (as NFS's unstable writes). The data stays until then, to send again if the connection
/// breaks first.
struct Behind {
    fh: u64,
    offset: u64,
    data: Vec<u8>,
    cx: Caller,
    conn: Arc<Connection>,
    ticket: Ticket,
}

/// Writes in flight per file, at most: enough to keep the connection and the server busy.
const BEHIND_WRITES: usize = 16;
const BEHIND_BYTES: usize = 16 << 20;
/// Writes smaller than this wait for the server.
const SEND_AHEAD_MIN: usize = 64 << 10;

/// How long the absence of an extended attribute is remembered (as long as the kernel keeps
/// attributes by default); the server's change notices forget it at once.
const ABSENT_XATTR_TTL: Duration = Duration::from_secs(1);

struct Inner {
    /// Extended attributes known to be absent (`ENODATA`), and nodes known to have none (an
    /// empty `listxattr`, name empty): `ls -l` asks for them for every file.
    absent_xattrs: Mutex<HashMap<(u64, Vec<u8>), Instant>>,
    name: String,
    connector: Box<dyn Connector>,
    timeout: Duration,
    conn: RwLock<Option<Arc<Connection>>>,
    /// Held while connecting, so one thread connects and the others wait for it.
    connecting: Mutex<()>,
    /// Counts connections: ids and handles of an older one are void.
    epoch: AtomicU64,
    table: Mutex<Table>,
    files: Mutex<HashMap<u64, RFile>>,
    next_fh: AtomicU64,
    ext_ops: OnceLock<&'static [ExtOpInfo]>,
    invalidator: RwLock<Option<Arc<dyn Invalidator>>>,
    /// Writes sent ahead, per node, oldest first; `behind_count` counts them (a quick look).
    behind: Mutex<HashMap<u64, VecDeque<Behind>>>,
    behind_count: AtomicUsize,
    /// The first failure of a write sent ahead, per handle: reported by the next write, fsync
    /// or close (flush) through it.
    deferred: Mutex<HashMap<u64, Error>>,
    settling: Mutex<()>,
    sync_writes: std::sync::atomic::AtomicBool,
    /// Listings of open directories, by handle.
    listings: Mutex<HashMap<u64, Listing>>,
    /// How many times listings were made stale (under the `listings` lock): a listing whose
    /// `listdir` was in flight across a change starts stale.
    listing_changes: AtomicU64,
    /// The server answers `listdir` (until it says it does not know it).
    lists: std::sync::atomic::AtomicBool,
    /// Changes to invalidate, for the thread that does it: the kernel may make that thread wait
    /// for a directory that a request in flight holds, and that request's reply must not wait
    /// behind it.
    notices: Mutex<std::sync::mpsc::Sender<Notices>>,
}

pub struct Remote(Arc<Inner>);

impl Remote {
    /// Connect (the first connection must succeed) and make the layer. A server that cannot be
    /// reached or refuses is `Error::Connect`, which callers tell from other failures.
    pub fn connect(name: &str, connector: Box<dyn Connector>, timeout: Duration) -> std::result::Result<Remote, crate::Error> {
        let mut table = Table { next_own: OWN_IDS, ..Default::default() };
        table.nodes.insert(
            NodeId::ROOT.0,
            RNode { server: NodeId::ROOT.0, epoch: 0, server_lookups: 0, lookups: u64::MAX / 2, parent: 0, name: OsString::new() },
        );
        let (notices, notices_rx) = std::sync::mpsc::channel();
        let inner = Arc::new(Inner {
            absent_xattrs: Mutex::new(HashMap::new()),
            name: name.to_owned(),
            connector,
            timeout,
            conn: RwLock::new(None),
            connecting: Mutex::new(()),
            epoch: AtomicU64::new(0),
            table: Mutex::new(table),
            files: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            ext_ops: OnceLock::new(),
            invalidator: RwLock::new(None),
            behind: Mutex::new(HashMap::new()),
            behind_count: AtomicUsize::new(0),
            deferred: Mutex::new(HashMap::new()),
            settling: Mutex::new(()),
            sync_writes: std::sync::atomic::AtomicBool::new(false),
            listings: Mutex::new(HashMap::new()),
            listing_changes: AtomicU64::new(0),
            lists: std::sync::atomic::AtomicBool::new(true),
            notices: Mutex::new(notices),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("remote-notices".into())
            .spawn(move || {
                for batch in notices_rx {
                    let Some(inner) = weak.upgrade() else { return };
                    let Some(inv) = inner.invalidator.read().clone() else { continue };
                    for (node, name) in batch {
                        match name {
                            Some(name) => inv.entry(NodeId(node), &name),
                            None => inv.node(NodeId(node)),
                        }
                    }
                }
            })
            .map_err(crate::Error::io("starting the thread that passes on invalidations for", &inner.name))?;
        // One try: a server that is not there at mount time is a mistake to report, not wait out.
        let conn = inner.reconnect(None, Instant::now())?;
        // The server's extended operations, leaked once: layers describe theirs statically.
        let ext: Vec<ExtOpInfo> =
            conn.welcome.ext_ops.iter().map(|o| o.to_static(&format!("{} (on the server's '{}')", o.help, o.level))).collect();
        let _ = inner.ext_ops.set(Box::leak(ext.into_boxed_slice()));
        let layers: Vec<String> = conn.welcome.layers.iter().map(|l| l.name.clone()).collect();
        tracing::info!(
            "{}: connected to {} ({}; stack [{}])",
            inner.name,
            inner.connector.describe(),
            conn.welcome.software,
            layers.join(", ")
        );
        Ok(Remote(inner))
    }

    /// Make every write wait for the server's reply (as NFS's `sync`), instead of sending
    /// writes ahead.
    pub fn sync_writes(self, on: bool) -> Remote {
        self.0.sync_writes.store(on, Ordering::Relaxed);
        self
    }

    pub fn level(self) -> Level {
        Level::new(Arc::new(self))
    }
}

fn idempotent(op: &OpHeader, append: bool) -> bool {
    match op {
        OpHeader::MkNod { .. }
        | OpHeader::MkDir { .. }
        | OpHeader::Unlink { .. }
        | OpHeader::RmDir { .. }
        | OpHeader::SymLink { .. }
        | OpHeader::Rename { .. }
        | OpHeader::Link { .. }
        | OpHeader::Create { .. }
        | OpHeader::RemoveXattr { .. }
        | OpHeader::Extended { .. } => false,
        OpHeader::SetXattr { flags, .. } => flags & libc::XATTR_CREATE == 0,
        OpHeader::Write { .. } => !append,
        _ => true,
    }
}

impl Inner {
    fn eio(&self, what: &str) -> Error {
        tracing::error!("{}: {what}", self.name);
        Error::Os(libc::EIO)
    }

    /// The current connection, or a new one if it is gone.
    fn connection(self: &Arc<Self>, deadline: Instant) -> std::result::Result<Arc<Connection>, crate::Error> {
        if let Some(c) = self.conn.read().as_ref().filter(|c| !c.is_dead()) {
            return Ok(c.clone());
        }
        let broken = self.conn.read().clone();
        self.reconnect(broken, deadline)
    }

    /// Replace `broken` (or nothing) with a new connection, trying until `deadline`.
    fn reconnect(
        self: &Arc<Self>,
        broken: Option<Arc<Connection>>,
        deadline: Instant,
    ) -> std::result::Result<Arc<Connection>, crate::Error> {
        let _one = self.connecting.lock();
        if let Some(c) = self.conn.read().as_ref() {
            if !c.is_dead() && broken.as_ref().is_none_or(|b| !Arc::ptr_eq(b, c)) {
                return Ok(c.clone());
            }
        }
        let mut pause = Duration::from_millis(50);
        let mut logged = false;
        loop {
            let weak = Arc::downgrade(self);
            let on_change: OnChange = Arc::new(move |changes| {
                if let Some(inner) = weak.upgrade() {
                    inner.changed(changes);
                }
            });
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
            match self.connector.connect(left.min(self.timeout), on_change) {
                Ok(conn) => {
                    let epoch = self.epoch.fetch_add(1, Ordering::AcqRel) + 1;
                    self.absent_xattrs.lock().clear();
                    // Perhaps another server, which may list directories; no notice came while
                    // the connection was down, so what the listings hold may be old.
                    self.lists.store(true, Ordering::Relaxed);
                    self.listings_stale();
                    {
                        let mut t = self.table.lock();
                        t.by_server.clear();
                        // The root is the root on every connection.
                        if let Some(root) = t.nodes.get_mut(&NodeId::ROOT.0) {
                            root.epoch = epoch;
                        }
                        t.by_server.insert(NodeId::ROOT.0, NodeId::ROOT.0);
                    }
                    if broken.is_some() || logged {
                        tracing::warn!("{}: reconnected to {}", self.name, self.connector.describe());
                    }
                    *self.conn.write() = Some(conn.clone());
                    return Ok(conn);
                }
                Err(e) if e.refused || Instant::now() + pause >= deadline => {
                    return Err(crate::Error::Connect { peer: self.connector.describe(), why: e.msg })
                }
                Err(e) => {
                    if !logged && broken.is_some() {
                        tracing::warn!("{}: lost {} ({e}); reconnecting", self.name, self.connector.describe());
                        logged = true;
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    fn changed(&self, changes: Vec<Change>) {
        self.listings_stale();
        self.forget_xattrs(changes.iter().filter_map(|c| match c {
            Change::Node { node } => Some(*node),
            Change::Entry { .. } => None,
        }));
        let t = self.table.lock();
        let mine = |server: u64| t.by_server.get(&server).copied();
        let mut out: Vec<(u64, Option<OsString>)> = Vec::new();
        for c in changes {
            match c {
                Change::Node { node } => out.extend(mine(node).map(|n| (n, None))),
                Change::Entry { parent, name } => out.extend(mine(parent).map(|p| (p, Some(OsStr::from_bytes(&name).to_owned())))),
            }
        }
        drop(t);
        if !out.is_empty() {
            let _ = self.notices.lock().send(out);
        }
    }

    /// This mount's nodes for these server ids (those it knows).
    fn known_nodes(&self, server_nodes: impl Iterator<Item = u64>) -> Vec<u64> {
        let t = self.table.lock();
        server_nodes.filter_map(|s| t.by_server.get(&s).copied()).collect()
    }

    /// Forget what is known of the extended attributes of these nodes (server ids).
    fn forget_xattrs(&self, server_nodes: impl Iterator<Item = u64>) {
        let nodes = self.known_nodes(server_nodes);
        if nodes.is_empty() {
            return;
        }
        self.absent_xattrs.lock().retain(|(n, _), _| !nodes.contains(n));
    }

    /// Whether `name` (empty: any) is known to be absent on `node`.
    fn known_absent(&self, node: u64, name: &[u8]) -> bool {
        let mut absent = self.absent_xattrs.lock();
        let fresh = |k: &(u64, Vec<u8>)| absent.get(k).is_some_and(|t| t.elapsed() < ABSENT_XATTR_TTL);
        if fresh(&(node, Vec::new())) || fresh(&(node, name.to_vec())) {
            return true;
        }
        if absent.len() > 100_000 {
            absent.retain(|_, t| t.elapsed() < ABSENT_XATTR_TTL);
        }
        false
    }

    /// The server's id for node `id` on `conn` (epoch `epoch`), finding it again by its path if
    /// it is from an older connection.
    fn server_node(&self, conn: &Connection, epoch: u64, cx: WireCaller, id: u64, deadline: Instant) -> Result<u64> {
        self.server_node_at(conn, epoch, cx, id, deadline, 0)
    }

    fn server_node_at(&self, conn: &Connection, epoch: u64, cx: WireCaller, id: u64, deadline: Instant, depth: usize) -> Result<u64> {
        // Deeper than any path can be: the recorded names form a loop.
        if depth > 2048 {
            return Err(self.eio(&format!("node {id}: its recorded path does not reach the root")));
        }
        let (server, node_epoch, parent, name) = {
            let t = self.table.lock();
            let n = t.nodes.get(&id).ok_or(Error::Os(libc::ESTALE))?;
            (n.server, n.epoch, n.parent, n.name.clone())
        };
        if node_epoch == epoch {
            return Ok(server);
        }
        if id == NodeId::ROOT.0 || parent == 0 {
            return Err(Error::Os(libc::ESTALE));
        }
        let server_parent = self.server_node_at(conn, epoch, cx, parent, deadline, depth + 1)?;
        let op = OpHeader::Lookup { parent: server_parent, name: plyfs_stack::op_header::ByteBuf::from(name.as_bytes().to_vec()) };
        let found = match conn.call(cx, op, &[], deadline) {
            Ok((WireReply::Entry(e), _)) => e.node,
            Ok((WireReply::Error(e), _)) => {
                tracing::warn!("{}: {:?} is gone from the server after reconnecting: {}", self.name, name, e.msg);
                return Err(Error::Os(libc::ESTALE));
            }
            Ok(_) => return Err(self.eio("a lookup got the wrong reply")),
            Err(e) => return Err(self.call_failed(e)),
        };
        let mut t = self.table.lock();
        let Some(n) = t.nodes.get_mut(&id) else {
            // Forgotten meanwhile: give the lookup back.
            let _ = conn.send_only(cx, OpHeader::Forget { node: found, nlookup: 1 });
            return Err(Error::Os(libc::ESTALE));
        };
        if found != server && server != 0 {
            drop(t);
            let _ = conn.send_only(cx, OpHeader::Forget { node: found, nlookup: 1 });
            tracing::warn!("{}: {:?} is another object on the server now", self.name, name);
            return Err(Error::Os(libc::ESTALE));
        }
        if n.epoch == epoch {
            // Another thread found it first.
            let s = n.server;
            drop(t);
            let _ = conn.send_only(cx, OpHeader::Forget { node: found, nlookup: 1 });
            return Ok(s);
        }
        n.server = found;
        n.epoch = epoch;
        n.server_lookups = 1;
        t.by_server.insert(found, id);
        Ok(found)
    }

    /// The server's handle for handle `fh`, opening the file again after a reconnection.
    fn server_fh(&self, conn: &Connection, epoch: u64, cx: WireCaller, fh: u64, deadline: Instant) -> Result<u64> {
        let (node, server_fh, fh_epoch, flags, dir) = {
            let files = self.files.lock();
            let f = files.get(&fh).ok_or(Error::Os(libc::EBADF))?;
            (f.node, f.server_fh, f.epoch, f.flags, f.dir)
        };
        if fh_epoch == epoch {
            return Ok(server_fh);
        }
        let server_node = self.server_node(conn, epoch, cx, node, deadline)?;
        let op = if dir {
            OpHeader::OpenDir { node: server_node }
        } else {
            OpHeader::Open { node: server_node, flags: flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC) }
        };
        let opened = match conn.call(cx, op, &[], deadline) {
            Ok((WireReply::Opened(o), _)) => o.fh,
            Ok((WireReply::Error(e), _)) => {
                tracing::warn!("{}: cannot open inode {node} again after reconnecting: {}", self.name, e.msg);
                return Err(Error::Os(libc::EIO));
            }
            Ok(_) => return Err(self.eio("an open got the wrong reply")),
            Err(e) => return Err(self.call_failed(e)),
        };
        let mut files = self.files.lock();
        match files.get_mut(&fh) {
            Some(f) if f.epoch != epoch => {
                f.server_fh = opened;
                f.epoch = epoch;
                Ok(opened)
            }
            other => {
                let result = other.map(|f| f.server_fh).ok_or(Error::Os(libc::EBADF));
                drop(files);
                let release = if dir {
                    OpHeader::ReleaseDir { node: server_node, fh: opened }
                } else {
                    OpHeader::Release { node: server_node, fh: opened }
                };
                let _ = conn.call(cx, release, &[], deadline);
                result
            }
        }
    }

    fn call_failed(&self, e: CallError) -> Error {
        match e {
            CallError::TimedOut => self.eio(&format!("no reply from {} within {:?}", self.connector.describe(), self.timeout)),
            CallError::Lost { reason, .. } => self.eio(&format!("lost {}: {reason}", self.connector.describe())),
        }
    }

    /// The node id this layer gives the server's `server` (new or known), with one more
    /// lookup held by the layer above; `parent`/`name` say where it was found.
    fn adopt(&self, epoch: u64, server: u64, parent: u64, name: &OsStr) -> u64 {
        // `.` and `..` are not where an object lives: they would make its path a loop.
        let named = name != "." && name != "..";
        let mut t = self.table.lock();
        if let Some(&id) = t.by_server.get(&server) {
            if let Some(n) = t.nodes.get_mut(&id) {
                n.lookups += 1;
                n.server_lookups += 1;
                if named {
                    n.parent = parent;
                    n.name = name.to_owned();
                }
                return id;
            }
        }
        let (parent, name) = if named { (parent, name) } else { (0, OsStr::new("")) };
        let id = if server < OWN_IDS && !t.nodes.contains_key(&server) {
            server
        } else {
            loop {
                t.next_own += 1;
                let candidate = t.next_own;
                if !t.nodes.contains_key(&candidate) {
                    break candidate;
                }
            }
        };
        t.nodes.insert(id, RNode { server, epoch, server_lookups: 1, lookups: 1, parent, name: name.to_owned() });
        t.by_server.insert(server, id);
        id
    }

    fn forget(&self, node: u64, n: u64) {
        let give_back = {
            let mut t = self.table.lock();
            let Some(rn) = t.nodes.get_mut(&node) else { return };
            rn.lookups = rn.lookups.saturating_sub(n);
            if rn.lookups > 0 || node == NodeId::ROOT.0 {
                return;
            }
            let rn = t.nodes.remove(&node).expect("just seen");
            if t.by_server.get(&rn.server) == Some(&node) {
                t.by_server.remove(&rn.server);
            }
            (rn.epoch == self.epoch.load(Ordering::Acquire) && rn.server_lookups > 0).then_some((rn.server, rn.server_lookups))
        };
        if let Some((server, nlookup)) = give_back {
            if let Some(conn) = self.conn.read().as_ref().filter(|c| !c.is_dead()) {
                let _ = conn.send_only(WireCaller { uid: 0, gid: 0, pid: 0 }, OpHeader::Forget { node: server, nlookup });
            }
        }
    }

    /// Map the ids in `op` to the server's.
    fn to_server(&self, conn: &Connection, epoch: u64, cx: WireCaller, op: &mut OpHeader, deadline: Instant) -> Result<()> {
        let node = |id: &mut u64| -> Result<()> {
            *id = self.server_node(conn, epoch, cx, *id, deadline)?;
            Ok(())
        };
        let fh = |h: &mut u64| -> Result<()> {
            *h = self.server_fh(conn, epoch, cx, *h, deadline)?;
            Ok(())
        };
        use OpHeader::*;
        match op {
            Lookup { parent, .. }
            | MkNod { parent, .. }
            | MkDir { parent, .. }
            | Unlink { parent, .. }
            | RmDir { parent, .. }
            | SymLink { parent, .. }
            | Create { parent, .. } => node(parent),
            Rename { parent, new_parent, .. } => {
                node(parent)?;
                node(new_parent)
            }
            Link { node: n, new_parent, .. } => {
                node(n)?;
                node(new_parent)
            }
            GetAttr { node: n, fh: h } | SetAttr { node: n, fh: h, .. } => {
                // An optional handle only speeds things up: drop it if it cannot be had.
                if let Some(x) = h {
                    match self.server_fh(conn, epoch, cx, *x, deadline) {
                        Ok(s) => *x = s,
                        Err(_) => *h = None,
                    }
                }
                node(n)
            }
            Read { node: n, fh: h, .. }
            | Write { node: n, fh: h, .. }
            | Flush { node: n, fh: h }
            | Fsync { node: n, fh: h, .. }
            | Release { node: n, fh: h }
            | ReadDir { node: n, fh: h, .. }
            | ReleaseDir { node: n, fh: h }
            | FsyncDir { node: n, fh: h, .. }
            | Fallocate { node: n, fh: h, .. }
            | Lseek { node: n, fh: h, .. }
            | Ioctl { node: n, fh: h, .. } => {
                fh(h)?;
                node(n)
            }
            Forget { .. } => Ok(()),
            ReadLink { node: n }
            | Open { node: n, .. }
            | OpenDir { node: n }
            | StatFs { node: n }
            | Access { node: n, .. }
            | GetXattr { node: n, .. }
            | SetXattr { node: n, .. }
            | ListXattr { node: n, .. }
            | RemoveXattr { node: n, .. }
            | Extended { node: n, .. } => node(n),
        }
    }

    /// Map the server's ids in a reply to this layer's, and keep the table's names current.
    fn adopt_reply(&self, epoch: u64, op: &Op<'_>, reply: Reply) -> Reply {
        match reply {
            Reply::Entry(mut e) => {
                let (parent, name) = match *op {
                    Op::Lookup { parent, name } | Op::MkNod { parent, name, .. } | Op::MkDir { parent, name, .. } => (parent, name),
                    Op::SymLink { parent, name, .. } => (parent, name),
                    Op::Link { new_parent, new_name, .. } => (new_parent, new_name),
                    _ => (NodeId(0), OsStr::new("")),
                };
                e.node = NodeId(self.adopt(epoch, e.node.0, parent.0, name));
                Reply::Entry(e)
            }
            Reply::Created(mut e, mut o) => {
                let (parent, name, flags) = match *op {
                    Op::Create { parent, name, flags, .. } => (parent, name, flags),
                    _ => (NodeId(0), OsStr::new(""), 0),
                };
                e.node = NodeId(self.adopt(epoch, e.node.0, parent.0, name));
                o.fh = self.own_fh(e.node.0, o.fh.0, epoch, flags, false, o.flush_on_close);
                o.flush_on_close |= Self::writable(flags);
                Reply::Created(e, o)
            }
            Reply::Opened(mut o) => {
                let (node, flags, dir) = match *op {
                    Op::Open { node, flags } => (node, flags, false),
                    Op::OpenDir { node } => (node, 0, true),
                    _ => (NodeId(0), 0, false),
                };
                o.fh = self.own_fh(node.0, o.fh.0, epoch, flags, dir, o.flush_on_close);
                // Writes are sent ahead: a close must hear how they went.
                o.flush_on_close |= !dir && Self::writable(flags);
                Reply::Opened(o)
            }
            Reply::Dir(entries) => {
                let parent = op.node().0;
                Reply::Dir(entries.into_iter().map(|d| self.dir_entry(epoch, parent, d)).collect())
            }
            other => other,
        }
    }

    fn dir_entry(&self, epoch: u64, parent: u64, mut d: DirEntry) -> DirEntry {
        match d.entry.as_mut() {
            Some(e) => {
                e.node = NodeId(self.adopt(epoch, e.node.0, parent, &d.name));
                d.node = e.node;
            }
            None => {
                let t = self.table.lock();
                if let Some(&id) = t.by_server.get(&d.node.0) {
                    d.node = NodeId(id);
                }
            }
        }
        d
    }

    fn writable(flags: i32) -> bool {
        flags & libc::O_ACCMODE != libc::O_RDONLY
    }

    fn own_fh(&self, node: u64, server_fh: u64, epoch: u64, flags: i32, dir: bool, server_flush: bool) -> plyfs_stack::FileHandle {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.files.lock().insert(fh, RFile { node, server_fh, epoch, flags, dir, server_flush });
        plyfs_stack::FileHandle(fh)
    }

    /// Keep names current after a change of the namespace this layer made.
    fn renamed(&self, op: &Op<'_>) {
        let Op::Rename { parent, name, new_parent, new_name, flags } = *op else { return };
        let mut t = self.table.lock();
        let find = |t: &Table, p: u64, n: &OsStr| t.nodes.iter().find(|(_, r)| r.parent == p && r.name == n).map(|(id, _)| *id);
        let moved = find(&t, parent.0, name);
        let other = find(&t, new_parent.0, new_name);
        if let Some(id) = moved {
            let r = t.nodes.get_mut(&id).expect("found");
            r.parent = new_parent.0;
            r.name = new_name.to_owned();
        }
        if let Some(id) = other.filter(|o| Some(*o) != moved) {
            let r = t.nodes.get_mut(&id).expect("found");
            if flags & libc::RENAME_EXCHANGE != 0 {
                r.parent = parent.0;
                r.name = name.to_owned();
            } else {
                // Replaced: it has no name any more.
                r.parent = 0;
            }
        }
    }

    fn unlinked(&self, parent: NodeId, name: &OsStr) {
        let mut t = self.table.lock();
        if let Some(r) = t.nodes.values_mut().find(|r| r.parent == parent.0 && r.name == name) {
            r.parent = 0;
        }
    }

    fn call(self: &Arc<Self>, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        if !plyfs_stack::readonly::changes_storage(op) {
            return self.call_unchanging(cx, op);
        }
        // Before, for the listings read already; after, for a listdir that was in flight and
        // read the directory before the change reached it.
        self.listings_stale();
        let result = self.call_unchanging(cx, op);
        self.listings_stale();
        result
    }

    /// [`Self::call`], the listings' staleness aside.
    fn call_unchanging(self: &Arc<Self>, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        if let Op::Write { node, fh, offset, data } = *op {
            if let Some(e) = self.deferred.lock().remove(&fh.0) {
                return Err(e);
            }
            // Small writes are mostly followed by something that must wait for them (tar
            // sets the times next): sending them ahead only adds a hand-over.
            if data.len() >= SEND_AHEAD_MIN && self.may_send_ahead(fh.0) {
                return self.send_ahead(cx, op, node.0, fh.0, offset, data);
            }
        }
        if self.behind_count.load(Ordering::Acquire) > 0 {
            // Nothing may overtake a write in flight, nor see the file without it: the
            // server runs data requests side by side.
            match *op {
                Op::Forget { .. } => {}
                // A listing carries the attributes of the directory's entries.
                Op::Lookup { .. } | Op::ReadDir { .. } | Op::OpenDir { .. } => self.settle_all(),
                _ => self.settle(op.node().0, usize::MAX),
            }
        }
        match *op {
            Op::Flush { fh, .. } => {
                if let Some(e) = self.deferred.lock().remove(&fh.0) {
                    return Err(e);
                }
                // Asked for the writes' sake only: nothing to tell the server.
                if !self.files.lock().get(&fh.0).is_some_and(|f| f.server_flush) {
                    return Ok(Reply::Empty);
                }
            }
            Op::Fsync { fh, .. } => {
                if let Some(e) = self.deferred.lock().remove(&fh.0) {
                    return Err(e);
                }
            }
            Op::Release { fh, .. } | Op::ReleaseDir { fh, .. } => {
                self.deferred.lock().remove(&fh.0);
                // Not under the lock: forgets write to the socket, and the reader takes the
                // lock for a server's notice.
                let left = self.listings.lock().remove(&fh.0);
                if let Some(left) = left {
                    self.forget_listed(left);
                }
                self.release(cx, fh.0);
                return Ok(Reply::Empty);
            }
            Op::OpenDir { node } => {
                if let Some(opened) = self.open_listed(cx, node) {
                    return opened;
                }
            }
            Op::ReadDir { fh, offset, max_entries, plus, .. } => {
                if let Some(entries) = self.from_listing(fh.0, offset, max_entries, plus) {
                    return Ok(Reply::Dir(entries));
                }
            }
            _ => {}
        }
        match *op {
            Op::Forget { node, nlookup } => {
                self.forget(node.0, nlookup);
                return Ok(Reply::Empty);
            }
            Op::GetXattr { node, name, .. } if self.known_absent(node.0, name.as_bytes()) => return Err(Error::Os(libc::ENODATA)),
            Op::ListXattr { node, .. } if self.known_absent(node.0, b"") => {
                return Ok(Reply::Xattr(plyfs_stack::XattrReply::Size(0)));
            }
            Op::SetXattr { node, .. } | Op::RemoveXattr { node, .. } => {
                self.absent_xattrs.lock().retain(|(n, _), _| *n != node.0);
            }
            _ => {}
        }
        let result = self.call_remote(cx, op);
        match (op, &result) {
            (Op::GetXattr { node, name, .. }, Err(Error::Os(libc::ENODATA))) => {
                self.absent_xattrs.lock().insert((node.0, name.as_bytes().to_vec()), Instant::now());
            }
            (Op::ListXattr { node, .. }, Ok(Reply::Xattr(x)))
                if matches!(x, plyfs_stack::XattrReply::Size(0)) || matches!(x, plyfs_stack::XattrReply::Data(d) if d.is_empty()) =>
            {
                self.absent_xattrs.lock().insert((node.0, Vec::new()), Instant::now());
            }
            _ => {}
        }
        result
    }

    /// `opendir` as `listdir`: the directory's entries come with its opening, for the
    /// readdirs that follow (see [`Listing`]). `None` when the server cannot list, or the
    /// connection broke: the caller then opens the directory as usual.
    fn open_listed(self: &Arc<Self>, cx: &Caller, node: NodeId) -> Option<Result<Reply>> {
        if !self.lists.load(Ordering::Relaxed) {
            return None;
        }
        let deadline = Instant::now() + self.timeout;
        let conn = self.connection(deadline).ok()?;
        let epoch = self.epoch.load(Ordering::Acquire);
        let wcx = WireCaller::from(cx);
        let server_node = match self.server_node(&conn, epoch, wcx, node.0, deadline) {
            Ok(n) => n,
            Err(e) => return Some(Err(e)),
        };
        let changes_before = self.listing_changes.load(Ordering::Acquire);
        let listing = match conn.call(wcx, CompoundOp::ListDir { node: server_node, max_entries: LISTING_ENTRIES }, &[], deadline) {
            Ok((WireReply::Listing(l), _)) => l,
            Ok((WireReply::Error(e), _)) if e.errno == libc::ENOSYS => {
                tracing::debug!("{}: the server does not list directories ({}); reading them entry by entry", self.name, e.msg);
                self.lists.store(false, Ordering::Relaxed);
                return None;
            }
            Ok((WireReply::Error(e), _)) => return Some(Err(e.to_error("opendir"))),
            Ok(_) => return Some(Err(self.eio("a listdir got the wrong reply"))),
            Err(CallError::Lost { .. }) => return None,
            Err(e) => return Some(Err(self.call_failed(e))),
        };
        let entries = listing.entries.iter().map(|d| self.dir_entry(epoch, node.0, DirEntry::from(d))).collect();
        self.note_bare(listing.entries.iter().filter_map(|d| d.entry.as_ref()).filter(|e| e.xattrs == Some(false)).map(|e| e.node));
        let fh = self.own_fh(node.0, listing.fh, epoch, 0, true, false);
        let mut listings = self.listings.lock();
        // A change through this mount or a server's notice while the listdir was in flight
        // may have come after the server read the directory.
        let stale = self.listing_changes.load(Ordering::Acquire) != changes_before;
        listings.insert(fh.0, Listing { entries, offset: 0, complete: listing.complete, stale });
        drop(listings);
        Some(Ok(Reply::Opened(Opened { fh, backing: None, direct_io: false, flush_on_close: false })))
    }

    /// What a readdir of handle `fh` at `offset` gets from its listing: `None` when the
    /// listing is gone, stale with entries left, or read to its end short of the directory's,
    /// or the reader went elsewhere; the readdir then goes to the server. A listing read to
    /// the directory's end has nothing left to be stale: whether names made since the
    /// directory was opened are read is unspecified (POSIX `readdir`).
    fn from_listing(&self, fh: u64, offset: u64, max_entries: u32, plus: bool) -> Option<Vec<DirEntry>> {
        let mut listings = self.listings.lock();
        let listing = listings.get_mut(&fh)?;
        let serves = offset == listing.offset
            && if listing.entries.is_empty() { listing.complete } else { !listing.stale };
        if !serves {
            let left = listings.remove(&fh).expect("just seen");
            drop(listings);
            self.forget_listed(left);
            return None;
        }
        let n = listing.entries.len().min(max_entries as usize);
        let mut batch: Vec<DirEntry> = listing.entries.drain(..n).collect();
        if let Some(last) = batch.last() {
            listing.offset = last.next_offset;
        }
        drop(listings);
        if !plus {
            for e in batch.iter_mut().filter_map(|d| d.entry.take()) {
                self.forget(e.node.0, 1);
            }
        }
        Some(batch)
    }

    /// Give back the lookups that the entries of a listing still hold.
    fn forget_listed(&self, listing: Listing) {
        for e in listing.entries.iter().filter_map(|d| d.entry.as_ref()) {
            self.forget(e.node.0, 1);
        }
    }

    /// Keep no listing's entries from now on: something may have changed them.
    fn listings_stale(&self) {
        let mut listings = self.listings.lock();
        self.listing_changes.fetch_add(1, Ordering::AcqRel);
        for listing in listings.values_mut() {
            listing.stale = true;
        }
    }

    /// Remember that these nodes (server ids) have no extended attributes, as the server said.
    fn note_bare(&self, server_nodes: impl Iterator<Item = u64>) {
        let mine = self.known_nodes(server_nodes);
        if mine.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut absent = self.absent_xattrs.lock();
        for n in mine {
            absent.insert((n, Vec::new()), now);
        }
    }

    /// Give the server's handle back without waiting for its reply: nobody would hear of a
    /// failure (the kernel does not wait for a release either), and the next request on the
    /// connection comes after it.
    fn release(&self, cx: &Caller, fh: u64) {
        let Some(f) = self.files.lock().remove(&fh) else { return };
        let epoch = self.epoch.load(Ordering::Acquire);
        if f.epoch != epoch {
            // The server's handle went with its connection.
            return;
        }
        let server_node = {
            let t = self.table.lock();
            t.nodes.get(&f.node).filter(|n| n.epoch == epoch).map(|n| n.server)
        };
        let (Some(node), Some(conn)) = (server_node, self.conn.read().clone()) else { return };
        let op = if f.dir { OpHeader::ReleaseDir { node, fh: f.server_fh } } else { OpHeader::Release { node, fh: f.server_fh } };
        let _ = conn.send_only(WireCaller::from(cx), op);
    }

    /// Whether writes through handle `fh` may be sent ahead: not appends (their place is the
    /// end of the file when they run), nor synchronous or direct ones (the writer wants them
    /// done).
    fn may_send_ahead(&self, fh: u64) -> bool {
        if self.sync_writes.load(Ordering::Relaxed) {
            return false;
        }
        let files = self.files.lock();
        files.get(&fh).is_some_and(|f| !f.dir && f.flags & (libc::O_APPEND | libc::O_DSYNC | libc::O_SYNC | libc::O_DIRECT) == 0)
    }

    /// Send a write and answer it at once; its reply is collected by the next operation on
    /// the file (a failure is reported by the next write, fsync or close through `fh`).
    fn send_ahead(self: &Arc<Self>, cx: &Caller, op: &Op<'_>, node: u64, fh: u64, offset: u64, data: &[u8]) -> Result<Reply> {
        let end = offset + data.len() as u64;
        loop {
            let settle = {
                let behind = self.behind.lock();
                match behind.get(&node) {
                    None => None,
                    Some(q) if q.iter().any(|b| b.offset < end && offset < b.offset + b.data.len() as u64) => Some(usize::MAX),
                    Some(q)
                        if q.len() >= BEHIND_WRITES || q.iter().map(|b| b.data.len()).sum::<usize>() + data.len() > BEHIND_BYTES =>
                    {
                        Some(1)
                    }
                    Some(_) => None,
                }
            };
            match settle {
                Some(n) => self.settle(node, n),
                None => break,
            }
        }
        let deadline = Instant::now() + self.timeout;
        let Ok(conn) = self.connection(deadline) else { return self.call_remote(cx, op) };
        let epoch = self.epoch.load(Ordering::Acquire);
        let wcx = WireCaller::from(cx);
        let (mut server_op, payload) = op.to_header();
        if self.to_server(&conn, epoch, wcx, &mut server_op, deadline).is_err() {
            return self.call_remote(cx, op);
        }
        let Ok(ticket) = conn.send(wcx, server_op, payload) else { return self.call_remote(cx, op) };
        let b = Behind { fh, offset, data: data.to_vec(), cx: *cx, conn, ticket };
        self.behind.lock().entry(node).or_default().push_back(b);
        self.behind_count.fetch_add(1, Ordering::AcqRel);
        Ok(Reply::Written(data.len() as u32))
    }

    /// Collect the replies of up to `most` of the oldest writes sent ahead on `node`.
    fn settle(self: &Arc<Self>, node: u64, most: usize) {
        // One thread settles at a time, so that none returns while another still waits for a
        // write it took off the queue.
        let _one = self.settling.lock();
        for _ in 0..most {
            let b = {
                let mut behind = self.behind.lock();
                let Some(q) = behind.get_mut(&node) else { return };
                let b = q.pop_front();
                if q.is_empty() {
                    behind.remove(&node);
                }
                match b {
                    Some(b) => b,
                    None => return,
                }
            };
            self.behind_count.fetch_sub(1, Ordering::AcqRel);
            self.finish(node, b);
        }
    }

    fn settle_all(self: &Arc<Self>) {
        let nodes: Vec<u64> = self.behind.lock().keys().copied().collect();
        for node in nodes {
            self.settle(node, usize::MAX);
        }
    }

    fn finish(self: &Arc<Self>, node: u64, b: Behind) {
        let len = b.data.len();
        let deadline = Instant::now() + self.timeout;
        let result = match b.ticket.wait(&b.conn, deadline) {
            Ok((reply, payload)) => reply.into_result(payload, "write"),
            // Lost with the connection: send it again on the next (a write is idempotent).
            Err(CallError::Lost { .. }) => {
                let op = Op::Write { node: NodeId(node), fh: plyfs_stack::FileHandle(b.fh), offset: b.offset, data: &b.data };
                self.call_remote(&b.cx, &op)
            }
            Err(e) => Err(self.call_failed(e)),
        };
        let err = match result {
            Ok(Reply::Written(n)) if n as usize == len => return,
            Ok(Reply::Written(n)) => {
                tracing::error!("{}: {}: the server wrote {n} of {len} bytes at {}", self.name, self.path_of(node), b.offset);
                Error::Os(libc::ENOSPC)
            }
            Ok(_) => Error::Os(libc::EIO),
            Err(e) => e,
        };
        tracing::error!(
            "{}: {}: a write of {len} bytes at {} failed after the writer was answered ({err}); the next write, fsync or close through its handle reports it",
            self.name,
            self.path_of(node),
            b.offset
        );
        self.deferred.lock().entry(b.fh).or_insert(err);
    }

    /// Where `node` was last seen, for log lines.
    fn path_of(&self, node: u64) -> String {
        let t = self.table.lock();
        let mut parts = Vec::new();
        let mut id = node;
        while id != NodeId::ROOT.0 && parts.len() < 4096 {
            match t.nodes.get(&id) {
                Some(n) if n.parent != 0 => {
                    parts.push(n.name.to_string_lossy().into_owned());
                    id = n.parent;
                }
                _ => return format!("node {node}"),
            }
        }
        parts.reverse();
        format!("/{}", parts.join("/"))
    }

    fn call_remote(self: &Arc<Self>, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let (wire_op, payload) = op.to_header();
        let append = match *op {
            Op::Write { fh, .. } => self.files.lock().get(&fh.0).is_some_and(|f| f.flags & libc::O_APPEND != 0),
            _ => false,
        };
        let cx = WireCaller::from(cx);
        let deadline = Instant::now() + self.timeout;
        let mut attempts = 0;
        // Server ids of entries the server says have no extended attributes.
        let bare: Vec<u64>;
        let result = loop {
            attempts += 1;
            let conn = match self.connection(deadline) {
                Ok(c) => c,
                Err(e) => return Err(self.eio(&e.to_string())),
            };
            let epoch = self.epoch.load(Ordering::Acquire);
            let mut server_op = wire_op.clone();
            match self.to_server(&conn, epoch, cx, &mut server_op, deadline) {
                Ok(()) => {}
                Err(Error::Os(libc::EIO)) if conn.is_dead() && attempts < 20 => continue,
                Err(e) => return Err(e),
            }
            match conn.call(cx, server_op, payload, deadline) {
                Ok((mut reply, data)) => {
                    bare = reply.entries_mut().into_iter().filter(|e| e.xattrs == Some(false)).map(|e| e.node).collect();
                    break reply.into_result(data, op.name());
                }
                Err(CallError::Lost { sent, reason }) => {
                    if (!sent || idempotent(&wire_op, append)) && Instant::now() < deadline && attempts < 20 {
                        tracing::debug!("{}: {} lost ({reason}); sending it again", self.name, op.name());
                        continue;
                    }
                    return Err(self.eio(&format!(
                        "{} was in flight when the connection to {} broke ({reason}); it may or may not have happened",
                        op.name(),
                        self.connector.describe()
                    )));
                }
                Err(e) => return Err(self.call_failed(e)),
            }
        };
        let epoch = self.epoch.load(Ordering::Acquire);
        match result {
            Ok(reply) => {
                match *op {
                    Op::Rename { .. } => self.renamed(op),
                    Op::Unlink { parent, name } | Op::RmDir { parent, name } => self.unlinked(parent, name),
                    Op::Release { fh, .. } | Op::ReleaseDir { fh, .. } => {
                        self.files.lock().remove(&fh.0);
                    }
                    _ => {}
                }
                let reply = self.adopt_reply(epoch, op, reply);
                self.note_bare(bare.into_iter());
                Ok(reply)
            }
            Err(e) => {
                if let Op::Release { fh, .. } | Op::ReleaseDir { fh, .. } = *op {
                    self.files.lock().remove(&fh.0);
                }
                Err(e)
            }
        }
    }
}

impl Layer for Remote {
    fn name(&self) -> &str {
        &self.0.name
    }

    fn kind(&self) -> &'static str {
        "remote"
    }

    fn lower(&self) -> &[Level] {
        &[]
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        self.0.ext_ops.get().copied().unwrap_or(&[])
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        plyfs_stack::readonly::check(op)?;
        self.0.call(cx, op)
    }

    fn set_invalidator(&self, inv: Arc<dyn Invalidator>) {
        *self.0.invalidator.write() = Some(inv);
    }

    fn shutdown(&self) {
        self.0.settle_all();
        if let Some(c) = self.0.conn.write().take() {
            c.close("the mount is shutting down");
        }
    }
}
