//! The trusted service: the only process that opens the volume. It runs the start-up scan, then
//! serves clients on a Unix socket: metadata operations through the protection core, data
//! through the disk queue straight into each client's shared memory.
//!
//! Anyone may connect (mode 0666): protection is by capability, not by user. The one thing that
//! depends on who the client is, read from the socket (`SO_PEERCRED`), is the named roots: each
//! user gets the root exonodes named for it, and only root may ask for another user's.
//!
//! Since every local user may connect, what keeps one from starving the others is the limits
//! (#28, [`ServiceOptions`]): connections in all and per user, a `Hello` of a few KiB read by a
//! deadline, the lists of a request bounded once decoded, and the replies and completions a
//! client has not read yet bounded per connection (the service stops reading a client that does
//! not read its answers).

use std::io::{BufReader, BufWriter, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use plyfs_stack::admission::{Admission, ByteBudget, ConnectionLimits, Deadline, DeadlineRead, Permit};
use serde_bytes::ByteBuf;

use crate::content::DataSeal;
use crate::core::{Access, Core, ExoError, Persistence, Target};
use crate::disk::Aligned;
use crate::engine::{Buffer, Engine, Job};
use crate::error::{io, Error};
use crate::layout;
use crate::object::{Caps, Entry};
use crate::proto::{self, cap, Message, Reply, Request};
use crate::shm::Shm;

/// What the start-up found and did, for the log.
pub struct Started {
    pub report: crate::scan::Report,
}

/// What the service takes from its clients before it refuses or waits.
#[derive(Clone, Debug)]
pub struct ServiceOptions {
    /// How long a client has, from connecting, to hand over its shared memory and say hello.
    pub handshake_timeout: Duration,
    /// Connections in all, and per user.
    pub limits: ConnectionLimits,
    /// Bytes of replies and completions one client may leave unread before the service stops
    /// reading its requests.
    pub unread_bytes: usize,
    /// Data requests one client may have queued or in flight; more complete at once with
    /// `EAGAIN`.
    pub queued_io: usize,
    /// A new file in which to record every write and flush made to the volume (see
    /// [`crate::record`]).
    pub record: Option<PathBuf>,
}

impl Default for ServiceOptions {
    fn default() -> Self {
        ServiceOptions {
            handshake_timeout: Duration::from_secs(10),
            limits: ConnectionLimits::default(),
            unread_bytes: 32 << 20,
            queued_io: 1 << 16,
            record: None,
        }
    }
}

/// A client of the service, for the limits on connections: its user.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct User(u32);

impl std::fmt::Display for User {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "user {}", self.0)
    }
}

pub struct Service {
    core: Mutex<Core>,
    engine: Engine,
    next_client: AtomicU64,
    stopping: AtomicBool,
    socket: PathBuf,
    /// The volume served, named in logs.
    volume: PathBuf,
    /// The service's own user, which may stop it like root.
    uid: u32,
    /// Each client's socket and thread, to close and wait for at shutdown.
    clients: Mutex<Vec<(UnixStream, std::thread::JoinHandle<()>)>>,
    /// The listening socket's descriptor, shut down to stop the accept loop.
    listener: std::sync::atomic::AtomicI32,
    /// Named roots held exclusively, by the client holding them.
    leases: Mutex<std::collections::HashMap<(u32, String), u64>>,
    options: ServiceOptions,
    admission: Admission<User>,
}

/// Where a client's replies and completions go: its writer thread, each message counted
/// against the client's budget of unread bytes until it is written.
struct Outbox {
    tx: Sender<(Vec<u8>, Permit)>,
    unread: ByteBudget,
    /// The client's data requests queued or in flight.
    queued_io: Arc<AtomicUsize>,
}

impl Outbox {
    /// Send a reply, waiting while the client has too much unread (it then waits for us).
    fn reply(&self, m: &Message) -> bool {
        let Ok(frame) = proto::frame_message(m) else { return false };
        let held = self.unread.take(frame.len());
        self.tx.send((frame, held)).is_ok()
    }

