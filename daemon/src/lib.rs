//! kvtier-daemon: the per-node KV block store behind `kvtierd`.
//!
//! The tiers (G3 local NVMe, G4 object store) implement [`tier::BlockTier`];
//! [`policy`] decides what a full tier keeps. The `kvtierd` binary wires the
//! tiers, the local server, the mount and peers together.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod access;
pub mod at_rest;
pub mod config;
pub mod config_env;
#[doc(hidden)]
pub mod conformance;
pub mod error;
pub mod events;
pub mod g3;
pub mod g4;
pub mod http_gate;
pub mod id_floor;
pub mod log_limit;
pub mod metrics;
pub mod mount;
pub mod node;
pub mod peer;
pub mod policy;
pub mod server;
#[doc(hidden)]
pub mod testkit;
pub mod tier;
pub mod workers;
pub mod zmq;

pub use error::{Error, Result};
