//! `CpuExperts`: SwiGLU experts on the host, GIL released.
use std::sync::Arc;

use freetoken_core::cpu::{CpuExperts, Hidden, Isa};
use numpy::{PyArrayDyn, PyArrayMethods};
use pyo3::prelude::*;

use crate::arrays::{copy_as, describe, int_array, readonly, readwrite};
use crate::errors::{invalid, IntoPyErr};
use crate::pool::PyExpertPool;

/// Runs routed experts on the CPU with a persistent pinned worker pool.
#[pyclass(frozen, name = "CpuExperts", module = "freetoken._core")]
pub struct PyCpuExperts {
    /// Shared with a `DecodeDriver`, which runs experts on its own thread.
    pub(crate) inner: Arc<CpuExperts>,
    pool: Py<PyExpertPool>,
}

#[pymethods]
impl PyCpuExperts {
    #[new]
    #[pyo3(signature = (pool, num_threads=None, isa=None))]
    fn new(
        pool: Bound<'_, PyExpertPool>,
        num_threads: Option<usize>,
        isa: Option<&str>,
    ) -> PyResult<Self> {
        let isa = match isa {
            None => None,
            Some(s) => Some(Isa::from_name(s).ok_or_else(|| {
                invalid(format!(
                    "unknown isa {s:?}; expected scalar, avx2, avx512_bf16 or amx_bf16"
                ))
            })?),
        };
        let inner = Arc::new(CpuExperts::new(pool.get().inner.clone(), num_threads, isa).py()?);
        Ok(Self {
            inner,
            pool: pool.unbind(),
        })
    }

    #[getter]
    fn isa(&self) -> &'static str {
        self.inner.isa().name()
    }
    #[getter]
    fn num_threads(&self) -> usize {
        self.inner.num_threads()
    }
    #[getter]
    fn idle_spin_us(&self) -> f64 {
        self.inner.idle_spin().as_secs_f64() * 1e6
    }
    #[setter]
    fn set_idle_spin_us(&self, us: f64) -> PyResult<()> {
        if !(0.0..=1e6).contains(&us) {
            return Err(invalid(format!(
                "idle_spin_us must be within 0..=1e6 (one second), got {us}"
            )));
        }
        self.inner
            .set_idle_spin(std::time::Duration::from_secs_f64(us / 1e6));
        Ok(())
    }
    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyExpertPool> {
        self.pool.clone_ref(py)
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        layer: i64,
        hidden: &Bound<'_, PyAny>,
        topk_ids: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        experts: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (ids, shape) = int_array(topk_ids, "topk_ids")?;
        let k = match shape.as_slice() {
            [_, k] => *k,
            s => return Err(invalid(format!("topk_ids must be [B, k], got shape {s:?}"))),
        };
        let (experts, _) = int_array(experts, "experts")?;
        let w = readonly::<f32>(topk_weights, "topk_weights", "float32")?;
        let w = w
            .as_slice()
            .map_err(|e| invalid(format!("topk_weights: {e}")))?;
        let mut out = readwrite::<f32>(out, "out [B, H]", "float32")?;
        let out = out
            .as_slice_mut()
            .map_err(|e| invalid(format!("out: {e}")))?;
        if let Ok(x) = hidden.cast::<PyArrayDyn<f32>>() {
            let x = x
                .try_readonly()
                .map_err(|e| invalid(format!("hidden: {e}")))?;
            let x = x
                .as_slice()
                .map_err(|e| invalid(format!("hidden must be C-contiguous: {e}")))?;
            return py
                .detach(|| {
                    self.inner
                        .forward(layer, Hidden::F32(x), &ids, w, k, &experts, out)
                })
                .py();
        }
        let bits = match copy_as::<u16, u16>(hidden, "hidden", |v| v)? {
            Some(b) => Some(b),
            None => copy_as::<i16, u16>(hidden, "hidden", |v| v as u16)?,
        };
        match bits {
            Some(x) => py.detach(|| self.inner.forward(layer, Hidden::Bf16(&x), &ids, w, k, &experts, out)).py(),
            None => Err(invalid(format!(
                "hidden must be a numpy float32 array or bf16 bits as int16/uint16 (torch: x.view(torch.int16).numpy()), got {}",
                describe(hidden)
            ))),
        }
    }
}

/// Kernel paths this CPU supports, slowest first (`scalar`, `avx2`, `avx512_bf16`, `amx_bf16`).
#[pyfunction]
pub fn supported_isas() -> Vec<&'static str> {
    Isa::all_supported().into_iter().map(|i| i.name()).collect()
}
