//! kvtier-client: block identity, the block file format, the wire protocol,
//! and the client library that inference workers link to talk to `kvtierd`.
//!
//! Start with [`Namespace`] (what a block belongs to), [`BlockKey`] (what it
//! is called) and [`block`] (how it is stored).
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod block;
pub mod client;
pub mod error;
pub mod events;
pub mod key;
pub mod namespace;
pub mod proto;
pub mod shm;
pub mod types;

pub use block::{decode_block, encode_block, BlockHeader};
pub use client::{
    Client, ClientConfig, EventStream, LookupResult, Miss, MissCause, NsHandle, OffloadBlock,
    OffloadOutcome, Onboarded,
};
pub use error::{Error, FormatFault, Result};
pub use events::{KvEvent, KvEventData, StorageTier};
pub use key::{BlockKey, HashMode};
pub use namespace::{block_path, Dtype, KvLayout, LayoutKind, Namespace, NamespaceId};
pub use types::{Hints, Tier};
