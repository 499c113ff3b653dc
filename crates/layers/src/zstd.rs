//! `zstd`: Zstandard compression of each chunk, through the `zstd` crate.

use std::cell::RefCell;
use std::ops::RangeInclusive;
use std::sync::Arc;

use ::zstd::bulk::{Compressor, Decompressor};
use plyfs_sca::codec::decode_in_place;
use plyfs_sca::{build_sca_layer, Codec, Error as CodecError, CHUNK_PARAM, EXT_OPS, FAST_TAILS_PARAM};
use plyfs_stack::spec::{ParamSpec, Params};
use plyfs_stack::{Build, BuildArgs, Layer, LayerFactory, Result};

pub struct Zstd {
    level: i32,
}

impl Zstd {
    pub const fn new(level: i32) -> Zstd {
        Zstd { level }
    }
}

thread_local! {
    // Contexts are costly to create; each thread keeps one of each.
    static COMPRESSOR: RefCell<Option<(i32, Compressor<'static>)>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<Decompressor<'static>>> = const { RefCell::new(None) };
}

impl Codec for Zstd {
    fn tag(&self) -> [u8; 4] {
        *b"zstd"
    }

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        COMPRESSOR.with_borrow_mut(|slot| {
            if slot.as_ref().is_none_or(|(level, _)| *level != self.level) {
                *slot = Some((self.level, Compressor::new(self.level).map_err(CodecError::encode)?));
            }
            let (_, c) = slot.as_mut().expect("set above");
            let start = out.len();
            out.resize(start + ::zstd::zstd_safe::compress_bound(chunk.len()), 0);
            let n = c.compress_to_buffer(chunk, &mut out[start..]).map_err(CodecError::encode)?;
            out.truncate(start + n);
            Ok(())
        })
    }

    fn decode(&self, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        DECOMPRESSOR.with_borrow_mut(|slot| {
            if slot.is_none() {
                *slot = Some(Decompressor::new().map_err(CodecError::decode)?);
            }
            let d = slot.as_mut().expect("set above");
            decode_in_place(out, decoded_len, |dst| d.decompress_to_buffer(encoded, dst).map_err(CodecError::decode))
        })
    }

    fn store_raw_if_larger(&self) -> bool {
        true
    }
}

/// The levels `level=` may give, fastest first.
pub const LEVELS: RangeInclusive<i64> = 1..=19;
/// The level when `level=` is not given.
pub const DEFAULT_LEVEL: i64 = 3;

const LEVEL: ParamSpec = ParamSpec { name: "level", help: "compression level, 1 (fastest) to 19 (smallest)", default: Some("3") };

/// The codec at the level `params` give (`level=`, checked against [`LEVELS`]): this layer's,
/// and the one a crypt layer runs when `zstd` is collapsed into it (`zstd,crypt`).
pub fn codec(params: &Params) -> Result<Zstd> {
    Ok(Zstd::new(params.int_in(LEVEL.name, DEFAULT_LEVEL, LEVELS)? as i32))
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let zstd = codec(&args.params)?;
    build_sca_layer(args, "zstd", Arc::new(zstd))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "zstd",
    summary: "Zstandard compression, chunk by chunk",
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
        let at = |v: &str| codec(&Params::new("zstd", vec![("level".into(), v.into())]));
        assert_eq!(at("19").unwrap().level, 19);
        assert_eq!(codec(&Params::new("zstd", vec![])).unwrap().level, 3);
        let e = at("20").err().expect("20 is refused").to_string();
        assert!(e.contains("'level'") && e.contains("expected 1 to 19"), "{e}");
        assert!(at("0").is_err());
    }
}
