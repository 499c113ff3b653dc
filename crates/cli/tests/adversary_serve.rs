//! The attacker's side of `plyfs serve` (#28, item 1): a client the server maps to a user of
//! its own (a Unix-socket peer admitted with `--allow-uid`, a root-squashed TCP client) tries to
//! gain what that user could not get on the server itself.
//!
//! The hostile client is written from `docs/protocol.md` alone: raw frames and MessagePack
//! built by hand, not the project's client or its wire types. It sends whatever it likes,
//! including a caller of pid 0 and uid 0.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use common::*;

// ---------------------------------------------------------------------------------------------
// MessagePack, as much as the protocol needs.

#[derive(Clone, Debug, PartialEq)]
enum V {
    Nil,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Arr(Vec<V>),
    Map(Vec<(V, V)>),
}

impl V {
    fn get(&self, key: &str) -> Option<&V> {
        match self {
            V::Map(kv) => kv.iter().find(|(k, _)| *k == V::Str(key.into())).map(|(_, v)| v),
            _ => None,
        }
    }

    fn int(&self) -> i64 {
        match self {
            V::Int(i) => *i,
            other => panic!("not an integer: {other:?}"),
        }
    }
}

fn s(v: &str) -> V {
    V::Str(v.into())
}

fn n(v: i64) -> V {
    V::Int(v)
}

fn b(v: &[u8]) -> V {
    V::Bin(v.to_vec())
}

fn map(kv: &[(&str, V)]) -> V {
    V::Map(kv.iter().map(|(k, v)| (s(k), v.clone())).collect())
}

fn encode(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::Bool(x) => out.push(if *x { 0xc3 } else { 0xc2 }),
        V::Int(i) if *i >= 0 => {
            out.push(0xcf);
            out.extend_from_slice(&(*i as u64).to_be_bytes());
        }
        V::Int(i) => {
            out.push(0xd3);
            out.extend_from_slice(&i.to_be_bytes());
        }
        V::Float(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_be_bytes());
        }
        V::Str(x) => {
            out.push(0xdb);
            out.extend_from_slice(&(x.len() as u32).to_be_bytes());
            out.extend_from_slice(x.as_bytes());
        }
        V::Bin(x) => {
            out.push(0xc6);
            out.extend_from_slice(&(x.len() as u32).to_be_bytes());
            out.extend_from_slice(x);
        }
        V::Arr(items) => {
            out.push(0xdd);
            out.extend_from_slice(&(items.len() as u32).to_be_bytes());
            items.iter().for_each(|i| encode(i, out));
        }
        V::Map(kv) => {
            out.push(0xdf);
            out.extend_from_slice(&(kv.len() as u32).to_be_bytes());
            for (k, v) in kv {
                encode(k, out);
                encode(v, out);
            }
        }
    }
}

fn decode(buf: &[u8], at: &mut usize) -> V {
    let take = |at: &mut usize, len: usize| -> Vec<u8> {
        let v = buf[*at..*at + len].to_vec();
        *at += len;
        v
    };
    let uint = |at: &mut usize, len: usize| -> u64 { take(at, len).iter().fold(0u64, |acc, &x| acc << 8 | u64::from(x)) };
    let tag = buf[*at];
    *at += 1;
    match tag {
        0x00..=0x7f => V::Int(i64::from(tag)),
        0x80..=0x8f => decode_map(buf, at, usize::from(tag & 0x0f)),
        0x90..=0x9f => decode_arr(buf, at, usize::from(tag & 0x0f)),
        0xa0..=0xbf => V::Str(String::from_utf8(take(at, usize::from(tag & 0x1f))).unwrap()),
        0xc0 => V::Nil,
        0xc2 => V::Bool(false),
        0xc3 => V::Bool(true),
        0xc4 | 0xc5 | 0xc6 => {
            let len = uint(at, 1 << (tag - 0xc4)) as usize;
            V::Bin(take(at, len))
        }
        0xca => V::Float(f64::from(f32::from_bits(uint(at, 4) as u32))),
        0xcb => V::Float(f64::from_bits(uint(at, 8))),
        0xcc..=0xcf => V::Int(uint(at, 1 << (tag - 0xcc)) as i64),
        0xd0 => V::Int(i64::from(take(at, 1)[0] as i8)),
        0xd1 => V::Int(i64::from(uint(at, 2) as u16 as i16)),
        0xd2 => V::Int(i64::from(uint(at, 4) as u32 as i32)),
        0xd3 => V::Int(uint(at, 8) as i64),
        0xd9..=0xdb => {
            let len = uint(at, 1 << (tag - 0xd9)) as usize;
            V::Str(String::from_utf8(take(at, len)).unwrap())
        }
        0xdc | 0xdd => {
            let len = uint(at, if tag == 0xdc { 2 } else { 4 }) as usize;
            decode_arr(buf, at, len)
        }
        0xde | 0xdf => {
            let len = uint(at, if tag == 0xde { 2 } else { 4 }) as usize;
            decode_map(buf, at, len)
        }
        0xe0..=0xff => V::Int(i64::from(tag as i8)),
        other => panic!("MessagePack type {other:#x} not expected from a server"),
    }
}

