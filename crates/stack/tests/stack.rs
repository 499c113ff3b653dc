//! The stack in-process, without FUSE: bypass, extended-operation routing, the passthrough
//! guard, and building stacks from specs.

use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use plyfs_stack::spec::{parse_stack_config, parse_stack_spec, ParamSpec};
use plyfs_stack::*;

/// A layer that overrides nothing, counting what crosses it.
struct Counting {
    name: String,
    lower: [Level; 1],
    seen: AtomicU64,
}

impl Layer for Counting {
    fn name(&self) -> &str {
        &self.name
    }
    fn kind(&self) -> &'static str {
        "counting"
    }
    fn lower(&self) -> &[Level] {
        &self.lower
    }
    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        self.seen.fetch_add(1, Ordering::Relaxed);
        bypass(self, cx, op)
    }
}

/// A layer that defines the extended operation `ping` and claims to transform data.
struct Pinger {
    lower: [Level; 1],
}

impl Layer for Pinger {
    fn name(&self) -> &str {
        "pinger"
    }
    fn kind(&self) -> &'static str {
        "pinger"
    }
    fn data_path(&self) -> DataPath {
        DataPath::Transforms
    }
    fn lower(&self) -> &[Level] {
        &self.lower
    }
    fn extended_ops(&self) -> &[ExtOpInfo] {
        &[ExtOpInfo { name: "ping", args: "[WORD]", help: "answers pong" }]
    }
    fn call(&self, cx: &Caller, op: &Op<'_>) -> Result<Reply> {
        match op {
            Op::Extended { name: "ping", node, args } => {
                Ok(Reply::Extended(serde_json::json!({ "pong": args, "node": node.0 })))
            }
            other => bypass(self, cx, other),
        }
    }
}

fn counting(name: &str, lower: Level) -> Arc<Counting> {
    Arc::new(Counting { name: name.into(), lower: [lower], seen: AtomicU64::new(0) })
}

fn cx() -> Caller {
    Caller::daemon()
}

#[test]
fn bypass_carries_every_operation_to_the_lower_directory() {
    let dir = tempfile::tempdir().unwrap();
    let bottom = LowerDir::level(dir.path()).unwrap();
    let inner = counting("inner", bottom);
    let outer = counting("outer", Level::new(inner.clone()));
    let top = Level::new(outer.clone());

    let (entry, opened) = top.create(&cx(), NodeId::ROOT, OsStr::new("f"), 0o644, libc::O_RDWR).unwrap();
    assert_eq!(top.write(&cx(), entry.node, opened.fh, 0, b"layered").unwrap(), 7);
    assert_eq!(top.read(&cx(), entry.node, opened.fh, 2, 100).unwrap(), b"yered");
    top.release(&cx(), entry.node, opened.fh).unwrap();
    assert_eq!(top.getattr(&cx(), entry.node).unwrap().size, 7);
    assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), b"layered");

    let names: Vec<_> = top.list_dir(&cx(), NodeId::ROOT).unwrap().into_iter().map(|e| e.name).collect();
    assert_eq!(names, vec!["f"]);
    // Every operation crossed both layers: create, write, read, release, getattr (5), then
    // opendir, two readdirs (entries, then the end), releasedir (4).
    assert_eq!(outer.seen.load(Ordering::Relaxed), 9);
    assert_eq!(inner.seen.load(Ordering::Relaxed), 9);
}

#[test]
fn node_ids_are_inode_numbers_shared_by_hard_links() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a"), b"x").unwrap();
    std::fs::hard_link(dir.path().join("a"), dir.path().join("b")).unwrap();
    let top = LowerDir::level(dir.path()).unwrap();
    let a = top.lookup(&cx(), NodeId::ROOT, OsStr::new("a")).unwrap();
    let b = top.lookup(&cx(), NodeId::ROOT, OsStr::new("b")).unwrap();
    assert_eq!(a.node, b.node);
    assert_eq!(a.attr.nlink, 2);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(a.node.0, std::fs::metadata(dir.path().join("a")).unwrap().ino());
    // Forgetting every lookup and looking up again gives the same id.
    top.forget(&cx(), a.node, 2);
    assert_eq!(top.lookup(&cx(), NodeId::ROOT, OsStr::new("a")).unwrap().node, a.node);
}

