//! `union` through real mounts: a read-write upper branch (the mount's LOWER) over a read-only
//! branch that already holds files.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirEntryExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use common::*;

/// A union of a fresh upper directory (LOWER) over `ro`, which `fill` populates first.
fn union_over(stack: &str, fill: impl FnOnce(&Path)) -> (Mount, PathBuf) {
    let (dir, _, [upper, ro, mnt]) = scratch_dirs(["upper", "ro", "mnt"]);
    fill(&ro);
    let branch = format!("--branch={}=ro", ro.display());
    (Mount::start(dir, upper, mnt, stack, &[&branch]), ro)
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn sample_tree(ro: &Path) {
    fs::write(ro.join("shared"), "lower shared").unwrap();
    fs::write(ro.join("lower-only"), "lower only").unwrap();
    fs::create_dir_all(ro.join("dir/sub")).unwrap();
    fs::write(ro.join("dir/a"), "a").unwrap();
    fs::write(ro.join("dir/sub/deep"), "deep").unwrap();
    std::os::unix::fs::symlink("lower-only", ro.join("link")).unwrap();
}

#[test]
fn lookup_prefers_the_first_branch_and_listings_merge_without_duplicates() {
    let (m, _ro) = union_over("union", sample_tree);
    fs::write(m.lower_path("shared"), "upper shared").unwrap();
    fs::create_dir(m.lower_path("dir")).unwrap();
    fs::write(m.lower_path("dir/b"), "b").unwrap();
    assert_eq!(fs::read_to_string(m.path("shared")).unwrap(), "upper shared");
    assert_eq!(fs::read_to_string(m.path("lower-only")).unwrap(), "lower only");
    assert_eq!(fs::read_to_string(m.path("link")).unwrap(), "lower only");
    assert_eq!(names(&m.mnt), ["dir", "link", "lower-only", "shared"]);
    assert_eq!(names(&m.path("dir")), ["a", "b", "sub"]);
    assert_eq!(fs::read_to_string(m.path("dir/sub/deep")).unwrap(), "deep");
    // Inode numbers are unique across branches, and readdir agrees with stat.
    let mut inos: Vec<u64> = ["shared", "lower-only", "dir", "dir/a", "dir/b"].iter().map(|p| fs::metadata(m.path(p)).unwrap().ino()).collect();
    for e in fs::read_dir(m.path("dir")).unwrap() {
        let e = e.unwrap();
        assert_eq!(e.ino(), fs::symlink_metadata(e.path()).unwrap().ino(), "{:?}", e.path());
    }
    inos.sort();
    inos.dedup();
    assert_eq!(inos.len(), 5);
    // Each branch is reachable on its own.
    assert_eq!(names(&m.path(".plyfs")), ["union.0", "union.0.policy", "union.1", "union.1.policy"]);
    assert_eq!(fs::read_to_string(m.path(".plyfs/union.1/shared")).unwrap(), "lower shared");
    let branches = op_json(&m.mnt, &["branch-list"]);
    assert_eq!(branches[1]["mode"], "ro");
    assert_eq!(branches[0]["dir"], m.lower.display().to_string());
}

#[test]
fn copy_up_keeps_data_metadata_and_inode_and_leaves_the_lower_branch_alone() {
    let old = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    let (m, ro) = union_over("union", |ro| {
        sample_tree(ro);
        let f = ro.join("dir/a");
        fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).unwrap();
        fs::File::options().write(true).open(&f).unwrap().set_modified(old).unwrap();
        if is_root() {
            std::os::unix::fs::chown(&f, Some(1234), Some(2345)).unwrap();
        }
        xattr_set(&f, "user.note", b"kept");
    });
    let ino = fs::metadata(m.path("dir/a")).unwrap().ino();
    let dir_ino = fs::metadata(m.path("dir")).unwrap().ino();
    // Setting an attribute copies the file up without touching its times.
    xattr_set(&m.path("dir/a"), "user.more", b"x");
    let up = fs::metadata(m.lower_path("dir/a")).unwrap();
    assert_eq!(up.permissions().mode() & 0o7777, 0o640);
    assert_eq!(up.modified().unwrap(), old);
    if is_root() {
        assert_eq!((up.uid(), up.gid()), (1234, 2345));
    }
    assert_eq!(xattr_get(&m.lower_path("dir/a"), "user.note").as_deref(), Some(&b"kept"[..]));
    assert_eq!(fs::read_to_string(m.lower_path("dir/a")).unwrap(), "a");
    // Writes go to the copy; the read-only branch is untouched.
    fs::OpenOptions::new().append(true).open(m.path("dir/a")).unwrap().write_all(b"+more").unwrap();
    assert_eq!(fs::read_to_string(m.path("dir/a")).unwrap(), "a+more");
    assert_eq!(fs::read_to_string(ro.join("dir/a")).unwrap(), "a");
    // The union's own attributes never show.
    let listed = String::from_utf8(xattr_list(&m.path("dir/a"))).unwrap();
    assert!(listed.contains("user.note") && !listed.contains("plyfs"), "{listed:?}");
    // The same numbers after copy-up and after a remount.
    assert_eq!(fs::metadata(m.path("dir/a")).unwrap().ino(), ino);
    assert_eq!(fs::metadata(m.path("dir")).unwrap().ino(), dir_ino);
    let m = m.remount();
    assert_eq!(fs::metadata(m.path("dir/a")).unwrap().ino(), ino);
    assert_eq!(fs::metadata(m.path("dir")).unwrap().ino(), dir_ino);
    // Truncating opens copy no data.
    fs::write(m.path("lower-only"), "new").unwrap();
    assert_eq!(fs::read_to_string(m.path("lower-only")).unwrap(), "new");
    assert_eq!(fs::read_to_string(ro.join("lower-only")).unwrap(), "lower only");
}

