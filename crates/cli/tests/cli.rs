//! The `plyfs` command: mount life cycle, bad input, extended operations, the trace layer and
//! the fan-in view, each through a real mount.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{is_root, mounted_fstype, op_json, plyfs, run, scratch_dirs, Mount};

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn op(path: &Path, args: &[&str]) -> std::process::Output {
    run(plyfs().arg("op").arg(path).args(args))
}

/// Exit statuses (`man plyfs`, EXIT STATUS).
const OTHER: i32 = 1;
const USAGE: i32 = 2;
const LOWER: i32 = 6;
const MOUNT_POINT: i32 = 10;

/// A failed command: exit status `status`, one line on stderr containing `expect`, nothing
/// mounted.
fn assert_refused(out: &std::process::Output, status: i32, expect: &str) {
    let err = stderr_of(out);
    assert_eq!(out.status.code(), Some(status), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(err.starts_with("plyfs: ") && err.contains(expect), "{err:?} should contain {expect:?}");
}

fn scratch() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (lower, mnt) = (root.join("lower"), root.join("mnt"));
    fs::create_dir(&lower).unwrap();
    fs::create_dir(&mnt).unwrap();
    fs::write(lower.join("keep.txt"), b"precious").unwrap();
    (dir, lower, mnt)
}

#[test]
fn bad_input_gets_one_clear_line_and_mounts_nothing() {
    let (dir, lower, mnt) = scratch();
    let mount = |args: &[&str]| run(plyfs().arg("mount").args(args));
    let (l, m) = (lower.to_str().unwrap(), mnt.to_str().unwrap());

    assert_refused(&mount(&["/nonexistent/lower", m]), LOWER, "lower directory /nonexistent/lower: No such file or directory");
    assert_refused(&mount(&[l, "/nonexistent/mnt"]), MOUNT_POINT, "mount point /nonexistent/mnt: No such file or directory");
    assert_refused(&mount(&[l, m, "--stack", "null,gzipp"]), USAGE, "unknown layer 'gzipp' (available: null, trace, copy, uuencode, gzip, zstd, lz4, crypt, union, mirror, cache, version, fault, lazy, ext, py)");
    assert_refused(&mount(&[l, m, "--stack", "zstd:level=99"]), USAGE, "layer 'zstd': bad value '99' for 'level': expected 1 to 19");
    assert_refused(&mount(&[l, m, "--stack", "gzip:chunk=3k"]), USAGE, "bad value '3k' for 'chunk': expected a power of two from 4k to 1m");
    assert_refused(&mount(&[l, m, "--stack", "lz4:fast_tails=maybe"]), USAGE, "bad value 'maybe' for 'fast_tails'");
    assert_refused(&mount(&[l, m, "--stack", "trace:colour=red"]), USAGE, "layer 'trace': unknown parameter 'colour'");
    assert_refused(&mount(&[l, m, "--stack", "trace:io=maybe"]), USAGE, "bad value 'maybe' for 'io'");
    assert_refused(&mount(&[l, m, "--stack", "trace:log=/nonexistent/dir/t.jsonl"]), USAGE, "cannot open log /nonexistent/dir/t.jsonl");
    assert_refused(&mount(&[l, m, "-o", "turbo"]), USAGE, "unknown mount option 'turbo'");
    let config = dir.path().join("bad.toml");
    fs::write(&config, "[[layer]]\ntype = \"null\"\n[[layer\n").unwrap();
    assert_refused(&mount(&[l, m, "--config", config.to_str().unwrap()]), USAGE, "bad.toml:3: ");
    assert_refused(&mount(&[l, m, "--config", "/nonexistent.toml"]), USAGE, "/nonexistent.toml: No such file or directory");

    let file_mnt = dir.path().join("file");
    fs::write(&file_mnt, b"").unwrap();
    assert_refused(&mount(&[l, file_mnt.to_str().unwrap()]), MOUNT_POINT, "not a directory");
    fs::write(mnt.join("x"), b"").unwrap();
    assert_refused(&mount(&[l, m]), MOUNT_POINT, "is not empty");
    fs::remove_file(mnt.join("x")).unwrap();

    assert!(mounted_fstype(&mnt).is_none());
    assert_eq!(fs::read(lower.join("keep.txt")).unwrap(), b"precious");
    assert_eq!(fs::read_dir(&lower).unwrap().count(), 1);
}

/// A mistake in a `--config` or `--rules` file is one line, `FILE:LINE: cause`, as a compiler
/// says it, and nothing is mounted (#32).
#[test]
fn a_mistake_in_a_config_or_rules_file_names_the_file_and_its_line() {
    let (dir, lower, mnt) = scratch();
    let (l, m) = (lower.to_str().unwrap(), mnt.to_str().unwrap());
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let mount = |args: &[&str]| run(plyfs().arg("mount").arg(l).arg(m).args(args));
    let config = file("unknown-key.toml", "[[layer]]\ntype = \"trace\"\nio = true\ncolour = \"red\"\n\n[[layer]]\ntype = \"null\"\n");
    assert_refused(&mount(&["--config", &config]), USAGE, &format!("{config}:4: layer 'trace': unknown parameter 'colour'"));
    let config = file(
        "branch.toml",
        "[[layer]]\ntype = \"union\"\n[[layer.branch]]\ndir = \"/tmp\"\n[[layer.branch.layer]]\ntype = \"zstd\"\nlevle = 3\n",
    );
    assert_refused(&mount(&["--config", &config]), USAGE, &format!("{config}:7: layer 'zstd': unknown parameter 'levle'"));
    // An unknown kind, in a branch too, names its `type` line.
    let config = file("unknown-type.toml", "[[layer]]\ntype = \"null\"\n\n[[layer]]\ntype = \"gzipp\"\n");
    assert_refused(&mount(&["--config", &config]), USAGE, &format!("{config}:5: unknown layer 'gzipp' (available: "));
    let config = file(
        "unknown-branch-type.toml",
        "[[layer]]\ntype = \"union\"\n[[layer.branch]]\ndir = \"/tmp\"\n[[layer.branch.layer]]\ntype = \"zstdd\"\n",
    );
    assert_refused(&mount(&["--config", &config]), USAGE, &format!("{config}:6: unknown layer 'zstdd'"));
    // `remote` is made by the assembly, not the registry: a file may name it, and its own
    // parameters are checked where it is made.
    let config = file("remote.toml", "[[layer]]\ntype = \"null\"\n[[layer]]\ntype = \"remote\"\nadress = \"x\"\n");
    assert_refused(&mount(&["--config", &config]), USAGE, "layer 'remote': unknown parameter 'adress'");
    let config = file("top-level.toml", "colour = 1\n[[layer]]\ntype = \"null\"\n");
    assert_refused(&mount(&["--config", &config]), USAGE, &format!("{config}:1: unknown field `colour`"));

    let rules = "[[rule]]\nglob = \"*.log\"\nlayers = \"zstd\"\n\n[[rule]]\n";
    let syntax = file("syntax.toml", &format!("{rules}glob = \"*.txt\nlayers = \"gzip\"\n"));
    assert_refused(&mount(&["--stack", "zstd", "--rules", &syntax]), USAGE, &format!("{syntax}:6: "));
    let glob = file("glob.toml", &format!("{rules}glob = \"[x\"\nlayers = \"gzip\"\n"));
    assert_refused(&mount(&["--stack", "zstd", "--rules", &glob]), USAGE, &format!("{glob}:5: rule 2: glob \"[x\": '[' without ']'"));
    let layer = file("layer.toml", &format!("{rules}glob = \"*.txt\"\nlayers = \"gzipp\"\n"));
    assert_refused(&mount(&["--stack", "zstd", "--rules", &layer]), USAGE, &format!("{layer}:5: rule 2: unknown layer 'gzipp'"));

    assert!(mounted_fstype(&mnt).is_none());
    assert_eq!(fs::read_dir(&lower).unwrap().count(), 1);
    assert_eq!(fs::read(lower.join("keep.txt")).unwrap(), b"precious");
}