#[test]
fn extended_operations_pass_through_layers_that_do_not_know_them() {
    let dir = tempfile::tempdir().unwrap();
    let bottom = LowerDir::level(dir.path()).unwrap();
    let pinger = Level::new(Arc::new(Pinger { lower: [bottom] }));
    let top = Level::new(counting("unaware", Level::new(counting("also-unaware", pinger))));

    let reply = top.extended(&cx(), NodeId::ROOT, "ping", &["hello".into()]).unwrap();
    assert_eq!(reply["pong"][0], "hello");
    assert_eq!(reply["node"], 1);

    // The bottom layer's own operation is reachable through everything too.
    let info = top.extended(&cx(), NodeId::ROOT, "lower-info", &[]).unwrap();
    assert_eq!(info["lower_path"], dir.path().canonicalize().unwrap().to_str().unwrap());

    match top.extended(&cx(), NodeId::ROOT, "no-such-op", &[]) {
        Err(Error::UnsupportedOp { op, .. }) => assert_eq!(op, "no-such-op"),
        other => panic!("expected unsupported, got {other:?}"),
    }
}

#[test]
fn the_lower_file_is_not_handed_up_through_a_data_transforming_layer() {
    let dir = tempfile::tempdir().unwrap();
    let bottom = LowerDir::level(dir.path()).unwrap();
    let (_, opened) = bottom.create(&cx(), NodeId::ROOT, OsStr::new("plain"), 0o644, libc::O_RDWR).unwrap();
    assert!(opened.backing.is_some(), "the bottom offers its file for passthrough");

    let over_transforming = Level::new(counting("above", Level::new(Arc::new(Pinger { lower: [bottom.clone()] }))));
    let (_, opened) = over_transforming.create(&cx(), NodeId::ROOT, OsStr::new("x"), 0o644, libc::O_RDWR).unwrap();
    assert!(opened.backing.is_none(), "a transforming layer must hide the lower file");

    let over_bypass = Level::new(counting("only-bypass", bottom));
    let node = over_bypass.lookup(&cx(), NodeId::ROOT, OsStr::new("plain")).unwrap().node;
    assert!(over_bypass.open(&cx(), node, libc::O_RDONLY).unwrap().backing.is_some());
}

fn build_counting(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    if let Some(v) = args.params.get("fail") {
        return Err(args.params.bad("fail", v, "asked to fail"));
    }
    Ok(counting(&args.name, args.lower))
}

/// A layer that collapses with a `counting` layer above it; its instance name shows what it
/// was given.
fn build_absorbing(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    let shown = format!("{}[{}:{}]", args.name, args.params.get("collapse").unwrap_or("-"), args.params.get("fail").unwrap_or("-"));
    Ok(counting(&shown, args.lower))
}

const REGISTRY: &[LayerFactory] = &[
    LayerFactory {
        kind: "counting",
        summary: "counts operations",
        params: &[ParamSpec { name: "fail", help: "fail to build", default: None }],
        ext_ops: &[],
        build: plyfs_stack::Build::Linear(build_counting),
        absorbs: &[],
    },
    LayerFactory {
        kind: "absorbing",
        summary: "collapses with a counting layer above it",
        params: &[
            ParamSpec { name: "fail", help: "shown in the name", default: None },
            ParamSpec { name: "collapse", help: "the absorbed kind", default: None },
        ],
        ext_ops: &[],
        build: plyfs_stack::Build::Linear(build_absorbing),
        absorbs: &["counting"],
    },
];

