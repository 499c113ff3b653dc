//! The offline tools' output: a progress bar on standard error, the layers' log lines and the
//! tools' notes printed above it, and the tools' summaries. The work is
//! [`plyfs_assemble::offline`]'s.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use plyfs_assemble::offline::{self, Progress};

use crate::failure::{code, Failure};

/// A bar over the bytes of the work, on standard error when it is a terminal.
pub struct Bar(ProgressBar);

impl Bar {
    pub fn new() -> Bar {
        let bar = ProgressBar::hidden();
        bar.set_style(
            ProgressStyle::with_template("{prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        Bar(bar)
    }
}

impl Progress for Bar {
    fn start(&self, what: &str, total: u64) {
        self.0.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        self.0.set_length(total);
        self.0.set_prefix(what.to_owned());
        self.0.enable_steady_tick(Duration::from_millis(200));
        LOG_BAR.with(|b| *b.borrow_mut() = Some(self.0.clone()));
    }
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
    // File names are the tree's, whatever they hold: a newline would split a file's one line,
    // an escape sequence would drive the terminal.
    fn note(&self, line: &str) {
        self.0.suspend(|| eprintln!("plyfs: {}", crate::table::printable(line)));
    }
    fn item(&self, name: &str) {
        self.0.set_message(crate::table::printable(name));
    }
    fn result(&self, line: &str) {
        self.0.suspend(|| println!("{}", crate::table::printable(line)));
    }
    fn finish(&self) {
        self.0.finish_and_clear();
        LOG_BAR.with(|b| *b.borrow_mut() = None);
    }
}

thread_local! {
    static LOG_BAR: std::cell::RefCell<Option<ProgressBar>> = const { std::cell::RefCell::new(None) };
}

/// Logs from the layers (index rebuilt, data lost) go to standard error above the bar.
pub fn init_logging() {
    init_logging_at("warn");
}

/// `fsck` names each damaged file and its cause in one line of its own, so the layers' lines
/// about the same files are shown only when asked for: warnings with `-v`, more with `-vv`
/// (or as `PLYFS_LOG` says).
pub fn init_fsck_logging(verbose: u8) {
    init_logging_at(match verbose {
        0 => "off",
        1 => "warn",
        2 => "info",
        _ => "debug",
    });
}

fn init_logging_at(default: &str) {
    struct AboveBar;
    impl Write for AboveBar {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let bar = LOG_BAR.with(|b| b.borrow().clone());
            match bar {
                Some(bar) => bar.suspend(|| std::io::stderr().write_all(buf)),
                None => std::io::stderr().write_all(buf),
            }?;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            std::io::stderr().flush()
        }
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("PLYFS_LOG").unwrap_or_else(|_| default.into()))
        .with_writer(|| AboveBar)
        .with_ansi(crate::daemon::stderr_wants_colour())
        .without_time()
        .with_target(false)
        .try_init();
}

/// `plyfs encode`.
pub fn encode(src: &Path, dest: &Path, spec: &str) -> Result<(), Failure> {
    let total = offline::encode(src, dest, spec, &Bar::new())?;
    eprintln!("plyfs: encoded {} ({}) into {}", src.display(), human(total), dest.display());
    Ok(())
}

/// `plyfs decode`.
pub fn decode(lower: &Path, dest: &Path, spec: &str, branches: &[String], sub: Option<&Path>) -> Result<(), Failure> {
    let total = offline::decode(lower, dest, spec, branches, sub, &Bar::new())?;
    eprintln!("plyfs: decoded {} into {}", human(total), dest.display());
    Ok(())
}

/// `plyfs fsck`: a line for each damaged file as it is found, then one that sums up; any
/// damage makes the result an error (exit status [`code::FSCK`]).
pub fn fsck(lower: &Path, spec: &str, branches: &[String], rebind: bool) -> Result<(), Failure> {
    let found = offline::fsck(lower, spec, branches, rebind, &Bar::new())?;
    let plain_note = match found.plain {
        0 => String::new(),
        n => format!(" ({n} plain files, which no layer encodes, need no check)"),
    };
    if rebind {
        eprintln!("plyfs: fsck: {} files bound anew to where they are", found.rebound);
    }
    let indexes = match found.repaired {
        1 => "1 index".to_owned(),
        n => format!("{n} indexes"),
    };
    let summary = format!("fsck: {} files checked, {} damaged, {indexes} rebuilt{plain_note}", found.checked, found.damaged.len());
    if found.damaged.is_empty() {
        eprintln!("plyfs: {summary}");
        Ok(())
    } else {
        Err(Failure::new(code::FSCK, summary))
    }
}

/// `plyfs du`: a table of decoded bytes against the space used, with the total.
pub fn du(path: &Path, spec: Option<&str>, branches: &[String]) -> Result<(), Failure> {
    let rows = offline::du(path, spec, branches)?;
    let (decoded, stored) = rows.iter().fold((0, 0), |(a, b), r| (a + r.1, b + r.2));
    println!("{:>10} {:>10} {:>7}  path", "decoded", "stored", "ratio");
    for (name, d, s) in rows.iter().chain(std::iter::once(&("total".to_owned(), decoded, stored))) {
        println!("{:>10} {:>10} {:>7}  {name}", human(*d), human(*s), ratio(*s, *d));
    }
    Ok(())
}

fn ratio(stored: u64, decoded: u64) -> String {
    if decoded == 0 { "-".into() } else { format!("{:.2}", stored as f64 / decoded as f64) }
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "K", "M", "G", "T"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes}B") } else { format!("{v:.1}{}", UNITS[unit]) }
}
