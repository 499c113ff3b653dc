//! `null`: the pure bypass layer. It handles no file-system operation, so every one goes straight
//! to the layer below; it exists to measure what a layer boundary costs and as the template for
//! new layers. Its one extended operation, `describe`, shows how a layer adds an operation that
//! travels through layers that do not know it.

use std::sync::Arc;

use plyfs_stack::{Build, bypass, BuildArgs, Caller, ExtOpInfo, Layer, LayerFactory, Level, Op, Reply, Result};
use serde_json::{json, Value};

pub struct Null {
    name: String,
    lower: [Level; 1],
}

const EXT_OPS: &[ExtOpInfo] = &[ExtOpInfo {
    name: "describe",
    args: "",
    help: "this layer and the chain below it: names, kinds, and what each does to file data",
}];

/// `layer` and every layer below it, one entry each.
fn describe_chain(layer: &dyn Layer) -> Vec<Value> {
    let mut chain = vec![json!({ "name": layer.name(), "kind": layer.kind(), "data": layer.data_path().to_string() })];
    if let Some(below) = layer.lower().first() {
        chain.extend(describe_chain(below.layer().as_ref()));
    }
    chain
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

    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        match op {
            Op::Extended { name: "describe", .. } => Ok(Reply::Extended(Value::Array(describe_chain(self)))),
            other => bypass(self, cx, other),
        }
    }
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    Ok(Arc::new(Null { name: args.name, lower: [args.lower] }))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "null",
    summary: "pure bypass: passes every operation to the layer below unchanged",
    params: &[],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};
