//! The client library: a typed API over the service's socket, with the data in shared memory.
//!
//! Requests may be many at once: [`Client::submit`] queues data requests and returns; their
//! completions are collected with [`Client::wait_io`] or looked at with [`Client::poll_io`] (the
//! thesis's polling of a result integer). [`Client::read`] and [`Client::write`] do it all for
//! one range.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use serde_bytes::ByteBuf;

use crate::core::{ExoError, Persistence, Result, Target};
use crate::error::{io, Error};
use crate::freemap::FreeMap;
use crate::object::{Cap, Caps};
use crate::proto::{self, wcap, IoReq, Message, Reply, Request, WExonode, WTarget};
use crate::shm::Shm;

/// Bytes per transfer slot of the shared memory.
const SLOT: usize = 1 << 20;

/// Where a reply goes: the caller waiting for it.
type Waiter = Sender<std::result::Result<Reply, (i32, String)>>;
/// The service's queue as a client sees it: sector, sectors, whether the request is its own.
pub type QueueView = Vec<(u64, u32, bool)>;

struct Shared {
    pending: Mutex<HashMap<u64, Waiter>>,
    done: Mutex<HashMap<u64, i32>>,
    arrived: Condvar,
    dead: AtomicBool,
}

pub struct Client {
    writer: Mutex<UnixStream>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    shm: Arc<Shm>,
    free_slots: Mutex<Vec<usize>>,
    slot_free: Condvar,
    pub sectors: u64,
    pub data_start: u64,
    pub id: u64,
    /// The service's socket, for messages.
    socket: PathBuf,
}

fn lost() -> ExoError {
    ExoError { errno: libc::ECONNRESET, msg: "the exodisk service went away".into() }
}

impl Client {
    /// The socket of the service this client is connected to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Connect to the service at `socket`, with `shm` bytes of shared memory for data.
    pub fn connect(socket: &Path, shm: usize) -> std::result::Result<Client, Error> {
        let stream = UnixStream::connect(socket).map_err(|source| Error::Unreachable { socket: socket.to_owned(), source })?;
        let shm = Shm::create(shm.max(SLOT)).map_err(io("making the shared memory", socket))?;
        let mut w = stream.try_clone().map_err(io("cloning the connection", socket))?;
        let hello = Message::Req { id: 0, req: Request::Hello { version: proto::VERSION, shm: shm.len() as u64 } };
        // A service over its limits answers before it reads anything and closes: its reason is
        // worth more than the failed write.
        let sent = crate::shm::send_fd(&stream, shm.fd()).and_then(|()| proto::write_message(&mut w, &hello));
        let mut r = std::io::BufReader::new(stream.try_clone().map_err(io("cloning the connection", socket))?);
        let answer = proto::read_message(&mut r)
            .map_err(|e| Error::Io { op: "saying hello", path: socket.to_owned(), source: sent.err().unwrap_or(e) })?;
        let (sectors, data_start, id) = match answer {
            Message::Rep { result: Ok(Reply::Welcome { sectors, data_start, client, .. }), .. } => (sectors, data_start, client),
            Message::Rep { result: Err((_, msg)), .. } => return Err(Error::Refused { socket: socket.to_owned(), why: msg }),
            _ => return Err(Error::NotAService { socket: socket.to_owned() }),
        };
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            done: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
            dead: AtomicBool::new(false),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("exodisk-client".into())
            .spawn(move || {
                while let Ok(m) = proto::read_message(&mut r) {
                    match m {
                        Message::Rep { id, result } => {
                            if let Some(tx) = s.pending.lock().remove(&id) {
                                let _ = tx.send(result);
                            }
                        }
                        Message::Done { id, result } => {
                            s.done.lock().insert(id, result);
                            s.arrived.notify_all();
                        }
                        Message::Req { .. } => break,
                    }
                }
                s.dead.store(true, Ordering::Release);
                s.pending.lock().clear();
                let _g = s.done.lock();
                s.arrived.notify_all();
            })
            .map_err(io("starting the reply reader", socket))?;
        let slots = shm.len() / SLOT;
        Ok(Client {
            writer: Mutex::new(w),
            shared,
            next_id: AtomicU64::new(1),
            shm: Arc::new(shm),
            free_slots: Mutex::new((0..slots).collect()),
            slot_free: Condvar::new(),
            sectors,
            data_start,
            id,
            socket: socket.to_owned(),
        })
    }

