//! The `crypt` layer through real mounts: round trips on both ciphers and with a collapsed
//! compressor, holes, passwords and key files, and an attacker who edits the lower files —
//! flipping bits, swapping and copying sealed chunks between places and files, cutting files
//! short — with every CRC recomputed, so that only the authenticated encryption stands between
//! them and the data.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{cpath, crypt_passfile, mounted_fstype, plyfs, run, Mount};
use serde_json::Value;

const CHUNK: usize = 4096;
const CONFIG: &str = ".plyfs-crypt.conf";
/// In every plaintext these tests write; never in a lower file.
const MARKER: &[u8] = b"TOPSECRET-PLAINTEXT-7d1f";

/// `len` bytes of compressible text, with the marker in every line.
fn secret_text(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 100);
    let mut i = 0;
    while out.len() < len {
        out.extend_from_slice(format!("line {i}: {} of a stackable file system\n", String::from_utf8_lossy(MARKER)).as_bytes());
        i += 1;
    }
    out.truncate(len);
    out
}

/// `chunks` whole chunks, each telling which chunk of which file it is.
fn chunked(tag: &str, chunks: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(chunks * CHUNK);
    for k in 0..chunks {
        let mut chunk = Vec::with_capacity(CHUNK + 100);
        while chunk.len() < CHUNK {
            chunk.extend_from_slice(format!("[{tag} chunk {k:05} {}]", String::from_utf8_lossy(MARKER)).as_bytes());
        }
        chunk.truncate(CHUNK);
        out.extend_from_slice(&chunk);
    }
    out
}

/// Pseudo-random bytes (xorshift), for data that does not compress.
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        })
        .collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn op(m: &Mount, rel: &str, name: &str) -> Value {
    let out = run(plyfs().arg("op").arg(m.path(rel)).arg(name));
    assert!(out.status.success(), "op {name} on {rel}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn passfile_opt(path: &Path) -> String {
    format!("--passfile={}", path.display())
}

/// Every regular file of a lower directory but the volume configuration.
fn lower_files(lower: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, top: bool, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                walk(&e.path(), false, out);
            } else if t.is_file() && !(top && e.file_name() == CONFIG) {
                out.push(e.path());
            }
        }
    }
    let mut out = Vec::new();
    walk(lower, true, &mut out);
    out.sort();
    out
}

/// The file id in the header of an encoded lower file, in hex, if it is one.
fn header_file_id(bytes: &[u8]) -> Option<String> {
    (bytes.len() >= 64 && bytes.starts_with(b"PLYSCA\x00\x01")).then(|| bytes[20..36].iter().map(|b| format!("{b:02x}")).collect())
}

/// The exit statuses of `man plyfs` (EXIT STATUS) these tests meet.
const OTHER: i32 = 1;
const BAD_CONFIG: i32 = 8;
const WRONG_SECRET: i32 = 12;
const FSCK_DAMAGE: i32 = 26;

/// The first line of a command's standard error, after checking it is the only one and the
/// exit status is `status`.
fn one_line_error(out: &Output, status: i32, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(status), "{what}: exit status {:?}, stderr: {stderr}", out.status);
    assert_eq!(stderr.lines().count(), 1, "{what}: one line of error, not:\n{stderr}");
    assert!(stderr.starts_with("plyfs: "), "{what}: {stderr}");
    stderr.trim_end().to_owned()
}

/// Mount with `plyfs mount` as a user would (a background daemon), expecting it to fail:
/// returns its one-line error after checking that nothing got mounted.
fn refused_mount(lower: &Path, mnt: &Path, args: &[&str], status: i32, what: &str) -> String {
    let out = run(plyfs().arg("mount").arg(lower).arg(mnt).args(args));
    if out.status.success() {
        let _ = run(plyfs().arg("umount").arg(mnt));
        panic!("{what}: the mount should have been refused: {}", String::from_utf8_lossy(&out.stderr));
    }
    assert_eq!(mounted_fstype(mnt), None, "{what}: something is mounted on {}", mnt.display());
    let mountpoint = Command::new("mountpoint").arg("-q").arg(mnt).status().unwrap();
    assert!(!mountpoint.success(), "{what}: mountpoint(1) says {} is a mount point", mnt.display());
    assert_eq!(fs::read_dir(mnt).unwrap().count(), 0, "{what}: the mount point is not left empty");
    one_line_error(&out, status, what)
}

/// Names, sizes, contents and modification times of everything in a directory tree.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (u64, Vec<u8>, std::time::SystemTime)> {
    let mut out = BTreeMap::new();
    for p in lower_files(dir).into_iter().chain([dir.join(CONFIG)]) {
        let meta = fs::metadata(&p).unwrap();
        out.insert(p.clone(), (meta.len(), fs::read(&p).unwrap(), meta.modified().unwrap()));
    }
    out
}

// ------------------------------------------------------------------------------------------
// The lower format, as an attacker who has read crates/sca/src/format.rs sees it.

const DATA_START: usize = 256;
const RECORD_HEADER: usize = 56;
const KIND_DATA: u8 = 1;
const KIND_RUN: u8 = 2;

/// CRC-32 (IEEE), as the format uses it: anyone can recompute it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

#[derive(Clone, Copy, Debug)]
struct Record {
    off: usize,
    kind: u8,
    seq: u64,
    chunk: u64,
    count: u32,
    payload_len: usize,
}

impl Record {
    fn payload(&self) -> Range<usize> {
        self.off + RECORD_HEADER..self.off + RECORD_HEADER + self.payload_len
    }

    fn end(&self) -> usize {
        self.off + RECORD_HEADER + self.payload_len.div_ceil(8) * 8
    }
}

