//! Stacks served by `plyfs serve` and mounted elsewhere: over a Unix socket and over TLS,
//! through real mounts and real server processes.

mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

struct Setup {
    _dir: tempfile::TempDir,
    root: PathBuf,
    lower: PathBuf,
}

fn setup() -> Setup {
    let dir = tempfile::Builder::new().prefix("plyfs-remote-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let lower = root.join("lower");
    std::fs::create_dir(&lower).unwrap();
    Setup { _dir: dir, root, lower }
}

fn mount(s: &Setup, name: &str, lower: &str, stack: &str, options: &[&str]) -> Mount {
    let mnt = s.root.join(name);
    std::fs::create_dir_all(&mnt).unwrap();
    let dir = tempfile::Builder::new().prefix("plyfs-remote-mnt-").tempdir_in("/tmp").unwrap();
    Mount::start(dir, PathBuf::from(lower), mnt, stack, options)
}

fn unix(s: &Setup) -> (Server, String) {
    let sock = s.root.join("s.sock");
    let addr = format!("unix:{}", sock.display());
    (Server::start(&s.lower, &addr, &[], &s.root.join("server.log")), addr)
}

#[test]
fn a_stack_served_on_a_unix_socket_reads_and_writes() {
    let s = setup();
    let (_server, addr) = unix(&s);
    let m = mount(&s, "mnt", &addr, "null", &[]);
    std::fs::create_dir_all(m.path("a/b")).unwrap();
    std::fs::write(m.path("a/b/f"), b"through the socket").unwrap();
    assert_eq!(std::fs::read(s.lower.join("a/b/f")).unwrap(), b"through the socket");
    std::fs::rename(m.path("a/b/f"), m.path("g")).unwrap();
    assert!(s.lower.join("g").exists());
    // Inode numbers are the server's.
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(m.path("g")).unwrap().ino(), std::fs::metadata(s.lower.join("g")).unwrap().ino());
    // The server's extended operations answer through the mount.
    let info = op_json(&m.path("g"), &["lower-info"]);
    assert!(info.to_string().contains("lower"), "{info}");
    let list = run(plyfs().arg("op").arg(m.path("g")).arg("--list"));
    assert!(String::from_utf8_lossy(&list.stdout).contains("lower-sync"), "{}", String::from_utf8_lossy(&list.stdout));
}

#[test]
fn zstd_over_remote_compresses_in_the_mount() {
    let s = setup();
    let (server, addr) = unix(&s);
    let text = "a line that repeats and compresses well\n".repeat(20_000);
    {
        // The address in the stack itself, with LOWER `-`.
        let m = mount(&s, "mnt", "-", &format!("zstd,remote:addr={addr}"), &[]);
        std::fs::write(m.path("f"), &text).unwrap();
        assert_eq!(std::fs::read_to_string(m.path("f")).unwrap(), text);
    }
    let stored = std::fs::metadata(s.lower.join("f")).unwrap().len();
    assert!(stored < text.len() as u64 / 10, "stored {stored} bytes for {}", text.len());
    // The same stack over the lower directory itself reads it, once the server is gone.
    drop(server);
    let out = run(plyfs().arg("decode").arg(&s.lower).arg(s.root.join("plain")).args(["--stack", "zstd"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(s.root.join("plain/f")).unwrap(), text);
}

#[test]
fn the_server_killed_and_restarted_loses_no_fsynced_byte_and_the_client_goes_on() {
    let s = setup();
    let (mut server, addr) = unix(&s);
    let m = mount(&s, "mnt", &addr, "zstd,remote", &[]);
    std::fs::create_dir_all(m.path("d/e")).unwrap();
    let mut f = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(m.path("d/e/log")).unwrap();
    let mut reader = std::fs::File::open(m.path("d/e/log")).unwrap();
    let mut synced = 0;
    let mut write = |i: usize| {
        f.write_all(format!("line {i:06}\n").as_bytes()).unwrap();
        f.sync_all().unwrap();
        synced = i + 1;
    };
    (0..100).for_each(&mut write);
    // Back in a moment: the writes meanwhile wait for it (within the timeout).
    let back = server.kill_and_restart_after(Duration::from_millis(700));
    (100..300).for_each(&mut write);
    server.wait_restarted(back);
    drop(write);
    drop(f);
    // The descriptor opened before the crash still reads, without a remount.
    let mut all = String::new();
    reader.seek(SeekFrom::Start(0)).unwrap();
    reader.read_to_string(&mut all).unwrap();
    let expected: String = (0..synced).map(|i| format!("line {i:06}\n")).collect();
    assert_eq!(all, expected);
    assert!(m.daemon_log().contains("reconnected"), "{}", m.daemon_log());
    // And what is on the server's disk is all of it.
    drop(reader);
    drop(m);
    let m = mount(&s, "mnt2", &addr, "zstd,remote", &[]);
    assert_eq!(std::fs::read_to_string(m.path("d/e/log")).unwrap(), expected);
}

#[test]
fn requests_while_a_server_stays_down_fail_with_eio_after_the_timeout_and_the_mount_survives() {
    let s = setup();
    let (mut server, addr) = unix(&s);
    let m = mount(&s, "mnt", &addr, "remote:timeout=2", &[]);
    std::fs::write(m.path("f"), b"x").unwrap();
    let file = std::fs::File::open(m.path("f")).unwrap();
    server.kill();
    let start = Instant::now();
    let mut buf = [0u8; 1];
    let err = file.read_at(&mut buf, 0).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    assert!(m.daemon_log().contains("remote:"), "{}", m.daemon_log());
    server.restart();
    assert_eq!(file.read_at(&mut buf, 0).unwrap(), 1);
    assert_eq!(std::fs::read(m.path("f")).unwrap(), b"x");
}

/// A pre-shared key file as it must be: 0600 (plyfs refuses one that others may read).
fn write_key(path: &std::path::Path, key: [u8; 32]) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).unwrap().write_all(&key).unwrap();
}

