//! Node over real G3 (temp dir), a `memory://` G4 and in-process peers on
//! loopback. The cross-process suites are in tests/e2e_node.rs.

use super::*;
use crate::base::backend::{Backend, EvictOutcome};
use crate::base::tier::Lookup;
use crate::tiers::peer::PeerInfo;
use kvtier_client::events::{KvEvent, KvEventData, StorageTier};
use kvtier_client::{BlockHeader, Hints, KvLayout, Namespace};

const BLOCK: u64 = 16 << 10;

fn ns() -> Namespace {
    Namespace::new(
        "node-unit",
        KvLayout::with_block_bytes(BLOCK).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn block(i: u64) -> (BlockHeader, Vec<u8>) {
    let payload: Vec<u8> = (0..BLOCK).map(|j| (j * 7 + i * 13) as u8).collect();
    let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(100 + i), &payload, 1);
    (h, payload)
}

fn node(dir: &std::path::Path, g4: bool, peer: Option<PeerSetup>) -> Arc<Node> {
    let mut c = NodeConfig::new(G3Config::new(dir.join("g3"), 64 << 20));
    if g4 {
        c.g4 = Some(G4Config::new("memory://"));
    }
    c.peer = peer;
    c.fetch_deadline_ms = 5_000;
    Node::open(c).unwrap()
}

fn read(n: &Node, key: &BlockKey) -> Lookup<(BlockHeader, Tier, Vec<u8>)> {
    let mut buf = vec![0u8; (BLOCK + 8192) as usize];
    match n.read_into(&ns().id(), key, &mut buf).unwrap() {
        Lookup::Hit((h, t)) => {
            let payload = buf[4096..4096 + h.payload_len as usize].to_vec();
            Lookup::Hit((h, t, payload))
        }
        Lookup::Miss(r) => Lookup::Miss(r),
    }
}

fn wait_in_g4(n: &Node, key: &BlockKey) {
    let t = Instant::now();
    while !n.g3().stat(&ns().id(), key).is_some_and(|i| i.in_g4) {
        assert!(t.elapsed() < Duration::from_secs(5), "never marked in G4");
        std::thread::sleep(Duration::from_millis(10));
    }
}

const SECRET: &[u8] = b"unit-peer-secret-0123456789";

fn peer_setup(id: &str, peers: Vec<PeerInfo>) -> PeerSetup {
    PeerSetup {
        cfg: crate::tiers::peer::PeerConfig {
            enabled: true,
            bind: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            peers,
            discovery: false,
            // Validation wants the file named; the secret itself is passed.
            secret_file: Some("/nonexistent/peer.secret".into()),
            ..Default::default()
        },
        node_id: id.into(),
        secret: SECRET.to_vec(),
        corrupt_responses_for_tests: false,
    }
}

/// Node A (no peers) and node B (A as its static peer), both on the G4 at
/// `g4_url` when given; `tweak` adjusts B's config.
fn peer_pair(
    da: &std::path::Path,
    db: &std::path::Path,
    g4_url: Option<&str>,
    tweak: impl Fn(&mut NodeConfig),
) -> (Arc<Node>, Arc<Node>) {
    peer_pair_tweaked(da, db, g4_url, &|_| {}, tweak)
}

/// [`peer_pair`] with A's config tweaked too.
fn peer_pair_tweaked(
    da: &std::path::Path,
    db: &std::path::Path,
    g4_url: Option<&str>,
    tweak_a: &dyn Fn(&mut NodeConfig),
    tweak: impl Fn(&mut NodeConfig),
) -> (Arc<Node>, Arc<Node>) {
    let open = |dir: &std::path::Path, peer: PeerSetup, tweak: &dyn Fn(&mut NodeConfig)| {
        let mut c = NodeConfig::new(G3Config::new(dir.join("g3"), 64 << 20));
        c.g4 = g4_url.map(G4Config::new);
        c.peer = Some(peer);
        c.fetch_deadline_ms = 5_000;
        tweak(&mut c);
        Node::open(c).unwrap()
    };
    let a = open(da, peer_setup("a", vec![]), tweak_a);
    let a_addr = a.peer_addr().unwrap().to_string();
    let b = open(
        db,
        peer_setup("b", vec![PeerInfo::new("a", a_addr).unwrap()]),
        &tweak,
    );
    (a, b)
}

#[test]
fn write_through_then_fall_through_from_g4() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), true, None);
    let bus = EventBus::new();
    let sub = bus.subscribe().unwrap();
    n.attach_events(bus);
    let id = ns().id();
    let (h0, p0) = block(0);
    let (h1, p1) = block(1);
    let eph = Hints {
        ephemeral: true,
        ..Hints::default()
    };
    n.offload(&id, &h0, &p0, None, Hints::default()).unwrap();
    n.offload(&id, &h1, &p1, Some(h0.key), eph).unwrap();
    assert!(n.g4().unwrap().flush(Duration::from_secs(5)));
    wait_in_g4(&n, &h0.key);
    assert!(
        !n.g3().stat(&id, &h1.key).unwrap().in_g4,
        "ephemeral uploaded"
    );

    // Disk events for both stores, External for the upload (published just
    // after the mark, from another thread: wait for it).
    let mut evs: Vec<Arc<KvEvent>> = Vec::new();
    let t = Instant::now();
    while !evs.iter().any(|e| e.storage_tier == StorageTier::External) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no External event: {evs:?}"
        );
        evs.extend(sub.rx.recv_timeout(Duration::from_millis(50)).ok());
    }
    // Any duplicate would follow at once (a re-queued upload of the block).
    std::thread::sleep(Duration::from_millis(200));
    evs.extend(sub.rx.try_iter());
    let disk = evs
        .iter()
        .filter(|e| e.storage_tier == StorageTier::Disk)
        .count();
    let external: Vec<_> = evs
        .iter()
        .filter(|e| e.storage_tier == StorageTier::External)
        .collect();
    assert_eq!(disk, 2, "{evs:?}");
    assert_eq!(external.len(), 1, "{evs:?}");
    assert!(
        matches!(&external[0].data, KvEventData::Stored { blocks, .. } if blocks[0].block_hash == h0.key && blocks[0].payload_len == BLOCK)
    );

    // Evicted locally: the lookup sees G4, the read falls through verified.
    // The child went with its parent (no lookup reaches it without it).
    assert_eq!(n.evict(&id, &h0.key).unwrap(), EvictOutcome::Evicted);
    assert_eq!(n.evict(&id, &h1.key).unwrap(), EvictOutcome::Absent);
    assert_eq!(n.lookup(&id, &[h0.key, h1.key]).unwrap(), vec![Tier::G4]);
    match read(&n, &h0.key) {
        Lookup::Hit((h, t, p)) => {
            assert_eq!(t, Tier::G4);
            assert_eq!(h.key, h0.key);
            assert_eq!(p, p0);
        }
        Lookup::Miss(r) => panic!("{r:?}"),
    }
    // Promoted (in the background): now a G3 hit, and never uploaded again.
    assert_eq!(n.lookup(&id, &[h0.key]).unwrap(), vec![Tier::G3]);
    assert!(matches!(read(&n, &h0.key), Lookup::Hit((_, Tier::G3, _))));
    assert!(n.wait_promotions(Duration::from_secs(5)));
    assert!(n.g3().stat(&id, &h0.key).unwrap().in_g4);
    // The ephemeral block never reached G4: a miss, not wrong bytes.
    assert!(matches!(read(&n, &h1.key), Lookup::Miss(_)));
    assert_eq!(n.figures().promoted_from_g4.count, 1);
}

