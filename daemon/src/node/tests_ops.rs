//! Deletion across tiers, daemon-side verify with repair, and the G4
//! sweeper's effect on G3's `in_g4` marks: a real G3 in a temp dir over a
//! `memory://` G4.

use super::*;
use crate::base::backend::{Backend, EvictOutcome, VerifyOutcome};
use crate::base::tier::Lookup;
use kvtier_client::events::{KvEvent, KvEventData, StorageTier};
use kvtier_client::proto::EvictTier;
use kvtier_client::{BlockHeader, Hints, KvLayout, Namespace};

const BLOCK: u64 = 16 << 10;

fn ns() -> Namespace {
    Namespace::new(
        "node-ops-unit",
        KvLayout::with_block_bytes(BLOCK).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn block(i: u64) -> (BlockHeader, Vec<u8>) {
    let payload: Vec<u8> = (0..BLOCK).map(|j| (j * 5 + i * 11) as u8).collect();
    let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(500 + i), &payload, 1);
    (h, payload)
}

fn node_with(dir: &std::path::Path, tweak: impl FnOnce(&mut G4Config)) -> Arc<Node> {
    let mut c = NodeConfig::new(G3Config::new(dir.join("g3"), 64 << 20));
    let mut g = G4Config::new("memory://");
    tweak(&mut g);
    c.g4 = Some(g);
    c.fetch_deadline_ms = 5_000;
    Node::open(c).unwrap()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn in_g4(n: &Node, key: &BlockKey) -> bool {
    n.g3().stat(&ns().id(), key).is_some_and(|i| i.in_g4)
}

fn g4_has(n: &Node, key: &BlockKey) -> bool {
    let (g4, id, k) = (n.g4().unwrap().clone(), ns().id(), *key);
    n.run_async(async move { g4.contains_async(&id, &k).await })
        .unwrap()
        .unwrap()
}

fn offload_uploaded(n: &Node, i: u64) -> (BlockHeader, Vec<u8>) {
    let (h, p) = block(i);
    n.offload(&ns().id(), &h, &p, None, Hints::default())
        .unwrap();
    wait_until("never marked in G4", || in_g4(n, &h.key));
    (h, p)
}

fn removed(evs: &[Arc<KvEvent>], tier: StorageTier, key: &BlockKey) -> bool {
    evs.iter().any(|e| {
        e.storage_tier == tier
            && matches!(&e.data, KvEventData::Removed { block_hashes } if block_hashes.contains(key))
    })
}

fn corrupt(n: &Node, key: &BlockKey) {
    use std::os::unix::fs::FileExt;
    let (p, at) = n.g3().block_location(&ns().id(), key).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at + 4096 + 3).unwrap();
    b[0] ^= 0x40;
    f.write_all_at(&b, at + 4096 + 3).unwrap();
}

#[test]
fn evict_by_tier_removes_where_asked_and_announces_each_tier() {
    let dir = tempfile::tempdir().unwrap();
    let n = node_with(dir.path(), |_| {});
    let bus = EventBus::new();
    let sub = bus.subscribe().unwrap();
    n.attach_events(bus);
    let id = ns().id();
    let (h0, _) = offload_uploaded(&n, 0);
    let (h1, _) = offload_uploaded(&n, 1);
    let (h2, _) = offload_uploaded(&n, 2);

    // G4 only: G3 keeps its copy, no longer marked safe in G4.
    assert_eq!(
        n.evict_tier(&id, &h0.key, EvictTier::G4).unwrap(),
        EvictOutcome::Evicted
    );
    assert!(n.g3().stat(&id, &h0.key).is_some() && !in_g4(&n, &h0.key));
    assert!(!g4_has(&n, &h0.key));
    // Everywhere: gone from both, a later read is a miss.
    assert_eq!(
        n.evict_tier(&id, &h1.key, EvictTier::All).unwrap(),
        EvictOutcome::Evicted
    );
    assert!(n.g3().stat(&id, &h1.key).is_none() && !g4_has(&n, &h1.key));
    assert_eq!(n.lookup(&id, &[h1.key]).unwrap(), vec![]);
    // Absent everywhere now.
    assert_eq!(
        n.evict_tier(&id, &h1.key, EvictTier::All).unwrap(),
        EvictOutcome::Absent
    );
    // Pinned: refused as a whole, G4 untouched.
    assert!(matches!(
        n.pin(&id, &h2.key, 60_000).unwrap(),
        Lookup::Hit(())
    ));
    assert_eq!(
        n.evict_tier(&id, &h2.key, EvictTier::All).unwrap(),
        EvictOutcome::Busy
    );
    assert!(g4_has(&n, &h2.key) && n.g3().stat(&id, &h2.key).is_some());
    // stat says until when (it said u64::MAX, "forever", for every pin).
    let until = n.stat(&id, &h2.key).unwrap().unwrap().pinned_until_unix_ms;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        (now_ms + 58_000..=now_ms + 62_000).contains(&until),
        "pinned until {until}, now {now_ms}"
    );
    // G3 (the default): G4 keeps it and serves the lookup.
    assert!(n.unpin(&id, &h2.key).unwrap());
    assert_eq!(
        n.evict_tier(&id, &h2.key, EvictTier::G3).unwrap(),
        EvictOutcome::Evicted
    );
    assert_eq!(n.lookup(&id, &[h2.key]).unwrap(), vec![Tier::G4]);

    let evs: Vec<Arc<KvEvent>> = sub.rx.try_iter().collect();
    assert!(removed(&evs, StorageTier::External, &h0.key), "{evs:?}");
    assert!(!removed(&evs, StorageTier::Disk, &h0.key), "{evs:?}");
    assert!(removed(&evs, StorageTier::Disk, &h1.key), "{evs:?}");
    assert!(removed(&evs, StorageTier::External, &h1.key), "{evs:?}");
    assert!(removed(&evs, StorageTier::Disk, &h2.key), "{evs:?}");
    assert!(!removed(&evs, StorageTier::External, &h2.key), "{evs:?}");
}

