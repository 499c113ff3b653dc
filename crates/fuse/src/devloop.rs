//! The `/dev/fuse` loop. fuser agrees on features with the kernel (INIT); after that plyfs
//! reads the requests itself and decodes them as the io_uring transport does
//! ([`uring::dispatch`]).
//!
//! Why not fuser's loop: there every thread waits in `read`, and the kernel wakes waiters in
//! the order they came, so each request goes to the thread that has slept longest, often on the
//! other CPU and with cold caches. Here one thread at a time waits in `read`, the *reader*: it
//! answers what it reads and reads again, so the next request of a caller goes to the thread
//! that answered the last one. The other threads wait in user space and take the reader's
//! place when:
//! - a request comes while others wait to be read (`poll` says so): they are then read and
//!   answered in parallel;
//! - a request may take long (`fsync`): the reader gives its place up before it starts;
//! - a request has run for more than [`TICK`]: a watchdog gives its place away, so a lower that
//!   blocks holds up only the requests that need it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::fs::FuseFs;
use crate::uring::{dispatch, op, u32_at, u64_at, InHeader, IN_HEADER_SIZE};

/// How long a request may hold the reader's place before a spare thread reads the next one.
const TICK: Duration = Duration::from_millis(1);
/// Ticks without a request after which the watchdog sleeps until the next one.
const IDLE_TICKS: u32 = 500;
/// No thread holds the reader's place.
const FREE: usize = usize::MAX;
/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// Who may use the mount, checked on every request as fuser does: the kernel is told
/// `allow_other` for `allow_root` too, so the daemon turns other users away itself.
#[derive(Clone, Copy, Debug)]
pub struct Access {
    /// The user the daemon runs as.
    owner: u32,
    others: Others,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Others {
    /// Only the owner (the kernel enforces it as well).
    None,
    /// The owner and root (`allow_root`).
    Root,
    /// Everyone (`allow_other`).
    All,
}

impl Access {
    pub fn new(others: Others) -> Access {
        Access { owner: unsafe { libc::geteuid() }, others }
    }

    /// Whether the request in `h` may be served. Requests the kernel sends on its own behalf
    /// (page-cache reads and writes, releases, forgets) may carry any user and always are.
    pub(crate) fn allows(&self, h: &InHeader) -> bool {
        let uid = h.caller.uid;
        let user_ok = match self.others {
            Others::All => true,
            Others::Root => uid == self.owner || uid == 0,
            Others::None => uid == self.owner,
        };
        user_ok
            || matches!(
                h.opcode,
                op::READ
                    | op::WRITE
                    | op::READDIR
                    | op::READDIRPLUS
                    | op::FSYNC
                    | op::FSYNCDIR
                    | op::RELEASE
                    | op::RELEASEDIR
                    | op::FORGET
                    | op::BATCH_FORGET
                    | op::INTERRUPT
                    | op::DESTROY
            )
    }
}

/// The size of the operation's own header (`struct fuse_*_in`), which follows
/// `struct fuse_in_header`; names and data follow it. `None` for operations plyfs does not
/// serve.
fn op_header_size(opcode: u32) -> Option<usize> {
    Some(match opcode {
        op::LOOKUP | op::READLINK | op::SYMLINK | op::UNLINK | op::RMDIR | op::STATFS | op::REMOVEXATTR | op::DESTROY => 0,
        op::MKDIR | op::RENAME | op::LINK | op::OPEN | op::SETXATTR | op::GETXATTR | op::LISTXATTR | op::OPENDIR | op::ACCESS => 8,
        op::GETATTR | op::MKNOD | op::FSYNC | op::FSYNCDIR | op::CREATE | op::RENAME2 => 16,
        op::RELEASE | op::FLUSH | op::RELEASEDIR | op::LSEEK => 24,
        op::IOCTL | op::FALLOCATE => 32,
        op::READ | op::WRITE | op::READDIR | op::READDIRPLUS => 40,
        op::COPY_FILE_RANGE => 56,
        op::SETATTR => 88,
        _ => return None,
    })
}

/// Requests that may wait on the disk or the network for long: the reader hands its place
/// over before it serves them.
fn may_take_long(opcode: u32) -> bool {
    matches!(opcode, op::FSYNC | op::FSYNCDIR)
}

/// The reader's place, and the watchdog that frees it from a request that runs long.
///
/// `place` packs the thread holding it (or [`FREE`]) with whether that thread is serving a
/// request ([`BUSY`]) rather than waiting in `read`. A thread that has answered its request
/// takes the place from a busy holder at once, without waking anyone: so at most one thread
/// waits in `read`, and every other idle one waits in user space.
struct Reader {
    place: AtomicU64,
    lock: Mutex<()>,
    freed: Condvar,
    /// Requests read so far.
    begun: AtomicU64,
    ended: AtomicBool,
    /// The watchdog watches (it sleeps while the mount is idle).
    watching: AtomicBool,
    watchdog: Mutex<Option<Thread>>,
}

const BUSY: u64 = 1;

fn place(holder: usize, busy: bool) -> u64 {
    ((holder as u64) << 1) | u64::from(busy)
}

fn holder_of(place: u64) -> usize {
    if place >> 1 == (FREE as u64) >> 1 {
        FREE
    } else {
        (place >> 1) as usize
    }
}

impl Reader {
    fn new() -> Reader {
        Reader {
            place: AtomicU64::new(place(FREE, false)),
            lock: Mutex::new(()),
            freed: Condvar::new(),
            begun: AtomicU64::new(0),
            ended: AtomicBool::new(false),
            watching: AtomicBool::new(false),
            watchdog: Mutex::new(None),
        }
    }

