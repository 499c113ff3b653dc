//! Which branch serves, and taking a failed one out: reads come from the first in-sync branch,
//! and an error that is the branch's fault (not the request's) fails it and the next one
//! serves the same request.

use std::sync::atomic::Ordering;

use plyfs_stack::{Error, Level, NodeId, Result};

use super::log::Unreached;
use super::{daemon, Mirror};

/// Errors that say a branch, not the request, is at fault.
const BRANCH_FAILURES: &[i32] = &[
    libc::EIO,
    libc::ENOTCONN,
    libc::ENODEV,
    libc::ENXIO,
    libc::ETIMEDOUT,
    libc::ESHUTDOWN,
    libc::EHOSTDOWN,
    libc::EHOSTUNREACH,
    libc::ECONNABORTED,
    libc::ECONNRESET,
];

impl Mirror {
    pub(super) fn top(&self, b: usize) -> &Level {
        self.branches[b].top()
    }

    pub(super) fn is_failed(&self, b: usize) -> bool {
        self.branches[b].failed.load(Ordering::Acquire)
    }

    pub(super) fn in_sync(&self) -> Vec<usize> {
        (0..self.branches.len()).filter(|b| !self.is_failed(*b)).collect()
    }

    /// The branch that serves reads: the first in sync.
    pub(super) fn reader(&self) -> Result<usize> {
        (0..self.branches.len()).find(|b| !self.is_failed(*b)).ok_or(Error::Os(libc::EIO))
    }

    /// Take branch `b` out of the mirror.
    pub(super) fn fail(&self, b: usize, why: &dyn std::fmt::Display) {
        self.fail_as(b, why, true)
    }

    /// Take branch `b` out of the mirror; with `-o shared` and `publish`, tell the other mounts.
    pub(super) fn fail_as(&self, b: usize, why: &dyn std::fmt::Display, publish: bool) {
        if self.branches[b].failed.swap(true, Ordering::AcqRel) {
            return;
        }
        let serving = self
            .reader()
            .map(|r| format!("reads now come from '{}'", self.branches[r].branch.name))
            .unwrap_or_else(|_| "no branch is left".into());
        tracing::error!(
            "mirror '{}': branch '{}' ({}) failed: {why}; the mirror is degraded and {serving}; once the branch is back, `plyfs op MOUNT resync` brings it up to date",
            self.name,
            self.branches[b].branch.name,
            self.branches[b].branch.lower
        );
        self.note(self.log.failed(b));
        if publish && self.sharing.is_some() {
            self.publish_failed(b);
        }
    }

    /// Fail the branches a log write could not reach.
    pub(super) fn note(&self, unreached: Unreached) {
        for (b, e) in unreached {
            self.fail(b, &e);
        }
    }

    /// What the log could not note of a change about to be made: the branches that could not
    /// note it fail, unless none of the in-sync branches could (a full file system under all
    /// of them): then the change is refused with that error, and no branch fails for it.
    pub(super) fn note_or_refuse(&self, unreached: Unreached) -> Result<()> {
        let Some((_, first)) = unreached.first() else { return Ok(()) };
        if self.in_sync().iter().all(|b| unreached.iter().any(|(u, _)| u == b)) {
            return Err(Error::Os(first.errno()));
        }
        self.note(unreached);
        Ok(())
    }

    /// Whether branch `b` still has its directory (a removed one answers ENOENT everywhere).
    pub(super) fn alive(&self, b: usize) -> bool {
        self.top(b).getattr(&daemon(), NodeId::ROOT).is_ok_and(|a| a.nlink > 0)
    }

    /// Whether `e`, from the reading branch `b`, is the branch's fault.
    pub(super) fn branch_failure(&self, b: usize, e: &Error) -> bool {
        match e.errno() {
            errno if BRANCH_FAILURES.contains(&errno) => true,
            libc::ENOENT | libc::ESTALE => self.in_sync().len() > 1 && !self.alive(b),
            _ => false,
        }
    }

    /// Run `f` on the reading branch, failing over to the next in-sync branch when the branch
    /// is at fault.
    pub(super) fn on_reader<T>(&self, f: impl Fn(usize) -> Result<T>) -> Result<(usize, T)> {
        loop {
            let r = self.reader()?;
            match f(r) {
                Err(e) if self.branch_failure(r, &e) => self.fail(r, &e),
                other => return other.map(|v| (r, v)),
            }
        }
    }
}
