//! FUSE over io_uring (Linux 6.14 and later): one request queue per CPU, served by threads
//! pinned to that CPU, so a request and its answer never cross CPUs. Each queue entry is a
//! pair of buffers the kernel fills with a request (`FUSE_IO_URING_CMD_REGISTER`) and takes the
//! answer from when the daemon commits it (`FUSE_IO_URING_CMD_COMMIT_AND_FETCH`, which also
//! waits for the next request). See `fs/fuse/dev_uring.c` in the kernel.
//!
//! The `/dev/fuse` loop ([`crate::devloop`]) keeps running beside the rings: it carries FORGET
//! and INTERRUPT, and fuser's channel sends the daemon's notifications. [`dispatch`] decodes
//! the requests of both.
//!
//! The layouts below are those of `include/uapi/linux/fuse.h`, ABI 7.40, without the
//! extensions plyfs does not negotiate (security contexts, supplementary groups, extended
//! setxattr).

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use plyfs_stack::{from_unix_time, unix_time, Attr, Caller, FileKind, SetAttr, TimeSet, XattrReply};

use crate::devloop::Access;
use crate::fs::{DirSink, FuseFs, NodeOut, OpenOut, Res};
use crate::Error;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// Threads serving each CPU's queue: one can wait on a slow request (an fsync, a lock) while
/// the other serves the next.
const THREADS_PER_QUEUE: usize = 2;
/// Queue entries each thread registers.
const ENTRIES_PER_THREAD: usize = 2;

pub(crate) mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const IOCTL: u32 = 39;
    pub const NOTIFY_REPLY: u32 = 41;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
    pub const COPY_FILE_RANGE: u32 = 47;
}

// FATTR_* bits of fuse_setattr_in.valid.
const FATTR_MODE: u32 = 1 << 0;
const FATTR_UID: u32 = 1 << 1;
const FATTR_GID: u32 = 1 << 2;
const FATTR_SIZE: u32 = 1 << 3;
const FATTR_ATIME: u32 = 1 << 4;
const FATTR_MTIME: u32 = 1 << 5;
const FATTR_FH: u32 = 1 << 6;
const FATTR_ATIME_NOW: u32 = 1 << 7;
const FATTR_MTIME_NOW: u32 = 1 << 8;
const FUSE_GETATTR_FH: u32 = 1;
const FUSE_FSYNC_FDATASYNC: u32 = 1;
const FUSE_WRITE_KILL_SUIDGID: u32 = 1 << 2;

/// `struct fuse_uring_req_header`: the request's `fuse_in_header` (the answer's
/// `fuse_out_header` goes in the same place), the operation's own header, and
/// `struct fuse_uring_ent_in_out`.
#[repr(C, align(8))]
struct Headers {
    in_out: [u8; 128],
    op_in: [u8; 128],
    ent_in_out: [u8; 32],
}

/// One queue entry: its headers and payload buffer, registered with the kernel for good.
struct QueueEntry {
    headers: Box<Headers>,
    payload: Vec<u8>,
    iov: Box<[libc::iovec; 2]>,
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(b[at..at + 4].try_into().unwrap())
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(b[at..at + 8].try_into().unwrap())
}

/// `struct fuse_in_header`.
pub(crate) struct InHeader {
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub caller: Caller,
}

/// The size of `struct fuse_in_header`.
pub(crate) const IN_HEADER_SIZE: usize = 40;

impl InHeader {
    pub(crate) fn parse(b: &[u8]) -> InHeader {
        InHeader {
            opcode: u32_at(b, 4),
            unique: u64_at(b, 8),
            nodeid: u64_at(b, 16),
            caller: Caller::new(u32_at(b, 24), u32_at(b, 28), u32_at(b, 32)),
        }
    }
}

/// Writes an answer into a buffer, in the kernel's layouts.
struct Out<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl<'a> Out<'a> {
    fn new(buf: &'a mut [u8]) -> Out<'a> {
        Out { buf, len: 0 }
    }

    fn room(&self) -> usize {
        self.buf.len() - self.len
    }

    fn bytes(&mut self, b: &[u8]) {
        self.buf[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
    }

    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_ne_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_ne_bytes());
    }

    fn zeros(&mut self, n: usize) {
        self.buf[self.len..self.len + n].fill(0);
        self.len += n;
    }

