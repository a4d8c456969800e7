#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Holdings digests between two real nodes on 127.0.0.1 (issue #18): node
//! B learns what node A holds from A's digest (`GET /v1/holdings`,
//! refreshed every `holdings_refresh_ms`), so B's lookup answers "Peer"
//! with no probe reaching A; a block A deleted since its digest is a miss
//! at fetch (counted as a false positive), never an error; a block nobody
//! has is confirmed by one probe round and reported nowhere.

use kvtier_client::{AlignedBuf, BlockHeader, BlockKey, Hints, KvLayout, Namespace, Tier};
use kvtier_daemon::base::backend::Backend;
use kvtier_daemon::base::tier::{Lookup, MissReason};
use kvtier_daemon::node::{Node, NodeConfig, PeerSetup};
use kvtier_daemon::tiers::g3::G3Config;
use kvtier_daemon::tiers::peer::holdings::HoldingsDigest;
use kvtier_daemon::tiers::peer::{PeerClient, PeerClientConfig, PeerConfig, PeerInfo, PeerMiss};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK: u64 = 64 << 10;
const SECRET: &[u8] = b"holdings-secret-0123456789";
const REFRESH_MS: u64 = 200;

fn ns() -> Namespace {
    Namespace::new(
        "holdings",
        KvLayout::with_block_bytes(BLOCK).unwrap(),
        "",
        "t",
    )
    .unwrap()
}

fn block(i: u64) -> (BlockHeader, Vec<u8>) {
    let payload: Vec<u8> = (0..BLOCK).map(|j| (j * 7 + i * 13) as u8).collect();
    let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(0x4_0000 + i), &payload, 1);
    (h, payload)
}

fn open(id: &str, peers: Vec<PeerInfo>, dir: &std::path::Path) -> Arc<Node> {
    let mut c = NodeConfig::new(G3Config::new(dir.join("g3"), 64 << 20));
    c.peer = Some(PeerSetup {
        cfg: PeerConfig {
            enabled: true,
            bind: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            peers,
            discovery: false,
            secret_file: Some("/nonexistent/peer.secret".into()),
            holdings_refresh_ms: REFRESH_MS,
            ..Default::default()
        },
        node_id: id.into(),
        secret: SECRET.to_vec(),
        corrupt_responses_for_tests: false,
    });
    Node::open(c).unwrap()
}

fn peer_figures(n: &Node) -> kvtier_daemon::tiers::peer::PeerMetricsSnapshot {
    n.figures().peer.unwrap()
}

