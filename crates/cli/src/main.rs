//! `plyfs`: mount, unmount and inspect stacks of file-system layers.

mod daemon;
mod exodisk;
mod failure;
mod helper;
mod install;
mod offline;
mod options;
mod policy;
mod secret;
mod serve;
mod stats;
mod status;
mod syslog;
mod table;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use failure::Failure;
use plyfs_assemble::umount::Umounted;
use plyfs_fuse::control;

#[derive(Parser)]
#[command(name = "plyfs", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("PLYFS_COMMIT"), ")"), about = "A user-space stackable file system", propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Mount a stack of layers over LOWER at MOUNTPOINT.
    Mount(daemon::MountArgs),
    /// Export a stack over LOWER to other processes and machines: `plyfs mount ADDR MNT` (or a
    /// `remote` layer) reaches it.
    Serve(serve::ServeArgs),
    /// Run layers in this process for mounts that reach them with `ext:socket=PATH`.
    Host(serve::HostArgs),
    /// Exodisk volumes: a raw volume protected by a small service and managed by libraries.
    Exodisk(exodisk::ExodiskArgs),
    /// Unmount a plyfs mount; also cleans up after a daemon that was killed.
    Umount {
        mountpoint: PathBuf,
        /// Detach now even if files are open; the daemon exits when the last one is closed.
        #[arg(short, long)]
        lazy: bool,
    },
    /// The plyfs mounts of this user (every user's, for root): mount point, lower, stack,
    /// daemon pid, transport, log, and whether the daemon still runs.
    #[command(visible_alias = "list")]
    Status {
        /// Print JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Run an extended operation on a path inside a mounted stack: NAME, or NAME@LAYER to
    /// address one layer.
    Op {
        path: PathBuf,
        /// The operation (e.g. `stats`), or `--list` to list what the stack offers. On a
        /// terminal the answer is drawn as a table; `--json` (among ARGS) keeps it JSON.
        #[arg(allow_hyphen_values = true)]
        name: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// List the available layers with their parameters and extended operations.
    Layers,
    /// Write plain files (a file or a whole tree) in the lower format of a stack, without
    /// mounting: DEST can then be mounted with the same stack.
    Encode {
        src: PathBuf,
        dest: PathBuf,
        #[arg(long, value_name = "SPEC")]
        stack: String,
        #[command(flatten)]
        secret: secret::SecretArgs,
    },
    /// Write the decoded contents of a lower directory (or of --path inside it) to DEST,
    /// without mounting.
    Decode {
        lower: PathBuf,
        dest: PathBuf,
        #[arg(long, value_name = "SPEC")]
        stack: String,
        /// Only this file or directory, relative to LOWER.
        #[arg(long, value_name = "PATH")]
        path: Option<PathBuf>,
        /// A further branch of the stack's fan-out layer, as for `mount`.
        #[arg(long = "branch", value_name = "DIR[=ro|rw]")]
        branches: Vec<String>,
        #[command(flatten)]
        secret: secret::SecretArgs,
    },
    /// Verify every file of a lower directory through a stack, without mounting; damaged
    /// indexes are rebuilt, damaged data is listed.
    Fsck {
        lower: PathBuf,
        #[arg(long, value_name = "SPEC")]
        stack: String,
        /// On a volume made with --bind-paths: bind every file to the place it is at now, before
        /// checking it (after a copy that dropped extended attributes). A file moved or swapped
        /// below is then accepted where it is: use it only on a tree you trust.
        #[arg(long)]
        rebind: bool,
        /// A further branch of the stack's fan-out layer, as for `mount`.
        #[arg(long = "branch", value_name = "DIR[=ro|rw]")]
        branches: Vec<String>,
        #[command(flatten)]
        secret: secret::SecretArgs,
        /// Also show the layers' own log lines (warnings; -vv for more).
        #[arg(short, long, action = clap::ArgAction::Count)]
        verbose: u8,
    },
    /// Decoded size against the space used, for each entry of a directory: inside a mount, or
    /// a lower directory read through --stack.
    Du {
        path: PathBuf,
        #[arg(long, value_name = "SPEC")]
        stack: Option<String>,
        /// A further branch of the stack's fan-out layer, as for `mount`.
        #[arg(long = "branch", value_name = "DIR[=ro|rw]", requires = "stack")]
        branches: Vec<String>,
        #[command(flatten)]
        secret: secret::SecretArgs,
    },
    /// Make LOWER a crypt volume: a random master key, wrapped with a password (asked for, or
    /// --passfile / --extpass) or a key file, in LOWER/.plyfs-crypt.conf.
    Init(secret::InitArgs),
    /// Change the password (or key file) of a crypt volume, without re-encrypting anything.
    Passwd(secret::PasswdArgs),
    /// Per-file layer chains (user.plyfs.layers attributes and the mount's rules).
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// Print the shell completion script for SHELL (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Install the mount(8) helper mount.fuse.plyfs for this plyfs, as the Debian package
    /// does, so that `mount -t fuse.plyfs` and fstab lines find it (for `cargo install`).
    InstallHelper(install::InstallHelperArgs),
    /// Write the manual pages (plyfs.1, plyfs-mount.1, ...) into DIR.
    Manpages {
        #[arg(value_name = "DIR", value_hint = clap::ValueHint::DirPath)]
        dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum PolicyAction {
    /// Which chain applies to a file inside a mount, which attribute or rule decided it, and
    /// the chain its data is encoded with.
    Explain { path: PathBuf },
    /// Re-encode files whose data is encoded with another chain than their policy says:
    /// each file atomically; run again after an interruption to finish.
    Apply {
        path: PathBuf,
        /// Every file under the directory PATH.
        #[arg(short, long)]
        recursive: bool,
    },
}

fn main() -> ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Aliases too (`plyfs list`): a subcommand is never read as a mount helper's LOWER.
    let subcommands: Vec<String> = Cli::command()
        .get_subcommands()
        .flat_map(|c| std::iter::once(c.get_name()).chain(c.get_all_aliases()))
        .map(str::to_owned)
        .chain(["help".to_owned()])
        .collect();
    let names: Vec<&str> = subcommands.iter().map(String::as_str).collect();
    if helper::is_helper_form(&argv, &names) {
        return finish(as_mount_helper(&argv));
    }
    // `plyfs mount -o` takes what the helper form takes (`stack=`, `passfile=`, `nofail`, ...).
    let argv = match argv.get(1).filter(|a| *a == "mount") {
        Some(_) => {
            let kinds: Vec<&str> = plyfs_assemble::registry().iter().map(|f| f.kind).collect();
            match helper::expand_mount_options(&argv[2..], &kinds) {
                Ok(rest) => argv[..2].iter().cloned().chain(rest).collect(),
                Err(e) => return finish(Err(Failure::usage(format!("{e} (see 'plyfs mount --help')")))),
            }
        }
        None => argv,
    };
    let cli = match Cli::try_parse_from(&argv) {
        Ok(cli) => cli,
        Err(e) => return usage_error(e, &argv),
    };
    if matches!(
        cli.command,
        Command::Layers | Command::Status { .. } | Command::Op { .. } | Command::Du { .. } | Command::Policy { action: PolicyAction::Explain { .. } } | Command::Completions { .. }
    ) {
        // Commands that only report end quietly when their reader does (`plyfs layers | head`),
        // as other command-line tools do. Daemons and commands that change things keep SIGPIPE
        // ignored: a closed socket or pipe is an error they handle.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result: Result<(), Failure> = match cli.command {
        Command::Mount(args) => daemon::mount(args),
        Command::Serve(args) => serve::serve(args),
        Command::Host(args) => serve::host(args).map_err(Failure::from),
        Command::Exodisk(args) => exodisk::run(args).map_err(Failure::from),
        Command::Umount { mountpoint, lazy } => umount(&mountpoint, lazy).map_err(Failure::from),
        Command::Status { json } => status::status(json).map_err(Failure::from),
        Command::Op { path, name, args } => op(&path, &name, &args).map_err(Failure::from),
        Command::Layers => {
            print_layers();
            Ok(())
        }
        Command::Encode { src, dest, stack, secret } => offline_run(|| {
            secret::unlock_and_register(&plyfs_assemble::offline::encode_root(&src, &dest), &secret)?;
            offline::encode(&src, &dest, &stack)
        }),
        Command::Decode { lower, dest, stack, path, branches, secret } => offline_run(|| {
            unlock_tree(&lower, &stack, &branches, &secret)?;
            offline::decode(&lower, &dest, &stack, &branches, path.as_deref())
        }),
        Command::Fsck { lower, stack, rebind, branches, secret, verbose } => {
            offline::init_fsck_logging(verbose);
            unlock_tree(&lower, &stack, &branches, &secret).and_then(|()| offline::fsck(&lower, &stack, &branches, rebind))
        }
        Command::Du { path, stack, branches, secret } => offline_run(|| {
            if let Some(stack) = &stack {
                unlock_tree(&path, stack, &branches, &secret)?;
            }
            offline::du(&path, stack.as_deref(), &branches)
        }),
        Command::Init(args) => secret::init(&args),
        Command::Passwd(args) => secret::passwd(&args),
        Command::Policy { action: PolicyAction::Explain { path } } => policy::explain(&path).map_err(Failure::from),
        Command::Policy { action: PolicyAction::Apply { path, recursive } } => policy::apply(&path, recursive).map_err(Failure::from),
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut completion_command(), "plyfs", &mut script);
            std::io::Write::write_all(&mut std::io::stdout(), &script).map_err(|e| Failure::from(format!("writing the script: {e}")))
        }
        Command::Manpages { dir } => manpages(&dir).map_err(Failure::from),
        Command::InstallHelper(args) => install::install_helper(&args),
    };
    finish(result)
}

