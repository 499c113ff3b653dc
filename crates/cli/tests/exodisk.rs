//! `plyfs exodisk` through its commands and real service processes: bad input, users kept apart,
//! and a service killed in the middle of allocation and write storms.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::exodisk::*;
use common::*;
use plyfs_exodisk::client::Client;
use plyfs_exodisk::core::{Persistence, Target};
use plyfs_exodisk::object::Caps;

fn fsck(v: &Path) -> (bool, String) {
    let out = run(plyfs().args(["exodisk", "fsck"]).arg(v));
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn bad_input_gets_one_line_and_changes_nothing() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let one_line = |out: &std::process::Output, want: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.trim().lines().count() == 1 && err.contains(want), "{err}");
    };
    let small = dir.path().join("small.img");
    one_line(&run(plyfs().args(["exodisk", "format"]).arg(&small).args(["--size", "100k"])), "too small");
    assert!(!small.exists());
    let v = format(dir.path(), "32M");
    let before = std::fs::read(&v).unwrap();
    one_line(&run(plyfs().args(["exodisk", "format"]).arg(&v)), "already an exodisk volume");
    assert!(std::fs::read(&v).unwrap() == before);
    let plain = dir.path().join("plain.img");
    std::fs::write(&plain, vec![0u8; 4 << 20]).unwrap();
    one_line(
        &run(plyfs().args(["exodisk", "fsck"]).arg(&plain).arg("--key").arg(v.with_extension("img.key"))),
        "not an exodisk volume",
    );
    let _s = Service::start(&v, &dir.path().join("s.sock"));
    one_line(&run(plyfs().args(["exodisk", "serve"]).arg(&v).arg("--socket").arg(dir.path().join("t.sock"))), "in use");
    one_line(&run(plyfs().args(["exodisk", "fsck"]).arg(&v)), "in use");
}

#[test]
fn two_users_get_roots_of_their_own_and_cannot_reach_each_other() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let v = format(dir.path(), "32M");
    let sock = dir.path().join("s.sock");
    let _s = Service::start(&v, &sock);
    let ls = |as_nobody: bool, args: &[&str]| {
        let mut cmd = plyfs();
        cmd.args(["exodisk", "ls"]).arg(&sock).args(args);
        if as_nobody {
            cmd.uid(65534).gid(65534);
        }
        run(&mut cmd)
    };
    let mine = ls(false, &["--root", "files"]);
    let theirs = ls(true, &["--root", "files"]);
    assert!(mine.status.success() && theirs.status.success(), "{}", String::from_utf8_lossy(&theirs.stderr));
    let field = |o: &std::process::Output, key: &str| {
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        let after = text.split(key).nth(1).unwrap().trim_start().to_owned();
        after.split_whitespace().next().unwrap().trim_end_matches(';').to_owned()
    };
    let (my_at, my_rcap) = (field(&mine, "exonode at"), field(&mine, "rcap"));
    assert_ne!(my_at, field(&theirs, "exonode at"));
    // Another user reaches root's exonode neither with its own capability nor by guessing.
    let their_rcap = field(&theirs, "rcap");
    for guess in [their_rcap.as_str(), "1234"] {
        let out = ls(true, &["--at", &my_at, "--rcap", guess]);
        assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("wrong read capability"), "{out:?}");
    }
    // With the capability itself, it would: capabilities, not users, protect.
    assert!(ls(true, &["--at", &my_at, "--rcap", &my_rcap]).status.success());
}