    /// `struct fuse_attr` (88 bytes).
    fn attr(&mut self, ino: u64, a: &Attr) {
        let (at, atn) = unix_time(a.atime);
        let (mt, mtn) = unix_time(a.mtime);
        let (ct, ctn) = unix_time(a.ctime);
        self.u64(ino);
        self.u64(a.size);
        self.u64(a.blocks);
        self.u64(at as u64);
        self.u64(mt as u64);
        self.u64(ct as u64);
        self.u32(atn);
        self.u32(mtn);
        self.u32(ctn);
        self.u32(a.kind.mode_bits() | u32::from(a.perm));
        self.u32(a.nlink);
        self.u32(a.uid);
        self.u32(a.gid);
        self.u32(a.rdev);
        self.u32(a.blksize);
        self.u32(0);
    }

    /// `struct fuse_entry_out` (128 bytes).
    fn entry(&mut self, n: &NodeOut, entry_ttl: Duration, attr_ttl: Duration) {
        self.u64(n.ino);
        self.u64(n.generation);
        self.u64(entry_ttl.as_secs());
        self.u64(attr_ttl.as_secs());
        self.u32(entry_ttl.subsec_nanos());
        self.u32(attr_ttl.subsec_nanos());
        self.attr(n.ino, &n.attr);
    }

    /// `struct fuse_open_out` (16 bytes).
    fn open(&mut self, o: &OpenOut) {
        self.u64(o.fh);
        self.u32(o.flags);
        self.u32(o.backing.as_ref().map_or(0, |b| b.id));
    }

    /// `struct fuse_dirent` and its name, padded to 8 bytes.
    fn dirent(&mut self, ino: u64, offset: u64, kind: FileKind, name: &[u8]) {
        self.u64(ino);
        self.u64(offset);
        self.u32(name.len() as u32);
        self.u32(kind.mode_bits() >> 12);
        self.bytes(name);
        self.zeros(dirent_pad(name.len()));
    }
}

const DIRENT_SIZE: usize = 24;
const ENTRY_OUT_SIZE: usize = 128;

fn dirent_pad(name_len: usize) -> usize {
    (8 - (DIRENT_SIZE + name_len) % 8) % 8
}

/// The NUL-terminated name at the start of `b`, and what follows it.
fn name(b: &[u8]) -> Res<(&OsStr, &[u8])> {
    let end = b.iter().position(|&c| c == 0).ok_or(libc::EINVAL)?;
    Ok((OsStr::from_bytes(&b[..end]), &b[end + 1..]))
}

/// Readdir entries written straight into the answer buffer, up to the size the kernel asked.
struct RingDir<'a> {
    out: Out<'a>,
    limit: usize,
    plus: bool,
}

impl DirSink for RingDir<'_> {
    fn push(&mut self, ino: u64, offset: u64, kind: FileKind, name: &OsStr, node: &NodeOut, ttl: Duration) -> bool {
        let name = name.as_bytes();
        let need = if self.plus { ENTRY_OUT_SIZE } else { 0 } + DIRENT_SIZE + name.len() + dirent_pad(name.len());
        if self.out.len + need > self.limit {
            return false;
        }
        if self.plus {
            self.out.entry(node, ttl, ttl);
        }
        self.out.dirent(ino, offset, kind, name);
        true
    }
}

