//! A crypt volume's keys: the configuration file at the root of the lower directory, the
//! master key wrapped in it, and the keyring that unlocked volumes live in.
//!
//! The master key is 32 random bytes. It is stored only wrapped: sealed with AES-256-GCM under
//! a key-encryption key (KEK) derived from a password by Argon2id, or from a key file by
//! HKDF-SHA256. The volume's settings are the associated data of that seal, so editing them in
//! the file makes unlocking fail instead of changing how data is read. Changing the password
//! re-wraps the same master key: no data is re-encrypted.
//!
//! Keys in memory are zeroized when dropped and never logged; `Debug` prints no key bytes.
//!
//! **Recovery.** `init` shows the master key once, as 64 hex digits in groups of eight and a
//! ninth group checking them ([`MasterKey::recovery_text`]). Given back (`--masterkey`), it
//! unlocks the volume without the password, and `passwd` can wrap it under a new one. The
//! configuration holds `key_check`, a one-way digest of the master key (HKDF), so a wrong key
//! is refused before anything is mounted.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::Aes256Gcm;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use zeroize::{Zeroize, Zeroizing};

use crate::Error;

/// The configuration file's name in the lower directory's root.
pub const CONFIG_NAME: &str = ".plyfs-crypt.conf";
const CONFIG_VERSION: u32 = 1;
/// The version of a volume whose files are bound to their places (`plyfs init --bind-paths`):
/// the version is the setting, with no field of its own, so a plyfs that knows only version 1
/// refuses it in so many words ("version 2 is not supported") instead of reading files without
/// checking their places (a new field would make it say "unknown field").
const CONFIG_VERSION_BOUND: u32 = 2;
/// Argon2id memory cost for new volumes, in KiB (64 MiB, as gocryptfs' scrypt).
pub const DEFAULT_KDF_MEMORY_KIB: u32 = 64 << 10;
const KDF_ITERATIONS: u32 = 3;
const KDF_LANES: u32 = 1;
/// The least memory cost accepted (tests use it to stay fast).
pub const MIN_KDF_MEMORY_KIB: u32 = 1 << 10;

/// The authenticated cipher sealing each chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CipherKind {
    #[serde(rename = "aes-256-gcm")]
    Aes256Gcm,
    #[serde(rename = "xchacha20-poly1305")]
    XChaCha20Poly1305,
}

impl CipherKind {
    pub fn name(self) -> &'static str {
        match self {
            CipherKind::Aes256Gcm => "aes-256-gcm",
            CipherKind::XChaCha20Poly1305 => "xchacha20-poly1305",
        }
    }

    pub fn parse(s: &str) -> Result<CipherKind, Error> {
        match s.to_ascii_lowercase().as_str() {
            "aes-256-gcm" | "aes" | "aes-gcm" | "gcm" => Ok(CipherKind::Aes256Gcm),
            "xchacha20-poly1305" | "xchacha" | "xchacha20" | "chacha" => Ok(CipherKind::XChaCha20Poly1305),
            _ => Err(Error::UnknownCipher { name: s.to_owned() }),
        }
    }
}

/// What unlocks a volume.
pub enum Secret {
    Password(Zeroizing<String>),
    KeyFile(Zeroizing<Vec<u8>>),
    /// The master key itself (recovery).
    MasterKey(MasterKey),
}

impl Secret {
    fn kind(&self) -> &'static str {
        match self {
            Secret::Password(_) => "password",
            Secret::KeyFile(_) => "key file",
            Secret::MasterKey(_) => "master key",
        }
    }
}

