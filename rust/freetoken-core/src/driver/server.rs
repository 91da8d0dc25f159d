//! The MoE layer step, once for every path: plan (q*), fills with their victims, the slot
//! kernel's tile alignment, the CPU experts, and the bandwidth samples that refine q*.
//!
//! Owns: the order of that work on the host. Not: how the device learns of it, which the caller
//! says through [`LayerHooks`]: the decode driver ([`super::DecodeDriver`]) raises the
//! handshake's flags for a step captured in one CUDA graph; the Python binding launches the slot
//! kernel of an eager or prefill step (and on the CPU device runs it after the step returns).
//!
//! ```text
//! plan (planner lock) -> plan buffer: topk slots, tile alignment  -> hooks.planned()
//! CPU experts start on the workers; alongside them: fills queued  -> hooks.fills_queued()
//! CPU experts joined (cpu_out), fills waited for                  -> bandwidth samples -> Planner
//! ```
//! Fills are queued once the workers have started so the CPU experts, usually the longer path of
//! a hybrid step, lose no time to the copies' driver calls; a hit's slot is never a fill's victim
//! in the same layer (the planner pins it first).
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Instant;

use super::{plan_layout, split_tiles, SlotCopier, StepReport};
use crate::align::{align_after, aligned_len};
use crate::cpu::{CpuExperts, Hidden};
use crate::error::{DriverError, KernelError};
use crate::planner::{Backend, Planner};

/// What the caller does at the points of a layer step where the device may move on.
pub trait LayerHooks {
    /// The plan is in the plan buffer; no fill is queued yet. `num_fills` fills will follow.
    ///
    /// # Errors
    /// Whatever the caller's work returns; the step then fails (its fills are still queued).
    fn planned(&mut self, num_fills: usize) -> Result<(), DriverError> {
        let _ = num_fills;
        Ok(())
    }

    /// Every fill of the step is queued on `copier` (none when `num_fills` is 0): work ordered
    /// after the copier's stream may read the filled slots. Returns whether the copier itself
    /// will signal the fills' landing (the driver's fill flag); false by default.
    ///
    /// # Errors
    /// Whatever the caller's work returns; the step then fails.
    fn fills_queued(
        &mut self,
        copier: &mut dyn SlotCopier,
        num_fills: usize,
    ) -> Result<bool, DriverError>;

    /// Makes the host copies of the routing weights and hidden states valid, for a step whose
    /// inputs were not ready ([`LayerInputs::ready`] false) once the plan sends experts to the CPU.
    ///
    /// # Errors
    /// Whatever the caller's copy returns.
    fn fetch_inputs(&mut self) -> Result<(), DriverError> {
        Err(DriverError::Invalid(
            "the CPU experts need the hidden states, and the caller gave none".into(),
        ))
    }
}

/// Host copies of one layer step's inputs, `[batch, k]` and `[batch, H]` float32.
#[derive(Clone, Copy, Debug)]
pub struct LayerInputs {
    /// Routing weights, `[batch, k]` float32.
    pub weights: *const f32,
    /// Hidden states, `[batch, H]` float32.
    pub hidden: *const f32,
    /// False when they are written only by [`LayerHooks::fetch_inputs`] (the offload backend
    /// copies them to the host only in the rare step whose misses find every slot pinned).
    pub ready: bool,
}

/// One layer step.
#[derive(Clone, Copy, Debug)]
pub struct LayerStep<'a> {
    /// Pool layer.
    pub layer: usize,
    /// How misses are served in this step (a prefill step may pick another than decode).
    pub backend: Backend,
    /// Routed expert ids `[batch, k]` row-major.
    pub ids: &'a [i64],
    /// Experts per token.
    pub top_k: usize,
    /// Rows of the padded batch the plan covers (>= batch; padding rows get -1 and no tiles).
    pub size: usize,
    /// Rows per M tile of the slot kernel.
    pub block_m: usize,
    /// Put the tiles of slots filled in this step in the plan's second tile row (the decode
    /// driver's device runs them after the fill flag); false leaves every tile in the first.
    pub split_fill_tiles: bool,
}

