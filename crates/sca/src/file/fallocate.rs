//! `fallocate`: room set aside in the file below for writing a range, and zeroing a range
//! (punching a hole).

use plyfs_stack::shared::LockKind;
use plyfs_stack::Result;

use crate::chunks::{chunk_bytes, chunk_start, chunks_touched, whole_chunks};
use crate::format::{record_bytes, DATA_START};

use super::{LowerIo, ScaFile, IO_WINDOW_BYTES};

impl<L: LowerIo> ScaFile<L> {
    /// `fallocate` of `length` bytes at `offset`: the file below sets aside room for a record of
    /// every chunk the range touches, at the most its codec can encode a chunk to (a write into
    /// a chunk writes the whole chunk again), for the checkpoint that lists them, and for the
    /// header if the file has none yet. Writing the range later then does not run out of space,
    /// and a request larger than the free space fails with `ENOSPC`, as on a kernel file system.
    pub fn reserve(&mut self, offset: u64, length: u64) -> Result<()> {
        let header = if self.header_on_disk { 0 } else { DATA_START };
        let need = reserve_bytes(self.ix.chunk_shift, offset, length, |n| self.engine.codec.max_payload(n));
        self.lower.reserve(need.saturating_add(header))
    }

    /// Zero `off..off + len` inside the file (hole punching).
    pub fn zero_range(&mut self, off: u64, len: u64) -> Result<()> {
        self.locked(LockKind::Exclusive, |f| {
            let end = (off + len).min(f.size());
            let shift = f.ix.chunk_shift;
            // The chunks the range covers whole become a run of zero chunks, as a truncate's
            // zeros do: a hole to SEEK_HOLE, and no data to store (xfstests generic/539).
            let whole = whole_chunks(shift, off, end);
            let (first, last) = (whole.start, whole.end);
            let (whole_from, whole_to) =
                if f.padded || last <= first { (end, end) } else { (chunk_start(shift, first), chunk_start(shift, last)) };
            let zeros = |f: &mut Self, from: u64, to: u64| -> Result<()> {
                let mut at = from;
                while at < to {
                    let n = (to - at).min(IO_WINDOW_BYTES);
                    f.write_now(at, &vec![0; n as usize])?;
                    at += n;
                }
                Ok(())
            };
            zeros(f, off, whole_from)?;
            if whole_to > whole_from {
                let size = f.ix.size;
                let result = f.with_rebuild(|f| {
                    for chunk in first..last {
                        f.lost.remove(&chunk);
                    }
                    f.zero_run(first, last - first, Some(size))
                });
                f.finish(result)?;
            }
            zeros(f, whole_to, end)
        })
    }
}

/// The bytes of the file below that writing `length` bytes at `offset` may take: a record for
/// each chunk (of `1 << shift` bytes) the range touches, with the largest payload
/// `max_payload` allows for a chunk, and a checkpoint record naming each of them apart.
pub fn reserve_bytes(shift: u8, offset: u64, length: u64, max_payload: impl Fn(usize) -> usize) -> u64 {
    /// A checkpoint's bytes per extent, at the most: varints of the chunk gap and count, and the
    /// record's place, length and sequence.
    const CHECKPOINT_EXTENT_BYTES: u64 = 48;
    if length == 0 {
        return 0;
    }
    let touched = chunks_touched(shift, offset, length);
    let chunks = touched.end - touched.start;
    let payload = u32::try_from(max_payload(chunk_bytes(shift) as usize)).unwrap_or(u32::MAX);
    let checkpoint = u32::try_from(chunks.saturating_mul(CHECKPOINT_EXTENT_BYTES).saturating_add(64)).unwrap_or(u32::MAX);
    chunks.saturating_mul(record_bytes(payload)).saturating_add(record_bytes(checkpoint))
}
