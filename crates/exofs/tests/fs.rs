//! exofs over a real exodisk service: files small and large, directories, removal, and a
//! remount that finds it all again.

use std::ffi::OsStr;
use std::path::Path;

use plyfs_exodisk::client::Client;
use plyfs_exodisk::layout::{self, default_key_path};
use plyfs_exodisk::service::{self, Background};
use plyfs_exofs::format::Inode;
use plyfs_exofs::fs::Fs;
use plyfs_stack::{Error, FileKind};

fn run(dir: &Path) -> (Background, std::path::PathBuf) {
    let img = dir.join("v.img");
    if !img.exists() {
        layout::format(&img, Some(128 << 20), &default_key_path(&img)).unwrap();
    }
    let sock = dir.join("s.sock");
    (service::spawn(&img, &default_key_path(&img), &sock).unwrap(), sock)
}

fn file(kind: FileKind) -> Inode {
    Inode::new(kind, 0o644, 0, 0)
}

#[test]
fn files_and_directories_round_trip_and_survive_a_remount() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 253) as u8).collect();
    let (small_ino, big_ino, sub);
    {
        let (_r, sock) = run(dir.path());
        let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
        let root = fs.root();
        sub = fs.make(root, OsStr::new("sub"), file(FileKind::Dir), &[]).unwrap();
        small_ino = fs.make(sub, OsStr::new("small"), file(FileKind::File), b"").unwrap();
        fs.write(small_ino, 0, b"hello, exofs").unwrap();
        fs.write(small_ino, 7, b"world").unwrap();
        assert_eq!(fs.read(small_ino, 0, 100).unwrap(), b"hello, world");
        big_ino = fs.make(root, OsStr::new("big"), file(FileKind::File), b"").unwrap();
        // Written in uneven pieces, moving out of the inode on the way.
        let mut off = 0;
        for piece in big.chunks(77_777) {
            fs.write(big_ino, off, piece).unwrap();
            off += piece.len() as u64;
        }
        assert_eq!(fs.read(big_ino, 1_000_001, 5000).unwrap(), big[1_000_001..1_005_001]);
        assert!(matches!(fs.make(root, OsStr::new("sub"), file(FileKind::File), b""), Err(Error::Os(libc::EEXIST))));
        assert!(matches!(fs.remove(root, OsStr::new("sub"), true), Err(Error::Os(libc::ENOTEMPTY))));
        let gone = fs.make(root, OsStr::new("gone"), file(FileKind::File), b"bytes").unwrap();
        fs.remove(root, OsStr::new("gone"), false).unwrap();
        assert!(matches!(fs.lookup(root, OsStr::new("gone")), Err(Error::Os(libc::ENOENT))));
        assert!(fs.getattr(gone).is_err());
        fs.truncate(big_ino, 2_500_000).unwrap();
        fs.sync().unwrap();
    }
    // The service restarts; everything is found again through the named root.
    let (_r, sock) = run(dir.path());
    let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
    let root = fs.root();
    let names: Vec<String> = fs.names(root).unwrap().into_iter().map(|(n, _)| n.into_string().unwrap()).collect();
    assert_eq!(names, ["big", "sub"]);
    assert_eq!(fs.lookup(root, OsStr::new("sub")).unwrap().0, sub);
    assert_eq!(fs.lookup(sub, OsStr::new("small")).unwrap().0, small_ino);
    assert_eq!(fs.read(small_ino, 0, 100).unwrap(), b"hello, world");
    let attrs = fs.getattr(big_ino).unwrap();
    assert_eq!(attrs.size, 2_500_000);
    assert_eq!(fs.read(big_ino, 0, 2_600_000).unwrap(), big[..2_500_000]);
    // Growing again reads zeros past the old end.
    fs.truncate(big_ino, 2_600_000).unwrap();
    assert!(fs.read(big_ino, 2_500_000, 100_000).unwrap().iter().all(|b| *b == 0));
    // Sparse: a write far past the end of a 128 MiB volume takes only what it writes.
    let sparse = fs.make(root, OsStr::new("sparse"), file(FileKind::File), b"").unwrap();
    fs.write(sparse, 0, b"head").unwrap();
    fs.write(sparse, 3 << 30, b"tail").unwrap();
    assert_eq!(fs.getattr(sparse).unwrap().size, (3 << 30) + 4);
    assert_eq!(fs.read(sparse, (3 << 30) - 2, 10).unwrap(), b"\0\0tail");
    assert_eq!(fs.read(sparse, 0, 6).unwrap(), b"head\0\0");
    // Small appends stay one extent.
    let log = fs.make(root, OsStr::new("log"), file(FileKind::File), b"").unwrap();
    let mut expect = Vec::new();
    for i in 0..300u32 {
        let line = format!("line {i:05} of the log\n");
        fs.write(log, expect.len() as u64, line.as_bytes()).unwrap();
        expect.extend_from_slice(line.as_bytes());
    }
    assert_eq!(fs.read(log, 0, expect.len()).unwrap(), expect);
}

