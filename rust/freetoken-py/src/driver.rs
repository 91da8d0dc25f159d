//! `LayerServer` (one MoE layer step, GIL released) and `DecodeDriver` (the host side of a
//! decode step captured as one CUDA graph), with their typed arguments and reports.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use freetoken_core::driver::server::{LayerHooks, LayerInputs, LayerServer, LayerStep};
use freetoken_core::driver::{
    cuda::CudaCopier, mail_offsets, plan_layout, DecodeDriver, DriverConfig, Handshake, HostCopier,
    SlotCopier, StepJob, StepReport,
};
use freetoken_core::error::DriverError;
use freetoken_core::planner::Backend;
use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arrays::readwrite;
use crate::cache::lock;
use crate::cpu::PyCpuExperts;
use crate::errors::{invalid, py_err, IntoPyErr};
use crate::planner::PyPlanner;

/// `(address, elements)` of a writable C-contiguous numpy array of `T`.
fn buffer<T: numpy::Element>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    dtype: &str,
) -> PyResult<(*mut T, usize)> {
    let n = readwrite::<T>(obj, what, dtype)?.len();
    let a = obj.cast::<PyArrayDyn<T>>()?; // checked by `readwrite`
    Ok((a.data(), n))
}

/// A driver error as its Python class; a handshake timeout also carries `layer` and `step`.
fn driver_err(e: DriverError) -> PyErr {
    let at = e.timed_out_at();
    let err = py_err(e.kind(), e.to_string());
    if let Some((step, layer)) = at {
        Python::attach(|py| {
            let v = err.value(py);
            // Attributes on a fresh exception instance cannot fail short of memory exhaustion.
            let _ = v.setattr("layer", layer);
            let _ = v.setattr("step", step);
        });
    }
    err
}

/// The device slots of a CUDA expert cache, for the CUDA driver-API copier.
#[pyclass(frozen, get_all, name = "CudaSlots", module = "freetoken._core")]
#[derive(Clone, Debug)]
pub struct PyCudaSlots {
    /// CUDA device ordinal.
    ordinal: i32,
    /// `CUstream` handle of the copy stream (torch's `Stream.cuda_stream`).
    stream: usize,
    /// Device address of row 0.
    ptr: u64,
    /// Bytes per row.
    stride: usize,
    /// Rows.
    rows: usize,
}

#[pymethods]
impl PyCudaSlots {
    #[new]
    #[pyo3(signature = (*, ordinal, stream, ptr, stride, rows))]
    fn new(ordinal: i32, stream: usize, ptr: u64, stride: usize, rows: usize) -> Self {
        Self {
            ordinal,
            stream,
            ptr,
            stride,
            rows,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "CudaSlots(ordinal={}, stream={:#x}, ptr={:#x}, stride={}, rows={})",
            self.ordinal, self.stream, self.ptr, self.stride, self.rows
        )
    }
}

/// Serves one MoE layer step at a time (see `freetoken_core::driver::server`).
#[pyclass(frozen, name = "LayerServer", module = "freetoken._core")]
pub struct PyLayerServer {
    pub(crate) inner: Arc<Mutex<LayerServer>>,
    hidden: usize,
    /// Kept here so that no call made with the GIL held waits for the server's lock, which `serve`
    /// holds while its callbacks wait for the GIL.
    slot_rows: usize,
    num_layers: usize,
    /// The host slots (CPU device), kept alive for the copier.
    _slots: Option<Py<PyAny>>,
}

/// Calls Python at the layer step's hook points; keeps the first Python error.
struct PyHooks<'a> {
    on_fills_queued: Option<&'a Py<PyAny>>,
    fetch_inputs: Option<&'a Py<PyAny>>,
    error: Option<PyErr>,
}

impl PyHooks<'_> {
    /// Runs `call` with the GIL; a Python error is kept for the caller and fails the step.
    fn call(
        &mut self,
        what: &str,
        call: impl FnOnce(Python<'_>) -> PyResult<Py<PyAny>>,
    ) -> Result<(), DriverError> {
        Python::attach(|py| call(py).map(drop)).map_err(|e| {
            self.error = Some(e);
            DriverError::Hook(format!("{what} raised"))
        })
    }
}

