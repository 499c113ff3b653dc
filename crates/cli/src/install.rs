//! `plyfs install-helper`: the mount(8) helper `mount.fuse.plyfs` for a plyfs that no package
//! installed (`cargo install`). mount(8) runs `mount.fuse.TYPE` from /sbin for `-t fuse.TYPE`
//! and fstab lines, before falling back on mount.fuse3 and the PATH; the helper runs this plyfs
//! wherever it is, so mounts at boot and from systemd find it. The Debian package's helper is
//! made here too (`scripts/deb.sh`), so there is one script.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use clap::Args;

use crate::failure::Failure;

#[derive(Args)]
pub struct InstallHelperArgs {
    /// Where to write mount.fuse.plyfs: mount(8) looks in /sbin (/usr/sbin where /sbin is a
    /// link to it), /sbin/fs.d and /sbin/fs.
    #[arg(long, value_name = "DIR", default_value = "/sbin", value_hint = clap::ValueHint::DirPath)]
    dir: PathBuf,
    /// The plyfs the helper runs (default: this one, where it is installed).
    #[arg(long = "exec", value_name = "PATH", value_hint = clap::ValueHint::ExecutablePath)]
    exec: Option<PathBuf>,
    /// The program comes with the helper, in a package being built (`scripts/deb.sh`): it is
    /// not there to check yet.
    #[arg(long, hide = true, requires = "exec")]
    for_package: bool,
}

const HELPER_NAME: &str = "mount.fuse.plyfs";

/// Where the Debian package puts plyfs, which its helper runs.
const PACKAGE_PROGRAM: &str = "/usr/bin/plyfs";

/// The program the helper is to run: an executable file, which, when root installs the
/// helper, only root can change.
fn check_program(plyfs: &Path) -> Result<(), Failure> {
    let program = std::fs::metadata(plyfs).map_err(|e| format!("{}: {e}", plyfs.display()))?;
    if !program.is_file() || program.permissions().mode() & 0o111 == 0 {
        return Err(format!("{}: not an executable file", plyfs.display()).into());
    }
    // Root's mounts (fstab, at boot) run the helper as root, and it runs the program: no one but
    // root may be able to change what that is (`sudo plyfs install-helper` after a user's
    // `cargo install` would hand root's mounts to the user's ~/.cargo/bin).
    if unsafe { libc::geteuid() } == 0 {
        if let Some(why) = others_can_change(plyfs) {
            return Err(format!(
                "{}: {why}, and root's mounts would run it: install plyfs where only root writes (e.g. `cargo install --root /usr/local`) and give --exec",
                plyfs.display()
            )
            .into());
        }
    }
    Ok(())
}

/// Why someone other than root could change `program` (or put another in its place): it, or a
/// directory above it, belongs to another user or is writable by others (a sticky directory
/// keeps root's entries its own).
fn others_can_change(program: &Path) -> Option<String> {
    let real = program.canonicalize().ok()?;
    let mut at = Some(real.as_path());
    let mut is_program = true;
    while let Some(p) = at {
        let meta = std::fs::metadata(p).ok()?;
        let mode = meta.permissions().mode();
        if meta.uid() != 0 {
            return Some(format!("{} belongs to uid {}", p.display(), meta.uid()));
        }
        if mode & 0o022 != 0 && (is_program || mode & 0o1000 == 0) {
            return Some(format!("{} is writable by others (mode {:o})", p.display(), mode & 0o7777));
        }
        is_program = false;
        at = p.parent();
    }
    None
}

/// The line that marks a helper as plyfs's own, which a later install may replace.
const MARK: &str = "# mount(8) helper for file systems of type fuse.plyfs: `mount -t fuse.plyfs LOWER MNT -o";

/// The helper script, which runs `plyfs` with mount(8)'s arguments.
fn helper_script(plyfs: &Path) -> String {
    let quoted = format!("'{}'", plyfs.display().to_string().replace('\'', r"'\''"));
    format!("#!/bin/sh\n{MARK}\n# stack=SPEC,...` and /etc/fstab lines run it as `mount.fuse.plyfs LOWER MNT -o OPTIONS`.\nexec {quoted} \"$@\"\n")
}

pub fn install_helper(args: &InstallHelperArgs) -> Result<(), Failure> {
    let plyfs = match &args.exec {
        // The helper runs from wherever mount(8) is: a relative path would name nothing there.
        Some(p) if !p.is_absolute() => return Err(Failure::usage(format!("--exec {}: give an absolute path", p.display()))),
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .and_then(|p| p.canonicalize())
            .map_err(|e| format!("cannot find the plyfs program: {e}"))?,
    };
    if !args.for_package {
        check_program(&plyfs)?;
    }

    let target = args.dir.join(HELPER_NAME);
    let shown = target.display();
    let meta = std::fs::metadata(&args.dir).map_err(|e| format!("{}: {e}", args.dir.display()))?;
    if !meta.is_dir() {
        return Err(format!("{}: not a directory", args.dir.display()).into());
    }
    // Another helper (another program's, or one edited by hand) is not ours to replace, nor is
    // the Debian package's (dpkg keeps it), unless it already runs the same program.
    if let Ok(existing) = std::fs::read_to_string(&target) {
        if !existing.contains(MARK) {
            return Err(format!("{shown}: exists and is not plyfs's helper; remove it first if it should be").into());
        }
        if existing.contains(&format!("exec '{PACKAGE_PROGRAM}' ")) && plyfs != Path::new(PACKAGE_PROGRAM) {
            return Err(format!("{shown}: the plyfs package's helper, which runs {PACKAGE_PROGRAM}; remove the package first, or give --dir").into());
        }
    } else if target.symlink_metadata().is_ok() {
        return Err(format!("{shown}: exists and is not plyfs's helper; remove it first if it should be").into());
    }
    let refused = |e: std::io::Error| -> Failure {
        let advice = if e.kind() == std::io::ErrorKind::PermissionDenied { " (run it as root, or give --dir DIR)" } else { "" };
        format!("{shown}: {e}{advice}").into()
    };
    // Written beside it and renamed, so a mount that runs it never reads half a script.
    let temporary = args.dir.join(format!(".{HELPER_NAME}.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o755).open(&temporary)?;
        f.write_all(helper_script(&plyfs).as_bytes())?;
        f.set_permissions(std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&temporary, &target)
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&temporary);
        return Err(refused(e));
    }
    eprintln!("plyfs: installed {shown}, which runs {}: `mount -t fuse.plyfs` and fstab lines find it", plyfs.display());
    Ok(())
}
