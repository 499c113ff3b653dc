//! Binding files to their places, on a volume made with `--bind-paths` (the tags and their
//! rules are in [`crate::crypt::bind`]): where each file known above is, the check at open, and
//! moving the binding on write of a new header, rename and link; and `crypt-rebind`, which binds
//! a file to where it is now.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;

use parking_lot::{Mutex, RwLock};
use plyfs_stack::{Entry, Error, FileKind, NodeId, Op, Reply, Result, XattrReply};

use super::{internal, CryptNames};
use crate::crypt::bind::{self, BindKey, Head, Stored, Verdict, BIND_XATTR, HEAD_BYTES};

/// What binding files to their places needs: the key, and where each file known above is.
pub(super) struct Binding {
    key: BindKey,
    /// Regular files by node: the place they were last found or made at, and how many lookups
    /// above hold them (the entry goes when they are all forgotten).
    places: RwLock<HashMap<NodeId, FilePlace>>,
    /// Refusals already logged, so that a file retried in a loop is one line.
    reported: Mutex<HashSet<(NodeId, [u8; 16], OsString)>>,
}

impl Binding {
    pub(super) fn new(key: BindKey) -> Binding {
        Binding { key, places: RwLock::new(HashMap::new()), reported: Mutex::new(HashSet::new()) }
    }
}

/// Where a file is: its directory's id (not the directory's node, which a lookup above may
/// already have let go of) and its lower name.
struct FilePlace {
    dir_id: [u8; 16],
    lower_name: OsString,
    lookups: u64,
}

impl CryptNames {
    /// Remember where the file of `entry` was found or made (`name` is its lower name in `dir`).
    pub(super) fn note_place(&self, dir: NodeId, lower_name: &OsStr, entry: &Entry) {
        let Some(b) = &self.bind else { return };
        if entry.attr.kind != FileKind::File {
            return;
        }
        let Ok(dir_id) = self.dir_id(dir) else { return };
        let mut places = b.places.write();
        let p = places.entry(entry.node).or_insert_with(|| FilePlace { dir_id, lower_name: OsString::new(), lookups: 0 });
        p.dir_id = dir_id;
        p.lower_name = lower_name.to_owned();
        p.lookups += 1;
    }

    pub(super) fn forget_place(&self, node: NodeId, nlookup: u64) {
        let Some(b) = &self.bind else { return };
        let mut places = b.places.write();
        if let Some(p) = places.get_mut(&node) {
            p.lookups = p.lookups.saturating_sub(nlookup);
            if p.lookups == 0 {
                places.remove(&node);
            }
        }
    }

    fn place_of(&self, node: NodeId) -> Option<([u8; 16], OsString)> {
        let b = self.bind.as_ref()?;
        b.places.read().get(&node).map(|p| (p.dir_id, p.lower_name.clone()))
    }

    /// What the first bytes of the lower file `node` say about its identity. Only a regular file
    /// has any: a FIFO or a device is never opened here (an open could block, or act).
    pub(super) fn head_of(&self, node: NodeId) -> Result<Head> {
        let below = self.below();
        if below.getattr(&internal(), node)?.kind != FileKind::File {
            return Ok(Head::None);
        }
        let opened = below.open(&internal(), node, libc::O_RDONLY | libc::O_NONBLOCK)?;
        let head = below.read(&internal(), node, opened.fh, 0, HEAD_BYTES as u32);
        let _ = below.release(&internal(), node, opened.fh);
        Ok(Head::of(&head?))
    }

