//! POSIX ACLs enforced through the mount as on the lower file system: a named user granted or
//! denied by an ACL entry, default ACLs inherited by new files and directories, and the umask
//! applied where no default ACL rules, through `null`, `zstd` and `crypt`.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use common::*;

fn setfacl(args: &[&str], path: &Path) {
    let out = Command::new("setfacl").args(args).arg(path).output().expect("setfacl (acl)");
    assert!(out.status.success(), "setfacl {args:?} {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
}

fn getfacl(path: &Path) -> String {
    let out = Command::new("getfacl").args(["-c", "-p"]).arg(path).output().expect("getfacl (acl)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Make `umask 077; touch FILE; mkdir DIR` as root, in a shell, and give back the modes.
fn made_with_umask_077(dir: &Path) -> (u32, u32) {
    let script = format!("umask 077; touch '{0}/f'; mkdir '{0}/d'", dir.display());
    assert!(Command::new("sh").arg("-c").arg(&script).status().unwrap().success());
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    (mode(&dir.join("f")), mode(&dir.join("d")))
}

fn acls_through(m: &Mount) {
    assert!(is_root(), "ACL tests switch to another user: run as root");
    for p in [m.dir.path(), &m.mnt, &m.lower] {
        fs::set_permissions(p, fs::Permissions::from_mode(0o755)).unwrap();
    }
    // Granted: a file only its owner may read, and an entry for nobody.
    let grant = m.path("grant");
    fs::write(&grant, b"for nobody's eyes").unwrap();
    fs::set_permissions(&grant, fs::Permissions::from_mode(0o600)).unwrap();
    let (ok, err) = as_nobody(&["cat", grant.to_str().unwrap()]);
    assert!(!ok, "nobody read a 0600 file before any grant");
    assert!(err.contains("Permission denied"), "{err}");
    setfacl(&["-m", "u:nobody:r"], &grant);
    let (ok, err) = as_nobody(&["cat", grant.to_str().unwrap()]);
    assert!(ok, "the ACL grants nobody reading: {err}");
    // Denied: a file anyone may read, and an entry taking it from nobody.
    let deny = m.path("deny");
    fs::write(&deny, b"for everyone but nobody").unwrap();
    fs::set_permissions(&deny, fs::Permissions::from_mode(0o644)).unwrap();
    assert!(as_nobody(&["cat", deny.to_str().unwrap()]).0);
    setfacl(&["-m", "u:nobody:---"], &deny);
    let (ok, err) = as_nobody(&["cat", deny.to_str().unwrap()]);
    assert!(!ok && err.contains("Permission denied"), "the ACL denies nobody: {err}");
    // Writing, granted to a directory: nobody may make a file in it.
    let shared = m.path("shared");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o755)).unwrap();
    assert!(!as_nobody(&["touch", shared.join("x").to_str().unwrap()]).0);
    setfacl(&["-m", "u:nobody:rwx"], &shared);
    let (ok, err) = as_nobody(&["touch", shared.join("x").to_str().unwrap()]);
    assert!(ok, "{err}");

    // Default ACLs and the umask: the same steps through the mount and natively (in the lower
    // of a plain directory beside it) give the same modes and ACLs.
    let native = tempfile::Builder::new().prefix("plyfs-test-native-").tempdir_in("/tmp").unwrap();
    for (base, what) in [(m.path(""), "through the mount"), (native.path().to_owned(), "natively")] {
        let inherit = base.join("inherit");
        fs::create_dir(&inherit).unwrap();
        setfacl(&["-d", "-m", "u:nobody:rwx"], &inherit);
        let plain = base.join("plain");
        fs::create_dir(&plain).unwrap();
        let got = (made_with_umask_077(&inherit), made_with_umask_077(&plain), getfacl(&inherit.join("f")), getfacl(&inherit.join("d")));
        if what == "natively" {
            let mount = m.path("");
            let ours = (
                {
                    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
                    (mode(&mount.join("inherit/f")), mode(&mount.join("inherit/d")))
                },
                {
                    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
                    (mode(&mount.join("plain/f")), mode(&mount.join("plain/d")))
                },
                getfacl(&mount.join("inherit/f")),
                getfacl(&mount.join("inherit/d")),
            );
            assert_eq!(ours, got, "modes and ACLs of new objects: through the mount, then natively");
            assert_eq!(got.1, (0o600, 0o700), "the umask where no default ACL rules");
            assert!(got.2.contains("user:nobody:rwx"), "inherited: {}", got.2);
        }
    }
}

#[test]
fn acls_are_enforced_through_null() {
    acls_through(&Mount::with("null", &["allow_other"]));
}

#[test]
fn acls_are_enforced_through_zstd() {
    acls_through(&Mount::with("zstd", &["allow_other"]));
}

#[test]
fn acls_are_enforced_through_crypt() {
    acls_through(&Mount::crypt("crypt", &[], &["allow_other"]));
}

/// Setting an access ACL keeps the set-group-ID bit for a caller in the file's group and clears
/// it for one outside it, as chmod does (xfstests generic/375), on files and directories.
fn acl_setgid_rule(m: &Mount) {
    assert!(is_root(), "ACL tests switch to another user: run as root");
    for p in [m.dir.path(), &m.mnt, &m.lower] {
        fs::set_permissions(p, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    fs::write(m.path("sgid-file"), b"").unwrap();
    fs::create_dir(m.path("sgid-dir")).unwrap();
    for name in ["sgid-file", "sgid-dir"] {
        let p = m.path(name);
        let shown = p.to_str().unwrap();
        // nobody owns it, in nobody's group: the bit stays.
        std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o2755)).unwrap();
        let (ok, err) = as_nobody(&["setfacl", "-m", "u::rwx,g::rwx,o::rwx", shown]);
        assert!(ok, "setfacl as the owner: {err}");
        assert_eq!(mode(&p), 0o2777, "{name}: the caller is in the file's group");
        // The file's group is one nobody is not in: the bit goes.
        std::os::unix::fs::chown(&p, None, Some(100)).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o2755)).unwrap();
        let (ok, err) = as_nobody(&["setfacl", "-m", "u::rwx,g::rwx,o::rwx", shown]);
        assert!(ok, "setfacl as the owner: {err}");
        assert_eq!(mode(&p), 0o777, "{name}: the caller is not in the file's group");
        assert_eq!(fs::metadata(m.lower_path(name)).unwrap().permissions().mode() & 0o7777, 0o777, "{name} below");
    }
}

#[test]
fn setting_an_acl_clears_setgid_as_chmod_does() {
    acl_setgid_rule(&Mount::with("null", &["allow_other"]));
    acl_setgid_rule(&Mount::with("zstd", &["allow_other"]));
}
