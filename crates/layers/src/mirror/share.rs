//! Sharing the branches with other mounts (`-o shared`): the locks every mount honours (a
//! file's own, and `.plyfs-mirror.lock` for changes of names), telling the others which
//! branches failed (`.plyfs-mirror.failed`), and taking over the logs of mounts that stopped.
//! Why each change runs under such a lock is in the header of [`super`].

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use plyfs_stack::shared::{self, LockKind};
use plyfs_stack::{Entry, Error, FileKind, Level, NodeId, Result};

use super::log::{self, LOGS_DIR, LOG_NAME};
use super::{daemon, sync, Mirror};

/// With `-o shared`: the file at each branch's root whose lock guards changes of names.
pub(super) const LOCK_NAME: &str = ".plyfs-mirror.lock";
/// With `-o shared`: the names of branches a mount found failed, one per line, on the others.
pub(super) const FAILED_NAME: &str = ".plyfs-mirror.failed";
/// How often a shared mount looks for branches other mounts found failed.
const WATCH_EVERY: Duration = Duration::from_secs(1);
/// ... and for the logs of stopped mounts, in turns of [`WATCH_EVERY`].
const ADOPT_EVERY: u32 = 5;
/// An empty log younger than this may be a mount's that is starting: it is left alone.
const YOUNG: Duration = Duration::from_secs(60);

/// What sharing the branches with other mounts takes.
pub(super) struct Sharing {
    /// Each branch's [`LOCK_NAME`], once looked up (the lookup is held).
    lock_files: Mutex<Vec<Option<NodeId>>>,
    /// The size of each branch's [`FAILED_NAME`] when last read.
    failed_seen: Mutex<Vec<u64>>,
    stop: Mutex<bool>,
    wake: Condvar,
    watcher: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Sharing {
    pub(super) fn new(branches: usize) -> Sharing {
        Sharing {
            lock_files: Mutex::new(vec![None; branches]),
            failed_seen: Mutex::new(vec![0; branches]),
            stop: Mutex::new(false),
            wake: Condvar::new(),
            watcher: Mutex::new(None),
        }
    }
}

/// A lock on a branch's file, dropped with this.
pub(super) struct Locked<'a> {
    level: &'a Level,
    node: NodeId,
    kind: LockKind,
    /// The lookup of `node` was taken for the lock, and goes with it.
    forget: bool,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let _ = shared::unlock(self.level, self.node, self.kind);
        if self.forget {
            self.level.forget(&daemon(), self.node, 1);
        }
    }
}

