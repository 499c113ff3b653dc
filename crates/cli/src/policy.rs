//! `plyfs policy explain PATH` and `plyfs policy apply PATH [-r]`: per-file layer chains, seen
//! and enforced from the command line. Both ask the daemon of the mount PATH is in. And the
//! word a mount says about the plain files it found, which `policy apply` encodes.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use plyfs_fuse::control;
use serde_json::Value;

/// Print which chain applies to PATH and why.
pub fn explain(path: &Path) -> Result<(), String> {
    let v = control::call_op(path, "policy-explain", &[]).map_err(|e| format!("{}: {e}", path.display()))?;
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    println!("{}", path.display());
    if s("kind") == "directory" {
        println!("  new files get: {}", s("new_files"));
        println!("  decided by:    {}", s("source"));
        if v.get("rules_apply").and_then(Value::as_bool) == Some(true) {
            println!("  (files matching a rule of the rules file get that rule's layers instead)");
        }
        return Ok(());
    }
    println!("  policy:        {}", s("policy"));
    println!("  decided by:    {}", s("source"));
    println!("  encoded with:  {}  ({})", s("recorded"), s("recorded_by"));
    if v.get("pending").and_then(Value::as_bool) == Some(true) {
        println!("  pending:       `plyfs policy apply` will re-encode it");
    }
    Ok(())
}

/// Re-encode PATH (and with `recursive` everything under it) to the current policy. A file
/// is converted whole and atomically; running again after an interruption finishes the job.
pub fn apply(path: &Path, recursive: bool) -> Result<(), String> {
    let meta = fs::symlink_metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let files: Vec<PathBuf> = if meta.is_dir() {
        if !recursive {
            return Err(format!("{}: a directory; use -r to apply the policy to every file under it", path.display()));
        }
        let mut files = Vec::new();
        walk(path, &mut files)?;
        files
    } else {
        vec![path.to_owned()]
    };
    let total: u64 = files.iter().filter_map(|f| fs::symlink_metadata(f).ok()).map(|m| m.len()).sum();
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("re-encoding [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let (mut changed, mut unchanged, mut failed, mut leftovers) = (0u64, 0u64, Vec::new(), 0u64);
    for f in &files {
        let size = fs::symlink_metadata(f).map(|m| m.len()).unwrap_or(0);
        bar.set_message(f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
        match control::call_op(f, "policy-apply", &[]) {
            Ok(v) if v.get("removed_leftover").and_then(Value::as_bool) == Some(true) => leftovers += 1,
            Ok(v) if v.get("changed").and_then(Value::as_bool) == Some(true) => {
                changed += 1;
                let from = v.get("from").and_then(Value::as_str).unwrap_or("?");
                let to = v.get("to").and_then(Value::as_str).unwrap_or("?");
                bar.suspend(|| println!("{}: {from} -> {to}", f.display()));
            }
            Ok(_) => unchanged += 1,
            // Removed meanwhile (a file deleted, or the temporary copy of a conversion the
            // daemon was finishing when the walk listed it): nothing to do, and nothing to count.
            Err(e) if e.contains("No such file") => {}
            Err(e) => {
                bar.suspend(|| eprintln!("plyfs: {}: {e}", f.display()));
                failed.push(f.clone());
            }
        }
        bar.inc(size);
    }
    bar.finish_and_clear();
    let mut summary = format!("{changed} re-encoded, {unchanged} already as their policy says");
    if leftovers > 0 {
        summary.push_str(&format!(", {leftovers} leftovers of an interrupted run removed"));
    }
    println!("{summary}");
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("{} file(s) not re-encoded (see above); run again to retry", failed.len()))
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        let t = e.file_type().map_err(|err| format!("{}: {err}", p.display()))?;
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
