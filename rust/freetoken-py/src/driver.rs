//! `DecodeDriver`: the host side of a decode step captured as one CUDA graph.
use std::sync::Mutex;
use std::time::Duration;

use freetoken_core::driver::{
    cuda::CudaCopier, DecodeDriver, DriverConfig, Handshake, HostCopier, SlotCopier, StepJob,
};
use freetoken_core::planner::Backend;
use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};

use crate::arrays::readwrite;
use pyo3::prelude::*;
use pyo3::types::PyDict;

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

/// Serves the MoE layers of decode steps from a host thread (see `freetoken_core::driver`).
#[pyclass(frozen, name = "DecodeDriver", module = "freetoken._core")]
pub struct PyDecodeDriver {
    inner: Mutex<DecodeDriver>,
    /// The handshake buffers and slots, kept alive for the driver thread.
    _keep: Vec<Py<PyAny>>,
}

#[pymethods]
impl PyDecodeDriver {
    #[new]
    #[pyo3(signature = (planner, cpu, backend, top_k, slot_rows, mail_flag, plan_flag, fill_flag, cpu_flag, mail, plan, cpu_out, slots=None, cuda=None, timeout_s=10.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        planner: &Bound<'_, PyPlanner>,
        cpu: &Bound<'_, PyCpuExperts>,
        backend: &str,
        top_k: usize,
        slot_rows: usize,
        mail_flag: &Bound<'_, PyAny>,
        plan_flag: &Bound<'_, PyAny>,
        fill_flag: &Bound<'_, PyAny>,
        cpu_flag: &Bound<'_, PyAny>,
        mail: &Bound<'_, PyAny>,
        plan: &Bound<'_, PyAny>,
        cpu_out: &Bound<'_, PyAny>,
        slots: Option<&Bound<'_, PyAny>>,
        cuda: Option<(i32, usize, u64, usize, usize)>,
        timeout_s: f64,
    ) -> PyResult<Self> {
        let backend = backend.parse::<Backend>().py()?;
        let layers = cpu.get().inner.pool().num_layers();
        let mut flags = Vec::new();
        for (obj, what) in [
            (mail_flag, "mail_flag"),
            (plan_flag, "plan_flag"),
            (fill_flag, "fill_flag"),
            (cpu_flag, "cpu_flag"),
        ] {
            let (p, n) = buffer::<u32>(obj, what, "uint32")?;
            if n != layers {
                return Err(invalid(format!(
                    "{what} has {n} flags, one per MoE layer ({layers}) expected"
                )));
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
        let stride = cpu.get().inner.pool().shape().expert_stride();
        let mut keep: Vec<Py<PyAny>> = [
            mail_flag, plan_flag, fill_flag, cpu_flag, mail, plan, cpu_out,
        ]
        .iter()
        .map(|o| (*o).clone().unbind())
        .collect();
        let copier: Box<dyn SlotCopier> = match (slots, cuda) {
            (Some(s), None) => {
                let (p, n) = buffer::<u8>(s, "slots", "uint8")?;
                if n < slot_rows * stride {
                    return Err(invalid(format!(
                        "slots holds {n} bytes, {slot_rows} rows of {stride} needed"
                    )));
                }
                keep.push(s.clone().unbind());
                // SAFETY: the array is kept alive in `_keep` for the driver's lifetime.
                Box::new(unsafe { HostCopier::new(p, stride, slot_rows) })
            }
            (None, Some((ordinal, stream, ptr, row_stride, rows))) => {
                if row_stride != stride || rows < slot_rows {
                    return Err(invalid(format!(
                        "cuda slots: {rows} rows of {row_stride} bytes, but the pool's experts take {stride} and {slot_rows} rows are indexed"
                    )));
                }
                // SAFETY: the caller (the expert-cache backend) owns the device slots and the
                // stream, and drops the driver first.
                Box::new(unsafe { CudaCopier::new(ordinal, stream, ptr, stride, rows) }.py()?)
            }
            _ => {
                return Err(invalid(
                    "give either slots (a host array) or cuda=(ordinal, stream, ptr, stride, rows)",
                ))
            }
        };
        if !(timeout_s > 0.0 && timeout_s.is_finite()) {
            return Err(invalid(format!(
                "timeout_s must be positive, got {timeout_s}"
            )));
        }
        let cfg = DriverConfig {
            backend,
            top_k,
            slot_rows,
            timeout: Duration::from_secs_f64(timeout_s),
        };
        let planner = planner.get().inner.clone();
        let cpu = cpu.get().inner.clone();
        // SAFETY: every buffer is kept alive in `_keep`; mapped for the device by the caller.
        let inner = unsafe { DecodeDriver::new(planner, cpu, copier, hs, cfg) }.py()?;
        Ok(Self {
            inner: Mutex::new(inner),
            _keep: keep,
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
            .py()
    }

    /// Blocks (GIL released) until `layer` (pool layer) of step `generation` is served.
    fn wait_served(&self, py: Python<'_>, layer: usize, generation: u32) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| lock(inner).wait_served(layer, generation))
            .py()
    }

    fn finish<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let report = py.detach(|| lock(&self.inner).finish()).py()?;
        if let Some(msg) = report.error {
            return Err(py_err(freetoken_core::error::ErrorKind::Internal, msg));
        }
        let d = PyDict::new(py);
        d.set_item("fills", report.fills)?;
        d.set_item("fill_bytes", report.fill_bytes)?;
        d.set_item("timed_fill_bytes", report.timed_fill_bytes)?;
        d.set_item("timed_fill_seconds", report.timed_fill_seconds)?;
        d.set_item("timed_fill_layers", report.timed_fill_layers)?;
        d.set_item("cpu_layers", report.cpu_layers)?;
        d.set_item("cpu_experts", report.cpu_experts)?;
        d.set_item("cpu_picks", report.cpu_picks)?;
        d.set_item("cpu_seconds", report.cpu_seconds)?;
        d.set_item("wait_seconds", report.wait_seconds)?;
        d.set_item("serve_seconds", report.serve_seconds)?;
        d.set_item("plan_seconds", report.plan_seconds)?;
        d.set_item("issue_seconds", report.issue_seconds)?;
        d.set_item("fill_wait_seconds", report.fill_wait_seconds)?;
        d.set_item("stream_flags", report.stream_flags)?;
        Ok(d)
    }
}
