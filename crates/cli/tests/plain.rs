//! A data layer mounted over a directory of plain files (there before the layer): the mount
//! counts them and serves them as they are, writes keep them plain, `plyfs policy apply`
//! encodes them in place, and files in the layer's format, damaged or not, stay the layer's.

mod common;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use common::{cpath, mounted_fstype, plyfs, run, scratch_dirs, Mount};

const MAGIC: &[u8] = b"PLYSCA\x00\x01";

/// Seeded pseudo-random bytes (splitmix64), for data that does not compress.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The plain tree every test starts from: relative path to content (symlinks apart).
fn plain_tree(lower: &Path) -> BTreeMap<&'static str, Vec<u8>> {
    let mut files = BTreeMap::new();
    files.insert("empty", Vec::new());
    files.insert("one", b"x".to_vec());
    files.insert("page", noise(1, 4096));
    files.insert("big", noise(2, (1 << 20) + 17));
    files.insert("sub/deeper/text", b"plain text in a subdirectory\n".repeat(300));
    // Begins like the format's magic, but only like it.
    files.insert("almost-magic", [&MAGIC[..7], b"\x02 and then text"].concat());
    for (rel, data) in &files {
        let p = lower.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, data).unwrap();
    }
    // Sparse: 8 MiB with 5 bytes in the middle.
    let sparse = fs::File::create(lower.join("sparse")).unwrap();
    sparse.set_len(8 << 20).unwrap();
    sparse.write_all_at(b"hello", 4 << 20).unwrap();
    let mut model = vec![0u8; 8 << 20];
    model[4 << 20..(4 << 20) + 5].copy_from_slice(b"hello");
    files.insert("sparse", model);
    std::os::unix::fs::symlink("sub/deeper/text", lower.join("link")).unwrap();
    files
}

fn assert_reads_as(root: &Path, files: &BTreeMap<&str, Vec<u8>>, when: &str) {
    for (rel, data) in files {
        let p = root.join(rel);
        assert_eq!(fs::metadata(&p).unwrap().len(), data.len() as u64, "{when}: size of {rel}");
        assert!(fs::read(&p).unwrap() == *data, "{when}: {rel} reads differently");
    }
    assert_eq!(fs::read_link(root.join("link")).unwrap(), Path::new("sub/deeper/text"), "{when}");
    assert_eq!(fs::read(root.join("link")).unwrap(), files["sub/deeper/text"], "{when}: through the symlink");
}

/// A mount made in the background as a user makes it, unmounted when dropped.
struct Background {
    mnt: PathBuf,
    said: String,
}

impl Background {
    fn mount(lower: &Path, mnt: &Path, stack: &str, log: &Path) -> Background {
        let out = run(plyfs().arg("mount").arg(lower).arg(mnt).arg("--stack").arg(stack).arg("--log").arg(log));
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "mount: {said}");
        Background { mnt: mnt.to_owned(), said }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if mounted_fstype(&self.mnt).is_some() {
            let _ = plyfs().arg("umount").arg(&self.mnt).stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
        if mounted_fstype(&self.mnt).is_some() {
            let _ = std::process::Command::new("fusermount3").arg("-uz").arg(&self.mnt).stderr(Stdio::null()).status();
        }
    }
}

