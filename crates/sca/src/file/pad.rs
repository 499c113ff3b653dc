//! Padded files (see the documentation of [`super`]): the trailer holding the real size, writes
//! and truncation that keep it at the end, and padding out to PADMÉ.

use plyfs_stack::Result;

use crate::chunks::chunk_of;
use crate::format::{padme, Kind, PAD_MAGIC, PAD_TRAILER_BYTES};

use super::{Fault, LowerIo, ScaFile, IO_WINDOW_BYTES, NOT_KNOWN};

/// A padded file's first write, from its start, up to this far is padded at once.
const EAGER_PAD_BYTES: u64 = 1 << 20;

impl<L: LowerIo> ScaFile<L> {
    pub(super) fn forget_real_size(&self) {
        let v = if self.padded && self.ix.size > 0 { NOT_KNOWN } else { 0 };
        self.real_size.store(v, std::sync::atomic::Ordering::Relaxed);
    }

    /// The real size of a padded file, from the last bytes stored. A trailer that does not
    /// read as one (a crash in the middle of a size change) leaves all that is stored visible,
    /// padding included: nothing is hidden that may be the owner's.
    pub(super) fn read_trailer(&self) -> u64 {
        let stored = self.ix.size;
        if stored == 0 {
            return 0;
        }
        let bad = |why: &str| {
            tracing::error!("{}: the size of this padded file cannot be read ({why}); showing all {stored} bytes stored", self.lower.describe());
            stored
        };
        if stored < PAD_TRAILER_BYTES {
            return bad("shorter than its trailer");
        }
        match self.read_stored(stored - PAD_TRAILER_BYTES, PAD_TRAILER_BYTES as usize) {
            Ok(t) => parse_trailer(&t, stored).unwrap_or_else(bad),
            Err(Fault::Fail(e)) => bad(&e.to_string()),
            Err(Fault::Stale(why)) => bad(&why),
        }
    }

    fn trailer(size: u64) -> [u8; PAD_TRAILER_BYTES as usize] {
        let mut t = [0u8; PAD_TRAILER_BYTES as usize];
        t[..8].copy_from_slice(&size.to_le_bytes());
        t[8..].copy_from_slice(&PAD_MAGIC);
        t
    }

