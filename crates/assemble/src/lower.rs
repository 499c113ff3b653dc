//! What a stack stands on: a lower directory, exofs on an exodisk service, or a stack served
//! elsewhere, which a `remote` layer at the bottom of the stack reaches.

use std::path::{Path, PathBuf};
use std::time::Duration;

use plyfs_stack::spec::{LayerSpec, ParamSpec};
use plyfs_stack::{Level, LowerDir};
use plyfs_transport::tls::{Psk, TlsConnector};
use plyfs_transport::{Addr, Connector, PlainConnector};

/// What a stack stands on: a lower directory, a stack served elsewhere (`remote`), exofs on an
/// exodisk service (`exodisk:SOCKET`), or, with LOWER `-`, whatever its fan-out layer's branches
/// say they stand on.
#[derive(Clone, Debug)]
pub enum Lower {
    Dir(PathBuf),
    Exodisk(PathBuf),
    Remote { addr: Addr, name: String, timeout: Duration, psk: Option<PathBuf>, sync: bool },
    /// No LOWER: every branch names its directory (`@DIR`, `--branch`) or its server
    /// (`remote:addr=...`); `places` are those, in order, for messages and `plyfs status`.
    Branches { places: Vec<String> },
}

/// How long a `remote` layer waits for its server (reconnecting included) before `EIO`.
const REMOTE_TIMEOUT: Duration = Duration::from_secs(60);

/// The layers that are not in the registry because the assembly makes them, at the bottom of a
/// stack: a configuration file may name them.
pub const BOTTOM_KINDS: &[&str] = &["remote"];

/// The `remote` layer is a bottom, built here rather than from the registry: what `plyfs
/// layers` says of it, and the parameters [`Lower::parse`] and [`Lower::of_branch`] take
/// (besides `name`).
pub const REMOTE_SUMMARY: &str = "the bottom of a stack, or of a branch, served elsewhere (plyfs serve): operations go to the server over a Unix socket or TLS";
pub const REMOTE_PARAMS: &[ParamSpec] = &[
    ParamSpec { name: "addr", help: "the server, unix:PATH or tcp:HOST:PORT (or give it as LOWER)", default: None },
    ParamSpec { name: "psk", help: "the pre-shared key file of a tcp: server (as --psk)", default: None },
    ParamSpec { name: "timeout", help: "seconds to wait for the server, reconnecting included, before EIO", default: Some("60") },
    ParamSpec { name: "sync", help: "on: every write waits for the server's reply (as NFS's sync)", default: Some("off") },
];

/// The parameters of a `remote` layer: its server's address, if it names one, and how to reach
/// it.
struct RemoteParams {
    addr: Option<Addr>,
    name: String,
    timeout: Duration,
    psk: Option<PathBuf>,
    sync: bool,
}

impl RemoteParams {
    /// `spec`'s parameters; `psk` is the key file given with `--psk`, which `psk=` overrides.
    fn parse(spec: &LayerSpec, psk: Option<&Path>) -> crate::Result<RemoteParams> {
        let mut params =
            RemoteParams { addr: None, name: "remote".to_owned(), timeout: REMOTE_TIMEOUT, psk: psk.map(Path::to_owned), sync: false };
        for (k, v) in &spec.params {
            match k.as_str() {
                "psk" => params.psk = Some(PathBuf::from(v)),
                "addr" => {
                    params.addr =
                        Some(Addr::parse(v).unwrap_or_else(|| Err(format!("remote: addr={v}: expected unix:PATH or tcp:HOST:PORT"))).map_err(crate::Error::Spec)?)
                }
                "name" => params.name = v.clone(),
                "sync" => {
                    params.sync = match v.as_str() {
                        "on" => true,
                        "off" => false,
                        _ => return Err(crate::Error::Spec(format!("remote: sync={v}: expected on or off"))),
                    }
                }
                "timeout" => {
                    let secs: f64 =
                        v.parse().ok().filter(|s: &f64| *s > 0.0).ok_or_else(|| format!("remote: timeout={v}: expected seconds"))?;
                    params.timeout = Duration::from_secs_f64(secs);
                }
                _ => {
                    let known: Vec<&str> = REMOTE_PARAMS.iter().chain([&plyfs_stack::NAME_PARAM]).map(|p| p.name).collect();
                    return Err(crate::Error::Spec(format!("layer 'remote': unknown parameter '{k}' (known: {})", known.join(", "))));
                }
            }
        }
        Ok(params)
    }

    fn at(self, addr: Addr) -> Lower {
        Lower::Remote { addr, name: self.name, timeout: self.timeout, psk: self.psk, sync: self.sync }
    }
}