/// The master key of an unlocked volume.
#[derive(Clone)]
pub struct MasterKey(Zeroizing<[u8; 32]>);

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl MasterKey {
    pub fn from_bytes(bytes: [u8; 32]) -> MasterKey {
        MasterKey(Zeroizing::new(bytes))
    }

    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key as a person writes it down: 64 hex digits in eight groups, and a ninth group of
    /// eight checking them (SHA-256), which catches a mistyped digit.
    pub fn recovery_text(&self) -> Zeroizing<String> {
        let mut digits = Zeroizing::new(hex(&self.0[..]));
        digits.push_str(&hex(&recovery_check(&self.0)));
        let groups: Vec<&str> = (0..digits.len()).step_by(8).map(|i| &digits[i..i + 8]).collect();
        Zeroizing::new(groups.join("-"))
    }

    /// Read a key written as [`MasterKey::recovery_text`] shows it; dashes, spaces and case do
    /// not matter, and the check group may be left out.
    pub fn from_recovery_text(text: &str) -> Result<MasterKey, Error> {
        let bad = |why: String| Error::BadMasterKey { why };
        let digits: Zeroizing<String> =
            Zeroizing::new(text.chars().filter(|c| !c.is_whitespace() && *c != '-').map(|c| c.to_ascii_lowercase()).collect());
        if digits.is_empty() {
            return Err(bad("is empty".into()));
        }
        if let Some(c) = digits.chars().find(|c| !c.is_ascii_hexdigit()) {
            return Err(bad(format!("holds '{c}', which is not a hex digit")));
        }
        if digits.len() != 64 && digits.len() != 72 {
            return Err(bad(format!("has {} hex digits, not 72 (nine groups of eight)", digits.len())));
        }
        let key: [u8; 32] = unhex(&digits[..64]).ok_or_else(|| bad("is not hex".into()))?;
        let key = MasterKey::from_bytes(key);
        if digits.len() == 72 && digits[64..] != hex(&recovery_check(&key.0)) {
            return Err(bad("is mistyped: its last group does not match the others".into()));
        }
        Ok(key)
    }

    /// What the configuration keeps to recognise the key: a one-way digest of it.
    fn check_value(&self) -> String {
        hex(&self.subkey::<16>("master key check")[..])
    }

    /// A key for one purpose, derived with HKDF-SHA256, so that no two uses share a key.
    pub fn subkey<const N: usize>(&self, purpose: &str) -> Zeroizing<[u8; N]> {
        let mut out = Zeroizing::new([0u8; N]);
        hkdf::Hkdf::<sha2::Sha256>::new(Some(b"plyfs crypt v1"), &self.0[..])
            .expand(purpose.as_bytes(), &mut out[..])
            .expect("HKDF output length is small");
        out
    }
}

/// How the key-encryption key is derived.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "algorithm", rename_all = "lowercase", deny_unknown_fields)]
pub enum Kdf {
    Argon2id { salt: String, memory_kib: u32, iterations: u32, lanes: u32 },
    Keyfile { salt: String },
}

/// The volume configuration file: settings and the wrapped master key. Nothing in it is
/// secret without the password or key file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeConfig {
    pub version: u32,
    /// Random, hex: tells volumes apart in the keyring.
    pub volume_id: String,
    pub cipher: CipherKind,
    pub plaintext_names: bool,
    pub kdf: Kdf,
    /// base64 of nonce (12) || sealed master key (32) || tag (16).
    pub wrapped_key: String,
    /// A one-way digest of the master key, to recognise it when it is given for recovery.
    /// Volumes made before recovery keys have none until their password is next changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_check: Option<String>,
    /// How new files' sizes are padded (`padme`); none when absent. The default of every
    /// crypt layer over the volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad: Option<String>,
    /// Each file's content is bound to its place (directory id and name) by a MAC that is
    /// checked at open (see [`super::bind`]): version 2.
    #[serde(skip)]
    pub bind_paths: bool,
}

/// Settings chosen when a volume is created.
#[derive(Clone, Debug)]
pub struct VolumeSettings {
    pub cipher: CipherKind,
    pub plaintext_names: bool,
    pub kdf_memory_kib: u32,
    /// Pad new files' sizes (PADMÉ).
    pub pad: bool,
    /// Bind each file's content to its place (`plyfs init --bind-paths`).
    pub bind_paths: bool,
}

impl Default for VolumeSettings {
    fn default() -> Self {
        VolumeSettings {
            cipher: CipherKind::Aes256Gcm,
            plaintext_names: false,
            kdf_memory_kib: DEFAULT_KDF_MEMORY_KIB,
            pad: false,
            bind_paths: false,
        }
    }
}

/// An unlocked volume: its settings and master key.
#[derive(Debug)]
pub struct Volume {
    pub id: [u8; 16],
    pub cipher: CipherKind,
    pub plaintext_names: bool,
    /// New files are padded (the volume was made with `--pad padme`).
    pub pad: bool,
    /// Files are bound to their places (the volume was made with `--bind-paths`).
    pub bind_paths: bool,
    pub key: MasterKey,
}

pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).expect("the system's random number generator failed");
    b
}

