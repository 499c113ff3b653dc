//! TCP connections: TLS 1.3 (rustls) with mutual authentication by a pre-shared key.
//!
//! The server makes itself a fresh certificate at every start; nobody needs to manage one.
//! Instead, each side proves it holds the shared key, bound to this very TLS session: the proof
//! is an HMAC under the key of a value exported from the session's secrets (RFC 8446 §7.5), which
//! differs on every connection. A man in the middle has two sessions with two different exported
//! values, so he can neither answer for the client nor for the server without the key; a client
//! without the key gets nothing but a refusal, and anonymous access does not exist.
//!
//! The halves of a TLS connection share the rustls state behind a lock held only to encrypt or
//! decrypt, never while waiting on the socket, so a reader blocked on the network does not stop
//! writers, and two peers sending large frames at once do not wait on each other.

use std::io::{self, BufRead, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, Connection, DigitallySignedStruct, ServerConfig, ServerConnection, SignatureScheme};
use zeroize::Zeroizing;

use crate::client::{ConnectError, Connection as Client, OnChange};
use crate::client::Connector;
use crate::server::{Authenticator, Identity, Origin, Server};
use plyfs_stack::admission::Deadline;
use crate::stream::{Addr, Control, Duplex, Halves};
use crate::Error;

const EXPORTER_LABEL: &[u8] = b"EXPORTER-plyfs-psk-binding";

/// A pre-shared key, read from a file of at least 32 bytes.
#[derive(Clone)]
pub struct Psk(Arc<Zeroizing<Vec<u8>>>);

impl Psk {
    /// Read the key file at `path`. As ssh does with a private key, a file that the group or
    /// others may read or write is refused (`chmod 600` it), and so is one owned by another user
    /// than the one running plyfs (root may use anyone's).
    pub fn load(path: &Path) -> Result<Psk, Error> {
        use std::io::Read;
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let shown = path.display();
        let bad = |why: String| Error::BadKeyFile { path: path.to_owned(), why };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| bad(format!("opening it: {e}")))?;
        let meta = file.metadata().map_err(|e| bad(format!("reading its attributes: {e}")))?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        let me = unsafe { libc::geteuid() };
        if me != 0 && meta.uid() != me {
            return Err(bad(format!("owned by uid {}, not by uid {me} who runs plyfs; refusing it", meta.uid())));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(bad(format!(
                "mode {:04o} lets others read or change it; refusing it (chmod 600 {shown})",
                meta.mode() & 0o7777
            )));
        }
        let mut key = Zeroizing::new(Vec::with_capacity(64));
        file.read_to_end(&mut key).map_err(|e| bad(format!("reading the pre-shared key: {e}")))?;
        if key.len() < 32 {
            return Err(bad(format!("{} bytes, at least 32 needed (make one with `head -c 32 /dev/urandom > FILE`)", key.len())));
        }
        Ok(Psk(Arc::new(key)))
    }

    /// The proof that `side` holds the key, bound to a session by its exported value.
    fn proof(&self, side: &[u8], binding: &[u8]) -> Vec<u8> {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.0);
        let mut ctx = ring::hmac::Context::with_key(&key);
        ctx.update(side);
        ctx.update(binding);
        ctx.sign().as_ref().to_vec()
    }

    fn verify(&self, side: &[u8], binding: &[u8], proof: &[u8]) -> bool {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.0);
        let mut msg = side.to_vec();
        msg.extend_from_slice(binding);
        ring::hmac::verify(&key, &msg, proof).is_ok()
    }
}

/// ring's algorithms, with AES-128-GCM first: as safe for this use, and faster than AES-256 on
/// the bulk data a file system moves.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::cipher_suite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256};
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256];
    Arc::new(p)
}

/// The server's TLS setup: a certificate made at start.
pub struct TlsServer {
    config: Arc<ServerConfig>,
    psk: Psk,
}