#[test]
fn a_service_killed_under_storms_restarts_with_every_invariant_and_every_durable_object() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let v = format(dir.path(), "128M");
    let sock = dir.path().join("s.sock");
    let mut service = Service::start(&v, &sock);
    let durable = std::sync::Mutex::new(Vec::<(u64, Caps, u8)>::new());
    let client = Client::connect(&sock, 4 << 20).unwrap();
    let start = client.data_start + 1000;
    std::thread::scope(|s| {
        // Writers: extents under the data model, then their contents; some freed again.
        for w in 0..3u64 {
            let (client, durable) = (&client, &durable);
            s.spawn(move || {
                let mut at = start + w * 60_000;
                for i in 0.. {
                    let caps = Caps { read: 1000 + i, write: 2000 + i };
                    let sectors = 8 + (i % 24) as u64;
                    if client.extent_allocate(at, sectors, caps, Persistence::Data).is_err() {
                        return;
                    }
                    let fill = (i % 250) as u8 + 1;
                    if client.write(&Target::Extent(at), caps.write, at + 1, &vec![fill; (sectors as usize - 1) * 512]).is_err() {
                        return;
                    }
                    if i % 5 == 4 {
                        if client.extent_deallocate(at, caps.write).is_err() {
                            return;
                        }
                    } else {
                        durable.lock().unwrap().push((at, caps, fill));
                    }
                    at += sectors;
                }
            });
        }
        // And exonodes in memory only, with extents: gone after the crash, sectors given back.
        let client = &client;
        s.spawn(move || {
            let mut at = start + 200_000;
            for i in 0u64.. {
                let caps = Caps { read: 5000 + i as u128, write: 6000 + i as u128 };
                if client.exonode_allocate(at, 1, caps, Persistence::Memory).is_err()
                    || client.add_extent(&Target::Exonode { at, path: vec![] }, caps.write, None, at + 1, 8).is_err()
                {
                    return;
                }
                at += 9;
            }
        });
        std::thread::sleep(Duration::from_millis(400));
        service.kill();
    });
    drop(client);
    let durable = durable.into_inner().unwrap();
    assert!(durable.len() > 10, "the storm wrote only {} objects", durable.len());
    // The scan on restart finds every invariant intact, and every durable object readable.
    let (clean, report) = fsck(&v);
    assert!(clean, "{report}");
    let mut service = Service::start(&v, &sock);
    let client = Client::connect(&sock, 4 << 20).unwrap();
    for (at, caps, fill) in &durable {
        let mut back = vec![0u8; 512];
        client.read(&Target::Extent(*at), caps.read, at + 1, &mut back).unwrap_or_else(|e| panic!("extent at {at}: {e}"));
        assert!(back.iter().all(|b| b == fill), "extent at {at}: contents lost");
    }
    drop(client);
    service.stop();
    assert!(service.log_text().contains("start-up scan gave back"), "{}", service.log_text());
    let (clean, report) = fsck(&v);
    assert!(clean, "{report}");
}

#[test]
fn the_service_stops_on_sigterm_even_when_its_socket_file_is_gone() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let v = format(dir.path(), "32M");
    let sock = dir.path().join("s.sock");
    let mut service = Service::start(&v, &sock);
    std::fs::remove_file(&sock).unwrap();
    let started = Instant::now();
    service.stop();
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    assert!(service.log_text().contains("is consistent"), "{}", service.log_text());
    let (clean, report) = fsck(&v);
    assert!(clean, "{report}");
}

#[test]
fn a_directory_read_while_its_entries_are_removed_misses_none() {
    let mut x = exofs_mount("null");
    let d = x.m.path("d");
    std::fs::create_dir(&d).unwrap();
    for i in 0..600 {
        std::fs::write(d.join(format!("a-rather-long-file-name-{i:04}")), format!("{i}")).unwrap();
    }
    // Removing each entry as it is read (as `rm -rf` does between reads of a large
    // directory): later reads go on where the earlier ones stopped.
    let mut seen = 0;
    for e in std::fs::read_dir(&d).unwrap() {
        std::fs::remove_file(e.unwrap().path()).unwrap();
        seen += 1;
    }
    assert_eq!(seen, 600);
    std::fs::remove_dir(&d).unwrap();
    assert!(x.m.unmount().success());
}

