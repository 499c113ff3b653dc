//! The lower lock (#29): a second user of a lower directory that would corrupt the first (an
//! unshared mount, `plyfs serve`, an offline tool that writes) is refused with one line naming
//! the holder, and the lock file is out of reach through every mount.

mod common;

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};

use common::{crypt_passfile, mounted_fstype, plyfs, run, scratch_dirs, Mount, Server};

const LOCK: &str = ".plyfs.lock";

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_owned()
}

/// Unmounts a mount point that a command expected to be refused mounted after all.
struct UnmountOnDrop(PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        if mounted_fstype(&self.0).is_some() {
            let _ = run(plyfs().arg("umount").arg(&self.0));
        }
    }
}

/// `plyfs mount LOWER MNT --stack STACK ARGS...` as a user runs it (a background daemon): its
/// output, with MNT unmounted again if it mounted.
fn mount_in_background(lower: &Path, mnt: &Path, stack: &str, args: &[&str]) -> (Output, UnmountOnDrop) {
    let guard = UnmountOnDrop(mnt.to_owned());
    let out = run(plyfs().arg("mount").arg(lower).arg(mnt).args(["--stack", stack]).args(args));
    (out, guard)
}

/// The refusal of a mount of `m`'s lower: exit status 32 (in use) and one line naming `m`'s daemon.
fn assert_refused_by(out: &Output, m: &Mount, advice: &str) {
    let text = stderr(out);
    let want = format!(
        "plyfs: lower {} is in use by another plyfs (pid {} on {}, mounted at {}); {advice}\n",
        m.lower.display(),
        m.pid(),
        hostname(),
        m.mnt.display()
    );
    assert_eq!(out.status.code(), Some(32), "in use: {text}");
    assert_eq!(text, want);
}

const MOUNT_ADVICE: &str = "unmount it, or mount both with -o shared";
const TOOL_ADVICE: &str = "unmount it (or wait for it to finish) first";

/// A second mount point in the test directory of `m`.
fn second_mountpoint(m: &Mount) -> PathBuf {
    let mnt = m.dir.path().canonicalize().unwrap().join("mnt-2");
    fs::create_dir_all(&mnt).unwrap();
    mnt
}

fn append_lines(path: &Path, from: usize, to: usize) {
    use std::io::Write;
    let mut f = fs::OpenOptions::new().append(true).create(true).open(path).unwrap();
    for i in from..to {
        writeln!(f, "line {i}").unwrap();
    }
}

fn lines(n: usize) -> String {
    (0..n).map(|i| format!("line {i}\n")).collect()
}

#[test]
fn a_second_unshared_mount_is_refused_and_the_first_keeps_working() {
    for stack in ["zstd", "crypt", "null"] {
        let m = if stack == "crypt" { Mount::crypt(stack, &[], &[]) } else { Mount::new(stack) };
        let passfile = format!("--passfile={}", crypt_passfile(m.dir.path()).display());
        let secret: &[&str] = if stack == "crypt" { &[&passfile] } else { &[] };
        append_lines(&m.path("log"), 0, 100);
        let mnt2 = second_mountpoint(&m);
        let (out, _guard) = mount_in_background(&m.lower, &mnt2, stack, secret);
        assert_refused_by(&out, &m, MOUNT_ADVICE);
        assert!(mounted_fstype(&mnt2).is_none(), "{stack}: nothing mounted");
        // A shared mount does not join an unshared one either.
        let shared: Vec<&str> = secret.iter().copied().chain(["-o", "shared"]).collect();
        let (out, _guard) = mount_in_background(&m.lower, &mnt2, stack, &shared);
        assert_refused_by(&out, &m, MOUNT_ADVICE);
        append_lines(&m.path("log"), 100, 300);
        assert_eq!(fs::read_to_string(m.path("log")).unwrap(), lines(300), "{stack}: the first mount keeps working");
    }
}

#[test]
fn an_unshared_mount_does_not_join_shared_ones_and_shared_ones_share() {
    let m = Mount::with("zstd", &["shared"]);
    let dir = tempfile::tempdir().unwrap();
    let b = Mount::start(dir, m.lower.clone(), second_mountpoint(&m), "zstd", &["shared"]);
    append_lines(&m.path("log"), 0, 10);
    append_lines(&b.path("log"), 10, 20);
    assert_eq!(fs::read_to_string(m.path("log")).unwrap(), lines(20), "both shared mounts write one file");
    let mnt3 = m.dir.path().canonicalize().unwrap().join("mnt-3");
    fs::create_dir(&mnt3).unwrap();
    let (out, _guard) = mount_in_background(&m.lower, &mnt3, "zstd", &[]);
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(32), "in use: {text}");
    assert!(text.starts_with(&format!("plyfs: lower {} is in use by another plyfs (pid ", m.lower.display())), "{text}");
    assert!(text.ends_with(&format!("); {MOUNT_ADVICE}\n")) && text.lines().count() == 1, "{text}");
}

