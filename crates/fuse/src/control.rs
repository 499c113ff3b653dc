//! The control socket: how `plyfs op PATH NAME [ARGS...]` reaches the daemon of a mount.
//!
//! Each daemon listens on a Unix socket whose path follows from the mount's owner and mount
//! point (see [`socket_path`]), so the client needs only the path it was given. One request per
//! connection, one JSON line each way:
//!
//! ```text
//! → {"path":"logs/app.log","op":"stats","args":[],"layer":null}
//! ← {"ok":{...}}            or            ← {"error":"..."}
//! ```
//!
//! The path is resolved inside the stack, through the same lookups a FUSE request would make;
//! `.plyfs/NAME/...` paths resolve in the view below layer NAME. `"op":"--list"` lists the
//! extended operations of the stack; `"op":"--about"` answers what the mount is (lower, stack,
//! pid, transport, log), for `plyfs status`.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use plyfs_stack::{Caller, Error, Level, NodeId, Stack};
use serde_json::{json, Value};

use crate::fs::LEVELS_DIR;
use crate::mountinfo;

/// Where the daemons of `uid` keep their sockets and logs: `/run/plyfs` for root; for other
/// users `$XDG_RUNTIME_DIR/plyfs` when `XDG_RUNTIME_DIR` (else `/run/user/UID`) is a directory
/// that `uid` owns with mode 0700, else `/tmp/plyfs-UID`. The directory is made 0700 if missing
/// when `create` is set, and must be a real directory (not a symbolic link) owned by `uid` with
/// mode 0700, or the answer is an error naming it: another user may have made it first in
/// `/tmp`. The daemon and every client (`plyfs op`, `plyfs umount`) go through here.
pub fn runtime_dir(uid: u32, create: bool) -> std::io::Result<PathBuf> {
    let xdg = std::env::var_os("XDG_RUNTIME_DIR");
    choose_runtime_dir(uid, xdg.as_deref().map(Path::new), Path::new("/tmp"), create)
}

/// [`runtime_dir`], with the environment's `XDG_RUNTIME_DIR` and the shared temporary
/// directory given (for tests).
pub fn choose_runtime_dir(uid: u32, xdg: Option<&Path>, tmp: &Path, create: bool) -> std::io::Result<PathBuf> {
    let dir = if uid == 0 {
        PathBuf::from("/run/plyfs")
    } else {
        let per_user = PathBuf::from(format!("/run/user/{uid}"));
        let private_base = [xdg.filter(|x| x.is_absolute()), Some(per_user.as_path())]
            .into_iter()
            .flatten()
            .find(|base| plyfs_stack::private::check_private_dir(base, uid).is_ok());
        match private_base {
            Some(base) => base.join("plyfs"),
            None => tmp.join(format!("plyfs-{uid}")),
        }
    };
    if create {
        plyfs_stack::private::private_dir(&dir, uid)?;
    } else {
        plyfs_stack::private::check_private_dir(&dir, uid)?;
    }
    Ok(dir)
}

