//! Encrypted names through a real mount: long names under stress, renames, hard links and
//! symlinks, across a remount; and the password prompt on a terminal.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;

/// The names in `dir`, but for the lower lock a mount holds (#29).
fn listing(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).filter(|n| n != ".plyfs.lock").collect()
}

/// A name of exactly `len` bytes, different for each `i`.
fn long_name(len: usize, i: usize) -> String {
    let head = format!("{i:04}-é-");
    let mut s = head.clone();
    while s.len() < len {
        s.push((b'a' + ((s.len() + i) % 26) as u8) as char);
    }
    s
}

#[test]
fn long_names_renames_links_and_symlinks_survive_a_remount() {
    let m = Mount::crypt("crypt", &[], &[]);
    let d = m.path("dir");
    fs::create_dir(&d).unwrap();
    let mut files = BTreeSet::new();
    for i in 0..150 {
        let name = long_name(150 + i % 106, i);
        fs::write(d.join(&name), format!("content {i}")).unwrap();
        files.insert(name);
    }
    assert_eq!(listing(&d), files);
    // Rename a third to other long names, a third into a subdirectory with a long name.
    let sub_name = long_name(255, 9999);
    let sub = d.join(&sub_name);
    fs::create_dir(&sub).unwrap();
    let mut in_sub = BTreeSet::new();
    for (k, name) in files.clone().iter().enumerate() {
        match k % 3 {
            0 => {
                let to = long_name(255 - k % 50, 5000 + k);
                fs::rename(d.join(name), d.join(&to)).unwrap();
                files.remove(name);
                files.insert(to);
            }
            1 => {
                fs::rename(d.join(name), sub.join(name)).unwrap();
                files.remove(name);
                in_sub.insert(name.clone());
            }
            _ => {}
        }
    }
    files.insert(sub_name.clone());
    // Hard links and symlinks with long names and targets.
    let first = in_sub.iter().next().unwrap().clone();
    let link = long_name(240, 7777);
    fs::hard_link(sub.join(&first), d.join(&link)).unwrap();
    files.insert(link.clone());
    let sym = long_name(230, 8888);
    let target = format!("{sub_name}/{first}");
    std::os::unix::fs::symlink(&target, d.join(&sym)).unwrap();
    files.insert(sym.clone());
    assert_eq!(listing(&d), files);
    assert_eq!(listing(&sub), in_sub);

    let m = m.remount();
    let d = m.path("dir");
    let sub = d.join(&sub_name);
    assert_eq!(listing(&d), files);
    assert_eq!(listing(&sub), in_sub);
    assert_eq!(fs::read_link(d.join(&sym)).unwrap().to_str().unwrap(), target);
    assert_eq!(fs::symlink_metadata(d.join(&sym)).unwrap().len(), target.len() as u64);
    let via_link = fs::read_to_string(d.join(&sym)).unwrap();
    assert_eq!(via_link, fs::read_to_string(d.join(&link)).unwrap());
    assert_eq!(fs::metadata(d.join(&link)).unwrap().nlink(), 2);
    for name in &in_sub {
        let i: usize = name[..4].parse().unwrap();
        assert_eq!(fs::read_to_string(sub.join(name)).unwrap(), format!("content {i}"));
    }
    // Nothing below shows a plaintext name (base64url has no 'é', and chance cannot give the
    // last 16 letters of a name); removing everything leaves only the volume file.
    let tails: Vec<String> = files.iter().chain(&in_sub).map(|n| n[n.len() - 16..].to_owned()).collect();
    let mut below = vec![m.lower.clone()];
    while let Some(dir) = below.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let n = e.file_name().into_string().unwrap();
            assert!(!n.contains('é') && !tails.iter().any(|t| n.contains(t.as_str())), "a plaintext name below: {n}");
            if e.file_type().unwrap().is_dir() {
                below.push(e.path());
            }
        }
    }
    fs::remove_dir_all(&d).unwrap();
    assert_eq!(listing(&m.lower), [".plyfs-crypt.conf".to_owned()].into_iter().collect());
}

