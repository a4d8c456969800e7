//! Proof 2 of issue #20: the JSON events of a running kvtierd
//! (`kvtier events --format dynamo`) deserialize with Dynamo 1.6.1's own
//! `RouterEvent`, and, applied to Dynamo's own radix indexer (one
//! `RadixTree` per storage tier, as Dynamo's router keeps lower tiers
//! apart), `find_matches` for a request's tokens gives kvtier's worker the
//! overlap kvtier's `lookup` reports: across store, eviction G3 -> G4 (tier
//! change), promotion back, restart and G4 deletion by the sweeper.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{payloads, Daemon, EventsCli};
use dynamo_kv_router::indexer::RadixTree;
use dynamo_kv_router::protocols::{KvCacheEventData, KvCacheEventError, RouterEvent, StorageTier};
use kvtier_client::{Client, HashMode, Hints, KvLayout, Namespace, Onboarded, Tier};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const WORKER: u64 = 4242;
const BLOCK_TOKENS: u32 = 16;
const SALT: &str = "tenant-oracle";
const LORA: &str = "adapter-7";

/// Dynamo's side: every event line parsed by `RouterEvent` and applied.
struct Router {
    trees: HashMap<StorageTier, RadixTree>,
    events: Vec<RouterEvent>,
}

impl Router {
    fn new() -> Self {
        Router {
            trees: HashMap::new(),
            events: Vec::new(),
        }
    }

    fn apply_line(&mut self, line: &str) {
        let ev: RouterEvent = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a Dynamo RouterEvent: {e}: {line}"));
        assert_eq!(ev.worker_id, WORKER, "{line}");
        assert!(
            matches!(ev.storage_tier, StorageTier::Disk | StorageTier::External),
            "{line}"
        );
        if let Some(last) = self.events.last() {
            assert!(
                ev.event.event_id > last.event.event_id,
                "ids increase: {line}"
            );
        }
        let tree = self.trees.entry(ev.storage_tier).or_default();
        match (tree.apply_event(ev.clone()), &ev.event.data) {
            (Ok(()), _) => {}
            // Dynamo's tree is prefix-shaped: removing a block drops the
            // worker from its descendants too, so a later removal of a
            // descendant finds nothing (Dynamo's router logs and goes on).
            (Err(KvCacheEventError::BlockNotFound), KvCacheEventData::Removed(_)) => {}
            (Err(e), _) => panic!("Dynamo's indexer refused {line}: {e}"),
        }
        self.events.push(ev);
    }

    /// Reads event lines until `done` holds (or fails after 30 s).
    fn pump_until(&mut self, cli: &EventsCli, what: &str, done: impl Fn(&Router) -> bool) {
        let t = Instant::now();
        while !done(self) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "timed out waiting for {what}"
            );
            if let Ok(l) = cli.lines.recv_timeout(Duration::from_millis(100)) {
                self.apply_line(&l);
            }
        }
    }

    /// Dynamo's overlap score for kvtier's worker on `tokens`, in `tier`.
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

    fn count(&self, tier: StorageTier, stored: bool) -> usize {
        self.events
            .iter()
            .filter(|e| e.storage_tier == tier)
            .map(|e| match &e.event.data {
                KvCacheEventData::Stored(s) if stored => s.blocks.len(),
                KvCacheEventData::Removed(r) if !stored => r.block_hashes.len(),
                _ => 0,
            })
            .sum()
    }
}

fn namespace() -> Namespace {
    Namespace::new(
        "oracle/model",
        KvLayout::with_block_bytes(4096).unwrap(),
        LORA,
        SALT,
    )
    .unwrap()
    .with_hash_mode(HashMode::Dynamo)
    .unwrap()
}

