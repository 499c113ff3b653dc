//! The mirror's write-intent log (the role of md's write-intent bitmap, per path).
//!
//! Every in-sync branch keeps a copy, `.plyfs-mirror.log` at its root, written through the
//! branch's stack. With `-o shared` every mount keeps a log of its own, `PID.TOKEN` in the
//! directory `.plyfs-mirror.logs` at each branch's root.
//! A mount holds a lock on its copies for as long as it runs (`lower-lock`), so a log whose lock
//! can be taken is a stopped mount's, and the mirror takes it over ([`super::Mirror`]). Lines
//! are `SEQ KIND [BRANCH] [PATH]`:
//!
//! - `W path` before a change to `path` reaches the branches, `C path` once every branch has it:
//!   a `W` without its `C` is a change that was in flight when the daemon stopped;
//! - `F branch` when a branch fails; `S branch path` for each path changed while it is failed;
//!   `R branch` when `resync` has brought it up to date.
//!
//! A line reaches the kernel before the change it announces, so a killed daemon loses none;
//! the log is made durable before any file's `fsync` returns. At mount the copy with the highest
//! sequence number (from the branch that stayed in sync longest) is read, and every copy is
//! rewritten with what is still true; the same happens when a copy grows past [`COMPACT_AT`].

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use parking_lot::Mutex;
use plyfs_stack::shared::{self, LockKind};
use plyfs_stack::{Caller, Error, FileHandle, Level, NodeId, Op, Result, SetAttr};

/// The log's name at the root of every branch (hidden from the mount).
pub const LOG_NAME: &str = ".plyfs-mirror.log";
/// The directory at the root of every branch that holds shared mounts' logs.
pub const LOGS_DIR: &str = ".plyfs-mirror.logs";

/// Whether `name` (at a branch's root) is a mirror log or the directory of shared mounts' logs.
pub fn is_log_name(name: &OsStr) -> bool {
    name.as_bytes().starts_with(LOG_NAME.as_bytes())
}
/// Rewrite a copy once it is this large and nothing is in flight.
const COMPACT_AT: u64 = 1 << 20;

/// The room each copy keeps set aside on its branch (see [`IntentLog::reserve`]): what it may
/// grow to before it is compacted, twice over.
const RESERVED: u64 = 2 * COMPACT_AT;

fn daemon() -> Caller {
    Caller::daemon()
}

