//! q* planner: ns per `Planner::plan` call at batch 1 and 16 (top-8, 128 experts, 48 layers,
//! expert_cache at 25 % of the pool), offload and hybrid backends, ids from the calibrated
//! synthetic trace. The target is well under 10 µs per plan at batch 1.
//!
//! Run:   cargo bench -p freetoken-core --bench planner
//! Quick: cargo bench -p freetoken-core --bench planner -- --quick
//! (Criterion prints time per call, i.e. per layer step, as `time:`.)
use std::time::Duration;

use criterion::{black_box, Criterion};
use freetoken_core::planner::{Backend, BandwidthProfile, Planner, PlannerConfig};
use freetoken_core::trace::{self, SyntheticConfig};

fn main() {
    let mut crit = Criterion::default()
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let (layers, experts, k) = (48usize, 128usize, 8usize);
    let mut g = crit.benchmark_group("planner");
    for batch in [1usize, 16] {
        let t = trace::synthetic(&SyntheticConfig {
            batch,
            seed: 3,
            ..SyntheticConfig::new(layers, experts, k, 200)
        })
        .expect("trace");
        let recs: Vec<(i64, Vec<i64>)> = t
            .records
            .iter()
            .map(|r| (r.layer as i64, r.ids.iter().map(|&e| e as i64).collect()))
            .collect();
        for backend in [Backend::Offload, Backend::Hybrid] {
            let mut p = Planner::new(PlannerConfig {
                num_layers: layers,
                num_experts: experts,
                expert_nbytes: 9 << 20,
                capacity: layers * experts / 4,
                policy: "lru".into(),
                profile: Some(
                    BandwidthProfile::new(50e9, vec![(1.0, 60e9), (16.0, 120e9)]).expect("profile"),
                ),
                reuse_weight: 0.5,
                reuse_decay: 0.9,
            })
            .expect("planner");
            let mut i = 0;
            g.bench_function(
                format!("plan_batch{batch}_{backend:?}").to_lowercase(),
                |b| {
                    b.iter(|| {
                        let (l, ids) = &recs[i % recs.len()];
                        i += 1;
                        black_box(p.plan(*l, ids, k, backend).expect("plan"))
                    })
                },
            );
        }
    }
    g.finish();
    crit.final_summary();
}
