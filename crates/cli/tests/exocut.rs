//! Power cuts for exofs over exodisk (#30), in the manner of CrashMonkey: a workload runs on
//! exofs over a service that records every write and flush it makes (`serve --record`); then
//! for each flush of the log, the volume as it stood on the disk there is built again
//! (`plyfs exodisk replay`) on a copy of the volume taken before, checked (`exodisk fsck`),
//! served (the start-up scan repairs what the cut left), mounted and read.
//!
//! After each cut:
//! - `exodisk fsck` finds no broken invariant, only what the service gives back, and after the
//!   service has given it back it finds nothing;
//! - the service starts and exofs mounts;
//! - every file (and directory) whose `fsync` or `fdatasync` had returned by that flush, and
//!   that was not changed between then and the flush, reads back exactly, its attribute too;
//! - no file reads garbage: each byte read is zero or a byte once written at that offset to a
//!   file that had that name; damage reads as `EIO`.
//!
//! Workloads: (a) ACE-style (Mohan et al., CrashMonkey and ACE, OSDI 2018): files made and synced
//! first, then one to three operations and an `fsync` or `fdatasync`; (b) a long random run.
//! `PLYFS_EXOCUT_SEED=N` repeats a run; `PLYFS_EXOCUT_ACE=N` (workloads), `PLYFS_EXOCUT_OPS=N`
//! (the long run's operations) and `PLYFS_EXOCUT_CUTS=N` (cuts replayed per workload, 0 for
//! all) make longer runs.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::exodisk::{format, Service};
use common::rng::{seed, Rng};
use common::*;
use plyfs_exodisk::record::Log;

/// Files stay under this size, so that both exofs's in-memory files (up to 256 KiB) and files
/// with extents are cut.
const MAX_FILE: u64 = 320 << 10;

fn env_or(var: &str, default: u64) -> u64 {
    std::env::var(var).ok().map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{var}={v}: not a number")))
}

/// What a file of the model is: its bytes and its attribute `user.t`, and every byte each
/// offset ever held (a bitmap of 256 values per offset), to tell stale bytes from garbage.
#[derive(Default)]
struct Inode {
    bytes: Vec<u8>,
    xattr: Option<Vec<u8>>,
    ever: Vec<[u64; 4]>,
    largest: u64,
}

impl Inode {
    fn wrote(&mut self, offset: usize, data: &[u8]) {
        let end = offset + data.len();
        if self.bytes.len() < end {
            self.bytes.resize(end, 0);
        }
        self.bytes[offset..end].copy_from_slice(data);
        if self.ever.len() < end {
            self.ever.resize(end, [0; 4]);
        }
        for (i, &b) in data.iter().enumerate() {
            self.ever[offset + i][b as usize / 64] |= 1 << (b % 64);
        }
        self.resized(self.bytes.len() as u64);
    }

    fn resized(&mut self, size: u64) {
        self.bytes.resize(size as usize, 0);
        self.largest = self.largest.max(size);
    }

