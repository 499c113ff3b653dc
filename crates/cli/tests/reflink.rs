//! `cp` through a mount onto a lower that shares extents (XFS made with reflink=1, on a loop
//! device): between files no layer changes, the copy is a reflink of the lower files
//! (copy_file_range done between them); between encoded files it is an ordinary copy. FICLONE
//! itself (`cp --reflink=always`) never reaches a FUSE daemon: the kernel refuses it.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// An XFS file system with reflinks, on a loop device, unmounted (and its image removed) when
/// dropped.
struct Xfs {
    dir: tempfile::TempDir,
    mnt: PathBuf,
}

impl Xfs {
    fn new() -> Xfs {
        assert!(is_root(), "needs root (loop devices)");
        // Not on a tmpfs: a loop device over tmpfs works, but keep the machine's memory.
        let dir = tempfile::Builder::new().prefix("plyfs-test-xfs-").tempdir_in("/var/tmp").unwrap();
        let img = dir.path().join("img");
        fs::File::create(&img).unwrap().set_len(300 << 20).unwrap();
        let out = Command::new("mkfs.xfs").args(["-q", "-m", "reflink=1"]).arg(&img).output().expect("mkfs.xfs (xfsprogs)");
        assert!(out.status.success(), "mkfs.xfs: {}", String::from_utf8_lossy(&out.stderr));
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        let out = Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&mnt).output().unwrap();
        assert!(out.status.success(), "mount: {}", String::from_utf8_lossy(&out.stderr));
        Xfs { dir, mnt }
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        if Command::new("umount").arg(&self.mnt).status().map(|s| !s.success()).unwrap_or(true) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        let _ = self.dir.path();
    }
}

/// How many of the file's extents the lower file system shares with another file.
fn shared_extents(path: &Path) -> usize {
    let out = Command::new("filefrag").arg("-v").arg(path).output().expect("filefrag (e2fsprogs)");
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains("shared")).count()
}

#[test]
fn cp_reflinks_untouched_files_and_copies_encoded_ones() {
    let xfs = Xfs::new();
    for (stack, reflinks) in [("null", true), ("zstd", false)] {
        let lower = xfs.mnt.join(stack);
        let mnt_dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
        let mnt = mnt_dir.path().join("mnt");
        fs::create_dir(&lower).unwrap();
        fs::create_dir(&mnt).unwrap();
        let m = Mount::start(mnt_dir, lower.clone(), mnt, stack, &[]);
        let data: Vec<u8> = (0..(4u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        fs::write(m.path("src"), &data).unwrap();
        let out = Command::new("cp").arg(m.path("src")).arg(m.path("dst")).output().unwrap();
        assert!(out.status.success(), "{stack}: cp: {}", String::from_utf8_lossy(&out.stderr));
        assert!(fs::read(m.path("dst")).unwrap() == data, "{stack}: the copy reads back");
        let shared = shared_extents(&lower.join("dst"));
        if reflinks {
            assert!(shared > 0, "{stack}: the copy shares the source's extents below");
        } else {
            assert_eq!(shared, 0, "{stack}: an encoded file is copied, not shared");
        }
        // FICLONE is the kernel's to refuse for any FUSE file system.
        let out = Command::new("cp").arg("--reflink=always").arg(m.path("src")).arg(m.path("clone")).output().unwrap();
        assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not supported"), "{stack}");
        drop(m);
    }
}

/// A version is copied by data extent (to keep holes, #29), and each extent still by reflink
/// where the lower file system shares them.
#[test]
fn a_version_shares_the_files_extents() {
    let xfs = Xfs::new();
    let lower = xfs.mnt.join("version");
    let mnt_dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let mnt = mnt_dir.path().join("mnt");
    fs::create_dir(&lower).unwrap();
    fs::create_dir(&mnt).unwrap();
    let m = Mount::start(mnt_dir, lower.clone(), mnt, "version", &[]);
    let data: Vec<u8> = (0..(4u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    fs::write(m.path("f"), &data).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&fs::OpenOptions::new().write(true).open(m.path("f")).unwrap(), b"changed", 0).unwrap();
    let version = lower.join(".plyfs-versions/f/@1");
    assert!(fs::read(&version).unwrap() == data, "the version reads back");
    assert!(shared_extents(&version) > 0, "the version shares the file's extents below");
    drop(m);
}
