//! Accepting clients: on a Unix socket, whose peers the kernel names, and on TCP.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;

use plyfs_stack::Groups;

use crate::server::{Authenticator, Identity, Origin, Server};
use crate::Error;
use crate::wire::{self, Message};

/// Which local users may connect to a Unix socket, and who the server acts as for them.
#[derive(Clone, Debug, Default)]
pub struct UnixPolicy {
    /// Users besides root and the server's own user that may connect.
    pub allow_uids: Vec<u32>,
}

impl UnixPolicy {
    /// Root's requests run as the ids they carry; anyone else's run as that user, whatever
    /// they claim.
    /// `groups` are the peer's supplementary groups, as the kernel gives them (`SO_PEERGROUPS`).
    pub fn admit(&self, uid: u32, gid: u32, groups: &[u32]) -> Result<Identity, Error> {
        let me = unsafe { libc::geteuid() };
        if uid == 0 {
            Ok(Identity::AsSent)
        } else if uid == me || self.allow_uids.contains(&uid) {
            Ok(if me == 0 { Identity::Fixed { uid, gid, groups: Groups::new(groups) } } else { Identity::AsSent })
        } else {
            Err(Error::NotAllowed { uid })
        }
    }
}

/// Bind a Unix socket at `path` (replacing a stale one), readable and writable by its owner only.
pub fn bind_unix(path: &Path) -> Result<UnixListener, Error> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            return Err(Error::SocketTaken { path: path.to_owned(), why: "exists and is not a socket" });
        }
        if UnixStream::connect(path).is_ok() {
            return Err(Error::SocketTaken { path: path.to_owned(), why: "another server is listening there" });
        }
        std::fs::remove_file(path).map_err(Error::io("removing a stale socket", path.display()))?;
    }
    let old = unsafe { libc::umask(0o177) };
    let listener = UnixListener::bind(path);
    unsafe { libc::umask(old) };
    listener.map_err(Error::io("binding a socket", path.display()))
}

/// Accept clients on `listener` until it fails, each on a thread of its own.
pub fn serve_unix(server: Arc<Server>, listener: UnixListener, policy: UnixPolicy) -> Result<(), Error> {
    let socket = match listener.local_addr().ok().and_then(|a| a.as_pathname().map(|p| p.display().to_string())) {
        Some(path) => format!("unix:{path}"),
        None => "a unix socket".to_owned(),
    };
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) || e.raw_os_error() == Some(libc::ENFILE) => {
                tracing::warn!("{socket}: accepting a client: {e}; trying again");
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
            Err(e) => return Err(Error::io("accepting a client", &socket)(e)),
        };
        let cred = match nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("{socket}: a client whose credentials cannot be read ({e}): refused");
                continue;
            }
        };
        let peer = format!("pid {} (uid {})", cred.pid(), cred.uid());
        let deadline = server.handshake_deadline();
        let groups = match peer_groups(&stream) {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!("{socket}: client {peer}: its groups cannot be read ({e}): refused");
                continue;
            }
        };
        let identity = match policy.admit(cred.uid(), cred.gid(), &groups) {
            Ok(i) => i,
            Err(e) => {
                let reason = e.to_string();
                server.log_refusal(&Origin::User(cred.uid()), &reason);
                refuse(&stream, &reason);
                continue;
            }
        };
        let client = Origin::User(cred.uid());
        let admitted = match server.admit(&client) {
            Ok(a) => a,
            Err(reason) => {
                refuse(&stream, &reason);
                continue;
            }
        };
        let server = server.clone();
        let spawned = std::thread::Builder::new().name("serve-conn".into()).spawn(move || {
            let _admitted = admitted;
            server.serve_until(Box::new(stream), &peer, Some(&client), identity, None::<&dyn Authenticator>, deadline)
        });
        if let Err(e) = spawned {
            tracing::warn!("{socket}: a client of uid {}: no thread to serve it: {e}", cred.uid());
        }
    }
    Ok(())
}

/// Tell a Unix-socket peer it is refused, as the protocol allows before its hello (the preamble
/// and a `refused` frame), without reading anything from it or waiting on it.
pub fn refuse(stream: &UnixStream, reason: &str) {
    let _ = stream.set_nonblocking(true);
    let mut out = wire::PREAMBLE.to_vec();
    let _ = wire::write_frame(&mut out, &wire::encode(&Message::Refused { reason: reason.to_owned() }), &[]);
    let _ = std::io::Write::write_all(&mut &*stream, &out);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// The supplementary groups of a Unix socket's peer, as they were when it connected.
fn peer_groups(stream: &UnixStream) -> std::io::Result<Vec<u32>> {
    use std::os::fd::AsRawFd;
    let mut groups = vec![0u32; 64];
    loop {
        let mut len = (groups.len() * 4) as libc::socklen_t;
        let r = unsafe {
            libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERGROUPS, groups.as_mut_ptr().cast(), &mut len)
        };
        if r == 0 {
            groups.truncate(len as usize / 4);
            return Ok(groups);
        }
        let e = std::io::Error::last_os_error();
        // ERANGE: the kernel says in `len` how much room the list needs.
        if e.raw_os_error() == Some(libc::ERANGE) && (len as usize / 4) > groups.len() && groups.len() < 1 << 16 {
            groups.resize(len as usize / 4, 0);
            continue;
        }
        return Err(e);
    }
}
