//! Volumes written by earlier plyfs builds read back exactly (#31): every fixture in
//! `tests/fixtures/formats` (made by `scripts/fixtures.sh`, each with the version that wrote it)
//! is mounted with its stack and compared, entry by entry, with the manifest made through the
//! mount that wrote it: kind, mode, size, content hash or link target (an exodisk volume is
//! served first, and exofs mounted from it). The tarballs keep the
//! lower files' `user.*` extended attributes, where the layers keep their own metadata.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::*;
use sha2::{Digest, Sha256};

/// `KIND MODE SIZE SHA256-OR-TARGET PATH` for every entry under `top` (names starting with
/// `.plyfs` left out), in path order: what `scripts/fixtures.sh` writes.
fn manifest(top: &Path) -> Vec<String> {
    let mut rows = Vec::new();
    let mut dirs = vec![top.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(top).unwrap().to_str().unwrap().to_owned();
            if rel.starts_with(".plyfs") {
                continue;
            }
            let m = std::fs::symlink_metadata(&p).unwrap();
            let mode = format!("{:04o}", m.permissions().mode() & 0o7777);
            let row = if m.file_type().is_symlink() {
                let t = std::fs::read_link(&p).unwrap().into_os_string().into_string().unwrap();
                format!("link {mode} {} {t} {rel}", t.len())
            } else if m.is_dir() {
                dirs.push(p.clone());
                format!("dir {mode} 0 - {rel}")
            } else {
                let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{rel}: {e}"));
                let hash: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
                format!("file {mode} {} {hash} {rel}", m.len())
            };
            rows.push((rel, row));
        }
    }
    rows.sort();
    rows.into_iter().map(|r| r.1).collect()
}

fn fixtures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/formats");
    let mut all: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_str().is_some_and(|s| s.ends_with(".tar.gz")))
        .collect();
    all.sort();
    all
}

#[test]
fn every_format_written_before_reads_back_exactly() {
    let all = fixtures();
    assert!(all.len() >= 17, "the fixtures are missing: {all:?}");
    for tarball in all {
        let name = tarball.file_name().unwrap().to_str().unwrap().trim_end_matches(".tar.gz").to_owned();
        let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
        let root = dir.path().canonicalize().unwrap();
        let out = run(std::process::Command::new("tar")
            .args(["--xattrs", "--xattrs-include=user.*", "-xzf"])
            .arg(&tarball)
            .arg("-C")
            .arg(&root));
        assert!(out.status.success(), "{name}: tar: {}", String::from_utf8_lossy(&out.stderr));
        let stack = std::fs::read_to_string(root.join("stack")).unwrap().trim().to_owned();
        let want: Vec<String> = std::fs::read_to_string(root.join("manifest")).unwrap().lines().map(str::to_owned).collect();
        let made_by = std::fs::read_to_string(root.join("made-by")).unwrap().trim().to_owned();
        // Further mount arguments (branches), then the password when there is one.
        let mut options: Vec<String> = std::fs::read_to_string(root.join("options"))
            .unwrap_or_default()
            .lines()
            .map(|l| l.replace("@ROOT@", root.to_str().unwrap()))
            .collect();
        let passfile = root.join("passfile");
        if passfile.exists() {
            options.push(format!("--passfile={}", passfile.display()));
        }
        let options: Vec<&str> = options.iter().map(String::as_str).collect();
        let mnt = root.join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        // An exodisk volume is served, and mounted through its socket.
        let volume = root.join("volume.img");
        let (_service, lower) = if volume.exists() {
            let sock = root.join("s.sock");
            (Some(exodisk::Service::start(&volume, &sock)), PathBuf::from(format!("exodisk:{}", sock.display())))
        } else {
            (None, root.join("lower"))
        };
        let mut m = Mount::start(dir, lower, mnt, &stack, &options);
        let got = manifest(&m.mnt);
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(w, g, "{name} (written by {made_by}, mounted with --stack {stack})");
        }
        assert_eq!(want.len(), got.len(), "{name}: entries\n{want:#?}\n{got:#?}");
        assert!(m.unmount().success(), "{name}: unmount");
    }
}
