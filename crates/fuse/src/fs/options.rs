//! What the front end is told (its tunables, who may use the fan-in views) and what it tells
//! whoever mounted it (how file data moves, whether the mount is in use).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

/// Tunables of the front end.
#[derive(Clone, Debug)]
pub struct FrontOptions {
    pub entry_ttl: Duration,
    pub attr_ttl: Duration,
    /// Use FUSE passthrough where the stack allows it.
    pub passthrough: bool,
    /// Why passthrough is off when the mount knows better than `-o passthrough=off`.
    pub no_passthrough_because: Option<String>,
    /// Other mounts share the lowers (`-o shared`): pages are not kept from one open to the
    /// next (close-to-open consistency, as NFS gives).
    pub shared: bool,
    /// Who may use the fan-in paths under `.plyfs/` (`-o fanin=owner|all|none`).
    pub fanin: FanIn,
}

/// Who may reach the fan-in views under `MNT/.plyfs/` (`-o fanin=`). The views go below layers
/// (a `trace` audit, a per-file policy), so they are the mount owner's to hand out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FanIn {
    /// The mount's owner and root (the default): `.plyfs` is mode 0500, owned by the owner;
    /// anyone else gets `EACCES`.
    #[default]
    Owner,
    /// Every user the mount lets in (`allow_other`), as far as the files' own modes allow.
    All,
    /// No one: `.plyfs` does not resolve (`ENOENT`); `OP@LAYER` through `plyfs op` still works.
    None,
}

impl FanIn {
    pub fn parse(text: &str) -> Option<FanIn> {
        match text {
            "owner" => Some(FanIn::Owner),
            "all" => Some(FanIn::All),
            "none" => Some(FanIn::None),
            _ => None,
        }
    }
}

impl Default for FrontOptions {
    fn default() -> Self {
        FrontOptions {
            entry_ttl: Duration::from_secs(1),
            attr_ttl: Duration::from_secs(1),
            passthrough: true,
            no_passthrough_because: None,
            shared: false,
            fanin: FanIn::Owner,
        }
    }
}

/// How file data moves, as decided when the kernel and the daemon agreed on features.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// Reads and writes go from the kernel to the lower files; the daemon is not on the path.
    Passthrough,
    /// Passthrough for files that no data layer encodes; the files a per-file chain (or the
    /// default chain) encodes use FUSE I/O with the page cache kept.
    Mixed,
    /// Reads and writes reach the daemon; the kernel page cache is kept across opens.
    Cached { reason: String },
}

impl std::fmt::Display for IoMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoMode::Passthrough => f.write_str("passthrough (the kernel reads and writes the lower files directly)"),
            IoMode::Mixed => f.write_str(
                "passthrough for files that no data layer encodes (the kernel reads and writes the lower files directly); FUSE I/O with the page cache kept for the files a data layer encodes",
            ),
            IoMode::Cached { reason } => write!(f, "FUSE I/O with the page cache kept ({reason})"),
        }
    }
}

/// What the front end shares with whoever mounted it.
pub struct FrontStatus {
    pub(super) io_mode: Mutex<Option<IoMode>>,
    pub(super) passthrough_failed: AtomicBool,
    /// The kernel refuses the lower file system's files for passthrough (found at mount).
    pub(super) passthrough_refused: AtomicBool,
    /// A request was served since [`FrontStatus::take_active`] last looked.
    pub(super) active: AtomicBool,
    /// Files and directories open now.
    pub(super) open: std::sync::atomic::AtomicI64,
}

impl FrontStatus {
    /// Whether any request was served since the last call (for `-o idle`).
    pub fn take_active(&self) -> bool {
        self.active.swap(false, Ordering::Relaxed)
    }

    /// How many files and directories are open through the mount.
    pub fn open_count(&self) -> i64 {
        self.open.load(Ordering::Relaxed)
    }

    pub(super) fn opened(&self, by: i64) {
        self.open.fetch_add(by, Ordering::Relaxed);
    }

    pub fn io_mode(&self) -> Option<IoMode> {
        self.io_mode.lock().clone()
    }

    /// Passthrough cannot serve this mount's files: every file uses FUSE I/O.
    pub(crate) fn refuse_passthrough(&self, reason: String) {
        self.passthrough_refused.store(true, Ordering::Relaxed);
        *self.io_mode.lock() = Some(IoMode::Cached { reason });
    }
}
