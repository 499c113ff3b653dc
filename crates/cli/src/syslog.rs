//! `-o syslog`: a mount daemon's log lines go to the system log instead of a file, as sshfs's
//! and gocryptfs's do: one datagram per line on the `/dev/log` socket, in the form glibc's
//! `syslog(3)` sends (RFC 3164 without the host name, which the local daemon adds):
//!
//! ```text
//! <30>Nov 27 15:40:51 plyfs[4242]: mounted /srv/data on /mnt/data with stack [zstd]
//! ```
//!
//! The facility is `daemon`; the severity follows the line's level. A line that cannot be sent
//! (no syslog daemon listens) is lost, as `syslog(3)`'s are: logging never stops the mount.

use std::io::Write;
use std::os::unix::net::UnixDatagram;
use std::sync::Mutex;

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

/// Where the local syslog daemon listens.
const SOCKET: &str = "/dev/log";
/// `LOG_DAEMON`.
const FACILITY_DAEMON: u8 = 3;
/// The longest line sent; the rest is cut (syslog daemons take at least 1 KiB, most 8 KiB).
const MAX_LINE: usize = 8000;

pub struct Syslog {
    /// Connected on first use, and again after a send fails (the syslog daemon restarted).
    socket: Mutex<Option<UnixDatagram>>,
    pid: u32,
}

impl Syslog {
    pub fn new() -> Syslog {
        Syslog { socket: Mutex::new(None), pid: std::process::id() }
    }

    fn send(&self, severity: u8, message: &str) {
        let datagram = format_line(severity, self.pid, &crate::table::syslog_time(now()), message);
        let mut socket = self.socket.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for _attempt in 0..2 {
            if socket.is_none() {
                *socket = UnixDatagram::unbound().and_then(|s| s.connect(SOCKET).map(|()| s)).ok();
            }
            match socket.as_ref().map(|s| s.send(datagram.as_bytes())) {
                Some(Ok(_)) => return,
                Some(Err(_)) => *socket = None,
                None => return,
            }
        }
    }
}

fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// The syslog severity of a tracing level.
fn severity(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// One datagram: `<PRI>TIMESTAMP plyfs[PID]: MESSAGE`, the message on one line and cut to
/// [`MAX_LINE`] bytes.
fn format_line(severity: u8, pid: u32, timestamp: &str, message: &str) -> String {
    let mut line: String = message.trim_end().chars().map(|c| if c == '\n' { ' ' } else { c }).collect();
    if line.len() > MAX_LINE {
        let mut cut = MAX_LINE;
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        line.truncate(cut);
    }
    format!("<{}>{timestamp} plyfs[{pid}]: {line}", FACILITY_DAEMON * 8 + severity)
}

/// The text of one event, sent when the formatter is done with it.
pub struct Line<'a> {
    to: &'a Syslog,
    severity: u8,
    text: Vec<u8>,
}

impl Write for Line<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        if !self.text.is_empty() {
            self.to.send(self.severity, &String::from_utf8_lossy(&self.text));
        }
    }
}

impl<'a> MakeWriter<'a> for Syslog {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Line<'a> {
        Line { to: self, severity: severity(&Level::INFO), text: Vec::new() }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Line<'a> {
        Line { to: self, severity: severity(meta.level()), text: Vec::new() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_rfc3164_datagrams_of_the_daemon_facility() {
        assert_eq!(format_line(6, 42, "Nov 27 15:40:51", "mounted /a on /b\n"), "<30>Nov 27 15:40:51 plyfs[42]: mounted /a on /b");
        assert_eq!(format_line(3, 1, "Jan  2 03:04:05", "two\nlines"), "<27>Jan  2 03:04:05 plyfs[1]: two lines");
        assert_eq!(format_line(4, 1, "t", &"é".repeat(5000)).len(), "<28>t plyfs[1]: ".len() + MAX_LINE);
        assert_eq!(severity(&Level::WARN), 4);
    }
}