/// Sectors allocated on the volume, seen by another client.
/// Sectors allocated in the object area (the superblock, free map and tag area before it are
/// the volume's own).
fn allocated(sock: &Path) -> u64 {
    let c = Client::connect(sock, 1 << 20).unwrap();
    c.free_map().unwrap().allocated() - c.data_start
}

#[test]
fn small_files_wait_in_memory_until_write_back_and_leave_nothing_behind() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let content = |i: u32| -> Vec<u8> { (0..10_000 + i).map(|j| ((i * 31 + j) % 251) as u8).collect() };
    let (empty, d);
    {
        let (_r, sock) = run(dir.path());
        let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
        fs.close().unwrap();
        empty = allocated(&sock);
        d = fs.make(fs.root(), OsStr::new("d"), file(FileKind::Dir), &[]).unwrap();
        let mut inos = Vec::new();
        for i in 0..100u32 {
            let ino = fs.make(d, OsStr::new(&format!("f{i:03}")), file(FileKind::File), b"").unwrap();
            for (k, piece) in content(i).chunks(4096).enumerate() {
                fs.write(ino, k as u64 * 4096, piece).unwrap();
            }
            inos.push(ino);
        }
        // Nothing of the data is on the volume yet: only inodes were made.
        let before = allocated(&sock);
        assert!(before - empty < 100 * 20, "{} sectors allocated before write-back", before - empty);
        assert_eq!(fs.read(inos[7], 9_990, 100).unwrap(), content(7)[9_990..]);
        // Half go before they were ever written back: their inodes are reused, nothing is freed.
        for i in (0..100u32).step_by(2) {
            fs.remove(d, OsStr::new(&format!("f{i:03}")), false).unwrap();
        }
        let again = fs.make(d, OsStr::new("again"), file(FileKind::File), b"").unwrap();
        assert!(inos.contains(&again), "a removed inode that never reached the disk is reused");
        fs.remove(d, OsStr::new("again"), false).unwrap();
        fs.sync().unwrap();
        // The other half is on the volume now, each near its directory's inode.
        assert!(allocated(&sock) - before >= 50 * 20);
        fs.close().unwrap();
    }
    let (_r, sock) = run(dir.path());
    let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
    assert_eq!(fs.names(d).unwrap().len(), 50);
    for i in (1..100u32).step_by(2) {
        let (ino, attrs) = fs.lookup(d, OsStr::new(&format!("f{i:03}"))).unwrap();
        assert_eq!(attrs.size, 10_000 + i as u64);
        assert!(fs.read(ino, 0, 20_000).unwrap() == content(i), "f{i:03}");
    }
    for i in (1..100u32).step_by(2) {
        fs.remove(d, OsStr::new(&format!("f{i:03}")), false).unwrap();
    }
    fs.remove(fs.root(), OsStr::new("d"), true).unwrap();
    fs.close().unwrap();
    assert_eq!(allocated(&sock), empty, "every sector comes back when everything is removed");
}

/// A small deterministic generator (xorshift), so that a failing seed reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The seeds to run: `PLYFS_SEED=N` alone, or `count` spread by `step`.
fn seeds(count: u64, step: u64) -> Vec<u64> {
    match std::env::var("PLYFS_SEED") {
        Ok(s) => vec![s.parse().expect("PLYFS_SEED is a number")],
        Err(_) => (1..=count).map(|i| i.wrapping_mul(step)).collect(),
    }
}

