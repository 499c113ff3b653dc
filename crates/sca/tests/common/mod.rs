//! What the in-process tests of encoded files share.

use plyfs_sca::Codec;

/// Run-length encoding: output size depends on the data, which exercises size changes.
pub struct Rle;

impl Codec for Rle {
    fn tag(&self) -> [u8; 4] {
        *b"rle\0"
    }

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), plyfs_sca::Error> {
        let mut i = 0;
        while i < chunk.len() {
            let b = chunk[i];
            let mut n = 1;
            while i + n < chunk.len() && chunk[i + n] == b && n < 255 {
                n += 1;
            }
            out.push(n as u8);
            out.push(b);
            i += n;
        }
        Ok(())
    }

    fn decode(&self, encoded: &[u8], _len: usize, out: &mut Vec<u8>) -> std::result::Result<(), plyfs_sca::Error> {
        if encoded.len() % 2 != 0 {
            return Err(plyfs_sca::Error::decode("odd length"));
        }
        for pair in encoded.chunks(2) {
            out.extend(std::iter::repeat_n(pair[1], pair[0] as usize));
        }
        Ok(())
    }

    fn store_raw_if_larger(&self) -> bool {
        true
    }
}

/// [`Rle`], slow enough (20 µs a chunk at least) that large writes encode on several threads.
#[allow(dead_code)]
pub struct SlowRle;

impl Codec for SlowRle {
    fn tag(&self) -> [u8; 4] {
        Rle.tag()
    }

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), plyfs_sca::Error> {
        std::thread::sleep(std::time::Duration::from_micros(20));
        Rle.encode(chunk, out)
    }

    fn decode(&self, encoded: &[u8], len: usize, out: &mut Vec<u8>) -> std::result::Result<(), plyfs_sca::Error> {
        Rle.decode(encoded, len, out)
    }

    fn store_raw_if_larger(&self) -> bool {
        true
    }
}

/// Whether this thread is one of the encoder pool's.
#[allow(dead_code)]
pub fn on_encoder_pool() -> bool {
    std::thread::current().name().is_some_and(|n| n.starts_with("sca-encode"))
}

/// [`Rle`], slow (2 ms a chunk) on the thread that got the write, quick on the encoder pool's,
/// so that a large write leaves most of its chunks to the pool. It counts the chunks the pool
/// encoded, and panics there on chunks that begin with `panic_on`.
#[allow(dead_code)]
pub struct PoolProbe {
    pub pool_chunks: std::sync::atomic::AtomicUsize,
    pub panic_on: Option<u8>,
}

impl Codec for PoolProbe {
    fn tag(&self) -> [u8; 4] {
        Rle.tag()
    }

    fn encode(&self, chunk: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), plyfs_sca::Error> {
        if self.panic_on.is_some() && chunk.first() == self.panic_on.as_ref() {
            panic!("a codec failing on purpose");
        }
        if on_encoder_pool() {
            self.pool_chunks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        } else {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        Rle.encode(chunk, out)
    }

    fn decode(&self, encoded: &[u8], len: usize, out: &mut Vec<u8>) -> std::result::Result<(), plyfs_sca::Error> {
        Rle.decode(encoded, len, out)
    }
}
