//! Encoded files shared by several mounts (`-o shared`), in process: each "mount" has its own
//! [`ScaFile`] over one lower file, and they take turns at random operations. Every read, by
//! any mount, must match a reference buffer; every write to the lower file must happen under
//! the write lock of the mount that makes it; and a mount that dies between operations (its
//! state dropped without a close) loses nothing another mount was told was written.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use plyfs_sca::mem::MemLower;
use plyfs_sca::{Engine, LowerIo, ScaFile};
use plyfs_stack::shared::{LockKind, SharedMode};
use plyfs_stack::Result;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

mod common;
use common::Rle;

/// Who holds the lock on the one lower file: `(mount, kind, depth)`.
type Holders = Arc<Mutex<Vec<(usize, LockKind, u32)>>>;

/// One mount's view of the shared lower file. Its lock is the lower file's lock between mounts
/// (an OFD lock in a real mount); as mounts take turns here, asking for a lock another mount
/// holds would wait forever, and fails the test instead.
#[derive(Clone)]
struct MountLower {
    mount: usize,
    bytes: MemLower,
    holders: Holders,
    /// The lower file cannot be locked: what locking it fails with.
    refuse: Option<fn() -> plyfs_stack::Error>,
}

impl MountLower {
    fn holds_write_lock(&self) -> bool {
        self.holders.lock().iter().any(|h| h.0 == self.mount && h.1 == LockKind::Exclusive)
    }

    fn check_writer(&self, what: &str) {
        assert!(self.holds_write_lock(), "mount {} changed the lower file ({what}) without its write lock", self.mount);
    }
}

impl LowerIo for MountLower {
    fn read_at(&self, off: u64, len: usize) -> Result<Vec<u8>> {
        self.bytes.read_at(off, len)
    }

    fn write_at(&self, off: u64, data: &[u8]) -> Result<()> {
        self.check_writer("write");
        self.bytes.write_at(off, data)
    }

    fn set_len(&self, len: u64) -> Result<()> {
        self.check_writer("set_len");
        self.bytes.set_len(len)
    }