/// Answer one request: decode it from the operation header `h` and the payload's first
/// `in_len` bytes, call the handler, and write the answer over the payload. Returns the
/// answer's length, or the errno.
pub(crate) fn dispatch(fs: &FuseFs, access: &Access, h: &InHeader, op_in: &[u8], payload: &mut [u8], in_len: usize) -> Res<usize> {
    if !access.allows(h) {
        return Err(libc::EACCES);
    }
    let cx = &h.caller;
    let ino = h.nodeid;
    let entry_ttl = fs.options.entry_ttl;
    let entry = |payload: &mut [u8], n: Res<NodeOut>| -> Res<usize> {
        let n = n?;
        let mut out = Out::new(payload);
        out.entry(&n, entry_ttl, fs.attr_ttl(n.ino));
        Ok(out.len)
    };
    let attr = |payload: &mut [u8], n: Res<NodeOut>| -> Res<usize> {
        let n = n?;
        let attr_ttl = fs.attr_ttl(n.ino);
        let mut out = Out::new(payload);
        out.u64(attr_ttl.as_secs());
        out.u32(attr_ttl.subsec_nanos());
        out.u32(0);
        out.attr(n.ino, &n.attr);
        Ok(out.len)
    };
    let xattr = |payload: &mut [u8], x: Res<XattrReply>| -> Res<usize> {
        let mut out = Out::new(payload);
        match x? {
            XattrReply::Size(n) => {
                out.u32(n);
                out.u32(0);
            }
            XattrReply::Data(d) => {
                if d.len() > out.room() {
                    return Err(libc::ERANGE);
                }
                out.bytes(&d);
            }
        }
        Ok(out.len)
    };
    let empty = |r: Res<()>| r.map(|()| 0);

    match h.opcode {
        op::LOOKUP => {
            let n = fs.lookup(cx, ino, name(&payload[..in_len])?.0);
            entry(payload, n)
        }
        op::GETATTR => {
            let fh = (u32_at(op_in, 0) & FUSE_GETATTR_FH != 0).then(|| u64_at(op_in, 8));
            attr(payload, fs.getattr(cx, ino, fh))
        }
        op::SETATTR => {
            let valid = u32_at(op_in, 0);
            let has = |bit: u32| valid & bit != 0;
            let time = |bit: u32, now: u32, secs_at: usize, nsecs_at: usize| {
                has(bit).then(|| if has(now) { TimeSet::Now } else { TimeSet::At(from_unix_time(u64_at(op_in, secs_at) as i64, u32_at(op_in, nsecs_at))) })
            };
            let set = SetAttr {
                mode: has(FATTR_MODE).then(|| u32_at(op_in, 68)),
                uid: has(FATTR_UID).then(|| u32_at(op_in, 76)),
                gid: has(FATTR_GID).then(|| u32_at(op_in, 80)),
                size: has(FATTR_SIZE).then(|| u64_at(op_in, 16)),
                atime: time(FATTR_ATIME, FATTR_ATIME_NOW, 32, 56),
                mtime: time(FATTR_MTIME, FATTR_MTIME_NOW, 40, 60),
            };
            let fh = has(FATTR_FH).then(|| u64_at(op_in, 8));
            attr(payload, fs.setattr(cx, ino, fh, set))
        }
        op::READLINK => {
            let target = fs.readlink(cx, ino)?;
            let mut out = Out::new(payload);
            if target.len() > out.room() {
                return Err(libc::ENAMETOOLONG);
            }
            out.bytes(&target);
            Ok(out.len)
        }
        op::SYMLINK => {
            let n = {
                let (link, rest) = name(&payload[..in_len])?;
                let (target, _) = name(rest)?;
                fs.symlink(cx, ino, link, Path::new(target))
            };
            entry(payload, n)
        }
        op::MKNOD => {
            // struct fuse_mknod_in: mode, rdev, umask.
            let n = fs.mknod(cx, ino, name(&payload[..in_len])?.0, u32_at(op_in, 0), u32_at(op_in, 8), u32_at(op_in, 4));
            entry(payload, n)
        }
        op::MKDIR => {
            // struct fuse_mkdir_in: mode, umask.
            let n = fs.mkdir(cx, ino, name(&payload[..in_len])?.0, u32_at(op_in, 0), u32_at(op_in, 4));
            entry(payload, n)
        }
        op::UNLINK => empty(fs.unlink(cx, ino, name(&payload[..in_len])?.0)),
        op::RMDIR => empty(fs.rmdir(cx, ino, name(&payload[..in_len])?.0)),
        op::RENAME | op::RENAME2 => {
            let flags = if h.opcode == op::RENAME2 { u32_at(op_in, 8) } else { 0 };
            let (old, rest) = name(&payload[..in_len])?;
            let (new, _) = name(rest)?;
            empty(fs.rename(cx, ino, old, u64_at(op_in, 0), new, flags))
        }
        op::LINK => {
            let n = fs.link(cx, u64_at(op_in, 0), ino, name(&payload[..in_len])?.0);
            entry(payload, n)
        }
        op::OPEN | op::OPENDIR => {
            let o = if h.opcode == op::OPEN { fs.open(cx, ino, u32_at(op_in, 0) as i32) } else { fs.opendir(cx, ino) }?;
            let mut out = Out::new(payload);
            out.open(&o);
            Ok(out.len)
        }
        op::CREATE => {
            // struct fuse_create_in: flags, mode, umask, open_flags.
            let (flags, mode, umask) = (u32_at(op_in, 0) as i32, u32_at(op_in, 4), u32_at(op_in, 8));
            let (n, o) = fs.create(cx, ino, name(&payload[..in_len])?.0, mode, umask, flags)?;
            let mut out = Out::new(payload);
            // The attributes of a file just made are current (see `FuseFs::open_out`).
            out.entry(&n, entry_ttl, fs.options.attr_ttl);
            out.open(&o);
            Ok(out.len)
        }
        op::READ => {
            let (fh, offset, size) = (u64_at(op_in, 0), u64_at(op_in, 8), u32_at(op_in, 16));
            let data = fs.read(cx, ino, fh, offset, size.min(payload.len() as u32))?;
            let len = data.len().min(payload.len());
            payload[..len].copy_from_slice(&data[..len]);
            Ok(len)
        }
        op::WRITE => {
            let (fh, offset, size, flags) = (u64_at(op_in, 0), u64_at(op_in, 8), u32_at(op_in, 16), u32_at(op_in, 20));
            let data = payload.get(..size as usize).ok_or(libc::EINVAL)?;
            let n = fs.write(cx, ino, fh, offset, data, flags & FUSE_WRITE_KILL_SUIDGID != 0)?;
            let mut out = Out::new(payload);
            out.u32(n);
            out.u32(0);
            Ok(out.len)
        }
        op::STATFS => {
            let s = fs.statfs(cx, ino)?;
            let mut out = Out::new(payload);
            for v in [s.blocks, s.bfree, s.bavail, s.files, s.ffree] {
                out.u64(v);
            }
            for v in [s.bsize, s.namelen, s.frsize] {
                out.u32(v);
            }
            out.zeros(4 + 6 * 4);
            Ok(out.len)
        }
        op::RELEASE => empty(fs.release(cx, ino, u64_at(op_in, 0))),
        op::RELEASEDIR => empty(fs.releasedir(cx, ino, u64_at(op_in, 0))),
        op::FSYNC => empty(fs.fsync(cx, ino, u64_at(op_in, 0), u32_at(op_in, 8) & FUSE_FSYNC_FDATASYNC != 0)),
        op::FSYNCDIR => empty(fs.fsyncdir(cx, ino, u64_at(op_in, 0), u32_at(op_in, 8) & FUSE_FSYNC_FDATASYNC != 0)),
        op::FLUSH => empty(fs.flush(cx, ino, u64_at(op_in, 0))),
        op::SETXATTR => {
            let (size, flags) = (u32_at(op_in, 0) as usize, u32_at(op_in, 4) as i32);
            let (xname, value) = name(&payload[..in_len])?;
            let value = value.get(..size).ok_or(libc::EINVAL)?;
            empty(fs.setxattr(cx, ino, xname, value, flags))
        }
        op::GETXATTR => {
            let x = fs.getxattr(cx, ino, name(&payload[..in_len])?.0, u32_at(op_in, 0));
            xattr(payload, x)
        }
        op::LISTXATTR => xattr(payload, fs.listxattr(cx, ino, u32_at(op_in, 0))),
        op::REMOVEXATTR => empty(fs.removexattr(cx, ino, name(&payload[..in_len])?.0)),
        op::READDIR | op::READDIRPLUS => {
            let (fh, offset, size) = (u64_at(op_in, 0), u64_at(op_in, 8), u32_at(op_in, 16) as usize);
            let plus = h.opcode == op::READDIRPLUS;
            let limit = size.min(payload.len());
            let mut sink = RingDir { out: Out::new(payload), limit, plus };
            fs.readdir(cx, ino, fh, offset, plus, &mut sink)?;
            Ok(sink.out.len)
        }
        op::ACCESS => empty(fs.access(cx, ino, u32_at(op_in, 0) as i32)),
        op::FALLOCATE => {
            let (fh, offset, length, mode) = (u64_at(op_in, 0), u64_at(op_in, 8), u64_at(op_in, 16), u32_at(op_in, 24) as i32);
            empty(fs.fallocate(cx, ino, fh, offset, length, mode))
        }
        op::LSEEK => {
            let (fh, offset, whence) = (u64_at(op_in, 0), u64_at(op_in, 8) as i64, u32_at(op_in, 16) as i32);
            let o = fs.lseek(cx, ino, fh, offset, whence)?;
            let mut out = Out::new(payload);
            out.u64(o);
            Ok(out.len)
        }
        // Only fuseblk mounts are sent DESTROY; fuser's session ends the stack either way.
        op::DESTROY => Ok(0),
        // struct fuse_copy_file_range_in: fh_in, off_in, nodeid_out, fh_out, off_out, len, flags.
        op::COPY_FILE_RANGE => {
            let (fh_in, off_in, ino_out, fh_out, off_out, len) =
                (u64_at(op_in, 0), u64_at(op_in, 8), u64_at(op_in, 16), u64_at(op_in, 24), u64_at(op_in, 32), u64_at(op_in, 40));
            let n = fs.copy_file_range(ino, fh_in, off_in, ino_out, fh_out, off_out, len)?;
            let mut out = Out::new(payload);
            out.u32(n);
            out.u32(0);
            Ok(out.len)
        }
        // struct fuse_ioctl_in: fh, flags, cmd, arg, in_size, out_size; the input follows.
        op::IOCTL => {
            let (fh, cmd, in_size, out_size) = (u64_at(op_in, 0), u32_at(op_in, 12), u32_at(op_in, 24), u32_at(op_in, 28));
            let data = payload.get(..(in_size as usize).min(in_len)).ok_or(libc::EINVAL)?.to_vec();
            let out_data = fs.ioctl(cx, ino, fh, cmd, &data, out_size)?;
            // struct fuse_ioctl_out: result, flags, in_iovs, out_iovs; then the output.
            let mut out = Out::new(payload);
            out.u32(0);
            out.u32(0);
            out.u32(0);
            out.u32(0);
            out.bytes(&out_data);
            Ok(out.len)
        }
        _ => Err(libc::ENOSYS),
    }
}

