//! Building a stack from specifications at run time, and naming every level of it (fan-in).
//!
//! A stack is a list of levels ending in a bottom layer or in a fan-out layer. A fan-out layer's
//! branches are stacks of their own ([`Branch`]), so a whole mount is a tree (`seeds/000` §3.2).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::error::{Error, Result};
use crate::layer::{ExtOpInfo, Layer, Level};
use crate::spec::{BranchMode, BranchSpec, LayerSpec, ParamSpec, Params};

/// Everything needed to build one linear layer.
pub struct BuildArgs {
    /// The instance name, unique within the stack.
    pub name: String,
    pub params: Params,
    pub lower: Level,
}

/// Everything needed to build one fan-out layer.
pub struct FanOutArgs {
    pub name: String,
    pub params: Params,
    /// The branches, top priority first, already built.
    pub branches: Vec<Branch>,
    /// Builds the branches added at run time.
    pub builder: Arc<dyn BranchBuilder>,
}

/// How a kind of layer is built: over one level, or over several branches.
pub enum Build {
    Linear(fn(BuildArgs) -> Result<Arc<dyn Layer>>),
    FanOut(fn(FanOutArgs) -> Result<Arc<dyn Layer>>),
}

/// One branch of a fan-out layer: a stack over its own lower directory, or over a stack served
/// elsewhere.
#[derive(Clone)]
pub struct Branch {
    /// Unique in the mount: `.plyfs/NAME/` shows the branch, `OP@NAME` starts there.
    pub name: String,
    pub lower: BranchLower,
    pub mode: BranchMode,
    pub stack: Arc<Stack>,
}

/// What a branch's stack stands on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BranchLower {
    /// A lower directory (canonical).
    Dir(PathBuf),
    /// A stack served elsewhere, which the `remote` layer at the bottom of the branch reaches
    /// at `addr` (`unix:PATH`, `tcp:HOST:PORT`).
    Remote { addr: String },
}

impl BranchLower {
    pub fn dir(&self) -> Option<&Path> {
        match self {
            BranchLower::Dir(dir) => Some(dir),
            BranchLower::Remote { .. } => None,
        }
    }

    /// The field a listing of branches shows it in (`branch-list`, `mirror-status`): `dir`
    /// or `addr`, with its value.
    pub fn field(&self) -> (&'static str, String) {
        match self {
            BranchLower::Dir(dir) => ("dir", dir.display().to_string()),
            BranchLower::Remote { addr } => ("addr", addr.clone()),
        }
    }
}

impl std::fmt::Display for BranchLower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BranchLower::Dir(dir) => write!(f, "{}", dir.display()),
            BranchLower::Remote { addr } => write!(f, "{addr}"),
        }
    }
}

impl Branch {
    /// The branch's top level: what the fan-out layer calls.
    pub fn top(&self) -> &Level {
        self.stack.top()
    }

    pub fn writable(&self) -> bool {
        self.mode == BranchMode::ReadWrite
    }

    /// Whether a user means this branch by `given`: its name, its directory or its server.
    pub fn is_called(&self, given: &str) -> bool {
        self.name == given || self.lower.to_string() == given
    }
}

/// Builds a branch's stack over its directory or its server. The mount supplies it (it knows
/// about lower directories, servers, volumes and per-file policies); fan-out layers keep it to
/// add branches later.
pub trait BranchBuilder: Send + Sync {
    /// Build `spec`, whose directory is filled in (unless it ends in a bottom layer that
    /// reaches a server), as the branch `name`.
    fn build(&self, name: &str, spec: &BranchSpec) -> Result<Branch>;
}

