//! The mount-wide rules file (ATTEST's "config file" of rules, `seeds/004` §6).
//!
//! ```toml
//! [[rule]]
//! glob = "*.log"            # a name without '/' matches the file name in any directory
//! layers = "zstd:level=3"
//!
//! [[rule]]
//! glob = "docs/**"          # a pattern with '/' matches the path from the mount root
//! layers = "gzip"
//!
//! [[rule]]
//! extension = ["mp4", "mkv", "jpg"]
//! layers = "none"
//!
//! [[rule]]
//! min_size = "1G"           # and max_size: sizes in bytes, or with k, M, G, T (powers of 1024)
//! layers = "none"
//! ```
//!
//! A rule matches when every condition it has matches; a rule without conditions matches every
//! file. The first matching rule, in file order, decides.

use std::path::Path;

use plyfs_stack::glob::{parse_size, Glob};
use plyfs_stack::{Error, Result};
use serde::Deserialize;

use crate::chain::Policy;

#[derive(Debug, Default)]
pub struct Rules {
    rules: Vec<Rule>,
}

#[derive(Debug)]
pub struct Rule {
    /// 1-based position in the file, for `policy explain`.
    pub number: usize,
    glob: Option<Glob>,
    extensions: Vec<String>,
    min_size: Option<u64>,
    max_size: Option<u64>,
    pub policy: Policy,
    /// The rule as written, for messages.
    pub text: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesFile {
    #[serde(default, rename = "rule")]
    rules: Vec<RuleTable>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleTable {
    glob: Option<String>,
    #[serde(default)]
    extension: Extensions,
    min_size: Option<Size>,
    max_size: Option<Size>,
    layers: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(untagged)]
enum Extensions {
    #[default]
    None,
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

/// Why a rules file cannot be used, and the line it is about (1-based) when one is known.
struct Bad {
    line: Option<usize>,
    why: String,
}

impl Rules {
    /// Read and check a rules file. `check` validates each rule's layers (known layers, valid
    /// parameters), so that a bad rule stops the mount instead of failing later, file by file.
    /// A mistake reads `FILE:LINE: cause`, as a compiler says it.
    pub fn load(path: &Path, check: impl Fn(&Policy) -> Result<()>) -> Result<Rules> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::config(format!("{}: {e}", path.display())))?;
        Rules::parse_lines(&text, check).map_err(|b| match b.line {
            Some(line) => Error::config(format!("{}:{line}: {}", path.display(), b.why)),
            None => Error::config(format!("{}: {}", path.display(), b.why)),
        })
    }

    /// Check the rules of `text`; a mistake says its line (`line 3: cause`).
    pub fn parse(text: &str, check: impl Fn(&Policy) -> Result<()>) -> Result<Rules> {
        Rules::parse_lines(text, check).map_err(|b| match b.line {
            Some(line) => Error::config(format!("line {line}: {}", b.why)),
            None => Error::config(b.why),
        })
    }

    fn parse_lines(text: &str, check: impl Fn(&Policy) -> Result<()>) -> std::result::Result<Rules, Bad> {
        let file: RulesFile = toml::from_str(text).map_err(|e| {
            let (line, why) = plyfs_stack::spec::toml_mistake(text, &e);
            Bad { line, why }
        })?;
        let headers = rule_headers(text);
        let mut rules = Vec::new();
        for (i, t) in file.rules.into_iter().enumerate() {
            let number = i + 1;
            let bad = |why: String| Bad { line: headers.get(i).copied(), why: format!("rule {number}: {why}") };
            let policy = Policy::parse(&t.layers).map_err(|e| bad(e.to_string()))?;
            check(&policy).map_err(|e| bad(e.to_string()))?;
            let glob = t.glob.as_deref().map(Glob::new).transpose().map_err(bad)?;
            let extensions = match t.extension {
                Extensions::None => vec![],
                Extensions::One(e) => vec![e],
                Extensions::Many(v) => v,
            };
            let extensions: Vec<String> = extensions.into_iter().map(|e| e.trim_start_matches('.').to_owned()).collect();
            if extensions.iter().any(|e| e.is_empty() || e.contains('/')) {
                return Err(bad("an extension is empty or contains '/'".into()));
            }
            let size = |s: Option<Size>, what: &str| -> std::result::Result<Option<u64>, Bad> {
                match s {
                    None => Ok(None),
                    Some(Size::Bytes(n)) => Ok(Some(n)),
                    Some(Size::Text(t)) => parse_size(&t).map(Some).ok_or_else(|| bad(format!("{what}: '{t}' is not a size (like 4096, 64k, 1G)"))),
                }
            };
            let (min_size, max_size) = (size(t.min_size, "min_size")?, size(t.max_size, "max_size")?);
            let mut text = Vec::new();
            if let Some(g) = &glob {
                text.push(format!("glob {:?}", g.pattern));
            }
            if !extensions.is_empty() {
                text.push(format!("extension {}", extensions.join("|")));
            }
            if let Some(n) = min_size {
                text.push(format!("size >= {n}"));
            }
            if let Some(n) = max_size {
                text.push(format!("size <= {n}"));
            }
            if text.is_empty() {
                text.push("every file".into());
            }
            let text = format!("{} -> {}", text.join(", "), policy);
            rules.push(Rule { number, glob, extensions, min_size, max_size, policy, text });
        }
        Ok(Rules { rules })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// The first rule matching the file at `path` (relative to the mount root, without a
    /// leading '/') of `size` bytes.
    pub fn find(&self, path: &str, size: u64) -> Option<&Rule> {
        let name = path.rsplit('/').next().unwrap_or(path);
        // Decoded once for all the globs.
        let path_chars: Vec<char> = path.chars().collect();
        let name_chars = &path_chars[path_chars.len() - name.chars().count()..];
        self.rules.iter().find(|r| r.matches(&path_chars, name_chars, name, size))
    }
}

/// The lines of the `[[rule]]` headers, in order: rule N's is the Nth.
fn rule_headers(text: &str) -> Vec<usize> {
    let is_header = |line: &str| {
        let line = line.split('#').next().unwrap_or("").replace([' ', '\t'], "");
        line == "[[rule]]"
    };
    text.lines().enumerate().filter(|(_, l)| is_header(l)).map(|(i, _)| i + 1).collect()
}

impl Rule {
    fn matches(&self, path: &[char], name_chars: &[char], name: &str, size: u64) -> bool {
        if let Some(g) = &self.glob {
            let subject = if g.pattern.contains('/') { path } else { name_chars };
            if !g.matches_chars(subject) {
                return false;
            }
        }
        if !self.extensions.is_empty() {
            let ext = name.rsplit_once('.').map(|(stem, e)| if stem.is_empty() { "" } else { e }).unwrap_or("");
            if !self.extensions.iter().any(|e| e.eq_ignore_ascii_case(ext)) {
                return false;
            }
        }
        self.min_size.is_none_or(|m| size >= m) && self.max_size.is_none_or(|m| size <= m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_match_wins_and_conditions_combine() {
        let text = r#"
            [[rule]]
            min_size = "1G"
            layers = "none"
            [[rule]]
            glob = "*.log"
            layers = "zstd:level=3"
            [[rule]]
            glob = "docs/**"
            extension = ["txt", ".md"]
            layers = "gzip"
        "#;
        let rules = Rules::parse(text, |_| Ok(())).unwrap();
        assert_eq!(rules.find("x/app.log", 10).map(|r| r.number), Some(2));
        assert_eq!(rules.find("x/app.log", 2 << 30).map(|r| r.number), Some(1));
        assert_eq!(rules.find("docs/a/readme.MD", 10).map(|r| r.number), Some(3));
        assert_eq!(rules.find("docs/a/image.png", 10).map(|r| r.number), None);
        assert_eq!(rules.find("src/readme.md", 10).map(|r| r.number), None);
    }

    #[test]
    fn bad_rules_say_which_and_why() {
        let e = Rules::parse("[[rule]]\nglob = \"[x\"\nlayers = \"zstd\"\n", |_| Ok(())).unwrap_err().to_string();
        assert!(e.contains("rule 1") && e.contains("without ']'"), "{e}");
        let e = Rules::parse("[[rule]]\nmin_size = \"big\"\nlayers = \"none\"\n", |_| Ok(())).unwrap_err().to_string();
        assert!(e.contains("min_size") && e.contains("big"), "{e}");
        let e = Rules::parse("[[rule]]\nglob = \"*\"\nlayers = \"zstd\"\ncolour = 1\n", |_| Ok(())).unwrap_err().to_string();
        assert!(e.contains("colour"), "{e}");
        let e = Rules::parse("[[rule]]\nlayers = \"zstd\"\n", |_| Err(Error::config("no zstd here"))).unwrap_err().to_string();
        assert!(e.contains("rule 1") && e.contains("no zstd here"), "{e}");
    }

    #[test]
    fn a_mistake_names_its_line() {
        let e = |text: &str| Rules::parse(text, |_| Ok(())).unwrap_err().to_string();
        let two = "[[rule]]\nglob = \"*.log\"\nlayers = \"zstd\"\n\n# the second\n [[ rule ]] # spaced\n";
        assert!(e(&format!("{two}glob = \"x\nlayers = \"zstd\"\n")).starts_with("line 7: "), "{}", e(&format!("{two}glob = \"x\n")));
        assert!(e(&format!("{two}glob = \"[x\"\nlayers = \"zstd\"\n")).starts_with("line 6: rule 2: "));
        assert!(e(&format!("{two}layers = \"zstd\"\ncolour = 1\n")).starts_with("line 8: unknown field `colour`"));
    }
}
