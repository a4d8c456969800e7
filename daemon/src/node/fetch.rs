//! The onboard fall-through: a block missing on G3 is fetched from a peer,
//! else from G4, verified by the fetcher (peer client / G4 fetch), served,
//! and promoted into G3 (see `promote`: in the background for reads, at
//! once for callers that need the G3 file).
//!
//! A batched onboard ([`Node::prepare`]) fetches the missing blocks of one
//! request concurrently (`FETCH_PARALLEL_PER_REQUEST`, and at most
//! `FETCH_PARALLEL_MAX` on the node), each with its own fall-through and
//! verification: a block a peer corrupts is a miss for that block only,
//! which then tries G4 like any other.
//!
//! Concurrency: G4 fetches are single-flight inside G4; two promotions of
//! the same block race harmlessly (`put_block` is create-once, the second
//! is `AlreadyPresent`).

use super::promote::{Activity, Staged};
use super::Node;
use crate::base::error::Result;
use crate::base::tier::{Block, Lookup, MissReason};
use crate::tiers::g4::G4Store;
use crate::tiers::peer::{PeerLookup, PeerSet};
use kvtier_client::{BlockKey, NamespaceId, Tier};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;

/// Blocks of one onboard request fetched at once.
pub(super) const FETCH_PARALLEL_PER_REQUEST: usize = 4;
/// Remote fetches in flight on this node at most (below a peer server's
/// default `transfers_max` of 16, so one node alone never gets a 503).
pub(super) const FETCH_PARALLEL_MAX: usize = 8;

/// Where a block the node can serve is.
pub(super) enum Local {
    /// On G3.
    OnG3,
    /// Verified in memory (staged for promotion, or just fetched).
    Staged {
        block: Arc<Block>,
        /// The tier that delivered it.
        from: Tier,
        /// The tier to report to this reader.
        report: Tier,
    },
}

/// One remote fetch's outcome.
pub(super) enum Fetched {
    Hit {
        block: Arc<Block>,
        from: Tier,
        fetch_us: u64,
    },
    Miss(MissReason),
}

/// Peers in rendezvous order, then G4, within `deadline`; the bytes are
/// verified by the peer client and by G4's fetch.
pub(super) async fn fetch_remote(
    peers: Option<Arc<PeerSet>>,
    g4: Option<Arc<G4Store>>,
    permits: Arc<Semaphore>,
    activity: Arc<Activity>,
    ns: NamespaceId,
    key: BlockKey,
    deadline: Instant,
) -> Fetched {
    // Background promotions yield while this runs.
    let _busy = activity.fetching();
    // Closed only if the node is going away; then fetch anyway, bounded by
    // the deadline.
    let _permit = permits.acquire_owned().await.ok();
    let mut reason = MissReason::Absent;
    if let Some(set) = &peers {
        let t = Instant::now();
        match set.fetch(&ns, &key, deadline).await {
            PeerLookup::Hit { block, peer, .. } => {
                tracing::debug!(%ns, %key, peer = %peer.id, "onboard: fetched from a peer");
                return Fetched::Hit {
                    block: Arc::new(*block),
                    from: Tier::Peer,
                    fetch_us: t.elapsed().as_micros() as u64,
                };
            }
            PeerLookup::Miss { attempts } => {
                // A peer that did not answer in time says Timeout (a hung
                // or slow peer, as for G4); one that could not be asked or
                // broke off, Unavailable; G4's answer below overrides both.
                use crate::tiers::peer::PeerMiss;
                let misses = || attempts.iter().filter_map(|a| a.miss);
                if misses().any(|m| m == PeerMiss::Timeout) {
                    reason = MissReason::Timeout;
                } else if misses().any(|m| m != PeerMiss::Absent) {
                    reason = MissReason::Unavailable;
                }
            }
        }
    }
    // A fresh "absent" from G4's existence cache saves a GET per miss.
    if let Some(g4) = g4.filter(|g| g.contains_cached(&ns, &key) != Some(false)) {
        let left = deadline.saturating_duration_since(Instant::now());
        let t = Instant::now();
        match g4.fetch_async(&ns, &key, left).await {
            Lookup::Hit(block) => {
                return Fetched::Hit {
                    block: Arc::new(block),
                    from: Tier::G4,
                    fetch_us: t.elapsed().as_micros() as u64,
                }
            }
            Lookup::Miss(MissReason::Absent) => {}
            Lookup::Miss(r) => reason = r,
        }
    }
    Fetched::Miss(reason)
}

impl Node {
    pub(super) fn remote(&self) -> bool {
        self.peers.is_some() || self.g4.is_some()
    }

    pub(super) fn on_g3(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.g3.lookup_prefix(ns, std::slice::from_ref(key)) == 1
    }

