//! plyfs as mount(8) and /etc/fstab reach it: `mount -t fuse.plyfs LOWER MNT -o stack=...` and
//! fstab lines (through mount.fuse3, which runs `plyfs LOWER MNT -o OPTIONS` from the PATH),
//! `mount -o remount,ro|rw`, and `umount`. Each test runs in a private mount namespace
//! (`unshare -m`) in which plyfs is put on the PATH and a test fstab over /etc/fstab, so nothing
//! of the machine's changes; the namespace unmounts whatever is left when its shell exits.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;

use common::*;

/// Run `script` with `sh -e` in a private mount namespace where `plyfs` is on the PATH (in
/// /usr/local/bin) and `fstab` is /etc/fstab; returns stdout, panicking with both streams if it
/// fails.
fn in_namespace(dir: &Path, fstab: &str, script: &str) -> String {
    if !is_root() || Command::new("unshare").arg("--help").output().is_err() || !Path::new("/sbin/mount.fuse3").exists() {
        panic!("this test needs root, unshare and mount.fuse3 (fuse3)");
    }
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).unwrap();
    let _ = fs::remove_file(bin.join("plyfs"));
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_plyfs"), bin.join("plyfs")).unwrap();
    fs::write(dir.join("fstab"), fstab).unwrap();
    // An installed package's helper would run its own plyfs: this one stands in for it.
    fs::write(bin.join("mount.fuse.plyfs"), format!("#!/bin/sh\nexec {} \"$@\"\n", env!("CARGO_BIN_EXE_plyfs"))).unwrap();
    fs::set_permissions(bin.join("mount.fuse.plyfs"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let full = format!(
        "set -e\nmount --make-rprivate /\nmount --bind {bin} /usr/local/bin\nmount --bind {tab} /etc/fstab\n\
         for h in /sbin/mount.fuse.plyfs /usr/sbin/mount.fuse.plyfs; do [ ! -e $h ] || [ \"$(readlink -f $h)\" = {exe} ] || mount --bind {bin}/mount.fuse.plyfs $h; done\n\
         trap 'for m in $(awk \"\\$3 == \\\"fuse.plyfs\\\" {{print \\$2}}\" /proc/self/mounts); do umount -l \"$m\"; done' EXIT\n{script}\n",
        bin = bin.display(),
        tab = dir.join("fstab").display(),
        // A helper that is already this plyfs (a link, as scripts/xfstests.sh makes) stays: a
        // bind mount would land on the binary itself.
        exe = Path::new(env!("CARGO_BIN_EXE_plyfs")).canonicalize().unwrap().display()
    );
    let out = Command::new("timeout").args(["120", "unshare", "-m", "sh", "-c", &full]).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "the script failed ({}):\n{stdout}\n{stderr}", out.status);
    stdout
}

#[test]
fn an_fstab_line_mounts_remounts_read_only_and_unmounts() {
    let (dir, root, [lower, mnt, other]) = scratch_dirs(["lower", "mnt", "other"]);
    let passfile = crypt_init(&root, &lower, &[]);
    // A stack with commas in it, a password file, kernel flags, a plyfs option, what only
    // systemd reads, and a second line whose lower is missing (nofail: mount -a goes on).
    let fstab = format!(
        "# plyfs test\n{} {} fuse.plyfs stack=zstd,crypt,passfile={},allow_other,noexec,idle=1h,nofail,x-systemd.automount 0 0\n\
         {}/missing {} fuse.plyfs stack=null,nofail 0 0\n",
        lower.display(),
        mnt.display(),
        passfile.display(),
        root.display(),
        other.display()
    );
    let m = mnt.display();
    let out = in_namespace(
        &root,
        &fstab,
        &format!(
            "mount -a -t fuse.plyfs || true\n\
             grep \" {m} \" /proc/self/mountinfo\n\
             echo 'through fstab' > {m}/f\n\
             cat {m}/f\n\
             mount -o remount,ro {m}\n\
             if (echo no > {m}/g) 2>/tmp/plyfs-erofs.$$; then echo 'WROTE ON A READ-ONLY MOUNT'; fi\n\
             cat /tmp/plyfs-erofs.$$; rm -f /tmp/plyfs-erofs.$$\n\
             grep \" {m} \" /proc/self/mountinfo\n\
             mount -o remount,rw {m}\n\
             echo yes > {m}/g\n\
             umount {m}\n\
             grep -c \" {m} \" /proc/self/mountinfo || true\n"
        ),
    );
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].contains(" - fuse.plyfs ") && lines[0].contains("noexec"), "{out}");
    assert_eq!(lines[1], "through fstab", "{out}");
    assert!(!out.contains("WROTE ON A READ-ONLY MOUNT"), "{out}");
    assert!(lines[2].contains("Read-only file system"), "{out}");
    assert!(lines[3].split_whitespace().nth(5).unwrap().starts_with("ro"), "{out}");
    assert_eq!(lines[4], "0", "still mounted after umount: {out}");
    // What was written went through zstd,crypt: sealed names below, and it reads back.
    assert!(!fs::read_dir(&lower).unwrap().any(|e| e.unwrap().file_name() == "f"));
    let m = Mount::start(dir, lower, mnt, "zstd,crypt", &[&format!("--passfile={}", passfile.display())]);
    assert_eq!(fs::read_to_string(m.path("f")).unwrap(), "through fstab\n");
    assert_eq!(fs::read_to_string(m.path("g")).unwrap(), "yes\n");
}

