//! The fast branch's side of a cache: `.plyfs-cache/` in the fast branch's directory.
//!
//! - `data/KEY-GEN`: the copies. `KEY` is the slow branch's node id of the file (its inode
//!   number, so hard links share a copy and renames keep it), `GEN` a number never used twice,
//!   so a copy that is dropped and fetched again is a new file and the descriptors of the old
//!   one (passthrough opens) never see the new bytes.
//! - `index`: what each copy is a copy of (the slow file's size, mtime and ctime when the copy
//!   was its bytes), whether it is whole, when it was last used, and the pins. Rewritten whole
//!   (to a temporary name, then renamed) every few seconds and at unmount; a copy the index
//!   does not name is removed at the next start.
//! - `dirty`: the write-back log, one line per change: `D` when a copy holds bytes the slow
//!   branch does not have yet (with the path to find its slow file by after a restart), `C`
//!   when they reached it. Appended with `write(2)` before the change is answered, so a killed
//!   daemon loses none of it; synced with the copy at `fsync`.
//! - `lock`: held (`flock`) while a mount uses the directory: two mounts sharing one cache
//!   directory would each take the other's copies for their own.
//!
//! Everything here is the daemon's own: made private (0700), and read as hostile input: a key
//! or generation is a number, names of copies are made from numbers only, and a path from the
//! log must be relative and free of `..` before it is looked up.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use plyfs_stack::{unix_time, Attr, Error, Result};
use serde::{Deserialize, Serialize};

/// The directory in the fast branch that holds the cache.
pub const DIR_NAME: &str = ".plyfs-cache";

/// What the slow branch said about a file when a copy was its bytes: a copy is used only while
/// the slow file still says the same (or while the copy holds changes not written back).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Stamp {
    pub size: u64,
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
}

impl Stamp {
    pub fn of(a: &Attr) -> Stamp {
        Stamp { size: a.size, mtime: unix_time(a.mtime), ctime: unix_time(a.ctime) }
    }

    /// The same contents: size and mtime agree (a change of metadata only moves the ctime).
    pub fn same_bytes(&self, other: &Stamp) -> bool {
        self.size == other.size && self.mtime == other.mtime
    }
}

/// How a path is treated, from `user.plyfs.cache` on it or on a directory above it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pin {
    /// Fetched and kept: never evicted.
    Pin,
    /// Never cached: always read from and written to the slow branch.
    Never,
}

impl Pin {
    pub fn parse(value: &[u8]) -> Option<Option<Pin>> {
        match value {
            b"pin" => Some(Some(Pin::Pin)),
            b"never" => Some(Some(Pin::Never)),
            b"auto" | b"" => Some(None),
            _ => None,
        }
    }
}

/// One copy.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Copy {
    pub gen: u64,
    /// The path it was last seen under (for the log, `cache-status` and pins).
    pub path: String,
    pub stamp: Stamp,
    /// Every byte of the file is in it.
    pub complete: bool,
    /// It holds bytes the slow branch does not have yet (write-back).
    pub dirty: bool,
    /// Seconds since the epoch of its last open.
    pub used: u64,
    /// Space it takes on the fast branch.
    pub bytes: u64,
    /// The ctime users saw before the copy was written back, shown while the slow file's ctime
    /// is still the one the write-back gave it (a write-back is not a change users made).
    #[serde(default)]
    pub shown_ctime: Option<(i64, u32)>,
}

#[derive(Default, Serialize, Deserialize)]
struct IndexFile {
    copies: HashMap<u64, Copy>,
    pins: BTreeMap<String, Pin>,
    next_gen: u64,
}

/// The index, in memory.
pub struct Index {
    pub copies: HashMap<u64, Copy>,
    pub pins: BTreeMap<String, Pin>,
    next_gen: u64,
    /// Changed since it was last written.
    pub changed: bool,
}

impl Index {
    pub fn new_gen(&mut self) -> u64 {
        self.next_gen += 1;
        self.next_gen
    }