/// A path in a log line: bytes outside a safe set are `%XX`.
fn encode(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || b"._-/+,=@~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// What a log says, replayed.
#[derive(Debug, Default, PartialEq)]
pub struct Replayed {
    pub seq: u64,
    pub failed: Vec<bool>,
    pub stale: Vec<BTreeSet<String>>,
    /// Changes that were in flight when the daemon stopped.
    pub in_flight: BTreeSet<String>,
}

/// Replay the lines of one copy; a line cut short by a crash is ignored.
pub fn replay(text: &str, names: &[String]) -> Replayed {
    let n = names.len();
    let mut r = Replayed { failed: vec![false; n], stale: vec![BTreeSet::new(); n], ..Replayed::default() };
    let mut in_flight: HashMap<String, i64> = HashMap::new();
    let branch = |name: &str| names.iter().position(|n| n == name);
    for line in text.lines() {
        let mut words = line.split(' ');
        let (Some(seq), Some(kind)) = (words.next().and_then(|s| s.parse::<u64>().ok()), words.next()) else { continue };
        let rest: Vec<&str> = words.collect();
        match (kind, rest.as_slice()) {
            ("W", [p]) => *in_flight.entry(decode(p).unwrap_or_default()).or_default() += 1,
            ("C", [p]) => *in_flight.entry(decode(p).unwrap_or_default()).or_default() -= 1,
            ("F", [b]) => match branch(b) {
                Some(i) => r.failed[i] = true,
                None => continue,
            },
            ("S", [b, p]) => match (branch(b), decode(p)) {
                (Some(i), Some(p)) => {
                    r.stale[i].insert(p);
                }
                _ => continue,
            },
            ("R", [b]) => match branch(b) {
                Some(i) => {
                    r.failed[i] = false;
                    r.stale[i].clear();
                }
                None => continue,
            },
            _ => continue,
        }
        r.seq = r.seq.max(seq);
    }
    r.in_flight = in_flight.into_iter().filter(|(_, n)| *n > 0).map(|(p, _)| p).collect();
    r
}

struct LogFile {
    node: NodeId,
    fh: FileHandle,
    size: u64,
    unsynced: bool,
    /// This mount holds the copy's lock (a lower without locks gives none, unless shared).
    locked: bool,
}

struct LogState {
    seq: u64,
    files: Vec<Option<LogFile>>,
    in_flight: HashMap<String, u32>,
    stale: Vec<BTreeSet<String>>,
    failed: Vec<bool>,
}

pub struct IntentLog {
    names: Vec<String>,
    tops: Vec<Level>,
    state: Mutex<LogState>,
    /// This mount's copies' name: [`LOG_NAME`], or with `-o shared` `PID.TOKEN` in [`LOGS_DIR`].
    own: String,
    /// With `-o shared`, each branch's [`LOGS_DIR`] once looked up (the lookup is held).
    dirs: Mutex<Vec<Option<NodeId>>>,
    shared: bool,
    /// Who holds the locks on the copies, and takes again those the branches' own layers take
    /// while writing them.
    owner: u64,
}

/// Branches a log write could not reach: they have failed.
pub type Unreached = Vec<(usize, Error)>;

/// Read the copies of log `name` in each directory `(level, dir)` that has one, and replay the
/// one that went furthest.
pub fn read_copies(places: &[(Level, NodeId)], name: &OsStr, names: &[String]) -> Result<Replayed> {
    let mut best: Option<Replayed> = None;
    for (top, dir) in places {
        let text = match top.read_small_file(&daemon(), *dir, name, 64 << 20) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(Error::Os(libc::ENOENT)) => String::new(),
            Err(e) => return Err(e),
        };
        let replayed = replay(&text, names);
        if best.as_ref().is_none_or(|b| replayed.seq > b.seq) {
            best = Some(replayed);
        }
    }
    Ok(best.unwrap_or_else(|| replay("", names)))
}

impl IntentLog {
    /// Read every branch's copy, and continue from the one that went furthest. Returns the log
    /// and what it says.
    /// With `shared`, the mount's log is a new one of its own (other mounts' are taken over by
    /// the mirror), and what it says is nothing yet.
    /// With `read_only`, the copies are read and left as they are.
    pub fn open(names: Vec<String>, tops: Vec<Level>, shared: bool, read_only: bool) -> Result<(IntentLog, Replayed)> {
        let n = names.len();
        let own = if shared {
            let mut token = [0u8; 4];
            getrandom::getrandom(&mut token).expect("the system's random number generator failed");
            format!("{}.{:08x}", std::process::id(), u32::from_le_bytes(token))
        } else {
            LOG_NAME.to_owned()
        };
        let replayed = if shared {
            replay("", &names)
        } else {
            let places: Vec<(Level, NodeId)> = tops.iter().map(|t| (t.clone(), NodeId::ROOT)).collect();
            read_copies(&places, OsStr::new(LOG_NAME), &names)?
        };
        let state = LogState {
            seq: replayed.seq,
            files: (0..n).map(|_| None).collect(),
            // Until recovered, they stay in flight (a crash meanwhile finds them again).
            in_flight: replayed.in_flight.iter().map(|p| (p.clone(), 1)).collect(),
            stale: replayed.stale.clone(),
            failed: replayed.failed.clone(),
        };
        let log = IntentLog {
            names,
            tops,
            state: Mutex::new(state),
            own,
            dirs: Mutex::new(vec![None; n]),
            shared,
            owner: shared::new_lock_owner(),
        };
        if read_only {
            return Ok((log, replayed));
        }
        // Start every in-sync copy afresh with what is still true.
        log.owned(|| {
            let mut state = log.state.lock();
            (0..n).try_for_each(|b| if state.failed[b] { Ok(()) } else { log.rewrite(&mut state, b) })
        })?;
        Ok((log, replayed))
    }

