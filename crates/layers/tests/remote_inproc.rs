//! A server and a `remote` layer in one process, over a real Unix socket.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use plyfs_stack::{Caller, Error, Level, LowerDir, NodeId, Op, Reply};
use plyfs_transport::listen::{bind_unix, serve_unix, UnixPolicy};
use plyfs_transport::server::{Server, ServerOptions};
use plyfs_transport::wire::{self, CompoundOp, Message, OpHeader, RequestOp, WireCaller, WireReply};
use plyfs_layers::remote::Remote;
use plyfs_transport::{Addr, PlainConnector};

struct Served {
    _dir: tempfile::TempDir,
    lower: PathBuf,
    socket: PathBuf,
}

fn serve() -> Served {
    let dir = tempfile::tempdir().unwrap();
    let lower = dir.path().join("lower");
    std::fs::create_dir(&lower).unwrap();
    let socket = dir.path().join("s.sock");
    let stack = plyfs_stack::Stack::build(&[], &[], Arc::new(LowerDir::open(&lower).unwrap())).unwrap();
    let server = Server::for_stack(&stack, ServerOptions::default());
    let listener = bind_unix(&socket).unwrap();
    std::thread::spawn(move || serve_unix(server, listener, UnixPolicy::default()));
    Served { _dir: dir, lower, socket }
}

fn remote(socket: &Path) -> Level {
    Remote::connect("remote", Box::new(PlainConnector(Addr::Unix(socket.to_owned()))), Duration::from_secs(5)).unwrap().level()
}

fn cx() -> Caller {
    Caller::daemon()
}

#[test]
fn files_and_directories_round_trip() {
    let s = serve();
    let r = remote(&s.socket);
    let (e, o) = r.create(&cx(), NodeId::ROOT, OsStr::new("f"), 0o644, libc::O_RDWR).unwrap();
    assert_eq!(r.write(&cx(), e.node, o.fh, 0, b"hello world").unwrap(), 11);
    assert_eq!(r.read(&cx(), e.node, o.fh, 6, 100).unwrap(), b"world");
    r.release(&cx(), e.node, o.fh).unwrap();
    assert_eq!(std::fs::read(s.lower.join("f")).unwrap(), b"hello world");
    // Inode numbers read the same on both sides.
    use std::os::unix::fs::MetadataExt;
    assert_eq!(e.node.0, std::fs::metadata(s.lower.join("f")).unwrap().ino());
    let d = r.mkdir(&cx(), NodeId::ROOT, OsStr::new("d"), 0o755).unwrap();
    let op = Op::Rename { parent: NodeId::ROOT, name: OsStr::new("f"), new_parent: d.node, new_name: OsStr::new("g"), flags: 0 };
    r.call(&cx(), &op).unwrap();
    let names: Vec<_> = r.list_dir(&cx(), d.node).unwrap().into_iter().map(|e| e.name).collect();
    assert_eq!(names, vec![OsStr::new("g").to_owned()]);
    assert!(matches!(r.lookup(&cx(), NodeId::ROOT, OsStr::new("f")), Err(Error::Os(libc::ENOENT))));
    // Extended operations cross without the transport knowing them.
    let info = r.extended(&cx(), d.node, "lower-info", &[]).unwrap();
    assert!(info.to_string().contains("\"d\""), "{info}");
    assert!(matches!(r.extended(&cx(), d.node, "no-such-op", &[]), Err(Error::UnsupportedOp { .. })));
}

/// A raw client: preamble and hello done.
fn raw(socket: &Path) -> UnixStream {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&wire::PREAMBLE).unwrap();
    let hello = Message::Hello { versions: vec![1], software: "test".into(), auth: None };
    wire::write_frame(&mut s, &wire::encode(&hello), &[]).unwrap();
    wire::read_preamble(&mut s).unwrap();
    let f = wire::read_frame(&mut s).unwrap();
    assert!(matches!(wire::decode(&f.header), Ok(Message::Welcome { .. })));
    s
}