/// `chattr` on a file or directory of the read-only branch copies it up, as any change does;
/// `lsattr` reads where the object shows from.
#[test]
fn file_attribute_flags_set_on_a_lower_branch_object_copy_it_up() {
    let (m, ro) = union_over("union", sample_tree);
    let Ok(flags) = get_file_flags(&ro.join("dir/a")) else { return };
    assert_eq!(get_file_flags(&m.path("dir/a")), Ok(flags));
    assert_eq!(get_file_flags(&m.path("dir/sub")), get_file_flags(&ro.join("dir/sub")));
    assert!(!m.lower_path("dir/a").exists());
    assert_eq!(set_file_flags(&m.path("dir/a"), flags | FS_NOATIME_FL), 0);
    assert_eq!(get_file_flags(&m.lower_path("dir/a")), Ok(flags | FS_NOATIME_FL), "set on the copy");
    assert_eq!(get_file_flags(&m.path("dir/a")), Ok(flags | FS_NOATIME_FL));
    assert_eq!(get_file_flags(&ro.join("dir/a")), Ok(flags), "the read-only branch untouched");
    assert_eq!(fs::read_to_string(m.path("dir/a")).unwrap(), "a");
    let dflags = get_file_flags(&ro.join("dir/sub")).unwrap();
    assert_eq!(set_file_flags(&m.path("dir/sub"), dflags | FS_NOATIME_FL), 0);
    assert_eq!(get_file_flags(&m.lower_path("dir/sub")), Ok(dflags | FS_NOATIME_FL));
    assert_eq!(get_file_flags(&ro.join("dir/sub")), Ok(dflags));
    assert_eq!(names(&m.path("dir/sub")), ["deep"]);
}