/// The manual pages: `plyfs.1` and one per subcommand (`plyfs-mount.1`, ...), from the same
/// definitions as `--help`.
fn manpages(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut cli = Cli::command().version(env!("CARGO_PKG_VERSION"));
    cli.build();
    let mut pages = vec![("plyfs".to_owned(), cli.clone())];
    for sub in cli.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
        let name: &'static str = Box::leak(format!("plyfs-{}", sub.get_name()).into_boxed_str());
        let synopsis = synopsis(sub, &format!("plyfs {}", sub.get_name()));
        pages.push((name.to_owned(), sub.clone().name(name).override_usage(synopsis)));
    }
    for (name, cmd) in pages {
        let path = dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        clap_mangen::Man::new(cmd).render(&mut out).map_err(|e| format!("{}: {e}", path.display()))?;
        if name == "plyfs" {
            out.extend_from_slice(MAN_EXTRA.as_bytes());
        }
        std::fs::write(&path, out).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// A manual page's synopsis: every option with its value (`[--stack <SPEC>]`), which
/// clap_mangen's own leaves out (`[--stack]`). `cmd` is built.
fn synopsis(cmd: &clap::Command, name: &str) -> String {
    let value = |a: &clap::Arg| match a.get_value_names() {
        Some(names) => names.iter().map(|n| format!("<{n}>")).collect::<Vec<_>>().join(" "),
        None => format!("<{}>", a.get_id().as_str().to_uppercase()),
    };
    let mut words = vec![name.to_owned()];
    for a in cmd.get_arguments().filter(|a| !a.is_hide_set() && !a.is_positional()) {
        let flag = match (a.get_short(), a.get_long()) {
            (Some(s), Some(l)) => format!("-{s}|--{l}"),
            (Some(s), None) => format!("-{s}"),
            (None, Some(l)) => format!("--{l}"),
            (None, None) => continue,
        };
        let takes_value = a.get_num_args().is_some_and(|n| n.takes_values());
        let word = if takes_value { format!("{flag} {}", value(a)) } else { flag };
        let repeats = matches!(a.get_action(), clap::ArgAction::Append | clap::ArgAction::Count);
        words.push(match (a.is_required_set(), repeats) {
            (true, _) => word,
            (false, false) => format!("[{word}]"),
            (false, true) => format!("[{word}]..."),
        });
    }
    for a in cmd.get_arguments().filter(|a| a.is_positional() && !a.is_hide_set()) {
        let many = a.get_num_args().is_some_and(|n| n.max_values() > 1);
        let word = format!("{}{}", value(a), if many { "..." } else { "" });
        words.push(if a.is_required_set() { word } else { format!("[{word}]") });
    }
    if cmd.has_subcommands() {
        words.push("<COMMAND>".into());
    }
    words.join(" ")
}

/// The command as shell completion sees it: after `--stack`, the names of the layers (the value
/// is parsed as a comma-separated spec, so this is for completion only).
fn completion_command() -> clap::Command {
    fn offer_layers(cmd: clap::Command, kinds: &[&'static str]) -> clap::Command {
        let cmd = cmd.mut_subcommands(|sub| offer_layers(sub, kinds));
        if cmd.get_arguments().any(|a| a.get_id() == "stack") {
            cmd.mut_arg("stack", |a| a.value_parser(clap::builder::PossibleValuesParser::new(kinds.iter().copied())))
        } else {
            cmd
        }
    }
    let kinds: Vec<&'static str> = plyfs_assemble::registry().iter().map(|f| f.kind).chain(["remote"]).collect();
    offer_layers(Cli::command(), &kinds)
}

/// What `plyfs.1` says beyond the options: the mount(8) form, files, where to read more.
const MAN_EXTRA: &str = r#".SH "MOUNT(8) AND FSTAB"
mount \-t fuse.plyfs LOWER MNT \-o stack=SPEC[,OPTIONS] runs
.B plyfs LOWER MNT \-o OPTIONS
through mount.fuse3. Options that name plyfs mount arguments become them (stack=, passfile=, branch=, rules=,
keyfile=, config=, reverse, exclude=); a stack's own commas stay with it. plyfs mount \-o takes the same
options. An /etc/fstab line:
.PP
.nf
/srv/data /mnt/data fuse.plyfs stack=zstd,crypt,passfile=/etc/plyfs/data.pw,nofail 0 0
.fi
.PP
mount \-o remount,ro MNT makes the mount read-only, for the daemon too; umount MNT unmounts it.
.PP
.B plyfs install\-helper
writes /sbin/mount.fuse.plyfs for a plyfs installed with cargo (the Debian package has it).
.SH "EXIT STATUS"
Every error is one line on standard error. Where gocryptfs has a status for the same failure, plyfs uses its
number; a background mount exits with the status its daemon reported.
.TP
.B 0
Success.
.TP
.B 1
Any other failure; the message says what.
.TP
.B 2
Usage: an unknown or missing argument, conflicting options, a bad \-\-stack, \-\-config or \-o option.
.TP
.B 6
LOWER (or a reverse view's plaintext directory) is missing or not a directory.
.TP
.B 8
Not a crypt volume, or its configuration is damaged or unknown.
.TP
.B 10
The mount point is missing, not a directory, not empty (see \-o nonempty), mounted on already, or nested with a
directory the stack stores in.
.TP
.B 12
Wrong password, key file or master key.
.TP
.B 19
The kernel's mount failed (/dev/fuse, mount(2), fusermount3).
.TP
.B 26
fsck found damaged data.
.TP
.B 32
A directory the stack stores in is in use by another mount, server or tool.
.TP
.B 33
The server (unix:, tcp:, exodisk:) cannot be reached or refused the connection.
.SH FILES
.TP
LOWER/.plyfs\-crypt.conf
A crypt volume's settings and wrapped master key.
.TP
PLAIN/.plyfs\-crypt.reverse.conf
The configuration of a reverse view.
.TP
/run/plyfs/
Control sockets and logs of root's mounts (/tmp/plyfs\-UID/ for other users).
.SH "SEE ALSO"
mount(8), fstab(5), fusermount3(1), and the README of plyfs.
"#;

fn finish(result: Result<(), Failure>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("plyfs: {failure}");
            ExitCode::from(failure.code)
        }
    }
}

/// A command line clap cannot parse, in the form of every other error: one line naming what is
/// wrong and where help is, with the usage status. `--help` and `--version` print as usual.
fn usage_error(e: clap::Error, argv: &[std::ffi::OsString]) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand) {
        e.exit();
    }
    finish(Err(one_line_usage(&e, argv)))
}

