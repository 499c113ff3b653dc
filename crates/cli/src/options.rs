//! `-o` mount options: plyfs's own tunables and the usual FUSE/kernel mount flags.

use std::time::Duration;

use plyfs_fuse::mount::KERNEL_FLAGS;
use plyfs_assemble::mount::MountOptions;
use plyfs_fuse::{FanIn, UringChoice};

pub const HELP: &str = "comma-separated: passthrough=on|off, io_uring=auto|on|off (auto: where the kernel allows it), entry_timeout=SECS, attr_timeout=SECS, threads=N, readahead=KIB, \
idle=DURATION (unmount after that long unused: 90s, 10m, 1h30m), fanin=owner|all|none (who may use MNT/.plyfs/: the mount's owner and root, the default; \
every user the mount lets in; no one), shared, allow_other, allow_root, ro, nonempty (mount over files, hiding them), fsname=NAME (the source the mount shows), syslog (the daemon logs to syslog, not a file), and the kernel flags (nosuid, nodev, noexec, noatime, ...)";

/// A source name the kernel shows in /proc/mounts: printable, without the blanks and backslashes
/// that tools splitting its fields would misread.
fn fsname(v: &str) -> Result<String, String> {
    if v.is_empty() || v.len() > 255 || v.chars().any(|c| c.is_control() || c.is_whitespace() || c == '\\') {
        return Err(format!("-o fsname={v}: expected 1 to 255 printable characters without blanks or backslashes"));
    }
    Ok(v.to_owned())
}

fn seconds(key: &str, v: &str) -> Result<Duration, String> {
    let s: f64 = v.parse().map_err(|_| format!("-o {key}={v}: not a number of seconds"))?;
    if !(0.0..=86400.0).contains(&s) {
        return Err(format!("-o {key}={v}: must be between 0 and 86400 seconds"));
    }
    Ok(Duration::from_secs_f64(s))
}

/// A duration as people write it: `90`, `90s`, `10m`, `2h`, `1h30m`, `500ms`.
pub fn duration(key: &str, v: &str) -> Result<Duration, String> {
    let bad = || format!("-o {key}={v}: not a duration (e.g. 90s, 10m, 1h30m)");
    let mut total = Duration::ZERO;
    let mut rest = v.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        let n: f64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let secs = match &rest[..unit] {
            "" | "s" => 1.0,
            "ms" => 0.001,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            "d" => 86400.0,
            _ => return Err(bad()),
        };
        rest = &rest[unit..];
        total += Duration::try_from_secs_f64(n * secs).map_err(|_| bad())?;
    }
    if total.is_zero() {
        return Err(format!("-o {key}={v}: must be longer than nothing"));
    }
    Ok(total)
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
            ("rw", None) => o.read_only = false,
            ("idle", Some(v)) => o.idle = Some(duration(key, v)?),
            ("shared", None) => o.shared = true,
            ("syslog", None) => o.syslog = true,
            ("nonempty", None) => o.nonempty = true,
            ("fanin", Some(v)) => {
                o.fanin = FanIn::parse(v).ok_or(format!("-o fanin={v}: expected owner, all or none"))?
            }
            ("fsname", Some(v)) => o.fsname = Some(fsname(v)?),
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
        assert_eq!(parse(&[]).unwrap().fanin, FanIn::Owner);
        assert_eq!(parse(&["fanin=all".into()]).unwrap().fanin, FanIn::All);
        assert_eq!(parse(&["fanin=none".into()]).unwrap().fanin, FanIn::None);
        assert!(parse(&["fanin=everyone".into()]).unwrap_err().contains("owner, all or none"));
        let o = parse(&["passthrough=off,attr_timeout=2.5".into(), "allow_other,noexec,threads=8".into()]).unwrap();
        assert!(!o.passthrough);
        assert_eq!(o.attr_ttl, Duration::from_millis(2500));
        assert!(o.allow_other);
        assert!(!o.syslog && parse(&["syslog".into()]).unwrap().syslog);
        assert_eq!(o.threads, 8);
        assert_eq!(o.flags, vec!["noexec".to_owned()]);
    }

    #[test]
    fn rejects_unknown_and_malformed_options() {
        assert!(parse(&["bogus".into()]).unwrap_err().contains("unknown mount option 'bogus'"));
        assert!(parse(&["threads=0".into()]).is_err());
        assert!(parse(&["attr_timeout=abc".into()]).is_err());
        assert!(parse(&["passthrough=maybe".into()]).is_err());
        assert_eq!(parse(&["fsname=source:/srv/t".into()]).unwrap().fsname.as_deref(), Some("source:/srv/t"));
        assert!(parse(&["fsname=a b".into()]).is_err());
        assert!(parse(&["fsname=".into()]).is_err());
        assert_eq!(parse(&[]).unwrap().io_uring, UringChoice::Auto);
        assert_eq!(parse(&["io_uring=auto".into()]).unwrap().io_uring, UringChoice::Auto);
        assert_eq!(parse(&["io_uring=on".into()]).unwrap().io_uring, UringChoice::On);
        assert_eq!(parse(&["io_uring=off".into()]).unwrap().io_uring, UringChoice::Off);
        assert!(parse(&["io_uring=maybe".into()]).unwrap_err().contains("expected auto, on or off"));
    }

    #[test]
    fn parses_idle_durations() {
        let idle = |v: &str| parse(&[format!("idle={v}")]).map(|o| o.idle.unwrap());
        assert_eq!(idle("90").unwrap(), Duration::from_secs(90));
        assert_eq!(idle("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(idle("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(idle("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(idle("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(idle("soon").unwrap_err().contains("not a duration"));
        assert!(idle("5x").is_err());
        assert!(idle("0s").unwrap_err().contains("longer than nothing"));
        assert_eq!(parse(&[]).unwrap().idle, None);
    }
}