fn mount_key(mountpoint: &Path) -> String {
    // FNV-1a: short, stable, and keeps socket paths under the 108-byte limit.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in mountpoint.as_os_str().as_encoded_bytes() {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// The control socket of `uid`'s mount at `mountpoint`, in a runtime directory that passed
/// [`runtime_dir`]'s checks.
pub fn socket_path(uid: u32, mountpoint: &Path) -> std::io::Result<PathBuf> {
    Ok(runtime_dir(uid, false)?.join(format!("{}.sock", mount_key(mountpoint))))
}

/// The default log file of a background daemon (the runtime directory is made if missing).
pub fn log_path(uid: u32, mountpoint: &Path) -> std::io::Result<PathBuf> {
    Ok(runtime_dir(uid, true)?.join(format!("{}.log", mount_key(mountpoint))))
}

/// Where the background daemon of `uid`'s mount at `mountpoint` logs by default, without making
/// anything (`plyfs status` on a mount whose daemon is gone).
pub fn log_path_of(uid: u32, mountpoint: &Path) -> Option<PathBuf> {
    Some(runtime_dir(uid, false).ok()?.join(format!("{}.log", mount_key(mountpoint))))
}

/// Create the runtime directory, private to its user.
pub fn ensure_runtime_dir(uid: u32) -> std::io::Result<PathBuf> {
    runtime_dir(uid, true)
}

/// Serves extended operations for one mount until dropped.
pub struct ControlServer {
    path: PathBuf,
}

impl ControlServer {
    /// Serve `stack`'s operations, and `about` (what `plyfs status` shows: lower, stack, pid,
    /// transport, log) to the `--about` request.
    pub fn start(stack: Arc<Stack>, mountpoint: &Path, about: Value) -> std::io::Result<ControlServer> {
        let uid = unsafe { libc::geteuid() };
        let path = ensure_runtime_dir(uid)?.join(format!("{}.sock", mount_key(mountpoint)));
        if path.exists() {
            if UnixStream::connect(&path).is_ok() {
                return Err(std::io::Error::other(format!("{} is in use by another daemon", path.display())));
            }
            std::fs::remove_file(&path)?;
        }
        let listener = UnixListener::bind(&path)?;
        // Only the owner connects (root too, whatever the mode); the daemon's umask is 0.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let about = Arc::new(about);
        std::thread::Builder::new().name("control".into()).spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (stack, about) = (stack.clone(), about.clone());
                let _ = std::thread::Builder::new().name("control-op".into()).spawn(move || serve(&stack, &about, conn));
            }
        })?;
        Ok(ControlServer { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn peer(conn: &UnixStream) -> Option<Caller> {
    let cred = nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::PeerCredentials).ok()?;
    Some(Caller::new(cred.uid(), cred.gid(), cred.pid() as u32))
}

/// The request for what the mount is (its answer is the `about` it was started with).
const ABOUT_OP: &str = "--about";

fn serve(stack: &Arc<Stack>, about: &Value, conn: UnixStream) {
    let mut line = String::new();
    let mut reader = BufReader::new(&conn);
    let answer = match (reader.read_line(&mut line), peer(&conn)) {
        (Ok(_), Some(cx)) => {
            let me = unsafe { libc::geteuid() };
            if cx.uid != me && cx.uid != 0 {
                json!({ "error": "permission denied: only the mount's owner may run operations" })
            } else if serde_json::from_str::<Value>(&line).is_ok_and(|r| r["op"] == ABOUT_OP) {
                json!({ "ok": about })
            } else {
                run_reporting_progress(stack, cx, line, &conn)
            }
        }
        _ => json!({ "error": "malformed request" }),
    };
    let mut out = &conn;
    let _ = writeln!(out, "{answer}");
}

/// Run one request on a thread of its own; while it runs, pass on the progress it reports, if
/// the client asked for it (`"progress": true`), as `{"progress": {...}}` lines.
fn run_reporting_progress(stack: &Arc<Stack>, cx: Caller, line: String, conn: &UnixStream) -> Value {
    let wants_progress = serde_json::from_str::<Value>(&line).ok().is_some_and(|r| r["progress"] == true);
    let (tx, rx) = std::sync::mpsc::channel();
    let worker_stack = stack.clone();
    let worker = std::thread::Builder::new().name("control-work".into()).spawn(move || {
        let answer = match handle(&worker_stack, &cx, &line) {
            Ok(v) => json!({ "ok": v }),
            Err(e) => json!({ "error": e }),
        };
        let _ = tx.send(answer);
    });
    let worker = match worker {
        Ok(w) => w,
        Err(e) => return json!({ "error": format!("cannot start the operation: {e}") }),
    };
    let id = worker.thread().id();
    let mut last = None;
    loop {
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(answer) => return answer,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return json!({ "error": "the operation failed" }),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let Some(p) = plyfs_stack::progress::of_thread(id).filter(|_| wants_progress) else { continue };
                if last.as_ref() == Some(&p) {
                    continue;
                }
                let mut out = conn;
                let line = json!({ "progress": { "label": p.label, "unit": p.unit, "done": p.done, "total": p.total } });
                if writeln!(out, "{line}").is_err() {
                    // The client is gone; the work goes on to its end.
                    continue;
                }
                last = Some(p);
            }
        }
    }
}