    fn stored_tags(&self, node: NodeId) -> Result<Option<Stored>> {
        let op = Op::GetXattr { node, name: OsStr::new(BIND_XATTR), size: bind::STORED_MAX_BYTES as u32 };
        match self.below().call(&internal(), &op) {
            // Tags that do not decode match no place.
            Ok(Reply::Xattr(XattrReply::Data(d))) => Ok(Some(Stored::decode(&d).unwrap_or_else(Stored::damaged))),
            Ok(_) | Err(Error::Os(libc::ERANGE)) => Ok(Some(Stored::damaged())),
            Err(Error::Os(libc::ENODATA)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn store_tags(&self, node: NodeId, tags: &Stored) -> Result<()> {
        let value = tags.encode();
        self.below().call(&internal(), &Op::SetXattr { node, name: OsStr::new(BIND_XATTR), value: &value, flags: 0 }).map(|_| ())
    }

    /// Refuse to open `node` unless its content is bound to the place it was found at.
    pub(super) fn check_binding(&self, node: NodeId, head: Head) -> Result<()> {
        let Some(b) = &self.bind else { return Ok(()) };
        let Head::Id(file_id) = head else { return Ok(()) };
        let Some((dir_id, lower_name)) = self.place_of(node) else {
            return Err(self.refuse(node, None, "this mount does not know where it is, so its place cannot be checked"));
        };
        let here = b.key.place_tag(&file_id, &dir_id, lower_name.as_bytes());
        match bind::verdict(&b.key, self.stored_tags(node)?.as_ref(), &file_id, &here) {
            Verdict::Here | Verdict::Linked => Ok(()),
            Verdict::Missing => Err(self.refuse(node, Some((dir_id, lower_name)), "its place tag is missing (removed below, or lost by a copy that dropped extended attributes)")),
            Verdict::Elsewhere => Err(self.refuse(
                node,
                Some((dir_id, lower_name)),
                "its content is bound to another place: the file was moved or swapped in the storage, not renamed through plyfs",
            )),
        }
    }

    /// Log a refusal to open `node` once (naming the file), and give the error to return.
    fn refuse(&self, node: NodeId, place: Option<([u8; 16], OsString)>, why: &str) -> Error {
        let b = self.bind.as_ref().expect("binding is on");
        let (dir_id, lower_name) = place.unwrap_or(([0; 16], OsString::new()));
        if b.reported.lock().insert((node, dir_id, lower_name)) {
            let path = self
                .below()
                .extended(&internal(), node, "lower-info", &[])
                .ok()
                .and_then(|v| v.get("path").and_then(|p| p.as_str()).map(str::to_owned))
                .map(|lower| match self.plain_path(&lower) {
                    Ok(plain) => format!("/{plain} (stored as {lower})"),
                    Err(_) => format!("stored as {lower}"),
                })
                .unwrap_or_else(|| format!("inode {}", node.0));
            tracing::error!("{}: {path}: refused with EIO: {why}", self.name);
        }
        Error::Os(libc::EIO)
    }

    /// A write of `data` at offset 0 of `node`: when it is a header with a new file id, bind
    /// that id to the file's place first, so that no header is ever stored without its tag.
    pub(super) fn bind_header(&self, node: NodeId, data: &[u8]) -> Result<()> {
        let Some(b) = &self.bind else { return Ok(()) };
        let Head::Id(file_id) = Head::of(data) else { return Ok(()) };
        let stored = self.stored_tags(node)?;
        let place = self.place_of(node);
        let here = place.as_ref().map(|(dir_id, lower_name)| b.key.place_tag(&file_id, dir_id, lower_name.as_bytes()));
        let verdict = bind::verdict(&b.key, stored.as_ref(), &file_id, &here.unwrap_or([0; 32]));
        if verdict == Verdict::Linked || (verdict == Verdict::Here && here.is_some()) {
            return Ok(());
        }
        // A file with several names (or none known here) is bound to its id only, and so is one
        // that ever had several: the name this mount saw last may be one that is gone.
        let linked = stored.is_some_and(|s| s.linked) || self.nlink(node) > 1;
        match here {
            Some(tag) if !linked => self.store_tags(node, &Stored::placed(tag, None)),
            _ => self.store_tags(node, &Stored::linked(Some(b.key.linked_tag(&file_id)))),
        }
    }

    /// Before `node`, now `lower_name` in `dir`, becomes `new_name` in `new_dir`: add the tag of
    /// the new place, keeping the old one, so the file is valid at either until the next
    /// rename (a crash between the two steps loses nothing). A file not valid where it is
    /// stays invalid; a linked file has no place to change.
    pub(super) fn bind_new_place(&self, node: NodeId, (dir, lower_name): (NodeId, &OsStr), (new_dir, new_name): (NodeId, &OsStr)) -> Result<()> {
        let Some(b) = &self.bind else { return Ok(()) };
        let Head::Id(file_id) = self.head_of(node)? else { return Ok(()) };
        let Some(Stored { linked: false, current: Some(current), previous }) = self.stored_tags(node)? else { return Ok(()) };
        let old = b.key.place_tag(&file_id, &self.dir_id(dir)?, lower_name.as_bytes());
        if current != old && previous != Some(old) {
            return Ok(());
        }
        let new = b.key.place_tag(&file_id, &self.dir_id(new_dir)?, new_name.as_bytes());
        self.store_tags(node, &Stored::placed(new, Some(old)))
    }

    /// Before `node` gets a second name: bind it to its file id only, for good.
    pub(super) fn bind_linked(&self, node: NodeId) -> Result<()> {
        let Some(b) = &self.bind else { return Ok(()) };
        if self.below().getattr(&internal(), node)?.kind != FileKind::File {
            return Ok(());
        }
        let stored = self.stored_tags(node)?;
        if stored.is_some_and(|s| s.linked) {
            return Ok(());
        }
        match self.head_of(node)? {
            // No content yet: only the mark, which the first header's tag will follow.
            Head::None => self.store_tags(node, &Stored::linked(None)),
            Head::Damaged => Ok(()),
            Head::Id(file_id) => {
                // A file not valid where it is does not become valid everywhere.
                let here = self.place_of(node).map(|(dir_id, lower_name)| b.key.place_tag(&file_id, &dir_id, lower_name.as_bytes()));
                match here {
                    Some(here) if bind::verdict(&b.key, stored.as_ref(), &file_id, &here) == Verdict::Here => {
                        self.store_tags(node, &Stored::linked(Some(b.key.linked_tag(&file_id))))
                    }
                    _ => Ok(()),
                }
            }
        }
    }

    /// `crypt-rebind`: bind `node` to the place it was found at, whatever its tags say (for
    /// `plyfs fsck --rebind`, after a copy that dropped extended attributes). Answers whether a
    /// tag was written.
    pub(super) fn rebind(&self, node: NodeId) -> Result<Reply> {
        let Some(b) = &self.bind else {
            return Err(Error::config("this crypt volume does not bind files to their places (it was made without --bind-paths)"));
        };
        let rebound = match self.head_of(node)? {
            Head::Id(file_id) => {
                let (dir_id, lower_name) = self.place_of(node).ok_or(Error::Os(libc::ESTALE))?;
                let stored = self.stored_tags(node)?;
                let want = if stored.is_some_and(|s| s.linked) || self.nlink(node) > 1 {
                    Stored::linked(Some(b.key.linked_tag(&file_id)))
                } else {
                    Stored::placed(b.key.place_tag(&file_id, &dir_id, lower_name.as_bytes()), None)
                };
                let fits = stored == Some(want);
                if !fits {
                    self.store_tags(node, &want)?;
                }
                !fits
            }
            Head::None | Head::Damaged => false,
        };
        Ok(Reply::Extended(serde_json::json!({ "rebound": rebound })))
    }

    /// For a rename of `name` in `parent` (lower names): the file that moves, if binding is on
    /// and it is a regular file; the caller forgets the lookup when the rename is done.
    pub(super) fn bound_file_at(&self, parent: NodeId, lower_name: &OsStr) -> Option<NodeId> {
        self.bind.as_ref()?;
        let e = self.below().lookup(&internal(), parent, lower_name).ok()?;
        if e.attr.kind != FileKind::File {
            self.below().forget(&internal(), e.node, 1);
            return None;
        }
        Some(e.node)
    }

    pub(super) fn moved_place(&self, node: NodeId, dir: NodeId, lower_name: &OsStr) {
        let Some(b) = &self.bind else { return };
        let Ok(dir_id) = self.dir_id(dir) else { return };
        if let Some(p) = b.places.write().get_mut(&node) {
            p.dir_id = dir_id;
            p.lower_name = lower_name.to_owned();
        }
    }
}
