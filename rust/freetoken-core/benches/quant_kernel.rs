//! Quantized CPU expert kernel throughput, in expert bytes (weights + scales) per second, beside
//! the host memory read bandwidth measured in the same run and the bf16 bench's shape.
//!
//! Shape: Qwen3-30B-A3B experts (hidden 2048, expert intermediate 768) in FP8 128x128 blocks
//! (4.5 MiB each), NVFP4 (2.4 MiB) and MXFP4 (2.3 MiB); 8 experts per call (top-8), rotating
//! through a pool larger than the last-level cache, so every call streams cold weights from
//! DRAM. Batch 1, 4, 16 tokens per expert. The work is split as `CpuExperts` splits it: row
//! chunks of gate/up (then the activation), then row chunks of down, claimed by the persistent
//! worker pool's threads.
//!
//! Run:   cargo bench -p freetoken-core --bench quant_kernel
//! Quick: cargo bench -p freetoken-core --bench quant_kernel -- --quick
//! Env:   FT_BENCH_EXPERTS (pool size in experts, default 256), FT_BENCH_THREADS (default: all
//!        CPUs), FT_BENCH_ISA (scalar | avx2 | avx512_bf16, default: fastest), FT_BENCH_FORMATS
//!        (comma-separated, default fp8_block,nvfp4,mxfp4), FT_BENCH_BATCHES (default 1,4,16),
//!        FT_BENCH_ACT (f32: f32 activations, the f32 kernels, on the bf16 paths too; default: bf16
//!        where the path wants it, as `CpuExperts` passes them).
//! With one thread it also prints GB/s per CPU-second of that thread (robust to a shared machine).
//! Prints one line per case and a JSON record, then criterion's own report.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use freetoken_core::bf16::f32_to_bf16;
use freetoken_core::cpu::workers::WorkerPool;
use freetoken_core::cpu::{Act, Isa};
use freetoken_core::pool::SplitMix64;
use freetoken_core::quant::{kernels, ExpertFormat, ExpertLayout};

mod common;
use common::{env_usize, read_bandwidth};

const H: usize = 2048;
const I: usize = 768;
const TOPK: usize = 8;
/// Rows per task (a multiple of 16, as `CpuExperts`' chunks).
const CHUNK: usize = 64;

/// Output buffers written by disjoint tasks.
#[derive(Clone, Copy)]
struct Out<T>(*mut T);
// SAFETY: tasks write disjoint elements; the pool's `run` returns after every writer is done.
unsafe impl<T> Send for Out<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Out<T> {}

impl<T> Out<T> {
    /// The pointer (a method, so closures capture the Sync wrapper, not the raw field).
    fn ptr(&self) -> *mut T {
        self.0
    }
}

struct Case {
    layout: ExpertLayout,
    pool: Vec<u8>,
    num_experts: usize,
    batch: usize,
    x: Vec<f32>,
    /// `x` as bf16 bits (for the paths that want bf16 activations).
    x_bf: Vec<u16>,
    act: Vec<f32>,
    act_bf: Vec<u16>,
    y: Vec<f32>,
    next: usize,
}

fn random_pool(layout: &ExpertLayout, num_experts: usize) -> Vec<u8> {
    let mut rng = SplitMix64::new(1);
    let mut pool: Vec<u8> = (0..num_experts * layout.expert_nbytes)
        .map(|_| rng.next_u64() as u8)
        .collect();
    for e in pool.chunks_mut(layout.expert_nbytes) {
        // Sane scales (the weights' bytes may be anything but e4m3's NaN codes, which the SIMD
        // paths do not special-case; their speed does not depend on the values).
        let (o, n) = layout.gate_up_scale;
        let (o2, n2) = layout.down_scale;
        for s in [o..o + n, o2..o2 + n2] {
            match layout.format {
                ExpertFormat::Fp8Block { .. } => e[s]
                    .chunks_mut(4)
                    .for_each(|c| c.copy_from_slice(&1e-3f32.to_le_bytes())),
                ExpertFormat::Mxfp4 => e[s].iter_mut().for_each(|v| *v = 120),
                _ => e[s].iter_mut().for_each(|v| *v = 0x30),
            }
        }
        if layout.tensor_scale.1 > 0 {
            let o = layout.tensor_scale.0;
            for k in 0..3 {
                e[o + 4 * k..o + 4 * k + 4].copy_from_slice(&1e-2f32.to_le_bytes());
            }
        }
    }
    pool
}