    fn len(&self) -> Result<u64> {
        self.bytes.len()
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn writable(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("mount {}", self.mount)
    }

    fn lock(&self, kind: LockKind) -> Result<()> {
        if let Some(refuse) = self.refuse {
            return Err(refuse());
        }
        let mut holders = self.holders.lock();
        let others = holders.iter().filter(|h| h.0 != self.mount);
        let conflict = match kind {
            LockKind::Exclusive => others.count() > 0,
            LockKind::Shared => others.filter(|h| h.1 == LockKind::Exclusive).count() > 0,
        };
        assert!(!conflict, "mount {} waits forever for a {kind:?} lock: {holders:?}", self.mount);
        match holders.iter_mut().find(|h| h.0 == self.mount && h.1 == kind) {
            Some(h) => h.2 += 1,
            None => holders.push((self.mount, kind, 1)),
        }
        Ok(())
    }

    fn unlock(&self, kind: LockKind) -> Result<()> {
        let mut holders = self.holders.lock();
        let i = holders.iter().position(|h| h.0 == self.mount && h.1 == kind).expect("unlock of a lock not held");
        holders[i].2 -= 1;
        if holders[i].2 == 0 {
            holders.remove(i);
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum Step {
    Write {
        m: usize,
        off: u64,
        len: usize,
        byte: u8,
    },
    Append {
        m: usize,
        len: usize,
        byte: u8,
    },
    Truncate {
        m: usize,
        size: u64,
    },
    Read {
        m: usize,
        off: u64,
        len: usize,
    },
    Compact {
        m: usize,
    },
    /// Close and open again.
    Reopen {
        m: usize,
    },
    /// The mount dies between operations: its state goes without a close.
    Die {
        m: usize,
    },
}

const MOUNTS: usize = 3;

fn step() -> impl Strategy<Value = Step> {
    let m = 0..MOUNTS;
    prop_oneof![
        4 => (m.clone(), 0u64..40_000, 1usize..9_000, any::<u8>()).prop_map(|(m, off, len, byte)| Step::Write { m, off, len, byte }),
        4 => (m.clone(), 1usize..300, any::<u8>()).prop_map(|(m, len, byte)| Step::Append { m, len, byte }),
        1 => (m.clone(), 0u64..45_000).prop_map(|(m, size)| Step::Truncate { m, size }),
        3 => (m.clone(), 0u64..45_000, 1usize..20_000).prop_map(|(m, off, len)| Step::Read { m, off, len }),
        1 => m.clone().prop_map(|m| Step::Compact { m }),
        1 => m.clone().prop_map(|m| Step::Reopen { m }),
        1 => m.prop_map(|m| Step::Die { m }),
    ]
}

fn data(len: usize, byte: u8) -> Vec<u8> {
    (0..len).map(|i| byte.wrapping_add((i / 5) as u8)).collect()
}

fn run(steps: &[Step], shift: u8, fast_tails: bool) {
    // Revalidation at every read, so that every read must see every earlier write.
    let mode = SharedMode { revalidate: Duration::ZERO };
    let engine = Arc::new(Engine::new("rle", Arc::new(Rle), shift, fast_tails).sharing(Some(mode)));
    let bytes = MemLower::default();
    let holders = Holders::default();
    let lower = |mount| MountLower { mount, bytes: bytes.clone(), holders: holders.clone(), refuse: None };
    let open = |mount| ScaFile::open(engine.clone(), lower(mount)).unwrap_or_else(|e| panic!("mount {mount}: open: {e}"));
    let mut mounts: Vec<ScaFile<MountLower>> = (0..MOUNTS).map(open).collect();
    let mut model: Vec<u8> = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        let fail = |e: plyfs_stack::Error| -> ! { panic!("step {i} ({s:?}): {e}") };
        match *s {
            Step::Write { m, off, len, byte } => {
                let d = data(len, byte);
                mounts[m].write(off, &d).unwrap_or_else(|e| fail(e));
                let end = off as usize + len;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&d);
            }
            Step::Append { m, len, byte } => {
                let d = data(len, byte);
                let at = mounts[m].append(&d).unwrap_or_else(|e| fail(e));
                assert_eq!(at, model.len() as u64, "step {i}: appended at {at}, the end is {}", model.len());
                model.extend_from_slice(&d);
            }
            Step::Truncate { m, size } => {
                mounts[m].truncate(size).unwrap_or_else(|e| fail(e));
                model.resize(size as usize, 0);
            }
            Step::Read { m, off, len } => {
                let got = mounts[m].read_current(off, len).unwrap_or_else(|e| fail(e));
                let start = (off as usize).min(model.len());
                let end = (start + len).min(model.len());
                assert_eq!(got, &model[start..end], "step {i}: mount {m} read {off}+{len}");
            }
            Step::Compact { m } => {
                mounts[m].compact().unwrap_or_else(|e| fail(e));
            }
            Step::Reopen { m } => {
                mounts[m].close().unwrap_or_else(|e| fail(e));
                mounts[m] = open(m);
            }
            Step::Die { m } => {
                mounts[m] = open(m);
            }
        }
        assert!(holders.lock().is_empty(), "step {i}: locks left held: {:?}", holders.lock());
        for (m, f) in mounts.iter_mut().enumerate() {
            assert_eq!(f.current_size().unwrap_or_else(|e| fail(e)), model.len() as u64, "step {i}: mount {m}'s size");
        }
    }
    for (m, f) in mounts.iter_mut().enumerate() {
        let all = f.read_current(0, model.len() + 10).unwrap_or_else(|e| panic!("mount {m}: final read: {e}"));
        assert!(all == model, "mount {m}: final content differs");
        let report = f.verify().unwrap();
        assert_eq!(report["ok"], true, "mount {m}: verify: {report}");
        assert_eq!(report["index_rebuilt"], serde_json::Value::Null, "mount {m}: the index had to be rebuilt: {report}");
    }
}

proptest! {
    // Failing cases are saved beside this file and replayed first on every run.
    #![proptest_config(ProptestConfig {
        cases: 1024,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/shared.proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn mounts_taking_turns_match_reference_4k(steps in proptest::collection::vec(step(), 1..50)) {
        run(&steps, 12, false);
    }

    #[test]
    fn mounts_taking_turns_match_reference_4k_fast_tails(steps in proptest::collection::vec(step(), 1..50)) {
        run(&steps, 12, true);
    }

    #[test]
    fn mounts_taking_turns_match_reference_64k(steps in proptest::collection::vec(step(), 1..30)) {
        run(&steps, 16, true);
    }
}

/// Without sharing, the same turns lose writes: what the test above guards against is real.
#[test]
fn without_sharing_mounts_overwrite_each_other() {
    let engine = Arc::new(Engine::new("rle", Arc::new(Rle), 12, false));
    let bytes = MemLower::default();
    let mut a = ScaFile::open(engine.clone(), bytes.clone()).unwrap();
    let mut b = ScaFile::open(engine.clone(), bytes.clone()).unwrap();
    a.write(0, b"from a\n").unwrap();
    b.write(0, b"from b, longer\n").unwrap();
    a.write(7, b"more from a\n").unwrap();
    a.close().unwrap();
    b.close().unwrap();
    let fresh = ScaFile::open(engine, bytes).unwrap();
    let composed = fresh.read(0, 100).is_ok_and(|c| c == b"from b, longermore from a\n");
    assert!(!composed, "without sharing the writes should not compose");
}

/// Sharing a file that cannot be locked fails every access with `ENOLCK` (as a file system
/// without locks would), and changes nothing below.
#[test]
fn a_lower_file_that_cannot_be_locked_is_refused_and_left_alone() {
    let refusals: [fn() -> plyfs_stack::Error; 3] = [
        || plyfs_stack::Error::Os(libc::ENOLCK),
        || plyfs_stack::Error::Os(libc::EOPNOTSUPP),
        || plyfs_stack::Error::UnsupportedOp { op: "lower-lock".into(), layers: vec!["below".into()], handled_below: vec![] },
    ];
    let unshared = Arc::new(Engine::new("rle", Arc::new(Rle), 12, false));
    let shared = Arc::new(Engine::new("rle", Arc::new(Rle), 12, false).sharing(Some(SharedMode { revalidate: Duration::ZERO })));
    for error in refusals {
        let bytes = MemLower::default();
        let mut f = ScaFile::open(unshared.clone(), bytes.clone()).unwrap();
        f.write(0, b"written before sharing\n").unwrap();
        f.close().unwrap();
        let before = bytes.read_at(0, 1 << 20).unwrap();
        // A file system without locks (or a bottom layer without `lower-lock`).
        let lower = MountLower { mount: 0, bytes: bytes.clone(), holders: Holders::default(), refuse: Some(error) };
        let opened = ScaFile::open(shared.clone(), lower.clone());
        assert_eq!(opened.err().map(|e| e.errno()), Some(libc::ENOLCK), "open of {:?}", error());

        assert_eq!(bytes.read_at(0, 1 << 20).unwrap(), before, "nothing changed below");

        // A new, empty file: writing to it is refused too.
        let empty = MemLower::default();
        let mut f = ScaFile::created(shared.clone(), MountLower { bytes: empty.clone(), ..lower });
        assert_eq!(f.write(0, b"x").err().map(|e| e.errno()), Some(libc::ENOLCK), "write under {:?}", error());
        assert_eq!(f.truncate(3).err().map(|e| e.errno()), Some(libc::ENOLCK), "truncate under {:?}", error());
        assert_eq!(empty.len().unwrap(), 0, "nothing written below");
    }
}
