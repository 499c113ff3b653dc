//! What one layer boundary costs, measured in-process (no FUSE, no kernel round trip): the same
//! operations through stacks of 1 and 8 `null` layers over the same lower directory.
//!
//! `cargo run --release -p plyfs-layers --example layer_cost [-- ROUNDS]`
//!
//! Prints nanoseconds per operation for each depth and the added cost per layer, relative to
//! the one-layer stack and to a FUSE round trip as measured by `bench/bench core`.

use std::ffi::OsStr;
use std::time::Instant;

use plyfs_stack::spec::parse_stack_spec;
use plyfs_stack::{Caller, LowerDir, NodeId, Op, Reply, Stack};

fn stack(depth: usize, lower: &std::path::Path) -> Stack {
    let spec = vec!["null"; depth].join(",");
    let specs = parse_stack_spec(&spec).unwrap();
    Stack::build(&specs, plyfs_layers::registry(), LowerDir::level(lower).unwrap().layer().clone()).unwrap()
}

/// Nanoseconds per round of: lookup + getattr + read 4 KiB (page-cached) + forget.
fn measure(stack: &Stack, rounds: u32) -> f64 {
    let cx = Caller::daemon();
    let top = stack.top();
    let file = top.lookup(&cx, NodeId::ROOT, OsStr::new("f")).unwrap();
    let opened = top.open(&cx, file.node, libc::O_RDONLY).unwrap();
    let start = Instant::now();
    for _ in 0..rounds {
        let e = top.lookup(&cx, NodeId::ROOT, OsStr::new("f")).unwrap();
        std::hint::black_box(top.getattr(&cx, e.node).unwrap());
        match top.call(&cx, &Op::Read { node: e.node, fh: opened.fh, offset: 0, size: 4096 }).unwrap() {
            Reply::Data(d) => assert_eq!(d.len(), 4096),
            other => panic!("{other:?}"),
        }
        top.forget(&cx, e.node, 1);
    }
    start.elapsed().as_nanos() as f64 / rounds as f64 / 4.0
}

fn main() {
    let rounds: u32 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), vec![1u8; 1 << 16]).unwrap();
    let (one, eight) = (stack(1, dir.path()), stack(8, dir.path()));
    // Warm up, then alternate to spread noise evenly; keep the best of five.
    measure(&one, rounds / 10);
    measure(&eight, rounds / 10);
    let (mut best1, mut best8) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        best1 = best1.min(measure(&one, rounds));
        best8 = best8.min(measure(&eight, rounds));
    }
    let per_layer_ns = (best8 - best1) / 7.0;
    println!("ns per operation (lookup, getattr, read 4 KiB, forget; best of 5 x {rounds} rounds):");
    println!("  1 null layer : {best1:8.1} ns");
    println!("  8 null layers: {best8:8.1} ns");
    println!("  per layer    : {per_layer_ns:8.2} ns = {:.3}% of the in-process operation", per_layer_ns / best1 * 100.0);
    println!("layer_cost_per_layer_ns={per_layer_ns:.3} layer_cost_one_ns={best1:.1}");
}
