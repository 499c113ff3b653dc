//! The raw volume: an image file or a block device, read and written with direct I/O so that the
//! page cache neither hides nor delays what the service does (the thesis measured the disk).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::record::WriteLog;
pub use crate::seal::SECTOR;

/// Alignment of every buffer handed to the volume (direct I/O wants the device's logical block;
/// a page covers every device here).
pub const ALIGN: usize = 4096;

/// A zeroed buffer aligned for direct I/O.
pub struct Aligned {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

unsafe impl Send for Aligned {}
unsafe impl Sync for Aligned {}

impl Aligned {
    pub fn zeroed(len: usize) -> Aligned {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Aligned { ptr, len }
    }

    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(1).next_multiple_of(ALIGN), ALIGN).expect("a sane buffer size")
    }

    /// A copy of `data`, padded with zeros to whole sectors.
    pub fn from_bytes(data: &[u8]) -> Aligned {
        let mut a = Aligned::zeroed(data.len().next_multiple_of(SECTOR));
        a[..data.len()].copy_from_slice(data);
        a
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl std::ops::Deref for Aligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes live at `ptr`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for Aligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// An open volume.
pub struct Disk {
    file: File,
    /// Its size in sectors.
    pub sectors: u64,
    pub is_device: bool,
    /// Where every write and flush is recorded (`serve --record`), when it is.
    log: Option<std::sync::Arc<WriteLog>>,
}

impl Disk {
    /// Open `path` for direct I/O. With `exclusive`, fail at once if another process holds it
    /// (`flock`; a block device is also opened `O_EXCL`).
    pub fn open(path: &Path, exclusive: bool) -> io::Result<Disk> {
        let meta = std::fs::metadata(path)?;
        let is_device = meta.file_type().is_block_device();
        if !is_device && !meta.is_file() {
            return Err(io::Error::other("not a regular file or a block device"));
        }
        let mut opts = std::fs::OpenOptions::new();
        opts.read(true).write(true);
        let mut flags = libc::O_DIRECT | libc::O_CLOEXEC;
        if is_device && exclusive {
            flags |= libc::O_EXCL;
        }
        opts.custom_flags(flags);
        let file = opts.open(path).map_err(|e| match e.raw_os_error() {
            Some(libc::EBUSY) => io::Error::other("in use by another process"),
            _ => e,
        })?;
        if exclusive {
            // A service that just died may hold the volume a moment longer (the kernel tears
            // its io_uring down in the background): wait a little before calling it in use.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                    return Err(e);
                }
                if std::time::Instant::now() > deadline {
                    return Err(io::Error::other("in use by another exodisk service (or fsck)"));
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        let bytes = if is_device { device_size(&file)? } else { meta.len() };
        Ok(Disk { file, sectors: bytes / SECTOR as u64, is_device, log: None })
    }

    /// Read `buf.len()` bytes from sector `at`.
    pub fn read(&self, at: u64, buf: &mut Aligned) -> io::Result<()> {
        self.check(at, buf.len())?;
        self.file.read_exact_at(buf, at * SECTOR as u64)
    }

    /// Write `buf` at sector `at`.
    pub fn write(&self, at: u64, buf: &Aligned) -> io::Result<()> {
        self.check(at, buf.len())?;
        self.file.write_all_at(buf, at * SECTOR as u64)?;
        if let Some(log) = &self.log {
            log.write(at, buf);
        }
        Ok(())
    }

    /// Make what was written durable (the device's own cache included).
    pub fn sync(&self) -> io::Result<()> {
        if let Some(log) = &self.log {
            log.flush();
        }
        self.file.sync_data()
    }

    /// Record every write and flush from now on in `log`.
    pub fn record_to(&mut self, log: std::sync::Arc<WriteLog>) {
        self.log = Some(log);
    }

    /// The write log, for those that write the volume other than through [`Disk::write`].
    pub fn write_log(&self) -> Option<std::sync::Arc<WriteLog>> {
        self.log.clone()
    }

    fn check(&self, at: u64, len: usize) -> io::Result<()> {
        if !len.is_multiple_of(SECTOR) || at.checked_add((len / SECTOR) as u64).is_none_or(|end| end > self.sectors) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(())
    }

    pub fn fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }
}

fn device_size(file: &File) -> io::Result<u64> {
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64.
    if unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}
