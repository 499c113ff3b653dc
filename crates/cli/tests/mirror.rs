//! `mirror` through real mounts: two branches kept identical, a branch failed by `fault` in the
//! middle of a workload, failover of reads, resync, scrub, and a daemon killed mid-write.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;


/// Every object under `root` (but the mirror's log and the lower lock) with what identifies its content.
fn tree(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel == ".plyfs-mirror.log" || rel == ".plyfs.lock" {
                continue;
            }
            let meta = fs::symlink_metadata(e.path()).unwrap();
            let what = if meta.is_dir() {
                walk(root, &e.path(), out);
                format!("dir {:o}", meta.mode())
            } else if meta.file_type().is_symlink() {
                format!("link {}", fs::read_link(e.path()).unwrap().display())
            } else {
                format!("file {:o} {}", meta.mode(), String::from_utf8_lossy(&fs::read(e.path()).unwrap()))
            };
            out.insert(rel, what);
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn workload(m: &Mount, round: usize) {
    fs::create_dir_all(m.path(&format!("r{round}/sub"))).unwrap();
    for i in 0..20 {
        fs::write(m.path(&format!("r{round}/f{i}")), format!("round {round} file {i}\n").repeat(i + 1)).unwrap();
    }
    let mut log = fs::OpenOptions::new().create(true).append(true).open(m.path("log")).unwrap();
    writeln!(log, "round {round}").unwrap();
    fs::rename(m.path(&format!("r{round}/f0")), m.path(&format!("r{round}/sub/moved"))).unwrap();
    fs::remove_file(m.path(&format!("r{round}/f1"))).unwrap();
    std::os::unix::fs::symlink("f2", m.path(&format!("r{round}/link"))).unwrap();
    fs::set_permissions(m.path(&format!("r{round}/f3")), std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
}

#[test]
fn every_change_reaches_both_branches() {
    let (m, b) = mirror("mirror");
    for round in 0..3 {
        workload(&m, round);
    }
    assert_eq!(tree(&m.lower), tree(&b));
    assert_eq!(tree(&m.lower), tree(&m.mnt));
    assert_eq!(op_json(&m.mnt, &["mirror-status"])["degraded"], false);
    assert_eq!(fs::read_to_string(m.path("log")).unwrap(), "round 0\nround 1\nround 2\n");
    assert!(!tree(&m.mnt).contains_key(".plyfs-mirror.log") && !m.path(".plyfs-mirror.log").exists());
}

/// `chattr` on a file or a directory sets its flags on both branches.
/// An object the mirror knows on the reading branch only (looked up after a remount) loses its
/// name while open, and another object takes the name: a change to the open object reaches
/// that object on every branch, not the one that took its name on the others (#29).
#[test]
fn a_change_to_an_object_whose_name_was_taken_reaches_that_object_only() {
    use std::os::unix::fs::PermissionsExt;
    let (m, b) = mirror("mirror");
    fs::write(m.path("a"), "a").unwrap();
    fs::write(m.path("c"), "c").unwrap();
    let m = m.remount();
    let open = fs::File::open(m.path("a")).unwrap();
    fs::rename(m.path("c"), m.path("a")).unwrap();
    open.set_permissions(fs::Permissions::from_mode(0o600)).unwrap();
    drop(open);
    assert_eq!(op_json(&m.mnt, &["mirror-status"])["degraded"], false);
    assert_eq!(tree(&m.lower), tree(&b));
    assert_eq!(fs::metadata(m.path("a")).unwrap().mode() & 0o777, 0o644);
}

#[test]
fn file_attribute_flags_are_set_on_both_branches() {
    let (m, b) = mirror("mirror");
    fs::write(m.path("f"), "x").unwrap();
    fs::create_dir(m.path("d")).unwrap();
    for name in ["f", "d"] {
        let Ok(flags) = get_file_flags(&m.lower_path(name)) else { return };
        assert_eq!(get_file_flags(&m.path(name)), Ok(flags));
        assert_eq!(set_file_flags(&m.path(name), flags | FS_NOATIME_FL), 0, "{name}");
        for branch in [m.lower_path(name), b.join(name)] {
            assert_eq!(get_file_flags(&branch), Ok(flags | FS_NOATIME_FL), "{}", branch.display());
        }
    }
}

/// An operation that only levels below the fan-out layer handle is refused with the addresses
/// that reach them (#32: it used to say only that no layer of the stack handles it).
#[test]
fn an_operation_handled_only_below_the_mirror_names_where_it_is_handled() {
    let op = |m: &Mount, op: &str| run(plyfs().arg("op").arg(&m.mnt).arg(op));
    let refused = |out: std::process::Output, expect: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(expect), "{err:?} should contain {expect:?}");
        assert!(out.stdout.is_empty());
    };
    let (m, _b) = mirror("mirror[|fault]");
    op_json(&m.mnt, &["fault-add@mirror.1.fault", "op=unlink", "error=EIO"]);
    refused(
        op(&m, "fault-clear"),
        "unsupported operation 'fault-clear': no layer of the stack (mirror) handles it; a level below a fan-out layer does: fault-clear@mirror.1.fault",
    );
    // Nothing was cleared.
    assert_eq!(op_json(&m.mnt, &["fault-list@mirror.1.fault"]).as_array().unwrap().len(), 1);
    drop(m);
    // Two levels handle it: the mirror would pick its reading branch's without a word.
    let (m, _b) = mirror("trace,mirror[fault|fault]");
    op_json(&m.mnt, &["fault-add@mirror.0.fault", "op=unlink", "error=EIO"]);
    refused(
        op(&m, "fault-clear"),
        "ambiguous operation 'fault-clear': no layer of the stack (trace, mirror) handles it, and levels below a fan-out layer do, each for itself: fault-clear@mirror.0.fault, fault-clear@mirror.1.fault; name one",
    );
    assert_eq!(op_json(&m.mnt, &["fault-list@mirror.0.fault"]).as_array().unwrap().len(), 1);
    op_json(&m.mnt, &["fault-clear@mirror.0.fault"]);
    assert_eq!(op_json(&m.mnt, &["fault-list@mirror.0.fault"]).as_array().unwrap().len(), 0);
}

