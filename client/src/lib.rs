//! kvtier-client: block identity, the block file format, the wire protocol,
//! and the client library that inference workers link to talk to `kvtierd`.
//!
//! Start with [`Namespace`] (what a block belongs to), [`BlockKey`] (what it
//! is called) and [`block`] (how it is stored).
//!
//! ```no_run
//! use kvtier_client::{Client, Hints, KvLayout, Namespace};
//!
//! # fn main() -> kvtier_client::Result<()> {
//! let ns = Namespace::new("meta-llama/Llama-3.1-8B", KvLayout::llama3_8b(16), "", b"tenant-a".to_vec())?;
//! let client = Client::connect("/run/kvtier/kvtierd.sock")?;
//! let h = client.namespace(&ns);
//! let prompt_tokens: Vec<u32> = (0..64).collect();
//! let keys = h.hash_chain(&prompt_tokens); // one key per full 16-token block
//! let cached = h.lookup(&keys).prefix_len(); // leading blocks stored somewhere
//! // Onboard the cached prefix into the engine's buffers (a miss means: recompute).
//! let block_bytes = ns.layout.block_bytes() as usize;
//! let mut bufs: Vec<Vec<u8>> = vec![vec![0; block_bytes]; cached];
//! let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
//! let _onboarded = h.onboard_into(&keys[..cached], &mut views);
//! // Offload the blocks computed for the rest of the prompt.
//! let new_kv: Vec<Vec<u8>> = vec![vec![0; block_bytes]; keys.len() - cached];
//! let payloads: Vec<&[u8]> = new_kv.iter().map(|b| b.as_slice()).collect();
//! let parent = cached.checked_sub(1).map(|i| keys[i]);
//! h.offload_chain(parent, &keys[cached..], &payloads, Hints::default());
//! # Ok(())
//! # }
//! ```
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod access_hint;
pub mod aligned;
pub mod block;
pub mod checksum;
pub mod client;
pub mod error;
pub mod events;
pub mod key;
pub mod namespace;
pub mod proto;
pub mod shm;
pub mod types;

pub use aligned::AlignedBuf;
pub use block::{decode_block, encode_block, BlockHeader, DynamoMeta};
pub use checksum::{PayloadSum, SumAlgo, SumHasher};
pub use client::{
    Client, ClientConfig, DirectBlock, DirectBlocks, EventStream, LookupResult, Miss, MissCause,
    NsHandle, OffloadBlock, OffloadOutcome, Onboarded, Pool, PoolBlock,
};
pub use error::{Error, FormatFault, Result};
pub use events::{KvEvent, KvEventData, StorageTier};
pub use key::{BlockKey, DynamoBlock, HashMode, DYNAMO_SCHEME};
pub use namespace::{block_path, Dtype, KvLayout, LayoutKind, Namespace, NamespaceId};
pub use types::{Hints, Tier};
