//! The driver against a test thread that plays the device's side of the handshake: it posts
//! routing, waits for each plan, and checks the plan, the slots' bytes and the CPU output against
//! the pool and the reference expert.
use super::*;
use crate::align::align_pairs;
use crate::cpu::{reference_expert, CpuExperts};
use crate::planner::{BandwidthProfile, Planner, PlannerConfig};
use crate::pool::{ExpertPool, PoolShape};
use std::sync::Mutex;

const L: usize = 3;
const E: usize = 8;
const H: usize = 32;
const I: usize = 16;
const K: usize = 2;
const SLOTS: usize = 3;
const MAX_ROWS: usize = 4;
const BLOCK_M: usize = 4;

/// The handshake buffers, owned by the test.
struct Shared {
    mail_flag: Vec<u32>,
    plan_flag: Vec<u32>,
    fill_flag: Vec<u32>,
    cpu_flag: Vec<u32>,
    mail: Vec<u64>,
    plan: Vec<i64>,
    cpu_out: Vec<f32>,
    slots: Vec<u8>,
}

struct Rig {
    pool: Arc<ExpertPool>,
    planner: Arc<Mutex<Planner>>,
    shared: Box<Shared>,
    driver: DecodeDriver,
}

fn rig(backend: Backend, timeout: Duration) -> Rig {
    rig_with(backend, timeout, false)
}

/// Copies that land only once waited for, as a copy engine's land some time after they are queued:
/// a fill flag raised before the wait, or a filled slot's tile run with the hits', would let the
/// device read a slot that does not hold its expert yet. Timed as `CudaCopier` times a group:
/// from its first copy to its end mark (`end_group`, else the wait).
struct DeferredCopier {
    inner: HostCopier,
    queued: Vec<(usize, *const u8, usize)>,
    first: Option<Instant>,
    end: Option<Instant>,
}

// SAFETY: as `HostCopier`; the queued sources are pool experts, which outlive the copier.
unsafe impl Send for DeferredCopier {}

impl SlotCopier for DeferredCopier {
    unsafe fn copy(
        &mut self,
        slot: usize,
        src: *const u8,
        nbytes: usize,
    ) -> Result<(), DriverError> {
        check_fill(slot, nbytes, SLOTS, usize::MAX)?;
        self.queued.push((slot, src, nbytes));
        self.first.get_or_insert_with(Instant::now);
        self.end = None;
        Ok(())
    }
    fn end_group(&mut self) -> Result<(), DriverError> {
        if self.first.is_some() {
            self.end.get_or_insert_with(Instant::now);
        }
        Ok(())
    }
    fn wait(&mut self) -> Result<Option<f64>, DriverError> {
        self.end_group()?;
        for (slot, src, nbytes) in std::mem::take(&mut self.queued) {
            // SAFETY: `src` per the trait's contract (valid until this wait returns).
            unsafe { self.inner.copy(slot, src, nbytes) }?;
        }
        self.inner.wait()?;
        Ok(self
            .first
            .take()
            .zip(self.end.take())
            .map(|(a, b)| (b - a).as_secs_f64()))
    }
    unsafe fn publish(&mut self, _flag: *mut u32, _value: u32) -> Result<bool, DriverError> {
        Ok(false) // the host raises the fill flag after the wait
    }
}