    /// The pin that applies to `path`: its own, else the nearest directory's above it.
    pub fn pin_of(&self, path: &str) -> Option<Pin> {
        let mut at = path;
        loop {
            if let Some(p) = self.pins.get(at) {
                return Some(*p);
            }
            match at.rfind('/') {
                Some(i) => at = &at[..i],
                None if !at.is_empty() => at = "",
                None => return None,
            }
        }
    }

    /// `from` (and everything under it) is now `to`.
    pub fn renamed(&mut self, from: &str, to: &str) -> Vec<(u64, u64, String)> {
        let moved = |p: &str| -> Option<String> {
            if p == from {
                Some(to.to_owned())
            } else {
                p.strip_prefix(from).filter(|rest| rest.starts_with('/') && !from.is_empty()).map(|rest| format!("{to}{rest}"))
            }
        };
        let mut dirty = Vec::new();
        for (key, c) in self.copies.iter_mut() {
            if let Some(p) = moved(&c.path) {
                c.path = p;
                if c.dirty {
                    dirty.push((*key, c.gen, c.path.clone()));
                }
                self.changed = true;
            }
        }
        let pins: Vec<(String, String, Pin)> = self.pins.iter().filter_map(|(p, v)| moved(p).map(|n| (p.clone(), n, *v))).collect();
        for (old, new, pin) in pins {
            self.pins.remove(&old);
            self.pins.insert(new, pin);
            self.changed = true;
        }
        dirty
    }
}

pub struct Store {
    root: PathBuf,
    data: PathBuf,
    _lock: File,
    pub index: Mutex<Index>,
    log: Mutex<File>,
}

pub fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A path from the log or the index, before it is used: relative, no `.` or `..`, no NUL.
pub fn sane_path(p: &str) -> bool {
    !p.starts_with('/') && !p.contains('\0') && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..") || p.is_empty()
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "t")]
enum LogLine {
    D { key: u64, gen: u64, path: String },
    C { key: u64 },
}

