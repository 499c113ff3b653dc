//! Passwords and key files for crypt volumes: from a prompt on the terminal, a file, or a
//! command; and `plyfs init` / `plyfs passwd`.

use std::io::{BufRead, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use clap::Args;
use plyfs_layers::crypt::keys::{self, CipherKind, MasterKey, Secret, Volume, VolumeConfig, VolumeSettings};
use plyfs_layers::crypt::reverse::REVERSE_CONFIG_NAME;
use zeroize::Zeroizing;

use crate::failure::{code, Failure};

/// Where the secret of a crypt volume comes from; without any of these, a prompt.
#[derive(Args, Clone, Default, Debug)]
pub struct SecretArgs {
    /// Read the crypt volume's password from the first line of FILE.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["extpass", "keyfile"])]
    pub passfile: Option<PathBuf>,
    /// Run CMD with `sh -c` and use the first line it prints as the password.
    #[arg(long, value_name = "CMD", conflicts_with = "keyfile")]
    pub extpass: Option<String>,
    /// Use the contents of FILE (at least 32 random bytes) instead of a password.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["masterkey", "masterkey_file"])]
    pub keyfile: Option<PathBuf>,
    /// Unlock with the master key `plyfs init` showed, typed at a prompt (when the password is
    /// lost).
    #[arg(long, conflicts_with_all = ["passfile", "extpass", "masterkey_file"])]
    pub masterkey: bool,
    /// Unlock with the master key written in FILE (`-` for standard input).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["passfile", "extpass"])]
    pub masterkey_file: Option<PathBuf>,
}

/// The new secret for `plyfs passwd`.
#[derive(Args, Clone, Default, Debug)]
pub struct NewSecretArgs {
    /// Read the new password from the first line of FILE.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["new_extpass", "new_keyfile"])]
    pub new_passfile: Option<PathBuf>,
    /// Run CMD with `sh -c` and use the first line it prints as the new password.
    #[arg(long, value_name = "CMD", conflicts_with = "new_keyfile")]
    pub new_extpass: Option<String>,
    /// Switch the volume to the key file FILE.
    #[arg(long, value_name = "FILE")]
    pub new_keyfile: Option<PathBuf>,
}

impl NewSecretArgs {
    fn as_secret_args(&self) -> SecretArgs {
        SecretArgs {
            passfile: self.new_passfile.clone(),
            extpass: self.new_extpass.clone(),
            keyfile: self.new_keyfile.clone(),
            ..SecretArgs::default()
        }
    }
}

fn first_line(bytes: &[u8], from: &str) -> Result<Zeroizing<String>, String> {
    let line = bytes.split(|b| *b == b'\n').next().unwrap_or(&[]);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let text = String::from_utf8(line.to_vec()).map_err(|_| format!("{from}: the password is not UTF-8"))?;
    if text.is_empty() {
        return Err(format!("{from}: the password is empty"));
    }
    Ok(Zeroizing::new(text))
}

impl SecretArgs {
    pub fn given(&self) -> bool {
        self.passfile.is_some() || self.extpass.is_some() || self.keyfile.is_some() || self.masterkey || self.masterkey_file.is_some()
    }

    /// The secret, from the source given, or else from a prompt (twice when `confirm`).
    pub fn get(&self, what: &str, confirm: bool) -> Result<Secret, String> {
        if let Some(path) = &self.masterkey_file {
            let text = if path.as_os_str() == "-" {
                let mut t = Zeroizing::new(String::new());
                std::io::stdin().read_to_string(&mut t).map_err(|e| format!("master key from standard input: {e}"))?;
                t
            } else {
                Zeroizing::new(std::fs::read_to_string(path).map_err(|e| format!("master key file {}: {e}", path.display()))?)
            };
            let shown = if path.as_os_str() == "-" { "standard input".to_owned() } else { path.display().to_string() };
            return MasterKey::from_recovery_text(&text).map(Secret::MasterKey).map_err(|e| format!("master key file {shown}: {e}"));
        }
        if self.masterkey {
            let text = prompt_for("Master key (nine groups of eight hex digits): ", "master key", "--masterkey-file FILE")?;
            return MasterKey::from_recovery_text(&text).map(Secret::MasterKey).map_err(String::from);
        }
        if let Some(path) = &self.keyfile {
            let bytes = std::fs::read(path).map_err(|e| format!("key file {}: {e}", path.display()))?;
            return Ok(Secret::KeyFile(Zeroizing::new(bytes)));
        }
        if let Some(path) = &self.passfile {
            let bytes = Zeroizing::new(std::fs::read(path).map_err(|e| format!("password file {}: {e}", path.display()))?);
            return Ok(Secret::Password(first_line(&bytes, &format!("password file {}", path.display()))?));
        }
        if let Some(cmd) = &self.extpass {
            let out = Command::new("/bin/sh")
                .arg("-c")
                .arg(cmd)
                .stdin(Stdio::inherit())
                .stderr(Stdio::inherit())
                .output()
                .map_err(|e| format!("--extpass '{cmd}': {e}"))?;
            let stdout = Zeroizing::new(out.stdout);
            if !out.status.success() {
                return Err(format!("--extpass '{cmd}' failed ({})", out.status));
            }
            return Ok(Secret::Password(first_line(&stdout, &format!("--extpass '{cmd}'"))?));
        }
        let pw = prompt(&format!("{what}: "))?;
        if confirm {
            let again = prompt("Repeat it: ")?;
            if *again != *pw {
                return Err("the two passwords differ".into());
            }
        }
        Ok(Secret::Password(pw))
    }
}

/// Read a password from the terminal without echoing it.
fn prompt(text: &str) -> Result<Zeroizing<String>, String> {
    prompt_for(text, "password", "--passfile FILE, --extpass CMD or --keyfile FILE")
}

/// Read a secret (`what`) from the terminal without echoing it; `instead` says how else to give
/// it.
fn prompt_for(text: &str, what: &str, instead: &str) -> Result<Zeroizing<String>, String> {
    let no_tty = || format!("no {what} given and no terminal to ask on: use {instead}");
    let mut tty = std::fs::OpenOptions::new().read(true).write(true).open("/dev/tty").map_err(|_| no_tty())?;
    let fd = tty.as_raw_fd();
    let mut saved: libc::termios = unsafe { std::mem::zeroed() };
    if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
        return Err(no_tty());
    }
    let mut quiet = saved;
    quiet.c_lflag &= !libc::ECHO;
    quiet.c_lflag |= libc::ECHONL;
    unsafe { libc::tcsetattr(fd, libc::TCSANOW, &quiet) };
    let _ = tty.write_all(text.as_bytes());
    let _ = tty.flush();
    let mut line = Zeroizing::new(String::new());
    let read = std::io::BufReader::new(&mut tty).read_line(&mut line);
    unsafe { libc::tcsetattr(fd, libc::TCSANOW, &saved) };
    read.map_err(|e| format!("reading the {what}: {e}"))?;
    let trimmed = Zeroizing::new(line.trim_end_matches(['\n', '\r']).to_owned());
    if trimmed.is_empty() {
        return Err(format!("the {what} is empty"));
    }
    Ok(trimmed)
}

