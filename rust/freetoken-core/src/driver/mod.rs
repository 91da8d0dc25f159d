//! The decode driver: serves every MoE layer of a decode step from a host thread while the whole
//! step runs on the device as one captured CUDA graph, with no Python between layers.
//!
//! Owns: the driver thread and the host side of a flag handshake through page-locked host memory
//! that the device reads and writes directly (mapped, `cudaHostRegister`). Per MoE layer `l` of a
//! step with generation `g` (docs/architecture.md, the decode step):
//!
//! ```text
//! device (graph)                               driver thread (here)
//! router -> one kernel writes the mail (ids,
//! weights, hidden f32) into host memory, then
//! mail_flag[l] = g (system-scope release)  ──> sees mail_flag[l] == g, plans (q*), writes topk
//!                                              slots + tile alignment, plan_flag[l] = g; hands
//! spins until plan_flag[l] == g, fetches the   the CPU experts to the workers, queues the fills
//! plan; slot kernel over the hits' tiles;      on the copy stream and after them fill_flag[l] = g
//! spins until fill_flag[l] == g; slot kernel   (a stream write; without fills, or where the
//! over the filled slots' tiles; spins until    copier cannot, the host sets it), joins the CPU
//! cpu_flag[l] == g, adds cpu_out               experts (cpu_out), waits for the fills, then
//!                                              cpu_flag[l] = g
//! ```
//! So the hits run on the GPU while the fills cross PCIe and the CPU experts run, and only the
//! filled experts' share of the slot kernel is left after the last fill lands. A hit's slot is
//! never a fill's victim in the same layer (the planner pins it first).
//! One mailbox, plan and cpu_out buffer serve every layer: the device posts layer `l + 1` only
//! after it fetched layer `l`'s plan and CPU output, and the driver writes them only after that
//! post. Fills are ordered after every earlier kernel that may read their victim slots, because
//! the device posts layer `l` only after layer `l - 1`'s slot kernels ran.
//!
//! A step that fails here (plan error, a device that never posts) still publishes every remaining
//! flag over an empty plan, so the device finishes the step instead of spinning, and
//! [`DecodeDriver::finish`] returns the error ([`DriverError::DeviceTimeout`] names the layer and
//! step a device never posted).
//!
//! The layer step itself (plan, fills, CPU experts, bandwidth samples) is [`server::LayerServer`],
//! which eager and prefill steps call through the bindings too; this module adds the handshake.
//! This doc is the one description of the protocol; the Python side (`freetoken.moe.handshake`)
//! and `docs/architecture.md` link here.
pub mod cuda;
pub mod server;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::align::aligned_len;
use crate::error::DriverError;
use crate::planner::Backend;
use server::{LayerHooks, LayerInputs, LayerServer, LayerStep};

/// Copies experts from the host pool into device slots for the driver thread.
pub trait SlotCopier: Send {
    /// Called on each thread before its first copy (binds a CUDA context there); may be called
    /// again on another thread, and must then keep what it made the first time.
    fn attach(&mut self) -> Result<(), DriverError> {
        Ok(())
    }
    /// Queues a copy of `nbytes` from host address `src` into slot `slot`.
    ///
    /// # Safety
    /// `src` must be valid for reads of `nbytes` until [`wait`](Self::wait) returns.
    unsafe fn copy(
        &mut self,
        slot: usize,
        src: *const u8,
        nbytes: usize,
    ) -> Result<(), DriverError>;
    /// The group of copies queued since the last [`wait`](Self::wait) is complete: their timing
    /// ends where the last of them lands. The caller runs its CPU experts between queueing and
    /// `wait`; an end marked only at `wait` would count that time as copy time, and the longer
    /// the CPU part the lower the PCIe rate the planner measures, so the more misses q* sends to
    /// the CPU. Optional: `wait` marks the end itself when this was not called.
    fn end_group(&mut self) -> Result<(), DriverError> {
        Ok(())
    }
    /// Blocks until every queued copy has landed. Returns the copies' own duration in seconds
    /// when they were timed (every few groups: timing costs driver calls), else None.
    fn wait(&mut self) -> Result<Option<f64>, DriverError>;
    /// Sets host flag `flag` to `value` as soon as every copy queued so far has landed, without
    /// blocking (the device writes it, in stream order after the copies). Returns false where the
    /// copier cannot, and the caller sets it after [`wait`](Self::wait).
    ///
    /// # Safety
    /// `flag` must be a 4-byte aligned host word that the device can write (mapped, page-locked)
    /// and that outlives the queued work.
    unsafe fn publish(&mut self, flag: *mut u32, value: u32) -> Result<bool, DriverError>;
}

