//! `crypt-reverse`: a read-only encrypted view of a plaintext tree (gocryptfs `-reverse`), for
//! encrypted backups. The view is a crypt volume: copied anywhere, it mounts with
//! `--stack crypt` and reads back the plaintext.
//!
//! - **Files** are shown as a crypt layer writing them front to back in one go would leave
//!   them ([`plyfs_sca::synth`]): header, one sealed record per chunk, a checkpoint. Any byte
//!   range is made from the plaintext chunks it covers.
//! - **Deterministic.** The view of an unchanged tree is the same byte for byte, so `rsync`
//!   sends only what changed. A file's id and a directory's id are derived from the volume key
//!   and the object's inode number (HMAC-SHA256); a chunk's nonce from the key, the file id, the
//!   chunk's place and its content (a synthetic IV: different content never shares a nonce, so
//!   a file changed in place stays safe under AES-GCM); a symlink's from its inode and target.
//! - **Names** are sealed as by the names layer, with each directory's id shown in a file
//!   `.plyfs-dirid` (which the names layer reads when the extended attribute is missing, as it
//!   is after any copy). Long names and long symlink targets get their companion files.
//! - **The volume configuration** (`.plyfs-crypt.reverse.conf` below) is shown at the root as
//!   `.plyfs-crypt.conf`.
//! - **Exclusions**: globs over plaintext paths; a pattern without `/` matches a name at any
//!   depth. An excluded directory hides everything under it.
//! - Extended attributes of the plaintext are not shown; nothing can be written (`EROFS`).

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use aes_gcm::Aes256Gcm;
use parking_lot::Mutex;
use plyfs_sca::synth::Sequential;
use plyfs_sca::{Codec, Place};
use plyfs_stack::glob::Glob;
use plyfs_stack::{
    Attr, Caller, DataPath, DirEntry, Entry, Error, FileHandle, FileKind, Layer, Level, NodeId, Op, Opened, Reply, Result,
    XattrReply,
};
use zeroize::Zeroizing;

use super::codec::CryptCodec;
use super::keys::{Volume, CONFIG_NAME};
use super::names::{long_name_companion, name_keys, seal_link, seal_name, LowerName, SealedTarget, DIRID_FILE, LINK_OVERHEAD};

/// Where a plaintext tree keeps the configuration of its reverse view.
pub const REVERSE_CONFIG_NAME: &str = ".plyfs-crypt.reverse.conf";
/// The chunk size of the view's files.
pub const CHUNK_SHIFT: u8 = 12;
/// Virtual nodes (configuration, directory ids, companions) count down from the top of the
/// node range; the lower directory's synthetic ids count up from far below.
const VIRTUAL_TOP: u64 = NodeId::MAX;
/// The inode number a plain `readdir` shows for the view's own files.
const VIRTUAL_INO: NodeId = NodeId(VIRTUAL_TOP);
/// Plaintext symlink targets longer than this may need a companion.
const INLINE_TARGET_MAX: u64 = 3000;

/// A file the view shows that has no plaintext counterpart.
struct Virtual {
    parent: NodeId,
    name: OsString,
    content: Vec<u8>,
    lookups: u64,
}

/// What an open handle of the view reads.
enum Handle {
    File { below: FileHandle, layout: Sequential, file_id: [u8; 16] },
    Virtual,
    /// The listing is made at offset 0 and shared by the calls that page through it.
    Dir { below: Option<FileHandle>, listing: Option<Arc<Vec<Shown>>> },
}

/// One entry of a directory of the view.
#[derive(Clone)]
struct Shown {
    name: OsString,
    kind: FileKind,
    what: Target,
    /// The inode number a plain `readdir` shows (the plaintext object's; virtual files share
    /// one). Never 0, which would hide the entry.
    ino: NodeId,
}

/// What a name of the view stands for.
#[derive(Clone)]
enum Target {
    /// The plaintext entry of this name.
    Plain(OsString),
    /// A virtual file with this content.
    Made(Vec<u8>),
}

