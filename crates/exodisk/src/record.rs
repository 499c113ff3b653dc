//! The write log (`plyfs exodisk serve --record LOG`), as dm-log-writes is for a block device:
//! every write the service makes to its volume and every flush, in the order they happened, so
//! that the volume as it stood at any flush can be built again offline ([`replay`]) from a copy
//! taken before the service started. Power-cut tests replay every flush; a user debugging a
//! crash replays the one before it.
//!
//! ```text
//! log   = "EXOWLOG1" | volume sectors (u64 LE) | entry*
//! entry = kind (b'W' write, b'F' flush) | sequence (u64 LE) | sector (u64 LE) | sectors (u32 LE)
//!         | the written bytes (sectors × 512; none for a flush)
//! ```
//!
//! What must stay true:
//! - A write is logged once it is complete, before anyone is told it is (a disk-queue write
//!   before its completion reaches the client), and a flush when it is issued: the writes logged
//!   before a flush are exactly those it covers, or fewer (a write that completed while the
//!   flush was being issued is logged after it), so a replay never makes durable what was not.
//! - A write with `RWF_DSYNC` is logged as the write, then a flush (dm-log-writes logs a FUA
//!   write as a flush point too).
//! - Each entry goes to the file in one `write`, under one lock, in sequence order: a reader
//!   while the service runs sees whole entries and at most a partial last one, which it
//!   ignores. The log is made 0600 with `O_EXCL`, never through a symlink: it holds the
//!   volume's bytes (sealed data, but the layout and every change show).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::disk::{Aligned, Disk, SECTOR};
use crate::error::{io, Error};

pub const MAGIC: &[u8; 8] = b"EXOWLOG1";
const HEADER_BYTES: u64 = 16;
const ENTRY_HEAD_BYTES: usize = 1 + 8 + 8 + 4;
const WRITE: u8 = b'W';
const FLUSH: u8 = b'F';

/// The service's side: appends to the log.
pub struct WriteLog {
    path: PathBuf,
    /// The file and the next sequence number, together so that numbers follow the file's order.
    file: Mutex<(File, u64)>,
}

impl WriteLog {
    /// Make a new log at `path` for a volume of `volume_sectors` sectors. An existing file is
    /// refused: a log means something only from the state it started at.
    pub fn create(path: &Path, volume_sectors: u64) -> Result<WriteLog, Error> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(io("cannot make the write log", path))?;
        let mut header = MAGIC.to_vec();
        header.extend_from_slice(&volume_sectors.to_le_bytes());
        file.write_all(&header).map_err(io("writing the write log's header", path))?;
        Ok(WriteLog { path: path.to_owned(), file: Mutex::new((file, 1)) })
    }

    /// `bytes` were written at `sector`.
    pub fn write(&self, sector: u64, bytes: &[u8]) {
        self.append(WRITE, sector, bytes);
    }

    /// A flush was issued: what was logged before it is durable once it completes.
    pub fn flush(&self) {
        self.append(FLUSH, 0, &[]);
    }

    fn append(&self, kind: u8, sector: u64, bytes: &[u8]) {
        let mut guard = self.file.lock();
        let (file, next) = &mut *guard;
        let mut entry = Vec::with_capacity(ENTRY_HEAD_BYTES + bytes.len());
        entry.push(kind);
        entry.extend_from_slice(&next.to_le_bytes());
        entry.extend_from_slice(&sector.to_le_bytes());
        entry.extend_from_slice(&((bytes.len() / SECTOR) as u32).to_le_bytes());
        entry.extend_from_slice(bytes);
        // A log that cannot be written is useless from here on, and the service must not stop
        // for it: say so once, and go on without it.
        if *next != u64::MAX {
            if let Err(e) = file.write_all(&entry) {
                tracing::error!("exodisk: {}: writing entry {next}: {e}; the write log stops here", self.path.display());
                *next = u64::MAX;
                return;
            }
            *next += 1;
        }
    }
}

/// One entry of a log, without its bytes: where they are in the log file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    Write { seq: u64, sector: u64, sectors: u32, bytes_at: u64 },
    Flush { seq: u64 },
}

/// A log read back: the volume's size and its whole entries.
pub struct Log {
    pub volume_sectors: u64,
    pub entries: Vec<Entry>,
}