/// Byte offsets of the mailbox's parts for `size` rows: `(weights, hidden, end)`; the ids start
/// at 0 (see [`Handshake`]).
pub fn mail_offsets(size: usize, top_k: usize, hidden: usize) -> (usize, usize, usize) {
    (
        8 * size * top_k,
        12 * size * top_k,
        mail_len(size, top_k, hidden),
    )
}

/// A fill's destination must be one of `num_slots` slots of `stride` bytes.
fn check_fill(
    slot: usize,
    nbytes: usize,
    num_slots: usize,
    stride: usize,
) -> Result<(), DriverError> {
    if slot >= num_slots || nbytes > stride {
        return Err(DriverError::Invalid(format!(
            "fill of {nbytes} bytes into slot {slot} of {num_slots} slots of {stride} bytes"
        )));
    }
    Ok(())
}

/// Slots in host memory (the CPU device): a copy is a `memcpy`, done at once.
pub struct HostCopier {
    slots: *mut u8,
    stride: usize,
    num_slots: usize,
    /// Seconds in the copies since the last `wait`.
    seconds: f64,
}

// SAFETY: the slot memory is only written by the driver thread while a step runs; the owner
// keeps it alive for the copier's lifetime (see `HostCopier::new`).
unsafe impl Send for HostCopier {}

impl HostCopier {
    /// Slots of `stride` bytes at `slots`, `num_slots` of them.
    ///
    /// # Safety
    /// `slots` must stay valid for `num_slots * stride` bytes while the copier lives, and no one
    /// else may write it during a step.
    pub unsafe fn new(slots: *mut u8, stride: usize, num_slots: usize) -> Self {
        Self {
            slots,
            stride,
            num_slots,
            seconds: 0.0,
        }
    }
}

impl SlotCopier for HostCopier {
    unsafe fn copy(
        &mut self,
        slot: usize,
        src: *const u8,
        nbytes: usize,
    ) -> Result<(), DriverError> {
        check_fill(slot, nbytes, self.num_slots, self.stride)?;
        let t0 = Instant::now();
        // SAFETY: destination bounds checked above; `src` per the trait's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, self.slots.add(slot * self.stride), nbytes) };
        self.seconds += t0.elapsed().as_secs_f64();
        Ok(())
    }
    fn wait(&mut self) -> Result<Option<f64>, DriverError> {
        Ok(Some(std::mem::take(&mut self.seconds)))
    }
    unsafe fn publish(&mut self, f: *mut u32, value: u32) -> Result<bool, DriverError> {
        // The copies are done already. SAFETY: per the trait's contract.
        // ORDERING: Release publishes the copied slots before the flag.
        unsafe { flag(f) }.store(value, Ordering::Release);
        Ok(true)
    }
}

/// Host memory shared with the device, page-locked and mapped, owned by the caller.
///
/// Layouts, for a padded batch of `size` rows (`k` = top-k, `H` = hidden size):
/// - `mail`: ids `[size, k]` int64, then routing weights `[size, k]` float32, then hidden states
///   `[size, H]` float32, packed one after the other;
/// - `plan`: topk slots `[size * k]` int64 (-1 where the CPU runs the pick), then the tile
///   alignment of [`crate::align::align_after`] over `slot_rows` rows: sorted pairs `[rows]`, then
///   tile slots `[2, tiles]` (sizes by [`plan_layout`]): row 0 holds the tiles of hits, row 1 those
///   of slots filled in this layer, -1 elsewhere (see [`split_tiles`]);
/// - `cpu_out`: the CPU experts' weighted sum `[size, H]` float32.
#[derive(Clone, Copy, Debug)]
pub struct Handshake {
    /// `[num_layers]` u32: generation of the last routing the device posted per layer.
    pub mail_flag: *mut u32,
    /// `[num_layers]` u32: generation of the last plan published per layer.
    pub plan_flag: *mut u32,
    /// `[num_layers]` u32: generation of the last layer step whose fills have all landed.
    pub fill_flag: *mut u32,
    /// `[num_layers]` u32: generation of the last CPU output published per layer.
    pub cpu_flag: *mut u32,
    /// The mailbox, `mail_len` bytes.
    pub mail: *const u8,
    /// Capacity of `mail` in bytes.
    pub mail_len: usize,
    /// The plan, `plan_len` int64.
    pub plan: *mut i64,
    /// Capacity of `plan` in int64.
    pub plan_len: usize,
    /// The CPU output, `cpu_out_len` float32.
    pub cpu_out: *mut f32,
    /// Capacity of `cpu_out` in float32.
    pub cpu_out_len: usize,
}

