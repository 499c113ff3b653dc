//! `version` through real mounts: what each kind of overwrite keeps, reading versions by path,
//! restore, undelete, pruning, compressed versions, and the fast path after a version is taken.

mod common;

use std::fs;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;

fn op(path: &Path, args: &[&str]) -> std::process::Output {
    run(plyfs().arg("op").arg(path).args(args))
}

/// The contents of a file's versions, oldest first, read through the mount by their path.
fn versions(m: &Mount, rel: &str) -> Vec<String> {
    op_json(&m.path(rel), &["versions"])
        .as_array()
        .unwrap()
        .iter()
        .map(|v| fs::read_to_string(m.path(v["path"].as_str().unwrap())).unwrap())
        .collect()
}

#[test]
fn every_kind_of_overwrite_keeps_the_previous_content() {
    let m = Mount::new("version");
    fs::write(m.path("f"), "one").unwrap();
    fs::write(m.path("f"), "two").unwrap(); // O_TRUNC
    let f = fs::OpenOptions::new().write(true).open(m.path("f")).unwrap();
    f.set_len(1).unwrap(); // truncate, on an open made for writing: one version for both
    drop(f);
    let mut f = fs::OpenOptions::new().read(true).write(true).open(m.path("f")).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.write_all(b"W").unwrap(); // the first write of an open
    drop(f);
    assert_eq!(versions(&m, "f"), ["one", "two", "t"]);
    fs::write(m.path("g"), "other").unwrap();
    fs::rename(m.path("g"), m.path("f")).unwrap(); // rename over
    assert_eq!(versions(&m, "f"), ["one", "two", "t", "W"]);
    fs::remove_file(m.path("f")).unwrap(); // unlink
    assert!(!m.path("f").exists());
    assert_eq!(fs::read_to_string(m.path(".plyfs-versions/f/@5")).unwrap(), "other");
    // Appends keep the old content as a prefix: no version. An open that changes nothing
    // leaves none.
    fs::write(m.path("log"), "a\n").unwrap();
    fs::OpenOptions::new().append(true).open(m.path("log")).unwrap().write_all(b"b\n").unwrap();
    drop(fs::OpenOptions::new().write(true).open(m.path("log")).unwrap());
    assert!(versions(&m, "log").is_empty());
    // While such an open is held, its version is the file as it is, and not listed; once it
    // writes, the version holds the earlier content.
    let held = fs::OpenOptions::new().write(true).open(m.path("log")).unwrap();
    assert!(versions(&m, "log").is_empty());
    held.write_at(b"A", 0).unwrap();
    assert_eq!(versions(&m, "log"), ["a\nb\n"]);
    drop(held);
    // Versions never show in listings, and survive a remount.
    let names: Vec<String> = fs::read_dir(&m.mnt).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["log"]);
    let m = m.remount();
    assert_eq!(op_json(&m.mnt, &["deleted"])[0]["versions"], 5);
}

