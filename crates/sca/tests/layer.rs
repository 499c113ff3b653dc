//! The size-changing layer in an in-process stack: parameters, the fast-tails refusal, and
//! decoded sizes through the operation interface.

use std::sync::Arc;

use plyfs_sca::{build_sca_layer, Codec, CHUNK_PARAM, EXT_OPS, FAST_TAILS_PARAM};
use plyfs_stack::spec::parse_stack_spec;
use plyfs_stack::{BuildArgs, Caller, Layer, LayerFactory, LowerDir, NodeId, Result, Stack};

/// A stand-in for a cipher: must never leave plaintext in the lower file.
struct Sealed;

impl Codec for Sealed {
    fn tag(&self) -> [u8; 4] {
        *b"seal"
    }
    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), plyfs_sca::Error> {
        out.extend(chunk.iter().map(|b| b ^ 0x5a));
        out.push(0);
        Ok(())
    }
    fn decode(&self, encoded: &[u8], _len: usize, out: &mut Vec<u8>) -> std::result::Result<(), plyfs_sca::Error> {
        let (body, trailer) = encoded.split_at(encoded.len().saturating_sub(1));
        if trailer != [0] {
            return Err(plyfs_sca::Error::decode("no trailer"));
        }
        out.extend(body.iter().map(|b| b ^ 0x5a));
        Ok(())
    }
    fn plaintext_safe(&self) -> bool {
        false
    }
}

fn build(args: BuildArgs) -> Result<Arc<dyn Layer>> {
    build_sca_layer(args, "sealed", Arc::new(Sealed))
}

const REGISTRY: [LayerFactory; 1] =
    [LayerFactory { kind: "sealed", summary: "test", params: &[CHUNK_PARAM, FAST_TAILS_PARAM], ext_ops: EXT_OPS, build: plyfs_stack::Build::Linear(build), absorbs: &[] }];

fn stack(spec: &str, lower: &std::path::Path) -> Result<Stack> {
    let bottom = LowerDir::level(lower)?;
    Stack::build(&parse_stack_spec(spec)?, &REGISTRY, bottom.layer().clone())
}

#[test]
fn fast_tails_are_refused_where_plaintext_is_unsafe() {
    let dir = tempfile::tempdir().unwrap();
    let err = stack("sealed:fast_tails=on", dir.path()).err().expect("must be refused").to_string();
    assert!(err.contains("fast_tails=on is refused"), "{err}");
    assert!(stack("sealed:fast_tails=off", dir.path()).is_ok());
}

#[test]
fn chunk_sizes_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    for good in ["4k", "64k", "1m", "65536", "1M"] {
        assert!(stack(&format!("sealed:chunk={good}"), dir.path()).is_ok(), "{good}");
    }
    for bad in ["3k", "2k", "2m", "abc", "0", "4096k"] {
        let err = stack(&format!("sealed:chunk={bad}"), dir.path()).err().expect(bad).to_string();
        assert!(err.contains("bad value") && err.contains("chunk"), "{bad}: {err}");
    }
}

#[test]
fn in_process_files_show_decoded_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let s = stack("sealed:chunk=64k", dir.path()).unwrap();
    let top = s.top();
    let cx = Caller::daemon();
    let (entry, opened) = top.create(&cx, NodeId::ROOT, "f".as_ref(), 0o644, libc::O_RDWR).unwrap();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(top.write(&cx, entry.node, opened.fh, 0, &data).unwrap() as usize, data.len());
    assert_eq!(top.getattr(&cx, entry.node).unwrap().size, data.len() as u64);
    assert_eq!(top.read(&cx, entry.node, opened.fh, 70_000, 1000).unwrap(), &data[70_000..71_000]);
    top.release(&cx, entry.node, opened.fh).unwrap();
    let lower = std::fs::read(dir.path().join("f")).unwrap();
    assert!(!lower.windows(64).any(|w| data.windows(64).next() == Some(w)), "plaintext leaked into the lower file");
    let stats = top.extended(&cx, entry.node, "sca-stats", &[]).unwrap();
    assert_eq!(stats["decoded_size"], data.len() as u64);
    assert_eq!(stats["chunk_bytes"], 65536);
    s.shutdown();
}

/// A handle is the layer's, not the lower directory's: getattr with one answers for the file
/// it was opened on, not for whichever lower file holds that number below.
#[test]
fn getattr_with_a_handle_answers_for_that_file() {
    use plyfs_stack::{Op, Reply};
    let dir = tempfile::tempdir().unwrap();
    let s = stack("sealed", dir.path()).unwrap();
    let top = s.top();
    let cx = Caller::daemon();
    // Two handles on `a` share one lower handle, so the upper and lower numbers part ways:
    // `a` is upper 1 and 2 over lower 1, `b` upper 3 over lower 2.
    let (a, a1) = top.create(&cx, NodeId::ROOT, "a".as_ref(), 0o600, libc::O_RDWR).unwrap();
    top.write(&cx, a.node, a1.fh, 0, &[7; 1000]).unwrap();
    let a2 = top.open(&cx, a.node, libc::O_RDONLY).unwrap();
    let (b, b1) = top.create(&cx, NodeId::ROOT, "b".as_ref(), 0o640, libc::O_RDWR).unwrap();
    top.write(&cx, b.node, b1.fh, 0, &[9; 5000]).unwrap();
    for (node, fh, mode, size) in [(a.node, a1.fh, 0o600, 1000), (a.node, a2.fh, 0o600, 1000), (b.node, b1.fh, 0o640, 5000)] {
        let attr = match top.call(&cx, &Op::GetAttr { node, fh: Some(fh) }).unwrap() {
            Reply::Attr(attr) => attr,
            other => panic!("getattr answered {other:?}"),
        };
        assert_eq!((attr.perm & 0o7777, attr.size), (mode, size), "inode {} with handle {}", node.0, fh.0);
    }
    for (node, fh) in [(a.node, a1.fh), (a.node, a2.fh), (b.node, b1.fh)] {
        top.release(&cx, node, fh).unwrap();
    }
    s.shutdown();
}
