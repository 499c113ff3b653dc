//! The client side of one connection: requests go out from any thread, each with its own id;
//! a reader thread hands every reply to the thread that waits for it, and passes the server's
//! change notices on.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::stream::{Control, Duplex};
use crate::wire::{self, Change, Frame, Message, WireCaller, WireExtOp, WireLayer, WireOp, WireReply};

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
}

/// Receives the server's change notices.
pub type OnChange = Arc<dyn Fn(Vec<Change>) + Send + Sync>;

/// Answers requests from the other end, for connections where both ends call (a mount and the
/// process hosting one of its layers: the layer calls the levels below it back).
pub type Incoming = Arc<dyn Fn(WireCaller, WireOp, Vec<u8>) -> (WireReply, Vec<u8>) + Send + Sync>;

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
        Connection::start(reader, writer, control, welcome, on_change, incoming).map_err(ConnectError::from)
    }

    /// The other side of [`Connection::open_with`], for a process that hosts a layer: wait for
    /// hello, answer with `welcome`, then serve `incoming` and make calls of its own.
    pub fn accept(
        stream: Box<dyn Duplex>,
        welcome: Welcome,
        timeout: Duration,
        incoming: Incoming,
    ) -> Result<Arc<Connection>, String> {
        let halves = stream.split().map_err(|e| e.to_string())?;
        let (mut reader, mut writer, control) = (halves.reader, halves.writer, halves.control);
        control.set_read_timeout(Some(timeout));
        writer.write_all(&wire::PREAMBLE).map_err(|e| e.to_string())?;
        wire::read_preamble(&mut reader).map_err(|e| e.to_string())?;
        let frame = wire::read_frame(&mut reader).map_err(|e| e.to_string())?;
        match wire::decode(&frame.header)? {
            Message::Hello { versions, .. } if versions.contains(&welcome.version) => {}
            Message::Hello { versions, .. } => return Err(format!("no common protocol version (the mount speaks {versions:?})")),
            _ => return Err("the first message was not hello".into()),
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
        wire::write_frame(&mut writer, &wire::encode(&msg), &[]).map_err(|e| e.to_string())?;
        control.set_read_timeout(None);
        Connection::start(reader, writer, control, welcome, Arc::new(|_| {}), Some(incoming))
    }

    fn start(
        reader: Box<dyn Read + Send>,
        writer: Box<dyn Write + Send>,
        control: Arc<dyn Control>,
        welcome: Welcome,
        on_change: OnChange,
        incoming: Option<Incoming>,
    ) -> Result<Arc<Connection>, String> {
        let conn = Arc::new(Connection {
            writer: Mutex::new(writer),
            control,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            dead: Mutex::new(None),
            is_dead: AtomicBool::new(false),
            welcome,
            incoming: Mutex::new(None),
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
                        if id != 0 {
                            let header = wire::encode(&Message::Rep { id, reply });
                            let mut w = conn.writer.lock();
                            if wire::write_frame(&mut *w, &header, &payload).is_err() {
                                drop(w);
                                conn.close("cannot send a reply");
                            }
                        }
                    })
                    .map_err(|e| e.to_string())?;
            }
            *conn.incoming.lock() = Some(tx);
        }
        let weak = Arc::downgrade(&conn);
        std::thread::Builder::new()
            .name("peer-replies".into())
            .spawn(move || read_replies(weak, reader, on_change))
            .map_err(|e| e.to_string())?;
        Ok(conn)
    }

    /// Wait until the connection ends (a hosting process serves until its mount goes).
    pub fn wait_closed(&self) {
        while !self.is_dead() {
            std::thread::sleep(Duration::from_millis(100));
        }
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
    pub fn send_only(&self, caller: WireCaller, op: WireOp) -> Result<(), String> {
        let header = wire::encode(&Message::Req { id: 0, caller, op });
        let mut w = self.writer.lock();
        wire::write_frame(&mut *w, &header, &[]).map_err(|e| e.to_string())
    }

    /// Send a request and wait for its reply, at most until `deadline`.
    pub fn call(&self, caller: WireCaller, op: WireOp, payload: &[u8], deadline: Instant) -> Result<(WireReply, Vec<u8>), CallError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot { reply: Mutex::new(None), ready: Condvar::new() });
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
        let mut reply = slot.reply.lock();
        while reply.is_none() {
            if slot.ready.wait_until(&mut reply, deadline).timed_out() && reply.is_none() {
                drop(reply);
                self.pending.lock().remove(&id);
                return Err(CallError::TimedOut);
            }
        }
        match reply.take().expect("checked above") {
            Ok(frame) => match wire::decode(&frame.header) {
                Ok(Message::Rep { reply, .. }) => Ok((reply, frame.payload)),
                _ => Err(CallError::Lost { sent: true, reason: "a malformed reply".into() }),
            },
            Err(reason) => Err(CallError::Lost { sent: true, reason }),
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.control.close();
    }
}

/// The reader thread: replies to their callers, notices to `on_change`, until the connection
/// ends or is dropped.
fn read_replies(conn: std::sync::Weak<Connection>, mut reader: Box<dyn Read + Send>, on_change: OnChange) {
    loop {
        let frame = wire::read_frame(&mut reader);
        let Some(c) = conn.upgrade() else { return };
        let frame = match frame {
            Ok(f) => f,
            Err(wire::FrameError::Closed) => return c.fail("the server closed the connection".into()),
            Err(e) => return c.fail(e.to_string()),
        };
        // Only the message type and id are needed here; the caller decodes the rest.
        match peek(&frame.header) {
            Some(("rep", id)) => {
                let slot = c.pending.lock().remove(&id);
                if let Some(slot) = slot {
                    *slot.reply.lock() = Some(Ok(frame));
                    slot.ready.notify_one();
                }
            }
            Some(("req", _)) => {
                let sent = c.incoming.lock().as_ref().map(|tx| tx.send(frame).is_ok());
                if sent != Some(true) {
                    c.close("a request from a peer that takes none");
                    return;
                }
            }
            Some(("changed", _)) => {
                if let Ok(Message::Changed { changes }) = wire::decode(&frame.header) {
                    on_change(changes);
                }
            }
            _ => {
                c.close("a malformed message from the server");
                return;
            }
        }
    }
}

#[derive(serde::Deserialize)]
struct Peek<'a> {
    t: &'a str,
    #[serde(default)]
    id: u64,
}

fn peek(header: &[u8]) -> Option<(&str, u64)> {
    let p: Peek = rmp_serde::from_slice(header).ok()?;
    Some((p.t, p.id))
}

/// Connect to `addr` (no TLS: Unix sockets, and tests).
pub fn connect_plain(addr: &crate::stream::Addr, timeout: Duration) -> Result<Box<dyn Duplex>, String> {
    match addr {
        crate::stream::Addr::Unix(path) => {
            std::os::unix::net::UnixStream::connect(path).map(|s| Box::new(s) as Box<dyn Duplex>).map_err(|e| format!("{addr}: {e}"))
        }
        crate::stream::Addr::Tcp(hp) => connect_tcp(hp, timeout).map(|s| Box::new(s) as Box<dyn Duplex>),
    }
}

/// Connect to `HOST:PORT`, trying each of its addresses.
pub fn connect_tcp(hostport: &str, timeout: Duration) -> Result<std::net::TcpStream, String> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<_> = hostport.to_socket_addrs().map_err(|e| format!("tcp:{hostport}: {e}"))?.collect();
    let mut last = format!("tcp:{hostport}: no address");
    for a in addrs {
        match std::net::TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("tcp:{hostport}: {e}"),
        }
    }
    Err(last)
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Connection>();
}
