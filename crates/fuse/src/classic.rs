//! The handshake: fuser reads the kernel's INIT from `/dev/fuse` and [`Classic`] agrees on
//! features. After it, plyfs reads the requests itself ([`crate::devloop`], or the rings of
//! [`crate::uring`]); fuser keeps the connection and sends the notifications.

use std::sync::Arc;

use fuser::{Filesystem, InitFlags, KernelConfig, Request};

use crate::fs::{FuseFs, IoMode};

/// The largest write the kernel sends in one request (and so the size of a ring entry's
/// payload buffer).
pub(crate) const MAX_WRITE: u32 = 1 << 20;

/// The fuser side of a mount.
pub struct Classic {
    pub(crate) fs: Arc<FuseFs>,
    /// Ask the kernel for FUSE over io_uring at INIT.
    pub(crate) want_uring: bool,
    /// Set at INIT: the kernel agreed to FUSE over io_uring.
    pub(crate) uring_agreed: Arc<std::sync::atomic::AtomicBool>,
}

impl Filesystem for Classic {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let caps = config.capabilities();
        for flag in [
            InitFlags::FUSE_DO_READDIRPLUS,
            InitFlags::FUSE_READDIRPLUS_AUTO,
            InitFlags::FUSE_PARALLEL_DIROPS,
            // The daemon clears set-user/group-ID bits itself (see `kill_privileges`). In
            // return the kernel stops asking for security.capability before every write and
            // refreshing attributes before every chown (it may mark inodes S_NOSEC).
            InitFlags::FUSE_HANDLE_KILLPRIV_V2,
            InitFlags::FUSE_AUTO_INVAL_DATA,
            InitFlags::FUSE_CACHE_SYMLINKS,
            // Not FUSE_ASYNC_DIO: with it, an asynchronous O_DIRECT write to a file kept in the
            // page cache completes without dropping the pages a concurrent buffered read filled
            // during the write (this kernel has no invalidation at completion), and later reads
            // return the old data (xfstests generic/451). Without it the kernel sends the write
            // at submission and drops those pages after it. Passthrough files are not affected
            // either way: the kernel hands their I/O to the lower file.
        ] {
            if caps.contains(flag) {
                let _ = config.add_capabilities(flag);
            }
        }
        // POSIX ACLs enforced by the kernel, as on a local file system: it caches them from
        // the lower files' system.posix_acl_* attributes and leaves the umask to the daemon.
        // FUSE_DONT_MASK with it: the kernel would otherwise apply the umask even where a
        // default ACL must rule instead.
        let acl = caps.contains(InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK)
            && config.add_capabilities(InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK).is_ok();
        self.fs.set_posix_acl(acl);
        if self.want_uring && config.add_capabilities(InitFlags::FUSE_OVER_IO_URING).is_ok() {
            self.uring_agreed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        // FUSE_ATOMIC_O_TRUNC is not requested: with it the kernel checks ETXTBSY only after the
        // lower file was opened with O_TRUNC, so opening a running program O_RDONLY|O_TRUNC
        // would fail and still destroy it. Without it the kernel checks first, then truncates
        // with a separate setattr.
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);

        let mode = self.fs.decide_io_mode(caps.contains(InitFlags::FUSE_PASSTHROUGH));
        let mut passthrough = false;
        if mode == IoMode::Passthrough {
            // Passthrough and writeback caching exclude each other (the kernel drops
            // passthrough silently); writeback caching is never requested here.
            passthrough = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok() && config.set_max_stack_depth(1).is_ok();
        }
        self.fs.settle_io_mode(mode, passthrough);
        Ok(())
    }

    fn destroy(&mut self) {
        self.fs.destroy();
    }
}
