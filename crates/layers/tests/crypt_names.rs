//! Encrypted names in process: the crypt-names layer over a real lower directory.

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use plyfs_layers::crypt::keys::{self, Secret, VolumeSettings, MIN_KDF_MEMORY_KIB};
use plyfs_layers::crypt::{names::DIRID_XATTR, with_names};
use plyfs_stack::{Caller, Error, FileKind, Level, LowerDir, NodeId, Op, Reply, XattrReply};
use zeroize::Zeroizing;

fn cx() -> Caller {
    Caller::daemon()
}

/// A fresh unlocked volume and its names level.
fn volume(plaintext_names: bool) -> (tempfile::TempDir, Level) {
    let dir = tempfile::tempdir().unwrap();
    let secret = Secret::Password(Zeroizing::new("pw".to_owned()));
    let settings = VolumeSettings { plaintext_names, kdf_memory_kib: MIN_KDF_MEMORY_KIB, ..VolumeSettings::default() };
    keys::init(dir.path(), &settings, &secret).unwrap();
    keys::register(keys::unlock(dir.path(), &secret).unwrap());
    let level = with_names(LowerDir::level(dir.path()).unwrap()).unwrap();
    (dir, level)
}

fn touch(l: &Level, parent: NodeId, name: &OsStr) -> plyfs_stack::Result<NodeId> {
    let (e, o) = l.create(&cx(), parent, name, 0o644, libc::O_WRONLY)?;
    l.release(&cx(), e.node, o.fh)?;
    Ok(e.node)
}

fn names(l: &Level, dir: NodeId) -> BTreeSet<OsString> {
    l.list_dir(&cx(), dir).unwrap().into_iter().map(|e| e.name).collect()
}

fn lower_names(dir: &Path) -> BTreeSet<OsString> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect()
}

fn name_of(len: usize, seed: u8) -> OsString {
    // Multi-byte UTF-8 and ASCII mixed, exactly `len` bytes.
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        if len - v.len() >= 2 && (v.len() / 2 + seed as usize).is_multiple_of(3) {
            v.extend_from_slice("é".as_bytes());
        } else {
            v.push(b'a' + (v.len() as u8).wrapping_add(seed) % 26);
        }
    }
    OsString::from_vec(v)
}

#[test]
fn names_are_encrypted_and_read_back_at_every_length() {
    let (dir, l) = volume(false);
    let mut made = BTreeSet::new();
    for (i, len) in [1usize, 2, 15, 16, 17, 100, 159, 160, 161, 200, 254, 255].into_iter().enumerate() {
        let n = name_of(len, i as u8);
        touch(&l, NodeId::ROOT, &n).unwrap_or_else(|e| panic!("create a {len}-byte name: {e}"));
        made.insert(n);
    }
    assert_eq!(names(&l, NodeId::ROOT), made);
    for n in &made {
        let e = l.lookup(&cx(), NodeId::ROOT, n).unwrap();
        assert_eq!(e.attr.kind, FileKind::File);
        l.forget(&cx(), e.node, 1);
    }
    // Below, no plaintext name, every name a valid one, and only the volume's own file besides.
    let lower = lower_names(dir.path());
    for n in &lower {
        assert!(n.len() <= 255);
        assert!(!made.contains(n), "a plaintext name below: {n:?}");
        for m in made.iter().filter(|m| m.len() >= 15) {
            assert!(!n.as_bytes().windows(12).any(|w| w == &m.as_bytes()[..12]), "part of {m:?} shows in {n:?}");
        }
    }
    assert!(lower.contains(OsStr::new(keys::CONFIG_NAME)));
    assert!(lower.iter().any(|n| n.as_bytes().starts_with(b"L.")), "the longest names use the long form");
    // Too long for any file system.
    let err = touch(&l, NodeId::ROOT, &name_of(256, 0)).unwrap_err();
    assert!(matches!(err, Error::Os(libc::ENAMETOOLONG)), "{err}");
}

#[test]
fn the_same_name_differs_between_directories_and_the_config_is_hidden() {
    let (dir, l) = volume(false);
    let a = l.mkdir(&cx(), NodeId::ROOT, OsStr::new("a"), 0o755).unwrap();
    let b = l.mkdir(&cx(), NodeId::ROOT, OsStr::new("b"), 0o755).unwrap();
    touch(&l, a.node, OsStr::new("same")).unwrap();
    touch(&l, b.node, OsStr::new("same")).unwrap();
    let la = lower_names(&dir.path().join(lookup_lower(dir.path(), &l, "a")));
    let lb = lower_names(&dir.path().join(lookup_lower(dir.path(), &l, "b")));
    assert_eq!(la.len(), 1);
    assert_ne!(la, lb, "a name's ciphertext depends on its directory");
    // The configuration and the directory ids are invisible from above.
    assert_eq!(names(&l, NodeId::ROOT), ["a", "b"].into_iter().map(OsString::from).collect());
    assert!(l.lookup(&cx(), NodeId::ROOT, OsStr::new(keys::CONFIG_NAME)).is_err());
    let get = Op::GetXattr { node: a.node, name: OsStr::new(DIRID_XATTR), size: 64 };
    assert!(matches!(l.call(&cx(), &get), Err(Error::Os(libc::ENODATA))));
    let set = Op::SetXattr { node: a.node, name: OsStr::new(DIRID_XATTR), value: b"x", flags: 0 };
    assert!(matches!(l.call(&cx(), &set), Err(Error::Os(libc::EPERM))));
    match l.call(&cx(), &Op::ListXattr { node: a.node, size: 4096 }).unwrap() {
        Reply::Xattr(XattrReply::Data(d)) => assert!(!d.windows(DIRID_XATTR.len()).any(|w| w == DIRID_XATTR.as_bytes())),
        other => panic!("{other:?}"),
    }
    // A stray lower name that does not decrypt is not shown.
    std::fs::write(dir.path().join("not-encrypted"), b"x").unwrap();
    assert_eq!(names(&l, NodeId::ROOT).len(), 2);
}

