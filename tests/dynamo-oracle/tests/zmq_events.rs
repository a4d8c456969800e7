//! Proof 3 of issue #20: the ZMQ frames a running kvtierd publishes
//! (`[events.zmq]`), captured with libzmq (the `zmq` crate Dynamo's own
//! listener uses), decode with Dynamo 1.6.1's `zmq_wire` decoder, pass its
//! `ZmqEventNormalizer` as its listener does, and, applied to Dynamo's
//! radix indexer, give kvtier's worker the overlap kvtier's `lookup`
//! reports: across store, eviction G3 -> G4, promotion back, restart (the
//! start-up's AllBlocksCleared and holdings, fetched through the replay
//! socket as Dynamo's listener does on a gap) and G4 deletion.
//! Then Dynamo's standalone indexer (`standalone-indexer`), run in this
//! process, registers kvtierd's endpoints and answers `/query`.
//!
//! Both wire forms (`[events.zmq] media`, issue #43): the default, vLLM
//! 0.33.0's (STORAGE with locality LOCAL for G3, REMOTE for G4), which
//! Dynamo files under Disk and, for REMOTE, filters out by its policy (no
//! shared index yet: `NonLocalLocality`, never an error); and `"dynamo"`
//! (DISK / EXTERNAL), with which Dynamo's router scores G4 too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{payloads, Daemon};
use dynamo_kv_router::indexer::RadixTree;
use dynamo_kv_router::protocols::{
    KvCacheEventData, KvCacheEventError, RouterEvent, StorageTier, WorkerWithDpRank,
};
use dynamo_kv_router::zmq_wire::{decode_event_batch, ZmqEventFilterReason, ZmqEventNormalizer};
use kvtier_client::{Client, HashMode, Hints, KvLayout, Namespace, Onboarded, Tier};
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

const WORKER: u64 = 5151;
const BLOCK_TOKENS: u32 = 16;
const SALT: &str = "tenant-zmq";
const LORA: &str = "adapter-z";
const TOPIC: &str = "kv-events";

fn namespace(salt: &str) -> Namespace {
    Namespace::new(
        "oracle/zmq-model",
        KvLayout::with_block_bytes(4096).unwrap(),
        LORA,
        salt,
    )
    .unwrap()
    .with_hash_mode(HashMode::Dynamo)
    .unwrap()
}

/// A kvtierd config publishing `ns` on ipc endpoints in `dir` with tiers
/// named in `media`'s form, after the `extra` TOML.
fn config(
    dir: &Path,
    ns: &Namespace,
    salt: &str,
    media: &str,
    extra: &str,
) -> (String, String, String) {
    let pub_ep = format!("ipc://{}", dir.join("kv-events.ipc").display());
    let replay_ep = format!("ipc://{}", dir.join("kv-replay.ipc").display());
    let cfg = dir.join("zmq.toml");
    std::fs::write(
        &cfg,
        format!(
            "{extra}\n[events.zmq]\nendpoint = \"{pub_ep}\"\nreplay_endpoint = \"{replay_ep}\"\ntopic = \"{TOPIC}\"\nmedia = \"{media}\"\n\
             [[events.zmq.namespaces]]\nid = \"{}\"\nsalt = \"{salt}\"\nlora_name = \"{LORA}\"\n",
            ns.id().to_hex()
        ),
    )
    .unwrap();
    (cfg.display().to_string(), pub_ep, replay_ep)
}

/// Dynamo's listener, reduced to what it does with frames: SUB for live
/// batches, DEALER for replays on a sequence gap, `decode_event_batch`,
/// the normalizer, and one `RadixTree` per tier.
struct Consumer {
    _ctx: zmq::Context,
    sub: zmq::Socket,
    dealer: zmq::Socket,
    normalizer: ZmqEventNormalizer,
    trees: HashMap<StorageTier, RadixTree>,
    watermark: Option<u64>,
    stored: HashMap<StorageTier, usize>,
    removed: HashMap<StorageTier, usize>,
    cleared: usize,
    hashes_seen: Vec<u64>,
    /// Events Dynamo's normalizer filtered as not local (REMOTE).
    non_local: usize,
}