#[test]
fn a_lease_promotes_and_protects() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), true, None);
    let id = ns().id();
    let (h, p) = block(5);
    n.offload(&id, &h, &p, None, Hints::default()).unwrap();
    assert!(n.g4().unwrap().flush(Duration::from_secs(5)));
    wait_in_g4(&n, &h.key);
    n.evict(&id, &h.key).unwrap();
    let Lookup::Hit(lease) = n.lease(&id, &h.key, 10_000).unwrap() else {
        panic!("lease after eviction should fall through to G4");
    };
    assert_ne!(lease, 0);
    assert_eq!(n.evict(&id, &h.key).unwrap(), EvictOutcome::Busy);
    assert!(n.release(lease));
    assert_eq!(n.evict(&id, &h.key).unwrap(), EvictOutcome::Evicted);
}

#[test]
fn peer_lookup_and_fetch_in_process() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = peer_pair(da.path(), db.path(), None, |_| {});
    let id = ns().id();
    let (h, p) = block(9);
    let (absent, _) = block(10);
    a.offload(&id, &h, &p, None, Hints::default()).unwrap();
    assert_eq!(
        b.lookup(&id, &[h.key, absent.key]).unwrap(),
        vec![Tier::Peer]
    );
    match read(&b, &h.key) {
        Lookup::Hit((_, t, got)) => {
            assert_eq!(t, Tier::Peer);
            assert_eq!(got, p);
        }
        Lookup::Miss(r) => panic!("{r:?}"),
    }
    assert_eq!(b.lookup(&id, &[h.key]).unwrap(), vec![Tier::G3]);
    assert!(b.wait_promotions(Duration::from_secs(5)));
    let f = b.figures();
    assert_eq!(f.promoted_from_peer.count, 1);
    assert_eq!(f.peer.unwrap().hits, 1);
    assert!(matches!(read(&b, &absent.key), Lookup::Miss(_)));
}