#[test]
fn dynamo_router_learns_what_kvtier_holds() {
    let worker = WORKER.to_string();
    let mut d = Daemon::start(&["--dynamo-worker-id", &worker]);
    let ns = namespace();
    let tokens: Vec<u32> = (0..6 * BLOCK_TOKENS).map(|t| t * 7 + 100).collect();
    let mut r = Router::new();

    // Store: 6 blocks on G3 (Disk) and, written through, on G4 (External).
    let cli = EventsCli::start(&d.socket);
    let client = Client::connect(&d.socket).unwrap();
    let h = client.namespace(&ns);
    let data = payloads(6, 0);
    let refs: Vec<&[u8]> = data.iter().map(|p| &p[..]).collect();
    let (keys, out) = h.offload_tokens(None, &tokens, &refs, Hints::default());
    assert_eq!(keys.len(), 6);
    assert!(out
        .iter()
        .all(|o| *o == kvtier_client::OffloadOutcome::Stored));
    // A blake3 namespace's blocks must not appear in Dynamo's form.
    let other = Namespace::new(
        "oracle/model",
        KvLayout::with_block_bytes(4096).unwrap(),
        "",
        SALT,
    )
    .unwrap();
    let ho = client.namespace(&other);
    let _ = ho.offload_tokens(None, &tokens, &refs[..2], Hints::default());
    r.pump_until(&cli, "6 Disk and 6 External stores", |r| {
        r.count(StorageTier::Disk, true) == 6 && r.count(StorageTier::External, true) == 6
    });
    assert_eq!(h.lookup(&keys).prefix_len(), 6);
    assert_eq!(r.score(StorageTier::Disk, &tokens), 6);
    assert_eq!(r.score(StorageTier::External, &tokens), 6);
    // A prefix of the request, and a request that diverges after block 2.
    assert_eq!(
        r.score(StorageTier::Disk, &tokens[..3 * BLOCK_TOKENS as usize]),
        3
    );
    let mut diverged = tokens.clone();
    diverged[2 * BLOCK_TOKENS as usize + 1] ^= 1;
    assert_eq!(r.score(StorageTier::Disk, &diverged), 2);
    // G4's stored events carry the chain: every block but the first has
    // its parent.
    let parents: Vec<Option<u64>> = r
        .events
        .iter()
        .filter(|e| e.storage_tier == StorageTier::External)
        .filter_map(|e| match &e.event.data {
            KvCacheEventData::Stored(s) => Some(s.parent_hash.map(|p| p.0)),
            _ => None,
        })
        .collect();
    assert_eq!(parents.iter().filter(|p| p.is_none()).count(), 1);

    // Evict from G3: the router loses the Disk copies, keeps External;
    // kvtier's lookup now reports G4 for the whole prefix.
    h.evict(&keys).unwrap();
    r.pump_until(&cli, "6 Disk removals", |r| {
        r.count(StorageTier::Disk, false) == 6
    });
    let l = h.lookup(&keys);
    assert_eq!(l.prefix_len(), 6);
    assert!(l.tiers.iter().all(|t| *t == Tier::G4), "{:?}", l.tiers);
    assert_eq!(r.score(StorageTier::Disk, &tokens), 0);
    assert_eq!(r.score(StorageTier::External, &tokens), 6);

    // Onboard: fetched from G4 and promoted into G3, announced again with
    // the routing facts from the block headers.
    let mut bufs: Vec<Vec<u8>> = (0..6).map(|_| vec![0u8; 4096]).collect();
    let mut rb: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = h.onboard_into(&keys, &mut rb);
    assert!(got.iter().all(|g| matches!(g, Onboarded::Hit { .. })));
    r.pump_until(&cli, "6 Disk stores after promotion", |r| {
        r.count(StorageTier::Disk, true) == 12
    });
    let t = Instant::now();
    while h.lookup(&keys).tiers.iter().any(|t| *t != Tier::G3) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "promotion did not finish"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(r.score(StorageTier::Disk, &tokens), 6);
    drop(cli);
    drop(client);

    // Restart with a G4 TTL: the sweeper deletes the G4 copies and says so
    // (Removed, External). Event ids keep increasing across the restart.
    let cfg = d.dir.path().join("ttl.toml");
    std::fs::write(
        &cfg,
        "[g4]\nttl_ms = 1\nsweep_interval_ms = 200\nsweep_min_age_ms = 0\n",
    )
    .unwrap();
    let args = vec![
        "--dynamo-worker-id".to_string(),
        worker.clone(),
        "--config".into(),
        cfg.display().to_string(),
    ];
    d.restart_with(&args);
    let cli = EventsCli::start(&d.socket);
    r.pump_until(&cli, "6 External removals by the sweeper", |r| {
        r.count(StorageTier::External, false) >= 6
    });
    assert_eq!(r.score(StorageTier::External, &tokens), 0);
    let client = Client::connect(&d.socket).unwrap();
    let h = client.namespace(&ns);
    let l = h.lookup(&keys);
    assert_eq!(l.prefix_len(), 6);
    assert_eq!(r.score(StorageTier::Disk, &tokens), 6);

    // Extend the chain after the restart: the new blocks hang under the
    // old ones in Dynamo's tree (their stored event names the parent).
    let longer: Vec<u32> = tokens
        .iter()
        .copied()
        .chain((0..2 * BLOCK_TOKENS).map(|t| t + 9000))
        .collect();
    let more = payloads(8, 5);
    let refs: Vec<&[u8]> = more.iter().map(|p| &p[..]).collect();
    let (all_keys, out) = h.offload_tokens(None, &longer, &refs, Hints::default());
    assert_eq!(
        out.iter()
            .filter(|o| **o == kvtier_client::OffloadOutcome::Stored)
            .count(),
        2,
        "the first 6 are already present"
    );
    r.pump_until(&cli, "2 more Disk stores", |r| {
        r.count(StorageTier::Disk, true) == 14
    });
    assert_eq!(h.lookup(&all_keys).prefix_len(), 8);
    assert_eq!(r.score(StorageTier::Disk, &longer), 8);
}

