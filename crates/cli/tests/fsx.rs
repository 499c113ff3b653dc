//! A randomized differential tester in the style of fsx: long random sequences of writes,
//! appends, truncates, reads, mmap reads and writes, fsyncs, reopens and remounts, applied both
//! through a mount and to a reference file on the native file system; every read is compared
//! byte for byte.
//!
//! `PLYFS_FSX_SEED=N` reproduces a run exactly; `PLYFS_FSX_OPS=N` sets its length (CI runs a short
//! one per configuration; `scripts/fsx.sh --long` runs a million operations per configuration).
//!
//! It runs on every size-changing layer, with and without fast tails, with 4 KiB and 64 KiB
//! chunks, and on crypt volumes (alone and with zstd collapsed into it). Written data is half random bytes and half compressible text, so compressors both
//! shrink chunks and fall back to storing them raw.

mod common;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::rng::{self, Rng};
use common::Mount;

/// `len` bytes to write: random, or drawn from a few words so that it compresses.
fn data(rng: &mut Rng, len: usize) -> Vec<u8> {
    const WORDS: [&[u8]; 6] = [b"fast ", b"indexing ", b"chunk ", b"tail\n", b"0000", b"layer "];
    if rng.below(2) == 0 {
        return (0..len).map(|_| rng.next() as u8).collect();
    }
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[rng.below(WORDS.len() as u64) as usize]);
    }
    out.truncate(len);
    out
}

const MAX_LEN: u64 = 1 << 20;