#[test]
fn insert_and_punch_through_a_mount_move_bytes_and_the_kernel_sees_them() {
    let mut x = exofs_mount("null");
    let f = x.m.path("f");
    let original: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&f, &original).unwrap();
    // Read once so that the kernel caches it, then move bytes behind its back.
    assert_eq!(std::fs::read(&f).unwrap(), original);
    let out = run(plyfs().arg("op").arg(&f).args(["insert", "500000", "sixteen bytes!!!"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("1000016"), "{}", String::from_utf8_lossy(&out.stdout));
    let mut want = original.clone();
    want.splice(500_000..500_000, b"sixteen bytes!!!".iter().copied());
    assert!(std::fs::read(&f).unwrap() == want, "the insertion is read back through the kernel");
    let out = run(plyfs().arg("op").arg(&f).args(["punch", "500000", "16"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&f).unwrap() == original, "the removal gives the original back");
    // Bad arguments: one line naming the problem.
    let out = run(plyfs().arg("op").arg(&f).args(["insert", "2000000", "x"]));
    assert!(!out.status.success());
    let out = run(plyfs().arg("op").arg(&f).args(["insert", "ten", "x"]));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a number"), "{}", String::from_utf8_lossy(&out.stderr));
    // Survives a remount.
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().sync_all().unwrap();
    let out = run(plyfs().arg("op").arg(&f).args(["insert", "0", "head:"]));
    assert!(out.status.success());
    x.m = x.m.remount();
    let mut want = original.clone();
    want.splice(0..0, b"head:".iter().copied());
    assert!(std::fs::read(x.m.path("f")).unwrap() == want);
    assert!(x.m.unmount().success());
}

/// A small exofs inode's attributes.
fn exofs_attrs(kind: plyfs_stack::FileKind) -> plyfs_exofs::format::Inode {
    plyfs_exofs::format::Inode::new(kind, 0o755, 0, 0)
}

#[test]
fn each_file_keeps_its_persistence_model_through_a_killed_service() {
    use plyfs_exofs::fs::Fs;
    use plyfs_stack::FileKind;
    use std::ffi::OsStr;
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let v = format(dir.path(), "64M");
    let sock = dir.path().join("s.sock");
    let mut service = Service::start(&v, &sock);
    let body: Vec<u8> = (0..50_000u32).map(|i| (i % 239) as u8).collect();
    {
        let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
        let root = fs.root();
        for model in ["data", "metadata", "memory"] {
            let d = fs.make(root, OsStr::new(model), exofs_attrs(FileKind::Dir), &[]).unwrap();
            fs.set_xattr(d, b"user.exofs.persistence", Some(model.as_bytes()), 0).unwrap();
        }
        // The directories themselves are written back once; what is made in them after that
        // follows their model.
        fs.sync().unwrap();
        for model in ["data", "metadata", "memory"] {
            let (d, _) = fs.lookup(root, OsStr::new(model)).unwrap();
            let f = fs.make(d, OsStr::new("f"), exofs_attrs(FileKind::File), b"").unwrap();
            assert_eq!(fs.get_xattr(f, b"user.exofs.persistence").unwrap(), model.as_bytes(), "inherited");
            fs.write(f, 0, &body).unwrap();
        }
        let bad = fs.set_xattr(root, b"user.exofs.persistence", Some(b"fast"), 0).unwrap_err();
        assert!(matches!(bad, plyfs_stack::Error::BadArgs(ref m) if m.contains("not a persistence model")), "{bad:?}");
        // No write-back, no unmount: the service dies.
        service.kill();
    }
    let _service = Service::start(&v, &sock);
    let fs = Fs::open(Client::connect(&sock, 4 << 20).unwrap(), "exofs").unwrap();
    let root = fs.root();
    for model in ["data", "metadata"] {
        let (d, _) = fs.lookup(root, OsStr::new(model)).unwrap();
        let (f, attrs) = fs.lookup(d, OsStr::new("f")).unwrap_or_else(|e| panic!("{model}: {e:?}"));
        assert_eq!(attrs.size, body.len() as u64, "{model}");
        assert!(fs.read(f, 0, body.len()).unwrap() == body, "{model}: the bytes are back");
    }
    // The memory model's directory and file lived in the service's memory only.
    assert!(
        fs.lookup(root, OsStr::new("memory")).is_err() || {
            let (d, _) = fs.lookup(root, OsStr::new("memory")).unwrap();
            fs.lookup(d, OsStr::new("f")).is_err()
        }
    );
}

#[test]
fn extended_attributes_are_kept_through_a_mount_and_a_remount() {
    let mut x = exofs_mount("null");
    let f = x.m.path("f");
    std::fs::write(&f, b"x").unwrap();
    let (p, name) = (cpath(&f), std::ffi::CString::new("user.colour").unwrap());
    let set =
        |value: &[u8], flags: i32| unsafe { libc::setxattr(p.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), flags) };
    assert_eq!(set(b"blue", libc::XATTR_REPLACE), -1);
    assert_eq!(errno(), libc::ENODATA);
    assert_eq!(set(b"blue", 0), 0);
    assert_eq!(set(b"red", libc::XATTR_CREATE), -1);
    assert_eq!(errno(), libc::EEXIST);
    let get = || {
        let mut buf = [0u8; 64];
        let n = unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        (n >= 0).then(|| buf[..n as usize].to_vec())
    };
    assert_eq!(get().as_deref(), Some(&b"blue"[..]));
    // Too much for an inode: ENOSPC, and nothing changes.
    assert_eq!(set(&[7u8; 4000], 0), -1);
    assert_eq!(errno(), libc::ENOSPC);
    x.m = x.m.remount();
    let p = cpath(&x.m.path("f"));
    let mut list = [0u8; 256];
    let n = unsafe { libc::listxattr(p.as_ptr(), list.as_mut_ptr().cast(), list.len()) };
    assert_eq!(&list[..n as usize], b"user.colour\0");
    let mut buf = [0u8; 64];
    let n = unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(&buf[..n as usize], b"blue");
    assert_eq!(unsafe { libc::removexattr(p.as_ptr(), name.as_ptr()) }, 0);
    assert_eq!(unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }, -1);
    assert_eq!(errno(), libc::ENODATA);
    // A model that does not exist is refused with EINVAL.
    let pm = std::ffi::CString::new("user.exofs.persistence").unwrap();
    assert_eq!(unsafe { libc::setxattr(p.as_ptr(), pm.as_ptr(), b"fast".as_ptr().cast(), 4, 0) }, -1);
    assert_eq!(errno(), libc::EINVAL);
    assert!(x.m.unmount().success());
}

