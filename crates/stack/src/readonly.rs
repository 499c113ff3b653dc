//! Read-only mounts (`-o ro`). The kernel refuses every write a user makes on a read-only
//! mount, but layers also write on their own: a rebuilt index, a repaired mirror branch, a
//! directory given an id. Each bottom layer (the lower directory, a remote stack, exofs)
//! refuses those with `EROFS` when the process serves a read-only mount, so no layer above can
//! change what is stored, whatever it tries; layers treat `EROFS` as "not now" and carry on
//! reading. `mount -o remount,ro` (and `rw`) switches it while the mount runs, through the
//! control socket's [`READ_ONLY_OP`].

use std::sync::atomic::{AtomicBool, Ordering};

use crate::op::Op;
use crate::{Error, Result};

static READ_ONLY: AtomicBool = AtomicBool::new(false);

/// The control socket's operation that switches a running mount (`on` or `off`), which
/// `mount -o remount,ro|rw` sends.
pub const READ_ONLY_OP: &str = "mount-read-only";

/// Make the bottom layers refuse every change from now on (or accept them again). A daemon
/// serves one mount and sets this before building its stack, and again at a remount.
pub fn set_read_only(on: bool) {
    READ_ONLY.store(on, Ordering::SeqCst);
}

/// Whether the process serves a read-only mount now.
pub fn read_only() -> bool {
    READ_ONLY.load(Ordering::Relaxed)
}

/// Whether `op` would change what is stored: anything that writes, makes, removes or renames,
/// sets attributes or extended attributes, or opens a file for writing.
pub fn changes_storage(op: &Op<'_>) -> bool {
    match *op {
        Op::SetAttr { .. }
        | Op::MkNod { .. }
        | Op::MkDir { .. }
        | Op::Unlink { .. }
        | Op::RmDir { .. }
        | Op::SymLink { .. }
        | Op::Rename { .. }
        | Op::Link { .. }
        | Op::Create { .. }
        | Op::Write { .. }
        | Op::SetXattr { .. }
        | Op::RemoveXattr { .. }
        | Op::Fallocate { .. } => true,
        Op::Open { flags, .. } => flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0,
        Op::Ioctl { cmd, .. } => crate::ioctl::sets(cmd),
        _ => false,
    }
}

/// `EROFS` for an operation a bottom layer must refuse because the mount is read-only now.
pub fn check(op: &Op<'_>) -> Result<()> {
    if read_only() && changes_storage(op) {
        return Err(Error::Os(libc::EROFS));
    }
    Ok(())
}
