//! The lower lock: who uses a lower directory, so that two users that would corrupt each other
//! cannot both have it.
//!
//! A mount that is not shared keeps state about its lower files (indexes, caches) that another
//! mount writing the same files silently invalidates. So every user of a lower directory (a
//! mount, `plyfs serve`, an offline tool) holds an open-file-description lock (`F_OFD_SETLK`) on
//! the file [`LOCK_NAME`] at its top: exclusive to write alone, shared to read or to write
//! beside other `-o shared` mounts. A second user whose lock conflicts is refused, with who
//! holds it. The kernel, and NFS, GlusterFS and CephFS across machines, carry the lock; it dies
//! with its holder, so the text a dead holder left in the file never blocks anyone. The file
//! says who last took the lock, for the refusal to name them; the lock, not the text, decides.
//!
//! The last holder to let go removes the file, so a lower not in use holds none: it takes the
//! lock exclusive before it removes it, and a user that locked the file checks after locking
//! that its name still leads to it, opening it again if not.
//!
//! The bottom layer hides the file: no mount shows, opens or replaces it.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::shared::LockKind;

/// The lock file's name, at the top of a lower directory.
pub const LOCK_NAME: &str = ".plyfs.lock";

/// Whether `name`, in the lower directory's top, is the lock file.
pub fn is_lock_file(name: &std::ffi::OsStr) -> bool {
    name == LOCK_NAME
}

/// What a user of a lower directory asks for.
#[derive(Clone, Copy, Debug)]
pub struct Claim {
    pub kind: LockKind,
    /// Whether it writes the lower: a user that only reads goes on without a lock where it may
    /// not make one, saying so; one that writes is refused (but on a read-only file system).
    pub writes: bool,
    /// What a refused user is told to do, e.g. "unmount it, or mount both with -o shared".
    pub advice: &'static str,
}

/// A held lower lock; dropping it releases it.
#[derive(Debug)]
pub struct LowerLock {
    file: File,
    path: PathBuf,
    /// Whether it removes the file when it is the last holder: a writer does, a reader only if
    /// it made the file (it leaves the lower as it found it).
    removes: bool,
    /// A reader that made the file: the directory's modification time before it did, which it
    /// put back then and puts back when it removes the file (`plyfs decode` copies it).
    dir_mtime: Option<Mtime>,
}

impl Drop for LowerLock {
    fn drop(&mut self) {
        if self.removes && lock(&self.file, LockKind::Exclusive).is_ok() {
            let dir = self.path.parent().unwrap_or(Path::new("."));
            // Only if nothing but this lock changed the directory meanwhile.
            let untouched = self.dir_mtime.filter(|before| dir_mtime(dir) == Some(*before));
            let _ = std::fs::remove_file(&self.path);
            if let Some(before) = untouched {
                set_dir_mtime(dir, before);
            }
        }
    }
}

/// A modification time: seconds and nanoseconds.
type Mtime = (i64, i64);

fn dir_mtime(dir: &Path) -> Option<Mtime> {
    std::fs::metadata(dir).ok().map(|m| (m.mtime(), m.mtime_nsec()))
}

/// Set the modification time of `dir`, leaving its access time.
fn set_dir_mtime(dir: &Path, (secs, nanos): Mtime) {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return };
    let times = [libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT }, libc::timespec { tv_sec: secs, tv_nsec: nanos }];
    // SAFETY: a valid path and two timespecs.
    unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) };
}

/// How many times a user opens the lock file again when the one it locked was removed by its
/// last holder meanwhile.
const REOPENS: usize = 100;