#[test]
fn restore_and_undelete_bring_content_back_and_lose_nothing() {
    let m = Mount::new("version");
    fs::create_dir(m.path("d")).unwrap();
    for v in ["v1", "v2", "v3"] {
        fs::write(m.path("d/f"), v).unwrap();
    }
    op_json(&m.path("d/f"), &["version-restore", "1"]);
    assert_eq!(fs::read_to_string(m.path("d/f")).unwrap(), "v1");
    assert_eq!(versions(&m, "d/f"), ["v1", "v2", "v3"], "what the file held became a version");
    fs::remove_file(m.path("d/f")).unwrap();
    let deleted = op_json(&m.path("d"), &["deleted"]);
    assert_eq!(deleted[0]["name"], "f");
    op_json(&m.path("d"), &["undelete", "f"]);
    assert_eq!(fs::read_to_string(m.path("d/f")).unwrap(), "v1");
    // Bad requests: one line each, nothing changed.
    for (path, args, expect) in [
        ("d/f", vec!["version-restore", "99"], "no version 99 (it has versions 1 to 4)"),
        ("d/f", vec!["version-restore", "x"], "'x' is not a version number"),
        ("d", vec!["undelete", "f"], "d/f exists"),
        ("d", vec!["undelete", "never"], "no versions to bring back"),
    ] {
        let out = op(&m.path(path), &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(expect) && err.lines().count() == 1, "{args:?}: {err}");
    }
    assert_eq!(fs::read_to_string(m.path("d/f")).unwrap(), "v1");
    // The store is read-only through the mount.
    let err = fs::write(m.path(".plyfs-versions/d/f/@1"), "x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    let err = fs::remove_file(m.path(".plyfs-versions/d/f/@1")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
}

#[test]
fn pruning_by_count_and_space() {
    let m = Mount::new("version:keep=2");
    for i in 0..6 {
        fs::write(m.path("f"), format!("content {i}")).unwrap();
    }
    assert_eq!(versions(&m, "f"), ["content 3", "content 4"]);
    drop(m);
    let m = Mount::new("version:keep=0:max_space=10k");
    for i in 0..8 {
        fs::write(m.path(&format!("f{}", i % 2)), vec![b'a' + i as u8; 3000]).unwrap();
    }
    let total: u64 = ["f0", "f1"].iter().flat_map(|f| op_json(&m.path(f), &["versions"]).as_array().unwrap().clone()).map(|v| v["size"].as_u64().unwrap()).sum();
    assert!(total <= 10 << 10, "{total} bytes of versions");
    assert!(total >= 6000, "the newest are kept: {total}");
    assert_eq!(versions(&m, "f1").last().unwrap().as_bytes()[0], b'a' + 5);
}

/// The space all versions take on disk, in the lower directory's store.
fn store_space(m: &Mount) -> u64 {
    fn walk(dir: &Path) -> u64 {
        fs::read_dir(dir).unwrap().flatten().map(|e| {
            let meta = e.metadata().unwrap();
            if meta.is_dir() { walk(&e.path()) } else { std::os::unix::fs::MetadataExt::blocks(&meta) * 512 }
        }).sum()
    }
    walk(&m.lower_path(".plyfs-versions"))
}

/// `max_space` counts the space versions take on disk: a sparse file's versions take that of
/// their data, and the limit holds across files, the newest versions kept (#29).
#[test]
fn the_space_limit_counts_disk_space_and_keeps_the_newest() {
    let m = Mount::new("version:keep=0:max_space=256k");
    // A 1 GiB file holding a few bytes: its versions fit in the limit, all of them.
    let f = fs::File::create(m.path("sparse")).unwrap();
    f.set_len(1 << 30).unwrap();
    drop(f);
    for i in 0..5u8 {
        fs::OpenOptions::new().write(true).open(m.path("sparse")).unwrap().write_all_at(&[b'0' + i; 8], 1 << 29).unwrap();
    }
    assert_eq!(op_json(&m.path("sparse"), &["versions"]).as_array().unwrap().len(), 5, "no version of the sparse file pruned");
    // Files of 64 KiB, overwritten in turn, more than the limit holds.
    for i in 0..12u8 {
        fs::write(m.path(&format!("f{}", i % 3)), vec![b'a' + i; 64 << 10]).unwrap();
        assert!(store_space(&m) <= 256 << 10, "the store takes {} bytes after write {i}", store_space(&m));
    }
    // The newest are kept: f0's last version is the content written at i = 6, f2's at i = 8.
    assert_eq!(versions(&m, "f0").last().unwrap().as_bytes()[0], b'a' + 6);
    assert_eq!(versions(&m, "f2").last().unwrap().as_bytes()[0], b'a' + 8);
    assert!(store_space(&m) >= 128 << 10, "pruned beyond the limit: {} bytes left", store_space(&m));
}

/// Without `max_space=`, the store may take a tenth of the file system below, and the mount says
/// so with the default `keep`.
#[test]
fn the_mount_says_the_default_limits() {
    let m = Mount::new("version");
    let mut fs_stats: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(cpath(&m.lower).as_ptr(), &mut fs_stats) }, 0);
    let tenth_mib = (fs_stats.f_blocks * fs_stats.f_frsize / 10) >> 20;
    let said = format!("version 'version' keeps 20 versions per file (the default), at most {tenth_mib} MiB of them in all (the default)");
    assert!(m.daemon_log().contains(&said), "{said:?} not in {}", m.daemon_log());
}

