//! Where things are on a volume, its key, and formatting.
//!
//! ```text
//! sector 0                      superblock (sealed)
//! sectors 8 .. 8 + 8·B          the free map: B blocks of 8 sectors, each sealed, one bit per sector
//! tags_start .. + sectors/8     the tag area: each sector's data seal (`content`), 64 bytes each
//! data_start ..                 extents and exonodes; the first is the service's root exonode
//! ```
//!
//! The volume key lives apart from the volume (`VOLUME.key` by default, mode 0400): whoever
//! holds a copy of the image alone can neither read the capabilities in it, nor forge a record,
//! nor read extent data. The image itself is made 0600, and an image or device that others can
//! read is warned about: they would still see its layout, sizes and how it changes.

use std::io;
use std::path::{Path, PathBuf};

use zeroize::Zeroizing;

use crate::disk::{Aligned, Disk, SECTOR};
use crate::error::{io, Error, SuperblockFault};
use crate::object::{Caps, Exonode};
use crate::seal::{self, body_len, VolumeKey};

/// Sectors per free-map block, and the bits each holds.
pub const MAP_BLOCK: u32 = 8;
pub const BITS_PER_BLOCK: u64 = (body_len(MAP_BLOCK) * 8) as u64;
/// The smallest volume worth formatting: 1 MiB.
pub const MIN_SECTORS: u64 = 2048;
/// The service's root exonode (the named roots of §4.3's exonode server).
pub const ROOTS_SECTORS: u32 = 16;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub sectors: u64,
    pub map_start: u64,
    pub map_blocks: u64,
    /// The tag area (extent data seals): from `tags_start`, `tag_sectors` long.
    pub tags_start: u64,
    pub tag_sectors: u64,
    pub data_start: u64,
    /// The root exonode, at `data_start`, and its capabilities (only the service knows them).
    pub roots: Caps,
    /// Seconds since the epoch at format.
    pub created: u64,
}

/// The format: 2 seals extent data (the tag area); 1 kept it in clear.
pub(crate) const VERSION: u8 = 2;

impl Superblock {
    pub fn for_size(sectors: u64) -> Superblock {
        let map_blocks = sectors.div_ceil(BITS_PER_BLOCK);
        let map_start = 8;
        let tags_start = (map_start + map_blocks * MAP_BLOCK as u64).next_multiple_of(8);
        let tag_sectors = crate::content::tag_sectors(sectors);
        let data_start = (tags_start + tag_sectors).next_multiple_of(8);
        Superblock { sectors, map_start, map_blocks, tags_start, tag_sectors, data_start, roots: Caps::default(), created: 0 }
    }

    pub fn seal(&self, key: &VolumeKey) -> Vec<u8> {
        let mut b = vec![VERSION];
        for v in [self.sectors, self.map_start, self.map_blocks, self.data_start, self.created] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.roots.read.to_le_bytes());
        b.extend_from_slice(&self.roots.write.to_le_bytes());
        key.seal(seal::SUPERBLOCK, 0, 1, &b)
    }

    pub fn open(key: &VolumeKey, sector: &[u8]) -> Result<Superblock, SuperblockFault> {
        let b = key.open(seal::SUPERBLOCK, 0, sector).map_err(SuperblockFault::Unsealed)?;
        if b[0] == 1 {
            // Its extent data is in clear and it has no tag area: read as this format, every
            // sector would fail to open. Refused rather than misread.
            return Err(SuperblockFault::Version1);
        }
        if b[0] != VERSION {
            return Err(SuperblockFault::Version(b[0]));
        }
        let u = |i: usize| u64::from_le_bytes(b[1 + 8 * i..9 + 8 * i].try_into().expect("8"));
        let c = |i: usize| u128::from_le_bytes(b[41 + 16 * i..57 + 16 * i].try_into().expect("16"));
        let expect = Superblock::for_size(u(0));
        let sb = Superblock {
            map_start: u(1),
            map_blocks: u(2),
            data_start: u(3),
            created: u(4),
            roots: Caps { read: c(0), write: c(1) },
            ..expect.clone()
        };
        if (sb.map_start, sb.map_blocks, sb.data_start) != (expect.map_start, expect.map_blocks, expect.data_start) {
            return Err(SuperblockFault::Inconsistent);
        }
        Ok(sb)
    }

    /// The root exonode's sector.
    pub fn roots_at(&self) -> u64 {
        self.data_start
    }
}

