//! The lower file format: one self-describing file per upper file.
//!
//! ```text
//! 0      file header: magic, codec tag, chunk size            (FILE_HEADER_BYTES)
//! 64     slot A ┐ the latest valid one says where the newest   (SLOT_BYTES each)
//! 128    slot B ┘ checkpoint is, the decoded size, the log end
//! 256    record, record, ...                                   (each 8-byte aligned)
//! ```
//!
//! Records form a log. Each one carries a sequence number, the chunk it describes, the decoded
//! file size after it was written, and CRCs of its header and payload; that framing is what lets
//! the index be rebuilt from the data alone (Fast Indexing §5). Kinds:
//!
//! - `Data`: one chunk, encoded (or stored raw when the codec could not shrink it);
//! - `Run`: `count` consecutive chunks that all decode from the same payload (zeros of a hole);
//! - `Tail`: a fast tail (§4.2): raw bytes; the chunk becomes its first `keep` bytes followed
//!   by the payload;
//! - `Size`: the file was cut at a chunk boundary;
//! - `Index`: a checkpoint of the whole index (see [`crate::index`]).
//!
//! The index therefore lives inside the data file (the "interspersed data" option of
//! `seeds/002` §5.1): no second name can clash with a user's file, rename, link and unlink keep
//! the two together for free, and the lower file system's own per-file consistency covers both.

/// Magic at offset 0 of every encoded file.
pub const FILE_MAGIC: [u8; 8] = *b"PLYSCA\x00\x01";
/// Magic at the start of every record.
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"PLYR");
pub const FORMAT_VERSION: u8 = 1;

pub const FILE_HEADER_BYTES: u64 = 64;
pub const SLOT_BYTES: u64 = 64;
pub const SLOT_OFFSETS: [u64; 2] = [64, 128];
/// Where the first record starts.
pub const DATA_START: u64 = 256;
pub const RECORD_HEADER_BYTES: u64 = 56;
pub const RECORD_ALIGN: u64 = 8;

pub const MIN_CHUNK_SHIFT: u8 = 12;
pub const MAX_CHUNK_SHIFT: u8 = 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Data = 1,
    Run = 2,
    Tail = 3,
    Size = 4,
    Index = 5,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Data,
            2 => Kind::Run,
            3 => Kind::Tail,
            4 => Kind::Size,
            5 => Kind::Index,
            _ => return None,
        })
    }
}

/// Record flag: the payload is the chunk itself, because encoding did not make it smaller.
pub const FLAG_RAW: u8 = 1;
const KNOWN_RECORD_FLAGS: u8 = FLAG_RAW;

fn crc(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Whether `head`, the first bytes of a lower file, is the start of a file in this format: it
/// begins with [`FILE_MAGIC`], or (its header damaged) the first record at [`DATA_START`] has a
/// sound header (magic and CRC). Whatever else is wrong with such a file, it is an encoded file,
/// and the layer repairs or refuses it; a file that passes neither check is plain. A plain file
/// passes only if it holds one of these by chance (8 given bytes, or 4 and a matching CRC-32):
/// a copy of an encoded lower file, which is one.
pub fn looks_encoded(head: &[u8]) -> bool {
    let first_record = head.get(DATA_START as usize..).and_then(RecordHeader::decode);
    head.starts_with(&FILE_MAGIC) || first_record.is_some()
}

/// Round up to the record alignment.
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

/// The bytes a record with `payload_len` bytes of payload takes in the log.
pub fn record_bytes(payload_len: u32) -> u64 {
    RECORD_HEADER_BYTES + align_up(payload_len.into())
}

/// The fixed header at offset 0.
///
/// ```text
/// 0   magic (8)   8  codec tag (4)   12 chunk shift   13 format version   16 CRC of 0..16
/// 20  file id (16), for codecs that bind payloads to their file   36 CRC of 20..36
/// 14  flags (HEADER_PADDED)
/// ```
///
/// Files of codecs without a file id leave bytes 20..40 zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileHeader {
    pub codec: [u8; 4],
    pub chunk_shift: u8,
    pub file_id: Option<[u8; 16]>,
    /// [`HEADER_PADDED`], and any flag a newer writer set.
    pub flags: u8,
}