fn private_dir(p: &Path) -> std::io::Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = fs::symlink_metadata(p)?;
            if !meta.is_dir() {
                return Err(std::io::Error::other(format!("{} is not a directory", p.display())));
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

impl Store {
    /// Open (or make) the cache in `fast`; `name` is the layer's, for messages. Returns the
    /// store and the copies the write-back log says are not on the slow branch yet.
    pub fn open(name: &str, fast: &Path, read_only: bool) -> Result<Store> {
        let root = fast.join(DIR_NAME);
        let data = root.join("data");
        let fail = |what: &str, e: std::io::Error| Error::config(format!("cache '{name}': {}: {what}: {e}", root.display()));
        private_dir(&root).map_err(|e| fail("cannot make the cache directory", e))?;
        private_dir(&data).map_err(|e| fail("cannot make the cache directory", e))?;
        let lock = OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).open(root.join("lock")).map_err(|e| fail("lock", e))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(Error::config(format!(
                "cache '{name}': {} is in use by another mount; give each mount its own fast branch",
                root.display()
            )));
        }
        let _ = read_only;
        let mut file: IndexFile = match fs::read(root.join("index")) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!("cache '{name}': {}/index is unreadable ({e}); starting with an empty cache", root.display());
                IndexFile::default()
            }),
            Err(_) => IndexFile::default(),
        };
        // Partial copies are not kept across restarts, nor anything that is not sane.
        file.copies.retain(|_, c| c.complete && sane_path(&c.path));
        file.pins.retain(|p, _| sane_path(p));
        // The write-back log wins over the index: what it calls dirty is dirty.
        let log_path = root.join("dirty");
        let mut dirty: HashMap<u64, (u64, String)> = HashMap::new();
        if let Ok(f) = File::open(&log_path) {
            for line in BufReader::new(f).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<LogLine>(&line) {
                    Ok(LogLine::D { key, gen, path }) if sane_path(&path) => {
                        dirty.insert(key, (gen, path));
                    }
                    Ok(LogLine::C { key }) => {
                        dirty.remove(&key);
                    }
                    // A torn last line (a killed daemon) or a hostile one: ignored.
                    _ => tracing::warn!("cache '{name}': {}: a line that is not a log entry, ignored", log_path.display()),
                }
            }
        }
        for (key, (gen, path)) in &dirty {
            let exists = data.join(copy_name(*key, *gen)).exists();
            if !exists {
                tracing::error!("cache '{name}': the unwritten copy of '{path}' ({}) is missing from the cache directory", copy_name(*key, *gen));
                file.copies.remove(key);
                continue;
            }
            let c = file.copies.entry(*key).or_insert_with(|| Copy {
                gen: *gen,
                path: path.clone(),
                stamp: Stamp::default(),
                complete: true,
                dirty: true,
                used: now_secs(),
                bytes: 0,
                shown_ctime: None,
            });
            c.gen = *gen;
            c.path = path.clone();
            c.dirty = true;
            c.complete = true;
        }
        for c in file.copies.values() {
            file.next_gen = file.next_gen.max(c.gen);
        }
        // Copies the index does not name (a crash before it was written, partial copies).
        if let Ok(dir) = fs::read_dir(&data) {
            for e in dir.flatten() {
                let name = e.file_name();
                let keep = parse_copy_name(&name.to_string_lossy())
                    .is_some_and(|(key, gen)| file.copies.get(&key).is_some_and(|c| c.gen == gen));
                if let Some((_, gen)) = parse_copy_name(&name.to_string_lossy()) {
                    file.next_gen = file.next_gen.max(gen);
                }
                if !keep {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        // The log is rewritten with only what is still dirty.
        let compact = root.join("dirty.new");
        {
            let mut f = OpenOptions::new().create(true).truncate(true).write(true).mode(0o600).open(&compact).map_err(|e| fail("write-back log", e))?;
            for (key, c) in file.copies.iter().filter(|(_, c)| c.dirty) {
                let line = serde_json::to_string(&LogLine::D { key: *key, gen: c.gen, path: c.path.clone() }).unwrap_or_default();
                writeln!(f, "{line}").map_err(|e| fail("write-back log", e))?;
            }
            f.sync_all().map_err(|e| fail("write-back log", e))?;
        }
        fs::rename(&compact, &log_path).map_err(|e| fail("write-back log", e))?;
        let log = OpenOptions::new().append(true).open(&log_path).map_err(|e| fail("write-back log", e))?;
        let store = Store {
            root,
            data,
            _lock: lock,
            index: Mutex::new(Index { copies: file.copies, pins: file.pins, next_gen: file.next_gen, changed: true }),
            log: Mutex::new(log),
        };
        store.save()?;
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn copy_path(&self, key: u64, gen: u64) -> PathBuf {
        self.data.join(copy_name(key, gen))
    }

    /// Make a new, empty copy file.
    pub fn create_copy(&self, key: u64, gen: u64) -> Result<File> {
        let f = OpenOptions::new().create_new(true).read(true).write(true).mode(0o600).open(self.copy_path(key, gen))?;
        Ok(f)
    }

    pub fn open_copy(&self, key: u64, gen: u64, write: bool) -> Result<File> {
        Ok(OpenOptions::new().read(true).write(write).open(self.copy_path(key, gen))?)
    }

    pub fn remove_copy(&self, key: u64, gen: u64) {
        let _ = fs::remove_file(self.copy_path(key, gen));
    }

    /// Keep what cannot be written back (its slow file is gone or is another file now), so that
    /// nothing is lost. Returns where it is.
    pub fn orphan(&self, key: u64, gen: u64) -> PathBuf {
        let dir = self.root.join("orphans");
        let _ = private_dir(&dir);
        let to = dir.join(copy_name(key, gen));
        let _ = fs::rename(self.copy_path(key, gen), &to);
        to
    }

    /// Note in the write-back log that `key`'s copy holds unwritten bytes (`Some`) or no longer
    /// does (`None`).
    pub fn log(&self, key: u64, dirty: Option<(u64, &str)>) -> Result<()> {
        let line = match dirty {
            Some((gen, path)) => LogLine::D { key, gen, path: path.to_owned() },
            None => LogLine::C { key },
        };
        let mut text = serde_json::to_string(&line).map_err(|_| Error::Os(libc::EIO))?;
        text.push('\n');
        self.log.lock().write_all(text.as_bytes()).map_err(|e| {
            tracing::error!("cache: the write-back log {}: {e}", self.root.join("dirty").display());
            Error::from(e)
        })
    }

    pub fn sync_log(&self) -> Result<()> {
        Ok(self.log.lock().sync_data()?)
    }

    /// Write the index if it changed.
    pub fn save(&self) -> Result<()> {
        let text = {
            let mut idx = self.index.lock();
            if !idx.changed {
                return Ok(());
            }
            idx.changed = false;
            let copies: HashMap<u64, Copy> = idx.copies.iter().filter(|(_, c)| c.complete).map(|(k, c)| (*k, c.clone())).collect();
            serde_json::to_vec(&IndexFile { copies, pins: idx.pins.clone(), next_gen: idx.next_gen }).map_err(|_| Error::Os(libc::EIO))?
        };
        let tmp = self.root.join("index.new");
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new().create(true).truncate(true).write(true).mode(0o600).open(&tmp)?;
            f.write_all(&text)?;
            f.sync_data()?;
            fs::rename(&tmp, self.root.join("index"))
        };
        write().map_err(|e| {
            self.index.lock().changed = true;
            tracing::warn!("cache: cannot write {}: {e}", self.root.join("index").display());
            Error::from(e)
        })
    }

    /// Free and total bytes of the file system the cache is on.
    pub fn space(&self) -> (u64, u64) {
        let Ok(path) = std::ffi::CString::new(self.root.as_os_str().as_encoded_bytes()) else { return (u64::MAX, u64::MAX) };
        // SAFETY: statvfs fills the struct it is given.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
            return (u64::MAX, u64::MAX);
        }
        (st.f_bavail as u64 * st.f_frsize as u64, st.f_blocks as u64 * st.f_frsize as u64)
    }
}

