//! Encoding chunks: the codec, with chunks it cannot shrink stored as they are; the zero chunk
//! encoded once; and the encoder pool that encodes the whole chunks of large writes on several
//! threads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, RwLock};
use plyfs_stack::{Error, Result};

use crate::chunks::{chunk_start, whole_chunks};
use crate::codec::Place;
use crate::Error as CodecError;

use super::{Engine, LowerIo, ScaFile};

/// Writes covering at least this much in whole chunks (`cp` writes 128 KiB at a time) may
/// encode them on several threads...
const PARALLEL_ENCODE_BYTES: u64 = 128 << 10;
/// ...when encoding them all on one would take at least this long. Handing chunks over (a copy
/// of them, a pool thread woken, the encodings gathered) costs tens of microseconds, which a
/// cipher's chunks (about 50 µs for 128 KiB) do not repay, and a compressor's (250 µs for
/// `lz4`, 550 µs for `zstd`) do.
const PARALLEL_ENCODE_TIME: std::time::Duration = std::time::Duration::from_micros(200);

/// Long-lived threads that encode chunks of large writes beside the thread that got the write,
/// so that what codecs keep per thread (compression contexts, nonce pools) is made once.
struct EncoderPool {
    jobs: Mutex<std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>>,
    threads: usize,
}

impl EncoderPool {
    fn run(&self, job: Box<dyn FnOnce() + Send>) {
        let _ = self.jobs.lock().send(job);
    }
}

/// Start the encoder pool if it is not running yet. [`Engine::new`] calls it, on the thread that
/// builds the layer: threads run on the CPUs their creator may use, and a transport thread
/// pinned to one CPU (an io_uring queue's) would leave the pool none but its own.
pub(super) fn start_encoder_pool() {
    encoder_pool();
}

/// The pool: one thread fewer than the CPUs this process may run on, at most three; none on a
/// single CPU.
fn encoder_pool() -> Option<&'static EncoderPool> {
    static POOL: std::sync::OnceLock<Option<EncoderPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(4) - 1;
        if threads == 0 {
            return None;
        }
        let (jobs, queue) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..threads {
            let queue = queue.clone();
            let spawned = std::thread::Builder::new().name(format!("sca-encode-{i}")).spawn(move || loop {
                let job = queue.lock().recv();
                let Ok(job) = job else { return };
                // A job that panics ends itself, not the thread (a batch reports its chunk failed).
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            });
            if spawned.is_err() {
                return None;
            }
        }
        Some(EncoderPool { jobs: Mutex::new(jobs), threads })
    })
    .as_ref()
}

pub(super) struct EncodedChunk {
    pub(super) payload: Vec<u8>,
    pub(super) raw: bool,
}

/// Chunks encoded ahead of the loop that stores them: `(chunk, encoding)`, in order.
pub(super) type Encoded = Vec<(u64, EncodedChunk)>;

/// A chunk of a batch, and its encoding or why the codec failed on it.
type Outcome = (u64, std::result::Result<EncodedChunk, CodecError>);

/// The whole chunks of one large write, shared between the thread that got the write and the
/// encoder pool. Each thread claims the next chunk nobody has claimed until none is left, so a
/// pool thread that starts late (its CPU busy with other work) takes fewer, and one that starts
/// after the last claim takes none: the write never waits for a thread that has not begun.
struct Batch {
    engine: Arc<Engine>,
    /// The place of the batch's chunks but for the chunk number.
    place: Place,
    first: u64,
    chunk_bytes: usize,
    /// The chunks' bytes, copied for the pool (the write's own buffer is only borrowed). The
    /// write empties it when every chunk is encoded, so that the jobs a busy pool thread has
    /// not reached yet hold no copy.
    data: RwLock<Vec<u8>>,
    count: u64,
    /// The next chunk to claim, counted from `first`.
    next: AtomicU64,
    /// What the pool encoded.
    helped: Mutex<Vec<Outcome>>,
    helper_done: Condvar,
}

