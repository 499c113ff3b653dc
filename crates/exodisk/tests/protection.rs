//! The protection model through the service's core, on a real volume: capabilities, coverage,
//! descendants, proxies, persistence models and a restart.

use std::path::Path;

use plyfs_exodisk::core::{Access, Core, Persistence, Target};
use plyfs_exodisk::disk::{Aligned, SECTOR};
use plyfs_exodisk::layout::{self, default_key_path};
use plyfs_exodisk::object::Caps;
use plyfs_exodisk::scan::scan;

fn start(img: &Path) -> (Core, plyfs_exodisk::scan::Report) {
    let (disk, key, sb) = layout::open(img, &default_key_path(img)).unwrap();
    let (_, report, map) = scan(&disk, &key, &sb).unwrap();
    (Core::new(disk, key, sb, map), report)
}

fn volume(dir: &Path) -> std::path::PathBuf {
    let img = dir.join("v.img");
    layout::format(&img, Some(32 << 20), &default_key_path(&img)).unwrap();
    img
}

const A: Caps = Caps { read: 0xA1, write: 0xA2 };
const B: Caps = Caps { read: 0xB1, write: 0xB2 };

fn errno<T: std::fmt::Debug>(r: plyfs_exodisk::core::Result<T>) -> i32 {
    r.unwrap_err().errno
}

#[test]
fn capabilities_and_coverage_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let img = volume(dir.path());
    let (mut core, _) = start(&img);
    let base = core.sb.data_start + 100;
    core.extent_allocate(base, 11, A, Persistence::Metadata).unwrap();
    let ext = Target::Extent(base);
    let data = Aligned::from_bytes(&[7u8; 2 * SECTOR]);
    core.write(&ext, A.write, base + 1, &data).unwrap();
    let mut back = Aligned::zeroed(2 * SECTOR);
    core.read(&ext, A.read, base + 1, &mut back).unwrap();
    assert_eq!(&back[..], &data[..]);
    // The wrong capability, the read capability for a write, the header, past the end.
    assert_eq!(errno(core.read(&ext, B.read, base + 1, &mut back)), libc::EACCES);
    assert_eq!(errno(core.write(&ext, A.read, base + 1, &data)), libc::EACCES);
    assert_eq!(errno(core.write(&ext, A.write, base, &data)), libc::EACCES);
    assert_eq!(errno(core.write(&ext, A.write, base + 10, &data)), libc::EACCES);
    // Allocated sectors cannot be allocated again, nor the system's.
    assert_eq!(errno(core.extent_allocate(base + 5, 4, B, Persistence::Metadata)), libc::EEXIST);
    assert_eq!(errno(core.extent_allocate(0, 4, B, Persistence::Metadata)), libc::EINVAL);
    assert_eq!(errno(core.extent_deallocate(base, A.read)), libc::EACCES);
    // Shrinking frees the tail, and the data beyond is out of reach.
    core.extent_resize(base, A.write, -8).unwrap();
    assert_eq!(errno(core.read(&ext, A.read, base + 3, &mut back)), libc::EACCES);
    assert!(core.free_map().is_free(base + 3, 8));
    core.extent_deallocate(base, A.write).unwrap();
    assert!(core.free_map().is_free(base, 11));
    assert_eq!(errno(core.read(&ext, A.read, base + 1, &mut back)), libc::ENOENT);
}

