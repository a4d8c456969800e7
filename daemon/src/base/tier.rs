//! The tier interface that G3 (local NVMe) and G4 (object store) implement,
//! and that one conformance suite exercises for every backend.
//!
//! Contract, for every implementation:
//! - `put` is atomic and create-once: no reader observes a partial block,
//!   and putting a key that exists is a no-op reported as `AlreadyPresent`.
//! - `get` returns only verified bytes (header and payload checksum). A
//!   missing, torn or corrupt block is `Lookup::Miss`, never an error and
//!   never wrong bytes. Errors are for the tier itself failing.
//! - Once `put` returned `Stored`, the block survives a crash and restart.

use crate::base::error::Result;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};

/// A lookup's outcome: a miss is a value, not an error.
#[derive(Debug)]
pub enum Lookup<T> {
    /// Found and verified.
    Hit(T),
    /// Not served, and why.
    Miss(MissReason),
}

impl<T> Lookup<T> {
    /// The hit, if any.
    pub fn hit(self) -> Option<T> {
        match self {
            Lookup::Hit(t) => Some(t),
            Lookup::Miss(_) => None,
        }
    }
}

/// Why a lookup missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissReason {
    /// The tier does not hold the block.
    Absent,
    /// The block was there but failed verification (it is quarantined).
    Corrupt,
    /// The tier could not be asked (down, its breaker open, throttled,
    /// an error answer).
    Unavailable,
    /// The tier was asked and did not answer within a deadline (a hung
    /// or slow store): the client is told `timeout`, not `unavailable`.
    Timeout,
}

/// Outcome of a put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// Newly stored and durable.
    Stored,
    /// Newly stored and durable, but the pin it asked for was refused: the
    /// pin budget (`pinned_budget_bytes`) is spent, so it is evicted like
    /// any other block.
    StoredUnpinned,
    /// The key was already present; nothing was written.
    AlreadyPresent,
}

impl PutOutcome {
    /// Newly stored (pinned as asked or not).
    pub fn is_stored(self) -> bool {
        matches!(self, PutOutcome::Stored | PutOutcome::StoredUnpinned)
    }
}

/// A verified block read from a tier.
#[derive(Debug, Clone)]
pub struct Block {
    /// The validated header.
    pub header: BlockHeader,
    /// The verified payload.
    pub payload: Vec<u8>,
}

/// The minimal interface of a block tier.
pub trait BlockTier: Send + Sync {
    /// Short name for logs and metrics (`g3`, `g4`).
    fn name(&self) -> &'static str;
    /// Stores a block (see the module contract).
    fn put(&self, ns: &NamespaceId, header: &BlockHeader, payload: &[u8]) -> Result<PutOutcome>;
    /// Reads and verifies a block.
    fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<Block>>;
    /// Whether the tier holds the block (may be stale for remote tiers).
    fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool>;
    /// Removes a block; `false` when it was not there.
    fn delete(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool>;
}