#[test]
fn tls_with_the_right_key_works_and_a_wrong_key_is_refused_with_one_log_line() {
    let s = setup();
    let (key, bad) = (s.root.join("psk"), s.root.join("bad"));
    write_key(&key, [7u8; 32]);
    write_key(&bad, [8u8; 32]);
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let key_arg = format!("--psk={}", key.display());
    let server = Server::start(&s.lower, &addr, &[&key_arg, "--no-root-squash"], &s.root.join("server.log"));
    let mnt = s.root.join("refused");
    std::fs::create_dir(&mnt).unwrap();
    let out = run(plyfs().arg("mount").arg(&addr).arg(&mnt).arg("--psk").arg(&bad));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("wrong key") && err.lines().count() == 1, "{err}");
    assert_eq!(server.log_text().matches("refused").count(), 1, "{}", server.log_text());
    let out = run(plyfs().arg("mount").arg(&addr).arg(&mnt));
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--psk"));
    assert!(mounted_fstype(&mnt).is_none());
    let m = mount(&s, "mnt", &addr, "null", &[&key_arg]);
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(m.path("big"), &data).unwrap();
    assert_eq!(std::fs::read(m.path("big")).unwrap(), data);
    assert_eq!(std::fs::read(s.lower.join("big")).unwrap(), data);
}

