//! The local trust boundaries of a mount (#28, items 5 to 7), tried as an attacker would: a
//! second local user (`nobody`, through `setpriv`) against the logs, the fan-in paths under
//! `MNT/.plyfs/`, the control socket and the runtime directory, and loose key files.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::*;

const NOBODY: u32 = 65534;

/// Run `script` with `sh -c` as the user `nobody`, with no groups: its success and standard error.
fn sh_as_nobody(script: &str) -> (bool, String) {
    as_nobody(&["sh", "-c", script])
}

fn quote(p: &Path) -> String {
    format!("'{}'", p.display())
}

/// A scratch directory that `nobody` may enter (tempfile makes them 0700), and its subdirectories.
fn open_scratch<const N: usize>(names: [&str; N]) -> (tempfile::TempDir, PathBuf, [PathBuf; N]) {
    let (dir, root, paths) = scratch_dirs(names);
    fs::set_permissions(&root, fs::Permissions::from_mode(0o755)).unwrap();
    for p in &paths {
        fs::set_permissions(p, fs::Permissions::from_mode(0o755)).unwrap();
    }
    (dir, root, paths)
}

#[test]
fn the_trace_log_is_0600_and_nobody_can_read_or_append_it() {
    let (dir, root, [lower, mnt]) = open_scratch(["lower", "mnt"]);
    let log = root.join("trace.jsonl");
    let mut m = Mount::start(dir, lower, mnt, &format!("trace:log={},null", log.display()), &[]);
    fs::write(m.path("secret-name"), b"x").unwrap();
    let meta = fs::symlink_metadata(&log).unwrap();
    assert!(meta.is_file());
    assert_eq!(meta.mode() & 0o777, 0o600, "the trace log is {:o}", meta.mode() & 0o777);
    let read = sh_as_nobody(&format!("cat {}", quote(&log)));
    assert!(!read.0, "nobody read the trace log");
    let append = sh_as_nobody(&format!("echo forged >> {}", quote(&log)));
    assert!(!append.0, "nobody appended to the trace log");
    m.unmount();
    assert!(!fs::read_to_string(&log).unwrap().contains("forged"));
}

#[test]
fn a_trace_log_that_is_a_symlink_or_another_users_file_is_refused_by_name() {
    let (_dir, root, [lower, mnt]) = open_scratch(["lower", "mnt"]);
    let target = root.join("victim");
    fs::write(&target, b"untouched").unwrap();
    let cases: [(&str, Box<dyn Fn(&Path)>, &str); 3] = [
        ("link.jsonl", Box::new(|p: &Path| std::os::unix::fs::symlink(&target, p).unwrap()), "symbolic link"),
        ("dangling.jsonl", Box::new(|p: &Path| std::os::unix::fs::symlink(root.join("made-by-plyfs"), p).unwrap()), "symbolic link"),
        (
            "theirs.jsonl",
            Box::new(|p: &Path| {
                fs::write(p, b"").unwrap();
                std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY)).unwrap();
            }),
            "owned by uid 65534",
        ),
    ];
    for (name, plant, why) in cases {
        let log = root.join(name);
        plant(&log);
        let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).arg("--stack").arg(format!("trace:log={},null", log.display())));
        if out.status.success() {
            run(plyfs().arg("umount").arg(&mnt));
            panic!("a trace log {name} was accepted");
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&log.display().to_string()) && err.contains(why), "{name}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    assert_eq!(fs::read(&target).unwrap(), b"untouched");
    assert!(!root.join("made-by-plyfs").exists());
}

#[test]
fn a_background_daemons_log_is_private_whatever_the_umask() {
    let (_dir, root, [lower, mnt]) = open_scratch(["lower", "mnt"]);
    let log = root.join("daemon.log");
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).arg("--stack").arg("null").arg("--log").arg(&log));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mode = fs::metadata(&log).unwrap().mode() & 0o777;
    let sock_mode = fs::metadata(control_socket(0, &mnt)).map(|m| m.mode() & 0o777);
    assert!(run(plyfs().arg("umount").arg(&mnt)).status.success());
    assert_eq!(mode, 0o600, "the daemon log is {mode:o}");
    assert_eq!(sock_mode.unwrap(), 0o600, "the control socket");
}

