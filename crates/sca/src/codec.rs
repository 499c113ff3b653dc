//! What a size-changing layer implements: the two routines of Fast Indexing §6 (`encode_data`,
//! `decode_data`) and a few facts about them. The framework does everything else.

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
    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), String>;

    /// Append the decoding of `encoded` to `out`. `decoded_len` is what it decoded to when it
    /// was written; the framework checks that it still does.
    fn decode(&self, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> Result<(), String>;

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

    /// A fresh identity for a new file, stored in its header and passed back in every
    /// [`Place`]; `None` (the default) for codecs whose output does not depend on the file.
    fn new_file_id(&self) -> Option<[u8; 16]> {
        None
    }

    /// [`Codec::encode`] for the payload at `place`. Codecs that bind their output to its place
    /// implement this instead.
    fn encode_at(&self, place: &Place, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
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
    fn decode_at(&self, place: &Place, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> Result<(), String> {
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
    fill: impl FnOnce(&mut [u8]) -> Result<usize, String>,
) -> Result<(), String> {
    let start = out.len();
    out.resize(start + decoded_len, 0);
    match fill(&mut out[start..]) {
        Ok(n) if n == decoded_len => Ok(()),
        Ok(n) => {
            out.truncate(start);
            Err(format!("decoded to {n} bytes, not {decoded_len}"))
        }
        Err(e) => {
            out.truncate(start);
            Err(e)
        }
    }
}