/// A reader that goes away (`plyfs layers | head -1`) ends a reporting command as it ends `ls`:
/// by SIGPIPE, without a panic on standard error.
#[test]
fn a_closed_output_pipe_ends_a_report_quietly() {
    use std::os::fd::FromRawFd;
    use std::os::unix::process::ExitStatusExt;
    for args in [&["layers"][..], &["completions", "bash"]] {
        let mut fds = [0; 2];
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        unsafe { libc::close(fds[0]) };
        let out = plyfs().args(args).stdout(unsafe { std::process::Stdio::from_raw_fd(fds[1]) }).output().unwrap();
        assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{args:?}: {}", stderr_of(&out));
        assert!(out.stderr.is_empty(), "{args:?}: {}", stderr_of(&out));
    }
}

#[test]
fn a_busy_mount_point_is_refused() {
    let m = Mount::new("null");
    let out = run(plyfs().arg("mount").arg(&m.lower).arg(&m.mnt));
    assert_refused(&out, MOUNT_POINT, "is busy: fuse.plyfs is already mounted there");
}

#[test]
fn background_mount_reports_ready_and_umount_waits_for_the_daemon() {
    let (dir, lower, mnt) = scratch();
    let log = dir.path().join("daemon.log");
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).arg("--stack").arg("trace,null").arg("--log").arg(&log));
    assert!(out.status.success(), "{}", stderr_of(&out));
    let said = stderr_of(&out);
    assert!(said.contains("mounted ") && said.contains("file I/O: "), "{said}");
    assert_eq!(mounted_fstype(&mnt).as_deref(), Some("fuse.plyfs"));
    assert_eq!(fs::read(mnt.join("keep.txt")).unwrap(), b"precious");

    let out = run(plyfs().arg("umount").arg(&mnt));
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(mounted_fstype(&mnt).is_none());
    let log = fs::read_to_string(&log).unwrap();
    assert!(log.contains("unmounted"), "the daemon finished before umount returned: {log}");
    assert_refused(&run(plyfs().arg("umount").arg(&mnt)), OTHER, "not mounted");
}

/// `plyfs umount` while another process statfs's the mount over and over (as `df` does every
/// mount): each statfs holds the mount for a moment, and the unmount waits that out rather than
/// answering EBUSY (before, about one unmount in five failed so with `df` in a loop).
#[test]
fn umount_waits_out_a_statfs_in_progress() {
    let (_dir, lower, mnt) = scratch();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let c = common::cpath(&mnt);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut st: libc::statfs = unsafe { std::mem::zeroed() };
                unsafe { libc::statfs(c.as_ptr(), &mut st) };
                // A few thousand a second: busy often, never for long.
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        let result = std::panic::catch_unwind(|| {
            for round in 0..20 {
                let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).arg("--quiet"));
                assert!(out.status.success(), "mount {round}: {}", stderr_of(&out));
                let out = run(plyfs().arg("umount").arg(&mnt));
                if !out.status.success() {
                    let _ = run(plyfs().arg("umount").arg("--lazy").arg(&mnt));
                }
                assert!(out.status.success(), "umount {round}: {}", stderr_of(&out));
            }
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) = result {
            std::panic::resume_unwind(e);
        }
    });
}

#[test]
fn sigterm_and_sigint_unmount_cleanly() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut m = Mount::new("trace,null");
        fs::write(m.path("f"), b"data").unwrap();
        unsafe { libc::kill(m.pid(), sig) };
        let status = m.wait_exit(Duration::from_secs(20)).expect("daemon exits on signal");
        assert!(status.success(), "exit status {status}: {}", m.daemon_log());
        assert!(mounted_fstype(&m.mnt).is_none(), "unmounted");
        assert_eq!(fs::read(m.lower_path("f")).unwrap(), b"data");
    }
}

#[test]
fn a_killed_daemon_leaves_a_stale_mount_that_umount_cleans_up() {
    let mut m = Mount::new("null");
    common::kill_daemon_and_clean_up(&mut m);
    // And it can be mounted again at once.
    let again = Mount::start(tempfile::tempdir().unwrap(), m.lower.clone(), m.mnt.clone(), "null", &[]);
    assert_eq!(fs::read(again.path("f")).unwrap(), b"synced");
}

#[test]
fn a_busy_mount_is_not_unmounted_unless_lazily() {
    let mut m = Mount::new("null");
    fs::write(m.path("open"), b"in use").unwrap();
    let mut f = fs::File::open(m.path("open")).unwrap();
    assert_refused(&run(plyfs().arg("umount").arg(&m.mnt)), OTHER, "busy");
    assert_eq!(mounted_fstype(&m.mnt).as_deref(), Some("fuse.plyfs"));
    let out = run(plyfs().arg("umount").arg("--lazy").arg(&m.mnt));
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(mounted_fstype(&m.mnt).is_none());
    // The open file is still served until it is closed; then the daemon exits.
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "in use");
    drop(f);
    let status = m.wait_exit(Duration::from_secs(20)).expect("daemon exits after the last close");
    assert!(status.success(), "the daemon exited with {status}: {:?}", m.daemon_log());
}

#[test]
fn trace_logs_every_operation_and_keeps_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("trace.jsonl");
    let mut m = Mount::with(&format!("trace:log={}:io=on,null", log.display()), &[]);
    fs::write(m.path("f"), b"hello").unwrap();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"hello");
    assert!(fs::metadata(m.path("missing")).is_err());

    let stats = op_json(&m.path("f"), &["stats"]);
    assert_eq!(stats["layer"], "trace");
    assert!(stats["ops"]["write"]["count"].as_u64().unwrap() >= 1, "{stats}");
    assert!(stats["ops"]["read"]["count"].as_u64().unwrap() >= 1, "{stats}");
    assert!(stats["ops"]["lookup"]["errors"].as_u64().unwrap() >= 1, "the failed lookup is counted: {stats}");
    for key in ["mean_us", "p50_us", "p99_us", "max_us"] {
        assert!(stats["ops"]["lookup"][key].is_number(), "{key} in {stats}");
    }
    // The histogram: [below µs, count] pairs adding up to the count; drawn as bars on request
    // (and on a terminal).
    let hist = stats["ops"]["lookup"]["histogram_us"].as_array().unwrap();
    let total: u64 = hist.iter().map(|p| p[1].as_u64().unwrap()).sum();
    assert_eq!(total, stats["ops"]["lookup"]["count"].as_u64().unwrap(), "{stats}");
    let drawn = run(plyfs().args(["op"]).arg(m.path("")).args(["stats", "--histogram"]));
    let drawn = String::from_utf8_lossy(&drawn.stdout);
    assert!(drawn.contains("lookup: ") && drawn.contains("█") && drawn.contains("µs"), "{drawn}");
    assert_eq!(op_json(&m.path(""), &["stats@trace"])["layer"], "trace");
    op_json(&m.path(""), &["stats-reset"]);
    assert!(op_json(&m.path(""), &["stats"])["ops"].get("write").is_none());

    m.unmount();
    let lines: Vec<serde_json::Value> =
        fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect();
    let create = lines.iter().find(|l| l["op"] == "create").expect("create logged");
    assert_eq!(create["args"]["name"], "f");
    assert_eq!(create["result"], "ok");
    assert!(create["us"].as_f64().unwrap() > 0.0);
    let write = lines.iter().find(|l| l["op"] == "write").expect("write logged");
    assert_eq!(write["args"]["data"]["bytes"], 5);
    let miss = lines.iter().find(|l| l["op"] == "lookup" && l["args"]["name"] == "missing").expect("lookup logged");
    assert_eq!(miss["result"], "ENOENT");
}

