//! The chunk cipher: each chunk sealed with an AEAD under the volume's data key.
//!
//! ```text
//! payload   = nonce || ciphertext || tag (16)
//! plaintext = body || kind (1)       kind 0: body is the chunk; 1 zstd, 2 deflate, 3 lz4:
//!                                    body is the chunk compressed (a collapsed pipeline)
//! AD        = "plyfs crypt v1" || file id (16) || first chunk (u64 LE) || chunk count (u64 LE)
//! ```
//!
//! The nonce is fresh and random for every seal: 12 bytes for AES-256-GCM, under a key of the
//! file's own (HKDF-SHA256 of the volume's data key and the file id), so the usual bound of
//! 2^32 random nonces per key is 2^32 chunks per file (16 TiB at 4 KiB); 24 bytes for
//! XChaCha20-Poly1305, under the volume's data key. The associated data binds the payload to
//! its file (the random id in the file header) and its place in it, so a chunk copied to
//! another position or file, or any altered byte, fails to open: EIO, never garbage. A run of
//! zero chunks (a hole) is one payload bound to the whole run.
//!
//! AES-256-GCM comes from `ring` (AES-NI, VAES and carry-less multiplication: about 0.5 µs per
//! 4 KiB chunk here, five times the RustCrypto implementation), XChaCha20-Poly1305 from
//! RustCrypto.
//!
//! Because the compression kind is inside the sealed plaintext, every crypt layer reads every
//! chunk, whether a collapsed `zstd,crypt` pipeline or a plain `crypt` wrote it.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::collections::HashMap;

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::XChaCha20Poly1305;
use parking_lot::RwLock;
use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};
use zeroize::Zeroizing;
use plyfs_sca::{Codec, Error as CodecError, FileFacts, Place};
use plyfs_stack::ExtOpInfo;
use serde_json::json;

use super::keys::{CipherKind, MasterKey};

const AD_PREFIX: &[u8; 14] = b"plyfs crypt v1";
const TAG_BYTES: usize = 16;

/// Compression kinds inside the sealed plaintext.
pub const KIND_STORED: u8 = 0;
pub const KIND_ZSTD: u8 = 1;
pub const KIND_DEFLATE: u8 = 2;
pub const KIND_LZ4: u8 = 3;

/// What a compressor collapsed into the cipher is called inside a payload.
pub fn kind_of(layer_kind: &str) -> Option<u8> {
    match layer_kind {
        "zstd" => Some(KIND_ZSTD),
        "gzip" => Some(KIND_DEFLATE),
        "lz4" => Some(KIND_LZ4),
        _ => None,
    }
}

fn decoder_for(kind: u8) -> Option<&'static dyn Codec> {
    // Levels matter only to encoding.
    static ZSTD: crate::zstd::Zstd = crate::zstd::Zstd::new(crate::zstd::DEFAULT_LEVEL as i32);
    static DEFLATE: crate::gzip::Gzip = crate::gzip::Gzip::new(crate::gzip::DEFAULT_LEVEL as u32);
    static LZ4: crate::lz4::Lz4 = crate::lz4::Lz4;
    match kind {
        KIND_ZSTD => Some(&ZSTD),
        KIND_DEFLATE => Some(&DEFLATE),
        KIND_LZ4 => Some(&LZ4),
        _ => None,
    }
}

enum Sealer {
    /// The volume's data key, and the keys derived from it per file.
    Gcm { data_key: Zeroizing<[u8; 32]>, files: RwLock<HashMap<[u8; 16], Arc<LessSafeKey>>> },
    XChaCha(Box<XChaCha20Poly1305>),
}

/// Per-file keys kept at most (each is a few hundred bytes); the table starts over when full.
const FILE_KEYS: usize = 4096;

/// Where nonces and file ids come from.
enum Nonces {
    Random,
    /// Known-answer tests only: bytes from a counter, so that output is reproducible.
    Counter(AtomicU64),
}

thread_local! {
    /// Random bytes fetched from the kernel in batches: one system call serves hundreds of
    /// chunks. (The daemon never forks without exec, so no two processes share a batch.)
    static RANDOM: RefCell<(usize, [u8; 4096])> = const { RefCell::new((4096, [0; 4096])) };
    /// A buffer for a chunk's compressed form, kept per thread.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl Nonces {
    fn fill(&self, out: &mut [u8]) {
        match self {
            Nonces::Random => RANDOM.with_borrow_mut(|(used, pool)| {
                if *used + out.len() > pool.len() {
                    getrandom::getrandom(pool).expect("the system's random number generator failed");
                    *used = 0;
                }
                out.copy_from_slice(&pool[*used..*used + out.len()]);
                // Never hand out the same bytes twice.
                pool[*used..*used + out.len()].fill(0);
                *used += out.len();
            }),
            Nonces::Counter(n) => {
                for b in out.iter_mut() {
                    *b = (n.fetch_add(1, Ordering::Relaxed) & 0xff) as u8;
                }
            }
        }
    }
}