#[test]
fn versions_below_a_compressor_are_stored_compressed() {
    let m = Mount::new("version,zstd");
    let text = "versioned and compressed ".repeat(4000);
    fs::write(m.path("doc"), &text).unwrap();
    fs::write(m.path("doc"), "short").unwrap();
    assert_eq!(versions(&m, "doc"), std::slice::from_ref(&text));
    let stored = fs::metadata(m.lower_path(".plyfs-versions/doc/@1")).unwrap().len();
    assert!(stored < text.len() as u64 / 5, "version stored in {stored} bytes");
}

#[test]
fn writes_after_the_version_is_taken_use_passthrough() {
    if !is_root() {
        return;
    }
    let m = Mount::new("trace,version");
    fs::write(m.path("big"), vec![1u8; 1 << 20]).unwrap();
    let f = fs::OpenOptions::new().write(true).open(m.path("big")).unwrap();
    f.write_all_at(&vec![2u8; 1 << 20], 0).unwrap();
    drop(f);
    let stats = op_json(&m.mnt, &["stats"]);
    assert_eq!(stats["ops"]["write"]["count"].as_u64().unwrap_or(0), 0, "{stats}");
    assert_eq!(versions(&m, "big")[0].as_bytes(), vec![1u8; 1 << 20]);
}