#[test]
fn passthrough_keeps_reads_and_writes_out_of_the_daemon() {
    let read_count = |m: &Mount| {
        fs::write(m.path("big"), vec![7u8; 1 << 20]).unwrap();
        let mut data = Vec::new();
        fs::File::open(m.path("big")).unwrap().read_to_end(&mut data).unwrap();
        assert_eq!(data.len(), 1 << 20);
        let stats = op_json(&m.path(""), &["stats"]);
        (stats["ops"]["read"]["count"].as_u64().unwrap_or(0), stats["ops"]["write"]["count"].as_u64().unwrap_or(0))
    };
    if is_root() {
        let fast = Mount::new("trace,null");
        assert!(fast.daemon_log().contains("file I/O: passthrough"), "{}", fast.daemon_log());
        assert_eq!(read_count(&fast), (0, 0), "with passthrough no read or write reaches the stack");
    }
    let cached = Mount::with("trace,null", &["passthrough=off"]);
    assert!(cached.daemon_log().contains("turned off with -o passthrough=off"), "{}", cached.daemon_log());
    let (reads, writes) = read_count(&cached);
    assert!(reads > 0 && writes > 0);
    let observing = Mount::new("trace:io=on,null");
    assert!(observing.daemon_log().contains("layer 'trace' observes file data"), "{}", observing.daemon_log());
}

#[test]
fn extended_operations_from_the_command_line() {
    let m = Mount::new("trace,null:name=inner");
    fs::write(m.path("f"), b"x").unwrap();
    let info = op_json(&m.path("f"), &["lower-info"]);
    assert_eq!(info["lower_path"], m.lower_path("f").to_str().unwrap());
    let list = op_json(&m.path(""), &["--list"]);
    let names: Vec<&str> = list.as_array().unwrap().iter().map(|o| o["op"].as_str().unwrap()).collect();
    // The policy layer (per-file chains) sits between the mount-wide layers and the bottom.
    assert_eq!(names, ["stats", "stats-reset", "describe", "policy-explain", "policy-apply", "policy-plain", "lower-info", "lower-lock", "lower-sync"]);
    // `describe` is answered by the null layer, below a trace layer that does not know it.
    let chain = op_json(&m.path(""), &["describe"]);
    let described: Vec<(&str, &str, &str)> = chain
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["name"].as_str().unwrap(), l["kind"].as_str().unwrap(), l["data"].as_str().unwrap()))
        .collect();
    assert_eq!(described, [("inner", "null", "transparent"), ("policy", "policy", "transparent"), ("lower", "lower", "transparent")]);

    assert_refused(
        &op(&m.path("f"), &["frobnicate"]),
        OTHER,
        "unsupported operation 'frobnicate': no layer of the stack (trace, inner, policy, lower) handles it",
    );
    assert_refused(&op(&m.path("f"), &["stats@inner"]), OTHER, "unsupported operation 'stats'");
    assert_eq!(op_json(&m.path("f"), &["describe@inner"])[0]["name"], "inner");
    assert_refused(&op(&m.path("f"), &["stats@nope"]), OTHER, "no layer named 'nope' in this stack (trace, inner, policy, lower)");
    assert_refused(&op(&m.path("nothing"), &["stats"]), OTHER, "No such file or directory");
    assert_refused(&op(Path::new("/etc"), &["stats"]), OTHER, "/etc is not inside a plyfs mount");
}

#[test]
fn every_level_is_reachable_under_dot_plyfs() {
    let m = Mount::new("trace:name=outer,null");
    fs::write(m.path("f"), b"same bytes").unwrap();
    let mut levels: Vec<_> = fs::read_dir(m.path(".plyfs")).unwrap().map(|e| e.unwrap().file_name()).collect();
    levels.sort();
    assert_eq!(levels, ["null", "outer", "policy"]);
    assert_eq!(fs::read(m.path(".plyfs/outer/f")).unwrap(), b"same bytes");
    assert_eq!(fs::read(m.path(".plyfs/policy/f")).unwrap(), b"same bytes", "below the policy layer: the lower files");
    assert_eq!(fs::read(m.path(".plyfs/null/f")).unwrap(), b"same bytes");
    // Writing through a lower level reaches the same file.
    fs::write(m.path(".plyfs/null/g"), b"from below").unwrap();
    assert_eq!(fs::read(m.path("g")).unwrap(), b"from below");
    // The reserved name cannot be removed, replaced or renamed.
    assert_eq!(fs::remove_dir(m.path(".plyfs")).unwrap_err().raw_os_error(), Some(libc::EBUSY));
    assert_eq!(fs::create_dir(m.path(".plyfs")).unwrap_err().raw_os_error(), Some(libc::EEXIST));
    assert_eq!(fs::rename(m.path(".plyfs"), m.path("elsewhere")).unwrap_err().raw_os_error(), Some(libc::EBUSY));
    fs::create_dir(m.path("d")).unwrap();
    assert_eq!(fs::rename(m.path("d"), m.path(".plyfs")).unwrap_err().raw_os_error(), Some(libc::EBUSY));
    assert_eq!(fs::rename(m.path(".plyfs/null/f"), m.path("h")).unwrap_err().raw_os_error(), Some(libc::EXDEV));
    // Extended operations can address a level by path.
    assert_eq!(op_json(&m.path(".plyfs/outer/f"), &["lower-info"])["lower_path"], m.lower_path("f").to_str().unwrap());
}

#[test]
fn a_toml_config_gives_the_same_stack() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("stack.toml");
    fs::write(&config, "[[layer]]\ntype = \"trace\"\nname = \"watch\"\n\n[[layer]]\ntype = \"null\"\n").unwrap();
    let (_d, lower, mnt) = scratch();
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).arg("--config").arg(&config));
    assert!(out.status.success(), "{}", stderr_of(&out));
    let stats = op(&mnt, &["stats@watch"]);
    let _ = run(plyfs().arg("umount").arg(&mnt));
    assert!(stats.status.success(), "{}", stderr_of(&stats));
}

