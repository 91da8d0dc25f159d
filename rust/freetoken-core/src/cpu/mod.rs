//! CPU expert kernels: SwiGLU forward of the experts a plan sends to the host.
//!
//! Owns: [`CpuExperts`] (kernel choice: AMX, AVX-512-BF16, AVX2 or scalar, see [`kernels`]; the persistent [`workers::WorkerPool`], the per-call
//! scratch) and the GEMV kernels ([`kernels`]). Not: routing decisions (the planner), the
//! pinned output buffer (the caller provides it).
//!
//! For expert `e` and the tokens routed to it, with `x [n, H]`:
//! ```text
//! g = x · gate_upᵀ[0..I]   u = x · gate_upᵀ[I..2I]   a = silu(g) ⊙ u   y = a · downᵀ   [n, H]
//! out[token] += routing_weight · y
//! ```
//! Work split: phase 1 cuts each expert's `I` rows (gate and up together, then the activation)
//! into chunks; phase 2 cuts its `H` down rows; a phase-2 chunk of expert `e` starts when every
//! phase-1 chunk of `e` is done. All chunks of a call are claimed from one atomic counter by the
//! worker threads and the caller; phase-1 chunks come first, so a phase-2 wait is always on
//! chunks already running. The weighted sum into `out` is done by the caller afterwards.
pub mod kernels;
pub mod workers;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::bf16::{bf16_to_f32, f32_to_bf16};
use crate::error::KernelError;
use crate::pool::ExpertPool;
pub use kernels::{Act, Isa};
use workers::WorkerPool;

/// Hidden states `[B, H]` row-major.
#[derive(Clone, Copy)]
pub enum Hidden<'a> {
    /// fp32.
    F32(&'a [f32]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
}

impl Hidden<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::Bf16(x) => x.len(),
        }
    }
    fn get(&self, i: usize) -> f32 {
        match self {
            Self::F32(x) => x[i],
            Self::Bf16(x) => bf16_to_f32(x[i]),
        }
    }
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: only used for buffers whose disjoint regions are written by distinct tasks, read after
// the writers' Release/Acquire handshake.
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// The pointer (a method, so closures capture the Sync wrapper, not the raw field).
    #[inline]
    fn ptr(&self) -> *mut T {
        self.0
    }
}

/// Runs routed experts on the host with a persistent worker pool.
pub struct CpuExperts {
    pool: Arc<ExpertPool>,
    workers: WorkerPool,
    isa: Isa,
}

/// One unit of work.
#[derive(Clone, Copy)]
struct Task {
    /// 0: gate/up + activation rows `r0..r1` of `I`; 1: down rows `r0..r1` of `H`.
    phase: u8,
    /// Index into the call's expert list.
    e: u32,
    r0: u32,
    r1: u32,
}

impl CpuExperts {
    /// Starts `num_threads` participants (default: one per allowed CPU) using `isa` (default:
    /// the fastest this CPU supports).
    pub fn new(
        pool: Arc<ExpertPool>,
        num_threads: Option<usize>,
        isa: Option<Isa>,
    ) -> Result<Self, KernelError> {
        let isa = isa.unwrap_or_else(Isa::detect);
        if !isa.supported() {
            return Err(KernelError::Invalid(format!(
                "kernel path {} is not supported by this CPU; supported: {:?}",
                isa.name(),
                Isa::all_supported()
                    .iter()
                    .map(|i| i.name())
                    .collect::<Vec<_>>()
            )));
        }
        if num_threads == Some(0) {
            return Err(KernelError::Invalid("num_threads must be positive".into()));
        }
        Ok(Self {
            pool,
            workers: WorkerPool::new(num_threads),
            isa,
        })
    }

    /// The kernel path in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Threads taking part in a call (workers + the caller).
    pub fn num_threads(&self) -> usize {
        self.workers.num_threads()
    }

    /// The pool the experts are read from.
    pub fn pool(&self) -> &Arc<ExpertPool> {
        &self.pool
    }

