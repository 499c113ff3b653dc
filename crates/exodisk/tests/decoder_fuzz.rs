//! The service's request decoder against arbitrary, mutated and hostile input (#28): it answers
//! with an error, never a panic, never a stack overflow, and never allocates beyond the frame
//! it was given and [`proto::MAX_DECODED`] (a request of a few bytes can be a hundred in
//! memory, so lists are counted as they are decoded).
//!
//! Failing cases are saved in `tests/decoder_fuzz.proptest-regressions` (commit it).

use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

use plyfs_exodisk::proto::{self, IoReq, Message, Request, WCaps, WPersistence, WTarget};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use serde_bytes::ByteBuf;

/// Counts what the measuring thread allocates, and only that: the other tests of this binary
/// run beside it, in the same process.
struct Counting;

static NOW: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    static MEASURED: Cell<bool> = const { Cell::new(false) };
}

fn counted(by: isize) {
    if MEASURED.try_with(|m| m.get()).unwrap_or(false) {
        PEAK.fetch_max(NOW.fetch_add(by, Ordering::Relaxed) + by, Ordering::Relaxed);
    }
}

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            counted(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        if !p.is_null() {
            counted(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(p, layout) };
        counted(-(layout.size() as isize));
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Run `f` alone (one measurement at a time) on a thread with the stack of the service's
/// connection threads; what it returned and the most that thread allocated.
fn measured<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> (T, usize) {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    NOW.store(0, Ordering::Relaxed);
    PEAK.store(0, Ordering::Relaxed);
    let run = move || {
        MEASURED.with(|m| m.set(true));
        let out = f();
        MEASURED.with(|m| m.set(false));
        out
    };
    let out = std::thread::Builder::new().stack_size(2 << 20).spawn(run).unwrap().join().expect("the decoder panicked");
    (out, PEAK.load(Ordering::Relaxed).max(0) as usize)
}

/// What decoding `body` may allocate: a copy of it, the lists (twice: a growing list may hold
/// its old and new buffers at once), and a little more.
fn bound(body: usize) -> usize {
    2 * body + 2 * proto::MAX_DECODED + (256 << 10)
}

fn samples() -> Vec<Vec<u8>> {
    let caps = WCaps { read: [1, 2], write: [3, 4] };
    let node = WTarget::Exonode { at: 9, path: vec![1, 2, 3] };
    let reqs = vec![
        Request::Hello { version: proto::VERSION, shm: 1 << 20 },
        Request::Root { name: "exofs".into(), uid: Some(7), exclusive: true },
        Request::ExtentAllocate { at: 100, sectors: 8, caps, persistence: WPersistence::Data },
        Request::AddExonode {
            target: node.clone(),
            wcap: [5, 6],
            idx: None,
            child: 200,
            sectors: 4,
            caps,
            persistence: Some(WPersistence::Memory),
            data: vec![ByteBuf::from(vec![1, 2, 3]), ByteBuf::new()],
        },
        Request::AddData { target: WTarget::Proxy(3), wcap: [0, 0], idx: Some(1), data: ByteBuf::from(b"name".to_vec()) },
        Request::ProxyEntries { target: node.clone(), cap: [1, 1], entries: vec![0, 5, 9], caps },
        Request::Io {
            reqs: vec![IoReq { id: 1, target: WTarget::Extent(100), cap: [1, 2], write: true, sector: 101, count: 2, offset: 4096 }],
        },
        Request::Batch {
            reqs: vec![Request::Poll, Request::WriteRecord { target: node, wcap: [2, 2] }, Request::FreeMap { from: 0 }, Request::Shutdown],
        },
    ];
    reqs.into_iter().enumerate().map(|(id, req)| proto::frame_message(&Message::Req { id: id as u64, req }).unwrap()).collect()
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 2000,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/decoder_fuzz.proptest-regressions"))),
        ..ProptestConfig::default()
    }
}

/// A message of a batch of `n` `Poll` requests, 5 bytes each, written as MessagePack by hand.
fn batch_of_polls(n: u32) -> Vec<u8> {
    let mut b = vec![0x81, 0xa3, b'R', b'e', b'q', 0x92, 0x00, 0x81, 0xa5, b'B', b'a', b't', b'c', b'h', 0x91, 0xdd];
    b.extend_from_slice(&n.to_be_bytes());
    for _ in 0..n {
        b.extend_from_slice(&[0xa4, b'P', b'o', b'l', b'l']);
    }
    b
}

/// `depth` batches, each inside the one before.
fn nested_batches(depth: usize) -> Vec<u8> {
    let mut b = vec![0x81, 0xa3, b'R', b'e', b'q', 0x92, 0x00];
    for _ in 0..depth {
        b.extend_from_slice(&[0x81, 0xa5, b'B', b'a', b't', b'c', b'h', 0x91, 0x91]);
    }
    b.extend_from_slice(&[0xa4, b'P', b'o', b'l', b'l']);
    b
}

#[test]
fn the_samples_decode() {
    for s in samples() {
        proto::read_message(&mut &s[..]).expect("a sample decodes");
    }
    let small = proto::decode_message(&batch_of_polls(2)).unwrap();
    assert!(matches!(small, Message::Req { req: Request::Batch { reqs }, .. } if reqs.len() == 2));
}

#[test]
fn a_batch_of_millions_of_tiny_requests_is_refused_within_the_bound() {
    // 15 MiB of 5-byte requests: 3 million of them, over 300 MiB once decoded before #28.
    let body = batch_of_polls(3_000_000);
    assert!(body.len() < proto::MAX_FRAME);
    let len = body.len();
    let (result, peak) = measured(move || proto::decode_message(&body).map(|_| ()).map_err(|e| e.to_string()));
    assert!(result.unwrap_err().contains("decoded"), "refused for its size");
    assert!(peak < bound(0), "{peak} bytes allocated to decode a message of {len} bytes");
}

#[test]
fn deeply_nested_batches_are_refused_without_overflowing_the_stack() {
    for depth in [5, 100, 100_000] {
        let body = nested_batches(depth);
        let (result, _) = measured(move || proto::decode_message(&body).is_err());
        assert!(result, "batches nested {depth} deep decoded");
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_bytes_are_refused_cheaply(body in proptest::collection::vec(any::<u8>(), 0..1024)) {
        let len = body.len();
        let (_, peak) = measured(move || proto::decode_message(&body).is_ok());
        prop_assert!(peak < bound(len), "{} bytes allocated for {} bytes", peak, len);
    }

    #[test]
    fn mutated_requests_never_panic(which in 0usize..8, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
        let mut m = samples()[which].clone();
        for (at, v) in flips {
            let at = 4 + at % (m.len() - 4);
            m[at] = v;
        }
        let cut = 4 + cut % (m.len() - 3);
        let len = m.len();
        let (_, peak) = measured(move || {
            let _ = proto::decode_message(&m[4..]);
            let _ = proto::decode_message(&m[4..cut]);
        });
        prop_assert!(peak < bound(len), "{} bytes allocated for {} bytes", peak, len);
    }

    /// A first message is read within the hello's limit: whatever length it announces, nothing
    /// over the limit is allocated.
    #[test]
    fn hello_lengths_reserve_nothing(len in prop_oneof![0u32..(32 << 20), any::<u32>()], tail in proptest::collection::vec(any::<u8>(), 0..64)) {
        let mut input = len.to_le_bytes().to_vec();
        input.extend_from_slice(&tail);
        let (_, peak) = measured(move || proto::read_message_within(&mut &input[..], proto::MAX_HELLO).is_ok());
        prop_assert!(peak < bound(proto::MAX_HELLO), "{} bytes allocated for a hello announcing {}", peak, len);
        prop_assert!(peak < 64 << 10 || len as usize <= proto::MAX_HELLO);
    }
}
