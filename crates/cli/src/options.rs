//! `-o` mount options: plyfs's own tunables and the usual FUSE/kernel mount flags.

use std::time::Duration;

use plyfs_fuse::mount::KERNEL_FLAGS;
use plyfs_fuse::UringChoice;

#[derive(Clone, Debug, PartialEq)]
pub struct MountOptions {
    pub passthrough: bool,
    /// Carry requests over FUSE io_uring (`-o io_uring=auto|on|off`; `auto`, the default, where
    /// the kernel allows it).
    pub io_uring: UringChoice,
    pub entry_ttl: Duration,
    pub attr_ttl: Duration,
    pub threads: usize,
    /// The kernel's read-ahead for the mount, in KiB (the kernel's own by default).
    pub readahead_kb: Option<u32>,
    pub allow_other: bool,
    pub allow_root: bool,
    pub read_only: bool,
    /// Other mounts share the lower tree (`-o shared`).
    pub shared: bool,
    pub flags: Vec<String>,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            passthrough: true,
            io_uring: UringChoice::Auto,
            entry_ttl: Duration::from_secs(1),
            attr_ttl: Duration::from_secs(1),
            threads: 4,
            readahead_kb: None,
            allow_other: false,
            allow_root: false,
            read_only: false,
            shared: false,
            flags: Vec::new(),
        }
    }
}

pub const HELP: &str = "comma-separated: passthrough=on|off, io_uring=auto|on|off (auto: where the kernel allows it), entry_timeout=SECS, attr_timeout=SECS, threads=N, readahead=KIB, \
shared, allow_other, allow_root, ro, and the kernel flags (nosuid, nodev, noexec, noatime, ...)";

fn seconds(key: &str, v: &str) -> Result<Duration, String> {
    let s: f64 = v.parse().map_err(|_| format!("-o {key}={v}: not a number of seconds"))?;
    if !(0.0..=86400.0).contains(&s) {
        return Err(format!("-o {key}={v}: must be between 0 and 86400 seconds"));
    }
    Ok(Duration::from_secs_f64(s))
}

/// Parse every `-o` argument given, in order.
pub fn parse(args: &[String]) -> Result<MountOptions, String> {
    let mut o = MountOptions::default();
    for opt in args.iter().flat_map(|a| a.split(',')).map(str::trim).filter(|s| !s.is_empty()) {
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (opt, None),
        };
        match (key, value) {
            ("passthrough", Some("on" | "true" | "yes")) => o.passthrough = true,
            ("passthrough", Some("off" | "false" | "no")) => o.passthrough = false,
            ("passthrough", v) => return Err(format!("-o passthrough={}: expected on or off", v.unwrap_or(""))),
            ("io_uring", Some("auto")) => o.io_uring = UringChoice::Auto,
            ("io_uring", Some("on" | "true" | "yes")) => o.io_uring = UringChoice::On,
            ("io_uring", Some("off" | "false" | "no")) => o.io_uring = UringChoice::Off,
            ("io_uring", v) => return Err(format!("-o io_uring={}: expected auto, on or off", v.unwrap_or(""))),
            ("entry_timeout", Some(v)) => o.entry_ttl = seconds(key, v)?,
            ("attr_timeout", Some(v)) => o.attr_ttl = seconds(key, v)?,
            ("threads", Some(v)) => {
                o.threads = v.parse().ok().filter(|n| (1..=64).contains(n)).ok_or(format!("-o threads={v}: expected 1 to 64"))?
            }
            ("readahead", Some(v)) => {
                o.readahead_kb = Some(
                    v.parse()
                        .ok()
                        .filter(|n| (4..=65536).contains(n))
                        .ok_or(format!("-o readahead={v}: expected 4 to 65536 (KiB)"))?,
                )
            }
            ("allow_other", None) => o.allow_other = true,
            ("allow_root", None) => o.allow_root = true,
            ("ro", None) => o.read_only = true,
            ("shared", None) => o.shared = true,
            ("default_permissions", None) => {} // always on
            (flag, None) if KERNEL_FLAGS.contains(&flag) => o.flags.push(flag.to_owned()),
            _ => return Err(format!("unknown mount option '{opt}' ({HELP})")),
        }
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_own_and_kernel_options() {
        let o = parse(&["passthrough=off,attr_timeout=2.5".into(), "allow_other,noexec,threads=8".into()]).unwrap();
        assert!(!o.passthrough);
        assert_eq!(o.attr_ttl, Duration::from_millis(2500));
        assert!(o.allow_other);
        assert_eq!(o.threads, 8);
        assert_eq!(o.flags, vec!["noexec".to_owned()]);
    }

    #[test]
    fn rejects_unknown_and_malformed_options() {
        assert!(parse(&["bogus".into()]).unwrap_err().contains("unknown mount option 'bogus'"));
        assert!(parse(&["threads=0".into()]).is_err());
        assert!(parse(&["attr_timeout=abc".into()]).is_err());
        assert!(parse(&["passthrough=maybe".into()]).is_err());
        assert_eq!(parse(&[]).unwrap().io_uring, UringChoice::Auto);
        assert_eq!(parse(&["io_uring=auto".into()]).unwrap().io_uring, UringChoice::Auto);
        assert_eq!(parse(&["io_uring=on".into()]).unwrap().io_uring, UringChoice::On);
        assert_eq!(parse(&["io_uring=off".into()]).unwrap().io_uring, UringChoice::Off);
        assert!(parse(&["io_uring=maybe".into()]).unwrap_err().contains("expected auto, on or off"));
    }
}
