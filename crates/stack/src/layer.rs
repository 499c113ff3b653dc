//! The symmetric layer interface.
//!
//! Every layer sees the same [`Op`]s above and below it. A layer implements [`Layer::call`] for
//! the operations it cares about and hands everything else to [`bypass`], which forwards the
//! operation unchanged to the layer below — the default routine of Heidemann & Popek (`seeds/000`
//! §3.3). An operation a layer has never heard of, including an extended operation defined by
//! some lower layer, therefore still reaches the layer that understands it.

use std::ffi::OsStr;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::op::{Op, Reply};
use crate::types::*;

/// What a layer does to file data, which decides whether the kernel may bypass it for reads and
/// writes (FUSE passthrough).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataPath {
    /// File bytes are the lower file's bytes and the layer need not see them move.
    Transparent,
    /// File bytes are unchanged, but the layer wants to see every read and write.
    Observes,
    /// The layer changes file bytes (or their size); the lower file cannot be handed out.
    Transforms,
}

impl std::fmt::Display for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataPath::Transparent => "transparent",
            DataPath::Observes => "observes",
            DataPath::Transforms => "transforms",
        })
    }
}

/// An extended operation a layer defines, for `plyfs layers` and `plyfs op PATH --list`.
#[derive(Clone, Copy, Debug)]
pub struct ExtOpInfo {
    pub name: &'static str,
    pub args: &'static str,
    pub help: &'static str,
}

/// How much of a lower file [`Layer::file_test`] is given.
pub const FILE_HEAD_BYTES: usize = 512;

pub trait Layer: Send + Sync + 'static {
    /// The layer's instance name, unique within its stack (`trace`, `null`, `null#2`, or the
    /// name the user gave with `name=`).
    fn name(&self) -> &str;

    /// The layer's type (`trace`, `null`, ...).
    fn kind(&self) -> &'static str;

    fn data_path(&self) -> DataPath {
        DataPath::Transparent
    }

    /// The level directly below a linear layer; none for a bottom layer or a fan-out layer,
    /// whose branches (which may change at run time) [`Layer::branches`] lists.
    fn lower(&self) -> &[Level];

    /// The branches of a fan-out layer, top priority first, as they are now.
    fn branches(&self) -> Vec<crate::Branch> {
        Vec::new()
    }

    /// Handle one operation. The default bypasses every operation to the layer below.
    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        bypass(self, cx, op)
    }

    /// The extended operations this layer answers.
    fn extended_ops(&self) -> &[ExtOpInfo] {
        &[]
    }

    /// For a layer that transforms data and can tell the lower files it wrote from others: the
    /// test, given a lower file's first [`FILE_HEAD_BYTES`] bytes (all of a shorter one). A
    /// non-empty file that fails it is not the layer's (a plain file that was there before the
    /// layer), and the policy layer serves it as it is. `None`: every lower file is the layer's.
    fn file_test(&self) -> Option<fn(&[u8]) -> bool> {
        None
    }

    /// Whether the layer keeps file data that has not reached the lower file yet (a write
    /// cache such as `lazy`): then an empty lower file is not necessarily an empty file.
    fn holds_data(&self) -> bool {
        false
    }

    /// Called once, from the top down, when the stack is taken down: flush what is buffered.
    fn shutdown(&self) {}

    /// What a user must know about this layer's settings when it is mounted (limits taken by
    /// default), for the mount's message; the layer is built more than once while a stack is
    /// assembled, so it cannot say it itself.
    fn mount_note(&self) -> Option<String> {
        None
    }

    /// Hand the front end's cache invalidation down to the layers that learn of changes made
    /// outside the stack (a `remote` layer, told by its server). A layer that passes node ids
    /// and names through unchanged (the default) hands it on; one that remaps them must
    /// translate, or keep it from the layers below (their ids mean nothing above it).
    fn set_invalidator(&self, inv: Arc<dyn Invalidator>) {
        if let [below] = self.lower() {
            below.layer().set_invalidator(inv);
        }
    }
}

/// The largest read [`Level::read_small_file`] makes: well below what a transport carries in
/// one message (plyfs-transport's `MAX_IO`, 8 MiB).
const SMALL_FILE_PIECE_BYTES: u32 = 1 << 20;

/// Drops what the front end caches (the kernel's attributes, names and pages) for objects that
/// changed behind the stack's back. Called from a thread that serves no request, never while a
/// request of the same mount waits on the caller.
pub trait Invalidator: Send + Sync {
    /// The object's attributes and data changed.
    fn node(&self, node: NodeId);
    /// The name in directory `parent` now means something else, or nothing.
    fn entry(&self, parent: NodeId, name: &OsStr);
}

