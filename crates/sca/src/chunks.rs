//! Chunk arithmetic: which chunk holds an offset, where a chunk starts, which chunks a byte range
//! touches or covers whole, and which bytes of a chunk a range covers.
//!
//! A file is encoded in chunks of `1 << shift` bytes, and the index maps each upper chunk to its
//! record (Fast Indexing §3), so every operation first turns offsets into chunks. These are the
//! small pure functions it does that with, tested on their own (the property tests below) rather
//! than only through a file. `shift` is a chunk shift of the format (12 to 20); offsets are any
//! `u64`, and a chunk is at most `u64::MAX >> shift`, the chunk of the last offset.

use std::ops::Range;

/// The bytes in one chunk.
pub(crate) fn chunk_bytes(shift: u8) -> u64 {
    1 << shift
}

/// The chunk holding byte `off`.
pub(crate) fn chunk_of(shift: u8, off: u64) -> u64 {
    off >> shift
}

/// The first byte of `chunk`.
pub(crate) fn chunk_start(shift: u8, chunk: u64) -> u64 {
    chunk << shift
}

/// Where byte `off` lies within its chunk.
pub(crate) fn offset_in_chunk(shift: u8, off: u64) -> u64 {
    off & (chunk_bytes(shift) - 1)
}

/// How many chunks `size` bytes span, the last one possibly partial.
pub(crate) fn chunk_count(shift: u8, size: u64) -> u64 {
    size.div_ceil(chunk_bytes(shift))
}

/// How many bytes of a file of `size` bytes lie in `chunk`: a whole chunk, what the file has of
/// its last one, or none past its end.
pub(crate) fn chunk_len(shift: u8, size: u64, chunk: u64) -> u64 {
    size.saturating_sub(chunk_start(shift, chunk)).min(chunk_bytes(shift))
}

/// The chunks that the `len` bytes from `off` touch, at least one (`len` is not 0). A range
/// running past the last offset ends at it.
pub(crate) fn chunks_touched(shift: u8, off: u64, len: u64) -> Range<u64> {
    debug_assert!(len > 0, "an empty range touches no chunk");
    let last_byte = off.saturating_add(len - 1);
    chunk_of(shift, off)..chunk_of(shift, last_byte) + 1
}

/// The chunks that bytes `off..end` cover whole; empty (its start at or past its end) when there
/// are none.
pub(crate) fn whole_chunks(shift: u8, off: u64, end: u64) -> Range<u64> {
    off.div_ceil(chunk_bytes(shift))..chunk_of(shift, end)
}