/// Run `plyfs ARGS` on a terminal (through `script`), typing each line once the prompt before
/// it is on the screen (typed earlier, the terminal would still echo it). Returns the exit
/// status and everything shown.
fn on_terminal(args: &str, answers: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    use std::sync::{Arc, Mutex};
    let bin = env!("CARGO_BIN_EXE_plyfs");
    let mut child = Command::new("script")
        .args(["-q", "-e", "-c", &format!("{bin} {args}"), "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("script (util-linux)");
    let shown = Arc::new(Mutex::new(String::new()));
    let mut stdout = child.stdout.take().unwrap();
    let reader = {
        let shown = shown.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 256];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                shown.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };
    let mut stdin = child.stdin.take().unwrap();
    for (i, (prompt, line)) in answers.iter().enumerate() {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        // The i-th answer waits for the prompt's (i+1)-th appearance counted over all answers.
        let wanted = answers[..=i].iter().filter(|(p, _)| p == prompt).count();
        while shown.lock().unwrap().matches(prompt).count() < wanted {
            assert!(std::time::Instant::now() < deadline, "no prompt {prompt:?}: {}", shown.lock().unwrap());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // The prompt is written once echo is off.
        writeln!(stdin, "{line}").unwrap();
    }
    drop(stdin);
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let text = shown.lock().unwrap().clone();
    (status, text)
}

#[test]
fn passwords_typed_at_the_prompt_are_not_echoed_and_unlock_the_volume() {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let (lower, mnt) = (dir.path().join("lower"), dir.path().join("mnt"));
    fs::create_dir(&lower).unwrap();
    fs::create_dir(&mnt).unwrap();
    let (status, shown) = on_terminal(&format!("init {} --kdf-memory 1024", lower.display()), &[("New password", "typed secret"), ("Repeat it", "typed secret")]);
    assert!(status.success(), "init at a prompt: {shown}");
    assert!(shown.contains("New password") && shown.contains("Repeat it"), "{shown}");
    assert!(!shown.contains("typed secret"), "the password was echoed: {shown}");
    // Two different answers are refused.
    let other = dir.path().join("other");
    fs::create_dir(&other).unwrap();
    let (status, shown) = on_terminal(&format!("init {} --kdf-memory 1024", other.display()), &[("New password", "one"), ("Repeat it", "two")]);
    assert!(!status.success());
    assert!(shown.contains("the two passwords differ"), "{shown}");
    // Typed at the mount's prompt, a wrong password mounts nothing; the right one mounts.
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            if mounted_fstype(self.0).is_some() {
                let _ = run(plyfs().arg("umount").arg(self.0));
                let _ = run(plyfs().arg("umount").arg("--lazy").arg(self.0));
            }
        }
    }
    let guard = Unmount(&mnt);
    let (status, shown) = on_terminal(&format!("mount {} {} --stack crypt", lower.display(), mnt.display()), &[("Password for", "wrong one")]);
    assert!(!status.success());
    assert!(shown.contains("wrong password"), "{shown}");
    assert!(mounted_fstype(&mnt).is_none());
    let (status, shown) = on_terminal(&format!("mount {} {} --stack crypt", lower.display(), mnt.display()), &[("Password for", "typed secret")]);
    assert!(status.success(), "{shown}");
    assert_eq!(mounted_fstype(&mnt).as_deref(), Some("fuse.plyfs"));
    fs::write(mnt.join("typed"), b"through the prompt").unwrap();
    assert!(run(plyfs().arg("umount").arg(&mnt)).status.success());
    drop(guard);
    // The same password from a file.
    let passfile = dir.path().join("pw");
    fs::write(&passfile, "typed secret\n").unwrap();
    let m = Mount::start(dir, lower, mnt, "crypt", &[&format!("--passfile={}", passfile.display())]);
    assert_eq!(fs::read(m.path("typed")).unwrap(), b"through the prompt");
    drop(m);
}