    /// Makes sure the node can serve the block: on G3, staged, or fetched
    /// now (verified). A fetched block is staged for a background
    /// promotion when `defer`. A miss when no tier delivered a verified
    /// copy within the fetch deadline.
    pub(super) fn ensure_available(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        defer: bool,
    ) -> Result<Lookup<Local>> {
        // Staging first: a batch's block promoted before its read is on G3
        // and staged, and its read must still report where it came from.
        if let Some((block, from, report)) = self.staging.get(ns, key) {
            return Ok(Lookup::Hit(Local::Staged {
                block,
                from,
                report,
            }));
        }
        if self.on_g3(ns, key) {
            return Ok(Lookup::Hit(Local::OnG3));
        }
        self.fetch_now(ns, key, defer)
    }

    /// Fetches the block from the peers or G4 now (verified), whatever G3
    /// says: also the fall-back when G3 holds the block but cannot read it.
    /// Staged for a background promotion when `defer`.
    pub(super) fn fetch_now(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        defer: bool,
    ) -> Result<Lookup<Local>> {
        if !self.remote() {
            return Ok(Lookup::Miss(MissReason::Absent));
        }
        let deadline = Instant::now() + self.fetch_deadline;
        let fut = fetch_remote(
            self.peers.clone(),
            self.g4.clone(),
            self.fetch_permits.clone(),
            self.activity.clone(),
            *ns,
            *key,
            deadline,
        );
        match self.run_async(fut) {
            Some(Fetched::Hit {
                block,
                from,
                fetch_us,
            }) => {
                self.staging.count_fetch(from, fetch_us);
                if defer {
                    self.staging.stage(ns, block.clone(), from, false, true);
                }
                Ok(Lookup::Hit(Local::Staged {
                    block,
                    from,
                    report: from,
                }))
            }
            Some(Fetched::Miss(r)) => Ok(Lookup::Miss(r)),
            None => Ok(Lookup::Miss(MissReason::Unavailable)),
        }
    }

    /// Makes sure the block is on G3 (for leases, pins, direct reads and
    /// the mount, which need the file): `Hit(tier it came from)` after a
    /// promotion, `Hit(G3)` when it was there, a miss when no tier
    /// delivered a verified copy within the fetch deadline.
    pub(super) fn ensure_local(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<Tier>> {
        match self.ensure_available(ns, key, false)? {
            Lookup::Miss(r) => Ok(Lookup::Miss(r)),
            Lookup::Hit(Local::OnG3) => Ok(Lookup::Hit(Tier::G3)),
            Lookup::Hit(Local::Staged {
                block,
                from,
                report,
            }) => {
                self.staging.write_now(ns, &block, from)?;
                self.remember_promoted(ns, block, report);
                Ok(Lookup::Hit(report))
            }
        }
    }

    /// The batched onboard's first step: fetches the blocks of `keys` that
    /// are neither on G3 nor staged, concurrently, and stages the verified
    /// ones for the reads that follow. Per key, `Some(reason)` when it is
    /// known missing now (the read would miss the same way).
    pub(super) fn prepare(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Vec<Option<MissReason>> {
        let mut out = vec![None; keys.len()];
        if keys.len() < 2 || !self.remote() {
            return out;
        }
        let mut seen = HashSet::new();
        let todo: Vec<(usize, BlockKey)> = keys
            .iter()
            .enumerate()
            .filter(|(_, k)| {
                seen.insert(**k) && !self.on_g3(ns, k) && !self.staging.contains(ns, k)
            })
            .map(|(i, k)| (i, *k))
            .collect();
        if todo.len() < 2 {
            // One block gains nothing from concurrency: the read fetches it.
            return out;
        }
        let deadline = Instant::now() + self.fetch_deadline;
        let (peers, g4, permits, activity, ns2) = (
            self.peers.clone(),
            self.g4.clone(),
            self.fetch_permits.clone(),
            self.activity.clone(),
            *ns,
        );
        let got = self.run_async(async move {
            use futures::StreamExt;
            // Results in request order; at most FETCH_PARALLEL_PER_REQUEST
            // in flight for this request.
            futures::stream::iter(todo)
                .map(move |(i, k)| {
                    let f = fetch_remote(
                        peers.clone(),
                        g4.clone(),
                        permits.clone(),
                        activity.clone(),
                        ns2,
                        k,
                        deadline,
                    );
                    async move { (i, f.await) }
                })
                .buffered(FETCH_PARALLEL_PER_REQUEST)
                .collect::<Vec<_>>()
                .await
        });
        for (i, f) in got.unwrap_or_default() {
            match f {
                Fetched::Hit {
                    block,
                    from,
                    fetch_us,
                } => {
                    self.staging.count_fetch(from, fetch_us);
                    // Dropped (no room): the read fetches it again.
                    let _: Staged = self.staging.stage(ns, block, from, true, false);
                }
                Fetched::Miss(r) => out[i] = Some(r),
            }
        }
        out
    }
}
