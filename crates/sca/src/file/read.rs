//! Reading: decoded bytes from the records the index names (records adjacent in the log are
//! fetched in one request), the fast tail, and `SEEK_DATA`/`SEEK_HOLE`.

use plyfs_stack::shared::LockKind;
use plyfs_stack::{Error, Result};

use crate::chunkmap::RecordRef;
use crate::chunks::{chunk_of, chunk_start, chunks_touched, span_in_chunk};
use crate::codec::Place;
use crate::format::{payload_ok, Kind, RecordHeader, RECORD_HEADER_BYTES};

use super::{Fault, LowerIo, ScaFile, IO_WINDOW_BYTES};

impl<L: LowerIo> ScaFile<L> {
    /// A read that checks the state against the lower file first when it is shared.
    pub fn read_current(&mut self, offset: u64, size: usize) -> Result<Vec<u8>> {
        self.locked(LockKind::Shared, |f| f.with_rebuild(|f| f.read(offset, size)))
    }

    /// Where `SEEK_DATA` (`data`) or `SEEK_HOLE` from `offset` lands: the first offset at or
    /// after it in data, or in a hole; `None` when no data follows. Holes are the chunks written
    /// as a run of zeros; a fast tail is data, and so is a lost chunk (a copy must fail on it,
    /// not skip it). The end of the file is a hole.
    pub fn seek_data_or_hole(&mut self, offset: u64, data: bool) -> Result<Option<u64>> {
        let size = self.current_size()?;
        if offset >= size {
            return Ok(None);
        }
        let (shift, chunks) = (self.ix.chunk_shift, self.ix.chunks());
        let mut chunk = chunk_of(shift, offset);
        while chunk < chunks {
            let hole_end = self.hole_end(chunk);
            if hole_end.is_some() != data {
                return Ok(Some(chunk_start(shift, chunk).max(offset)));
            }
            chunk = hole_end.unwrap_or(chunk + 1);
        }
        Ok(if data { None } else { Some(size) })
    }

    /// One past the last chunk of the hole that starts at `chunk`, if one does: a run of zero
    /// chunks, up to the fast tail or a lost chunk within it.
    fn hole_end(&self, chunk: u64) -> Option<u64> {
        let tail = self.ix.tail.as_ref().map(|t| t.chunk);
        let run_end = self.ix.map.run_end(chunk).filter(|_| tail != Some(chunk) && !self.lost.contains(&chunk))?;
        let lost = self.lost.range(chunk..run_end).next().copied();
        let tail = tail.filter(|&t| t > chunk && t < run_end);
        Some([lost, tail].into_iter().flatten().fold(run_end, u64::min))
    }

    /// Decoded bytes `off..off + len`, clipped to the file size.
    pub fn read(&self, off: u64, len: usize) -> std::result::Result<Vec<u8>, Fault> {
        let len = if self.padded { (self.size().saturating_sub(off)).min(len as u64) as usize } else { len };
        self.read_stored(off, len)
    }