fn decode_arr(buf: &[u8], at: &mut usize, len: usize) -> V {
    V::Arr((0..len).map(|_| decode(buf, at)).collect())
}

fn decode_map(buf: &[u8], at: &mut usize, len: usize) -> V {
    V::Map((0..len).map(|_| (decode(buf, at), decode(buf, at))).collect())
}

// ---------------------------------------------------------------------------------------------
// The hostile client.

struct Hostile {
    stream: UnixStream,
    next_id: i64,
}

/// A reply: its kind (`r`), its value (`v`) and its payload.
#[derive(Debug)]
struct Rep {
    r: String,
    v: V,
    payload: Vec<u8>,
}

impl Rep {
    fn errno(&self) -> Option<i32> {
        (self.r == "error").then(|| self.v.get("errno").unwrap().int() as i32)
    }

    fn node(&self) -> i64 {
        assert_eq!(self.r, "entry", "{self:?}");
        self.v.get("node").unwrap().int()
    }

    fn fh(&self) -> i64 {
        match self.r.as_str() {
            "opened" => self.v.get("fh").unwrap().int(),
            "created" => match &self.v {
                V::Arr(pair) => pair[1].get("fh").unwrap().int(),
                other => panic!("{other:?}"),
            },
            _ => panic!("not opened: {self:?}"),
        }
    }
}

/// Set the calling thread's ids, and nothing else's (raw system calls: glibc would change
/// every thread of the test process).
fn become_user(uid: u32, gid: u32, groups: &[u32]) {
    unsafe {
        assert_eq!(libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()), 0);
        assert_eq!(libc::syscall(libc::SYS_setresgid, gid, gid, gid), 0);
        assert_eq!(libc::syscall(libc::SYS_setresuid, uid, uid, uid), 0);
    }
}

impl Hostile {
    /// Connect to the Unix socket as `uid`/`gid`/`groups` (the kernel tells the server these
    /// ids), on a thread that then ends, and say hello.
    fn connect_as(socket: &Path, uid: u32, gid: u32, groups: &[u32]) -> Hostile {
        let socket = socket.to_owned();
        let groups = groups.to_vec();
        let stream = std::thread::spawn(move || {
            become_user(uid, gid, &groups);
            UnixStream::connect(&socket).unwrap()
        })
        .join()
        .unwrap();
        stream.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
        let mut c = Hostile { stream, next_id: 1 };
        c.stream.write_all(b"plyfs\r\n\x01").unwrap();
        let mut preamble = [0u8; 8];
        c.stream.read_exact(&mut preamble).unwrap();
        assert_eq!(&preamble, b"plyfs\r\n\x01");
        c.send(&map(&[("t", s("hello")), ("versions", V::Arr(vec![n(1)])), ("software", s("hostile"))]), &[]);
        let (welcome, _) = c.frame();
        assert_eq!(welcome.get("t"), Some(&s("welcome")), "{welcome:?}");
        c
    }

