//! # plyfs-assemble
//!
//! A stack put together from its specification, and the things that run it. `plyfs` (the
//! binary) parses its arguments and prints; everything it does with a stack is here, where the
//! tests and other programs can call it too:
//!
//! - [`registry`]: every layer this build knows;
//! - [`lower`]: what a stack stands on (a directory, exofs on an exodisk service, a remote
//!   stack), and [`tree`]: the stack over it, linear or with a fan-out layer's branches;
//! - [`dirs`], [`locks`] and [`nesting`]: the directories it stores in, found, locked against
//!   other users, and kept apart from the mount point;
//! - [`mount`]: a mount made and served until it is unmounted; [`serve`]: a stack served to
//!   other processes and machines, and layers hosted for `ext` layers;
//! - [`offline`]: `encode`, `decode`, `fsck` and `du`, which run a stack in this process;
//! - [`umount`]: unmounting, and cleaning up after a daemon that died.

pub mod dirs;
mod error;
pub mod locks;
pub mod lower;
pub mod mount;
pub mod nesting;
pub mod offline;
pub mod policy;
pub mod serve;
pub mod tree;
pub mod umount;

pub use error::{Error, Result};
use plyfs_stack::LayerFactory;

/// Every layer this build knows.
pub fn registry() -> &'static [LayerFactory] {
    plyfs_layers::registry()
}

/// A crypt volume to unlock: its name (for the prompt), where its configuration was read (for
/// errors), and the configuration.
pub type FoundVolume = (String, String, plyfs_layers::crypt::keys::VolumeConfig);