fn handle(stack: &Stack, cx: &Caller, line: &str) -> Result<Value, String> {
    let req: Value = serde_json::from_str(line).map_err(|e| format!("malformed request: {e}"))?;
    let path = req["path"].as_str().unwrap_or("");
    let op = req["op"].as_str().ok_or("request names no operation")?;
    let args: Vec<String> =
        req["args"].as_array().map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect()).unwrap_or_default();

    let mut components: Vec<&OsStr> = Path::new(path)
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    let mut level = stack.top().clone();
    let mut from_view = false;
    if components.first().is_some_and(|c| *c == LEVELS_DIR) {
        let name = components.get(1).ok_or("name a layer after .plyfs/")?;
        let view = stack.view_named(&name.to_string_lossy()).ok_or_else(|| format!("no layer named {name:?}"))?;
        level = stack.view(view).ok_or_else(|| format!("layer {name:?} is gone"))?;
        from_view = true;
        components.drain(..2);
    }
    if let Some(layer) = req["layer"].as_str() {
        if from_view {
            return Err("give either OP@LAYER or a .plyfs/ path, not both".into());
        }
        level = stack.level_named(layer).ok_or_else(|| {
            let names: Vec<String> = stack.named_levels().into_iter().map(|n| n.name).collect();
            format!("no layer named '{layer}' in this stack ({})", names.join(", "))
        })?;
    }
    let level = &level;

    if op == plyfs_stack::readonly::READ_ONLY_OP {
        // `mount -o remount,ro|rw`: the whole mount, whatever the path.
        let on = match args.first().map(String::as_str) {
            Some("on") => true,
            Some("off") => false,
            _ => return Err(format!("{op}: expected on or off")),
        };
        plyfs_stack::readonly::set_read_only(on);
        tracing::info!("remounted {}", if on { "read-only: nothing below changes from now on" } else { "read-write" });
        return Ok(json!({ "read_only": on }));
    }
    if op == "--list" {
        let ops = stack.extended_ops_from(level);
        return Ok(Value::Array(ops.into_iter().map(|(layer, o)| json!({ "layer": layer, "op": o.name, "args": o.args, "help": o.help })).collect()));
    }

    // Sent to the whole mount, not to a level or an object in one branch.
    if components.is_empty() && !from_view && req["layer"].is_null() {
        if let Some(e) = stack.ambiguous(op) {
            return Err(e.to_string());
        }
    }
    let (node, held) = resolve(level, cx, &components).map_err(|e| format!("{path}: {e}"))?;
    let result = level.extended(cx, node, op, &args);
    for n in held {
        level.forget(cx, n, 1);
    }
    result.map_err(|e| stack.explain(e).to_string())
}

/// Look `components` up from the root of `level`, returning the node and the lookups to drop.
fn resolve(level: &Level, cx: &Caller, components: &[&OsStr]) -> Result<(NodeId, Vec<NodeId>), Error> {
    let mut node = NodeId::ROOT;
    let mut held = Vec::new();
    for name in components {
        match level.lookup(cx, node, name) {
            Ok(e) => {
                node = e.node;
                held.push(e.node);
            }
            Err(e) => {
                for n in held {
                    level.forget(cx, n, 1);
                }
                return Err(e);
            }
        }
    }
    Ok((node, held))
}

/// Run extended operation `op` (`NAME` or `NAME@LAYER`) on `path` in a mounted stack.
pub fn call_op(path: &Path, op: &str, args: &[String]) -> Result<Value, String> {
    call_op_with_progress(path, op, args, &mut |_| {})
}

