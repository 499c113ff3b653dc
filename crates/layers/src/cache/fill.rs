//! A copy being filled from the slow branch, a range at a time.
//!
//! A read waits only for the ranges it covers: each missing one is fetched by the reader itself,
//! and the next few are fetched ahead of it in parallel, by the layer's fetchers. A write of the
//! slow file through this mount (write-through) holds the ranges it covers while it reaches the
//! slow branch and the copy, so a fetch in flight can never put older bytes over it.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use plyfs_stack::{Caller, FileHandle, Level, NodeId, Result};

use super::store::Stamp;

const ABSENT: u8 = 0;
/// Being fetched, or held by a write.
const BUSY: u8 = 1;
const PRESENT: u8 = 2;

/// Bytes read from the slow branch in one request.
const PIECE: u64 = 1 << 20;

struct State {
    size: u64,
    ranges: Vec<u8>,
    present: usize,
}

pub struct Fill {
    pub key: u64,
    pub gen: u64,
    pub file: Arc<File>,
    range: u64,
    st: Mutex<State>,
    cond: Condvar,
    slow: Level,
    /// The slow branch's handle the fetches read through, opened when first needed.
    source: Mutex<Option<FileHandle>>,
    /// The slow file as it was when filling started.
    pub start: Mutex<Stamp>,
    /// Bytes fetched so far (for eviction's accounting while it fills).
    pub fetched: AtomicU64,
    /// Every fill's fetched bytes, for `cache-status`.
    total: Arc<AtomicU64>,
    /// The copy was given up (the slow file changed, or it was evicted): reads go to the slow
    /// branch.
    pub detached: AtomicBool,
    /// The layer recorded it whole.
    pub recorded: AtomicBool,
}

fn ranges_for(size: u64, range: u64) -> usize {
    size.div_ceil(range) as usize
}

impl Fill {
    #[allow(clippy::too_many_arguments)]
    pub fn new(key: u64, gen: u64, file: File, size: u64, range: u64, slow: Level, start: Stamp, complete: bool, total: Arc<AtomicU64>) -> Fill {
        let n = ranges_for(size, range);
        let state = if complete { PRESENT } else { ABSENT };
        Fill {
            key,
            gen,
            file: Arc::new(file),
            range,
            st: Mutex::new(State { size, ranges: vec![state; n], present: if complete { n } else { 0 } }),
            cond: Condvar::new(),
            slow,
            source: Mutex::new(None),
            start: Mutex::new(start),
            fetched: AtomicU64::new(0),
            total,
            detached: AtomicBool::new(false),
            recorded: AtomicBool::new(complete),
        }
    }

    pub fn size(&self) -> u64 {
        self.st.lock().size
    }

    pub fn is_complete(&self) -> bool {
        let st = self.st.lock();
        st.present == st.ranges.len()
    }

    fn source(&self) -> Result<FileHandle> {
        let mut src = self.source.lock();
        if let Some(fh) = *src {
            return Ok(fh);
        }
        let opened = self.slow.open(&Caller::daemon(), NodeId(self.key), libc::O_RDONLY)?;
        *src = Some(opened.fh);
        Ok(opened.fh)
    }

    /// Read from the slow branch directly (a detached copy).
    pub fn read_slow(&self, offset: u64, size: u32) -> Result<Vec<u8>> {
        let fh = self.source()?;
        self.slow.read(&Caller::daemon(), NodeId(self.key), fh, offset, size)
    }

