//! The fast-indexing machinery in process, over an in-memory lower file: every operation is
//! checked against a plain reference buffer, including after reopening, compaction, a lost
//! index and crashes (a lower file cut at any point).

use std::sync::Arc;

use parking_lot::Mutex;
use plyfs_sca::format::DATA_START;
use plyfs_sca::mem::MemLower;
use plyfs_sca::{Engine, LowerIo, ScaFile};
use plyfs_stack::Result;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

mod common;
use common::{PoolProbe, Rle, SlowRle};

fn engine(shift: u8, fast_tails: bool) -> Arc<Engine> {
    Arc::new(Engine::new("rle", Arc::new(Rle), shift, fast_tails))
}

fn read_all(f: &ScaFile<MemLower>) -> Vec<u8> {
    match f.read(0, f.size() as usize + 10) {
        Ok(d) => d,
        Err(e) => panic!("read failed: {e:?}"),
    }
}

#[derive(Clone, Debug)]
enum Step {
    Write { off: u64, len: usize, byte: u8, varied: bool },
    Append { len: usize, byte: u8 },
    Truncate(u64),
    Reopen,
    Compact,
    Read { off: u64, len: usize },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u64..40_000, 1usize..9000, any::<u8>(), any::<bool>()).prop_map(|(off, len, byte, varied)| Step::Write { off, len, byte, varied }),
        3 => (1usize..300, any::<u8>()).prop_map(|(len, byte)| Step::Append { len, byte }),
        2 => (0u64..45_000).prop_map(Step::Truncate),
        1 => Just(Step::Reopen),
        1 => Just(Step::Compact),
        2 => (0u64..45_000, 0usize..10_000).prop_map(|(off, len)| Step::Read { off, len }),
    ]
}

/// Writes large enough that their whole chunks are encoded on several threads, among the rest.
fn big_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u64..600_000, 250_000usize..700_000, any::<u8>(), any::<bool>()).prop_map(|(off, len, byte, varied)| Step::Write { off, len, byte, varied }),
        3 => step(),
    ]
}

fn data(len: usize, byte: u8, varied: bool) -> Vec<u8> {
    (0..len).map(|i| if varied { byte.wrapping_add((i / 7) as u8) } else { byte }).collect()
}

fn run(steps: &[Step], shift: u8, fast_tails: bool) {
    run_with(steps, engine(shift, fast_tails));
}

fn run_with(steps: &[Step], e: Arc<Engine>) {
    let lower = MemLower::default();
    let mut f = ScaFile::open(e.clone(), lower.clone()).unwrap();
    let mut model: Vec<u8> = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        match s {
            Step::Write { off, len, byte, varied } => {
                let d = data(*len, *byte, *varied);
                f.write(*off, &d).unwrap();
                let end = *off as usize + len;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[*off as usize..end].copy_from_slice(&d);
            }
            Step::Append { len, byte } => {
                let d = data(*len, *byte, false);
                f.write(model.len() as u64, &d).unwrap();
                model.extend_from_slice(&d);
            }
            Step::Truncate(n) => {
                f.truncate(*n).unwrap();
                model.resize(*n as usize, 0);
            }
            Step::Reopen => {
                f.close().unwrap();
                if e.pad {
                    // Closed, a padded file stores exactly PADMÉ(size + trailer) bytes.
                    let want = if model.is_empty() { 0 } else { plyfs_sca::format::padme(model.len() as u64 + 16) };
                    assert_eq!(f.index().size, want, "step {i}: stored size of a padded file of {} bytes", model.len());
                }
                f = ScaFile::open(e.clone(), lower.clone()).unwrap();
                assert_eq!(f.is_padded(), e.pad || f.is_padded() && f.size() == 0);
            }
            Step::Compact => {
                f.compact().unwrap();
            }
            Step::Read { off, len } => {
                let got = f.read(*off, *len).unwrap_or_else(|e| panic!("step {i}: {e:?}"));
                let start = (*off as usize).min(model.len());
                let end = (start + len).min(model.len());
                assert_eq!(got, &model[start..end], "step {i}: read {off}+{len}");
            }
        }
        assert_eq!(f.size(), model.len() as u64, "step {i}: size after {s:?}");
        f.index().validate(lower.len().unwrap()).unwrap_or_else(|e| panic!("step {i} ({s:?}): {e}"));
        let live = f.index().live_bytes();
        let dead = f.index().dead_bytes();
        assert!(dead <= live.max(plyfs_sca::file::COMPACT_SLACK_BYTES), "step {i}: {dead} dead bytes for {live} live");
    }
    assert_eq!(read_all(&f), model, "final content");
    f.close().unwrap();
    let f = ScaFile::open(e, lower).unwrap();
    assert_eq!(read_all(&f), model, "content after reopening");
}

