//! FUSE over io_uring (`-o io_uring=on` or `auto`): requests reach the daemon through per-CPU
//! rings, and everything behaves as over `/dev/fuse`. The POSIX checks of `posix.rs`, the
//! fsx-style tester and pjdfstest also run with io_uring on (see those files and
//! `tests/pjdfstest/run.sh`).
//!
//! The rings need the kernel's permission (`/sys/module/fuse/parameters/enable_uring`), which
//! `scripts/test.sh` gives. Without it these tests say so and pass, unless
//! `PLYFS_REQUIRE_URING=1` (set by `scripts/test.sh`) makes that a failure.

mod common;

use std::fs;
use std::path::Path;
use std::time::Duration;

use common::*;

const PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

fn uring_allowed() -> bool {
    let on = fs::read_to_string(PARAM).is_ok_and(|v| v.trim() == "Y");
    if !on {
        assert!(
            std::env::var("PLYFS_REQUIRE_URING").as_deref() != Ok("1"),
            "PLYFS_REQUIRE_URING=1 but {PARAM} is not Y"
        );
        eprintln!("skipped: FUSE over io_uring is off in this kernel ({PARAM})");
    }
    on
}

/// The voluntary context switches of the daemon's ring threads: each request a ring serves
/// wakes one of them.
fn ring_wakeups(pid: i32) -> u64 {
    let mut total = 0;
    for task in fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("plyfs-uring-") || comm.starts_with("plyfs-uring-w") {
            continue;
        }
        let status = fs::read_to_string(task.path().join("status")).unwrap_or_default();
        total += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap());
    }
    total
}

#[test]
fn requests_travel_over_the_rings() {
    if !uring_allowed() {
        return;
    }
    // No attribute or entry caching: every stat is a LOOKUP and a GETATTR.
    let m = Mount::with("null", &["io_uring=on", "attr_timeout=0", "entry_timeout=0"]);
    assert!(m.daemon_log().contains("requests over io_uring"), "{}", m.daemon_log());
    fs::write(m.path("f"), b"x").unwrap();
    let before = ring_wakeups(m.pid());
    for _ in 0..500 {
        fs::metadata(m.path("f")).unwrap();
    }
    let served = ring_wakeups(m.pid()) - before;
    assert!(served >= 500, "the ring threads woke {served} times for 1000 requests");
}

#[test]
fn the_default_uses_the_rings_where_allowed_and_off_does_not() {
    if !uring_allowed() || !is_root() {
        return;
    }
    for opts in [&["io_uring=auto"][..], &[]] {
        let m = Mount::with("null", opts);
        assert!(m.daemon_log().contains("requests over io_uring"), "{opts:?}: {}", m.daemon_log());
    }
    let m = Mount::with("null", &["io_uring=off"]);
    assert!(!m.daemon_log().contains("requests over io_uring"), "{}", m.daemon_log());
    assert_eq!(ring_wakeups(m.pid()), 0);
}

/// The rings are served by threads of their own: they too turn away users other than root and
/// the owner on an `allow_root` mount (the kernel is told `allow_other`).
#[test]
fn allow_root_turns_other_users_away_over_the_rings() {
    if !uring_allowed() || !is_root() {
        return;
    }
    assert_allow_root_refuses_others(&["io_uring=on"]);
}

