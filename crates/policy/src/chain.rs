//! Policies (what a file should be encoded with) and chains (the layers that encode it).

use std::fmt;
use std::sync::Arc;

use plyfs_stack::spec::{parse_stack_spec, LayerSpec};
use plyfs_stack::{DataPath, Error, LayerFactory, Level, Result, Stack};

/// The value of a `user.plyfs.layers` attribute or of a rule: a chain of data layers, top
/// first, or none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    specs: Vec<LayerSpec>,
}

/// The word that opts a file or a tree out of every data layer.
pub const NONE: &str = "none";

impl Policy {
    pub fn none() -> Policy {
        Policy { specs: Vec::new() }
    }

    pub fn of(specs: Vec<LayerSpec>) -> Policy {
        Policy { specs }
    }

    /// Parse `none` or a chain such as `gzip:level=9,copy`.
    pub fn parse(text: &str) -> Result<Policy> {
        let text = text.trim();
        if text.eq_ignore_ascii_case(NONE) {
            return Ok(Policy::none());
        }
        if text.is_empty() {
            return Err(Error::config(format!("an empty value: name the layers (e.g. zstd:level=3) or '{NONE}'")));
        }
        let specs = parse_stack_spec(text)?;
        if let Some(s) = specs.iter().find(|s| s.params.iter().any(|(k, _)| k == "name")) {
            return Err(Error::config(format!("layer '{}': name= cannot be given per file", s.kind)));
        }
        Ok(Policy { specs })
    }

    pub fn is_none(&self) -> bool {
        self.specs.is_empty()
    }

    pub fn specs(&self) -> &[LayerSpec] {
        &self.specs
    }
}

impl fmt::Display for Policy {
    /// The canonical text: what is recorded with a file and compared between policies.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.specs.is_empty() {
            return f.write_str(NONE);
        }
        for (i, s) in self.specs.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(&s.kind)?;
            // An instance name (from --stack) says nothing about the encoding.
            for (k, v) in s.params.iter().filter(|(k, _)| k != "name") {
                write!(f, ":{k}={v}")?;
            }
        }
        Ok(())
    }
}

/// A policy built into layers over the shared lower level. The `none` chain is the lower level
/// itself, so untouched files keep the passthrough fast path.
pub struct Chain {
    pub policy: Policy,
    /// The canonical text (`Policy`'s display).
    pub text: String,
    pub top: Level,
    /// The chain's own levels, top first; empty for `none`.
    stack: Option<Stack>,
}

impl Chain {
    pub fn none(lower: &Level) -> Chain {
        Chain { policy: Policy::none(), text: NONE.to_owned(), top: lower.clone(), stack: None }
    }

    /// Build `policy` over `lower`. Its top layer must transform data: monitoring and other
    /// mount-wide layers belong in the mount's stack, above the per-file chains. Below that, a
    /// chain may hold layers that pass data through (`zstd,ext:socket=...,null`): they see what
    /// the layer above them writes.
    pub fn build(policy: &Policy, registry: &[LayerFactory], lower: &Level) -> Result<Chain> {
        if policy.is_none() {
            return Ok(Chain::none(lower));
        }
        let stack = Stack::build(policy.specs(), registry, lower.layer().clone())?;
        if let Some(l) = stack.layers().first().filter(|l| l.layer().data_path() != DataPath::Transforms) {
            return Err(Error::config(format!(
                "layer '{}' cannot be chosen per file: it does not transform data (put it in the mount's --stack)",
                l.layer().kind()
            )));
        }
        Ok(Chain { text: policy.to_string(), policy: policy.clone(), top: stack.top().clone(), stack: Some(stack) })
    }

    /// The chain's own levels, top first (none for the empty chain).
    pub fn levels(&self) -> &[Level] {
        self.stack.as_ref().map_or(&[], |s| s.layers())
    }

    pub fn transforms(&self) -> bool {
        self.stack.is_some()
    }

    /// How to tell the chain's lower files from plain ones: the test of its lowest layer that
    /// transforms data, which writes them. `None` when that layer cannot tell (every file is
    /// the chain's), or for the empty chain.
    pub fn file_test(&self) -> Option<fn(&[u8]) -> bool> {
        self.levels().iter().rev().find(|l| l.layer().data_path() == DataPath::Transforms)?.layer().file_test()
    }

    pub fn shutdown(&self) {
        if let Some(s) = &self.stack {
            // The shared bottom level belongs to the mount: stop the chain's own layers only.
            for l in s.layers() {
                l.layer().shutdown();
            }
        }
    }
}

pub type ChainRef = Arc<Chain>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_text() {
        assert_eq!(Policy::parse(" None ").unwrap().to_string(), "none");
        assert_eq!(Policy::parse("gzip:level=9, copy").unwrap().to_string(), "gzip:level=9,copy");
        assert!(Policy::parse("").is_err());
        assert!(Policy::parse("zstd:level").is_err());
        assert!(Policy::parse("zstd:name=x").is_err());
    }
}
