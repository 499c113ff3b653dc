//! Plain data types that travel through the stack with operations.

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Identifies a file-system object at one level of the stack, and is the inode number users see
/// (`st_ino`): the same for every hard link of a file, and stable for the life of the mount.
///
/// Each layer presents node ids to the layer above it. A layer that does not remap objects (most
/// layers) passes the ids of the layer below through unchanged. An id is not reused while the
/// layer above still holds lookups of it. Ids fit in 56 bits: the FUSE front end uses the top
/// byte to tell levels apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u64);

impl NodeId {
    /// The root directory of every level.
    pub const ROOT: NodeId = NodeId(1);
    /// The largest id a layer may hand out.
    pub const MAX: u64 = (1 << 56) - 1;
}

/// An open file or directory, as returned by `open`, `create` or `opendir` at some level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileHandle(pub u64);

/// The caller of an operation: the process on whose behalf the kernel sent it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    /// Set for a caller that nobody checked before the stack (a client that `plyfs serve` maps
    /// to an identity): the bottom layer then runs each of its operations as `uid`, `gid` and
    /// these supplementary groups, so the kernel applies its own rules. Only the server sets it;
    /// nothing in a request can.
    pub confined: Option<Groups>,
}

/// A caller's supplementary groups, held inline so that [`Caller`] stays `Copy`. Lists longer
/// than [`Groups::MAX`] keep their first `MAX` groups, as NFS's AUTH_SYS does with 16: a
/// group left out can only grant less.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Groups {
    len: u8,
    ids: [u32; Groups::MAX],
}

impl Groups {
    pub const MAX: usize = 32;

    pub fn new(ids: &[u32]) -> Groups {
        let mut g = Groups { len: 0, ids: [0; Groups::MAX] };
        for &id in ids.iter().take(Groups::MAX) {
            g.ids[g.len as usize] = id;
            g.len += 1;
        }
        g
    }

    pub fn as_slice(&self) -> &[u32] {
        &self.ids[..self.len as usize]
    }

    pub fn contains(&self, gid: u32) -> bool {
        self.as_slice().contains(&gid)
    }
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl Caller {
    /// A caller the kernel (or a trusted peer) has already checked.
    pub const fn new(uid: u32, gid: u32, pid: u32) -> Caller {
        Caller { uid, gid, pid, confined: None }
    }

    /// A caller whose every operation must run with these ids (see [`Caller::confined`]).
    pub fn confined(uid: u32, gid: u32, pid: u32, groups: &[u32]) -> Caller {
        Caller { uid, gid, pid, confined: Some(Groups::new(groups)) }
    }

    /// Whether the caller is in group `gid` (its own, or a supplementary one when known).
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.confined.is_some_and(|g| g.contains(gid))
    }

    /// The daemon itself, for operations that no user process asked for (offline tools, tests,
    /// the control socket).
    pub fn daemon() -> Caller {
        static DAEMON: std::sync::OnceLock<Caller> = std::sync::OnceLock::new();
        // SAFETY: these calls cannot fail. The daemon never changes its own ids (it switches
        // only the file-system ids, per thread, for the duration of a call).
        *DAEMON.get_or_init(|| unsafe { Caller::new(libc::geteuid(), libc::getegid(), 0) })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl FileKind {
    /// The `S_IFMT` bits of a mode of this kind.
    pub fn mode_bits(self) -> u32 {
        match self {
            FileKind::File => libc::S_IFREG,
            FileKind::Dir => libc::S_IFDIR,
            FileKind::Symlink => libc::S_IFLNK,
            FileKind::Fifo => libc::S_IFIFO,
            FileKind::Socket => libc::S_IFSOCK,
            FileKind::CharDevice => libc::S_IFCHR,
            FileKind::BlockDevice => libc::S_IFBLK,
        }
    }

    /// From the `S_IFMT` bits of a mode.
    pub fn from_mode(mode: u32) -> Option<FileKind> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => FileKind::File,
            libc::S_IFDIR => FileKind::Dir,
            libc::S_IFLNK => FileKind::Symlink,
            libc::S_IFIFO => FileKind::Fifo,
            libc::S_IFSOCK => FileKind::Socket,
            libc::S_IFCHR => FileKind::CharDevice,
            libc::S_IFBLK => FileKind::BlockDevice,
            _ => return None,
        })
    }

    /// From a `d_type` value of `getdents`.
    pub fn from_dirent_type(d_type: u8) -> Option<FileKind> {
        Some(match d_type {
            libc::DT_REG => FileKind::File,
            libc::DT_DIR => FileKind::Dir,
            libc::DT_LNK => FileKind::Symlink,
            libc::DT_FIFO => FileKind::Fifo,
            libc::DT_SOCK => FileKind::Socket,
            libc::DT_CHR => FileKind::CharDevice,
            libc::DT_BLK => FileKind::BlockDevice,
            _ => return None,
        })
    }
}