fn recovery_check(key: &[u8; 32]) -> [u8; 4] {
    use sha2::Digest;
    let d = sha2::Sha256::new().chain_update(b"plyfs recovery key").chain_update(key).finalize();
    d[..4].try_into().expect("4 bytes")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

pub fn config_path(lower: &Path) -> PathBuf {
    lower.join(CONFIG_NAME)
}

impl VolumeConfig {
    /// What the wrapped key's seal authenticates: every setting that changes how data is
    /// read, and the KDF (so its cost cannot be lowered behind the owner's back).
    fn associated_data(&self) -> Vec<u8> {
        let kdf = toml::to_string(&self.kdf).unwrap_or_default();
        let mut ad = format!(
            "plyfs-crypt-config|{}|{}|{}|{}|{}",
            self.version,
            self.volume_id,
            self.cipher.name(),
            self.plaintext_names,
            kdf
        );
        if let Some(check) = &self.key_check {
            ad.push_str(&format!("|{check}"));
        }
        if let Some(pad) = &self.pad {
            ad.push_str(&format!("|pad={pad}"));
        }
        if self.bind_paths {
            ad.push_str("|bind_paths");
        }
        ad.into_bytes()
    }

    /// The key-encryption key from `secret`, for the volume configured in `shown`.
    fn derive_kek(&self, secret: &Secret, shown: &str) -> Result<Zeroizing<[u8; 32]>, Error> {
        let kdf = |why: String| Error::Kdf { path: shown.to_owned(), why };
        let mut kek = Zeroizing::new([0u8; 32]);
        match (&self.kdf, secret) {
            (Kdf::Argon2id { salt, memory_kib, iterations, lanes }, Secret::Password(pw)) => {
                let salt = B64.decode(salt).map_err(|e| kdf(format!("kdf salt: {e}")))?;
                let params = argon2::Params::new(*memory_kib, *iterations, *lanes, Some(32)).map_err(|e| kdf(format!("kdf parameters: {e}")))?;
                argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params)
                    .hash_password_into(pw.as_bytes(), &salt, &mut kek[..])
                    .map_err(|e| kdf(format!("argon2id: {e}")))?;
            }
            (Kdf::Keyfile { salt }, Secret::KeyFile(bytes)) => {
                let salt = B64.decode(salt).map_err(|e| kdf(format!("kdf salt: {e}")))?;
                hkdf::Hkdf::<sha2::Sha256>::new(Some(&salt), bytes)
                    .expand(b"plyfs crypt key file", &mut kek[..])
                    .expect("HKDF output length is small");
            }
            (_, Secret::MasterKey(_)) => return Err(kdf("a master key is not wrapped: it is the key".into())),
            (Kdf::Argon2id { .. }, s) => return Err(Error::WrongSecretKind { path: shown.to_owned(), takes: "password", given: s.kind() }),
            (Kdf::Keyfile { .. }, s) => return Err(Error::WrongSecretKind { path: shown.to_owned(), takes: "key file", given: s.kind() }),
        }
        Ok(kek)
    }

    fn wrap(&mut self, key: &MasterKey, secret: &Secret, shown: &str) -> Result<(), Error> {
        let kek = self.derive_kek(secret, shown)?;
        let nonce: [u8; 12] = random_bytes();
        let sealed = Aes256Gcm::new_from_slice(&kek[..])
            .expect("32-byte key")
            .encrypt((&nonce).into(), Payload { msg: key.bytes(), aad: &self.associated_data() })
            .map_err(|_| Error::Seal { path: shown.to_owned() })?;
        let mut blob = nonce.to_vec();
        blob.extend_from_slice(&sealed);
        self.wrapped_key = B64.encode(&blob);
        Ok(())
    }

    fn unwrap_key(&self, secret: &Secret, shown: &str) -> Result<MasterKey, Error> {
        if let Secret::MasterKey(key) = secret {
            return match &self.key_check {
                Some(check) if *check == key.check_value() => Ok(key.clone()),
                Some(_) => Err(Error::WrongSecret { path: shown.to_owned(), secret: secret.kind() }),
                None => Err(Error::MasterKeyUnchecked { path: shown.to_owned() }),
            };
        }
        let kek = self.derive_kek(secret, shown)?;
        let corrupt = |why: String| Error::Corrupt { path: shown.to_owned(), why };
        let blob = B64.decode(&self.wrapped_key).map_err(|e| corrupt(format!("wrapped_key: {e}")))?;
        if blob.len() != 12 + 32 + 16 {
            return Err(corrupt(format!("wrapped_key has {} bytes, not 60", blob.len())));
        }
        let mut opened = Aes256Gcm::new_from_slice(&kek[..])
            .expect("32-byte key")
            .decrypt(blob[..12].into(), Payload { msg: &blob[12..], aad: &self.associated_data() })
            .map_err(|_| Error::WrongSecret { path: shown.to_owned(), secret: secret.kind() })?;
        let mut bytes = [0u8; 32];
        bytes.copy_from_slice(&opened);
        opened.zeroize();
        Ok(MasterKey::from_bytes(bytes))
    }

    pub fn id(&self) -> Result<[u8; 16], Error> {
        unhex(&self.volume_id).ok_or_else(|| Error::BadVolumeId { id: self.volume_id.clone() })
    }

    /// Whether new files are padded, as the configuration says.
    pub fn pads(&self) -> Result<bool, Error> {
        match self.pad.as_deref() {
            None | Some("none") => Ok(false),
            Some("padme") => Ok(true),
            Some(other) => Err(Error::Unsupported {
                path: "the volume configuration".into(),
                why: format!("pad = \"{other}\" is not known to this plyfs (it knows padme)"),
            }),
        }
    }

    pub fn uses_password(&self) -> bool {
        matches!(self.kdf, Kdf::Argon2id { .. })
    }

    /// Parse and check a configuration file's text.
    pub fn parse(text: &str, shown: &str) -> Result<VolumeConfig, Error> {
        let corrupt = |why: String| Error::Corrupt { path: shown.to_owned(), why };
        /// The version alone, read first: a newer file's other fields are not this plyfs's to judge.
        #[derive(Deserialize)]
        struct Version {
            version: u32,
        }
        let v: Version = toml::from_str(text).map_err(|e| corrupt(e.message().to_owned()))?;
        if v.version != CONFIG_VERSION && v.version != CONFIG_VERSION_BOUND {
            return Err(Error::Unsupported {
                path: shown.to_owned(),
                why: format!(
                    "version {} is not supported by this plyfs (it knows versions {CONFIG_VERSION} and {CONFIG_VERSION_BOUND})",
                    v.version
                ),
            });
        }
        let mut c: VolumeConfig = toml::from_str(text).map_err(|e| corrupt(e.message().to_owned()))?;
        c.bind_paths = c.version == CONFIG_VERSION_BOUND;
        c.id().map_err(|_| corrupt(format!("volume_id '{}' is not 32 hex digits", c.volume_id)))?;
        Ok(c)
    }

    /// Read the configuration of the volume at `lower`.
    pub fn load(lower: &Path) -> Result<VolumeConfig, Error> {
        Self::load_file(lower, &config_path(lower), " --layer crypt")
    }

    /// Read the configuration in `path`, of the volume at `lower`; `init_flag` is what
    /// `plyfs init` takes to make one (for the message when it is missing).
    pub fn load_file(lower: &Path, path: &Path, init_flag: &str) -> Result<VolumeConfig, Error> {
        let shown = path.display().to_string();
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                return Err(Error::NotAVolume { dir: lower.to_owned(), file, init_flag: init_flag.to_owned() });
            }
            Err(e) => return Err(Error::io("reading the volume configuration", path)(e)),
        };
        let text = String::from_utf8(text).map_err(|_| Error::Corrupt { path: shown.clone(), why: "not text".into() })?;
        VolumeConfig::parse(&text, &shown)
    }

    /// Write the configuration atomically: a temporary file, fsynced, renamed over the old
    /// one, and the directory fsynced. A crash leaves the old file or the new one.
    fn store(&self, path: &Path) -> Result<(), Error> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let text = format!(
            "# plyfs crypt volume: the settings and the wrapped master key. Without this file the\n\
             # data cannot be decrypted: back it up. Editing it makes unlocking fail.\n{}",
            toml::to_string(self).map_err(|e| Error::io("writing the volume configuration", path)(std::io::Error::other(e)))?
        );
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode_0400().open(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            std::fs::File::open(dir)?.sync_all()
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io("writing the volume configuration", path)(e)
        })
    }
}