/// A rig whose copier lands its copies at once (`HostCopier`) or only when waited for
/// (`DeferredCopier`, `deferred`).
fn rig_with(backend: Backend, timeout: Duration, deferred: bool) -> Rig {
    let shape = PoolShape {
        moe_layers: (0..L).collect(),
        num_experts: E,
        hidden_size: H,
        intermediate_size: I,
        format: crate::quant::ExpertFormat::Bf16,
    };
    let pool = Arc::new(ExpertPool::random(shape, 7, Some(1)).unwrap());
    let stride = pool.shape().expert_stride();
    let (a, b, c) = plan_layout(MAX_ROWS, K, SLOTS, BLOCK_M);
    let mut shared = Box::new(Shared {
        mail_flag: vec![0; L],
        plan_flag: vec![0; L],
        fill_flag: vec![0; L],
        cpu_flag: vec![0; L],
        mail: vec![0; mail_len(MAX_ROWS, K, H).div_ceil(8)],
        plan: vec![0; a + b + 2 * c],
        cpu_out: vec![0.0; MAX_ROWS * H],
        slots: vec![0; SLOTS * stride],
    });
    let hs = Handshake {
        mail_flag: shared.mail_flag.as_mut_ptr(),
        plan_flag: shared.plan_flag.as_mut_ptr(),
        fill_flag: shared.fill_flag.as_mut_ptr(),
        cpu_flag: shared.cpu_flag.as_mut_ptr(),
        mail: shared.mail.as_ptr() as *const u8,
        mail_len: shared.mail.len() * 8,
        plan: shared.plan.as_mut_ptr(),
        plan_len: shared.plan.len(),
        cpu_out: shared.cpu_out.as_mut_ptr(),
        cpu_out_len: shared.cpu_out.len(),
    };
    let planner = Planner::new(PlannerConfig {
        num_layers: L,
        num_experts: E,
        expert_nbytes: pool.expert_nbytes(),
        capacity: SLOTS,
        policy: "lru".into(),
        profile: Some(BandwidthProfile::new(1e9, vec![(1.0, 1e9)]).unwrap()),
        reuse_weight: 0.0,
        reuse_decay: 0.9,
    })
    .unwrap();
    let cpu = Arc::new(CpuExperts::new(pool.clone(), Some(2), None).unwrap());
    // SAFETY: the slots and handshake buffers live in `shared`, boxed (stable addresses) and
    // dropped after the driver (field order of `Rig` is irrelevant: tests drop the driver first).
    let host = unsafe { HostCopier::new(shared.slots.as_mut_ptr(), stride, SLOTS) };
    let copier: Box<dyn SlotCopier> = if deferred {
        Box::new(DeferredCopier {
            inner: host,
            queued: Vec::new(),
            first: None,
            end: None,
        })
    } else {
        Box::new(host)
    };
    let cfg = DriverConfig {
        backend,
        top_k: K,
        timeout,
    };
    let planner = Arc::new(Mutex::new(planner));
    let server = LayerServer::new(planner.clone(), cpu, copier, SLOTS).unwrap();
    // SAFETY: every pointer of `hs` points into `shared`, boxed and alive for the whole test (the
    // tests drop the driver first); host memory, so nothing needs to be page-locked.
    let driver = unsafe { DecodeDriver::new(Arc::new(Mutex::new(server)), hs, cfg).unwrap() };
    Rig {
        pool,
        planner,
        shared,
        driver,
    }
}

fn atomic(v: &mut [u32], i: usize) -> &AtomicU32 {
    // SAFETY: in bounds; the driver thread accesses the flags only atomically.
    unsafe { AtomicU32::from_ptr(v.as_mut_ptr().add(i)) }
}