/// As [`call_op`], passing each progress report (`label`, `unit`, `done`, `total`) of long work
/// to `progress` while it runs.
pub fn call_op_with_progress(path: &Path, op: &str, args: &[String], progress: &mut dyn FnMut(&Value)) -> Result<Value, String> {
    let shown = path.display();
    let canonical = path.canonicalize().map_err(|e| format!("{shown}: {e}"))?;
    let mount = mountinfo::mount_containing(&canonical)
        .filter(|m| m.is_plyfs())
        .ok_or_else(|| format!("{shown} is not inside a plyfs mount"))?;
    let rel = canonical.strip_prefix(&mount.mountpoint).unwrap_or(Path::new(""));
    let (name, layer) = match op.split_once('@') {
        Some((n, l)) => (n, Some(l)),
        None => (op, None),
    };
    let conn = connect(mount.user_id.unwrap_or(0), &mount.mountpoint)?;
    let request = json!({ "path": rel.to_string_lossy(), "op": name, "args": args, "layer": layer, "progress": true });
    let mut out = &conn;
    writeln!(out, "{request}").map_err(|e| format!("control socket: {e}"))?;
    let mut reader = BufReader::new(&conn);
    let reply = loop {
        let mut line = String::new();
        reader.read_line(&mut line).map_err(|e| format!("control socket: {e}"))?;
        let reply: Value = serde_json::from_str(&line).map_err(|_| "the daemon closed the connection without answering".to_owned())?;
        match reply.get("progress") {
            Some(p) => progress(p),
            None => break reply,
        }
    };
    match (reply.get("ok"), reply.get("error")) {
        (Some(v), _) => Ok(v.clone()),
        (_, Some(e)) => Err(e.as_str().unwrap_or("error").to_owned()),
        _ => Err("malformed answer from the daemon".into()),
    }
}

/// A connection to the daemon of `owner`'s mount at `mountpoint`, served by that owner (or
/// root), not by someone who took the socket's place.
fn connect(owner: u32, mountpoint: &Path) -> Result<UnixStream, String> {
    connect_with(owner, mountpoint, false)
}

/// [`connect`]; with `at_once`, a listener that does not take the connection now (its queue
/// full: nothing accepts) is an error rather than a wait, since the socket lies in its owner's
/// directory and the owner may put anything there.
fn connect_with(owner: u32, mountpoint: &Path, at_once: bool) -> Result<UnixStream, String> {
    let shown = mountpoint.display();
    let socket = socket_path(owner, mountpoint).map_err(|e| format!("cannot reach the daemon of {shown}: {e}"))?;
    let connected = if at_once { connect_at_once(&socket) } else { UnixStream::connect(&socket) };
    let conn = connected.map_err(|e| {
        format!("cannot reach the daemon of {shown} ({}: {e}); if it was killed, `plyfs umount {shown}` cleans up", socket.display())
    })?;
    match peer(&conn) {
        Some(p) if p.uid == owner || p.uid == 0 => Ok(conn),
        _ => Err(format!("{}: not served by uid {owner}, the owner of the mount; refusing it", socket.display())),
    }
}

/// Why [`about`] has no description of a mount.
#[derive(Debug)]
pub enum NoAbout {
    /// A daemon took the connection but did not answer in time.
    Silent(String),
    /// No daemon to ask, or none that answers as a daemon does.
    Gone(String),
}

impl std::fmt::Display for NoAbout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoAbout::Silent(why) | NoAbout::Gone(why) => f.write_str(why),
        }
    }
}

/// The longest answer [`about`] reads: a daemon's description is well under 1 KiB.
const ABOUT_MAX: usize = 64 << 10;

