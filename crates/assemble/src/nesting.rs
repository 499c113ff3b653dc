//! Keeping the directories a stack stores in apart from its mount point.
//!
//! A mount point inside a storage directory makes the daemon its own client: listing that
//! directory looks at the mount point, the kernel asks the daemon about it, and the daemon's
//! thread sleeps in the kernel for an answer only it could give, unkillably (#29). A storage
//! directory inside the mount point would be hidden by the mount. Both are refused before
//! anything is mounted. Directories are told apart by (device, inode) along the whole path up
//! to `/`, never by name, so that symlinks and bind mounts (whose root shows its source's
//! device and inode) are seen through.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A directory as the kernel knows it.
#[derive(Clone, Copy, PartialEq, Eq)]
struct DirId {
    dev: u64,
    ino: u64,
}

fn dir_id(path: &Path) -> Option<DirId> {
    std::fs::metadata(path).ok().map(|m| DirId { dev: m.dev(), ino: m.ino() })
}

/// `path` and every directory above it, up to `/`, as the kernel resolves them.
fn ids_up_to_root(path: &Path) -> Vec<DirId> {
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_owned());
    canonical.ancestors().filter_map(dir_id).collect()
}

/// Refuse (with the line to show) if the storage directory `dir` (`what`: "the lower", "branch
/// 'b'") is the mount point, holds it or lies inside it. Paths that do not exist pass: the
/// checks that need them name what is missing.
pub fn check_apart(what: &str, dir: &Path, mountpoint: &Path) -> crate::Result<()> {
    let (Some(storage), Some(mount)) = (dir_id(dir), dir_id(mountpoint)) else { return Ok(()) };
    let (d, m) = (dir.display(), mountpoint.display());
    if storage == mount {
        return Err(crate::Error::Nested(format!("mount point {m} is {what} {d} itself (the daemon would wait on itself); choose a mount point outside it")));
    }
    if ids_up_to_root(mountpoint).contains(&storage) {
        return Err(crate::Error::Nested(format!("mount point {m} lies inside {what} {d} (the daemon would wait on itself); choose a mount point outside it")));
    }
    if ids_up_to_root(dir).contains(&mount) {
        return Err(crate::Error::Nested(format!("{what} {d} lies inside the mount point {m} (the mount would hide it); choose a mount point outside it")));
    }
    Ok(())
}

/// [`check_apart`] for every directory of [`crate::dirs::storage_dirs`]: LOWER first, then
/// the branches.
pub fn check_storage_apart(dirs: &[PathBuf], mountpoint: &Path) -> crate::Result<()> {
    for (i, dir) in dirs.iter().enumerate() {
        check_apart(if i == 0 { "the lower" } else { "the branch" }, dir, mountpoint)?;
    }
    Ok(())
}
