//! File-system behaviour through real mounts, for every configuration of the front end: the
//! passthrough fast path, the cached path, and a monitoring layer that sees all I/O.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirEntryExt, FileExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use common::{cpath, errno, get_file_flags, is_root, set_file_flags, Mount, FS_IMMUTABLE_FL, FS_NOATIME_FL};

fn file_data(m: &Mount) {
    let p = m.path("data.bin");
    let mut f = OpenOptions::new().create(true).read(true).write(true).truncate(true).open(&p).unwrap();
    let block: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    f.write_all(&block).unwrap();
    f.write_at(b"MIDDLE", 100_000).unwrap();
    let mut expect = block.clone();
    expect[100_000..100_006].copy_from_slice(b"MIDDLE");
    // Append through a second descriptor opened with O_APPEND.
    OpenOptions::new().append(true).open(&p).unwrap().write_all(b"tail").unwrap();
    expect.extend_from_slice(b"tail");
    let mut buf = vec![0; 10];
    f.read_exact_at(&mut buf, 99_998).unwrap();
    assert_eq!(buf, &expect[99_998..100_008]);
    assert_eq!(fs::read(&p).unwrap(), expect);
    assert_eq!(fs::read(m.lower_path("data.bin")).unwrap(), expect, "the lower file holds the same bytes");

    // Truncate down, then up: the new range reads as zeros.
    f.set_len(1000).unwrap();
    f.set_len(5000).unwrap();
    let mut all = Vec::new();
    File::open(&p).unwrap().read_to_end(&mut all).unwrap();
    assert_eq!(&all[..1000], &expect[..1000]);
    assert!(all[1000..].iter().all(|b| *b == 0));
    assert_eq!(fs::metadata(&p).unwrap().len(), 5000);
    // Truncate by path (setattr without a handle) and O_TRUNC.
    OpenOptions::new().write(true).truncate(true).open(&p).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), 0);

    // Changes made to the lower file directly show up (the cache follows mtime and size).
    fs::write(m.lower_path("outside.txt"), b"v1").unwrap();
    assert_eq!(fs::read(m.path("outside.txt")).unwrap(), b"v1");
}

fn mmap_read_write(m: &Mount) {
    let p = m.path("mapped");
    let f = OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&p).unwrap();
    f.set_len(3 * 4096).unwrap();
    unsafe {
        let len = 3 * 4096;
        let ptr = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd(), 0);
        assert_ne!(ptr, libc::MAP_FAILED, "mmap: errno {}", errno());
        let bytes = std::slice::from_raw_parts_mut(ptr as *mut u8, len);
        bytes[5000..5005].copy_from_slice(b"hello");
        assert_eq!(libc::msync(ptr, len, libc::MS_SYNC), 0);
        libc::munmap(ptr, len);
    }
    drop(f);
    let data = fs::read(&p).unwrap();
    assert_eq!(&data[5000..5005], b"hello");
    // A write through a shared mapping changes the file's times, as the next stat shows (also
    // through passthrough, where the write never reaches the daemon): xfstests generic/080, whose
    // steps these are. Written and synced, then past the attribute timeout (1 s), so that the open
    // fetches attributes afresh and the kernel would keep those for the stat after the write.
    let p = m.path("mapped-times");
    let mut f = File::create(&p).unwrap();
    f.write_all(&[b'a'; 4096]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let before = fs::metadata(&p).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    unsafe {
        let ptr = libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd(), 0);
        assert_ne!(ptr, libc::MAP_FAILED, "mmap: errno {}", errno());
        *(ptr as *mut u8) = b'!';
        libc::munmap(ptr, 4096);
    }
    drop(f);
    // Asked for the times alone, as stat(1) asks: a stat(2) also asks for the atime, which the
    // mapped read made the kernel fetch again, and would get fresh times whatever we do.
    let after = mtime_and_ctime(&p);
    assert!(after.0 > (before.mtime(), before.mtime_nsec()), "mtime after a mapped write");
    assert!(after.1 > (before.ctime(), before.ctime_nsec()), "ctime after a mapped write");
    assert_eq!(&fs::read(m.lower_path("mapped")).unwrap()[5000..5005], b"hello");
}

/// A file's mtime and ctime, from a `statx` that asks for those alone.
fn mtime_and_ctime(p: &Path) -> ((i64, i64), (i64, i64)) {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statx(libc::AT_FDCWD, c.as_ptr(), 0, libc::STATX_MTIME | libc::STATX_CTIME, &mut stx) };
    assert_eq!(rc, 0, "statx {}: errno {}", p.display(), errno());
    let t = |ts: libc::statx_timestamp| (ts.tv_sec, ts.tv_nsec as i64);
    (t(stx.stx_mtime), t(stx.stx_ctime))
}

