//! `plyfs serve`: export a stack over a Unix socket or TLS, for `plyfs mount ADDR` and `remote`
//! layers elsewhere.

use std::path::PathBuf;

use clap::Args;
use plyfs_stack::admission::ConnectionLimits;
use plyfs_stack::spec::parse_stack_spec;
use plyfs_assemble::serve::ServePlan;
use plyfs_transport::server::{Identity, ServerOptions};
use plyfs_transport::Addr;

#[derive(Args, Clone)]
pub struct ServeArgs {
    /// The directory whose contents the stack presents.
    lower: PathBuf,
    /// Where to listen: unix:PATH, or tcp:HOST:PORT (TLS).
    #[arg(long, value_name = "ADDR")]
    listen: String,
    #[command(flatten)]
    tree: crate::daemon::StackArgs,
    /// A local user besides root and the server's own user that may connect to the Unix
    /// socket (repeatable). Their requests run as that user.
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uids: Vec<u32>,
    /// The pre-shared key file clients must prove they hold (TCP; at least 32 bytes, e.g.
    /// `head -c 32 /dev/urandom > FILE`; mode 0600 and yours, or it is refused).
    #[arg(long, value_name = "FILE")]
    psk: Option<PathBuf>,
    /// Act as root for TCP clients' root requests (by default they act as nobody, as NFS's
    /// root squash).
    #[arg(long)]
    no_root_squash: bool,
    /// Let clients whose ids the server maps (root-squashed TCP clients, --allow-uid users)
    /// make and open block and character devices. Off by default: a device node is raw access
    /// to a disk or to the kernel.
    #[arg(long)]
    allow_devices: bool,
    /// Let clients whose ids the server maps set and remove `security.*` and `trusted.*`
    /// attributes (file capabilities, LSM labels). Off by default: they give privileges.
    #[arg(long)]
    allow_privileged_xattrs: bool,
    /// Serve LOWER as it is stored: a crypt volume's names and contents leave the server
    /// encrypted, and the server needs no key. Clients decrypt with `--stack crypt,remote`.
    #[arg(long)]
    as_stored: bool,
    /// Requests of each client that run at once.
    #[arg(long, default_value_t = 4, value_name = "N")]
    workers: usize,
    #[command(flatten)]
    limits: LimitArgs,
    /// Log more (debug); repeat for every request (trace).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(flatten)]
    secret: crate::secret::SecretArgs,
}

pub fn serve(args: ServeArgs) -> Result<(), crate::failure::Failure> {
    use crate::failure::Failure;
    let signals = plyfs_assemble::mount::block_signals();
    crate::daemon::init_logging(args.verbose);
    let specs = args.tree.specs().map_err(Failure::usage)?;
    let addr = Addr::parse(&args.listen)
        .unwrap_or_else(|| Err(format!("--listen {}: expected unix:PATH or tcp:HOST:PORT", args.listen)))
        .map_err(Failure::usage)?;
    let lower = plyfs_assemble::dirs::existing_dir("lower directory", &args.lower).map_err(crate::daemon::lower_failure)?;
    let tls = plyfs_assemble::serve::tls_for(&addr, args.psk.as_deref())?;
    let dirs = plyfs_assemble::dirs::storage_dirs(Some(&lower), &args.tree.branches, &specs);
    // Held while the server runs.
    let _locks = plyfs_assemble::locks::take_all(Some(&lower), &args.tree.branches, &specs, plyfs_assemble::locks::Use::Serve, &format!("serving on {addr}"))?;
    let _volumes = if args.as_stored {
        if args.secret.given() {
            return Err("--as-stored serves a crypt volume encrypted: the server takes no password or key file".into());
        }
        Vec::new()
    } else {
        crate::secret::unlock_volumes(&dirs, &args.secret)?
    };
    let plan = ServePlan {
        specs,
        lower,
        addr,
        tls,
        branches: args.tree.branches.clone(),
        rules: args.tree.rules.clone(),
        as_stored: args.as_stored,
        options: ServerOptions {
            workers: args.workers.max(1),
            handshake_timeout: args.limits.handshake_timeout,
            limits: args.limits.connections(),
            in_flight_bytes: args.limits.in_flight as usize,
            allow_devices: args.allow_devices,
            allow_privileged_xattrs: args.allow_privileged_xattrs,
            // Set for --as-stored where the server is run.
            readable_by_all: None,
        },
        allow_uids: args.allow_uids.clone(),
        identity: if args.no_root_squash { Identity::AsSent } else { Identity::RootSquash },
    };
    Ok(plyfs_assemble::serve::run(plan, signals)?)
}

