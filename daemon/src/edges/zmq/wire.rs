//! The KV event wire form of vLLM 0.33.0 (`vllm/distributed/kv_events.py`),
//! which vLLM's own `msgspec.msgpack.Decoder(KVEventBatch)` and NVIDIA
//! Dynamo 1.6.1's router (`dynamo_kv_router::zmq_wire`) both decode.
//!
//! A batch (`KVEventBatch`, `array_like`) is `[ts, [event, ...],
//! data_parallel_rank]`. Each event is a msgspec tagged struct that is not
//! `array_like` in 0.33.0: a map whose `type` key holds the tag, then the
//! fields by name (older vLLM sent positional arrays; 0.33.0's decoder
//! refuses them, Dynamo reads both):
//!
//! - `{type: "BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, lora_name[, extra_keys]}` (`lora_id` is
//!   vLLM's retired slot, always nil; the cache salt travels in the first
//!   block's `extra_keys` entry as `"dynamo-cache-salt:<salt>"`, after the
//!   LoRA name, which is where Dynamo's decoder looks for it; `extra_keys`
//!   is left out, as vLLM's encoder leaves out a default, when no salt);
//! - `{type: "BlockRemoved", block_hashes, medium}`;
//! - `{type: "AllBlocksCleared"}`.
//!
//! Where a block is ([`Media`], `[events.zmq] media`): by default as vLLM
//! 0.33.0's own storage tiers say it (`vllm/v1/kv_offload/base.py`
//! `Medium.STORAGE`, `Locality`; its `fs` tier sends LOCAL, its `obj` tier
//! REMOTE): `medium: "STORAGE"` with `locality: "LOCAL"` for G3 and
//! `"REMOTE"` for G4, the `locality` field after `extra_keys` (declaration
//! order) and no `ownership`. `media = "dynamo"` sends the older names
//! instead, `"DISK"` for G3 and `"EXTERNAL"` for G4 without a locality
//! (Dynamo's `StorageTier::to_kv_medium`): Dynamo 1.6.1 files STORAGE
//! under its Disk tier but drops every REMOTE event (no shared index yet),
//! so a Dynamo router that should count G4 needs that form. An empty
//! batch (no events) is the publisher's idle heartbeat.

use kvtier_client::events::StorageTier;

/// Dynamo's tag before a cache salt in `extra_keys`
/// (`zmq_wire::DYNAMO_CACHE_SALT_PREFIX`).
pub const CACHE_SALT_PREFIX: &str = "dynamo-cache-salt:";

/// One block of a `BlockStored`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireBlock {
    /// Dynamo's sequence hash (the kvtier key of a dynamo-mode block).
    pub hash: u64,
    /// The block's token ids.
    pub token_ids: Vec<u32>,
}

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireEvent {
    /// Blocks stored in chain order under `parent`.
    Stored {
        /// The block before the first one.
        parent: Option<u64>,
        /// Tokens per block.
        block_size: u32,
        /// The blocks (each with exactly `block_size` tokens).
        blocks: Vec<WireBlock>,
        /// Where.
        tier: StorageTier,
        /// Dynamo's LoRA name ("" none).
        lora_name: String,
        /// Dynamo's cache salt ("" none).
        salt: String,
    },
    /// Blocks gone from `tier`.
    Removed {
        /// Their sequence hashes.
        hashes: Vec<u64>,
        /// Where.
        tier: StorageTier,
    },
    /// Forget everything this worker announced.
    Cleared,
}

/// How a tier is named on the wire (`[events.zmq] media`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Media {
    /// vLLM 0.33.0's storage tiers: `STORAGE` with locality `LOCAL` (G3)
    /// or `REMOTE` (G4); what vLLM publishes and llm-d's router scores.
    #[default]
    Vllm,
    /// `DISK` (G3) and `EXTERNAL` (G4), no locality: Dynamo 1.6.1 indexes
    /// both (it drops REMOTE events).
    Dynamo,
}

impl Media {
    /// The config value's form.
    pub fn parse(s: &str) -> Option<Media> {
        match s {
            "vllm" => Some(Media::Vllm),
            "dynamo" => Some(Media::Dynamo),
            _ => None,
        }
    }
}

