//! A mount: its stack built over the lower, the kernel's mount made, and its requests served
//! until it is unmounted. `plyfs mount` parses its arguments into a [`MountPlan`], unlocks the
//! crypt volumes, goes to the background if asked, and calls [`run`].

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::SigSet;
use plyfs_fuse::{unmount, FanIn, FrontOptions, MountRequest, Mounted, Transport, Unmounted, UringChoice};
use plyfs_fuse::control::ControlServer;
use plyfs_stack::spec::LayerSpec;
use plyfs_stack::LowerDir;

use crate::lower::Lower;

/// What to mount, and how.
pub struct MountPlan {
    /// The layers, top first (none for a reverse view).
    pub specs: Vec<LayerSpec>,
    pub opts: MountOptions,
    pub lower: Lower,
    /// Checked already ([`plyfs_fuse::check_mountpoint`]).
    pub mountpoint: PathBuf,
    /// `--branch` arguments, for the stack's fan-out layer.
    pub branches: Vec<String>,
    /// The rules file choosing files' chains.
    pub rules: Option<PathBuf>,
    /// A reverse view of the plaintext tree LOWER, leaving out what these globs match.
    pub reverse: Option<Vec<String>>,
}

/// Who hears about a mount as it comes up: the foreground, or the process that started the
/// daemon, waiting on a pipe.
pub trait MountReport {
    /// A line for the user, printed before the mount's own.
    fn note(&mut self, line: &str);
    /// The mount is up; `io` says how files' data moves ("passthrough ...; shared ...").
    fn mounted(&mut self, io: &str);
}

/// The `-o` options of a mount, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct MountOptions {
    pub passthrough: bool,
    /// Carry requests over FUSE io_uring (`-o io_uring=auto|on|off`; `auto`, the default, where
    /// the kernel allows it).
    pub io_uring: UringChoice,
    pub entry_ttl: Duration,
    pub attr_ttl: Duration,
    pub threads: usize,
    /// The kernel's read-ahead for the mount, in KiB (the kernel's own by default).
    pub readahead_kb: Option<u32>,
    pub allow_other: bool,
    pub allow_root: bool,
    pub read_only: bool,
    /// Mount over a mount point that holds files (`-o nonempty`).
    pub nonempty: bool,
    /// Other mounts share the lower tree (`-o shared`).
    pub shared: bool,
    /// Unmount after this long without a request and with nothing open (`-o idle=DURATION`).
    pub idle: Option<Duration>,
    /// Who may use the fan-in paths under `MNT/.plyfs/` (`-o fanin=owner|all|none`).
    pub fanin: FanIn,
    /// What the mount shows as its source (`-o fsname=NAME`; the lower directory by default).
    pub fsname: Option<String>,
    /// The daemon logs to syslog rather than to a file (`-o syslog`); the binary sets the log
    /// up, the mount names it in its status.
    pub syslog: bool,
    pub flags: Vec<String>,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            passthrough: true,
            io_uring: UringChoice::Auto,
            entry_ttl: Duration::from_secs(1),
            attr_ttl: Duration::from_secs(1),
            threads: 4,
            readahead_kb: None,
            allow_other: false,
            allow_root: false,
            read_only: false,
            nonempty: false,
            shared: false,
            idle: None,
            fanin: FanIn::Owner,
            fsname: None,
            syslog: false,
            flags: Vec::new(),
        }
    }
}

/// Block the termination signals in this thread before any other thread starts, so they all
/// inherit the mask and only the signal thread receives them.
pub fn block_signals() -> SigSet {
    use nix::sys::signal::Signal;
    let mut set = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        set.add(s);
    }
    let _ = set.thread_block();
    set
}