impl LayerHooks for PyHooks<'_> {
    fn fills_queued(
        &mut self,
        _copier: &mut dyn SlotCopier,
        num_fills: usize,
    ) -> Result<bool, DriverError> {
        if let Some(f) = self.on_fills_queued {
            self.call("on_fills_queued", |py| f.call1(py, (num_fills,)))?;
        }
        Ok(false)
    }

    fn fetch_inputs(&mut self) -> Result<(), DriverError> {
        match self.fetch_inputs {
            Some(f) => self.call("fetch_inputs", |py| f.call0(py)),
            None => Err(DriverError::Invalid(
                "the CPU experts need the hidden states: pass inputs_ready=True or fetch_inputs"
                    .into(),
            )),
        }
    }
}

/// A raw pointer that crosses into the GIL-free closure (the arrays it points into are held by
/// the caller's frame for the call).
#[derive(Clone, Copy)]
struct Raw<T>(*mut T);
// SAFETY: only dereferenced inside `serve`'s call, while the Python arrays are alive and not
// resized (numpy arrays own fixed buffers).
unsafe impl<T> Send for Raw<T> {}

#[pymethods]
impl PyLayerServer {
    #[new]
    #[pyo3(signature = (planner, cpu, slot_rows, *, slots=None, cuda=None))]
    fn new(
        planner: &Bound<'_, PyPlanner>,
        cpu: &Bound<'_, PyCpuExperts>,
        slot_rows: usize,
        slots: Option<&Bound<'_, PyAny>>,
        cuda: Option<PyCudaSlots>,
    ) -> PyResult<Self> {
        let pool = cpu.get().inner.pool().clone();
        let stride = pool.shape().expert_stride();
        let (copier, keep): (Box<dyn SlotCopier>, _) = match (slots, cuda) {
            (Some(s), None) => {
                let (p, n) = buffer::<u8>(s, "slots", "uint8")?;
                if n < slot_rows * stride {
                    return Err(invalid(format!(
                        "slots holds {n} bytes, {slot_rows} rows of {stride} needed"
                    )));
                }
                // SAFETY: the array is kept alive in `_slots` for the server's lifetime.
                let c = unsafe { HostCopier::new(p, stride, slot_rows) };
                (Box::new(c), Some(s.clone().unbind()))
            }
            (None, Some(c)) => {
                if c.stride != stride || c.rows < slot_rows {
                    return Err(invalid(format!(
                        "cuda slots: {} rows of {} bytes, but the pool's experts take {stride} and {slot_rows} rows are indexed",
                        c.rows, c.stride
                    )));
                }
                // SAFETY: the caller (the expert-cache backend) owns the device slots and the
                // stream, and drops the server first.
                let copier = unsafe { CudaCopier::new(c.ordinal, c.stream, c.ptr, stride, c.rows) }
                    .map_err(driver_err)?;
                (Box::new(copier), None)
            }
            _ => {
                return Err(invalid(
                    "give either slots (a host uint8 array) or cuda (a CudaSlots)",
                ))
            }
        };
        let planner = planner.get().inner.clone();
        let cpu = cpu.get().inner.clone();
        let server = LayerServer::new(planner, cpu, copier, slot_rows).map_err(driver_err)?;
        Ok(Self {
            inner: Arc::new(Mutex::new(server)),
            hidden: pool.hidden_size(),
            slot_rows,
            num_layers: pool.num_layers(),
            _slots: keep,
        })
    }

    /// Rows and tiles of a step's plan for `tokens` rows: `(topk slots, sorted pairs, tiles)`.
    fn plan_layout(&self, tokens: usize, top_k: usize, block_m: usize) -> (usize, usize, usize) {
        plan_layout(tokens, top_k, self.slot_rows, block_m)
    }