#[test]
fn peers_found_through_g4_heartbeats() {
    let shared = tempfile::tempdir().unwrap();
    let url = format!("file://{}", shared.path().display());
    let secret = b"unit-peer-secret-0123456789".to_vec();
    let open = |dir: &std::path::Path, id: &str| {
        let mut c = NodeConfig::new(G3Config::new(dir.join("g3"), 64 << 20));
        c.g4 = Some(G4Config::new(url.clone()));
        c.peer = Some(PeerSetup {
            cfg: crate::tiers::peer::PeerConfig {
                enabled: true,
                bind: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                discovery: true,
                secret_file: Some("/nonexistent/peer.secret".into()),
                ..Default::default()
            },
            node_id: id.into(),
            secret: secret.clone(),
            corrupt_responses_for_tests: false,
        });
        Node::open(c).unwrap()
    };
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = open(da.path(), "a");
    // B reads the heartbeats at start: A is there, with no static list.
    let b = open(db.path(), "b");
    let id = ns().id();
    let (h, p) = block(11);
    // Ephemeral: never in G4, so only the peer can deliver it.
    let eph = Hints {
        ephemeral: true,
        ..Hints::default()
    };
    a.offload(&id, &h, &p, None, eph).unwrap();
    assert_eq!(b.lookup(&id, &[h.key]).unwrap(), vec![Tier::Peer]);
    match read(&b, &h.key) {
        Lookup::Hit((_, t, got)) => {
            assert_eq!(t, Tier::Peer);
            assert_eq!(got, p);
        }
        Lookup::Miss(r) => panic!("{r:?}"),
    }
}

#[test]
fn a_read_is_served_while_its_promotion_is_deferred() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = peer_pair(da.path(), db.path(), None, |_| {});
    let bus = EventBus::new();
    let sub = bus.subscribe().unwrap();
    b.attach_events(bus);
    let id = ns().id();
    let (h, p) = block(20);
    a.offload(&id, &h, &p, None, Hints::default()).unwrap();
    b.staging.pause(true);
    match read(&b, &h.key) {
        Lookup::Hit((got, t, bytes)) => {
            assert_eq!(t, Tier::Peer);
            assert_eq!(got.key, h.key);
            assert_eq!(bytes, p);
        }
        Lookup::Miss(r) => panic!("{r:?}"),
    }
    // Answered before the G3 write: not on G3, no Stored event yet, but
    // local for lookups and reads.
    assert!(b.g3().stat(&id, &h.key).is_none());
    assert_eq!(sub.rx.try_iter().count(), 0);
    assert_eq!(b.lookup(&id, &[h.key]).unwrap(), vec![Tier::G3]);
    assert!(matches!(read(&b, &h.key), Lookup::Hit((_, Tier::G3, ref x)) if *x == p));
    assert_eq!(
        b.figures().peer.unwrap().hits,
        1,
        "the second read refetched"
    );
    assert!(!b.wait_promotions(Duration::from_millis(50)));
    // Released: the block lands on G3 (the normal durable path), the
    // Stored event follows, and G3 serves it verified.
    b.staging.pause(false);
    assert!(b.wait_promotions(Duration::from_secs(5)));
    let info = b.g3().stat(&id, &h.key).expect("promoted into G3");
    assert_eq!(info.payload_sum, h.payload_sum);
    let evs: Vec<_> = sub.rx.try_iter().collect();
    assert!(
        evs.iter().any(|e| e.storage_tier == StorageTier::Disk
            && matches!(&e.data, KvEventData::Stored { blocks, .. } if blocks[0].block_hash == h.key)),
        "{evs:?}"
    );
    let mut buf = vec![0u8; (BLOCK + 8192) as usize];
    assert!(matches!(
        b.g3().read_into(&id, &h.key, &mut buf).unwrap(),
        Lookup::Hit(_)
    ));
    assert!(buf[4096..4096 + BLOCK as usize] == p[..]);
    let f = b.figures().promoted_from_peer;
    assert_eq!((f.count, f.skipped), (1, 0));
}