/// The records of a lower file, in log order; checks their CRCs (and so this file's CRC-32).
fn records(bytes: &[u8]) -> Vec<Record> {
    let mut out = Vec::new();
    let mut at = DATA_START;
    while at + RECORD_HEADER <= bytes.len() && &bytes[at..at + 4] == b"PLYR" {
        assert_eq!(crc32(&bytes[at..at + 52]), u32_at(bytes, at + 52), "record at {at}: header CRC");
        let r = Record {
            off: at,
            kind: bytes[at + 4],
            seq: u64_at(bytes, at + 8),
            chunk: u64_at(bytes, at + 16),
            count: u32_at(bytes, at + 24),
            payload_len: u32_at(bytes, at + 32) as usize,
        };
        assert_eq!(crc32(&bytes[r.payload()]), u32_at(bytes, at + 36), "record at {at}: payload CRC");
        out.push(r);
        at = r.end();
    }
    out
}

/// The live data record of every chunk (the newest of each), in chunk order.
fn data_records(bytes: &[u8]) -> Vec<Record> {
    let mut newest: BTreeMap<u64, Record> = BTreeMap::new();
    for r in records(bytes).into_iter().filter(|r| r.kind == KIND_DATA) {
        if newest.get(&r.chunk).is_none_or(|old| old.seq < r.seq) {
            newest.insert(r.chunk, r);
        }
    }
    let out: Vec<Record> = newest.into_values().collect();
    for (i, r) in out.iter().enumerate() {
        assert_eq!(r.chunk, i as u64, "a data record for every chunk: {out:?}");
    }
    out
}

/// Make a record's CRCs (and payload length) fit what it now holds, as an attacker would.
fn reseal_crcs(bytes: &mut [u8], r: &Record) {
    let payload = r.payload();
    let payload_crc = crc32(&bytes[payload.clone()]);
    bytes[r.off + 32..r.off + 36].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    bytes[r.off + 36..r.off + 40].copy_from_slice(&payload_crc.to_le_bytes());
    let header_crc = crc32(&bytes[r.off..r.off + 52]);
    bytes[r.off + 52..r.off + 56].copy_from_slice(&header_crc.to_le_bytes());
}

/// The nonce length of the AES-256-GCM payloads of these tests.
const NONCE: usize = 12;
const TAG: usize = 16;

// ------------------------------------------------------------------------------------------
// Reading through the mount.

/// One chunk of a file through the mount (fewer bytes at the end of the file).
fn read_chunk(f: &File, chunk: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0;
    while done < CHUNK {
        match f.read_at(&mut buf[done..], (chunk * CHUNK + done) as u64)? {
            0 => break,
            n => done += n,
        }
    }
    buf.truncate(done);
    Ok(buf)
}

fn open_random(path: &Path) -> File {
    let f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    // Only what is asked for: no readahead into damaged chunks.
    unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::POSIX_FADV_RANDOM) };
    f
}

/// Read every chunk of `rel`: the chunks in `bad` must fail with EIO, the others must read as
/// `data` does.
fn check_chunks(m: &Mount, rel: &str, data: &[u8], bad: &BTreeSet<usize>) {
    let f = open_random(&m.path(rel));
    let chunks = data.len().div_ceil(CHUNK);
    // The good ones first, then the bad ones, then the good ones again: a failure must not
    // leave anything behind.
    let good: Vec<usize> = (0..chunks).filter(|c| !bad.contains(c)).collect();
    for round in 0..2 {
        for &c in &good {
            let got = read_chunk(&f, c).unwrap_or_else(|e| panic!("{rel}: chunk {c} (round {round}): {e}"));
            let want = &data[c * CHUNK..((c + 1) * CHUNK).min(data.len())];
            assert!(got == want, "{rel}: chunk {c} reads back wrong");
        }
        if round == 0 {
            for &c in bad {
                match read_chunk(&f, c) {
                    Ok(got) => panic!("{rel}: tampered chunk {c} read as {} bytes instead of EIO: {:?}", got.len(), String::from_utf8_lossy(&got[..got.len().min(80)])),
                    Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{rel}: chunk {c}: {e}"),
                }
            }
        }
    }
}

/// The daemon still serves the mount.
fn assert_alive(m: &mut Mount) {
    assert!(m.child().try_wait().unwrap().is_none(), "the daemon died: {}", m.daemon_log());
    fs::metadata(m.path("")).expect("the mount answers stat");
    fs::read_dir(m.path("")).expect("the mount answers readdir").count();
    fs::write(m.path("alive"), b"still here").expect("the mount takes writes");
    assert_eq!(fs::read(m.path("alive")).unwrap(), b"still here");
    fs::remove_file(m.path("alive")).unwrap();
}

/// The log line for a damaged chunk names the lower file and the upper offset.
fn assert_logged(m: &Mount, rel: &str, chunk: usize, why: &str) {
    let log = m.daemon_log();
    let wanted = format!("{}: corrupt data at offset {}", m.lower_path(rel).display(), chunk * CHUNK);
    let line = log.lines().find(|l| l.contains(&wanted));
    let line = line.unwrap_or_else(|| panic!("the daemon log lacks '{wanted}':\n{log}"));
    assert!(line.contains(why), "the log line should say '{why}': {line}");
}

/// A crypt volume with plaintext names holding `files`, unmounted so that its lower files can
/// be tampered with; `remount()` it afterwards.
fn tamper_volume(files: &[(&str, &[u8])]) -> Mount {
    let mut m = Mount::crypt("crypt", &["--plaintext-names"], &[]);
    for (name, data) in files {
        fs::write(m.path(name), data).unwrap();
    }
    m.unmount();
    m
}

fn edit_lower(m: &Mount, rel: &str, edit: impl FnOnce(&mut Vec<u8>)) {
    let path = m.lower_path(rel);
    let mut bytes = fs::read(&path).unwrap();
    edit(&mut bytes);
    fs::write(&path, &bytes).unwrap();
}

fn set(items: &[usize]) -> BTreeSet<usize> {
    items.iter().copied().collect()
}

// ------------------------------------------------------------------------------------------
// Round trips.

const SIZES: [usize; 6] = [0, 1, 4095, 4096, 4097, (1 << 20) + 3];

