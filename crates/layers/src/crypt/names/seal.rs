//! What names and symlink targets look like below: sealing and opening them, pure functions of
//! the keys and the bytes (the formats are in the header of [`super`]). The reverse view
//! ([`crate::crypt::reverse`]) seals with these too, so both views store the same bytes.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::Aes256Gcm;
use aes_siv::siv::Aes256Siv;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine as _;
use plyfs_stack::{Error, Result};
use sha2::Digest;
use zeroize::Zeroizing;

use crate::crypt::keys::Volume;

/// The lower attribute holding a directory's id.
pub const DIRID_XATTR: &str = "user.plyfs.dirid";
pub(super) const LONG_PREFIX: &str = "L.";
pub(super) const COMPANION_SUFFIX: &str = ".name";
pub(super) const NAME_MAX: usize = 255;
/// The longest symlink target the lower file system stores (ext4: a block less one byte).
const LOWER_LINK_MAX: usize = 4095;
pub(super) const LINK_NONCE: usize = 12;
pub const LINK_OVERHEAD: usize = LINK_NONCE + 16;
/// The prefix of a long target's companion file.
pub(super) const TARGET_PREFIX: &str = "T.";
/// `T.` and 43 characters of hash: a long target's companion file's name.
const TARGET_COMPANION_LEN: usize = 45;
/// The companion's name, a dot and seven digits: what a symlink with a long target points to.
pub const MARKER_LEN: usize = 53;
/// The file that holds a directory's id where the extended attribute cannot (reverse views,
/// copies that drop extended attributes).
pub const DIRID_FILE: &str = ".plyfs-dirid";

/// A name as stored below.
pub enum LowerName {
    /// The whole name.
    Short(OsString),
    /// The hashed name, and the full encrypted name for its companion file.
    Long { hashed: OsString, full: String },
}

impl LowerName {
    pub fn name(&self) -> &OsStr {
        match self {
            LowerName::Short(n) => n,
            LowerName::Long { hashed, .. } => hashed,
        }
    }
}

/// A symlink target as stored below.
pub enum SealedTarget {
    /// The lower symlink's target.
    Inline(OsString),
    /// Too long for a lower symlink: the marker it points to, and the companion holding `blob`.
    Long { marker: OsString, companion: OsString, blob: Vec<u8> },
}

impl SealedTarget {
    /// How `blob` (nonce, sealed target and tag) of a target `len` bytes long is stored.
    pub fn of(blob: Vec<u8>, len: usize) -> SealedTarget {
        let text = B64.encode(&blob);
        if text.len() <= LOWER_LINK_MAX {
            return SealedTarget::Inline(text.into());
        }
        let companion = format!("{TARGET_PREFIX}{}", B64.encode(sha2::Sha256::digest(&blob)));
        debug_assert_eq!(companion.len(), TARGET_COMPANION_LEN);
        let marker = format!("{companion}.{len:07}");
        debug_assert_eq!(marker.len(), MARKER_LEN);
        SealedTarget::Long { marker: marker.into(), companion: companion.into(), blob }
    }
}

/// Seal the name `bytes` (neither empty, `.` nor `..`, at most 255 bytes) of an entry of the
/// directory whose id is `id`: padded to a multiple of 16 bytes, AES-SIV with the id as
/// associated data, base64url; hashed, with a companion, when that passes 255 bytes.
pub fn seal_name(siv_key: &[u8; 64], id: &[u8; 16], bytes: &[u8]) -> Result<LowerName> {
    let pad = 16 - bytes.len() % 16;
    let mut padded = Zeroizing::new(Vec::with_capacity(bytes.len() + pad));
    padded.extend_from_slice(bytes);
    padded.resize(bytes.len() + pad, pad as u8);
    let sealed = Aes256Siv::new(siv_key.into())
        .encrypt([&id[..]], &padded)
        .map_err(|_| Error::Corrupt("name encryption failed".into()))?;
    let full = B64.encode(sealed);
    if full.len() <= NAME_MAX {
        return Ok(LowerName::Short(full.into()));
    }
    let hash = B64.encode(sha2::Sha256::digest(full.as_bytes()));
    Ok(LowerName::Long { hashed: format!("{LONG_PREFIX}{hash}").into(), full })
}

