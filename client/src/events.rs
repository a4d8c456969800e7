//! KV events: what a KV-aware router learns from the store.
//!
//! Shaped like NVIDIA Dynamo's `RouterEvent` / `KvCacheEvent`: an event id,
//! a `storage_tier` (`Disk` for this node's G3, `External` for the shared
//! object store) and `Stored { parent_hash, blocks: [...] }`,
//! `Removed { block_hashes }` or `Cleared`. Two JSON renderings:
//! [`KvEvent::to_json`], kvtier's own richer form (the `kvtier events`
//! default), and [`KvEvent::to_dynamo_json`], exactly what Dynamo 1.6.1's
//! `RouterEvent` deserializes (only for events of dynamo-mode namespaces).
//! On the socket an event travels as a binary frame
//! ([`crate::proto::OP_EVENT`]; docs/FORMAT.md).

use crate::block::DYNAMO_TOKENS_MAX;
use crate::error::Result;
use crate::key::BlockKey;
use crate::namespace::NamespaceId;
use crate::proto::{Reader, Writer, KEYS_MAX};
use serde_json::{json, Value};

/// Dynamo's storage tier names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StorageTier {
    /// This node's local disk (G3).
    Disk = 1,
    /// Shared storage every node can read (G4).
    External = 2,
}

impl StorageTier {
    /// kvtier's own form's spelling (Dynamo's variant names).
    pub fn name(self) -> &'static str {
        match self {
            StorageTier::Disk => "Disk",
            StorageTier::External => "External",
        }
    }

    /// Dynamo 1.6.1's serde spelling (`rename_all = "snake_case"`).
    pub fn dynamo_name(self) -> &'static str {
        match self {
            StorageTier::Disk => "disk",
            StorageTier::External => "external",
        }
    }
}

/// One stored block of a `Stored` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBlock {
    /// The block's sequence hash (its key).
    pub block_hash: BlockKey,
    /// Payload bytes.
    pub payload_len: u64,
    /// Dynamo's tokens_hash (LocalBlockHash), when the client sent it.
    pub tokens_hash: Option<u64>,
    /// The block's token ids, when the client sent them (empty otherwise).
    pub token_ids: Vec<u32>,
}