/// Unlock the crypt volume at `lower`, if it is one, and put its key in the keyring for the
/// crypt layers built after this. `Ok(None)` when `lower` is not a crypt volume.
pub fn unlock_if_volume(lower: &Path, secret: &SecretArgs) -> Result<Option<Volume>, Failure> {
    if !keys::config_path(lower).exists() {
        if secret.given() {
            return Err(Failure::new(code::CONFIG, format!("{}: not a crypt volume, so it takes no password or key file", lower.display())));
        }
        return Ok(None);
    }
    let s = secret.get(&format!("Password for {}", lower.display()), false)?;
    Ok(Some(keys::unlock(lower, &s)?))
}

/// Unlock as [`unlock_if_volume`] and register the key.
pub fn unlock_and_register(lower: &Path, secret: &SecretArgs) -> Result<(), Failure> {
    if let Some(v) = unlock_if_volume(lower, secret)? {
        keys::register(v);
    }
    Ok(())
}

/// Unlock and register every crypt volume among `dirs` (a stack's LOWER first, then its other
/// branches), asking for each one's password. A password given when none is a volume is an
/// error, as for a single directory.
pub fn unlock_volumes(dirs: &[std::path::PathBuf], secret: &SecretArgs) -> Result<Vec<std::sync::Arc<Volume>>, Failure> {
    let configs = dir_configs(dirs)?;
    if configs.is_empty() {
        return match (secret.given(), dirs.first()) {
            (true, Some(lower)) => Err(Failure::new(code::CONFIG, format!("{}: not a crypt volume, so it takes no password or key file", lower.display()))),
            _ => Ok(Vec::new()),
        };
    }
    unlock_configs(&configs, secret)
}

