//! `plyfs serve` attacked by the clients it maps (#28, item 1): a local user admitted with
//! `--allow-uid`, speaking the protocol with a client written here from `docs/protocol.md`
//! (raw frames, MessagePack through `rmpv`; not the project's own client), and root on a stock
//! `plyfs mount tcp:...`, squashed to `nobody`. The client sends whatever it likes, a caller of
//! uid 0 and pid 0 included. Every attack must be refused with the errno Linux gives and leave
//! the server's tree as it was.

mod common;

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use common::*;
use rmpv::Value;

const NOBODY: u32 = 65534;
const TEAM: u32 = 4242;
const FS_IOC_GETFLAGS: u32 = 0x8008_6601;
const FS_IOC_SETFLAGS: u32 = 0x4008_6602;
const FS_IMMUTABLE_FL: u32 = 0x10;

/// A Unix-socket connection to `sock` made as `uid`, `gid` and `groups`: the server reads the
/// peer's credentials at connect time, so a thread of its own takes these ids (raw system calls,
/// which change that thread only; glibc's would change every thread of the test) and connects.
fn connect_as(sock: &Path, uid: u32, gid: u32, groups: &[u32]) -> UnixStream {
    let (sock, groups) = (sock.to_owned(), groups.to_vec());
    std::thread::spawn(move || {
        unsafe {
            assert_eq!(libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()), 0);
            assert_eq!(libc::syscall(libc::SYS_setresgid, gid, gid, gid), 0);
            assert_eq!(libc::syscall(libc::SYS_setresuid, uid, uid, uid), 0);
        }
        UnixStream::connect(&sock).unwrap()
    })
    .join()
    .unwrap()
}

/// A protocol client written from `docs/protocol.md`. Its requests carry `caller`, which a
/// test may set to anything (the server must not care for a mapped peer).
struct Hostile {
    stream: UnixStream,
    next_id: u64,
    caller: (u32, u32, u32),
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

fn field<'a>(v: &'a Value, key: &str) -> &'a Value {
    static NIL: Value = Value::Nil;
    v.as_map().and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)).unwrap_or(&NIL)
}

fn name(n: &str) -> Value {
    Value::Binary(n.as_bytes().to_vec())
}

fn u(n: u64) -> Value {
    Value::from(n)
}

impl Hostile {
    fn new(mut stream: UnixStream) -> Hostile {
        const PREAMBLE: [u8; 8] = *b"plyfs\r\n\x01";
        stream.write_all(&PREAMBLE).unwrap();
        let mut theirs = [0u8; 8];
        stream.read_exact(&mut theirs).unwrap();
        assert_eq!(theirs, PREAMBLE);
        let mut c = Hostile { stream, next_id: 1, caller: (NOBODY, NOBODY, 4000) };
        let hello = map(vec![("t", "hello".into()), ("versions", Value::Array(vec![u(1)])), ("software", "adversary".into())]);
        c.send(&hello, &[]);
        let (welcome, _) = c.receive();
        assert_eq!(field(&welcome, "t").as_str(), Some("welcome"), "{welcome}");
        c
    }