/// Forward `op` unchanged to the single layer below. A bottom layer has nothing to forward to:
/// extended operations end there as "unsupported", anything else as `ENOSYS`.
pub fn bypass<L: Layer + ?Sized>(layer: &L, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
    match layer.lower() {
        [below] => below.call(cx, op),
        // A bottom layer ends the stack; a fan-out layer routes every operation itself.
        [] => Err(unsupported(op)),
        _ => Err(Error::Os(libc::ENOSYS)),
    }
}

/// The error for an operation that reached the bottom of the stack unanswered.
pub fn unsupported(op: &Op<'_>) -> Error {
    match op {
        Op::Extended { name, .. } => Error::UnsupportedOp { op: (*name).to_owned(), layers: vec![], handled_below: vec![] },
        _ => Error::Os(libc::ENOSYS),
    }
}

/// A layer as seen from the layer above it: the entry point for every operation on it.
///
/// Calling through a `Level` rather than the layer directly is what keeps the passthrough fast
/// path honest: a lower file handed up by `open` or `create` is dropped on its way through a
/// layer that transforms or observes data.
#[derive(Clone)]
pub struct Level {
    layer: Arc<dyn Layer>,
    shares_lower_bytes: bool,
    /// This handle refuses every change with `EROFS` (the view of a branch mounted `=ro`).
    read_only: bool,
}

impl Level {
    pub fn new(layer: Arc<dyn Layer>) -> Level {
        let shares_lower_bytes = layer.data_path() == DataPath::Transparent;
        Level { layer, shares_lower_bytes, read_only: false }
    }

    /// The same level, through a handle that refuses every change with `EROFS`
    /// ([`crate::readonly::changes_storage`]): what a fan-in view of a read-only branch calls,
    /// so that the branch's `ro` holds on every path, not only through the fan-out layer.
    pub fn read_only(&self) -> Level {
        Level { read_only: true, ..self.clone() }
    }