/// Header flag: the file's size is padded; its last [`PAD_TRAILER_BYTES`] decoded bytes hold
/// the real size (see [`crate::file`]).
pub const HEADER_PADDED: u8 = 1;
pub const KNOWN_HEADER_FLAGS: u8 = HEADER_PADDED;
/// The trailer of a padded file: the real size (u64 LE) and [`PAD_MAGIC`].
pub const PAD_TRAILER_BYTES: u64 = 16;
pub const PAD_MAGIC: [u8; 8] = *b"PLYSIZE\x01";

/// PADMÉ (Nikitin et al., *Reducing Metadata Leakage from Encrypted Files and Communication
/// with PURBs*, PETS 2019): round `len` up so that only its top `floor(log2 E) + 1` bits may
/// be set, where `E = floor(log2 len)`. At most 12% more, and a padded length tells
/// O(log log len) bits about the length.
pub fn padme(len: u64) -> u64 {
    if len < 2 {
        return len;
    }
    let e = 63 - u64::from(len.leading_zeros());
    let s = 64 - u64::from(e.leading_zeros());
    let mask = (1u64 << (e - s)) - 1;
    (len + mask) & !mask
}

impl FileHeader {
    pub fn encode(&self) -> [u8; FILE_HEADER_BYTES as usize] {
        let mut b = [0u8; FILE_HEADER_BYTES as usize];
        b[0..8].copy_from_slice(&FILE_MAGIC);
        b[8..12].copy_from_slice(&self.codec);
        b[12] = self.chunk_shift;
        b[13] = FORMAT_VERSION;
        b[14] = self.flags;
        let c = crc(&b[0..16]);
        b[16..20].copy_from_slice(&c.to_le_bytes());
        if let Some(id) = &self.file_id {
            b[20..36].copy_from_slice(id);
            let c = crc(&b[20..36]);
            b[36..40].copy_from_slice(&c.to_le_bytes());
        }
        b
    }

    /// `None` if the bytes are not a valid header of this format. A damaged file id reads as
    /// none: the codec then refuses the file's payloads, and says so.
    pub fn decode(b: &[u8]) -> Option<FileHeader> {
        if b.len() < 40 || b[0..8] != FILE_MAGIC || u32_at(b, 16) != crc(&b[0..16]) || b[13] != FORMAT_VERSION {
            return None;
        }
        let chunk_shift = b[12];
        if !(MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT).contains(&chunk_shift) {
            return None;
        }
        let file_id = (b[20..40] != [0; 20] && u32_at(b, 36) == crc(&b[20..36])).then(|| b[20..36].try_into().expect("16 bytes"));
        Some(FileHeader { codec: b[8..12].try_into().expect("4 bytes"), chunk_shift, file_id, flags: b[14] })
    }
}

/// One of the two alternating slots after the file header. The valid slot with the higher
/// `slot_seq` wins, so a torn slot write leaves the other one in force.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot {
    pub slot_seq: u64,
    /// Decoded file size as of record `covered_seq`.
    pub file_size: u64,
    /// Every record with a sequence number up to this one is reflected here.
    pub covered_seq: u64,
    /// Where the log ended when the slot was written.
    pub log_end: u64,
    /// The newest checkpoint record, 0 if there is none.
    pub checkpoint_off: u64,
    pub checkpoint_seq: u64,
}