    /// Adds `Σ_e w[t,e] · SwiGLU_e(hidden[t])` into `out[t]` over the listed `experts` of pool
    /// layer `layer`, for each token `t` routed to `e` in `topk_ids`.
    ///
    /// Shapes: `hidden [B, H]`, `topk_ids [B, k]`, `topk_weights [B, k]` (fp32), `out [B, H]`
    /// fp32 (accumulated in place, not zeroed). Experts listed but routed to no token are skipped.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        layer: i64,
        hidden: Hidden<'_>,
        topk_ids: &[i64],
        topk_weights: &[f32],
        k: usize,
        experts: &[i64],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let (h, i_sz, ne) = (
            self.pool.hidden_size(),
            self.pool.intermediate_size(),
            self.pool.num_experts(),
        );
        let l = self.pool.check(layer, 0)?.0;
        if !out.len().is_multiple_of(h) || out.is_empty() {
            return Err(KernelError::Invalid(format!(
                "out has {} elements, not a positive multiple of hidden_size {h}",
                out.len()
            )));
        }
        let b = out.len() / h;
        if hidden.len() != b * h {
            return Err(KernelError::Invalid(format!(
                "hidden has {} elements, expected [B={b}, H={h}] = {}",
                hidden.len(),
                b * h
            )));
        }
        if k == 0 || topk_ids.len() != b * k || topk_weights.len() != b * k {
            return Err(KernelError::Invalid(format!(
                "topk_ids ({}) and topk_weights ({}) must both be [B={b}, k={k}]",
                topk_ids.len(),
                topk_weights.len()
            )));
        }
        // Tokens of each listed expert.
        let mut seen = vec![false; ne];
        let mut list: Vec<(usize, Vec<(usize, f32)>)> = Vec::with_capacity(experts.len());
        for &e in experts {
            let (_, eu) = self.pool.check(layer, e)?;
            if std::mem::replace(&mut seen[eu], true) {
                return Err(KernelError::Invalid(format!(
                    "expert {e} listed twice in experts"
                )));
            }
            let toks: Vec<(usize, f32)> = (0..b * k)
                .filter(|&j| topk_ids[j] == e)
                .map(|j| (j / k, topk_weights[j]))
                .collect();
            if !toks.is_empty() {
                list.push((eu, toks));
            }
        }
        if list.is_empty() {
            return Ok(());
        }
        // Scratch: gathered inputs, activations, outputs, per expert at these offsets (in tokens).
        let mut tok_off = Vec::with_capacity(list.len() + 1);
        tok_off.push(0usize);
        for (_, t) in &list {
            tok_off.push(tok_off.last().copied().unwrap_or(0) + t.len());
        }
        let n_all = *tok_off.last().unwrap_or(&0);
        let bf = self.isa.wants_bf16();
        let mut x_f32 = vec![0f32; if bf { 0 } else { n_all * h }];
        let mut x_bf = vec![0u16; if bf { n_all * h } else { 0 }];
        for (li, (_, toks)) in list.iter().enumerate() {
            for (j, &(t, _)) in toks.iter().enumerate() {
                let dst = (tok_off[li] + j) * h;
                for c in 0..h {
                    let v = hidden.get(t * h + c);
                    if bf {
                        x_bf[dst + c] = f32_to_bf16(v);
                    } else {
                        x_f32[dst + c] = v;
                    }
                }
            }
        }
        let mut a_f32 = vec![0f32; if bf { 0 } else { n_all * i_sz }];
        let mut a_bf = vec![0u16; if bf { n_all * i_sz } else { 0 }];
        let mut y = vec![0f32; n_all * h];