/// Issue 27: a chain offloaded in parts (`offload_tokens` with the last key
/// of the part before as parent) is one chain to Dynamo. Dynamo's own
/// request-side hashing of the whole token list is the judge: the keys
/// kvtier stored and announced are Dynamo's sequence hashes, every stored
/// event names its block's true parent, Dynamo's tree scores the whole
/// request, and kvtier's lookup by Dynamo's keys finds every block.
#[test]
fn a_chain_offloaded_in_parts_has_dynamos_keys() {
    use dynamo_kv_router::protocols::{
        compute_block_hash_for_seq, compute_seq_hash_for_block, BlockHashOptions,
    };
    // Dynamo's request-side sequence hashes of a whole token list.
    let dynamo_seq = |tokens: &[u32]| -> Vec<u64> {
        compute_seq_hash_for_block(&compute_block_hash_for_seq(
            tokens,
            BLOCK_TOKENS,
            BlockHashOptions {
                cache_namespace: Some(SALT),
                lora_name: Some(LORA),
                ..Default::default()
            },
        ))
    };
    let worker = WORKER.to_string();
    let d = Daemon::start(&["--dynamo-worker-id", &worker]);
    let ns = namespace();
    let cli = EventsCli::start(&d.socket);
    let client = Client::connect(&d.socket).unwrap();
    let h = client.namespace(&ns);
    let mut r = Router::new();
    let bt = BLOCK_TOKENS as usize;
    // Three requests, each split its own way (block counts per part).
    let splits: [&[usize]; 3] = [&[2, 2], &[1, 3, 1, 2], &[4, 1]];
    let mut stored_blocks = 0usize;
    let mut chains: Vec<Vec<u64>> = Vec::new();
    for (s, split) in splits.iter().enumerate() {
        let n: usize = split.iter().sum();
        let tokens: Vec<u32> = (0..(n * bt) as u32)
            .map(|t| 60_000 + t + 1000 * s as u32)
            .collect();
        let want = dynamo_seq(&tokens);
        chains.push(want.clone());
        let data = payloads(n, s as u8 + 1);
        let mut parent = None;
        let mut at = 0usize;
        let mut keys = Vec::new();
        for part in split.iter() {
            let refs: Vec<&[u8]> = data[at..at + part].iter().map(|p| &p[..]).collect();
            let (k, out) = h.offload_tokens(
                parent,
                &tokens[at * bt..(at + part) * bt],
                &refs,
                Hints::default(),
            );
            assert!(
                out.iter()
                    .all(|o| *o == kvtier_client::OffloadOutcome::Stored),
                "{out:?}"
            );
            parent = k.last().copied();
            keys.extend(k);
            at += part;
        }
        let got: Vec<u64> = keys.iter().map(|k| k.as_u64().unwrap()).collect();
        assert_eq!(got, want, "split {split:?}: kvtier's keys are not Dynamo's");
        stored_blocks += n;
        r.pump_until(&cli, "the parts' Disk stores", |r| {
            r.count(StorageTier::Disk, true) == stored_blocks
        });
        assert_eq!(
            r.score(StorageTier::Disk, &tokens),
            n as u32,
            "split {split:?}"
        );
        let dynamo_keys: Vec<kvtier_client::BlockKey> = want
            .iter()
            .map(|&v| kvtier_client::BlockKey::from_u64(v))
            .collect();
        assert_eq!(h.lookup(&dynamo_keys).prefix_len(), n, "split {split:?}");
    }
    // Every announced block's parent is the block before it in its chain.
    let mut parent_of: HashMap<u64, Option<u64>> = HashMap::new();
    for e in r
        .events
        .iter()
        .filter(|e| e.storage_tier == StorageTier::Disk)
    {
        if let KvCacheEventData::Stored(st) = &e.event.data {
            let mut p = st.parent_hash.map(|p| p.0);
            for b in &st.blocks {
                parent_of.insert(b.block_hash.0, p);
                p = Some(b.block_hash.0);
            }
        }
    }
    for (want, split) in chains.iter().zip(splits) {
        for (i, k) in want.iter().enumerate() {
            let expect = (i > 0).then(|| want[i - 1]);
            assert_eq!(parent_of.get(k), Some(&expect), "split {split:?} block {i}");
        }
    }
}
