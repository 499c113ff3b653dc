//! Building a mount's stack, linear or a tree.
//!
//! A linear stack is the mount-wide layers over the per-file policy layer over the lower
//! directory. With a fan-out layer (`union`, `mirror`), the layers above it are the trunk and
//! each branch is built as a mount of its own would be: its directory, a crypt volume's names
//! if it is one, its per-file policy, and the branch's layers as the default chain; or, for a
//! branch that ends in `remote`, its layers over a connection to the server, as a mount of a
//! remote stack.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use plyfs_stack::spec::{BranchMode, BranchSpec, LayerSpec};
use plyfs_stack::{Branch, BranchBuilder, BranchLower, DataPath, Error, LowerDir, Stack};

use crate::lower::Lower;

/// What every branch of a mount shares.
pub struct MountBranches {
    /// Branches may not hold the mount point, nor lie inside it.
    pub mountpoint: Option<PathBuf>,
    /// The mount's rules file, applied in every branch.
    pub rules: Option<PathBuf>,
}

/// A `--branch DIR[=ro|rw]` argument.
pub fn parse_branch_arg(arg: &str) -> crate::Result<(PathBuf, Option<BranchMode>)> {
    match arg.rsplit_once('=') {
        Some((dir, mode)) => match BranchMode::parse(mode) {
            Some(m) if !dir.is_empty() => Ok((PathBuf::from(dir), Some(m))),
            _ => Err(crate::Error::Spec(format!("--branch {arg}: expected DIR, DIR=ro or DIR=rw"))),
        },
        None if arg.is_empty() => Err(crate::Error::Spec("--branch: empty directory".into())),
        None => Ok((PathBuf::from(arg), None)),
    }
}

impl MountBranches {
    fn branch_dir(&self, name: &str, dir: &Path) -> crate::Result<PathBuf> {
        let dir = crate::dirs::existing_dir(&format!("branch '{name}':"), dir)?;
        if let Some(mnt) = &self.mountpoint {
            crate::nesting::check_apart(&format!("branch '{name}'"), &dir, mnt)?;
        }
        Ok(dir)
    }
}

impl BranchBuilder for MountBranches {
    fn build(&self, name: &str, spec: &BranchSpec) -> plyfs_stack::Result<Branch> {
        let in_branch = |e: &dyn std::fmt::Display| Error::config(format!("branch '{name}': {e}"));
        let (layers, remote) = plyfs_stack::spec::split_bottom(&spec.layers, crate::lower::BOTTOM_KINDS).map_err(|e| in_branch(&e))?;
        if let Some(remote) = remote {
            let server = Lower::of_branch(remote).map_err(|e| in_branch(&e))?;
            if decrypts(layers) {
                // Its key would have to be unlocked from the volume's configuration on the
                // server, as `crypt,remote` is before the mount starts.
                return Err(in_branch(&format!(
                    "crypt over a server ({server}) is not supported in a branch: let the server decrypt (plyfs serve --stack crypt), or mount it alone (--stack crypt,remote)"
                )));
            }
            let stack = remote_stack(layers, &server, self.rules.as_deref()).map_err(|e| in_branch(&e))?;
            return Ok(Branch { name: name.to_owned(), lower: BranchLower::Remote { addr: server.to_string() }, mode: spec.mode(), stack: Arc::new(stack) });
        }
        let dir = spec.dir.as_deref().ok_or_else(|| in_branch(&"no directory"))?;
        let dir = self.branch_dir(name, dir).map_err(|e| Error::config(e.to_string()))?;
        let rules = match &self.rules {
            Some(path) => Some(crate::dirs::load_rules(path, &dir).map_err(|e| in_branch(&e))?),
            None => None,
        };
        let stack = linear_stack(layers, rules, &dir, true).map_err(|e| in_branch(&e))?;
        Ok(Branch { name: name.to_owned(), lower: BranchLower::Dir(dir), mode: spec.mode(), stack: Arc::new(stack) })
    }
}

