//! Data I/O: reads and writes of extent data, checked against the capabilities and the
//! sectors the target covers.

use crate::disk::{Aligned, SECTOR};
use crate::object::{Cap, Caps, Entry};

use super::{err, extent_data, io_err, unsealed, Access, Core, ExoError, Obj, Persistence, Result, Target};

impl Core {
    /// Whether `a..b` lies in sectors `target` covers.
    pub(super) fn covered(&mut self, target: &Target, cap: Cap, a: u64, b: u64) -> Result<bool> {
        match target {
            Target::Extent(at) => {
                let h = self.extent(*at, cap, Access::Read)?;
                let (lo, hi) = extent_data(*at, &h);
                Ok(a >= lo && b <= hi)
            }
            _ => {
                let at = self.exonode_at(target, cap, Access::Read)?;
                Ok(self
                    .exonode(at)
                    .entries
                    .iter()
                    .any(|e| matches!(*e, Entry::Extent { start, sectors } if a >= start && b <= start + sectors)))
            }
        }
    }

    /// Check an IO of sectors `at..at + len` on `target` with `cap` for `want` (thesis `IO`).
    /// Returns the persistence model that governs it.
    pub fn check_io(&mut self, target: &Target, cap: Cap, want: Access, at: u64, len: u64) -> Result<Persistence> {
        let end = at.checked_add(len).ok_or(ExoError { errno: libc::EINVAL, msg: "sector range overflows".into() })?;
        if len == 0 {
            return err(libc::EINVAL, "an IO of no sectors");
        }
        match target {
            Target::Proxy(id) => {
                let p = self.proxy(*id, cap, want)?;
                if let Some((lo, hi)) = p.sectors {
                    if at < lo || end > hi {
                        return err(libc::EACCES, format!("sectors {at}..{end}: outside what proxy {id} grants ({lo}..{hi})"));
                    }
                }
                // Within the original as it is now (it may have shrunk), with its own rights.
                let real_cap = self.real_caps(&p.target)?;
                let cap = if want == Access::Write { real_cap.write } else { real_cap.read };
                if let Some(es) = &p.entries {
                    let xn = self.exonode_at(&p.target, cap, want)?;
                    let x = self.exonode(xn);
                    let inside = es.iter().any(|e| {
                        matches!(x.entries.get(*e as usize), Some(Entry::Extent { start, sectors }) if at >= *start && end <= start + sectors)
                    });
                    if !inside {
                        return err(libc::EACCES, format!("sectors {at}..{end}: not in the entries proxy {id} grants"));
                    }
                }
                self.check_io(&p.target, cap, want, at, len)
            }
            Target::Extent(x) => {
                let h = self.extent(*x, cap, want)?;
                let (lo, hi) = extent_data(*x, &h);
                if at < lo || end > hi {
                    return err(libc::EACCES, format!("sectors {at}..{end}: outside the extent's data {lo}..{hi}"));
                }
                Ok(self.persistence(*x))
            }
            _ => {
                let xn = self.exonode_at(target, cap, want)?;
                let inside = self
                    .exonode(xn)
                    .entries
                    .iter()
                    .any(|e| matches!(*e, Entry::Extent { start, sectors } if at >= start && end <= start + sectors));
                if !inside {
                    return err(libc::EACCES, format!("sectors {at}..{end}: not in an extent of the exonode at {xn}"));
                }
                Ok(self.persistence(xn))
            }
        }
    }

    pub(super) fn real_caps(&mut self, target: &Target) -> Result<Caps> {
        match target {
            Target::Extent(at) => {
                self.load(*at)?;
                match &self.cache[at].obj {
                    Obj::Extent(h) => Ok(h.caps),
                    _ => err(libc::EINVAL, "not an extent"),
                }
            }
            Target::Exonode { at, .. } => {
                self.load(*at)?;
                match &self.cache[at].obj {
                    Obj::Exonode(x) => Ok(x.caps),
                    _ => err(libc::EINVAL, "not an exonode"),
                }
            }
            Target::Proxy(_) => err(libc::EINVAL, "a proxy of a proxy names its original"),
        }
    }

    /// Read sectors `at..` into `buf` after checking (synchronous; the service batches through
    /// its queue instead).
    pub fn read(&mut self, target: &Target, rcap: Cap, at: u64, buf: &mut Aligned) -> Result<()> {
        self.check_io(target, rcap, Access::Read, at, (buf.len() / SECTOR) as u64)?;
        self.disk.read(at, buf).map_err(io_err)?;
        self.content.open(at, buf).map_err(unsealed)
    }

    /// Write `buf` at sector `at` after checking, flushed when the model is `data`.
    pub fn write(&mut self, target: &Target, wcap: Cap, at: u64, buf: &Aligned) -> Result<()> {
        let model = self.check_io(target, wcap, Access::Write, at, (buf.len() / SECTOR) as u64)?;
        let mut sealed = Aligned::from_bytes(buf);
        self.content.seal(at, &mut sealed, model == Persistence::Data).map_err(io_err)?;
        self.disk.write(at, &sealed).map_err(io_err)?;
        if model == Persistence::Data {
            self.sync_disk()?;
        }
        Ok(())
    }
}