impl Slot {
    pub fn encode(&self) -> [u8; SLOT_BYTES as usize] {
        let mut b = [0u8; SLOT_BYTES as usize];
        for (i, v) in [self.slot_seq, self.file_size, self.covered_seq, self.log_end, self.checkpoint_off, self.checkpoint_seq]
            .iter()
            .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        let c = crc(&b[0..60]);
        b[60..64].copy_from_slice(&c.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Slot> {
        if b.len() < SLOT_BYTES as usize || u32_at(b, 60) != crc(&b[0..60]) || b[0..8] == [0; 8] {
            return None;
        }
        Some(Slot {
            slot_seq: u64_at(b, 0),
            file_size: u64_at(b, 8),
            covered_seq: u64_at(b, 16),
            log_end: u64_at(b, 24),
            checkpoint_off: u64_at(b, 32),
            checkpoint_seq: u64_at(b, 40),
        })
    }

    /// The slot in force in `head`, the first bytes of a file (at least [`DATA_START`]).
    pub fn newest_in(head: &[u8]) -> Option<Slot> {
        let [a, b] = SLOT_OFFSETS.map(|at| head.get(at as usize..).and_then(Slot::decode));
        Slot::newest(a, b)
    }

    /// The slot in force among the two stored ones.
    pub fn newest(a: Option<Slot>, b: Option<Slot>) -> Option<Slot> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if a.slot_seq >= b.slot_seq { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    /// Where the next write of a slot goes: over the older one.
    pub fn offset_for(slot_seq: u64) -> u64 {
        SLOT_OFFSETS[(slot_seq % 2) as usize]
    }
}

/// The header of a record in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: Kind,
    pub flags: u8,
    pub chunk_shift: u8,
    pub seq: u64,
    /// The (first) chunk the record describes.
    pub chunk: u64,
    /// `Run`: how many chunks. `Tail`: how many bytes of the chunk come before the payload.
    /// `Index`: 0. Otherwise 1 or 0.
    pub count: u32,
    /// `Data`, `Run`: the decoded length of the payload. `Tail`: the payload length.
    pub decoded_len: u32,
    pub payload_len: u32,
    pub payload_crc: u32,
    /// The decoded file size once this record is applied.
    pub file_size: u64,
}

impl RecordHeader {
    pub fn encode(&self) -> [u8; RECORD_HEADER_BYTES as usize] {
        let mut b = [0u8; RECORD_HEADER_BYTES as usize];
        b[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.flags;
        b[6] = self.chunk_shift;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.chunk.to_le_bytes());
        b[24..28].copy_from_slice(&self.count.to_le_bytes());
        b[28..32].copy_from_slice(&self.decoded_len.to_le_bytes());
        b[32..36].copy_from_slice(&self.payload_len.to_le_bytes());
        b[36..40].copy_from_slice(&self.payload_crc.to_le_bytes());
        b[40..48].copy_from_slice(&self.file_size.to_le_bytes());
        let c = crc(&b[0..52]);
        b[52..56].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Parse and check a record header: magic, CRC, known kind and flags, and lengths that fit
    /// the chunk size. The payload is checked separately ([`payload_ok`]).
    pub fn decode(b: &[u8]) -> Option<RecordHeader> {
        if b.len() < RECORD_HEADER_BYTES as usize || u32_at(b, 0) != RECORD_MAGIC || u32_at(b, 52) != crc(&b[0..52]) {
            return None;
        }
        let h = RecordHeader {
            kind: Kind::from_u8(b[4])?,
            flags: b[5],
            chunk_shift: b[6],
            seq: u64_at(b, 8),
            chunk: u64_at(b, 16),
            count: u32_at(b, 24),
            decoded_len: u32_at(b, 28),
            payload_len: u32_at(b, 32),
            payload_crc: u32_at(b, 36),
            file_size: u64_at(b, 40),
        };
        h.plausible().then_some(h)
    }

    fn plausible(&self) -> bool {
        if self.flags & !KNOWN_RECORD_FLAGS != 0 || !(MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT).contains(&self.chunk_shift) {
            return false;
        }
        let chunk_bytes = 1u64 << self.chunk_shift;
        let decoded = u64::from(self.decoded_len);
        match self.kind {
            Kind::Data => {
                self.count == 1
                    && decoded > 0
                    && decoded <= chunk_bytes
                    && (self.flags & FLAG_RAW == 0 || self.payload_len == self.decoded_len)
            }
            Kind::Run => self.count > 0 && decoded == chunk_bytes,
            Kind::Tail => {
                u64::from(self.count) + decoded < chunk_bytes
                    && self.payload_len == self.decoded_len
                    && self.flags == 0
            }
            Kind::Size => self.count == 0 && self.payload_len == 0 && self.file_size % chunk_bytes == 0,
            Kind::Index => self.flags == 0,
        }
    }

    /// The bytes this record takes in the log.
    pub fn bytes(&self) -> u64 {
        record_bytes(self.payload_len)
    }
}

/// Build a whole record: header, payload and alignment padding.
pub fn build_record(header: RecordHeader, payload: &[u8], out: &mut Vec<u8>) -> RecordHeader {
    let start = begin_record(out);
    out.extend_from_slice(payload);
    finish_record(header, out, start)
}

/// Start a record at the end of `out`: room for its header, which [`finish_record`] fills in
/// once the payload has been appended after it. Returns where the record starts.
pub fn begin_record(out: &mut Vec<u8>) -> usize {
    let start = out.len();
    out.resize(start + RECORD_HEADER_BYTES as usize, 0);
    start
}

/// Complete the record begun at `start`: everything appended since its header is the payload.
/// Fills in the header (lengths and CRCs) and pads the record; returns the header written.
pub fn finish_record(mut header: RecordHeader, out: &mut Vec<u8>, start: usize) -> RecordHeader {
    let payload_at = start + RECORD_HEADER_BYTES as usize;
    let payload = &out[payload_at..];
    header.payload_len = u32::try_from(payload.len()).expect("payloads are far below 4 GiB");
    header.payload_crc = crc(payload);
    out[start..payload_at].copy_from_slice(&header.encode());
    let padded = align_up(u64::from(header.payload_len)) as usize;
    out.resize(payload_at + padded, 0);
    header
}

pub fn payload_ok(header: &RecordHeader, payload: &[u8]) -> bool {
    payload.len() == header.payload_len as usize && crc(payload) == header.payload_crc
}

/// LEB128 varints, for the compact checkpoint encoding.
pub mod varint {
    pub fn put(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    pub fn put_signed(out: &mut Vec<u8>, v: i64) {
        put(out, ((v << 1) ^ (v >> 63)) as u64);
    }

    /// Read one varint at `*at`, advancing it. `None` if the input ends or overflows.
    pub fn get(input: &[u8], at: &mut usize) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *input.get(*at)?;
            *at += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }

    pub fn get_signed(input: &[u8], at: &mut usize) -> Option<i64> {
        let v = get(input, at)?;
        Some(((v >> 1) as i64) ^ -((v & 1) as i64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: Kind) -> RecordHeader {
        RecordHeader {
            kind,
            flags: 0,
            chunk_shift: 12,
            seq: 7,
            chunk: 3,
            count: 1,
            decoded_len: 4096,
            payload_len: 0,
            payload_crc: 0,
            file_size: 16384,
        }
    }

    #[test]
    fn record_round_trip_and_corruption() {
        let mut out = Vec::new();
        build_record(header(Kind::Data), b"hello", &mut out);
        assert_eq!(out.len() as u64, record_bytes(5));
        let h = RecordHeader::decode(&out).unwrap();
        assert_eq!(h.seq, 7);
        assert!(payload_ok(&h, &out[56..61]));
        for i in 0..56 {
            let mut bad = out.clone();
            bad[i] ^= 0x10;
            assert!(RecordHeader::decode(&bad).is_none(), "flip in byte {i} went unnoticed");
        }
        let mut bad = out.clone();
        bad[58] ^= 1;
        assert!(!payload_ok(&h, &bad[56..61]));
    }

    #[test]
    fn implausible_records_are_rejected() {
        let mut t = header(Kind::Tail);
        t.count = 4000;
        t.decoded_len = 200; // 4000 + 200 > 4096: a tail cannot fill or pass the chunk
        t.payload_len = 200;
        assert!(RecordHeader::decode(&t.encode()).is_none());
        let mut s = header(Kind::Size);
        s.count = 0;
        s.file_size = 5000; // not on a chunk boundary
        assert!(RecordHeader::decode(&s.encode()).is_none());
        let mut d = header(Kind::Data);
        d.flags = 0x80;
        assert!(RecordHeader::decode(&d.encode()).is_none());
    }

    #[test]
    fn newest_slot_wins_and_torn_slots_lose() {
        let a = Slot { slot_seq: 4, file_size: 10, ..Default::default() };
        let b = Slot { slot_seq: 5, file_size: 20, ..Default::default() };
        let (ea, mut eb) = (a.encode(), b.encode());
        assert_eq!(Slot::newest(Slot::decode(&ea), Slot::decode(&eb)).unwrap().file_size, 20);
        eb[9] ^= 1;
        assert_eq!(Slot::newest(Slot::decode(&ea), Slot::decode(&eb)).unwrap().file_size, 10);
        assert_eq!(Slot::decode(&[0u8; 64]), None);
    }

    #[test]
    fn padme_rounds_as_the_paper_says() {
        // Table 2 of the paper's examples and the 12% bound.
        assert_eq!((0..=8).map(padme).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(padme(9), 10);
        assert_eq!(padme(100), 104);
        assert_eq!(padme(1000), 1024);
        assert_eq!(padme(4104), 4352);
        assert_eq!(padme((1 << 20) + 1), (1 << 20) + (1 << 15));
        for len in (1u64..1 << 24).step_by(997).chain([u64::MAX >> 8]) {
            let p = padme(len);
            assert!(p >= len && (p - len) as f64 <= 0.12 * len as f64 + 1.0, "{len} -> {p}");
            assert_eq!(padme(p), p, "padding is idempotent");
            let e = 63 - len.leading_zeros();
            let s = 32 - e.leading_zeros();
            assert_eq!(p.trailing_zeros().min(e - s), e - s, "{len} -> {p}: the low bits are zero");
        }
    }

    #[test]
    fn encoded_files_are_told_from_plain_ones() {
        let mut file = FileHeader { codec: *b"zstd", chunk_shift: 12, file_id: None, flags: 0 }.encode().to_vec();
        file.resize(DATA_START as usize, 0);
        build_record(header(Kind::Data), b"payload", &mut file);
        assert!(looks_encoded(&file));
        let mut no_magic = file.clone();
        no_magic[..8].fill(b'X');
        assert!(looks_encoded(&no_magic), "the first record still tells");
        no_magic[DATA_START as usize + 9] ^= 1;
        assert!(!looks_encoded(&no_magic), "magic and first record both gone: plain");
        assert!(looks_encoded(&file[..8]), "the magic alone, on a cut file");
        for plain in [&b"PLYSCA\x00"[..], b"PLYSCA\x00\x02 text", b"x", b"plain text\n"] {
            assert!(!looks_encoded(plain), "{plain:?}");
        }
    }

    #[test]
    fn varints_round_trip() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut out = Vec::new();
            varint::put(&mut out, v);
            let mut at = 0;
            assert_eq!(varint::get(&out, &mut at), Some(v));
            assert_eq!(at, out.len());
        }
        for v in [0i64, -1, 1, -300, i64::MIN, i64::MAX] {
            let mut out = Vec::new();
            varint::put_signed(&mut out, v);
            let mut at = 0;
            assert_eq!(varint::get_signed(&out, &mut at), Some(v));
        }
        assert_eq!(varint::get(&[0x80], &mut 0), None);
    }
}
