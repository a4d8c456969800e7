//! The onboard fall-through: a block missing on G3 is fetched from a peer,
//! else from G4, verified by the fetcher (peer client / G4 fetch), and
//! promoted into G3 before it is served. Only G3 serves bytes.
//!
//! Concurrency: G4 fetches are single-flight inside G4; two promotions of
//! the same block race harmlessly (`put_block` is create-once, the second
//! is `AlreadyPresent`).

use super::Node;
use crate::error::Result;
use crate::g3::PutMeta;
use crate::peer::PeerLookup;
use crate::tier::{Block, Lookup, MissReason, PutOutcome};
use kvtier_client::{BlockKey, Hints, NamespaceId, Tier};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Node {
    /// Makes sure the block is on G3: `Hit(tier it came from)` after a
    /// promotion, `Hit(G3)` when it was there, a miss when no tier
    /// delivered a verified copy within the fetch deadline.
    pub(super) fn ensure_local(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<Tier>> {
        if self.g3.lookup_prefix(ns, std::slice::from_ref(key)) == 1 {
            return Ok(Lookup::Hit(Tier::G3));
        }
        if self.peers.is_none() && self.g4.is_none() {
            return Ok(Lookup::Miss(MissReason::Absent));
        }
        let deadline = Instant::now() + self.fetch_deadline;
        let mut reason = MissReason::Absent;
        if let Some(set) = &self.peers {
            let (set, ns2, key2) = (set.clone(), *ns, *key);
            let t = Instant::now();
            let got = self.run_async(async move { set.fetch(&ns2, &key2, deadline).await });
            match got {
                Some(PeerLookup::Hit { block, peer, .. }) => {
                    let fetch_us = t.elapsed().as_micros() as u64;
                    tracing::debug!(%ns, %key, peer = %peer.id, "onboard: fetched from a peer");
                    return self.promote(ns, Arc::new(*block), Tier::Peer, fetch_us);
                }
                Some(PeerLookup::Miss { attempts }) => {
                    if attempts
                        .iter()
                        .any(|a| a.miss.is_some_and(|m| m != crate::peer::PeerMiss::Absent))
                    {
                        reason = MissReason::Unavailable;
                    }
                }
                None => reason = MissReason::Unavailable,
            }
        }
        // A fresh "absent" from G4's existence cache saves a GET per miss.
        if let Some(g4) = self
            .g4
            .as_ref()
            .filter(|g| g.contains_cached(ns, key) != Some(false))
        {
            let left = deadline.saturating_duration_since(Instant::now());
            let t = Instant::now();
            match g4.fetch(ns, key, left) {
                Lookup::Hit(block) => {
                    let fetch_us = t.elapsed().as_micros() as u64;
                    let r = self.promote(ns, Arc::new(block), Tier::G4, fetch_us)?;
                    // It came from G4: never upload it again.
                    self.g3.mark_in_g4(ns, key);
                    return Ok(r);
                }
                Lookup::Miss(MissReason::Absent) => {}
                Lookup::Miss(r) => reason = r,
            }
        }
        Ok(Lookup::Miss(reason))
    }

    /// Stores a verified block fetched from `from` into G3 and publishes the
    /// Stored event.
    fn promote(
        &self,
        ns: &NamespaceId,
        block: Arc<Block>,
        from: Tier,
        fetch_us: u64,
    ) -> Result<Lookup<Tier>> {
        let t = Instant::now();
        let meta = PutMeta {
            parent: None,
            hints: Hints::default(),
        };
        let outcome = self.g3.put_block(ns, &block.header, &block.payload, meta)?;
        let store_us = t.elapsed().as_micros() as u64;
        let c = match from {
            Tier::Peer => &self.from_peer,
            _ => &self.from_g4,
        };
        c.count.fetch_add(1, Ordering::Relaxed);
        c.fetch_us.fetch_add(fetch_us, Ordering::Relaxed);
        c.store_us.fetch_add(store_us, Ordering::Relaxed);
        if outcome == PutOutcome::Stored {
            super::events::g3_stored(
                &self.events,
                ns,
                &block.header.key,
                None,
                block.header.payload_len,
            );
        }
        self.remember_promoted(ns, block, from);
        Ok(Lookup::Hit(from))
    }
}
