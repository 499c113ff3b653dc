//! A mount point inside a directory the stack stores in (or a storage directory inside the mount
//! point) is refused before anything is mounted: such a daemon waits on itself, unkillably
//! (#29). Every way of naming the same directory is tried: directly, through a symlink, through
//! a bind mount, as a branch, in the foreground and in the background.

mod common;

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A command that mounted or hung is a failure, not a stuck test run: past this it is killed.
const SAFETY_NET: Duration = Duration::from_secs(60);

/// Unmounts whatever a regression mounted at its path, aborting the FUSE connection first so a
/// daemon waiting on itself lets go.
struct NothingLeftAt(PathBuf);

impl Drop for NothingLeftAt {
    fn drop(&mut self) {
        if mounted_fstype(&self.0).is_none() {
            return;
        }
        if let Some(minor) = fuse_connection(&self.0) {
            let _ = fs::write(format!("/sys/fs/fuse/connections/{minor}/abort"), "1");
        }
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// The FUSE connection number (the device's minor) of the mount at `path`.
fn fuse_connection(path: &Path) -> Option<String> {
    let text = fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines().rev().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        (Path::new(fields.get(4)?) == path).then(|| fields[2].split(':').nth(1).unwrap_or("").to_owned())
    })
}

/// A bind mount of `source` at `target`, unmounted when dropped.
struct BindMount(PathBuf);

impl BindMount {
    fn new(source: &Path, target: &Path) -> BindMount {
        let ok = Command::new("mount").arg("--bind").arg(source).arg(target).status().unwrap().success();
        assert!(ok, "mount --bind {} {}", source.display(), target.display());
        BindMount(target.to_owned())
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Run `plyfs mount ARGS` (with `--foreground` if asked) and check it is refused with one line
/// saying `expect`, exit status 10 (a bad mount point), and nothing mounted at `mnt`.
fn refused(args: &[&Path], extra: &[&str], mnt: &Path, foreground: bool, expect: &str) {
    let _cleanup = NothingLeftAt(mnt.to_owned());
    let mut cmd = plyfs();
    cmd.arg("mount").args(args).args(extra);
    if foreground {
        cmd.arg("--foreground");
    }
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + SAFETY_NET;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("plyfs mount {args:?} {extra:?} still runs after {SAFETY_NET:?}: it was not refused");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
    // The status of a bad mount point (`man plyfs`, EXIT STATUS).
    assert_eq!(status.code(), Some(10), "{args:?} {extra:?}: {err}");
    assert!(err.starts_with("plyfs: ") && err.lines().count() == 1 && err.contains(expect), "{args:?} {extra:?}: {err:?} should say {expect:?}");
    assert!(!fs::read_to_string("/proc/mounts").unwrap().contains(&format!(" {} ", mnt.display())), "{} is mounted", mnt.display());
}

fn inside_lower(mnt: &Path, lower: &Path) -> String {
    format!("mount point {} lies inside the lower {} (the daemon would wait on itself); choose a mount point outside it", mnt.display(), lower.display())
}

#[test]
fn a_mount_point_inside_the_lower_is_refused_for_every_stack_in_both_modes() {
    let (_dir, _root, [lower]) = scratch_dirs(["lower"]);
    let inner = lower.join("inner");
    fs::create_dir(&inner).unwrap();
    for stack in ["null", "zstd", "version", "union", "mirror"] {
        for foreground in [false, true] {
            refused(&[&lower, &inner], &["--stack", stack], &inner, foreground, &inside_lower(&inner, &lower));
        }
    }
    refused(&[&lower, &lower], &[], &lower, false, "is the lower");
}

#[test]
fn symlinks_do_not_hide_a_mount_point_inside_the_lower() {
    let (_dir, root, [lower]) = scratch_dirs(["lower"]);
    let inner = lower.join("inner");
    fs::create_dir(&inner).unwrap();
    // The lower's parent through a link, and the mount point itself a link into the lower.
    let (to_lower, to_inner) = (root.join("to-lower"), root.join("to-inner"));
    symlink(&lower, &to_lower).unwrap();
    symlink(&inner, &to_inner).unwrap();
    let via_link = to_lower.join("inner");
    refused(&[&lower, &via_link], &[], &inner, false, &inside_lower(&via_link, &lower));
    refused(&[&lower, &to_inner], &[], &inner, true, &inside_lower(&to_inner, &lower));
    // The lower given through the link is the same directory.
    refused(&[&to_lower, &inner], &[], &inner, false, "lies inside the lower");
}

#[test]
fn a_bind_mount_does_not_hide_a_mount_point_inside_the_lower() {
    let (_dir, _root, [lower, bound]) = scratch_dirs(["lower", "bound"]);
    fs::create_dir(lower.join("inner")).unwrap();
    let _bind = BindMount::new(&lower, &bound);
    let inner = bound.join("inner");
    refused(&[&lower, &inner], &["--stack", "zstd"], &inner, false, &inside_lower(&inner, &lower));
    refused(&[&bound, &lower.join("inner")], &[], &lower.join("inner"), true, "lies inside the lower");
}

#[test]
fn a_lower_inside_the_mount_point_is_refused() {
    let (_dir, _root, [mnt]) = scratch_dirs(["mnt"]);
    let lower = mnt.join("lower");
    fs::create_dir(&lower).unwrap();
    let expect = format!("the lower {} lies inside the mount point {} (the mount would hide it)", lower.display(), mnt.display());
    refused(&[&lower, &mnt], &[], &mnt, false, &expect);
}

#[test]
fn a_mount_point_inside_a_branch_is_refused() {
    let (_dir, _root, [lower, ro, other]) = scratch_dirs(["lower", "ro", "other"]);
    let inner = ro.join("inner");
    fs::create_dir(&inner).unwrap();
    let branch = format!("{}=ro", ro.display());
    refused(&[&lower, &inner], &["--stack", "union", "--branch", &branch], &inner, false, "lies inside the branch");
    let spec = format!("mirror[@{}|@{}]", other.display(), ro.display());
    refused(&[&lower, &inner], &["--stack", &spec], &inner, true, "lies inside the branch");
    // A branch inside the mount point is hidden by it.
    let hidden = other.join("hidden");
    fs::create_dir(&hidden).unwrap();
    refused(&[&lower, &other], &["--stack", "union", "--branch", hidden.to_str().unwrap()], &other, false, "lies inside the mount point");
}

#[test]
fn a_reverse_view_inside_its_plaintext_is_refused() {
    let (_dir, _root, [plain]) = scratch_dirs(["plain"]);
    let inner = plain.join("inner");
    fs::create_dir(&inner).unwrap();
    refused(&[&plain, &inner], &["--reverse"], &inner, false, "lies inside the plaintext directory");
}
