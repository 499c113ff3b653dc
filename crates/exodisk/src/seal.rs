//! Records sealed under the volume key and bound to where they live.
//!
//! The thesis stored capabilities and magic numbers encrypted, salted by sector number, and
//! noted that a MAC would be stronger: an attacker with the raw disk could otherwise edit a
//! header it knows to cover sectors it does not own. Here every piece of protection metadata
//! (superblock, free map, extent headers, exonodes) is sealed with XChaCha20-Poly1305 under the
//! volume key. The associated data binds the record to its kind, its volume and its sector, so a
//! record copied to another place, another volume, or edited by a single bit does not open.
//! Capabilities are encrypted as well: a copy of the image does not reveal them.
//!
//! A sealed record fills whole sectors: `magic (8) | sectors (u32 LE) | 0 (4) | nonce (24) |
//! ciphertext | tag (16)`, its body padded to fill them. The magic and the length are in clear
//! (and authenticated), so that a scan can skip sectors that hold no record without trying to
//! open them, and knows how much to read for one that spans several sectors.

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use zeroize::Zeroizing;

pub const SECTOR: usize = 512;
pub const MAGIC_LEN: usize = 8;
const LEN_LEN: usize = 8;
pub const NONCE_LEN: usize = 24;
pub const TAG_LEN: usize = 16;
/// Bytes a sealed record takes beyond its body.
pub const OVERHEAD: usize = MAGIC_LEN + LEN_LEN + NONCE_LEN + TAG_LEN;

/// The body a record of `sectors` sectors holds.
pub const fn body_len(sectors: u32) -> usize {
    sectors as usize * SECTOR - OVERHEAD
}

/// The kinds of record, by their magic.
pub const SUPERBLOCK: &[u8; 8] = b"PLYEXOSB";
pub const FREE_MAP: &[u8; 8] = b"PLYEXOFM";
pub const EXTENT: &[u8; 8] = b"PLYEXOEX";
pub const EXONODE: &[u8; 8] = b"PLYEXOXN";
pub const ROOTS: &[u8; 8] = b"PLYEXORT";

/// The volume's secret: the key that seals its records, and its identity.
pub struct VolumeKey {
    cipher: XChaCha20Poly1305,
    /// Seals extent data (`content`): a key of its own, derived from the volume key, so that
    /// records and data never share a key.
    data_key: Zeroizing<[u8; 32]>,
    pub volume_id: [u8; 16],
}

impl VolumeKey {
    pub fn new(key: &[u8; 32], volume_id: [u8; 16]) -> VolumeKey {
        let mut data_key = Zeroizing::new([0u8; 32]);
        hkdf::Hkdf::<sha2::Sha256>::new(Some(&volume_id), key)
            .expand(b"plyfs exodisk extent data", &mut data_key[..])
            .expect("32 bytes is a valid HKDF-SHA256 output");
        VolumeKey { cipher: XChaCha20Poly1305::new(key.into()), data_key, volume_id }
    }

    /// The key that seals extent data.
    pub fn data_key(&self) -> crate::content::DataKey {
        crate::content::DataKey::new(self.data_key.clone(), self.volume_id)
    }

    fn aad(&self, magic: &[u8; 8], at: u64, sectors: u32) -> [u8; 36] {
        let mut aad = [0u8; 36];
        aad[..8].copy_from_slice(magic);
        aad[8..24].copy_from_slice(&self.volume_id);
        aad[24..32].copy_from_slice(&at.to_le_bytes());
        aad[32..].copy_from_slice(&sectors.to_le_bytes());
        aad
    }

