//! Test harness: real FUSE mounts that are always unmounted, even when a test panics or hangs.
#![allow(dead_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub mod exodisk;
pub mod rng;
pub mod stress;

/// A test that still runs after this long is stuck on the mount: the watchdog kills the daemon
/// (which makes the stuck calls fail) and detaches the mount.
const WATCHDOG: Duration = Duration::from_secs(240);

pub fn plyfs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_plyfs"))
}

pub fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null()).output().expect("run command")
}

/// Run `cmd` with its standard output and error on a terminal of its own (a pseudo-terminal),
/// as a person at a shell would: its exit status and what it printed there (`\r\n` read as
/// `\n`).
pub fn run_on_terminal(cmd: &mut Command) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (-1, -1);
    let made = unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
    assert_eq!(made, 0, "openpty: {}", std::io::Error::last_os_error());
    let (mut master, slave) = unsafe { (std::fs::File::from_raw_fd(master), std::fs::File::from_raw_fd(slave)) };
    let mut child = cmd.stdin(Stdio::null()).stdout(slave.try_clone().unwrap()).stderr(slave).spawn().expect("run command");
    // Read while it runs (a full terminal would hold it up); the end reads as EIO once the
    // last copy of the other side is closed, `cmd`'s own included.
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match master.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    let status = child.wait().unwrap();
    (status, String::from_utf8_lossy(&out).replace("\r\n", "\n"))
}

/// A tree encoded with `zstd:chunk=16k` in a new directory `name` under `root`: `sound.txt`,
/// and `damaged.txt`, whose stored bytes are overwritten in the middle (its index is then found
/// inconsistent and rebuilt, and two of its chunks fail their checks).
pub fn damaged_zstd_tree(root: &Path, name: &str) -> PathBuf {
    use std::os::unix::fs::FileExt;
    let src = root.join(format!("{name}.src"));
    std::fs::create_dir_all(&src).unwrap();
    let text: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
    std::fs::write(src.join("sound.txt"), &text).unwrap();
    std::fs::write(src.join("damaged.txt"), &text).unwrap();
    let enc = root.join(name);
    let out = run(plyfs().arg("encode").arg(&src).arg(&enc).args(["--stack", "zstd:chunk=16k"]));
    assert!(out.status.success(), "encode: {}", String::from_utf8_lossy(&out.stderr));
    let victim = std::fs::OpenOptions::new().write(true).open(enc.join("damaged.txt")).unwrap();
    let len = victim.metadata().unwrap().len();
    victim.write_all_at(&[0x5a; 3000], len / 3).unwrap();
    enc
}

/// Run `argv` as the user nobody (65534), with no supplementary groups: its success and standard
/// error.
pub fn as_nobody(argv: &[&str]) -> (bool, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(argv)
        .stdin(Stdio::null())
        .output()
        .expect("setpriv (util-linux)");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

pub fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// The fstype mounted exactly at `path`, if any.
pub fn mounted_fstype(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines().rev().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mp = left.split(' ').nth(4)?.replace("\\040", " ");
        (Path::new(&mp) == path).then(|| right.split(' ').next().unwrap_or("").to_owned())
    })
}

fn lazy_unmount(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    let _ = Command::new("fusermount3").arg("-uz").arg(path).stderr(Stdio::null()).status();
}

pub struct Mount {
    pub dir: tempfile::TempDir,
    pub lower: PathBuf,
    pub mnt: PathBuf,
    daemon_log: PathBuf,
    child: Option<Child>,
    done: Arc<AtomicBool>,
    stack: String,
    options: Vec<String>,
}

impl Mount {
    pub fn new(stack: &str) -> Mount {
        Mount::with(stack, &[])
    }

    /// Mount `stack` in a foreground daemon owned by this test, with `-o` options.
    pub fn with(stack: &str, options: &[&str]) -> Mount {
        let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (lower, mnt) = (root.join("lower"), root.join("mnt"));
        std::fs::create_dir(&lower).unwrap();
        std::fs::create_dir(&mnt).unwrap();
        Mount::start(dir, lower, mnt, stack, options)
    }

    /// Make a new crypt volume (`plyfs init --layer crypt` with `init_args`, e.g.
    /// `--plaintext-names` or `--cipher=xchacha20-poly1305`) and mount `stack` over it, unlocked
    /// with the password file [`crypt_passfile`] of the test's directory.
    pub fn crypt(stack: &str, init_args: &[&str], options: &[&str]) -> Mount {
        let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (lower, mnt) = (root.join("lower"), root.join("mnt"));
        std::fs::create_dir(&lower).unwrap();
        std::fs::create_dir(&mnt).unwrap();
        let passfile = crypt_init(&root, &lower, init_args);
        let passfile = format!("--passfile={}", passfile.display());
        let options: Vec<&str> = options.iter().copied().chain([passfile.as_str()]).collect();
        Mount::start(dir, lower, mnt, stack, &options)
    }