/// The rings of a mount: the threads serving them.
pub struct Rings {
    threads: Vec<JoinHandle<()>>,
    pub queues: usize,
}

impl Rings {
    /// Wait for the threads, which end when the kernel ends the connection, for at most
    /// `limit`.
    pub fn join(self, limit: Duration) {
        let deadline = std::time::Instant::now() + limit;
        for t in self.threads {
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// The CPUs the kernel may run callers on: one queue each (`num_possible_cpus()`).
fn possible_cpus() -> usize {
    let list = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let mut max = None;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let last = part.rsplit('-').next().and_then(|n| n.parse::<usize>().ok());
        max = max.max(last);
    }
    max.map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), |m| m + 1)
}

/// Whether this process can make the rings at all (io_uring may be off: the
/// `kernel.io_uring_disabled` sysctl, seccomp, a container). Asked before INIT, since once the
/// kernel agrees to FUSE over io_uring, requests wait until the rings are ready.
pub fn can_make_rings() -> Result<(), Error> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .build(4)
        .map(drop)
        .map_err(|e| Error::Uring { why: format!("cannot make an io_uring with 128-byte entries ({e})") })
}

/// Whether this kernel has FUSE over io_uring but it is turned off (the `fuse` module's
/// `enable_uring`, off by default on most distributions' kernels): what a user can change.
pub fn turned_off() -> bool {
    std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring").is_ok_and(|v| v.trim() == "N" || v.trim() == "0")
}