#[test]
fn files_of_every_size_round_trip_and_the_lower_files_hold_no_plaintext() {
    for (stack, init, algorithm, compression) in [
        ("crypt", &[][..], "aes-256-gcm", Value::Null),
        ("crypt", &["--cipher", "xchacha20-poly1305"][..], "xchacha20-poly1305", Value::Null),
        ("zstd,crypt", &[][..], "aes-256-gcm", Value::from("zstd")),
    ] {
        let what = format!("[{stack} {init:?}]");
        let m = Mount::crypt(stack, init, &[]);
        let files: Vec<(String, Vec<u8>)> = SIZES.iter().map(|&n| (format!("f{n}"), secret_text(n))).collect();
        for (name, data) in &files {
            fs::write(m.path(name), data).unwrap();
            assert_eq!(&fs::read(m.path(name)).unwrap(), data, "{what} {name}");
        }
        let listed: BTreeSet<String> = fs::read_dir(m.path("")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        let expected: BTreeSet<String> = files.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(listed, expected, "{what} the mount shows the files and nothing else (no volume configuration)");

        // crypt-info answers from the header and index.
        let mut ids = BTreeSet::new();
        for (name, data) in &files {
            let info = op(&m, name, "crypt-info");
            assert_eq!(info["algorithm"], algorithm, "{what} {name}: {info}");
            assert_eq!(info["chunk_bytes"], CHUNK as u64, "{what} {name}: {info}");
            assert_eq!(info["chunks"], data.len().div_ceil(CHUNK) as u64, "{what} {name}: {info}");
            assert_eq!(info["size"], data.len() as u64, "{what} {name}: {info}");
            assert_eq!(info["compression"], compression, "{what} {name}: {info}");
            if data.is_empty() {
                continue;
            }
            let id = info["file_id"].as_str().unwrap_or_else(|| panic!("{what} {name}: no file id: {info}")).to_owned();
            assert!(id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()), "{what} {name}: file id {id}");
            assert!(ids.insert(id), "{what} {name}: file ids are unique");
        }

        let m = m.remount();
        for (name, data) in &files {
            assert_eq!(&fs::read(m.path(name)).unwrap(), data, "{what} {name} after a remount");
            assert_eq!(fs::metadata(m.path(name)).unwrap().len(), data.len() as u64, "{what} {name}: stat size");
            assert_eq!(op(&m, name, "verify")["ok"], true, "{what} {name}");
        }

        // Below: no plaintext anywhere, and the headers carry the ids crypt-info reports.
        let mut lower_ids = BTreeSet::new();
        let mut stored = 0;
        for p in lower_files(&m.lower) {
            let bytes = fs::read(&p).unwrap();
            assert!(!contains(&bytes, MARKER), "{what} {} holds plaintext", p.display());
            assert!(!contains(&bytes, b"of a stackable file"), "{what} {} holds plaintext", p.display());
            lower_ids.extend(header_file_id(&bytes));
            stored += bytes.len();
        }
        assert_eq!(lower_ids, ids, "{what} file ids in the lower headers");
        let plain: usize = SIZES.iter().sum();
        if compression.is_null() {
            assert!(stored > plain, "{what} sealed data takes more room than the plaintext: {stored} <= {plain}");
        } else {
            assert!(stored < plain / 4, "{what} compressible text must shrink before it is sealed: {stored} bytes for {plain}");
        }
    }
}

#[test]
fn zstd_crypt_files_read_back_through_crypt_alone() {
    let mut m = Mount::crypt("zstd,crypt", &[], &[]);
    let text = secret_text(3 << 20);
    let mixed: Vec<u8> = noise(100_000, 7).into_iter().chain(secret_text(100_000)).collect();
    fs::write(m.path("text"), &text).unwrap();
    fs::write(m.path("mixed"), &mixed).unwrap();
    assert_eq!(op(&m, "text", "crypt-info")["compression"], "zstd");
    let stored: u64 = lower_files(&m.lower).iter().map(|p| fs::metadata(p).unwrap().len()).sum();
    assert!(stored < (text.len() / 4 + mixed.len()) as u64, "zstd,crypt stores {stored} bytes for {} of text and {} mixed", text.len(), mixed.len());
    m.unmount();

    // The files record their chain, so `--stack crypt` still reads them through zstd,crypt ...
    let passfile = passfile_opt(&crypt_passfile(m.dir.path()));
    let mut m = Mount::start(tempfile::tempdir().unwrap(), m.lower.clone(), m.mnt.clone(), "crypt", &[&passfile]);
    assert_eq!(fs::read(m.path("text")).unwrap(), text);
    assert_eq!(fs::read(m.path("mixed")).unwrap(), mixed);
    m.unmount();
    // ... and without that record (copied without attributes, say), a plain crypt layer reads
    // them too: the compression kind is inside each sealed chunk.
    for p in lower_files(&m.lower) {
        unsafe { libc::removexattr(cpath(&p).as_ptr(), c"user.plyfs.chain".as_ptr()) };
    }
    let m = Mount::start(tempfile::tempdir().unwrap(), m.lower.clone(), m.mnt.clone(), "crypt", &[&passfile]);
    assert_eq!(fs::read(m.path("text")).unwrap(), text);
    assert_eq!(fs::read(m.path("mixed")).unwrap(), mixed);
    let info = op(&m, "text", "crypt-info");
    assert_eq!(info["compression"], Value::Null, "now read by a plain crypt layer: {info}");
    assert_eq!(op(&m, "text", "verify")["ok"], true);
}