/// Mount `plan` and serve it until it is unmounted: by `plyfs umount`, by one of the blocked
/// `signals`, or by `-o idle`. `report` hears of the mount once it is up.
pub fn run(plan: MountPlan, signals: SigSet, report: &mut dyn MountReport) -> crate::Result<()> {
    let MountPlan { specs, opts, lower, mountpoint, branches, rules, reverse } = plan;
    // Modes arrive already masked by the kernel; a umask here would mask them twice.
    unsafe { libc::umask(0) };
    let fd_limit = plyfs_stack::raise_fd_limit();
    tracing::debug!("open-files limit: {fd_limit}");

    if opts.shared {
        plyfs_stack::shared::set_mode(Some(plyfs_stack::shared::SharedMode { revalidate: opts.attr_ttl }));
    }
    plyfs_stack::readonly::set_read_only(opts.read_only);
    // Held until the daemon ends (a reverse view only reads a plaintext tree).
    let _locks = if reverse.is_some() { Vec::new() } else { lock_lowers(&branches, &specs, &opts, &lower, &mountpoint)? };
    let stack = match (&reverse, lower.dir()) {
        (Some(excludes), Some(plain)) => reverse_stack(plain, excludes)?,
        _ => crate::tree::build_stack(&specs, &lower, &branches, rules.as_deref(), Some(&mountpoint))?,
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
            passthrough: opts.passthrough && lower.local(),
            no_passthrough_because: match &lower {
                Lower::Dir(_) | Lower::Branches { .. } => None,
                Lower::Remote { .. } => Some("a remote stack has no lower files to hand to the kernel".to_owned()),
                Lower::Exodisk(_) => Some("exofs has no lower files to hand to the kernel".to_owned()),
            },
            shared: opts.shared,
            fanin: opts.fanin,
        },
        threads: opts.threads,
        // Across a transport, a longer read-ahead keeps several reads in flight.
        readahead_kb: opts.readahead_kb.or((!lower.local()).then_some(REMOTE_READAHEAD_KB)),
        allow_other: opts.allow_other,
        allow_root: opts.allow_root,
        read_only: opts.read_only,
        nonempty: opts.nonempty,
        flags: opts.flags.clone(),
        io_uring: opts.io_uring,
    };
    let mounted = Mounted::mount(stack.clone(), &request)?;
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
        // Most users get /dev/fuse because their kernel ships with io_uring for FUSE off: say
        // how to have it, and what it gives (docs/benchmarks.md: metadata in 55–70% of the
        // time), since nothing else would tell them.
        Transport::DevFuse if opts.io_uring == UringChoice::Auto && plyfs_fuse::uring::turned_off() => format!(
            "{io_mode}; requests over /dev/fuse: this kernel has FUSE over io_uring turned off, which would make metadata 1.4–1.8× faster (as root: echo 1 > /sys/module/fuse/parameters/enable_uring, then mount again)"
        ),
        Transport::DevFuse => io_mode,
        uring => format!("{io_mode}; requests over {uring}"),
    };
    // What `plyfs status` shows of this mount.
    let about = serde_json::json!({
        "mountpoint": mountpoint.display().to_string(),
        "lower": lower.to_string(),
        "stack": names.join(","),
        "pid": std::process::id(),
        "transport": match mounted.transport() {
            Transport::DevFuse => "/dev/fuse",
            Transport::IoUring { .. } => "io_uring",
        },
        "log": log_destination(opts.syslog),
    });
    let control = match ControlServer::start(stack.clone(), &mountpoint, about) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!("control socket: {e}; `plyfs op` will not reach this mount");
            None
        }
    };
    let notes: String = stack.named_levels().iter().filter_map(|n| n.level.layer().mount_note()).map(|note| format!("; {note}")).collect();
    tracing::info!("mounted {} on {} with stack [{}]; file I/O: {io_mode}{notes}", lower, mountpoint.display(), names.join(", "));
    if let Some(plain) = lower.dir().and_then(|dir| plain_files_notice(&stack, dir, &mountpoint)) {
        report.note(&plain);
    }
    report.mounted(&format!("{io_mode}{notes}"));

    let signal_mountpoint = mountpoint.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let Ok(sig) = signals.wait() else { continue };
            tracing::info!("{sig}: unmounting {}", signal_mountpoint.display());
            match unmount(&signal_mountpoint, false) {
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!("{e}; detaching it lazily");
                    match unmount(&signal_mountpoint, true) {
                        Ok(Unmounted::Lazily | Unmounted::Done) => break,
                        Err(e) => tracing::error!("{e}"),
                    }
                }
            }
        })
        .map_err(|e| crate::Error::Run(e.to_string()))?;

    if let Some(idle) = opts.idle {
        watch_idle(mounted.status(), mountpoint.clone(), idle)?;
    }
    // Do not keep any directory busy.
    let _ = std::env::set_current_dir("/");
    let result = mounted.run();
    drop(control);
    tracing::info!("{} unmounted", mountpoint.display());
    result.map_err(|e| crate::Error::Run(format!("serving {}: {e}", mountpoint.display())))
}


