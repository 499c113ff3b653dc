//! Writing: every chunk a write touches is stored as a new record, so a write in the middle
//! costs one chunk; an append inside the last chunk is kept as a fast tail (Fast Indexing §4.2);
//! a write past the end first grows the file with zeros (§4.4).

use std::sync::Arc;

use plyfs_stack::shared::LockKind;
use plyfs_stack::Result;

use crate::chunks::{chunk_count, chunk_of, chunk_start, chunks_touched, offset_in_chunk, span_in_chunk};
use crate::codec::Place;
use crate::format::{record_bytes, Kind, RecordHeader, DATA_START, FLAG_RAW};

use super::encode::EncodedChunk;
use super::{Fault, LowerIo, ScaFile};

impl<L: LowerIo> ScaFile<L> {
    /// Write `data` at `off`, extending the file with zeros if `off` is past its end.
    pub fn write(&mut self, off: u64, data: &[u8]) -> Result<usize> {
        self.locked(LockKind::Exclusive, |f| f.write_now(off, data))
    }

    /// Append `data` at the end of the file as it is now, across mounts (`O_APPEND`); returns
    /// where it went.
    pub fn append(&mut self, data: &[u8]) -> Result<u64> {
        self.locked(LockKind::Exclusive, |f| {
            let at = f.size();
            f.write_now(at, data).map(|_| at)
        })
    }

    pub(super) fn write_now(&mut self, off: u64, data: &[u8]) -> Result<usize> {
        if data.is_empty() {
            return Ok(0);
        }
        let result = if self.padded {
            self.with_rebuild(|f| f.write_padded(off, data))
        } else {
            self.with_rebuild(|f| f.write_chunks(off, data))
        };
        self.finish(result.map(|()| data.len()))
    }

    pub(super) fn write_chunks(&mut self, off: u64, data: &[u8]) -> std::result::Result<(), Fault> {
        if off > self.ix.size {
            self.extend(off)?;
        }
        let shift = self.ix.chunk_shift;
        let cs = self.ix.chunk_bytes();
        let end = off + data.len() as u64;
        let touched = chunks_touched(shift, off, data.len() as u64);
        let chunks = touched.end - touched.start;
        // Room for every record at once: growing the buffer midway would copy it, and leave it
        // too large to keep for the next write.
        let record_bound = record_bytes(self.engine.codec.max_payload(cs as usize) as u32) as usize;
        self.pending.reserve(DATA_START as usize + chunks as usize * record_bound);
        let mut ready = self.encode_whole_chunks(off, data)?.into_iter();
        for chunk in touched {
            let start = chunk_start(shift, chunk);
            let span = span_in_chunk(shift, chunk, off, end);
            let (s, e) = (span.start, span.end);
            let piece = &data[(start + s as u64 - off) as usize..(start + e as u64 - off) as usize];
            let current = self.ix.chunk_len(chunk) as usize;
            let new_size = self.ix.size.max(start + e as u64);
            if self.engine.fast_tails && s == current && (e as u64) < cs {
                // An append inside the last chunk: store the bytes as they are (§4.2).
                self.check_not_lost(chunk)?;
                self.append_tail(chunk, s as u32, piece, new_size)?;
            } else if s == 0 && e >= current {
                self.lost.remove(&chunk);
                match ready.next().filter(|(c, _)| *c == chunk) {
                    Some((_, encoded)) => self.store_encoded(chunk, encoded, new_size)?,
                    None => self.store_chunk(chunk, piece, new_size)?,
                }
            } else {
                // Read-modify-write, in a buffer kept for the purpose.
                let mut content = std::mem::take(&mut self.scratch);
                self.chunk_content_into(chunk, &mut content)?;
                content.resize(current.max(e), 0);
                content[s..e].copy_from_slice(piece);
                let stored = self.store_chunk(chunk, &content, new_size);
                self.scratch = content;
                stored?;
            }
        }
        Ok(())
    }

    /// Grow the file to `size` with zeros, encoding them too (§4.4, case 4).
    pub(super) fn extend(&mut self, size: u64) -> std::result::Result<(), Fault> {
        let shift = self.ix.chunk_shift;
        let cs = self.ix.chunk_bytes();
        let old = self.ix.size;
        if offset_in_chunk(shift, old) != 0 {
            // Fill out the partial last chunk (as far as the new size reaches into it).
            let chunk = chunk_of(shift, old);
            let current = offset_in_chunk(shift, old) as usize;
            let target = (size - chunk_start(shift, chunk)).min(cs) as usize;
            let new_size = chunk_start(shift, chunk) + target as u64;
            if self.engine.fast_tails && (target as u64) < cs {
                self.append_tail(chunk, current as u32, &vec![0; target - current], new_size)?;
            } else {
                let mut content = self.chunk_content(chunk)?;
                content.resize(target, 0);
                self.store_chunk(chunk, &content, new_size)?;
            }
        }
        let first_hole = chunk_count(shift, self.ix.size);
        let full_end = chunk_of(shift, size);
        if full_end > first_hole {
            self.zero_run(first_hole, full_end - first_hole, None)?;
        }
        if size > self.ix.size {
            let chunk = chunk_of(shift, size);
            let zeros = vec![0; offset_in_chunk(shift, size) as usize];
            if self.engine.fast_tails {
                self.append_tail(chunk, 0, &zeros, size)?;
            } else {
                self.store_chunk(chunk, &zeros, size)?;
            }
        }
        Ok(())
    }

