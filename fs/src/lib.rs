//! kvtier-fs: the KV namespace as a mounted filesystem.
//!
//! A FUSE adapter (fuser) over a small trait, [`KvNamespace`]. The tree is
//! `/<ns-hex32>/<hh>/<key-hex>` (the one naming scheme,
//! `kvtier_client::block_path`) plus a read-only `/.kvtier/` holding
//! `stats` and a tail-able `events`. Files are whole block files (header +
//! padded payload). Reads go to the backing file through FUSE passthrough
//! when the kernel and privileges allow, else through the daemon. Writes
//! are create-once imports verified before they become visible.
//!
//! Start with [`KvNamespace`] (what a store implements), [`mount`] (what a
//! daemon calls) and [`MemNamespace`] (the reference implementation).
//! Only this crate knows FUSE; it knows nothing of tiers. `faultfs` is
//! test support (a power-cutting FUSE filesystem for crash tests), built
//! only for tests and with the `testkit` feature, never into kvtierd.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod adapter;
pub mod error;
#[cfg(any(test, feature = "testkit"))]
pub mod faultfs;
pub mod memory;
pub mod mount;
pub mod names;
pub mod namespace;

pub use error::{Error, Result};
pub use memory::MemNamespace;
pub use mount::{
    clean_stale_mount, mount, mounted_at, Counters, MountGuard, MountOptions, MountedFs,
    Passthrough,
};
pub use namespace::{
    BlockReader, BlockStat, Caller, EventLog, KvNamespace, OpenBlock, Space, StagedBlock,
};
