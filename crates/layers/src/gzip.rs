//! `gzip`: deflate compression of each chunk (Gzipfs in Fast Indexing §7.1), through `flate2`.

use std::cell::RefCell;
use std::ops::RangeInclusive;
use std::sync::Arc;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use plyfs_sca::{build_sca_layer, Codec, Error as CodecError, CHUNK_PARAM, EXT_OPS, FAST_TAILS_PARAM};
use plyfs_stack::spec::{ParamSpec, Params};
use plyfs_stack::{Build, BuildArgs, Layer, LayerFactory, Result};

pub struct Gzip {
    level: u32,
}

impl Gzip {
    pub const fn new(level: u32) -> Gzip {
        Gzip { level }
    }
}

thread_local! {
    // Deflate state is costly to set up; each thread keeps one of each and resets it.
    static DEFLATE: RefCell<Option<(u32, Compress)>> = const { RefCell::new(None) };
    static INFLATE: RefCell<Option<Decompress>> = const { RefCell::new(None) };
}

impl Codec for Gzip {
    fn tag(&self) -> [u8; 4] {
        *b"gzip"
    }

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        DEFLATE.with_borrow_mut(|slot| {
            let (_, deflate) = match slot {
                Some((level, d)) if *level == self.level => {
                    d.reset();
                    slot.as_mut().expect("matched")
                }
                _ => slot.insert((self.level, Compress::new(Compression::new(self.level), false))),
            };
            // Deflate never grows data by more than 5 bytes per 16 KiB block plus a little.
            out.reserve(chunk.len() + chunk.len() / 1000 + 64);
            match deflate.compress_vec(chunk, out, FlushCompress::Finish) {
                Ok(Status::StreamEnd) => Ok(()),
                Ok(status) => Err(CodecError::encode(format!("deflate stopped early ({status:?})"))),
                Err(e) => Err(CodecError::encode(e)),
            }
        })
    }

    fn decode(&self, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        INFLATE.with_borrow_mut(|slot| {
            let inflate = match slot {
                Some(d) => {
                    d.reset(false);
                    d
                }
                None => slot.insert(Decompress::new(false)),
            };
            out.reserve(decoded_len);
            let before = out.len();
            match inflate.decompress_vec(encoded, out, FlushDecompress::Finish) {
                Ok(Status::StreamEnd) if out.len() - before == decoded_len => Ok(()),
                Ok(_) => Err(CodecError::decode("the deflate stream does not decode to the chunk")),
                Err(e) => Err(CodecError::decode(e)),
            }
        })
    }

    fn store_raw_if_larger(&self) -> bool {
        true
    }
}

/// The levels `level=` may give, fastest first.
pub const LEVELS: RangeInclusive<i64> = 1..=9;
/// The level when `level=` is not given.
pub const DEFAULT_LEVEL: i64 = 6;

const LEVEL: ParamSpec = ParamSpec { name: "level", help: "compression level, 1 (fastest) to 9 (smallest)", default: Some("6") };

/// The codec at the level `params` give (`level=`, checked against [`LEVELS`]): this layer's,
/// and the one a crypt layer runs when `gzip` is collapsed into it (`gzip,crypt`).
pub fn codec(params: &Params) -> Result<Gzip> {
    Ok(Gzip::new(params.int_in(LEVEL.name, DEFAULT_LEVEL, LEVELS)? as u32))
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let gzip = codec(&args.params)?;
    build_sca_layer(args, "gzip", Arc::new(gzip))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "gzip",
    summary: "deflate compression (as gzip), chunk by chunk",
    params: &[LEVEL, CHUNK_PARAM, FAST_TAILS_PARAM],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_level_parameter_says_what_the_codec_takes() {
        assert_eq!(LEVEL.default, Some(DEFAULT_LEVEL.to_string().as_str()));
        assert!(LEVEL.help.contains(&format!("{} (fastest) to {} (smallest)", LEVELS.start(), LEVELS.end())), "{}", LEVEL.help);
        assert!(LEVELS.contains(&DEFAULT_LEVEL));
    }

    #[test]
    fn levels_outside_the_range_are_refused_naming_the_parameter_and_the_range() {
        let at = |v: &str| codec(&Params::new("gzip", vec![("level".into(), v.into())]));
        assert_eq!(at("9").unwrap().level, 9);
        assert_eq!(codec(&Params::new("gzip", vec![])).unwrap().level, 6);
        let e = at("10").err().expect("10 is refused").to_string();
        assert!(e.contains("'level'") && e.contains("expected 1 to 9"), "{e}");
        assert!(at("0").is_err());
    }
}
