//! Concurrency stress through real mounts ([`common::stress`]): four workers colliding on one
//! small namespace through `mirror`, `union`, `version` and `zstd,crypt`. After the run the
//! mount answers, and what each stack promises holds: mirror branches are identical with no
//! branch failed, a union's read-only branch is unchanged, every file reads, `fsck` is sound.
//! `PLYFS_STRESS_SEED` repeats a run.

mod common;

use std::fs;
use std::path::Path;

use common::stress::{differences, tree};
use common::*;

const WORKERS: u64 = 4;
const OPS: u64 = 10_000;

/// Stress `m`, then check that its root lists and every file under it reads whole.
fn stress(m: &Mount) {
    let seed = stress::seed();
    let succeeded = stress::run(&m.mnt, seed, WORKERS, OPS).unwrap_or_else(|e| panic!("{e}\n{}", m.daemon_log()));
    assert!(succeeded > WORKERS * OPS / 10, "seed {seed}: only {succeeded} operations succeeded");
    assert!(fs::read_dir(&m.mnt).unwrap().count() > 0, "seed {seed}: the mount does not list");
    for (path, what) in tree(&m.mnt) {
        if what.starts_with("file") {
            let read = fs::read(m.path(&path));
            assert!(read.is_ok(), "seed {seed}: {path} does not read: {read:?}");
        }
    }
}

fn fsck(lower: &Path, args: &[&str]) {
    let out = run(plyfs().arg("fsck").arg(lower).args(args));
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "fsck {args:?}: {said}");
}

#[test]
fn mirror_branches_stay_identical_and_in_sync() {
    let (mut m, b) = mirror("mirror");
    stress(&m);
    let status = op_json(&m.mnt, &["mirror-status"]);
    assert_eq!(status["degraded"], false, "{status}\n{}", m.daemon_log());
    m.unmount();
    let diff = differences(&tree(&m.lower), &tree(&b));
    assert!(diff.is_empty(), "the branches differ:\n{}", diff.join("\n"));
}

#[test]
fn union_leaves_its_read_only_branch_unchanged() {
    let (dir, _, [upper, ro, mnt]) = scratch_dirs(["upper", "ro", "mnt"]);
    // Names the workers pick: files, a directory with a file, a symlink.
    for d in 0..4 {
        let d = ro.join(format!("d{d}"));
        fs::create_dir(&d).unwrap();
        for n in 0..6 {
            fs::write(d.join(format!("n{n}")), format!("read-only {n}\n").repeat(100)).unwrap();
        }
        fs::create_dir(d.join("n6")).unwrap();
        fs::write(d.join("n6/n0"), "deep").unwrap();
        std::os::unix::fs::symlink("n0", d.join("n7")).unwrap();
    }
    let before = tree(&ro);
    let branch = format!("--branch={}=ro", ro.display());
    let mut m = Mount::start(dir, upper, mnt, "union", &[&branch]);
    stress(&m);
    m.unmount();
    let diff = differences(&before, &tree(&ro));
    assert!(diff.is_empty(), "the read-only branch changed:\n{}", diff.join("\n"));
}

#[test]
fn version_keeps_every_file_readable_and_fsck_sound() {
    let mut m = Mount::new("version");
    stress(&m);
    m.unmount();
    fsck(&m.lower, &["--stack", "version"]);
}

#[test]
fn zstd_over_crypt_keeps_every_file_readable_and_fsck_sound() {
    let mut m = Mount::crypt("zstd,crypt", &[], &[]);
    stress(&m);
    m.unmount();
    let passfile = crypt_passfile(m.dir.path());
    fsck(&m.lower, &["--stack", "zstd,crypt", "--passfile", passfile.to_str().unwrap()]);
}