impl Lower {
    /// LOWER as given on the command line, with the stack's `remote` layer if it ends in one
    /// (which is taken out of `specs`: it is the bottom, not a layer above it), and the
    /// `--branch` arguments (for LOWER `-`). `psk` is the key file given with `--psk`, for a
    /// TCP server.
    pub fn parse(arg: &Path, specs: &mut Vec<LayerSpec>, branches: &[String], psk: Option<&Path>) -> crate::Result<Lower> {
        let remote = plyfs_stack::spec::split_bottom(specs, BOTTOM_KINDS).map_err(|e| crate::Error::Spec(e.to_string()))?.1.cloned();
        if let Some(socket) = arg.to_str().and_then(|a| a.strip_prefix("exodisk:")) {
            if remote.is_some() {
                return Err(crate::Error::Spec("exodisk:SOCKET is the bottom: no 'remote' layer over it".into()));
            }
            return Ok(Lower::Exodisk(PathBuf::from(socket)));
        }
        let given = arg.to_str().and_then(Addr::parse).transpose().map_err(crate::Error::Spec)?;
        if remote.is_none() && arg == Path::new("-") {
            return Lower::of_branches(specs, branches);
        }
        let Some(spec) = remote else {
            return match given {
                Some(addr) => Ok(Lower::Remote {
                    addr,
                    name: "remote".into(),
                    timeout: REMOTE_TIMEOUT,
                    psk: psk.map(Path::to_owned),
                    sync: false,
                }),
                None => crate::dirs::existing_dir("lower directory", arg).map(Lower::Dir),
            };
        };
        specs.pop();
        let params = RemoteParams::parse(&spec, psk)?;
        let addr = match (params.addr.clone(), given) {
            (Some(a), None) if arg == Path::new("-") => a,
            (Some(a), Some(g)) if a == g => a,
            (None, Some(g)) => g,
            (Some(a), _) => {
                return Err(crate::Error::Spec(format!("the stack ends in remote:addr={a}, so LOWER must be '-' or that address, not {}", arg.display())))
            }
            (None, None) => {
                return Err(crate::Error::Spec(format!(
                    "layer 'remote' needs an address: LOWER unix:PATH or tcp:HOST:PORT, or remote:addr=..., not {}",
                    arg.display()
                )))
            }
        };
        Ok(params.at(addr))
    }

    /// LOWER `-` without a `remote` layer: the stack's fan-out layer, which must be there, says
    /// where each branch stands, with the `--branch` directories (checked here, before a mount
    /// goes to the background).
    fn of_branches(specs: &[LayerSpec], branches: &[String]) -> crate::Result<Lower> {
        let registry = crate::registry();
        let is_fan_out = |s: &&LayerSpec| plyfs_stack::is_fan_out(registry, &s.kind);
        if !specs.iter().any(|s| is_fan_out(&s)) {
            return Err(crate::Error::Spec(
                "LOWER '-' needs a stack that says where it stands: one that ends in remote:addr=..., or a fan-out layer whose branches each name a directory (@DIR, --branch) or a server (remote:addr=...)".into(),
            ));
        }
        let cli = branches.iter().map(|b| crate::tree::parse_branch_arg(b)).collect::<crate::Result<Vec<_>>>()?;
        let mut placed = specs.to_vec();
        plyfs_stack::assign_branch_dirs(&mut placed, registry, BOTTOM_KINDS, None, cli).map_err(|e| crate::Error::Spec(e.to_string()))?;
        let fan = placed.iter().find(is_fan_out).expect("a fan-out layer, checked above");
        let places = fan
            .branches
            .iter()
            .map(|b| match b.bottom(BOTTOM_KINDS) {
                Ok(Some(remote)) => remote.params.iter().find(|(k, _)| k == "addr").map_or("remote".to_owned(), |(_, addr)| addr.clone()),
                _ => b.dir.as_ref().map_or(String::new(), |d| d.display().to_string()),
            })
            .collect();
        Ok(Lower::Branches { places })
    }

    /// The server a fan-out layer's branch stands on when its layers end in `remote`
    /// (`mirror[@/a | remote:addr=unix:/run/s.sock]`), which names it with `addr=`, and its key
    /// with `psk=` (`--psk` is LOWER's).
    pub fn of_branch(remote: &LayerSpec) -> crate::Result<Lower> {
        let params = RemoteParams::parse(remote, None)?;
        match params.addr.clone() {
            Some(addr @ Addr::Tcp(_)) if params.psk.is_none() => {
                Err(crate::Error::Spec(format!("{addr}: a TCP server needs its key: remote:psk=FILE")))
            }
            Some(addr) => Ok(params.at(addr)),
            None => Err(crate::Error::Spec("layer 'remote' needs an address: remote:addr=unix:PATH or tcp:HOST:PORT".into())),
        }
    }

    /// The bottom level: the directory's, or a connection to the server.
    pub fn bottom(&self) -> crate::Result<Level> {
        match self {
            Lower::Branches { .. } => Err(crate::Error::Spec(format!("{self}: a tree's branches are its bottoms"))),
            Lower::Dir(dir) => LowerDir::level(dir).map_err(|e| crate::Error::Spec(e.to_string())),
            Lower::Exodisk(socket) => {
                let client = plyfs_exodisk::client::Client::connect(socket, 32 << 20)?;
                let fs = plyfs_exofs::fs::Fs::open(client, "exofs")?;
                Ok(plyfs_exofs::layer::Exofs::new("exofs", fs).level())
            }
            Lower::Remote { addr, name, timeout, psk, sync } => {
                let connector = connector(addr, psk.as_deref())?;
                // The error names the server.
                let remote = plyfs_layers::remote::Remote::connect(name, connector, *timeout)?;
                Ok(remote.sync_writes(*sync).level())
            }
        }
    }