pub struct CryptCodec {
    cipher: CipherKind,
    sealer: Sealer,
    /// A compressor collapsed into this pipeline, with its kind byte.
    inner: Option<(u8, Arc<dyn Codec>)>,
    nonces: Nonces,
}

impl CryptCodec {
    /// The chunk cipher of a volume, with `inner` compressing each chunk before it is sealed.
    pub fn new(cipher: CipherKind, key: &MasterKey, inner: Option<(u8, Arc<dyn Codec>)>) -> CryptCodec {
        let sealer = match cipher {
            CipherKind::Aes256Gcm => Sealer::Gcm { data_key: key.subkey::<32>("data aes-256-gcm"), files: RwLock::new(HashMap::new()) },
            CipherKind::XChaCha20Poly1305 => {
                let k = key.subkey::<32>("data xchacha20-poly1305");
                Sealer::XChaCha(Box::new(XChaCha20Poly1305::new_from_slice(&k[..]).expect("32-byte key")))
            }
        };
        CryptCodec { cipher, sealer, inner, nonces: Nonces::Random }
    }

    /// For known-answer tests: nonces and file ids counted up from `start` instead of random.
    #[doc(hidden)]
    pub fn with_counter_nonces(mut self, start: u64) -> CryptCodec {
        self.nonces = Nonces::Counter(AtomicU64::new(start));
        self
    }

    /// Seal `chunk` for `place` under `nonce` (of [`CryptCodec::nonce_len`] bytes), appending
    /// the payload to `out`. A nonce must never seal two different chunks of a file: callers
    /// take it fresh and random, or derive it from the chunk itself (a reverse view).
    pub fn seal_chunk(&self, place: &Place, nonce: &[u8], chunk: &[u8], out: &mut Vec<u8>) -> Result<(), CodecError> {
        let start = out.len();
        out.extend_from_slice(nonce);
        let body = out.len();
        let kind = match &self.inner {
            Some((kind, codec)) => {
                out.reserve(chunk.len() + 1 + TAG_BYTES);
                let compressed = !plyfs_sca::codec::looks_incompressible(chunk)
                    && codec.encode(chunk, out).is_ok()
                    && out.len() - body < chunk.len();
                if compressed {
                    *kind
                } else {
                    out.truncate(body);
                    out.extend_from_slice(chunk);
                    KIND_STORED
                }
            }
            None => {
                out.reserve(chunk.len() + 1 + TAG_BYTES);
                out.extend_from_slice(chunk);
                KIND_STORED
            }
        };
        out.push(kind);
        match self.seal(place, nonce, &Self::associated_data(place), &mut out[body..]) {
            Ok(tag) => {
                out.extend_from_slice(&tag);
                Ok(())
            }
            Err(e) => {
                out.truncate(start);
                Err(e)
            }
        }
    }

    /// Bytes of nonce in every payload.
    pub fn nonce_len(&self) -> usize {
        match self.sealer {
            Sealer::Gcm { .. } => 12,
            Sealer::XChaCha(_) => 24,
        }
    }

    /// Bytes a stored (uncompressed) chunk's payload has beyond the chunk: nonce, kind, tag.
    pub fn overhead(&self) -> u32 {
        (self.nonce_len() + 1 + TAG_BYTES) as u32
    }

    /// The AES-256-GCM key of one file: HKDF-SHA256(salt "plyfs crypt v1 file", data key,
    /// info file id).
    fn file_key(data_key: &[u8; 32], files: &RwLock<HashMap<[u8; 16], Arc<LessSafeKey>>>, file_id: &[u8; 16]) -> Arc<LessSafeKey> {
        if let Some(k) = files.read().get(file_id) {
            return k.clone();
        }
        let mut bytes = Zeroizing::new([0u8; 32]);
        hkdf::Hkdf::<sha2::Sha256>::new(Some(b"plyfs crypt v1 file"), data_key)
            .expand(file_id, &mut bytes[..])
            .expect("HKDF output length is small");
        let key = Arc::new(LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &bytes[..]).expect("32-byte key")));
        let mut files = files.write();
        if files.len() >= FILE_KEYS {
            files.clear();
        }
        files.insert(*file_id, key.clone());
        key
    }

    fn associated_data(place: &Place) -> [u8; 46] {
        let mut ad = [0u8; 46];
        ad[..14].copy_from_slice(AD_PREFIX);
        ad[14..30].copy_from_slice(&place.file_id);
        ad[30..38].copy_from_slice(&place.chunk.to_le_bytes());
        ad[38..46].copy_from_slice(&place.count.to_le_bytes());
        ad
    }

    fn seal(&self, place: &Place, nonce: &[u8], ad: &[u8], buf: &mut [u8]) -> Result<[u8; TAG_BYTES], CodecError> {
        let failed = |_| CodecError::encode("sealing failed");
        match &self.sealer {
            Sealer::Gcm { data_key, files } => {
                let key = Self::file_key(data_key, files, &place.file_id);
                let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(failed)?;
                let tag = key.seal_in_place_separate_tag(nonce, Aad::from(ad), buf).map_err(failed)?;
                Ok(tag.as_ref().try_into().expect("16-byte tag"))
            }
            Sealer::XChaCha(c) => c.encrypt_in_place_detached(nonce.into(), ad, buf).map(|t| t.into()).map_err(|_| CodecError::encode("sealing failed")),
        }
    }

    fn open(&self, place: &Place, nonce: &[u8], ad: &[u8], buf: &mut [u8], tag: &[u8]) -> bool {
        match &self.sealer {
            Sealer::Gcm { data_key, files } => {
                let key = Self::file_key(data_key, files, &place.file_id);
                let (Ok(nonce), Ok(tag)) = (Nonce::try_assume_unique_for_key(nonce), <[u8; 16]>::try_from(tag)) else { return false };
                key.open_in_place_separate_tag(nonce, Aad::from(ad), Tag::from(tag), buf, 0..).is_ok()
            }
            Sealer::XChaCha(c) => c.decrypt_in_place_detached(nonce.into(), ad, buf, tag.into()).is_ok(),
        }
    }
}

