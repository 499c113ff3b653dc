//! `plyfs exodisk`: format, check and serve exodisk volumes.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use plyfs_exodisk::layout;

#[derive(Args)]
pub struct ExodiskArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Format an image file (made if missing) or a block device as a volume, with a new key.
    Format {
        volume: PathBuf,
        /// The volume's size (e.g. 256M, 4G); the whole file or device when not given.
        #[arg(long, value_parser = size, value_name = "SIZE")]
        size: Option<u64>,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Check every invariant of a volume (read only); exit status 0 when they all hold.
    Fsck {
        volume: PathBuf,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Serve a volume on a Unix socket: the only process that opens it. In the foreground
    /// unless --daemon. The socket is open to every local user (protection is by capability):
    /// the limits below keep one user from exhausting the service.
    Serve {
        volume: PathBuf,
        #[arg(long, value_name = "PATH")]
        socket: PathBuf,
        #[command(flatten)]
        key: KeyArg,
        /// Detach once it serves; its log goes to --log (VOLUME.log by default).
        #[arg(long)]
        daemon: bool,
        #[arg(long, value_name = "FILE")]
        log: Option<PathBuf>,
        /// Record every write and flush made to the volume in a new file (mode 0600), for
        /// `plyfs exodisk replay` on a copy of the volume taken before. It holds the volume's
        /// (sealed) bytes and grows with every write: for tests and debugging.
        #[arg(long, value_name = "LOG")]
        record: Option<PathBuf>,
        #[command(flatten)]
        limits: crate::serve::LimitArgs,
    },
    /// Build on VOLUME, a copy of a volume taken before `serve --record LOG` started, the
    /// volume as it was on the disk at a flush of that log (the last by default): what a power
    /// cut just after it would have left. Without VOLUME, count the log's writes and flushes.
    Replay {
        log: PathBuf,
        volume: Option<PathBuf>,
        /// The flush to stop at (1 for the first; 0 for the state before any write).
        #[arg(long, value_name = "N")]
        to_flush: Option<u64>,
        /// Also some of the writes after that flush and before the next, drawn from SEED: a
        /// disk may take any of them, in any order, before the power goes.
        #[arg(long, value_name = "SEED")]
        unflushed: Option<u64>,
    },
    /// The volume behind a service: size, space, and the disk queue.
    Stat { socket: PathBuf },
    /// Stop the service listening on SOCKET, as SIGTERM would: it finishes the disk queue and
    /// writes back what is dirty. Only the service's user and root may.
    Stop { socket: PathBuf },
    /// Run one group of the thesis's micro-benchmarks against the service (lines of
    /// `group,config,metric,value`; `bench/bench exodisk` runs them all).
    Bench {
        socket: PathBuf,
        /// small, large, two, insert, ddio or persist.
        group: String,
        /// Files (small, two, persist).
        #[arg(long, default_value_t = 1000, value_name = "N")]
        files: usize,
        /// Bytes per file (small, two, persist), or of the one file (large).
        #[arg(long, value_parser = size, default_value = "10000", value_name = "BYTES")]
        size: u64,
    },
    /// Allocate an extent (or, with --exonode, an exonode) and print its capabilities.
    Alloc {
        socket: PathBuf,
        /// Sectors (512 bytes; an extent's first holds its header).
        #[arg(long, value_name = "N")]
        sectors: u64,
        /// Where (a free sector); the first free run large enough by default.
        #[arg(long, value_name = "SECTOR")]
        at: Option<u64>,
        #[arg(long)]
        exonode: bool,
        /// memory, metadata or data.
        #[arg(long, default_value = "metadata", value_name = "KIND")]
        persistence: String,
    },
    /// Deallocate the extent (or --exonode) at AT, given its write capability.
    Free {
        socket: PathBuf,
        at: u64,
        #[arg(long, value_name = "HEX")]
        wcap: String,
        #[arg(long)]
        exonode: bool,
    },
    /// List the entries of an exonode: your named root (--root NAME), or the one at --at with
    /// --rcap.
    Ls {
        socket: PathBuf,
        #[arg(long, value_name = "NAME")]
        root: Option<String>,
        #[arg(long, value_name = "SECTOR")]
        at: Option<u64>,
        #[arg(long, value_name = "HEX")]
        rcap: Option<String>,
    },
}

#[derive(Args)]
struct KeyArg {
    /// The volume's key file (VOLUME.key by default). It seals the volume's metadata: keep it
    /// apart from copies of the volume.
    #[arg(long, value_name = "FILE")]
    key: Option<PathBuf>,
}

impl KeyArg {
    fn path(&self, volume: &Path) -> PathBuf {
        self.key.clone().unwrap_or_else(|| layout::default_key_path(volume))
    }
}

fn size(s: &str) -> Result<u64, String> {
    plyfs_stack::glob::parse_size(s).ok_or_else(|| format!("'{s}': expected a size such as 256M or 4G"))
}

pub fn run(args: ExodiskArgs) -> Result<(), String> {
    match args.action {
        Action::Format { volume, size, key } => {
            let key_path = key.path(&volume);
            let f = layout::format(&volume, size, &key_path)?;
            if let Some(w) = &f.warning {
                eprintln!("{w}");
            }
            let sb = &f.superblock;
            println!(
                "{}: an exodisk volume of {} sectors ({} MiB); {} sectors for extents and exonodes from sector {}; key in {}",
                volume.display(),
                sb.sectors,
                (sb.sectors * 512) >> 20,
                sb.sectors - sb.data_start,
                sb.data_start,
                key_path.display()
            );
            Ok(())
        }
        Action::Fsck { volume, key } => fsck(&volume, &key.path(&volume)),
        Action::Serve { volume, socket, key, daemon, log, record, limits } => {
            if daemon {
                detach(&volume, &socket, &key.path(&volume), log, record.as_deref(), &limits)
            } else {
                serve(&volume, &socket, &key.path(&volume), record, &limits)
            }
        }
        Action::Replay { log, volume, to_flush, unflushed } => replay(&log, volume.as_deref(), to_flush, unflushed),
        Action::Bench { socket, group, files, size } => {
            for s in plyfs_exofs::bench::run(&socket, &group, files, size as usize)? {
                println!("{},{},{},{:.4}", s.group, s.config, s.metric, s.value);
            }
            Ok(())
        }
        Action::Stat { socket } => {
            quiet_pipe();
            stat(&socket)
        }
        Action::Stop { socket } => stop(&socket),
        Action::Alloc { socket, sectors, at, exonode, persistence } => alloc(&socket, sectors, at, exonode, &persistence),
        Action::Free { socket, at, wcap, exonode } => {
            let c = connect(&socket)?;
            let w = hex_cap(&wcap)?;
            let r = if exonode { c.exonode_deallocate(&Target::Exonode { at, path: vec![] }, w) } else { c.extent_deallocate(at, w) };
            r.map_err(|e| format!("{}: {e}", socket.display()))?;
            println!("freed the {} at {at}", if exonode { "exonode" } else { "extent" });
            Ok(())
        }
        Action::Ls { socket, root, at, rcap } => {
            quiet_pipe();
            ls(&socket, root, at, rcap)
        }
    }
}

use plyfs_exodisk::client::Client;
use plyfs_exodisk::core::{Persistence, Target};
use plyfs_exodisk::object::Caps;
use plyfs_exodisk::proto::WEntry;

fn connect(socket: &Path) -> Result<Client, String> {
    Ok(Client::connect(socket, 1 << 20)?)
}

fn hex_cap(s: &str) -> Result<u128, String> {
    u128::from_str_radix(s.trim_start_matches("0x"), 16).map_err(|_| format!("'{s}': expected a capability in hex"))
}

fn serve(volume: &Path, socket: &Path, key: &Path, record: Option<PathBuf>, limits: &crate::serve::LimitArgs) -> Result<(), String> {
    let signals = plyfs_assemble::mount::block_signals();
    crate::daemon::init_logging(0);
    if let Some(w) = layout::exposure_warning(volume) {
        tracing::warn!("{w}");
    }
    let options = plyfs_exodisk::service::ServiceOptions {
        handshake_timeout: limits.handshake_timeout,
        limits: limits.connections(),
        unread_bytes: limits.in_flight as usize,
        record,
        ..Default::default()
    };
    let (service, started) = plyfs_exodisk::service::start_with(volume, key, socket, options)?;
    let r = &started.report;
    tracing::info!(
        "{}: {} extents, {} exonodes; start-up scan gave back {} sectors and {} orphaned exonodes",
        volume.display(),
        r.extents,
        r.exonodes,
        r.reclaimed,
        r.orphans.len()
    );
    let stopper = service.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Ok(sig) = signals.wait() {
                tracing::info!("{sig}: stopping");
            }
            stopper.stop();
        })
        .map_err(|e| e.to_string())?;
    tracing::info!("serving {} on {}", volume.display(), socket.display());
    service.serve()?;
    tracing::info!("stopped; {} is consistent", volume.display());
    Ok(())
}