#[test]
fn a_layer_directly_above_one_that_absorbs_it_collapses_into_it() {
    let dir = tempfile::tempdir().unwrap();
    let bottom = LowerDir::level(dir.path()).unwrap();
    let build = |spec: &str| Stack::build(&parse_stack_spec(spec).unwrap(), REGISTRY, bottom.layer().clone());
    let names = |s: &Stack| s.layers().iter().map(|l| l.name().to_owned()).collect::<Vec<_>>();
    // The pair becomes one layer, named as the lower one, with the upper's kind and parameters.
    assert_eq!(names(&build("counting:fail=no,absorbing").unwrap()), ["absorbing[counting:no]"]);
    // Not adjacent, or the other way round: no collapsing.
    assert_eq!(names(&build("absorbing,counting").unwrap()), ["absorbing[-:-]", "counting"]);
    assert_eq!(names(&build("counting,counting,absorbing").unwrap()), ["counting", "absorbing[counting:-]"]);
    // Disagreeing parameters are refused.
    let err = build("counting:fail=a,absorbing:fail=b").err().unwrap().to_string();
    assert!(err.contains("must agree on 'fail'"), "{err}");
}

#[test]
fn stacks_build_from_specs_with_unique_names() {
    let dir = tempfile::tempdir().unwrap();
    let bottom = LowerDir::level(dir.path()).unwrap();
    let specs = parse_stack_spec("counting, counting:name=mine ,counting").unwrap();
    let stack = Stack::build(&specs, REGISTRY, bottom.layer().clone()).unwrap();
    let names: Vec<_> = stack.levels().iter().map(|l| l.name().to_owned()).collect();
    assert_eq!(names, ["counting", "mine", "counting#2", "lower"]);
    assert_eq!(stack.position("mine"), Some(1));
    let err = stack.explain(stack.top().extended(&cx(), NodeId::ROOT, "nope", &[]).unwrap_err());
    assert_eq!(
        err.to_string(),
        "unsupported operation 'nope': no layer of the stack (counting, mine, counting#2, lower) handles it"
    );
}

#[test]
fn bad_specs_are_refused_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let bottom = LowerDir::level(dir.path()).unwrap().layer().clone();
    let build = |spec: &str| match parse_stack_spec(spec) {
        Ok(specs) => Stack::build(&specs, REGISTRY, bottom.clone()).map(|_| ()).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    assert_eq!(build("").unwrap_err(), "empty stack: name at least one layer, e.g. --stack null");
    assert_eq!(build("gzip").unwrap_err(), "unknown layer 'gzip' (available: counting, absorbing)");
    assert_eq!(build("counting,,counting").unwrap_err(), "stack spec: empty layer name in ''");
    assert_eq!(build("counting:level").unwrap_err(), "layer 'counting': parameter 'level' is not key=value");
    assert_eq!(build("counting:x=1").unwrap_err(), "layer 'counting': unknown parameter 'x' (known: fail, name)");
    assert_eq!(build("counting:fail=1:fail=2").unwrap_err(), "layer 'counting': parameter 'fail' given twice");
    assert_eq!(build("counting:fail=yes").unwrap_err(), "layer 'counting': bad value 'yes' for 'fail': asked to fail");
    assert_eq!(build("counting:name=a,counting:name=a").unwrap_err(), "two layers are named 'a': give one another name= ");
    assert_eq!(build("counting:name=.x").unwrap_err(), "layer 'counting': bad name '.x' (letters, digits, - _ . # only)");
    assert_eq!(build("coun ting").unwrap_err(), "stack spec: bad layer name 'coun ting'");
    assert!(build("counting , counting:name=b").is_ok());
}

