//! # plyfs-policy
//!
//! Per-file and per-directory choice of data layers (ATTEST, `seeds/004` §4 and §6).
//!
//! The [`PolicyLayer`] sits in a mount's stack above the lower directory and below the
//! mount-wide layers (monitoring and the like). It routes the operations on each regular file
//! to that file's *chain*: the data layers (`zstd`, `gzip,copy`, ...) the file was written with,
//! or no layer at all, in which case the operations go straight to the lower directory and the
//! passthrough fast path stays open.
//!
//! - **Policy.** `user.plyfs.layers` on a file or directory names a chain, or `none`. A file
//!   attribute beats the nearest directory attribute, which beats the mount's rules file, which
//!   beats the mount's default chain (the data layers of `--stack`).
//! - **Record.** The chain a file's data was written with is recorded in the lower file's
//!   `user.plyfs.chain` attribute (hidden from the mount), so it is always read back through
//!   that chain whatever the policy says later. A file without the record was written through
//!   the mount's default chain.
//! - **Change.** A new file takes its policy at creation. An existing file keeps its chain until
//!   `plyfs policy apply` re-encodes it: into a new lower file beside it, made durable, then
//!   renamed over the old one, so that an interruption leaves either the old file or the new one,
//!   never a mix. (An empty, closed file switches at once: there is nothing to convert.)

pub mod chain;
pub mod rules;

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use plyfs_stack::shared::NoReplace;
use plyfs_stack::spec::LayerSpec;
use plyfs_stack::{
    bypass, Caller, DataPath, DirEntry, Entry, Error, ExtOpInfo, FileHandle, FileKind, Layer, LayerFactory, Level, NodeId, Op,
    Reply, Result, SetAttr, Stack, TimeSet, XattrReply, FILE_HEAD_BYTES,
};
use serde_json::{json, Value};

pub use chain::{Chain, ChainRef, Policy, NONE};
pub use rules::Rules;

/// The attribute users set: which layers apply to a file, or to the files created under a
/// directory.
pub const POLICY_XATTR: &str = "user.plyfs.layers";
/// The attribute recording the chain a file's data is encoded with (hidden from the mount).
pub const CHAIN_XATTR: &str = "user.plyfs.chain";
/// Marks a re-encoded copy that is not yet in place (hidden from the mount).
const TEMP_XATTR: &str = "user.plyfs.reencoding";
/// On the root of the lower directory once any file below has a record (hidden from the mount).
/// Until then no file has one, and looking a file up needs no attribute read.
pub const RECORDS_XATTR: &str = "user.plyfs.records";
/// Name prefix of re-encoded copies while they are written.
pub const TEMP_PREFIX: &str = ".plyfs-reencode.";

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo {
        name: "policy-explain",
        args: "",
        help: "which chain applies to a file, which attribute or rule decided it, and the chain its data is recorded with",
    },
    ExtOpInfo {
        name: "policy-apply",
        args: "",
        help: "re-encode a file whose recorded chain differs from its policy (atomically); removes leftovers of an interrupted run",
    },
    ExtOpInfo {
        name: "policy-plain",
        args: "[LIMIT]",
        help: "count the plain files under a directory (no record, not in the format of the mount's default chain), looking at LIMIT files at most",
    },
];

/// A walk counting plain files.
struct PlainCount {
    looked_at: u64,
    plain: u64,
    limit: u64,
    /// Stopped at the limit with files left to look at.
    cut: bool,
}

/// Where a file's policy came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// The file's own `user.plyfs.layers`.
    FileAttr,
    /// `user.plyfs.layers` on this directory (relative path; "" is the mount root).
    DirAttr(Arc<str>),
    /// Rule number N of the rules file, with its text.
    Rule(usize, Arc<str>),
    /// The data layers of the mount's `--stack`.
    Default,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::FileAttr => write!(f, "the file's own {POLICY_XATTR}"),
            Source::DirAttr(p) if p.is_empty() => write!(f, "{POLICY_XATTR} on the mount root"),
            Source::DirAttr(p) => write!(f, "{POLICY_XATTR} on directory {p}"),
            Source::Rule(n, text) => write!(f, "rule {n} of the rules file ({text})"),
            Source::Default => f.write_str("the mount's default (the data layers of --stack)"),
        }
    }
}

#[derive(Clone)]
struct Decided {
    /// The chain the policy names, built.
    chain: ChainRef,
    source: Source,
}

/// What the layer knows of a node the kernel holds.
enum Known {
    File(FileState),
    Other,
}

struct FileState {
    /// `None` until first needed.
    chain: Option<ChainRef>,
    /// Handles open on it: a file in use is not re-encoded.
    opens: u32,
    /// Replaced by a re-encoded file under the same name: new uses get ESTALE, so that the
    /// kernel looks the name up again.
    superseded: bool,
    /// On a shared lower: the chain is the default only because the file, still empty, had no
    /// record when last asked; the mount that created it may not have recorded it yet.
    provisional: bool,
}

struct DirState {
    generation: u64,
    /// Relative to the mount root, "" for the root; known only where rules or the directory's
    /// own policy need it.
    path: Option<String>,
    decided: Option<Decided>,
}

pub struct PolicyLayer {
    name: String,
    lower: [Level; 1],
    registry: &'static [LayerFactory],
    none: ChainRef,
    default: ChainRef,
    rules: Rules,
    /// The chain of each rule, built at its first match (rules were checked at mount).
    rule_chains: Vec<OnceLock<ChainRef>>,
    chains: Mutex<HashMap<String, ChainRef>>,
    nodes: RwLock<HashMap<NodeId, Known>>,
    dirs: Mutex<HashMap<NodeId, DirState>>,
    /// Bumped whenever a directory policy or the shape of the tree changes: cached directory
    /// decisions older than it are recomputed.
    generation: AtomicU64,
    temp_counter: AtomicU64,
    /// `TEMP_PREFIX.PID.TOKEN.`: this process's temporary names.
    temp_stem: String,
    warned_no_xattrs: std::sync::atomic::AtomicBool,
    /// Whether any file of the lower directory may carry a record ([`RECORDS_XATTR`]).
    records: std::sync::atomic::AtomicBool,
    /// Opens take it shared; the moment a re-encoded file replaces the old one takes it
    /// exclusively, so that no open can slip between the last check and the switch.
    switch: RwLock<()>,
    /// Other mounts share the lower tree (`-o shared`): they may record chains at any time.
    shared: bool,
    /// How files made under a temporary name move into place.
    no_replace: NoReplace,
}

