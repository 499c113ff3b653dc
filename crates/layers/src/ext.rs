//! `ext` and `py`: a layer of the stack that runs in another process (`seeds/000` §5.5).
//!
//! `ext:socket=PATH` reaches a process that listens on PATH and hosts one layer (`plyfs host`,
//! or a Python script run with `--socket`). `py:script=FILE` starts `python3 FILE` itself, with a
//! socket pair; the script's standard error passes through the mount's, and its last line is the
//! cause given when the script dies at start. Either way the process says in its welcome what it
//! is:
//!
//! - a layer, with the operations it answers: those go to it, every other operation bypasses
//!   it here, in the mount, at no cost. Its own calls to the level below come back over the
//!   same connection and run on this layer's lower level.
//! - a codec (`encode`/`decode` of one chunk): the mount builds a fast-indexing layer around it,
//!   so the index, fast tails, recovery and holes are the framework's, and only chunks travel.
//!
//! If the process dies, its operations fail with `EIO` and one log line; the mount lives on, and
//! the next operation connects again (or starts the script again, at most once a second).

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use plyfs_sca::{build_sca_layer, Codec, Error as CodecError, CHUNK_PARAM, FAST_TAILS_PARAM};
use plyfs_stack::spec::{ParamSpec, ANY_PARAM};
use plyfs_stack::{Build, BuildArgs, Caller, DataPath, Error, ExtOpInfo, Layer, LayerFactory, Level, Op, Reply, Result};
use plyfs_transport::client::{CallError, Connection, Incoming};
use plyfs_transport::wire::{CodecOp, Hosted, RequestOp, WireReply};

const SOCKET: ParamSpec = ParamSpec { name: "socket", help: "the Unix socket the layer's process listens on", default: None };
const SCRIPT: ParamSpec = ParamSpec { name: "script", help: "the Python file that defines the layer or codec", default: None };
const PYTHON: ParamSpec = ParamSpec {
    name: "python",
    help: "the Python interpreter (default: $PLYFS_PYTHON, else an active virtual environment's, else python3)",
    default: None,
};
const TIMEOUT: ParamSpec = ParamSpec { name: "timeout", help: "seconds to wait for the process before EIO", default: Some("60") };
const SCRIPT_PARAMS: ParamSpec =
    ParamSpec { name: ANY_PARAM, help: "any other parameter goes to the script (plyfs.params)", default: None };

pub const EXT_FACTORY: LayerFactory = LayerFactory {
    kind: "ext",
    summary: "a layer hosted by another process on a Unix socket (plyfs host, or a Python layer run with --socket)",
    params: &[SOCKET, TIMEOUT],
    ext_ops: &[],
    build: Build::Linear(build_ext),
    absorbs: &[],
};

pub const PY_FACTORY: LayerFactory = LayerFactory {
    kind: "py",
    summary: "a layer or codec written in Python (the plyfs package), run in a process the mount starts",
    params: &[SCRIPT, PYTHON, TIMEOUT, CHUNK_PARAM, FAST_TAILS_PARAM, SCRIPT_PARAMS],
    ext_ops: &[],
    build: Build::Linear(build_py),
    absorbs: &[],
};

/// How the process is reached.
enum Endpoint {
    Socket(PathBuf),
    Script { python: String, script: PathBuf, params: Vec<(String, String)> },
}

/// One process hosting a layer or codec, and the connection to it.
struct Peer {
    /// The layer's name, for log lines.
    name: String,
    endpoint: Endpoint,
    /// Where the process's own calls go: the level below the layer (none for a codec).
    below: Option<Level>,
    timeout: Duration,
    conn: RwLock<Option<Arc<Connection>>>,
    child: Mutex<Option<Child>>,
    /// The last lines the script wrote to standard error.
    said: Arc<Mutex<VecDeque<String>>>,
    /// Copies the script's standard error to the mount's, keeping the last lines in `said`.
    stderr_copier: Mutex<Option<std::thread::JoinHandle<()>>>,
    last_start: Mutex<Option<Instant>>,
    /// The loss of the process was logged.
    lost: std::sync::atomic::AtomicBool,
}

