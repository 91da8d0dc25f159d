//! `SlotMap`: `(layer, expert)` -> GPU slot ids with a replacement policy.
use std::sync::Mutex;

use freetoken_core::cache::{policy_by_name, SlotMap};
use numpy::PyArray2;
use pyo3::prelude::*;

use crate::errors::IntoPyErr;

/// Locks a mutex, recovering from poisoning (no panic is expected inside).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Maps `(layer, expert)` to slot ids of a fixed capacity.
#[pyclass(frozen, name = "SlotMap", module = "freetoken._core")]
pub struct PySlotMap {
    inner: Mutex<SlotMap>,
}

/// Relocations as an int64 array `[n, 4]`: (layer, expert, from_slot, to_slot).
pub fn relocations<'py>(
    py: Python<'py>,
    r: &[freetoken_core::cache::Relocation],
) -> Bound<'py, PyArray2<i64>> {
    let rows: Vec<Vec<i64>> = r
        .iter()
        .map(|r| {
            vec![
                r.key.layer as i64,
                r.key.expert as i64,
                r.from as i64,
                r.to as i64,
            ]
        })
        .collect();
    if rows.is_empty() {
        return numpy::PyArray2::zeros(py, [0, 4], false);
    }
    PyArray2::from_vec2(py, &rows).unwrap_or_else(|_| numpy::PyArray2::zeros(py, [0, 4], false))
}

#[pymethods]
impl PySlotMap {
    #[new]
    #[pyo3(signature = (capacity, num_layers, num_experts, policy="lru"))]
    fn new(capacity: usize, num_layers: usize, num_experts: usize, policy: &str) -> PyResult<Self> {
        let p = policy_by_name(policy, capacity, num_layers).py()?;
        Ok(Self {
            inner: Mutex::new(SlotMap::new(capacity, num_layers, num_experts, p).py()?),
        })
    }

    #[getter]
    fn capacity(&self) -> usize {
        lock(&self.inner).capacity()
    }
    #[getter]
    fn policy(&self) -> &'static str {
        lock(&self.inner).policy_name()
    }
    fn __len__(&self) -> usize {
        lock(&self.inner).len()
    }

    fn get(&self, layer: i64, expert: i64) -> PyResult<Option<u32>> {
        lock(&self.inner).get(layer, expert).py()
    }

    fn touch(&self, layer: i64, expert: i64) -> PyResult<Option<u32>> {
        lock(&self.inner).touch(layer, expert).py()
    }

    fn insert(&self, layer: i64, expert: i64) -> PyResult<(u32, Option<(u32, u32)>)> {
        let (s, v) = lock(&self.inner).insert(layer, expert).py()?;
        Ok((s, v.map(|k| (k.layer, k.expert))))
    }

    fn remove(&self, layer: i64, expert: i64) -> PyResult<Option<u32>> {
        lock(&self.inner).remove(layer, expert).py()
    }

    fn is_pinned(&self, slot: i64) -> bool {
        u32::try_from(slot).is_ok_and(|s| lock(&self.inner).is_pinned(s))
    }

    fn unpin_all(&self) {
        lock(&self.inner).unpin_all()
    }

    fn resize<'py>(&self, py: Python<'py>, capacity: usize) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let moves = lock(&self.inner).resize(capacity).py()?;
        Ok(relocations(py, &moves))
    }

    fn residents(&self) -> Vec<(u32, u32, u32)> {
        lock(&self.inner)
            .residents()
            .into_iter()
            .map(|(k, s)| (k.layer, k.expert, s))
            .collect()
    }

    fn __repr__(&self) -> String {
        let m = lock(&self.inner);
        format!(
            "SlotMap(capacity={}, len={}, policy={:?})",
            m.capacity(),
            m.len(),
            m.policy_name()
        )
    }
}
