//! Extent data sealed at rest: every data sector is encrypted and authenticated under the volume
//! key, so that whoever reads the image reads no file, and an altered sector reads as `EIO`.
//!
//! The thesis protected data only by the service's checks: the raw disk held it in clear
//! (§2.2.5 protects the metadata). Here a sector keeps its place and its 512 bytes (clients
//! address sectors; nothing about extents changes for them), and its seal lives apart, in the
//! *tag area* between the free map and the object area: one 64-byte entry per sector of the
//! volume, 8 entries to a tag sector.
//!
//! ```text
//! entry   = newest slot (32) | previous slot (32)
//! slot    = session (u64 LE) | counter (u64 LE) | Poly1305 tag (16); all zero: empty
//! nonce   = sector (u64 LE) | session | counter          (XChaCha20-Poly1305, 24 bytes)
//! aad     = volume id (16) | sector (u64 LE)
//! ```
//!
//! What must stay true:
//! - A nonce is never used twice: the counter rises within a service's run and the session is
//!   drawn at random (non-zero) for each run, so two seals share a nonce only if two runs draw
//!   the same 64-bit session. The sector in the nonce makes that collision matter only within
//!   one sector.
//! - A sector opens only at its own place on its own volume (the aad), under the key.
//! - The seal is written before the data (both unflushed, flushed together as the data's model
//!   says), and the previous seal is kept: a reader racing a write, or a crash that kept the
//!   seal but not the data, still opens the old data. A crash that kept the data but not its
//!   seal reads as `EIO` (a sector written and never flushed, not data a client was told is
//!   durable).
//! - An entry with both slots empty reads as zeros, whatever the sector holds: the state of a
//!   new volume, and of sectors just allocated ([`DataSeal::forget`]), so that a new owner never
//!   opens what an old owner left there.
//!
//! Not protected: rolling a sector back to an earlier sealed state (its old bytes and entry, or
//! an empty entry, which reads as zeros) is not detected; which sectors are used and how often
//! they change shows in the tag area.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use chacha20poly1305::aead::AeadInPlace;
use chacha20poly1305::{Tag, XChaCha20Poly1305, XNonce};
use parking_lot::Mutex;

use crate::disk::{Aligned, SECTOR};

pub const SLOT_BYTES: usize = 32;
pub const ENTRY_BYTES: usize = 2 * SLOT_BYTES;
pub const ENTRIES_PER_SECTOR: u64 = (SECTOR / ENTRY_BYTES) as u64;

/// The tag area's size for a volume of `volume_sectors` sectors: an entry for each of them.
pub const fn tag_sectors(volume_sectors: u64) -> u64 {
    volume_sectors.div_ceil(ENTRIES_PER_SECTOR)
}

/// Where sector `sector`'s entry is: the tag sector (counted from the tag area's start) and the
/// byte offset in it.
pub const fn entry_place(sector: u64) -> (u64, usize) {
    (sector / ENTRIES_PER_SECTOR, (sector % ENTRIES_PER_SECTOR) as usize * ENTRY_BYTES)
}

/// One seal of a sector's contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Slot {
    pub session: u64,
    pub counter: u64,
    pub tag: [u8; 16],
}

impl Slot {
    pub fn is_empty(&self) -> bool {
        *self == Slot::default()
    }

    pub fn to_bytes(self) -> [u8; SLOT_BYTES] {
        let mut b = [0u8; SLOT_BYTES];
        b[..8].copy_from_slice(&self.session.to_le_bytes());
        b[8..16].copy_from_slice(&self.counter.to_le_bytes());
        b[16..].copy_from_slice(&self.tag);
        b
    }

    pub fn from_bytes(b: &[u8]) -> Slot {
        Slot {
            session: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            counter: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            tag: b[16..32].try_into().expect("16 bytes"),
        }
    }
}

/// A sector's entry: its newest seal and the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SectorEntry {
    pub newest: Slot,
    pub previous: Slot,
}

impl SectorEntry {
    pub fn from_bytes(b: &[u8]) -> SectorEntry {
        SectorEntry { newest: Slot::from_bytes(&b[..SLOT_BYTES]), previous: Slot::from_bytes(&b[SLOT_BYTES..ENTRY_BYTES]) }
    }

