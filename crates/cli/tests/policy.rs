//! Per-file layer chains through a real mount: attributes set with setxattr(2), rules files,
//! `plyfs policy explain` and `plyfs policy apply` (interrupted and resumed), and untouched files
//! keeping the passthrough fast path.

mod common;

use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{cpath, errno, is_root, plyfs, run, Mount};

fn set_policy(path: &Path, value: &str) -> Result<(), i32> {
    let r = unsafe { libc::setxattr(cpath(path).as_ptr(), c"user.plyfs.layers".as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

fn get_xattr(path: &Path, name: &str) -> Option<String> {
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 4096];
    let len = unsafe { libc::getxattr(cpath(path).as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (len >= 0).then(|| String::from_utf8_lossy(&buf[..len as usize]).into_owned())
}

fn text(n: usize) -> Vec<u8> {
    b"per-file policies choose the layers of each file; ".iter().copied().cycle().take(n).collect()
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn trace_counts(m: &Mount) -> (u64, u64) {
    let out = run(plyfs().arg("op").arg(m.path("")).arg("stats"));
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (v["ops"]["read"]["count"].as_u64().unwrap_or(0), v["ops"]["write"]["count"].as_u64().unwrap_or(0))
}

#[test]
fn a_compressed_directory_beside_untouched_files_that_keep_passthrough() {
    let m = Mount::new("trace,null");
    fs::create_dir(m.path("logs")).unwrap();
    set_policy(&m.path("logs"), "zstd:level=3").unwrap();
    fs::create_dir_all(m.path("logs/deep/er")).unwrap();
    let data = text(1 << 20);
    fs::write(m.path("plain.bin"), &data).unwrap();
    fs::write(m.path("logs/deep/er/app.log"), &data).unwrap();
    assert_eq!(fs::read(m.lower_path("plain.bin")).unwrap(), data, "untouched below");
    let lower = fs::read(m.lower_path("logs/deep/er/app.log")).unwrap();
    assert!(lower.starts_with(b"PLYSCA") && lower.len() < data.len() / 4, "compressed below: {} bytes", lower.len());
    assert_eq!(fs::metadata(m.path("logs/deep/er/app.log")).unwrap().len(), data.len() as u64);
    assert_eq!(get_xattr(&m.path("logs"), "user.plyfs.layers").as_deref(), Some("zstd:level=3"), "getfattr shows the policy");
    assert_eq!(get_xattr(&m.path("logs/deep/er/app.log"), "user.plyfs.chain"), None, "the record is hidden");

    if is_root() {
        assert!(m.daemon_log().contains("file I/O: passthrough"), "{}", m.daemon_log());
        let before = trace_counts(&m);
        let mut got = Vec::new();
        fs::File::open(m.path("plain.bin")).unwrap().read_to_end(&mut got).unwrap();
        assert_eq!(got, data);
        assert_eq!(trace_counts(&m).0, before.0, "reads of an untouched file bypass the daemon");
        got.clear();
        fs::File::open(m.path("logs/deep/er/app.log")).unwrap().read_to_end(&mut got).unwrap();
        assert_eq!(got, data);
        assert!(trace_counts(&m).0 > before.0, "reads of a compressed file go through its chain");
    }
    // After a remount every file reads back through the chain it was written with.
    let mut m = m.remount();
    assert_eq!(fs::read(m.path("logs/deep/er/app.log")).unwrap(), data);
    assert_eq!(fs::read(m.path("plain.bin")).unwrap(), data);
    // Offline, each file is checked through its own chain; plain files need no check.
    m.unmount();
    let out = run(plyfs().arg("fsck").arg(&m.lower).args(["--stack", "null"]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("1 files checked, 0 damaged, 0 indexes rebuilt (1 plain"), "{}", stderr(&out));
}

#[test]
fn bad_values_fail_at_once_and_the_log_says_why() {
    let m = Mount::new("null");
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/f"), b"data").unwrap();
    for bad in ["zstd:level=42", "nosuch", "trace"] {
        assert_eq!(set_policy(&m.path("d"), bad), Err(libc::EINVAL), "{bad}");
        assert_eq!(set_policy(&m.path("d/f"), bad), Err(libc::EINVAL), "{bad}");
    }
    assert_eq!(get_xattr(&m.path("d"), "user.plyfs.layers"), None, "nothing was set");
    assert_eq!(fs::read(m.path("d/f")).unwrap(), b"data");
    let log = m.daemon_log();
    assert!(log.contains("refusing user.plyfs.layers=\"zstd:level=42\"") && log.contains("level"), "{log}");
    assert!(log.contains("unknown layer 'nosuch'"), "{log}");
    assert!(log.contains("does not transform data"), "{log}");
    let r = unsafe { libc::setxattr(cpath(&m.path("d/f")).as_ptr(), c"user.plyfs.chain".as_ptr(), c"none".as_ptr().cast(), 4, 0) };
    assert_eq!((r, errno()), (-1, libc::EPERM), "the record cannot be forged");
}

#[test]
fn rules_and_attributes_combine_as_documented() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    fs::write(&rules, "[[rule]]\nglob = \"*.log\"\nlayers = \"zstd\"\n\n[[rule]]\nextension = [\"jpg\", \"mp4\"]\nlayers = \"none\"\n").unwrap();
    let m = Mount::with("gzip", &[&format!("--rules={}", rules.display())]);
    fs::create_dir(m.path("keep")).unwrap();
    set_policy(&m.path("keep"), "lz4").unwrap();
    let data = text(10_000);
    for p in ["a.log", "b.jpg", "c.txt", "keep/d.log"] {
        fs::write(m.path(p), &data).unwrap();
    }
    for (p, chain, why) in [
        ("a.log", "zstd", "rule 1"),
        ("b.jpg", "none", "rule 2"),
        ("c.txt", "gzip", "default"),
        ("keep/d.log", "lz4", "directory keep"),
    ] {
        let out = run(plyfs().args(["policy", "explain"]).arg(m.path(p)));
        assert!(out.status.success(), "{p}: {}", stderr(&out));
        let text = stdout(&out);
        assert!(text.contains(&format!("policy:        {chain}")), "{p}: {text}");
        assert!(text.contains(&format!("encoded with:  {chain}")), "{p}: {text}");
        assert!(text.contains(why), "{p}: {text}");
        assert_eq!(fs::read(m.path(p)).unwrap(), data, "{p}");
    }
    assert_eq!(fs::read(m.lower_path("b.jpg")).unwrap(), data);
    let out = run(plyfs().args(["policy", "explain"]).arg(m.path("keep")));
    assert!(stdout(&out).contains("new files get: lz4"), "{}", stdout(&out));
    // A file's own attribute beats the rest; it takes effect at `apply`.
    set_policy(&m.path("a.log"), "copy").unwrap();
    let out = run(plyfs().args(["policy", "explain"]).arg(m.path("a.log")));
    assert!(stdout(&out).contains("file's own") && stdout(&out).contains("pending"), "{}", stdout(&out));
    let out = run(plyfs().args(["policy", "apply"]).arg(m.path("a.log")));
    assert!(out.status.success() && stdout(&out).contains("zstd -> copy"), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(fs::read(m.path("a.log")).unwrap(), data);
    // Rename into a directory with another policy keeps the file's chain (and its data).
    fs::rename(m.path("a.log"), m.path("keep/moved.log")).unwrap();
    assert_eq!(fs::read(m.path("keep/moved.log")).unwrap(), data);
    let out = run(plyfs().args(["policy", "explain"]).arg(m.path("keep/moved.log")));
    assert!(stdout(&out).contains("encoded with:  copy"), "{}", stdout(&out));
    // Opening a file that is being used does not stop the others from being converted.
    let held = fs::File::open(m.path("c.txt")).unwrap();
    set_policy(&m.path("c.txt"), "lz4").unwrap();
    let out = run(plyfs().args(["policy", "apply"]).arg(m.path("c.txt")));
    assert!(!out.status.success() && stderr(&out).contains("it is open"), "{}", stderr(&out));
    drop(held);
    // A rules file that names an unknown layer stops the mount with a clear message.
    fs::write(&rules, "[[rule]]\nglob = \"*\"\nlayers = \"zstd:level=0\"\n").unwrap();
    let other = tempfile::tempdir().unwrap();
    let (lo, mnt) = (other.path().join("lo"), other.path().join("mnt"));
    fs::create_dir(&lo).unwrap();
    fs::create_dir(&mnt).unwrap();
    let out = run(plyfs().arg("mount").arg(&lo).arg(&mnt).arg("--rules").arg(&rules));
    assert!(!out.status.success());
    assert!(stderr(&out).contains("rule 1") && stderr(&out).contains("level"), "{}", stderr(&out));
}

/// `count` plain files `data/fNN` of `size + NN * step` bytes each (each with a byte of its own),
/// in a directory whose policy is now gzip at level 9: work for `policy apply`.
fn plain_files_to_gzip(m: &Mount, count: usize, size: usize, step: usize) -> Vec<(String, Vec<u8>)> {
    fs::create_dir(m.path("data")).unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..count)
        .map(|i| {
            let mut d = text(size + i * step);
            d[i] = b'#';
            (format!("data/f{i:02}"), d)
        })
        .collect();
    for (p, d) in &files {
        fs::write(m.path(p), d).unwrap();
    }
    set_policy(&m.path("data"), "gzip:level=9").unwrap();
    files
}

#[test]
fn apply_can_be_killed_and_resumed_without_losing_a_byte() {
    let m = Mount::new("null");
    let files = plain_files_to_gzip(&m, 12, 2 << 20, 777);
    // Kill the first run once it has converted a file or two.
    let mut child = plyfs().args(["policy", "apply", "-r"]).arg(m.path("data")).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done = files.iter().filter(|(p, _)| fs::read(m.lower_path(p)).is_ok_and(|b| b.starts_with(b"PLYSCA"))).count();
        if done >= 2 || child.try_wait().unwrap().is_some() || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
    let converted = files.iter().filter(|(p, _)| fs::read(m.lower_path(p)).unwrap().starts_with(b"PLYSCA")).count();
    assert!(converted < files.len(), "the run should have been interrupted ({converted} converted)");
    for (p, d) in &files {
        assert_eq!(&fs::read(m.path(p)).unwrap(), d, "{p} after the interruption");
    }
    let out = run(plyfs().args(["policy", "apply", "-r"]).arg(m.path("data")));
    assert!(out.status.success(), "{}", stderr(&out));
    // The daemon finishes the file it was converting when the command died, so the second
    // run finds one or two fewer to do than were left at the kill.
    let summary = stdout(&out);
    // "N re-encoded, M already as their policy says[, K leftovers of an interrupted run removed]":
    // the last part only when the kill left a half-made copy.
    let (done, already, gone) = summary_counts(&out);
    assert_eq!(done + already + gone, files.len(), "{summary}");
    assert!(done + 1 >= files.len() - converted && done >= 1, "{summary}");
    for (p, d) in &files {
        assert!(fs::read(m.lower_path(p)).unwrap().starts_with(b"PLYSCA"), "{p} converted");
        assert_eq!(&fs::read(m.path(p)).unwrap(), d, "{p} after the second run");
    }
    let names: Vec<_> = fs::read_dir(m.lower_path("data")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), files.len(), "no leftovers: {names:?}");
    let out = run(plyfs().args(["policy", "apply", "-r"]).arg(m.path("data")));
    assert!(stdout(&out).contains("0 re-encoded"), "{}", stdout(&out));
    // Metadata survives the switch.
    let meta = fs::metadata(m.path("data/f00")).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o644);
    let m = m.remount();
    assert_eq!(&fs::read(m.path("data/f03")).unwrap(), &files[3].1);
}

/// The numbers of a run's summary line: (re-encoded, already as their policy says, removed or
/// replaced meanwhile).
fn summary_counts(out: &std::process::Output) -> (usize, usize, usize) {
    let text = stdout(out);
    let last = text.lines().last().unwrap_or_default().to_owned();
    let count = |what: &str| -> usize {
        let part = last.split(", ").find(|p| p.contains(what));
        part.map_or(0, |p| p.split(|c: char| !c.is_ascii_digit()).find_map(|w| w.parse().ok()).unwrap())
    };
    assert!(last.contains("re-encoded") && last.contains("already"), "{text}");
    (count("re-encoded"), count("already"), count("meanwhile"))
}

#[test]
fn two_runs_at_once_and_listings_meanwhile_never_see_the_temporary_copies() {
    let m = Mount::new("null");
    let files = plain_files_to_gzip(&m, 8, 3 << 20, 1001);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let seen: Vec<String> = std::thread::scope(|s| {
        let lister = s.spawn(|| {
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for e in fs::read_dir(m.path("data")).unwrap() {
                    let name = e.unwrap().file_name().to_string_lossy().into_owned();
                    if !name.starts_with('f') {
                        seen.push(name);
                    }
                }
            }
            seen
        });
        let runs: Vec<_> = (0..2)
            .map(|_| plyfs().args(["policy", "apply", "-r"]).arg(m.path("data")).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap())
            .collect();
        for child in runs {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
            // Each run accounts for every file once, whichever of the two re-encoded it.
            let (done, already, gone) = summary_counts(&out);
            assert_eq!(done + already + gone, files.len(), "{}", stdout(&out));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        lister.join().unwrap()
    });
    assert!(seen.is_empty(), "a listing showed names the mount made for itself: {seen:?}");
    for (p, d) in &files {
        assert!(fs::read(m.lower_path(p)).unwrap().starts_with(b"PLYSCA"), "{p} converted");
        assert_eq!(&fs::read(m.path(p)).unwrap(), d, "{p}");
    }
    let names: Vec<_> = fs::read_dir(m.lower_path("data")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), files.len(), "no leftovers: {names:?}");
}

#[test]
fn a_killed_daemon_leaves_the_old_file_and_the_next_run_cleans_up() {
    let mut m = Mount::new("null");
    let data = text(8 << 20);
    fs::write(m.path("big"), &data).unwrap();
    set_policy(&m.path("big"), "gzip:level=9").unwrap();
    let pid = m.pid();
    let mut apply = plyfs().args(["policy", "apply"]).arg(m.path("big")).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    // Kill the daemon while the copy is being written beside the file.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let tmp = fs::read_dir(&m.lower).unwrap().filter_map(|e| e.ok()).find(|e| e.file_name().to_string_lossy().starts_with(".plyfs-reencode."));
        if tmp.is_some_and(|t| t.metadata().is_ok_and(|md| md.len() > 0)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = m.child().wait();
    let _ = apply.wait();
    // `remount` unmounts the stale mount first, as `plyfs umount` does after a killed daemon.
    let m2 = m.remount();
    assert_eq!(fs::read(m2.path("big")).unwrap(), data, "the old file is intact");
    let out = run(plyfs().args(["policy", "apply", "-r"]).arg(m2.path("")));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(fs::read(m2.path("big")).unwrap(), data);
    assert!(fs::read(m2.lower_path("big")).unwrap().starts_with(b"PLYSCA"));
    let names: Vec<_> = fs::read_dir(&m2.lower).unwrap().map(|e| e.unwrap().file_name()).filter(|n| n != ".plyfs.lock").collect();
    assert_eq!(names.len(), 1, "the leftover is gone: {names:?}");
}
