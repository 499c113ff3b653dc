//! The reverse view in-process: listings of any length come out whole in pieces.

use std::ffi::OsString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use plyfs_layers::crypt::keys::{self, Secret, VolumeSettings, MIN_KDF_MEMORY_KIB};
use plyfs_layers::crypt::reverse::{ReverseView, REVERSE_CONFIG_NAME};
use plyfs_stack::{Caller, Layer, Level, LowerDir, NodeId, Op, Reply, Result};
use zeroize::Zeroizing;

/// The plaintext directory's listings, counted.
struct CountListings {
    lower: [Level; 1],
    opendirs: AtomicU64,
}

impl Layer for CountListings {
    fn name(&self) -> &str {
        "count"
    }
    fn kind(&self) -> &'static str {
        "count"
    }
    fn lower(&self) -> &[Level] {
        &self.lower
    }
    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        if matches!(op, Op::OpenDir { .. }) {
            self.opendirs.fetch_add(1, Ordering::Relaxed);
        }
        self.lower[0].call(cx, op)
    }
}

/// A plaintext tree whose directory `d` holds `files` (named by `name`), set up for reverse
/// views: its path, its unlocked volume and its configuration.
fn plain_tree(dir: &std::path::Path, files: usize, name: impl Fn(usize) -> String) -> (std::path::PathBuf, keys::Volume, Vec<u8>) {
    let plain = dir.join("plain");
    std::fs::create_dir_all(plain.join("d")).unwrap();
    for i in 0..files {
        std::fs::write(plain.join("d").join(name(i)), b"x").unwrap();
    }
    let secret = Secret::Password(Zeroizing::new("pw".to_owned()));
    let settings = VolumeSettings { kdf_memory_kib: MIN_KDF_MEMORY_KIB, ..VolumeSettings::default() };
    let conf = plain.join(REVERSE_CONFIG_NAME);
    keys::init_file(&plain, &conf, &settings, &secret, false).unwrap();
    let volume = keys::unlock_config(&keys::VolumeConfig::load_file(&plain, &conf, "").unwrap(), "conf", &secret).unwrap();
    (plain.clone(), volume, std::fs::read(&conf).unwrap())
}

/// A reverse view of `plain`, its plaintext listings counted, and the view's node of `d`.
fn view_of(plain: &std::path::Path, volume: &keys::Volume, conf: &[u8]) -> (Level, Arc<CountListings>, NodeId) {
    let counter = Arc::new(CountListings { lower: [LowerDir::level(plain).unwrap()], opendirs: AtomicU64::new(0) });
    let view = ReverseView::new(volume, Level::new(counter.clone()), conf.to_vec(), &[]).unwrap().level();
    let cx = Caller::daemon();
    let d = match view.call(&cx, &Op::ReadDir { node: NodeId::ROOT, fh: open_dir(&view, NodeId::ROOT), offset: 0, max_entries: 100, plus: false }).unwrap() {
        Reply::Dir(entries) => entries.into_iter().find(|e| e.kind == plyfs_stack::FileKind::Dir && e.name != "." && e.name != "..").unwrap().name,
        _ => panic!(),
    };
    let d = view.lookup(&cx, NodeId::ROOT, &d).unwrap().node;
    (view, counter, d)
}

/// A directory of long names (hashed in the view) is listed once for `ls -l`, not once per
/// name; in a view that has not listed it, the first lookup lists it and the others do not;
/// a name whose plaintext is gone is not found.
#[test]
fn long_names_are_looked_up_without_listing_the_directory_again() {
    let dir = tempfile::tempdir().unwrap();
    let long = |i: usize| format!("{}{i:04}", "n".repeat(200));
    let (plain, volume, conf) = plain_tree(dir.path(), 200, long);
    let (view, counter, d) = view_of(&plain, &volume, &conf);
    let cx = Caller::daemon();
    let fh = open_dir(&view, d);
    let names = match view.call(&cx, &Op::ReadDir { node: d, fh, offset: 0, max_entries: 1000, plus: false }).unwrap() {
        Reply::Dir(b) => b.into_iter().map(|e| e.name).filter(|n| n != "." && n != "..").collect::<Vec<_>>(),
        _ => panic!(),
    };
    assert_eq!(names.len(), 401, "200 hashed names, their companions and the directory id");
    let listed = counter.opendirs.load(Ordering::Relaxed);
    for n in &names {
        let e = view.lookup(&cx, d, n).unwrap();
        view.forget(&cx, e.node, 1);
    }
    assert_eq!(counter.opendirs.load(Ordering::Relaxed), listed, "lookups after a listing list nothing again");
    // A second view of the same tree shows the same names.
    let (view, counter, d) = view_of(&plain, &volume, &conf);
    let companions: Vec<OsString> = names.iter().filter(|n| n.to_string_lossy().ends_with(".name")).cloned().collect();
    assert_eq!(companions.len(), 200);
    let before = counter.opendirs.load(Ordering::Relaxed);
    for n in &companions {
        let e = view.lookup(&cx, d, n).unwrap();
        view.forget(&cx, e.node, 1);
    }
    assert_eq!(counter.opendirs.load(Ordering::Relaxed) - before, 1, "one listing for 200 lookups");
    std::fs::remove_file(plain.join("d").join(long(7))).unwrap();
    let gone = companions.iter().filter(|n| view.lookup(&cx, d, n).map(|e| view.forget(&cx, e.node, 1)).is_err()).count();
    assert_eq!(gone, 1, "only the removed file's companion is gone");
}

#[test]
fn a_long_listing_reads_whole_in_pieces_with_and_without_lookups() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, volume, conf) = plain_tree(dir.path(), 300, |i| format!("file-{i:03}"));
    let (view, _, d) = view_of(&plain, &volume, &conf);
    let cx = Caller::daemon();
    for plus in [false, true] {
        let fh = open_dir(&view, d);
        let mut names: Vec<OsString> = Vec::new();
        let mut offset = 0;
        loop {
            let batch = match view.call(&cx, &Op::ReadDir { node: d, fh, offset, max_entries: 128, plus }).unwrap() {
                Reply::Dir(b) => b,
                _ => panic!(),
            };
            if batch.is_empty() {
                break;
            }
            offset = batch.last().unwrap().next_offset;
            // An inode number of 0 would make the kernel drop the entry.
            assert!(batch.iter().all(|e| e.node.0 != 0), "plus {plus}");
            names.extend(batch.into_iter().map(|e| e.name));
        }
        // 300 files, the directory's id, `.` and `..`.
        assert_eq!(names.len(), 303, "plus {plus}");
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 303, "no name twice (plus {plus})");
    }
}

fn open_dir(view: &plyfs_stack::Level, node: NodeId) -> plyfs_stack::FileHandle {
    match view.call(&Caller::daemon(), &Op::OpenDir { node }).unwrap() {
        Reply::Opened(o) => o.fh,
        _ => panic!(),
    }
}
