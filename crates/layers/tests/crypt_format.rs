//! Known answers for the crypt layer's on-disk chunk format, computed independently of the
//! codec: the key derived with HKDF-SHA256 and the chunk sealed with the `aes-gcm` and
//! `chacha20poly1305` crates directly (the AES-256-GCM file key too), and pinned as hex bytes (checked against Python's
//! `cryptography` package, with HChaCha20 written out by hand for XChaCha20-Poly1305). A change
//! of format — key derivation, associated data, nonce, kind byte, layout — fails here before
//! it can make existing volumes unreadable.
//!
//! ```text
//! data key  = HKDF-SHA256(salt "plyfs crypt v1", ikm master key, info "data <cipher>")
//! key       = AES-256-GCM: HKDF-SHA256(salt "plyfs crypt v1 file", ikm data key, info file id)
//!             XChaCha20-Poly1305: the data key
//! AD        = "plyfs crypt v1" || file id (16) || first chunk (u64 LE) || chunk count (u64 LE)
//! plaintext = chunk || kind (0: stored, 1: zstd)
//! payload   = nonce (12 for AES-256-GCM, 24 for XChaCha20-Poly1305) || ciphertext || tag (16)
//! ```

use std::sync::Arc;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::Aes256Gcm;
use chacha20poly1305::XChaCha20Poly1305;
use plyfs_layers::crypt::codec::{CryptCodec, KIND_STORED, KIND_ZSTD};
use plyfs_layers::crypt::keys::{CipherKind, MasterKey};
use plyfs_sca::{Codec, Place};

const MASTER: [u8; 32] = [7; 32];
const FILE_ID: [u8; 16] = *b"0123456789abcdef";
const CIPHERS: [CipherKind; 2] = [CipherKind::Aes256Gcm, CipherKind::XChaCha20Poly1305];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn data_key(info: &str) -> [u8; 32] {
    let mut key = [0u8; 32];
    hkdf::Hkdf::<sha2::Sha256>::new(Some(b"plyfs crypt v1"), &MASTER).expand(info.as_bytes(), &mut key).unwrap();
    key
}

/// The AES-256-GCM key of the file `file_id`.
fn file_key(file_id: &[u8; 16]) -> [u8; 32] {
    let mut key = [0u8; 32];
    hkdf::Hkdf::<sha2::Sha256>::new(Some(b"plyfs crypt v1 file"), &data_key("data aes-256-gcm")).expand(file_id, &mut key).unwrap();
    key
}

fn associated_data(place: &Place) -> Vec<u8> {
    let mut ad = b"plyfs crypt v1".to_vec();
    ad.extend_from_slice(&place.file_id);
    ad.extend_from_slice(&place.chunk.to_le_bytes());
    ad.extend_from_slice(&place.count.to_le_bytes());
    ad
}

fn nonce_len(cipher: CipherKind) -> usize {
    match cipher {
        CipherKind::Aes256Gcm => 12,
        CipherKind::XChaCha20Poly1305 => 24,
    }
}

/// The payload of `body || kind` at `place` with `nonce`, sealed without the codec.
fn independent_seal(cipher: CipherKind, nonce: &[u8], place: &Place, body: &[u8], kind: u8) -> Vec<u8> {
    let mut msg = body.to_vec();
    msg.push(kind);
    let aad = associated_data(place);
    let sealed = match cipher {
        CipherKind::Aes256Gcm => Aes256Gcm::new_from_slice(&file_key(&place.file_id))
            .unwrap()
            .encrypt(nonce.into(), Payload { msg: &msg, aad: &aad }),
        CipherKind::XChaCha20Poly1305 => XChaCha20Poly1305::new_from_slice(&data_key("data xchacha20-poly1305"))
            .unwrap()
            .encrypt(nonce.into(), Payload { msg: &msg, aad: &aad }),
    }
    .unwrap();
    let mut payload = nonce.to_vec();
    payload.extend_from_slice(&sealed);
    payload
}

/// Open a payload without the codec: (body, kind).
fn independent_open(cipher: CipherKind, place: &Place, payload: &[u8]) -> (Vec<u8>, u8) {
    let (nonce, sealed) = payload.split_at(nonce_len(cipher));
    let aad = associated_data(place);
    let mut plain = match cipher {
        CipherKind::Aes256Gcm => Aes256Gcm::new_from_slice(&file_key(&place.file_id))
            .unwrap()
            .decrypt(nonce.into(), Payload { msg: sealed, aad: &aad }),
        CipherKind::XChaCha20Poly1305 => XChaCha20Poly1305::new_from_slice(&data_key("data xchacha20-poly1305"))
            .unwrap()
            .decrypt(nonce.into(), Payload { msg: sealed, aad: &aad }),
    }
    .expect("the payload opens with the independently derived key");
    let kind = plain.pop().unwrap();
    (plain, kind)
}