/// A kind of layer that stacks can be built from.
pub struct LayerFactory {
    pub kind: &'static str,
    pub summary: &'static str,
    pub params: &'static [ParamSpec],
    pub ext_ops: &'static [ExtOpInfo],
    pub build: Build,
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
/// the lower storage, or down to a fan-out layer, whose branches are stacks of their own.
pub struct Stack {
    levels: Vec<Level>,
    /// How many levels, from the top, every operation passes through. Below them a routing
    /// layer (per-file chains) may send each file its own way.
    shared: usize,
    /// The numbered views of fan-in ([`Stack::view`]). A number, once given, always means the
    /// same level: branches added later get new numbers, removed ones leave a gap.
    views: RwLock<Vec<(String, Option<Level>)>>,
}

/// A level of the tree by name: the level itself (`OP@NAME` starts there) and the view below it
/// (`.plyfs/NAME/`), which a bottom or fan-out layer does not have.
#[derive(Clone)]
pub struct NamedLevel {
    pub name: String,
    pub level: Level,
    pub below: Option<Level>,
}

/// Views are numbered in one byte by the FUSE front end, which keeps 0 for the top and 255 for
/// itself.
pub const MAX_VIEWS: usize = 254;

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
            if !spec.branches.is_empty() {
                return Err(Error::config(format!("layer '{name}' has no branches: only a fan-out layer takes [...]")));
            }
            let Build::Linear(build) = factory.build else {
                return Err(Error::config(format!(
                    "layer '{name}' fans out, so it must be the last layer of its list (layers below it go in its branches)"
                )));
            };
            let lower = levels.last().expect("the bottom is always there").clone();
            let layer = build(BuildArgs { name: name.clone(), params: layer_params(name, spec), lower })?;
            levels.push(Level::new(layer));
        }
        levels.reverse();
        Ok(Stack::of_levels(levels))
    }

    fn of_levels(levels: Vec<Level>) -> Stack {
        let shared = levels.len();
        let stack = Stack { levels, shared, views: RwLock::new(Vec::new()) };
        stack.refresh_views();
        stack
    }

    /// Build the fan-out layer `spec` (named `name`) over its branches, whose directories are
    /// filled in. Branches are named as `spec` says, else `NAME.INDEX`.
    pub fn build_fan_out(spec: &LayerSpec, name: &str, registry: &[LayerFactory], builder: Arc<dyn BranchBuilder>) -> Result<Level> {
        let factory = find_factory(registry, spec)?;
        check_params(factory, spec)?;
        let Build::FanOut(build) = factory.build else {
            return Err(Error::config(format!("layer '{name}' does not fan out")));
        };
        if spec.branches.is_empty() {
            return Err(Error::config(format!("layer '{name}' has no branches")));
        }
        let mut branches: Vec<Branch> = Vec::with_capacity(spec.branches.len());
        for (i, b) in spec.branches.iter().enumerate() {
            let branch_name = b.name.clone().unwrap_or_else(|| format!("{name}.{i}"));
            check_name(&format!("branch of '{name}'"), &branch_name)?;
            if branches.iter().any(|o| o.name == branch_name) {
                return Err(Error::config(format!("layer '{name}': two branches are named '{branch_name}'")));
            }
            let branch = builder.build(&branch_name, b)?;
            check_branch_lowers(&branches, &branch)?;
            branches.push(branch);
        }
        let layer = build(FanOutArgs { name: name.to_owned(), params: layer_params(name, spec), branches, builder })?;
        Ok(Level::new(layer))
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

    /// Every level of the tree by name, top first, depth first: this stack's levels, then the
    /// branches of a fan-out layer at its bottom (`BRANCH`, then `BRANCH.LAYER` for the levels
    /// inside), as they are now.
    pub fn named_levels(&self) -> Vec<NamedLevel> {
        let mut out = Vec::new();
        self.collect_named("", &mut out);
        out
    }

    fn collect_named(&self, prefix: &str, out: &mut Vec<NamedLevel>) {
        self.collect_named_in(prefix, false, out)
    }

    /// `read_only`: this stack is (inside) a branch mounted `=ro`, and every level of it is
    /// handed out through a handle that refuses changes, so no fan-in path writes to it.
    fn collect_named_in(&self, prefix: &str, read_only: bool, out: &mut Vec<NamedLevel>) {
        let guard = |l: &Level| if read_only { l.read_only() } else { l.clone() };
        for (i, level) in self.levels.iter().enumerate() {
            let below = self.levels.get(i + 1).map(guard);
            out.push(NamedLevel { name: format!("{prefix}{}", level.name()), level: guard(level), below });
        }
        let last = self.levels.last().expect("a stack has a bottom");
        for branch in last.layer().branches() {
            let name = format!("{prefix}{}", branch.name);
            let ro = read_only || !branch.writable();
            let top = if ro { branch.top().read_only() } else { branch.top().clone() };
            out.push(NamedLevel { name: name.clone(), level: top.clone(), below: Some(top) });
            branch.stack.collect_named_in(&format!("{name}."), ro, out);
        }
    }

    /// The level `OP@NAME` starts at.
    pub fn level_named(&self, name: &str) -> Option<Level> {
        self.named_levels().into_iter().find(|n| n.name == name).map(|n| n.level)
    }

    /// Renumber fan-in views after branches came or went: new names get new numbers, names
    /// that are gone (or now name another level) leave their number unused.
    pub fn refresh_views(&self) {
        let current: Vec<(String, Level)> =
            self.named_levels().into_iter().filter_map(|n| n.below.map(|b| (n.name, b))).collect();
        let mut views = self.views.write();
        for (name, level) in views.iter_mut() {
            match current.iter().find(|(n, l)| n == name && level.as_ref().is_some_and(|v| v.same(l))) {
                // A branch switched between ro and rw keeps its number, with the new handle.
                Some((_, l)) => *level = Some(l.clone()),
                None => *level = None,
            }
        }
        for (name, level) in current {
            if views.iter().any(|(n, l)| *n == name && l.is_some()) {
                continue;
            }
            if views.len() >= MAX_VIEWS {
                tracing::warn!("level '{name}' gets no view under .plyfs: a mount has at most {MAX_VIEWS}");
                continue;
            }
            views.push((name, Some(level)));
        }
    }

    /// Fan-in view `n`: 0 is the top, others are numbered by [`Stack::views`].
    pub fn view(&self, n: usize) -> Option<Level> {
        match n {
            0 => Some(self.levels[0].clone()),
            n => self.views.read().get(n - 1).and_then(|(_, l)| l.clone()),
        }
    }

    /// The live views with their numbers and names, in order.
    pub fn views(&self) -> Vec<(usize, String)> {
        let views = self.views.read();
        views.iter().enumerate().filter(|(_, (_, l))| l.is_some()).map(|(i, (n, _))| (i + 1, n.clone())).collect()
    }

    /// The number of the view called `name`, looking again at the tree if it is not known.
    pub fn view_named(&self, name: &str) -> Option<usize> {
        let find = |s: &Stack| s.views().into_iter().find(|(_, n)| n == name).map(|(i, _)| i);
        find(self).or_else(|| {
            self.refresh_views();
            find(self)
        })
    }

    /// The index of the user layer called `name`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.layers().iter().position(|l| l.name() == name)
    }

    /// The extended operations of `from` and of every level below it in the tree (branches
    /// included), each once, with the name of the level that answers it.
    pub fn extended_ops_from(&self, from: &Level) -> Vec<(String, ExtOpInfo)> {
        let named = self.named_levels();
        let start = named.iter().position(|n| n.level.same(from)).unwrap_or(0);
        let mut seen: Vec<Level> = Vec::new();
        let mut out = Vec::new();
        for n in named.into_iter().skip(start) {
            if seen.iter().any(|l| l.same(&n.level)) {
                continue;
            }
            out.extend(n.level.layer().extended_ops().iter().map(|op| (n.name.clone(), *op)));
            seen.push(n.level);
        }
        out
    }

    /// Fill in the layer names of an "unsupported operation" error from the bottom, and the
    /// addresses of the levels below a fan-out layer that handle it: a fan-out layer passes an
    /// extended operation to one branch at most, so `OP@NAME` must name the level.
    pub fn explain(&self, err: Error) -> Error {
        match err {
            Error::UnsupportedOp { op, .. } => Error::UnsupportedOp {
                handled_below: self.handled_below(&op),
                layers: self.levels.iter().map(|l| l.name().to_owned()).collect(),
                op,
            },
            other => other,
        }
    }

    /// An error if `op`, sent to the whole mount, is handled by no level of the stack's main line
    /// but by several levels below a fan-out layer: the fan-out layer would pick one of them (its
    /// first or reading branch) without saying so.
    pub fn ambiguous(&self, op: &str) -> Option<Error> {
        if self.levels.iter().any(|l| l.layer().extended_ops().iter().any(|o| o.name == op)) {
            return None;
        }
        let handled = self.handled_below(op);
        (handled.len() > 1).then(|| {
            Error::BadArgs(format!(
                "ambiguous operation '{op}': no layer of the stack ({}) handles it, and levels below a fan-out layer do, each for itself: {}; name one",
                self.levels.iter().map(|l| l.name()).collect::<Vec<_>>().join(", "),
                handled.join(", ")
            ))
        })
    }

    /// `OP@NAME` for each level below a fan-out layer that handles extended operation `op`.
    fn handled_below(&self, op: &str) -> Vec<String> {
        // A branch's top level is named twice (`mirror.1`, `mirror.1.fault`): the longer name
        // says which layer it is.
        let mut handled: Vec<NamedLevel> = Vec::new();
        for n in self.named_levels().into_iter().skip(self.levels.len()) {
            if !n.level.layer().extended_ops().iter().any(|o| o.name == op) {
                continue;
            }
            match handled.iter_mut().find(|h| h.level.same(&n.level)) {
                Some(h) => h.name = n.name,
                None => handled.push(n),
            }
        }
        handled.into_iter().map(|n| format!("{op}@{}", n.name)).collect()
    }

    /// Flush and stop every layer, top first, branches included.
    pub fn shutdown(&self) {
        for level in &self.levels {
            level.layer().shutdown();
        }
    }
}