    fn send(&mut self, header: &V, payload: &[u8]) {
        let mut h = Vec::new();
        encode(header, &mut h);
        let mut frame = Vec::new();
        frame.extend_from_slice(&(h.len() as u32).to_be_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(&h);
        frame.extend_from_slice(payload);
        self.stream.write_all(&frame).unwrap();
    }

    fn frame(&mut self) -> (V, Vec<u8>) {
        let mut lens = [0u8; 8];
        self.stream.read_exact(&mut lens).unwrap();
        let hlen = u32::from_be_bytes(lens[..4].try_into().unwrap()) as usize;
        let plen = u32::from_be_bytes(lens[4..].try_into().unwrap()) as usize;
        let mut h = vec![0u8; hlen];
        self.stream.read_exact(&mut h).unwrap();
        let mut p = vec![0u8; plen];
        self.stream.read_exact(&mut p).unwrap();
        (decode(&h, &mut 0), p)
    }

    /// Send `op` with `args`, claiming to be `caller` (uid, gid, pid), and wait for its reply.
    fn req_as(&mut self, caller: (i64, i64, i64), op: &str, args: &[(&str, V)], payload: &[u8]) -> Rep {
        let id = self.next_id;
        self.next_id += 1;
        let caller = map(&[("uid", n(caller.0)), ("gid", n(caller.1)), ("pid", n(caller.2))]);
        self.send(&map(&[("t", s("req")), ("id", n(id)), ("caller", caller), ("op", s(op)), ("args", map(args))]), payload);
        loop {
            let (h, payload) = self.frame();
            if h.get("t") == Some(&s("rep")) && h.get("id") == Some(&n(id)) {
                return Rep { r: match h.get("r") { Some(V::Str(r)) => r.clone(), other => panic!("{other:?}") }, v: h.get("v").cloned().unwrap_or(V::Nil), payload };
            }
        }
    }

    /// As [`Hostile::req_as`], claiming to be root with pid 0 (the daemon itself).
    fn req(&mut self, op: &str, args: &[(&str, V)], payload: &[u8]) -> Rep {
        self.req_as((0, 0, 0), op, args, payload)
    }

    fn lookup(&mut self, parent: i64, name: &str) -> Rep {
        self.req("lookup", &[("parent", n(parent)), ("name", b(name.as_bytes()))], &[])
    }
}

// ---------------------------------------------------------------------------------------------

const NOBODY: u32 = 65534;

/// A served export that `nobody` may write in, and the server's socket.
struct Export {
    _dir: tempfile::TempDir,
    root: PathBuf,
    lower: PathBuf,
    socket: PathBuf,
    _server: Server,
}

fn export(extra: &[&str]) -> Export {
    let dir = tempfile::Builder::new().prefix("plyfs-test-adv-").tempdir().unwrap();
    let root = dir.path().to_owned();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let lower = root.join("export");
    std::fs::create_dir(&lower).unwrap();
    std::fs::set_permissions(&lower, std::fs::Permissions::from_mode(0o777)).unwrap();
    let socket = root.join("s.sock");
    let listen = format!("unix:{}", socket.display());
    let mut args = vec!["--allow-uid", "65534"];
    args.extend_from_slice(extra);
    let server = Server::start(&lower, &listen, &args, &root.join("server.log"));
    // The socket is its owner's; the server's own check of its peers is what is tried here.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    Export { _dir: dir, root, lower, socket, _server: server }
}

fn nobody(e: &Export) -> Hostile {
    Hostile::connect_as(&e.socket, NOBODY, NOBODY, &[NOBODY])
}

const O_WRONLY: i64 = libc::O_WRONLY as i64;
const O_CREAT: i64 = libc::O_CREAT as i64;

#[test]
fn a_caller_of_pid_0_still_creates_as_the_mapped_user() {
    if !is_root() {
        return;
    }
    let e = export(&[]);
    let mut c = nobody(&e);
    let created = c.req(
        "create",
        &[("parent", n(1)), ("name", b(b"evil")), ("mode", n(0o104755)), ("flags", n(O_WRONLY | O_CREAT))],
        &[],
    );
    assert_eq!(created.r, "created", "{created:?}");
    let m = std::fs::metadata(e.lower.join("evil")).unwrap();
    assert_eq!((m.uid(), m.gid()), (NOBODY, NOBODY), "made as the mapped user, not as root");
    for (op, args) in [
        ("mkdir", vec![("parent", n(1)), ("name", b(b"dir")), ("mode", n(0o2755))]),
        ("mknod", vec![("parent", n(1)), ("name", b(b"fifo")), ("mode", n(i64::from(libc::S_IFIFO) | 0o644)), ("rdev", n(0))]),
        ("symlink", vec![("parent", n(1)), ("name", b(b"link")), ("target", b(b"evil"))]),
    ] {
        let r = c.req(op, &args, &[]);
        assert_eq!(r.r, "entry", "{op}: {r:?}");
    }
    for name in ["dir", "fifo", "link"] {
        let m = std::fs::symlink_metadata(e.lower.join(name)).unwrap();
        assert_eq!((m.uid(), m.gid()), (NOBODY, NOBODY), "{name}");
    }
}

#[test]
fn device_nodes_are_neither_made_nor_opened_by_a_mapped_client() {
    if !is_root() {
        return;
    }
    let e = export(&[]);
    // A device the server's administrator made (the null device: harmless to read here).
    let dev = common::cpath(&e.lower.join("dev"));
    assert_eq!(unsafe { libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) }, 0);
    let mut c = nobody(&e);
    let rdev = libc::makedev(8, 0) as i64; // the first SCSI disk
    for mode in [libc::S_IFCHR, libc::S_IFBLK] {
        let r = c.req(
            "mknod",
            &[("parent", n(1)), ("name", b(b"disk")), ("mode", n(i64::from(mode) | 0o666)), ("rdev", n(rdev))],
            &[],
        );
        assert_eq!(r.errno(), Some(libc::EPERM), "{r:?}");
        assert!(std::fs::symlink_metadata(e.lower.join("disk")).is_err());
    }
    let node = c.lookup(1, "dev").node();
    let r = c.req("open", &[("node", n(node)), ("flags", n(libc::O_RDONLY as i64))], &[]);
    assert_eq!(r.errno(), Some(libc::EACCES), "{r:?}");
}

