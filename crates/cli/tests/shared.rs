//! Shared lowers (`-o shared`, issue #13): two mounts over one lower tree, on the local ext4 and
//! on GlusterFS with one client per mount (as two machines would have), for `zstd`,
//! `gzip:fast_tails=on`, `crypt` and a tree whose directories choose their own layers.
//!
//! After each workload every byte is accounted for, both mounts read the same bytes, `verify`
//! finds every file sound through both, and `plyfs fsck` finds the lower tree sound.
//!
//! GlusterFS comes from `scripts/gluster.sh`: used if it is up, else brought up for this test
//! binary and taken down when it exits.

mod common;

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{crypt_init, op_json, plyfs, run, Mount};

/// Where the two mounts' lower directories are.
#[derive(Clone, Copy, Debug)]
enum Place {
    /// One directory of the local file system (ext4 here), for both.
    Local,
    /// One directory of a GlusterFS volume, seen through a different client by each mount.
    Gluster,
}

const STACKS: &[&str] = &["zstd", "gzip:fast_tails=on", "crypt", "mixed"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

extern "C" fn gluster_down() {
    let _ = std::process::Command::new(repo_root().join("scripts/gluster.sh")).arg("down").output();
}

/// The GlusterFS volume's two client mounts.
fn gluster() -> &'static (PathBuf, PathBuf) {
    static MOUNTS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    MOUNTS.get_or_init(|| {
        let script = repo_root().join("scripts/gluster.sh");
        let status = run(std::process::Command::new(&script).arg("status"));
        let up_before = status.status.success();
        let out = run(std::process::Command::new(&script).arg("up"));
        assert!(out.status.success(), "scripts/gluster.sh up: {}", String::from_utf8_lossy(&out.stderr));
        if !up_before {
            unsafe { libc::atexit(gluster_down) };
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mounts: Vec<PathBuf> = text.lines().map(PathBuf::from).collect();
        assert!(mounts.len() >= 2, "scripts/gluster.sh up gave {text:?}");
        (mounts[0].clone(), mounts[1].clone())
    })
}

/// Two mounts of one lower directory, with `-o shared`.
struct Pair {
    // `b` goes first: `a` owns the directory both mount points are in.
    b: Mount,
    a: Mount,
    stack: &'static str,
    /// The lower directory as the first mount sees it, and the arguments of `fsck`.
    lower: PathBuf,
    fsck_args: Vec<String>,
    /// The lower directory on the GlusterFS volume, removed last (after both mounts went).
    _on_volume: Option<RemoveOnDrop>,
}

/// A directory removed with everything in it when this goes.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

impl Pair {
    fn new(place: Place, stack: &'static str) -> Pair {
        let dir = tempfile::Builder::new().prefix("plyfs-shared-").tempdir_in("/tmp").unwrap();
        let root = dir.path().canonicalize().unwrap();
        let name = root.file_name().unwrap().to_owned();
        let (lower_a, lower_b) = match place {
            Place::Local => (root.join("lower"), root.join("lower")),
            Place::Gluster => {
                let (g1, g2) = gluster();
                (g1.join(&name), g2.join(&name))
            }
        };
        fs::create_dir_all(&lower_a).unwrap();
        let on_volume = matches!(place, Place::Gluster).then(|| RemoveOnDrop(lower_a.clone()));
        wait_for(|| lower_b.is_dir(), "the lower directory through the second client");
        let (mnt_a, mnt_b) = (root.join("mnt-a"), root.join("mnt-b"));
        fs::create_dir(&mnt_a).unwrap();
        fs::create_dir(&mnt_b).unwrap();
        let mut options = vec!["shared".to_owned()];
        let mut fsck_args = vec!["--stack".to_owned(), mount_stack(stack).to_owned()];
        if stack == "crypt" {
            let passfile = crypt_init(&root, &lower_a, &[]);
            options.push(format!("--passfile={}", passfile.display()));
            fsck_args.push(format!("--passfile={}", passfile.display()));
        }
        let opts: Vec<&str> = options.iter().map(String::as_str).collect();
        let a = Mount::start(dir, lower_a.clone(), mnt_a, mount_stack(stack), &opts);
        if stack == "mixed" {
            // Directories that choose their layers, set before the second mount looks.
            for (d, layers) in [("z", "zstd"), ("g", "gzip:fast_tails=on"), ("p", "none")] {
                fs::create_dir(a.path(d)).unwrap();
                xattr_set(&a.path(d), "user.plyfs.layers", layers);
            }
        }
        let b = Mount::start(tempfile::tempdir().unwrap(), lower_b, mnt_b, mount_stack(stack), &opts);
        Pair { a, b, stack, lower: lower_a, fsck_args, _on_volume: on_volume }
    }

    /// The directory files of a workload go in: for the mixed tree, one per chain in turn.
    fn dir(&self, i: usize) -> &'static str {
        if self.stack == "mixed" {
            ["z", "g", "p"][i % 3]
        } else {
            "."
        }
    }

    /// Every file sound through both mounts, then both unmounted and the lower tree checked.
    fn finish(mut self, files: &[String]) {
        for f in files {
            let (pa, pb) = (self.a.path(f), self.b.path(f));
            let (ca, cb) = (fs::read(&pa).unwrap(), read_settled(&pb, &fs::read(&pa).unwrap()));
            assert!(ca == cb, "[{}] {f}: the mounts read different bytes ({} and {})", self.stack, ca.len(), cb.len());
            if encoded(self.stack, f) {
                for p in [&pa, &pb] {
                    let v = op_json(p, &["verify"]);
                    assert_eq!(v["ok"], true, "[{}] verify {}: {v}", self.stack, p.display());
                }
            }
        }
        self.b.unmount();
        self.a.unmount();
        let out = run(plyfs().arg("fsck").arg(&self.lower).args(&self.fsck_args));
        assert!(
            out.status.success(),
            "[{}] plyfs fsck: {}{}",
            self.stack,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn mount_stack(stack: &str) -> &str {
    if stack == "mixed" {
        "null"
    } else {
        stack
    }
}

fn encoded(stack: &str, file: &str) -> bool {
    stack != "mixed" || !file.starts_with("p/")
}

fn xattr_set(path: &Path, name: &str, value: &str) {
    let (p, n) = (common::cpath(path), std::ffi::CString::new(name).unwrap());
    let rc = unsafe { libc::setxattr(p.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    assert_eq!(rc, 0, "setxattr {name} on {}: {}", path.display(), std::io::Error::last_os_error());
}

fn wait_for(mut ok: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not there after 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The file's bytes through a mount, once they are `expected` (within the attribute timeout,
/// for what the other mount wrote last).
fn read_settled(path: &Path, expected: &[u8]) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        if got == expected || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Both mounts append lines to one file at once, each line by its own open, write and close
/// (`echo line >> file`): every line arrives once, whole.
fn appends(place: Place) {
    for &stack in STACKS {
        let pair = Pair::new(place, stack);
        let mut files = Vec::new();
        for round in 0..if stack == "mixed" { 3 } else { 1 } {
            let rel = format!("{}/log", pair.dir(round));
            // Enough that GlusterFS's own O_APPEND, placed at the end each client last saw,
            // overwrites records from two clients (it did in three runs of three).
            let per_mount = 200;
            std::thread::scope(|s| {
                for (who, m) in [("a", &pair.a), ("b", &pair.b)] {
                    let path = m.path(&rel);
                    s.spawn(move || {
                        for i in 0..per_mount {
                            let mut f = OpenOptions::new().append(true).create(true).open(&path).unwrap();
                            // Lines of varied length, so that appends cross chunk boundaries at
                            // different places.
                            // One write(2), as `echo` makes.
                            f.write_all(format!("{who} {i} {}\n", "x".repeat(i % 50)).as_bytes()).unwrap();
                        }
                    });
                }
            });
            let text = String::from_utf8(fs::read(pair.a.path(&rel)).unwrap()).unwrap();
            let mut lines: Vec<&str> = text.lines().collect();
            lines.sort();
            let mut want: Vec<String> =
                ["a", "b"].iter().flat_map(|w| (0..per_mount).map(move |i| format!("{w} {i} {}", "x".repeat(i % 50)))).collect();
            want.sort();
            let wrong: Vec<_> = lines.iter().zip(&want).filter(|(l, w)| *l != w).take(3).collect();
            assert!(
                lines == want,
                "[{stack} on {place:?}] {rel}: {} lines for {} written; first differences: {wrong:?}",
                lines.len(),
                want.len()
            );
            files.push(rel);
        }
        pair.finish(&files);
    }
}

/// Both mounts write blocks into one file at once, interleaved (blocks straddle chunk
/// boundaries, so both rewrite the same chunks), and files of their own into one directory.
fn chunks(place: Place) {
    const BLOCK: usize = 6000;
    const BLOCKS: usize = 48;
    for &stack in STACKS {
        let pair = Pair::new(place, stack);
        let rel = format!("{}/blocks", pair.dir(0));
        fs::write(pair.a.path(&rel), b"").unwrap();
        wait_for(|| pair.b.path(&rel).exists(), "the file through the second mount");
        let block = |i: usize| -> Vec<u8> { (0..BLOCK).map(|j| (i * 31 + j / 97) as u8).collect() };
        std::thread::scope(|s| {
            for (who, m) in [(0usize, &pair.a), (1, &pair.b)] {
                let (path, block) = (m.path(&rel), &block);
                s.spawn(move || {
                    let f = OpenOptions::new().write(true).open(&path).unwrap();
                    // Back to front, so the file grows by holes as well as by appends.
                    for i in (0..BLOCKS).rev().filter(|i| i % 2 == who) {
                        f.write_all_at(&block(i), (i * BLOCK) as u64).unwrap();
                    }
                });
                for k in 0..8 {
                    let path = m.path(&format!("{}/own-{who}-{k}", pair.dir(k)));
                    s.spawn(move || fs::write(&path, format!("file {k} of mount {who}\n").repeat(300 + k)).unwrap());
                }
            }
        });
        let want: Vec<u8> = (0..BLOCKS).flat_map(block).collect();
        let got = read_settled(&pair.a.path(&rel), &want);
        assert!(got == want, "[{stack} on {place:?}] {rel}: {} bytes, not the {} written", got.len(), want.len());
        let mut files = vec![rel];
        for who in 0..2 {
            for k in 0..8 {
                let rel = format!("{}/own-{who}-{k}", pair.dir(k));
                let want = format!("file {k} of mount {who}\n").repeat(300 + k);
                for m in [&pair.a, &pair.b] {
                    let got = read_settled(&m.path(&rel), want.as_bytes());
                    assert!(got == want.as_bytes(), "[{stack} on {place:?}] {rel} through {}", m.mnt.display());
                }
                files.push(rel);
            }
        }
        pair.finish(&files);
    }
}

/// One mount appends records while the other reads the file in a loop: every read is a
/// prefix of what is being written (never torn, never garbage), and the last read is all of it.
fn writer_and_reader(place: Place) {
    const RECORDS: usize = 150;
    for &stack in STACKS {
        let pair = Pair::new(place, stack);
        let rel = format!("{}/journal", pair.dir(1));
        let record = |i: usize| format!("record {i:05} {}\n", "=".repeat(i % 40));
        let all: String = (0..RECORDS).map(record).collect();
        fs::write(pair.a.path(&rel), b"").unwrap();
        wait_for(|| pair.b.path(&rel).exists(), "the file through the second mount");
        let done = std::sync::atomic::AtomicBool::new(false);
        let reads = std::thread::scope(|s| {
            let (path, record, done) = (pair.a.path(&rel), &record, &done);
            s.spawn(move || {
                for i in 0..RECORDS {
                    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
                    f.write_all(record(i).as_bytes()).unwrap();
                }
                done.store(true, std::sync::atomic::Ordering::SeqCst);
            });
            let mut reads = 0;
            let reader = pair.b.path(&rel);
            loop {
                let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                let got = fs::read(&reader).unwrap_or_else(|e| panic!("[{stack}] read {}: {e}", reader.display()));
                assert!(
                    all.as_bytes().starts_with(&got),
                    "[{stack} on {place:?}] read {reads} of {} bytes is not a prefix of what was written",
                    got.len()
                );
                reads += 1;
                if finished {
                    break reads;
                }
            }
        });
        assert!(reads > 1, "[{stack}] the reader never ran alongside the writer");
        let got = read_settled(&pair.b.path(&rel), all.as_bytes());
        assert!(got == all.as_bytes(), "[{stack} on {place:?}] the reader's last read has {} of {} bytes", got.len(), all.len());
        pair.finish(&[rel]);
    }
}

/// The lower lock (#29) reaches across GlusterFS clients: while a mount through one client holds
/// a directory alone, a mount of it through the other, shared or not, is refused and names it.
#[test]
fn a_lower_held_through_one_gluster_client_is_refused_through_the_other() {
    let (g1, g2) = gluster();
    let dir = tempfile::Builder::new().prefix("plyfs-shared-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let name = root.file_name().unwrap().to_owned();
    let (lower_a, lower_b) = (g1.join(&name), g2.join(&name));
    fs::create_dir_all(&lower_b).unwrap();
    let _on_volume = RemoveOnDrop(lower_b.clone());
    wait_for(|| lower_a.is_dir(), "the lower directory through the first client");
    let (mnt_a, mnt_b) = (root.join("mnt-a"), root.join("mnt-b"));
    fs::create_dir(&mnt_a).unwrap();
    fs::create_dir(&mnt_b).unwrap();
    let b = Mount::start(tempfile::tempdir().unwrap(), lower_b, mnt_b, "zstd", &[]);
    for shared in [&[][..], &["-o", "shared"][..]] {
        let out = run(plyfs().arg("mount").arg(&lower_a).arg(&mnt_a).args(["--stack", "zstd"]).args(shared));
        if common::mounted_fstype(&mnt_a).is_some() {
            run(plyfs().arg("umount").arg(&mnt_a));
        }
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(32), "in use: {shared:?}: {text}");
        let holder = format!("is in use by another plyfs (pid {} on ", b.pid());
        assert!(text.contains(&holder) && text.contains(&format!("mounted at {})", b.mnt.display())), "{shared:?}: {text}");
    }
}

#[test]
fn appends_from_two_mounts_all_arrive_local() {
    appends(Place::Local);
}

#[test]
fn appends_from_two_mounts_all_arrive_gluster() {
    appends(Place::Gluster);
}

#[test]
fn interleaved_chunk_writes_and_files_from_two_mounts_local() {
    chunks(Place::Local);
}

#[test]
fn interleaved_chunk_writes_and_files_from_two_mounts_gluster() {
    chunks(Place::Gluster);
}

#[test]
fn a_reader_sees_whole_prefixes_of_a_writer_on_the_other_mount_local() {
    writer_and_reader(Place::Local);
}

#[test]
fn a_reader_sees_whole_prefixes_of_a_writer_on_the_other_mount_gluster() {
    writer_and_reader(Place::Gluster);
}

/// Whether some process holds a lock on `path` that would keep a writer out.
fn locked(path: &Path) -> bool {
    let f = OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    let rc = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&f), libc::F_OFD_GETLK, &mut fl) };
    assert_eq!(rc, 0, "F_OFD_GETLK {}: {}", path.display(), std::io::Error::last_os_error());
    fl.l_type != libc::F_UNLCK as libc::c_short
}

/// A mount killed with SIGKILL in the middle of a change, its lock held: the other mount goes
/// on at once, nothing stays locked, and nothing the other mount was told was written is lost.
#[test]
fn a_mount_killed_holding_the_lock_leaves_nothing_locked() {
    let dir = tempfile::Builder::new().prefix("plyfs-shared-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let lower = root.join("lower");
    fs::create_dir(&lower).unwrap();
    let (mnt_a, mnt_b) = (root.join("mnt-a"), root.join("mnt-b"));
    fs::create_dir(&mnt_a).unwrap();
    fs::create_dir(&mnt_b).unwrap();
    // The first mount's writes to the lower file stall, inside its lock, until it is killed.
    let mut a = Mount::start(dir, lower.clone(), mnt_a, "zstd,fault", &["shared"]);
    let b = Mount::start(tempfile::tempdir().unwrap(), lower.clone(), mnt_b, "zstd", &["shared"]);
    fs::write(a.path("f"), "first line\n").unwrap();
    op_json(&a.path("f"), &["fault-add", "op=write", "delay=60s"]);
    let stalled = {
        let path = a.path("f");
        std::thread::spawn(move || OpenOptions::new().append(true).open(&path).and_then(|mut f| f.write_all(b"never acknowledged\n")))
    };
    wait_for(|| locked(&lower.join("f")), "the first mount's lock");
    unsafe { libc::kill(a.pid(), libc::SIGKILL) };
    a.wait_exit(Duration::from_secs(10)).expect("the killed daemon is gone");
    let started = Instant::now();
    let mut f = OpenOptions::new().append(true).open(b.path("f")).unwrap();
    f.write_all(b"second line\n").unwrap();
    drop(f);
    assert!(started.elapsed() < Duration::from_secs(5), "the second mount waited {:?} for the lock", started.elapsed());
    assert!(!locked(&lower.join("f")), "the lower file is still locked");
    assert_eq!(fs::read_to_string(b.path("f")).unwrap(), "first line\nsecond line\n");
    assert_eq!(op_json(&b.path("f"), &["verify"])["ok"], true);
    assert!(stalled.join().unwrap().is_err(), "the write of the killed mount should have failed");
}

/// What a path reads as now, or the error's kind.
fn content(path: &Path) -> Result<String, std::io::ErrorKind> {
    fs::read_to_string(path).map_err(|e| e.kind())
}

/// Files added, removed, renamed and rewritten in the lower directory itself, or through the
/// mount's view of a lower level (`MNT/.plyfs/NAME/`), show above within the attribute timeout
/// (1 s), plain and encoded alike, whether or not the mount shares its lower.
#[test]
fn direct_changes_to_the_lower_show_within_the_timeout() {
    const WITHIN: Duration = Duration::from_millis(1800);
    for options in [&[][..], &["shared"][..]] {
        // Plain files.
        let m = Mount::with("null", options);
        fs::write(m.path("f"), "one\n").unwrap();
        assert_eq!(content(&m.path("f")), Ok("one\n".into()));
        assert!(!m.path("new").exists(), "looked up (and remembered) as missing");
        fs::write(m.lower_path("f"), "two, longer\n").unwrap();
        fs::write(m.lower_path("new"), "added\n").unwrap();
        let start = Instant::now();
        wait_for(
            || content(&m.path("f")) == Ok("two, longer\n".into()) && content(&m.path("new")) == Ok("added\n".into()),
            "rewritten and added",
        );
        fs::rename(m.lower_path("f"), m.lower_path("g")).unwrap();
        fs::remove_file(m.lower_path("new")).unwrap();
        wait_for(
            || !m.path("f").exists() && !m.path("new").exists() && content(&m.path("g")) == Ok("two, longer\n".into()),
            "renamed and removed",
        );
        fs::write(m.path(".plyfs/null/h"), "through the view\n").unwrap();
        wait_for(|| content(&m.path("h")) == Ok("through the view\n".into()), "written through .plyfs/null/");
        assert!(start.elapsed() < 3 * WITHIN, "{options:?}: the changes took {:?} to show", start.elapsed());
        drop(m);

        // An encoded file replaced in the lower by another encoded file (as a restore from a
        // backup would), and one replaced by bytes the layer cannot decode.
        let m = Mount::with("zstd", options);
        let other = Mount::with("zstd", &[]);
        fs::write(m.path("e"), "the first version\n").unwrap();
        assert_eq!(content(&m.path("e")), Ok("the first version\n".into()));
        fs::write(other.path("e"), "the second version, from elsewhere\n").unwrap();
        drop(other.path("e"));
        let encoded = fs::read(other.lower_path("e")).unwrap();
        fs::write(m.lower_path("e.tmp"), &encoded).unwrap();
        fs::rename(m.lower_path("e.tmp"), m.lower_path("e")).unwrap();
        wait_for(
            || content(&m.path("e")) == Ok("the second version, from elsewhere\n".into()),
            &format!("an encoded file replaced in the lower (reads {:?}; {})", content(&m.path("e")), m.daemon_log()),
        );
        // Bytes no codec wrote: a plain file now, served as it is where the mount looks at the
        // file again (-o shared), `EIO` where it still holds it as encoded; never the old text.
        fs::write(m.lower_path("e"), "not zstd at all").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while content(&m.path("e")).is_ok_and(|c| c != "not zstd at all") {
            assert!(
                Instant::now() < deadline,
                "{options:?}: the rewritten lower file does not show after 10 s (reads {:?}, stat {:?}; lower {:?}; {})",
                content(&m.path("e")),
                fs::metadata(m.path("e")).map(|m| (m.len(), m.modified().ok())),
                fs::metadata(m.lower_path("e")).map(|m| (m.len(), m.modified().ok())),
                m.daemon_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        match fs::read(m.path("e")) {
            Ok(bytes) => assert_eq!(bytes, b"not zstd at all", "{options:?}"),
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{options:?}: {e}"),
        }
    }
}

/// Two mounts that encode here and store through one `plyfs serve` (`zstd,remote`): the locks
/// travel to the server, which holds them for each connection, so appends from both all arrive;
/// and a client that goes away leaves nothing locked.
#[test]
fn appends_through_one_server_from_two_client_mounts_all_arrive() {
    let dir = tempfile::Builder::new().prefix("plyfs-shared-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let lower = root.join("lower");
    fs::create_dir(&lower).unwrap();
    let addr = format!("unix:{}", root.join("s.sock").display());
    let _server = common::Server::start(&lower, &addr, &[], &root.join("server.log"));
    let (mnt_a, mnt_b) = (root.join("mnt-a"), root.join("mnt-b"));
    fs::create_dir(&mnt_a).unwrap();
    fs::create_dir(&mnt_b).unwrap();
    let a = Mount::start(dir, PathBuf::from(&addr), mnt_a, "zstd,remote", &["shared"]);
    let mut b = Mount::start(tempfile::tempdir().unwrap(), PathBuf::from(&addr), mnt_b, "zstd,remote", &["shared"]);
    let per_mount = 100;
    std::thread::scope(|s| {
        for (who, m) in [("a", &a), ("b", &b)] {
            let path = m.path("log");
            s.spawn(move || {
                for i in 0..per_mount {
                    let mut f = OpenOptions::new().append(true).create(true).open(&path).unwrap();
                    f.write_all(format!("{who} {i}\n").as_bytes()).unwrap();
                }
            });
        }
    });
    let text = fs::read_to_string(a.path("log")).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort();
    let mut want: Vec<String> = ["a", "b"].iter().flat_map(|w| (0..per_mount).map(move |i| format!("{w} {i}"))).collect();
    want.sort();
    assert!(lines == want, "{} lines for {} written", lines.len(), want.len());
    assert_eq!(op_json(&a.path("log"), &["verify"])["ok"], true);
    // A client killed while it holds the lock (its connection drops): the other goes on.
    op_json(&b.path("log"), &["verify"]);
    let stalled = {
        let path = b.path("log");
        std::thread::spawn(move || {
            // Holds the file's write lock on the server while the first append is being made.
            OpenOptions::new().append(true).open(&path).and_then(|mut f| f.write_all(b"from the killed client\n"))
        })
    };
    unsafe { libc::kill(b.pid(), libc::SIGKILL) };
    let _ = stalled.join();
    b.wait_exit(Duration::from_secs(10)).expect("the killed client is gone");
    let started = Instant::now();
    let mut f = OpenOptions::new().append(true).open(a.path("log")).unwrap();
    f.write_all(b"after the kill\n").unwrap();
    drop(f);
    assert!(started.elapsed() < Duration::from_secs(5), "the surviving client waited {:?}", started.elapsed());
    assert!(fs::read_to_string(a.path("log")).unwrap().ends_with("after the kill\n"));
}

/// On a shared mount over a local lower, changes made behind its back show at once, however
/// long the timeouts: the lower directory is watched (fanotify), and the mount's own changes
/// are not taken for outside ones.
#[test]
fn direct_changes_show_at_once_on_a_shared_mount_of_a_local_lower() {
    let m = Mount::with("null", &["shared", "attr_timeout=60", "entry_timeout=60"]);
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/f"), "one\n").unwrap();
    assert_eq!(content(&m.path("d/f")), Ok("one\n".into()));
    assert!(!m.path("d/new").exists());
    let quickly = |what: &str, ok: &dyn Fn() -> bool| {
        let start = Instant::now();
        while !ok() {
            assert!(start.elapsed() < Duration::from_secs(3), "{what}: not seen after 3 s (the timeouts are 60 s)");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    fs::write(m.lower_path("d/f"), "two, longer\n").unwrap();
    quickly("a file rewritten in the lower", &|| content(&m.path("d/f")) == Ok("two, longer\n".into()));
    fs::write(m.lower_path("d/new"), "added\n").unwrap();
    quickly("a file added in the lower", &|| content(&m.path("d/new")) == Ok("added\n".into()));
    fs::rename(m.lower_path("d/new"), m.lower_path("d/moved")).unwrap();
    quickly("a file renamed in the lower", &|| !m.path("d/new").exists() && m.path("d/moved").exists());
    fs::remove_file(m.lower_path("d/moved")).unwrap();
    quickly("a file removed in the lower", &|| !m.path("d/moved").exists());
    let names = |p: &Path| -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(p).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&m.path("d")), ["f"]);
    fs::write(m.lower_path("d/listed"), "").unwrap();
    quickly("a listing after a file added in the lower", &|| names(&m.path("d")) == ["f", "listed"]);
    // The mount's own work is not taken for outside changes: nothing in the log about it, and
    // its files stay as written.
    for i in 0..50 {
        fs::write(m.path(&format!("d/own-{i}")), format!("{i}\n")).unwrap();
    }
    for i in 0..50 {
        assert_eq!(content(&m.path(&format!("d/own-{i}"))), Ok(format!("{i}\n")));
    }
}

/// Two mounts, `-o shared`, of the local directory `lower` (made under `root`) with `stack` and
/// the options `extra`. Bound as `let (a, b)`, `b` goes first, as it must: `a` owns the
/// directory both mount points are in.
fn two_local(dir: tempfile::TempDir, lower: &Path, stack: &str, extra: &[&str]) -> (Mount, Mount) {
    let root = dir.path().canonicalize().unwrap();
    let (mnt_a, mnt_b) = (root.join("mnt-a"), root.join("mnt-b"));
    fs::create_dir(&mnt_a).unwrap();
    fs::create_dir(&mnt_b).unwrap();
    let opts: Vec<&str> = std::iter::once("shared").chain(extra.iter().copied()).collect();
    let a = Mount::start(dir, lower.to_owned(), mnt_a, stack, &opts);
    let b = Mount::start(tempfile::tempdir().unwrap(), lower.to_owned(), mnt_b, stack, &opts);
    (a, b)
}

/// Two mounts of a union over one upper branch and a read-only base write to the base's files
/// at once, each line by its own open (so each mount copies every file up when it first writes
/// it, unless it sees the other's copy). A copy-up never replaces the other mount's copy: every
/// line arrives, and the base stays as it was.
#[test]
fn union_copy_ups_from_two_mounts_lose_nothing() {
    const FILES: usize = 4;
    const LINES: usize = 60;
    let dir = tempfile::Builder::new().prefix("plyfs-shared-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (base, upper) = (root.join("base"), root.join("upper"));
    fs::create_dir_all(base.join("d")).unwrap();
    fs::create_dir(&upper).unwrap();
    for k in 0..FILES {
        fs::write(base.join(format!("d/f{k}")), "from the base\n").unwrap();
    }
    let branch = format!("--branch={}=ro", base.display());
    let (a, b) = two_local(dir, &upper, "union", &[&branch]);
    std::thread::scope(|s| {
        for (who, m) in [("a", &a), ("b", &b)] {
            s.spawn(move || {
                for i in 0..LINES {
                    for k in 0..FILES {
                        let mut f = OpenOptions::new().append(true).open(m.path(&format!("d/f{k}"))).unwrap();
                        f.write_all(format!("{who} {i}\n").as_bytes()).unwrap();
                    }
                }
            });
        }
    });
    let mut want: Vec<String> = ["a", "b"].iter().flat_map(|w| (0..LINES).map(move |i| format!("{w} {i}"))).collect();
    want.push("from the base".into());
    want.sort();
    for k in 0..FILES {
        let rel = format!("d/f{k}");
        let text = String::from_utf8(fs::read(a.path(&rel)).unwrap()).unwrap();
        assert_eq!(String::from_utf8(read_settled(&b.path(&rel), text.as_bytes())).unwrap(), text, "{rel}: the mounts differ");
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort();
        assert!(lines == want, "{rel}: {} lines of the {} written", lines.len(), want.len());
        assert!(text.starts_with("from the base\n"), "{rel}: the copy-up kept the base's content first");
        assert_eq!(fs::read_to_string(base.join(&rel)).unwrap(), "from the base\n", "{rel} in the base");
    }
}

/// Two mounts of a `version` stack rewrite one file at once (each open for writing keeps what
/// the file held): every version is kept under a number of its own, none replacing another
/// mount's. (The rewrites keep the length, so that no open finds the file empty, with nothing
/// to keep.)
#[test]
fn versions_saved_by_two_mounts_at_once_are_all_kept() {
    const ROUNDS: usize = 40;
    let dir = tempfile::Builder::new().prefix("plyfs-shared-").tempdir_in("/tmp").unwrap();
    let lower = dir.path().canonicalize().unwrap().join("lower");
    fs::create_dir(&lower).unwrap();
    let (a, b) = two_local(dir, &lower, "version:keep=0", &[]);
    fs::write(a.path("f"), "first\n").unwrap();
    wait_for(|| b.path("f").exists(), "the file through the second mount");
    std::thread::scope(|s| {
        for (who, m) in [("a", &a), ("b", &b)] {
            s.spawn(move || {
                for i in 0..ROUNDS {
                    let f = OpenOptions::new().write(true).open(m.path("f")).unwrap();
                    f.write_all_at(format!("{who} {i:03}\n").as_bytes(), 0).unwrap();
                }
            });
        }
    });
    let versions = op_json(&a.path("f"), &["versions"]);
    let list = versions.as_array().unwrap_or_else(|| panic!("versions: {versions}"));
    assert_eq!(list.len(), 2 * ROUNDS, "one version per overwrite: {versions}");
    let mut numbers: Vec<u64> = list.iter().map(|v| v["number"].as_u64().unwrap()).collect();
    numbers.dedup();
    assert_eq!(numbers.len(), 2 * ROUNDS, "distinct numbers: {versions}");
}

/// A file that another mount replaced (renaming a new file over it, or `plyfs policy apply`
/// re-encoding it) is stale to a mount that has it open: its writes fail with `ESTALE` rather than go to
/// a file no name leads to any more. Opened again, it is the new file.
#[test]
fn writes_to_a_file_another_mount_replaced_are_refused_not_lost() {
    let dir = tempfile::Builder::new().prefix("plyfs-shared-").tempdir_in("/tmp").unwrap();
    let lower = dir.path().canonicalize().unwrap().join("lower");
    fs::create_dir(&lower).unwrap();
    let (a, b) = two_local(dir, &lower, "zstd", &[]);
    fs::write(a.path("f"), "old\n").unwrap();
    wait_for(|| b.path("f").exists(), "the file through the second mount");
    let mut f = OpenOptions::new().append(true).open(b.path("f")).unwrap();
    f.write_all(b"from b\n").unwrap();
    fs::write(a.path("new"), "new\n").unwrap();
    fs::rename(a.path("new"), a.path("f")).unwrap();
    let err = f.write_all(b"lost?\n").expect_err("a write to the replaced file");
    assert_eq!(err.raw_os_error(), Some(libc::ESTALE), "{err}");
    drop(f);
    assert_eq!(read_settled(&b.path("f"), b"new\n"), b"new\n");
    // The same when `policy apply` in the first mount re-encodes a file the second has open.
    fs::write(a.path("p"), "zstd\n").unwrap();
    wait_for(|| b.path("p").exists(), "the file through the second mount");
    let mut f = OpenOptions::new().append(true).open(b.path("p")).unwrap();
    f.write_all(b"from b\n").unwrap();
    xattr_set(&a.path("p"), "user.plyfs.layers", "lz4");
    let out = run(plyfs().args(["policy", "apply"]).arg(a.path("p")));
    assert!(out.status.success(), "policy apply: {}", String::from_utf8_lossy(&out.stderr));
    let err = f.write_all(b"lost?\n").expect_err("a write to the re-encoded file's old copy");
    assert_eq!(err.raw_os_error(), Some(libc::ESTALE), "{err}");
    drop(f);
    assert_eq!(read_settled(&b.path("p"), b"zstd\nfrom b\n"), b"zstd\nfrom b\n");
    assert!(String::from_utf8_lossy(&run(plyfs().args(["policy", "explain"]).arg(b.path("p"))).stdout).contains("encoded with:  lz4"));
    // A file removed through the mount that has it open stays writable, as everywhere.
    let mut g = OpenOptions::new().create(true).append(true).open(b.path("g")).unwrap();
    g.write_all(b"one\n").unwrap();
    fs::remove_file(b.path("g")).unwrap();
    g.write_all(b"two\n").unwrap();
}

/// Every object under `root` but the mirror's own files and the lower lock, with what identifies its content.
/// Where two trees of `mirror_tree` differ, briefly: each name on one side only, and for each
/// file on both, the sizes and the first differing byte.
fn tree_difference(a: &std::collections::BTreeMap<String, String>, b: &std::collections::BTreeMap<String, String>) -> String {
    let mut out = Vec::new();
    for name in a.keys().chain(b.keys()).collect::<std::collections::BTreeSet<_>>() {
        match (a.get(name), b.get(name)) {
            (Some(x), Some(y)) if x != y => {
                let at = x.bytes().zip(y.bytes()).position(|(p, q)| p != q).unwrap_or(x.len().min(y.len()));
                let around = |s: &str| s.get(at.saturating_sub(8)..(at + 24).min(s.len())).unwrap_or("").to_owned();
                out.push(format!("{name}: {} and {} bytes described, first difference at {at} ({:?} / {:?})", x.len(), y.len(), around(x), around(y)));
            }
            (Some(_), None) => out.push(format!("{name}: only in the first")),
            (None, Some(_)) => out.push(format!("{name}: only in the second")),
            _ => {}
        }
    }
    out.join("; ")
}

fn mirror_tree(root: &Path) -> std::collections::BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut std::collections::BTreeMap<String, String>) {
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel.starts_with(".plyfs-mirror.") || rel == ".plyfs.lock" {
                continue;
            }
            let meta = fs::symlink_metadata(e.path()).unwrap();
            let what = if meta.is_dir() {
                walk(root, &e.path(), out);
                format!("dir {:o}", std::os::unix::fs::MetadataExt::mode(&meta))
            } else {
                format!(
                    "file {:o} {}",
                    std::os::unix::fs::MetadataExt::mode(&meta),
                    String::from_utf8_lossy(&fs::read(e.path()).unwrap())
                )
            };
            out.insert(rel, what);
        }
    }
    let mut out = std::collections::BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The logs of running or stopped shared mounts of a mirror in branch directory `dir`.
fn mirror_logs(dir: &Path) -> Vec<String> {
    let mut logs: Vec<String> = match fs::read_dir(dir.join(".plyfs-mirror.logs")) {
        Ok(entries) => entries.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => Vec::new(),
    };
    logs.sort();
    logs
}

/// A mirror of directories `a` and `b` under a new directory, mounted twice with `-o shared`.
fn shared_mirror() -> (PathBuf, PathBuf, Mount, Mount) {
    shared_mirror_of("mirror")
}

/// The same with `stack`, a spec whose top is the mirror.
fn shared_mirror_of(stack: &str) -> (PathBuf, PathBuf, Mount, Mount) {
    let dir = tempfile::Builder::new().prefix("plyfs-shared-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (da, db) = (root.join("a"), root.join("b"));
    fs::create_dir(&da).unwrap();
    fs::create_dir(&db).unwrap();
    let branch = format!("--branch={}", db.display());
    let (a, b) = two_local(dir, &da, stack, &[&branch]);
    (da, db, a, b)
}

/// Two mounts of one mirror change the same files and names at once. Every change runs under
/// a lock both honour, so both branches see the changes in one order: they end identical (the
/// overwrites of one place race to the branches without it), and no line, chunk or name is lost
/// or doubled. `scrub` refuses while the other mount runs.
#[test]
fn a_mirror_shared_by_two_mounts_keeps_its_branches_identical() {
    const ROUNDS: usize = 120;
    let (da, db, a, b) = shared_mirror();
    fs::write(a.path("chunks"), vec![b'.'; 2 * ROUNDS * 1024]).unwrap();
    std::thread::scope(|s| {
        for (who, m, half) in [("a", &a, 0), ("b", &b, 1)] {
            s.spawn(move || {
                let chunks = OpenOptions::new().write(true).open(m.path("chunks")).unwrap();
                for i in 0..ROUNDS {
                    let mut log = OpenOptions::new().create(true).append(true).open(m.path("log")).unwrap();
                    log.write_all(format!("{who} {i}\n").as_bytes()).unwrap();
                    chunks.write_all_at(&[who.as_bytes()[0]; 1024], ((2 * i + half) * 1024) as u64).unwrap();
                    // The same names from both mounts: the second to come finds what the first
                    // did, on every branch alike (errors are the race's and expected).
                    let k = i % 5;
                    let _ = fs::create_dir(m.path(&format!("d{k}")));
                    let _ = fs::write(m.path(&format!("d{k}/{who}{i}")), format!("{who} {i}\n"));
                    let _ = fs::rename(m.path(&format!("d{k}/{who}{i}")), m.path(&format!("n{k}")));
                    if i % 3 == 0 {
                        let _ = fs::remove_file(m.path(&format!("n{k}")));
                    }
                    if i % 7 == 0 {
                        let _ = fs::remove_dir_all(m.path(&format!("d{k}")));
                    }
                }
                // Overwrites of one place, large enough to reach the branches in parallel.
                let same = OpenOptions::new().create(true).write(true).open(m.path("same")).unwrap();
                for _ in 0..ROUNDS {
                    same.write_all_at(&vec![who.as_bytes()[0]; 300 << 10], 0).unwrap();
                }
            });
        }
    });
    let log = fs::read_to_string(a.path("log")).unwrap();
    let mut lines: Vec<&str> = log.lines().collect();
    lines.sort();
    let mut expected: Vec<String> = (0..ROUNDS).flat_map(|i| [format!("a {i}"), format!("b {i}")]).collect();
    expected.sort();
    assert_eq!(lines, expected, "every appended line, once");
    let chunks = fs::read(a.path("chunks")).unwrap();
    for (n, chunk) in chunks.chunks(1024).enumerate() {
        let who = if n % 2 == 0 { b'a' } else { b'b' };
        assert!(chunk.iter().all(|c| *c == who), "chunk {n} is not all {:?}", who as char);
    }
    let branch_a = mirror_tree(&da);
    let branch_b = mirror_tree(&db);
    if branch_a != branch_b {
        let why: Vec<String> = [&a, &b]
            .iter()
            .flat_map(|m| m.daemon_log().lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).map(str::to_owned).collect::<Vec<_>>())
            .collect();
        panic!("the branches differ: {}\nthe daemons said:\n{}", tree_difference(&branch_a, &branch_b), why.join("\n"));
    }
    assert_eq!(mirror_tree(&a.mnt), branch_a);
    assert_eq!(mirror_tree(&b.mnt), branch_a);
    assert_eq!(mirror_logs(&da).len(), 2, "one log per mount: {:?}", mirror_logs(&da));
    let out = run(plyfs().arg("op").arg(&a.mnt).arg("scrub"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("1 other mount(s) of this mirror are running"), "{err}");
    for m in [&a, &b] {
        let status = op_json(&m.mnt, &["mirror-status"]);
        let said: Vec<String> = m.daemon_log().lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).map(str::to_owned).collect();
        assert_eq!(status["degraded"], false, "{status}; the daemon said:\n{}", said.join("\n"));
    }
    // A mount without -o shared beside them is refused, in one line.
    let mnt_c = tempfile::tempdir().unwrap();
    let out =
        run(plyfs().arg("mount").arg(&da).arg(mnt_c.path()).args(["--stack", "mirror"]).arg(format!("--branch={}", db.display())));
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        run(plyfs().arg("umount").arg(mnt_c.path()));
    }
    assert!(!out.status.success() && err.contains("is in use by another plyfs") && err.contains("mount both with -o shared"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    drop(b);
    assert_eq!(mirror_logs(&da).len(), 1, "a mount that stops cleanly takes its log with it");
    assert_eq!(op_json(&a.mnt, &["scrub"])["repaired"].as_array().unwrap().len(), 0, "alone now, and nothing differs");
}

/// A name one mount is making is on the first branch before it is on the second. The other
/// mount, finding it there and opening it for writing meanwhile, waits for it to be on every
/// branch: it judged the second branch failed (the name missing there) and left it out.
#[test]
fn a_name_another_mount_is_making_is_on_every_branch_before_it_is_used() {
    let (da, db, a, b) = shared_mirror_of("mirror[|fault]");
    let out = run(plyfs().arg("op").arg(&a.mnt).args(["fault-add@mirror.1.fault", "op=create", "path=slow*", "delay=1500ms"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::thread::scope(|s| {
        s.spawn(|| drop(fs::File::create(a.path("slow")).unwrap()));
        let started = std::time::Instant::now();
        while !da.join("slow").exists() {
            assert!(started.elapsed() < Duration::from_secs(5), "the create never reached the first branch");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!db.join("slow").exists(), "the delay holds the create back from the second branch");
        let f = OpenOptions::new().write(true).open(b.path("slow")).unwrap();
        f.write_all_at(b"from b\n", 0).unwrap();
    });
    for m in [&a, &b] {
        let status = op_json(&m.mnt, &["mirror-status"]);
        assert_eq!(status["degraded"], false, "{status}; the daemon said:\n{}", m.daemon_log());
    }
    assert_eq!(fs::read_to_string(da.join("slow")).unwrap(), fs::read_to_string(db.join("slow")).unwrap());
    assert_eq!(fs::read_to_string(b.path("slow")).unwrap(), "from b\n");
}

/// A mount of a shared mirror killed with a change in flight (its write reached the first
/// branch; the second holds something else): the other mount takes its log over within
/// seconds, makes the file the same on both branches, and removes the log.
#[test]
fn a_killed_mirror_mount_is_taken_over_by_the_other() {
    let (da, db, mut a, b) = shared_mirror();
    fs::write(a.path("f"), "before\n").unwrap();
    let mut f = OpenOptions::new().write(true).open(a.path("f")).unwrap();
    f.write_all(b"after!\n").unwrap();
    assert_eq!(mirror_logs(&da).len(), 2);
    unsafe { libc::kill(a.pid(), libc::SIGKILL) };
    a.wait_exit(Duration::from_secs(10)).expect("the killed daemon is gone");
    drop(f);
    fs::write(db.join("f"), "stale!\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while mirror_logs(&da).len() > 1 || fs::read(db.join("f")).unwrap() != b"after!\n" {
        assert!(Instant::now() < deadline, "not taken over after 20 s: logs {:?}\n{}", mirror_logs(&da), b.daemon_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(b.daemon_log().contains("taking over the log"), "{}", b.daemon_log());
    assert_eq!(mirror_logs(&db).len(), 1, "{:?}", mirror_logs(&db));
    let mut f = OpenOptions::new().append(true).open(b.path("f")).unwrap();
    f.write_all(b"more\n").unwrap();
    drop(f);
    assert_eq!(fs::read_to_string(da.join("f")).unwrap(), "after!\nmore\n");
    assert_eq!(mirror_tree(&da), mirror_tree(&db));
}

/// A branch one mount finds failed is left out by the other within a second.
#[test]
fn a_branch_failed_in_one_mount_is_left_out_by_the_other() {
    let (_da, db, a, b) = shared_mirror();
    fs::write(a.path("f"), "one\n").unwrap();
    // The second branch goes: the first mount to change something finds it failed.
    fs::remove_dir_all(&db).unwrap();
    fs::write(a.path("g"), "two\n").unwrap();
    let failed = |m: &Mount| op_json(&m.mnt, &["mirror-status"])["degraded"] == true;
    assert!(failed(&a));
    wait_for(|| failed(&b), "the other mount leaving the branch out");
    assert!(b.daemon_log().contains("another mount found it failed"), "{}", b.daemon_log());
    fs::write(b.path("h"), "three\n").unwrap();
    assert_eq!(content(&a.path("h")), Ok("three\n".into()));
}

/// `lower-lock exclusive try` fails at once while another process holds the lower file's lock,
/// and takes it once the lock is free.
#[test]
fn a_tried_lock_does_not_wait() {
    let m = Mount::with("null", &["shared"]);
    fs::write(m.path("f"), "x").unwrap();
    let held = OpenOptions::new().read(true).write(true).open(m.lower_path("f")).unwrap();
    let set = |l_type: i32| {
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = l_type as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        let rc = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&held), libc::F_OFD_SETLK, &fl) };
        assert_eq!(rc, 0, "F_OFD_SETLK: {}", std::io::Error::last_os_error());
    };
    let tried = || run(plyfs().arg("op").arg(m.path("f")).args(["lower-lock", "exclusive", "try"]));
    set(libc::F_WRLCK);
    let started = Instant::now();
    let out = tried();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success() && err.contains("temporarily unavailable"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5), "it waited {:?}", started.elapsed());
    set(libc::F_UNLCK);
    let out = tried();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(locked(&m.lower_path("f")), "taken");
}

/// A user creates a file with mode 0 on a GlusterFS lower and writes it through the descriptor
/// the create gave, as POSIX allows (pjdfstest ftruncate and posix_fallocate do). The kernel's
/// passthrough would open the lower file again with the daemon's credentials, which GlusterFS
/// refuses by the permission bits even for root, and the create failed with EIO; such opens are
/// served by the daemon.
#[test]
fn a_file_a_user_creates_with_mode_0_is_written_through_its_descriptor_on_gluster() {
    let (g1, _) = gluster();
    let dir = tempfile::Builder::new().prefix("plyfs-shared-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let lower = g1.join(root.file_name().unwrap());
    fs::create_dir_all(&lower).unwrap();
    let _on_volume = RemoveOnDrop(lower.clone());
    let mnt = root.join("mnt");
    fs::create_dir(&mnt).unwrap();
    for options in [&["allow_other"][..], &["allow_other", "shared"][..]] {
        let m = Mount::start(tempfile::tempdir().unwrap(), lower.clone(), mnt.clone(), "null", options);
        let sub = m.path(&format!("sub-{}", options.len()));
        fs::create_dir(&sub).unwrap();
        fs::set_permissions(&sub, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        let script = "import os, sys\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\n\
                      fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0)\nos.ftruncate(fd, 3)\nos.pwrite(fd, b'abc', 0)\n";
        let out = run(std::process::Command::new("python3").arg("-c").arg(script).arg(sub.join("f")));
        assert!(out.status.success(), "{options:?}: {}\n{}", String::from_utf8_lossy(&out.stderr), m.daemon_log());
        assert_eq!(fs::read(sub.join("f")).unwrap(), b"abc", "{options:?}");
        drop(m);
    }
}