/// Whether the kernel allows FUSE over io_uring (`/sys/module/fuse/parameters/enable_uring`).
pub fn kernel_allows() -> Result<(), Error> {
    let refused = |why: &str| Error::Uring { why: why.to_owned() };
    match std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring") {
        Ok(v) if v.trim() == "Y" || v.trim() == "1" => Ok(()),
        Ok(_) => Err(refused("the kernel has it turned off (as root: echo 1 > /sys/module/fuse/parameters/enable_uring)")),
        Err(_) => Err(refused("this kernel has no FUSE over io_uring (needs Linux 6.14 or later, CONFIG_FUSE_IO_URING)")),
    }
}

/// Start one queue per CPU on the connection `dev`, with buffers of `payload_size` bytes;
/// the threads yield their CPU to callers when `can_yield` (see [`can_yield`]). Returns once
/// every queue is registered, or the reason it could not be; then the kernel has gone back to
/// `/dev/fuse` for this connection.
pub fn start(fs: Arc<FuseFs>, access: Access, dev: Arc<OwnedFd>, payload_size: usize, can_yield: bool) -> Result<Rings, Error> {
    let queues = possible_cpus();
    let yielding = if can_yield {
        Yielding::start(queues * THREADS_PER_QUEUE)
    } else {
        tracing::debug!("ring threads stay SCHED_OTHER: this process may not leave SCHED_IDLE");
        None
    };
    let (tx, rx) = mpsc::channel();
    let mut threads = Vec::new();
    for qid in 0..queues {
        for n in 0..THREADS_PER_QUEUE {
            let (fs, ring_dev, tx, y) = (fs.clone(), dev.clone(), tx.clone(), yielding.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("plyfs-uring-{qid}.{n}"))
                .spawn(move || serve(&fs, &access, ring_dev.as_raw_fd(), qid as u16, payload_size, y, tx));
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    abandon(dev.as_raw_fd());
                    return Err(Error::Uring { why: format!("cannot start a ring thread ({e})") });
                }
            }
        }
    }
    drop(tx);
    let mut failure = None;
    for _ in 0..threads.len() {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                failure.get_or_insert(e);
            }
            Err(_) => {
                failure.get_or_insert_with(|| "a ring thread did not register in time".to_owned());
                break;
            }
        }
    }
    match failure {
        None => Ok(Rings { threads, queues }),
        Some(e) => {
            // The threads that did register wait for requests that no longer come; the
            // kernel hands their entries back at unmount, and they end.
            abandon(dev.as_raw_fd());
            Err(Error::Uring { why: e })
        }
    }
}