fn directories(m: &Mount) {
    fs::create_dir_all(m.path("a/b/c")).unwrap();
    let names: Vec<String> = (0..600).map(|i| format!("file-with-a-longish-name-{i:04}")).collect();
    for n in &names {
        File::create(m.path("a/b").join(n)).unwrap();
    }
    let mut listed: Vec<String> = fs::read_dir(m.path("a/b")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    listed.sort();
    let mut expect = names.clone();
    expect.push("c".into());
    expect.sort();
    assert_eq!(listed, expect, "every entry listed exactly once");
    // Entry types and inode numbers from readdir agree with stat.
    for e in fs::read_dir(m.path("a")).unwrap() {
        let e = e.unwrap();
        assert!(e.file_type().unwrap().is_dir());
        assert_eq!(e.ino(), fs::metadata(e.path()).unwrap().ino());
    }
    assert_eq!(fs::remove_dir(m.path("a/b")).unwrap_err().raw_os_error(), Some(libc::ENOTEMPTY));
    fs::remove_dir(m.path("a/b/c")).unwrap();
    assert!(!m.lower_path("a/b/c").exists());
    assert_eq!(fs::read_dir(m.path("")).unwrap().filter(|e| e.as_ref().unwrap().file_name() == ".plyfs").count(), 0, ".plyfs is not listed");
}

fn symlinks(m: &Mount) {
    fs::write(m.path("target"), b"pointed").unwrap();
    std::os::unix::fs::symlink("target", m.path("link")).unwrap();
    assert_eq!(fs::read_link(m.path("link")).unwrap(), Path::new("target"));
    assert!(fs::symlink_metadata(m.path("link")).unwrap().file_type().is_symlink());
    assert_eq!(fs::read(m.path("link")).unwrap(), b"pointed");
    // O_NOFOLLOW refuses the link and opens the file (as cp and mv open their sources).
    let nofollow = |p: &Path| unsafe { libc::open(cpath(p).as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW) };
    assert_eq!((nofollow(&m.path("link")), errno()), (-1, libc::ELOOP));
    let fd = nofollow(&m.path("target"));
    assert!(fd >= 0, "O_NOFOLLOW open of a file: errno {}", errno());
    unsafe { libc::close(fd) };
    std::os::unix::fs::symlink("/nowhere/at/all", m.path("dangling")).unwrap();
    assert_eq!(fs::read_link(m.lower_path("dangling")).unwrap(), Path::new("/nowhere/at/all"));
}

fn hard_links(m: &Mount) {
    fs::write(m.path("one"), b"shared").unwrap();
    fs::hard_link(m.path("one"), m.path("two")).unwrap();
    let (a, b) = (fs::metadata(m.path("one")).unwrap(), fs::metadata(m.path("two")).unwrap());
    assert_eq!(a.ino(), b.ino());
    assert_eq!(a.nlink(), 2);
    assert_eq!(a.ino(), fs::metadata(m.lower_path("one")).unwrap().ino(), "st_ino is the lower inode number");
    fs::write(m.path("two"), b"changed").unwrap();
    assert_eq!(fs::read(m.path("one")).unwrap(), b"changed");
    fs::remove_file(m.path("one")).unwrap();
    assert_eq!(fs::metadata(m.path("two")).unwrap().nlink(), 1);
}

fn renameat2(from: &Path, to: &Path, flags: u32) -> i32 {
    let (f, t) = (cpath(from), cpath(to));
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, f.as_ptr(), libc::AT_FDCWD, t.as_ptr(), flags) };
    if rc == 0 { 0 } else { errno() }
}

