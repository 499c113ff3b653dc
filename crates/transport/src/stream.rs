//! The byte streams the protocol runs over, and the addresses that name them.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where a stack is served: `unix:PATH` or `tcp:HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Addr {
    Unix(PathBuf),
    Tcp(String),
}

impl Addr {
    /// Parse `unix:PATH` or `tcp:HOST:PORT`; `None` if `s` has neither form.
    pub fn parse(s: &str) -> Option<Result<Addr, String>> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Some(Err(format!("{s}: no socket path after 'unix:'")));
            }
            return Some(Ok(Addr::Unix(PathBuf::from(path))));
        }
        let hostport = s.strip_prefix("tcp:")?;
        Some(match hostport.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(Addr::Tcp(hostport.to_owned())),
            _ => Err(format!("{s}: expected tcp:HOST:PORT")),
        })
    }

    /// The host name a TLS client checks the server's certificate against.
    pub fn host(&self) -> Option<&str> {
        match self {
            Addr::Unix(_) => None,
            Addr::Tcp(hp) => hp.rsplit_once(':').map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']')),
        }
    }
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Addr::Unix(p) => write!(f, "unix:{}", p.display()),
            Addr::Tcp(hp) => write!(f, "tcp:{hp}"),
        }
    }
}

/// A connection split into the halves that different threads use at once: one reads frames
/// while others write theirs.
pub struct Halves {
    pub reader: Box<dyn FrameRead>,
    pub writer: Box<dyn Write + Send>,
    pub control: Arc<dyn Control>,
}

/// The read half: bytes, and whether more can be had without waiting.
pub trait FrameRead: Read + Send {
    /// Bytes already received and not yet read (in a buffer, or decrypted).
    fn buffered(&self) -> bool;
    /// The socket, to poll.
    fn fd(&self) -> std::os::fd::RawFd;
}

impl<S: Read + Send + std::os::fd::AsRawFd> FrameRead for io::BufReader<S> {
    fn buffered(&self) -> bool {
        !self.buffer().is_empty()
    }
    fn fd(&self) -> std::os::fd::RawFd {
        self.get_ref().as_raw_fd()
    }
}

/// How long a reader polls for the next frame before it sleeps. A thread's wake-up can cost tens
/// of microseconds, more than a whole request; a reply usually comes sooner than that. (On this
/// project's 2-CPU test machine, 50 µs missed about one reply in three over TLS.)
pub fn spin_time() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        // On one CPU, polling only keeps the other side from running.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let default = if cpus > 1 { 100 } else { 0 };
        let us = std::env::var("PLYFS_SPIN_US").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        Duration::from_micros(us)
    })
}

/// How long one reader's frames took to come of late, which says whether polling before
/// sleeping pays: it does when they follow each other closely (a reply to a request just sent,
/// a stream of writes), and only takes a CPU that others need when they come far apart (a
/// client at work between its requests, as `ls -lR` is between directories for hundreds of
/// microseconds: a server polling after each reply took a fifth of two CPUs from it).
#[derive(Default)]
pub struct Gaps {
    /// A running average (each new wait weighs an eighth), of waits cut at [`Gaps::LONG`]
    /// times the spin time so that an idle minute does not stop the polling of a burst.
    typical_ns: std::sync::atomic::AtomicU64,
}

impl Gaps {
    const LONG: u32 = 4;

    /// How long to poll before sleeping: the spin time while frames come within it.
    pub fn spin(&self) -> Duration {
        let spin = spin_time();
        let typical = Duration::from_nanos(self.typical_ns.load(std::sync::atomic::Ordering::Relaxed));
        if typical <= spin {
            spin
        } else {
            Duration::ZERO
        }
    }

    /// A frame came after `waited`.
    pub fn came_after(&self, waited: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let waited_ns = waited.min(spin_time() * Self::LONG).as_nanos() as u64;
        let typical = self.typical_ns.load(Relaxed);
        self.typical_ns.store(typical - typical / 8 + waited_ns / 8, Relaxed);
    }
}

/// Between two polls: give the CPU to any thread that waits for it. On a busy machine that may
/// be the very thread (the peer, the process whose request this is) that the frame waits for;
/// a poll that only spun kept it from there, and one crossing over TLS took 140 µs rather than
/// 45 on two CPUs shared with other work. On an idle CPU this returns at once, as spinning did.
pub fn yield_now() {
    unsafe { libc::sched_yield() };
}

