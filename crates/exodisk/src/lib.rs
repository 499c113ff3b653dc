//! Exodisk (Grimm, MIT 1996, in `seeds/001`): a raw volume whose protection (who may touch which
//! sectors) is kept by a small trusted service, and whose management (layout, allocation,
//! caching, persistence) is left to untrusted libraries.
//!
//! - [`seal`]: protection metadata sealed under the volume key and bound to its sector.
//! - [`content`]: extent data sealed at rest under the volume key, one seal per sector.
//! - [`object`]: self-protected extents and exonodes.
//! - [`freemap`]: the conservative free map.
//! - [`layout`]: the superblock, the key file, formatting.
//! - [`scan`]: the start-up scan and `fsck`.
//! - [`disk`]: the volume, with direct I/O.
//! - [`record`]: the write log of a service (`serve --record`) and its replay.
//! - [`Error`]: what goes wrong managing a volume, naming the file or socket; an operation's
//!   error is [`core::ExoError`], the errno and line the wire carries.

pub mod client;
pub mod content;
pub mod core;
pub mod disk;
pub mod engine;
mod error;
pub mod freemap;
pub mod layout;
pub mod object;
pub mod proto;
pub mod record;
pub mod scan;
pub mod seal;
pub mod service;
pub mod shm;

pub use error::{Error, SuperblockFault};