#[test]
fn verify_repairs_a_bad_g3_copy_from_g4_and_drops_one_without_a_good_copy() {
    let dir = tempfile::tempdir().unwrap();
    let n = node_with(dir.path(), |_| {});
    let id = ns().id();
    let (h0, p0) = offload_uploaded(&n, 0);
    let (h1, _) = offload_uploaded(&n, 1);
    assert_eq!(n.verify(&id, &h0.key, true).unwrap(), VerifyOutcome::Ok);

    // Bad on G3, good in G4: quarantined and replaced, served from G3.
    corrupt(&n, &h0.key);
    assert_eq!(
        n.verify(&id, &h0.key, true).unwrap(),
        VerifyOutcome::Repaired(Tier::G4)
    );
    assert!(n.g3().stat(&id, &h0.key).is_some());
    assert_eq!(n.verify(&id, &h0.key, true).unwrap(), VerifyOutcome::Ok);
    let mut buf = vec![0u8; (BLOCK + 8192) as usize];
    match n.read_into(&id, &h0.key, &mut buf).unwrap() {
        Lookup::Hit((h, tier)) => {
            assert_eq!((h.key, tier), (h0.key, Tier::G3));
            assert!(buf[4096..4096 + BLOCK as usize] == p0[..], "bytes differ");
        }
        Lookup::Miss(r) => panic!("{r:?}"),
    }

    // Bad on G3, no copy elsewhere: dropped; no lookup reports it.
    assert_eq!(
        n.evict_tier(&id, &h1.key, EvictTier::G4).unwrap(),
        EvictOutcome::Evicted
    );
    corrupt(&n, &h1.key);
    assert_eq!(
        n.verify(&id, &h1.key, true).unwrap(),
        VerifyOutcome::Dropped
    );
    assert_eq!(n.lookup(&id, &[h1.key]).unwrap(), vec![]);
    assert_eq!(n.verify(&id, &h1.key, true).unwrap(), VerifyOutcome::Absent);
    assert_eq!(n.stats().quarantined, 2);
}

#[test]
fn a_g4_sweep_clears_the_in_g4_marks_of_what_it_deleted() {
    let dir = tempfile::tempdir().unwrap();
    // Capacity 0, no grace: a sweep deletes every object; the background
    // sweeper waits an hour between passes (the test sweeps by hand).
    let n = node_with(dir.path(), |g| {
        g.capacity_bytes = Some(0);
        g.sweep_min_age_ms = 0;
        g.sweep_interval_ms = 3_600_000;
    });
    let id = ns().id();
    let (h0, _) = offload_uploaded(&n, 0);
    assert!(n.g3_headers(&id, 10)[0].1, "announced as in G4");
    let rep = n.g4().unwrap().sweep_once().unwrap();
    assert_eq!(rep.deleted, 1);
    wait_until("in_g4 not cleared after the sweep", || !in_g4(&n, &h0.key));
    // What a start-up announcement would say: on disk, not in G4.
    let heads = n.g3_headers(&id, 10);
    assert_eq!(heads.len(), 1);
    assert!(!heads[0].1, "an External copy that is gone");
}

