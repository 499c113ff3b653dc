//! The form mount(8) uses: `mount -t fuse.plyfs LOWER MNT -o stack=SPEC,passfile=F,...` (and
//! `/etc/fstab` lines of type `fuse.plyfs`) reach plyfs through mount.fuse3, which runs
//! `plyfs LOWER MNT -o OPTIONS`; a `mount.fuse.plyfs` link to plyfs is called the same way.
//! Options that name plyfs's own arguments (`stack=`, `passfile=`, `branch=`, ...) become them,
//! the rest stay mount options, and what only mount(8) and systemd read is dropped.
//! `-o remount,...` (from `mount -o remount,ro MNT`) changes the mounted file system's flags.
//!
//! The source may also name the lower directory the way test suites and libfuse's examples do:
//! `source:DIR` (xfstests' `TEST_DEV=source:/srv/test`), or any tag with `-o source=DIR`. The mount
//! then shows the source as given (`fsname`), so that `umount SOURCE` and `findmnt SOURCE` find
//! it. Like every mount helper, it prints nothing when the mount succeeds (`-v`: the usual line).

use std::ffi::OsString;

/// Options that become arguments of `plyfs mount` (with their value), and the argument each
/// becomes.
const ARGUMENTS: &[(&str, &str)] = &[
    ("stack", "--stack"),
    ("config", "--config"),
    ("branch", "--branch"),
    ("rules", "--rules"),
    ("passfile", "--passfile"),
    ("extpass", "--extpass"),
    ("keyfile", "--keyfile"),
    ("masterkey_file", "--masterkey-file"),
    ("masterkey-file", "--masterkey-file"),
    ("psk", "--psk"),
    ("log", "--log"),
    ("exclude", "--exclude"),
    ("exclude_from", "--exclude-from"),
    ("exclude-from", "--exclude-from"),
];

/// Options that become flags of `plyfs mount`.
const FLAGS: &[(&str, &str)] = &[("reverse", "--reverse"), ("foreground", "--foreground")];

/// What mount(8), mount.fuse3 and systemd read and plyfs has no use for.
fn ignored(opt: &str) -> bool {
    const IGNORED: &[&str] =
        &["defaults", "auto", "noauto", "user", "users", "nouser", "owner", "group", "nofail", "_netdev", "relatime", "strictatime", "lazytime", "nolazytime"];
    IGNORED.contains(&opt)
        || opt.starts_with("x-")
        || opt.starts_with("comment=")
        || opt.starts_with("user_id=")
        || opt.starts_with("group_id=")
        || opt.starts_with("subtype=")
}

/// Whether `argv` (the whole command line) is the helper form: no subcommand, but a source (a
/// path, present or not, or an address such as `unix:PATH`) and a mount point. A missing source
/// is the helper's to report, as `plyfs mount` does ("lower directory ...: No such file"). A
/// word that is neither (a mistyped subcommand) is left to the ordinary parser.
pub fn is_helper_form(argv: &[OsString], subcommands: &[&str]) -> bool {
    let called_as_helper = argv.first().and_then(|a| std::path::Path::new(a).file_name()).is_some_and(|n| n.to_string_lossy().starts_with("mount."));
    let first = argv.get(1).map(|a| a.to_string_lossy().into_owned()).unwrap_or_default();
    // A tag names the lower with `-o source=DIR` (libfuse's examples, test suites).
    let names_source = argv.iter().any(|a| a.to_string_lossy().trim_start_matches("-o").split(',').any(|o| o.starts_with("source=")));
    let source_like = first.contains(':') || first.contains('/') || std::path::Path::new(&first).exists() || names_source;
    called_as_helper || (argv.len() >= 3 && !first.starts_with('-') && !subcommands.contains(&first.as_str()) && source_like)
}