    #[pyo3(signature = (layer, backend, ids, weights, hidden, plan, cpu_out, block_m, *, inputs_ready=true, on_fills_queued=None, fetch_inputs=None))]
    #[allow(clippy::too_many_arguments)]
    fn serve(
        &self,
        py: Python<'_>,
        layer: usize,
        backend: &str,
        ids: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
        plan: &Bound<'_, PyAny>,
        cpu_out: &Bound<'_, PyAny>,
        block_m: usize,
        inputs_ready: bool,
        on_fills_queued: Option<Py<PyAny>>,
        fetch_inputs: Option<Py<PyAny>>,
    ) -> PyResult<PyLayerReport> {
        let backend = backend.parse::<Backend>().py()?;
        let ids_arr = ids
            .cast::<PyArrayDyn<i64>>()
            .map_err(|_| invalid("ids must be an int64 numpy array [T, k]"))?;
        let (tokens, k) = match ids_arr.shape() {
            [t, k] => (*t, *k),
            s => return Err(invalid(format!("ids must be [T, k], got shape {s:?}"))),
        };
        let (ids_p, n_ids) = buffer::<i64>(ids, "ids", "int64")?;
        let (w_p, n_w) = buffer::<f32>(weights, "weights", "float32")?;
        let (h_p, n_h) = buffer::<f32>(hidden, "hidden", "float32")?;
        if n_ids != tokens * k || n_w < tokens * k || n_h < tokens * self.hidden {
            return Err(invalid(format!(
                "ids ({n_ids}), weights ({n_w}) and hidden ({n_h}) must hold [T={tokens}, k={k}] and [T, H={}]",
                self.hidden
            )));
        }
        let (plan_p, n_plan) = buffer::<i64>(plan, "plan", "int64")?;
        let (out_p, n_out) = buffer::<f32>(cpu_out, "cpu_out", "float32")?;
        let raw = (Raw(ids_p), Raw(w_p), Raw(h_p), Raw(plan_p), Raw(out_p));
        let inner = &self.inner;
        let mut hooks = PyHooks {
            on_fills_queued: on_fills_queued.as_ref(),
            fetch_inputs: fetch_inputs.as_ref(),
            error: None,
        };
        let mut report = StepReport::default();
        let (hooks_ref, report_ref) = (&mut hooks, &mut report);
        let served = py.detach(move || {
            let (ids_p, w_p, h_p, plan_p, out_p) = raw;
            // SAFETY: the arrays are alive for the call (borrowed by this frame), of the lengths
            // checked above; numpy lets no one resize them meanwhile.
            let (ids, plan, out) = unsafe {
                (
                    std::slice::from_raw_parts(ids_p.0, n_ids),
                    std::slice::from_raw_parts_mut(plan_p.0, n_plan),
                    std::slice::from_raw_parts_mut(out_p.0, n_out),
                )
            };
            let step = LayerStep {
                layer,
                backend,
                ids,
                top_k: k,
                size: tokens,
                block_m,
                split_fill_tiles: false,
            };
            let inputs = LayerInputs {
                weights: w_p.0,
                hidden: h_p.0,
                ready: inputs_ready,
            };
            let mut server = lock(inner);
            // SAFETY: weights and hidden are arrays of the checked lengths, written meanwhile
            // only by `fetch_inputs` (the caller's contract in the stub).
            let r = unsafe { server.serve(&step, inputs, plan, out, hooks_ref, report_ref) };
            if r.is_err() {
                // The planned fills are queued: they land before the slots are read again.
                let _ = server.drain();
            }
            r
        });
        match (served, hooks.error.take()) {
            (Ok(o), _) => Ok(PyLayerReport {
                num_hits: o.num_hits,
                num_fills: o.num_fills,
                num_cpu: o.num_cpu,
                num_pairs: o.num_pairs,
                num_tiles: o.num_tiles,
                report: StepReportFields::from(&report),
            }),
            (Err(_), Some(e)) => Err(e),
            (Err(e), None) => Err(driver_err(e)),
        }
    }
}

/// The figures of a step report, without its error.
#[derive(Clone, Debug)]
struct StepReportFields {
    fills: usize,
    fill_bytes: usize,
    timed_fill_bytes: usize,
    timed_fill_seconds: f64,
    timed_fill_layers: usize,
    cpu_experts: usize,
    cpu_picks: usize,
    cpu_seconds: f64,
    cpu_layers: usize,
    wait_seconds: f64,
    serve_seconds: f64,
    plan_seconds: f64,
    issue_seconds: f64,
    fill_wait_seconds: f64,
    stream_flags: usize,
}

