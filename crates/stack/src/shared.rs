//! Shared lowers (`-o shared`): several mounts, on one machine or on several sharing a
//! distributed file system, over one lower tree.
//!
//! A layer that keeps state about a lower file between operations (the index of an encoded
//! file) serialises its updates with the other mounts through a lock on the lower file, taken
//! with the extended operation `lower-lock` ([`lock`], [`unlock`]). The bottom layer answers it
//! with an open-file-description lock (`F_OFD_SETLKW`) on the lower file, which the local
//! kernel and NFS, GlusterFS and CephFS carry to every other client. A mount that dies loses its
//! locks with its descriptors.
//!
//! Within one process, locks are counted per owner: a layer under another one that holds the
//! lock (`zstd` over `crypt`, both encoding the same lower file) takes it again without
//! waiting. The owner is the calling thread, or what [`with_lock_owner`] says (a transport
//! server names the connection a request came from).

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::error::{Error, Result};
use crate::layer::{Invalidator, Level};
use crate::op::{Op, Reply};
use crate::types::{Caller, FileKind, NodeId};

/// The extended operation that locks a lower file.
pub const LOCK_OP: &str = "lower-lock";

/// How a mount shares its lowers with other mounts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedMode {
    /// How long state checked against the lower file may serve reads before it is checked
    /// again: the mount's attribute timeout, the staleness a user already accepts.
    pub revalidate: Duration,
}

static MODE: RwLock<Option<SharedMode>> = RwLock::new(None);

/// Set the process's sharing mode. A daemon serves one mount and sets it before building its
/// stack; layers read it when they are built.
pub fn set_mode(mode: Option<SharedMode>) {
    *MODE.write() = mode;
}

/// The process's sharing mode: `None` unless the mount was asked to share its lowers.
pub fn mode() -> Option<SharedMode> {
    *MODE.read()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LockKind {
    /// Readers: any number at once, no writer.
    Shared,
    /// One writer.
    Exclusive,
}

impl LockKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LockKind::Shared => "shared",
            LockKind::Exclusive => "exclusive",
        }
    }

    pub fn parse(s: &str) -> Option<LockKind> {
        match s {
            "shared" => Some(LockKind::Shared),
            "exclusive" => Some(LockKind::Exclusive),
            _ => None,
        }
    }
}

/// What `lower-lock` is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockRequest {
    pub kind: LockKind,
    /// Take a hold, or drop one.
    pub take: bool,
    /// Wait while someone else holds a conflicting lock, or fail at once (`EWOULDBLOCK`).
    pub wait: bool,
}

/// Parse `lower-lock`'s arguments: `[shared|exclusive]` to take, waiting; `[shared|exclusive,
/// try]` to take only if free at once; `[unlock, shared|exclusive]` to drop one hold.
pub fn parse_lock_args(args: &[String]) -> Result<LockRequest> {
    let bad = || Error::BadArgs(format!("{LOCK_OP}: expected shared|exclusive [try], or unlock shared|exclusive, got {args:?}"));
    let (kind, take, wait) = match args {
        [k] => (k, true, true),
        [k, t] if t == "try" => (k, true, false),
        [u, k] if u == "unlock" => (k, false, true),
        _ => return Err(bad()),
    };
    LockKind::parse(kind).map(|kind| LockRequest { kind, take, wait }).ok_or_else(bad)
}

/// Take `kind` of lock on the lower file of `node` (waiting for other mounts).
pub fn lock(level: &Level, node: NodeId, kind: LockKind) -> Result<()> {
    level.extended(&Caller::daemon(), node, LOCK_OP, &[kind.as_str().to_owned()]).map(|_| ())
}

