//! `zstd`: Zstandard compression of each chunk, through the `zstd` crate.

use std::cell::RefCell;
use std::sync::Arc;

use ::zstd::bulk::{Compressor, Decompressor};
use plyfs_sca::codec::decode_in_place;
use plyfs_sca::{build_sca_layer, Codec, CHUNK_PARAM, EXT_OPS, FAST_TAILS_PARAM};
use plyfs_stack::spec::ParamSpec;
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

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), String> {
        COMPRESSOR.with_borrow_mut(|slot| {
            if slot.as_ref().is_none_or(|(level, _)| *level != self.level) {
                *slot = Some((self.level, Compressor::new(self.level).map_err(|e| e.to_string())?));
            }
            let (_, c) = slot.as_mut().expect("set above");
            let start = out.len();
            out.resize(start + ::zstd::zstd_safe::compress_bound(chunk.len()), 0);
            let n = c.compress_to_buffer(chunk, &mut out[start..]).map_err(|e| e.to_string())?;
            out.truncate(start + n);
            Ok(())
        })
    }

    fn decode(&self, encoded: &[u8], decoded_len: usize, out: &mut Vec<u8>) -> std::result::Result<(), String> {
        DECOMPRESSOR.with_borrow_mut(|slot| {
            if slot.is_none() {
                *slot = Some(Decompressor::new().map_err(|e| e.to_string())?);
            }
            let d = slot.as_mut().expect("set above");
            decode_in_place(out, decoded_len, |dst| d.decompress_to_buffer(encoded, dst).map_err(|e| e.to_string()))
        })
    }

    fn store_raw_if_larger(&self) -> bool {
        true
    }
}

const LEVEL: ParamSpec = ParamSpec { name: "level", help: "compression level, 1 (fastest) to 19 (smallest)", default: Some("3") };

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let level = args.params.int_in(LEVEL.name, 3, 1..=19)? as i32;
    build_sca_layer(args, "zstd", Arc::new(Zstd { level }))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "zstd",
    summary: "Zstandard compression, chunk by chunk",
    params: &[LEVEL, CHUNK_PARAM, FAST_TAILS_PARAM],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};
