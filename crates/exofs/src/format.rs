//! exofs's on-disk layout, inside exonodes.
//!
//! An inode is an exonode; its number is the exonode's sector. Its entries are:
//! - 0: the attributes ([`Inode`]), as application data;
//! - 1: immediate data: a small file's bytes, a symlink's target, or a small directory's records;
//! - 2: the extent map: for each extent entry, the file sector it starts at (holes between
//!   extents read as zeros);
//! - 3 onwards: extents holding the rest.
//!
//! A directory's contents are records `name length (u8) | name | inode (u64 LE) | kind (u8)`.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::time::SystemTime;

use plyfs_stack::{from_unix_time, unix_time, FileKind};

/// The attributes entry.
pub const ATTRS: u32 = 0;
/// The immediate-data entry.
pub const IMMEDIATE: u32 = 1;
/// The extent map entry.
pub const MAP: u32 = 2;

const VERSION: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inode {
    pub kind: FileKind,
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub rdev: u32,
    pub size: u64,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
    pub generation: u64,
}

fn kind_code(k: FileKind) -> u8 {
    match k {
        FileKind::File => 1,
        FileKind::Dir => 2,
        FileKind::Symlink => 3,
        FileKind::Fifo => 4,
        FileKind::Socket => 5,
        FileKind::CharDevice => 6,
        FileKind::BlockDevice => 7,
    }
}

fn kind_of(c: u8) -> Option<FileKind> {
    Some(match c {
        1 => FileKind::File,
        2 => FileKind::Dir,
        3 => FileKind::Symlink,
        4 => FileKind::Fifo,
        5 => FileKind::Socket,
        6 => FileKind::CharDevice,
        7 => FileKind::BlockDevice,
        _ => return None,
    })
}

fn put_time(b: &mut Vec<u8>, t: SystemTime) {
    let (secs, nanos) = unix_time(t);
    b.extend_from_slice(&secs.to_le_bytes());
    b.extend_from_slice(&nanos.to_le_bytes());
}

/// Why stored bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corrupt(pub &'static str);

impl std::fmt::Display for Corrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "corrupt exofs metadata ({})", self.0)
    }
}

impl Inode {
    /// A new object's attributes: owned by `uid`:`gid`, its times now, one link (two for a
    /// directory), empty.
    pub fn new(kind: FileKind, perm: u16, uid: u32, gid: u32) -> Inode {
        let now = SystemTime::now();
        Inode {
            kind,
            perm,
            uid,
            gid,
            nlink: if kind == FileKind::Dir { 2 } else { 1 },
            rdev: 0,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            generation: 1,
        }
    }

    pub const ENCODED_LEN: usize = 1 + 1 + 2 + 4 * 4 + 8 + 3 * 12 + 8;

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::ENCODED_LEN);
        b.push(VERSION);
        b.push(kind_code(self.kind));
        b.extend_from_slice(&self.perm.to_le_bytes());
        for v in [self.uid, self.gid, self.nlink, self.rdev] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.size.to_le_bytes());
        for t in [self.atime, self.mtime, self.ctime] {
            put_time(&mut b, t);
        }
        b.extend_from_slice(&self.generation.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Inode, Corrupt> {
        if b.len() != Self::ENCODED_LEN || b[0] != VERSION {
            return Err(Corrupt("inode attributes: length or version"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8"));
        let time_at = |i: usize| from_unix_time(u64_at(i) as i64, u32_at(i + 8));
        let nanos_ok = [28usize, 40, 52].iter().all(|&i| u32_at(i + 8) < 1_000_000_000);
        if !nanos_ok {
            return Err(Corrupt("inode attributes: a time"));
        }
        Ok(Inode {
            kind: kind_of(b[1]).ok_or(Corrupt("inode attributes: file kind"))?,
            perm: u16::from_le_bytes([b[2], b[3]]),
            uid: u32_at(4),
            gid: u32_at(8),
            nlink: u32_at(12),
            rdev: u32_at(16),
            size: u64_at(20),
            atime: time_at(28),
            mtime: time_at(40),
            ctime: time_at(52),
            generation: u64_at(64),
        })
    }
}

/// Extended attributes: name to value.
pub type Xattrs = BTreeMap<Vec<u8>, Vec<u8>>;

/// Extended attributes as kept after an inode's attributes: `(name len u8, value len u16,
/// name, value)*`.
pub fn encode_xattrs(x: &Xattrs) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, value) in x {
        b.push(name.len() as u8);
        b.extend_from_slice(&(value.len() as u16).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(value);
    }
    b
}

pub fn decode_xattrs(mut b: &[u8]) -> Result<Xattrs, Corrupt> {
    let mut x = Xattrs::new();
    while !b.is_empty() {
        if b.len() < 3 {
            return Err(Corrupt("extended attributes: truncated"));
        }
        let (n, v) = (b[0] as usize, u16::from_le_bytes([b[1], b[2]]) as usize);
        if n == 0 || b.len() < 3 + n + v {
            return Err(Corrupt("extended attributes: truncated"));
        }
        x.insert(b[3..3 + n].to_vec(), b[3 + n..3 + n + v].to_vec());
        b = &b[3 + n + v..];
    }
    Ok(x)
}

/// A directory's entries: name to inode number and kind.
pub type Dir = BTreeMap<OsString, (u64, FileKind)>;

pub fn encode_dir(d: &Dir) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, (ino, kind)) in d {
        let n = name.as_bytes();
        debug_assert!(!n.is_empty() && n.len() <= 255);
        b.push(n.len() as u8);
        b.extend_from_slice(n);
        b.extend_from_slice(&ino.to_le_bytes());
        b.push(kind_code(*kind));
    }
    b
}