impl Log {
    /// Read the entries of the log at `path`. A partial last entry (a log being written, or cut
    /// by a crash) is left out; anything else out of shape is an error naming the file and where.
    pub fn read(path: &Path) -> Result<Log, Error> {
        let bad = |why: String| Error::WriteLog { path: path.to_owned(), why };
        let mut file = File::open(path).map_err(io("opening the write log", path))?;
        let len = file.metadata().map_err(io("reading the write log's size", path))?.len();
        let mut header = [0u8; HEADER_BYTES as usize];
        file.read_exact(&mut header).map_err(|_| bad("not an exodisk write log (too short)".into()))?;
        if &header[..8] != MAGIC {
            return Err(bad(format!("not an exodisk write log (no {} magic)", String::from_utf8_lossy(MAGIC))));
        }
        let volume_sectors = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
        let mut entries = Vec::new();
        let mut at = HEADER_BYTES;
        let mut reader = std::io::BufReader::new(file);
        let mut head = [0u8; ENTRY_HEAD_BYTES];
        while at + ENTRY_HEAD_BYTES as u64 <= len {
            reader.read_exact(&mut head).map_err(io("reading the write log", path))?;
            let (kind, seq, sector, sectors) = parse_head(&head);
            let expected = entries.len() as u64 + 1;
            if seq != expected {
                return Err(bad(format!("entry at byte {at} has sequence number {seq}, expected {expected}")));
            }
            let bytes = sectors as u64 * SECTOR as u64;
            let bytes_at = at + ENTRY_HEAD_BYTES as u64;
            match kind {
                WRITE if bytes_at + bytes > len => break,
                WRITE if sectors == 0 || sector.checked_add(sectors as u64).is_none_or(|end| end > volume_sectors) => {
                    return Err(bad(format!(
                        "entry {seq} writes sectors {sector}+{sectors}, outside the volume of {volume_sectors}"
                    )));
                }
                WRITE => entries.push(Entry::Write { seq, sector, sectors, bytes_at }),
                FLUSH if sectors == 0 && sector == 0 => entries.push(Entry::Flush { seq }),
                _ => return Err(bad(format!("entry {seq} at byte {at} is neither a write nor a flush"))),
            }
            reader.seek_relative(if kind == WRITE { bytes as i64 } else { 0 }).map_err(io("reading the write log", path))?;
            at = bytes_at + if kind == WRITE { bytes } else { 0 };
        }
        Ok(Log { volume_sectors, entries })
    }

    pub fn flushes(&self) -> u64 {
        self.entries.iter().filter(|e| matches!(e, Entry::Flush { .. })).count() as u64
    }

    /// The entries before flush `n` (1 for the first): the writes it made durable. 0 is the
    /// start (no entry).
    pub fn before_flush(&self, n: u64) -> Option<&[Entry]> {
        if n == 0 {
            return Some(&[]);
        }
        let mut seen = 0;
        let end = self.entries.iter().position(|e| {
            seen += matches!(e, Entry::Flush { .. }) as u64;
            seen == n
        })?;
        Some(&self.entries[..end])
    }

    /// The writes after flush `n` and before the next one (or the log's end): those that may
    /// have reached the disk, in any order, in a crash after flush `n`.
    pub fn unflushed_after(&self, n: u64) -> Vec<Entry> {
        let start = self.before_flush(n).map_or(self.entries.len(), |b| b.len() + (n > 0) as usize);
        self.entries[start..].iter().take_while(|e| matches!(e, Entry::Write { .. })).copied().collect()
    }

    /// About half of [`Log::unflushed_after`]`(n)`, drawn from `seed`: a disk may have taken
    /// any of them, in any order, before a crash.
    pub fn some_unflushed(&self, n: u64, seed: u64) -> Vec<Entry> {
        // xorshift64: the same seed draws the same writes.
        let mut x = seed | 1;
        let mut coin = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x >> 63 == 1
        };
        self.unflushed_after(n).into_iter().filter(|_| coin()).collect()
    }
}

fn parse_head(head: &[u8; ENTRY_HEAD_BYTES]) -> (u8, u64, u64, u32) {
    let seq = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
    let sector = u64::from_le_bytes(head[9..17].try_into().expect("8 bytes"));
    let sectors = u32::from_le_bytes(head[17..21].try_into().expect("4 bytes"));
    (head[0], seq, sector, sectors)
}

/// What a replay did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replayed {
    pub writes: u64,
    pub flushes: u64,
}

