//! # plyfs-sca
//!
//! Support for size-changing algorithms (SCAs) in stacked layers, after Zadok et al., *Fast
//! Indexing* (`seeds/003`). A compressor or an encoder implements [`Codec`] (`encode` and
//! `decode` of one chunk) and [`build_sca_layer`] turns it into a layer; this crate does the
//! rest:
//!
//! - [`format`]: the lower file, a header and a log of checksummed records;
//! - [`chunkmap`] and [`index`]: the index mapping upper chunks to encoded records, with the
//!   decoded size, so `stat` never decodes anything;
//! - [`file`]: reads, writes in the middle at the cost of one chunk, fast tails for appends,
//!   the four truncate cases, index validation and rebuilding, compaction;
//! - [`layer`]: the [`plyfs_stack::Layer`] that serves upper files from all this.

pub mod chunkmap;
mod chunks;
pub mod codec;
mod error;
pub mod file;
pub mod format;
pub mod index;
pub mod layer;
pub mod mem;
pub mod synth;

pub use codec::{Codec, FileFacts, Place};
pub use error::Error;
pub use file::{Engine, LowerIo, ScaFile};
pub use layer::{build_sca_layer, build_sca_layer_padded, CHUNK_PARAM, EXT_OPS, FAST_TAILS_PARAM};