/// Make the kernel give up on the rings of this connection and go back to `/dev/fuse`: a
/// registration it refuses (an impossible queue) does that, and wakes requests waiting for the
/// rings.
fn abandon(dev: RawFd) {
    if let Ok(mut ring) = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(2) {
        let mut entry = QueueEntry::new(0);
        let sqe = command(dev, CMD_REGISTER, u16::MAX, 0, &mut entry, 0);
        // SAFETY: the entry's buffers outlive the submission, which fails at once.
        unsafe {
            let _ = ring.submission().push(&sqe);
        }
        let _ = ring.submit_and_wait(1);
    }
}

impl QueueEntry {
    fn new(payload_size: usize) -> QueueEntry {
        let mut headers = Box::new(Headers { in_out: [0; 128], op_in: [0; 128], ent_in_out: [0; 32] });
        let mut payload = vec![0u8; payload_size];
        let iov = Box::new([
            libc::iovec { iov_base: (&mut *headers as *mut Headers).cast(), iov_len: std::mem::size_of::<Headers>() },
            libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() },
        ]);
        QueueEntry { headers, payload, iov }
    }
}

/// A `FUSE_IO_URING_CMD_*` submission for `entry` of queue `qid`.
fn command(dev: RawFd, cmd_op: u32, qid: u16, commit_id: u64, entry: &mut QueueEntry, user_data: u64) -> squeue::Entry128 {
    // struct fuse_uring_cmd_req { u64 flags; u64 commit_id; u16 qid; u8 padding[6]; }
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    let mut sqe = opcode::UringCmd80::new(types::Fd(dev), cmd_op)
        .cmd(cmd)
        .addr(Some(entry.iov.as_ptr() as u64))
        .build()
        .user_data(user_data);
    // The kernel takes the two iovecs from `addr` and their count from `len` (offset 24 of the
    // SQE), which the io-uring crate has no setter for on this opcode.
    const LEN_OFFSET: usize = 24;
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is the kernel's 128-byte SQE (repr(C)); `len` is a u32 at offset 24.
    unsafe {
        (&mut sqe as *mut squeue::Entry128).cast::<u8>().add(LEN_OFFSET).cast::<u32>().write_unaligned(2);
    }
    sqe
}

/// Pin this thread to `cpu`, where the callers of its queue run.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET stays within it for cpu < CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut set);
            // An offline CPU refuses: the thread then runs anywhere, which is only slower.
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

