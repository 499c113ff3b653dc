//! The chunk cipher: each chunk sealed with an AEAD under the volume's data key.
//!
//! ```text
//! payload   = nonce || ciphertext || tag (16)
//! plaintext = body || kind (1)       kind 0: body is the chunk; 1 zstd, 2 deflate, 3 lz4:
//!                                    body is the chunk compressed (a collapsed pipeline)
//! AD        = "plyfs crypt v1" || file id (16) || first chunk (u64 LE) || chunk count (u64 LE)
//! ```
//!
//! The nonce is fresh and random for every seal: 16 bytes for AES-256-GCM (as gocryptfs, which
//! keeps random nonces far from collision), 24 for XChaCha20-Poly1305. The associated data binds
//! the payload to its file (the random id in the file header) and its place in it, so a chunk
//! copied to another position or file, or any altered byte, fails to open: EIO, never garbage.
//! A run of zero chunks (a hole) is one payload bound to the whole run.
//!
//! Because the compression kind is inside the sealed plaintext, every crypt layer reads every
//! chunk, whether a collapsed `zstd,crypt` pipeline or a plain `crypt` wrote it.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use aes_gcm::aead::consts::U16;
use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::aes::Aes256;
use aes_gcm::AesGcm;
use chacha20poly1305::XChaCha20Poly1305;
use plyfs_sca::{Codec, FileFacts, Place};
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
    static ZSTD: crate::zstd::Zstd = crate::zstd::Zstd::new(3);
    static DEFLATE: crate::gzip::Gzip = crate::gzip::Gzip::new(6);
    static LZ4: crate::lz4::Lz4 = crate::lz4::Lz4;
    match kind {
        KIND_ZSTD => Some(&ZSTD),
        KIND_DEFLATE => Some(&DEFLATE),
        KIND_LZ4 => Some(&LZ4),
        _ => None,
    }
}

enum Sealer {
    Gcm(Box<AesGcm<Aes256, U16>>),
    XChaCha(Box<XChaCha20Poly1305>),
}

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
            CipherKind::Aes256Gcm => {
                let k = key.subkey::<32>("data aes-256-gcm");
                Sealer::Gcm(Box::new(AesGcm::new_from_slice(&k[..]).expect("32-byte key")))
            }
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

    fn nonce_len(&self) -> usize {
        match self.sealer {
            Sealer::Gcm(_) => 16,
            Sealer::XChaCha(_) => 24,
        }
    }

    fn associated_data(place: &Place) -> [u8; 46] {
        let mut ad = [0u8; 46];
        ad[..14].copy_from_slice(AD_PREFIX);
        ad[14..30].copy_from_slice(&place.file_id);
        ad[30..38].copy_from_slice(&place.chunk.to_le_bytes());
        ad[38..46].copy_from_slice(&place.count.to_le_bytes());
        ad
    }

    fn seal(&self, nonce: &[u8], ad: &[u8], buf: &mut [u8]) -> Result<[u8; TAG_BYTES], String> {
        let tag = match &self.sealer {
            Sealer::Gcm(c) => c.encrypt_in_place_detached(nonce.into(), ad, buf),
            Sealer::XChaCha(c) => c.encrypt_in_place_detached(nonce.into(), ad, buf),
        };
        tag.map(|t| t.into()).map_err(|_| "sealing failed".to_owned())
    }

    fn open(&self, nonce: &[u8], ad: &[u8], buf: &mut [u8], tag: &[u8]) -> bool {
        match &self.sealer {
            Sealer::Gcm(c) => c.decrypt_in_place_detached(nonce.into(), ad, buf, tag.into()).is_ok(),
            Sealer::XChaCha(c) => c.decrypt_in_place_detached(nonce.into(), ad, buf, tag.into()).is_ok(),
        }
    }
}

impl Codec for CryptCodec {
    fn tag(&self) -> [u8; 4] {
        match self.cipher {
            CipherKind::Aes256Gcm => *b"cryG",
            CipherKind::XChaCha20Poly1305 => *b"cryX",
        }
    }

    fn encode(&self, _chunk: &[u8], _out: &mut Vec<u8>) -> Result<(), String> {
        Err("a chunk cannot be encrypted without its place".into())
    }

    fn decode(&self, _encoded: &[u8], _decoded_len: usize, _out: &mut Vec<u8>) -> Result<(), String> {
        Err("a chunk cannot be decrypted without its place".into())
    }

    fn encode_at(&self, place: &Place, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        let start = out.len();
        let mut nonce = [0u8; 24];
        let nonce = &mut nonce[..self.nonce_len()];
        self.nonces.fill(nonce);
        out.extend_from_slice(nonce);
        let body = out.len();
        let kind = match &self.inner {
            Some((kind, codec)) => {
                out.reserve(chunk.len() + 1 + TAG_BYTES);
                let compressed = codec.encode(chunk, out).is_ok() && out.len() - body < chunk.len();
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
        match self.seal(nonce, &Self::associated_data(place), &mut out[body..]) {
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

    fn decode_at(&self, place: &Place, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> Result<(), String> {
        if place.file_id == [0; 16] {
            return Err("the file's header has lost its file id, without which no chunk can be authenticated".into());
        }
        let n = self.nonce_len();
        if encoded.len() < n + 1 + TAG_BYTES {
            return Err(format!("a sealed chunk of {} bytes is too short", encoded.len()));
        }
        let (nonce, rest) = encoded.split_at(n);
        let (sealed, tag) = rest.split_at(rest.len() - TAG_BYTES);
        let start = out.len();
        out.extend_from_slice(sealed);
        if !self.open(nonce, &Self::associated_data(place), &mut out[start..], tag) {
            out.truncate(start);
            return Err("authentication failed: the chunk was altered, moved from another place or file, or is not this volume's".into());
        }
        let kind = out.pop().expect("at least the kind byte");
        if kind == KIND_STORED {
            return Ok(());
        }
        let Some(decoder) = decoder_for(kind) else {
            out.truncate(start);
            return Err(format!("unknown compression kind {kind} inside an authentic chunk (written by a newer plyfs?)"));
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