fn renames(m: &Mount) {
    fs::create_dir(m.path("d1")).unwrap();
    fs::create_dir(m.path("d2")).unwrap();
    fs::write(m.path("d1/x"), b"x").unwrap();
    fs::write(m.path("d2/y"), b"y").unwrap();
    let ino = fs::metadata(m.path("d1/x")).unwrap().ino();
    fs::rename(m.path("d1/x"), m.path("d2/moved")).unwrap();
    assert_eq!(fs::metadata(m.path("d2/moved")).unwrap().ino(), ino, "rename keeps the inode");
    assert_eq!(renameat2(&m.path("d2/moved"), &m.path("d2/y"), libc::RENAME_NOREPLACE), libc::EEXIST);
    assert_eq!(renameat2(&m.path("d2/moved"), &m.path("d2/y"), libc::RENAME_EXCHANGE), 0);
    assert_eq!(fs::read(m.path("d2/y")).unwrap(), b"x");
    assert_eq!(fs::read(m.path("d2/moved")).unwrap(), b"y");
    assert_eq!(renameat2(&m.path("d2/y"), &m.path("d1/new"), libc::RENAME_NOREPLACE), 0);
    fs::rename(m.path("d2"), m.path("d1/sub")).unwrap();
    assert_eq!(fs::read(m.path("d1/sub/moved")).unwrap(), b"y");
    // Replacing a file by rename.
    fs::write(m.path("d1/old"), b"old").unwrap();
    fs::rename(m.path("d1/new"), m.path("d1/old")).unwrap();
    assert_eq!(fs::read(m.path("d1/old")).unwrap(), b"x");
    assert!(!m.path("d1/new").exists());
}

fn special_files(m: &Mount) {
    let fifo = cpath(&m.path("fifo"));
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0, "mkfifo: errno {}", errno());
    let md = fs::symlink_metadata(m.path("fifo")).unwrap();
    assert!(md.file_type().is_fifo());
    assert_eq!(md.permissions().mode() & 0o777, 0o640);
    let listener = std::os::unix::net::UnixListener::bind(m.path("sock")).unwrap();
    assert!(fs::symlink_metadata(m.path("sock")).unwrap().file_type().is_socket());
    drop(listener);
    assert!(fs::symlink_metadata(m.lower_path("sock")).unwrap().file_type().is_socket());
}

fn attributes(m: &Mount) {
    let p = m.path("attrs");
    fs::write(&p, b"a").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o4751)).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o7777, 0o4751);
    let times = [
        libc::timespec { tv_sec: 1_000_000_000, tv_nsec: 123_456_789 },
        libc::timespec { tv_sec: 1_200_000_000, tv_nsec: 987_654_321 },
    ];
    assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, cpath(&p).as_ptr(), times.as_ptr(), 0) }, 0);
    let md = fs::metadata(&p).unwrap();
    assert_eq!((md.atime(), md.atime_nsec()), (1_000_000_000, 123_456_789));
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_200_000_000, 987_654_321));
    if is_root() {
        std::os::unix::fs::chown(&p, Some(1234), Some(5678)).unwrap();
        let md = fs::metadata(m.lower_path("attrs")).unwrap();
        assert_eq!((md.uid(), md.gid()), (1234, 5678));
    }
}

fn xattrs(m: &Mount) {
    let p = cpath(&m.path("xa"));
    fs::write(m.path("xa"), b"").unwrap();
    let name = c"user.plyfs.test";
    assert_eq!(unsafe { libc::setxattr(p.as_ptr(), name.as_ptr(), b"value".as_ptr().cast(), 5, 0) }, 0, "setxattr: errno {}", errno());
    let mut buf = [0u8; 64];
    assert_eq!(unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) }, 5);
    let n = unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(&buf[..n as usize], b"value");
    assert_eq!(unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), 2) }, -1);
    assert_eq!(errno(), libc::ERANGE);
    let n = unsafe { libc::listxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(buf[..n as usize].split(|b| *b == 0).any(|s| s == b"user.plyfs.test"));
    assert_eq!(unsafe { libc::setxattr(p.as_ptr(), name.as_ptr(), b"v".as_ptr().cast(), 1, libc::XATTR_CREATE) }, -1);
    assert_eq!(errno(), libc::EEXIST);
    assert_eq!(unsafe { libc::removexattr(p.as_ptr(), name.as_ptr()) }, 0);
    assert_eq!(unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }, -1);
    assert_eq!(errno(), libc::ENODATA);
    symlink_xattrs(m);
}