/// Operations per seed: the number in `var`, or `default`.
fn ops(var: &str, default: usize) -> usize {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Random writes, truncations, insertions and removals in the middle, write-backs and restarts,
/// each compared with the same operations on a plain vector. `PLYFS_SEED=N` replays one seed.
#[test]
fn insert_and_punch_match_a_reference_under_random_operations() {
    let ops = ops("PLYFS_FSX_OPS", 400);
    for seed in seeds(6, 0x9E37_79B9_7F4A_7C15) {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let mut rng = Rng(seed);
        let mut model: Vec<u8> = Vec::new();
        let (mut running, sock) = run(dir.path());
        let mut fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
        let ino = fs.make(fs.root(), OsStr::new("f"), file(FileKind::File), b"").unwrap();
        // Sizes around the thresholds: immediate (480 B), held in memory (256 KiB), sectors.
        let span = |rng: &mut Rng| [600u64, 5_000, 70_000, 400_000][rng.below(4) as usize];
        for step in 0..ops {
            let what = rng.below(100);
            let sp = span(&mut rng);
            let tiny = rng.below(3) == 0;
            let ctx = format!("seed {seed}, step {step}, size {}", model.len());
            match what {
                0..=29 => {
                    let off = rng.below(model.len() as u64 + sp / 4);
                    let len = 1 + rng.below(sp);
                    let byte = (step % 251) as u8 + 1;
                    let data: Vec<u8> = (0..len).map(|i| byte.wrapping_add(i as u8)).collect();
                    fs.write(ino, off, &data).unwrap_or_else(|e| panic!("{ctx}: write: {e:?}"));
                    let end = (off + len) as usize;
                    if model.len() < end {
                        model.resize(end, 0);
                    }
                    model[off as usize..end].copy_from_slice(&data);
                }
                30..=49 => {
                    let off = rng.below(model.len() as u64 + 1);
                    let len = 1 + rng.below(if tiny { 20 } else { sp });
                    let data: Vec<u8> = (0..len).map(|i| (i * 7 + step as u64) as u8 | 1).collect();
                    let a = fs.insert(ino, off, &data).unwrap_or_else(|e| panic!("{ctx}: insert: {e:?}"));
                    model.splice(off as usize..off as usize, data);
                    assert_eq!(a.size, model.len() as u64, "{ctx}");
                }
                50..=64 => {
                    let off = rng.below(model.len() as u64 + 1);
                    let len = rng.below(sp);
                    let a = fs.remove_range(ino, off, len).unwrap_or_else(|e| panic!("{ctx}: punch: {e:?}"));
                    let end = (off + len).min(model.len() as u64) as usize;
                    model.drain(off as usize..end);
                    assert_eq!(a.size, model.len() as u64, "{ctx}");
                }
                65..=74 => {
                    let size = rng.below(model.len() as u64 + sp);
                    fs.truncate(ino, size).unwrap_or_else(|e| panic!("{ctx}: truncate: {e:?}"));
                    model.resize(size as usize, 0);
                }
                75..=84 => fs.sync().unwrap_or_else(|e| panic!("{ctx}: sync: {e:?}")),
                85..=87 => {
                    // Unmount, restart the service, mount again.
                    fs.close().unwrap_or_else(|e| panic!("{ctx}: close: {e:?}"));
                    drop(fs);
                    drop(running);
                    (running, _) = run(dir.path());
                    fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
                }
                _ => {
                    let off = rng.below(model.len() as u64 + 10);
                    let len = rng.below(sp) as usize;
                    let got = fs.read(ino, off, len).unwrap_or_else(|e| panic!("{ctx}: read: {e:?}"));
                    let s = (off as usize).min(model.len());
                    let want = &model[s..(s + len).min(model.len())];
                    assert!(got == want, "{ctx}: read {off}+{len} differs");
                }
            }
            assert_eq!(fs.getattr(ino).unwrap().size, model.len() as u64, "{ctx}");
        }
        let all = fs.read(ino, 0, model.len() + 1).unwrap();
        assert!(all == model, "seed {seed}: the whole file differs at the end");
        // Removed, it gives every sector back.
        fs.remove(fs.root(), OsStr::new("f"), false).unwrap();
        fs.close().unwrap();
        drop(fs);
        drop(running);
        let (_r, sock) = run(dir.path());
        let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
        assert!(fs.names(fs.root()).unwrap().is_empty());
        fs.close().unwrap();
        let used = allocated(&sock);
        assert!(used < 2048, "seed {seed}: {used} sectors still allocated with the file gone");
    }
}

#[test]
fn a_very_fragmented_file_keeps_its_extents_in_a_descendant() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let (empty, ino);
    {
        let (_r, sock) = run(dir.path());
        let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
        fs.close().unwrap();
        empty = allocated(&sock);
        ino = fs.make(fs.root(), OsStr::new("holes"), file(FileKind::File), b"").unwrap();
        // 600 pieces of 4 KiB, each 60 KiB from the next: 600 extents, far more than an inode holds.
        for i in 0..600u64 {
            fs.write(ino, i * 65536, &[i as u8 | 1; 4096]).unwrap();
        }
        fs.close().unwrap();
    }
    let (_r, sock) = run(dir.path());
    let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
    for i in (0..600u64).step_by(37) {
        assert_eq!(fs.read(ino, i * 65536, 4096).unwrap(), vec![i as u8 | 1; 4096], "piece {i}");
        assert!(fs.read(ino, i * 65536 + 4096, 100).unwrap().iter().all(|b| *b == 0));
    }
    fs.truncate(ino, 300 * 65536).unwrap();
    fs.sync().unwrap();
    fs.remove(fs.root(), OsStr::new("holes"), false).unwrap();
    fs.close().unwrap();
    assert_eq!(allocated(&sock), empty, "the extents, the holder and the inode are all given back");
}

