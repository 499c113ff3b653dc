//! Issue #28, items 3 and 4, played by the attacker: a second local user (`nobody`, through
//! `setpriv`) after the volume's files and an exofs mount's set-ID bits, and someone with the raw
//! image who reads it or flips a byte of it.

mod common;

use std::fs;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::exodisk::*;
use common::*;

fn mode(p: &Path) -> u32 {
    fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// Let anyone through the directories above `p` (tempfile makes them 0700), so that only the
/// files' own modes stand between nobody and them.
fn open_the_way(p: &Path) {
    let mut d = p.parent();
    while let Some(dir) = d {
        if dir == Path::new("/") || dir == Path::new("/var/tmp") || dir == Path::new("/tmp") {
            break;
        }
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).unwrap();
        d = dir.parent();
    }
}

#[test]
fn another_user_cannot_read_the_image_its_key_or_its_log() {
    assert!(is_root(), "switches to nobody: run as root");
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let v = format(dir.path(), "32M");
    let key = PathBuf::from(format!("{}.key", v.display()));
    let log = dir.path().join("v.log");
    let sock = dir.path().join("s.sock");
    let out = run(plyfs().args(["exodisk", "serve", "--daemon"]).arg(&v).arg("--socket").arg(&sock).arg("--log").arg(&log));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stop = || {
        let _ = plyfs_exodisk::client::Client::connect(&sock, 1 << 20).map_err(String::from).and_then(|c| c.shutdown().map_err(|e| e.to_string()));
    };
    open_the_way(&v);
    for f in [&v, &key, &log] {
        let m = mode(f);
        let readable = m & 0o077 != 0;
        let (read, err) = as_nobody(&["cat", f.to_str().unwrap()]);
        if readable || read {
            stop();
            panic!("{}: mode {m:04o}; nobody read it: {read} ({err})", f.display());
        }
        assert!(err.contains("Permission denied"), "{err}");
    }
    stop();
    // An image that was there before, readable by others: formatted, with one line saying so.
    let open_image = dir.path().join("open.img");
    fs::write(&open_image, vec![0u8; 4 << 20]).unwrap();
    fs::set_permissions(&open_image, fs::Permissions::from_mode(0o644)).unwrap();
    let out = run(plyfs().args(["exodisk", "format"]).arg(&open_image));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let warning: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert!(warning.len() == 1 && warning[0].contains(open_image.to_str().unwrap()) && warning[0].contains("chmod 600"), "{err}");
}

/// A pattern no volume holds by chance: what the raw scans look for.
fn plaintext() -> Vec<u8> {
    b"exofs plaintext that must not reach the disk in clear; ".iter().copied().cycle().take(256 << 10).collect()
}