/// The helper's command line: `SOURCE MOUNTPOINT [-o OPTIONS]... [-n] [-s] [-f] [-v] [-t TYPE]`.
pub struct HelperCall {
    pub source: OsString,
    pub mountpoint: OsString,
    pub options: Vec<String>,
    /// `-v`: say what was mounted, as `plyfs mount` does.
    pub verbose: bool,
}

pub fn parse(argv: &[OsString]) -> Result<HelperCall, String> {
    let mut positional = Vec::new();
    let mut options = Vec::new();
    let mut verbose = false;
    let mut args = argv.iter().skip(1);
    while let Some(a) = args.next() {
        let s = a.to_string_lossy();
        match s.as_ref() {
            "-o" => options.push(args.next().ok_or("-o needs a value")?.to_string_lossy().into_owned()),
            "-t" => {
                args.next();
            }
            "-v" => verbose = true,
            // mount(8)'s own: no mtab, sloppy, fake.
            "-n" | "-s" | "-f" => {}
            o if o.starts_with("-o") => options.push(o[2..].to_owned()),
            _ => positional.push(a.clone()),
        }
    }
    match <[OsString; 2]>::try_from(positional) {
        Ok([source, mountpoint]) => Ok(HelperCall { source, mountpoint, options, verbose }),
        Err(p) => Err(format!(
            "expected `plyfs LOWER MOUNTPOINT -o stack=SPEC[,OPTIONS]` (the form mount(8) uses), got {} operand(s); see `plyfs --help`",
            p.len()
        )),
    }
}

/// Split the comma-separated options, keeping a stack spec's own commas: after `stack=`, what
/// follows belongs to the stack while brackets are open or while it names a layer.
pub fn split_options(options: &[String], layer_kinds: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut in_stack = false;
    let mut depth = 0i32;
    for part in options.iter().flat_map(|o| o.split(',')) {
        let is_layer = {
            let kind = part.split([':', '[', '#']).next().unwrap_or("");
            layer_kinds.contains(&kind)
        };
        if in_stack && (depth > 0 || is_layer) {
            let last = out.last_mut().expect("the stack option came first");
            last.push(',');
            last.push_str(part);
        } else {
            in_stack = part.starts_with("stack=");
            depth = 0;
            out.push(part.to_owned());
        }
        if in_stack {
            depth += part.matches('[').count() as i32 - part.matches(']').count() as i32;
        }
    }
    out.retain(|o| !o.is_empty());
    out
}

/// What the helper does.
#[derive(Debug)]
pub enum Action {
    /// `plyfs mount` with these arguments (after `plyfs mount`).
    Mount(Vec<OsString>),
    /// Change the flags of the file system mounted there.
    Remount { mountpoint: OsString, options: Vec<String> },
}

pub fn translate(call: HelperCall, layer_kinds: &[&str]) -> Result<Action, String> {
    let options = split_options(&call.options, layer_kinds);
    if options.iter().any(|o| o == "remount") {
        return Ok(Action::Remount { mountpoint: call.mountpoint, options });
    }
    // The lower directory, and the name the mount shows for it when that is not the directory.
    let source_dir = options.iter().find_map(|o| o.strip_prefix("source="));
    let given = call.source.to_string_lossy().into_owned();
    let (lower, shown): (OsString, Option<String>) = match (source_dir, given.strip_prefix("source:")) {
        (Some(dir), _) => (dir.into(), Some(given.clone())),
        (None, Some(dir)) => (dir.into(), Some(given.clone())),
        (None, None) => (call.source, None),
    };
    if lower.is_empty() {
        return Err(format!("{given}: names no lower directory"));
    }
    let mut args: Vec<OsString> = vec![lower, call.mountpoint];
    if !call.verbose {
        args.push("--quiet".into());
    }
    let mut rest: Vec<String> = Vec::new();
    if let Some(name) = shown.filter(|_| !options.iter().any(|o| o.starts_with("fsname="))) {
        rest.push(format!("fsname={name}"));
    }
    let options: Vec<String> = options.into_iter().filter(|o| !o.starts_with("source=")).collect();
    let (arguments, mount_options) = arguments_of(options)?;
    args.extend(arguments.into_iter().flat_map(|a| a.argv()));
    rest.extend(mount_options);
    if !rest.is_empty() {
        args.push("-o".into());
        args.push(rest.join(",").into());
    }
    Ok(Action::Mount(args))
}

