//! How a change reaches every in-sync branch, in one order: the locks it holds (this mount's,
//! and with `-o shared` the one every mount honours), the write-intent log around it, the
//! reading branch first, then the others, and the judgement of their answers. Why the order
//! matters is in the header of [`super`].

use std::ffi::OsStr;
use std::sync::atomic::Ordering;

use parking_lot::{MutexGuard, RwLockWriteGuard};
use plyfs_stack::shared::LockKind;
use plyfs_stack::{Error, FileHandle, NodeId, Reply, Result};

use super::share::Locked;
use super::{MFile, Mirror, OBJECT_STRIPES};

/// What a change must hold: nothing, the lock of changes of names, or the lock of one object
/// (across mounts a file's own; other objects change under the names lock there).
#[derive(Clone, Copy)]
pub(super) enum Guard {
    None,
    Names,
    Object(NodeId),
}

/// What a change holds while it runs: the lock other mounts honour (released first), then
/// this mount's own.
#[derive(Default)]
pub(super) struct Holding<'a> {
    _shared: Option<Locked<'a>>,
    _names: Option<RwLockWriteGuard<'a, ()>>,
    _object: Option<MutexGuard<'a, ()>>,
}

/// What a change did: the reading branch and its reply, then each other branch that followed.
pub(super) type Changed = (usize, Reply, Vec<(usize, Reply)>);

impl Mirror {
    /// Find object `id` on every in-sync branch it is not known on yet, under the names lock
    /// (shared; with `-o shared` other mounts' too). A name another thread or mount is making
    /// may be on the reading branch (where the object was looked up) and not yet on the others:
    /// found by name in that moment, it would be missing there, and the branch judged failed.
    /// Taken before any object's lock, as every holder of the names lock takes those after it.
    pub(super) fn settle(&self, id: NodeId) -> Result<()> {
        let in_sync = self.in_sync();
        let missing = {
            let table = self.nodes.lock();
            table.nodes.get(&id.0).is_some_and(|n| in_sync.iter().any(|b| n.places[*b].is_none()))
        };
        if !missing {
            return Ok(());
        }
        let _names = self.names.read();
        let _shared = self.lock_names_as(LockKind::Shared)?;
        for b in in_sync {
            // One missing here is the change's to find, and fails the branch there.
            let _ = self.resolve(id, b);
        }
        Ok(())
    }

