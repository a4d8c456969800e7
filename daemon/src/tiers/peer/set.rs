//! [`PeerSet`]: the live peers (static list plus discovered ones) and the
//! lookup that asks them in rendezvous order within the caller's deadline.
//!
//! Each peer gets at most `per_peer_timeout_ms` of the deadline, so one slow
//! peer cannot eat the whole budget. A peer that was unreachable is skipped
//! for `down_backoff_ms`; one that sent bytes failing verification is
//! skipped for `corrupt_quarantine_ms`. Skips are counted.

use super::client::{PeerClient, PeerFetch, PeerMetricsSnapshot, PeerMiss};
use super::holdings::HoldingsDigest;
use super::{placement, validate_node_id, PeerInfo};
use crate::base::error::{Error, Result};
use crate::base::tier::Block;
use kvtier_client::{BlockKey, NamespaceId, Tier};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

/// Most peers asked for one block.
pub const FANOUT_LIMIT: usize = 16;

/// Peer-set settings.
#[derive(Debug, Clone)]
pub struct PeerSetConfig {
    /// This node's id (never asked).
    pub self_id: String,
    /// Peers from the config file.
    pub static_peers: Vec<PeerInfo>,
    /// Peers asked per lookup, most likely first (1 to 16).
    pub fanout_max: usize,
    /// Longest time given to one peer.
    pub per_peer_timeout_ms: u64,
    /// How long an unreachable or timed-out peer is skipped.
    pub down_backoff_ms: u64,
    /// How long a peer that sent corrupt bytes is skipped.
    pub corrupt_quarantine_ms: u64,
    /// Period of fetching every live peer's holdings digest; 0: no
    /// digests, lookups probe every block.
    pub holdings_refresh_ms: u64,
    /// Largest digest accepted from a peer.
    pub holdings_bytes_max: u64,
    /// Whether a block a peer's digest does not list is still confirmed
    /// with a header probe (finds blocks stored since the digest; a lookup
    /// probes at most the blocks around its first gap). `false`: the
    /// digest's answer is final.
    pub holdings_probe_negatives: bool,
}

impl PeerSetConfig {
    /// Defaults: ask 3 peers, 2 s each, back off 5 s, quarantine 60 s.
    pub fn new(self_id: impl Into<String>) -> Self {
        PeerSetConfig {
            self_id: self_id.into(),
            static_peers: Vec::new(),
            fanout_max: 3,
            per_peer_timeout_ms: 2_000,
            down_backoff_ms: 5_000,
            corrupt_quarantine_ms: 60_000,
            holdings_refresh_ms: 2_000,
            holdings_bytes_max: 4 << 20,
            holdings_probe_negatives: true,
        }
    }

    /// Oldest digest still used: three refresh periods (one refresh may
    /// fail without falling back to probes).
    pub fn holdings_age_max(&self) -> Duration {
        Duration::from_millis(self.holdings_refresh_ms.saturating_mul(3))
    }
}

/// Peers whose digests are kept at most (the rest are probed).
pub const HOLDINGS_PEERS_MAX: usize = 1024;

/// One peer's digest and when it arrived.
#[derive(Debug, Clone)]
struct Held {
    digest: std::sync::Arc<HoldingsDigest>,
    fetched: Instant,
}

/// One peer asked during a lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAttempt {
    /// The peer's id.
    pub peer_id: String,
    /// What it answered; `None` when it was skipped (marked down or lying).
    pub miss: Option<PeerMiss>,
}

/// A lookup's outcome.
#[derive(Debug)]
pub enum PeerLookup {
    /// A verified block from `peer`.
    Hit {
        /// Who delivered it.
        peer: PeerInfo,
        /// The verified block (boxed: it is much larger than a miss).
        block: Box<Block>,
        /// Peers that missed before it.
        attempts: Vec<PeerAttempt>,
    },
    /// No peer delivered it.
    Miss {
        /// Every peer considered, in order.
        attempts: Vec<PeerAttempt>,
    },
}

impl PeerLookup {
    /// The tier a hit came from ([`Tier::Peer`]), `None` for a miss.
    pub fn tier(&self) -> Option<Tier> {
        matches!(self, PeerLookup::Hit { .. }).then_some(Tier::Peer)
    }
}