    pub fn to_bytes(self) -> [u8; ENTRY_BYTES] {
        let mut b = [0u8; ENTRY_BYTES];
        b[..SLOT_BYTES].copy_from_slice(&self.newest.to_bytes());
        b[SLOT_BYTES..].copy_from_slice(&self.previous.to_bytes());
        b
    }

    /// After a new seal: it is the newest, the newest before it the previous.
    pub fn resealed(self, slot: Slot) -> SectorEntry {
        SectorEntry { newest: slot, previous: self.newest }
    }
}

/// The nonce of the seal `(session, counter)` of sector `sector`. Injective in its three
/// arguments, so distinct seals never share a nonce.
pub fn sector_nonce(sector: u64, session: u64, counter: u64) -> [u8; 24] {
    let mut n = [0u8; 24];
    n[..8].copy_from_slice(&sector.to_le_bytes());
    n[8..16].copy_from_slice(&session.to_le_bytes());
    n[16..].copy_from_slice(&counter.to_le_bytes());
    n
}

fn aad(volume_id: &[u8; 16], sector: u64) -> [u8; 24] {
    let mut a = [0u8; 24];
    a[..16].copy_from_slice(volume_id);
    a[16..].copy_from_slice(&sector.to_le_bytes());
    a
}

/// Encrypt one sector in place as seal `(session, counter)`: its slot.
pub fn seal_sector(cipher: &XChaCha20Poly1305, volume_id: &[u8; 16], sector: u64, session: u64, counter: u64, data: &mut [u8]) -> Slot {
    debug_assert_eq!(data.len(), SECTOR);
    let nonce = sector_nonce(sector, session, counter);
    let tag = cipher
        .encrypt_in_place_detached(XNonce::from_slice(&nonce), &aad(volume_id, sector), data)
        .expect("XChaCha20-Poly1305 seals a sector");
    Slot { session, counter, tag: tag.into() }
}

/// Open one sector in place by its entry: the newest seal, else the previous one (see the
/// module's invariants); an empty entry gives zeros. On failure `data` is unchanged.
pub fn open_sector(cipher: &XChaCha20Poly1305, volume_id: &[u8; 16], sector: u64, entry: &SectorEntry, data: &mut [u8]) -> bool {
    debug_assert_eq!(data.len(), SECTOR);
    if entry.newest.is_empty() && entry.previous.is_empty() {
        data.fill(0);
        return true;
    }
    [entry.newest, entry.previous].iter().filter(|s| !s.is_empty()).any(|slot| {
        let nonce = sector_nonce(sector, slot.session, slot.counter);
        cipher
            .decrypt_in_place_detached(XNonce::from_slice(&nonce), &aad(volume_id, sector), data, Tag::from_slice(&slot.tag))
            .is_ok()
    })
}

/// Tag sectors kept in memory at most (each covers 4 KiB of data); past it the cache starts
/// afresh. The disk always holds what the cache does, so dropping it loses nothing.
const CACHE_SECTORS: usize = 32 * 1024;

/// The volume's data seals: the key, the tag area, and this run's session and counter.
pub struct DataSeal {
    cipher: XChaCha20Poly1305,
    volume_id: [u8; 16],
    /// The volume's descriptor (its `Disk` outlives this: both belong to the service's core).
    fd: RawFd,
    tags_start: u64,
    tag_sectors: u64,
    session: u64,
    counter: AtomicU64,
    /// Tag sectors by number in the tag area. Held while one is changed and written, so that
    /// two writes sharing a tag sector do not lose each other's seal.
    cache: Mutex<HashMap<u64, Box<[u8; SECTOR]>>>,
}

/// A sector whose seal does not open: altered, moved, or written by a crash that lost its seal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsealed {
    pub sector: u64,
}