impl Case {
    /// One call: TOPK experts (the next ones in the rotation), every token routed to all of them.
    fn call(&mut self, workers: &WorkerPool, isa: Isa, bf: bool) {
        let first = self.next;
        self.next = (self.next + TOPK) % self.num_experts;
        let (n, nb) = (self.batch, self.layout.expert_nbytes);
        let experts: Vec<_> = (0..TOPK)
            .map(|j| {
                let e = (first + j) % self.num_experts;
                self.layout
                    .expert(&self.pool[e * nb..(e + 1) * nb])
                    .expect("expert")
            })
            .collect();
        let x = if bf {
            Act::Bf16(&self.x_bf)
        } else {
            Act::F32(&self.x)
        };
        let (act, act_bf, y) = (
            Out(self.act.as_mut_ptr()),
            Out(self.act_bf.as_mut_ptr()),
            Out(self.y.as_mut_ptr()),
        );
        // Phase 0: gate and up rows, then silu(g) * u into act [TOPK, n, I].
        let next = AtomicUsize::new(0);
        let tasks0 = TOPK * I.div_ceil(CHUNK);
        workers.run(&|| loop {
            // ORDERING: a plain work counter; results are published by `run` returning.
            let k = next.fetch_add(1, Ordering::Relaxed);
            if k >= tasks0 {
                break;
            }
            let (j, r0) = (k / I.div_ceil(CHUNK), k % I.div_ceil(CHUNK) * CHUNK);
            let r1 = (r0 + CHUNK).min(I);
            let (mut g, mut u) = (vec![0f32; n * CHUNK], vec![0f32; n * CHUNK]);
            kernels::gemv(isa, &experts[j].gate, r0, r1, x, n, &mut g, CHUNK);
            kernels::gemv(isa, &experts[j].up, r0, r1, x, n, &mut u, CHUNK);
            for t in 0..n {
                for r in 0..r1 - r0 {
                    let gv = g[t * CHUNK + r];
                    let v = gv / (1.0 + (-gv).exp()) * u[t * CHUNK + r];
                    let idx = (j * n + t) * I + r0 + r;
                    // SAFETY: (j, t, r0 + r) is written by this task only, inside act's and
                    // act_bf's lengths.
                    unsafe {
                        if bf {
                            *act_bf.ptr().add(idx) = f32_to_bf16(v);
                        } else {
                            *act.ptr().add(idx) = v;
                        }
                    };
                }
            }
        });
        // Phase 1: down rows into y [TOPK, n, H].
        let next = AtomicUsize::new(0);
        let tasks1 = TOPK * H.div_ceil(CHUNK);
        let (act, act_bf) = (&self.act, &self.act_bf);
        workers.run(&|| loop {
            // ORDERING: as above.
            let k = next.fetch_add(1, Ordering::Relaxed);
            if k >= tasks1 {
                break;
            }
            let (j, r0) = (k / H.div_ceil(CHUNK), k % H.div_ceil(CHUNK) * CHUNK);
            let r1 = (r0 + CHUNK).min(H);
            let mut o = vec![0f32; n * CHUNK];
            let a = if bf {
                Act::Bf16(&act_bf[j * n * I..(j + 1) * n * I])
            } else {
                Act::F32(&act[j * n * I..(j + 1) * n * I])
            };
            kernels::gemv(isa, &experts[j].down, r0, r1, a, n, &mut o, CHUNK);
            for t in 0..n {
                for r in 0..r1 - r0 {
                    // SAFETY: (j, t, r0 + r) is written by this task only, inside y's length.
                    unsafe { *y.ptr().add((j * n + t) * H + r0 + r) = o[t * CHUNK + r] };
                }
            }
        });
    }
}

