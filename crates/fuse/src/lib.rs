//! # plyfs-fuse
//!
//! The FUSE front end: the only crate that speaks FUSE.
//!
//! - [`fs`] turns kernel requests into stack operations, chooses the passthrough fast path or
//!   the cached path for each open, and exposes every level under `.plyfs/` (fan-in).
//! - [`classic`] agrees on features with the kernel (fuser's handshake). Two transports then
//!   carry the requests: [`devloop`] (plyfs's own `/dev/fuse` loop) and [`uring`] (FUSE over
//!   io_uring, one queue per CPU); both decode them alike ([`uring::dispatch`]) and check who
//!   may use the mount ([`devloop::Access`]).
//! - [`mount`] mounts and unmounts, directly or through `fusermount3`.
//! - [`control`] is the socket that carries extended operations from `plyfs op` to the stack.
//! - [`mountinfo`] finds the mount a path is on.
//! - [`Error`] is what fails around the requests (mounting, unmounting, the transports), naming
//!   the mount point or the transport.

pub mod classic;
pub mod control;
pub mod devloop;
mod error;
pub mod fs;
pub mod mount;
pub mod mountinfo;
pub mod uring;

pub use error::Error;
pub use fs::{FanIn, FrontOptions, FrontStatus, IoMode, LEVELS_DIR};
pub use mount::{check_mountpoint, unmount, MountError, MountRequest, Mounted, Transport, Unmounted, UringChoice};
