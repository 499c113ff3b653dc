//! `crypt-names`: the names of a crypt volume. It sits directly on the lower directory, under
//! the per-file routing, so everything above it (rules matching on paths, `trace`) sees
//! plaintext names and everything below holds ciphertext.
//!
//! - **Names** are sealed with AES-SIV (RFC 5297, deterministic), keyed per volume and bound to
//!   their directory by a random 16-byte directory id (`user.plyfs.dirid` on the lower
//!   directory; the root's comes from the key). Equal names in two directories look different,
//!   and a lookup is one encryption, no search. Names are padded to a multiple of 16 bytes first,
//!   so their ciphertext shows their length only roughly. The lower name is the sealed bytes in
//!   unpadded base64url.
//! - **Long names**, whose encrypted form would pass 255 bytes, are stored under
//!   `L.<base64url(SHA-256(encrypted name))>`, with the encrypted name itself in a companion
//!   file `L.<hash>.name` beside it (as gocryptfs does). Neither form can be a short encrypted
//!   name, which never contains a dot.
//! - **Symlink targets** are sealed with AES-256-GCM under a random nonce. A sealed target too
//!   long for a lower symlink (a plaintext target of more than about 3,000 bytes, up to
//!   PATH_MAX - 1) is stored in a companion file `T.<base64url(SHA-256(sealed))>` beside the
//!   symlink, whose own target is then a 53-byte marker: the companion's name, a dot and the
//!   plaintext length in seven digits. No sealed target is 53 bytes long (unpadded base64 is
//!   never one byte longer than a multiple of four), so the lower size tells a marker apart.
//!   Every directory holding a name of such a symlink holds its companion; the companion goes
//!   with the symlink's last name.
//! - **Directory ids** are read from `user.plyfs.dirid`, or else from a file `.plyfs-dirid` in the
//!   directory (what a reverse view shows, and what survives a copy that drops extended
//!   attributes).
//! - Lower names that do not decrypt (the volume configuration, strays) are not shown.
//!
//! With `plaintext_names` the layer changes no name; it only hides the volume configuration.
//!
//! Renames and hard links need nothing special for names: a name's ciphertext depends only on
//! the name and its directory, and a directory's id moves with it. On a volume made with
//! `--bind-paths`, this layer also binds each file's content to its place, checks the binding
//! at open and moves it on rename and link (see [`super::bind`]).

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::Arc;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::Aes256Gcm;
use aes_siv::siv::Aes256Siv;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine as _;
use parking_lot::{Mutex, RwLock};
use plyfs_stack::{
    bypass, Attr, Caller, DirEntry, Entry, Error, FileKind, Layer, Level, NodeId, Op, Reply, Result, XattrReply,
};
use sha2::Digest;
use zeroize::Zeroizing;

use super::bind::{self, BindKey, Head, Stored, Verdict, BIND_XATTR, HEAD_BYTES};
use super::keys::{random_bytes, Volume, CONFIG_NAME};

/// The lower attribute holding a directory's id.
pub const DIRID_XATTR: &str = "user.plyfs.dirid";
const LONG_PREFIX: &str = "L.";
const COMPANION_SUFFIX: &str = ".name";
const NAME_MAX: usize = 255;
/// The longest symlink target the lower file system stores (ext4: a block less one byte).
const LOWER_LINK_MAX: usize = 4095;
const LINK_NONCE: usize = 12;
pub const LINK_OVERHEAD: usize = LINK_NONCE + 16;
/// The prefix of a long target's companion file.
const TARGET_PREFIX: &str = "T.";
/// `T.` and 43 characters of hash: a long target's companion file's name.
const TARGET_COMPANION_LEN: usize = 45;
/// The companion's name, a dot and seven digits: what a symlink with a long target points to.
pub const MARKER_LEN: usize = 53;
/// The file that holds a directory's id where the extended attribute cannot (reverse views,
/// copies that drop extended attributes).
pub const DIRID_FILE: &str = ".plyfs-dirid";

/// A name as stored below.
pub enum LowerName {
    /// The whole name.
    Short(OsString),
    /// The hashed name, and the full encrypted name for its companion file.
    Long { hashed: OsString, full: String },
}

impl LowerName {
    pub fn name(&self) -> &OsStr {
        match self {
            LowerName::Short(n) => n,
            LowerName::Long { hashed, .. } => hashed,
        }
    }
}

pub struct CryptNames {
    name: String,
    lower: [Level; 1],
    plaintext: bool,
    siv_key: Zeroizing<[u8; 64]>,
    links: Aes256Gcm,
    root_id: [u8; 16],
    /// Directory ids by node. A directory made here always (re)sets its entry, so a reused
    /// inode number cannot keep an old id.
    dirs: RwLock<HashMap<NodeId, [u8; 16]>>,
    /// Symlinks with long targets this mount has seen, and where.
    long_targets: RwLock<LongTargets>,
    /// Files bound to their places, on a volume made with `--bind-paths`.
    bind: Option<Binding>,
    /// A name that does not decrypt was hidden with a warning: the next ones are debug lines.
    warned_hidden: std::sync::atomic::AtomicBool,
}

/// What binding files to their places needs: the key, and where each file known above is.
struct Binding {
    key: BindKey,
    /// Regular files by node: the place they were last found or made at, and how many lookups
    /// above hold them (the entry goes when they are all forgotten).
    places: RwLock<HashMap<NodeId, FilePlace>>,
    /// Refusals already logged, so that a file retried in a loop is one line.
    reported: Mutex<HashSet<(NodeId, [u8; 16], OsString)>>,
}

/// Where a file is: its directory's id (not the directory's node, which a lookup above may
/// already have let go of) and its lower name.
struct FilePlace {
    dir_id: [u8; 16],
    lower_name: OsString,
    lookups: u64,
}

/// Where the companions of long symlink targets are: by node (a directory holding one of its
/// names, and so its companion), and by lower name. Such symlinks are rare; entries go when
/// their names do.
#[derive(Default)]
struct LongTargets {
    nodes: HashMap<NodeId, LongTarget>,
    names: HashMap<(NodeId, OsString), NodeId>,
}

#[derive(Clone)]
struct LongTarget {
    dir: NodeId,
    companion: OsString,
    len: u64,
}

/// A symlink target as stored below.
pub enum SealedTarget {
    /// The lower symlink's target.
    Inline(OsString),
    /// Too long for a lower symlink: the marker it points to, and the companion holding `blob`.
    Long { marker: OsString, companion: OsString, blob: Vec<u8> },
}

impl SealedTarget {
    /// How `blob` (nonce, sealed target and tag) of a target `len` bytes long is stored.
    pub fn of(blob: Vec<u8>, len: usize) -> SealedTarget {
        let text = B64.encode(&blob);
        if text.len() <= LOWER_LINK_MAX {
            return SealedTarget::Inline(text.into());
        }
        let companion = format!("{TARGET_PREFIX}{}", B64.encode(sha2::Sha256::digest(&blob)));
        debug_assert_eq!(companion.len(), TARGET_COMPANION_LEN);
        let marker = format!("{companion}.{len:07}");
        debug_assert_eq!(marker.len(), MARKER_LEN);
        SealedTarget::Long { marker: marker.into(), companion: companion.into(), blob }
    }
}

