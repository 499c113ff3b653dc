//! `trace`: a monitoring layer (class 1 of `seeds/002` §3). It records every operation that
//! crosses it — name, arguments, result, latency — to a JSON-lines file, and keeps per-operation
//! counts and latency statistics, answered by the `stats` extended operation.
//!
//! It changes nothing, so by default it leaves the passthrough fast path on: reads and writes of
//! open files then go from the kernel to the lower file and are not seen here. `io=on` makes
//! the layer observe data, which keeps every read and write on the traced path.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use plyfs_stack::spec::ParamSpec;
use plyfs_stack::{Build, 
    Arg, BuildArgs, Caller, DataPath, Error, ExtOpInfo, Layer, LayerFactory, Level, Op, OpKind, Reply, Result,
};
use serde_json::{json, Map, Value};

const BUCKETS: usize = 32;

/// Counters for one kind of operation. Latencies are kept in power-of-two microsecond buckets,
/// enough for percentiles within a factor of two at no locking cost.
#[derive(Default)]
struct OpStats {
    count: AtomicU64,
    errors: AtomicU64,
    total_ns: AtomicU64,
    max_ns: AtomicU64,
    buckets: [AtomicU64; BUCKETS],
}

impl OpStats {
    fn record(&self, ns: u64, failed: bool) {
        self.count.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.total_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
        self.buckets[bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
    }

    fn reset(&self) {
        for c in [&self.count, &self.errors, &self.total_ns, &self.max_ns].into_iter().chain(&self.buckets) {
            c.store(0, Ordering::Relaxed);
        }
    }

    fn report(&self) -> Option<Value> {
        let count = self.count.load(Ordering::Relaxed);
        if count == 0 {
            return None;
        }
        let buckets: Vec<u64> = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let total = self.total_ns.load(Ordering::Relaxed);
        Some(json!({
            "count": count,
            "errors": self.errors.load(Ordering::Relaxed),
            "mean_us": total as f64 / count as f64 / 1000.0,
            "p50_us": percentile_us(&buckets, count, 0.50),
            "p99_us": percentile_us(&buckets, count, 0.99),
            "max_us": self.max_ns.load(Ordering::Relaxed) as f64 / 1000.0,
            // [below this many µs, how many], from the first bucket used to the last.
            "histogram_us": histogram(&buckets),
        }))
    }
}

/// Bucket `i` holds latencies below `2^i` microseconds (bucket 0: under 1 µs).
fn bucket_of(ns: u64) -> usize {
    let us = ns / 1000;
    ((u64::BITS - us.leading_zeros()) as usize).min(BUCKETS - 1)
}

/// The buckets from the first used to the last used, as `[upper bound in µs, count]` pairs.
fn histogram(buckets: &[u64]) -> Vec<[u64; 2]> {
    let first = buckets.iter().position(|n| *n > 0).unwrap_or(0);
    let last = buckets.iter().rposition(|n| *n > 0).unwrap_or(0);
    (first..=last).map(|i| [1u64 << i, buckets[i]]).collect()
}

/// The upper bound, in microseconds, of the bucket holding the `q` quantile.
fn percentile_us(buckets: &[u64], count: u64, q: f64) -> u64 {
    let rank = ((count as f64) * q).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, n) in buckets.iter().enumerate() {
        seen += n;
        if seen >= rank {
            return 1 << i;
        }
    }
    1 << (buckets.len() - 1)
}

/// Writes log lines on its own thread so that operations never wait for the disk.
struct LogWriter {
    sender: Mutex<Option<Sender<String>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl LogWriter {
    fn start(path: PathBuf, file: File) -> LogWriter {
        let (tx, rx) = mpsc::channel::<String>();
        let thread = std::thread::Builder::new()
            .name("trace-log".into())
            .spawn(move || {
                let mut out = BufWriter::with_capacity(1 << 16, file);
                loop {
                    let line = match rx.recv_timeout(Duration::from_millis(200)) {
                        Ok(line) => line,
                        Err(RecvTimeoutError::Timeout) => {
                            let _ = out.flush();
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => break,
                    };
                    if let Err(e) = out.write_all(line.as_bytes()) {
                        tracing::error!("trace log {}: {e}; tracing to the file stops", path.display());
                        return;
                    }
                }
                if let Err(e) = out.flush() {
                    tracing::error!("trace log {}: {e}", path.display());
                }
            })
            .expect("spawn trace log thread");
        LogWriter { sender: Mutex::new(Some(tx)), thread: Mutex::new(Some(thread)) }
    }

    fn send(&self, line: String) {
        if let Some(tx) = &*self.sender.lock() {
            let _ = tx.send(line);
        }
    }

    fn stop(&self) {
        self.sender.lock().take();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

pub struct Trace {
    name: String,
    lower: [Level; 1],
    observe_io: bool,
    stats: Vec<OpStats>,
    started: Instant,
    log: Option<LogWriter>,
    log_path: Option<PathBuf>,
}

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo {
        name: "stats",
        args: "[--histogram]",
        help: "per-operation counts, errors and latency (mean, p50, p99, max, histogram); drawn as bars on a terminal or with --histogram",
    },
    ExtOpInfo { name: "stats-reset", args: "", help: "zero the statistics" },
];

fn arg_json(arg: &Arg<'_>) -> Value {
    match arg {
        Arg::U64(v) => json!(v),
        Arg::I64(v) => json!(v),
        Arg::Bool(v) => json!(v),
        Arg::Str(s) => json!(s),
        Arg::Bytes(n) => json!({ "bytes": n }),
        Arg::Strs(v) => json!(v),
    }
}

fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EIO => "EIO",
        libc::EBADF => "EBADF",
        libc::EACCES => "EACCES",
        libc::EEXIST => "EEXIST",
        libc::EXDEV => "EXDEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::ENOSPC => "ENOSPC",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ENOSYS => "ENOSYS",
        libc::ENODATA => "ENODATA",
        libc::ERANGE => "ERANGE",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::ELOOP => "ELOOP",
        libc::ESTALE => "ESTALE",
        libc::ENXIO => "ENXIO",
        libc::EMLINK => "EMLINK",
        _ => return format!("errno {errno}"),
    };
    name.to_owned()
}

impl Trace {
    fn stats_of(&self, kind: OpKind) -> &OpStats {
        &self.stats[OpKind::ALL.iter().position(|k| *k == kind).expect("every kind is in ALL")]
    }

