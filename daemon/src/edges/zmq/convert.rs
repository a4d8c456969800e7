//! kvtier events -> vLLM wire events, for the namespaces configured.
//!
//! A Dynamo router recomputes each block's tokens_hash from the token ids,
//! the LoRA name and the cache salt of the event, so a block can only be
//! published with its token ids, and only when the salt and LoRA name
//! configured for its namespace give the tokens_hash the client computed
//! with Dynamo's crate: a wrong salt in the config would otherwise teach
//! the router hashes no request ever matches. Such blocks are counted and
//! left out, never published wrong.

use super::wire::{WireBlock, WireEvent};
use super::ZmqStats;
use crate::warn_limited;
use kvtier_client::events::{KvEvent, KvEventData, StorageTier, StoredBlock};
use kvtier_client::{BlockHeader, NamespaceId};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

static MISMATCH_LOG: crate::base::log_limit::LogLimit =
    crate::base::log_limit::LogLimit::new(10_000);

/// What the router needs to know of a published namespace.
#[derive(Debug, Clone)]
pub struct PublishedNs {
    /// Dynamo's cache salt ("" none).
    pub salt: String,
    /// Dynamo's LoRA name ("" none).
    pub lora_name: String,
}

/// The namespaces a publisher covers.
#[derive(Debug, Clone, Default)]
pub struct Published {
    ns: HashMap<NamespaceId, PublishedNs>,
}

impl Published {
    /// Covers `ns` with its Dynamo salt and LoRA name.
    pub fn insert(&mut self, ns: NamespaceId, p: PublishedNs) {
        self.ns.insert(ns, p);
    }

    /// The namespaces covered.
    pub fn ids(&self) -> impl Iterator<Item = &NamespaceId> {
        self.ns.keys()
    }

    /// `ev` in the wire form, or `None` when it is not for this stream.
    pub fn convert(&self, ev: &KvEvent, stats: &ZmqStats) -> Option<WireEvent> {
        let p = self.ns.get(&ev.namespace)?;
        match &ev.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                let parent = match parent_hash {
                    Some(k) => Some(k.as_u64()?),
                    None => None,
                };
                self.stored(p, &ev.namespace, parent, blocks, ev.storage_tier, stats)
            }
            KvEventData::Removed { block_hashes } => {
                let hashes: Vec<u64> = block_hashes.iter().filter_map(|k| k.as_u64()).collect();
                (!hashes.is_empty()).then_some(WireEvent::Removed {
                    hashes,
                    tier: ev.storage_tier,
                })
            }
            // A kvtier `Cleared` is per namespace and tier; vLLM's
            // AllBlocksCleared forgets the whole worker. The publisher
            // sends its own (with the holdings after it) instead.
            KvEventData::Cleared | KvEventData::Lagged { .. } => None,
        }
    }

    fn stored(
        &self,
        p: &PublishedNs,
        ns: &NamespaceId,
        parent: Option<u64>,
        blocks: &[StoredBlock],
        tier: StorageTier,
        stats: &ZmqStats,
    ) -> Option<WireEvent> {
        let block_size = blocks.first()?.token_ids.len();
        let mut wire = Vec::with_capacity(blocks.len());
        for b in blocks {
            let (Some(hash), Some(tokens_hash)) = (b.block_hash.as_u64(), b.tokens_hash) else {
                stats.skipped_blocks.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            if b.token_ids.is_empty() || b.token_ids.len() != block_size {
                stats.skipped_blocks.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            let ok = kvtier_client::key::dynamo_blocks(
                &p.salt,
                &p.lora_name,
                block_size as u32,
                &b.token_ids,
            )
            .ok()
            .and_then(|v| v.first().map(|d| d.tokens_hash))
                == Some(tokens_hash);
            if !ok {
                stats.mismatched_blocks.fetch_add(1, Ordering::Relaxed);
                warn_limited!(
                    MISMATCH_LOG,
                    namespace = %ns,
                    "events.zmq: a block's tokens_hash does not match the salt and lora_name configured for its namespace; not published (check [[events.zmq.namespaces]])"
                );
                return None;
            }
            wire.push(WireBlock {
                hash,
                token_ids: b.token_ids.clone(),
            });
        }
        Some(WireEvent::Stored {
            parent,
            block_size: block_size as u32,
            blocks: wire,
            tier,
            lora_name: p.lora_name.clone(),
            salt: p.salt.clone(),
        })
    }

    /// The announcement of `headers` (a namespace's holdings in `tier`)
    /// as stores, parents before children (a router drops a block whose
    /// parent it does not know).
    pub fn holdings(
        &self,
        ns: &NamespaceId,
        headers: Vec<BlockHeader>,
        tier: StorageTier,
        stats: &ZmqStats,
    ) -> Vec<WireEvent> {
        let by_key: HashMap<u64, &BlockHeader> = headers
            .iter()
            .filter_map(|h| Some((h.key.as_u64()?, h)))
            .collect();
        let mut done: HashSet<u64> = HashSet::with_capacity(by_key.len());
        let mut out = Vec::with_capacity(by_key.len());
        for h in &headers {
            let Some(k) = h.key.as_u64() else { continue };
            // Walk up to the oldest ancestor not yet announced, then
            // announce down.
            // A chain whose oldest block names a parent not held here is
            // left out: the router would refuse it (and a sweeper racing
            // this scan makes such holes in G4).
            let mut chain = vec![k];
            let mut cur = h;
            let mut rooted = true;
            while let Some(parent) = cur.dynamo.as_ref().and_then(|d| d.parent) {
                if done.contains(&parent) || chain.contains(&parent) {
                    break;
                }
                match by_key.get(&parent) {
                    Some(ph) => {
                        chain.push(parent);
                        cur = ph;
                    }
                    None => {
                        rooted = false;
                        break;
                    }
                }
            }
            if !rooted {
                stats
                    .orphans
                    .fetch_add(chain.len() as u64, Ordering::Relaxed);
                continue;
            }
            for key in chain.into_iter().rev() {
                if !done.insert(key) {
                    continue;
                }
                let Some(hd) = by_key.get(&key) else { continue };
                let ev = KvEvent {
                    event_id: 0,
                    namespace: *ns,
                    storage_tier: tier,
                    data: KvEventData::Stored {
                        parent_hash: hd
                            .dynamo
                            .as_ref()
                            .and_then(|d| d.parent)
                            .map(kvtier_client::BlockKey::from_u64),
                        blocks: vec![crate::base::events::stored_block(hd)],
                    },
                    dynamo_worker: None,
                };
                if let Some(w) = self.convert(&ev, stats) {
                    out.push(w);
                }
            }
        }
        out
    }
}