/// A copy-up carries `noatime` (`chattr +A`) and `sync` (`+S`) as overlayfs does; the read-only
/// branch's other flags stay below.
#[test]
fn a_copy_up_keeps_the_noatime_and_sync_flags() {
    const FS_SYNC_FL: libc::c_int = 0x08;
    const FS_NODUMP_FL: libc::c_int = 0x40;
    let mut below = None;
    let (m, ro) = union_over("union", |ro| {
        sample_tree(ro);
        let Ok(flags) = get_file_flags(&ro.join("dir/a")) else { return };
        for (path, extra) in [("dir/a", FS_NOATIME_FL | FS_NODUMP_FL), ("dir/sub", FS_SYNC_FL), ("shared", 0)] {
            assert_eq!(set_file_flags(&ro.join(path), get_file_flags(&ro.join(path)).unwrap() | extra), 0, "{path}");
        }
        below = Some(flags);
    });
    let Some(plain) = below else { return };
    // A write copies dir/a up, and dir/sub (its parent's copy is made for dir/sub/deep).
    fs::OpenOptions::new().append(true).open(m.path("dir/a")).unwrap().write_all(b"+").unwrap();
    fs::OpenOptions::new().append(true).open(m.path("dir/sub/deep")).unwrap().write_all(b"+").unwrap();
    fs::OpenOptions::new().append(true).open(m.path("shared")).unwrap().write_all(b"+").unwrap();
    let up = |p: &str| get_file_flags(&m.lower_path(p)).unwrap();
    assert_eq!(up("dir/a") & (FS_NOATIME_FL | FS_NODUMP_FL), FS_NOATIME_FL, "noatime kept, nodump not");
    assert_eq!(up("dir/sub") & FS_SYNC_FL, FS_SYNC_FL, "sync kept on a directory");
    assert_eq!(up("shared") & (FS_NOATIME_FL | FS_SYNC_FL), plain & (FS_NOATIME_FL | FS_SYNC_FL), "nothing added");
    assert_eq!(get_file_flags(&m.path("dir/a")).unwrap() & FS_NOATIME_FL, FS_NOATIME_FL);
    assert_eq!(fs::read_to_string(m.path("dir/a")).unwrap(), "a+");
    assert_eq!(fs::read_to_string(ro.join("dir/a")).unwrap(), "a");
}

#[test]
fn whiteouts_and_opaque_directories_hide_what_lies_below() {
    let (m, ro) = union_over("union", sample_tree);
    fs::remove_file(m.path("lower-only")).unwrap();
    fs::remove_file(m.path("link")).unwrap();
    fs::remove_dir_all(m.path("dir")).unwrap();
    assert_eq!(names(&m.mnt), ["shared"]);
    assert!(ro.join("dir/sub/deep").exists() && ro.join("lower-only").exists());
    // A directory made again where one was removed starts empty.
    fs::create_dir(m.path("dir")).unwrap();
    assert!(names(&m.path("dir")).is_empty());
    fs::write(m.path("lower-only"), "again").unwrap();
    let m = m.remount();
    assert_eq!(names(&m.mnt), ["dir", "lower-only", "shared"]);
    assert!(names(&m.path("dir")).is_empty());
    assert_eq!(fs::read_to_string(m.path("lower-only")).unwrap(), "again");
    // A whiteout-looking symlink cannot be made by a user.
    let err = std::os::unix::fs::symlink("(plyfs union whiteout)", m.path("trick")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
}

#[test]
fn a_directory_on_several_branches_is_removed_whole() {
    let (m, _ro) = union_over("union", sample_tree);
    fs::create_dir_all(m.lower_path("dir/sub")).unwrap();
    fs::write(m.lower_path("dir/upper-file"), "u").unwrap();
    assert_eq!(names(&m.path("dir")), ["a", "sub", "upper-file"]);
    let err = fs::remove_dir(m.path("dir")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTEMPTY));
    fs::remove_dir_all(m.path("dir")).unwrap();
    assert!(!m.path("dir").exists());
    let m = m.remount();
    assert!(!m.path("dir").exists());
    assert_eq!(names(&m.mnt), ["link", "lower-only", "shared"]);
}

#[test]
fn renames_move_files_across_branches_and_directories_with_lower_contents_fall_back() {
    let (m, ro) = union_over("union", sample_tree);
    let ino = fs::metadata(m.path("lower-only")).unwrap().ino();
    fs::rename(m.path("lower-only"), m.path("dir/moved")).unwrap();
    assert_eq!(fs::read_to_string(m.path("dir/moved")).unwrap(), "lower only");
    assert_eq!(fs::metadata(m.path("dir/moved")).unwrap().ino(), ino);
    assert!(!m.path("lower-only").exists());
    assert!(ro.join("lower-only").exists());
    // Over an existing lower file.
    fs::rename(m.path("dir/moved"), m.path("shared")).unwrap();
    assert_eq!(fs::read_to_string(m.path("shared")).unwrap(), "lower only");
    // A directory whose contents are on the read-only branch: EXDEV, and mv copies instead.
    let err = fs::rename(m.path("dir"), m.path("dir2")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EXDEV));
    let out = Command::new("mv").arg(m.path("dir")).arg(m.path("dir2")).output().unwrap();
    assert!(out.status.success(), "mv: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(fs::read_to_string(m.path("dir2/sub/deep")).unwrap(), "deep");
    assert!(!m.path("dir").exists());
    // A directory made in the union renames in place, even over a removed lower name.
    fs::create_dir(m.path("fresh")).unwrap();
    fs::write(m.path("fresh/f"), "f").unwrap();
    fs::rename(m.path("fresh"), m.path("dir")).unwrap();
    assert_eq!(names(&m.path("dir")), ["f"]);
    let m = m.remount();
    assert_eq!(names(&m.mnt), ["dir", "dir2", "link", "shared"]);
    assert_eq!(names(&m.path("dir")), ["f"]);
}