    /// The name of this mount's copies.
    pub fn own_name(&self) -> &str {
        &self.own
    }

    /// Run `f` with the log's lock owner holding what it locks.
    fn owned<R>(&self, f: impl FnOnce() -> R) -> R {
        shared::with_lock_owner(self.owner, f)
    }

    /// The directory of this mount's copy on branch `b`.
    fn dir(&self, b: usize) -> Result<NodeId> {
        if !self.shared {
            return Ok(NodeId::ROOT);
        }
        if let Some(dir) = self.dirs.lock()[b] {
            return Ok(dir);
        }
        let top = &self.tops[b];
        let name = OsStr::new(LOGS_DIR);
        let e = match top.lookup(&daemon(), NodeId::ROOT, name) {
            Err(Error::Os(libc::ENOENT)) => match top.mkdir(&daemon(), NodeId::ROOT, name, 0o700) {
                Err(Error::Os(libc::EEXIST)) => top.lookup(&daemon(), NodeId::ROOT, name)?,
                other => other?,
            },
            other => other?,
        };
        let mut dirs = self.dirs.lock();
        match dirs[b] {
            Some(dir) => {
                top.forget(&daemon(), e.node, 1);
                Ok(dir)
            }
            None => Ok(*dirs[b].insert(e.node)),
        }
    }

    fn open_file(&self, b: usize) -> Result<LogFile> {
        let top = &self.tops[b];
        let name = OsStr::new(&self.own);
        let dir = self.dir(b)?;
        let (node, fh) = match top.lookup(&daemon(), dir, name) {
            Ok(e) => match top.open(&daemon(), e.node, libc::O_RDWR) {
                Ok(o) => (e.node, o.fh),
                Err(err) => {
                    top.forget(&daemon(), e.node, 1);
                    return Err(err);
                }
            },
            Err(Error::Os(libc::ENOENT)) => {
                let (e, o) = top.create(&daemon(), dir, name, 0o600, libc::O_RDWR)?;
                (e.node, o.fh)
            }
            Err(e) => return Err(e),
        };
        let mut file = LogFile { node, fh, size: 0, unsynced: false, locked: false };
        // Held while the mount runs: it says the log is in use.
        let locked = if self.shared {
            // Only a mount taking over stopped mounts' logs may hold it, for a moment.
            shared::lock(top, node, LockKind::Exclusive).map(|()| true)
        } else {
            match shared::try_lock(top, node, LockKind::Exclusive) {
                Ok(false) => Err(Error::config(format!(
                    "mirror branch '{}': another mount is using this mirror (it holds the lock on {LOG_NAME}); a mirror mounted more than once needs -o shared on every mount",
                    self.names[b]
                ))),
                Ok(true) => Ok(true),
                Err(_) => Ok(false),
            }
        };
        match locked {
            Ok(l) => file.locked = l,
            Err(e) => {
                self.close_file(b, file);
                return Err(e);
            }
        }
        Ok(file)
    }

    /// Let go of branch `b`'s copy.
    fn close_file(&self, b: usize, f: LogFile) {
        let top = &self.tops[b];
        if f.locked {
            let _ = shared::unlock(top, f.node, LockKind::Exclusive);
        }
        let _ = top.release(&daemon(), f.node, f.fh);
        top.forget(&daemon(), f.node, 1);
    }

