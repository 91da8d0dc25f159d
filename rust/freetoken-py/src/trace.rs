//! Routing traces: `TraceWriter`, `read_trace`, `simulate_trace`, `synthetic_trace`.
use std::path::PathBuf;
use std::sync::Mutex;

use freetoken_core::trace::{self, SyntheticConfig, Trace, TraceWriter};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::int_array;
use crate::cache::lock;
use crate::errors::{invalid, IntoPyErr};

/// Appends `(step, layer, ids)` records to a routing-trace file.
#[pyclass(frozen, name = "TraceWriter", module = "freetoken._core")]
pub struct PyTraceWriter {
    inner: Mutex<Option<TraceWriter>>,
}

#[pymethods]
impl PyTraceWriter {
    #[new]
    fn new(path: PathBuf, num_layers: usize, num_experts: usize, top_k: usize) -> PyResult<Self> {
        Ok(Self {
            inner: Mutex::new(Some(
                TraceWriter::create(&path, num_layers, num_experts, top_k).py()?,
            )),
        })
    }

    fn record(&self, step: u32, layer: usize, topk_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let (ids, _) = int_array(topk_ids, "topk_ids")?;
        let ids: Vec<u16> = ids
            .into_iter()
            .map(|v| u16::try_from(v).map_err(|_| invalid(format!("expert id {v} out of range"))))
            .collect::<PyResult<_>>()?;
        match lock(&self.inner).as_mut() {
            Some(w) => w.record(step, layer, &ids).py(),
            None => Err(invalid("TraceWriter is closed")),
        }
    }

    fn flush(&self) -> PyResult<()> {
        match lock(&self.inner).as_mut() {
            Some(w) => w.flush().py(),
            None => Ok(()),
        }
    }

    fn close(&self) -> PyResult<()> {
        match lock(&self.inner).take() {
            Some(w) => w.finish().py(),
            None => Ok(()),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        _a: Option<Bound<'_, PyAny>>,
        _b: Option<Bound<'_, PyAny>>,
        _c: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.close()?;
        Ok(false)
    }
}

/// Reads a trace: a dict with `num_layers`, `num_experts`, `top_k` and `records`, a list of
/// `(step, layer, ids int32 [B, k])`.
#[pyfunction]
pub fn read_trace<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let t = py.detach(|| Trace::read(&path)).py()?;
    let d = PyDict::new(py);
    d.set_item("num_layers", t.num_layers)?;
    d.set_item("num_experts", t.num_experts)?;
    d.set_item("top_k", t.top_k)?;
    let mut recs = Vec::with_capacity(t.records.len());
    for r in &t.records {
        let ids: Vec<i32> = r.ids.iter().map(|&v| v as i32).collect();
        let a = PyArray1::from_vec(py, ids).reshape([r.ids.len() / t.top_k, t.top_k])?;
        recs.push((r.step, r.layer, a));
    }
    d.set_item("records", recs)?;
    Ok(d)
}

/// Replays a trace file through a slot map; returns `{"hits", "misses", "hit_rate"}`.
#[pyfunction]
#[pyo3(signature = (path, capacity, policy="lru", warmup=0))]
pub fn simulate_trace<'py>(
    py: Python<'py>,
    path: PathBuf,
    capacity: usize,
    policy: &str,
    warmup: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let policy = policy.to_string();
    let r = py
        .detach(|| Trace::read(&path).and_then(|t| trace::simulate(&t, capacity, &policy, warmup)))
        .py()?;
    let d = PyDict::new(py);
    d.set_item("hits", r.hits)?;
    d.set_item("misses", r.misses)?;
    d.set_item("hit_rate", r.hit_rate())?;
    Ok(d)
}

/// Writes a synthetic trace (see the stub for the model and its calibration).
#[pyfunction]
#[pyo3(signature = (path, num_layers, num_experts, top_k, num_steps, batch=1, skew=0.45, reuse=0.35, window=16, seed=0))]
#[allow(clippy::too_many_arguments)]
pub fn synthetic_trace(
    py: Python<'_>,
    path: PathBuf,
    num_layers: usize,
    num_experts: usize,
    top_k: usize,
    num_steps: usize,
    batch: usize,
    skew: f64,
    reuse: f64,
    window: usize,
    seed: u64,
) -> PyResult<()> {
    let cfg = SyntheticConfig {
        batch,
        skew,
        reuse,
        window,
        seed,
        ..SyntheticConfig::new(num_layers, num_experts, top_k, num_steps)
    };
    py.detach(|| trace::synthetic(&cfg).and_then(|t| t.write(&path)))
        .py()
}