        // Tasks: ~2 chunks per thread per phase, rows a multiple of 16 (an AMX tile).
        let nt = self.num_threads();
        let chunks = |rows: usize| -> usize {
            let per_expert = (2 * nt).div_ceil(list.len()).max(1);
            rows.div_ceil(per_expert).next_multiple_of(16).max(16)
        };
        let (c1, c2) = (chunks(i_sz), chunks(h));
        let mut tasks = Vec::new();
        let mut left1 = Vec::with_capacity(list.len());
        for phase in 0..2u8 {
            let (rows, c) = if phase == 0 { (i_sz, c1) } else { (h, c2) };
            for e in 0..list.len() {
                let mut n = 0;
                for r0 in (0..rows).step_by(c) {
                    tasks.push(Task {
                        phase,
                        e: e as u32,
                        r0: r0 as u32,
                        r1: (r0 + c).min(rows) as u32,
                    });
                    n += 1;
                }
                if phase == 0 {
                    left1.push(AtomicUsize::new(n));
                }
            }
        }
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let (px_f, px_b) = (SyncPtr(x_f32.as_mut_ptr()), SyncPtr(x_bf.as_mut_ptr()));
        let (pa_f, pa_b, py) = (
            SyncPtr(a_f32.as_mut_ptr()),
            SyncPtr(a_bf.as_mut_ptr()),
            SyncPtr(y.as_mut_ptr()),
        );
        let (x_len, a_len, y_len) = (n_all * h, n_all * i_sz, n_all * h);
        let isa = self.isa;
        let pool = &*self.pool;
        let job = || {
            let mut g = Vec::new();
            let mut u = Vec::new();
            loop {
                // ORDERING: a work counter; data dependencies use `left1` below.
                let ti = next.fetch_add(1, Ordering::Relaxed);
                if ti >= tasks.len() || failed.load(Ordering::Relaxed) {
                    break;
                }
                let t = tasks[ti];
                let (e, r0, r1) = (t.e as usize, t.r0 as usize, t.r1 as usize);
                let (eu, n) = (list[e].0, list[e].1.len());
                let w = pool.expert_unchecked(l, eu);
                let off = tok_off[e];
                if t.phase == 0 {
                    let rows = r1 - r0;
                    g.clear();
                    g.resize(n * rows, 0.0);
                    u.clear();
                    u.resize(n * rows, 0.0);
                    // SAFETY: x is only read during the job; its length is x_len.
                    let act = unsafe {
                        if bf {
                            Act::Bf16(
                                &std::slice::from_raw_parts(px_b.ptr(), x_len)
                                    [off * h..(off + n) * h],
                            )
                        } else {
                            Act::F32(
                                &std::slice::from_raw_parts(px_f.ptr(), x_len)
                                    [off * h..(off + n) * h],
                            )
                        }
                    };
                    kernels::gemv(isa, w.gate_up, h, r0, r1, act, n, &mut g, rows);
                    kernels::gemv(
                        isa,
                        w.gate_up,
                        h,
                        i_sz + r0,
                        i_sz + r1,
                        act,
                        n,
                        &mut u,
                        rows,
                    );
                    for tok in 0..n {
                        for r in 0..rows {
                            let gv = g[tok * rows + r];
                            let v = gv / (1.0 + (-gv).exp()) * u[tok * rows + r];
                            let idx = (off + tok) * i_sz + r0 + r;
                            debug_assert!(idx < a_len);
                            // SAFETY: element (tok, r0 + r) of expert e's activations is written
                            // by this task only (chunks partition 0..I).
                            unsafe {
                                if bf {
                                    *pa_b.ptr().add(idx) = f32_to_bf16(v);
                                } else {
                                    *pa_f.ptr().add(idx) = v;
                                }
                            }
                        }
                    }
                    // ORDERING: Release publishes this chunk's activations to phase-2 readers.
                    left1[e].fetch_sub(1, Ordering::Release);
                } else {
                    // ORDERING: Acquire pairs with the phase-1 Release decrements of expert e.
                    while left1[e].load(Ordering::Acquire) != 0 {
                        if failed.load(Ordering::Relaxed) {
                            return;
                        }
                        std::hint::spin_loop();
                    }
                    // SAFETY: every phase-1 chunk of e is done (Acquire above); the activations
                    // of e are no longer written.
                    let act = unsafe {
                        if bf {
                            Act::Bf16(
                                &std::slice::from_raw_parts(pa_b.ptr(), a_len)
                                    [off * i_sz..(off + n) * i_sz],
                            )
                        } else {
                            Act::F32(
                                &std::slice::from_raw_parts(pa_f.ptr(), a_len)
                                    [off * i_sz..(off + n) * i_sz],
                            )
                        }
                    };
                    debug_assert!((off + n) * h <= y_len);
                    // SAFETY: this task alone writes columns r0..r1 of expert e's rows of y;
                    // gemv writes out[tok * h + (r - r0)] for r in r0..r1, tok < n only.
                    let out_e = unsafe {
                        std::slice::from_raw_parts_mut(py.ptr().add(off * h + r0), n * h - r0)
                    };
                    kernels::gemv(isa, w.down, i_sz, r0, r1, act, n, out_e, h);
                }
            }
        };
        let guarded = || {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                failed.store(true, Ordering::Relaxed);
            }
        };
        if !self.workers.run(&guarded) || failed.load(Ordering::Relaxed) {
            return Err(KernelError::Worker(
                "a task panicked; out is unchanged".into(),
            ));
        }
        // Weighted sum into out.
        for (li, (_, toks)) in list.iter().enumerate() {
            for (j, &(t, wgt)) in toks.iter().enumerate() {
                let src = &y[(tok_off[li] + j) * h..(tok_off[li] + j + 1) * h];
                for (o, s) in out[t * h..(t + 1) * h].iter_mut().zip(src) {
                    *o += wgt * s;
                }
            }
        }
        Ok(())
    }
}