    /// Mount over an existing lower directory (e.g. to remount), in a new temporary mount point.
    pub fn start(dir: tempfile::TempDir, lower: PathBuf, mnt: PathBuf, stack: &str, options: &[&str]) -> Mount {
        let daemon_log = dir.path().join(format!("daemon-{}.log", std::process::id()));
        let log = std::fs::File::create(&daemon_log).unwrap();
        let mut cmd = plyfs();
        cmd.arg("mount").arg(&lower).arg(&mnt).arg("--foreground");
        // An empty stack names none (`--reverse` views).
        if !stack.is_empty() {
            cmd.arg("--stack").arg(stack);
        }
        for o in options {
            // `--flag=value` goes as it is (e.g. `--rules=FILE`); anything else is a `-o` option.
            if o.starts_with("--") {
                cmd.arg(o);
            } else {
                cmd.arg("-o").arg(o);
            }
        }
        // PLYFS_TEST_OPTIONS adds `-o` options to every test mount (e.g. `io_uring=on`, to run
        // a whole test file over io_uring).
        if let Ok(extra) = std::env::var("PLYFS_TEST_OPTIONS") {
            cmd.arg("-o").arg(extra);
        }
        let child = cmd.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap();
        let mut m = Mount {
            dir,
            lower,
            mnt,
            daemon_log,
            child: Some(child),
            done: Arc::new(AtomicBool::new(false)),
            stack: stack.to_owned(),
            options: options.iter().map(|o| o.to_string()).collect(),
        };
        m.wait_ready();
        m.start_watchdog();
        m
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if mounted_fstype(&self.mnt).as_deref() == Some("fuse.plyfs") && self.daemon_log().contains("mounted ") {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("plyfs exited before mounting ({status}): {}", self.daemon_log());
            }
            assert!(Instant::now() < deadline, "mount not ready after 20 s: {}", self.daemon_log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn start_watchdog(&self) {
        let done = self.done.clone();
        let pid = self.child.as_ref().unwrap().id() as i32;
        let mnt = self.mnt.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            while start.elapsed() < WATCHDOG {
                if done.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if !done.load(Ordering::SeqCst) {
                eprintln!("watchdog: test stuck on {} for {WATCHDOG:?}; killing its daemon", mnt.display());
                unsafe { libc::kill(pid, libc::SIGKILL) };
                lazy_unmount(&mnt);
            }
        });
    }

    /// Unmount and mount the same stack again over the same lower directory.
    pub fn remount(mut self) -> Mount {
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        let (lower, mnt, stack, options) = (self.lower.clone(), self.mnt.clone(), self.stack.clone(), self.options.clone());
        drop(self);
        let options: Vec<&str> = options.iter().map(String::as_str).collect();
        Mount::start(dir, lower, mnt, &stack, &options)
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    pub fn lower_path(&self, rel: &str) -> PathBuf {
        self.lower.join(rel)
    }

    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(&self.daemon_log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Take the daemon process, for tests that signal or kill it; the guard still cleans up.
    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().unwrap()
    }

    /// Unmount with `plyfs umount` and wait for the daemon to exit; returns its exit status.
    pub fn unmount(&mut self) -> std::process::ExitStatus {
        let out = run(plyfs().arg("umount").arg(&self.mnt));
        assert!(out.status.success(), "plyfs umount failed: {}", String::from_utf8_lossy(&out.stderr));
        self.wait_exit(Duration::from_secs(20)).expect("daemon did not exit after unmount")
    }

    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        let child = self.child.as_mut()?;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        if mounted_fstype(&self.mnt).is_some() {
            let _ = plyfs().arg("umount").arg(&self.mnt).stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
        if self.wait_exit(Duration::from_secs(10)).is_none() {
            if let Some(child) = self.child.as_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if mounted_fstype(&self.mnt).is_some() {
            lazy_unmount(&self.mnt);
        }
    }
}

/// A mirror of LOWER and a second directory, with `stack` (e.g. `mirror[|fault]`); returns the
/// mount and the second directory.
pub fn mirror(stack: &str) -> (Mount, PathBuf) {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (a, b, mnt) = (root.join("a"), root.join("b"), root.join("mnt"));
    for d in [&a, &b, &mnt] {
        std::fs::create_dir(d).unwrap();
    }
    let branch = format!("--branch={}", b.display());
    (Mount::start(dir, a, mnt, stack, &[&branch]), b)
}

/// The password of the crypt volumes tests make.
pub const CRYPT_PASSWORD: &str = "correct horse battery staple";

/// The password file for the crypt volumes made in the test directory `dir`: written on first
/// use.
pub fn crypt_passfile(dir: &Path) -> PathBuf {
    let path = dir.join("passfile");
    if !path.exists() {
        std::fs::write(&path, format!("{CRYPT_PASSWORD}\n")).unwrap();
    }
    path
}

/// Make `lower` a crypt volume with the password of [`crypt_passfile`]`(dir)`, whose path is
/// returned. `--kdf-memory 1024` keeps Argon2id fast; `init_args` are passed as they are.
pub fn crypt_init(dir: &Path, lower: &Path, init_args: &[&str]) -> PathBuf {
    let passfile = crypt_passfile(dir);
    let out = run(plyfs()
        .arg("init")
        .arg(lower)
        .args(["--layer", "crypt", "--kdf-memory", "1024", "--passfile"])
        .arg(&passfile)
        .args(init_args));
    assert!(out.status.success(), "plyfs init {}: {}", lower.display(), String::from_utf8_lossy(&out.stderr));
    passfile
}

/// `errno` of a failed libc call.
/// Write `f` through `m`, then kill its daemon: the mount answers as a dead one (ENOTCONN; over
/// io_uring ECONNABORTED, or ECANCELED while the kernel takes the rings down), `plyfs umount`
/// cleans it up and says so, and what was written stays in the lower directory.
pub fn kill_daemon_and_clean_up(m: &mut Mount) {
    std::fs::write(m.path("f"), b"synced").unwrap();
    m.child().kill().unwrap();
    m.child().wait().unwrap();
    let e = std::fs::metadata(m.path("f")).unwrap_err().raw_os_error();
    assert!(matches!(e, Some(libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED)), "{e:?}");
    let out = run(plyfs().arg("umount").arg(&m.mnt));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("its daemon had died"), "{stderr}");
    assert!(mounted_fstype(&m.mnt).is_none());
    assert_eq!(std::fs::read(m.lower_path("f")).unwrap(), b"synced");
}

/// A test directory under /tmp (removed when dropped), its canonical path, and the
/// subdirectories `names` made in it.
pub fn scratch_dirs<const N: usize>(names: [&str; N]) -> (tempfile::TempDir, PathBuf, [PathBuf; N]) {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let paths = names.map(|n| {
        let p = root.join(n);
        std::fs::create_dir(&p).unwrap();
        p
    });
    (dir, root, paths)
}

pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

pub const FS_NOATIME_FL: libc::c_int = 0x80;
pub const FS_IMMUTABLE_FL: libc::c_int = 0x10;
pub const FS_APPEND_FL: libc::c_int = 0x20;

/// The file-attribute flags of a file or directory (`lsattr`), or the errno that refused them.
pub fn get_file_flags(p: &Path) -> Result<libc::c_int, i32> {
    const FS_IOC_GETFLAGS: libc::c_ulong = 0x8008_6601;
    let f = std::fs::File::open(p).map_err(|e| e.raw_os_error().unwrap_or(0))?;
    let mut flags: libc::c_int = 0;
    match unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&f), FS_IOC_GETFLAGS, &mut flags) } {
        0 => Ok(flags),
        _ => Err(errno()),
    }
}