#[test]
fn descendants_are_reached_through_ancestors_not_the_reverse() {
    let dir = tempfile::tempdir().unwrap();
    let img = volume(dir.path());
    let (mut core, _) = start(&img);
    let base = core.sb.data_start + 100;
    let root = Target::Exonode { at: base, path: vec![] };
    core.exonode_allocate(base, 1, A, Persistence::Metadata).unwrap();
    let child_entry = core.add_exonode(&root, A.write, None, base + 1, 1, B).unwrap();
    let via_root = Target::Exonode { at: base, path: vec![child_entry] };
    let child = Target::Exonode { at: base + 1, path: vec![] };
    let e = core.add_extent(&via_root, A.write, None, base + 10, 4).unwrap();
    // The child's own capability reaches it; the ancestor's reaches it too.
    let data = Aligned::from_bytes(&[1u8; SECTOR]);
    core.write(&child, B.write, base + 10, &data).unwrap();
    core.write(&via_root, A.write, base + 11, &data).unwrap();
    // Not the reverse: the child's capability does not open the ancestor.
    assert_eq!(errno(core.add_data(&root, B.write, None, b"x")), libc::EACCES);
    assert_eq!(errno(core.map(&root, B.read)), libc::EACCES);
    // Capabilities are discovered through the ancestor: all of them with its write capability.
    assert_eq!(core.cap_discover(&root, A.write, child_entry).unwrap(), B);
    assert_eq!(core.cap_discover(&root, A.read, child_entry).unwrap(), Caps { read: B.read, write: 0 });
    assert_eq!(errno(core.cap_discover(&child, B.write, 0)), libc::ENOENT);
    // Entries: split, combine, data.
    let tail = core.split(&via_root, A.write, e, 1, None).unwrap();
    core.combine(&via_root, A.write, e, tail).unwrap();
    let d = core.add_data(&child, B.write, None, b"size=4096").unwrap();
    assert_eq!(core.read_data(&via_root, A.read, d).unwrap(), b"size=4096");
    assert_eq!(core.map(&child, B.read).unwrap().entries.len(), 2, "the data took the slot the combine emptied");
    // A parent with descendants is not deallocated; the child is, with its extents.
    assert_eq!(errno(core.exonode_deallocate(&root, A.write)), libc::ENOTEMPTY);
    core.exonode_deallocate(&via_root, A.write).unwrap();
    assert!(core.free_map().is_free(base + 1, 1) && core.free_map().is_free(base + 10, 4));
    core.exonode_deallocate(&root, A.write).unwrap();
}

#[test]
fn a_proxy_never_widens_access_and_shrinks_with_its_original() {
    let dir = tempfile::tempdir().unwrap();
    let img = volume(dir.path());
    let (mut core, _) = start(&img);
    let base = core.sb.data_start + 100;
    core.extent_allocate(base, 11, A, Persistence::Metadata).unwrap();
    let ext = Target::Extent(base);
    let p = Caps { read: 0xC1, write: 0xC2 };
    // Made with the read capability: reads only, whatever capabilities it is given.
    let ro = Target::Proxy(core.make_proxy(&ext, A.read, Some((base + 3, base + 7)), p).unwrap());
    let mut buf = Aligned::zeroed(SECTOR);
    core.read(&ro, p.read, base + 3, &mut buf).unwrap();
    assert_eq!(errno(core.write(&ro, p.write, base + 3, &buf)), libc::EACCES);
    // Only its range.
    assert_eq!(errno(core.read(&ro, p.read, base + 2, &mut buf)), libc::EACCES);
    assert_eq!(errno(core.read(&ro, p.read, base + 7, &mut buf)), libc::EACCES);
    assert_eq!(errno(core.read(&ro, A.read, base + 3, &mut buf)), libc::EACCES);
    // A writable proxy writes inside its range, and shrinks with the extent.
    let rw = Target::Proxy(core.make_proxy(&ext, A.write, None, p).unwrap());
    core.write(&rw, p.write, base + 9, &buf).unwrap();
    core.extent_resize(base, A.write, -5).unwrap();
    assert_eq!(errno(core.write(&rw, p.write, base + 9, &buf)), libc::EACCES);
    // A proxy of a proxy is no wider than it.
    let inner = Target::Proxy(core.make_proxy(&ro, p.read, None, Caps { read: 0xD1, write: 0xD2 }).unwrap());
    assert_eq!(errno(core.write(&inner, 0xD2, base + 3, &buf)), libc::EACCES);
    core.read(&inner, 0xD1, base + 3, &mut buf).unwrap();
    assert_eq!(errno(core.read(&inner, 0xD1, base + 8, &mut buf)), libc::EACCES);
    assert_eq!(errno(core.make_proxy(&ro, p.read, Some((base + 1, base + 9)), Caps { read: 0xE1, write: 0 })), libc::EACCES);
    assert_eq!(core.make_proxy(&ext, B.read, None, p).unwrap_err().errno, libc::EACCES);
    let _ = Access::Read;
}