#[test]
fn mount_t_fuse_plyfs_takes_every_plyfs_option_and_says_what_is_wrong() {
    let (_dir, root, [a, b, mnt]) = scratch_dirs(["a", "b", "mnt"]);
    fs::write(b.join("from-b"), b"lower branch").unwrap();
    let m = mnt.display();
    let out = in_namespace(
        &root,
        "",
        &format!(
            "mount -t fuse.plyfs {a} {m} -o 'stack=union,branch={b}=ro,threads=2'\n\
             cat {m}/from-b; echo\n\
             echo up > {m}/new\n\
             umount {m}\n\
             if mount -t fuse.plyfs {a} {m} -o stack=nosuchlayer 2>/tmp/plyfs-err.$$; then echo MOUNTED; fi\n\
             cat /tmp/plyfs-err.$$; rm -f /tmp/plyfs-err.$$\n",
            a = a.display(),
            b = b.display()
        ),
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "lower branch", "{out}");
    assert!(!out.contains("MOUNTED"), "{out}");
    assert!(out.contains("nosuchlayer"), "one line naming the unknown layer: {out}");
    assert_eq!(fs::read_to_string(a.join("new")).unwrap(), "up\n");
    assert!(!b.join("new").exists());
}

/// mount(8) reaches the same refusal of a mount point inside the lower (#29), and nothing is
/// mounted.
#[test]
fn mount_t_fuse_plyfs_refuses_a_mount_point_inside_the_lower() {
    let (_dir, root, [lower]) = scratch_dirs(["lower"]);
    let inner = lower.join("inner");
    fs::create_dir(&inner).unwrap();
    let out = in_namespace(
        &root,
        "",
        &format!(
            "if timeout 60 mount -t fuse.plyfs {l} {i} -o stack=null 2>/tmp/plyfs-err.$$; then echo MOUNTED; fi\n\
             cat /tmp/plyfs-err.$$; rm -f /tmp/plyfs-err.$$\n\
             echo \"mounts: $(grep -c ' {i} ' /proc/self/mounts || true)\"\n",
            l = lower.display(),
            i = inner.display()
        ),
    );
    let expect = format!("mount point {} lies inside the lower {}", inner.display(), lower.display());
    assert!(!out.contains("MOUNTED") && out.contains(&expect) && out.contains("mounts: 0"), "{out}");
}