/// Serve one thread's entries of queue `qid` until the connection ends.
fn serve(
    fs: &FuseFs,
    access: &Access,
    dev: RawFd,
    qid: u16,
    payload_size: usize,
    yielding: Option<Arc<Yielding>>,
    registered: mpsc::Sender<Result<(), String>>,
) {
    pin_to(usize::from(qid));
    let me = yielding.as_ref().map(|y| (y.clone(), y.enlist()));
    let built = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_coop_taskrun()
        .build((ENTRIES_PER_THREAD * 2) as u32);
    let mut ring = match built {
        Ok(r) => r,
        Err(e) => {
            let _ = registered.send(Err(format!("cannot make an io_uring ({e})")));
            return;
        }
    };
    let mut entries: Vec<QueueEntry> = (0..ENTRIES_PER_THREAD).map(|_| QueueEntry::new(payload_size)).collect();
    for (i, entry) in entries.iter_mut().enumerate() {
        let sqe = command(dev, CMD_REGISTER, qid, 0, entry, i as u64);
        // SAFETY: the entries' buffers live until this thread ends, after the kernel let go
        // of them (every entry ended with an error completion).
        unsafe {
            let _ = ring.submission().push(&sqe);
        }
    }
    if let Err(e) = ring.submit() {
        let _ = registered.send(Err(format!("queue {qid}: cannot register ({e})")));
        return;
    }
    // A refused registration completes at once; an accepted one waits for a request.
    let _ = ring.submit_and_wait(0);
    let refused = ring.completion().find(|c| c.result() < 0).map(|c| io::Error::from_raw_os_error(-c.result()));
    if let Some(e) = refused {
        let _ = registered.send(Err(format!("the kernel refused queue {qid} ({e})")));
        return;
    }
    let _ = registered.send(Ok(()));
    drop(registered);

    let mut live = entries.len();
    let mut done = [(0u64, 0i32); ENTRIES_PER_THREAD * 2];
    while live > 0 {
        if let Some((y, slot)) = &me {
            y.done(*slot);
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => {
                tracing::error!("FUSE over io_uring, queue {qid}: waiting for requests: {e}; this thread stops");
                return;
            }
        }
        let mut n = 0;
        for c in ring.completion() {
            if n < done.len() {
                done[n] = (c.user_data(), c.result());
                n += 1;
            }
        }
        if let Some((y, slot)) = &me {
            y.busy(*slot);
        }
        for &(i, res) in &done[..n] {
            if res < 0 {
                // The connection ends (unmount, abort): the kernel hands every entry back.
                live -= 1;
                if !matches!(-res, libc::ENOTCONN | libc::ECANCELED | libc::ENODEV | libc::ECONNABORTED) {
                    tracing::warn!("FUSE over io_uring, queue {qid}: an entry failed: {}", io::Error::from_raw_os_error(-res));
                }
                continue;
            }
            let entry = &mut entries[i as usize];
            let commit_id = answer(fs, access, entry);
            let sqe = command(dev, CMD_COMMIT_AND_FETCH, qid, commit_id, entry, i);
            // SAFETY: as above.
            unsafe {
                let _ = ring.submission().push(&sqe);
            }
        }
    }
}

fn set_policy(tid: i32, policy: i32) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    unsafe { libc::sched_setscheduler(tid, policy, &param) == 0 }
}

/// How the ring threads give their CPU to the callers they answer.
///
/// A caller waits on the CPU its queue's thread is pinned to. When the thread answers, the
/// kernel wakes the caller on an idle CPU rather than on this busy one, so the caller moves
/// at every request and the next one lands on the other queue: each request pays a wake-up
/// across CPUs, which the rings are there to avoid. The scheduler counts a CPU that runs only
/// SCHED_IDLE threads as idle, so ring threads wait and answer as SCHED_IDLE: the caller is
/// woken where it was and preempts the thread at once.
///
/// A SCHED_IDLE thread gets almost no CPU beside busy ones, so a request that takes long (a
/// large write to encode, a copy-up) would starve. A watchdog lifts a thread busy for more
/// than [`BOOST_AFTER`] to SCHED_OTHER, and the thread goes back to SCHED_IDLE when it has
/// answered. The watchdog sleeps while no request runs.
pub(crate) struct Yielding {
    slots: Vec<Slot>,
    next: AtomicUsize,
    base: Instant,
    parked: AtomicBool,
    watchdog: Mutex<Option<std::thread::Thread>>,
}

#[derive(Default)]
struct Slot {
    tid: AtomicI32,
    /// Microseconds since `base` (plus one) when the thread took its current requests; 0
    /// while it waits.
    busy_since: AtomicU64,
    boosted: AtomicBool,
}

const BOOST_AFTER: Duration = Duration::from_millis(10);
const WATCH_EVERY: Duration = Duration::from_millis(10);