#[test]
fn lookups_answer_from_the_peers_digest_and_stale_entries_miss_at_fetch() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = open("a", vec![], da.path());
    let a_addr = a.peer_addr().unwrap().to_string();
    let b = open(
        "b",
        vec![PeerInfo::new("a", a_addr.clone()).unwrap()],
        db.path(),
    );
    let id = ns().id();
    // 8 blocks B will onboard, one A deletes after publishing it.
    let blocks: Vec<_> = (0..9).map(block).collect();
    for (h, p) in &blocks {
        a.offload(&id, h, p, None, Hints::default()).unwrap();
    }
    let chain: Vec<BlockKey> = blocks[..8].iter().map(|(h, _)| h.key).collect();
    let gone = blocks[8].0.key;

    // Two refreshes after the writes: the second fetched a digest A built
    // after them (A caches a build for half a period).
    let r0 = peer_figures(&b).holdings_refreshed;
    let t = Instant::now();
    while peer_figures(&b).holdings_refreshed < r0 + 2 {
        assert!(t.elapsed() < Duration::from_secs(20), "B never refreshed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let fb = peer_figures(&b);
    assert_eq!(fb.holdings_peers, 1, "{fb:?}");
    // 9 blocks at 10 bits each, in 64-bit words, plus 64 bytes of framing.
    assert_eq!(fb.holdings_bytes, 64 + 16, "{fb:?}");
    assert!(fb.holdings_age_ms_max < 3 * REFRESH_MS + 1000, "{fb:?}");

    // The lookup says Peer for all 8 without a single probe reaching A.
    let probes_at_a = a.figures().peer_served.unwrap().probes;
    assert_eq!(b.lookup(&id, &chain).unwrap(), vec![Tier::Peer; 8]);
    assert_eq!(a.figures().peer_served.unwrap().probes, probes_at_a);
    let fb = peer_figures(&b);
    assert_eq!(fb.lookup_probes, 0, "{fb:?}");
    assert!(fb.lookup_digest_held >= 8, "{fb:?}");

    // And the onboard fetches them (verified) from A.
    let mut buf = AlignedBuf::rounded((BLOCK + 8192) as usize).unwrap();
    for (h, p) in &blocks[..8] {
        match b.read_into(&id, &h.key, buf.as_mut_slice()).unwrap() {
            Lookup::Hit((gh, tier)) => {
                assert_eq!(tier, Tier::Peer);
                assert_eq!(gh.key, h.key);
                assert_eq!(&buf.as_slice()[4096..4096 + p.len()], &p[..]);
            }
            other => panic!("{other:?}"),
        }
    }

    // A deletes a block its last digest listed: B's lookup still says
    // Peer (the digest is a hint), the fetch is a clean miss.
    a.evict(&id, &gone).unwrap();
    assert_eq!(b.lookup(&id, &[gone]).unwrap(), vec![Tier::Peer]);
    match b.read_into(&id, &gone, buf.as_mut_slice()).unwrap() {
        Lookup::Miss(MissReason::Absent) => {}
        other => panic!("a block A deleted: {other:?}"),
    }
    assert_eq!(peer_figures(&b).holdings_false_positives, 1);
    assert_eq!(a.figures().peer_served.unwrap().probes, probes_at_a);

    // A block nobody holds: the digest says no, one probe confirms it
    // (holdings_probe_negatives), the lookup reports nothing.
    let nobody = block(99).0.key;
    assert_eq!(b.lookup(&id, &[nobody]).unwrap(), vec![]);
    let fb = peer_figures(&b);
    assert_eq!(fb.lookup_probes, 1, "{fb:?}");
    assert!(fb.lookup_digest_not_held >= 1, "{fb:?}");
    assert_eq!(a.figures().peer_served.unwrap().probes, probes_at_a + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_digest_needs_the_secret_and_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let a = tokio::task::spawn_blocking({
        let p = dir.path().to_path_buf();
        move || open("a", vec![], &p)
    })
    .await
    .unwrap();
    let (h, p) = block(1);
    let a2 = a.clone();
    tokio::task::spawn_blocking(move || a2.offload(&ns().id(), &h, &p, None, Hints::default()))
        .await
        .unwrap()
        .unwrap();
    let addr = a.peer_addr().unwrap().to_string();
    let deadline = || Instant::now() + Duration::from_secs(5);
    let good = PeerClient::new(PeerClientConfig::new(SECRET)).unwrap();
    let d: HoldingsDigest = good.holdings(&addr, 4 << 20, deadline()).await.unwrap();
    assert!(d.may_hold(&ns().id(), &block(1).0.key));
    assert_eq!(d.blocks(), 1);
    // The wrong secret gets nothing (401, and no proof to believe).
    let bad =
        PeerClient::new(PeerClientConfig::new(b"another-secret-0123456789".to_vec())).unwrap();
    assert_eq!(
        bad.holdings(&addr, 4 << 20, deadline()).await,
        Err(PeerMiss::Unavailable)
    );
    // A bound below the digest's size refuses it instead of buffering it.
    assert_eq!(d.encoded_bytes(), 64 + 8);
    assert!(good.holdings(&addr, 50, deadline()).await.is_err());
    tokio::task::spawn_blocking(move || drop(a)).await.unwrap();
}
