//! `plyfs mount`: build the stack, mount it, and serve it — in the foreground, or in a
//! background daemon that reports back once the mount is ready.
//!
//! Going to the background re-executes the program with `--foreground` in a new session rather
//! than forking: the stack and FUSE start threads, and a forked copy of a threaded process is
//! not safe to continue. The child reports "ready" or its error over a pipe, so the parent's
//! exit status and message are the mount's.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use clap::Args;
use plyfs_fuse::control::{self, ControlServer};
use plyfs_fuse::{unmount, FrontOptions, MountRequest, Mounted, Transport, Unmounted, UringChoice};
use plyfs_stack::spec::{load_stack_config, parse_stack_spec};
use plyfs_assemble::dirs::{existing_dir, storage_dirs};
use plyfs_stack::LowerDir;

use crate::options;

#[derive(Args, Clone)]
pub struct MountArgs {
    /// The directory whose contents the stack presents, or a stack served elsewhere: unix:PATH,
    /// tcp:HOST:PORT (or - when the stack ends in remote:addr=...).
    lower: PathBuf,
    /// Where to mount.
    mountpoint: PathBuf,
    #[command(flatten)]
    tree: StackArgs,
    /// Stay in the foreground and log to standard error.
    #[arg(short, long)]
    foreground: bool,
    /// Mount options.
    #[arg(short = 'o', value_name = "OPTIONS", help = options::HELP)]
    options: Vec<String>,
    /// Where a background daemon logs (default: next to its control socket); made 0600, and
    /// refused if it is a symbolic link or another user's file.
    #[arg(long)]
    log: Option<PathBuf>,
    /// Log more (debug); repeat for every request (trace).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Print nothing when the mount succeeds, as mount helpers do (warnings and errors still go
    /// to standard error).
    #[arg(short, long)]
    quiet: bool,
    /// Internal: the pipe to report readiness on.
    #[arg(long, hide = true)]
    ready_fd: Option<i32>,
    /// Internal: the pipe the parent hands an unlocked volume's master key over on.
    #[arg(long, hide = true)]
    key_fd: Option<i32>,
    /// The pre-shared key file of a `tcp:` server (at least 32 bytes, the same as the server's;
    /// mode 0600 and yours, or it is refused).
    #[arg(long, value_name = "FILE")]
    psk: Option<PathBuf>,
    /// The password or key file of a crypt volume.
    #[command(flatten)]
    secret: crate::secret::SecretArgs,
    /// Show LOWER, a plaintext tree, as a read-only crypt volume (set up with `plyfs init LOWER
    /// --reverse`), for encrypted backups; copied anywhere, the view mounts with --stack crypt.
    #[arg(long, conflicts_with_all = ["stack", "config", "branches", "rules", "psk"])]
    reverse: bool,
    /// With --reverse: leave out what GLOB matches (a plaintext path relative to LOWER; without
    /// a slash, a name at any depth). Repeatable.
    #[arg(long, value_name = "GLOB", requires = "reverse")]
    exclude: Vec<String>,
    /// With --reverse: leave out the globs listed in FILE, one per line (# starts a comment).
    #[arg(long, value_name = "FILE", requires = "reverse")]
    exclude_from: Option<PathBuf>,
}

impl MountArgs {
    /// The exclusions of a reverse view: --exclude, then the lines of --exclude-from.
    fn excludes(&self) -> Result<Vec<String>, String> {
        let mut all = self.exclude.clone();
        if let Some(path) = &self.exclude_from {
            let text = std::fs::read_to_string(path).map_err(|e| format!("--exclude-from {}: {e}", path.display()))?;
            all.extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_owned));
        }
        for g in &all {
            plyfs_stack::glob::Glob::new(g).map_err(|e| format!("--exclude {g}: {e}"))?;
        }
        Ok(all)
    }
}