/// The peers of this node and how to ask them.
#[derive(Debug)]
pub struct PeerSet {
    cfg: PeerSetConfig,
    client: PeerClient,
    discovered: RwLock<Vec<PeerInfo>>,
    skip_until: Mutex<HashMap<String, Instant>>,
    /// Holdings digests by peer id.
    holdings: RwLock<HashMap<String, Held>>,
}

impl PeerSet {
    /// A peer set; validates the config.
    pub fn new(cfg: PeerSetConfig, client: PeerClient) -> Result<Self> {
        validate_node_id(&cfg.self_id)?;
        if cfg.fanout_max == 0 || cfg.fanout_max > FANOUT_LIMIT {
            return Err(Error::Config {
                key: "peer.fanout_max".into(),
                problem: format!("{} is outside 1..={FANOUT_LIMIT}", cfg.fanout_max),
            });
        }
        for p in &cfg.static_peers {
            PeerInfo::new(p.id.clone(), p.address.clone())?;
        }
        Ok(PeerSet {
            cfg,
            client,
            discovered: RwLock::new(Vec::new()),
            skip_until: Mutex::new(HashMap::new()),
            holdings: RwLock::new(HashMap::new()),
        })
    }

    /// The client (its counters include this set's skips).
    pub fn client(&self) -> &PeerClient {
        &self.client
    }

    /// Client counters, with the holdings gauges.
    pub fn metrics(&self) -> PeerMetricsSnapshot {
        let mut m = self.client.metrics().snapshot();
        let max_age = self.cfg.holdings_age_max();
        if let Ok(h) = self.holdings.read() {
            for held in h.values() {
                let age = held.fetched.elapsed();
                if age <= max_age {
                    m.holdings_peers += 1;
                    m.holdings_bytes += held.digest.encoded_bytes() as u64;
                    m.holdings_age_ms_max = m.holdings_age_ms_max.max(age.as_millis() as u64);
                }
            }
        }
        m
    }

    /// The settings.
    pub fn config(&self) -> &PeerSetConfig {
        &self.cfg
    }

    /// What `peer_id`'s digest says about `(ns, key)`: `None` when no
    /// usable digest is known (none fetched, or older than three refresh
    /// periods), else whether it lists the block. Memory only. Counted.
    pub fn digest_says(&self, peer_id: &str, ns: &NamespaceId, key: &BlockKey) -> Option<bool> {
        let held = self.holdings.read().ok()?.get(peer_id)?.clone();
        if held.fetched.elapsed() > self.cfg.holdings_age_max() {
            return None;
        }
        let yes = held.digest.may_hold(ns, key);
        let m = self.client.metrics();
        if yes {
            m.lookup_digest_held.fetch_add(1, Ordering::Relaxed);
        } else {
            m.lookup_digest_not_held.fetch_add(1, Ordering::Relaxed);
        }
        Some(yes)
    }

    /// Whether a usable digest of `peer_id` lists `(ns, key)` (uncounted).
    fn digest_lists(&self, peer_id: &str, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.holdings
            .read()
            .ok()
            .and_then(|h| h.get(peer_id).cloned())
            .is_some_and(|held| {
                held.fetched.elapsed() <= self.cfg.holdings_age_max()
                    && held.digest.may_hold(ns, key)
            })
    }

