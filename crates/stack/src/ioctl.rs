//! The ioctls a stack answers: the file-attribute flags of `lsattr`/`chattr` (`FS_IOC_GETFLAGS`,
//! `FS_IOC_SETFLAGS`) and of `xfs_io -c chattr` (`FS_IOC_FSGETXATTR`, `FS_IOC_FSSETXATTR`), which
//! the kernel sends a FUSE file system through its fileattr calls. The bottom layer passes them to
//! the lower file; layers that change the data refuse them for the files they encode. Clones
//! (`FICLONE`) and extent maps (`FS_IOC_FIEMAP`) never reach a FUSE daemon: the kernel answers
//! them itself (`EOPNOTSUPP`), having no FUSE call for either.

/// `_IOR('f', 1, long)`.
pub const FS_IOC_GETFLAGS: u32 = 0x8008_6601;
/// `_IOW('f', 2, long)`.
pub const FS_IOC_SETFLAGS: u32 = 0x4008_6602;
/// `_IOR('X', 31, struct fsxattr)`.
pub const FS_IOC_FSGETXATTR: u32 = 0x801c_581f;
/// `_IOW('X', 32, struct fsxattr)`.
pub const FS_IOC_FSSETXATTR: u32 = 0x401c_5820;

/// Synchronous updates (`chattr +S`), one of the flags `FS_IOC_GETFLAGS` reads.
pub const FS_SYNC_FL: u32 = 0x08;
/// No change at all (`chattr +i`).
pub const FS_IMMUTABLE_FL: u32 = 0x10;
/// Appends only (`chattr +a`).
pub const FS_APPEND_FL: u32 = 0x20;
/// No access times (`chattr +A`).
pub const FS_NOATIME_FL: u32 = 0x80;

/// Whether the stack answers `cmd` at all.
pub fn known(cmd: u32) -> bool {
    matches!(cmd, FS_IOC_GETFLAGS | FS_IOC_SETFLAGS | FS_IOC_FSGETXATTR | FS_IOC_FSSETXATTR)
}

/// Whether `cmd` changes the file.
pub fn sets(cmd: u32) -> bool {
    matches!(cmd, FS_IOC_SETFLAGS | FS_IOC_FSSETXATTR)
}
