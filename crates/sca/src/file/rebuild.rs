//! Rebuilding the index from the records alone when it is missing or inconsistent (Fast
//! Indexing §5). Chunks whose newest record is gone become lost: EIO, never stale data.

use std::collections::BTreeSet;

use plyfs_stack::shared::LockKind;
use plyfs_stack::{Error, Result};
use serde_json::{json, Value};

use crate::chunks::chunk_start;
use crate::format::{FileHeader, Kind, RecordHeader, Slot, DATA_START, PAD_TRAILER_BYTES};
use crate::index::FileIndex;

use super::pad::parse_trailer;
use super::{fault_to_error, Fault, LowerIo, ScaFile};

impl<L: LowerIo> ScaFile<L> {
    /// The file header is unreadable: rebuild from the records if there are any, else this is
    /// not an encoded file.
    pub(super) fn rebuild_without_header(&mut self, len: u64) -> Result<()> {
        let mut shift = None;
        self.scan(DATA_START, len, true, |_, h, _, _| {
            shift.get_or_insert(h.chunk_shift);
        })
        .map_err(|f| fault_to_error(&self.lower, f))?;
        match shift {
            Some(shift) => {
                tracing::warn!("{}: the file header is damaged; rebuilding it and the index from the data", self.lower.describe());
                // Whether the file was padded went with the header: its trailer tells.
                self.padded = false;
                self.rebuild(shift, None)?;
                let n = self.ix.size;
                if n >= PAD_TRAILER_BYTES {
                    let trailer = self.read_stored(n - PAD_TRAILER_BYTES, PAD_TRAILER_BYTES as usize);
                    if trailer.is_ok_and(|t| parse_trailer(&t, n).is_ok()) {
                        self.padded = true;
                        self.forget_real_size();
                        if self.lower.writable() {
                            self.write_lower(0, &self.header(shift).encode())?;
                        }
                    }
                }
                Ok(())
            }
            None => Err(Error::Corrupt(format!(
                "{}: not a '{}' file (no plyfs header); convert existing files with `plyfs encode`",
                self.lower.describe(),
                self.engine.kind
            ))),
        }
    }

