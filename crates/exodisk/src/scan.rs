//! The start-up scan (and `plyfs exodisk fsck`): find every extent and exonode on the volume,
//! check the invariants, and reconcile the free map with what is really owned.
//!
//! Invariants (thesis §2.2.4): every allocated sector is owned exactly once, by the superblock
//! and free map, by a self-protected extent, or by an exonode (its own sectors and its extent
//! entries); free sectors appear nowhere; metadata names only sectors of the volume; a descendant
//! exonode is named by exactly its parent.
//!
//! Objects are found by their sealed records: a sector that starts with a record's magic and
//! opens under the volume key at that very sector. Deallocation overwrites a record before its
//! sectors are freed, so no stale record survives in free or reused space. A magic that does not
//! open is application data when it lies inside an object's data, and tampering otherwise.

use std::collections::BTreeMap;
use std::io;

use crate::disk::{Aligned, Disk, SECTOR};
use crate::freemap::FreeMap;
use crate::layout::Superblock;
use crate::object::{Entry, Exonode, ExtentHeader};
use crate::seal::{self, VolumeKey};

/// Every object on the volume.
#[derive(Default)]
pub struct Found {
    pub extents: BTreeMap<u64, ExtentHeader>,
    pub exonodes: BTreeMap<u64, Exonode>,
}

#[derive(Default, Debug)]
pub struct Report {
    pub extents: usize,
    pub exonodes: usize,
    /// Sectors owned (the superblock and free map included).
    pub owned: u64,
    /// Sectors the map had allocated that nothing owns (left by a crash): given back.
    pub reclaimed: u64,
    /// Exonodes their parent does not name (an interrupted creation or removal), by sector:
    /// given back, their records erased ([`erase_orphans`]).
    pub orphans: Vec<u64>,
    /// Descendant entries (exonode, entry) that name an exonode that is gone (a removal whose
    /// parent was not written yet): the service drops them.
    pub dangling: Vec<(u64, u32)>,
    /// Invariants that do not hold, and records that fail authentication.
    pub problems: Vec<String>,
}

