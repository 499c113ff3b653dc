//! `-o ro` honoured by every layer (nothing below changes, not even a repair the layers would
//! make on a read-write mount), and `-o idle=DURATION` unmounting an unused mount.

mod common;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

/// Everything that identifies the state of each object under `root`: content (or target),
/// mode, size, modification and change times, and extended attributes. A read-only mount may
/// move access times only.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let content = if m.is_file() {
                format!("{:x}", crc(&fs::read(&p).unwrap()))
            } else if m.file_type().is_symlink() {
                fs::read_link(&p).unwrap().display().to_string()
            } else {
                String::new()
            };
            let state = format!(
                "{content} mode {:o} size {} mtime {}.{} ctime {}.{} xattrs {:?}",
                m.mode(),
                m.size(),
                m.mtime(),
                m.mtime_nsec(),
                m.ctime(),
                m.ctime_nsec(),
                xattrs(&p)
            );
            out.insert(p.strip_prefix(root).unwrap().to_owned(), state);
            if m.is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn crc(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, x| (h ^ u64::from(*x)).wrapping_mul(0x100000001b3))
}

fn xattrs(p: &Path) -> Vec<(String, Vec<u8>)> {
    let c = cpath(p);
    let mut names = vec![0u8; 4096];
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n <= 0 {
        return Vec::new();
    }
    names.truncate(n as usize);
    names
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| {
            let name = std::ffi::CString::new(n).unwrap();
            let mut v = vec![0u8; 4096];
            let len = unsafe { libc::lgetxattr(c.as_ptr(), name.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
            v.truncate(len.max(0) as usize);
            (String::from_utf8_lossy(n).into_owned(), v)
        })
        .collect()
}

fn text(len: usize) -> Vec<u8> {
    (0..len).map(|i| b"lorem ipsum dolor sit amet, "[i % 28] ^ (i / 4096 % 3) as u8).collect()
}

/// Write a file of many chunks through `m`, compact it (its index then ends the lower file),
/// unmount, and cut the index off with the slots that name it: the next open must rebuild it.
fn file_with_lost_index(mut m: Mount) -> (tempfile::TempDir, PathBuf, PathBuf, Vec<u8>) {
    let data = text(300_000);
    fs::write(m.path("f"), &data).unwrap();
    let stats = op_json(&m.path("f"), &["compact"]);
    assert!(stats.is_object());
    let stats = op_json(&m.path("f"), &["sca-stats"]);
    let off = stats["index"]["offset"].as_u64().unwrap_or_else(|| panic!("no index: {stats}"));
    m.unmount();
    let lower_file = lower_file_of(&m.lower);
    let f = OpenOptions::new().write(true).open(&lower_file).unwrap();
    f.write_all_at(&[0; 128], 64).unwrap();
    f.set_len(off).unwrap();
    let (lower, mnt) = (m.lower.clone(), m.mnt.clone());
    let dir = std::mem::replace(&mut m.dir, tempfile::tempdir().unwrap());
    (dir, lower, mnt, data)
}

/// The one encoded data file below (whatever its name).
fn lower_file_of(lower: &Path) -> PathBuf {
    fs::read_dir(lower)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_file() && fs::read(p).unwrap().starts_with(b"PLYSCA"))
        .expect("an encoded file below")
}