#[test]
fn layers_lists_every_layer_with_parameters() {
    let out = run(plyfs().arg("layers"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for needle in ["null ", "trace ", "log=", "io=", "name=", "op stats", "lower-info"] {
        assert!(text.contains(needle), "{needle} in {text}");
    }
}

/// Without root: the mount goes through fusermount3, as on a normal Linux desktop.
#[test]
fn an_unprivileged_user_mounts_through_fusermount3() {
    if !is_root() || std::process::Command::new("setpriv").arg("--help").stdout(Stdio::null()).status().is_err() {
        eprintln!("skipped: needs root (to become another user) and setpriv");
        return;
    }
    // fusermount3 opens /dev/fuse as the user. A normal system makes it 0666; where it is
    // private to root (as on some build machines), grant this user access for the test.
    let _access = match DevFuseAccess::grant(65534) {
        Ok(a) => a,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let (dir, lower, mnt) = scratch();
    for p in [dir.path(), &lower, &mnt] {
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
    }
    std::os::unix::fs::chown(lower.join("keep.txt"), Some(65534), Some(65534)).unwrap();
    let as_nobody = |args: &[&std::ffi::OsStr]| {
        let mut cmd = std::process::Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--reset-env", "--"]).arg(env!("CARGO_BIN_EXE_plyfs")).args(args);
        run(&mut cmd)
    };
    let out = as_nobody(&["mount".as_ref(), lower.as_os_str(), mnt.as_os_str(), "--stack".as_ref(), "trace,null".as_ref()]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let guard = scopeguard(&mnt);
    assert!(stderr_of(&out).contains("FUSE I/O with the page cache kept (passthrough needs CAP_SYS_ADMIN)"), "{}", stderr_of(&out));
    // The mount belongs to nobody: check its contents as nobody.
    let mut cat = std::process::Command::new("setpriv");
    cat.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--", "cat"]).arg(mnt.join("keep.txt"));
    assert_eq!(run(&mut cat).stdout, b"precious");
    let stats = as_nobody(&["op".as_ref(), mnt.as_os_str(), "stats".as_ref()]);
    assert!(stats.status.success(), "{}", stderr_of(&stats));
    let out = as_nobody(&["umount".as_ref(), mnt.as_os_str()]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(mounted_fstype(&mnt).is_none());
    drop(guard);
}

/// Gives one user read-write access to /dev/fuse with an ACL, removed when dropped (the whole
/// ACL if /dev/fuse had none before).
struct DevFuseAccess(Option<(u32, bool)>);

impl DevFuseAccess {
    fn grant(uid: u32) -> Result<DevFuseAccess, String> {
        let usable = std::process::Command::new("setpriv")
            .args([format!("--reuid={uid}"), "--regid=65534".into(), "--clear-groups".into()])
            .args(["test", "-r", "/dev/fuse", "-a", "-w", "/dev/fuse"])
            .status()
            .is_ok_and(|s| s.success());
        if usable {
            return Ok(DevFuseAccess(None));
        }
        let had_acl = std::process::Command::new("getfacl")
            .args(["--skip-base", "/dev/fuse"])
            .output()
            .is_ok_and(|o| !o.stdout.is_empty());
        let ok = std::process::Command::new("setfacl")
            .args(["-m", &format!("u:{uid}:rw"), "/dev/fuse"])
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            Ok(DevFuseAccess(Some((uid, had_acl))))
        } else {
            Err("/dev/fuse is not usable by unprivileged users here and setfacl (package acl) cannot grant it".into())
        }
    }
}

impl Drop for DevFuseAccess {
    fn drop(&mut self) {
        match self.0 {
            Some((uid, true)) => {
                let _ = std::process::Command::new("setfacl").args(["-x", &format!("u:{uid}"), "/dev/fuse"]).status();
            }
            Some((_, false)) => {
                let _ = std::process::Command::new("setfacl").args(["-b", "/dev/fuse"]).status();
            }
            None => {}
        }
    }
}

/// Unmounts `path` when dropped, whatever happened.
struct Unmounter(std::path::PathBuf);

fn scopeguard(path: &Path) -> Unmounter {
    Unmounter(path.to_owned())
}

impl Drop for Unmounter {
    fn drop(&mut self) {
        if mounted_fstype(&self.0).is_some() {
            let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// A Python layer whose interpreter lacks the plyfs package says so on standard error, in one
/// line, with the script's own last words; the interpreter of an active virtual environment is
/// found without being named, and `python=` names one (#32).
#[test]
fn a_python_layer_that_cannot_start_says_why_and_a_virtual_environment_is_found() {
    let (dir, lower, mnt) = scratch();
    let rot13 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/python/rot13.py").canonicalize().unwrap();
    let mount = |stack: &str, env: &[(&str, &std::ffi::OsStr)]| {
        let mut cmd = plyfs();
        cmd.arg("mount").arg(&lower).arg(&mnt).args(["--stack", stack]).env_remove("PLYFS_PYTHON").env_remove("VIRTUAL_ENV");
        for (k, v) in env {
            cmd.env(k, v);
        }
        run(&mut cmd)
    };
    // An interpreter without site-packages: no plyfs package there.
    let bare = dir.path().join("bare-python");
    fs::write(&bare, "#!/bin/sh\nexec python3 -S \"$@\"\n").unwrap();
    fs::set_permissions(&bare, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let stack = format!("py:script={}:python={}", rot13.display(), bare.display());
    assert_refused(&mount(&stack, &[]), USAGE, &format!("layer 'py' ({}): {} ended at start: exit status: 1: ", rot13.display(), bare.display()));
    let err = stderr_of(&mount(&stack, &[]));
    assert!(err.contains("ModuleNotFoundError: No module named 'plyfs' (install the plyfs package"), "{err}");
    // A script that fails its own way: its last line is the cause.
    let broken = dir.path().join("broken.py");
    fs::write(&broken, "import sys\nprint('some noise', file=sys.stderr)\nraise SystemExit('broken.py: no layer today')\n").unwrap();
    let stack = format!("py:script={}:python={}", broken.display(), bare.display());
    assert_refused(&mount(&stack, &[]), USAGE, "ended at start: exit status: 1: broken.py: no layer today");
    assert!(mounted_fstype(&mnt).is_none());
    assert_eq!(fs::read_dir(&lower).unwrap().count(), 1);

    // The interpreter with the package, as the test suite is given it (scripts/test.sh).
    let Some(python) = std::env::var_os("PLYFS_PYTHON") else {
        eprintln!("skipped the rest: PLYFS_PYTHON names no interpreter with the plyfs package");
        return;
    };
    let venv = Path::new(&python).parent().and_then(Path::parent).unwrap().to_owned();
    assert!(venv.join("pyvenv.cfg").is_file(), "PLYFS_PYTHON={python:?} is not in a virtual environment");
    let by_venv = format!("py:script={}", rot13.display());
    let by_param = format!("py:script={}:python={}", rot13.display(), python.to_string_lossy());
    for (stack, env) in [(&by_venv, vec![("VIRTUAL_ENV", venv.as_os_str())]), (&by_param, vec![])] {
        let out = mount(stack, &env);
        let _unmount = scopeguard(&mnt);
        assert!(out.status.success(), "{stack}: {}", stderr_of(&out));
        fs::write(mnt.join("note"), "Hello").unwrap();
        assert_eq!(fs::read_to_string(mnt.join("note")).unwrap(), "Hello");
        assert!(run(plyfs().arg("umount").arg(&mnt)).status.success());
        assert!(!fs::read(lower.join("note")).unwrap().windows(5).any(|w| w == b"Hello"), "rot13 rotated it");
        fs::remove_file(lower.join("note")).unwrap();
    }
}

/// An unprivileged write or truncate clears set-user-ID, and set-group-ID where the kernel
/// would, through passthrough and the cached path alike (the daemon does it for the kernel,
/// which hands the duty over with FUSE_HANDLE_KILLPRIV_V2). Native ext4 is the reference.
#[test]
fn unprivileged_writes_and_truncates_clear_set_id_bits_like_a_kernel_fs() {
    if !is_root() {
        eprintln!("skipped: needs root to act as another user");
        return;
    }
    let as_nobody = |script: &str| {
        let status = std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", script])
            .status()
            .unwrap();
        assert!(status.success(), "{script}");
    };
    use std::os::unix::fs::PermissionsExt;
    let mode_after = |dir: &Path, name: &str, mode: u32, group: u32, action: &str| {
        let f = dir.join(name);
        fs::write(&f, b"x").unwrap();
        std::os::unix::fs::chown(&f, None, Some(group)).unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(mode)).unwrap();
        let p = f.display();
        as_nobody(&match action {
            "write" => format!("echo more >> {p}"),
            _ => format!("truncate -s 1 {p}"),
        });
        fs::metadata(&f).unwrap().permissions().mode() & 0o7777
    };
    let native = tempfile::tempdir_in("/tmp").unwrap();
    fs::set_permissions(native.path(), fs::Permissions::from_mode(0o777)).unwrap();
    for opts in [&["allow_other"][..], &["allow_other", "passthrough=off"][..]] {
        let m = Mount::with("null", opts);
        fs::set_permissions(&m.mnt, fs::Permissions::from_mode(0o777)).unwrap();
        for mode in [0o4777, 0o6777, 0o2777, 0o2767, 0o0777] {
            for group in [0, 65534] {
                for action in ["write", "truncate"] {
                    let name = format!("f{mode:o}-{group}-{action}");
                    let want = mode_after(native.path(), &name, mode, group, action);
                    let got = mode_after(&m.mnt, &name, mode, group, action);
                    assert_eq!(got, want, "{opts:?}: {action} on mode {mode:o} group {group} as nobody");
                }
            }
        }
        // A privileged writer keeps the bits, as on a kernel file system.
        fs::write(m.path("root"), b"").unwrap();
        fs::set_permissions(m.path("root"), fs::Permissions::from_mode(0o4755)).unwrap();
        fs::OpenOptions::new().append(true).open(m.path("root")).unwrap().write_all(b"root writes").unwrap();
        assert_eq!(fs::metadata(m.path("root")).unwrap().permissions().mode() & 0o7777, 0o4755);
    }
}

/// The bottom layer needs a descriptor per file the kernel knows. The daemon raises its soft
/// open-files limit (commonly 1024) to the hard limit; as root it keeps file handles and only a
/// bounded set of descriptors, so it serves more files than its limit; and when descriptors do
/// run out (open files need real ones) it says so once, clearly, and keeps serving.
#[test]
fn the_daemon_outgrows_its_open_files_limit_and_reports_running_out() {
    let mount_with_limits = |soft: u32, hard: u32| {
        let (dir, lower, mnt) = scratch();
        let log = dir.path().join("daemon.log");
        let script = format!(
            "ulimit -Sn {soft} && ulimit -Hn {hard} && exec {} mount {} {} --log {}",
            env!("CARGO_BIN_EXE_plyfs"),
            lower.display(),
            mnt.display(),
            log.display()
        );
        let out = run(std::process::Command::new("sh").args(["-c", &script]));
        assert!(out.status.success(), "{}", stderr_of(&out));
        (dir, mnt, log)
    };
    let hard = {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        lim.rlim_max.min(65536) as u32
    };
    if hard < 4096 {
        eprintln!("skipped: the hard open-files limit ({hard}) is too low to test above 1024");
        return;
    }
    // A soft limit of 1024 does not limit the daemon.
    let (_dir, mnt, _log) = mount_with_limits(1024, hard);
    let guard = scopeguard(&mnt);
    for i in 0..2000 {
        fs::write(mnt.join(format!("f{i}")), b"x").unwrap_or_else(|e| panic!("file {i}: {e}"));
    }
    assert_eq!(fs::read_dir(&mnt).unwrap().count(), 2001, "2000 files and keep.txt");
    drop(guard);

    // Under a hard limit of 256: as root, 600 files are served all the same (handles, and a
    // bounded cache of descriptors) ...
    let (_dir, mnt, log) = mount_with_limits(256, 256);
    let guard = scopeguard(&mnt);
    if is_root() {
        for i in 0..600 {
            fs::write(mnt.join(format!("f{i}")), format!("{i}")).unwrap_or_else(|e| panic!("file {i}: {e}"));
        }
        for i in 0..600 {
            assert_eq!(fs::read_to_string(mnt.join(format!("f{i}"))).unwrap(), format!("{i}"));
        }
    }
    // Names replaced the way tar extracts symlinks over placeholders (write a file, later unlink
    // it and put a symlink there), after the placeholders' descriptors were closed: the lower
    // file system must not hand a new object the inode number of one the kernel still knows.
    if is_root() {
        // 100, not more: symlinks keep their descriptors, and the limit here is 256.
        for i in 0..100 {
            fs::write(mnt.join(format!("p{i}")), b"placeholder").unwrap();
        }
        // Enough other files to close the placeholders' descriptors (second chance: twice over).
        for round in 0..2 {
            for i in 0..600 {
                fs::metadata(mnt.join(format!("f{i}"))).unwrap_or_else(|e| panic!("round {round} f{i}: {e}"));
            }
        }
        for i in 0..100 {
            let p = mnt.join(format!("p{i}"));
            fs::remove_file(&p).unwrap();
            std::os::unix::fs::symlink(format!("f{i}"), &p).unwrap();
            std::os::unix::fs::lchown(&p, Some(0), Some(0)).unwrap_or_else(|e| panic!("lchown p{i}: {e}"));
            assert_eq!(fs::read_to_string(&p).unwrap(), format!("{i}"), "p{i} follows its link");
        }
    }
    // ... but 300 files held open at once need 300 descriptors: the opens beyond the limit fail
    // with EMFILE, the log says why, once, and the daemon lives on.
    let mut held = Vec::new();
    let mut failures = 0;
    for i in 0..300 {
        match fs::OpenOptions::new().create(true).truncate(false).write(true).open(mnt.join(format!("open{i}"))) {
            Ok(f) => held.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "open {i}: {e}");
                failures += 1;
            }
        }
    }
    assert!(failures > 0, "256 descriptors cannot hold 300 open files");
    drop(held);
    let text = fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches("out of file descriptors").count(), 1, "{text}");
    assert!(fs::metadata(mnt.join("open0")).is_ok(), "the daemon still serves");
    // Closed, the files no longer pin the mount; but a process that another test thread is
    // starting holds copies of this process's descriptors until it execs, so a busy mount is
    // retried for a moment.
    let mut out = run(plyfs().arg("umount").arg(&mnt));
    for _ in 0..20 {
        if out.status.success() || !stderr_of(&out).contains("busy") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        out = run(plyfs().arg("umount").arg(&mnt));
    }
    assert!(out.status.success(), "{}", stderr_of(&out));
    drop(guard);
}

/// `plyfs --version` names the commit it was built from.
#[test]
fn the_version_names_the_commit() {
    let out = run(plyfs().arg("--version"));
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(shown.starts_with(&format!("plyfs {} (", env!("CARGO_PKG_VERSION"))), "{shown}");
    let head = std::process::Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).current_dir(env!("CARGO_MANIFEST_DIR")).output();
    if let Some(head) = head.ok().filter(|h| h.status.success()) {
        let head = String::from_utf8_lossy(&head.stdout).trim().to_owned();
        assert!(shown.contains(&head), "{shown} does not name {head}");
    }
}

/// A full log file system does not stop a mount: its lines are lost, the daemon serves (xfstests
/// found the daemon panicking at start when another test had filled the disk).
#[test]
fn a_mount_whose_log_cannot_be_written_still_serves() {
    assert!(is_root(), "this test mounts a small tmpfs: run as root");
    let (_dir, _root, [lower, mnt, full]) = scratch_dirs(["lower", "mnt", "full"]);
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).stderr(Stdio::null()).status();
        }
    }
    assert!(Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"]).arg(&full).status().unwrap().success());
    let _full = Unmount(full.clone());
    // Fill it: writes stop at ENOSPC.
    let mut f = fs::File::create(full.join("fill")).unwrap();
    while std::io::Write::write_all(&mut f, &[0u8; 65536]).is_ok() {}
    drop(f);
    let log = full.join("plyfs.log");
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).args(["--stack", "null", "--log"]).arg(&log));
    assert!(out.status.success(), "mount with a full log: {}", stderr_of(&out));
    let _mounted = Unmount(mnt.clone());
    fs::write(mnt.join("f"), b"served").unwrap();
    assert_eq!(fs::read(lower.join("f")).unwrap(), b"served");
    let out = run(plyfs().arg("umount").arg(&mnt));
    assert!(out.status.success(), "umount: {}", stderr_of(&out));
}

