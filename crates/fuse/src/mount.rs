//! Mounting and unmounting, with clear errors for the usual mistakes, and the `fusermount3`
//! route for users who cannot open `/dev/fuse` themselves.

use std::ffi::CString;
use std::io::{self, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use fuser::{Config, MountOption, Session, SessionACL};
use plyfs_stack::Stack;

use crate::classic::{Classic, MAX_WRITE};
use crate::fs::{FrontOptions, FrontStatus, FuseFs, IoMode, KernelCache};
use crate::devloop::{self, Access, Others};
use crate::{mountinfo, uring, Error};

/// Room for the headers before a request's data in the `/dev/fuse` read buffer (the kernel
/// wants at least 8 KiB beyond the largest write).
const REQUEST_HEADROOM: usize = 8192;

/// Everything `plyfs mount` decides before mounting.
#[derive(Clone, Debug)]
pub struct MountRequest {
    pub mountpoint: PathBuf,
    /// Shown as the source in `mount` output.
    pub fsname: String,
    pub front: FrontOptions,
    pub threads: usize,
    /// The kernel's read-ahead for this mount, in KiB; `None` leaves the kernel's.
    pub readahead_kb: Option<u32>,
    pub allow_other: bool,
    pub allow_root: bool,
    pub read_only: bool,
    /// Mount over a mount point that holds files, hiding them (`-o nonempty`).
    pub nonempty: bool,
    /// Other kernel mount flags (`noexec`, `nosuid`, `noatime`, ...), by their usual names.
    pub flags: Vec<String>,
    /// Whether requests travel over io_uring, one queue per CPU.
    pub io_uring: UringChoice,
}

/// `-o io_uring=auto|on|off`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UringChoice {
    /// Where the kernel allows it and the ring threads can yield their CPU to callers
    /// (SCHED_IDLE, see `uring::Yielding`); without that it is slower than `/dev/fuse` on
    /// machines with few CPUs.
    Auto,
    /// Wherever the kernel allows it; the mount says why not otherwise.
    On,
    /// `/dev/fuse` only: the default until the races io_uring's timing exposes in the
    /// shared-lower tests are fixed (see issue #14's notes).
    #[default]
    Off,
}

/// How requests reach the daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Read from `/dev/fuse` by a pool of threads.
    DevFuse,
    /// FUSE over io_uring, with this many queues (one per CPU).
    IoUring { queues: usize },
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::DevFuse => f.write_str("/dev/fuse"),
            Transport::IoUring { queues } => write!(f, "io_uring ({queues} queues, one per CPU)"),
        }
    }
}

/// A mounted stack, ready to serve.
pub struct Mounted {
    session: Session<Classic>,
    fs: Arc<FuseFs>,
    access: Access,
    threads: usize,
    rings: Option<uring::Rings>,
    /// Why io_uring was asked for and not used.
    uring_refused: Option<String>,
    status: Arc<FrontStatus>,
    mountpoint: PathBuf,
    /// The mount's `major:minor`, to tell it from a later mount at the same place.
    dev: Option<String>,
}

/// Why a mount failed: the crate's [`Error`], by the name callers know it under.
pub type MountError = Error;

/// Kernel mount flags `-o` accepts besides plyfs's own options.
pub const KERNEL_FLAGS: &[&str] =
    &["dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime", "noatime", "diratime", "nodiratime", "relatime", "strictatime", "sync", "async", "dirsync", "rw"];

fn flag_option(name: &str) -> Option<MountOption> {
    Some(match name {
        "dev" => MountOption::Dev,
        "nodev" => MountOption::NoDev,
        "suid" => MountOption::Suid,
        "nosuid" => MountOption::NoSuid,
        "exec" => MountOption::Exec,
        "noexec" => MountOption::NoExec,
        "atime" => MountOption::Atime,
        "noatime" => MountOption::NoAtime,
        "sync" => MountOption::Sync,
        "async" => MountOption::Async,
        "dirsync" => MountOption::DirSync,
        "rw" => MountOption::RW,
        "diratime" | "nodiratime" | "relatime" | "strictatime" => MountOption::CUSTOM(name.to_owned()),
        _ => return None,
    })
}