    fn send(&mut self, header: &Value, payload: &[u8]) {
        let mut h = Vec::new();
        rmpv::encode::write_value(&mut h, header).unwrap();
        let mut frame = Vec::new();
        frame.extend_from_slice(&(h.len() as u32).to_be_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(&h);
        frame.extend_from_slice(payload);
        self.stream.write_all(&frame).unwrap();
    }

    fn receive(&mut self) -> (Value, Vec<u8>) {
        let mut lens = [0u8; 8];
        self.stream.read_exact(&mut lens).unwrap();
        let header_len = u32::from_be_bytes(lens[..4].try_into().unwrap()) as usize;
        let payload_len = u32::from_be_bytes(lens[4..].try_into().unwrap()) as usize;
        let mut header = vec![0u8; header_len];
        self.stream.read_exact(&mut header).unwrap();
        let mut payload = vec![0u8; payload_len];
        self.stream.read_exact(&mut payload).unwrap();
        (rmpv::decode::read_value(&mut &header[..]).unwrap(), payload)
    }

    /// One request; its reply's value and payload, or the errno of an `error` reply.
    fn call(&mut self, op: &str, args: Vec<(&str, Value)>, payload: &[u8]) -> Result<(Value, Vec<u8>), i32> {
        let id = self.next_id;
        self.next_id += 1;
        let (uid, gid, pid) = self.caller;
        let caller = map(vec![("uid", u(uid.into())), ("gid", u(gid.into())), ("pid", u(pid.into()))]);
        let req = map(vec![("t", "req".into()), ("id", u(id)), ("caller", caller), ("op", op.into()), ("args", map(args))]);
        self.send(&req, payload);
        loop {
            let (rep, payload) = self.receive();
            if field(&rep, "t").as_str() != Some("rep") || field(&rep, "id").as_u64() != Some(id) {
                continue;
            }
            let v = field(&rep, "v").clone();
            return match field(&rep, "r").as_str() {
                Some("error") => Err(field(&v, "errno").as_i64().unwrap() as i32),
                _ => Ok((v, payload)),
            };
        }
    }

    fn lookup(&mut self, parent: u64, n: &str) -> Result<u64, i32> {
        self.call("lookup", vec![("parent", u(parent)), ("name", name(n))], &[]).map(|(v, _)| field(&v, "node").as_u64().unwrap())
    }

    fn getattr(&mut self, node: u64) -> Result<Value, i32> {
        self.call("getattr", vec![("node", u(node)), ("fh", Value::Nil)], &[]).map(|(v, _)| v)
    }

    /// `create`: the new node and its handle.
    fn create(&mut self, parent: u64, n: &str, mode: u32, flags: i32) -> Result<(u64, u64), i32> {
        let args = vec![("parent", u(parent)), ("name", name(n)), ("mode", u(mode.into())), ("flags", Value::from(flags))];
        self.call("create", args, &[]).map(|(v, _)| {
            let pair = v.as_array().unwrap();
            (field(&pair[0], "node").as_u64().unwrap(), field(&pair[1], "fh").as_u64().unwrap())
        })
    }

    fn open(&mut self, node: u64, flags: i32) -> Result<u64, i32> {
        self.call("open", vec![("node", u(node)), ("flags", Value::from(flags))], &[]).map(|(v, _)| field(&v, "fh").as_u64().unwrap())
    }

    fn read(&mut self, node: u64, fh: u64, size: u32) -> Result<Vec<u8>, i32> {
        let args = vec![("node", u(node)), ("fh", u(fh)), ("offset", u(0)), ("size", u(size.into()))];
        self.call("read", args, &[]).map(|(_, data)| data)
    }

    fn mknod(&mut self, parent: u64, n: &str, mode: u32, rdev: u32) -> Result<u64, i32> {
        let args = vec![("parent", u(parent)), ("name", name(n)), ("mode", u(mode.into())), ("rdev", u(rdev.into()))];
        self.call("mknod", args, &[]).map(|(v, _)| field(&v, "node").as_u64().unwrap())
    }

    fn mkdir(&mut self, parent: u64, n: &str, mode: u32) -> Result<u64, i32> {
        let args = vec![("parent", u(parent)), ("name", name(n)), ("mode", u(mode.into()))];
        self.call("mkdir", args, &[]).map(|(v, _)| field(&v, "node").as_u64().unwrap())
    }

    fn setattr(&mut self, node: u64, mode: Option<u32>, gid: Option<u32>) -> Result<(), i32> {
        let opt = |x: Option<u32>| x.map_or(Value::Nil, |x| u(x.into()));
        let args = vec![
            ("node", u(node)),
            ("fh", Value::Nil),
            ("mode", opt(mode)),
            ("uid", Value::Nil),
            ("gid", opt(gid)),
            ("size", Value::Nil),
            ("atime", Value::Nil),
            ("mtime", Value::Nil),
        ];
        self.call("setattr", args, &[]).map(|_| ())
    }

    fn setxattr(&mut self, node: u64, n: &str, value: &[u8]) -> Result<(), i32> {
        self.call("setxattr", vec![("node", u(node)), ("name", name(n)), ("flags", u(0))], value).map(|_| ())
    }

    fn getxattr(&mut self, node: u64, n: &str) -> Result<Vec<u8>, i32> {
        self.call("getxattr", vec![("node", u(node)), ("name", name(n)), ("size", u(4096))], &[]).map(|(_, data)| data)
    }

    fn removexattr(&mut self, node: u64, n: &str) -> Result<(), i32> {
        self.call("removexattr", vec![("node", u(node)), ("name", name(n))], &[]).map(|_| ())
    }

    fn link(&mut self, node: u64, new_parent: u64, new_name: &str) -> Result<u64, i32> {
        let args = vec![("node", u(node)), ("new_parent", u(new_parent)), ("new_name", name(new_name))];
        self.call("link", args, &[]).map(|(v, _)| field(&v, "node").as_u64().unwrap())
    }
}

/// A directory served on a Unix socket that `nobody` may use (`--allow-uid 65534`); the lower
/// directory is writable by all, as a shared directory would be.
struct Served {
    _dir: tempfile::TempDir,
    root: PathBuf,
    lower: PathBuf,
    sock: PathBuf,
    _server: Server,
}

fn serve_for_nobody() -> Served {
    serve_for_nobody_with(&[])
}

fn serve_for_nobody_with(options: &[&str]) -> Served {
    let dir = tempfile::Builder::new().prefix("plyfs-adversary-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::set_permissions(&root, PermissionsExt::from_mode(0o755)).unwrap();
    let lower = root.join("lower");
    std::fs::create_dir(&lower).unwrap();
    std::fs::set_permissions(&lower, PermissionsExt::from_mode(0o777)).unwrap();
    let sock = root.join("s.sock");
    let server = Server::start(&lower, &format!("unix:{}", sock.display()), &[&["--allow-uid", "65534"], options].concat(), &root.join("server.log"));
    // The socket is its owner's only; the test lets the other user reach it.
    std::fs::set_permissions(&sock, PermissionsExt::from_mode(0o666)).unwrap();
    Served { _dir: dir, root, lower, sock, _server: server }
}

impl Served {
    fn nobody(&self) -> Hostile {
        Hostile::new(connect_as(&self.sock, NOBODY, NOBODY, &[]))
    }
}

fn mknod(path: &Path, mode: u32, dev: libc::dev_t) {
    assert_eq!(unsafe { libc::mknod(cpath(path).as_ptr(), mode, dev) }, 0, "mknod {}", path.display());
}

fn xattr(path: &Path, n: &str) -> Option<Vec<u8>> {
    let n = CString::new(n).unwrap();
    let mut buf = [0u8; 256];
    let len = unsafe { libc::lgetxattr(cpath(path).as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (len >= 0).then(|| buf[..len as usize].to_vec())
}

/// A version 2 `security.capability` value that gives CAP_DAC_READ_SEARCH, effective.
fn dac_read_search_capability() -> Vec<u8> {
    let mut v = Vec::new();
    for word in [0x0200_0000u32 | 1, 1 << 2, 0, 0, 0] {
        v.extend_from_slice(&word.to_le_bytes());
    }
    v
}

#[test]
fn a_request_that_claims_pid_0_still_runs_as_the_mapped_user() {
    if !is_root() {
        return;
    }
    let s = serve_for_nobody();
    let mut c = s.nobody();
    c.caller = (0, 0, 0);
    let _ = c.create(1, "evil", 0o104755, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL);
    let _ = c.mkdir(1, "evil-dir", 0o6777);
    let _ = c.mknod(1, "evil-fifo", libc::S_IFIFO | 0o6666, 0);
    let _ = c.call("symlink", vec![("parent", u(1)), ("name", name("evil-link")), ("target", name("evil"))], &[]);
    for n in ["evil", "evil-dir", "evil-fifo", "evil-link"] {
        let meta = std::fs::symlink_metadata(s.lower.join(n)).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (NOBODY, NOBODY), "{n} was made as root");
    }
    // In a directory only root may write to, nothing is made at all.
    let private = s.lower.join("private");
    std::fs::create_dir(&private).unwrap();
    let dir = c.lookup(1, "private").unwrap();
    assert_eq!(c.create(dir, "evil", 0o104755, libc::O_WRONLY | libc::O_CREAT), Err(libc::EACCES));
    assert_eq!(c.mkdir(dir, "evil-dir", 0o755), Err(libc::EACCES));
    assert_eq!(std::fs::read_dir(&private).unwrap().count(), 0);
}

#[test]
fn device_nodes_can_be_neither_made_nor_opened() {
    if !is_root() {
        return;
    }
    let s = serve_for_nobody();
    mknod(&s.lower.join("zero"), libc::S_IFCHR | 0o666, libc::makedev(1, 5));
    let mut c = s.nobody();
    for (n, kind) in [("disk", libc::S_IFBLK), ("mem", libc::S_IFCHR)] {
        assert_eq!(c.mknod(1, n, kind | 0o666, libc::makedev(1, 5) as u32), Err(libc::EPERM), "{n}");
        assert!(!s.lower.join(n).exists(), "{n}");
    }
    let zero = c.lookup(1, "zero").unwrap();
    assert_eq!(c.open(zero, libc::O_RDONLY), Err(libc::EACCES));
    assert_eq!(c.open(zero, libc::O_RDWR), Err(libc::EACCES));
    // Nor through `create` of the existing name.
    assert_eq!(c.create(1, "zero", 0o644, libc::O_RDONLY | libc::O_CREAT).map(|_| ()), Err(libc::EACCES));
}

#[test]
fn chgrp_is_only_to_the_callers_groups_and_setgid_only_in_them() {
    if !is_root() {
        return;
    }
    let s = serve_for_nobody();
    let mut c = s.nobody();
    let (mine, fh) = c.create(1, "mine", 0o755, libc::O_WRONLY | libc::O_CREAT).unwrap();
    assert_eq!(c.setattr(mine, None, Some(0)), Err(libc::EPERM));
    assert_eq!(c.setattr(mine, Some(0o2755), Some(0)), Err(libc::EPERM));
    let meta = std::fs::metadata(s.lower.join("mine")).unwrap();
    assert_eq!((meta.gid(), meta.mode() & 0o7777), (NOBODY, 0o755));
    // Its own group is fine.
    c.setattr(mine, Some(0o2755), Some(NOBODY)).unwrap();
    let attr = c.getattr(mine).unwrap();
    assert_eq!((field(&attr, "gid").as_u64(), field(&attr, "perm").as_u64()), (Some(NOBODY.into()), Some(0o2755)));
    // Root on the server makes it a set-ID root file; the client's write (it holds the file
    // open) clears both bits, as a local write by another user would.
    std::os::unix::fs::chown(s.lower.join("mine"), Some(0), Some(0)).unwrap();
    std::fs::set_permissions(s.lower.join("mine"), PermissionsExt::from_mode(0o6777)).unwrap();
    c.call("write", vec![("node", u(mine)), ("fh", u(fh)), ("offset", u(0))], b"#!/bin/sh\n").unwrap();
    let mode = std::fs::metadata(s.lower.join("mine")).unwrap().mode();
    assert_eq!(mode & 0o6000, 0, "set-ID bits kept after another user's write: {mode:o}");
}

#[test]
fn security_and_trusted_attributes_cannot_be_set_or_removed() {
    if !is_root() {
        return;
    }
    let s = serve_for_nobody();
    let mut c = s.nobody();
    let (mine, _) = c.create(1, "mine", 0o755, libc::O_WRONLY | libc::O_CREAT).unwrap();
    let lower = s.lower.join("mine");
    let set = |n: &str, v: &[u8]| {
        let n = CString::new(n).unwrap();
        assert_eq!(unsafe { libc::lsetxattr(cpath(&lower).as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) }, 0);
    };
    set("trusted.kept", b"root's");
    assert_eq!(c.setxattr(mine, "security.capability", &dac_read_search_capability()), Err(libc::EPERM));
    assert_eq!(c.setxattr(mine, "trusted.overlay.redirect", b"/etc"), Err(libc::EPERM));
    assert_eq!(c.removexattr(mine, "trusted.kept"), Err(libc::EPERM));
    assert_eq!(c.getxattr(mine, "trusted.kept"), Err(libc::ENODATA));
    let (_, names) = c.call("listxattr", vec![("node", u(mine)), ("size", u(4096))], &[]).unwrap();
    assert!(!String::from_utf8_lossy(&names).contains("trusted."), "trusted.* listed: {names:?}");
    assert_eq!(xattr(&lower, "security.capability"), None);
    assert_eq!(xattr(&lower, "trusted.overlay.redirect"), None);
    assert_eq!(xattr(&lower, "trusted.kept").as_deref(), Some(&b"root's"[..]));
    // The user's own namespace is its own.
    c.setxattr(mine, "user.note", b"fine").unwrap();
    assert_eq!(xattr(&lower, "user.note").as_deref(), Some(&b"fine"[..]));
}

#[test]
fn no_file_can_be_made_immutable_neither_its_own_nor_roots() {
    if !is_root() {
        return;
    }
    let s = serve_for_nobody();
    let mut c = s.nobody();
    let (mine, _) = c.create(1, "mine", 0o644, libc::O_WRONLY | libc::O_CREAT).unwrap();
    let lower = s.lower.join("mine");
    let theirs = s.lower.join("theirs");
    std::fs::write(&theirs, b"root's").unwrap();
    let their_node = c.lookup(1, "theirs").unwrap();
    for (node, path) in [(mine, &lower), (their_node, &theirs)] {
        let fh = c.open(node, libc::O_RDONLY).unwrap();
        let args = vec![("node", u(node)), ("fh", u(fh)), ("cmd", u(FS_IOC_SETFLAGS.into())), ("out_size", u(0))];
        let frozen = c.call("ioctl", args, &FS_IMMUTABLE_FL.to_le_bytes()).map(|_| ());
        let flags = get_file_flags(path).unwrap();
        set_file_flags(path, flags & !(FS_IMMUTABLE_FL as i32));
        assert_eq!((frozen, flags & FS_IMMUTABLE_FL as i32), (Err(libc::EPERM), 0), "{}", path.display());
    }
    // A handle the connection never opened names nothing.
    let args = vec![("node", u(mine)), ("fh", u(9999)), ("cmd", u(FS_IOC_GETFLAGS.into())), ("out_size", u(4))];
    assert_eq!(c.call("ioctl", args, &[]).map(|_| ()), Err(libc::EBADF));
}

#[test]
fn no_hard_link_to_a_file_the_caller_may_not_read_and_write() {
    if !is_root() {
        return;
    }
    let s = serve_for_nobody();
    let secret = s.lower.join("secret");
    std::fs::write(&secret, b"root only").unwrap();
    std::fs::set_permissions(&secret, PermissionsExt::from_mode(0o600)).unwrap();
    let mut c = s.nobody();
    let node = c.lookup(1, "secret").unwrap();
    assert_eq!(c.link(node, 1, "mine"), Err(libc::EPERM));
    assert!(!s.lower.join("mine").exists());
    assert_eq!(std::fs::metadata(&secret).unwrap().nlink(), 1);
}

#[test]
fn dot_names_and_a_directory_moved_out_of_the_export_lead_nowhere() {
    if !is_root() {
        return;
    }
    let s = serve_for_nobody();
    let inside = s.lower.join("d");
    std::fs::create_dir(&inside).unwrap();
    std::fs::set_permissions(&inside, PermissionsExt::from_mode(0o777)).unwrap();
    let outside = s.root.join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::set_permissions(&outside, PermissionsExt::from_mode(0o777)).unwrap();
    let mut c = s.nobody();
    let d = c.lookup(1, "d").unwrap();
    for (parent, n) in [(1, ".."), (1, "."), (d, ".")] {
        assert_eq!(c.lookup(parent, n), Err(libc::EPERM), "{parent} {n}");
    }
    // Inside the export `..` is the parent (the per-file policy climbs that way).
    assert_eq!(c.lookup(d, ".."), Ok(1));
    // Someone on the server moves the directory out while the client holds it.
    std::fs::rename(&inside, outside.join("d")).unwrap();
    assert_eq!(c.getattr(d).map(|_| ()), Err(libc::ESTALE));
    assert!(matches!(c.lookup(d, ".."), Err(libc::ESTALE | libc::EPERM)));
    assert_eq!(c.create(d, "planted", 0o644, libc::O_WRONLY | libc::O_CREAT).map(|_| ()), Err(libc::ESTALE));
    assert_eq!(c.mkdir(d, "planted-dir", 0o755), Err(libc::ESTALE));
    assert_eq!(c.call("opendir", vec![("node", u(d))], &[]).map(|_| ()), Err(libc::ESTALE));
    assert_eq!(std::fs::read_dir(outside.join("d")).unwrap().count(), 0);
}

#[test]
fn a_supplementary_group_of_the_peer_grants_access() {
    if !is_root() {
        return;
    }
    let s = serve_for_nobody();
    let team = s.lower.join("team");
    std::fs::create_dir(&team).unwrap();
    std::fs::write(team.join("plan"), b"team only").unwrap();
    for (p, mode) in [(&team, 0o770), (&team.join("plan"), 0o660)] {
        std::os::unix::fs::chown(p, Some(0), Some(TEAM)).unwrap();
        std::fs::set_permissions(p, PermissionsExt::from_mode(mode)).unwrap();
    }
    let mut member = Hostile::new(connect_as(&s.sock, NOBODY, NOBODY, &[TEAM]));
    let dir = member.lookup(1, "team").unwrap();
    let plan = member.lookup(dir, "plan").unwrap();
    let fh = member.open(plan, libc::O_RDONLY).unwrap();
    assert_eq!(member.read(plan, fh, 100).unwrap(), b"team only");
    member.create(dir, "notes", 0o640, libc::O_WRONLY | libc::O_CREAT).unwrap();
    assert_eq!(std::fs::metadata(team.join("notes")).unwrap().uid(), NOBODY);
    // The same user without the group is kept out.
    let mut outsider = s.nobody();
    assert_eq!(outsider.lookup(1, "team").and_then(|d| outsider.lookup(d, "plan")), Err(libc::EACCES));
}

#[test]
fn root_on_a_tcp_mount_can_neither_chgrp_0_nor_setgid_root_nor_setcap() {
    if !is_root() {
        return;
    }
    let dir = tempfile::Builder::new().prefix("plyfs-adversary-tcp-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let lower = root.join("lower");
    std::fs::create_dir(&lower).unwrap();
    std::fs::set_permissions(&lower, PermissionsExt::from_mode(0o777)).unwrap();
    let key = root.join("psk");
    std::fs::write(&key, [7u8; 32]).unwrap();
    std::fs::set_permissions(&key, PermissionsExt::from_mode(0o600)).unwrap();
    let key_arg = format!("--psk={}", key.display());
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let _server = Server::start(&lower, &addr, &[&key_arg], &root.join("server.log"));
    let mnt = root.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mount_dir = tempfile::Builder::new().prefix("plyfs-adversary-mnt-").tempdir_in("/tmp").unwrap();
    let m = Mount::start(mount_dir, PathBuf::from(&addr), mnt, "null", &[&key_arg]);

    let f = m.path("f");
    std::fs::write(&f, b"#!/bin/sh\nid\n").unwrap();
    std::fs::set_permissions(&f, PermissionsExt::from_mode(0o755)).unwrap();
    let err = std::os::unix::fs::chown(&f, None, Some(0)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "chgrp 0: {err}");
    let _ = std::fs::set_permissions(&f, PermissionsExt::from_mode(0o2755));
    let cap = dac_read_search_capability();
    let rc = unsafe { libc::setxattr(cpath(&f).as_ptr(), c"security.capability".as_ptr(), cap.as_ptr().cast(), cap.len(), 0) };
    assert_eq!((rc, errno()), (-1, libc::EPERM), "setcap");

    let meta = std::fs::metadata(lower.join("f")).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (NOBODY, NOBODY));
    assert!(!(meta.gid() == 0 && meta.mode() & 0o2000 != 0), "a set-group-ID root file: {:o}", meta.mode());
    assert_eq!(xattr(&lower.join("f"), "security.capability"), None);
}

#[test]
fn the_server_may_allow_devices_and_privileged_attributes() {
    if !is_root() {
        return;
    }
    let s = serve_for_nobody_with(&["--allow-devices", "--allow-privileged-xattrs"]);
    mknod(&s.lower.join("zero"), libc::S_IFCHR | 0o666, libc::makedev(1, 5));
    let mut c = s.nobody();
    let zero = c.lookup(1, "zero").unwrap();
    let fh = c.open(zero, libc::O_RDONLY).unwrap();
    assert_eq!(c.read(zero, fh, 4).unwrap(), [0; 4]);
    // Making one still needs CAP_MKNOD, which the server drops while it acts as the user.
    assert_eq!(c.mknod(1, "mem", libc::S_IFCHR | 0o666, libc::makedev(1, 1) as u32), Err(libc::EPERM));
    let (mine, _) = c.create(1, "mine", 0o644, libc::O_WRONLY | libc::O_CREAT).unwrap();
    c.setxattr(mine, "trusted.note", b"allowed").unwrap();
    assert_eq!(xattr(&s.lower.join("mine"), "trusted.note").as_deref(), Some(&b"allowed"[..]));
}
