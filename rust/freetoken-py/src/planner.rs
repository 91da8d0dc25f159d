//! `Planner` and `Plan`: the q* decision per layer step, and per-layer counters.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use freetoken_core::planner::{Backend, BandwidthProfile, Plan, Planner, PlannerConfig};
use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::{int_array, readwrite};
use crate::cache::{lock, relocations};
use crate::errors::{invalid, IntoPyErr};

/// The plan of one layer step (arrays are int32, expert ids of the plan's layer).
#[pyclass(frozen, name = "Plan", module = "freetoken._core")]
pub struct PyPlan {
    plan: Plan,
    layer: i64,
    batch: usize,
    k: usize,
}

fn arr<'py>(py: Python<'py>, v: &[i32]) -> Bound<'py, PyArray1<i32>> {
    PyArray1::from_slice(py, v)
}

#[pymethods]
impl PyPlan {
    #[getter]
    fn layer(&self) -> i64 {
        self.layer
    }
    #[getter]
    fn hit_experts<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.hit_experts)
    }
    #[getter]
    fn hit_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.hit_slots)
    }
    #[getter]
    fn fill_experts<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.fill_experts)
    }
    #[getter]
    fn fill_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.fill_slots)
    }
    #[getter]
    fn victim_layers<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.victim_layers)
    }
    #[getter]
    fn victim_experts<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.victim_experts)
    }
    #[getter]
    fn cpu_experts<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.cpu_experts)
    }
    #[getter]
    fn topk_slots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        arr(py, &self.plan.topk_slots).reshape([self.batch, self.k])
    }
    #[getter]
    fn q(&self) -> f64 {
        self.plan.q
    }
    #[getter]
    fn num_hits(&self) -> usize {
        self.plan.hit_experts.len()
    }
    #[getter]
    fn num_fills(&self) -> usize {
        self.plan.fill_experts.len()
    }
    #[getter]
    fn num_cpu(&self) -> usize {
        self.plan.cpu_experts.len()
    }
    fn __repr__(&self) -> String {
        format!(
            "Plan(layer={}, hits={:?}, fills={:?}, cpu={:?}, q={:.3})",
            self.layer,
            self.plan.hit_experts,
            self.plan.fill_experts,
            self.plan.cpu_experts,
            self.plan.q
        )
    }
}

fn profile(
    pcie: Option<f64>,
    cpu: Option<HashMap<i64, f64>>,
) -> PyResult<Option<BandwidthProfile>> {
    match (pcie, cpu) {
        (None, None) => Ok(None),
        (Some(p), Some(c)) => {
            let pts = c.into_iter().map(|(b, v)| (b as f64, v)).collect();
            BandwidthProfile::new(p, pts).py().map(Some)
        }
        _ => Err(invalid(
            "pcie_bytes_per_s and cpu_bytes_per_s must be given together",
        )),
    }
}

/// `(B_pcie, {batch: B_cpu})` as Python sees a profile.
type ProfileTuple = (f64, HashMap<i64, f64>);

fn profile_tuple(p: &BandwidthProfile) -> ProfileTuple {
    let curve = p
        .cpu_bytes_per_s
        .iter()
        .map(|&(b, v)| (b as i64, v))
        .collect();
    (p.pcie_bytes_per_s, curve)
}

/// Decides, per layer step, hits, fills and CPU runs (q*), and counts them per layer.
#[pyclass(frozen, name = "Planner", module = "freetoken._core")]
pub struct PyPlanner {
    /// Shared with a `DecodeDriver`, which plans on its own thread.
    pub(crate) inner: Arc<Mutex<Planner>>,
}