/// A union of the mount's LOWER over a branch mounted `=ro` that holds `f`.
fn union_with_ro_branch() -> (Mount, PathBuf) {
    let (dir, _, [upper, ro, mnt]) = open_scratch(["upper", "ro", "mnt"]);
    fs::write(ro.join("f"), b"read only").unwrap();
    fs::create_dir(ro.join("d")).unwrap();
    let branch = format!("--branch={}=ro", ro.display());
    (Mount::start(dir, upper, mnt, "union", &[&branch]), ro)
}

#[test]
fn a_read_only_branch_stays_read_only_through_its_fan_in_view() {
    let (m, ro) = union_with_ro_branch();
    let view = m.path(".plyfs/union.1");
    assert_eq!(fs::read(view.join("f")).unwrap(), b"read only");
    let erofs = |r: std::io::Result<()>, what: &str| {
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EROFS), "{what}");
    };
    erofs(fs::write(view.join("new"), b"planted"), "create");
    erofs(fs::write(view.join("f"), b"changed"), "write");
    erofs(fs::OpenOptions::new().append(true).open(view.join("f")).map(drop), "open for append");
    erofs(fs::create_dir(view.join("newdir")), "mkdir");
    erofs(fs::remove_file(view.join("f")), "unlink");
    erofs(fs::remove_dir(view.join("d")), "rmdir");
    erofs(fs::rename(view.join("f"), view.join("g")), "rename");
    erofs(fs::set_permissions(view.join("f"), fs::Permissions::from_mode(0o777)), "chmod");
    erofs(std::os::unix::fs::symlink("f", view.join("l")), "symlink");
    erofs(fs::write(view.join("d/inner"), b"deeper"), "create in a subdirectory");
    assert_eq!(fs::read(ro.join("f")).unwrap(), b"read only");
    assert!(!ro.join("new").exists() && !ro.join("newdir").exists() && !ro.join("d/inner").exists());
    // The writable branch and the union itself still take changes.
    fs::write(m.path(".plyfs/union.0/w"), b"ok").unwrap();
    fs::write(m.path("f"), b"copied up").unwrap();
    assert_eq!(fs::read(ro.join("f")).unwrap(), b"read only");
}

#[test]
fn the_levels_inside_a_read_only_branch_are_read_only_too() {
    let (dir, _, [upper, ro, mnt]) = open_scratch(["upper", "ro", "mnt"]);
    let branch = format!("--branch={}=ro", ro.display());
    let m = Mount::start(dir, upper, mnt, "union[null|zstd@=ro]", &[&branch]);
    for view in [".plyfs/union.1", ".plyfs/union.1.zstd"] {
        let err = fs::write(m.path(view).join("new"), b"planted").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{view}: {err}");
    }
    // (Only the lower lock, which the mount holds shared on its read-only branch.)
    let names: Vec<_> = fs::read_dir(&ro).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, [".plyfs.lock"], "nothing planted");
}

#[test]
fn nobody_cannot_go_below_trace_on_an_allow_other_mount_unless_the_owner_says_so() {
    for (fanin, nobody_may) in [(None, false), (Some("fanin=owner"), false), (Some("fanin=all"), true)] {
        let (dir, root, [lower, mnt]) = open_scratch(["lower", "mnt"]);
        fs::write(lower.join("f"), b"public").unwrap();
        fs::set_permissions(lower.join("f"), fs::Permissions::from_mode(0o644)).unwrap();
        let log = root.join("audit.jsonl");
        let mut opts = vec!["allow_other"];
        opts.extend(fanin);
        let m = Mount::start(dir, lower, mnt, &format!("trace:log={},null", log.display()), &opts);
        // The owner (root) may use the views.
        assert_eq!(fs::read(m.path(".plyfs/trace/f")).unwrap(), b"public");
        let top = sh_as_nobody(&format!("cat {}", quote(&m.path("f"))));
        assert!(top.0, "{fanin:?}: nobody reads through the top: {}", top.1);
        let below = sh_as_nobody(&format!("cat {}", quote(&m.path(".plyfs/trace/f"))));
        let listing = sh_as_nobody(&format!("ls {}", quote(&m.path(".plyfs"))));
        if nobody_may {
            assert!(below.0, "{fanin:?}: {}", below.1);
            assert!(listing.0, "{fanin:?}");
        } else {
            assert!(!below.0, "{fanin:?}: nobody read below trace");
            assert!(below.1.contains("Permission denied"), "{}", below.1);
            assert!(!listing.0, "{fanin:?}: nobody listed .plyfs");
        }
    }
}