/// What a server takes from its clients before it refuses or waits (#28; `docs/protocol.md`,
/// *Limits of a server*). Shared by `plyfs serve` and `plyfs exodisk serve`.
#[derive(Args, Clone)]
pub struct LimitArgs {
    /// Connections taken at once, in all; more are refused.
    #[arg(long, value_name = "N", default_value_t = ConnectionLimits::default().total)]
    max_connections: usize,
    /// Connections taken at once from one client: one TCP address, or one local user on a Unix
    /// socket; more are refused.
    #[arg(long, value_name = "N", default_value_t = ConnectionLimits::default().per_client)]
    max_connections_per_client: usize,
    /// Seconds a client has, from connecting, to finish its handshake (TLS, hello and proof of
    /// the key); it is dropped then, however slowly it keeps sending.
    #[arg(long, value_name = "SECONDS", value_parser = seconds, default_value = "10")]
    pub handshake_timeout: std::time::Duration,
    /// Bytes one connection may hold in the server (e.g. 32M): its requests not yet answered
    /// (`plyfs serve`), or its replies not yet read (`plyfs exodisk serve`). Past it, the server
    /// stops reading that connection until some are done.
    #[arg(long, value_name = "BYTES", value_parser = bytes, default_value = "32M")]
    pub in_flight: u64,
}

impl LimitArgs {
    pub fn connections(&self) -> ConnectionLimits {
        ConnectionLimits { total: self.max_connections.max(1), per_client: self.max_connections_per_client.max(1) }
    }

    /// The options that give these limits, for a process started with them.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            format!("--max-connections={}", self.max_connections),
            format!("--max-connections-per-client={}", self.max_connections_per_client),
            format!("--handshake-timeout={}", self.handshake_timeout.as_secs_f64()),
            format!("--in-flight={}", self.in_flight),
        ]
    }
}

fn seconds(s: &str) -> Result<std::time::Duration, String> {
    match s.parse::<f64>() {
        Ok(t) if t > 0.0 && t <= 3600.0 => Ok(std::time::Duration::from_secs_f64(t)),
        _ => Err(format!("'{s}': expected seconds, more than 0 and at most 3600")),
    }
}

fn bytes(s: &str) -> Result<u64, String> {
    match plyfs_stack::glob::parse_size(s) {
        Some(n) if n >= 1 << 20 => Ok(n),
        _ => Err(format!("'{s}': expected a size of at least 1M, such as 32M")),
    }
}

#[derive(Args, Clone)]
pub struct HostArgs {
    /// The layers to host, top first (e.g. `trace` or `zstd:level=9`), as one layer of the
    /// mount's stack.
    layers: String,
    /// The Unix socket to listen on; mounts reach it with `ext:socket=PATH`.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Log more (debug); repeat for every request (trace).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

/// `plyfs host`: run layers in this process for mounts that reach them with `ext:socket=`.
/// Each mount that connects gets layers of its own over its own lower levels.
pub fn host(args: HostArgs) -> Result<(), String> {
    let signals = plyfs_assemble::mount::block_signals();
    crate::daemon::init_logging(args.verbose);
    let specs = parse_stack_spec(&args.layers).map_err(|e| e.to_string())?;
    Ok(plyfs_assemble::serve::host(specs, &args.layers, &args.socket, signals)?)
}