/// Rules match the plaintext paths of a volume with encrypted names, `policy explain` names
/// the rule, and a rule may itself choose `crypt` (the volume is unlocked before rules load).
#[test]
fn rules_see_plaintext_paths_on_a_volume_with_encrypted_names() {
    let rules_dir = tempfile::tempdir().unwrap();
    let rules = rules_dir.path().join("rules.toml");
    fs::write(
        &rules,
        "[[rule]]\nglob = \"sub/*.txt\"\nlayers = \"zstd,crypt\"\n\n[[rule]]\nglob = \"*.log\"\nlayers = \"none\"\n",
    )
    .unwrap();
    let m = Mount::crypt("crypt", &[], &[&format!("--rules={}", rules.display())]);
    fs::create_dir(m.path("sub")).unwrap();
    let text = "a line of text that compresses well\n".repeat(2000);
    fs::write(m.path("sub/a.txt"), &text).unwrap();
    fs::write(m.path("top.log"), "plain log line\n").unwrap();
    fs::write(m.path("sub/b.log"), "another plain log line\n").unwrap();
    fs::write(m.path("other.dat"), &text).unwrap();
    let explain = |rel: &str| {
        let out = run(plyfs().args(["policy", "explain"]).arg(m.path(rel)));
        assert!(out.status.success(), "explain {rel}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let a = explain("sub/a.txt");
    assert!(a.contains("rule 1") && a.contains("zstd,crypt"), "{a}");
    assert!(explain("top.log").contains("rule 2"), "{}", explain("top.log"));
    assert!(explain("sub/b.log").contains("rule 2"));
    assert!(explain("other.dat").contains("default"), "{}", explain("other.dat"));
    // What each file became below: the logs stay plain (as their rule says), the rest is sealed;
    // sub/a.txt compressed too.
    let mut plain = 0;
    let mut sealed_sizes = Vec::new();
    let mut below = vec![m.lower.clone()];
    while let Some(dir) = below.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                below.push(e.path());
            } else if e.file_name() != ".plyfs-crypt.conf" && e.file_name() != ".plyfs.lock" {
                let bytes = fs::read(e.path()).unwrap();
                if bytes.ends_with(b"log line\n") {
                    plain += 1;
                } else {
                    assert!(bytes.starts_with(b"PLYSCA"), "{}", e.path().display());
                    sealed_sizes.push(bytes.len());
                }
            }
        }
    }
    assert_eq!(plain, 2);
    sealed_sizes.sort();
    assert_eq!(sealed_sizes.len(), 2);
    assert!(sealed_sizes[0] * 4 < sealed_sizes[1], "sub/a.txt is compressed before it is sealed: {sealed_sizes:?}");
    assert_eq!(fs::read_to_string(m.path("sub/a.txt")).unwrap(), text);
}

/// A path of exactly `len` bytes made of long directory names (as pjdfstest's `dirgen_max`).
fn long_path(len: usize) -> String {
    let mut p = String::new();
    let mut i = 0;
    while p.len() < len {
        let room = len - p.len();
        // Components of up to 255 bytes, never leaving a last one of fewer than 2 bytes.
        let take = if room > 256 { (255).min(room - 2) } else { room };
        if !p.is_empty() {
            p.push('/');
        }
        let take = if p.is_empty() { take } else { take - 1 };
        p.push_str(&long_name(take.max(1), i));
        i += 1;
    }
    p.truncate(len);
    p
}

