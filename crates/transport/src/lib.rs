//! # plyfs-transport
//!
//! Transport layers (`seeds/000` §5.4–5.5): operations that travel from one address space to
//! another, and from one machine to another, through one self-describing protocol.
//!
//! - [`wire`] is the protocol: frames, messages, operation descriptors, limits.
//! - [`server`] exports a level to clients; [`listen`] accepts them.
//! - [`client`] is one connection, and the [`Connector`] that opens it (a Unix socket, or
//!   [`tls`] proving a pre-shared key).
//! - [`host`] runs layers for mounts in other processes.
//! - [`Error`] is what fails in setting up, accepting and keeping connections, naming the
//!   socket, peer or key file.
//!
//! The layers that use the protocol from inside a stack live with the other layers:
//! `plyfs_layers::remote` (a stack served elsewhere, as the bottom of this one) and
//! `plyfs_layers::ext` (layers hosted in another process, or in Python).

pub mod client;
mod error;
pub mod host;
pub mod listen;
pub mod server;
pub mod stream;
pub mod tls;
pub mod wire;

pub use client::Connector;
pub use error::Error;
pub use stream::Addr;

/// Connects over a plain socket (a Unix socket, or TCP without TLS in tests).
pub struct PlainConnector(pub Addr);

impl Connector for PlainConnector {
    fn describe(&self) -> String {
        self.0.to_string()
    }

    fn connect(
        &self,
        timeout: std::time::Duration,
        on_change: client::OnChange,
    ) -> Result<std::sync::Arc<client::Connection>, client::ConnectError> {
        let stream = client::connect_plain(&self.0, timeout)?;
        client::Connection::open(stream, None, timeout, on_change)
    }
}
