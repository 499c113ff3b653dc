//! What the layer knows of the nodes the kernel holds: files with their chains, directories,
//! and the attributes that record them.

use super::*;

impl PolicyLayer {
    pub(crate) fn note_entry(&self, e: &Entry) {
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

    pub(crate) fn note_file(&self, node: NodeId, chain: ChainRef, provisional: bool) {
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
    pub(crate) fn chain_of(&self, node: NodeId) -> Result<ChainRef> {
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
    pub(crate) fn recorded_chain(&self, node: NodeId) -> Result<ChainRef> {
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
    pub(crate) fn unrecorded_chain(&self, node: NodeId) -> ChainRef {
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
    pub(crate) fn lower_head(&self, node: NodeId) -> Result<Vec<u8>> {
        let cx = daemon();
        let opened = self.below().open(&cx, node, libc::O_RDONLY)?;
        let head = self.below().read(&cx, node, opened.fh, 0, FILE_HEAD_BYTES as u32);
        let _ = self.below().release(&cx, node, opened.fh);
        head
    }

    /// Whether a regular file is plain: without a record, and not in the default chain's format.
    pub(crate) fn is_plain(&self, node: NodeId) -> Result<bool> {
        let may_have_record = self.shared || self.records.load(Ordering::Acquire);
        if may_have_record && self.read_xattr(node, CHAIN_XATTR)?.is_some() {
            return Ok(false);
        }
        Ok(Arc::ptr_eq(&self.unrecorded_chain(node), &self.none))
    }

    pub(crate) fn unreadable_record(&self, node: NodeId, text: &str, e: &Error) -> Error {
        let msg = format!("{}: its data is recorded as encoded with '{text}', which this build cannot read: {e}", self.describe(node));
        tracing::error!("{msg}");
        Error::Corrupt(msg)
    }

    pub(crate) fn describe_in(&self, parent: NodeId, name: &OsStr) -> String {
        match self.rel_path(parent) {
            Ok(p) if p.is_empty() => name.to_string_lossy().into_owned(),
            Ok(p) => format!("{p}/{}", name.to_string_lossy()),
            Err(_) => name.to_string_lossy().into_owned(),
        }
    }

    pub(crate) fn describe(&self, node: NodeId) -> String {
        self.rel_path(node).map_or_else(|_| format!("inode {}", node.0), |p| if p.is_empty() { "/".into() } else { p })
    }

    /// An attribute of the lower node as text, `None` when it is not set.
    pub(crate) fn read_xattr(&self, node: NodeId, name: &str) -> Result<Option<String>> {
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
    pub(crate) fn record(&self, node: NodeId, chain: &str) -> Result<()> {
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

    pub(crate) fn write_xattr(&self, node: NodeId, name: &str, value: &str) -> Result<()> {
        let op = Op::SetXattr { node, name: OsStr::new(name), value: value.as_bytes(), flags: 0 };
        self.below().call(&daemon(), &op).map(|_| ())
    }

    pub(crate) fn remove_xattr(&self, node: NodeId, name: &str) -> Result<()> {
        match self.below().call(&daemon(), &Op::RemoveXattr { node, name: OsStr::new(name) }) {
            Ok(_) | Err(Error::Os(libc::ENODATA)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The policy attribute of a node, `None` when it has none. A value that does not parse
    /// (written from outside the mount) is ignored with a warning.
    pub(crate) fn own_policy(&self, node: NodeId) -> Result<Option<ChainRef>> {
        let Some(text) = self.read_xattr(node, POLICY_XATTR)? else { return Ok(None) };
        match self.chain_named(&text) {
            Ok(chain) => Ok(Some(chain)),
            Err(e) => {
                tracing::warn!("{}: ignoring {POLICY_XATTR}={text:?}: {e}", self.describe(node));
                Ok(None)
            }
        }
    }
}
