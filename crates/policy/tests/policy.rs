//! The policy layer in process, over a real lower directory: inheritance, precedence, the
//! recorded chain, re-encoding, and bad values. (Mount tests live with the CLI.)

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;

use plyfs_policy::{build_stack, PolicyLayer, Rules, CHAIN_XATTR, POLICY_XATTR};
use plyfs_stack::spec::parse_stack_spec;
use plyfs_stack::{Caller, Error, LowerDir, NodeId, Op, Reply, Stack, XattrReply};

const SCA_MAGIC: &[u8] = b"PLYSCA";

struct Fixture {
    _dir: tempfile::TempDir,
    lower: std::path::PathBuf,
    stack: Stack,
    policy: Arc<PolicyLayer>,
}

fn fixture(spec: &str, rules: &str) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let lower = dir.path().to_owned();
    let bottom = LowerDir::level(&lower).unwrap();
    let registry = plyfs_layers::registry();
    let rules = Rules::parse(rules, plyfs_policy::rule_checker(registry, &bottom)).unwrap();
    let (stack, policy) = build_stack(&parse_stack_spec(spec).unwrap(), Some(rules), registry, bottom).unwrap();
    Fixture { _dir: dir, lower, stack, policy }
}

fn cx() -> Caller {
    Caller::daemon()
}

impl Fixture {
    fn lookup_path(&self, path: &str) -> NodeId {
        let mut at = NodeId::ROOT;
        for c in path.split('/').filter(|c| !c.is_empty()) {
            at = self.stack.top().lookup(&cx(), at, OsStr::new(c)).unwrap_or_else(|e| panic!("{path}: {e}")).node;
        }
        at
    }

    fn mkdir(&self, parent: &str, name: &str) -> NodeId {
        let p = self.lookup_path(parent);
        self.stack.top().mkdir(&cx(), p, OsStr::new(name), 0o755).unwrap().node
    }

    fn write_file(&self, parent: &str, name: &str, data: &[u8]) -> NodeId {
        let top = self.stack.top();
        let p = self.lookup_path(parent);
        let (e, o) = top.create(&cx(), p, OsStr::new(name), 0o644, libc::O_RDWR | libc::O_EXCL).unwrap();
        let mut off = 0;
        while off < data.len() {
            off += top.write(&cx(), e.node, o.fh, off as u64, &data[off..]).unwrap() as usize;
        }
        top.release(&cx(), e.node, o.fh).unwrap();
        e.node
    }

    fn read_file(&self, path: &str) -> Vec<u8> {
        let top = self.stack.top();
        let n = self.lookup_path(path);
        let o = top.open(&cx(), n, libc::O_RDONLY).unwrap();
        let mut out = Vec::new();
        loop {
            let d = top.read(&cx(), n, o.fh, out.len() as u64, 1 << 20).unwrap();
            if d.is_empty() {
                break;
            }
            out.extend_from_slice(&d);
        }
        top.release(&cx(), n, o.fh).unwrap();
        out
    }

    fn set_policy(&self, path: &str, value: &str) -> Result<(), Error> {
        let n = self.lookup_path(path);
        let op = Op::SetXattr { node: n, name: OsStr::new(POLICY_XATTR), value: value.as_bytes(), flags: 0 };
        self.stack.top().call(&cx(), &op).map(|_| ())
    }

    fn lower_bytes(&self, path: &str) -> Vec<u8> {
        std::fs::read(self.lower.join(path)).unwrap()
    }

    fn recorded(&self, path: &str) -> Option<String> {
        xattr(&self.lower.join(path), CHAIN_XATTR)
    }

    fn explain(&self, path: &str) -> serde_json::Value {
        self.stack.top().extended(&cx(), self.lookup_path(path), "policy-explain", &[]).unwrap()
    }

    fn apply(&self, path: &str) -> serde_json::Value {
        self.stack.top().extended(&cx(), self.lookup_path(path), "policy-apply", &[]).unwrap()
    }
}

