//! The in-memory index proper: which record holds each upper chunk.
//!
//! Chunks are kept as extents (first chunk, count, record) so that a hole of a million zero
//! chunks, written as one `Run` record, costs one entry rather than a million.

use std::collections::BTreeMap;

use crate::format::{record_bytes, Kind};

/// Where one encoded chunk (or run of chunks) lives in the lower file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RecordRef {
    pub off: u64,
    pub seq: u64,
    pub kind: Kind,
    /// The payload is the chunk itself (see [`crate::format::FLAG_RAW`]).
    pub raw: bool,
    pub payload_len: u32,
    pub decoded_len: u32,
}

impl RecordRef {
    /// The bytes the record takes in the log.
    pub fn bytes(&self) -> u64 {
        record_bytes(self.payload_len)
    }

    /// One past the record's last byte in the log: where the record after it starts.
    pub fn end(&self) -> u64 {
        self.off + self.bytes()
    }
}

/// A map from chunk number to the record that holds it.
#[derive(Clone, Debug, Default)]
pub struct ChunkMap {
    /// First chunk → (number of chunks, record).
    extents: BTreeMap<u64, (u64, RecordRef)>,
}

/// Chunks that no longer point at a record after an update: (record, how many of its chunks).
pub type Displaced = Vec<(RecordRef, u64)>;

impl ChunkMap {
    pub fn get(&self, chunk: u64) -> Option<RecordRef> {
        let (first, (count, rec)) = self.extents.range(..=chunk).next_back()?;
        (chunk < first + count).then_some(*rec)
    }

    /// One past the last chunk of the run of zero chunks (a `Run` record, a hole) that holds
    /// `chunk`, if one does.
    pub fn run_end(&self, chunk: u64) -> Option<u64> {
        let (first, (count, rec)) = self.extents.range(..=chunk).next_back()?;
        (chunk < first + count && rec.kind == Kind::Run).then_some(first + count)
    }

    /// Point chunks `first..first + count` at `rec`.
    pub fn set(&mut self, first: u64, count: u64, rec: RecordRef) -> Displaced {
        let displaced = self.remove_range(first, first + count);
        self.extents.insert(first, (count, rec));
        displaced
    }

    /// Take chunk `chunk` out of the map.
    pub fn remove(&mut self, chunk: u64) -> Displaced {
        self.remove_range(chunk, chunk + 1)
    }

    /// Drop every chunk from `chunks` on.
    pub fn truncate(&mut self, chunks: u64) -> Displaced {
        self.remove_range(chunks, u64::MAX)
    }

    fn remove_range(&mut self, start: u64, end: u64) -> Displaced {
        // Nothing mapped from `start` on (a file written from start to end, one chunk after
        // another): the last extent says so without a search.
        if self.extents.last_key_value().is_none_or(|(first, (count, _))| first + count <= start) {
            return Vec::new();
        }
        let mut displaced = Vec::new();
        let overlapping: Vec<u64> = self
            .extents
            .range(..end)
            .rev()
            .take_while(|(first, (count, _))| *first + *count > start)
            .map(|(first, _)| *first)
            .collect();
        for first in overlapping {
            let (count, rec) = self.extents.remove(&first).expect("just listed");
            let last = first + count;
            if first < start {
                self.extents.insert(first, (start - first, rec));
            }
            if last > end {
                self.extents.insert(end, (last - end, rec));
            }
            displaced.push((rec, last.min(end) - first.max(start)));
        }
        displaced
    }

