//! # plyfs-layers
//!
//! One module per layer. [`registry`] lists them all for stack building and `plyfs layers`.
//! The size-changing layers (`copy`, `uuencode`, `gzip`, `zstd`, `lz4`) are each a codec; the
//! `plyfs-sca` framework does the rest. `crypt` is a codec too, with its volume keys.
//! `remote` (a stack served elsewhere, as a bottom layer) and `ext`/`py` (layers hosted in
//! another process, or in Python) reach other processes through the `plyfs-transport`
//! protocol.

pub mod cache;
pub mod copy;
pub mod crypt;
mod error;
pub mod ext;
pub mod fault;
pub mod gzip;
pub mod lazy;
mod ids;
pub mod mirror;
pub mod lz4;
pub mod null;
mod paths;
pub mod remote;
pub mod trace;
pub mod transfer;
pub mod union;
pub mod uuencode;
pub mod version;
pub mod zstd;

pub use error::Error;
use plyfs_stack::LayerFactory;

/// Every layer this build knows.
pub fn registry() -> &'static [LayerFactory] {
    static REGISTRY: [LayerFactory; 16] = [
        null::FACTORY,
        trace::FACTORY,
        copy::FACTORY,
        uuencode::FACTORY,
        gzip::FACTORY,
        zstd::FACTORY,
        lz4::FACTORY,
        crypt::FACTORY,
        union::FACTORY,
        mirror::FACTORY,
        cache::FACTORY,
        version::FACTORY,
        fault::FACTORY,
        lazy::FACTORY,
        ext::EXT_FACTORY,
        ext::PY_FACTORY,
    ];
    &REGISTRY
}