fn sockets(ctx: &zmq::Context, pub_ep: &str, replay_ep: &str) -> (zmq::Socket, zmq::Socket) {
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_subscribe(b"").unwrap();
    sub.set_rcvtimeo(100).unwrap();
    // Reconnects after a restart's first batches went out, as a router
    // across the network would.
    sub.set_reconnect_ivl(1000).unwrap();
    sub.connect(pub_ep).unwrap();
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_rcvtimeo(5000).unwrap();
    dealer.set_reconnect_ivl(50).unwrap();
    dealer.connect(replay_ep).unwrap();
    (sub, dealer)
}

impl Consumer {
    /// New sockets to a restarted worker, keeping what was learned (as
    /// Dynamo's registry does when a worker registers again): the first
    /// batch of the new run shows a gap and the replay fills it.
    fn reconnect(&mut self, pub_ep: &str, replay_ep: &str) {
        (self.sub, self.dealer) = sockets(&self._ctx, pub_ep, replay_ep);
    }

    fn connect(pub_ep: &str, replay_ep: &str) -> Consumer {
        let ctx = zmq::Context::new();
        let (sub, dealer) = sockets(&ctx, pub_ep, replay_ep);
        Consumer {
            _ctx: ctx,
            sub,
            dealer,
            normalizer: ZmqEventNormalizer::new(BLOCK_TOKENS),
            trees: HashMap::new(),
            watermark: None,
            stored: HashMap::new(),
            removed: HashMap::new(),
            cleared: 0,
            hashes_seen: Vec::new(),
            non_local: 0,
        }
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        let batch = decode_event_batch(payload)
            .unwrap_or_else(|e| panic!("Dynamo's zmq_wire cannot decode kvtier's batch: {e}"));
        for raw in batch.events {
            // As Dynamo's listener: preprocess (its filters, with the
            // reason), then conversion.
            let w = WorkerWithDpRank::new(WORKER, 0);
            let raw = match self.normalizer.preprocess_with_reason(raw, w) {
                Ok(raw) => raw,
                Err(ZmqEventFilterReason::NonLocalLocality) => {
                    self.non_local += 1;
                    continue;
                }
                Err(r) => panic!("Dynamo's normalizer filtered a kvtier event out: {r:?}"),
            };
            let Some(pe) = self.normalizer.normalize_preprocessed(raw, seq, w) else {
                panic!("Dynamo's conversion dropped a kvtier event");
            };
            let ev: RouterEvent = pe.into_router_event().expect("a local worker's event");
            if std::env::var_os("ORACLE_DEBUG").is_some() {
                eprintln!("seq {seq}: {ev:?}");
            }
            match &ev.event.data {
                KvCacheEventData::Stored(s) => {
                    *self.stored.entry(ev.storage_tier).or_default() += s.blocks.len();
                    self.hashes_seen
                        .extend(s.blocks.iter().map(|b| b.block_hash.0));
                }
                KvCacheEventData::Removed(r) => {
                    *self.removed.entry(ev.storage_tier).or_default() += r.block_hashes.len()
                }
                KvCacheEventData::Cleared => {
                    // AllBlocksCleared forgets the worker in every tier.
                    self.cleared += 1;
                    self.trees.clear();
                    continue;
                }
            }
            let tree = self.trees.entry(ev.storage_tier).or_default();
            match (tree.apply_event(ev.clone()), &ev.event.data) {
                (Ok(()), _) => {}
                (Err(KvCacheEventError::BlockNotFound), KvCacheEventData::Removed(_)) => {}
                (Err(e), _) => panic!("Dynamo's indexer refused {ev:?}: {e}"),
            }
        }
        self.watermark = Some(self.watermark.map_or(seq, |w| w.max(seq)));
    }