fn request(s: &mut UnixStream, op: impl Into<RequestOp>) -> WireReply {
    let req = Message::Req { id: 9, caller: WireCaller { uid: 0, gid: 0, pid: 1 }, op: op.into() };
    wire::write_frame(s, &wire::encode(&req), &[]).unwrap();
    let f = wire::read_frame(s).unwrap();
    match wire::decode(&f.header).unwrap() {
        Message::Rep { id: 9, reply } => reply,
        other => panic!("{other:?}"),
    }
}

fn errno(r: WireReply) -> i32 {
    match r {
        WireReply::Error(e) => e.errno,
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn a_client_cannot_reach_outside_the_export() {
    let s = serve();
    std::fs::write(s.lower.join("inside"), b"x").unwrap();
    std::os::unix::fs::symlink("/etc", s.lower.join("out")).unwrap();
    let mut c = raw(&s.socket);
    let name = |n: &str| serde_bytes::ByteBuf::from(n.as_bytes().to_vec());
    assert_eq!(errno(request(&mut c, OpHeader::Lookup { parent: 1, name: name("..") })), libc::EPERM);
    assert_eq!(errno(request(&mut c, OpHeader::Lookup { parent: 1, name: name("../x") })), libc::EPERM);
    // A node id this connection never looked up (a real inode number outside the tree).
    use std::os::unix::fs::MetadataExt;
    let etc = std::fs::metadata("/etc").unwrap().ino();
    assert_eq!(errno(request(&mut c, OpHeader::GetAttr { node: etc, fh: None })), libc::ESTALE);
    // Nor through a symlink: the lookup gives the link, never what it points to.
    let out = match request(&mut c, OpHeader::Lookup { parent: 1, name: name("out") }) {
        WireReply::Entry(e) => e,
        other => panic!("{other:?}"),
    };
    assert_eq!(out.attr.kind, wire::WireKind::Symlink);
    assert_eq!(errno(request(&mut c, OpHeader::Lookup { parent: out.node, name: name("passwd") })), libc::ENOTDIR);
    // Another connection's handle.
    let inside = match request(&mut c, OpHeader::Lookup { parent: 1, name: name("inside") }) {
        WireReply::Entry(e) => e.node,
        other => panic!("{other:?}"),
    };
    let fh = match request(&mut c, OpHeader::Open { node: inside, flags: libc::O_RDONLY }) {
        WireReply::Opened(o) => o.fh,
        other => panic!("{other:?}"),
    };
    let mut other = raw(&s.socket);
    let _ = request(&mut other, OpHeader::Lookup { parent: 1, name: name("inside") });
    assert_eq!(errno(request(&mut other, OpHeader::Read { node: inside, fh, offset: 0, size: 1 })), libc::EBADF);
}

#[test]
fn garbage_gets_an_error_or_a_closed_connection_and_the_server_lives_on() {
    let s = serve();
    // Not the protocol at all.
    let mut c = UnixStream::connect(&s.socket).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    // An unknown operation is answered, and the connection goes on.
    let mut c = raw(&s.socket);
    let mut map = std::collections::BTreeMap::new();
    map.insert("t", rmpv::Value::from("req"));
    map.insert("id", rmpv::Value::from(5));
    map.insert("op", rmpv::Value::from("teleport"));
    wire::write_frame(&mut c, &rmp_serde::to_vec_named(&map).unwrap(), &[]).unwrap();
    let f = wire::read_frame(&mut c).unwrap();
    match wire::decode(&f.header).unwrap() {
        Message::Rep { id: 5, reply: WireReply::Error(e) } => assert_eq!(e.errno, libc::ENOSYS, "{}", e.msg),
        other => panic!("{other:?}"),
    }
    assert!(matches!(request(&mut c, OpHeader::GetAttr { node: 1, fh: None }), WireReply::Attr(_)));
    // A payload where none belongs, and arguments of the wrong type.
    let req = Message::Req { id: 9, caller: WireCaller { uid: 0, gid: 0, pid: 1 }, op: OpHeader::GetAttr { node: 1, fh: None }.into() };
    wire::write_frame(&mut c, &wire::encode(&req), b"junk").unwrap();
    let f = wire::read_frame(&mut c).unwrap();
    assert!(matches!(wire::decode(&f.header).unwrap(), Message::Rep { reply: WireReply::Error(_), .. }));
    // A frame claiming 4 GiB closes the connection without allocating it.
    c.write_all(&[0xff; 8]).unwrap();
    let mut buf = Vec::new();
    assert!(c.read_to_end(&mut buf).is_ok());
    // A truncated frame, then silence: the server gives up on it at close.
    let mut c = raw(&s.socket);
    c.write_all(&[0, 0, 0, 50, 0, 0, 0, 0, 1, 2, 3]).unwrap();
    drop(c);
    // Random bytes after a good hello.
    let mut c = raw(&s.socket);
    let mut seed = 7u64;
    let junk: Vec<u8> = (0..4096)
        .map(|_| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u8
        })
        .collect();
    let _ = c.write_all(&junk);
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    // Still serving.
    let r = remote(&s.socket);
    assert!(r.getattr(&cx(), NodeId::ROOT).is_ok());
}

#[test]
fn a_wrong_version_is_refused_with_a_reason() {
    let s = serve();
    let mut c = UnixStream::connect(&s.socket).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.write_all(&wire::PREAMBLE).unwrap();
    let hello = Message::Hello { versions: vec![99], software: "test".into(), auth: None };
    wire::write_frame(&mut c, &wire::encode(&hello), &[]).unwrap();
    wire::read_preamble(&mut c).unwrap();
    let f = wire::read_frame(&mut c).unwrap();
    match wire::decode(&f.header).unwrap() {
        Message::Refused { reason } => assert!(reason.contains("version"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

/// `listdir` opens a directory and reads it with attributes in one request; a directory longer
/// than asked for is read on with `readdir`; its entries count as lookups.
#[test]
fn listdir_reads_a_directory_in_one_request() {
    let s = serve();
    std::fs::create_dir(s.lower.join("d")).unwrap();
    for n in ["a", "b", "c"] {
        std::fs::write(s.lower.join("d").join(n), n).unwrap();
    }
    let mut c = raw(&s.socket);
    let name = |n: &str| serde_bytes::ByteBuf::from(n.as_bytes().to_vec());
    let d = match request(&mut c, OpHeader::Lookup { parent: 1, name: name("d") }) {
        WireReply::Entry(e) => e.node,
        other => panic!("{other:?}"),
    };
    let listed = |l: &wire::WireListing| -> Vec<String> {
        let mut names: Vec<String> = l.entries.iter().map(|e| String::from_utf8_lossy(&e.name).into_owned()).filter(|n| n != "." && n != "..").collect();
        names.sort();
        names
    };
    // (An empty answer ends a listing only for a window of at least 128 entries: see
    // `END_WINDOW` in the server.)
    let whole = match request(&mut c, CompoundOp::ListDir { node: d, max_entries: 1000 }) {
        WireReply::Listing(l) => l,
        other => panic!("{other:?}"),
    };
    assert_eq!(listed(&whole), ["a", "b", "c"]);
    assert!(whole.complete);
    assert!(matches!(request(&mut c, OpHeader::ReleaseDir { node: d, fh: whole.fh }), WireReply::Empty));
    let a = whole.entries.iter().find(|e| &e.name[..] == b"a").and_then(|e| e.entry).expect("with its attributes");
    assert_eq!(a.attr.size, 1);
    // The entry is held: the connection may name it.
    assert!(matches!(request(&mut c, OpHeader::GetAttr { node: a.node, fh: None }), WireReply::Attr(_)));
    // Two entries of five: the rest is read on the handle the listing leaves open.
    let first = match request(&mut c, CompoundOp::ListDir { node: d, max_entries: 2 }) {
        WireReply::Listing(l) => l,
        other => panic!("{other:?}"),
    };
    assert_eq!(first.entries.len(), 2);
    assert!(!first.complete);
    let fh = first.fh;
    let offset = first.entries.last().unwrap().next;
    let rest = match request(&mut c, OpHeader::ReadDir { node: d, fh, offset, max_entries: 100, plus: false }) {
        WireReply::Dir(rest) => rest,
        other => panic!("{other:?}"),
    };
    let mut all: Vec<String> = first.entries.iter().chain(&rest).map(|e| String::from_utf8_lossy(&e.name).into_owned()).collect();
    all.sort();
    assert_eq!(all, [".", "..", "a", "b", "c"]);
    assert!(matches!(request(&mut c, OpHeader::ReleaseDir { node: d, fh }), WireReply::Empty));
    // What opendir refuses, listdir refuses.
    assert_eq!(errno(request(&mut c, CompoundOp::ListDir { node: a.node, max_entries: 100 })), libc::ENOTDIR);
    assert_eq!(errno(request(&mut c, CompoundOp::ListDir { node: 999_999, max_entries: 100 })), libc::ESTALE);
}

fn name(n: &str) -> serde_bytes::ByteBuf {
    serde_bytes::ByteBuf::from(n.as_bytes().to_vec())
}

fn entry_of(r: WireReply) -> wire::WireEntry {
    match r {
        WireReply::Entry(e) => e,
        other => panic!("expected an entry, got {other:?}"),
    }
}

fn listing_of(r: WireReply) -> wire::WireListing {
    match r {
        WireReply::Listing(l) => l,
        other => panic!("expected a listing, got {other:?}"),
    }
}

fn dir_of(r: WireReply) -> Vec<wire::WireDirEntry> {
    match r {
        WireReply::Dir(d) => d,
        other => panic!("expected directory entries, got {other:?}"),
    }
}

/// `listdir`'s handle against a hostile client (issue #33): another connection's handle, a
/// handle given back, a file's handle, windows of nothing and of everything, and offsets past
/// the end. Each gets a clear error or an empty, correct answer, and the listing the first
/// connection has in progress reads on undisturbed, to the last name, after the other
/// connection has tried all this and gone.
#[test]
fn a_hostile_client_cannot_disturb_another_connections_listing() {
    let s = serve();
    const FILES: usize = 4200;
    std::fs::create_dir(s.lower.join("d")).unwrap();
    for i in 0..FILES {
        std::fs::write(s.lower.join("d").join(format!("f{i}")), b"").unwrap();
    }
    let mut want: Vec<String> = (0..FILES).map(|i| format!("f{i}")).chain([".".into(), "..".into()]).collect();
    want.sort();
    let names = |entries: &[wire::WireDirEntry]| -> Vec<String> {
        let mut n: Vec<String> = entries.iter().map(|e| String::from_utf8_lossy(&e.name).into_owned()).collect();
        n.sort();
        n
    };

    // The listing in progress: connection a, two entries read.
    let mut a = raw(&s.socket);
    let d = entry_of(request(&mut a, OpHeader::Lookup { parent: 1, name: name("d") })).node;
    let listing = listing_of(request(&mut a, CompoundOp::ListDir { node: d, max_entries: 2 }));
    assert_eq!(listing.entries.len(), 2);
    assert!(!listing.complete);
    let a_fh = listing.fh;
    let mut a_read = listing.entries;

    let mut b = raw(&s.socket);
    let bd = entry_of(request(&mut b, OpHeader::Lookup { parent: 1, name: name("d") })).node;
    assert_eq!(bd, d);
    // a's handle, named by b: refused, whatever b asks of it.
    assert_eq!(errno(request(&mut b, OpHeader::ReadDir { node: d, fh: a_fh, offset: 0, max_entries: 100, plus: true })), libc::EBADF);
    assert_eq!(errno(request(&mut b, OpHeader::ReadDir { node: d, fh: a_fh, offset: 2, max_entries: 100, plus: false })), libc::EBADF);
    assert_eq!(errno(request(&mut b, OpHeader::FsyncDir { node: d, fh: a_fh, datasync: false })), libc::EBADF);
    assert_eq!(errno(request(&mut b, OpHeader::ReleaseDir { node: d, fh: a_fh })), libc::EBADF);
    assert_eq!(errno(request(&mut b, OpHeader::Release { node: d, fh: a_fh })), libc::EBADF);

    // A handle given back is no handle.
    let given_back = listing_of(request(&mut b, CompoundOp::ListDir { node: d, max_entries: 10 })).fh;
    assert!(matches!(request(&mut b, OpHeader::ReleaseDir { node: d, fh: given_back }), WireReply::Empty));
    assert_eq!(errno(request(&mut b, OpHeader::ReadDir { node: d, fh: given_back, offset: 10, max_entries: 10, plus: true })), libc::EBADF);
    assert_eq!(errno(request(&mut b, OpHeader::ReleaseDir { node: d, fh: given_back })), libc::EBADF);

    // A file's handle is no directory's, on the file or on the directory; a file is not listed.
    let f0 = entry_of(request(&mut b, OpHeader::Lookup { parent: d, name: name("f0") })).node;
    let file_fh = match request(&mut b, OpHeader::Open { node: f0, flags: libc::O_RDONLY }) {
        WireReply::Opened(o) => o.fh,
        other => panic!("{other:?}"),
    };
    assert_eq!(errno(request(&mut b, OpHeader::ReadDir { node: f0, fh: file_fh, offset: 0, max_entries: 10, plus: true })), libc::EBADF);
    assert_eq!(errno(request(&mut b, OpHeader::ReadDir { node: d, fh: file_fh, offset: 0, max_entries: 10, plus: true })), libc::EBADF);
    assert_eq!(errno(request(&mut b, OpHeader::ReleaseDir { node: f0, fh: file_fh })), libc::EBADF);
    assert_eq!(errno(request(&mut b, CompoundOp::ListDir { node: f0, max_entries: 10 })), libc::ENOTDIR);
    // Nor is a directory's handle a file's, even to the connection that holds it.
    assert_eq!(errno(request(&mut a, OpHeader::Read { node: d, fh: a_fh, offset: 0, size: 10 })), libc::EBADF);
    assert_eq!(errno(request(&mut a, OpHeader::Release { node: d, fh: a_fh })), libc::EBADF);

    // A window of nothing: no entries, not complete, and the handle reads the whole directory.
    let empty = listing_of(request(&mut b, CompoundOp::ListDir { node: d, max_entries: 0 }));
    assert!(empty.entries.is_empty());
    assert!(!empty.complete, "a window of nothing says nothing of the end");
    let mut all = Vec::new();
    let mut offset = 0;
    loop {
        let batch = dir_of(request(&mut b, OpHeader::ReadDir { node: d, fh: empty.fh, offset, max_entries: 4096, plus: false }));
        let Some(last) = batch.last() else { break };
        offset = last.next;
        all.extend(batch);
    }
    assert_eq!(names(&all), want);
    assert!(matches!(request(&mut b, OpHeader::ReleaseDir { node: d, fh: empty.fh }), WireReply::Empty));

    // A window of everything: at most 4096 entries, and not complete when there are more.
    let most = listing_of(request(&mut b, CompoundOp::ListDir { node: d, max_entries: u32::MAX }));
    assert_eq!(most.entries.len(), wire::limits::MAX_DIR_ENTRIES as usize);
    assert!(!most.complete);
    let rest = dir_of(request(&mut b, OpHeader::ReadDir {
        node: d,
        fh: most.fh,
        offset: most.entries.last().unwrap().next,
        max_entries: u32::MAX,
        plus: false,
    }));
    assert_eq!(most.entries.len() + rest.len(), FILES + 2);
    // Offsets past the end read nothing, at any distance.
    for offset in [(FILES + 2) as u64, (FILES + 3) as u64, 1 << 40, i64::MAX as u64, u64::MAX] {
        for plus in [false, true] {
            let past = dir_of(request(&mut b, OpHeader::ReadDir { node: d, fh: most.fh, offset, max_entries: 10, plus }));
            assert!(past.is_empty(), "offset {offset}: {} entries", past.len());
        }
    }
    // b goes without giving back what it holds; the server gives it back.
    drop(b);

    // a reads on from where it was, to the end, each name once.
    loop {
        let offset = a_read.last().unwrap().next;
        let batch = dir_of(request(&mut a, OpHeader::ReadDir { node: d, fh: a_fh, offset, max_entries: 1000, plus: true }));
        if batch.is_empty() {
            break;
        }
        a_read.extend(batch);
    }
    assert_eq!(names(&a_read), want, "a's listing, after b");
    assert!(matches!(request(&mut a, OpHeader::ReleaseDir { node: d, fh: a_fh }), WireReply::Empty));
    // And the server serves on.
    let r = remote(&s.socket);
    let de = r.lookup(&cx(), NodeId::ROOT, OsStr::new("d")).unwrap();
    assert_eq!(r.list_dir(&cx(), de.node).unwrap().len(), FILES, "(without . and ..)");
}

/// Through the layer, a directory reads the same whether its listing holds all of it, or
/// less and the rest comes from the server, and whether it is read with attributes or not.
#[test]
fn directories_read_through_the_layer_as_on_the_server() {
    let s = serve();
    let r = remote(&s.socket);
    for (dir, files) in [("empty", 0), ("small", 3), ("large", 2500)] {
        std::fs::create_dir(s.lower.join(dir)).unwrap();
        for i in 0..files {
            std::fs::write(s.lower.join(dir).join(format!("f{i}")), b"").unwrap();
        }
        let mut want: Vec<_> = std::fs::read_dir(s.lower.join(dir)).unwrap().map(|e| e.unwrap().file_name()).collect();
        want.sort();
        let d = r.lookup(&cx(), NodeId::ROOT, OsStr::new(dir)).unwrap();
        let mut plain: Vec<_> = r.list_dir(&cx(), d.node).unwrap().into_iter().map(|e| e.name).collect();
        plain.sort();
        assert_eq!(plain, want, "{dir}, without attributes");
        let fh = match r.call(&cx(), &Op::OpenDir { node: d.node }).unwrap() {
            Reply::Opened(o) => o.fh,
            other => panic!("{other:?}"),
        };
        let mut plus = Vec::new();
        let mut offset = 0;
        loop {
            let batch = match r.call(&cx(), &Op::ReadDir { node: d.node, fh, offset, max_entries: 128, plus: true }).unwrap() {
                Reply::Dir(b) if b.is_empty() => break,
                Reply::Dir(b) => b,
                other => panic!("{other:?}"),
            };
            offset = batch.last().unwrap().next_offset;
            for e in batch.into_iter().filter(|e| e.name != "." && e.name != "..") {
                let entry = e.entry.expect("readdirplus gives every entry its attributes");
                assert_eq!(r.getattr(&cx(), entry.node).unwrap().size, 0);
                r.forget(&cx(), entry.node, 1);
                plus.push(e.name);
            }
        }
        // Read again from the start on the same handle (rewinddir): the server's entries again.
        let again = match r.call(&cx(), &Op::ReadDir { node: d.node, fh, offset: 0, max_entries: 4096, plus: false }).unwrap() {
            Reply::Dir(b) => b.len(),
            other => panic!("{other:?}"),
        };
        r.call(&cx(), &Op::ReleaseDir { node: d.node, fh }).unwrap();
        plus.sort();
        assert_eq!(plus, want, "{dir}, with attributes");
        assert_eq!(again, want.len().min(4096 - 2) + 2, "{dir}, read again");
        r.forget(&cx(), d.node, 1);
    }
}

#[test]
fn many_requests_in_flight_on_one_connection() {
    let s = serve();
    let r = remote(&s.socket);
    for i in 0..8 {
        std::fs::write(s.lower.join(format!("f{i}")), vec![i as u8; 100_000]).unwrap();
    }
    std::thread::scope(|sc| {
        for i in 0..8u8 {
            let r = r.clone();
            sc.spawn(move || {
                for _ in 0..50 {
                    let e = r.lookup(&cx(), NodeId::ROOT, OsStr::new(&format!("f{i}"))).unwrap();
                    let o = r.open(&cx(), e.node, libc::O_RDONLY).unwrap();
                    let data = r.read(&cx(), e.node, o.fh, 0, 200_000).unwrap();
                    assert_eq!(data, vec![i; 100_000]);
                    r.release(&cx(), e.node, o.fh).unwrap();
                    r.forget(&cx(), e.node, 1);
                }
            });
        }
    });
    let _ = Reply::Empty;
}

/// Not a test: the cost of one round trip without FUSE (`cargo test --release -p plyfs-transport
/// --test inproc round_trip_cost -- --ignored --nocapture`).
#[test]
#[ignore]
fn round_trip_cost() {
    let s = serve();
    let r = remote(&s.socket);
    let local = Level::new(Arc::new(LowerDir::open(&s.lower).unwrap()));
    for (what, level) in [("local", &local), ("remote", &r)] {
        let n = 20_000;
        for _ in 0..1000 {
            level.getattr(&cx(), NodeId::ROOT).unwrap();
        }
        let t = std::time::Instant::now();
        for _ in 0..n {
            level.getattr(&cx(), NodeId::ROOT).unwrap();
        }
        eprintln!("{what}: {:.2} us per getattr", t.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
}

/// Root squash maps root's group as well as root (as nfsd does): a client with the key may not
/// claim group 0 for another user, and a squashed root has only nobody's group.
#[test]
fn root_squash_takes_group_0_away_too() {
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let lower = dir.path().join("lower");
    std::fs::create_dir(&lower).unwrap();
    std::fs::set_permissions(&lower, std::fs::Permissions::from_mode(0o777)).unwrap();
    let stack = plyfs_stack::Stack::build(&[], &[], Arc::new(LowerDir::open(&lower).unwrap())).unwrap();
    let server = Server::for_stack(&stack, ServerOptions::default());
    let (client, served) = UnixStream::pair().unwrap();
    std::thread::spawn(move || server.serve(Box::new(served), "squashed", plyfs_transport::server::Identity::RootSquash, None));
    let mut s = client;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&wire::PREAMBLE).unwrap();
    wire::write_frame(&mut s, &wire::encode(&Message::Hello { versions: vec![1], software: "test".into(), auth: None }), &[]).unwrap();
    wire::read_preamble(&mut s).unwrap();
    let f = wire::read_frame(&mut s).unwrap();
    assert!(matches!(wire::decode(&f.header), Ok(Message::Welcome { .. })));
    for (name, uid, gid) in [("as-1000-group-0", 1000, 0), ("as-root", 0, 0)] {
        let op = OpHeader::MkDir { parent: 1, name: serde_bytes::ByteBuf::from(name.as_bytes().to_vec()), mode: 0o2777 };
        let req = Message::Req { id: 9, caller: WireCaller { uid, gid, pid: 1 }, op: op.into() };
        wire::write_frame(&mut s, &wire::encode(&req), &[]).unwrap();
        let f = wire::read_frame(&mut s).unwrap();
        assert!(matches!(wire::decode(&f.header).unwrap(), Message::Rep { id: 9, .. }));
        let m = std::fs::metadata(lower.join(name)).unwrap();
        assert_ne!(m.gid(), 0, "{name}: group 0 claimed by a squashed client");
        assert_eq!(m.uid(), if uid == 0 { 65534 } else { uid }, "{name}");
    }
}
