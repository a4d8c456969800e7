//! `kvtier bench scale`: a model of a fleet (default 64 nodes of 8 GPUs)
//! serving the Mooncake conversation trace, computed from the trace and the
//! daemon's own defaults and code, not from retyped numbers:
//!
//! - The trace is replayed `--replicas` times with disjoint ids (independent
//!   user populations), each request routed to a node, either at random or
//!   KV-aware (longest prefix held in G3, then least loaded). Per node, G3
//!   is a set (the one-hour trace fits on a node's NVMe); G4 holds every
//!   block written (admission `all`, the default).
//! - A hit block past the node's local prefix is served by a peer when one
//!   of the first `peer.fanout_max` peers in the requester's rendezvous
//!   order (the real `peer::placement::weight`) holds it, else by G4 —
//!   exactly the order `PeerSet::fetch` asks in. The share a perfect
//!   holdings index would give ("any other node holds it") is reported
//!   beside it.
//! - Fleet request rate: each GPU prefills `--prefill-tokens-per-s` (the
//!   `bench replay` default), so it serves prefill-rate / mean uncached
//!   prompt tokens requests per second.
//! - Discovery load from `PeerConfig::default()` (heartbeat period) and
//!   `discovery::NODES_MAX`; heartbeat bytes from a serialized
//!   `Heartbeat`; G4 request counts from `G4Config::default()` (multipart
//!   threshold and part size); router event bytes from the ZMQ publisher's
//!   own encoder (`zmq::wire::batch`, token ids included).
//!
//! Per-request means come from the simulation; rates are those means times
//! the fleet's request rate. What is not modelled: eviction (G3 and G4
//! never fill within the hour), the existence cache's savings on HEADs
//! (HEADs are an upper bound), lookup probes past the first gap (up to 15
//! more per lookup, `LOOKUP_PARALLEL`), decode.

use super::common::{emit, parse_size};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::events::StorageTier;
use kvtier_client::{BlockKey, NamespaceId};
use kvtier_daemon::app::config::Config;
use kvtier_daemon::edges::zmq::wire::{self, WireBlock, WireEvent};
use kvtier_daemon::tiers::g4::G4Config;
use kvtier_daemon::tiers::peer::discovery::{Heartbeat, NODES_MAX};
use kvtier_daemon::tiers::peer::{placement, PeerConfig};
use kvtier_daemon::tiers::policy::admission::G4Admission;
use kvtier_daemon::tiers::policy::trace::Trace;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::PathBuf;

/// Tokens per block of the Mooncake trace's `hash_ids`.
const TRACE_BLOCK_TOKENS: u64 = 512;
/// AWS S3's documented request rates per partitioned prefix (GET/HEAD and
/// PUT/POST/DELETE per second): where one prefix saturates.
const S3_GET_PER_PREFIX_PER_S: f64 = 5_500.0;
const S3_PUT_PER_PREFIX_PER_S: f64 = 3_500.0;
/// Key shards per namespace (`<ns>/<shard>/<key>`, the key's first byte).
const KEY_SHARDS: f64 = 256.0;
/// HTTP request + response head bytes of a peer probe, besides the 4096
/// header bytes (measured order of magnitude: method, path, signature).
const PROBE_HTTP_OVERHEAD_BYTES: f64 = 400.0;
/// Most nodes the simulation's holder bitmasks represent.
const NODES_SIM_MAX: usize = 64;

/// Arguments of `kvtier bench scale`.
#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// Mooncake-format trace (default: the shared conversation trace).
    #[arg(
        long,
        default_value = "../shared/workloads/mooncake/conversation_trace.jsonl"
    )]
    trace: PathBuf,
    /// Nodes in the fleet (at most 64).
    #[arg(long, default_value_t = 64)]
    nodes: usize,
    /// GPUs (engine instances) per node.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: usize,
    /// Tokens per kvtier block (a divisor of 512: each trace block becomes
    /// 512 / block-tokens kvtier blocks).
    #[arg(long, default_value_t = 512)]
    block_tokens: u64,
    /// KV bytes per token (default: Llama-3-8B bf16, 32 layers x K,V x 8
    /// heads x 128 x 2 bytes).
    #[arg(long, value_parser = parse_size, default_value = "128KiB")]
    bytes_per_token: u64,
    /// Prefill rate of one GPU, tokens per second (the `bench replay`
    /// default).
    #[arg(long, default_value_t = 8000.0)]
    prefill_tokens_per_s: f64,
    /// Copies of the trace replayed at once, with disjoint ids.
    #[arg(long, default_value_t = 4)]
    replicas: u64,
    /// Replay only the first N requests of the trace.
    #[arg(long)]
    max_requests: Option<usize>,
    /// One JSON document on stdout.
    #[arg(long)]
    json: bool,
}

