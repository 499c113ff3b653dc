//! The server side: a stack exported to clients (`plyfs serve`), or one layer hosted for a mount
//! that reaches it through an `ext` layer.
//!
//! Each connection is served by a few workers that take turns reading: the one that read a
//! request answers it, so a request costs no hand-over between threads, and several requests of
//! one connection are answered at once (pipelining).
//!
//! A connection can only name what it was given: node ids it looked up (or the root) and file
//! handles it opened. Anything else is `ESTALE` or `EBADF`, so a client cannot reach objects
//! outside the exported tree by guessing ids, and never another client's open files. Names are
//! single components (no `/`, `.` or `..`), and the stack's bottom layer never follows symlinks.
//! What a connection holds is released when it ends.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use plyfs_stack::admission::{Admission, Admitted, ByteBudget, ConnectionLimits, Deadline, DeadlineRead, Permit};
use plyfs_stack::shared::{LockKind, LOCK_OP};
use std::os::unix::ffi::OsStrExt;
use std::time::Instant;

use plyfs_stack::{Caller, Error, Groups, Level, NodeId, Op, Reply, XattrReply};

use crate::stream::{wait_readable, Control, Duplex, FrameRead, Gaps};
use crate::wire::{
    self, Change, CompoundOp, FrameError, FrameLimits, JustId, Message, OpHeader, RequestOp, WireCaller, WireExtOp, WireLayer, WireListing,
    WireReply,
};

/// A request read from a connection.
struct Request {
    id: u64,
    caller: WireCaller,
    op: RequestOp,
    payload: Vec<u8>,
    /// The connection's in-flight bytes this request holds until it is answered.
    held: Permit,
}

/// Who a connection comes from, for the limits on connections: a TCP client's address (not its
/// port), or a Unix-socket peer's user.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    Addr(std::net::IpAddr),
    User(u32),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Addr(a) => write!(f, "address {a}"),
            Origin::User(uid) => write!(f, "user {uid}"),
        }
    }
}

/// The ids a server acts as for a connection's requests.
///
/// Every identity but `AsSent` is *mapped*: the server decides who the client is, and each of
/// its operations runs as that user at the bottom layer (see `plyfs_stack::Caller::confined`),
/// so the kernel's own rules hold for it whatever the request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Identity {
    /// The ids the client sends (a root client, or an authenticated client without squashing).
    AsSent,
    /// The ids the client sends, except root, which becomes `nobody` (NFS's root squash). The
    /// groups are the server's own idea of the user's (its group database), never the client's.
    RootSquash,
    /// Always these ids, whatever the client sends (a Unix-socket peer that is not root).
    Fixed { uid: u32, gid: u32, groups: Groups },
}

/// The `nobody` user and group.
pub const NOBODY: u32 = 65534;

/// How long the server trusts what its group database said of a user.
const GROUPS_FOR: Duration = Duration::from_secs(60);

/// Checks a client's proof of the shared key in its `hello`, and proves the server's own.
pub trait Authenticator: Send + Sync {
    /// `Ok(proof)` to send back in `welcome`, or the one-line reason to refuse the client.
    fn check(&self, proof: Option<&[u8]>) -> Result<Option<Vec<u8>>, String>;
}

/// How a server is set up.
pub struct ServerOptions {
    /// Workers per connection: how many of its requests run at once.
    pub workers: usize,
    /// How long a client may take from connecting to being welcome: the whole handshake (TLS,
    /// preamble, hello, proof of the key), not each read of it.
    pub handshake_timeout: Duration,
    /// How many connections the server takes, in all and per client.
    pub limits: ConnectionLimits,
    /// The bytes of requests (headers and payloads) one connection may have read and not yet
    /// answered; past it the server stops reading that connection until some are answered.
    pub in_flight_bytes: usize,
    /// Mapped clients may make and open block and character devices.
    pub allow_devices: bool,
    /// Mapped clients may set and remove `security.*` and `trusted.*` attributes.
    pub allow_privileged_xattrs: bool,
    /// A file at the export's root that every client may open read-only, whatever ids the
    /// server acts as for it: a crypt volume's configuration, served as stored, which every client
    /// needs to unlock the volume (a root client is `nobody` here; gocryptfs.conf is likewise
    /// readable by whoever mounts). Only a regular file with one link, owned by root or by the owner
    /// of the export's root, in an export root that only its owner may make entries in (neither
    /// group- nor world-writable), so that no client can pass another file off as it.
    pub readable_by_all: Option<&'static str>,
}

/// The default bound on a connection's requests in flight: four writes of the largest size.
pub const IN_FLIGHT_BYTES: usize = 4 * wire::limits::MAX_IO;

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            workers: 4,
            handshake_timeout: Duration::from_secs(10),
            limits: ConnectionLimits::default(),
            in_flight_bytes: IN_FLIGHT_BYTES,
            allow_devices: false,
            allow_privileged_xattrs: false,
            readable_by_all: None,
        }
    }
}

/// An exported level and the connections to it.
pub struct Server {
    top: Level,
    layers: Vec<WireLayer>,
    ext_ops: Vec<WireExtOp>,
    /// A new value at every start, so clients know their node ids and handles are gone.
    instance: u64,
    options: ServerOptions,
    conns: Mutex<Vec<Weak<Conn>>>,
    next_conn: AtomicU64,
    admission: Admission<Origin>,
    /// Users' supplementary groups, from the server's group database, by (uid, gid).
    groups: Mutex<HashMap<(u32, u32), (Groups, Instant)>>,
}