/// A small volume filled past full under delayed write-back (xfstests generic/750 found the
/// bugs): writes are refused with ENOSPC when they are made, and only then (write-back never
/// refuses what was accepted); removing files makes room again; and every file kept reads
/// back exactly after a restart. `PLYFS_SEED=N` replays one seed.
#[test]
fn filling_the_volume_and_freeing_room_loses_nothing() {
    let ops = ops("PLYFS_FILL_OPS", 600);
    let enospc = |e: &Error| matches!(e, Error::Os(libc::ENOSPC));
    for seed in seeds(4, 0x2545_F491_4F6C_DD1D) {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let img = dir.path().join("v.img");
        layout::format(&img, Some(12 << 20), &default_key_path(&img)).unwrap();
        let mut rng = Rng(seed);
        let (mut running, sock) = run(dir.path());
        let mut fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
        let root = fs.root();
        // name -> (inode, content)
        let mut model: std::collections::BTreeMap<String, (u64, Vec<u8>)> = Default::default();
        let (mut refused, mut made) = (0, 0);
        // Remove `k` files, chosen at random: the room a full volume needs.
        let free_some = |fs: &Fs, model: &mut std::collections::BTreeMap<String, (u64, Vec<u8>)>, rng: &mut Rng, k: usize, ctx: &str| {
            for _ in 0..k.min(model.len()) {
                let name = model.keys().nth(rng.below(model.len() as u64) as usize).unwrap().clone();
                fs.remove(root, OsStr::new(&name), false).unwrap_or_else(|e| panic!("{ctx}: remove {name}: {e:?}"));
                model.remove(&name);
            }
        };
        for step in 0..ops {
            let ctx = format!("seed {seed}, step {step}, {} files", model.len());
            match rng.below(100) {
                0..=59 => {
                    let size = [300u64, 3_000, 40_000, 200_000, 700_000, 2_000_000][rng.below(6) as usize];
                    let size = size / 2 + rng.below(size);
                    let name = format!("f{step:05}");
                    let byte = rng.below(251) as u8;
                    let data: Vec<u8> = (0..size).map(|i| byte.wrapping_add((i % 253) as u8)).collect();
                    let ino = match fs.make(root, OsStr::new(&name), file(FileKind::File), b"") {
                        Ok(ino) => ino,
                        Err(e) if enospc(&e) => {
                            refused += 1;
                            free_some(&fs, &mut model, &mut rng, 3, &ctx);
                            continue;
                        }
                        Err(e) => panic!("{ctx}: make {name}: {e:?}"),
                    };
                    let mut off = 0;
                    let mut failed = false;
                    for piece in data.chunks(65_536) {
                        match fs.write(ino, off, piece) {
                            Ok(()) => off += piece.len() as u64,
                            Err(e) if enospc(&e) => {
                                failed = true;
                                break;
                            }
                            Err(e) => panic!("{ctx}: write {name} at {off}: {e:?}"),
                        }
                    }
                    if failed {
                        // What was written stays; the file keeps its first `off` bytes.
                        refused += 1;
                        let got = fs.read(ino, 0, data.len() + 1).unwrap_or_else(|e| panic!("{ctx}: read {name}: {e:?}"));
                        assert!(
                            got == data[..off as usize],
                            "{ctx}: {name} after a refused write at {off}: {} bytes, first difference at {:?}",
                            got.len(),
                            got.iter().zip(&data).position(|(a, b)| a != b)
                        );
                        model.insert(name, (ino, got));
                        free_some(&fs, &mut model, &mut rng, 3, &ctx);
                    } else {
                        made += 1;
                        model.insert(name, (ino, data));
                    }
                }
                60..=67 => free_some(&fs, &mut model, &mut rng, 1, &ctx),
                68..=74 => {
                    // Bytes put in the middle: the file changes whole, or not at all.
                    let Some(name) = model.keys().nth(rng.below(model.len() as u64) as usize).cloned() else { continue };
                    let (ino, data) = model.get_mut(&name).unwrap();
                    let off = rng.below(data.len() as u64 + 1) as usize;
                    let piece: Vec<u8> = (0..[10u64, 5_000, 300_000][rng.below(3) as usize]).map(|i| (i * 3 + step as u64) as u8).collect();
                    match fs.insert(*ino, off as u64, &piece) {
                        Ok(_) => {
                            data.splice(off..off, piece);
                        }
                        Err(e) => {
                            assert!(enospc(&e), "{ctx}: insert into {name}: {e:?}");
                            refused += 1;
                        }
                    }
                    let got = fs.read(*ino, 0, data.len() + 1).unwrap_or_else(|e| panic!("{ctx}: read {name}: {e:?}"));
                    assert!(got == *data, "{ctx}: {name} after an insertion");
                }
                // What was accepted has its room: write-back never refuses it.
                75..=89 => fs.sync().unwrap_or_else(|e| panic!("{ctx}: sync: {e:?}")),
                90..=93 => {
                    fs.close().unwrap_or_else(|e| panic!("{ctx}: close: {e:?}"));
                    drop(fs);
                    drop(running);
                    (running, _) = run(dir.path());
                    fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
                    let names: Vec<String> = fs.names(root).unwrap().into_iter().map(|(n, _)| n.into_string().unwrap()).collect();
                    assert_eq!(names, model.keys().cloned().collect::<Vec<_>>(), "{ctx}: the names after a restart");
                }
                _ => {
                    if let Some((name, (ino, data))) = model.iter().nth(rng.below(model.len() as u64) as usize) {
                        let got = fs.read(*ino, 0, data.len() + 1).unwrap_or_else(|e| panic!("{ctx}: read {name}: {e:?}"));
                        assert!(got == *data, "{ctx}: {name} differs");
                    }
                }
            }
        }
        fs.close().unwrap_or_else(|e| panic!("seed {seed}: close: {e:?}"));
        drop(fs);
        drop(running);
        let (_r, sock) = run(dir.path());
        let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
        for (name, (_, data)) in &model {
            let (ino, attrs) = fs.lookup(root, OsStr::new(name)).unwrap_or_else(|e| panic!("seed {seed}: {name}: {e:?}"));
            assert_eq!(attrs.size, data.len() as u64, "seed {seed}: {name}");
            assert!(fs.read(ino, 0, data.len() + 1).unwrap() == *data, "seed {seed}: {name} differs after a restart");
        }
        assert!(refused > 5 && made > 20, "seed {seed}: the volume never filled ({refused} refusals, {made} files)");
        eprintln!("seed {seed}: {made} files made, {refused} refusals, {} kept", model.len());
    }
}

