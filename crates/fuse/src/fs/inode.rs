//! FUSE inode numbers. The node id the kernel names and `st_ino` are one number here (fuser
//! sends the same value for both): a node of one view of the stack, packed. The top view uses
//! the stack's node ids as they are; the view below layer `i` puts `i + 1` in the top byte.
//! `.plyfs` itself has the reserved top byte `0xff`, which no view has
//! ([`plyfs_stack::MAX_VIEWS`]).

use plyfs_stack::NodeId;

/// The inode number of `.plyfs`.
pub(super) const LEVELS_DIR_INO: u64 = (0xff << 56) | 1;
const VIEW_SHIFT: u32 = 56;

/// The inode number of `node` of view `view` (0 for the top).
pub(super) fn pack_ino(view: usize, node: NodeId) -> u64 {
    ((view as u64) << VIEW_SHIFT) | node.0
}

/// The view and node an inode number stands for.
pub(super) fn unpack_ino(ino: u64) -> (usize, NodeId) {
    ((ino >> VIEW_SHIFT) as usize, NodeId(ino & NodeId::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn unpack_gives_back_what_was_packed(view in 0..=plyfs_stack::MAX_VIEWS, node in 0..=NodeId::MAX) {
            prop_assert_eq!(unpack_ino(pack_ino(view, NodeId(node))), (view, NodeId(node)));
        }

        #[test]
        fn the_top_view_keeps_the_stack_ids(node in 0..=NodeId::MAX) {
            prop_assert_eq!(pack_ino(0, NodeId(node)), node);
        }

        #[test]
        fn no_view_packs_to_the_levels_dir(view in 0..=plyfs_stack::MAX_VIEWS, node in 0..=NodeId::MAX) {
            prop_assert_ne!(pack_ino(view, NodeId(node)), LEVELS_DIR_INO);
        }
    }
}
