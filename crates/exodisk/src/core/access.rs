//! Access checks: the capability presented against an object's, and the path from an exonode
//! through its descendants to the one an operation names.

use crate::object::{Cap, Caps, Entry, Exonode};

use super::{err, Access, Core, ExoError, Obj, Persistence, Proxy, Result, Target};

impl Core {
    pub(super) fn check_cap(caps: &Caps, cap: Cap, want: Access, what: &str) -> Result<()> {
        let ok = cap != 0
            && match want {
                Access::Read => cap == caps.read || cap == caps.write,
                Access::Write => cap == caps.write,
            };
        if ok {
            return Ok(());
        }
        err(libc::EACCES, format!("{what}: wrong {} capability", if want == Access::Read { "read" } else { "write" }))
    }

    /// The exonode `target` names, after checking `cap` for `want` at its first exonode: its
    /// sector. Access to an ancestor reaches its descendants.
    pub(super) fn exonode_at(&mut self, target: &Target, cap: Cap, want: Access) -> Result<u64> {
        let (mut at, path) = match target {
            Target::Exonode { at, path } => (*at, path.clone()),
            Target::Extent(at) => return err(libc::EINVAL, format!("sector {at}: an extent, not an exonode")),
            Target::Proxy(id) => {
                let p = self.proxy(*id, cap, want)?;
                if p.sectors.is_some() {
                    return err(libc::EACCES, format!("proxy {id} grants sectors, not the exonode's entries"));
                }
                if let Some(e) = &p.entries {
                    return err(libc::EACCES, format!("proxy {id} grants entries {e:?} only: I/O on them, MAP and READ_DATA"));
                }
                // The proxy's capability was checked: reach the original with its own.
                let real = self.real_caps(&p.target)?;
                let cap = if want == Access::Write { real.write } else { real.read };
                return self.exonode_at(&p.target, cap, want);
            }
        };
        self.load(at)?;
        let caps = match &self.cache[&at].obj {
            Obj::Exonode(x) => x.caps,
            Obj::Extent(_) => return err(libc::EINVAL, format!("sector {at}: an extent, not an exonode")),
        };
        Self::check_cap(&caps, cap, want, &format!("the exonode at {at}"))?;
        for (depth, idx) in path.iter().enumerate() {
            let next = match &self.cache[&at].obj {
                Obj::Exonode(x) => match x.entries.get(*idx as usize) {
                    Some(Entry::Descendant { at }) => *at,
                    _ => {
                        return err(
                            libc::ENOENT,
                            format!("the exonode at {at}: entry {idx} (step {depth} of the path) is not a descendant"),
                        )
                    }
                },
                Obj::Extent(_) => unreachable!("descendants are exonodes"),
            };
            self.load(next)?;
            at = next;
        }
        Ok(at)
    }

    pub(super) fn exonode(&self, at: u64) -> &Exonode {
        match &self.cache[&at].obj {
            Obj::Exonode(x) => x,
            Obj::Extent(_) => unreachable!("checked to be an exonode"),
        }
    }

    pub(super) fn exonode_mut(&mut self, at: u64) -> &mut Exonode {
        let c = self.cache.get_mut(&at).expect("cached");
        c.dirty = true;
        match &mut c.obj {
            Obj::Exonode(x) => x,
            Obj::Extent(_) => unreachable!("checked to be an exonode"),
        }
    }

    pub(super) fn persistence(&self, at: u64) -> Persistence {
        self.cache.get(&at).map_or(Persistence::Metadata, |c| c.persistence)
    }

    pub(super) fn proxy(&self, id: u64, cap: Cap, want: Access) -> Result<Proxy> {
        let p = self.proxies.get(&id).ok_or(ExoError { errno: libc::ENOENT, msg: format!("proxy {id}: no such proxy") })?;
        Self::check_cap(&p.caps, cap, want, &format!("proxy {id}"))?;
        if want == Access::Write && p.access == Access::Read {
            return err(libc::EACCES, format!("proxy {id}: read only"));
        }
        Ok(p.clone())
    }
}