proptest! {
    // Failing cases are saved beside this file and replayed first on every run.
    #![proptest_config(ProptestConfig {
        cases: 4096,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/file.proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn matches_reference_4k(steps in proptest::collection::vec(step(), 1..60)) {
        run(&steps, 12, false);
    }

    #[test]
    fn matches_reference_4k_fast_tails(steps in proptest::collection::vec(step(), 1..60)) {
        run(&steps, 12, true);
    }

    #[test]
    fn matches_reference_64k_fast_tails(steps in proptest::collection::vec(step(), 1..40)) {
        run(&steps, 16, true);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1024,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/file.proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    /// Padded files (`crypt:pad=padme`): the real size is sealed in a trailer, and what is
    /// stored is padded at every close.
    #[test]
    fn matches_reference_padded(steps in proptest::collection::vec(step(), 1..60)) {
        run_with(&steps, Arc::new(Engine::new("rle", Arc::new(Rle), 12, false).padding(true)));
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/file.proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn matches_reference_with_large_writes(steps in proptest::collection::vec(big_step(), 1..16), fast_tails in any::<bool>()) {
        // Slow enough per chunk that their whole chunks are encoded on several threads.
        run_with(&steps, Arc::new(Engine::new("rle", Arc::new(SlowRle), 12, fast_tails)));
    }
}

/// Build a file with a varied history, close it, and return the lower bytes and content.
fn sample_file(fast_tails: bool) -> (MemLower, Vec<u8>) {
    let lower = MemLower::default();
    let mut f = ScaFile::open(engine(12, fast_tails), lower.clone()).unwrap();
    let mut model = Vec::new();
    for i in 0..40u64 {
        let d = data(1000 + (i as usize * 37) % 3000, i as u8, i % 2 == 0);
        f.write(model.len() as u64, &d).unwrap();
        model.extend_from_slice(&d);
    }
    f.write(5000, &[7; 3000]).unwrap();
    model[5000..8000].fill(7);
    f.truncate(100_000).unwrap();
    model.resize(100_000, 0);
    f.close().unwrap();
    (lower, model)
}

/// A codec that panics fails the write, naming the codec, its message and the chunk, whichever
/// thread encoded the chunk (the write's own, which must still answer, or the encoder pool's);
/// the write never hangs waiting for the chunk, the file keeps what it held before, and the next
/// write works.
#[test]
fn a_codec_panicking_fails_the_write_on_any_thread() {
    // 64 chunks: the write's thread takes 2 ms over each, the pool claims the rest at once.
    // Chunk 0 is always the write's own; marking every other chunk fails the write whichever
    // thread gets there first.
    for (marked, first_failed) in [(0..1u64, 0u64), (1..64, 1)] {
        let probe = Arc::new(PoolProbe { pool_chunks: std::sync::atomic::AtomicUsize::new(0), panic_on: Some(0xEE) });
        let e = Arc::new(Engine::new("rle", probe.clone(), 12, false));
        let mut f = ScaFile::open(e.clone(), MemLower::default()).unwrap();
        let before = data(10_000, 3, true);
        f.write(0, &before).unwrap();
        let mut big = vec![1u8; 64 << 12];
        for c in marked.clone() {
            big[(c as usize) << 12] = 0xEE;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let written = f.write(0, &big);
            let _ = tx.send((f, written));
        });
        let (mut f, written) = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the write hung");
        let e = written.expect_err("a chunk failed");
        assert!(
            e.to_string().contains("the rle codec panicked: a codec failing on purpose")
                && e.to_string().contains(&format!("offset {}", first_failed << 12)),
            "chunks {marked:?}: {e}"
        );
        assert_eq!(read_all(&f), before, "chunks {marked:?}");
        let after = vec![2u8; 64 << 12];
        f.write(0, &after).unwrap();
        assert_eq!(read_all(&f), after, "chunks {marked:?}");
    }
}

#[test]
fn lost_or_scribbled_index_is_rebuilt() {
    for fast_tails in [false, true] {
        let (lower, model) = sample_file(fast_tails);
        let pristine = lower.0.lock().clone();
        let scribbles: Vec<(&str, Box<dyn Fn(&mut Vec<u8>)>)> = vec![
            ("both slots zeroed", Box::new(|b: &mut Vec<u8>| b[64..192].fill(0))),
            ("file header destroyed", Box::new(|b: &mut Vec<u8>| b[0..256].fill(0xAA))),
            ("checkpoint scribbled", Box::new(|b: &mut Vec<u8>| {
                let n = b.len();
                b[n - 40..n - 8].fill(0x55);
            })),
            ("checkpoint cut off", Box::new(|b: &mut Vec<u8>| {
                let n = b.len();
                b.truncate(n - 30);
            })),
        ];
        for (what, scribble) in scribbles {
            let mut bytes = pristine.clone();
            scribble(&mut bytes);
            *lower.0.lock() = bytes;
            let f = ScaFile::open(engine(12, fast_tails), lower.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(read_all(&f), model, "{what} (fast tails {fast_tails})");
            // And it was repaired: a second open loads it without rebuilding.
            let f = ScaFile::open(engine(12, fast_tails), lower.clone()).unwrap();
            assert_eq!(read_all(&f), model, "{what}: after repair");
        }
    }
}

/// A padded file whose header (which says it is padded) is destroyed: the rebuild finds its
/// size trailer, shows the real size again, and writes the flag back into the new header.
#[test]
fn a_padded_file_with_a_destroyed_header_is_rebuilt_padded() {
    let e = Arc::new(Engine::new("rle", Arc::new(Rle), 12, false).padding(true));
    let lower = MemLower::default();
    let model = data(10_000, 3, true);
    let mut f = ScaFile::open(e.clone(), lower.clone()).unwrap();
    f.write(0, &model).unwrap();
    f.close().unwrap();
    lower.0.lock()[0..256].fill(0xAA);
    let f = ScaFile::open(e.clone(), lower.clone()).unwrap();
    assert!(f.is_padded(), "the trailer tells the rebuild the file was padded");
    assert_eq!(f.size(), 10_000);
    assert_eq!(read_all(&f), model);
    // Repaired: an engine that does not pad reads it as padded from the new header.
    let plain = ScaFile::open(engine(12, false), lower).unwrap();
    assert!(plain.is_padded());
    assert_eq!(read_all(&plain), model);
}

#[test]
fn a_corrupt_chunk_reads_as_an_error_never_as_garbage() {
    let (lower, model) = sample_file(false);
    // Flip one byte inside the payload of the record holding chunk 0.
    let record = ScaFile::open(engine(12, false), lower.clone()).unwrap().index().map.get(0).unwrap();
    lower.0.lock()[record.off as usize + 56 + 1] ^= 0x40;
    let f = ScaFile::open(engine(12, false), lower.clone()).unwrap();
    assert!(f.read(0, 4096).is_err(), "the damaged chunk must fail");
    // Chunks elsewhere still read correctly.
    assert_eq!(f.read(8192, 4096).unwrap(), &model[8192..12288]);
}

#[test]
fn every_crash_point_leaves_a_state_the_user_saw() {
    // Replay a workload, keeping the lower file after each operation; then cut the lower file at
    // many points between two states and check the file opens as one of the seen contents.
    let lower = MemLower::default();
    let e = engine(12, true);
    let mut f = ScaFile::open(e.clone(), lower.clone()).unwrap();
    let mut model = Vec::new();
    let mut seen: Vec<Vec<u8>> = vec![Vec::new()];
    let mut images: Vec<Vec<u8>> = Vec::new();
    for i in 0..60u64 {
        match i % 5 {
            0..=2 => {
                let d = data(10 + (i as usize * 91) % 2000, i as u8, true);
                f.write(model.len() as u64, &d).unwrap();
                model.extend_from_slice(&d);
            }
            3 => {
                let off = (i * 997) % (model.len() as u64 + 1);
                let d = data(500, i as u8, false);
                f.write(off, &d).unwrap();
                let end = off as usize + 500;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&d);
            }
            _ => {
                let n = model.len() as u64 * 3 / 4;
                f.truncate(n).unwrap();
                model.truncate(n as usize);
            }
        }
        seen.push(model.clone());
        images.push(lower.0.lock().clone());
    }
    // Between two operations without a compaction the log only grows, so a crash during the
    // second one leaves the first image plus a prefix of what the second appended. Every such
    // cut must open to content whose every byte is either the old or the new one (a torn
    // write, as on any file system), or fail with an error: never bytes no one wrote.
    let mut checked = 0;
    for k in 1..images.len() {
        let (before, after) = (&images[k - 1], &images[k]);
        if after.len() <= before.len() || after[DATA_START as usize..before.len()] != before[DATA_START as usize..] {
            continue; // compaction or truncation to zero rewrote the log
        }
        let (old, new) = (&seen[k], &seen[k + 1]);
        for cut in (before.len()..after.len()).step_by(31) {
            let mut image = after[..cut].to_vec();
            image[..DATA_START as usize].copy_from_slice(&before[..DATA_START as usize]);
            let crashed = MemLower(Arc::new(Mutex::new(image)));
            let Ok(f) = ScaFile::open(e.clone(), crashed) else { continue };
            let Ok(content) = f.read(0, f.size() as usize) else { continue };
            checked += 1;
            let byte_ok = |i: usize| old.get(i) == Some(&content[i]) || new.get(i) == Some(&content[i]) || (content[i] == 0 && i >= old.len().min(new.len()));
            assert!(
                content.len() >= old.len().min(new.len()) && content.len() <= old.len().max(new.len()) && (0..content.len()).all(byte_ok),
                "a crash at {cut} during operation {k} shows content no one wrote"
            );
        }
    }
    assert!(checked > 100, "only {checked} crash points were checked");
}

/// A lower file cut short (by damage, or on purpose) does not read as a shorter file: the
/// size the header vouches for stays, the chunks whose records are gone read as errors, and
/// the rest reads as before. (A cut that also takes away rewrites of earlier chunks gives
/// those chunks their previous content back: nothing left in the file tells them apart.)
#[test]
fn a_cut_log_reads_as_errors_past_the_cut_never_as_a_shorter_file() {
    for fast_tails in [false, true] {
        let lower = MemLower::default();
        let mut f = ScaFile::open(engine(12, fast_tails), lower.clone()).unwrap();
        let mut model = Vec::new();
        for i in 0..40u64 {
            let d = data(1000 + (i as usize * 37) % 3000, i as u8, i % 2 == 0);
            f.write(model.len() as u64, &d).unwrap();
            model.extend_from_slice(&d);
        }
        f.close().unwrap();
        let full = lower.0.lock().clone();
        let cut = DATA_START as usize + (full.len() - DATA_START as usize) / 2;
        *lower.0.lock() = full[..cut].to_vec();
        let mut f = ScaFile::open(engine(12, fast_tails), lower.clone()).unwrap();
        assert_eq!(f.size(), model.len() as u64, "the size stays what the header says");
        let (mut good, mut bad) = (0, 0);
        for chunk in 0..(model.len() as u64).div_ceil(4096) {
            let off = chunk * 4096;
            let len = (model.len() as u64 - off).min(4096) as usize;
            match f.read_repairing(off, len) {
                Ok(d) => {
                    assert!(d == model[off as usize..off as usize + len], "chunk {chunk} reads back other bytes");
                    assert_eq!(bad, 0, "chunk {chunk} reads after a lost one");
                    good += 1;
                }
                Err(_) => bad += 1,
            }
        }
        assert!(good > 0 && bad > 0, "fast tails {fast_tails}: {good} chunks read, {bad} lost");
        let report = f.verify().unwrap();
        assert_eq!(report["ok"], false, "{report}");
    }
}

/// One change a crashing process may have made to its lower file.
#[derive(Clone)]
enum LowerOp {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

/// A lower file that keeps, besides its bytes, the list of changes made while `journal` is on.
#[derive(Clone, Default)]
struct JournalLower {
    mem: MemLower,
    journal: Arc<Mutex<Option<Vec<LowerOp>>>>,
}

impl JournalLower {
    fn note(&self, op: LowerOp) {
        if let Some(j) = self.journal.lock().as_mut() {
            j.push(op);
        }
    }
}

impl LowerIo for JournalLower {
    fn read_at(&self, off: u64, len: usize) -> Result<Vec<u8>> {
        self.mem.read_at(off, len)
    }
    fn write_at(&self, off: u64, data: &[u8]) -> Result<()> {
        self.note(LowerOp::Write(off, data.to_vec()));
        self.mem.write_at(off, data)
    }
    fn set_len(&self, len: u64) -> Result<()> {
        self.note(LowerOp::SetLen(len));
        self.mem.set_len(len)
    }
    fn len(&self) -> Result<u64> {
        self.mem.len()
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    fn writable(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        "journal".into()
    }
}

/// A process killed during a compaction leaves every lower write before the kill complete
/// and the one in progress cut anywhere. From each such state the file must read back
/// exactly as before, and `verify` (what fsck runs) must call it sound, rebuilding the index
/// where the slot still names the checkpoint from before the compaction.
#[test]
fn a_crash_anywhere_in_a_compaction_loses_nothing() {
    // Rewriting the front of the file leaves the gap at the end (live records move down
    // directly); rewriting the back leaves it at the front (they move through a copy after
    // the log).
    for rewrite_front in [true, false] {
        for fast_tails in [false, true] {
            let lower = JournalLower::default();
            let e = engine(12, fast_tails);
            let mut f = ScaFile::open(e.clone(), lower.clone()).unwrap();
            let mut model = Vec::new();
            for i in 0..24u64 {
                let d = data(700 + (i as usize * 389) % 2500, i as u8, true);
                f.write(model.len() as u64, &d).unwrap();
                model.extend_from_slice(&d);
            }
            for round in 0..6u8 {
                let off = if rewrite_front { 0 } else { model.len() / 2 };
                let d = data(model.len() / 2 - 10, round.wrapping_mul(31), true);
                f.write(off as u64, &d).unwrap();
                model[off..off + d.len()].copy_from_slice(&d);
            }
            f.sync().unwrap();
            let before = lower.mem.0.lock().clone();
            *lower.journal.lock() = Some(Vec::new());
            f.compact().unwrap();
            let ops = lower.journal.lock().take().unwrap();
            assert!(ops.len() >= 4, "the compaction wrote only {} times", ops.len());
            let mut checked = 0;
            for n in 0..ops.len() {
                let cuts: Vec<Option<usize>> = match &ops[n] {
                    LowerOp::Write(_, d) if d.len() > 1 => vec![Some(d.len() / 3), Some(d.len() * 2 / 3), None],
                    _ => vec![None],
                };
                for cut in cuts {
                    let mut image = before.clone();
                    for (k, op) in ops[..=n].iter().enumerate() {
                        match op {
                            LowerOp::Write(off, d) => {
                                let d = if k == n { &d[..cut.unwrap_or(d.len())] } else { &d[..] };
                                let end = *off as usize + d.len();
                                if image.len() < end {
                                    image.resize(end, 0);
                                }
                                image[*off as usize..end].copy_from_slice(d);
                            }
                            LowerOp::SetLen(len) => image.resize(*len as usize, 0),
                        }
                    }
                    let what = format!("front {rewrite_front}, fast tails {fast_tails}, crash in lower write {n} of {} at {cut:?}", ops.len());
                    let crashed = MemLower(Arc::new(Mutex::new(image)));
                    let mut g = ScaFile::open(e.clone(), crashed.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
                    let report = g.verify().unwrap();
                    assert_eq!(report["ok"], true, "{what}: {report}");
                    let mut g = ScaFile::open(e.clone(), crashed).unwrap();
                    let got = g.read_repairing(0, model.len() + 10).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert!(got == model, "{what}: reads back other content");
                    checked += 1;
                }
            }
            assert!(checked > 8, "only {checked} crash points");
        }
    }
}

/// Emptying a file restarts its sequence numbers, so nothing remembered about the old content
/// may be matched against the new records: here the decoded chunk kept for the next write.
#[test]
fn emptying_a_file_forgets_the_chunk_kept_for_rewriting() {
    let lower = MemLower::default();
    let mut f = ScaFile::open(engine(12, false), lower).unwrap();
    f.write(0, &[7; 6000]).unwrap(); // chunk 1 is left partial, and kept decoded
    f.truncate(0).unwrap();
    f.truncate(4096).unwrap();
    f.truncate(8192).unwrap(); // chunk 1 is now zeros, from a record numbered as the old one
    f.write(5000, &[1]).unwrap();
    let mut want = vec![0; 8192];
    want[5000] = 1;
    assert_eq!(read_all(&f), want);
}

/// A file rewritten in place from outside while its state is in memory (a mount holding it
/// open): a read finds the index stale, but nothing of the encoded file is left to rebuild
/// from. It reads as an error, and the outside bytes are left as they are.
#[test]
fn a_file_rewritten_from_outside_is_never_rebuilt_over() {
    for outside in [&b"not an encoded file at all"[..], &[0xAB; 5000][..]] {
        // Larger than what an open reads ahead, so that reads far in go to the lower file.
        let lower = MemLower::default();
        let mut f = ScaFile::open(engine(12, false), lower.clone()).unwrap();
        let model: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        f.write(0, &model).unwrap();
        f.close().unwrap();
        let mut f = ScaFile::open(engine(12, false), lower.clone()).unwrap();
        assert_eq!(f.read(200_000, 4096).unwrap(), &model[200_000..204_096]);
        *lower.0.lock() = outside.to_vec();
        let repaired = f.read_repairing(250_000, 4096);
        assert!(repaired.is_err(), "read {repaired:?} from a file that is not encoded any more");
        assert_eq!(&*lower.0.lock(), outside, "the outside bytes were overwritten");
    }
}

/// A padded file made sparse (a far write, a truncate upwards) keeps its holes as holes: no
/// buffer of the gap's size, and it reads back as zeros with the data after it.
#[test]
fn a_padded_file_grows_sparse_without_filling_the_gap() {
    let e = Arc::new(Engine::new("rle", Arc::new(Rle), 12, false).padding(true));
    let lower = MemLower::default();
    let mut f = ScaFile::open(e.clone(), lower.clone()).unwrap();
    f.write(0, b"head").unwrap();
    f.write(5 << 30, b"tail").unwrap();
    assert_eq!(f.size(), (5 << 30) + 4);
    f.truncate(40 << 30).unwrap();
    assert_eq!(f.size(), 40 << 30);
    f.close().unwrap();
    assert!(lower.0.lock().len() < 1 << 20, "the holes are stored as holes: {} bytes", lower.0.lock().len());
    let f = ScaFile::open(e, lower).unwrap();
    assert_eq!(f.size(), 40 << 30);
    assert_eq!(f.read(0, 8).map_err(|_| ()).unwrap(), b"head\0\0\0\0");
    assert_eq!(f.read((5 << 30) - 2, 8).map_err(|_| ()).unwrap(), b"\0\0tail\0\0");
    assert_eq!(f.read((40 << 30) - 4, 100).map_err(|_| ()).unwrap(), [0; 4]);
}

/// A lower file that notes how far `fallocate` set room aside.
#[derive(Clone)]
struct Reserving {
    file: MemLower,
    reserved_to: Arc<Mutex<u64>>,
}

impl LowerIo for Reserving {
    fn read_at(&self, off: u64, len: usize) -> Result<Vec<u8>> {
        self.file.read_at(off, len)
    }
    fn write_at(&self, off: u64, data: &[u8]) -> Result<()> {
        self.file.write_at(off, data)
    }
    fn set_len(&self, len: u64) -> Result<()> {
        self.file.set_len(len)
    }
    fn len(&self) -> Result<u64> {
        self.file.len()
    }
    fn sync(&self) -> Result<()> {
        self.file.sync()
    }
    fn writable(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        self.file.describe()
    }
    fn reserve(&self, len: u64) -> Result<()> {
        let end = self.file.len()? + len;
        let mut to = self.reserved_to.lock();
        *to = (*to).max(end);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// What `fallocate` sets aside (as the layer asks for it: set aside, grow the file, set
    /// aside again from the new end) holds a new file once the range is written and closed,
    /// whatever the data, the chunk size and the range.
    #[test]
    fn fallocate_sets_aside_what_writing_the_range_takes(
        shift in 12u8..=14,
        offset in 0u64..200_000,
        length in 1u64..300_000,
        noisy in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let lower = Reserving { file: MemLower(Arc::new(Mutex::new(Vec::new()))), reserved_to: Arc::new(Mutex::new(0)) };
        let mut f = ScaFile::created(engine(shift, false), lower.clone());
        f.reserve(offset, length).unwrap();
        f.grow_to(offset + length).unwrap();
        f.reserve(offset, length).unwrap();
        let mut x = seed | 1;
        let data: Vec<u8> = (0..length)
            .map(|i| if noisy { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 } else { (i / 7) as u8 })
            .collect();
        f.write(offset, &data).unwrap();
        f.close().unwrap();
        let (len, reserved) = (lower.len().unwrap(), *lower.reserved_to.lock());
        prop_assert!(len <= reserved, "the file below takes {len} bytes, {reserved} were set aside");
    }
}
