//! Presence and state, from memory (and one redb record for `stat`):
//! `lookup_prefix` (and its precomputed-digest form), `stat`, `list`,
//! `namespaces`. No verification: lookups are hints, reads verify.

use super::index::{self, FLAG_EPHEMERAL, FLAG_IN_G4, PIN_FOREVER};
use super::{now_s, G3Store};
use kvtier_client::{BlockKey, NamespaceId};
use std::sync::atomic::Ordering;

/// A block's state as [`G3Store::stat`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockInfo {
    /// File length (header + padded payload).
    pub file_len: u64,
    /// Payload length.
    pub payload_len: u64,
    /// Payload checksum.
    pub payload_sum: kvtier_client::PayloadSum,
    /// When first stored.
    pub created_unix_ms: u64,
    /// Reads served.
    pub hits: u32,
    /// Last read or write (second resolution).
    pub last_access_unix_ms: u64,
    /// A pin protects it now.
    pub pinned: bool,
    /// When the pin ends (Unix ms): 0 when not pinned, `u64::MAX` for a pin
    /// without end (a `pinned` hint, the mount's `setfattr`).
    pub pinned_until_unix_ms: u64,
    /// Priority hint.
    pub priority: u8,
    /// Ephemeral hint.
    pub ephemeral: bool,
    /// Live leases.
    pub leases: u16,
    /// A copy exists in G4.
    pub in_g4: bool,
    /// It lives in a slab slot (slots.rs), not a file of its own.
    pub slotted: bool,
}

impl G3Store {
    /// How many leading blocks of `chain` are present. Memory only: no disk
    /// access, no verification (a later read may still miss).
    pub fn lookup_prefix(&self, ns: &NamespaceId, chain: &[BlockKey]) -> usize {
        // One read lock per chain; hashing under it costs readers nothing
        // and delays a writer by at most the chain's hashing.
        self.mem
            .read()
            .map(|m| m.lookup_prefix(ns, chain))
            .unwrap_or(0)
    }

    /// [`G3Store::lookup_prefix`] over digests computed earlier with
    /// [`G3Store::chain_digests`] (a caller probing the same chain on
    /// several tiers or repeatedly hashes it once). Probes only.
    pub fn lookup_prefix_digests(&self, digests: &[(u64, u64)]) -> usize {
        self.mem
            .read()
            .map(|m| m.count_present(digests))
            .unwrap_or(0)
    }

    /// The index digests of a chain's keys, for
    /// [`G3Store::lookup_prefix_digests`].
    pub fn chain_digests(ns: &NamespaceId, chain: &[BlockKey]) -> Vec<(u64, u64)> {
        index::digests(ns, chain)
    }

    /// A block's state, or `None` when absent. Reads one redb record.
    pub fn stat(&self, ns: &NamespaceId, key: &BlockKey) -> Option<BlockInfo> {
        let (id, pinned, pin_until_s, leases, priority, flags, hits, last, slotted) = {
            let mem = self.mem.read().ok()?;
            let (id, e) = mem.get(ns, key)?;
            (
                id,
                e.pinned(now_s()),
                e.pin_until_s,
                e.leases,
                e.priority,
                e.flags,
                e.hits.load(Ordering::Relaxed),
                e.last_access_s.load(Ordering::Relaxed),
                e.slotted().is_some(),
            )
        };
        let rec = self.disk.get_named(id, ns, key).ok()??;
        Some(BlockInfo {
            file_len: rec.file_len(),
            payload_len: rec.payload_len,
            payload_sum: rec.payload_sum,
            created_unix_ms: rec.created_unix_ms,
            hits,
            last_access_unix_ms: u64::from(last) * 1000,
            pinned,
            pinned_until_unix_ms: match (pinned, pin_until_s) {
                (false, _) => 0,
                (true, PIN_FOREVER) => u64::MAX,
                (true, s) => u64::from(s) * 1000,
            },
            priority,
            ephemeral: flags & FLAG_EPHEMERAL != 0,
            leases,
            in_g4: flags & FLAG_IN_G4 != 0,
            slotted,
        })
    }

    /// Up to `limit` keys of `ns` after `after`, sorted by raw key bytes
    /// (page by passing the last key back).
    pub fn list(&self, ns: &NamespaceId, after: Option<&BlockKey>, limit: usize) -> Vec<BlockKey> {
        self.disk.list(ns, after, limit).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "g3: list failed");
            Vec::new()
        })
    }

    /// Whether `ns` holds at least one block.
    pub fn holds_namespace(&self, ns: &NamespaceId) -> bool {
        self.mem
            .read()
            .map(|m| m.ns_blocks.contains_key(ns))
            .unwrap_or(true)
    }

    /// Namespaces that hold at least one block, sorted.
    pub fn namespaces(&self) -> Vec<NamespaceId> {
        let mut v: Vec<NamespaceId> = self
            .mem
            .read()
            .map(|m| m.ns_blocks.keys().copied().collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}
