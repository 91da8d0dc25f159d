//! A persistent pool of worker threads, each pinned to one allowed CPU, fed through lock-free
//! `crossbeam` channels.
//!
//! Owns: the threads. A job is a `Fn() + Sync` that every participant (each worker and the
//! caller) runs once; the job itself claims work items from an atomic counter, so the pool
//! needs no per-item messages. [`WorkerPool::run`] returns only after every participant has left
//! the job, which is what makes lending it a stack reference sound.
//!
//! After a job a worker polls for the next one for [`WorkerPool::set_idle_spin`] before it parks:
//! a decode step calls the pool once per MoE layer, a fraction of a millisecond apart, and waking
//! parked threads (a futex wake each, then the scheduler) costs tens of microseconds of a call
//! that reads ~20 MB in ~0.25 ms.
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use crate::numa;

/// A job lent to the workers: raw pointers into the caller's stack frame of `run`.
struct JobRef {
    job: *const (dyn Fn() + Sync + 'static),
    pending: *const AtomicUsize,
    panicked: *const AtomicBool,
}

// SAFETY: the pointees are Sync and outlive every use: `run` blocks until `pending` reaches zero,
// and a worker's last access to any of them is its decrement of `pending`.
unsafe impl Send for JobRef {}

/// Persistent worker threads (`num_threads - 1` of them; the caller is the last participant).
pub struct WorkerPool {
    senders: Vec<Sender<JobRef>>,
    handles: Vec<JoinHandle<()>>,
    /// Serialises jobs from concurrent callers.
    gate: Mutex<()>,
    /// Nanoseconds a worker polls for the next job before it parks.
    idle_spin_ns: Arc<AtomicU64>,
}

/// The next job for a worker: polled for `spin_ns` nanoseconds, then waited for parked. `None`
/// once the pool is dropped.
fn next_job(rx: &Receiver<JobRef>, spin_ns: &AtomicU64) -> Option<JobRef> {
    // ORDERING: a tuning knob; any recent value will do.
    let spin = Duration::from_nanos(spin_ns.load(Ordering::Relaxed));
    if !spin.is_zero() {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            match rx.try_recv() {
                Ok(j) => return Some(j),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) => {}
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) && start.elapsed() >= spin {
                break;
            }
            std::hint::spin_loop();
        }
    }
    rx.recv().ok()
}