#[test]
fn devices_can_be_allowed_by_the_server() {
    if !is_root() {
        return;
    }
    let e = export(&["--allow-devices"]);
    let dev = common::cpath(&e.lower.join("dev"));
    assert_eq!(unsafe { libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) }, 0);
    let mut c = nobody(&e);
    let node = c.lookup(1, "dev").node();
    let r = c.req("open", &[("node", n(node)), ("flags", n(libc::O_RDONLY as i64))], &[]);
    assert_eq!(r.r, "opened", "{r:?}");
    // Still not made: without CAP_MKNOD the kernel refuses the user itself.
    let r = c.req(
        "mknod",
        &[("parent", n(1)), ("name", b(b"disk")), ("mode", n(i64::from(libc::S_IFBLK) | 0o666)), ("rdev", n(libc::makedev(8, 0) as i64))],
        &[],
    );
    assert_eq!(r.errno(), Some(libc::EPERM), "{r:?}");
}

#[test]
fn a_mapped_client_may_not_chgrp_out_of_its_groups_nor_keep_set_ids() {
    if !is_root() {
        return;
    }
    let e = export(&[]);
    let mut c = nobody(&e);
    let created =
        c.req("create", &[("parent", n(1)), ("name", b(b"f")), ("mode", n(0o755)), ("flags", n(O_WRONLY | O_CREAT))], &[]);
    let node = match &created.v {
        V::Arr(pair) => pair[0].get("node").unwrap().int(),
        other => panic!("{other:?}"),
    };
    let fh = created.fh();
    let setattr = |c: &mut Hostile, mode: V, gid: V| {
        c.req(
            "setattr",
            &[
                ("node", n(node)),
                ("fh", V::Nil),
                ("mode", mode),
                ("uid", V::Nil),
                ("gid", gid),
                ("size", V::Nil),
                ("atime", V::Nil),
                ("mtime", V::Nil),
            ],
            &[],
        )
    };
    let r = setattr(&mut c, V::Nil, n(0));
    assert_eq!(r.errno(), Some(libc::EPERM), "chgrp 0: {r:?}");
    assert_eq!(std::fs::metadata(e.lower.join("f")).unwrap().gid(), NOBODY);
    // Its own group: set-group-ID is its to set, and a write by it... keeps it (the owner may);
    // the set-user-ID bit it sets is cleared when another user's write comes (below).
    let r = setattr(&mut c, n(0o6755), V::Nil);
    assert_eq!(r.r, "attr", "{r:?}");
    // Root (on the server) hands the file to root: the kernel clears both set-id bits.
    std::os::unix::fs::chown(e.lower.join("f"), Some(0), Some(0)).unwrap();
    std::fs::set_permissions(e.lower.join("f"), std::fs::Permissions::from_mode(0o6777)).unwrap();
    // A write by the mapped client to root's set-id file clears the bits, as it would locally.
    let w = c.req("write", &[("node", n(node)), ("fh", n(fh)), ("offset", n(0))], b"#!/bin/sh\n");
    assert_eq!(w.r, "written", "{w:?}");
    let mode = std::fs::metadata(e.lower.join("f")).unwrap().mode();
    assert_eq!(mode & 0o6000, 0, "set-id bits kept after another user's write: {mode:o}");
}

