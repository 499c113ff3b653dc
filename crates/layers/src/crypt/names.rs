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
//! - **Symlink targets** are sealed with AES-256-GCM under a random nonce.
//! - Lower names that do not decrypt (the volume configuration, strays) are not shown.
//!
//! With `plaintext_names` the layer changes no name; it only hides the volume configuration.
//!
//! Renames and hard links need nothing special: a name's ciphertext depends only on the name
//! and its directory, and a directory's id moves with it.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::Arc;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::Aes256Gcm;
use aes_siv::siv::Aes256Siv;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine as _;
use parking_lot::RwLock;
use plyfs_stack::{
    bypass, Attr, Caller, DirEntry, Entry, Error, FileKind, Layer, Level, NodeId, Op, Reply, Result, XattrReply,
};
use sha2::Digest;
use zeroize::Zeroizing;

use super::keys::{random_bytes, Volume, CONFIG_NAME};

/// The lower attribute holding a directory's id.
pub const DIRID_XATTR: &str = "user.plyfs.dirid";
const LONG_PREFIX: &str = "L.";
const COMPANION_SUFFIX: &str = ".name";
const NAME_MAX: usize = 255;
/// The longest symlink target the lower file system stores (ext4: a block less one byte).
const LOWER_LINK_MAX: usize = 4095;
const LINK_NONCE: usize = 12;
const LINK_OVERHEAD: usize = LINK_NONCE + 16;

/// A name as stored below.
enum LowerName {
    /// The whole name.
    Short(OsString),
    /// The hashed name, and the full encrypted name for its companion file.
    Long { hashed: OsString, full: String },
}

