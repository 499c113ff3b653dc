//! `null`: the pure bypass layer. It overrides nothing, so every operation goes straight to the
//! layer below; it exists to measure what a layer boundary costs and as the template for new
//! layers.

use std::sync::Arc;

use plyfs_stack::{BuildArgs, Layer, LayerFactory, Level, Result};

pub struct Null {
    name: String,
    lower: [Level; 1],
}

impl Layer for Null {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "null"
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    Ok(Arc::new(Null { name: args.name, lower: [args.lower] }))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "null",
    summary: "pure bypass: passes every operation to the layer below unchanged",
    params: &[],
    ext_ops: &[],
    build,
};
