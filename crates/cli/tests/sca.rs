//! Size-changing layers through a real mount: sizes and savings in `stat`, index loss and
//! damage, a daemon killed in the middle of writes, corrupt chunks, foreign files, and the
//! extended and offline operations.

mod common;

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{cpath, crypt_init, crypt_passfile, get_file_flags, plyfs, run, scratch_dirs, set_file_flags, Mount, SmallTmpfs};
use serde_json::Value;

fn text(len: usize) -> Vec<u8> {
    let words = ["stackable ", "file ", "system ", "index ", "chunk\n", "tail "];
    let mut out = Vec::with_capacity(len + 16);
    let mut i = 0usize;
    while out.len() < len {
        out.extend_from_slice(words[(i * 7 + i / 3) % words.len()].as_bytes());
        i += 1;
    }
    out.truncate(len);
    out
}

fn op(m: &Mount, rel: &str, name: &str) -> Value {
    let out = run(plyfs().arg("op").arg(m.path(rel)).arg(name));
    assert!(out.status.success(), "op {name}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn stat_shows_decoded_size_and_real_usage() {
    let m = Mount::new("zstd");
    let data = text(1 << 20);
    fs::write(m.path("big.txt"), &data).unwrap();
    let meta = fs::metadata(m.path("big.txt")).unwrap();
    assert_eq!(meta.len(), data.len() as u64);
    let lower = fs::metadata(m.lower_path("big.txt")).unwrap();
    assert!(lower.len() < data.len() as u64 / 4, "zstd should shrink text: {} bytes", lower.len());
    // The kernel sends `release` after close(2) returns, and the layer's last write (the index
    // checkpoint) happens there; the kernel also caches attributes for a second. So compare
    // until both have settled.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (upper, lower) = (fs::metadata(m.path("big.txt")).unwrap().blocks(), fs::metadata(m.lower_path("big.txt")).unwrap().blocks());
        if upper == lower {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "st_blocks reports the lower usage: {upper} != {lower}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats = op(&m, "big.txt", "sca-stats");
    assert_eq!(stats["decoded_size"], data.len() as u64);
    assert!(stats["ratio"].as_f64().unwrap() < 0.25);
    // After a remount, stat answers from the file's header, without decoding.
    let m = m.remount();
    assert_eq!(fs::metadata(m.path("big.txt")).unwrap().len(), data.len() as u64);
    assert_eq!(fs::read(m.path("big.txt")).unwrap(), data);
}

/// Write a file spanning many chunks, then unmount; return its content.
fn file_with_index(m: &Mount) -> Vec<u8> {
    let mut data = text(300_000);
    fs::write(m.path("f"), &data).unwrap();
    // A few writes in the middle, so the log holds dead records as well.
    let f = OpenOptions::new().write(true).open(m.path("f")).unwrap();
    for (i, off) in [5000u64, 70_000, 123_457].iter().enumerate() {
        let patch = vec![b'0' + i as u8; 3000];
        f.write_all_at(&patch, *off).unwrap();
        data[*off as usize..*off as usize + 3000].copy_from_slice(&patch);
    }
    drop(f);
    data
}

#[test]
fn a_lost_truncated_or_scribbled_index_is_rebuilt() {
    type Damage = fn(&Path, u64, u64);
    let cases: [(&str, Damage); 3] = [
        ("deleted", |p, off, _| {
            // The slots that point at it, and the index itself.
            let f = OpenOptions::new().write(true).open(p).unwrap();
            f.write_all_at(&[0; 128], 64).unwrap();
            f.set_len(off).unwrap();
        }),
        ("truncated", |p, off, len| {
            OpenOptions::new().write(true).open(p).unwrap().set_len(off + len / 2).unwrap();
        }),
        ("scribbled", |p, off, len| {
            let junk: Vec<u8> = (0..len).map(|i| (i * 131 + 7) as u8).collect();
            OpenOptions::new().write(true).open(p).unwrap().write_all_at(&junk, off).unwrap();
        }),
    ];
    for (what, damage) in cases {
        let mut m = Mount::new("gzip:level=9");
        let data = file_with_index(&m);
        // Compaction leaves the index at the end of the file; find it.
        op(&m, "f", "compact");
        let stats = op(&m, "f", "sca-stats");
        let index = &stats["index"];
        assert!(index.is_object(), "{what}: no index after close: {stats}");
        let (off, len) = (index["offset"].as_u64().unwrap(), index["bytes"].as_u64().unwrap());
        m.unmount();
        damage(&m.lower_path("f"), off, len);
        let m = m.remount();
        assert_eq!(fs::read(m.path("f")).unwrap(), data, "index {what}: data read back wrong");
        assert!(m.daemon_log().contains("rebuil"), "index {what}: no warning in the log:\n{}", m.daemon_log());
        let stats = op(&m, "f", "sca-stats");
        assert!(stats["index"].is_object(), "index {what}: not rebuilt: {stats}");
        assert_eq!(op(&m, "f", "verify")["ok"], true, "index {what}");
    }
}

#[test]
fn a_corrupt_chunk_reads_as_eio_and_is_logged_with_file_and_offset() {
    let mut m = Mount::new("zstd");
    let data = text(200_000);
    fs::write(m.path("c.txt"), &data).unwrap();
    m.unmount();
    // Damage the record holding bytes 40960.. (the 11th chunk): find it by its offset in the
    // lower file, which is laid out in order after a single sequential write.
    let lower = m.lower_path("c.txt");
    let bytes = fs::read(&lower).unwrap();
    let mut records = Vec::new();
    let mut at = 256usize;
    while at + 56 <= bytes.len() && &bytes[at..at + 4] == b"PLYR" {
        records.push(at);
        let payload = u32::from_le_bytes(bytes[at + 32..at + 36].try_into().unwrap()) as usize;
        at += 56 + payload.div_ceil(8) * 8;
    }
    assert!(records.len() > 20);
    let victim = records[10];
    let f = OpenOptions::new().write(true).open(&lower).unwrap();
    f.write_all_at(b"\xff\xff\xff\xff", victim as u64 + 60).unwrap();
    let m = m.remount();
    let file = fs::File::open(m.path("c.txt")).unwrap();
    let mut buf = vec![0; 4096];
    let err = file.read_at(&mut buf, 10 * 4096).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    // The rest reads fine, and the daemon is alive.
    file.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(buf, data[..4096]);
    file.read_exact_at(&mut buf, 20 * 4096).unwrap();
    assert_eq!(buf, data[20 * 4096..21 * 4096]);
    let log = m.daemon_log();
    assert!(
        log.contains(&format!("{}: corrupt data at offset 40960", lower.display())),
        "the log must name the file and offset:\n{log}"
    );
    let report = op(&m, "c.txt", "verify");
    assert_eq!(report["ok"], false);
    assert_eq!(report["problems"][0]["offset"], 40960);
}

#[test]
fn foreign_and_mismatched_files_give_clear_errors() {
    let mut m = Mount::new("gzip");
    fs::write(m.path("z"), text(10_000)).unwrap();
    m.unmount();
    fs::write(m.lower_path("plain.txt"), b"not encoded at all").unwrap();
    // A file carries a record of its chain, and reads back through it under any --stack.
    let m = Mount::start(tempfile::tempdir().unwrap(), m.lower.clone(), m.mnt.clone(), "zstd", &[]);
    assert_eq!(fs::read(m.path("z")).unwrap(), text(10_000));
    let mut m = m;
    m.unmount();
    // Without the record (copied without its attributes, say), it is read through the mount's
    // default and refused as what it is. A file in no layer's format is plain: served as it is.
    let z = cpath(&m.lower_path("z"));
    assert_eq!(unsafe { libc::removexattr(z.as_ptr(), c"user.plyfs.chain".as_ptr()) }, 0);
    let m = Mount::start(tempfile::tempdir().unwrap(), m.lower.clone(), m.mnt.clone(), "zstd", &[]);
    let err = fs::read(m.path("z")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    assert!(m.daemon_log().contains("encoded by 'gzip'"), "log lacks why:\n{}", m.daemon_log());
    assert_eq!(fs::read(m.path("plain.txt")).unwrap(), b"not encoded at all");
}

#[test]
fn fast_tails_append_without_reencoding_and_truncate_in_the_tail() {
    let m = Mount::new("gzip:level=9:fast_tails=on");
    let mut model = Vec::new();
    for i in 0..500 {
        let line = format!("log line {i}\n");
        let mut f = OpenOptions::new().append(true).create(true).open(m.path("log")).unwrap();
        f.write_all(line.as_bytes()).unwrap();
        model.extend_from_slice(line.as_bytes());
    }
    let stats = op(&m, "log", "sca-stats");
    let tail = stats["fast_tail_bytes"].as_u64().unwrap();
    assert!(tail > 0 && tail < 4096, "the partial last chunk is a fast tail: {stats}");
    // Truncate inside the fast tail, then past the end (a hole of zeros).
    let cut = model.len() as u64 - tail / 2;
    let f = OpenOptions::new().write(true).open(m.path("log")).unwrap();
    f.set_len(cut).unwrap();
    model.truncate(cut as usize);
    f.set_len(cut + 100_000).unwrap();
    model.resize(cut as usize + 100_000, 0);
    drop(f);
    let m = m.remount();
    assert_eq!(fs::read(m.path("log")).unwrap(), model);
    assert_eq!(op(&m, "log", "verify")["ok"], true);
}

#[test]
fn writes_in_the_middle_stay_bounded_and_compact() {
    let m = Mount::new("zstd");
    let size = 2 << 20;
    let mut model = text(size);
    fs::write(m.path("db"), &model).unwrap();
    let f = OpenOptions::new().write(true).open(m.path("db")).unwrap();
    for i in 0..3000u64 {
        let off = (i * 7919 * 4096 + i * 13) % (size as u64 - 5000);
        let patch = format!("<update {i}>").into_bytes();
        f.write_all_at(&patch, off).unwrap();
        model[off as usize..off as usize + patch.len()].copy_from_slice(&patch);
    }
    drop(f);
    let stats = op(&m, "db", "sca-stats");
    let (live, dead) = (stats["live_bytes"].as_u64().unwrap(), stats["dead_bytes"].as_u64().unwrap());
    assert!(dead <= live.max(64 << 10), "dead space must stay bounded: {stats}");
    let compacted = op(&m, "db", "compact");
    assert!(compacted["after"].as_u64().unwrap() <= compacted["before"].as_u64().unwrap());
    let stats = op(&m, "db", "sca-stats");
    let (live, dead) = (stats["live_bytes"].as_u64().unwrap(), stats["dead_bytes"].as_u64().unwrap());
    assert!(dead < live / 50, "compaction leaves (almost) no dead space: {stats}");
    assert_eq!(fs::read(m.path("db")).unwrap(), model);
}

/// The state of one file in the crash workload: appends, with what was fsync'd and the
/// append in flight when the daemon died.
#[derive(Default, Clone)]
struct Appended {
    written: Vec<u8>,
    synced: usize,
    in_flight: Vec<u8>,
}

#[test]
fn a_killed_daemon_loses_nothing_that_was_fsynced() {
    // The last two on crypt volumes, whose password the remount and fsck need too.
    for (stack, crypt) in [("zstd:fast_tails=on", false), ("gzip:chunk=64k", false), ("crypt", true), ("zstd,crypt", true)] {
        let mut m = if crypt { Mount::crypt(stack, &[], &[]) } else { Mount::new(stack) };
        let passfile = crypt.then(|| crypt_passfile(m.dir.path()));
        let secret: Vec<String> = passfile.iter().map(|p| format!("--passfile={}", p.display())).collect();
        let secret: Vec<&str> = secret.iter().map(String::as_str).collect();
        let files: Vec<Arc<Mutex<Appended>>> = (0..4).map(|_| Arc::new(Mutex::new(Appended::default()))).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(n, state)| {
                let (state, stop, path) = (state.clone(), stop.clone(), m.path(&format!("f{n}")));
                std::thread::spawn(move || {
                    let Ok(mut f) = OpenOptions::new().append(true).create(true).open(&path) else { return };
                    let mut i = 0usize;
                    while !stop.load(Ordering::SeqCst) {
                        let mut chunk = format!("<{n}:{i}>").into_bytes();
                        chunk.extend_from_slice(&text(50 + (i * 977) % 9000));
                        state.lock().unwrap().in_flight = chunk.clone();
                        if f.write_all(&chunk).is_err() {
                            return;
                        }
                        let mut s = state.lock().unwrap();
                        s.written.extend_from_slice(&chunk);
                        s.in_flight.clear();
                        drop(s);
                        if i % 5 == 4 {
                            if f.sync_all().is_err() {
                                return;
                            }
                            let mut s = state.lock().unwrap();
                            s.synced = s.written.len();
                        }
                        i += 1;
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(700));
        unsafe { libc::kill(m.pid(), libc::SIGKILL) };
        stop.store(true, Ordering::SeqCst);
        for w in writers {
            w.join().unwrap();
        }
        m.wait_exit(Duration::from_secs(10)).expect("the daemon died");
        assert!(run(plyfs().arg("umount").arg(&m.mnt)).status.success());
        let fsck = run(plyfs().arg("fsck").arg(&m.lower).arg("--stack").arg(stack).args(&secret));
        assert!(fsck.status.success(), "[{stack}] fsck after the crash: {}", String::from_utf8_lossy(&fsck.stderr));
        let m = Mount::start(tempfile::tempdir().unwrap(), m.lower.clone(), m.mnt.clone(), stack, &secret);
        for (n, state) in files.iter().enumerate() {
            let s = state.lock().unwrap().clone();
            let mut got = Vec::new();
            fs::File::open(m.path(&format!("f{n}"))).unwrap().read_to_end(&mut got).unwrap();
            assert!(s.synced > 0, "[{stack}] f{n}: the workload never synced");
            assert!(got.len() >= s.synced, "[{stack}] f{n}: {} bytes read back, {} were fsynced", got.len(), s.synced);
            let mut all = s.written.clone();
            all.extend_from_slice(&s.in_flight);
            assert!(got.len() <= all.len(), "[{stack}] f{n}: longer than anything written");
            assert!(got[..] == all[..got.len()], "[{stack}] f{n}: reads back bytes no one wrote");
        }
    }
}

#[test]
fn offline_encode_fsck_du_and_decode_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir_all(src.join("sub")).unwrap();
    fs::write(src.join("a.txt"), text(100_000)).unwrap();
    fs::write(src.join("sub/b.bin"), (0..50_000u32).map(|i| (i.wrapping_mul(2_654_435_761u32) >> 24) as u8).collect::<Vec<_>>()).unwrap();
    fs::write(src.join("sub/empty"), b"").unwrap();
    std::os::unix::fs::symlink("a.txt", src.join("link")).unwrap();
    let enc = dir.path().join("enc");
    let ok = |cmd: &mut std::process::Command| {
        let out = run(cmd);
        assert!(out.status.success(), "{:?}: {}", cmd, String::from_utf8_lossy(&out.stderr));
        out
    };
    ok(plyfs().arg("encode").arg(&src).arg(&enc).args(["--stack", "zstd:chunk=64k"]));
    assert!(fs::metadata(enc.join("a.txt")).unwrap().len() < 20_000);
    ok(plyfs().arg("fsck").arg(&enc).args(["--stack", "zstd"]));
    let du = ok(plyfs().arg("du").arg(&enc).args(["--stack", "zstd"]));
    let du = String::from_utf8_lossy(&du.stdout);
    assert!(du.lines().any(|l| l.ends_with(" a.txt") && l.contains("97.7K")), "du output:\n{du}");
    let dec: PathBuf = dir.path().join("dec");
    ok(plyfs().arg("decode").arg(&enc).arg(&dec).args(["--stack", "zstd"]));
    for rel in ["a.txt", "sub/b.bin", "sub/empty"] {
        assert_eq!(fs::read(src.join(rel)).unwrap(), fs::read(dec.join(rel)).unwrap(), "{rel}");
    }
    assert_eq!(fs::read_link(dec.join("link")).unwrap(), Path::new("a.txt"));
    // The encoded tree mounts with the same stack.
    fs::create_dir(dir.path().join("mnt")).unwrap();
    let m = Mount::start(tempfile::tempdir().unwrap(), enc.clone(), dir.path().join("mnt"), "zstd", &[]);
    assert_eq!(fs::read(m.path("a.txt")).unwrap(), fs::read(src.join("a.txt")).unwrap());
    // fsck reports damaged data and fails.
    drop(m);
    let victim = enc.join("sub/b.bin");
    let len = fs::metadata(&victim).unwrap().len();
    OpenOptions::new().write(true).open(&victim).unwrap().write_all_at(&[0x5a; 64], len / 2).unwrap();
    let out = run(plyfs().arg("fsck").arg(&enc).args(["--stack", "zstd"]));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("sub/b.bin"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `plyfs fsck` gives one line per damaged file, naming it and the cause, then one line that
/// sums up, and fails; the layers' own lines about the same file only with `-v` (#32).
#[test]
fn fsck_says_one_line_per_damaged_file_then_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = |out: &std::process::Output| String::from_utf8_lossy(&out.stderr).into_owned();
    let enc = common::damaged_zstd_tree(dir.path(), "enc");
    let out = run(plyfs().arg("fsck").arg(&enc).args(["--stack", "zstd"]));
    let said = stderr(&out);
    assert_eq!(out.status.code(), Some(26), "{said}");
    let lines: Vec<&str> = said.lines().collect();
    assert_eq!(lines.len(), 2, "{said}");
    assert!(lines[0].starts_with("plyfs: damaged.txt: corrupt data at offset "), "{said}");
    assert!(lines[0].contains("more damaged chunk") || lines[0].contains("checksum"), "{said}");
    assert!(!lines[0].contains(&enc.display().to_string()), "the lower path is not repeated: {said}");
    assert_eq!(lines[1], "plyfs: fsck: 2 files checked, 1 damaged, 1 index rebuilt", "{said}");
    assert!(out.stdout.is_empty());
    // Asked for, the layers' warnings come too.
    let enc = common::damaged_zstd_tree(dir.path(), "enc-v");
    let said = stderr(&run(plyfs().arg("fsck").arg(&enc).args(["--stack", "zstd", "-v"])));
    assert!(said.lines().any(|l| l.contains("WARN") && l.contains("rebuilding it from the data")), "{said}");
    assert!(said.lines().last().unwrap().ends_with("1 damaged, 1 index rebuilt"), "{said}");
    // A name holding a newline and an escape sequence is still one line, and drives nothing.
    let enc = common::damaged_zstd_tree(dir.path(), "enc-names");
    fs::rename(enc.join("damaged.txt"), enc.join("bad\nname\u{1b}[2J.txt")).unwrap();
    let said = stderr(&run(plyfs().arg("fsck").arg(&enc).args(["--stack", "zstd"])));
    assert_eq!(said.lines().count(), 2, "{said}");
    assert!(said.starts_with("plyfs: bad\\nname\\u{1b}[2J.txt: corrupt data at offset "), "{said}");
    assert!(!said.contains('\u{1b}'), "{said:?}");
    // A sound tree: the same summary, and success.
    let out = run(plyfs().arg("fsck").arg(dir.path().join("enc.src")).args(["--stack", "zstd"]));
    assert!(out.status.success() && stderr(&out) == "plyfs: fsck: 0 files checked, 0 damaged, 0 indexes rebuilt (2 plain files, which no layer encodes, need no check)\n", "{}", stderr(&out));
}

/// `plyfs decode` keeps the modification times of every kind of entry: symlinks their own (not
/// their targets'), directories theirs after their contents are written, and a FIFO is not
/// opened to set them (#32: every symlink got the time of the decode).
#[test]
fn decode_keeps_the_times_of_files_symlinks_directories_and_fifos() {
    let dir = tempfile::tempdir().unwrap();
    let (src, enc, dec) = (dir.path().join("src"), dir.path().join("enc"), dir.path().join("dec"));
    fs::create_dir_all(src.join("docs/deep")).unwrap();
    fs::write(src.join("docs/a.txt"), text(10_000)).unwrap();
    fs::write(src.join("docs/deep/b.txt"), text(100)).unwrap();
    std::os::unix::fs::symlink("a.txt", src.join("docs/link")).unwrap();
    std::os::unix::fs::symlink("/nonexistent", src.join("docs/deep/dangling")).unwrap();
    let out = run(plyfs().arg("encode").arg(&src).arg(&enc).args(["--stack", "zstd"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let fifo = std::ffi::CString::new(enc.join("docs/fifo").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
    // Times of the encoded tree, each its own, set deepest first so that no later change moves them.
    let entries = ["docs/deep/b.txt", "docs/deep/dangling", "docs/deep", "docs/a.txt", "docs/link", "docs/fifo", "docs", ""];
    for (i, rel) in entries.iter().enumerate() {
        let at = format!("@{}", 1_000_000_000 + i * 86_400);
        let out = run(std::process::Command::new("touch").args(["-h", "-d", &at]).arg(enc.join(rel)));
        assert!(out.status.success(), "touch {rel}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = run(plyfs().arg("decode").arg(&enc).arg(&dec).args(["--stack", "zstd"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (i, rel) in entries.iter().enumerate() {
        let meta = fs::symlink_metadata(dec.join(rel)).unwrap();
        assert_eq!(meta.mtime(), 1_000_000_000 + i as i64 * 86_400, "mtime of {rel:?}");
    }
    assert_eq!(fs::read_link(dec.join("docs/link")).unwrap(), Path::new("a.txt"));
    assert_eq!(fs::read(dec.join("docs/a.txt")).unwrap(), text(10_000));
    assert!(fs::symlink_metadata(dec.join("docs/fifo")).unwrap().file_type().is_fifo());
}

/// A lower tree written by `zstd` and opened with `--stack gzip`: each file records its chain and
/// is read with it, by a mount as by fsck, which says so in a warning; a file that lost its
/// record (copied without attributes) is refused by both with EIO (#32).
#[test]
fn a_file_written_by_another_codec_is_read_with_its_own_and_fsck_warns() {
    let dir = tempfile::tempdir().unwrap();
    let (lower, mnt) = (dir.path().join("lower"), dir.path().join("mnt"));
    fs::create_dir(&lower).unwrap();
    fs::create_dir(&mnt).unwrap();
    drop({
        let m = Mount::start(tempfile::tempdir().unwrap(), lower.clone(), mnt.clone(), "zstd", &[]);
        fs::write(m.path("a.txt"), text(50_000)).unwrap();
        m
    });
    let fsck = |stack: &str| run(plyfs().arg("fsck").arg(&lower).args(["--stack", stack]));
    let out = fsck("gzip");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("plyfs: warning: a.txt: encoded with 'zstd', while the mount's default (the data layers of --stack) gives 'gzip'; it is read with 'zstd'"),
        "{err}"
    );
    let out = fsck("zstd");
    assert!(out.status.success() && !String::from_utf8_lossy(&out.stderr).contains("warning"), "{}", String::from_utf8_lossy(&out.stderr));
    // Many such files make one line, not one each.
    drop({
        let m = Mount::start(tempfile::tempdir().unwrap(), lower.clone(), mnt.clone(), "zstd", &[]);
        for i in 0..5 {
            fs::write(m.path(&format!("more-{i}.txt")), text(1000)).unwrap();
        }
        m
    });
    let out = fsck("gzip");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().filter(|l| l.contains("warning")).count(), 1, "{err}");
    assert!(err.contains("plyfs: warning: 6 files (the first: ") && err.contains(") are encoded with 'zstd', while"), "{err}");
    for i in 0..5 {
        fs::remove_file(lower.join(format!("more-{i}.txt"))).unwrap();
    }
    // The copy has no record: its header says zstd, and a gzip mount cannot take it for its own.
    fs::copy(lower.join("a.txt"), lower.join("copy.txt")).unwrap();
    let stored: Vec<Vec<u8>> = ["a.txt", "copy.txt"].iter().map(|f| fs::read(lower.join(f)).unwrap()).collect();
    let out = fsck("gzip");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(26), "{err}");
    assert!(err.contains("copy.txt: verifying: ") && err.contains("encoded by 'zstd', not by this 'gzip' layer"), "{err}");
    {
        let m = Mount::start(tempfile::tempdir().unwrap(), lower.clone(), mnt.clone(), "gzip", &[]);
        assert_eq!(fs::read(m.path("a.txt")).unwrap(), text(50_000));
        assert_eq!(fs::read(m.path("copy.txt")).unwrap_err().raw_os_error(), Some(libc::EIO));
    }
    let after: Vec<Vec<u8>> = ["a.txt", "copy.txt"].iter().map(|f| fs::read(lower.join(f)).unwrap()).collect();
    assert!(after == stored, "fsck and the mount left the lower files as they were");
}

/// `echo >> log` in a loop: every append opens and closes the file, and the kernel sends each
/// `release` asynchronously, so it often races with the next `open`. The two must share one
/// state: a second one loaded from a file still being closed once lost data here.
#[test]
fn open_append_close_loops_race_release_safely() {
    for stack in ["gzip:level=9", "zstd:fast_tails=on", "copy"] {
        let m = Mount::new(stack);
        for round in 0..3 {
            let path = m.path("log");
            let _ = fs::remove_file(&path);
            let mut model = Vec::new();
            for i in 0..2000 {
                let piece = format!("{round}:{i};");
                let mut f = OpenOptions::new().append(true).create(true).open(&path).unwrap();
                f.write_all(piece.as_bytes()).unwrap_or_else(|e| panic!("[{stack}] round {round} append {i}: {e}"));
                model.extend_from_slice(piece.as_bytes());
            }
            assert_eq!(fs::read(&path).unwrap(), model, "[{stack}] round {round}");
        }
        assert!(!m.daemon_log().contains("inconsistent"), "[{stack}] {}", m.daemon_log());
    }
}

/// A file rewritten in place in the lower directory while the mount still has it open: the
/// next open sees the rewrite (here bytes that do not decode, so EIO), not the state the open
/// one loaded, and the outside bytes stay as they are.
#[test]
fn a_rewrite_from_outside_shows_at_the_next_open_even_while_the_file_is_open() {
    let m = Mount::new("zstd");
    fs::write(m.path("e"), "the encoded version\n").unwrap();
    // A fresh daemon loads the file at its first open, with the bytes it reads ahead.
    let m = m.remount();
    let held = fs::File::open(m.path("e")).unwrap();
    assert_eq!(fs::read_to_string(m.path("e")).unwrap(), "the encoded version\n");
    std::thread::sleep(std::time::Duration::from_millis(50));
    fs::write(m.lower_path("e"), "not zstd at all").unwrap();
    // Past the attribute timeout, so that the kernel asks again.
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let err = fs::read(m.path("e")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert_eq!(fs::read(m.lower_path("e")).unwrap(), b"not zstd at all");
    drop(held);
}

/// `tar`, `cp -p` and `rsync -t` set a file's times on the open file just before closing it.
/// The last close writes the rest of the encoded file to the lower file, which moved its mtime
/// past the one set: untarred files showed the time of the untar.
#[test]
fn times_set_on_an_open_file_just_before_closing_it_stay() {
    use std::time::{Duration as D, SystemTime};
    for (stack, init) in [("zstd", false), ("crypt", true), ("zstd,crypt", true)] {
        let m = if init { Mount::crypt(stack, &[], &[]) } else { Mount::new(stack) };
        let when = SystemTime::UNIX_EPOCH + D::from_secs(1_600_000_000);
        let accessed = SystemTime::UNIX_EPOCH + D::from_secs(1_500_000_000);
        for (i, len) in [10usize, 5000, 100_000, 3 << 20].into_iter().enumerate() {
            let f = fs::File::create(m.path(&format!("f{i}"))).unwrap();
            (&f).write_all(&text(len)).unwrap();
            f.set_times(fs::FileTimes::new().set_modified(when).set_accessed(accessed)).unwrap();
            drop(f);
        }
        // Written after its times were set: the write moves the mtime, as on any file system.
        let f = fs::File::create(m.path("later")).unwrap();
        f.set_modified(when).unwrap();
        (&f).write_all(b"after").unwrap();
        drop(f);
        let m = m.remount();
        for i in 0..4 {
            let meta = fs::metadata(m.path(&format!("f{i}"))).unwrap();
            assert_eq!(meta.modified().unwrap(), when, "{stack}: f{i}, through the mount");
            assert_eq!(meta.accessed().unwrap(), accessed, "{stack}: f{i} atime, through the mount");
            assert_eq!(fs::read(m.path(&format!("f{i}"))).unwrap().len(), [10usize, 5000, 100_000, 3 << 20][i]);
        }
        let later = fs::metadata(m.path("later")).unwrap().modified().unwrap();
        assert!(later > when + D::from_secs(86400), "{stack}: a write after the times moves the mtime");
    }
}

/// `lsattr`/`chattr` on an encoded file: refused clearly (the lower file's flags are not this
/// file's), while a directory beside it takes them.
#[test]
fn file_attribute_flags_are_refused_on_encoded_files() {
    let m = Mount::new("zstd");
    fs::write(m.path("f"), b"encoded").unwrap();
    fs::create_dir(m.path("d")).unwrap();
    assert_eq!(get_file_flags(&m.path("f")), Err(libc::ENOTTY), "refused (lsattr says \"Operation not supported\")");
    assert_eq!(set_file_flags(&m.path("f"), 0), libc::ENOTTY);
    if let Ok(flags) = get_file_flags(&m.lower_path("d")) {
        assert_eq!(get_file_flags(&m.path("d")), Ok(flags), "a directory passes");
    }
}

/// Mount `stack` over `lower`, made a crypt volume first when the stack has a crypt layer.
fn mount_encoding(stack: &str, dir: tempfile::TempDir, root: &Path, lower: PathBuf, mnt: PathBuf) -> Mount {
    let passfile = stack.contains("crypt").then(|| format!("--passfile={}", crypt_init(root, &lower, &[]).display()));
    Mount::start(dir, lower, mnt, stack, passfile.as_deref().as_slice())
}

/// `fallocate` on an encoded file sets room aside below, as a kernel file system does, and punches
/// holes that SEEK_HOLE finds. Asking
/// for more than the free space fails with `ENOSPC` and leaves the file as it was (xfstests
/// generic/213 found it growing the file instead), and room set aside shows as used.
#[test]
fn fallocate_sets_room_aside_and_refuses_more_than_there_is() {
    for stack in ["zstd", "zstd,crypt"] {
        let small = SmallTmpfs::mount("16m");
        let lower = small.path().join("lower");
        fs::create_dir(&lower).unwrap();
        let (dir, root, [mnt]) = scratch_dirs(["mnt"]);
        let m = mount_encoding(stack, dir, &root, lower, mnt);
        let f = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(m.path("f")).unwrap();
        let free = small.available();
        let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, 2 * free as i64) };
        assert_eq!((rc, common::errno()), (-1, libc::ENOSPC), "[{stack}] fallocate of twice the free space");
        assert_eq!(f.metadata().unwrap().len(), 0, "[{stack}] a refused fallocate leaves the size");
        let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, 4 << 20) };
        assert_eq!(rc, 0, "[{stack}] fallocate of 4 MiB: errno {}", common::errno());
        assert_eq!(f.metadata().unwrap().len(), 4 << 20, "[{stack}]");
        assert!(small.available() + (4 << 20) <= free + (64 << 10), "[{stack}] 4 MiB set aside below: {} of {free} free", small.available());
        let mut data = Vec::new();
        (&f).read_to_end(&mut data).unwrap();
        assert!(data.len() == 4 << 20 && data.iter().all(|&b| b == 0), "[{stack}] reads as zeros");
        // A truncate that shrinks the file gives the room back (xfstests generic/701 found it kept).
        f.set_len(1 << 20).unwrap();
        assert!(small.available() + (64 << 10) >= free, "[{stack}] room given back: {} of {free} free", small.available());
        // A punched chunk (4 KiB chunks here) is a hole, as SEEK_DATA shows (xfstests generic/539).
        f.set_len(0).unwrap();
        f.write_all_at(&[b'a'; 12288], 0).unwrap();
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        assert_eq!(unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), punch, 4096, 4096) }, 0, "[{stack}] punch");
        assert_eq!(unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(&f), 4096, libc::SEEK_DATA) }, 8192, "[{stack}] SEEK_DATA");
        assert_eq!(unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(&f), 0, libc::SEEK_HOLE) }, 4096, "[{stack}] SEEK_HOLE");
        let mut all = vec![0u8; 12288];
        f.read_exact_at(&mut all, 0).unwrap();
        assert!(all[..4096].iter().all(|&b| b == b'a') && all[4096..8192].iter().all(|&b| b == 0) && all[8192..].iter().all(|&b| b == b'a'), "[{stack}]");
        drop(f);
        drop(m);
    }
}

