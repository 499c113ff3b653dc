//! The protection metadata on disk: self-protected extents and exonodes (thesis §2.2).
//!
//! A **self-protected extent** is a run of contiguous sectors whose first sector holds its header:
//! its length and the read and write capabilities the application chose. It is named by its
//! first sector; its data are the sectors after the header.
//!
//! An **exonode** groups header-less extents under one pair of capabilities. It takes one or more
//! whole sectors of its own (the thesis's prototype capped it at 512 bytes; here it may be up to
//! [`MAX_EXONODE_SECTORS`]) and holds numbered entries: extents, descendant exonodes (which have
//! capabilities of their own; access to an ancestor reaches them, not the reverse), and
//! arbitrary application data kept beside the protection metadata. A removed entry leaves an
//! empty slot, so entry numbers stay put. A descendant records its parent, so the start-up scan
//! can check that each exonode is reached from exactly one place.
//!
//! Both are sealed records ([`crate::seal`]), bound to their first sector.

use crate::seal::{self, body_len, SealError, VolumeKey};

/// A capability: 128 bits the application chose. Zero is "none".
pub type Cap = u128;

/// The read and write capabilities of an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Caps {
    pub read: Cap,
    pub write: Cap,
}

impl Caps {
    /// A fresh pair from the operating system's random source (never 0, which is "none").
    pub fn random() -> Caps {
        let c = || u128::from_le_bytes(crate::seal::random()).max(1);
        Caps { read: c(), write: c() }
    }
}

/// The largest exonode: 64 KiB.
pub const MAX_EXONODE_SECTORS: u32 = 128;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtentHeader {
    /// All of it, header sector included.
    pub sectors: u64,
    pub caps: Caps,
    /// Its persistence model (the service's code for it), so that it outlives a restart.
    pub model: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A removed entry's slot.
    Empty,
    /// Sectors `start..start + sectors`, owned through this exonode.
    Extent { start: u64, sectors: u64 },
    /// The exonode at sector `at`, a descendant of this one.
    Descendant { at: u64 },
    /// The application's own bytes.
    Data(Vec<u8>),
}

impl Entry {
    pub fn encoded_len(&self) -> usize {
        match self {
            Entry::Empty => 1,
            Entry::Extent { .. } => 17,
            Entry::Descendant { .. } => 9,
            Entry::Data(d) => 5 + d.len(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exonode {
    /// The sectors it takes.
    pub sectors: u32,
    pub caps: Caps,
    /// Its persistence model (the service's code for it).
    pub model: u8,
    /// The exonode whose descendant it is (0 for none).
    pub parent: u64,
    pub entries: Vec<Entry>,
}

/// Why on-disk metadata was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bad {
    Seal(SealError),
    /// It opened, but what is inside does not make sense.
    Garbled(&'static str),
}

impl std::fmt::Display for Bad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bad::Seal(e) => e.fmt(f),
            Bad::Garbled(what) => write!(f, "authentic but inconsistent ({what})"),
        }
    }
}

impl From<SealError> for Bad {
    fn from(e: SealError) -> Bad {
        Bad::Seal(e)
    }
}

const VERSION: u8 = 1;

impl ExtentHeader {
    pub fn seal(&self, key: &VolumeKey, at: u64) -> Vec<u8> {
        let mut b = Vec::with_capacity(48);
        b.push(VERSION);
        b.push(self.model);
        b.extend_from_slice(&self.sectors.to_le_bytes());
        b.extend_from_slice(&self.caps.read.to_le_bytes());
        b.extend_from_slice(&self.caps.write.to_le_bytes());
        key.seal(seal::EXTENT, at, 1, &b)
    }

    pub fn open(key: &VolumeKey, at: u64, sector: &[u8]) -> Result<ExtentHeader, Bad> {
        let b = key.open(seal::EXTENT, at, sector)?;
        let mut r = Reader(&b);
        if r.u8()? != VERSION {
            return Err(Bad::Garbled("unknown version"));
        }
        let model = r.u8()?;
        let sectors = r.u64()?;
        let caps = Caps { read: r.u128()?, write: r.u128()? };
        if sectors < 1 {
            return Err(Bad::Garbled("an extent of no sectors"));
        }
        Ok(ExtentHeader { sectors, caps, model })
    }
}

impl Exonode {
    /// The bytes its entries may take.
    pub fn capacity(sectors: u32) -> usize {
        body_len(sectors) - Self::FIXED
    }

    const FIXED: usize = 1 + 1 + 4 + 16 + 16 + 8 + 4;

    /// The bytes its entries take now.
    pub fn used(&self) -> usize {
        self.entries.iter().map(Entry::encoded_len).sum()
    }

    pub fn fits(&self) -> bool {
        self.used() <= Self::capacity(self.sectors)
    }

