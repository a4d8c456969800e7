//! `Node`: the store behind kvtierd's server. G3 (local NVMe) first, then
//! peers, then G4 (the shared object store), as one [`crate::base::backend::Backend`].
//!
//! Roles, one file each:
//! - `backend`: the [`crate::base::backend::Backend`] implementation (the server's
//!   view: lookup, offload, onboard, leases, pins, stats).
//! - `fetch`: the onboard fall-through (peer, then G4), verified on
//!   arrival; a batched onboard fetches its missing blocks concurrently.
//! - `promote`: fetched blocks staged in memory and promoted into G3 by
//!   background workers (bounded; a cache fill, not an acknowledged write).
//! - `locate`: lookup across tiers (G3 index, peer header probes, G4
//!   existence cache then HEAD), within a small deadline.
//! - `uplink`: the G4 write-through (admission, the uploader's block
//!   source, marking blocks safe in G4, re-queueing after a restart).
//! - `peers`: starting the peer server, the peer set and heartbeats.
//! - `events`: G3/G4 happenings turned into KV events on the bus.
//! - `remove`: deletion across tiers (`evict --tier g3|g4|all`).
//! - `repair`: daemon-side verify; a bad G3 copy is quarantined and
//!   re-fetched (verified) from a peer or G4 (`kvtier verify`, a client's
//!   corruption report).
//! - `scrub`: the background G3 scrub (verify and repair at a bounded
//!   rate), which finds copies corrupted at rest.
//!
//! Threading: the server calls the `Backend` methods from its own
//! connection threads. G4 and peers are async: the node owns a small tokio
//! runtime and hands work to it, waiting on a channel ([`Node::run_async`]),
//! so no `block_on` ever runs on a runtime thread.
//!
//! Architecture invariants:
//! - Bytes reach a client only verified: from G3 (`G3Store::read_into`
//!   verifies them, or the client verifies a direct read against the
//!   header), or, for the read right after a promotion, from the block the
//!   fetcher verified (staged for promotion, or kept in a bounded memo). A
//!   block found on a peer or in G4 is fetched and verified before anything
//!   is served; a read answers from the verified bytes while G3 is written
//!   in the background, a lease, pin or direct read waits for the G3 copy.
//!   A G4-only or peer-only read is byte-identical to what was stored, or a
//!   miss.
//! - A lookup never reports a block the node cannot then try to serve:
//!   `Peer` means a peer's header probe named this namespace and key, `G4`
//!   means G4's existence cache or a HEAD said present. Both are hints: a
//!   later fetch that fails verification is a miss.
//! - Ephemeral blocks never leave the node (not uploaded to G4).

mod backend;
mod backlog;
mod disk_order;
mod events;
mod fetch;
mod g4_order;
mod locate;
mod peers;
mod prefetch;
mod promote;
mod remove;
mod repair;
mod scrub;
pub use backlog::age_seconds as g4_backlog_age_seconds;
mod uplink;

use crate::base::error::{Error, Result};
use crate::base::events::EventBus;
use crate::tiers::g3::{G3Config, G3Store};
use crate::tiers::g4::{G4Config, G4StatsSnapshot, G4Store};
use crate::tiers::peer::{HeartbeatTask, PeerMetricsSnapshot, PeerServer, PeerSet};
use crate::tiers::policy::G4Admission;
use kvtier_client::{BlockKey, NamespaceId, Tier};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::runtime::{Handle, Runtime};

pub use peers::PeerSetup;
pub use prefetch::{PrefetchFigures, PrefetchLimits};
pub use promote::PromoteFigures;
pub use scrub::{ScrubFigures, ScrubLimits};

/// Entries of the "promoted from" memo at most (see [`Node`]).
const PROMOTED_MEMO_MAX: usize = 4096;
/// Bytes of fetched blocks the memo keeps for the read that follows their
/// promotion at most.
const PROMOTED_MEMO_BYTES_MAX: u64 = 64 << 20;

/// Recently promoted blocks (the `u64` beside it counts their bytes).
type PromotedMemo = HashMap<(NamespaceId, BlockKey), Promoted>;

