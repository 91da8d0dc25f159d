//! A persistent pool of worker threads, each pinned to one allowed CPU, fed through lock-free
//! `crossbeam` channels.
//!
//! Owns: the threads. A job is a `Fn() + Sync` that every participant (each worker and the
//! caller) runs once; the job itself claims work items from an atomic counter, so the pool
//! needs no per-item messages. [`WorkerPool::run`] returns only after every participant has left
//! the job, which is what makes lending it a stack reference sound.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

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
}

impl WorkerPool {
    /// Starts `num_threads - 1` workers (default: one per allowed CPU), worker `i` pinned to the
    /// `(i + 1)`-th allowed CPU (the caller's thread is left unpinned).
    pub fn new(num_threads: Option<usize>) -> Self {
        let cpus = numa::allowed_cpus();
        let n = num_threads.unwrap_or(cpus.len()).max(1);
        let mut senders = Vec::with_capacity(n - 1);
        let mut handles = Vec::with_capacity(n - 1);
        for i in 0..n - 1 {
            let (tx, rx): (Sender<JobRef>, Receiver<JobRef>) = crossbeam_channel::bounded(1);
            let cpu = cpus[(i + 1) % cpus.len()];
            let pin = n <= cpus.len();
            let h = std::thread::Builder::new()
                .name(format!("ft-cpu-{i}"))
                .spawn(move || {
                    if pin {
                        numa::bind_current_thread(&[cpu]);
                    }
                    while let Ok(j) = rx.recv() {
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
        }
    }

    /// Participants of a job (workers + the caller).
    pub fn num_threads(&self) -> usize {
        self.senders.len() + 1
    }

    /// Runs `job` on every worker and on the calling thread; returns when all are done.
    /// Returns false if any participant panicked.
    pub fn run(&self, job: &(dyn Fn() + Sync)) -> bool {
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
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
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
}
