//! The `/dev/fuse` loop. fuser agrees on features with the kernel (INIT); after that plyfs
//! reads the requests itself, on several threads each with its own clone of the connection's
//! descriptor, and decodes them as the io_uring transport does ([`uring::dispatch`]): one
//! decoder and one check of who may use the mount ([`Access`]) for both transports.
//!
//! Every thread waits in `read`; the kernel hands each request to the thread that has waited
//! longest. Measured on 2 CPUs (docs/benchmarks.md, *Where a metadata request's time goes*):
//! keeping one thread hot and the others parked until requests queue or one runs long cost up to
//! a fifth more on an idle machine (it paid only on a loaded one), so every thread reads.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::fs::FuseFs;
use crate::uring::{dispatch, op, u32_at, u64_at, InHeader, IN_HEADER_SIZE};

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// Who may use the mount, checked on every request as fuser does: the kernel is told
/// `allow_other` for `allow_root` too, so the daemon turns other users away itself.
#[derive(Clone, Copy, Debug)]
pub struct Access {
    /// The user the daemon runs as.
    owner: u32,
    others: Others,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Others {
    /// Only the owner (the kernel enforces it as well).
    None,
    /// The owner and root (`allow_root`).
    Root,
    /// Everyone (`allow_other`).
    All,
}

impl Access {
    pub fn new(others: Others) -> Access {
        Access { owner: unsafe { libc::geteuid() }, others }
    }

    /// Whether the request in `h` may be served. Requests the kernel sends on its own behalf
    /// (page-cache reads and writes, releases) may carry any user and always are; forgets and
    /// interrupts are never answered as requests (see `serve_one`).
    pub(crate) fn allows(&self, h: &InHeader) -> bool {
        let uid = h.caller.uid;
        let user_ok = match self.others {
            Others::All => true,
            Others::Root => uid == self.owner || uid == 0,
            Others::None => uid == self.owner,
        };
        user_ok
            || matches!(
                h.opcode,
                op::READ
                    | op::WRITE
                    | op::READDIR
                    | op::READDIRPLUS
                    | op::FSYNC
                    | op::FSYNCDIR
                    | op::RELEASE
                    | op::RELEASEDIR
                    | op::DESTROY
            )
    }
}

/// The size of the operation's own header (`struct fuse_*_in`), which follows
/// `struct fuse_in_header`; names and data follow it. `None` for operations plyfs does not
/// serve.
fn op_header_size(opcode: u32) -> Option<usize> {
    Some(match opcode {
        op::LOOKUP | op::READLINK | op::SYMLINK | op::UNLINK | op::RMDIR | op::STATFS | op::REMOVEXATTR | op::DESTROY => 0,
        op::MKDIR | op::RENAME | op::LINK | op::OPEN | op::SETXATTR | op::GETXATTR | op::LISTXATTR | op::OPENDIR | op::ACCESS => 8,
        op::GETATTR | op::MKNOD | op::FSYNC | op::FSYNCDIR | op::CREATE | op::RENAME2 => 16,
        op::RELEASE | op::FLUSH | op::RELEASEDIR | op::LSEEK => 24,
        op::IOCTL | op::FALLOCATE => 32,
        op::READ | op::WRITE | op::READDIR | op::READDIRPLUS => 40,
        op::COPY_FILE_RANGE => 56,
        op::SETATTR => 88,
        _ => return None,
    })
}

/// One descriptor per thread: a clone of the connection's (`FUSE_DEV_IOC_CLONE`), whose
/// answers must go back through it, or the connection's own where `/dev/fuse` cannot be opened
/// (a user mounting through fusermount3).
fn channel(dev: RawFd) -> Option<OwnedFd> {
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just opened and is owned here.
    let clone = unsafe { OwnedFd::from_raw_fd(fd) };
    let source = dev as u32;
    (unsafe { libc::ioctl(clone.as_raw_fd(), DEV_IOC_CLONE, &source) } == 0).then_some(clone)
}

/// Serve the requests of connection `dev` with `threads` threads until the file system is
/// unmounted (`Ok`) or the connection fails.
pub fn run(fs: Arc<FuseFs>, access: Access, dev: RawFd, threads: usize, buffer_size: usize) -> io::Result<()> {
    let mut handles: Vec<JoinHandle<io::Result<()>>> = Vec::with_capacity(threads);
    for me in 0..threads.max(1) {
        let own = if me == 0 { None } else { channel(dev) };
        let fs = fs.clone();
        let spawned = std::thread::Builder::new().name(format!("plyfs-fuse-{me}")).spawn(move || {
            let fd = own.as_ref().map_or(dev, |f| f.as_raw_fd());
            serve(&fs, &access, fd, buffer_size)
        });
        match spawned {
            Ok(h) => handles.push(h),
            // Fewer threads serve; one is enough.
            Err(e) if me > 0 => {
                tracing::warn!("the /dev/fuse loop runs with {me} threads: cannot start more ({e})");
                break;
            }
            Err(e) => return Err(e),
        }
    }
    let mut result = Ok(());
    for h in handles {
        let r = h.join().unwrap_or_else(|_| Err(io::Error::other("a /dev/fuse thread panicked")));
        if result.is_ok() {
            result = r;
        }
    }
    result
}

/// One thread: read a request, answer it, until the connection ends.
fn serve(fs: &FuseFs, access: &Access, fd: RawFd, buffer_size: usize) -> io::Result<()> {
    let mut buf = vec![0u8; buffer_size];
    loop {
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // An interrupted request, a signal: read again.
                Some(libc::ENOENT | libc::EINTR | libc::EAGAIN) => continue,
                // Unmounted.
                Some(libc::ENODEV) => return Ok(()),
                _ => return Err(e),
            }
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "/dev/fuse gave an empty read"));
        }
        serve_one(fs, access, fd, &mut buf, n as usize);
    }
}

