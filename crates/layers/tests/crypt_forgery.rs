//! Records an attacker can forge without the key (the framing is only CRC-protected) must not
//! smuggle data past the cipher: a fast tail (plaintext) or a record flagged "stored as is".

use std::sync::Arc;

use plyfs_layers::crypt::codec::CryptCodec;
use plyfs_layers::crypt::keys::{CipherKind, MasterKey};
use plyfs_sca::format::{build_record, Kind, RecordHeader, DATA_START, FLAG_RAW, RECORD_HEADER_BYTES};
use plyfs_sca::mem::MemLower as Mem;
use plyfs_sca::{Engine, LowerIo, ScaFile};

fn engine() -> Arc<Engine> {
    let codec = CryptCodec::new(CipherKind::Aes256Gcm, &MasterKey::from_bytes([9; 32]), None);
    Arc::new(Engine::new("crypt", Arc::new(codec), 12, false))
}

/// A closed three-chunk file, its content, and where each record starts.
fn sample() -> (Mem, Vec<u8>, Vec<(u64, RecordHeader)>) {
    let lower = Mem::default();
    let mut f = ScaFile::open(engine(), lower.clone()).unwrap();
    let content: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    f.write(0, &content).unwrap();
    f.close().unwrap();
    let bytes = lower.0.lock().clone();
    let mut records = Vec::new();
    let mut at = DATA_START as usize;
    while let Some(h) = bytes.get(at..).and_then(RecordHeader::decode) {
        records.push((at as u64, h));
        at += h.bytes() as usize;
    }
    (lower, content, records)
}

fn last_seq(records: &[(u64, RecordHeader)]) -> u64 {
    records.iter().map(|(_, h)| h.seq).max().unwrap()
}

#[test]
fn a_forged_plaintext_fast_tail_reads_as_an_error() {
    let (lower, content, records) = sample();
    let header = RecordHeader {
        kind: Kind::Tail,
        flags: 0,
        chunk_shift: 12,
        seq: last_seq(&records) + 1,
        chunk: 2,
        count: 0,
        decoded_len: 4,
        payload_len: 0,
        payload_crc: 0,
        file_size: 2 * 4096 + 4,
    };
    let mut forged = Vec::new();
    build_record(header, b"EVIL", &mut forged);
    let end = lower.0.lock().len() as u64;
    lower.write_at(end, &forged).unwrap();
    let mut f = ScaFile::open(engine(), lower).unwrap();
    assert_eq!(f.read(0, 8192).unwrap(), &content[..8192], "the chunks before are untouched");
    let tail = f.read_repairing(8192, 4);
    assert!(tail.is_err(), "a forged plaintext tail was served: {:?}", tail.unwrap());
}

#[test]
fn a_record_forged_as_stored_unencoded_reads_as_an_error() {
    let (lower, content, records) = sample();
    // The last chunk is partial, so a sealed payload a little longer than it still fits a chunk.
    let (at, h) = records.iter().find(|(_, h)| h.kind == Kind::Data && h.chunk == 2).copied().unwrap();
    // Claim the sealed payload is the chunk itself, with a length to match, and fix the CRC.
    let forged = RecordHeader { flags: h.flags | FLAG_RAW, decoded_len: h.payload_len, ..h };
    lower.write_at(at, &forged.encode()).unwrap();
    assert_eq!(RECORD_HEADER_BYTES as usize, forged.encode().len());
    let mut f = ScaFile::open(engine(), lower).unwrap();
    assert_eq!(f.read_repairing(0, 8192).unwrap(), &content[..8192]);
    let chunk = f.read_repairing(8192, 100);
    assert!(chunk.is_err(), "ciphertext was served as data");
}

/// A padded file whose trailer (its real size, sealed in the last chunk) is damaged: the size
/// cannot be read, so all that is stored shows, and the damaged chunk reads as an error, never
/// as data; the chunks before it read as they were.
#[test]
fn a_damaged_size_trailer_shows_the_stored_size_and_its_chunk_reads_as_an_error() {
    let padded = Arc::new(Engine::new("crypt", engine().codec.clone(), 12, false).padding(true));
    let lower = Mem::default();
    let content: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let mut f = ScaFile::open(padded.clone(), lower.clone()).unwrap();
    f.write(0, &content).unwrap();
    f.close().unwrap();
    let f = ScaFile::open(padded.clone(), lower.clone()).unwrap();
    assert_eq!(f.size(), 10_000);
    let stored = plyfs_sca::format::padme(10_000 + 16);
    assert!(stored > 10_016, "{stored}");
    drop(f);
    // Flip a byte in the sealed payload of the last chunk's newest record.
    let bytes = lower.0.lock().clone();
    let mut last = None;
    let mut at = DATA_START as usize;
    while let Some(h) = bytes.get(at..).and_then(RecordHeader::decode) {
        if h.kind == Kind::Data && h.chunk == (stored - 1) >> 12 {
            last = Some(at);
        }
        at += h.bytes() as usize;
    }
    let at = last.expect("a record holding the trailer") + RECORD_HEADER_BYTES as usize + 4;
    lower.write_at(at as u64, &[bytes[at] ^ 0x40]).unwrap();
    let mut f = ScaFile::open(padded, lower).unwrap();
    assert_eq!(f.size(), stored, "the stored size shows when the real one cannot be read");
    assert_eq!(f.read_repairing(0, 8192).unwrap(), &content[..8192]);
    assert!(f.read_repairing(stored - 100, 100).is_err(), "a damaged chunk was served as data");
}