#[test]
fn a_killed_exofs_mount_loses_nothing_that_was_synced_and_the_next_mount_takes_over() {
    let mut x = exofs_mount("null");
    let synced: Vec<u8> = (0..300_000u32).map(|i| (i % 241) as u8).collect();
    std::fs::create_dir(x.m.path("d")).unwrap();
    std::fs::write(x.m.path("d/synced"), &synced).unwrap();
    std::fs::File::open(x.m.path("d/synced")).unwrap().sync_all().unwrap();
    // Written after the last write-back: lost with the daemon, or kept whole, never half.
    std::fs::write(x.m.path("d/late"), b"written after the sync").unwrap();
    unsafe { libc::kill(x.m.pid(), libc::SIGKILL) };
    x.m.wait_exit(Duration::from_secs(10)).expect("the daemon did not die");
    // The service notices the connection go, so the next mount gets the file system at once.
    x.m = x.m.remount();
    assert!(std::fs::read(x.m.path("d/synced")).unwrap() == synced);
    match std::fs::read(x.m.path("d/late")) {
        Ok(b) => assert_eq!(b, b"written after the sync"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::NotFound),
    }
    // And it works as before.
    std::fs::write(x.m.path("d/after"), b"after").unwrap();
    assert_eq!(std::fs::read(x.m.path("d/after")).unwrap(), b"after");
    assert!(x.m.unmount().success());
}