#[test]
fn a_full_promotion_queue_skips_the_promotion_not_the_read() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = peer_pair(da.path(), db.path(), None, |c| c.promote_queue_max = 1);
    let id = ns().id();
    let (h1, p1) = block(21);
    let (h2, p2) = block(22);
    a.offload(&id, &h1, &p1, None, Hints::default()).unwrap();
    a.offload(&id, &h2, &p2, None, Hints::default()).unwrap();
    b.staging.pause(true);
    // The first fills the queue; the second finds it full and is still
    // served, byte-identical.
    assert!(matches!(read(&b, &h1.key), Lookup::Hit((_, Tier::Peer, ref x)) if *x == p1));
    assert!(matches!(read(&b, &h2.key), Lookup::Hit((_, Tier::Peer, ref x)) if *x == p2));
    b.staging.pause(false);
    assert!(b.wait_promotions(Duration::from_secs(5)));
    assert!(b.g3().stat(&id, &h1.key).is_some());
    assert!(
        b.g3().stat(&id, &h2.key).is_none(),
        "promoted past a full queue"
    );
    let f = b.figures().promoted_from_peer;
    assert_eq!((f.count, f.skipped), (1, 1));
    // Not kept anywhere: the next read fetches it again.
    assert!(matches!(read(&b, &h2.key), Lookup::Hit((_, Tier::Peer, ref x)) if *x == p2));
}

#[test]
fn evicting_a_staged_block_cancels_its_promotion() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = peer_pair(da.path(), db.path(), None, |_| {});
    let id = ns().id();
    let (h, p) = block(23);
    a.offload(&id, &h, &p, None, Hints::default()).unwrap();
    b.staging.pause(true);
    assert!(matches!(read(&b, &h.key), Lookup::Hit((_, Tier::Peer, _))));
    assert_eq!(b.evict(&id, &h.key).unwrap(), EvictOutcome::Evicted);
    b.staging.pause(false);
    assert!(b.wait_promotions(Duration::from_secs(5)));
    assert!(b.g3().stat(&id, &h.key).is_none());
    assert!(matches!(read(&b, &h.key), Lookup::Hit((_, Tier::Peer, _))));
}

#[test]
fn a_batched_onboard_fetches_concurrently_and_falls_back_per_block() {
    let shared = tempfile::tempdir().unwrap();
    let url = format!("file://{}", shared.path().display());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Files on A: A serves a rotted file as it is (a slotted block is
    // verified before any peer gets it), so B's own check is tested.
    let files = |c: &mut NodeConfig| c.g3.slot_file_bytes_max = 0;
    let (a, b) = peer_pair_tweaked(da.path(), db.path(), Some(&url), &files, |c| {
        // A lying peer is normally skipped for a while; here every block
        // asks it, so that exactly one block sees corrupt bytes.
        if let Some(p) = c.peer.as_mut() {
            p.cfg.corrupt_quarantine_ms = 0;
        }
    });
    let id = ns().id();
    let blocks: Vec<_> = (30..34).map(block).collect();
    for (h, p) in &blocks {
        a.offload(&id, h, p, None, Hints::default()).unwrap();
    }
    assert!(a.g4().unwrap().flush(Duration::from_secs(10)));
    for (h, _) in &blocks {
        wait_in_g4(&a, &h.key);
    }
    // A's copy of block 2 goes bad on disk after its upload: A serves the
    // file as it is, B must reject it and take G4's copy.
    let bad = da
        .path()
        .join("g3/blocks")
        .join(kvtier_client::block_path(&id, &blocks[2].0.key));
    let mut bytes = std::fs::read(&bad).unwrap();
    bytes[4096 + 10] ^= 0xff;
    std::fs::write(&bad, &bytes).unwrap();

    let keys: Vec<BlockKey> = blocks.iter().map(|(h, _)| h.key).collect();
    let known = b.prepare_onboard(&id, &keys);
    assert_eq!(known, vec![None; 4]);
    // Promoted before they are read: the reads still report the tier that
    // delivered each block.
    assert!(b.wait_promotions(Duration::from_secs(5)));
    let mut tiers = Vec::new();
    for (h, p) in &blocks {
        match read(&b, &h.key) {
            Lookup::Hit((_, t, got)) => {
                assert!(got == *p, "block {:?} differs", h.key);
                tiers.push(t);
            }
            Lookup::Miss(r) => panic!("{r:?}"),
        }
    }
    assert_eq!(tiers, vec![Tier::Peer, Tier::Peer, Tier::G4, Tier::Peer]);
    // Fetched once each, by the batch step: the reads did not fetch again.
    let m = b.figures().peer.unwrap();
    assert_eq!((m.hits, m.corrupt), (3, 1));
    assert!(b.wait_promotions(Duration::from_secs(5)));
    for (h, _) in &blocks {
        assert!(b.g3().stat(&id, &h.key).is_some());
    }
    assert!(b.g3().stat(&id, &blocks[2].0.key).unwrap().in_g4);
    // A block nobody has is reported missing by the batch step itself.
    let (absent, _) = block(40);
    let known = b.prepare_onboard(&id, &[absent.key, BlockKey::from_u64(999)]);
    assert!(known.iter().all(|k| k.is_some()), "{known:?}");
}

#[test]
fn a_batch_past_a_full_queue_is_held_for_its_reads_only() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = peer_pair(da.path(), db.path(), None, |c| c.promote_queue_max = 0);
    let id = ns().id();
    let blocks: Vec<_> = (50..53).map(block).collect();
    for (h, p) in &blocks {
        a.offload(&id, h, p, None, Hints::default()).unwrap();
    }
    let keys: Vec<BlockKey> = blocks.iter().map(|(h, _)| h.key).collect();
    assert_eq!(b.prepare_onboard(&id, &keys), vec![None; 3]);
    for (h, p) in &blocks {
        assert!(matches!(read(&b, &h.key), Lookup::Hit((_, Tier::Peer, ref x)) if x == p));
    }
    // Served from what the batch fetched (no second fetch), never promoted,
    // and not kept after its read.
    assert_eq!(b.figures().peer.unwrap().hits, 3);
    assert!(b.wait_promotions(Duration::from_secs(5)));
    let f = b.figures().promoted_from_peer;
    assert_eq!((f.count, f.skipped), (0, 3));
    for k in &keys {
        assert!(b.g3().stat(&id, k).is_none());
        assert!(!b.staging.contains(&id, k));
    }
}