impl TlsServer {
    pub fn new(psk: Psk) -> Result<TlsServer, Error> {
        let tls = |op: &'static str, e: &dyn std::fmt::Display| Error::Tls { op, why: e.to_string() };
        let cert = rcgen::generate_simple_self_signed(vec!["plyfs".to_owned()]).map_err(|e| tls("making the server's certificate", &e))?;
        let der = CertificateDer::from(cert.cert.der().to_vec());
        let key = PrivateKeyDer::try_from(cert.signing_key.serialize_der()).map_err(|e| tls("reading the certificate's key", &e))?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls("choosing TLS 1.3", &e))?
            .with_no_client_auth()
            .with_single_cert(vec![der], key)
            .map_err(|e| tls("setting up the server", &e))?;
        // No resumption: every connection proves the key afresh.
        config.send_tls13_tickets = 0;
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        Ok(TlsServer { config: Arc::new(config), psk })
    }

    /// Accept clients on `listener` until it fails, each on a thread of its own.
    pub fn serve(self: Arc<Self>, server: Arc<Server>, listener: TcpListener, identity: Identity) -> Result<(), Error> {
        let socket = match listener.local_addr() {
            Ok(a) => format!("tcp:{a}"),
            Err(_) => "a TCP socket".to_owned(),
        };
        for stream in listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ECONNABORTED)) => {
                    tracing::warn!("{socket}: accepting a client: {e}; trying again");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                Err(e) => return Err(Error::io("accepting a client", &socket)(e)),
            };
            // The whole handshake, TLS included, must be over by this.
            let deadline = server.handshake_deadline();
            let Ok(addr) = stream.peer_addr() else { continue };
            let peer = addr.to_string();
            // Over the limits, the connection is closed at once: without TLS there is no way to
            // say why, and a TLS handshake is what a flood should not cost.
            let client = Origin::Addr(addr.ip());
            let Ok(admitted) = server.admit(&client) else { continue };
            let (tls, server) = (self.clone(), server.clone());
            let spawned = std::thread::Builder::new().name("serve-tls".into()).spawn(move || {
                let _admitted = admitted;
                let conn = match ServerConnection::new(tls.config.clone()) {
                    Ok(c) => c,
                    Err(e) => return tracing::warn!("client {peer}: starting a TLS session: {e}"),
                };
                let stream = match TlsStream::handshake(stream, conn.into(), deadline) {
                    Ok(s) => s,
                    Err(e) => return server.log_refusal(&client, &format!("TLS handshake: {e} ({peer})")),
                };
                let auth = PskCheck { psk: tls.psk.clone(), binding: stream.binding.clone() };
                server.serve_until(Box::new(stream), &peer, Some(&client), identity, Some(&auth), deadline);
            });
            if let Err(e) = spawned {
                tracing::warn!("client {addr}: no thread to serve it: {e}");
            }
        }
        Ok(())
    }
}

struct PskCheck {
    psk: Psk,
    binding: Vec<u8>,
}

impl Authenticator for PskCheck {
    fn check(&self, proof: Option<&[u8]>) -> Result<Option<Vec<u8>>, String> {
        match proof {
            Some(p) if self.psk.verify(b"plyfs client", &self.binding, p) => Ok(Some(self.psk.proof(b"plyfs server", &self.binding))),
            Some(_) => Err("wrong key".into()),
            None => Err("no key given (anonymous access is not allowed)".into()),
        }
    }
}

/// Connects over TLS and proves the key.
pub struct TlsConnector {
    pub addr: Addr,
    psk: Psk,
    config: Arc<ClientConfig>,
}

impl TlsConnector {
    pub fn new(addr: Addr, psk: Psk) -> Result<TlsConnector, Error> {
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Tls { op: "choosing TLS 1.3", why: e.to_string() })?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(KeyProves(provider())))
            .with_no_client_auth();
        Ok(TlsConnector { addr, psk, config: Arc::new(config) })
    }
}

impl Connector for TlsConnector {
    fn describe(&self) -> String {
        self.addr.to_string()
    }

    fn connect(&self, timeout: Duration, on_change: OnChange) -> Result<Arc<Client>, ConnectError> {
        let Addr::Tcp(hostport) = &self.addr else {
            return Err(ConnectError::refused(format!("TLS needs a tcp: address, not {}", self.addr)));
        };
        let sock = crate::client::connect_tcp(hostport, timeout)?;
        let name = ServerName::try_from("plyfs").expect("a valid name");
        let conn = ClientConnection::new(self.config.clone(), name).map_err(|e| format!("TLS: {e}"))?;
        let stream = TlsStream::handshake(sock, conn.into(), Deadline::after(timeout)).map_err(|e| format!("TLS handshake: {e}"))?;
        let binding = stream.binding.clone();
        let proof = self.psk.proof(b"plyfs client", &binding);
        let client = Client::open(Box::new(stream), Some(proof), timeout, on_change)?;
        let server_proof = client.welcome.auth.clone().unwrap_or_default();
        if !self.psk.verify(b"plyfs server", &binding, &server_proof) {
            client.close("the server did not prove the key");
            return Err(ConnectError::refused(
                "the server does not hold the key (a different server, or someone in between)".into(),
            ));
        }
        Ok(client)
    }
}