/// Writing a range that `fallocate` set aside takes no room beyond it, whatever the data: the
/// room set aside covers every chunk the range touches, encoded at the most the codec can make
/// of it, and the checkpoint after. (xfstests generic/568 on crypt: two bytes written across a
/// chunk boundary after `fallocate` of those two bytes grew the file from 8 to 12 KiB.)
#[test]
fn writing_a_fallocated_range_takes_no_more_room() {
    let mut seed = 0x5eed_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for stack in ["zstd", "crypt", "zstd,crypt"] {
        let (dir, root, [lower, mnt]) = scratch_dirs(["lower", "mnt"]);
        let m = mount_encoding(stack, dir, &root, lower, mnt);
        let mut cases = vec![(4095, 2), (0, 1 << 20)];
        cases.extend((0..12).map(|_| (next() % (1 << 20), 1 + next() % (3 << 18))));
        for (i, (offset, length)) in cases.into_iter().enumerate() {
            let path = m.path(&format!("f{i}"));
            let f = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path).unwrap();
            let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, offset as i64, length as i64) };
            assert_eq!(rc, 0, "[{stack}] fallocate {offset} {length}: errno {}", common::errno());
            let before = f.metadata().unwrap().blocks();
            // Data no codec shrinks.
            let data: Vec<u8> = (0..length).map(|_| next() as u8).collect();
            f.write_all_at(&data, offset).unwrap();
            f.sync_all().unwrap();
            drop(f);
            let after = fs::metadata(&path).unwrap().blocks();
            assert!(after <= before, "[{stack}] fallocate {offset} {length}, then a write of it: {before} blocks before, {after} after");
            let mut back = vec![0; length as usize];
            File::open(&path).unwrap().read_exact_at(&mut back, offset).unwrap();
            assert!(back == data, "[{stack}] {offset} {length}: reads back");
        }
    }
}