impl WorkerPool {
    /// Starts `num_threads - 1` workers (default: one per allowed CPU), worker `i` pinned to the
    /// `(i + 1)`-th allowed CPU (the caller's thread is left unpinned).
    pub fn new(num_threads: Option<usize>) -> Self {
        let cpus = numa::allowed_cpus();
        let n = num_threads.unwrap_or(cpus.len()).max(1);
        let mut senders = Vec::with_capacity(n - 1);
        let mut handles = Vec::with_capacity(n - 1);
        let idle_spin_ns = Arc::new(AtomicU64::new(0));
        for i in 0..n - 1 {
            let spin_ns = idle_spin_ns.clone();
            let (tx, rx): (Sender<JobRef>, Receiver<JobRef>) = crossbeam_channel::bounded(1);
            let cpu = cpus[(i + 1) % cpus.len()];
            let pin = n <= cpus.len();
            let h = std::thread::Builder::new()
                .name(format!("ft-cpu-{i}"))
                .spawn(move || {
                    if pin {
                        numa::bind_current_thread(&[cpu]);
                    }
                    while let Some(j) = next_job(&rx, &spin_ns) {
                        // SAFETY: see JobRef; the job outlives this call.
                        let job = unsafe { &*j.job };
                        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                            // SAFETY: as above.
                            // ORDERING: published by the Release decrement of `pending` below.
                            unsafe { (*j.panicked).store(true, Ordering::Relaxed) };
                        }
                        // ORDERING: Release publishes this worker's writes to the caller, which
                        // loads `pending` with Acquire. Last access to the job.
                        // SAFETY: as above.
                        unsafe { (*j.pending).fetch_sub(1, Ordering::Release) };
                    }
                })
                .expect("spawning a CPU expert worker thread");
            senders.push(tx);
            handles.push(h);
        }
        Self {
            senders,
            handles,
            gate: Mutex::new(()),
            idle_spin_ns,
        }
    }

    /// Participants of a job (workers + the caller).
    pub fn num_threads(&self) -> usize {
        self.senders.len() + 1
    }

    /// How long a worker polls for the next job before it parks (0: parks at once). Polling
    /// keeps a core busy; it pays where jobs come in quick succession (the decode driver).
    pub fn set_idle_spin(&self, spin: Duration) {
        let ns = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX);
        // ORDERING: a tuning knob, read Relaxed by the workers before each wait.
        self.idle_spin_ns.store(ns, Ordering::Relaxed);
    }

    /// The idle spin in effect.
    pub fn idle_spin(&self) -> Duration {
        // ORDERING: as in `set_idle_spin`.
        Duration::from_nanos(self.idle_spin_ns.load(Ordering::Relaxed))
    }

    /// Runs `job` on every worker and on the calling thread; returns when all are done.
    /// Returns false if any participant panicked.
    pub fn run(&self, job: &(dyn Fn() + Sync)) -> bool {
        self.run_with(job, &mut || {})
    }

    /// As [`run`](Self::run), but the calling thread first runs `alongside` while the workers
    /// start on `job`, then joins `job` itself (the decode driver queues its fills there).
    pub fn run_with(&self, job: &(dyn Fn() + Sync), alongside: &mut dyn FnMut()) -> bool {
        let _g = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        let pending = AtomicUsize::new(self.senders.len());
        let panicked = AtomicBool::new(false);
        // SAFETY: erases the lifetime of `job`; sound because this function does not return
        // before `pending` is zero, i.e. before every worker has stopped using it.
        let erased: *const (dyn Fn() + Sync + 'static) = unsafe { std::mem::transmute(job) };
        let mut sent = 0;
        for tx in &self.senders {
            if tx
                .send(JobRef {
                    job: erased,
                    pending: &pending,
                    panicked: &panicked,
                })
                .is_ok()
            {
                sent += 1;
            }
        }
        // ORDERING: workers that were never sent the job must not be waited for.
        pending.fetch_sub(self.senders.len() - sent, Ordering::Relaxed);
        let alone = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut *alongside));
        if alone.is_err() || std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
            panicked.store(true, Ordering::Relaxed);
        }
        let mut spins = 0u32;
        // ORDERING: Acquire pairs with the workers' Release decrement.
        while pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // ORDERING: after the Acquire load of `pending` == 0 above.
        !panicked.load(Ordering::Relaxed)
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.senders.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // ORDERING (whole test): counters only; `run` joins before the asserts read them.
    #[test]
    fn every_participant_runs_and_work_is_claimed_once() {
        let pool = WorkerPool::new(Some(3));
        let next = AtomicUsize::new(0);
        let sum = AtomicUsize::new(0);
        let ok = pool.run(&|| loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= 1000 {
                break;
            }
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert!(ok);
        assert_eq!(sum.load(Ordering::Relaxed), 999 * 1000 / 2);
        let bad = AtomicUsize::new(0);
        assert!(!pool.run(&|| {
            if bad.fetch_add(1, Ordering::Relaxed) == 0 {
                panic!("one participant fails");
            }
        }));
        assert!(pool.run(&|| {}));
    }

    // ORDERING (whole test): counters only; `run_with` joins before the asserts read them.
    #[test]
    fn spinning_workers_take_jobs_and_the_caller_runs_alongside_first() {
        let pool = WorkerPool::new(Some(4));
        pool.set_idle_spin(Duration::from_millis(2));
        assert_eq!(pool.idle_spin(), Duration::from_millis(2));
        for round in 0..50usize {
            let next = AtomicUsize::new(0);
            let sum = AtomicUsize::new(0);
            let mut before = usize::MAX;
            let ok = pool.run_with(
                &|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= 100 {
                        break;
                    }
                    sum.fetch_add(i + round, Ordering::Relaxed);
                },
                &mut || before = round,
            );
            assert!(ok);
            assert_eq!(before, round);
            assert_eq!(sum.load(Ordering::Relaxed), 99 * 100 / 2 + 100 * round);
        }
        pool.set_idle_spin(Duration::ZERO);
        assert!(pool.run(&|| {}));
    }
}