#[derive(Default)]
struct State {
    virtuals: HashMap<NodeId, Virtual>,
    by_name: HashMap<(NodeId, OsString), NodeId>,
    next_virtual: u64,
    /// Plaintext paths of the directories seen (relative, no leading slash; the root is "").
    dirs: HashMap<NodeId, String>,
    handles: HashMap<u64, Handle>,
    /// The plaintext entry each hashed name of the view (a long name, its companion, a long
    /// target's companion) stands for, learnt from listings. The name is a function of the
    /// directory's id and the entry, so this never goes wrong; whether the entry still exists
    /// is asked below at each lookup.
    hashed: HashMap<(NodeId, OsString), OsString>,
}

/// Hashed names remembered at most; past it the memory starts again.
const HASHED_NAMES_MAX: usize = 200_000;

pub struct ReverseView {
    name: String,
    lower: [Level; 1],
    codec: CryptCodec,
    siv_key: Zeroizing<[u8; 64]>,
    root_id: [u8; 16],
    links: Aes256Gcm,
    derive: ring::hmac::Key,
    config: Vec<u8>,
    excludes: Vec<Glob>,
    state: Mutex<State>,
    next_fh: AtomicU64,
}

fn b64_len(bytes: u64) -> u64 {
    bytes / 3 * 4 + [0, 2, 3][(bytes % 3) as usize]
}

/// The length of a sealed target as stored in a lower symlink (a marker when too long).
fn stored_target_len(target_len: u64) -> u64 {
    let inline = b64_len(target_len + LINK_OVERHEAD as u64);
    if inline <= 4095 {
        inline
    } else {
        super::names::MARKER_LEN as u64
    }
}