    /// Send `req` and wait for its reply.
    pub fn call(&self, req: Request) -> Result<Reply> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = channel();
        self.shared.pending.lock().insert(id, tx);
        if self.shared.dead.load(Ordering::Acquire) {
            return Err(lost());
        }
        {
            let mut w = self.writer.lock();
            let mut frame = Vec::new();
            proto::write_message(&mut frame, &Message::Req { id, req }).map_err(|_| lost())?;
            w.write_all(&frame).map_err(|_| lost())?;
        }
        match rx.recv() {
            Ok(Ok(r)) => Ok(r),
            Ok(Err((errno, msg))) => Err(ExoError { errno, msg }),
            Err(_) => Err(lost()),
        }
    }

    fn ok(&self, req: Request) -> Result<()> {
        self.call(req).map(|_| ())
    }

    fn entry(&self, req: Request) -> Result<u32> {
        match self.call(req)? {
            Reply::Entry(e) => Ok(e),
            r => Err(unexpected(r)),
        }
    }

    /// The caller's root exonode named `name` (made on first use), and its capabilities.
    pub fn root(&self, name: &str) -> Result<(u64, Caps)> {
        match self.call(Request::Root { name: name.into(), uid: None, exclusive: false })? {
            Reply::Root { at, caps } => Ok((at, caps.into())),
            r => Err(unexpected(r)),
        }
    }

    /// The root named `name`, held by this connection alone until it ends (another exclusive
    /// holder waits up to 10 s for it, then gets `EBUSY`).
    pub fn root_exclusive(&self, name: &str) -> Result<(u64, Caps)> {
        match self.call(Request::Root { name: name.into(), uid: None, exclusive: true })? {
            Reply::Root { at, caps } => Ok((at, caps.into())),
            r => Err(unexpected(r)),
        }
    }

    /// A snapshot of the free map, for choosing where to allocate. It comes in pages, so other
    /// clients' allocations between two pages may show in one and not the other: the map is a
    /// hint, and the service checks every allocation.
    pub fn free_map(&self) -> Result<FreeMap> {
        let short = || ExoError { errno: libc::EPROTO, msg: "a short free map".into() };
        let (mut volume, mut bits) = (None, Vec::new());
        loop {
            let (sectors, page) = match self.call(Request::FreeMap { from: bits.len() as u64 })? {
                Reply::FreeMap { sectors, bits } => (sectors, bits.into_vec()),
                r => return Err(unexpected(r)),
            };
            if *volume.get_or_insert(sectors) != sectors || page.is_empty() && (bits.len() as u64) < sectors.div_ceil(8) {
                return Err(short());
            }
            bits.extend_from_slice(&page);
            if bits.len() as u64 >= sectors.div_ceil(8) {
                return FreeMap::from_bits(sectors, &bits).ok_or_else(short);
            }
        }
    }

    pub fn extent_allocate(&self, at: u64, sectors: u64, caps: Caps, p: Persistence) -> Result<()> {
        self.ok(Request::ExtentAllocate { at, sectors, caps: caps.into(), persistence: p.into() })
    }

    pub fn extent_deallocate(&self, at: u64, wcap_: Cap) -> Result<()> {
        self.ok(Request::ExtentDeallocate { at, wcap: wcap(wcap_) })
    }

    pub fn extent_resize(&self, at: u64, wcap_: Cap, by: i64) -> Result<u64> {
        match self.call(Request::ExtentResize { at, wcap: wcap(wcap_), by })? {
            Reply::Sectors(n) => Ok(n),
            r => Err(unexpected(r)),
        }
    }

    pub fn exonode_allocate(&self, at: u64, sectors: u32, caps: Caps, p: Persistence) -> Result<()> {
        self.ok(Request::ExonodeAllocate { at, sectors, caps: caps.into(), persistence: p.into() })
    }

    pub fn exonode_deallocate(&self, t: &Target, wcap_: Cap) -> Result<()> {
        self.ok(Request::ExonodeDeallocate { target: t.into(), wcap: wcap(wcap_) })
    }

    pub fn add_extent(&self, t: &Target, wcap_: Cap, idx: Option<u32>, start: u64, sectors: u64) -> Result<u32> {
        self.entry(Request::AddExtent { target: t.into(), wcap: wcap(wcap_), idx, start, sectors })
    }

    pub fn add_exonode(&self, t: &Target, wcap_: Cap, idx: Option<u32>, child: u64, sectors: u32, caps: Caps) -> Result<u32> {
        self.add_exonode_as(t, wcap_, idx, child, sectors, caps, None, Vec::new())
    }

    /// ADD_EXONODE, the descendant with a persistence model of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn add_exonode_as(
        &self,
        t: &Target,
        wcap_: Cap,
        idx: Option<u32>,
        child: u64,
        sectors: u32,
        caps: Caps,
        model: Option<Persistence>,
        data: Vec<Vec<u8>>,
    ) -> Result<u32> {
        self.entry(Request::AddExonode {
            target: t.into(),
            wcap: wcap(wcap_),
            idx,
            child,
            sectors,
            caps: caps.into(),
            persistence: model.map(Into::into),
            data: data.into_iter().map(ByteBuf::from).collect(),
        })
    }

    pub fn add_data(&self, t: &Target, wcap_: Cap, idx: Option<u32>, data: &[u8]) -> Result<u32> {
        self.entry(Request::AddData { target: t.into(), wcap: wcap(wcap_), idx, data: ByteBuf::from(data.to_vec()) })
    }

    pub fn read_data(&self, t: &Target, rcap: Cap, idx: u32) -> Result<Vec<u8>> {
        match self.call(Request::ReadData { target: t.into(), rcap: wcap(rcap), idx })? {
            Reply::Data(d) => Ok(d.into_vec()),
            r => Err(unexpected(r)),
        }
    }

    pub fn remove_entry(&self, t: &Target, wcap_: Cap, idx: u32) -> Result<()> {
        self.ok(Request::RemoveEntry { target: t.into(), wcap: wcap(wcap_), idx })
    }

    pub fn combine(&self, t: &Target, wcap_: Cap, a: u32, b: u32) -> Result<()> {
        self.ok(Request::Combine { target: t.into(), wcap: wcap(wcap_), a, b })
    }

    pub fn split(&self, t: &Target, wcap_: Cap, idx: u32, at_sector: u64, new_idx: Option<u32>) -> Result<u32> {
        self.entry(Request::Split { target: t.into(), wcap: wcap(wcap_), idx, at_sector, new_idx })
    }

    pub fn cap_discover(&self, t: &Target, c: Cap, idx: u32) -> Result<Caps> {
        match self.call(Request::CapDiscover { target: t.into(), cap: wcap(c), idx })? {
            Reply::Caps(c) => Ok(c.into()),
            r => Err(unexpected(r)),
        }
    }

    pub fn write_record(&self, t: &Target, wcap_: Cap) -> Result<()> {
        self.ok(Request::WriteRecord { target: t.into(), wcap: wcap(wcap_) })
    }

    pub fn map(&self, t: &Target, rcap: Cap) -> Result<WExonode> {
        match self.call(Request::Map { target: t.into(), rcap: wcap(rcap) })? {
            Reply::Exonode(x) => Ok(x),
            r => Err(unexpected(r)),
        }
    }

    pub fn proxy(&self, t: &Target, c: Cap, range: Option<(u64, u64)>, caps: Caps) -> Result<u64> {
        match self.call(Request::Proxy { target: t.into(), cap: wcap(c), range, caps: caps.into() })? {
            Reply::Id(id) => Ok(id),
            r => Err(unexpected(r)),
        }
    }

    /// A proxy of some entries of the exonode `t` under `caps`.
    pub fn proxy_entries(&self, t: &Target, c: Cap, entries: Vec<u32>, caps: Caps) -> Result<u64> {
        match self.call(Request::ProxyEntries { target: t.into(), cap: wcap(c), entries, caps: caps.into() })? {
            Reply::Id(id) => Ok(id),
            r => Err(unexpected(r)),
        }
    }

    /// The service's pending count and its queue (sector, sectors, whether it is this
    /// client's).
    pub fn poll(&self) -> Result<(u64, QueueView)> {
        match self.call(Request::Poll)? {
            Reply::Poll { pending, queue } => Ok((pending, queue)),
            r => Err(unexpected(r)),
        }
    }

    // ---- data ----------------------------------------------------------------------------

    /// The shared memory, for callers that place their own data ([`Client::submit`]).
    pub fn shm(&self) -> &Shm {
        &self.shm
    }

    /// A fresh id for a data request.
    pub fn io_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Queue data requests (disk-directed I/O: all of them at once); they complete later.
    pub fn submit(&self, reqs: Vec<IoReq>) -> Result<u32> {
        match self.call(Request::Io { reqs })? {
            Reply::Queued(n) => Ok(n),
            r => Err(unexpected(r)),
        }
    }

    /// The result of data request `id` if it has completed (bytes, or a negative errno).
    pub fn poll_io(&self, id: u64) -> Option<i32> {
        self.shared.done.lock().remove(&id)
    }

    /// Wait for data request `id`.
    pub fn wait_io(&self, id: u64) -> i32 {
        let mut done = self.shared.done.lock();
        loop {
            if let Some(r) = done.remove(&id) {
                return r;
            }
            if self.shared.dead.load(Ordering::Acquire) {
                return -libc::ECONNRESET;
            }
            self.shared.arrived.wait(&mut done);
        }
    }

    fn slot(&self) -> usize {
        let mut free = self.free_slots.lock();
        loop {
            if let Some(s) = free.pop() {
                return s;
            }
            self.slot_free.wait(&mut free);
        }
    }

    fn give_back(&self, s: usize) {
        self.free_slots.lock().push(s);
        self.slot_free.notify_one();
    }

    fn transfer(&self, t: &Target, c: Cap, sector: u64, len: usize, write: Option<&[u8]>, out: Option<&mut [u8]>) -> Result<()> {
        if !len.is_multiple_of(crate::disk::SECTOR) {
            return Err(ExoError { errno: libc::EINVAL, msg: "a whole number of sectors".into() });
        }
        let slot = self.slot();
        let offset = (slot * SLOT) as u64;
        let mut result = Ok(());
        let mut out = out;
        let mut done = 0usize;
        while done < len && result.is_ok() {
            let n = (len - done).min(SLOT);
            if let Some(data) = write {
                self.shm.put(offset, &data[done..done + n]).map_err(|_| lost())?;
            }
            let id = self.io_id();
            let req = IoReq {
                id,
                target: WTarget::from(t),
                cap: wcap(c),
                write: write.is_some(),
                sector: sector + (done / crate::disk::SECTOR) as u64,
                count: (n / crate::disk::SECTOR) as u32,
                offset,
            };
            result = self.submit(vec![req]).and_then(|_| match self.wait_io(id) {
                r if r >= 0 => Ok(()),
                r => Err(ExoError { errno: -r, msg: format!("sectors {sector}..: {}", std::io::Error::from_raw_os_error(-r)) }),
            });
            if result.is_ok() {
                if let Some(o) = out.as_deref_mut() {
                    self.shm.get(offset, &mut o[done..done + n]).map_err(|_| lost())?;
                }
            }
            done += n;
        }
        self.give_back(slot);
        result
    }

    /// Read `out.len()` bytes (whole sectors) from `sector` of `t`.
    pub fn read(&self, t: &Target, rcap: Cap, sector: u64, out: &mut [u8]) -> Result<()> {
        let len = out.len();
        self.transfer(t, rcap, sector, len, None, Some(out))
    }

    /// Write `data` (whole sectors) at `sector` of `t`.
    pub fn write(&self, t: &Target, wcap_: Cap, sector: u64, data: &[u8]) -> Result<()> {
        self.transfer(t, wcap_, sector, data.len(), Some(data), None)
    }

    /// Do `reqs` in order in one round trip. The replies of those done, and the failure that
    /// stopped the rest (if one did).
    pub fn batch(&self, reqs: Vec<Request>) -> (Vec<Reply>, Option<ExoError>) {
        if reqs.is_empty() {
            return (Vec::new(), None);
        }
        match self.call(Request::Batch { reqs }) {
            Ok(Reply::Batch(results)) => {
                let mut out = Vec::with_capacity(results.len());
                for r in results {
                    match r {
                        Ok(r) => out.push(r),
                        Err((errno, msg)) => return (out, Some(ExoError { errno, msg })),
                    }
                }
                (out, None)
            }
            Ok(r) => (Vec::new(), Some(unexpected(r))),
            Err(e) => (Vec::new(), Some(e)),
        }
    }

    /// Write many pieces at once (each whole sectors of one object): they are packed into the
    /// shared memory, queued together so that the service orders them on the disk, and waited
    /// for. The first failure is the answer, after every piece has completed.
    pub fn write_many(&self, pieces: &[(Target, Cap, u64, &[u8])]) -> Result<()> {
        // Slots held by this call, those of them idle again, the one being filled and how full.
        let mut held: Vec<usize> = Vec::new();
        let mut idle: Vec<usize> = Vec::new();
        let (mut slot, mut used) = (0usize, SLOT);
        let mut waiting: Vec<(u64, u64)> = Vec::new();
        let mut first_err: Option<ExoError> = None;
        let mut reqs = Vec::new();
        let send = |reqs: &mut Vec<IoReq>, first_err: &mut Option<ExoError>| {
            if !reqs.is_empty() {
                if let Err(e) = self.submit(std::mem::take(reqs)) {
                    first_err.get_or_insert(e);
                }
            }
        };
        let finish = |waiting: &mut Vec<(u64, u64)>, first_err: &mut Option<ExoError>| {
            for (id, sector) in waiting.drain(..) {
                let r = self.wait_io(id);
                if r < 0 && first_err.is_none() {
                    *first_err =
                        Some(ExoError { errno: -r, msg: format!("sectors {sector}..: {}", std::io::Error::from_raw_os_error(-r)) });
                }
            }
        };
        for (t, c, sector, data) in pieces {
            if !data.len().is_multiple_of(crate::disk::SECTOR) {
                first_err.get_or_insert(ExoError { errno: libc::EINVAL, msg: "a whole number of sectors".into() });
                break;
            }
            let mut done = 0usize;
            while done < data.len() {
                if used == SLOT {
                    // Another slot: one of ours that is idle, a free one, or (when every slot is
                    // taken) ours again once what was queued in them is done.
                    if let Some(s) = idle.pop() {
                        slot = s;
                    } else if let Some(f) = if held.is_empty() { Some(self.slot()) } else { self.free_slots.lock().pop() } {
                        held.push(f);
                        slot = f;
                    } else {
                        send(&mut reqs, &mut first_err);
                        finish(&mut waiting, &mut first_err);
                        idle = held.clone();
                        slot = idle.pop().expect("one held");
                    }
                    used = 0;
                }
                let n = (data.len() - done).min(SLOT - used);
                let offset = (slot * SLOT + used) as u64;
                self.shm.put(offset, &data[done..done + n]).map_err(|_| lost())?;
                let id = self.io_id();
                let s = sector + (done / crate::disk::SECTOR) as u64;
                reqs.push(IoReq {
                    id,
                    target: WTarget::from(t),
                    cap: wcap(*c),
                    write: true,
                    sector: s,
                    count: (n / crate::disk::SECTOR) as u32,
                    offset,
                });
                waiting.push((id, s));
                used += n;
                done += n;
            }
        }
        send(&mut reqs, &mut first_err);
        finish(&mut waiting, &mut first_err);
        for s in held {
            self.give_back(s);
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Read many pieces at once (each whole sectors of one object, at most 1 MiB): queued
    /// together so that the service orders them on the disk, then copied out. The pieces' bytes,
    /// in order.
    pub fn read_many(&self, pieces: &[(Target, Cap, u64, usize)]) -> Result<Vec<Vec<u8>>> {
        let mut out: Vec<Vec<u8>> = Vec::with_capacity(pieces.len());
        let mut held = vec![self.slot()];
        while held.len() < 8 {
            match self.free_slots.lock().pop() {
                Some(s) => held.push(s),
                None => break,
            }
        }
        let mut result = Ok(());
        let mut next = 0;
        while next < pieces.len() && result.is_ok() {
            // A round: as many whole pieces as the slots held take.
            let (mut slot, mut used) = (0usize, 0usize);
            let mut round: Vec<(usize, u64, u64)> = Vec::new();
            while next < pieces.len() {
                let len = pieces[next].3;
                if len > SLOT || !len.is_multiple_of(crate::disk::SECTOR) {
                    result =
                        Err(ExoError { errno: libc::EINVAL, msg: format!("a piece of {len} bytes (whole sectors, at most 1 MiB)") });
                    break;
                }
                if used + len > SLOT {
                    (slot, used) = (slot + 1, 0);
                    if slot == held.len() {
                        break;
                    }
                }
                round.push((next, (held[slot] * SLOT + used) as u64, self.io_id()));
                used += len;
                next += 1;
            }
            if result.is_err() || round.is_empty() {
                break;
            }
            let reqs = round
                .iter()
                .map(|&(i, offset, id)| IoReq {
                    id,
                    target: WTarget::from(&pieces[i].0),
                    cap: wcap(pieces[i].1),
                    write: false,
                    sector: pieces[i].2,
                    count: (pieces[i].3 / crate::disk::SECTOR) as u32,
                    offset,
                })
                .collect();
            if let Err(e) = self.submit(reqs) {
                result = Err(e);
            }
            for &(i, offset, id) in &round {
                let r = self.wait_io(id);
                if r < 0 && result.is_ok() {
                    result = Err(ExoError {
                        errno: -r,
                        msg: format!("sectors {}..: {}", pieces[i].2, std::io::Error::from_raw_os_error(-r)),
                    });
                }
                if result.is_ok() {
                    let mut b = vec![0u8; pieces[i].3];
                    self.shm.get(offset, &mut b).map_err(|_| lost())?;
                    out.push(b);
                }
            }
        }
        for s in held {
            self.give_back(s);
        }
        result.map(|()| out)
    }

    /// Ask the service to stop (root or its own user).
    pub fn shutdown(&self) -> Result<()> {
        self.ok(Request::Shutdown)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // The reader thread holds the socket too: end the connection for both.
        let _ = self.writer.lock().shutdown(std::net::Shutdown::Both);
    }
}

fn unexpected(r: Reply) -> ExoError {
    ExoError { errno: libc::EPROTO, msg: format!("unexpected reply {r:?}") }
}