fn daemon() -> Caller {
    Caller::daemon()
}

impl PolicyLayer {
    /// `default`: the mount's default chain (possibly none); `rules`: the mount's rules.
    pub fn new(
        name: &str,
        default: &Policy,
        rules: Rules,
        registry: &'static [LayerFactory],
        lower: Level,
    ) -> Result<Arc<PolicyLayer>> {
        let none = Arc::new(Chain::none(&lower));
        let default = if default.is_none() { none.clone() } else { Arc::new(Chain::build(default, registry, &lower)?) };
        let mut chains = HashMap::new();
        chains.insert(none.text.clone(), none.clone());
        chains.insert(default.text.clone(), default.clone());
        let mut nodes = HashMap::new();
        nodes.insert(NodeId::ROOT, Known::Other);
        let op = Op::GetXattr { node: NodeId::ROOT, name: OsStr::new(RECORDS_XATTR), size: 64 };
        let shared = plyfs_stack::shared::mode().is_some();
        let records = match lower.call(&daemon(), &op) {
            Ok(_) => true,
            Err(Error::Os(libc::ENODATA | libc::ENOTSUP)) => false,
            // Unknown: read every file's record, to be safe.
            Err(_) => true,
        };
        Ok(Arc::new(PolicyLayer {
            name: name.to_owned(),
            lower: [lower],
            registry,
            none,
            default,
            rule_chains: (0..rules.len()).map(|_| OnceLock::new()).collect(),
            rules,
            chains: Mutex::new(chains),
            nodes: RwLock::new(nodes),
            dirs: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(1),
            temp_counter: AtomicU64::new(0),
            temp_stem: {
                // Random per process: mounts on other machines sharing the lower may have the
                // same process ids.
                let mut token = [0u8; 4];
                getrandom::getrandom(&mut token).expect("the system's random number generator failed");
                format!("{TEMP_PREFIX}{}.{:08x}.", std::process::id(), u32::from_le_bytes(token))
            },
            warned_no_xattrs: std::sync::atomic::AtomicBool::new(false),
            records: std::sync::atomic::AtomicBool::new(records),
            switch: RwLock::new(()),
            shared,
            no_replace: NoReplace::default(),
        }))
    }

    fn below(&self) -> &Level {
        &self.lower[0]
    }

    pub fn default_chain(&self) -> &ChainRef {
        &self.default
    }

    /// The chain an attribute value names, built (known layers, valid parameters, data layers
    /// only) or refused.
    fn chain_named(&self, text: &str) -> Result<ChainRef> {
        self.chain_for(&Policy::parse(text)?)
    }

    /// The chain for `policy`, built once per distinct policy.
    fn chain_for(&self, policy: &Policy) -> Result<ChainRef> {
        let text = policy.to_string();
        if let Some(c) = self.chains.lock().get(&text) {
            return Ok(c.clone());
        }
        let chain = Arc::new(Chain::build(policy, self.registry, self.below())?);
        Ok(self.chains.lock().entry(text).or_insert(chain).clone())
    }

    // What is known about nodes.

    fn note_entry(&self, e: &Entry) {
        if self.nodes.read().contains_key(&e.node) {
            return;
        }
        let mut nodes = self.nodes.write();
        nodes.entry(e.node).or_insert_with(|| {
            if e.attr.kind == FileKind::File {
                Known::File(FileState { chain: None, opens: 0, superseded: false, provisional: false })
            } else {
                Known::Other
            }
        });
    }

    fn note_file(&self, node: NodeId, chain: ChainRef, provisional: bool) {
        let mut nodes = self.nodes.write();
        match nodes.get_mut(&node) {
            Some(Known::File(f)) => {
                f.chain = Some(chain);
                f.provisional = provisional;
            }
            _ => {
                nodes.insert(node, Known::File(FileState { chain: Some(chain), opens: 0, superseded: false, provisional }));
            }
        }
    }

    /// The chain a node's operations go to: its recorded chain for a regular file, none for
    /// anything else.
    fn chain_of(&self, node: NodeId) -> Result<ChainRef> {
        let known_file = match self.nodes.read().get(&node) {
            Some(Known::Other) => return Ok(self.none.clone()),
            Some(Known::File(FileState { superseded: true, .. })) => return Err(Error::Os(libc::ESTALE)),
            // A provisional chain is asked again, unless handles use it.
            Some(Known::File(FileState { chain: Some(c), provisional, opens, .. })) if !*provisional || *opens > 0 => {
                return Ok(c.clone())
            }
            Some(Known::File(_)) => true,
            None => false,
        };
        if !known_file && self.below().getattr(&daemon(), node)?.kind != FileKind::File {
            self.nodes.write().insert(node, Known::Other);
            return Ok(self.none.clone());
        }
        let chain = self.recorded_chain(node)?;
        // Another mount that has just created an empty file may not have recorded its chain yet,
        // nor written its header: no record on an empty file, and a plain verdict, are not
        // remembered.
        let plain = Arc::ptr_eq(&chain, &self.none) && self.default.transforms();
        let provisional = self.shared
            && (plain || Arc::ptr_eq(&chain, &self.default) && self.below().getattr(&daemon(), node)?.size == 0);
        self.note_file(node, chain.clone(), provisional);
        Ok(chain)
    }

    /// The chain recorded with a regular file, or when it has no record, the default's.
    fn recorded_chain(&self, node: NodeId) -> Result<ChainRef> {
        // On a shared lower, another mount may record the first chain at any time.
        if !self.shared && !self.records.load(Ordering::Acquire) {
            return Ok(self.unrecorded_chain(node));
        }
        match self.read_xattr(node, CHAIN_XATTR)? {
            None => Ok(self.unrecorded_chain(node)),
            Some(text) => {
                let policy = Policy::parse(&text).map_err(|e| self.unreadable_record(node, &text, &e))?;
                self.chain_for(&policy).map_err(|e| self.unreadable_record(node, &text, &e))
            }
        }
    }