trait Mode0400 {
    fn mode_0400(&mut self) -> &mut Self;
}

impl Mode0400 for std::fs::OpenOptions {
    fn mode_0400(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o400)
    }
}

fn new_kdf(secret: &Secret, memory_kib: u32) -> Result<Kdf, Error> {
    let bad = |why: String| Error::BadSecret { why };
    let salt = B64.encode(random_bytes::<32>());
    Ok(match secret {
        Secret::Password(pw) => {
            if pw.is_empty() {
                return Err(bad("the password is empty".into()));
            }
            if memory_kib < MIN_KDF_MEMORY_KIB {
                return Err(bad(format!("kdf memory {memory_kib} KiB is below the least allowed, {MIN_KDF_MEMORY_KIB} KiB")));
            }
            Kdf::Argon2id { salt, memory_kib, iterations: KDF_ITERATIONS, lanes: KDF_LANES }
        }
        Secret::KeyFile(bytes) => {
            if bytes.len() < 32 {
                return Err(bad(format!("the key file holds {} bytes: at least 32 random bytes are needed", bytes.len())));
            }
            Kdf::Keyfile { salt }
        }
        Secret::MasterKey(_) => return Err(bad("the new secret must be a password or a key file, not a master key".into())),
    })
}

/// Create a volume at `lower`: a new random master key, wrapped with `secret`. Returns the
/// configuration and the master key (for the owner to write down).
pub fn init(lower: &Path, settings: &VolumeSettings, secret: &Secret) -> Result<(VolumeConfig, MasterKey), Error> {
    init_file(lower, &config_path(lower), settings, secret, true)
}

