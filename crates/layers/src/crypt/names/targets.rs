//! Symlinks whose sealed target is too long for a lower symlink: the companion file `T.<hash>`
//! beside each of their names, and where this mount has seen them (the format is in the header
//! of [`super`]). A symlink's size shown above is its plaintext target's length.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine as _;
use plyfs_stack::{Attr, Caller, Entry, Error, FileKind, NodeId, Op, Reply, Result};
use sha2::Digest;

use super::seal::{open_link, parse_marker, seal_link, sealed_target_len, SealedTarget, LINK_NONCE, MARKER_LEN, TARGET_PREFIX};
use super::{internal, CryptNames};
use crate::crypt::keys::random_bytes;

/// Where the companions of long symlink targets are: by node (a directory holding one of its
/// names, and so its companion), and by lower name. Such symlinks are rare; entries go when
/// their names do.
#[derive(Default)]
pub(super) struct LongTargets {
    pub(super) nodes: HashMap<NodeId, LongTarget>,
    names: HashMap<(NodeId, OsString), NodeId>,
}

#[derive(Clone)]
pub(super) struct LongTarget {
    dir: NodeId,
    pub(super) companion: OsString,
    len: u64,
}

impl CryptNames {
    fn seal_target(&self, target: &[u8]) -> Result<SealedTarget> {
        if target.len() >= libc::PATH_MAX as usize {
            return Err(Error::Os(libc::ENAMETOOLONG));
        }
        if self.plaintext {
            return Ok(SealedTarget::Inline(OsStr::from_bytes(target).to_owned()));
        }
        let nonce: [u8; LINK_NONCE] = random_bytes();
        Ok(SealedTarget::of(seal_link(&self.links, &nonce, target)?, target.len()))
    }

    pub(super) fn open_target(&self, node: NodeId, stored: &[u8]) -> Result<Vec<u8>> {
        if self.plaintext {
            return Ok(stored.to_vec());
        }
        let bad = |why: &str| {
            tracing::error!("symlink inode {}: its target {why}", node.0);
            Error::Os(libc::EIO)
        };
        let blob = match parse_marker(stored) {
            Some((companion, _)) => {
                let dir = self.long_targets.read().nodes.get(&node).map(|l| l.dir);
                let dir = dir.ok_or_else(|| bad("is stored beside it, in a directory this mount has not seen it in"))?;
                let blob = self.below().read_small_file(&internal(), dir, &companion, 8192).map_err(|e| match e {
                    Error::Os(libc::ENOENT) => bad(&format!("is lost: its file {} is missing", companion.to_string_lossy())),
                    e => e,
                })?;
                if B64.encode(sha2::Sha256::digest(&blob)).as_bytes() != &companion.as_bytes()[TARGET_PREFIX.len()..] {
                    return Err(bad(&format!("is damaged: {} does not match its name", companion.to_string_lossy())));
                }
                blob
            }
            None => B64.decode(stored).map_err(|_| bad("does not decrypt (altered, or not this volume's)"))?,
        };
        open_link(&self.links, &blob).ok_or_else(|| bad("does not decrypt (altered, or not this volume's)"))
    }

    /// Remember where the companion of a symlink with a long target lies (`entry` was found or
    /// made as `name` in `dir`), and give back the attributes to show.
    pub(super) fn note_entry(&self, dir: NodeId, name: &OsStr, mut entry: Entry) -> Entry {
        if self.plaintext || entry.attr.kind != FileKind::Symlink {
            return entry;
        }
        if entry.attr.size as usize != MARKER_LEN {
            entry.attr = self.fix_attr(entry.attr);
            return entry;
        }
        match self.marker_of(entry.node) {
            Some((companion, len)) => {
                entry.attr.size = len;
                let mut t = self.long_targets.write();
                t.nodes.insert(entry.node, LongTarget { dir, companion, len });
                t.names.insert((dir, name.to_owned()), entry.node);
            }
            None => entry.attr = self.fix_attr(entry.attr),
        }
        entry
    }

    /// The companion name and plaintext length a lower symlink's marker gives.
    fn marker_of(&self, node: NodeId) -> Option<(OsString, u64)> {
        match self.below().call(&internal(), &Op::ReadLink { node }) {
            Ok(Reply::Data(stored)) => parse_marker(&stored),
            _ => None,
        }
    }

    /// The symlink with a long target `name` in `dir` names, if this mount saw it there.
    pub(super) fn long_target_at(&self, dir: NodeId, name: &OsStr) -> Option<(NodeId, OsString)> {
        let t = self.long_targets.read();
        let node = *t.names.get(&(dir, name.to_owned()))?;
        t.nodes.get(&node).map(|l| (node, l.companion.clone()))
    }