    /// Fetch range `r` (already marked busy by the caller) into the copy.
    fn fetch(&self, r: usize) -> Result<()> {
        let size = self.size();
        let from = r as u64 * self.range;
        let to = (from + self.range).min(size);
        let fh = self.source()?;
        let mut at = from;
        while at < to {
            let want = (to - at).min(PIECE) as u32;
            let data = self.slow.read(&Caller::daemon(), NodeId(self.key), fh, at, want)?;
            if data.is_empty() {
                // The slow file is shorter than it was: the stamp check at the end finds it.
                break;
            }
            self.file.write_all_at(&data, at)?;
            at += data.len() as u64;
            self.fetched.fetch_add(data.len() as u64, Ordering::Relaxed);
            self.total.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Make range `r` present: wait if someone else fetches it, fetch it if nobody does.
    fn ensure(&self, r: usize) -> Result<()> {
        {
            let mut st = self.st.lock();
            loop {
                match st.ranges.get(r) {
                    None | Some(&PRESENT) => return Ok(()),
                    Some(&BUSY) => self.cond.wait(&mut st),
                    Some(_) => {
                        st.ranges[r] = BUSY;
                        break;
                    }
                }
            }
        }
        let result = self.fetch(r);
        let mut st = self.st.lock();
        if let Some(s) = st.ranges.get_mut(r) {
            *s = if result.is_ok() { PRESENT } else { ABSENT };
            if result.is_ok() {
                st.present += 1;
            }
        }
        self.cond.notify_all();
        result
    }

    /// Claim the ranges after `last` that nobody fetches yet, up to `ahead` of them, for the
    /// fetchers.
    pub fn claim_ahead(&self, last: usize, ahead: usize) -> Vec<usize> {
        let mut st = self.st.lock();
        let mut claimed = Vec::new();
        for r in last + 1..(last + 1 + ahead).min(st.ranges.len()) {
            if st.ranges[r] == ABSENT {
                st.ranges[r] = BUSY;
                claimed.push(r);
            }
        }
        claimed
    }

    /// Fetch a range claimed by [`Fill::claim_ahead`].
    pub fn fetch_claimed(&self, r: usize) {
        let result = self.fetch(r);
        let mut st = self.st.lock();
        if let Some(s) = st.ranges.get_mut(r) {
            if *s == BUSY {
                *s = if result.is_ok() { PRESENT } else { ABSENT };
                if result.is_ok() {
                    st.present += 1;
                }
            }
        }
        self.cond.notify_all();
    }

    /// `size` bytes at `offset`, fetching what is missing. Returns the data and the last range
    /// it covered (for read-ahead).
    pub fn read(&self, offset: u64, size: u32) -> Result<(Vec<u8>, Option<usize>)> {
        if self.detached.load(Ordering::Acquire) {
            return self.read_slow(offset, size).map(|d| (d, None));
        }
        let end = (offset + u64::from(size)).min(self.size());
        if offset >= end {
            return Ok((Vec::new(), None));
        }
        let (first, last) = ((offset / self.range) as usize, ((end - 1) / self.range) as usize);
        for r in first..=last {
            self.ensure(r)?;
        }
        let mut buf = vec![0u8; (end - offset) as usize];
        let mut got = 0;
        while got < buf.len() {
            let n = self.file.read_at(&mut buf[got..], offset + got as u64)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        buf.truncate(got);
        Ok((buf, Some(last)))
    }

    /// Every range, fetched now (for a copy that must be whole: write-back, `cache-warm`).
    /// `progress` is told the bytes of each range as it arrives.
    pub fn fill_all(&self, progress: &dyn Fn(u64)) -> Result<()> {
        let n = self.st.lock().ranges.len();
        for r in 0..n {
            self.ensure(r)?;
            progress(self.range.min(self.size().saturating_sub(r as u64 * self.range)));
        }
        Ok(())
    }

    /// Hold the ranges `offset..offset+len` covers (waiting for fetches in flight), for a write
    /// that reaches the slow branch and then the copy. Ranges past the end are added, absent.
    pub fn hold(&self, offset: u64, len: u64) -> Held<'_> {
        let mut st = self.st.lock();
        let end = offset.saturating_add(len.max(1));
        let (first, last) = ((offset / self.range) as usize, ((end - 1) / self.range) as usize);
        loop {
            let busy = (first..=last.min(st.ranges.len().saturating_sub(1))).any(|r| st.ranges.get(r) == Some(&BUSY));
            if !busy {
                break;
            }
            self.cond.wait(&mut st);
        }
        let mut was = Vec::new();
        for r in first..=last {
            if let Some(s) = st.ranges.get_mut(r) {
                was.push((r, *s));
                *s = BUSY;
            }
        }
        Held { fill: self, was }
    }

    /// The write `data` at `offset` that just reached the slow branch, into the copy (under
    /// [`Fill::hold`]).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.file.write_all_at(data, offset)?;
        let mut st = self.st.lock();
        let end = offset + data.len() as u64;
        if end > st.size {
            st.size = end;
            let n = ranges_for(end, self.range);
            // New ranges are absent: fetched from the slow branch, which has them, when read.
            st.ranges.resize(n, ABSENT);
        }
        Ok(())
    }

    /// The file's size changed to `size` on the slow branch (under [`Fill::hold`] of the
    /// ranges between the old and the new end).
    pub fn set_size(&self, size: u64) -> Result<()> {
        self.file.set_len(size)?;
        let mut st = self.st.lock();
        let old = st.size;
        st.size = size;
        let n = ranges_for(size, self.range);
        if size < old {
            // Ranges past the new end are gone; the last one keeps what it had.
            let gone = st.ranges.iter().skip(n).filter(|s| **s == PRESENT).count();
            st.present -= gone;
            st.ranges.truncate(n);
        } else {
            // The last range of the old size ends at the old end; its tail is now zeros, as on
            // the slow branch, and what follows is absent.
            st.ranges.resize(n, ABSENT);
        }
        Ok(())
    }

    pub fn detach(&self) {
        self.detached.store(true, Ordering::Release);
    }
}

/// Ranges held by a write; given back as they were when dropped.
pub struct Held<'a> {
    fill: &'a Fill,
    was: Vec<(usize, u8)>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut st = self.fill.st.lock();
        for (r, s) in &self.was {
            if let Some(slot) = st.ranges.get_mut(*r) {
                if *s == PRESENT {
                    *slot = PRESENT;
                } else {
                    *slot = ABSENT;
                }
            }
        }
        // Count again: a truncate under the hold may have removed ranges.
        st.present = st.ranges.iter().filter(|s| **s == PRESENT).count();
        self.fill.cond.notify_all();
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        if let Some(fh) = self.source.get_mut().take() {
            let _ = self.slow.release(&Caller::daemon(), NodeId(self.key), fh);
        }
    }
}