/// An option that names an argument of `plyfs mount`: `stack=zstd` is `--stack zstd`.
pub struct OptionArgument {
    /// As given in `-o`, for messages.
    pub option: String,
    pub flag: &'static str,
    pub value: Option<String>,
}

impl OptionArgument {
    fn argv(self) -> Vec<OsString> {
        std::iter::once(self.flag.into()).chain(self.value.map(OsString::from)).collect()
    }
}

/// Split options (already split at commas) into those that name arguments of `plyfs mount`
/// and the mount options proper; what only mount(8) and systemd read is dropped.
fn arguments_of(options: Vec<String>) -> Result<(Vec<OptionArgument>, Vec<String>), String> {
    let mut arguments = Vec::new();
    let mut rest = Vec::new();
    for o in options {
        let (key, value) = match o.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (o.as_str(), None),
        };
        if let Some((_, flag)) = ARGUMENTS.iter().find(|(k, _)| *k == key) {
            let v = value.ok_or_else(|| format!("-o {key}: needs a value ({key}=...)"))?.to_owned();
            arguments.push(OptionArgument { flag, value: Some(v), option: o.clone() });
        } else if let Some((_, flag)) = FLAGS.iter().find(|(k, _)| *k == key) {
            arguments.push(OptionArgument { flag, value: None, option: o.clone() });
        } else if !ignored(&o) {
            rest.push(o);
        }
    }
    Ok((arguments, rest))
}

/// Arguments of `plyfs mount` that may be given more than once.
const REPEATABLE: &[&str] = &["--branch", "--exclude"];

/// `plyfs mount ... -o OPTIONS` takes every option the helper form takes, with the same
/// meaning, as mount(8) and fstab users write them: those that name arguments (`stack=`,
/// `passfile=`, `reverse`, ...) become them, what only mount(8) reads (`nofail`, `_netdev`,
/// `defaults`, ...) is dropped, and the rest stay `-o`. `argv` is the command line after
/// `plyfs mount`. An argument given both ways is refused, as two `--stack` would be.
pub fn expand_mount_options(argv: &[OsString], layer_kinds: &[&str]) -> Result<Vec<OsString>, String> {
    let mut others = Vec::new();
    let mut given = Vec::new();
    let mut args = argv.iter();
    while let Some(a) = args.next() {
        let s = a.to_string_lossy();
        match s.strip_prefix("-o") {
            Some("") => match args.next() {
                Some(v) => given.push(v.to_string_lossy().into_owned()),
                None => others.push(a.clone()),
            },
            Some(v) if !s.starts_with("--") => given.push(v.strip_prefix('=').unwrap_or(v).to_owned()),
            _ => others.push(a.clone()),
        }
    }
    if given.is_empty() {
        return Ok(argv.to_vec());
    }
    let (arguments, rest) = arguments_of(split_options(&given, layer_kinds))?;
    for a in &arguments {
        let twice = others.iter().any(|o| o.to_str().is_some_and(|o| o == a.flag || o.strip_prefix(a.flag).is_some_and(|v| v.starts_with('='))));
        if twice && !REPEATABLE.contains(&a.flag) && a.value.is_some() {
            return Err(format!("-o {}: {} is given too; give it once", a.option, a.flag));
        }
    }
    others.extend(arguments.into_iter().flat_map(OptionArgument::argv));
    if !rest.is_empty() {
        others.push("-o".into());
        others.push(rest.join(",").into());
    }
    Ok(others)
}

