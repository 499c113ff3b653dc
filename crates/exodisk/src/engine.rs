//! The service's disk queue: every client's data requests in one queue, ordered as C-LOOK
//! (ascending from the last sector dispatched, then wrapping round: the thesis's scheduler), and
//! submitted through io_uring with a bounded depth. The queue is visible (`POLL`), so that
//! applications can time their own requests (thesis §2.3.2).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;

use crate::disk::SECTOR;
use crate::record::WriteLog;

/// Requests in the device's hands at once.
pub const DEPTH: usize = 64;

/// Where a request's bytes are: memory that outlives it (a client's shared memory, kept alive
/// by `_keep`).
pub struct Buffer {
    pub ptr: *mut u8,
    pub len: usize,
    pub _keep: Arc<dyn Send + Sync>,
}

unsafe impl Send for Buffer {}

pub struct Job {
    pub write: bool,
    pub sector: u64,
    pub buf: Buffer,
    /// Flushed to stable storage before it completes (`RWF_DSYNC`).
    pub dsync: bool,
    /// Who asked (for the queue's view).
    pub client: u64,
    /// Called with the result: bytes done, or a negative errno.
    pub done: Box<dyn FnOnce(i32) + Send>,
}

/// One entry of the queue's view: sector, sectors, client.
pub type Queued = (u64, u32, u64);

