//! KV events: what a KV-aware router learns from the store.
//!
//! Shaped like NVIDIA Dynamo's `RouterEvent` / `KvCacheEvent`: an event id,
//! a `storage_tier` (`Disk` for this node's G3, `External` for the shared
//! object store) and either `Stored { parent_hash, blocks: [...] }` or
//! `Removed { block_hashes }`. [`KvEvent::to_json`] renders that shape as one
//! JSON object (the `kvtier events` line format); on the socket the same
//! event travels as a binary frame ([`crate::proto::OP_EVENT`]).

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
    /// Dynamo's spelling.
    pub fn name(self) -> &'static str {
        match self {
            StorageTier::Disk => "Disk",
            StorageTier::External => "External",
        }
    }
}

/// One stored block of a `Stored` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBlock {
    /// The block's sequence hash (its key).
    pub block_hash: BlockKey,
    /// Payload bytes.
    pub payload_len: u64,
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
                w.u8(1);
                w.opt_key(parent_hash);
                w.count(blocks.len());
                for b in blocks {
                    w.key(&b.block_hash);
                    w.u64(b.payload_len);
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
            1 => {
                let parent_hash = r.opt_key()?;
                let n = r.count(KEYS_MAX, 10)?;
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    blocks.push(StoredBlock {
                        block_hash: r.key()?,
                        payload_len: r.u64()?,
                    });
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
            k => {
                return Err(crate::Error::Protocol {
                    reason: format!("event kind {k}"),
                })
            }
        };
        Ok(KvEvent {
            event_id,
            namespace,
            storage_tier,
            data,
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
                })).collect::<Vec<_>>(),
            }}),
            KvEventData::Removed { block_hashes } => json!({"removed": {
                "block_hashes": block_hashes.iter().map(hex).collect::<Vec<_>>(),
                "block_hashes_u64": block_hashes.iter().map(|k| k.as_u64()).collect::<Vec<_>>(),
            }}),
            KvEventData::Lagged { dropped } => json!({"lagged": {"dropped": dropped}}),
        };
        json!({
            "event_id": self.event_id,
            "namespace": self.namespace.to_hex(),
            "storage_tier": self.storage_tier.name(),
            "data": data,
        })
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
                blocks: vec![StoredBlock {
                    block_hash: BlockKey::from_u64(6),
                    payload_len: 10,
                }],
            },
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
    }
}