/// Create a volume whose configuration is the file `path` (for a directory `lower` that
/// holds the data; `empty`: it must hold nothing yet, unless names stay plaintext).
pub fn init_file(lower: &Path, path: &Path, settings: &VolumeSettings, secret: &Secret, empty: bool) -> Result<(VolumeConfig, MasterKey), Error> {
    if path.exists() {
        let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        return Err(Error::AlreadyAVolume { dir: lower.to_owned(), file });
    }
    if settings.bind_paths && settings.plaintext_names {
        return Err(Error::BadSettings {
            why: "--bind-paths binds files to their directories' ids, which only encrypted names have: leave out --plaintext-names",
        });
    }
    if empty && !settings.plaintext_names {
        // (The lower lock's file is hidden from every mount, so it needs no name.)
        let mut entries = std::fs::read_dir(lower).map_err(Error::io("listing the directory", lower))?;
        if entries.any(|e| e.map_or(true, |e| !plyfs_stack::lowerlock::is_lock_file(&e.file_name()))) {
            return Err(Error::NotEmpty { dir: lower.to_owned() });
        }
    }
    let mut config = VolumeConfig {
        version: if settings.bind_paths { CONFIG_VERSION_BOUND } else { CONFIG_VERSION },
        volume_id: hex(&random_bytes::<16>()),
        cipher: settings.cipher,
        plaintext_names: settings.plaintext_names,
        kdf: new_kdf(secret, settings.kdf_memory_kib)?,
        wrapped_key: String::new(),
        key_check: None,
        pad: settings.pad.then(|| "padme".to_owned()),
        bind_paths: settings.bind_paths,
    };
    let key = MasterKey::from_bytes(random_bytes());
    config.key_check = Some(key.check_value());
    config.wrap(&key, secret, &path.display().to_string())?;
    config.store(path)?;
    Ok((config, key))
}

/// Unlock the volume at `lower` with `secret`.
pub fn unlock(lower: &Path, secret: &Secret) -> Result<Volume, Error> {
    let config = VolumeConfig::load(lower)?;
    unlock_config(&config, &config_path(lower).display().to_string(), secret)
}

/// Unlock the volume of `config` (read from `shown`) with `secret`.
pub fn unlock_config(config: &VolumeConfig, shown: &str, secret: &Secret) -> Result<Volume, Error> {
    let key = config.unwrap_key(secret, shown)?;
    let in_file = |e: Error| match e {
        Error::Unsupported { why, .. } => Error::Unsupported { path: shown.to_owned(), why },
        Error::BadVolumeId { id } => Error::Corrupt { path: shown.to_owned(), why: format!("volume_id '{id}' is not 32 hex digits") },
        other => other,
    };
    Ok(Volume {
        id: config.id().map_err(in_file)?,
        cipher: config.cipher,
        plaintext_names: config.plaintext_names,
        pad: config.pads().map_err(in_file)?,
        bind_paths: config.bind_paths,
        key,
    })
}