/// What one layer step planned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerOutcome {
    /// Distinct experts found resident.
    pub num_hits: usize,
    /// Experts copied into slots.
    pub num_fills: usize,
    /// Experts run on the CPU.
    pub num_cpu: usize,
    /// Sorted-pair entries of the plan's tile alignment.
    pub num_pairs: usize,
    /// Tiles per tile row of the plan.
    pub num_tiles: usize,
}

/// Serves MoE layer steps: the planner, the host experts and the copier into the device slots.
/// Shared (behind a mutex) by the decode driver thread and the eager steps' binding; one step at
/// a time.
pub struct LayerServer {
    planner: Arc<Mutex<Planner>>,
    cpu: Arc<CpuExperts>,
    copier: Box<dyn SlotCopier>,
    slot_rows: usize,
    /// The thread the copier is attached to (a CUDA context is current per thread).
    attached: Option<ThreadId>,
}

impl LayerServer {
    /// A server over `slot_rows` rows of device weights (slots, then any layer buffers: the id
    /// range of the tile alignment), filled by `copier`.
    ///
    /// # Errors
    /// `Invalid` if the planner and the pool disagree on the layers or experts, or `slot_rows`
    /// is 0.
    pub fn new(
        planner: Arc<Mutex<Planner>>,
        cpu: Arc<CpuExperts>,
        copier: Box<dyn SlotCopier>,
        slot_rows: usize,
    ) -> Result<Self, DriverError> {
        {
            let p = planner.lock().unwrap_or_else(|e| e.into_inner());
            let (pc, pool) = (p.config(), cpu.pool());
            if pc.num_layers != pool.num_layers() || pc.num_experts != pool.num_experts() {
                return Err(DriverError::Invalid(format!(
                    "the planner covers {} layers x {} experts, the pool {} x {}",
                    pc.num_layers,
                    pc.num_experts,
                    pool.num_layers(),
                    pool.num_experts()
                )));
            }
        }
        if slot_rows == 0 {
            return Err(DriverError::Invalid("slot_rows must be positive".into()));
        }
        Ok(Self {
            planner,
            cpu,
            copier,
            slot_rows,
            attached: None,
        })
    }

    /// The host experts (and through them the pool).
    pub fn cpu(&self) -> &Arc<CpuExperts> {
        &self.cpu
    }

    /// Rows of the device weight tensor the plan's slot ids index.
    pub fn slot_rows(&self) -> usize {
        self.slot_rows
    }

    /// Binds the copier to the calling thread, once per thread.
    ///
    /// # Errors
    /// The copier's (a CUDA context that cannot be made current).
    pub fn attach(&mut self) -> Result<(), DriverError> {
        let me = std::thread::current().id();
        if self.attached != Some(me) {
            self.copier.attach()?;
            self.attached = Some(me);
        }
        Ok(())
    }

    /// Waits for the copies queued so far (a failed step's fills must land before their slots
    /// count as resident).
    ///
    /// # Errors
    /// The copier's.
    pub fn drain(&mut self) -> Result<(), DriverError> {
        self.copier.wait().map(|_| ())
    }

