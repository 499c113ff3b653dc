//! Building a stack from specifications at run time.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::layer::{ExtOpInfo, Layer, Level};
use crate::spec::{LayerSpec, ParamSpec, Params};

/// Everything needed to build one layer.
pub struct BuildArgs {
    /// The instance name, unique within the stack.
    pub name: String,
    pub params: Params,
    pub lower: Level,
}

/// A kind of layer that stacks can be built from.
pub struct LayerFactory {
    pub kind: &'static str,
    pub summary: &'static str,
    pub params: &'static [ParamSpec],
    pub ext_ops: &'static [ExtOpInfo],
    pub build: fn(BuildArgs) -> Result<Arc<dyn Layer>>,
    /// Kinds of layer this one collapses with when one sits directly above it (layer
    /// collapsing, `seeds/002` §4.3): the pair is built as this layer alone, with the upper
    /// layer's kind as the parameter `collapse` and its parameters added, so that the two run
    /// as one per-chunk pipeline with one index. Such a kind further below this layer is
    /// warned about: it would see this layer's output.
    pub absorbs: &'static [&'static str],
}

/// The parameter a collapsed layer receives the absorbed layer's kind in.
pub const COLLAPSE_PARAM: &str = "collapse";

/// The parameter every layer accepts.
pub const NAME_PARAM: ParamSpec = ParamSpec {
    name: "name",
    help: "instance name, for .plyfs/NAME and `plyfs op PATH OP@NAME` (default: the layer type)",
    default: None,
};

/// A built stack: its levels from the top (nearest the user) down to the bottom layer, which owns
/// the lower storage.
pub struct Stack {
    levels: Vec<Level>,
    /// How many levels, from the top, every operation passes through. Below them a routing
    /// layer (per-file chains) may send each file its own way.
    shared: usize,
}

impl Stack {
    /// Build `specs` (top first) over `bottom`, looking layer kinds up in `registry`.
    pub fn build(specs: &[LayerSpec], registry: &[LayerFactory], bottom: Arc<dyn Layer>) -> Result<Stack> {
        Stack::build_over(specs, registry, vec![Level::new(bottom)])
    }

    /// Build `specs` (top first) over `below`, levels already built (top first, the bottom
    /// layer last), which become the lower part of the stack.
    pub fn build_over(specs: &[LayerSpec], registry: &[LayerFactory], below: Vec<Level>) -> Result<Stack> {
        assert!(!below.is_empty(), "a stack needs a bottom");
        let specs = &collapse_specs(specs, registry)?;
        let names = instance_names(specs)?;
        if let Some(taken) = names.iter().find(|n| below.iter().any(|l| l.name() == n.as_str())) {
            return Err(Error::config(format!("layer name '{taken}' is taken by the stack itself: give the layer another name=")));
        }
        let factories = specs
            .iter()
            .map(|spec| find_factory(registry, spec).and_then(|f| check_params(f, spec).map(|()| f)))
            .collect::<Result<Vec<_>>>()?;

        let mut levels: Vec<Level> = below.into_iter().rev().collect();
        for ((spec, factory), name) in specs.iter().zip(&factories).zip(&names).rev() {
            let params: Vec<_> = spec.params.iter().filter(|(k, _)| k != NAME_PARAM.name).cloned().collect();
            let lower = levels.last().expect("the bottom is always there").clone();
            let layer = (factory.build)(BuildArgs { name: name.clone(), params: Params::new(name, params), lower })?;
            levels.push(Level::new(layer));
        }
        levels.reverse();
        let shared = levels.len();
        Ok(Stack { levels, shared })
    }

    /// The level users see.
    pub fn top(&self) -> &Level {
        &self.levels[0]
    }

    /// Declare that only the top `n` levels see every operation (see [`Stack::shared_levels`]).
    pub fn with_shared(mut self, n: usize) -> Stack {
        self.shared = n.min(self.levels.len());
        self
    }

    /// The levels every operation passes through, top first: all of them, unless a routing
    /// layer sends files through per-file chains below it.
    pub fn shared_levels(&self) -> &[Level] {
        &self.levels[..self.shared]
    }

    /// All levels, top first, bottom last.
    pub fn levels(&self) -> &[Level] {
        &self.levels
    }

    /// The user's layers, top first (the bottom layer is not one of them).
    pub fn layers(&self) -> &[Level] {
        &self.levels[..self.levels.len() - 1]
    }

    /// The index of the user layer called `name`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.layers().iter().position(|l| l.name() == name)
    }

    /// Every extended operation some level answers, with the level's name.
    pub fn extended_ops(&self) -> Vec<(String, ExtOpInfo)> {
        self.levels
            .iter()
            .flat_map(|l| l.layer().extended_ops().iter().map(move |op| (l.name().to_owned(), *op)))
            .collect()
    }

    /// Fill in the layer names of an "unsupported operation" error from the bottom.
    pub fn explain(&self, err: Error) -> Error {
        match err {
            Error::UnsupportedOp { op, .. } => Error::UnsupportedOp {
                op,
                layers: self.levels.iter().map(|l| l.name().to_owned()).collect(),
            },
            other => other,
        }
    }

    /// Flush and stop every layer, top first.
    pub fn shutdown(&self) {
        for level in &self.levels {
            level.layer().shutdown();
        }
    }
}