/// What one connection holds, so it can be checked and released.
struct Conn {
    id: u64,
    peer: String,
    writer: Mutex<Box<dyn Write + Send>>,
    control: Arc<dyn Control>,
    identity: Identity,
    /// Node ids this connection looked up, with the number of lookups it holds.
    nodes: Mutex<HashMap<u64, u64>>,
    /// Handles this connection opened: the node each is on, and whether it is a directory's.
    files: Mutex<HashMap<u64, (u64, bool)>>,
    /// Whom the locks on lower files this connection takes (`lower-lock`) belong to, and how
    /// many of each kind it holds per node: dropped when it goes, as a killed mount's are.
    lock_owner: u64,
    locks: Mutex<HashMap<(u64, LockKind), u32>>,
    closed: AtomicBool,
}

impl Conn {
    /// Why this connection must end, naming its client.
    fn broke(&self, why: impl std::fmt::Display) -> crate::Error {
        crate::Error::Peer { peer: format!("client {}", self.peer), why: why.to_string() }
    }
}

impl Server {
    /// Serve `top`, whose stack has `layers` (top first) and answers `ext_ops`.
    pub fn new(top: Level, layers: Vec<WireLayer>, ext_ops: Vec<WireExtOp>, options: ServerOptions) -> Arc<Server> {
        let mut seed = [0u8; 8];
        if getrandom(&mut seed).is_err() {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            seed = (t.as_nanos() as u64 ^ u64::from(std::process::id())).to_le_bytes();
        }
        Arc::new(Server {
            top,
            layers,
            ext_ops,
            instance: u64::from_le_bytes(seed) | 1,
            admission: Admission::new(options.limits),
            options,
            conns: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(1),
            groups: Mutex::new(HashMap::new()),
        })
    }

    /// Export a whole stack: its levels and extended operations, by name.
    pub fn for_stack(stack: &plyfs_stack::Stack, options: ServerOptions) -> Arc<Server> {
        let layers =
            stack.named_levels().into_iter().map(|n| WireLayer { name: n.name, kind: n.level.layer().kind().to_owned() }).collect();
        let ext_ops = stack.extended_ops_from(stack.top()).into_iter().map(|(level, op)| WireExtOp::of(&op, &level)).collect();
        Server::new(stack.top().clone(), layers, ext_ops, options)
    }

    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// How many clients are connected now.
    pub fn connections(&self) -> usize {
        self.conns.lock().iter().filter(|c| c.strong_count() > 0).count()
    }

    /// A place for a connection from `client` (see [`ServerOptions::limits`]), taken before
    /// anything is read from it; the reason to give it otherwise. Refusals are logged here,
    /// once per client and minute.
    pub fn admit(&self, client: &Origin) -> Result<Admitted<Origin>, String> {
        self.admission.admit(client)
    }

    /// Log that `client` was refused (its handshake failed, or it may not connect at all): once
    /// per client and minute, however many times it tries.
    pub fn log_refusal(&self, client: &Origin, reason: &str) {
        self.admission.log_refusal(client, reason)
    }

    /// When a handshake that starts now must be over.
    pub fn handshake_deadline(&self) -> Deadline {
        Deadline::after(self.options.handshake_timeout)
    }

    /// Serve one connection until it ends; `peer` names it in log lines.
    pub fn serve(self: &Arc<Self>, stream: Box<dyn Duplex>, peer: &str, identity: Identity, auth: Option<&dyn Authenticator>) {
        self.serve_until(stream, peer, None, identity, auth, self.handshake_deadline())
    }