impl Codec for CryptCodec {
    fn tag(&self) -> [u8; 4] {
        match self.cipher {
            CipherKind::Aes256Gcm => *b"cgcm",
            CipherKind::XChaCha20Poly1305 => *b"cryX",
        }
    }

    fn encode(&self, _chunk: &[u8], _out: &mut Vec<u8>) -> Result<(), CodecError> {
        Err(CodecError::encode("a chunk cannot be encrypted without its place"))
    }

    fn decode(&self, _encoded: &[u8], _decoded_len: usize, _out: &mut Vec<u8>) -> Result<(), CodecError> {
        Err(CodecError::decode("a chunk cannot be decrypted without its place"))
    }

    /// A chunk is stored (compressed or not) and sealed: nonce, kind and tag come on top.
    fn max_payload(&self, chunk_len: usize) -> usize {
        chunk_len + self.overhead() as usize
    }

    fn encode_at(&self, place: &Place, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), CodecError> {
        let mut nonce = [0u8; 24];
        let nonce = &mut nonce[..self.nonce_len()];
        self.nonces.fill(nonce);
        self.seal_chunk(place, nonce, chunk, out)
    }

    fn decode_at(&self, place: &Place, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> Result<(), CodecError> {
        if place.file_id == [0; 16] {
            return Err(CodecError::decode("the file's header has lost its file id, without which no chunk can be authenticated"));
        }
        let n = self.nonce_len();
        if encoded.len() < n + 1 + TAG_BYTES {
            return Err(CodecError::decode(format!("a sealed chunk of {} bytes is too short", encoded.len())));
        }
        let (nonce, rest) = encoded.split_at(n);
        let (sealed, tag) = rest.split_at(rest.len() - TAG_BYTES);
        let start = out.len();
        out.extend_from_slice(sealed);
        if !self.open(place, nonce, &Self::associated_data(place), &mut out[start..], tag) {
            out.truncate(start);
            return Err(CodecError::decode("authentication failed: the chunk was altered, moved from another place or file, or is not this volume's"));
        }
        let kind = out.pop().expect("at least the kind byte");
        if kind == KIND_STORED {
            return Ok(());
        }
        let Some(decoder) = decoder_for(kind) else {
            out.truncate(start);
            return Err(CodecError::decode(format!("unknown compression kind {kind} inside an authentic chunk (written by a newer plyfs?)")));
        };
        SCRATCH.with_borrow_mut(|scratch| {
            scratch.clear();
            scratch.extend_from_slice(&out[start..]);
            out.truncate(start);
            decoder.decode(scratch, decoded_len, out)
        })
    }

    fn plaintext_safe(&self) -> bool {
        false
    }

    fn deterministic(&self) -> bool {
        false
    }

    fn new_file_id(&self) -> Option<[u8; 16]> {
        let mut id = [0u8; 16];
        self.nonces.fill(&mut id);
        Some(id)
    }

    fn info_op(&self) -> Option<ExtOpInfo> {
        Some(INFO_OP)
    }

    fn info(&self, facts: &FileFacts) -> serde_json::Value {
        json!({
            "algorithm": self.cipher.name(),
            "file_id": facts.file_id.map(|id| id.iter().map(|b| format!("{b:02x}")).collect::<String>()),
            "chunk_bytes": facts.chunk_bytes,
            "chunks": facts.chunks,
            "size": facts.size,
            "compression": self.inner.as_ref().map(|(k, _)| match *k {
                KIND_ZSTD => "zstd",
                KIND_DEFLATE => "deflate",
                _ => "lz4",
            }),
        })
    }
}

pub const INFO_OP: ExtOpInfo =
    ExtOpInfo { name: "crypt-info", args: "", help: "the file's id, cipher, chunk size and chunk count" };
