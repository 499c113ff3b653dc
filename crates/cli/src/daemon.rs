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
use plyfs_fuse::control;
use plyfs_stack::spec::{load_stack_config, parse_stack_spec};
use plyfs_assemble::dirs::existing_dir;
use plyfs_assemble::mount::{block_signals, lock_lowers, MountOptions, MountPlan, MountReport};

use crate::failure::{code, Failure};
use crate::options;

#[derive(Args, Clone)]
pub struct MountArgs {
    /// The directory whose contents the stack presents, or a stack served elsewhere: unix:PATH,
    /// tcp:HOST:PORT; or - when the stack names where it stands: it ends in remote:addr=..., or
    /// each branch of its fan-out layer names its directory or server.
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
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// Log more (debug); repeat for every request (trace).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Print nothing when the mount succeeds, as mount helpers do (warnings and errors still go
    /// to standard error).
    #[arg(short, long)]
    quiet: bool,
    /// Internal: the pipe to report readiness on.
    #[arg(long, hide = true, value_name = "FD")]
    ready_fd: Option<i32>,
    /// Internal: the pipe the parent hands an unlocked volume's master key over on.
    #[arg(long, hide = true, value_name = "FD")]
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
    #[arg(long, conflicts_with = "config", value_name = "SPEC")]
    pub stack: Option<String>,
    /// A TOML file describing the stack ([[layer]] tables).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A further branch for the stack's first fan-out layer (union, mirror), which takes LOWER
    /// as its first branch and these after it, in order: DIR, DIR=rw (the default) or DIR=ro.
    #[arg(long = "branch", value_name = "DIR[=ro|rw]")]
    pub branches: Vec<String>,
    /// A TOML file of rules choosing the data layers of files by path, extension and size
    /// ([[rule]] tables); file and directory attributes (user.plyfs.layers) take precedence.
    #[arg(long, value_name = "FILE")]
    pub rules: Option<PathBuf>,
}

impl StackArgs {
    /// The layer specifications: `--config`, `--stack`, or `null`.
    pub fn specs(&self) -> Result<Vec<plyfs_stack::spec::LayerSpec>, String> {
        match (&self.stack, &self.config) {
            (_, Some(config)) => load_stack_config(config, plyfs_assemble::registry(), plyfs_assemble::lower::BOTTOM_KINDS).map_err(|e| e.to_string()),
            (Some(spec), None) => parse_stack_spec(spec).map_err(|e| e.to_string()),
            (None, None) => parse_stack_spec("null").map_err(|e| e.to_string()),
        }
    }
}