fn ops(default: usize) -> usize {
    std::env::var("PLYFS_FSX_OPS").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn open_rw(p: &Path) -> File {
    OpenOptions::new().read(true).write(true).create(true).truncate(false).open(p).unwrap()
}

fn mmap_op(f: &File, offset: u64, data: Option<&[u8]>, len: usize) -> Vec<u8> {
    let page = 4096u64;
    let start = offset / page * page;
    let map_len = (offset - start) as usize + len;
    unsafe {
        let prot = if data.is_some() { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        let ptr = libc::mmap(std::ptr::null_mut(), map_len, prot, libc::MAP_SHARED, f.as_raw_fd(), start as i64);
        assert_ne!(ptr, libc::MAP_FAILED, "mmap failed: {}", std::io::Error::last_os_error());
        let bytes = std::slice::from_raw_parts_mut((ptr as *mut u8).add((offset - start) as usize), len);
        let out = match data {
            Some(d) => {
                bytes.copy_from_slice(d);
                libc::msync(ptr, map_len, libc::MS_SYNC);
                Vec::new()
            }
            None => bytes.to_vec(),
        };
        libc::munmap(ptr, map_len);
        out
    }
}

fn run_fsx(stack: &str, options: &[&str], default_ops: usize) {
    run_fsx_on(&format!("[{stack}] {options:?}"), || Mount::with(stack, options), default_ops, &[]);
}

/// fsx on a crypt volume (made with `init_args`) mounted with `stack`.
fn run_fsx_crypt(stack: &str, init_args: &[&str], default_ops: usize) {
    run_fsx_on(&format!("[{stack}] on a crypt volume {init_args:?}"), || Mount::crypt(stack, init_args, &[]), default_ops, &[]);
}

/// fsx on `stack` with a second branch (`--branch DIR=MODE`); the file starts there, holding
/// `initial`, when that is not empty.
fn run_fsx_fan_out(stack: &str, mode: &str, initial: &[u8], default_ops: usize) {
    run_fsx_fan_out_with(stack, mode, initial, default_ops, false)
}

/// The same; with `reader`, a second descriptor, read-only and opened before the writer at
/// every reopen, serves half of the reads (a cache then serves it from its copy).
fn run_fsx_fan_out_with(stack: &str, mode: &str, initial: &[u8], default_ops: usize, reader: bool) {
    let mount = || {
        let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (lower, second, mnt) = (root.join("lower"), root.join("second"), root.join("mnt"));
        for d in [&lower, &second, &mnt] {
            std::fs::create_dir(d).unwrap();
        }
        if !initial.is_empty() {
            std::fs::write(second.join("fsx"), initial).unwrap();
        }
        let branch = format!("--branch={}={mode}", second.display());
        Mount::start(dir, lower, mnt, stack, &[&branch])
    };
    run_fsx_on_with(&format!("[{stack}] over a {mode} branch"), mount, default_ops, initial, reader);
}

/// fsx: random writes, appends, truncates, reads and mmaps of one file, each checked against
/// the same done to a reference file, which starts holding `initial`.
fn run_fsx_on(what: &str, mount: impl FnOnce() -> Mount, default_ops: usize, initial: &[u8]) {
    run_fsx_on_with(what, mount, default_ops, initial, false)
}

fn run_fsx_on_with(what: &str, mount: impl FnOnce() -> Mount, default_ops: usize, initial: &[u8], with_reader: bool) {
    let seed = rng::seed("PLYFS_FSX_SEED");
    let count = ops(default_ops);
    eprintln!("fsx on {what}: {count} operations");
    let mut rng = Rng(seed);
    let reference_dir = tempfile::tempdir().unwrap();
    let reference_path = reference_dir.path().join("ref");
    let mut mount = mount();
    let mut ours = open_rw(&mount.path("fsx"));
    let open_reader = |m: &Mount| with_reader.then(|| File::open(m.path("fsx")).unwrap());
    let mut reader: Option<File> = None;
    let reference = open_rw(&reference_path);
    reference.write_all_at(initial, 0).unwrap();
    let mut size: u64 = initial.len() as u64;
    let mut history: Vec<String> = Vec::new();

    for i in 0..count {
        let choice = rng.below(100);
        let desc;
        match choice {
            0..=29 => {
                let off = rng.below(MAX_LEN);
                let len = 1 + rng.below(64 * 1024) as usize;
                let data = data(&mut rng, len);
                ours.write_all_at(&data, off).unwrap();
                reference.write_all_at(&data, off).unwrap();
                size = size.max(off + len as u64);
                desc = format!("write {off}+{len}");
            }
            30..=37 => {
                let len = 1 + rng.below(10_000) as usize;
                let data = data(&mut rng, len);
                let mut a = OpenOptions::new().append(true).open(mount.path("fsx")).unwrap();
                std::io::Write::write_all(&mut a, &data).unwrap();
                reference.write_all_at(&data, size).unwrap();
                size += len as u64;
                desc = format!("append {len}");
            }
            38..=45 => {
                let new = rng.below(MAX_LEN + 100_000);
                ours.set_len(new).unwrap();
                reference.set_len(new).unwrap();
                size = new;
                desc = format!("truncate {new}");
            }
            72..=75 => {
                // Punch a hole, or zero a range (keeping the size, or growing it), as fallocate
                // does: whole chunks of an encoded file become holes, the edges zeros.
                let off = rng.below(size + 1000);
                let len = 1 + rng.below(80_000);
                let mode = [
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                    libc::FALLOC_FL_ZERO_RANGE,
                ][rng.below(3) as usize];
                let fallocate = |f: &File| unsafe { libc::fallocate(f.as_raw_fd(), mode, off as i64, len as i64) };
                desc = format!("fallocate mode {mode:#x} {off}+{len}");
                if fallocate(&ours) == 0 {
                    assert_eq!(fallocate(&reference), 0, "{desc} on the reference: {}", std::io::Error::last_os_error());
                    if mode & libc::FALLOC_FL_KEEP_SIZE == 0 {
                        size = size.max(off + len);
                    }
                } else {
                    // A stack that cannot (EOPNOTSUPP) leaves the file alone; the reference too.
                    let err = std::io::Error::last_os_error();
                    assert_eq!(err.raw_os_error(), Some(libc::EOPNOTSUPP), "{desc}: {err}");
                }
            }
            46..=71 => {
                let off = rng.below(size + 1000);
                let len = 1 + rng.below(100_000) as usize;
                let mut a = vec![0u8; len];
                let mut b = vec![0u8; len];
                let by_reader = reader.is_some() && rng.below(2) == 0;
                let n = read_at(if by_reader { reader.as_ref().unwrap() } else { &ours }, &mut a, off);
                let m = read_at(&reference, &mut b, off);
                desc = format!("read {off}+{len}{}", if by_reader { " (reader)" } else { "" });
                check(seed, i, &desc, &history, &a[..n], &b[..m], off);
            }
            76..=81 if size > 0 => {
                let off = rng.below(size);
                let len = 1 + rng.below((size - off).min(50_000)) as usize;
                let a = mmap_op(&ours, off, None, len);
                let mut b = vec![0u8; len];
                reference.read_exact_at(&mut b, off).unwrap();
                desc = format!("mmap read {off}+{len}");
                check(seed, i, &desc, &history, &a, &b, off);
            }
            82..=86 if size > 0 => {
                let off = rng.below(size);
                let len = 1 + rng.below((size - off).min(20_000)) as usize;
                let data = data(&mut rng, len);
                mmap_op(&ours, off, Some(&data), len);
                reference.write_all_at(&data, off).unwrap();
                desc = format!("mmap write {off}+{len}");
            }
            87..=90 => {
                ours.sync_all().unwrap();
                desc = "fsync".into();
            }
            91..=97 => {
                drop(ours);
                drop(reader.take());
                reader = open_reader(&mount);
                ours = open_rw(&mount.path("fsx"));
                desc = "close and reopen".into();
            }
            _ => {
                drop(ours);
                drop(reader.take());
                mount = mount.remount();
                reader = open_reader(&mount);
                ours = open_rw(&mount.path("fsx"));
                desc = "remount".into();
            }
        }
        if history.len() == 20 {
            history.remove(0);
        }
        history.push(format!("#{i} {desc}"));
    }
    // The whole file, at the end and after a final remount.
    drop(ours);
    drop(reader);
    let mount = mount.remount();
    let a = std::fs::read(mount.path("fsx")).unwrap();
    let b = std::fs::read(&reference_path).unwrap();
    check(seed, count, "final compare after remount", &history, &a, &b, 0);
}

fn read_at(f: &File, buf: &mut [u8], off: u64) -> usize {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64).unwrap() {
            0 => break,
            n => done += n,
        }
    }
    done
}