    /// Give the directory `to` the companion of the long target of `node` (a new name of it is
    /// about to be made there). Returns whether a new companion name was made.
    pub(super) fn copy_target_companion(&self, cx: &Caller, node: NodeId, to: NodeId) -> Result<bool> {
        let Some(l) = self.long_targets.read().nodes.get(&node).cloned() else { return Ok(false) };
        if l.dir == to {
            return Ok(false);
        }
        let below = self.below();
        let src = below.lookup(&internal(), l.dir, &l.companion)?;
        let linked = below.call(cx, &Op::Link { node: src.node, new_parent: to, new_name: &l.companion });
        below.forget(&internal(), src.node, 1);
        match linked {
            Ok(Reply::Entry(e)) => {
                below.forget(&internal(), e.node, 1);
                Ok(true)
            }
            Ok(_) => Ok(true),
            Err(Error::Os(libc::EEXIST)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The name `name` of `node` (a symlink with a long target) left `dir`: its companion goes
    /// too when that was the symlink's last name (`nlink` before it went).
    pub(super) fn drop_target_name(&self, cx: &Caller, dir: NodeId, name: &OsStr, node: NodeId, companion: &OsStr, nlink: u32) {
        {
            let mut t = self.long_targets.write();
            t.names.remove(&(dir, name.to_owned()));
            if nlink <= 1 {
                t.nodes.remove(&node);
            }
        }
        if nlink <= 1 {
            if let Err(e) = self.below().unlink(cx, dir, companion) {
                if !matches!(e, Error::Os(libc::ENOENT)) {
                    tracing::warn!("directory inode {}: removing {}: {e}", dir.0, companion.to_string_lossy());
                }
            }
        }
    }

    pub(super) fn nlink(&self, node: NodeId) -> u32 {
        self.below().getattr(&internal(), node).map_or(1, |a| a.nlink)
    }

    pub(super) fn symlink(&self, cx: &Caller, parent: NodeId, name: &OsStr, target: &[u8]) -> Result<Reply> {
        let n = self.encrypt(parent, name)?;
        let (stored, companion) = match self.seal_target(target)? {
            SealedTarget::Inline(t) => (t, None),
            SealedTarget::Long { marker, companion, blob } => {
                let made = self.write_aux(cx, parent, &companion, &blob)?;
                (marker, Some((companion, made)))
            }
        };
        let reply = self.make(cx, parent, &n, &Op::SymLink { parent, name: n.name(), target: std::path::Path::new(&stored) });
        match (reply, companion) {
            (Err(e), Some((companion, true))) => {
                let _ = self.below().unlink(cx, parent, &companion);
                Err(e)
            }
            (reply, _) => reply,
        }
    }


    /// Take back the companions copied for a rename that did not happen.
    pub(super) fn undo_copied(&self, cx: &Caller, copied: &[(NodeId, NodeId)]) {
        for (dir, node) in copied {
            if let Some(l) = self.long_targets.read().nodes.get(node).cloned() {
                let _ = self.below().unlink(cx, *dir, &l.companion);
            }
        }
    }

    /// After a rename: where the companions of long targets among the two names now belong.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn renamed_targets(
        &self,
        cx: &Caller,
        (from_dir, from): (NodeId, &OsStr),
        (to_dir, to): (NodeId, &OsStr),
        moving: Option<(NodeId, OsString)>,
        moving_nlink: Option<u32>,
        victim: Option<(NodeId, OsString)>,
        victim_nlink: Option<u32>,
        exchanged: bool,
    ) {
        if exchanged {
            let mut t = self.long_targets.write();
            t.names.remove(&(from_dir, from.to_owned()));
            t.names.remove(&(to_dir, to.to_owned()));
            if let Some((node, _)) = &victim {
                t.names.insert((from_dir, from.to_owned()), *node);
            }
            if let Some((node, _)) = &moving {
                t.names.insert((to_dir, to.to_owned()), *node);
            }
            return;
        }
        if let (Some((node, companion)), Some(nlink)) = (&victim, victim_nlink) {
            if moving.as_ref().map(|(n, _)| n) != Some(node) {
                self.drop_target_name(cx, to_dir, to, *node, companion, nlink);
            }
        }
        if let (Some((node, companion)), Some(nlink)) = (moving, moving_nlink) {
            let mut t = self.long_targets.write();
            t.names.remove(&(from_dir, from.to_owned()));
            t.names.insert((to_dir, to.to_owned()), node);
            if let Some(l) = t.nodes.get_mut(&node) {
                l.dir = to_dir;
            }
            drop(t);
            if from_dir != to_dir && nlink <= 1 {
                if let Err(e) = self.below().unlink(cx, from_dir, &companion) {
                    tracing::warn!("directory inode {}: removing {}: {e}", from_dir.0, companion.to_string_lossy());
                }
            }
        }
    }

    fn fix_attr(&self, mut attr: Attr) -> Attr {
        if !self.plaintext && attr.kind == FileKind::Symlink {
            attr.size = sealed_target_len(attr.size);
        }
        attr
    }

    /// The attributes of `node` to show: a symlink with a long target shows its length.
    pub(super) fn fix_node_attr(&self, node: NodeId, mut attr: Attr) -> Attr {
        if self.plaintext || attr.kind != FileKind::Symlink || attr.size as usize != MARKER_LEN {
            return self.fix_attr(attr);
        }
        let known = self.long_targets.read().nodes.get(&node).map(|l| l.len);
        match known.or_else(|| self.marker_of(node).map(|(_, len)| len)) {
            Some(len) => attr.size = len,
            None => attr = self.fix_attr(attr),
        }
        attr
    }

}