#[test]
fn persistence_models_survive_a_restart_as_they_promise() {
    let dir = tempfile::tempdir().unwrap();
    let img = volume(dir.path());
    let base;
    {
        let (mut core, _) = start(&img);
        base = core.sb.data_start + 100;
        core.extent_allocate(base, 5, A, Persistence::Memory).unwrap();
        core.extent_allocate(base + 10, 5, A, Persistence::Metadata).unwrap();
        core.extent_allocate(base + 20, 5, A, Persistence::Data).unwrap();
        core.exonode_allocate(base + 30, 1, A, Persistence::Memory).unwrap();
        let x = Target::Exonode { at: base + 30, path: vec![] };
        core.add_extent(&x, A.write, None, base + 40, 8).unwrap();
        core.write(&Target::Extent(base + 20), A.write, base + 21, &Aligned::from_bytes(b"durable")).unwrap();
        // The process ends without a word (as if killed): nothing more is written.
    }
    let (mut core, report) = start(&img);
    assert!(report.clean(), "{report:?}");
    // Memory objects are gone and their sectors free; the others are there.
    assert_eq!(errno(core.load(base)), libc::ENOENT);
    assert!(core.free_map().is_free(base, 5) && core.free_map().is_free(base + 30, 1) && core.free_map().is_free(base + 40, 8));
    core.load(base + 10).unwrap();
    let mut buf = Aligned::zeroed(SECTOR);
    core.read(&Target::Extent(base + 20), A.read, base + 21, &mut buf).unwrap();
    assert_eq!(&buf[..7], b"durable");
    // A memory object written explicitly is on disk as it was then, and stays a memory object
    // after a restart: its later changes wait for the next write.
    core.exonode_allocate(base, 1, B, Persistence::Memory).unwrap();
    let x = Target::Exonode { at: base, path: vec![] };
    core.add_data(&x, B.write, None, b"first").unwrap();
    core.write_record(&x, B.write).unwrap();
    core.add_data(&x, B.write, None, b"lost").unwrap();
    drop(core);
    let (mut core, _) = start(&img);
    assert_eq!(core.map(&x, B.read).unwrap().entries.len(), 1);
    core.add_data(&x, B.write, None, b"lost again").unwrap();
    drop(core);
    let (mut core, _) = start(&img);
    assert_eq!(core.map(&x, B.read).unwrap().entries.len(), 1);
}

#[test]
fn a_proxy_of_some_entries_grants_those_and_nothing_else() {
    use plyfs_exodisk::object::Entry;
    let dir = tempfile::tempdir().unwrap();
    let img = volume(dir.path());
    let (mut core, _) = start(&img);
    let x = core.sb.data_start + 100;
    core.exonode_allocate(x, 1, A, Persistence::Metadata).unwrap();
    let xt = Target::Exonode { at: x, path: vec![] };
    let (e0, e1) = (x + 10, x + 20);
    assert_eq!(core.add_extent(&xt, A.write, None, e0, 4).unwrap(), 0);
    assert_eq!(core.add_extent(&xt, A.write, None, e1, 4).unwrap(), 1);
    assert_eq!(core.add_data(&xt, A.write, None, b"secret").unwrap(), 2);
    assert_eq!(core.add_data(&xt, A.write, None, b"shared").unwrap(), 3);
    let p = Caps { read: 0xC1, write: 0xC2 };
    let only = Target::Proxy(core.make_entries_proxy(&xt, A.write, vec![1, 3], p).unwrap());
    let mut buf = Aligned::zeroed(SECTOR);
    // I/O on entry 1's extent, not on entry 0's.
    core.write(&only, p.write, e1 + 1, &buf).unwrap();
    core.read(&only, p.read, e1, &mut buf).unwrap();
    assert_eq!(errno(core.read(&only, p.read, e0, &mut buf)), libc::EACCES);
    // MAP and READ_DATA show only the entries granted.
    let m = core.map(&only, p.read).unwrap();
    assert_eq!(m.entries[0], Entry::Empty);
    assert_eq!(m.entries[2], Entry::Empty);
    assert_eq!(m.entries[3], Entry::Data(b"shared".to_vec()));
    assert_eq!(core.read_data(&only, p.read, 3).unwrap(), b"shared");
    assert_eq!(errno(core.read_data(&only, p.read, 2)), libc::EACCES);
    // No other entry operation goes through it.
    assert_eq!(errno(core.add_data(&only, p.write, None, b"more")), libc::EACCES);
    assert_eq!(errno(core.remove_entry(&only, p.write, 1)), libc::EACCES);
    // Narrowed, never widened; a sector proxy of it would widen it and is refused.
    let narrower = Target::Proxy(core.make_entries_proxy(&only, p.read, vec![3], Caps { read: 0xD1, write: 0 }).unwrap());
    assert_eq!(errno(core.read(&narrower, 0xD1, e1, &mut buf)), libc::EACCES);
    assert_eq!(errno(core.make_entries_proxy(&only, p.read, vec![0], Caps { read: 0xE1, write: 0 })), libc::EACCES);
    assert_eq!(errno(core.make_proxy(&only, p.read, None, Caps { read: 0xE1, write: 0 })), libc::EACCES);
    // Made with the wrong capability, or of entries that are not there: refused.
    assert_eq!(errno(core.make_entries_proxy(&xt, B.read, vec![1], p)), libc::EACCES);
    assert_eq!(errno(core.make_entries_proxy(&xt, A.read, vec![9], p)), libc::EINVAL);
    // It follows the original: entry 1 removed, its sectors are no longer reachable.
    core.remove_entry(&xt, A.write, 1).unwrap();
    assert_eq!(errno(core.read(&only, p.read, e1, &mut buf)), libc::EACCES);
}

