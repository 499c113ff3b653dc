//! Renames and hard links: the object moves (or gains a name) on the upper branch, copied up
//! first if it is below; a whiteout hides the old name where a lower branch still holds it. A
//! directory with contents below cannot move in one step: `EXDEV`, and `mv` copies it.

use std::ffi::OsStr;

use plyfs_stack::{Caller, Entry, Error, FileKind, NodeId, Op, Reply, Result};

use super::{daemon, enoent, is_temp, Found, Union, OPAQUE_XATTR};
use crate::ids::Place;

impl Union {
    pub(super) fn rename(&self, cx: &Caller, parent: NodeId, name: &OsStr, new_parent: NodeId, new_name: &OsStr, flags: u32) -> Result<Reply> {
        if flags & !(libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE | libc::RENAME_WHITEOUT) != 0 {
            return Err(Error::Os(libc::EINVAL));
        }
        if is_temp(new_name) {
            return Err(Error::Os(libc::EPERM));
        }
        if flags & libc::RENAME_EXCHANGE != 0 {
            return self.exchange(cx, parent, name, new_parent, new_name);
        }
        let from_dir = self.dir_places(parent)?;
        let to_dir = self.dir_places(new_parent)?;
        let src = self.find(cx, &from_dir, name)?.ok_or_else(enoent)?;
        let dst = match self.find(cx, &to_dir, new_name) {
            Ok(d) => d,
            Err(e) => {
                self.forget_places(&src.places);
                return Err(e);
            }
        };
        // The union keeps the source's places (and the lookups held on them) while it moves it.
        let src_entry = self.remember(parent, name, Found { places: src.places.clone(), entry: src.entry });
        let result =
            self.rename_found(cx, parent, name, &from_dir, new_parent, new_name, &to_dir, &src, src_entry.node, dst.as_ref(), flags);
        if result.is_ok() {
            if let Some(n) = self.nodes.lock().nodes.get_mut(&src_entry.node.0) {
                n.parent = Some((new_parent.0, new_name.to_owned()));
            }
        }
        self.forget(src_entry.node, 1);
        if let Some(d) = &dst {
            self.forget_places(&d.places);
        }
        result.map(|()| Reply::Empty)
    }

