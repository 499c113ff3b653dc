//! A stack served to other processes and machines (`plyfs serve`), and layers hosted for
//! mounts that reach them with `ext:socket=` (`plyfs host`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::sys::signal::SigSet;
use plyfs_stack::spec::LayerSpec;
use plyfs_transport::listen::{bind_unix, serve_unix, UnixPolicy};
use plyfs_transport::server::{Identity, Server, ServerOptions};
use plyfs_transport::tls::{Psk, TlsServer};
use plyfs_transport::Addr;

use crate::lower::Lower;

/// What to serve, and how.
pub struct ServePlan {
    /// The layers, top first.
    pub specs: Vec<LayerSpec>,
    /// The lower directory, canonical ([`crate::dirs::existing_dir`]).
    pub lower: PathBuf,
    pub addr: Addr,
    /// For a `tcp:` address: the TLS that proves clients hold the key ([`tls_for`]).
    pub tls: Option<Arc<TlsServer>>,
    /// `--branch` arguments, for the stack's fan-out layer.
    pub branches: Vec<String>,
    /// The rules file choosing files' chains.
    pub rules: Option<PathBuf>,
    /// Serve a crypt volume as it is stored, encrypted ([`crate::tree::build_stored_stack`]).
    pub as_stored: bool,
    pub options: ServerOptions,
    /// Local users besides root and the server's own that may connect to a Unix socket.
    pub allow_uids: Vec<u32>,
    /// Who root requests from TCP clients act as.
    pub identity: Identity,
}

/// The TLS a server on `addr` needs: `psk` for a `tcp:` address, nothing for a Unix socket.
pub fn tls_for(addr: &Addr, psk: Option<&Path>) -> crate::Result<Option<Arc<TlsServer>>> {
    match (addr, psk) {
        (Addr::Tcp(_), Some(psk)) => Ok(Some(Arc::new(TlsServer::new(Psk::load(psk)?)?))),
        (Addr::Tcp(_), None) => Err(crate::Error::Run(format!("--listen {addr}: TCP needs --psk FILE (clients must prove they hold the key)"))),
        (Addr::Unix(_), Some(_)) => Err(crate::Error::Run("--psk is for tcp: addresses; a Unix socket checks its peers' user ids".into())),
        (Addr::Unix(_), None) => Ok(None),
    }
}

/// Build the stack of `plan` and serve it until one of the blocked `signals` comes. The caller
/// holds the lower locks and has unlocked the crypt volumes.
pub fn run(plan: ServePlan, signals: SigSet) -> crate::Result<()> {
    let ServePlan { specs, lower, addr, tls, branches, rules, as_stored, options, allow_uids, identity } = plan;
    // Modes arrive already masked by the client's kernel.
    unsafe { libc::umask(0) };
    plyfs_stack::raise_fd_limit();
    let stack = if as_stored {
        if !branches.is_empty() {
            return Err(crate::Error::Run("--as-stored serves one directory: no --branch".into()));
        }
        crate::tree::build_stored_stack(&specs, &lower, rules.as_deref())?
    } else {
        crate::tree::build_stack(&specs, &Lower::Dir(lower.clone()), &branches, rules.as_deref(), None)?
    };
    let stack = Arc::new(stack);
    let lower = Lower::Dir(lower);
    // Every client of a volume served as stored needs its configuration to unlock it.
    let options = ServerOptions { readable_by_all: as_stored.then_some(plyfs_layers::crypt::keys::CONFIG_NAME), ..options };
    let server = Server::for_stack(&stack, options);
    let names: Vec<String> = stack.named_levels().into_iter().map(|n| n.name).collect();

    let cleanup_path = match &addr {
        Addr::Unix(p) => Some(p.clone()),
        Addr::Tcp(_) => None,
    };
    let stop_stack = stack.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Ok(sig) = signals.wait() {
                tracing::info!("{sig}: stopping");
            }
            stop_stack.shutdown();
            if let Some(p) = cleanup_path {
                let _ = std::fs::remove_file(p);
            }
            std::process::exit(0);
        })
        .map_err(|e| crate::Error::Run(e.to_string()))?;

    match &addr {
        Addr::Unix(path) => {
            let listener = bind_unix(path)?;
            tracing::info!("serving {lower} with stack [{}] on {addr}", names.join(", "));
            serve_unix(server, listener, UnixPolicy { allow_uids }).map_err(|e| crate::Error::Run(e.to_string()))
        }
        Addr::Tcp(hostport) => {
            let listener = std::net::TcpListener::bind(hostport).map_err(|e| format!("--listen {addr}: {e}"))?;
            tracing::info!("serving {lower} with stack [{}] on {addr} (TLS, pre-shared key)", names.join(", "));
            let tls = tls.ok_or_else(|| crate::Error::Spec(format!("--listen {addr}: TCP needs TLS")))?;
            tls.serve(server, listener, identity).map_err(|e| crate::Error::Run(e.to_string()))
        }
    }
}

/// Run the layers `specs` (linear, no fan-out; `what` as the user gave them) for every mount
/// that connects to `socket`, each with layers of its own over its own lower levels, until one
/// of the blocked `signals` comes.
pub fn host(specs: Vec<LayerSpec>, what: &str, socket: &Path, signals: SigSet) -> crate::Result<()> {
    let registry = crate::registry();
    if let Some(s) = specs.iter().find(|s| plyfs_stack::is_fan_out(registry, &s.kind)) {
        return Err(crate::Error::Run(format!("layer '{}' fans out: only linear layers can be hosted", s.kind)));
    }
    // Check the layers build before listening, so mistakes are reported now.
    let probe = plyfs_transport::host::Below::new();
    plyfs_stack::Stack::build_over(&specs, registry, vec![plyfs_stack::Level::new(probe)]).map_err(|e| crate::Error::Run(e.to_string()))?;
    let listener = bind_unix(socket)?;
    let path = socket.to_owned();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let _ = signals.wait();
            let _ = std::fs::remove_file(path);
            std::process::exit(0);
        })
        .map_err(|e| crate::Error::Run(e.to_string()))?;
    tracing::info!("hosting [{what}] on {}", socket.display());
    for stream in listener.incoming() {
        let stream = stream.map_err(|e| format!("accept: {e}"))?;
        let specs = specs.clone();
        std::thread::spawn(move || {
            let below = plyfs_transport::host::Below::new();
            let stack = match plyfs_stack::Stack::build_over(&specs, registry, vec![plyfs_stack::Level::new(below.clone())]) {
                Ok(s) => s,
                Err(e) => return tracing::error!("building the layers: {e}"),
            };
            let top = stack.top().layer().clone();
            if let Err(e) = plyfs_transport::host::serve_layer(Box::new(stream), top, &below) {
                tracing::warn!("a mount: {e}");
            }
            stack.shutdown();
        });
    }
    Ok(())
}