/// A recently promoted block: where it came from and, while the memo has
/// room, its verified bytes (so the read that follows the promoting lease
/// is served without reading the fresh G3 copy back).
#[derive(Clone)]
struct Promoted {
    tier: Tier,
    block: Option<Arc<crate::base::tier::Block>>,
}

/// Everything a [`Node`] is built from.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The local tier.
    pub g3: G3Config,
    /// G3 eviction policy name (`default`, `lru`; see `policy::by_name`).
    pub policy: String,
    /// The shared tier, if any.
    pub g4: Option<G4Config>,
    /// Which blocks are written through to G4.
    pub admission: G4Admission,
    /// Peers, if enabled.
    pub peer: Option<PeerSetup>,
    /// Time a lookup may spend asking peers and G4 about blocks past the
    /// local prefix.
    pub lookup_remote_deadline_ms: u64,
    /// Time an onboard may spend fetching one block from peers and G4.
    pub fetch_deadline_ms: u64,
    /// Bytes of fetched blocks staged in memory at most (waiting for their
    /// background promotion into G3, or for the read of a batched onboard).
    pub staged_bytes_max: u64,
    /// Promotions waiting for a worker at most; a fetched block that finds
    /// the queue full is served but not promoted (0: never promote reads).
    pub promote_queue_max: usize,
    /// Pins held at once.
    pub pins_max: usize,
    /// Longest pin.
    pub pin_ttl_max_ms: u32,
    /// Bounds of the prefetch queue.
    pub prefetch: PrefetchLimits,
    /// The background G3 scrub's rate and pause (scrub.rs).
    pub scrub: ScrubLimits,
}

impl NodeConfig {
    /// G3 only, with defaults for the rest.
    pub fn new(g3: G3Config) -> Self {
        NodeConfig {
            g3,
            policy: "default".into(),
            g4: None,
            admission: G4Admission::All,
            peer: None,
            lookup_remote_deadline_ms: 200,
            fetch_deadline_ms: 10_000,
            staged_bytes_max: 256 << 20,
            promote_queue_max: 64,
            pins_max: 65536,
            pin_ttl_max_ms: 3_600_000,
            prefetch: PrefetchLimits::default(),
            scrub: ScrubLimits::default(),
        }
    }
}

/// What the peer server has done, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerServedFigures {
    /// Requests received.
    pub requests: u64,
    /// Block bytes sent.
    pub bytes_sent: u64,
    /// Requests refused for a bad or missing signature.
    pub unauthorized: u64,
    /// Requests refused otherwise (method, path, range).
    pub rejected: u64,
    /// Ranged requests (lookups' header probes).
    pub probes: u64,
    /// Holdings digests served.
    pub holdings_served: u64,
}