/// Two file systems on one volume (two roots) allocate in turn, each from a map of the volume
/// that the other's allocations leave stale: the service refuses a run the other took, and
/// the file system takes another, never passing the refusal on.
#[test]
fn two_file_systems_on_one_volume_allocate_in_turn_without_refusals() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let (_r, sock) = run(dir.path());
    let a = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "a").unwrap();
    let b = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "b").unwrap();
    let content = |i: u32, size: usize| -> Vec<u8> { (0..size).map(|j| (j as u32 * 7 + i) as u8).collect() };
    let sizes = [3_000usize, 100_000, 600_000];
    for i in 0..120u32 {
        for (k, fs) in [&a, &b].into_iter().enumerate() {
            let name = format!("f{i:03}");
            let data = content(i * 2 + k as u32, sizes[i as usize % 3]);
            let ino = fs.make(fs.root(), OsStr::new(&name), file(FileKind::File), b"").unwrap_or_else(|e| panic!("{k}: make {name}: {e:?}"));
            for (j, piece) in data.chunks(50_000).enumerate() {
                fs.write(ino, j as u64 * 50_000, piece).unwrap_or_else(|e| panic!("{k}: write {name}: {e:?}"));
            }
            if i % 5 == k as u32 {
                fs.sync().unwrap_or_else(|e| panic!("{k}: sync after {name}: {e:?}"));
            }
        }
    }
    for (k, fs) in [&a, &b].into_iter().enumerate() {
        fs.close().unwrap_or_else(|e| panic!("{k}: close: {e:?}"));
        for i in 0..120u32 {
            let (ino, _) = fs.lookup(fs.root(), OsStr::new(&format!("f{i:03}"))).unwrap();
            assert!(fs.read(ino, 0, 1 << 20).unwrap() == content(i * 2 + k as u32, sizes[i as usize % 3]), "{k}: f{i:03}");
        }
    }
}