fn layer_params(name: &str, spec: &LayerSpec) -> Params {
    Params::new(name, spec.params.iter().filter(|(k, _)| k != NAME_PARAM.name).cloned().collect())
}

/// Two branches may not share a directory or a server, nor hold one another: the fan-out layer
/// would see the same objects twice, or its own branches inside one.
pub fn check_branch_lowers(existing: &[Branch], new: &Branch) -> Result<()> {
    for other in existing {
        if other.lower == new.lower {
            return Err(Error::config(format!("branch '{}': {} is already branch '{}'", new.name, new.lower, other.name)));
        }
        let (Some(new_dir), Some(other_dir)) = (new.lower.dir(), other.lower.dir()) else { continue };
        let ((inner, inner_dir), (outer, outer_dir)) =
            if new_dir.starts_with(other_dir) { ((new, new_dir), (other, other_dir)) } else { ((other, other_dir), (new, new_dir)) };
        if inner_dir.starts_with(outer_dir) {
            return Err(Error::config(format!(
                "branch '{}': {} lies inside branch '{}' ({})",
                inner.name,
                inner_dir.display(),
                outer.name,
                outer_dir.display()
            )));
        }
    }
    Ok(())
}

fn check_name(what: &str, given: &str) -> Result<()> {
    let valid = !given.is_empty()
        && given.chars().all(|c| c.is_ascii_alphanumeric() || "-_.#".contains(c))
        && !given.starts_with('.');
    if valid {
        Ok(())
    } else {
        Err(Error::config(format!("{what}: bad name '{given}' (letters, digits, - _ . # only)")))
    }
}