/// A codec whose nonces count up from `start` (each byte the next counter value).
fn counting(cipher: CipherKind, start: u64) -> CryptCodec {
    CryptCodec::new(cipher, &MasterKey::from_bytes(MASTER), None).with_counter_nonces(start)
}

fn counted_nonce(cipher: CipherKind, start: u64) -> Vec<u8> {
    (start..start + nonce_len(cipher) as u64).map(|n| n as u8).collect()
}

fn encode(codec: &CryptCodec, place: &Place, chunk: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    codec.encode_at(place, chunk, &mut out).unwrap();
    out
}

fn decode(codec: &CryptCodec, place: &Place, payload: &[u8], len: usize) -> Result<Vec<u8>, plyfs_sca::Error> {
    let mut out = Vec::new();
    codec.decode_at(place, payload, len, &mut out).map(|()| out)
}

#[test]
fn pinned_payloads_of_a_tiny_chunk() {
    let place = Place { file_id: FILE_ID, chunk: 5, count: 1 };
    for (cipher, expected) in [
        (CipherKind::Aes256Gcm, "000102030405060708090a0b75d511dd8bcca81a335bb491c4b008b6f57412dd560f"),
        (
            CipherKind::XChaCha20Poly1305,
            "000102030405060708090a0b0c0d0e0f101112131415161736afff4e5fb989235332c324a70fc7ec8c881048cde4",
        ),
    ] {
        let payload = encode(&counting(cipher, 0), &place, b"plyfs");
        assert_eq!(hex(&payload), expected, "{cipher:?}");
        assert_eq!(hex(&independent_seal(cipher, &counted_nonce(cipher, 0), &place, b"plyfs", KIND_STORED)), expected, "{cipher:?}");
        assert_eq!(decode(&counting(cipher, 0), &place, &payload, 5).unwrap(), b"plyfs");
    }
}

#[test]
fn payloads_equal_an_independent_seal() {
    let chunks: [Vec<u8>; 4] = [vec![0x5a], (0..4096u32).map(|i| (i * 31 % 251) as u8).collect(), vec![0; 4096], b"x".repeat(1 << 20)];
    let places = [
        Place { file_id: FILE_ID, chunk: 0, count: 1 },
        Place { file_id: [0xff; 16], chunk: u64::MAX - 1, count: 1 },
        // A run of zero chunks (a hole) is one payload bound to the whole run.
        Place { file_id: FILE_ID, chunk: 3, count: 1000 },
    ];
    for cipher in CIPHERS {
        for (i, chunk) in chunks.iter().enumerate() {
            for (j, place) in places.iter().enumerate() {
                let start = (i * 40 + j * 7) as u64;
                let payload = encode(&counting(cipher, start), place, chunk);
                assert_eq!(payload.len(), nonce_len(cipher) + chunk.len() + 1 + 16, "{cipher:?}");
                let expected = independent_seal(cipher, &counted_nonce(cipher, start), place, chunk, KIND_STORED);
                assert!(payload == expected, "{cipher:?}: chunk {i} at {place:?} differs from the independent seal");
                let (body, kind) = independent_open(cipher, place, &payload);
                assert!(body == *chunk && kind == KIND_STORED, "{cipher:?}: chunk {i} at {place:?}");
                assert!(decode(&counting(cipher, 0), place, &payload, chunk.len()).unwrap() == *chunk, "{cipher:?}: chunk {i} at {place:?}");
            }
        }
    }
}

#[test]
fn a_payload_opens_only_at_its_own_place() {
    let place = Place { file_id: FILE_ID, chunk: 9, count: 1 };
    let chunk = b"a chunk that belongs to chunk 9 of one file".to_vec();
    for cipher in CIPHERS {
        let codec = counting(cipher, 100);
        let payload = encode(&codec, &place, &chunk);
        assert_eq!(decode(&codec, &place, &payload, chunk.len()).unwrap(), chunk, "{cipher:?}");
        let mut other_file = FILE_ID;
        other_file[15] ^= 1;
        for wrong in [
            Place { chunk: 8, ..place },
            Place { chunk: 10, ..place },
            Place { chunk: 9 + (1 << 32), ..place },
            Place { file_id: other_file, ..place },
            Place { count: 2, ..place },
            Place { count: 0, ..place },
        ] {
            let err = decode(&codec, &wrong, &payload, chunk.len()).expect_err(&format!("{cipher:?}: opened at {wrong:?}"));
            assert!(err.to_string().contains("authentication failed"), "{cipher:?}: {err}");
        }
        // A header that lost its file id cannot vouch for any chunk.
        assert!(decode(&codec, &Place { file_id: [0; 16], ..place }, &payload, chunk.len()).is_err());
        // Every byte matters: nonce, ciphertext, the sealed kind byte, the tag.
        for at in 0..payload.len() {
            for bit in [0x01u8, 0x80] {
                let mut bad = payload.clone();
                bad[at] ^= bit;
                assert!(decode(&codec, &place, &bad, chunk.len()).is_err(), "{cipher:?}: flipping bit {bit:#x} of byte {at} went unnoticed");
            }
        }
        for len in [0, payload.len() - 1, nonce_len(cipher) + 16] {
            assert!(decode(&codec, &place, &payload[..len], chunk.len()).is_err(), "{cipher:?}: cut to {len} bytes");
        }
        let mut longer = payload.clone();
        longer.push(0);
        assert!(decode(&codec, &place, &longer, chunk.len()).is_err(), "{cipher:?}: a byte appended");
        // Another volume's key, or the other cipher, opens nothing.
        let stranger = CryptCodec::new(cipher, &MasterKey::from_bytes([8; 32]), None);
        assert!(decode(&stranger, &place, &payload, chunk.len()).is_err(), "{cipher:?}: another key");
        let other = CIPHERS.into_iter().find(|c| *c != cipher).unwrap();
        assert!(decode(&counting(other, 0), &place, &payload, chunk.len()).is_err(), "{cipher:?} read as {other:?}");
    }
}