/// CPU seconds the calling thread has run.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec the call writes.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() {
    let num_experts = env_usize("FT_BENCH_EXPERTS").unwrap_or(256);
    let threads = env_usize("FT_BENCH_THREADS");
    let isa = std::env::var("FT_BENCH_ISA")
        .ok()
        .and_then(|s| Isa::from_name(&s))
        .unwrap_or_else(Isa::detect);
    let formats = std::env::var("FT_BENCH_FORMATS").unwrap_or("fp8_block,nvfp4,mxfp4".into());
    let batches: Vec<usize> = std::env::var("FT_BENCH_BATCHES")
        .unwrap_or("1,4,16".into())
        .split(',')
        .map(|b| {
            b.trim()
                .parse()
                .expect("FT_BENCH_BATCHES: comma-separated token counts")
        })
        .collect();
    let bf = isa.wants_bf16() && std::env::var("FT_BENCH_ACT").as_deref() != Ok("f32");
    let workers = WorkerPool::new(threads);
    let nt = workers.num_threads();
    let bw = read_bandwidth(nt, 1 << 30);
    println!(
        "quant_kernel: {num_experts} experts per format, {nt} threads, isa {}, {} activations; host read bandwidth {:.2} GB/s (baseline)",
        isa.name(),
        if bf { "bf16" } else { "f32" },
        bw / 1e9
    );
    let mut cases = Vec::new();
    for name in formats.split(',') {
        let format = ExpertFormat::from_name(name.trim(), (128, 128)).expect("format");
        let layout = format.layout(H, I);
        let pool = random_pool(&layout, num_experts);
        for &b in &batches {
            cases.push(Case {
                layout,
                pool: pool.clone(),
                num_experts,
                batch: b,
                x: (0..b * H).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect(),
                x_bf: (0..b * H)
                    .map(|i| f32_to_bf16(((i % 17) as f32 - 8.0) / 8.0))
                    .collect(),
                act: vec![0.0; TOPK * b * I],
                act_bf: vec![0; TOPK * b * I],
                y: vec![0.0; TOPK * b * H],
                next: 0,
            });
        }
    }
    for c in &mut cases {
        for _ in 0..(num_experts / TOPK).max(2) {
            c.call(&workers, isa, bf); // warm up: page faults, thread wake-up
        }
        let calls = 3 * (num_experts / TOPK).max(4);
        let (t0, cpu0) = (Instant::now(), thread_cpu_s());
        for _ in 0..calls {
            c.call(&workers, isa, bf);
        }
        let s = t0.elapsed().as_secs_f64() / calls as f64;
        if nt == 1 {
            // One thread runs every task on the caller: its CPU time is the kernels' time even on a
            // shared machine whose scheduler takes the core away now and then.
            let cpu_s = (thread_cpu_s() - cpu0) / calls as f64;
            println!(
                "quant_kernel {:>9} batch {:>2}: {:>6.2} GB/s expert bytes per CPU-second of the thread",
                c.layout.format.name(),
                c.batch,
                (TOPK * c.layout.expert_nbytes) as f64 / cpu_s / 1e9
            );
        }
        let gbps = (TOPK * c.layout.expert_nbytes) as f64 / s / 1e9;
        let name = c.layout.format.name();
        println!(
            "quant_kernel {name:>9} batch {:>2}: {:>7.1} us per call of {TOPK} experts, {:>6.2} GB/s expert bytes = {:>5.1} % of read bandwidth",
            c.batch,
            s * 1e6,
            gbps,
            100.0 * gbps * 1e9 / bw
        );
        println!(
            "{{\"bench\":\"quant_kernel\",\"format\":\"{name}\",\"isa\":\"{}\",\"threads\":{nt},\"batch\":{},\"us_per_call\":{:.2},\"expert_gbps\":{:.3},\"read_gbps\":{:.3}}}",
            isa.name(),
            c.batch,
            s * 1e6,
            gbps,
            bw / 1e9
        );
    }
    let mut crit = Criterion::default()
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut g = crit.benchmark_group("quant_kernel");
    for c in &mut cases {
        g.throughput(Throughput::Bytes((TOPK * c.layout.expert_nbytes) as u64));
        let id = format!(
            "qwen3_30b_a3b_{}_top8_batch{}",
            c.layout.format.name(),
            c.batch
        );
        g.bench_function(id, |bch| bch.iter(|| c.call(&workers, isa, bf)));
    }
    g.finish();
    crit.final_summary();
}
