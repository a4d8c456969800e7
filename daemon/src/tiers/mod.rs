//! Layer 2: where blocks live and what a full tier keeps. Imports only
//! [`crate::base`].
//!
//! - [`g3`]: the local NVMe tier (block files, the redb index, io_uring).
//! - [`g4`]: the shared object-store tier.
//! - [`peer`]: other nodes' G3s over HTTP.
//! - [`policy`]: eviction and admission, shared by G3 and G4.

pub mod g3;
pub mod g4;
pub mod peer;
pub mod policy;