#[test]
fn after_an_unmount_or_a_killed_daemon_the_lower_mounts_again() {
    let mut m = Mount::new("zstd");
    fs::write(m.path("f"), b"kept").unwrap();
    m.unmount();
    assert!(!m.lower_path(LOCK).exists(), "the last holder removes the lock file");
    let mut m = m.remount();
    let dead = m.pid();
    m.child().kill().unwrap();
    m.child().wait().unwrap();
    let stale = fs::read_to_string(m.lower_path(LOCK)).unwrap();
    assert!(stale.starts_with(&format!("pid {dead} on ")), "{stale}");
    // The dead daemon's text is left; its lock died with it.
    let m = m.remount();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"kept");
    assert!(fs::read_to_string(m.lower_path(LOCK)).unwrap().starts_with(&format!("pid {} on ", m.pid())));
}

#[test]
fn a_read_only_branch_is_shared_by_unions() {
    let (_dir, _root, [ro, a, b, mnt_a, mnt_b]) = scratch_dirs(["ro", "a", "b", "mnt-a", "mnt-b"]);
    fs::write(ro.join("base"), b"base").unwrap();
    let branch = format!("--branch={}=ro", ro.display());
    let ma = Mount::start(tempfile::tempdir().unwrap(), a, mnt_a, "union", &[&branch]);
    let mb = Mount::start(tempfile::tempdir().unwrap(), b, mnt_b.clone(), "union", &[&branch]);
    assert_eq!(fs::read(ma.path("base")).unwrap(), b"base");
    assert_eq!(fs::read(mb.path("base")).unwrap(), b"base");
    // A mount that writes the branch is refused while they read it.
    let mnt_x = ma.dir.path().join("mnt-x");
    fs::create_dir(&mnt_x).unwrap();
    let (out, _guard) = mount_in_background(&ro, &mnt_x, "null", &[]);
    assert_eq!(out.status.code(), Some(32), "in use: {}", stderr(&out));
}

/// What a mount shows of the lock file: nothing, and nothing can be made or moved to its name.
fn assert_lock_file_out_of_reach(m: &Mount, what: &str) {
    assert!(m.lower_path(LOCK).exists(), "{what}: the mount holds its lock file");
    fs::write(m.path("other"), b"x").unwrap();
    let names: Vec<_> = fs::read_dir(&m.mnt).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(!names.iter().any(|n| n == LOCK), "{what}: listed: {names:?}");
    let kind = |r: std::io::Result<()>| r.unwrap_err().kind();
    assert_eq!(kind(fs::File::open(m.path(LOCK)).map(drop)), ErrorKind::NotFound, "{what}: open");
    assert_eq!(kind(fs::metadata(m.path(LOCK)).map(drop)), ErrorKind::NotFound, "{what}: stat");
    assert_eq!(kind(fs::remove_file(m.path(LOCK))), ErrorKind::NotFound, "{what}: unlink");
    assert_eq!(kind(fs::File::create(m.path(LOCK)).map(drop)), ErrorKind::PermissionDenied, "{what}: create");
    assert_eq!(kind(fs::rename(m.path("other"), m.path(LOCK))), ErrorKind::PermissionDenied, "{what}: rename onto it");
    assert_eq!(kind(fs::hard_link(m.path("other"), m.path(LOCK))), ErrorKind::PermissionDenied, "{what}: link");
    assert_eq!(kind(fs::create_dir(m.path(LOCK))), ErrorKind::PermissionDenied, "{what}: mkdir");
    assert_eq!(kind(std::os::unix::fs::symlink("other", m.path(LOCK))), ErrorKind::PermissionDenied, "{what}: symlink");
    // In a subdirectory the name is an ordinary one.
    fs::create_dir(m.path("sub")).unwrap();
    fs::write(m.path(&format!("sub/{LOCK}")), b"mine").unwrap();
    assert_eq!(fs::read(m.path(&format!("sub/{LOCK}"))).unwrap(), b"mine", "{what}");
    assert!(fs::read_to_string(m.lower_path(LOCK)).unwrap().contains("mounted at"), "{what}: the lock file is untouched");
}