/// Re-wrap the master key of the volume at `lower` for `new`, after unlocking it with `old`.
pub fn change_secret(lower: &Path, old: &Secret, new: &Secret) -> Result<(), Error> {
    change_secret_file(lower, &config_path(lower), old, new)
}

/// [`change_secret`] of the volume configured in the file `path`.
pub fn change_secret_file(lower: &Path, path: &Path, old: &Secret, new: &Secret) -> Result<(), Error> {
    let mut config = VolumeConfig::load_file(lower, path, " --layer crypt")?;
    let shown = path.display().to_string();
    let key = config.unwrap_key(old, &shown)?;
    let memory_kib = match &config.kdf {
        Kdf::Argon2id { memory_kib, .. } => *memory_kib,
        Kdf::Keyfile { .. } => DEFAULT_KDF_MEMORY_KIB,
    };
    config.kdf = new_kdf(new, memory_kib)?;
    // The key was checked (by its wrap, or against the check value): keep its check value.
    config.key_check = Some(key.check_value());
    config.wrap(&key, new, &shown)?;
    config.store(path)
}

/// Unlocked volumes by id, for crypt layers to find their key when they are built.
fn keyring() -> &'static Mutex<HashMap<[u8; 16], Arc<Volume>>> {
    static KEYRING: OnceLock<Mutex<HashMap<[u8; 16], Arc<Volume>>>> = OnceLock::new();
    KEYRING.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Make an unlocked volume's key available to the crypt layers built after this.
pub fn register(volume: Volume) -> Arc<Volume> {
    let v = Arc::new(volume);
    keyring().lock().insert(v.id, v.clone());
    v
}

/// The unlocked volume with this id, if any.
pub fn registered(id: &[u8; 16]) -> Option<Arc<Volume>> {
    keyring().lock().get(id).cloned()
}