#[test]
fn holes_read_as_zeros_and_cost_little() {
    for stack in ["crypt", "zstd,crypt"] {
        let m = Mount::crypt(stack, &["--plaintext-names"], &[]);
        let hole = 10 << 20;
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(m.path("sparse")).unwrap();
        f.write_all_at(b"end", hole as u64).unwrap();
        drop(f);
        let check = |m: &Mount| {
            assert_eq!(fs::metadata(m.path("sparse")).unwrap().len(), hole as u64 + 3, "[{stack}]");
            let got = fs::read(m.path("sparse")).unwrap();
            assert_eq!(got.len(), hole + 3, "[{stack}]");
            assert!(got[..hole].iter().all(|&b| b == 0), "[{stack}] the hole reads as zeros");
            assert_eq!(&got[hole..], b"end", "[{stack}]");
        };
        check(&m);
        let info = op(&m, "sparse", "crypt-info");
        assert_eq!(info["chunks"], (hole / CHUNK + 1) as u64, "[{stack}] {info}");
        let lower = fs::read(m.lower_path("sparse")).unwrap();
        assert!(lower.len() < 64 << 10, "[{stack}] a 10 MiB hole costs {} lower bytes", lower.len());
        let runs = records(&lower).into_iter().filter(|r| r.kind == KIND_RUN).count();
        assert!(runs >= 1, "[{stack}] the hole is stored as a run of zero chunks");
        let m = m.remount();
        check(&m);
        assert_eq!(op(&m, "sparse", "verify")["ok"], true, "[{stack}]");
    }
}

#[test]
fn a_hole_is_sealed_like_data() {
    // One payload stands for the whole run of zero chunks; altering it must not go unnoticed.
    let hole_chunks = 100;
    let mut m = Mount::crypt("crypt", &["--plaintext-names"], &[]);
    let f = OpenOptions::new().write(true).create(true).truncate(true).open(m.path("sparse")).unwrap();
    f.write_all_at(&chunked("head", 1), 0).unwrap();
    f.write_all_at(&chunked("tail", 1), ((hole_chunks + 1) * CHUNK) as u64).unwrap();
    drop(f);
    let mut data = chunked("head", 1);
    data.resize((hole_chunks + 1) * CHUNK, 0);
    data.extend_from_slice(&chunked("tail", 1));
    m.unmount();
    let mut run = None;
    edit_lower(&m, "sparse", |b| {
        let r = *records(b).iter().rfind(|r| r.kind == KIND_RUN).expect("a run record for the hole");
        assert_eq!((r.chunk, r.count as usize), (1, hole_chunks), "the run stands for the whole hole: {r:?}");
        b[r.payload().start + NONCE + 1] ^= 0x04;
        reseal_crcs(b, &r);
        run = Some(r);
    });
    let run = run.unwrap();
    let mut m = m.remount();
    let bad: BTreeSet<usize> = (run.chunk as usize..run.chunk as usize + run.count as usize).collect();
    check_chunks(&m, "sparse", &data, &bad);
    assert_alive(&mut m);
}

// ------------------------------------------------------------------------------------------
// Passwords, key files and the volume configuration.

/// A crypt volume with one file, unmounted: (test dir, lower, mount point, password file).
fn volume_with_file(data: &[u8]) -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let mut m = Mount::crypt("crypt", &[], &[]);
    fs::write(m.path("f"), data).unwrap();
    m.unmount();
    let (lower, mnt) = (m.lower.clone(), m.mnt.clone());
    let dir = std::mem::replace(&mut m.dir, tempfile::tempdir().unwrap());
    drop(m);
    let passfile = crypt_passfile(dir.path());
    (dir, lower, mnt, passfile)
}

#[test]
fn a_wrong_password_mounts_nothing_and_touches_nothing() {
    let data = secret_text(50_000);
    let (dir, lower, mnt, passfile) = volume_with_file(&data);
    let wrong = dir.path().join("wrong");
    fs::write(&wrong, "correct horse battery stapler\n").unwrap();
    let before = snapshot(&lower);
    let expected = format!("plyfs: {}/{CONFIG}: wrong password (or the file was altered)", lower.display());
    let wrong_arg = wrong.display().to_string();
    for args in [
        vec!["--stack", "crypt", "--passfile", &wrong_arg],
        vec!["--stack", "crypt", "--extpass", "echo hunter2"],
        vec!["--stack", "zstd,crypt", "--passfile", &wrong_arg],
        vec!["--stack", "crypt", "--passfile", &wrong_arg, "--foreground"],
    ] {
        assert_eq!(refused_mount(&lower, &mnt, &args, WRONG_SECRET, &format!("{args:?}")), expected, "{args:?}");
    }
    assert!(snapshot(&lower) == before, "a refused mount changed the lower directory");
    // The right password, from a command this time, still opens it.
    let extpass = format!("--extpass=cat {}", passfile.display());
    let m = Mount::start(dir, lower, mnt, "crypt", &[&extpass]);
    assert_eq!(fs::read(m.path("f")).unwrap(), data);
}

#[test]
fn a_corrupt_or_missing_configuration_is_refused_clearly() {
    let (dir, lower, mnt, passfile) = volume_with_file(b"data");
    let config = lower.join(CONFIG);
    let pass = passfile.display().to_string();
    let args = ["--stack", "crypt", "--passfile", &pass];
    let good = fs::read_to_string(&config).unwrap();
    let shown = config.display().to_string();
    // The file is read-only (0400); the attacker, or a careless editor, writes it anyway.
    fs::set_permissions(&config, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();

    fs::write(&config, "this is not a configuration file at all {{{\n").unwrap();
    let err = refused_mount(&lower, &mnt, &args, BAD_CONFIG, "garbage configuration");
    assert!(err.starts_with(&format!("plyfs: {shown}: corrupt")), "{err}");

    fs::write(&config, good.lines().filter(|l| !l.starts_with("wrapped_key")).collect::<Vec<_>>().join("\n")).unwrap();
    let err = refused_mount(&lower, &mnt, &args, BAD_CONFIG, "configuration without its key");
    assert!(err.starts_with(&format!("plyfs: {shown}: corrupt")) && err.contains("wrapped_key"), "{err}");

    // A setting changed behind the owner's back: the key no longer unwraps.
    assert!(good.contains("plaintext_names = false"), "{good}");
    fs::write(&config, good.replace("plaintext_names = false", "plaintext_names = true")).unwrap();
    let err = refused_mount(&lower, &mnt, &args, WRONG_SECRET, "edited setting");
    assert_eq!(err, format!("plyfs: {shown}: wrong password (or the file was altered)"));

    fs::write(&config, &good).unwrap();
    let mut m = Mount::start(dir, lower.clone(), mnt.clone(), "crypt", &[&passfile_opt(&passfile)]);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"data");
    m.unmount();

    // A plain directory is not a volume, with or without a password.
    let plain = m.dir.path().join("plain");
    fs::create_dir(&plain).unwrap();
    fs::write(plain.join("file"), b"plain").unwrap();
    for args in [&["--stack", "crypt"][..], &args[..], &["--stack", "zstd,crypt", "--foreground"][..]] {
        let err = refused_mount(&plain, &mnt, args, BAD_CONFIG, &format!("plain directory, {args:?}"));
        assert!(err.contains("not a crypt volume"), "{args:?}: {err}");
        assert!(err.contains(&plain.display().to_string()) || err.contains(CONFIG), "{args:?}: the error names what is missing: {err}");
    }
    assert_eq!(fs::read_dir(&plain).unwrap().count(), 1, "nothing was added to the plain directory");
}

