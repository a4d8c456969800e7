//! The exception hierarchy: every misuse raises a subclass of
//! `kvtier.Error` with a message that says what to change. Misses are never
//! exceptions (they come back as values with a reason).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

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
    Ok(())
}