    /// Extents in chunk order: (first chunk, count, record).
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, RecordRef)> + '_ {
        self.extents.iter().map(|(first, (count, rec))| (*first, *count, *rec))
    }

    /// One past the highest mapped chunk.
    pub fn end(&self) -> u64 {
        self.extents.iter().next_back().map_or(0, |(first, (count, _))| first + count)
    }

    /// How many chunks are mapped.
    pub fn mapped(&self) -> u64 {
        self.extents.values().map(|(count, _)| count).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.extents.is_empty()
    }

    /// Follow records that compaction moved (old offset → new offset).
    pub fn relocate(&mut self, moved: &std::collections::HashMap<u64, u64>) {
        for (_, rec) in self.extents.values_mut() {
            if let Some(to) = moved.get(&rec.off) {
                rec.off = *to;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{RECORD_ALIGN, RECORD_HEADER_BYTES};
    use proptest::prelude::*;

    fn rec(off: u64) -> RecordRef {
        RecordRef { off, seq: off, kind: Kind::Data, raw: false, payload_len: 10, decoded_len: 4096 }
    }

    #[test]
    fn runs_split_around_an_update() {
        let mut m = ChunkMap::default();
        m.set(0, 100, rec(1));
        let d = m.set(50, 1, rec(2));
        assert_eq!(d, vec![(rec(1), 1)]);
        assert_eq!(m.get(49), Some(rec(1)));
        assert_eq!(m.get(50), Some(rec(2)));
        assert_eq!(m.get(51), Some(rec(1)));
        assert_eq!(m.get(100), None);
        assert_eq!(m.mapped(), 100);
        let d = m.truncate(60);
        assert_eq!(d, vec![(rec(1), 40)]);
        assert_eq!(m.end(), 60);
    }

    #[test]
    fn a_run_of_zero_chunks_is_a_hole_to_its_end() {
        let mut m = ChunkMap::default();
        m.set(0, 1, rec(1));
        m.set(1, 1000, RecordRef { kind: Kind::Run, ..rec(2) });
        m.set(500, 1, rec(3));
        assert_eq!(m.run_end(0), None, "data");
        assert_eq!(m.run_end(1), Some(500));
        assert_eq!(m.run_end(499), Some(500));
        assert_eq!(m.run_end(500), None, "data written into the run");
        assert_eq!(m.run_end(501), Some(1001));
        assert_eq!(m.run_end(1001), None, "past the map");
    }

    proptest! {
        /// A record ends where the next may start: after its header and payload, on the record
        /// alignment.
        #[test]
        fn a_record_ends_after_its_payload_aligned(off in (0u64..1 << 50).prop_map(|o| o * RECORD_ALIGN), payload_len in any::<u32>()) {
            let r = RecordRef { off, payload_len, ..rec(0) };
            let unaligned_end = off + RECORD_HEADER_BYTES + u64::from(payload_len);
            prop_assert_eq!(r.end() - r.off, r.bytes());
            prop_assert!(unaligned_end <= r.end() && r.end() < unaligned_end + RECORD_ALIGN);
            prop_assert_eq!(r.end() % RECORD_ALIGN, 0);
        }

        /// The extent map agrees with a plain per-chunk vector under any sequence of updates,
        /// and what it reports as displaced is exactly what the vector lost.
        #[test]
        fn matches_a_plain_vector(ops in proptest::collection::vec((0u64..64, 1u64..20, any::<bool>()), 1..60)) {
            let mut m = ChunkMap::default();
            let mut v: Vec<Option<u64>> = vec![None; 128];
            for (i, (first, count, cut)) in ops.into_iter().enumerate() {
                let off = i as u64 + 1;
                if cut {
                    let d = m.truncate(first);
                    let lost: u64 = v[first as usize..].iter().filter(|x| x.is_some()).count() as u64;
                    prop_assert_eq!(d.iter().map(|(_, n)| n).sum::<u64>(), lost);
                    for x in &mut v[first as usize..] { *x = None; }
                } else {
                    let d = m.set(first, count, rec(off));
                    let lost = v[first as usize..(first + count) as usize].iter().filter(|x| x.is_some()).count() as u64;
                    prop_assert_eq!(d.iter().map(|(_, n)| n).sum::<u64>(), lost);
                    for x in &mut v[first as usize..(first + count) as usize] { *x = Some(off); }
                }
                for (c, want) in v.iter().enumerate() {
                    prop_assert_eq!(m.get(c as u64).map(|r| r.off), *want);
                }
                prop_assert_eq!(m.mapped(), v.iter().filter(|x| x.is_some()).count() as u64);
            }
        }
    }
}
