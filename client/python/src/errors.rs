//! The exception hierarchy: every misuse raises a subclass of
//! `kvtier.Error` with a message that says what to change. Misses are never
//! exceptions (they come back as values with a reason).

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTuple, PyType};
use std::ffi::CStr;

create_exception!(
    _kvtier,
    Error,
    PyException,
    "Base class of every kvtier exception (misuse, not misses: a miss is a value)."
);
create_exception!(
    _kvtier,
    BufferError,
    Error,
    "A buffer has the wrong size, is read-only where it must be written, is not contiguous, or is not a buffer at all."
);
create_exception!(
    _kvtier,
    InvalidKeyError,
    Error,
    "A block key is not 1..=64 bytes (or a non-negative int below 2**64)."
);
create_exception!(
    _kvtier,
    NamespaceError,
    Error,
    "A namespace or layout field is out of range."
);
create_exception!(
    _kvtier,
    UnavailableError,
    Error,
    "A control call (stats, pin, unpin, evict, stat, events) could not reach the daemon or was refused by it."
);
create_exception!(
    _kvtier,
    DeviceError,
    Error,
    "A GPU buffer was given but this process cannot move bytes to or from it (no CUDA driver, GDS or device)."
);
create_exception!(
    _kvtier,
    PoolError,
    Error,
    "A shared-memory pool request is invalid (size, slot index, a second pool)."
);

/// The exception types with a builtin as their second base (an argument of
/// the wrong type is a `kvtier.Error` and a `TypeError`): made at import
/// with PyErr_NewExceptionWithDoc, which takes a tuple of bases.
static ARGUMENT_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ARGUMENT_TYPE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static CLOSED_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn two_bases(
    py: Python<'_>,
    name: &CStr,
    doc: &CStr,
    builtin: Bound<'_, PyType>,
) -> PyResult<Py<PyType>> {
    let bases = PyTuple::new(py, [py.get_type::<Error>(), builtin])?;
    // SAFETY: name and doc are NUL-terminated; bases is a live tuple of
    // exception classes; the GIL is held. A null return sets an exception.
    let t = unsafe {
        let p = ffi::PyErr_NewExceptionWithDoc(
            name.as_ptr(),
            doc.as_ptr(),
            bases.as_ptr(),
            std::ptr::null_mut(),
        );
        Bound::from_owned_ptr_or_err(py, p)?
    };
    Ok(t.cast_into::<PyType>()?.unbind())
}

fn lazy_type(
    py: Python<'_>,
    cell: &'static PyOnceLock<Py<PyType>>,
    name: &'static CStr,
    doc: &'static CStr,
    builtin: fn(Python<'_>) -> Bound<'_, PyType>,
) -> PyResult<&'static Py<PyType>> {
    cell.get_or_try_init(py, || two_bases(py, name, doc, builtin(py)))
}

fn argument_error_type(py: Python<'_>) -> PyResult<&'static Py<PyType>> {
    lazy_type(
        py,
        &ARGUMENT_ERROR,
        c"kvtier.ArgumentError",
        c"An argument is out of range (a kvtier.Error and a ValueError).",
        |py| py.get_type::<PyValueError>(),
    )
}

fn argument_type_error_type(py: Python<'_>) -> PyResult<&'static Py<PyType>> {
    lazy_type(
        py,
        &ARGUMENT_TYPE_ERROR,
        c"kvtier.ArgumentTypeError",
        c"An argument has the wrong type (a kvtier.Error and a TypeError).",
        |py| py.get_type::<PyTypeError>(),
    )
}

fn closed_error_type(py: Python<'_>) -> PyResult<&'static Py<PyType>> {
    lazy_type(
        py,
        &CLOSED_ERROR,
        c"kvtier.ClosedError",
        c"A call on a Client after close() (a kvtier.Error and a ValueError, as for a closed file).",
        |py| py.get_type::<PyValueError>(),
    )
}

fn raise(t: PyResult<&'static Py<PyType>>, py: Python<'_>, msg: String) -> PyErr {
    match t {
        Ok(t) => PyErr::from_type(t.bind(py).clone(), msg),
        Err(e) => e,
    }
}

/// `kvtier.ArgumentError(msg)`: an argument out of range.
pub(crate) fn argument_error(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    raise(argument_error_type(py), py, msg.into())
}

/// `kvtier.ArgumentTypeError(msg)`: an argument of the wrong type.
pub(crate) fn argument_type_error(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    raise(argument_type_error_type(py), py, msg.into())
}

/// `kvtier.ClosedError(msg)`: the client was closed.
pub(crate) fn closed_error(py: Python<'_>) -> PyErr {
    raise(
        closed_error_type(py),
        py,
        "this kvtier.Client is closed: open a new one".into(),
    )
}

/// A method argument converted as `T` converts, with its conversion
/// errors raised as kvtier errors: a wrong type as `ArgumentTypeError`
/// (a `TypeError`), a value out of `T`'s range (Python's `OverflowError`
/// or `ValueError`) as `ArgumentError` (a `ValueError`). PyO3 notes which
/// argument it was.
pub(crate) struct Arg<T>(pub T);

impl<'a, 'py, T: FromPyObject<'a, 'py>> FromPyObject<'a, 'py> for Arg<T> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> Result<Self, PyErr> {
        let py = obj.py();
        T::extract(obj).map(Arg).map_err(|e| {
            let e: PyErr = e.into();
            if e.is_instance_of::<Error>(py) {
                return e;
            }
            let msg = e.value(py).to_string();
            if e.is_instance_of::<PyTypeError>(py) {
                raise(argument_type_error_type(py), py, msg)
            } else {
                raise(argument_error_type(py), py, msg)
            }
        })
    }
}

/// Maps a client-crate error of a control call onto the exception a person
/// can act on.
pub(crate) fn from_client(e: kvtier_client::Error) -> PyErr {
    use kvtier_client::Error as E;
    match &e {
        E::InvalidKey { .. } => InvalidKeyError::new_err(e.to_string()),
        E::InvalidNamespace { .. } => NamespaceError::new_err(e.to_string()),
        _ => {
            UnavailableError::new_err(format!("{e} (is kvtierd running, and is this its socket?)"))
        }
    }
}

/// Registers the exception types on the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("BufferError", py.get_type::<BufferError>())?;
    m.add("InvalidKeyError", py.get_type::<InvalidKeyError>())?;
    m.add("NamespaceError", py.get_type::<NamespaceError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("PoolError", py.get_type::<PoolError>())?;
    m.add("ArgumentError", argument_error_type(py)?.bind(py))?;
    m.add("ArgumentTypeError", argument_type_error_type(py)?.bind(py))?;
    m.add("ClosedError", closed_error_type(py)?.bind(py))?;
    Ok(())
}
