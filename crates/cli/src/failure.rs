//! Why a command failed: the one line it prints, and the exit status scripts can tell apart.
//!
//! The statuses follow gocryptfs's (`internal/exitcodes`) where a failure is the same, so that
//! scripts written for it read plyfs's the same way; plyfs's own failures take numbers gocryptfs
//! does not use. Errors are classified where their typed form is at hand (the crates' error
//! enums); a plain `String` is the general failure, 1.

use std::fmt;

/// The exit statuses, as `man plyfs` (EXIT STATUS) and the README list them.
pub mod code {
    /// Any other failure: the message says what.
    pub const OTHER: u8 = 1;
    /// The command line is wrong: an unknown or missing argument, conflicting options, a bad
    /// stack or mount option (as clap, getopt and mount(8) helpers exit).
    pub const USAGE: u8 = 2;
    /// LOWER is missing or not a directory (gocryptfs: CipherDir).
    pub const LOWER: u8 = 6;
    /// Not a crypt volume, or its configuration is damaged or unknown (gocryptfs: LoadConf).
    pub const CONFIG: u8 = 8;
    /// The mount point is missing, not a directory, not empty, already mounted on, or nested
    /// with a directory the stack stores in (gocryptfs: MountPoint).
    pub const MOUNT_POINT: u8 = 10;
    /// The password, key file or master key does not unlock the volume (gocryptfs:
    /// PasswordIncorrect).
    pub const WRONG_SECRET: u8 = 12;
    /// The kernel's mount failed: /dev/fuse, mount(2), fusermount3 (gocryptfs: FuseNewServer).
    pub const FUSE: u8 = 19;
    /// fsck found damaged data (gocryptfs: FsckErrors).
    pub const FSCK: u8 = 26;
    /// A directory the stack stores in is in use by another mount or tool.
    pub const IN_USE: u8 = 32;
    /// The server (`unix:`, `tcp:`, `ext:` or `exodisk:`) cannot be reached or refused us.
    pub const UNREACHABLE: u8 = 33;
}

/// A failed command: what to print after `plyfs: `, and the exit status.
#[derive(Debug, PartialEq, Eq)]
pub struct Failure {
    pub code: u8,
    pub msg: String,
}

impl Failure {
    pub fn new(code: u8, msg: impl fmt::Display) -> Failure {
        Failure { code, msg: msg.to_string() }
    }

    pub fn usage(msg: impl fmt::Display) -> Failure {
        Failure::new(code::USAGE, msg)
    }

    /// The line a background daemon sends its parent (`ERR CODE MESSAGE`), and back.
    pub fn to_report(&self) -> String {
        // One line: the parent reads the report up to its newline.
        format!("ERR {} {}", self.code, self.msg.trim_end().replace('\n', "; "))
    }

