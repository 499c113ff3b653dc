//! The server's handshake against arbitrary, mutated and oversized input (#28): whatever comes
//! before the peer proved the key (the preamble, the frame lengths, the hello and its proof),
//! the server ends the connection cleanly (no panic, no welcome without the proof) and never
//! allocates more than a few KiB for it.
//!
//! Failing cases are saved in `tests/handshake_fuzz.proptest-regressions` (commit it): they
//! run first next time. For longer runs, `fuzz/` has a cargo-fuzz target of the same handshake.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use plyfs_stack::LowerDir;
use plyfs_transport::server::{Authenticator, Identity, Server, ServerOptions};
use plyfs_transport::wire::{self, Message};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

/// Counts the bytes allocated now and the most at once, so a case can see what it cost.
struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        if !p.is_null() {
            let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(p, layout) };
        NOW.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// What one handshake may allocate: the reader's buffer (64 KiB), a hello (4 KiB), the
/// connection's thread and the `welcome`, with room to spare. Before #28, a hello could make the
/// server reserve 12 MiB.
const HANDSHAKE_BYTES: usize = 512 << 10;

/// The proof the test's authenticator takes, and the one it answers with.
const PROOF: [u8; 32] = [0x5a; 32];

struct Key;

impl Authenticator for Key {
    fn check(&self, proof: Option<&[u8]>) -> Result<Option<Vec<u8>>, String> {
        match proof {
            Some(p) if p == PROOF => Ok(Some(vec![1; 32])),
            Some(_) => Err("wrong key".into()),
            None => Err("no key given".into()),
        }
    }
}

fn server() -> &'static Arc<Server> {
    static SERVER: OnceLock<(tempfile::TempDir, Arc<Server>)> = OnceLock::new();
    &SERVER
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let stack = plyfs_stack::Stack::build(&[], &[], Arc::new(LowerDir::open(dir.path()).unwrap())).unwrap();
            let options = ServerOptions { handshake_timeout: Duration::from_secs(2), ..Default::default() };
            (dir, Server::for_stack(&stack, options))
        })
        .1
}

/// What the server made of `input`.
#[derive(Debug, PartialEq)]
enum Outcome {
    Welcome,
    Refused,
    Closed,
}

/// Send `input` to a server's connection, then end it, and read what the server answered.
/// Returns the outcome and the most the server allocated meanwhile.
fn handshake(input: &[u8]) -> (Outcome, usize) {
    // One case at a time: the allocator's peak is the whole process's.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let (ours, theirs) = UnixStream::pair().unwrap();
    let server = server().clone();
    let base = NOW.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let serving = std::thread::spawn(move || server.serve(Box::new(theirs), "fuzz", Identity::AsSent, Some(&Key)));
    let mut ours_w = ours.try_clone().unwrap();
    // The server may close before it took everything: that is an answer too.
    let _ = ours_w.write_all(input);
    let _ = ours.shutdown(std::net::Shutdown::Write);
    ours.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = Vec::new();
    let _ = (&ours).read_to_end(&mut answer);
    serving.join().expect("the server's connection thread panicked");
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (outcome(&answer), peak)
}

fn outcome(answer: &[u8]) -> Outcome {
    let Some(rest) = answer.strip_prefix(&wire::PREAMBLE) else { return Outcome::Closed };
    match wire::read_frame(&mut &rest[..]).ok().and_then(|f| wire::decode(&f.header).ok()) {
        Some(Message::Welcome { .. }) => Outcome::Welcome,
        Some(Message::Refused { .. }) => Outcome::Refused,
        _ => Outcome::Closed,
    }
}

fn hello(versions: Vec<u32>, auth: Option<Vec<u8>>) -> Vec<u8> {
    let msg = Message::Hello { versions, software: "fuzz".into(), auth: auth.map(serde_bytes::ByteBuf::from) };
    let mut out = wire::PREAMBLE.to_vec();
    wire::write_frame(&mut out, &wire::encode(&msg), &[]).unwrap();
    out
}

/// Where the frame's lengths start in [`hello`]'s output.
const LENGTHS_AT: usize = 8;

/// A frame length: any, and often within the limits of an established connection.
fn length() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..(16 << 20), any::<u32>()]
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 400,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/handshake_fuzz.proptest-regressions"))),
        ..ProptestConfig::default()
    }
}

#[test]
fn the_honest_hello_is_welcome_and_costs_little() {
    let (outcome, peak) = handshake(&hello(vec![1], Some(PROOF.to_vec())));
    assert_eq!(outcome, Outcome::Welcome);
    assert!(peak < HANDSHAKE_BYTES, "{peak} bytes for a handshake");
    let (outcome, _) = handshake(&hello(vec![1], Some(vec![0; 32])));
    assert_eq!(outcome, Outcome::Refused);
}

proptest! {
    #![proptest_config(config())]

    /// Anything at all, with or without the preamble in front.
    #[test]
    fn arbitrary_bytes_are_refused_cheaply(preamble in any::<bool>(), bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let mut input = if preamble { wire::PREAMBLE.to_vec() } else { Vec::new() };
        input.extend_from_slice(&bytes);
        let (outcome, peak) = handshake(&input);
        prop_assert_ne!(outcome, Outcome::Welcome);
        prop_assert!(peak < HANDSHAKE_BYTES, "{} bytes allocated", peak);
    }

    /// Any lengths a first frame may announce, followed by a few bytes: nothing is reserved
    /// beyond a hello's limit.
    #[test]
    fn announced_lengths_reserve_nothing(header in length(), payload in length(), tail in proptest::collection::vec(any::<u8>(), 0..64)) {
        let mut input = wire::PREAMBLE.to_vec();
        input.extend_from_slice(&header.to_be_bytes());
        input.extend_from_slice(&payload.to_be_bytes());
        input.extend_from_slice(&tail);
        let (outcome, peak) = handshake(&input);
        prop_assert_ne!(outcome, Outcome::Welcome);
        prop_assert!(peak < HANDSHAKE_BYTES, "{} bytes allocated for a frame of {} + {}", peak, header, payload);
    }

    /// A valid hello with bytes changed, cut short, or with another proof: never welcome
    /// unless it still is the hello with the proof.
    #[test]
    fn mutated_hellos_are_welcome_only_with_the_proof(
        proof in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..80)),
        versions in proptest::collection::vec(any::<u32>(), 0..6),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        cut in any::<usize>(),
    ) {
        let honest = proof.as_deref() == Some(&PROOF[..]) && versions.contains(&1);
        let mut input = hello(versions, proof);
        for (at, v) in &flips {
            let at = at % input.len();
            input[at] = *v;
        }
        let whole = flips.is_empty() && cut % (input.len() + 1) == input.len();
        let cut = cut % (input.len() + 1);
        let input = &input[..cut.max(LENGTHS_AT)];
        let (outcome, peak) = handshake(input);
        prop_assert!(peak < HANDSHAKE_BYTES, "{} bytes allocated", peak);
        if outcome == Outcome::Welcome {
            // Flipped bytes may still decode to a hello with the proof; anything else is a bug.
            let frame = wire::read_frame(&mut &input[LENGTHS_AT..]).expect("a whole frame was welcome");
            let ok = matches!(wire::decode(&frame.header), Ok(Message::Hello { auth: Some(a), versions, .. }) if a[..] == PROOF && versions.contains(&1));
            prop_assert!(ok, "welcome for {:?}", input);
        } else {
            prop_assert!(!(honest && whole), "the honest hello was refused");
        }
    }
}
