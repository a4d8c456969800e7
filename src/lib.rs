//! kvtier: an LLM KV-cache storage tier (local NVMe G3 + shared object store G4).
//!
//! This facade re-exports [`kvtier_client`], the crate inference workers link.
//! The cross-crate end-to-end suites live in this package's `tests/`.
pub use kvtier_client::*;