/// Whether layers of `kind` fan out.
pub fn is_fan_out(registry: &[LayerFactory], kind: &str) -> bool {
    registry.iter().any(|f| f.kind == kind && matches!(f.build, Build::FanOut(_)))
}

/// Give the first fan-out layer of `specs` its directories: the branches its spec lists take,
/// in order, LOWER (`None` when the mount has none: LOWER `-`) and the `--branch` directories
/// that lack one; with no branch list, each of those directories is a branch of its own with no
/// layers. A branch that ends in one of
/// `bottoms` (a `remote` layer, which reaches a server) stands on that and takes no directory.
/// `cli` pairs a directory with the mode the command line gave it (`None`: not said).
pub fn assign_branch_dirs(
    specs: &mut [LayerSpec],
    registry: &[LayerFactory],
    bottoms: &[&str],
    lower: Option<PathBuf>,
    cli: Vec<(PathBuf, Option<BranchMode>)>,
) -> Result<()> {
    let Some(fan) = specs.iter_mut().find(|s| is_fan_out(registry, &s.kind)) else {
        if !cli.is_empty() {
            return Err(Error::config("--branch needs a fan-out layer (union or mirror) in the stack"));
        }
        return Ok(());
    };
    let mut given = lower.map(|dir| (dir, None)).into_iter().chain(cli);
    if fan.branches.is_empty() {
        fan.branches = given.map(|(dir, mode)| BranchSpec { name: None, dir: Some(dir), mode, layers: Vec::new() }).collect();
        return Ok(());
    }
    let kind = fan.kind.clone();
    for (i, branch) in fan.branches.iter_mut().enumerate() {
        let bottom = branch.bottom(bottoms).map_err(|e| Error::config(format!("layer '{kind}', branch {i}: {e}")))?;
        match (bottom, &branch.dir) {
            (Some(bottom), Some(dir)) => {
                return Err(Error::config(format!(
                    "layer '{kind}', branch {i}: a branch that ends in '{}' stands on its server and takes no directory (@{})",
                    bottom.kind,
                    dir.display()
                )))
            }
            (Some(_), None) | (None, Some(_)) => continue,
            (None, None) => {}
        }
        let Some((dir, mode)) = given.next() else {
            return Err(Error::config(format!(
                "layer '{kind}', branch {i}: no directory (give it as @DIR, or one more --branch)"
            )));
        };
        branch.dir = Some(dir);
        branch.mode = branch.mode.or(mode);
    }
    match given.next() {
        Some((dir, _)) => {
            let on_servers: String = bottoms.iter().map(|b| format!(", or end in '{b}',")).collect();
            Err(Error::config(format!(
                "{}: no branch of '{kind}' is left to take it (branches that name their own directory with @DIR{on_servers} take none)",
                dir.display()
            )))
        }
        None => Ok(()),
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
    match unknown_param(factory, spec) {
        Some(bad) => Err(bad.error),
        None => Ok(()),
    }
}

/// The first parameter of `spec` that its layer does not take.
fn unknown_param(factory: &LayerFactory, spec: &LayerSpec) -> Option<BadParam> {
    let (key, _) = spec.params.iter().find(|(key, _)| {
        key != NAME_PARAM.name && !factory.params.iter().any(|p| p.name == key || p.name == crate::spec::ANY_PARAM)
    })?;
    let mut known: Vec<_> = factory.params.iter().map(|p| p.name).collect();
    known.push(NAME_PARAM.name);
    let error = Error::config(format!("layer '{}': unknown parameter '{key}' (known: {})", spec.kind, known.join(", ")));
    Some(BadParam { layer: 0, key: key.clone(), error })
}

/// A parameter that its layer does not take, found by [`check_all_params`].
#[derive(Debug)]
pub struct BadParam {
    /// The layer's position, counting top first and depth first (branches' layers included).
    pub layer: usize,
    pub key: String,
    pub error: Error,
}

/// Check the kind and the parameter names of every layer of `specs`, branches included, before
/// anything is built, so that a configuration file's mistake can be traced to its line. Kinds
/// that `registry` does not have are refused (as the `type` key), except `bottoms`: the layers
/// that the assembly makes itself at the bottom of a stack (`remote`), which check their own.
pub fn check_all_params(specs: &[LayerSpec], registry: &[LayerFactory], bottoms: &[&str]) -> std::result::Result<(), BadParam> {
    fn walk(specs: &[LayerSpec], registry: &[LayerFactory], bottoms: &[&str], position: &mut usize) -> std::result::Result<(), BadParam> {
        for spec in specs {
            let layer = *position;
            *position += 1;
            match find_factory(registry, spec) {
                Ok(factory) => {
                    if let Some(bad) = unknown_param(factory, spec) {
                        return Err(BadParam { layer, ..bad });
                    }
                }
                Err(_) if bottoms.contains(&spec.kind.as_str()) => {}
                Err(error) => return Err(BadParam { layer, key: "type".into(), error }),
            }
            for branch in &spec.branches {
                walk(&branch.layers, registry, bottoms, position)?;
            }
        }
        Ok(())
    }
    walk(specs, registry, bottoms, &mut 0)
}

/// Instance names, top first: the `name=` parameter, else the kind, numbered from the top when
/// a kind repeats (`null`, `null#2`, ...).
fn instance_names(specs: &[LayerSpec]) -> Result<Vec<String>> {
    let mut names: Vec<String> = Vec::with_capacity(specs.len());
    for spec in specs {
        let name = match spec.params.iter().find(|(k, _)| k == NAME_PARAM.name) {
            Some((_, given)) => {
                check_name(&format!("layer '{}'", spec.kind), given)?;
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
