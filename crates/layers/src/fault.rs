//! `fault`: fault injection, for testing applications and the layers above (the role dm-flakey
//! plays for block devices, here for any tree, and inside the stack).
//!
//! Rules pick operations by name, path glob and probability, and inject an error, a delay, a
//! short read or write, or a torn write (part of the data written, then `EIO`). They are added and
//! removed at run time with `fault-add`, `fault-list` and `fault-clear`, or loaded at mount from
//! `rules=FILE` (one rule per line). A rule is words of `key=value`:
//!
//! ```text
//! op=write path=*.db p=0.1 error=ENOSPC    one write in ten to a .db file fails with ENOSPC
//! op=read|readdir delay=200ms              reads and listings take 200 ms longer
//! op=read short=50%                        reads return half of what was asked
//! op=write torn=4096 count=1               the next write keeps 4096 bytes, then fails with EIO
//! error=ENOTCONN                           every operation fails: a dead branch
//! ```
//!
//! `seed=N` makes the random choices of probabilistic rules repeat from one run to the next.

use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use plyfs_stack::glob::{parse_size, Glob};
use plyfs_stack::spec::ParamSpec;
use plyfs_stack::{
    bypass, Build, BuildArgs, Caller, DataPath, Error, ExtOpInfo, Layer, LayerFactory, Level, NodeId, Op, Reply, Result,
};
use serde_json::{json, Value};

use crate::paths::PathTable;

const EXT_OPS: &[ExtOpInfo] = &[
    ExtOpInfo {
        name: "fault-add",
        args: "RULE...",
        help: "add a rule: op=NAME[|NAME] path=GLOB p=PROB count=N and one of error=ERRNO, delay=DURATION, short=N|N%, torn=N",
    },
    ExtOpInfo { name: "fault-list", args: "", help: "the rules, with how often each has fired" },
    ExtOpInfo { name: "fault-clear", args: "[ID]", help: "remove one rule, or all of them" },
];

const RULES: ParamSpec = ParamSpec { name: "rules", help: "a file of rules to start with, one per line (# comments)", default: None };
const SEED: ParamSpec = ParamSpec { name: "seed", help: "seed of the random choices of probabilistic rules", default: Some("random") };

