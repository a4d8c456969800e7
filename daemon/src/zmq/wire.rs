//! vLLM's KV event wire form, as NVIDIA Dynamo's router decodes it
//! (`dynamo_kv_router::zmq_wire`, 1.6.1).
//!
//! vLLM's publisher sends msgspec structs with `array_like=True, tag=True`:
//! a batch is `[ts, [event, ...], data_parallel_rank]` and each event a
//! positional array whose first element is its tag. kvtier writes exactly
//! that shape:
//!
//! - `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, lora_name, extra_keys]` (`lora_id` is
//!   vLLM's old slot, always nil; the cache salt travels in the first
//!   block's `extra_keys` as `"dynamo-cache-salt:<salt>"`, after the LoRA
//!   name, which is where Dynamo's decoder looks for it);
//! - `["BlockRemoved", block_hashes, medium]`;
//! - `["AllBlocksCleared"]`.
//!
//! `medium` is `"DISK"` for G3 and `"EXTERNAL"` for G4 (Dynamo's
//! `StorageTier::to_kv_medium`).

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

/// vLLM's medium name of a tier.
pub fn medium(tier: StorageTier) -> &'static str {
    match tier {
        StorageTier::Disk => "DISK",
        StorageTier::External => "EXTERNAL",
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

fn event(out: &mut Vec<u8>, ev: &WireEvent) {
    match ev {
        WireEvent::Stored {
            parent,
            block_size,
            blocks,
            tier,
            lora_name,
            salt,
        } => {
            arr(out, 9);
            str(out, "BlockStored");
            arr(out, blocks.len());
            for b in blocks {
                uint(out, b.hash);
            }
            match parent {
                Some(p) => uint(out, *p),
                None => nil(out),
            }
            arr(out, blocks.iter().map(|b| b.token_ids.len()).sum());
            for b in blocks {
                for t in &b.token_ids {
                    uint(out, u64::from(*t));
                }
            }
            uint(out, u64::from(*block_size));
            nil(out); // lora_id: vLLM's retired slot
            str(out, medium(*tier));
            if lora_name.is_empty() {
                nil(out);
            } else {
                str(out, lora_name);
            }
            if salt.is_empty() {
                nil(out);
            } else {
                // Aligned with blocks; only the first carries the salt.
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
        }
        WireEvent::Removed { hashes, tier } => {
            arr(out, 3);
            str(out, "BlockRemoved");
            arr(out, hashes.len());
            for h in hashes {
                uint(out, *h);
            }
            str(out, medium(*tier));
        }
        WireEvent::Cleared => {
            arr(out, 1);
            str(out, "AllBlocksCleared");
        }
    }
}

/// A `KVEventBatch`: `[ts, events, data_parallel_rank]`.
pub fn batch(ts_s: f64, events: &[WireEvent], dp_rank: Option<u32>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    arr(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, ts_s);
    arr(&mut out, events.len());
    for e in events {
        event(&mut out, e);
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
    fn stored_event_has_vllms_positional_shape() {
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
        let v = decode(&batch(1.5, &[ev, WireEvent::Cleared], Some(3)));
        let text = v.to_string();
        assert_eq!(
            text,
            r#"[1.5, [["BlockStored", [18446744073709551615, 9], 7, [1, 2, 3, 4], 2, nil, "DISK", "ad", [["ad", "dynamo-cache-salt:s"], nil]], ["AllBlocksCleared"]], 3]"#
        );
        let removed = WireEvent::Removed {
            hashes: vec![5],
            tier: StorageTier::External,
        };
        assert_eq!(
            decode(&batch(2.5, &[removed], None)).to_string(),
            r#"[2.5, [["BlockRemoved", [5], "EXTERNAL"]], nil]"#
        );
    }
}