    /// Truncate branch `b`'s copy and write the current state into it.
    fn rewrite(&self, state: &mut LogState, b: usize) -> Result<()> {
        if state.files[b].is_none() {
            state.files[b] = Some(self.open_file(b)?);
        }
        let file = state.files[b].as_mut().expect("opened above");
        let top = &self.tops[b];
        let set = SetAttr { size: Some(0), ..SetAttr::default() };
        top.call(&daemon(), &Op::SetAttr { node: file.node, fh: Some(file.fh), set })?;
        file.size = 0;
        Self::reserve(top, file);
        let mut text = String::new();
        state.seq += 1;
        let seq = state.seq;
        for (i, failed) in state.failed.iter().enumerate() {
            if *failed {
                text.push_str(&format!("{seq} F {}\n", self.names[i]));
                for p in &state.stale[i] {
                    text.push_str(&format!("{seq} S {} {}\n", self.names[i], encode(p)));
                }
            }
        }
        for p in state.in_flight.keys() {
            text.push_str(&format!("{seq} W {}\n", encode(p)));
        }
        let file = state.files[b].as_mut().expect("opened above");
        Self::write_at(top, file, text.as_bytes())
    }

    /// Set aside room for the copy to grow to [`RESERVED`] bytes (`FALLOC_FL_KEEP_SIZE`), so that
    /// the log can still note changes, above all those that free space, once the branch's file
    /// system is full. Best effort: a branch whose layers cannot reserve space goes without.
    fn reserve(top: &Level, file: &LogFile) {
        let op = Op::Fallocate { node: file.node, fh: file.fh, offset: 0, length: RESERVED, mode: libc::FALLOC_FL_KEEP_SIZE };
        let _ = top.call(&daemon(), &op);
    }

    fn write_at(top: &Level, file: &mut LogFile, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let mut done = 0;
        while done < bytes.len() {
            done += top.write(&daemon(), file.node, file.fh, file.size + done as u64, &bytes[done..])? as usize;
        }
        file.size += bytes.len() as u64;
        file.unsynced = true;
        Ok(())
    }

    /// Append `body` (a line without its sequence number) to every in-sync copy.
    fn append(&self, state: &mut LogState, body: &str) -> Unreached {
        state.seq += 1;
        let line = format!("{} {body}\n", state.seq);
        let mut unreached = Vec::new();
        for b in 0..self.tops.len() {
            if state.failed[b] {
                continue;
            }
            let result = match state.files[b].as_mut() {
                Some(file) => Self::write_at(&self.tops[b], file, line.as_bytes()),
                None => self.rewrite(state, b),
            };
            if let Err(e) = result {
                unreached.push((b, e));
            }
        }
        unreached
    }

    /// A change to `path` is about to reach the branches.
    pub fn begin(&self, path: &str) -> Unreached {
        self.owned(|| {
            let mut state = self.state.lock();
            *state.in_flight.entry(path.to_owned()).or_default() += 1;
            self.append(&mut state, &format!("W {}", encode(path)))
        })
    }

    /// Every branch has the change to `path`.
    pub fn end(&self, path: &str) -> Unreached {
        self.owned(|| {
            let mut state = self.state.lock();
            match state.in_flight.get_mut(path) {
                Some(n) if *n > 1 => *n -= 1,
                Some(_) => {
                    state.in_flight.remove(path);
                }
                None => return Vec::new(),
            }
            let mut unreached = self.append(&mut state, &format!("C {}", encode(path)));
            let large = state.files.iter().flatten().any(|f| f.size > COMPACT_AT);
            if large && state.in_flight.is_empty() {
                for b in 0..self.tops.len() {
                    if !state.failed[b] {
                        if let Err(e) = self.rewrite(&mut state, b) {
                            unreached.push((b, e));
                        }
                    }
                }
            }
            unreached
        })
    }

    /// Branch `b` failed: from now on every change is noted stale for it.
    pub fn failed(&self, b: usize) -> Unreached {
        self.owned(|| {
            let mut state = self.state.lock();
            if state.failed[b] {
                return Vec::new();
            }
            state.failed[b] = true;
            if let Some(f) = state.files[b].take() {
                self.close_file(b, f);
            }
            self.append(&mut state, &format!("F {}", self.names[b]))
        })
    }

    /// `paths` changed while branch `b` is failed.
    pub fn stale(&self, b: usize, paths: &[String]) -> Unreached {
        self.owned(|| {
            let mut state = self.state.lock();
            let mut unreached = Vec::new();
            for p in paths {
                if state.stale[b].insert(p.clone()) {
                    let body = format!("S {} {}", self.names[b], encode(p));
                    unreached.extend(self.append(&mut state, &body));
                }
            }
            unreached
        })
    }

