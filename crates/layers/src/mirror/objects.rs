//! The objects the kernel knows: the mirror's own numbers for them, their nodes on each branch
//! (found by name from the parent when first needed), and the paths the log notes them by.

use std::ffi::OsStr;

use plyfs_stack::{Entry, Error, NodeId, Result};

use super::{daemon, MNode, Mirror};
use crate::ids::Place;

impl Mirror {
    /// The object's node on branch `b`, found by name from its parent if not known yet.
    pub(super) fn resolve(&self, id: NodeId, b: usize) -> Result<NodeId> {
        let (parent, name) = {
            let table = self.nodes.lock();
            let n = table.nodes.get(&id.0).ok_or(Error::Os(libc::ESTALE))?;
            if let Some(node) = n.places[b] {
                return Ok(node);
            }
            n.parent.clone().ok_or(Error::Os(libc::ESTALE))?
        };
        self.place_by_name(id, b, NodeId(parent), &name)
    }

    /// Find object `id` on branch `b` as `name` in `parent`, and keep its place there.
    fn place_by_name(&self, id: NodeId, b: usize, parent: NodeId, name: &OsStr) -> Result<NodeId> {
        let dir = self.resolve(parent, b)?;
        let e = self.top(b).lookup(&daemon(), dir, name)?;
        let mut table = self.nodes.lock();
        match table.nodes.get_mut(&id.0) {
            Some(n) if n.places[b].is_none() => {
                n.places[b] = Some(e.node);
                Ok(e.node)
            }
            Some(n) => {
                let known = n.places[b].expect("checked");
                drop(table);
                self.top(b).forget(&daemon(), e.node, 1);
                Ok(known)
            }
            None => {
                drop(table);
                self.top(b).forget(&daemon(), e.node, 1);
                Err(Error::Os(libc::ESTALE))
            }
        }
    }

    /// Under the names lock: if the object named `name` in `parent` is one the mirror knows,
    /// find it on every in-sync branch it is not known on yet. Where it cannot be found, the
    /// change that follows finds the branch's fault.
    pub(super) fn pin(&self, parent: NodeId, name: &OsStr) {
        let Ok(r) = self.reader() else { return };
        let Ok(e) = self.resolve(parent, r).and_then(|dir| self.top(r).lookup(&daemon(), dir, name)) else { return };
        self.top(r).forget(&daemon(), e.node, 1);
        let missing: Vec<(NodeId, usize)> = {
            let mut table = self.nodes.lock();
            let id = table.id_of(Place { branch: r as u32, node: e.node });
            let Some(n) = table.nodes.get(&id) else { return };
            self.in_sync().into_iter().filter(|b| n.places[*b].is_none()).map(|b| (NodeId(id), b)).collect()
        };
        for (id, b) in missing {
            let _ = self.place_by_name(id, b, parent, name);
        }
    }

    /// Keep an object found (or made) as `name` in `parent`: `found` is where, on which branch;
    /// each such place carries one lookup, which the mirror keeps or drops.
    pub(super) fn remember(&self, parent: NodeId, name: &OsStr, reader: usize, found: &[(usize, Entry)]) -> Entry {
        let (_, top) = found.iter().find(|(b, _)| *b == reader).copied().unwrap_or(found[0]);
        let mut table = self.nodes.lock();
        let id = table.id_of(Place { branch: reader as u32, node: top.node });
        let n = self.branches.len();
        let node =
            table.nodes.entry(id).or_insert_with(|| MNode { kind: top.attr.kind, lookups: 0, places: vec![None; n], parent: None });
        node.lookups += 1;
        node.kind = top.attr.kind;
        node.parent = Some((parent.0, name.to_owned()));
        let mut extra = Vec::new();
        for (b, e) in found {
            match node.places[*b] {
                None => node.places[*b] = Some(e.node),
                Some(known) if known == e.node => extra.push((*b, e.node)),
                Some(old) => {
                    node.places[*b] = Some(e.node);
                    extra.push((*b, old));
                }
            }
        }
        drop(table);
        for (b, node) in extra {
            self.top(b).forget(&daemon(), node, 1);
        }
        Entry { node: NodeId(id), ..top }
    }

    pub(super) fn forget(&self, id: NodeId, nlookup: u64) {
        if id == NodeId::ROOT {
            return;
        }
        let mut table = self.nodes.lock();
        let Some(n) = table.nodes.get_mut(&id.0) else { return };
        n.lookups = n.lookups.saturating_sub(nlookup);
        if n.lookups > 0 {
            return;
        }
        let places = table.nodes.remove(&id.0).map(|n| n.places).unwrap_or_default();
        drop(table);
        for (b, node) in places.into_iter().enumerate() {
            if let Some(node) = node {
                self.top(b).forget(&daemon(), node, 1);
            }
        }
    }

    /// The object's path from the root, for the log ("" is the root).
    pub(super) fn path_of(&self, id: NodeId) -> String {
        self.nodes.lock().path_of(id.0)
    }

    pub(super) fn child_path(&self, parent: NodeId, name: &OsStr) -> String {
        let p = self.path_of(parent);
        if p.is_empty() {
            name.to_string_lossy().into_owned()
        } else {
            format!("{p}/{}", name.to_string_lossy())
        }
    }
}