/// Per-request sums of one routing's simulation.
#[derive(Debug, Default, Clone)]
struct Sums {
    requests: u64,
    blocks: u64,
    hit: u64,
    local: u64,
    peer: u64,
    peer_if_known: u64,
    g4: u64,
    new: u64,
    uploads: u64,
    unreachable: u64,
    probes: u64,
    heads: u64,
    input_tokens: u64,
    hit_tokens: u64,
    load_max: u64,
}

/// Which node a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Routing {
    Random,
    Affinity,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The first `k` nodes of a block's rendezvous order over all nodes.
fn top_nodes(ids: &[String], ns: &NamespaceId, block: u64, k: usize) -> Vec<u8> {
    let key = BlockKey::from_u64(block);
    let mut w: Vec<(u64, u8)> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (placement::weight(id, ns, &key), i as u8))
        .collect();
    w.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    w.into_iter().take(k).map(|(_, i)| i).collect()
}

fn simulate(
    trace: &Trace,
    a: &ScaleArgs,
    fanout: usize,
    routing: Routing,
    admission: G4Admission,
) -> Sums {
    // Dense ids: trace id -> 0..distinct, per replica offset.
    let mut dense: HashMap<u64, u32> = HashMap::new();
    for r in &trace.requests {
        for h in &r.hash_ids {
            let n = dense.len() as u32;
            dense.entry(*h).or_insert(n);
        }
    }
    let distinct = dense.len();
    let total = distinct * a.replicas as usize;
    let mut holders = vec![0u64; total];
    let mut in_g4 = vec![false; total];
    let mut top: Vec<Option<Vec<u8>>> = vec![None; total];
    let ids: Vec<String> = (0..a.nodes).map(|i| format!("node-{i:03}")).collect();
    let ns = NamespaceId([7; 16]);
    let mut load = vec![0u64; a.nodes];
    // The router's view of load: blocks of the requests each node took
    // among the last `window` (one request in flight per GPU).
    let window = a.nodes * a.gpus_per_node;
    let mut recent: std::collections::VecDeque<(usize, u64)> = Default::default();
    let mut active = vec![0u64; a.nodes];
    let mut s = Sums::default();
    let all = if a.nodes == 64 {
        u64::MAX
    } else {
        (1u64 << a.nodes) - 1
    };
    let mut i = 0u64;
    for req in &trace.requests {
        for rep in 0..a.replicas as usize {
            i += 1;
            let chain: Vec<usize> = req
                .hash_ids
                .iter()
                .map(|h| rep * distinct + dense[h] as usize)
                .collect();
            let node = match routing {
                Routing::Random => (splitmix(i) % a.nodes as u64) as usize,
                Routing::Affinity => {
                    // Dynamo's KV router cost: blocks to prefill on the
                    // node (chain minus its cached prefix) plus its active
                    // blocks; the cheapest node wins, ties to the lowest.
                    let mut overlap = vec![0u64; a.nodes];
                    let mut mask = all;
                    for &b in &chain {
                        mask &= holders[b];
                        if mask == 0 {
                            break;
                        }
                        for (n, o) in overlap.iter_mut().enumerate() {
                            *o += mask >> n & 1;
                        }
                    }
                    let len = chain.len() as u64;
                    (0..a.nodes)
                        .min_by_key(|&n| (len - overlap[n] + active[n], n))
                        .unwrap_or(0)
                }
            };
            load[node] += 1;
            active[node] += chain.len() as u64;
            recent.push_back((node, chain.len() as u64));
            if recent.len() > window {
                if let Some((n, l)) = recent.pop_front() {
                    active[n] -= l;
                }
            }
            let bit = 1u64 << node;
            let local = chain.iter().take_while(|&&b| holders[b] & bit != 0).count();
            // Past the local prefix: a peer among the first `fanout` of
            // this node's rendezvous order, else G4, else the prefix ends.
            let mut hit = local;
            for &b in &chain[local..] {
                if holders[b] == 0 {
                    break;
                }
                let others = holders[b] & !bit;
                let t = top[b].get_or_insert_with(|| top_nodes(&ids, &ns, b as u64, fanout + 1));
                let asked = t
                    .iter()
                    .filter(|&&n| n as usize != node)
                    .take(fanout)
                    .fold(0u64, |m, &n| m | 1 << n);
                if others & asked != 0 {
                    s.peer += 1;
                } else if in_g4[b] {
                    s.g4 += 1;
                } else {
                    s.unreachable += 1;
                    break;
                }
                if others != 0 {
                    s.peer_if_known += 1;
                }
                holders[b] |= bit; // promoted into this node's G3
                hit += 1;
            }
            // A local hit is a G3 hit: `after-first-reuse` uploads it now.
            for &b in &chain[..local] {
                if admission == G4Admission::AfterFirstReuse && !in_g4[b] {
                    in_g4[b] = true;
                    s.uploads += 1;
                }
            }
            let gap = u64::from(hit < chain.len());
            s.probes += (hit - local) as u64 * fanout as u64 + gap * fanout as u64;
            s.heads += gap;
            for &b in &chain[hit..] {
                if holders[b] & bit == 0 {
                    s.new += 1;
                }
                holders[b] |= bit;
                if admission == G4Admission::All && !in_g4[b] {
                    in_g4[b] = true;
                    s.uploads += 1;
                }
            }
            s.requests += 1;
            s.blocks += chain.len() as u64;
            s.hit += hit as u64;
            s.local += local as u64;
            s.input_tokens += req.input_length;
            s.hit_tokens += (hit as u64 * TRACE_BLOCK_TOKENS).min(req.input_length);
        }
    }
    s.heads += s.g4;
    s.load_max = load.iter().copied().max().unwrap_or(0);
    s
}