    fn once_held(&self, offset: usize, b: u8) -> bool {
        b == 0 || self.ever.get(offset).is_some_and(|bits| bits[b as usize / 64] & (1 << (b % 64)) != 0)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Node {
    File(usize),
    Dir,
}

/// What a `fsync` or `fdatasync` that returned made durable: the path's state then, from the
/// flush the log had reached when it returned.
struct Synced {
    op: usize,
    path: String,
    flush: u64,
    state: Option<(Vec<u8>, Option<Vec<u8>>)>,
}

/// An operation that changed `paths`, started when the log had `flushes_before` flushes: a
/// cut at a later flush may hold any part of it.
struct Change {
    op: usize,
    flushes_before: u64,
    paths: Vec<String>,
}

/// The workload as it ran, and what it allows after a cut.
#[derive(Default)]
struct Model {
    inodes: Vec<Inode>,
    names: BTreeMap<String, Node>,
    /// Every inode a name ever had.
    ever_at: BTreeMap<String, BTreeSet<usize>>,
    dirs_ever: BTreeSet<String>,
    synced: Vec<Synced>,
    changes: Vec<Change>,
    ops: usize,
    next_name: usize,
}

/// What one cut found.
#[derive(Default)]
struct Checked {
    exact: u64,
    read: u64,
    eio: u64,
}

impl Model {
    fn files(&self) -> Vec<String> {
        self.names.iter().filter(|(_, n)| matches!(n, Node::File(_))).map(|(p, _)| p.clone()).collect()
    }

    fn dirs(&self) -> Vec<String> {
        self.names.iter().filter(|(_, n)| **n == Node::Dir).map(|(p, _)| p.clone()).collect()
    }

    fn inode_of(&self, path: &str) -> usize {
        match self.names[path] {
            Node::File(i) => i,
            Node::Dir => panic!("{path} is a directory"),
        }
    }

    /// The names of inode `i`.
    fn names_of(&self, i: usize) -> Vec<String> {
        self.names.iter().filter(|(_, n)| **n == Node::File(i)).map(|(p, _)| p.clone()).collect()
    }

    fn new_name(&mut self, rng: &mut Rng) -> String {
        self.next_name += 1;
        let dirs = self.dirs();
        let dir = &dirs[rng.below(dirs.len() as u64) as usize];
        if dir.is_empty() {
            format!("n{}", self.next_name)
        } else {
            format!("{dir}/n{}", self.next_name)
        }
    }

    fn link_name(&mut self, path: &str, node: Node) {
        self.names.insert(path.to_owned(), node);
        match node {
            Node::File(i) => {
                self.ever_at.entry(path.to_owned()).or_default().insert(i);
            }
            Node::Dir => {
                self.dirs_ever.insert(path.to_owned());
            }
        }
    }

    /// The synced states a cut at flush `n` must show: for each name, its last sync by then,
    /// unless something changed it between that sync and the flush (or, with `unflushed`, the
    /// next flush: the cut then holds some writes after flush `n`).
    fn expected_at(&self, n: u64, unflushed: bool) -> BTreeMap<&str, &Synced> {
        let horizon = n + unflushed as u64;
        let mut last: BTreeMap<&str, &Synced> = BTreeMap::new();
        for s in self.synced.iter().filter(|s| s.flush <= n) {
            last.insert(&s.path, s);
        }
        last.retain(|path, s| {
            !self.changes.iter().any(|c| c.op > s.op && c.flushes_before < horizon && c.paths.iter().any(|p| p == path))
        });
        last
    }
}

/// A workload on a live mount: the mount point, the write log and the model.
struct Run<'a> {
    mnt: &'a Path,
    log: &'a Path,
    model: Model,
    rng: Rng,
}

fn flushes(log: &Path) -> u64 {
    Log::read(log).unwrap_or_else(|e| panic!("{e}")).flushes()
}

fn errno(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn set_xattr(path: &Path, value: &[u8]) -> std::io::Result<()> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    errno(unsafe { libc::setxattr(c.as_ptr(), c"user.t".as_ptr(), value.as_ptr().cast(), value.len(), 0) })
}

fn get_xattr(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut buf = vec![0u8; 4096];
    let n = unsafe { libc::getxattr(c.as_ptr(), c"user.t".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENODATA) { Ok(None) } else { Err(e) };
    }
    buf.truncate(n as usize);
    Ok(Some(buf))
}

impl Run<'_> {
    fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// `least` to `least + spread - 1` random bytes.
    fn bytes(&mut self, least: u64, spread: u64) -> Vec<u8> {
        let len = least + self.rng.below(spread);
        (0..len).map(|_| self.rng.next() as u8).collect()
    }

    fn pick(&mut self, from: &[String]) -> Option<String> {
        (!from.is_empty()).then(|| from[self.rng.below(from.len() as u64) as usize].clone())
    }

