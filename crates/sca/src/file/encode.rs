//! Encoding chunks: the codec, with chunks it cannot shrink stored as they are; the zero chunk
//! encoded once; and the encoder pool that encodes the whole chunks of large writes on several
//! threads.

use std::sync::Arc;

use parking_lot::Mutex;
use plyfs_stack::{Error, Result};

use crate::chunks::{chunk_start, whole_chunks};
use crate::codec::Place;
use crate::Error as CodecError;

use super::{Engine, LowerIo, ScaFile};

/// Writes covering at least this much in whole chunks may encode them on several threads...
const PARALLEL_ENCODE_BYTES: u64 = 256 << 10;
/// ...when encoding them all on one would take at least this long. A cipher's chunks encode
/// too fast for it: handing half of them over costs more than it saves.
const PARALLEL_ENCODE_TIME: std::time::Duration = std::time::Duration::from_millis(1);

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
                // A panicking codec loses its group (the write fails), not the thread.
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

/// What an encoder thread sends back for its group: the encodings, or the chunk the codec
/// failed on and why.
type GroupResult = std::result::Result<Encoded, (u64, CodecError)>;

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
        // Contiguous groups: the first for this thread, one for each pool thread.
        let rest = first + 1..last;
        if rest.is_empty() {
            return Ok(all);
        }
        let groups = pool.threads + 1;
        let per = (rest.end - rest.start).div_ceil(groups as u64);
        let ranges: Vec<std::ops::Range<u64>> =
            rest.clone().step_by(per as usize).map(|start| start..(start + per).min(rest.end)).collect();
        let (done, results) = std::sync::mpsc::channel();
        for (i, range) in ranges.iter().enumerate().skip(1) {
            let (engine, done, range) = (self.engine.clone(), done.clone(), range.clone());
            let copy = data[bytes_of(range.start).start..bytes_of(range.end - 1).end].to_vec();
            pool.run(Box::new(move || {
                let encoded: GroupResult = range
                    .clone()
                    .zip(copy.chunks(cs as usize))
                    .map(|(c, chunk)| Ok((c, engine.encode(&Place { chunk: c, ..place }, chunk).map_err(|e| (c, e))?)))
                    .collect();
                let _ = done.send((i, encoded));
            }));
        }
        drop(done);
        for c in ranges[0].clone() {
            all.push((c, self.engine.encode(&Place { chunk: c, ..place }, &data[bytes_of(c)]).map_err(|e| self.encode_failed(c, e))?));
        }
        let mut theirs: Vec<(usize, GroupResult)> = results.iter().collect();
        if theirs.len() != ranges.len() - 1 {
            return Err(Error::Corrupt(format!("{}: an encoder thread failed ({})", self.lower.describe(), self.engine.kind)));
        }
        theirs.sort_by_key(|(i, _)| *i);
        for (_, encoded) in theirs {
            all.extend(encoded.map_err(|(c, e)| self.encode_failed(c, e))?);
        }
        Ok(all)
    }

    /// The error for a chunk the codec could not encode: the file, the upper offset, the cause.
    pub(super) fn encode_failed(&self, chunk: u64, e: CodecError) -> Error {
        Error::Corrupt(format!("{}: the chunk at offset {}: {e}", self.lower.describe(), chunk_start(self.ix.chunk_shift, chunk)))
    }
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
        if let Err(e) = self.codec.encode_at(place, chunk, out) {
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