/// Node-level figures beyond [`crate::base::backend::BackendStats`] (G4 queue,
/// peers, promotions), read at scrape time.
#[derive(Debug, Clone, Default)]
pub struct NodeFigures {
    /// G4 counters, when G4 is configured.
    pub g4: Option<G4StatsSnapshot>,
    /// Peer client counters, when peers are enabled.
    pub peer: Option<PeerMetricsSnapshot>,
    /// Peer server counters, when peers are enabled.
    pub peer_served: Option<PeerServedFigures>,
    /// Promotions from peers.
    pub promoted_from_peer: PromoteFigures,
    /// Promotions from G4.
    pub promoted_from_g4: PromoteFigures,
    /// G3 write-through jobs queued by this node.
    pub g4_enqueued: u64,
    /// G3 recovery and repair counters ([`G3Store::recovery_figures`]).
    pub g3_recovery: Vec<(&'static str, u64)>,
    /// Prefetch counters.
    pub prefetch: PrefetchFigures,
}

/// G3 + optional G4 + optional peers. See the module docs.
pub struct Node {
    g3: Arc<G3Store>,
    g4: Option<Arc<G4Store>>,
    peers: Option<Arc<PeerSet>>,
    peer_server: Option<PeerServer>,
    peer_fanout: usize,
    node_id: String,
    heartbeat: Mutex<Option<HeartbeatTask>>,
    admission: G4Admission,
    events: Arc<RwLock<Option<EventBus>>>,
    listeners: events::Listeners,
    /// Orders External events (offloads tell it parents their headers lack).
    g4_order: Option<Arc<g4_order::G4Order>>,
    /// Where recently promoted blocks came from, so the read that follows
    /// the promoting lease reports the tier that actually delivered them.
    promoted: Mutex<(PromotedMemo, u64)>,
    leases: Mutex<HashMap<u64, Instant>>,
    pins: Mutex<HashMap<(NamespaceId, BlockKey), Instant>>,
    /// Fetched blocks waiting for (or being written by) their promotion.
    staging: promote::Staging,
    /// Remote fetches in flight now (promotions yield to them).
    activity: Arc<promote::Activity>,
    /// Remote fetches in flight at most (`fetch::FETCH_PARALLEL_MAX`).
    fetch_permits: Arc<tokio::sync::Semaphore>,
    /// Chains asked for ahead of their requests.
    prefetcher: prefetch::Prefetcher,
    /// The background G3 scrub.
    scrubber: scrub::Scrubber,
    g4_enqueued: Arc<AtomicU64>,
    /// Blocks evicted because the filesystem filled before capacity did.
    enospc_evictions: AtomicU64,
    /// Set at start when G3's capacity is above its filesystem's room.
    capacity_problem: Option<String>,
    /// Blocks removed by `evict` requests (G3 counts only its own).
    evicted_by_request: AtomicU64,
    lookup_remote_deadline: Duration,
    fetch_deadline: Duration,
    pins_max: usize,
    pin_ttl_max_ms: u32,
    handle: Handle,
    runtime: Mutex<Option<Runtime>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("node_id", &self.node_id)
            .field("g4", &self.g4.is_some())
            .field("peers", &self.peers.is_some())
            .finish()
    }
}

impl Node {
    /// Opens G3 (recovery included), G4 and peers as configured, starts the
    /// G4 uploader, the peer server and heartbeats.
    pub fn open(cfg: NodeConfig) -> Result<Arc<Node>> {
        let policy = crate::tiers::policy::by_name(&cfg.policy).ok_or_else(|| Error::Config {
            key: "g3.policy".into(),
            problem: format!("unknown policy {:?} (default | lru)", cfg.policy),
        })?;
        let g3 = G3Store::open(cfg.g3.clone(), policy)?;
        Self::open_with_g3(cfg, g3)
    }

