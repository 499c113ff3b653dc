//! Stack specifications: `--stack trace:log=t.jsonl,null`, or the same in a TOML file.
//!
//! A spec lists layers from the top (nearest the user) to the bottom. Each layer is
//! `name[:key=value]...`. Every layer accepts `name=` to give the instance its own name, which
//! is how it is addressed from the mount (`.plyfs/NAME`) and by `plyfs op NAME@LAYER`.
//!
//! Stacks can be trees (`seeds/000` §3.2): a fan-out layer (`union`, `mirror`) is the last layer
//! of its list and may be followed by its branches in brackets, separated by `|`. Each branch is
//! itself a stack over its own lower directory, or over a stack served elsewhere when its layers
//! end in `remote` (which takes no directory):
//!
//! ```text
//! BRANCH := [LAYERS] ['@' [DIR] ['=' ro|rw]]
//! union[crypt@/srv/private | @/srv/shared=ro]      two branches with their own directories
//! mirror[zstd|zstd]                                 directories from LOWER and --branch
//! mirror[@/srv/a | remote:addr=tcp:nas:7070]        a directory and a server
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};

/// One layer of a spec, not yet built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub kind: String,
    pub params: Vec<(String, String)>,
    /// The branches of a fan-out layer, top priority first (empty for other layers, and for a
    /// fan-out layer whose branches all come from the command line).
    pub branches: Vec<BranchSpec>,
}

/// Whether a branch of a fan-out layer may be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BranchMode {
    ReadWrite,
    ReadOnly,
}

impl BranchMode {
    pub fn parse(text: &str) -> Option<BranchMode> {
        match text.trim() {
            "rw" => Some(BranchMode::ReadWrite),
            "ro" => Some(BranchMode::ReadOnly),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            BranchMode::ReadWrite => "rw",
            BranchMode::ReadOnly => "ro",
        }
    }
}

/// One branch of a fan-out layer: a stack of its own over its own lower directory, or over a
/// stack served elsewhere when its layers end in `remote`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BranchSpec {
    /// The branch's name under `.plyfs/` (default: the fan-out layer's name, a dot, its index).
    pub name: Option<String>,
    /// The branch's lower directory; `None` until filled from LOWER and `--branch`, and for a
    /// branch that ends in `remote`, which stands on its server.
    pub dir: Option<PathBuf>,
    /// `None` means "as the command line says, else rw".
    pub mode: Option<BranchMode>,
    /// The branch's layers, top first (empty: the directory as it is).
    pub layers: Vec<LayerSpec>,
}

impl BranchSpec {
    pub fn mode(&self) -> BranchMode {
        self.mode.unwrap_or(BranchMode::ReadWrite)
    }

    /// The branch's bottom layer, if it ends in one of `bottoms` (see [`split_bottom`]): it
    /// stands on that (a `remote` layer's server) instead of a directory.
    pub fn bottom(&self, bottoms: &[&str]) -> Result<Option<&LayerSpec>> {
        split_bottom(&self.layers, bottoms).map(|(_, bottom)| bottom)
    }
}

/// `specs` without the bottom layer they end in, and that layer: one of `bottoms`, the layers
/// that the assembly makes itself at the bottom of a stack (`remote`). Such a layer anywhere but
/// last is refused.
pub fn split_bottom<'s>(specs: &'s [LayerSpec], bottoms: &[&str]) -> Result<(&'s [LayerSpec], Option<&'s LayerSpec>)> {
    match specs.iter().position(|s| bottoms.contains(&s.kind.as_str())) {
        None => Ok((specs, None)),
        Some(i) if i + 1 == specs.len() => Ok((&specs[..i], Some(&specs[i]))),
        Some(i) => Err(Error::config(format!("layer '{}' is a bottom layer: it must come last in its stack", specs[i].kind))),
    }
}

/// Split `text` at `sep` where it is not inside brackets.
fn split_top(text: &str, sep: char) -> Result<Vec<&str>> {
    let (mut depth, mut start, mut parts) = (0i32, 0, Vec::new());
    for (i, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth < 0 {
                    return Err(Error::config(format!("stack spec: ']' without '[' in '{text}'")));
                }
            }
            c if c == sep && depth == 0 => {
                parts.push(&text[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(Error::config(format!("stack spec: '[' without ']' in '{text}'")));
    }
    parts.push(&text[start..]);
    Ok(parts)
}

/// Parse a comma-separated stack spec.
pub fn parse_stack_spec(spec: &str) -> Result<Vec<LayerSpec>> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Err(Error::config("empty stack: name at least one layer, e.g. --stack null"));
    }
    split_top(spec, ',')?.into_iter().map(parse_layer_spec).collect()
}

