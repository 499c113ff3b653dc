//! One connection, seen from the side that calls: requests go out from any thread, each with its
//! own id, and many may be in flight.
//!
//! Replies are read by the callers themselves, one at a time (leader and followers): the caller
//! that holds the read half reads frames until its own reply comes, handing the others' replies
//! to them, then passes the read half on. It polls the socket briefly before it sleeps. On a
//! machine where waking a thread costs tens of microseconds, a reply then costs no wake-up at
//! all. When no call waits, a background thread reads what the other side sends on its own:
//! change notices, and requests from a peer that calls back.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::stream::{wait_readable, Control, Duplex, FrameRead, Gaps};
use crate::wire::{self, Change, Frame, Message, WireCaller, WireExtOp, WireLayer, RequestOp, WireReply};
use crate::Error;

/// What the server said about itself in the handshake.
#[derive(Clone, Debug)]
pub struct Welcome {
    pub version: u32,
    pub software: String,
    pub instance: u64,
    pub layers: Vec<WireLayer>,
    pub ext_ops: Vec<WireExtOp>,
    pub auth: Option<Vec<u8>>,
    pub hosted: Option<crate::wire::Hosted>,
}

/// Why a connection could not be made.
#[derive(Debug)]
pub struct ConnectError {
    /// What failed, without the address: the caller names it once (`Connector::describe`).
    pub msg: String,
    /// The server answered and said no (wrong key, version): trying again will not help.
    pub refused: bool,
}

impl ConnectError {
    pub fn refused(msg: String) -> ConnectError {
        ConnectError { msg, refused: true }
    }
}

impl From<String> for ConnectError {
    fn from(msg: String) -> ConnectError {
        ConnectError { msg, refused: false }
    }
}

impl From<Error> for ConnectError {
    /// The error without the object it names, which is the address being connected to.
    fn from(e: Error) -> ConnectError {
        let msg = match e {
            Error::Io { op, source, .. } => format!("{op}: {source}"),
            Error::Peer { why, .. } => why,
            e => e.to_string(),
        };
        ConnectError { msg, refused: false }
    }
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

/// Why a call got no reply.
#[derive(Debug)]
pub enum CallError {
    /// The connection ended. `sent` tells whether the request may have reached the server.
    Lost { sent: bool, reason: String },
    /// No reply in time; the request may still run on the server.
    TimedOut,
}

struct Slot {
    reply: Mutex<Option<Result<Frame, String>>>,
    ready: Condvar,
    /// A thread waits for this reply (and may take over reading for everyone).
    waiting: AtomicBool,
}

/// A request sent on a connection, whose reply is still to be collected.
pub struct Ticket {
    id: u64,
    slot: Arc<Slot>,
}

impl Ticket {
    /// Whether the reply (or the connection's end) has come.
    pub fn is_done(&self) -> bool {
        self.slot.reply.lock().is_some()
    }

    /// Wait for the reply on `conn` (the connection that sent it), at most until `deadline`.
    pub fn wait(self, conn: &Connection, deadline: Instant) -> Result<(WireReply, Vec<u8>), CallError> {
        let slot = self.slot;
        let frame = loop {
            if let Some(r) = slot.reply.lock().take() {
                break r;
            }
            if Instant::now() >= deadline {
                conn.pending.lock().remove(&self.id);
                // The reply may have come just now.
                if let Some(r) = slot.reply.lock().take() {
                    break r;
                }
                return Err(CallError::TimedOut);
            }
            match conn.reader.try_lock() {
                Some(mut reader) => {
                    conn.lead(&mut reader, &slot, deadline);
                    drop(reader);
                    conn.pass_the_lead();
                }
                None => {
                    // Someone else reads; it hands the reply over, or the lead when it is done.
                    let mut r = slot.reply.lock();
                    if r.is_none() {
                        slot.waiting.store(true, Ordering::Relaxed);
                        let wait = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(20));
                        slot.ready.wait_for(&mut r, wait);
                        slot.waiting.store(false, Ordering::Relaxed);
                    }
                }
            }
        };
        match frame {
            Ok(frame) => match wire::decode(&frame.header) {
                Ok(Message::Rep { reply, .. }) => Ok((reply, frame.payload)),
                _ => Err(CallError::Lost { sent: true, reason: "a malformed reply".into() }),
            },
            Err(reason) => Err(CallError::Lost { sent: true, reason }),
        }
    }
}

/// Receives the server's change notices.
pub type OnChange = Arc<dyn Fn(Vec<Change>) + Send + Sync>;