    /// One operation of ACE's list on a random target; returns what it did and the path to
    /// sync after it.
    fn op(&mut self) -> (String, String) {
        let flushes_before = flushes(self.log);
        let files = self.model.files();
        let mut kind = self.rng.below(11);
        if files.is_empty() {
            kind = 4;
        }
        let file = self.pick(&files).unwrap_or_default();
        let (what, changed, target) = match kind {
            // Overwrite, append, extend, truncate.
            0..=3 => {
                let i = self.model.inode_of(&file);
                let size = self.model.inodes[i].bytes.len() as u64;
                let f = std::fs::OpenOptions::new().write(true).open(self.path(&file)).unwrap();
                let what = match kind {
                    0 => {
                        let off = self.rng.below(size + 1);
                        let data = self.bytes(1, MAX_FILE.saturating_sub(off).min(64 << 10));
                        f.write_all_at(&data, off).unwrap();
                        self.model.inodes[i].wrote(off as usize, &data);
                        format!("overwrite {file} at {off}, {} bytes", data.len())
                    }
                    1 => {
                        let data = self.bytes(1, MAX_FILE.saturating_sub(size).clamp(1, 64 << 10));
                        f.write_all_at(&data, size).unwrap();
                        self.model.inodes[i].wrote(size as usize, &data);
                        format!("append {} bytes to {file}", data.len())
                    }
                    2 => {
                        let to = size + self.rng.below(MAX_FILE.saturating_sub(size) + 1);
                        f.set_len(to).unwrap();
                        self.model.inodes[i].resized(to);
                        format!("extend {file} to {to}")
                    }
                    _ => {
                        let to = self.rng.below(size + 1);
                        f.set_len(to).unwrap();
                        self.model.inodes[i].resized(to);
                        format!("truncate {file} to {to}")
                    }
                };
                (what, self.model.names_of(i), file)
            }
            // Create and write.
            4 => {
                let name = self.model.new_name(&mut self.rng);
                let data = self.bytes(0, MAX_FILE / 2);
                let mut f = std::fs::File::create_new(self.path(&name)).unwrap();
                f.write_all(&data).unwrap();
                self.model.inodes.push(Inode::default());
                let i = self.model.inodes.len() - 1;
                self.model.inodes[i].wrote(0, &data);
                self.model.link_name(&name, Node::File(i));
                (format!("create {name} with {} bytes", data.len()), vec![name.clone()], name)
            }
            // Rename over another file (not a link of the same one: that rename does nothing).
            5 => {
                let i = self.model.inode_of(&file);
                let others: Vec<String> = files.iter().filter(|p| self.model.names[*p] != Node::File(i)).cloned().collect();
                let Some(over) = self.pick(&others) else { return self.op() };
                std::fs::rename(self.path(&file), self.path(&over)).unwrap();
                self.model.names.remove(&file);
                self.model.link_name(&over, Node::File(i));
                (format!("rename {file} over {over}"), vec![file, over.clone()], over)
            }
            6 => {
                let i = self.model.inode_of(&file);
                let name = self.model.new_name(&mut self.rng);
                std::fs::hard_link(self.path(&file), self.path(&name)).unwrap();
                self.model.link_name(&name, Node::File(i));
                (format!("link {file} to {name}"), vec![name.clone()], name)
            }
            7 => {
                std::fs::remove_file(self.path(&file)).unwrap();
                self.model.names.remove(&file);
                let dirs = self.model.dirs();
                let parent = Path::new(&file).parent().map_or(String::new(), |p| p.to_string_lossy().into_owned());
                let target = if dirs.contains(&parent) { parent } else { String::new() };
                (format!("unlink {file}"), vec![file], target)
            }
            8 => {
                let name = self.model.new_name(&mut self.rng);
                std::fs::create_dir(self.path(&name)).unwrap();
                self.model.link_name(&name, Node::Dir);
                (format!("mkdir {name}"), vec![name.clone()], name)
            }
            9 => {
                let i = self.model.inode_of(&file);
                let value = self.bytes(1, 64);
                set_xattr(&self.path(&file), &value).unwrap();
                self.model.inodes[i].xattr = Some(value.clone());
                (format!("setxattr user.t on {file}, {} bytes", value.len()), self.model.names_of(i), file)
            }
            _ => {
                let i = self.model.inode_of(&file);
                let size = self.model.inodes[i].bytes.len() as u64;
                let off = self.rng.below(size + 1);
                let len = 1 + self.rng.below(MAX_FILE.saturating_sub(off).clamp(1, 64 << 10));
                let f = std::fs::OpenOptions::new().write(true).open(self.path(&file)).unwrap();
                let r = errno(unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, off as i64, len as i64) });
                match r {
                    Ok(()) => self.model.inodes[i].resized(size.max(off + len)),
                    Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
                    Err(e) => panic!("fallocate {file}: {e}"),
                }
                (format!("fallocate {file} at {off}, {len} bytes"), self.model.names_of(i), file)
            }
        };
        self.model.changes.push(Change { op: self.model.ops, flushes_before, paths: changed });
        self.model.ops += 1;
        (what, target)
    }

    /// `fsync` or `fdatasync` `target` (a file or a directory), and note what it made durable.
    fn sync(&mut self, target: &str) -> String {
        let data_only = self.rng.below(2) == 0;
        let f = std::fs::File::open(self.path(target)).unwrap();
        if data_only {
            f.sync_data().unwrap();
        } else {
            f.sync_all().unwrap();
        }
        let flush = flushes(self.log);
        let state = match self.model.names[target] {
            Node::File(i) => Some((self.model.inodes[i].bytes.clone(), self.model.inodes[i].xattr.clone())),
            Node::Dir => None,
        };
        self.model.synced.push(Synced { op: self.model.ops, path: target.to_owned(), flush, state });
        self.model.ops += 1;
        format!("{} {target:?} (flush {flush})", if data_only { "fdatasync" } else { "fsync" })
    }

    /// ACE's starting state: a directory and a few files, all synced.
    fn setup(&mut self) {
        for d in ["", "d"] {
            if !d.is_empty() {
                std::fs::create_dir(self.path(d)).unwrap();
            }
            self.model.link_name(d, Node::Dir);
        }
        for name in ["f0", "f1", "d/f2", "d/f3"] {
            let data = self.bytes(0, MAX_FILE / 2);
            std::fs::write(self.path(name), &data).unwrap();
            self.model.inodes.push(Inode::default());
            let i = self.model.inodes.len() - 1;
            self.model.inodes[i].wrote(0, &data);
            self.model.link_name(name, Node::File(i));
        }
        for name in ["f0", "f1", "d/f2", "d/f3", "d", ""] {
            self.sync(name);
        }
    }
}