fn xattr(path: &Path, name: &str) -> Option<String> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 4096];
    let len = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (len >= 0).then(|| String::from_utf8_lossy(&buf[..len as usize]).into_owned())
}

fn text(n: usize) -> Vec<u8> {
    b"the quick brown fox jumps over the lazy dog; ".iter().copied().cycle().take(n).collect()
}

#[test]
fn directory_policies_are_inherited_overridden_and_opted_out() {
    let f = fixture("null", "");
    f.mkdir("", "logs");
    f.mkdir("logs", "a");
    f.mkdir("logs/a", "b");
    f.mkdir("logs/a", "raw");
    f.set_policy("logs", "zstd:level=3").unwrap();
    f.set_policy("logs/a/raw", "none").unwrap();
    f.mkdir("", "docs");
    f.set_policy("docs", "gzip:level=9").unwrap();
    let data = text(100_000);
    for path in ["", "logs", "logs/a", "logs/a/b", "logs/a/raw", "docs"] {
        f.write_file(path, "f.txt", &data);
    }
    let at = |p: &str| if p.is_empty() { "f.txt".to_owned() } else { format!("{p}/f.txt") };
    // (A plain file needs no record in a mount whose default is plain.)
    for (dir, chain) in [("", None), ("logs", Some("zstd:level=3")), ("logs/a", Some("zstd:level=3")), ("logs/a/b", Some("zstd:level=3")), ("logs/a/raw", None), ("docs", Some("gzip:level=9"))] {
        let path = at(dir);
        assert_eq!(f.recorded(&path).as_deref(), chain, "{path}: recorded chain");
        assert_eq!(f.read_file(&path), data, "{path}: content");
        let lower = f.lower_bytes(&path);
        match chain {
            None => assert_eq!(lower, data, "{path}: untouched files stay plain below"),
            Some(_) => {
                assert!(lower.starts_with(SCA_MAGIC), "{path}: encoded below");
                assert!(lower.len() < data.len() / 3, "{path}: compressed below ({} bytes)", lower.len());
            }
        }
        assert_eq!(f.stack.top().getattr(&cx(), f.lookup_path(&path)).unwrap().size, data.len() as u64, "{path}: decoded size");
    }
    let e = f.explain("logs/a/b/f.txt");
    assert_eq!(e["policy"], "zstd:level=3");
    assert!(e["source"].as_str().unwrap().contains("directory logs"), "{e}");
    assert_eq!(e["pending"], false);
    let e = f.explain("logs/a/raw/f.txt");
    assert!(e["source"].as_str().unwrap().contains("logs/a/raw"), "{e}");
    let e = f.explain("f.txt");
    assert_eq!(e["policy"], "none");
    assert!(e["source"].as_str().unwrap().contains("default"), "{e}");
    let e = f.explain("logs/a");
    assert_eq!(e["kind"], "directory");
    assert_eq!(e["new_files"], "zstd:level=3");
    f.stack.shutdown();
}

#[test]
fn rules_apply_below_attributes_and_first_match_wins() {
    let rules = r#"
        [[rule]]
        glob = "*.log"
        layers = "zstd"
        [[rule]]
        glob = "docs/**"
        layers = "gzip"
        [[rule]]
        extension = "mp4"
        layers = "none"
    "#;
    let f = fixture("lz4", rules);
    f.mkdir("", "docs");
    f.mkdir("", "attr");
    f.set_policy("attr", "copy").unwrap();
    let data = text(20_000);
    f.write_file("", "app.log", &data);
    f.write_file("docs", "app.log", &data);
    f.write_file("docs", "guide.txt", &data);
    f.write_file("", "movie.mp4", &data);
    f.write_file("", "other.txt", &data);
    f.write_file("attr", "app.log", &data);
    for (path, chain, source) in [
        ("app.log", "zstd", "rule 1"),
        ("docs/app.log", "zstd", "rule 1"),
        ("docs/guide.txt", "gzip", "rule 2"),
        ("movie.mp4", "none", "rule 3"),
        ("other.txt", "lz4", "default"),
        ("attr/app.log", "copy", "directory attr"),
    ] {
        assert_eq!(f.recorded(path).as_deref(), Some(chain), "{path}");
        assert_eq!(f.read_file(path), data, "{path}");
        let e = f.explain(path);
        assert_eq!(e["policy"], chain, "{path}: {e}");
        assert!(e["source"].as_str().unwrap().contains(source), "{path}: {e}");
    }
    assert_eq!(f.lower_bytes("movie.mp4"), data, "a 'none' rule leaves the file plain even under a default chain");
    f.stack.shutdown();
}