/// Wait until `r` has bytes to read: poll for as long as `gaps` says it pays, then sleep in
/// `poll(2)` until `deadline` (`None`: for ever). Returns whether there is something to read.
pub fn wait_readable(r: &dyn FrameRead, gaps: &Gaps, deadline: Option<std::time::Instant>) -> io::Result<bool> {
    if r.buffered() {
        gaps.came_after(Duration::ZERO);
        return Ok(true);
    }
    let start = std::time::Instant::now();
    let readable = poll_readable(r.fd(), gaps.spin(), deadline);
    if let Ok(true) = readable {
        gaps.came_after(start.elapsed());
    }
    readable
}

/// Whether `fd` became readable: polled for `spin`, then slept on until `deadline`.
fn poll_readable(fd: std::os::fd::RawFd, spin: Duration, deadline: Option<std::time::Instant>) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let start = std::time::Instant::now();
    loop {
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        if n != 0 {
            return if n > 0 { Ok(true) } else { Err(io::Error::last_os_error()) };
        }
        if start.elapsed() >= spin {
            break;
        }
        yield_now();
    }
    loop {
        let timeout = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Ok(false);
                }
                left.as_millis().clamp(1, i32::MAX as u128) as i32
            }
        };
        let n = unsafe { libc::poll(&mut pfd, 1, timeout) };
        match n {
            n if n > 0 => return Ok(true),
            0 if deadline.is_some() => {
                if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                    return Ok(false);
                }
            }
            0 => {}
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// What either side may do to a connection whatever its halves are doing.
pub trait Control: Send + Sync {
    /// End the connection: blocked reads and writes on it return.
    fn close(&self);
    /// Bound how long a read may wait (`None`: forever).
    fn set_read_timeout(&self, timeout: Option<Duration>);
}

/// A stream the protocol can run over.
pub trait Duplex: Send + 'static {
    fn split(self: Box<Self>) -> io::Result<Halves>;
}

/// A socket whose halves are clones of one descriptor.
trait Socket: Read + Write + Send + Sync + Sized + std::os::fd::AsRawFd + 'static {
    fn try_clone(&self) -> io::Result<Self>;
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl Socket for UnixStream {
    fn try_clone(&self) -> io::Result<Self> {
        UnixStream::try_clone(self)
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        UnixStream::shutdown(self, how)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
}

impl Socket for TcpStream {
    fn try_clone(&self) -> io::Result<Self> {
        TcpStream::try_clone(self)
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        TcpStream::shutdown(self, how)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
}

struct SocketControl<S>(S);

impl<S: Socket> Control for SocketControl<S> {
    fn close(&self) {
        let _ = self.0.shutdown(Shutdown::Both);
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) {
        let _ = self.0.set_read_timeout(timeout);
    }
}

fn split_socket<S: Socket>(s: S) -> io::Result<Halves> {
    let writer = s.try_clone()?;
    let control = s.try_clone()?;
    // Frames are written whole, with one vectored write: a buffer would only add a copy.
    Ok(Halves {
        reader: Box::new(io::BufReader::with_capacity(64 << 10, s)),
        writer: Box::new(writer),
        control: Arc::new(SocketControl(control)),
    })
}

impl Duplex for UnixStream {
    fn split(self: Box<Self>) -> io::Result<Halves> {
        split_socket(*self)
    }
}

impl Duplex for TcpStream {
    fn split(self: Box<Self>) -> io::Result<Halves> {
        let _ = self.set_nodelay(true);
        split_socket(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!(Addr::parse("unix:/run/x.sock"), Some(Ok(Addr::Unix("/run/x.sock".into()))));
        assert_eq!(Addr::parse("tcp:127.0.0.1:7000"), Some(Ok(Addr::Tcp("127.0.0.1:7000".into()))));
        assert_eq!(Addr::parse("tcp:[::1]:7000").unwrap().unwrap().host(), Some("::1"));
        assert!(matches!(Addr::parse("tcp:host"), Some(Err(_))));
        assert!(matches!(Addr::parse("unix:"), Some(Err(_))));
        assert_eq!(Addr::parse("/srv/dir"), None);
    }

    #[test]
    fn polling_stops_when_frames_come_far_apart_and_starts_again_when_they_come_close() {
        let gaps = Gaps::default();
        let spin = spin_time();
        assert_eq!(gaps.spin(), spin, "a new reader polls");
        // An hour idle weighs as little as a few long waits: a burst soon polls again.
        gaps.came_after(Duration::from_secs(3600));
        for _ in 0..30 {
            gaps.came_after(spin * 3);
        }
        if !spin.is_zero() {
            assert_eq!(gaps.spin(), Duration::ZERO, "frames far apart");
        }
        for _ in 0..20 {
            gaps.came_after(spin / 4);
        }
        assert_eq!(gaps.spin(), spin, "frames close together");
    }
}
