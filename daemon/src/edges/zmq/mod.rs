//! KV events on vLLM 0.33.0's ZMQ wire (`[events.zmq]`), for NVIDIA
//! Dynamo's router and any consumer written against vLLM's types.
//!
//! A PUB socket sends multipart messages `[topic, seq (u64 big-endian),
//! payload]`, the payload a msgpack `KVEventBatch` ([`wire`]); a ROUTER
//! socket beside it answers "replay from seq N" (`[identity, "", N]`) as
//! vLLM 0.33.0's `ZmqEventPublisher` does: `[identity, "", topic, seq,
//! payload]` per batch, then `[identity, "", "", -1, ""]` as the end.
//! Proven with vLLM's own `msgspec` decoder
//! (client/python/tests_engines/test_zmq_events.py) and with Dynamo
//! 1.6.1's decoder, normalizer, radix indexer and standalone indexer
//! (tests/dynamo-oracle).
//!
//! - Only the namespaces configured are published, each with the salt and
//!   LoRA name its workers hash with ([`convert`]); blocks whose routing
//!   facts disagree with them, or that were offloaded without token ids,
//!   are counted and left out.
//! - Never on the data path: the publisher reads its own bounded event-bus
//!   subscription on a thread of its own. Falling behind loses events; it
//!   then starts over with `AllBlocksCleared` and the current holdings (a
//!   router applying them ends where the node is), counted as a resync.
//!   A slow ZMQ subscriber loses messages inside the PUB socket, sees the
//!   gap in the sequence numbers and asks the replay socket.
//! - A start-up begins with `AllBlocksCleared` (which forgets the worker in
//!   every tier) and then announces what G3 holds (parents first) as G3
//!   (STORAGE/LOCAL, or DISK with `media = "dynamo"`), and those of them G4
//!   has a copy of as G4 (STORAGE/REMOTE, or EXTERNAL), so a router that knew
//!   the node before the restart forgets what went away. Blocks only in G4
//!   (evicted from G3) are not announced again until they are uploaded or
//!   fetched: after a restart the router under-reports G4, never over.
//!   Sequence numbers start at the clock (microseconds since the Unix
//!   epoch) or above every earlier run's when the clock is behind
//!   ([`crate::base::id_floor`]): a consumer sees a gap, not stale numbers, and
//!   asks for a replay.
//! - A subscriber connected across a restart reconnects after the
//!   start-up's batches went out: after `heartbeat_ms` without a batch the
//!   publisher sends an empty one, whose number shows the gap, so the
//!   subscriber asks for a replay without waiting for the next store.
//! - Replay keeps the last `replay_batches_max` batches; a request older
//!   than them is answered with a fresh `AllBlocksCleared` and the
//!   holdings instead, numbered contiguously up to the newest batch sent
//!   (the live stream goes on from the next number), so a Dynamo listener
//!   finds the replay in order with nothing missing.

mod convert;
mod publisher;
pub mod wire;

pub use convert::{Published, PublishedNs};
pub use publisher::ZmqPublisher;

use kvtier_client::{BlockHeader, NamespaceId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Where a start-up (or an old replay) learns what G3 holds: up to
/// `limit` block headers of a namespace, each with whether G4 holds a copy.
pub type Holdings = Arc<dyn Fn(&NamespaceId, usize) -> Vec<(BlockHeader, bool)> + Send + Sync>;

/// What a publisher is asked to do.
#[derive(Clone)]
pub struct ZmqOptions {
    /// PUB endpoint (`tcp://...`, `ipc://...`); port 0 picks a free one.
    pub endpoint: String,
    /// ROUTER endpoint for replays.
    pub replay_endpoint: Option<String>,
    /// Topic frame.
    pub topic: String,
    /// Batches kept for replay.
    pub replay_batches_max: usize,
    /// Blocks announced at most by a start-up or resync.
    pub announce_blocks_max: usize,
    /// `data_parallel_rank` of each batch.
    pub dp_rank: Option<u32>,
    /// An empty batch after this long without one (0: none).
    pub heartbeat_ms: u64,
    /// Permission bits of `ipc://` socket files.
    pub ipc_mode: u32,
    /// How tiers are named on the wire.
    pub media: wire::Media,
    /// The namespaces covered.
    pub published: Published,
    /// Keeps sequence numbers above the last run's when the clock is
    /// behind (`None`: they start at the clock).
    pub seq_floor: Option<(Arc<crate::base::id_floor::IdFloor>, u64)>,
}

/// Counters of a publisher (`kvtier_events_zmq_*_total` in /metrics).
#[derive(Debug, Default)]
pub struct ZmqStats {
    /// Batches sent on the PUB socket.
    pub batches: AtomicU64,
    /// Blocks announced (stored events' blocks).
    pub blocks_stored: AtomicU64,
    /// Stored blocks left out: no token ids or no Dynamo key.
    pub skipped_blocks: AtomicU64,
    /// Stored blocks left out: tokens_hash disagrees with the configured
    /// salt / LoRA name.
    pub mismatched_blocks: AtomicU64,
    /// Bus events lost because the publisher fell behind.
    pub lagged_events: AtomicU64,
    /// Start-overs (AllBlocksCleared + holdings), the first at start-up.
    pub resyncs: AtomicU64,
    /// Holdings not announced because of `announce_blocks_max`.
    pub announce_truncated: AtomicU64,
    /// Holdings not announced because a parent is not held (a router
    /// would refuse them).
    pub orphans: AtomicU64,
    /// Empty batches sent while idle.
    pub heartbeats: AtomicU64,
    /// Replay requests answered.
    pub replays: AtomicU64,
    /// Replays that began with holdings (asked for batches no longer kept).
    pub replay_snapshots: AtomicU64,
    /// PUB or ROUTER send failures.
    pub send_errors: AtomicU64,
}

impl ZmqStats {
    /// `(what, value)` pairs for metrics.
    pub fn figures(&self) -> Vec<(&'static str, u64)> {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        vec![
            ("batches", g(&self.batches)),
            ("blocks_stored", g(&self.blocks_stored)),
            ("skipped_blocks", g(&self.skipped_blocks)),
            ("mismatched_blocks", g(&self.mismatched_blocks)),
            ("lagged_events", g(&self.lagged_events)),
            ("resyncs", g(&self.resyncs)),
            ("announce_truncated", g(&self.announce_truncated)),
            ("orphans", g(&self.orphans)),
            ("heartbeats", g(&self.heartbeats)),
            ("replays", g(&self.replays)),
            ("replay_snapshots", g(&self.replay_snapshots)),
            ("send_errors", g(&self.send_errors)),
        ]
    }
}
