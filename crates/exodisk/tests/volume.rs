//! Formatting, the start-up scan and offline tampering, on real image files with direct I/O.

use std::path::{Path, PathBuf};

use plyfs_exodisk::disk::{Aligned, Disk, SECTOR};
use plyfs_exodisk::layout::{self, default_key_path};
use plyfs_exodisk::object::{Caps, Entry, Exonode, ExtentHeader};
use plyfs_exodisk::scan::scan;

fn image(dir: &Path) -> (PathBuf, PathBuf) {
    let img = dir.join("vol.img");
    let key = default_key_path(&img);
    layout::format(&img, Some(16 << 20), &key).unwrap();
    (img, key)
}

fn write_at(img: &Path, at: u64, bytes: &[u8]) {
    let disk = Disk::open(img, false).unwrap();
    disk.write(at, &Aligned::from_bytes(bytes)).unwrap();
}

fn flip(img: &Path, byte: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(img).unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, byte).unwrap();
    b[0] ^= 0x20;
    f.write_all_at(&b, byte).unwrap();
}

#[test]
fn a_new_volume_scans_clean_and_bad_input_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = image(dir.path());
    let (disk, k, sb) = layout::open(&img, &key).unwrap();
    let (found, report, map) = scan(&disk, &k, &sb).unwrap();
    assert!(report.clean(), "{report:?}");
    assert_eq!((found.extents.len(), found.exonodes.len(), report.reclaimed), (0, 1, 0));
    assert_eq!(map.allocated(), sb.data_start + layout::ROOTS_SECTORS as u64);
    // In use: a second opener is refused at once.
    let err = layout::open(&img, &key).err().unwrap().to_string();
    assert!(err.contains("in use"), "{err}");
    drop(disk);

    let before = std::fs::read(&img).unwrap();
    let err = layout::format(&img, None, &dir.path().join("other.key")).err().unwrap().to_string();
    assert!(err.contains("already an exodisk volume"), "{err}");
    assert!(std::fs::read(&img).unwrap() == before && !dir.path().join("other.key").exists());
    // Another volume's key is never overwritten.
    let fresh = dir.path().join("fresh.img");
    let err = layout::format(&fresh, Some(4 << 20), &key).err().unwrap().to_string();
    assert!(err.contains("key file is already there") && !fresh.exists(), "{err}");

    let small = dir.path().join("small.img");
    let err = layout::format(&small, Some(100 << 10), &dir.path().join("small.key")).err().unwrap().to_string();
    assert!(err.contains("too small"), "{err}");
    assert!(!small.exists() && !dir.path().join("small.key").exists());

    let plain = dir.path().join("plain.img");
    std::fs::write(&plain, vec![0u8; 4 << 20]).unwrap();
    let err = layout::open(&plain, &key).err().unwrap().to_string();
    assert!(err.contains("not an exodisk volume"), "{err}");
    // A key of another volume.
    let (img2, _) = {
        let d2 = dir.path().join("two");
        std::fs::create_dir(&d2).unwrap();
        image(&d2)
    };
    let err = layout::open(&img2, &key).err().unwrap().to_string();
    assert!(err.contains("authentication failed"), "{err}");
}

#[test]
fn objects_are_found_leftovers_reclaimed_and_edits_detected() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = image(dir.path());
    let caps = Caps { read: 11, write: 22 };
    let (ext_at, xn_at, leftover) = {
        let (disk, k, sb) = layout::open(&img, &key).unwrap();
        let base = sb.data_start + 64;
        // An extent of 21 sectors, an exonode owning an extent, and allocated sectors nobody owns.
        disk.write(base, &Aligned::from_bytes(&ExtentHeader { sectors: 21, caps, model: 1 }.seal(&k, base))).unwrap();
        let x = Exonode { sectors: 1, caps, model: 1, parent: 0, entries: vec![Entry::Extent { start: base + 100, sectors: 8 }] };
        disk.write(base + 50, &Aligned::from_bytes(&x.seal(&k, base + 50))).unwrap();
        let (_, _, mut map) = scan(&disk, &k, &sb).unwrap();
        map.set(base, 21, true);
        map.set(base + 50, 1, true);
        map.set(base + 100, 8, true);
        map.set(base + 500, 7, true);
        map.store(&disk, &k, &sb).unwrap();
        // Application data that happens to start like a header is not mistaken for one.
        let mut junk = vec![0u8; SECTOR];
        junk[..8].copy_from_slice(b"PLYEXOEX");
        disk.write(base + 3, &Aligned::from_bytes(&junk)).unwrap();
        (base, base + 50, base + 500)
    };
    let (disk, k, sb) = layout::open(&img, &key).unwrap();
    let (found, report, map) = scan(&disk, &k, &sb).unwrap();
    assert!(report.clean(), "{report:?}");
    assert_eq!((found.extents.len(), found.exonodes.len()), (1, 2));
    assert_eq!(report.reclaimed, 7);
    assert!(!map.is_allocated(leftover) && map.is_allocated(xn_at) && map.is_allocated(ext_at + 100));
    drop(disk);

    // An edited header, an edited exonode, an edited free map: each is detected, never trusted.
    for (byte, expect) in [
        (ext_at * SECTOR as u64 + 40, "extent header that fails authentication"),
        (xn_at * SECTOR as u64 + 60, "exonode that fails authentication"),
        (sb.map_start * SECTOR as u64 + 100, "free-map block 0 fails authentication"),
    ] {
        flip(&img, byte);
        let (disk, k, sb) = layout::open(&img, &key).unwrap();
        let (_, report, _) = scan(&disk, &k, &sb).unwrap();
        assert!(report.problems.iter().any(|p| p.contains(expect)), "{expect}: {report:?}");
        drop(disk);
        flip(&img, byte);
    }
    // A record moved elsewhere does not open there.
    let mut header = vec![0u8; SECTOR];
    {
        use std::os::unix::fs::FileExt;
        std::fs::File::open(&img).unwrap().read_exact_at(&mut header, ext_at * SECTOR as u64).unwrap();
    }
    write_at(&img, leftover + 40, &header);
    let (disk, k, sb) = layout::open(&img, &key).unwrap();
    let (found, report, _) = scan(&disk, &k, &sb).unwrap();
    assert_eq!(found.extents.len(), 1);
    assert!(report.problems.iter().any(|p| p.contains(&format!("sector {}", leftover + 40))), "{report:?}");
}

