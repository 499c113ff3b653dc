//! The paths of the nodes the kernel holds, for linear layers that choose by path (`fault`'s
//! globs, `version`'s store). Each node is known by the directory and name it was last seen
//! under, for as long as the layer above holds lookups of it.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};

use parking_lot::Mutex;
use plyfs_stack::{NodeId, Op, Reply};

struct Seen {
    parent: NodeId,
    name: OsString,
    lookups: u64,
}

pub struct PathTable {
    names: Mutex<HashMap<NodeId, Seen>>,
}

fn lossy(name: &OsStr) -> String {
    name.to_string_lossy().into_owned()
}

impl PathTable {
    pub fn new() -> PathTable {
        PathTable { names: Mutex::new(HashMap::new()) }
    }

    /// One more lookup of `node`, seen as `name` in `parent`.
    pub fn seen(&self, parent: NodeId, name: &OsStr, node: NodeId) {
        let mut names = self.names.lock();
        let slot = names.entry(node).or_insert(Seen { parent, name: OsString::new(), lookups: 0 });
        slot.parent = parent;
        slot.name = name.to_owned();
        slot.lookups += 1;
    }

    /// Note the lookups a reply to `op` carries: the entry of a lookup or of what was made, and
    /// each entry of a `readdirplus`.
    pub fn learn(&self, op: &Op<'_>, reply: &Reply) {
        match (op, reply) {
            (
                Op::Lookup { parent, name }
                | Op::Create { parent, name, .. }
                | Op::MkDir { parent, name, .. }
                | Op::MkNod { parent, name, .. }
                | Op::SymLink { parent, name, .. }
                | Op::Link { new_parent: parent, new_name: name, .. },
                Reply::Entry(e) | Reply::Created(e, _),
            ) => self.seen(*parent, name, e.node),
            (Op::ReadDir { node, plus: true, .. }, Reply::Dir(entries)) => {
                for e in entries {
                    if let Some(entry) = &e.entry {
                        self.seen(*node, &e.name, entry.node);
                    }
                }
            }
            _ => {}
        }
    }

    /// `node` is now `name` in `parent` (a rename), with the same lookups.
    pub fn moved(&self, node: NodeId, parent: NodeId, name: &OsStr) {
        if let Some(slot) = self.names.lock().get_mut(&node) {
            slot.parent = parent;
            slot.name = name.to_owned();
        }
    }

    /// The layer above dropped `nlookup` lookups of `node`. Returns whether it is gone.
    pub fn forget(&self, node: NodeId, nlookup: u64) -> bool {
        let mut names = self.names.lock();
        let Some(slot) = names.get_mut(&node) else { return false };
        slot.lookups = slot.lookups.saturating_sub(nlookup);
        if slot.lookups > 0 {
            return false;
        }
        names.remove(&node);
        true
    }

    /// The directory and name `node` was last seen under.
    pub fn parent_of(&self, node: NodeId) -> Option<(NodeId, OsString)> {
        self.names.lock().get(&node).map(|s| (s.parent, s.name.clone()))
    }

    /// The path of `node` from the root ("" for the root), if every directory on the way is known.
    pub fn path_of(&self, node: NodeId) -> Option<String> {
        self.path_with(node, lossy)
    }

    /// The path of `name` in directory `parent`.
    pub fn child_path(&self, parent: NodeId, name: &OsStr) -> Option<String> {
        self.child_path_with(parent, name, lossy)
    }

    /// [`PathTable::path_of`], with each name written by `text` (a layer that must find names
    /// that are not UTF-8 again escapes them).
    pub fn path_with(&self, node: NodeId, text: impl Fn(&OsStr) -> String) -> Option<String> {
        let names = self.names.lock();
        let mut parts = Vec::new();
        let mut at = node;
        while at != NodeId::ROOT {
            let seen = names.get(&at)?;
            parts.push(text(&seen.name));
            at = seen.parent;
            if parts.len() > 4096 {
                return None;
            }
        }
        parts.reverse();
        Some(parts.join("/"))
    }

    /// [`PathTable::child_path`], with each name written by `text`.
    pub fn child_path_with(&self, parent: NodeId, name: &OsStr, text: impl Fn(&OsStr) -> String) -> Option<String> {
        let dir = self.path_with(parent, &text)?;
        let name = text(name);
        Some(if dir.is_empty() { name } else { format!("{dir}/{name}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_lookups_renames_and_forgets() {
        let t = PathTable::new();
        t.seen(NodeId::ROOT, OsStr::new("d"), NodeId(5));
        t.seen(NodeId(5), OsStr::new("f"), NodeId(9));
        assert_eq!(t.path_of(NodeId(9)).as_deref(), Some("d/f"));
        assert_eq!(t.child_path(NodeId(5), OsStr::new("g")).as_deref(), Some("d/g"));
        assert_eq!(t.child_path(NodeId::ROOT, OsStr::new("g")).as_deref(), Some("g"));
        t.moved(NodeId(9), NodeId::ROOT, OsStr::new("top"));
        assert_eq!(t.path_of(NodeId(9)).as_deref(), Some("top"));
        assert_eq!(t.path_of(NodeId(77)), None, "an unknown node has no path");
        t.seen(NodeId(5), OsStr::new("f"), NodeId(9));
        assert!(!t.forget(NodeId(9), 1));
        assert!(t.forget(NodeId(9), 1));
        assert_eq!(t.path_of(NodeId(9)), None);
    }
}