/// Take `kind` of lock on the lower file of `node` if nobody else holds a conflicting one now:
/// whether it was taken.
pub fn try_lock(level: &Level, node: NodeId, kind: LockKind) -> Result<bool> {
    match level.extended(&Caller::daemon(), node, LOCK_OP, &[kind.as_str().to_owned(), "try".to_owned()]) {
        Ok(_) => Ok(true),
        Err(Error::Os(libc::EWOULDBLOCK)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Drop one hold of `kind` taken by [`lock`].
pub fn unlock(level: &Level, node: NodeId, kind: LockKind) -> Result<()> {
    level.extended(&Caller::daemon(), node, LOCK_OP, &["unlock".to_owned(), kind.as_str().to_owned()]).map(|_| ())
}

/// Renames that never replace what the new name holds (another mount sharing the tree may
/// have made it meanwhile): `RENAME_NOREPLACE`, or where the level refuses it (GlusterFS does;
/// remembered), a link and an unlink. A directory, which cannot be linked, is then renamed if
/// the name is free a moment before.
#[derive(Default)]
pub struct NoReplace {
    refused: AtomicBool,
}

impl NoReplace {
    /// Rename `from` (the object `node`, of kind `kind`) to `to` for `cx`, unless `to` exists
    /// (`EEXIST`).
    pub fn rename(
        &self,
        level: &Level,
        cx: &Caller,
        from: (NodeId, &OsStr),
        to: (NodeId, &OsStr),
        node: NodeId,
        kind: FileKind,
    ) -> Result<()> {
        if !self.refused.load(Ordering::Relaxed) {
            let rename = Op::Rename { parent: from.0, name: from.1, new_parent: to.0, new_name: to.1, flags: libc::RENAME_NOREPLACE };
            match level.call(cx, &rename) {
                Err(Error::Os(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) => self.refused.store(true, Ordering::Relaxed),
                other => return other.map(|_| ()),
            }
        }
        if kind == FileKind::Dir {
            if let Ok(e) = level.lookup(cx, to.0, to.1) {
                level.forget(cx, e.node, 1);
                return Err(Error::Os(libc::EEXIST));
            }
            let rename = Op::Rename { parent: from.0, name: from.1, new_parent: to.0, new_name: to.1, flags: 0 };
            return level.call(cx, &rename).map(|_| ());
        }
        if let Reply::Entry(e) = level.call(cx, &Op::Link { node, new_parent: to.0, new_name: to.1 })? {
            level.forget(&Caller::daemon(), e.node, 1);
        }
        level.unlink(cx, from.0, from.1)
    }
}

thread_local! {
    static OWNER: Cell<u64> = const { Cell::new(0) };
}

static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// Who holds the locks this thread takes: the thread itself unless [`with_lock_owner`] says
/// otherwise.
pub fn lock_owner() -> u64 {
    OWNER.with(|o| {
        if o.get() == 0 {
            o.set(NEXT_OWNER.fetch_add(1, Ordering::Relaxed) << 1);
        }
        o.get()
    })
}

/// A new owner to run requests under with [`with_lock_owner`] (a connection, say).
pub fn new_lock_owner() -> u64 {
    (NEXT_OWNER.fetch_add(1, Ordering::Relaxed) << 1) | 1
}

/// Run `f` with the locks it takes held by `owner`.
pub fn with_lock_owner<R>(owner: u64, f: impl FnOnce() -> R) -> R {
    let before = lock_owner();
    OWNER.with(|o| o.set(owner));
    struct Restore(u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            OWNER.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(before);
    f()
}

/// What a lock table does to the lower file itself.
pub trait LockFile: Send + Sync {
    /// Take the whole-file lock (or turn a read lock this file holds into a write lock): waiting
    /// for other processes if `wait`, else failing at once with `EWOULDBLOCK` if one holds it.
    fn take(&self, kind: LockKind, wait: bool) -> Result<()>;
    /// Drop the lock, which was of kind `held`.
    fn release(&self, held: LockKind) -> Result<()>;
}

/// Per-node locks of one bottom layer, counted per owner within the process, with the lower
/// file's own lock held while any owner holds one.
#[derive(Default)]
pub struct LockTable {
    nodes: Mutex<HashMap<NodeId, Arc<NodeLock>>>,
}

#[derive(Default)]
struct NodeLock {
    state: Mutex<NodeState>,
    changed: Condvar,
}

#[derive(Default)]
struct NodeState {
    file: Option<Arc<dyn LockFile>>,
    /// `(owner, exclusive holds, shared holds)`.
    holders: Vec<(u64, u32, u32)>,
    held: Option<LockKind>,
}

impl NodeState {
    fn others(&self, owner: u64) -> impl Iterator<Item = &(u64, u32, u32)> {
        self.holders.iter().filter(move |h| h.0 != owner)
    }
}

impl LockTable {
    /// Take `kind` for the calling owner. `file` opens what the lower lock is taken on, the
    /// first time the node is locked.
    pub fn lock(&self, node: NodeId, kind: LockKind, file: impl FnOnce() -> Result<Arc<dyn LockFile>>) -> Result<()> {
        self.lock_or_not(node, kind, true, file)
    }

    /// Like [`Self::lock`], but failing at once with `EWOULDBLOCK` where it would wait (for
    /// another owner here or another process) unless `wait`.
    pub fn lock_or_not(
        &self,
        node: NodeId,
        kind: LockKind,
        wait: bool,
        file: impl FnOnce() -> Result<Arc<dyn LockFile>>,
    ) -> Result<()> {
        let owner = lock_owner();
        let entry = self.nodes.lock().entry(node).or_default().clone();
        let mut st = entry.state.lock();
        if st.file.is_none() {
            st.file = Some(file()?);
        }
        loop {
            let mine = st.holders.iter().find(|h| h.0 == owner).copied();
            let blocked = match kind {
                LockKind::Exclusive => st.others(owner).next().is_some(),
                LockKind::Shared => mine.is_none() && st.others(owner).any(|h| h.1 > 0),
            };
            if !blocked {
                break;
            }
            if !wait {
                return Err(Error::Os(libc::EWOULDBLOCK));
            }
            entry.changed.wait(&mut st);
        }
        let mine = st.holders.iter().position(|h| h.0 == owner);
        let holds_exclusive = mine.is_some_and(|i| st.holders[i].1 > 0);
        if kind == LockKind::Exclusive && mine.is_some() && !holds_exclusive {
            // Turning a read lock into a write lock could wait forever on another process
            // doing the same: callers take the write lock first.
            return Err(Error::Os(libc::EDEADLK));
        }
        let need = match (kind, st.held) {
            (LockKind::Exclusive, Some(LockKind::Exclusive)) | (LockKind::Shared, Some(_)) => None,
            (k, _) => Some(k),
        };
        if let Some(k) = need {
            st.file.as_ref().expect("opened above").take(k, wait)?;
            st.held = Some(k);
        }
        match mine {
            Some(i) if kind == LockKind::Exclusive => st.holders[i].1 += 1,
            Some(i) => st.holders[i].2 += 1,
            None => st.holders.push((owner, u32::from(kind == LockKind::Exclusive), u32::from(kind == LockKind::Shared))),
        }
        Ok(())
    }

    /// Drop one hold of `kind` by the calling owner; the lower lock goes with the last one.
    pub fn unlock(&self, node: NodeId, kind: LockKind) -> Result<()> {
        let owner = lock_owner();
        let Some(entry) = self.nodes.lock().get(&node).cloned() else {
            return Err(Error::Os(libc::ENOLCK));
        };
        let mut st = entry.state.lock();
        let i = st.holders.iter().position(|h| h.0 == owner).ok_or(Error::Os(libc::ENOLCK))?;
        let h = &mut st.holders[i];
        let count = if kind == LockKind::Exclusive { &mut h.1 } else { &mut h.2 };
        if *count == 0 {
            return Err(Error::Os(libc::ENOLCK));
        }
        *count -= 1;
        if h.1 == 0 && h.2 == 0 {
            st.holders.swap_remove(i);
        }
        let result = match (st.holders.is_empty(), st.held.take()) {
            (true, Some(held)) => st.file.as_ref().map_or(Ok(()), |f| f.release(held)),
            (_, held) => {
                st.held = held;
                Ok(())
            }
        };
        entry.changed.notify_all();
        result
    }

    /// Forget the node's lock file once nobody holds it (the node is gone).
    pub fn forget(&self, node: NodeId) {
        let mut nodes = self.nodes.lock();
        if nodes.get(&node).is_some_and(|e| e.state.lock().holders.is_empty()) {
            nodes.remove(&node);
        }
    }
}

/// Invalidations of the front end's caches sent from a thread of their own: a layer learns
/// that another mount changed a file while it serves a request, when the front end may not be
/// told (see [`Invalidator`]).
#[derive(Default)]
pub struct LaterInvalidation {
    tx: Mutex<Option<std::sync::mpsc::Sender<NodeId>>>,
}

impl LaterInvalidation {
    /// Send from now on to `inv`.
    pub fn set(&self, inv: Arc<dyn Invalidator>) {
        let (tx, rx) = std::sync::mpsc::channel::<NodeId>();
        let spawned = std::thread::Builder::new().name("invalidate".into()).spawn(move || {
            for node in rx {
                inv.node(node);
            }
        });
        if spawned.is_ok() {
            *self.tx.lock() = Some(tx);
        }
    }

    /// The node's attributes and pages are stale.
    pub fn node(&self, node: NodeId) {
        if let Some(tx) = &*self.tx.lock() {
            let _ = tx.send(node);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[derive(Default)]
    struct Counted {
        sets: Mutex<Vec<Option<LockKind>>>,
    }

    impl LockFile for Counted {
        fn take(&self, kind: LockKind, _: bool) -> Result<()> {
            self.sets.lock().push(Some(kind));
            Ok(())
        }
        fn release(&self, _: LockKind) -> Result<()> {
            self.sets.lock().push(None);
            Ok(())
        }
    }

    #[test]
    fn one_owner_nests_and_the_lower_lock_follows_the_outermost() {
        let table = LockTable::default();
        let file = Arc::new(Counted::default());
        let f = file.clone();
        table.lock(NodeId(5), LockKind::Exclusive, move || Ok(f as Arc<dyn LockFile>)).unwrap();
        table.lock(NodeId(5), LockKind::Exclusive, || unreachable!()).unwrap();
        table.lock(NodeId(5), LockKind::Shared, || unreachable!()).unwrap();
        table.unlock(NodeId(5), LockKind::Shared).unwrap();
        table.unlock(NodeId(5), LockKind::Exclusive).unwrap();
        assert_eq!(*file.sets.lock(), [Some(LockKind::Exclusive)]);
        table.unlock(NodeId(5), LockKind::Exclusive).unwrap();
        assert_eq!(*file.sets.lock(), [Some(LockKind::Exclusive), None]);
        assert!(table.unlock(NodeId(5), LockKind::Exclusive).is_err());
    }

    #[test]
    fn a_read_lock_is_not_turned_into_a_write_lock() {
        let table = LockTable::default();
        table.lock(NodeId(1), LockKind::Shared, || Ok(Arc::new(Counted::default()) as Arc<dyn LockFile>)).unwrap();
        assert!(matches!(table.lock(NodeId(1), LockKind::Exclusive, || unreachable!()), Err(Error::Os(libc::EDEADLK))));
    }

    #[test]
    fn owners_exclude_each_other() {
        let table = Arc::new(LockTable::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (table, inside) = (table.clone(), inside.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        table.lock(NodeId(2), LockKind::Exclusive, || Ok(Arc::new(Counted::default()) as Arc<dyn LockFile>)).unwrap();
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
                        inside.fetch_sub(1, Ordering::SeqCst);
                        table.unlock(NodeId(2), LockKind::Exclusive).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // Readers share.
        table.lock(NodeId(3), LockKind::Shared, || Ok(Arc::new(Counted::default()) as Arc<dyn LockFile>)).unwrap();
        let t = {
            let table = table.clone();
            std::thread::spawn(move || {
                table.lock(NodeId(3), LockKind::Shared, || unreachable!()).unwrap();
                table.unlock(NodeId(3), LockKind::Shared).unwrap();
            })
        };
        t.join().unwrap();
        table.unlock(NodeId(3), LockKind::Shared).unwrap();
    }

    #[test]
    fn a_lock_tried_while_another_owner_holds_it_is_refused_at_once() {
        let table = Arc::new(LockTable::default());
        let file = || Ok(Arc::new(Counted::default()) as Arc<dyn LockFile>);
        table.lock(NodeId(4), LockKind::Shared, file).unwrap();
        let other = |kind| {
            let table = table.clone();
            std::thread::spawn(move || {
                let r = table.lock_or_not(NodeId(4), kind, false, || unreachable!());
                if r.is_ok() {
                    table.unlock(NodeId(4), kind).unwrap();
                }
                r
            })
            .join()
            .unwrap()
        };
        assert!(matches!(other(LockKind::Exclusive), Err(Error::Os(libc::EWOULDBLOCK))));
        assert!(other(LockKind::Shared).is_ok(), "readers share");
        table.unlock(NodeId(4), LockKind::Shared).unwrap();
        assert!(other(LockKind::Exclusive).is_ok(), "free again");
        for args in [&["exclusive", "try"][..], &["shared"], &["unlock", "shared"]] {
            let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            assert!(parse_lock_args(&args).is_ok(), "{args:?}");
        }
        assert_eq!(
            parse_lock_args(&["exclusive".into(), "try".into()]).unwrap(),
            LockRequest { kind: LockKind::Exclusive, take: true, wait: false }
        );
        assert!(parse_lock_args(&["try".into(), "exclusive".into()]).is_err());
    }

    #[test]
    fn an_owner_set_for_a_scope_is_restored() {
        let me = lock_owner();
        let other = new_lock_owner();
        assert_eq!(with_lock_owner(other, lock_owner), other);
        assert_eq!(lock_owner(), me);
    }
}
