//! exodisk services and exofs mounts for tests: killed and unmounted when dropped.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use super::*;

/// A `plyfs exodisk serve` process, killed when dropped.
pub struct Service {
    child: Option<Child>,
    log: PathBuf,
}

impl Service {
    pub fn start(volume: &Path, socket: &Path) -> Service {
        Service::start_with(volume, socket, &[])
    }

    /// [`Service::start`] with more arguments for `plyfs exodisk serve` (`--record LOG`).
    pub fn start_with(volume: &Path, socket: &Path, args: &[&std::ffi::OsStr]) -> Service {
        let log = volume.with_extension("log");
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let _ = std::fs::remove_file(socket);
        let child = plyfs()
            .args(["exodisk", "serve"])
            .arg(volume)
            .arg("--socket")
            .arg(socket)
            .args(args)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        let s = Service { child: Some(child), log };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            assert!(Instant::now() < deadline, "the service did not start: {}", s.log_text());
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn format(dir: &Path, size: &str) -> PathBuf {
    let v = dir.join("v.img");
    let out = run(plyfs().args(["exodisk", "format"]).arg(&v).args(["--size", size]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    v
}

/// exofs on a volume of its own, mounted under a stack. Dropped in this order: the mount,
/// the service, the files.
pub struct ExofsMount {
    pub m: Mount,
    pub service: Service,
    pub dir: tempfile::TempDir,
}

pub fn exofs_mount(stack: &str) -> ExofsMount {
    exofs_mount_with(stack, &[])
}

/// [`exofs_mount`] with mount options (`allow_other`, ...).
pub fn exofs_mount_with(stack: &str, options: &[&str]) -> ExofsMount {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let v = format(dir.path(), "64M");
    let sock = dir.path().join("s.sock");
    let service = Service::start(&v, &sock);
    let mdir = tempfile::tempdir_in("/var/tmp").unwrap();
    let mnt = mdir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = Mount::start(mdir, PathBuf::from(format!("exodisk:{}", sock.display())), mnt, stack, options);
    ExofsMount { m, service, dir }
}

