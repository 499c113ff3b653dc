//! A lower file as a writer would leave it after writing a file front to back in one go, made
//! up on demand: header, one `Data` record per chunk, a checkpoint, and the slot naming it.
//! Every record's place follows from the decoded size alone, so any byte range of the file can
//! be produced from the chunks it covers, without the rest. A reverse view (plaintext below,
//! encoded file shown) serves its files this way; what it shows is read by an ordinary
//! [`crate::ScaFile`].
//!
//! Each payload is its chunk plus a fixed number of bytes (a cipher's nonce, kind byte and
//! tag), so payload lengths are known before any chunk is encoded.

use crate::chunks;
use crate::Error;
use crate::format::*;

/// The layout of one file written sequentially.
#[derive(Clone, Copy, Debug)]
pub struct Sequential {
    /// The decoded size.
    pub size: u64,
    pub chunk_shift: u8,
    /// Bytes each payload has beyond its chunk.
    pub overhead: u32,
    pub codec: [u8; 4],
    pub file_id: Option<[u8; 16]>,
}

fn varint_len(v: u64) -> u64 {
    (64 - v.max(1).leading_zeros() as u64).div_ceil(7)
}

impl Sequential {
    pub fn chunk_bytes(&self) -> u64 {
        chunks::chunk_bytes(self.chunk_shift)
    }

    pub fn chunks(&self) -> u64 {
        chunks::chunk_count(self.chunk_shift, self.size)
    }

    /// The decoded length of chunk `i`.
    pub fn chunk_len(&self, i: u64) -> u64 {
        chunks::chunk_len(self.chunk_shift, self.size, i)
    }

    fn payload_len(&self, i: u64) -> u64 {
        self.chunk_len(i) + u64::from(self.overhead)
    }

    fn full_record(&self) -> u64 {
        record_bytes((self.chunk_bytes() + u64::from(self.overhead)) as u32)
    }

    /// Where chunk `i`'s record starts.
    pub fn record_off(&self, i: u64) -> u64 {
        DATA_START + i * self.full_record()
    }

    /// Where the checkpoint record starts.
    pub fn index_off(&self) -> u64 {
        match self.chunks() {
            0 => DATA_START,
            n => self.record_off(n - 1) + record_bytes(self.payload_len(n - 1) as u32),
        }
    }

    /// The length of the checkpoint's payload (see [`crate::index::FileIndex::checkpoint_payload`]):
    /// version, size, extent count, five bytes and two lengths per chunk, and "no tail".
    fn index_payload_len(&self) -> u64 {
        let n = self.chunks();
        let mut len = 1 + varint_len(self.size) + varint_len(n) + 1;
        if n > 0 {
            let full = 5 + varint_len(self.payload_len(0)) + varint_len(self.chunk_len(0));
            let last = 5 + varint_len(self.payload_len(n - 1)) + varint_len(self.chunk_len(n - 1));
            len += (n - 1) * full + last;
        }
        len
    }

    /// The length of the whole file: nothing at all for an empty file.
    pub fn len(&self) -> u64 {
        if self.size == 0 {
            return 0;
        }
        self.index_off() + record_bytes(self.index_payload_len() as u32)
    }

    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    fn index_seq(&self) -> u64 {
        self.chunks() + 1
    }

    /// The file header and the slot in force ([`DATA_START`] bytes).
    fn head(&self) -> Vec<u8> {
        let mut b = vec![0u8; DATA_START as usize];
        let header = FileHeader { codec: self.codec, chunk_shift: self.chunk_shift, file_id: self.file_id, flags: 0 };
        b[..FILE_HEADER_BYTES as usize].copy_from_slice(&header.encode());
        let slot = Slot {
            slot_seq: 1,
            file_size: self.size,
            covered_seq: self.index_seq(),
            log_end: self.len(),
            checkpoint_off: self.index_off(),
            checkpoint_seq: self.index_seq(),
        };
        let at = Slot::offset_for(1) as usize;
        b[at..at + SLOT_BYTES as usize].copy_from_slice(&slot.encode());
        b
    }

    fn record_header(&self, i: u64) -> RecordHeader {
        RecordHeader {
            kind: Kind::Data,
            flags: 0,
            chunk_shift: self.chunk_shift,
            seq: i + 1,
            chunk: i,
            count: 1,
            decoded_len: self.chunk_len(i) as u32,
            payload_len: 0,
            payload_crc: 0,
            file_size: chunks::chunk_start(self.chunk_shift, i + 1).min(self.size),
        }
    }

    /// The checkpoint's payload in pieces: the start, one entry per full chunk (all alike), the
    /// last chunk's entry, and the end (see [`crate::index::FileIndex::checkpoint_payload`]).
    fn index_parts(&self) -> (Vec<u8>, Vec<u8>, u64, Vec<u8>) {
        let n = self.chunks();
        let mut head = Vec::new();
        varint::put(&mut head, 1);
        varint::put(&mut head, self.size);
        varint::put(&mut head, n);
        let entry = |i: u64| {
            // No gap before the extent, one chunk, a Data record where the one before ended, one
            // sequence number on.
            let mut e = vec![0, 1, Kind::Data as u8, 0, 2];
            varint::put(&mut e, self.payload_len(i));
            varint::put(&mut e, self.chunk_len(i));
            e
        };
        let (full, last) = if n == 0 { (Vec::new(), Vec::new()) } else { (entry(0), entry(n - 1)) };
        let mut tail = last;
        tail.push(0); // no fast tail
        (head, full, n.saturating_sub(1), tail)
    }