/// Answers requests from the other end, for connections where both ends call (a mount and the
/// process hosting one of its layers: the layer calls the levels below it back).
pub type Incoming = Arc<dyn Fn(WireCaller, RequestOp, Vec<u8>) -> (WireReply, Vec<u8>) + Send + Sync>;

/// Threads that answer the other end's requests: a request may wait on a call of its own over
/// the same connection, whose reply the reader thread must stay free to deliver.
const INCOMING_WORKERS: usize = 8;

pub struct Connection {
    writer: Mutex<Box<dyn Write + Send>>,
    control: Arc<dyn Control>,
    pending: Mutex<HashMap<u64, Arc<Slot>>>,
    next_id: AtomicU64,
    /// Why the connection ended, once it has.
    dead: Mutex<Option<String>>,
    is_dead: AtomicBool,
    pub welcome: Welcome,
    incoming: Mutex<Option<std::sync::mpsc::Sender<Frame>>>,
    /// The read half; whoever holds it reads for everyone.
    reader: Mutex<Box<dyn FrameRead>>,
    /// Answers the other end's requests in the thread that read them, when that is the
    /// background reader (a process hosting a layer: the layer's own calls below lead the
    /// connection while it runs).
    inline: Option<Incoming>,
    /// The socket, for the background thread to poll without the read half.
    fd: std::os::fd::RawFd,
    on_change: OnChange,
    /// How closely frames follow each other here: whether waiting for one polls first.
    gaps: Gaps,
}

impl Connection {
    /// Say hello over `stream` and start reading replies. `proof` answers the server's
    /// authentication.
    pub fn open(
        stream: Box<dyn Duplex>,
        proof: Option<Vec<u8>>,
        timeout: Duration,
        on_change: OnChange,
    ) -> Result<Arc<Connection>, ConnectError> {
        Connection::open_with(stream, proof, timeout, on_change, None)
    }

