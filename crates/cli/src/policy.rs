//! `plyfs policy explain PATH` and `plyfs policy apply PATH [-r]`: per-file layer chains, seen
//! and enforced from the command line. Both ask the daemon of the mount PATH is in; the work of
//! `apply` is [`plyfs_assemble::policy::apply`].

use std::path::Path;

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

/// Re-encode PATH (and with `recursive` everything under it) to the current policy, with a
/// bar; each file re-encoded is a line on standard output.
pub fn apply(path: &Path, recursive: bool) -> Result<(), String> {
    let done = plyfs_assemble::policy::apply(path, recursive, &crate::offline::Bar::new())?;
    let mut summary = format!("{} re-encoded, {} already as their policy says", done.changed, done.unchanged);
    if done.gone > 0 {
        summary.push_str(&format!(", {} removed or replaced meanwhile", done.gone));
    }
    if done.leftovers > 0 {
        summary.push_str(&format!(", {} leftovers of an interrupted run removed", done.leftovers));
    }
    println!("{summary}");
    if done.failed.is_empty() {
        Ok(())
    } else {
        Err(format!("{} file(s) not re-encoded (see above); run again to retry", done.failed.len()))
    }
}
