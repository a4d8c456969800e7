//! The one interface between the local server and the store behind it.
//!
//! The server knows nothing about tiers, files or indexes: it validates
//! frames, moves bytes between the client's shared region and this trait,
//! and counts. The node (layer 3) implements `Backend` over G3, peers and
//! G4; the test kit's `MemBackend` is the in-memory test seam.
//!
//! Contract, for every implementation:
//! - Calls are synchronous and may block on I/O; the server calls them from
//!   its per-connection threads, so one slow call stalls only its client.
//! - Buffers handed in (`payload` of `offload`, `dst` of `read_into`) live in
//!   a client's shared memory, which that client may modify concurrently.
//!   `offload` must verify the payload checksum on the bytes it actually
//!   persists (e.g. after copying, or on the written file), never trust a
//!   check done on the shared buffer before the copy.
//! - A missing, torn or corrupt block is `Lookup::Miss` (a value); `Err` is
//!   for the store itself failing. Never return unverified bytes as a hit.
//! - Leases and pins are bounded: `lease` and `pin` return
//!   [`Error::LimitReached`] when the budget is spent. A leased or pinned
//!   block is not evicted by capacity pressure, and `evict` refuses it.
//!   Leases cannot be renewed: each lives at most the configured maximum, so
//!   a client re-leasing in a loop cannot keep a block forever (pins are the
//!   tool for that, and they have their own budget and TTL cap).
//! - Stored and Removed events go to the bus given to `attach_events`,
//!   including removals the store decides itself (capacity eviction).

use crate::base::error::Result;

/// A read's eviction-policy touch, run by the caller in request order
/// (tiers/g3/access_order.rs).
pub type ReadTouch = Box<dyn FnOnce() + Send>;
use crate::base::events::EventBus;
use crate::base::tier::{Lookup, MissReason, PutOutcome};
use kvtier_client::proto::{BlockStat, ItemStatus, ListEntry};
use kvtier_client::{BlockHeader, BlockKey, Hints, NamespaceId, Tier};
use std::sync::Arc;

/// A lease handle (never 0).
pub type LeaseId = u64;

/// A block file opened for a direct read by the client.
#[derive(Debug)]
pub struct ReadFile {
    /// The open file (its fd is passed to the client).
    pub file: std::fs::File,
    /// Offset of the block's header in the file (payload at +4096).
    pub offset: u64,
    /// The verified header.
    pub header: BlockHeader,
    /// Where the block is.
    pub tier: Tier,
}

/// One block of an offload request ([`Backend::offload_batch`]).
#[derive(Debug, Clone)]
pub struct OffloadBlock<'a> {
    /// The validated header (its namespace is the request's).
    pub header: BlockHeader,
    /// The payload (shared memory).
    pub payload: &'a [u8],
    /// The block before this one in its chain.
    pub parent: Option<BlockKey>,
    /// Engine hints.
    pub hints: Hints,
}

/// Outcome of an eviction request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictOutcome {
    /// Removed from the node.
    Evicted,
    /// Not stored.
    Absent,
    /// Leased or pinned: kept.
    Busy,
}

/// Outcome of a daemon-side verification (`kvtier verify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyOutcome {
    /// The stored copy verified.
    Ok,
    /// The copy failed, was quarantined, and a verified copy from this
    /// tier replaced it.
    Repaired(kvtier_client::Tier),
    /// The copy failed and was quarantined; no good copy was found (or
    /// repair was not asked for).
    Dropped,
    /// Not stored here.
    Absent,
}

/// Occupancy of one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierStats {
    /// Which tier.
    pub tier: Tier,
    /// Blocks held.
    pub blocks: u64,
    /// Bytes held (files, including headers and padding).
    pub bytes: u64,
    /// Configured capacity (0: unbounded or unknown).
    pub capacity_bytes: u64,
    /// Whether `blocks` and `bytes` are known (G4's are not until its
    /// first listing has finished); unknown figures read 0 here and are
    /// left out of /metrics and shown as null by `stats`.
    pub known: bool,
}

/// Store-wide figures for `stats` and `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Per tier.
    pub tiers: Vec<TierStats>,
    /// Blocks evicted by capacity pressure or request, since start.
    pub evictions: u64,
    /// Blocks found corrupt and quarantined, since start.
    pub quarantined: u64,
    /// Leases held now.
    pub leases_held: u64,
    /// Pins held now.
    pub pins_held: u64,
}

/// Who asks for a prefetch: its uid has a share of the queue, and a newer
/// prefetch of the same uid and stream supersedes the older one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchCaller {
    /// The caller's uid.
    pub uid: u32,
    /// The caller's stream (`Request::Prefetch`); 0: never superseded.
    pub stream: u64,
}

