//! Which lower locks a command takes (see [`plyfs_stack::lowerlock`]), so that two users of one
//! lower directory that would corrupt each other are refused instead.
//!
//! A mount takes each directory it stores in: exclusive if it writes it alone, shared if it
//! writes it beside other `-o shared` mounts or only reads it (a read-only branch, `-o ro`).
//! `plyfs serve` takes them as an unshared mount does, and so do the offline tools that write
//! (`encode`, `fsck`); those that only read (`decode`, `du`) take them shared, so that they do
//! not read a tree an unshared mount is changing. A remote stack's server holds its locks.

use std::path::{Path, PathBuf};

use plyfs_stack::lowerlock::{self, Claim, LowerLock};
use plyfs_stack::shared::LockKind;
use plyfs_stack::spec::{BranchMode, LayerSpec};

const MOUNT_ADVICE: &str = "unmount it, or mount both with -o shared";
const TOOL_ADVICE: &str = "unmount it (or wait for it to finish) first";

/// How a command uses the lowers it stores in.
#[derive(Clone, Copy)]
pub enum Use {
    /// A mount; `shared` with `-o shared`, `read_only` with `-o ro`.
    Mount { shared: bool, read_only: bool },
    /// `plyfs serve`: as an unshared mount.
    Serve,
    /// An offline tool, which writes or only reads.
    Tool { writes: bool },
}

impl Use {
    fn claim(self, mode: BranchMode) -> Claim {
        let branch_writes = mode == BranchMode::ReadWrite;
        let (writes, alone, advice) = match self {
            Use::Mount { shared, read_only } => (branch_writes && !read_only, !shared, MOUNT_ADVICE),
            Use::Serve => (branch_writes, true, MOUNT_ADVICE),
            Use::Tool { writes } => (branch_writes && writes, true, TOOL_ADVICE),
        };
        let kind = if writes && alone { LockKind::Exclusive } else { LockKind::Shared };
        Claim { kind, writes, advice }
    }
}

/// Take the lock of every directory a stack over `lower` stores in (see
/// [`crate::dirs::storage_dirs`]), each in the mode its branch is used in; `who` says what
/// holds them ("mounted at /mnt/a").
pub fn take_all(lower: Option<&Path>, branches: &[String], specs: &[LayerSpec], how: Use, who: &str) -> crate::Result<Vec<LowerLock>> {
    let mut held = Vec::new();
    // (A directory that is not there is the stack's to report.)
    for (dir, mode) in storage_modes(lower, branches, specs).into_iter().filter(|(d, _)| d.is_dir()) {
        held.extend(lowerlock::take(&dir, how.claim(mode), who).map_err(crate::Error::InUse)?);
    }
    Ok(held)
}

/// The directories of [`crate::dirs::storage_dirs`], each with the mode of the branch it is
/// (LOWER of a stack without fan-out, and a directory no branch takes, are read-write); a
/// directory that two branches take is read-write if either is.
fn storage_modes(lower: Option<&Path>, branches: &[String], specs: &[LayerSpec]) -> Vec<(PathBuf, BranchMode)> {
    let mut assigned = specs.to_vec();
    let cli = branches.iter().filter_map(|b| crate::tree::parse_branch_arg(b).ok()).collect();
    let modes = match plyfs_stack::assign_branch_dirs(&mut assigned, crate::registry(), crate::lower::BOTTOM_KINDS, lower.map(Path::to_owned), cli) {
        Ok(_) => crate::dirs::spec_branch_dirs(&assigned),
        Err(_) => Vec::new(),
    };
    let canonical = |d: &Path| d.canonicalize().unwrap_or_else(|_| d.to_owned());
    let mode_of = |dir: &Path| {
        let taken: Vec<BranchMode> = modes.iter().filter(|(d, _)| canonical(d) == dir).map(|(_, m)| *m).collect();
        if taken.is_empty() || taken.contains(&BranchMode::ReadWrite) {
            BranchMode::ReadWrite
        } else {
            BranchMode::ReadOnly
        }
    };
    crate::dirs::storage_dirs(lower, branches, specs).into_iter().map(|d| (d.clone(), mode_of(&d))).collect()
}