/// What exofs does not do it refuses, and changes nothing: a POSIX ACL (exofs would keep it beside a
/// mode it disagrees with, and the kernel would then let the owner do what the ACL denies: xfstests
/// generic/099) and a rename with flags that do not go together. `RENAME_WHITEOUT`, which it ignored
/// (generic/078), leaves a whiteout (a character device 0:0) at the old name.
#[test]
fn acls_are_refused_and_a_whiteout_rename_leaves_a_whiteout() {
    let x = exofs_mount("null");
    let f = x.m.path("f");
    std::fs::write(&f, b"x").unwrap();
    std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
    // An access ACL of user::r-x group::--- other::---, as setfacl writes it.
    let mut acl = 2u32.to_le_bytes().to_vec();
    for (tag, perm) in [(0x01u16, 5u16), (0x04, 0), (0x20, 0)] {
        acl.extend_from_slice(&tag.to_le_bytes());
        acl.extend_from_slice(&perm.to_le_bytes());
        acl.extend_from_slice(&u32::MAX.to_le_bytes());
    }
    let p = cpath(&f);
    std::fs::create_dir(x.m.path("d")).unwrap();
    for (on, name) in [(&f, "system.posix_acl_access"), (&x.m.path("d"), "system.posix_acl_default")] {
        let n = std::ffi::CString::new(name).unwrap();
        let rc = unsafe { libc::setxattr(cpath(on).as_ptr(), n.as_ptr(), acl.as_ptr().cast(), acl.len(), 0) };
        assert_eq!((rc, errno()), (-1, libc::EOPNOTSUPP), "{name}");
    }
    let mode = std::fs::metadata(&f).unwrap().permissions();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o7777, 0o640, "the mode is left as it was");
    let to = cpath(&x.m.path("g"));
    for flags in [libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE, libc::RENAME_WHITEOUT | libc::RENAME_EXCHANGE, 1 << 7] {
        let rc = unsafe { libc::renameat2(libc::AT_FDCWD, p.as_ptr(), libc::AT_FDCWD, to.as_ptr(), flags) };
        assert_eq!((rc, errno()), (-1, libc::EINVAL), "flags {flags:#x}");
        assert!(f.exists() && !x.m.path("g").exists(), "flags {flags:#x}: nothing moved");
    }
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, p.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_WHITEOUT) };
    assert_eq!(rc, 0, "RENAME_WHITEOUT: errno {}", errno());
    assert_eq!(std::fs::read(x.m.path("g")).unwrap(), b"x", "the file moved");
    let w = std::fs::symlink_metadata(&f).unwrap();
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    assert!(w.file_type().is_char_device() && w.rdev() == 0 && w.mode() & 0o7777 == 0, "a whiteout is left: {w:?}");
    // It outlives the mount.
    let m = x.m.remount();
    assert!(std::fs::symlink_metadata(m.path("f")).unwrap().file_type().is_char_device(), "the whiteout after a remount");
    assert_eq!(std::fs::read(m.path("g")).unwrap(), b"x");
}

/// A read moves a file's access time as `relatime` does on Linux: the first read after a change
/// does, the next ones do not (xfstests generic/192 found exofs never moving it).
#[test]
fn reads_move_the_access_time_as_relatime_does() {
    use std::os::unix::fs::MetadataExt;
    let x = exofs_mount("null");
    let f = x.m.path("f");
    std::fs::write(&f, b"some text").unwrap();
    let atime = |p: &Path| {
        let m = std::fs::metadata(p).unwrap();
        (m.atime(), m.atime_nsec())
    };
    let written = atime(&f);
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(std::fs::read(&f).unwrap(), b"some text");
    let read = atime(&f);
    assert!(read > written, "the first read after the write moves the access time: {written:?}, then {read:?}");
    std::thread::sleep(Duration::from_millis(1100));
    // Past the page cache: the read reaches exofs.
    std::fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    assert_eq!(std::fs::read(&f).unwrap(), b"some text");
    assert_eq!(atime(&f), read, "a later read leaves it, the access time being after the last change");
}