/// Seal the name `bytes` (neither empty, `.` nor `..`, at most 255 bytes) of an entry of the
/// directory whose id is `id`: padded to a multiple of 16 bytes, AES-SIV with the id as
/// associated data, base64url; hashed, with a companion, when that passes 255 bytes.
pub fn seal_name(siv_key: &[u8; 64], id: &[u8; 16], bytes: &[u8]) -> Result<LowerName> {
    let pad = 16 - bytes.len() % 16;
    let mut padded = Zeroizing::new(Vec::with_capacity(bytes.len() + pad));
    padded.extend_from_slice(bytes);
    padded.resize(bytes.len() + pad, pad as u8);
    let sealed = Aes256Siv::new(siv_key.into())
        .encrypt([&id[..]], &padded)
        .map_err(|_| Error::Corrupt("name encryption failed".into()))?;
    let full = B64.encode(sealed);
    if full.len() <= NAME_MAX {
        return Ok(LowerName::Short(full.into()));
    }
    let hash = B64.encode(sha2::Sha256::digest(full.as_bytes()));
    Ok(LowerName::Long { hashed: format!("{LONG_PREFIX}{hash}").into(), full })
}

/// The name sealed as `stored` (a short lower name) in the directory whose id is `id`, if it
/// is one: authentic, well padded, and a name (not empty, `.` or `..`, no `/` or NUL).
pub fn open_name(siv_key: &[u8; 64], id: &[u8; 16], stored: &[u8]) -> Option<Vec<u8>> {
    let sealed = B64.decode(stored).ok()?;
    let mut padded = Aes256Siv::new(siv_key.into()).decrypt([&id[..]], &sealed).ok()?;
    let pad = *padded.last()? as usize;
    if pad == 0 || pad > 16 || pad > padded.len() || !padded[padded.len() - pad..].iter().all(|b| *b as usize == pad) {
        return None;
    }
    padded.truncate(padded.len() - pad);
    let ok = !padded.is_empty() && !padded.contains(&b'/') && !padded.contains(&0) && padded != b"." && padded != b"..";
    ok.then_some(padded)
}

/// The keys of a volume's names: AES-SIV for names, and the root directory's id.
pub fn name_keys(volume: &Volume) -> (Zeroizing<[u8; 64]>, [u8; 16]) {
    (volume.key.subkey::<64>("names aes-siv"), *volume.key.subkey::<16>("names root directory id"))
}

/// The companion file of a long name.
pub fn long_name_companion(hashed: &OsStr) -> OsString {
    let mut c = hashed.to_owned();
    c.push(COMPANION_SUFFIX);
    c
}

/// Seal a symlink target: nonce || AES-256-GCM(target) || tag.
pub fn seal_link(key: &Aes256Gcm, nonce: &[u8; LINK_NONCE], target: &[u8]) -> Result<Vec<u8>> {
    let sealed = key
        .encrypt(nonce.into(), Payload { msg: target, aad: b"plyfs symlink" })
        .map_err(|_| Error::Corrupt("symlink encryption failed".into()))?;
    let mut blob = nonce.to_vec();
    blob.extend_from_slice(&sealed);
    Ok(blob)
}

fn open_link(key: &Aes256Gcm, blob: &[u8]) -> Option<Vec<u8>> {
    if blob.len() < LINK_OVERHEAD {
        return None;
    }
    key.decrypt(blob[..LINK_NONCE].into(), Payload { msg: &blob[LINK_NONCE..], aad: b"plyfs symlink" }).ok()
}

/// The symlink key of a volume.
pub fn link_key(volume: &Volume) -> Aes256Gcm {
    Aes256Gcm::new_from_slice(&volume.key.subkey::<32>("symlinks aes-256-gcm")[..]).expect("32-byte key")
}

/// The companion name and plaintext length in a marker, if `stored` is one.
fn parse_marker(stored: &[u8]) -> Option<(OsString, u64)> {
    if stored.len() != MARKER_LEN || !stored.starts_with(TARGET_PREFIX.as_bytes()) || stored[TARGET_COMPANION_LEN] != b'.' {
        return None;
    }
    let len = std::str::from_utf8(&stored[TARGET_COMPANION_LEN + 1..]).ok()?.parse().ok()?;
    Some((OsStr::from_bytes(&stored[..TARGET_COMPANION_LEN]).to_owned(), len))
}

/// The plaintext length of a target whose sealed form is `lower` bytes of base64.
fn sealed_target_len(lower: u64) -> u64 {
    (lower * 3 / 4).saturating_sub(LINK_OVERHEAD as u64)
}

/// Names of this layer's own files, which the user never sees: a directory's id and the
/// companions of long names and long targets.
fn is_aux(name: &[u8]) -> bool {
    name == DIRID_FILE.as_bytes()
        || (name.starts_with(LONG_PREFIX.as_bytes()) && name.ends_with(COMPANION_SUFFIX.as_bytes()))
        || (name.len() == TARGET_COMPANION_LEN && name.starts_with(TARGET_PREFIX.as_bytes()))
}

fn internal() -> Caller {
    Caller::daemon()
}