    /// The next path branch `b` needs, in order (parents before what they hold).
    pub fn next_stale(&self, b: usize) -> Option<String> {
        self.state.lock().stale[b].first().cloned()
    }

    pub fn stale_count(&self, b: usize) -> usize {
        self.state.lock().stale[b].len()
    }

    pub fn clear_stale(&self, b: usize, path: &str) {
        self.state.lock().stale[b].remove(path);
    }

    pub fn in_flight(&self) -> usize {
        self.state.lock().in_flight.len()
    }

    /// Branch `b` is up to date again: its copy starts afresh and the others say so.
    pub fn resynced(&self, b: usize) -> Unreached {
        self.owned(|| {
            let mut state = self.state.lock();
            state.failed[b] = false;
            state.stale[b].clear();
            let mut unreached = self.append(&mut state, &format!("R {}", self.names[b]));
            if let Err(e) = self.rewrite(&mut state, b) {
                unreached.push((b, e));
            }
            unreached
        })
    }

    /// Make every copy durable (before a file's fsync returns).
    pub fn sync(&self) -> Unreached {
        self.owned(|| {
            let mut state = self.state.lock();
            let mut unreached = Vec::new();
            for b in 0..self.tops.len() {
                let Some(file) = state.files[b].as_mut().filter(|f| f.unsynced) else { continue };
                match self.tops[b].call(&daemon(), &Op::Fsync { node: file.node, fh: file.fh, datasync: true }) {
                    Ok(_) => file.unsynced = false,
                    Err(e) => unreached.push((b, e)),
                }
            }
            unreached
        })
    }

    /// Close every copy (at unmount). A shared mount's log goes too when it says nothing any
    /// more: no branch failed, nothing in flight.
    pub fn close(&self) {
        self.owned(|| {
            let mut state = self.state.lock();
            let done = self.shared && state.in_flight.is_empty() && !state.failed.iter().any(|f| *f);
            for b in 0..self.tops.len() {
                if let Some(f) = state.files[b].take() {
                    let _ = self.tops[b].call(&daemon(), &Op::Fsync { node: f.node, fh: f.fh, datasync: true });
                    self.close_file(b, f);
                    if done {
                        if let Ok(dir) = self.dir(b) {
                            let _ = self.tops[b].unlink(&daemon(), dir, OsStr::new(&self.own));
                        }
                    }
                }
            }
            for (b, dir) in std::mem::take(&mut *self.dirs.lock()).into_iter().enumerate() {
                if let Some(dir) = dir {
                    self.tops[b].forget(&daemon(), dir, 1);
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_round_trip_through_the_encoding() {
        for p in ["", "a/b", "with space", "per%cent", "new\nline", "ünï"] {
            assert_eq!(decode(&encode(p)).as_deref(), Some(p));
            assert!(!encode(p).contains(' ') && !encode(p).contains('\n'));
        }
    }

    #[test]
    fn replay_finds_in_flight_changes_failures_and_stale_paths() {
        let names = vec!["m.0".to_owned(), "m.1".to_owned()];
        let text = "1 W a\n2 C a\n3 W b\n4 F m.1\n5 S m.1 c\n6 S m.1 d%20e\n7 W f\n8 W f\n9 C f\n10 W cut";
        let r = replay(text, &names);
        assert_eq!(r.seq, 10);
        assert_eq!(r.failed, [false, true]);
        assert_eq!(r.stale[1].iter().map(String::as_str).collect::<Vec<_>>(), ["c", "d e"]);
        assert_eq!(r.in_flight.iter().map(String::as_str).collect::<Vec<_>>(), ["b", "cut", "f"]);
        let r = replay(&format!("{text}\n11 R m.1\n12 x y\n13 W"), &names);
        assert_eq!(r.failed, [false, false]);
        assert!(r.stale[1].is_empty());
        assert_eq!(r.seq, 11, "malformed lines are skipped");
    }
}