pub fn mount(args: MountArgs) -> Result<(), Failure> {
    if args.reverse {
        return mount_reverse(args);
    }
    // Check what can be checked before going to the background, so mistakes are reported here.
    let mut specs = args.tree.specs().map_err(Failure::usage)?;
    let opts = options::parse(&args.options).map_err(Failure::usage)?;
    // (A foreground mount logs them as it builds the stack.)
    if !args.foreground {
        for w in plyfs_stack::order_warnings(&specs, plyfs_assemble::registry()) {
            eprintln!("plyfs: warning: {w}");
        }
    }
    let lower = plyfs_assemble::lower::Lower::parse(&args.lower, &mut specs, &args.tree.branches, args.psk.as_deref()).map_err(lower_failure)?;
    let dirs = lower.storage_dirs(&args.tree.branches, &specs);
    // A linear stack with crypt needs LOWER to be a volume: said here, with its status, rather
    // than by the daemon as it builds the stack.
    let registry = plyfs_assemble::registry();
    if let Some(dir) = lower.dir().filter(|_| specs.iter().any(|s| s.kind == "crypt") && !specs.iter().any(|s| plyfs_stack::is_fan_out(registry, &s.kind))) {
        plyfs_layers::crypt::keys::VolumeConfig::load(dir)?;
    }
    plyfs_assemble::nesting::check_storage_apart(&dirs, &args.mountpoint)?;
    let mountpoint = plyfs_fuse::check_mountpoint(&args.mountpoint, opts.nonempty)?;
    // A lower in use is reported here; the mount's daemon takes the locks for its life.
    if args.ready_fd.is_none() {
        lock_lowers(&args.tree.branches, &specs, &opts, &lower, &mountpoint)?;
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
    let defaults = defaults_taken(&args.tree, &specs, &lower);
    if args.foreground {
        if let Some(d) = &defaults {
            eprintln!("plyfs: {d}");
        }
        return serve(&args, specs, opts, lower, mountpoint);
    }
    spawn_background(&args, &mountpoint, volumes, opts.syslog, defaults)
}

/// What a mount over a directory took by default that its user may not know: said in the
/// mount message, since the mount works either way and nothing else would tell.
fn defaults_taken(tree: &StackArgs, specs: &[plyfs_stack::spec::LayerSpec], lower: &plyfs_assemble::lower::Lower) -> Option<String> {
    let dir = lower.dir()?;
    if tree.stack.is_none() && tree.config.is_none() {
        return Some("stack: null, which passes everything through unchanged (no --stack given)".into());
    }
    let registry = plyfs_assemble::registry();
    let fan_out = specs.iter().find(|s| plyfs_stack::is_fan_out(registry, &s.kind))?;
    (fan_out.branches.is_empty() && tree.branches.is_empty())
        .then(|| format!("{} has one branch, {} (add more with --branch DIR)", fan_out.kind, dir.display()))
}

pub(crate) fn init_logging(verbose: u8) {
    init_logging_to(verbose, false)
}

/// The log of a daemon: standard error, or syslog (`-o syslog`), which dates and ranks each
/// line itself.
fn init_logging_to(verbose: u8, syslog: bool) {
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
    if syslog {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(crate::syslog::Syslog::new())
            .with_ansi(false)
            .without_time()
            .with_level(false)
            .with_target(false)
            .log_internal_errors(false)
            .try_init();
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(stderr_wants_colour())
        .with_target(false)
        .log_internal_errors(false)
        .try_init();
}

/// Colour codes are for a person at a terminal: a log file, a pipe or a journal gets plain
/// text, and so does anyone who set `NO_COLOR` (no-color.org), as other tools do.
pub(crate) fn stderr_wants_colour() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// The pipe a background daemon reports on to the process that started it: `NOTE` lines, then
/// `OK` or `ERR` (none when the mount is in the foreground).
struct Ready(Option<File>);

impl Ready {
    fn send(&mut self, line: &str) {
        if let Some(mut f) = self.0.take() {
            let _ = writeln!(f, "{line}");
        }
    }
}

impl MountReport for Ready {
    /// A line for the user, which the mounting process prints before its own.
    fn note(&mut self, line: &str) {
        tracing::warn!("{line}");
        if let Some(f) = &mut self.0 {
            let _ = writeln!(f, "NOTE {line}");
        }
    }

    fn mounted(&mut self, io: &str) {
        self.send(&format!("OK {io}"));
    }
}

/// `mount --reverse`: the encrypted view of a plaintext tree, always read-only.
fn mount_reverse(args: MountArgs) -> Result<(), Failure> {
    let mut opts = options::parse(&args.options).map_err(Failure::usage)?;
    opts.read_only = true;
    let plain = existing_dir("plaintext directory", &args.lower).map_err(lower_failure)?;
    args.excludes().map_err(Failure::usage)?;
    plyfs_assemble::nesting::check_apart("the plaintext directory", &plain, &args.mountpoint)?;
    let mountpoint = plyfs_fuse::check_mountpoint(&args.mountpoint, opts.nonempty)?;
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
    let syslog = opts.syslog;
    spawn_background(&args, &mountpoint, volumes, syslog, None)
}

fn serve(
    args: &MountArgs,
    specs: Vec<plyfs_stack::spec::LayerSpec>,
    opts: MountOptions,
    lower: plyfs_assemble::lower::Lower,
    mountpoint: PathBuf,
) -> Result<(), Failure> {
    let mut ready = Ready(args.ready_fd.map(|fd| unsafe { File::from_raw_fd(fd) }));
    let signals = block_signals();
    init_logging_to(args.verbose, opts.syslog);
    let result = match args.reverse.then(|| args.excludes()).transpose() {
        Ok(reverse) => {
            let (branches, rules) = (args.tree.branches.clone(), args.tree.rules.clone());
            let plan = MountPlan { specs, opts, lower, mountpoint, branches, rules, reverse };
            plyfs_assemble::mount::run(plan, signals, &mut ready).map_err(Failure::from)
        }
        Err(e) => Err(Failure::usage(e)),
    };
    // The parent exits with the same status and message.
    if let Err(e) = &result {
        ready.send(&e.to_report());
    }
    result
}

/// LOWER (or a reverse view's plaintext directory) cannot be used: missing, or not a directory.
pub(crate) fn lower_failure(e: plyfs_assemble::Error) -> Failure {
    match e {
        plyfs_assemble::Error::Path { .. } => Failure::new(code::LOWER, e),
        other => Failure::from(other),
    }
}

/// Start the daemon and wait for its report; `defaults` goes in the mount message. With
/// `syslog`, the daemon logs to the system log and writes no log file.
fn spawn_background(
    args: &MountArgs,
    mountpoint: &Path,
    volumes: Vec<Arc<plyfs_layers::crypt::keys::Volume>>,
    syslog: bool,
    defaults: Option<String>,
) -> Result<(), Failure> {
    let uid = unsafe { libc::geteuid() };
    // With `-o syslog` the daemon writes no file: what it prints besides its log goes nowhere.
    let (log, log_file) = match (&args.log, syslog) {
        (Some(_), true) => return Err("--log and -o syslog name two places for the log: give one".into()),
        (None, true) => (PathBuf::from("syslog"), File::options().write(true).open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?),
        (Some(l), false) => {
            let log = std::path::absolute(l).map_err(|e| format!("--log {}: {e}", l.display()))?;
            let file = plyfs_stack::private::open_log(&log).map_err(|e| e.to_string())?;
            (log, file)
        }
        (None, false) => {
            let log = control::log_path(uid, mountpoint).map_err(|e| e.to_string())?;
            let file = plyfs_stack::private::open_log(&log).map_err(|e| e.to_string())?;
            (log, file)
        }
    };

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
        let defaults = defaults.map(|d| format!("; {d}")).unwrap_or_default();
        eprintln!("plyfs: mounted {} (pid {}){defaults}; file I/O: {mode}; log: {}", mountpoint.display(), child.id(), log.display());
        Ok(())
    } else if let Some(err) = line.strip_prefix("ERR ") {
        let _ = child.wait();
        Err(Failure::from_report(err))
    } else {
        let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
        Err(format!("the daemon exited before the mount was ready ({status}); see {}", log.display()).into())
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