    fn report(&self) -> Value {
        let mut ops = Map::new();
        for (kind, stats) in OpKind::ALL.iter().zip(&self.stats) {
            if let Some(r) = stats.report() {
                ops.insert(kind.name().to_owned(), r);
            }
        }
        json!({
            "layer": self.name,
            "uptime_s": self.started.elapsed().as_secs_f64(),
            "io_observed": self.observe_io,
            "log": self.log_path.as_ref().map(|p| p.display().to_string()),
            "ops": ops,
        })
    }

    fn log_line(&self, cx: &Caller, op: &Op<'_>, result: &Result<Reply>, ns: u64) -> String {
        let args: Map<String, Value> = op.args().iter().map(|(k, v)| ((*k).to_owned(), arg_json(v))).collect();
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        let (outcome, reply) = match result {
            Ok(r) => ("ok".to_owned(), Value::String(r.summary())),
            Err(e) => (errno_name(e.errno()), Value::Null),
        };
        let mut line = json!({
            "ts": ts,
            "op": op.name(),
            "args": args,
            "result": outcome,
            "reply": reply,
            "us": ns as f64 / 1000.0,
            "uid": cx.uid,
            "pid": cx.pid,
        })
        .to_string();
        line.push('\n');
        line
    }
}

impl Layer for Trace {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "trace"
    }

    fn data_path(&self) -> DataPath {
        if self.observe_io { DataPath::Observes } else { DataPath::Transparent }
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        match op {
            Op::Extended { name: "stats", .. } => return Ok(Reply::Extended(self.report())),
            Op::Extended { name: "stats-reset", .. } => {
                self.stats.iter().for_each(OpStats::reset);
                return Ok(Reply::Extended(json!({ "reset": true })));
            }
            _ => {}
        }
        let kind = op.kind();
        let start = Instant::now();
        let result = self.lower[0].call(cx, op);
        let ns = start.elapsed().as_nanos() as u64;
        self.stats_of(kind).record(ns, result.is_err());
        if let Some(log) = &self.log {
            log.send(self.log_line(cx, op, &result, ns));
        }
        result
    }

    fn shutdown(&self) {
        if let Some(log) = &self.log {
            log.stop();
        }
    }
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let observe_io = args.params.flag("io", false)?;
    let (log, log_path) = match args.params.get("log") {
        None | Some("") => (None, None),
        Some(path) => {
            let path = std::path::absolute(path)
                .map_err(|e| Error::config(format!("layer '{}': log '{path}': {e}", args.name)))?;
            // 0600 whatever the daemon's umask, never through a symbolic link: the log holds
            // the names a crypt layer below hides, and is an audit trail others must not forge.
            let file = plyfs_stack::private::open_log(&path)
                .map_err(|e| Error::config(format!("layer '{}': cannot open {e}", args.name)))?;
            (Some(LogWriter::start(path.clone(), file)), Some(path))
        }
    };
    Ok(Arc::new(Trace {
        name: args.name,
        lower: [args.lower],
        observe_io,
        stats: OpKind::ALL.iter().map(|_| OpStats::default()).collect(),
        started: Instant::now(),
        log,
        log_path,
    }))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "trace",
    summary: "monitoring: logs every operation (arguments, result, latency) and keeps statistics",
    params: &[
        ParamSpec { name: "log", help: "JSON-lines file to append one record per operation to", default: None },
        ParamSpec {
            name: "io",
            help: "on: see every read and write (turns the passthrough fast path off)",
            default: Some("off"),
        },
    ],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};
