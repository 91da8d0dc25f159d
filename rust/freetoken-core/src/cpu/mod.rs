//! CPU expert kernels: SwiGLU forward of the experts a plan sends to the host.
//!
//! Quantized pools (FP8 block, NVFP4, MXFP4) take the same split with the kernels of
//! [`crate::quant::kernels`], which read the expert's bytes as stored and dequantize in registers.
//! Activations are bf16 (rounded to nearest even: the hidden states once per call, `silu(g) · u`
//! as each chunk produces it) on the paths that want them ([`Isa::wants_bf16`]) and f32 elsewhere,
//! for every format: the models run in bf16, so the hidden states that reach a GPU model's host
//! experts are bf16 values already; a float32 model on the CPU gets its expert inputs rounded on
//! those paths (its tests allow for it).
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
//! Work split, three phases of row chunks claimed from one atomic counter by the workers and
//! the caller: (0) per expert, chunks of `I` (gate and up rows, then the activation); (1) per
//! expert, chunks of `H` of the down projection into a scratch `y`, once every phase-0 chunk of
//! that expert is done; (2) chunks of `H`, `out[t] += w · y` over every expert, once phase 1 is
//! done (chunks are disjoint, so no locks). Earlier phases are claimed first, so a wait is always
//! on chunks already running. Inputs are gathered once per call into scratch buffers reused
//! across calls.
pub mod kernels;
pub mod workers;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::bf16::{bf16_to_f32, f32_to_bf16};
use crate::error::KernelError;
use crate::pool::{ExpertPool, ExpertWeights};
use crate::quant::{kernels as qkernels, ExpertFormat, QExpert};
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

/// Buffers reused across calls: gathered inputs `[n, H]` and activations `[n, I]` of the listed
/// experts' tokens (one of each pair is used, by the path's activation format).
#[derive(Default)]
struct Scratch {
    x_f32: Vec<f32>,
    x_bf: Vec<u16>,
    a_f32: Vec<f32>,
    a_bf: Vec<u16>,
    /// Expert outputs `[n, H]` before weighting.
    y: Vec<f32>,
}

/// Runs routed experts on the host with a persistent worker pool.
pub struct CpuExperts {
    pool: Arc<ExpertPool>,
    workers: WorkerPool,
    isa: Isa,
    scratch: std::sync::Mutex<Scratch>,
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

/// One listed expert's weights as the kernels read them.
// One per listed expert per call, copied into each task: 240 bytes on the stack beats a Box per expert.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy)]
enum Weights<'a> {
    /// bf16 rows (`crate::cpu::kernels`).
    Bf16(ExpertWeights<'a>),
    /// Quantized bytes with their scales (`crate::quant::kernels`).
    Quant(QExpert<'a>),
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
            scratch: Default::default(),
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
        self.forward_with(
            layer,
            hidden,
            topk_ids,
            topk_weights,
            k,
            experts,
            out,
            &mut || {},
        )
    }

    /// How long the worker threads poll for the next call before they park (see
    /// [`WorkerPool::set_idle_spin`]); 0 by default.
    pub fn set_idle_spin(&self, spin: std::time::Duration) {
        self.workers.set_idle_spin(spin)
    }

    /// The idle spin in effect.
    pub fn idle_spin(&self) -> std::time::Duration {
        self.workers.idle_spin()
    }

    /// As [`forward`](Self::forward), and the calling thread runs `alongside` once the workers
    /// have started (the decode driver queues its fills there, so they do not delay the CPU
    /// experts). `alongside` runs exactly once when the arguments are valid, also when no listed
    /// expert has tokens; not at all when they are invalid.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_with(
        &self,
        layer: i64,
        hidden: Hidden<'_>,
        topk_ids: &[i64],
        topk_weights: &[f32],
        k: usize,
        experts: &[i64],
        out: &mut [f32],
        alongside: &mut dyn FnMut(),
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
            alongside();
            return Ok(());
        }
        // Per expert, its tokens' rows in the scratch buffers start at tok_off[e].
        let mut tok_off = Vec::with_capacity(list.len() + 1);
        tok_off.push(0usize);
        for (_, t) in &list {
            tok_off.push(tok_off.last().copied().unwrap_or(0) + t.len());
        }
        let n_all = *tok_off.last().unwrap_or(&0);
        let format = self.pool.format();
        let layout = format.layout(h, i_sz);
        let weights = list
            .iter()
            .map(|&(eu, _)| {
                Ok(if format == ExpertFormat::Bf16 {
                    Weights::Bf16(self.pool.expert_unchecked(l, eu))
                } else {
                    Weights::Quant(layout.expert(self.pool.expert_bytes(l as i64, eu as i64)?)?)
                })
            })
            .collect::<Result<Vec<_>, KernelError>>()?;
        let bf = self.isa.wants_bf16();
        let mut guard = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let sc = &mut *guard;
        // Gather: convert hidden once, then copy each routed token's row per expert.
        let (xs, xe) = if bf { (0, n_all * h) } else { (n_all * h, 0) };
        sc.x_f32.resize(xs, 0.0);
        sc.x_bf.resize(xe, 0);
        sc.a_f32.resize(if bf { 0 } else { n_all * i_sz }, 0.0);
        sc.a_bf.resize(if bf { n_all * i_sz } else { 0 }, 0);
        match (hidden, bf) {
            (Hidden::Bf16(x), true) => gather(&list, &tok_off, h, x, &mut sc.x_bf),
            (Hidden::F32(x), false) => gather(&list, &tok_off, h, x, &mut sc.x_f32),
            (Hidden::F32(x), true) => {
                let xb: Vec<u16> = x.iter().map(|&v| f32_to_bf16(v)).collect();
                gather(&list, &tok_off, h, &xb, &mut sc.x_bf)
            }
            (Hidden::Bf16(x), false) => {
                let xf: Vec<f32> = x.iter().map(|&v| bf16_to_f32(v)).collect();
                gather(&list, &tok_off, h, &xf, &mut sc.x_f32)
            }
        }