#[test]
fn a_branch_failed_mid_workload_costs_the_application_nothing_and_resync_restores_it() {
    let (m, b) = mirror("mirror[|fault]");
    workload(&m, 0);
    op_json(&m.mnt, &["fault-add@mirror.1.fault", "error=EIO"]);
    // No error reaches the application while the branch fails under it.
    for round in 1..4 {
        workload(&m, round);
    }
    let status = op_json(&m.mnt, &["mirror-status"]);
    assert_eq!(status["degraded"], true);
    assert_eq!(status["branches"][1]["state"], "failed");
    assert!(status["branches"][1]["stale_paths"].as_u64().unwrap() > 0);
    assert!(m.daemon_log().contains("branch 'mirror.1'") && m.daemon_log().contains("failed"), "{}", m.daemon_log());
    assert_ne!(tree(&m.lower), tree(&b));
    // Still failing: resync refuses and changes nothing.
    op_json(&m.mnt, &["fault-clear@mirror.1.fault"]);
    let done = op_json(&m.mnt, &["resync"]);
    assert_eq!(done["resynced"][0]["branch"], "mirror.1");
    assert_eq!(tree(&m.lower), tree(&b));
    assert_eq!(op_json(&m.mnt, &["mirror-status"])["degraded"], false);
    // In sync again: changes reach it.
    workload(&m, 9);
    assert_eq!(tree(&m.lower), tree(&b));
}

#[test]
fn an_fsync_error_every_branch_gives_is_the_answer_and_fails_no_branch() {
    let (m, b) = mirror("mirror[fault|fault]");
    let mut f = std::fs::File::create(m.path("f")).unwrap();
    f.write_all(b"data").unwrap();
    for level in ["mirror.0.fault", "mirror.1.fault"] {
        op_json(&m.mnt, &[&format!("fault-add@{level}"), "op=fsync", "path=f", "error=ENOSPC"]);
    }
    assert_eq!(f.sync_all().unwrap_err().raw_os_error(), Some(libc::ENOSPC), "{}", m.daemon_log());
    let status = op_json(&m.mnt, &["mirror-status"]);
    assert_eq!(status["degraded"], false, "{status}");
    for level in ["mirror.0.fault", "mirror.1.fault"] {
        op_json(&m.mnt, &[&format!("fault-clear@{level}")]);
    }
    // One branch's own failure still fails that branch alone.
    op_json(&m.mnt, &["fault-add@mirror.1.fault", "op=fsync", "path=f", "error=EIO"]);
    f.sync_all().unwrap();
    assert_eq!(op_json(&m.mnt, &["mirror-status"])["branches"][1]["state"], "failed");
    assert_eq!(std::fs::read(b.join("f")).unwrap(), b"data");
}

