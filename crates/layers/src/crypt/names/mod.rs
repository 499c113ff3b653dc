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

mod places;
mod seal;
mod targets;

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::Arc;

use aes_gcm::Aes256Gcm;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine as _;
use parking_lot::RwLock;
use plyfs_stack::{bypass, Caller, DirEntry, Error, Layer, Level, NodeId, Op, Reply, Result, XattrReply};
use sha2::Digest;
use zeroize::Zeroizing;

use super::bind::{BindKey, Head, BIND_XATTR, HEAD_BYTES};
use super::keys::{random_bytes, Volume, CONFIG_NAME};
use places::Binding;
use seal::{is_aux, COMPANION_SUFFIX, LONG_PREFIX, NAME_MAX};
pub use seal::{
    link_key, long_name_companion, name_keys, open_name, seal_link, seal_name, LowerName, SealedTarget, DIRID_FILE, DIRID_XATTR,
    LINK_OVERHEAD, MARKER_LEN,
};
use targets::LongTargets;

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
            bind: (volume.bind_paths && !volume.plaintext_names).then(|| Binding::new(BindKey::of(&volume.key))),
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
            Ok(_) => return Err(Error::Corrupt(format!("directory inode {}: its {DIRID_XATTR} is damaged", dir.0))),
            Err(Error::Os(libc::ENODATA | libc::ENOTSUP)) => match self.below().read_small_file(&internal(), dir, OsStr::new(DIRID_FILE), 64) {
                Ok(d) if d.len() == 16 => d.try_into().expect("16 bytes"),
                Ok(_) => return Err(Error::Corrupt(format!("directory inode {}: its {DIRID_FILE} is damaged", dir.0))),
                Err(Error::Os(libc::ENOENT)) => {
                    // A directory made without one (by hand, below): give it one now.
                    tracing::warn!("directory inode {}: no {DIRID_XATTR}; giving it a new one", dir.0);
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
                tracing::warn!("directory inode {}: {companion} does not belong to {text}; hiding it", dir.0);
                return None;
            }
            return self.decrypt(id, &full).map(OsString::from_vec);
        }
        let name = self.decrypt(id, text);
        // The layer's own files (a directory's id file, companions) are hidden without a word.
        if name.is_none() && !is_aux(bytes) && !(dir == NodeId::ROOT && is_config(bytes)) {
            if self.warned_hidden.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::debug!("directory inode {}: hiding {text}, which does not decrypt", dir.0);
            } else {
                tracing::warn!(
                    "directory inode {}: hiding {text}, which does not decrypt: put there from outside the mount? (a crypt volume serves only its own files; further such names are debug lines)",
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
                    tracing::warn!("directory inode {}: removing {}: {e}", dir.0, companion.to_string_lossy());
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

    // Replies and listings: names below become names above.

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