/// The attributes of an object, as `stat` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attr {
    pub size: u64,
    /// 512-byte blocks in use.
    pub blocks: u64,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
    pub kind: FileKind,
    /// Permission bits, including set-id and sticky bits (no type bits).
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
}

/// The reply to a name lookup: the node, its attributes, and a generation for NFS-style reuse
/// detection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub node: NodeId,
    pub attr: Attr,
    pub generation: u64,
}

/// `t` as seconds and nanoseconds since the epoch, as `struct timespec` has it: seconds are
/// negative before the epoch, nanoseconds never.
pub fn unix_time(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => {
            let d = e.duration();
            match d.subsec_nanos() {
                0 => (-(d.as_secs() as i64), 0),
                n => (-(d.as_secs() as i64) - 1, 1_000_000_000 - n),
            }
        }
    }
}

/// The time `secs` seconds and `nanos` nanoseconds after the epoch (the inverse of
/// [`unix_time`]). Values from outside the process (a lower file system, the wire, a volume)
/// never panic: nanoseconds are held below a second and times past what the system can hold
/// stop at its limit.
pub fn from_unix_time(secs: i64, nanos: u32) -> SystemTime {
    let nanos = Duration::from_nanos(u64::from(nanos.min(999_999_999)));
    let whole = if secs >= 0 {
        UNIX_EPOCH.checked_add(Duration::from_secs(secs as u64))
    } else {
        UNIX_EPOCH.checked_sub(Duration::from_secs(secs.unsigned_abs()))
    };
    whole.and_then(|t| t.checked_add(nanos)).or(whole).unwrap_or(UNIX_EPOCH)
}

/// A time to set with `setattr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeSet {
    Now,
    At(SystemTime),
}

/// What `setattr` changes; `None` leaves a field alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
}

/// The result of `open` or `create` on a file.
#[derive(Clone, Debug)]
pub struct Opened {
    pub fh: FileHandle,
    /// The lower file whose bytes are exactly what this level shows, if the levels it came up
    /// through changed no data. The FUSE front end hands it to the kernel (passthrough), so
    /// reads and writes no longer reach the daemon. Layers that transform or observe data must
    /// not let it through; the stack strips it for them (see [`crate::DataPath`]).
    pub backing: Option<Arc<OwnedFd>>,
    /// Ask the kernel not to cache this file's pages (each read and write reaches the stack).
    pub direct_io: bool,
    /// The stack wants `flush` at every close of a descriptor. Without it the kernel skips that
    /// round trip. A layer that buffers data until close must set it.
    pub flush_on_close: bool,
}

/// One directory entry as returned by `readdir`.
#[derive(Clone, Debug)]
pub struct DirEntry {
    pub name: OsString,
    /// The node a lookup of the name would return (its inode number).
    pub node: NodeId,
    pub kind: FileKind,
    /// The offset to pass to `readdir` to continue after this entry.
    pub next_offset: u64,
    /// For `readdirplus`: the looked-up entry (counts as one lookup of the node). `None` for `.`
    /// and `..`, which are never looked up this way.
    pub entry: Option<Entry>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// Whether `name` is one of the extended attributes that hold POSIX ACLs.
pub fn is_posix_acl_xattr(name: &std::ffi::OsStr) -> bool {
    name == "system.posix_acl_access" || name == "system.posix_acl_default"
}

/// The reply to `getxattr` and `listxattr`: the value (or the NUL-separated name list), or only
/// its size when the caller asked with a zero-size buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XattrReply {
    Data(Vec<u8>),
    Size(u32),
}

#[cfg(test)]
mod time_tests {
    use super::*;

    #[test]
    fn unix_times_round_trip_and_bad_ones_never_panic() {
        for (secs, nanos) in [(0, 0), (1, 5), (1_700_000_000, 999_999_999), (-1, 0), (-1, 500_000_000), (-86_400 * 365, 1)] {
            let t = from_unix_time(secs, nanos);
            assert_eq!(unix_time(t), (secs, nanos), "{secs}.{nanos}");
        }
        // One nanosecond before the epoch is second -1 plus 999,999,999 ns, as in a timespec.
        assert_eq!(unix_time(UNIX_EPOCH - Duration::from_nanos(1)), (-1, 999_999_999));
        // From outside: nanoseconds past a second are held below it; the extremes do not panic.
        assert_eq!(unix_time(from_unix_time(7, 2_000_000_000)), (7, 999_999_999));
        from_unix_time(i64::MAX, u32::MAX);
        from_unix_time(i64::MIN, u32::MAX);
    }
}