    pub fn from_report(rest: &str) -> Failure {
        match rest.split_once(' ').and_then(|(c, m)| Some((c.parse().ok()?, m))) {
            Some((code, msg)) => Failure::new(code, msg),
            None => Failure::new(code::OTHER, rest),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl From<String> for Failure {
    fn from(msg: String) -> Failure {
        Failure::new(code::OTHER, msg)
    }
}

impl From<&str> for Failure {
    fn from(msg: &str) -> Failure {
        Failure::new(code::OTHER, msg)
    }
}

/// For code that reports in words: the message, without its status.
impl From<Failure> for String {
    fn from(f: Failure) -> String {
        f.msg
    }
}

impl From<plyfs_layers::Error> for Failure {
    fn from(e: plyfs_layers::Error) -> Failure {
        Failure::new(layers_code(&e), e)
    }
}

impl From<plyfs_fuse::Error> for Failure {
    fn from(e: plyfs_fuse::Error) -> Failure {
        Failure::new(fuse_code(&e), e)
    }
}

impl From<plyfs_assemble::Error> for Failure {
    fn from(e: plyfs_assemble::Error) -> Failure {
        use plyfs_assemble::Error as E;
        let code = match &e {
            E::Spec(_) => code::USAGE,
            E::InUse(_) => code::IN_USE,
            E::Nested(_) => code::MOUNT_POINT,
            E::Below(below) => below_code(below.as_ref()),
            E::Path { .. } | E::File { .. } | E::Run(_) | E::Msg(_) => code::OTHER,
        };
        Failure::new(code, e)
    }
}

fn layers_code(e: &plyfs_layers::Error) -> u8 {
    use plyfs_layers::Error as E;
    match e {
        E::WrongSecret { .. } | E::WrongSecretKind { .. } => code::WRONG_SECRET,
        E::NotAVolume { .. } | E::Corrupt { .. } | E::Unsupported { .. } | E::BadVolumeId { .. } => code::CONFIG,
        E::Connect { .. } => code::UNREACHABLE,
        _ => code::OTHER,
    }
}

fn fuse_code(e: &plyfs_fuse::Error) -> u8 {
    use plyfs_fuse::Error as E;
    match e {
        E::MountPoint { .. } | E::MountPointBusy { .. } | E::MountPointNotEmpty { .. } => code::MOUNT_POINT,
        E::UnknownOption { .. } => code::USAGE,
        E::Device { .. } | E::Mount { .. } => code::FUSE,
        _ => code::OTHER,
    }
}

/// The status of an error a crate below `plyfs-assemble` reported through it.
fn below_code(e: &(dyn std::error::Error + Send + Sync + 'static)) -> u8 {
    if let Some(e) = e.downcast_ref::<plyfs_layers::Error>() {
        layers_code(e)
    } else if let Some(e) = e.downcast_ref::<plyfs_fuse::Error>() {
        fuse_code(e)
    } else if let Some(e) = e.downcast_ref::<plyfs_transport::Error>() {
        match e {
            plyfs_transport::Error::Peer { .. } | plyfs_transport::Error::NotAllowed { .. } => code::UNREACHABLE,
            _ => code::OTHER,
        }
    } else if let Some(e) = e.downcast_ref::<plyfs_exodisk::Error>() {
        match e {
            plyfs_exodisk::Error::Unreachable { .. } | plyfs_exodisk::Error::Refused { .. } | plyfs_exodisk::Error::NotAService { .. } => {
                code::UNREACHABLE
            }
            _ => code::OTHER,
        }
    } else {
        code::OTHER
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_daemon_report_keeps_its_code() {
        let f = Failure::new(code::WRONG_SECRET, "volume /l: wrong password");
        assert_eq!(Failure::from_report(f.to_report().strip_prefix("ERR ").unwrap()), f);
        assert_eq!(Failure::from_report("an older daemon's message"), Failure::new(code::OTHER, "an older daemon's message"));
        let two = Failure::new(code::OTHER, "first\nsecond\n");
        assert_eq!(two.to_report(), "ERR 1 first; second", "one line");
    }

    #[test]
    fn the_manual_lists_every_status() {
        use code::*;
        for status in [OTHER, USAGE, LOWER, CONFIG, MOUNT_POINT, WRONG_SECRET, FUSE, FSCK, IN_USE, UNREACHABLE] {
            assert!(crate::MAN_EXTRA.contains(&format!(".B {status}\n")), "man plyfs, EXIT STATUS, lacks {status}");
        }
    }

    #[test]
    fn typed_errors_are_classified_and_words_are_general() {
        assert_eq!(Failure::from("anything".to_owned()).code, code::OTHER);
        let nested = plyfs_assemble::Error::Nested("mount point /l/m lies inside lower directory /l".into());
        assert_eq!(Failure::from(nested).code, code::MOUNT_POINT);
        let wrong = plyfs_layers::Error::WrongSecret { path: "/l/.plyfs-crypt.conf".into(), secret: "password" };
        assert_eq!(Failure::from(plyfs_assemble::Error::from(wrong)).code, code::WRONG_SECRET);
        let refused = plyfs_layers::Error::Connect { peer: "unix:/s".into(), why: "refused".into() };
        assert_eq!(Failure::from(refused).code, code::UNREACHABLE);
    }
}
