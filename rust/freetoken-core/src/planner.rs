//! The q* planner: for one MoE layer step, which experts hit, which fill a slot, which run on
//! the CPU; plus per-layer counters.
//!
//! Owns: the [`SlotMap`], the decision between fill and CPU, per-expert reuse estimates and
//! counters. Not: copies, kernels (Python and [`crate::cpu`] run the plan).
//!
//! # q*
//! With `n` missing experts of `S` bytes each at a layer step, PCIe bandwidth `B_pcie` (bytes/s,
//! pinned host -> device copies) and CPU kernel throughput `B_cpu(b)` (weight bytes/s at `b`
//! tokens per expert, `b` = the mean tokens per missing expert), sending a share `q` of the miss
//! bytes to the CPU makes the two paths take `(1-q)·n·S / B_pcie` and `q·n·S / B_cpu(b)`; they
//! end together at
//! ```text
//! q* = B_cpu(b) / (B_cpu(b) + B_pcie)
//! ```
//! A fill also buys future hits and a CPU run does not. Each expert keeps `p_e`, an exponential
//! moving average (decay `reuse_decay` per step of its layer) of "used at this layer step", so
//! `p_e` estimates the chance that the next step at this layer needs it again. A fill of an expert
//! with reuse `p` saves about `p` future misses; we credit that by inflating the PCIe bandwidth:
//! ```text
//! B_pcie_eff = B_pcie · (1 + w · p̄)        q = B_cpu(b) / (B_cpu(b) + B_pcie_eff)
//! ```
//! with `p̄` the mean `p_e` of the missing experts and `w` = `reuse_weight` (0 = pure q*).
//!
//! Experts are whole: `k` of the `n` misses go to the CPU. In units of one expert's time on each
//! path (`t_c ∝ 1/B_cpu(b)`, `t_p ∝ 1/B_pcie_eff`), the layer step ends with the slower path,
//! `max(k·t_c, (n-k)·t_p)`, which is least at `⌊q·n⌋` or the next integer: the next one exactly
//! when the fraction of `q·n` exceeds `1 - q` (the two makespans cross there), so
//! ```text
//! k = min(n, ⌊q·(n + 1)⌋)
//! ```
//! (rounding `q·n` instead costs up to one expert on the PCIe path: with `q` = 0.62 and 4 misses
//! it sends 2 of them over PCIe, ending at 2 `t_p` = 3.3 `t_c` where 3 on the CPU end at 3 `t_c`).
//! Those with the lowest `p_e` (ties: fewer tokens first) go to the CPU and the rest fill. If a
//! fill finds every slot pinned, that expert runs on the CPU instead.
//!
//! # Refinement
//! Whoever runs a plan reports what its paths actually did ([`Planner::record_fills`],
//! [`Planner::record_cpu`]); each path keeps an exponential moving average of measured /
//! profiled bandwidth ([`BandwidthTracker`], weight [`REFINE_ALPHA`] per layer step, bounded to
//! [[`MIN_RATIO`], [`MAX_RATIO`]]) that scales its whole profile, so q* follows the box when
//! another process loads the PCIe or memory bus. [`Planner::refined_profile`] is what q* uses;
//! the Python side only reads it.
//!
//! # Pins
//! Each `plan` first releases the previous plan's pins: the router of layer `l+1` depends on the
//! output of layer `l`, so by the time its ids reach the host, layer `l`'s slots are no longer read.
use crate::cache::{policy_by_name, Policy, SlotMap};
use crate::error::PlanError;

/// Where the misses of a layer step go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Every miss fills a slot (copy over PCIe, run on the GPU).
    Offload,
    /// Every miss runs on the CPU (hits still run on the GPU).
    Cpu,
    /// The q* split between fills and CPU runs.
    Hybrid,
}

