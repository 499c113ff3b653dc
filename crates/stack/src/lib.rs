//! # plyfs-stack
//!
//! The heart of plyfs: a stack of layers that all speak one symmetric interface.
//!
//! - [`Op`] is an operation with its descriptor (name, typed arguments); [`Reply`] its answer;
//!   [`OpHeader`] its owned form, which a transport sends.
//! - [`Layer`] is what a layer implements: [`Layer::call`] for the operations it cares about,
//!   [`bypass`] for the rest. Extended operations ([`Op::Extended`]) travel down the same way.
//! - [`Level`] is a layer as seen from above; [`Stack`] is the built stack, top to bottom.
//! - [`LowerDir`] is the bottom layer, which owns the lower directory.
//! - [`spec`] parses `--stack` specifications and TOML configurations, trees included.
//! - A fan-out layer ([`Build::FanOut`]) has several [`Branch`]es, each a stack of its own.
//!
//! This crate knows nothing of FUSE: tests and offline tools run stacks in-process through
//! [`Stack::top`].

pub mod admission;
mod creds;
mod error;
pub mod glob;
pub mod ioctl;
mod layer;
mod lowerdir;
pub mod lowerlock;
mod op;
pub mod private;
pub mod progress;
pub mod readonly;
pub mod setid;
pub mod shared;
pub mod spec;
mod stack;
mod types;
mod watch;

pub use error::{Error, Result};
pub use layer::{bypass, unsupported, DataPath, ExtOpInfo, Invalidator, Layer, Level, FILE_HEAD_BYTES};
pub use lowerdir::{has_capability, raise_fd_limit, LowerDir};
pub use op::header as op_header;
pub use op::{Arg, Op, OpHeader, OpKind, Reply};
pub use stack::{
    assign_branch_dirs, check_all_params, check_branch_lowers, collapse_specs, is_fan_out, order_warnings, BadParam, Branch,
    BranchBuilder, BranchLower, Build, BuildArgs, FanOutArgs, LayerFactory, NamedLevel, Stack, COLLAPSE_PARAM, MAX_VIEWS, NAME_PARAM,
};
pub use types::*;