/// The stack of `specs` over the server `lower` reaches.
fn remote_stack(specs: &[LayerSpec], lower: &Lower, rules: Option<&Path>) -> crate::Result<Stack> {
    // Per-file chains and crypt volumes are the server's: its own policy layer keeps the
    // attributes they are recorded in, and refuses them to clients.
    if rules.is_some() {
        return Err(crate::Error::Spec(format!("--rules: per-file rules of a remote stack run on the server (plyfs serve {lower} --rules FILE)")));
    }
    let mut bottom = lower.bottom()?;
    if decrypts(specs) {
        // A crypt volume served as it is stored: its names are decrypted here too.
        bottom = plyfs_layers::crypt::with_names(bottom).map_err(|e| format!("{lower}: {e}"))?;
    }
    Stack::build_over(specs, crate::registry(), vec![bottom]).map_err(|e| crate::Error::Spec(e.to_string()))
}

/// The stack of a lower directory with no fan-out: mount-wide layers, policy, default chain.
fn linear_stack(specs: &[LayerSpec], rules: Option<plyfs_policy::Rules>, lower: &Path, names: bool) -> plyfs_stack::Result<Stack> {
    let bottom = LowerDir::level(lower)?;
    let bottom = if names { plyfs_layers::crypt::with_names(bottom)? } else { bottom };
    plyfs_policy::build_stack(specs, rules, crate::registry(), bottom).map(|(s, _)| s)
}

/// Whether the stack has a crypt layer of its own.
pub(crate) fn decrypts(specs: &[LayerSpec]) -> bool {
    specs.iter().any(|s| s.kind == "crypt")
}

/// `plyfs serve --as-stored`: a linear stack over the directory as it is stored, without the
/// names layer a crypt volume gets otherwise, so that names and contents leave the server
/// encrypted (the server holds no key; its clients decrypt with `--stack crypt,remote`).
pub fn build_stored_stack(specs: &[LayerSpec], lower: &Path, rules: Option<&Path>) -> crate::Result<Stack> {
    if decrypts(specs) {
        return Err(
            "--as-stored serves a crypt volume encrypted, for clients to decrypt: a crypt layer in --stack would need its key here"
                .into(),
        );
    }
    if let Some(s) = specs.iter().find(|s| plyfs_stack::is_fan_out(crate::registry(), &s.kind)) {
        return Err(crate::Error::Spec(format!("--as-stored: layer '{}' fans out; --as-stored serves one directory", s.kind)));
    }
    let rules = rules.map(|r| crate::dirs::load_rules(r, lower)).transpose()?;
    linear_stack(specs, rules, lower, false).map_err(|e| crate::Error::Spec(e.to_string()))
}

