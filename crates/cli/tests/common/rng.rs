//! The randomized tests' generator and seeds: a run prints its seed, and the seed given back in
//! the test's environment variable repeats it.

/// xorshift64*: tiny, deterministic, good enough to drive a tester.
pub struct Rng(pub u64);

impl Rng {
    /// A generator for `seed`, spread over the state so that nearby seeds (a worker's number
    /// mixed in) draw unrelated sequences.
    pub fn spread(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The run's seed: the number in the environment variable `var`, or a new (odd) one; printed
/// either way, with how to repeat the run.
pub fn seed(var: &str) -> u64 {
    let seed = match std::env::var(var) {
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("{var}={s}: not a number")),
        Err(_) => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1,
    };
    eprintln!("seed {seed} ({var}={seed} repeats this run)");
    seed
}