    /// [`Connection::open`], answering the other end's requests with `incoming`.
    pub fn open_with(
        stream: Box<dyn Duplex>,
        proof: Option<Vec<u8>>,
        timeout: Duration,
        on_change: OnChange,
        incoming: Option<Incoming>,
    ) -> Result<Arc<Connection>, ConnectError> {
        let halves = stream.split().map_err(|e| e.to_string())?;
        let (mut reader, mut writer, control) = (halves.reader, halves.writer, halves.control);
        control.set_read_timeout(Some(timeout));
        let hello = Message::Hello {
            versions: wire::VERSIONS.to_vec(),
            software: format!("plyfs {}", env!("CARGO_PKG_VERSION")),
            auth: proof.map(serde_bytes::ByteBuf::from),
        };
        let welcome = (|| -> Result<Welcome, ConnectError> {
            writer.write_all(&wire::PREAMBLE).map_err(|e| e.to_string())?;
            wire::write_frame(&mut writer, &wire::encode(&hello), &[]).map_err(|e| e.to_string())?;
            wire::read_preamble(&mut reader).map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "no answer from the server".to_owned(),
                std::io::ErrorKind::UnexpectedEof => "the server closed the connection".to_owned(),
                _ => e.to_string(),
            })?;
            let frame = wire::read_frame(&mut reader).map_err(|e| match e {
                wire::FrameError::Closed => "the server closed the connection".to_owned(),
                e => e.to_string(),
            })?;
            match wire::decode(&frame.header).map_err(|e| format!("a malformed welcome: {e}"))? {
                Message::Welcome { version, software, instance, layers, ext_ops, auth, hosted } => {
                    Ok(Welcome { version, software, instance, layers, ext_ops, auth: auth.map(|b| b.into_vec()), hosted })
                }
                Message::Refused { reason } => Err(ConnectError::refused(format!("refused: {reason}"))),
                _ => Err(ConnectError::refused("the server did not answer hello with welcome".into())),
            }
        })();
        let welcome = match welcome {
            Ok(w) => w,
            Err(e) => {
                control.close();
                return Err(e);
            }
        };
        control.set_read_timeout(None);
        Connection::start(reader, writer, control, welcome, on_change, incoming, false).map_err(ConnectError::from)
    }

    /// The other side of [`Connection::open_with`], for a process that hosts a layer: wait for
    /// hello, answer with `welcome`, then serve `incoming` and make calls of its own.
    pub fn accept(
        stream: Box<dyn Duplex>,
        welcome: Welcome,
        timeout: Duration,
        incoming: Incoming,
    ) -> Result<Arc<Connection>, Error> {
        const MOUNT: &str = "the mount";
        let halves = stream.split().map_err(Error::io("splitting the connection", MOUNT))?;
        let (mut reader, mut writer, control) = (halves.reader, halves.writer, halves.control);
        control.set_read_timeout(Some(timeout));
        writer.write_all(&wire::PREAMBLE).map_err(Error::io("sending the preamble", MOUNT))?;
        wire::read_preamble(&mut reader).map_err(Error::io("reading the preamble", MOUNT))?;
        let frame = wire::read_frame(&mut reader).map_err(Error::peer(MOUNT))?;
        match wire::decode(&frame.header).map_err(Error::peer(MOUNT))? {
            Message::Hello { versions, .. } if versions.contains(&welcome.version) => {}
            Message::Hello { versions, .. } => {
                return Err(Error::peer(MOUNT)(format!("no common protocol version (the mount speaks {versions:?})")))
            }
            _ => return Err(Error::peer(MOUNT)("the first message was not hello")),
        }
        let msg = Message::Welcome {
            version: welcome.version,
            software: welcome.software.clone(),
            instance: welcome.instance,
            layers: welcome.layers.clone(),
            ext_ops: welcome.ext_ops.clone(),
            auth: None,
            hosted: welcome.hosted.clone(),
        };
        wire::write_frame(&mut writer, &wire::encode(&msg), &[]).map_err(Error::io("sending welcome", MOUNT))?;
        control.set_read_timeout(None);
        Connection::start(reader, writer, control, welcome, Arc::new(|_| {}), Some(incoming), true)
    }

    fn start(
        reader: Box<dyn FrameRead>,
        writer: Box<dyn Write + Send>,
        control: Arc<dyn Control>,
        welcome: Welcome,
        on_change: OnChange,
        incoming: Option<Incoming>,
        inline_incoming: bool,
    ) -> Result<Arc<Connection>, Error> {
        let fd = reader.fd();
        let conn = Arc::new(Connection {
            writer: Mutex::new(writer),
            control,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            dead: Mutex::new(None),
            is_dead: AtomicBool::new(false),
            welcome,
            incoming: Mutex::new(None),
            reader: Mutex::new(reader),
            inline: if inline_incoming { incoming.clone() } else { None },
            fd,
            on_change,
            gaps: Gaps::default(),
        });
        if let Some(handler) = incoming {
            let (tx, rx) = std::sync::mpsc::channel::<Frame>();
            let rx = Arc::new(Mutex::new(rx));
            for i in 0..INCOMING_WORKERS {
                let (rx, handler, weak) = (rx.clone(), handler.clone(), Arc::downgrade(&conn));
                std::thread::Builder::new()
                    .name(format!("peer-calls-{i}"))
                    .spawn(move || loop {
                        let frame = match rx.lock().recv() {
                            Ok(f) => f,
                            Err(_) => return,
                        };
                        let Ok(Message::Req { id, caller, op }) = wire::decode(&frame.header) else { continue };
                        let (reply, payload) = handler(caller, op, frame.payload);
                        let Some(conn) = weak.upgrade() else { return };
                        conn.reply(id, reply, &payload);
                    })
                    .map_err(Error::io("starting a thread for the peer's calls", "a connection"))?;
            }
            *conn.incoming.lock() = Some(tx);
        }
        let weak = Arc::downgrade(&conn);
        std::thread::Builder::new().name("peer-idle-reader".into()).spawn(move || read_when_idle(weak))
            .map_err(Error::io("starting its reader thread", "a connection"))?;
        Ok(conn)
    }

    /// Wait until the connection ends (a hosting process serves until its mount goes).
    pub fn wait_closed(&self) {
        while !self.is_dead() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Why the connection ended, if it has.
    pub fn dead_reason(&self) -> Option<String> {
        self.dead.lock().clone()
    }

    pub fn is_dead(&self) -> bool {
        self.is_dead.load(Ordering::Relaxed)
    }

    /// Close the connection; calls waiting on it fail as lost.
    pub fn close(&self, reason: &str) {
        self.fail(reason.to_owned());
        self.control.close();
    }

    fn fail(&self, reason: String) {
        {
            let mut dead = self.dead.lock();
            if dead.is_none() {
                *dead = Some(reason.clone());
            }
        }
        self.is_dead.store(true, Ordering::Relaxed);
        // Stop the workers: they end when the queue does.
        self.incoming.lock().take();
        let slots: Vec<Arc<Slot>> = self.pending.lock().drain().map(|(_, s)| s).collect();
        for slot in slots {
            let mut r = slot.reply.lock();
            if r.is_none() {
                *r = Some(Err(reason.clone()));
            }
            slot.ready.notify_one();
        }
    }

    /// Send a request that wants no reply (`forget`).
    pub fn send_only(&self, caller: WireCaller, op: impl Into<RequestOp>) -> std::io::Result<()> {
        let header = wire::encode(&Message::Req { id: 0, caller, op: op.into() });
        let mut w = self.writer.lock();
        wire::write_frame(&mut *w, &header, &[])
    }

    /// Send a request and wait for its reply, at most until `deadline`.
    pub fn call(&self, caller: WireCaller, op: impl Into<RequestOp>, payload: &[u8], deadline: Instant) -> Result<(WireReply, Vec<u8>), CallError> {
        self.send(caller, op, payload)?.wait(self, deadline)
    }

    /// Send a request whose reply is collected later with [`Ticket::wait`] (the reply is
    /// kept until then, whoever reads it).
    pub fn send(&self, caller: WireCaller, op: impl Into<RequestOp>, payload: &[u8]) -> Result<Ticket, CallError> {
        let op = op.into();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot { reply: Mutex::new(None), ready: Condvar::new(), waiting: AtomicBool::new(false) });
        self.pending.lock().insert(id, slot.clone());
        if let Some(reason) = self.dead.lock().clone() {
            self.pending.lock().remove(&id);
            return Err(CallError::Lost { sent: false, reason });
        }
        let header = wire::encode(&Message::Req { id, caller, op });
        let written = {
            let mut w = self.writer.lock();
            wire::write_frame(&mut *w, &header, payload)
        };
        if let Err(e) = written {
            self.pending.lock().remove(&id);
            self.close(&e.to_string());
            // A frame is only acted on once whole, and it was not all written.
            return Err(CallError::Lost { sent: false, reason: e.to_string() });
        }
        Ok(Ticket { id, slot })
    }

    /// Read frames for everyone until `mine` has its reply, the deadline passes or the
    /// connection fails.
    fn lead(&self, reader: &mut Box<dyn FrameRead>, mine: &Slot, deadline: Instant) {
        while mine.reply.lock().is_none() && !self.is_dead() {
            match wait_readable(&**reader, &self.gaps, Some(deadline)) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => return self.close(&e.to_string()),
            }
            match wire::read_frame(&mut **reader) {
                Ok(frame) => {
                    if let Err(reason) = self.dispatch(frame) {
                        return self.close(reason);
                    }
                }
                Err(wire::FrameError::Closed) => return self.close("the other side closed the connection"),
                Err(e) => return self.close(&e.to_string()),
            }
        }
    }

    /// A waiting caller takes over reading, if any waits.
    fn pass_the_lead(&self) {
        let pending = self.pending.lock();
        // Replies collected later (writes sent ahead) have no one waiting on them.
        if let Some(slot) = pending.values().find(|s| s.waiting.load(Ordering::Relaxed)) {
            slot.ready.notify_one();
        }
    }

    /// Answer a request from the other end in this thread.
    fn answer_inline(&self, frame: Frame) {
        let Some(handler) = &self.inline else { return };
        let Ok(Message::Req { id, caller, op }) = wire::decode(&frame.header) else {
            return self.close("a malformed request");
        };
        let (reply, payload) = handler(caller, op, frame.payload);
        self.reply(id, reply, &payload);
    }

    /// Answer request `id` of the other end (none for id 0); a reply that cannot be sent ends
    /// the connection.
    fn reply(&self, id: u64, reply: WireReply, payload: &[u8]) {
        if id == 0 {
            return;
        }
        let header = wire::encode(&Message::Rep { id, reply });
        let mut w = self.writer.lock();
        if wire::write_frame(&mut *w, &header, payload).is_err() {
            drop(w);
            self.close("cannot send a reply");
        }
    }

    /// Hand one frame to whom it is for; otherwise, why the connection must end.
    fn dispatch(&self, frame: Frame) -> Result<(), &'static str> {
        // Only the message type and id are needed here; the caller decodes the rest.
        match peek(&frame.header) {
            Some(("rep", id)) => {
                let slot = self.pending.lock().remove(&id);
                if let Some(slot) = slot {
                    *slot.reply.lock() = Some(Ok(frame));
                    slot.ready.notify_one();
                }
                Ok(())
            }
            Some(("req", _)) => match self.incoming.lock().as_ref().map(|tx| tx.send(frame).is_ok()) {
                Some(true) => Ok(()),
                _ => Err("a request from a peer that takes none"),
            },
            Some(("changed", _)) => {
                if let Ok(Message::Changed { changes }) = wire::decode(&frame.header) {
                    (self.on_change)(changes);
                }
                Ok(())
            }
            _ => Err("a malformed message"),
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.control.close();
    }
}