fn parse_layer_spec(text: &str) -> Result<LayerSpec> {
    let text = text.trim();
    let (head, branches) = match text.find('[') {
        Some(open) => {
            let Some(inner) = text[open + 1..].strip_suffix(']') else {
                return Err(Error::config(format!("stack spec: nothing may follow the branches of '{}'", &text[..open])));
            };
            (&text[..open], Some(inner))
        }
        None => (text, None),
    };
    let mut parts = head.split(':');
    let kind = parts.next().unwrap_or("").trim();
    if kind.is_empty() {
        return Err(Error::config(format!("stack spec: empty layer name in '{text}'")));
    }
    if !kind.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err(Error::config(format!("stack spec: bad layer name '{kind}'")));
    }
    let mut params: Vec<(String, String)> = Vec::new();
    for part in parts {
        let Some((key, value)) = part.split_once('=') else {
            // A value may hold colons (`addr=unix:/run/s.sock`, `addr=tcp:host:7070`): a part
            // without `=` continues the value before it.
            if let Some((_, last)) = params.last_mut() {
                last.push(':');
                last.push_str(part.trim());
                continue;
            }
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
    let branches = match branches {
        Some(inner) => split_top(inner, '|')?
            .into_iter()
            .enumerate()
            .map(|(i, b)| parse_branch_spec(b).map_err(|e| Error::config(format!("layer '{kind}', branch {i}: {e}"))))
            .collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    Ok(LayerSpec { kind: kind.to_owned(), params, branches })
}

/// `[LAYERS] ['@' [DIR] ['=' ro|rw]]`.
fn parse_branch_spec(text: &str) -> Result<BranchSpec> {
    let text = text.trim();
    let at = split_top(text, '@')?;
    if at.len() > 2 {
        return Err(Error::config(format!("'{text}' has more than one '@'")));
    }
    let layers = match at[0].trim() {
        "" => Vec::new(),
        stack => parse_stack_spec(stack)?,
    };
    let (mut dir, mut mode) = (None, None);
    if let Some(place) = at.get(1).map(|p| p.trim()) {
        let (path, m) = match place.rsplit_once('=') {
            Some((p, m)) => match BranchMode::parse(m) {
                Some(m) => (p.trim(), Some(m)),
                None => return Err(Error::config(format!("bad branch mode '{m}' (ro or rw)"))),
            },
            None => (place, None),
        };
        if !path.is_empty() {
            dir = Some(PathBuf::from(path));
        }
        mode = m;
    }
    Ok(BranchSpec { name: None, dir, mode, layers })
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
    /// The branches of a fan-out layer (`[[layer.branch]]`).
    #[serde(default, rename = "branch")]
    pub branches: Vec<BranchTable>,
    #[serde(flatten)]
    pub params: BTreeMap<String, toml::Value>,
}

/// A branch in TOML: `dir`, `mode`, `name`, and its own `[[layer.branch.layer]]` tables.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BranchTable {
    pub dir: Option<PathBuf>,
    pub mode: Option<String>,
    pub name: Option<String>,
    #[serde(default, rename = "layer")]
    pub layers: Vec<LayerTable>,
}

/// Read a stack from a TOML configuration file, with each layer's kind and parameters checked
/// against `registry` (and `bottoms`, see [`crate::check_all_params`]) here, so that a mistake
/// names the file and its line: `FILE:LINE: cause`.
pub fn load_stack_config(path: &Path, registry: &[crate::LayerFactory], bottoms: &[&str]) -> Result<Vec<LayerSpec>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::config(format!("{}: {e}", path.display())))?;
    let at = |line: Option<usize>, why: String| match line {
        Some(line) => Error::config(format!("{}:{line}: {why}", path.display())),
        None => Error::config(format!("{}: {why}", path.display())),
    };
    let specs = parse_config(&text).map_err(|(line, why)| at(line, why))?;
    crate::stack::check_all_params(&specs, registry, bottoms).map_err(|bad| at(param_line(&text, bad.layer, &bad.key), bad.error.to_string()))?;
    Ok(specs)
}