/// What a rule does to an operation it picks.
#[derive(Clone, Debug, PartialEq)]
enum Action {
    Error(i32),
    Delay(Duration),
    /// Reads return, and writes write, only this much.
    Short(Amount),
    /// A write writes this many bytes, then fails with EIO.
    Torn(u64),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Amount {
    Bytes(u64),
    Percent(u64),
}

impl Amount {
    fn of(self, len: usize) -> usize {
        match self {
            Amount::Bytes(n) => (n as usize).min(len),
            Amount::Percent(p) => len * p as usize / 100,
        }
    }
}

#[derive(Debug)]
struct Rule {
    id: u64,
    text: String,
    /// Operation names; empty means every operation.
    ops: Vec<String>,
    glob: Option<Glob>,
    probability: f64,
    action: Action,
    /// How many more times it may fire (`None`: always).
    remaining: Option<u64>,
    fired: u64,
}

/// Error names accepted in `error=`.
const ERRNOS: &[(&str, i32)] = &[
    ("EIO", libc::EIO),
    ("ENOSPC", libc::ENOSPC),
    ("EDQUOT", libc::EDQUOT),
    ("EROFS", libc::EROFS),
    ("ENOTCONN", libc::ENOTCONN),
    ("ETIMEDOUT", libc::ETIMEDOUT),
    ("EACCES", libc::EACCES),
    ("EPERM", libc::EPERM),
    ("ENOENT", libc::ENOENT),
    ("EEXIST", libc::EEXIST),
    ("EAGAIN", libc::EAGAIN),
    ("EINTR", libc::EINTR),
    ("EBUSY", libc::EBUSY),
    ("ENOMEM", libc::ENOMEM),
    ("EFBIG", libc::EFBIG),
    ("ESTALE", libc::ESTALE),
    ("ENXIO", libc::ENXIO),
];

fn rule_error(why: impl Into<String>) -> crate::Error {
    crate::Error::BadRule { why: why.into() }
}

fn parse_errno(text: &str) -> std::result::Result<i32, crate::Error> {
    if let Ok(n) = text.parse::<i32>() {
        return if n > 0 && n < 4096 { Ok(n) } else { Err(rule_error(format!("error={text}: not an errno"))) };
    }
    let upper = text.to_ascii_uppercase();
    ERRNOS.iter().find(|(n, _)| *n == upper).map(|(_, e)| *e).ok_or_else(|| {
        let names: Vec<&str> = ERRNOS.iter().map(|(n, _)| *n).collect();
        rule_error(format!("error={text}: unknown error (a number, or one of {})", names.join(", ")))
    })
}

/// `250ms`, `2s`, `1.5s`, `100us`.
fn parse_duration(text: &str) -> std::result::Result<Duration, crate::Error> {
    let bad = || rule_error(format!("delay={text}: expected a duration such as 200ms or 1.5s"));
    let split = text.find(|c: char| c.is_ascii_alphabetic()).ok_or_else(bad)?;
    let value: f64 = text[..split].parse().map_err(|_| bad())?;
    let unit = match &text[split..] {
        "us" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "m" | "min" => 60.0,
        _ => return Err(bad()),
    };
    let secs = value * unit;
    if !(0.0..=3600.0).contains(&secs) {
        return Err(rule_error(format!("delay={text}: between 0 and one hour")));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_amount(key: &str, text: &str) -> std::result::Result<Amount, crate::Error> {
    match text.strip_suffix('%') {
        Some(p) => match p.parse::<u64>() {
            Ok(p) if p <= 100 => Ok(Amount::Percent(p)),
            _ => Err(rule_error(format!("{key}={text}: a percentage is 0% to 100%"))),
        },
        None => parse_size(text).map(Amount::Bytes).ok_or_else(|| rule_error(format!("{key}={text}: expected bytes (4096, 4k) or a percentage"))),
    }
}

/// Parse one rule from its words (`key=value`, separated by spaces or commas).
fn parse_rule(id: u64, text: &str) -> std::result::Result<Rule, crate::Error> {
    let mut rule = Rule {
        id,
        text: String::new(),
        ops: Vec::new(),
        glob: None,
        probability: 1.0,
        action: Action::Error(0),
        remaining: None,
        fired: 0,
    };
    let mut action = None;
    let words: Vec<&str> = text.split(|c: char| c.is_whitespace() || c == ',').filter(|w| !w.is_empty()).collect();
    if words.is_empty() {
        return Err(rule_error("an empty rule: say what to inject (error=, delay=, short= or torn=)"));
    }
    for word in &words {
        let (key, value) = word.split_once('=').ok_or_else(|| rule_error(format!("'{word}' is not key=value")))?;
        let mut set_action = |a: Action| match action.replace(a) {
            None => Ok(()),
            Some(_) => Err(rule_error("a rule does one thing: give only one of error=, delay=, short= and torn=")),
        };
        match key {
            "op" => rule.ops = value.split('|').filter(|o| !o.is_empty() && *o != "*").map(str::to_owned).collect(),
            "path" => rule.glob = Some(Glob::new(value).map_err(|e| rule_error(format!("path={value}: {e}")))?),
            "p" => {
                let p = match value.strip_suffix('%') {
                    Some(pct) => pct.parse::<f64>().map(|v| v / 100.0),
                    None => value.parse::<f64>(),
                };
                rule.probability = p
                    .ok()
                    .filter(|p| (0.0..=1.0).contains(p))
                    .ok_or_else(|| rule_error(format!("p={value}: a probability is 0 to 1 (or 0% to 100%)")))?;
            }
            "count" => rule.remaining = Some(value.parse().map_err(|_| rule_error(format!("count={value}: expected a number")))?),
            "error" => set_action(Action::Error(parse_errno(value)?))?,
            "delay" => set_action(Action::Delay(parse_duration(value)?))?,
            "short" => set_action(Action::Short(parse_amount(key, value)?))?,
            "torn" => set_action(Action::Torn(parse_size(value).ok_or_else(|| rule_error(format!("torn={value}: expected bytes (4096, 4k)")))?))?,
            other => return Err(rule_error(format!("unknown key '{other}' (op, path, p, count, error, delay, short, torn)"))),
        }
    }
    rule.action = action.ok_or_else(|| rule_error("say what to inject: error=, delay=, short= or torn="))?;
    rule.text = words.join(" ");
    Ok(rule)
}

pub struct Fault {
    name: String,
    lower: [Level; 1],
    rules: RwLock<Vec<Rule>>,
    next_id: AtomicU64,
    rng: Mutex<u64>,
    /// Where each node the kernel holds was last seen, for path globs.
    paths: PathTable,
}

impl Fault {
    /// The path an operation addresses: its object, or the name in its directory.
    fn path_of(&self, node: NodeId, name: Option<&OsStr>) -> String {
        match name {
            Some(name) => self.paths.child_path(node, name),
            None => self.paths.path_of(node),
        }
        .unwrap_or_default()
    }

    fn chance(&self) -> f64 {
        // xorshift64*: reproducible from the seed, which is all a test needs.
        let mut s = self.rng.lock();
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The action of the first rule that picks `op`, counted as fired.
    fn pick(&self, op: &Op<'_>) -> Option<Action> {
        let rules = self.rules.read();
        if rules.is_empty() {
            return None;
        }
        let name = op.name();
        let mut path = None;
        let mut chosen = None;
        for rule in rules.iter() {
            if rule.remaining == Some(0) || (!rule.ops.is_empty() && !rule.ops.iter().any(|o| o == name)) {
                continue;
            }
            if let Some(g) = &rule.glob {
                let p = path.get_or_insert_with(|| {
                    let name = match op {
                        Op::Lookup { name, .. }
                        | Op::Create { name, .. }
                        | Op::MkDir { name, .. }
                        | Op::MkNod { name, .. }
                        | Op::SymLink { name, .. }
                        | Op::Unlink { name, .. }
                        | Op::RmDir { name, .. }
                        | Op::Rename { name, .. } => Some(*name),
                        _ => None,
                    };
                    self.path_of(op.node(), name)
                });
                let subject = if g.pattern.contains('/') { p.as_str() } else { p.rsplit('/').next().unwrap_or(p) };
                if !g.matches(subject) {
                    continue;
                }
            }
            if rule.probability < 1.0 && self.chance() >= rule.probability {
                continue;
            }
            chosen = Some(rule.id);
            break;
        }
        drop(rules);
        let id = chosen?;
        let mut rules = self.rules.write();
        let rule = rules.iter_mut().find(|r| r.id == id)?;
        if rule.remaining == Some(0) {
            return None;
        }
        if let Some(n) = &mut rule.remaining {
            *n -= 1;
        }
        rule.fired += 1;
        tracing::debug!("fault '{}': rule {} ({}) fires on {name}", self.name, rule.id, rule.text);
        Some(rule.action.clone())
    }

    fn add(&self, text: &str) -> std::result::Result<Value, crate::Error> {
        let rule = parse_rule(self.next_id.fetch_add(1, Ordering::Relaxed), text)?;
        let shown = json!({ "id": rule.id, "rule": rule.text });
        tracing::info!("fault '{}': rule {} added: {}", self.name, rule.id, rule.text);
        self.rules.write().push(rule);
        Ok(shown)
    }

    fn list(&self) -> Value {
        let rules = self.rules.read();
        Value::Array(rules.iter().map(|r| json!({ "id": r.id, "rule": r.text, "fired": r.fired, "remaining": r.remaining })).collect())
    }

    fn clear(&self, args: &[String]) -> Result<Value> {
        let mut rules = self.rules.write();
        match args {
            [] => {
                let n = rules.len();
                rules.clear();
                Ok(json!({ "removed": n }))
            }
            [id] => {
                let id: u64 = id.parse().map_err(|_| Error::BadArgs(format!("fault-clear: '{id}' is not a rule number")))?;
                let before = rules.len();
                rules.retain(|r| r.id != id);
                if rules.len() == before {
                    return Err(Error::BadArgs(format!("fault-clear: there is no rule {id}")));
                }
                Ok(json!({ "removed": 1 }))
            }
            _ => Err(Error::BadArgs("usage: fault-clear [ID]".into())),
        }
    }

    /// Forward `op`, with `action` applied to it.
    fn inject(&self, cx: &Caller, op: &Op<'_>, action: Action) -> Result<Reply> {
        match (action, *op) {
            (Action::Error(e), _) => Err(Error::Os(e)),
            (Action::Delay(d), _) => {
                std::thread::sleep(d);
                self.forward(cx, op)
            }
            (Action::Short(amount), Op::Read { .. }) => match self.forward(cx, op)? {
                Reply::Data(mut d) => {
                    let keep = amount.of(d.len());
                    d.truncate(keep);
                    Ok(Reply::Data(d))
                }
                other => Ok(other),
            },
            (Action::Short(amount), Op::Write { node, fh, offset, data }) => {
                let keep = amount.of(data.len());
                self.forward(cx, &Op::Write { node, fh, offset, data: &data[..keep] })
            }
            (Action::Torn(n), Op::Write { node, fh, offset, data }) => {
                let keep = (n as usize).min(data.len());
                self.forward(cx, &Op::Write { node, fh, offset, data: &data[..keep] })?;
                Err(Error::Os(libc::EIO))
            }
            // Short and torn apply to data; other operations pass.
            _ => self.forward(cx, op),
        }
    }

    fn forward(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        let reply = bypass(self, cx, op)?;
        self.paths.learn(op, &reply);
        Ok(reply)
    }
}

impl Layer for Fault {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "fault"
    }

    fn data_path(&self) -> DataPath {
        // Rules may pick reads and writes at any time, so they must all come here.
        DataPath::Observes
    }

    fn lower(&self) -> &[Level] {
        &self.lower
    }

    fn extended_ops(&self) -> &[ExtOpInfo] {
        EXT_OPS
    }

    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        match *op {
            Op::Extended { name: "fault-add", args, .. } => self.add(&args.join(" ")).map(Reply::Extended).map_err(|e| Error::BadArgs(e.to_string())),
            Op::Extended { name: "fault-list", .. } => Ok(Reply::Extended(self.list())),
            Op::Extended { name: "fault-clear", args, .. } => self.clear(args).map(Reply::Extended),
            Op::Forget { node, nlookup } => {
                self.paths.forget(node, nlookup);
                bypass(self, cx, op)
            }
            // Releasing and forgetting are never refused: the kernel does not retry them.
            Op::Release { .. } | Op::ReleaseDir { .. } => bypass(self, cx, op),
            _ => match self.pick(op) {
                Some(action) => self.inject(cx, op, action),
                None => self.forward(cx, op),
            },
        }
    }
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let seed = match args.params.get(SEED.name) {
        None | Some("random") => {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            t.as_nanos() as u64 ^ u64::from(std::process::id())
        }
        Some(v) => v.parse::<u64>().map_err(|_| args.params.bad(SEED.name, v, "expected a number"))?,
    };
    let layer = Fault {
        name: args.name.clone(),
        lower: [args.lower],
        rules: RwLock::new(Vec::new()),
        next_id: AtomicU64::new(1),
        rng: Mutex::new(seed | 1),
        paths: PathTable::new(),
    };
    if let Some(path) = args.params.get(RULES.name) {
        let text = std::fs::read_to_string(path).map_err(|e| args.params.bad(RULES.name, path, &e.to_string()))?;
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            layer.add(line).map_err(|e| Error::config(format!("layer '{}': {path} line {}: {e}", args.name, i + 1)))?;
        }
    }
    Ok(Arc::new(layer))
}

pub const FACTORY: LayerFactory = LayerFactory {
    kind: "fault",
    summary: "fault injection: errors, delays, short and torn reads and writes on chosen operations, changed at run time",
    params: &[RULES, SEED],
    ext_ops: EXT_OPS,
    build: Build::Linear(build),
    absorbs: &[],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_and_refuse_with_reasons() {
        let r = parse_rule(1, "op=write|fsync path=*.db p=10% error=ENOSPC count=2").unwrap();
        assert_eq!(r.ops, ["write", "fsync"]);
        assert_eq!(r.probability, 0.1);
        assert_eq!(r.action, Action::Error(libc::ENOSPC));
        assert_eq!(r.remaining, Some(2));
        assert_eq!(r.text, "op=write|fsync path=*.db p=10% error=ENOSPC count=2");
        assert_eq!(parse_rule(1, "delay=1.5s").unwrap().action, Action::Delay(Duration::from_millis(1500)));
        assert_eq!(parse_rule(1, "op=read,short=25%").unwrap().action, Action::Short(Amount::Percent(25)));
        assert_eq!(parse_rule(1, "torn=4k").unwrap().action, Action::Torn(4096));
        assert_eq!(parse_rule(1, "error=5").unwrap().action, Action::Error(5));
        let err = |t: &str| parse_rule(1, t).unwrap_err().to_string();
        assert!(err("").contains("empty rule"));
        assert!(err("op=write").contains("say what to inject"));
        assert!(err("error=EIO delay=1s").contains("only one of"));
        assert!(err("error=EWHAT").contains("unknown error"));
        assert!(err("p=2").contains("a probability is 0 to 1"));
        assert!(err("delay=soon").contains("expected a duration"));
        assert!(err("short=200%").contains("0% to 100%"));
        assert!(err("colour=red error=EIO").contains("unknown key 'colour'"));
        assert!(err("path=[x error=EIO").contains("without ']'"));
    }

    #[test]
    fn amounts() {
        assert_eq!(Amount::Percent(50).of(10), 5);
        assert_eq!(Amount::Bytes(100).of(10), 10);
        assert_eq!(Amount::Bytes(3).of(10), 3);
    }
}