    /// Take the place if it is free or its holder is busy. True if `me` holds it, idle.
    fn try_take(&self, me: usize) -> bool {
        let mut now = self.place.load(Ordering::Acquire);
        loop {
            let holder = holder_of(now);
            if holder == me {
                // Ours still: we served a request while holding it.
                if now & BUSY == 0 {
                    return true;
                }
            } else if holder != FREE && now & BUSY == 0 {
                // Another thread waits in `read`.
                return false;
            }
            match self.place.compare_exchange_weak(now, place(me, false), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(seen) => now = seen,
            }
        }
    }

    /// Take the place, waiting while another thread waits in `read`. False once the
    /// connection ended.
    fn take(&self, me: usize) -> bool {
        if self.try_take(me) {
            return !self.ended.load(Ordering::Acquire);
        }
        let mut guard = self.lock.lock();
        loop {
            if self.ended.load(Ordering::Acquire) {
                return false;
            }
            if self.try_take(me) {
                return true;
            }
            self.freed.wait(&mut guard);
        }
    }

    /// `me` read a request: it serves it, busy, and may be relieved of the place.
    fn begin(&self, me: usize) {
        let _ = self.place.compare_exchange(place(me, false), place(me, true), Ordering::AcqRel, Ordering::Acquire);
        // SeqCst with the watchdog's going to sleep: one of the two sees the other's store.
        self.begun.fetch_add(1, Ordering::SeqCst);
        if !self.watching.load(Ordering::SeqCst) {
            self.watching.store(true, Ordering::SeqCst);
            if let Some(t) = self.watchdog.lock().as_ref() {
                t.unpark();
            }
        }
    }

    /// Free the place if it is `seen`, and wake a thread waiting for it.
    fn give_up(&self, seen: u64) {
        if self.place.compare_exchange(seen, place(FREE, false), Ordering::AcqRel, Ordering::Acquire).is_ok() {
            // Under the lock: a thread that found the place taken is waiting by then.
            let _guard = self.lock.lock();
            self.freed.notify_one();
        }
    }