/// The stack a command builds over LOWER, as `mount` and `serve` take it.
#[derive(Args, Clone)]
pub struct StackArgs {
    /// Layers from the top down, e.g. `trace:log=t.jsonl,null`.
    #[arg(long, conflicts_with = "config")]
    pub stack: Option<String>,
    /// A TOML file describing the stack ([[layer]] tables).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A further branch for the stack's first fan-out layer (union, mirror), which takes LOWER
    /// as its first branch and these after it, in order: DIR, DIR=rw (the default) or DIR=ro.
    #[arg(long = "branch", value_name = "DIR[=ro|rw]")]
    pub branches: Vec<String>,
    /// A TOML file of rules choosing the data layers of files by path, extension and size
    /// ([[rule]] tables); file and directory attributes (user.plyfs.layers) take precedence.
    #[arg(long)]
    pub rules: Option<PathBuf>,
}

impl StackArgs {
    /// The layer specifications: `--config`, `--stack`, or `null`.
    pub fn specs(&self) -> Result<Vec<plyfs_stack::spec::LayerSpec>, String> {
        match (&self.stack, &self.config) {
            (_, Some(config)) => load_stack_config(config).map_err(|e| e.to_string()),
            (Some(spec), None) => parse_stack_spec(spec).map_err(|e| e.to_string()),
            (None, None) => parse_stack_spec("null").map_err(|e| e.to_string()),
        }
    }
}

pub fn mount(args: MountArgs) -> Result<(), String> {
    if args.reverse {
        return mount_reverse(args);
    }
    // Check what can be checked before going to the background, so mistakes are reported here.
    let mut specs = args.tree.specs()?;
    let opts = options::parse(&args.options)?;
    // (A foreground mount logs them as it builds the stack.)
    if !args.foreground {
        for w in plyfs_stack::order_warnings(&specs, plyfs_assemble::registry()) {
            eprintln!("plyfs: warning: {w}");
        }
    }
    let lower = plyfs_assemble::lower::Lower::parse(&args.lower, &mut specs, args.psk.as_deref())?;
    let dirs = match lower.dir() {
        Some(dir) => storage_dirs(dir, &args.tree.branches, &specs),
        None => Vec::new(),
    };
    plyfs_assemble::nesting::check_storage_apart(&dirs, &args.mountpoint)?;
    let mountpoint = plyfs_fuse::check_mountpoint(&args.mountpoint).map_err(|e| e.to_string())?;
    // A lower in use is reported here; the mount's daemon takes the locks for its life.
    if args.ready_fd.is_none() {
        lock_lowers(&args.tree, &specs, &opts, &lower, &mountpoint)?;
    }
    // Unlock the crypt volumes here (LOWER, and any branch that is one), so that a wrong
    // password is reported before anything starts (and rules naming crypt can be checked).
    // A remote stack's volumes are the server's to unlock.
    // A crypt volume served as stored is unlocked here, with its configuration read through
    // the server.
    let remote_volume: Vec<_> = lower.remote_volume(&specs)?.into_iter().collect();
    let volumes = match args.key_fd {
        Some(fd) if remote_volume.is_empty() => {
            crate::secret::register_keys_from_fd(&dirs, fd)?;
            Vec::new()
        }
        Some(fd) => {
            crate::secret::register_configs_from_fd(&remote_volume, fd)?;
            Vec::new()
        }
        None if remote_volume.is_empty() => crate::secret::unlock_volumes(&dirs, &args.secret)?,
        None => crate::secret::unlock_configs(&remote_volume, &args.secret)?,
    };
    if args.foreground {
        return serve(&args, specs, opts, lower, mountpoint);
    }
    spawn_background(&args, &mountpoint, volumes)
}