// SAFETY: the buffers are plain host memory that outlives the driver (the caller's contract in
// `DecodeDriver::new`); the driver thread is their only host-side writer while a step runs.
unsafe impl Send for Handshake {}

// SAFETY: the only pointer the handle keeps is `cpu_flag`, read atomically (`wait_served`).
unsafe impl Send for DecodeDriver {}
// SAFETY: as for `Send`: shared handles only read `cpu_flag`, atomically.
unsafe impl Sync for DecodeDriver {}

/// What does not change between steps.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// How misses are served.
    pub backend: Backend,
    /// Experts per token (k).
    pub top_k: usize,
    /// How long to wait for the device to post a layer before failing the step.
    pub timeout: Duration,
}

/// One decode step for the driver.
#[derive(Clone, Copy, Debug)]
pub struct StepJob {
    /// Real rows of the batch (the planner sees only these).
    pub batch: usize,
    /// Padded rows of the captured graph (>= batch); padding rows get no experts.
    pub size: usize,
    /// Generation of this step: the value the device writes to the flags (non-zero, new per step).
    pub generation: u32,
    /// Rows per M tile of the slot kernel at this size.
    pub block_m: usize,
    /// Answer every layer with an empty plan, touching neither the planner nor the slots (the
    /// warm-up run before a graph is captured).
    pub idle: bool,
}

/// What one step did, for the counters (the bandwidth samples went to the planner already).
#[derive(Debug, Default)]
pub struct StepReport {
    /// Experts copied into slots, and their bytes.
    pub fills: usize,
    /// Bytes copied host -> device.
    pub fill_bytes: usize,
    /// Bytes of the fills that were timed (see [`SlotCopier::wait`]).
    pub timed_fill_bytes: usize,
    /// Seconds the timed fills took on the copy engine, summed over layers.
    pub timed_fill_seconds: f64,
    /// Layers whose fills were timed.
    pub timed_fill_layers: usize,
    /// Experts run on the CPU.
    pub cpu_experts: usize,
    /// Routed picks those experts served (tokens per expert = picks / experts).
    pub cpu_picks: usize,
    /// Seconds in the CPU experts (from handing them to the workers until all are done, the
    /// fills queued meanwhile), summed over layers.
    pub cpu_seconds: f64,
    /// Layers that ran CPU experts.
    pub cpu_layers: usize,
    /// Seconds the driver waited for the device to post routing, summed over layers.
    pub wait_seconds: f64,
    /// Seconds from a post seen to its flags raised, summed over layers: the plan, the fills'
    /// queueing and waiting, the CPU experts (the parts below, and what lies between them).
    pub serve_seconds: f64,
    /// Seconds copying the routing out of the mailbox, planning and writing the plan.
    pub plan_seconds: f64,
    /// Seconds queueing fills (driver API calls), on the driver thread while the CPU workers
    /// run (so inside `cpu_seconds` in layers that ran CPU experts).
    pub issue_seconds: f64,
    /// Seconds blocked on fills after the CPU experts were done (the copies' exposed time).
    pub fill_wait_seconds: f64,
    /// Layers whose fill flag the copy stream wrote after their fills (the rest of the layers
    /// with fills had it raised by the host after waiting for them).
    pub stream_flags: usize,
    /// Why the step failed, if it did.
    pub error: Option<DriverError>,
}

struct Worker {
    server: Arc<Mutex<LayerServer>>,
    num_layers: usize,
    hidden: usize,
    slot_rows: usize,
    hs: Handshake,
    cfg: DriverConfig,
    /// Leading float32 of `cpu_out` that may be non-zero (from any earlier step, of any size).
    cpu_out_dirty: usize,
    /// The posted routing, copied out of the mailbox (the device may write the mailbox again if it
    /// gave up waiting; the CPU kernels must not read memory that can change under them).
    mail_copy: Vec<u64>,
}

