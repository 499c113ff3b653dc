//! Whiteouts, opaque directories and the branch mark: how the union hides the names of lower
//! branches ([`super::WHITEOUT_TARGET`], [`super::OPAQUE_XATTR`]), and recognises them only on
//! branches it has marked ([`super::MARK_XATTR`]), so a plain branch costs no extra system call.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::Ordering;

use plyfs_stack::{Entry, Error, FileKind, NodeId, Op, Reply, Result, XattrReply};

use super::{daemon, BranchState, Union, MARK_XATTR, OPAQUE_XATTR, WHITEOUT_TARGET};

impl Union {
    fn readlink(&self, b: &BranchState, node: NodeId) -> Option<Vec<u8>> {
        match b.top().call(&daemon(), &Op::ReadLink { node }) {
            Ok(Reply::Data(d)) => Some(d),
            _ => None,
        }
    }

    pub(super) fn is_whiteout(&self, b: &BranchState, e: &Entry) -> bool {
        b.marked.load(Ordering::Relaxed)
            && e.attr.kind == FileKind::Symlink
            && self.readlink(b, e.node).is_some_and(|t| t == WHITEOUT_TARGET.as_bytes())
    }

    pub(super) fn has_xattr(&self, b: &BranchState, node: NodeId, name: &str) -> Option<Vec<u8>> {
        let op = Op::GetXattr { node, name: OsStr::new(name), size: 64 };
        match b.top().call(&daemon(), &op) {
            Ok(Reply::Xattr(XattrReply::Data(d))) => Some(d),
            _ => None,
        }
    }

    pub(super) fn is_opaque(&self, b: &BranchState, node: NodeId) -> bool {
        b.marked.load(Ordering::Relaxed) && self.has_xattr(b, node, OPAQUE_XATTR).is_some()
    }

    /// Mark `b` before the first whiteout, origin or opaque flag is written there.
    fn mark(&self, b: &BranchState) {
        if b.marked.swap(true, Ordering::AcqRel) {
            return;
        }
        let op = Op::SetXattr { node: NodeId::ROOT, name: OsStr::new(MARK_XATTR), value: b"1", flags: 0 };
        if let Err(e) = b.top().call(&daemon(), &op) {
            tracing::warn!(
                "union '{}': cannot mark branch '{}' ({}): {e}; its whiteouts will not be recognised after a remount",
                self.name,
                b.branch.name,
                b.branch.lower
            );
        }
    }

    pub(super) fn set_flag(&self, b: &BranchState, node: NodeId, name: &str, value: &[u8]) -> Result<()> {
        self.mark(b);
        b.top().call(&daemon(), &Op::SetXattr { node, name: OsStr::new(name), value, flags: 0 }).map(|_| ())
    }

    pub(super) fn whiteout(&self, b: &BranchState, dir: NodeId, name: &OsStr) -> Result<()> {
        self.mark(b);
        let e = match b.top().call(&daemon(), &Op::SymLink { parent: dir, name, target: Path::new(WHITEOUT_TARGET) })? {
            Reply::Entry(e) => e,
            _ => return Err(Error::Os(libc::EIO)),
        };
        b.top().forget(&daemon(), e.node, 1);
        Ok(())
    }

    /// Remove a whiteout of `name` in `dir` on `b`, if there is one. Returns whether there was.
    pub(super) fn remove_whiteout(&self, b: &BranchState, dir: NodeId, name: &OsStr) -> Result<bool> {
        if !b.marked.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let e = match b.top().lookup(&daemon(), dir, name) {
            Ok(e) => e,
            Err(Error::Os(libc::ENOENT)) => return Ok(false),
            Err(e) => return Err(e),
        };
        let whiteout = self.is_whiteout(b, &e);
        b.top().forget(&daemon(), e.node, 1);
        if whiteout {
            b.top().unlink(&daemon(), dir, name)?;
        }
        Ok(whiteout)
    }

    /// A whiteout of `name` in the directory `parent`, on the upper branch.
    pub(super) fn whiteout_in(&self, parent: NodeId, name: &OsStr) -> Result<()> {
        let upper = self.upper()?;
        let dir = self.ensure_dir_on_upper(parent)?;
        self.whiteout(&upper, dir.node, name)
    }
}
