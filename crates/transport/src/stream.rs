//! The byte streams the protocol runs over, and the addresses that name them.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where a stack is served: `unix:PATH` or `tcp:HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Addr {
    Unix(PathBuf),
    Tcp(String),
}

impl Addr {
    /// Parse `unix:PATH` or `tcp:HOST:PORT`; `None` if `s` has neither form.
    pub fn parse(s: &str) -> Option<Result<Addr, String>> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Some(Err(format!("{s}: no socket path after 'unix:'")));
            }
            return Some(Ok(Addr::Unix(PathBuf::from(path))));
        }
        let hostport = s.strip_prefix("tcp:")?;
        Some(match hostport.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(Addr::Tcp(hostport.to_owned())),
            _ => Err(format!("{s}: expected tcp:HOST:PORT")),
        })
    }

    /// The host name a TLS client checks the server's certificate against.
    pub fn host(&self) -> Option<&str> {
        match self {
            Addr::Unix(_) => None,
            Addr::Tcp(hp) => hp.rsplit_once(':').map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']')),
        }
    }
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Addr::Unix(p) => write!(f, "unix:{}", p.display()),
            Addr::Tcp(hp) => write!(f, "tcp:{hp}"),
        }
    }
}

/// A connection split into the halves that different threads use at once: one reads frames
/// while others write theirs.
pub struct Halves {
    pub reader: Box<dyn Read + Send>,
    pub writer: Box<dyn Write + Send>,
    pub control: Arc<dyn Control>,
}

/// What either side may do to a connection whatever its halves are doing.
pub trait Control: Send + Sync {
    /// End the connection: blocked reads and writes on it return.
    fn close(&self);
    /// Bound how long a read may wait (`None`: forever).
    fn set_read_timeout(&self, timeout: Option<Duration>);
}

/// A stream the protocol can run over.
pub trait Duplex: Send + 'static {
    fn split(self: Box<Self>) -> io::Result<Halves>;
}

/// A socket whose halves are clones of one descriptor.
trait Socket: Read + Write + Send + Sync + Sized + 'static {
    fn try_clone(&self) -> io::Result<Self>;
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl Socket for UnixStream {
    fn try_clone(&self) -> io::Result<Self> {
        UnixStream::try_clone(self)
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        UnixStream::shutdown(self, how)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
}

impl Socket for TcpStream {
    fn try_clone(&self) -> io::Result<Self> {
        TcpStream::try_clone(self)
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        TcpStream::shutdown(self, how)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
}

struct SocketControl<S>(S);

impl<S: Socket> Control for SocketControl<S> {
    fn close(&self) {
        let _ = self.0.shutdown(Shutdown::Both);
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) {
        let _ = self.0.set_read_timeout(timeout);
    }
}

fn split_socket<S: Socket>(s: S) -> io::Result<Halves> {
    let writer = s.try_clone()?;
    let control = s.try_clone()?;
    // Frames are written whole, with one vectored write: a buffer would only add a copy.
    Ok(Halves {
        reader: Box::new(io::BufReader::with_capacity(64 << 10, s)),
        writer: Box::new(writer),
        control: Arc::new(SocketControl(control)),
    })
}

impl Duplex for UnixStream {
    fn split(self: Box<Self>) -> io::Result<Halves> {
        split_socket(*self)
    }
}

impl Duplex for TcpStream {
    fn split(self: Box<Self>) -> io::Result<Halves> {
        let _ = self.set_nodelay(true);
        split_socket(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!(Addr::parse("unix:/run/x.sock"), Some(Ok(Addr::Unix("/run/x.sock".into()))));
        assert_eq!(Addr::parse("tcp:127.0.0.1:7000"), Some(Ok(Addr::Tcp("127.0.0.1:7000".into()))));
        assert_eq!(Addr::parse("tcp:[::1]:7000").unwrap().unwrap().host(), Some("::1"));
        assert!(matches!(Addr::parse("tcp:host"), Some(Err(_))));
        assert!(matches!(Addr::parse("unix:"), Some(Err(_))));
        assert_eq!(Addr::parse("/srv/dir"), None);
    }
}
