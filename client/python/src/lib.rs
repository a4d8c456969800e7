//! The Python package `kvtier`'s native module (`kvtier._kvtier`): a PyO3
//! binding over kvtier-client. The Python layer (client/python/python/
//! kvtier) re-exports it and adds `kvtier.aio` and `kvtier.bench`.
//!
//! Rules every call keeps: the GIL is released while it waits on the
//! daemon or copies bytes; a miss is a value with a reason; misuse raises a
//! `kvtier.Error` subclass before anything is sent.

mod baseline;
mod buffers;
mod client;
mod errors;
mod gpu;
mod ns;
mod results;

use pyo3::prelude::*;

/// kvtier: the node-local KV-cache tier for LLM engines (native part).
#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<ns::Layout>()?;
    m.add_class::<ns::Namespace>()?;
    m.add_class::<client::Client>()?;
    m.add_class::<client::Events>()?;
    m.add_class::<client::Pool>()?;
    m.add_class::<results::BlockResult>()?;
    m.add_class::<results::Lookup>()?;
    m.add("BLOCK_BYTES_MAX", kvtier_client::block::PAYLOAD_BYTES_MAX)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(default_socket, m)?)?;
    m.add_function(wrap_pyfunction!(baseline::_rust_client_round, m)?)?;
    Ok(())
}

/// The socket Client(socket=None) uses ($KVTIER_SOCKET, else the daemon's default).
#[pyfunction]
fn default_socket() -> String {
    client::default_socket().display().to_string()
}
