//! Expert formats: layouts, and the CPU kernels on one quantized expert (for tests and benches;
//! the layer step runs them through `CpuExperts`).
use freetoken_core::cpu::Isa;
use freetoken_core::quant::{kernels, ExpertFormat, ExpertLayout, QExpert};
use numpy::{PyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::readonly;
use crate::errors::{invalid, IntoPyErr};

/// A float32 numpy array.
type F32Array<'py> = Bound<'py, PyArray1<f32>>;

fn layout(
    format: &str,
    hidden: usize,
    inter: usize,
    block: (usize, usize),
) -> PyResult<ExpertLayout> {
    let f = ExpertFormat::from_name(format, block).py()?;
    f.check_shape(hidden, inter).py()?;
    Ok(f.layout(hidden, inter))
}

fn view<'a>(l: &ExpertLayout, bytes: &'a [u8]) -> PyResult<QExpert<'a>> {
    l.expert(bytes).py()
}

/// `{section: (offset, nbytes)}` of one expert and `expert_nbytes`.
#[pyfunction]
#[pyo3(signature = (format, hidden_size, intermediate_size, block=(0, 0)))]
pub fn expert_layout<'py>(
    py: Python<'py>,
    format: &str,
    hidden_size: usize,
    intermediate_size: usize,
    block: (usize, usize),
) -> PyResult<Bound<'py, PyDict>> {
    let l = layout(format, hidden_size, intermediate_size, block)?;
    let d = PyDict::new(py);
    d.set_item("gate_up", l.gate_up)?;
    d.set_item("down", l.down)?;
    d.set_item("gate_up_scale", l.gate_up_scale)?;
    d.set_item("down_scale", l.down_scale)?;
    d.set_item("tensor_scale", l.tensor_scale)?;
    d.set_item("expert_nbytes", l.expert_nbytes)?;
    Ok(d)
}

/// One quantized expert's weights dequantized by the Rust codecs: `(gate_up [2I*H], down [H*I])` f32.
#[pyfunction]
#[pyo3(signature = (format, hidden_size, intermediate_size, expert, block=(0, 0)))]
pub fn dequantize_expert<'py>(
    py: Python<'py>,
    format: &str,
    hidden_size: usize,
    intermediate_size: usize,
    expert: &Bound<'py, PyAny>,
    block: (usize, usize),
) -> PyResult<(F32Array<'py>, F32Array<'py>)> {
    let l = layout(format, hidden_size, intermediate_size, block)?;
    let bytes = readonly::<u8>(expert, "expert", "uint8")?;
    let e = view(&l, bytes.as_slice()?)?;
    let (h, i) = (hidden_size, intermediate_size);
    let mut gate_up = Vec::with_capacity(2 * i * h);
    for m in [&e.gate, &e.up] {
        for r in 0..i {
            gate_up.extend((0..h).map(|c| m.get(r, c)));
        }
    }
    let down: Vec<f32> = (0..h)
        .flat_map(|r| (0..i).map(move |c| (r, c)))
        .map(|(r, c)| e.down.get(r, c))
        .collect();
    Ok((
        PyArray1::from_vec(py, gate_up),
        PyArray1::from_vec(py, down),
    ))
}

/// SwiGLU of one quantized expert on `x [n, H]` f32 with kernel path `isa` -> `[n * H]` f32 (the
/// bf16 paths round `x` and `silu(g) · u` to bf16, as `CpuExperts` does).
#[pyfunction]
#[pyo3(signature = (format, hidden_size, intermediate_size, expert, x, isa="scalar", block=(0, 0)))]
#[allow(clippy::too_many_arguments)]
pub fn quantized_expert_forward<'py>(
    py: Python<'py>,
    format: &str,
    hidden_size: usize,
    intermediate_size: usize,
    expert: &Bound<'py, PyAny>,
    x: &Bound<'py, PyAny>,
    isa: &str,
    block: (usize, usize),
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let isa = Isa::from_name(isa)
        .filter(|i| i.supported())
        .ok_or_else(|| {
            invalid(format!(
                "isa {isa:?} is unknown or not supported by this CPU"
            ))
        })?;
    let l = layout(format, hidden_size, intermediate_size, block)?;
    let bytes = readonly::<u8>(expert, "expert", "uint8")?;
    let xs = readonly::<f32>(x, "x", "float32")?;
    if xs.len() % hidden_size != 0 || xs.len() == 0 {
        return Err(invalid(format!(
            "x has {} elements, not [n, H={hidden_size}]",
            xs.len()
        )));
    }
    let n = xs.len() / hidden_size;
    let (bytes, xs) = (bytes.as_slice()?.to_vec(), xs.as_slice()?.to_vec());
    let out = py.detach(move || -> PyResult<Vec<f32>> {
        let e = view(&l, &bytes)?;
        let mut out = vec![0f32; n * hidden_size];
        kernels::expert_forward(isa, &e, &xs, n, &mut out);
        Ok(out)
    })?;
    Ok(PyArray1::from_vec(py, out))
}