#[test]
fn sectors_owned_twice_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = image(dir.path());
    let (disk, k, sb) = layout::open(&img, &key).unwrap();
    let base = sb.data_start + 64;
    let caps = Caps { read: 1, write: 2 };
    disk.write(base, &Aligned::from_bytes(&ExtentHeader { sectors: 10, caps, model: 1 }.seal(&k, base))).unwrap();
    let x = Exonode { sectors: 1, caps, model: 1, parent: 0, entries: vec![Entry::Extent { start: base + 5, sectors: 10 }] };
    disk.write(base + 40, &Aligned::from_bytes(&x.seal(&k, base + 40))).unwrap();
    let (_, report, _) = scan(&disk, &k, &sb).unwrap();
    assert!(report.problems.iter().any(|p| p.contains("owned twice")), "{report:?}");
    assert!(report.problems.iter().any(|p| p.contains("marked free")), "{report:?}");
}

#[test]
fn a_descendant_entry_naming_a_removed_exonode_is_given_back_not_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = image(dir.path());
    let (disk, k, sb) = layout::open(&img, &key).unwrap();
    let base = sb.data_start + 64;
    // The parent was not written again before a crash, after its child was overwritten.
    let x = Exonode {
        sectors: 1,
        caps: Caps { read: 1, write: 2 },
        model: 1,
        parent: 0,
        entries: vec![Entry::Descendant { at: base + 5 }],
    };
    disk.write(base, &Aligned::from_bytes(&x.seal(&k, base))).unwrap();
    let (_, _, mut map) = scan(&disk, &k, &sb).unwrap();
    map.set(base, 1, true);
    map.store(&disk, &k, &sb).unwrap();
    let (_, report, _) = scan(&disk, &k, &sb).unwrap();
    assert!(report.clean(), "{report:?}");
    assert_eq!(report.dangling, vec![(base, 0)]);
}

#[test]
fn a_version_1_volume_is_refused_not_misread() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key_path) = image(dir.path());
    let key = layout::load_key(&key_path).unwrap();
    let disk = Disk::open(&img, false).unwrap();
    let mut first = Aligned::zeroed(SECTOR);
    disk.read(0, &mut first).unwrap();
    drop(disk);
    // The same superblock, as the format that kept extent data in clear wrote it.
    let mut body = key.open(plyfs_exodisk::seal::SUPERBLOCK, 0, &first).unwrap().to_vec();
    body[0] = 1;
    write_at(&img, 0, &key.seal(plyfs_exodisk::seal::SUPERBLOCK, 0, 1, &body));
    let e = layout::open(&img, &key_path).err().expect("a version 1 volume opened").to_string();
    assert!(e.contains("version 1") && e.contains("format a new volume"), "{e}");
}

/// Found by the power-cut test (`crates/cli/tests/exocut.rs`): a cut in the middle of exofs's
/// creation of an inode left an exonode whose parent did not name it yet. The service gave its
/// sectors back but left its record, so every scan after found and reported it again.
#[test]
fn an_orphaned_exonode_is_given_back_once_and_then_gone() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = image(dir.path());
    let orphan_at = {
        let (disk, k, sb) = layout::open(&img, &key).unwrap();
        let at = sb.data_start + 64;
        let x = Exonode { sectors: 2, caps: Caps { read: 1, write: 2 }, model: 1, parent: sb.roots_at(), entries: vec![] };
        disk.write(at, &Aligned::from_bytes(&x.seal(&k, at))).unwrap();
        let (_, report, mut map) = scan(&disk, &k, &sb).unwrap();
        assert_eq!(report.orphans, vec![at]);
        map.set(at, 2, true);
        map.store(&disk, &k, &sb).unwrap();
        at
    };
    let service = plyfs_exodisk::service::spawn(&img, &key, &dir.path().join("s.sock")).unwrap();
    drop(service);
    let (disk, k, sb) = layout::open(&img, &key).unwrap();
    let (_, report, map) = scan(&disk, &k, &sb).unwrap();
    assert!(report.clean() && report.orphans.is_empty() && report.reclaimed == 0, "{report:?}");
    assert!(!map.is_allocated(orphan_at));
}