/// Check that `mountpoint` can take a mount: it exists, is a directory, is not mounted on, and is
/// empty (mounting would hide what it holds) unless `nonempty` (`-o nonempty`, as fuse2 tools
/// and sshfs users write it; fuse3's own tools mount over files silently).
pub fn check_mountpoint(mountpoint: &Path, nonempty: bool) -> Result<PathBuf, MountError> {
    let path = || mountpoint.to_owned();
    // Checking the mount point is the operation; the system's reason says the rest.
    let failed = |e: io::Error| Error::MountPoint { path: path(), why: e.to_string() };
    let meta = std::fs::metadata(mountpoint).map_err(failed)?;
    if !meta.is_dir() {
        return Err(Error::MountPoint { path: path(), why: "not a directory".into() });
    }
    let canonical = mountpoint.canonicalize().map_err(failed)?;
    if let Some(m) = mountinfo::mount_at(&canonical) {
        return Err(Error::MountPointBusy { path: path(), fstype: m.fstype });
    }
    let mut entries = std::fs::read_dir(&canonical).map_err(failed)?;
    if !nonempty && entries.next().is_some() {
        return Err(Error::MountPointNotEmpty { path: path() });
    }
    Ok(canonical)
}

impl Mounted {
    /// Mount `stack` as the request says. Returns once the kernel has agreed on features and
    /// the mount serves requests (after `run` starts).
    pub fn mount(stack: Arc<Stack>, req: &MountRequest) -> Result<Mounted, MountError> {
        let mountpoint = check_mountpoint(&req.mountpoint, req.nonempty)?;
        let mut options = vec![
            MountOption::FSName(req.fsname.clone()),
            MountOption::Subtype("plyfs".into()),
            // The daemon may run as root: the kernel checks permissions against the attributes,
            // as for any local file system.
            MountOption::DefaultPermissions,
            if req.read_only { MountOption::RO } else { MountOption::RW },
        ];
        for flag in &req.flags {
            let opt = flag_option(flag).ok_or_else(|| Error::UnknownOption { flag: flag.clone() })?;
            if !options.contains(&opt) {
                options.push(opt);
            }
        }
        let mut config = Config::default();
        config.mount_options = options;
        config.acl = if req.allow_other {
            SessionACL::All
        } else if req.allow_root {
            SessionACL::RootAndOwner
        } else {
            SessionACL::Owner
        };

        let fd = match mount_directly(&mountpoint, &config)? {
            Some(fd) => fd,
            // Not allowed to open /dev/fuse or to mount: go through the set-uid fusermount3,
            // as libfuse does.
            None => fusermount(&mountpoint, &config)?,
        };
        let top = stack.top().layer().clone();
        let dev = Arc::new(fd.try_clone().map_err(|e| Error::Device { why: format!("duplicating its descriptor: {e}") })?);
        let (fs, status) = FuseFs::new(stack, req.front.clone(), dev.clone());
        let fs = Arc::new(fs);
        // Once the kernel agrees to io_uring, requests wait for the rings: ask only when they
        // can be made.
        let mut uring_refused = None;
        let mut can_yield = false;
        let mut usable = || {
            uring::kernel_allows().and_then(|()| uring::can_make_rings())?;
            can_yield = uring::can_yield();
            if req.io_uring == UringChoice::Auto && !can_yield {
                return Err(Error::Uring { why: "its threads could not give their CPU to callers (SCHED_IDLE needs CAP_SYS_NICE here), which makes it slower than /dev/fuse".to_owned() });
            }
            Ok(())
        };
        let want_uring = req.io_uring != UringChoice::Off && {
            match usable() {
                Ok(()) => true,
                Err(why) => {
                    uring_refused = Some(why.to_string());
                    false
                }
            }
        };
        let uring_agreed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let classic = Classic { fs: fs.clone(), want_uring, uring_agreed: uring_agreed.clone() };
        let access = Access::new(match config.acl {
            SessionACL::All => Others::All,
            SessionACL::RootAndOwner => Others::Root,
            SessionACL::Owner => Others::None,
        });
        let session = Session::from_fd(classic, fd, config.acl, config.clone()).map_err(|e| {
            let _ = unmount(&mountpoint, true);
            Error::Mount { mountpoint: mountpoint.clone(), why: format!("FUSE handshake failed: {e}") }
        })?;
        let cache = Arc::new(KernelCache(session.notifier()));
        top.set_invalidator(cache.clone());
        fs.set_kernel_cache(cache);
        let mut rings = None;
        if want_uring && !uring_agreed.load(std::sync::atomic::Ordering::Relaxed) {
            uring_refused = Some("the kernel did not offer it at INIT".into());
        } else if want_uring {
            match uring::start(fs.clone(), access, dev, ring_payload_size(), can_yield) {
                Ok(r) => rings = Some(r),
                Err(why) => uring_refused = Some(why.to_string()),
            }
        }
        let dev = mountinfo::mount_at(&mountpoint).filter(|m| m.is_plyfs()).map(|m| m.dev);
        if let (Some(kb), Some(dev)) = (req.readahead_kb, &dev) {
            set_readahead(dev, kb);
        }
        Ok(Mounted { session, fs, access, threads: req.threads, rings, uring_refused, status, mountpoint, dev })
    }