    /// Stored bytes `off..off + len` (a padded file's padding and trailer included).
    pub(super) fn read_stored(&self, off: u64, len: usize) -> std::result::Result<Vec<u8>, Fault> {
        let end = (off + len as u64).min(self.ix.size);
        if off >= end {
            return Ok(Vec::new());
        }
        let shift = self.ix.chunk_shift;
        let cs = self.ix.chunk_bytes();
        let mut out = Vec::with_capacity((end - off) as usize);
        let touched = chunks_touched(shift, off, end - off);
        let mut chunk = touched.start;
        let last = touched.end - 1;
        let range_in = |c: u64| {
            let within = span_in_chunk(shift, c, off, end);
            (within.start, within.end)
        };
        while chunk <= last {
            self.check_not_lost(chunk)?;
            if self.ix.tail.as_ref().is_some_and(|t| t.chunk == chunk) {
                let content = self.tail_content()?;
                let (s, e) = range_in(chunk);
                copy_padded(&mut out, &content, s, e);
                chunk += 1;
                continue;
            }
            // Chunks whose records sit back to back in the log are read with one request.
            let first = self.record_of(chunk)?;
            let mut span = vec![(chunk, first)];
            let (span_start, mut span_end) = (first.off, first.end());
            while chunk + (span.len() as u64) <= last {
                let next = chunk + span.len() as u64;
                if self.lost.contains(&next) || self.ix.tail.as_ref().is_some_and(|t| t.chunk == next) {
                    break;
                }
                let rec = self.record_of(next)?;
                let same_run = rec.off == span.last().expect("not empty").1.off;
                if !same_run && (rec.off != span_end || span_end - span_start >= IO_WINDOW_BYTES) {
                    break;
                }
                span_end = span_end.max(rec.end());
                span.push((next, rec));
            }
            let bytes = self.log_bytes(span_start, (span_end - span_start) as usize)?;
            let mut run_cache: Option<(u64, Vec<u8>)> = None;
            for (c, rec) in &span {
                let at = (rec.off - span_start) as usize;
                let (s, e) = range_in(*c);
                if rec.kind == Kind::Run {
                    if run_cache.as_ref().is_none_or(|(o, _)| *o != rec.off) {
                        let payload = self.check_record(*c, rec, bytes.get(at..).unwrap_or(&[]))?;
                        let mut decoded = Vec::with_capacity(cs as usize);
                        self.decode_into(*c, rec, payload, &mut decoded)?;
                        run_cache = Some((rec.off, decoded));
                    }
                    copy_padded(&mut out, &run_cache.as_ref().expect("filled").1, s, e);
                    continue;
                }
                let payload = self.check_record(*c, rec, bytes.get(at..).unwrap_or(&[]))?;
                if s == 0 && e == rec.decoded_len as usize {
                    self.decode_into(*c, rec, payload, &mut out)?;
                } else {
                    let mut decoded = Vec::with_capacity(rec.decoded_len as usize);
                    self.decode_into(*c, rec, payload, &mut decoded)?;
                    copy_padded(&mut out, &decoded, s, e);
                }
            }
            chunk += span.len() as u64;
        }
        Ok(out)
    }

    pub(super) fn check_not_lost(&self, chunk: u64) -> std::result::Result<(), Fault> {
        if self.lost.contains(&chunk) {
            return Err(Fault::Fail(Error::Corrupt(format!(
                "{}: data at offset {} is lost (its newest record is missing or damaged)",
                self.lower.describe(),
                chunk_start(self.ix.chunk_shift, chunk)
            ))));
        }
        Ok(())
    }

    fn record_of(&self, chunk: u64) -> std::result::Result<RecordRef, Fault> {
        self.ix.map.get(chunk).ok_or_else(|| Fault::Stale(format!("chunk {chunk} has no record")))
    }

