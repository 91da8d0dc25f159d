//! Python bindings: convert, call the core, map errors. No logic here.
use pyo3::prelude::*;

/// The `freetoken._core` extension module.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", freetoken_core::VERSION)?;
    Ok(())
}
