//! `plyfs exodisk`: format, check and serve exodisk volumes.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use plyfs_exodisk::layout;

#[derive(Args)]
pub struct ExodiskArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Format an image file (made if missing) or a block device as a volume, with a new key.
    Format {
        volume: PathBuf,
        /// The volume's size (e.g. 256M, 4G); the whole file or device when not given.
        #[arg(long, value_parser = size)]
        size: Option<u64>,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Check every invariant of a volume (read only); exit status 0 when they all hold.
    Fsck {
        volume: PathBuf,
        #[command(flatten)]
        key: KeyArg,
    },
}

#[derive(Args)]
struct KeyArg {
    /// The volume's key file (VOLUME.key by default). It seals the volume's metadata: keep it
    /// apart from copies of the volume.
    #[arg(long, value_name = "FILE")]
    key: Option<PathBuf>,
}

impl KeyArg {
    fn path(&self, volume: &Path) -> PathBuf {
        self.key.clone().unwrap_or_else(|| layout::default_key_path(volume))
    }
}

fn size(s: &str) -> Result<u64, String> {
    plyfs_stack::glob::parse_size(s).ok_or_else(|| format!("'{s}': expected a size such as 256M or 4G"))
}

pub fn run(args: ExodiskArgs) -> Result<(), String> {
    match args.action {
        Action::Format { volume, size, key } => {
            let key_path = key.path(&volume);
            let f = layout::format(&volume, size, &key_path)?;
            let sb = &f.superblock;
            println!(
                "{}: an exodisk volume of {} sectors ({} MiB); {} sectors for extents and exonodes from sector {}; key in {}",
                volume.display(),
                sb.sectors,
                sb.sectors * 512 >> 20,
                sb.sectors - sb.data_start,
                sb.data_start,
                key_path.display()
            );
            Ok(())
        }
        Action::Fsck { volume, key } => fsck(&volume, &key.path(&volume)),
    }
}

fn fsck(volume: &Path, key_path: &Path) -> Result<(), String> {
    let (disk, key, sb) = layout::open(volume, key_path)?;
    let started = std::time::Instant::now();
    let (_, report, _) = plyfs_exodisk::scan::scan(&disk, &key, &sb).map_err(|e| format!("{}: {e}", volume.display()))?;
    println!(
        "{}: {} extents, {} exonodes, {} of {} sectors owned; {} allocated sectors owned by nothing (a crash leaves these; the service gives them back); scanned in {:.2} s",
        volume.display(),
        report.extents,
        report.exonodes,
        report.owned,
        sb.sectors,
        report.reclaimed,
        started.elapsed().as_secs_f64()
    );
    for p in &report.problems {
        println!("  problem: {p}");
    }
    if report.clean() {
        println!("{}: every invariant holds", volume.display());
        Ok(())
    } else {
        let n = report.problems.len();
        Err(format!("{}: {n} problem{} (listed above)", volume.display(), if n == 1 { "" } else { "s" }))
    }
}