pub struct Engine {
    tx: Mutex<Option<Sender<Job>>>,
    queue: Arc<Mutex<Vec<Queued>>>,
    pending: Arc<AtomicU64>,
    /// The sector ranges of the requests submitted and not yet complete, with how many of each.
    outstanding: Arc<Mutex<HashMap<(u64, u64), u32>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Engine {
    /// Start the engine on the descriptor of the volume at `volume` (named in its logs),
    /// recording what it writes in `log` if any.
    pub fn start(volume: &Path, fd: RawFd, log: Option<Arc<WriteLog>>) -> std::io::Result<Engine> {
        let ring = IoUring::new(DEPTH as u32 * 2)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let queue = Arc::new(Mutex::new(Vec::new()));
        let pending = Arc::new(AtomicU64::new(0));
        let outstanding = Arc::new(Mutex::new(HashMap::new()));
        let (q, p, o) = (queue.clone(), pending.clone(), outstanding.clone());
        let thread = std::thread::Builder::new().name("exodisk-io".into()).spawn({
            let volume = volume.to_owned();
            move || run(ring, &volume, fd, log, rx, q, p, o)
        })?;
        Ok(Engine { tx: Mutex::new(Some(tx)), queue, pending, outstanding, thread: Mutex::new(Some(thread)) })
    }

    pub fn submit(&self, job: Job) {
        self.pending.fetch_add(1, Ordering::AcqRel);
        let range = (job.sector, job.sector + (job.buf.len / SECTOR) as u64);
        *self.outstanding.lock().entry(range).or_default() += 1;
        let sent = self.tx.lock().as_ref().map(|tx| tx.send(job));
        if let Some(Err(std::sync::mpsc::SendError(job))) = sent {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            done_with(&self.outstanding, range);
            (job.done)(-libc::ESHUTDOWN);
        }
    }

    /// Wait until no request submitted on any of `ranges` is still queued or in flight: what a
    /// deallocation gives up is then no longer written (or read) on behalf of its old owner
    /// once another owns it.
    pub fn wait_clear(&self, ranges: &[(u64, u64)]) {
        let busy = || self.outstanding.lock().keys().any(|&(a, b)| ranges.iter().any(|&(c, d)| a < d && c < b));
        while !ranges.is_empty() && busy() {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// Requests submitted and not yet complete (`POLL`).
    pub fn pending(&self) -> u64 {
        self.pending.load(Ordering::Acquire)
    }

    /// The queue as it stands, in the order it will be served.
    pub fn queue(&self) -> Vec<Queued> {
        self.queue.lock().clone()
    }

    /// Finish what was submitted and stop.
    pub fn stop(&self) {
        self.tx.lock().take();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Take one request's range out of the outstanding ones.
fn done_with(outstanding: &Mutex<HashMap<(u64, u64), u32>>, range: (u64, u64)) {
    let mut o = outstanding.lock();
    if let Some(n) = o.get_mut(&range) {
        *n -= 1;
        if *n == 0 {
            o.remove(&range);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    mut ring: IoUring,
    volume: &Path,
    fd: RawFd,
    log: Option<Arc<WriteLog>>,
    rx: Receiver<Job>,
    view: Arc<Mutex<Vec<Queued>>>,
    pending: Arc<AtomicU64>,
    outstanding: Arc<Mutex<HashMap<(u64, u64), u32>>>,
) {
    // Waiting requests by (sector, arrival), so C-LOOK is a range query.
    let mut waiting: BTreeMap<(u64, u64), Job> = BTreeMap::new();
    let mut in_flight: Vec<Option<Job>> = (0..DEPTH).map(|_| None).collect();
    let mut busy = 0usize;
    let mut head = 0u64;
    let mut arrival = 0u64;
    let mut open = true;
    loop {
        // Take what has arrived; sleep only when there is nothing to do.
        loop {
            let got = if busy == 0 && waiting.is_empty() && open {
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                rx.recv_timeout(Duration::ZERO)
            };
            match got {
                Ok(job) => {
                    arrival += 1;
                    waiting.insert((job.sector, arrival), job);
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if !open && busy == 0 && waiting.is_empty() {
            return;
        }
        // Dispatch in C-LOOK order.
        while busy < DEPTH {
            let key = match waiting.range((head, 0)..).next() {
                Some((k, _)) => *k,
                None => match waiting.keys().next() {
                    Some(k) => *k,
                    None => break,
                },
            };
            let job = waiting.remove(&key).expect("just seen");
            let slot = in_flight.iter().position(Option::is_none).expect("fewer than DEPTH in flight");
            let offset = job.sector * SECTOR as u64;
            let entry = if job.write {
                opcode::Write::new(types::Fd(fd), job.buf.ptr, job.buf.len as u32)
                    .offset(offset)
                    .rw_flags(if job.dsync { libc::RWF_DSYNC } else { 0 })
                    .build()
            } else {
                opcode::Read::new(types::Fd(fd), job.buf.ptr, job.buf.len as u32).offset(offset).build()
            };
            head = job.sector + (job.buf.len / SECTOR) as u64;
            in_flight[slot] = Some(job);
            // SAFETY: the buffer lives until the job completes (the job holds what keeps it).
            unsafe {
                ring.submission().push(&entry.user_data(slot as u64)).expect("the ring has room for DEPTH entries");
            }
            busy += 1;
        }
        *view.lock() = clook_order(&waiting, head);
        if busy == 0 {
            continue;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.raw_os_error() != Some(libc::EINTR) {
                tracing::error!("exodisk: {}: submitting to io_uring: {e}", volume.display());
            }
        }
        let done: Vec<(usize, i32)> = ring.completion().map(|c| (c.user_data() as usize, c.result())).collect();
        for (slot, result) in done {
            if let Some(job) = in_flight.get_mut(slot).and_then(Option::take) {
                busy -= 1;
                let result = if result >= 0 && result as usize != job.buf.len { -libc::EIO } else { result };
                if let (true, true, Some(log)) = (job.write, result >= 0, &log) {
                    // SAFETY: the job's buffer lives as long as the job.
                    log.write(job.sector, unsafe { std::slice::from_raw_parts(job.buf.ptr, job.buf.len) });
                    if job.dsync {
                        log.flush();
                    }
                }
                pending.fetch_sub(1, Ordering::AcqRel);
                // Its completion is sent before its sectors count as clear, so that a client
                // hears of it before the answer to a deallocation that waited for it.
                let range = (job.sector, job.sector + (job.buf.len / SECTOR) as u64);
                (job.done)(result);
                done_with(&outstanding, range);
            }
        }
    }
}

fn clook_order(waiting: &BTreeMap<(u64, u64), Job>, head: u64) -> Vec<Queued> {
    let view = |(_, j): (&(u64, u64), &Job)| (j.sector, (j.buf.len / SECTOR) as u32, j.client);
    waiting.range((head, 0)..).map(view).chain(waiting.range(..(head, 0)).map(view)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::Aligned;

    #[test]
    fn jobs_complete_through_io_uring() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let disk = crate::disk::Disk::open(&path, true).unwrap();
        let engine = Engine::start(&path, disk.fd(), None).unwrap();
        let buf = Arc::new(Mutex::new(Aligned::from_bytes(&[9u8; 4096])));
        let (tx, rx) = std::sync::mpsc::channel();
        for i in (0..16u64).rev() {
            let ptr = buf.lock().as_ptr() as *mut u8;
            let tx = tx.clone();
            engine.submit(Job {
                write: true,
                sector: i * 8,
                buf: Buffer { ptr, len: 4096, _keep: buf.clone() },
                dsync: i == 0,
                client: 1,
                done: Box::new(move |r| tx.send((i, r)).unwrap()),
            });
        }
        let results: Vec<(u64, i32)> = (0..16).map(|_| rx.recv().unwrap()).collect();
        assert!(results.iter().all(|(_, r)| *r == 4096), "{results:?}");
        assert_eq!(engine.pending(), 0);
        engine.stop();
        let mut back = Aligned::zeroed(4096);
        disk.read(120, &mut back).unwrap();
        assert_eq!(&back[..], &[9u8; 4096][..]);
    }
}