    /// Rebuild the index from the records alone (Fast Indexing §5), replaying every valid
    /// record in sequence order. Chunks whose newest record is gone, judged against `known`
    /// (the index in memory) or else the newest checkpoint found, become lost: EIO, not stale
    /// data.
    pub(super) fn rebuild(&mut self, shift: u8, known: Option<&FileIndex>) -> Result<()> {
        if self.read_locked {
            // Other mounts may be reading too: the repair waits for the write lock.
            self.needs_write_lock = true;
            return Err(Error::Os(libc::EAGAIN));
        }
        // From the file as it is now: the bytes read at open may be of a file since replaced.
        self.drop_prefetched();
        let len = self.lower.len()?;
        let mut found: Vec<(RecordHeader, u64, Vec<u8>, bool)> = Vec::new();
        self.scan(DATA_START, len, true, |off, h, payload, ok| {
            if h.chunk_shift == shift {
                let keep = matches!(h.kind, Kind::Tail | Kind::Index);
                found.push((*h, off, if keep { payload.to_vec() } else { Vec::new() }, ok));
            }
        })
        .map_err(|f| fault_to_error(&self.lower, f))?;
        let sound = found.iter().any(|(_, _, _, ok)| *ok);
        if !sound && self.lower.read_at(0, DATA_START as usize).ok().and_then(|h| FileHeader::decode(&h)).is_none() {
            // Neither a header nor a sound record: the file is no longer an encoded file
            // (rewritten in place from outside the mount, say). Nothing to rebuild, and its
            // bytes are not ours to overwrite.
            return Err(Error::Corrupt(format!(
                "{}: not a '{}' file any more (no plyfs header, no records): it was rewritten from outside the mount",
                self.lower.describe(),
                self.engine.kind
            )));
        }
        // Compaction may leave copies of a record: keep one, a sound one if there is one.
        found.sort_by_key(|(h, off, _, ok)| (h.seq, !*ok, *off));
        found.dedup_by_key(|(h, _, _, _)| h.seq);

        let newest_checkpoint = found
            .iter()
            .rev()
            .filter(|(h, _, _, ok)| h.kind == Kind::Index && *ok)
            .find_map(|(h, off, payload, _)| FileIndex::from_checkpoint(shift, *off, h, payload).ok());
        let bound = known.cloned().or(newest_checkpoint);
        // The slot in force, if readable, says how far the log went and how large the file was.
        let slot = self.lower.read_at(0, DATA_START as usize).ok().and_then(|head| Slot::newest_in(&head));

        let mut ix = FileIndex::new(shift);
        let mut lost = BTreeSet::new();
        for (h, off, payload, ok) in &found {
            if h.kind == Kind::Index {
                ix.log_end = ix.log_end.max(off + h.bytes());
                ix.next_seq = ix.next_seq.max(h.seq + 1);
                continue;
            }
            let zeros;
            let payload = if *ok || h.kind != Kind::Tail {
                payload.as_slice()
            } else {
                lost.insert(h.chunk);
                zeros = vec![0; h.payload_len as usize];
                zeros.as_slice()
            };
            if let Err(e) = ix.apply(*off, h, payload) {
                tracing::warn!("{}: skipping record at {off}: {e}", self.lower.describe());
            }
        }
        ix.checkpoint = None;
        let cut = slot.filter(|s| s.covered_seq >= ix.next_seq && s.file_size > ix.size);
        if let Some(s) = cut {
            // Records the slot vouches for are gone (the file was cut): the end of the file is
            // lost, not silently shorter.
            tracing::warn!(
                "{}: the log ends before record {}: the file was {} bytes, its records reach {}",
                self.lower.describe(),
                s.covered_seq,
                s.file_size,
                ix.size
            );
            let old_chunks = ix.chunks();
            ix.extend_without_data(s.file_size);
            // A chunk the records leave shorter than the vouched size needs was completed by a
            // record that is gone.
            for chunk in old_chunks.saturating_sub(1)..ix.chunks() {
                let have = match ix.tail.as_ref().filter(|t| t.chunk == chunk) {
                    Some(t) => t.len(),
                    None => ix.map.get(chunk).map_or(0, |r| u64::from(r.decoded_len)),
                };
                if have < ix.chunk_len(chunk) {
                    lost.insert(chunk);
                }
            }
        }
        if let Some(bound) = &bound {
            for chunk in 0..ix.chunks().min(bound.chunks()) {
                if newest_seq(&ix, chunk) < newest_seq(bound, chunk) {
                    lost.insert(chunk);
                }
            }
        }
        for chunk in 0..ix.chunks() {
            let has_data = ix.map.get(chunk).is_some() || ix.tail.as_ref().is_some_and(|t| t.chunk == chunk);
            if !has_data {
                lost.insert(chunk);
            }
        }
        lost.retain(|c| *c < ix.chunks());
        if !lost.is_empty() {
            tracing::error!(
                "{}: the newest data of {} chunk(s) is missing or damaged (first at offset {}); they read as I/O errors until rewritten",
                self.lower.describe(),
                lost.len(),
                lost.first().map_or(0, |&c| chunk_start(shift, c))
            );
        }
        self.replace_index(ix);
        self.lost = lost;
        self.header_on_disk = true;
        if self.lower.writable() {
            self.drop_prefetched();
            if self.ix.log_end < len {
                self.set_lower_len(self.ix.log_end)?;
            }
            self.write_lower(0, &self.header(shift).encode())?;
            // A cut log keeps the slot that vouches for what is gone, so that every open finds
            // the damage again (until the lost chunks are rewritten, which records the size).
            if cut.is_none() {
                self.write_checkpoint()?;
                // Both slots, so that no older slot can name an older checkpoint.
                self.write_slot()?;
            }
            self.lower.sync()?;
        }
        tracing::warn!(
            "{}: index rebuilt from {} records: {} bytes in {} chunks",
            self.lower.describe(),
            found.len(),
            self.ix.size,
            self.ix.chunks()
        );
        Ok(())
    }

    /// Run `op`, rebuilding the index once if it turns out stale.
    pub(super) fn with_rebuild<T>(&mut self, mut op: impl FnMut(&mut Self) -> std::result::Result<T, Fault>) -> Result<T> {
        match op(self) {
            Ok(v) => Ok(v),
            Err(Fault::Fail(e)) => Err(e),
            Err(Fault::Stale(why)) => {
                // Records already appended by the failed attempt are valid: keep them.
                self.flush_pending()?;
                tracing::warn!("{}: the index is inconsistent ({why}); rebuilding it from the data", self.lower.describe());
                let known = self.ix.clone();
                self.rebuild(self.ix.chunk_shift, Some(&known))?;
                op(self).map_err(|f| match f {
                    Fault::Fail(e) => e,
                    Fault::Stale(why) => Error::Corrupt(format!("{}: {why}", self.lower.describe())),
                })
            }
        }
    }

    /// Rebuild the index from the data, whatever state it is in.
    pub fn recover_index(&mut self) -> Result<Value> {
        self.locked(LockKind::Exclusive, |f| f.recover_index_now())
    }

    fn recover_index_now(&mut self) -> Result<Value> {
        self.flush_pending()?;
        let known = self.ix.clone();
        self.rebuild(self.ix.chunk_shift, Some(&known))?;
        Ok(json!({ "size": self.ix.size, "chunks": self.ix.chunks(), "lost_chunks": self.lost.len() }))
    }
}

/// The newest record sequence number behind `chunk` in `ix`.
fn newest_seq(ix: &FileIndex, chunk: u64) -> u64 {
    if let Some(t) = ix.tail.as_ref().filter(|t| t.chunk == chunk) {
        return t.fragments.iter().map(|f| f.seq).max().unwrap_or(0);
    }
    ix.map.get(chunk).map_or(0, |r| r.seq)
}
