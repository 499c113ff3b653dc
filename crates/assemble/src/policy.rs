//! `plyfs policy apply`: files re-encoded into the chain their policy names, by the daemon of
//! the mount they are in.

use std::fs;
use std::path::{Path, PathBuf};

use plyfs_fuse::control;
use serde_json::Value;

use crate::offline::Progress;
use crate::Error;

/// What [`apply`] did.
#[derive(Debug, Default)]
pub struct Applied {
    /// Files re-encoded.
    pub changed: u64,
    /// Files already in their policy's chain.
    pub unchanged: u64,
    /// Leftovers of an interrupted run, removed.
    pub leftovers: u64,
    /// Files removed or replaced (by a run beside this one) after the walk listed them.
    pub gone: u64,
    /// Files that could not be re-encoded (each was reported to `progress`).
    pub failed: Vec<PathBuf>,
}

/// Re-encode `path` (with `recursive`, every file under it) into its policy's chain. A file is
/// converted whole and atomically; running again after an interruption finishes the job. Each
/// file re-encoded is reported to `progress` as "PATH: FROM -> TO" ([`Progress::result`]), each
/// failure as a note.
pub fn apply(path: &Path, recursive: bool, progress: &dyn Progress) -> crate::Result<Applied> {
    let meta = fs::symlink_metadata(path).map_err(|e| Error::path("", path, e))?;
    let files: Vec<PathBuf> = if meta.is_dir() {
        if !recursive {
            return Err(Error::path("", path, "a directory; use -r to apply the policy to every file under it"));
        }
        let mut files = Vec::new();
        walk(path, &mut files)?;
        files
    } else {
        vec![path.to_owned()]
    };
    let total: u64 = files.iter().filter_map(|f| fs::symlink_metadata(f).ok()).map(|m| m.len()).sum();
    progress.start("re-encoding", total);
    let mut done = Applied::default();
    for f in &files {
        let size = fs::symlink_metadata(f).map(|m| m.len()).unwrap_or(0);
        progress.item(&f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
        match control::call_op(f, "policy-apply", &[]) {
            Ok(v) if v.get("removed_leftover").and_then(Value::as_bool) == Some(true) => done.leftovers += 1,
            Ok(v) if v.get("gone").and_then(Value::as_bool) == Some(true) => done.gone += 1,
            Ok(v) if v.get("changed").and_then(Value::as_bool) == Some(true) => {
                done.changed += 1;
                let from = v.get("from").and_then(Value::as_str).unwrap_or("?");
                let to = v.get("to").and_then(Value::as_str).unwrap_or("?");
                progress.result(&format!("{}: {from} -> {to}", f.display()));
            }
            Ok(_) => done.unchanged += 1,
            // Removed meanwhile: nothing to do.
            Err(e) if e.contains("No such file") => done.gone += 1,
            Err(e) => {
                progress.note(&format!("{}: {e}", f.display()));
                done.failed.push(f.clone());
            }
        }
        progress.advance(size);
    }
    progress.finish();
    Ok(done)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> crate::Result<()> {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .map_err(|e| Error::path("", dir, e))?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        let t = e.file_type().map_err(|err| Error::path("", &p, err))?;
        if t.is_dir() {
            if e.file_name() != plyfs_fuse::LEVELS_DIR {
                walk(&p, out)?;
            }
        } else if t.is_file() {
            out.push(p);
        }
    }
    Ok(())
}
