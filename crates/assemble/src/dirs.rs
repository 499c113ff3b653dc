//! The directories a stack stores in, found and checked before anything is built over them.

use std::path::{Path, PathBuf};

use plyfs_stack::spec::{BranchMode, LayerSpec};
use plyfs_stack::LowerDir;

/// `path` made canonical, if it is a directory; errors read "`what` PATH: cause".
pub fn existing_dir(what: &str, path: &Path) -> crate::Result<PathBuf> {
    let meta = std::fs::metadata(path).map_err(|e| crate::Error::path(what, path, e))?;
    if !meta.is_dir() {
        return Err(crate::Error::path(what, path, "not a directory"));
    }
    path.canonicalize().map_err(|e| crate::Error::path(what, path, e))
}

/// Every directory a stack stores in: LOWER (unless it is `-`), the `--branch` directories and
/// the directories branches name in the spec (`@DIR`), each once, in that order.
pub fn storage_dirs(lower: Option<&Path>, branches: &[String], specs: &[LayerSpec]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = lower.into_iter().map(Path::to_owned).collect();
    dirs.extend(branches.iter().filter_map(|b| crate::tree::parse_branch_arg(b).ok()).map(|(d, _)| d));
    dirs.extend(spec_branch_dirs(specs).into_iter().map(|(d, _)| d));
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        let d = d.canonicalize().unwrap_or(d);
        if !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// The directories the branches of `specs` name (`@DIR`, at any depth), each with its mode.
pub fn spec_branch_dirs(specs: &[LayerSpec]) -> Vec<(PathBuf, BranchMode)> {
    specs
        .iter()
        .flat_map(|s| &s.branches)
        .flat_map(|branch| branch.dir.clone().map(|d| (d, branch.mode())).into_iter().chain(spec_branch_dirs(&branch.layers)))
        .collect()
}

/// Read and check a rules file: every rule's layers must exist and take the parameters given.
pub fn load_rules(path: &Path, lower: &Path) -> crate::Result<plyfs_policy::Rules> {
    let bottom = LowerDir::level(lower).map_err(|e| crate::Error::path("lower directory", lower, e))?;
    plyfs_policy::Rules::load(path, plyfs_policy::rule_checker(crate::registry(), &bottom)).map_err(|e| crate::Error::Spec(e.to_string()))
}