impl LowerName {
    fn name(&self) -> &OsStr {
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
}

fn internal() -> Caller {
    Caller::daemon()
}

impl CryptNames {
    pub fn new(name: &str, volume: &Volume, lower: Level) -> CryptNames {
        let root = volume.key.subkey::<16>("names root directory id");
        CryptNames {
            name: name.to_owned(),
            lower: [lower],
            plaintext: volume.plaintext_names,
            siv_key: volume.key.subkey::<64>("names aes-siv"),
            links: Aes256Gcm::new_from_slice(&volume.key.subkey::<32>("symlinks aes-256-gcm")[..]).expect("32-byte key"),
            root_id: *root,
            dirs: RwLock::new(HashMap::new()),
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
            Err(Error::Os(libc::ENODATA)) => {
                // A directory made without one (by hand, below): give it one now.
                tracing::warn!("directory {}: no {DIRID_XATTR}; giving it a new one", dir.0);
                self.set_dir_id(dir, libc::XATTR_CREATE)?
            }
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
        let pad = 16 - bytes.len() % 16;
        let mut padded = Zeroizing::new(Vec::with_capacity(bytes.len() + pad));
        padded.extend_from_slice(bytes);
        padded.resize(bytes.len() + pad, pad as u8);
        let sealed = Aes256Siv::new((&self.siv_key[..]).into())
            .encrypt([&id[..]], &padded)
            .map_err(|_| Error::Corrupt("name encryption failed".into()))?;
        let full = B64.encode(sealed);
        if full.len() <= NAME_MAX {
            return Ok(LowerName::Short(full.into()));
        }
        let hash = B64.encode(sha2::Sha256::digest(full.as_bytes()));
        Ok(LowerName::Long { hashed: format!("{LONG_PREFIX}{hash}").into(), full })
    }

    fn decrypt(&self, id: &[u8; 16], stored: &str) -> Option<Vec<u8>> {
        let sealed = B64.decode(stored).ok()?;
        let mut padded = Aes256Siv::new((&self.siv_key[..]).into()).decrypt([&id[..]], &sealed).ok()?;
        let pad = *padded.last()? as usize;
        if pad == 0 || pad > 16 || pad > padded.len() || !padded[padded.len() - pad..].iter().all(|b| *b as usize == pad) {
            return None;
        }
        padded.truncate(padded.len() - pad);
        let ok = !padded.is_empty() && !padded.contains(&b'/') && !padded.contains(&0) && padded != b"." && padded != b"..";
        ok.then_some(padded)
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
        if name.is_none() && !(dir == NodeId::ROOT && is_config(bytes)) {
            tracing::debug!("directory {}: hiding {text}, which does not decrypt", dir.0);
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
        let mut companion = hashed.clone();
        companion.push(COMPANION_SUFFIX);
        let lower = self.below();
        let op = Op::Create { parent: dir, name: &companion, mode: 0o400, flags: libc::O_WRONLY | libc::O_EXCL };
        let (entry, opened) = match lower.call(cx, &op) {
            Ok(Reply::Created(e, o)) => (e, o),
            Ok(_) => return Err(Error::Os(libc::EIO)),
            Err(Error::Os(libc::EEXIST)) => return Ok(false),
            Err(e) => return Err(e),
        };
        let written = lower.write(cx, entry.node, opened.fh, 0, full.as_bytes());
        let _ = lower.release(cx, entry.node, opened.fh);
        lower.forget(cx, entry.node, 1);
        if let Err(e) = written {
            let _ = lower.unlink(cx, dir, &companion);
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
        reply.map(|r| self.fix_reply(r))
    }

    // Symlink targets.

    fn seal_target(&self, target: &[u8]) -> Result<OsString> {
        if self.plaintext {
            return Ok(OsStr::from_bytes(target).to_owned());
        }
        let nonce: [u8; LINK_NONCE] = random_bytes();
        let sealed = self
            .links
            .encrypt((&nonce).into(), Payload { msg: target, aad: b"plyfs symlink" })
            .map_err(|_| Error::Corrupt("symlink encryption failed".into()))?;
        let mut blob = nonce.to_vec();
        blob.extend_from_slice(&sealed);
        let text = B64.encode(blob);
        if text.len() > LOWER_LINK_MAX {
            return Err(Error::Os(libc::ENAMETOOLONG));
        }
        Ok(text.into())
    }

    fn open_target(&self, node: NodeId, stored: &[u8]) -> Result<Vec<u8>> {
        if self.plaintext {
            return Ok(stored.to_vec());
        }
        let bad = || {
            tracing::error!("symlink {}: its target does not decrypt (altered, or not this volume's)", node.0);
            Error::Os(libc::EIO)
        };
        let blob = B64.decode(stored).map_err(|_| bad())?;
        if blob.len() < LINK_OVERHEAD {
            return Err(bad());
        }
        self.links
            .decrypt(blob[..LINK_NONCE].into(), Payload { msg: &blob[LINK_NONCE..], aad: b"plyfs symlink" })
            .map_err(|_| bad())
    }

    // Attributes: a symlink's size is its target's length.

    fn fix_attr(&self, mut attr: Attr) -> Attr {
        if !self.plaintext && attr.kind == FileKind::Symlink {
            attr.size = (attr.size * 3 / 4).saturating_sub(LINK_OVERHEAD as u64);
        }
        attr
    }

    fn fix_entry(&self, mut e: Entry) -> Entry {
        e.attr = self.fix_attr(e.attr);
        e
    }

    fn fix_reply(&self, reply: Reply) -> Reply {
        match reply {
            Reply::Entry(e) => Reply::Entry(self.fix_entry(e)),
            Reply::Attr(a) => Reply::Attr(self.fix_attr(a)),
            Reply::Created(e, o) => Reply::Created(self.fix_entry(e), o),
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
                Some(name) => shown.push(DirEntry { name, entry: e.entry.map(|x| self.fix_entry(x)), ..e }),
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
        !self.plaintext && name.as_bytes() == DIRID_XATTR.as_bytes()
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
                below.call(cx, &Op::Lookup { parent, name: n.name() }).map(|r| self.fix_reply(r))
            }
            Op::Create { parent, name, mode, flags } => {
                let n = self.encrypt(parent, name)?;
                self.make(cx, parent, &n, &Op::Create { parent, name: n.name(), mode, flags })
            }
            Op::MkNod { parent, name, mode, rdev } => {
                let n = self.encrypt(parent, name)?;
                self.make(cx, parent, &n, &Op::MkNod { parent, name: n.name(), mode, rdev })
            }
            Op::SymLink { parent, name, target } => {
                let n = self.encrypt(parent, name)?;
                let sealed = self.seal_target(target.as_os_str().as_bytes())?;
                self.make(cx, parent, &n, &Op::SymLink { parent, name: n.name(), target: std::path::Path::new(&sealed) })
            }
            Op::Link { node, new_parent, new_name } => {
                let n = self.encrypt(new_parent, new_name)?;
                self.make(cx, new_parent, &n, &Op::Link { node, new_parent, new_name: n.name() })
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
            Op::Unlink { parent, name } => {
                let n = self.encrypt(parent, name)?;
                below.call(cx, &Op::Unlink { parent, name: n.name() })?;
                self.remove_companion(cx, parent, &n);
                Ok(Reply::Empty)
            }
            Op::RmDir { parent, name } => {
                let n = self.encrypt(parent, name)?;
                let node = below.lookup(&internal(), parent, n.name()).ok().map(|e| e.node);
                let result = below.call(cx, &Op::RmDir { parent, name: n.name() });
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
                let made = self.write_companion(cx, new_parent, &to)?;
                let result = below.call(cx, &Op::Rename { parent, name: from.name(), new_parent, new_name: to.name(), flags });
                match result {
                    Ok(r) => {
                        // After an exchange both names still exist; otherwise the old one is gone.
                        let exchanged = flags & libc::RENAME_EXCHANGE != 0;
                        let same = parent == new_parent && from.name() == to.name();
                        if !exchanged && !same {
                            self.remove_companion(cx, parent, &from);
                        }
                        Ok(r)
                    }
                    Err(e) => {
                        if made {
                            self.remove_companion(cx, new_parent, &to);
                        }
                        Err(e)
                    }
                }
            }
            Op::ReadLink { node } => match below.call(cx, op)? {
                Reply::Data(stored) => Ok(Reply::Data(self.open_target(node, &stored)?)),
                other => Ok(other),
            },
            Op::ReadDir { node, .. } => self.readdir(cx, op, node),
            Op::GetAttr { .. } | Op::SetAttr { .. } => below.call(cx, op).map(|r| self.fix_reply(r)),
            Op::Forget { node, .. } => {
                self.dirs.write().remove(&node);
                below.call(cx, op)
            }
            Op::GetXattr { name, .. } if self.xattr_hidden(name) => Err(Error::Os(libc::ENODATA)),
            Op::SetXattr { name, .. } | Op::RemoveXattr { name, .. } if self.xattr_hidden(name) => Err(Error::Os(libc::EPERM)),
            Op::ListXattr { node, size } if !self.plaintext => self.list_xattrs(cx, node, size),
            Op::Extended { name: "lower-info", .. } if !self.plaintext => self.lower_info(cx, op),
            _ => bypass(self, cx, op),
        }
    }
}

/// The names layer of the unlocked volume at the bottom of `lower`, to put directly over it.
pub fn names_level(volume: &Arc<Volume>, lower: Level) -> Level {
    Level::new(Arc::new(CryptNames::new("crypt-names", volume, lower)))
}
