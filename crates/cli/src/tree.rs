//! Building a mount's stack, linear or a tree.
//!
//! A linear stack is the mount-wide layers over the per-file policy layer over the lower
//! directory. With a fan-out layer (`union`, `mirror`), the layers above it are the trunk and
//! each branch is built as a mount of its own would be: its directory, a crypt volume's names
//! if it is one, its per-file policy, and the branch's layers as the default chain.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use plyfs_stack::spec::{BranchMode, BranchSpec, LayerSpec};
use plyfs_stack::{Branch, BranchBuilder, DataPath, Error, Level, LowerDir, Stack};
use plyfs_transport::Addr;

/// What a stack stands on: a lower directory, a stack served elsewhere (`remote`), or exofs on
/// an exodisk service (`exodisk:SOCKET`).
#[derive(Clone, Debug)]
pub enum Lower {
    Dir(PathBuf),
    Exodisk(PathBuf),
    Remote { addr: Addr, name: String, timeout: Duration, psk: Option<PathBuf>, sync: bool },
}

/// How long a `remote` layer waits for its server (reconnecting included) before `EIO`.
const REMOTE_TIMEOUT: Duration = Duration::from_secs(60);

impl Lower {
    /// LOWER as given on the command line, with the stack's `remote` layer if it ends in one
    /// (which is taken out of `specs`: it is the bottom, not a layer above it).
    /// `psk` is the key file given with `--psk`, for a TCP server.
    pub fn parse(arg: &Path, specs: &mut Vec<LayerSpec>, psk: Option<&Path>) -> Result<Lower, String> {
        if let Some(i) = specs.iter().position(|s| s.kind == "remote") {
            if i + 1 != specs.len() {
                return Err("layer 'remote' is a bottom layer: it must come last in the stack".into());
            }
        }
        if let Some(socket) = arg.to_str().and_then(|a| a.strip_prefix("exodisk:")) {
            if specs.iter().any(|s| s.kind == "remote") {
                return Err("exodisk:SOCKET is the bottom: no 'remote' layer over it".into());
            }
            return Ok(Lower::Exodisk(PathBuf::from(socket)));
        }
        let given = arg.to_str().and_then(Addr::parse).transpose()?;
        let remote = match specs.last() {
            Some(s) if s.kind == "remote" => specs.pop(),
            _ => None,
        };
        let Some(spec) = remote else {
            return match given {
                Some(addr) => Ok(Lower::Remote {
                    addr,
                    name: "remote".into(),
                    timeout: REMOTE_TIMEOUT,
                    psk: psk.map(Path::to_owned),
                    sync: false,
                }),
                None => crate::daemon::existing_dir("lower directory", arg).map(Lower::Dir),
            };
        };
        let mut addr = None;
        let mut name = "remote".to_owned();
        let mut timeout = REMOTE_TIMEOUT;
        let mut psk = psk.map(Path::to_owned);
        let mut sync = false;
        for (k, v) in &spec.params {
            match k.as_str() {
                "psk" => psk = Some(PathBuf::from(v)),
                "addr" => {
                    addr =
                        Some(Addr::parse(v).unwrap_or_else(|| Err(format!("remote: addr={v}: expected unix:PATH or tcp:HOST:PORT")))?)
                }
                "name" => name = v.clone(),
                "sync" => {
                    sync = match v.as_str() {
                        "on" => true,
                        "off" => false,
                        _ => return Err(format!("remote: sync={v}: expected on or off")),
                    }
                }
                "timeout" => {
                    let secs: f64 =
                        v.parse().ok().filter(|s: &f64| *s > 0.0).ok_or_else(|| format!("remote: timeout={v}: expected seconds"))?;
                    timeout = Duration::from_secs_f64(secs);
                }
                _ => return Err(format!("layer 'remote': unknown parameter '{k}' (known: addr, psk, timeout, sync, name)")),
            }
        }
        let addr = match (addr, given) {
            (Some(a), None) if arg == Path::new("-") => a,
            (Some(a), Some(g)) if a == g => a,
            (None, Some(g)) => g,
            (Some(a), _) => {
                return Err(format!("the stack ends in remote:addr={a}, so LOWER must be '-' or that address, not {}", arg.display()))
            }
            (None, None) => {
                return Err(format!(
                    "layer 'remote' needs an address: LOWER unix:PATH or tcp:HOST:PORT, or remote:addr=..., not {}",
                    arg.display()
                ))
            }
        };
        Ok(Lower::Remote { addr, name, timeout, psk, sync })
    }