    /// Serves one layer step: plans it, writes the plan (topk slots of the real rows, -1 for
    /// padding rows and CPU picks, then the tile alignment; sizes by [`plan_layout`]) into
    /// `plan`, runs the CPU experts into `cpu_out` (`[batch, H]` float32, written only when
    /// some run: see the outcome) while the fills are queued, waits for the fills, books both
    /// paths' bandwidth in the planner and the step's figures in `report`.
    ///
    /// # Errors
    /// `Invalid` for buffers too small for the step; the planner's, the kernels', the
    /// copier's and the hooks' errors. After an error the planned fills are still queued, so
    /// the caller must [`drain`](Self::drain) before the slots are read.
    ///
    /// # Safety
    /// `inputs.weights` and `inputs.hidden` must be valid for reads of `batch * k` and
    /// `batch * H` float32 for the call (once `ready`, or once `fetch_inputs` returned), and
    /// nothing but `fetch_inputs` may write them meanwhile.
    pub unsafe fn serve(
        &mut self,
        step: &LayerStep<'_>,
        inputs: LayerInputs,
        plan_buf: &mut [i64],
        cpu_out: &mut [f32],
        hooks: &mut dyn LayerHooks,
        report: &mut StepReport,
    ) -> Result<LayerOutcome, DriverError> {
        let t0 = Instant::now();
        self.attach()?;
        let (k, h) = (step.top_k, self.cpu.pool().hidden_size());
        if k == 0 || step.ids.is_empty() || !step.ids.len().is_multiple_of(k) {
            return Err(DriverError::Invalid(format!(
                "{} routed ids are not [batch, k = {k}]",
                step.ids.len()
            )));
        }
        let batch = step.ids.len() / k;
        let (ns, nr, nt) = plan_layout(step.size, k, self.slot_rows, step.block_m);
        if step.size < batch || plan_buf.len() < ns + nr + 2 * nt || cpu_out.len() < batch * h {
            return Err(DriverError::Invalid(format!(
                "a step of {batch} rows padded to {} needs a plan of {} and cpu_out of {} elements; got {} and {}",
                step.size,
                ns + nr + 2 * nt,
                batch * h,
                plan_buf.len(),
                cpu_out.len()
            )));
        }
        let plan = {
            let mut planner = self.planner.lock().unwrap_or_else(|e| e.into_inner());
            planner.plan(step.layer as i64, step.ids, k, step.backend)?
        };
        let buf = &mut plan_buf[..ns + nr + 2 * nt];
        for (dst, &s) in buf.iter_mut().zip(&plan.topk_slots) {
            *dst = i64::from(s);
        }
        buf[batch * k..ns].fill(-1);
        let filled: &[i32] = if step.split_fill_tiles {
            &plan.fill_slots
        } else {
            &[]
        };
        align_plan(buf, ns, self.slot_rows, step.block_m, filled);
        let outcome = LayerOutcome {
            num_hits: plan.hit_experts.len(),
            num_fills: plan.fill_experts.len(),
            num_cpu: plan.cpu_experts.len(),
            num_pairs: nr,
            num_tiles: nt,
        };
        report.plan_seconds += t0.elapsed().as_secs_f64();
        let planned = hooks.planned(outcome.num_fills);
        let fetched = if outcome.num_cpu > 0 && !inputs.ready && planned.is_ok() {
            hooks.fetch_inputs()
        } else {
            Ok(())
        };

        let pool = self.cpu.pool().clone();
        let (cpu, copier) = (&self.cpu, &mut self.copier);
        let mut issued: Result<(), DriverError> = Ok(());
        let mut issue_seconds = 0.0;
        let mut published = false;
        let issue_ran = std::cell::Cell::new(false);
        let mut issue = || {
            issue_ran.set(true);
            let t = Instant::now();
            issued = plan
                .fill_experts
                .iter()
                .zip(&plan.fill_slots)
                .try_for_each(|(&e, &slot)| {
                    let (src, nbytes) = pool
                        .expert_ptr(step.layer as i64, i64::from(e))
                        .map_err(KernelError::from)?;
                    // SAFETY: `src` is a pool expert of `nbytes`, and the pool outlives the step.
                    unsafe { copier.copy(slot as usize, src, nbytes) }
                });
            // The copies' timing ends here, not after the CPU experts (`SlotCopier::end_group`).
            if issued.is_ok() {
                issued = copier.end_group();
            }
            if issued.is_ok() {
                match hooks.fills_queued(copier.as_mut(), plan.fill_experts.len()) {
                    Ok(p) => published = p,
                    Err(e) => issued = Err(e),
                }
            }
            issue_seconds = t.elapsed().as_secs_f64();
        };
        let mut ran: Result<(), DriverError> = Ok(());
        let mut cpu_seconds = 0.0;
        if outcome.num_cpu > 0 && planned.is_ok() && fetched.is_ok() {
            // SAFETY: valid for these lengths once ready or fetched (the caller's contract).
            let (weights, hidden) = unsafe {
                (
                    std::slice::from_raw_parts(inputs.weights, batch * k),
                    std::slice::from_raw_parts(inputs.hidden, batch * h),
                )
            };
            let out = &mut cpu_out[..batch * h];
            out.fill(0.0);
            let experts: Vec<i64> = plan.cpu_experts.iter().map(|&e| i64::from(e)).collect();
            let t = Instant::now();
            // The fills are queued while the workers start on the CPU experts.
            ran = cpu
                .forward_with(
                    step.layer as i64,
                    Hidden::F32(hidden),
                    step.ids,
                    weights,
                    k,
                    &experts,
                    out,
                    &mut issue,
                )
                .map_err(DriverError::from);
            cpu_seconds = t.elapsed().as_secs_f64();
        }
        if !issue_ran.get() {
            // The planner counts the fills as resident: queue them even if the CPU part failed.
            issue();
        }
        report.issue_seconds += issue_seconds;
        report.stream_flags += usize::from(published);
        planned?;
        fetched?;
        ran?;
        issued?;
        let nbytes = pool.expert_nbytes();
        if outcome.num_cpu > 0 {
            let picks = plan.topk_slots.iter().filter(|&&s| s < 0).count();
            report.cpu_experts += outcome.num_cpu;
            report.cpu_picks += picks;
            report.cpu_seconds += cpu_seconds;
            report.cpu_layers += 1;
            let batch_per_expert = picks as f64 / outcome.num_cpu as f64;
            self.planner
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .record_cpu(outcome.num_cpu * nbytes, cpu_seconds, batch_per_expert, 1);
        }
        if outcome.num_fills > 0 {
            report.fills += outcome.num_fills;
            report.fill_bytes += outcome.num_fills * nbytes;
            let t = Instant::now();
            let timed = self.copier.wait()?;
            report.fill_wait_seconds += t.elapsed().as_secs_f64();
            if let Some(seconds) = timed {
                report.timed_fill_bytes += outcome.num_fills * nbytes;
                report.timed_fill_seconds += seconds;
                report.timed_fill_layers += 1;
                self.planner
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .record_fills(outcome.num_fills * nbytes, seconds, 1);
            }
        }
        Ok(outcome)
    }
}