#[test]
fn the_lock_file_is_out_of_reach_through_every_stack() {
    for stack in ["null", "zstd", "gzip,zstd"] {
        assert_lock_file_out_of_reach(&Mount::new(stack), stack);
    }
    assert_lock_file_out_of_reach(&Mount::crypt("crypt", &["--plaintext-names"], &[]), "crypt --plaintext-names");
    let (m, _b) = common::mirror("mirror");
    assert_lock_file_out_of_reach(&m, "mirror");
}

/// `plyfs serve LOWER`, which is expected to be refused: its output. One that starts serving
/// after all is killed (the test then fails).
fn serve_refused(lower: &Path, sock: &Path) -> Output {
    struct KillOnDrop(Option<Child>);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            if let Some(mut c) = self.0.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let child = plyfs()
        .arg("serve")
        .arg(lower)
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut guard = KillOnDrop(Some(child));
    let pid = guard.0.as_ref().unwrap().id();
    // A server that was not refused listens: stop waiting for it then.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while guard.0.as_mut().unwrap().try_wait().unwrap().is_none() {
        assert!(!sock.exists() && std::time::Instant::now() < deadline, "plyfs serve (pid {pid}) was not refused");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    guard.0.take().unwrap().wait_with_output().unwrap()
}

#[test]
fn serve_and_a_mount_of_one_lower_refuse_each_other() {
    let m = Mount::new("zstd");
    let out = serve_refused(&m.lower, &m.dir.path().join("sock"));
    assert_refused_by(&out, &m, MOUNT_ADVICE);
    drop(m);

    let (_dir, root, [lower, mnt]) = scratch_dirs(["lower", "mnt"]);
    let sock = root.join("sock");
    let server = Server::start(&lower, &format!("unix:{}", sock.display()), &["--stack", "zstd"], &root.join("serve.log"));
    let (out, _guard) = mount_in_background(&lower, &mnt, "zstd", &[]);
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(32), "in use: {text}");
    let want = format!(
        "plyfs: lower {} is in use by another plyfs (pid {} on {}, serving on unix:{}); {MOUNT_ADVICE}\n",
        lower.display(),
        server.pid(),
        hostname(),
        sock.display()
    );
    assert_eq!(text, want);
    // A remote mount of the served stack takes no lock of its own: the server holds it.
    let remote = Mount::start(tempfile::tempdir().unwrap(), PathBuf::from(format!("unix:{}", sock.display())), mnt, "", &[]);
    fs::write(remote.path("f"), b"through the server").unwrap();
    assert_eq!(fs::read(remote.path("f")).unwrap(), b"through the server");
}

fn offline(args: &[&str], lower: &Path) -> Output {
    run(plyfs().args(&args[..1]).arg(lower).args(&args[1..]))
}

#[test]
fn offline_tools_wait_for_the_mounts_of_a_lower() {
    let mut m = Mount::new("zstd");
    fs::write(m.path("f"), b"data").unwrap();
    let (lower, scratch) = (m.lower.clone(), m.dir.path().canonicalize().unwrap());
    let plain = scratch.join("plain");
    fs::write(&plain, b"plain").unwrap();
    let fsck = || offline(&["fsck", "--stack", "zstd"], &lower);
    let encode = || run(plyfs().arg("encode").arg(&plain).arg(lower.join("new")).args(["--stack", "zstd"]));
    let decode = |to: &str| offline(&["decode", scratch.join(to).to_str().unwrap(), "--stack", "zstd"], &lower);
    for out in [fsck(), encode(), decode("out-1"), offline(&["du", "--stack", "zstd"], &lower)] {
        assert_refused_by(&out, &m, TOOL_ADVICE);
    }
    assert!(!lower.join("new").exists() && !scratch.join("out-1").exists(), "nothing written");

    m.unmount();
    for (what, out) in [("fsck", fsck()), ("encode", encode()), ("decode", decode("out-2"))] {
        assert!(out.status.success(), "{what} after the unmount: {}", stderr(&out));
    }
    assert_eq!(fs::read(scratch.join("out-2/new")).unwrap(), b"plain");
    assert!(!lower.join(LOCK).exists(), "the tools removed the lock file after them");

    // Beside a shared mount, tools that only read run; those that write do not.
    let shared = Mount::start(tempfile::tempdir().unwrap(), lower.clone(), m.mnt.clone(), "zstd", &["shared"]);
    assert!(decode("out-3").status.success());
    assert_refused_by(&fsck(), &shared, TOOL_ADVICE);
}