impl Batch {
    fn claim(&self) -> Option<u64> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        (i < self.count).then_some(i)
    }

    /// A pool thread's part: encode chunks until none is left unclaimed. Whatever panics (the
    /// codec's own panics fail their chunk in [`Engine::encode_into`]) still fails its chunk,
    /// so the write hears about every chunk claimed.
    fn help(&self) {
        while let Some(i) = self.claim() {
            let c = self.first + i;
            let place = Place { chunk: c, ..self.place };
            let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let data = self.data.read();
                self.engine.encode(&place, &data[i as usize * self.chunk_bytes..(i as usize + 1) * self.chunk_bytes])
            }))
            .unwrap_or_else(|panic| Err(CodecError::encode(format!("encoding panicked: {}", panic_text(&*panic)))));
            self.helped.lock().push((c, encoded));
            self.helper_done.notify_one();
        }
    }

    /// The write's part once nothing is left to claim: `own`, the chunks it encoded itself,
    /// with those the pool claimed (waited for), in chunk order. The copy of the chunks is
    /// dropped: no thread needs it any more.
    fn gather(&self, mut own: Vec<Outcome>) -> Vec<Outcome> {
        let mut helped = self.helped.lock();
        while own.len() + helped.len() < self.count as usize {
            self.helper_done.wait(&mut helped);
        }
        own.append(&mut helped);
        drop(helped);
        *self.data.write() = Vec::new();
        own.sort_unstable_by_key(|(c, _)| *c);
        own
    }
}

impl<L: LowerIo> ScaFile<L> {
    /// The chunks that `data`, written at `off`, covers whole and that [`Self::write_chunks`]
    /// need not encode itself: `(chunk, encoding)`, in order. For a large write of a codec slow
    /// enough to pay for it (judged by the time its first chunk took), all of them, encoded
    /// on this thread and the encoder pool's at once; otherwise the first one only, or none.
    pub(super) fn encode_whole_chunks(&mut self, off: u64, data: &[u8]) -> Result<Encoded> {
        let (shift, cs) = (self.ix.chunk_shift, self.ix.chunk_bytes());
        let whole = whole_chunks(shift, off, off + data.len() as u64);
        let (first, last) = (whole.start, whole.end); // `last` exclusive
        let Some(pool) = encoder_pool() else { return Ok(Vec::new()) };
        if last <= first || (last - first) * cs < PARALLEL_ENCODE_BYTES {
            return Ok(Vec::new());
        }
        let place = self.place(first, 1);
        let bytes_of = |c: u64| (chunk_start(shift, c) - off) as usize..(chunk_start(shift, c + 1) - off) as usize;
        let started = std::time::Instant::now();
        let mut all = vec![(first, self.engine.encode(&place, &data[bytes_of(first)]).map_err(|e| self.encode_failed(first, e))?)];
        if started.elapsed() * ((last - first) as u32) < PARALLEL_ENCODE_TIME {
            return Ok(all);
        }
        let rest = first + 1..last;
        if rest.is_empty() {
            return Ok(all);
        }
        let batch = Arc::new(Batch {
            engine: self.engine.clone(),
            place,
            first: rest.start,
            chunk_bytes: cs as usize,
            data: RwLock::new(data[bytes_of(rest.start).start..bytes_of(rest.end - 1).end].to_vec()),
            count: rest.end - rest.start,
            next: AtomicU64::new(0),
            helped: Mutex::new(Vec::new()),
            helper_done: Condvar::new(),
        });
        for _ in 0..pool.threads {
            let batch = batch.clone();
            pool.run(Box::new(move || batch.help()));
        }
        let mut own = Vec::new();
        while let Some(i) = batch.claim() {
            let c = batch.first + i;
            own.push((c, self.engine.encode(&Place { chunk: c, ..place }, &data[bytes_of(c)])));
        }
        for (c, encoded) in batch.gather(own) {
            all.push((c, encoded.map_err(|e| self.encode_failed(c, e))?));
        }
        Ok(all)
    }

    /// The error for a chunk the codec could not encode: the file, the upper offset, the cause.
    pub(super) fn encode_failed(&self, chunk: u64, e: CodecError) -> Error {
        Error::Corrupt(format!("{}: the chunk at offset {}: {e}", self.lower.describe(), chunk_start(self.ix.chunk_shift, chunk)))
    }
}