/// pjdfstest's `symlink/03` (which the crates.io pjdfstest does not carry): a symlink whose
/// target is PATH_MAX - 1 bytes, and one whose own path is; one byte more is ENAMETOOLONG.
fn symlink_03(stack: &str) {
    use std::os::unix::fs::symlink;
    let m = Mount::crypt(stack, &[], &[]);
    let nx = long_path(libc::PATH_MAX as usize - 1 - m.mnt.as_os_str().len() - 1);
    let full_nx = format!("{}/{nx}", m.mnt.display());
    assert_eq!(full_nx.len(), libc::PATH_MAX as usize - 1);
    let target = "/".repeat(0) + &full_nx; // a PATH_MAX - 1 byte target
    fs::create_dir_all(Path::new(&full_nx).parent().unwrap()).unwrap();
    symlink(&target, m.path("n0")).unwrap();
    assert_eq!(fs::read_link(m.path("n0")).unwrap().as_os_str().len(), target.len());
    assert_eq!(fs::read_link(m.path("n0")).unwrap().to_str().unwrap(), target);
    assert_eq!(fs::symlink_metadata(m.path("n0")).unwrap().len(), target.len() as u64);
    fs::remove_file(m.path("n0")).unwrap();
    symlink("n0", &full_nx).unwrap();
    assert_eq!(fs::read_link(&full_nx).unwrap().to_str().unwrap(), "n0");
    fs::remove_file(&full_nx).unwrap();
    let nxx = format!("{full_nx}x");
    assert_eq!(std::os::unix::fs::symlink("n0", &nxx).unwrap_err().raw_os_error(), Some(libc::ENAMETOOLONG));
    assert_eq!(std::os::unix::fs::symlink(&nxx, m.path("n0")).unwrap_err().raw_os_error(), Some(libc::ENAMETOOLONG));
    let top = nx.split('/').next().unwrap();
    fs::remove_dir_all(m.path(top)).unwrap();
    assert_eq!(listing(&m.lower), [".plyfs-crypt.conf".to_owned()].into_iter().collect());
}

#[test]
fn symlink_03_targets_of_path_max_minus_one_on_crypt() {
    symlink_03("crypt");
}

#[test]
fn symlink_03_targets_of_path_max_minus_one_on_zstd_crypt() {
    symlink_03("zstd,crypt");
}

/// Symlinks with long targets (their sealed form kept in a companion file) renamed within and
/// across directories, hard-linked, replaced and removed: each reads back, shows its length,
/// survives a remount, and nothing is left below once all are gone.
#[test]
fn long_symlink_targets_follow_renames_links_and_removal() {
    use std::os::unix::fs::symlink;
    let m = Mount::crypt("crypt", &[], &[]);
    let target = |i: usize| format!("/{}", "t".repeat(3100 + i * 200)) + &format!("/{i}");
    let (a, b) = (m.path("a"), m.path("b"));
    fs::create_dir(&a).unwrap();
    fs::create_dir(&b).unwrap();
    for i in 0..5 {
        symlink(target(i), a.join(format!("s{i}"))).unwrap();
    }
    let check = |p: &Path, i: usize| {
        assert_eq!(fs::read_link(p).unwrap().to_str().unwrap(), target(i), "{}", p.display());
        assert_eq!(fs::symlink_metadata(p).unwrap().len(), target(i).len() as u64, "{}", p.display());
    };
    for i in 0..5 {
        check(&a.join(format!("s{i}")), i);
    }
    // A short target beside them shows its length from the moment it is made.
    symlink("short/target", a.join("short")).unwrap();
    assert_eq!(fs::symlink_metadata(a.join("short")).unwrap().len(), 12);
    fs::remove_file(a.join("short")).unwrap();
    // Within a directory, across directories, hard-linked across, and over another one.
    fs::rename(a.join("s0"), a.join("renamed")).unwrap();
    fs::rename(a.join("s1"), b.join("moved")).unwrap();
    fs::hard_link(a.join("s2"), b.join("linked")).unwrap();
    fs::rename(a.join("s3"), a.join("s4")).unwrap();
    let m = m.remount();
    let (a, b) = (m.path("a"), m.path("b"));
    check(&a.join("renamed"), 0);
    check(&b.join("moved"), 1);
    check(&a.join("s2"), 2);
    check(&b.join("linked"), 2);
    check(&a.join("s4"), 3);
    assert_eq!(listing(&a), ["renamed", "s2", "s4"].map(String::from).into_iter().collect());
    assert_eq!(listing(&b), ["linked", "moved"].map(String::from).into_iter().collect());
    // Each directory holds one companion per symlink with a long target named in it.
    let companions = |dir: &str| {
        let id = m.lower.join(fs::read_dir(&m.lower).unwrap().map(|e| e.unwrap().file_name()).find(|n| n != ".plyfs-crypt.conf" && {
            let d = m.lower.join(n);
            fs::symlink_metadata(&d).unwrap().is_dir() && dir_holds(&d, dir, &m)
        }).unwrap());
        fs::read_dir(id).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_str().unwrap().starts_with("T.")).count()
    };
    assert_eq!((companions("a"), companions("b")), (3, 2), "{}", String::from_utf8_lossy(&Command::new("ls").arg("-laR").arg(&m.lower).output().unwrap().stdout));
    assert_eq!(companions("b"), 2);
    fs::remove_file(a.join("s2")).unwrap();
    check(&b.join("linked"), 2);
    fs::remove_dir_all(&a).unwrap();
    fs::remove_dir_all(&b).unwrap();
    assert_eq!(listing(&m.lower), [".plyfs-crypt.conf".to_owned()].into_iter().collect());
}