/// The lower locks of a mount of `lower` at `mountpoint` (none for a remote stack: its server
/// holds them).
fn lock_lowers(
    tree: &StackArgs,
    specs: &[plyfs_stack::spec::LayerSpec],
    opts: &options::MountOptions,
    lower: &plyfs_assemble::lower::Lower,
    mountpoint: &Path,
) -> Result<Vec<plyfs_stack::lowerlock::LowerLock>, String> {
    let Some(dir) = lower.dir() else { return Ok(Vec::new()) };
    let how = plyfs_assemble::locks::Use::Mount { shared: opts.shared, read_only: opts.read_only };
    plyfs_assemble::locks::take_all(dir, &tree.branches, specs, how, &format!("mounted at {}", mountpoint.display()))
}

pub(crate) fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    // fuser::reply only reports replies to requests the caller had already interrupted.
    let filter = tracing_subscriber::EnvFilter::try_from_env("PLYFS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{default},fuser=warn,fuser::reply=off")));
    // A log that cannot be written (its file system full) loses lines; it must not stop the
    // daemon, as tracing's own complaint on standard error (the same full file) would by
    // panicking (xfstests, with a disk filled by another test, found it).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .log_internal_errors(false)
        .try_init();
}

/// Block the termination signals in this thread before any other thread starts, so they all
/// inherit the mask and only the signal thread receives them.
pub(crate) fn block_signals() -> nix::sys::signal::SigSet {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        set.add(s);
    }
    let _ = set.thread_block();
    set
}

struct Ready(Option<File>);

impl Ready {
    fn send(&mut self, line: &str) {
        if let Some(mut f) = self.0.take() {
            let _ = writeln!(f, "{line}");
        }
    }

    /// A line for the user, which the mounting process prints before its own.
    fn note(&mut self, line: &str) {
        tracing::warn!("{line}");
        if let Some(f) = &mut self.0 {
            let _ = writeln!(f, "NOTE {line}");
        }
    }
}

/// What a user sharing `dir` must know about the file system it lives on, if anything.
///
/// A GlusterFS client keeps the content of small files (`quick-read`) and attributes
/// (`stat-prefetch`) for a second whatever locks say, so a mount on another client may update
/// a file from a stale copy and lose another mount's writes.
///
/// An NFS client mounted with `nolock` or `local_lock=all|posix` keeps locks to itself, so
/// mounts on other machines do not wait for them.
fn shared_lower_caveat(dir: &Path) -> Option<String> {
    caveat_for(&plyfs_fuse::mountinfo::mount_containing(dir)?)
}

fn caveat_for(m: &plyfs_fuse::mountinfo::MountEntry) -> Option<String> {
    if m.fstype == "fuse.glusterfs" {
        return Some(format!(
            "-o shared over GlusterFS ({}): mounts on other clients see each other's changes only if the volume does not cache \
             file contents and attributes on clients: `gluster volume set VOLUME performance.quick-read off` and \
             `... performance.stat-prefetch off` (and `... cluster.post-op-delay-secs 0`, or every hand-over of a file between \
             clients waits a second)",
            m.source
        ));
    }
    let local_locks = m.super_options.iter().find(|o| *o == "nolock" || *o == "local_lock=all" || *o == "local_lock=posix");
    match (m.fstype.as_str(), local_locks) {
        ("nfs" | "nfs4", Some(option)) => Some(format!(
            "-o shared over NFS mounted with {option} ({}): locks stay on this machine, so mounts on other machines do not wait \
             for them and may lose each other's writes; mount the export without it to share it between machines",
            m.source
        )),
        _ => None,
    }
}

/// A regular file of the lower directory to try passthrough with: one at its top, or else an
/// unnamed one made for the purpose (`O_TMPFILE`, gone when closed).
fn probe_file(dir: &Path) -> Option<File> {
    let found = std::fs::read_dir(dir).ok()?.take(256).flatten().find(|e| e.file_type().is_ok_and(|t| t.is_file()));
    if let Some(f) = found.and_then(|e| File::open(e.path()).ok()) {
        return Some(f);
    }
    std::os::unix::fs::OpenOptionsExt::custom_flags(std::fs::OpenOptions::new().read(true).write(true), libc::O_TMPFILE).open(dir).ok()
}

