//! Reverse views (`plyfs mount PLAIN MNT --reverse`): the encrypted view of a plaintext tree,
//! copied out, mounts as a crypt volume and reads back the tree; views of an unchanged tree are
//! byte-identical, a change shows only in its own objects, and the view refuses writes.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Every object under `root`: kind, mode and content (file bytes, symlink target).
fn tree(root: &Path) -> BTreeMap<PathBuf, (String, Vec<u8>)> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, (String, Vec<u8>)>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().to_owned();
            let mode = format!("{:o}", m.mode());
            if m.is_dir() {
                out.insert(rel, (mode, Vec::new()));
                walk(root, &p, out);
            } else if m.file_type().is_symlink() {
                out.insert(rel, (mode, fs::read_link(&p).unwrap().into_os_string().into_encoded_bytes()));
            } else {
                out.insert(rel, (mode, fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8).collect()
}

/// A plaintext tree with what a reverse view has to get right: sizes around the chunk size,
/// an empty file and directory, names of 255 bytes, short and PATH_MAX - 1 symlink targets, a
/// hard link, modes; and files the exclusions below leave out.
fn plaintext(root: &Path) {
    fs::create_dir_all(root.join("a/b/c")).unwrap();
    fs::create_dir(root.join("empty")).unwrap();
    for (i, n) in [0usize, 1, 100, 4095, 4096, 4097, 70_000, (1 << 20) + 3].iter().enumerate() {
        fs::write(root.join(format!("a/f{n}")), bytes(*n, i as u8)).unwrap();
    }
    let long = "n".repeat(255);
    fs::write(root.join("a/b").join(&long), b"under a long name").unwrap();
    fs::create_dir(root.join("a").join("d".repeat(250))).unwrap();
    fs::write(root.join("a").join("d".repeat(250)).join("inside"), b"deep").unwrap();
    symlink("f100", root.join("a/short-link")).unwrap();
    symlink(format!("/{}", "t/".repeat(2047)), root.join("a/b/long-link")).unwrap();
    fs::hard_link(root.join("a/f4096"), root.join("a/b/c/hard")).unwrap();
    fs::set_permissions(root.join("a/f1"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::set_permissions(root.join("a/b/c"), fs::Permissions::from_mode(0o750)).unwrap();
    fs::write(root.join("a/scratch.tmp"), b"left out").unwrap();
    fs::create_dir_all(root.join("cache/x")).unwrap();
    fs::write(root.join("cache/x/big"), bytes(10_000, 9)).unwrap();
}

/// `plyfs init PLAIN --reverse`, as a script would run it.
fn init_reverse(dir: &Path, plain: &Path) {
    let passfile = crypt_passfile(dir);
    let out = run(plyfs().arg("init").arg(plain).args(["--reverse", "--kdf-memory", "1024", "--passfile"]).arg(&passfile));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim().len(), 80, "init shows the master key");
}

/// Mount the reverse view of `plain` (under the test directory `root`) at `mnt`.
fn view(root: &Path, plain: &Path, mnt: &Path, extra: &[&str]) -> Mount {
    let passfile = format!("--passfile={}", crypt_passfile(root).display());
    let mut args = vec!["--reverse", passfile.as_str()];
    args.extend_from_slice(extra);
    // The mount's own directory holds only its log: the test's files outlive it.
    let logs = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    Mount::start(logs, plain.to_owned(), mnt.to_owned(), "", &args)
}

/// The test's directory (removed when dropped), its canonical path, and the plaintext tree
/// made in its `plain`; `view`, `copy` and `back` are made beside it.
fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let (dir, root, [plain, ..]) = scratch_dirs(["plain", "view", "copy", "back"]);
    plaintext(&plain);
    (dir, root, plain)
}

#[test]
fn the_view_copied_out_mounts_as_a_crypt_volume_and_reads_back_the_tree() {
    let (_dir, root, plain) = dirs();
    init_reverse(&root, &plain);
    let v = view(&root, &plain, &root.join("view"), &["--exclude=*.tmp", "--exclude=/cache"]);
    // What a backup sees: no plaintext name, the configuration at the root.
    let shown = tree(&v.mnt);
    assert!(shown.contains_key(Path::new(".plyfs-crypt.conf")));
    for p in shown.keys() {
        let s = p.to_string_lossy();
        assert!(!s.contains("f4096") && !s.contains("nnnn") && !s.contains("scratch") && !s.contains("cache"), "{s}");
    }
    // Copied with cp -a (no extended attributes come along: directory ids travel as files).
    let copy = root.join("copy");
    let out = Command::new("cp").arg("-a").arg(format!("{}/.", v.mnt.display())).arg(&copy).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    drop(v);
    let logs = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let back = Mount::start(logs, copy, root.join("back"), "crypt", &[&format!("--passfile={}", root.join("passfile").display())]);
    let mut want = tree(&plain);
    want.retain(|p, _| {
        let s = p.to_string_lossy();
        !s.ends_with(".tmp") && !s.starts_with("cache") && s != ".plyfs-crypt.reverse.conf"
    });
    let got = tree(&back.mnt);
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (p, w) in &want {
        assert!(got[p] == *w, "{} differs (mode {} vs {})", p.display(), got[p].0, w.0);
    }
    assert!(!back.daemon_log().contains("WARN"), "{}", back.daemon_log());
    // Read-write as any volume: a new file, and removing a directory the copy gave an id file.
    fs::write(back.path("a/new"), b"written after the restore").unwrap();
    fs::remove_dir_all(back.path("a")).unwrap();
    fs::remove_dir(back.path("empty")).unwrap();
}

#[test]
fn views_of_an_unchanged_tree_are_identical_and_a_change_shows_only_in_its_own_objects() {
    let (_dir, root, plain) = dirs();
    init_reverse(&root, &plain);
    let mut v = view(&root, &plain, &root.join("view"), &[]);
    let first = tree(&v.mnt);
    v.unmount();
    let mut v = view(&root, &plain, &root.join("view"), &[]);
    assert!(tree(&v.mnt) == first, "a second view of the same tree differs");
    v.unmount();

    // One byte changed in the middle of the 1 MiB file, in place.
    let big = plain.join("a").join(format!("f{}", (1 << 20) + 3));
    let f = fs::OpenOptions::new().write(true).open(&big).unwrap();
    f.write_all_at(&[0xee], 500_000).unwrap();
    drop(f);
    let v = view(&root, &plain, &root.join("view"), &[]);
    let second = tree(&v.mnt);
    let changed: Vec<&PathBuf> = first.keys().filter(|p| first[*p] != second[*p]).collect();
    assert_eq!(changed.len(), 1, "only the changed file's object differs: {changed:?}");
    assert_eq!(first.keys().collect::<Vec<_>>(), second.keys().collect::<Vec<_>>());
    // Within it, only the record of the chunk that changed: what rsync's rolling checksums
    // would send.
    let (a, b) = (&first[changed[0]].1, &second[changed[0]].1);
    assert_eq!(a.len(), b.len());
    let differing: Vec<usize> = (0..a.len()).filter(|i| a[*i] != b[*i]).collect();
    let span = differing.last().unwrap() - differing.first().unwrap();
    assert!(span < 4200, "the change spans {span} bytes of the encrypted file, more than one chunk's record");
}

#[test]
fn the_view_refuses_every_change_and_wrong_passwords() {
    let (_dir, root, plain) = dirs();
    // Not set up yet: one line saying how.
    let out = run(plyfs().arg("mount").arg(&plain).arg(root.join("view")).args(["--reverse", "--passfile"]).arg(crypt_passfile(&root)));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--reverse") && err.trim().lines().count() == 1, "{err}");
    init_reverse(&root, &plain);
    let wrong = root.join("wrong");
    fs::write(&wrong, "not it\n").unwrap();
    let out = run(plyfs().arg("mount").arg(&plain).arg(root.join("view")).args(["--reverse", "--passfile"]).arg(&wrong));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("wrong password") && err.trim().lines().count() == 1, "{err}");
    assert!(mounted_fstype(&root.join("view")).is_none());

    let before = tree(&plain);
    let v = view(&root, &plain, &root.join("view"), &[]);
    let shown = tree(&v.mnt);
    let pick = |want: &dyn Fn(&Path) -> bool| {
        shown.keys().map(|p| v.mnt.join(p)).find(|p| want(p) && !p.ends_with(".plyfs-crypt.conf") && !p.ends_with(".plyfs-dirid")).unwrap()
    };
    let some_file = pick(&|p: &Path| fs::symlink_metadata(p).unwrap().is_file());
    let some_dir = pick(&|p: &Path| fs::symlink_metadata(p).unwrap().is_dir());
    let erofs = |r: std::io::Result<()>| assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EROFS));
    erofs(fs::write(v.path("new"), b"x"));
    erofs(fs::OpenOptions::new().append(true).open(&some_file).map(|_| ()));
    erofs(fs::create_dir(v.path("d")));
    erofs(fs::remove_file(&some_file));
    erofs(fs::remove_dir_all(&some_dir));
    erofs(fs::rename(&some_file, v.path("moved")));
    erofs(fs::set_permissions(&some_file, fs::Permissions::from_mode(0o777)));
    erofs(symlink("x", v.path("l")));
    drop(v);
    assert!(tree(&plain) == before, "the plaintext changed under a reverse view");
}