    /// How requests reach the daemon.
    pub fn transport(&self) -> Transport {
        match &self.rings {
            Some(r) => Transport::IoUring { queues: r.queues },
            None => Transport::DevFuse,
        }
    }

    /// Why `-o io_uring` was asked for and requests still go through `/dev/fuse`.
    pub fn uring_refused(&self) -> Option<&str> {
        self.uring_refused.as_deref()
    }

    /// Check that the kernel takes the files of the lower file system for passthrough, with
    /// `file`, one of them. A lower that is itself a stacked file system (a FUSE mount using
    /// passthrough, overlayfs) may be one level too deep: then every file uses FUSE I/O, and
    /// the error says why.
    pub fn probe_passthrough(&self, file: &std::fs::File) -> Result<(), Error> {
        if !matches!(self.io_mode(), IoMode::Passthrough | IoMode::Mixed) {
            return Ok(());
        }
        use crate::fs::{BackingMap, BACKING_CLOSE, BACKING_OPEN};
        let map = BackingMap { fd: file.as_raw_fd(), flags: 0, padding: 0 };
        let dev = self.session.as_fd().as_raw_fd();
        let id = unsafe { libc::ioctl(dev, BACKING_OPEN, &map) };
        if id > 0 {
            let id = id as u32;
            unsafe { libc::ioctl(dev, BACKING_CLOSE, &id) };
            return Ok(());
        }
        let e = io::Error::last_os_error();
        let why = match e.raw_os_error() {
            Some(libc::ELOOP) => format!(
                "the kernel refuses passthrough to the lower files ({e}): the lower file system is itself stacked (a FUSE mount using passthrough, or overlayfs) and the kernel allows one level"
            ),
            _ => format!("the kernel refuses passthrough to the lower files ({e})"),
        };
        self.status.refuse_passthrough(why.clone());
        Err(Error::Passthrough { why })
    }