    /// Asks the replay socket for everything from `start` and applies it
    /// until the end marker, as Dynamo's listener does, and checks the
    /// reply as its `ReplayRecoveryProgress` does (no `Replay incomplete`):
    /// vLLM 0.33.0's framing, batches in order with none missing, reaching
    /// `end - 1` (the batch before the live one that showed the gap).
    fn replay(&mut self, start: u64, end: u64) {
        self.dealer
            .send_multipart([Vec::new(), start.to_be_bytes().to_vec()], 0)
            .unwrap();
        let mut seqs = Vec::new();
        loop {
            let m = self
                .dealer
                .recv_multipart(0)
                .expect("replay answers in time");
            // [id, "", topic, seq, payload] from the ROUTER; the DEALER
            // sees what follows the identity. End: ["", "", END, ""].
            let [_, topic, seq, payload] = m.as_slice() else {
                panic!(
                    "replay frames: {} (vLLM 0.33.0 sends 4 after the identity)",
                    m.len()
                );
            };
            if payload.is_empty() {
                assert!(topic.is_empty() && seq[..] == [0xff; 8], "end marker");
                break;
            }
            assert_eq!(topic, TOPIC.as_bytes(), "replayed batches carry the topic");
            let seq = u64::from_be_bytes(seq[..8].try_into().unwrap());
            seqs.push(seq);
            self.apply(seq, payload);
        }
        let first = *seqs.first().expect("Replay incomplete: empty");
        assert!(
            first >= start,
            "replayed {first} before the {start} asked for"
        );
        assert!(
            seqs.windows(2).all(|w| w[1] == w[0] + 1),
            "Replay incomplete: non_contiguous {seqs:?}"
        );
        assert!(
            *seqs.last().unwrap() + 1 >= end,
            "Replay incomplete: ended_before_target {seqs:?} < {end}"
        );
    }

    /// Takes live messages until `done` (30 s at most); a gap in sequence
    /// numbers (including the first message of a run) is filled by replay.
    fn pump_until(&mut self, what: &str, done: impl Fn(&Consumer) -> bool) {
        let t = Instant::now();
        while !done(self) {
            assert!(t.elapsed() < Duration::from_secs(30), "timed out: {what}");
            let Ok(m) = self.sub.recv_multipart(0) else {
                continue;
            };
            assert_eq!(m.len(), 3, "[topic, seq, payload]");
            assert_eq!(m[0], TOPIC.as_bytes());
            let seq = u64::from_be_bytes(m[1][..].try_into().expect("8-byte seq"));
            if std::env::var_os("ORACLE_DEBUG").is_some() {
                eprintln!("live {seq} watermark {:?}", self.watermark);
            }
            match self.watermark {
                Some(w) if seq <= w => continue, // already replayed
                Some(w) if seq == w + 1 => {}
                Some(w) => self.replay(w + 1, seq),
                None => self.replay(0, seq),
            }
            if self.watermark.is_some_and(|w| seq <= w) {
                continue;
            }
            self.apply(seq, &m[2]);
        }
    }

    fn score(&self, tier: StorageTier, tokens: &[u32]) -> u32 {
        common::dynamo_score(
            self.trees.get(&tier),
            WORKER,
            tokens,
            BLOCK_TOKENS,
            SALT,
            LORA,
        )
    }

    fn n(&self, m: &HashMap<StorageTier, usize>, tier: StorageTier) -> usize {
        m.get(&tier).copied().unwrap_or(0)
    }
}

