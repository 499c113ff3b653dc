//! A concurrency stress generator, in the manner of xfstests' fsstress (which CI cannot fetch
//! and build): workers that change one small namespace at once, so that their creates,
//! renames, removals, writes, truncates and links collide on the same names all the time. The
//! errors such collisions cause (`ENOENT`, `EEXIST`, ...) are expected; any other, above all
//! `EIO`, fails the run. Each worker draws from its own generator, seeded from the run's seed,
//! which is printed and taken back from `PLYFS_STRESS_SEED`.

use std::collections::BTreeMap;
use std::fs;
use std::hash::{Hash, Hasher};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::rng::Rng;

/// Top-level directories the workers share, and names in each.
const DIRS: u64 = 4;
const NAMES: u64 = 20;

/// What colliding workers are told, as Linux file systems tell them.
const EXPECTED: &[i32] = &[
    libc::ENOENT,
    libc::EEXIST,
    libc::ENOTEMPTY,
    libc::EISDIR,
    libc::ENOTDIR,
    libc::EINVAL,
    libc::EXDEV,
    libc::ELOOP,
    libc::EMLINK,
    // A hard link to a directory.
    libc::EPERM,
];

/// The run's seed: `PLYFS_STRESS_SEED`, or a new one; printed either way.
pub fn seed() -> u64 {
    super::rng::seed("PLYFS_STRESS_SEED")
}

/// Run `workers` workers of `ops` operations each under `root` (its directories `d0`...
/// are made first). Returns the number of operations that succeeded, or the first unexpected
/// error, with the seed.
pub fn run(root: &Path, seed: u64, workers: u64, ops: u64) -> Result<u64, String> {
    for d in 0..DIRS {
        fs::create_dir_all(root.join(format!("d{d}"))).unwrap();
    }
    let done: Vec<Result<u64, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers).map(|w| s.spawn(move || work(root, Rng::spread(seed ^ (w + 1)), ops))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a worker panicked".into()))).collect()
    });
    let mut succeeded = 0;
    for (w, r) in done.into_iter().enumerate() {
        match r {
            Ok(n) => succeeded += n,
            Err(e) => return Err(format!("stress seed {seed}, worker {w}: {e}")),
        }
    }
    Ok(succeeded)
}

/// A path in the shared namespace: `dN/nM`, or one level deeper under such a name.
fn pick(root: &Path, rng: &mut Rng) -> PathBuf {
    let mut p = root.join(format!("d{}", rng.below(DIRS))).join(format!("n{}", rng.below(NAMES)));
    if rng.below(3) == 0 {
        p.push(format!("n{}", rng.below(NAMES)));
    }
    p
}

fn work(root: &Path, mut rng: Rng, ops: u64) -> Result<u64, String> {
    let mut succeeded = 0;
    for _ in 0..ops {
        let (a, b) = (pick(root, &mut rng), pick(root, &mut rng));
        let (what, result) = step(&mut rng, &a, &b);
        match result {
            Ok(()) => succeeded += 1,
            Err(e) if e.raw_os_error().is_some_and(|n| EXPECTED.contains(&n)) => {}
            Err(e) => return Err(format!("{what} {} {}: {e}", a.display(), b.display())),
        }
    }
    Ok(succeeded)
}

/// One operation on `a` (and `b`): its name and its result.
fn step(rng: &mut Rng, a: &Path, b: &Path) -> (&'static str, std::io::Result<()>) {
    let offset = rng.below(256 << 10);
    let len = 1 + rng.below(32 << 10) as usize;
    let byte = rng.below(256) as u8;
    match rng.below(15) {
        0 | 1 => {
            let created = fs::OpenOptions::new().write(true).create(true).truncate(false).open(a);
            ("create", created.and_then(|mut f| f.write_all(&vec![byte; len])))
        }
        2 => ("mkdir", fs::create_dir(a)),
        3 | 4 => ("rename", fs::rename(a, b)),
        5 => ("unlink", fs::remove_file(a)),
        6 => ("rmdir", fs::remove_dir(a)),
        7 | 8 => ("write", write_at(a, offset, &vec![byte; len])),
        9 => ("truncate", fs::OpenOptions::new().write(true).open(a).and_then(|f| f.set_len(rng.below(512 << 10)))),
        10 => ("link", fs::hard_link(a, b)),
        11 => ("symlink", std::os::unix::fs::symlink(b.file_name().unwrap(), a)),
        12 => ("chmod", fs::set_permissions(a, fs::Permissions::from_mode(0o700 | rng.below(0o100) as u32))),
        13 => ("fsync", write_at(a, offset, &[byte]).and_then(|()| fs::OpenOptions::new().write(true).open(a)?.sync_all())),
        _ => ("read", fs::File::open(a).and_then(|mut f| f.read_to_end(&mut Vec::new())).map(|_| ())),
    }
}

fn write_at(path: &Path, offset: u64, data: &[u8]) -> std::io::Result<()> {
    let mut f = fs::OpenOptions::new().write(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
    f.seek(SeekFrom::Start(offset))?;
    f.write_all(data)
}

/// Every object under `root` (but plyfs's own names at its top, `.plyfs-...`) with what a copy
/// must keep: kind, mode, links, size and a hash of the content, or a symlink's target.
pub fn tree(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            let rel = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel.starts_with(".plyfs-") {
                continue;
            }
            let meta = fs::symlink_metadata(&path).unwrap();
            let what = if meta.is_dir() {
                walk(root, &path, out);
                format!("dir {:o}", meta.mode())
            } else if meta.file_type().is_symlink() {
                format!("link -> {}", fs::read_link(&path).unwrap().display())
            } else {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                fs::read(&path).unwrap().hash(&mut h);
                format!("file {:o} links {} size {} hash {:x}", meta.mode(), meta.nlink(), meta.len(), h.finish())
            };
            out.insert(rel, what);
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// Where two trees of [`tree`] differ, one line each (at most 20).
pub fn differences(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> Vec<String> {
    let names: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    names
        .into_iter()
        .filter(|n| a.get(*n) != b.get(*n))
        .take(20)
        .map(|n| format!("{n}: {:?} / {:?}", a.get(n), b.get(n)))
        .collect()
}