    pub fn io_mode(&self) -> IoMode {
        self.status.io_mode().unwrap_or(IoMode::Cached { reason: "the kernel did not negotiate".into() })
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// What the front end tells about its use: requests served, files open.
    pub fn status(&self) -> Arc<FrontStatus> {
        self.status.clone()
    }

    /// Serve requests until the file system is unmounted.
    ///
    /// When the last user of a lazily detached mount goes, the kernel tears the connection
    /// down, and a request reader may see ECONNABORTED instead of ENODEV: that is the normal
    /// end too, told from an aborted connection (`/sys/fs/fuse/connections/N/abort`) by the
    /// mount being gone.
    pub fn run(self) -> io::Result<()> {
        let (mountpoint, dev, rings) = (self.mountpoint, self.dev, self.rings);
        let fd = self.session.as_fd().as_raw_fd();
        let result = devloop::run(self.fs, self.access, fd, self.threads, ring_payload_size() + REQUEST_HEADROOM);
        // Dropping the session ends the stack (`Classic::destroy`).
        drop(self.session);
        if let Some(rings) = rings {
            // The kernel hands every ring entry back when the connection ends.
            rings.join(std::time::Duration::from_secs(5));
        }
        match result {
            Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => {
                let still_mounted = dev.is_none_or(|dev| mountinfo::mounts().iter().any(|m| m.dev == dev));
                if still_mounted {
                    Err(io::Error::new(
                        e.kind(),
                        format!("the kernel aborted the FUSE connection; the mount is dead until `plyfs umount {}`", mountpoint.display()),
                    ))
                } else {
                    Ok(())
                }
            }
            other => other,
        }
    }
}

/// The size of each ring entry's payload buffer: what the kernel may put in one request,
/// `max(max_write, max_pages * PAGE_SIZE)` (fuser asks max_pages for `MAX_WRITE`).
fn ring_payload_size() -> usize {
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    (MAX_WRITE as usize).div_ceil(page) * page
}

/// Set the read-ahead of the mount's backing device (`/sys/class/bdi/MAJ:MIN`). FUSE caps what
/// a daemon may ask for at the kernel's default (128 KiB), so it is set here, as root may.
fn set_readahead(dev: &str, kb: u32) {
    let path = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    match std::fs::write(&path, kb.to_string()) {
        Ok(()) => tracing::debug!("read-ahead {kb} KiB ({path})"),
        Err(e) => tracing::warn!("cannot set the read-ahead to {kb} KiB ({path}: {e}); the kernel's default stays"),
    }
}

/// The option string `fusermount3` and the kernel share.
fn fuse_options(config: &Config) -> Vec<String> {
    let mut opts = vec!["default_permissions".to_owned()];
    match config.acl {
        SessionACL::All => opts.push("allow_other".into()),
        // The kernel knows only allow_other; fuser turns away other users itself.
        SessionACL::RootAndOwner => opts.push("allow_other".into()),
        SessionACL::Owner => {}
    }
    opts
}

fn fsname(config: &Config) -> String {
    config
        .mount_options
        .iter()
        .find_map(|o| match o {
            MountOption::FSName(n) => Some(n.clone()),
            _ => None,
        })
        .unwrap_or_else(|| "plyfs".into())
}

/// Open `/dev/fuse` and mount with `mount(2)`, as type `fuse.plyfs`. `None` when this process
/// may not (no access to `/dev/fuse`, or no CAP_SYS_ADMIN).
fn mount_directly(mountpoint: &Path, config: &Config) -> Result<Option<OwnedFd>, MountError> {
    let dev = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if dev < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EACCES | libc::EPERM) => Ok(None),
            _ => Err(Error::Device { why: format!("opening it: {e} (is the fuse module loaded?)") }),
        };
    }
    let dev = unsafe { OwnedFd::from_raw_fd(dev) };
    let root_mode = std::fs::metadata(mountpoint)
        .map(|m| std::os::unix::fs::MetadataExt::mode(&m) & libc::S_IFMT)
        .unwrap_or(libc::S_IFDIR);
    let mut data = format!(
        "fd={},rootmode={:o},user_id={},group_id={}",
        dev.as_raw_fd(),
        root_mode,
        unsafe { libc::getuid() },
        unsafe { libc::getgid() }
    );
    for o in fuse_options(config) {
        data.push(',');
        data.push_str(&o);
    }
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    for o in &config.mount_options {
        match o {
            MountOption::RO => flags |= libc::MS_RDONLY,
            MountOption::Dev => flags &= !libc::MS_NODEV,
            MountOption::Suid => flags &= !libc::MS_NOSUID,
            MountOption::NoExec => flags |= libc::MS_NOEXEC,
            MountOption::NoAtime => flags |= libc::MS_NOATIME,
            MountOption::Sync => flags |= libc::MS_SYNCHRONOUS,
            MountOption::DirSync => flags |= libc::MS_DIRSYNC,
            MountOption::CUSTOM(o) if o == "nodiratime" => flags |= libc::MS_NODIRATIME,
            MountOption::CUSTOM(o) if o == "strictatime" => flags |= libc::MS_STRICTATIME,
            _ => {}
        }
    }
    let failed = |why: &str| Error::Mount { mountpoint: mountpoint.to_owned(), why: why.to_owned() };
    let source = CString::new(fsname(config)).map_err(|_| failed("fsname has a NUL byte"))?;
    let target = CString::new(mountpoint.as_os_str().as_bytes()).map_err(|_| failed("the path has a NUL byte"))?;
    let data = CString::new(data).expect("no NUL in options");
    let rc = unsafe {
        libc::mount(source.as_ptr(), target.as_ptr(), c"fuse.plyfs".as_ptr(), flags, data.as_ptr().cast())
    };
    if rc == 0 {
        return Ok(Some(dev));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EPERM) => Ok(None),
        _ => Err(failed(&e.to_string())),
    }
}