fn copy_name(key: u64, gen: u64) -> String {
    format!("{key:016x}-{gen}")
}

fn parse_copy_name(name: &str) -> Option<(u64, u64)> {
    let (k, g) = name.split_once('-')?;
    Some((u64::from_str_radix(k, 16).ok()?, g.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_apply_to_what_is_under_them() {
        let mut idx = Index { copies: HashMap::new(), pins: BTreeMap::new(), next_gen: 0, changed: false };
        idx.pins.insert("a/b".into(), Pin::Pin);
        idx.pins.insert("a/b/c".into(), Pin::Never);
        assert_eq!(idx.pin_of("a/b/x"), Some(Pin::Pin));
        assert_eq!(idx.pin_of("a/b/c/d"), Some(Pin::Never));
        assert_eq!(idx.pin_of("a/bb"), None);
        assert_eq!(idx.pin_of("a"), None);
        idx.pins.insert("".into(), Pin::Never);
        assert_eq!(idx.pin_of("z"), Some(Pin::Never));
        idx.pins.remove("");
        idx.renamed("a/b", "q");
        assert_eq!(idx.pin_of("q/x"), Some(Pin::Pin));
        assert_eq!(idx.pin_of("q/c/d"), Some(Pin::Never));
        assert_eq!(idx.pin_of("a/b/x"), None);
    }

    #[test]
    fn hostile_paths_and_names_are_refused() {
        assert!(sane_path("a/b"));
        assert!(sane_path(""));
        for bad in ["/etc/passwd", "a/../b", "..", "a//b", "a/./b", "a\0b"] {
            assert!(!sane_path(bad), "{bad}");
        }
        assert_eq!(parse_copy_name("000000000000002a-7"), Some((42, 7)));
        assert_eq!(parse_copy_name("../x-1"), None);
        assert_eq!(parse_copy_name("2a"), None);
    }
}
