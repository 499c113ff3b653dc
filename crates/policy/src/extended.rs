//! The layer's extended operations: `policy-explain`, `policy-apply` (re-encoding a file into
//! its policy's chain) and the count of plain files.

use super::*;

impl PolicyLayer {
    pub(crate) fn explain(&self, node: NodeId) -> Result<Value> {
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
    pub(crate) fn count_plain(&self, dir: NodeId, args: &[String]) -> Result<Value> {
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
    pub(crate) fn count_plain_in(&self, dir: NodeId, walk: &mut PlainCount) -> Result<()> {
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

    pub(crate) fn rule_or_default_for_dir(&self) -> Decided {
        Decided { chain: self.default.clone(), source: Source::Default }
    }

    /// Re-encode a file to its policy; remove a leftover of an interrupted re-encoding.
    pub(crate) fn apply(&self, node: NodeId) -> Result<Value> {
        let _one_at_a_time = self.applying.lock();
        // Replaced by another run's re-encoding (or removed) after this run looked its name up:
        // whatever now has the name is another file.
        let superseded = matches!(self.nodes.read().get(&node), Some(Known::File(FileState { superseded: true, .. })));
        if superseded || self.below().getattr(&daemon(), node)?.nlink == 0 {
            return Ok(json!({ "changed": false, "gone": true }));
        }
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

    pub(crate) fn remove_leftover(&self, node: NodeId) -> Result<Value> {
        let (held, name, path) = self.parent_and_name(node)?;
        self.below().unlink(&daemon(), held.last(), &name)?;
        tracing::info!("{path}: removed the leftover of an interrupted re-encoding");
        Ok(json!({ "path": path, "changed": true, "removed_leftover": true }))
    }

    pub(crate) fn reencode(&self, node: NodeId, from: &ChainRef, to: &ChainRef, parent: NodeId, name: &OsStr, path: &str) -> Result<u64> {
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

    pub(crate) fn is_open(&self, node: NodeId) -> bool {
        matches!(self.nodes.read().get(&node), Some(Known::File(f)) if f.opens > 0)
    }

    pub(crate) fn copy_data(&self, node: NodeId, from: &ChainRef, tmp: NodeId, fh: FileHandle, to: &ChainRef) -> Result<u64> {
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
    pub(crate) fn copy_xattrs(&self, from: NodeId, to: NodeId) -> Result<()> {
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