/// Whether the lower directory `lower_dir` is the one the mount shows as `name` (by inode).
fn dir_holds(lower_dir: &Path, name: &str, m: &Mount) -> bool {
    fs::metadata(lower_dir).unwrap().ino() == fs::metadata(m.path(name)).unwrap().ino()
}

/// `init` shows the master key once; after the password wrap is replaced by one nobody knows,
/// the key (from a file, or typed at the prompt) still mounts the volume and `passwd` wraps it
/// under a new password. A wrong key is one line of error and mounts nothing, and the key never
/// reaches the daemon's log.
#[test]
fn the_recovery_key_opens_a_volume_whose_password_is_lost() {
    let dir = tempfile::Builder::new().prefix("plyfs-test-").tempdir_in("/tmp").unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (lower, mnt) = (root.join("lower"), root.join("mnt"));
    fs::create_dir(&lower).unwrap();
    fs::create_dir(&mnt).unwrap();
    let passfile = crypt_passfile(&root);
    let out = run(plyfs().arg("init").arg(&lower).args(["--kdf-memory", "1024", "--passfile"]).arg(&passfile));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let key = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert_eq!(key.len(), 80, "nine groups of eight hex digits: {key}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("master key"), "init explains what it shows");
    let m = Mount::start(dir, lower.clone(), mnt.clone(), "crypt", &[&format!("--passfile={}", passfile.display())]);
    fs::write(m.path("kept"), b"still here").unwrap();
    let dir = unmount_keeping_dir(m);

    // The password is replaced by one that is then forgotten.
    let unknown = root.join("unknown");
    fs::write(&unknown, format!("{:x}\n", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos())).unwrap();
    let out = run(plyfs().arg("passwd").arg(&lower).arg("--passfile").arg(&passfile).arg("--new-passfile").arg(&unknown));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    fs::remove_file(&unknown).unwrap();
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).args(["--stack", "crypt", "--passfile"]).arg(&passfile));
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("wrong password"));

    // A wrong key (another volume's), and a mistyped one: one line each, nothing mounted.
    let wrong = root.join("wrong-key");
    fs::write(&wrong, format!("{}\n", "0123abcd-".repeat(8) + "00000000")).unwrap();
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).args(["--stack", "crypt", "--masterkey-file"]).arg(&wrong));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("mistyped") && err.trim().lines().count() == 1, "{err}");
    let other = tempfile::tempdir().unwrap();
    let out = run(plyfs().arg("init").arg(other.path()).args(["--kdf-memory", "1024", "--passfile"]).arg(&passfile));
    fs::write(&wrong, String::from_utf8(out.stdout).unwrap()).unwrap();
    let out = run(plyfs().arg("mount").arg(&lower).arg(&mnt).args(["--stack", "crypt", "--masterkey-file"]).arg(&wrong));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("wrong master key") && err.trim().lines().count() == 1, "{err}");
    assert!(mounted_fstype(&mnt).is_none());

    // The right key, from a file, mounts it.
    let keyfile = root.join("written-down");
    fs::write(&keyfile, format!("{}\n", key.to_uppercase().replace('-', " "))).unwrap();
    let m = Mount::start(dir, lower.clone(), mnt.clone(), "crypt", &[&format!("--masterkey-file={}", keyfile.display())]);
    assert_eq!(fs::read(m.path("kept")).unwrap(), b"still here");
    let digits = key.replace('-', "");
    assert!(!m.daemon_log().to_lowercase().contains(&digits[..16]), "the key reached the log");
    let dir = unmount_keeping_dir(m);

    // Typed at the prompt, it lets `passwd` set a new password.
    let (status, shown) = on_terminal(
        &format!("passwd {} --masterkey --new-passfile {}", lower.display(), passfile.display()),
        &[("Master key", &key)],
    );
    assert!(status.success(), "{shown}");
    assert!(!shown.contains(&key), "the key was echoed: {shown}");
    let m = Mount::start(dir, lower, mnt, "crypt", &[&format!("--passfile={}", passfile.display())]);
    assert_eq!(fs::read(m.path("kept")).unwrap(), b"still here");
}