/// Start the service in the background and return once it listens (or say why it did not).
fn detach(
    volume: &Path,
    socket: &Path,
    key: &Path,
    log: Option<PathBuf>,
    record: Option<&Path>,
    limits: &crate::serve::LimitArgs,
) -> Result<(), String> {
    let log = log.unwrap_or_else(|| {
        let mut p = volume.as_os_str().to_owned();
        p.push(".log");
        PathBuf::from(p)
    });
    let out = plyfs_stack::private::open_log(&log).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = {
        use std::os::unix::process::CommandExt;
        std::process::Command::new(exe)
            .args(["exodisk", "serve"])
            .arg(volume)
            .arg("--socket")
            .arg(socket)
            .arg("--key")
            .arg(key)
            .args(record.map(|r| [std::ffi::OsStr::new("--record"), r.as_os_str()]).into_iter().flatten())
            .args(limits.to_args())
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone().map_err(|e| e.to_string())?)
            .stderr(out)
            .process_group(0)
            .spawn()
            .map_err(|e| e.to_string())?
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").to_owned();
            return Err(format!("the service exited ({status}): {last}"));
        }
        if UnixStream::connect(socket).is_ok() {
            println!("serving {} on {} (pid {}); log: {}", volume.display(), socket.display(), child.id(), log.display());
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(format!("the service did not listen on {} within 120 s (see {})", socket.display(), log.display()));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

use std::os::unix::net::UnixStream;

fn stat(socket: &Path) -> Result<(), String> {
    let c = connect(socket)?;
    let e = |e: plyfs_exodisk::core::ExoError| format!("{}: {e}", socket.display());
    let map = c.free_map().map_err(e)?;
    let (pending, queue) = c.poll().map_err(e)?;
    let used = map.allocated();
    println!("sectors:   {} ({} MiB), objects from sector {}", c.sectors, (c.sectors * 512) >> 20, c.data_start);
    println!("allocated: {used} sectors ({:.1}%)", used as f64 * 100.0 / c.sectors as f64);
    println!("free:      {} sectors", c.sectors - used);
    println!("queue:     {pending} pending, {} waiting", queue.len());
    Ok(())
}

/// `exodisk stop`: ask the service to stop, then wait until its socket is gone (it removes it
/// once the volume is written back), so that the volume is free when this returns.
fn stop(socket: &Path) -> Result<(), String> {
    let shown = socket.display();
    if let Err(e) = UnixStream::connect(socket) {
        return Err(format!("{shown}: no exodisk service listens there ({e})"));
    }
    let c = connect(socket)?;
    c.shutdown().map_err(|e| format!("{shown}: {e}"))?;
    drop(c);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while UnixStream::connect(socket).is_ok() || socket.exists() {
        if std::time::Instant::now() > deadline {
            return Err(format!("{shown}: the service was asked to stop and still runs after 60 s"));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    println!("stopped the service on {shown}");
    Ok(())
}

fn alloc(socket: &Path, sectors: u64, at: Option<u64>, exonode: bool, persistence: &str) -> Result<(), String> {
    let p = match persistence {
        "memory" => Persistence::Memory,
        "metadata" => Persistence::Metadata,
        "data" => Persistence::Data,
        _ => return Err(format!("--persistence {persistence}: expected memory, metadata or data")),
    };
    let c = connect(socket)?;
    let e = |e: plyfs_exodisk::core::ExoError| format!("{}: {e}", socket.display());
    let at = match at {
        Some(a) => a,
        None => c
            .free_map()
            .map_err(e)?
            .find_free(sectors, c.data_start)
            .ok_or_else(|| format!("{}: no {sectors} free sectors in a row", socket.display()))?,
    };
    let caps = Caps::random();
    if exonode {
        c.exonode_allocate(at, sectors as u32, caps, p).map_err(e)?;
    } else {
        c.extent_allocate(at, sectors, caps, p).map_err(e)?;
    }
    println!(
        "{} at {at}: {sectors} sectors; rcap {:032x} wcap {:032x}",
        if exonode { "exonode" } else { "extent" },
        caps.read,
        caps.write
    );
    Ok(())
}

fn ls(socket: &Path, root: Option<String>, at: Option<u64>, rcap: Option<String>) -> Result<(), String> {
    let c = connect(socket)?;
    let e = |e: plyfs_exodisk::core::ExoError| format!("{}: {e}", socket.display());
    let (at, r) = match (root, at, rcap) {
        (Some(name), None, None) => {
            let (at, caps) = c.root(&name).map_err(e)?;
            println!("root '{name}': exonode at {at}; rcap {:032x} wcap {:032x}", caps.read, caps.write);
            (at, caps.read)
        }
        (None, Some(at), Some(r)) => (at, hex_cap(&r)?),
        _ => return Err("give --root NAME, or --at SECTOR with --rcap HEX".into()),
    };
    let x = c.map(&Target::Exonode { at, path: vec![] }, r).map_err(e)?;
    println!("exonode at {at}: {} sectors, parent {}, {} entries", x.sectors, x.parent, x.entries.len());
    for (i, entry) in x.entries.iter().enumerate() {
        match entry {
            WEntry::Empty => println!("  {i:4}  (empty)"),
            WEntry::Extent { start, sectors } => println!("  {i:4}  extent {start}..{} ({sectors} sectors)", start + sectors),
            WEntry::Descendant { at } => println!("  {i:4}  descendant exonode at {at}"),
            WEntry::Data(d) => println!("  {i:4}  data, {} bytes", d.len()),
        }
    }
    Ok(())
}

fn fsck(volume: &Path, key_path: &Path) -> Result<(), String> {
    let (disk, key, sb) = layout::open(volume, key_path)?;
    let started = std::time::Instant::now();
    let (_, report, _) = plyfs_exodisk::scan::scan(&disk, &key, &sb).map_err(|e| format!("{}: {e}", volume.display()))?;
    println!(
        "{}: {} extents, {} exonodes, {} of {} sectors owned; {} allocated sectors owned by nothing (a crash leaves these; the service gives them back); scanned in {:.2} s",
        volume.display(),
        report.extents,
        report.exonodes,
        report.owned,
        sb.sectors,
        report.reclaimed,
        started.elapsed().as_secs_f64()
    );
    if !report.dangling.is_empty() || !report.orphans.is_empty() {
        println!(
            "  {} orphaned exonodes and {} entries naming removed exonodes (interrupted creations and removals): the service gives them back",
            report.orphans.len(),
            report.dangling.len()
        );
    }
    for p in &report.problems {
        println!("  problem: {p}");
    }
    if report.clean() {
        println!("{}: every invariant holds", volume.display());
        Ok(())
    } else {
        let n = report.problems.len();
        Err(format!("{}: {n} problem{} (listed above)", volume.display(), if n == 1 { "" } else { "s" }))
    }
}

fn replay(log: &Path, volume: Option<&Path>, to_flush: Option<u64>, unflushed: Option<u64>) -> Result<(), String> {
    use plyfs_exodisk::record;
    let Some(volume) = volume else {
        let l = record::Log::read(log)?;
        let writes = l.entries.len() as u64 - l.flushes();
        println!("{}: {writes} writes and {} flushes to a volume of {} sectors", log.display(), l.flushes(), l.volume_sectors);
        return Ok(());
    };
    let done = record::replay(log, volume, to_flush, unflushed)?;
    println!("{}: {} writes replayed from {}, up to flush {}", volume.display(), done.writes, log.display(), done.flushes);
    Ok(())
}

/// A report piped into `head` ends quietly when the reader goes, as other tools' do (Rust
/// ignores SIGPIPE, so a write would fail and `println!` panic instead).
fn quiet_pipe() {
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}