impl std::str::FromStr for Backend {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        match s {
            "offload" => Ok(Self::Offload),
            "cpu" => Ok(Self::Cpu),
            "hybrid" => Ok(Self::Hybrid),
            other => Err(PlanError::Invalid(format!(
                "unknown backend {other:?}; expected \"offload\", \"cpu\" or \"hybrid\""
            ))),
        }
    }
}

/// Measured bandwidths (from `ft bench bw`).
#[derive(Debug, Clone, PartialEq)]
pub struct BandwidthProfile {
    /// Host -> device expert copy bandwidth, bytes/s.
    pub pcie_bytes_per_s: f64,
    /// CPU expert kernel throughput in weight bytes/s at each batch size: `(batch, bytes/s)`,
    /// sorted by batch; linear interpolation between points, the first point's value below them,
    /// and `B(b_max) · b_max / b` above the largest (see [`BandwidthProfile::cpu_at`]).
    pub cpu_bytes_per_s: Vec<(f64, f64)>,
}

impl BandwidthProfile {
    /// Checks the profile: positive finite values, at least one CPU point, batches increasing.
    pub fn new(
        pcie_bytes_per_s: f64,
        mut cpu_bytes_per_s: Vec<(f64, f64)>,
    ) -> Result<Self, PlanError> {
        cpu_bytes_per_s.sort_by(|a, b| a.0.total_cmp(&b.0));
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if !ok(pcie_bytes_per_s)
            || cpu_bytes_per_s.is_empty()
            || cpu_bytes_per_s.iter().any(|&(b, v)| !ok(b) || !ok(v))
        {
            return Err(PlanError::Invalid(format!(
                "bandwidth profile needs a positive B_pcie (got {pcie_bytes_per_s}) and at least one positive (batch, B_cpu) point (got {cpu_bytes_per_s:?})"
            )));
        }
        Ok(Self {
            pcie_bytes_per_s,
            cpu_bytes_per_s,
        })
    }

    /// `B_cpu(b)`, bytes/s. Above the largest measured batch `b_max` the kernels are compute-bound
    /// (a prefill chunk gives each expert hundreds of tokens): the time per (token, expert) stays
    /// that of `b_max`, so weight bytes/s fall as `b_max / b`. Clamping there instead would send a
    /// long chunk's experts to the CPU at memory speed, many times slower than planned.
    pub fn cpu_at(&self, b: f64) -> f64 {
        let p = &self.cpu_bytes_per_s;
        if b <= p[0].0 {
            return p[0].1;
        }
        for w in p.windows(2) {
            if b <= w[1].0 {
                let t = (b - w[0].0) / (w[1].0 - w[0].0);
                return w[0].1 + t * (w[1].1 - w[0].1);
            }
        }
        let (b_max, v) = p[p.len() - 1];
        v * b_max / b
    }

    /// `q* = B_cpu(b) / (B_cpu(b) + B_pcie · (1 + reuse_credit))`.
    pub fn q(&self, b: f64, reuse_credit: f64) -> f64 {
        let c = self.cpu_at(b);
        c / (c + self.pcie_bytes_per_s * (1.0 + reuse_credit.max(0.0)))
    }
}

/// EMA weight of one layer step's measurement (about 1/alpha layer steps of memory: with 0.02,
/// about one token's layer steps on a 48-layer model).
pub const REFINE_ALPHA: f64 = 0.02;
/// Lower bound of a path's refined / profiled ratio (one noisy run cannot swing q*).
pub const MIN_RATIO: f64 = 0.25;
/// Upper bound of a path's refined / profiled ratio.
pub const MAX_RATIO: f64 = 4.0;

/// Exponential moving average of one miss path's measured bandwidth, absolute and relative to
/// its profile.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BandwidthTracker {
    ratio: Option<f64>,
    bytes_per_s: Option<f64>,
    num_samples: u64,
}