#[test]
fn apply_reencodes_atomically_and_byte_identically() {
    let f = fixture("null", "");
    f.mkdir("", "d");
    let small = text(1000);
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8 & 0x3f).collect();
    f.write_file("d", "small", &small);
    f.write_file("d", "big", &big);
    f.write_file("d", "empty", b"");
    assert_eq!(f.recorded("d/big"), None);
    // A new directory policy changes nothing by itself: files keep their chain until applied.
    f.set_policy("d", "gzip:level=1").unwrap();
    assert_eq!(f.explain("d/big")["pending"], true);
    assert_eq!(f.read_file("d/big"), big);
    for (name, data) in [("small", &small), ("big", &big)] {
        let path = format!("d/{name}");
        let r = f.apply(&path);
        assert_eq!(r["changed"], true, "{path}: {r}");
        assert_eq!(f.recorded(&path).as_deref(), Some("gzip:level=1"));
        assert!(f.lower_bytes(&path).starts_with(SCA_MAGIC));
        assert_eq!(&f.read_file(&path), data, "{path}: byte-identical after re-encoding");
        assert_eq!(f.apply(&path)["changed"], false, "{path}: a second apply has nothing to do");
    }
    // The file's own attribute beats the directory's; back to plain.
    f.set_policy("d/big", "none").unwrap();
    assert_eq!(f.apply("d/big")["to"], "none");
    assert_eq!(f.lower_bytes("d/big"), big);
    // An empty file waits for `apply` like the others when its directory's policy changes, but
    // switches at once when it gets an attribute of its own (there is nothing to convert).
    assert_eq!(f.explain("d/empty")["pending"], true);
    f.set_policy("d/empty", "lz4").unwrap();
    assert_eq!(f.explain("d/empty")["pending"], false, "{}", f.explain("d/empty"));
    assert_eq!(f.recorded("d/empty").as_deref(), Some("lz4"));
    // No leftovers beside the files.
    let names: Vec<_> = std::fs::read_dir(f.lower.join("d")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    f.stack.shutdown();
}

#[test]
fn open_files_and_hard_links_are_not_reencoded() {
    let f = fixture("null", "");
    f.write_file("", "a", &text(100));
    f.set_policy("a", "zstd").unwrap();
    let n = f.lookup_path("a");
    let o = f.stack.top().open(&cx(), n, libc::O_RDONLY).unwrap();
    let err = f.stack.top().extended(&cx(), n, "policy-apply", &[]).unwrap_err().to_string();
    assert!(err.contains("open"), "{err}");
    f.stack.top().release(&cx(), n, o.fh).unwrap();
    std::fs::hard_link(f.lower.join("a"), f.lower.join("b")).unwrap();
    let err = f.stack.top().extended(&cx(), f.lookup_path("a"), "policy-apply", &[]).unwrap_err().to_string();
    assert!(err.contains("hard links"), "{err}");
    assert_eq!(f.lower_bytes("a"), text(100), "left as it was");
    f.stack.shutdown();
}