impl Peer {
    fn describe(&self) -> String {
        match &self.endpoint {
            Endpoint::Socket(p) => format!("layer '{}' (process on {})", self.name, p.display()),
            Endpoint::Script { script, .. } => format!("layer '{}' ({})", self.name, script.display()),
        }
    }

    /// The live connection, or a new one: at most one start per second.
    fn connection(&self) -> Result<Arc<Connection>> {
        if let Some(c) = self.conn.read().as_ref().filter(|c| !c.is_dead()) {
            return Ok(c.clone());
        }
        let mut last = self.last_start.lock();
        if let Some(c) = self.conn.read().as_ref() {
            if !c.is_dead() {
                return Ok(c.clone());
            }
            // Once per loss: the process is gone.
            if !self.lost.swap(true, std::sync::atomic::Ordering::Relaxed) {
                let status = self.child.lock().as_mut().and_then(|c| c.try_wait().ok().flatten());
                let how = status.map_or_else(|| c.dead_reason().unwrap_or_default(), |s| format!("the process ended ({s})"));
                tracing::error!("{}: {how}; its operations fail with EIO until it is back", self.describe());
            }
        }
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return Err(Error::Os(libc::EIO));
        }
        *last = Some(Instant::now());
        let restarting = self.conn.read().is_some();
        match self.start() {
            Ok(c) => {
                if restarting {
                    tracing::warn!("{}: connected again", self.describe());
                }
                self.lost.store(false, std::sync::atomic::Ordering::Relaxed);
                *self.conn.write() = Some(c.clone());
                Ok(c)
            }
            Err(e) => {
                tracing::error!("{e}");
                Err(Error::Os(libc::EIO))
            }
        }
    }

    /// Connect to the process, starting it first if it is a script.
    fn start(&self) -> std::result::Result<Arc<Connection>, crate::Error> {
        let failed = |doing: &str, e: &dyn std::fmt::Display| crate::Error::Connect { peer: self.describe(), why: format!("{doing}: {e}") };
        let incoming: Option<Incoming> = self.below.clone().map(|below| -> Incoming {
            Arc::new(move |caller, op, payload| {
                let result = op.stack_op(&payload).and_then(|op| below.call(&caller.into(), &op));
                WireReply::from_result(result)
            })
        });
        let stream: UnixStream = match &self.endpoint {
            Endpoint::Socket(path) => UnixStream::connect(path).map_err(|e| failed(&format!("connecting to {}", path.display()), &e))?,
            Endpoint::Script { python, script, params } => {
                let (ours, theirs) = UnixStream::pair().map_err(|e| failed("making a socket pair", &e))?;
                let (child, copier) = spawn_script(python, script, params, theirs.into(), self.said.clone())
                    .map_err(|e| failed(&format!("cannot run {python} {}", script.display()), &e))?;
                if let Some(mut old) = self.child.lock().replace(child) {
                    let _ = old.kill();
                    let _ = old.wait();
                }
                *self.stderr_copier.lock() = Some(copier);
                ours
            }
        };
        Connection::open_with(Box::new(stream), None, self.timeout, Arc::new(|_| {}), incoming).map_err(|e| match &self.endpoint {
            Endpoint::Script { python, .. } => match self.ended_at_start() {
                Some(why) => failed(&format!("{python} ended at start"), &why),
                None => failed("opening the connection", &e),
            },
            Endpoint::Socket(_) => failed("opening the connection", &e),
        })
    }

    /// How the script ended, if it did (waiting a moment for it), with the last line it wrote to
    /// standard error: for a script that dies at start, the exception that killed it (`No
    /// module named 'plyfs'`).
    fn ended_at_start(&self) -> Option<String> {
        let deadline = Instant::now() + Duration::from_secs(2);
        let status = loop {
            let ended = self.child.lock().as_mut().map(|c| c.try_wait());
            match ended {
                Some(Ok(Some(status))) => break status,
                Some(Ok(None)) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => return None,
            }
        };
        // Its last words may still be in the pipe.
        if let Some(copier) = self.stderr_copier.lock().take() {
            while !copier.is_finished() && Instant::now() < deadline + Duration::from_secs(1) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let said = self.said.lock();
        let last = said.iter().rev().map(|l| l.trim()).find(|l| !l.is_empty());
        Some(match last {
            Some(line) if line.contains("No module named 'plyfs'") => format!(
                "{status}: {line} (install the plyfs package for this interpreter, activate a virtual environment that has it, or give py:python=PATH)"
            ),
            Some(line) => format!("{status}: {line}"),
            None => status.to_string(),
        })
    }

    /// Send one request; a lost process is one log line and `EIO`.
    fn call(&self, cx: &Caller, op: RequestOp, payload: &[u8]) -> Result<(WireReply, Vec<u8>)> {
        let conn = self.connection()?;
        let name = op.name().to_owned();
        match conn.call(cx.into(), op, payload, Instant::now() + self.timeout) {
            Ok(r) => Ok(r),
            Err(CallError::TimedOut) => {
                tracing::error!("{}: no answer to {name} within {:?}", self.describe(), self.timeout);
                Err(Error::Os(libc::EIO))
            }
            Err(CallError::Lost { reason, .. }) => {
                let status = self.child.lock().as_mut().and_then(|c| c.try_wait().ok().flatten());
                let how = status.map_or(reason, |s| format!("the process ended ({s})"));
                if !self.lost.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::error!("{}: {name} failed: {how}; its operations fail with EIO until it is back", self.describe());
                }
                Err(Error::Os(libc::EIO))
            }
        }
    }

    fn stop(&self) {
        if let Some(c) = self.conn.write().take() {
            c.close("the mount is shutting down");
        }
        if let Some(mut child) = self.child.lock().take() {
            // The script ends when its connection does; give it a moment, then insist.
            let deadline = Instant::now() + Duration::from_secs(2);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The lines of a script's standard error kept for the message if it dies at start.
const SAID_LINES: usize = 20;

/// Start `python script` with the socket as descriptor 3 and the parameters in the environment.
/// Its standard error goes to the mount's (its log), line by line through a thread that keeps
/// the last lines in `said`.
fn spawn_script(
    python: &str,
    script: &std::path::Path,
    params: &[(String, String)],
    sock: OwnedFd,
    said: Arc<Mutex<VecDeque<String>>>,
) -> std::io::Result<(Child, std::thread::JoinHandle<()>)> {
    let params = serde_json::Value::Object(params.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect());
    let raw = sock.as_raw_fd();
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .env("PLYFS_FD", "3")
        .env("PLYFS_PARAMS", params.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(raw, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let flags = libc::fcntl(3, libc::F_GETFD);
            libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    drop(sock);
    said.lock().clear();
    let stderr = child.stderr.take().expect("piped");
    let copier = std::thread::Builder::new().name("script-stderr".into()).spawn(move || {
        use std::io::{BufRead, Write};
        for line in std::io::BufReader::new(stderr).split(b'\n').map_while(|l| l.ok()) {
            let _ = std::io::stderr().lock().write_all(&[&line[..], b"\n"].concat());
            let mut said = said.lock();
            if said.len() == SAID_LINES {
                said.pop_front();
            }
            said.push_back(String::from_utf8_lossy(&line).into_owned());
        }
    });
    match copier {
        Ok(copier) => Ok((child, copier)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

fn timeout(args: &BuildArgs) -> Result<Duration> {
    Ok(Duration::from_secs(args.params.int_in(TIMEOUT.name, 60, 1..=86_400)? as u64))
}

fn peer(args: &BuildArgs, endpoint: Endpoint, below: Option<Level>) -> Result<(Arc<Peer>, Hosted, Vec<ExtOpInfo>)> {
    let peer = Arc::new(Peer {
        name: args.name.clone(),
        endpoint,
        below,
        timeout: timeout(args)?,
        conn: RwLock::new(None),
        child: Mutex::new(None),
        said: Arc::new(Mutex::new(VecDeque::new())),
        stderr_copier: Mutex::new(None),
        last_start: Mutex::new(None),
        lost: std::sync::atomic::AtomicBool::new(false),
    });
    // The first start says why it failed; later ones, if the process dies, are logged.
    let conn = peer.start().map_err(|e| Error::config(e.to_string()))?;
    *peer.last_start.lock() = Some(Instant::now());
    *peer.conn.write() = Some(conn.clone());
    let hosted =
        conn.welcome.hosted.clone().ok_or_else(|| {
            Error::config(format!("{}: the process does not host a layer (it answered as a server)", peer.describe()))
        })?;
    let ext = conn.welcome.ext_ops.iter().map(|o| o.to_static(&o.help)).collect();
    Ok((peer, hosted, ext))
}

fn build_ext(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let socket = args.params.get(SOCKET.name).ok_or_else(|| Error::config(format!("layer '{}': socket=PATH is needed", args.name)))?;
    let endpoint = Endpoint::Socket(PathBuf::from(socket));
    let (peer, hosted, ext) = peer(&args, endpoint, Some(args.lower.clone()))?;
    if hosted.kind != "layer" {
        return Err(Error::config(format!("{}: hosts a {}, not a layer (use py:script= for codecs)", peer.describe(), hosted.kind)));
    }
    Ok(Arc::new(Ext::new(args, peer, hosted, ext)))
}

/// The interpreter with the plyfs package, as a user who installed it would expect:
/// $PLYFS_PYTHON, else the active virtual environment's (`$VIRTUAL_ENV/bin/python`, which
/// `sudo -E` keeps), else python3 from PATH.
fn default_python() -> String {
    if let Some(p) = std::env::var_os("PLYFS_PYTHON").filter(|p| !p.is_empty()) {
        return p.to_string_lossy().into_owned();
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        let python = std::path::Path::new(&venv).join("bin/python");
        if python.is_file() {
            return python.to_string_lossy().into_owned();
        }
    }
    "python3".into()
}

fn build_py(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let script = args.params.get(SCRIPT.name).ok_or_else(|| Error::config(format!("layer '{}': script=FILE is needed", args.name)))?;
    let script = std::path::absolute(script).map_err(|e| Error::config(format!("script {script}: {e}")))?;
    if !script.is_file() {
        return Err(Error::config(format!("layer '{}': script {}: no such file", args.name, script.display())));
    }
    let python = match args.params.get(PYTHON.name) {
        Some(p) => p.to_owned(),
        None => default_python(),
    };
    let own = [SCRIPT.name, PYTHON.name, TIMEOUT.name, CHUNK_PARAM.name, FAST_TAILS_PARAM.name];
    let params = args.params.all().iter().filter(|(k, _)| !own.contains(&k.as_str())).cloned().collect();
    let endpoint = Endpoint::Script { python, script, params };
    // Every chunk crosses to Python and back: a codec gets 64 KiB chunks unless told otherwise.
    let mut args = args;
    if args.params.get(CHUNK_PARAM.name).is_none() {
        let mut values = args.params.all().to_vec();
        values.push((CHUNK_PARAM.name.to_owned(), "64k".to_owned()));
        args.params = plyfs_stack::spec::Params::new(&args.name, values);
    }
    // A codec never calls below; a layer does. Which one it is, the script says once started.
    let (peer, hosted, ext) = peer(&args, endpoint, Some(args.lower.clone()))?;
    match hosted.kind.as_str() {
        "layer" => Ok(Arc::new(Ext::new(args, peer, hosted, ext))),
        "codec" => {
            let tag = hosted
                .tag
                .as_deref()
                .filter(|t| t.len() == 4)
                .ok_or_else(|| Error::config(format!("{}: a codec needs a tag of exactly 4 bytes", peer.describe())))?;
            let codec = Arc::new(RemoteCodec {
                peer,
                tag: tag[..].try_into().expect("4 bytes"),
                deterministic: hosted.deterministic.unwrap_or(true),
                compresses: hosted.compresses.unwrap_or(false),
            });
            build_sca_layer(args, "py", codec)
        }
        other => Err(Error::config(format!("{}: hosts a '{other}', which this build does not know", peer.describe()))),
    }
}

/// The mount's side of a hosted layer.
pub struct Ext {
    name: String,
    lower: [Level; 1],
    peer: Arc<Peer>,
    /// The operations the process answers; the others bypass it here.
    ops: Vec<String>,
    ext_ops: Vec<ExtOpInfo>,
    data: DataPath,
}

impl Ext {
    fn new(args: BuildArgs, peer: Arc<Peer>, hosted: Hosted, ext_ops: Vec<ExtOpInfo>) -> Ext {
        let data = match hosted.data.as_deref() {
            Some("transparent") => DataPath::Transparent,
            Some("observes") => DataPath::Observes,
            _ => DataPath::Transforms,
        };
        Ext { name: args.name, lower: [args.lower], peer, ops: hosted.ops, ext_ops, data }
    }

    fn answers(&self, op: &Op<'_>) -> bool {
        match op {
            Op::Extended { name, .. } => self.ext_ops.iter().any(|o| o.name == *name),
            other => self.ops.iter().any(|o| o == other.kind().name()),
        }
    }
}

impl Layer for Ext {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "ext"
    }

    fn data_path(&self) -> DataPath {
        self.data
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        &self.ext_ops
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        if !self.answers(op) {
            return self.lower[0].call(cx, op);
        }
        let (header, payload) = op.to_header();
        let (reply, data) = self.peer.call(cx, header.into(), payload)?;
        reply.into_result(data, op.name())
    }

    fn shutdown(&self) {
        self.peer.stop();
    }
}

/// A codec whose `encode` and `decode` run in the hosting process.
struct RemoteCodec {
    peer: Arc<Peer>,
    tag: [u8; 4],
    deterministic: bool,
    compresses: bool,
}

impl RemoteCodec {
    /// Run `op` in the process; `failed` makes the error (an encoding's or a decoding's) from
    /// what went wrong.
    fn run(&self, op: CodecOp, input: &[u8], out: &mut Vec<u8>, failed: fn(String) -> CodecError) -> std::result::Result<(), CodecError> {
        let op = RequestOp::from(op);
        let fail = |why: &dyn std::fmt::Display| failed(format!("{}: {why}", self.peer.describe()));
        match self.peer.call(&Caller::daemon(), op, input) {
            Ok((WireReply::Data, data)) => {
                out.extend_from_slice(&data);
                Ok(())
            }
            Ok((WireReply::Error(e), _)) => Err(fail(&e.msg)),
            Ok(_) => Err(fail(&"the codec answered with something else than data")),
            Err(e) => Err(fail(&e)),
        }
    }
}

impl Codec for RemoteCodec {
    fn tag(&self) -> [u8; 4] {
        self.tag
    }

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        self.run(CodecOp::Encode { chunk: 0 }, chunk, out, CodecError::encode)
    }

    fn decode(&self, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        let before = out.len();
        self.run(CodecOp::Decode { chunk: 0, decoded_len: decoded_len as u64 }, encoded, out, CodecError::decode)?;
        if out.len() - before != decoded_len {
            return Err(CodecError::DecodedLength { got: out.len() - before, expected: decoded_len });
        }
        Ok(())
    }

    fn deterministic(&self) -> bool {
        self.deterministic
    }

    fn store_raw_if_larger(&self) -> bool {
        self.compresses
    }
}