/// `lsattr`/`chattr` (FS_IOC_GETFLAGS/SETFLAGS) pass to the lower file, and the flags hold
/// there: an immutable file refuses writes. Skipped where the lower file system has no flags.
fn file_flags(m: &Mount) {
    fs::write(m.path("flagged"), b"x").unwrap();
    let get = |p: &Path| get_file_flags(p).ok();
    let Some(flags) = get(&m.lower_path("flagged")) else { return };
    assert_eq!(get(&m.path("flagged")), Some(flags), "the flags read through the mount are the lower file's");
    let before = fs::metadata(m.path("flagged")).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(set_file_flags(&m.path("flagged"), flags | FS_NOATIME_FL), 0);
    // Setting flags changes the ctime, as the next stat shows (xfstests generic/277).
    let after = fs::metadata(m.path("flagged")).unwrap();
    assert!((after.ctime(), after.ctime_nsec()) > (before.ctime(), before.ctime_nsec()), "ctime after chattr");
    assert_eq!(get(&m.lower_path("flagged")).unwrap() & FS_NOATIME_FL, FS_NOATIME_FL, "set on the lower file");
    if is_root() && set_file_flags(&m.path("flagged"), flags | FS_IMMUTABLE_FL) == 0 {
        let e = OpenOptions::new().append(true).open(m.path("flagged")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "an immutable file refuses writes");
        assert_eq!(set_file_flags(&m.path("flagged"), flags), 0);
    }
    fs::remove_file(m.path("flagged")).unwrap();
    // A directory's flags, through the handle the kernel opens on it (`lsattr -d`, `chattr`).
    fs::create_dir(m.path("flagdir")).unwrap();
    let flags = get(&m.lower_path("flagdir")).unwrap();
    assert_eq!(get(&m.path("flagdir")), Some(flags), "the flags read through the mount are the lower directory's");
    assert_eq!(set_file_flags(&m.path("flagdir"), flags | FS_NOATIME_FL), 0);
    assert_eq!(get(&m.lower_path("flagdir")).unwrap() & FS_NOATIME_FL, FS_NOATIME_FL, "set on the lower directory");
    fs::remove_dir(m.path("flagdir")).unwrap();
}