    /// Zero chunks `first..first + count` with `Run` records: one encoded zero chunk stands for
    /// each run. A deterministic codec shares one encoding among all runs; any other (a
    /// cipher) encodes one per run, bound to the run's place.
    /// `size`: the file's size the records leave, if not the end of the run (a run inside it).
    pub(super) fn zero_run(&mut self, first: u64, count: u64, size: Option<u64>) -> std::result::Result<(), Fault> {
        let shift = self.ix.chunk_shift;
        let shared = self.engine.codec.deterministic();
        let mut chunk = first;
        while chunk < first + count {
            let n = (first + count - chunk).min(u64::from(u32::MAX));
            let z = if shared {
                self.engine.zero_chunk(shift).map_err(|e| self.encode_failed(chunk, e))?
            } else {
                let place = self.place(chunk, n);
                Arc::new(self.engine.encode(&place, &vec![0; 1 << shift]).map_err(|e| self.encode_failed(chunk, e))?)
            };
            let header = RecordHeader {
                kind: Kind::Run,
                flags: if z.raw { FLAG_RAW } else { 0 },
                count: n as u32,
                decoded_len: 1 << shift,
                ..self.header_for(chunk, size.unwrap_or(chunk_start(shift, chunk + n)))
            };
            self.append_record(header, &z.payload)?;
            chunk += n;
        }
        Ok(())
    }

    /// Store a whole chunk encoded ahead of time.
    fn store_encoded(&mut self, chunk: u64, encoded: EncodedChunk, new_size: u64) -> std::result::Result<(), Fault> {
        let header =
            RecordHeader { kind: Kind::Data, count: 1, decoded_len: self.ix.chunk_bytes() as u32, ..self.header_for(chunk, new_size) };
        self.append_with(header, |out| {
            out.extend_from_slice(&encoded.payload);
            Ok(if encoded.raw { FLAG_RAW } else { 0 })
        })?;
        Ok(())
    }

    /// Store a chunk's whole content: encoded, or raw as the fast tail when it is the partial
    /// last chunk and fast tails are on.
    pub(super) fn store_chunk(&mut self, chunk: u64, content: &[u8], new_size: u64) -> std::result::Result<(), Fault> {
        let is_partial_last = (content.len() as u64) < self.ix.chunk_bytes() && chunk_of(self.ix.chunk_shift, new_size) == chunk;
        if self.engine.fast_tails && is_partial_last {
            return self.append_tail(chunk, 0, content, new_size);
        }
        let header = RecordHeader { kind: Kind::Data, count: 1, decoded_len: content.len() as u32, ..self.header_for(chunk, new_size) };
        let engine = self.engine.clone();
        let place = self.place(chunk, 1);
        let mut failure = None;
        let stored = self.append_with(header, |out| match engine.encode_into(&place, content, out) {
            Ok(raw) => Ok(if raw { FLAG_RAW } else { 0 }),
            Err(e) => {
                failure = Some(e);
                Err(plyfs_stack::Error::Os(libc::EIO)) // replaced below by the error naming the file
            }
        });
        if let Some(e) = failure {
            return Err(Fault::Fail(self.encode_failed(chunk, e)));
        }
        stored?;
        if is_partial_last {
            // Reuse the buffer of the chunk last kept.
            let mut kept = self.hot.take().map(|(_, _, v)| v).unwrap_or_default();
            kept.clear();
            kept.extend_from_slice(content);
            self.hot = Some((chunk, self.ix.next_seq - 1, kept));
        }
        Ok(())
    }

    pub(super) fn append_tail(&mut self, chunk: u64, keep: u32, bytes: &[u8], new_size: u64) -> std::result::Result<(), Fault> {
        let header = RecordHeader { kind: Kind::Tail, count: keep, decoded_len: bytes.len() as u32, ..self.header_for(chunk, new_size) };
        self.append_record(header, bytes)?;
        // Many small appends leave many fragments: fold them into one now and then.
        let fragments = self.ix.tail.as_ref().map_or(0, |t| t.fragments.len());
        if fragments > 64 {
            let content = self.tail_content()?;
            let t = self.ix.tail.as_ref().expect("just appended");
            let header = RecordHeader { kind: Kind::Tail, count: 0, decoded_len: content.len() as u32, ..self.header_for(t.chunk, self.ix.size) };
            self.append_record(header, &content)?;
        }
        Ok(())
    }

    /// Where a payload for chunks `chunk..chunk + count` belongs. The file gets its header
    /// (and identity) first if it has none yet.
    pub(super) fn place(&mut self, chunk: u64, count: u64) -> Place {
        self.start_file();
        Place { file_id: self.file_id, chunk, count }
    }

    /// End a modifying operation: write what is pending, compact if it is time. On a lower
    /// failure the index in memory may be ahead of the file, so it is reloaded.
    pub(super) fn finish<T>(&mut self, result: Result<T>) -> Result<T> {
        let result = result.and_then(|v| self.flush_pending().map(|()| v));
        match result {
            Ok(v) => {
                self.compact_if_due()?;
                Ok(v)
            }
            Err(e) => {
                self.pending.clear();
                if let Err(reload) = self.load() {
                    tracing::error!("{}: reloading the index after a failed write: {reload}", self.lower.describe());
                }
                Err(e)
            }
        }
    }
}