/// What xfstests does with a FUSE file system (#30): `mount -t fuse.plyfs source:DIR MNT` (or a tag
/// with `-o source=DIR`, as libfuse's examples are mounted), silent on success; the mount shows
/// the source as given, so that `umount SOURCE` and findmnt find it; `-o remount` and the atime
/// flags the suite passes.
#[test]
fn mount_t_fuse_plyfs_takes_the_sources_test_suites_give() {
    let (_dir, root, [lower, other, mnt]) = scratch_dirs(["lower", "other", "mnt"]);
    let (l, o, m) = (lower.display(), other.display(), mnt.display());
    let out = in_namespace(
        &root,
        "",
        &format!(
            "mount -t fuse.plyfs source:{l} {m} -o stack=null,allow_other,nodiratime 2>/tmp/plyfs-said.$$\n\
             echo \"said: $(cat /tmp/plyfs-said.$$)\"; rm -f /tmp/plyfs-said.$$\n\
             findmnt -n -o SOURCE,FSTYPE {m}\n\
             grep -q nodiratime /proc/self/mountinfo && echo nodiratime\n\
             echo one > {m}/f\n\
             mount -o remount,ro source:{l} {m}\n\
             findmnt -n -o OPTIONS {m} | cut -d, -f1\n\
             umount source:{l}\n\
             mount -t fuse.plyfs scratch-tag {m} -o source={o},stack=zstd\n\
             findmnt -n -o SOURCE {m}\n\
             echo two > {m}/g\n\
             umount scratch-tag\n\
             grep -c \" {m} \" /proc/self/mountinfo || true\n"
        ),
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "said: ", "a mount helper is silent when the mount works: {out}");
    assert_eq!(lines[1].split_whitespace().collect::<Vec<_>>(), [format!("source:{l}").as_str(), "fuse.plyfs"], "{out}");
    assert_eq!(lines[2], "nodiratime", "{out}");
    assert_eq!(lines[3], "ro", "{out}");
    assert_eq!(lines[4], "scratch-tag", "{out}");
    assert_eq!(lines[5], "0", "still mounted after umount SOURCE: {out}");
    assert_eq!(fs::read_to_string(lower.join("f")).unwrap(), "one\n");
    // Through zstd: the lower file is not the plain text.
    assert_ne!(fs::read(other.join("g")).unwrap(), b"two\n");
}

/// `mount -t fuse.plyfs` with a lower that is not there says what `plyfs mount` says, in one
/// line with its exit status (6), not the argument parser's "unrecognized subcommand"; a mount
/// point that holds files is refused naming `-o nonempty`, which mounts over them (#32).
#[test]
fn mount_t_fuse_plyfs_says_what_plyfs_mount_says() {
    let (_dir, root, [lower, mnt]) = scratch_dirs(["lower", "mnt"]);
    fs::write(mnt.join("hidden"), b"under the mount").unwrap();
    let (l, m, missing) = (lower.display(), mnt.display(), root.join("missing"));
    let out = in_namespace(
        &root,
        "",
        &format!(
            "status=0; timeout 60 mount -t fuse.plyfs {missing} {m} -o stack=zstd 2>/tmp/plyfs-err.$$ || status=$?\n\
             echo \"status $status\"; cat /tmp/plyfs-err.$$\n\
             status=0; timeout 60 mount -t fuse.plyfs {l} {m} -o stack=zstd 2>/tmp/plyfs-err.$$ || status=$?\n\
             echo \"status $status\"; cat /tmp/plyfs-err.$$; rm -f /tmp/plyfs-err.$$\n\
             echo \"mounts: $(grep -c ' {m} ' /proc/self/mounts || true)\"\n\
             mount -t fuse.plyfs {l} {m} -o stack=zstd,nonempty\n\
             ls {m}; echo written > {m}/f\n\
             umount {m}\n\
             ls {m}\n",
            missing = missing.display()
        ),
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "status 6", "{out}");
    assert_eq!(lines[1], format!("plyfs: lower directory {}: No such file or directory (os error 2)", missing.display()), "{out}");
    assert_eq!(lines[2], "status 10", "{out}");
    assert_eq!(lines[3], format!("plyfs: mount point {m} is not empty: mounting would hide what it holds (-o nonempty mounts over it)"), "{out}");
    assert_eq!(lines[4], "mounts: 0", "{out}");
    assert_eq!(&lines[5..], ["hidden"], "the mount showed the empty lower, and the files are back after it: {out}");
    assert_ne!(fs::read(lower.join("f")).unwrap(), b"written\n", "written through zstd");
    assert_eq!(fs::read(mnt.join("hidden")).unwrap(), b"under the mount");
}