impl StoredBlock {
    /// A block known by key and length only.
    pub fn new(block_hash: BlockKey, payload_len: u64) -> Self {
        StoredBlock {
            block_hash,
            payload_len,
            tokens_hash: None,
            token_ids: Vec::new(),
        }
    }
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventData {
    /// Blocks became available, chained under `parent_hash`.
    Stored {
        /// The block before the first one, if known.
        parent_hash: Option<BlockKey>,
        /// The blocks, in chain order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks went away.
    Removed {
        /// Their keys.
        block_hashes: Vec<BlockKey>,
    },
    /// The subscriber fell behind and events were dropped: a router must
    /// resynchronise (e.g. with `list`).
    Lagged {
        /// How many were dropped.
        dropped: u64,
    },
    /// Forget everything this node announced in this tier (a start-up
    /// says so before announcing its holdings again).
    Cleared,
}

/// A KV event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// Monotonic per daemon run.
    pub event_id: u64,
    /// Namespace of the blocks.
    pub namespace: NamespaceId,
    /// Where they are stored.
    pub storage_tier: StorageTier,
    /// What happened.
    pub data: KvEventData,
    /// The node's Dynamo worker id, set by the daemon when the event
    /// belongs to a dynamo-mode namespace a Dynamo router can index (its
    /// blocks carry tokens_hash); `None` otherwise.
    pub dynamo_worker: Option<u64>,
}

impl KvEvent {
    /// Writes the binary form.
    pub fn encode(&self, w: &mut Writer) {
        w.u64(self.event_id);
        w.ns(&self.namespace);
        w.u8(self.storage_tier as u8);
        match &self.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                // Kind 1 is the original form; kind 4 adds each block's
                // routing facts (docs/FORMAT.md).
                let routed = blocks
                    .iter()
                    .any(|b| b.tokens_hash.is_some() || !b.token_ids.is_empty());
                w.u8(if routed { 4 } else { 1 });
                w.opt_key(parent_hash);
                w.count(blocks.len());
                for b in blocks {
                    w.key(&b.block_hash);
                    w.u64(b.payload_len);
                    if routed {
                        w.u8(b.tokens_hash.is_some() as u8);
                        w.u64(b.tokens_hash.unwrap_or(0));
                        let tokens = if b.token_ids.len() <= DYNAMO_TOKENS_MAX {
                            &b.token_ids[..]
                        } else {
                            &[]
                        };
                        w.count(tokens.len());
                        for t in tokens {
                            w.u32(*t);
                        }
                    }
                }
            }
            KvEventData::Removed { block_hashes } => {
                w.u8(2);
                w.count(block_hashes.len());
                for k in block_hashes {
                    w.key(k);
                }
            }
            KvEventData::Lagged { dropped } => {
                w.u8(3);
                w.u64(*dropped);
            }
            KvEventData::Cleared => w.u8(5),
        }
        // A trailing, optional field: frames without it still decode.
        if let Some(worker) = self.dynamo_worker {
            w.u8(1);
            w.u64(worker);
        }
    }

    /// Reads the binary form.
    pub fn decode(r: &mut Reader<'_>) -> Result<Self> {
        let event_id = r.u64()?;
        let namespace = r.ns()?;
        let storage_tier = match r.u8()? {
            1 => StorageTier::Disk,
            2 => StorageTier::External,
            t => {
                return Err(crate::Error::Protocol {
                    reason: format!("storage tier {t}"),
                })
            }
        };
        let data = match r.u8()? {
            kind @ (1 | 4) => {
                let parent_hash = r.opt_key()?;
                let n = r.count(KEYS_MAX, 10)?;
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    let mut b = StoredBlock::new(r.key()?, r.u64()?);
                    if kind == 4 {
                        let has = r.bool()?;
                        let tokens_hash = r.u64()?;
                        b.tokens_hash = has.then_some(tokens_hash);
                        let t = r.count(DYNAMO_TOKENS_MAX, 4)?;
                        b.token_ids = (0..t).map(|_| r.u32()).collect::<Result<_>>()?;
                    }
                    blocks.push(b);
                }
                KvEventData::Stored {
                    parent_hash,
                    blocks,
                }
            }
            2 => {
                let n = r.count(KEYS_MAX, 2)?;
                let mut block_hashes = Vec::with_capacity(n);
                for _ in 0..n {
                    block_hashes.push(r.key()?);
                }
                KvEventData::Removed { block_hashes }
            }
            3 => KvEventData::Lagged { dropped: r.u64()? },
            5 => KvEventData::Cleared,
            k => {
                return Err(crate::Error::Protocol {
                    reason: format!("event kind {k}"),
                })
            }
        };
        let dynamo_worker = if r.remaining() > 0 && r.bool()? {
            Some(r.u64()?)
        } else {
            None
        };
        Ok(KvEvent {
            event_id,
            namespace,
            storage_tier,
            data,
            dynamo_worker,
        })
    }

    /// Dynamo's `RouterEvent` shape as JSON. Keys are hex strings; an
    /// 8-byte (Dynamo-mode) key is also given as its u64 under `*_u64`, the
    /// form Dynamo's router indexes by.
    pub fn to_json(&self) -> Value {
        let hex = |k: &BlockKey| Value::String(k.to_hex());
        let data = match &self.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => json!({"stored": {
                "parent_hash": parent_hash.as_ref().map(hex),
                "parent_hash_u64": parent_hash.as_ref().and_then(|k| k.as_u64()),
                "blocks": blocks.iter().map(|b| json!({
                    "block_hash": hex(&b.block_hash),
                    "block_hash_u64": b.block_hash.as_u64(),
                    "payload_len": b.payload_len,
                    "tokens_hash": b.tokens_hash,
                })).collect::<Vec<_>>(),
            }}),
            KvEventData::Removed { block_hashes } => json!({"removed": {
                "block_hashes": block_hashes.iter().map(hex).collect::<Vec<_>>(),
                "block_hashes_u64": block_hashes.iter().map(|k| k.as_u64()).collect::<Vec<_>>(),
            }}),
            KvEventData::Lagged { dropped } => json!({"lagged": {"dropped": dropped}}),
            KvEventData::Cleared => json!("cleared"),
        };
        json!({
            "event_id": self.event_id,
            "namespace": self.namespace.to_hex(),
            "storage_tier": self.storage_tier.name(),
            "data": data,
            // A string: a 64-bit id loses digits as a JSON number above
            // 2^53 in most readers (jq, JavaScript).
            "dynamo_worker_id": self.dynamo_worker.map(|w| w.to_string()),
        })
    }

    /// Dynamo 1.6.1's `RouterEvent` exactly (`dynamo_kv_router::protocols`):
    /// `{"worker_id", "storage_tier": "disk"|"external", "event":
    /// {"event_id", "data": {"stored": {...}} | {"removed": {...}} |
    /// "cleared", "dp_rank"}}`, hashes as u64. `None` for events a Dynamo
    /// router cannot index: other namespaces (no worker id), a `Stored` block
    /// without tokens_hash, keys that are not Dynamo's 64-bit hashes, and
    /// `Lagged` (Dynamo has no such event: the consumer must resync).
    pub fn to_dynamo_json(&self) -> Option<Value> {
        let worker_id = self.dynamo_worker?;
        let data = match &self.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                let parent = match parent_hash {
                    Some(k) => Some(k.as_u64()?),
                    None => None,
                };
                let mut out = Vec::with_capacity(blocks.len());
                for b in blocks {
                    out.push(json!({
                        "block_hash": b.block_hash.as_u64()?,
                        "tokens_hash": b.tokens_hash?,
                        "mm_extra_info": null,
                    }));
                }
                json!({"stored": {
                    "parent_hash": parent,
                    "start_position": null,
                    "blocks": out,
                }})
            }
            KvEventData::Removed { block_hashes } => {
                let hashes = block_hashes
                    .iter()
                    .map(|k| k.as_u64())
                    .collect::<Option<Vec<_>>>()?;
                json!({"removed": {"block_hashes": hashes}})
            }
            KvEventData::Cleared => json!("cleared"),
            KvEventData::Lagged { .. } => return None,
        };
        Some(json!({
            "worker_id": worker_id,
            "storage_tier": self.storage_tier.dynamo_name(),
            "event": {
                "event_id": self.event_id,
                "data": data,
                "dp_rank": 0,
            },
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_round_trip_and_json_shape() {
        let e = KvEvent {
            event_id: 7,
            namespace: NamespaceId([1; 16]),
            storage_tier: StorageTier::Disk,
            data: KvEventData::Stored {
                parent_hash: Some(BlockKey::from_u64(5)),
                blocks: vec![StoredBlock::new(BlockKey::from_u64(6), 10)],
            },
            dynamo_worker: None,
        };
        let mut w = Writer::frame(crate::proto::OP_EVENT, 0);
        e.encode(&mut w);
        let f = w.finish();
        let mut r = Reader::new(&f[12..]);
        assert_eq!(KvEvent::decode(&mut r).unwrap(), e);
        let j = e.to_json();
        assert_eq!(j["storage_tier"], "Disk");
        assert_eq!(j["data"]["stored"]["blocks"][0]["block_hash_u64"], 6);
        assert_eq!(j["data"]["stored"]["parent_hash_u64"], 5);
        assert_eq!(e.to_dynamo_json(), None, "not a dynamo-mode event");
        assert!(j["dynamo_worker_id"].is_null());
        // A worker id above 2^53 must survive readers that parse numbers as
        // doubles (jq, JavaScript): kvtier's own form carries it as a string.
        let big = KvEvent {
            dynamo_worker: Some((1 << 53) + 1),
            ..e
        };
        assert_eq!(big.to_json()["dynamo_worker_id"], "9007199254740993");
    }

    fn round_trip(e: &KvEvent) -> KvEvent {
        let mut w = Writer::frame(crate::proto::OP_EVENT, 0);
        e.encode(&mut w);
        let f = w.finish();
        let mut r = Reader::new(&f[12..]);
        let d = KvEvent::decode(&mut r).unwrap();
        r.finish().unwrap();
        d
    }

    #[test]
    fn routed_and_cleared_events_round_trip_and_render_as_dynamo() {
        let mut b = StoredBlock::new(BlockKey::from_u64(6), 10);
        b.tokens_hash = Some(77);
        b.token_ids = vec![1, 2, 3, 4];
        let e = KvEvent {
            event_id: 9,
            namespace: NamespaceId([2; 16]),
            storage_tier: StorageTier::External,
            data: KvEventData::Stored {
                parent_hash: Some(BlockKey::from_u64(5)),
                blocks: vec![b],
            },
            dynamo_worker: Some(42),
        };
        assert_eq!(round_trip(&e), e);
        let d = e.to_dynamo_json().unwrap();
        assert_eq!(d["worker_id"], 42);
        assert_eq!(d["storage_tier"], "external");
        assert_eq!(d["event"]["event_id"], 9);
        assert_eq!(d["event"]["dp_rank"], 0);
        assert_eq!(d["event"]["data"]["stored"]["parent_hash"], 5);
        assert_eq!(d["event"]["data"]["stored"]["blocks"][0]["block_hash"], 6);
        assert_eq!(d["event"]["data"]["stored"]["blocks"][0]["tokens_hash"], 77);
        let c = KvEvent {
            data: KvEventData::Cleared,
            storage_tier: StorageTier::Disk,
            ..e.clone()
        };
        assert_eq!(round_trip(&c), c);
        assert_eq!(c.to_dynamo_json().unwrap()["event"]["data"], "cleared");
        // A block without tokens_hash cannot be indexed by Dynamo.
        let mut plain = e.clone();
        if let KvEventData::Stored { blocks, .. } = &mut plain.data {
            blocks[0].tokens_hash = None;
        }
        assert_eq!(plain.to_dynamo_json(), None);
        // 32-byte (blake3) keys are not Dynamo hashes.
        let r = KvEvent {
            data: KvEventData::Removed {
                block_hashes: vec![BlockKey::from_digest([1; 32])],
            },
            ..e
        };
        assert_eq!(r.to_dynamo_json(), None);
    }
}