#[test]
fn a_new_owner_of_sectors_reads_zeros_not_what_the_last_owner_left() {
    let dir = tempfile::tempdir().unwrap();
    let img = volume(dir.path());
    let (mut core, _) = start(&img);
    let base = core.sb.data_start + 100;
    core.extent_allocate(base, 9, A, Persistence::Metadata).unwrap();
    core.write(&Target::Extent(base), A.write, base + 1, &Aligned::from_bytes(&[7u8; 8 * SECTOR])).unwrap();
    core.extent_deallocate(base, A.write).unwrap();
    // B takes the same sectors, through an extent and through an exonode's entry.
    core.extent_allocate(base, 5, B, Persistence::Metadata).unwrap();
    let mut back = Aligned::zeroed(4 * SECTOR);
    core.read(&Target::Extent(base), B.read, base + 1, &mut back).unwrap();
    assert!(back.iter().all(|b| *b == 0), "B read A's old data");
    let x = core.sb.data_start + 400;
    core.exonode_allocate(x, 1, B, Persistence::Metadata).unwrap();
    let node = Target::Exonode { at: x, path: vec![] };
    core.add_extent(&node, B.write, None, base + 5, 4).unwrap();
    core.read(&node, B.read, base + 5, &mut back).unwrap();
    assert!(back.iter().all(|b| *b == 0), "B read A's old data through its exonode");
}

#[test]
fn altered_data_reads_as_eio_and_the_rest_of_the_extent_still_reads() {
    let dir = tempfile::tempdir().unwrap();
    let img = volume(dir.path());
    let (mut core, _) = start(&img);
    let base = core.sb.data_start + 100;
    core.extent_allocate(base, 5, A, Persistence::Data).unwrap();
    let ext = Target::Extent(base);
    core.write(&ext, A.write, base + 1, &Aligned::from_bytes(&[7u8; 4 * SECTOR])).unwrap();
    drop(core);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&img).unwrap();
        let at = (base + 2) * SECTOR as u64 + 17;
        // Not one byte: a sealed byte is 7 once in 256 runs. A run of 64 is never all 7s.
        let mut b = [0u8; 64];
        f.read_exact_at(&mut b, at).unwrap();
        assert!(b.iter().any(|&x| x != 7), "the data are in clear on the disk");
        f.write_all_at(&[b[0] ^ 1], at).unwrap();
    }
    let (mut core, _) = start(&img);
    let mut one = Aligned::zeroed(SECTOR);
    assert_eq!(errno(core.read(&ext, A.read, base + 2, &mut one)), libc::EIO);
    core.read(&ext, A.read, base + 1, &mut one).unwrap();
    assert_eq!(&one[..], &[7u8; SECTOR][..]);
}