#[test]
fn reads_fail_over_when_the_reading_branch_fails() {
    let (m, b) = mirror("mirror[fault|]");
    fs::write(m.path("data"), "mirrored").unwrap();
    op_json(&m.mnt, &["fault-add@mirror.0.fault", "op=read|lookup|getattr|open", "error=EIO"]);
    // Drop the kernel's cached pages so the read reaches the mirror.
    fs::write("/proc/sys/vm/drop_caches", "3").ok();
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(fs::read_to_string(m.path("data")).unwrap(), "mirrored");
    let status = op_json(&m.mnt, &["mirror-status"]);
    assert_eq!(status["reads_from"], "mirror.1");
    assert_eq!(status["branches"][0]["state"], "failed");
    fs::write(m.path("later"), "only on b for now").unwrap();
    assert_eq!(fs::read_to_string(b.join("later")).unwrap(), "only on b for now");
    op_json(&m.mnt, &["fault-clear@mirror.0.fault"]);
    op_json(&m.mnt, &["resync", "mirror.0"]);
    assert_eq!(tree(&m.lower), tree(&b));
    assert_eq!(op_json(&m.mnt, &["mirror-status"])["reads_from"], "mirror.0");
}

#[test]
fn a_failed_branch_stays_out_across_a_remount_until_resynced() {
    let (m, b) = mirror("mirror[|fault]");
    workload(&m, 0);
    op_json(&m.mnt, &["fault-add@mirror.1.fault", "error=ENOTCONN"]);
    workload(&m, 1);
    let m = m.remount();
    let status = op_json(&m.mnt, &["mirror-status"]);
    assert_eq!(status["branches"][1]["state"], "failed", "{status}");
    assert!(m.daemon_log().contains("serves nothing until `resync`"), "{}", m.daemon_log());
    // A scrub cannot check the failed branch, and says so.
    let out = run(plyfs().arg("op").arg(&m.mnt).arg("scrub"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let said = format!("branch 'mirror.1' ({}) failed and is not in sync, so its files were not checked", b.display());
    assert!(err.contains(&said), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    workload(&m, 2);
    op_json(&m.mnt, &["resync"]);
    assert_eq!(tree(&m.lower), tree(&b));
}

#[test]
fn scrub_finds_and_repairs_what_differs() {
    let (m, b) = mirror("mirror");
    workload(&m, 0);
    // Open for writing across the repair: what it writes after reaches the repaired copy.
    let mut open = fs::OpenOptions::new().append(true).open(m.path("r0/f5")).unwrap();
    open.write_all(b"before\n").unwrap();
    fs::write(b.join("r0/f5"), "rotten").unwrap();
    fs::remove_file(b.join("r0/f6")).unwrap();
    fs::write(b.join("r0/extra"), "not on a").unwrap();
    let report = op_json(&m.mnt, &["scrub"]);
    let repaired: Vec<&str> = report["repaired"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(repaired, ["r0/extra", "r0/f6", "r0/f5"]);
    open.write_all(b"after\n").unwrap();
    drop(open);
    assert!(fs::read_to_string(b.join("r0/f5")).unwrap().ends_with("before\nafter\n"));
    assert_eq!(tree(&m.lower), tree(&b));
    assert_eq!(op_json(&m.mnt, &["scrub"])["repaired"].as_array().unwrap().len(), 0);
}

/// A name with control characters (a terminal escape, a newline) is logged escaped, one line
/// that cannot recolour a terminal or forge another line; the answer keeps it as it is (#32).
#[test]
fn names_in_the_log_have_their_control_characters_escaped() {
    let (m, b) = mirror("mirror");
    let evil = "red\u{1b}[31mname\nWARN forged";
    fs::write(m.path(evil), "x").unwrap();
    fs::write(b.join(evil), "rotten").unwrap();
    let report = op_json(&m.mnt, &["scrub"]);
    assert_eq!(report["repaired"], serde_json::json!([evil]));
    let log = m.daemon_log();
    let line = log.lines().find(|l| l.contains("scrub repaired")).unwrap_or_else(|| panic!("{log}"));
    assert!(line.ends_with("red\\x1b[31mname\\x0aWARN forged"), "{line:?}");
    assert!(!log.contains('\u{1b}') && !log.lines().any(|l| l.starts_with("WARN forged")), "{log:?}");
    assert_eq!(fs::read(b.join(evil)).unwrap(), b"x");
}

/// On a terminal, `mirror-status` reads as fields and a table of the branches (#32).
#[test]
fn mirror_status_is_a_table_on_a_terminal() {
    let (m, _b) = mirror("mirror");
    let (status, text) = run_on_terminal(plyfs().arg("op").arg(&m.mnt).arg("mirror-status"));
    assert!(status.success(), "{text}");
    assert!(text.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["degraded:", "false"]), "{text}");
    let header = text.lines().position(|l| l.trim_start().starts_with("NAME ")).unwrap_or_else(|| panic!("{text}"));
    assert!(text.lines().nth(header - 1) == Some("branches:"), "{text}");
    let rows: Vec<Vec<&str>> = text.lines().skip(header + 1).map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows.len(), 2, "{text}");
    assert!(rows.iter().all(|r| r.contains(&"in-sync")), "{text}");
}

/// SIGKILL while a large file is being written: the next mount makes it the same on both
/// branches before serving.
/// A copy that a resync or scrub left halfway (a directory under its hidden temporary name) is
/// removed by the next scrub: the branches end identical (#29).
#[test]
fn scrub_removes_copies_left_halfway() {
    let (m, b) = mirror("mirror");
    fs::create_dir_all(m.path("d/e")).unwrap();
    for left in [b.join(".plyfs-mirror-copy.1.left.0/sub"), b.join("d/e/.plyfs-mirror-copy.1.left.1")] {
        fs::create_dir_all(&left).unwrap();
        fs::write(left.join("f"), "half a copy").unwrap();
    }
    op_json(&m.mnt, &["scrub"]);
    assert_eq!(tree(&m.lower), tree(&b));
}

#[test]
fn a_daemon_killed_mid_write_is_resynced_at_the_next_mount() {
    let (mut m, b) = mirror("mirror");
    let path = m.path("big");
    let writer = std::thread::spawn(move || {
        let mut f = fs::File::create(path)?;
        let block = vec![0x5au8; 1 << 20];
        for _ in 0..4096 {
            f.write_all(&block)?;
        }
        Ok::<(), std::io::Error>(())
    });
    while fs::metadata(m.lower_path("big")).map(|s| s.len()).unwrap_or(0) < 32 << 20 {
        std::thread::sleep(Duration::from_millis(5));
    }
    m.child().kill().unwrap();
    let _ = m.child().wait();
    assert!(writer.join().unwrap().is_err(), "the writer saw its file system go");
    let m = m.remount();
    assert!(m.daemon_log().contains("were in flight when the daemon stopped"), "{}", m.daemon_log());
    let (sa, sb) = (fs::read(m.lower_path("big")).unwrap(), fs::read(b.join("big")).unwrap());
    assert_eq!(sa.len(), sb.len());
    assert!(sa == sb, "both branches hold the same bytes");
    assert_eq!(op_json(&m.mnt, &["scrub"])["repaired"].as_array().unwrap().len(), 0);
}

#[test]
fn bad_requests_are_refused_with_one_line() {
    let (m, _b) = mirror("mirror");
    for (args, expect) in [(vec!["resync", "nosuch"], "no branch named 'nosuch'"), (vec!["resync", "mirror.1"], "is in sync already")] {
        let out = run(plyfs().arg("op").arg(&m.mnt).args(&args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(expect) && err.lines().count() == 1, "{args:?}: {err}");
    }
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let (a, b, mnt) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("mnt"));
    for d in [&a, &b, &mnt] {
        fs::create_dir(d).unwrap();
    }
    let out = run(plyfs().arg("mount").arg(&a).arg(&mnt).args(["--stack", "mirror", "--branch"]).arg(format!("{}=ro", b.display())));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is read-only, but every branch of a mirror takes every write"), "{err}");
    assert!(mounted_fstype(&mnt).is_none());
}

/// The bottom layers of all branches share the daemon's open-files limit: a two-branch mirror
/// under a limit of 1,000 descriptors holds 2,500 files the kernel remembers.
#[test]
fn branches_share_the_open_files_limit() {
    if !is_root() {
        return; // closing idle descriptors needs reopening by handle (CAP_DAC_READ_SEARCH)
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = run(plyfs().arg("umount").arg(&self.0));
            if mounted_fstype(&self.0).is_some() {
                let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
            }
        }
    }
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (a, b, mnt) = (root.join("a"), root.join("b"), root.join("mnt"));
    for d in [&a, &b, &mnt] {
        fs::create_dir(d).unwrap();
    }
    let script = format!(
        "ulimit -Sn 1000 && ulimit -Hn 1000 && exec {} mount {} {} --stack mirror --branch {}",
        env!("CARGO_BIN_EXE_plyfs"),
        a.display(),
        mnt.display(),
        b.display()
    );
    let out = run(std::process::Command::new("sh").arg("-c").arg(&script));
    let _guard = Unmount(mnt.clone());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for i in 0..2500 {
        let d = mnt.join(format!("d{:02}", i / 100));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join(format!("f{i}")), "x").unwrap_or_else(|e| panic!("file {i}: {e}"));
    }
    assert_eq!(tree(&a), tree(&b));
    assert_eq!(tree(&mnt).len(), 2525);
}