#[test]
fn root_is_squashed_over_tcp_unless_asked() {
    let s = setup();
    let key = s.root.join("psk");
    write_key(&key, [7u8; 32]);
    let key_arg = format!("--psk={}", key.display());
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let _server = Server::start(&s.lower, &addr, &[&key_arg], &s.root.join("server.log"));
    let m = mount(&s, "mnt", &addr, "null", &[&key_arg]);
    // The lower root belongs to root and is not writable by others: nobody may not create.
    let err = std::fs::write(m.path("f"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    std::fs::set_permissions(&s.lower, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    std::fs::write(m.path("f"), b"x").unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(s.lower.join("f")).unwrap().uid(), 65534);
}

#[test]
fn changes_made_through_another_client_reach_the_kernel_caches() {
    let s = setup();
    let (_server, addr) = unix(&s);
    // Long timeouts: without the server's notices, b would see its cached copy for a minute.
    let opts = ["attr_timeout=60", "entry_timeout=60"];
    let a = mount(&s, "a", &addr, "null", &opts);
    let b = mount(&s, "b", &addr, "null", &opts);
    std::fs::write(a.path("f"), b"first").unwrap();
    assert_eq!(std::fs::read(b.path("f")).unwrap(), b"first");
    std::fs::write(a.path("f"), b"second, longer").unwrap();
    wait_for(|| std::fs::read(b.path("f")).ok().as_deref() == Some(&b"second, longer"[..]), "b sees a's new data");
    std::fs::remove_file(a.path("f")).unwrap();
    wait_for(|| !b.path("f").exists(), "b sees the removal");
    std::fs::write(a.path("g"), b"new").unwrap();
    wait_for(|| b.path("g").exists(), "b sees the new name");
    // b remembers that g has no attribute; a sets one, and b sees it.
    let get = |p: &std::path::Path| {
        let mut buf = [0u8; 16];
        let n = unsafe { libc::getxattr(cpath(p).as_ptr(), c"user.k".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        (n >= 0).then(|| buf[..n as usize].to_vec())
    };
    assert_eq!(get(&b.path("g")), None);
    let rc = unsafe { libc::setxattr(cpath(&a.path("g")).as_ptr(), c"user.k".as_ptr(), b"v".as_ptr().cast(), 1, 0) };
    assert_eq!(rc, 0);
    wait_for(|| get(&b.path("g")).as_deref() == Some(&b"v"[..]), "b sees the new attribute");
}

/// A directory read entry by entry through libc (readdir(3)), for tests that act while it is
/// open.
struct DirStream(*mut libc::DIR);

impl DirStream {
    fn open(path: &Path) -> DirStream {
        let d = unsafe { libc::opendir(cpath(path).as_ptr()) };
        assert!(!d.is_null(), "opendir {}", path.display());
        DirStream(d)
    }

    fn next_name(&mut self) -> Option<String> {
        let e = unsafe { libc::readdir(self.0) };
        (!e.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr((*e).d_name.as_ptr()) }.to_string_lossy().into_owned())
    }
}

impl Drop for DirStream {
    fn drop(&mut self) {
        unsafe { libc::closedir(self.0) };
    }
}

/// A directory of `n` files in the server's lower directory, and the name its listing gives
/// at `at` (readdir order).
fn long_dir(s: &Setup, name: &str, n: usize, at: usize) -> String {
    std::fs::create_dir(s.lower.join(name)).unwrap();
    for i in 0..n {
        std::fs::write(s.lower.join(name).join(format!("f{i}")), b"x").unwrap();
    }
    let order: Vec<_> = std::fs::read_dir(s.lower.join(name)).unwrap().map(|e| e.unwrap().file_name()).collect();
    order[at].to_string_lossy().into_owned()
}

/// A directory's entries come with its opening and are handed to the readdirs that follow
/// (`listdir`). An entry removed while the directory is open, through another client or this
/// one, must not come back from what was listed before: readdirplus would give the kernel a
/// name that no longer exists, for the entry timeout.
#[test]
fn a_directory_open_while_its_entries_change_lists_no_entry_that_is_gone() {
    let s = setup();
    let (_server, addr) = unix(&s);
    let opts = ["attr_timeout=60", "entry_timeout=60"];
    let a = mount(&s, "a", &addr, "null", &opts);
    let b = mount(&s, "b", &addr, "null", &opts);
    std::fs::write(s.lower.join("probe"), b"").unwrap();
    let mode = |p: &Path| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions()) & 0o777;
    assert_eq!(mode(&b.path("probe")), 0o644);
    for (dir, removed_by) in [("by-a", &a), ("by-b", &b)] {
        // The kernel reads with attributes at the start, and on after a lookup in the
        // directory: the second readdir (the front end hands on at most 128 entries a time)
        // gets this entry with attributes, which would make a name for it.
        let gone = long_dir(&s, dir, 600, 150);
        let mut stream = DirStream::open(&b.path(dir));
        let first = std::iter::from_fn(|| stream.next_name()).find(|n| n != "." && n != "..").unwrap();
        std::fs::symlink_metadata(b.path(&format!("{dir}/{first}"))).unwrap();
        std::fs::remove_file(removed_by.path(&format!("{dir}/{gone}"))).unwrap();
        if dir == "by-a" {
            // The server's notices come in order: once b sees the probe change, it heard of
            // the removal too.
            std::fs::set_permissions(a.path("probe"), std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
            wait_for(|| mode(&b.path("probe")) == 0o600, "b hears of a's changes");
        }
        let mut names = 0;
        while stream.next_name().is_some() {
            names += 1;
        }
        drop(stream);
        assert!(names >= 400, "{dir}: {names} more entries read");
        assert_eq!(
            std::fs::symlink_metadata(b.path(&format!("{dir}/{gone}"))).map_err(|e| e.raw_os_error()).err(),
            Some(Some(libc::ENOENT)),
            "{dir}: {gone} was removed while the directory was open, and came back"
        );
    }
    // A name made on the server's side, behind every client, shows at the next opening.
    std::fs::write(s.lower.join("by-a/new"), b"").unwrap();
    assert!(std::fs::read_dir(b.path("by-a")).unwrap().any(|e| e.unwrap().file_name() == "new"));
}

fn wait_for(mut cond: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within 3 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bad_remote_arguments_get_one_clear_line() {
    let s = setup();
    let mnt = s.root.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["unix:/nonexistent/x.sock"], "/nonexistent/x.sock"),
        (&["tcp:nohost"], "tcp:HOST:PORT"),
        (&["-", "--stack", "remote:bogus=1"], "unknown parameter 'bogus'"),
        (&["-", "--stack", "remote,null"], "must come last"),
        (&["unix:/x.sock", "--stack", "remote:timeout=-1"], "timeout"),
    ];
    for (args, expect) in cases {
        let out = run(plyfs().arg("mount").arg(args[0]).arg(&mnt).args(&args[1..]).arg("--foreground"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(expect), "{args:?}: {err}");
        assert!(mounted_fstype(&mnt).is_none());
    }
    let _ = Path::new("");
}

/// A server that is not there, or that answers TLS with nonsense, is one line naming its address
/// once, then the cause (#32: the address used to come two or three times).
#[test]
fn a_failed_connection_names_the_address_once() {
    let s = setup();
    let mnt = s.root.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let key = s.root.join("psk");
    write_key(&key, [7u8; 32]);
    let refuse = |lower: &str, args: &[&std::ffi::OsStr], cause: &str| {
        let out = run(plyfs().arg("mount").arg(lower).arg(&mnt).args(args));
        let err = String::from_utf8_lossy(&out.stderr);
        // The status of a server that cannot be reached (README, *Exit statuses*).
        assert_eq!(out.status.code(), Some(33), "{lower}: {err}");
        assert_eq!(err.lines().count(), 1, "{lower}: {err}");
        assert!(err.starts_with(&format!("plyfs: {lower}: {cause}")), "{lower}: {err}");
        assert_eq!(err.matches(lower).count(), 1, "{err}");
        assert!(mounted_fstype(&mnt).is_none());
        assert_eq!(std::fs::read_dir(&mnt).unwrap().count(), 0);
    };
    let sock = format!("unix:{}", s.root.join("x.sock").display());
    refuse(&sock, &[], "connecting: No such file or directory");
    let psk = [std::ffi::OsStr::new("--psk"), key.as_os_str()];
    let nobody_there = format!("tcp:127.0.0.1:{}", free_port());
    refuse(&nobody_there, &psk, "connecting: Connection refused");
    // Something that is not a plyfs server: it answers the TLS client hello with plain text.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let not_tls = format!("tcp:{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for mut c in listener.incoming().flatten() {
            let _ = c.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n");
        }
    });
    refuse(&not_tls, &psk, "TLS handshake: ");
    // A server with another key refuses the client.
    let other = s.root.join("other");
    write_key(&other, [8u8; 32]);
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let _server = Server::start(&s.lower, &addr, &[&format!("--psk={}", other.display())], &s.root.join("server.log"));
    refuse(&addr, &psk, "refused: ");
}