/// `mount --reverse`: the encrypted view of a plaintext tree, always read-only.
fn mount_reverse(args: MountArgs) -> Result<(), String> {
    let mut opts = options::parse(&args.options)?;
    opts.read_only = true;
    let plain = existing_dir("plaintext directory", &args.lower)?;
    args.excludes()?;
    plyfs_assemble::nesting::check_apart("the plaintext directory", &plain, &args.mountpoint)?;
    let mountpoint = plyfs_fuse::check_mountpoint(&args.mountpoint).map_err(|e| e.to_string())?;
    let found = [crate::secret::reverse_volume(&plain)?];
    let volumes = match args.key_fd {
        Some(fd) => {
            crate::secret::register_configs_from_fd(&found, fd)?;
            Vec::new()
        }
        None => crate::secret::unlock_configs(&found, &args.secret)?,
    };
    if args.foreground {
        return serve(&args, Vec::new(), opts, plyfs_assemble::lower::Lower::Dir(plain), mountpoint);
    }
    spawn_background(&args, &mountpoint, volumes)
}

/// The stack of a reverse view over the plaintext tree `plain`: the view over the directory.
fn reverse_stack(args: &MountArgs, plain: &Path) -> Result<plyfs_stack::Stack, String> {
    use plyfs_layers::crypt::{keys, reverse};
    let config_path = plain.join(reverse::REVERSE_CONFIG_NAME);
    let config = keys::VolumeConfig::load_file(plain, &config_path, " --reverse")?;
    let volume = keys::registered(&config.id()?).ok_or("the reverse view's volume is locked")?;
    // What the view shows as its configuration: the file as it is (a volume configuration).
    let shown = std::fs::read(&config_path).map_err(|e| format!("{}: {e}", config_path.display()))?;
    let bottom = LowerDir::level(plain).map_err(|e| format!("plaintext directory {}: {e}", plain.display()))?;
    let view = reverse::ReverseView::new(&volume, bottom.clone(), shown, &args.excludes()?).map_err(|e| e.to_string())?;
    // The view alone: the plaintext below is not offered as a level (`MNT/.plyfs/...`).
    plyfs_stack::Stack::build_over(&[], plyfs_assemble::registry(), vec![view.level()]).map_err(|e| e.to_string())
}

fn serve(
    args: &MountArgs,
    specs: Vec<plyfs_stack::spec::LayerSpec>,
    opts: options::MountOptions,
    lower: plyfs_assemble::lower::Lower,
    mountpoint: PathBuf,
) -> Result<(), String> {
    let mut ready = Ready(args.ready_fd.map(|fd| unsafe { File::from_raw_fd(fd) }));
    let result = serve_inner(args, specs, opts, lower, mountpoint, &mut ready);
    if let Err(e) = &result {
        ready.send(&format!("ERR {e}"));
    }
    result
}