/// The bytes of `chunk` that bytes `off..end` cover, as offsets within the chunk. `chunk` is one
/// of those the range touches.
pub(crate) fn span_in_chunk(shift: u8, chunk: u64, off: u64, end: u64) -> Range<usize> {
    let start = chunk_start(shift, chunk);
    debug_assert!(off < end && start < end && off - offset_in_chunk(shift, off) <= start, "chunk {chunk} is not in {off}..{end}");
    let from = off.saturating_sub(start);
    let to = (end - start).min(chunk_bytes(shift));
    from as usize..to as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{MAX_CHUNK_SHIFT, MIN_CHUNK_SHIFT};
    use proptest::prelude::*;

    fn shifts() -> impl Strategy<Value = u8> {
        MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT
    }

    /// Offsets of every size, the largest ones included: near 0, near the top, and anywhere.
    fn offsets() -> impl Strategy<Value = u64> {
        prop_oneof![0u64..1 << 24, (u64::MAX - (1 << 24))..=u64::MAX, any::<u64>()]
    }

    /// A byte range `off..end` (not empty), short or long, anywhere up to the last offset.
    fn ranges() -> impl Strategy<Value = (u64, u64)> {
        (offsets(), prop_oneof![1u64..1 << 22, 1u64..=u64::MAX]).prop_map(|(off, len)| {
            let off = off.min(u64::MAX - 1);
            (off, off.saturating_add(len))
        })
    }

    proptest! {
        #[test]
        fn an_offset_is_its_chunks_start_plus_its_place_in_it(shift in shifts(), off in offsets()) {
            let chunk = chunk_of(shift, off);
            let within = offset_in_chunk(shift, off);
            prop_assert!(within < chunk_bytes(shift));
            prop_assert_eq!(chunk_start(shift, chunk) + within, off);
            prop_assert!(chunk <= u64::MAX >> shift);
        }

        #[test]
        fn every_byte_of_a_chunk_is_in_that_chunk(shift in shifts(), chunk in any::<u64>(), at in any::<u64>()) {
            let chunk = chunk >> shift;
            let at = at % chunk_bytes(shift);
            let off = chunk_start(shift, chunk) + at;
            prop_assert_eq!(chunk_of(shift, off), chunk);
            prop_assert_eq!(offset_in_chunk(shift, off), at);
            prop_assert_eq!(chunk_start(shift, chunk) % chunk_bytes(shift), 0);
        }

        #[test]
        fn the_chunk_count_covers_the_size_and_no_more(shift in shifts(), size in offsets()) {
            let n = chunk_count(shift, size);
            if size == 0 {
                prop_assert_eq!(n, 0);
            } else {
                prop_assert_eq!(n, chunk_of(shift, size - 1) + 1);
                prop_assert!(chunk_start(shift, n - 1) < size);
                prop_assert!(size - chunk_start(shift, n - 1) <= chunk_bytes(shift));
            }
        }

        #[test]
        fn chunk_lengths_add_up_to_the_size(shift in shifts(), size in offsets(), pick in any::<u64>()) {
            let n = chunk_count(shift, size);
            let cs = chunk_bytes(shift);
            // Past the end: nothing.
            if n <= u64::MAX >> shift {
                prop_assert_eq!(chunk_len(shift, size, n), 0);
                prop_assert_eq!(chunk_len(shift, size, u64::MAX >> shift), 0);
            }
            if n > 0 {
                // Every chunk but the last is whole; the last holds the rest.
                let last = n - 1;
                let tail = chunk_len(shift, size, last);
                prop_assert!(tail > 0 && tail <= cs);
                prop_assert_eq!(chunk_start(shift, last) + tail, size);
                let inner = pick % n;
                if inner < last {
                    prop_assert_eq!(chunk_len(shift, size, inner), cs);
                }
            }
        }

        #[test]
        fn a_range_touches_exactly_the_chunks_holding_its_bytes(shift in shifts(), (off, end) in ranges()) {
            let touched = chunks_touched(shift, off, end - off);
            prop_assert!(touched.start < touched.end);
            prop_assert_eq!(touched.start, chunk_of(shift, off));
            prop_assert_eq!(touched.end - 1, chunk_of(shift, end - 1));
            // The chunk after the last starts at or after the range's end.
            prop_assert!(chunk_start(shift, touched.end - 1) < end);
            if touched.end <= u64::MAX >> shift {
                prop_assert!(chunk_start(shift, touched.end) >= end);
            }
        }

        #[test]
        fn a_range_past_the_last_offset_stops_at_it(shift in shifts(), off in offsets(), len in 1u64..=u64::MAX) {
            let touched = chunks_touched(shift, off, len);
            prop_assert_eq!(touched.start, chunk_of(shift, off));
            prop_assert_eq!(touched.end - 1, chunk_of(shift, off.saturating_add(len - 1)));
        }

        #[test]
        fn the_spans_of_a_range_tile_it(shift in shifts(), (off, end) in ranges().prop_filter("a few chunks", |(o, e)| e - o <= 1 << 23)) {
            let cs = chunk_bytes(shift);
            let touched = chunks_touched(shift, off, end - off);
            let mut at = off;
            for chunk in touched.clone() {
                let span = span_in_chunk(shift, chunk, off, end);
                prop_assert!(span.start < span.end && span.end as u64 <= cs);
                // Each span begins where the one before it ended.
                prop_assert_eq!(chunk_start(shift, chunk) + span.start as u64, at);
                if chunk != touched.start {
                    prop_assert_eq!(span.start, 0);
                }
                if chunk + 1 != touched.end {
                    prop_assert_eq!(span.end as u64, cs);
                }
                at += (span.end - span.start) as u64;
            }
            prop_assert_eq!(at, end);
        }

        #[test]
        fn whole_chunks_lie_inside_the_range_and_no_others_do(shift in shifts(), (off, end) in ranges()) {
            let cs = chunk_bytes(shift);
            let whole = whole_chunks(shift, off, end);
            let inside = |c: u64| chunk_start(shift, c) >= off && chunk_start(shift, c) + (cs - 1) < end;
            if whole.start < whole.end {
                prop_assert!(inside(whole.start));
                prop_assert!(inside(whole.end - 1));
                let touched = chunks_touched(shift, off, end - off);
                prop_assert!(touched.start <= whole.start && whole.end <= touched.end);
            }
            // The chunks around them are not whole inside the range.
            if whole.start > 0 {
                prop_assert!(!inside(whole.start - 1));
            }
            let after = whole.end.max(whole.start);
            if after <= u64::MAX >> shift {
                prop_assert!(!inside(after));
            }
        }
    }

    #[test]
    fn examples() {
        assert_eq!(chunk_of(12, 4095), 0);
        assert_eq!(chunk_of(12, 4096), 1);
        assert_eq!(offset_in_chunk(12, 4097), 1);
        assert_eq!(chunk_count(12, 4097), 2);
        assert_eq!(chunk_len(12, 4097, 1), 1);
        assert_eq!(chunks_touched(12, 4095, 2), 0..2);
        assert_eq!(whole_chunks(12, 1, 3 * 4096), 1..3);
        assert_eq!(whole_chunks(12, 1, 4096), 1..1);
        assert_eq!(span_in_chunk(12, 1, 100, 4196), 0..100);
        assert_eq!(span_in_chunk(12, 0, 100, 4196), 100..4096);
        assert_eq!(chunks_touched(12, u64::MAX, 1), u64::MAX >> 12..(u64::MAX >> 12) + 1);
        assert_eq!(span_in_chunk(12, u64::MAX >> 12, u64::MAX - 1, u64::MAX), 4094..4095);
    }
}
