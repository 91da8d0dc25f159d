//! Argument conversion: numpy arrays (or sequences) in, owned or borrowed Rust slices out.
use numpy::{
    PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::invalid;

/// Integer ids `[.., k]` from a numpy int32/int64 array (any other integer dtype or a sequence
/// is converted through numpy). Returns the values as i64 and the shape.
pub fn int_array(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(Vec<i64>, Vec<usize>)> {
    if let Ok(a) = obj.cast::<PyArrayDyn<i64>>() {
        let r = a.readonly();
        return Ok((r.as_array().iter().copied().collect(), r.shape().to_vec()));
    }
    if let Ok(a) = obj.cast::<PyArrayDyn<i32>>() {
        let r = a.readonly();
        return Ok((
            r.as_array().iter().map(|&v| v as i64).collect(),
            r.shape().to_vec(),
        ));
    }
    let np = obj.py().import("numpy")?;
    let conv = np.call_method1("asarray", (obj, "int64")).map_err(|e| {
        invalid(format!(
            "{what} must be an integer array (numpy int32/int64): {e}"
        ))
    })?;
    let a = conv
        .cast::<PyArrayDyn<i64>>()
        .map_err(|_| invalid(format!("{what} must be an integer array")))?;
    let r = a.readonly();
    Ok((r.as_array().iter().copied().collect(), r.shape().to_vec()))
}

/// A read-only C-contiguous numpy array of `T`, borrowed.
pub fn readonly<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    dtype: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    let a = obj.cast::<PyArrayDyn<T>>().map_err(|_| {
        invalid(format!(
            "{what} must be a numpy array of dtype {dtype}, got {}",
            describe(obj)
        ))
    })?;
    let r = a
        .try_readonly()
        .map_err(|e| invalid(format!("{what}: {e}")))?;
    if !r.is_c_contiguous() {
        return Err(invalid(format!(
            "{what} must be C-contiguous (call numpy.ascontiguousarray)"
        )));
    }
    Ok(r)
}

/// A writable C-contiguous numpy array of `T`, borrowed (`what` and `dtype` name it in errors).
pub fn readwrite<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    dtype: &str,
) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    let a = obj.cast::<PyArrayDyn<T>>().map_err(|_| {
        invalid(format!(
            "{what} must be a writable numpy array of dtype {dtype}, got {}",
            describe(obj)
        ))
    })?;
    let w = a
        .try_readwrite()
        .map_err(|e| invalid(format!("{what}: {e}")))?;
    if !w.is_c_contiguous() {
        return Err(invalid(format!("{what} must be C-contiguous")));
    }
    Ok(w)
}

/// `type(obj)` and, for arrays, the dtype, for error messages.
pub fn describe(obj: &Bound<'_, PyAny>) -> String {
    let ty = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    match obj.getattr("dtype") {
        Ok(d) => format!("{ty} of dtype {d}"),
        Err(_) => ty,
    }
}

/// A C-contiguous numpy array of `T` copied out through `f`; `None` when `obj` is not a numpy
/// array of dtype `T`.
pub fn copy_as<T: numpy::Element + Copy, U>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    f: impl Fn(T) -> U,
) -> PyResult<Option<Vec<U>>> {
    let Ok(a) = obj.cast::<PyArrayDyn<T>>() else {
        return Ok(None);
    };
    let r = a
        .try_readonly()
        .map_err(|e| invalid(format!("{what}: {e}")))?;
    let v = r
        .as_slice()
        .map_err(|e| invalid(format!("{what} must be C-contiguous: {e}")))?;
    Ok(Some(v.iter().map(|&x| f(x)).collect()))
}
