//! Files plyfs makes for itself (logs, state, runtime directories): private to the user who
//! runs plyfs, whatever the umask (daemons run with umask 0, since FUSE hands them modes already
//! masked), and never opened through a symbolic link another user could plant.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Open the log file `path` for appending, creating it mode 0600. The last component is not
/// followed if it is a symbolic link (`O_NOFOLLOW`), and the descriptor does not outlive an
/// `exec` (`O_CLOEXEC`). An existing file must be a regular file, owned by the user running
/// plyfs, with no other hard link; a looser mode is narrowed to 0600. The error names the file.
pub fn open_log(path: &Path) -> io::Result<File> {
    let named = |what: String| io::Error::new(io::ErrorKind::PermissionDenied, format!("log {}: {what}", path.display()));
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => named("is a symbolic link; refusing to follow it".into()),
            _ => io::Error::new(e.kind(), format!("log {}: {e}", path.display())),
        })?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(named("is not a regular file; refusing to write to it".into()));
    }
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(named(format!("is owned by uid {}, not by uid {me} who runs plyfs; refusing to write to it", meta.uid())));
    }
    if meta.nlink() > 1 {
        return Err(named(format!("has {} hard links; refusing to write to it", meta.nlink())));
    }
    if meta.mode() & 0o077 != 0 {
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    // O_NONBLOCK was only there so that opening a FIFO cannot hang; writes block as usual.
    let flags = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_GETFL) };
    if flags >= 0 {
        unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_SETFL, flags & !libc::O_NONBLOCK) };
    }
    Ok(file)
}

/// Make `dir` (its parent must exist) mode 0700 if it is missing, and check that it is what a
/// private directory must be: a real directory (not a symbolic link), owned by `uid`, that no
/// one else may enter. The error is one line naming the directory and the cause.
pub fn private_dir(dir: &Path, uid: u32) -> io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {
            // The umask may have narrowed it further; never wider.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", dir.display()))),
    }
    check_private_dir(dir, uid)
}

/// Whether `dir` is a real directory (lstat: not a symbolic link) owned by `uid` with no
/// access for group or others; the error says which of those fails.
pub fn check_private_dir(dir: &Path, uid: u32) -> io::Result<()> {
    let refuse = |why: String| {
        io::Error::new(io::ErrorKind::PermissionDenied, format!("{}: {why}; refusing to use it", dir.display()))
    };
    let meta = std::fs::symlink_metadata(dir).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
    if meta.file_type().is_symlink() {
        return Err(refuse("is a symbolic link".into()));
    }
    if !meta.is_dir() {
        return Err(refuse("is not a directory".into()));
    }
    if meta.uid() != uid {
        return Err(refuse(format!("is owned by uid {}, not uid {uid}", meta.uid())));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(refuse(format!("has mode {:04o}, not 0700", meta.mode() & 0o7777)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_is_private_and_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let old = unsafe { libc::umask(0) };
        let log = dir.path().join("a.log");
        open_log(&log).unwrap();
        assert_eq!(std::fs::metadata(&log).unwrap().mode() & 0o777, 0o600);
        std::fs::set_permissions(&log, std::fs::Permissions::from_mode(0o666)).unwrap();
        open_log(&log).unwrap();
        assert_eq!(std::fs::metadata(&log).unwrap().mode() & 0o777, 0o600);
        unsafe { libc::umask(old) };
        let link = dir.path().join("link.log");
        std::os::unix::fs::symlink(&log, &link).unwrap();
        let e = open_log(&link).unwrap_err().to_string();
        assert!(e.contains("link.log") && e.contains("symbolic link"), "{e}");
        let e = open_log(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file") || e.contains("directory"), "{e}");
    }

    #[test]
    fn a_private_dir_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let me = unsafe { libc::geteuid() };
        let d = dir.path().join("d");
        private_dir(&d, me).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(private_dir(&d, me).unwrap_err().to_string().contains("mode 0755"));
        let l = dir.path().join("l");
        std::os::unix::fs::symlink(&d, &l).unwrap();
        assert!(private_dir(&l, me).unwrap_err().to_string().contains("symbolic link"));
        assert!(private_dir(&d, me + 1).unwrap_err().to_string().contains("owned by uid"));
    }
}