/// Mount through `fusermount3`, which opens `/dev/fuse`, mounts, and sends the descriptor back
/// over a socket (`_FUSE_COMMFD`).
fn fusermount(mountpoint: &Path, config: &Config) -> Result<OwnedFd, MountError> {
    let mut opts = fuse_options(config);
    for o in &config.mount_options {
        let s = match o {
            MountOption::FSName(n) => format!("fsname={n}"),
            MountOption::Subtype(n) => format!("subtype={n}"),
            MountOption::DefaultPermissions => continue,
            MountOption::RO => "ro".into(),
            MountOption::RW => "rw".into(),
            MountOption::NoDev => "nodev".into(),
            MountOption::Dev => "dev".into(),
            MountOption::NoSuid => "nosuid".into(),
            MountOption::Suid => "suid".into(),
            MountOption::NoExec => "noexec".into(),
            MountOption::Exec => "exec".into(),
            MountOption::NoAtime => "noatime".into(),
            MountOption::Atime => "atime".into(),
            MountOption::Sync => "sync".into(),
            MountOption::Async => "async".into(),
            MountOption::DirSync => "dirsync".into(),
            MountOption::CUSTOM(o) => o.clone(),
            other => format!("{other:?}").to_lowercase(),
        };
        opts.push(s);
    }
    let failed = |why: String| Error::Mount { mountpoint: mountpoint.to_owned(), why };
    let (ours, theirs) = UnixStream::pair().map_err(|e| failed(format!("fusermount3: making its socket: {e}")))?;
    let their_fd = theirs.as_raw_fd();
    let mut cmd = Command::new("fusermount3");
    cmd.arg("-o").arg(opts.join(",")).arg("--").arg(mountpoint);
    cmd.env("_FUSE_COMMFD", their_fd.to_string()).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let flags = libc::fcntl(their_fd, libc::F_GETFD);
            if flags < 0 || libc::fcntl(their_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| failed(format!("cannot open /dev/fuse and cannot run fusermount3 ({e}): install the fuse3 package")))?;
    drop(theirs);
    let received = receive_fd(&ours);
    drop(ours);
    let output = child.wait_with_output().map_err(|e| failed(format!("fusermount3: waiting for it: {e}")))?;
    match received {
        Some(fd) => Ok(fd),
        None => {
            let msg = String::from_utf8_lossy(&output.stderr);
            let msg = msg.trim().trim_start_matches("fusermount3: ");
            Err(failed(format!("fusermount3: {msg}")))
        }
    }
}

fn receive_fd(sock: &UnixStream) -> Option<OwnedFd> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!(std::os::fd::RawFd);
    let msg = loop {
        match recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::empty()) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other.ok()?,
        }
    };
    for cmsg in msg.cmsgs().ok()? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            if let Some(&fd) = fds.first() {
                return Some(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    None
}

fn fusermount_unmount(mountpoint: &Path, lazy: bool) -> Result<(), Error> {
    let failed = |why: String| Error::Unmount { mountpoint: mountpoint.to_owned(), why };
    let mut cmd = Command::new("fusermount3");
    cmd.arg(if lazy { "-uz" } else { "-u" }).arg("--").arg(mountpoint);
    let out = cmd.output().map_err(|e| failed(format!("running fusermount3: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        let msg = String::from_utf8_lossy(&out.stderr);
        Err(failed(msg.trim().trim_start_matches("fusermount3: ").to_owned()))
    }
}

/// How an unmount went.
#[derive(Debug, PartialEq, Eq)]
pub enum Unmounted {
    Done,
    /// Detached from the name space; the daemon serves open files until they are closed.
    Lazily,
}

/// Unmount `mountpoint`. Without `lazy`, a busy mount is an error, as for `umount`. A stale
/// mount (its daemon killed) unmounts like any other.
///
/// A mount is also busy for as long as another process's `statfs` of it takes (`df`, and
/// anything else that looks at every mount, holds it meanwhile): such an `EBUSY` passes within
/// moments, so it is tried again for up to two seconds before it is the answer.
pub fn unmount(mountpoint: &Path, lazy: bool) -> Result<Unmounted, Error> {
    let failed = |why: &str| Error::Unmount { mountpoint: mountpoint.to_owned(), why: why.to_owned() };
    let c = CString::new(mountpoint.as_os_str().as_bytes()).map_err(|_| failed("the path has a NUL byte"))?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let err = loop {
        if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
            return Ok(if lazy { Unmounted::Lazily } else { Unmounted::Done });
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EBUSY) || std::time::Instant::now() >= deadline {
            break err;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    match err.raw_os_error() {
        Some(libc::EPERM) => fusermount_unmount(mountpoint, lazy).map(|()| if lazy { Unmounted::Lazily } else { Unmounted::Done }),
        Some(libc::EBUSY) => Err(failed("busy: files on it are in use (close them, or unmount with --lazy)")),
        Some(libc::EINVAL) => Err(failed("not a mount point")),
        _ => Err(failed(&err.to_string())),
    }
}
