//! Inode numbers across branches (`seeds/002` §4.5), for the fan-out layers.
//!
//! An object's number is made from a place it has on a branch: the branch's stable number in
//! bits 48..55 and the branch's own node id (the lower inode number) below, so numbers are unique
//! across branches and the same after a remount. Node ids that do not fit get a number of their
//! own for the life of the mount, above `SYNTHETIC`.

use std::collections::HashMap;

use plyfs_stack::NodeId;

/// Bits of a branch's own node id kept in a union node id.
const ID_BITS: u32 = 48;
/// Branch numbers fit in 7 bits: at most this many branches over the life of a mount.
pub const MAX_BRANCH_NUMBERS: u32 = 127;
/// Numbers from here on are handed out for the life of the mount.
const SYNTHETIC: u64 = 1 << 55;

/// Where an object is on one branch: the branch's number and the node at its top level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Place {
    pub branch: u32,
    pub node: NodeId,
}

/// The number an object found at `place` has, unless it records an origin.
pub fn natural_id(place: Place) -> Option<u64> {
    (place.node.0 < (1 << ID_BITS) && place.branch <= MAX_BRANCH_NUMBERS).then(|| (u64::from(place.branch) << ID_BITS) | place.node.0)
}

/// An object that knows the directory and name it was last seen under (none for the root).
pub trait Named {
    fn seen_as(&self) -> Option<&(u64, std::ffi::OsString)>;
}

/// The objects a fan-out layer knows, by number, with the numbers given out so far.
pub struct NodeTable<N> {
    pub nodes: HashMap<u64, N>,
    synthetic: HashMap<Place, u64>,
    next_synthetic: u64,
}

impl<N> NodeTable<N> {
    pub fn new() -> NodeTable<N> {
        NodeTable { nodes: HashMap::new(), synthetic: HashMap::new(), next_synthetic: SYNTHETIC }
    }

    /// The path of object `id` from the root ("" for the root), as far as its parents are known.
    pub fn path_of(&self, id: u64) -> String
    where
        N: Named,
    {
        let mut parts = Vec::new();
        let mut at = id;
        while let Some((parent, name)) = self.nodes.get(&at).and_then(N::seen_as) {
            parts.push(name.to_string_lossy().into_owned());
            at = *parent;
            if parts.len() > 4096 {
                break;
            }
        }
        parts.reverse();
        parts.join("/")
    }

    /// The number of an object whose origin is `place`.
    pub fn id_of(&mut self, place: Place) -> u64 {
        if let Some(id) = natural_id(place) {
            return id;
        }
        if let Some(id) = self.synthetic.get(&place) {
            return *id;
        }
        let id = self.next_synthetic;
        self.next_synthetic += 1;
        self.synthetic.insert(place, id);
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_across_branches_and_stable() {
        let a = Place { branch: 0, node: NodeId(12) };
        let b = Place { branch: 1, node: NodeId(12) };
        assert_ne!(natural_id(a), natural_id(b));
        assert_eq!(natural_id(a), Some(12));
        assert_eq!(natural_id(b), Some((1 << 48) | 12));
        let mut t = NodeTable::<()>::new();
        let big = Place { branch: 1, node: NodeId(1 << 50) };
        let id = t.id_of(big);
        assert!((SYNTHETIC..=NodeId::MAX).contains(&id));
        assert_eq!(t.id_of(big), id);
        assert_ne!(t.id_of(Place { branch: 2, node: NodeId(1 << 50) }), id);
        assert!(natural_id(Place { branch: MAX_BRANCH_NUMBERS, node: NodeId((1 << 48) - 1) }).unwrap() < SYNTHETIC);
    }
}
