//! Finding names on the branches: a name shows from the highest-priority branch holding it,
//! unless a whiteout or an opaque directory above hides it; a directory merges every branch
//! holding it, down to the first opaque one. Each object found keeps its union inode number
//! (from its origin, see [`crate::ids`]) and its places.

use std::ffi::OsStr;
use std::sync::atomic::Ordering;

use plyfs_stack::{Caller, Entry, Error, FileKind, NodeId, Reply, Result};

use super::{enoent, is_temp, Found, UNode, Union, ORIGIN_XATTR};
use crate::ids::Place;

impl Union {
    /// The union inode number a copy recorded, if the object at `place` is one.
    pub(super) fn origin_of(&self, place: Place, kind: FileKind) -> Option<u64> {
        let b = self.branch(place.branch).ok()?;
        if !b.marked.load(Ordering::Relaxed) || kind == FileKind::Symlink {
            return None;
        }
        let value = self.has_xattr(&b, place.node, ORIGIN_XATTR)?;
        std::str::from_utf8(&value).ok()?.parse().ok().filter(|id| *id <= NodeId::MAX)
    }

    /// Look `name` up in the directory at `parent` (its places, top first).
    pub(super) fn find(&self, cx: &Caller, parent: &[Place], name: &OsStr) -> Result<Option<Found>> {
        if is_temp(name) {
            return Ok(None);
        }
        let mut found: Option<Found> = None;
        for p in parent {
            let Ok(b) = self.branch(p.branch) else {
                continue;
            };
            let e = match b.top().lookup(cx, p.node, name) {
                Ok(e) => e,
                Err(Error::Os(libc::ENOENT)) => continue,
                Err(e) => {
                    if let Some(f) = found {
                        self.forget_places(&f.places);
                    }
                    return Err(e);
                }
            };
            let place = Place { branch: p.branch, node: e.node };
            let is_dir = e.attr.kind == FileKind::Dir;
            match &mut found {
                _ if self.is_whiteout(&b, &e) => {
                    self.forget_places(&[place]);
                    break;
                }
                None => {
                    found = Some(Found { places: vec![place], entry: e });
                    if !is_dir || self.is_opaque(&b, e.node) {
                        break;
                    }
                }
                Some(f) => {
                    if !is_dir {
                        self.forget_places(&[place]);
                        break;
                    }
                    f.places.push(place);
                    if self.is_opaque(&b, e.node) {
                        break;
                    }
                }
            }
        }
        if let Some(f) = found.as_mut().filter(|f| f.places.len() > 1) {
            f.entry.attr.nlink = self.merged_links(cx, &f.places)?;
        }
        Ok(found)
    }

    /// A merged directory's link count as a kernel file system counts it: two, and one for each
    /// subdirectory it shows. The top branch's own count misses the subdirectories that are
    /// only below it (found by the differential fuzzer, `difffuzz.rs`).
    fn merged_links(&self, cx: &Caller, places: &[Place]) -> Result<u32> {
        let subdirs = self.merged(cx, places)?.iter().filter(|m| m.kind == FileKind::Dir).count();
        Ok(2 + subdirs as u32)
    }

    /// `reply` (attributes of `node`, from where it shows from) with a merged directory's link
    /// count counted.
    pub(super) fn with_merged_links(&self, cx: &Caller, node: NodeId, reply: Reply) -> Result<Reply> {
        match (reply, self.node(node)?) {
            (Reply::Attr(mut attr), (FileKind::Dir, places)) if places.len() > 1 => {
                attr.nlink = self.merged_links(cx, &places)?;
                Ok(Reply::Attr(attr))
            }
            (reply, _) => Ok(reply),
        }
    }

    /// Whether `name` shows in `parent` on a branch below `below` (its number).
    pub(super) fn exists_below(&self, cx: &Caller, parent: &[Place], name: &OsStr, below: u32) -> Result<bool> {
        let Some(start) = parent.iter().position(|p| p.branch == below) else {
            // The directory is not on that branch (it is being created there): all its places
            // are below.
            return self.find(cx, parent, name).map(|f| f.inspect(|f| self.forget_places(&f.places)).is_some());
        };
        let found = self.find(cx, &parent[start + 1..], name)?;
        Ok(found.inspect(|f| self.forget_places(&f.places)).is_some())
    }

    /// Keep a found object: its number, its places and where it was seen. Returns its entry.
    pub(super) fn remember(&self, parent: NodeId, name: &OsStr, found: Found) -> Entry {
        let kind = found.entry.attr.kind;
        let origin = self.origin_of(found.places[0], kind);
        let mut table = self.nodes.lock();
        let id = origin.unwrap_or_else(|| table.id_of(found.places[0]));
        let seen = Some((parent.0, name.to_owned()));
        let old = match table.nodes.get_mut(&id) {
            Some(n) => {
                n.lookups += 1;
                n.kind = kind;
                n.parent = seen;
                std::mem::replace(&mut n.places, found.places)
            }
            None => {
                table.nodes.insert(id, UNode { kind, lookups: 1, places: found.places, parent: seen });
                Vec::new()
            }
        };
        drop(table);
        self.forget_places(&old);
        Entry { node: NodeId(id), ..found.entry }
    }

    pub(super) fn lookup(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Result<Entry> {
        let places = self.dir_places(parent)?;
        let found = self.find(cx, &places, name)?.ok_or_else(enoent)?;
        Ok(self.remember(parent, name, found))
    }

    pub(super) fn forget(&self, node: NodeId, nlookup: u64) {
        if node == NodeId::ROOT {
            return;
        }
        let mut table = self.nodes.lock();
        let Some(n) = table.nodes.get_mut(&node.0) else {
            return;
        };
        n.lookups = n.lookups.saturating_sub(nlookup);
        if n.lookups > 0 {
            return;
        }
        let gone = table.nodes.remove(&node.0).map(|n| n.places).unwrap_or_default();
        drop(table);
        self.forget_places(&gone);
    }
}