    /// The bytes `from..to` of the checkpoint record, made without the rest of it: a file of a
    /// terabyte has a checkpoint of gigabytes.
    fn index_record_range(&self, from: u64, to: u64) -> Vec<u8> {
        let (head, full, repeats, tail) = self.index_parts();
        let f = full.len() as u64;
        let payload_len = head.len() as u64 + f * repeats + tail.len() as u64;
        debug_assert_eq!(payload_len, self.index_payload_len());
        let mut crc = crc32fast::Hasher::new();
        crc.update(&head);
        crc.combine(&repeated_crc(&full, repeats));
        let mut t = crc32fast::Hasher::new();
        t.update(&tail);
        crc.combine(&t);
        let header = RecordHeader {
            kind: Kind::Index,
            chunk: 0,
            count: 0,
            decoded_len: 0,
            seq: self.index_seq(),
            file_size: self.size,
            payload_len: payload_len as u32,
            payload_crc: crc.finalize(),
            ..self.record_header(0)
        };
        let header = header.encode();
        let total = record_bytes(payload_len as u32);
        let byte = |k: u64| -> u8 {
            if k < RECORD_HEADER_BYTES {
                return header[k as usize];
            }
            let p = k - RECORD_HEADER_BYTES;
            let h = head.len() as u64;
            if p < h {
                head[p as usize]
            } else if p < h + f * repeats {
                full[((p - h) % f) as usize]
            } else if p < payload_len {
                tail[(p - h - f * repeats) as usize]
            } else {
                0 // alignment
            }
        };
        (from..to.min(total)).map(byte).collect()
    }

    /// The chunks whose records overlap `off..off + len`.
    pub fn chunks_overlapping(&self, off: u64, len: u64) -> std::ops::Range<u64> {
        let n = self.chunks();
        let end = (off + len).min(self.index_off());
        if len == 0 || off >= end {
            return 0..0;
        }
        let first = off.saturating_sub(DATA_START) / self.full_record();
        let last = (end - 1).saturating_sub(DATA_START) / self.full_record();
        first.min(n)..(last + 1).min(n)
    }

    /// The bytes at `off..off + len` (fewer at the end). `payload` appends the payload of the
    /// chunk it is given to its buffer; it is called for the chunks of
    /// [`Sequential::chunks_overlapping`], in order.
    pub fn read_at(&self, off: u64, len: u64, mut payload: impl FnMut(u64, &mut Vec<u8>) -> Result<(), Error>) -> Result<Vec<u8>, Error> {
        let total = self.len();
        let end = (off + len).min(total);
        let mut out = Vec::with_capacity(end.saturating_sub(off) as usize);
        if off >= end {
            return Ok(out);
        }
        let mut copy = |at: u64, bytes: &[u8]| {
            let (s, e) = (at.max(off), (at + bytes.len() as u64).min(end));
            if s < e {
                debug_assert_eq!(out.len() as u64, s - off, "pieces come in order");
                out.extend_from_slice(&bytes[(s - at) as usize..(e - at) as usize]);
            }
        };
        if off < DATA_START {
            copy(0, &self.head());
        }
        let mut record = Vec::new();
        for i in self.chunks_overlapping(off, end - off) {
            record.clear();
            let start = begin_record(&mut record);
            payload(i, &mut record)?;
            let got = record.len() - start - RECORD_HEADER_BYTES as usize;
            if got as u64 != self.payload_len(i) {
                return Err(Error::PayloadLength { chunk: i, got, expected: self.payload_len(i) });
            }
            finish_record(self.record_header(i), &mut record, start);
            copy(self.record_off(i), &record);
        }
        let index = self.index_off();
        if end > index {
            let from = off.max(index);
            copy(from, &self.index_record_range(from - index, end - index));
        }
        Ok(out)
    }
}