/// Plays the device for one step: per layer, posts `ids` (and weights 1/(j+1), hidden from a
/// formula), waits for the plan and checks it. Returns the picks the CPU ran (offload runs picks
/// there too when a layer routes to more experts than there are slots) and the tiles of filled
/// slots.
fn device_step(
    r: &mut Rig,
    generation: u32,
    batch: usize,
    size: usize,
    ids: &[[i64; K]],
) -> (usize, usize) {
    let stride = r.pool.shape().expert_stride();
    let nbytes = r.pool.expert_nbytes();
    let mut cpu_picks = 0;
    let mut filled_tiles = 0;
    for layer in 0..L {
        let sh = &mut *r.shared;
        let mail = sh.mail.as_mut_ptr() as *mut u8;
        let hidden: Vec<f32> = (0..size * H)
            .map(|i| ((i * 7 + layer) % 13) as f32 / 13.0 - 0.5)
            .collect();
        let weights: Vec<f32> = (0..size * K).map(|p| 1.0 / (p % K + 1) as f32).collect();
        // SAFETY: writes within the mailbox's size-row layout (the driver reads it after the flag).
        unsafe {
            let flat: Vec<i64> = ids[..size].iter().flatten().copied().collect();
            std::ptr::copy_nonoverlapping(flat.as_ptr(), mail as *mut i64, size * K);
            std::ptr::copy_nonoverlapping(
                weights.as_ptr(),
                mail.add(8 * size * K) as *mut f32,
                size * K,
            );
            std::ptr::copy_nonoverlapping(
                hidden.as_ptr(),
                mail.add(12 * size * K) as *mut f32,
                size * H,
            );
        }
        atomic(&mut sh.mail_flag, layer).store(generation, Ordering::Release);
        // The plan must be complete as soon as the plan flag is up (the device's slot kernel runs
        // the hits' tiles then), the filled slots once the fill flag is up (their tiles run then),
        // while the CPU experts may still be running.
        while atomic(&mut sh.plan_flag, layer).load(Ordering::Acquire) != generation {
            std::hint::spin_loop();
        }
        let (ns, nr, nt) = plan_layout(size, K, SLOTS, BLOCK_M);
        let plan = sh.plan[..ns + nr + 2 * nt].to_vec();
        let slots = &plan[..ns];
        // Padding rows are skipped; every real pick has a slot holding its expert, or -1.
        assert!(slots[batch * K..].iter().all(|&s| s == -1));
        // The first tile row (hits) runs now, while the fills may still be landing: each of its
        // slots must hold its expert already, and none may be a slot this layer fills.
        let ready = &plan[ns + nr..ns + nr + nt];
        let holds = |s: usize, e: usize| {
            let (src, _) = r.pool.expert_ptr(layer as i64, e as i64).unwrap();
            // SAFETY: a pool expert of `nbytes`.
            let want = unsafe { std::slice::from_raw_parts(src, nbytes) };
            sh.slots[s * stride..s * stride + nbytes] == *want
        };
        for t in 0..batch {
            for j in 0..K {
                let s = slots[t * K + j];
                if s >= 0 && ready.contains(&s) {
                    let e = ids[t][j] as usize;
                    assert!(
                        holds(s as usize, e),
                        "layer {layer}: hit slot {s} does not hold expert {e} when the plan is published"
                    );
                }
            }
        }
        while atomic(&mut sh.fill_flag, layer).load(Ordering::Acquire) != generation {
            std::hint::spin_loop();
        }
        let mut expected = vec![0.0f32; size * H];
        for t in 0..batch {
            for j in 0..K {
                let (e, s) = (ids[t][j] as usize, slots[t * K + j]);
                if s >= 0 {
                    let s = s as usize;
                    assert!(s < SLOTS);
                    let (src, _) = r.pool.expert_ptr(layer as i64, e as i64).unwrap();
                    // SAFETY: a pool expert of `nbytes`.
                    let want = unsafe { std::slice::from_raw_parts(src, nbytes) };
                    assert_eq!(
                        &sh.slots[s * stride..s * stride + nbytes],
                        want,
                        "slot {s} holds expert {e}"
                    );
                } else {
                    cpu_picks += 1;
                    let y = reference_expert(&r.pool, layer, e, &hidden[t * H..(t + 1) * H]);
                    for (o, v) in expected[t * H..(t + 1) * H].iter_mut().zip(y) {
                        *o += weights[t * K + j] * v;
                    }
                }
            }
        }
        let (mut pairs, mut tiles) = (vec![0; nr], vec![0; nt]);
        align_pairs(slots, SLOTS, BLOCK_M, &mut pairs, &mut tiles);
        assert_eq!(&plan[ns..ns + nr], &pairs[..]);
        // Each tile is in one row: its slot's, or -1 in both; a slot is in one row only.
        let (ready, later) = plan[ns + nr..].split_at(nt);
        for t in 0..nt {
            let (r, l) = (ready[t], later[t]);
            assert!(r == -1 || l == -1, "tile {t} in both rows");
            assert_eq!(r.max(l), tiles[t], "tile {t}");
            assert!(
                r == -1 || !later.contains(&r),
                "slot {r} both ready and filled"
            );
        }
        filled_tiles += later.iter().filter(|&&s| s >= 0).count();
        while atomic(&mut sh.cpu_flag, layer).load(Ordering::Acquire) != generation {
            std::hint::spin_loop();
        }
        for (got, want) in sh.cpu_out[..size * H].iter().zip(&expected) {
            assert!(
                (got - want).abs() <= 1e-3 + 1e-2 * want.abs(),
                "cpu_out {got} vs {want}"
            );
        }
    }
    (cpu_picks, filled_tiles)
}

fn job(generation: u32, batch: usize, size: usize) -> StepJob {
    StepJob {
        batch,
        size,
        generation,
        block_m: BLOCK_M,
        idle: false,
    }
}

#[test]
fn every_backend_serves_steps_through_the_handshake() {
    let routing: [[i64; K]; MAX_ROWS] = [[0, 1], [2, 3], [1, 4], [7, 0]];
    for backend in [Backend::Offload, Backend::Cpu, Backend::Hybrid] {
        let mut r = rig(backend, Duration::from_secs(20));
        let (mut total_cpu, mut total_filled) = (0, 0);
        for generation in 1..=4u32 {
            let (batch, size) = if generation % 2 == 0 { (3, 4) } else { (1, 2) };
            let ids: Vec<[i64; K]> = (0..size)
                .map(|t| routing[(t + generation as usize) % MAX_ROWS])
                .collect();
            r.driver.start(job(generation, batch, size)).unwrap();
            let (cpu_picks, filled) = device_step(&mut r, generation, batch, size, &ids);
            total_filled += filled;
            r.driver.wait_served(L - 1, generation).unwrap();
            let report = r.driver.finish().unwrap();
            assert!(report.error.is_none(), "{:?}", report.error);
            assert_eq!(report.cpu_picks, cpu_picks);
            total_cpu += cpu_picks;
            if backend == Backend::Cpu {
                assert_eq!(report.fills, 0);
            }
        }
        let planner = r.planner.lock().unwrap();
        let (pcie, cpu) = planner.bandwidth();
        if backend != Backend::Offload {
            assert!(total_cpu > 0, "{backend:?} ran nothing on the CPU");
            // The server booked the CPU experts' bandwidth in the planner (refining q*).
            assert!(
                cpu.num_samples() > 0 && cpu.ratio().is_some(),
                "{backend:?}"
            );
        }
        if backend != Backend::Cpu {
            // The host copier times every group of fills.
            assert!(pcie.num_samples() > 0, "{backend:?}");
        }
        drop(planner);
        if backend != Backend::Cpu {
            assert!(total_filled > 0, "{backend:?} filled no slot");
        }
    }
}