/// The key file's default place: beside the volume.
pub fn default_key_path(volume: &Path) -> PathBuf {
    let mut p = volume.as_os_str().to_owned();
    p.push(".key");
    PathBuf::from(p)
}

/// Read a key file.
pub fn load_key(path: &Path) -> Result<VolumeKey, Error> {
    let text = Zeroizing::new(std::fs::read_to_string(path).map_err(io("reading the key file", path))?);
    let mut key = None;
    let mut id = None;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("key=") {
            key = unhex::<32>(v);
        } else if let Some(v) = line.strip_prefix("volume=") {
            id = unhex::<16>(v);
        }
    }
    match (text.lines().next(), key, id) {
        (Some(KEY_HEADER), Some(k), Some(id)) => Ok(VolumeKey::new(&k, *id)),
        _ => Err(Error::BadKeyFile { path: path.to_owned() }),
    }
}

const KEY_HEADER: &str = "plyfs exodisk volume key v1";

fn unhex<const N: usize>(s: &str) -> Option<Zeroizing<[u8; N]>> {
    let s = s.trim();
    if s.len() != 2 * N {
        return None;
    }
    let mut out = Zeroizing::new([0u8; N]);
    for i in 0..N {
        out[i] = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// What `format` made.
pub struct Formatted {
    pub superblock: Superblock,
    pub key_path: PathBuf,
    /// Said once to the user: an existing image or device others can read.
    pub warning: Option<String>,
}

/// One line to warn of when others than the owner may read or write the volume at `path` (an
/// image or device that was already there: a new image is made 0600). Its data are sealed,
/// but its layout, sizes and changes show, and a writer can destroy it.
pub fn exposure_warning(path: &Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode();
    (mode & 0o077 != 0).then(|| {
        format!(
            "warning: {} is mode {:04o}: other users can read its layout and sizes (or write it); \
             run `chmod 600 {}` (for a device, a udev rule), or keep it in a directory only you can enter",
            path.display(),
            mode & 0o7777,
            path.display()
        )
    })
}

/// Format `path` (an image file, made if missing, or a block device) as a volume of `size`
/// bytes (the whole of it when `None`), with a new key written to `key_path`. Refuses a volume
/// that already is one, one that is too small, and one in use, without changing anything.
pub fn format(path: &Path, size: Option<u64>, key_path: &Path) -> Result<Formatted, Error> {
    if is_volume(path) {
        return Err(Error::AlreadyAVolume { path: path.to_owned() });
    }
    if key_path.exists() {
        return Err(Error::KeyFileThere { path: key_path.to_owned() });
    }
    let existed = path.exists();
    if !existed {
        let size = size.ok_or_else(|| Error::NoSize { path: path.to_owned() })?;
        check_size(path, size)?;
        // 0600, made here and now (O_EXCL), never through a symlink (O_NOFOLLOW).
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(io("making the image", path))?;
        // The image's space is taken now, as a disk's is: the service never finds the host
        // file system full, and its first writes do not pay for allocating the file's blocks.
        use std::os::fd::AsRawFd;
        let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, size as libc::off_t) };
        match r {
            0 => {}
            libc::EOPNOTSUPP | libc::EINVAL => f.set_len(size).map_err(io("sizing the image", path))?,
            e => {
                drop(f);
                let _ = std::fs::remove_file(path);
                return Err(Error::Reserve { path: path.to_owned(), bytes: size, source: std::io::Error::from_raw_os_error(e) });
            }
        }
    }
    let result = format_existing(path, size, key_path, existed);
    if result.is_err() && !existed {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Whether `path` starts with a superblock (read through the page cache: a quick look).
fn is_volume(path: &Path) -> bool {
    use std::io::Read;
    let mut first = [0u8; 16];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut first)).is_ok()
        && seal::record_sectors(&first, seal::SUPERBLOCK).is_some()
}

fn check_size(path: &Path, size: u64) -> Result<(), Error> {
    if size / SECTOR as u64 >= MIN_SECTORS {
        return Ok(());
    }
    Err(Error::TooSmall { path: path.to_owned(), bytes: size, min_bytes: MIN_SECTORS * SECTOR as u64 })
}