#[test]
fn an_onboard_of_a_corrupt_g3_copy_is_served_from_g4_not_missed() {
    let dir = tempfile::tempdir().unwrap();
    let n = node_with(dir.path(), |_| {});
    let id = ns().id();
    let (h0, p0) = offload_uploaded(&n, 0);
    corrupt(&n, &h0.key);
    // The read finds the bad copy (quarantined), and the same request gets
    // G4's verified copy instead of a Corrupt miss.
    let mut buf = vec![0u8; (BLOCK + 8192) as usize];
    match n.read_into(&id, &h0.key, &mut buf).unwrap() {
        Lookup::Hit((h, tier)) => {
            assert_eq!((h.key, tier), (h0.key, Tier::G4));
            assert!(buf[4096..4096 + BLOCK as usize] == p0[..], "bytes differ");
        }
        Lookup::Miss(r) => panic!("{r:?}"),
    }
    assert_eq!(n.stats().quarantined, 1);
    // Promoted back: the next read is a G3 hit.
    assert!(n.wait_promotions(Duration::from_secs(5)));
    assert!(n.g3().stat(&id, &h0.key).is_some(), "never promoted back");
    match n.read_into(&id, &h0.key, &mut buf).unwrap() {
        Lookup::Hit((_, tier)) => assert_eq!(tier, Tier::G3),
        Lookup::Miss(r) => panic!("{r:?}"),
    }
}

/// Issue 28: the background scrub finds a G3 copy corrupted at rest (no
/// client reads it) and repairs it from G4; it counts no hit.
#[test]
fn the_scrub_repairs_a_copy_corrupted_at_rest_from_g4() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = NodeConfig::new(G3Config::new(dir.path().join("g3"), 64 << 20));
    c.g4 = Some(G4Config::new("memory://"));
    c.fetch_deadline_ms = 5_000;
    c.scrub = ScrubLimits {
        bytes_per_s: 64 << 20,
        pause_ms: 50,
    };
    let n = Node::open(c).unwrap();
    let id = ns().id();
    let (h0, p0) = offload_uploaded(&n, 0);
    let (h1, _) = offload_uploaded(&n, 1);
    let hits = n.g3().stats().hits;
    corrupt(&n, &h0.key);
    let t = Instant::now();
    while n.scrub_figures().repaired < 1 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{:?}",
            n.scrub_figures()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let f = n.scrub_figures();
    assert_eq!((f.corrupt, f.repaired), (1, 1), "{f:?}");
    assert_eq!(n.g3().stats().hits, hits, "the scrub counted hits");
    let mut buf = vec![0u8; (BLOCK + 8192) as usize];
    match n.read_into(&id, &h0.key, &mut buf).unwrap() {
        Lookup::Hit((h, tier)) => {
            assert_eq!((h.key, tier), (h0.key, Tier::G3));
            assert!(buf[4096..4096 + BLOCK as usize] == p0[..], "bytes differ");
        }
        Lookup::Miss(r) => panic!("{r:?}"),
    }
    assert!(n.g3().stat(&id, &h1.key).is_some());
}

/// Issue 28: with G4 write-through on (admission `all`), the node's G3
/// eviction takes blocks already safe in G4 before one that is not, and a
/// block evicted before its upload is counted
/// (`kvtier_g3_evicted_before_upload_total`), never silent.
#[test]
fn eviction_prefers_uploaded_blocks_and_counts_one_evicted_before_its_upload() {
    let dir = tempfile::tempdir().unwrap();
    let file = BLOCK + 4096;
    let mut g3 = G3Config::new(dir.path().join("g3"), 4 * file);
    // No recycle pool: capacity is exactly 4 block files.
    g3.recycle_pool_bytes = 0;
    let mut c = NodeConfig::new(g3);
    c.g4 = Some(G4Config::new("memory://"));
    c.fetch_deadline_ms = 5_000;
    let n = Node::open(c).unwrap();
    // Only the writes' own eviction runs (no background pass between).
    n.g3().pause_background_eviction(true);
    let id = ns().id();
    let before_upload = |n: &Node| -> u64 {
        let f: std::collections::HashMap<_, _> = n.g3().recovery_figures().into_iter().collect();
        f["evicted_before_upload"]
    };
    let hs: Vec<BlockHeader> = (0..4).map(|i| offload_uploaded(&n, i).0).collect();
    // Block 0, the oldest, is no longer safe in G4 (deleted there only).
    assert_eq!(
        n.evict_tier(&id, &hs[0].key, EvictTier::G4).unwrap(),
        EvictOutcome::Evicted
    );
    assert!(!in_g4(&n, &hs[0].key));
    // Three more blocks into the full tier: each takes an uploaded one.
    for i in 4..7 {
        offload_uploaded(&n, i);
        assert!(
            n.g3().stat(&id, &hs[0].key).is_some(),
            "block 0 (not in G4) evicted before uploaded ones (offload {i})"
        );
    }
    assert_eq!(before_upload(&n), 0);
    // Nothing held is in G4 any more: the next eviction takes a block G4
    // has no copy of, and counts it.
    for i in 4..7 {
        let k = block(i).0.key;
        if n.g3().stat(&id, &k).is_some() {
            n.evict_tier(&id, &k, EvictTier::G4).unwrap();
        }
    }
    let (h7, p7) = block(7);
    n.offload(&id, &h7, &p7, None, Hints::default()).unwrap();
    assert_eq!(before_upload(&n), 1);
    assert!(n.g3().stat(&id, &h7.key).is_some());
}
