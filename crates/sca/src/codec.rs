//! What a size-changing layer implements: the two routines of Fast Indexing §6 (`encode_data`,
//! `decode_data`) and a few facts about them. The framework does everything else.

use crate::Error;

/// Where an encoded payload belongs: its file and the chunks it stands for. A codec that binds
/// its output to its place (a cipher authenticating it as associated data) sees it in
/// [`Codec::encode_at`] and [`Codec::decode_at`], so that a payload moved to another chunk or
/// another file no longer decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// The file's random identity, from its header; zeros for codecs that do not ask for one.
    pub file_id: [u8; 16],
    /// The first chunk the payload stands for.
    pub chunk: u64,
    /// How many chunks: 1, or the length of a run of zero chunks (a hole).
    pub count: u64,
}

/// What the framework knows of one encoded file without decoding it.
#[derive(Clone, Copy, Debug)]
pub struct FileFacts {
    pub tag: [u8; 4],
    pub file_id: Option<[u8; 16]>,
    pub chunk_bytes: u64,
    pub chunks: u64,
    pub size: u64,
}

/// A size-changing algorithm, applied to one chunk at a time.
pub trait Codec: Send + Sync + 'static {
    /// Four bytes stored in every file this codec writes, so that a file is never decoded with
    /// the wrong algorithm.
    fn tag(&self) -> [u8; 4];

    /// Append the encoding of `chunk` to `out`.
    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), Error>;

    /// Append the decoding of `encoded` to `out`. `decoded_len` is what it decoded to when it
    /// was written; the framework checks that it still does.
    fn decode(&self, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> Result<(), Error>;

    /// Whether the lower file may hold data unencoded: fast tails, and chunks a compressor
    /// could not shrink. A cipher says no.
    fn plaintext_safe(&self) -> bool {
        true
    }

    /// Whether equal chunks always encode to equal bytes, so one encoded chunk can stand for a
    /// whole run of zero chunks (a hole). A cipher with random nonces says no.
    fn deterministic(&self) -> bool {
        true
    }

    /// Whether to store a chunk as-is when encoding would not make it smaller (compressors).
    fn store_raw_if_larger(&self) -> bool {
        false
    }

    /// The most bytes the payload of an encoded chunk of `chunk_len` bytes can take: what
    /// `fallocate` sets aside in the file below for each chunk a range touches. A codec that
    /// stores a chunk as-is when encoding does not shrink it takes no more than the chunk; one
    /// that can make a chunk larger says by how much.
    fn max_payload(&self, chunk_len: usize) -> usize {
        chunk_len
    }

    /// A fresh identity for a new file, stored in its header and passed back in every
    /// [`Place`]; `None` (the default) for codecs whose output does not depend on the file.
    fn new_file_id(&self) -> Option<[u8; 16]> {
        None
    }

    /// [`Codec::encode`] for the payload at `place`. Codecs that bind their output to its place
    /// implement this instead.
    fn encode_at(&self, place: &Place, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
        let _ = place;
        self.encode(chunk, out)
    }

    /// An extended operation of the codec's own (for a cipher, `crypt-info`), answered by
    /// [`Codec::info`] from what the file's header and index say.
    fn info_op(&self) -> Option<plyfs_stack::ExtOpInfo> {
        None
    }

    fn info(&self, facts: &FileFacts) -> serde_json::Value {
        let _ = facts;
        serde_json::Value::Null
    }

    /// [`Codec::decode`] of the payload found at `place`.
    fn decode_at(&self, place: &Place, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> Result<(), Error> {
        let _ = place;
        self.decode(encoded, decoded_len, out)
    }
}

/// A four-character tag as text, for messages.
pub fn tag_name(tag: [u8; 4]) -> String {
    tag.iter().map(|&b| if b.is_ascii_graphic() { b as char } else { '?' }).collect::<String>().trim_end_matches('?').to_owned()
}

/// Decode into the `decoded_len` bytes appended to `out` by `fill`, which returns how many it
/// wrote; on failure or a wrong length `out` is left as it was. For codecs whose decoders
/// write into a slice.
pub fn decode_in_place(
    out: &mut Vec<u8>,
    decoded_len: usize,
    fill: impl FnOnce(&mut [u8]) -> Result<usize, Error>,
) -> Result<(), Error> {
    let start = out.len();
    out.resize(start + decoded_len, 0);
    match fill(&mut out[start..]) {
        Ok(n) if n == decoded_len => Ok(()),
        Ok(n) => {
            out.truncate(start);
            Err(Error::DecodedLength { got: n, expected: decoded_len })
        }
        Err(e) => {
            out.truncate(start);
            Err(e)
        }
    }
}

/// Whether `chunk` looks like data no compressor can shrink (already compressed or encrypted):
/// every byte value about equally frequent. Judged on every third byte (a stride that cycles
/// through the lanes of 2-, 4- and 8-byte records), in well under a microsecond per 4 KiB, so a
/// compressor can store such chunks as they are without trying, which costs about as much as
/// sealing them. Chunks under 1 KiB are never judged. A false "yes" (high-entropy bytes with
/// long repeats) only costs compression, never data.
pub fn looks_incompressible(chunk: &[u8]) -> bool {
    if chunk.len() < 1024 {
        return false;
    }
    let mut counts = [0u32; 256];
    let mut n = 0u32;
    for b in chunk.iter().step_by(3) {
        counts[*b as usize] += 1;
        n += 1;
    }
    // For n uniform samples each value turns up about n/256 times: at 1,365 samples (a 4 KiB
    // chunk), 5.3 times, with all but one or two values present and none above 24. Text uses
    // well under 200 values, and code and tables repeat a few values far more often.
    let present = counts.iter().filter(|c| **c > 0).count();
    let most = counts.iter().copied().max().unwrap_or(0);
    let expected = n / 256;
    present >= 240.min(n as usize * 9 / 10) && most <= expected * 3 + 8
}

#[cfg(test)]
mod tests {
    use super::looks_incompressible;

    /// A small xorshift generator: the same bytes on every run.
    fn noise(len: usize, mut x: u64) -> Vec<u8> {
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn random_and_compressed_chunks_look_incompressible_and_others_do_not() {
        for seed in 1..200 {
            assert!(looks_incompressible(&noise(4096, seed)), "seed {seed}");
        }
        let text: Vec<u8> = (0..2_000).flat_map(|i| format!("line {i} of some text, ").into_bytes()).collect();
        assert!(!looks_incompressible(&text[..4096]), "text");
        assert!(!looks_incompressible(&[0u8; 4096]), "zeros");
        // Random 32-bit numbers below 2^24: one byte of four always zero.
        let ints: Vec<u8> = noise(4096, 7).chunks(4).flat_map(|c| [c[0], c[1], c[2], 0]).collect();
        assert!(!looks_incompressible(&ints), "records with a constant lane");
        // Random bytes drawn from half of the values.
        let half: Vec<u8> = noise(4096, 9).iter().map(|b| b & 0x7f).collect();
        assert!(!looks_incompressible(&half), "7-bit data");
        assert!(!looks_incompressible(&noise(1000, 3)), "under 1 KiB");
    }
}