#[test]
fn toml_configs_give_the_same_stacks() {
    let specs = parse_stack_config("[[layer]]\ntype = \"trace\"\nlog = \"t.jsonl\"\nio = true\n\n[[layer]]\ntype = \"null\"\n").unwrap();
    assert_eq!(specs, parse_stack_spec("trace:io=true:log=t.jsonl,null").unwrap());

    let err = |text: &str| parse_stack_config(text).unwrap_err().to_string();
    assert_eq!(err(""), "no [[layer]] tables: name at least one layer");
    assert!(err("[[layer]]\ntype = \"null\"\n[oops").starts_with("line 3: "), "{}", err("[[layer]]\n[oops"));
    assert!(err("[[layer]]\nlog = 1\n").contains("missing field `type`"));
    assert!(err("[[layer]]\ntype = \"trace\"\nlog = [1]\n").contains("must be a string, number or boolean"));
    assert!(err("stack = 1\n").contains("unknown field `stack`"));
}

#[test]
fn descriptors_name_the_operation_and_its_typed_arguments() {
    let op = Op::Write { node: NodeId(7), fh: FileHandle(3), offset: 4096, data: b"abc" };
    assert_eq!(op.name(), "write");
    assert_eq!(op.kind(), OpKind::Write);
    assert_eq!(
        op.args(),
        vec![("node", Arg::U64(7)), ("fh", Arg::U64(3)), ("offset", Arg::U64(4096)), ("data", Arg::Bytes(3))]
    );
    let args = ["a".to_owned()];
    let ext = Op::Extended { node: NodeId::ROOT, name: "verify", args: &args };
    assert_eq!(ext.name(), "verify");
    assert_eq!(ext.args()[2], ("args", Arg::Strs(&args)));
    // Every kind has a distinct name.
    let mut names: Vec<_> = OpKind::ALL.iter().map(|k| k.name()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), OpKind::ALL.len());
}

#[test]
fn tree_specs_parse_into_branches() {
    use plyfs_stack::spec::{BranchMode, BranchSpec};
    let specs = parse_stack_spec("trace:log=t, union[zstd:level=5,copy@/srv/a=ro | @/srv/b | mirror[lz4|] ]").unwrap();
    assert_eq!(specs.len(), 2);
    let u = &specs[1];
    assert_eq!((u.kind.as_str(), u.branches.len()), ("union", 3));
    assert_eq!(u.branches[0].layers, parse_stack_spec("zstd:level=5,copy").unwrap());
    assert_eq!(u.branches[0].dir.as_deref(), Some(std::path::Path::new("/srv/a")));
    assert_eq!(u.branches[0].mode, Some(BranchMode::ReadOnly));
    assert_eq!(u.branches[1], BranchSpec { name: None, dir: Some("/srv/b".into()), mode: None, layers: vec![] });
    let nested = &u.branches[2].layers[0];
    assert_eq!((nested.kind.as_str(), nested.branches.len()), ("mirror", 2));
    assert!(nested.branches[1].layers.is_empty());

    let err = |spec: &str| parse_stack_spec(spec).unwrap_err().to_string();
    assert_eq!(err("union[zstd"), "stack spec: '[' without ']' in 'union[zstd'");
    assert_eq!(err("union]"), "stack spec: ']' without '[' in 'union]'");
    assert_eq!(err("union[a]x"), "stack spec: nothing may follow the branches of 'union'");
    assert_eq!(err("union[@/a=rx]"), "layer 'union', branch 0: bad branch mode 'rx' (ro or rw)");
    assert_eq!(err("union[a@b@c]"), "layer 'union', branch 0: 'a@b@c' has more than one '@'");
}