/// Build on `volume` (a copy of the volume taken before the log was started) the state the log
/// made durable at flush `to_flush` (all of them when `None`), and with `unflushed` (a seed)
/// some of the writes after it ([`Log::some_unflushed`]). Everything is checked before
/// anything is written: a bad log or a volume of another size changes nothing.
pub fn replay(log_path: &Path, volume: &Path, to_flush: Option<u64>, unflushed: Option<u64>) -> Result<Replayed, Error> {
    let log = Log::read(log_path)?;
    let flushes = log.flushes();
    let n = to_flush.unwrap_or(flushes);
    let entries = log
        .before_flush(n)
        .ok_or_else(|| Error::WriteLog { path: log_path.to_owned(), why: format!("has {flushes} flushes, not {n}") })?;
    let extra = unflushed.map(|seed| log.some_unflushed(n, seed)).unwrap_or_default();
    let disk = Disk::open(volume, true).map_err(io("opening the volume", volume))?;
    if disk.sectors != log.volume_sectors {
        return Err(Error::LogOfAnotherVolume {
            path: volume.to_owned(),
            sectors: disk.sectors,
            log: log_path.to_owned(),
            logged: log.volume_sectors,
        });
    }
    let mut file = File::open(log_path).map_err(io("opening the write log", log_path))?;
    let mut writes = 0;
    for entry in entries.iter().chain(&extra) {
        if let Entry::Write { sector, sectors, bytes_at, .. } = *entry {
            let mut buf = Aligned::zeroed(sectors as usize * SECTOR);
            file.seek(SeekFrom::Start(bytes_at)).and_then(|_| file.read_exact(&mut buf)).map_err(io("reading the write log", log_path))?;
            disk.write(sector, &buf).map_err(|source| Error::Sector { op: "writing", path: volume.to_owned(), sector, source })?;
            writes += 1;
        }
    }
    disk.sync().map_err(io("syncing the volume", volume))?;
    Ok(Replayed { writes, flushes: n })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_of(dir: &Path, steps: &[(u8, u64, u8)]) -> std::path::PathBuf {
        let path = dir.join("w.log");
        let log = WriteLog::create(&path, 64).unwrap();
        for &(kind, sector, fill) in steps {
            if kind == WRITE {
                log.write(sector, &[fill; SECTOR]);
            } else {
                log.flush();
            }
        }
        path
    }

    #[test]
    fn a_replay_builds_the_volume_as_it_was_at_each_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = log_of(dir.path(), &[(WRITE, 1, 1), (FLUSH, 0, 0), (WRITE, 1, 2), (WRITE, 3, 3), (FLUSH, 0, 0), (WRITE, 4, 4)]);
        let log = Log::read(&path).unwrap();
        assert_eq!((log.flushes(), log.entries.len()), (2, 6));
        assert_eq!(log.unflushed_after(1).len(), 2);
        assert_eq!(log.unflushed_after(2).len(), 1);
        for (n, want) in [(0u64, [0u8, 0, 0]), (1, [1, 0, 0]), (2, [2, 3, 0])] {
            let volume = dir.path().join(format!("v{n}"));
            std::fs::write(&volume, vec![0u8; 64 * SECTOR]).unwrap();
            let done = replay(&path, &volume, Some(n), None).unwrap();
            assert_eq!(done.flushes, n);
            let bytes = std::fs::read(&volume).unwrap();
            assert_eq!([bytes[SECTOR], bytes[3 * SECTOR], bytes[4 * SECTOR]], want, "at flush {n}");
        }
        assert!(replay(&path, &dir.path().join("v0"), Some(3), None).unwrap_err().to_string().contains("has 2 flushes"));
    }

    #[test]
    fn a_partial_last_entry_is_left_out_and_a_bad_log_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = log_of(dir.path(), &[(WRITE, 1, 1), (FLUSH, 0, 0), (WRITE, 2, 2)]);
        let whole = std::fs::read(&path).unwrap();
        std::fs::write(&path, &whole[..whole.len() - 100]).unwrap();
        assert_eq!(Log::read(&path).unwrap().entries.len(), 2);
        let volume = dir.path().join("v");
        std::fs::write(&volume, vec![7u8; 64 * SECTOR]).unwrap();
        let mut bad = whole.clone();
        bad[HEADER_BYTES as usize + 1] = 9; // the first entry's sequence number
        std::fs::write(&path, &bad).unwrap();
        assert!(replay(&path, &volume, None, None).unwrap_err().to_string().contains("sequence number 9"));
        std::fs::write(&path, b"EXOWLOG0........").unwrap();
        assert!(replay(&path, &volume, None, None).unwrap_err().to_string().contains("not an exodisk write log"));
        std::fs::write(&path, &whole).unwrap();
        std::fs::write(&volume, vec![7u8; 32 * SECTOR]).unwrap();
        assert!(replay(&path, &volume, None, None).unwrap_err().to_string().contains("records a volume of 64"));
        assert_eq!(std::fs::read(&volume).unwrap(), vec![7u8; 32 * SECTOR]);
        assert!(WriteLog::create(&path, 64).is_err(), "an existing log is never appended to");
    }
}
