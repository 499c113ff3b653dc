//! What keeps a service's memory bounded whatever its clients send (#28): how many connections it
//! takes (in all, and per client: a TCP address or a local user), a deadline for a whole
//! handshake, and a budget of bytes a connection may hold in flight. `plyfs serve` and the
//! exodisk service share them, so both hold the same bounds against the same attacks.
//!
//! None of this knows a protocol: a server asks [`Admission::admit`] before it reads a byte, reads
//! its handshake through a [`Deadline`], and takes [`ByteBudget`] permits before it allocates.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How many connections a server takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// In all.
    pub total: usize,
    /// From one client: one TCP address, or one local user (uid) on a Unix socket.
    pub per_client: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits { total: 256, per_client: 32 }
    }
}

/// The connections a server holds, counted in all and per client.
pub struct Admission<K: Eq + Hash + Clone + std::fmt::Display> {
    limits: ConnectionLimits,
    held: Arc<Mutex<Held<K>>>,
    log: RefusalLog<K>,
}

struct Held<K> {
    total: usize,
    per_client: HashMap<K, usize>,
}

/// One admitted connection: its place is given back when this is dropped.
pub struct Admitted<K: Eq + Hash + Clone> {
    key: K,
    held: Arc<Mutex<Held<K>>>,
}

impl<K: Eq + Hash + Clone> Drop for Admitted<K> {
    fn drop(&mut self) {
        let mut held = self.held.lock();
        held.total -= 1;
        if let Some(n) = held.per_client.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.per_client.remove(&self.key);
            }
        }
    }
}

impl<K: Eq + Hash + Clone + std::fmt::Display> Admission<K> {
    pub fn new(limits: ConnectionLimits) -> Self {
        Admission { limits, held: Arc::new(Mutex::new(Held { total: 0, per_client: HashMap::new() })), log: RefusalLog::new() }
    }

    /// A place for a connection from `client`, or the one-line reason it is refused. A refusal
    /// is logged, once per client and minute whatever the number of attempts.
    pub fn admit(&self, client: &K) -> Result<Admitted<K>, String> {
        let refused = {
            let mut held = self.held.lock();
            let mine = held.per_client.get(client).copied().unwrap_or(0);
            if held.total >= self.limits.total {
                Some(format!("the server has its maximum of {} connections; try again later", self.limits.total))
            } else if mine >= self.limits.per_client {
                Some(format!("{client} has its maximum of {} connections to this server", self.limits.per_client))
            } else {
                held.total += 1;
                *held.per_client.entry(client.clone()).or_insert(0) += 1;
                None
            }
        };
        match refused {
            None => Ok(Admitted { key: client.clone(), held: self.held.clone() }),
            Some(reason) => {
                self.log.refused(client, Refusal::OverLimit, &reason);
                Err(reason)
            }
        }
    }

    /// Log that `client` was refused for another reason (a failed handshake), under the same
    /// rule: once per client and minute.
    pub fn log_refusal(&self, client: &K, reason: &str) {
        self.log.refused(client, Refusal::Other, reason)
    }

    /// Connections held now.
    pub fn held(&self) -> usize {
        self.held.lock().total
    }
}

/// Why a client was refused, as far as the log is concerned: a client over the limits that
/// also fails handshakes has both said.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    OverLimit,
    Other,
}

/// Logs a refusal once per client, kind and minute, with how many more attempts it stood for:
/// a flood of connections must not become a flood of log lines.
pub struct RefusalLog<K> {
    seen: Mutex<HashMap<(K, Refusal), (Instant, u64)>>,
}

/// How often one client's refusals are logged.
const LOG_EVERY: Duration = Duration::from_secs(60);
/// Clients remembered; beyond this the oldest are forgotten (logged again if they come back).
const LOG_CLIENTS: usize = 1024;

impl<K: Eq + Hash + Clone + std::fmt::Display> RefusalLog<K> {
    pub fn new() -> Self {
        RefusalLog { seen: Mutex::new(HashMap::new()) }
    }

    pub fn refused(&self, client: &K, kind: Refusal, reason: &str) {
        let now = Instant::now();
        let mut seen = self.seen.lock();
        let key = (client.clone(), kind);
        match seen.get_mut(&key) {
            Some((at, more)) if now.duration_since(*at) < LOG_EVERY => *more += 1,
            Some((at, more)) => {
                tracing::warn!("client {client} refused: {reason} (and {more} more attempts in the last minute)");
                (*at, *more) = (now, 0);
            }
            None => {
                if seen.len() >= LOG_CLIENTS {
                    seen.retain(|_, (at, _)| now.duration_since(*at) < LOG_EVERY);
                    if seen.len() >= LOG_CLIENTS {
                        seen.clear();
                    }
                }
                tracing::warn!("client {client} refused: {reason}");
                seen.insert(key, (now, 0));
            }
        }
    }
}