    /// The chain of a file without a record: the default, unless the file is plain, that is
    /// not empty and failing the default chain's test of its lower files (see
    /// [`plyfs_stack::Layer::file_test`]). A plain file was there before the mount's data layers:
    /// it is served as it is, the chain none, until `plyfs policy apply` encodes it. A file the
    /// daemon cannot read is the default's, which says why it cannot open it (and `stat` works).
    fn unrecorded_chain(&self, node: NodeId) -> ChainRef {
        let Some(is_encoded) = self.default.file_test() else { return self.default.clone() };
        let head = match self.lower_head(node) {
            Ok(head) => head,
            Err(e) => {
                tracing::debug!("{}: cannot tell whether it is plain: {e}", self.describe(node));
                return self.default.clone();
            }
        };
        if head.is_empty() || is_encoded(&head) { self.default.clone() } else { self.none.clone() }
    }

    /// The first [`FILE_HEAD_BYTES`] of a lower file.
    fn lower_head(&self, node: NodeId) -> Result<Vec<u8>> {
        let cx = daemon();
        let opened = self.below().open(&cx, node, libc::O_RDONLY)?;
        let head = self.below().read(&cx, node, opened.fh, 0, FILE_HEAD_BYTES as u32);
        let _ = self.below().release(&cx, node, opened.fh);
        head
    }

    /// Whether a regular file is plain: without a record, and not in the default chain's format.
    fn is_plain(&self, node: NodeId) -> Result<bool> {
        let may_have_record = self.shared || self.records.load(Ordering::Acquire);
        if may_have_record && self.read_xattr(node, CHAIN_XATTR)?.is_some() {
            return Ok(false);
        }
        Ok(Arc::ptr_eq(&self.unrecorded_chain(node), &self.none))
    }

    fn unreadable_record(&self, node: NodeId, text: &str, e: &Error) -> Error {
        let msg = format!("{}: its data is recorded as encoded with '{text}', which this build cannot read: {e}", self.describe(node));
        tracing::error!("{msg}");
        Error::Corrupt(msg)
    }

    fn describe_in(&self, parent: NodeId, name: &OsStr) -> String {
        match self.rel_path(parent) {
            Ok(p) if p.is_empty() => name.to_string_lossy().into_owned(),
            Ok(p) => format!("{p}/{}", name.to_string_lossy()),
            Err(_) => name.to_string_lossy().into_owned(),
        }
    }

    fn describe(&self, node: NodeId) -> String {
        self.rel_path(node).map_or_else(|_| format!("inode {}", node.0), |p| if p.is_empty() { "/".into() } else { p })
    }