impl BandwidthTracker {
    /// A timed run: `nbytes` moved or read in `seconds`, against `profiled` bytes/s at the same
    /// batch (None without a profile: only the absolute EMA moves); `samples` runs summed into
    /// one, weighted as that many. Non-positive inputs are ignored.
    pub fn add(&mut self, nbytes: f64, seconds: f64, profiled: Option<f64>, samples: u32) {
        if !(seconds > 0.0 && nbytes > 0.0) || samples == 0 {
            return;
        }
        let measured = nbytes / seconds;
        let alpha = 1.0 - (1.0 - REFINE_ALPHA).powi(samples as i32);
        let ema = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + alpha * (new - o)));
        self.bytes_per_s = ema(self.bytes_per_s, measured);
        if let Some(p) = profiled.filter(|p| *p > 0.0) {
            self.ratio = ema(self.ratio, measured / p);
        }
        self.num_samples += u64::from(samples);
    }

    /// The factor that scales the profile: the ratio's EMA bounded to [`MIN_RATIO`],
    /// [`MAX_RATIO`]; 1 before any sample.
    pub fn scale(&self) -> f64 {
        self.ratio.map_or(1.0, |r| r.clamp(MIN_RATIO, MAX_RATIO))
    }

    /// EMA of measured / profiled (unbounded), None before a sample against a profile.
    pub fn ratio(&self) -> Option<f64> {
        self.ratio
    }

    /// EMA of the measured bytes/s, None before any sample.
    pub fn bytes_per_s(&self) -> Option<f64> {
        self.bytes_per_s
    }

    /// Timed runs so far.
    pub fn num_samples(&self) -> u64 {
        self.num_samples
    }
}

/// Per-layer counters, cumulative since construction or [`Planner::reset_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerCounters {
    /// Layer steps planned.
    pub steps: u64,
    /// Distinct experts found resident.
    pub hits: u64,
    /// Experts copied into a slot.
    pub fills: u64,
    /// Experts run on the CPU.
    pub cpu_runs: u64,
    /// Fills that evicted a resident expert.
    pub evictions: u64,
    /// Bytes copied host -> device by fills.
    pub bytes_h2d: u64,
    /// Expert weight bytes read by CPU runs.
    pub bytes_cpu: u64,
}

/// The plan of one layer step. Expert ids are those of the plan's layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// Resident experts, ascending.
    pub hit_experts: Vec<i32>,
    /// Their slots.
    pub hit_slots: Vec<i32>,
    /// Experts to copy into a slot, ascending.
    pub fill_experts: Vec<i32>,
    /// The slot each fill goes to.
    pub fill_slots: Vec<i32>,
    /// Pool layer of the expert evicted by each fill, -1 when the slot was free.
    pub victim_layers: Vec<i32>,
    /// Expert evicted by each fill, -1 when the slot was free.
    pub victim_experts: Vec<i32>,
    /// Experts to run on the CPU, ascending.
    pub cpu_experts: Vec<i32>,
    /// `[B, k]` row-major: the slot of each routed pick, -1 where the expert runs on the CPU.
    pub topk_slots: Vec<i32>,
    /// Share of miss bytes sent to the CPU (0 for offload, 1 for cpu).
    pub q: f64,
}

/// Construction parameters of a [`Planner`].
#[derive(Debug, Clone)]
pub struct PlannerConfig {
    /// Pool layers.
    pub num_layers: usize,
    /// Experts per layer.
    pub num_experts: usize,
    /// Bytes of one expert (`ExpertPool::expert_nbytes`).
    pub expert_nbytes: usize,
    /// Slots in the GPU expert cache.
    pub capacity: usize,
    /// Replacement policy name (`lru`, `layer_lru`).
    pub policy: String,
    /// Bandwidths; required by the `hybrid` backend.
    pub profile: Option<BandwidthProfile>,
    /// `w` in the q* formula: weight of the future-hit credit of a fill (>= 0).
    pub reuse_weight: f64,
    /// Per-layer-step decay of the reuse average `p_e`, in `[0, 1)`.
    pub reuse_decay: f64,
}