/// Writes the tile alignment of the plan's first `ns` entries (its topk slots) after them: sorted
/// pairs by [`align_after`], then the tile slots split by readiness ([`split_tiles`], `filled`:
/// the slots filled in this layer step). `buf` holds the whole plan (sizes by [`plan_layout`]).
pub(crate) fn align_plan(
    buf: &mut [i64],
    ns: usize,
    slot_rows: usize,
    block_m: usize,
    filled: &[i32],
) {
    let (nr, nt) = aligned_len(ns, slot_rows, block_m);
    align_after(&mut buf[..ns + nr + nt], ns, slot_rows, block_m);
    split_tiles(&mut buf[ns + nr..ns + nr + 2 * nt], filled);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuExperts;
    use crate::driver::HostCopier;
    use crate::planner::{BandwidthProfile, PlannerConfig};
    use crate::pool::{ExpertPool, PoolShape};

    /// Records the hook calls in order; supplies the inputs on `fetch_inputs`.
    struct Recorder {
        calls: Vec<String>,
        hidden: Vec<f32>,
        weights: Vec<f32>,
        fill: (Vec<f32>, Vec<f32>),
    }

    impl LayerHooks for Recorder {
        fn planned(&mut self, num_fills: usize) -> Result<(), DriverError> {
            self.calls.push(format!("planned {num_fills}"));
            Ok(())
        }
        fn fills_queued(
            &mut self,
            _copier: &mut dyn SlotCopier,
            num_fills: usize,
        ) -> Result<bool, DriverError> {
            self.calls.push(format!("fills_queued {num_fills}"));
            Ok(false)
        }
        fn fetch_inputs(&mut self) -> Result<(), DriverError> {
            self.calls.push("fetch_inputs".into());
            self.weights.copy_from_slice(&self.fill.0);
            self.hidden.copy_from_slice(&self.fill.1);
            Ok(())
        }
    }

    #[test]
    fn one_layer_step_orders_its_hooks_and_fetches_inputs_only_for_the_cpu() {
        let (e, h, i, k, slots) = (8, 32, 16, 2, 2);
        let shape = PoolShape {
            moe_layers: vec![0],
            num_experts: e,
            hidden_size: h,
            intermediate_size: i,
            format: crate::quant::ExpertFormat::Bf16,
        };
        let pool = Arc::new(ExpertPool::random(shape, 5, Some(1)).unwrap());
        let stride = pool.shape().expert_stride();
        let planner = Planner::new(PlannerConfig {
            num_layers: 1,
            num_experts: e,
            expert_nbytes: pool.expert_nbytes(),
            capacity: slots,
            policy: "lru".into(),
            profile: Some(BandwidthProfile::new(1e9, vec![(1.0, 1e9)]).unwrap()),
            reuse_weight: 0.0,
            reuse_decay: 0.9,
        })
        .unwrap();
        let cpu = Arc::new(CpuExperts::new(pool.clone(), Some(1), None).unwrap());
        let mut slot_mem = vec![0u8; slots * stride];
        // SAFETY: `slot_mem` outlives the server (dropped at the end of the test, after it).
        let copier = unsafe { HostCopier::new(slot_mem.as_mut_ptr(), stride, slots) };
        let planner = Arc::new(Mutex::new(planner));
        let mut server = LayerServer::new(planner.clone(), cpu, Box::new(copier), slots).unwrap();
        // Offload, 4 distinct experts and 2 slots: 2 fills, the 2 others run on the CPU, inputs not ready.
        let ids = [0i64, 1, 2, 3];
        let mut rec = Recorder {
            calls: Vec::new(),
            hidden: vec![f32::NAN; 2 * h],
            weights: vec![f32::NAN; 2 * k],
            fill: (vec![0.5; 2 * k], vec![0.25; 2 * h]),
        };
        let (ns, nr, nt) = plan_layout(2, k, slots, 4);
        let mut plan = vec![0i64; ns + nr + 2 * nt];
        let mut out = vec![0f32; 2 * h];
        let step = LayerStep {
            layer: 0,
            backend: Backend::Offload,
            ids: &ids,
            top_k: k,
            size: 2,
            block_m: 4,
            split_fill_tiles: false,
        };
        let inputs = LayerInputs {
            weights: rec.weights.as_ptr(),
            hidden: rec.hidden.as_ptr(),
            ready: false,
        };
        let mut report = StepReport::default();
        // SAFETY: the input vectors live in `rec` for the call and only `fetch_inputs` writes them.
        let o = unsafe { server.serve(&step, inputs, &mut plan, &mut out, &mut rec, &mut report) }
            .unwrap();
        assert_eq!((o.num_hits, o.num_fills, o.num_cpu), (0, 2, 2));
        assert_eq!(rec.calls, ["planned 2", "fetch_inputs", "fills_queued 2"]);
        assert!(out.iter().all(|v| v.is_finite()) && out.iter().any(|&v| v != 0.0));
        // Unsplit tiles: the second tile row is empty.
        assert!(plan[ns + nr + nt..].iter().all(|&t| t == -1));
        let filled: Vec<usize> = plan[..ns]
            .iter()
            .filter(|&&s| s >= 0)
            .map(|&s| s as usize)
            .collect();
        for s in filled {
            assert!(
                slot_mem[s * stride..s * stride + 8].iter().any(|&b| b != 0),
                "slot {s} filled"
            );
        }
        // Both paths were timed into the planner.
        let g = planner.lock().unwrap();
        assert_eq!(g.bandwidth().0.num_samples(), 1);
        assert_eq!(g.bandwidth().1.num_samples(), 1);
        drop(g);
        // A hit-only step: inputs never fetched, cpu_out untouched.
        rec.calls.clear();
        out.fill(7.0);
        let step = LayerStep {
            ids: &ids[..2],
            size: 1,
            ..step
        };
        let inputs = LayerInputs {
            ready: false,
            ..inputs
        };
        let (ns1, nr1, nt1) = plan_layout(1, k, slots, 4);
        // SAFETY: as above.
        let o = unsafe {
            server.serve(
                &step,
                inputs,
                &mut plan[..ns1 + nr1 + 2 * nt1],
                &mut out,
                &mut rec,
                &mut report,
            )
        }
        .unwrap();
        assert_eq!((o.num_cpu, o.num_fills), (0, 0));
        assert_eq!(rec.calls, ["planned 0", "fills_queued 0"]);
        assert!(out.iter().all(|&v| v == 7.0));
    }
}