/// The `medium` and `locality` fields of a tier in `media`'s form.
pub fn medium(tier: StorageTier, media: Media) -> (&'static str, Option<&'static str>) {
    match (media, tier) {
        (Media::Vllm, StorageTier::Disk) => ("STORAGE", Some("LOCAL")),
        (Media::Vllm, StorageTier::External) => ("STORAGE", Some("REMOTE")),
        (Media::Dynamo, StorageTier::Disk) => ("DISK", None),
        (Media::Dynamo, StorageTier::External) => ("EXTERNAL", None),
    }
}

// rmp's writers into a Vec cannot fail; the Results only exist for other
// writers.
fn str(out: &mut Vec<u8>, s: &str) {
    let _ = rmp::encode::write_str(out, s);
}
fn arr(out: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_array_len(out, n as u32);
}
fn nil(out: &mut Vec<u8>) {
    let _ = rmp::encode::write_nil(out);
}
fn uint(out: &mut Vec<u8>, v: u64) {
    let _ = rmp::encode::write_uint(out, v);
}

/// A struct's map header as msgspec writes it: sized for every field the
/// struct declares (tag included), not for those written, so a struct of
/// more than 15 (vLLM 0.33.0's `BlockStored`: 16) always gets a map16.
fn map(out: &mut Vec<u8>, n: usize, declared: usize) {
    if declared > 15 {
        out.push(0xde);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        let _ = rmp::encode::write_map_len(out, n as u32);
    }
}

/// Fields of vLLM 0.33.0's `BlockStored`, its tag included.
const BLOCK_STORED_FIELDS: usize = 16;
fn opt_str(out: &mut Vec<u8>, s: &str) {
    if s.is_empty() {
        nil(out);
    } else {
        str(out, s);
    }
}

/// One event: a msgspec tagged struct as vLLM 0.33.0's encoder writes it
/// (`omit_defaults=True`, not `array_like`): a map whose first key is the
/// tag field `type`, then the declared fields in declaration order; the
/// required ones always (nil when unset), the defaulted ones only when set.
fn event(out: &mut Vec<u8>, ev: &WireEvent, media: Media) {
    match ev {
        WireEvent::Stored {
            parent,
            block_size,
            blocks,
            tier,
            lora_name,
            salt,
        } => {
            let (med, locality) = medium(*tier, media);
            let n = 8 + usize::from(!salt.is_empty()) + usize::from(locality.is_some());
            map(out, n, BLOCK_STORED_FIELDS);
            str(out, "type");
            str(out, "BlockStored");
            str(out, "block_hashes");
            arr(out, blocks.len());
            for b in blocks {
                uint(out, b.hash);
            }
            str(out, "parent_block_hash");
            match parent {
                Some(p) => uint(out, *p),
                None => nil(out),
            }
            str(out, "token_ids");
            arr(out, blocks.iter().map(|b| b.token_ids.len()).sum());
            for b in blocks {
                for t in &b.token_ids {
                    uint(out, u64::from(*t));
                }
            }
            str(out, "block_size");
            uint(out, u64::from(*block_size));
            str(out, "lora_id");
            nil(out); // vLLM's retired slot
            str(out, "medium");
            str(out, med);
            str(out, "lora_name");
            opt_str(out, lora_name);
            if !salt.is_empty() {
                // Aligned with blocks; only the first carries the salt.
                str(out, "extra_keys");
                arr(out, blocks.len());
                for i in 0..blocks.len() {
                    if i > 0 {
                        nil(out);
                        continue;
                    }
                    let lora = !lora_name.is_empty();
                    arr(out, 1 + usize::from(lora));
                    if lora {
                        str(out, lora_name);
                    }
                    str(out, &format!("{CACHE_SALT_PREFIX}{salt}"));
                }
            }
            // group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
            // keep their defaults (left out), then locality.
            if let Some(l) = locality {
                str(out, "locality");
                str(out, l);
            }
        }
        WireEvent::Removed { hashes, tier } => {
            let (med, locality) = medium(*tier, media);
            map(out, 3 + usize::from(locality.is_some()), 6);
            str(out, "type");
            str(out, "BlockRemoved");
            str(out, "block_hashes");
            arr(out, hashes.len());
            for h in hashes {
                uint(out, *h);
            }
            str(out, "medium");
            str(out, med);
            // group_idx keeps its default (left out), then locality.
            if let Some(l) = locality {
                str(out, "locality");
                str(out, l);
            }
        }
        WireEvent::Cleared => {
            map(out, 1, 1);
            str(out, "type");
            str(out, "AllBlocksCleared");
        }
    }
}