/// The CRC-32 state of `block` repeated `times` times, by doubling: O(log times) combines.
fn repeated_crc(block: &[u8], times: u64) -> crc32fast::Hasher {
    let mut result = crc32fast::Hasher::new();
    let mut power = crc32fast::Hasher::new();
    power.update(block);
    let mut t = times;
    while t > 0 {
        if t & 1 == 1 {
            result.combine(&power);
        }
        let p = power.clone();
        power.combine(&p);
        t >>= 1;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{Codec, Place};
    use crate::file::{Engine, ScaFile};
    use crate::index::FileIndex;
    use crate::mem::MemLower;
    use std::sync::Arc;

    /// A codec whose payload is a fixed prefix, the chunk reversed, and a suffix.
    struct Framed;

    impl Codec for Framed {
        fn tag(&self) -> [u8; 4] {
            *b"test"
        }
        fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
            out.extend_from_slice(b"<<");
            out.extend(chunk.iter().rev());
            out.extend_from_slice(b">>>");
            Ok(())
        }
        fn decode(&self, e: &[u8], n: usize, out: &mut Vec<u8>) -> Result<(), Error> {
            if e.len() != n + 5 || !e.starts_with(b"<<") || !e.ends_with(b">>>") {
                return Err(Error::decode("not framed"));
            }
            out.extend(e[2..e.len() - 3].iter().rev());
            Ok(())
        }
        fn plaintext_safe(&self) -> bool {
            false
        }
        fn deterministic(&self) -> bool {
            false
        }
        fn new_file_id(&self) -> Option<[u8; 16]> {
            Some([7; 16])
        }
        fn encode_at(&self, p: &Place, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
            assert_eq!(p.file_id, [7; 16]);
            self.encode(chunk, out)
        }
    }

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 4096) as u8).collect()
    }

    fn layout(size: u64) -> Sequential {
        Sequential { size, chunk_shift: 12, overhead: 5, codec: *b"test", file_id: Some([7; 16]) }
    }

    fn whole(s: &Sequential, d: &[u8]) -> Vec<u8> {
        s.read_at(0, s.len(), |i, out| {
            let c = &d[(i << 12) as usize..][..s.chunk_len(i) as usize];
            Framed.encode(c, out)
        })
        .unwrap()
    }

    #[test]
    fn a_made_up_file_opens_with_its_checkpoint_and_reads_back() {
        for size in [1u64, 100, 4095, 4096, 4097, 8192, 70_000, 1 << 20, (1 << 20) + 3] {
            let d = data(size as usize);
            let s = layout(size);
            let bytes = whole(&s, &d);
            assert_eq!(bytes.len() as u64, s.len(), "size {size}");
            // The checkpoint is what the index code itself would write for these records.
            let mut ix = FileIndex::new(12);
            for i in 0..s.chunks() {
                let h = RecordHeader { payload_len: s.payload_len(i) as u32, ..s.record_header(i) };
                ix.apply(s.record_off(i), &h, &[]).unwrap();
            }
            let idx = RecordHeader::decode(&bytes[s.index_off() as usize..]).unwrap();
            let at = (s.index_off() + RECORD_HEADER_BYTES) as usize;
            assert_eq!(&bytes[at..at + idx.payload_len as usize], &ix.checkpoint_payload()[..], "size {size}");
            let engine = Arc::new(Engine::new("test", Arc::new(Framed), 12, false));
            let lower = MemLower::default();
            *lower.0.lock() = bytes.clone();
            let f = ScaFile::open(engine, lower.clone()).unwrap();
            assert_eq!(f.size(), size);
            assert!(f.read(0, size as usize).map_err(|_| ()).unwrap() == d, "size {size}");
            assert_eq!(*lower.0.lock(), bytes, "opening and reading wrote nothing");
        }
    }

    #[test]
    fn the_checkpoint_is_made_piecewise_as_it_would_be_whole() {
        for size in [1u64, 4096, 4097, 1 << 20, (7 << 20) + 5] {
            let s = layout(size);
            let (head, full, repeats, tail) = s.index_parts();
            let mut payload = head.clone();
            for _ in 0..repeats {
                payload.extend_from_slice(&full);
            }
            payload.extend_from_slice(&tail);
            let whole = {
                let h = RecordHeader { kind: Kind::Index, chunk: 0, count: 0, decoded_len: 0, seq: s.index_seq(), file_size: size, ..s.record_header(0) };
                let mut out = Vec::new();
                build_record(h, &payload, &mut out);
                out
            };
            assert_eq!(s.index_record_range(0, whole.len() as u64), whole, "size {size}");
            assert_eq!(s.index_record_range(7, 300), whole[7..300.min(whole.len())], "size {size}");
        }
        // A terabyte's checkpoint (2.4 GB) is never made whole: its last bytes come alone.
        let big = layout(1 << 40);
        let end = big.len() - big.index_off();
        assert_eq!(big.index_record_range(end - 8, end + 8).len(), 8);
    }

    #[test]
    fn any_range_matches_the_whole() {
        let d = data(50_000);
        let s = layout(50_000);
        let all = whole(&s, &d);
        for (off, len) in [(0, 1), (0, 300), (255, 2), (256, 4200), (4000, 9000), (s.index_off() - 3, 10), (s.len() - 1, 100), (s.len(), 5)] {
            let part = s
                .read_at(off, len, |i, out| Framed.encode(&d[(i << 12) as usize..][..s.chunk_len(i) as usize], out))
                .unwrap();
            let want = &all[(off as usize).min(all.len())..((off + len) as usize).min(all.len())];
            assert_eq!(part, want, "{off}+{len}");
        }
        assert!(layout(0).is_empty());
        assert_eq!(layout(0).len(), 0);
        let short = s.read_at(0, 10_000, |_, out| {
            out.push(1);
            Ok(())
        });
        assert!(short.unwrap_err().to_string().contains("encoded to 1 bytes"));
    }
}