/// Take the lock of `dir` as `claim` says, without waiting, and record `who` (e.g. "mounted at
/// /mnt/a") as its holder. `Ok(None)`: a user that only reads, of a lower where no lock file
/// can be made; the reason is logged.
pub fn take(dir: &Path, claim: Claim, who: &str) -> Result<Option<LowerLock>, String> {
    let path = dir.join(LOCK_NAME);
    for _ in 0..REOPENS {
        let before = if claim.writes { None } else { dir_mtime(dir) };
        let Opened { mut file, writable, made } = match open(&path, claim) {
            Ok(opened) => opened,
            Err(e) if may_only_read(claim, &e) => {
                tracing::warn!("{}: {e}; reading {} without the lower lock", path.display(), dir.display());
                return Ok(None);
            }
            Err(e) => return Err(format!("{}: {e} (the lower lock, which a user that writes the lower must hold)", path.display())),
        };
        // A reader that made the lock file puts back the time that moved (below): the time before,
        // and the one making the file left.
        let moved = before.filter(|_| made).map(|before| (before, dir_mtime(dir)));
        let kind = if writable { claim.kind } else { LockKind::Shared };
        if let Err(e) = lock_or_wait_for_leaver(&mut file, kind) {
            return Err(match e.raw_os_error() {
                Some(libc::EAGAIN | libc::EACCES) => {
                    format!("lower {} is in use by another plyfs ({}); {}", dir.display(), holder(&mut file), claim.advice)
                }
                _ => format!("{}: cannot lock it: {e}", path.display()),
            });
        }
        if !still_named(&file, &path) {
            continue;
        }
        // A reader does not name itself: the refusal names a writer, whom it concerns.
        if writable && claim.writes {
            record(&mut file, who);
        }
        // Put back the time the lock file moved (a reader leaves the lower as it found it), only
        // if making the lock file was the directory's last change: another program's entry made
        // since then keeps the time it gave the directory.
        if let Some((before, made_at @ Some(_))) = moved {
            if dir_mtime(dir) == made_at {
                set_dir_mtime(dir, before);
            }
        }
        let removes = writable && (claim.writes || made);
        return Ok(Some(LowerLock { file, path, removes, dir_mtime: moved.map(|(before, _)| before) }));
    }
    Err(format!("{}: removed each time it was locked; is another program removing it?", path.display()))
}

/// How long a user waits for a holder that is leaving: a daemon whose file system was just
/// unmounted (`umount` returns before the daemon has written its state and exited).
const LEAVING_GRACE: Duration = Duration::from_secs(10);