    /// [`Server::serve`] a connection from `client` whose handshake must be over by `deadline`
    /// (set when it was accepted, so the TLS handshake counts).
    pub fn serve_until(
        self: &Arc<Self>,
        stream: Box<dyn Duplex>,
        peer: &str,
        client: Option<&Origin>,
        identity: Identity,
        auth: Option<&dyn Authenticator>,
        deadline: Deadline,
    ) {
        let halves = match stream.split() {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("client {peer}: splitting the connection: {e}");
                return;
            }
        };
        let mut reader = halves.reader;
        let mut writer = halves.writer;
        let shaken = {
            let control = &*halves.control;
            let set_timeout = |left| {
                control.set_read_timeout(Some(left));
                Ok(())
            };
            let mut reader = DeadlineRead { inner: &mut *reader, set_timeout: &set_timeout, deadline };
            self.handshake(&mut reader, &mut writer, auth)
        };
        if let Err(e) = shaken {
            match client {
                Some(client) => self.log_refusal(client, &format!("{e} ({peer})")),
                None => tracing::warn!("client {peer} refused: {e}"),
            }
            halves.control.close();
            return;
        }
        halves.control.set_read_timeout(None);
        let conn = Arc::new(Conn {
            id: self.next_conn.fetch_add(1, Ordering::Relaxed),
            peer: peer.to_owned(),
            writer: Mutex::new(writer),
            control: halves.control,
            identity,
            nodes: Mutex::new(HashMap::new()),
            files: Mutex::new(HashMap::new()),
            lock_owner: plyfs_stack::shared::new_lock_owner(),
            locks: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        });
        {
            let mut conns = self.conns.lock();
            conns.retain(|c| c.strong_count() > 0);
            conns.push(Arc::downgrade(&conn));
        }
        tracing::debug!("client {peer} connected (connection {})", conn.id);
        // Each worker has a queue, and the requests on one file always go to the same worker, in
        // order: writes sent ahead to one file then never wait for each other's locks (ext4
        // serialises them, and its waiters spin). At most `PER_WORKER` requests wait in a
        // queue; then the reader waits too, and so does a client that sends faster than its
        // requests are answered. What bounds the memory of those requests is the in-flight
        // budget (`read_requests`): a queue of large writes would hold 8 MiB per place.
        const PER_WORKER: usize = 6;
        let mut queues = Vec::new();
        std::thread::scope(|s| {
            for i in 1..self.options.workers.max(2) {
                let (tx, rx) = std::sync::mpsc::sync_channel::<(Request, Arc<AtomicUsize>)>(PER_WORKER);
                queues.push(tx);
                let conn = &conn;
                let _ = std::thread::Builder::new().name(format!("serve-{}-{i}", conn.id)).spawn_scoped(s, move || loop {
                    let Ok((req, busy)) = rx.recv() else { return };
                    let done = self.run(conn, req);
                    busy.fetch_sub(1, Ordering::AcqRel);
                    if let Err(reason) = done {
                        return self.close(conn, Some(reason));
                    }
                });
            }
            self.read_requests(&conn, reader, std::mem::take(&mut queues));
        });
        self.release_all(&conn);
        tracing::debug!("client {peer} disconnected");
    }

    fn handshake(&self, reader: &mut dyn Read, writer: &mut dyn Write, auth: Option<&dyn Authenticator>) -> Result<(), String> {
        writer.write_all(&wire::PREAMBLE).map_err(|e| e.to_string())?;
        wire::read_preamble(reader).map_err(|e| e.to_string())?;
        // Until the peer proved the key, it gets a few KiB, no more.
        let frame = wire::read_frame_within(reader, FrameLimits::HELLO).map_err(|e| e.to_string())?;
        let refuse = |writer: &mut dyn Write, reason: String| {
            let _ = wire::write_frame(writer, &wire::encode(&Message::Refused { reason: reason.clone() }), &[]);
            Err(reason)
        };
        let (versions, proof) = match wire::decode(&frame.header) {
            Ok(Message::Hello { versions, auth, .. }) => (versions, auth),
            Ok(_) => return refuse(writer, "the first message must be hello".into()),
            Err(e) => return refuse(writer, format!("a malformed hello: {e}")),
        };
        let Some(version) = wire::VERSIONS.iter().rev().find(|v| versions.contains(v)).copied() else {
            return refuse(writer, format!("no common protocol version (client: {versions:?}, server: {:?})", wire::VERSIONS));
        };
        let my_proof = match auth.map(|a| a.check(proof.as_ref().map(|p| &p[..]))) {
            None => None,
            Some(Ok(p)) => p,
            Some(Err(reason)) => return refuse(writer, reason),
        };
        let welcome = Message::Welcome {
            version,
            software: format!("plyfs {}", env!("CARGO_PKG_VERSION")),
            instance: self.instance,
            layers: self.layers.clone(),
            ext_ops: self.ext_ops.clone(),
            auth: my_proof.map(serde_bytes::ByteBuf::from),
            hosted: None,
        };
        wire::write_frame(writer, &wire::encode(&welcome), &[]).map_err(|e| e.to_string())
    }

    /// The connection's reader: it polls a little before sleeping (the next request of a busy
    /// client comes sooner than a sleeping thread would wake), answers requests that only touch
    /// metadata itself, without handing them to another thread, and passes those that may take
    /// long (data, syncs, extended operations) to the workers, so they run side by side.
    fn read_requests(
        &self,
        conn: &Arc<Conn>,
        mut reader: Box<dyn FrameRead>,
        workers: Vec<std::sync::mpsc::SyncSender<(Request, Arc<AtomicUsize>)>>,
    ) {
        let busy = Arc::new(AtomicUsize::new(0));
        // A frame's bytes are taken from the budget before they are read: when the requests in
        // flight hold it all, reading waits, and so does the client.
        let budget = ByteBudget::new(self.options.in_flight_bytes);
        let gaps = Gaps::default();
        while !conn.closed.load(Ordering::Relaxed) {
            let frame = match wait_readable(&*reader, &gaps, None) {
                Ok(_) => wire::read_lengths(&mut reader, FrameLimits::SESSION).and_then(|(header, payload)| {
                    let held = budget.take(header + payload);
                    wire::read_body(&mut reader, header, payload).map(|f| (f, held))
                }),
                Err(e) => Err(FrameError::Io(e)),
            };
            let (frame, held) = match frame {
                Ok(f) => f,
                Err(FrameError::Closed) => return self.close(conn, None),
                Err(e) => return self.close(conn, Some(conn.broke(e))),
            };
            let req = match self.decode(conn, frame, held) {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(reason) => return self.close(conn, Some(reason)),
            };
            let slow = matches!(
                req.op,
                RequestOp::Stack(
                    OpHeader::Read { .. }
                        | OpHeader::Write { .. }
                        | OpHeader::Fsync { .. }
                        | OpHeader::FsyncDir { .. }
                        | OpHeader::Flush { .. }
                        | OpHeader::Release { .. }
                        | OpHeader::Fallocate { .. }
                        | OpHeader::Extended { .. }
                        | OpHeader::SetAttr { set: wire::SetAttrHeader { size: Some(_), .. }, .. }
                )
            );
            // A data request waits for a worker only when something else is going on: another
            // request in the workers' hands, or the next one already here. A single writer's
            // requests then cost no hand-over either.
            let alone = || busy.load(Ordering::Acquire) == 0 && !reader.buffered() && !readable_now(reader.fd());
            let done = if slow && !alone() {
                busy.fetch_add(1, Ordering::AcqRel);
                let worker = &workers[(op_node(&req.op) % workers.len() as u64) as usize];
                worker.send((req, busy.clone())).map_err(|_| conn.broke("the workers are gone"))
            } else {
                self.run(conn, req)
            };
            if let Err(reason) = done {
                return self.close(conn, Some(reason));
            }
        }
    }

    /// End `conn`, logging why when it is not the client's own doing (`reason` names the client).
    fn close(&self, conn: &Conn, reason: Option<crate::Error>) {
        if !conn.closed.swap(true, Ordering::Relaxed) {
            if let Some(reason) = reason {
                tracing::warn!("{reason}; closing the connection");
            }
            conn.control.close();
        }
    }

    /// A request from a frame. A request that cannot be read but has an id is answered with an
    /// error here (`None`); anything else unreadable ends the connection.
    fn decode(&self, conn: &Conn, frame: wire::Frame, held: Permit) -> Result<Option<Request>, crate::Error> {
        match wire::decode(&frame.header) {
            Ok(Message::Req { id, caller, op }) => Ok(Some(Request { id, caller, op, payload: frame.payload, held })),
            Ok(other) => Err(conn.broke(format!("unexpected message {:?}", message_type(&other)))),
            Err(e) => {
                let Ok(JustId { t, id, op }) = wire::from_msgpack::<JustId>(&frame.header) else {
                    return Err(conn.broke(format!("a malformed message: {e}")));
                };
                if t != "req" {
                    return Err(conn.broke(format!("a malformed message: {e}")));
                }
                let (errno, msg) = match op {
                    Some(op) if !is_known(&op) => (libc::ENOSYS, format!("unknown operation '{op}'")),
                    _ => (libc::EPROTO, format!("malformed request: {e}")),
                };
                self.send(conn, id, WireReply::Error(wire::WireError { errno, msg, class: None }), Vec::new())?;
                Ok(None)
            }
        }
    }

    /// Run one request and answer it. An error ends the connection.
    fn run(&self, conn: &Conn, req: Request) -> Result<(), crate::Error> {
        // `_held` keeps the request's bytes counted until it is answered.
        let Request { id, caller, op, payload, held: _held } = req;
        let cx = self.caller(conn.identity, caller);
        let (mut reply, payload) = match &op {
            RequestOp::Compound(CompoundOp::ListDir { node, max_entries }) => match self.list_dir(conn, &cx, NodeId(*node), *max_entries) {
                Ok(listing) => (WireReply::Listing(listing), Vec::new()),
                Err(e) => WireReply::from_result(Err(e)),
            },
            _ => WireReply::from_result(op.stack_op(&payload).and_then(|op| self.dispatch(conn, &cx, &op))),
        };
        let changes = match reply {
            WireReply::Error(_) => Vec::new(),
            _ => changes_of(&op),
        };
        if id != 0 {
            self.hint_xattrs(&cx, &mut reply);
            self.send(conn, id, reply, payload)?;
        }
        if !changes.is_empty() {
            self.broadcast(conn.id, &changes);
        }
        Ok(())
    }

    /// `listdir`: the directory opened and read with attributes from the start until its end
    /// or `max_entries`. Each step is checked as it would be asked alone, and the handle and
    /// entries are held as those of `opendir` and `readdir` with `plus` are.
    fn list_dir(&self, conn: &Conn, cx: &Caller, node: NodeId, max_entries: u32) -> Result<WireListing, Error> {
        let fh = match self.dispatch(conn, cx, &Op::OpenDir { node })? {
            Reply::Opened(o) => o.fh,
            _ => return Err(Error::Os(libc::EIO)),
        };
        let most = max_entries.min(wire::limits::MAX_DIR_ENTRIES) as usize;
        let mut entries: Vec<plyfs_stack::DirEntry> = Vec::new();
        let read = loop {
            if entries.len() >= most {
                break Ok(false);
            }
            let offset = entries.last().map_or(0, |e| e.next_offset);
            let left = (most - entries.len()) as u32;
            match self.dispatch(conn, cx, &Op::ReadDir { node, fh, offset, max_entries: left, plus: true }) {
                // A layer that hides names (crypt's companions) may answer a small window with
                // nothing before the end: only an empty answer to a window as large as the
                // kernel's smallest is taken for the end, as a plain readdir would; otherwise
                // the client reads on.
                Ok(Reply::Dir(batch)) if batch.is_empty() => break Ok(left >= END_WINDOW),
                Ok(Reply::Dir(batch)) => entries.extend(batch),
                Ok(_) => break Err(Error::Os(libc::EIO)),
                Err(e) => break Err(e),
            }
        };
        let at_end = match read {
            Ok(at_end) => at_end,
            Err(e) => {
                for held in entries.iter().filter_map(|d| d.entry.as_ref()) {
                    let _ = self.dispatch(conn, cx, &Op::Forget { node: held.node, nlookup: 1 });
                }
                let _ = self.dispatch(conn, cx, &Op::ReleaseDir { node, fh });
                return Err(e);
            }
        };
        Ok(WireListing { fh: fh.0, entries: entries.iter().map(Into::into).collect(), complete: at_end })
    }

    /// Mark the entries of a reply that have no extended attributes: asking here is a local
    /// call, asking from the client a crossing per attribute.
    fn hint_xattrs(&self, cx: &Caller, reply: &mut WireReply) {
        for e in reply.entries_mut() {
            let op = Op::ListXattr { node: NodeId(e.node), size: 0 };
            if let Ok(Reply::Xattr(plyfs_stack::XattrReply::Size(n))) = self.top.call(cx, &op) {
                e.xattrs = Some(n > 0);
            }
        }
    }

    fn send(&self, conn: &Conn, id: u64, reply: WireReply, payload: Vec<u8>) -> Result<(), crate::Error> {
        let header = wire::encode(&Message::Rep { id, reply });
        let mut w = conn.writer.lock();
        wire::write_frame(&mut *w, &header, &payload).map_err(|e| conn.broke(format!("sending a reply: {e}")))
    }

    /// Tell every other client that holds one of the objects concerned.
    fn broadcast(&self, from: u64, changes: &[Change]) {
        let conns: Vec<Arc<Conn>> = self.conns.lock().iter().filter_map(Weak::upgrade).filter(|c| c.id != from).collect();
        for conn in conns {
            let relevant: Vec<Change> = {
                let nodes = conn.nodes.lock();
                changes
                    .iter()
                    .filter(|c| match c {
                        Change::Node { node } => nodes.contains_key(node),
                        Change::Entry { parent, .. } => *parent == NodeId::ROOT.0 || nodes.contains_key(parent),
                    })
                    .cloned()
                    .collect()
            };
            if relevant.is_empty() || conn.closed.load(Ordering::Relaxed) {
                continue;
            }
            let header = wire::encode(&Message::Changed { changes: relevant });
            let mut w = conn.writer.lock();
            if wire::write_frame(&mut *w, &header, &[]).is_err() {
                drop(w);
                self.close(&conn, None);
            }
        }
    }

    /// Who a request runs as: the ids it sent, or those its connection's identity maps them to.
    fn caller(&self, identity: Identity, sent: WireCaller) -> Caller {
        match identity {
            Identity::AsSent => sent.into(),
            Identity::RootSquash if sent.uid == 0 => Caller::confined(NOBODY, NOBODY, sent.pid, &[NOBODY]),
            // Root's group is squashed too, as nfsd's root_squash maps gid 0 to anongid: a
            // client may not claim it. (A user whose groups on the server include 0 keeps it.)
            Identity::RootSquash => {
                let gid = if sent.gid == 0 { NOBODY } else { sent.gid };
                Caller { confined: Some(self.groups_of(sent.uid, gid)), ..Caller::new(sent.uid, gid, sent.pid) }
            }
            Identity::Fixed { uid, gid, groups } => Caller { confined: Some(groups), ..Caller::new(uid, gid, sent.pid) },
        }
    }

    /// The supplementary groups the server's group database gives `uid` (with `gid`), as NFS
    /// servers find them with `--manage-gids`; only `gid` for a user the database does not know.
    fn groups_of(&self, uid: u32, gid: u32) -> Groups {
        let now = Instant::now();
        if let Some((groups, at)) = self.groups.lock().get(&(uid, gid)) {
            if now.duration_since(*at) < GROUPS_FOR {
                return *groups;
            }
        }
        let groups = Groups::new(&user_groups(uid, gid));
        let mut cache = self.groups.lock();
        // Ids come from clients: the cache must not grow with them.
        if cache.len() >= 4096 {
            cache.clear();
        }
        cache.insert((uid, gid), (groups, now));
        groups
    }

    /// Check that the connection may name what `op` names, run it, and record what it now holds.
    fn dispatch(&self, conn: &Conn, cx: &Caller, op: &Op<'_>) -> Result<Reply, Error> {
        if let Op::Forget { node, nlookup } = *op {
            let held = {
                let mut nodes = conn.nodes.lock();
                match nodes.get_mut(&node.0) {
                    Some(held) => {
                        let n = nlookup.min(*held);
                        *held -= n;
                        if *held == 0 {
                            nodes.remove(&node.0);
                        }
                        n
                    }
                    None => 0,
                }
            };
            if held > 0 {
                self.top.forget(cx, node, held);
            }
            return Ok(Reply::Empty);
        }
        if let Op::Lookup { parent: NodeId::ROOT, name } = *op {
            if name == ".." {
                return Err(Error::Os(libc::EPERM));
            }
        }
        self.check_nodes(conn, op)?;
        self.check_handle(conn, op)?;
        if let Op::Extended { node, name: LOCK_OP, args } = *op {
            return self.lower_lock(conn, cx, node, args);
        }
        let server = Caller { pid: cx.pid, ..Caller::daemon() };
        let mut cx = cx;
        if conn.identity != Identity::AsSent {
            if let Op::Access { node, mask } = *op {
                return self.permit(cx, node, mask as u32).map(|()| Reply::Empty);
            }
            match self.check_access(cx, op) {
                // The server opens it: the kernel would refuse the client's ids at the bottom.
                Err(Error::Os(libc::EACCES)) if self.opens_readable_by_all(op) => cx = &server,
                checked => checked?,
            }
            self.check_privileged(cx, op)?;
        }
        let mut reply = self.top.call(cx, op)?;
        // `create` of an existing name opens what is there: for a mapped client, not a device.
        if let (Reply::Created(e, o), true) = (&reply, conn.identity != Identity::AsSent && cx.uid != 0 && !self.options.allow_devices) {
            if is_device(e.attr.kind.mode_bits()) {
                let _ = self.top.call(cx, &Op::Release { node: e.node, fh: o.fh });
                self.top.forget(cx, e.node, 1);
                return Err(Error::Os(libc::EACCES));
            }
        }
        if let (Reply::Xattr(XattrReply::Data(names)), Op::ListXattr { .. }) = (&mut reply, op) {
            if conn.identity != Identity::AsSent && cx.uid != 0 {
                hide_trusted_names(names);
            }
        }
        match (&reply, op) {
            (Reply::Entry(e), _) => self.hold(conn, e.node, 1),
            (Reply::Created(e, o), _) => {
                self.hold(conn, e.node, 1);
                conn.files.lock().insert(o.fh.0, (e.node.0, false));
            }
            (Reply::Opened(o), Op::Open { node, .. }) => {
                conn.files.lock().insert(o.fh.0, (node.0, false));
            }
            (Reply::Opened(o), Op::OpenDir { node }) => {
                conn.files.lock().insert(o.fh.0, (node.0, true));
            }
            (Reply::Dir(entries), Op::ReadDir { plus: true, .. }) => {
                for e in entries.iter().filter_map(|d| d.entry.as_ref()) {
                    self.hold(conn, e.node, 1);
                }
            }
            (_, Op::Release { fh, .. } | Op::ReleaseDir { fh, .. }) => {
                conn.files.lock().remove(&fh.0);
            }
            _ => {}
        }
        Ok(reply)
    }

    /// Whether `op` opens, read-only, the file of [`ServerOptions::readable_by_all`].
    fn opens_readable_by_all(&self, op: &Op<'_>) -> bool {
        let (Some(name), Op::Open { node, flags }) = (self.options.readable_by_all, op) else { return false };
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & (libc::O_TRUNC | libc::O_CREAT) != 0 {
            return false;
        }
        let server = Caller::daemon();
        let Ok(root) = self.top.getattr(&server, NodeId::ROOT) else { return false };
        // Where other users may make entries (group- or world-writable, sticky or not: the sticky
        // bit keeps others' entries in place, but anyone may still move in a file of root's from
        // a directory of their own), a client could give another file of root's that name: only
        // the root's owner (or root) must be able to put a file there.
        if root.perm & 0o022 != 0 {
            return false;
        }
        match self.top.call(&server, &Op::Lookup { parent: NodeId::ROOT, name: std::ffi::OsStr::new(name) }) {
            Ok(Reply::Entry(e)) => {
                self.top.forget(&server, e.node, 1);
                e.node == *node && e.attr.kind == plyfs_stack::FileKind::File && e.attr.nlink == 1 && (e.attr.uid == 0 || e.attr.uid == root.uid)
            }
            _ => false,
        }
    }

    /// Permission checks for a client whose requests run as other ids than it sent (root
    /// squashed, a Unix peer held to its own ids). The client's kernel checked against the ids
    /// it knows, and the bottom layer trusts such checks, so the server makes them again with
    /// the ids it acts as, as an NFS server does. Over a lower directory the kernel checks again,
    /// as the client (see `Caller::confined`); these checks hold for every bottom layer. (ACLs
    /// and the sticky bit are left to the bottom layer.)
    fn check_access(&self, cx: &Caller, op: &Op<'_>) -> Result<(), Error> {
        const R: u32 = 4;
        const W: u32 = 2;
        const X: u32 = 1;
        match *op {
            Op::Lookup { parent, .. } => self.permit(cx, parent, X),
            Op::OpenDir { node } => self.permit(cx, node, R),
            Op::Open { node, flags } => {
                let want = match flags & libc::O_ACCMODE {
                    libc::O_RDONLY => R,
                    libc::O_WRONLY => W,
                    _ => R | W,
                } | if flags & libc::O_TRUNC != 0 { W } else { 0 };
                if cx.uid == 0 {
                    return Ok(());
                }
                // One look at the node serves both checks: a device is opened only where the
                // server allows devices (as `check_privileged` does for mknod), then the mode.
                let attr = self.top.getattr(cx, node)?;
                let device = matches!(attr.kind, plyfs_stack::FileKind::CharDevice | plyfs_stack::FileKind::BlockDevice);
                if device && !self.options.allow_devices {
                    return Err(Error::Os(libc::EACCES));
                }
                permitted(cx, &attr, want)
            }
            Op::Create { parent, .. }
            | Op::MkDir { parent, .. }
            | Op::MkNod { parent, .. }
            | Op::SymLink { parent, .. }
            | Op::Unlink { parent, .. }
            | Op::RmDir { parent, .. } => self.permit(cx, parent, W | X),
            Op::Link { node, new_parent, .. } => {
                self.permit(cx, new_parent, W | X)?;
                // protected_hardlinks: only to a file the caller owns, or a plain file it may
                // read and write that gives no privileges.
                let attr = self.top.getattr(cx, node)?;
                if cx.uid == 0 || attr.uid == cx.uid {
                    return Ok(());
                }
                let perm = u32::from(attr.perm);
                let setid = perm & 0o4000 != 0 || perm & 0o2010 == 0o2010;
                if attr.kind != plyfs_stack::FileKind::File || setid || permitted(cx, &attr, R | W).is_err() {
                    return Err(Error::Os(libc::EPERM));
                }
                Ok(())
            }
            Op::Rename { parent, new_parent, .. } => {
                self.permit(cx, parent, W | X)?;
                self.permit(cx, new_parent, W | X)
            }
            Op::SetAttr { node, set, .. } => {
                let attr = self.top.getattr(cx, node)?;
                let owner = cx.uid == 0 || attr.uid == cx.uid;
                if set.uid.is_some_and(|u| u != attr.uid) && cx.uid != 0 {
                    return Err(Error::Os(libc::EPERM));
                }
                // chgrp: only to a group the caller is in.
                if set.gid.is_some_and(|g| g != attr.gid && !cx.in_group(g)) && cx.uid != 0 {
                    return Err(Error::Os(libc::EPERM));
                }
                if (set.mode.is_some() || set.gid.is_some() || matches!(set.atime, Some(plyfs_stack::TimeSet::At(_)))) && !owner {
                    return Err(Error::Os(libc::EPERM));
                }
                if set.size.is_some() || (set.atime.is_some() || set.mtime.is_some()) && !owner {
                    return self.permit(cx, node, W);
                }
                Ok(())
            }
            Op::SetXattr { node, .. } | Op::RemoveXattr { node, .. } => self.permit(cx, node, W),
            Op::Extended { .. } => {
                Err(Error::BadArgs("extended operations need a client the server trusts (a root peer, or --no-root-squash)".into()))
            }
            _ => Ok(()),
        }
    }

    /// What the daemon could do for a mapped client that the client could not do on the
    /// server itself: the kernel would allow it to the daemon's capabilities that running as
    /// the client does not drop (CAP_SYS_ADMIN, CAP_SETFCAP), or on any bottom layer that is
    /// not the kernel's. Refused unless the server was started to allow it.
    fn check_privileged(&self, cx: &Caller, op: &Op<'_>) -> Result<(), Error> {
        if cx.uid == 0 {
            return Ok(());
        }
        match *op {
            Op::MkNod { mode, .. } if !self.options.allow_devices && is_device(mode) => Err(Error::Os(libc::EPERM)),
            Op::SetXattr { name, .. } | Op::RemoveXattr { name, .. }
                if !self.options.allow_privileged_xattrs && is_privileged_xattr(name) =>
            {
                Err(Error::Os(libc::EPERM))
            }
            // As the kernel answers a process without CAP_SYS_ADMIN.
            Op::GetXattr { name, .. } if name.as_bytes().starts_with(b"trusted.") => Err(Error::Os(libc::ENODATA)),
            _ => Ok(()),
        }
    }

    fn permit(&self, cx: &Caller, node: NodeId, want: u32) -> Result<(), Error> {
        if cx.uid == 0 {
            return Ok(());
        }
        permitted(cx, &self.top.getattr(cx, node)?, want)
    }

    fn hold(&self, conn: &Conn, node: NodeId, n: u64) {
        *conn.nodes.lock().entry(node.0).or_insert(0) += n;
    }

    fn check_nodes(&self, conn: &Conn, op: &Op<'_>) -> Result<(), Error> {
        let mut named = vec![op.node()];
        match *op {
            Op::Rename { new_parent, .. } | Op::Link { new_parent, .. } => named.push(new_parent),
            _ => {}
        }
        let nodes = conn.nodes.lock();
        for n in named {
            if n != NodeId::ROOT && !nodes.contains_key(&n.0) {
                return Err(Error::Os(libc::ESTALE));
            }
        }
        Ok(())
    }

    fn check_handle(&self, conn: &Conn, op: &Op<'_>) -> Result<(), Error> {
        use Op::*;
        let (node, fh, dir) = match *op {
            GetAttr { node, fh: Some(fh) } | SetAttr { node, fh: Some(fh), .. } | Ioctl { node, fh, .. } => (node, fh, None),
            Read { node, fh, .. }
            | Write { node, fh, .. }
            | Flush { node, fh }
            | Fsync { node, fh, .. }
            | Release { node, fh }
            | Fallocate { node, fh, .. }
            | Lseek { node, fh, .. } => (node, fh, Some(false)),
            ReadDir { node, fh, .. } | ReleaseDir { node, fh } | FsyncDir { node, fh, .. } => (node, fh, Some(true)),
            _ => return Ok(()),
        };
        match conn.files.lock().get(&fh.0) {
            Some(&(n, is_dir)) if n == node.0 && dir.is_none_or(|d| d == is_dir) => Ok(()),
            _ => Err(Error::Os(libc::EBADF)),
        }
    }

    /// Release what a connection that ended still held: its open files, then its lookups.
    /// `lower-lock` for a client: any client that may read the file may read-lock it, and one
    /// that may write it write-lock it. The locks belong to the connection.
    fn lower_lock(&self, conn: &Conn, cx: &Caller, node: NodeId, args: &[String]) -> Result<Reply, Error> {
        const R: u32 = 4;
        const W: u32 = 2;
        let plyfs_stack::shared::LockRequest { kind, take, .. } = plyfs_stack::shared::parse_lock_args(args)?;
        if take && conn.identity != Identity::AsSent {
            self.permit(cx, node, if kind == LockKind::Exclusive { W } else { R })?;
        }
        let op = Op::Extended { node, name: LOCK_OP, args };
        let reply = plyfs_stack::shared::with_lock_owner(conn.lock_owner, || self.top.call(&Caller::daemon(), &op))?;
        let mut locks = conn.locks.lock();
        let held = locks.entry((node.0, kind)).or_default();
        if take {
            *held += 1;
        } else {
            *held = held.saturating_sub(1);
            if *held == 0 {
                locks.remove(&(node.0, kind));
            }
        }
        Ok(reply)
    }

    fn release_all(&self, conn: &Conn) {
        let cx = Caller::daemon();
        let locks: Vec<((u64, LockKind), u32)> = conn.locks.lock().drain().collect();
        for ((node, kind), n) in locks {
            for _ in 0..n {
                let _ = plyfs_stack::shared::with_lock_owner(conn.lock_owner, || plyfs_stack::shared::unlock(&self.top, NodeId(node), kind));
            }
        }
        let files: Vec<(u64, (u64, bool))> = conn.files.lock().drain().collect();
        for (fh, (node, dir)) in files {
            let (node, fh) = (NodeId(node), plyfs_stack::FileHandle(fh));
            let op = if dir { Op::ReleaseDir { node, fh } } else { Op::Release { node, fh } };
            let _ = self.top.call(&cx, &op);
        }
        let nodes: Vec<(u64, u64)> = conn.nodes.lock().drain().collect();
        for (node, n) in nodes {
            self.top.forget(&cx, NodeId(node), n);
        }
    }
}