/// The lower name of the root entry shown as `name`.
fn lookup_lower(lower: &Path, l: &Level, name: &str) -> OsString {
    let e = l.lookup(&cx(), NodeId::ROOT, OsStr::new(name)).unwrap();
    l.forget(&cx(), e.node, 1);
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(lower)
        .unwrap()
        .map(|d| d.unwrap())
        .find(|d| d.metadata().unwrap().ino() == e.node.0)
        .unwrap()
        .file_name()
}

#[test]
fn long_names_survive_renames_links_and_removal_without_leftovers() {
    let (dir, l) = volume(false);
    let d = l.mkdir(&cx(), NodeId::ROOT, OsStr::new("d"), 0o755).unwrap();
    let mut live = BTreeSet::new();
    for i in 0..60u8 {
        let n = name_of(180 + (i as usize % 76), i);
        touch(&l, d.node, &n).unwrap();
        live.insert(n);
    }
    assert_eq!(names(&l, d.node), live);
    // Rename every other one to another long name, some into the root, and link a few.
    let all: Vec<OsString> = live.iter().cloned().collect();
    for (i, n) in all.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        let to = name_of(250, i as u8 + 100);
        let (new_parent, set) = if i % 4 == 0 { (NodeId::ROOT, None) } else { (d.node, Some(&mut live)) };
        l.call(&cx(), &Op::Rename { parent: d.node, name: n, new_parent, new_name: &to, flags: 0 }).unwrap();
        if let Some(set) = set {
            set.remove(n);
            set.insert(to);
        } else {
            live.remove(n);
        }
    }
    assert_eq!(names(&l, d.node), live);
    let first = live.iter().next().unwrap().clone();
    let e = l.lookup(&cx(), d.node, &first).unwrap();
    let linked = name_of(240, 7);
    l.call(&cx(), &Op::Link { node: e.node, new_parent: NodeId::ROOT, new_name: &linked }).unwrap();
    assert_eq!(l.getattr(&cx(), e.node).unwrap().nlink, 2);
    assert!(names(&l, NodeId::ROOT).contains(&linked));
    // Remove everything: no companion may stay behind.
    for n in live.clone() {
        l.unlink(&cx(), d.node, &n).unwrap();
    }
    for n in names(&l, NodeId::ROOT) {
        if n != "d" {
            l.unlink(&cx(), NodeId::ROOT, &n).unwrap();
        }
    }
    l.call(&cx(), &Op::RmDir { parent: NodeId::ROOT, name: OsStr::new("d") }).unwrap();
    assert_eq!(lower_names(dir.path()), [OsString::from(keys::CONFIG_NAME)].into_iter().collect());
}

#[test]
fn symlink_targets_are_sealed_and_report_their_length() {
    let (dir, l) = volume(false);
    for target in ["x", "../some/where/else", &"t".repeat(3000), &"t".repeat(3100), &"u".repeat(4095)] {
        let name = OsString::from(format!("link{}", target.len()));
        let e = match l.call(&cx(), &Op::SymLink { parent: NodeId::ROOT, name: &name, target: Path::new(target) }).unwrap() {
            Reply::Entry(e) => e,
            other => panic!("{other:?}"),
        };
        assert_eq!(e.attr.size, target.len() as u64, "a symlink's size is its target's length");
        assert_eq!(l.getattr(&cx(), e.node).unwrap().size, target.len() as u64);
        match l.call(&cx(), &Op::ReadLink { node: e.node }).unwrap() {
            Reply::Data(d) => assert_eq!(d, target.as_bytes()),
            other => panic!("{other:?}"),
        }
    }
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let p = entry.unwrap().path();
        if let Ok(t) = std::fs::read_link(&p) {
            assert!(!t.as_os_str().as_bytes().windows(4).any(|w| w == b"some"), "a target shows below: {t:?}");
        }
    }
    // The two longest are kept in companion files, which the layer does not show.
    let companions = std::fs::read_dir(dir.path()).unwrap().filter(|e| e.as_ref().unwrap().file_name().as_bytes().starts_with(b"T.")).count();
    assert_eq!(companions, 2);
    assert_eq!(names(&l, NodeId::ROOT).len(), 5);
    let too_long = "t".repeat(4096);
    let err = l.call(&cx(), &Op::SymLink { parent: NodeId::ROOT, name: OsStr::new("big"), target: Path::new(&too_long) });
    assert!(matches!(err, Err(Error::Os(libc::ENAMETOOLONG))), "{err:?}");
}

#[test]
fn plaintext_names_keep_names_and_still_guard_the_config() {
    let (dir, l) = volume(true);
    touch(&l, NodeId::ROOT, OsStr::new("plain.txt")).unwrap();
    assert!(dir.path().join("plain.txt").exists());
    assert_eq!(names(&l, NodeId::ROOT), [OsString::from("plain.txt")].into_iter().collect());
    assert!(l.lookup(&cx(), NodeId::ROOT, OsStr::new(keys::CONFIG_NAME)).is_err());
    assert!(matches!(touch(&l, NodeId::ROOT, OsStr::new(keys::CONFIG_NAME)), Err(Error::Os(libc::EPERM))));
    let rename = Op::Rename {
        parent: NodeId::ROOT,
        name: OsStr::new("plain.txt"),
        new_parent: NodeId::ROOT,
        new_name: OsStr::new(keys::CONFIG_NAME),
        flags: 0,
    };
    assert!(matches!(l.call(&cx(), &rename), Err(Error::Os(libc::EPERM))));
}