/// Read what comes while no call waits (change notices, a peer's requests), until the
/// connection ends or is dropped. While calls wait, their callers read.
fn read_when_idle(conn: std::sync::Weak<Connection>) {
    loop {
        let Some(c) = conn.upgrade() else { return };
        if c.is_dead() {
            return;
        }
        if c.reader.is_locked() {
            // A caller reads for everyone: stay out of its way (spinning beside it costs it a
            // CPU on a small machine).
            drop(c);
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let fd = c.fd;
        let spin = c.gaps.spin();
        drop(c);
        // Wait for the socket without holding anything (and without keeping the connection):
        // a little polling first, as the leaders do, then sleeping.
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let spin_until = Instant::now() + spin;
        let mut readable = false;
        while !readable && Instant::now() < spin_until {
            readable = unsafe { libc::poll(&mut pfd, 1, 0) } > 0;
            crate::stream::yield_now();
        }
        if !readable {
            readable = unsafe { libc::poll(&mut pfd, 1, 50) } > 0;
        }
        let Some(c) = conn.upgrade() else { return };
        let waiting = !c.pending.lock().is_empty();
        if waiting && !readable {
            continue;
        }
        let Some(mut reader) = c.reader.try_lock() else {
            if readable {
                // A caller reads; do not spin on the same bytes.
                std::thread::sleep(Duration::from_millis(1));
            }
            continue;
        };
        // Calls wait but none reads (the lead was just passed on): read for them.
        // Decrypted bytes may wait in the reader even when the socket has none.
        if !readable && !reader.buffered() {
            continue;
        }
        match wire::read_frame(&mut **reader) {
            Ok(frame) if c.inline.is_some() && matches!(peek(&frame.header), Some(("req", _))) => {
                drop(reader);
                c.answer_inline(frame);
                continue;
            }
            Ok(frame) => {
                if let Err(reason) = c.dispatch(frame) {
                    drop(reader);
                    c.close(reason);
                    return;
                }
            }
            Err(wire::FrameError::Closed) => {
                drop(reader);
                c.fail("the other side closed the connection".into());
                return;
            }
            Err(e) => {
                drop(reader);
                c.fail(e.to_string());
                return;
            }
        }
        drop(reader);
        c.pass_the_lead();
    }
}

#[derive(serde::Deserialize)]
struct Peek<'a> {
    t: &'a str,
    #[serde(default)]
    id: u64,
}

