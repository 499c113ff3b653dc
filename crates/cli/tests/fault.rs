//! The `fault` layer through real mounts: rules added, listed and cleared at run time, each kind
//! of fault, and probabilistic rules that repeat from a seed.

mod common;

use std::fs;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

fn op(path: &Path, args: &[&str]) -> std::process::Output {
    run(plyfs().arg("op").arg(path).args(args))
}

#[test]
fn errors_hit_only_what_the_rule_picks_until_cleared() {
    let m = Mount::new("fault,null");
    fs::write(m.path("keep.txt"), "fine").unwrap();
    let added = op_json(&m.mnt, &["fault-add", "op=create|write", "path=*.db", "error=ENOSPC"]);
    assert_eq!(added["rule"], "op=create|write path=*.db error=ENOSPC");
    let err = fs::write(m.path("data.db"), "x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
    fs::write(m.path("other.txt"), "still fine").unwrap();
    assert_eq!(fs::read_to_string(m.path("keep.txt")).unwrap(), "fine");
    let list = op_json(&m.mnt, &["fault-list"]);
    assert_eq!(list[0]["fired"], 1);
    op_json(&m.mnt, &["fault-clear"]);
    fs::write(m.path("data.db"), "x").unwrap();
    // Bad rules get one line and change nothing.
    for (rule, expect) in [("error=EWHAT", "unknown error"), ("op=read", "say what to inject"), ("p=3 error=EIO", "probability")] {
        let out = op(&m.mnt, &["fault-add", rule]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(expect) && err.lines().count() == 1, "{rule}: {err}");
    }
    assert_eq!(op_json(&m.mnt, &["fault-list"]).as_array().unwrap().len(), 0);
}

#[test]
fn torn_short_and_delayed_writes() {
    let m = Mount::new("fault,null");
    op_json(&m.mnt, &["fault-add", "op=write", "torn=5", "count=1"]);
    let mut f = fs::File::create(m.path("torn")).unwrap();
    let err = f.write_all(b"hello, torn world").and_then(|()| f.sync_all()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    drop(f);
    assert_eq!(fs::read(m.lower_path("torn")).unwrap(), b"hello", "the first 5 bytes reached the lower file");
    // A short write: write(2) returns less, and write_all goes on with the rest.
    op_json(&m.mnt, &["fault-add", "op=write", "short=4", "count=1"]);
    let mut f = fs::File::create(m.path("short")).unwrap();
    assert_eq!(f.write(b"0123456789").unwrap(), 4);
    f.write_all(b"456789").unwrap();
    drop(f);
    assert_eq!(fs::read(m.path("short")).unwrap(), b"0123456789");
    op_json(&m.mnt, &["fault-add", "op=getattr|lookup", "path=slow", "delay=300ms", "count=1"]);
    fs::write(m.lower_path("slow"), "x").unwrap();
    let start = Instant::now();
    fs::metadata(m.path("slow")).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(300), "the delay applies");
}

/// The same seed makes the same choices: a failing run can be replayed.
#[test]
fn probabilistic_rules_repeat_from_a_seed() {
    let outcomes = |seed: &str| {
        let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
        let root = dir.path().canonicalize().unwrap();
        let rules = root.join("rules");
        fs::write(&rules, "# half the creates fail\nop=create p=0.5 error=EIO\n").unwrap();
        let (lower, mnt) = (root.join("lower"), root.join("mnt"));
        fs::create_dir(&lower).unwrap();
        fs::create_dir(&mnt).unwrap();
        let m = Mount::start(dir, lower, mnt, &format!("fault:seed={seed}:rules={},null", rules.display()), &[]);
        (0..40).map(|i| fs::write(m.path(&format!("f{i}")), "x").is_ok()).collect::<Vec<bool>>()
    };
    let first = outcomes("42");
    assert_eq!(first, outcomes("42"));
    let failed = first.iter().filter(|ok| !**ok).count();
    assert!((5..=35).contains(&failed), "about half fail: {failed} of 40");
    assert_ne!(first, outcomes("7"));
}

#[test]
fn a_bad_rules_file_refuses_the_mount_with_its_line() {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let rules = dir.path().join("rules");
    fs::write(&rules, "op=read error=EIO\nop=write error=EWHAT\n").unwrap();
    let (lower, mnt) = (dir.path().join("lower"), dir.path().join("mnt"));
    fs::create_dir(&lower).unwrap();
    fs::create_dir(&mnt).unwrap();
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).arg("--stack").arg(format!("fault:rules={}", rules.display())));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "a bad stack is a usage error: {err}");
    assert!(err.contains("line 2: error=EWHAT: unknown error") && err.lines().count() == 1, "{err}");
    assert!(mounted_fstype(&mnt).is_none());
}
