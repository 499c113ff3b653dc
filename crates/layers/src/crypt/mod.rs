//! `crypt`: authenticated encryption of file data, chunk by chunk, on the size-changing
//! framework. See [`codec`] for the format of a chunk, [`keys`] for the volume's keys, [`names`]
//! for its names and [`bind`] for binding each file to its place (`plyfs init --bind-paths`).
//!
//! The layer finds its volume by the configuration file at the root of the directory below
//! it, and its key in the keyring, where `plyfs mount` (or an offline tool) put it after
//! unlocking the volume. A volume that is not unlocked cannot be stacked.

pub mod bind;
pub mod codec;
pub mod keys;
pub mod names;
pub mod reverse;

use std::ffi::OsStr;
use std::sync::Arc;

use plyfs_sca::{build_sca_layer_padded, Codec, CHUNK_PARAM, EXT_OPS, FAST_TAILS_PARAM};
use plyfs_stack::spec::{ParamSpec, Params};
use plyfs_stack::{Build, BuildArgs, Caller, Error, ExtOpInfo, Layer, LayerFactory, Level, NodeId, Result, COLLAPSE_PARAM};

use codec::CryptCodec;
use keys::{Volume, VolumeConfig, CONFIG_NAME};

/// Read the volume configuration at the root of the storage under `lower`: from the bottom
/// level, past any layer that would transform the file.
pub fn config_below(lower: &Level) -> Result<Option<VolumeConfig>> {
    let mut bottom = lower.clone();
    while let Some(next) = bottom.layer().lower().first().cloned() {
        bottom = next;
    }
    let bytes = match bottom.read_small_file(&Caller::daemon(), NodeId::ROOT, OsStr::new(CONFIG_NAME), 1 << 16) {
        Ok(b) => b,
        Err(Error::Os(libc::ENOENT)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let text = String::from_utf8(bytes).map_err(|_| Error::config(format!("{CONFIG_NAME}: corrupt: not text")))?;
    VolumeConfig::parse(&text, CONFIG_NAME).map(Some).map_err(Error::config)
}

/// The unlocked volume of `config`.
fn unlocked(config: &VolumeConfig, layer: &str) -> Result<Arc<Volume>> {
    let id = config.id().map_err(Error::config)?;
    keys::registered(&id).ok_or_else(|| {
        Error::config(format!(
            "layer '{layer}': the crypt volume is locked: give its password (prompt, --passfile or --extpass) or --keyfile"
        ))
    })
}

/// The unlocked volume whose configuration sits at the root of `lower`.
pub fn volume_below(lower: &Level, layer: &str) -> Result<Arc<Volume>> {
    let config = config_below(lower)?.ok_or_else(|| {
        Error::config(format!(
            "layer '{layer}': the directory below is not a crypt volume ({CONFIG_NAME} is missing); create one with `plyfs init LOWER --layer crypt`"
        ))
    })?;
    unlocked(&config, layer)
}

/// `lower` (the lower directory of a mount) with the names layer of its crypt volume on top,
/// when it is one; unchanged when it is not. The volume must be unlocked.
pub fn with_names(lower: Level) -> Result<Level> {
    match config_below(&lower)? {
        None => Ok(lower),
        Some(config) => Ok(names::names_level(&unlocked(&config, "crypt-names")?, lower)),
    }
}

/// Build a crypt layer; `inner` is a compressor collapsed into it (`zstd,crypt`), given by its
/// layer kind and codec.
pub fn build_crypt(args: BuildArgs, kind: &'static str, inner: Option<(&str, Arc<dyn Codec>)>) -> Result<Arc<dyn Layer>> {
    let volume = volume_below(&args.lower, &args.name)?;
    let pad = match args.params.get(PAD.name) {
        // The volume's setting; a pipeline that compresses does not pad (below).
        None => volume.pad && inner.is_none(),
        Some("none") => false,
        Some("padme") if inner.is_some() => {
            return Err(Error::config(format!(
                "layer '{}': pad=padme with compression would hide nothing: each compressed chunk's length shows below; pad plain crypt",
                args.name
            )))
        }
        Some("padme") => true,
        Some(other) => return Err(args.params.bad(PAD.name, other, "expected padme or none")),
    };
    if volume.pad && !pad {
        tracing::warn!(
            "layer '{}': this volume pads file sizes, but the files this layer writes are not padded ({}): their sizes show below",
            args.name,
            if inner.is_some() { "compressed chunks show their lengths anyway" } else { "pad=none" }
        );
    }
    let inner = match inner {
        None => None,
        Some((k, c)) => Some((
            codec::kind_of(k).ok_or_else(|| Error::config(format!("layer '{k}' cannot be collapsed into crypt")))?,
            c,
        )),
    };
    build_sca_layer_padded(args, kind, Arc::new(CryptCodec::new(volume.cipher, &volume.key, inner)), pad)
}

/// The compressor `collapse=` names, by layer kind, with its codec at the level `level=` gives:
/// each compressor checks its own levels.
fn collapsed(params: &Params) -> Result<Option<(&'static str, Arc<dyn Codec>)>> {
    let inner: Option<(&'static str, Arc<dyn Codec>)> = match params.get(COLLAPSE_PARAM) {
        None | Some("none") => {
            if let Some(v) = params.get(LEVEL.name) {
                return Err(params.bad(LEVEL.name, v, "a level needs a compressor (collapse=zstd, gzip or lz4)"));
            }
            None
        }
        Some("zstd") => Some(("zstd", Arc::new(crate::zstd::codec(params)?))),
        Some("gzip") => Some(("gzip", Arc::new(crate::gzip::codec(params)?))),
        Some("lz4") => Some(("lz4", Arc::new(crate::lz4::codec(params)?))),
        Some(other) => return Err(params.bad(COLLAPSE_PARAM, other, "expected zstd, gzip, lz4 or none")),
    };
    Ok(inner)
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let inner = collapsed(&args.params)?;
    build_crypt(args, "crypt", inner)
}

const COLLAPSE: ParamSpec = ParamSpec {
    name: COLLAPSE_PARAM,
    help: "compress each chunk before sealing it, in one pass: zstd, gzip, lz4 or none; set by itself when one of them sits directly above crypt (`zstd,crypt`)",
    default: Some("none"),
};

const LEVEL: ParamSpec = ParamSpec { name: "level", help: "level of the collapsed compressor", default: None };

const PAD: ParamSpec = ParamSpec {
    name: "pad",
    help: "hide file sizes below: padme pads what is stored to the PADMÉ length of the size (at most 12% more), none does not",
    default: Some("the volume's (plyfs init --pad)"),
};

pub const CRYPT_OPS: [ExtOpInfo; 5] = [EXT_OPS[0], EXT_OPS[1], EXT_OPS[2], EXT_OPS[3], codec::INFO_OP];

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "crypt",
    summary: "authenticated encryption (AES-256-GCM or XChaCha20-Poly1305), chunk by chunk",
    params: &[CHUNK_PARAM, FAST_TAILS_PARAM, COLLAPSE, LEVEL, PAD],
    ext_ops: &CRYPT_OPS,
    build: Build::Linear(build),
    absorbs: &["zstd", "gzip", "lz4"],
};

#[cfg(test)]
mod tests {
    use super::*;

    fn collapse(values: &[(&str, &str)]) -> Result<Option<(&'static str, [u8; 4])>> {
        let params = Params::new("crypt", values.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        collapsed(&params).map(|inner| inner.map(|(kind, codec)| (kind, codec.tag())))
    }

    fn refusal(values: &[(&str, &str)]) -> String {
        collapse(values).expect_err("refused").to_string()
    }

    #[test]
    fn each_compressor_collapses_at_its_own_levels() {
        assert_eq!(collapse(&[]).unwrap(), None);
        assert_eq!(collapse(&[("collapse", "none")]).unwrap(), None);
        assert_eq!(collapse(&[("collapse", "zstd")]).unwrap(), Some(("zstd", *b"zstd")));
        assert_eq!(collapse(&[("collapse", "zstd"), ("level", "19")]).unwrap(), Some(("zstd", *b"zstd")));
        assert_eq!(collapse(&[("collapse", "gzip"), ("level", "9")]).unwrap(), Some(("gzip", *b"gzip")));
        assert_eq!(collapse(&[("collapse", "lz4")]).unwrap(), Some(("lz4", *b"lz4\0")));
    }

    #[test]
    fn a_bad_level_is_refused_naming_the_parameter_and_what_it_takes() {
        let zstd = refusal(&[("collapse", "zstd"), ("level", "20")]);
        assert!(zstd.contains("layer 'crypt'") && zstd.contains("'level'") && zstd.contains("expected 1 to 19"), "{zstd}");
        let gzip = refusal(&[("collapse", "gzip"), ("level", "10")]);
        assert!(gzip.contains("'level'") && gzip.contains("expected 1 to 9"), "{gzip}");
        let lz4 = refusal(&[("collapse", "lz4"), ("level", "1")]);
        assert!(lz4.contains("'level'") && lz4.contains("lz4 has no levels"), "{lz4}");
        let alone = refusal(&[("level", "3")]);
        assert!(alone.contains("'level'") && alone.contains("a level needs a compressor"), "{alone}");
        let other = refusal(&[("collapse", "brotli")]);
        assert!(other.contains("'collapse'") && other.contains("expected zstd, gzip, lz4 or none"), "{other}");
    }
}