#[test]
fn without_a_password_or_a_terminal_mount_says_how_to_give_one() {
    let (_dir, lower, mnt, _passfile) = volume_with_file(b"data");
    let out = plyfs()
        .arg("mount")
        .arg(&lower)
        .arg(&mnt)
        .args(["--stack", "crypt"])
        .stdin(std::process::Stdio::null())
        .pre_exec_setsid()
        .output()
        .unwrap();
    assert_eq!(mounted_fstype(&mnt), None);
    let err = one_line_error(&out, OTHER, "no password, no terminal");
    assert!(err.contains("no terminal") && err.contains("--passfile"), "{err}");
}

/// `setsid` in the child, so that it has no controlling terminal even when the tests run in
/// one.
trait Setsid {
    fn pre_exec_setsid(&mut self) -> &mut Self;
}

impl Setsid for Command {
    fn pre_exec_setsid(&mut self) -> &mut Self {
        // SAFETY: setsid is async-signal-safe.
        unsafe {
            self.pre_exec(|| {
                libc::setsid();
                Ok(())
            })
        }
    }
}

#[test]
fn passwd_rewraps_the_key_and_keeps_the_data() {
    let data = secret_text(300_000);
    let (dir, lower, mnt, old) = volume_with_file(&data);
    let new = dir.path().join("new-passfile");
    fs::write(&new, "a much better password\n").unwrap();
    let config_before = fs::read_to_string(lower.join(CONFIG)).unwrap();
    let out = run(plyfs().arg("passwd").arg(&lower).arg("--passfile").arg(&old).arg("--new-passfile").arg(&new));
    assert!(out.status.success(), "passwd: {}", String::from_utf8_lossy(&out.stderr));
    let config_after = fs::read_to_string(lower.join(CONFIG)).unwrap();
    let line = |text: &str, key: &str| text.lines().find(|l| l.starts_with(key)).map(str::to_owned);
    assert_eq!(line(&config_before, "volume_id"), line(&config_after, "volume_id"), "the same volume");
    assert_ne!(line(&config_before, "wrapped_key"), line(&config_after, "wrapped_key"), "the key is wrapped anew");

    let old_arg = old.display().to_string();
    let err = refused_mount(&lower, &mnt, &["--stack", "crypt", "--passfile", &old_arg], WRONG_SECRET, "the old password");
    assert!(err.ends_with("wrong password (or the file was altered)"), "{err}");
    // The old password cannot change it back either.
    let out = run(plyfs().arg("passwd").arg(&lower).arg("--passfile").arg(&old).arg("--new-passfile").arg(&old));
    assert!(one_line_error(&out, WRONG_SECRET, "passwd with the old password").contains("wrong password"));

    let m = Mount::start(dir, lower, mnt, "crypt", &[&passfile_opt(&new)]);
    assert_eq!(fs::read(m.path("f")).unwrap(), data);
    fs::write(m.path("g"), b"written after the change").unwrap();
    let m = m.remount();
    assert_eq!(fs::read(m.path("g")).unwrap(), b"written after the change");
}

#[test]
fn a_key_file_volume() {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (lower, mnt) = (root.join("lower"), root.join("mnt"));
    fs::create_dir(&lower).unwrap();
    fs::create_dir(&mnt).unwrap();
    let keyfile = root.join("key");
    fs::write(&keyfile, noise(64, 42)).unwrap();
    let short = root.join("short-key");
    fs::write(&short, b"0123456789").unwrap();

    let out = run(plyfs().arg("init").arg(&lower).arg("--keyfile").arg(&short));
    assert!(one_line_error(&out, OTHER, "a short key file").contains("at least 32"));
    let out = run(plyfs().arg("init").arg(&lower).arg("--keyfile").arg(&keyfile));
    assert!(out.status.success(), "init --keyfile: {}", String::from_utf8_lossy(&out.stderr));

    let data = secret_text(100_000);
    let keyfile_arg = format!("--keyfile={}", keyfile.display());
    let mut m = Mount::start(dir, lower.clone(), mnt.clone(), "crypt", &[&keyfile_arg]);
    fs::write(m.path("f"), &data).unwrap();
    m.unmount();
    let mut m = m.remount();
    assert_eq!(fs::read(m.path("f")).unwrap(), data);
    m.unmount();
    let other = root.join("other-key");
    fs::write(&other, noise(64, 99)).unwrap();

    let passfile = crypt_passfile(&root);
    let pass = passfile.display().to_string();
    let err = refused_mount(&lower, &mnt, &["--stack", "crypt", "--passfile", &pass], WRONG_SECRET, "a password for a key file volume");
    assert!(err.contains("key file"), "{err}");
    let other = other.display().to_string();
    let err = refused_mount(&lower, &mnt, &["--stack", "crypt", "--keyfile", &other], WRONG_SECRET, "another key file");
    assert_eq!(err, format!("plyfs: {}/{CONFIG}: wrong key file (or the file was altered)", lower.display()));
    for p in lower_files(&lower) {
        assert!(!contains(&fs::read(p).unwrap(), MARKER));
    }
}