/// `telldir`/`seekdir` on a merged directory of 100,000 entries (Perl has both).
#[test]
fn readdir_offsets_resume_on_a_large_merged_directory() {
    let (m, _ro) = union_over("union", |ro| {
        fs::create_dir(ro.join("big")).unwrap();
        for i in 0..60_000 {
            fs::File::create(ro.join(format!("big/f{i:06}"))).unwrap();
        }
    });
    fs::create_dir(m.lower_path("big")).unwrap();
    // 40,000 new names and 10,000 that the lower branch has too.
    for i in 50_000..100_000 {
        fs::File::create(m.lower_path(&format!("big/f{i:06}"))).unwrap();
    }
    let script = r#"
        opendir(my $d, $ARGV[0]) or die "opendir: $!";
        my (@names, @marks);
        while (1) {
            my $pos = telldir($d);
            my $n = readdir($d);
            last unless defined $n;
            next if $n eq '.' || $n eq '..';
            push @marks, [$pos, $n] if @names % 997 == 0;
            push @names, $n;
        }
        my %seen; $seen{$_}++ for @names;
        die "duplicates" if grep { $seen{$_} > 1 } keys %seen;
        for my $m (@marks) {
            seekdir($d, $m->[0]);
            my $n = readdir($d);
            $n = readdir($d) while $n eq '.' || $n eq '..';
            die "seekdir to $m->[0]: got $n, want $m->[1]" unless $n eq $m->[1];
        }
        print scalar(@names), "\n";
    "#;
    let out = Command::new("perl").arg("-e").arg(script).arg(m.path("big")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "100000");
}

