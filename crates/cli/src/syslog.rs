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
    path: &'static str,
    pid: u32,
}

impl Syslog {
    pub fn new() -> Syslog {
        Syslog::at(SOCKET)
    }

    fn at(path: &'static str) -> Syslog {
        Syslog { socket: Mutex::new(None), path, pid: std::process::id() }
    }

    fn send(&self, severity: u8, message: &str) {
        let datagram = format_line(severity, self.pid, &crate::table::syslog_time(now()), message);
        let mut socket = self.socket.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for _attempt in 0..2 {
            if socket.is_none() {
                // Non-blocking: a syslog daemon that stops reading (restarting, stalled) fills the
                // socket's queue, and a blocking send would then stop every thread that logs,
                // the mount's request threads among them.
                *socket = UnixDatagram::unbound().and_then(|s| s.connect(self.path).and(s.set_nonblocking(true)).map(|()| s)).ok();
            }
            match socket.as_ref().map(|s| s.send(datagram.as_bytes())) {
                Some(Ok(_)) => return,
                // The queue is full: the line is lost, as syslog(3)'s are, rather than the mount.
                Some(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => return,
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
    // One line, with no control character that a log reader would show raw (`\r`, ESC...).
    let mut line: String = message
        .trim_end()
        .chars()
        .map(|c| match c {
            '\n' => " ".to_owned(),
            c if c.is_control() && c != '\t' => c.escape_default().to_string(),
            c => c.to_string(),
        })
        .collect();
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
    fn a_syslog_daemon_that_stops_reading_loses_lines_not_the_mount() {
        let dir = tempfile::tempdir().unwrap();
        let path: &'static str = Box::leak(dir.path().join("log").to_str().unwrap().to_owned().into_boxed_str());
        let reader = UnixDatagram::bind(path).unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let log = Syslog::at(path);
            for i in 0..1000 {
                log.send(6, &format!("line {i}"));
            }
            let _ = done.send(());
        });
        // A blocking send would stop after the socket's queue (about ten datagrams) was full.
        assert!(finished.recv_timeout(std::time::Duration::from_secs(10)).is_ok(), "sending blocked");
        let mut first = [0u8; 100];
        let n = reader.recv(&mut first).unwrap();
        assert!(first[..n].ends_with(b": line 0"), "{}", String::from_utf8_lossy(&first[..n]));
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(format_line(6, 1, "t", "a\rb\u{1b}[2Jc\td"), "<30>t plyfs[1]: a\\rb\\u{1b}[2Jc\td");
    }

    #[test]
    fn lines_are_rfc3164_datagrams_of_the_daemon_facility() {
        assert_eq!(format_line(6, 42, "Nov 27 15:40:51", "mounted /a on /b\n"), "<30>Nov 27 15:40:51 plyfs[42]: mounted /a on /b");
        assert_eq!(format_line(3, 1, "Jan  2 03:04:05", "two\nlines"), "<27>Jan  2 03:04:05 plyfs[1]: two lines");
        assert_eq!(format_line(4, 1, "t", &"é".repeat(5000)).len(), "<28>t plyfs[1]: ".len() + MAX_LINE);
        assert_eq!(severity(&Level::WARN), 4);
    }
}