fn peek(header: &[u8]) -> Option<(&str, u64)> {
    let p: Peek = wire::from_msgpack(header).ok()?;
    Some((p.t, p.id))
}

/// Connect to `addr` (no TLS: Unix sockets, and tests).
pub fn connect_plain(addr: &crate::stream::Addr, timeout: Duration) -> Result<Box<dyn Duplex>, Error> {
    match addr {
        crate::stream::Addr::Unix(path) => {
            std::os::unix::net::UnixStream::connect(path).map(|s| Box::new(s) as Box<dyn Duplex>).map_err(Error::io("connecting", addr))
        }
        crate::stream::Addr::Tcp(hp) => connect_tcp(hp, timeout).map(|s| Box::new(s) as Box<dyn Duplex>),
    }
}

/// Connect to `HOST:PORT`, trying each of its addresses.
pub fn connect_tcp(hostport: &str, timeout: Duration) -> Result<std::net::TcpStream, Error> {
    use std::net::ToSocketAddrs;
    let shown = format!("tcp:{hostport}");
    let addrs: Vec<_> = hostport.to_socket_addrs().map_err(Error::io("resolving", &shown))?.collect();
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    for a in addrs {
        match std::net::TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(Error::io("connecting", shown)(last))
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Connection>();
}

/// Opens connections to the server: a socket, TLS and the key's proof as configured.
pub trait Connector: Send + Sync {
    /// Where it connects, for log lines and errors (a [`ConnectError`] does not repeat it).
    fn describe(&self) -> String;
    fn connect(&self, timeout: Duration, on_change: OnChange) -> std::result::Result<Arc<Connection>, ConnectError>;
}