/// Forget a volume's key (at unmount).
pub fn forget(id: &[u8; 16]) {
    keyring().lock().remove(id);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pw(s: &str) -> Secret {
        Secret::Password(Zeroizing::new(s.to_owned()))
    }

    fn fast() -> VolumeSettings {
        VolumeSettings { kdf_memory_kib: MIN_KDF_MEMORY_KIB, ..VolumeSettings::default() }
    }

    #[test]
    fn init_unlock_and_change_the_password() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &fast(), &pw("hunter2")).unwrap();
        let v = unlock(dir.path(), &pw("hunter2")).unwrap();
        let err = unlock(dir.path(), &pw("hunter3")).unwrap_err();
        assert!(err.to_string().contains("wrong password"), "{err}");
        change_secret(dir.path(), &pw("hunter2"), &pw("correct horse")).unwrap();
        assert!(unlock(dir.path(), &pw("hunter2")).unwrap_err().to_string().contains("wrong password"));
        let again = unlock(dir.path(), &pw("correct horse")).unwrap();
        assert_eq!(v.key.bytes(), again.key.bytes(), "the master key is kept");
        assert!(init(dir.path(), &fast(), &pw("x")).unwrap_err().to_string().contains("already a crypt volume"));
    }

    #[test]
    fn editing_a_setting_makes_unlocking_fail() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &fast(), &pw("pw")).unwrap();
        let path = config_path(dir.path());
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        std::fs::write(&path, text.replace("plaintext_names = false", "plaintext_names = true")).unwrap();
        assert!(unlock(dir.path(), &pw("pw")).unwrap_err().to_string().contains("wrong password (or the file was altered)"));
        std::fs::write(&path, "version = 1\nvolume_id = [").unwrap();
        assert!(unlock(dir.path(), &pw("pw")).unwrap_err().to_string().contains("corrupt"));
        std::fs::remove_file(&path).unwrap();
        assert!(unlock(dir.path(), &pw("pw")).unwrap_err().to_string().contains("not a crypt volume"));
    }

    #[test]
    fn key_files_and_passwords_do_not_mix() {
        let dir = tempfile::tempdir().unwrap();
        let kf = Secret::KeyFile(Zeroizing::new(random_bytes::<32>().to_vec()));
        init(dir.path(), &fast(), &kf).unwrap();
        unlock(dir.path(), &kf).unwrap();
        assert!(unlock(dir.path(), &pw("x")).unwrap_err().to_string().contains("key file, not a password"));
        let short = Secret::KeyFile(Zeroizing::new(vec![1; 8]));
        let other = tempfile::tempdir().unwrap();
        assert!(init(other.path(), &fast(), &short).unwrap_err().to_string().contains("at least 32"));
    }

    #[test]
    fn the_recovery_key_unlocks_and_rewraps_and_a_wrong_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_, key) = init(dir.path(), &fast(), &pw("lost")).unwrap();
        let text = key.recovery_text();
        assert_eq!(text.len(), 9 * 8 + 8, "nine groups of eight, dashes between: {}", &*text);
        let again = MasterKey::from_recovery_text(&text.to_uppercase().replace('-', " ")).unwrap();
        assert_eq!(again.bytes(), key.bytes());
        let v = unlock(dir.path(), &Secret::MasterKey(again)).unwrap();
        assert_eq!(v.key.bytes(), key.bytes());
        // A typo is caught by the check group; another key by the configuration.
        let mut typo = text.to_string();
        typo.replace_range(0..1, if typo.starts_with('0') { "1" } else { "0" });
        assert!(MasterKey::from_recovery_text(&typo).unwrap_err().to_string().contains("mistyped"));
        let other = MasterKey::from_bytes(random_bytes());
        assert!(unlock(dir.path(), &Secret::MasterKey(other.clone())).unwrap_err().to_string().contains("wrong master key"));
        assert!(MasterKey::from_recovery_text("12-zz").unwrap_err().to_string().contains("not a hex digit"));
        // The key wraps under a new password; the lost one no longer opens it.
        change_secret(dir.path(), &Secret::MasterKey(key.clone()), &pw("found")).unwrap();
        assert_eq!(unlock(dir.path(), &pw("found")).unwrap().key.bytes(), key.bytes());
        assert!(unlock(dir.path(), &pw("lost")).is_err());
        assert!(change_secret(dir.path(), &pw("found"), &Secret::MasterKey(other)).unwrap_err().to_string().contains("not a master key"));
        // The check value is bound to the wrap: editing it makes the password fail.
        let path = config_path(dir.path());
        let t = std::fs::read_to_string(&path).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        let check = VolumeConfig::load(dir.path()).unwrap().key_check.unwrap();
        std::fs::write(&path, t.replace(&check, &"0".repeat(32))).unwrap();
        assert!(unlock(dir.path(), &pw("found")).unwrap_err().to_string().contains("altered"));
    }

    #[test]
    fn binding_is_version_2_and_a_later_version_is_refused_by_its_number() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &VolumeSettings { bind_paths: true, ..fast() }, &pw("p")).unwrap();
        let text = std::fs::read_to_string(config_path(dir.path())).unwrap();
        assert!(text.contains("version = 2") && !text.contains("bind_paths"), "{text}");
        assert!(unlock(dir.path(), &pw("p")).unwrap().bind_paths);
        change_secret(dir.path(), &pw("p"), &pw("q")).unwrap();
        assert!(unlock(dir.path(), &pw("q")).unwrap().bind_paths, "a new password keeps the binding");
        let text = std::fs::read_to_string(config_path(dir.path())).unwrap();
        // Made version 1 by an edit: binding off, and the key no longer unwraps.
        let edited = text.replace("version = 2", "version = 1");
        let c = VolumeConfig::parse(&edited, "c").unwrap();
        assert!(!c.bind_paths);
        assert!(unlock_config(&c, "c", &pw("q")).unwrap_err().to_string().contains("wrong password"));
        let later = text.replace("version = 2", "version = 3").replace("cipher =", "new_setting = 1\ncipher =");
        assert!(VolumeConfig::parse(&later, "c").unwrap_err().to_string().contains("version 3 is not supported"));
        let with_names = VolumeSettings { bind_paths: true, plaintext_names: true, ..fast() };
        assert!(init(tempfile::tempdir().unwrap().path(), &with_names, &pw("p")).unwrap_err().to_string().contains("--bind-paths"));
    }

    #[test]
    fn a_non_empty_directory_needs_plaintext_names() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"x").unwrap();
        assert!(init(dir.path(), &fast(), &pw("p")).unwrap_err().to_string().contains("not empty"));
        init(dir.path(), &VolumeSettings { plaintext_names: true, ..fast() }, &pw("p")).unwrap();
    }
}