#[test]
fn a_device_that_never_posts_fails_the_step_and_releases_every_layer() {
    let mut r = rig(Backend::Offload, Duration::from_millis(50));
    r.driver.start(job(1, 1, 1)).unwrap();
    let report = r.driver.finish().unwrap();
    assert!(
        r.driver.wait_served(L - 1, 1).is_ok(),
        "an aborted step releases every layer"
    );
    assert!(r.driver.wait_served(L, 1).is_err());
    let err = report.error.expect("a timeout");
    assert_eq!(err.timed_out_at(), Some((1, 0)), "{err}");
    assert_eq!(err.kind(), crate::error::ErrorKind::Timeout);
    assert!(
        err.to_string().contains("did not post MoE layer 0"),
        "{err}"
    );
    let late = r.driver.wait_served(L - 1, 7).unwrap_err();
    assert_eq!(late.timed_out_at(), Some((7, L - 1)), "{late}");
    let sh = &mut *r.shared;
    for l in 0..L {
        for f in [&mut sh.plan_flag, &mut sh.fill_flag, &mut sh.cpu_flag] {
            assert_eq!(atomic(f, l).load(Ordering::Acquire), 1);
        }
    }
    let (ns, nr, nt) = plan_layout(1, K, SLOTS, BLOCK_M);
    assert!(sh.plan[..ns].iter().all(|&s| s == -1));
    assert!(sh.plan[ns + nr..ns + nr + 2 * nt].iter().all(|&t| t == -1));
    // The driver still serves the next step.
    r.driver.start(job(2, 1, 1)).unwrap();
    device_step(&mut r, 2, 1, 1, &[[3, 5]]);
    assert!(r.driver.finish().unwrap().error.is_none());
}

#[test]
fn bad_routing_and_oversized_steps_are_errors_not_hangs() {
    let mut r = rig(Backend::Hybrid, Duration::from_secs(20));
    r.driver.start(job(1, 1, 1)).unwrap();
    // An expert id out of range: the planner refuses, every layer is released.
    let sh = &mut *r.shared;
    // SAFETY: the mailbox holds at least one row.
    unsafe { *(sh.mail.as_mut_ptr() as *mut i64) = E as i64 };
    for l in 0..L {
        atomic(&mut sh.mail_flag, l).store(1, Ordering::Release);
    }
    let err = r.driver.finish().unwrap().error.expect("a plan error");
    assert_eq!(err.kind(), crate::error::ErrorKind::Index, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("MoE layer 0") && msg.contains("out of range"),
        "{msg}"
    );
    r.driver.start(job(2, 5, 5)).unwrap();
    let msg = r
        .driver
        .finish()
        .unwrap()
        .error
        .expect("too large for the buffers")
        .to_string();
    assert!(msg.contains("the buffers hold"), "{msg}");
    assert!(r.driver.start(job(3, 2, 1)).is_err(), "batch above size");
    assert!(r.driver.finish().is_err(), "nothing running");
}

#[test]
fn an_idle_step_answers_empty_plans_without_planning() {
    let mut r = rig(Backend::Offload, Duration::from_secs(20));
    r.driver
        .start(StepJob {
            idle: true,
            ..job(1, 2, 2)
        })
        .unwrap();
    let sh = &mut *r.shared;
    for l in 0..L {
        atomic(&mut sh.mail_flag, l).store(1, Ordering::Release);
        while atomic(&mut sh.cpu_flag, l).load(Ordering::Acquire) != 1 {
            std::hint::spin_loop();
        }
    }
    let report = r.driver.finish().unwrap();
    assert!(report.error.is_none());
    assert_eq!((report.fills, report.cpu_experts), (0, 0));
    assert!(sh.plan[..2 * K].iter().all(|&s| s == -1));
    r.driver.start(job(2, 1, 1)).unwrap();
    device_step(&mut r, 2, 1, 1, &[[6, 2]]);
    assert!(r.driver.finish().unwrap().error.is_none());
}