    /// An attribute of the lower node as text, `None` when it is not set.
    fn read_xattr(&self, node: NodeId, name: &str) -> Result<Option<String>> {
        let op = Op::GetXattr { node, name: OsStr::new(name), size: 4096 };
        match self.below().call(&daemon(), &op) {
            Ok(Reply::Xattr(XattrReply::Data(d))) => Ok(Some(String::from_utf8_lossy(&d).into_owned())),
            Ok(_) => Err(Error::Os(libc::EIO)),
            Err(Error::Os(libc::ENODATA | libc::ENOTSUP)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Record `chain` with a file. The first record of a lower directory first marks its root
    /// (durably), so that later mounts know to read records.
    fn record(&self, node: NodeId, chain: &str) -> Result<()> {
        if !self.records.load(Ordering::Acquire) {
            let _once = self.switch.write();
            if !self.records.load(Ordering::Acquire) {
                self.write_xattr(NodeId::ROOT, RECORDS_XATTR, "1")?;
                let cx = daemon();
                if let Ok(Reply::Opened(o)) = self.below().call(&cx, &Op::OpenDir { node: NodeId::ROOT }) {
                    let synced = self.below().call(&cx, &Op::FsyncDir { node: NodeId::ROOT, fh: o.fh, datasync: false });
                    let _ = self.below().call(&cx, &Op::ReleaseDir { node: NodeId::ROOT, fh: o.fh });
                    synced?;
                }
                self.records.store(true, Ordering::Release);
            }
        }
        self.write_xattr(node, CHAIN_XATTR, chain)
    }

    fn write_xattr(&self, node: NodeId, name: &str, value: &str) -> Result<()> {
        let op = Op::SetXattr { node, name: OsStr::new(name), value: value.as_bytes(), flags: 0 };
        self.below().call(&daemon(), &op).map(|_| ())
    }

    fn remove_xattr(&self, node: NodeId, name: &str) -> Result<()> {
        match self.below().call(&daemon(), &Op::RemoveXattr { node, name: OsStr::new(name) }) {
            Ok(_) | Err(Error::Os(libc::ENODATA)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The policy attribute of a node, `None` when it has none. A value that does not parse
    /// (written from outside the mount) is ignored with a warning.
    fn own_policy(&self, node: NodeId) -> Result<Option<ChainRef>> {
        let Some(text) = self.read_xattr(node, POLICY_XATTR)? else { return Ok(None) };
        match self.chain_named(&text) {
            Ok(chain) => Ok(Some(chain)),
            Err(e) => {
                tracing::warn!("{}: ignoring {POLICY_XATTR}={text:?}: {e}", self.describe(node));
                Ok(None)
            }
        }
    }

    // Paths.

    /// The node's path relative to the mount root ("" for the root), as the layers above
    /// name it: the bottom's `lower-info` says, translated by any layer between (a crypt
    /// volume's names).
    fn rel_path(&self, node: NodeId) -> Result<String> {
        if node == NodeId::ROOT {
            return Ok(String::new());
        }
        let v = self.below().extended(&daemon(), node, "lower-info", &[])?;
        v.get("path").and_then(Value::as_str).map(str::to_owned).ok_or(Error::Os(libc::EIO))
    }

    // Deciding.

    /// The policy directory `dir` hands down to new files: its own attribute, else its
    /// parent's. Cached until a directory policy changes or a directory moves.
    fn dir_decision(&self, dir: NodeId) -> Result<(Option<String>, Option<Decided>)> {
        let generation = self.generation.load(Ordering::Acquire);
        if let Some(d) = self.dirs.lock().get(&dir).filter(|d| d.generation == generation) {
            return Ok((d.path.clone(), d.decided.clone()));
        }
        // Paths serve to match rules and to name a directory's own policy; without either no
        // path is asked for (a deep tree's lower paths can pass PATH_MAX).
        let own = self.own_policy(dir)?;
        let path = if !self.rules.is_empty() || own.is_some() { Some(self.rel_path(dir)?) } else { None };
        let decided = match own {
            Some(chain) => Some(Decided { chain, source: Source::DirAttr(path.clone().unwrap_or_default().as_str().into()) }),
            None if dir == NodeId::ROOT => None,
            None => {
                let parent = self.below().lookup(&daemon(), dir, OsStr::new(".."))?;
                let inherited = self.dir_decision(parent.node);
                self.below().forget(&daemon(), parent.node, 1);
                inherited?.1
            }
        };
        let mut dirs = self.dirs.lock();
        if dirs.len() > 1 << 16 {
            dirs.clear();
        }
        dirs.insert(dir, DirState { generation, path: path.clone(), decided: decided.clone() });
        Ok((path, decided))
    }

    /// The policy for a file in `dir` named `name` of `size` bytes, ignoring any attribute of
    /// its own.
    fn decide_in(&self, dir: NodeId, name: &OsStr, size: u64) -> Result<Decided> {
        let (dir_path, from_dir) = self.dir_decision(dir)?;
        if let Some(d) = from_dir {
            return Ok(d);
        }
        if !self.rules.is_empty() {
            let name = name.to_string_lossy();
            let dir_path = dir_path.unwrap_or_default();
            let path = if dir_path.is_empty() { name.into_owned() } else { format!("{dir_path}/{name}") };
            if let Some(r) = self.rules.find(&path, size) {
                let slot = &self.rule_chains[r.number - 1];
                let chain = match slot.get() {
                    Some(c) => c.clone(),
                    None => {
                        let c = self.chain_for(&r.policy)?;
                        slot.get_or_init(|| c).clone()
                    }
                };
                return Ok(Decided { chain, source: Source::Rule(r.number, r.text.as_str().into()) });
            }
        }
        Ok(Decided { chain: self.default.clone(), source: Source::Default })
    }

    /// The parent directory and name of an existing file, found from its path. The returned
    /// guard holds the lookups made on the way until it is dropped.
    fn parent_and_name(&self, node: NodeId) -> Result<(Held<'_>, OsString, String)> {
        let path = self.rel_path(node)?;
        let (dir, name) = path.rsplit_once('/').unwrap_or(("", &path));
        let mut held = Held { layer: self, nodes: Vec::new() };
        for comp in dir.split('/').filter(|c| !c.is_empty()) {
            let e = self.below().lookup(&daemon(), held.last(), OsStr::new(comp))?;
            held.nodes.push(e.node);
        }
        let name = OsString::from_vec(name.as_bytes().to_vec());
        Ok((held, name, path))
    }

    /// Which policy applies to an existing file, and where it came from.
    fn decide_existing(&self, node: NodeId) -> Result<(Decided, String, Held<'_>, OsString)> {
        let (held, name, path) = self.parent_and_name(node)?;
        let decided = match self.own_policy(node)? {
            Some(chain) => Decided { chain, source: Source::FileAttr },
            None => {
                let size = self.chain_of(node)?.top.getattr(&daemon(), node)?.size;
                self.decide_in(held.last(), &name, size)?
            }
        };
        Ok((decided, path, held, name))
    }

    // Operations.

    /// An operation that answers with an entry (lookup, link, mknod, mkdir, symlink): note the
    /// node, and show a file as its chain does.
    fn entry_op(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let mut e = match self.below().call(cx, op)? {
            Reply::Entry(e) => e,
            other => return Ok(other),
        };
        self.note_entry(&e);
        self.fix_entry(&mut e)?;
        Ok(Reply::Entry(e))
    }

    /// Report what the file's chain shows (the decoded size) instead of the lower attributes.
    fn fix_entry(&self, e: &mut Entry) -> Result<()> {
        // While no file of the tree has a record and the default encodes nothing, no file is
        // encoded. An empty lower file still goes through its chain: the chain reports its own
        // block size (the chunk), as it does when the file is created and at getattr.
        if e.attr.kind != FileKind::File || !self.default.transforms() && !self.shared && !self.records.load(Ordering::Acquire) {
            return Ok(());
        }
        // A file whose chain cannot be read still has a name and attributes (the error is in the
        // log, and opening it says so).
        let Ok(chain) = self.chain_of(e.node) else { return Ok(()) };
        if chain.transforms() {
            e.attr = chain.top.getattr(&daemon(), e.node)?;
        }
        Ok(())
    }

    fn create(&self, cx: &Caller, parent: NodeId, name: &OsStr, mode: u32, flags: i32) -> Result<Reply> {
        if name.as_bytes().starts_with(TEMP_PREFIX.as_bytes()) {
            tracing::debug!("create of a name that re-encoding uses: {name:?}");
        }
        // An existing file keeps its chain (open with O_CREAT but without O_EXCL).
        if flags & libc::O_EXCL == 0 {
            if let Some(reply) = self.create_existing(cx, parent, name, mode, flags) {
                return reply;
            }
        }
        let decided = self.decide_in(parent, name, 0)?;
        let chain = decided.chain;
        // A file of the default chain reads the same in every mount, recorded yet or not.
        if self.shared && !Arc::ptr_eq(&chain, &self.default) {
            return self.create_recorded(cx, parent, name, mode, flags, &chain);
        }
        let reply = chain.top.call(cx, &Op::Create { parent, name, mode, flags });
        self.finish_create(reply, &chain, true, parent, name)
    }

    /// `create` of a name that exists: the file opened through its own chain. `None` if the name
    /// is free.
    fn create_existing(&self, cx: &Caller, parent: NodeId, name: &OsStr, mode: u32, flags: i32) -> Option<Result<Reply>> {
        let e = self.below().lookup(cx, parent, name).ok()?;
        self.note_entry(&e);
        let chain = self.chain_of(e.node);
        self.below().forget(cx, e.node, 1);
        Some(chain.and_then(|chain| {
            self.finish_create(chain.top.call(cx, &Op::Create { parent, name, mode, flags }), &chain, false, parent, name)
        }))
    }

    /// Give the file `node` named `tmp` in `parent` the name `name`, unless that name exists
    /// (`EEXIST`; see [`NoReplace`]).
    fn move_into_place(&self, cx: &Caller, node: NodeId, parent: NodeId, tmp: &OsStr, name: &OsStr) -> Result<()> {
        self.no_replace.rename(self.below(), cx, (parent, tmp), (parent, name), node, FileKind::File)
    }

    /// `create` on a shared lower of a file that needs a record: made under a temporary name,
    /// recorded, then renamed into place, so that another mount never finds the file without
    /// its record (it would take it for a plain file). If another mount made the name first, its
    /// file is opened instead (or `EEXIST` under `O_EXCL`).
    fn create_recorded(&self, cx: &Caller, parent: NodeId, name: &OsStr, mode: u32, flags: i32, chain: &ChainRef) -> Result<Reply> {
        let n = self.temp_counter.fetch_add(1, Ordering::Relaxed);
        let tmp = OsString::from(format!("{}{n}", self.temp_stem));
        let reply = chain.top.call(cx, &Op::Create { parent, name: &tmp, mode, flags: flags | libc::O_EXCL });
        let reply = self.finish_create(reply, chain, true, parent, &tmp)?;
        let Reply::Created(e, opened) = &reply else { return Err(Error::Os(libc::EIO)) };
        match self.move_into_place(cx, e.node, parent, &tmp, name) {
            Ok(()) => {
                // The rename changed the file's ctime: reply with its attributes as they are.
                let Reply::Created(mut e, opened) = reply else { unreachable!("matched above") };
                e.attr = chain.top.getattr(&daemon(), e.node)?;
                Ok(Reply::Created(e, opened))
            }
            Err(err) => {
                let _ = chain.top.release(&daemon(), e.node, opened.fh);
                self.count_open(e.node, -1);
                let _ = self.below().unlink(&daemon(), parent, &tmp);
                self.below().forget(&daemon(), e.node, 1);
                match err {
                    Error::Os(libc::EEXIST) if flags & libc::O_EXCL == 0 => {
                        self.create_existing(cx, parent, name, mode, flags).unwrap_or(Err(Error::Os(libc::EEXIST)))
                    }
                    err => Err(err),
                }
            }
        }
    }

    fn finish_create(&self, reply: Result<Reply>, chain: &ChainRef, new: bool, parent: NodeId, name: &OsStr) -> Result<Reply> {
        let Reply::Created(mut e, opened) = reply? else { return Err(Error::Os(libc::EIO)) };
        let is_default = Arc::ptr_eq(chain, &self.default);
        if new && e.attr.size == 0 && (chain.transforms() || !is_default) {
            // Record the chain before any data is written, so that the file is read through it
            // even if the mount's default changes. (A file without a record is read through the
            // default; only plain files in a mount without data layers go unrecorded, at no cost.)
            if let Err(err) = self.record(e.node, &chain.text) {
                if is_default {
                    if !self.warned_no_xattrs.swap(true, Ordering::Relaxed) {
                        tracing::warn!("the lower file system refuses extended attributes ({err}): files are not recorded with their chain and must be mounted with the same --stack");
                    }
                } else {
                    let _ = chain.top.release(&daemon(), e.node, opened.fh);
                    let _ = self.below().unlink(&daemon(), parent, name);
                    tracing::error!(
                        "{}: cannot record its chain '{}' ({err}); per-file layers need extended attributes on the lower file system",
                        self.describe_in(parent, name),
                        chain.text
                    );
                    return Err(err);
                }
            } else {
                // Setting the attribute changed the ctime: reply with the attributes as they are.
                e.attr = chain.top.getattr(&daemon(), e.node)?;
            }
        }
        self.note_open(e.node, chain);
        if e.attr.kind == FileKind::File && chain.transforms() && e.attr.size > 0 {
            e.attr = chain.top.getattr(&daemon(), e.node)?;
        }
        Ok(Reply::Created(e, opened))
    }

    /// One more handle open on `node` through `chain`. The node's state is made again if a
    /// forget (of an earlier lookup) took it away meanwhile.
    fn note_open(&self, node: NodeId, chain: &ChainRef) {
        let mut nodes = self.nodes.write();
        match nodes.get_mut(&node) {
            Some(Known::File(f)) => {
                f.chain = Some(chain.clone());
                f.provisional = false;
                f.opens += 1;
            }
            _ => {
                nodes.insert(node, Known::File(FileState { chain: Some(chain.clone()), opens: 1, superseded: false, provisional: false }));
            }
        }
    }

    fn count_open(&self, node: NodeId, delta: i32) {
        if let Some(Known::File(f)) = self.nodes.write().get_mut(&node) {
            f.opens = f.opens.saturating_add_signed(delta);
        }
    }

    fn set_policy_attr(&self, cx: &Caller, op: &Op<'_>, node: NodeId, value: &[u8]) -> Result<Reply> {
        let text = String::from_utf8_lossy(value);
        let new = self.chain_named(&text).map_err(|e| {
            tracing::error!("{}: refusing {POLICY_XATTR}={text:?}: {e}", self.describe(node));
            Error::Os(libc::EINVAL)
        })?;
        let reply = self.below().call(cx, op)?;
        match self.nodes.read().get(&node) {
            Some(Known::File(_)) => {}
            _ => {
                self.generation.fetch_add(1, Ordering::AcqRel);
                return Ok(reply);
            }
        }
        // A file that is empty and closed has nothing to convert: it switches at once.
        let idle = matches!(self.nodes.read().get(&node), Some(Known::File(f)) if f.opens == 0);
        if idle {
            let chain = self.chain_of(node)?;
            let empty = chain.top.getattr(&daemon(), node).is_ok_and(|a| a.size == 0);
            if empty && chain.text != new.text {
                self.record(node, &new.text)?;
                // Drop what the old chain keeps about the file.
                let _ = chain.top.call(&daemon(), &Op::Forget { node, nlookup: 0 });
                self.note_file(node, new, false);
            }
        }
        Ok(reply)
    }

    /// List attributes without the hidden ones.
    fn list_xattr(&self, cx: &Caller, node: NodeId, size: u32) -> Result<Reply> {
        let all = match self.below().call(cx, &Op::ListXattr { node, size: 1 << 16 })? {
            Reply::Xattr(XattrReply::Data(d)) => d,
            other => return Ok(other),
        };
        let mut out = Vec::with_capacity(all.len());
        for name in all.split(|b| *b == 0).filter(|n| !n.is_empty()) {
            if !hidden(OsStr::from_bytes(name)) {
                out.extend_from_slice(name);
                out.push(0);
            }
        }
        if size == 0 {
            return Ok(Reply::Xattr(XattrReply::Size(out.len() as u32)));
        }
        if out.len() > size as usize {
            return Err(Error::Os(libc::ERANGE));
        }
        Ok(Reply::Xattr(XattrReply::Data(out)))
    }

    fn fix_dir_entries(&self, entries: &mut [DirEntry]) -> Result<()> {
        for e in entries.iter_mut().filter_map(|d| d.entry.as_mut()) {
            self.note_entry(e);
            self.fix_entry(e)?;
        }
        Ok(())
    }

    fn forget(&self, cx: &Caller, node: NodeId, nlookup: u64) -> Result<Reply> {
        // A forget may reach the daemon after the kernel looked the node up again and opened
        // it (the kernel sends it on its own): a file with open handles keeps its state.
        let known = {
            let mut nodes = self.nodes.write();
            match nodes.get(&node) {
                Some(Known::File(FileState { opens, chain: Some(c), .. })) if *opens > 0 => {
                    let chain = c.clone();
                    drop(nodes);
                    return chain.top.call(cx, &Op::Forget { node, nlookup });
                }
                _ => nodes.remove(&node),
            }
        };
        self.dirs.lock().remove(&node);
        let chain = match known {
            Some(Known::File(FileState { chain: Some(c), .. })) => c,
            _ => self.none.clone(),
        };
        chain.top.call(cx, &Op::Forget { node, nlookup })
    }

    fn is_dir(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> bool {
        match self.below().lookup(cx, parent, name) {
            Ok(e) => {
                self.below().forget(cx, e.node, 1);
                e.attr.kind == FileKind::Dir
            }
            Err(_) => false,
        }
    }

    // Extended operations.

    fn explain(&self, node: NodeId) -> Result<Value> {
        let chain = self.chain_of(node)?;
        if !matches!(self.nodes.read().get(&node), Some(Known::File(_))) {
            let (path, decided) = self.dir_decision(node)?;
            let path = match path {
                Some(p) => p,
                None => self.rel_path(node)?,
            };
            let decided = decided.unwrap_or_else(|| self.rule_or_default_for_dir());
            return Ok(json!({
                "path": path,
                "kind": "directory",
                "new_files": decided.chain.text,
                "source": decided.source.to_string(),
                "rules_apply": decided.source == Source::Default && !self.rules.is_empty(),
            }));
        }
        let recorded_explicitly = self.read_xattr(node, CHAIN_XATTR)?.is_some();
        let (decided, path, ..) = self.decide_existing(node)?;
        let pending = decided.chain.text != chain.text;
        Ok(json!({
            "path": path,
            "kind": "file",
            "policy": decided.chain.text,
            "source": decided.source.to_string(),
            "recorded": chain.text,
            "recorded_by": match recorded_explicitly {
                true => format!("recorded in {CHAIN_XATTR} on the lower file"),
                false if Arc::ptr_eq(&chain, &self.none) && self.default.transforms() => "a plain file: no record, and not in the format of the mount's default chain".to_owned(),
                false => "no record on the lower file: the mount's default chain".to_owned(),
            },
            "pending": pending,
        }))
    }

    /// Count the plain files under directory `dir` (see [`PolicyLayer::unrecorded_chain`]),
    /// looking at the first `args[0]` regular files met (all without it). A walk cut short says
    /// so: its count is a lower bound.
    fn count_plain(&self, dir: NodeId, args: &[String]) -> Result<Value> {
        let limit = match args.first() {
            Some(a) => a.parse::<u64>().map_err(|_| Error::BadArgs(format!("policy-plain: {a:?} is not a number of files")))?,
            None => u64::MAX,
        };
        let mut walk = PlainCount { looked_at: 0, plain: 0, limit, cut: false };
        if self.default.file_test().is_some() {
            self.count_plain_in(dir, &mut walk)?;
        }
        Ok(json!({ "plain": walk.plain, "looked_at": walk.looked_at, "complete": !walk.cut, "chain": self.default.text }))
    }

    /// Count in `dir` and below; what cannot be looked at is left out (and logged).
    fn count_plain_in(&self, dir: NodeId, walk: &mut PlainCount) -> Result<()> {
        let cx = daemon();
        for d in self.below().list_dir(&cx, dir)? {
            let is_temp = d.name.as_bytes().starts_with(TEMP_PREFIX.as_bytes());
            if !matches!(d.kind, FileKind::File | FileKind::Dir) || is_temp {
                continue;
            }
            if walk.looked_at >= walk.limit {
                walk.cut = true;
                break;
            }
            let counted = self.below().lookup(&cx, dir, &d.name).and_then(|e| {
                let counted = match e.attr.kind {
                    FileKind::Dir => self.count_plain_in(e.node, walk),
                    _ => self.is_plain(e.node).map(|plain| {
                        walk.looked_at += 1;
                        walk.plain += u64::from(plain);
                    }),
                };
                self.below().forget(&cx, e.node, 1);
                counted
            });
            if let Err(e) = counted {
                tracing::debug!("{}: not counted: {e}", self.describe_in(dir, &d.name));
            }
        }
        Ok(())
    }

    fn rule_or_default_for_dir(&self) -> Decided {
        Decided { chain: self.default.clone(), source: Source::Default }
    }

    /// Re-encode a file to its policy; remove a leftover of an interrupted re-encoding.
    fn apply(&self, node: NodeId) -> Result<Value> {
        let chain = self.chain_of(node)?;
        if !matches!(self.nodes.read().get(&node), Some(Known::File(_))) {
            return Ok(json!({ "changed": false, "reason": "not a regular file" }));
        }
        if self.read_xattr(node, TEMP_XATTR)?.is_some() {
            return self.remove_leftover(node);
        }
        let (decided, path, held, name) = self.decide_existing(node)?;
        let target = decided.chain.clone();
        if target.text == chain.text {
            return Ok(json!({ "path": path, "changed": false, "chain": chain.text }));
        }
        let bytes = self.reencode(node, &chain, &target, held.last(), &name, &path)?;
        Ok(json!({ "path": path, "changed": true, "from": chain.text, "to": target.text, "bytes": bytes, "source": decided.source.to_string() }))
    }

    fn remove_leftover(&self, node: NodeId) -> Result<Value> {
        let (held, name, path) = self.parent_and_name(node)?;
        self.below().unlink(&daemon(), held.last(), &name)?;
        tracing::info!("{path}: removed the leftover of an interrupted re-encoding");
        Ok(json!({ "path": path, "changed": true, "removed_leftover": true }))
    }

    fn reencode(&self, node: NodeId, from: &ChainRef, to: &ChainRef, parent: NodeId, name: &OsStr, path: &str) -> Result<u64> {
        let cx = daemon();
        // The caller names the file as it asked for it: a hard link's path here may be another
        // of its names.
        let refuse = |why: &str| {
            tracing::warn!("{path}: not re-encoded: {why}");
            Error::BadArgs(format!("not re-encoded: {why}"))
        };
        if self.is_open(node) {
            return Err(refuse("it is open; run again once it is closed"));
        }
        let attr = from.top.getattr(&cx, node)?;
        if attr.nlink > 1 {
            return Err(refuse(&format!("it has {} hard links, which a re-encoded copy would split", attr.nlink)));
        }
        // The new encoding goes into a new lower file beside the old one, marked as a leftover
        // until it is complete.
        let (tmp, tmp_name, fh) = loop {
            let n = self.temp_counter.fetch_add(1, Ordering::Relaxed);
            let tmp_name = OsString::from(format!("{}{n}", self.temp_stem));
            let op = Op::Create { parent, name: &tmp_name, mode: 0o600, flags: libc::O_RDWR | libc::O_EXCL };
            match to.top.call(&cx, &op) {
                Ok(Reply::Created(e, o)) => break (e.node, tmp_name, o.fh),
                Ok(_) => return Err(Error::Os(libc::EIO)),
                Err(Error::Os(libc::EEXIST)) => continue,
                Err(e) => return Err(e),
            }
        };
        let mut open = Some(fh);
        let result = (|| {
            self.write_xattr(tmp, TEMP_XATTR, path)?;
            self.record(tmp, &to.text)?;
            let bytes = self.copy_data(node, from, tmp, fh, to)?;
            to.top.call(&cx, &Op::Fsync { node: tmp, fh, datasync: false })?;
            to.top.release(&cx, tmp, fh)?;
            open = None;
            self.copy_xattrs(node, tmp)?;
            let owner = SetAttr { uid: Some(attr.uid), gid: Some(attr.gid), ..Default::default() };
            if let Err(e) = self.below().call(&cx, &Op::SetAttr { node: tmp, fh: None, set: owner }) {
                tracing::debug!("{path}: the re-encoded file keeps the daemon as owner: {e}");
            }
            let rest = SetAttr {
                mode: Some(u32::from(attr.perm)),
                atime: Some(TimeSet::At(attr.atime)),
                mtime: Some(TimeSet::At(attr.mtime)),
                ..Default::default()
            };
            self.below().call(&cx, &Op::SetAttr { node: tmp, fh: None, set: rest })?;
            self.remove_xattr(tmp, TEMP_XATTR)?;
            // The switch: one rename replaces the old lower file by the new one. From here on
            // the old node answers ESTALE, and the kernel looks the name up again.
            let _no_opens = self.switch.write();
            if self.is_open(node) {
                return Err(refuse("it was opened meanwhile; run again once it is closed"));
            }
            let rename = Op::Rename { parent, name: &tmp_name, new_parent: parent, new_name: name, flags: 0 };
            self.below().call(&cx, &rename)?;
            if let Some(Known::File(f)) = self.nodes.write().get_mut(&node) {
                f.superseded = true;
            }
            Ok(bytes)
        })();
        if let Err(e) = &result {
            if let Some(fh) = open {
                let _ = to.top.release(&cx, tmp, fh);
            }
            let _ = self.below().unlink(&cx, parent, &tmp_name);
            if !matches!(e, Error::BadArgs(_)) {
                tracing::error!("{path}: re-encoding to '{}' failed, the file is unchanged: {e}", to.text);
            }
        }
        // The kernel never knew the new node: drop the reference `create` gave.
        let _ = to.top.call(&cx, &Op::Forget { node: tmp, nlookup: 1 });
        self.nodes.write().remove(&tmp);
        let bytes = result?;
        tracing::info!("{path}: re-encoded from '{}' to '{}' ({bytes} bytes)", from.text, to.text);
        Ok(bytes)
    }

    fn is_open(&self, node: NodeId) -> bool {
        matches!(self.nodes.read().get(&node), Some(Known::File(f)) if f.opens > 0)
    }

    fn copy_data(&self, node: NodeId, from: &ChainRef, tmp: NodeId, fh: FileHandle, to: &ChainRef) -> Result<u64> {
        let cx = daemon();
        let src = from.top.open(&cx, node, libc::O_RDONLY)?;
        let result = (|| {
            let mut off = 0u64;
            loop {
                let data = from.top.read(&cx, node, src.fh, off, 1 << 20)?;
                if data.is_empty() {
                    return Ok(off);
                }
                let mut done = 0;
                while done < data.len() {
                    done += to.top.write(&cx, tmp, fh, off + done as u64, &data[done..])? as usize;
                }
                off += data.len() as u64;
            }
        })();
        let _ = from.top.release(&cx, node, src.fh);
        result
    }

    /// Copy the extended attributes the file carries (its policy, ACLs, users' own) except the
    /// layer's hidden ones.
    fn copy_xattrs(&self, from: NodeId, to: NodeId) -> Result<()> {
        let cx = daemon();
        let names = match self.below().call(&cx, &Op::ListXattr { node: from, size: 1 << 16 })? {
            Reply::Xattr(XattrReply::Data(d)) => d,
            _ => return Ok(()),
        };
        for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()).map(OsStr::from_bytes) {
            if hidden(name) {
                continue;
            }
            let value = match self.below().call(&cx, &Op::GetXattr { node: from, name, size: 1 << 16 })? {
                Reply::Xattr(XattrReply::Data(d)) => d,
                _ => continue,
            };
            if let Err(e) = self.below().call(&cx, &Op::SetXattr { node: to, name, value: &value, flags: 0 }) {
                tracing::warn!("{}: attribute {name:?} not carried over: {e}", self.describe(from));
            }
        }
        Ok(())
    }
}

/// Lookups made while finding a file's parent directory, forgotten when dropped.
struct Held<'a> {
    layer: &'a PolicyLayer,
    nodes: Vec<NodeId>,
}

impl Held<'_> {
    /// The directory reached: the root when no lookup was needed.
    fn last(&self) -> NodeId {
        self.nodes.last().copied().unwrap_or(NodeId::ROOT)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        for n in self.nodes.drain(..).rev() {
            self.layer.below().forget(&daemon(), n, 1);
        }
    }
}

/// Attributes the layer keeps for itself.
fn hidden(name: &OsStr) -> bool {
    name == CHAIN_XATTR || name == TEMP_XATTR || name == RECORDS_XATTR
}

impl Layer for PolicyLayer {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "policy"
    }

    fn data_path(&self) -> DataPath {
        // Untouched files go straight to the lower directory; the chains of the others strip
        // passthrough themselves.
        DataPath::Transparent
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        match *op {
            Op::Lookup { .. } | Op::Link { .. } | Op::MkNod { .. } | Op::MkDir { .. } | Op::SymLink { .. } => self.entry_op(cx, op),
            Op::ReadDir { plus: true, .. } => {
                let mut reply = self.below().call(cx, op)?;
                if let Reply::Dir(entries) = &mut reply {
                    self.fix_dir_entries(entries)?;
                }
                Ok(reply)
            }
            Op::Forget { node, nlookup } => self.forget(cx, node, nlookup),
            Op::Create { parent, name, mode, flags } => self.create(cx, parent, name, mode, flags),
            Op::Open { node, .. } => {
                let _switch = self.switch.read();
                let chain = self.chain_of(node)?;
                let reply = chain.top.call(cx, op)?;
                self.note_open(node, &chain);
                Ok(reply)
            }
            Op::Release { node, .. } => {
                let chain = self.chain_of_open(node);
                let result = chain.top.call(cx, op);
                self.count_open(node, -1);
                result
            }
            Op::GetAttr { node, .. } => match self.chain_of(node) {
                Ok(chain) => chain.top.call(cx, op),
                // Unreadable chain: the lower attributes, so that `ls -l` works; opening fails.
                Err(Error::Corrupt(_)) => self.below().call(cx, op),
                Err(e) => Err(e),
            },
            Op::SetAttr { node, .. } => self.chain_of(node)?.top.call(cx, op),
            // Open handles keep the chain they were opened through.
            Op::Read { node, .. }
            | Op::Write { node, .. }
            | Op::Flush { node, .. }
            | Op::Fsync { node, .. }
            | Op::Fallocate { node, .. }
            | Op::Lseek { node, .. }
            | Op::Ioctl { node, .. } => self.chain_of_open(node).top.call(cx, op),
            Op::GetXattr { name, .. } if hidden(name) => Err(Error::Os(libc::ENODATA)),
            Op::SetXattr { name, .. } | Op::RemoveXattr { name, .. } if hidden(name) => Err(Error::Os(libc::EPERM)),
            Op::SetXattr { node, name, value, .. } if name == POLICY_XATTR => self.set_policy_attr(cx, op, node, value),
            Op::RemoveXattr { node, name } if name == POLICY_XATTR => {
                let reply = self.below().call(cx, op)?;
                if !matches!(self.nodes.read().get(&node), Some(Known::File(_))) {
                    self.generation.fetch_add(1, Ordering::AcqRel);
                }
                Ok(reply)
            }
            Op::ListXattr { node, size } => self.list_xattr(cx, node, size),
            Op::Rename { parent, name, .. } => {
                let moves_dir = self.is_dir(cx, parent, name);
                let reply = self.below().call(cx, op)?;
                if moves_dir {
                    self.generation.fetch_add(1, Ordering::AcqRel);
                }
                Ok(reply)
            }
            Op::RmDir { .. } => {
                let reply = self.below().call(cx, op)?;
                self.generation.fetch_add(1, Ordering::AcqRel);
                Ok(reply)
            }
            Op::Extended { node, name: "policy-explain", .. } => self.explain(node).map(Reply::Extended),
            Op::Extended { node, name: "policy-apply", .. } => self.apply(node).map(Reply::Extended),
            Op::Extended { node, name: "policy-plain", args } => self.count_plain(node, args).map(Reply::Extended),
            Op::Extended { node, .. } => self.chain_of(node)?.top.call(cx, op),
            _ => bypass(self, cx, op),
        }
    }

    fn shutdown(&self) {
        let chains: Vec<ChainRef> = self.chains.lock().values().cloned().collect();
        for c in chains {
            c.shutdown();
        }
    }
}

impl PolicyLayer {
    /// The chain serving an open handle: known, since the open went through it.
    fn chain_of_open(&self, node: NodeId) -> ChainRef {
        match self.nodes.read().get(&node) {
            Some(Known::File(FileState { chain: Some(c), .. })) => c.clone(),
            _ => self.none.clone(),
        }
    }
}

/// The spec of a mount split in two: the mount-wide layers (top first) and the default chain,
/// which starts at the topmost layer that transforms data.
pub fn split_stack(specs: &[LayerSpec], registry: &[LayerFactory], lower: &Level) -> Result<(Vec<LayerSpec>, Policy)> {
    // Build each layer alone to learn its data path: cheap, and it checks the parameters too.
    for (i, spec) in specs.iter().enumerate() {
        let probe = Stack::build(std::slice::from_ref(spec), registry, lower.layer().clone())?;
        if probe.top().layer().data_path() == DataPath::Transforms {
            return Ok((specs[..i].to_vec(), Policy::of(specs[i..].to_vec())));
        }
    }
    Ok((specs.to_vec(), Policy::none()))
}

/// Build a mount's stack: the mount-wide layers of `specs` over a policy layer over `lower`,
/// with the data layers of `specs` as the default chain.
///
/// The levels are, top first: the mount-wide layers, `policy`, the default chain's layers, and
/// the lower directory. Every operation passes the first two groups; the default chain's layers
/// are listed so that they keep their names (`.plyfs/zstd` shows the lower files, `op
/// verify@zstd` reaches the layer), though only the files recorded with that chain use them.
pub fn build_stack(specs: &[LayerSpec], rules: Option<Rules>, registry: &'static [LayerFactory], lower: Level) -> Result<(Stack, Arc<PolicyLayer>)> {
    let (mount_wide, default) = split_stack(specs, registry, &lower)?;
    let policy = PolicyLayer::new("policy", &default, rules.unwrap_or_default(), registry, lower.clone())?;
    let mut below = vec![Level::new(policy.clone())];
    below.extend(policy.default_chain().levels().iter().cloned());
    // `lower` may itself be a layer over the lower directory (a crypt volume's names): list
    // every level down to the bottom, so each has its view under `.plyfs`.
    let mut level = lower;
    loop {
        below.push(level.clone());
        match level.layer().lower() {
            [next] => level = next.clone(),
            _ => break,
        }
    }
    let stack = Stack::build_over(&mount_wide, registry, below)?.with_shared(mount_wide.len() + 1);
    Ok((stack, policy))
}

/// Check a rules file's policies against the registry, for `Rules::load`.
pub fn rule_checker<'a>(registry: &'static [LayerFactory], lower: &'a Level) -> impl Fn(&Policy) -> Result<()> + 'a {
    move |p| Chain::build(p, registry, lower).map(|_| ())
}