    fn end(&self) {
        self.ended.store(true, Ordering::Release);
        let guard = self.lock.lock();
        self.freed.notify_all();
        drop(guard);
        if let Some(t) = self.watchdog.lock().as_ref() {
            t.unpark();
        }
    }

    /// Every [`TICK`]: a holder that has served the same request since the last tick loses
    /// the place.
    fn watch(&self) {
        let mut last = u64::MAX;
        let mut idle = 0;
        while !self.ended.load(Ordering::Acquire) {
            if !self.watching.load(Ordering::SeqCst) {
                std::thread::park();
                continue;
            }
            std::thread::sleep(TICK);
            let begun = self.begun.load(Ordering::Relaxed);
            let now = self.place.load(Ordering::Acquire);
            let busy = now & BUSY != 0;
            if busy && begun == last {
                self.give_up(now);
            }
            idle = if begun == last && !busy { idle + 1 } else { 0 };
            if idle > IDLE_TICKS {
                self.watching.store(false, Ordering::SeqCst);
                // A request read meanwhile saw `watching` still set: look once more.
                if self.begun.load(Ordering::SeqCst) != begun {
                    self.watching.store(true, Ordering::SeqCst);
                }
                idle = 0;
            }
            last = begun;
        }
    }
}

/// One descriptor per thread: a clone of the connection's (`FUSE_DEV_IOC_CLONE`), whose
/// answers must go back through it, or the connection's own where `/dev/fuse` cannot be opened
/// (a user mounting through fusermount3).
fn channel(dev: RawFd) -> Option<OwnedFd> {
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just opened and is owned here.
    let clone = unsafe { OwnedFd::from_raw_fd(fd) };
    let source = dev as u32;
    (unsafe { libc::ioctl(clone.as_raw_fd(), DEV_IOC_CLONE, &source) } == 0).then_some(clone)
}

/// Serve the requests of connection `dev` with `threads` threads until the file system is
/// unmounted (`Ok`) or the connection fails.
pub fn run(fs: Arc<FuseFs>, access: Access, dev: RawFd, threads: usize, buffer_size: usize) -> io::Result<()> {
    let reader = Arc::new(Reader::new());
    let threads = threads.max(1);
    if threads > 1 {
        let r = reader.clone();
        let watchdog = std::thread::Builder::new().name("plyfs-fuse-watch".into()).spawn(move || r.watch())?;
        *reader.watchdog.lock() = Some(watchdog.thread().clone());
    }
    let mut handles: Vec<JoinHandle<io::Result<()>>> = Vec::with_capacity(threads);
    for me in 0..threads {
        let own = if me == 0 { None } else { channel(dev) };
        let (fs, reader) = (fs.clone(), reader.clone());
        let spawned = std::thread::Builder::new().name(format!("plyfs-fuse-{me}")).spawn(move || {
            let fd = own.as_ref().map_or(dev, |f| f.as_raw_fd());
            let result = serve(&fs, &access, fd, me, &reader, buffer_size);
            reader.end();
            result
        });
        match spawned {
            Ok(h) => handles.push(h),
            // Fewer threads serve; one is enough.
            Err(e) if me > 0 => {
                tracing::warn!("the /dev/fuse loop runs with {me} threads: cannot start more ({e})");
                break;
            }
            Err(e) => return Err(e),
        }
    }
    let mut result = Ok(());
    for h in handles {
        let r = h.join().unwrap_or_else(|_| Err(io::Error::other("a /dev/fuse thread panicked")));
        if result.is_ok() {
            result = r;
        }
    }
    reader.end();
    result
}

/// One thread: take the reader's place, serve while holding it, and wait for it again.
fn serve(fs: &FuseFs, access: &Access, fd: RawFd, me: usize, reader: &Reader, buffer_size: usize) -> io::Result<()> {
    let mut buf = vec![0u8; buffer_size];
    while reader.take(me) {
        loop {
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    // An interrupted request, a signal: read again.
                    Some(libc::ENOENT | libc::EINTR | libc::EAGAIN) => continue,
                    // Unmounted.
                    Some(libc::ENODEV) => return Ok(()),
                    _ => return Err(e),
                }
            }
            reader.begin(me);
            let n = n as usize;
            let opcode = if n >= IN_HEADER_SIZE { u32_at(&buf, 4) } else { 0 };
            if may_take_long(opcode) || pending(fd) {
                reader.give_up(place(me, true));
            }
            serve_one(fs, access, fd, &mut buf, n);
            if !reader.try_take(me) {
                break;
            }
        }
    }
    Ok(())
}

