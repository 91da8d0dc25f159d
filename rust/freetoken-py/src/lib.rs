//! Python bindings (`freetoken._core`): convert arguments, call the core, map errors. No logic
//! here; everything that can take more than a few microseconds runs with the GIL released.
//! The stubs and user docs live in `python/freetoken/_core.pyi`.
use pyo3::prelude::*;

mod arrays;
mod cache;
mod cpu;
mod driver;
mod errors;
mod planner;
mod pool;
mod quant;
mod trace;

/// The `freetoken._core` extension module.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", freetoken_core::VERSION)?;
    errors::register(m)?;
    m.add_class::<pool::PyExpertPool>()?;
    m.add_class::<cache::PySlotMap>()?;
    m.add_class::<planner::PyPlanner>()?;
    m.add_class::<planner::PyPlan>()?;
    m.add_class::<cpu::PyCpuExperts>()?;
    m.add_class::<driver::PyDecodeDriver>()?;
    m.add_class::<trace::PyTraceWriter>()?;
    m.add_function(wrap_pyfunction!(cpu::supported_isas, m)?)?;
    m.add_function(wrap_pyfunction!(planner::aligned_len, m)?)?;
    m.add_function(wrap_pyfunction!(planner::align_slots, m)?)?;
    m.add_function(wrap_pyfunction!(quant::expert_layout, m)?)?;
    m.add_function(wrap_pyfunction!(quant::dequantize_expert, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quantized_expert_forward, m)?)?;
    m.add_function(wrap_pyfunction!(trace::read_trace, m)?)?;
    m.add_function(wrap_pyfunction!(trace::simulate_trace, m)?)?;
    m.add_function(wrap_pyfunction!(trace::synthetic_trace, m)?)?;
    Ok(())
}