#[test]
fn a_collapsed_compressor_seals_its_output_with_its_kind() {
    let place = Place { file_id: FILE_ID, chunk: 2, count: 1 };
    let text = b"compressible text, compressible text, compressible text. ".repeat(80)[..4096].to_vec();
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 32) as u8
        })
        .collect();
    for cipher in CIPHERS {
        let key = MasterKey::from_bytes(MASTER);
        let zstd: Arc<dyn Codec> = Arc::new(plyfs_layers::zstd::Zstd::new(3));
        let collapsed = CryptCodec::new(cipher, &key, Some((KIND_ZSTD, zstd))).with_counter_nonces(0);
        let plain_crypt = CryptCodec::new(cipher, &key, None);

        let payload = encode(&collapsed, &place, &text);
        let (body, kind) = independent_open(cipher, &place, &payload);
        assert_eq!(kind, KIND_ZSTD, "{cipher:?}");
        assert!(body.len() < text.len() / 4, "{cipher:?}: compressed before sealing: {} bytes", body.len());
        assert!(zstd::bulk::decompress(&body, text.len()).unwrap() == text, "{cipher:?}: the body is a zstd frame of the chunk");
        // Any crypt layer reads it: the kind is inside the seal.
        assert!(decode(&plain_crypt, &place, &payload, text.len()).unwrap() == text, "{cipher:?}");
        assert!(decode(&collapsed, &place, &payload, text.len()).unwrap() == text, "{cipher:?}");

        // What does not shrink is stored as it is.
        let payload = encode(&collapsed, &place, &noise);
        let (body, kind) = independent_open(cipher, &place, &payload);
        assert_eq!(kind, KIND_STORED, "{cipher:?}: random bytes do not shrink");
        assert!(body == noise, "{cipher:?}: stored as they are");
        assert!(decode(&plain_crypt, &place, &payload, noise.len()).unwrap() == noise, "{cipher:?}");
    }
}

#[test]
fn an_unknown_kind_inside_an_authentic_chunk_is_an_error() {
    let place = Place { file_id: FILE_ID, chunk: 0, count: 1 };
    for cipher in CIPHERS {
        let payload = independent_seal(cipher, &counted_nonce(cipher, 0), &place, b"from the future", 200);
        let err = decode(&counting(cipher, 0), &place, &payload, 15).unwrap_err();
        assert!(err.to_string().contains("unknown compression kind 200"), "{cipher:?}: {err}");
    }
}

#[test]
fn real_nonces_and_file_ids_are_fresh() {
    let place = Place { file_id: FILE_ID, chunk: 0, count: 1 };
    for cipher in CIPHERS {
        let codec = CryptCodec::new(cipher, &MasterKey::from_bytes(MASTER), None);
        let n = nonce_len(cipher);
        let nonces: std::collections::BTreeSet<Vec<u8>> = (0..1000).map(|_| encode(&codec, &place, b"same chunk")[..n].to_vec()).collect();
        assert_eq!(nonces.len(), 1000, "{cipher:?}: a nonce was repeated");
        assert!(!nonces.contains(&vec![0u8; n]), "{cipher:?}");
        let ids: std::collections::BTreeSet<[u8; 16]> = (0..1000).map(|_| codec.new_file_id().unwrap()).collect();
        assert_eq!(ids.len(), 1000, "{cipher:?}: a file id was repeated");
        assert!(!codec.deterministic() && !codec.plaintext_safe(), "{cipher:?}: a cipher allows neither shared runs nor raw tails");
    }
}
