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
    fn note(&self, line: &str) {
        self.0.suspend(|| eprintln!("plyfs: {line}"));
    }
    fn item(&self, name: &str) {
        self.0.set_message(name.to_owned());
    }
    fn result(&self, line: &str) {
        self.0.suspend(|| println!("{line}"));
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
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("PLYFS_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(|| AboveBar)
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

/// `plyfs fsck`: the damaged files are listed as they are found; any makes the result an error.
pub fn fsck(lower: &Path, spec: &str, branches: &[String], rebind: bool) -> Result<(), Failure> {
    let found = offline::fsck(lower, spec, branches, rebind, &Bar::new())?;
    let (checked, plain, repaired) = (found.checked, found.plain, found.repaired);
    let plain_note = if plain > 0 { format!(" ({plain} plain files, which no layer encodes, need no check)") } else { String::new() };
    if rebind {
        eprintln!("plyfs: fsck: {} files bound anew to where they are", found.rebound);
    }
    if found.damaged.is_empty() {
        let repaired_note = if repaired > 0 { format!(", {repaired} of them after rebuilding the index") } else { String::new() };
        eprintln!("plyfs: fsck: {checked} files checked, all sound{repaired_note}{plain_note}");
        Ok(())
    } else {
        Err(Failure::new(code::FSCK, format!("fsck: {} of {checked} files have damaged data (listed above){plain_note}", found.damaged.len())))
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