/// Bytes of one `KVEventBatch` carrying one `BlockStored` of `blocks`
/// blocks of `tokens` tokens each (token ids spread over Llama-3's vocab).
fn stored_event_bytes(blocks: usize, tokens: u64, tier: StorageTier) -> usize {
    let blocks: Vec<WireBlock> = (0..blocks)
        .map(|b| WireBlock {
            hash: splitmix(b as u64),
            token_ids: (0..tokens)
                .map(|t| (splitmix(t ^ (b as u64) << 32) % 128_256) as u32)
                .collect(),
        })
        .collect();
    let ev = WireEvent::Stored {
        parent: Some(1),
        block_size: tokens as u32,
        blocks,
        tier,
        lora_name: String::new(),
        salt: String::new(),
    };
    wire::batch(1.0, &[ev], Some(0), wire::Media::default()).len()
}

fn admission_name(a: G4Admission) -> &'static str {
    match a {
        G4Admission::All => "all",
        G4Admission::AfterFirstReuse => "after-first-reuse",
    }
}

/// Runs the model and prints its report.
pub fn run(a: ScaleArgs) -> Result<()> {
    let r = report(&a)?;
    emit(&r, a.json)
}

/// The model's report as one JSON value.
pub fn report(a: &ScaleArgs) -> Result<Value> {
    if a.nodes < 2 || a.nodes > NODES_SIM_MAX {
        bail!("--nodes {} must lie in 2..={NODES_SIM_MAX}", a.nodes);
    }
    if a.block_tokens == 0 || !TRACE_BLOCK_TOKENS.is_multiple_of(a.block_tokens) {
        bail!("--block-tokens {} must divide 512", a.block_tokens);
    }
    if a.replicas == 0 || a.gpus_per_node == 0 || a.prefill_tokens_per_s <= 0.0 {
        bail!("--replicas, --gpus-per-node and --prefill-tokens-per-s must be positive");
    }
    let mut trace =
        Trace::load(&a.trace).with_context(|| format!("loading trace {}", a.trace.display()))?;
    if let Some(n) = a.max_requests {
        trace.requests.truncate(n);
    }
    if trace.requests.is_empty() {
        bail!("the trace has no requests");
    }
    let peer = PeerConfig::default();
    let g4 = G4Config::default();
    let fanout = peer.fanout_max.min(a.nodes - 1);
    let sub = (TRACE_BLOCK_TOKENS / a.block_tokens) as f64;
    let payload = a.block_tokens * a.bytes_per_token;
    let file_bytes = (payload + HEADER_BYTES as u64) as f64;
    let puts_per_object = if file_bytes as u64 >= g4.multipart_threshold_bytes {
        // Create, the parts, complete.
        2.0 + (file_bytes / g4.multipart_part_bytes as f64).ceil()
    } else {
        1.0
    };
    let n = a.nodes as f64;
    let period_s = peer.heartbeat_period_ms as f64 / 1000.0;
    let hb = Heartbeat {
        node_id: "gpu-node-063".into(),
        address: "10.0.0.63:7401".into(),
        expires_unix_ms: 1_764_000_000_000,
        written_unix_ms: 1_764_000_000_000,
    };
    let hb_bytes = serde_json::to_vec(&hb)?.len() as f64;
    let list_pages = (n / 1000.0).ceil();
    let disc_get = n * (n - 1.0) / period_s;
    let discovery = json!({
        "heartbeat_period_ms": peer.heartbeat_period_ms,
        "heartbeat_ttl_ms": peer.heartbeat_ttl_ms,
        "heartbeat_bytes": hb_bytes,
        "put_per_s": n / period_s,
        "list_per_s": n / period_s * list_pages,
        "get_per_s": disc_get,
        "bytes_per_s": (n / period_s + disc_get) * hb_bytes,
        // Every heartbeat is under one prefix (`nodes/`): its GETs grow as
        // N^2 and meet one prefix's GET rate here.
        "nodes_at_prefix_get_limit": (S3_GET_PER_PREFIX_PER_S * period_s).sqrt().floor(),
        "nodes_max_read": NODES_MAX,
    });
    let ev_one = stored_event_bytes(1, a.block_tokens, StorageTier::Disk) as f64;
    let default_admission: G4Admission = Config::default()
        .g4
        .admission
        .parse()
        .map_err(|e| anyhow::anyhow!("the default g4.admission: {e}"))?;
    let mut admissions = vec![default_admission];
    admissions.extend(
        [G4Admission::All, G4Admission::AfterFirstReuse]
            .into_iter()
            .filter(|x| *x != default_admission),
    );
    let mut routings = serde_json::Map::new();
    for admission in admissions {
        for (rname, routing) in [("random", Routing::Random), ("affinity", Routing::Affinity)] {
            let name = format!("{}/{rname}", admission_name(admission));
            let s = simulate(&trace, a, fanout, routing, admission);
            let per = |v: u64| v as f64 / s.requests as f64;
            let uncached_tokens = per(s.input_tokens) - per(s.hit_tokens);
            let gpu_rps = a.prefill_tokens_per_s / uncached_tokens.max(1.0);
            let fleet_rps = gpu_rps * (a.gpus_per_node * a.nodes) as f64;
            let rate = |v: u64| per(v) * sub * fleet_rps;
            let new_per_req = per(s.new);
            let new_event_blocks = (new_per_req * sub).round().max(1.0) as usize;
            let ev_new =
                stored_event_bytes(new_event_blocks, a.block_tokens, StorageTier::Disk) as f64;
            // Events per request: one DISK Stored for the request's new
            // blocks, one DISK Stored per promoted block (promotions finish one
            // by one), one EXTERNAL Stored per uploaded block.
            let promoted = per(s.peer + s.g4) * sub;
            let uploads = per(s.uploads) * sub;
            let events_per_req = 1.0 + promoted + uploads;
            let event_bytes_per_req = ev_new + (promoted + uploads) * ev_one;
            let g4_get = rate(s.g4);
            let g4_put_objects = rate(s.uploads);
            let g4_heads = rate(s.heads);
            let remote = (s.peer + s.g4).max(1) as f64;
            routings.insert(
            name,
            json!({
                "requests_simulated": s.requests,
                "load_max_over_mean": s.load_max as f64 / (s.requests as f64 / n),
                "per_request": {
                    "trace_blocks": per(s.blocks),
                    "hit_blocks": per(s.hit),
                    "local_blocks": per(s.local),
                    "peer_blocks": per(s.peer),
                    "g4_blocks": per(s.g4),
                    "new_blocks": new_per_req,
                    "uploaded_blocks": per(s.uploads),
                    "lost_hit_blocks": per(s.unreachable),
                    "uncached_tokens": uncached_tokens,
                },
                "peer_share_of_remote_hits": s.peer as f64 / remote,
                "peer_share_if_holdings_known": s.peer_if_known as f64 / remote,
                "fleet_requests_per_s": fleet_rps,
                "g4": {
                    "get_per_s": g4_get,
                    "get_bytes_per_s": g4_get * file_bytes,
                    "head_per_s_upper_bound": g4_heads,
                    "put_objects_per_s": g4_put_objects,
                    "put_requests_per_s": g4_put_objects * puts_per_object,
                    "put_bytes_per_s": g4_put_objects * file_bytes,
                    "get_bytes_per_s_per_node": g4_get * file_bytes / n,
                    "gets_share_of_sharded_prefix_limit": g4_get / (S3_GET_PER_PREFIX_PER_S * KEY_SHARDS),
                    "puts_share_of_sharded_prefix_limit": g4_put_objects * puts_per_object / (S3_PUT_PER_PREFIX_PER_S * KEY_SHARDS),
                },
                "peer": {
                    "fetch_per_s": rate(s.peer),
                    "fetch_bytes_per_s": rate(s.peer) * file_bytes,
                    "probe_per_s": rate(s.probes),
                    "probe_bytes_per_s": rate(s.probes) * (HEADER_BYTES as f64 + PROBE_HTTP_OVERHEAD_BYTES),
                },
                "router_events": {
                    "events_per_s": events_per_req * fleet_rps,
                    "bytes_per_s": event_bytes_per_req * fleet_rps,
                    "bytes_per_block_event": ev_one,
                },
            }),
        );
        }
    }
    Ok(json!({
        "bench": "scale",
        "trace": a.trace.display().to_string(),
        "trace_requests": trace.requests.len(),
        "nodes": a.nodes,
        "gpus_per_node": a.gpus_per_node,
        "replicas": a.replicas,
        "block_tokens": a.block_tokens,
        "block_file_bytes": file_bytes,
        "g4_requests_per_put": puts_per_object,
        "peer_fanout_max": fanout,
        "prefill_tokens_per_s_per_gpu": a.prefill_tokens_per_s,
        "g4_admission_default": admission_name(default_admission),
        "discovery": discovery,
        "model": routings,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ScaleArgs,
    }

    #[test]
    fn tiny_trace_model_has_the_contract() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.jsonl");
        let mut text = String::new();
        for i in 0..40u64 {
            // Conversations of two turns: turn two extends turn one.
            let c = i / 2;
            let turn = i % 2;
            let ids: Vec<String> = (0..3 + turn).map(|b| (c * 10 + b).to_string()).collect();
            text.push_str(&format!(
                "{{\"timestamp\": {i}, \"input_length\": {}, \"output_length\": 10, \"hash_ids\": [{}]}}\n",
                (3 + turn) * 512,
                ids.join(", ")
            ));
        }
        std::fs::write(&trace, text).unwrap();
        let cli = Cli::parse_from([
            "x",
            "--trace",
            trace.to_str().unwrap(),
            "--nodes",
            "8",
            "--replicas",
            "2",
        ]);
        let r = report(&cli.a).unwrap();
        assert_eq!(r["nodes"], 8);
        let aff = &r["model"]["all/affinity"];
        let rnd = &r["model"]["all/random"];
        assert!(r["model"]["after-first-reuse/random"].is_object());
        // KV-aware routing sends turn two where turn one's blocks are.
        assert!(
            aff["per_request"]["local_blocks"].as_f64().unwrap()
                > rnd["per_request"]["local_blocks"].as_f64().unwrap()
        );
        // Every block seen once is new; each conversation's second turn
        // reuses three of its four.
        assert_eq!(aff["per_request"]["hit_blocks"].as_f64().unwrap(), 1.5);
        assert_eq!(aff["per_request"]["new_blocks"].as_f64().unwrap(), 2.0);
        for k in ["get_per_s", "put_requests_per_s"] {
            assert!(rnd["g4"][k].as_f64().unwrap() >= 0.0, "{k}");
        }
        assert!(r["discovery"]["get_per_s"].as_f64().unwrap() > 0.0);
        assert!(
            rnd["router_events"]["bytes_per_block_event"]
                .as_f64()
                .unwrap()
                > 512.0
        );
        let bad = Cli::parse_from(["x", "--trace", trace.to_str().unwrap(), "--nodes", "65"]);
        assert!(report(&bad.a).is_err());
    }
}