impl ReverseView {
    /// The view of the plaintext tree `lower`, encrypted for `volume`, showing `config` as the
    /// volume configuration and hiding what `excludes` match.
    pub fn new(volume: &Volume, lower: Level, config: Vec<u8>, excludes: &[String]) -> Result<ReverseView> {
        let excludes = excludes
            .iter()
            .map(|p| {
                let p = p.trim_end_matches('/');
                let full = if p.trim_start_matches('/').contains('/') || p.starts_with('/') { p.to_owned() } else { format!("**/{p}") };
                Glob::new(&full).map_err(|e| Error::config(format!("--exclude {p}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let (siv_key, root_id) = name_keys(volume);
        let mut state = State::default();
        state.dirs.insert(NodeId::ROOT, String::new());
        Ok(ReverseView {
            name: "crypt-reverse".into(),
            lower: [lower],
            codec: CryptCodec::new(volume.cipher, &volume.key, None),
            siv_key,
            root_id,
            links: super::names::link_key(volume),
            derive: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &volume.key.subkey::<32>("reverse view derivations")[..]),
            config,
            excludes,
            state: Mutex::new(state),
            next_fh: AtomicU64::new(1),
        })
    }

    pub fn level(self) -> Level {
        Level::new(Arc::new(self))
    }

    fn below(&self) -> &Level {
        &self.lower[0]
    }

    fn derived<const N: usize>(&self, parts: &[&[u8]]) -> [u8; N] {
        let mut ctx = ring::hmac::Context::with_key(&self.derive);
        for p in parts {
            ctx.update(&(p.len() as u64).to_le_bytes());
            ctx.update(p);
        }
        ctx.sign().as_ref()[..N].try_into().expect("N <= 32")
    }

    fn file_id(&self, node: NodeId) -> [u8; 16] {
        self.derived(&[b"file id", &node.0.to_le_bytes()])
    }

    fn dir_id(&self, dir: NodeId) -> [u8; 16] {
        if dir == NodeId::ROOT {
            self.root_id
        } else {
            self.derived(&[b"directory id", &dir.0.to_le_bytes()])
        }
    }

    fn layout(&self, size: u64, file_id: [u8; 16]) -> Sequential {
        Sequential { size, chunk_shift: CHUNK_SHIFT, overhead: self.codec.overhead(), codec: self.codec.tag(), file_id: Some(file_id) }
    }

    // Names.

    fn rel_path(&self, dir: NodeId, name: &OsStr) -> Option<String> {
        let st = self.state.lock();
        let parent = st.dirs.get(&dir)?;
        let name = name.to_string_lossy();
        Some(if parent.is_empty() { name.into_owned() } else { format!("{parent}/{name}") })
    }

    /// Whether the plaintext entry `name` of `dir` stays out of the view. A directory whose
    /// path this view does not know (never looked up through it) hides everything.
    fn excluded(&self, dir: NodeId, name: &OsStr) -> bool {
        if dir == NodeId::ROOT && name.as_bytes() == REVERSE_CONFIG_NAME.as_bytes() {
            return true;
        }
        if self.excludes.is_empty() {
            return false;
        }
        match self.rel_path(dir, name) {
            Some(path) => self.excludes.iter().any(|g| g.matches(&path)),
            None => true,
        }
    }

    fn seal(&self, dir: NodeId, name: &OsStr) -> Result<LowerName> {
        seal_name(&self.siv_key, &self.dir_id(dir), name.as_bytes())
    }

    /// The plaintext name of `name` in `dir` (a sealed short name), if it is one.
    fn open_name(&self, dir: NodeId, name: &OsStr) -> Option<OsString> {
        super::names::open_name(&self.siv_key, &self.dir_id(dir), name.as_bytes()).map(OsString::from_vec)
    }

    /// The sealed target of the symlink `node` whose plaintext target is `target`.
    fn sealed_target(&self, node: NodeId, target: &[u8]) -> Result<SealedTarget> {
        let nonce: [u8; 12] = self.derived(&[b"symlink nonce", &node.0.to_le_bytes(), target]);
        Ok(SealedTarget::of(seal_link(&self.links, &nonce, target)?, target.len()))
    }

    /// Every entry of the plaintext directory `dir` as the view shows it, with the directory's
    /// own files: its id, the configuration at the root, companions.
    fn listing(&self, cx: &Caller, dir: NodeId) -> Result<Vec<Shown>> {
        let below = self.below();
        let mut out = Vec::new();
        if dir == NodeId::ROOT {
            out.push(Shown { name: CONFIG_NAME.into(), kind: FileKind::File, what: Target::Made(self.config.clone()), ino: VIRTUAL_INO });
        } else {
            out.push(Shown { name: DIRID_FILE.into(), kind: FileKind::File, what: Target::Made(self.dir_id(dir).to_vec()), ino: VIRTUAL_INO });
        }
        let mut learnt = Vec::new();
        for e in below.list_dir(cx, dir)? {
            if self.excluded(dir, &e.name) {
                continue;
            }
            let from = out.len();
            self.shown_of(cx, dir, &e.name, e.kind, e.node, &mut out)?;
            for s in out[from..].iter().filter(|s| s.name.as_bytes().contains(&b'.')) {
                learnt.push(((dir, s.name.clone()), e.name.clone()));
            }
        }
        if !learnt.is_empty() {
            let mut st = self.state.lock();
            if st.hashed.len() + learnt.len() > HASHED_NAMES_MAX {
                st.hashed.clear();
            }
            st.hashed.extend(learnt);
        }
        Ok(out)
    }

    /// The entries the view shows for the plaintext entry `plain` of `dir` (of `kind`, inode
    /// `ino`): its sealed name, and the companions of a long name or a long target.
    fn shown_of(&self, cx: &Caller, dir: NodeId, plain: &OsStr, kind: FileKind, ino: NodeId, out: &mut Vec<Shown>) -> Result<()> {
        match self.seal(dir, plain)? {
            LowerName::Short(n) => out.push(Shown { name: n, kind, what: Target::Plain(plain.to_owned()), ino }),
            LowerName::Long { hashed, full } => {
                let companion = long_name_companion(&hashed);
                out.push(Shown { name: companion, kind: FileKind::File, what: Target::Made(full.into_bytes()), ino: VIRTUAL_INO });
                out.push(Shown { name: hashed, kind, what: Target::Plain(plain.to_owned()), ino });
            }
        }
        if kind == FileKind::Symlink {
            if let Some(companion) = self.target_companion(cx, dir, plain)? {
                out.push(companion);
            }
        }
        Ok(())
    }

    /// A hashed name of `dir` whose plaintext entry a listing showed: what it stands for now,
    /// if that entry is still there and still shows it.
    fn resolve_known(&self, cx: &Caller, dir: NodeId, name: &OsStr) -> Result<Option<Shown>> {
        let Some(plain) = self.state.lock().hashed.get(&(dir, name.to_owned())).cloned() else { return Ok(None) };
        if self.excluded(dir, &plain) {
            return Ok(None);
        }
        let e = match self.below().lookup(cx, dir, &plain) {
            Ok(e) => e,
            Err(Error::Os(libc::ENOENT)) => return Ok(None),
            Err(e) => return Err(e),
        };
        self.below().forget(cx, e.node, 1);
        let mut shown = Vec::new();
        self.shown_of(cx, dir, &plain, e.attr.kind, e.node, &mut shown)?;
        Ok(shown.into_iter().find(|s| s.name == name))
    }

    /// The companion file of the symlink `name` in `dir`, if its target is long.
    fn target_companion(&self, cx: &Caller, dir: NodeId, name: &OsStr) -> Result<Option<Shown>> {
        let below = self.below();
        let e = below.lookup(cx, dir, name)?;
        let result = (|| {
            if e.attr.size <= INLINE_TARGET_MAX {
                return Ok(None);
            }
            let target = match below.call(cx, &Op::ReadLink { node: e.node })? {
                Reply::Data(t) => t,
                _ => return Err(Error::Os(libc::EIO)),
            };
            Ok(match self.sealed_target(e.node, &target)? {
                SealedTarget::Long { companion, blob, .. } => {
                    Some(Shown { name: companion, kind: FileKind::File, what: Target::Made(blob), ino: VIRTUAL_INO })
                }
                SealedTarget::Inline(_) => None,
            })
        })();
        below.forget(cx, e.node, 1);
        result
    }

    /// What `name` in `dir` of the view stands for.
    fn resolve(&self, cx: &Caller, dir: NodeId, name: &OsStr) -> Result<Shown> {
        let bytes = name.as_bytes();
        if dir == NodeId::ROOT && bytes == CONFIG_NAME.as_bytes() {
            return Ok(Shown { name: name.to_owned(), kind: FileKind::File, what: Target::Made(self.config.clone()), ino: VIRTUAL_INO });
        }
        if dir != NodeId::ROOT && bytes == DIRID_FILE.as_bytes() {
            return Ok(Shown { name: name.to_owned(), kind: FileKind::File, what: Target::Made(self.dir_id(dir).to_vec()), ino: VIRTUAL_INO });
        }
        if !bytes.contains(&b'.') {
            let plain = self.open_name(dir, name).ok_or(Error::Os(libc::ENOENT))?;
            if self.excluded(dir, &plain) {
                return Err(Error::Os(libc::ENOENT));
            }
            // The kind is the lookup's to tell.
            return Ok(Shown { name: name.to_owned(), kind: FileKind::File, what: Target::Plain(plain), ino: VIRTUAL_INO });
        }
        // A long name, its companion, or a long target's companion: known from a listing
        // (`ls` lists before it looks up), else found by listing.
        if let Some(s) = self.resolve_known(cx, dir, name)? {
            return Ok(s);
        }
        self.listing(cx, dir)?.into_iter().find(|s| s.name == name).ok_or(Error::Os(libc::ENOENT))
    }

    // Nodes.

    fn made_node(&self, parent: NodeId, name: &OsStr, content: Vec<u8>) -> NodeId {
        let mut st = self.state.lock();
        let key = (parent, name.to_owned());
        if let Some(id) = st.by_name.get(&key).copied() {
            let v = st.virtuals.get_mut(&id).expect("named virtual exists");
            v.lookups += 1;
            v.content = content;
            return id;
        }
        st.next_virtual += 1;
        let id = NodeId(VIRTUAL_TOP - st.next_virtual);
        st.virtuals.insert(id, Virtual { parent, name: name.to_owned(), content, lookups: 1 });
        st.by_name.insert(key, id);
        id
    }

    fn is_virtual(&self, node: NodeId) -> bool {
        self.state.lock().virtuals.contains_key(&node)
    }

    fn virtual_attr(&self, cx: &Caller, node: NodeId) -> Result<Attr> {
        let (parent, len) = {
            let st = self.state.lock();
            let v = st.virtuals.get(&node).ok_or(Error::Os(libc::ESTALE))?;
            (v.parent, v.content.len() as u64)
        };
        let mut attr = self.below().getattr(cx, parent)?;
        attr.kind = FileKind::File;
        attr.perm = 0o400;
        attr.nlink = 1;
        attr.size = len;
        attr.blocks = len.div_ceil(512);
        attr.rdev = 0;
        Ok(attr)
    }

    /// The attributes the view shows for a plaintext object.
    fn view_attr(&self, node: NodeId, mut attr: Attr) -> Attr {
        match attr.kind {
            FileKind::File => {
                attr.size = self.layout(attr.size, self.file_id(node)).len();
                attr.blocks = attr.size.div_ceil(512);
            }
            FileKind::Symlink => attr.size = stored_target_len(attr.size),
            _ => {}
        }
        // Modes stay as they are (the mount is read-only anyway): a copy of the view, mounted,
        // shows them as the plaintext had them.
        attr
    }

    fn view_entry(&self, dir: NodeId, plain: &OsStr, mut e: Entry) -> Entry {
        if e.attr.kind == FileKind::Dir {
            if let Some(path) = self.rel_path(dir, plain) {
                self.state.lock().dirs.insert(e.node, path);
            }
        }
        e.attr = self.view_attr(e.node, e.attr);
        e
    }

    fn lookup(&self, cx: &Caller, dir: NodeId, name: &OsStr) -> Result<Entry> {
        if self.is_virtual(dir) {
            return Err(Error::Os(libc::ENOTDIR));
        }
        match self.resolve(cx, dir, name)? {
            Shown { what: Target::Made(content), .. } => {
                let node = self.made_node(dir, name, content);
                Ok(Entry { node, attr: self.virtual_attr(cx, node)?, generation: 0 })
            }
            Shown { what: Target::Plain(plain), .. } => {
                let e = self.below().lookup(cx, dir, &plain)?;
                Ok(self.view_entry(dir, &plain, e))
            }
        }
    }

    fn forget(&self, cx: &Caller, node: NodeId, nlookup: u64) -> Result<Reply> {
        {
            let mut st = self.state.lock();
            if let Some(v) = st.virtuals.get_mut(&node) {
                v.lookups = v.lookups.saturating_sub(nlookup);
                if v.lookups == 0 {
                    let v = st.virtuals.remove(&node).expect("present");
                    st.by_name.remove(&(v.parent, v.name));
                }
                return Ok(Reply::Empty);
            }
        }
        self.below().forget(cx, node, nlookup);
        Ok(Reply::Empty)
    }

    // Files.

    fn open(&self, cx: &Caller, node: NodeId, flags: i32) -> Result<Reply> {
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
            return Err(Error::Os(libc::EROFS));
        }
        let handle = if self.is_virtual(node) {
            Handle::Virtual
        } else {
            let opened = match self.below().call(cx, &Op::Open { node, flags: libc::O_RDONLY })? {
                Reply::Opened(o) => o,
                _ => return Err(Error::Os(libc::EIO)),
            };
            let size = match self.below().call(cx, &Op::GetAttr { node, fh: Some(opened.fh) }) {
                Ok(Reply::Attr(a)) => a.size,
                Ok(_) => 0,
                Err(e) => {
                    let _ = self.below().release(cx, node, opened.fh);
                    return Err(e);
                }
            };
            let file_id = self.file_id(node);
            Handle::File { below: opened.fh, layout: self.layout(size, file_id), file_id }
        };
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.state.lock().handles.insert(fh, handle);
        Ok(Reply::Opened(Opened { fh: FileHandle(fh), backing: None, direct_io: false, flush_on_close: false }))
    }

    fn read(&self, cx: &Caller, node: NodeId, fh: FileHandle, offset: u64, size: u32) -> Result<Reply> {
        let (below_fh, layout, file_id) = {
            let st = self.state.lock();
            match st.handles.get(&fh.0) {
                Some(Handle::File { below, layout, file_id }) => (*below, *layout, *file_id),
                Some(Handle::Virtual) => {
                    let v = st.virtuals.get(&node).ok_or(Error::Os(libc::ESTALE))?;
                    let start = (offset as usize).min(v.content.len());
                    let end = (start + size as usize).min(v.content.len());
                    return Ok(Reply::Data(v.content[start..end].to_vec()));
                }
                _ => return Err(Error::Os(libc::EBADF)),
            }
        };
        let chunks = layout.chunks_overlapping(offset, size.into());
        let plain = if chunks.is_empty() {
            Vec::new()
        } else {
            let (from, to) = (chunks.start << CHUNK_SHIFT, (chunks.end << CHUNK_SHIFT).min(layout.size));
            self.read_plain(cx, node, below_fh, from, to - from)?
        };
        let nonce_len = self.codec.nonce_len();
        let mut padded = Vec::new();
        let bytes = layout.read_at(offset, size.into(), |i, out| {
            let want = layout.chunk_len(i) as usize;
            let start = ((i - chunks.start) << CHUNK_SHIFT) as usize;
            let mut chunk = plain.get(start..).unwrap_or(&[]);
            chunk = &chunk[..want.min(chunk.len())];
            if chunk.len() < want {
                // The file shrank since it was opened: what is gone reads as zeros.
                padded.clear();
                padded.extend_from_slice(chunk);
                padded.resize(want, 0);
                chunk = &padded;
            }
            let nonce: [u8; 24] = {
                let mut n = [0u8; 24];
                let d: [u8; 32] = self.derived(&[b"chunk nonce", &file_id, &i.to_le_bytes(), chunk]);
                n[..nonce_len].copy_from_slice(&d[..nonce_len]);
                n
            };
            self.codec.seal_chunk(&Place { file_id, chunk: i, count: 1 }, &nonce[..nonce_len], chunk, out)
        });
        bytes.map(Reply::Data).map_err(|e| Error::Corrupt(format!("reverse view, inode {}: reading {size} bytes at offset {offset}: {e}", node.0)))
    }

    fn read_plain(&self, cx: &Caller, node: NodeId, fh: FileHandle, from: u64, len: u64) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(len as usize);
        while (out.len() as u64) < len {
            let want = (len - out.len() as u64).min(4 << 20) as u32;
            let got = self.below().read(cx, node, fh, from + out.len() as u64, want)?;
            if got.is_empty() {
                break;
            }
            out.extend_from_slice(&got);
        }
        Ok(out)
    }

    fn release(&self, cx: &Caller, node: NodeId, fh: FileHandle) -> Result<Reply> {
        let handle = self.state.lock().handles.remove(&fh.0);
        match handle {
            Some(Handle::File { below, .. }) => self.below().release(cx, node, below).map(|()| Reply::Empty),
            Some(Handle::Dir { below: Some(below), .. }) => self.below().call(cx, &Op::ReleaseDir { node, fh: below }),
            _ => Ok(Reply::Empty),
        }
    }

    // Directories.

    fn opendir(&self, cx: &Caller, node: NodeId) -> Result<Reply> {
        if self.is_virtual(node) {
            return Err(Error::Os(libc::ENOTDIR));
        }
        let below = match self.below().call(cx, &Op::OpenDir { node })? {
            Reply::Opened(o) => Some(o.fh),
            _ => None,
        };
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.state.lock().handles.insert(fh, Handle::Dir { below, listing: None });
        Ok(Reply::Opened(Opened { fh: FileHandle(fh), backing: None, direct_io: false, flush_on_close: false }))
    }

    fn readdir(&self, cx: &Caller, node: NodeId, fh: FileHandle, offset: u64, max: u32, plus: bool) -> Result<Reply> {
        let cached = match self.state.lock().handles.get(&fh.0) {
            Some(Handle::Dir { listing, .. }) => listing.clone().filter(|_| offset != 0),
            _ => return Err(Error::Os(libc::EBADF)),
        };
        let listing = match cached {
            Some(l) => l,
            None => {
                let l = Arc::new(self.listing(cx, node)?);
                if let Some(Handle::Dir { listing, .. }) = self.state.lock().handles.get_mut(&fh.0) {
                    *listing = Some(l.clone());
                }
                l
            }
        };
        // Offsets: 1 and 2 for `.` and `..`, then 3 + the index in the listing.
        let mut out = Vec::new();
        let dots = [(".", node), ("..", node)];
        for (i, (name, n)) in dots.iter().enumerate() {
            if offset <= i as u64 && out.len() < max as usize {
                out.push(DirEntry { name: (*name).into(), node: *n, kind: FileKind::Dir, next_offset: i as u64 + 1, entry: None });
            }
        }
        let skip = offset.saturating_sub(2) as usize;
        for (i, s) in listing.iter().enumerate().skip(skip) {
            if out.len() >= max as usize {
                break;
            }
            let next_offset = i as u64 + 3;
            let entry = if plus {
                match self.lookup(cx, node, &s.name) {
                    Ok(e) => Some(e),
                    Err(Error::Os(libc::ENOENT)) => continue, // gone since it was listed
                    Err(e) => return Err(e),
                }
            } else {
                None
            };
            let (node_id, kind) = match &entry {
                Some(e) => (e.node, e.attr.kind),
                None => (s.ino, s.kind),
            };
            out.push(DirEntry { name: s.name.clone(), node: node_id, kind, next_offset, entry });
        }
        Ok(Reply::Dir(out))
    }
}

impl Layer for ReverseView {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "crypt-reverse"
    }

    fn data_path(&self) -> DataPath {
        DataPath::Transforms
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }

    fn set_invalidator(&self, _inv: Arc<dyn plyfs_stack::Invalidator>) {
        // Names below are plaintext; the view's are not: nothing below can name what to drop.
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        if plyfs_stack::readonly::changes_storage(op) {
            return Err(Error::Os(libc::EROFS));
        }
        match *op {
            Op::Lookup { parent, name } => self.lookup(cx, parent, name).map(Reply::Entry),
            Op::Forget { node, nlookup } => self.forget(cx, node, nlookup),
            Op::GetAttr { node, .. } => {
                if self.is_virtual(node) {
                    return self.virtual_attr(cx, node).map(Reply::Attr);
                }
                let attr = self.below().getattr(cx, node)?;
                Ok(Reply::Attr(self.view_attr(node, attr)))
            }
            Op::ReadLink { node } => {
                let target = match self.below().call(cx, op)? {
                    Reply::Data(t) => t,
                    _ => return Err(Error::Os(libc::EIO)),
                };
                Ok(Reply::Data(match self.sealed_target(node, &target)? {
                    SealedTarget::Inline(t) => t.as_bytes().to_vec(),
                    SealedTarget::Long { marker, .. } => marker.as_bytes().to_vec(),
                }))
            }
            Op::Open { node, flags } => self.open(cx, node, flags),
            Op::Read { node, fh, offset, size } => self.read(cx, node, fh, offset, size),
            Op::Release { node, fh } | Op::ReleaseDir { node, fh } => self.release(cx, node, fh),
            Op::Flush { .. } | Op::Fsync { .. } | Op::FsyncDir { .. } => Ok(Reply::Empty),
            Op::OpenDir { node } => self.opendir(cx, node),
            Op::ReadDir { node, fh, offset, max_entries, plus } => self.readdir(cx, node, fh, offset, max_entries, plus),
            Op::StatFs { .. } => self.below().call(cx, &Op::StatFs { node: NodeId::ROOT }),
            Op::Access { node, mask } => {
                if mask & libc::W_OK != 0 {
                    return Err(Error::Os(libc::EROFS));
                }
                if self.is_virtual(node) {
                    return Ok(Reply::Empty);
                }
                self.below().call(cx, op)
            }
            // The plaintext's extended attributes stay private.
            Op::GetXattr { .. } => Err(Error::Os(libc::ENODATA)),
            Op::ListXattr { size, .. } => Ok(Reply::Xattr(if size == 0 { XattrReply::Size(0) } else { XattrReply::Data(Vec::new()) })),
            Op::Lseek { .. } => Err(Error::Os(libc::ENOSYS)),
            Op::Extended { name: "lower-info", .. } => Err(Error::Os(libc::ENOSYS)),
            _ => plyfs_stack::bypass(self, cx, op),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_target_lengths_match_the_names_layer() {
        for len in [0u64, 1, 2, 3, 100, 3000, 3043, 3044, 3045, 4095] {
            let blob = vec![0u8; len as usize + LINK_OVERHEAD];
            let shown = match SealedTarget::of(blob, len as usize) {
                SealedTarget::Inline(t) => t.len() as u64,
                SealedTarget::Long { marker, .. } => marker.len() as u64,
            };
            assert_eq!(stored_target_len(len), shown, "target of {len} bytes");
        }
    }
}