#[test]
fn dynamo_decodes_kvtiers_zmq_stream_and_routes_on_it() {
    let worker = WORKER.to_string();
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(SALT);
    let (cfg, pub_ep, replay_ep) = config(dir.path(), &ns, SALT, "dynamo", "");
    let mut d = Daemon::start(&["--dynamo-worker-id", &worker, "--config", &cfg]);
    let mut c = Consumer::connect(&pub_ep, &replay_ep);
    std::thread::sleep(Duration::from_millis(300));

    let tokens: Vec<u32> = (0..6 * BLOCK_TOKENS).map(|t| t * 3 + 11).collect();
    let client = Client::connect(&d.socket).unwrap();
    let h = client.namespace(&ns);
    let data = payloads(6, 1);
    let refs: Vec<&[u8]> = data.iter().map(|p| &p[..]).collect();
    let (keys, out) = h.offload_tokens(None, &tokens, &refs, Hints::default());
    assert!(out
        .iter()
        .all(|o| *o == kvtier_client::OffloadOutcome::Stored));
    // Not on this stream: a namespace not configured, and one configured
    // id whose blocks were hashed with another salt would not even be the
    // same namespace; the stream never carries them.
    let other = namespace("another-tenant");
    let _ = client
        .namespace(&other)
        .offload_tokens(None, &tokens, &refs[..3], Hints::default());
    // (Counts of events would mislead: a replay may announce a block
    // twice, holdings and then the batch that stored it. Scores do not.)
    c.pump_until("6 blocks on Disk and External", |c| {
        c.score(StorageTier::Disk, &tokens) == 6 && c.score(StorageTier::External, &tokens) == 6
    });
    assert!(c.cleared >= 1, "the start-up's AllBlocksCleared, by replay");
    assert_eq!(h.lookup(&keys).prefix_len(), 6);
    assert_eq!(c.score(StorageTier::Disk, &tokens), 6);
    assert_eq!(c.score(StorageTier::External, &tokens), 6);
    assert_eq!(
        c.score(StorageTier::Disk, &tokens[..2 * BLOCK_TOKENS as usize]),
        2
    );
    let mut diverged = tokens.clone();
    diverged[3 * BLOCK_TOKENS as usize] ^= 1;
    assert_eq!(c.score(StorageTier::Disk, &diverged), 3);
    let own: Vec<u64> = keys.iter().map(|k| k.as_u64().unwrap()).collect();
    assert!(
        c.hashes_seen.iter().all(|h| own.contains(h)),
        "only the configured namespace's blocks are published"
    );

    // Evict from G3: Disk removals; External stays; lookup says G4.
    h.evict(&keys).unwrap();
    c.pump_until("6 Disk removals", |c| {
        c.n(&c.removed, StorageTier::Disk) >= 6 && c.score(StorageTier::Disk, &tokens) == 0
    });
    let l = h.lookup(&keys);
    assert_eq!(l.prefix_len(), 6);
    assert!(l.tiers.iter().all(|t| *t == Tier::G4), "{:?}", l.tiers);
    assert_eq!(c.score(StorageTier::Disk, &tokens), 0);
    assert_eq!(c.score(StorageTier::External, &tokens), 6);

    // Onboard: promoted back into G3, announced with the header's tokens.
    let mut bufs: Vec<Vec<u8>> = (0..6).map(|_| vec![0u8; 4096]).collect();
    let mut rb: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = h.onboard_into(&keys, &mut rb);
    assert!(got.iter().all(|g| matches!(g, Onboarded::Hit { .. })));
    c.pump_until("6 Disk stores after promotion", |c| {
        c.score(StorageTier::Disk, &tokens) == 6
    });
    let t = Instant::now();
    while h.lookup(&keys).tiers.iter().any(|t| *t != Tier::G3) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "promotion did not finish"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(c.score(StorageTier::Disk, &tokens), 6);
    drop(client);

    // Restart (kill -9). The new run's numbers start above the old ones:
    // the consumer sees a gap, replays, and gets AllBlocksCleared, then the
    // G3 holdings from their headers (DISK) and those G4 has too
    // (EXTERNAL).
    let cleared_before = c.cleared;
    let args = |cfg: String| {
        vec![
            "--dynamo-worker-id".to_string(),
            worker.clone(),
            "--config".into(),
            cfg,
        ]
    };
    d.restart_with(&args(cfg.clone()));
    // The consumer keeps its sockets (libzmq reconnects them after the
    // start-up's batches went out) and nothing is stored: the publisher's
    // idle heartbeat shows the gap, the replay brings AllBlocksCleared and
    // the holdings.
    c.pump_until("the restart's clear and holdings, with no store", |c| {
        c.cleared > cleared_before
            && c.score(StorageTier::Disk, &tokens) == 6
            && c.score(StorageTier::External, &tokens) == 6
    });
    let client = Client::connect(&d.socket).unwrap();
    let h = client.namespace(&ns);
    // Something new: it hangs under the announced holdings in both tiers.
    let longer: Vec<u32> = tokens
        .iter()
        .copied()
        .chain((0..2 * BLOCK_TOKENS).map(|t| t + 7000))
        .collect();
    let more = payloads(8, 9);
    let refs: Vec<&[u8]> = more.iter().map(|p| &p[..]).collect();
    let (all_keys, _) = h.offload_tokens(None, &longer, &refs, Hints::default());
    c.pump_until("2 new blocks under the holdings", |c| {
        c.score(StorageTier::Disk, &longer) == 8 && c.score(StorageTier::External, &longer) == 8
    });
    assert_eq!(h.lookup(&all_keys).prefix_len(), 8);
    drop(client);

    // Restart with a G4 TTL: the sweeper deletes the G4 copies; the router
    // ends with none on EXTERNAL and all 8 on DISK, as kvtier's lookup says.
    let cleared_before = c.cleared;
    let (cfg2, _, _) = config(
        dir.path(),
        &ns,
        SALT,
        "dynamo",
        "[g4]\nttl_ms = 1\nsweep_interval_ms = 200\nsweep_min_age_ms = 0\n",
    );
    d.restart_with(&args(cfg2));
    c.reconnect(&pub_ep, &replay_ep);
    std::thread::sleep(Duration::from_millis(500));
    let client = Client::connect(&d.socket).unwrap();
    let h = client.namespace(&ns);
    // A live batch to reveal the gap: a block of another chain.
    let single = payloads(1, 4);
    let lone: Vec<u32> = (0..BLOCK_TOKENS).map(|t| t + 50_000).collect();
    let _ = h.offload_tokens(None, &lone, &[&single[0][..]], Hints::default());
    c.pump_until("the sweeper's External removals", |c| {
        c.cleared > cleared_before
            && c.score(StorageTier::External, &longer) == 0
            && c.score(StorageTier::Disk, &longer) == 8
    });
    let l = h.lookup(&all_keys);
    assert_eq!(l.prefix_len(), 8);
    assert!(l.tiers.iter().all(|t| *t == Tier::G3), "{:?}", l.tiers);
    assert_eq!(c.non_local, 0, "the dynamo form names no locality");
}