/// Extended attributes on a symlink itself, where the kernel allows them (`trusted.*` for
/// root), as on ext4; `user.*` is refused there by the kernel.
fn symlink_xattrs(m: &Mount) {
    if !is_root() {
        return;
    }
    std::os::unix::fs::symlink("xa", m.path("xl")).unwrap();
    let (link, name) = (cpath(&m.path("xl")), c"trusted.plyfs.test");
    assert_eq!(unsafe { libc::lsetxattr(link.as_ptr(), name.as_ptr(), b"on the link".as_ptr().cast(), 11, 0) }, 0, "lsetxattr: errno {}", errno());
    let mut buf = [0u8; 64];
    let n = unsafe { libc::lgetxattr(link.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(&buf[..n.max(0) as usize], b"on the link");
    let n = unsafe { libc::llistxattr(link.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(buf[..n.max(0) as usize].split(|b| *b == 0).any(|s| s == b"trusted.plyfs.test"));
    // The target has none of it.
    let target = cpath(&m.path("xa"));
    assert_eq!(unsafe { libc::getxattr(target.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }, -1);
    assert_eq!(unsafe { libc::lsetxattr(link.as_ptr(), c"user.plyfs.test".as_ptr(), b"x".as_ptr().cast(), 1, 0) }, -1);
    assert_eq!(errno(), libc::EPERM);
    assert_eq!(unsafe { libc::lremovexattr(link.as_ptr(), name.as_ptr()) }, 0);
    assert_eq!(unsafe { libc::lgetxattr(link.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }, -1);
    assert_eq!(errno(), libc::ENODATA);
    fs::remove_file(m.path("xl")).unwrap();
}

fn deleted_while_open(m: &Mount) {
    let p = m.path("doomed");
    let mut f = OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&p).unwrap();
    f.write_all(b"still here").unwrap();
    fs::remove_file(&p).unwrap();
    assert!(!p.exists());
    assert!(!m.lower_path("doomed").exists());
    f.write_all(b", and more").unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "still here, and more");
    assert_eq!(f.metadata().unwrap().nlink(), 0);
    assert_eq!(f.metadata().unwrap().len(), 20);
}

fn statfs_fallocate_and_holes(m: &Mount) {
    let mut ours: libc::statvfs = unsafe { std::mem::zeroed() };
    let mut theirs: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(cpath(&m.mnt).as_ptr(), &mut ours) }, 0);
    assert_eq!(unsafe { libc::statvfs(cpath(&m.lower).as_ptr(), &mut theirs) }, 0);
    assert_eq!((ours.f_blocks, ours.f_bsize, ours.f_files), (theirs.f_blocks, theirs.f_bsize, theirs.f_files));

    let f = OpenOptions::new().create(true).truncate(false).read(true).write(true).open(m.path("sparse")).unwrap();
    f.write_at(b"head", 0).unwrap();
    f.write_at(b"far", 1 << 20).unwrap();
    f.sync_all().unwrap();
    let fd = f.as_raw_fd();
    let lower = File::open(m.lower_path("sparse")).unwrap();
    for (off, whence) in [(0, libc::SEEK_HOLE), (8192, libc::SEEK_DATA), (0, libc::SEEK_DATA)] {
        let ours = unsafe { libc::lseek(fd, off, whence) };
        let native = unsafe { libc::lseek(lower.as_raw_fd(), off, whence) };
        assert_eq!(ours, native, "lseek({off}, {whence}) agrees with the lower file");
    }
    assert_eq!(unsafe { libc::fallocate(fd, 0, 0, 3 << 20) }, 0, "fallocate: errno {}", errno());
    assert_eq!(f.metadata().unwrap().len(), 3 << 20);
    assert_eq!(unsafe { libc::fallocate(fd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, 4096) }, 0);
    let mut head = [1u8; 4];
    f.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(head, [0; 4], "a punched hole reads as zeros");
    f.sync_data().unwrap();
    File::open(m.path("")).unwrap().sync_all().unwrap();
}

fn inode_numbers_survive_kernel_forgets(m: &Mount) {
    fs::create_dir(m.path("keep")).unwrap();
    fs::write(m.path("keep/f"), b"1").unwrap();
    let before = (fs::metadata(m.path("keep")).unwrap().ino(), fs::metadata(m.path("keep/f")).unwrap().ino());
    if is_root() {
        // Drop dentries and inodes: the kernel forgets them and must look them up again.
        let _ = fs::write("/proc/sys/vm/drop_caches", "2");
    }
    let after = (fs::metadata(m.path("keep")).unwrap().ino(), fs::metadata(m.path("keep/f")).unwrap().ino());
    assert_eq!(before, after);
}

/// A running program cannot be truncated: `open(O_TRUNC)` fails with ETXTBSY and leaves the file
/// whole (the kernel checks before the truncate reaches the lower file).
fn running_programs_are_not_truncated(m: &Mount) {
    let prog = m.path("prog");
    fs::copy("/bin/sleep", &prog).unwrap();
    fs::set_permissions(&prog, fs::Permissions::from_mode(0o755)).unwrap();
    let size = fs::metadata(&prog).unwrap().len();
    // Another test thread may fork while the copy's write descriptor is open, and the child
    // holds it until it execs: that exec fails with ETXTBSY for a moment. Retry briefly.
    let mut attempts = 0;
    let mut child = loop {
        match std::process::Command::new(&prog).arg("30").spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && attempts < 100 => {
                attempts += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => break other.unwrap(),
        }
    };
    std::thread::sleep(std::time::Duration::from_millis(200));
    for flags in [libc::O_RDONLY | libc::O_TRUNC, libc::O_WRONLY, libc::O_RDWR | libc::O_TRUNC] {
        let fd = unsafe { libc::open(cpath(&prog).as_ptr(), flags) };
        assert_eq!((fd, errno()), (-1, libc::ETXTBSY), "open flags {flags:#o}");
        assert_eq!(fs::metadata(&prog).unwrap().len(), size, "open flags {flags:#o} left the file whole");
    }
    assert!(child.try_wait().unwrap().is_none(), "the program still runs");
    child.kill().unwrap();
    child.wait().unwrap();
}

macro_rules! posix_tests {
    ($config:ident, $stack:expr, $opts:expr) => {
        mod $config {
            use super::*;
            posix_tests!(@each $stack, $opts; file_data, mmap_read_write, directories, symlinks, hard_links, renames,
                special_files, attributes, xattrs, file_flags, deleted_while_open, statfs_fallocate_and_holes,
                inode_numbers_survive_kernel_forgets, running_programs_are_not_truncated);
        }
    };
    (@each $stack:expr, $opts:expr; $($test:ident),*) => {
        $(
            #[test]
            fn $test() {
                let m = Mount::with($stack, $opts);
                super::$test(&m);
            }
        )*
    };
}

posix_tests!(null_passthrough, "null", &[]);
posix_tests!(null_cached, "null", &["passthrough=off"]);
// Requests over /dev/fuse: where the kernel allows FUSE io_uring (scripts/test.sh gives its
// permission), the other mounts use it by default.
posix_tests!(null_over_dev_fuse, "null", &["io_uring=off"]);
posix_tests!(null_cached_over_dev_fuse, "null", &["passthrough=off", "io_uring=off"]);
posix_tests!(trace_all_io, "trace:io=on,null", &[]);
posix_tests!(eight_nulls, "null,null,null,null,null,null,null,null", &[]);
posix_tests!(union_of_one, "union", &[]);

/// Linux AIO (`io_submit`), as xfstests' aio-dio-cycle-write uses it: a submitted write is
/// asynchronous to the kernel (not a synchronous kiocb), unlike pwrite(2).
mod aio {
    #[repr(C)]
    #[derive(Default)]
    struct Iocb {
        data: u64,
        key: u32,
        rw_flags: i32,
        opcode: u16,
        reqprio: i16,
        fildes: u32,
        buf: u64,
        nbytes: u64,
        offset: i64,
        reserved2: u64,
        flags: u32,
        resfd: u32,
    }

    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Event {
        data: u64,
        obj: u64,
        res: i64,
        res2: i64,
    }

    const IOCB_CMD_PWRITE: u16 = 1;

    pub struct Context(libc::c_ulong);

    impl Context {
        pub fn new() -> Context {
            let mut ctx: libc::c_ulong = 0;
            let r = unsafe { libc::syscall(libc::SYS_io_setup, 1, &mut ctx as *mut libc::c_ulong) };
            assert_eq!(r, 0, "io_setup: {}", std::io::Error::last_os_error());
            Context(ctx)
        }

        /// Write `buf` at `offset` of `fd` through io_submit and wait for its completion.
        pub fn pwrite(&self, fd: i32, buf: &[u8], offset: i64) -> i64 {
            let mut cb = Iocb { opcode: IOCB_CMD_PWRITE, fildes: fd as u32, buf: buf.as_ptr() as u64, nbytes: buf.len() as u64, offset, ..Default::default() };
            let mut list = [&mut cb as *mut Iocb];
            let r = unsafe { libc::syscall(libc::SYS_io_submit, self.0, 1, list.as_mut_ptr()) };
            assert_eq!(r, 1, "io_submit: {}", std::io::Error::last_os_error());
            let mut ev = [Event::default()];
            let r = unsafe { libc::syscall(libc::SYS_io_getevents, self.0, 1, 1, ev.as_mut_ptr(), std::ptr::null_mut::<libc::timespec>()) };
            assert_eq!(r, 1, "io_getevents: {}", std::io::Error::last_os_error());
            ev[0].res
        }
    }

    impl Drop for Context {
        fn drop(&mut self) {
            unsafe { libc::syscall(libc::SYS_io_destroy, self.0) };
        }
    }
}

/// A buffer aligned for O_DIRECT, filled with `byte`.
fn aligned(len: usize, byte: u8) -> (Vec<u8>, usize) {
    let v = vec![byte; len + 4096];
    let skip = v.as_ptr().align_offset(4096);
    (v, skip)
}

/// Asynchronous O_DIRECT writes while other threads keep reading the file through the page cache
/// (xfstests generic/451): once a write has completed, a buffered read returns what it wrote.
/// With FUSE_ASYNC_DIO the kernel of this machine completed such writes without dropping the
/// pages the readers filled meanwhile, and reads returned the pattern before the write.
fn async_direct_writes_beside_buffered_reads(m: &Mount) {
    const LEN: usize = 640 << 10;
    let path = m.mnt.join("aio-dio");
    fs::write(&path, vec![0x55; LEN]).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (path, stop) = (path.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0; LEN];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = File::open(&path).and_then(|f| f.read_at(&mut buf, 0));
                }
            })
        })
        .collect();
    let file = OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(&path).unwrap();
    let ctx = aio::Context::new();
    let patterns = [(aligned(LEN, 0xaa)), (aligned(LEN, 0x55))];
    let mut stale = None;
    let mut read = vec![0; LEN];
    for round in 0..400 {
        let ((buf, skip), byte) = (&patterns[round % 2], [0xaa, 0x55][round % 2]);
        assert_eq!(ctx.pwrite(file.as_raw_fd(), &buf[*skip..*skip + LEN], 0), LEN as i64, "round {round}: the write");
        File::open(&path).unwrap().read_exact_at(&mut read, 0).unwrap();
        if let Some(at) = read.iter().position(|b| *b != byte) {
            stale = Some((round, at, read[at]));
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    assert_eq!(stale, None, "(round, offset, byte): a buffered read after a completed direct write saw the old data");
}

#[test]
fn async_direct_writes_beside_buffered_reads_on_zstd() {
    async_direct_writes_beside_buffered_reads(&Mount::new("zstd"));
}

#[test]
fn async_direct_writes_beside_buffered_reads_cached() {
    async_direct_writes_beside_buffered_reads(&Mount::with("null", &["passthrough=off"]));
}