/// `mount -o remount,...`: set the mount's flags (read-only or not, nosuid, nodev, noexec,
/// noatime) with mount(2), and tell the daemon whether it may write.
pub fn remount(mountpoint: &OsString, options: &[String]) -> Result<(), String> {
    use nix::mount::MsFlags;
    let mut flags = MsFlags::MS_REMOUNT;
    let mut data = Vec::new();
    let mut read_only = false;
    for o in options {
        match o.as_str() {
            "remount" => {}
            "ro" => {
                flags |= MsFlags::MS_RDONLY;
                read_only = true;
            }
            "rw" => read_only = false,
            "nosuid" => flags |= MsFlags::MS_NOSUID,
            "nodev" => flags |= MsFlags::MS_NODEV,
            "noexec" => flags |= MsFlags::MS_NOEXEC,
            "noatime" => flags |= MsFlags::MS_NOATIME,
            "nodiratime" => flags |= MsFlags::MS_NODIRATIME,
            "sync" => flags |= MsFlags::MS_SYNCHRONOUS,
            "dirsync" => flags |= MsFlags::MS_DIRSYNC,
            o if o.starts_with("user_id=") || o.starts_with("group_id=") || o == "default_permissions" || o == "allow_other" => {
                data.push(o.to_owned())
            }
            _ => {}
        }
    }
    let mnt = std::path::Path::new(mountpoint);
    // The daemon first, when it is to stop writing: nothing of its own may land after the
    // kernel's flag; when it may write again, after.
    if read_only {
        tell_daemon(mnt, true)?;
    }
    let data = data.join(",");
    nix::mount::mount(None::<&str>, mnt, None::<&str>, flags, Some(data.as_str())).map_err(|e| {
        if read_only {
            let _ = tell_daemon(mnt, false);
        }
        format!("remount {}: {e}", mnt.display())
    })?;
    if !read_only {
        tell_daemon(mnt, false)?;
    }
    Ok(())
}