/// clap's message for `e` on one line: its first line, a suggestion it makes, and the help of
/// the (sub)command `argv` names.
fn one_line_usage(e: &clap::Error, argv: &[std::ffi::OsString]) -> Failure {
    use clap::error::ContextKind;
    use clap::error::ContextValue;
    // The first paragraph (a list of missing arguments follows its first line), on one line.
    let rendered = e.to_string();
    let what: Vec<&str> = rendered.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
    let what = what.join(" ");
    let what = what.trim_start_matches("error: ").trim_end_matches('.');
    let suggested = [ContextKind::SuggestedArg, ContextKind::SuggestedSubcommand, ContextKind::SuggestedValue]
        .into_iter()
        .find_map(|k| match e.get(k)? {
            ContextValue::String(s) => Some(format!("'{s}'")),
            ContextValue::Strings(v) if !v.is_empty() => Some(v.iter().map(|s| format!("'{s}'")).collect::<Vec<_>>().join(" or ")),
            _ => None,
        })
        .map(|s| format!("; did you mean {s}?"))
        .unwrap_or_default();
    // The deepest subcommand the command line names: its help is the one to read.
    let mut command = Cli::command();
    let mut path = vec!["plyfs".to_owned()];
    for arg in argv.iter().skip(1).map(|a| a.to_string_lossy()) {
        let Some(sub) = command.find_subcommand(arg.as_ref()).cloned() else { continue };
        path.push(sub.get_name().to_owned());
        command = sub;
    }
    Failure::usage(format!("{what}{suggested} (see '{} --help')", path.join(" ")))
}