impl Mirror {
    /// Take the lock of changes of names (on the reading branch), with `-o shared`.
    pub(super) fn lock_names(&self) -> Result<Option<Locked<'_>>> {
        self.lock_names_as(LockKind::Exclusive)
    }

    /// The names lock as `kind`: shared to look names up on every branch while no other mount
    /// is halfway through changing one.
    pub(super) fn lock_names_as(&self, kind: LockKind) -> Result<Option<Locked<'_>>> {
        let Some(sharing) = &self.sharing else { return Ok(None) };
        let r = self.reader()?;
        let top = self.top(r);
        let known = sharing.lock_files.lock()[r];
        let node = match known {
            Some(node) => node,
            None => {
                let name = OsStr::new(LOCK_NAME);
                let e = match top.lookup(&daemon(), NodeId::ROOT, name) {
                    Err(Error::Os(libc::ENOENT)) => match top.create(&daemon(), NodeId::ROOT, name, 0o600, libc::O_RDWR) {
                        Ok((e, o)) => {
                            let _ = top.release(&daemon(), e.node, o.fh);
                            e
                        }
                        // Another mount made it meanwhile.
                        Err(Error::Os(libc::EEXIST)) => top.lookup(&daemon(), NodeId::ROOT, name)?,
                        Err(e) => return Err(e),
                    },
                    other => other?,
                };
                let mut files = sharing.lock_files.lock();
                match files[r] {
                    Some(node) => {
                        top.forget(&daemon(), e.node, 1);
                        node
                    }
                    None => *files[r].insert(e.node),
                }
            }
        };
        shared::lock(top, node, kind)?;
        Ok(Some(Locked { level: top, node, kind, forget: false }))
    }

    /// With `-o shared`, the lock of object `id` that every mount honours: a file's own, or the
    /// names lock for other objects.
    pub(super) fn lock_object(&self, id: NodeId) -> Result<Option<Locked<'_>>> {
        if self.sharing.is_none() {
            return Ok(None);
        }
        let file = self.nodes.lock().nodes.get(&id.0).is_some_and(|n| n.kind == FileKind::File);
        if !file {
            return self.lock_names();
        }
        let r = self.reader()?;
        let node = self.resolve(id, r)?;
        match shared::lock(self.top(r), node, LockKind::Exclusive) {
            Ok(()) => Ok(Some(Locked { level: self.top(r), node, kind: LockKind::Exclusive, forget: false })),
            // A file the daemon may not open for writing (a write lock needs that): its
            // attributes change under the names lock instead, which every mount takes too
            // for such a file.
            Err(Error::Os(libc::EBADF | libc::EACCES | libc::EPERM)) => self.lock_names(),
            Err(e) => Err(e),
        }
    }

    /// Lock the file at `path` on branch `r`, if it is one, with `-o shared`.
    pub(super) fn lock_path(&self, r: usize, path: &str) -> Result<Option<Locked<'_>>> {
        if self.sharing.is_none() {
            return Ok(None);
        }
        let top = self.top(r);
        let Some(e) = sync::find(top, path)? else { return Ok(None) };
        if e.attr.kind != FileKind::File {
            top.forget(&daemon(), e.node, 1);
            return Ok(None);
        }
        if let Err(err) = shared::lock(top, e.node, LockKind::Exclusive) {
            top.forget(&daemon(), e.node, 1);
            return Err(err);
        }
        Ok(Some(Locked { level: top, node: e.node, kind: LockKind::Exclusive, forget: true }))
    }

    /// Tell the other mounts that branch `b` failed: its name goes into [`FAILED_NAME`] on every
    /// branch still in sync.
    pub(super) fn publish_failed(&self, b: usize) {
        let line = format!("{}\n", self.branches[b].branch.name);
        for c in self.in_sync() {
            let top = self.top(c);
            let name = OsStr::new(FAILED_NAME);
            let appended = (|| {
                let (e, fh) = match top.lookup(&daemon(), NodeId::ROOT, name) {
                    Ok(e) => (e, top.open(&daemon(), e.node, libc::O_RDWR).inspect_err(|_| top.forget(&daemon(), e.node, 1))?.fh),
                    Err(Error::Os(libc::ENOENT)) => {
                        let (e, o) = top.create(&daemon(), NodeId::ROOT, name, 0o644, libc::O_RDWR)?;
                        (e, o.fh)
                    }
                    Err(e) => return Err(e),
                };
                let result = shared::lock(top, e.node, LockKind::Exclusive).and_then(|()| {
                    let written =
                        top.getattr(&daemon(), e.node).and_then(|a| top.write(&daemon(), e.node, fh, a.size, line.as_bytes()));
                    let _ = shared::unlock(top, e.node, LockKind::Exclusive);
                    written
                });
                let _ = top.release(&daemon(), e.node, fh);
                top.forget(&daemon(), e.node, 1);
                result
            })();
            if let Err(e) = appended {
                tracing::warn!(
                    "mirror '{}': could not tell other mounts on branch '{}' that branch '{}' failed: {e}",
                    self.name,
                    self.branches[c].branch.name,
                    self.branches[b].branch.name
                );
            }
        }
    }

    /// Leave out the branches other mounts found failed (named in [`FAILED_NAME`] on a branch
    /// in sync here).
    pub(super) fn watch_failed(&self) {
        let Some(sharing) = &self.sharing else { return };
        for c in self.in_sync() {
            let top = self.top(c);
            let name = OsStr::new(FAILED_NAME);
            let size = match top.lookup(&daemon(), NodeId::ROOT, name) {
                Ok(e) => {
                    top.forget(&daemon(), e.node, 1);
                    e.attr.size
                }
                Err(_) => 0,
            };
            if std::mem::replace(&mut sharing.failed_seen.lock()[c], size) == size || size == 0 {
                continue;
            }
            let Ok(text) = top.read_small_file(&daemon(), NodeId::ROOT, name, 1 << 20) else { continue };
            for line in String::from_utf8_lossy(&text).lines() {
                if let Some(b) = self.branches.iter().position(|br| br.branch.name == line) {
                    if !self.is_failed(b) {
                        let why = Error::BadArgs(format!(
                            "another mount found it failed (see {FAILED_NAME} on '{}')",
                            self.branches[c].branch.name
                        ));
                        self.fail_as(b, &why, false);
                    }
                }
            }
        }
    }

    /// After a resync: [`FAILED_NAME`] names only the branches still failed, on every branch.
    pub(super) fn rewrite_failed(&self) -> Result<()> {
        let text: String =
            (0..self.branches.len()).filter(|b| self.is_failed(*b)).map(|b| format!("{}\n", self.branches[b].branch.name)).collect();
        for c in self.in_sync() {
            let top = self.top(c);
            let e = match top.lookup(&daemon(), NodeId::ROOT, OsStr::new(FAILED_NAME)) {
                Ok(e) => e,
                Err(Error::Os(libc::ENOENT)) => continue,
                Err(e) => return Err(e),
            };
            let result = (|| {
                let o = top.open(&daemon(), e.node, libc::O_RDWR | libc::O_TRUNC)?;
                let written = if text.is_empty() { Ok(0) } else { top.write(&daemon(), e.node, o.fh, 0, text.as_bytes()) };
                let _ = top.release(&daemon(), e.node, o.fh);
                written.map(|_| ())
            })();
            top.forget(&daemon(), e.node, 1);
            result?;
            if let Some(sharing) = &self.sharing {
                sharing.failed_seen.lock()[c] = text.len() as u64;
            }
        }
        Ok(())
    }

    /// Take over the logs of stopped mounts (their lock is free): what they had in flight is
    /// made the same on every branch, what they found failed and stale is this mount's now,
    /// and their logs go. Returns how many other mounts are running. An unshared mount refuses
    /// to run beside a shared one.
    pub(super) fn adopt(&self) -> Result<usize> {
        let own = OsStr::new(self.log.own_name());
        // `(in LOGS_DIR, name)`; at the root, a mount's log from before it was shared.
        let mut logs: BTreeSet<(bool, OsString)> = BTreeSet::new();
        for b in self.in_sync() {
            let top = self.top(b);
            if self.sharing.is_some() {
                if let Ok(e) = top.lookup(&daemon(), NodeId::ROOT, OsStr::new(LOG_NAME)) {
                    top.forget(&daemon(), e.node, 1);
                    logs.insert((false, LOG_NAME.into()));
                }
            }
            let Ok(dir) = top.lookup(&daemon(), NodeId::ROOT, OsStr::new(LOGS_DIR)) else { continue };
            if let Ok(entries) = top.list_dir(&daemon(), dir.node) {
                logs.extend(entries.into_iter().filter(|e| e.name != own).map(|e| (true, e.name)));
            }
            top.forget(&daemon(), dir.node, 1);
        }
        let mut running = 0;
        for (in_dir, name) in logs {
            if !self.adopt_one(in_dir, &name)? {
                running += 1;
            }
        }
        Ok(running)
    }

    /// Take over one other log (in [`LOGS_DIR`] or at the root) if its mount stopped: whether it
    /// did (or the log needed nothing).
    fn adopt_one(&self, in_dir: bool, name: &OsStr) -> Result<bool> {
        // `(branch, directory, the log there)`.
        let mut copies: Vec<(usize, NodeId, Entry)> = Vec::new();
        let mut dirs: Vec<(usize, NodeId)> = Vec::new();
        let mut locked: Vec<Locked<'_>> = Vec::new();
        let mut running = false;
        for b in self.in_sync() {
            let top = self.top(b);
            let dir = if in_dir {
                let Ok(d) = top.lookup(&daemon(), NodeId::ROOT, OsStr::new(LOGS_DIR)) else { continue };
                dirs.push((b, d.node));
                d.node
            } else {
                NodeId::ROOT
            };
            let Ok(e) = top.lookup(&daemon(), dir, name) else { continue };
            copies.push((b, dir, e));
            match shared::try_lock(top, e.node, LockKind::Exclusive) {
                Ok(true) => locked.push(Locked { level: top, node: e.node, kind: LockKind::Exclusive, forget: false }),
                Ok(false) => running = true,
                // A lower without locks: nothing tells a running mount from a stopped one. A
                // shared mount leaves the log be; an unshared one was told it is alone.
                Err(_) => running = self.sharing.is_some(),
            }
        }
        let shown = if in_dir { format!("{LOGS_DIR}/{}", name.to_string_lossy()) } else { name.to_string_lossy().into_owned() };
        let result = (|| {
            if running {
                if self.sharing.is_none() {
                    return Err(Error::config(format!(
                        "mirror '{}': another mount is using this mirror with -o shared (its log {shown} is locked); mount with -o shared too",
                        self.name
                    )));
                }
                return Ok(false);
            }
            let empty = copies.iter().all(|(_, _, e)| e.attr.size == 0);
            let young = copies.iter().any(|(_, _, e)| e.attr.mtime.elapsed().map_or(true, |age| age < YOUNG));
            if copies.is_empty() || (empty && young) {
                return Ok(true);
            }
            let places: Vec<(Level, NodeId)> = copies.iter().map(|(b, dir, _)| (self.top(*b).clone(), *dir)).collect();
            let names: Vec<String> = self.branches.iter().map(|b| b.branch.name.clone()).collect();
            let said = log::read_copies(&places, name, &names)?;
            let failed = said.failed.iter().filter(|f| **f).count();
            if !said.in_flight.is_empty() || failed > 0 {
                tracing::warn!(
                    "mirror '{}': taking over the log {shown} of a mount that stopped: {} changes in flight, {failed} branches failed",
                    self.name,
                    said.in_flight.len(),
                );
            }
            // Noted here before the log goes, so a crash meanwhile loses nothing.
            for (b, failed) in said.failed.iter().enumerate() {
                if *failed && !self.is_failed(b) {
                    self.fail_as(b, &Error::BadArgs(format!("it failed in a mount that stopped (log {shown})")), true);
                }
                if !said.stale[b].is_empty() {
                    self.note(self.log.stale(b, &said.stale[b].iter().cloned().collect::<Vec<_>>()));
                }
            }
            for p in &said.in_flight {
                self.note(self.log.begin(p));
            }
            self.note(self.log.sync());
            for (b, dir, _) in &copies {
                self.top(*b).unlink(&daemon(), *dir, name)?;
            }
            self.recover(&said.in_flight)?;
            Ok(true)
        })();
        drop(locked);
        for (b, _, e) in copies {
            self.top(b).forget(&daemon(), e.node, 1);
        }
        for (b, dir) in dirs {
            self.top(b).forget(&daemon(), dir, 1);
        }
        result
    }

    /// With `-o shared`, a thread that looks every [`WATCH_EVERY`] for branches other mounts
    /// found failed, and now and then for logs of stopped mounts.
    pub(super) fn start_watch(self: &Arc<Self>) {
        let Some(sharing) = &self.sharing else { return };
        let weak: Weak<Mirror> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("mirror-watch".into()).spawn(move || {
            let mut turn = 0u32;
            loop {
                let Some(m) = weak.upgrade() else { return };
                let Some(sharing) = &m.sharing else { return };
                {
                    let mut stop = sharing.stop.lock();
                    if !*stop {
                        sharing.wake.wait_for(&mut stop, WATCH_EVERY);
                    }
                    if *stop {
                        return;
                    }
                }
                m.watch_failed();
                turn += 1;
                if turn.is_multiple_of(ADOPT_EVERY) {
                    if let Err(e) = m.adopt() {
                        tracing::warn!("mirror '{}': taking over the logs of stopped mounts: {e}", m.name);
                    }
                }
            }
        });
        match spawned {
            Ok(handle) => *sharing.watcher.lock() = Some(handle),
            Err(e) => tracing::warn!("mirror '{}': no thread to watch other mounts: {e}", self.name),
        }
    }

    /// Whether this is the only mount running: `resync` and `scrub`, which compare and copy,
    /// must not race other mounts' changes.
    pub(super) fn require_alone(&self, what: &str) -> Result<()> {
        if self.sharing.is_none() {
            return Ok(());
        }
        match self.adopt()? {
            0 => Ok(()),
            n => Err(Error::BadArgs(format!(
                "{what}: {n} other mount(s) of this mirror are running; {what} compares and copies what they may be changing, so it runs only where no other mount does"
            ))),
        }
    }

    /// At shutdown: stop the watching thread and let go of the lock files.
    pub(super) fn stop_sharing(&self) {
        let Some(sharing) = &self.sharing else { return };
        *sharing.stop.lock() = true;
        sharing.wake.notify_all();
        if let Some(h) = sharing.watcher.lock().take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        let files = std::mem::take(&mut *sharing.lock_files.lock());
        for (b, node) in files.into_iter().enumerate() {
            if let Some(node) = node {
                self.top(b).forget(&daemon(), node, 1);
            }
        }
    }
}