    fn set_real_size(&self, n: u64) {
        self.real_size.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Write to a padded file: the bytes between its end and `off` become zeros, and the
    /// trailer follows the new end, or stays at the end of the padding the new end is still in.
    pub(super) fn write_padded(&mut self, off: u64, data: &[u8]) -> std::result::Result<(), Fault> {
        let n = self.size();
        let end = off + data.len() as u64;
        if end <= n {
            return self.write_chunks(off, data);
        }
        let stored = self.ix.size;
        if off > n + EAGER_PAD_BYTES {
            // A far jump (a sparse file): the padding and trailer go, and the gap becomes a hole,
            // as in any file; the data and its trailer follow.
            self.truncate_chunks(n)?;
            self.flush_pending()?;
            let mut buf = Vec::with_capacity(data.len() + PAD_TRAILER_BYTES as usize);
            buf.extend_from_slice(data);
            buf.extend_from_slice(&Self::trailer(end));
            self.write_chunks(off, &buf)?;
            self.set_real_size(end);
            return Ok(());
        }
        // What goes from the old end on: zeros up to `off`, then the data.
        let from = off.min(n);
        let mut buf = vec![0u8; (end - from) as usize];
        buf[(off - from) as usize..].copy_from_slice(data);
        let cs = self.ix.chunk_bytes();
        if end + PAD_TRAILER_BYTES <= stored && stored - end <= cs {
            // Inside the padding, near its end: data, zeros and the trailer in one write.
            buf.resize((stored - PAD_TRAILER_BYTES - from) as usize, 0);
            buf.extend_from_slice(&Self::trailer(end));
            self.write_chunks(from, &buf)?;
        } else if end + PAD_TRAILER_BYTES <= stored {
            // Still inside the padding: the trailer stays where it is, and says more. (The
            // records go out first: the trailer's chunk may be one just written.)
            self.write_chunks(from, &buf)?;
            self.flush_pending()?;
            self.write_chunks(stored - PAD_TRAILER_BYTES, &Self::trailer(end))?;
        } else if stored == 0 && end <= EAGER_PAD_BYTES {
            // A new file written from the start, as most small files are: padded at once, so
            // that closing it writes nothing more.
            let target = padme(end + PAD_TRAILER_BYTES);
            buf.resize((target - PAD_TRAILER_BYTES - from) as usize, 0);
            buf.extend_from_slice(&Self::trailer(end));
            self.write_chunks(from, &buf)?;
        } else {
            buf.extend_from_slice(&Self::trailer(end));
            self.write_chunks(from, &buf)?;
        }
        self.set_real_size(end);
        Ok(())
    }

    /// Set a padded file's size: what lay past the new size goes, and the trailer follows it.
    pub(super) fn truncate_padded(&mut self, size: u64) -> std::result::Result<(), Fault> {
        let n = self.size();
        // The trailer is written first, so that the last bytes stored always name the size.
        if size < n {
            self.write_chunks(size, &Self::trailer(size))?;
            self.flush_pending()?;
            self.truncate_chunks(size + PAD_TRAILER_BYTES)?;
        } else {
            self.write_padded(size - 1, &[0])?;
        }
        self.set_real_size(size);
        Ok(())
    }

    /// Bring a padded file's stored size to `padme(size + 16)`, the padding written as data.
    fn pad_out(&mut self) -> std::result::Result<(), Fault> {
        let n = self.size();
        let stored = self.ix.size;
        if n == 0 && stored == 0 {
            return Ok(());
        }
        let target = padme(n + PAD_TRAILER_BYTES);
        if stored == target {
            return Ok(());
        }
        if stored < target && target - n <= self.ix.chunk_bytes() {
            // Little to add: the zeros and the trailer in one write.
            let mut buf = vec![0u8; (target - n) as usize];
            buf[(target - n - PAD_TRAILER_BYTES) as usize..].copy_from_slice(&Self::trailer(n));
            self.write_chunks(n, &buf)?;
            self.set_real_size(n);
            return Ok(());
        }
        // The trailer first, at the padded end; then zeros over everything between.
        self.write_chunks(target - PAD_TRAILER_BYTES, &Self::trailer(n))?;
        self.flush_pending()?;
        if stored > target {
            self.truncate_chunks(target)?;
            self.flush_pending()?;
        }
        // A file that ends in a hole (but for its last chunk) shows no end of data for the
        // padding to hide: its padding joins the hole (a sparse image of a terabyte is not to be followed by gigabytes of
        // sealed zeros).
        let last = chunk_of(self.ix.chunk_shift, n - 1);
        let is_hole = |c: u64| self.ix.map.get(c).is_some_and(|r| r.kind == Kind::Run);
        if is_hole(last) || (last > 0 && is_hole(last - 1)) {
            self.set_real_size(n);
            return Ok(());
        }
        let mut at = n;
        while at < target - PAD_TRAILER_BYTES {
            let len = (target - PAD_TRAILER_BYTES - at).min(IO_WINDOW_BYTES);
            self.write_chunks(at, &vec![0u8; len as usize])?;
            self.flush_pending()?;
            at += len;
        }
        self.set_real_size(n);
        Ok(())
    }

    /// [`Self::pad_out`] before the file is left or synced, when this open changed it.
    pub(super) fn pad_if_changed(&mut self) -> Result<()> {
        if !self.padded || !self.modified || !self.lower.writable() {
            return Ok(());
        }
        let result = self.with_rebuild(|f| f.pad_out());
        self.finish(result)
    }
}

/// The real size a padded file's trailer `t` (its last stored bytes, of `stored`) names, or why
/// it names none.
pub(super) fn parse_trailer(t: &[u8], stored: u64) -> std::result::Result<u64, &'static str> {
    if t.len() != PAD_TRAILER_BYTES as usize || t[8..] != PAD_MAGIC {
        return Err("no trailer at the end");
    }
    let n = u64::from_le_bytes(t[..8].try_into().expect("8 bytes"));
    if n > stored - PAD_TRAILER_BYTES {
        return Err("the size it names is past the end");
    }
    Ok(n)
}