/// A raw protocol client connecting from this thread with effective user `uid` (the kernel
/// reports the connecting thread's credentials); returns the server's first answer.
fn hello_as(sock: &std::path::Path, uid: u32) -> std::io::Result<String> {
    use std::io::{Read, Write};
    // Only this thread changes its effective user (the raw system call, not glibc's, which
    // would change every thread's).
    let set = |u: u32| unsafe { libc::syscall(libc::SYS_setresuid, -1i64, i64::from(u), -1i64) };
    assert_eq!(set(uid), 0);
    let conn = std::os::unix::net::UnixStream::connect(sock);
    assert_eq!(set(0), 0);
    let mut c = conn?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.write_all(b"plyfs\r\n\x01")?;
    // A hello frame: {"t": "hello", "versions": [1], "software": "test"} in MessagePack.
    let mut hello = vec![0x83, 0xa1, b't', 0xa5];
    hello.extend_from_slice(b"hello");
    hello.extend_from_slice(&[0xa8]);
    hello.extend_from_slice(b"versions");
    hello.extend_from_slice(&[0x91, 0x01, 0xa8]);
    hello.extend_from_slice(b"software");
    hello.extend_from_slice(&[0xa4]);
    hello.extend_from_slice(b"test");
    let mut frame = (hello.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&0u32.to_be_bytes());
    frame.extend_from_slice(&hello);
    c.write_all(&frame)?;
    let mut all = Vec::new();
    let _ = c.take(4096).read_to_end(&mut all);
    Ok(String::from_utf8_lossy(&all).into_owned())
}

#[test]
fn a_unix_socket_admits_only_root_the_server_user_and_allowed_users() {
    let s = setup();
    // The socket itself is for its owner only; let the test's other user reach it, so that the
    // server's own check is what refuses it.
    let sock = s.root.join("s.sock");
    let addr = format!("unix:{}", sock.display());
    std::fs::set_permissions(&s.root, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let server = Server::start(&s.lower, &addr, &[], &s.root.join("server.log"));
    std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let answer = hello_as(&sock, 65534).unwrap_or_default();
    assert!(!answer.contains("welcome"), "{answer:?}");
    wait_for(|| server.log_text().contains("user 65534 may not use this server"), "the refusal in the server's log");
    drop(server);
    let allowed = Server::start(&s.lower, &addr, &["--allow-uid=65534"], &s.root.join("server2.log"));
    std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let answer = hello_as(&sock, 65534).unwrap();
    assert!(answer.contains("welcome"), "{answer:?}");
    drop(allowed);
}

/// The server's resident memory, in MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb / 1024
}