/// The default form, vLLM 0.33.0's: Dynamo decodes every batch, files
/// STORAGE/LOCAL (G3) under its Disk tier with kvtier's G3 holdings, and
/// filters STORAGE/REMOTE (G4) out by its own policy, never as an error.
#[test]
fn dynamo_reads_vllms_storage_form_local_as_disk_and_filters_remote() {
    let worker = (WORKER + 2).to_string();
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(SALT);
    let (cfg, pub_ep, replay_ep) = config(dir.path(), &ns, SALT, "vllm", "");
    let d = Daemon::start(&["--dynamo-worker-id", &worker, "--config", &cfg]);
    let mut c = Consumer::connect(&pub_ep, &replay_ep);
    std::thread::sleep(Duration::from_millis(300));
    let tokens: Vec<u32> = (0..6 * BLOCK_TOKENS).map(|t| t * 7 + 5).collect();
    let client = Client::connect(&d.socket).unwrap();
    let h = client.namespace(&ns);
    let data = payloads(6, 3);
    let refs: Vec<&[u8]> = data.iter().map(|p| &p[..]).collect();
    let (keys, _) = h.offload_tokens(None, &tokens, &refs, Hints::default());
    // G3 stores on Disk; the G4 uploads arrive as REMOTE and are filtered.
    c.pump_until("6 blocks on Disk and 6 REMOTE stores filtered", |c| {
        c.score(StorageTier::Disk, &tokens) == 6 && c.non_local >= 6
    });
    assert_eq!(h.lookup(&keys).prefix_len(), 6);
    assert_eq!(c.score(StorageTier::External, &tokens), 0);
    assert_eq!(c.n(&c.stored, StorageTier::External), 0);
    // Evicted from G3: the LOCAL removals reach Disk.
    h.evict(&keys).unwrap();
    c.pump_until("6 Disk removals", |c| {
        c.n(&c.removed, StorageTier::Disk) >= 6 && c.score(StorageTier::Disk, &tokens) == 0
    });
    assert!(h.lookup(&keys).tiers.iter().all(|t| *t == Tier::G4));
}