// ------------------------------------------------------------------------------------------
// An attacker with write access to the lower directory.

#[test]
fn a_flipped_bit_anywhere_in_a_sealed_chunk_reads_as_eio() {
    let data = chunked("f", 16);
    let m = tamper_volume(&[("f", &data)]);
    // One bit in the nonce of chunk 2, the ciphertext of chunk 5, the sealed kind byte of chunk
    // 8 and the tag of chunk 11; the CRCs recomputed each time.
    edit_lower(&m, "f", |b| {
        let recs = data_records(b);
        assert_eq!(recs.len(), 16);
        for (chunk, at) in [(2usize, 3usize), (5, NONCE + 100), (8, NONCE + CHUNK), (11, NONCE + CHUNK + 1 + TAG - 1)] {
            let r = recs[chunk];
            assert_eq!(r.payload_len, NONCE + CHUNK + 1 + TAG, "{r:?}");
            b[r.payload().start + at] ^= 0x10;
            reseal_crcs(b, &r);
        }
    });
    let mut m = m.remount();
    let bad = set(&[2, 5, 8, 11]);
    check_chunks(&m, "f", &data, &bad);
    for &c in &bad {
        assert_logged(&m, "f", c, "authentication failed");
    }
    let report = op(&m, "f", "verify");
    assert_eq!(report["ok"], false, "{report}");
    let offsets: BTreeSet<u64> = report["problems"].as_array().unwrap().iter().map(|p| p["offset"].as_u64().unwrap()).collect();
    assert_eq!(offsets, bad.iter().map(|c| (c * CHUNK) as u64).collect(), "{report}");
    assert_alive(&mut m);
}

#[test]
fn chunks_swapped_within_a_file_read_as_eio() {
    let data = chunked("s", 10);
    let m = tamper_volume(&[("payloads", &data), ("numbers", &data), ("moved", &data)]);
    // Swap the sealed payloads of chunks 3 and 7, headers left in place.
    edit_lower(&m, "payloads", |b| {
        let recs = data_records(b);
        let (a, z) = (recs[3], recs[7]);
        let pa = b[a.payload()].to_vec();
        let pz = b[z.payload()].to_vec();
        b[a.payload()].copy_from_slice(&pz);
        b[z.payload()].copy_from_slice(&pa);
        reseal_crcs(b, &a);
        reseal_crcs(b, &z);
    });
    // Swap the chunk numbers in the two records' headers instead: each record claims the
    // other's place.
    edit_lower(&m, "numbers", |b| {
        let recs = data_records(b);
        let (a, z) = (recs[3], recs[7]);
        b[a.off + 16..a.off + 24].copy_from_slice(&7u64.to_le_bytes());
        b[z.off + 16..z.off + 24].copy_from_slice(&3u64.to_le_bytes());
        reseal_crcs(b, &a);
        reseal_crcs(b, &z);
    });
    // Moving whole records within the log, each with its own header, is no attack: the index
    // is rebuilt from the records and every chunk still reads back.
    edit_lower(&m, "moved", |b| {
        let recs = data_records(b);
        let (a, z) = (recs[3], recs[7]);
        let ra = b[a.off..a.end()].to_vec();
        let rz = b[z.off..z.end()].to_vec();
        b[a.off..a.end()].copy_from_slice(&rz);
        b[z.off..z.end()].copy_from_slice(&ra);
    });
    let mut m = m.remount();
    check_chunks(&m, "payloads", &data, &set(&[3, 7]));
    assert_logged(&m, "payloads", 3, "authentication failed");
    assert_logged(&m, "payloads", 7, "authentication failed");
    check_chunks(&m, "numbers", &data, &set(&[3, 7]));
    check_chunks(&m, "moved", &data, &set(&[]));
    assert_alive(&mut m);
}

#[test]
fn a_chunk_copied_from_another_file_reads_as_eio() {
    // Two files with the same plaintext: only their ids tell their chunks apart.
    let data = chunked("same", 8);
    let m = tamper_volume(&[("a", &data), ("b", &data)]);
    let a = fs::read(m.lower_path("a")).unwrap();
    let from = data_records(&a)[4];
    edit_lower(&m, "b", |b| {
        let to = data_records(b)[4];
        assert_eq!(from.payload_len, to.payload_len);
        b[to.payload()].copy_from_slice(&a[from.payload()]);
        reseal_crcs(b, &to);
        // A chunk from another place of the same file, too.
        let (one, six) = (data_records(b)[1], data_records(b)[6]);
        let moved = b[one.payload()].to_vec();
        b[six.payload()].copy_from_slice(&moved);
        reseal_crcs(b, &six);
    });
    let mut m = m.remount();
    check_chunks(&m, "a", &data, &set(&[]));
    check_chunks(&m, "b", &data, &set(&[4, 6]));
    assert_logged(&m, "b", 4, "authentication failed");
    assert_logged(&m, "b", 6, "authentication failed");
    assert_alive(&mut m);
}

#[test]
fn a_lower_file_cut_short_reads_as_eio_past_the_cut() {
    let data = chunked("cut", 32);
    let m = tamper_volume(&[("mid", &data), ("edge", &data)]);
    // In the middle of chunk 16's record, and exactly where it starts.
    for (name, inside) in [("mid", 100usize), ("edge", 0)] {
        let bytes = fs::read(m.lower_path(name)).unwrap();
        let cut = data_records(&bytes)[16].off + inside;
        OpenOptions::new().write(true).open(m.lower_path(name)).unwrap().set_len(cut as u64).unwrap();
    }
    let mut m = m.remount();
    let lost: BTreeSet<usize> = (16..32).collect();
    for name in ["mid", "edge"] {
        assert_eq!(fs::metadata(m.path(name)).unwrap().len(), data.len() as u64, "{name}: stat still gives the size written");
        check_chunks(&m, name, &data, &lost);
        assert_eq!(fs::read(m.path(name)).unwrap_err().raw_os_error(), Some(libc::EIO), "{name}: reading it whole");
    }
    assert_alive(&mut m);
}