/// The store behind the local server. See the module docs for the contract.
pub trait Backend: Send + Sync + 'static {
    /// Short name (`mem`, `g3+g4`), reported in stats and bench JSON.
    fn name(&self) -> &'static str;

    /// The tier of each block of the longest stored prefix of `chain`.
    fn lookup(&self, ns: &NamespaceId, chain: &[BlockKey]) -> Result<Vec<Tier>>;

    /// [`Backend::lookup`], and why the prefix stopped short of `chain`
    /// (meaningless when it did not): `Absent` when no tier holds the
    /// first missing block, `Unavailable` when a tier that might hold it
    /// could not answer in time (G4 down or late), so that misses during
    /// an outage are counted as such. The default: always `Absent`.
    fn lookup_why(&self, ns: &NamespaceId, chain: &[BlockKey]) -> Result<(Vec<Tier>, MissReason)> {
        Ok((self.lookup(ns, chain)?, MissReason::Absent))
    }

    /// Stores one block whose validated header is `header` (its namespace
    /// is `ns`) and whose payload is `payload` (shared memory).
    fn offload(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        payload: &[u8],
        parent: Option<BlockKey>,
        hints: Hints,
    ) -> Result<PutOutcome>;

    /// Stores the blocks of one offload request: one outcome per block, in
    /// input order, each with [`Backend::offload`]'s meaning (a failed
    /// block does not fail the others). Blocks of a chain come parent
    /// first; a store that batches must keep that order wherever it is
    /// visible (policy, events). The default stores them one at a time.
    fn offload_batch(
        &self,
        ns: &NamespaceId,
        blocks: &[OffloadBlock<'_>],
    ) -> Vec<Result<PutOutcome>> {
        blocks
            .iter()
            .map(|b| self.offload(ns, &b.header, b.payload, b.parent, b.hints))
            .collect()
    }

    /// Reads a verified block into `dst` (shared memory, 4096-aligned):
    /// header in `dst[..4096]`, payload from `dst[4096..]`. A block larger
    /// than `dst` is a miss.
    fn read_into(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> Result<Lookup<(BlockHeader, Tier)>>;

    /// [`Backend::read_into`] for a reader that checks the payload against
    /// the header's checksum itself, on the bytes it received, and reports a
    /// mismatch (`OP_REPORT_CORRUPT`): a client onboarding into its shared
    /// region. A backend may then leave the payload checksum to the reader
    /// (G3 reads straight into `dst`, checking the header and length), so
    /// each byte is hashed once. Default: the verifying read.
    fn read_into_for_verifier(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> Result<Lookup<(BlockHeader, Tier)>> {
        self.read_into(ns, key, dst)
    }

    /// [`Backend::read_into_for_verifier`] for the blocks of one request
    /// at once, where a backend can read them together on this thread
    /// (G3's slotted blocks: one batch of ring requests). One outcome per
    /// item, in order: `Some((header, tier, touch))` for a hit, whose
    /// eviction-policy touch the caller runs in request order; `None` for
    /// an item the caller reads the usual way. Default: none served.
    fn read_many_for_verifier(
        &self,
        ns: &NamespaceId,
        items: &mut [(BlockKey, &mut [u8])],
    ) -> Vec<Option<(BlockHeader, Tier, ReadTouch)>> {
        let _ = ns;
        items.iter().map(|_| None).collect()
    }

    /// The first step of an onboard of several blocks, before they are
    /// leased and read one by one: a backend may bring missing blocks close
    /// concurrently (the node fetches them from peers and G4). Per key,
    /// `Some(reason)` when the block is known missing now, so the read
    /// would miss the same way; `None` otherwise. Default: nothing known.
    fn prepare_onboard(&self, _ns: &NamespaceId, keys: &[BlockKey]) -> Vec<Option<MissReason>> {
        vec![None; keys.len()]
    }

    /// Queues the blocks of `keys` that are not local for a background
    /// fetch within `deadline_ms` (see `Request::Prefetch`). Default, for a
    /// store without remote tiers: nothing to fetch, so `AlreadyPresent`
    /// for what it holds and `Absent` for the rest.
    fn prefetch(
        &self,
        _caller: PrefetchCaller,
        ns: &NamespaceId,
        keys: &[BlockKey],
        _deadline_ms: u32,
    ) -> Vec<ItemStatus> {
        keys.iter()
            .map(|k| match self.stat(ns, k) {
                Ok(Some(_)) => ItemStatus::AlreadyPresent,
                _ => ItemStatus::Absent,
            })
            .collect()
    }

    /// Opens a block for a direct read by the client.
    fn open_for_read(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<ReadFile>>;

    /// Keeps a block from eviction for up to `ttl_ms` (capped).
    fn lease(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: u32) -> Result<Lookup<LeaseId>>;

    /// Ends a lease; false when unknown or expired.
    fn release(&self, lease: LeaseId) -> bool;

    /// Pins a block for up to `ttl_ms` (capped).
    fn pin(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: u32) -> Result<Lookup<()>>;

    /// Removes a pin; false when not pinned.
    fn unpin(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool>;

    /// Removes a block from the node unless leased or pinned.
    fn evict(&self, ns: &NamespaceId, key: &BlockKey) -> Result<EvictOutcome>;

    /// Removes a block from `tier` (G3: [`Self::evict`]; G4: the shared
    /// object store). Default: only G3 exists.
    fn evict_tier(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        tier: kvtier_client::proto::EvictTier,
    ) -> Result<EvictOutcome> {
        if tier.g3() {
            self.evict(ns, key)
        } else {
            Ok(EvictOutcome::Absent)
        }
    }

    /// A client's report that a block it was served failed its check
    /// (`ReportCorrupt`): [`Self::verify`] with repair. The client reads the
    /// block again next, so a backend that repaired it from another tier
    /// reports that tier on that read. Default: verify with repair.
    fn report_corrupt(&self, ns: &NamespaceId, key: &BlockKey) -> Result<VerifyOutcome> {
        self.verify(ns, key, true)
    }

    /// Re-reads a stored block through the verifying read path; a copy
    /// that fails is quarantined (the read path does that) and, with
    /// `repair` on a backend with other tiers, replaced by a verified copy.
    /// Default: verify only.
    fn verify(&self, ns: &NamespaceId, key: &BlockKey, _repair: bool) -> Result<VerifyOutcome> {
        let Some(st) = self.stat(ns, key)? else {
            return Ok(VerifyOutcome::Absent);
        };
        let len = kvtier_client::block::HEADER_BYTES as u64
            + st.payload_len
                .next_multiple_of(kvtier_client::block::ALIGN_BYTES as u64);
        let mut buf = vec![0u8; len as usize];
        Ok(match self.read_into(ns, key, &mut buf)? {
            Lookup::Hit(_) => VerifyOutcome::Ok,
            Lookup::Miss(MissReason::Corrupt) => VerifyOutcome::Dropped,
            Lookup::Miss(_) => VerifyOutcome::Absent,
        })
    }

    /// Metadata of a block, `None` when absent.
    fn stat(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<BlockStat>>;

    /// Up to `limit` blocks after `after` in (namespace, key) order.
    fn list(
        &self,
        ns: Option<NamespaceId>,
        after: Option<(NamespaceId, BlockKey)>,
        limit: usize,
    ) -> Result<Vec<ListEntry>>;

    /// Store-wide figures.
    fn stats(&self) -> BackendStats;

    /// Where to publish KV events from now on.
    fn attach_events(&self, bus: EventBus);

    /// Makes everything acknowledged durable (called at shutdown).
    fn flush(&self) -> Result<()>;

    /// Whether the node holds blocks of `ns` (bounds namespaces per uid;
    /// `true` when unknown).
    fn holds_namespace(&self, _ns: &NamespaceId) -> bool {
        true
    }

    /// Why the backend is degraded now, one line per problem (a tier that
    /// failed its start-up check, an open G4 circuit breaker); empty when
    /// healthy. `/healthz` shows it. Degraded is not fatal: the node
    /// serves what it can, and the rest are misses.
    fn health(&self) -> Vec<String> {
        Vec::new()
    }
}

// The mount's hooks into the node: the node builds them, the mount calls
// them; defined here so that neither layer imports the other's types.

/// Brings a block that G3 lacks (G4-only, peer-only) into G3, verified.
/// `Ok(true)`: it is in G3 now; `Ok(false)`: nobody has it. Called from
/// FUSE threads; it may block for the duration of a fetch.
pub type FetchHook = Arc<dyn Fn(&NamespaceId, &BlockKey) -> Result<bool> + Send + Sync + 'static>;

/// Stores a block imported through the mount the way a client offload is
/// stored (the node's path: G3 put, the stored event on the bus, G4
/// write-through admission, metrics). Without one, imports go straight to
/// G3 (and are neither announced nor uploaded).
pub type ImportHook = Arc<
    dyn Fn(&NamespaceId, &kvtier_client::BlockHeader, &[u8]) -> Result<PutOutcome>
        + Send
        + Sync
        + 'static,
>;

/// Removes a block from tiers (the node's evict: leases and pins refuse
/// it, G4 deletions are announced). `Ok(false)`: no tier had it.
pub type EvictHook = Arc<
    dyn Fn(&NamespaceId, &BlockKey, kvtier_client::proto::EvictTier) -> Result<EvictOutcome>
        + Send
        + Sync
        + 'static,
>;
