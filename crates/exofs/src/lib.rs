//! exofs: a file system of plyfs's own on an exodisk volume (thesis §4.1), built on the client
//! library alone, and the plyfs bottom layer over it. See `docs/exodisk.md`.
//!
//! - [`format`]: how an inode and a directory are laid out in exonode entries.
//! - [`fs`]: the file system over the exodisk client.
//! - [`bench`]: the thesis's micro-benchmarks (`plyfs exodisk bench`).
//! - [`Error`]: what goes wrong opening exofs or benchmarking, naming the service's socket.

pub mod bench;
mod error;
pub mod format;
pub mod fs;
pub mod layer;

pub use error::Error;