fn check(seed: u64, i: usize, what: &str, history: &[String], got: &[u8], want: &[u8], base: u64) {
    if got == want {
        return;
    }
    let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
    panic!(
        "fsx mismatch at op #{i} ({what}): {} bytes read, {} expected, first difference at file offset {}\n\
         reproduce with PLYFS_FSX_SEED={seed}\nlast operations:\n  {}",
        got.len(),
        want.len(),
        base + at as u64,
        history.join("\n  ")
    );
}

#[test]
fn fsx_null_passthrough() {
    run_fsx("null", &[], 400);
}

#[test]
fn fsx_null_cached() {
    run_fsx("null", &["passthrough=off"], 400);
}

// Requests over /dev/fuse: where the kernel allows FUSE io_uring (scripts/test.sh gives its
// permission), the other mounts use it by default.
#[test]
fn fsx_null_cached_over_dev_fuse() {
    run_fsx("null", &["passthrough=off", "io_uring=off"], 400);
}

#[test]
fn fsx_zstd_over_dev_fuse() {
    run_fsx("zstd:fast_tails=on", &["io_uring=off"], 250);
}

#[test]
fn fsx_crypt_over_dev_fuse() {
    run_fsx_on("[crypt] on a crypt volume, io_uring=off", || Mount::crypt("crypt", &[], &["io_uring=off"]), 250, &[]);
}

#[test]
fn fsx_trace_observing_all_io() {
    run_fsx("trace:io=on,null", &[], 400);
}

/// One test per size-changing layer, fast tails off and on, 4 KiB and 64 KiB chunks.
macro_rules! fsx_sca {
    ($($name:ident: $stack:literal,)*) => {
        $(
            #[test]
            fn $name() {
                run_fsx($stack, &[], 250);
            }
        )*
    };
}

