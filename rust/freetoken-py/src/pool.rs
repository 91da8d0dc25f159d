//! `ExpertPool`: the host arena of routed experts.
use std::sync::Arc;

use freetoken_core::pool::{checkpoint, ExpertPool, PoolShape};
use freetoken_core::quant::ExpertFormat;
use numpy::PyArray1;
use pyo3::prelude::*;

use crate::errors::{interruptible, invalid, IntoPyErr};

/// Every routed expert of every MoE layer in one 2 MiB-aligned host arena.
#[pyclass(frozen, name = "ExpertPool", module = "freetoken._core")]
pub struct PyExpertPool {
    pub inner: Arc<ExpertPool>,
}

impl PyExpertPool {
    fn view<'py>(
        slf: &Bound<'py, Self>,
        ptr: *const u8,
        n: usize,
    ) -> PyResult<Bound<'py, PyArray1<u8>>> {
        // SAFETY: ptr..ptr+n lies inside the arena, which lives as long as the pool object; the
        // array's base is set to that object, so the memory outlives the array and every buffer
        // taken from it.
        unsafe {
            let v = ndarray::ArrayView1::from_shape_ptr(n, ptr);
            Ok(PyArray1::borrow_from_array(&v, slf.clone().into_any()))
        }
    }
}

/// `moe_layers`, default `range(num_layers)`, checked to have `num_layers` entries.
fn layers_arg(num_layers: usize, moe_layers: Option<Vec<usize>>) -> PyResult<Vec<usize>> {
    let moe_layers = moe_layers.unwrap_or_else(|| (0..num_layers).collect());
    if moe_layers.len() != num_layers {
        return Err(invalid(format!(
            "moe_layers has {} entries but num_layers is {num_layers}",
            moe_layers.len()
        )));
    }
    Ok(moe_layers)
}

#[pymethods]
impl PyExpertPool {
    #[staticmethod]
    #[pyo3(signature = (model_dir, num_threads=None))]
    fn from_checkpoint(
        py: Python<'_>,
        model_dir: std::path::PathBuf,
        num_threads: Option<usize>,
    ) -> PyResult<Self> {
        if num_threads == Some(0) {
            return Err(invalid("num_threads must be positive"));
        }
        let pool = interruptible(py, move || checkpoint::load(&model_dir, num_threads))?.py()?;
        Ok(Self {
            inner: Arc::new(pool),
        })
    }

    #[staticmethod]
    #[pyo3(signature = (num_layers, num_experts, hidden_size, intermediate_size, seed=0, moe_layers=None, num_threads=None, format="bf16", block=(0, 0)))]
    #[allow(clippy::too_many_arguments)]
    fn random(
        py: Python<'_>,
        num_layers: usize,
        num_experts: usize,
        hidden_size: usize,
        intermediate_size: usize,
        seed: u64,
        moe_layers: Option<Vec<usize>>,
        num_threads: Option<usize>,
        format: &str,
        block: (usize, usize),
    ) -> PyResult<Self> {
        let moe_layers = layers_arg(num_layers, moe_layers)?;
        if num_threads == Some(0) {
            return Err(invalid("num_threads must be positive"));
        }
        let shape = PoolShape {
            moe_layers,
            num_experts,
            hidden_size,
            intermediate_size,
            format: ExpertFormat::from_name(format, block).py()?,
        };
        let pool = interruptible(py, move || ExpertPool::random(shape, seed, num_threads))?.py()?;
        Ok(Self {
            inner: Arc::new(pool),
        })
    }

    #[staticmethod]
    #[pyo3(signature = (num_layers, num_experts, hidden_size, intermediate_size, format="bf16", block=(0, 0), moe_layers=None))]
    #[allow(clippy::too_many_arguments)]
    fn zeroed(
        py: Python<'_>,
        num_layers: usize,
        num_experts: usize,
        hidden_size: usize,
        intermediate_size: usize,
        format: &str,
        block: (usize, usize),
        moe_layers: Option<Vec<usize>>,
    ) -> PyResult<Self> {
        let moe_layers = layers_arg(num_layers, moe_layers)?;
        let shape = PoolShape {
            moe_layers,
            num_experts,
            hidden_size,
            intermediate_size,
            format: ExpertFormat::from_name(format, block).py()?,
        };
        let pool = interruptible(py, move || ExpertPool::zeroed(shape))?.py()?;
        Ok(Self {
            inner: Arc::new(pool),
        })
    }

    #[getter]
    fn format(&self) -> &'static str {
        self.inner.format().name()
    }

    /// FP8's `weight_block_size` (rows, cols); (1, 16) for NVFP4, (1, 32) for MXFP4, (0, 0) for bf16.
    #[getter]
    fn block(&self) -> (usize, usize) {
        self.inner.format().block()
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
    #[getter]
    fn num_experts(&self) -> usize {
        self.inner.num_experts()
    }
    #[getter]
    fn hidden_size(&self) -> usize {
        self.inner.hidden_size()
    }
    #[getter]
    fn intermediate_size(&self) -> usize {
        self.inner.intermediate_size()
    }
    #[getter]
    fn expert_nbytes(&self) -> usize {
        self.inner.expert_nbytes()
    }
    #[getter]
    fn expert_stride(&self) -> usize {
        self.inner.shape().expert_stride()
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }
    #[getter]
    fn ptr(&self) -> usize {
        self.inner.ptr() as usize
    }
    #[getter]
    fn moe_layers(&self) -> Vec<usize> {
        self.inner.moe_layers().to_vec()
    }

    fn layer_index(&self, model_layer: i64) -> PyResult<usize> {
        self.inner.layer_index(model_layer).py()
    }

    fn expert_ptr(&self, layer: i64, expert: i64) -> PyResult<(usize, usize)> {
        let (p, n) = self.inner.expert_ptr(layer, expert).py()?;
        Ok((p as usize, n))
    }

    fn expert_offset(&self, layer: i64, expert: i64) -> PyResult<usize> {
        let (p, _) = self.inner.expert_ptr(layer, expert).py()?;
        Ok(p as usize - self.inner.ptr() as usize)
    }

    fn expert_view<'py>(
        slf: &Bound<'py, Self>,
        layer: i64,
        expert: i64,
    ) -> PyResult<Bound<'py, PyArray1<u8>>> {
        let (p, n) = slf.get().inner.expert_ptr(layer, expert).py()?;
        Self::view(slf, p, n)
    }

    fn arena_view<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray1<u8>>> {
        let pool = &slf.get().inner;
        Self::view(slf, pool.ptr(), pool.nbytes())
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "ExpertPool(num_layers={}, num_experts={}, hidden_size={}, intermediate_size={}, nbytes={})",
            p.num_layers(),
            p.num_experts(),
            p.hidden_size(),
            p.intermediate_size(),
            p.nbytes()
        )
    }
}