#[test]
fn fanin_none_turns_the_views_off_and_the_mount_helper_passes_the_option() {
    let (dir, _, [lower, mnt]) = open_scratch(["lower", "mnt"]);
    fs::write(lower.join("f"), b"x").unwrap();
    let m = Mount::start(dir, lower.clone(), mnt.clone(), "trace,null", &["fanin=none"]);
    assert_eq!(fs::metadata(m.path(".plyfs")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
    assert_eq!(fs::read(m.path("f")).unwrap(), b"x");
    drop(m);
    let (_dir2, _, [lower, mnt]) = open_scratch(["lower", "mnt"]);
    let bad = run(plyfs().arg(&lower).arg(&mnt).arg("-o").arg("stack=null,fanin=everyone"));
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("fanin=everyone: expected owner, all or none"), "{}", String::from_utf8_lossy(&bad.stderr));
    assert!(mounted_fstype(&mnt).is_none());
    // As mount(8) calls it (`plyfs LOWER MNT -o OPTIONS`, from mount.fuse.plyfs).
    fs::write(lower.join("g"), b"y").unwrap();
    let ok = run(plyfs().arg(&lower).arg(&mnt).arg("-o").arg("stack=trace,null,fanin=none"));
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let hidden = fs::metadata(mnt.join(".plyfs")).map(drop).map_err(|e| e.raw_os_error());
    let seen = fs::read(mnt.join("g"));
    assert!(run(plyfs().arg("umount").arg(&mnt)).status.success());
    assert_eq!(hidden, Err(Some(libc::ENOENT)));
    assert_eq!(seen.unwrap(), b"y");
}

/// The control socket of `uid`'s mount at `mnt` (the daemon's naming: an FNV-1a hash of the
/// mount point).
fn control_socket(uid: u32, mnt: &Path) -> PathBuf {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in mnt.as_os_str().as_encoded_bytes() {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    assert_eq!(uid, 0, "tests mount as root");
    PathBuf::from(format!("/run/plyfs/{hash:016x}.sock"))
}

#[test]
fn the_control_socket_is_0600_and_nobody_is_turned_away() {
    let (dir, _, [lower, mnt]) = open_scratch(["lower", "mnt"]);
    let m = Mount::start(dir, lower, mnt, "trace,null", &["allow_other"]);
    let sock = control_socket(0, &m.mnt);
    let meta = fs::symlink_metadata(&sock).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600, "the control socket is {:o}", meta.mode() & 0o777);
    let out = sh_as_nobody(&format!("{} op {} --list", quote(Path::new(env!("CARGO_BIN_EXE_plyfs"))), quote(&m.mnt)));
    assert!(!out.0, "nobody ran an operation");
}

#[test]
fn a_runtime_directory_another_user_made_first_is_refused_never_followed() {
    use plyfs_fuse::control::choose_runtime_dir;
    let (_dir, root, [tmp, elsewhere]) = open_scratch(["tmp", "elsewhere"]);
    let chown = |p: &Path, uid: u32| std::os::unix::fs::lchown(p, Some(uid), Some(uid)).unwrap();
    let planted = tmp.join(format!("plyfs-{NOBODY}"));

    // Made first by another user (here root, for nobody's mounts): refused, by name.
    fs::create_dir(&planted).unwrap();
    fs::set_permissions(&planted, fs::Permissions::from_mode(0o700)).unwrap();
    for create in [false, true] {
        let e = choose_runtime_dir(NOBODY, None, &tmp, create).unwrap_err().to_string();
        assert!(e.contains(&planted.display().to_string()) && e.contains("owned by uid 0"), "{e}");
    }
    // The user's own, but open to others: refused.
    chown(&planted, NOBODY);
    fs::set_permissions(&planted, fs::Permissions::from_mode(0o777)).unwrap();
    let e = choose_runtime_dir(NOBODY, None, &tmp, true).unwrap_err().to_string();
    assert!(e.contains("mode 0777"), "{e}");
    // A symbolic link to a directory that passes every check: refused, never followed.
    fs::remove_dir(&planted).unwrap();
    chown(&elsewhere, NOBODY);
    fs::set_permissions(&elsewhere, fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &planted).unwrap();
    let e = choose_runtime_dir(NOBODY, None, &tmp, true).unwrap_err().to_string();
    assert!(e.contains(&planted.display().to_string()) && e.contains("symbolic link"), "{e}");
    assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 0);
    // The user's own, mode 0700: used.
    fs::remove_file(&planted).unwrap();
    fs::create_dir(&planted).unwrap();
    chown(&planted, NOBODY);
    fs::set_permissions(&planted, fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(choose_runtime_dir(NOBODY, None, &tmp, true).unwrap(), planted);

    // $XDG_RUNTIME_DIR, when it is the user's and private, comes first, and /tmp is not looked at.
    let xdg = root.join("xdg");
    fs::create_dir(&xdg).unwrap();
    fs::set_permissions(&xdg, fs::Permissions::from_mode(0o700)).unwrap();
    fs::create_dir(xdg.join("plyfs")).unwrap();
    fs::set_permissions(xdg.join("plyfs"), fs::Permissions::from_mode(0o700)).unwrap();
    chown(&xdg.join("plyfs"), NOBODY);
    // Not the user's: ignored.
    assert_eq!(choose_runtime_dir(NOBODY, Some(&xdg), &tmp, false).unwrap(), planted);
    chown(&xdg, NOBODY);
    assert_eq!(choose_runtime_dir(NOBODY, Some(&xdg), &tmp, false).unwrap(), xdg.join("plyfs"));
    fs::remove_dir(&planted).unwrap();
    fs::create_dir(&planted).unwrap();
    assert_eq!(choose_runtime_dir(NOBODY, Some(&xdg), &tmp, false).unwrap(), xdg.join("plyfs"));
    // Open to others: ignored, and the planted /tmp directory is refused.
    fs::set_permissions(&xdg, fs::Permissions::from_mode(0o755)).unwrap();
    assert!(choose_runtime_dir(NOBODY, Some(&xdg), &tmp, false).is_err());
}

#[test]
fn a_key_file_others_may_read_is_refused_by_name_with_chmod_600() {
    let (_dir, root, [mnt]) = open_scratch(["mnt"]);
    let key = root.join("psk");
    fs::write(&key, [7u8; 32]).unwrap();
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    for mode in [0o644, 0o640, 0o604, 0o660] {
        fs::set_permissions(&key, fs::Permissions::from_mode(mode)).unwrap();
        let out = run(plyfs().arg("mount").arg(&addr).arg(&mnt).arg("--psk").arg(&key));
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&key.display().to_string()) && err.contains("chmod 600"), "{mode:o}: {err}");
        // (A server that took the key would serve until killed.)
        let serve = run(std::process::Command::new("timeout")
            .arg("10")
            .arg(env!("CARGO_BIN_EXE_plyfs"))
            .arg("serve")
            .arg(&mnt)
            .arg("--listen")
            .arg(&addr)
            .arg("--psk")
            .arg(&key));
        assert!(!serve.status.success());
        assert!(String::from_utf8_lossy(&serve.stderr).contains("chmod 600"), "{}", String::from_utf8_lossy(&serve.stderr));
    }
    // 0600: the key is taken (and the mount fails only because no server listens).
    fs::set_permissions(&key, fs::Permissions::from_mode(0o600)).unwrap();
    let out = run(plyfs().arg("mount").arg(&addr).arg(&mnt).arg("--psk").arg(&key));
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("chmod 600"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(mounted_fstype(&mnt).is_none());
}