/// The name sealed as `stored` (a short lower name) in the directory whose id is `id`, if it
/// is one: authentic, well padded, and a name (not empty, `.` or `..`, no `/` or NUL).
pub fn open_name(siv_key: &[u8; 64], id: &[u8; 16], stored: &[u8]) -> Option<Vec<u8>> {
    let sealed = B64.decode(stored).ok()?;
    let mut padded = Aes256Siv::new(siv_key.into()).decrypt([&id[..]], &sealed).ok()?;
    let pad = *padded.last()? as usize;
    if pad == 0 || pad > 16 || pad > padded.len() || !padded[padded.len() - pad..].iter().all(|b| *b as usize == pad) {
        return None;
    }
    padded.truncate(padded.len() - pad);
    let ok = !padded.is_empty() && !padded.contains(&b'/') && !padded.contains(&0) && padded != b"." && padded != b"..";
    ok.then_some(padded)
}

/// The keys of a volume's names: AES-SIV for names, and the root directory's id.
pub fn name_keys(volume: &Volume) -> (Zeroizing<[u8; 64]>, [u8; 16]) {
    (volume.key.subkey::<64>("names aes-siv"), *volume.key.subkey::<16>("names root directory id"))
}

/// The companion file of a long name.
pub fn long_name_companion(hashed: &OsStr) -> OsString {
    let mut c = hashed.to_owned();
    c.push(COMPANION_SUFFIX);
    c
}

/// Seal a symlink target: nonce || AES-256-GCM(target) || tag.
pub fn seal_link(key: &Aes256Gcm, nonce: &[u8; LINK_NONCE], target: &[u8]) -> Result<Vec<u8>> {
    let sealed = key
        .encrypt(nonce.into(), Payload { msg: target, aad: b"plyfs symlink" })
        .map_err(|_| Error::Corrupt("symlink encryption failed".into()))?;
    let mut blob = nonce.to_vec();
    blob.extend_from_slice(&sealed);
    Ok(blob)
}

pub(super) fn open_link(key: &Aes256Gcm, blob: &[u8]) -> Option<Vec<u8>> {
    if blob.len() < LINK_OVERHEAD {
        return None;
    }
    key.decrypt(blob[..LINK_NONCE].into(), Payload { msg: &blob[LINK_NONCE..], aad: b"plyfs symlink" }).ok()
}

/// The symlink key of a volume.
pub fn link_key(volume: &Volume) -> Aes256Gcm {
    Aes256Gcm::new_from_slice(&volume.key.subkey::<32>("symlinks aes-256-gcm")[..]).expect("32-byte key")
}

/// The companion name and plaintext length in a marker, if `stored` is one.
pub(super) fn parse_marker(stored: &[u8]) -> Option<(OsString, u64)> {
    if stored.len() != MARKER_LEN || !stored.starts_with(TARGET_PREFIX.as_bytes()) || stored[TARGET_COMPANION_LEN] != b'.' {
        return None;
    }
    let len = std::str::from_utf8(&stored[TARGET_COMPANION_LEN + 1..]).ok()?.parse().ok()?;
    Some((OsStr::from_bytes(&stored[..TARGET_COMPANION_LEN]).to_owned(), len))
}

/// The plaintext length of a target whose sealed form is `lower` bytes of base64.
pub(super) fn sealed_target_len(lower: u64) -> u64 {
    (lower * 3 / 4).saturating_sub(LINK_OVERHEAD as u64)
}

/// Names of this layer's own files, which the user never sees: a directory's id and the
/// companions of long names and long targets.
pub(super) fn is_aux(name: &[u8]) -> bool {
    name == DIRID_FILE.as_bytes()
        || (name.starts_with(LONG_PREFIX.as_bytes()) && name.ends_with(COMPANION_SUFFIX.as_bytes()))
        || (name.len() == TARGET_COMPANION_LEN && name.starts_with(TARGET_PREFIX.as_bytes()))
}