/// A mirror whose two branches share one file system, and fill it (xfstests generic/103): the
/// branch that could not follow a write fails, as a mirror's must. The last one in sync then
/// answers `ENOSPC` for what does not fit, and goes on serving reads, new names and removals:
/// no `EIO`, and removing a file makes room again. (Its log of changes keeps room set aside;
/// without it, the log could not note a change on the full branch, which failed too.)
#[test]
fn a_full_file_system_under_the_last_branch_answers_enospc_and_still_frees_space() {
    let small = SmallTmpfs::mount("8m");
    let (a, b) = (small.path().join("a"), small.path().join("b"));
    fs::create_dir(&a).unwrap();
    fs::create_dir(&b).unwrap();
    let (dir, _, [mnt]) = scratch_dirs(["mnt"]);
    let m = Mount::start(dir, a, mnt, "mirror", &[&format!("--branch={}", b.display())]);
    fs::write(m.path("keep"), vec![7u8; 65536]).unwrap();
    let mut fill = fs::File::create(m.path("fill")).unwrap();
    let err = loop {
        if let Err(e) = fill.write_all(&[1u8; 65536]) {
            break e;
        }
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "filling: {err}");
    drop(fill);
    // Many changes on the full file system: each is made or refused with ENOSPC.
    for i in 0..200 {
        let p = m.path(&format!("f{i}"));
        match fs::write(&p, vec![2u8; 8192]) {
            Ok(()) => {}
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{}: {e}\n{}", p.display(), m.daemon_log()),
        }
    }
    assert_eq!(fs::read(m.path("keep")).unwrap(), vec![7u8; 65536]);
    fs::remove_file(m.path("fill")).expect("removing a file on a full mirror");
    fs::write(m.path("after"), vec![3u8; 1 << 20]).expect("writing once there is room again");
    let status = op_json(&m.mnt, &["mirror-status"]);
    assert_eq!(status["reads_from"], "mirror.0", "{status}");
    assert_eq!(status["branches"][0]["state"], "in-sync", "{status}");
    drop(m);
}

/// `SEEK_DATA` past the last data and `SEEK_HOLE` past the end answer ENXIO, as lseek(2) says:
/// an answer, not a failure of the branch that gave it (xfstests generic/285 failed both
/// branches with it, and every later access answered EIO).
#[test]
fn lseek_past_the_data_answers_enxio_and_fails_no_branch() {
    let (m, _b) = mirror("mirror");
    fs::write(m.path("f"), vec![1u8; 4096]).unwrap();
    let f = fs::File::open(m.path("f")).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    for whence in [libc::SEEK_DATA, libc::SEEK_HOLE] {
        let at = unsafe { libc::lseek(fd, 8192, whence) };
        assert_eq!((at, errno()), (-1, libc::ENXIO), "lseek(8192, {whence})");
    }
    assert_eq!(unsafe { libc::lseek(fd, 0, libc::SEEK_HOLE) }, 4096);
    let status = op_json(&m.mnt, &["mirror-status"]);
    assert_eq!(status["degraded"], false, "{status}");
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![1u8; 4096]);
}
