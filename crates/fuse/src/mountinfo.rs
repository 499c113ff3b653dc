//! Reading `/proc/self/mountinfo`: which mount a path is on, and who owns it.

use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// `major:minor` of the mounted file system: for FUSE, one per connection.
    pub dev: String,
    pub mountpoint: PathBuf,
    pub fstype: String,
    pub source: String,
    /// `user_id=` of a FUSE mount: the user the daemon runs as.
    pub user_id: Option<u32>,
    /// The file system's own options (`nolock`, `local_lock=all`, ...).
    pub super_options: Vec<String>,
}

impl MountEntry {
    pub fn is_plyfs(&self) -> bool {
        self.fstype == "fuse.plyfs"
    }
}

/// Undo the octal escapes (`\040` for a space) mountinfo uses in paths.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b)) {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parse one line of mountinfo.
pub fn parse_line(line: &str) -> Option<MountEntry> {
    let (left, right) = line.split_once(" - ")?;
    let dev = left.split(' ').nth(2)?.to_owned();
    let mountpoint = unescape(left.split(' ').nth(4)?);
    let mut right = right.split(' ');
    let fstype = right.next()?.to_owned();
    let source = unescape(right.next()?);
    let super_opts = right.next().unwrap_or("");
    let user_id = super_opts.split(',').find_map(|o| o.strip_prefix("user_id=")).and_then(|v| v.parse().ok());
    let super_options = super_opts.split(',').filter(|o| !o.is_empty()).map(str::to_owned).collect();
    Some(MountEntry { dev, mountpoint: PathBuf::from(mountpoint), fstype, source, user_id, super_options })
}

pub fn mounts() -> Vec<MountEntry> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|text| text.lines().filter_map(parse_line).collect())
        .unwrap_or_default()
}

/// The mount whose mount point is exactly `path` (the last one, if stacked).
pub fn mount_at(path: &Path) -> Option<MountEntry> {
    mounts().into_iter().rev().find(|m| m.mountpoint == path)
}

/// The innermost mount containing `path`.
pub fn mount_containing(path: &Path) -> Option<MountEntry> {
    mounts()
        .into_iter()
        .rev()
        .filter(|m| path.starts_with(&m.mountpoint))
        .max_by_key(|m| m.mountpoint.components().count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_fuse_line_with_escapes() {
        let line = "123 29 0:55 / /tmp/my\\040mnt rw,nosuid,nodev,relatime shared:1 - fuse.plyfs /data rw,user_id=1000,group_id=1000,default_permissions";
        let m = parse_line(line).unwrap();
        assert_eq!(m.mountpoint, PathBuf::from("/tmp/my mnt"));
        assert_eq!(m.fstype, "fuse.plyfs");
        assert_eq!(m.source, "/data");
        assert_eq!(m.user_id, Some(1000));
        assert!(m.is_plyfs());
        assert_eq!(m.super_options, ["rw", "user_id=1000", "group_id=1000", "default_permissions"]);
    }

    #[test]
    fn optional_fields_do_not_confuse_the_parser() {
        let line = "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 shared:7 - ext3 /dev/root rw,errors=continue";
        let m = parse_line(line).unwrap();
        assert_eq!(m.mountpoint, PathBuf::from("/mnt2"));
        assert_eq!(m.fstype, "ext3");
        assert_eq!(m.user_id, None);
    }
}