/// Unmount `m` and give back its test directory.
fn unmount_keeping_dir(mut m: Mount) -> tempfile::TempDir {
    m.unmount();
    std::mem::replace(&mut m.dir, tempfile::tempdir().unwrap())
}

/// `renameat2(RENAME_WHITEOUT)` leaves a whiteout (a character device 0/0) under the old name. Under
/// a long name the whiteout keeps its companion: it stays listed and can be removed, and the
/// directory can then be removed (xfstests generic/013's fsstress found it left an entry that
/// nothing listed and that kept its directory from being removed).
#[test]
fn a_whiteout_rename_keeps_the_old_long_name_listed() {
    assert!(is_root(), "RENAME_WHITEOUT needs CAP_MKNOD: run as root");
    let m = Mount::crypt("crypt", &[], &[]);
    fs::create_dir(m.path("d")).unwrap();
    for (i, len) in [(0, 40), (1, 200), (2, 255)] {
        let (old, new) = (long_name(len, i), long_name(len, i + 10));
        fs::write(m.path(&format!("d/{old}")), b"moved").unwrap();
        let (from, to) = (cpath(&m.path(&format!("d/{old}"))), cpath(&m.path(&format!("d/{new}"))));
        let rc = unsafe { libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_WHITEOUT) };
        assert_eq!(rc, 0, "renameat2(RENAME_WHITEOUT) of a {len}-byte name: errno {}", errno());
        assert_eq!(listing(&m.path("d")), BTreeSet::from([old.clone(), new.clone()]), "{len}-byte names");
        let whiteout = fs::symlink_metadata(m.path(&format!("d/{old}"))).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_char_device(&whiteout.file_type()) && whiteout.rdev() == 0, "{len}: a whiteout");
        assert_eq!(fs::read(m.path(&format!("d/{new}"))).unwrap(), b"moved");
        fs::remove_file(m.path(&format!("d/{old}"))).unwrap();
        fs::remove_file(m.path(&format!("d/{new}"))).unwrap();
    }
    fs::remove_dir(m.path("d")).expect("the directory is empty once both names are gone");
}
