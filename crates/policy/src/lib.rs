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
mod decide;
mod extended;
mod nodes;
mod ops;
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
    bypass, Caller, DataPath, Entry, Error, ExtOpInfo, FileHandle, FileKind, Layer, LayerFactory, Level, NodeId, Op,
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
    /// Held by each `policy-apply`: two runs (one whose command died while the daemon finished
    /// its file, and the next) never re-encode the same file at once.
    applying: Mutex<()>,
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
            applying: Mutex::new(()),
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
            Op::Lookup { name, .. } if self.own_temp(name) => Err(Error::Os(libc::ENOENT)),
            Op::Lookup { .. } | Op::Link { .. } | Op::MkNod { .. } | Op::MkDir { .. } | Op::SymLink { .. } => self.entry_op(cx, op),
            Op::ReadDir { .. } => self.read_dir(cx, op),
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
