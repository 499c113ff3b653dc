//! Progress of long work inside the stack (a mirror's resync or scrub), for whoever waits for it.
//!
//! A layer doing long work in an extended operation starts a [`Progress`] on the thread the
//! operation runs on and advances it; the control socket, which runs each operation on a thread
//! of its own, reads it by that thread ([`of_thread`]) and passes it to `plyfs op`, which draws a
//! progress bar.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::ThreadId;

use parking_lot::Mutex;

struct Meter {
    label: Mutex<String>,
    unit: &'static str,
    done: AtomicU64,
    total: AtomicU64,
}

fn registry() -> &'static Mutex<HashMap<ThreadId, Arc<Meter>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<ThreadId, Arc<Meter>>>> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Long work under way on this thread; it ends when dropped.
pub struct Progress(Arc<Meter>);

/// Start reporting `label`, `total` units of `unit` (`bytes`, `files`; a total of 0 is unknown).
pub fn start(label: &str, unit: &'static str, total: u64) -> Progress {
    let meter = Arc::new(Meter { label: Mutex::new(label.to_owned()), unit, done: AtomicU64::new(0), total: AtomicU64::new(total) });
    registry().lock().insert(std::thread::current().id(), meter.clone());
    Progress(meter)
}

impl Progress {
    pub fn add(&self, n: u64) {
        self.0.done.fetch_add(n, Ordering::Relaxed);
    }

    pub fn set_total(&self, total: u64) {
        self.0.total.store(total, Ordering::Relaxed);
    }

    pub fn set_label(&self, label: &str) {
        *self.0.label.lock() = label.to_owned();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        let mut reg = registry().lock();
        let id = std::thread::current().id();
        if reg.get(&id).is_some_and(|m| Arc::ptr_eq(m, &self.0)) {
            reg.remove(&id);
        }
    }
}

/// What a thread reports now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub label: String,
    pub unit: &'static str,
    pub done: u64,
    pub total: u64,
}

pub fn of_thread(id: ThreadId) -> Option<Snapshot> {
    let m = registry().lock().get(&id).cloned()?;
    let label = m.label.lock().clone();
    Some(Snapshot { label, unit: m.unit, done: m.done.load(Ordering::Relaxed), total: m.total.load(Ordering::Relaxed) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_by_thread_until_dropped() {
        let p = start("copy", "bytes", 10);
        p.add(4);
        let me = std::thread::current().id();
        assert_eq!(of_thread(me), Some(Snapshot { label: "copy".into(), unit: "bytes", done: 4, total: 10 }));
        let other = std::thread::spawn(|| std::thread::current().id()).join().unwrap();
        assert_eq!(of_thread(other), None);
        drop(p);
        assert_eq!(of_thread(me), None);
    }
}