impl CryptNames {
    pub fn new(name: &str, volume: &Volume, lower: Level) -> CryptNames {
        let (siv_key, root_id) = name_keys(volume);
        CryptNames {
            name: name.to_owned(),
            lower: [lower],
            plaintext: volume.plaintext_names,
            siv_key,
            links: link_key(volume),
            root_id,
            dirs: RwLock::new(HashMap::new()),
            long_targets: RwLock::new(LongTargets::default()),
            bind: (volume.bind_paths && !volume.plaintext_names).then(|| Binding {
                key: BindKey::of(&volume.key),
                places: RwLock::new(HashMap::new()),
                reported: Mutex::new(HashSet::new()),
            }),
            warned_hidden: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn below(&self) -> &Level {
        &self.lower[0]
    }

    // Directory ids.

    fn dir_id(&self, dir: NodeId) -> Result<[u8; 16]> {
        if dir == NodeId::ROOT {
            return Ok(self.root_id);
        }
        if let Some(id) = self.dirs.read().get(&dir) {
            return Ok(*id);
        }
        let op = Op::GetXattr { node: dir, name: OsStr::new(DIRID_XATTR), size: 64 };
        let id = match self.below().call(&internal(), &op) {
            Ok(Reply::Xattr(XattrReply::Data(d))) if d.len() == 16 => d.try_into().expect("16 bytes"),
            Ok(_) => return Err(Error::Corrupt(format!("directory {}: its {DIRID_XATTR} is damaged", dir.0))),
            Err(Error::Os(libc::ENODATA | libc::ENOTSUP)) => match self.below().read_small_file(&internal(), dir, OsStr::new(DIRID_FILE), 64) {
                Ok(d) if d.len() == 16 => d.try_into().expect("16 bytes"),
                Ok(_) => return Err(Error::Corrupt(format!("directory {}: its {DIRID_FILE} is damaged", dir.0))),
                Err(Error::Os(libc::ENOENT)) => {
                    // A directory made without one (by hand, below): give it one now.
                    tracing::warn!("directory {}: no {DIRID_XATTR}; giving it a new one", dir.0);
                    self.set_dir_id(dir, libc::XATTR_CREATE)?
                }
                Err(e) => return Err(e),
            },
            Err(e) => return Err(e),
        };
        self.dirs.write().insert(dir, id);
        Ok(id)
    }

    fn set_dir_id(&self, dir: NodeId, flags: i32) -> Result<[u8; 16]> {
        let id: [u8; 16] = random_bytes();
        let op = Op::SetXattr { node: dir, name: OsStr::new(DIRID_XATTR), value: &id, flags };
        match self.below().call(&internal(), &op) {
            Ok(_) => {
                self.dirs.write().insert(dir, id);
                Ok(id)
            }
            Err(Error::Os(libc::EEXIST)) if flags == libc::XATTR_CREATE => {
                self.dirs.write().remove(&dir);
                self.dir_id(dir)
            }
            Err(Error::Os(libc::EROFS)) if flags == libc::XATTR_CREATE => {
                // A read-only mount: nothing in the directory can decrypt under a new id
                // anyway, and it cannot be given one; keep it for this mount only.
                self.dirs.write().insert(dir, id);
                Ok(id)
            }
            Err(e) => Err(e),
        }
    }

    // Names.

    fn encrypt(&self, dir: NodeId, name: &OsStr) -> Result<LowerName> {
        let bytes = name.as_bytes();
        if self.plaintext {
            if dir == NodeId::ROOT && is_config(bytes) {
                return Err(Error::Os(libc::EPERM));
            }
            return Ok(LowerName::Short(name.to_owned()));
        }
        if bytes == b"." || bytes == b".." {
            return Ok(LowerName::Short(name.to_owned()));
        }
        if bytes.len() > NAME_MAX {
            return Err(Error::Os(libc::ENAMETOOLONG));
        }
        let id = self.dir_id(dir)?;
        seal_name(&self.siv_key, &id, bytes)
    }

    fn decrypt(&self, id: &[u8; 16], stored: &str) -> Option<Vec<u8>> {
        open_name(&self.siv_key, id, stored.as_bytes())
    }

    /// The plaintext name of a lower entry of `dir`, or `None` to hide it.
    fn shown_name(&self, dir: NodeId, id: &[u8; 16], lower: &OsStr) -> Option<OsString> {
        let bytes = lower.as_bytes();
        if self.plaintext {
            return (!(dir == NodeId::ROOT && is_config(bytes))).then(|| lower.to_owned());
        }
        if bytes == b"." || bytes == b".." {
            return Some(lower.to_owned());
        }
        let text = std::str::from_utf8(bytes).ok()?;
        if text.starts_with(LONG_PREFIX) {
            if text.ends_with(COMPANION_SUFFIX) {
                return None;
            }
            let companion = format!("{text}{COMPANION_SUFFIX}");
            let full = self.read_companion(dir, OsStr::new(&companion))?;
            let hash = B64.encode(sha2::Sha256::digest(full.as_bytes()));
            if text.strip_prefix(LONG_PREFIX) != Some(hash.as_str()) {
                tracing::warn!("directory {}: {companion} does not belong to {text}; hiding it", dir.0);
                return None;
            }
            return self.decrypt(id, &full).map(OsString::from_vec);
        }
        let name = self.decrypt(id, text);
        // The layer's own files (a directory's id file, companions) are hidden without a word.
        if name.is_none() && !is_aux(bytes) && !(dir == NodeId::ROOT && is_config(bytes)) {
            if self.warned_hidden.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::debug!("directory {}: hiding {text}, which does not decrypt", dir.0);
            } else {
                tracing::warn!(
                    "directory {}: hiding {text}, which does not decrypt: put there from outside the mount? (a crypt volume serves only its own files; further such names are debug lines)",
                    dir.0
                );
            }
        }
        name.map(OsString::from_vec)
    }

    fn read_companion(&self, dir: NodeId, name: &OsStr) -> Option<String> {
        String::from_utf8(self.below().read_small_file(&internal(), dir, name, 4096).ok()?).ok()
    }

    /// Write the companion of a long name (its content depends on the name alone, so one that
    /// exists is already right). Returns whether this call made it.
    fn write_companion(&self, cx: &Caller, dir: NodeId, name: &LowerName) -> Result<bool> {
        let LowerName::Long { hashed, full } = name else { return Ok(false) };
        self.write_aux(cx, dir, &long_name_companion(hashed), full.as_bytes())
    }

    /// Make the small file `name` in `dir` holding `content`, unless it exists (every companion's
    /// name is a hash of its content). Returns whether this call made it.
    fn write_aux(&self, cx: &Caller, dir: NodeId, name: &OsStr, content: &[u8]) -> Result<bool> {
        let lower = self.below();
        let op = Op::Create { parent: dir, name, mode: 0o400, flags: libc::O_WRONLY | libc::O_EXCL };
        let (entry, opened) = match lower.call(cx, &op) {
            Ok(Reply::Created(e, o)) => (e, o),
            Ok(_) => return Err(Error::Os(libc::EIO)),
            Err(Error::Os(libc::EEXIST)) => return Ok(false),
            Err(e) => return Err(e),
        };
        let written = lower.write(cx, entry.node, opened.fh, 0, content);
        let _ = lower.release(cx, entry.node, opened.fh);
        lower.forget(cx, entry.node, 1);
        if let Err(e) = written {
            let _ = lower.unlink(cx, dir, name);
            return Err(e);
        }
        Ok(true)
    }

    fn remove_companion(&self, cx: &Caller, dir: NodeId, name: &LowerName) {
        if let LowerName::Long { hashed, .. } = name {
            let mut companion = hashed.clone();
            companion.push(COMPANION_SUFFIX);
            if let Err(e) = self.below().unlink(cx, dir, &companion) {
                if !matches!(e, Error::Os(libc::ENOENT)) {
                    tracing::warn!("directory {}: removing {}: {e}", dir.0, companion.to_string_lossy());
                }
            }
        }
    }

    /// Make an entry under a name that may need a companion; the companion goes first, and
    /// goes again if the entry cannot be made.
    fn make(&self, cx: &Caller, dir: NodeId, name: &LowerName, op: &Op<'_>) -> Result<Reply> {
        let made = self.write_companion(cx, dir, name)?;
        let reply = self.below().call(cx, op);
        if reply.is_err() && made {
            self.remove_companion(cx, dir, name);
        }
        reply.map(|r| self.fix_reply_at(dir, name.name(), r))
    }

    // Symlink targets.

    fn seal_target(&self, target: &[u8]) -> Result<SealedTarget> {
        if target.len() >= libc::PATH_MAX as usize {
            return Err(Error::Os(libc::ENAMETOOLONG));
        }
        if self.plaintext {
            return Ok(SealedTarget::Inline(OsStr::from_bytes(target).to_owned()));
        }
        let nonce: [u8; LINK_NONCE] = random_bytes();
        Ok(SealedTarget::of(seal_link(&self.links, &nonce, target)?, target.len()))
    }

    fn open_target(&self, node: NodeId, stored: &[u8]) -> Result<Vec<u8>> {
        if self.plaintext {
            return Ok(stored.to_vec());
        }
        let bad = |why: &str| {
            tracing::error!("symlink {}: its target {why}", node.0);
            Error::Os(libc::EIO)
        };
        let blob = match parse_marker(stored) {
            Some((companion, _)) => {
                let dir = self.long_targets.read().nodes.get(&node).map(|l| l.dir);
                let dir = dir.ok_or_else(|| bad("is stored beside it, in a directory this mount has not seen it in"))?;
                let blob = self.below().read_small_file(&internal(), dir, &companion, 8192).map_err(|e| match e {
                    Error::Os(libc::ENOENT) => bad(&format!("is lost: its file {} is missing", companion.to_string_lossy())),
                    e => e,
                })?;
                if B64.encode(sha2::Sha256::digest(&blob)).as_bytes() != &companion.as_bytes()[TARGET_PREFIX.len()..] {
                    return Err(bad(&format!("is damaged: {} does not match its name", companion.to_string_lossy())));
                }
                blob
            }
            None => B64.decode(stored).map_err(|_| bad("does not decrypt (altered, or not this volume's)"))?,
        };
        open_link(&self.links, &blob).ok_or_else(|| bad("does not decrypt (altered, or not this volume's)"))
    }

    /// Remember where the companion of a symlink with a long target lies (`entry` was found or
    /// made as `name` in `dir`), and give back the attributes to show.
    fn note_entry(&self, dir: NodeId, name: &OsStr, mut entry: Entry) -> Entry {
        if self.plaintext || entry.attr.kind != FileKind::Symlink {
            return entry;
        }
        if entry.attr.size as usize != MARKER_LEN {
            entry.attr = self.fix_attr(entry.attr);
            return entry;
        }
        match self.marker_of(entry.node) {
            Some((companion, len)) => {
                entry.attr.size = len;
                let mut t = self.long_targets.write();
                t.nodes.insert(entry.node, LongTarget { dir, companion, len });
                t.names.insert((dir, name.to_owned()), entry.node);
            }
            None => entry.attr = self.fix_attr(entry.attr),
        }
        entry
    }

    /// The companion name and plaintext length a lower symlink's marker gives.
    fn marker_of(&self, node: NodeId) -> Option<(OsString, u64)> {
        match self.below().call(&internal(), &Op::ReadLink { node }) {
            Ok(Reply::Data(stored)) => parse_marker(&stored),
            _ => None,
        }
    }

    /// The symlink with a long target `name` in `dir` names, if this mount saw it there.
    fn long_target_at(&self, dir: NodeId, name: &OsStr) -> Option<(NodeId, OsString)> {
        let t = self.long_targets.read();
        let node = *t.names.get(&(dir, name.to_owned()))?;
        t.nodes.get(&node).map(|l| (node, l.companion.clone()))
    }

    /// Give the directory `to` the companion of the long target of `node` (a new name of it is
    /// about to be made there). Returns whether a new companion name was made.
    fn copy_target_companion(&self, cx: &Caller, node: NodeId, to: NodeId) -> Result<bool> {
        let Some(l) = self.long_targets.read().nodes.get(&node).cloned() else { return Ok(false) };
        if l.dir == to {
            return Ok(false);
        }
        let below = self.below();
        let src = below.lookup(&internal(), l.dir, &l.companion)?;
        let linked = below.call(cx, &Op::Link { node: src.node, new_parent: to, new_name: &l.companion });
        below.forget(&internal(), src.node, 1);
        match linked {
            Ok(Reply::Entry(e)) => {
                below.forget(&internal(), e.node, 1);
                Ok(true)
            }
            Ok(_) => Ok(true),
            Err(Error::Os(libc::EEXIST)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The name `name` of `node` (a symlink with a long target) left `dir`: its companion goes
    /// too when that was the symlink's last name (`nlink` before it went).
    fn drop_target_name(&self, cx: &Caller, dir: NodeId, name: &OsStr, node: NodeId, companion: &OsStr, nlink: u32) {
        {
            let mut t = self.long_targets.write();
            t.names.remove(&(dir, name.to_owned()));
            if nlink <= 1 {
                t.nodes.remove(&node);
            }
        }
        if nlink <= 1 {
            if let Err(e) = self.below().unlink(cx, dir, companion) {
                if !matches!(e, Error::Os(libc::ENOENT)) {
                    tracing::warn!("directory {}: removing {}: {e}", dir.0, companion.to_string_lossy());
                }
            }
        }
    }

    fn nlink(&self, node: NodeId) -> u32 {
        self.below().getattr(&internal(), node).map_or(1, |a| a.nlink)
    }

    fn symlink(&self, cx: &Caller, parent: NodeId, name: &OsStr, target: &[u8]) -> Result<Reply> {
        let n = self.encrypt(parent, name)?;
        let (stored, companion) = match self.seal_target(target)? {
            SealedTarget::Inline(t) => (t, None),
            SealedTarget::Long { marker, companion, blob } => {
                let made = self.write_aux(cx, parent, &companion, &blob)?;
                (marker, Some((companion, made)))
            }
        };
        let reply = self.make(cx, parent, &n, &Op::SymLink { parent, name: n.name(), target: std::path::Path::new(&stored) });
        match (reply, companion) {
            (Err(e), Some((companion, true))) => {
                let _ = self.below().unlink(cx, parent, &companion);
                Err(e)
            }
            (reply, _) => reply,
        }
    }

    /// Remove `name` from `parent` below (`rmdir` when `dir`), with what goes with it.
    fn remove(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Result<Reply> {
        let n = self.encrypt(parent, name)?;
        let long = self.long_target_at(parent, n.name());
        let nlink = long.as_ref().map(|(node, _)| self.nlink(*node));
        self.below().call(cx, &Op::Unlink { parent, name: n.name() })?;
        if let (Some((node, companion)), Some(nlink)) = (long, nlink) {
            self.drop_target_name(cx, parent, n.name(), node, &companion, nlink);
        }
        self.remove_companion(cx, parent, &n);
        Ok(Reply::Empty)
    }

    /// `rmdir` below; a directory that holds nothing but this layer's own files (a directory id,
    /// companions left behind) is empty to the user, so those go and the removal is tried again.
    fn rmdir_below(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Result<Reply> {
        let below = self.below();
        match below.call(cx, &Op::RmDir { parent, name }) {
            Err(Error::Os(libc::ENOTEMPTY)) => {}
            other => return other,
        }
        let dir = below.lookup(&internal(), parent, name)?;
        let swept = (|| {
            let entries = below.list_dir(&internal(), dir.node)?;
            if entries.is_empty() || !entries.iter().all(|e| is_aux(e.name.as_bytes())) {
                return Err(Error::Os(libc::ENOTEMPTY));
            }
            for e in &entries {
                below.unlink(cx, dir.node, &e.name)?;
            }
            Ok(())
        })();
        below.forget(&internal(), dir.node, 1);
        swept?;
        below.call(cx, &Op::RmDir { parent, name })
    }

    /// Take back the companions copied for a rename that did not happen.
    fn undo_copied(&self, cx: &Caller, copied: &[(NodeId, NodeId)]) {
        for (dir, node) in copied {
            if let Some(l) = self.long_targets.read().nodes.get(node).cloned() {
                let _ = self.below().unlink(cx, *dir, &l.companion);
            }
        }
    }

    /// After a rename: where the companions of long targets among the two names now belong.
    #[allow(clippy::too_many_arguments)]
    fn renamed_targets(
        &self,
        cx: &Caller,
        (from_dir, from): (NodeId, &OsStr),
        (to_dir, to): (NodeId, &OsStr),
        moving: Option<(NodeId, OsString)>,
        moving_nlink: Option<u32>,
        victim: Option<(NodeId, OsString)>,
        victim_nlink: Option<u32>,
        exchanged: bool,
    ) {
        if exchanged {
            let mut t = self.long_targets.write();
            t.names.remove(&(from_dir, from.to_owned()));
            t.names.remove(&(to_dir, to.to_owned()));
            if let Some((node, _)) = &victim {
                t.names.insert((from_dir, from.to_owned()), *node);
            }
            if let Some((node, _)) = &moving {
                t.names.insert((to_dir, to.to_owned()), *node);
            }
            return;
        }
        if let (Some((node, companion)), Some(nlink)) = (&victim, victim_nlink) {
            if moving.as_ref().map(|(n, _)| n) != Some(node) {
                self.drop_target_name(cx, to_dir, to, *node, companion, nlink);
            }
        }
        if let (Some((node, companion)), Some(nlink)) = (moving, moving_nlink) {
            let mut t = self.long_targets.write();
            t.names.remove(&(from_dir, from.to_owned()));
            t.names.insert((to_dir, to.to_owned()), node);
            if let Some(l) = t.nodes.get_mut(&node) {
                l.dir = to_dir;
            }
            drop(t);
            if from_dir != to_dir && nlink <= 1 {
                if let Err(e) = self.below().unlink(cx, from_dir, &companion) {
                    tracing::warn!("directory {}: removing {}: {e}", from_dir.0, companion.to_string_lossy());
                }
            }
        }
    }

    // Attributes: a symlink's size is its target's length.

    fn fix_attr(&self, mut attr: Attr) -> Attr {
        if !self.plaintext && attr.kind == FileKind::Symlink {
            attr.size = sealed_target_len(attr.size);
        }
        attr
    }

    /// The attributes of `node` to show: a symlink with a long target shows its length.
    fn fix_node_attr(&self, node: NodeId, mut attr: Attr) -> Attr {
        if self.plaintext || attr.kind != FileKind::Symlink || attr.size as usize != MARKER_LEN {
            return self.fix_attr(attr);
        }
        let known = self.long_targets.read().nodes.get(&node).map(|l| l.len);
        match known.or_else(|| self.marker_of(node).map(|(_, len)| len)) {
            Some(len) => attr.size = len,
            None => attr = self.fix_attr(attr),
        }
        attr
    }

    /// A reply to an operation that found or made `name` in `dir` (a lower name).
    fn fix_reply_at(&self, dir: NodeId, name: &OsStr, reply: Reply) -> Reply {
        if let Reply::Entry(e) | Reply::Created(e, _) = &reply {
            self.note_place(dir, name, e);
        }
        match reply {
            Reply::Entry(e) => Reply::Entry(self.note_entry(dir, name, e)),
            Reply::Created(e, o) => Reply::Created(self.note_entry(dir, name, e), o),
            other => other,
        }
    }

    fn readdir(&self, cx: &Caller, op: &Op<'_>, dir: NodeId) -> Result<Reply> {
        let entries = match self.below().call(cx, op)? {
            Reply::Dir(entries) => entries,
            other => return Ok(other),
        };
        let id = if self.plaintext { [0; 16] } else { self.dir_id(dir)? };
        let mut shown = Vec::with_capacity(entries.len());
        for e in entries {
            match self.shown_name(dir, &id, &e.name) {
                Some(name) => {
                    if let Some(x) = &e.entry {
                        self.note_place(dir, &e.name, x);
                    }
                    shown.push(DirEntry { name, entry: e.entry.map(|x| self.note_entry(dir, &e.name, x)), ..e })
                }
                None => {
                    // A hidden entry looked up for readdirplus: give the lookup back.
                    if let Some(x) = e.entry {
                        self.below().forget(cx, x.node, 1);
                    }
                }
            }
        }
        Ok(Reply::Dir(shown))
    }

    /// The plaintext form of a path relative to the lower root.
    fn plain_path(&self, lower: &str) -> Result<String> {
        let cx = internal();
        let comps: Vec<&str> = lower.split('/').filter(|c| !c.is_empty()).collect();
        let mut parent = NodeId::ROOT;
        let mut held = Vec::new();
        let mut out = Vec::with_capacity(comps.len());
        let result = (|| {
            for (i, c) in comps.iter().enumerate() {
                let id = self.dir_id(parent)?;
                let name = self.shown_name(parent, &id, OsStr::new(c)).ok_or(Error::Os(libc::EIO))?;
                out.push(name.to_string_lossy().into_owned());
                if i + 1 < comps.len() {
                    let e = self.below().lookup(&cx, parent, OsStr::new(c))?;
                    held.push(e.node);
                    parent = e.node;
                }
            }
            Ok(())
        })();
        for node in held {
            self.below().forget(&cx, node, 1);
        }
        result.map(|()| out.join("/"))
    }

    fn lower_info(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let mut v = match self.below().call(cx, op)? {
            Reply::Extended(v) => v,
            other => return Ok(other),
        };
        if let Some(lower) = v.get("path").and_then(|p| p.as_str()).map(str::to_owned) {
            v["lower_rel_path"] = lower.clone().into();
            v["path"] = self.plain_path(&lower)?.into();
        }
        Ok(Reply::Extended(v))
    }

    fn xattr_hidden(&self, name: &OsStr) -> bool {
        !self.plaintext && (name.as_bytes() == DIRID_XATTR.as_bytes() || name.as_bytes() == BIND_XATTR.as_bytes())
    }

    // Binding files to their places (see `super::bind`).

    /// Remember where the file of `entry` was found or made (`name` is its lower name in `dir`).
    fn note_place(&self, dir: NodeId, lower_name: &OsStr, entry: &Entry) {
        let Some(b) = &self.bind else { return };
        if entry.attr.kind != FileKind::File {
            return;
        }
        let Ok(dir_id) = self.dir_id(dir) else { return };
        let mut places = b.places.write();
        let p = places.entry(entry.node).or_insert_with(|| FilePlace { dir_id, lower_name: OsString::new(), lookups: 0 });
        p.dir_id = dir_id;
        p.lower_name = lower_name.to_owned();
        p.lookups += 1;
    }

    fn forget_place(&self, node: NodeId, nlookup: u64) {
        let Some(b) = &self.bind else { return };
        let mut places = b.places.write();
        if let Some(p) = places.get_mut(&node) {
            p.lookups = p.lookups.saturating_sub(nlookup);
            if p.lookups == 0 {
                places.remove(&node);
            }
        }
    }

    fn place_of(&self, node: NodeId) -> Option<([u8; 16], OsString)> {
        let b = self.bind.as_ref()?;
        b.places.read().get(&node).map(|p| (p.dir_id, p.lower_name.clone()))
    }

    /// What the first bytes of the lower file `node` say about its identity. Only a regular file
    /// has any: a FIFO or a device is never opened here (an open could block, or act).
    fn head_of(&self, node: NodeId) -> Result<Head> {
        let below = self.below();
        if below.getattr(&internal(), node)?.kind != FileKind::File {
            return Ok(Head::None);
        }
        let opened = below.open(&internal(), node, libc::O_RDONLY | libc::O_NONBLOCK)?;
        let head = below.read(&internal(), node, opened.fh, 0, HEAD_BYTES as u32);
        let _ = below.release(&internal(), node, opened.fh);
        Ok(Head::of(&head?))
    }

    fn stored_tags(&self, node: NodeId) -> Result<Option<Stored>> {
        let op = Op::GetXattr { node, name: OsStr::new(BIND_XATTR), size: bind::STORED_MAX_BYTES as u32 };
        match self.below().call(&internal(), &op) {
            // Tags that do not decode match no place.
            Ok(Reply::Xattr(XattrReply::Data(d))) => Ok(Some(Stored::decode(&d).unwrap_or_else(Stored::damaged))),
            Ok(_) | Err(Error::Os(libc::ERANGE)) => Ok(Some(Stored::damaged())),
            Err(Error::Os(libc::ENODATA)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn store_tags(&self, node: NodeId, tags: &Stored) -> Result<()> {
        let value = tags.encode();
        self.below().call(&internal(), &Op::SetXattr { node, name: OsStr::new(BIND_XATTR), value: &value, flags: 0 }).map(|_| ())
    }

    /// Refuse to open `node` unless its content is bound to the place it was found at.
    fn check_binding(&self, node: NodeId, head: Head) -> Result<()> {
        let Some(b) = &self.bind else { return Ok(()) };
        let Head::Id(file_id) = head else { return Ok(()) };
        let Some((dir_id, lower_name)) = self.place_of(node) else {
            return Err(self.refuse(node, None, "this mount does not know where it is, so its place cannot be checked"));
        };
        let here = b.key.place_tag(&file_id, &dir_id, lower_name.as_bytes());
        match bind::verdict(&b.key, self.stored_tags(node)?.as_ref(), &file_id, &here) {
            Verdict::Here | Verdict::Linked => Ok(()),
            Verdict::Missing => Err(self.refuse(node, Some((dir_id, lower_name)), "its place tag is missing (removed below, or lost by a copy that dropped extended attributes)")),
            Verdict::Elsewhere => Err(self.refuse(
                node,
                Some((dir_id, lower_name)),
                "its content is bound to another place: the file was moved or swapped in the storage, not renamed through plyfs",
            )),
        }
    }

    /// Log a refusal to open `node` once (naming the file), and give the error to return.
    fn refuse(&self, node: NodeId, place: Option<([u8; 16], OsString)>, why: &str) -> Error {
        let b = self.bind.as_ref().expect("binding is on");
        let (dir_id, lower_name) = place.unwrap_or(([0; 16], OsString::new()));
        if b.reported.lock().insert((node, dir_id, lower_name)) {
            let path = self
                .below()
                .extended(&internal(), node, "lower-info", &[])
                .ok()
                .and_then(|v| v.get("path").and_then(|p| p.as_str()).map(str::to_owned))
                .map(|lower| match self.plain_path(&lower) {
                    Ok(plain) => format!("/{plain} (stored as {lower})"),
                    Err(_) => format!("stored as {lower}"),
                })
                .unwrap_or_else(|| format!("inode {}", node.0));
            tracing::error!("{}: {path}: refused with EIO: {why}", self.name);
        }
        Error::Os(libc::EIO)
    }

    /// A write of `data` at offset 0 of `node`: when it is a header with a new file id, bind
    /// that id to the file's place first, so that no header is ever stored without its tag.
    fn bind_header(&self, node: NodeId, data: &[u8]) -> Result<()> {
        let Some(b) = &self.bind else { return Ok(()) };
        let Head::Id(file_id) = Head::of(data) else { return Ok(()) };
        let stored = self.stored_tags(node)?;
        let place = self.place_of(node);
        let here = place.as_ref().map(|(dir_id, lower_name)| b.key.place_tag(&file_id, dir_id, lower_name.as_bytes()));
        let verdict = bind::verdict(&b.key, stored.as_ref(), &file_id, &here.unwrap_or([0; 32]));
        if verdict == Verdict::Linked || (verdict == Verdict::Here && here.is_some()) {
            return Ok(());
        }
        // A file with several names (or none known here) is bound to its id only, and so is one
        // that ever had several: the name this mount saw last may be one that is gone.
        let linked = stored.is_some_and(|s| s.linked) || self.nlink(node) > 1;
        match here {
            Some(tag) if !linked => self.store_tags(node, &Stored::placed(tag, None)),
            _ => self.store_tags(node, &Stored::linked(Some(b.key.linked_tag(&file_id)))),
        }
    }

    /// Before `node`, now `lower_name` in `dir`, becomes `new_name` in `new_dir`: add the tag of
    /// the new place, keeping the old one, so the file is valid at either until the next
    /// rename (a crash between the two steps loses nothing). A file not valid where it is
    /// stays invalid; a linked file has no place to change.
    fn bind_new_place(&self, node: NodeId, (dir, lower_name): (NodeId, &OsStr), (new_dir, new_name): (NodeId, &OsStr)) -> Result<()> {
        let Some(b) = &self.bind else { return Ok(()) };
        let Head::Id(file_id) = self.head_of(node)? else { return Ok(()) };
        let Some(Stored { linked: false, current: Some(current), previous }) = self.stored_tags(node)? else { return Ok(()) };
        let old = b.key.place_tag(&file_id, &self.dir_id(dir)?, lower_name.as_bytes());
        if current != old && previous != Some(old) {
            return Ok(());
        }
        let new = b.key.place_tag(&file_id, &self.dir_id(new_dir)?, new_name.as_bytes());
        self.store_tags(node, &Stored::placed(new, Some(old)))
    }

    /// Before `node` gets a second name: bind it to its file id only, for good.
    fn bind_linked(&self, node: NodeId) -> Result<()> {
        let Some(b) = &self.bind else { return Ok(()) };
        if self.below().getattr(&internal(), node)?.kind != FileKind::File {
            return Ok(());
        }
        let stored = self.stored_tags(node)?;
        if stored.is_some_and(|s| s.linked) {
            return Ok(());
        }
        match self.head_of(node)? {
            // No content yet: only the mark, which the first header's tag will follow.
            Head::None => self.store_tags(node, &Stored::linked(None)),
            Head::Damaged => Ok(()),
            Head::Id(file_id) => {
                // A file not valid where it is does not become valid everywhere.
                let here = self.place_of(node).map(|(dir_id, lower_name)| b.key.place_tag(&file_id, &dir_id, lower_name.as_bytes()));
                match here {
                    Some(here) if bind::verdict(&b.key, stored.as_ref(), &file_id, &here) == Verdict::Here => {
                        self.store_tags(node, &Stored::linked(Some(b.key.linked_tag(&file_id))))
                    }
                    _ => Ok(()),
                }
            }
        }
    }

    /// `crypt-rebind`: bind `node` to the place it was found at, whatever its tags say (for
    /// `plyfs fsck --rebind`, after a copy that dropped extended attributes). Answers whether a
    /// tag was written.
    fn rebind(&self, node: NodeId) -> Result<Reply> {
        let Some(b) = &self.bind else {
            return Err(Error::config("this crypt volume does not bind files to their places (it was made without --bind-paths)"));
        };
        let rebound = match self.head_of(node)? {
            Head::Id(file_id) => {
                let (dir_id, lower_name) = self.place_of(node).ok_or(Error::Os(libc::ESTALE))?;
                let stored = self.stored_tags(node)?;
                let want = if stored.is_some_and(|s| s.linked) || self.nlink(node) > 1 {
                    Stored::linked(Some(b.key.linked_tag(&file_id)))
                } else {
                    Stored::placed(b.key.place_tag(&file_id, &dir_id, lower_name.as_bytes()), None)
                };
                let fits = stored == Some(want);
                if !fits {
                    self.store_tags(node, &want)?;
                }
                !fits
            }
            Head::None | Head::Damaged => false,
        };
        Ok(Reply::Extended(serde_json::json!({ "rebound": rebound })))
    }

    /// For a rename of `name` in `parent` (lower names): the file that moves, if binding is on
    /// and it is a regular file; the caller forgets the lookup when the rename is done.
    fn bound_file_at(&self, parent: NodeId, lower_name: &OsStr) -> Option<NodeId> {
        self.bind.as_ref()?;
        let e = self.below().lookup(&internal(), parent, lower_name).ok()?;
        if e.attr.kind != FileKind::File {
            self.below().forget(&internal(), e.node, 1);
            return None;
        }
        Some(e.node)
    }

    fn moved_place(&self, node: NodeId, dir: NodeId, lower_name: &OsStr) {
        let Some(b) = &self.bind else { return };
        let Ok(dir_id) = self.dir_id(dir) else { return };
        if let Some(p) = b.places.write().get_mut(&node) {
            p.dir_id = dir_id;
            p.lower_name = lower_name.to_owned();
        }
    }

    fn list_xattrs(&self, cx: &Caller, node: NodeId, size: u32) -> Result<Reply> {
        let all = match self.below().call(cx, &Op::ListXattr { node, size: 1 << 16 })? {
            Reply::Xattr(XattrReply::Data(d)) => d,
            other => return Ok(other),
        };
        let kept: Vec<u8> = all
            .split_inclusive(|b| *b == 0)
            .filter(|n| !self.xattr_hidden(OsStr::from_bytes(n.strip_suffix(b"\0").unwrap_or(n))))
            .flatten()
            .copied()
            .collect();
        match size {
            0 => Ok(Reply::Xattr(XattrReply::Size(kept.len() as u32))),
            s if (s as usize) < kept.len() => Err(Error::Os(libc::ERANGE)),
            _ => Ok(Reply::Xattr(XattrReply::Data(kept))),
        }
    }
}

/// The extended operation that binds a file to where it is now (`plyfs fsck --rebind`).
pub const REBIND_OP: &str = "crypt-rebind";

/// For tests of crash safety: `PLYFS_CRYPT_CRASH_AT=NAME` makes the process kill itself with
/// SIGKILL at the point `NAME`, as `kill -9` would: nothing is cleaned up or flushed.
fn crash_point(name: &str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if AT.get_or_init(|| std::env::var("PLYFS_CRYPT_CRASH_AT").ok()).as_deref() == Some(name) {
        eprintln!("plyfs: crash point {name} reached: killing this process");
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

fn is_config(name: &[u8]) -> bool {
    name.starts_with(CONFIG_NAME.as_bytes())
}

/// Changes below name encrypted entries: the directory is what can be invalidated above.
struct SealedNames(Arc<dyn plyfs_stack::Invalidator>);

impl plyfs_stack::Invalidator for SealedNames {
    fn node(&self, node: NodeId) {
        self.0.node(node);
    }

    fn entry(&self, parent: NodeId, _sealed: &OsStr) {
        self.0.node(parent);
    }
}

impl Layer for CryptNames {
    fn name(&self) -> &str {
        &self.name
    }

    fn set_invalidator(&self, inv: Arc<dyn plyfs_stack::Invalidator>) {
        self.lower[0].layer().set_invalidator(Arc::new(SealedNames(inv)));
    }

    fn kind(&self) -> &'static str {
        "crypt-names"
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let below = self.below();
        match *op {
            Op::Lookup { parent, name } => {
                let n = self.encrypt(parent, name).map_err(|e| match e {
                    Error::Os(libc::EPERM) => Error::Os(libc::ENOENT),
                    e => e,
                })?;
                below.call(cx, &Op::Lookup { parent, name: n.name() }).map(|r| self.fix_reply_at(parent, n.name(), r))
            }
            Op::Create { parent, name, mode, flags } => {
                let n = self.encrypt(parent, name)?;
                self.make(cx, parent, &n, &Op::Create { parent, name: n.name(), mode, flags })
            }
            Op::MkNod { parent, name, mode, rdev } => {
                let n = self.encrypt(parent, name)?;
                self.make(cx, parent, &n, &Op::MkNod { parent, name: n.name(), mode, rdev })
            }
            Op::SymLink { parent, name, target } => self.symlink(cx, parent, name, target.as_os_str().as_bytes()),
            Op::Link { node, new_parent, new_name } => {
                let n = self.encrypt(new_parent, new_name)?;
                self.bind_linked(node)?;
                let copied = self.copy_target_companion(cx, node, new_parent)?;
                let reply = self.make(cx, new_parent, &n, &Op::Link { node, new_parent, new_name: n.name() });
                if reply.is_err() && copied {
                    if let Some(l) = self.long_targets.read().nodes.get(&node) {
                        let _ = below.unlink(cx, new_parent, &l.companion);
                    }
                }
                reply
            }
            Op::MkDir { parent, name, mode } => {
                let n = self.encrypt(parent, name)?;
                let reply = self.make(cx, parent, &n, &Op::MkDir { parent, name: n.name(), mode })?;
                if let (false, Reply::Entry(e)) = (self.plaintext, &reply) {
                    if let Err(err) = self.set_dir_id(e.node, 0) {
                        below.forget(cx, e.node, 1);
                        let _ = below.call(cx, &Op::RmDir { parent, name: n.name() });
                        self.remove_companion(cx, parent, &n);
                        return Err(err);
                    }
                }
                Ok(reply)
            }
            Op::Unlink { parent, name } => self.remove(cx, parent, name),
            Op::RmDir { parent, name } => {
                let n = self.encrypt(parent, name)?;
                let node = below.lookup(&internal(), parent, n.name()).ok().map(|e| e.node);
                let result = self.rmdir_below(cx, parent, n.name());
                if let Some(node) = node {
                    if result.is_ok() {
                        self.dirs.write().remove(&node);
                    }
                    below.forget(&internal(), node, 1);
                }
                result?;
                self.remove_companion(cx, parent, &n);
                Ok(Reply::Empty)
            }
            Op::Rename { parent, name, new_parent, new_name, flags } => {
                let from = self.encrypt(parent, name)?;
                let to = self.encrypt(new_parent, new_name)?;
                let exchanged = flags & libc::RENAME_EXCHANGE != 0;
                let same = parent == new_parent && from.name() == to.name();
                // Symlinks with long targets among the two names: their companions must be
                // where their names will be.
                let moving = self.long_target_at(parent, from.name());
                let victim = if same { None } else { self.long_target_at(new_parent, to.name()) };
                let moving_nlink = moving.as_ref().map(|(node, _)| self.nlink(*node));
                let victim_nlink = victim.as_ref().map(|(node, _)| self.nlink(*node));
                let mut copied = Vec::new();
                if let Some((node, _)) = &moving {
                    if self.copy_target_companion(cx, *node, new_parent)? {
                        copied.push((new_parent, *node));
                    }
                }
                if let (true, Some((node, _))) = (exchanged, &victim) {
                    if self.copy_target_companion(cx, *node, parent)? {
                        copied.push((parent, *node));
                    }
                }
                let made = match self.write_companion(cx, new_parent, &to) {
                    Ok(made) => made,
                    Err(e) => {
                        self.undo_copied(cx, &copied);
                        return Err(e);
                    }
                };
                // Bound files: the tag of the new place goes first (see `bind_new_place`).
                let moving_file = if same { None } else { self.bound_file_at(parent, from.name()) };
                let victim_file = if exchanged && !same { self.bound_file_at(new_parent, to.name()) } else { None };
                let rebound = (|| {
                    if let Some(node) = moving_file {
                        self.bind_new_place(node, (parent, from.name()), (new_parent, to.name()))?;
                    }
                    if let Some(node) = victim_file {
                        self.bind_new_place(node, (new_parent, to.name()), (parent, from.name()))?;
                    }
                    Ok(())
                })();
                let result = rebound.and_then(|()| {
                    crash_point("bind-before-rename");
                    below.call(cx, &Op::Rename { parent, name: from.name(), new_parent, new_name: to.name(), flags })
                });
                if let (Ok(_), Some(node)) = (&result, moving_file) {
                    crash_point("bind-after-rename");
                    self.moved_place(node, new_parent, to.name());
                }
                if let (Ok(_), Some(node)) = (&result, victim_file) {
                    self.moved_place(node, parent, from.name());
                }
                for node in moving_file.into_iter().chain(victim_file) {
                    below.forget(&internal(), node, 1);
                }
                match result {
                    Ok(r) => {
                        // After an exchange both names still exist, and after a whiteout rename
                        // the old name holds the whiteout; otherwise the old one is gone.
                        if !exchanged && !same && flags & libc::RENAME_WHITEOUT == 0 {
                            self.remove_companion(cx, parent, &from);
                        }
                        if !same {
                            self.renamed_targets(cx, (parent, from.name()), (new_parent, to.name()), moving, moving_nlink, victim, victim_nlink, exchanged);
                        }
                        Ok(r)
                    }
                    Err(e) => {
                        if made {
                            self.remove_companion(cx, new_parent, &to);
                        }
                        self.undo_copied(cx, &copied);
                        Err(e)
                    }
                }
            }
            Op::ReadLink { node } => match below.call(cx, op)? {
                Reply::Data(stored) => Ok(Reply::Data(self.open_target(node, &stored)?)),
                other => Ok(other),
            },
            Op::ReadDir { node, .. } => self.readdir(cx, op, node),
            Op::GetAttr { node, .. } | Op::SetAttr { node, .. } => match below.call(cx, op)? {
                Reply::Attr(a) => Ok(Reply::Attr(self.fix_node_attr(node, a))),
                other => Ok(other),
            },
            Op::Forget { node, nlookup } => {
                self.dirs.write().remove(&node);
                self.forget_place(node, nlookup);
                below.call(cx, op)
            }
            Op::Open { node, flags } if self.bind.is_some() => {
                if flags & libc::O_ACCMODE == libc::O_WRONLY {
                    self.check_binding(node, self.head_of(node)?)?;
                    return below.call(cx, op);
                }
                // Checked through the handle just opened: one lower open, not two.
                let reply = below.call(cx, op)?;
                let Reply::Opened(opened) = &reply else { return Ok(reply) };
                let checked = below
                    .read(&internal(), node, opened.fh, 0, HEAD_BYTES as u32)
                    .and_then(|head| self.check_binding(node, Head::of(&head)));
                if let Err(e) = checked {
                    let _ = below.release(&internal(), node, opened.fh);
                    return Err(e);
                }
                Ok(reply)
            }
            Op::Write { node, offset: 0, data, .. } if self.bind.is_some() && data.len() >= HEAD_BYTES => {
                self.bind_header(node, data)?;
                below.call(cx, op)
            }
            Op::GetXattr { name, .. } if self.xattr_hidden(name) => Err(Error::Os(libc::ENODATA)),
            Op::SetXattr { name, .. } | Op::RemoveXattr { name, .. } if self.xattr_hidden(name) => Err(Error::Os(libc::EPERM)),
            Op::ListXattr { node, size } if !self.plaintext => self.list_xattrs(cx, node, size),
            Op::Extended { name: "lower-info", .. } if !self.plaintext => self.lower_info(cx, op),
            Op::Extended { node, name: REBIND_OP, .. } => self.rebind(node),
            _ => bypass(self, cx, op),
        }
    }
}

/// The names layer of the unlocked volume at the bottom of `lower`, to put directly over it.
pub fn names_level(volume: &Arc<Volume>, lower: Level) -> Level {
    Level::new(Arc::new(CryptNames::new("crypt-names", volume, lower)))
}