fsx_sca! {
    fsx_copy_4k: "copy",
    fsx_copy_4k_fast_tails: "copy:fast_tails=on",
    fsx_copy_64k: "copy:chunk=64k",
    fsx_copy_64k_fast_tails: "copy:chunk=64k:fast_tails=on",
    fsx_uuencode_4k: "uuencode",
    fsx_uuencode_4k_fast_tails: "uuencode:fast_tails=on",
    fsx_uuencode_64k: "uuencode:chunk=64k",
    fsx_uuencode_64k_fast_tails: "uuencode:chunk=64k:fast_tails=on",
    fsx_gzip_4k: "gzip",
    fsx_gzip_4k_fast_tails: "gzip:fast_tails=on",
    fsx_gzip_64k: "gzip:chunk=64k",
    fsx_gzip_64k_fast_tails: "gzip:chunk=64k:fast_tails=on",
    fsx_zstd_4k: "zstd",
    fsx_zstd_4k_fast_tails: "zstd:fast_tails=on",
    fsx_zstd_64k: "zstd:chunk=64k",
    fsx_zstd_64k_fast_tails: "zstd:chunk=64k:fast_tails=on",
    fsx_lz4_4k: "lz4",
    fsx_lz4_4k_fast_tails: "lz4:fast_tails=on",
    fsx_lz4_64k: "lz4:chunk=64k",
    fsx_lz4_64k_fast_tails: "lz4:chunk=64k:fast_tails=on",
    fsx_zstd_over_copy: "zstd:fast_tails=on,copy:chunk=64k",
}

// Authenticated encryption (fast tails are refused: they would leave plaintext below), alone and
// with a compressor collapsed into it, on both ciphers.

#[test]
fn fsx_crypt_4k() {
    run_fsx_crypt("crypt", &[], 250);
}

#[test]
fn fsx_crypt_padded() {
    run_fsx_crypt("crypt:pad=padme", &[], 250);
}

#[test]
fn fsx_crypt_xchacha_64k() {
    run_fsx_crypt("crypt:chunk=64k", &["--cipher", "xchacha20-poly1305"], 250);
}

#[test]
fn fsx_zstd_crypt_4k() {
    run_fsx_crypt("zstd,crypt", &[], 250);
}

#[test]
fn fsx_zstd_crypt_64k() {
    run_fsx_crypt("zstd:chunk=64k,crypt", &[], 250);
}

// The fan-out and operation-transforming layers: a union whose file starts on its read-only
// branch (the first change copies it up), a mirror, and versioning (over a compressor too).

#[test]
fn fsx_union_file_starting_on_the_read_only_branch() {
    let initial: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    run_fsx_fan_out("union", "ro", &initial, 300);
}

// A cache whose file starts on the slow branch, with a reader beside the writer (so the copy is
// read by passthrough while the writer writes), in both write modes.

#[test]
fn fsx_cache_write_through() {
    let initial: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    run_fsx_fan_out_with("cache:range=64k", "rw", &initial, 400, false);
}

#[test]
fn fsx_cache_write_through_with_a_reader() {
    let initial: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    run_fsx_fan_out_with("cache:range=64k", "rw", &initial, 400, true);
}

#[test]
fn fsx_cache_write_back() {
    let initial: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    run_fsx_fan_out_with("cache:mode=write-back:delay=0s:range=64k", "rw", &initial, 400, true);
}

/// fsx on a cache whose slow branch is a `plyfs serve` over a Unix socket.
fn run_fsx_cache_over_server(stack: &str) {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (slow, fast, mnt) = (root.join("slow"), root.join("fast"), root.join("mnt"));
    for d in [&slow, &fast, &mnt] {
        std::fs::create_dir(d).unwrap();
    }
    let initial: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(slow.join("fsx"), &initial).unwrap();
    let sock = root.join("slow.sock");
    let server = common::Server::start(&slow, &format!("unix:{}", sock.display()), &["--stack", "null"], &root.join("server.log"));
    let spec = format!("{stack}[@{} | remote:addr=unix:{}]", fast.display(), sock.display());
    let mount = || Mount::start(dir, std::path::PathBuf::from("-"), mnt, &spec, &[]);
    run_fsx_on_with(&format!("[{stack}] over a server"), mount, 300, &initial, true);
    drop(server);
}

#[test]
fn fsx_cache_write_through_over_a_server() {
    run_fsx_cache_over_server("cache:range=64k");
}

#[test]
fn fsx_cache_write_back_over_a_server() {
    run_fsx_cache_over_server("cache:mode=write-back:delay=0s:range=64k");
}

#[test]
fn fsx_mirror() {
    run_fsx_fan_out("mirror", "rw", &[], 300);
}

