//! # plyfs-layers
//!
//! One module per layer. [`registry`] lists them all for stack building and `plyfs layers`.

pub mod null;
pub mod trace;

use plyfs_stack::LayerFactory;

/// Every layer this build knows.
pub fn registry() -> &'static [LayerFactory] {
    static REGISTRY: [LayerFactory; 2] = [null::FACTORY, trace::FACTORY];
    &REGISTRY
}