    /// Seal `body` (at most [`body_len`]`(sectors)` bytes; zeros fill the rest) as a record of
    /// kind `magic` taking `sectors` sectors from sector `at`.
    pub fn seal(&self, magic: &[u8; 8], at: u64, sectors: u32, body: &[u8]) -> Vec<u8> {
        let len = body_len(sectors);
        assert!(body.len() <= len, "a record body of {} bytes does not fit {sectors} sectors", body.len());
        let mut padded = Zeroizing::new(vec![0u8; len]);
        padded[..body.len()].copy_from_slice(body);
        let nonce: [u8; NONCE_LEN] = random();
        let aad = self.aad(magic, at, sectors);
        let ct = self
            .cipher
            .encrypt(XNonce::from_slice(&nonce), Payload { msg: &padded, aad: &aad })
            .expect("XChaCha20-Poly1305 encrypts any length we use");
        let mut out = Vec::with_capacity(sectors as usize * SECTOR);
        out.extend_from_slice(magic);
        out.extend_from_slice(&sectors.to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        debug_assert_eq!(out.len(), sectors as usize * SECTOR);
        out
    }

    /// Open a record of kind `magic` at sector `at` (all of its sectors in `sealed`): its body.
    pub fn open(&self, magic: &[u8; 8], at: u64, sealed: &[u8]) -> Result<Zeroizing<Vec<u8>>, SealError> {
        let sectors = record_sectors(sealed, magic).ok_or(SealError::NotThere)?;
        let len = sectors as usize * SECTOR;
        if sealed.len() < len {
            return Err(SealError::Short);
        }
        let start = MAGIC_LEN + LEN_LEN;
        let nonce = XNonce::from_slice(&sealed[start..start + NONCE_LEN]);
        let aad = self.aad(magic, at, sectors);
        self.cipher
            .decrypt(nonce, Payload { msg: &sealed[start + NONCE_LEN..len], aad: &aad })
            .map(Zeroizing::new)
            .map_err(|_| SealError::Forged)
    }
}

/// How many sectors the record of kind `magic` that starts in `first` takes, if one starts
/// there (not yet checked to be genuine).
pub fn record_sectors(first: &[u8], magic: &[u8; 8]) -> Option<u32> {
    if first.len() < MAGIC_LEN + LEN_LEN || &first[..MAGIC_LEN] != magic || first[12..16] != [0; 4] {
        return None;
    }
    let sectors = u32::from_le_bytes(first[8..12].try_into().expect("4 bytes"));
    (1..=MAX_RECORD_SECTORS).contains(&sectors).then_some(sectors)
}

/// The longest record: 1 MiB.
pub const MAX_RECORD_SECTORS: u32 = 2048;

/// Why a record did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealError {
    /// No record of this kind starts here.
    NotThere,
    /// Fewer bytes than the record needs.
    Short,
    /// The magic is there, but the record was altered, moved, or sealed under another key.
    Forged,
}

impl std::fmt::Display for SealError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SealError::NotThere => "no record here",
            SealError::Short => "truncated",
            SealError::Forged => "altered, moved or sealed under another key (authentication failed)",
        })
    }
}

/// Random bytes from the operating system.
pub fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).expect("the operating system's random source");
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_opens_only_where_and_as_what_it_was_sealed() {
        let key = VolumeKey::new(&[7u8; 32], [1u8; 16]);
        let sealed = key.seal(EXTENT, 100, 1, b"capabilities");
        assert_eq!(sealed.len(), SECTOR);
        assert_eq!(&key.open(EXTENT, 100, &sealed).unwrap()[..12], b"capabilities");
        assert_eq!(key.open(EXTENT, 101, &sealed), Err(SealError::Forged));
        assert_eq!(key.open(EXONODE, 100, &sealed), Err(SealError::NotThere));
        let other = VolumeKey::new(&[7u8; 32], [2u8; 16]);
        assert_eq!(other.open(EXTENT, 100, &sealed), Err(SealError::Forged));
        for i in MAGIC_LEN..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 1;
            assert!(key.open(EXTENT, 100, &bad).is_err(), "byte {i}");
        }
        // The capabilities are not in clear.
        assert!(!sealed.windows(12).any(|w| w == b"capabilities"));
        // Several sectors, and a length that lies.
        let big = key.seal(EXONODE, 8, 3, &[5u8; 1000]);
        assert_eq!(big.len(), 3 * SECTOR);
        assert_eq!(&key.open(EXONODE, 8, &big).unwrap()[..1000], &[5u8; 1000][..]);
        assert_eq!(key.open(EXONODE, 8, &big[..2 * SECTOR]), Err(SealError::Short));
        let mut lie = big.clone();
        lie[8] = 2;
        assert_eq!(key.open(EXONODE, 8, &lie), Err(SealError::Forged));
    }
}
