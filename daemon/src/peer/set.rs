//! [`PeerSet`]: the live peers (static list plus discovered ones) and the
//! lookup that asks them in rendezvous order within the caller's deadline.
//!
//! Each peer gets at most `per_peer_timeout_ms` of the deadline, so one slow
//! peer cannot eat the whole budget. A peer that was unreachable is skipped
//! for `down_backoff_ms`; one that sent bytes failing verification is
//! skipped for `corrupt_quarantine_ms`. Skips are counted.

use super::client::{PeerClient, PeerFetch, PeerMetricsSnapshot, PeerMiss};
use super::{placement, validate_node_id, PeerInfo};
use crate::error::{Error, Result};
use crate::tier::Block;
use kvtier_client::{BlockKey, NamespaceId, Tier};
use std::collections::HashMap;
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
        }
    }
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
        })
    }

    /// The client (its counters include this set's skips).
    pub fn client(&self) -> &PeerClient {
        &self.client
    }

    /// Client counters.
    pub fn metrics(&self) -> PeerMetricsSnapshot {
        self.client.metrics().snapshot()
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