    /// Send a completion without waiting: it may come from the disk queue, which serves every
    /// client. Completions are bounded by [`ServiceOptions::queued_io`].
    fn done(tx: &Sender<(Vec<u8>, Permit)>, unread: &ByteBudget, id: u64, result: i32) {
        if let Ok(frame) = proto::frame_message(&Message::Done { id, result }) {
            let held = unread.force(frame.len());
            let _ = tx.send((frame, held));
        }
    }
}

/// Open and check the volume, reconcile its free map, and get ready to serve. A volume whose
/// invariants do not hold is not served: `plyfs exodisk fsck` says why.
pub fn start(volume: &Path, key: &Path, socket: &Path) -> Result<(Arc<Service>, Started), Error> {
    start_with(volume, key, socket, ServiceOptions::default())
}

/// [`start`] with limits other than the default ones.
pub fn start_with(volume: &Path, key: &Path, socket: &Path, options: ServiceOptions) -> Result<(Arc<Service>, Started), Error> {
    let (mut disk, key, sb) = layout::open(volume, key)?;
    if let Some(path) = &options.record {
        disk.record_to(Arc::new(crate::record::WriteLog::create(path, disk.sectors)?));
    }
    let (_, report, map) = crate::scan::scan(&disk, &key, &sb).map_err(io("scanning the volume", volume))?;
    if !report.clean() {
        return Err(Error::Inconsistent { path: volume.to_owned(), problem: report.problems[0].clone(), count: report.problems.len() });
    }
    crate::scan::erase_orphans(&disk, &report, &map)
        .and_then(|()| map.store(&disk, &key, &sb))
        .and_then(|()| disk.sync()).map_err(io("giving back the sectors of orphaned exonodes", volume))?;
    let engine = Engine::start(volume, disk.fd(), disk.write_log()).map_err(io("starting io_uring", volume))?;
    let mut core = Core::new(disk, key, sb, map);
    core.drop_dangling(&report.dangling)
        .map_err(|source| Error::Exo { op: "dropping entries of removed exonodes", path: volume.to_owned(), source })?;
    let service = Arc::new(Service {
        core: Mutex::new(core),
        engine,
        next_client: AtomicU64::new(1),
        stopping: AtomicBool::new(false),
        socket: socket.to_owned(),
        volume: volume.to_owned(),
        uid: unsafe { libc::geteuid() },
        clients: Mutex::new(Vec::new()),
        listener: std::sync::atomic::AtomicI32::new(-1),
        leases: Mutex::new(std::collections::HashMap::new()),
        admission: Admission::new(options.limits),
        options,
    });
    Ok((service, Started { report }))
}