/// `plyfs LOWER MNT -o stack=SPEC,...`, as mount(8) (through mount.fuse3) and fstab call it.
fn as_mount_helper(argv: &[std::ffi::OsString]) -> Result<(), Failure> {
    let kinds: Vec<&str> = plyfs_assemble::registry().iter().map(|f| f.kind).collect();
    match helper::translate(helper::parse(argv).map_err(Failure::usage)?, &kinds).map_err(Failure::usage)? {
        helper::Action::Remount { mountpoint, options } => Ok(helper::remount(&mountpoint, &options)?),
        helper::Action::Mount(args) => {
            let full: Vec<std::ffi::OsString> = ["plyfs".into(), "mount".into()].into_iter().chain(args).collect();
            match Cli::try_parse_from(&full).map_err(|e| one_line_usage(&e, &full))?.command {
                Command::Mount(m) => daemon::mount(m),
                _ => unreachable!("the helper only mounts"),
            }
        }
    }
}

/// Unlock every crypt volume a stack over `lower` (with `--branch` directories) stores in.
fn unlock_tree(lower: &Path, spec: &str, branches: &[String], secret: &secret::SecretArgs) -> Result<(), Failure> {
    let specs = plyfs_stack::spec::parse_stack_spec(spec).map_err(Failure::usage)?;
    secret::unlock_volumes(&plyfs_assemble::dirs::storage_dirs(Some(lower), branches, &specs), secret).map(|_| ())
}