/// Colour codes only for a person at a terminal: a background daemon's log file, `plyfs serve`
/// into a file and `plyfs fsck` into a pipe are plain text, and `NO_COLOR` turns colour off on
/// a terminal too (#32).
#[test]
fn logs_are_coloured_only_on_a_terminal() {
    // A colour (SGR) sequence, `ESC [ 33 m`; a progress bar's line clearing (`ESC [ 2 K`) is not.
    let coloured = |text: &str| {
        text.split('\u{1b}').skip(1).any(|rest| rest.strip_prefix('[').is_some_and(|r| r.trim_start_matches(|c: char| c.is_ascii_digit() || c == ';').starts_with('m')))
    };
    let (dir, lower, mnt) = scratch();
    let log = dir.path().join("daemon.log");
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).args(["--stack", "null", "--log"]).arg(&log));
    assert!(out.status.success(), "{}", stderr_of(&out));
    let _unmount = scopeguard(&mnt);
    fs::write(mnt.join("f"), b"x").unwrap();
    assert!(run(plyfs().arg("umount").arg(&mnt)).status.success());
    let text = fs::read_to_string(&log).unwrap();
    assert!(text.contains(" INFO ") && text.contains("unmounted") && !coloured(&text), "{text:?}");

    let served = common::Server::start(&lower, &format!("unix:{}", dir.path().join("s.sock").display()), &[], &dir.path().join("serve.log"));
    let text = served.log_text();
    assert!(text.contains(" INFO ") && !coloured(&text), "{text:?}");
    drop(served);

    let fsck = |name: &str| {
        let mut cmd = plyfs();
        cmd.arg("fsck").arg(common::damaged_zstd_tree(dir.path(), name)).args(["--stack", "zstd", "-v"]).env_remove("NO_COLOR");
        cmd
    };
    let out = run(&mut fsck("piped"));
    let text = stderr_of(&out);
    assert!(text.contains("WARN") && !text.contains('\u{1b}'), "{text:?}");
    let (_, text) = common::run_on_terminal(&mut fsck("on-a-terminal"));
    assert!(text.contains("WARN") && coloured(&text), "{text:?}");
    let (_, text) = common::run_on_terminal(fsck("no-color").env("NO_COLOR", "1"));
    assert!(text.contains("WARN") && !coloured(&text), "{text:?}");
}