pub use plyfs_assemble::FoundVolume;

/// The crypt volumes among `dirs`.
fn dir_configs(dirs: &[std::path::PathBuf]) -> Result<Vec<FoundVolume>, Failure> {
    dirs.iter()
        .filter(|d| keys::config_path(d).exists())
        .map(|d| Ok((d.display().to_string(), keys::config_path(d).display().to_string(), VolumeConfig::load(d)?)))
        .collect()
}

/// Unlock the volumes of `configs`.
pub fn unlock_configs(configs: &[FoundVolume], secret: &SecretArgs) -> Result<Vec<std::sync::Arc<Volume>>, Failure> {
    configs
        .iter()
        .map(|(name, file, config)| {
            let s = secret.get(&format!("Password for {name}"), false)?;
            Ok(keys::register(keys::unlock_config(config, file, &s)?))
        })
        .collect()
}

/// The volume of the reverse view of `plain`.
pub fn reverse_volume(plain: &Path) -> Result<FoundVolume, Failure> {
    let path = plain.join(REVERSE_CONFIG_NAME);
    let config = VolumeConfig::load_file(plain, &path, " --reverse")?;
    Ok((plain.display().to_string(), path.display().to_string(), config))
}

/// Register the master keys the parent process handed over on a pipe: one for each crypt
/// volume among `dirs`, in order.
pub fn register_keys_from_fd(dirs: &[std::path::PathBuf], fd: i32) -> Result<(), Failure> {
    register_configs_from_fd(&dir_configs(dirs)?, fd)
}