#[test]
fn cpu_output_of_a_bigger_earlier_step_never_leaks_into_a_later_one() {
    // 3 slots: 8 distinct experts run 5 on the CPU (4 rows dirty); then steps whose experts all fit
    // in the slots run nothing there, and every row the device reads must be zero again.
    let mut r = rig(Backend::Offload, Duration::from_secs(20));
    let steps: [(usize, Vec<[i64; K]>); 3] = [
        (4, vec![[0, 1], [2, 3], [4, 5], [6, 7]]),
        (2, vec![[0, 1], [0, 1]]),
        (4, vec![[0, 1], [1, 0], [0, 1], [1, 0]]),
    ];
    for (generation, (size, ids)) in (1u32..).zip(steps) {
        r.driver.start(job(generation, size, size)).unwrap();
        let (cpu_picks, _) = device_step(&mut r, generation, size, size, &ids);
        assert_eq!(cpu_picks > 0, generation == 1);
        assert!(r.driver.finish().unwrap().error.is_none());
    }
}

#[test]
fn fills_that_land_late_are_never_read_early_across_evicting_steps() {
    // 3 slots for 3 layers x 8 experts: every step evicts, and a layer routed to more than 3
    // experts runs the rest on the CPU (offload) or splits them (hybrid). The copier lands each
    // layer's fills only when the driver waits for them, so a device that ran a filled slot's tile
    // with the hits', or a fill flag raised before the fills landed, would read a stale slot;
    // `device_step` checks the hits' slots when the plan flag rises and every slot when the fill
    // flag does, in 40 steps of random routing at random batch sizes.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as usize
    };
    for backend in [Backend::Offload, Backend::Hybrid] {
        let mut r = rig_with(backend, Duration::from_secs(20), true);
        let mut filled = 0;
        for generation in 1..=40u32 {
            let size = 1 + next(MAX_ROWS);
            let batch = 1 + next(size);
            let ids: Vec<[i64; K]> = (0..size)
                .map(|_| {
                    let a = next(E);
                    [a as i64, ((a + 1 + next(E - 1)) % E) as i64]
                })
                .collect();
            r.driver.start(job(generation, batch, size)).unwrap();
            filled += device_step(&mut r, generation, batch, size, &ids).1;
            let report = r.driver.finish().unwrap();
            assert!(report.error.is_none(), "{:?}", report.error);
        }
        let evictions: u64 = r
            .planner
            .lock()
            .unwrap()
            .counters()
            .iter()
            .map(|c| c.evictions)
            .sum();
        assert!(
            filled > 0 && evictions > 0,
            "{backend:?}: {filled} filled tiles, {evictions} evictions"
        );
    }
}

#[test]
fn fill_timing_ends_where_the_copies_do_not_after_the_cpu_experts() {
    // The fills are queued as the CPU experts start and waited for after them. Timed to the wait,
    // a copy would take the CPU part's time, so the more misses q* sent to the CPU the slower
    // PCIe would measure and the more it would send there (measured on the H200: NVFP4 fills at
    // 12 GB/s against 52 in the profile, 97 % of the misses on the CPU). The copier here times
    // as the CUDA one does, from the first copy to the end mark.
    let mut r = rig_with(Backend::Hybrid, Duration::from_secs(20), true);
    let (mut fill_s, mut cpu_s, mut both) = (0.0, 0.0, 0);
    for generation in 1..=40u32 {
        let (batch, size) = (MAX_ROWS, MAX_ROWS);
        let ids: Vec<[i64; K]> = (0..size)
            .map(|row| {
                let a = (row * 3 + generation as usize) % E;
                [a as i64, ((a + 1 + row % (E - 1)) % E) as i64]
            })
            .collect();
        r.driver.start(job(generation, batch, size)).unwrap();
        device_step(&mut r, generation, batch, size, &ids);
        let report = r.driver.finish().unwrap();
        assert!(report.error.is_none(), "{:?}", report.error);
        if report.timed_fill_layers > 0 && report.cpu_layers > 0 {
            fill_s += report.timed_fill_seconds;
            cpu_s += report.cpu_seconds;
            both += 1;
        }
    }
    assert!(both > 0, "no step both filled and ran CPU experts");
    assert!(
        fill_s < 0.5 * cpu_s,
        "fills timed {fill_s:.6} s against {cpu_s:.6} s of CPU experts in {both} steps"
    );
}