    /// The bottom level: the directory's, or a connection to the server.
    pub fn bottom(&self) -> Result<Level, String> {
        match self {
            Lower::Dir(dir) => LowerDir::level(dir).map_err(|e| e.to_string()),
            Lower::Exodisk(socket) => {
                let client = plyfs_exodisk::client::Client::connect(socket, 32 << 20)?;
                let fs = plyfs_exofs::fs::Fs::open(client, "exofs").map_err(|e| format!("exodisk:{}: {e}", socket.display()))?;
                Ok(plyfs_exofs::layer::Exofs::new("exofs", fs).level())
            }
            Lower::Remote { addr, name, timeout, psk, sync } => {
                let connector = crate::serve::connector(addr, psk.as_deref())?;
                let remote = plyfs_transport::Remote::connect(name, connector, *timeout).map_err(|e| format!("{addr}: {e}"))?;
                Ok(remote.sync_writes(*sync).level())
            }
        }
    }

    /// The configuration of the crypt volume a remote stack is stored in, read through the
    /// server, when the server serves it as stored and `specs` decrypt it here
    /// (`--stack crypt,remote`). `None` for anything else.
    pub fn remote_volume(&self, specs: &[LayerSpec]) -> Result<Option<crate::secret::FoundVolume>, String> {
        if !matches!(self, Lower::Remote { .. }) || !decrypts(specs) {
            return Ok(None);
        }
        let bottom = self.bottom()?;
        let config = plyfs_layers::crypt::config_below(&bottom).map_err(|e| format!("{self}: {e}"));
        bottom.layer().shutdown();
        let name = format!("the crypt volume served at {self}");
        Ok(config?.map(|c| (name.clone(), name, c)))
    }

    pub fn dir(&self) -> Option<&Path> {
        match self {
            Lower::Dir(d) => Some(d),
            Lower::Remote { .. } | Lower::Exodisk(_) => None,
        }
    }
}

impl std::fmt::Display for Lower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lower::Dir(d) => write!(f, "{}", d.display()),
            Lower::Remote { addr, .. } => write!(f, "{addr}"),
            Lower::Exodisk(socket) => write!(f, "exodisk:{}", socket.display()),
        }
    }
}

/// What every branch of a mount shares.
pub struct MountBranches {
    /// Branches may not hold the mount point, nor lie inside it.
    pub mountpoint: Option<PathBuf>,
    /// The mount's rules file, applied in every branch.
    pub rules: Option<PathBuf>,
}

/// A `--branch DIR[=ro|rw]` argument.
pub fn parse_branch_arg(arg: &str) -> Result<(PathBuf, Option<BranchMode>), String> {
    match arg.rsplit_once('=') {
        Some((dir, mode)) => match BranchMode::parse(mode) {
            Some(m) if !dir.is_empty() => Ok((PathBuf::from(dir), Some(m))),
            _ => Err(format!("--branch {arg}: expected DIR, DIR=ro or DIR=rw")),
        },
        None if arg.is_empty() => Err("--branch: empty directory".into()),
        None => Ok((PathBuf::from(arg), None)),
    }
}

impl MountBranches {
    fn branch_dir(&self, name: &str, dir: &Path) -> Result<PathBuf, String> {
        let dir = crate::daemon::existing_dir(&format!("branch '{name}':"), dir)?;
        if let Some(mnt) = &self.mountpoint {
            crate::nesting::check_apart(&format!("branch '{name}'"), &dir, mnt)?;
        }
        Ok(dir)
    }
}

impl BranchBuilder for MountBranches {
    fn build(&self, name: &str, spec: &BranchSpec) -> plyfs_stack::Result<Branch> {
        let dir = spec.dir.as_deref().ok_or_else(|| Error::config(format!("branch '{name}': no directory")))?;
        let dir = self.branch_dir(name, dir).map_err(Error::Config)?;
        let rules = match &self.rules {
            Some(path) => Some(crate::daemon::load_rules(path, &dir).map_err(|e| Error::config(format!("branch '{name}': {e}")))?),
            None => None,
        };
        let stack = linear_stack(&spec.layers, rules, &dir, true).map_err(|e| Error::config(format!("branch '{name}': {e}")))?;
        Ok(Branch { name: name.to_owned(), dir, mode: spec.mode(), stack: Arc::new(stack) })
    }
}

/// The stack of a lower directory with no fan-out: mount-wide layers, policy, default chain.
fn linear_stack(specs: &[LayerSpec], rules: Option<plyfs_policy::Rules>, lower: &Path, names: bool) -> plyfs_stack::Result<Stack> {
    let bottom = LowerDir::level(lower)?;
    let bottom = if names { plyfs_layers::crypt::with_names(bottom)? } else { bottom };
    plyfs_policy::build_stack(specs, rules, plyfs_layers::registry(), bottom).map(|(s, _)| s)
}

/// Whether the stack has a crypt layer of its own.
fn decrypts(specs: &[LayerSpec]) -> bool {
    specs.iter().any(|s| s.kind == "crypt")
}

