//! The reverse view in-process: listings of any length come out whole in pieces.

use std::ffi::OsString;

use plyfs_layers::crypt::keys::{self, Secret, VolumeSettings, MIN_KDF_MEMORY_KIB};
use plyfs_layers::crypt::reverse::{ReverseView, REVERSE_CONFIG_NAME};
use plyfs_stack::{Caller, LowerDir, NodeId, Op, Reply};
use zeroize::Zeroizing;

#[test]
fn a_long_listing_reads_whole_in_pieces_with_and_without_lookups() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    std::fs::create_dir_all(plain.join("d")).unwrap();
    for i in 0..300 {
        std::fs::write(plain.join("d").join(format!("file-{i:03}")), b"x").unwrap();
    }
    let secret = Secret::Password(Zeroizing::new("pw".to_owned()));
    let settings = VolumeSettings { kdf_memory_kib: MIN_KDF_MEMORY_KIB, ..VolumeSettings::default() };
    let conf = plain.join(REVERSE_CONFIG_NAME);
    keys::init_file(&plain, &conf, &settings, &secret, false).unwrap();
    let volume = keys::unlock_config(&keys::VolumeConfig::load_file(&plain, &conf, "").unwrap(), "conf", &secret).unwrap();
    let view = ReverseView::new(&volume, LowerDir::level(&plain).unwrap(), std::fs::read(&conf).unwrap(), &[]).unwrap().level();
    let cx = Caller::daemon();
    let d = match view.call(&cx, &Op::ReadDir { node: NodeId::ROOT, fh: open_dir(&view, NodeId::ROOT), offset: 0, max_entries: 100, plus: false }).unwrap() {
        Reply::Dir(entries) => entries.into_iter().find(|e| e.kind == plyfs_stack::FileKind::Dir && e.name != "." && e.name != "..").unwrap().name,
        _ => panic!(),
    };
    let d = view.lookup(&cx, NodeId::ROOT, &d).unwrap().node;
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
