//! `version` under concurrency, in process (issue #33): writers overwrite files every way the
//! layer keeps a version, while listers ask `versions` of the same files without pause and read
//! every version they are given.
//!
//! The race this guards: a release (which the kernel sends after close has returned) drops the
//! version its open took when the file did not change. A listing running meanwhile must neither
//! fail nor lose a version; a version it names may be gone when read, and must then be
//! reported as gone (`ENOENT`), never as something else.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use parking_lot::Mutex;
use plyfs_stack::spec::parse_stack_spec;
use plyfs_stack::{bypass, Caller, Error, Layer, Level, LowerDir, NodeId, Op, Reply, SetAttr, Stack, TimeSet};

const FILES: usize = 3;
/// Rounds per writer; `PLYFS_VERSION_RACE_ROUNDS` sets more (or fewer).
const ROUNDS: usize = 400;
/// Every content a writer writes has this length, so a write at 0 replaces all of a file.
const CONTENT_BYTES: usize = 16;
/// What a truncate leaves.
const TRUNCATED_BYTES: u64 = 5;

fn cx() -> Caller {
    Caller::daemon()
}

fn content(file: usize, round: usize) -> Vec<u8> {
    let c = format!("f{file}-round{round:08}").into_bytes();
    assert_eq!(c.len(), CONTENT_BYTES);
    c
}

/// Each way of overwriting a file, and whether it keeps a version.
#[derive(Clone, Copy, Debug)]
enum Overwrite {
    /// Opened for writing, closed unchanged: the version taken at open is dropped at release.
    OpenUnchanged,
    /// Opened for writing (no `O_TRUNC`), written from the start.
    OpenWrite,
    /// Opened with `O_TRUNC`, then written.
    TruncOpenWrite,
    /// Truncated by `setattr` (the `truncate(2)` of a file not open).
    Truncate,
    /// Another file written and renamed over it.
    RenameOver,
}

const OVERWRITES: [Overwrite; 5] =
    [Overwrite::OpenUnchanged, Overwrite::OpenWrite, Overwrite::TruncOpenWrite, Overwrite::Truncate, Overwrite::RenameOver];

/// What listers saw, summed over all of them.
#[derive(Default)]
struct Seen {
    listings: AtomicU64,
    versions_listed: AtomicU64,
    versions_read: AtomicU64,
    /// Named by a listing, gone when read: a version dropped by its release meanwhile.
    versions_gone: AtomicU64,
    /// The file's name missing (a rename over it is not atomic if this is ever above 0).
    file_missing: AtomicU64,
    /// The file looked up, then renamed over and so a version, before its listing: a clean
    /// refusal, as for any version named as a file.
    renamed_over: AtomicU64,
    failures: Mutex<Vec<String>>,
}

impl Seen {
    fn fail(&self, what: String) {
        let mut f = self.failures.lock();
        if f.len() < 20 {
            f.push(what);
        }
    }
}