#[test]
fn branches_come_and_go_at_run_time() {
    let (m, ro) = union_over("union", sample_tree);
    let extra = m.dir.path().join("extra");
    fs::create_dir(&extra).unwrap();
    fs::write(extra.join("added"), "from the added branch").unwrap();
    fs::write(extra.join("shared"), "hidden below").unwrap();
    let list = op_json(&m.mnt, &["branch-add", extra.to_str().unwrap(), "ro"]);
    assert_eq!(list.as_array().unwrap().len(), 3);
    assert_eq!(list[2]["name"], "union.2");
    assert_eq!(fs::read_to_string(m.path("added")).unwrap(), "from the added branch");
    assert_eq!(fs::read_to_string(m.path("shared")).unwrap(), "lower shared");
    assert_eq!(fs::read_to_string(m.path(".plyfs/union.2/added")).unwrap(), "from the added branch");
    // Refused while a file on it is open, then allowed.
    let open = fs::File::open(m.path("added")).unwrap();
    let out = run(plyfs().arg("op").arg(&m.mnt).args(["branch-remove", "union.2"]));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 files are open on branch 'union.2'"), "{}", String::from_utf8_lossy(&out.stderr));
    drop(open);
    op_json(&m.mnt, &["branch-remove", "union.2"]);
    // The kernel may keep the name for the entry timeout.
    std::thread::sleep(Duration::from_millis(1100));
    assert!(!m.path("added").exists());
    // Bad requests change nothing.
    for (args, expect) in [
        (vec!["branch-add", ro.to_str().unwrap()], "is already branch 'union.1'"),
        (vec!["branch-add", "/nonexistent/plyfs"], "No such file or directory"),
        (vec!["branch-add", m.mnt.to_str().unwrap()], "mnt is branch 'union."),
        (vec!["branch-remove", "nosuch"], "no branch named 'nosuch'"),
    ] {
        let out = run(plyfs().arg("op").arg(&m.mnt).args(&args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(expect) && err.lines().count() == 1, "{args:?}: {err}");
    }
    op_json(&m.mnt, &["branch-remove", "union.1"]);
    let out = run(plyfs().arg("op").arg(&m.mnt).args(["branch-remove", "union.0"]));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is the last branch"));
    assert_eq!(op_json(&m.mnt, &["branch-list"]).as_array().unwrap().len(), 1);
}

#[test]
fn bad_branches_are_refused_with_one_line_and_nothing_mounted() {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (lower, other, mnt) = (root.join("lower"), root.join("other"), root.join("mnt"));
    for d in [&lower, &other, &mnt] {
        fs::create_dir(d).unwrap();
    }
    fs::create_dir(lower.join("inner")).unwrap();
    // Exit statuses (`man plyfs`, EXIT STATUS): a bad command line, a bad mount point.
    const USAGE: i32 = 2;
    const MOUNT_POINT: i32 = 10;
    let refuse = |stack: &str, branches: &[String], status: i32, expect: &str| {
        let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).arg("--stack").arg(stack).args(branches.iter().flat_map(|b| ["--branch", b.as_str()])));
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(status), "{stack} {branches:?}: {err}");
        assert!(err.starts_with("plyfs: ") && err.lines().count() == 1 && err.contains(expect), "{stack} {branches:?}: {err:?} should say {expect:?}");
        assert!(mounted_fstype(&mnt).is_none());
    };
    let o = other.display().to_string();
    refuse("union", &[format!("{}/missing=ro", o)], USAGE, "branch 'union.1': ");
    refuse("union", &[format!("{}/missing=ro", o)], USAGE, "No such file or directory");
    refuse("union", &[lower.display().to_string()], USAGE, "is already branch 'union.0'");
    refuse("union", &[format!("{}/inner", lower.display())], USAGE, "lies inside branch 'union.0'");
    refuse("union", &[mnt.display().to_string()], MOUNT_POINT, "is the branch");
    refuse("union", &[format!("{o}=rx")], USAGE, "expected DIR, DIR=ro or DIR=rw");
    refuse("null", std::slice::from_ref(&o), USAGE, "--branch needs a fan-out layer");
    refuse("union,null", std::slice::from_ref(&o), USAGE, "layers below a fan-out layer go in its branches");
    refuse("zstd,union", std::slice::from_ref(&o), USAGE, "cannot sit above the fan-out layer 'union'");
    refuse("union[null|null|null]", std::slice::from_ref(&o), USAGE, "branch 2: no directory");
    refuse("union[nosuch|null]", std::slice::from_ref(&o), USAGE, "branch 'union.0': unknown layer 'nosuch'");
    assert!(fs::read_dir(&lower).unwrap().count() == 1, "nothing written below");
}

/// A branch is a stack of its own: a compressed upper branch stores what the union writes,
/// copy-ups included, compressed.
#[test]
fn a_branch_with_its_own_layers_encodes_what_lands_on_it() {
    let text = "plyfs union branch text ".repeat(4000);
    let (m, ro) = union_over("union[zstd|]", |ro| fs::write(ro.join("big.txt"), &text).unwrap());
    fs::write(m.path("new.txt"), &text).unwrap();
    fs::OpenOptions::new().append(true).open(m.path("big.txt")).unwrap().write_all(b"end").unwrap();
    assert_eq!(fs::read_to_string(m.path("new.txt")).unwrap(), text);
    assert_eq!(fs::read_to_string(m.path("big.txt")).unwrap(), format!("{text}end"));
    for f in ["new.txt", "big.txt"] {
        let stored = fs::metadata(m.lower_path(f)).unwrap().len();
        assert!(stored < text.len() as u64 / 5, "{f}: {stored} bytes stored");
    }
    assert_eq!(fs::read_to_string(ro.join("big.txt")).unwrap(), text);
    let m = m.remount();
    assert_eq!(fs::read_to_string(m.path("big.txt")).unwrap(), format!("{text}end"));
    assert!(names(&m.path(".plyfs")).contains(&"union.0.zstd".to_owned()));
}