        sc.y.resize(n_all * h, 0.0);

        // Phase 0: per expert, chunks of I (gate and up rows, then the activation).
        // Phase 1: per expert, chunks of H of the down projection into y (after e's phase 0).
        // Phase 2: chunks of H, out[t] += w · y over every expert (after all of phase 1).
        // About two chunks per thread per phase, rows a multiple of 16 (an AMX tile).
        let nt = self.num_threads();
        let per_expert = (2 * nt).div_ceil(list.len()).max(1);
        let chunk = |rows: usize, parts: usize| rows.div_ceil(parts).next_multiple_of(16).max(16);
        let (c0, c1, c2) = (
            chunk(i_sz, per_expert),
            chunk(h, per_expert),
            chunk(h, 2 * nt),
        );
        let mut tasks = Vec::new();
        let mut left0 = Vec::with_capacity(list.len());
        for (phase, rows, c) in [(0u8, i_sz, c0), (1, h, c1)] {
            for e in 0..list.len() {
                let before = tasks.len();
                for r0 in (0..rows).step_by(c) {
                    let r1 = (r0 + c).min(rows);
                    tasks.push(Task {
                        phase,
                        e: e as u32,
                        r0: r0 as u32,
                        r1: r1 as u32,
                    });
                }
                if phase == 0 {
                    left0.push(AtomicUsize::new(tasks.len() - before));
                }
            }
        }
        // ORDERING: no other thread runs yet; Relaxed reads of our own initial counts.
        let n0: usize = left0.iter().map(|a| a.load(Ordering::Relaxed)).sum();
        let left1 = AtomicUsize::new(tasks.len() - n0);
        for r0 in (0..h).step_by(c2) {
            tasks.push(Task {
                phase: 2,
                e: 0,
                r0: r0 as u32,
                r1: (r0 + c2).min(h) as u32,
            });
        }
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let (x_f32, x_bf) = (&sc.x_f32[..], &sc.x_bf[..]);
        let (pa_f, pa_b) = (
            SyncPtr(sc.a_f32.as_mut_ptr()),
            SyncPtr(sc.a_bf.as_mut_ptr()),
        );
        let py = SyncPtr(sc.y.as_mut_ptr());
        let (a_len, y_len) = (n_all * i_sz, n_all * h);
        let pout = SyncPtr(out.as_mut_ptr());
        let out_len = out.len();
        let isa = self.isa;
        let wait = |counter: &AtomicUsize| -> bool {
            // ORDERING: Acquire pairs with the Release decrements of the tasks waited for.
            while counter.load(Ordering::Acquire) != 0 {
                if failed.load(Ordering::Relaxed) {
                    return false;
                }
                std::hint::spin_loop();
            }
            true
        };
        let job = || {
            let (mut g, mut u) = (Vec::new(), Vec::new());
            loop {
                // ORDERING: a work counter; data dependencies use `left0`/`left1`.
                let ti = next.fetch_add(1, Ordering::Relaxed);
                if ti >= tasks.len() || failed.load(Ordering::Relaxed) {
                    break;
                }
                let t = tasks[ti];
                let (e, r0, r1) = (t.e as usize, t.r0 as usize, t.r1 as usize);
                let rows = r1 - r0;
                let (n, off) = (list[e].1.len(), tok_off[e]);
                let w = weights[e];
                match t.phase {
                    0 => {
                        g.clear();
                        g.resize(n * rows, 0.0);
                        u.clear();
                        u.resize(n * rows, 0.0);
                        let act = if bf {
                            Act::Bf16(&x_bf[off * h..(off + n) * h])
                        } else {
                            Act::F32(&x_f32[off * h..(off + n) * h])
                        };
                        match w {
                            Weights::Bf16(w) => {
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
                            }
                            Weights::Quant(q) => {
                                qkernels::gemv(isa, &q.gate, r0, r1, act, n, &mut g, rows);
                                qkernels::gemv(isa, &q.up, r0, r1, act, n, &mut u, rows);
                            }
                        }
                        for tok in 0..n {
                            for r in 0..rows {
                                let gv = g[tok * rows + r];
                                let v = gv / (1.0 + (-gv).exp()) * u[tok * rows + r];
                                let idx = (off + tok) * i_sz + r0 + r;
                                debug_assert!(idx < a_len);
                                // SAFETY: element (tok, r0 + r) of expert e's activations is
                                // written by this task only (chunks partition 0..I); idx < a_len.
                                unsafe {
                                    if bf {
                                        *pa_b.ptr().add(idx) = f32_to_bf16(v);
                                    } else {
                                        *pa_f.ptr().add(idx) = v;
                                    }
                                }
                            }
                        }
                        // ORDERING: Release publishes this chunk's activations to phase 1.
                        left0[e].fetch_sub(1, Ordering::Release);
                    }
                    1 => {
                        if !wait(&left0[e]) {
                            return;
                        }
                        // SAFETY: every phase-0 chunk of e is done (Acquire in `wait`), so its
                        // activations are no longer written; they span a_len elements.
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
                        // gemv writes y[tok * h + (r - r0)] for r in r0..r1, tok < n only.
                        let y_e = unsafe {
                            std::slice::from_raw_parts_mut(py.ptr().add(off * h + r0), n * h - r0)
                        };
                        match w {
                            Weights::Quant(q) => {
                                qkernels::gemv(isa, &q.down, r0, r1, act, n, y_e, h)
                            }
                            Weights::Bf16(w) => {
                                kernels::gemv(isa, w.down, i_sz, r0, r1, act, n, y_e, h)
                            }
                        }
                        // ORDERING: Release publishes this chunk of y to phase 2.
                        left1.fetch_sub(1, Ordering::Release);
                    }
                    _ => {
                        if !wait(&left1) {
                            return;
                        }
                        for (e, (_, toks)) in list.iter().enumerate() {
                            for (j, &(tok, wgt)) in toks.iter().enumerate() {
                                let src = (tok_off[e] + j) * h + r0;
                                debug_assert!(tok * h + r1 <= out_len && src + rows <= y_len);
                                // SAFETY: y is complete and no longer written (Acquire in
                                // `wait`); this task alone touches columns r0..r1 of `out`
                                // (chunks partition 0..H); both ranges are in bounds.
                                let (o, y) = unsafe {
                                    (
                                        std::slice::from_raw_parts_mut(
                                            pout.ptr().add(tok * h + r0),
                                            rows,
                                        ),
                                        std::slice::from_raw_parts(py.ptr().add(src), rows),
                                    )
                                };
                                for (o, y) in o.iter_mut().zip(y) {
                                    *o += wgt * y;
                                }
                            }
                        }
                    }
                }
            }
        };
        let guarded = || {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                // ORDERING: a flag only; `run` returning is the synchronisation point.
                failed.store(true, Ordering::Relaxed);
            }
        };
        // ORDERING: `run` has joined every participant (Acquire inside), so Relaxed suffices.
        if !self.workers.run_with(&guarded, alongside) || failed.load(Ordering::Relaxed) {
            return Err(KernelError::Worker(
                "a task panicked; out may be partly updated".into(),
            ));
        }
        Ok(())
    }
}