fn occurs(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_raw_scan_of_the_image_finds_no_file_data() {
    let mut x = exofs_mount("null");
    let data = plaintext();
    fs::write(x.m.path("big"), &data).unwrap();
    fs::write(x.m.path("small"), &data[..4000]).unwrap();
    fs::write(x.m.path("tiny"), &data[..100]).unwrap();
    assert!(x.m.unmount().success());
    x.service.stop();
    let image = fs::read(x.dir.path().join("v.img")).unwrap();
    assert!(!occurs(&image, &data[..40]), "the image holds file data in clear");
}

/// The sectors of `after` that differ from `before`, at or after `from`, that hold no record.
fn changed_data_sectors(before: &[u8], after: &[u8], from: u64) -> Vec<u64> {
    (from..after.len() as u64 / 512)
        .filter(|&s| {
            let (a, b) = (&before[s as usize * 512..][..512], &after[s as usize * 512..][..512]);
            a != b && !b.starts_with(b"PLYEXO")
        })
        .collect()
}

#[test]
fn a_flipped_byte_in_an_extent_reads_as_eio_and_the_service_stays_up() {
    let mut x = exofs_mount("null");
    let img = x.dir.path().join("v.img");
    fs::write(x.m.path("other"), plaintext()).unwrap();
    fs::write(x.m.path("victim"), b"").unwrap();
    assert!(x.m.unmount().success());
    let before = fs::read(&img).unwrap();
    x.m = x.m.remount();
    fs::write(x.m.path("victim"), &plaintext()[..64 << 10]).unwrap();
    assert!(x.m.unmount().success());
    let after = fs::read(&img).unwrap();
    let data_start = plyfs_exodisk::layout::Superblock::for_size(after.len() as u64 / 512).data_start;
    let sectors = changed_data_sectors(&before, &after, data_start);
    assert!(sectors.len() >= 128, "64 KiB written, {} data sectors changed", sectors.len());
    // The attacker flips one byte in the middle of the file's data.
    let target = sectors[sectors.len() / 2];
    let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
    let at = target * 512 + 100;
    f.write_all_at(&[after[at as usize] ^ 0x20], at).unwrap();
    f.sync_all().unwrap();
    x.m = x.m.remount();
    let e = fs::read(x.m.path("victim")).expect_err("an altered extent read without error");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    // The service stays up: the other file reads, and a new one is written and read.
    assert_eq!(fs::read(x.m.path("other")).unwrap(), plaintext());
    fs::write(x.m.path("new"), b"after the attack").unwrap();
    assert_eq!(fs::read(x.m.path("new")).unwrap(), b"after the attack");
    assert!(x.m.unmount().success());
    let out = run(plyfs().args(["exodisk", "stat"]).arg(x.dir.path().join("s.sock")));
    assert!(out.status.success(), "the service is gone: {}", x.service.log_text());
}

/// The set-ID script: root prepares files in `$1`, nobody changes them, then every file's mode,
/// owner and group, and what nobody was refused, are printed.
const SETID_SCRIPT: &str = r#"
set -u
cd "$1"
chmod 0777 .
mk() { echo content > "$1"; chown "$2" "$1"; chmod "$3" "$1"; }
mk chown_x   65534:65534 6755
mk chown_nx  65534:65534 6745
mk write_x   0:0         6777
mk write_nx  0:0         6767
mk trunc_x   0:0         6777
mk chmod_out 65534:0     0755
mk chmod_in  65534:65534 0755
mk chgrp_out 65534:65534 0644
mk root_chown_x  0:0 6755
mk root_chown_nx 0:0 6745
mkdir sgid_dir; chown 0:100 sgid_dir; chmod 2777 sgid_dir
nobody() { setpriv --reuid=65534 --regid=65534 --clear-groups -- "$@" 2>/dev/null || echo "refused: $*"; }
nobody chgrp 65534 chown_x
nobody chown 65534:65534 chown_nx
nobody sh -c 'echo more >> write_x'
nobody sh -c 'echo more >> write_nx'
nobody truncate -s 0 trunc_x
nobody chmod 2755 chmod_out
nobody chmod 2755 chmod_in
nobody chgrp 0 chgrp_out
nobody sh -c ': > sgid_dir/file; mkdir sgid_dir/sub; chmod 2755 sgid_dir/file'
chown 0:0 root_chown_x root_chown_nx
stat -c '%n %04a %u %g' * sgid_dir/*
"#;

fn setid_sequence(dir: &Path) -> String {
    let out = Command::new("sh").arg("-c").arg(SETID_SCRIPT).arg("setid").arg(dir).output().unwrap();
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn tmpfs_reference() -> String {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    assert_eq!(mounted_fstype_of(dir.path()), "tmpfs", "/dev/shm is not a tmpfs here");
    open_the_way(&dir.path().join("x"));
    setid_sequence(dir.path())
}

/// The file system type `dir` is on.
fn mounted_fstype_of(dir: &Path) -> String {
    let out = Command::new("stat").args(["-f", "-c", "%T"]).arg(dir).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn assert_as_tmpfs(what: &str, mnt: &Path, reference: &str) {
    open_the_way(&mnt.join("x"));
    let got = setid_sequence(mnt);
    assert!(got == reference, "{what} differs from tmpfs:\n--- tmpfs\n{reference}\n--- {what}\n{got}");
}

#[test]
fn exofs_applies_the_set_id_rules_as_tmpfs_does() {
    assert!(is_root(), "switches to nobody: run as root");
    let reference = tmpfs_reference();
    // The reference itself: the kernel's rules as this test expects them.
    for line in ["chown_x 0755", "chown_nx 2745", "write_x 0777", "trunc_x 0777", "chmod_out 0755", "chmod_in 2755"] {
        assert!(reference.contains(line), "tmpfs: no '{line}' in\n{reference}");
    }
    assert!(reference.contains("refused: chgrp 0 chgrp_out"), "{reference}");
    assert!(reference.contains("sgid_dir/sub 2755 65534 100") && reference.contains("sgid_dir/file 0755 65534 100"), "{reference}");
    let x = exofs_mount_with("null", &["allow_other"]);
    assert_as_tmpfs("exofs", &x.m.mnt, &reference);
}

#[test]
fn crypt_applies_the_set_id_rules_as_tmpfs_does() {
    assert!(is_root(), "switches to nobody: run as root");
    let m = Mount::crypt("crypt", &[], &["allow_other"]);
    assert_as_tmpfs("crypt", &m.mnt, &tmpfs_reference());
}

#[test]
fn zstd_applies_the_set_id_rules_as_tmpfs_does() {
    assert!(is_root(), "switches to nobody: run as root");
    let m = Mount::with("zstd", &["allow_other"]);
    assert_as_tmpfs("zstd", &m.mnt, &tmpfs_reference());
}