fn is_device(mode: u32) -> bool {
    matches!(mode & libc::S_IFMT, libc::S_IFCHR | libc::S_IFBLK)
}

/// `security.*` (file capabilities, LSM labels) and `trusted.*`: namespaces whose attributes
/// give or take privileges on the server.
fn is_privileged_xattr(name: &std::ffi::OsStr) -> bool {
    let name = name.as_bytes();
    name.starts_with(b"security.") || name.starts_with(b"trusted.")
}

/// Leave `trusted.*` out of a listing, as the kernel does for a process without CAP_SYS_ADMIN.
fn hide_trusted_names(names: &mut Vec<u8>) {
    let kept: Vec<u8> = names.split_inclusive(|&b| b == 0).filter(|n| !n.starts_with(b"trusted.")).flatten().copied().collect();
    *names = kept;
}

/// The groups the server's user database gives `uid`: its primary group `gid` and those it is
/// a member of (getgrouplist). Only `gid` for a user the database does not know.
fn user_groups(uid: u32, gid: u32) -> Vec<u32> {
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    let r = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut found) };
    if r != 0 || found.is_null() {
        return vec![gid];
    }
    let mut groups = vec![0 as libc::gid_t; 64];
    loop {
        let mut n = groups.len() as libc::c_int;
        let r = unsafe { libc::getgrouplist(pw.pw_name, gid, groups.as_mut_ptr(), &mut n) };
        if r >= 0 {
            groups.truncate(n.max(0) as usize);
            return groups;
        }
        if n as usize <= groups.len() || groups.len() >= 1 << 16 {
            return vec![gid];
        }
        groups.resize(n as usize, 0);
    }
}