/// A service serving on a thread of this process (tools and tests that embed it), stopped and
/// joined when dropped.
pub struct Background {
    pub service: Arc<Service>,
    pub socket: PathBuf,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// [`start`], then serve on a thread; returns once the socket is there (at most 10 s).
pub fn spawn(volume: &Path, key: &Path, socket: &Path) -> Result<Background, Error> {
    let (service, _) = start(volume, key, socket)?;
    let s = service.clone();
    let thread = std::thread::Builder::new()
        .name("exodisk-serve".into())
        .spawn(move || {
            if let Err(e) = s.serve() {
                tracing::error!("exodisk: {e}");
            }
        })
        .map_err(io("starting the service's thread", socket))?;
    let running = Background { service, socket: socket.to_owned(), thread: Some(thread) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    // Listening, not merely bound: a client that connects between the two is refused.
    while running.service.listener.load(Ordering::Acquire) < 0 {
        if std::time::Instant::now() > deadline || running.thread.as_ref().is_some_and(|t| t.is_finished()) {
            return Err(Error::NotListening { socket: socket.to_owned() });
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    Ok(running)
}

impl Drop for Background {
    fn drop(&mut self) {
        self.service.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Service {
    /// Listen on the socket and serve until `SHUTDOWN` (or `stop`).
    pub fn serve(self: &Arc<Self>) -> Result<(), Error> {
        if self.socket.exists() {
            if UnixStream::connect(&self.socket).is_ok() {
                return Err(Error::SocketInUse { socket: self.socket.clone() });
            }
            std::fs::remove_file(&self.socket).map_err(io("removing a stale socket", &self.socket))?;
        }
        let listener = UnixListener::bind(&self.socket).map_err(io("binding the socket", &self.socket))?;
        self.listener.store(std::os::fd::AsRawFd::as_raw_fd(&listener), Ordering::Release);
        if self.stopping.load(Ordering::Acquire) {
            return Ok(());
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.socket, std::fs::Permissions::from_mode(0o666))
            .map_err(io("opening the socket to every user", &self.socket))?;
        for stream in listener.incoming() {
            if self.stopping.load(Ordering::Acquire) {
                break;
            }
            let Ok(stream) = stream else {
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            };
            // The handshake's deadline starts now, and the limits apply before anything is read.
            let deadline = Deadline::after(self.options.handshake_timeout);
            let Ok(uid) = peer_uid(&stream) else { continue };
            let admitted = match self.admission.admit(&User(uid)) {
                Ok(a) => a,
                Err(reason) => {
                    refuse(&stream, &reason);
                    continue;
                }
            };
            let Ok(handle) = stream.try_clone() else { continue };
            let me = self.clone();
            let thread = std::thread::Builder::new().name("exodisk-client".into()).spawn(move || {
                let _admitted = admitted;
                // However the connection's thread ends (an error, a message it cannot read, a
                // panic), the connection ends with it, so the client is not left waiting.
                struct Hangup(UnixStream);
                impl Drop for Hangup {
                    fn drop(&mut self) {
                        let _ = self.0.shutdown(std::net::Shutdown::Both);
                    }
                }
                let _hangup = stream.try_clone().map(Hangup);
                // Only a handshake ends in an error (a session ends when its client goes): logged
                // as a refusal, once per user and minute.
                match me.clone().client(stream, uid, deadline) {
                    Ok(()) => {}
                    // A connection that closed before its handshake (someone checking that the
                    // service listens, a client that gave up) refused nothing.
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => tracing::debug!("exodisk: user {uid}: {e}"),
                    Err(e) => me.admission.log_refusal(&User(uid), &format!("exodisk: {e}")),
                }
            });
            if let Ok(t) = thread {
                let mut clients = self.clients.lock();
                clients.retain(|(_, t)| !t.is_finished());
                clients.push((handle, t));
            }
        }
        self.listener.store(-1, Ordering::Release);
        drop(listener);
        self.finish();
        Ok(())
    }

    /// Stop serving: finish the queue, write what is dirty.
    pub fn stop(&self) {
        if !self.stopping.swap(true, Ordering::AcqRel) {
            // Wake the accept loop (whether or not its socket is still in the file system).
            let fd = self.listener.load(Ordering::Acquire);
            if fd >= 0 {
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            }
        }
    }

    fn finish(&self) {
        // Close every client's connection and wait for its thread: then nothing but the caller
        // holds the service, and the volume is closed when it lets go.
        let clients = std::mem::take(&mut *self.clients.lock());
        for (stream, thread) in clients {
            let _ = stream.shutdown(std::net::Shutdown::Both);
            let _ = thread.join();
        }
        self.engine.stop();
        if let Err(e) = self.core.lock().flush() {
            tracing::error!("exodisk: {}: writing back at shutdown: {e}", self.volume.display());
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    fn client(self: Arc<Self>, stream: UnixStream, uid: u32, deadline: Deadline) -> std::io::Result<()> {
        // Until its hello is read, a client gets a deadline and a few KiB.
        stream.set_read_timeout(Some(deadline.left()?))?;
        let fd = crate::shm::recv_fd(&stream).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock => std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake took too long"),
            _ => e,
        })?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let hello = {
            let set_timeout = |left| stream.set_read_timeout(Some(left));
            proto::read_message_within(&mut DeadlineRead { inner: &mut reader, set_timeout: &set_timeout, deadline }, proto::MAX_HELLO)?
        };
        stream.set_read_timeout(None)?;
        let (id, shm_len) = match hello {
            Message::Req { id, req: Request::Hello { version, shm } } if version == proto::VERSION => (id, shm),
            _ => return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "expected hello")),
        };
        let shm = Arc::new(Shm::map(fd, shm_len as usize)?);
        let client = self.next_client.fetch_add(1, Ordering::Relaxed);
        // Replies and completions go out through one writer thread, so that a client slow to
        // read never holds up the disk queue; what it has not read yet is bounded.
        let (tx, rx) = std::sync::mpsc::channel::<(Vec<u8>, Permit)>();
        let outbox =
            Outbox { tx, unread: ByteBudget::new(self.options.unread_bytes), queued_io: Arc::new(AtomicUsize::new(0)) };
        let mut out = BufWriter::new(stream.try_clone()?);
        let writer = std::thread::Builder::new().name("exodisk-out".into()).spawn(move || {
            while let Ok((frame, _held)) = rx.recv() {
                if out.write_all(&frame).is_err() {
                    return;
                }
                // Send what has piled up together.
                while let Ok((frame, _held)) = rx.try_recv() {
                    if out.write_all(&frame).is_err() {
                        return;
                    }
                }
                if out.flush().is_err() {
                    return;
                }
            }
        })?;
        let (sectors, data_start) = {
            let core = self.core.lock();
            (core.sb.sectors, core.sb.data_start)
        };
        outbox.reply(&Message::Rep { id, result: Ok(Reply::Welcome { version: proto::VERSION, sectors, data_start, client }) });
        loop {
            let (id, req) = match proto::read_message(&mut reader) {
                Ok(Message::Req { id, req }) => (id, req),
                Ok(_) => break,
                Err(_) => break,
            };
            if let Request::Shutdown = req {
                if uid == 0 || uid == self.uid {
                    tracing::info!("user {uid} asked the service to stop: stopping");
                    // Answer first (the writer sends it), then stop.
                    outbox.reply(&Message::Rep { id, result: Ok(Reply::Ok) });
                    drop(outbox);
                    let _ = writer.join();
                    self.stop();
                    return Ok(());
                }
                outbox.reply(&Message::Rep { id, result: Err((libc::EPERM, "only root or the service's user may stop it".into())) });
                continue;
            }
            let result = self.handle(req, uid, client, &shm, &outbox).map_err(|e| (e.errno, e.msg));
            if !outbox.reply(&Message::Rep { id, result }) {
                break;
            }
        }
        drop(outbox);
        let _ = writer.join();
        self.leases.lock().retain(|_, c| *c != client);
        Ok(())
    }

    /// Take root `key` for `client` alone, waiting a while for another holder to go.
    fn lease(&self, key: (u32, String), client: u64) -> crate::core::Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            {
                let mut leases = self.leases.lock();
                match leases.get(&key) {
                    Some(c) if *c != client => {}
                    _ => {
                        leases.insert(key, client);
                        return Ok(());
                    }
                }
            }
            if std::time::Instant::now() > deadline {
                return err(libc::EBUSY, "this root is in use by another client (a mount of it?)");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    fn handle(&self, req: Request, uid: u32, client: u64, shm: &Arc<Shm>, outbox: &Outbox) -> crate::core::Result<Reply> {
        if let Request::Root { name, uid: other, exclusive: true } = &req {
            let who = other.unwrap_or(uid);
            if who == uid || uid == 0 {
                self.lease((who, name.clone()), client)?;
            }
        }
        let mut core = self.core.lock();
        self.handle_locked(&mut core, req, uid, client, shm, outbox)
    }

    /// A request, with the core held (a batch holds it throughout, so that no other client's
    /// request runs inside it and is answered before the batch's flush).
    fn handle_locked(
        &self,
        core: &mut Core,
        req: Request,
        uid: u32,
        client: u64,
        shm: &Arc<Shm>,
        outbox: &Outbox,
    ) -> crate::core::Result<Reply> {
        let t = |w: &proto::WTarget| Target::from(w);
        // Sectors about to be given up: their queued data requests finish first.
        let giving_up = match &req {
            Request::ExtentDeallocate { at, wcap } => core.sectors_given_up(&Target::Extent(*at), cap(*wcap), None),
            Request::ExtentResize { at, wcap, by } if *by < 0 => core.sectors_given_up(&Target::Extent(*at), cap(*wcap), None),
            Request::ExonodeDeallocate { target, wcap } => core.sectors_given_up(&t(target), cap(*wcap), None),
            Request::RemoveEntry { target, wcap, idx } => core.sectors_given_up(&t(target), cap(*wcap), Some(*idx)),
            _ => Vec::new(),
        };
        self.engine.wait_clear(&giving_up);
        Ok(match req {
            Request::Hello { .. } | Request::Shutdown => return err(libc::EPROTO, "unexpected here"),
            Request::Batch { reqs } => {
                let records = reqs.iter().any(|r| matches!(r, Request::WriteRecord { .. }));
                core.begin_batch(records)?;
                let mut out = Vec::with_capacity(reqs.len());
                for (i, r) in reqs.into_iter().enumerate() {
                    let result =
                        if matches!(r, Request::Hello { .. } | Request::Root { .. } | Request::Shutdown | Request::Batch { .. }) {
                            Err((libc::EINVAL, format!("request {i} of the batch cannot be batched")))
                        } else {
                            self.handle_locked(core, r, uid, client, shm, outbox)
                                .map_err(|e| (e.errno, format!("request {i} of the batch: {}", e.msg)))
                        };
                    let failed = result.is_err();
                    out.push(result);
                    if failed {
                        break;
                    }
                }
                // One flush for all of it; a failure there fails the batch's last request.
                if let Err(e) = core.end_batch() {
                    out.push(Err((e.errno, format!("flushing the batch: {}", e.msg))));
                }
                return Ok(Reply::Batch(out));
            }
            Request::Root { name, uid: other, .. } => {
                let uid = match other {
                    Some(o) if o != uid && uid != 0 => return err(libc::EPERM, "only root may open another user's root"),
                    Some(o) => o,
                    None => uid,
                };
                let (at, caps) = named_root(core, uid, &name)?;
                Reply::Root { at, caps: caps.into() }
            }
            Request::FreeMap { from } => {
                let map = core.free_map();
                Reply::FreeMap { sectors: map.sectors(), bits: ByteBuf::from(map.bits_range(from, proto::FREE_MAP_PAGE)) }
            }
            Request::ExtentAllocate { at, sectors, caps, persistence } => {
                core.extent_allocate(at, sectors, caps.into(), persistence.into())?;
                Reply::Ok
            }
            Request::ExtentDeallocate { at, wcap } => {
                core.extent_deallocate(at, cap(wcap))?;
                Reply::Ok
            }
            Request::ExtentResize { at, wcap, by } => Reply::Sectors(core.extent_resize(at, cap(wcap), by)?),
            Request::ExonodeAllocate { at, sectors, caps, persistence } => {
                core.exonode_allocate(at, sectors, caps.into(), persistence.into())?;
                Reply::Ok
            }
            Request::ExonodeDeallocate { target, wcap } => {
                core.exonode_deallocate(&t(&target), cap(wcap))?;
                Reply::Ok
            }
            Request::AddExtent { target, wcap, idx, start, sectors } => {
                Reply::Entry(core.add_extent(&t(&target), cap(wcap), idx, start, sectors)?)
            }
            Request::AddExonode { target, wcap, idx, child, sectors, caps, persistence, data } => Reply::Entry(core.add_exonode_as(
                &t(&target),
                cap(wcap),
                idx,
                child,
                sectors,
                caps.into(),
                persistence.map(Into::into),
                data.into_iter().map(ByteBuf::into_vec).collect(),
            )?),
            Request::AddData { target, wcap, idx, data } => Reply::Entry(core.add_data(&t(&target), cap(wcap), idx, &data)?),
            Request::ReadData { target, rcap, idx } => Reply::Data(ByteBuf::from(core.read_data(&t(&target), cap(rcap), idx)?)),
            Request::RemoveEntry { target, wcap, idx } => {
                core.remove_entry(&t(&target), cap(wcap), idx)?;
                Reply::Ok
            }
            Request::Combine { target, wcap, a, b } => {
                core.combine(&t(&target), cap(wcap), a, b)?;
                Reply::Ok
            }
            Request::Split { target, wcap, idx, at_sector, new_idx } => {
                Reply::Entry(core.split(&t(&target), cap(wcap), idx, at_sector, new_idx)?)
            }
            Request::CapDiscover { target, cap: c, idx } => Reply::Caps(core.cap_discover(&t(&target), cap(c), idx)?.into()),
            Request::Load { at } => {
                core.load(at)?;
                Reply::Ok
            }
            Request::WriteRecord { target, wcap } => {
                core.write_record(&t(&target), cap(wcap))?;
                Reply::Ok
            }
            Request::Map { target, rcap } => Reply::Exonode((&core.map(&t(&target), cap(rcap))?).into()),
            Request::Proxy { target, cap: c, range, caps } => Reply::Id(core.make_proxy(&t(&target), cap(c), range, caps.into())?),
            Request::ProxyEntries { target, cap: c, entries, caps } => {
                Reply::Id(core.make_entries_proxy(&t(&target), cap(c), entries, caps.into())?)
            }
            Request::RemoveProxy { id, cap: c } => {
                core.remove_proxy(id, cap(c))?;
                Reply::Ok
            }
            Request::MarkReplacement { at } => Reply::Bool(core.mark_replacement(at)),
            Request::InCache { at } => Reply::Bool(core.in_cache(at)),
            Request::Poll => Reply::Poll {
                pending: self.engine.pending(),
                queue: self.engine.queue().into_iter().map(|(s, n, c)| (s, n, c == client)).collect(),
            },
            Request::Io { reqs } => {
                let mut queued = 0;
                for r in reqs {
                    let want = if r.write { Access::Write } else { Access::Read };
                    let len = r.count as usize * crate::disk::SECTOR;
                    if outbox.queued_io.load(Ordering::Acquire) >= self.options.queued_io {
                        Outbox::done(&outbox.tx, &outbox.unread, r.id, -libc::EAGAIN);
                        continue;
                    }
                    let checked = core.check_io(&t(&r.target), cap(r.cap), want, r.sector, r.count as u64).and_then(|model| {
                        let ptr =
                            shm.at(r.offset, len).ok_or(ExoError { errno: libc::EFAULT, msg: "outside the shared memory".into() })?;
                        if r.offset % crate::disk::SECTOR as u64 != 0 {
                            return err(libc::EINVAL, "a buffer not aligned to a sector");
                        }
                        Ok((model, ptr))
                    });
                    let staged = checked.and_then(|(model, ptr)| {
                        let dsync = r.write && model == Persistence::Data;
                        Ok((stage(&core.content(), shm, r.write, r.sector, ptr, len, dsync)?, dsync))
                    });
                    match staged {
                        Ok((staged, dsync)) => {
                            let (tx, unread, queued_io, id) =
                                (outbox.tx.clone(), outbox.unread.clone(), outbox.queued_io.clone(), r.id);
                            queued_io.fetch_add(1, Ordering::AcqRel);
                            self.engine.submit(Job {
                                write: r.write,
                                sector: r.sector,
                                buf: staged.buffer(),
                                dsync,
                                client,
                                done: Box::new(move |result| {
                                    let result = staged.finish(result);
                                    queued_io.fetch_sub(1, Ordering::AcqRel);
                                    Outbox::done(&tx, &unread, id, result);
                                }),
                            });
                            queued += 1;
                        }
                        Err(e) => Outbox::done(&outbox.tx, &outbox.unread, r.id, -e.errno),
                    }
                }
                Reply::Queued(queued)
            }
        })
    }
}

/// A data request's bytes between the client's shared memory and the disk: sealed here before
/// a write, opened after a read (`content`). The client's memory never holds ciphertext, and
/// the service never seals bytes the client can still change.
struct Staged {
    bounce: Arc<Mutex<Aligned>>,
    ptr: *mut u8,
    /// For a read: where the opened bytes go, in the client's shared memory (kept alive).
    client: Option<(usize, Arc<Shm>)>,
    sector: u64,
    content: Arc<DataSeal>,
}

// SAFETY: `ptr` points into `bounce`, which the job owns until it completes.
unsafe impl Send for Staged {}

/// Stage a data request on `len` bytes at `at` in `shm`: a write's bytes are copied and sealed
/// now (their seals written), a read's are opened by [`Staged::finish`].
fn stage(content: &Arc<DataSeal>, shm: &Arc<Shm>, write: bool, sector: u64, at: *mut u8, len: usize, dsync: bool) -> crate::core::Result<Staged> {
    let mut bounce = Aligned::zeroed(len);
    if write {
        // SAFETY: `at..at + len` lies in the client's mapping (checked by `Shm::at`).
        bounce.copy_from_slice(unsafe { std::slice::from_raw_parts(at, len) });
        content.seal(sector, &mut bounce, dsync).map_err(|e| ExoError { errno: libc::EIO, msg: format!("sealing: {e}") })?;
    }
    let ptr = bounce.as_mut_ptr();
    let client = (!write).then(|| (at as usize, shm.clone()));
    Ok(Staged { bounce: Arc::new(Mutex::new(bounce)), ptr, client, sector, content: content.clone() })
}

impl Staged {
    fn buffer(&self) -> Buffer {
        Buffer { ptr: self.ptr, len: self.bounce.lock().len(), _keep: self.bounce.clone() }
    }

    /// The job's result, after opening what a read brought.
    fn finish(self, result: i32) -> i32 {
        let Some((at, _keep)) = self.client else { return result };
        if result < 0 {
            return result;
        }
        let mut bounce = self.bounce.lock();
        match self.content.open(self.sector, &mut bounce) {
            Ok(()) => {
                // SAFETY: as in `stage`; the client's mapping is kept alive by `_keep`.
                unsafe { std::ptr::copy_nonoverlapping(bounce.as_ptr(), at as *mut u8, bounce.len()) };
                result
            }
            Err(u) => {
                tracing::warn!("exodisk: reading for a client: {}", crate::core::unsealed(u));
                -libc::EIO
            }
        }
    }
}

fn err<T>(errno: i32, msg: &str) -> crate::core::Result<T> {
    Err(ExoError { errno, msg: msg.into() })
}

/// The root exonode named `name` for user `uid`: a descendant of the service's root exonode,
/// found by the data entry before it (`uid/name`), made on first use.
fn named_root(core: &mut Core, uid: u32, name: &str) -> crate::core::Result<(u64, Caps)> {
    if name.is_empty() || name.len() > 64 || name.contains('/') {
        return err(libc::EINVAL, "a root's name is 1 to 64 bytes, without '/'");
    }
    let roots_at = core.sb.roots_at();
    let caps = core.sb.roots;
    let top = Target::Exonode { at: roots_at, path: vec![] };
    let label = format!("{uid}/{name}").into_bytes();
    let x = core.map(&top, caps.read)?;
    for (i, e) in x.entries.iter().enumerate() {
        if *e == Entry::Data(label.clone()) {
            if let Some(Entry::Descendant { .. }) = x.entries.get(i + 1) {
                let caps = core.cap_discover(&top, caps.write, i as u32 + 1)?;
                let at = match x.entries[i + 1] {
                    Entry::Descendant { at } => at,
                    _ => unreachable!(),
                };
                return Ok((at, caps));
            }
        }
    }
    // A new root: 4 sectors, somewhere free after the service's own.
    let sectors = 4u32;
    let at = core
        .free_map()
        .find_free(sectors as u64, roots_at + layout::ROOTS_SECTORS as u64)
        .ok_or(ExoError { errno: libc::ENOSPC, msg: "the volume is full".into() })?;
    let new = Caps::random();
    let n = x.entries.len() as u32;
    core.add_data(&top, caps.write, Some(n), &label)?;
    if let Err(e) = core.add_exonode(&top, caps.write, Some(n + 1), at, sectors, new) {
        let _ = core.remove_entry(&top, caps.write, n);
        return Err(e);
    }
    Ok((at, new))
}

/// Tell a client it is refused, as its `Hello` would be, without reading from it or waiting on
/// it; the refusal was logged by the admission, once per user and minute.
fn refuse(stream: &UnixStream, reason: &str) {
    let _ = stream.set_nonblocking(true);
    if let Ok(frame) = proto::frame_message(&Message::Rep { id: 0, result: Err((libc::EUSERS, reason.to_owned())) }) {
        let _ = (&mut &*stream).write_all(&frame);
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred.
    let rc = unsafe {
        libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}