impl From<&StepReport> for StepReportFields {
    fn from(r: &StepReport) -> Self {
        Self {
            fills: r.fills,
            fill_bytes: r.fill_bytes,
            timed_fill_bytes: r.timed_fill_bytes,
            timed_fill_seconds: r.timed_fill_seconds,
            timed_fill_layers: r.timed_fill_layers,
            cpu_experts: r.cpu_experts,
            cpu_picks: r.cpu_picks,
            cpu_seconds: r.cpu_seconds,
            cpu_layers: r.cpu_layers,
            wait_seconds: r.wait_seconds,
            serve_seconds: r.serve_seconds,
            plan_seconds: r.plan_seconds,
            issue_seconds: r.issue_seconds,
            fill_wait_seconds: r.fill_wait_seconds,
            stream_flags: r.stream_flags,
        }
    }
}

/// What one layer step served (`LayerServer.serve`).
#[pyclass(frozen, name = "LayerReport", module = "freetoken._core")]
pub struct PyLayerReport {
    /// Distinct experts found resident.
    #[pyo3(get)]
    num_hits: usize,
    /// Experts copied into slots.
    #[pyo3(get)]
    num_fills: usize,
    /// Experts run on the CPU (`cpu_out` was written only when this is positive).
    #[pyo3(get)]
    num_cpu: usize,
    /// Sorted-pair entries of the plan's tile alignment.
    #[pyo3(get)]
    num_pairs: usize,
    /// Tiles per tile row of the plan.
    #[pyo3(get)]
    num_tiles: usize,
    report: StepReportFields,
}

#[pymethods]
impl PyLayerReport {
    /// The step's figures (a `StepReport` of one layer).
    #[getter]
    fn step(&self) -> PyStepReport {
        PyStepReport(self.report.clone())
    }
}

/// What one decode step did (`DecodeDriver.finish`): counts, bytes and seconds by phase.
#[pyclass(frozen, name = "StepReport", module = "freetoken._core")]
pub struct PyStepReport(StepReportFields);

