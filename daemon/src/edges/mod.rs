//! Layer 4: how the world reaches a node. Imports [`crate::base`],
//! [`crate::tiers`] and [`crate::node`].
//!
//! - [`server`]: the Unix socket server the client library talks to.
//! - [`mount`]: the FUSE namespace over the blocks (kvtier-fs underneath).
//! - [`zmq`]: KV events on vLLM's ZMQ wire for routers.
//! - [`metrics`]: Prometheus `/metrics` and `/healthz`.
//! - [`access`]: tenancy: who may use which namespace, per-uid shares.

pub mod access;
pub mod metrics;
pub mod mount;
pub mod server;
pub mod zmq;