fn serve_inner(
    args: &MountArgs,
    specs: Vec<plyfs_stack::spec::LayerSpec>,
    opts: options::MountOptions,
    lower: plyfs_assemble::lower::Lower,
    mountpoint: PathBuf,
    ready: &mut Ready,
) -> Result<(), String> {
    let signals = block_signals();
    init_logging(args.verbose);
    // Modes arrive already masked by the kernel; a umask here would mask them twice.
    unsafe { libc::umask(0) };
    let fd_limit = plyfs_stack::raise_fd_limit();
    tracing::debug!("open-files limit: {fd_limit}");

    if opts.shared {
        plyfs_stack::shared::set_mode(Some(plyfs_stack::shared::SharedMode { revalidate: opts.attr_ttl }));
    }
    plyfs_stack::readonly::set_read_only(opts.read_only);
    // Held until the daemon ends (a reverse view only reads a plaintext tree).
    let _locks = if args.reverse { Vec::new() } else { lock_lowers(&args.tree, &specs, &opts, &lower, &mountpoint)? };
    let stack = match (args.reverse, lower.dir()) {
        (true, Some(plain)) => reverse_stack(args, plain)?,
        _ => plyfs_assemble::tree::build_stack(&specs, &lower, &args.tree.branches, args.tree.rules.as_deref(), Some(&mountpoint))?,
    };
    let stack = Arc::new(stack);
    // Every level by name, branches included (a tree's trunk may have no layer of its own).
    let names: Vec<String> = stack
        .named_levels()
        .into_iter()
        .filter(|n| n.below.is_some() || n.level.layer().lower().is_empty() && !n.level.layer().branches().is_empty())
        .map(|n| n.name)
        .collect();

    const REMOTE_READAHEAD_KB: u32 = 512;
    let request = MountRequest {
        mountpoint: mountpoint.clone(),
        fsname: opts.fsname.clone().unwrap_or_else(|| lower.to_string()),
        // No lower file of a remote stack is here to hand to the kernel.
        front: FrontOptions {
            entry_ttl: opts.entry_ttl,
            attr_ttl: opts.attr_ttl,
            passthrough: opts.passthrough && lower.dir().is_some(),
            no_passthrough_because: match &lower {
                plyfs_assemble::lower::Lower::Dir(_) => None,
                plyfs_assemble::lower::Lower::Remote { .. } => Some("a remote stack has no lower files to hand to the kernel".to_owned()),
                plyfs_assemble::lower::Lower::Exodisk(_) => Some("exofs has no lower files to hand to the kernel".to_owned()),
            },
            shared: opts.shared,
            fanin: opts.fanin,
        },
        threads: opts.threads,
        // Across a transport, a longer read-ahead keeps several reads in flight.
        readahead_kb: opts.readahead_kb.or(lower.dir().is_none().then_some(REMOTE_READAHEAD_KB)),
        allow_other: opts.allow_other,
        allow_root: opts.allow_root,
        read_only: opts.read_only,
        flags: opts.flags.clone(),
        io_uring: opts.io_uring,
    };
    let mounted = Mounted::mount(stack.clone(), &request).map_err(|e| e.to_string())?;
    match (mounted.uring_refused(), opts.io_uring) {
        (Some(why), UringChoice::On) => tracing::warn!("-o io_uring: {why}; requests go through /dev/fuse"),
        (Some(why), _) => tracing::info!("FUSE over io_uring not used: {why}; requests go through /dev/fuse"),
        (None, _) => {}
    }
    if let Some(file) = lower.dir().and_then(probe_file) {
        if let Err(why) = mounted.probe_passthrough(&file) {
            tracing::warn!("{why}; every file uses FUSE I/O");
        }
    }
    let io_mode = mounted.io_mode();
    let io_mode = if opts.shared {
        let caveat = lower.dir().and_then(shared_lower_caveat).map(|c| format!("; note: {c}")).unwrap_or_default();
        format!(
            "{io_mode}; shared with other mounts (-o shared): encoded files change under a lock on the lower file, pages are dropped at each open{caveat}"
        )
    } else {
        io_mode.to_string()
    };
    let io_mode = match mounted.transport() {
        Transport::DevFuse => io_mode,
        uring => format!("{io_mode}; requests over {uring}"),
    };
    let control = match ControlServer::start(stack.clone(), &mountpoint) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!("control socket: {e}; `plyfs op` will not reach this mount");
            None
        }
    };
    let notes: String = stack.named_levels().iter().filter_map(|n| n.level.layer().mount_note()).map(|note| format!("; {note}")).collect();
    tracing::info!("mounted {} on {} with stack [{}]; file I/O: {io_mode}{notes}", lower, mountpoint.display(), names.join(", "));
    if let Some(plain) = lower.dir().and_then(|dir| crate::policy::plain_files_notice(&stack, dir, &mountpoint)) {
        ready.note(&plain);
    }
    ready.send(&format!("OK {io_mode}{notes}"));

    let signal_mountpoint = mountpoint.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let Ok(sig) = signals.wait() else { continue };
            tracing::info!("{sig}: unmounting {}", signal_mountpoint.display());
            match unmount(&signal_mountpoint, false) {
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!("unmount {}: {e}; detaching it lazily", signal_mountpoint.display());
                    match unmount(&signal_mountpoint, true) {
                        Ok(Unmounted::Lazily | Unmounted::Done) => break,
                        Err(e) => tracing::error!("unmount {}: {e}", signal_mountpoint.display()),
                    }
                }
            }
        })
        .map_err(|e| e.to_string())?;

    if let Some(idle) = opts.idle {
        watch_idle(mounted.status(), mountpoint.clone(), idle)?;
    }
    // Do not keep any directory busy.
    let _ = std::env::set_current_dir("/");
    let result = mounted.run();
    drop(control);
    tracing::info!("{} unmounted", mountpoint.display());
    result.map_err(|e| format!("serving {}: {e}", mountpoint.display()))
}