#[test]
fn promotions_yield_to_fetches_in_flight() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = peer_pair(da.path(), db.path(), None, |_| {});
    let id = ns().id();
    let (h, p) = block(60);
    a.offload(&id, &h, &p, None, Hints::default()).unwrap();
    // Another onboard's fetch in flight: the promotion waits (up to 1 s).
    let busy = b.activity.fetching();
    assert!(matches!(read(&b, &h.key), Lookup::Hit((_, Tier::Peer, ref x)) if *x == p));
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        b.g3().stat(&id, &h.key).is_none(),
        "promoted during a fetch"
    );
    drop(busy);
    assert!(b.wait_promotions(Duration::from_secs(5)));
    assert!(b.g3().stat(&id, &h.key).is_some());
}

/// A blake3 chain's headers name no parent, and uploads finish in any
/// order: the External stores still come parent first, each with the
/// parent its offload gave (issue #27).
#[test]
fn external_stores_of_a_blake3_chain_come_in_order_with_their_parents() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), true, None);
    let bus = EventBus::new();
    let sub = bus.subscribe().unwrap();
    n.attach_events(bus);
    let id = ns().id();
    const CHAIN: u64 = 24;
    let blocks: Vec<_> = (0..CHAIN).map(block).collect();
    for (i, (h, p)) in blocks.iter().enumerate() {
        assert!(h.dynamo.is_none());
        let parent = i.checked_sub(1).map(|j| blocks[j].0.key);
        n.offload(&id, h, p, parent, Hints::default()).unwrap();
    }
    assert!(n.g4().unwrap().flush(Duration::from_secs(30)));
    let mut external = Vec::new();
    let t = Instant::now();
    while external.len() < CHAIN as usize {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "External stores: {external:?}"
        );
        if let Ok(e) = sub.rx.recv_timeout(Duration::from_millis(50)) {
            if e.storage_tier == StorageTier::External {
                if let KvEventData::Stored {
                    parent_hash,
                    blocks,
                } = &e.data
                {
                    external.push((blocks[0].block_hash, *parent_hash));
                }
            }
        }
    }
    let mut announced = std::collections::HashSet::new();
    for (key, parent) in &external {
        let i = blocks.iter().position(|(h, _)| h.key == *key).unwrap();
        let want = i.checked_sub(1).map(|j| blocks[j].0.key);
        assert_eq!(*parent, want, "block {i}'s parent: {external:?}");
        if let Some(p) = parent {
            assert!(
                announced.contains(p),
                "block {i} before its parent: {external:?}"
            );
        }
        announced.insert(*key);
    }
}