/// Whether more requests wait to be read.
fn pending(fd: RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
}

/// Answer the request in `buf[..n]` (forgets are not answered).
fn serve_one(fs: &FuseFs, access: &Access, fd: RawFd, buf: &mut [u8], n: usize) {
    if n < IN_HEADER_SIZE {
        tracing::error!("/dev/fuse gave a request of {n} bytes, shorter than its header; it is dropped");
        return;
    }
    let h = InHeader::parse(&buf[..IN_HEADER_SIZE]);
    let result = match h.opcode {
        // struct fuse_forget_in: nlookup.
        op::FORGET => {
            if n >= IN_HEADER_SIZE + 8 {
                fs.forget(h.nodeid, u64_at(buf, IN_HEADER_SIZE));
            }
            return;
        }
        // struct fuse_batch_forget_in: count; then count × struct fuse_forget_one.
        op::BATCH_FORGET => {
            let count = if n >= IN_HEADER_SIZE + 8 { u32_at(buf, IN_HEADER_SIZE) as usize } else { 0 };
            let ones = &buf[IN_HEADER_SIZE + 8..n];
            for one in ones.chunks_exact(16).take(count) {
                fs.forget(u64_at(one, 0), u64_at(one, 8));
            }
            return;
        }
        op::NOTIFY_REPLY => return,
        // Not supported: the kernel stops sending interrupts.
        op::INTERRUPT => Err(libc::ENOSYS),
        op::INIT => Err(libc::EIO),
        opcode => match op_header_size(opcode) {
            None => Err(libc::ENOSYS),
            Some(size) if n < IN_HEADER_SIZE + size => Err(libc::EIO),
            Some(size) => {
                // Copied: the answer is written over the request.
                let mut op_in = [0u8; 128];
                op_in[..size].copy_from_slice(&buf[IN_HEADER_SIZE..IN_HEADER_SIZE + size]);
                let payload = &mut buf[IN_HEADER_SIZE + size..];
                dispatch(fs, access, &h, &op_in, payload, n - IN_HEADER_SIZE - size).map(|len| (IN_HEADER_SIZE + size, len))
            }
        },
    };
    // struct fuse_out_header { u32 len; i32 error; u64 unique; }
    let (error, at, len) = match result {
        Ok((at, len)) => (0, at, len),
        Err(e) => (-e, 0, 0),
    };
    let mut out = [0u8; 16];
    out[0..4].copy_from_slice(&((16 + len) as u32).to_ne_bytes());
    out[4..8].copy_from_slice(&error.to_ne_bytes());
    out[8..16].copy_from_slice(&h.unique.to_ne_bytes());
    let iov = [
        libc::iovec { iov_base: out.as_mut_ptr().cast(), iov_len: 16 },
        libc::iovec { iov_base: buf[at..].as_mut_ptr().cast(), iov_len: len },
    ];
    if unsafe { libc::writev(fd, iov.as_ptr(), if len > 0 { 2 } else { 1 }) } < 0 {
        let e = io::Error::last_os_error();
        // ENOENT: the request was interrupted meanwhile; ENODEV: unmounted.
        if !matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENODEV)) {
            tracing::warn!("answering FUSE request {} (opcode {}): {e}", h.unique, h.opcode);
        }
    }
}
