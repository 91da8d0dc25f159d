//! Python exceptions: a `FreetokenError` root and one subclass per error kind, each also
//! subclassing the natural builtin (`IndexError`, `ValueError`, `FileNotFoundError`, ...).
use freetoken_core::error::ErrorKind;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

pyo3::create_exception!(
    freetoken._core,
    FreetokenError,
    PyException,
    "Root of every error raised by freetoken._core."
);

/// (class name, builtin base, kind, docstring).
const CLASSES: [(&str, &str, ErrorKind, &str); 9] = [
    (
        "OutOfRangeError",
        "IndexError",
        ErrorKind::Index,
        "A layer, expert or slot index out of range.",
    ),
    (
        "InvalidArgumentError",
        "ValueError",
        ErrorKind::Value,
        "A bad argument: shape, dtype, name or value.",
    ),
    (
        "CheckpointError",
        "ValueError",
        ErrorKind::Checkpoint,
        "A checkpoint whose content is wrong (missing tensor, shape, dtype).",
    ),
    (
        "MissingFileError",
        "FileNotFoundError",
        ErrorKind::NotFound,
        "A file or directory that should exist does not.",
    ),
    (
        "HostIOError",
        "OSError",
        ErrorKind::Io,
        "An operating-system error: read, mmap, allocation.",
    ),
    (
        "ExpertCacheFullError",
        "RuntimeError",
        ErrorKind::Capacity,
        "Every expert_cache slot is pinned by the step in flight.",
    ),
    (
        "TraceFormatError",
        "ValueError",
        ErrorKind::Trace,
        "A routing-trace file is malformed.",
    ),
    (
        "InternalError",
        "RuntimeError",
        ErrorKind::Internal,
        "A bug: a worker thread failed. Please report it.",
    ),
    (
        "DeviceTimeoutError",
        "TimeoutError",
        ErrorKind::Timeout,
        "The device or the decode driver did not answer in time; `layer` and `step` name where.",
    ),
];

static TYPES: PyOnceLock<Vec<(ErrorKind, Py<PyType>)>> = PyOnceLock::new();

/// Creates the classes and adds them (and the root) to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let root = py.get_type::<FreetokenError>();
    m.add("FreetokenError", &root)?;
    let builtins = py.import("builtins")?;
    let type_ = builtins.getattr("type")?;
    let mut types = Vec::new();
    for (name, base, kind, doc) in CLASSES {
        let ns = PyDict::new(py);
        ns.set_item("__doc__", doc)?;
        ns.set_item("__module__", "freetoken._core")?;
        let bases = PyTuple::new(py, [root.clone().into_any(), builtins.getattr(base)?])?;
        let cls = type_.call1((name, bases, ns))?.cast_into::<PyType>()?;
        m.add(name, &cls)?;
        types.push((kind, cls.unbind()));
    }
    let _ = TYPES.set(py, types);
    Ok(())
}

/// A Python exception of the class for `kind`, with `msg`.
pub fn py_err(kind: ErrorKind, msg: String) -> PyErr {
    Python::attach(|py| {
        match TYPES
            .get(py)
            .and_then(|t| t.iter().find(|(k, _)| *k == kind))
        {
            Some((_, cls)) => PyErr::from_type(cls.bind(py).clone(), msg),
            None => FreetokenError::new_err(msg),
        }
    })
}

/// Converts core errors (anything with `kind()` and `Display`) into Python exceptions.
pub trait IntoPyErr<T> {
    /// Maps the error side into a `PyErr`.
    fn py(self) -> PyResult<T>;
}

macro_rules! impl_into {
    ($($t:ty),*) => {$(
        impl<T> IntoPyErr<T> for Result<T, $t> {
            fn py(self) -> PyResult<T> {
                self.map_err(|e| py_err(e.kind(), e.to_string()))
            }
        }
    )*};
}
impl_into!(
    freetoken_core::error::PoolError,
    freetoken_core::error::CacheError,
    freetoken_core::error::PlanError,
    freetoken_core::error::KernelError,
    freetoken_core::error::TraceError,
    freetoken_core::error::DriverError
);

/// An `InvalidArgumentError` with `msg`.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    py_err(ErrorKind::Value, msg.into())
}

/// Runs `work` on its own thread with the GIL released, checking for Python signals every 100 ms, so that
/// Ctrl-C during a long load raises `KeyboardInterrupt` at once (polars' `enter_polars` does the same). The
/// abandoned work finishes in the background and its result is dropped.
pub fn interruptible<T: Send + 'static>(
    py: Python<'_>,
    work: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    use std::sync::mpsc::{channel, RecvTimeoutError};
    use std::time::Duration;

    let (tx, rx) = channel();
    std::thread::Builder::new()
        .name("freetoken-load".into())
        .spawn(move || {
            // A send fails only when the caller was interrupted and left; the result is then unwanted.
            let _ = tx.send(work());
        })
        .map_err(|e| py_err(ErrorKind::Internal, format!("cannot start a thread: {e}")))?;
    let mut rx = rx;
    loop {
        // The receiver is Send but not Sync: it moves into the GIL-free closure and back.
        let (back, received) = py.detach(move || {
            let received = rx.recv_timeout(Duration::from_millis(100));
            (rx, received)
        });
        rx = back;
        match received {
            Ok(result) => return Ok(result),
            Err(RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(py_err(
                    ErrorKind::Internal,
                    "the worker thread panicked".to_string(),
                ))
            }
        }
    }
}