/// Set the file-attribute flags of a file or directory (`chattr`): 0, or the errno.
pub fn set_file_flags(p: &Path, flags: libc::c_int) -> i32 {
    const FS_IOC_SETFLAGS: libc::c_ulong = 0x4008_6602;
    let f = std::fs::File::open(p).unwrap();
    if unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&f), FS_IOC_SETFLAGS, &flags) } == 0 { 0 } else { errno() }
}

/// Run `plyfs op PATH ARGS...`, which must succeed, and return its JSON answer.
pub fn op_json(path: &Path, args: &[&str]) -> serde_json::Value {
    let out = run(plyfs().arg("op").arg(path).args(args));
    assert!(out.status.success(), "plyfs op {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A `plyfs serve` owned by a test: stopped (killed if need be) when dropped.
pub struct Server {
    pub lower: PathBuf,
    pub listen: String,
    pub log: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl Server {
    /// Serve `lower` on `listen` (`unix:PATH` or `tcp:HOST:PORT`) with more `args`
    /// (`--stack`, `--psk`, ...); returns once it listens.
    pub fn start(lower: &Path, listen: &str, args: &[&str], log: &Path) -> Server {
        let mut s = Server {
            lower: lower.to_owned(),
            listen: listen.to_owned(),
            log: log.to_owned(),
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let before = self.log_text().matches("serving ").count();
        self.child = Some(self.command(None).spawn().unwrap());
        self.wait_serving(before);
    }

    /// `plyfs serve` with this server's arguments and log; with `after`, started `delay` after
    /// process `pid` is gone.
    fn command(&self, after: Option<(u32, Duration)>) -> Command {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut cmd = match after {
            None => plyfs(),
            Some((pid, delay)) => {
                // The old server holds the lower lock until it has exited, which a busy machine
                // can make take longer than `delay`; the new one would find the lower in use.
                let script = r#"while kill -0 "$1" 2>/dev/null; do sleep 0.02; done; sleep "$0"; shift; exec "$@""#;
                let mut sh = Command::new("sh");
                sh.args(["-c", script, &format!("{}", delay.as_secs_f64()), &pid.to_string()]).arg(plyfs().get_program());
                sh
            }
        };
        cmd.arg("serve").arg(&self.lower).arg("--listen").arg(&self.listen).args(&self.args);
        cmd.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log);
        cmd
    }

    fn wait_serving(&mut self, before: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.log_text().matches("serving ").count() == before {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("plyfs serve exited ({status}): {}", self.log_text());
            }
            assert!(Instant::now() < deadline, "plyfs serve not listening after 20 s: {}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Kill the server with SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again after [`Server::kill`].
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a server that runs");
        self.spawn();
    }

    /// Kill the server with SIGKILL and have it start again `delay` after it has exited, without
    /// waiting for it. The new server is started before the kill, so call this while files of a mount of it
    /// have writes in flight: a process started later, from this one, would close its copies of
    /// those files when it execs, and the kernel would make that close wait for the writes, so
    /// for the very server it is starting.
    pub fn kill_and_restart_after(&mut self, delay: Duration) -> Restarting {
        let serving = self.log_text().matches("serving ").count();
        let next = self.command(Some((self.pid(), delay))).spawn().unwrap();
        self.kill();
        self.child = Some(next);
        Restarting(serving)
    }

    /// Wait until the server [`Server::kill_and_restart_after`] started serves.
    pub fn wait_restarted(&mut self, r: Restarting) {
        self.wait_serving(r.0);
    }
}

/// A server on its way back (see [`Server::kill_and_restart_after`]): how many times the log
/// said "serving" before it.
#[must_use]
pub struct Restarting(usize);

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A TCP port on loopback that nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A tmpfs of `size` (e.g. `8m`) mounted on a directory of its own under /tmp, for tests that
/// fill a file system; unmounted when dropped, also when the test fails. Needs root.
pub struct SmallTmpfs(tempfile::TempDir);

impl SmallTmpfs {
    pub fn mount(size: &str) -> SmallTmpfs {
        assert!(is_root(), "mounting a tmpfs needs root");
        let dir = tempfile::Builder::new().prefix("plyfs-small-").tempdir_in("/tmp").unwrap();
        let status =
            std::process::Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(dir.path()).status().unwrap();
        assert!(status.success(), "mount -t tmpfs -o size={size}");
        SmallTmpfs(dir)
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Bytes free for an unprivileged user.
    pub fn available(&self) -> u64 {
        let c = cpath(self.path());
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
        s.f_bavail as u64 * s.f_frsize as u64
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

/// The mount's directory, made reachable by other users (a test's own is private).
pub fn open_to_all(m: &Mount) {
    use std::os::unix::fs::PermissionsExt;
    for p in [m.dir.path(), &m.mnt, &m.lower] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// With `-o allow_root` (and `extra` options) the kernel lets every user reach the daemon, which
/// must turn away all but root and the owner (root here); with `-o allow_other`, everyone may.
/// Needs root.
pub fn assert_allow_root_refuses_others(extra: &[&str]) {
    use std::os::unix::fs::PermissionsExt;
    let options: Vec<&str> = ["allow_root"].iter().chain(extra).copied().collect();
    let m = Mount::with("null", &options);
    open_to_all(&m);
    std::fs::write(m.path("f"), b"hello").unwrap();
    std::fs::set_permissions(m.path("f"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let mnt = m.mnt.to_str().unwrap().to_owned();
    let f = m.path("f").to_str().unwrap().to_owned();
    let new = format!("{mnt}/new");
    for argv in [vec!["ls", mnt.as_str()], vec!["cat", f.as_str()], vec!["touch", new.as_str()]] {
        let (ok, err) = as_nobody(&argv);
        assert!(!ok, "{argv:?} as nobody succeeded on an allow_root mount ({options:?})");
        assert!(err.contains("Permission denied"), "{argv:?}: {err}");
    }
    assert!(!m.lower_path("new").exists());
    assert_eq!(std::fs::read(m.path("f")).unwrap(), b"hello");

    let options: Vec<&str> = ["allow_other"].iter().chain(extra).copied().collect();
    let m = Mount::with("null", &options);
    open_to_all(&m);
    std::fs::write(m.path("f"), b"hello").unwrap();
    std::fs::set_permissions(m.path("f"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ok, err) = as_nobody(&["cat", m.path("f").to_str().unwrap()]);
    assert!(ok, "allow_other ({options:?}): {err}");
}