/// Decides hits, fills and CPU runs per layer step. Not thread-safe by itself (the bindings
/// hold it behind a mutex).
pub struct Planner {
    cfg: PlannerConfig,
    slots: SlotMap,
    counters: Vec<LayerCounters>,
    /// Per flat key: reuse average `p_e` as of `reuse_step`.
    reuse: Vec<f32>,
    reuse_step: Vec<u32>,
    /// Per layer: its step count (the clock of `reuse`).
    layer_step: Vec<u32>,
    /// Scratch: per expert, tokens routed in this step (0 = not routed).
    tokens: Vec<u32>,
    distinct: Vec<u32>,
    misses: Vec<(f32, u32, u32)>,
    /// Scratch: per expert, slot (or -1 for CPU) in this step.
    dest: Vec<i32>,
    /// Measured host -> device fill bandwidth.
    pcie_bw: BandwidthTracker,
    /// Measured CPU expert throughput.
    cpu_bw: BandwidthTracker,
}

impl Planner {
    /// A planner with an empty expert cache.
    pub fn new(cfg: PlannerConfig) -> Result<Self, PlanError> {
        if !(0.0..1.0).contains(&cfg.reuse_decay)
            || cfg.reuse_weight.is_nan()
            || cfg.reuse_weight < 0.0
            || cfg.expert_nbytes == 0
        {
            return Err(PlanError::Invalid(format!(
                "reuse_decay must be in [0, 1) (got {}), reuse_weight >= 0 (got {}), expert_nbytes > 0 (got {})",
                cfg.reuse_decay, cfg.reuse_weight, cfg.expert_nbytes
            )));
        }
        let policy: Box<dyn Policy> = policy_by_name(&cfg.policy, cfg.capacity, cfg.num_layers)?;
        let slots = SlotMap::new(cfg.capacity, cfg.num_layers, cfg.num_experts, policy)?;
        let keys = cfg.num_layers * cfg.num_experts;
        Ok(Self {
            counters: vec![LayerCounters::default(); cfg.num_layers],
            reuse: vec![0.0; keys],
            reuse_step: vec![0; keys],
            layer_step: vec![0; cfg.num_layers],
            tokens: vec![0; cfg.num_experts],
            distinct: Vec::with_capacity(cfg.num_experts),
            misses: Vec::with_capacity(cfg.num_experts),
            dest: vec![-1; cfg.num_experts],
            pcie_bw: BandwidthTracker::default(),
            cpu_bw: BandwidthTracker::default(),
            slots,
            cfg,
        })
    }

    /// The slot map (read-only).
    pub fn slots(&self) -> &SlotMap {
        &self.slots
    }

    /// The configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    /// Replaces the bandwidth profile; the refinement starts over against it.
    pub fn set_profile(&mut self, profile: Option<BandwidthProfile>) {
        self.cfg.profile = profile;
        self.pcie_bw = BandwidthTracker::default();
        self.cpu_bw = BandwidthTracker::default();
    }

    /// Books one layer step's timed fills: `nbytes` copied host -> device in `seconds` of copy
    /// engine time (`samples` layer steps summed).
    pub fn record_fills(&mut self, nbytes: usize, seconds: f64, samples: u32) {
        let profiled = self.cfg.profile.as_ref().map(|p| p.pcie_bytes_per_s);
        self.pcie_bw.add(nbytes as f64, seconds, profiled, samples);
    }

    /// Books one layer step's CPU experts: `nbytes` of expert weights read in `seconds` at
    /// `batch` tokens per expert (`samples` layer steps summed).
    pub fn record_cpu(&mut self, nbytes: usize, seconds: f64, batch: f64, samples: u32) {
        let profiled = self.cfg.profile.as_ref().map(|p| p.cpu_at(batch));
        self.cpu_bw.add(nbytes as f64, seconds, profiled, samples);
    }

    /// The measured bandwidths: (PCIe fills, CPU experts).
    pub fn bandwidth(&self) -> (&BandwidthTracker, &BandwidthTracker) {
        (&self.pcie_bw, &self.cpu_bw)
    }

