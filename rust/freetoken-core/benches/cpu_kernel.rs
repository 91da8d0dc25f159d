//! CPU expert kernel throughput, in expert weight bytes per second, beside the host memory read
//! bandwidth measured in the same run (the baseline: a batch-1 expert forward cannot beat it).
//!
//! Shape: Qwen3-30B-A3B experts (hidden 2048, expert intermediate 768: 9 MiB bf16 each); 8
//! experts per call (top-8), rotating through a pool larger than the last-level cache, so every
//! call streams cold weights from DRAM. Batch 1, 4, 16 tokens per expert.
//!
//! Run:   cargo bench -p freetoken-core --bench cpu_kernel
//! Quick: cargo bench -p freetoken-core --bench cpu_kernel -- --quick
//! Env:   FT_BENCH_EXPERTS (pool size in experts, default 128 = 1.2 GB), FT_BENCH_THREADS
//!        (default: all CPUs), FT_BENCH_ISA (scalar | avx2 | avx512_bf16, default: fastest).
//! Prints one line per case and a JSON record, then criterion's own report.
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use freetoken_core::cpu::{CpuExperts, Hidden, Isa};
use freetoken_core::pool::{ExpertPool, PoolShape};

mod common;
use common::{env_usize, read_bandwidth};

const H: usize = 2048;
const I: usize = 768;
const TOPK: usize = 8;

struct Case {
    cpu: CpuExperts,
    num_experts: usize,
    x: Vec<f32>,
    ids: Vec<i64>,
    w: Vec<f32>,
    out: Vec<f32>,
    next: usize,
    batch: usize,
}

impl Case {
    /// One call: TOPK experts (the next ones in the rotation), every token routed to all of them.
    fn call(&mut self) {
        let experts: Vec<i64> = (0..TOPK)
            .map(|j| ((self.next + j) % self.num_experts) as i64)
            .collect();
        self.next = (self.next + TOPK) % self.num_experts;
        for t in 0..self.batch {
            self.ids[t * TOPK..(t + 1) * TOPK].copy_from_slice(&experts);
        }
        self.cpu
            .forward(
                0,
                Hidden::F32(&self.x),
                &self.ids,
                &self.w,
                TOPK,
                &experts,
                &mut self.out,
            )
            .expect("forward");
    }
}

fn main() {
    let num_experts = env_usize("FT_BENCH_EXPERTS").unwrap_or(128);
    let threads = env_usize("FT_BENCH_THREADS");
    let isa = std::env::var("FT_BENCH_ISA")
        .ok()
        .and_then(|s| Isa::from_name(&s));
    let shape = PoolShape {
        moe_layers: vec![0],
        num_experts,
        hidden_size: H,
        intermediate_size: I,
        format: freetoken_core::quant::ExpertFormat::Bf16,
    };
    let pool = Arc::new(ExpertPool::random(shape, 0, threads).expect("pool"));
    let expert_bytes = pool.expert_nbytes();
    let cpu0 = CpuExperts::new(pool.clone(), threads, isa).expect("cpu experts");
    let nt = cpu0.num_threads();
    let isa = cpu0.isa();
    drop(cpu0);
    let bw = read_bandwidth(nt, 1 << 30);
    println!(
        "cpu_kernel: pool {num_experts} experts x {:.1} MiB = {:.2} GB, {nt} threads, isa {}; host read bandwidth {:.2} GB/s (baseline)",
        expert_bytes as f64 / (1 << 20) as f64,
        (num_experts * expert_bytes) as f64 / 1e9,
        isa.name(),
        bw / 1e9
    );
    let mut cases: Vec<Case> = [1usize, 4, 16]
        .iter()
        .map(|&b| Case {
            cpu: CpuExperts::new(pool.clone(), threads, Some(isa)).expect("cpu experts"),
            num_experts,
            x: (0..b * H).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect(),
            ids: vec![0; b * TOPK],
            w: vec![1.0 / TOPK as f32; b * TOPK],
            out: vec![0.0; b * H],
            next: 0,
            batch: b,
        })
        .collect();
    for c in &mut cases {
        for _ in 0..(num_experts / TOPK).max(2) {
            c.call(); // warm up: page faults, thread wake-up
        }
        let calls = 3 * (num_experts / TOPK).max(4);
        let t0 = Instant::now();
        for _ in 0..calls {
            c.call();
        }
        let s = t0.elapsed().as_secs_f64() / calls as f64;
        let gbps = (TOPK * expert_bytes) as f64 / s / 1e9;
        println!(
            "cpu_kernel batch {:>2}: {:>7.1} us per call of {TOPK} experts, {:>6.2} GB/s weights = {:>5.1} % of read bandwidth",
            c.batch,
            s * 1e6,
            gbps,
            100.0 * gbps * 1e9 / bw
        );
        println!(
            "{{\"bench\":\"cpu_kernel\",\"isa\":\"{}\",\"threads\":{nt},\"batch\":{},\"us_per_call\":{:.2},\"weight_gbps\":{:.3},\"read_gbps\":{:.3}}}",
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
    let mut g = crit.benchmark_group("cpu_kernel");
    g.throughput(Throughput::Bytes((TOPK * expert_bytes) as u64));
    for c in &mut cases {
        g.bench_function(format!("qwen3_30b_a3b_top8_batch{}", c.batch), |bch| {
            bch.iter(|| c.call())
        });
    }
    g.finish();
    crit.final_summary();
}
