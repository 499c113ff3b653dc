//! Proxies (thesis §2.2.3, unbuilt there): part of an object under new capabilities, kept in
//! memory only.

use crate::object::{Cap, Caps};

use super::{err, extent_data, Access, Core, Proxy, Result, Target};

impl Core {
    /// PROXY: all of `target`, or its sectors `range` (absolute sector numbers, inside what it
    /// covers), under `caps`, with at most the access `cap` gives on it. A proxy of a proxy is
    /// no wider than that proxy, in sectors or in rights.
    pub fn make_proxy(&mut self, target: &Target, cap: Cap, range: Option<(u64, u64)>, caps: Caps) -> Result<u64> {
        if caps.read == 0 {
            return err(libc::EINVAL, "a proxy needs a read capability");
        }
        let access = match self.access_of(target, cap) {
            Some(a) => a,
            None => return err(libc::EACCES, "a proxy needs the read or write capability of what it grants"),
        };
        let (original, sectors) = match target {
            Target::Proxy(id) => {
                let parent = self.proxy(*id, cap, Access::Read)?;
                if parent.entries.is_some() {
                    return err(libc::EACCES, format!("proxy {id} grants entries: it can be narrowed only to fewer entries"));
                }
                let sectors = match (parent.sectors, range) {
                    (Some(p), None) => Some(p),
                    (Some((lo, hi)), Some((a, b))) if lo <= a && a < b && b <= hi => Some((a, b)),
                    (Some((lo, hi)), Some((a, b))) => {
                        return err(libc::EACCES, format!("range {a}..{b}: wider than proxy {id}'s {lo}..{hi}"))
                    }
                    (None, r) => {
                        if let Some((a, b)) = r {
                            let real = self.real_caps(&parent.target)?;
                            if a >= b || !self.covered(&parent.target, real.read, a, b)? {
                                return err(libc::EINVAL, format!("range {a}..{b}: not covered by proxy {id}"));
                            }
                        }
                        r
                    }
                };
                (parent.target, sectors)
            }
            Target::Extent(at) => {
                let h = self.extent(*at, cap, Access::Read)?;
                let (lo, hi) = extent_data(*at, &h);
                let (a, b) = range.unwrap_or((lo, hi));
                if a >= b || a < lo || b > hi {
                    return err(libc::EINVAL, format!("range {a}..{b}: not inside the extent's data {lo}..{hi}"));
                }
                (target.clone(), Some((a, b)))
            }
            _ => {
                if let Some((a, b)) = range {
                    if a >= b || !self.covered(target, cap, a, b)? {
                        return err(libc::EINVAL, format!("range {a}..{b}: not covered by the exonode"));
                    }
                }
                (target.clone(), range)
            }
        };
        let id = self.next_proxy;
        self.next_proxy += 1;
        let access = if caps.write == 0 { Access::Read } else { access };
        self.proxies.insert(id, Proxy { target: original, caps, access, sectors, entries: None });
        Ok(id)
    }

    /// PROXY of some entries of an exonode (or of an entries proxy, narrowed to fewer), under
    /// `caps`, with at most the access `cap` gives.
    pub fn make_entries_proxy(&mut self, target: &Target, cap: Cap, entries: Vec<u32>, caps: Caps) -> Result<u64> {
        if caps.read == 0 {
            return err(libc::EINVAL, "a proxy needs a read capability");
        }
        if entries.is_empty() {
            return err(libc::EINVAL, "a proxy of no entries");
        }
        let access = match self.access_of(target, cap) {
            Some(a) => a,
            None => return err(libc::EACCES, "a proxy needs the read or write capability of what it grants"),
        };
        let original = match target {
            Target::Proxy(id) => {
                let parent = self.proxy(*id, cap, Access::Read)?;
                match &parent.entries {
                    Some(have) if entries.iter().all(|e| have.contains(e)) => parent.target,
                    Some(have) => return err(libc::EACCES, format!("entries {entries:?}: wider than proxy {id}'s {have:?}")),
                    None => return err(libc::EACCES, format!("proxy {id} does not grant entries")),
                }
            }
            Target::Extent(at) => return err(libc::EINVAL, format!("sector {at}: an extent has no entries")),
            _ => {
                let at = self.exonode_at(target, cap, Access::Read)?;
                let n = self.exonode(at).entries.len() as u32;
                if let Some(e) = entries.iter().find(|e| **e >= n) {
                    return err(libc::EINVAL, format!("entry {e}: the exonode has {n} entries"));
                }
                target.clone()
            }
        };
        let id = self.next_proxy;
        self.next_proxy += 1;
        let access = if caps.write == 0 { Access::Read } else { access };
        self.proxies.insert(id, Proxy { target: original, caps, access, sectors: None, entries: Some(entries) });
        Ok(id)
    }

    /// The original exonode behind an entries proxy, and the entries it grants.
    pub(super) fn entries_proxy(&mut self, target: &Target, cap: Cap, want: Access) -> Result<Option<(u64, Vec<u32>)>> {
        let Target::Proxy(id) = target else { return Ok(None) };
        let p = self.proxy(*id, cap, want)?;
        let Some(entries) = p.entries else { return Ok(None) };
        let real = self.real_caps(&p.target)?;
        let at = self.exonode_at(&p.target, if want == Access::Write { real.write } else { real.read }, want)?;
        Ok(Some((at, entries)))
    }

    /// Remove a proxy (its maker's job; proxies also die with the service).
    pub fn remove_proxy(&mut self, id: u64, cap: Cap) -> Result<()> {
        self.proxy(id, cap, Access::Read)?;
        self.proxies.remove(&id);
        Ok(())
    }

    /// What `cap` allows on `target`, if anything.
    pub(super) fn access_of(&mut self, target: &Target, cap: Cap) -> Option<Access> {
        for want in [Access::Write, Access::Read] {
            let ok = match target {
                Target::Extent(at) => self.extent(*at, cap, want).is_ok(),
                Target::Proxy(id) => self.proxy(*id, cap, want).is_ok(),
                _ => self.exonode_at(target, cap, want).is_ok(),
            };
            if ok {
                return Some(want);
            }
        }
        None
    }
}