#[pymethods]
impl PyPlanner {
    #[new]
    #[pyo3(signature = (num_layers, num_experts, expert_nbytes, capacity, policy="lru", pcie_bytes_per_s=None, cpu_bytes_per_s=None, reuse_weight=0.5, reuse_decay=0.9))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_layers: usize,
        num_experts: usize,
        expert_nbytes: usize,
        capacity: usize,
        policy: &str,
        pcie_bytes_per_s: Option<f64>,
        cpu_bytes_per_s: Option<HashMap<i64, f64>>,
        reuse_weight: f64,
        reuse_decay: f64,
    ) -> PyResult<Self> {
        let cfg = PlannerConfig {
            num_layers,
            num_experts,
            expert_nbytes,
            capacity,
            policy: policy.to_string(),
            profile: profile(pcie_bytes_per_s, cpu_bytes_per_s)?,
            reuse_weight,
            reuse_decay,
        };
        Ok(Self {
            inner: Arc::new(Mutex::new(Planner::new(cfg).py()?)),
        })
    }

    #[pyo3(signature = (layer, topk_ids, backend="offload"))]
    fn plan(&self, layer: i64, topk_ids: &Bound<'_, PyAny>, backend: &str) -> PyResult<PyPlan> {
        let backend = backend.parse::<Backend>().py()?;
        let (ids, shape) = int_array(topk_ids, "topk_ids")?;
        let (batch, k) = match shape.as_slice() {
            [b, k] => (*b, *k),
            [k] => (1, *k),
            s => return Err(invalid(format!("topk_ids must be [B, k], got shape {s:?}"))),
        };
        let plan = lock(&self.inner).plan(layer, &ids, k, backend).py()?;
        Ok(PyPlan {
            plan,
            layer,
            batch,
            k,
        })
    }

    #[pyo3(signature = (pcie_bytes_per_s=None, cpu_bytes_per_s=None))]
    fn set_profile(
        &self,
        pcie_bytes_per_s: Option<f64>,
        cpu_bytes_per_s: Option<HashMap<i64, f64>>,
    ) -> PyResult<()> {
        let p = profile(pcie_bytes_per_s, cpu_bytes_per_s)?;
        lock(&self.inner).set_profile(p);
        Ok(())
    }

    #[pyo3(signature = (batch, reuse=0.0))]
    fn q_star(&self, batch: f64, reuse: f64) -> PyResult<f64> {
        let g = lock(&self.inner);
        let w = g.config().reuse_weight;
        g.q_star(batch, w * reuse)
            .ok_or_else(|| invalid("no bandwidth profile set"))
    }

    /// The profile as refined by measurement: `(B_pcie, {batch: B_cpu})` in bytes/s, or None.
    fn refined_profile(&self) -> Option<ProfileTuple> {
        lock(&self.inner)
            .refined_profile()
            .as_ref()
            .map(profile_tuple)
    }

    /// The profile as given (`ft bench bw`): `(B_pcie, {batch: B_cpu})` in bytes/s, or None.
    fn profile(&self) -> Option<ProfileTuple> {
        lock(&self.inner)
            .config()
            .profile
            .as_ref()
            .map(profile_tuple)
    }

    /// Each miss path's measurement: `{"pcie"|"cpu": (bytes/s EMA or None, measured/profiled
    /// EMA or None, samples)}`.
    fn bandwidth<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = lock(&self.inner);
        let (pcie, cpu) = g.bandwidth();
        let d = PyDict::new(py);
        for (name, t) in [("pcie", pcie), ("cpu", cpu)] {
            d.set_item(name, (t.bytes_per_s(), t.ratio(), t.num_samples()))?;
        }
        Ok(d)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c: Vec<_> = lock(&self.inner).counters().to_vec();
        let d = PyDict::new(py);
        let col = |f: fn(&freetoken_core::planner::LayerCounters) -> u64| -> Vec<i64> {
            c.iter().map(|x| f(x) as i64).collect()
        };
        d.set_item("steps", PyArray1::from_vec(py, col(|x| x.steps)))?;
        d.set_item("hits", PyArray1::from_vec(py, col(|x| x.hits)))?;
        d.set_item("fills", PyArray1::from_vec(py, col(|x| x.fills)))?;
        d.set_item("cpu_runs", PyArray1::from_vec(py, col(|x| x.cpu_runs)))?;
        d.set_item("evictions", PyArray1::from_vec(py, col(|x| x.evictions)))?;
        d.set_item("bytes_h2d", PyArray1::from_vec(py, col(|x| x.bytes_h2d)))?;
        d.set_item("bytes_cpu", PyArray1::from_vec(py, col(|x| x.bytes_cpu)))?;
        Ok(d)
    }

    fn reset_stats(&self) {
        lock(&self.inner).reset_stats()
    }

    fn resize<'py>(&self, py: Python<'py>, capacity: usize) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let moves = lock(&self.inner).resize(capacity).py()?;
        Ok(relocations(py, &moves))
    }

    fn slot_of(&self, layer: i64, expert: i64) -> PyResult<Option<u32>> {
        lock(&self.inner).slots().get(layer, expert).py()
    }

    /// The slot of every expert of `layer`, -1 where it is not resident: int32 `[num_experts]`.
    fn layer_slots<'py>(&self, py: Python<'py>, layer: i64) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let g = lock(&self.inner);
        let slots = g.slots();
        let out = (0..slots.num_experts() as i64)
            .map(|e| Ok(slots.get(layer, e)?.map_or(-1, |s| s as i32)))
            .collect::<Result<Vec<i32>, freetoken_core::error::CacheError>>()
            .py()?;
        Ok(PyArray1::from_vec(py, out))
    }

    #[getter]
    fn capacity(&self) -> usize {
        lock(&self.inner).slots().capacity()
    }
    #[getter]
    fn num_resident(&self) -> usize {
        lock(&self.inner).slots().len()
    }
    #[getter]
    fn policy(&self) -> &'static str {
        lock(&self.inner).slots().policy_name()
    }
    #[getter]
    fn num_layers(&self) -> usize {
        lock(&self.inner).config().num_layers
    }
    #[getter]
    fn num_experts(&self) -> usize {
        lock(&self.inner).config().num_experts
    }
}