/// Reference SwiGLU of one expert for one token, fp32 everywhere (for tests): `y [H]`.
pub fn reference_expert(pool: &ExpertPool, layer: usize, expert: usize, x: &[f32]) -> Vec<f32> {
    let (h, i) = (pool.hidden_size(), pool.intermediate_size());
    let w = pool.expert_unchecked(layer, expert);
    let dot = |row: &[u16], v: &[f32]| {
        row.iter()
            .zip(v)
            .map(|(&a, &b)| bf16_to_f32(a) * b)
            .sum::<f32>()
    };
    let a: Vec<f32> = (0..i)
        .map(|r| {
            let g = dot(&w.gate_up[r * h..(r + 1) * h], x);
            let u = dot(&w.gate_up[(i + r) * h..(i + r + 1) * h], x);
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    (0..h)
        .map(|r| dot(&w.down[r * i..(r + 1) * i], &a))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{PoolShape, SplitMix64};

    #[test]
    fn forward_matches_reference_on_every_path() {
        let shape = PoolShape {
            moe_layers: vec![0, 2],
            num_experts: 6,
            hidden_size: 67,
            intermediate_size: 33,
        };
        let pool = Arc::new(ExpertPool::random(shape, 1, None).unwrap());
        let (h, b, k) = (67, 5, 2);
        let mut rng = SplitMix64::new(9);
        let x: Vec<f32> = (0..b * h)
            .map(|_| rng.next_f64() as f32 * 2.0 - 1.0)
            .collect();
        let ids: Vec<i64> = vec![0, 1, 1, 2, 3, 0, 5, 1, 0, 4];
        let wts: Vec<f32> = (0..b * k).map(|j| 0.25 + j as f32 * 0.05).collect();
        let experts = [0i64, 1, 5, 3];
        // Reference.
        let mut want = vec![0.5f32; b * h];
        for t in 0..b {
            for j in 0..k {
                let e = ids[t * k + j];
                if experts.contains(&e) {
                    let y = reference_expert(&pool, 1, e as usize, &x[t * h..(t + 1) * h]);
                    for c in 0..h {
                        want[t * h + c] += wts[t * k + j] * y[c];
                    }
                }
            }
        }
        let scale = want.iter().map(|v| (v - 0.5).abs()).fold(0.0, f32::max);
        for isa in Isa::all_supported() {
            for threads in [1, 3] {
                let cpu = CpuExperts::new(pool.clone(), Some(threads), Some(isa)).unwrap();
                let mut out = vec![0.5f32; b * h];
                cpu.forward(1, Hidden::F32(&x), &ids, &wts, k, &experts, &mut out)
                    .unwrap();
                let err = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                let tol = if isa.wants_bf16() { 2e-2 } else { 1e-4 };
                assert!(
                    err <= tol * scale,
                    "{isa:?} x{threads}: max err {err} vs scale {scale}"
                );
            }
        }
        let cpu = CpuExperts::new(pool.clone(), Some(2), None).unwrap();
        let mut out = vec![0.0f32; b * h];
        assert!(cpu
            .forward(2, Hidden::F32(&x), &ids, &wts, k, &experts, &mut out)
            .is_err());
        assert!(cpu
            .forward(1, Hidden::F32(&x), &ids, &wts, k, &[6], &mut out)
            .is_err());
        assert!(cpu
            .forward(1, Hidden::F32(&x), &ids, &wts, k, &[1, 1], &mut out)
            .is_err());
        assert!(cpu
            .forward(1, Hidden::F32(&x[1..]), &ids, &wts, k, &[1], &mut out)
            .is_err());
        assert!(cpu
            .forward(1, Hidden::F32(&x), &ids[1..], &wts, k, &[1], &mut out)
            .is_err());
    }
}
