//! Bringing branches back in line: `resync` copies the paths the write-intent log noted while a
//! branch was failed; `scrub` compares every object and repairs what differs. Both copy from
//! the branch that serves reads, and every copy is made whole under a temporary name before it
//! replaces anything ([`crate::transfer`]).

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::sync::atomic::Ordering;

use plyfs_stack::{progress, Attr, Caller, Entry, Error, FileKind, Level, NodeId, Op, Reply, Result, XattrReply};
use serde_json::{json, Value};

use super::Mirror;
use crate::transfer::{copy_data, copy_meta, copy_object, Data};

fn daemon() -> Caller {
    Caller::daemon()
}

/// Lookups taken while walking a level, dropped at the end.
struct Held<'a> {
    level: &'a Level,
    nodes: Vec<NodeId>,
}

impl<'a> Held<'a> {
    fn new(level: &'a Level) -> Held<'a> {
        Held { level, nodes: Vec::new() }
    }

    fn lookup(&mut self, dir: NodeId, name: &OsStr) -> Result<Option<Entry>> {
        match self.level.lookup(&daemon(), dir, name) {
            Ok(e) => {
                self.nodes.push(e.node);
                Ok(Some(e))
            }
            Err(Error::Os(libc::ENOENT)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        for n in self.nodes.drain(..) {
            self.level.forget(&daemon(), n, 1);
        }
    }
}

fn components(path: &str) -> Vec<&OsStr> {
    path.split('/').filter(|c| !c.is_empty()).map(OsStr::new).collect()
}

/// The object at `path` on `level`, if there is one (its lookup is the caller's to forget).
pub(super) fn find(level: &Level, path: &str) -> Result<Option<Entry>> {
    let mut held = Held::new(level);
    let mut at = NodeId::ROOT;
    let parts = components(path);
    let Some((name, dirs)) = parts.split_last() else { return Ok(None) };
    for dir in dirs {
        match held.lookup(at, dir)? {
            Some(e) if e.attr.kind == FileKind::Dir => at = e.node,
            _ => return Ok(None),
        }
    }
    Ok(held.lookup(at, name)?.inspect(|_| {
        held.nodes.pop();
    }))
}

/// The names of a directory, without what the mirror keeps for itself.
fn listing(m: &Mirror, level: &Level, dir: NodeId) -> Result<Vec<(OsString, FileKind)>> {
    Ok(level.list_dir(&daemon(), dir)?.into_iter().filter(|e| !m.hidden(dir, &e.name)).map(|e| (e.name, e.kind)).collect())
}

/// Whether two files hold the same bytes.
fn same_data(a: &Level, an: NodeId, b: &Level, bn: NodeId) -> Result<bool> {
    let cx = daemon();
    let fa = a.open(&cx, an, libc::O_RDONLY)?;
    let fb = match b.open(&cx, bn, libc::O_RDONLY) {
        Ok(f) => f,
        Err(e) => {
            let _ = a.release(&cx, an, fa.fh);
            return Err(e);
        }
    };
    let result = (|| {
        let mut offset = 0;
        loop {
            let (da, db) = (a.read(&cx, an, fa.fh, offset, 1 << 20)?, b.read(&cx, bn, fb.fh, offset, 1 << 20)?);
            if da != db {
                return Ok(false);
            }
            if da.is_empty() {
                return Ok(true);
            }
            offset += da.len() as u64;
        }
    })();
    let _ = a.release(&cx, an, fa.fh);
    let _ = b.release(&cx, bn, fb.fh);
    result
}

fn xattrs(level: &Level, node: NodeId) -> Vec<(Vec<u8>, Vec<u8>)> {
    let cx = daemon();
    let names = match level.call(&cx, &Op::ListXattr { node, size: 65536 }) {
        Ok(Reply::Xattr(XattrReply::Data(d))) => d,
        _ => return Vec::new(),
    };
    let mut out: Vec<(Vec<u8>, Vec<u8>)> = names
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .filter_map(|n| {
            let name = <OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(n);
            match level.call(&cx, &Op::GetXattr { node, name, size: 65536 }) {
                Ok(Reply::Xattr(XattrReply::Data(v))) => Some((n.to_vec(), v)),
                _ => None,
            }
        })
        .collect();
    out.sort();
    out
}

/// Whether the metadata a copy keeps is the same (times differ between branches by nature).
fn same_meta(a: &Attr, b: &Attr) -> bool {
    a.kind == b.kind && a.perm == b.perm && a.uid == b.uid && a.gid == b.gid && (a.kind != FileKind::File || a.size == b.size)
}

impl Mirror {
    /// Make `path` on branch `b` what it is on branch `a`. A directory's own metadata and its
    /// list of names are made the same; what it holds is copied only where `b` lacks it.
    /// Returns the bytes copied.
    pub(super) fn sync_path(&self, a: usize, b: usize, path: &str, data: Data) -> Result<u64> {
        let (la, lb) = (self.top(a), self.top(b));
        let (mut ha, mut hb) = (Held::new(la), Held::new(lb));
        let parts = components(path);
        let Some((name, dirs)) = parts.split_last() else {
            // The root: its metadata and its names.
            let (aa, ab) = (la.getattr(&daemon(), NodeId::ROOT)?, lb.getattr(&daemon(), NodeId::ROOT)?);
            if !same_meta(&aa, &ab) {
                copy_meta(la, NodeId::ROOT, lb, NodeId::ROOT, &aa, |_| true)?;
            }
            return self.reconcile(la, NodeId::ROOT, lb, NodeId::ROOT, data);
        };
        let (mut da, mut db) = (NodeId::ROOT, NodeId::ROOT);
        let mut copied = 0;
        for (i, dir) in dirs.iter().enumerate() {
            let Some(ea) = ha.lookup(da, dir)?.filter(|e| e.attr.kind == FileKind::Dir) else {
                // Gone on the reading branch too: the whole path goes on `b`.
                return self.sync_path(a, b, &dirs[..=i].iter().map(|c| c.to_string_lossy()).collect::<Vec<_>>().join("/"), data);
            };
            let eb = match hb.lookup(db, dir)? {
                Some(e) if e.attr.kind == FileKind::Dir => e,
                _ => {
                    let prefix = dirs[..=i].iter().map(|c| c.to_string_lossy()).collect::<Vec<_>>().join("/");
                    copied += self.sync_path(a, b, &prefix, data)?;
                    hb.lookup(db, dir)?.ok_or(Error::Os(libc::EIO))?
                }
            };
            (da, db) = (ea.node, eb.node);
        }
        let ea = ha.lookup(da, name)?;
        let eb = hb.lookup(db, name)?;
        copied += match (ea, eb) {
            (None, None) => 0,
            (None, Some(eb)) => {
                self.remove_tree(lb, db, name, eb.attr.kind)?;
                0
            }
            (Some(ea), Some(eb)) if ea.attr.kind == FileKind::Dir && eb.attr.kind == FileKind::Dir => {
                if !same_meta(&ea.attr, &eb.attr) || xattrs(la, ea.node) != xattrs(lb, eb.node) {
                    copy_meta(la, ea.node, lb, eb.node, &ea.attr, |_| true)?;
                }
                self.reconcile(la, ea.node, lb, eb.node, data)?
            }
            (Some(ea), Some(eb))
                if ea.attr.kind == FileKind::File
                    && eb.attr.kind == FileKind::File
                    && ea.attr.size == eb.attr.size
                    && same_data(la, ea.node, lb, eb.node)? =>
            {
                if !same_meta(&ea.attr, &eb.attr) || xattrs(la, ea.node) != xattrs(lb, eb.node) {
                    copy_meta(la, ea.node, lb, eb.node, &ea.attr, |_| true)?;
                }
                0
            }
            // Other mounts sharing the branches may hold the file open: its bytes are replaced,
            // not the file.
            (Some(ea), Some(eb)) if self.sharing.is_some() && ea.attr.kind == FileKind::File && eb.attr.kind == FileKind::File => {
                match rewrite_file(la, &ea, lb, &eb, data)? {
                    Some(copied) => copied,
                    // Not writable as it is: replaced after all.
                    None => self.copy_tree(la, ea, lb, db, name, data)?,
                }
            }
            (Some(ea), eb) => {
                if let Some(eb) = eb.filter(|e| e.attr.kind == FileKind::Dir) {
                    // A copy cannot be renamed over a directory.
                    self.remove_tree(lb, db, name, eb.attr.kind)?;
                }
                self.copy_tree(la, ea, lb, db, name, data)?
            }
        };
        Ok(copied)
    }

    /// Make the names in `db` those of `da`: remove extra ones, copy missing ones.
    fn reconcile(&self, la: &Level, da: NodeId, lb: &Level, db: NodeId, data: Data) -> Result<u64> {
        self.remove_leftovers(lb, db)?;
        let names_a: BTreeSet<OsString> = listing(self, la, da)?.into_iter().map(|(n, _)| n).collect();
        let mut copied = 0;
        for (name, kind) in listing(self, lb, db)? {
            if !names_a.contains(&name) {
                self.remove_tree(lb, db, &name, kind)?;
            }
        }
        let names_b: BTreeSet<OsString> = listing(self, lb, db)?.into_iter().map(|(n, _)| n).collect();
        let mut ha = Held::new(la);
        for name in names_a.difference(&names_b) {
            if let Some(ea) = ha.lookup(da, name)? {
                copied += self.copy_tree(la, ea, lb, db, name, data)?;
            }
        }
        Ok(copied)
    }

    /// Copy `ea` of `la` as `name` into `dir` of `lb`, a directory with all it holds, made whole
    /// under a temporary name first.
    fn copy_tree(&self, la: &Level, ea: Entry, lb: &Level, dir: NodeId, name: &OsStr, data: Data) -> Result<u64> {
        let mut copied = 0;
        let made = self.temps.place(lb, dir, name, |temp| {
            let e = copy_object(la, ea.node, &ea.attr, lb, dir, temp, data)?;
            if ea.attr.kind == FileKind::Dir {
                let mut ha = Held::new(la);
                for (child, _) in listing(self, la, ea.node)? {
                    if let Some(ec) = ha.lookup(ea.node, &child)? {
                        copied += self.copy_tree(la, ec, lb, e.node, &child, data)?;
                    }
                }
            } else if ea.attr.kind == FileKind::File {
                copied += ea.attr.size;
            }
            copy_meta(la, ea.node, lb, e.node, &ea.attr, |_| true)?;
            Ok(e)
        })?;
        lb.forget(&daemon(), made.node, 1);
        Ok(copied)
    }

    /// Remove from `dir` the copies a resync or scrub left when it stopped halfway: hidden from
    /// every listing, nothing else would ever remove them, and the branches would differ.
    fn remove_leftovers(&self, level: &Level, dir: NodeId) -> Result<()> {
        for e in level.list_dir(&daemon(), dir)? {
            let changed = || {
                let found = level.lookup(&daemon(), dir, &e.name).ok()?;
                level.forget(&daemon(), found.node, 1);
                Some(found.attr.mtime.max(found.attr.ctime))
            };
            if self.temps.is_leftover(&e.name, changed) {
                self.remove_tree(level, dir, &e.name, e.kind)?;
            }
        }
        Ok(())
    }

    fn remove_tree(&self, level: &Level, dir: NodeId, name: &OsStr, kind: FileKind) -> Result<()> {
        let cx = daemon();
        if kind != FileKind::Dir {
            return level.unlink(&cx, dir, name);
        }
        let e = level.lookup(&cx, dir, name)?;
        let emptied = level
            .list_dir(&cx, e.node)
            .and_then(|children| children.into_iter().try_for_each(|c| self.remove_tree(level, e.node, &c.name, c.kind)));
        level.forget(&cx, e.node, 1);
        emptied?;
        level.call(&cx, &Op::RmDir { parent: dir, name }).map(|_| ())
    }

    /// Bring failed branches (all, or the one named) up to date and back into the mirror.
    pub(super) fn resync(&self, args: &[String]) -> Result<Value> {
        let _one = self.repairing.lock();
        self.require_alone("resync")?;
        let targets: Vec<usize> = match args {
            [] => (0..self.branches.len()).filter(|b| self.is_failed(*b)).collect(),
            [name] => {
                let b = self
                    .branches
                    .iter()
                    .position(|b| b.branch.name == *name)
                    .ok_or_else(|| Error::BadArgs(format!("resync: no branch named '{name}'")))?;
                if !self.is_failed(b) {
                    return Err(Error::BadArgs(format!("resync: branch '{name}' is in sync already")));
                }
                vec![b]
            }
            _ => return Err(Error::BadArgs("usage: resync [BRANCH]".into())),
        };
        let mut report = Vec::new();
        for b in targets {
            let name = self.branches[b].branch.name.clone();
            if !self.alive(b) {
                return Err(Error::BadArgs(format!(
                    "resync: branch '{name}' ({}) is still unreachable",
                    self.branches[b].branch.lower
                )));
            }
            let a = self.reader()?;
            let started = std::time::Instant::now();
            let meter = progress::start(&format!("resync {name}"), "files", self.log.stale_count(b) as u64);
            let (mut paths, mut bytes) = (0u64, 0u64);
            let mut step = |m: &Mirror| -> Result<bool> {
                let Some(path) = m.log.next_stale(b) else { return Ok(false) };
                // Not synced file by file: the branch stays out until `sync_branch` below, and a
                // resync cut short runs again.
                bytes += m
                    .sync_path(a, b, &path, Data::Deferred)
                    .map_err(|e| Error::BadArgs(format!("resync of '{name}' stopped at {path:?}: {e}")))?;
                m.log.clear_stale(b, &path);
                paths += 1;
                meter.add(1);
                meter.set_total(paths + m.log.stale_count(b) as u64);
                Ok(true)
            };
            while step(self)? {}
            {
                // Let the branch back in with nothing changing meanwhile: what changed since is
                // copied now, then every change reaches it again.
                let _alone = self.membership.write();
                // (With sharing, no other mount may have started meanwhile, and none may start
                // until the branch is named in sync.)
                let _names = self.lock_names()?;
                self.require_alone("resync")?;
                while step(self)? {}
                self.sync_branch(b)?;
                self.forget_places_on(b);
                self.branches[b].failed.store(false, Ordering::Release);
                self.note(self.log.resynced(b));
                self.rewrite_failed()?;
            }
            tracing::info!(
                "mirror '{}': branch '{name}' is in sync again: {paths} paths, {bytes} bytes copied in {:.1?}",
                self.name,
                started.elapsed()
            );
            report.push(json!({ "branch": name, "paths": paths, "bytes": bytes, "seconds": started.elapsed().as_secs_f64() }));
        }
        Ok(json!({ "resynced": report, "status": self.status() }))
    }

    /// Make what was copied to branch `b` durable, in one go.
    pub(super) fn sync_branch(&self, b: usize) -> Result<()> {
        self.top(b).extended(&daemon(), NodeId::ROOT, "lower-sync", &[]).map(|_| ())
    }

    /// Nodes and open handles on branch `b` may name objects a resync replaced: find them again
    /// when next needed.
    fn forget_places_on(&self, b: usize) {
        let dropped: Vec<NodeId> = {
            let mut table = self.nodes.lock();
            table.nodes.iter_mut().filter(|(id, _)| **id != NodeId::ROOT.0).filter_map(|(_, n)| n.places[b].take()).collect()
        };
        for node in dropped {
            self.top(b).forget(&daemon(), node, 1);
        }
        let files: Vec<_> = self.files.lock().values().cloned().collect();
        for f in files {
            if let Some((node, fh)) = f.handles.lock()[b].take() {
                let _ = self.top(b).release(&daemon(), node, fh);
            }
        }
    }

    /// Compare every object on every in-sync branch with the reading branch; repair.
    pub(super) fn scrub(&self) -> Result<Value> {
        let _one = self.repairing.lock();
        self.require_alone("scrub")?;
        let a = self.reader()?;
        let meter = progress::start("scrub", "files", 0);
        let mut checked = 0u64;
        let mut repaired: Vec<String> = Vec::new();
        for b in self.in_sync().into_iter().filter(|b| *b != a) {
            self.scrub_dir(a, b, NodeId::ROOT, NodeId::ROOT, "", &mut checked, &mut repaired, &meter)?;
        }
        if !repaired.is_empty() {
            let shown: Vec<String> = repaired.iter().map(|p| super::printable(p)).collect();
            tracing::warn!("mirror '{}': scrub repaired {} paths: {}", self.name, repaired.len(), shown.join(", "));
        }
        self.skipped_by_scrub(checked, repaired.len())?;
        Ok(json!({ "checked": checked, "repaired": repaired }))
    }

    /// A scrub that left failed branches out did not do its job: an error that says which, and
    /// what was done.
    fn skipped_by_scrub(&self, checked: u64, repaired: usize) -> Result<()> {
        let failed: Vec<String> = (0..self.branches.len())
            .filter(|b| self.is_failed(*b))
            .map(|b| format!("'{}' ({})", self.branches[b].branch.name, self.branches[b].branch.lower))
            .collect();
        if failed.is_empty() {
            return Ok(());
        }
        Err(Error::BadArgs(format!(
            "scrub: branch {} failed and is not in sync, so its files were not checked (checked {checked} objects on the others, repaired {repaired}); bring it back with `resync`, then scrub again",
            failed.join(", ")
        )))
    }

    #[allow(clippy::too_many_arguments)]
    fn scrub_dir(
        &self,
        a: usize,
        b: usize,
        da: NodeId,
        db: NodeId,
        path: &str,
        checked: &mut u64,
        repaired: &mut Vec<String>,
        meter: &progress::Progress,
    ) -> Result<()> {
        let (la, lb) = (self.top(a), self.top(b));
        let join = |name: &OsStr| {
            if path.is_empty() {
                name.to_string_lossy().into_owned()
            } else {
                format!("{path}/{}", name.to_string_lossy())
            }
        };
        self.remove_leftovers(lb, db)?;
        let names_a: BTreeSet<OsString> = listing(self, la, da)?.into_iter().map(|(n, _)| n).collect();
        let names_b: BTreeSet<OsString> = listing(self, lb, db)?.into_iter().map(|(n, _)| n).collect();
        for name in names_a.symmetric_difference(&names_b) {
            self.repair(a, b, join(name), repaired)?;
        }
        let (mut ha, mut hb) = (Held::new(la), Held::new(lb));
        for name in names_a.intersection(&names_b) {
            *checked += 1;
            meter.add(1);
            let (Some(ea), Some(eb)) = (ha.lookup(da, name)?, hb.lookup(db, name)?) else { continue };
            let differs = !same_meta(&ea.attr, &eb.attr)
                || xattrs(la, ea.node) != xattrs(lb, eb.node)
                || match ea.attr.kind {
                    FileKind::File => !same_data(la, ea.node, lb, eb.node)?,
                    FileKind::Symlink => readlink(la, ea.node)? != readlink(lb, eb.node)?,
                    _ => false,
                };
            if differs {
                self.repair(a, b, join(name), repaired)?;
            } else if ea.attr.kind == FileKind::Dir {
                self.scrub_dir(a, b, ea.node, eb.node, &join(name), checked, repaired, meter)?;
            }
        }
        Ok(())
    }
}

impl Mirror {
    /// Repair `path` on `b` from `a`, with changes held off: a file being written may differ
    /// for a moment, and the copy must not race it.
    fn repair(&self, a: usize, b: usize, path: String, repaired: &mut Vec<String>) -> Result<()> {
        let _alone = self.membership.write();
        self.sync_path(a, b, &path, Data::Durable)?;
        // A copy may have replaced objects this mount holds (an open file's handle would write
        // to the replaced one): found again when next needed.
        self.forget_places_on(b);
        repaired.push(path);
        Ok(())
    }
}

/// Make file `eb` of `lb` hold what `ea` of `la` does, in place: the bytes copied, or `None`
/// if the file cannot be opened for writing as it is.
fn rewrite_file(la: &Level, ea: &Entry, lb: &Level, eb: &Entry, data: Data) -> Result<Option<u64>> {
    let cx = daemon();
    let dst = match lb.open(&cx, eb.node, libc::O_WRONLY | libc::O_TRUNC) {
        Ok(dst) => dst,
        Err(Error::Os(libc::EACCES | libc::EPERM)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let copied = copy_data(la, ea.node, lb, eb.node, &dst, ea.attr.size).and_then(|()| match data {
        Data::Durable => lb.call(&cx, &Op::Fsync { node: eb.node, fh: dst.fh, datasync: true }).map(|_| ()),
        _ => Ok(()),
    });
    let _ = lb.release(&cx, eb.node, dst.fh);
    copied?;
    copy_meta(la, ea.node, lb, eb.node, &ea.attr, |_| true)?;
    Ok(Some(ea.attr.size))
}

fn readlink(level: &Level, node: NodeId) -> Result<Vec<u8>> {
    match level.call(&daemon(), &Op::ReadLink { node })? {
        Reply::Data(d) => Ok(d),
        _ => Err(Error::Os(libc::EIO)),
    }
}