/// Copies the rows of `x` (`[B, h]`) routed to each listed expert into `dst`, expert after
/// expert, starting at row `tok_off[e]`.
fn gather<T: Copy>(
    list: &[(usize, Vec<(usize, f32)>)],
    tok_off: &[usize],
    h: usize,
    x: &[T],
    dst: &mut [T],
) {
    for (e, (_, toks)) in list.iter().enumerate() {
        for (j, &(t, _)) in toks.iter().enumerate() {
            let d = (tok_off[e] + j) * h;
            dst[d..d + h].copy_from_slice(&x[t * h..(t + 1) * h]);
        }
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
    use crate::quant::ScaleType;

    /// One `forward` call's arguments, `out` starting at `init` everywhere.
    struct Case<'a> {
        x: &'a [f32],
        ids: &'a [i64],
        wts: &'a [f32],
        k: usize,
        experts: &'a [i64],
        init: f32,
    }

    impl Case<'_> {
        /// `init + Σ w · expert(e, x_t)` over the listed experts' picks: `out [B, h]` as `forward` must give it.
        fn reference(&self, h: usize, expert: impl Fn(i64, &[f32]) -> Vec<f32>) -> Vec<f32> {
            let b = self.ids.len() / self.k;
            let mut want = vec![self.init; b * h];
            for (j, &e) in self.ids.iter().enumerate() {
                if self.experts.contains(&e) {
                    let t = j / self.k;
                    let y = expert(e, &self.x[t * h..(t + 1) * h]);
                    for c in 0..h {
                        want[t * h + c] += self.wts[j] * y[c];
                    }
                }
            }
            want
        }

        /// Every supported kernel path, 1 and 3 threads, on pool layer 1 against `want`, within `tol(isa)` of
        /// the largest change `want` makes to `init`.
        fn check_every_path(
            &self,
            pool: &Arc<ExpertPool>,
            want: &[f32],
            tol: impl Fn(Isa) -> f32,
            what: &str,
        ) {
            let scale = want
                .iter()
                .map(|v| (v - self.init).abs())
                .fold(0.0, f32::max);
            assert!(scale > 1e-3, "{what}: the reference is all but zero");
            for isa in Isa::all_supported() {
                for threads in [1, 3] {
                    let cpu = CpuExperts::new(pool.clone(), Some(threads), Some(isa)).unwrap();
                    let mut out = vec![self.init; want.len()];
                    let x = Hidden::F32(self.x);
                    cpu.forward(1, x, self.ids, self.wts, self.k, self.experts, &mut out)
                        .unwrap();
                    let err = out
                        .iter()
                        .zip(want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    assert!(
                        err <= tol(isa) * scale,
                        "{what} {isa:?} x{threads}: max err {err} vs scale {scale}"
                    );
                }
            }
        }
    }

    #[test]
    fn forward_matches_reference_on_every_path() {
        let shape = PoolShape {
            moe_layers: vec![0, 2],
            num_experts: 6,
            hidden_size: 67,
            intermediate_size: 33,
            format: crate::quant::ExpertFormat::Bf16,
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
        let case = Case {
            x: &x,
            ids: &ids,
            wts: &wts,
            k,
            experts: &experts,
            init: 0.5,
        };
        let want = case.reference(h, |e, x| reference_expert(&pool, 1, e as usize, x));
        case.check_every_path(
            &pool,
            &want,
            |isa| if isa.wants_bf16() { 2e-2 } else { 1e-4 },
            "bf16",
        );
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

    /// A quantized pool with random valid codes and scales (no NaN codes).
    fn quantized_pool(format: ExpertFormat, h: usize, i: usize, seed: u64) -> Arc<ExpertPool> {
        let shape = PoolShape {
            moe_layers: vec![1, 3],
            num_experts: 5,
            hidden_size: h,
            intermediate_size: i,
            format,
        };
        let pool = ExpertPool::zeroed(shape).unwrap();
        let layout = format.layout(h, i);
        let mut rng = SplitMix64::new(seed);
        for l in 0..2i64 {
            for e in 0..5i64 {
                let (p, n) = pool.expert_ptr(l, e).unwrap();
                // SAFETY: the expert's n bytes lie in the arena, which no one else reads or writes
                // while the test fills it.
                let bytes = unsafe { std::slice::from_raw_parts_mut(p.cast_mut(), n) };
                for b in &mut bytes[..layout.down.0 + layout.down.1] {
                    let v = rng.next_u64() as u8;
                    // e4m3 NaN is S.1111.111; 4-bit codes have none.
                    *b = if v & 0x7F == 0x7F { v ^ 1 } else { v };
                }
                for sec in [layout.gate_up_scale, layout.down_scale] {
                    let s = &mut bytes[sec.0..sec.0 + sec.1];
                    match format.scale_type() {
                        ScaleType::F32 => {
                            for c in s.chunks_mut(4) {
                                let v = 0.002 + 0.002 * rng.next_f64() as f32;
                                c.copy_from_slice(&v.to_le_bytes());
                            }
                        }
                        // e4m3 codes 0x20..0x3F (2^-3 .. ~1), e8m0 near 2^-4.
                        ScaleType::E4m3 => {
                            s.iter_mut().for_each(|b| *b = 0x20 + (rng.below(32) as u8))
                        }
                        ScaleType::E8m0 => {
                            s.iter_mut().for_each(|b| *b = 120 + (rng.below(4) as u8))
                        }
                        ScaleType::None => {}
                    }
                }
                let (o, n) = layout.tensor_scale;
                for c in bytes[o..o + n].chunks_mut(4) {
                    c.copy_from_slice(&0.05f32.to_le_bytes());
                }
            }
        }
        Arc::new(pool)
    }

    #[test]
    fn quantized_pools_match_the_scalar_expert() {
        let fp8 = ExpertFormat::Fp8Block {
            block_rows: 16,
            block_cols: 32,
        };
        let (h, i, b, k) = (96, 64, 6, 2);
        for format in [fp8, ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
            let pool = quantized_pool(format, h, i, 3);
            let layout = format.layout(h, i);
            let mut rng = SplitMix64::new(5);
            let x: Vec<f32> = (0..b * h)
                .map(|_| rng.next_f64() as f32 * 2.0 - 1.0)
                .collect();
            let ids: Vec<i64> = vec![0, 1, 1, 2, 3, 0, 4, 1, 0, 2, 3, 4];
            let wts: Vec<f32> = (0..b * k).map(|j| 0.3 + j as f32 * 0.05).collect();
            let experts = [0i64, 1, 4, 2];
            let case = Case {
                x: &x,
                ids: &ids,
                wts: &wts,
                k,
                experts: &experts,
                init: 0.25,
            };
            let want = case.reference(h, |e, x| {
                let q = layout.expert(pool.expert_bytes(1, e).unwrap()).unwrap();
                let mut y = vec![0f32; h];
                qkernels::expert_forward(Isa::Scalar, &q, x, 1, &mut y);
                y
            });
            // bf16 paths: the activations rounded to bf16 (2^-9 relative each) against an f32 reference.
            case.check_every_path(
                &pool,
                &want,
                |isa| if isa.wants_bf16() { 1e-2 } else { 1e-4 },
                format.name(),
            );
        }
    }
}