/// What a panic said, if it said it in words.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    panic.downcast_ref::<&str>().copied().or_else(|| panic.downcast_ref::<String>().map(String::as_str)).unwrap_or("(no message)")
}

impl Engine {
    pub(super) fn encode(&self, place: &Place, chunk: &[u8]) -> std::result::Result<EncodedChunk, CodecError> {
        let mut payload = Vec::with_capacity(chunk.len() / 2 + 64);
        let raw = self.encode_into(place, chunk, &mut payload)?;
        Ok(EncodedChunk { payload, raw })
    }

    /// Append the encoding of `chunk` (for `place`) to `out`, or the chunk itself when the
    /// codec stores chunks it cannot shrink as they are; returns whether it did the latter
    /// (raw). On failure `out` is left as it was.
    pub(super) fn encode_into(&self, place: &Place, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<bool, CodecError> {
        if self.codec.store_raw_if_larger() && crate::codec::looks_incompressible(chunk) {
            out.extend_from_slice(chunk);
            return Ok(true);
        }
        let start = out.len();
        // A codec that panics fails its chunk, on whichever thread encodes it (a pool thread,
        // or the request's own, which must still answer).
        let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.codec.encode_at(place, chunk, out)))
            .unwrap_or_else(|panic| Err(CodecError::encode(format!("the {} codec panicked: {}", self.kind, panic_text(&*panic)))));
        if let Err(e) = encoded {
            out.truncate(start);
            return Err(e);
        }
        if self.codec.store_raw_if_larger() && out.len() - start >= chunk.len() {
            out.truncate(start);
            out.extend_from_slice(chunk);
            return Ok(true);
        }
        Ok(false)
    }

    /// A zero chunk encoded once, for runs of holes, for a deterministic codec whose output
    /// does not depend on its place.
    pub(super) fn zero_chunk(&self, chunk_shift: u8) -> std::result::Result<Arc<EncodedChunk>, CodecError> {
        if let Some(z) = self.zero_chunks.lock().get(&chunk_shift) {
            return Ok(z.clone());
        }
        let anywhere = Place { file_id: [0; 16], chunk: 0, count: 1 };
        let z = Arc::new(self.encode(&anywhere, &vec![0; 1 << chunk_shift])?);
        self.zero_chunks.lock().insert(chunk_shift, z.clone());
        Ok(z)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A codec that stores chunks as they are.
    struct Stored;

    impl crate::Codec for Stored {
        fn tag(&self) -> [u8; 4] {
            *b"test"
        }
        fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
            out.extend_from_slice(chunk);
            Ok(())
        }
        fn decode(&self, encoded: &[u8], _: usize, out: &mut Vec<u8>) -> std::result::Result<(), CodecError> {
            out.extend_from_slice(encoded);
            Ok(())
        }
    }

    fn batch(count: u64) -> Batch {
        Batch {
            engine: Arc::new(Engine::new("test", Arc::new(Stored), 12, false)),
            place: Place { file_id: [0; 16], chunk: 0, count: 1 },
            first: 10,
            chunk_bytes: 4,
            data: RwLock::new((0..count as u8 * 4).collect()),
            count,
            next: AtomicU64::new(0),
            helped: Mutex::new(Vec::new()),
            helper_done: Condvar::new(),
        }
    }

    /// The write and a helper split the chunks between them, every chunk exactly once, and the
    /// write gets them all back in order; the copy is dropped then, and a helper that comes
    /// later finds nothing to do.
    #[test]
    fn a_batch_gives_every_chunk_once_in_order_then_lets_go_of_its_copy() {
        let b = batch(6);
        let own: Vec<_> = [b.claim(), b.claim()].into_iter().flatten().map(|i| (b.first + i, Err(CodecError::encode("mine")))).collect();
        b.help();
        let all = b.gather(own);
        assert_eq!(all.iter().map(|(c, _)| *c).collect::<Vec<_>>(), (10..16).collect::<Vec<_>>());
        for (c, encoded) in &all[2..] {
            let start = (c - 10) as u8 * 4;
            assert_eq!(encoded.as_ref().map(|e| e.payload.clone()).ok(), Some((start..start + 4).collect()));
        }
        assert!(b.data.read().is_empty());
        b.help();
        assert!(b.helped.lock().is_empty());
    }
}