/// Filled past full through a mount, exofs refuses the write that does not fit (ENOSPC, from the
/// write or its fsync: never another error, never later at write-back), takes writes again once
/// files are removed, and keeps every file it accepted through an unmount and a remount (xfstests
/// generic/750 and 754 found it refusing every write-back after one ENOSPC, and dropping the
/// unwritten data at unmount).
#[test]
fn a_full_volume_refuses_writes_when_they_are_made_and_loses_none_it_took() {
    use std::io::Write;
    let mut x = exofs_mount("null");
    let mut kept: std::collections::BTreeMap<String, Vec<u8>> = Default::default();
    let mut refusals = 0;
    let mut n = 0u32;
    // Fill; remove every other file; fill again; three times over.
    for round in 0..3 {
        let mut refused_here = 0;
        // The room of files removed is there at once (not only after the next write-back).
        let mut first = round > 0;
        while refused_here < 4 {
            n += 1;
            // Files held in memory until write-back (200 KiB) and files written through (1 MiB).
            let size = if n % 2 == 0 { 200_000 } else { 1_000_000 + n as usize };
            let data: Vec<u8> = (0..size).map(|i| (i as u32 * 13 + n) as u8).collect();
            let name = format!("f{n:04}");
            let p = x.m.path(&name);
            let done = std::fs::File::create(&p).and_then(|mut f| {
                f.write_all(&data)?;
                f.sync_all()
            });
            match done {
                Ok(()) => {
                    kept.insert(name, data);
                }
                Err(e) => {
                    assert!(!first, "round {round}, {name}: refused right after files were removed: {e}");
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "round {round}, {name}: {e}");
                    refusals += 1;
                    refused_here += 1;
                    // Refused at its create, or after: gone either way.
                    if let Err(e) = std::fs::remove_file(&p) {
                        assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{name}");
                    }
                }
            }
            first = false;
            assert!(n < 1000, "the volume never filled");
        }
        let names: Vec<String> = kept.keys().cloned().collect();
        for name in names.iter().step_by(2) {
            std::fs::remove_file(x.m.path(name)).unwrap();
            kept.remove(name);
        }
    }
    assert!(refusals >= 12 && kept.len() > 10, "{refusals} refusals, {} files kept", kept.len());
    for (name, data) in &kept {
        assert!(std::fs::read(x.m.path(name)).unwrap() == *data, "{name} differs");
    }
    assert!(x.m.unmount().success());
    let log = x.m.daemon_log();
    assert!(!log.contains("ERROR"), "the unmount wrote back everything: {log}");
    x.m = x.m.remount();
    for (name, data) in &kept {
        assert!(std::fs::read(x.m.path(name)).unwrap() == *data, "{name} differs after a remount");
    }
    let names: Vec<String> = std::fs::read_dir(x.m.path("")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(names.len(), kept.len(), "{names:?}");
}

/// `exodisk stat` leaves nothing in the service's log (it needs no shared memory), and
/// `exodisk stop` stops the service as SIGTERM does: only for its user or root, and with one
/// line when nothing listens (#32).
#[test]
fn stat_leaves_the_log_quiet_and_stop_stops_the_service() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let v = format(dir.path(), "32M");
    let sock = dir.path().join("s.sock");
    let log = dir.path().join("service.log");
    let out = run(plyfs().args(["exodisk", "serve", "--daemon"]).arg(&v).arg("--socket").arg(&sock).arg("--log").arg(&log));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let pid: i32 = String::from_utf8_lossy(&out.stdout).split("(pid ").nth(1).and_then(|r| r.split(')').next()).unwrap().parse().unwrap();
    // Killed if the test fails while it still runs (and is still this service).
    struct Killer(i32, std::path::PathBuf);
    impl Drop for Killer {
        fn drop(&mut self) {
            let cmdline = std::fs::read(format!("/proc/{}/cmdline", self.0)).unwrap_or_default();
            if cmdline.windows(self.1.as_os_str().len()).any(|w| w == self.1.as_os_str().as_encoded_bytes()) {
                unsafe { libc::kill(self.0, libc::SIGKILL) };
            }
        }
    }
    let _killer = Killer(pid, sock.clone());
    for _ in 0..2 {
        let out = run(plyfs().args(["exodisk", "stat"]).arg(&sock));
        assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("sectors:"));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains("WARN") && !text.contains("shared memory"), "{text}");

    let one_line = |out: &std::process::Output, want: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(1) && err.lines().count() == 1 && err.starts_with("plyfs: ") && err.contains(want), "{err}");
    };
    let mut nobody = plyfs();
    nobody.args(["exodisk", "stop"]).arg(&sock).uid(65534).gid(65534);
    one_line(&run(&mut nobody), "only root or the service's user may stop it");
    assert!(run(plyfs().args(["exodisk", "stat"]).arg(&sock)).status.success(), "a refused stop stops nothing");

    let out = run(plyfs().args(["exodisk", "stop"]).arg(&sock));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let deadline = Instant::now() + Duration::from_secs(10);
    while unsafe { libc::kill(pid, 0) } == 0 {
        assert!(Instant::now() < deadline, "the service still runs after stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!sock.exists());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("asked the service to stop") && text.contains("is consistent"), "{text}");
    assert!(fsck(&v).0, "the volume is consistent after stop: {}", fsck(&v).1);
    one_line(&run(plyfs().args(["exodisk", "stop"]).arg(&sock)), "no exodisk service listens there");
}