/// Dynamo's standalone indexer (its `standalone-indexer` feature, run in
/// this process on a loopback port) registers kvtierd as a worker by its
/// ZMQ endpoints and answers `/query` for a prompt with kvtier's overlap.
#[test]
fn dynamos_standalone_indexer_routes_on_kvtierd() {
    let worker = (WORKER + 1).to_string();
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace(SALT);
    // The default form (vLLM's): G3 as STORAGE/LOCAL is the indexer's disk.
    let (cfg, pub_ep, replay_ep) = config(dir.path(), &ns, SALT, "vllm", "");
    let d = Daemon::start(&["--dynamo-worker-id", &worker, "--config", &cfg]);
    // Blocks stored before the indexer exists: it learns them through the
    // replay socket (start-up holdings).
    let tokens: Vec<u32> = (0..5 * BLOCK_TOKENS).map(|t| t * 5 + 3).collect();
    let client = Client::connect(&d.socket).unwrap();
    let h = client.namespace(&ns);
    let data = payloads(5, 2);
    let refs: Vec<&[u8]> = data.iter().map(|p| &p[..]).collect();
    let (keys, _) = h.offload_tokens(
        None,
        &tokens[..3 * BLOCK_TOKENS as usize],
        &refs[..3],
        Hints::default(),
    );
    assert_eq!(keys.len(), 3);

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(dynamo_kv_router::services::indexer::run_server(
            dynamo_kv_router::services::indexer::IndexerConfig {
                block_size: Some(BLOCK_TOKENS),
                port,
                threads: 1,
                workers: None,
                model_name: "oracle".into(),
                routing_group: "default".into(),
                peers: None,
                access_log: None,
                trace_id_header: "x-request-id".parse().unwrap(),
                access_log_local_time: false,
            },
        ))
        .unwrap();
    });
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "indexer did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, body) = http_post(
        port,
        "/register",
        &serde_json::json!({
            "instance_id": WORKER + 1,
            "endpoint": pub_ep,
            "replay_endpoint": replay_ep,
            "model_name": "oracle",
            "block_size": BLOCK_TOKENS,
        }),
    );
    assert!(code == 201 || code == 200, "{code} {body}");
    std::thread::sleep(Duration::from_millis(500));
    // More blocks: the first live batch shows the indexer a gap, which it
    // fills from the replay socket.
    let (keys5, _) = h.offload_tokens(None, &tokens, &refs, Hints::default());
    assert_eq!(h.lookup(&keys5).prefix_len(), 5);
    let query = |toks: &[u32]| -> serde_json::Value {
        let (code, body) = http_post(
            port,
            "/query",
            &serde_json::json!({
                "token_ids": toks,
                "model_name": "oracle",
                "lora_name": LORA,
                "cache_salt": SALT,
            }),
        );
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    };
    let id = (WORKER + 1).to_string();
    let t = Instant::now();
    loop {
        let v = query(&tokens);
        let disk = v["instances"][&id]["disk"].as_u64().unwrap_or(0);
        if disk == u64::from(5 * BLOCK_TOKENS) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the indexer never learned kvtierd's 5 blocks: {v}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A prompt sharing 2 blocks (the indexer applies events on its own
    // threads: poll until it agrees).
    let mut other = tokens.clone();
    other[2 * BLOCK_TOKENS as usize] ^= 1;
    let t = Instant::now();
    loop {
        let v = query(&other);
        if v["instances"][&id]["disk"].as_u64() == Some(u64::from(2 * BLOCK_TOKENS)) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{v}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A plain HTTP/1.1 POST on loopback: `(status, body)`.
fn http_post(port: u16, path: &str, body: &serde_json::Value) -> (u16, String) {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let code = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (code, body)
}