/// `-o idle`: unmount once no request came for `idle` and nothing is open, as gocryptfs
/// `-idle` does. A mount still in use (a shell's working directory in it) refuses, and the watch
/// tries again later.
fn watch_idle(status: Arc<plyfs_fuse::FrontStatus>, mountpoint: PathBuf, idle: std::time::Duration) -> Result<(), String> {
    let every = (idle / 4).clamp(std::time::Duration::from_millis(100), std::time::Duration::from_secs(10));
    tracing::info!("-o idle: unmounting after {idle:?} without use");
    std::thread::Builder::new()
        .name("idle".into())
        .spawn(move || {
            let mut since = std::time::Instant::now();
            loop {
                std::thread::sleep(every);
                if status.take_active() || status.open_count() > 0 {
                    since = std::time::Instant::now();
                    continue;
                }
                if since.elapsed() < idle {
                    continue;
                }
                tracing::info!("unused for {:?}: unmounting {} (-o idle)", since.elapsed(), mountpoint.display());
                match unmount(&mountpoint, false) {
                    Ok(_) => break,
                    Err(e) => {
                        tracing::info!("-o idle: {} is still in use ({e}); trying again later", mountpoint.display());
                        since = std::time::Instant::now();
                    }
                }
            }
        })
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn spawn_background(args: &MountArgs, mountpoint: &Path, volumes: Vec<Arc<plyfs_layers::crypt::keys::Volume>>) -> Result<(), String> {
    let uid = unsafe { libc::geteuid() };
    let log = match &args.log {
        Some(l) => std::path::absolute(l).map_err(|e| format!("--log {}: {e}", l.display()))?,
        None => control::log_path(uid, mountpoint).map_err(|e| e.to_string())?,
    };
    let log_file = plyfs_stack::private::open_log(&log).map_err(|e| e.to_string())?;

    let (read_end, write_end) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
    let write_fd = write_end.as_raw_fd();
    // Unlocked volumes' keys go to the child through a pipe, never its arguments, in the order
    // of `storage_dirs`. 32 bytes each fit in the pipe's buffer, so they are written before
    // the child starts.
    let key_pipe = if volumes.is_empty() {
        None
    } else {
        let (key_read, key_write) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
        let mut w = File::from(key_write);
        for v in &volumes {
            w.write_all(v.key.bytes()).map_err(|e| format!("pipe: {e}"))?;
        }
        Some(key_read)
    };
    let key_fd = key_pipe.as_ref().map(|k| k.as_raw_fd());
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the plyfs program: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.args(child_args(args, write_fd, key_fd));
    cmd.stdin(Stdio::null()).stdout(log_file.try_clone().map_err(|e| e.to_string())?).stderr(log_file);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            for fd in [Some(write_fd), key_fd].into_iter().flatten() {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot start the daemon: {e}"))?;
    drop(write_end);
    drop(key_pipe);
    drop(volumes);

    let mut from_child = BufReader::new(File::from(read_end));
    let mut line = String::new();
    while from_child.read_line(&mut line).is_ok_and(|n| n > 0) && line.starts_with("NOTE ") {
        eprintln!("plyfs: {}", line["NOTE ".len()..].trim_end());
        line.clear();
    }
    let line = line.trim_end();
    if let Some(mode) = line.strip_prefix("OK ") {
        if args.quiet {
            return Ok(());
        }
        eprintln!("plyfs: mounted {} (pid {}); file I/O: {mode}; log: {}", mountpoint.display(), child.id(), log.display());
        Ok(())
    } else if let Some(err) = line.strip_prefix("ERR ") {
        let _ = child.wait();
        Err(err.to_owned())
    } else {
        let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
        Err(format!("the daemon exited before the mount was ready ({status}); see {}", log.display()))
    }
}

/// The arguments for the background child: the same mount, in the foreground, reporting on
/// `ready_fd`. Relative paths stay valid because the child starts in the same directory.
fn child_args(args: &MountArgs, ready_fd: i32, key_fd: Option<i32>) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec!["mount".into(), args.lower.clone().into(), args.mountpoint.clone().into()];
    if let Some(s) = &args.tree.stack {
        v.push("--stack".into());
        v.push(s.into());
    }
    if let Some(c) = &args.tree.config {
        v.push("--config".into());
        v.push(c.clone().into());
    }
    if let Some(p) = &args.psk {
        v.push("--psk".into());
        v.push(p.clone().into());
    }
    for b in &args.tree.branches {
        // Relative directories stay valid: the child starts in the same directory.
        v.push("--branch".into());
        v.push(b.into());
    }
    if let Some(r) = &args.tree.rules {
        v.push("--rules".into());
        v.push(r.canonicalize().unwrap_or_else(|_| r.clone()).into());
    }
    for o in &args.options {
        v.push("-o".into());
        v.push(o.into());
    }
    if args.reverse {
        v.push("--reverse".into());
    }
    for g in &args.exclude {
        v.push("--exclude".into());
        v.push(g.into());
    }
    if let Some(f) = &args.exclude_from {
        v.push("--exclude-from".into());
        v.push(f.canonicalize().unwrap_or_else(|_| f.clone()).into());
    }
    for _ in 0..args.verbose {
        v.push("-v".into());
    }
    v.push("--foreground".into());
    v.push("--ready-fd".into());
    v.push(ready_fd.to_string().into());
    if let Some(fd) = key_fd {
        v.push("--key-fd".into());
        v.push(fd.to_string().into());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::caveat_for;
    use plyfs_fuse::mountinfo::parse_line;

    #[test]
    fn shared_lowers_that_need_a_word_get_one() {
        let on = |fstype: &str, source: &str, opts: &str| {
            parse_line(&format!("40 29 0:60 / /srv/vol rw,relatime shared:5 - {fstype} {source} {opts}")).unwrap()
        };
        assert!(caveat_for(&on("fuse.glusterfs", "host:/vol", "rw,user_id=0")).unwrap().contains("quick-read off"));
        let nfs = caveat_for(&on("nfs", "host:/export", "rw,vers=3,nolock,proto=tcp")).unwrap();
        assert!(nfs.contains("with nolock (host:/export)") && nfs.contains("locks stay on this machine"), "{nfs}");
        assert!(caveat_for(&on("nfs4", "host:/e", "rw,vers=4.2,local_lock=posix")).is_some());
        assert_eq!(caveat_for(&on("nfs4", "host:/e", "rw,vers=4.2,local_lock=none,addr=10.0.0.1")), None);
        assert_eq!(caveat_for(&on("ext4", "/dev/vda1", "rw")), None);
    }
}