#[test]
fn bad_values_are_refused_and_change_nothing() {
    let f = fixture("null", "");
    f.mkdir("", "d");
    f.set_policy("d", "zstd").unwrap();
    for bad in ["nosuchlayer", "zstd:level=99", "zstd:colour=red", "trace", "", "zstd:level"] {
        let e = f.set_policy("d", bad).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{bad}: {e}");
    }
    assert_eq!(xattr(&f.lower.join("d"), POLICY_XATTR).as_deref(), Some("zstd"), "the old value stays");
    // The layer's own attributes can be neither seen nor set.
    let d = f.lookup_path("d");
    f.write_file("d", "x", b"hello");
    let x = f.lookup_path("d/x");
    let list = match f.stack.top().call(&cx(), &Op::ListXattr { node: x, size: 4096 }).unwrap() {
        Reply::Xattr(XattrReply::Data(d)) => d,
        other => panic!("{other:?}"),
    };
    assert!(!String::from_utf8_lossy(&list).contains("plyfs.chain"), "hidden: {:?}", String::from_utf8_lossy(&list));
    let set = Op::SetXattr { node: x, name: OsStr::new(CHAIN_XATTR), value: b"none", flags: 0 };
    assert_eq!(f.stack.top().call(&cx(), &set).unwrap_err().errno(), libc::EPERM);
    let _ = d;
    f.stack.shutdown();
}

