//! The encoder pool serves writes that arrive on a thread pinned to one CPU, as an io_uring
//! queue's threads are. (A test binary of its own: the pool is made once per process, and no
//! other test may make it first from an unpinned thread.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use plyfs_sca::mem::MemLower;
use plyfs_sca::{Engine, ScaFile};

mod common;
use common::PoolProbe;

/// Pin the calling thread to CPU 0.
fn pin_to_first_cpu() {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET stays within it.
    let pinned = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(pinned, 0, "sched_setaffinity: {}", std::io::Error::last_os_error());
}

#[test]
fn a_write_on_a_thread_pinned_to_one_cpu_is_encoded_on_the_others_too() {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        return; // one CPU: no pool to use
    }
    let probe = Arc::new(PoolProbe { pool_chunks: AtomicUsize::new(0), panic_on: None });
    let engine = Arc::new(Engine::new("rle", probe.clone(), 12, false));
    let data: Vec<u8> = (0..64u32 << 12).map(|i| (i / 4096 + i % 7) as u8).collect();
    let lower = MemLower::default();
    let written = {
        let (engine, lower, data) = (engine.clone(), lower.clone(), data.clone());
        std::thread::spawn(move || {
            pin_to_first_cpu();
            ScaFile::created(engine, lower).write(0, &data)
        })
        .join()
        .expect("the writer does not panic")
    };
    assert_eq!(written.expect("the write succeeds"), data.len());
    assert!(probe.pool_chunks.load(Ordering::Relaxed) > 0, "no chunk was encoded on the encoder pool");
    let f = ScaFile::open(engine, lower).unwrap();
    assert_eq!(f.read(0, data.len()).ok(), Some(data));
}