    pub fn seal(&self, key: &VolumeKey, at: u64) -> Vec<u8> {
        assert!(self.fits(), "exonode entries overflow its sectors");
        let mut b = Vec::with_capacity(Self::FIXED + self.used());
        b.push(VERSION);
        b.push(self.model);
        b.extend_from_slice(&self.sectors.to_le_bytes());
        b.extend_from_slice(&self.caps.read.to_le_bytes());
        b.extend_from_slice(&self.caps.write.to_le_bytes());
        b.extend_from_slice(&self.parent.to_le_bytes());
        b.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            match e {
                Entry::Empty => b.push(0),
                Entry::Extent { start, sectors } => {
                    b.push(1);
                    b.extend_from_slice(&start.to_le_bytes());
                    b.extend_from_slice(&sectors.to_le_bytes());
                }
                Entry::Descendant { at } => {
                    b.push(2);
                    b.extend_from_slice(&at.to_le_bytes());
                }
                Entry::Data(d) => {
                    b.push(3);
                    b.extend_from_slice(&(d.len() as u32).to_le_bytes());
                    b.extend_from_slice(d);
                }
            }
        }
        key.seal(seal::EXONODE, at, self.sectors, &b)
    }

    pub fn open(key: &VolumeKey, at: u64, sealed: &[u8]) -> Result<Exonode, Bad> {
        let b = key.open(seal::EXONODE, at, sealed)?;
        let mut r = Reader(&b);
        if r.u8()? != VERSION {
            return Err(Bad::Garbled("unknown version"));
        }
        let model = r.u8()?;
        let sectors = r.u32()?;
        if sectors == 0 || sectors > MAX_EXONODE_SECTORS || seal::record_sectors(sealed, seal::EXONODE) != Some(sectors) {
            return Err(Bad::Garbled("exonode length"));
        }
        let caps = Caps { read: r.u128()?, write: r.u128()? };
        let parent = r.u64()?;
        let n = r.u32()? as usize;
        if n > b.len() {
            return Err(Bad::Garbled("entry count"));
        }
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            entries.push(match r.u8()? {
                0 => Entry::Empty,
                1 => Entry::Extent { start: r.u64()?, sectors: r.u64()? },
                2 => Entry::Descendant { at: r.u64()? },
                3 => {
                    let len = r.u32()? as usize;
                    Entry::Data(r.bytes(len)?.to_vec())
                }
                _ => return Err(Bad::Garbled("entry kind")),
            });
        }
        Ok(Exonode { sectors, caps, model, parent, entries })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], Bad> {
        if self.0.len() < n {
            return Err(Bad::Garbled("truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, Bad> {
        Ok(self.bytes(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, Bad> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, Bad> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8")))
    }
    fn u128(&mut self) -> Result<u128, Bad> {
        Ok(u128::from_le_bytes(self.bytes(16)?.try_into().expect("16")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key() -> VolumeKey {
        VolumeKey::new(&[3u8; 32], [9u8; 16])
    }

    #[test]
    fn headers_and_exonodes_round_trip_and_refuse_another_place() {
        let k = key();
        let h = ExtentHeader { sectors: 21, caps: Caps { read: 1, write: u128::MAX }, model: 2 };
        let s = h.seal(&k, 64);
        assert_eq!(ExtentHeader::open(&k, 64, &s).unwrap(), h);
        assert!(ExtentHeader::open(&k, 65, &s).is_err());
        let x = Exonode {
            sectors: 2,
            model: 1,
            caps: Caps { read: 5, write: 6 },
            parent: 7,
            entries: vec![
                Entry::Extent { start: 100, sectors: 8 },
                Entry::Empty,
                Entry::Descendant { at: 300 },
                Entry::Data(b"size=10240".to_vec()),
            ],
        };
        let s = x.seal(&k, 200);
        assert_eq!(s.len(), 1024);
        assert_eq!(Exonode::open(&k, 200, &s).unwrap(), x);
        assert!(Exonode::open(&k, 200, &s[..512]).is_err());
        assert!(ExtentHeader::open(&k, 200, &s).is_err());
    }

    proptest! {
        #[test]
        fn exonodes_round_trip(entries in proptest::collection::vec(prop_oneof![
            Just(Entry::Empty),
            (any::<u64>(), any::<u64>()).prop_map(|(start, sectors)| Entry::Extent { start, sectors }),
            any::<u64>().prop_map(|at| Entry::Descendant { at }),
            proptest::collection::vec(any::<u8>(), 0..200).prop_map(Entry::Data),
        ], 0..20), sectors in 1u32..8) {
            let x = Exonode { sectors, caps: Caps { read: 1, write: 2 }, model: 0, parent: 0, entries };
            prop_assume!(x.fits());
            let k = key();
            prop_assert_eq!(Exonode::open(&k, 10, &x.seal(&k, 10)).unwrap(), x);
        }
    }
}
