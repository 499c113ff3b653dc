//! `uuencode`: stores each chunk in uuencoded lines (Uuencodefs in Fast Indexing §7.1), a
//! size-increasing encoding: every 3 bytes become 4 printable characters, in lines of at most
//! 45 input bytes, each prefixed by its length character and ended by a newline.

use std::sync::Arc;

use plyfs_sca::{build_sca_layer, Codec, Error as CodecError, CHUNK_PARAM, EXT_OPS, FAST_TAILS_PARAM};
use plyfs_stack::{Build, BuildArgs, Layer, LayerFactory, Result};

pub struct Uuencode;

const LINE_BYTES: usize = 45;

/// A 6-bit value as a uuencode character (zero as a backquote, as modern uuencode writes it).
fn char_of(v: u8) -> u8 {
    if v == 0 { b'`' } else { v + b' ' }
}

fn value_of(c: u8) -> Option<u8> {
    match c {
        b'`' => Some(0),
        b' '..=b'_' => Some((c - b' ') & 0x3f),
        _ => None,
    }
}

impl Codec for Uuencode {
    fn tag(&self) -> [u8; 4] {
        *b"uuen"
    }

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        out.reserve(chunk.len() / 3 * 4 + chunk.len() / LINE_BYTES * 2 + 8);
        for line in chunk.chunks(LINE_BYTES) {
            out.push(char_of(line.len() as u8));
            for group in line.chunks(3) {
                let b = [group[0], *group.get(1).unwrap_or(&0), *group.get(2).unwrap_or(&0)];
                out.extend_from_slice(&[
                    char_of(b[0] >> 2),
                    char_of(((b[0] & 0x03) << 4) | (b[1] >> 4)),
                    char_of(((b[1] & 0x0f) << 2) | (b[2] >> 6)),
                    char_of(b[2] & 0x3f),
                ]);
            }
            out.push(b'\n');
        }
        Ok(())
    }

    /// Four characters for every three bytes (or fewer, at a line's end), and a length
    /// character and a newline per line.
    fn max_payload(&self, chunk_len: usize) -> usize {
        let lines = chunk_len.div_ceil(LINE_BYTES);
        (chunk_len.div_ceil(3) + lines) * 4 + lines * 2
    }

    fn decode(&self, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        out.reserve(decoded_len);
        for line in encoded.split(|&c| c == b'\n').filter(|l| !l.is_empty()) {
            let len = value_of(line[0]).ok_or_else(|| CodecError::decode("bad length character"))? as usize;
            let body = &line[1..];
            if len > LINE_BYTES || body.len() != len.div_ceil(3) * 4 {
                return Err(CodecError::decode(format!("a line of {} characters cannot hold {len} bytes", body.len())));
            }
            let mut bytes = Vec::with_capacity(len + 2);
            for quad in body.chunks(4) {
                let v: Vec<u8> = quad.iter().map(|&c| value_of(c)).collect::<Option<_>>().ok_or_else(|| CodecError::decode("bad character"))?;
                bytes.extend_from_slice(&[(v[0] << 2) | (v[1] >> 4), (v[1] << 4) | (v[2] >> 2), (v[2] << 6) | v[3]]);
            }
            out.extend_from_slice(&bytes[..len]);
        }
        Ok(())
    }
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    build_sca_layer(args, "uuencode", Arc::new(Uuencode))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "uuencode",
    summary: "stores data uuencoded (3 bytes become 4 printable characters): a size-increasing layer",
    params: &[CHUNK_PARAM, FAST_TAILS_PARAM],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_classic_format_and_round_trips() {
        let mut out = Vec::new();
        Uuencode.encode(b"Cat", &mut out).unwrap();
        assert_eq!(out, b"#0V%T\n");
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 256) as u8).collect();
        let mut enc = Vec::new();
        Uuencode.encode(&data, &mut enc).unwrap();
        assert!(enc.iter().all(|&c| c == b'\n' || (b' '..=b'`').contains(&c)));
        let mut dec = Vec::new();
        Uuencode.decode(&enc, data.len(), &mut dec).unwrap();
        assert_eq!(dec, data);
        assert!(Uuencode.decode(b"#0V%\n", 3, &mut Vec::new()).is_err());
    }
}