#[test]
fn garbage_appended_to_a_lower_file_is_ignored() {
    let data = secret_text(5 * CHUNK + 1234);
    let m = tamper_volume(&[("noise", &data), ("fake", &data)]);
    let mut f = OpenOptions::new().append(true).open(m.lower_path("noise")).unwrap();
    f.write_all(&noise(3000, 5)).unwrap();
    // Something that starts like a record.
    let mut fake = b"PLYR".to_vec();
    fake.extend_from_slice(&noise(200, 6));
    OpenOptions::new().append(true).open(m.lower_path("fake")).unwrap().write_all(&fake).unwrap();
    let mut m = m.remount();
    for name in ["noise", "fake"] {
        assert_eq!(fs::read(m.path(name)).unwrap(), data, "{name}");
        assert_eq!(op(&m, name, "verify")["ok"], true, "{name}");
    }
    assert_alive(&mut m);
}

/// A record header as the format builds it, with its CRCs, for forging records.
fn forged_record(kind: u8, flags: u8, seq: u64, chunk: u64, count: u32, decoded_len: u32, file_size: u64, payload: &[u8]) -> Vec<u8> {
    let mut r = vec![0u8; RECORD_HEADER];
    r[0..4].copy_from_slice(b"PLYR");
    r[4] = kind;
    r[5] = flags;
    r[6] = 12; // 4 KiB chunks
    r[8..16].copy_from_slice(&seq.to_le_bytes());
    r[16..24].copy_from_slice(&chunk.to_le_bytes());
    r[24..28].copy_from_slice(&count.to_le_bytes());
    r[28..32].copy_from_slice(&decoded_len.to_le_bytes());
    r[32..36].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    r[36..40].copy_from_slice(&crc32(payload).to_le_bytes());
    r[40..48].copy_from_slice(&file_size.to_le_bytes());
    let crc = crc32(&r[0..52]);
    r[52..56].copy_from_slice(&crc.to_le_bytes());
    r.extend_from_slice(payload);
    r.resize(RECORD_HEADER + payload.len().div_ceil(8) * 8, 0);
    r
}

#[test]
fn forged_unencoded_records_appended_to_the_log_read_as_eio() {
    // Records the cipher never writes — a chunk flagged as stored as it is, a fast tail — carry
    // plaintext of the attacker's choosing; appended after the log with newer sequence numbers
    // they would replace real chunks.
    let data = chunked("real", 4);
    let m = tamper_volume(&[("raw", &data), ("tail", &data)]);
    const EVIL: &[u8] = b"EVIL";
    let evil_chunk: Vec<u8> = EVIL.iter().copied().cycle().take(CHUNK).collect();
    for (name, chunk) in [("raw", 1u64), ("tail", 3)] {
        edit_lower(&m, name, |b| {
            let next_seq = records(b).iter().map(|r| r.seq).max().unwrap() + 1;
            let forged = match name {
                "raw" => forged_record(KIND_DATA, 1, next_seq, chunk, 1, CHUNK as u32, data.len() as u64, &evil_chunk),
                // Keep 100 bytes of the sealed chunk, then the attacker's bytes.
                _ => forged_record(3, 0, next_seq, chunk, 100, EVIL.len() as u32, (3 * CHUNK + 100 + EVIL.len()) as u64, EVIL),
            };
            b.extend_from_slice(&forged);
        });
    }
    let mut m = m.remount();
    for (name, chunk) in [("raw", 1usize), ("tail", 3)] {
        let f = open_random(&m.path(name));
        for c in 0..4 {
            match read_chunk(&f, c) {
                Ok(got) => {
                    assert!(!contains(&got, EVIL), "{name}: chunk {c} serves the attacker's bytes");
                    assert!(c != chunk, "{name}: the forged chunk {c} read as {} bytes instead of EIO", got.len());
                    assert!(got == data[c * CHUNK..(c + 1) * CHUNK], "{name}: chunk {c} reads back wrong");
                }
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{name}: chunk {c}: {e}");
                    assert_eq!(c, chunk, "{name}: chunk {c} should still read");
                }
            }
        }
        assert!(!fs::read(m.path(name)).is_ok_and(|all| contains(&all, EVIL)), "{name}: the attacker's bytes read back");
    }
    assert_logged(&m, "raw", 1, "a record marked unencoded");
    assert_logged(&m, "tail", 3, "an unencoded fast tail");
    assert_alive(&mut m);
}

// ------------------------------------------------------------------------------------------
// Offline tools.

#[test]
fn fsck_and_decode_with_a_password() {
    let files = [("a", secret_text(200_000)), ("b", chunked("b", 12)), ("empty", Vec::new())];
    let mut m = Mount::crypt("crypt", &["--plaintext-names"], &[]);
    fs::create_dir(m.path("sub")).unwrap();
    for (name, data) in &files {
        fs::write(m.path(&format!("sub/{name}")), data).unwrap();
    }
    m.unmount();
    let passfile = crypt_passfile(m.dir.path());
    let fsck = |pass: &Path| run(plyfs().arg("fsck").arg(&m.lower).args(["--stack", "crypt", "--passfile"]).arg(pass));

    let out = fsck(&passfile);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fsck of a sound volume: {stderr}");
    assert!(stderr.contains("3 files checked, 0 damaged"), "{stderr}");

    let dest = m.dir.path().join("decoded");
    let out = run(plyfs().arg("decode").arg(&m.lower).arg(&dest).args(["--stack", "crypt", "--passfile"]).arg(&passfile));
    assert!(out.status.success(), "decode: {}", String::from_utf8_lossy(&out.stderr));
    for (name, data) in &files {
        assert_eq!(&fs::read(dest.join("sub").join(name)).unwrap(), data, "decoded {name}");
    }
    assert!(!dest.join(CONFIG).exists(), "the volume configuration is no file of the volume");

    let wrong = m.dir.path().join("wrong");
    fs::write(&wrong, "nope\n").unwrap();
    assert!(one_line_error(&fsck(&wrong), WRONG_SECRET, "fsck with a wrong password").ends_with("wrong password (or the file was altered)"));

    edit_lower(&m, "sub/b", |b| {
        let r = data_records(b)[9];
        b[r.payload().start + NONCE + 7] ^= 1;
        reseal_crcs(b, &r);
    });
    let out = fsck(&passfile);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(FSCK_DAMAGE), "fsck must fail on damaged data: {stderr}");
    let damage: Vec<&str> = stderr.lines().filter(|l| l.starts_with("plyfs: sub/")).collect();
    assert!(!damage.is_empty() && damage.iter().all(|l| l.starts_with("plyfs: sub/b:")), "only sub/b is damaged:\n{stderr}");
    assert!(stderr.contains("3 files checked, 1 damaged"), "{stderr}");
}