/// Whether the mode bits of `a` give a non-root `cx` the access `want` (4, 2, 1: read, write,
/// search), by owner, then group (its supplementary ones included), then others.
fn permitted(cx: &Caller, a: &plyfs_stack::Attr, want: u32) -> Result<(), Error> {
    let perm = u32::from(a.perm);
    let bits = if a.uid == cx.uid {
        perm >> 6
    } else if cx.in_group(a.gid) {
        perm >> 3
    } else {
        perm
    } & 7;
    if bits & want == want {
        Ok(())
    } else {
        Err(Error::Os(libc::EACCES))
    }
}

/// Whether `fd` has bytes to read now.
/// The smallest readdir window whose empty answer `listdir` takes for the directory's end: the
/// kernel's smallest (`max_entries` of a FUSE readdir of one page).
const END_WINDOW: u32 = 128;

fn readable_now(fd: std::os::fd::RawFd) -> bool {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    unsafe { libc::poll(&mut pfd, 1, 0) > 0 }
}

/// The node a request that goes to a worker concerns (0 for none).
fn op_node(op: &RequestOp) -> u64 {
    match op {
        RequestOp::Stack(op) => op.node(),
        RequestOp::Compound(CompoundOp::ListDir { node, .. }) => *node,
        RequestOp::Codec(_) => 0,
    }
}

