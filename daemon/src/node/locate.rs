//! Lookup across tiers: the local prefix from the G3 index (memory only),
//! then, for the blocks after it and within `lookup_remote_deadline`, a
//! peer that holds the block (reported `Peer`), else G4 (reported `G4`).
//! The walk stops at the first block found nowhere: a prefix is only as
//! long as its first gap.
//!
//! How a peer is known to hold a block, cheaply: first its holdings
//! digest (a Bloom filter fetched every `peer.holdings_refresh_ms`, see
//! `peer::holdings`): a digest that lists the block answers "Peer" with no
//! request at all. Peers without a usable digest, and (with
//! `holdings_probe_negatives`, the default) peers whose digest does not
//! list it, get a ranged GET of the 4096 header bytes
//! (`PeerClient::probe`), sent at once to the first `fanout_max` peers in
//! rendezvous order; any that answers with a header naming this namespace
//! and key wins. Since the walk stops at the first gap, probes go only to
//! blocks around it. No payload moves at lookup time. G4 is asked through its existence cache first, then one HEAD.
//! Both answers are hints: the onboard verifies what it fetches. Up to 16
//! blocks are asked about at once; answers are taken in chain order.
//!
//! The first gap says why it is one: `Absent` when every place asked
//! answered, `Unavailable` when G4 could not (down, breaker open, or past
//! the deadline), so misses during an outage are not counted as absent.

use super::Node;
use crate::base::error::Result;
use crate::base::tier::MissReason;
use kvtier_client::{BlockKey, NamespaceId, Tier};
use std::time::Instant;

/// Blocks asked about at once past the local prefix (each asks up to
/// `fanout_max` peers and G4).
const LOOKUP_PARALLEL: usize = 16;

impl Node {
    pub(super) fn locate(
        &self,
        ns: &NamespaceId,
        chain: &[BlockKey],
    ) -> Result<(Vec<Tier>, MissReason)> {
        // Staged blocks (fetched, promotion pending) are local too.
        let mut n = self.g3.lookup_prefix(ns, chain);
        while n < chain.len() && self.staging.contains(ns, &chain[n]) {
            n += 1;
            n += self.g3.lookup_prefix(ns, &chain[n..]);
        }
        let mut tiers = vec![Tier::G3; n];
        if n == chain.len() || (self.peers.is_none() && self.g4.is_none()) {
            return Ok((tiers, MissReason::Absent));
        }
        let rest: Vec<BlockKey> = chain[n..].to_vec();
        let deadline = Instant::now() + self.lookup_remote_deadline;
        let peers = self.peers.clone();
        let g4 = self.g4.clone();
        let fanout = self.peer_fanout;
        let (ns2, g3) = (*ns, self.g3.clone());
        let found = self.run_async(async move {
            use futures::StreamExt;
            // Where one block is, or why it was not found.
            let where_is = |key: BlockKey| {
                let (peers, g4, g3) = (peers.clone(), g4.clone(), g3.clone());
                async move {
                    if Instant::now() >= deadline {
                        return Err(MissReason::Unavailable);
                    }
                    // A block promoted meanwhile (another client onboarded it).
                    if g3.lookup_prefix(&ns2, std::slice::from_ref(&key)) == 1 {
                        return Ok(Tier::G3);
                    }
                    if let Some(set) = &peers {
                        let order: Vec<_> =
                            set.order(&ns2, &key).into_iter().take(fanout).collect();
                        // A digest that lists the block answers at once;
                        // peers without a usable digest are probed, and so
                        // are negatives when configured (a block stored
                        // since the digest is still found).
                        let mut ask = Vec::new();
                        for p in &order {
                            match set.digest_says(&p.id, &ns2, &key) {
                                Some(true) => return Ok(Tier::Peer),
                                Some(false) if !set.config().holdings_probe_negatives => {}
                                _ => ask.push(p.address.clone()),
                            }
                        }
                        let probes = ask.into_iter().map(|addr| {
                            let set = set.clone();
                            async move {
                                set.count_probe();
                                set.client().probe(&addr, &ns2, &key, deadline).await
                            }
                        });
                        if futures::future::join_all(probes)
                            .await
                            .into_iter()
                            .any(|a| a)
                        {
                            return Ok(Tier::Peer);
                        }
                    }
                    let g4 = g4.as_ref().ok_or(MissReason::Absent)?;
                    let present = match g4.contains_cached(&ns2, &key) {
                        Some(p) => p,
                        // A store that errs or answers too late could hold
                        // the block: unavailable, not absent.
                        None => tokio::time::timeout_at(
                            tokio::time::Instant::from_std(deadline),
                            g4.contains_async(&ns2, &key),
                        )
                        .await
                        .ok()
                        .and_then(|r| r.ok())
                        .ok_or(MissReason::Unavailable)?,
                    };
                    present.then_some(Tier::G4).ok_or(MissReason::Absent)
                }
            };
            // Several blocks asked at once, answers taken in chain order; the
            // first gap ends the prefix (and drops the questions after it).
            let mut answers = futures::stream::iter(rest)
                .map(where_is)
                .buffered(LOOKUP_PARALLEL);
            let mut out = Vec::new();
            let mut why = MissReason::Absent;
            while let Some(answer) = answers.next().await {
                match answer {
                    Ok(t) => out.push(t),
                    Err(reason) => {
                        why = reason;
                        break;
                    }
                }
            }
            (out, why)
        });
        let (found, why) = found.unwrap_or((Vec::new(), MissReason::Unavailable));
        tiers.extend(found);
        Ok((tiers, why))
    }
}
