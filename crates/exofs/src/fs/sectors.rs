//! Sector arithmetic: byte ranges to the sectors that hold them, and the rounding of what is
//! allocated to whole 4 KiB blocks. Pure, and tested with properties below.

use super::SECTOR;

/// The sectors holding bytes `off..end`: the first, and the one after the last.
pub(super) fn sectors_spanning(off: u64, end: u64) -> (u64, u64) {
    (off / SECTOR, end.div_ceil(SECTOR))
}

/// `sectors` rounded up to whole 4 KiB blocks (8 sectors), the unit room is taken in.
pub(super) fn whole_blocks(sectors: u64) -> u64 {
    sectors.div_ceil(8) * 8
}

/// Sectors write-back places for `len` bytes held in memory. Reservation (`Fs::to_place`) and
/// placement (`Fs::place_buffered`) must agree on it, or a write accepted could find no room
/// at write-back.
pub(super) fn placed_sectors(len: u64) -> u64 {
    whole_blocks(len.div_ceil(SECTOR))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_sectors_spanning_a_range_are_the_fewest_that_hold_it(off in 0u64..1 << 40, len in 0u64..1 << 24) {
            let end = off + len;
            let (s0, s1) = sectors_spanning(off, end);
            prop_assert!(s0 * SECTOR <= off && off < (s0 + 1) * SECTOR);
            prop_assert!(end <= s1 * SECTOR);
            prop_assert!(s1 == 0 || (s1 - 1) * SECTOR < end);
            prop_assert!(s0 <= s1);
            if len > 0 {
                prop_assert!(s0 < s1);
            }
        }

        #[test]
        fn whole_blocks_round_up_to_the_next_4k(sectors in 0u64..1 << 50) {
            let b = whole_blocks(sectors);
            prop_assert_eq!(b % 8, 0);
            prop_assert!(sectors <= b && b < sectors + 8);
        }

        #[test]
        fn placed_sectors_hold_the_bytes_in_whole_blocks(len in 0u64..1 << 40) {
            let placed = placed_sectors(len);
            prop_assert_eq!(placed % 8, 0);
            prop_assert!(placed * SECTOR >= len);
            prop_assert!(placed * SECTOR < len + 8 * SECTOR);
            prop_assert_eq!(placed == 0, len == 0);
        }
    }
}