/// What clients' caches must forget after `op` succeeded.
fn changes_of(op: &RequestOp) -> Vec<Change> {
    let entry = |parent: u64, name: &[u8]| Change::Entry { parent, name: serde_bytes::ByteBuf::from(name.to_vec()) };
    let RequestOp::Stack(op) = op else { return Vec::new() };
    match op {
        OpHeader::SetAttr { node, .. }
        | OpHeader::Write { node, .. }
        | OpHeader::Fallocate { node, .. }
        | OpHeader::SetXattr { node, .. }
        | OpHeader::RemoveXattr { node, .. } => vec![Change::Node { node: *node }],
        OpHeader::MkNod { parent, name, .. }
        | OpHeader::MkDir { parent, name, .. }
        | OpHeader::SymLink { parent, name, .. }
        | OpHeader::Create { parent, name, .. }
        | OpHeader::Unlink { parent, name }
        | OpHeader::RmDir { parent, name } => vec![entry(*parent, name), Change::Node { node: *parent }],
        OpHeader::Link { node, new_parent, new_name } => {
            vec![entry(*new_parent, new_name), Change::Node { node: *new_parent }, Change::Node { node: *node }]
        }
        OpHeader::Rename { parent, name, new_parent, new_name, .. } => {
            let mut v = vec![entry(*parent, name), entry(*new_parent, new_name), Change::Node { node: *parent }];
            if new_parent != parent {
                v.push(Change::Node { node: *new_parent });
            }
            v
        }
        _ => Vec::new(),
    }
}

fn is_known(op: &str) -> bool {
    plyfs_stack::OpKind::ALL.iter().any(|k| k.name() == op) || CompoundOp::NAMES.contains(&op)
}

fn message_type(m: &Message) -> &'static str {
    match m {
        Message::Hello { .. } => "hello",
        Message::Welcome { .. } => "welcome",
        Message::Refused { .. } => "refused",
        Message::Req { .. } => "req",
        Message::Rep { .. } => "rep",
        Message::Changed { .. } => "changed",
    }
}

fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n as usize == buf.len() {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