    /// `RENAME_EXCHANGE`: both objects on the upper branch (files are copied up), swapped there.
    /// A directory with contents below, or one that would land on a lower directory of the same
    /// name, cannot be swapped in one step: `EXDEV`.
    fn exchange(&self, cx: &Caller, parent: NodeId, name: &OsStr, new_parent: NodeId, new_name: &OsStr) -> Result<Reply> {
        let a = self.lookup(cx, parent, name)?;
        let b = match self.lookup(cx, new_parent, new_name) {
            Ok(b) => b,
            Err(e) => {
                self.forget(a.node, 1);
                return Err(e);
            }
        };
        let result = (|| {
            let upper = self.upper()?;
            let (from_dir, to_dir) = (self.dir_places(parent)?, self.dir_places(new_parent)?);
            for (e, lands_in, lands_as) in [(&a, &to_dir, new_name), (&b, &from_dir, name)] {
                if e.attr.kind != FileKind::Dir {
                    continue;
                }
                let places = self.node(e.node)?.1;
                if places.len() > 1 || places[0].branch != upper.number || self.exists_below(cx, lands_in, lands_as, upper.number)? {
                    return Err(Error::Os(libc::EXDEV));
                }
            }
            self.upper_place(a.node, false)?;
            self.upper_place(b.node, false)?;
            let (from, to) = (self.ensure_dir_on_upper(parent)?, self.ensure_dir_on_upper(new_parent)?);
            let op = Op::Rename { parent: from.node, name, new_parent: to.node, new_name, flags: libc::RENAME_EXCHANGE };
            upper.top().call(cx, &op)?;
            let mut table = self.nodes.lock();
            for (id, seen) in [(a.node, (new_parent.0, new_name)), (b.node, (parent.0, name))] {
                if let Some(n) = table.nodes.get_mut(&id.0) {
                    n.parent = Some((seen.0, seen.1.to_owned()));
                }
            }
            Ok(Reply::Empty)
        })();
        self.forget(a.node, 1);
        self.forget(b.node, 1);
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn rename_found(
        &self,
        cx: &Caller,
        parent: NodeId,
        name: &OsStr,
        from_dir: &[Place],
        new_parent: NodeId,
        new_name: &OsStr,
        to_dir: &[Place],
        src: &Found,
        src_id: NodeId,
        dst: Option<&Found>,
        flags: u32,
    ) -> Result<()> {
        let src_is_dir = src.entry.attr.kind == FileKind::Dir;
        if let Some(d) = dst {
            if flags & libc::RENAME_NOREPLACE != 0 {
                return Err(Error::Os(libc::EEXIST));
            }
            if d.places[0] == src.places[0] {
                return Ok(()); // the same object: nothing to do, as rename(2) says
            }
            match (src_is_dir, d.entry.attr.kind == FileKind::Dir) {
                (true, false) => return Err(Error::Os(libc::ENOTDIR)),
                (false, true) => return Err(Error::Os(libc::EISDIR)),
                (true, true) if !self.merged(cx, &d.places)?.is_empty() => return Err(Error::Os(libc::ENOTEMPTY)),
                _ => {}
            }
        }
        let upper = self.upper()?;
        if src_is_dir
            && (src.places.len() > 1 || src.places[0].branch != upper.number || self.exists_below(cx, from_dir, name, upper.number)?)
        {
            // Its contents (or a shadowed object) lie on a lower branch: let `mv` copy it.
            return Err(Error::Os(libc::EXDEV));
        }
        let place = self.upper_place(src_id, false)?;
        let from = self.ensure_dir_on_upper(parent)?;
        let to = self.ensure_dir_on_upper(new_parent)?;
        match dst {
            Some(d) if d.entry.attr.kind == FileKind::Dir && d.places[0].branch == upper.number => {
                self.clear_hidden(&upper, d.places[0].node)?;
            }
            None => {
                self.remove_whiteout(&upper, to.node, new_name)?;
            }
            _ => {}
        }
        // RENAME_WHITEOUT (overlayfs asks it of its upper file system, which this union may be)
        // leaves a character device 0/0 under the old name on the upper branch: an object of
        // the user's, not one of the union's whiteouts, and it hides what lies below as any
        // object there does.
        upper.top().call(cx, &Op::Rename { parent: from.node, name, new_parent: to.node, new_name, flags })?;
        if src_is_dir && self.exists_below(cx, to_dir, new_name, upper.number)? {
            self.set_flag(&upper, place.node, OPAQUE_XATTR, b"y")?;
        }
        if flags & libc::RENAME_WHITEOUT == 0 && self.exists_below(cx, from_dir, name, upper.number)? {
            self.whiteout(&upper, from.node, name)?;
        }
        Ok(())
    }

    pub(super) fn link(&self, cx: &Caller, node: NodeId, new_parent: NodeId, new_name: &OsStr) -> Result<Reply> {
        if is_temp(new_name) {
            return Err(Error::Os(libc::EPERM));
        }
        let upper = self.upper()?;
        let place = self.upper_place(node, false)?;
        let to = self.ensure_dir_on_upper(new_parent)?;
        self.remove_whiteout(&upper, to.node, new_name)?;
        let e = match upper.top().call(cx, &Op::Link { node: place.node, new_parent: to.node, new_name })? {
            Reply::Entry(e) => e,
            _ => return Err(Error::Os(libc::EIO)),
        };
        let mut table = self.nodes.lock();
        let n = table.nodes.get_mut(&node.0).ok_or(Error::Os(libc::ESTALE))?;
        n.lookups += 1;
        drop(table);
        // The union holds one lookup per place; the link's is extra.
        upper.top().forget(&daemon(), e.node, 1);
        Ok(Reply::Entry(Entry { node, ..e }))
    }
}
