//! `lz4`: LZ4 block compression of each chunk, through `lz4_flex`: the fastest of the
//! compressors, for data that is read far more than it is written.

use std::sync::Arc;

use plyfs_sca::codec::decode_in_place;
use plyfs_sca::{build_sca_layer, Codec, Error as CodecError, CHUNK_PARAM, EXT_OPS, FAST_TAILS_PARAM};
use plyfs_stack::spec::Params;
use plyfs_stack::{Build, BuildArgs, Layer, LayerFactory, Result};

pub struct Lz4;

impl Codec for Lz4 {
    fn tag(&self) -> [u8; 4] {
        *b"lz4\0"
    }

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        let start = out.len();
        out.resize(start + lz4_flex::block::get_maximum_output_size(chunk.len()), 0);
        let n = lz4_flex::block::compress_into(chunk, &mut out[start..]).map_err(CodecError::encode)?;
        out.truncate(start + n);
        Ok(())
    }

    fn decode(&self, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        decode_in_place(out, decoded_len, |dst| lz4_flex::block::decompress_into(encoded, dst).map_err(CodecError::decode))
    }

    fn store_raw_if_larger(&self) -> bool {
        true
    }
}

/// The parameter that gives the other compressors their level.
const LEVEL_PARAM: &str = "level";

/// The codec for `params`: this layer's, and the one a crypt layer runs when `lz4` is collapsed
/// into it (`lz4,crypt`). lz4 has no levels, so a `level=` is refused.
pub fn codec(params: &Params) -> Result<Lz4> {
    if let Some(v) = params.get(LEVEL_PARAM) {
        return Err(params.bad(LEVEL_PARAM, v, "lz4 has no levels"));
    }
    Ok(Lz4)
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let lz4 = codec(&args.params)?;
    build_sca_layer(args, "lz4", Arc::new(lz4))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "lz4",
    summary: "LZ4 compression, chunk by chunk: fastest to decode",
    params: &[CHUNK_PARAM, FAST_TAILS_PARAM],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_level_is_refused_naming_the_parameter() {
        assert!(codec(&Params::new("lz4", vec![])).is_ok());
        let e = codec(&Params::new("lz4", vec![("level".into(), "3".into())])).err().expect("refused").to_string();
        assert!(e.contains("'level'") && e.contains("lz4 has no levels"), "{e}");
    }
}
