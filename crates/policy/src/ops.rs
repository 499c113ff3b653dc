//! The operations: each regular file's go to its chain, the rest to the lower directory.

use super::*;

impl PolicyLayer {
    /// An operation that answers with an entry (lookup, link, mknod, mkdir, symlink): note the
    /// node, and show a file as its chain does.
    pub(crate) fn entry_op(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let mut e = match self.below().call(cx, op)? {
            Reply::Entry(e) => e,
            other => return Ok(other),
        };
        self.note_entry(&e);
        self.fix_entry(&mut e)?;
        Ok(Reply::Entry(e))
    }

    /// Report what the file's chain shows (the decoded size) instead of the lower attributes.
    pub(crate) fn fix_entry(&self, e: &mut Entry) -> Result<()> {
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

    pub(crate) fn create(&self, cx: &Caller, parent: NodeId, name: &OsStr, mode: u32, flags: i32) -> Result<Reply> {
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
    pub(crate) fn create_existing(&self, cx: &Caller, parent: NodeId, name: &OsStr, mode: u32, flags: i32) -> Option<Result<Reply>> {
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
    pub(crate) fn move_into_place(&self, cx: &Caller, node: NodeId, parent: NodeId, tmp: &OsStr, name: &OsStr) -> Result<()> {
        self.no_replace.rename(self.below(), cx, (parent, tmp), (parent, name), node, FileKind::File)
    }

    /// `create` on a shared lower of a file that needs a record: made under a temporary name,
    /// recorded, then renamed into place, so that another mount never finds the file without
    /// its record (it would take it for a plain file). If another mount made the name first, its
    /// file is opened instead (or `EEXIST` under `O_EXCL`).
    pub(crate) fn create_recorded(&self, cx: &Caller, parent: NodeId, name: &OsStr, mode: u32, flags: i32, chain: &ChainRef) -> Result<Reply> {
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

    pub(crate) fn finish_create(&self, reply: Result<Reply>, chain: &ChainRef, new: bool, parent: NodeId, name: &OsStr) -> Result<Reply> {
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
    pub(crate) fn note_open(&self, node: NodeId, chain: &ChainRef) {
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

    pub(crate) fn count_open(&self, node: NodeId, delta: i32) {
        if let Some(Known::File(f)) = self.nodes.write().get_mut(&node) {
            f.opens = f.opens.saturating_add_signed(delta);
        }
    }

    pub(crate) fn set_policy_attr(&self, cx: &Caller, op: &Op<'_>, node: NodeId, value: &[u8]) -> Result<Reply> {
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
    pub(crate) fn list_xattr(&self, cx: &Caller, node: NodeId, size: u32) -> Result<Reply> {
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

    /// A name this process is making a file under (a re-encoding, or a recorded create on a
    /// shared lower): nobody sees it until it is renamed into place. A leftover of another
    /// process (a killed daemon, another mount) stays visible, for `policy apply` to remove.
    pub(crate) fn own_temp(&self, name: &OsStr) -> bool {
        name.as_bytes().starts_with(self.temp_stem.as_bytes())
    }

    /// `readdir`: the lower directory's entries less this process's temporary names, each file
    /// shown as its chain does. A batch made only of hidden names is skipped, since an empty
    /// answer would end the listing.
    pub(crate) fn read_dir(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let Op::ReadDir { node, fh, mut offset, max_entries, plus } = *op else { unreachable!("called for readdir") };
        loop {
            let op = Op::ReadDir { node, fh, offset, max_entries, plus };
            let mut entries = match self.below().call(cx, &op)? {
                Reply::Dir(entries) => entries,
                other => return Ok(other),
            };
            let Some(last) = entries.last().map(|d| d.next_offset) else { return Ok(Reply::Dir(entries)) };
            entries.retain(|d| {
                if !self.own_temp(&d.name) {
                    return true;
                }
                // A readdirplus entry counts as a lookup: give it back.
                if let Some(e) = &d.entry {
                    self.below().forget(&daemon(), e.node, 1);
                }
                false
            });
            if entries.is_empty() {
                offset = last;
                continue;
            }
            for e in entries.iter_mut().filter_map(|d| d.entry.as_mut()) {
                self.note_entry(e);
                self.fix_entry(e)?;
            }
            return Ok(Reply::Dir(entries));
        }
    }

    pub(crate) fn forget(&self, cx: &Caller, node: NodeId, nlookup: u64) -> Result<Reply> {
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

    pub(crate) fn is_dir(&self, cx: &Caller, parent: NodeId, name: &OsStr) -> bool {
        match self.below().lookup(cx, parent, name) {
            Ok(e) => {
                self.below().forget(cx, e.node, 1);
                e.attr.kind == FileKind::Dir
            }
            Err(_) => false,
        }
    }
}