/// Where this daemon's log goes: syslog, or the file (or terminal) its standard error is.
fn log_destination(syslog: bool) -> String {
    if syslog {
        return "syslog".into();
    }
    std::fs::read_link("/proc/self/fd/2").map(|p| p.display().to_string()).unwrap_or_else(|_| "-".into())
}

/// `-o idle`: unmount once no request came for `idle` and nothing is open, as gocryptfs
/// `-idle` does. A mount still in use (a shell's working directory in it) refuses, and the watch
/// tries again later.
fn watch_idle(status: Arc<plyfs_fuse::FrontStatus>, mountpoint: PathBuf, idle: std::time::Duration) -> crate::Result<()> {
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
        .map_err(|e| crate::Error::Run(e.to_string()))
}

/// The lower locks of a mount of `lower` at `mountpoint` (none for a remote stack: its server
/// holds them; a branch on a server, likewise).
pub fn lock_lowers(
    branches: &[String],
    specs: &[LayerSpec],
    opts: &MountOptions,
    lower: &Lower,
    mountpoint: &Path,
) -> crate::Result<Vec<plyfs_stack::lowerlock::LowerLock>> {
    if !lower.local() {
        return Ok(Vec::new());
    }
    let how = crate::locks::Use::Mount { shared: opts.shared, read_only: opts.read_only };
    crate::locks::take_all(lower.dir(), branches, specs, how, &format!("mounted at {}", mountpoint.display()))
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


/// The stack of a reverse view over the plaintext tree `plain`: the view over the directory.
fn reverse_stack(plain: &Path, excludes: &[String]) -> crate::Result<plyfs_stack::Stack> {
    use plyfs_layers::crypt::{keys, reverse};
    let config_path = plain.join(reverse::REVERSE_CONFIG_NAME);
    let config = keys::VolumeConfig::load_file(plain, &config_path, " --reverse")?;
    let volume = keys::registered(&config.id()?).ok_or("the reverse view's volume is locked")?;
    // What the view shows as its configuration: the file as it is (a volume configuration).
    let shown = std::fs::read(&config_path).map_err(|e| crate::Error::path("", &config_path, e))?;
    let bottom = LowerDir::level(plain).map_err(|e| crate::Error::path("plaintext directory", plain, e))?;
    let view = reverse::ReverseView::new(&volume, bottom.clone(), shown, excludes).map_err(|e| crate::Error::Run(e.to_string()))?;
    // The view alone: the plaintext below is not offered as a level (`MNT/.plyfs/...`).
    plyfs_stack::Stack::build_over(&[], crate::registry(), vec![view.level()]).map_err(|e| crate::Error::Run(e.to_string()))
}

/// How many files a mount looks at for plain ones before it serves: a bound on the time it
/// takes. Beyond it, the count is a lower bound.
const PLAIN_SCAN_FILES: u64 = 1000;

/// What the mount says when `lower` holds plain files (there before the mount's data layers,
/// served as they are): how many, and how to encode them. `None` when there are none, or the
/// stack has no per-file policy.
pub fn plain_files_notice(stack: &plyfs_stack::Stack, lower: &Path, mountpoint: &Path) -> Option<String> {
    let cx = plyfs_stack::Caller::daemon();
    let v = stack.top().extended(&cx, plyfs_stack::NodeId::ROOT, "policy-plain", &[PLAIN_SCAN_FILES.to_string()]).ok()?;
    let plain = v.get("plain").and_then(serde_json::Value::as_u64).filter(|n| *n > 0)?;
    let at_least = if v.get("complete").and_then(serde_json::Value::as_bool) == Some(false) { "at least " } else { "" };
    let chain = v.get("chain").and_then(serde_json::Value::as_str).unwrap_or("?");
    let (files, are) = if plain == 1 { ("file", "is") } else { ("files", "are") };
    Some(format!(
        "{at_least}{plain} {files} in {} {are} plain (not {chain}-encoded), and served as they are; run 'plyfs policy apply -r {}' to encode them",
        lower.display(),
        mountpoint.display()
    ))
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
    }}
