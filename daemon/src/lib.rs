//! kvtier-daemon: the per-node KV block store behind `kvtierd`.
//!
//! The source is in layers; each imports only from its own layer and the
//! ones below it (the unit test in `layering.rs` reads the sources and fails
//! on an upward import or an import cycle):
//!
//! 1. [`base`]: vocabulary and contracts every layer shares: errors, sizes,
//!    the tier contract ([`base::tier::BlockTier`]) and the server's backend
//!    contract ([`base::backend::Backend`]), the event bus, workers.
//! 2. [`tiers`]: where blocks live and what a full tier keeps: G3 (local
//!    NVMe), G4 (object store), peers, the eviction and admission policies.
//! 3. [`node`]: one node's tiers composed into one [`base::backend::Backend`]
//!    (promotion, write-through, repair, scrub, prefetch).
//! 4. [`edges`]: how the world reaches the node: the Unix socket server,
//!    the FUSE mount, the ZMQ event publisher, metrics, tenancy.
//! 5. [`app`]: the configuration file and the wiring `kvtierd` runs.
//!
//! Test and bench scaffolding ([`testkit`], the G3 fault and power-loss
//! harnesses, the policy replay simulator, the peer transfer bench) is
//! compiled only for tests and with the `testkit` / `bench` features; a
//! `kvtierd` build carries none of it.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod app;
pub mod base;
pub mod edges;
pub mod node;
pub mod tiers;

#[cfg(test)]
mod layering;

#[cfg(any(test, feature = "testkit"))]
#[doc(hidden)]
pub mod testkit;

pub use base::error::{Error, Result};
