//! Expert-cache policies: hit rate and ns per lookup on routing traces, at cache sizes from 5 %
//! to 60 % of the pool, with Belady's MIN as the ceiling.
//!
//! Traces (no real per-token traces are available offline: `../shared/traces/` holds per-layer
//! expert counts only, see its README):
//! - `synthetic-qwen3-30b`: 48 layers x 128 experts, top-8, the calibrated defaults of
//!   `trace::SyntheticConfig` (busiest expert ~4.4x uniform, per-layer LRU-64 ~69 %).
//! - `olmoe-counts`: 16 layers x 64 experts, top-8, popularity taken from OLMoE-1B-7B's measured
//!   expert counts (layers 0, 7, 15 of the c4 domain, cycled), same temporal-reuse model. Skipped
//!   when the counts file is absent (`FT_TRACES_DIR` overrides `../shared/traces`).
//!
//! Run:   cargo bench -p freetoken-core --bench policies
//! Quick: cargo bench -p freetoken-core --bench policies -- --quick
//! Prints a hit-rate table (one line per trace x policy) and a JSON record per cell, then
//! criterion's ns per lookup (touch + insert on miss, averaged over a trace's accesses).
use std::path::PathBuf;
use std::time::Duration;

use criterion::{black_box, Criterion, Throughput};
use freetoken_core::cache::{policy_by_name, SlotMap};
use freetoken_core::trace::{self, access_sequence, SyntheticConfig, Trace};

const FRACTIONS: [f64; 5] = [0.05, 0.10, 0.20, 0.40, 0.60];
const POLICIES: [&str; 4] = ["lru", "layer_lru", "lfu", "min"];

fn traces_dir() -> PathBuf {
    std::env::var_os("FT_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces"))
}

/// OLMoE per-layer popularity from the counts file (c4 domain, layers 0/7/15).
fn olmoe_popularity() -> Option<Vec<Vec<f64>>> {
    let path = traces_dir().join("olmoe_repo_routing_counts/olmoe_1b_7b_0924.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    let counts = v.get("domains")?.get("c4")?.get("expert_counts")?;
    let rows: Vec<Vec<f64>> = ["layer0", "layer7", "layer15"]
        .iter()
        .filter_map(|l| {
            counts
                .get(*l)?
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        })
        .collect();
    (rows.len() == 3).then_some(rows)
}

fn main() {
    let mut traces: Vec<(&str, Trace)> = vec![(
        "synthetic-qwen3-30b",
        trace::synthetic(&SyntheticConfig {
            seed: 1,
            ..SyntheticConfig::new(48, 128, 8, 600)
        })
        .expect("trace"),
    )];
    match olmoe_popularity() {
        Some(pop) => traces.push((
            "olmoe-counts",
            trace::synthetic(&SyntheticConfig {
                seed: 2,
                popularity: Some(pop),
                ..SyntheticConfig::new(16, 64, 8, 1500)
            })
            .expect("trace"),
        )),
        None => println!(
            "policies: OLMoE counts not found under {}; skipping that trace",
            traces_dir().display()
        ),
    }
    for (name, t) in &traces {
        let keys = t.num_layers * t.num_experts;
        let warmup = t.records.len() / 10;
        let ratio = trace::busiest_ratio(t);
        println!(
            "policies: trace {name}: {} layers x {} experts, top-{}, {} layer steps; busiest expert {:.1}-{:.1}x uniform",
            t.num_layers,
            t.num_experts,
            t.top_k,
            t.records.len(),
            ratio.iter().cloned().fold(f64::MAX, f64::min),
            ratio.iter().cloned().fold(0.0, f64::max)
        );
        println!(
            "  {:<10} {}",
            "policy",
            FRACTIONS
                .map(|f| format!("{:>7}", format!("{:.0}%", f * 100.0)))
                .join(" ")
        );
        for p in POLICIES {
            let mut cells = Vec::new();
            for f in FRACTIONS {
                let cap = ((keys as f64) * f).round() as usize;
                let r = trace::simulate(t, cap, p, warmup).expect("simulate");
                cells.push(r.hit_rate());
                println!(
                    "{{\"bench\":\"policies\",\"trace\":\"{name}\",\"policy\":\"{p}\",\"cache_fraction\":{f},\"capacity\":{cap},\"hit_rate\":{:.4}}}",
                    r.hit_rate()
                );
            }
            println!(
                "  {:<10} {}",
                p,
                cells
                    .iter()
                    .map(|h| format!("{:>6.1}%", h * 100.0))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
    }
    // ns per lookup: replay the first trace's accesses through a slot map at 20 % of the pool.
    let mut crit = Criterion::default()
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let (_, t) = &traces[0];
    let seq = access_sequence(t);
    let n_acc = seq.len();
    let ne = t.num_experts;
    let cap = t.num_layers * t.num_experts / 5;
    let mut g = crit.benchmark_group("policies_lookup");
    g.throughput(Throughput::Elements(n_acc as u64));
    for p in ["lru", "layer_lru", "lfu"] {
        g.bench_function(format!("{p}_20pct_{n_acc}_accesses"), |b| {
            b.iter(|| {
                let mut m = SlotMap::new(
                    cap,
                    t.num_layers,
                    ne,
                    policy_by_name(p, cap, t.num_layers).expect("policy"),
                )
                .expect("map");
                let mut hits = 0u64;
                for (i, k) in seq.iter().enumerate() {
                    if i % 8 == 0 {
                        m.unpin_all();
                    }
                    let f = k.layer as usize * ne + k.expert as usize;
                    if m.touch_flat(f).is_some() {
                        hits += 1;
                    } else {
                        m.insert_flat(f).expect("insert");
                    }
                }
                black_box(hits)
            })
        });
    }
    g.finish();
    crit.final_summary();
}