/// Register the master keys of the volumes of `configs`, handed over on a pipe in that order.
pub fn register_configs_from_fd(configs: &[FoundVolume], fd: i32) -> Result<(), Failure> {
    use std::os::fd::FromRawFd;
    let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
    for (name, _, config) in configs {
        let mut key = Zeroizing::new([0u8; 32]);
        f.read_exact(&mut key[..]).map_err(|e| format!("reading the key of {name} from the parent: {e}"))?;
        keys::register(Volume {
            id: config.id()?,
            cipher: config.cipher,
            plaintext_names: config.plaintext_names,
            pad: config.pads()?,
            bind_paths: config.bind_paths,
            key: keys::MasterKey::from_bytes(*key),
        });
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct InitArgs {
    /// The directory to make a volume of (empty, unless --plaintext-names).
    lower: PathBuf,
    /// The layer to set up: crypt.
    #[arg(long, default_value = "crypt", value_name = "LAYER")]
    layer: String,
    /// The cipher for file data: aes-256-gcm (default) or xchacha20-poly1305.
    #[arg(long, default_value = "aes-256-gcm", value_name = "CIPHER")]
    cipher: String,
    /// Leave file names unencrypted.
    #[arg(long)]
    plaintext_names: bool,
    /// Hide file sizes below: `padme` pads every new file (the default of `crypt:pad=`).
    #[arg(long, value_name = "SCHEME", value_parser = ["padme", "none"], default_value = "none")]
    pad: String,
    /// Set up a reverse view of LOWER, a plaintext tree (`plyfs mount LOWER MNT --reverse`):
    /// the configuration goes in LOWER/.plyfs-crypt.reverse.conf.
    #[arg(long, conflicts_with = "plaintext_names")]
    reverse: bool,
    /// Bind each file's content to its place (directory and name), so that a file moved or
    /// swapped in the storage fails to open (EIO) instead of reading as another file. Recorded
    /// in the volume configuration; needs encrypted names, and xattrs kept by copies.
    #[arg(long, conflicts_with_all = ["plaintext_names", "reverse"])]
    bind_paths: bool,
    #[command(flatten)]
    secret: SecretArgs,
    /// Argon2id memory cost in KiB (default 65536). Lower only for tests.
    #[arg(long, hide = true, value_name = "KIB")]
    kdf_memory: Option<u32>,
}

pub fn init(args: &InitArgs) -> Result<(), Failure> {
    if args.layer != "crypt" {
        return Err(Failure::usage(format!("--layer {}: only the crypt layer needs setting up", args.layer)));
    }
    let meta = std::fs::metadata(&args.lower).map_err(|e| Failure::new(code::LOWER, format!("{}: {e}", args.lower.display())))?;
    if !meta.is_dir() {
        return Err(Failure::new(code::LOWER, format!("{}: not a directory", args.lower.display())));
    }
    let settings = VolumeSettings {
        cipher: CipherKind::parse(&args.cipher)?,
        plaintext_names: args.plaintext_names,
        kdf_memory_kib: args.kdf_memory.unwrap_or(keys::DEFAULT_KDF_MEMORY_KIB),
        pad: args.pad == "padme",
        bind_paths: args.bind_paths,
    };
    if settings.pad && args.reverse {
        return Err("--pad: a reverse view shows files at their own sizes; pad the volume a backup is restored into instead".into());
    }
    if args.secret.masterkey || args.secret.masterkey_file.is_some() {
        return Err("a new volume gets a new master key: give a password (prompt, --passfile, --extpass) or --keyfile".into());
    }
    let secret = args.secret.get("New password", true)?;
    if args.reverse {
        let path = args.lower.join(REVERSE_CONFIG_NAME);
        let (_, key) = keys::init_file(&args.lower, &path, &settings, &secret, false)?;
        eprintln!(
            "plyfs: {} has a reverse view now ({}): `plyfs mount {} MNT --reverse` shows it encrypted; keep {} safe: the view carries a copy, but without one nothing can be decrypted",
            args.lower.display(),
            settings.cipher.name(),
            args.lower.display(),
            path.display()
        );
        show_master_key(&key);
        return Ok(());
    }
    let (_, key) = keys::init(&args.lower, &settings, &secret)?;
    eprintln!(
        "plyfs: {} is now a crypt volume ({}, {} names{}{}); keep {} safe: without it nothing can be decrypted",
        args.lower.display(),
        settings.cipher.name(),
        if settings.plaintext_names { "plaintext" } else { "encrypted" },
        if settings.pad { ", sizes padded with PADMÉ" } else { "" },
        if settings.bind_paths { ", files bound to their places" } else { "" },
        keys::config_path(&args.lower).display()
    );
    show_master_key(&key);
    Ok(())
}

/// Show a new volume's master key, once: on standard output, which a script may keep, with the
/// explanation on standard error.
fn show_master_key(key: &MasterKey) {
    eprintln!(
        "plyfs: the volume's master key follows. It unlocks the volume if the password is lost \
         (`plyfs mount --masterkey`, `plyfs passwd --masterkey`). Write it down and keep it apart from the volume; \
         it is not shown again."
    );
    println!("{}", &*key.recovery_text());
}

#[derive(Args, Debug)]
pub struct PasswdArgs {
    /// The crypt volume.
    lower: PathBuf,
    /// The volume is LOWER's reverse view (LOWER/.plyfs-crypt.reverse.conf).
    #[arg(long)]
    reverse: bool,
    /// The current secret.
    #[command(flatten)]
    secret: SecretArgs,
    #[command(flatten)]
    new: NewSecretArgs,
}

pub fn passwd(args: &PasswdArgs) -> Result<(), Failure> {
    // Check it is a volume before asking anything.
    let path = if args.reverse { args.lower.join(REVERSE_CONFIG_NAME) } else { keys::config_path(&args.lower) };
    VolumeConfig::load_file(&args.lower, &path, if args.reverse { " --reverse" } else { " --layer crypt" })?;
    let old = args.secret.get("Current password", false)?;
    let new = args.new.as_secret_args().get("New password", true)?;
    let recovered = matches!(old, Secret::MasterKey(_));
    keys::change_secret_file(&args.lower, &path, &old, &new)?;
    if recovered {
        eprintln!("plyfs: {}: recovered: the master key is wrapped for the new secret; the old password no longer opens it", args.lower.display());
    } else {
        eprintln!("plyfs: {}: the master key is re-wrapped for the new secret; no data was re-encrypted", args.lower.display());
    }
    Ok(())
}