    /// Whether this handle refuses changes (see [`Level::read_only`]).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    pub fn layer(&self) -> &Arc<dyn Layer> {
        &self.layer
    }

    pub fn name(&self) -> &str {
        self.layer.name()
    }

    /// Whether both are the same level (the same layer instance).
    pub fn same(&self, other: &Level) -> bool {
        Arc::ptr_eq(&self.layer, &other.layer)
    }

    /// Operations travel by reference, as in the paper's argument blocks: a layer boundary
    /// costs a call, not a copy of the arguments.
    #[inline]
    pub fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        if self.read_only && crate::readonly::changes_storage(op) {
            return Err(crate::Error::Os(libc::EROFS));
        }
        if self.shares_lower_bytes {
            return self.layer.call(cx, op);
        }
        let mut reply = self.layer.call(cx, op)?;
        if let Reply::Opened(o) | Reply::Created(_, o) = &mut reply {
            o.backing = None;
        }
        Ok(reply)
    }

    // Typed helpers: build the operation, unwrap the reply.

    pub fn lookup(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Result<Entry> {
        match self.call(cx, &Op::Lookup { parent, name })? {
            Reply::Entry(e) => Ok(e),
            other => Err(mismatch("lookup", &other)),
        }
    }

    pub fn forget(&self, cx: &Caller, node: NodeId, nlookup: u64) {
        // Forget has no reply and cannot fail in a way the caller could act on.
        let _ = self.call(cx, &Op::Forget { node, nlookup });
    }

    pub fn getattr(&self, cx: &Caller, node: NodeId) -> Result<Attr> {
        match self.call(cx, &Op::GetAttr { node, fh: None })? {
            Reply::Attr(a) => Ok(a),
            other => Err(mismatch("getattr", &other)),
        }
    }

    pub fn open(&self, cx: &Caller, node: NodeId, flags: i32) -> Result<Opened> {
        match self.call(cx, &Op::Open { node, flags })? {
            Reply::Opened(o) => Ok(o),
            other => Err(mismatch("open", &other)),
        }
    }

    pub fn create(
        &self,
        cx: &Caller,
        parent: NodeId,
        name: &OsStr,
        mode: u32,
        flags: i32,
    ) -> Result<(Entry, Opened)> {
        match self.call(cx, &Op::Create { parent, name, mode, flags })? {
            Reply::Created(e, o) => Ok((e, o)),
            other => Err(mismatch("create", &other)),
        }
    }

    pub fn read(&self, cx: &Caller, node: NodeId, fh: FileHandle, offset: u64, size: u32) -> Result<Vec<u8>> {
        match self.call(cx, &Op::Read { node, fh, offset, size })? {
            Reply::Data(d) => Ok(d),
            other => Err(mismatch("read", &other)),
        }
    }

    pub fn write(&self, cx: &Caller, node: NodeId, fh: FileHandle, offset: u64, data: &[u8]) -> Result<u32> {
        match self.call(cx, &Op::Write { node, fh, offset, data })? {
            Reply::Written(n) => Ok(n),
            other => Err(mismatch("write", &other)),
        }
    }

    pub fn release(&self, cx: &Caller, node: NodeId, fh: FileHandle) -> Result<()> {
        self.call(cx, &Op::Release { node, fh }).map(|_| ())
    }

    /// `op`, an [`Op::Ioctl`], sent to object `node` (a file or a directory of `kind`) through a
    /// handle opened for it and let go again: for a layer that holds no handle of its own there
    /// (a directory, or a file copied up since it was opened).
    pub fn ioctl_opened(&self, cx: &Caller, op: &Op<'_>, node: NodeId, kind: FileKind) -> Result<Reply> {
        if kind == FileKind::Dir {
            let fh = match self.call(cx, &Op::OpenDir { node })? {
                Reply::Opened(o) => o.fh,
                other => return Err(mismatch("opendir", &other)),
            };
            let reply = self.call(cx, &op.on_open(node, fh));
            let _ = self.call(cx, &Op::ReleaseDir { node, fh });
            return reply;
        }
        let opened = self.open(cx, node, libc::O_RDONLY | libc::O_NONBLOCK)?;
        let reply = self.call(cx, &op.on_open(node, opened.fh));
        let _ = self.release(cx, node, opened.fh);
        reply
    }

    /// The first `max` bytes of the file `name` in `dir`, looked up, opened, read and let go
    /// again: for small files a layer keeps for itself (a configuration, a companion, a
    /// mirror's log). Read in pieces of 1 MiB at most, which a transport carries (a `remote`
    /// bottom refuses reads over 8 MiB), until a piece comes back short.
    pub fn read_small_file(&self, cx: &Caller, dir: NodeId, name: &OsStr, max: u32) -> Result<Vec<u8>> {
        let entry = self.lookup(cx, dir, name)?;
        let data = self.open(cx, entry.node, libc::O_RDONLY).and_then(|opened| {
            let mut data = Vec::new();
            let read = loop {
                let want = (max - data.len() as u32).min(SMALL_FILE_PIECE_BYTES);
                match self.read(cx, entry.node, opened.fh, data.len() as u64, want) {
                    Ok(piece) => {
                        let short = (piece.len() as u32) < want;
                        data.extend_from_slice(&piece);
                        if short || data.len() as u32 == max {
                            break Ok(());
                        }
                    }
                    Err(e) => break Err(e),
                }
            };
            let _ = self.release(cx, entry.node, opened.fh);
            read.map(|()| data)
        });
        self.forget(cx, entry.node, 1);
        data
    }

    pub fn mkdir(&self, cx: &Caller, parent: NodeId, name: &OsStr, mode: u32) -> Result<Entry> {
        match self.call(cx, &Op::MkDir { parent, name, mode })? {
            Reply::Entry(e) => Ok(e),
            other => Err(mismatch("mkdir", &other)),
        }
    }

    pub fn unlink(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> Result<()> {
        self.call(cx, &Op::Unlink { parent, name }).map(|_| ())
    }

    /// Read a whole directory (without `.` and `..`), opening and releasing it.
    pub fn list_dir(&self, cx: &Caller, node: NodeId) -> Result<Vec<DirEntry>> {
        let fh = match self.call(cx, &Op::OpenDir { node })? {
            Reply::Opened(o) => o.fh,
            other => return Err(mismatch("opendir", &other)),
        };
        let mut all = Vec::new();
        let mut offset = 0;
        let result = loop {
            match self.call(cx, &Op::ReadDir { node, fh, offset, max_entries: 1024, plus: false }) {
                Ok(Reply::Dir(batch)) if batch.is_empty() => break Ok(()),
                Ok(Reply::Dir(batch)) => {
                    offset = batch.last().map_or(offset, |e| e.next_offset);
                    all.extend(batch.into_iter().filter(|e| e.name != "." && e.name != ".."));
                }
                Ok(other) => break Err(mismatch("readdir", &other)),
                Err(e) => break Err(e),
            }
        };
        let _ = self.call(cx, &Op::ReleaseDir { node, fh });
        result.map(|()| all)
    }

    pub fn extended(&self, cx: &Caller, node: NodeId, name: &str, args: &[String]) -> Result<serde_json::Value> {
        match self.call(cx, &Op::Extended { node, name, args })? {
            Reply::Extended(v) => Ok(v),
            other => Err(mismatch(name, &other)),
        }
    }
}

fn mismatch(op: &str, reply: &Reply) -> Error {
    tracing::error!("{op}: a layer replied with the wrong kind of reply: {reply:?}");
    Error::Os(libc::EIO)
}