impl<K: Eq + Hash + Clone + std::fmt::Display> Default for RefusalLog<K> {
    fn default() -> Self {
        Self::new()
    }
}

/// The end of a handshake: every read before it waits at most until then, so a peer that sends
/// a byte at a time is dropped at the deadline, not kept by each byte it sends.
#[derive(Clone, Copy, Debug)]
pub struct Deadline(pub Instant);

impl Deadline {
    pub fn after(timeout: Duration) -> Deadline {
        Deadline(Instant::now() + timeout)
    }

    /// The time left, or `TimedOut` when none is.
    pub fn left(&self) -> std::io::Result<Duration> {
        let left = self.0.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake took too long"))
        } else {
            Ok(left)
        }
    }
}

/// A reader that must be done by a deadline: before each read, `set_timeout` bounds the wait
/// to the time left, so a peer that trickles bytes is dropped at the deadline, not kept alive by
/// every byte it sends.
pub struct DeadlineRead<'a, R: ?Sized> {
    pub inner: &'a mut R,
    pub set_timeout: &'a dyn Fn(Duration) -> std::io::Result<()>,
    pub deadline: Deadline,
}

impl<R: std::io::Read + ?Sized> std::io::Read for DeadlineRead<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        (self.set_timeout)(self.deadline.left()?)?;
        match self.inner.read(buf) {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake took too long"))
            }
            other => other,
        }
    }
}

/// A bound on the bytes a connection holds: a reader takes a permit for a frame before it
/// allocates it, and waits while the connection holds the budget already (back-pressure: the
/// peer's sends then wait in its socket, not in our memory).
#[derive(Clone)]
pub struct ByteBudget(Arc<(Mutex<usize>, Condvar, usize)>);

/// Bytes of a [`ByteBudget`], given back when dropped.
pub struct Permit {
    budget: ByteBudget,
    bytes: usize,
}

impl ByteBudget {
    /// A budget of `bytes` (at least 1).
    pub fn new(bytes: usize) -> ByteBudget {
        ByteBudget(Arc::new((Mutex::new(0), Condvar::new(), bytes.max(1))))
    }

    pub fn capacity(&self) -> usize {
        self.0 .2
    }

    /// `bytes` of the budget, waiting until they are free. A request larger than the whole
    /// budget waits until nothing else is held, so one frame always gets through.
    pub fn take(&self, bytes: usize) -> Permit {
        let (used, freed, cap) = &*self.0;
        let mut used = used.lock();
        while *used > 0 && *used + bytes > *cap {
            freed.wait(&mut used);
        }
        *used += bytes;
        Permit { budget: self.clone(), bytes }
    }

    /// `bytes` without waiting, for what must not wait (a completion from a shared queue); the
    /// caller bounds these otherwise.
    pub fn force(&self, bytes: usize) -> Permit {
        *self.0 .0.lock() += bytes;
        Permit { budget: self.clone(), bytes }
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        *self.0 .0.lock()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let (used, freed, _) = &*self.budget.0;
        *used.lock() -= self.bytes;
        freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_counted_in_all_and_per_client() {
        let a = Admission::<u32>::new(ConnectionLimits { total: 3, per_client: 2 });
        let one = a.admit(&1).unwrap();
        let two = a.admit(&1).unwrap();
        assert!(a.admit(&1).err().unwrap().contains("maximum of 2"));
        let three = a.admit(&2).unwrap();
        assert!(a.admit(&3).err().unwrap().contains("maximum of 3"));
        drop(one);
        assert_eq!(a.held(), 2);
        let _again = a.admit(&3).unwrap();
        drop((two, three));
        assert_eq!(a.held(), 1);
    }

    #[test]
    fn a_budget_waits_for_what_it_lent() {
        let b = ByteBudget::new(10);
        let first = b.take(8);
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            let _p = b2.take(5);
            b2.used()
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(b.used(), 8, "the second waits");
        drop(first);
        assert_eq!(t.join().unwrap(), 5);
        // One frame larger than the budget still gets through alone.
        let big = b.take(100);
        assert_eq!(b.used(), 100);
        drop(big);
        assert_eq!(b.used(), 0);
    }
}