    /// Take what `guard` says: this mount's lock, then, with `-o shared`, the one every mount
    /// honours.
    fn guard(&self, guard: Guard) -> Result<Holding<'_>> {
        match guard {
            Guard::None => Ok(Holding::default()),
            Guard::Names => {
                let names = self.names.write();
                Ok(Holding { _shared: self.lock_names()?, _names: Some(names), _object: None })
            }
            Guard::Object(id) => {
                self.settle(id)?;
                let object = self.objects[id.0 as usize % OBJECT_STRIPES].lock();
                Ok(Holding { _shared: self.lock_object(id)?, _names: None, _object: Some(object) })
            }
        }
    }

    /// Run a change on every in-sync branch: the reading one first (its answer is the answer;
    /// an ordinary error stops there), then the others. A branch that cannot follow fails; for
    /// failed branches the change's `paths` are noted stale.
    pub(super) fn change(&self, guard: Guard, paths: &dyn Fn() -> Vec<String>, f: impl Fn(usize) -> Result<Reply>) -> Result<Changed> {
        let _members = self.membership.read();
        let _held = self.guard(guard)?;
        self.apply(paths, f)
    }

    /// A change that takes names away (unlink, rmdir, rename): under the names lock, the objects
    /// `named` now are first found on every branch, as they cannot be found by these names
    /// after; `then` runs when it succeeded, before the lock goes.
    pub(super) fn change_names(
        &self,
        named: &[(NodeId, &OsStr)],
        paths: &dyn Fn() -> Vec<String>,
        f: impl Fn(usize) -> Result<Reply>,
        then: impl FnOnce(),
    ) -> Result<Changed> {
        let _members = self.membership.read();
        let _held = self.guard(Guard::Names)?;
        for (parent, name) in named {
            self.pin(*parent, name);
        }
        self.apply(paths, f).inspect(|_| then())
    }

    /// [`Mirror::change`] once its locks are held.
    fn apply(&self, paths: &dyn Fn() -> Vec<String>, f: impl Fn(usize) -> Result<Reply>) -> Result<Changed> {
        let path_list = paths();
        for (i, p) in path_list.iter().enumerate() {
            if let Err(e) = self.note_or_refuse(self.log.begin(p)) {
                for begun in &path_list[..=i] {
                    let _ = self.note_or_refuse(self.log.end(begun));
                }
                return Err(e);
            }
        }
        let result = self.on_reader(&f);
        let mut others = Vec::new();
        if let Ok((r, _)) = &result {
            for b in (0..self.branches.len()).filter(|b| b != r) {
                if self.is_failed(b) {
                    continue;
                }
                match f(b) {
                    Ok(reply) => others.push((b, reply)),
                    Err(e) if path_list.is_empty() => self.fail(b, &e),
                    Err(e) => {
                        let paths: Vec<String> = path_list.iter().map(|p| super::printable(p)).collect();
                        self.fail(b, &format!("{}: {e}", paths.join(" -> ")))
                    }
                }
            }
        }
        for b in (0..self.branches.len()).filter(|b| self.is_failed(*b)) {
            self.note(self.log.stale(b, &path_list));
        }
        for p in &path_list {
            self.note(self.log.end(p));
        }
        result.map(|(r, reply)| (r, reply, others))
    }

    /// An operation on an open file that changes it: on every in-sync branch (opened there if
    /// needed), in parallel when `parallel`.
    pub(super) fn file_change(
        &self,
        file: &MFile,
        parallel: bool,
        f: impl Fn(usize, NodeId, FileHandle) -> Result<Reply> + Sync,
    ) -> Result<Reply> {
        let _members = self.membership.read();
        let _held = self.guard(Guard::Object(file.node))?;
        if !file.in_flight.swap(true, Ordering::AcqRel) {
            if let Err(e) = self.note_or_refuse(self.log.begin(&file.path)) {
                let _ = self.note_or_refuse(self.log.end(&file.path));
                file.in_flight.store(false, Ordering::Release);
                return Err(e);
            }
        }
        let targets = self.in_sync();
        let run = |b: usize| self.handle_on(file, b).and_then(|(node, bfh)| f(b, node, bfh));
        let results: Vec<(usize, Result<Reply>)> = if parallel && targets.len() > 1 {
            std::thread::scope(|s| {
                let spawned: Vec<_> = targets[1..].iter().map(|&b| (b, s.spawn(move || run(b)))).collect();
                let mut results = vec![(targets[0], run(targets[0]))];
                for (b, h) in spawned {
                    results.push((b, h.join().unwrap_or(Err(Error::Os(libc::EIO)))));
                }
                results
            })
        } else {
            targets.iter().map(|&b| (b, run(b))).collect()
        };
        self.judge(file, results)
    }

    /// The answer to a change of `file` from the branches' `results`: the first branch whose
    /// answer is not its own fault answers, and a branch that answered otherwise fails. An error
    /// every branch gives (a full disk everywhere, a bad argument) is the operation's answer.
    pub(super) fn judge(&self, file: &MFile, results: Vec<(usize, Result<Reply>)>) -> Result<Reply> {
        // The first branch whose answer is not its own fault answers.
        let answer = results.iter().position(|(b, r)| !matches!(r, Err(e) if self.branch_failure(*b, e)));
        let Some(answer) = answer else {
            let (b, first) = results.into_iter().next().ok_or(Error::Os(libc::EIO))?;
            let err = first.err().unwrap_or(Error::Os(libc::EIO));
            self.fail(b, &format!("{}: {err}", super::printable(&file.path)));
            return Err(err);
        };
        let summary = |r: &Result<Reply>| match r {
            Ok(Reply::Written(n)) => Ok(Some(*n)),
            Ok(_) => Ok(None),
            Err(e) => Err(e.errno()),
        };
        let expected = summary(&results[answer].1);
        for (i, (b, r)) in results.iter().enumerate() {
            if i != answer && summary(r) != expected {
                let why = match r {
                    Err(e) => Error::Os(e.errno()),
                    Ok(_) => Error::Corrupt("it did not do what the reading branch did".into()),
                };
                self.fail(*b, &format!("{}: {why}", super::printable(&file.path)));
            }
        }
        for b in (0..self.branches.len()).filter(|b| self.is_failed(*b)) {
            self.note(self.log.stale(b, std::slice::from_ref(&file.path)));
        }
        results.into_iter().nth(answer).expect("found above").1
    }
}
