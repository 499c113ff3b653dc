//! Exonodes: allocating and deallocating them, and the operations on their entries (extents,
//! descendants, data), each checked against the capability presented.

use crate::object::{Cap, Caps, Entry, Exonode, MAX_EXONODE_SECTORS};

use super::{err, Access, Cached, Core, Obj, Persistence, Result, Target};

impl Core {
    /// EXONODE_ALLOCATE: a top-level exonode of `sectors` sectors at `at`.
    pub fn exonode_allocate(&mut self, at: u64, sectors: u32, caps: Caps, persistence: Persistence) -> Result<()> {
        self.new_exonode(at, sectors, caps, 0, persistence)
    }

    fn new_exonode(&mut self, at: u64, sectors: u32, caps: Caps, parent: u64, persistence: Persistence) -> Result<()> {
        if sectors == 0 || sectors > MAX_EXONODE_SECTORS {
            return err(libc::EINVAL, format!("an exonode takes 1 to {MAX_EXONODE_SECTORS} sectors"));
        }
        if caps.read == 0 || caps.write == 0 {
            return err(libc::EINVAL, "capabilities must not be 0");
        }
        self.check_free(at, sectors as u64)?;
        self.mark(at, sectors as u64, true);
        self.clock += 1;
        let obj = Obj::Exonode(Exonode { sectors, caps, model: persistence.code(), parent, entries: Vec::new() });
        self.cache.insert(at, Cached { obj, persistence, on_disk: false, dirty: true, used: self.clock, stale_frees: Vec::new() });
        self.persist(at, false)
    }

