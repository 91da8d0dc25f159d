//! Shared by the CPU kernel benches: environment knobs and the host read-bandwidth baseline.
use std::time::Instant;

use criterion::black_box;

/// An environment variable parsed as usize, if set and valid.
pub fn env_usize(k: &str) -> Option<usize> {
    std::env::var(k).ok().and_then(|v| v.parse().ok())
}

/// Sums `c` with AVX2 loads when available (the compiler vectorises the 8-lane loop).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(c: &[u64]) -> u64 {
    sum_plain(c)
}

#[inline(always)]
fn sum_plain(c: &[u64]) -> u64 {
    let mut a = [0u64; 8];
    for q in c.chunks_exact(8) {
        for j in 0..8 {
            a[j] = a[j].wrapping_add(q[j]);
        }
    }
    a.iter().fold(0u64, |x, y| x.wrapping_add(*y))
}

fn sum(c: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 support checked just above.
        return unsafe { sum_avx2(c) };
    }
    sum_plain(c)
}

/// Multi-threaded streaming read of a buffer larger than the LLC, best of 5: bytes/s.
pub fn read_bandwidth(threads: usize, nbytes: usize) -> f64 {
    let buf: Vec<u64> = (0..nbytes / 8).map(|i| i as u64).collect();
    let chunk = buf.len().div_ceil(threads);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        let s: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf.chunks(chunk).map(|c| s.spawn(move || sum(c))).collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, |x, y| x.wrapping_add(y))
        });
        black_box(s);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    nbytes as f64 / best
}