fn format_existing(path: &Path, size: Option<u64>, key_path: &Path, existed: bool) -> Result<Formatted, Error> {
    let disk = Disk::open(path, true).map_err(io("opening the volume", path))?;
    let mut first = Aligned::zeroed(SECTOR);
    disk.read(0, &mut first).map_err(io("reading the first sector", path))?;
    if existed && seal::record_sectors(&first, seal::SUPERBLOCK).is_some() {
        return Err(Error::AlreadyAVolume { path: path.to_owned() });
    }
    let available = disk.sectors * SECTOR as u64;
    let bytes = match size {
        Some(s) if s > available && disk.is_device => {
            return Err(Error::LargerThanDevice { path: path.to_owned(), size: s, available })
        }
        Some(s) if s > available => {
            drop(disk);
            std::fs::OpenOptions::new().write(true).open(path).and_then(|f| f.set_len(s)).map_err(io("growing the image", path))?;
            return format_existing(path, size, key_path, existed);
        }
        Some(s) => s,
        None => available,
    };
    check_size(path, bytes)?;
    let sectors = bytes / SECTOR as u64;
    let raw_key: Zeroizing<[u8; 32]> = Zeroizing::new(seal::random());
    let key = VolumeKey::new(&raw_key, seal::random());
    let mut sb = Superblock::for_size(sectors);
    sb.roots = Caps::random();
    sb.created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if sb.data_start + ROOTS_SECTORS as u64 >= sectors {
        let min_bytes = (sb.data_start + ROOTS_SECTORS as u64 + 1) * SECTOR as u64;
        return Err(Error::TooSmall { path: path.to_owned(), bytes, min_bytes });
    }
    // The free map: the superblock, the map and the root exonode are allocated.
    let mut map = crate::freemap::FreeMap::new(sectors);
    map.set(0, sb.data_start + ROOTS_SECTORS as u64, true);
    let roots = Exonode {
        sectors: ROOTS_SECTORS,
        caps: sb.roots,
        model: crate::core::Persistence::Data.code(),
        parent: 0,
        entries: Vec::new(),
    };
    // The key first: a volume whose key was lost is lost.
    write_key(key_path, &raw_key, &key.volume_id)?;
    let write = || -> io::Result<()> {
        disk.write(sb.roots_at(), &Aligned::from_bytes(&roots.seal(&key, sb.roots_at())))?;
        map.store(&disk, &key, &sb)?;
        disk.write(0, &Aligned::from_bytes(&sb.seal(&key)))?;
        disk.sync()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(key_path);
        return Err(Error::Io { op: "writing the new volume's metadata", path: path.to_owned(), source: e });
    }
    let warning = if existed { exposure_warning(path) } else { None };
    Ok(Formatted { superblock: sb, key_path: key_path.to_owned(), warning })
}

fn write_key(path: &Path, key: &[u8; 32], id: &[u8; 16]) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let text = Zeroizing::new(format!(
        "{KEY_HEADER}\n# Seals the volume's metadata and data. Without it the volume cannot be served: keep a copy.\nvolume={}\nkey={}\n",
        hex(id),
        hex(key)
    ));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io("making the key file", path))?;
    f.write_all(text.as_bytes()).and_then(|()| f.sync_all()).map_err(io("writing the key file", path))
}

/// Open a volume: its disk (held exclusively), key and superblock.
pub fn open(path: &Path, key_path: &Path) -> Result<(Disk, VolumeKey, Superblock), Error> {
    let disk = Disk::open(path, true).map_err(io("opening the volume", path))?;
    let mut first = Aligned::zeroed(SECTOR);
    disk.read(0, &mut first).map_err(io("reading the superblock", path))?;
    if seal::record_sectors(&first, seal::SUPERBLOCK).is_none() {
        return Err(Error::NotAVolume { path: path.to_owned() });
    }
    let key = load_key(key_path)?;
    let sb = Superblock::open(&key, &first)
        .map_err(|why| Error::Superblock { path: path.to_owned(), key: key_path.to_owned(), why })?;
    if sb.sectors > disk.sectors {
        return Err(Error::Truncated { path: path.to_owned(), claimed: sb.sectors, sectors: disk.sectors });
    }
    Ok((disk, key, sb))
}
