//! Shared memory between a client and the service: a memfd, mapped by both. The service's direct
//! I/O goes straight between the device and these pages (a mapping is page-aligned).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

pub struct Shm {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

unsafe impl Send for Shm {}
unsafe impl Sync for Shm {}

impl Shm {
    /// A new region of `len` bytes (a whole number of pages).
    pub fn create(len: usize) -> io::Result<Shm> {
        let len = len.next_multiple_of(4096).max(4096);
        // SAFETY: a plain memfd_create call.
        let fd = unsafe { libc::memfd_create(c"plyfs-exodisk".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: just made, ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Shm::map(fd, len)
    }

    /// Map `fd`, which must be at least `len` bytes long.
    pub fn map(fd: OwnedFd, len: usize) -> io::Result<Shm> {
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if (st.st_mode & libc::S_IFMT) != libc::S_IFREG || (st.st_size as u64) < len as u64 || len == 0 || !len.is_multiple_of(4096) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "the shared memory is not what the client said"));
        }
        // SAFETY: a fresh shared mapping of a descriptor we hold.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Shm { ptr: ptr.cast(), len, fd })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of `offset..offset + len`, if inside.
    pub fn at(&self, offset: u64, len: usize) -> Option<*mut u8> {
        let end = (offset as usize).checked_add(len)?;
        (offset as usize <= self.len && end <= self.len).then(|| unsafe { self.ptr.add(offset as usize) })
    }

    /// Copy `data` in at `offset`.
    pub fn put(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let p = self.at(offset, data.len()).ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
        // SAFETY: in bounds; the other side does not write this range while it is ours.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    /// Copy out `out.len()` bytes from `offset`.
    pub fn get(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let p = self.at(offset, out.len()).ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
        // SAFETY: as in `put`.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Send one byte with descriptor `fd` attached.
pub fn send_fd(sock: &UnixStream, fd: RawFd) -> io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let fds = [fd];
    let iov = [io::IoSlice::new(b"F")];
    sendmsg::<()>(sock.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None).map_err(io::Error::from)?;
    Ok(())
}

/// Receive the byte and the descriptor `send_fd` sent.
pub fn recv_fd(sock: &UnixStream) -> io::Result<OwnedFd> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut byte = [0u8; 1];
    let mut iov = [io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC).map_err(io::Error::from)?;
    if msg.bytes == 0 {
        // Closed before saying anything: a probe of whether the service listens, not a client.
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection closed before its handshake"));
    }
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            if let Some(&fd) = fds.first() {
                for &extra in &fds[1..] {
                    // SAFETY: received, ours to close.
                    drop(unsafe { OwnedFd::from_raw_fd(extra) });
                }
                // SAFETY: received, ours.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    Err(io::Error::new(io::ErrorKind::InvalidData, "the client sent no shared memory"))
}