/// What the daemon of `owner`'s mount at `mountpoint` says it is (`plyfs status`): lower,
/// stack, pid, transport, log. An error when no daemon answers in full within `wait`: root asks
/// every user's daemon, over sockets those users control, so no answer may hold it longer, or
/// make it read without end.
pub fn about(owner: u32, mountpoint: &Path, wait: std::time::Duration) -> Result<Value, NoAbout> {
    let deadline = std::time::Instant::now() + wait;
    let conn = connect_with(owner, mountpoint, true).map_err(NoAbout::Gone)?;
    let silent = || format!("the daemon of {} does not answer", mountpoint.display());
    let _ = conn.set_write_timeout(Some(wait));
    let mut out = &conn;
    writeln!(out, "{}", json!({ "op": ABOUT_OP })).map_err(|e| NoAbout::Gone(format!("control socket: {e}")))?;
    let mut line = Vec::new();
    let mut chunk = [0u8; 4096];
    while !line.contains(&b'\n') {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(NoAbout::Silent(format!("{} within {wait:?}", silent())));
        }
        let _ = conn.set_read_timeout(Some(left));
        match std::io::Read::read(&mut &conn, &mut chunk) {
            Ok(0) => break,
            Ok(n) => line.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(NoAbout::Silent(format!("{}: {e}", silent()))),
        }
        if line.len() > ABOUT_MAX {
            return Err(NoAbout::Gone(format!("the daemon of {} answers at more length than a daemon does ({ABOUT_MAX} bytes)", mountpoint.display())));
        }
    }
    let reply: Value = serde_json::from_slice(&line).map_err(|_| NoAbout::Gone("the daemon closed the connection without answering".to_owned()))?;
    reply.get("ok").cloned().ok_or_else(|| NoAbout::Gone(reply["error"].as_str().unwrap_or("malformed answer from the daemon").to_owned()))
}

/// Connect to the Unix socket `path` without waiting: a stream socket's connect waits while its
/// listener's queue is full; non-blocking, it fails with EAGAIN instead. The stream returned
/// blocks again.
fn connect_at_once(path: &Path) -> std::io::Result<UnixStream> {
    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType, UnixAddr};
    let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    nix::sys::socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(path)?)?;
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A listener in the place of the control socket of a (pretend) mount of ours, removed when
    /// dropped.
    struct Place(PathBuf, PathBuf);

    impl Place {
        fn new(name: &str) -> Place {
            let uid = unsafe { libc::geteuid() };
            ensure_runtime_dir(uid).unwrap();
            let mountpoint = PathBuf::from(format!("/nonexistent/plyfs-about-test-{}-{name}", std::process::id()));
            let socket = socket_path(uid, &mountpoint).unwrap();
            let _ = std::fs::remove_file(&socket);
            Place(mountpoint, socket)
        }

        fn ask(&self) -> (Result<Value, NoAbout>, Duration) {
            let start = Instant::now();
            (about(unsafe { libc::geteuid() }, &self.0, Duration::from_millis(800)), start.elapsed())
        }
    }

    impl Drop for Place {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.1);
        }
    }

    /// `plyfs status` run by root asks every user's daemon over a socket that user controls: a
    /// listener that accepts nothing, answers a byte at a time, or never ends its line holds
    /// it no longer than its wait, and makes it read no more than a daemon says.
    #[test]
    fn about_is_bounded_in_time_and_length_whatever_listens() {
        // Nothing accepts, and the queue is full: connect would wait for ever.
        let place = Place::new("full");
        let listener = UnixListener::bind(&place.1).unwrap();
        let mut queued = Vec::new();
        while let Ok(s) = connect_at_once(&place.1) {
            queued.push(s);
            assert!(queued.len() < 10_000, "the queue never fills");
        }
        let (answer, took) = place.ask();
        assert!(answer.is_err() && took < Duration::from_secs(2), "{answer:?} after {took:?}");
        drop((listener, queued));

        // A byte every 200 ms: each read is in time, the whole answer is not.
        let place = Place::new("dribble");
        let listener = UnixListener::bind(&place.1).unwrap();
        std::thread::spawn(move || {
            if let Ok((mut c, _)) = listener.accept() {
                while c.write_all(b" ").is_ok() {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        });
        let (answer, took) = place.ask();
        assert!(matches!(&answer, Err(NoAbout::Silent(_))) && answer.unwrap_err().to_string().contains("does not answer within") && took < Duration::from_secs(2), "after {took:?}");

        // A line without end.
        let place = Place::new("endless");
        let listener = UnixListener::bind(&place.1).unwrap();
        std::thread::spawn(move || {
            if let Ok((mut c, _)) = listener.accept() {
                while c.write_all(&[b'x'; 4096]).is_ok() {}
            }
        });
        let (answer, _) = place.ask();
        assert!(answer.unwrap_err().to_string().contains("answers at more length"));
    }
}