#[test]
fn files_on_a_plain_branch_keep_the_passthrough_fast_path() {
    if !is_root() {
        return;
    }
    let (m, _ro) = union_over("trace,union", |ro| fs::write(ro.join("big"), vec![3u8; 1 << 20]).unwrap());
    let mut data = Vec::new();
    fs::File::open(m.path("big")).unwrap().read_to_end(&mut data).unwrap();
    fs::write(m.path("new"), vec![4u8; 1 << 20]).unwrap();
    assert_eq!(fs::read(m.path("new")).unwrap().len(), 1 << 20);
    let stats = op_json(&m.mnt, &["stats"]);
    assert_eq!(stats["ops"]["read"]["count"].as_u64().unwrap_or(0), 0, "{stats}");
    assert_eq!(stats["ops"]["write"]["count"].as_u64().unwrap_or(0), 0, "{stats}");
}

/// SIGKILL in the middle of a copy-up: after a remount the original shows, whole, and the
/// partial copy is gone.
#[test]
fn a_killed_copy_up_leaves_the_original_and_no_partial_file() {
    const SIZE: usize = 768 << 20;
    let (mut m, ro) = union_over("union[zstd:level=1|]", |ro| {
        let mut f = fs::File::create(ro.join("huge")).unwrap();
        let block: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
        for _ in 0..SIZE >> 20 {
            f.write_all(&block).unwrap();
        }
    });
    let upper = m.lower.clone();
    let target = m.path("huge");
    let writer = std::thread::spawn(move || fs::OpenOptions::new().append(true).open(target).map(|_| ()));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let copying = fs::read_dir(&upper).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().starts_with(".plyfs-union."));
        if copying {
            break;
        }
        assert!(Instant::now() < deadline, "no copy-up seen");
        std::thread::sleep(Duration::from_millis(2));
    }
    m.child().kill().unwrap();
    let _ = m.child().wait();
    let _ = writer.join();
    let m = m.remount();
    assert_eq!(fs::metadata(m.path("huge")).unwrap().len(), SIZE as u64);
    assert_eq!(names(&m.mnt), ["huge"]);
    assert!(!m.lower_path("huge").exists(), "no partial copy in place");
    assert!(fs::read_dir(&m.lower).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().starts_with(".plyfs-union.")), "leftover removed");
    assert_eq!(fs::metadata(ro.join("huge")).unwrap().len(), SIZE as u64);
}