impl Report {
    pub fn clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Sectors read at a time.
const CHUNK: u64 = 2048;

/// Scan the volume. Returns what is on it, the report, and the free map as it should be.
pub fn scan(disk: &Disk, key: &VolumeKey, sb: &Superblock) -> io::Result<(Found, Report, FreeMap)> {
    let mut report = Report::default();
    let (map, bad_blocks) = FreeMap::load(disk, key, sb)?;
    for b in bad_blocks {
        report.problems.push(format!("free-map block {b} fails authentication (edited offline?): not trusted, rebuilt from the scan"));
    }
    let mut found = Found::default();
    // Sectors with a record's magic that did not open.
    let mut suspects: Vec<(u64, &'static str)> = Vec::new();
    let mut buf = Aligned::zeroed(CHUNK as usize * SECTOR);
    let mut at = sb.data_start;
    while at < sb.sectors {
        let n = CHUNK.min(sb.sectors - at);
        let chunk = &mut buf[..n as usize * SECTOR];
        let mut sub = Aligned::zeroed(chunk.len());
        disk.read(at, &mut sub)?;
        chunk.copy_from_slice(&sub);
        for i in 0..n {
            let s = at + i;
            let sector = &buf[i as usize * SECTOR..(i as usize + 1) * SECTOR];
            if seal::record_sectors(sector, seal::EXTENT).is_some() {
                match ExtentHeader::open(key, s, sector) {
                    Ok(h) => {
                        found.extents.insert(s, h);
                    }
                    Err(_) => suspects.push((s, "an extent header")),
                }
            } else if let Some(len) = seal::record_sectors(sector, seal::EXONODE) {
                let whole = read_record(disk, &buf, at, n, s, len)?;
                match whole.as_ref().map(|w| Exonode::open(key, s, w)) {
                    Some(Ok(x)) => {
                        found.exonodes.insert(s, x);
                    }
                    _ => suspects.push((s, "an exonode")),
                }
            }
        }
        at += n;
    }
    report.extents = found.extents.len();
    report.exonodes = found.exonodes.len();

    // Orphans: exonodes whose parent does not name them (or is itself an orphan, or gone). An
    // interrupted creation or removal of a descendant leaves one; they and what they own are
    // given back.
    let mut orphans = std::collections::BTreeSet::new();
    loop {
        let before = orphans.len();
        for (&s, x) in &found.exonodes {
            if x.parent == 0 || orphans.contains(&s) {
                continue;
            }
            let named = match found.exonodes.get(&x.parent) {
                Some(p) if !orphans.contains(&x.parent) => {
                    p.entries.iter().filter(|e| matches!(e, Entry::Descendant { at } if *at == s)).count()
                }
                _ => 0,
            };
            if named == 0 {
                orphans.insert(s);
            } else if named > 1 {
                report.problems.push(format!("the exonode at {s} is named {named} times by its parent {}", x.parent));
            }
        }
        if orphans.len() == before {
            break;
        }
    }
    report.orphans = orphans.iter().copied().collect();
    for s in &orphans {
        found.exonodes.remove(s);
    }
    report.exonodes = found.exonodes.len();

    // Who owns what.
    let mut ranges: Vec<(u64, u64, String)> = vec![(0, sb.data_start, "the superblock and free map".into())];
    for (&s, h) in &found.extents {
        ranges.push((s, s.saturating_add(h.sectors), format!("the extent at {s}")));
    }
    for (&s, x) in &found.exonodes {
        ranges.push((s, s + x.sectors as u64, format!("the exonode at {s}")));
        for (i, e) in x.entries.iter().enumerate() {
            match *e {
                Entry::Extent { start, sectors } => {
                    ranges.push((start, start.saturating_add(sectors), format!("entry {i} of the exonode at {s}")))
                }
                Entry::Descendant { at: d } => match found.exonodes.get(&d) {
                    Some(child) if child.parent == s => {}
                    Some(child) => report
                        .problems
                        .push(format!("entry {i} of the exonode at {s} names the exonode at {d}, whose parent is {}", child.parent)),
                    None => report.dangling.push((s, i as u32)),
                },
                _ => {}
            }
        }
    }
    if found.exonodes.get(&sb.roots_at()).is_none_or(|r| r.caps != sb.roots) {
        report.problems.push(format!("the service's root exonode at {} is missing or not the superblock's", sb.roots_at()));
    }
    ranges.sort();
    let mut owned = FreeMap::new(sb.sectors);
    let mut reach = 0u64;
    let mut reach_owner = String::new();
    for (start, end, owner) in &ranges {
        if *end > sb.sectors || start > end {
            report.problems.push(format!("{owner} names sectors {start}..{end}, beyond the volume's {}", sb.sectors));
            continue;
        }
        if *start < reach {
            report.problems.push(format!("sectors {start}..{} are owned twice: by {reach_owner} and by {owner}", reach.min(*end)));
        }
        if *end > reach {
            reach = *end;
            reach_owner = owner.clone();
        }
        owned.set(*start, end - start, true);
    }
    // A record's magic that does not open is tampering unless it sits in some object's data
    // (where an application may write anything).
    for (s, what) in suspects {
        // Past an object's first sector, or anywhere in an extent an exonode owns.
        let in_data = ranges.iter().any(|(a, b, o)| s < *b && (s > *a || (s == *a && o.starts_with("entry"))));
        if !in_data {
            report.problems.push(format!("sector {s} holds {what} that fails authentication (edited offline?): not trusted"));
        }
    }
    // Reconcile the map with what is owned.
    let mut in_use_but_free = 0u64;
    let mut first_free = None;
    for s in 0..sb.sectors {
        match (owned.is_allocated(s), map.is_allocated(s)) {
            (true, false) => {
                in_use_but_free += 1;
                first_free.get_or_insert(s);
            }
            (false, true) => report.reclaimed += 1,
            _ => {}
        }
    }
    if let Some(first) = first_free {
        let owner = ranges.iter().find(|(a, b, _)| (*a..*b).contains(&first)).map_or("?", |r| r.2.as_str());
        report.problems.push(format!(
            "{in_use_but_free} sectors in use are marked free in the free map (the first, {first}, owned by {owner})"
        ));
    }
    report.owned = owned.allocated();
    Ok((found, report, owned))
}

/// Erase the records of the orphans the scan gave back (those whose first sector nothing owns
/// now), and flush: before their sectors are marked free, as a deallocation overwrites a record
/// before it frees its sectors. Without this, an orphan's record would be found, and reported,
/// by every scan after. `owned` is the map the scan returned.
pub fn erase_orphans(disk: &Disk, report: &Report, owned: &FreeMap) -> io::Result<()> {
    let erasable: Vec<u64> = report.orphans.iter().copied().filter(|&s| !owned.is_allocated(s)).collect();
    for &s in &erasable {
        disk.write(s, &Aligned::zeroed(SECTOR))?;
    }
    if !erasable.is_empty() {
        disk.sync()?;
    }
    Ok(())
}

/// All sectors of the record of `len` sectors at `s`: from the chunk in `buf` (holding `n`
/// sectors from `at`) when it is all there, read on its own otherwise. `None` past the volume.
fn read_record(disk: &Disk, buf: &[u8], at: u64, n: u64, s: u64, len: u32) -> io::Result<Option<Vec<u8>>> {
    let end = s + len as u64;
    if end > disk.sectors {
        return Ok(None);
    }
    if end <= at + n {
        let from = ((s - at) as usize) * SECTOR;
        return Ok(Some(buf[from..from + len as usize * SECTOR].to_vec()));
    }
    let mut whole = Aligned::zeroed(len as usize * SECTOR);
    disk.read(s, &mut whole)?;
    Ok(Some(whole.to_vec()))
}