#[test]
fn toml_trees_match_the_spec_syntax() {
    let text = r#"
[[layer]]
type = "trace"
log = "t"

[[layer]]
type = "union"

[[layer.branch]]
dir = "/srv/a"
mode = "ro"
[[layer.branch.layer]]
type = "zstd"
level = 5
[[layer.branch.layer]]
type = "copy"

[[layer.branch]]
dir = "/srv/b"
"#;
    assert_eq!(parse_stack_config(text).unwrap(), parse_stack_spec("trace:log=t,union[zstd:level=5,copy@/srv/a=ro|@/srv/b]").unwrap());
    let remote = text.replace("dir = \"/srv/b\"", "[[layer.branch.layer]]\ntype = \"remote\"\naddr = \"unix:/run/s.sock\"");
    assert_eq!(parse_stack_config(&remote).unwrap(), parse_stack_spec("trace:log=t,union[zstd:level=5,copy@/srv/a=ro|remote:addr=unix:/run/s.sock]").unwrap());
    let bad = text.replace("mode = \"ro\"", "mode = \"rx\"");
    assert_eq!(parse_stack_config(&bad).unwrap_err().to_string(), "layer 'union', branch 0: bad mode 'rx' (ro or rw)");
    let bad = text.replace("mode = \"ro\"", "color = \"ro\"");
    assert!(parse_stack_config(&bad).unwrap_err().to_string().contains("unknown field `color`"));
}

#[test]
fn branch_directories_come_from_lower_and_the_command_line() {
    use plyfs_stack::spec::BranchMode;
    static FANOUT_REGISTRY: &[LayerFactory] = &[LayerFactory {
        kind: "fan",
        summary: "",
        params: &[],
        ext_ops: &[],
        build: Build::FanOut(|_| Err(Error::config("not built here"))),
        absorbs: &[],
    }];
    let assign = |spec: &str, cli: Vec<(&str, Option<BranchMode>)>| {
        let mut specs = parse_stack_spec(spec).unwrap();
        let cli = cli.into_iter().map(|(d, m)| (std::path::PathBuf::from(d), m)).collect();
        assign_branch_dirs(&mut specs, FANOUT_REGISTRY, &["remote"], Some("/lower".into()), cli).map(|()| specs).map_err(|e| e.to_string())
    };
    let specs = assign("fan", vec![("/b", Some(BranchMode::ReadOnly)), ("/c", None)]).unwrap();
    let dirs: Vec<_> = specs[0].branches.iter().map(|b| (b.dir.clone().unwrap(), b.mode())).collect();
    assert_eq!(dirs, vec![("/lower".into(), BranchMode::ReadWrite), ("/b".into(), BranchMode::ReadOnly), ("/c".into(), BranchMode::ReadWrite)]);
    // Listed branches without a directory take them in order; a mode in the spec wins.
    let specs = assign("fan[zstd|@/x|@=ro]", vec![("/b", Some(BranchMode::ReadWrite))]).unwrap();
    let b = &specs[0].branches;
    assert_eq!((b[0].dir.as_deref(), b[1].dir.as_deref(), b[2].dir.as_deref()), (Some("/lower".as_ref()), Some("/x".as_ref()), Some("/b".as_ref())));
    assert_eq!(b[2].mode(), BranchMode::ReadOnly);
    assert_eq!(assign("fan[a|b|c]", vec![("/b", None)]).unwrap_err(), "layer 'fan', branch 2: no directory (give it as @DIR, or one more --branch)");
    assert!(assign("fan[@/x|@/y]", vec![]).unwrap_err().starts_with("/lower: no branch of 'fan' is left to take it"));
    // A branch that ends in a bottom layer stands on its server: it takes neither LOWER nor a
    // --branch directory, and one given with @DIR is refused.
    let specs = assign("fan[zstd,remote:addr=tcp:nas:7070:psk=/k@=ro|@=ro]", vec![]).unwrap();
    let b = &specs[0].branches;
    assert_eq!((b[0].dir.as_deref(), b[1].dir.as_deref()), (None, Some("/lower".as_ref())));
    assert_eq!(b[0].mode(), BranchMode::ReadOnly);
    let remote = b[0].bottom(&["remote"]).unwrap().unwrap();
    assert_eq!(remote.params, vec![("addr".into(), "tcp:nas:7070".into()), ("psk".into(), "/k".into())]);
    assert_eq!(b[1].bottom(&["remote"]).unwrap(), None);
    assert_eq!(
        assign("fan[@/x|remote:addr=unix:/s@/y]", vec![]).unwrap_err(),
        "layer 'fan', branch 1: a branch that ends in 'remote' stands on its server and takes no directory (@/y)"
    );
    assert_eq!(
        assign("fan[|remote:addr=unix:/s,zstd]", vec![]).unwrap_err(),
        "layer 'fan', branch 1: layer 'remote' is a bottom layer: it must come last in its stack"
    );
    assert_eq!(
        assign("fan[remote:addr=unix:/s]", vec![]).unwrap_err(),
        "/lower: no branch of 'fan' is left to take it (branches that name their own directory with @DIR, or end in 'remote', take none)"
    );
    assert_eq!(assign("null", vec![("/b", None)]).unwrap_err(), "--branch needs a fan-out layer (union or mirror) in the stack");
    // Without LOWER (`-`), every branch names where it stands, or takes a --branch directory.
    let unplaced = |spec: &str, cli: Vec<&str>| {
        let mut specs = parse_stack_spec(spec).unwrap();
        let cli = cli.into_iter().map(|d| (std::path::PathBuf::from(d), None)).collect();
        assign_branch_dirs(&mut specs, FANOUT_REGISTRY, &["remote"], None, cli).map(|()| specs).map_err(|e| e.to_string())
    };
    let specs = unplaced("fan[@/x|remote:addr=unix:/s|zstd]", vec!["/b"]).unwrap();
    let b = &specs[0].branches;
    assert_eq!((b[0].dir.as_deref(), b[1].dir.as_deref(), b[2].dir.as_deref()), (Some("/x".as_ref()), None, Some("/b".as_ref())));
    assert_eq!(unplaced("fan[@/x|zstd]", vec![]).unwrap_err(), "layer 'fan', branch 1: no directory (give it as @DIR, or one more --branch)");
}

