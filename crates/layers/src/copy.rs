//! `copy`: the identity size-changing layer (Copyfs in Fast Indexing §7.1). Its chunks are the
//! data itself, so what it costs over `null` is the fast-indexing machinery alone.

use std::sync::Arc;

use plyfs_sca::{build_sca_layer, Codec, Error as CodecError, CHUNK_PARAM, EXT_OPS, FAST_TAILS_PARAM};
use plyfs_stack::{Build, BuildArgs, Layer, LayerFactory, Result};

pub struct Copy;

impl Codec for Copy {
    fn tag(&self) -> [u8; 4] {
        *b"copy"
    }

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        out.extend_from_slice(chunk);
        Ok(())
    }

    fn decode(&self, encoded: &[u8], _decoded_len: usize, out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
        out.extend_from_slice(encoded);
        Ok(())
    }
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    build_sca_layer(args, "copy", Arc::new(Copy))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "copy",
    summary: "identity size-changing layer: measures the fast-indexing machinery alone",
    params: &[CHUNK_PARAM, FAST_TAILS_PARAM],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};