/// The `status --json` entry of the mount at `mnt`.
fn status_of(mnt: &Path) -> serde_json::Value {
    let out = run(plyfs().args(["status", "--json"]));
    assert!(out.status.success(), "{}", stderr_of(&out));
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let shown = mnt.display().to_string();
    all.as_array().unwrap().iter().find(|e| e["mountpoint"] == shown.as_str()).cloned().unwrap_or_else(|| panic!("{shown} not listed: {all}"))
}

/// `plyfs status` (or `plyfs list`): each mount with its lower, stack, daemon, transport, log
/// and state, as a table or JSON; a killed daemon's mount shows as stale; another user sees
/// none of root's (#32).
#[test]
fn status_lists_each_mount_with_its_daemon_and_log() {
    let mut m = Mount::new("trace,null");
    let e = status_of(&m.mnt);
    assert_eq!(e["lower"], m.lower.display().to_string().as_str(), "{e}");
    assert!(e["stack"].as_str().unwrap().starts_with("trace,null"), "{e}");
    assert_eq!(e["pid"], m.pid(), "{e}");
    assert!(matches!(e["transport"].as_str(), Some("/dev/fuse" | "io_uring")), "{e}");
    let log = e["log"].as_str().unwrap();
    assert!(log.ends_with(".log") && fs::read_to_string(log).unwrap().contains("mounted "), "{e}");
    assert_eq!(e["state"], "running", "{e}");

    let out = run(plyfs().arg("list"));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success() && table.starts_with("MOUNTPOINT "), "{table}{}", stderr_of(&out));
    let row = table.lines().find(|l| l.starts_with(&format!("{} ", m.mnt.display()))).unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains(&m.pid().to_string()) && row.ends_with("running"), "{row}");
    // The alias is a subcommand even where a file of its name makes it look like a mount
    // helper's LOWER.
    fs::write(m.dir.path().join("list"), b"").unwrap();
    let out = run(plyfs().args(["list", "--json"]).current_dir(m.dir.path()));
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains(&m.mnt.display().to_string()), "{}", stderr_of(&out));
    if is_root() {
        let (ok, err) = common::as_nobody(&[env!("CARGO_BIN_EXE_plyfs"), "status"]);
        assert!(ok && err.trim() == "plyfs: no plyfs mounts of yours", "{err}");
    }

    m.child().kill().unwrap();
    m.child().wait().unwrap();
    let e = status_of(&m.mnt);
    assert!(e["state"].as_str().unwrap().starts_with("daemon dead: stale mount"), "{e}");
    assert!(e["pid"].is_null(), "{e}");
    let out = run(plyfs().arg("umount").arg(&m.mnt));
    assert!(out.status.success(), "{}", stderr_of(&out));
    let out = run(plyfs().args(["status", "--json"]));
    assert!(!String::from_utf8_lossy(&out.stdout).contains(&m.mnt.display().to_string()));
}

/// `-o syslog`: the daemon's lines go to /dev/log as RFC 3164 datagrams of the daemon facility,
/// and `status` names syslog as its log. Needs /dev/log free (no syslog daemon on the machine).
#[test]
fn syslog_option_sends_the_daemon_log_to_dev_log() {
    use std::os::unix::net::UnixDatagram;
    if Path::new("/dev/log").exists() || !is_root() {
        eprintln!("skipped: /dev/log is taken (a syslog daemon runs), or not root");
        return;
    }
    struct Listening(UnixDatagram);
    impl Drop for Listening {
        fn drop(&mut self) {
            let _ = fs::remove_file("/dev/log");
        }
    }
    let syslog = Listening(UnixDatagram::bind("/dev/log").unwrap());
    syslog.0.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (_dir, lower, mnt) = scratch();
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).args(["--stack", "null", "-o", "syslog"]));
    assert!(out.status.success(), "{}", stderr_of(&out));
    let _unmount = scopeguard(&mnt);
    assert!(stderr_of(&out).trim_end().ends_with("log: syslog"), "{}", stderr_of(&out));
    let e = status_of(&mnt);
    assert_eq!(e["log"], "syslog", "{e}");
    let pid = e["pid"].as_u64().unwrap();
    assert!(run(plyfs().arg("umount").arg(&mnt)).status.success());
    let mut lines = Vec::new();
    let mut buf = [0u8; 9000];
    while !lines.iter().any(|l: &String| l.contains("unmounted")) {
        let n = syslog.0.recv(&mut buf).unwrap_or_else(|e| panic!("{e}; received so far: {lines:#?}"));
        lines.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    let form = |l: &String| {
        let (pri, rest) = l.strip_prefix('<').and_then(|r| r.split_once('>')).unwrap();
        pri.parse::<u8>().unwrap() / 8 == 3 && rest.len() > 16 && rest[16..].starts_with(&format!("plyfs[{pid}]: "))
    };
    assert!(lines.iter().all(form), "{lines:#?}");
    assert!(lines.iter().any(|l| l.starts_with("<30>") && l.contains(&format!("mounted {} on {}", lower.display(), mnt.display()))), "{lines:#?}");
}