fn tell_daemon(mnt: &std::path::Path, read_only: bool) -> Result<(), String> {
    let arg = if read_only { "on" } else { "off" };
    plyfs_fuse::control::call_op(mnt, plyfs_stack::readonly::READ_ONLY_OP, &[arg.to_owned()])
        .map(|_| ())
        .map_err(|e| format!("remount {}: telling the daemon: {e}", mnt.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: &[&str] = &["null", "zstd", "crypt", "union", "mirror", "trace"];

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn stack_specs_keep_their_commas() {
        let o = |s: &str| split_options(&[s.to_owned()], KINDS);
        assert_eq!(o("stack=zstd,crypt,allow_other"), ["stack=zstd,crypt", "allow_other"]);
        assert_eq!(o("stack=trace,zstd,fanin=all"), ["stack=trace,zstd", "fanin=all"]);
        assert_eq!(o("ro,stack=trace:log=/t,null,passfile=/p"), ["ro", "stack=trace:log=/t,null", "passfile=/p"]);
        assert_eq!(o("stack=union[zstd,crypt|null],branch=/b=ro"), ["stack=union[zstd,crypt|null]", "branch=/b=ro"]);
        assert_eq!(o("noexec,stack=null"), ["noexec", "stack=null"]);
    }

    #[test]
    fn mount_fuse3_calls_become_plyfs_mount() {
        let call = parse(&args(&["plyfs", "/l", "/m", "-o", "rw,stack=zstd,crypt,passfile=/p,allow_other,nofail,x-systemd.automount,dev,suid,idle=5m"])).unwrap();
        let Action::Mount(a) = translate(call, KINDS).unwrap() else { panic!() };
        assert_eq!(a, args(&["/l", "/m", "--quiet", "--stack", "zstd,crypt", "--passfile", "/p", "-o", "rw,allow_other,dev,suid,idle=5m"]));
        let call = parse(&args(&["mount.fuse.plyfs", "/l", "/m", "-o", "ro,remount,nosuid,user_id=0"])).unwrap();
        assert!(matches!(translate(call, KINDS).unwrap(), Action::Remount { .. }));
        assert!(parse(&args(&["plyfs", "/l"])).is_err());
        assert!(translate(parse(&args(&["plyfs", "/l", "/m", "-o", "passfile"])).unwrap(), KINDS).unwrap_err().contains("needs a value"));
        assert!(is_helper_form(&args(&["plyfs", "/tmp", "/m", "-o", "stack=null"]), &["mount"]));
        assert!(is_helper_form(&args(&["plyfs", "unix:/run/s", "/m"]), &["mount"]));
        assert!(!is_helper_form(&args(&["plyfs", "mout", "/tmp", "/m"]), &["mount"]), "a typo is not a source");
        assert!(is_helper_form(&args(&["plyfs", "/missing", "/m", "-o", "stack=zstd"]), &["mount"]), "a missing lower is the helper's to report");
        assert!(!is_helper_form(&args(&["plyfs", "mount", "/l", "/m"]), &["mount"]));
        assert!(is_helper_form(&args(&["/sbin/mount.fuse.plyfs", "/l", "/m"]), &["mount"]));
        // mount.fuse3 runs `plyfs TAG MNT -o source=DIR,...` for a tag.
        assert!(is_helper_form(&args(&["plyfs", "scratch", "/m", "-o", "rw,source=/srv/s"]), &["mount"]));
    }

    #[test]
    fn plyfs_mount_takes_the_helpers_options() {
        let expand = |a: &[&str]| expand_mount_options(&args(a), KINDS);
        assert_eq!(
            expand(&["/l", "/m", "-o", "rw,stack=zstd,crypt,passfile=/p,nofail,_netdev,defaults,noexec", "-obranch=/b=ro", "-v"]).unwrap(),
            args(&["/l", "/m", "-v", "--stack", "zstd,crypt", "--passfile", "/p", "--branch", "/b=ro", "-o", "rw,noexec"])
        );
        assert_eq!(expand(&["/l", "/m", "--stack", "null"]).unwrap(), args(&["/l", "/m", "--stack", "null"]));
        assert_eq!(expand(&["/l", "/m", "-o", "reverse,exclude=*.tmp", "--exclude", "x"]).unwrap(), args(&["/l", "/m", "--exclude", "x", "--reverse", "--exclude", "*.tmp"]));
        assert_eq!(expand(&["/l", "/m", "--stack=null", "-o", "stack=zstd"]).unwrap_err(), "-o stack=zstd: --stack is given too; give it once");
        assert!(expand(&["/l", "/m", "-o", "stack"]).unwrap_err().contains("needs a value"));
    }

    #[test]
    fn sources_name_the_lower_as_test_suites_do() {
        let mount = |a: &[&str]| match translate(parse(&args(a)).unwrap(), KINDS).unwrap() {
            Action::Mount(m) => m,
            Action::Remount { .. } => panic!("not a remount"),
        };
        // xfstests: TEST_DEV=source:DIR; the mount shows the source as given.
        assert_eq!(
            mount(&["mount.fuse.plyfs", "source:/srv/t", "/m", "-o", "stack=null,allow_other"]),
            args(&["/srv/t", "/m", "--quiet", "--stack", "null", "-o", "fsname=source:/srv/t,allow_other"])
        );
        // libfuse's examples: a tag, and -o source=DIR.
        assert_eq!(
            mount(&["mount.fuse.plyfs", "test1", "/m", "-o", "source=/srv/t,stack=zstd", "-v"]),
            args(&["/srv/t", "/m", "--stack", "zstd", "-o", "fsname=test1"])
        );
        // A name the user chose stays.
        assert_eq!(
            mount(&["plyfs", "source:/srv/t", "/m", "-o", "fsname=data"]),
            args(&["/srv/t", "/m", "--quiet", "-o", "fsname=data"])
        );
        let empty = translate(parse(&args(&["plyfs", "source:", "/m"])).unwrap(), KINDS).unwrap_err();
        assert_eq!(empty, "source:: names no lower directory");
    }
}