fn offline_run(work: impl FnOnce() -> Result<(), Failure>) -> Result<(), Failure> {
    offline::init_logging();
    work()
}

fn umount(path: &Path, lazy: bool) -> Result<(), String> {
    let shown = plyfs_assemble::umount::mountpoint_path(path)?;
    let shown = shown.display();
    match plyfs_assemble::umount::umount(path, lazy)? {
        Umounted::Done => {}
        Umounted::Lazily => eprintln!("plyfs: {shown} detached; its daemon exits when the last open file is closed"),
        Umounted::Stale { lazily } => {
            if lazily {
                eprintln!("plyfs: {shown} detached; its daemon exits when the last open file is closed");
            }
            eprintln!("plyfs: {shown}: its daemon had died; the stale mount is cleaned up");
        }
    }
    Ok(())
}

fn op(path: &Path, name: &str, args: &[String]) -> Result<(), String> {
    // Answers are drawn for people on a terminal (`stats` as latency histograms, or with
    // --histogram), JSON for scripts and with --json.
    let is_stats = name == "stats" || name.starts_with("stats@");
    let json = args.iter().any(|a| a == "--json");
    let for_people = !json && std::io::IsTerminal::is_terminal(&std::io::stdout());
    let draw = is_stats && !json && (args.iter().any(|a| a == "--histogram") || for_people);
    let args: Vec<String> = args.iter().filter(|a| !(is_stats && *a == "--histogram") && *a != "--json").cloned().collect();
    let args = &args[..];
    // Long operations (a resync, a scrub) report progress: draw it on a terminal.
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut show = |p: &serde_json::Value| {
        let (done, total) = (p["done"].as_u64().unwrap_or(0), p["total"].as_u64().unwrap_or(0));
        let bar = bar.get_or_insert_with(|| {
            let bar = indicatif::ProgressBar::new(total);
            let template = match p["unit"].as_str() {
                Some("bytes") => "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                _ => "{msg} [{bar:30}] {pos}/{len} eta {eta}",
            };
            bar.set_style(indicatif::ProgressStyle::with_template(template).expect("valid template").progress_chars("=> "));
            bar
        });
        bar.set_message(p["label"].as_str().unwrap_or("").to_owned());
        bar.set_length(total.max(done));
        bar.set_position(done);
    };
    let result = control::call_op_with_progress(path, name, args, &mut show);
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let value = result.map_err(|e| if name == "--list" { e } else { format!("op '{name}' on {}: {e}", path.display()) })?;
    if draw && value["ops"].is_object() {
        print!("{}", stats::draw(&value));
        return Ok(());
    }
    if for_people {
        print!("{}", table::draw(&value));
        return Ok(());
    }
    match value {
        serde_json::Value::String(s) => println!("{s}"),
        v => println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default()),
    }
    Ok(())
}