/// The server is authenticated by the key (see the module documentation), not by its
/// certificate; the handshake's signatures are still checked, so the server holds the key of the
/// certificate it sent.
#[derive(Debug)]
struct KeyProves(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for KeyProves {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not used".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A TLS connection whose halves work at once.
pub struct TlsStream {
    sock: TcpStream,
    conn: Arc<Mutex<Connection>>,
    /// The value exported from the session, which proofs of the key are bound to.
    binding: Vec<u8>,
}

impl TlsStream {
    /// The TLS handshake, over by `deadline` (the whole of it, however slowly the peer sends).
    fn handshake(sock: TcpStream, mut conn: Connection, deadline: Deadline) -> io::Result<TlsStream> {
        let _ = sock.set_nodelay(true);
        let mut until = Until { sock: &sock, deadline };
        while conn.is_handshaking() {
            conn.complete_io(&mut until)?;
        }
        // Send what is left (the client's Finished).
        while conn.wants_write() {
            conn.write_tls(&mut until)?;
        }
        sock.set_read_timeout(None)?;
        sock.set_write_timeout(None)?;
        // Frames are sealed whole and sent by the writer itself; rustls need not hold any back.
        conn.set_buffer_limit(None);
        let mut binding = vec![0u8; 32];
        conn.export_keying_material(&mut binding[..], EXPORTER_LABEL, None).map_err(io::Error::other)?;
        Ok(TlsStream { sock, conn: Arc::new(Mutex::new(conn)), binding })
    }
}

/// A socket whose reads and writes wait at most until a deadline.
struct Until<'a> {
    sock: &'a TcpStream,
    deadline: Deadline,
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.sock.set_read_timeout(Some(self.deadline.left()?))?;
        (&mut &*self.sock).read(buf)
    }
}

impl Write for Until<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sock.set_write_timeout(Some(self.deadline.left()?))?;
        (&mut &*self.sock).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct TlsReader {
    sock: TcpStream,
    conn: Arc<Mutex<Connection>>,
    /// Bytes from the network not yet given to rustls: `raw[start..end]`.
    raw: Vec<u8>,
    start: usize,
    end: usize,
}

impl Read for TlsReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            {
                let mut conn = self.conn.lock();
                match conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                // rustls takes what fits its buffer; the rest waits for the next round.
                if self.start < self.end {
                    let mut pending = &self.raw[self.start..self.end];
                    self.start += conn.read_tls(&mut pending)?;
                    conn.process_new_packets().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    continue;
                }
            }
            // Wait for the network without the lock.
            let n = self.sock.read(&mut self.raw)?;
            if n == 0 {
                // The peer closed without a close_notify: the frame reader calls that a close.
                return Ok(0);
            }
            (self.start, self.end) = (0, n);
        }
    }
}

impl crate::stream::FrameRead for TlsReader {
    fn buffered(&self) -> bool {
        if self.start < self.end {
            return true;
        }
        let mut conn = self.conn.lock();
        // Plaintext already decrypted: peek without taking it.
        matches!(conn.reader().fill_buf(), Ok(b) if !b.is_empty())
    }

    fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.sock.as_raw_fd()
    }
}

struct TlsWriter {
    sock: TcpStream,
    conn: Arc<Mutex<Connection>>,
    /// Keeps records going out in the order they were sealed.
    order: Arc<Mutex<()>>,
}

impl Write for TlsWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let _order = self.order.lock();
        let mut sealed = Vec::with_capacity(buf.len() + 64);
        {
            let mut conn = self.conn.lock();
            conn.writer().write_all(buf)?;
            while conn.wants_write() {
                conn.write_tls(&mut sealed)?;
            }
        }
        self.sock.write_all(&sealed)?;
        Ok(buf.len())
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let _order = self.order.lock();
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut sealed = Vec::with_capacity(total + total / 16_000 * 32 + 64);
        {
            let mut conn = self.conn.lock();
            for b in bufs {
                conn.writer().write_all(b)?;
            }
            while conn.wants_write() {
                conn.write_tls(&mut sealed)?;
            }
        }
        self.sock.write_all(&sealed)?;
        Ok(total)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct TlsControl(TcpStream);

impl Control for TlsControl {
    fn close(&self) {
        let _ = self.0.shutdown(Shutdown::Both);
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) {
        let _ = self.0.set_read_timeout(timeout);
    }
}

impl Duplex for TlsStream {
    fn split(self: Box<Self>) -> io::Result<Halves> {
        let reader = TlsReader { sock: self.sock.try_clone()?, conn: self.conn.clone(), raw: vec![0u8; 64 << 10], start: 0, end: 0 };
        let writer = TlsWriter { sock: self.sock.try_clone()?, conn: self.conn.clone(), order: Arc::new(Mutex::new(())) };
        Ok(Halves { reader: Box::new(reader), writer: Box::new(writer), control: Arc::new(TlsControl(self.sock)) })
    }
}
