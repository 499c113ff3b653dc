//! An attacker who holds the ciphertext of a crypt volume and moves whole files in it (#28
//! item 8): swapping two sealed files, in one directory or across directories, while the volume
//! is unmounted or mounted. On a volume made with `--bind-paths` each swapped file fails to
//! open with EIO (and `plyfs fsck` names it); without it they read as each other, which is the
//! documented limit (the README's threat model). Renames through the mount, a daemon killed in
//! the middle of one, and random sequences of file operations keep every file readable.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;
use std::sync::Mutex;

use common::{cpath, errno, op_json, plyfs, run, Mount};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Mounts start under this lock, so that the one test that sets the crash point in the
/// environment gives it to its own daemon only.
static SPAWN: Mutex<()> = Mutex::new(());

fn volume(init_args: &[&str]) -> Mount {
    let _g = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
    Mount::crypt("crypt", init_args, &[])
}

fn remount(m: Mount) -> Mount {
    let _g = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
    m.remount()
}

const BOUND: &[&str] = &["--bind-paths"];
const BIND_XATTR: &str = "user.plyfs.bind";

fn get_xattr(path: &Path, name: &str) -> Result<Vec<u8>, i32> {
    let (path, name) = (cpath(path), std::ffi::CString::new(name).unwrap());
    let mut buf = vec![0u8; 256];
    let n = unsafe { libc::getxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(errno());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// The lower path (relative) of a file shown at `rel` in the mount.
fn lower_of(m: &Mount, rel: &str) -> String {
    op_json(&m.path(rel), &["lower-info"])["lower_rel_path"].as_str().expect("lower_rel_path").to_owned()
}

/// Swap two lower files, as someone with write access to the storage can.
fn swap(lower: &Path, a: &str, b: &str) {
    let (a, b, tmp) = (lower.join(a), lower.join(b), lower.join("swap.tmp"));
    fs::rename(&a, &tmp).unwrap();
    fs::rename(&b, &a).unwrap();
    fs::rename(&tmp, &b).unwrap();
}

fn read_errno(m: &Mount, rel: &str) -> Option<i32> {
    fs::read(m.path(rel)).err().map(|e| e.raw_os_error().unwrap_or(0))
}

fn drop_caches() {
    unsafe { libc::sync() };
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

/// Three files to swap (two in the root, one in a subdirectory) and one left alone; their
/// lower paths.
fn victims(m: &Mount) -> [String; 3] {
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("a"), b"the content of a, which is the root's").unwrap();
    fs::write(m.path("b"), vec![b'b'; 10_000]).unwrap();
    fs::write(m.path("d/c"), b"c lives in d").unwrap();
    fs::write(m.path("untouched"), b"nobody moved me").unwrap();
    ["a", "b", "d/c"].map(|rel| lower_of(m, rel))
}

fn fsck(m: &Mount, args: &[&str]) -> (bool, String) {
    let passfile = common::crypt_passfile(m.dir.path());
    let out = run(plyfs().arg("fsck").arg(&m.lower).args(["--stack", "crypt", "--passfile"]).arg(&passfile).args(args));
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn swapped_files_fail_to_open_on_a_bound_volume_and_fsck_names_them() {
    let mut m = volume(BOUND);
    let [a, b, c] = victims(&m);
    m.unmount();
    swap(&m.lower, &a, &b); // in one directory
    let mut m = remount(m);
    // Across directories, with the volume mounted: the kernel's caches dropped first.
    swap(&m.lower, &b, &c);
    drop_caches();
    for rel in ["a", "b", "d/c"] {
        assert_eq!(read_errno(&m, rel), Some(libc::EIO), "{rel} read after its file was swapped");
    }
    // Nothing else breaks: the other file, listings, stat, new files.
    assert_eq!(fs::read(m.path("untouched")).unwrap(), b"nobody moved me");
    let names: BTreeSet<String> = fs::read_dir(m.path("")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(names, ["a", "b", "d", "untouched"].map(String::from).into());
    fs::metadata(m.path("a")).unwrap();
    fs::write(m.path("new"), b"fresh").unwrap();
    assert_eq!(fs::read(m.path("new")).unwrap(), b"fresh");
    // One line per file, naming it and the cause.
    let log = m.daemon_log();
    for rel in ["/a ", "/b ", "/d/c "] {
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(rel) && l.contains("refused with EIO")).collect();
        assert_eq!(lines.len(), 1, "{rel}: {log}");
        assert!(lines[0].contains("bound to another place"), "{}", lines[0]);
    }
    m.unmount();
    let (ok, report) = fsck(&m, &[]);
    assert!(!ok, "{report}");
    for rel in ["a:", "b:", "d/c:"] {
        assert!(report.lines().any(|l| l.contains(&format!("plyfs: {rel}"))), "{rel} not reported: {report}");
    }
    assert!(report.contains("5 files checked, 3 damaged"), "{report}");
    // Swapped back, they read again: nothing was lost.
    swap(&m.lower, &b, &c);
    swap(&m.lower, &a, &b);
    let m = remount(m);
    assert_eq!(fs::read(m.path("a")).unwrap(), b"the content of a, which is the root's");
    assert_eq!(fs::read(m.path("d/c")).unwrap(), b"c lives in d");
}

#[test]
fn a_tag_taken_off_or_copied_does_not_let_a_file_in() {
    let mut m = volume(BOUND);
    let [a, b, _] = victims(&m);
    m.unmount();
    // b's content and b's tag, copied over a's: the tag is b's place's, not a's.
    fs::copy(m.lower.join(&b), m.lower.join(&a)).unwrap();
    let tag = get_xattr(&m.lower.join(&b), BIND_XATTR).unwrap();
    let (path, name) = (cpath(&m.lower.join(&a)), std::ffi::CString::new(BIND_XATTR).unwrap());
    assert_eq!(unsafe { libc::setxattr(path.as_ptr(), name.as_ptr(), tag.as_ptr().cast(), tag.len(), 0) }, 0);
    // A file whose tag was taken off.
    let path = cpath(&m.lower.join(&b));
    assert_eq!(unsafe { libc::removexattr(path.as_ptr(), name.as_ptr()) }, 0);
    let m = remount(m);
    assert_eq!(read_errno(&m, "a"), Some(libc::EIO));
    assert_eq!(read_errno(&m, "b"), Some(libc::EIO));
    assert!(m.daemon_log().contains("place tag is missing"), "{}", m.daemon_log());
    // The tag is not shown above.
    assert_eq!(get_xattr(&m.path("untouched"), BIND_XATTR), Err(libc::ENODATA));
    let path = cpath(&m.path("untouched"));
    let mut list = vec![0u8; 4096];
    let n = unsafe { libc::listxattr(path.as_ptr(), list.as_mut_ptr().cast(), list.len()) };
    assert!(n >= 0);
    assert!(!list[..n as usize].split(|b| *b == 0).any(|x| x == BIND_XATTR.as_bytes()));
    // The owner who trusts the tree as it stands binds every file where it is: b reads again,
    // and a reads as what was put there.
    let mut m = m;
    m.unmount();
    let (ok, report) = fsck(&m, &[]);
    assert!(!ok && report.contains("4 files checked, 2 damaged"), "{report}");
    let (ok, report) = fsck(&m, &["--rebind"]);
    assert!(ok, "{report}");
    assert!(report.contains("2 files bound anew"), "{report}");
    let m = remount(m);
    assert_eq!(fs::read(m.path("b")).unwrap(), vec![b'b'; 10_000]);
    assert_eq!(fs::read(m.path("a")).unwrap(), vec![b'b'; 10_000]);
}

/// The documented limit of a volume made without `--bind-paths` (as of gocryptfs): whole files
/// swapped in the storage read as each other, with no error.
#[test]
fn without_binding_swapped_files_read_as_each_other() {
    let mut m = volume(&[]);
    let [a, b, c] = victims(&m);
    m.unmount();
    swap(&m.lower, &a, &b);
    swap(&m.lower, &a, &c);
    let m = remount(m);
    assert_eq!(fs::read(m.path("a")).unwrap(), b"c lives in d");
    assert_eq!(fs::read(m.path("b")).unwrap(), b"the content of a, which is the root's");
    assert_eq!(fs::read(m.path("d/c")).unwrap(), vec![b'b'; 10_000]);
}

fn renameat2(from: &Path, to: &Path, flags: u32) -> i32 {
    let (f, t) = (cpath(from), cpath(to));
    if unsafe { libc::renameat2(libc::AT_FDCWD, f.as_ptr(), libc::AT_FDCWD, t.as_ptr(), flags) } == 0 {
        0
    } else {
        errno()
    }
}

#[test]
fn renames_through_the_mount_keep_files_readable() {
    let m = volume(BOUND);
    fs::create_dir_all(m.path("d/e")).unwrap();
    fs::create_dir(m.path("f")).unwrap();
    for (rel, body) in [("one", "1"), ("two", "2"), ("three", "3"), ("four", "4"), ("d/e/deep", "deep"), ("victim", "v")] {
        fs::write(m.path(rel), body.repeat(5000)).unwrap();
    }
    fs::rename(m.path("one"), m.path("uno")).unwrap(); // same directory
    fs::rename(m.path("two"), m.path("f/dos")).unwrap(); // across directories
    fs::rename(m.path("three"), m.path("victim")).unwrap(); // over an existing file
    fs::write(m.path("f/cinco"), "5".repeat(5000)).unwrap();
    assert_eq!(renameat2(&m.path("four"), &m.path("f/cinco"), libc::RENAME_EXCHANGE), 0);
    fs::rename(m.path("d"), m.path("f/d")).unwrap(); // a directory: its children keep their directory's id
    fs::hard_link(m.path("uno"), m.path("f/uno-link")).unwrap();
    fs::rename(m.path("f/uno-link"), m.path("uno-link")).unwrap();
    // Special files have nothing to bind, and are never opened for it (a FIFO's open would
    // wait for a writer): linked and renamed, they stay what they are.
    let fifo = cpath(&m.path("fifo"));
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    fs::hard_link(m.path("fifo"), m.path("f/fifo-link")).unwrap();
    fs::rename(m.path("f/fifo-link"), m.path("fifo-moved")).unwrap();
    use std::os::unix::fs::FileTypeExt;
    assert!(fs::metadata(m.path("fifo-moved")).unwrap().file_type().is_fifo());
    // A file linked, its first name removed, then written anew (a new file id) under the name
    // left, whether it was empty or not when it was linked.
    for (first, other, before) in [("empty", "f/empty-link", ""), ("full", "f/full-link", "old")] {
        fs::write(m.path(first), before).unwrap();
        fs::hard_link(m.path(first), m.path(other)).unwrap();
        fs::remove_file(m.path(first)).unwrap();
        fs::write(m.path(other), "L".repeat(5000)).unwrap();
    }
    let expect = [
        ("uno", "1"),
        ("f/dos", "2"),
        ("victim", "3"),
        ("f/cinco", "4"),
        ("four", "5"),
        ("f/d/e/deep", "deep"),
        ("uno-link", "1"),
        ("f/empty-link", "L"),
        ("f/full-link", "L"),
    ];
    let check = |m: &Mount| {
        for (rel, body) in expect {
            assert_eq!(fs::read_to_string(m.path(rel)).unwrap(), body.repeat(5000), "{rel}");
        }
    };
    check(&m);
    drop_caches();
    check(&m);
    let mut m = remount(m);
    check(&m);
    assert!(!m.daemon_log().contains("refused"), "{}", m.daemon_log());
    m.unmount();
    let (ok, report) = fsck(&m, &[]);
    assert!(ok, "{report}");
}

/// The daemon dies (as under `kill -9`) after the new place's tag is written and before the
/// lower rename, or just after the rename: the file stays readable where it is, with no repair.
#[test]
fn a_daemon_killed_in_the_middle_of_a_rename_loses_nothing() {
    for (at, lands_at) in [("bind-before-rename", "f"), ("bind-after-rename", "d/g")] {
        let m = {
            let _g = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
            std::env::set_var("PLYFS_CRYPT_CRASH_AT", at);
            let m = Mount::crypt("crypt", BOUND, &[]);
            std::env::remove_var("PLYFS_CRYPT_CRASH_AT");
            m
        };
        fs::create_dir(m.path("d")).unwrap();
        fs::write(m.path("f"), b"survives the crash").unwrap();
        let err = fs::rename(m.path("f"), m.path("d/g")).unwrap_err();
        assert!(matches!(err.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED)), "{at}: {err}");
        let out = run(plyfs().arg("umount").arg(&m.mnt));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let mut m = remount(m);
        assert_eq!(fs::read(m.path(lands_at)).unwrap(), b"survives the crash", "{at}");
        // And it can be renamed on, and back.
        fs::rename(m.path(lands_at), m.path("h")).unwrap();
        fs::rename(m.path("h"), m.path(lands_at)).unwrap();
        let mut m2 = {
            m.unmount();
            remount(m)
        };
        assert_eq!(fs::read(m2.path(lands_at)).unwrap(), b"survives the crash", "{at}");
        m2.unmount();
        let (ok, report) = fsck(&m2, &[]);
        assert!(ok, "{at}: {report}");
    }
}

// A differential test: random sequences of operations on a bound volume and on a model.

#[derive(Clone, Debug)]
enum FileOp {
    Write(usize, usize, u8),
    Rename(usize, usize),
    Exchange(usize, usize),
    Link(usize, usize),
    Unlink(usize),
}

const PATHS: [&str; 6] = ["a", "b", "d0/a", "d0/c", "d1/b", "d1/e"];

fn file_op() -> impl Strategy<Value = FileOp> {
    let p = 0..PATHS.len();
    prop_oneof![
        3 => (p.clone(), 0..9000usize, any::<u8>()).prop_map(|(i, len, fill)| FileOp::Write(i, len, fill)),
        3 => (p.clone(), p.clone()).prop_map(|(a, b)| FileOp::Rename(a, b)),
        1 => (p.clone(), p.clone()).prop_map(|(a, b)| FileOp::Exchange(a, b)),
        1 => (p.clone(), p.clone()).prop_map(|(a, b)| FileOp::Link(a, b)),
        1 => p.prop_map(FileOp::Unlink),
    ]
}

/// Which file each path names, and each file's content.
#[derive(Default)]
struct Model {
    paths: BTreeMap<usize, usize>,
    files: BTreeMap<usize, Vec<u8>>,
    next: usize,
}

impl Model {
    fn apply(&mut self, op: &FileOp) {
        match *op {
            FileOp::Write(i, len, fill) => {
                let body = vec![fill; len];
                match self.paths.get(&i) {
                    Some(f) => {
                        self.files.insert(*f, body);
                    }
                    None => {
                        self.next += 1;
                        self.paths.insert(i, self.next);
                        self.files.insert(self.next, body);
                    }
                }
            }
            FileOp::Rename(a, b) => {
                let Some(f) = self.paths.get(&a).copied() else { return };
                if self.paths.get(&b) == Some(&f) {
                    return; // the same file: rename(2) does nothing
                }
                self.paths.remove(&a);
                self.paths.insert(b, f);
            }
            FileOp::Exchange(a, b) => {
                if let (Some(fa), Some(fb)) = (self.paths.get(&a).copied(), self.paths.get(&b).copied()) {
                    self.paths.insert(a, fb);
                    self.paths.insert(b, fa);
                }
            }
            FileOp::Link(a, b) => {
                if let (Some(f), false) = (self.paths.get(&a).copied(), self.paths.contains_key(&b)) {
                    self.paths.insert(b, f);
                }
            }
            FileOp::Unlink(a) => {
                self.paths.remove(&a);
            }
        }
    }
}

fn perform(root: &Path, op: &FileOp, model: &Model) {
    let p = |i: usize| root.join(PATHS[i]);
    match *op {
        FileOp::Write(i, len, fill) => fs::write(p(i), vec![fill; len]).unwrap(),
        FileOp::Rename(a, b) if model.paths.contains_key(&a) => fs::rename(p(a), p(b)).unwrap(),
        FileOp::Exchange(a, b) if model.paths.contains_key(&a) && model.paths.contains_key(&b) => {
            assert_eq!(renameat2(&p(a), &p(b), libc::RENAME_EXCHANGE), 0)
        }
        FileOp::Link(a, b) if model.paths.contains_key(&a) && !model.paths.contains_key(&b) => fs::hard_link(p(a), p(b)).unwrap(),
        FileOp::Unlink(a) if model.paths.contains_key(&a) => fs::remove_file(p(a)).unwrap(),
        _ => {}
    }
}

fn compare(root: &Path, model: &Model) -> Result<(), String> {
    for (i, rel) in PATHS.iter().enumerate() {
        let got = fs::read(root.join(rel));
        match (model.paths.get(&i), got) {
            (None, Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
            (Some(f), Ok(body)) if body == model.files[f] => {}
            (want, got) => {
                return Err(format!("{}/{rel}: want {:?}, got {:?}", root.display(), want.map(|f| model.files[f].len()), got.map(|b| b.len())))
            }
        }
    }
    Ok(())
}

#[test]
fn random_operations_on_a_bound_volume_match_a_model() {
    let mut m = volume(BOUND);
    let mut runner = TestRunner::new(Config { cases: 64, failure_persistence: None, ..Config::default() });
    let case = std::cell::Cell::new(0);
    let finals = std::cell::RefCell::new(Vec::new());
    let result = runner.run(&proptest::collection::vec(file_op(), 1..40), |ops| {
        case.set(case.get() + 1);
        let root = m.path(&format!("case{}", case.get()));
        for d in ["", "d0", "d1"] {
            fs::create_dir(root.join(d)).unwrap();
        }
        let mut model = Model::default();
        for op in &ops {
            perform(&root, op, &model);
            model.apply(op);
        }
        compare(&root, &model).map_err(|e| TestCaseError::fail(format!("{e} after {ops:?}")))?;
        finals.borrow_mut().push((case.get(), model, ops));
        Ok(())
    });
    result.unwrap();
    // Every binding written was the right one: after a remount, with nothing cached, every
    // case reads the same.
    m.unmount();
    let m = remount(m);
    for (n, model, ops) in finals.borrow().iter() {
        if let Err(e) = compare(&m.path(&format!("case{n}")), model) {
            panic!("after a remount: {e}; the operations: {ops:?}");
        }
    }
    assert!(!m.daemon_log().contains("refused"), "{}", m.daemon_log());
}
