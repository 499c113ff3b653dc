//! Hosting one layer in a process of its own, for a mount that reaches it with an `ext` or `py`
//! layer (`seeds/000` §5.5, figure 5: layers developed and run as user code, with a transport
//! above them and one below). Both directions share one connection: the mount sends the
//! operations the hosted layer answers, and the hosted layer's calls to the level below it come
//! back to the mount, which runs them on its own lower levels.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use plyfs_stack::{Caller, Error, Layer, Level, Op, Reply, Result};

use crate::client::{CallError, Connection, Incoming, Welcome};
use crate::stream::Duplex;
use crate::wire::{Hosted, RequestOp, WireCaller, WireReply};

/// How long a hosted layer waits on the mount for a call below it.
const BELOW_TIMEOUT: Duration = Duration::from_secs(300);

/// The level below a hosted layer: the mount's levels, reached back over the connection.
pub struct Below {
    conn: OnceLock<Arc<Connection>>,
}

impl Below {
    pub fn new() -> Arc<Below> {
        Arc::new(Below { conn: OnceLock::new() })
    }

    /// Call the mount with an operation in its wire form (what a generic bypass sends).
    pub fn call_wire(&self, caller: WireCaller, op: RequestOp, payload: &[u8]) -> (WireReply, Vec<u8>) {
        let Some(conn) = self.conn.get() else {
            return error_reply(&Error::Os(libc::EIO));
        };
        match conn.call(caller, op, payload, Instant::now() + BELOW_TIMEOUT) {
            Ok(r) => r,
            Err(CallError::TimedOut) => error_reply(&Error::Os(libc::ETIMEDOUT)),
            Err(CallError::Lost { .. }) => error_reply(&Error::Os(libc::EIO)),
        }
    }
}

fn error_reply(e: &Error) -> (WireReply, Vec<u8>) {
    (WireReply::Error(e.into()), Vec::new())
}

impl Layer for Below {
    fn name(&self) -> &str {
        "mount"
    }

    fn kind(&self) -> &'static str {
        "mount"
    }

    fn lower(&self) -> &[Level] {
        &[]
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let (header, payload) = op.to_header();
        let (reply, data) = self.call_wire(cx.into(), header.into(), payload);
        reply.into_result(data, op.name())
    }
}

/// What the hosting process tells the mount about itself.
pub fn welcome(layer_name: &str, layer_kind: &str, hosted: Hosted, ext_ops: Vec<crate::wire::WireExtOp>) -> Welcome {
    Welcome {
        version: *crate::wire::VERSIONS.last().expect("a version"),
        software: format!("plyfs {}", env!("CARGO_PKG_VERSION")),
        instance: u64::from(std::process::id()),
        layers: vec![crate::wire::WireLayer { name: layer_name.into(), kind: layer_kind.into() }],
        ext_ops,
        auth: None,
        hosted: Some(hosted),
    }
}

/// Serve `incoming` for the mount at the other end of `stream` until it goes; `below` becomes
/// the way back to it.
pub fn serve(stream: Box<dyn Duplex>, welcome: Welcome, below: &Arc<Below>, incoming: Incoming) -> std::result::Result<(), crate::Error> {
    let conn = Connection::accept(stream, welcome, Duration::from_secs(30), incoming)?;
    let _ = below.conn.set(conn.clone());
    conn.wait_closed();
    Ok(())
}

/// Host a Rust layer: every operation the mount sends goes to it.
pub fn serve_layer(stream: Box<dyn Duplex>, layer: Arc<dyn Layer>, below: &Arc<Below>) -> std::result::Result<(), crate::Error> {
    let data = layer.data_path().to_string();
    let ops: Vec<String> = plyfs_stack::OpKind::ALL.iter().map(|k| k.name().to_owned()).collect();
    let ext_ops = layer.extended_ops().iter().map(|o| crate::wire::WireExtOp::of(o, layer.name())).collect();
    let hosted = Hosted { kind: "layer".into(), ops, data: Some(data), tag: None, deterministic: None, compresses: None };
    let welcome = welcome(layer.name(), layer.kind(), hosted, ext_ops);
    let level = Level::new(layer);
    let incoming: Incoming = Arc::new(move |caller, op, payload| {
        let result = op.stack_op(&payload).and_then(|op| level.call(&caller.into(), &op));
        WireReply::from_result(result)
    });
    serve(stream, welcome, below, incoming)
}