    /// Fetches every live peer's digest (at most 8 at once, each within
    /// `per_peer_timeout_ms`) and forgets the digests of peers that left.
    /// A failed fetch keeps the previous digest until it ages out.
    pub async fn refresh_holdings(&self) {
        use futures::StreamExt;
        let peers: Vec<PeerInfo> = self
            .live_peers()
            .into_iter()
            .take(HOLDINGS_PEERS_MAX)
            .collect();
        let per_peer = Duration::from_millis(self.cfg.per_peer_timeout_ms);
        let max = self.cfg.holdings_bytes_max;
        let got: Vec<(String, Option<HoldingsDigest>)> = futures::stream::iter(peers.clone())
            .map(|p| async move {
                let r = self
                    .client
                    .holdings(&p.address, max, Instant::now() + per_peer)
                    .await;
                (p.id, r.ok())
            })
            .buffer_unordered(8)
            .collect()
            .await;
        let m = self.client.metrics();
        if let Ok(mut h) = self.holdings.write() {
            h.retain(|id, _| peers.iter().any(|p| &p.id == id));
            for (id, d) in got {
                match d {
                    Some(d) => {
                        m.holdings_refreshed.fetch_add(1, Ordering::Relaxed);
                        h.insert(
                            id,
                            Held {
                                digest: std::sync::Arc::new(d),
                                fetched: Instant::now(),
                            },
                        );
                    }
                    None => {
                        m.holdings_failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// Counts a header probe sent by a lookup.
    pub fn count_probe(&self) {
        self.client
            .metrics()
            .lookup_probes
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Replaces the peers found through discovery.
    pub fn set_discovered(&self, peers: Vec<PeerInfo>) {
        if let Ok(mut d) = self.discovered.write() {
            *d = peers;
        }
    }

    /// Static and discovered peers, without this node, deduplicated by id
    /// (the static entry wins), sorted by id.
    pub fn live_peers(&self) -> Vec<PeerInfo> {
        let mut by_id: HashMap<String, PeerInfo> = HashMap::new();
        if let Ok(d) = self.discovered.read() {
            for p in d.iter() {
                by_id.insert(p.id.clone(), p.clone());
            }
        }
        for p in &self.cfg.static_peers {
            by_id.insert(p.id.clone(), p.clone());
        }
        by_id.remove(&self.cfg.self_id);
        let mut v: Vec<_> = by_id.into_values().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// The peers to ask for `(ns, key)`, most likely first (all live peers;
    /// a lookup asks the first `fanout_max`).
    pub fn order(&self, ns: &NamespaceId, key: &BlockKey) -> Vec<PeerInfo> {
        placement::rank(&self.live_peers(), ns, key)
    }

    fn skipped(&self, id: &str, now: Instant) -> bool {
        self.skip_until
            .lock()
            .map(|m| m.get(id).is_some_and(|&t| t > now))
            .unwrap_or(false)
    }

    fn mark(&self, id: &str, miss: PeerMiss) {
        let ms = match miss {
            PeerMiss::Absent => return,
            PeerMiss::Unavailable | PeerMiss::Timeout => self.cfg.down_backoff_ms,
            PeerMiss::Corrupt => self.cfg.corrupt_quarantine_ms,
        };
        if let Ok(mut m) = self.skip_until.lock() {
            m.insert(id.to_string(), Instant::now() + Duration::from_millis(ms));
        }
    }

    /// Forgets down/lying marks (e.g. after an operator fixed a node).
    pub fn clear_marks(&self) {
        if let Ok(mut m) = self.skip_until.lock() {
            m.clear();
        }
    }

    /// Asks the likely peers in order until one delivers a verified block or
    /// the deadline passes.
    pub async fn fetch(&self, ns: &NamespaceId, key: &BlockKey, deadline: Instant) -> PeerLookup {
        let mut attempts = Vec::new();
        for peer in self.order(ns, key).into_iter().take(self.cfg.fanout_max) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            if self.skipped(&peer.id, now) {
                self.client.metrics().count_skip();
                attempts.push(PeerAttempt {
                    peer_id: peer.id,
                    miss: None,
                });
                continue;
            }
            let peer_deadline =
                deadline.min(now + Duration::from_millis(self.cfg.per_peer_timeout_ms));
            match self
                .client
                .fetch(&peer.address, ns, key, peer_deadline)
                .await
            {
                PeerFetch::Hit(block) => {
                    return PeerLookup::Hit {
                        peer,
                        block: Box::new(block),
                        attempts,
                    }
                }
                PeerFetch::Miss(miss) => {
                    if miss == PeerMiss::Absent && self.digest_lists(&peer.id, ns, key) {
                        self.client
                            .metrics()
                            .holdings_false_positives
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    self.mark(&peer.id, miss);
                    attempts.push(PeerAttempt {
                        peer_id: peer.id,
                        miss: Some(miss),
                    });
                }
            }
        }
        PeerLookup::Miss { attempts }
    }
}