/// The driver thread's handle: [`start`](Self::start) a step, replay the graph, then
/// [`finish`](Self::finish).
pub struct DecodeDriver {
    /// `Handshake::cpu_flag` and its length, for [`wait_served`](Self::wait_served).
    cpu_flag: *mut u32,
    num_layers: usize,
    timeout: Duration,
    jobs: Option<Sender<StepJob>>,
    reports: Receiver<StepReport>,
    handle: Option<JoinHandle<()>>,
    running: bool,
}

/// Sizes of the plan's parts for `size` rows: `(topk slots, sorted pairs, tiles)`, in int64; the
/// tile slots take `2 * tiles` (hits, then fills), so the plan is `a + b + 2 * c` long.
pub fn plan_layout(
    size: usize,
    top_k: usize,
    slot_rows: usize,
    block_m: usize,
) -> (usize, usize, usize) {
    let (rows, tiles) = aligned_len(size * top_k, slot_rows, block_m);
    (size * top_k, rows, tiles)
}

/// Bytes of the mailbox for `size` rows: ids int64 and weights float32 `[size, k]`, hidden
/// float32 `[size, H]`.
pub fn mail_len(size: usize, top_k: usize, hidden: usize) -> usize {
    size * (12 * top_k + 4 * hidden)
}

impl DecodeDriver {
    /// Starts the driver thread.
    ///
    /// # Errors
    /// `Invalid` if `cfg` is inconsistent with the planner or the CPU experts' pool.
    ///
    /// # Safety
    /// Every pointer of `hs` must stay valid for its stated length until the driver is dropped,
    /// and be page-locked and mapped for the device when the device takes part.
    pub unsafe fn new(
        server: Arc<Mutex<LayerServer>>,
        hs: Handshake,
        cfg: DriverConfig,
    ) -> Result<Self, DriverError> {
        if cfg.top_k == 0 {
            return Err(DriverError::Invalid("top_k must be positive".into()));
        }
        let (num_layers, hidden, slot_rows) = {
            let g = server.lock().unwrap_or_else(|e| e.into_inner());
            let pool = g.cpu().pool();
            (pool.num_layers(), pool.hidden_size(), g.slot_rows())
        };
        let (cpu_flag, timeout) = (hs.cpu_flag, cfg.timeout);
        let (job_tx, job_rx) = crossbeam_channel::bounded::<StepJob>(1);
        let (rep_tx, rep_rx) = crossbeam_channel::bounded::<StepReport>(1);
        let mut worker = Worker {
            server,
            num_layers,
            hidden,
            slot_rows,
            hs,
            cpu_out_dirty: hs.cpu_out_len,
            mail_copy: Vec::new(),
            cfg,
        };
        let handle = std::thread::Builder::new()
            .name("ft-decode-driver".into())
            .spawn(move || {
                // Binds the copier here at once; a failure comes back from each step's serve.
                let _ = worker.lock().attach();
                while let Ok(job) = job_rx.recv() {
                    let run = std::panic::AssertUnwindSafe(|| worker.step(job));
                    let report = std::panic::catch_unwind(run).unwrap_or_else(|_| {
                        // A bug: still release every layer so the device finishes.
                        let mut r = StepReport::default();
                        let e = DriverError::Invalid("the decode driver panicked".into());
                        worker.abort(&job, 0, &mut r, e);
                        r
                    });
                    if rep_tx.send(report).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| DriverError::Invalid(format!("spawning the decode driver thread: {e}")))?;
        Ok(Self {
            cpu_flag,
            num_layers,
            timeout,
            jobs: Some(job_tx),
            reports: rep_rx,
            handle: Some(handle),
            running: false,
        })
    }

    /// Hands a step to the driver thread (returns at once). Start it before the device runs the
    /// step's graph.
    ///
    /// # Errors
    /// `Invalid` if a step is already running, or the job does not fit the handshake buffers.
    pub fn start(&mut self, job: StepJob) -> Result<(), DriverError> {
        if self.running {
            return Err(DriverError::Invalid(
                "a step is already running: finish() it first".into(),
            ));
        }
        if job.batch == 0 || job.batch > job.size || job.generation == 0 || job.block_m == 0 {
            return Err(DriverError::Invalid(format!(
                "bad step: batch {} of size {}, generation {}, block_m {}",
                job.batch, job.size, job.generation, job.block_m
            )));
        }
        let tx = self.jobs.as_ref().expect("jobs sender lives until drop");
        tx.send(job)
            .map_err(|_| DriverError::Invalid("the decode driver thread has stopped".into()))?;
        self.running = true;
        Ok(())
    }

    /// Blocks until the driver has served `layer` of the step with `generation` (its CPU output
    /// published), or failed it. Lets the caller launch the next part of a step only once nothing
    /// queued ahead of it waits on the driver.
    ///
    /// # Errors
    /// `Invalid` for a layer out of range; `Timeout` after the driver's timeout.
    pub fn wait_served(&self, layer: usize, generation: u32) -> Result<(), DriverError> {
        if layer >= self.num_layers {
            return Err(DriverError::Invalid(format!(
                "layer {layer} out of range for {} MoE layers",
                self.num_layers
            )));
        }
        // SAFETY: `cpu_flag` is `[num_layers]` and lives as long as the driver (see `new`).
        let f = unsafe { flag(self.cpu_flag.add(layer)) };
        if wait_for(f, generation, self.timeout) {
            Ok(())
        } else {
            Err(DriverError::NotServed {
                step: generation,
                layer,
                waited: self.timeout,
            })
        }
    }

    /// Waits for the running step to end and returns its report (with `error` set if it failed).
    ///
    /// # Errors
    /// `Invalid` if no step is running or the thread has stopped.
    pub fn finish(&mut self) -> Result<StepReport, DriverError> {
        if !self.running {
            return Err(DriverError::Invalid("no step is running".into()));
        }
        self.running = false;
        self.reports
            .recv()
            .map_err(|_| DriverError::Invalid("the decode driver thread has stopped".into()))
    }
}

impl Drop for DecodeDriver {
    fn drop(&mut self) {
        self.jobs = None; // closes the channel: the thread's recv fails and it exits
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// `AtomicU32` view of one flag.
///
/// # Safety
/// `p` must be valid, 4-byte aligned, and only accessed atomically (or by the device) meanwhile.
unsafe fn flag<'a>(p: *mut u32) -> &'a AtomicU32 {
    // SAFETY: per the caller's contract.
    unsafe { AtomicU32::from_ptr(p) }
}

/// The driver's side of a layer step's handshake: raises the flags as the server gets there.
struct FlagHooks {
    plan_flag: *mut u32,
    fill_flag: *mut u32,
    generation: u32,
}

impl LayerHooks for FlagHooks {
    fn planned(&mut self, num_fills: usize) -> Result<(), DriverError> {
        // The hits' tiles can run at once; the fills' wait for the fill flag, which the copy
        // stream raises after them (the host at once when there are none).
        // SAFETY: flags of the handshake, alive as long as the driver. ORDERING: Release
        // publishes the plan before its flag.
        unsafe { flag(self.plan_flag) }.store(self.generation, Ordering::Release);
        if num_fills == 0 {
            // SAFETY: as above.
            unsafe { flag(self.fill_flag) }.store(self.generation, Ordering::Release);
        }
        Ok(())
    }

    fn fills_queued(
        &mut self,
        copier: &mut dyn SlotCopier,
        num_fills: usize,
    ) -> Result<bool, DriverError> {
        if num_fills == 0 {
            return Ok(false);
        }
        // SAFETY: a mapped host flag of the handshake, alive as long as the driver.
        unsafe { copier.publish(self.fill_flag, self.generation) }
    }
}

impl Worker {
    fn lock(&self) -> std::sync::MutexGuard<'_, LayerServer> {
        self.server.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(&self, job: &StepJob) -> Result<(), DriverError> {
        let (k, h) = (self.cfg.top_k, self.hidden);
        let (a, b, c) = plan_layout(job.size, k, self.slot_rows, job.block_m);
        if mail_len(job.size, k, h) > self.hs.mail_len
            || a + b + 2 * c > self.hs.plan_len
            || job.size * h > self.hs.cpu_out_len
        {
            return Err(DriverError::Invalid(format!(
                "a step of {} rows needs mail {} B, plan {} and cpu_out {} elements; the buffers hold {}, {} and {}",
                job.size,
                mail_len(job.size, k, h),
                a + b + 2 * c,
                job.size * h,
                self.hs.mail_len,
                self.hs.plan_len,
                self.hs.cpu_out_len
            )));
        }
        Ok(())
    }

    fn step(&mut self, job: StepJob) -> StepReport {
        let mut report = StepReport::default();
        if let Err(e) = self.check(&job) {
            self.abort(&job, 0, &mut report, e);
            return report;
        }
        for layer in 0..self.num_layers {
            let t0 = Instant::now();
            // SAFETY: flags are `[num_layers]` (Handshake contract).
            let posted = unsafe { flag(self.hs.mail_flag.add(layer)) };
            if !wait_for(posted, job.generation, self.cfg.timeout) {
                let e = DriverError::DeviceTimeout {
                    step: job.generation,
                    layer,
                    waited: self.cfg.timeout,
                };
                self.abort(&job, layer, &mut report, e);
                return report;
            }
            report.wait_seconds += t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let served = if job.idle {
                self.write_empty(&job);
                Ok(())
            } else {
                self.serve(layer, &job, &mut report)
            };
            if let Err(e) = served {
                self.abort(&job, layer, &mut report, DriverError::at_layer(layer, e));
                return report;
            }
            // SAFETY: as above. ORDERING: Release publishes the plan, the landed fills and
            // cpu_out before the flags (the device reads host memory coherently, over PCIe or C2C).
            unsafe {
                for f in [self.hs.plan_flag, self.hs.fill_flag, self.hs.cpu_flag] {
                    flag(f.add(layer)).store(job.generation, Ordering::Release);
                }
            }
            report.serve_seconds += t1.elapsed().as_secs_f64();
        }
        report
    }

    /// Serves one layer step from the mailbox ([`LayerServer::serve`]); returns once fills have
    /// landed and the plan and CPU output are written (the plan flag is up already, the fill flag
    /// is up or queued behind the fills).
    fn serve(
        &mut self,
        layer: usize,
        job: &StepJob,
        report: &mut StepReport,
    ) -> Result<(), DriverError> {
        let (k, h) = (self.cfg.top_k, self.hidden);
        let (b, size) = (job.batch, job.size);
        let n = mail_len(size, k, h);
        self.mail_copy.resize(n.div_ceil(8), 0);
        // SAFETY: the mailbox holds a step of `size` rows (checked in `check`), posted and
        // visible since the Acquire load of its flag; `mail_copy` holds at least `n` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(self.hs.mail, self.mail_copy.as_mut_ptr() as *mut u8, n)
        };
        let (w_at, h_at, _) = mail_offsets(size, k, h);
        // SAFETY: offsets within the `n` bytes copied into an 8-byte aligned buffer: the int64
        // ids first, the float32 blocks at multiples of 4 bytes.
        let (ids, inputs) = unsafe {
            let base = self.mail_copy.as_ptr() as *const u8;
            (
                std::slice::from_raw_parts(base as *const i64, b * k),
                LayerInputs {
                    weights: base.add(w_at) as *const f32,
                    hidden: base.add(h_at) as *const f32,
                    ready: true,
                },
            )
        };
        let (ns, nr, nt) = plan_layout(size, k, self.slot_rows, job.block_m);
        // SAFETY: the plan buffer holds ns + nr + 2 nt int64 (checked in `check`).
        let plan = unsafe { std::slice::from_raw_parts_mut(self.hs.plan, ns + nr + 2 * nt) };
        // The device reads `size * h`; earlier steps may have left more non-zero.
        let n_out = (size * h).max(self.cpu_out_dirty);
        // SAFETY: n_out <= cpu_out_len (`check`, and `cpu_out_dirty` never exceeds it).
        let cpu_out = unsafe { std::slice::from_raw_parts_mut(self.hs.cpu_out, n_out) };
        let step = LayerStep {
            layer,
            backend: self.cfg.backend,
            ids,
            top_k: k,
            size,
            block_m: job.block_m,
            split_fill_tiles: true,
        };
        let mut hooks = FlagHooks {
            plan_flag: self.hs.plan_flag.wrapping_add(layer),
            fill_flag: self.hs.fill_flag.wrapping_add(layer),
            generation: job.generation,
        };
        let server = Arc::clone(&self.server);
        let mut server = server.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the inputs point into `mail_copy`, which nothing writes during the call.
        let outcome = unsafe { server.serve(&step, inputs, plan, cpu_out, &mut hooks, report) }?;
        if outcome.num_cpu > 0 {
            cpu_out[b * h..size * h].fill(0.0);
            self.cpu_out_dirty = self.cpu_out_dirty.max(b * h);
        } else if self.cpu_out_dirty > 0 {
            cpu_out[..self.cpu_out_dirty].fill(0.0);
            self.cpu_out_dirty = 0;
        }
        Ok(())
    }

    /// An empty plan for `job.size` rows (every pick skipped) and a zero CPU output.
    fn write_empty(&mut self, job: &StepJob) {
        let (k, h) = (self.cfg.top_k, self.hidden);
        let (ns, nr, nt) = plan_layout(job.size, k, self.slot_rows, job.block_m);
        if ns + nr + 2 * nt <= self.hs.plan_len {
            // SAFETY: length checked against the plan buffer's capacity.
            let buf = unsafe { std::slice::from_raw_parts_mut(self.hs.plan, ns + nr + 2 * nt) };
            buf[..ns].fill(-1);
            server::align_plan(buf, ns, self.slot_rows, job.block_m, &[]);
        }
        let n = (job.size * h)
            .max(self.cpu_out_dirty)
            .min(self.hs.cpu_out_len);
        // SAFETY: n <= the cpu_out buffer's capacity.
        unsafe { std::slice::from_raw_parts_mut(self.hs.cpu_out, n) }.fill(0.0);
        self.cpu_out_dirty = 0;
    }

    /// Fails the step at `layer`: publishes an empty plan for it and every later layer so the
    /// device runs to the end of its graph, and records `error`.
    fn abort(&mut self, job: &StepJob, layer: usize, report: &mut StepReport, error: DriverError) {
        // Copies already queued must land (or time out) before their slots count as resident.
        let _ = self.lock().drain();
        // The device may be fetching the failed layer's plan, published already, while the empty
        // one replaces it: a mix of both layouts for the same rows, so every index stays in range
        // and only the failed step's output is wrong.
        self.write_empty(job);
        for l in layer..self.num_layers {
            // SAFETY: flags are `[num_layers]`. ORDERING: Release after the empty plan.
            unsafe {
                for f in [self.hs.plan_flag, self.hs.fill_flag, self.hs.cpu_flag] {
                    flag(f.add(l)).store(job.generation, Ordering::Release);
                }
            }
        }
        report.error = Some(error);
    }
}

/// Splits the tile slots `tiles[2 * n]` (row 0 as [`align_after`] wrote it, row 1 ignored) by
/// readiness: row 0 keeps the tiles whose slot is not in `filled` (hits, or -1), row 1 gets the
/// tiles of `filled` slots (-1 elsewhere), so the device runs row 0 at once and row 1 once the
/// fills have landed. A tile has one slot, so each tile is in exactly one row.
///
/// # Panics
/// If `tiles` has an odd length.
pub fn split_tiles(tiles: &mut [i64], filled: &[i32]) {
    assert!(tiles.len().is_multiple_of(2), "tiles must be [2, n]");
    let (ready, later) = tiles.split_at_mut(tiles.len() / 2);
    let mut filled: Vec<i64> = filled.iter().map(|&s| i64::from(s)).collect();
    filled.sort_unstable();
    for (r, l) in ready.iter_mut().zip(later) {
        *l = -1;
        if *r >= 0 && filled.binary_search(r).is_ok() {
            *l = std::mem::replace(r, -1);
        }
    }
}

/// Spins (then yields) until `f == want`; false after `timeout`.
fn wait_for(f: &AtomicU32, want: u32, timeout: Duration) -> bool {
    let start = Instant::now();
    let mut spins = 0u32;
    // ORDERING: Acquire pairs with the device's post (its stores of the mailbox, then a
    // system-scope release of the flag): the mailbox is read only after the flag is seen.
    while f.load(Ordering::Acquire) != want {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) && start.elapsed() > timeout {
            return false;
        }
        if spins < 1 << 16 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    true
}

#[cfg(test)]
mod tests;