fn xattr_set(path: &Path, name: &str, value: &[u8]) {
    let (p, n) = (cpath(path), std::ffi::CString::new(name).unwrap());
    let rc = unsafe { libc::setxattr(p.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    assert_eq!(rc, 0, "setxattr {name} on {}: {}", path.display(), std::io::Error::last_os_error());
}

fn xattr_get(path: &Path, name: &str) -> Option<Vec<u8>> {
    let (p, n) = (cpath(path), std::ffi::CString::new(name).unwrap());
    let mut buf = vec![0u8; 4096];
    let rc = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (rc >= 0).then(|| {
        buf.truncate(rc as usize);
        buf
    })
}

fn xattr_list(path: &Path) -> Vec<u8> {
    let p = cpath(path);
    let mut buf = vec![0u8; 4096];
    let rc = unsafe { libc::listxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(rc >= 0);
    buf.truncate(rc as usize);
    buf
}

/// A branch may be a crypt volume of its own: its password unlocks it at mount, for a
/// background daemon too.
#[test]
fn a_crypt_volume_can_be_a_branch() {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (upper, vault, mnt) = (root.join("upper"), root.join("vault"), root.join("mnt"));
    for d in [&upper, &vault, &mnt] {
        fs::create_dir(d).unwrap();
    }
    let passfile = crypt_init(&root, &vault, &[]);
    let pass = format!("--passfile={}", passfile.display());
    {
        let m = Mount::start(tempfile::tempdir().unwrap(), vault.clone(), mnt.clone(), "crypt", &[&pass]);
        fs::write(m.path("secret.txt"), "sealed below").unwrap();
    }
    // In the background: the parent unlocks the branch and hands its key to the daemon.
    let out = run(plyfs().arg("mount").arg(&upper).arg(&mnt).args(["--stack", "union[|crypt]", "--branch"]).arg(format!("{}=ro", vault.display())).arg(&pass));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let read = fs::read_to_string(mnt.join("secret.txt"));
    fs::write(mnt.join("new.txt"), "plain upper").unwrap();
    let umount = run(plyfs().arg("umount").arg(&mnt));
    assert!(umount.status.success(), "{}", String::from_utf8_lossy(&umount.stderr));
    assert_eq!(read.unwrap(), "sealed below");
    assert_eq!(fs::read_to_string(upper.join("new.txt")).unwrap(), "plain upper");
    assert!(fs::read_dir(&vault).unwrap().all(|e| e.unwrap().file_name() != "secret.txt"), "names stay encrypted in the branch");
}

/// The upper branch fails in the middle of a copy-up (a torn write, then an error): the
/// application gets the error, the original stays visible and whole, and no partial copy is
/// left; once the branch works again the same change succeeds.
#[test]
fn a_copy_up_failed_by_fault_leaves_the_original() {
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
    let (m, ro) = union_over("union[fault|]", |ro| fs::write(ro.join("data.bin"), &data).unwrap());
    op_json(&m.mnt, &["fault-add@union.0.fault", "op=write", "torn=100000", "count=1"]);
    let err = fs::OpenOptions::new().append(true).open(m.path("data.bin")).and_then(|mut f| f.write_all(b"more")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(m.daemon_log().contains("copy-up") || m.daemon_log().contains("union"), "{}", m.daemon_log());
    assert_eq!(fs::read(m.path("data.bin")).unwrap(), data, "the original still shows, whole");
    assert_eq!(names(&m.mnt), ["data.bin"]);
    assert!(!m.lower_path("data.bin").exists(), "no partial copy in place");
    assert!(fs::read_dir(&m.lower).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().starts_with(".plyfs-union.")));
    // The fault fired once; now the copy-up goes through.
    fs::OpenOptions::new().append(true).open(m.path("data.bin")).unwrap().write_all(b"more").unwrap();
    let mut want = data.clone();
    want.extend_from_slice(b"more");
    assert_eq!(fs::read(m.path("data.bin")).unwrap(), want);
    assert_eq!(fs::read(ro.join("data.bin")).unwrap(), data);
}

/// The offline tools build the same tree as a mount: fsck, decode and du of a union whose upper
/// branch compresses.
#[test]
fn offline_tools_go_through_trees() {
    let text = "offline through the tree\n".repeat(2000);
    let (mut m, ro) = union_over("union[zstd|]", |ro| fs::write(ro.join("base.txt"), "base\n").unwrap());
    fs::write(m.path("new.txt"), &text).unwrap();
    fs::OpenOptions::new().append(true).open(m.path("base.txt")).unwrap().write_all(b"more\n").unwrap();
    m.unmount();
    let branch = format!("{}=ro", ro.display());
    let args = ["--stack", "union[zstd|]", "--branch", branch.as_str()];
    let out = run(plyfs().arg("fsck").arg(&m.lower).args(args));
    assert!(out.status.success() && String::from_utf8_lossy(&out.stderr).contains("2 files checked, 0 damaged"), "{}", String::from_utf8_lossy(&out.stderr));
    let dest = m.dir.path().join("decoded");
    let out = run(plyfs().arg("decode").arg(&m.lower).arg(&dest).args(args));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(fs::read_to_string(dest.join("new.txt")).unwrap(), text);
    assert_eq!(fs::read_to_string(dest.join("base.txt")).unwrap(), "base\nmore\n");
    let out = run(plyfs().arg("du").arg(&m.lower).args(args));
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("new.txt"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `renameat2(RENAME_WHITEOUT)`, which overlayfs asks of its upper file system: the old name
/// shows a character device 0/0 (an object of its own, hiding the lower branch's file), the new
/// name the file, and the read-only branch is left alone (xfstests generic/631 found it refused).
#[test]
fn a_whiteout_rename_leaves_a_device_that_hides_the_lower_file() {
    assert!(is_root(), "RENAME_WHITEOUT needs CAP_MKNOD: run as root");
    let (m, ro) = union_over("union", sample_tree);
    let rename_whiteout = |from: &str, to: &str| {
        let (from, to) = (cpath(&m.path(from)), cpath(&m.path(to)));
        let rc = unsafe { libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_WHITEOUT) };
        assert_eq!(rc, 0, "renameat2(RENAME_WHITEOUT): errno {}", errno());
    };
    rename_whiteout("lower-only", "moved");
    rename_whiteout("dir/a", "dir/b");
    let m = m.remount();
    for (old, new, data) in [("lower-only", "moved", "lower only"), ("dir/a", "dir/b", "a")] {
        let st = fs::symlink_metadata(m.path(old)).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_char_device(&st.file_type()) && st.rdev() == 0, "{old}: a whiteout device");
        assert_eq!(fs::read_to_string(m.path(new)).unwrap(), data);
    }
    assert_eq!(fs::read_to_string(ro.join("lower-only")).unwrap(), "lower only");
    assert_eq!(names(&ro.join("dir")), ["a", "sub"]);
    fs::remove_file(m.path("lower-only")).unwrap();
    assert!(!m.path("lower-only").exists(), "removing the device leaves the name empty, not the lower file");
}

/// Unmounts an overlayfs mount when dropped, also when the test fails.
struct Overlay(PathBuf);

impl Drop for Overlay {
    fn drop(&mut self) {
        let c = cpath(&self.0);
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Kernel overlayfs with its upper and work directories on a union mount mounts, and renames
/// and creates in it work (it needs RENAME_WHITEOUT there).
#[test]
fn overlayfs_takes_a_union_mount_as_its_upper_file_system() {
    assert!(is_root(), "mounting overlayfs needs root");
    let (m, _ro) = union_over("union", sample_tree);
    for d in ["ovl-lower/etc", "ovl-upper", "ovl-work", "ovl-merged"] {
        fs::create_dir_all(m.path(d)).unwrap();
    }
    fs::write(m.path("ovl-lower/etc/access.conf"), "conf").unwrap();
    let merged = m.path("ovl-merged");
    let opts = format!(
        "lowerdir={},upperdir={},workdir={},index=off",
        m.path("ovl-lower").display(),
        m.path("ovl-upper").display(),
        m.path("ovl-work").display()
    );
    let out = Command::new("mount").args(["-t", "overlay", "overlay", "-o", &opts]).arg(&merged).output().unwrap();
    assert!(out.status.success(), "mount -t overlay: {}", String::from_utf8_lossy(&out.stderr));
    let overlay = Overlay(merged.clone());
    for _ in 0..2 {
        fs::rename(merged.join("etc/access.conf"), merged.join("etc/access.conf.bak")).unwrap();
        fs::write(merged.join("etc/access.conf"), "new").unwrap();
    }
    assert_eq!(fs::read_to_string(merged.join("etc/access.conf.bak")).unwrap(), "new");
    assert_eq!(fs::read_to_string(m.path("ovl-lower/etc/access.conf")).unwrap(), "conf");
    drop(overlay);
}

/// In an immutable or append-only directory, removing a name is refused with EPERM before the
/// union looks whether a directory is empty or across branches, as a kernel file system does
/// (xfstests generic/079 found ENOTEMPTY).
#[test]
fn names_in_an_immutable_directory_cannot_be_removed() {
    assert!(is_root(), "chattr +i needs CAP_LINUX_IMMUTABLE: run as root");
    let (m, _ro) = union_over("union", sample_tree);
    // A whiteout marks the branch: removals take the union's own path.
    fs::remove_file(m.path("lower-only")).unwrap();
    fs::create_dir_all(m.path("d/sub")).unwrap();
    fs::write(m.path("d/sub/f"), "x").unwrap();
    fs::write(m.path("d/f"), "x").unwrap();
    fs::create_dir(m.path("d/empty")).unwrap();
    let before = get_file_flags(&m.path("d")).unwrap();
    for flag in [FS_IMMUTABLE_FL, FS_APPEND_FL] {
        assert_eq!(set_file_flags(&m.path("d"), before | flag), 0, "chattr");
        for (what, result) in [
            ("d/sub", fs::remove_dir(m.path("d/sub"))),
            ("d/empty", fs::remove_dir(m.path("d/empty"))),
            ("d/f", fs::remove_file(m.path("d/f"))),
            ("dir (lower, holding d)", fs::remove_dir(m.path("dir"))),
        ] {
            if what.starts_with("dir") {
                assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::ENOTEMPTY), "{what}: the flag of d is not its");
                continue;
            }
            assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::EPERM), "{what} with flag {flag:#x} on d");
        }
        assert_eq!(set_file_flags(&m.path("d"), before), 0, "chattr");
    }
    fs::remove_dir(m.path("d/empty")).unwrap();
    fs::remove_file(m.path("d/f")).unwrap();
}