pub fn decode_dir(mut b: &[u8]) -> Result<Dir, Corrupt> {
    let mut d = Dir::new();
    while !b.is_empty() {
        let n = b[0] as usize;
        if n == 0 || b.len() < 1 + n + 9 {
            return Err(Corrupt("directory record"));
        }
        let name = &b[1..1 + n];
        if name.contains(&b'/') || name.contains(&0) || name == b"." || name == b".." {
            return Err(Corrupt("directory entry name"));
        }
        let ino = u64::from_le_bytes(b[1 + n..9 + n].try_into().expect("8"));
        let kind = kind_of(b[9 + n]).ok_or(Corrupt("directory entry kind"))?;
        if d.insert(OsStr::from_bytes(name).to_owned(), (ino, kind)).is_some() {
            return Err(Corrupt("a name twice in a directory"));
        }
        b = &b[10 + n..];
    }
    Ok(d)
}

/// The extent map: (entry, file sector) pairs.
/// A piece of a file whose bytes were inserted or removed in the middle: file bytes
/// `logical..logical + len` are the bytes `store..store + len` of its extents (the *store*,
/// addressed as the file itself is when it has no pieces).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    pub logical: u64,
    pub len: u64,
    pub store: u64,
}

/// Marks the pieces after the extent map (an entry number no exonode has).
const SEGS: u32 = u32::MAX;

/// The extent map (entry, file sector) and, for a file with inserted or removed bytes, its
/// pieces after it: `(entry u32, sector u64)*` then `(logical, len, store)*` and a trailer
/// `(u32::MAX, count u64)`.
pub fn encode_map(m: &[(u32, u64)], segs: Option<&[Seg]>) -> Vec<u8> {
    let mut b = Vec::with_capacity(m.len() * 12 + segs.map_or(0, |s| s.len() * 24 + 12));
    for (e, l) in m {
        b.extend_from_slice(&e.to_le_bytes());
        b.extend_from_slice(&l.to_le_bytes());
    }
    if let Some(segs) = segs {
        for s in segs {
            for v in [s.logical, s.len, s.store] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        b.extend_from_slice(&SEGS.to_le_bytes());
        b.extend_from_slice(&(segs.len() as u64).to_le_bytes());
    }
    b
}

/// The extent map and the pieces, if any ([`encode_map`]).
#[allow(clippy::type_complexity)]
pub fn decode_map(b: &[u8]) -> Result<(Vec<(u32, u64)>, Option<Vec<Seg>>), Corrupt> {
    let u64_at = |c: &[u8], i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8"));
    let mut map = b;
    let mut segs = None;
    if b.len() >= 12 && b[b.len() - 12..b.len() - 8] == SEGS.to_le_bytes() {
        let n = u64_at(b, b.len() - 8) as usize;
        let bytes = n.checked_mul(24).filter(|l| l + 12 <= b.len()).ok_or(Corrupt("the pieces' count"))?;
        let at = b.len() - 12 - bytes;
        let list: Vec<Seg> =
            b[at..b.len() - 12].chunks(24).map(|c| Seg { logical: u64_at(c, 0), len: u64_at(c, 8), store: u64_at(c, 16) }).collect();
        if list.windows(2).any(|w| w[0].logical + w[0].len != w[1].logical) || list.first().is_some_and(|s| s.logical != 0) {
            return Err(Corrupt("the pieces do not follow each other"));
        }
        segs = Some(list);
        map = &b[..at];
    }
    if !map.len().is_multiple_of(12) {
        return Err(Corrupt("extent map length"));
    }
    let m = map.chunks(12).map(|c| (u32::from_le_bytes(c[..4].try_into().expect("4")), u64_at(c, 4))).collect();
    Ok((m, segs))
}

/// `name` as a directory may hold it.
pub fn valid_name(name: &OsStr) -> bool {
    let n = name.as_bytes();
    !n.is_empty() && n.len() <= 255 && !n.contains(&b'/') && !n.contains(&0) && n != b"." && n != b".."
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kinds() -> impl Strategy<Value = FileKind> {
        (1u8..=7).prop_map(|c| kind_of(c).unwrap())
    }

    fn times() -> impl Strategy<Value = SystemTime> {
        (-4_000_000_000i64..4_000_000_000, 0u32..1_000_000_000).prop_map(|(s, n)| from_unix_time(s, n))
    }

    proptest! {
        #[test]
        fn inodes_round_trip(kind in kinds(), perm in 0u16..0o7777, uid: u32, gid: u32, nlink: u32, rdev: u32, size: u64,
                             atime in times(), mtime in times(), ctime in times(), generation: u64) {
            let i = Inode { kind, perm, uid, gid, nlink, rdev, size, atime, mtime, ctime, generation };
            let b = i.encode();
            prop_assert_eq!(b.len(), Inode::ENCODED_LEN);
            prop_assert_eq!(Inode::decode(&b).unwrap(), i);
        }

        #[test]
        fn directories_round_trip(entries in proptest::collection::btree_map("[a-zA-Z0-9._-]{1,40}", (any::<u64>(), kinds()), 0..50)) {
            let d: Dir = entries.into_iter().filter(|(n, _)| n != "." && n != "..").map(|(n, v)| (OsString::from(n), v)).collect();
            prop_assert_eq!(decode_dir(&encode_dir(&d)).unwrap(), d);
        }

        #[test]
        fn garbage_is_refused_or_read_never_a_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Inode::decode(&b);
            let _ = decode_dir(&b);
        }
    }
}