/// Answer the request in `buf[..n]` (forgets are not answered).
fn serve_one(fs: &FuseFs, access: &Access, fd: RawFd, buf: &mut [u8], n: usize) {
    if n < IN_HEADER_SIZE {
        tracing::error!("/dev/fuse gave a request of {n} bytes, shorter than its header; it is dropped");
        return;
    }
    let h = InHeader::parse(&buf[..IN_HEADER_SIZE]);
    let result = match h.opcode {
        // struct fuse_forget_in: nlookup.
        op::FORGET => {
            if n >= IN_HEADER_SIZE + 8 {
                fs.forget(h.nodeid, u64_at(buf, IN_HEADER_SIZE));
            }
            return;
        }
        // struct fuse_batch_forget_in: count; then count × struct fuse_forget_one.
        op::BATCH_FORGET => {
            if n < IN_HEADER_SIZE + 8 {
                return;
            }
            let count = u32_at(buf, IN_HEADER_SIZE) as usize;
            let ones = &buf[IN_HEADER_SIZE + 8..n];
            for one in ones.chunks_exact(16).take(count) {
                fs.forget(u64_at(one, 0), u64_at(one, 8));
            }
            return;
        }
        op::NOTIFY_REPLY => return,
        // Not supported: the kernel stops sending interrupts.
        op::INTERRUPT => Err(libc::ENOSYS),
        op::INIT => Err(libc::EIO),
        opcode => match op_header_size(opcode) {
            None => Err(libc::ENOSYS),
            Some(size) if n < IN_HEADER_SIZE + size => Err(libc::EIO),
            Some(size) => {
                // Copied: the answer is written over the request.
                let mut op_in = [0u8; 128];
                op_in[..size].copy_from_slice(&buf[IN_HEADER_SIZE..IN_HEADER_SIZE + size]);
                let payload = &mut buf[IN_HEADER_SIZE + size..];
                dispatch(fs, access, &h, &op_in, payload, n - IN_HEADER_SIZE - size).map(|len| (IN_HEADER_SIZE + size, len))
            }
        },
    };
    // struct fuse_out_header { u32 len; i32 error; u64 unique; }
    let (error, at, len) = match result {
        Ok((at, len)) => (0, at, len),
        Err(e) => (-e, 0, 0),
    };
    let mut out = [0u8; 16];
    out[0..4].copy_from_slice(&((16 + len) as u32).to_ne_bytes());
    out[4..8].copy_from_slice(&error.to_ne_bytes());
    out[8..16].copy_from_slice(&h.unique.to_ne_bytes());
    let iov = [
        libc::iovec { iov_base: out.as_mut_ptr().cast(), iov_len: 16 },
        libc::iovec { iov_base: buf[at..].as_mut_ptr().cast(), iov_len: len },
    ];
    if unsafe { libc::writev(fd, iov.as_ptr(), if len > 0 { 2 } else { 1 }) } < 0 {
        let e = io::Error::last_os_error();
        // ENOENT: the request was interrupted meanwhile; ENODEV: unmounted.
        if !matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENODEV)) {
            tracing::warn!("answering FUSE request {} (opcode {}): {e}", h.unique, h.opcode);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_root_lets_root_and_the_owner_in_and_requests_of_the_kernel_through() {
        let h = |uid, opcode| InHeader { opcode, unique: 1, nodeid: 1, caller: plyfs_stack::Caller::new(uid, uid, 1) };
        let root = Access { owner: 1000, others: Others::Root };
        assert!(root.allows(&h(1000, op::LOOKUP)));
        assert!(root.allows(&h(0, op::LOOKUP)));
        assert!(!root.allows(&h(1001, op::LOOKUP)));
        assert!(!root.allows(&h(1001, op::OPEN)));
        assert!(root.allows(&h(1001, op::RELEASE)));
        let owner = Access { owner: 1000, others: Others::None };
        assert!(!owner.allows(&h(0, op::GETATTR)));
        assert!(Access { owner: 1000, others: Others::All }.allows(&h(1001, op::MKDIR)));
    }
}