#[test]
fn privileged_attributes_are_refused_to_a_mapped_client() {
    if !is_root() {
        return;
    }
    let e = export(&[]);
    std::fs::write(e.lower.join("tool"), b"\x7fELF").unwrap();
    std::os::unix::fs::chown(e.lower.join("tool"), Some(NOBODY), Some(NOBODY)).unwrap();
    let mut c = nobody(&e);
    let node = c.lookup(1, "tool").node();
    // VFS_CAP_REVISION_2 with cap_dac_read_search permitted and effective.
    let mut cap = vec![0u8; 20];
    cap[..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
    cap[4..8].copy_from_slice(&(1u32 << 2).to_le_bytes());
    for name in ["security.capability", "trusted.overlay.opaque", "security.selinux"] {
        let r = c.req("setxattr", &[("node", n(node)), ("name", b(name.as_bytes())), ("flags", n(0))], &cap);
        assert_eq!(r.errno(), Some(libc::EPERM), "{name}: {r:?}");
        assert!(xattr(&e.lower.join("tool"), name).is_none(), "{name} was set");
    }
    // trusted.* set by root on the server is not shown to the client, as the kernel hides it.
    let path = common::cpath(&e.lower.join("tool"));
    assert_eq!(unsafe { libc::setxattr(path.as_ptr(), c"trusted.secret".as_ptr(), b"x".as_ptr().cast(), 1, 0) }, 0);
    let r = c.req("getxattr", &[("node", n(node)), ("name", b(b"trusted.secret")), ("size", n(64))], &[]);
    assert_eq!(r.errno(), Some(libc::ENODATA), "{r:?}");
    let r = c.req("listxattr", &[("node", n(node)), ("size", n(4096))], &[]);
    assert_eq!(r.r, "xattr", "{r:?}");
    assert!(!String::from_utf8_lossy(&r.payload).contains("trusted."), "{r:?}");
    let r = c.req("removexattr", &[("node", n(node)), ("name", b(b"trusted.secret"))], &[]);
    assert_eq!(r.errno(), Some(libc::EPERM), "{r:?}");
    // user.* stays the owner's to set.
    let r = c.req("setxattr", &[("node", n(node)), ("name", b(b"user.note")), ("flags", n(0))], b"mine");
    assert_eq!(r.r, "empty", "{r:?}");
}

fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let p = common::cpath(path);
    let name = std::ffi::CString::new(name).unwrap();
    let mut buf = [0u8; 256];
    let len = unsafe { libc::lgetxattr(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (len >= 0).then(|| buf[..len as usize].to_vec())
}

#[test]
fn protected_hardlinks_hold_for_a_mapped_client() {
    if !is_root() {
        return;
    }
    let e = export(&[]);
    std::fs::write(e.lower.join("shadow"), b"root's secret").unwrap();
    std::fs::set_permissions(e.lower.join("shadow"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut c = nobody(&e);
    let node = c.lookup(1, "shadow").node();
    let r = c.req("link", &[("node", n(node)), ("new_parent", n(1)), ("new_name", b(b"mine"))], &[]);
    assert_eq!(r.errno(), Some(libc::EPERM), "{r:?}");
    assert!(!e.lower.join("mine").exists());
    // Its own file it may link.
    c.req("create", &[("parent", n(1)), ("name", b(b"own")), ("mode", n(0o600)), ("flags", n(O_WRONLY | O_CREAT))], &[]);
    let own = c.lookup(1, "own").node();
    let r = c.req("link", &[("node", n(own)), ("new_parent", n(1)), ("new_name", b(b"own2"))], &[]);
    assert_eq!(r.r, "entry", "{r:?}");
}

#[test]
fn a_directory_moved_out_of_the_export_cannot_be_reached() {
    if !is_root() {
        return;
    }
    let e = export(&[]);
    std::fs::create_dir(e.lower.join("d")).unwrap();
    std::fs::set_permissions(e.lower.join("d"), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::write(e.root.join("outside-secret"), b"not exported").unwrap();
    let mut c = nobody(&e);
    let d = c.lookup(1, "d").node();
    // The server's administrator moves d out of the export while the client holds it.
    std::fs::rename(e.lower.join("d"), e.root.join("moved")).unwrap();
    let r = c.lookup(d, "..");
    assert!(matches!(r.errno(), Some(libc::ESTALE) | Some(libc::EPERM)), "{r:?}");
    let r = c.req("mkdir", &[("parent", n(d)), ("name", b(b"planted")), ("mode", n(0o755))], &[]);
    assert_eq!(r.errno(), Some(libc::ESTALE), "{r:?}");
    assert!(!e.root.join("moved/planted").exists());
    let r = c.req("opendir", &[("node", n(d))], &[]);
    assert_eq!(r.errno(), Some(libc::ESTALE), "{r:?}");
    // Inside the export, `..` still works (the per-file policy climbs that way); at its root not.
    std::fs::create_dir(e.lower.join("e")).unwrap();
    let e_node = c.lookup(1, "e").node();
    assert_eq!(c.lookup(e_node, "..").r, "entry");
    assert!(c.lookup(1, "..").errno().is_some());
}

#[test]
fn supplementary_groups_of_a_unix_peer_count() {
    if !is_root() {
        return;
    }
    let e = export(&[]);
    std::fs::write(e.lower.join("team"), b"for group 4242").unwrap();
    std::os::unix::fs::chown(e.lower.join("team"), Some(0), Some(4242)).unwrap();
    std::fs::set_permissions(e.lower.join("team"), std::fs::Permissions::from_mode(0o640)).unwrap();
    let read = |groups: &[u32]| {
        let mut c = Hostile::connect_as(&e.socket, NOBODY, NOBODY, groups);
        let node = c.lookup(1, "team").node();
        let r = c.req_as((65534, 65534, 1), "open", &[("node", n(node)), ("flags", n(libc::O_RDONLY as i64))], &[]);
        if let Some(errno) = r.errno() {
            return Err(errno);
        }
        let fh = r.fh();
        let r = c.req("read", &[("node", n(node)), ("fh", n(fh)), ("offset", n(0)), ("size", n(100))], &[]);
        Ok(r.payload)
    };
    assert_eq!(read(&[NOBODY, 4242]).unwrap(), b"for group 4242");
    assert_eq!(read(&[NOBODY]), Err(libc::EACCES));
}

/// Through the stock client: root on a mount of a root-squashed TCP server acts as nobody, and
/// cannot give a file root's group or file capabilities.
#[test]
fn root_on_a_squashed_mount_cannot_chgrp_0_or_setcap() {
    if !is_root() {
        return;
    }
    let (_dir, root, [lower, mnt]) = scratch_dirs(["lower", "mnt"]);
    std::fs::set_permissions(&lower, std::fs::Permissions::from_mode(0o777)).unwrap();
    let key = root.join("psk");
    std::fs::write(&key, [9u8; 32]).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let key_arg = format!("--psk={}", key.display());
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let _server = Server::start(&lower, &addr, &[&key_arg], &root.join("server.log"));
    let state = tempfile::Builder::new().prefix("plyfs-test-adv-mnt-").tempdir_in("/tmp").unwrap();
    let m = Mount::start(state, PathBuf::from(&addr), mnt, "null", &[&key_arg]);
    std::fs::write(m.path("tool"), b"#!/bin/sh\n").unwrap();
    assert_eq!(std::fs::metadata(lower.join("tool")).unwrap().uid(), NOBODY, "root is squashed");
    let err = std::os::unix::fs::chown(m.path("tool"), None, Some(0)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "chgrp 0: {err}");
    assert_eq!(std::fs::metadata(lower.join("tool")).unwrap().gid(), NOBODY);
    let mut cap = vec![0u8; 20];
    cap[..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
    cap[4..8].copy_from_slice(&(1u32 << 2).to_le_bytes());
    let p = common::cpath(&m.path("tool"));
    let r = unsafe { libc::setxattr(p.as_ptr(), c"security.capability".as_ptr(), cap.as_ptr().cast(), cap.len(), 0) };
    assert_eq!((r, errno()), (-1, libc::EPERM));
    assert!(xattr(&lower.join("tool"), "security.capability").is_none());
}