    /// Check that `bytes` (starting at the record) hold the record the index expects for
    /// `chunk`, and return its payload.
    fn check_record<'b>(&self, chunk: u64, rec: &RecordRef, bytes: &'b [u8]) -> std::result::Result<(&'b [u8], Place), Fault> {
        let stale = || Fault::Stale(format!("the record at {} is not chunk {chunk}'s", rec.off));
        let h = RecordHeader::decode(bytes).ok_or_else(stale)?;
        let count = if h.kind == Kind::Run { u64::from(h.count) } else { 1 };
        if h.kind != rec.kind
            || h.seq != rec.seq
            || h.payload_len != rec.payload_len
            || h.decoded_len != rec.decoded_len
            || !(h.chunk..h.chunk + count).contains(&chunk)
        {
            return Err(stale());
        }
        let payload = bytes.get(RECORD_HEADER_BYTES as usize..(RECORD_HEADER_BYTES + u64::from(h.payload_len)) as usize);
        // Bytes still as they were checked while loading need no second check.
        let checked = self.verified.start <= rec.off && rec.end() <= self.verified.end;
        let place = Place { file_id: self.file_id, chunk: h.chunk, count };
        match payload {
            Some(p) if checked || payload_ok(&h, p) => Ok((p, place)),
            _ => Err(Fault::Fail(self.corrupt(chunk, rec.off, "checksum mismatch"))),
        }
    }

    fn decode_into(&self, chunk: u64, rec: &RecordRef, (payload, place): (&[u8], Place), out: &mut Vec<u8>) -> std::result::Result<(), Fault> {
        let before = out.len();
        if rec.raw && !self.engine.codec.store_raw_if_larger() {
            // This codec never stores a chunk as it is (a cipher): the flag was forged.
            return Err(Fault::Fail(self.corrupt(chunk, rec.off, "a record marked unencoded, which this codec never writes")));
        }
        if rec.raw {
            out.extend_from_slice(payload);
        } else if let Err(e) = self.engine.codec.decode_at(&place, payload, rec.decoded_len as usize, out) {
            out.truncate(before);
            return Err(Fault::Fail(self.corrupt(chunk, rec.off, &e.to_string())));
        }
        if out.len() - before != rec.decoded_len as usize {
            let got = out.len() - before;
            out.truncate(before);
            return Err(Fault::Fail(self.corrupt(chunk, rec.off, &format!("decoded to {got} bytes, not {}", rec.decoded_len))));
        }
        Ok(())
    }

    /// The error for a damaged chunk: the file, the upper offset, the lower offset, the cause.
    /// Whoever reports the error logs it (the FUSE front end logs every one it turns into EIO).
    fn corrupt(&self, chunk: u64, lower_off: u64, why: &str) -> Error {
        Error::Corrupt(format!(
            "{}: corrupt data at offset {} (record at lower offset {lower_off}): {why}",
            self.lower.describe(),
            chunk_start(self.ix.chunk_shift, chunk)
        ))
    }

    pub(super) fn tail_content(&self) -> std::result::Result<Vec<u8>, Fault> {
        let t = self.ix.tail.as_ref().expect("caller checked");
        if !self.engine.codec.plaintext_safe() {
            // A codec that may not leave plaintext below never writes a fast tail: it was forged.
            let at = t.fragments.last().map_or(0, |f| f.off);
            return Err(Fault::Fail(self.corrupt(t.chunk, at, "an unencoded fast tail, which this codec never writes")));
        }
        let mut content = Vec::with_capacity(t.len() as usize);
        if let Some(base) = &t.base {
            let bytes = self.lower.read_at(base.off, base.bytes() as usize)?;
            let payload = self.check_record(t.chunk, base, &bytes)?;
            self.decode_into(t.chunk, base, payload, &mut content)?;
            content.truncate(t.keep as usize);
        }
        content.extend_from_slice(&t.bytes);
        Ok(content)
    }

    /// The decoded content of one chunk (empty past the end of the file).
    pub(super) fn chunk_content(&mut self, chunk: u64) -> std::result::Result<Vec<u8>, Fault> {
        let mut content = Vec::new();
        self.chunk_content_into(chunk, &mut content)?;
        Ok(content)
    }

    /// [`Self::chunk_content`] into `out`, which is cleared first.
    pub(super) fn chunk_content_into(&mut self, chunk: u64, out: &mut Vec<u8>) -> std::result::Result<(), Fault> {
        out.clear();
        let start = chunk_start(self.ix.chunk_shift, chunk);
        let len = self.ix.chunk_len(chunk) as usize;
        if len == 0 {
            return Ok(());
        }
        let current_seq = self.ix.map.get(chunk).map(|r| r.seq);
        match &self.hot {
            Some((c, seq, content)) if *c == chunk && Some(*seq) == current_seq => {
                out.extend_from_slice(&content[..len.min(content.len())]);
                out.resize(len, 0);
            }
            _ => *out = self.read_stored(start, len)?,
        }
        Ok(())
    }

    /// A read that rebuilds a stale index (unless a reader before it already has) and tries
    /// again.
    pub fn read_repairing(&mut self, offset: u64, size: usize) -> Result<Vec<u8>> {
        self.with_rebuild(|f| f.read(offset, size))
    }
}

/// Append `content[s..e]` to `out`, with zeros for whatever `content` lacks.
fn copy_padded(out: &mut Vec<u8>, content: &[u8], s: usize, e: usize) {
    let have = content.len().min(e);
    if s < have {
        out.extend_from_slice(&content[s..have]);
    }
    out.resize(out.len() + (e - s.max(have)), 0);
}