/// Build a mount's stack over `lower` (with `--branch` directories for a fan-out layer).
pub fn build_stack(
    specs: &[LayerSpec],
    lower: &Lower,
    branches: &[String],
    rules: Option<&Path>,
    mountpoint: Option<&Path>,
) -> crate::Result<Stack> {
    let lower_dir = match lower {
        Lower::Dir(dir) => Some(dir),
        Lower::Branches { .. } => None,
        Lower::Exodisk(_) => {
            if specs.iter().any(|s| plyfs_stack::is_fan_out(crate::registry(), &s.kind))
                || !branches.is_empty()
                || rules.is_some()
            {
                return Err(crate::Error::Spec(format!("{lower}: fan-out layers and --rules need lower directories")));
            }
            let bottom = lower.bottom()?;
            return Stack::build_over(specs, crate::registry(), vec![bottom]).map_err(|e| crate::Error::Spec(e.to_string()));
        }
        Lower::Remote { .. } => {
            if specs.iter().any(|s| plyfs_stack::is_fan_out(crate::registry(), &s.kind)) || !branches.is_empty() {
                return Err(crate::Error::Spec(format!("{lower}: a fan-out layer over a remote stack is not supported; serve the tree instead (plyfs serve --stack 'union[...]'), or make the server a branch (plyfs mount - MNT --stack 'mirror[@DIR | remote:addr={lower}]')")));
            }
            return remote_stack(specs, lower, rules);
        }
    };
    let registry = crate::registry();
    let cli = branches.iter().map(|b| parse_branch_arg(b)).collect::<Result<Vec<_>, _>>()?;
    let mut specs = specs.to_vec();
    plyfs_stack::assign_branch_dirs(&mut specs, registry, crate::lower::BOTTOM_KINDS, lower_dir.cloned(), cli).map_err(|e| crate::Error::Spec(e.to_string()))?;
    let Some(pos) = specs.iter().position(|s| plyfs_stack::is_fan_out(registry, &s.kind)) else {
        // (Lower::parse gives `-` only to a stack with a fan-out layer.)
        let lower = lower_dir.ok_or_else(|| format!("{lower}: a stack without a fan-out layer needs LOWER"))?;
        let rules = rules.map(|r| crate::dirs::load_rules(r, lower)).transpose()?;
        return linear_stack(&specs, rules, lower, true).map_err(|e| crate::Error::Spec(e.to_string()));
    };
    let (trunk, fan) = (&specs[..pos], &specs[pos]);
    if let Some(below) = specs.get(pos + 1) {
        return Err(crate::Error::Spec(format!(
            "layer '{}' sits below the fan-out layer '{}': layers below a fan-out layer go in its branches ({}[{}|...])",
            below.kind, fan.kind, fan.kind, below.kind
        )));
    }
    let builder = Arc::new(MountBranches { mountpoint: mountpoint.map(Path::to_owned), rules: rules.map(Path::to_owned) });
    let fan_name = fan.params.iter().find(|(k, _)| k == "name").map_or(fan.kind.as_str(), |(_, v)| v.as_str());
    let fan_level = Stack::build_fan_out(fan, fan_name, registry, builder).map_err(|e| crate::Error::Spec(e.to_string()))?;
    let stack = Stack::build_over(trunk, registry, vec![fan_level]).map_err(|e| crate::Error::Spec(e.to_string()))?;
    if let Some(l) = stack.layers().iter().find(|l| l.layer().data_path() == DataPath::Transforms) {
        return Err(crate::Error::Spec(format!(
            "layer '{}' transforms data, so it cannot sit above the fan-out layer '{}': put it in the branches ({}[{}|{}])",
            l.name(),
            fan_name,
            fan.kind,
            l.layer().kind(),
            l.layer().kind()
        )));
    }
    Ok(stack)
}

#[cfg(test)]
mod tests {
    use super::build_stack;
    use crate::lower::Lower;

    /// What building `spec` over a fresh LOWER says is wrong.
    fn refusal(spec: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        let specs = plyfs_stack::spec::parse_stack_spec(spec).unwrap();
        match build_stack(&specs, &Lower::Dir(dir.path().to_owned()), &[], None, None) {
            Ok(_) => panic!("{spec}: built"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_branch_on_a_server_is_refused_in_one_line_naming_it() {
        let err = refusal("mirror[|remote:addr=unix:/nonexistent/plyfs.sock]");
        assert!(err.starts_with("branch 'mirror.1': unix:/nonexistent/plyfs.sock: connecting: "), "{err}");
        assert!(!err.contains('\n'), "{err}");
        assert_eq!(
            refusal("mirror[|remote:addr=unix:/s.sock@/srv/b]"),
            "layer 'mirror', branch 1: a branch that ends in 'remote' stands on its server and takes no directory (@/srv/b)"
        );
        assert_eq!(refusal("union[|remote]"), "branch 'union.1': layer 'remote' needs an address: remote:addr=unix:PATH or tcp:HOST:PORT");
        assert_eq!(refusal("union[|remote:addr=tcp:nas:7070]"), "branch 'union.1': tcp:nas:7070: a TCP server needs its key: remote:psk=FILE");
        assert!(refusal("mirror[|crypt,remote:addr=unix:/s.sock]").starts_with("branch 'mirror.1': crypt over a server (unix:/s.sock) is not supported in a branch"));
    }
}