    /// The profile as measured so far: each path's profile scaled by its bounded ratio (the
    /// profile itself before any sample); None without a profile. q* uses this.
    pub fn refined_profile(&self) -> Option<BandwidthProfile> {
        let p = self.cfg.profile.as_ref()?;
        let (sp, sc) = (self.pcie_bw.scale(), self.cpu_bw.scale());
        Some(BandwidthProfile {
            pcie_bytes_per_s: p.pcie_bytes_per_s * sp,
            cpu_bytes_per_s: p
                .cpu_bytes_per_s
                .iter()
                .map(|&(b, v)| (b, v * sc))
                .collect(),
        })
    }

    /// q* of the refined profile at `batch` tokens per expert with reuse credit `reuse_credit`
    /// (see the module doc); None without a profile.
    pub fn q_star(&self, batch: f64, reuse_credit: f64) -> Option<f64> {
        let p = self.cfg.profile.as_ref()?;
        let c = p.cpu_at(batch) * self.cpu_bw.scale();
        let pcie = p.pcie_bytes_per_s * self.pcie_bw.scale();
        Some(c / (c + pcie * (1.0 + reuse_credit.max(0.0))))
    }

    /// Per-layer counters.
    pub fn counters(&self) -> &[LayerCounters] {
        &self.counters
    }

    /// Zeroes the counters.
    pub fn reset_stats(&mut self) {
        self.counters
            .iter_mut()
            .for_each(|c| *c = LayerCounters::default());
    }

    /// Resizes the expert cache at a safe point; see [`SlotMap::resize`].
    pub fn resize(&mut self, capacity: usize) -> Result<Vec<crate::cache::Relocation>, PlanError> {
        self.cfg.capacity = capacity;
        Ok(self.slots.resize(capacity)?)
    }

    /// Current reuse estimate `p_e` of `(layer, expert)` (both checked by the caller).
    fn reuse_now(&self, flat: usize, now: u32) -> f32 {
        let age = now.saturating_sub(self.reuse_step[flat]);
        self.reuse[flat] * (self.cfg.reuse_decay as f32).powi(age as i32)
    }