#[test]
fn a_recorded_chain_this_build_lacks_is_a_clear_error() {
    let f = fixture("null", "");
    f.write_file("", "f", b"payload");
    let c = std::ffi::CString::new(f.lower.join("f").as_os_str().as_encoded_bytes()).unwrap();
    let v = b"rot13:rounds=2";
    assert_eq!(unsafe { libc::setxattr(c.as_ptr(), c"user.plyfs.chain".as_ptr(), v.as_ptr().cast(), v.len(), 0) }, 0);
    // As if a plyfs of another build had recorded it: the root says the tree has records.
    let root = std::ffi::CString::new(f.lower.as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(unsafe { libc::setxattr(root.as_ptr(), c"user.plyfs.records".as_ptr(), b"1".as_ptr().cast(), 1, 0) }, 0);
    // A fresh stack (the old one cached the chain).
    let bottom = LowerDir::level(&f.lower).unwrap();
    let (stack, _) = build_stack(&parse_stack_spec("null").unwrap(), None, plyfs_layers::registry(), bottom).unwrap();
    let n = stack.top().lookup(&cx(), NodeId::ROOT, OsStr::new("f")).unwrap().node;
    let err = stack.top().open(&cx(), n, libc::O_RDONLY).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    assert!(err.to_string().contains("rot13") && err.to_string().contains("cannot read"), "{err}");
    stack.shutdown();
}

#[test]
fn rename_across_policies_keeps_the_recorded_chain() {
    let f = fixture("null", "");
    f.mkdir("", "z");
    f.mkdir("", "g");
    f.set_policy("z", "zstd").unwrap();
    f.set_policy("g", "gzip").unwrap();
    let data = text(50_000);
    f.write_file("z", "f", &data);
    let op = Op::Rename { parent: f.lookup_path("z"), name: OsStr::new("f"), new_parent: f.lookup_path("g"), new_name: OsStr::new("f"), flags: 0 };
    f.stack.top().call(&cx(), &op).unwrap();
    assert_eq!(f.read_file("g/f"), data);
    assert_eq!(f.recorded("g/f").as_deref(), Some("zstd"), "rename does not re-encode");
    assert_eq!(f.explain("g/f")["pending"], true);
    assert_eq!(f.apply("g/f")["to"], "gzip");
    assert_eq!(f.read_file("g/f"), data);
    // Moving a directory changes what its new files inherit.
    f.mkdir("z", "sub");
    let op = Op::Rename { parent: f.lookup_path("z"), name: OsStr::new("sub"), new_parent: f.lookup_path("g"), new_name: OsStr::new("sub"), flags: 0 };
    f.stack.top().call(&cx(), &op).unwrap();
    f.write_file("g/sub", "new", &data);
    assert_eq!(f.recorded("g/sub/new").as_deref(), Some("gzip"));
    f.stack.shutdown();
}

#[test]
fn a_default_chain_mount_records_and_reads_like_before() {
    let f = fixture("zstd", "");
    let data = text(30_000);
    f.write_file("", "f", &data);
    assert_eq!(f.recorded("f").as_deref(), Some("zstd"));
    assert!(f.lower_bytes("f").starts_with(SCA_MAGIC));
    assert_eq!(f.read_file("f"), data);
    // Levels keep their names: the default chain's layer is listed under the policy layer.
    let names: Vec<&str> = f.stack.layers().iter().map(|l| l.name()).collect();
    assert_eq!(names, ["policy", "zstd"]);
    assert_eq!(f.stack.shared_levels().len(), 1);
    let _ = &f.policy;
    f.stack.shutdown();
}

#[test]
fn the_root_says_whether_any_file_has_a_record() {
    let f = fixture("null", "");
    f.write_file("", "plain", &text(5000));
    assert_eq!(xattr(&f.lower, "user.plyfs.records"), None, "plain files only: no record, no marker");
    f.mkdir("", "z");
    f.set_policy("z", "zstd").unwrap();
    f.write_file("z", "packed", &text(5000));
    assert_eq!(xattr(&f.lower, "user.plyfs.records").as_deref(), Some("1"), "marked before the first record");
    // Hidden from the mount like the records themselves.
    let list = match f.stack.top().call(&cx(), &Op::ListXattr { node: NodeId::ROOT, size: 4096 }).unwrap() {
        Reply::Xattr(XattrReply::Data(d)) => d,
        other => panic!("{other:?}"),
    };
    assert!(!String::from_utf8_lossy(&list).contains("plyfs.records"));
    // A fresh stack over the tree reads the record.
    f.stack.shutdown();
    let bottom = LowerDir::level(&f.lower).unwrap();
    let (stack, _) = build_stack(&parse_stack_spec("null").unwrap(), None, plyfs_layers::registry(), bottom).unwrap();
    let z = stack.top().lookup(&cx(), NodeId::ROOT, OsStr::new("z")).unwrap().node;
    let p = stack.top().lookup(&cx(), z, OsStr::new("packed")).unwrap();
    assert_eq!(p.attr.size, 5000, "the decoded size, through the recorded chain");
    stack.shutdown();
}

/// An empty file reports the same attributes whichever request asks for them: its chain's block
/// size (the chunk), not the lower file's, in the reply to its creation, to a lookup and to a
/// getattr. (pjdfstest's rename::preserve_metadata compared a link's reply with the created
/// file's over GlusterFS, whose block size is 128 KiB.)
#[test]
fn an_empty_file_has_one_block_size_for_every_request() {
    let f = fixture("zstd:chunk=64k", "");
    f.mkdir("", "gz");
    f.set_policy("gz", "gzip:chunk=16k").unwrap();
    for (dir, chunk) in [("", 64 << 10), ("gz", 16 << 10)] {
        let top = f.stack.top();
        let p = f.lookup_path(dir);
        let (e, o) = top.create(&cx(), p, OsStr::new("empty"), 0o644, libc::O_RDWR | libc::O_EXCL).unwrap();
        top.release(&cx(), e.node, o.fh).unwrap();
        let looked_up = top.lookup(&cx(), p, OsStr::new("empty")).unwrap();
        let got = top.getattr(&cx(), e.node).unwrap();
        let op = Op::Link { node: e.node, new_parent: p, new_name: OsStr::new("link") };
        let Ok(Reply::Entry(link)) = top.call(&cx(), &op) else { panic!("{dir}: link") };
        assert_eq!(
            [e.attr.blksize, looked_up.attr.blksize, got.blksize, link.attr.blksize],
            [chunk; 4],
            "{dir}/empty: block size in the replies to create, lookup, getattr and link"
        );
    }
}
