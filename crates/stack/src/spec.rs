//! Stack specifications: `--stack trace:log=t.jsonl,null`, or the same in a TOML file.
//!
//! A spec lists layers from the top (nearest the user) to the bottom. Each layer is
//! `name[:key=value]...`. Every layer accepts `name=` to give the instance its own name, which
//! is how it is addressed from the mount (`.plyfs/NAME`) and by `plyfs op NAME@LAYER`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// One layer of a spec, not yet built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub kind: String,
    pub params: Vec<(String, String)>,
}

/// Parse a comma-separated stack spec.
pub fn parse_stack_spec(spec: &str) -> Result<Vec<LayerSpec>> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Err(Error::config("empty stack: name at least one layer, e.g. --stack null"));
    }
    spec.split(',').map(parse_layer_spec).collect()
}

fn parse_layer_spec(text: &str) -> Result<LayerSpec> {
    let text = text.trim();
    let mut parts = text.split(':');
    let kind = parts.next().unwrap_or("").trim();
    if kind.is_empty() {
        return Err(Error::config(format!("stack spec: empty layer name in '{text}'")));
    }
    if !kind.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err(Error::config(format!("stack spec: bad layer name '{kind}'")));
    }
    let mut params = Vec::new();
    for part in parts {
        let Some((key, value)) = part.split_once('=') else {
            return Err(Error::config(format!(
                "layer '{kind}': parameter '{part}' is not key=value"
            )));
        };
        let key = key.trim();
        if key.is_empty() {
            return Err(Error::config(format!("layer '{kind}': empty parameter name in '{part}'")));
        }
        if params.iter().any(|(k, _)| k == key) {
            return Err(Error::config(format!("layer '{kind}': parameter '{key}' given twice")));
        }
        params.push((key.to_owned(), value.trim().to_owned()));
    }
    Ok(LayerSpec { kind: kind.to_owned(), params })
}

/// The TOML form of a mount configuration.
///
/// ```toml
/// [[layer]]
/// type = "trace"
/// log = "/var/log/plyfs.jsonl"
///
/// [[layer]]
/// type = "null"
/// ```
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StackConfig {
    #[serde(default, rename = "layer")]
    pub layers: Vec<LayerTable>,
}

#[derive(Debug, Deserialize)]
pub struct LayerTable {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(flatten)]
    pub params: BTreeMap<String, toml::Value>,
}

/// Read a stack from a TOML configuration file.
pub fn load_stack_config(path: &Path) -> Result<Vec<LayerSpec>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::config(format!("{}: {e}", path.display())))?;
    parse_stack_config(&text).map_err(|e| Error::config(format!("{}: {e}", path.display())))
}

pub fn parse_stack_config(text: &str) -> Result<Vec<LayerSpec>> {
    let config: StackConfig = toml::from_str(text).map_err(|e| {
        // toml's message spans several lines; keep the first, which names the problem.
        let msg = e.message().lines().next().unwrap_or("malformed").to_owned();
        match e.span() {
            Some(span) => {
                let line = text[..span.start].matches('\n').count() + 1;
                Error::config(format!("line {line}: {msg}"))
            }
            None => Error::config(msg),
        }
    })?;
    if config.layers.is_empty() {
        return Err(Error::config("no [[layer]] tables: name at least one layer"));
    }
    config
        .layers
        .into_iter()
        .map(|t| {
            let params = t
                .params
                .into_iter()
                .map(|(k, v)| {
                    let v = match v {
                        toml::Value::String(s) => s,
                        toml::Value::Integer(i) => i.to_string(),
                        toml::Value::Boolean(b) => b.to_string(),
                        toml::Value::Float(f) => f.to_string(),
                        other => {
                            return Err(Error::config(format!(
                                "layer '{}': parameter '{k}' must be a string, number or boolean, not {}",
                                t.kind,
                                other.type_str()
                            )))
                        }
                    };
                    Ok((k, v))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(LayerSpec { kind: t.kind, params })
        })
        .collect()
}

/// A parameter a layer accepts.
#[derive(Clone, Copy, Debug)]
pub struct ParamSpec {
    pub name: &'static str,
    pub help: &'static str,
    /// The default, for `plyfs layers`; `None` means the parameter is optional with no default.
    pub default: Option<&'static str>,
}

/// The validated parameters handed to a layer's constructor.
#[derive(Clone, Debug)]
pub struct Params {
    layer: String,
    values: Vec<(String, String)>,
}

impl Params {
    pub fn new(layer: &str, values: Vec<(String, String)>) -> Params {
        Params { layer: layer.to_owned(), values }
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// A boolean parameter: on/off, true/false, yes/no, 1/0.
    pub fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match v.to_ascii_lowercase().as_str() {
                "on" | "true" | "yes" | "1" => Ok(true),
                "off" | "false" | "no" | "0" => Ok(false),
                _ => Err(self.bad(key, v, "expected on or off")),
            },
        }
    }

    /// An integer parameter within `range`.
    pub fn int_in(&self, key: &str, default: i64, range: std::ops::RangeInclusive<i64>) -> Result<i64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match v.parse::<i64>() {
                Ok(n) if range.contains(&n) => Ok(n),
                _ => Err(self.bad(key, v, &format!("expected {} to {}", range.start(), range.end()))),
            },
        }
    }

    /// The error for a parameter value a layer cannot use.
    pub fn bad(&self, key: &str, value: &str, why: &str) -> Error {
        Error::config(format!("layer '{}': bad value '{value}' for '{key}': {why}", self.layer))
    }
}