#[test]
fn fsx_version() {
    run_fsx("version:keep=3", &[], 300);
}

#[test]
fn fsx_version_over_zstd() {
    run_fsx("version:keep=3,zstd", &[], 250);
}

/// fsx on `stack` ending in `remote`, served by a `plyfs serve` over a Unix socket that
/// outlives the test's remounts.
/// A stack with `crypt` decrypts a crypt volume that the server serves as stored.
fn run_fsx_remote(stack: &str, default_ops: usize) {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let lower = root.join("lower");
    std::fs::create_dir(&lower).unwrap();
    let addr = format!("unix:{}", root.join("s.sock").display());
    let crypt = stack.split(',').any(|l| l == "crypt");
    let passfile = crypt.then(|| format!("--passfile={}", common::crypt_init(&root, &lower, &[]).display()));
    let serve_args: &[&str] = if crypt { &["--as-stored"] } else { &[] };
    let server = common::Server::start(&lower, &addr, serve_args, &root.join("server.log"));
    let mount = || {
        let mdir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
        let mnt = mdir.path().canonicalize().unwrap().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let options: Vec<&str> = passfile.iter().map(String::as_str).collect();
        Mount::start(mdir, std::path::PathBuf::from(&addr), mnt, stack, &options)
    };
    run_fsx_on(&format!("[{stack}] served on {addr}"), mount, default_ops, &[]);
    assert!(!server.log_text().contains("panick"), "{}", server.log_text());
}

#[test]
fn fsx_zstd_over_remote() {
    run_fsx_remote("zstd,remote", 400);
}

/// The kernel's own writes, sent ahead by the remote layer: overlapping writes, reads and
/// truncations must still come in order.
#[test]
fn fsx_remote_with_writes_sent_ahead() {
    run_fsx_remote("remote", 400);
}

/// End-to-end encryption: the server holds the volume without its key.
#[test]
fn fsx_crypt_over_remote_served_as_stored() {
    run_fsx_remote("zstd,crypt,remote", 300);
}

/// fsx on `stack` over exofs, on an exodisk volume served by a `plyfs exodisk serve` that outlives
/// the test's remounts.
fn run_fsx_exofs(stack: &str, default_ops: usize) {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/var/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let img = root.join("v.img");
    let out = common::run(common::plyfs().args(["exodisk", "format"]).arg(&img).args(["--size", "256M"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let sock = root.join("s.sock");
    let log = std::fs::File::create(root.join("server.log")).unwrap();
    let mut server = common::plyfs()
        .args(["exodisk", "serve"])
        .arg(&img)
        .arg("--socket")
        .arg(&sock)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
            let _ = self.0.wait();
        }
    }
    let _guard = Kill(&mut server);
    for _ in 0..1000 {
        if std::os::unix::net::UnixStream::connect(&sock).is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let lower = format!("exodisk:{}", sock.display());
    let mount = || {
        let mdir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
        let mnt = mdir.path().canonicalize().unwrap().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        Mount::start(mdir, std::path::PathBuf::from(&lower), mnt, stack, &[])
    };
    run_fsx_on(&format!("[{stack}] on {lower}"), mount, default_ops, &[]);
}

#[test]
fn fsx_exofs() {
    run_fsx_exofs("null", 400);
}

#[test]
fn fsx_zstd_over_exofs() {
    run_fsx_exofs("zstd", 300);
}

/// An example of `examples/python`, by its file name, as a `py:script=` layer.
fn python_example(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/python").join(name);
    format!("py:script={}", path.canonicalize().unwrap().display())
}

#[test]
fn fsx_python_rot13_codec() {
    run_fsx(&python_example("rot13.py"), &[], 300);
}

#[test]
fn fsx_python_zlib_codec() {
    run_fsx(&format!("{}:level=1", python_example("zlib_codec.py")), &[], 300);
}

#[test]
fn fsx_python_audit_layer_over_zstd() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.jsonl");
    run_fsx(&format!("{}:log={},zstd", python_example("audit.py"), log.display()), &[], 200);
    let lines = std::fs::read_to_string(&log).unwrap();
    assert!(lines.lines().any(|l| l.contains("\"path\": \"fsx\"")), "{lines}");
}