/// Merge every layer into the layer directly below it when that one absorbs its kind (see
/// [`LayerFactory::absorbs`]), and warn about absorbable layers placed further below.
pub fn collapse_specs(specs: &[LayerSpec], registry: &[LayerFactory]) -> Result<Vec<LayerSpec>> {
    for w in order_warnings(specs, registry) {
        tracing::warn!("{w}");
    }
    let absorbs = |lower: &LayerSpec, upper: &LayerSpec| absorbs(registry, lower, upper);
    let mut out: Vec<LayerSpec> = Vec::with_capacity(specs.len());
    let mut i = 0;
    while i < specs.len() {
        let (upper, lower) = (&specs[i], specs.get(i + 1));
        let Some(lower) = lower.filter(|l| absorbs(l, upper)) else {
            out.push(upper.clone());
            i += 1;
            continue;
        };
        let mut merged = lower.clone();
        merged.params.push((COLLAPSE_PARAM.to_owned(), upper.kind.clone()));
        for (k, v) in upper.params.iter().filter(|(k, _)| k != NAME_PARAM.name) {
            match merged.params.iter().find(|(mk, _)| mk == k) {
                Some((_, mv)) if mv != v => {
                    return Err(Error::config(format!(
                        "layers '{}' and '{}' run as one pipeline, so they must agree on '{k}' ({v} against {mv})",
                        upper.kind, lower.kind
                    )))
                }
                Some(_) => {}
                None => merged.params.push((k.clone(), v.clone())),
            }
        }
        out.push(merged);
        i += 2;
    }
    Ok(out)
}

fn absorbs(registry: &[LayerFactory], lower: &LayerSpec, upper: &LayerSpec) -> bool {
    registry.iter().find(|f| f.kind == lower.kind).is_some_and(|f| f.absorbs.contains(&upper.kind.as_str()))
}

/// Layers placed below a layer that would absorb them, where they only see its output (a
/// compressor below a cipher): one message each.
pub fn order_warnings(specs: &[LayerSpec], registry: &[LayerFactory]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        for below in specs[i + 1..].iter().filter(|b| absorbs(registry, spec, b)) {
            out.push(format!(
                "layer '{}' sits below '{}' and only ever sees its output, which it cannot shrink: put it directly above '{}'",
                below.kind, spec.kind, spec.kind
            ));
        }
    }
    out
}

fn find_factory<'r>(registry: &'r [LayerFactory], spec: &LayerSpec) -> Result<&'r LayerFactory> {
    registry.iter().find(|f| f.kind == spec.kind).ok_or_else(|| {
        let known: Vec<_> = registry.iter().map(|f| f.kind).collect();
        Error::config(format!("unknown layer '{}' (available: {})", spec.kind, known.join(", ")))
    })
}

fn check_params(factory: &LayerFactory, spec: &LayerSpec) -> Result<()> {
    for (key, _) in &spec.params {
        if key != NAME_PARAM.name && !factory.params.iter().any(|p| p.name == key) {
            let mut known: Vec<_> = factory.params.iter().map(|p| p.name).collect();
            known.push(NAME_PARAM.name);
            return Err(Error::config(format!(
                "layer '{}': unknown parameter '{key}' (known: {})",
                spec.kind,
                known.join(", ")
            )));
        }
    }
    Ok(())
}

/// Instance names, top first: the `name=` parameter, else the kind, numbered from the top when
/// a kind repeats (`null`, `null#2`, ...).
fn instance_names(specs: &[LayerSpec]) -> Result<Vec<String>> {
    let mut names: Vec<String> = Vec::with_capacity(specs.len());
    for spec in specs {
        let name = match spec.params.iter().find(|(k, _)| k == NAME_PARAM.name) {
            Some((_, given)) => {
                let valid = !given.is_empty()
                    && given.chars().all(|c| c.is_ascii_alphanumeric() || "-_.#".contains(c))
                    && !given.starts_with('.');
                if !valid {
                    return Err(Error::config(format!(
                        "layer '{}': bad name '{given}' (letters, digits, - _ . # only)",
                        spec.kind
                    )));
                }
                given.clone()
            }
            None => {
                let same = names.iter().filter(|n| *n == &spec.kind || n.starts_with(&format!("{}#", spec.kind))).count();
                if same == 0 { spec.kind.clone() } else { format!("{}#{}", spec.kind, same + 1) }
            }
        };
        if names.contains(&name) {
            return Err(Error::config(format!("two layers are named '{name}': give one another name= ")));
        }
        names.push(name);
    }
    Ok(names)
}