/// [`lock`], waiting up to [`LEAVING_GRACE`] if the holder is a mount of this machine whose
/// mount point is no longer mounted, so that `umount M && mount ... M` works. Any other
/// holder refuses at once.
fn lock_or_wait_for_leaver(file: &mut File, kind: LockKind) -> io::Result<()> {
    let deadline = Instant::now() + LEAVING_GRACE;
    loop {
        match lock(file, kind) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) && Instant::now() < deadline => {
                if !leaving(&holder(file)) {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Whether the holder `text` ([`record`]'s) names a mount of this host that is no longer
/// mounted here.
fn leaving(text: &str) -> bool {
    let Some((host, who)) = text.split_once(" on ").and_then(|(_, rest)| rest.split_once(", ")) else { return false };
    let Some(mountpoint) = who.strip_prefix("mounted at ") else { return false };
    host == hostname() && !is_mount_point(mountpoint)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_owned()
}

/// Whether `path` is a mount point in this process's mount namespace (`/proc/self/mountinfo`
/// writes space, tab, newline and backslash as octal escapes).
fn is_mount_point(path: &str) -> bool {
    let mut escaped = String::new();
    for c in path.chars() {
        match c {
            ' ' | '\t' | '\n' | '\\' => escaped.push_str(&format!("\\{:03o}", c as u32)),
            c => escaped.push(c),
        }
    }
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines().any(|line| line.split(' ').nth(4) == Some(escaped.as_str()))
}

/// Whether a user may go on with the lock file only read, or none, after `e` opening it for
/// writing: a user that only reads, where it may not write; anyone on a read-only file system,
/// where no one writes through this path.
fn may_only_read(claim: Claim, e: &io::Error) -> bool {
    match e.raw_os_error() {
        Some(libc::EROFS) => true,
        Some(libc::EACCES | libc::EPERM) => !claim.writes,
        _ => false,
    }
}

/// Whether `path` still names `file` (its last holder removes it when it lets go).
fn still_named(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// The lock file as opened.
struct Opened {
    file: File,
    /// Open for writing (else a user that only reads a lower it may not write).
    writable: bool,
    /// Made by this open.
    made: bool,
}

/// The lock file, made 0600 if it is not there (and given to the directory's owner when root
/// makes it in another user's directory, so that its owner's mounts can lock it too). A user
/// that only reads a lower it may not write opens it for reading.
fn open(path: &Path, claim: Claim) -> io::Result<Opened> {
    let mut read = OpenOptions::new();
    read.read(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    let mut rw = read.clone();
    rw.write(true).mode(0o600);
    let opened = match rw.clone().create_new(true).open(path) {
        Ok(file) => Ok(Opened { file, writable: true, made: true }),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => rw.open(path).map(|file| Opened { file, writable: true, made: false }),
        Err(e) => Err(e),
    };
    let opened = match opened {
        Err(e) if may_only_read(claim, &e) => {
            return read.open(path).map(|file| Opened { file, writable: false, made: false }).map_err(|_| e);
        }
        opened => opened?,
    };
    give_to_dir_owner(&opened.file, path)?;
    if !opened.file.metadata()?.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    Ok(opened)
}

fn give_to_dir_owner(file: &File, path: &Path) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new(".")).metadata()?;
    let mine = file.metadata()?;
    if unsafe { libc::geteuid() } == 0 && mine.uid() == 0 && dir.uid() != 0 {
        std::os::unix::fs::fchown(file, Some(dir.uid()), Some(dir.gid()))?;
    }
    Ok(())
}

fn lock(file: &File, kind: LockKind) -> io::Result<()> {
    let l_type = match kind {
        LockKind::Shared => libc::F_RDLCK,
        LockKind::Exclusive => libc::F_WRLCK,
    };
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = l_type as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    match unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) } {
        -1 => Err(io::Error::last_os_error()),
        _ => Ok(()),
    }
}

/// Write "pid N on HOST, WHO" into the lock file. Only a hint for refusals: failing to write
/// it loses nothing.
fn record(file: &mut File, who: &str) {
    let text = format!("pid {} on {}, {who}\n", std::process::id(), hostname());
    let _ = file.set_len(0).and_then(|()| file.rewind()).and_then(|()| file.write_all(text.as_bytes()));
}

/// Who the lock file says holds the lock.
fn holder(file: &mut File) -> String {
    let mut text = String::new();
    let _ = file.rewind().and_then(|_| file.take(512).read_to_string(&mut text));
    match text.lines().next().map(str::trim) {
        Some(line) if !line.is_empty() => line.to_owned(),
        _ => "who holds it is not recorded".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALONE: Claim = Claim { kind: LockKind::Exclusive, writes: true, advice: "unmount it" };
    const SHARED: Claim = Claim { kind: LockKind::Shared, writes: true, advice: "unmount it" };

    #[test]
    fn exclusive_excludes_everyone_and_shared_only_exclusive() {
        // Holders mounted where something is mounted: no one waits for them to leave.
        let dir = tempfile::tempdir().unwrap();
        let first = take(dir.path(), ALONE, "mounted at /").unwrap().unwrap();
        let refused = take(dir.path(), SHARED, "mounted at /proc").unwrap_err();
        assert!(refused.contains("is in use by another plyfs (pid ") && refused.contains("mounted at /); unmount it"), "{refused}");
        drop(first);
        let a = take(dir.path(), SHARED, "mounted at /").unwrap().unwrap();
        let _b = take(dir.path(), SHARED, "mounted at /proc").unwrap().unwrap();
        assert!(take(dir.path(), ALONE, "fsck").unwrap_err().contains("mounted at /proc"));
        drop(a);
        assert!(take(dir.path(), ALONE, "fsck").is_err());
    }

    #[test]
    fn a_holder_whose_mount_point_is_gone_is_waited_for() {
        // As after `umount M`: the daemon still holds the lock for a moment.
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("unmounted");
        let leaving = take(dir.path(), ALONE, &format!("mounted at {}", gone.display())).unwrap().unwrap();
        let letting_go = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(leaving);
        });
        take(dir.path(), ALONE, "mounted at /").unwrap().unwrap();
        letting_go.join().unwrap();
        assert!(leaving_text_parses());
    }

    fn leaving_text_parses() -> bool {
        let host = hostname();
        leaving(&format!("pid 7 on {host}, mounted at /no/such/mount"))
            && !leaving(&format!("pid 7 on {host}, mounted at /"))
            && !leaving("pid 7 on another-host, mounted at /no/such/mount")
            && !leaving(&format!("pid 7 on {host}, serving on unix:/s"))
    }

    #[test]
    fn the_last_holder_removes_the_file_and_a_dead_holders_text_blocks_nobody() {
        let dir = tempfile::tempdir().unwrap();
        let a = take(dir.path(), SHARED, "mounted at /mnt/a").unwrap().unwrap();
        let b = take(dir.path(), SHARED, "mounted at /mnt/b").unwrap().unwrap();
        drop(a);
        assert!(dir.path().join(LOCK_NAME).exists(), "b still holds it");
        drop(b);
        assert!(!dir.path().join(LOCK_NAME).exists(), "removed by its last holder");
        std::fs::write(dir.path().join(LOCK_NAME), "pid 1 on gone, mounted at /mnt/old\n").unwrap();
        drop(take(dir.path(), ALONE, "fsck").unwrap().unwrap());
    }

    #[test]
    fn a_lock_file_that_is_a_symbolic_link_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join(LOCK_NAME)).unwrap();
        let e = take(dir.path(), ALONE, "x").unwrap_err();
        assert!(e.contains(LOCK_NAME) && e.contains("symbolic links"), "{e}");
    }
}