/// Mistakes the argument parser finds read like every other error: one line naming what is
/// wrong and the help to read, with the usage status; `--help` and `--version` still print to
/// standard output and succeed (#32).
#[test]
fn argument_errors_are_one_line_with_the_usage_status() {
    let (_dir, lower, mnt) = scratch();
    let (l, m) = (lower.to_str().unwrap(), mnt.to_str().unwrap());
    for (args, says) in [
        (&["mount", l, m, "--config", "c.toml", "--stack", "null"][..], "the argument '--config <FILE>' cannot be used with '--stack <SPEC>' (see 'plyfs mount --help')"),
        (&["mount", l, m, "--bogus"], "unexpected argument '--bogus' found (see 'plyfs mount --help')"),
        (&["mount", l], "the following required arguments were not provided: <MOUNTPOINT> (see 'plyfs mount --help')"),
        (&["mount", l, m, "--stak", "null"], "unexpected argument '--stak' found; did you mean '--stack'? (see 'plyfs mount --help')"),
        (&["policy", "apply"], "(see 'plyfs policy apply --help')"),
        (&["moutn", l, m], "unrecognized subcommand 'moutn'; did you mean 'umount' or 'mount'? (see 'plyfs --help')"),
    ] {
        assert_refused(&run(plyfs().args(args)), USAGE, says);
    }
    assert_eq!(mounted_fstype(&mnt), None);
    assert_eq!(fs::read_dir(&lower).unwrap().count(), 1, "nothing written below");
    for args in [&["--help"][..], &["mount", "--help"], &["--version"]] {
        let out = run(plyfs().args(args));
        assert!(out.status.success() && !out.stdout.is_empty() && out.stderr.is_empty(), "{args:?}: {}", stderr_of(&out));
    }
}

/// Scripts tell the usual failures apart by the exit status, gocryptfs's where the failure is
/// the same (`man plyfs`, EXIT STATUS); a background daemon's failure reaches the command that
/// started it with its status (#32).
#[test]
fn exit_statuses_tell_failures_apart() {
    let (dir, lower, mnt) = scratch();
    let mount = |args: &[&str]| run(plyfs().arg("mount").args(args));
    let (l, m) = (lower.to_str().unwrap(), mnt.to_str().unwrap());
    const CONFIG: i32 = 8;
    const UNREACHABLE: i32 = 33;
    // The server is reached only by the daemon, which reports on its readiness pipe.
    let addr = format!("unix:{}", dir.path().join("no-server.sock").display());
    assert_refused(&mount(&[&addr, m]), UNREACHABLE, &format!("{addr}: connecting: No such file or directory"));
    assert_refused(&mount(&[&addr, m, "--foreground"]), UNREACHABLE, &format!("{addr}: connecting"));
    let exodisk = dir.path().join("no-service.sock");
    let source = format!("exodisk:{}", exodisk.display());
    assert_refused(&mount(&[&source, m]), UNREACHABLE, &format!("{}: connecting: No such file or directory", exodisk.display()));
    assert_refused(&mount(&[l, m, "--stack", "zstd,crypt"]), CONFIG, &format!("{l}: not a crypt volume (.plyfs-crypt.conf is missing)"));
    assert_refused(&mount(&["/nonexistent/lower", m, "--stack", "zstd"]), LOWER, "lower directory /nonexistent/lower: No such file or directory");
    assert_refused(&mount(&[l, m, "-o", "turbo"]), USAGE, "unknown mount option 'turbo'");
    // The form mount(8) uses (through mount.fuse3), with a lower that is not there: the same
    // line and status as `plyfs mount`, not the parser's "unrecognized subcommand".
    let out = run(plyfs().args(["/nonexistent/lower", m, "-o", "rw,stack=zstd"]));
    assert_refused(&out, LOWER, "lower directory /nonexistent/lower: No such file or directory");
    assert_eq!(mounted_fstype(&mnt), None);
    assert_eq!(fs::read_dir(&mnt).unwrap().count(), 0);
    assert_eq!(fs::read_dir(&lower).unwrap().count(), 1, "nothing written below");
}

/// `plyfs mount -o` takes what mount(8) and fstab lines take (`stack=`, `passfile=`, `branch=`,
/// `nofail`, `_netdev`, `defaults`, ...) with the same meaning; an argument given both ways is
/// refused with one line (#32).
#[test]
fn mount_dash_o_takes_what_fstab_takes() {
    let (dir, lower, mnt) = scratch();
    let (l, m) = (lower.to_str().unwrap(), mnt.to_str().unwrap());
    let mount = |args: &[&str]| run(plyfs().arg("mount").args([l, m]).args(args));
    assert_refused(&mount(&["--stack", "null", "-o", "stack=zstd"]), USAGE, "-o stack=zstd: --stack is given too; give it once (see 'plyfs mount --help')");
    assert_refused(&mount(&["--config", "c.toml", "-o", "rw,stack=zstd"]), USAGE, "the argument '--config <FILE>' cannot be used with '--stack <SPEC>'");
    assert_refused(&mount(&["-o", "passfile"]), USAGE, "-o passfile: needs a value (passfile=...)");
    assert_eq!(mounted_fstype(&mnt), None);
    assert_eq!(fs::read_dir(&lower).unwrap().count(), 1, "nothing written below");

    let m = Mount::start(dir, lower, mnt, "", &["rw,stack=trace,zstd,nofail,_netdev,defaults,x-systemd.automount,noatime"]);
    let text = "written through -o stack=trace,zstd\n".repeat(1000);
    fs::write(m.path("f"), &text).unwrap();
    assert_eq!(fs::read_to_string(m.path("f")).unwrap(), text);
    let stored = fs::read(m.lower_path("f")).unwrap();
    assert!(stored.len() < text.len() / 4, "zstd stores it compressed: {} bytes", stored.len());
    assert!(op_json(&m.mnt, &["stats"])["ops"].is_object(), "trace is in the stack");
}

/// A mount point that holds files is refused, naming `-o nonempty`, which mounts over them
/// (hiding them until the unmount), from `plyfs mount` and from the mount(8) form alike (#32).
#[test]
fn nonempty_mounts_over_files_that_the_refusal_names() {
    let (_dir, lower, mnt) = scratch();
    fs::write(mnt.join("hidden"), b"under the mount").unwrap();
    let refusal = format!("mount point {} is not empty: mounting would hide what it holds (-o nonempty mounts over it)", mnt.display());
    assert_refused(&run(plyfs().arg("mount").arg(&lower).arg(&mnt)), MOUNT_POINT, &refusal);
    assert_refused(&run(plyfs().arg(&lower).arg(&mnt).args(["-o", "stack=null"])), MOUNT_POINT, &refusal);
    assert_eq!(fs::read_dir(&lower).unwrap().count(), 1, "nothing written below");
    for (args, form) in [(&["mount", "-o", "nonempty"][..], "plyfs mount"), (&["-o", "stack=null,nonempty"], "mount(8)")] {
        let (subcommand, options) = args.split_at(if form == "plyfs mount" { 1 } else { 0 });
        let _guard = scopeguard(&mnt);
        let out = run(plyfs().args(subcommand).arg(&lower).arg(&mnt).args(options));
        assert!(out.status.success(), "{form}: {}", stderr_of(&out));
        assert_eq!(mounted_fstype(&mnt).as_deref(), Some("fuse.plyfs"), "{form}");
        assert!(mnt.join("keep.txt").exists() && !mnt.join("hidden").exists(), "{form}: the mount shows the lower");
        let out = run(plyfs().arg("umount").arg(&mnt));
        assert!(out.status.success(), "{form}: {}", stderr_of(&out));
        assert_eq!(fs::read(mnt.join("hidden")).unwrap(), b"under the mount", "{form}: the files are back");
    }
}