    /// [`Node::open`] around a G3 store the caller opened (`cfg.g3` and
    /// `cfg.policy` are not used): the acknowledgement-path crash harness
    /// (daemon/tests/acked/mod.rs) opens G3 over its power-loss
    /// filesystem and serves it through the real node and server.
    pub fn open_with_g3(cfg: NodeConfig, g3: Arc<G3Store>) -> Result<Arc<Node>> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvtier-node")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the node runtime", "", e))?;
        let handle = runtime.handle().clone();
        let capacity_problem = Self::capacity_problem(&g3);
        if let Some(p) = &capacity_problem {
            tracing::warn!(problem = %p, "g3 capacity above the free space");
        }
        let events: Arc<RwLock<Option<EventBus>>> = Arc::new(RwLock::new(None));
        let listeners: events::Listeners = Arc::new(RwLock::new(Vec::new()));
        g3.set_event_sink(events::g3_sink(events.clone(), listeners.clone()));
        let mut g4_store = None;
        let mut g4_raw = None;
        if let Some(c) = &cfg.g4 {
            let (store, prefix) = c.build_store()?;
            g4_raw = Some((store.clone(), prefix.clone()));
            g4_store = Some(Arc::new(G4Store::with_handle(
                store,
                prefix,
                c.clone(),
                handle.clone(),
            )?));
        }
        let g4_enqueued = Arc::new(AtomicU64::new(0));
        let mut g4_order = None;
        if let Some(g4) = &g4_store {
            // Bounded by g4.startup_check_timeout_ms; a failure is logged,
            // counted and shown by /healthz, never fatal.
            if g4.startup_check().is_ok() {
                tracing::info!(url = %g4.config().url, "G4 start-up check passed");
            }
            g4_order = Some(uplink::start(&g3, g4, events.clone())?);
            // Every non-ephemeral block is owed an upload: eviction takes
            // uploaded ones first and counts the others (reclaimer.rs).
            // Under `after-first-reuse` most blocks are never owed one.
            g3.set_prefer_uploaded(cfg.admission == crate::tiers::policy::G4Admission::All);
        }
        let mut node_id = String::from("local");
        let mut peer_fanout = 1;
        let (mut peer_set, mut peer_server, mut heartbeat) = (None, None, None);
        if let Some(p) = &cfg.peer {
            let started = peers::start(&handle, &g3, p, g4_raw.clone())?;
            node_id = p.node_id.clone();
            peer_fanout = p.cfg.fanout_max.max(1);
            peer_set = Some(started.set);
            peer_server = Some(started.server);
            heartbeat = started.heartbeat;
        }
        let activity = promote::Activity::new();
        let staging = promote::Staging::start(
            g3.clone(),
            events.clone(),
            promote::StagingLimits {
                staged_bytes_max: cfg.staged_bytes_max,
                queue_max: cfg.promote_queue_max,
            },
            activity.clone(),
        )?;
        let node = Arc::new(Node {
            g3,
            g4: g4_store,
            peers: peer_set,
            peer_server,
            peer_fanout,
            node_id,
            heartbeat: Mutex::new(heartbeat),
            admission: cfg.admission,
            events,
            listeners,
            g4_order,
            promoted: Mutex::new((HashMap::new(), 0)),
            leases: Mutex::new(HashMap::new()),
            pins: Mutex::new(HashMap::new()),
            staging,
            activity,
            fetch_permits: Arc::new(tokio::sync::Semaphore::new(fetch::FETCH_PARALLEL_MAX)),
            prefetcher: prefetch::Prefetcher::new(cfg.prefetch),
            scrubber: scrub::Scrubber::default(),
            g4_enqueued,
            enospc_evictions: AtomicU64::new(0),
            capacity_problem,
            evicted_by_request: AtomicU64::new(0),
            lookup_remote_deadline: Duration::from_millis(cfg.lookup_remote_deadline_ms),
            fetch_deadline: Duration::from_millis(cfg.fetch_deadline_ms),
            pins_max: cfg.pins_max,
            pin_ttl_max_ms: cfg.pin_ttl_max_ms,
            handle,
            runtime: Mutex::new(Some(runtime)),
        });
        if node.g4.is_some() {
            backlog::spawn(&node);
        }
        node.prefetcher
            .start(&node)
            .map_err(|e| Error::io("starting the prefetch threads", "", e))?;
        node.scrubber
            .start(&node, cfg.scrub)
            .map_err(|e| Error::io("starting the g3 scrub thread", "", e))?;
        Ok(node)
    }

    /// The parent G3 is told for a block offloaded with `parent` (`earlier`:
    /// the blocks before it in its batch). G3 refuses a block whose parent
    /// it does not hold (no lookup could reach it there); with a remote
    /// tier the parent may be in G4 or on a peer, where a lookup does reach
    /// it, so the block starts a G3 chain of its own instead (events keep
    /// the declared parent). Only when a remote tier does hold it: a parent
    /// held nowhere (refused or evicted before its upload) stays the G3
    /// parent, so G3 refuses the block instead of keeping a root no lookup
    /// reaches (issue 27: blocks 75-99 of a 100-block chain into a full
    /// G3 were stored past a refused 74).
    pub(super) fn g3_parent(
        &self,
        ns: &NamespaceId,
        parent: Option<BlockKey>,
        earlier: &[crate::base::backend::OffloadBlock<'_>],
    ) -> Option<BlockKey> {
        let p = parent?;
        if !self.remote() || self.on_g3(ns, &p) || earlier.iter().any(|b| b.header.key == p) {
            return Some(p);
        }
        // One lookup (G4's existence cache or a HEAD, peers' digests or a
        // probe, within lookup_remote_deadline_ms): paid only by a block
        // whose parent G3 lacks, the start of a chain continued elsewhere.
        match self.locate(ns, std::slice::from_ref(&p)) {
            Ok((tiers, _)) if !tiers.is_empty() => None,
            _ => Some(p),
        }
    }

    /// G3's `put_blocks`, and when the filesystem fills up before capacity
    /// does (other files share it, or capacity is above its size): evicts
    /// twice what the failed items need and retries them once, so ENOSPC
    /// fails an offload only when eviction cannot help.
    pub(crate) fn put_evicting_on_enospc(
        &self,
        ns: &NamespaceId,
        items: &[crate::tiers::g3::PutItem<'_>],
    ) -> Vec<Result<crate::base::tier::PutOutcome>> {
        let mut out = self.g3.put_blocks(ns, items);
        let failed: Vec<usize> = (0..out.len())
            .filter(|&i| matches!(out[i], Err(Error::NoSpace { .. })))
            .collect();
        if failed.is_empty() {
            return out;
        }
        let need: u64 = failed.iter().map(|&i| items[i].header.file_len()).sum();
        // Pooled files (g3/recycle.rs) first: they hold disk space too.
        self.g3.release_recycled();
        let used = self.g3.stats().used_bytes;
        let evicted = self
            .g3
            .evict_to(used.saturating_sub(need.saturating_mul(2)), false);
        self.enospc_evictions.fetch_add(evicted, Ordering::Relaxed);
        tracing::warn!(
            failed = failed.len(),
            evicted,
            "g3: the filesystem is full before g3 capacity is; evicted to make room, retrying"
        );
        if evicted == 0 {
            return out;
        }
        let again: Vec<crate::tiers::g3::PutItem<'_>> = failed.iter().map(|&i| items[i]).collect();
        for (j, r) in self.g3.put_blocks(ns, &again).into_iter().enumerate() {
            out[failed[j]] = r;
        }
        out
    }

    /// A warning when G3's capacity is above what its filesystem can hold
    /// (free space plus what G3 uses now): the disk would fill first.
    fn capacity_problem(g3: &G3Store) -> Option<String> {
        let dir = &g3.config().root;
        let st = nix::sys::statvfs::statvfs(dir).ok()?;
        let free = st.blocks_available() as u64 * st.fragment_size() as u64;
        let used = g3.stats().used_bytes;
        let cap = g3.config().capacity_bytes;
        (cap > free.saturating_add(used)).then(|| {
            format!(
                "g3 capacity ({cap} bytes) is above what {} can hold ({} bytes free + {used} \
                 used): the disk fills first (offloads then evict and retry); lower g3.capacity",
                dir.display(),
                free
            )
        })
    }

    /// What the background G3 scrub did since start-up.
    pub fn scrub_figures(&self) -> ScrubFigures {
        self.scrubber.figures()
    }

    /// The local tier.
    pub fn g3(&self) -> &Arc<G3Store> {
        &self.g3
    }

    /// The shared tier, when configured.
    pub fn g4(&self) -> Option<&Arc<G4Store>> {
        self.g4.as_ref()
    }

    /// This node's id (`local` without peers).
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Where the peer server listens, when peers are enabled.
    pub fn peer_addr(&self) -> Option<std::net::SocketAddr> {
        self.peer_server.as_ref().map(|s| s.local_addr())
    }

    /// Headers of up to `limit` blocks of `ns` on G3 (what a start-up
    /// announces), each with whether G4 has a copy too (as far as this node
    /// knows: it uploaded or fetched it); a block evicted meanwhile or with
    /// a damaged header is left out. Buffered 4 KiB reads: call off the
    /// data path.
    pub fn g3_headers(
        &self,
        ns: &NamespaceId,
        limit: usize,
    ) -> Vec<(kvtier_client::BlockHeader, bool)> {
        let mut out = Vec::new();
        let mut after: Option<BlockKey> = None;
        while out.len() < limit {
            let page = self
                .g3
                .list(ns, after.as_ref(), 1024.min(limit - out.len()));
            let Some(last) = page.last().copied() else {
                break;
            };
            out.extend(page.iter().filter_map(|k| {
                let h = uplink::read_header(&self.g3, ns, k)?;
                let in_g4 = self.g3.stat(ns, k).is_some_and(|i| i.in_g4)
                    && self
                        .g4
                        .as_ref()
                        .is_some_and(|g| g.contains_cached(ns, k) != Some(false));
                Some((h, in_g4))
            }));
            after = Some(last);
        }
        out
    }

    /// Hands every G3 event (stored, removed) to `sink` too, on the thread
    /// that caused it (keep it short). For the mount's event log.
    pub fn add_g3_listener(&self, sink: crate::tiers::g3::EventSink) {
        if let Ok(mut l) = self.listeners.write() {
            l.push(sink);
        }
    }

    /// The mount's fall-through: brings a block G3 lacks in from a peer or
    /// G4 (verified, promoted). `Ok(true)` when it is on G3 now. Blocks for
    /// up to the fetch deadline; call from plain threads (FUSE's).
    pub fn fetch_hook(self: &Arc<Self>) -> crate::base::backend::FetchHook {
        let node = Arc::clone(self);
        Arc::new(move |ns: &NamespaceId, key: &BlockKey| {
            Ok(matches!(
                node.ensure_local(ns, key)?,
                crate::base::tier::Lookup::Hit(_)
            ))
        })
    }

    /// The mount's imports, stored as a client's offload is: G3 put (with
    /// ENOSPC eviction), the stored event on the bus (socket subscribers,
    /// the ZMQ publisher), G4 write-through admission. `on_stored` runs
    /// after each newly stored block (metrics).
    pub fn import_hook(
        self: &Arc<Self>,
        on_stored: Arc<dyn Fn(&kvtier_client::BlockHeader) + Send + Sync>,
    ) -> crate::base::backend::ImportHook {
        let node = Arc::clone(self);
        Arc::new(
            move |ns: &NamespaceId, header: &kvtier_client::BlockHeader, payload: &[u8]| {
                // A file's Dynamo parent links it in G3 when G3 holds the
                // parent; otherwise the file starts a chain (an import is
                // a file copy, never refused for its place in a chain; the
                // event still carries the header's parent).
                let parent = header
                    .dynamo
                    .as_ref()
                    .and_then(|d| d.parent)
                    .map(BlockKey::from_u64)
                    .filter(|p| node.on_g3(ns, p));
                let out = crate::base::backend::Backend::offload(
                    node.as_ref(),
                    ns,
                    header,
                    payload,
                    parent,
                    kvtier_client::Hints::default(),
                )?;
                if out.is_stored() {
                    on_stored(header);
                }
                Ok(out)
            },
        )
    }

    /// The mount's `rm` and `user.kvtier.evict`: the node's evict across
    /// tiers (see `remove`).
    pub fn evict_hook(self: &Arc<Self>) -> crate::base::backend::EvictHook {
        let node = Arc::clone(self);
        Arc::new(move |ns: &NamespaceId, key: &BlockKey, tier| node.evict_tiers(ns, key, tier))
    }

    /// Figures for `/metrics` beyond the backend stats.
    pub fn figures(&self) -> NodeFigures {
        NodeFigures {
            g4: self.g4.as_ref().map(|g| g.stats()),
            peer: self.peers.as_ref().map(|p| p.metrics()),
            peer_served: self.peer_server.as_ref().map(|s| {
                let m = s.metrics();
                PeerServedFigures {
                    requests: m.requests.load(Ordering::Relaxed),
                    bytes_sent: m.bytes_sent.load(Ordering::Relaxed),
                    unauthorized: m.unauthorized.load(Ordering::Relaxed),
                    rejected: m.rejected.load(Ordering::Relaxed),
                    probes: m.ranged.load(Ordering::Relaxed),
                    holdings_served: m.holdings_served.load(Ordering::Relaxed),
                }
            }),
            promoted_from_peer: self.staging.figures(Tier::Peer),
            promoted_from_g4: self.staging.figures(Tier::G4),
            g4_enqueued: self.g4_enqueued.load(Ordering::Relaxed),
            g3_recovery: self.g3.recovery_figures(),
            prefetch: self.prefetcher.figures(),
        }
    }

    /// Runs `fut` on the node runtime and waits for it. Must not be called
    /// from a runtime thread (the server's connection threads are plain
    /// threads). `None` when the runtime is gone (shutting down).
    fn run_async<T: Send + 'static>(
        &self,
        fut: impl Future<Output = T> + Send + 'static,
    ) -> Option<T> {
        run_on(&self.handle, fut)
    }

    fn remember_promoted(
        &self,
        ns: &NamespaceId,
        block: Arc<crate::base::tier::Block>,
        tier: Tier,
    ) {
        if let Ok(mut g) = self.promoted.lock() {
            let (m, bytes) = &mut *g;
            let len = block.payload.len() as u64;
            if m.len() >= PROMOTED_MEMO_MAX || *bytes + len > PROMOTED_MEMO_BYTES_MAX {
                // Only an optimization: forgotten entries read from G3 and
                // report G3.
                m.clear();
                *bytes = 0;
            }
            let keep = len <= PROMOTED_MEMO_BYTES_MAX;
            if keep {
                *bytes += len;
            }
            let key = (*ns, block.header.key);
            let old = m.insert(
                key,
                Promoted {
                    tier,
                    block: keep.then_some(block),
                },
            );
            if let Some(b) = old.and_then(|o| o.block) {
                *bytes = bytes.saturating_sub(b.payload.len() as u64);
            }
        }
    }

    /// Remembers that `key`'s G3 copy was just repaired from `tier` for a
    /// client that reads it next (no bytes kept: it reads G3), so that read
    /// reports `tier`.
    fn remember_repaired(&self, ns: &NamespaceId, key: &BlockKey, tier: Tier) {
        if let Ok(mut g) = self.promoted.lock() {
            let (m, bytes) = &mut *g;
            if m.len() >= PROMOTED_MEMO_MAX {
                m.clear();
                *bytes = 0;
            }
            let old = m.insert((*ns, *key), Promoted { tier, block: None });
            if let Some(b) = old.and_then(|o| o.block) {
                *bytes = bytes.saturating_sub(b.payload.len() as u64);
            }
        }
    }

    fn take_promoted(&self, ns: &NamespaceId, key: &BlockKey) -> Option<Promoted> {
        let mut g = self.promoted.lock().ok()?;
        let (m, bytes) = &mut *g;
        let p = m.remove(&(*ns, *key))?;
        if let Some(b) = &p.block {
            *bytes = bytes.saturating_sub(b.payload.len() as u64);
        }
        Some(p)
    }

    /// Waits until every background promotion queued so far is written
    /// into G3 (or has failed); `false` on timeout.
    pub fn wait_promotions(&self, timeout: Duration) -> bool {
        self.staging.wait_idle(timeout)
    }

    /// Stops heartbeats, waits (bounded) for promotions and G4 uploads,
    /// closes G3.
    pub fn shutdown(&self, g4_flush_timeout: Duration) -> Result<()> {
        if let Ok(mut h) = self.heartbeat.lock() {
            h.take();
        }
        self.prefetcher.stop();
        self.scrubber.stop();
        if !self.staging.wait_idle(g4_flush_timeout) {
            tracing::warn!("promotions still pending at shutdown; dropped (cache fills only)");
        }
        self.staging.close();
        if let Some(g4) = &self.g4 {
            if !g4.flush(g4_flush_timeout) {
                tracing::warn!(
                    "g4: uploads still pending at shutdown; they are re-queued at the next start"
                );
            }
        }
        self.g3.close()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.prefetcher.close();
        self.scrubber.close();
        if let Ok(mut r) = self.runtime.lock() {
            if let Some(rt) = r.take() {
                rt.shutdown_background();
            }
        }
    }
}

/// Runs `fut` on `handle` and waits for it from a non-runtime thread.
pub(crate) fn run_on<T: Send + 'static>(
    handle: &Handle,
    fut: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().ok()
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ops;