    /// EXONODE_DEALLOCATE: it must have no descendants left; its extents are freed with it.
    pub fn exonode_deallocate(&mut self, target: &Target, wcap: Cap) -> Result<()> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        let x = self.exonode(at).clone();
        if x.entries.iter().any(|e| matches!(e, Entry::Descendant { .. })) {
            return err(libc::ENOTEMPTY, format!("the exonode at {at}: remove its descendants first"));
        }
        if x.parent != 0 {
            // Unnamed in the parent first: an interrupted removal leaves an orphan.
            let parent = x.parent;
            self.load(parent)?;
            let px = self.exonode_mut(parent);
            for e in px.entries.iter_mut() {
                if *e == (Entry::Descendant { at }) {
                    *e = Entry::Empty;
                }
            }
            self.persist(parent, false)?;
        }
        let persistent = self.persistence(at) != Persistence::Memory;
        let stale_frees = std::mem::take(&mut self.cache.get_mut(&at).expect("cached").stale_frees);
        self.drop_record(at, x.sectors)?;
        for (start, sectors) in stale_frees {
            self.mark(start, sectors, false);
        }
        self.mark(at, x.sectors as u64, false);
        for e in &x.entries {
            if let Entry::Extent { start, sectors } = *e {
                self.mark(start, sectors, false);
            }
        }
        if persistent {
            self.flush_map()?;
        }
        Ok(())
    }

    /// Put `entry` in slot `idx` (an empty one, or the end), or in the first empty slot.
    fn place(x: &mut Exonode, idx: Option<u32>, entry: Entry) -> Result<u32> {
        let i = match idx {
            Some(i) => i as usize,
            None => x.entries.iter().position(|e| *e == Entry::Empty).unwrap_or(x.entries.len()),
        };
        if i > x.entries.len() {
            return err(libc::EINVAL, format!("entry {i}: past the end ({} entries)", x.entries.len()));
        }
        if i < x.entries.len() && x.entries[i] != Entry::Empty {
            return err(libc::EEXIST, format!("entry {i} is in use"));
        }
        Self::fits_with(x, i, &entry)?;
        if i == x.entries.len() {
            x.entries.push(entry);
        } else if x.entries[i] == Entry::Empty {
            x.entries[i] = entry;
        } else {
            return err(libc::EEXIST, format!("entry {i} is in use"));
        }
        debug_assert!(x.fits());
        Ok(i as u32)
    }

    /// The sectors a deallocation of `target` (or, with `entry`, a removal of that entry) would
    /// give up, for the service to wait until no data request on them is still queued. Empty
    /// when the request would be refused anyway.
    pub fn sectors_given_up(&mut self, target: &Target, wcap: Cap, entry: Option<u32>) -> Vec<(u64, u64)> {
        match target {
            Target::Extent(at) => match self.extent(*at, wcap, Access::Write) {
                Ok(h) => vec![(*at, *at + h.sectors)],
                Err(_) => Vec::new(),
            },
            _ => {
                let Ok(at) = self.exonode_at(target, wcap, Access::Write) else { return Vec::new() };
                let x = self.exonode(at);
                let extent = |e: &Entry| match *e {
                    Entry::Extent { start, sectors } => Some((start, start + sectors)),
                    _ => None,
                };
                match entry {
                    Some(i) => x.entries.get(i as usize).and_then(extent).into_iter().collect(),
                    None => x.entries.iter().filter_map(extent).chain([(at, at + x.sectors as u64)]).collect(),
                }
            }
        }
    }

    /// Change the exonode at `at` and persist it by its model. `edit` checks before it changes
    /// anything: on an error the exonode is as it was (no copy is kept to restore it, so that an
    /// edit of a large exonode costs no more than the change).
    fn edit<T>(&mut self, at: u64, edit: impl FnOnce(&mut Exonode) -> Result<T>) -> Result<T> {
        let was_dirty = self.cache[&at].dirty;
        match edit(self.exonode_mut(at)) {
            Ok(v) => {
                self.persist(at, false)?;
                Ok(v)
            }
            Err(e) => {
                self.cache.get_mut(&at).expect("cached").dirty = was_dirty;
                Err(e)
            }
        }
    }

    /// Whether `x` still fits its sectors with entry `i` replaced by (or, past the end,
    /// extended with) `entry`.
    fn fits_with(x: &Exonode, i: usize, entry: &Entry) -> Result<()> {
        let old = x.entries.get(i).map_or(0, Entry::encoded_len);
        let used = x.used() - old + entry.encoded_len();
        if used > Exonode::capacity(x.sectors) {
            return err(libc::ENOSPC, format!("the exonode is full ({used} bytes of entries): allocate a larger one or a descendant"));
        }
        Ok(())
    }

    /// ADD_EXTENT: allocate `start..start + sectors` into the exonode. Returns the entry number.
    pub fn add_extent(&mut self, target: &Target, wcap: Cap, idx: Option<u32>, start: u64, sectors: u64) -> Result<u32> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        self.check_free(start, sectors)?;
        self.forget_data(start, sectors)?;
        self.mark(start, sectors, true);
        let r = self.edit(at, |x| Self::place(x, idx, Entry::Extent { start, sectors }));
        if r.is_err() {
            self.mark(start, sectors, false);
        }
        r
    }

    /// ADD_EXONODE: allocate a descendant exonode at `child` with capabilities of its own.
    pub fn add_exonode(&mut self, target: &Target, wcap: Cap, idx: Option<u32>, child: u64, sectors: u32, caps: Caps) -> Result<u32> {
        self.add_exonode_as(target, wcap, idx, child, sectors, caps, None, Vec::new())
    }

    /// ADD_EXONODE with the descendant's own persistence model (its parent's by default).
    #[allow(clippy::too_many_arguments)]
    pub fn add_exonode_as(
        &mut self,
        target: &Target,
        wcap: Cap,
        idx: Option<u32>,
        child: u64,
        sectors: u32,
        caps: Caps,
        model: Option<Persistence>,
        data: Vec<Vec<u8>>,
    ) -> Result<u32> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        let persistence = model.unwrap_or(self.persistence(at));
        // Room in the parent first, so a full parent leaves nothing behind.
        let mut probe = self.exonode(at).clone();
        Self::place(&mut probe, idx, Entry::Descendant { at: child })?;
        // And in the child for the data entries it starts with.
        let first = Exonode { sectors, caps, model: 0, parent: at, entries: data.iter().cloned().map(Entry::Data).collect() };
        if sectors == 0 || sectors > MAX_EXONODE_SECTORS || !first.fits() {
            return err(libc::ENOSPC, "the new exonode's first entries do not fit it");
        }
        self.new_exonode(child, sectors, caps, at, persistence)?;
        if !data.is_empty() {
            self.edit(child, |x| {
                x.entries = data.into_iter().map(Entry::Data).collect();
                Ok(())
            })?;
        }
        self.edit(at, |x| Self::place(x, idx, Entry::Descendant { at: child }))
    }

    /// ADD_DATA: put (or replace) application data in entry `idx` (or the first empty one).
    pub fn add_data(&mut self, target: &Target, wcap: Cap, idx: Option<u32>, data: &[u8]) -> Result<u32> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        let data = data.to_vec();
        self.edit(at, |x| match idx.map(|i| i as usize) {
            Some(i) if matches!(x.entries.get(i), Some(Entry::Data(_))) => {
                let entry = Entry::Data(data);
                Self::fits_with(x, i, &entry)?;
                x.entries[i] = entry;
                Ok(i as u32)
            }
            _ => Self::place(x, idx, Entry::Data(data)),
        })
    }

    /// READ_DATA.
    pub fn read_data(&mut self, target: &Target, rcap: Cap, idx: u32) -> Result<Vec<u8>> {
        let at = match self.entries_proxy(target, rcap, Access::Read)? {
            Some((_, entries)) if !entries.contains(&idx) => {
                return err(libc::EACCES, format!("entry {idx}: not granted by the proxy"))
            }
            Some((at, _)) => at,
            None => self.exonode_at(target, rcap, Access::Read)?,
        };
        match self.exonode(at).entries.get(idx as usize) {
            Some(Entry::Data(d)) => Ok(d.clone()),
            _ => err(libc::ENOENT, format!("the exonode at {at}: entry {idx} holds no data")),
        }
    }

    /// REMOVE_ENTRY: an extent's sectors are freed (after the exonode is written without it); a
    /// descendant must be deallocated itself.
    pub fn remove_entry(&mut self, target: &Target, wcap: Cap, idx: u32) -> Result<()> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        let entry = self.exonode(at).entries.get(idx as usize).cloned();
        match entry {
            None | Some(Entry::Empty) => err(libc::ENOENT, format!("the exonode at {at}: no entry {idx}")),
            Some(Entry::Descendant { at: d }) => {
                err(libc::ENOTEMPTY, format!("entry {idx} is the descendant at {d}: deallocate it (EXONODE_DEALLOCATE) instead"))
            }
            Some(e) => {
                self.edit(at, |x| {
                    x.entries[idx as usize] = Entry::Empty;
                    Ok(())
                })?;
                if let Entry::Extent { start, sectors } = e {
                    let persistent = self.persistence(at) != Persistence::Memory;
                    self.release(at, start, sectors, persistent)?;
                }
                Ok(())
            }
        }
    }

    /// COMBINE: extent entries `a` and `b` (b right after a on disk) become one, in `a`.
    pub fn combine(&mut self, target: &Target, wcap: Cap, a: u32, b: u32) -> Result<()> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        self.edit(at, |x| {
            let (ea, eb) = (x.entries.get(a as usize).cloned(), x.entries.get(b as usize).cloned());
            match (ea, eb) {
                (Some(Entry::Extent { start, sectors }), Some(Entry::Extent { start: s2, sectors: n2 }))
                    if a != b && start + sectors == s2 =>
                {
                    x.entries[a as usize] = Entry::Extent { start, sectors: sectors + n2 };
                    x.entries[b as usize] = Entry::Empty;
                    Ok(())
                }
                _ => err(libc::EINVAL, format!("entries {a} and {b}: not two extents, the second right after the first")),
            }
        })
    }

    /// SPLIT: extent entry `idx` keeps its first `at_sector` sectors; the rest goes to entry
    /// `new_idx` (or the first empty one). Returns that entry's number.
    pub fn split(&mut self, target: &Target, wcap: Cap, idx: u32, at_sector: u64, new_idx: Option<u32>) -> Result<u32> {
        let at = self.exonode_at(target, wcap, Access::Write)?;
        self.edit(at, |x| match x.entries.get(idx as usize).cloned() {
            Some(Entry::Extent { start, sectors }) if at_sector > 0 && at_sector < sectors => {
                // The tail first: if it has no room, nothing has changed.
                let tail = Self::place(x, new_idx, Entry::Extent { start: start + at_sector, sectors: sectors - at_sector })?;
                x.entries[idx as usize] = Entry::Extent { start, sectors: at_sector };
                Ok(tail)
            }
            _ => err(libc::EINVAL, format!("entry {idx}: not an extent longer than {at_sector} sectors")),
        })
    }

    /// CAP_DISCOVER: the capabilities of the descendant in entry `idx`. The ancestor's read
    /// capability reveals the read capability, its write capability both.
    pub fn cap_discover(&mut self, target: &Target, cap: Cap, idx: u32) -> Result<Caps> {
        let writer = self.access_of(target, cap) == Some(Access::Write);
        let at = self.exonode_at(target, cap, Access::Read)?;
        let child = match self.exonode(at).entries.get(idx as usize) {
            Some(Entry::Descendant { at }) => *at,
            _ => return err(libc::ENOENT, format!("the exonode at {at}: entry {idx} is not a descendant")),
        };
        self.load(child)?;
        let caps = self.exonode(child).caps;
        Ok(if writer { caps } else { Caps { read: caps.read, write: 0 } })
    }

    /// EXTENT_WRITE / EXONODE_WRITE: write the record now, whatever its model. A `memory`
    /// object stays one: its later changes wait for the next write (a library that writes its
    /// metadata back now and then, as a file system with a commit interval does).
    pub fn write_record(&mut self, target: &Target, wcap: Cap) -> Result<()> {
        let at = match target {
            Target::Extent(at) => {
                self.extent(*at, wcap, Access::Write)?;
                *at
            }
            _ => self.exonode_at(target, wcap, Access::Write)?,
        };
        self.persist(at, true)
    }

    /// MAP: the exonode as it is (entries and data), for a holder of its read capability.
    pub fn map(&mut self, target: &Target, rcap: Cap) -> Result<Exonode> {
        if let Some((at, entries)) = self.entries_proxy(target, rcap, Access::Read)? {
            // Only what the proxy grants shows.
            let mut x = self.exonode(at).clone();
            for (i, e) in x.entries.iter_mut().enumerate() {
                if !entries.contains(&(i as u32)) {
                    *e = Entry::Empty;
                }
            }
            return Ok(x);
        }
        let at = self.exonode_at(target, rcap, Access::Read)?;
        Ok(self.exonode(at).clone())
    }

    /// Drop descendant entries that name exonodes that are gone (found by the start-up scan),
    /// and write their exonodes.
    pub fn drop_dangling(&mut self, dangling: &[(u64, u32)]) -> Result<()> {
        for &(at, idx) in dangling {
            self.load(at)?;
            if let Obj::Exonode(x) = &mut self.cache.get_mut(&at).expect("loaded").obj {
                if let Some(e @ Entry::Descendant { .. }) = x.entries.get_mut(idx as usize) {
                    *e = Entry::Empty;
                }
            }
            self.cache.get_mut(&at).expect("loaded").dirty = true;
            self.persist(at, true)?;
        }
        Ok(())
    }
}