/// The mount point of the workload and of each cut, with its own service.
struct Exofs {
    service: Service,
    mount: Mount,
}

fn serve_and_mount(volume: &Path, socket: &Path, record: Option<&Path>) -> Exofs {
    let args: Vec<&OsStr> = record.map(|r| vec![OsStr::new("--record"), r.as_os_str()]).unwrap_or_default();
    let service = Service::start_with(volume, socket, &args);
    let mdir = tempfile::tempdir_in("/var/tmp").unwrap();
    let mnt = mdir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mount = Mount::start(mdir, PathBuf::from(format!("exodisk:{}", socket.display())), mnt, "null", &[]);
    Exofs { service, mount }
}

impl Exofs {
    /// Unmount (again for a moment while the kernel calls it busy: a file just closed may
    /// still be held) and stop the service.
    fn stop(mut self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let out = run(plyfs().arg("umount").arg(&self.mount.mnt));
            let err = String::from_utf8_lossy(&out.stderr);
            if out.status.success() {
                break;
            }
            assert!(err.contains("busy") && std::time::Instant::now() < deadline, "plyfs umount: {err}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let status = self.mount.wait_exit(std::time::Duration::from_secs(20)).expect("exofs did not exit after unmount");
        assert!(status.success(), "exofs exited with {status}: {}", self.mount.daemon_log());
        self.service.stop();
    }
}

/// `plyfs exodisk fsck`: its success and its report.
fn fsck(volume: &Path) -> (bool, String) {
    let out = run(plyfs().args(["exodisk", "fsck"]).arg(volume));
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Whether an fsck report names something to give back.
fn reports_leftovers(report: &str) -> bool {
    !report.contains(" 0 allocated sectors owned by nothing") || report.contains("orphaned exonodes")
}

/// The volume of cut `n` (with `unflushed`, a seed, some of the writes after it too):
/// replayed, checked, repaired, mounted and read against the model.
fn check_cut(work: &Path, base: &Path, log: &Path, model: &Model, n: u64, unflushed: Option<u64>) -> Result<Checked, String> {
    let volume = work.join("cut.img");
    std::fs::copy(base, &volume).unwrap();
    let mut replay = plyfs();
    replay.args(["exodisk", "replay"]).arg(log).arg(&volume).arg("--to-flush").arg(n.to_string());
    if let Some(seed) = unflushed {
        replay.arg("--unflushed").arg(seed.to_string());
    }
    let out = run(&mut replay);
    if !out.status.success() {
        return Err(format!("replay: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let (ok, report) = fsck(&volume);
    if !ok {
        return Err(format!("exodisk fsck finds broken invariants: {report}"));
    }
    // The service's start-up repairs what fsck reported; fsck then finds nothing.
    let socket = work.join("cut.sock");
    let mut service = Service::start(&volume, &socket);
    service.stop();
    let (ok, again) = fsck(&volume);
    if !ok || reports_leftovers(&again) {
        return Err(format!("the service did not repair what fsck reported:\n{report}\nafter: {again}"));
    }
    let x = serve_and_mount(&volume, &socket, None);
    let checked = check_tree(&x.mount.mnt, model, n, unflushed.is_some());
    x.stop();
    checked
}

/// Read every file of the mount: synced ones exactly, the others for garbage.
fn check_tree(mnt: &Path, model: &Model, n: u64, unflushed: bool) -> Result<Checked, String> {
    let mut checked = Checked::default();
    for (path, s) in model.expected_at(n, unflushed) {
        let at = mnt.join(path);
        match &s.state {
            None => {
                if !at.is_dir() {
                    return Err(format!("{path:?}: the directory synced at flush {} is not there", s.flush));
                }
            }
            Some((bytes, xattr)) => {
                let got = std::fs::read(&at).map_err(|e| format!("{path:?}: synced at flush {}: {e}", s.flush))?;
                if &got != bytes {
                    let first = got.iter().zip(bytes).position(|(a, b)| a != b).unwrap_or(got.len().min(bytes.len()));
                    return Err(format!(
                        "{path:?}: synced at flush {} with {} bytes, reads {} bytes, first difference at {first}",
                        s.flush,
                        bytes.len(),
                        got.len()
                    ));
                }
                let got = get_xattr(&at).map_err(|e| format!("{path:?}: user.t: {e}"))?;
                if &got != xattr {
                    return Err(format!("{path:?}: synced at flush {} with user.t {xattr:?}, reads {got:?}", s.flush));
                }
            }
        }
        checked.exact += 1;
    }
    let mut stack = vec![String::new()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(mnt.join(&dir)).map_err(|e| format!("{dir:?}: listing: {e}"))?;
        for e in entries {
            let e = e.map_err(|e| format!("{dir:?}: listing: {e}"))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let path = if dir.is_empty() { name } else { format!("{dir}/{name}") };
            let kind = e.file_type().map_err(|e| format!("{path:?}: {e}"))?;
            if kind.is_dir() {
                if !model.dirs_ever.contains(&path) {
                    return Err(format!("{path:?}: a directory the workload never made"));
                }
                stack.push(path);
                continue;
            }
            let Some(inodes) = model.ever_at.get(&path).filter(|_| kind.is_file()) else {
                return Err(format!("{path:?}: a file the workload never made ({kind:?})"));
            };
            match std::fs::read(mnt.join(&path)) {
                Ok(bytes) => {
                    let largest = inodes.iter().map(|&i| model.inodes[i].largest).max().unwrap_or(0);
                    if bytes.len() as u64 > largest {
                        return Err(format!("{path:?}: {} bytes, but it never had more than {largest}", bytes.len()));
                    }
                    if let Some(at) = bytes.iter().enumerate().position(|(o, &b)| !inodes.iter().any(|&i| model.inodes[i].once_held(o, b))) {
                        return Err(format!("{path:?}: garbage at byte {at} ({:#04x}): never written there", bytes[at]));
                    }
                    checked.read += 1;
                }
                Err(e) if e.raw_os_error() == Some(libc::EIO) => checked.eio += 1,
                Err(e) => return Err(format!("{path:?}: {e}")),
            }
        }
    }
    Ok(checked)
}

/// The flushes to replay: all of `from..=to` when `cuts` is 0 or they are fewer, else `cuts`
/// of them: the first and last, those just after each sync, and the rest at random.
fn choose_cuts(rng: &mut Rng, model: &Model, from: u64, to: u64, cuts: u64) -> Vec<u64> {
    let all: Vec<u64> = (from..=to).collect();
    if cuts == 0 || all.len() as u64 <= cuts {
        return all;
    }
    let mut chosen: BTreeSet<u64> = [from, to].into();
    for s in model.synced.iter().filter(|s| s.flush >= from) {
        if chosen.len() as u64 >= cuts / 2 {
            break;
        }
        chosen.insert(s.flush);
    }
    while (chosen.len() as u64) < cuts {
        chosen.insert(from + rng.below(to - from + 1));
    }
    chosen.into_iter().collect()
}

/// Totals over a test's workloads, printed at the end.
#[derive(Default)]
struct Totals {
    workloads: u64,
    ops: u64,
    cuts: u64,
    /// Cuts replayed with some of the writes after their flush.
    torn: u64,
    exact: u64,
    read: u64,
    eio: u64,
}

/// Run one workload (`ace`: ACE-style, else `ops` random operations with syncs) from `seed`,
/// then replay and check its cuts.
fn workload(seed: u64, ace: bool, ops: u64, cuts: u64, totals: &mut Totals) {
    let mut work = tempfile::tempdir_in("/var/tmp").unwrap();
    let volume = format(work.path(), "16M");
    let base = work.path().join("base.img");
    std::fs::copy(&volume, &base).unwrap();
    std::fs::copy(volume.with_extension("img.key"), work.path().join("cut.img.key")).unwrap();
    let log = work.path().join("writes.exolog");
    let x = serve_and_mount(&volume, &work.path().join("s.sock"), Some(&log));
    let mut w = Run { mnt: &x.mount.mnt, log: &log, model: Model::default(), rng: Rng::spread(seed) };
    w.setup();
    let start = flushes(&log);
    let mut trace = Vec::new();
    let ops = if ace { 1 + w.rng.below(3) } else { ops };
    let mut target = String::new();
    for k in 0..ops {
        let (what, t) = w.op();
        trace.push(what);
        target = t;
        if !ace && w.rng.below(6) == 0 && k + 1 < ops {
            let t = w.pick(&w.model.files()).unwrap_or_default();
            trace.push(w.sync(&t));
        }
    }
    trace.push(w.sync(&target));
    let model = std::mem::take(&mut w.model);
    x.stop();
    let last = flushes(&log);
    let mut rng = Rng::spread(seed ^ 0x5eed);
    let chosen = choose_cuts(&mut rng, &model, if ace { start } else { 1 }, last, cuts);
    // Each cut as the flush left it, and about a third of them again with some of the writes
    // that followed it.
    let mut cuts: Vec<(u64, Option<u64>)> = chosen.iter().map(|&n| (n, None)).collect();
    for &n in chosen.iter().filter(|&&n| n < last) {
        if rng.below(3) == 0 {
            cuts.push((n, Some(rng.next())));
        }
    }
    for &(n, unflushed) in &cuts {
        let checked = match check_cut(work.path(), &base, &log, &model, n, unflushed) {
            Ok(checked) => checked,
            Err(e) => {
                // Kept for `plyfs exodisk replay`: the volume before, the log, and the cut.
                let kept = std::mem::replace(&mut work, tempfile::tempdir().unwrap()).keep();
                panic!(
                    "seed {seed} ({} workload), cut at flush {n} of {last}{}: {e}\nthe workload:\n  {}\n(kept in {})",
                    if ace { "ACE" } else { "long" },
                    unflushed.map_or(String::new(), |u| format!(" with unflushed writes (--unflushed {u})")),
                    trace.join("\n  "),
                    kept.display()
                )
            }
        };
        totals.exact += checked.exact;
        totals.read += checked.read;
        totals.eio += checked.eio;
    }
    totals.workloads += 1;
    totals.ops += model.ops as u64;
    totals.cuts += chosen.len() as u64;
    totals.torn += (cuts.len() - chosen.len()) as u64;
}

fn print_totals(what: &str, seed: u64, t: &Totals) {
    eprintln!(
        "{what} (seed {seed}): {} workloads, {} operations, {} cuts replayed at a flush and {} more with some later writes; {} synced files and directories read back exactly, {} files read with no garbage, {} read as EIO",
        t.workloads, t.ops, t.cuts, t.torn, t.exact, t.read, t.eio
    );
}

#[test]
fn ace_workloads_lose_nothing_synced_at_any_flush() {
    let seed = seed("PLYFS_EXOCUT_SEED");
    let (workloads, cuts) = (env_or("PLYFS_EXOCUT_ACE", 12), env_or("PLYFS_EXOCUT_CUTS", 8));
    let mut totals = Totals::default();
    for k in 0..workloads {
        workload(seed.wrapping_add(k), true, 0, cuts, &mut totals);
    }
    print_totals("ACE workloads", seed, &totals);
}

#[test]
fn a_long_random_workload_loses_nothing_synced_at_any_flush() {
    let seed = seed("PLYFS_EXOCUT_SEED");
    let (ops, cuts) = (env_or("PLYFS_EXOCUT_OPS", 150), env_or("PLYFS_EXOCUT_CUTS", 40));
    let mut totals = Totals::default();
    workload(seed, false, ops, cuts, &mut totals);
    print_totals("a long workload", seed, &totals);
}

#[test]
fn replay_and_record_refuse_bad_input_in_one_line_and_change_nothing() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let one_line = |out: &std::process::Output, want: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.trim().lines().count() == 1 && err.contains(want), "{err}");
    };
    let volume = format(dir.path(), "16M");
    let base = dir.path().join("base.img");
    std::fs::copy(&volume, &base).unwrap();
    let log = dir.path().join("w.log");
    let mut service = Service::start_with(&volume, &dir.path().join("s.sock"), &[OsStr::new("--record"), log.as_os_str()]);
    service.stop();
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&log).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    let summary = run(plyfs().args(["exodisk", "replay"]).arg(&log));
    let flushes = Log::read(&log).unwrap().flushes();
    assert!(String::from_utf8_lossy(&summary.stdout).contains(&format!(" {flushes} flushes")), "{summary:?}");
    // A log is never appended to: it means something only from where it started.
    let out = run(plyfs().args(["exodisk", "serve"]).arg(&volume).arg("--socket").arg(dir.path().join("t.sock")).arg("--record").arg(&log));
    one_line(&out, "cannot make the write log");
    let before = std::fs::read(&base).unwrap();
    let replay = |log: &Path, to: u64| run(plyfs().args(["exodisk", "replay"]).arg(log).arg(&base).arg("--to-flush").arg(to.to_string()));
    one_line(&replay(&log, flushes + 1), &format!("has {flushes} flushes"));
    let junk = dir.path().join("junk.log");
    std::fs::write(&junk, b"not a log at all").unwrap();
    one_line(&replay(&junk, 1), "not an exodisk write log");
    let mut bad = std::fs::read(&log).unwrap();
    bad[16] = b'X';
    std::fs::write(&junk, &bad).unwrap();
    one_line(&replay(&junk, 1), "neither a write nor a flush");
    let small = dir.path().join("small.img");
    std::fs::write(&small, vec![0u8; 1 << 20]).unwrap();
    one_line(&run(plyfs().args(["exodisk", "replay"]).arg(&log).arg(&small)), "records a volume of");
    assert!(std::fs::read(&base).unwrap() == before && std::fs::read(&small).unwrap() == vec![0u8; 1 << 20]);
    // And the log replayed whole is the volume the service left.
    assert!(replay(&log, flushes).status.success());
    assert!(std::fs::read(&base).unwrap() == std::fs::read(&volume).unwrap());
}

/// Found by the power cuts (a cut at the fifth flush of a new volume): exofs writes its
/// superblock, naming the root directory's inode, before that inode reaches the disk, so a
/// crash in between left a file system whose every call answered `ESTALE`. It is made again.
#[test]
fn a_file_system_whose_making_was_cut_short_is_made_again_at_mount() {
    use plyfs_exodisk::client::Client;
    use plyfs_exodisk::core::Target;
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let volume = format(dir.path(), "16M");
    let socket = dir.path().join("s.sock");
    let service = Service::start(&volume, &socket);
    let c = Client::connect(&socket, 1 << 20).unwrap();
    let (r, caps) = c.root("exofs").unwrap();
    let mut sb = plyfs_exofs::fs::MAGIC.to_vec();
    sb.extend_from_slice(&4242u64.to_le_bytes());
    c.add_data(&Target::Exonode { at: r, path: vec![] }, caps.write, Some(0), &sb).unwrap();
    drop(c);
    let mdir = tempfile::tempdir_in("/var/tmp").unwrap();
    let mnt = mdir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mount = Mount::start(mdir, PathBuf::from(format!("exodisk:{}", socket.display())), mnt.clone(), "null", &[]);
    let x = Exofs { service, mount };
    std::fs::write(mnt.join("f"), b"made again").unwrap();
    assert_eq!(std::fs::read(mnt.join("f")).unwrap(), b"made again");
    assert_eq!(std::fs::read_dir(&mnt).unwrap().count(), 1);
    x.stop();
}