    /// The configuration of the crypt volume a remote stack is stored in, read through the
    /// server, when the server serves it as stored and `specs` decrypt it here
    /// (`--stack crypt,remote`). `None` for anything else.
    pub fn remote_volume(&self, specs: &[LayerSpec]) -> crate::Result<Option<crate::FoundVolume>> {
        if !matches!(self, Lower::Remote { .. }) || !crate::tree::decrypts(specs) {
            return Ok(None);
        }
        let bottom = self.bottom()?;
        let config = plyfs_layers::crypt::config_below(&bottom).map_err(|e| {
            let name = plyfs_layers::crypt::keys::CONFIG_NAME;
            match e {
                // A server not started with --as-stored acts as the client's ids (root as nobody).
                plyfs_stack::Error::Os(libc::EACCES) => format!(
                    "{self}: reading {name}: {e}: the server does not let this client read the volume's configuration; serve the volume with `plyfs serve --as-stored`"
                ),
                e => format!("{self}: reading {name}: {e}"),
            }
        });
        bottom.layer().shutdown();
        let name = format!("the crypt volume served at {self}");
        Ok(config?.map(|c| (name.clone(), name, c)))
    }

    pub fn dir(&self) -> Option<&Path> {
        match self {
            Lower::Dir(d) => Some(d),
            Lower::Remote { .. } | Lower::Exodisk(_) | Lower::Branches { .. } => None,
        }
    }

    /// Whether the stack stands on directories of this machine, which hold the files that
    /// passthrough hands to the kernel: LOWER's, or its branches'.
    pub fn local(&self) -> bool {
        matches!(self, Lower::Dir(_) | Lower::Branches { .. })
    }

    /// Every directory the stack stores in (see [`crate::dirs::storage_dirs`]): none on a
    /// server or exofs.
    pub fn storage_dirs(&self, branches: &[String], specs: &[LayerSpec]) -> Vec<PathBuf> {
        if !self.local() {
            return Vec::new();
        }
        crate::dirs::storage_dirs(self.dir(), branches, specs)
    }
}

impl std::fmt::Display for Lower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lower::Dir(d) => write!(f, "{}", d.display()),
            Lower::Remote { addr, .. } => write!(f, "{addr}"),
            Lower::Exodisk(socket) => write!(f, "exodisk:{}", socket.display()),
            Lower::Branches { places } => write!(f, "{}", places.join("|")),
        }
    }
}


/// How to reach a server at `addr`: a Unix socket, or TLS proving the key in `psk`.
pub fn connector(addr: &Addr, psk: Option<&Path>) -> crate::Result<Box<dyn Connector>> {
    match (addr, psk) {
        (Addr::Unix(_), _) => Ok(Box::new(PlainConnector(addr.clone()))),
        (Addr::Tcp(_), Some(psk)) => Ok(Box::new(TlsConnector::new(addr.clone(), Psk::load(psk)?)?)),
        (Addr::Tcp(_), None) => Err(crate::Error::Spec(format!("{addr}: a TCP server needs its key: --psk FILE (or remote:psk=FILE)"))),
    }
}

#[cfg(test)]
mod tests {
    use super::Lower;

    /// LOWER `-` and `spec`, with `--branch` arguments: where the branches stand, or why not.
    fn without_lower(spec: &str, branches: &[&str]) -> Result<String, String> {
        let mut specs = plyfs_stack::spec::parse_stack_spec(spec).unwrap();
        let branches: Vec<String> = branches.iter().map(|b| b.to_string()).collect();
        Lower::parse("-".as_ref(), &mut specs, &branches, None).map(|l| l.to_string()).map_err(|e| e.to_string())
    }

    #[test]
    fn without_lower_the_branches_say_where_they_stand() {
        assert_eq!(without_lower("trace,mirror[@/srv/a | remote:addr=tcp:nas:7070:psk=/k]", &[]).unwrap(), "/srv/a|tcp:nas:7070");
        assert_eq!(without_lower("union[zstd|remote:addr=unix:/s]", &["/srv/b=ro"]).unwrap(), "/srv/b|unix:/s");
        assert_eq!(without_lower("mirror", &["/srv/a", "/srv/b"]).unwrap(), "/srv/a|/srv/b");
        assert_eq!(without_lower("mirror[@/srv/a|zstd]", &[]).unwrap_err(), "layer 'mirror', branch 1: no directory (give it as @DIR, or one more --branch)");
        assert!(without_lower("zstd", &[]).unwrap_err().starts_with("LOWER '-' needs a stack that says where it stands"));
        // A stack that ends in `remote` is the remote stack at its address, as before.
        assert_eq!(without_lower("zstd,remote:addr=unix:/s", &[]).unwrap(), "unix:/s");
    }
}