#[test]
fn data_metadata_and_directories_round_trip() {
    if !uring_allowed() {
        return;
    }
    for (stack, opts) in [("null", &["io_uring=on"][..]), ("null", &["io_uring=on", "passthrough=off"]), ("zstd", &["io_uring=on"])] {
        let m = Mount::with(stack, opts);
        // Large writes and reads: one request carries up to 1 MiB.
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        fs::write(m.path("big"), &data).unwrap();
        assert_eq!(fs::read(m.path("big")).unwrap(), data, "[{stack}] {opts:?}");
        fs::create_dir(m.path("d")).unwrap();
        for i in 0..300 {
            fs::write(m.path(&format!("d/file-with-a-longer-name-{i}")), i.to_string()).unwrap();
        }
        // Enough entries that readdir and readdirplus take several requests.
        let mut names: Vec<String> = fs::read_dir(m.path("d")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names.len(), 300);
        for i in 0..300 {
            assert_eq!(fs::read_to_string(m.path(&format!("d/file-with-a-longer-name-{i}"))).unwrap(), i.to_string());
        }
        std::os::unix::fs::symlink("big", m.path("link")).unwrap();
        assert_eq!(fs::read_link(m.path("link")).unwrap(), Path::new("big"));
        fs::rename(m.path("link"), m.path("d/link")).unwrap();
        fs::hard_link(m.path("big"), m.path("hard")).unwrap();
        assert_eq!(fs::metadata(m.path("big")).unwrap().len(), data.len() as u64);
        xattr_round_trip(&m.path("big"));
        let out = run(std::process::Command::new("rm").arg("-rf").arg(m.path("d")));
        assert!(out.status.success());
        assert!(!m.path("d").exists());
        // statfs
        let c = cpath(&m.mnt);
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
        assert!(st.f_blocks > 0);
        // Errors come back as errors.
        assert_eq!(fs::metadata(m.path("missing")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
        assert_eq!(fs::create_dir(m.path("hard")).unwrap_err().raw_os_error(), Some(libc::EEXIST));
    }
}

fn xattr_round_trip(p: &Path) {
    let c = cpath(p);
    let (name, value) = (c"user.plyfs-test", b"a value");
    assert_eq!(unsafe { libc::setxattr(c.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) }, 0);
    let mut buf = [0u8; 64];
    let n = unsafe { libc::getxattr(c.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(&buf[..n as usize], value);
    let n = unsafe { libc::getxattr(c.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
    assert_eq!(n as usize, value.len());
    let n = unsafe { libc::listxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(buf[..n as usize].split(|&b| b == 0).any(|x| x == b"user.plyfs-test"));
    assert_eq!(unsafe { libc::removexattr(c.as_ptr(), name.as_ptr()) }, 0);
    assert_eq!(unsafe { libc::getxattr(c.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) }, -1);
    assert_eq!(errno(), libc::ENODATA);
}

#[test]
fn a_killed_daemon_with_rings_leaves_a_mount_umount_cleans_up() {
    if !uring_allowed() {
        return;
    }
    let mut m = Mount::with("null", &["io_uring=on"]);
    kill_daemon_and_clean_up(&mut m);
}

#[test]
fn unmount_ends_the_ring_threads_and_the_daemon() {
    if !uring_allowed() {
        return;
    }
    let mut m = Mount::with("zstd", &["io_uring=on"]);
    fs::write(m.path("f"), b"kept").unwrap();
    let out = run(plyfs().arg("umount").arg(&m.mnt));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let status = m.wait_exit(Duration::from_secs(20)).expect("the daemon exits after unmount");
    assert!(status.success(), "{}", m.daemon_log());
    let again = Mount::start(tempfile::tempdir().unwrap(), m.lower.clone(), m.mnt.clone(), "zstd", &["io_uring=on"]);
    assert_eq!(fs::read(again.path("f")).unwrap(), b"kept");
}

/// With the kernel's permission off, `-o io_uring=on` mounts over `/dev/fuse` and says why, and
/// `auto` says in the mount message how to turn it on.
/// It turns the permission off for a moment, which other mounts asking for io_uring at that
/// time would see: `scripts/test.sh` runs it on its own (`--ignored`).
#[test]
#[ignore]
fn without_the_kernels_permission_requests_go_through_dev_fuse() {
    if !is_root() || !Path::new(PARAM).exists() {
        eprintln!("skipped: needs root and a kernel with FUSE over io_uring");
        return;
    }
    let was = fs::read_to_string(PARAM).unwrap();
    fs::write(PARAM, "0").unwrap();
    let logs = std::panic::catch_unwind(|| {
        ["io_uring=on", "io_uring=auto", "io_uring=off"].map(|o| {
            let m = Mount::with("null", &[o]);
            fs::write(m.path("f"), b"works").unwrap();
            assert_eq!(fs::read(m.path("f")).unwrap(), b"works");
            m.daemon_log()
        })
    });
    fs::write(PARAM, if was.trim() == "Y" { "1" } else { "0" }).unwrap();
    let [on, auto, off] = logs.unwrap();
    // Asked for: a warning that says how to allow it.
    assert!(on.contains("WARN") && on.contains("-o io_uring: the kernel has it turned off"), "{on}");
    assert!(on.contains("echo 1 > /sys/module/fuse/parameters/enable_uring"), "{on}");
    assert!(!on.contains("requests over io_uring"), "{on}");
    // auto: no warning.
    assert!(!auto.contains("WARN") && auto.contains("FUSE over io_uring not used"), "{auto}");
    assert!(!auto.contains("requests over io_uring"), "{auto}");
    // The mount message says how to have it, and what it gives, unless asked not to use it (or
    // asked for it: then the warning says so).
    let hint = "requests over /dev/fuse: this kernel has FUSE over io_uring turned off, which would make metadata 1.4–1.8× faster (as root: echo 1 > /sys/module/fuse/parameters/enable_uring, then mount again)";
    assert!(auto.contains(hint), "{auto}");
    assert!(!on.contains(hint) && !off.contains(hint), "{on}\n{off}");
}