fn print_layers() {
    for f in plyfs_assemble::registry() {
        print_layer(f.kind, f.summary, f.params, f.ext_ops);
    }
    // `remote` is a bottom, built apart from the registry's layers.
    print_layer("remote", plyfs_assemble::lower::REMOTE_SUMMARY, plyfs_assemble::lower::REMOTE_PARAMS, &[]);
    println!("\nEvery mount also answers `op lower-info` (where a file lives in the lower directory).");
}

fn print_layer(kind: &str, summary: &str, params: &[plyfs_stack::spec::ParamSpec], ext_ops: &[plyfs_stack::ExtOpInfo]) {
    println!("{kind:<8} {summary}");
    for p in params.iter().chain([&plyfs_stack::NAME_PARAM]) {
        let default = p.default.map(|d| format!(" (default: {d})")).unwrap_or_default();
        println!("    {}=…{:<width$} {}{default}", p.name, "", p.help, width = 8usize.saturating_sub(p.name.len()));
    }
    for o in ext_ops {
        let args = if o.args.is_empty() { String::new() } else { format!(" {}", o.args) };
        println!("    op {}{args}: {}", o.name, o.help);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every option that takes a value names it (`--stack <SPEC>`), for --help and the manual.
    #[test]
    fn every_option_names_its_value() {
        fn check(cmd: &clap::Command, path: &str) {
            for a in cmd.get_arguments().filter(|a| !a.is_positional() && a.get_num_args().is_some_and(|n| n.takes_values())) {
                assert!(a.get_value_names().is_some(), "{path} --{}: no value_name", a.get_id());
            }
            for sub in cmd.get_subcommands() {
                check(sub, &format!("{path} {}", sub.get_name()));
            }
        }
        let mut cli = Cli::command();
        cli.build();
        check(&cli, "plyfs");
    }
}