#[test]
fn a_client_that_floods_the_server_with_writes_is_slowed_down_not_buffered() {
    use plyfs_transport::wire::{self, Message, OpHeader, Payload, WireCaller, WireReply};
    use std::io::Write;
    let s = setup();
    let (server, addr) = unix(&s);
    std::fs::write(s.lower.join("f"), b"").unwrap();
    let mut c = std::os::unix::net::UnixStream::connect(addr.strip_prefix("unix:").unwrap()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.write_all(&wire::PREAMBLE).unwrap();
    let hello = Message::Hello { versions: vec![1], software: "flood".into(), auth: None };
    wire::write_frame(&mut c, &wire::encode(&hello), &[]).unwrap();
    wire::read_preamble(&mut c).unwrap();
    wire::read_frame(&mut c).unwrap();
    let caller = WireCaller { uid: 0, gid: 0, pid: 1 };
    let mut ask = |id: u64, op: OpHeader| {
        wire::write_frame(&mut c, &wire::encode(&Message::Req { id, caller, op: op.into() }), &[]).unwrap();
        match wire::decode(&wire::read_frame(&mut c).unwrap().header).unwrap() {
            Message::Rep { reply, .. } => reply,
            other => panic!("{other:?}"),
        }
    };
    let node = match ask(1, OpHeader::Lookup { parent: 1, name: serde_bytes::ByteBuf::from(b"f".to_vec()) }) {
        WireReply::Entry(e) => e.node,
        other => panic!("{other:?}"),
    };
    let fh = match ask(2, OpHeader::Open { node, flags: libc::O_WRONLY }) {
        WireReply::Opened(o) => o.fh,
        other => panic!("{other:?}"),
    };
    // 8 MiB writes, as fast as they go, never reading a reply.
    let mut flood = c.try_clone().unwrap();
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = sent.clone();
    std::thread::spawn(move || {
        let data = vec![7u8; 8 << 20];
        for id in 10..1000u64 {
            let op = OpHeader::Write { node, fh, offset: 0, data: Payload };
            if wire::write_frame(&mut flood, &wire::encode(&Message::Req { id, caller, op: op.into() }), &data).is_err() {
                return;
            }
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let pid = server.pid();
    let rss = rss_mib(pid);
    let n = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(n < 990, "the server took every write ({n}) without being slowed down");
    assert!(rss < 400, "the server holds {rss} MiB after {n} writes of 8 MiB");
    drop(c);
}

/// A `plyfs host` process owned by the test, killed when dropped.
struct Host(std::process::Child);

impl Host {
    fn start(layers: &str, sock: &std::path::Path, log: &std::path::Path) -> Host {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
        let child = plyfs()
            .args(["host", layers, "--socket"])
            .arg(sock)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let host = Host(child);
        wait_for(|| sock.exists(), "the host's socket");
        host
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_layer_in_another_process_that_dies_gives_eio_and_the_mount_lives_on() {
    let s = setup();
    let sock = s.root.join("host.sock");
    let host = Host::start("trace", &sock, &s.root.join("host.log"));
    let m = mount(&s, "mnt", s.lower.to_str().unwrap(), &format!("zstd,ext:socket={},null", sock.display()), &[]);
    std::fs::write(m.path("f"), b"through another process").unwrap();
    // The hosted layer answers its own extended operations through the mount.
    let stats = op_json(&m.path("f"), &["stats@ext"]);
    assert_eq!(stats["layer"], "trace", "{stats}");
    drop(host);
    let _ = std::fs::remove_file(&sock);
    std::thread::sleep(Duration::from_millis(100));
    // Opening the file goes down through the dead layer.
    let err = std::fs::read(m.path("f")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(m.daemon_log().contains("layer 'ext'"), "{}", m.daemon_log());
    assert_eq!(mounted_fstype(&m.mnt).as_deref(), Some("fuse.plyfs"));
    // Back: the next operation (a second later) connects again.
    let _host = Host::start("trace", &sock, &s.root.join("host.log"));
    std::thread::sleep(Duration::from_millis(1100));
    std::fs::write(m.path("h"), b"again").unwrap();
    assert_eq!(std::fs::read(m.path("h")).unwrap(), b"again");
    assert_eq!(std::fs::read(m.path("f")).unwrap(), b"through another process");
}

#[test]
fn a_write_sent_ahead_that_fails_is_reported_by_fsync_and_close_and_sync_writes_fail_at_once() {
    let s = setup();
    let rules = s.root.join("rules");
    std::fs::write(&rules, "op=write path=*.db error=ENOSPC\n").unwrap();
    let sock = s.root.join("s.sock");
    let addr = format!("unix:{}", sock.display());
    let stack = format!("fault:rules={},null", rules.display());
    let _server = Server::start(&s.lower, &addr, &["--stack", &stack], &s.root.join("server.log"));
    let errno = |e: std::io::Error| e.raw_os_error();
    {
        let m = mount(&s, "mnt", &addr, "remote", &[]);
        // Other files are not concerned.
        std::fs::write(m.path("ok.txt"), b"fine").unwrap();
        assert_eq!(std::fs::read(m.path("ok.txt")).unwrap(), b"fine");
        // A large write is answered before the server has run it; fsync reports it.
        let mut f = std::fs::File::create(m.path("a.db")).unwrap();
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        assert_eq!(f.sync_all().map_err(errno), Err(Some(libc::ENOSPC)));
        // And close does, when nothing asked before.
        let mut f = std::fs::OpenOptions::new().write(true).open(m.path("a.db")).unwrap();
        f.write_all(&vec![8u8; 1 << 20]).unwrap();
        let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
        assert_eq!(unsafe { libc::close(fd) }, -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::ENOSPC));
        // A small write, and a synchronous writer's, are answered by the server.
        let mut f = std::fs::OpenOptions::new().write(true).open(m.path("a.db")).unwrap();
        assert_eq!(f.write(b"small").map_err(errno), Err(Some(libc::ENOSPC)));
        let mut f = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_SYNC).open(m.path("a.db")).unwrap();
        assert_eq!(f.write(&[9u8; 100_000]).map_err(errno), Err(Some(libc::ENOSPC)));
        assert!(m.daemon_log().contains("/a.db: a write of"), "{}", m.daemon_log());
    }
    // With remote:sync=on every write waits for the server.
    let m = mount(&s, "mnt2", &addr, "remote:sync=on", &[]);
    let mut f = std::fs::File::create(m.path("b.db")).unwrap();
    assert_eq!(f.write(&[1u8; 100_000]).map_err(errno), Err(Some(libc::ENOSPC)));
}

#[test]
fn the_server_killed_under_writes_sent_ahead_loses_nothing_and_fsync_finds_it_all() {
    let s = setup();
    let (mut server, addr) = unix(&s);
    let m = mount(&s, "mnt", &addr, "remote", &[]);
    let block = |i: usize| -> Vec<u8> { (0..1 << 20).map(|j| (i * 31 + j / 4096) as u8).collect() };
    let mut f = std::fs::File::create(m.path("big")).unwrap();
    for i in 0..16 {
        f.write_all(&block(i)).unwrap();
    }
    // Killed with writes in flight, back a little later.
    let back = server.kill_and_restart_after(Duration::from_millis(500));
    let logs = |server: &Server, e: std::io::Error| -> ! {
        panic!("{e}\nthe server's log:\n{}\nthe mount's log:\n{}", server.log_text(), m.daemon_log())
    };
    for i in 16..48 {
        f.write_all(&block(i)).unwrap_or_else(|e| logs(&server, e));
    }
    server.wait_restarted(back);
    f.sync_all().unwrap_or_else(|e| logs(&server, e));
    drop(f);
    let expected: Vec<u8> = (0..48).flat_map(block).collect();
    let stored = std::fs::read(s.lower.join("big")).unwrap();
    assert!(stored == expected, "the lower file differs ({} bytes, {} expected)", stored.len(), expected.len());
    assert!(m.daemon_log().contains("reconnected"), "{}", m.daemon_log());
}

#[test]
fn a_crypt_volume_served_as_stored_is_decrypted_only_by_the_client() {
    let s = setup();
    let passfile = crypt_init(&s.root, &s.lower, &[]);
    let sock = s.root.join("s.sock");
    let addr = format!("unix:{}", sock.display());
    // The server takes no key: with one, or with crypt in its stack, --as-stored is refused.
    let refused = run(plyfs().arg("serve").arg(&s.lower).args(["--listen", &addr, "--as-stored", "--stack", "crypt"]));
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("--as-stored"));
    let refused = run(plyfs()
        .arg("serve")
        .arg(&s.lower)
        .args(["--listen", &addr, "--as-stored"])
        .arg(format!("--passfile={}", passfile.display())));
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("no password"));
    let _server = Server::start(&s.lower, &addr, &["--as-stored"], &s.root.join("server.log"));
    {
        let m = mount(&s, "mnt", &addr, "zstd,crypt", &[&format!("--passfile={}", passfile.display())]);
        std::fs::create_dir(m.path("private")).unwrap();
        std::fs::write(m.path("private/letter"), "a secret letter ".repeat(1000)).unwrap();
        assert_eq!(std::fs::read_to_string(m.path("private/letter")).unwrap(), "a secret letter ".repeat(1000));
        let names: Vec<String> =
            std::fs::read_dir(m.path("")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(names, ["private"]);
    }
    // What the server stores and sends is ciphertext: no name, no byte of the letter.
    let mut found = Vec::new();
    for e in walk(&s.lower) {
        let name = e.file_name().unwrap().to_string_lossy().into_owned();
        assert!(!name.contains("private") && !name.contains("letter"), "{name}");
        if e.is_file() {
            found.push(std::fs::read(&e).unwrap());
        }
    }
    assert!(found.iter().all(|b| !b.windows(6).any(|w| w == b"secret")));
    // A wrong password is refused with one line naming the server.
    let wrong = s.root.join("wrong");
    std::fs::write(&wrong, "not the password\n").unwrap();
    let out = run(plyfs()
        .arg("mount")
        .arg(&addr)
        .arg(s.root.join("mnt"))
        .args(["--stack", "crypt"])
        .arg(format!("--passfile={}", wrong.display())));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("wrong password") && err.contains(&addr) && err.trim().lines().count() == 1,
        "{err}"
    );
}

/// The README's example of end-to-end encryption, as written: a volume made by root, served as
/// stored over TCP with root squash, mounted by root on the client. The client, `nobody` on the
/// server, reads the volume's configuration (0400, root's), and nothing else it could not
/// before (#32: the mount failed with "Permission denied").
#[test]
fn a_root_client_mounts_a_volume_served_as_stored_over_tcp_as_the_readme_shows() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let s = setup();
    let passfile = crypt_init(&s.root, &s.lower, &[]);
    let config = s.lower.join(".plyfs-crypt.conf");
    let before = std::fs::metadata(&config).unwrap();
    assert_eq!((before.mode() & 0o7777, before.uid()), (0o400, 0));
    let key = s.root.join("plyfs.psk");
    write_key(&key, [9u8; 32]);
    let key_arg = format!("--psk={}", key.display());
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let _server = Server::start(&s.lower, &addr, &["--as-stored", &key_arg], &s.root.join("server.log"));
    {
        let m = mount(&s, "vault", &addr, "zstd,crypt", &[&key_arg, &format!("--passfile={}", passfile.display())]);
        assert_eq!(std::fs::read_dir(m.path("")).unwrap().count(), 0);
        // Root squash, as the README says: nobody may not write into root's directory...
        let err = std::fs::write(m.path("letter"), "x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
        // ... until the directory is nobody's.
        std::os::unix::fs::chown(&s.lower, Some(65534), Some(65534)).unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        std::fs::write(m.path("letter"), "a secret letter").unwrap();
        assert_eq!(std::fs::read_to_string(m.path("letter")).unwrap(), "a secret letter");
    }
    let after = std::fs::metadata(&config).unwrap();
    assert_eq!((after.mode() & 0o7777, after.uid(), after.len()), (0o400, 0, before.len()));
    // Through a mount of the stored tree itself: the configuration is the one file the server
    // opens for any client; another file of root's stays closed to nobody.
    let private = s.lower.join("private");
    std::fs::write(&private, "root's").unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o400)).unwrap();
    let raw = mount(&s, "raw", &addr, "null", &[&key_arg]);
    assert_eq!(std::fs::read(raw.path(".plyfs-crypt.conf")).unwrap(), std::fs::read(&config).unwrap());
    assert_eq!(std::fs::read(raw.path("private")).unwrap_err().raw_os_error(), Some(libc::EACCES));
    let err = std::fs::OpenOptions::new().append(true).open(raw.path(".plyfs-crypt.conf")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    // Where any client may rename entries of the export's root (world-writable, not sticky), one
    // could give another file of root's that name: the exception stands aside there.
    std::fs::set_permissions(&s.lower, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::rename(raw.path("private"), raw.path(".plyfs-crypt.conf")).unwrap();
    assert_eq!(std::fs::read(s.lower.join(".plyfs-crypt.conf")).unwrap(), b"root's", "the client renamed it");
    assert_eq!(std::fs::read(raw.path(".plyfs-crypt.conf")).unwrap_err().raw_os_error(), Some(libc::EACCES));
    // Sticky does not do: anyone may still move a file of root's in from a directory of theirs.
    std::fs::set_permissions(&s.lower, std::fs::Permissions::from_mode(0o1777)).unwrap();
    assert_eq!(std::fs::read(raw.path(".plyfs-crypt.conf")).unwrap_err().raw_os_error(), Some(libc::EACCES));
    // Writable by its owner alone, it is served again.
    std::fs::set_permissions(&s.lower, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(std::fs::read(raw.path(".plyfs-crypt.conf")).unwrap(), b"root's");
}

/// A mirror whose second branch is a server (issue #34): every change lands in the local
/// directory and on the server's, the branch is listed by its address and seen under
/// `.plyfs/`, and when the server goes away the mirror fails that branch and goes on, until a
/// resync brings it back in line.
#[test]
fn a_mirror_branch_on_a_server_takes_every_change_and_is_resynced_after_it_was_away() {
    let s = setup();
    let (mut server, addr) = unix(&s);
    let local = s.root.join("local");
    std::fs::create_dir(&local).unwrap();
    // No LOWER: the branches say where they stand.
    let m = mount(&s, "mnt", "-", &format!("mirror[@{} | remote:addr={addr}:timeout=1]", local.display()), &[]);
    std::fs::create_dir_all(m.path("a/b")).unwrap();
    std::fs::write(m.path("a/b/f"), "on both").unwrap();
    std::fs::write(m.path("gone"), "removed").unwrap();
    std::fs::rename(m.path("a/b/f"), m.path("a/g")).unwrap();
    std::fs::remove_file(m.path("gone")).unwrap();
    for branch in [&local, &s.lower] {
        assert_eq!(std::fs::read_to_string(branch.join("a/g")).unwrap(), "on both", "{}", branch.display());
        assert!(!branch.join("a/b/f").exists() && !branch.join("gone").exists(), "{}", branch.display());
    }
    let status = op_json(&m.mnt, &["mirror-status"]);
    assert_eq!(status["branches"][0]["dir"], local.display().to_string(), "{status}");
    assert_eq!(status["branches"][1]["addr"], addr, "{status}");
    assert_eq!(std::fs::read_to_string(m.path(".plyfs/mirror.1/a/g")).unwrap(), "on both");
    let listed: serde_json::Value = serde_json::from_slice(&run(plyfs().args(["status", "--json"])).stdout).unwrap();
    let row = listed.as_array().unwrap().iter().find(|r| r["mountpoint"] == m.mnt.display().to_string()).expect("listed");
    assert_eq!(row["lower"], format!("{}|{addr}", local.display()), "{row}");
    assert!(row["stack"].as_str().unwrap().split(',').any(|l| l == "mirror.1"), "{row}");

    // The server away: the branch fails once its timeout is out, and the mount goes on.
    server.kill();
    std::fs::write(m.path("while-away"), "later").unwrap();
    let status = op_json(&m.mnt, &["mirror-status"]);
    assert_eq!((status["degraded"].clone(), status["branches"][1]["state"].clone()), (true.into(), "failed".into()), "{status}");
    assert!(m.daemon_log().contains(&addr), "the failure names the server: {}", m.daemon_log());
    assert!(!s.lower.join("while-away").exists());
    server.restart();
    op_json(&m.mnt, &["resync"]);
    assert_eq!(std::fs::read_to_string(s.lower.join("while-away")).unwrap(), "later");
    assert_eq!(op_json(&m.mnt, &["mirror-status"])["degraded"], false);
    // Mounted again, the mirror reads its log on the server too (in pieces a transport carries).
    let m = m.remount();
    assert_eq!(op_json(&m.mnt, &["mirror-status"])["degraded"], false);
    assert_eq!(std::fs::read_to_string(m.path("while-away")).unwrap(), "later");
}

/// A union whose upper branch is a server: copy-up, whiteouts and opaque directories are made
/// there, and hold across a remount (issue #34).
#[test]
fn a_union_branch_on_a_server_takes_copies_up_and_whiteouts() {
    let s = setup();
    let (_server, addr) = unix(&s);
    let base = s.root.join("base");
    std::fs::create_dir_all(base.join("d")).unwrap();
    std::fs::write(base.join("f"), "base").unwrap();
    std::fs::write(base.join("d/x"), "x").unwrap();
    std::fs::write(base.join("hidden"), "h").unwrap();
    let stack = format!("union[remote:addr={addr}|@=ro]");
    {
        let m = mount(&s, "mnt", base.to_str().unwrap(), &stack, &[]);
        std::fs::OpenOptions::new().append(true).open(m.path("f")).unwrap().write_all(b"+upper").unwrap();
        std::fs::remove_file(m.path("hidden")).unwrap();
        std::fs::remove_dir_all(m.path("d")).unwrap();
        std::fs::create_dir(m.path("d")).unwrap();
        let branches = op_json(&m.mnt, &["branch-list"]);
        assert_eq!((branches[0]["addr"].clone(), branches[1]["dir"].clone()), (addr.clone().into(), base.display().to_string().into()), "{branches}");
    }
    assert_eq!(std::fs::read_to_string(s.lower.join("f")).unwrap(), "base+upper");
    assert_eq!(std::fs::read_to_string(base.join("f")).unwrap(), "base");
    assert!(base.join("hidden").exists() && base.join("d/x").exists());
    let m = mount(&s, "again", base.to_str().unwrap(), &stack, &[]);
    assert_eq!(std::fs::read_to_string(m.path("f")).unwrap(), "base+upper");
    assert!(!m.path("hidden").exists());
    assert_eq!(std::fs::read_dir(m.path("d")).unwrap().count(), 0);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}
