//! Copies keep holes (#29): a version, a union copy-up, a mirror resync and scrub, and `encode`
//! and `decode` of a 1 GiB file holding 8 bytes take about the space of the 8 bytes, not 1 GiB,
//! and read back the same, over plain files and through a data layer. The test directories are on /tmp, which must be a file system that
//! keeps holes (`SEEK_HOLE`) and has no reflink (ext4, tmpfs): a reflink would share the blocks
//! and prove nothing about holes.

mod common;

use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use common::*;

const SPARSE_SIZE: u64 = 1 << 30;
/// The data sits in the middle: holes before it and after it.
const DATA_AT: u64 = (512 << 20) + 3;

/// Far below the 1 GiB a filled copy takes; a few blocks of data and metadata fit.
const SPACE_OF_THE_DATA: u64 = 1 << 20;

fn make_sparse(path: &Path, data: &[u8; 8]) {
    let f = fs::File::create(path).unwrap();
    f.set_len(SPARSE_SIZE).unwrap();
    f.write_all_at(data, DATA_AT).unwrap();
}

/// `path` is a sparse copy holding `data`: its size, zeros everywhere else, and the space of its
/// data only.
fn assert_sparse_copy(path: &Path, data: &[u8; 8]) {
    let meta = fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(meta.len(), SPARSE_SIZE, "{}", path.display());
    let used = meta.blocks() * 512;
    assert!(used <= SPACE_OF_THE_DATA, "{} takes {used} bytes on disk for 8 bytes of data", path.display());
    let mut f = fs::File::open(path).unwrap();
    let mut buf = vec![0u8; 4 << 20];
    let mut offset = 0u64;
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        for (i, &b) in buf[..n].iter().enumerate() {
            let at = offset + i as u64;
            let expect = if (DATA_AT..DATA_AT + 8).contains(&at) { data[(at - DATA_AT) as usize] } else { 0 };
            assert_eq!(b, expect, "{} at byte {at}", path.display());
        }
        offset += n as u64;
    }
    assert_eq!(offset, SPARSE_SIZE, "{}", path.display());
}

#[test]
fn versions_of_a_sparse_file_take_the_space_of_its_data() {
    let m = Mount::new("version");
    make_sparse(&m.path("f"), b"version1");
    // Two opens for writing, each changing the data: two versions.
    for data in [b"version2", b"version3"] {
        let f = fs::OpenOptions::new().write(true).open(m.path("f")).unwrap();
        f.write_all_at(data, DATA_AT).unwrap();
    }
    assert_sparse_copy(&m.lower_path(".plyfs-versions/f/@1"), b"version1");
    assert_sparse_copy(&m.lower_path(".plyfs-versions/f/@2"), b"version2");
    assert_sparse_copy(&m.path(".plyfs-versions/f/@2"), b"version2");
    assert_sparse_copy(&m.path("f"), b"version3");
}

/// Below a data layer the holes are its runs of zero chunks, which `lseek` reports, so the
/// versions of an encoded sparse file are sparse too.
#[test]
fn versions_of_an_encoded_sparse_file_keep_its_holes() {
    let m = Mount::new("version,zstd");
    make_sparse(&m.path("f"), b"encoded1");
    let f = fs::OpenOptions::new().write(true).open(m.path("f")).unwrap();
    f.write_all_at(b"encoded2", DATA_AT).unwrap();
    drop(f);
    let stored = fs::metadata(m.lower_path(".plyfs-versions/f/@1")).unwrap().blocks() * 512;
    assert!(stored <= SPACE_OF_THE_DATA, "the encoded version takes {stored} bytes on disk");
    assert_sparse_copy(&m.path(".plyfs-versions/f/@1"), b"encoded1");
    assert_sparse_copy(&m.path("f"), b"encoded2");
}

#[test]
fn a_union_copy_up_of_a_sparse_file_keeps_its_holes() {
    let (dir, _root, [upper, ro, mnt]) = scratch_dirs(["upper", "ro", "mnt"]);
    make_sparse(&ro.join("f"), b"readonly");
    let branch = format!("--branch={}=ro", ro.display());
    let m = Mount::start(dir, upper.clone(), mnt, "union", &[&branch]);
    let f = fs::OpenOptions::new().write(true).open(m.path("f")).unwrap();
    f.write_all_at(b"ro-", 0).unwrap();
    drop(f);
    let copied = upper.join("f");
    let used = fs::metadata(&copied).unwrap().blocks() * 512;
    assert!(used <= SPACE_OF_THE_DATA, "the copy-up takes {used} bytes on disk");
    let mut head = [0u8; 3];
    fs::File::open(&copied).unwrap().read_exact_at(&mut head, 0).unwrap();
    assert_eq!(&head, b"ro-");
    fs::File::options().write(true).open(&copied).unwrap().write_all_at(&[0; 3], 0).unwrap();
    assert_sparse_copy(&copied, b"readonly");
    assert_sparse_copy(&ro.join("f"), b"readonly");
}

#[test]
fn mirror_resync_and_scrub_of_a_sparse_file_keep_its_holes() {
    let (m, b) = mirror("mirror[|fault]");
    op_json(&m.mnt, &["fault-add@mirror.1.fault", "error=EIO"]);
    make_sparse(&m.path("f"), b"mirrored");
    op_json(&m.mnt, &["fault-clear@mirror.1.fault"]);
    op_json(&m.mnt, &["resync"]);
    assert_sparse_copy(&b.join("f"), b"mirrored");
    // A rotten copy on the second branch: scrub rewrites it from the first.
    fs::File::options().write(true).open(b.join("f")).unwrap().write_all_at(b"rotten!!", DATA_AT).unwrap();
    let report = op_json(&m.mnt, &["scrub"]);
    assert_eq!(report["repaired"][0], "f", "{report}");
    assert_sparse_copy(&b.join("f"), b"mirrored");
}

#[test]
fn encode_and_decode_keep_holes() {
    let (_dir, root, [plain]) = scratch_dirs(["plain"]);
    make_sparse(&plain.join("f"), b"offline!");
    let (encoded, decoded) = (root.join("encoded"), root.join("decoded"));
    let out = run(plyfs().arg("encode").arg(&plain).arg(&encoded).args(["--stack", "null"]));
    assert!(out.status.success(), "encode: {}", String::from_utf8_lossy(&out.stderr));
    assert_sparse_copy(&encoded.join("f"), b"offline!");
    let out = run(plyfs().arg("decode").arg(&encoded).arg(&decoded).args(["--stack", "null"]));
    assert!(out.status.success(), "decode: {}", String::from_utf8_lossy(&out.stderr));
    assert_sparse_copy(&decoded.join("f"), b"offline!");
    // Through a data layer: encoded as runs of zero chunks, decoded as holes again.
    let (zstd, unzstd) = (root.join("zstd"), root.join("unzstd"));
    let out = run(plyfs().arg("encode").arg(&plain).arg(&zstd).args(["--stack", "zstd"]));
    assert!(out.status.success(), "encode: {}", String::from_utf8_lossy(&out.stderr));
    let stored = fs::metadata(zstd.join("f")).unwrap().blocks() * 512;
    assert!(stored <= SPACE_OF_THE_DATA, "the encoded file takes {stored} bytes on disk");
    let out = run(plyfs().arg("decode").arg(&zstd).arg(&unzstd).args(["--stack", "zstd"]));
    assert!(out.status.success(), "decode: {}", String::from_utf8_lossy(&out.stderr));
    assert_sparse_copy(&unzstd.join("f"), b"offline!");
}