macro_rules! getters {
    ($($name:ident: $t:ty),*) => {
        #[pymethods]
        impl PyStepReport {
            $(#[getter] fn $name(&self) -> $t { self.0.$name })*
            fn __repr__(&self) -> String {
                let mut s = String::from("StepReport(");
                $(s.push_str(&format!("{}={:?}, ", stringify!($name), self.0.$name));)*
                s.truncate(s.len() - 2);
                s + ")"
            }
        }
    };
}
getters!(
    fills: usize, fill_bytes: usize, timed_fill_bytes: usize, timed_fill_seconds: f64,
    timed_fill_layers: usize, cpu_experts: usize, cpu_picks: usize, cpu_seconds: f64,
    cpu_layers: usize, wait_seconds: f64, serve_seconds: f64, plan_seconds: f64,
    issue_seconds: f64, fill_wait_seconds: f64, stream_flags: usize
);

/// The page-locked host buffers of the decode handshake (layouts in the driver's module doc).
#[pyclass(frozen, name = "HandshakeBuffers", module = "freetoken._core")]
pub struct PyHandshakeBuffers {
    hs: Handshake,
    keep: Vec<Py<PyAny>>,
}

// SAFETY: the pointers point into the numpy arrays in `keep`, which live as long as this object.
unsafe impl Send for PyHandshakeBuffers {}
// SAFETY: as above; the object is frozen (never mutated after construction).
unsafe impl Sync for PyHandshakeBuffers {}

#[pymethods]
impl PyHandshakeBuffers {
    #[new]
    #[pyo3(signature = (*, mail_flag, plan_flag, fill_flag, cpu_flag, mail, plan, cpu_out))]
    fn new(
        mail_flag: &Bound<'_, PyAny>,
        plan_flag: &Bound<'_, PyAny>,
        fill_flag: &Bound<'_, PyAny>,
        cpu_flag: &Bound<'_, PyAny>,
        mail: &Bound<'_, PyAny>,
        plan: &Bound<'_, PyAny>,
        cpu_out: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let mut flags = Vec::new();
        let mut layers = None;
        for (obj, what) in [
            (mail_flag, "mail_flag"),
            (plan_flag, "plan_flag"),
            (fill_flag, "fill_flag"),
            (cpu_flag, "cpu_flag"),
        ] {
            let (p, n) = buffer::<u32>(obj, what, "uint32")?;
            if *layers.get_or_insert(n) != n {
                return Err(invalid(
                    "the four flag arrays must have one flag per MoE layer each",
                ));
            }
            flags.push(p);
        }
        let (mail_p, mail_len) = buffer::<u8>(mail, "mail", "uint8")?;
        if !(mail_p as usize).is_multiple_of(8) {
            return Err(invalid("mail must be 8-byte aligned (it holds int64 ids)"));
        }
        let (plan_p, plan_len) = buffer::<i64>(plan, "plan", "int64")?;
        let (out_p, out_len) = buffer::<f32>(cpu_out, "cpu_out", "float32")?;
        let hs = Handshake {
            mail_flag: flags[0],
            plan_flag: flags[1],
            fill_flag: flags[2],
            cpu_flag: flags[3],
            mail: mail_p,
            mail_len,
            plan: plan_p,
            plan_len,
            cpu_out: out_p,
            cpu_out_len: out_len,
        };
        let keep = [
            mail_flag, plan_flag, fill_flag, cpu_flag, mail, plan, cpu_out,
        ]
        .iter()
        .map(|o| (*o).clone().unbind())
        .collect();
        Ok(Self { hs, keep })
    }

    #[getter]
    fn num_layers(&self, py: Python<'_>) -> PyResult<usize> {
        self.keep[0].bind(py).len()
    }
}

/// Byte offsets of the mailbox's parts for `size` rows: `(weights, hidden, end)` (ids at 0).
#[pyfunction]
pub fn mail_layout(size: usize, top_k: usize, hidden: usize) -> (usize, usize, usize) {
    mail_offsets(size, top_k, hidden)
}

/// Serves the MoE layers of decode steps from a host thread (see `freetoken_core::driver`).
#[pyclass(frozen, name = "DecodeDriver", module = "freetoken._core")]
pub struct PyDecodeDriver {
    inner: Mutex<DecodeDriver>,
    /// The handshake buffers and the server, kept alive for the driver thread.
    _keep: (Py<PyHandshakeBuffers>, Py<PyLayerServer>),
}

#[pymethods]
impl PyDecodeDriver {
    #[new]
    #[pyo3(signature = (server, buffers, backend, top_k, timeout_s=10.0))]
    fn new(
        server: &Bound<'_, PyLayerServer>,
        buffers: &Bound<'_, PyHandshakeBuffers>,
        backend: &str,
        top_k: usize,
        timeout_s: f64,
    ) -> PyResult<Self> {
        let backend = backend.parse::<Backend>().py()?;
        let layers = server.get().num_layers;
        let n = buffers.get().num_layers(buffers.py())?;
        if n != layers {
            return Err(invalid(format!(
                "the handshake has {n} flags per row, one per MoE layer ({layers}) expected"
            )));
        }
        if !(timeout_s > 0.0 && timeout_s.is_finite()) {
            return Err(invalid(format!(
                "timeout_s must be positive, got {timeout_s}"
            )));
        }
        let cfg = DriverConfig {
            backend,
            top_k,
            timeout: Duration::from_secs_f64(timeout_s),
        };
        let hs = buffers.get().hs;
        // SAFETY: the buffers live in `_keep`; mapped for the device by the caller.
        let inner = unsafe { DecodeDriver::new(server.get().inner.clone(), hs, cfg) }
            .map_err(driver_err)?;
        Ok(Self {
            inner: Mutex::new(inner),
            _keep: (buffers.clone().unbind(), server.clone().unbind()),
        })
    }

    #[pyo3(signature = (batch, size, generation, block_m, idle=false))]
    fn start(
        &self,
        batch: usize,
        size: usize,
        generation: u32,
        block_m: usize,
        idle: bool,
    ) -> PyResult<()> {
        lock(&self.inner)
            .start(StepJob {
                batch,
                size,
                generation,
                block_m,
                idle,
            })
            .map_err(driver_err)
    }

    /// Blocks (GIL released) until `layer` (pool layer) of step `generation` is served.
    fn wait_served(&self, py: Python<'_>, layer: usize, generation: u32) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| lock(inner).wait_served(layer, generation))
            .map_err(driver_err)
    }

    fn finish(&self, py: Python<'_>) -> PyResult<PyStepReport> {
        let mut report = py
            .detach(|| lock(&self.inner).finish())
            .map_err(driver_err)?;
        if let Some(e) = report.error.take() {
            return Err(driver_err(e));
        }
        Ok(PyStepReport(StepReportFields::from(&report)))
    }
}