#[test]
fn operations_are_readdressed_to_another_level() {
    let data = b"abc";
    let write = Op::Write { node: NodeId(7), fh: FileHandle(3), offset: 4096, data };
    match write.on_open(NodeId(70), FileHandle(30)) {
        Op::Write { node, fh, offset, data: d } => assert_eq!((node, fh, offset, d), (NodeId(70), FileHandle(30), 4096, &data[..])),
        other => panic!("{other:?}"),
    }
    // at() keeps a mandatory handle and drops an optional one.
    assert!(matches!(write.at(NodeId(70)), Op::Write { node: NodeId(70), fh: FileHandle(3), .. }));
    let getattr = Op::GetAttr { node: NodeId(7), fh: Some(FileHandle(3)) };
    assert!(matches!(getattr.at(NodeId(70)), Op::GetAttr { node: NodeId(70), fh: None }));
    assert!(matches!(getattr.on_open(NodeId(70), FileHandle(30)), Op::GetAttr { node: NodeId(70), fh: Some(FileHandle(30)) }));
    // Name operations move to another directory; rename keeps its second one.
    let name = OsStr::new("n");
    let rename = Op::Rename { parent: NodeId(7), name, new_parent: NodeId(8), new_name: name, flags: 1 };
    assert!(matches!(rename.at(NodeId(70)), Op::Rename { parent: NodeId(70), new_parent: NodeId(8), flags: 1, .. }));
    // Every kind keeps its kind and its other arguments.
    for op in [write, getattr, rename, Op::Lookup { parent: NodeId(7), name }, Op::StatFs { node: NodeId(7) }] {
        let moved = op.at(NodeId(70));
        assert_eq!(moved.kind(), op.kind());
        assert_eq!(moved.node(), NodeId(70));
        assert_eq!(moved.args()[1..].iter().filter(|(n, _)| *n != "fh").collect::<Vec<_>>(), op.args()[1..].iter().filter(|(n, _)| *n != "fh").collect::<Vec<_>>());
    }
}