/// `B_cpu(batch)` of a `{batch: bytes/s}` curve by the planner's rule (`BandwidthProfile::cpu_at`:
/// linear between points, the first value below them, compute-bound above the largest).
#[pyfunction]
pub fn cpu_bytes_per_s_at(curve: HashMap<i64, f64>, batch: f64) -> PyResult<f64> {
    let pts = curve.into_iter().map(|(b, v)| (b as f64, v)).collect();
    Ok(BandwidthProfile::new(1.0, pts).py()?.cpu_at(batch))
}

/// `q* = B_cpu(b) / (B_cpu(b) + B_pcie)` of a profile, without the planner's reuse credit.
#[pyfunction]
pub fn q_star(
    pcie_bytes_per_s: f64,
    cpu_bytes_per_s: HashMap<i64, f64>,
    batch: f64,
) -> PyResult<f64> {
    let pts = cpu_bytes_per_s
        .into_iter()
        .map(|(b, v)| (b as f64, v))
        .collect();
    Ok(BandwidthProfile::new(pcie_bytes_per_s, pts)
        .py()?
        .q(batch, 0.0))
}

/// Rows and tiles of the kernel's aligned layout for `num_pairs` pairs: `(num_rows, num_tiles)`.
#[pyfunction]
pub fn aligned_len(
    num_pairs: usize,
    num_experts: usize,
    block_m: usize,
) -> PyResult<(usize, usize)> {
    if block_m == 0 {
        return Err(invalid("block_m must be >= 1"));
    }
    Ok(freetoken_core::align::aligned_len(
        num_pairs,
        num_experts,
        block_m,
    ))
}

/// Writes `[slot ids (T*k) | sorted_pairs (num_rows) | tile_expert (num_tiles)]` as int64 into the
/// front of `out` (a C-contiguous int64 array, e.g. a pinned staging buffer) and returns
/// `(num_rows, num_tiles)`; see `freetoken_core::align::align_pairs`.
#[pyfunction]
pub fn align_slots(
    topk_slots: &Bound<'_, PyAny>,
    num_experts: usize,
    block_m: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<(usize, usize)> {
    let (ids, _) = int_array(topk_slots, "topk_slots")?;
    let (rows, tiles) = aligned_len(ids.len(), num_experts, block_m)?;
    if let Some(bad) = ids.iter().find(|&&id| id >= num_experts as i64) {
        return Err(invalid(format!(
            "slot id {bad} out of range for {num_experts} rows"
        )));
    }
    let mut out = readwrite::<i64>(out, "out", "int64")?;
    let out = out
        .as_slice_mut()
        .map_err(|e| invalid(format!("out must be C-contiguous: {e}")))?;
    let n = ids.len();
    if out.len() < n + rows + tiles {
        return Err(invalid(format!(
            "out holds {} values, {} needed",
            out.len(),
            n + rows + tiles
        )));
    }
    out[..n].copy_from_slice(&ids);
    Ok(freetoken_core::align::align_after(
        out,
        n,
        num_experts,
        block_m,
    ))
}