/// A stack from the text of a TOML configuration; a mistake says its line (`line 3: cause`).
pub fn parse_stack_config(text: &str) -> Result<Vec<LayerSpec>> {
    parse_config(text).map_err(|(line, why)| match line {
        Some(line) => Error::config(format!("line {line}: {why}")),
        None => Error::config(why),
    })
}

fn parse_config(text: &str) -> std::result::Result<Vec<LayerSpec>, (Option<usize>, String)> {
    let config: StackConfig = toml::from_str(text).map_err(|e| toml_mistake(text, &e))?;
    if config.layers.is_empty() {
        return Err((None, "no [[layer]] tables: name at least one layer".into()));
    }
    layers_of_tables(config.layers).map_err(|e| (None, e.to_string()))
}

/// What is wrong in a TOML text: the line (1-based) toml found it on, if it knows, and the first
/// line of its message, which names the problem.
pub fn toml_mistake(text: &str, e: &toml::de::Error) -> (Option<usize>, String) {
    let line = e.span().map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
    (line, e.message().lines().next().unwrap_or("malformed").to_owned())
}

/// The line of parameter `key` of the `layer`th layer table of a configuration (counted top
/// first and depth first, branches' layers included, which is the order of the `[[layer]]` and
/// `[[layer.branch.layer]]` headers in the file), if it can be found.
fn param_line(text: &str, layer: usize, key: &str) -> Option<usize> {
    let header = |line: &str| line.trim_start().starts_with('[');
    // `[[layer]]`, `[[layer.branch.layer]]`, ...
    let is_layer = |line: &str| {
        let h = line.split('#').next().unwrap_or("").replace([' ', '\t'], "");
        let Some(path) = h.strip_prefix("[[").and_then(|h| h.strip_suffix("]]")) else { return false };
        let parts: Vec<&str> = path.split('.').collect();
        parts.len() % 2 == 1 && parts.iter().enumerate().all(|(i, p)| *p == if i % 2 == 0 { "layer" } else { "branch" })
    };
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.iter().enumerate().filter(|(_, l)| is_layer(l)).map(|(i, _)| i).nth(layer)?;
    lines[start + 1..]
        .iter()
        .take_while(|l| !header(l))
        .position(|l| l.split('=').next().is_some_and(|k| k.trim().trim_matches(['"', '\'']) == key))
        .map(|i| start + 1 + i + 1)
}

fn layers_of_tables(tables: Vec<LayerTable>) -> Result<Vec<LayerSpec>> {
    tables
        .into_iter()
        .map(|t| {
            let kind = t.kind.clone();
            let branches = t
                .branches
                .into_iter()
                .enumerate()
                .map(|(i, b)| {
                    let mode = match b.mode.as_deref() {
                        None => None,
                        Some(m) => Some(BranchMode::parse(m).ok_or_else(|| {
                            Error::config(format!("layer '{kind}', branch {i}: bad mode '{m}' (ro or rw)"))
                        })?),
                    };
                    Ok(BranchSpec { name: b.name, dir: b.dir, mode, layers: layers_of_tables(b.layers)? })
                })
                .collect::<Result<Vec<_>>>()?;
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
            Ok(LayerSpec { kind: t.kind, params, branches })
        })
        .collect()
}

/// A parameter a layer accepts.
#[derive(Clone, Copy, Debug)]
pub struct ParamSpec {
    /// The parameter's name; [`ANY_PARAM`] lets a layer take parameters of any name.
    pub name: &'static str,
    pub help: &'static str,
    /// The default, for `plyfs layers`; `None` means the parameter is optional with no default.
    pub default: Option<&'static str>,
}

/// The name of a [`ParamSpec`] that stands for parameters of any other name, which the layer
/// passes on (a Python layer's own parameters).
pub const ANY_PARAM: &str = "*";

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

    /// Every parameter given, in order (for a layer that passes unknown ones on).
    pub fn all(&self) -> &[(String, String)] {
        &self.values
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
}#[test]
    fn values_may_hold_colons() {
        let specs = parse_stack_spec("zstd,remote:addr=tcp:host:7070:timeout=5").unwrap();
        assert_eq!(specs[1].params, vec![("addr".into(), "tcp:host:7070".into()), ("timeout".into(), "5".into())]);
        assert!(parse_stack_spec("remote:unix").is_err());
    }

    