fn user_xattr(p: &Path) -> Option<Vec<u8>> {
    let mut buf = [0u8; 64];
    let n = unsafe { libc::getxattr(cpath(p).as_ptr(), c"user.note".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (n >= 0).then(|| buf[..n as usize].to_vec())
}

#[test]
fn plain_files_are_counted_served_as_they_are_and_encoded_by_policy_apply() {
    let (_dir, root, [lower, mnt]) = scratch_dirs(["lower", "mnt"]);
    let mut files = plain_tree(&lower);
    let big = lower.join("big");
    fs::set_permissions(&big, fs::Permissions::from_mode(0o640)).unwrap();
    let value = b"kept";
    assert_eq!(unsafe { libc::setxattr(cpath(&big).as_ptr(), c"user.note".as_ptr(), value.as_ptr().cast(), value.len(), 0) }, 0);
    let then = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    fs::File::options().write(true).open(&big).unwrap().set_modified(then).unwrap();

    let m = Background::mount(&lower, &mnt, "zstd", &root.join("daemon.log"));
    // Every non-empty regular file: the empty one is empty whatever the layer.
    let expected = format!("plyfs: 6 files in {} are plain (not zstd-encoded), and served as they are", lower.display());
    assert!(m.said.contains(&expected), "mount said: {}", m.said);
    assert_reads_as(&mnt, &files, "plain, through zstd");

    // Writes, truncation and mmap work on a plain file, and leave it plain.
    let mut f = OpenOptions::new().append(true).open(mnt.join("one")).unwrap();
    f.write_all(b"yz").unwrap();
    drop(f);
    files.get_mut("one").unwrap().extend_from_slice(b"yz");
    let page = OpenOptions::new().read(true).write(true).open(mnt.join("page")).unwrap();
    page.set_len(1000).unwrap();
    files.get_mut("page").unwrap().truncate(1000);
    page.write_at(b"middle", 500).unwrap();
    files.get_mut("page").unwrap()[500..506].copy_from_slice(b"middle");
    let mapped = mmap_read(&page, 1000);
    assert_eq!(mapped, files["page"], "mmap of a plain file");
    drop(page);
    for rel in ["one", "page"] {
        assert_eq!(fs::read(lower.join(rel)).unwrap(), files[rel], "{rel} stays plain in the lower directory");
    }
    // New files are encoded as the stack says.
    fs::write(mnt.join("new"), b"new through the mount").unwrap();
    files.insert("new", b"new through the mount".to_vec());
    assert!(fs::read(lower.join("new")).unwrap().starts_with(MAGIC), "a new file is zstd-encoded");

    assert_eq!(common::op_json(&mnt, &["policy-plain"])["plain"], 6, "counted under a directory");
    let explained = run(plyfs().args(["policy", "explain"]).arg(mnt.join("big")));
    let explained = String::from_utf8_lossy(&explained.stdout);
    assert!(explained.contains("a plain file") && explained.contains("pending"), "{explained}");
    let out = run(plyfs().args(["policy", "apply", "-r"]).arg(&mnt));
    assert!(out.status.success(), "policy apply: {}", String::from_utf8_lossy(&out.stderr));
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(summary.contains("6 re-encoded"), "{summary}");
    assert_reads_as(&mnt, &files, "after policy apply, same mount");
    drop(m);

    for (rel, data) in &files {
        let stored = fs::read(lower.join(rel)).unwrap();
        assert!(data.is_empty() || stored.starts_with(MAGIC), "{rel} is encoded in the lower directory");
    }
    let meta = fs::metadata(&big).unwrap();
    assert_eq!((meta.mode() & 0o7777, meta.modified().unwrap()), (0o640, then), "mode and mtime kept");
    assert_eq!(user_xattr(&big).as_deref(), Some(&value[..]), "user attributes kept");
    assert!(fs::metadata(lower.join("sparse")).unwrap().len() < 1 << 20, "the hole is not stored as zeros");

    let m = Background::mount(&lower, &mnt, "zstd", &root.join("daemon2.log"));
    assert!(!m.said.contains("plain"), "nothing plain is left: {}", m.said);
    assert_reads_as(&mnt, &files, "remounted after policy apply");
}

fn mmap_read(f: &fs::File, len: usize) -> Vec<u8> {
    use std::os::fd::AsRawFd;
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    assert_ne!(p, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
    let out = unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec();
    unsafe { libc::munmap(p, len) };
    out
}

/// Only a file in the layer's format is the layer's: with its header damaged it is still
/// rebuilt from its records, and with its data damaged it reads EIO; never is it served raw.
#[test]
fn damaged_encoded_files_stay_the_layers() {
    let mut m = Mount::new("zstd");
    let data = b"encoded, then damaged in the lower directory\n".repeat(200);
    for name in ["header", "data"] {
        fs::write(m.path(name), &data).unwrap();
    }
    m.unmount();
    // The magic gone: the first record still says what the file is.
    let header = OpenOptions::new().write(true).open(m.lower_path("header")).unwrap();
    header.write_all_at(b"XXXXXXXX", 0).unwrap();
    // The magic kept, everything after it overwritten.
    let mut damaged = OpenOptions::new().write(true).open(m.lower_path("data")).unwrap();
    let len = damaged.metadata().unwrap().len() as usize;
    damaged.seek(SeekFrom::Start(MAGIC.len() as u64)).unwrap();
    damaged.write_all(&noise(3, len - MAGIC.len())).unwrap();
    drop((header, damaged));
    let m = m.remount();
    assert_eq!(fs::read(m.path("header")).unwrap(), data, "rebuilt from its records");
    let err = fs::read(m.path("data")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "damaged data: {err}");
    assert!(!m.daemon_log().contains("plain"), "{}", m.daemon_log());
}

/// Random plain contents, some beginning with part of the magic, read back the same through
/// each compressor. `PLYFS_PLAIN_SEED=N` repeats a run.
#[test]
fn random_plain_files_read_the_same_through_the_mount() {
    let seed = common::rng::seed("PLYFS_PLAIN_SEED");
    let (_dir, _root, [lower, mnt]) = scratch_dirs(["lower", "mnt"]);
    let shape = noise(seed, 64 * 4);
    let mut files = Vec::new();
    for (i, r) in shape.chunks(4).enumerate() {
        let len = match r[0] % 4 {
            0 => usize::from(r[1]) % 16,
            1 => usize::from(u16::from_le_bytes([r[1], r[2]])),
            _ => usize::from(u16::from_le_bytes([r[1], r[2]])) * (usize::from(r[3]) % 8 + 1),
        };
        let mut data = noise(seed ^ (i as u64 + 1) << 32, len);
        if r[0] & 0x10 != 0 {
            // A strict prefix of the magic: the file is still plain.
            let prefix = (usize::from(r[3]) % MAGIC.len()).min(len);
            data[..prefix].copy_from_slice(&MAGIC[..prefix]);
            // The random byte after it must not complete the magic (1 in 256 did): a file
            // that begins with the whole magic is the layer's, and reads as damaged.
            if let Some(next) = data.get_mut(prefix) {
                if *next == MAGIC[prefix] {
                    *next ^= 0xff;
                }
            }
        }
        fs::write(lower.join(format!("f{i}")), &data).unwrap();
        files.push(data);
    }
    for stack in ["zstd", "gzip", "lz4"] {
        let m = Mount::start(tempfile::tempdir().unwrap(), lower.clone(), mnt.clone(), stack, &[]);
        for (i, data) in files.iter().enumerate() {
            let read = fs::read(m.path(&format!("f{i}"))).unwrap_or_else(|e| {
                panic!("{stack}: f{i} ({} bytes, {:x?}): {e}; seed {seed}\n{}", data.len(), &data[..16.min(data.len())], m.daemon_log())
            });
            assert!(read == *data, "{stack}: f{i} ({} bytes) differs; seed {seed}", data.len());
        }
    }
}

/// A cipher takes every lower file as its own: a plain file in a crypt volume is refused, not
/// passed off as authentic.
#[test]
fn crypt_refuses_plain_files() {
    for stack in ["crypt", "zstd,crypt"] {
        let mut m = Mount::crypt(stack, &["--plaintext-names"], &[]);
        fs::write(m.path("sealed"), b"encrypted").unwrap();
        m.unmount();
        fs::write(m.lower_path("planted"), b"not encrypted").unwrap();
        let m = m.remount();
        assert_eq!(fs::read(m.path("sealed")).unwrap(), b"encrypted", "{stack}");
        let err = fs::read(m.path("planted")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{stack}: {err}");
    }
    // With encrypted names, a plain name does not decrypt: hidden, with a warning.
    let mut m = Mount::crypt("zstd,crypt", &[], &[]);
    fs::write(m.path("sealed"), b"encrypted").unwrap();
    m.unmount();
    fs::write(m.lower_path("planted"), b"not encrypted").unwrap();
    let m = m.remount();
    let names: Vec<_> = fs::read_dir(&m.mnt).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["sealed"]);
    assert!(m.daemon_log().contains("hiding planted, which does not decrypt"), "{}", m.daemon_log());
}

/// The mount looks at 1000 files at most before it serves; past them its count is a lower bound.
#[test]
fn the_mount_count_is_bounded_and_says_so() {
    let (_dir, root, [lower, mnt]) = scratch_dirs(["lower", "mnt"]);
    for i in 0..1000 {
        fs::write(lower.join(format!("{i:04}")), b"plain").unwrap();
    }
    let said = Background::mount(&lower, &mnt, "zstd", &root.join("daemon.log")).said.clone();
    assert!(said.contains(&format!("plyfs: 1000 files in {} are plain", lower.display())), "{said}");
    fs::write(lower.join("one-more"), b"plain").unwrap();
    let said = Background::mount(&lower, &mnt, "zstd", &root.join("daemon.log")).said.clone();
    assert!(said.contains(&format!("plyfs: at least 1000 files in {} are plain", lower.display())), "{said}");
}

/// A plain file with two names is left plain by `policy apply`, with one line saying why: a
/// re-encoded copy would split the links.
#[test]
fn policy_apply_refuses_hard_linked_plain_files_per_file() {
    let (_dir, _root, [lower, mnt]) = scratch_dirs(["lower", "mnt"]);
    fs::write(lower.join("a"), b"linked plain").unwrap();
    fs::hard_link(lower.join("a"), lower.join("b")).unwrap();
    fs::write(lower.join("single"), b"single plain").unwrap();
    let m = Mount::start(tempfile::tempdir().unwrap(), lower.clone(), mnt.clone(), "zstd", &[]);
    let out = run(plyfs().args(["policy", "apply", "-r"]).arg(&mnt));
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    for name in ["a", "b"] {
        let line = format!("{}: not re-encoded: it has 2 hard links", mnt.join(name).display());
        assert!(said.lines().filter(|l| l.contains(&line)).count() == 1, "one line for {name}: {said}");
        assert_eq!(fs::read(m.path(name)).unwrap(), b"linked plain");
        assert_eq!(fs::read(lower.join(name)).unwrap(), b"linked plain", "{name} stays plain");
    }
    assert!(fs::read(lower.join("single")).unwrap().starts_with(MAGIC), "the others are encoded");
    assert_eq!(fs::read(m.path("single")).unwrap(), b"single plain");
}