    /// Plans one layer step. `topk_ids` is `[batch, k]` row-major (any integer type fitting i64).
    pub fn plan(
        &mut self,
        layer: i64,
        topk_ids: &[i64],
        k: usize,
        backend: Backend,
    ) -> Result<Plan, PlanError> {
        let (nl, ne) = (self.cfg.num_layers, self.cfg.num_experts);
        if layer < 0 || layer as usize >= nl {
            return Err(PlanError::Index(format!(
                "layer {layer} out of range: the planner covers {nl} pool layers"
            )));
        }
        if k == 0 || topk_ids.is_empty() || !topk_ids.len().is_multiple_of(k) {
            return Err(PlanError::Invalid(format!(
                "topk_ids has {} entries, not a multiple of k = {k}",
                topk_ids.len()
            )));
        }
        if let Some(&bad) = topk_ids.iter().find(|&&e| e < 0 || e as usize >= ne) {
            return Err(PlanError::Index(format!(
                "expert id {bad} out of range 0..{ne} in topk_ids"
            )));
        }
        if backend == Backend::Hybrid && self.cfg.profile.is_none() {
            return Err(PlanError::Invalid("the hybrid backend needs a bandwidth profile (Planner(profile=...) or set_profile)".into()));
        }
        let l = layer as usize;
        self.slots.unpin_all();
        // Distinct experts and their token counts.
        self.distinct.clear();
        for &e in topk_ids {
            let e = e as usize;
            if self.tokens[e] == 0 {
                self.distinct.push(e as u32);
            }
            self.tokens[e] += 1;
        }
        self.distinct.sort_unstable();
        let now = self.layer_step[l] + 1;
        self.layer_step[l] = now;

        let mut plan = Plan::default();
        self.misses.clear();
        for i in 0..self.distinct.len() {
            let e = self.distinct[i] as usize;
            let flat = l * ne + e;
            match self.slots.touch_flat(flat) {
                Some(s) => {
                    plan.hit_experts.push(e as i32);
                    plan.hit_slots.push(s as i32);
                    self.dest[e] = s as i32;
                }
                None => {
                    let p = self.reuse_now(flat, now);
                    self.misses.push((p, self.tokens[e], e as u32));
                }
            }
        }
        // How many misses go to the CPU.
        let n = self.misses.len();
        let n_cpu = match backend {
            Backend::Offload => {
                plan.q = 0.0;
                0
            }
            Backend::Cpu => {
                plan.q = 1.0;
                n
            }
            Backend::Hybrid if n == 0 => 0,
            Backend::Hybrid => {
                let mean_tokens = self.misses.iter().map(|m| m.1 as f64).sum::<f64>() / n as f64;
                let mean_p = self.misses.iter().map(|m| m.0 as f64).sum::<f64>() / n as f64;
                let credit = self.cfg.reuse_weight * mean_p;
                plan.q = self.q_star(mean_tokens, credit).unwrap_or(1.0);
                ((plan.q * (n + 1) as f64).floor() as usize).min(n)
            }
        };
        if n_cpu > 0 && n_cpu < n {
            // Lowest reuse first, then fewest tokens, then id (deterministic).
            self.misses.sort_unstable_by(|a, b| {
                a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2))
            });
        }
        let c = &mut self.counters[l];
        let s_bytes = self.cfg.expert_nbytes as u64;
        for (j, &(_, _, e)) in self.misses.iter().enumerate() {
            let e = e as usize;
            let mut to_cpu = j < n_cpu;
            if !to_cpu {
                match self.slots.insert_flat(l * ne + e) {
                    Ok((slot, victim)) => {
                        plan.fill_experts.push(e as i32);
                        plan.fill_slots.push(slot as i32);
                        plan.victim_layers
                            .push(victim.map_or(-1, |v| v.layer as i32));
                        plan.victim_experts
                            .push(victim.map_or(-1, |v| v.expert as i32));
                        self.dest[e] = slot as i32;
                        c.fills += 1;
                        c.bytes_h2d += s_bytes;
                        c.evictions += u64::from(victim.is_some());
                    }
                    Err(crate::error::CacheError::AllPinned { .. }) => to_cpu = true,
                    Err(other) => return Err(other.into()),
                }
            }
            if to_cpu {
                plan.cpu_experts.push(e as i32);
                self.dest[e] = -1;
                c.cpu_runs += 1;
                c.bytes_cpu += s_bytes;
            }
        }
        c.hits += plan.hit_experts.len() as u64;
        c.steps += 1;
        if !plan.cpu_experts.is_empty() && !plan.fill_experts.is_empty() {
            // keep fills (and their parallel arrays) ascending by expert
            let mut idx: Vec<usize> = (0..plan.fill_experts.len()).collect();
            idx.sort_unstable_by_key(|&i| plan.fill_experts[i]);
            let perm = |v: &Vec<i32>| idx.iter().map(|&i| v[i]).collect::<Vec<i32>>();
            plan.fill_experts = perm(&plan.fill_experts);
            plan.fill_slots = perm(&plan.fill_slots);
            plan.victim_layers = perm(&plan.victim_layers);
            plan.victim_experts = perm(&plan.victim_experts);
        }
        plan.cpu_experts.sort_unstable();
        plan.topk_slots = topk_ids.iter().map(|&e| self.dest[e as usize]).collect();
        // Reuse averages of this layer: p <- p·d^age + (1-d) for the used experts.
        let d = self.cfg.reuse_decay as f32;
        for i in 0..self.distinct.len() {
            let e = self.distinct[i] as usize;
            let flat = l * ne + e;
            self.reuse[flat] = self.reuse_now(flat, now) + (1.0 - d);
            self.reuse_step[flat] = now;
            self.tokens[e] = 0;
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planner(capacity: usize, profile: Option<BandwidthProfile>) -> Planner {
        Planner::new(PlannerConfig {
            num_layers: 2,
            num_experts: 8,
            expert_nbytes: 1000,
            capacity,
            policy: "lru".into(),
            profile,
            reuse_weight: 0.0,
            reuse_decay: 0.9,
        })
        .unwrap()
    }

    #[test]
    fn offload_fills_then_hits() {
        let mut p = planner(4, None);
        let plan = p.plan(0, &[1, 2, 2, 3], 2, Backend::Offload).unwrap();
        assert_eq!(plan.fill_experts, vec![1, 2, 3]);
        assert_eq!(plan.fill_slots, vec![0, 1, 2]);
        assert_eq!(plan.topk_slots, vec![0, 1, 1, 2]);
        let plan = p.plan(0, &[3, 4], 2, Backend::Offload).unwrap();
        assert_eq!((plan.hit_experts, plan.hit_slots), (vec![3], vec![2]));
        assert_eq!(plan.fill_experts, vec![4]);
        let plan = p.plan(1, &[0, 5], 2, Backend::Offload).unwrap();
        // Cache full (1,2,3,4 resident); victims are LRU: expert 1 then 2 of layer 0.
        assert_eq!(plan.victim_layers, vec![0, 0]);
        assert_eq!(plan.victim_experts, vec![1, 2]);
        let c = p.counters()[0];
        assert_eq!((c.hits, c.fills, c.bytes_h2d), (1, 4, 4000));
        assert!(p.plan(2, &[0, 1], 2, Backend::Offload).is_err());
        assert!(p.plan(0, &[0, 8], 2, Backend::Offload).is_err());
        assert!(p.plan(0, &[0, 1, 2], 2, Backend::Offload).is_err());
        assert!(p.plan(0, &[0, 1], 2, Backend::Hybrid).is_err());
    }

    #[test]
    fn cpu_and_pinned_overflow() {
        let mut p = planner(2, None);
        let plan = p.plan(0, &[1, 2, 3, 4], 4, Backend::Offload).unwrap();
        // Only two slots: the other two misses run on the CPU.
        assert_eq!(plan.fill_experts.len(), 2);
        assert_eq!(plan.cpu_experts.len(), 2);
        assert_eq!(plan.topk_slots.iter().filter(|&&s| s < 0).count(), 2);
        let plan = p.plan(1, &[1, 2], 2, Backend::Cpu).unwrap();
        assert_eq!(plan.cpu_experts, vec![1, 2]);
        assert!(plan.fill_experts.is_empty());
    }

    #[test]
    fn hybrid_splits_by_q_star() {
        // B_cpu = B_pcie: q* = 1/2.
        let prof = BandwidthProfile::new(1e9, vec![(1.0, 1e9), (16.0, 4e9)]).unwrap();
        assert!((prof.q(1.0, 0.0) - 0.5).abs() < 1e-12);
        assert!((prof.cpu_at(8.5) - 2.5e9).abs() < 1.0);
        assert!((prof.cpu_at(0.5) - 1e9).abs() < 1.0);
        assert!((prof.cpu_at(64.0) - 1e9).abs() < 1.0); // compute-bound: 4e9 * 16 / 64
        let mut p = planner(16, Some(prof));
        let plan = p
            .plan(0, &[0, 1, 2, 3, 4, 5, 6, 7], 8, Backend::Hybrid)
            .unwrap();
        assert_eq!(plan.cpu_experts.len(), 4);
        assert_eq!(plan.fill_experts.len(), 4);
        assert!((plan.q - 0.5).abs() < 1e-12);
        assert!(BandwidthProfile::new(0.0, vec![(1.0, 1.0)]).is_err());
    }

    #[test]
    fn hybrid_split_minimises_the_slower_path() {
        // An expert takes t_c on the CPU and t_p over PCIe; for every miss count the planner's k
        // (misses on the CPU) gives the least max(k·t_c, (n-k)·t_p) of any integer split.
        for (cpu, pcie) in [(71e9, 44e9), (1e9, 1e9), (1e9, 3e9), (90e9, 20e9)] {
            let prof = BandwidthProfile::new(pcie, vec![(1.0, cpu)]).unwrap();
            let (t_c, t_p) = (1.0 / cpu, 1.0 / pcie);
            for n in 1..=8usize {
                let mut p = planner(16, Some(prof.clone()));
                let ids: Vec<i64> = (0..n as i64).collect();
                let plan = p.plan(0, &ids, n, Backend::Hybrid).unwrap();
                let span = |k: usize| (k as f64 * t_c).max((n - k) as f64 * t_p);
                let k = plan.cpu_experts.len();
                let best = (0..=n).map(span).fold(f64::INFINITY, f64::min);
                assert!(span(k) <= best * (1.0 + 1e-9), "{cpu}/{pcie}, n={n}: k={k}");
                assert_eq!(plan.fill_experts.len(), n - k);
            }
        }
    }

    #[test]
    fn refinement_scales_the_profile_within_bounds() {
        let prof = BandwidthProfile::new(10e9, vec![(1.0, 10e9), (16.0, 40e9)]).unwrap();
        let mut p = planner(16, Some(prof));
        assert!((p.q_star(1.0, 0.0).unwrap() - 0.5).abs() < 1e-12);
        // CPU at twice its profile (25 GB/s interpolated at 8.5): the first sample sets the EMA.
        p.record_cpu(50_000_000_000, 1.0, 8.5, 1);
        assert!((p.bandwidth().1.ratio().unwrap() - 2.0).abs() < 1e-9);
        let r = p.refined_profile().unwrap();
        assert_eq!(r.cpu_bytes_per_s, vec![(1.0, 20e9), (16.0, 80e9)]);
        assert!((p.q_star(1.0, 0.0).unwrap() - 2.0 / 3.0).abs() < 1e-12);
        // A later sample moves it by alpha; many samples at once by 1 - (1 - alpha)^n.
        p.record_cpu(25_000_000_000, 1.0, 8.5, 1);
        let want = 2.0 + REFINE_ALPHA * (1.0 - 2.0);
        assert!((p.bandwidth().1.ratio().unwrap() - want).abs() < 1e-9);
        // PCIe a hundred times slower: bounded to MIN_RATIO.
        p.record_fills(1_000_000, 1e-2 * 100.0, 1);
        assert_eq!(
            p.refined_profile().unwrap().pcie_bytes_per_s,
            10e9 * MIN_RATIO
        );
        assert_eq!(p.bandwidth().0.num_samples(), 1);
        // Without a profile only the absolute EMA moves.
        let mut bare = planner(4, None);
        bare.record_fills(1000, 1e-6, 3);
        assert_eq!(bare.bandwidth().0.bytes_per_s(), Some(1e9));
        assert_eq!(bare.bandwidth().0.ratio(), None);
        assert!(bare.refined_profile().is_none() && bare.q_star(1.0, 0.0).is_none());
        bare.record_fills(0, 1.0, 1); // ignored
        assert_eq!(bare.bandwidth().0.num_samples(), 3);
    }

    #[test]
    fn reuse_credit_favours_fills() {
        let prof = BandwidthProfile::new(1e9, vec![(1.0, 1e9)]).unwrap();
        let mk = |w: f64| {
            let mut p = planner(2, Some(prof.clone()));
            p.cfg.reuse_weight = w;
            p
        };
        // With reuse credit, an expert seen often is filled rather than run on the CPU.
        let mut p = mk(4.0);
        for _ in 0..20 {
            p.plan(0, &[1, 2], 2, Backend::Cpu).unwrap();
        }
        let plan = p.plan(0, &[1, 2], 2, Backend::Hybrid).unwrap();
        assert!(plan.q < 0.5, "{}", plan.q);
        assert_eq!(plan.fill_experts.len(), 2);
    }
}