/// `crypt:pad=padme`: what is stored below is padded to the PADMÉ length of each file's size
/// (and its 16-byte trailer), with the padding written as data; `stat` shows the real size;
/// data reads back, through a mount without the setting too (the files say they are padded);
/// compression and padding are refused together.
#[test]
fn padded_sizes_round_up_as_padme_says_and_stat_shows_the_real_size() {
    use plyfs_sca::format::{padme, FileHeader, Slot, HEADER_PADDED};
    let mut m = Mount::crypt("crypt:pad=padme", &[], &[]);
    let sizes = [1usize, 100, 1000, 4096, 5000, 100_000, 1_000_003];
    let content = |n: usize| -> Vec<u8> { (0..n).map(|i| (i * 7 + n) as u8).collect() };
    for n in sizes {
        fs::write(m.path(&format!("f{n}")), content(n)).unwrap();
        assert_eq!(fs::metadata(m.path(&format!("f{n}"))).unwrap().len(), n as u64);
    }
    // Grown and cut while open, then closed: padded again to the new size.
    let mut f = fs::OpenOptions::new().append(true).open(m.path("f1000")).unwrap();
    f.write_all(&[9; 3000]).unwrap();
    f.set_len(2500).unwrap();
    drop(f);
    m.unmount();
    let mut want: std::collections::BTreeMap<u64, Vec<u8>> = sizes.iter().map(|n| (*n as u64, content(*n))).collect();
    let mut f1000 = content(1000);
    f1000.resize(2500, 9);
    want.remove(&1000);
    want.insert(2500, f1000);
    let mut stored = Vec::new();
    for e in fs::read_dir(&m.lower).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().unwrap() == ".plyfs-crypt.conf" {
            continue;
        }
        let bytes = fs::read(&p).unwrap();
        let header = FileHeader::decode(&bytes).unwrap();
        assert_eq!(header.flags & HEADER_PADDED, HEADER_PADDED, "{}", p.display());
        stored.push(Slot::newest_in(&bytes).unwrap().file_size);
    }
    stored.sort();
    let expected: Vec<u64> = want.keys().map(|n| padme(n + 16)).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    assert_eq!(stored, expected, "stored sizes are the PADMÉ lengths of the sizes and their trailers");
    for (n, s) in want.keys().zip(&expected) {
        assert!((*s - n) as f64 <= 0.12 * (*n + 16) as f64 + 16.0, "{n} -> {s}");
    }
    // Read back through a mount that does not pad: the files say they are padded.
    let passfile = format!("--passfile={}", crypt_passfile(m.dir.path()).display());
    let dir = std::mem::replace(&mut m.dir, tempfile::tempdir().unwrap());
    let mut m = Mount::start(dir, m.lower.clone(), m.mnt.clone(), "crypt", &[&passfile]);
    for (n, data) in &want {
        let name = if *n == 2500 { "f1000".to_owned() } else { format!("f{n}") };
        assert_eq!(fs::metadata(m.path(&name)).unwrap().len(), *n);
        assert!(fs::read(m.path(&name)).unwrap() == *data, "{name} reads back");
    }
    // (Unmounted first: a second unshared mount of a lower is refused for that alone.)
    m.unmount();
    let elsewhere = tempfile::tempdir().unwrap();
    let out = run(plyfs().arg("mount").arg(&m.lower).arg(elsewhere.path()).args(["--stack", "zstd,crypt:pad=padme"]).arg(&passfile));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("would hide nothing"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A volume made with `plyfs init --pad padme` pads without being told at mount; the setting
/// is bound to the configuration like the others.
#[test]
fn a_volume_made_to_pad_pads_by_default() {
    use plyfs_sca::format::{FileHeader, HEADER_PADDED};
    let mut m = Mount::crypt("crypt", &["--pad", "padme"], &[]);
    fs::write(m.path("f"), b"how long am I?").unwrap();
    assert_eq!(fs::metadata(m.path("f")).unwrap().len(), 14);
    m.unmount();
    let config = fs::read_to_string(m.lower.join(".plyfs-crypt.conf")).unwrap();
    assert!(config.contains("pad = \"padme\""), "{config}");
    let below = fs::read_dir(&m.lower).unwrap().map(|e| e.unwrap().path()).find(|p| !p.ends_with(".plyfs-crypt.conf")).unwrap();
    let header = FileHeader::decode(&fs::read(&below).unwrap()).unwrap();
    assert_eq!(header.flags & HEADER_PADDED, HEADER_PADDED);
    // Editing the setting out makes the password fail rather than stop the padding silently.
    let path = m.lower.join(".plyfs-crypt.conf");
    fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    fs::write(&path, config.replace("pad = \"padme\"\n", "")).unwrap();
    let out = run(plyfs().arg("mount").arg(&m.lower).arg(&m.mnt).args(["--stack", "crypt"]).arg(format!("--passfile={}", crypt_passfile(m.dir.path()).display())));
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("altered"), "{}", String::from_utf8_lossy(&out.stderr));
}