impl DataSeal {
    pub fn new(cipher: XChaCha20Poly1305, volume_id: [u8; 16], fd: RawFd, tags_start: u64, tag_sectors: u64) -> DataSeal {
        let session = u64::from_le_bytes(crate::seal::random()) | 1;
        DataSeal {
            cipher,
            volume_id,
            fd,
            tags_start,
            tag_sectors,
            session,
            counter: AtomicU64::new(1),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Encrypt `data` (whole sectors, to be written at `sector`) in place and write their seals
    /// (flushed with `RWF_DSYNC` when `dsync`). The data must be written after this returns.
    pub fn seal(&self, sector: u64, data: &mut [u8], dsync: bool) -> std::io::Result<()> {
        let n = (data.len() / SECTOR) as u64;
        let first = self.counter.fetch_add(n, Ordering::Relaxed);
        let slots: Vec<Slot> = data
            .chunks_exact_mut(SECTOR)
            .enumerate()
            .map(|(i, d)| seal_sector(&self.cipher, &self.volume_id, sector + i as u64, self.session, first + i as u64, d))
            .collect();
        self.update(sector, n, dsync, |i, e| e.resealed(slots[i as usize]))
    }

    /// Open `data`, read from `sector`, in place.
    pub fn open(&self, sector: u64, data: &mut [u8]) -> Result<(), Unsealed> {
        let n = (data.len() / SECTOR) as u64;
        let entries = self.entries(sector, n).map_err(|_| Unsealed { sector })?;
        for (i, d) in data.chunks_exact_mut(SECTOR).enumerate() {
            let s = sector + i as u64;
            if !open_sector(&self.cipher, &self.volume_id, s, &entries[i], d) {
                return Err(Unsealed { sector: s });
            }
        }
        Ok(())
    }

    /// Empty the entries of `len` sectors from `start` (just allocated): they read as zeros
    /// until written, whatever an earlier owner left in them.
    pub fn forget(&self, start: u64, len: u64) -> std::io::Result<()> {
        self.update(start, len, false, |_, _| SectorEntry::default())
    }

    fn entries(&self, sector: u64, n: u64) -> std::io::Result<Vec<SectorEntry>> {
        let mut cache = self.cache.lock();
        self.load(&mut cache, sector, n)?;
        Ok((sector..sector + n)
            .map(|s| {
                let (t, off) = entry_place(s);
                SectorEntry::from_bytes(&cache[&t][off..off + ENTRY_BYTES])
            })
            .collect())
    }

    /// Change the entries of sectors `sector..sector + n` (`change` gets the index and the old
    /// entry) and write the tag sectors they are in.
    fn update(&self, sector: u64, n: u64, dsync: bool, change: impl Fn(u64, SectorEntry) -> SectorEntry) -> std::io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        let mut cache = self.cache.lock();
        let (lo, hi) = self.load(&mut cache, sector, n)?;
        for i in 0..n {
            let (t, off) = entry_place(sector + i);
            let bytes = &mut cache.get_mut(&t).expect("loaded")[off..off + ENTRY_BYTES];
            let new = change(i, SectorEntry::from_bytes(bytes));
            bytes.copy_from_slice(&new.to_bytes());
        }
        let mut out = Aligned::zeroed(((hi - lo) as usize) * SECTOR);
        for t in lo..hi {
            let at = (t - lo) as usize * SECTOR;
            out[at..at + SECTOR].copy_from_slice(&cache[&t][..]);
        }
        let written = self.io(true, self.tags_start + lo, &mut out, dsync);
        if written.is_err() {
            // The disk may hold either: forget what it holds.
            for t in lo..hi {
                cache.remove(&t);
            }
        }
        written
    }

    /// Bring the tag sectors of sectors `sector..sector + n` into the cache: their range.
    fn load(&self, cache: &mut HashMap<u64, Box<[u8; SECTOR]>>, sector: u64, n: u64) -> std::io::Result<(u64, u64)> {
        let lo = entry_place(sector).0;
        let hi = entry_place(sector + n - 1).0 + 1;
        if hi > self.tag_sectors {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        if (lo..hi).all(|t| cache.contains_key(&t)) {
            return Ok((lo, hi));
        }
        if cache.len() + (hi - lo) as usize > CACHE_SECTORS {
            cache.clear();
        }
        let mut buf = Aligned::zeroed(((hi - lo) as usize) * SECTOR);
        self.io(false, self.tags_start + lo, &mut buf, false)?;
        for t in lo..hi {
            let at = (t - lo) as usize * SECTOR;
            cache.entry(t).or_insert_with(|| Box::new(buf[at..at + SECTOR].try_into().expect("a sector")));
        }
        Ok((lo, hi))
    }

    fn io(&self, write: bool, at: u64, buf: &mut Aligned, dsync: bool) -> std::io::Result<()> {
        let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let offset = (at * SECTOR as u64) as libc::off_t;
        // SAFETY: one iovec over `buf`, which outlives the call.
        let done = unsafe {
            if write {
                libc::pwritev2(self.fd, &iov, 1, offset, if dsync { libc::RWF_DSYNC } else { 0 })
            } else {
                libc::preadv2(self.fd, &iov, 1, offset, 0)
            }
        };
        match done {
            n if n as usize == buf.len() => Ok(()),
            n if n < 0 => Err(std::io::Error::last_os_error()),
            _ => Err(std::io::Error::from_raw_os_error(libc::EIO)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chacha20poly1305::KeyInit;
    use proptest::prelude::*;

    fn cipher() -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new(&[3u8; 32].into())
    }

    proptest! {
        #[test]
        fn nonces_differ_when_any_part_differs(a in any::<(u64, u64, u64)>(), b in any::<(u64, u64, u64)>()) {
            prop_assert_eq!(sector_nonce(a.0, a.1, a.2) == sector_nonce(b.0, b.1, b.2), a == b);
        }

        #[test]
        fn entries_tile_the_tag_area(sector in 0u64..1 << 40) {
            let (t, off) = entry_place(sector);
            prop_assert!(off + ENTRY_BYTES <= SECTOR);
            prop_assert!(t < tag_sectors(sector + 1));
            prop_assert_eq!(t * ENTRIES_PER_SECTOR + (off / ENTRY_BYTES) as u64, sector);
        }

        #[test]
        fn a_sealed_sector_opens_only_as_sealed(sector in any::<u64>(), counter in 1u64.., data in prop::collection::vec(any::<u8>(), SECTOR), flip in 0usize..SECTOR) {
            let (c, id) = (cipher(), [9u8; 16]);
            let mut sealed = data.clone();
            let slot = seal_sector(&c, &id, sector, 7, counter, &mut sealed);
            prop_assert_ne!(&sealed, &data);
            let entry = SectorEntry::default().resealed(slot);
            let mut back = sealed.clone();
            prop_assert!(open_sector(&c, &id, sector, &entry, &mut back));
            prop_assert_eq!(&back, &data);
            // A flipped bit, another place, another volume: refused, and the bytes untouched.
            let mut bad = sealed.clone();
            bad[flip] ^= 1;
            prop_assert!(!open_sector(&c, &id, sector, &entry, &mut bad));
            let mut moved = sealed.clone();
            prop_assert!(!open_sector(&c, &id, sector.wrapping_add(1), &entry, &mut moved));
            prop_assert_eq!(&moved, &sealed);
            prop_assert!(!open_sector(&c, &[8u8; 16], sector, &entry, &mut sealed.clone()));
        }
    }

    #[test]
    fn the_previous_seal_still_opens_and_an_empty_entry_reads_as_zeros() {
        let (c, id) = (cipher(), [1u8; 16]);
        let mut old = vec![1u8; SECTOR];
        let first = seal_sector(&c, &id, 10, 5, 1, &mut old);
        let mut new = vec![2u8; SECTOR];
        let second = seal_sector(&c, &id, 10, 5, 2, &mut new);
        let entry = SectorEntry::default().resealed(first).resealed(second);
        assert_eq!(SectorEntry::from_bytes(&entry.to_bytes()), entry);
        let mut d = old.clone();
        assert!(open_sector(&c, &id, 10, &entry, &mut d) && d == [1u8; SECTOR]);
        let mut d = new.clone();
        assert!(open_sector(&c, &id, 10, &entry, &mut d) && d == [2u8; SECTOR]);
        let mut d = new.clone();
        assert!(open_sector(&c, &id, 10, &SectorEntry::default(), &mut d) && d == [0u8; SECTOR]);
    }
}
