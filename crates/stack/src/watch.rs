//! Changes made to a local lower directory behind the mount's back, seen at once (`-o shared`):
//! a fanotify group watches the directories the kernel knows, and every change in one of them
//! that this process did not make drops the kernel's cache of that name (and, for a change of
//! the directory itself, of the directory's attributes). Without it such changes show within
//! the attribute and entry timeouts.
//!
//! Events carry the directory's file handle and the entry's name (`FAN_REPORT_DFID_NAME`), and
//! the process that caused them, so the mount's own changes are told apart by process id. They
//! are read every 10 ms, not one by one as they come: the mount's own work makes a couple per
//! file, and a wake-up for each cost a busy mount a fifth of its time.
//! Watching needs CAP_SYS_ADMIN (fanotify reports process ids to privileged listeners only).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::layer::Invalidator;
use crate::types::NodeId;

/// How long events gather between reads: a change behind the mount's back shows within this.
const GATHER: std::time::Duration = std::time::Duration::from_millis(10);

/// Names made, removed and moved, and files written (at their close: a write through
/// passthrough carries the writer's process id, not the daemon's, and every one would count).
/// Attribute changes (which the mount's own work makes several of per file, each an event to
/// read) show within the attribute timeout.
const MASK: u64 = libc::FAN_CREATE
    | libc::FAN_DELETE
    | libc::FAN_MOVED_FROM
    | libc::FAN_MOVED_TO
    | libc::FAN_CLOSE_WRITE
    | libc::FAN_EVENT_ON_CHILD
    | libc::FAN_ONDIR;

pub(crate) struct Watch {
    fd: OwnedFd,
    /// Watched directories by the key of their file handle, and the other way round.
    dirs: Mutex<(HashMap<Vec<u8>, NodeId>, HashMap<NodeId, Vec<u8>>)>,
    full: std::sync::atomic::AtomicBool,
}

/// The key of the object `fd` refers to: its file handle's type and bytes, as events report them.
fn handle_key(fd: RawFd) -> Option<Vec<u8>> {
    let header = std::mem::size_of::<libc::file_handle>();
    let mut buf = vec![0u64; (header + libc::MAX_HANDLE_SZ as usize).div_ceil(8)];
    let fh = buf.as_mut_ptr() as *mut libc::file_handle;
    let mut mount_id = 0;
    unsafe { (*fh).handle_bytes = libc::MAX_HANDLE_SZ as u32 };
    if unsafe { libc::name_to_handle_at(fd, c"".as_ptr(), fh, &mut mount_id, libc::AT_EMPTY_PATH) } != 0 {
        return None;
    }
    let (len, kind) = unsafe { ((*fh).handle_bytes as usize, (*fh).handle_type) };
    let bytes = unsafe { std::slice::from_raw_parts((fh as *const u8).add(8), len) };
    Some([&kind.to_le_bytes()[..], bytes].concat())
}

impl Watch {
    pub(crate) fn new() -> Result<Watch> {
        let flags = libc::FAN_CLASS_NOTIF | libc::FAN_CLOEXEC | libc::FAN_REPORT_DFID_NAME;
        let fd = unsafe { libc::fanotify_init(flags, (libc::O_RDONLY | libc::O_LARGEFILE) as libc::c_uint) };
        if fd < 0 {
            return Err(Error::last_os());
        }
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Watch { fd, dirs: Mutex::new((HashMap::new(), HashMap::new())), full: false.into() })
    }

    /// Watch the directory `dir` (an `O_PATH` descriptor) of node `node`.
    pub(crate) fn add(&self, node: NodeId, dir: RawFd) {
        if self.dirs.lock().1.contains_key(&node) {
            return;
        }
        let Some(key) = handle_key(dir) else { return };
        let path = format!("/proc/self/fd/{dir}\0");
        let rc = unsafe { libc::fanotify_mark(self.fd.as_raw_fd(), libc::FAN_MARK_ADD, MASK, libc::AT_FDCWD, path.as_ptr().cast()) };
        if rc != 0 {
            if !self.full.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    "watching the lower directory for outside changes: {}; further directories show such changes within the timeouts",
                    std::io::Error::last_os_error()
                );
            }
            return;
        }
        let mut dirs = self.dirs.lock();
        dirs.0.insert(key.clone(), node);
        dirs.1.insert(node, key);
    }

    /// Stop watching node `node`'s directory (`dir`), which the kernel forgot.
    pub(crate) fn remove(&self, node: NodeId, dir: RawFd) {
        let Some(key) = self.dirs.lock().1.remove(&node) else { return };
        self.dirs.lock().0.remove(&key);
        let path = format!("/proc/self/fd/{dir}\0");
        unsafe { libc::fanotify_mark(self.fd.as_raw_fd(), libc::FAN_MARK_REMOVE, MASK, libc::AT_FDCWD, path.as_ptr().cast()) };
    }

    /// Read events until the group is closed, telling `inv` of every change another process
    /// made.
    pub(crate) fn run(self: Arc<Self>, inv: Arc<dyn Invalidator>) {
        let me = std::process::id() as i32;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return;
            }
            let mut at = 0usize;
            while at + std::mem::size_of::<libc::fanotify_event_metadata>() <= n as usize {
                let meta: libc::fanotify_event_metadata = unsafe { std::ptr::read_unaligned(buf.as_ptr().add(at).cast()) };
                let len = meta.event_len as usize;
                if len == 0 || at + len > n as usize {
                    break;
                }
                if meta.pid != me {
                    self.handle(&inv, meta.mask, &buf[at + meta.metadata_len as usize..at + len]);
                }
                at += len;
            }
            // Let events gather before the next read: a busy mount's own changes make a
            // couple of events per file, and waking for each costs more than its work.
            std::thread::sleep(GATHER);
        }
    }

    /// One event's information records: the directory's handle and the entry's name.
    fn handle(&self, inv: &Arc<dyn Invalidator>, mask: u64, mut info: &[u8]) {
        while info.len() >= 4 {
            let (kind, len) = (info[0], u16::from_le_bytes([info[2], info[3]]) as usize);
            if len < 4 || len > info.len() {
                return;
            }
            if kind == libc::FAN_EVENT_INFO_TYPE_DFID_NAME {
                // header (4), fsid (8), handle_bytes (4), handle_type (4), handle, name\0
                let rec = &info[..len];
                if rec.len() < 20 {
                    return;
                }
                let bytes = u32::from_le_bytes(rec[12..16].try_into().expect("4 bytes")) as usize;
                let Some(handle) = rec.get(20..20 + bytes) else { return };
                let key = [&rec[16..20], handle].concat();
                let name = &rec[20 + bytes..];
                let name = &name[..name.iter().position(|b| *b == 0).unwrap_or(name.len())];
                let Some(dir) = self.dirs.lock().0.get(&key).copied() else { return };
                if name.is_empty() || name == b"." {
                    inv.node(dir);
                } else {
                    inv.entry(dir, OsStr::from_bytes(name));
                    if mask & (libc::FAN_CREATE | libc::FAN_DELETE | libc::FAN_MOVED_FROM | libc::FAN_MOVED_TO) != 0 {
                        // The directory's own times and size changed too.
                        inv.node(dir);
                    }
                }
            }
            info = &info[len..];
        }
    }
}