/// What a mount took by default is said in its mount message: no `--stack` mounts `null`, and a
/// `union` without `--branch` has LOWER as its only branch. A stack given in full says neither
/// (#32).
#[test]
fn the_mount_message_says_what_was_taken_by_default() {
    let (_dir, lower, mnt) = scratch();
    for (stack, says) in [
        (&[][..], "stack: null, which passes everything through unchanged (no --stack given)".to_owned()),
        (&["--stack", "union"], format!("union has one branch, {} (add more with --branch DIR)", lower.display())),
        (&["--stack", "trace,null"], String::new()),
    ] {
        let _guard = scopeguard(&mnt);
        let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).args(stack));
        let said = stderr_of(&out);
        assert!(out.status.success(), "{stack:?}: {said}");
        assert_eq!(said.lines().count(), 1, "{stack:?}: one line: {said}");
        let first = format!("plyfs: mounted {} (pid ", mnt.display());
        assert!(said.starts_with(&first), "{stack:?}: {said}");
        if says.is_empty() {
            assert!(!said.contains("no --stack") && !said.contains("one branch"), "{stack:?}: {said}");
        } else {
            assert!(said.contains(&format!("); {says}; file I/O: ")), "{stack:?}: {said:?} should say {says:?}");
        }
        let out = run(plyfs().arg("umount").arg(&mnt));
        assert!(out.status.success(), "{}", stderr_of(&out));
    }
}

/// What a newcomer reads first names everything: `plyfs --help` lists `manpages`, `plyfs
/// layers` lists `remote` and its parameters, options show their values (`--stack <SPEC>`) in
/// --help and the manual's synopsis, and shell completion offers layer names after `--stack`
/// (#32).
#[test]
fn help_layers_manual_and_completion_name_what_they_take() {
    let stdout = |args: &[&str]| {
        let out = run(plyfs().args(args));
        assert!(out.status.success(), "{args:?}: {}", stderr_of(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(stdout(&["--help"]).contains("\n  manpages "), "plyfs --help lists manpages");
    let layers = stdout(&["layers"]);
    let remote = layers.split("\nremote ").nth(1).expect("plyfs layers lists remote");
    for param in ["addr=", "psk=", "timeout=", "sync=", "name="] {
        assert!(remote.contains(&format!("\n    {param}")), "remote's {param} in {remote}");
    }
    let help = stdout(&["mount", "--help"]);
    for option in ["--stack <SPEC>", "--config <FILE>", "--rules <FILE>", "--log <FILE>", "-o <OPTIONS>"] {
        assert!(help.contains(option), "{option} in plyfs mount --help");
    }
    let dir = tempfile::tempdir().unwrap();
    stdout(&["manpages", dir.path().to_str().unwrap()]);
    let page = fs::read_to_string(dir.path().join("plyfs-mount.1")).unwrap();
    let synopsis = page.split(".SH SYNOPSIS\n").nth(1).and_then(|s| s.lines().next()).unwrap();
    for option in [r"[\-\-stack <SPEC>]", r"[\-\-config <FILE>]", r"[\-o <OPTIONS>]...", r"[\-\-branch <DIR[=ro|rw]>]...", "<LOWER> <MOUNTPOINT>"] {
        assert!(synopsis.contains(option), "{option} in {synopsis}");
    }
    let kinds = "null trace copy uuencode gzip zstd lz4 crypt union mirror cache version fault lazy ext py remote";
    let bash = stdout(&["completions", "bash"]);
    assert!(bash.contains(&format!("--stack)\n                    COMPREPLY=($(compgen -W \"{kinds}\" -- \"${{cur}}\"))")), "bash offers layer names after --stack");
    for shell in ["zsh", "fish"] {
        let script = stdout(&["completions", shell]);
        assert!(["zstd", "crypt", "union", "remote"].iter().all(|k| script.contains(k)), "{shell} offers layer names");
    }
}

/// `plyfs install-helper` writes the mount(8) helper the Debian package installs, for a plyfs
/// from `cargo install`: a script that runs this plyfs. It replaces its own, leaves another
/// program's alone, and says what to do without permission, in one line each (#32).
#[test]
fn install_helper_writes_the_mount_helper() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let sbin = dir.path().join("sbin");
    fs::create_dir(&sbin).unwrap();
    for d in [dir.path(), &sbin] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let helper = sbin.join("mount.fuse.plyfs");
    let exe = Path::new(env!("CARGO_BIN_EXE_plyfs")).canonicalize().unwrap();
    for _ in 0..2 {
        let out = run(plyfs().args(["install-helper", "--dir"]).arg(&sbin));
        let said = stderr_of(&out);
        assert!(out.status.success(), "{said}");
        assert_eq!(said, format!("plyfs: installed {}, which runs {}: `mount -t fuse.plyfs` and fstab lines find it\n", helper.display(), exe.display()));
    }
    assert_eq!(fs::metadata(&helper).unwrap().permissions().mode() & 0o7777, 0o755);
    let script = fs::read_to_string(&helper).unwrap();
    assert!(script.starts_with("#!/bin/sh\n") && script.ends_with(&format!("exec '{}' \"$@\"\n", exe.display())), "{script}");
    let out = run(&mut Command::new(&helper).arg("--version"));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("plyfs "), "the helper runs this plyfs");

    let foreign = "#!/bin/sh\nexec sshfs \"$@\"\n";
    fs::write(&helper, foreign).unwrap();
    let out = run(plyfs().args(["install-helper", "--dir"]).arg(&sbin));
    assert_refused(&out, OTHER, &format!("{}: exists and is not plyfs's helper; remove it first if it should be", helper.display()));
    assert_eq!(fs::read_to_string(&helper).unwrap(), foreign);
    fs::remove_file(&helper).unwrap();

    if is_root() {
        let out = run(Command::new("setpriv").args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"]).arg(&exe).args(["install-helper", "--dir"]).arg(&sbin));
        assert_refused(&out, OTHER, &format!("{}: Permission denied (os error 13) (run it as root, or give --dir DIR)", helper.display()));
        assert_eq!(fs::read_dir(&sbin).unwrap().count(), 0, "nothing written");
    }
    assert_refused(&run(plyfs().args(["install-helper", "--dir"]).arg(sbin.join("missing"))), OTHER, "missing: No such file or directory");

    // The program it is to run: absolute, there, executable.
    let install = |exec: &Path| run(plyfs().args(["install-helper", "--dir"]).arg(&sbin).arg("--exec").arg(exec));
    assert_refused(&install(Path::new("target/release/plyfs")), USAGE, "--exec target/release/plyfs: give an absolute path");
    assert_refused(&install(&dir.path().join("nowhere")), OTHER, "nowhere: No such file or directory");
    assert_refused(&install(&sbin), OTHER, "sbin: not an executable file");
    assert_eq!(fs::read_dir(&sbin).unwrap().count(), 0, "nothing written");
    if is_root() {
        // Root's mounts would run it: a program another user could change is refused, as is
        // one in a directory others may write (a user's `cargo install`).
        let theirs = dir.path().join("home");
        fs::create_dir(&theirs).unwrap();
        fs::copy(&exe, theirs.join("plyfs")).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        assert_refused(&install(&theirs.join("plyfs")), OTHER, &format!("{} belongs to uid 65534, and root's mounts would run it", theirs.display()));
        std::os::unix::fs::chown(&theirs, Some(0), Some(0)).unwrap();
        fs::set_permissions(&theirs, fs::Permissions::from_mode(0o777)).unwrap();
        assert_refused(&install(&theirs.join("plyfs")), OTHER, "is writable by others (mode 777)");
        fs::set_permissions(&theirs, fs::Permissions::from_mode(0o755)).unwrap();
        assert!(install(&theirs.join("plyfs")).status.success());
        fs::remove_file(&helper).unwrap();
    }
    // The Debian package's helper stays the package's.
    let package = format!("#!/bin/sh\n# mount(8) helper for file systems of type fuse.plyfs: `mount -t fuse.plyfs LOWER MNT -o\nexec '/usr/bin/plyfs' \"$@\"\n");
    fs::write(&helper, &package).unwrap();
    assert_refused(&run(plyfs().args(["install-helper", "--dir"]).arg(&sbin)), OTHER, "the plyfs package's helper, which runs /usr/bin/plyfs");
    assert_eq!(fs::read_to_string(&helper).unwrap(), package);
}