/// A `KVEventBatch`: `[ts, events, data_parallel_rank]`, tiers named in
/// `media`'s form.
pub fn batch(ts_s: f64, events: &[WireEvent], dp_rank: Option<u32>, media: Media) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    arr(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, ts_s);
    arr(&mut out, events.len());
    for e in events {
        event(&mut out, e, media);
    }
    match dp_rank {
        Some(r) => uint(&mut out, u64::from(r)),
        None => nil(&mut out),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes a msgpack reader sees (independent of the encoder above:
    /// decoded by rmp's own value reader).
    fn decode(b: &[u8]) -> rmpv::Value {
        rmpv::decode::read_value(&mut &b[..]).unwrap()
    }

    #[test]
    fn events_are_tagged_maps_in_a_positional_batch() {
        let ev = WireEvent::Stored {
            parent: Some(7),
            block_size: 2,
            blocks: vec![
                WireBlock {
                    hash: u64::MAX,
                    token_ids: vec![1, 2],
                },
                WireBlock {
                    hash: 9,
                    token_ids: vec![3, 4],
                },
            ],
            tier: StorageTier::Disk,
            lora_name: "ad".into(),
            salt: "s".into(),
        };
        let bytes = batch(1.5, &[ev.clone(), WireEvent::Cleared], Some(3), Media::Vllm);
        // [fixarray 3, f64 (9 bytes), fixarray 2, then BlockStored's header:
        // a map16 as msgspec writes it for a struct of 16 fields.
        assert_eq!(bytes[..3], [0x93, 0xcb, 0x3f]);
        assert_eq!(bytes[10..14], [0x92, 0xde, 0x00, 0x0a]);
        let v = decode(&bytes);
        assert_eq!(
            v.to_string(),
            r#"[1.5, [{"type": "BlockStored", "block_hashes": [18446744073709551615, 9], "parent_block_hash": 7, "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": nil, "medium": "STORAGE", "lora_name": "ad", "extra_keys": [["ad", "dynamo-cache-salt:s"], nil], "locality": "LOCAL"}, {"type": "AllBlocksCleared"}], 3]"#
        );
        // The older names for a Dynamo router: no locality.
        let bytes = batch(1.5, &[ev, WireEvent::Cleared], Some(3), Media::Dynamo);
        assert_eq!(bytes[10..14], [0x92, 0xde, 0x00, 0x09]);
        assert_eq!(
            decode(&bytes).to_string(),
            r#"[1.5, [{"type": "BlockStored", "block_hashes": [18446744073709551615, 9], "parent_block_hash": 7, "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": nil, "medium": "DISK", "lora_name": "ad", "extra_keys": [["ad", "dynamo-cache-salt:s"], nil]}, {"type": "AllBlocksCleared"}], 3]"#
        );
        let removed = WireEvent::Removed {
            hashes: vec![5],
            tier: StorageTier::External,
        };
        assert_eq!(
            decode(&batch(
                2.5,
                std::slice::from_ref(&removed),
                None,
                Media::Vllm
            ))
            .to_string(),
            r#"[2.5, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "STORAGE", "locality": "REMOTE"}], nil]"#
        );
        assert_eq!(
            decode(&batch(2.5, &[removed], None, Media::Dynamo)).to_string(),
            r#"[2.5, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "EXTERNAL"}], nil]"#
        );
        let plain = WireEvent::Stored {
            parent: None,
            block_size: 1,
            blocks: vec![WireBlock {
                hash: 4,
                token_ids: vec![8],
            }],
            tier: StorageTier::External,
            lora_name: String::new(),
            salt: String::new(),
        };
        assert_eq!(
            decode(&batch(3.5, &[plain], Some(0), Media::Vllm)).to_string(),
            r#"[3.5, [{"type": "BlockStored", "block_hashes": [4], "parent_block_hash": nil, "token_ids": [8], "block_size": 1, "lora_id": nil, "medium": "STORAGE", "lora_name": nil, "locality": "REMOTE"}], 0]"#
        );
    }
}