/// `plyfs serve --as-stored`: a linear stack over the directory as it is stored, without the
/// names layer a crypt volume gets otherwise, so that names and contents leave the server
/// encrypted (the server holds no key; its clients decrypt with `--stack crypt,remote`).
pub fn build_stored_stack(specs: &[LayerSpec], lower: &Path, rules: Option<&Path>) -> Result<Stack, String> {
    if decrypts(specs) {
        return Err(
            "--as-stored serves a crypt volume encrypted, for clients to decrypt: a crypt layer in --stack would need its key here"
                .into(),
        );
    }
    if let Some(s) = specs.iter().find(|s| plyfs_stack::is_fan_out(plyfs_layers::registry(), &s.kind)) {
        return Err(format!("--as-stored: layer '{}' fans out; --as-stored serves one directory", s.kind));
    }
    let rules = rules.map(|r| crate::daemon::load_rules(r, lower)).transpose()?;
    linear_stack(specs, rules, lower, false).map_err(|e| e.to_string())
}

/// Build a mount's stack over `lower` (with `--branch` directories for a fan-out layer).
pub fn build_stack(
    specs: &[LayerSpec],
    lower: &Lower,
    branches: &[String],
    rules: Option<&Path>,
    mountpoint: Option<&Path>,
) -> Result<Stack, String> {
    let lower = match lower {
        Lower::Dir(dir) => dir,
        Lower::Exodisk(_) => {
            if specs.iter().any(|s| plyfs_stack::is_fan_out(plyfs_layers::registry(), &s.kind))
                || !branches.is_empty()
                || rules.is_some()
            {
                return Err(format!("{lower}: fan-out layers and --rules need lower directories"));
            }
            let bottom = lower.bottom()?;
            return Stack::build_over(specs, plyfs_layers::registry(), vec![bottom]).map_err(|e| e.to_string());
        }
        Lower::Remote { .. } => {
            if specs.iter().any(|s| plyfs_stack::is_fan_out(plyfs_layers::registry(), &s.kind)) || !branches.is_empty() {
                return Err(format!("{lower}: a fan-out layer over a remote stack is not supported; serve the tree instead (plyfs serve --stack 'union[...]')"));
            }
            // Per-file chains and crypt volumes are the server's: its own policy layer keeps
            // the attributes they are recorded in, and refuses them to clients.
            if rules.is_some() {
                return Err(format!("--rules: per-file rules of a remote stack run on the server (plyfs serve {lower} --rules FILE)"));
            }
            let mut bottom = lower.bottom()?;
            if decrypts(specs) {
                // A crypt volume served as it is stored: its names are decrypted here too.
                bottom = plyfs_layers::crypt::with_names(bottom).map_err(|e| format!("{lower}: {e}"))?;
            }
            return Stack::build_over(specs, plyfs_layers::registry(), vec![bottom]).map_err(|e| e.to_string());
        }
    };
    let registry = plyfs_layers::registry();
    let cli = branches.iter().map(|b| parse_branch_arg(b)).collect::<Result<Vec<_>, _>>()?;
    let mut specs = specs.to_vec();
    plyfs_stack::assign_branch_dirs(&mut specs, registry, lower.to_owned(), cli).map_err(|e| e.to_string())?;
    let Some(pos) = specs.iter().position(|s| plyfs_stack::is_fan_out(registry, &s.kind)) else {
        let rules = rules.map(|r| crate::daemon::load_rules(r, lower)).transpose()?;
        return linear_stack(&specs, rules, lower, true).map_err(|e| e.to_string());
    };
    let (trunk, fan) = (&specs[..pos], &specs[pos]);
    if let Some(below) = specs.get(pos + 1) {
        return Err(format!(
            "layer '{}' sits below the fan-out layer '{}': layers below a fan-out layer go in its branches ({}[{}|...])",
            below.kind, fan.kind, fan.kind, below.kind
        ));
    }
    let builder = Arc::new(MountBranches { mountpoint: mountpoint.map(Path::to_owned), rules: rules.map(Path::to_owned) });
    let fan_name = fan.params.iter().find(|(k, _)| k == "name").map_or(fan.kind.as_str(), |(_, v)| v.as_str());
    let fan_level = Stack::build_fan_out(fan, fan_name, registry, builder).map_err(|e| e.to_string())?;
    let stack = Stack::build_over(trunk, registry, vec![fan_level]).map_err(|e| e.to_string())?;
    if let Some(l) = stack.layers().iter().find(|l| l.layer().data_path() == DataPath::Transforms) {
        return Err(format!(
            "layer '{}' transforms data, so it cannot sit above the fan-out layer '{}': put it in the branches ({}[{}|{}])",
            l.name(),
            fan_name,
            fan.kind,
            l.layer().kind(),
            l.layer().kind()
        ));
    }
    Ok(stack)
}