/// A version read through the top of the stack by the path `versions` gave:
/// `Ok(None)` when it is gone.
fn read_version(top: &Level, path: &str) -> plyfs_stack::Result<Option<Vec<u8>>> {
    let mut held: Vec<NodeId> = Vec::new();
    let result = (|| {
        let mut at = NodeId::ROOT;
        for part in path.split('/') {
            match top.lookup(&cx(), at, OsStr::new(part)) {
                Ok(e) => {
                    held.push(e.node);
                    at = e.node;
                }
                Err(Error::Os(libc::ENOENT)) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        let o = top.open(&cx(), at, libc::O_RDONLY)?;
        let data = top.read(&cx(), at, o.fh, 0, 4096);
        top.release(&cx(), at, o.fh)?;
        data.map(Some)
    })();
    for n in held {
        top.forget(&cx(), n, 1);
    }
    result
}

/// A version as a listing named it, and what reading it found.
struct Listed {
    number: u64,
    /// `None`: gone since listed.
    content: Option<Vec<u8>>,
}

/// The versions of `name`, each read.
fn versions_of(top: &Level, name: &str) -> Result<Vec<Listed>, String> {
    let e = top.lookup(&cx(), NodeId::ROOT, OsStr::new(name)).map_err(|e| format!("lookup {name}: {e}"))?;
    let listed = top.extended(&cx(), e.node, "versions", &[]);
    top.forget(&cx(), e.node, 1);
    let listed = listed.map_err(|e| format!("versions of {name}: {e}"))?;
    let mut out = Vec::new();
    for v in listed.as_array().ok_or_else(|| format!("versions of {name}: not a list: {listed}"))? {
        let number = v["number"].as_u64().ok_or_else(|| format!("versions of {name}: no number in {v}"))?;
        let path = v["path"].as_str().ok_or_else(|| format!("versions of {name}: no path in {v}"))?;
        let content = read_version(top, path).map_err(|e| format!("{path}: listed, then read: {e}"))?;
        out.push(Listed { number, content });
    }
    Ok(out)
}

/// One writer's file: what it held before each version-keeping overwrite, in order.
struct Writer {
    name: String,
    /// Every content the file has held, for listers to check versions against.
    held: Mutex<HashSet<Vec<u8>>>,
    kept: Mutex<Vec<Vec<u8>>>,
}

fn overwrite(top: &Level, w: &Writer, file: usize, round: usize, how: Overwrite, now: &mut Vec<u8>) {
    let name = OsStr::new(&w.name);
    let new = content(file, round);
    let f = top.lookup(&cx(), NodeId::ROOT, name).unwrap();
    let write_all = |flags: i32| {
        w.held.lock().insert(new.clone());
        let o = top.open(&cx(), f.node, flags).unwrap();
        assert_eq!(top.write(&cx(), f.node, o.fh, 0, &new).unwrap() as usize, CONTENT_BYTES);
        top.release(&cx(), f.node, o.fh).unwrap();
    };
    let previous = now.clone();
    match how {
        Overwrite::OpenUnchanged => {
            let o = top.open(&cx(), f.node, libc::O_RDWR).unwrap();
            top.release(&cx(), f.node, o.fh).unwrap();
        }
        Overwrite::OpenWrite => {
            write_all(libc::O_WRONLY);
            *now = new;
        }
        Overwrite::TruncOpenWrite => {
            write_all(libc::O_WRONLY | libc::O_TRUNC);
            *now = new;
        }
        Overwrite::Truncate => {
            now.truncate(TRUNCATED_BYTES as usize);
            w.held.lock().insert(now.clone());
            let set = SetAttr { size: Some(TRUNCATED_BYTES), ..Default::default() };
            top.call(&cx(), &Op::SetAttr { node: f.node, fh: None, set }).unwrap();
        }
        Overwrite::RenameOver => {
            let temp = format!("{}.new", w.name);
            w.held.lock().insert(new.clone());
            let (t, o) = top.create(&cx(), NodeId::ROOT, OsStr::new(&temp), 0o644, libc::O_WRONLY).unwrap();
            top.write(&cx(), t.node, o.fh, 0, &new).unwrap();
            top.release(&cx(), t.node, o.fh).unwrap();
            top.forget(&cx(), t.node, 1);
            let op = Op::Rename { parent: NodeId::ROOT, name: OsStr::new(&temp), new_parent: NodeId::ROOT, new_name: name, flags: 0 };
            top.call(&cx(), &op).unwrap();
            *now = new;
        }
    }
    top.forget(&cx(), f.node, 1);
    if !matches!(how, Overwrite::OpenUnchanged) {
        w.kept.lock().push(previous);
    }
}

fn lister(top: &Level, writers: &[Writer], done: &AtomicBool, seen: &Seen) {
    while !done.load(Ordering::SeqCst) {
        for w in writers {
            let listed = match versions_of(top, &w.name) {
                Ok(listed) => listed,
                Err(e) if e.starts_with("lookup") && e.contains("No such file") => {
                    seen.file_missing.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err(e) if e.contains("this is a version already") => {
                    seen.renamed_over.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err(e) => {
                    seen.fail(e);
                    continue;
                }
            };
            seen.listings.fetch_add(1, Ordering::Relaxed);
            let numbers: Vec<u64> = listed.iter().map(|v| v.number).collect();
            if numbers.windows(2).any(|p| p[0] >= p[1]) {
                seen.fail(format!("{}: versions out of order or twice: {numbers:?}", w.name));
            }
            for Listed { number, content } in listed {
                seen.versions_listed.fetch_add(1, Ordering::Relaxed);
                match content {
                    None => {
                        seen.versions_gone.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(data) => {
                        seen.versions_read.fetch_add(1, Ordering::Relaxed);
                        if !w.held.lock().contains(&data) {
                            seen.fail(format!("{} @{number}: {:?} was never the file's content", w.name, String::from_utf8_lossy(&data)));
                        }
                    }
                }
            }
        }
    }
}

/// A stack of `version` (no pruning) over a fresh directory.
fn version_stack() -> (tempfile::TempDir, Stack) {
    let dir = tempfile::tempdir().unwrap();
    let specs = parse_stack_spec("version:keep=0:max_space=0").unwrap();
    let stack = Stack::build(&specs, plyfs_layers::registry(), Arc::new(LowerDir::open(dir.path()).unwrap())).unwrap();
    (dir, stack)
}

#[test]
fn listings_racing_overwrites_and_releases_never_fail_nor_lose_a_version() {
    let rounds = std::env::var("PLYFS_VERSION_RACE_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(ROUNDS);
    let (_dir, stack) = version_stack();
    let top = stack.top();
    let writers: Vec<Writer> = (0..FILES)
        .map(|i| Writer { name: format!("f{i}"), held: Mutex::new(HashSet::new()), kept: Mutex::new(Vec::new()) })
        .collect();
    let first: Vec<Vec<u8>> = (0..FILES).map(|i| content(i, 0)).collect();
    for (w, data) in writers.iter().zip(&first) {
        w.held.lock().insert(data.clone());
        let (e, o) = top.create(&cx(), NodeId::ROOT, OsStr::new(&w.name), 0o644, libc::O_WRONLY).unwrap();
        top.write(&cx(), e.node, o.fh, 0, data).unwrap();
        top.release(&cx(), e.node, o.fh).unwrap();
        top.forget(&cx(), e.node, 1);
    }
    let (done, seen) = (AtomicBool::new(false), Seen::default());
    std::thread::scope(|s| {
        let listers: Vec<_> = (0..FILES).map(|_| s.spawn(|| lister(top, &writers, &done, &seen))).collect();
        let writing: Vec<_> = writers
            .iter()
            .zip(first)
            .enumerate()
            .map(|(i, (w, mut now))| {
                s.spawn(move || {
                    for round in 1..=rounds {
                        overwrite(top, w, i, round, OVERWRITES[(round + i) % OVERWRITES.len()], &mut now);
                    }
                })
            })
            .collect();
        for w in writing {
            w.join().unwrap();
        }
        done.store(true, Ordering::SeqCst);
        for l in listers {
            l.join().unwrap();
        }
    });
    eprintln!(
        "{} listings naming {} versions: {} read, {} gone when read; the file's name missing {} times, renamed over before its listing {}",
        seen.listings.load(Ordering::Relaxed),
        seen.versions_listed.load(Ordering::Relaxed),
        seen.versions_read.load(Ordering::Relaxed),
        seen.versions_gone.load(Ordering::Relaxed),
        seen.file_missing.load(Ordering::Relaxed),
        seen.renamed_over.load(Ordering::Relaxed),
    );
    let failures = seen.failures.lock();
    assert!(failures.is_empty(), "{} failures, the first: {:#?}", failures.len(), &failures[..]);
    assert_eq!(seen.file_missing.load(Ordering::Relaxed), 0, "a rename over the file left its name missing");
    // Once the writers are done, each file has exactly the versions they made, in order.
    for w in &writers {
        let got: Vec<Vec<u8>> =
            versions_of(top, &w.name).unwrap().into_iter().map(|v| v.content.unwrap_or_else(|| panic!("{} @{} gone", w.name, v.number))).collect();
        let want = w.kept.lock();
        assert_eq!(got.len(), want.len(), "{}: version count", w.name);
        for (i, (g, k)) in got.iter().zip(want.iter()).enumerate() {
            assert_eq!(String::from_utf8_lossy(g), String::from_utf8_lossy(k), "{}: version {} of {}", w.name, i + 1, want.len());
        }
    }
}

/// The kernel sends a release after close returns, so it may come after the next open of the
/// file has changed it. An open that changed nothing then keeps no version of its own: it
/// shares the one the next open took, which is kept once.
#[test]
fn a_late_release_of_an_unchanged_open_leaves_no_copy_of_the_next_version() {
    let (_dir, stack) = version_stack();
    let top = stack.top();
    let (e, o) = top.create(&cx(), NodeId::ROOT, OsStr::new("f"), 0o644, libc::O_WRONLY).unwrap();
    top.write(&cx(), e.node, o.fh, 0, b"one").unwrap();
    top.release(&cx(), e.node, o.fh).unwrap();
    let count = || top.extended(&cx(), e.node, "versions", &[]).unwrap().as_array().unwrap().len();
    for flags in [libc::O_WRONLY, libc::O_WRONLY | libc::O_TRUNC] {
        let before = count();
        // Opened for writing and closed unchanged; its release still to come.
        let unchanged = top.open(&cx(), e.node, libc::O_RDWR).unwrap();
        let next = top.open(&cx(), e.node, flags).unwrap();
        top.write(&cx(), e.node, next.fh, 0, b"two").unwrap();
        top.release(&cx(), e.node, next.fh).unwrap();
        top.release(&cx(), e.node, unchanged.fh).unwrap();
        assert_eq!(count(), before + 1, "flags {flags:#o}: one version for one change");
    }
    // Both unchanged, released in either order: none. One changes after the other's release:
    // the version stays.
    for first_released_unchanged in [true, false] {
        let before = count();
        let a = top.open(&cx(), e.node, libc::O_RDWR).unwrap();
        let b = top.open(&cx(), e.node, libc::O_RDWR).unwrap();
        let (first, second) = if first_released_unchanged { (a, b) } else { (b, a) };
        top.release(&cx(), e.node, first.fh).unwrap();
        assert_eq!(count(), before, "an open that changed nothing shows no version");
        top.release(&cx(), e.node, second.fh).unwrap();
        assert_eq!(count(), before);
        let a = top.open(&cx(), e.node, libc::O_RDWR).unwrap();
        let b = top.open(&cx(), e.node, libc::O_RDWR).unwrap();
        top.release(&cx(), e.node, a.fh).unwrap();
        top.write(&cx(), e.node, b.fh, 0, b"new").unwrap();
        top.release(&cx(), e.node, b.fh).unwrap();
        assert_eq!(count(), before + 1, "what the file held before b wrote is kept");
    }
    top.forget(&cx(), e.node, 1);
}

/// The bottom of a stack for the tests below: a directory, with a level that can refuse
/// `RENAME_EXCHANGE` (as NFS and many FUSE file systems do), fail the making of directories (a
/// store that cannot be made), and hold a truncate on its way down until the test lets it go.
struct Gate {
    lower: [Level; 1],
    /// Refuse `RENAME_EXCHANGE` with this errno (0: do it).
    refuse_exchange: AtomicI32,
    /// Fail `mkdir` with this errno (0: do it).
    fail_mkdir: AtomicI32,
    /// The next truncate says it arrived, then waits to be let go.
    hold_truncate: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
    /// The next copy a save makes says it arrived, then waits to be let go.
    hold_copy: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
}

impl Layer for Gate {
    fn name(&self) -> &str {
        "gate"
    }
    fn kind(&self) -> &'static str {
        "gate"
    }
    fn lower(&self) -> &[Level] {
        &self.lower
    }
    fn call(&self, cx: &Caller, op: &Op<'_>) -> plyfs_stack::Result<Reply> {
        match *op {
            Op::Rename { flags, .. } if flags & libc::RENAME_EXCHANGE != 0 => match self.refuse_exchange.load(Ordering::SeqCst) {
                0 => {}
                errno => return Err(Error::Os(errno)),
            },
            Op::MkDir { .. } => match self.fail_mkdir.load(Ordering::SeqCst) {
                0 => {}
                errno => return Err(Error::Os(errno)),
            },
            Op::SetAttr { ref set, .. } if set.size.is_some() => {
                let held = self.hold_truncate.lock().take();
                if let Some((arrived, go)) = held {
                    arrived.send(()).unwrap();
                    go.recv().unwrap();
                }
            }
            Op::Create { name, .. } if name.to_string_lossy().starts_with(".plyfs-version-copy.") => {
                let held = self.hold_copy.lock().take();
                if let Some((arrived, go)) = held {
                    arrived.send(()).unwrap();
                    go.recv().unwrap();
                }
            }
            _ => {}
        }
        bypass(self, cx, op)
    }
}

/// `version` (no pruning) over a [`Gate`].
fn gated_version_stack() -> (tempfile::TempDir, Stack, Arc<Gate>) {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate {
        lower: [Level::new(Arc::new(LowerDir::open(dir.path()).unwrap()))],
        refuse_exchange: AtomicI32::new(0),
        fail_mkdir: AtomicI32::new(0),
        hold_truncate: Mutex::new(None),
        hold_copy: Mutex::new(None),
    });
    let specs = parse_stack_spec("version:keep=0:max_space=0").unwrap();
    let stack = Stack::build(&specs, plyfs_layers::registry(), gate.clone()).unwrap();
    (dir, stack, gate)
}

fn make_file(top: &Level, name: &str, data: &[u8]) -> NodeId {
    let (e, o) = top.create(&cx(), NodeId::ROOT, OsStr::new(name), 0o644, libc::O_WRONLY).unwrap();
    top.write(&cx(), e.node, o.fh, 0, data).unwrap();
    top.release(&cx(), e.node, o.fh).unwrap();
    e.node
}

fn read_file(top: &Level, name: &str) -> Option<Vec<u8>> {
    read_version(top, name).unwrap()
}

/// What each version of `name` holds, oldest first.
fn contents_of_versions(top: &Level, name: &str) -> Vec<String> {
    versions_of(top, name).unwrap().into_iter().map(|v| String::from_utf8_lossy(&v.content.expect("listed, then gone")).into_owned()).collect()
}

/// A level below that cannot exchange: the rename over a file still keeps what it held, by
/// moving it into the store and then renaming.
#[test]
fn a_rename_over_a_file_keeps_it_when_the_level_below_cannot_exchange() {
    for errno in [libc::EINVAL, libc::ENOSYS, libc::EOPNOTSUPP] {
        let (_dir, stack, gate) = gated_version_stack();
        let top = stack.top();
        gate.refuse_exchange.store(errno, Ordering::SeqCst);
        let f = make_file(top, "f", b"old");
        let n = make_file(top, "f.new", b"new");
        let op = Op::Rename { parent: NodeId::ROOT, name: OsStr::new("f.new"), new_parent: NodeId::ROOT, new_name: OsStr::new("f"), flags: 0 };
        top.call(&cx(), &op).unwrap_or_else(|e| panic!("errno {errno}: the rename: {e}"));
        assert_eq!(read_file(top, "f").as_deref(), Some(&b"new"[..]), "errno {errno}");
        assert_eq!(read_file(top, "f.new"), None, "errno {errno}");
        assert_eq!(contents_of_versions(top, "f"), ["old"], "errno {errno}");
        top.forget(&cx(), f, 1);
        top.forget(&cx(), n, 1);
    }
}

/// When what the target held cannot be kept after the exchange, the exchange is undone and the
/// rename fails as a whole: both names hold what they held.
#[test]
fn a_rename_over_a_file_whose_version_cannot_be_kept_changes_nothing() {
    let (_dir, stack, gate) = gated_version_stack();
    let top = stack.top();
    let f = make_file(top, "f", b"old");
    let n = make_file(top, "f.new", b"new");
    gate.fail_mkdir.store(libc::ENOSPC, Ordering::SeqCst);
    let op = Op::Rename { parent: NodeId::ROOT, name: OsStr::new("f.new"), new_parent: NodeId::ROOT, new_name: OsStr::new("f"), flags: 0 };
    assert!(matches!(top.call(&cx(), &op), Err(Error::Os(libc::ENOSPC))));
    gate.fail_mkdir.store(0, Ordering::SeqCst);
    assert_eq!(read_file(top, "f").as_deref(), Some(&b"old"[..]));
    assert_eq!(read_file(top, "f.new").as_deref(), Some(&b"new"[..]));
    assert!(contents_of_versions(top, "f").is_empty());
    top.forget(&cx(), f, 1);
    top.forget(&cx(), n, 1);
}

/// An open shares the version of an unreleased open only of the same file: another file now at
/// the same path, of the same size and modification time, is other content, and keeps its own.
#[test]
fn an_open_shares_no_version_of_another_file_that_had_its_path() {
    let (_dir, stack, _gate) = gated_version_stack();
    let top = stack.top();
    let first = make_file(top, "f", b"first file");
    let a = top.open(&cx(), first, libc::O_RDWR).unwrap();
    let op = Op::Rename { parent: NodeId::ROOT, name: OsStr::new("f"), new_parent: NodeId::ROOT, new_name: OsStr::new("g"), flags: 0 };
    top.call(&cx(), &op).unwrap();
    // Another file at f, as long, and modified when the first was (as `cp -p` or `tar` leave it).
    let second = make_file(top, "f", b"other file");
    let mtime = top.getattr(&cx(), first).unwrap().mtime;
    let set = SetAttr { mtime: Some(TimeSet::At(mtime)), ..Default::default() };
    top.call(&cx(), &Op::SetAttr { node: second, fh: None, set }).unwrap();
    let b = top.open(&cx(), second, libc::O_WRONLY).unwrap();
    top.write(&cx(), second, b.fh, 0, b"third data").unwrap();
    top.release(&cx(), second, b.fh).unwrap();
    top.release(&cx(), first, a.fh).unwrap();
    let kept = contents_of_versions(top, "f");
    assert!(kept.iter().any(|k| k == "other file"), "what the second file held before it was written is lost: {kept:?}");
    top.forget(&cx(), first, 1);
    top.forget(&cx(), second, 1);
}

/// A truncate that a version taken at an unreleased open covers, and that open's release
/// (which finds the file as it was, the truncate not yet done): the version stays.
#[test]
fn a_truncate_covered_by_an_open_keeps_its_version_when_the_open_is_released_meanwhile() {
    let (_dir, stack, gate) = gated_version_stack();
    let top = stack.top();
    let f = make_file(top, "f", b"what f held");
    let a = top.open(&cx(), f, libc::O_RDWR).unwrap();
    let (arrived_tx, arrived) = mpsc::channel();
    let (go, go_rx) = mpsc::channel();
    *gate.hold_truncate.lock() = Some((arrived_tx, go_rx));
    std::thread::scope(|s| {
        let truncate = s.spawn(|| {
            let set = SetAttr { size: Some(0), ..Default::default() };
            top.call(&cx(), &Op::SetAttr { node: f, fh: None, set }).unwrap();
        });
        arrived.recv().unwrap();
        // The open closed (its release) while the truncate is on its way down.
        top.release(&cx(), f, a.fh).unwrap();
        go.send(()).unwrap();
        truncate.join().unwrap();
    });
    assert_eq!(read_file(top, "f").as_deref(), Some(&b""[..]));
    assert_eq!(contents_of_versions(top, "f"), ["what f held"], "what the truncate cut is lost");
    top.forget(&cx(), f, 1);
}

/// Dropping a version waits for any save in progress (a copy of a large file), and is done
/// outside the lock every open for writing, truncate, release and listing takes: a release of an
/// unrelated file, opened only to read, does not wait for that copy.
#[test]
fn a_release_does_not_wait_for_a_save_of_another_file() {
    let (_dir, stack, gate) = gated_version_stack();
    let top = stack.top();
    let (x, y, z) = (make_file(top, "x", b"xxxx"), make_file(top, "y", b"yyyy"), make_file(top, "z", b"zzzz"));
    // y's version is pending and goes at release (y unchanged); z is open only to read.
    let oy = top.open(&cx(), y, libc::O_RDWR).unwrap();
    let oz = top.open(&cx(), z, libc::O_RDONLY).unwrap();
    let (arrived_tx, arrived) = mpsc::channel();
    let (go, go_rx) = mpsc::channel();
    *gate.hold_copy.lock() = Some((arrived_tx, go_rx));
    std::thread::scope(|s| {
        // The save of x's version is held in its copy.
        let open_x = s.spawn(|| top.open(&cx(), x, libc::O_WRONLY).unwrap());
        arrived.recv().unwrap();
        let release_y = s.spawn(|| top.release(&cx(), y, oy.fh).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(100));
        let release_z = s.spawn(|| top.release(&cx(), z, oz.fh).unwrap());
        let start = std::time::Instant::now();
        while !release_z.is_finished() && start.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let finished = release_z.is_finished();
        go.send(()).unwrap();
        let ox = open_x.join().unwrap();
        release_y.join().unwrap();
        release_z.join().unwrap();
        top.write(&cx(), x, ox.fh, 0, b"XXXX").unwrap();
        top.release(&cx(), x, ox.fh).unwrap();
        assert!(finished, "the release of z waited for the save of x's version");
    });
    assert!(contents_of_versions(top, "y").is_empty(), "y's unchanged version was kept");
    assert_eq!(contents_of_versions(top, "x"), ["xxxx"]);
}