fn read_only_mount_rebuilds_in_memory_only(stack: &str, secret: &[&str]) {
    let m = if secret.is_empty() { Mount::new(stack) } else { Mount::crypt(stack, &[], &[]) };
    let passfile = format!("--passfile={}", crypt_passfile(m.dir.path()).display());
    let extra: Vec<&str> = if secret.is_empty() { vec![] } else { vec![passfile.as_str()] };
    let (dir, lower, mnt, data) = file_with_lost_index(m);
    let before = snapshot(&lower);
    let ro: Vec<&str> = extra.iter().copied().chain(["ro"]).collect();
    let mut m = Mount::start(dir, lower.clone(), mnt.clone(), stack, &ro);
    let got = fs::read(m.path("f")).unwrap();
    let first_diff = got.iter().zip(&data).position(|(a, b)| a != b);
    assert!(got == data, "{stack}: read back through the rebuilt index: {} bytes, not {}; first difference at {first_diff:?}\n{}", got.len(), data.len(), m.daemon_log());
    assert!(m.daemon_log().contains("rebuil"), "{stack}: {}", m.daemon_log());
    let e = fs::write(m.path("g"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    assert_eq!(OpenOptions::new().append(true).open(m.path("f")).unwrap_err().raw_os_error(), Some(libc::EROFS));
    // An extended operation that would write says so.
    let out = run(plyfs().arg("op").arg(m.path("f")).arg("compact"));
    assert!(!out.status.success(), "compact on a read-only mount");
    m.unmount();
    assert_eq!(snapshot(&lower), before, "{stack}: a read-only mount changed the lower directory");
    // Read-write, the same read repairs the file below: what the check above guards against.
    let dir = std::mem::replace(&mut m.dir, tempfile::tempdir().unwrap());
    let mut m = Mount::start(dir, lower.clone(), mnt, stack, &extra);
    assert!(fs::read(m.path("f")).unwrap() == data);
    m.unmount();
    assert_ne!(snapshot(&lower), before, "{stack}: a read-write mount was expected to write the rebuilt index");
}

#[test]
fn a_read_only_zstd_mount_rebuilds_a_lost_index_without_writing_it() {
    read_only_mount_rebuilds_in_memory_only("zstd", &[]);
}

#[test]
fn a_read_only_crypt_mount_rebuilds_a_lost_index_without_writing_it() {
    read_only_mount_rebuilds_in_memory_only("crypt", &["secret"]);
}

/// A directory of an encrypted-name volume that lost its id: a read-write mount gives it a new
/// one, a read-only mount does not.
#[test]
fn a_read_only_crypt_mount_gives_no_directory_an_id() {
    let mut m = Mount::crypt("crypt", &[], &[]);
    fs::create_dir(m.path("d")).unwrap();
    m.unmount();
    let below = fs::read_dir(&m.lower).unwrap().map(|e| e.unwrap().path()).find(|p| p.is_dir()).unwrap();
    let c = cpath(&below);
    assert_eq!(unsafe { libc::removexattr(c.as_ptr(), c"user.plyfs.dirid".as_ptr()) }, 0);
    let before = snapshot(&m.lower);
    let passfile = format!("--passfile={}", crypt_passfile(m.dir.path()).display());
    let dir = std::mem::replace(&mut m.dir, tempfile::tempdir().unwrap());
    let mut m = Mount::start(dir, m.lower.clone(), m.mnt.clone(), "crypt", &[&passfile, "ro"]);
    assert_eq!(fs::read_dir(m.path("d")).unwrap().count(), 0);
    m.unmount();
    assert_eq!(snapshot(&m.lower), before);
    assert!(xattrs(&below).iter().all(|(n, _)| n != "user.plyfs.dirid"));
}

/// A mirror whose daemon was killed while a file was open for writing: read-write, the next
/// mount would make the branches the same; read-only, it serves them as they are and says why.
#[test]
fn a_read_only_mirror_takes_no_lock_writes_no_log_and_repairs_nothing() {
    let (mut m, b) = mirror("mirror");
    let (a, mnt) = (m.lower.clone(), m.mnt.clone());
    let branch = format!("--branch={}", b.display());
    fs::write(m.path("kept"), b"on both").unwrap();
    let mut f = fs::File::create(m.path("open")).unwrap();
    f.write_all(&vec![7u8; 1 << 20]).unwrap();
    m.child().kill().unwrap();
    let _ = m.child().wait();
    drop(f);
    let (before_a, before_b) = (snapshot(&a), snapshot(&b));
    let dir = std::mem::replace(&mut m.dir, tempfile::tempdir().unwrap());
    drop(m);
    let mut m = Mount::start(dir, a.clone(), mnt, "mirror", &[&branch, "ro"]);
    assert_eq!(fs::read(m.path("kept")).unwrap(), b"on both");
    assert!(m.daemon_log().contains("a read-only mount cannot make the branches the same"), "{}", m.daemon_log());
    m.unmount();
    assert_eq!(snapshot(&a), before_a);
    assert_eq!(snapshot(&b), before_b);
}

/// `-o idle`: an unused mount goes by itself; one with a file open stays until it is closed.
#[test]
fn an_idle_mount_unmounts_itself_unless_a_file_is_open() {
    let mut m = Mount::with("zstd", &["idle=1s"]);
    fs::write(m.path("f"), b"x").unwrap();
    let held = fs::File::open(m.path("f")).unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(mounted_fstype(&m.mnt).as_deref(), Some("fuse.plyfs"), "unmounted with a file open");
    drop(held);
    let start = Instant::now();
    let status = m.wait_exit(Duration::from_secs(10)).expect("the daemon did not exit after the idle time");
    assert!(status.success(), "{}", m.daemon_log());
    assert!(start.elapsed() >= Duration::from_millis(900), "unmounted before the idle time passed");
    assert!(mounted_fstype(&m.mnt).is_none());
    assert!(m.daemon_log().contains("(-o idle)"), "{}", m.daemon_log());
    assert!(!fs::read(m.lower_path("f")).unwrap().is_empty(), "what was written stays below");
    // A bad duration is one line, before anything is mounted.
    let out = run(plyfs().arg("mount").arg(&m.lower).arg(&m.mnt).args(["--stack", "null", "-o", "idle=soon"]));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a duration"));
}

/// `df` asks every few seconds how full each mount is (`stat`, then `statfs`): that is no use
/// of the mount, and an idle one still goes (#32).
#[test]
fn df_does_not_keep_an_idle_mount() {
    let mut m = Mount::with("null", &["idle=1s", "attr_timeout=0"]);
    fs::write(m.path("f"), b"x").unwrap();
    let start = Instant::now();
    let mut status = None;
    while status.is_none() && start.elapsed() < Duration::from_secs(15) {
        let _ = std::process::Command::new("df").arg(&m.mnt).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).status();
        let c = cpath(&m.mnt);
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        unsafe { libc::statvfs(c.as_ptr(), &mut s) };
        status = m.wait_exit(Duration::from_millis(200));
    }
    let status = status.unwrap_or_else(|| panic!("df kept the mount alive: {}", m.daemon_log()));
    assert!(status.success(), "{}", m.daemon_log());
    assert!(m.daemon_log().contains("(-o idle)"), "{}", m.daemon_log());
    assert!(mounted_fstype(&m.mnt).is_none());
    assert_eq!(fs::read(m.lower_path("f")).unwrap(), b"x");
}

