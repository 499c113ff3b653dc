//! `listdir` through the remote layer against what could make a listing wrong: a layer below
//! the server that hides names window by window (as crypt hides its companions), and a change
//! (through this mount, or a notice from another client) while the listdir is in flight.
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use plyfs_stack::{Caller, Layer, Level, LowerDir, NodeId, Op, Reply, Result};
use plyfs_transport::listen::{bind_unix, serve_unix, UnixPolicy};
use plyfs_transport::server::{Server, ServerOptions};
use plyfs_layers::remote::Remote;
use plyfs_transport::{Addr, PlainConnector};

/// Hides names starting with 'h' from readdir (as crypt's names layer hides companions,
/// window by window), and sleeps after readdir with plus when `slow` is set.
struct Probe {
    below: [Level; 1],
    hide: bool,
    slow: Arc<AtomicBool>,
}

impl Layer for Probe {
    fn name(&self) -> &str { "probe" }
    fn kind(&self) -> &'static str { "probe" }
    fn lower(&self) -> &[Level] { &self.below }
    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let below = &self.below[0];
        match *op {
            Op::ReadDir { plus, .. } => {
                let r = below.call(cx, op)?;
                if plus && self.slow.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(400));
                }
                let Reply::Dir(entries) = r else { return Ok(r) };
                if !self.hide { return Ok(Reply::Dir(entries)); }
                let mut shown = Vec::new();
                for e in entries {
                    if e.name.as_encoded_bytes().first() == Some(&b'h') {
                        if let Some(x) = e.entry { below.forget(cx, x.node, 1); }
                    } else {
                        shown.push(e);
                    }
                }
                Ok(Reply::Dir(shown))
            }
            _ => below.call(cx, op),
        }
    }
}

struct Served { _dir: tempfile::TempDir, lower: PathBuf, socket: PathBuf, slow: Arc<AtomicBool> }

fn serve(hide: bool) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let lower = dir.path().join("lower");
    std::fs::create_dir(&lower).unwrap();
    let socket = dir.path().join("s.sock");
    let slow = Arc::new(AtomicBool::new(false));
    let bottom = Level::new(Arc::new(LowerDir::open(&lower).unwrap()));
    let probe = Level::new(Arc::new(Probe { below: [bottom.clone()], hide, slow: slow.clone() }));
    let stack = plyfs_stack::Stack::build_over(&[], &[], vec![probe, bottom]).unwrap();
    let server = Server::for_stack(&stack, ServerOptions::default());
    let listener = bind_unix(&socket).unwrap();
    std::thread::spawn(move || serve_unix(server, listener, UnixPolicy::default()));
    Served { _dir: dir, lower, socket, slow }
}

fn remote(socket: &Path) -> Level {
    Remote::connect("remote", Box::new(PlainConnector(Addr::Unix(socket.to_owned()))), Duration::from_secs(5)).unwrap().level()
}

fn cx() -> Caller { Caller::daemon() }

#[test]
fn a_layer_that_hides_entries_does_not_end_listings_early() {
    let s = serve(true);
    let mut short = 0;
    for d in 0..5 {
        let dir = s.lower.join(format!("d{d}"));
        std::fs::create_dir(&dir).unwrap();
        for i in 0..1100 {
            std::fs::write(dir.join(format!("v{i}")), b"").unwrap();
            std::fs::write(dir.join(format!("h{i}")), b"").unwrap();
        }
        let r = remote(&s.socket);
        let e = r.lookup(&cx(), NodeId::ROOT, OsStr::new(&format!("d{d}"))).unwrap();
        let n = r.list_dir(&cx(), e.node).unwrap().into_iter().filter(|e| e.name.as_encoded_bytes()[0] == b'v').count();
        eprintln!("d{d}: {n} of 1100 visible entries read");
        if n != 1100 { short += 1; }
    }
    assert_eq!(short, 0, "directories read short");
}

fn names_at_zero(r: &Level, node: NodeId, fh: plyfs_stack::FileHandle) -> Vec<String> {
    match r.call(&cx(), &Op::ReadDir { node, fh, offset: 0, max_entries: 128, plus: true }).unwrap() {
        Reply::Dir(b) => b.into_iter().map(|e| {
            if let Some(x) = e.entry { r.forget(&cx(), x.node, 1); }
            e.name.to_string_lossy().into_owned()
        }).collect(),
        other => panic!("{other:?}"),
    }
}

/// An unlink through the same mount while the opendir (listdir) is in flight.
#[test]
fn an_unlink_during_a_listdir_in_flight_is_not_seen_by_the_listing() {
    let s = serve(false);
    std::fs::create_dir(s.lower.join("d")).unwrap();
    std::fs::write(s.lower.join("d/x"), b"").unwrap();
    let r = remote(&s.socket);
    let d = r.lookup(&cx(), NodeId::ROOT, OsStr::new("d")).unwrap().node;
    s.slow.store(true, Ordering::SeqCst);
    let r2 = r.clone();
    let opener = std::thread::spawn(move || match r2.call(&cx(), &Op::OpenDir { node: d }).unwrap() {
        Reply::Opened(o) => o.fh,
        other => panic!("{other:?}"),
    });
    std::thread::sleep(Duration::from_millis(100));
    r.call(&cx(), &Op::Unlink { parent: d, name: OsStr::new("x") }).unwrap();
    s.slow.store(false, Ordering::SeqCst);
    let fh = opener.join().unwrap();
    assert!(!s.lower.join("d/x").exists());
    let names = names_at_zero(&r, d, fh);
    r.call(&cx(), &Op::ReleaseDir { node: d, fh }).unwrap();
    assert!(!names.contains(&"x".to_string()), "x was unlinked (and the unlink returned) before the first readdir, yet: {names:?}");
}

/// The same through another client: its notice comes while the listdir is in flight.
#[test]
fn a_notice_during_a_listdir_in_flight_is_not_lost() {
    let s = serve(false);
    std::fs::create_dir(s.lower.join("d")).unwrap();
    std::fs::write(s.lower.join("d/x"), b"").unwrap();
    let a = remote(&s.socket);
    let b = remote(&s.socket);
    let d = a.lookup(&cx(), NodeId::ROOT, OsStr::new("d")).unwrap().node;
    let db = b.lookup(&cx(), NodeId::ROOT, OsStr::new("d")).unwrap().node;
    s.slow.store(true, Ordering::SeqCst);
    let a2 = a.clone();
    let opener = std::thread::spawn(move || match a2.call(&cx(), &Op::OpenDir { node: d }).unwrap() {
        Reply::Opened(o) => o.fh,
        other => panic!("{other:?}"),
    });
    std::thread::sleep(Duration::from_millis(100));
    b.call(&cx(), &Op::Unlink { parent: db, name: OsStr::new("x") }).unwrap();
    s.slow.store(false, Ordering::SeqCst);
    let fh = opener.join().unwrap();
    // Give the notice every chance to arrive.
    std::thread::sleep(Duration::from_millis(300));
    let names = names_at_zero(&a, d, fh);
    a.call(&cx(), &Op::ReleaseDir { node: d, fh }).unwrap();
    assert!(!names.contains(&"x".to_string()), "x was removed through b before a's first readdir, yet: {names:?}");
}