/// On a terminal, `versions` and `deleted` are tables with local times (`2026-11-27 15:40:51`),
/// not JSON with epoch seconds; `--json`, or a pipe, keeps the JSON (#32).
#[test]
fn versions_and_deleted_are_tables_on_a_terminal() {
    let m = Mount::new("version");
    fs::write(m.path("f"), "one").unwrap();
    fs::write(m.path("f"), "two").unwrap();
    fs::write(m.path("f"), "three").unwrap();
    let is_local_time = |s: &str| {
        let b = s.as_bytes();
        b.len() == 19 && s.chars().enumerate().all(|(i, c)| match i {
            4 | 7 => c == '-',
            10 => c == ' ',
            13 | 16 => c == ':',
            _ => c.is_ascii_digit(),
        })
    };
    let (status, table) = run_on_terminal(plyfs().arg("op").arg(m.path("f")).arg("versions"));
    assert!(status.success(), "{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "a header and two versions: {table}");
    assert!(lines[0].starts_with("NUMBER  MODIFIED ") && lines[0].ends_with("PATH"), "{table}");
    for (i, row) in lines[1..].iter().enumerate() {
        let saved_at = lines[0].find("SAVED").unwrap();
        assert!(is_local_time(&row[saved_at..saved_at + 19]), "{row}");
        assert!(row.trim_start().starts_with(&format!("{} ", i + 1)) && row.ends_with(&format!("@{}", i + 1)), "{row}");
    }
    // JSON when asked, and into a pipe, with the times as they were.
    let (status, json) = run_on_terminal(plyfs().arg("op").arg(m.path("f")).args(["versions", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert!(status.success() && v[0]["saved"].as_f64().unwrap() > 1.0e9, "{json}");
    assert_eq!(op_json(&m.path("f"), &["versions"]).as_array().unwrap().len(), 2);

    fs::remove_file(m.path("f")).unwrap();
    let (status, table) = run_on_terminal(plyfs().arg("op").arg(&m.mnt).arg("deleted"));
    assert!(status.success(), "{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines[0].split_whitespace().collect::<Vec<_>>(), ["NAME", "LATEST", "SIZE", "VERSIONS"], "{table}");
    assert_eq!(lines[1].split_whitespace().collect::<Vec<_>>(), ["f", "3", "5", "3"], "{table}");
    // Nothing changed: the versions are all still there.
    assert_eq!(fs::read_to_string(m.path(".plyfs-versions/f/@3")).unwrap(), "three");
}

/// The kernel keeps a name it looked up for the entry timeout, and the store changes behind its
/// back: the number of a version that went (dropped at the release of an open that changed
/// nothing) is not given to the next, or a read by the path `versions` gives would find the
/// version that went, or nothing (issue #34).
#[test]
fn the_number_of_a_version_that_went_is_not_given_again() {
    let m = Mount::new("version");
    fs::write(m.path("f"), "a").unwrap();
    // Version 1, taken at an open that changes nothing, read by its path meanwhile.
    let f = fs::OpenOptions::new().write(true).open(m.path("f")).unwrap();
    assert_eq!(fs::read_to_string(m.path(".plyfs-versions/f/@1")).unwrap(), "a");
    drop(f);
    // Its release, which the kernel sends after close returns, drops it.
    let start = std::time::Instant::now();
    while m.lower_path(".plyfs-versions/f/@1").exists() {
        assert!(start.elapsed() < std::time::Duration::from_secs(10), "version 1 never dropped");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    fs::OpenOptions::new().append(true).open(m.path("f")).unwrap().write_all(b"b").unwrap(); // no version
    fs::write(m.path("f"), "c").unwrap();
    assert_eq!(versions(&m, "f"), ["ab"]);
    assert_eq!(op_json(&m.path("f"), &["versions"])[0]["number"], 2);
}

/// Listings racing overwrites through a real mount (issue #33): the kernel sends a release after
/// close has returned, so a `versions` right after a close meets the release that drops the
/// version its open took. A writer overwrites a file every way that keeps a version (and opens
/// it without changing it, which keeps none) while listers ask `versions` without pause and
/// read what they are given. No listing fails, and every version listed reads: the writer
/// removes none, so none listed may go (a release in flight dropped versions that listings
/// had named, and the kernel then kept their names as absent while new versions took their
/// numbers, the final listing's included: CI, issue #34). At the end the file has exactly the
/// versions the writer made. (The same in process, with more threads and rounds:
/// `crates/layers/tests/version_race.rs`.)
#[test]
fn listings_racing_overwrites_through_the_mount_never_fail_nor_lose_a_version() {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Mutex;
    let m = Mount::new("version:keep=0:max_space=0");
    let content = |round: usize| format!("round {round:010}").into_bytes();
    let held = Mutex::new(HashSet::from([content(0)]));
    fs::write(m.path("f"), content(0)).unwrap();
    let (done, listings) = (AtomicBool::new(false), AtomicU64::new(0));
    let failures = Mutex::new(Vec::<String>::new());
    let kept = std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                while !done.load(Ordering::SeqCst) {
                    let out = op(&m.path("f"), &["versions"]);
                    if !out.status.success() {
                        failures.lock().unwrap().push(String::from_utf8_lossy(&out.stderr).into_owned());
                        continue;
                    }
                    listings.fetch_add(1, Ordering::Relaxed);
                    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                    for v in listed.as_array().unwrap() {
                        let path = m.path(v["path"].as_str().unwrap());
                        match fs::read(&path) {
                            Ok(data) if held.lock().unwrap().contains(&data) => {}
                            Ok(data) => failures.lock().unwrap().push(format!("{}: {:?} never was the file's", path.display(), String::from_utf8_lossy(&data))),
                            Err(e) => failures.lock().unwrap().push(format!("{}: listed, then read: {e}", path.display())),
                        }
                    }
                }
            });
        }
        let writer = s.spawn(|| {
            let (mut now, mut kept) = (content(0), Vec::new());
            for round in 1..=300 {
                let new = content(round);
                held.lock().unwrap().insert(new.clone());
                let before = now.clone();
                match round % 5 {
                    // Opened for writing and closed unchanged: no version.
                    0 => drop(fs::OpenOptions::new().write(true).open(m.path("f")).unwrap()),
                    1 => {
                        fs::OpenOptions::new().write(true).open(m.path("f")).unwrap().write_all_at(&new, 0).unwrap();
                        now = new;
                    }
                    2 => {
                        fs::write(m.path("f"), &new).unwrap();
                        now = new;
                    }
                    3 => {
                        now.truncate(5);
                        held.lock().unwrap().insert(now.clone());
                        assert_eq!(unsafe { libc::truncate(cpath(&m.path("f")).as_ptr(), 5) }, 0);
                    }
                    _ => {
                        fs::write(m.path("f.new"), &new).unwrap();
                        fs::rename(m.path("f.new"), m.path("f")).unwrap();
                        now = new;
                    }
                }
                if round % 5 != 0 {
                    kept.push(before);
                }
            }
            kept
        });
        let kept = writer.join().unwrap();
        done.store(true, Ordering::SeqCst);
        kept
    });
    eprintln!("{} listings", listings.load(Ordering::Relaxed));
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{} failures: {:#?}", failures.len(), &failures[..failures.len().min(10)]);
    let want: Vec<String> = kept.iter().map(|k| String::from_utf8_lossy(k).into_owned()).collect();
    assert_eq!(versions(&m, "f"), want, "a version lost, or one made twice");
}