impl Yielding {
    /// `None` where the watchdog cannot be started: then the threads stay SCHED_OTHER.
    fn start(threads: usize) -> Option<Arc<Yielding>> {
        let y = Arc::new(Yielding {
            slots: (0..threads).map(|_| Slot::default()).collect(),
            next: AtomicUsize::new(0),
            base: Instant::now(),
            parked: AtomicBool::new(false),
            watchdog: Mutex::new(None),
        });
        let weak = Arc::downgrade(&y);
        let spawned = std::thread::Builder::new().name("plyfs-uring-watch".into()).spawn(move || watch(weak));
        match spawned {
            Ok(t) => {
                *y.watchdog.lock() = Some(t.thread().clone());
                Some(y)
            }
            Err(_) => None,
        }
    }

    /// Take a slot for the calling ring thread, and make it SCHED_IDLE.
    fn enlist(&self) -> usize {
        let slot = self.next.fetch_add(1, Ordering::Relaxed).min(self.slots.len() - 1);
        self.slots[slot].tid.store(unsafe { libc::gettid() }, Ordering::Relaxed);
        set_policy(0, libc::SCHED_IDLE);
        slot
    }

    fn now(&self) -> u64 {
        self.base.elapsed().as_micros() as u64 + 1
    }

    fn busy(&self, slot: usize) {
        // SeqCst with the watchdog's `parked` store and `busy_since` loads: one of the two
        // sides sees the other, so the watchdog never parks while a thread is busy.
        self.slots[slot].busy_since.store(self.now(), Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            if let Some(t) = self.watchdog.lock().as_ref() {
                t.unpark();
            }
        }
    }

    fn done(&self, slot: usize) {
        let s = &self.slots[slot];
        s.busy_since.store(0, Ordering::Relaxed);
        if s.boosted.swap(false, Ordering::Relaxed) {
            set_policy(0, libc::SCHED_IDLE);
        }
    }
}

/// Whether ring threads may wait as SCHED_IDLE and come back to SCHED_OTHER (which needs
/// CAP_SYS_NICE or a high RLIMIT_NICE), as [`Yielding`] has them do.
pub fn can_yield() -> bool {
    std::thread::spawn(|| set_policy(0, libc::SCHED_IDLE) && set_policy(0, libc::SCHED_OTHER)).join().unwrap_or(false)
}

/// The watchdog of [`Yielding`]: ends with the rings.
fn watch(weak: Weak<Yielding>) {
    let mut quiet = 0u32;
    loop {
        std::thread::sleep(WATCH_EVERY);
        let Some(y) = weak.upgrade() else { return };
        let now = y.now();
        let mut any = false;
        for s in &y.slots {
            let since = s.busy_since.load(Ordering::Relaxed);
            if since == 0 {
                continue;
            }
            any = true;
            if now.saturating_sub(since) > BOOST_AFTER.as_micros() as u64 && !s.boosted.swap(true, Ordering::Relaxed) {
                set_policy(s.tid.load(Ordering::Relaxed), libc::SCHED_OTHER);
            }
        }
        quiet = if any { 0 } else { quiet + 1 };
        // Nothing ran for a while: sleep until a ring thread takes a request.
        if quiet > 100 {
            y.parked.store(true, Ordering::SeqCst);
            let busy = y.slots.iter().any(|s| s.busy_since.load(Ordering::SeqCst) != 0);
            drop(y);
            if !busy {
                std::thread::park_timeout(Duration::from_secs(5));
            }
            let Some(y) = weak.upgrade() else { return };
            y.parked.store(false, Ordering::Relaxed);
            quiet = 0;
        }
    }
}

/// Answer the request in `entry`, in place. Returns the commit id to hand it back with.
fn answer(fs: &FuseFs, access: &Access, entry: &mut QueueEntry) -> u64 {
    let h = InHeader::parse(&entry.headers.in_out);
    let commit_id = u64_at(&entry.headers.ent_in_out, 8);
    let in_len = (u32_at(&entry.headers.ent_in_out, 16) as usize).min(entry.payload.len());
    let result = dispatch(fs, access, &h, &entry.headers.op_in, &mut entry.payload, in_len);
    let (error, len) = match result {
        Ok(len) => (0, len),
        Err(e) => (-e, 0),
    };
    // struct fuse_out_header { u32 len; i32 error; u64 unique; }
    let out = &mut entry.headers.in_out;
    out[0..4].copy_from_slice(&((16 + len) as u32).to_ne_bytes());
    out[4..8].copy_from_slice(&error.to_ne_bytes());
    out[8..16].copy_from_slice(&h.unique.to_ne_bytes());
    entry.headers.ent_in_out[16..20].copy_from_slice(&(len as u32).to_ne_bytes());
    commit_id
}
