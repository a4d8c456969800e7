#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Peer server and client over real TCP on 127.0.0.1, serving temp dirs.

use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{encode_block, BlockHeader, BlockKey, KvLayout, Namespace, NamespaceId};
use kvtier_daemon::tiers::peer::auth::{PeerKey, Target};
use kvtier_daemon::tiers::peer::wire::block_url_path;
use kvtier_daemon::tiers::peer::{
    placement, unix_ms_now, DirSource, PeerClient, PeerClientConfig, PeerFetch, PeerInfo,
    PeerLookup, PeerMiss, PeerServer, PeerServerConfig, PeerSet, PeerSetConfig, PeerSource,
};
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SECRET: &[u8] = b"test-secret-0123456789abcdef";

struct Node {
    _dir: tempfile::TempDir,
    src: Arc<DirSource>,
    server: PeerServer,
    info: PeerInfo,
}

async fn node(id: &str, tweak: impl FnOnce(&mut PeerServerConfig)) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let src = Arc::new(DirSource::new(dir.path()));
    let mut cfg = PeerServerConfig::new(SECRET);
    tweak(&mut cfg);
    let server = PeerServer::start(cfg, src.clone()).await.unwrap();
    let info = PeerInfo::new(id, server.local_addr().to_string()).unwrap();
    Node {
        _dir: dir,
        src,
        server,
        info,
    }
}

fn make_block(bytes: u64, seed: u64) -> (Namespace, BlockKey, Vec<u8>, Vec<u8>) {
    let ns = Namespace::new(
        "model",
        KvLayout::with_block_bytes(bytes).unwrap(),
        "",
        b"tenant".to_vec(),
    )
    .unwrap();
    let key = BlockKey::from_u64(seed);
    let payload: Vec<u8> = (0..bytes)
        .map(|i| (i.wrapping_mul(seed | 1) >> 3) as u8)
        .collect();
    let h = BlockHeader::for_payload(&ns, key, &payload, 42);
    let file = encode_block(&h, &payload);
    (ns, key, payload, file)
}

fn set(self_id: &str, peers: &[&PeerInfo], tweak: impl FnOnce(&mut PeerSetConfig)) -> PeerSet {
    let mut cfg = PeerSetConfig::new(self_id);
    cfg.static_peers = peers.iter().map(|p| (*p).clone()).collect();
    tweak(&mut cfg);
    PeerSet::new(cfg, PeerClient::new(PeerClientConfig::new(SECRET)).unwrap()).unwrap()
}

/// A key for which `first` ranks ahead of every other peer.
fn key_ranked_first(peers: &[PeerInfo], first: &str, ns: &NamespaceId) -> u64 {
    (1..10_000u64)
        .find(|&k| placement::rank(peers, ns, &BlockKey::from_u64(k))[0].id == first)
        .unwrap()
}

/// One raw HTTP/1.1 request; returns the status code and the body.
async fn raw(addr: &str, path: &str, headers: &[(&str, String)]) -> (u16, Vec<u8>) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let text_end = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&out[..text_end]).to_string();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, out[text_end + 4..].to_vec())
}

fn auth(
    secret: &[u8],
    to: &Target,
    path: &str,
    range: &str,
    unix_ms: u64,
) -> (&'static str, String) {
    (
        "Authorization",
        PeerKey::from_secret(secret)
            .unwrap()
            .sign("GET", path, range, to, unix_ms),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_on_a_is_fetched_by_c_byte_identical() {
    let a = node("a", |_| {}).await;
    let b = node("b", |_| {}).await;
    let (ns, key, payload, file) = make_block(3 << 20, 7);
    let on_disk = a.src.write_block(&ns.id(), &key, &file).unwrap();
    let c = set("c", &[&a.info, &b.info], |_| {});
    match c
        .fetch(&ns.id(), &key, Instant::now() + Duration::from_secs(10))
        .await
    {
        PeerLookup::Hit {
            peer,
            block,
            attempts,
        } => {
            assert_eq!(peer.id, "a");
            assert_eq!(block.payload, payload);
            assert_eq!(
                encode_block(&block.header, &block.payload),
                std::fs::read(on_disk).unwrap()
            );
            // b, if asked first, said it does not hold the block.
            for at in attempts {
                assert_eq!(
                    (at.peer_id.as_str(), at.miss),
                    ("b", Some(PeerMiss::Absent))
                );
            }
        }
        other => panic!("expected a hit, got {other:?}"),
    }
    let m = c.metrics();
    assert_eq!(m.hits, 1);
    // The connection to A is kept and reused for the next block.
    let conns = a.server.metrics().connections.load(Ordering::Relaxed);
    assert!(matches!(
        c.client()
            .fetch(
                &a.info.address,
                &ns.id(),
                &key,
                Instant::now() + Duration::from_secs(10)
            )
            .await,
        PeerFetch::Hit(_)
    ));
    assert_eq!(
        a.server.metrics().connections.load(Ordering::Relaxed),
        conns
    );
    assert_eq!(m.bytes, file.len() as u64);
    let _ = b;
    assert_eq!(m.corrupt, 0);
    // A block nobody holds is a miss, not an error.
    let absent = c
        .fetch(
            &ns.id(),
            &BlockKey::from_u64(99),
            Instant::now() + Duration::from_secs(5),
        )
        .await;
    assert!(matches!(absent, PeerLookup::Miss { .. }));
    assert_eq!(absent.tier(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_and_slow_peers_miss_within_the_deadline() {
    let a = node("a", |_| {}).await;
    let a_info = a.info.clone();
    drop(a);
    let (ns, key, _, file) = make_block(64 << 10, 3);
    let c = set("c", &[&a_info], |_| {});
    let t = Instant::now();
    let got = c
        .fetch(&ns.id(), &key, Instant::now() + Duration::from_millis(1500))
        .await;
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "took {:?}",
        t.elapsed()
    );
    match got {
        PeerLookup::Miss { attempts } => assert_eq!(attempts[0].miss, Some(PeerMiss::Unavailable)),
        other => panic!("{other:?}"),
    }
    // Marked down: the next lookup skips it without connecting.
    let again = c
        .fetch(&ns.id(), &key, Instant::now() + Duration::from_secs(1))
        .await;
    match again {
        PeerLookup::Miss { attempts } => assert_eq!(attempts[0].miss, None),
        other => panic!("{other:?}"),
    }
    assert_eq!(c.metrics().skipped, 1);

    // A slow peer: accepts TCP but never answers. It gets its per-peer
    // slice; the honest peer after it still answers within the deadline.
    let slow = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let slow_info = PeerInfo::new("slow", slow.local_addr().unwrap().to_string()).unwrap();
    let _hold = tokio::spawn(async move {
        let mut socks = Vec::new();
        while let Ok((s, _)) = slow.accept().await {
            socks.push(s);
        }
    });
    let good = node("good", |_| {}).await;
    let peers = [slow_info.clone(), good.info.clone()];
    let k = key_ranked_first(&peers, "slow", &ns.id());
    let (ns2, key2, payload2, file2) = make_block(64 << 10, k);
    assert_eq!(ns2.id(), ns.id());
    good.src.write_block(&ns2.id(), &key2, &file2).unwrap();
    let c = set("c", &[&slow_info, &good.info], |cfg| {
        cfg.per_peer_timeout_ms = 300
    });
    let t = Instant::now();
    match c
        .fetch(&ns2.id(), &key2, Instant::now() + Duration::from_secs(3))
        .await
    {
        PeerLookup::Hit {
            peer,
            block,
            attempts,
        } => {
            assert_eq!(peer.id, "good");
            assert_eq!(block.payload, payload2);
            assert_eq!(attempts[0].peer_id, "slow");
            assert_eq!(attempts[0].miss, Some(PeerMiss::Timeout));
        }
        other => panic!("{other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(c.metrics().timeout, 1);
    let _ = file;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lying_peer_is_rejected_counted_and_skipped() {
    let liar = node("liar", |c| c.corrupt_responses_for_tests = true).await;
    let honest = node("honest", |_| {}).await;
    let peers = [liar.info.clone(), honest.info.clone()];
    let ns_id = make_block(64 << 10, 1).0.id();
    let k = key_ranked_first(&peers, "liar", &ns_id);
    let (ns, key, payload, file) = make_block(64 << 10, k);
    liar.src.write_block(&ns.id(), &key, &file).unwrap();
    honest.src.write_block(&ns.id(), &key, &file).unwrap();

    let c = set("c", &[&liar.info, &honest.info], |_| {});
    match c
        .fetch(&ns.id(), &key, Instant::now() + Duration::from_secs(5))
        .await
    {
        PeerLookup::Hit {
            peer,
            block,
            attempts,
        } => {
            assert_eq!(peer.id, "honest");
            assert_eq!(block.payload, payload);
            assert_eq!(attempts.len(), 1);
            assert_eq!(attempts[0].peer_id, "liar");
            assert_eq!(attempts[0].miss, Some(PeerMiss::Corrupt));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.metrics().corrupt, 1);
    // Quarantined: skipped on the next lookup.
    match c
        .fetch(&ns.id(), &key, Instant::now() + Duration::from_secs(5))
        .await
    {
        PeerLookup::Hit { peer, attempts, .. } => {
            assert_eq!(peer.id, "honest");
            assert_eq!(attempts[0].miss, None);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.metrics().skipped, 1);

    // Only the liar holds it: a miss, never its bytes.
    let only = set("c", &[&liar.info], |_| {});
    match only
        .fetch(&ns.id(), &key, Instant::now() + Duration::from_secs(5))
        .await
    {
        PeerLookup::Miss { attempts } => assert_eq!(attempts[0].miss, Some(PeerMiss::Corrupt)),
        other => panic!("{other:?}"),
    }
    // The plain client agrees.
    let client = PeerClient::new(PeerClientConfig::new(SECRET)).unwrap();
    let addr = liar.info.address.clone();
    assert!(matches!(
        client
            .fetch(
                &addr,
                &ns.id(),
                &key,
                Instant::now() + Duration::from_secs(5)
            )
            .await,
        PeerFetch::Miss(PeerMiss::Corrupt)
    ));
    assert_eq!(client.metrics().snapshot().corrupt, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_wrong_secret_and_stale_requests_get_401() {
    let a = node("a", |_| {}).await;
    let (ns, key, _, file) = make_block(64 << 10, 5);
    a.src.write_block(&ns.id(), &key, &file).unwrap();
    let addr = a.info.address.clone();
    let path = block_url_path(&ns.id(), &key);
    let now = unix_ms_now();

    assert_eq!(raw(&addr, &path, &[]).await.0, 401);
    let wrong = auth(
        b"another-secret-0123456789",
        &a.server.target(),
        &path,
        "",
        now,
    );
    assert_eq!(raw(&addr, &path, &[wrong]).await.0, 401);
    let stale = auth(SECRET, &a.server.target(), &path, "", now - 120_000);
    assert_eq!(raw(&addr, &path, &[stale]).await.0, 401);
    let future = auth(SECRET, &a.server.target(), &path, "", now + 120_000);
    assert_eq!(raw(&addr, &path, &[future]).await.0, 401);
    // Signed for another block: refused for this one.
    let other = auth(
        SECRET,
        &a.server.target(),
        &block_url_path(&ns.id(), &BlockKey::from_u64(6)),
        "",
        now,
    );
    assert_eq!(raw(&addr, &path, &[other]).await.0, 401);
    // Signed without a range, replayed with one: refused.
    let no_range = auth(SECRET, &a.server.target(), &path, "", now);
    assert_eq!(
        raw(&addr, &path, &[no_range, ("Range", "bytes=0-9".into())])
            .await
            .0,
        401
    );
    // A client with the wrong secret sees a miss.
    let bad =
        PeerClient::new(PeerClientConfig::new(b"another-secret-0123456789".to_vec())).unwrap();
    assert!(matches!(
        bad.fetch(
            &addr,
            &ns.id(),
            &key,
            Instant::now() + Duration::from_secs(5)
        )
        .await,
        PeerFetch::Miss(PeerMiss::Unavailable)
    ));
    assert_eq!(a.server.metrics().unauthorized.load(Ordering::Relaxed), 7);

    // Correctly signed: whole file, then a range.
    let (st, body) = raw(
        &addr,
        &path,
        &[auth(SECRET, &a.server.target(), &path, "", now)],
    )
    .await;
    assert_eq!((st, body.len()), (200, file.len()));
    assert_eq!(body, file);
    let range = "bytes=4090-4105";
    let (st, body) = raw(
        &addr,
        &path,
        &[
            auth(SECRET, &a.server.target(), &path, range, now),
            ("Range", range.into()),
        ],
    )
    .await;
    assert_eq!(st, 206);
    assert_eq!(body, &file[4090..4106]);
    let past = format!("bytes={}-", file.len());
    let (st, _) = raw(
        &addr,
        &path,
        &[
            auth(SECRET, &a.server.target(), &path, &past, now),
            ("Range", past.clone()),
        ],
    )
    .await;
    assert_eq!(st, 416);
}

/// Counts every call that reaches the store.
struct Counting {
    inner: DirSource,
    opens: AtomicU64,
}
impl PeerSource for Counting {
    fn open_block(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
    ) -> kvtier_daemon::Result<Option<(File, u64)>> {
        self.opens.fetch_add(1, Ordering::Relaxed);
        self.inner.open_block(ns, key)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_paths_are_refused_without_touching_the_store() {
    let dir = tempfile::tempdir().unwrap();
    // A secret file next to the block root that traversal would reach.
    std::fs::write(dir.path().join("secret.txt"), b"do not serve").unwrap();
    let root = dir.path().join("blocks");
    std::fs::create_dir(&root).unwrap();
    let src = Arc::new(Counting {
        inner: DirSource::new(&root),
        opens: AtomicU64::new(0),
    });
    let server = PeerServer::start(PeerServerConfig::new(SECRET), src.clone())
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let nsx = NamespaceId([0x11; 16]).to_hex();
    let now = unix_ms_now();
    let hostile = [
        ("/", 404),
        ("/secret.txt", 404),
        ("/etc/passwd", 404),
        ("/v1/blocks/../secret.txt", 400),
        ("/v1/blocks/../../etc/passwd", 400),
        (&format!("/v1/blocks/{nsx}/../../secret.txt") as &str, 400),
        (&format!("/v1/blocks/{nsx}/%2e%2e%2fsecret"), 400),
        (&format!("/v1/blocks/{nsx}/ABCDEF"), 400),
        (&format!("/v1/blocks/{nsx}/abc"), 400),
        (&format!("/v1/blocks/{nsx}/ab/cd"), 400),
        (&format!("/v1/blocks/{nsx}/{}", "0".repeat(130)), 400),
        (&format!("/v1/blocks/{}/abcd", &nsx[..31]), 400),
        (&format!("/v1/blocks/{nsx}/abcd?x=1"), 400),
    ];
    for (path, want) in hostile {
        // Unsigned: 401 before the path is even looked at.
        assert_eq!(raw(&addr, path, &[]).await.0, 401, "{path}");
        let sign_path = path.split('?').next().unwrap();
        let (st, body) = raw(
            &addr,
            path,
            &[auth(SECRET, &server.target(), sign_path, "", now)],
        )
        .await;
        assert_eq!(st, want, "{path}");
        assert!(!body.windows(6).any(|w| w == b"do not"), "{path}");
    }
    assert_eq!(src.opens.load(Ordering::Relaxed), 0);
    // Other methods are refused too.
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(format!("PUT /v1/blocks/{nsx}/abcd HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    assert!(
        out.starts_with(b"HTTP/1.1 405"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    // A well-formed signed request for an absent block does reach the store.
    let p = format!("/v1/blocks/{nsx}/abcd");
    assert_eq!(
        raw(&addr, &p, &[auth(SECRET, &server.target(), &p, "", now)])
            .await
            .0,
        404
    );
    assert_eq!(src.opens.load(Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_limit_answers_503_at_once() {
    let a = node("a", |c| {
        c.transfers_max = 1;
        c.chunk_bytes = 64 << 10;
    })
    .await;
    let (ns, key, payload, file) = make_block(32 << 20, 11);
    a.src.write_block(&ns.id(), &key, &file).unwrap();
    let addr = a.info.address.clone();
    let path = block_url_path(&ns.id(), &key);
    // Start a transfer and do not read its body: it holds the only permit.
    let mut hog = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (k, v) = auth(SECRET, &a.server.target(), &path, "", unix_ms_now());
    hog.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{k}: {v}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut first = [0u8; 12];
    hog.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");

    let t = Instant::now();
    let (st, _) = raw(
        &addr,
        &path,
        &[auth(SECRET, &a.server.target(), &path, "", unix_ms_now())],
    )
    .await;
    assert_eq!(st, 503);
    assert!(t.elapsed() < Duration::from_secs(1));
    let client = PeerClient::new(PeerClientConfig::new(SECRET)).unwrap();
    assert!(matches!(
        client
            .fetch(
                &addr,
                &ns.id(),
                &key,
                Instant::now() + Duration::from_secs(5)
            )
            .await,
        PeerFetch::Miss(PeerMiss::Unavailable)
    ));
    assert_eq!(a.server.metrics().busy.load(Ordering::Relaxed), 2);
    // Releasing the hog frees the permit.
    drop(hog);
    let t = Instant::now();
    loop {
        match client
            .fetch(
                &addr,
                &ns.id(),
                &key,
                Instant::now() + Duration::from_secs(10),
            )
            .await
        {
            PeerFetch::Hit(b) => {
                assert_eq!(b.payload.len(), payload.len());
                assert!(b.payload == payload);
                break;
            }
            PeerFetch::Miss(m) => {
                assert_eq!(m, PeerMiss::Unavailable);
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "permit never released"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let _ = HEADER_BYTES;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_helpers_measure_both_paths() {
    let dir = tempfile::tempdir().unwrap();
    let r = kvtier_daemon::tiers::peer::bench::loopback_compare(dir.path(), 4, 256 << 10, 2)
        .await
        .unwrap();
    assert_eq!(r.rounds, 2);
    assert_eq!(r.bytes_per_round, 4 * (256 << 10) + 4 * HEADER_BYTES as u64);
    assert!(r.peer_gbps > 0.0 && r.raw_gbps > 0.0, "{r:?}");
}

#[tokio::test]
async fn server_binds_loopback_by_default_and_checks_config() {
    let cfg = PeerServerConfig::new(SECRET);
    assert!(cfg.bind.ip().is_loopback());
    assert!(!cfg.corrupt_responses_for_tests);
    assert!(!format!("{cfg:?}").contains("test-secret"));
    let short = PeerServerConfig::new(b"short".to_vec());
    assert!(
        PeerServer::start(short, Arc::new(DirSource::new("/nonexistent")))
            .await
            .is_err()
    );
    let mut zero = PeerServerConfig::new(SECRET);
    zero.transfers_max = 0;
    assert!(
        PeerServer::start(zero, Arc::new(DirSource::new("/nonexistent")))
            .await
            .is_err()
    );
}

/// Not a test: prints an in-process loopback measurement for
/// docs/BENCHMARKS.md. `cargo test -p kvtier-daemon --test peer_fetch --
/// --ignored --nocapture loopback_figures`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn loopback_figures() {
    let dir = tempfile::tempdir().unwrap();
    let n: usize = std::env::var("PEER_BENCH_BLOCKS").map_or(64, |v| v.parse().unwrap());
    let r = kvtier_daemon::tiers::peer::bench::loopback_compare(dir.path(), n, 2 << 20, 7)
        .await
        .unwrap();
    println!(
        "{{\"peer_gbps\":{:.3},\"raw_tcp_gbps\":{:.3},\"peer_gbps_vs_baseline\":{:.3},\"bytes_per_round\":{},\"rounds\":{}}}",
        r.peer_gbps,
        r.raw_gbps,
        r.peer_gbps / r.raw_gbps,
        r.bytes_per_round,
        r.rounds
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_closed_by_the_server_are_replaced() {
    let a = node("a", |c| c.header_read_timeout_ms = 200).await;
    let (ns, key, payload, file) = make_block(64 << 10, 21);
    a.src.write_block(&ns.id(), &key, &file).unwrap();
    let client = PeerClient::new(PeerClientConfig::new(SECRET)).unwrap();
    for round in 0..3 {
        match client
            .fetch(
                &a.info.address,
                &ns.id(),
                &key,
                Instant::now() + Duration::from_secs(5),
            )
            .await
        {
            PeerFetch::Hit(b) => assert_eq!(b.payload, payload, "round {round}"),
            other => panic!("round {round}: {other:?}"),
        }
        // Longer than the server's idle limit: the pooled connection dies.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(client.metrics().snapshot().unavailable, 0);
    assert_eq!(a.server.metrics().connections.load(Ordering::Relaxed), 3);
}

// ---------------------------------------------------------------------------
// The node's fall-through under faults (issue #15, item 2): a real node B
// whose lookup and onboard fall through to peer A (a real node's peer
// server) behind the fault proxy, then to G4 (the real test S3 server)
// behind another fault proxy. Hung, slow, cut mid-transfer, lying,
// truncated and oversized peers; G4 good, absent, hung, cut or lying.
// Every answer comes within the deadline, is a miss or the verified block
// (never wrong bytes), and memory stays bounded.

mod fall_through {
    use kvtier_client::{AlignedBuf, BlockHeader, BlockKey, Hints, KvLayout, Namespace, Tier};
    use kvtier_daemon::base::backend::Backend;
    use kvtier_daemon::base::tier::{BlockTier, Lookup};
    use kvtier_daemon::node::{Node, NodeConfig, PeerSetup};
    use kvtier_daemon::testkit::fault_proxy::{Fault, FaultProxy, FaultRule};
    use kvtier_daemon::testkit::s3::S3Server;
    use kvtier_daemon::tiers::g3::G3Config;
    use kvtier_daemon::tiers::g4::{G4Config, G4Store};
    use kvtier_daemon::tiers::peer::{PeerConfig, PeerInfo};
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::{Duration, Instant};

    const BLOCK: u64 = 64 << 10;
    const SECRET: &[u8] = b"fall-through-secret-0123456789";
    /// B's deadlines.
    const FETCH_MS: u64 = 1_500;
    const LOOKUP_MS: u64 = 300;
    const PER_PEER_MS: u64 = 400;
    const G4_RESPONSE_MS: u64 = 300;
    /// Scheduling slack on a loaded 2-core machine.
    const SLACK_MS: u64 = 1_000;

    fn ns() -> Namespace {
        Namespace::new(
            "fall-through",
            KvLayout::with_block_bytes(BLOCK).unwrap(),
            "",
            "t",
        )
        .unwrap()
    }

    fn block(i: u64) -> (BlockHeader, Vec<u8>) {
        let payload: Vec<u8> = (0..BLOCK).map(|j| (j * 11 + i * 5) as u8).collect();
        let h = BlockHeader::for_payload(&ns(), BlockKey::from_u64(0xf000 + i), &payload, 1);
        (h, payload)
    }

    fn peer_setup(id: &str, peers: Vec<PeerInfo>) -> PeerSetup {
        PeerSetup {
            cfg: PeerConfig {
                enabled: true,
                bind: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                peers,
                discovery: false,
                secret_file: Some("/nonexistent/peer.secret".into()),
                per_peer_timeout_ms: PER_PEER_MS,
                connect_timeout_ms: 200,
                ..Default::default()
            },
            node_id: id.into(),
            secret: SECRET.to_vec(),
            corrupt_responses_for_tests: false,
        }
    }

    fn g4_through(server: &S3Server, endpoint: &str) -> G4Config {
        G4Config {
            endpoint: Some(endpoint.to_string()),
            response_timeout_ms: G4_RESPONSE_MS,
            body_idle_timeout_ms: G4_RESPONSE_MS,
            connect_timeout_ms: G4_RESPONSE_MS,
            request_timeout_ms: FETCH_MS,
            retry_backoff_ms: 10,
            retry_backoff_max_ms: 50,
            startup_check_timeout_ms: 1_000,
            ..server.g4_config("fall-through")
        }
    }

    fn vm_hwm_kib() -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        s.lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap()
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum G4Has {
        /// The good copy, served faithfully.
        Good,
        /// Not there.
        Absent,
        /// There, behind this fault on every GET and HEAD.
        Faulted(&'static str),
    }

    struct Case {
        name: &'static str,
        peer: Option<Fault>,
        g4: G4Has,
        g4_fault: Option<Fault>,
        /// Keys onboarded together (a batched onboard when > 1).
        blocks: u64,
    }

    #[test]
    fn node_falls_through_faulty_peers_and_g4_to_a_verified_copy_or_a_miss_in_time() {
        let Some(server) = S3Server::start("kvtier-fall-through").unwrap() else {
            eprintln!(
                "SKIP node_falls_through_...: weed (SeaweedFS) not installed (scripts/setup.sh)"
            );
            return;
        };
        let direct = G4Store::open(server.g4_config("fall-through")).unwrap();
        let g4_proxy = FaultProxy::start(&server.endpoint()).unwrap();
        // A: holds every block in G3 and serves it to peers.
        let da = tempfile::tempdir().unwrap();
        let mut ca = NodeConfig::new(G3Config::new(da.path().join("g3"), 64 << 20));
        ca.peer = Some(peer_setup("a", vec![]));
        let a = Node::open(ca).unwrap();
        let peer_proxy = FaultProxy::start(&format!("http://{}", a.peer_addr().unwrap())).unwrap();
        let peer_addr = peer_proxy
            .endpoint()
            .trim_start_matches("http://")
            .to_string();
        // A peer that is gone: a port nothing listens on.
        let dead_addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let id = ns().id();
        let gib3 = 3u64 << 30;
        let cases = [
            Case {
                name: "hung peer, good G4",
                peer: Some(Fault::NoAnswer),
                g4: G4Has::Good,
                g4_fault: None,
                blocks: 1,
            },
            Case {
                name: "slow peer, good G4",
                peer: Some(Fault::SlowBody {
                    chunk_bytes: 1024,
                    delay_ms: 200,
                }),
                g4: G4Has::Good,
                g4_fault: None,
                blocks: 1,
            },
            Case {
                name: "peer cut mid-transfer, good G4",
                peer: Some(Fault::CutAfter { bytes: 6000 }),
                g4: G4Has::Good,
                g4_fault: None,
                blocks: 1,
            },
            Case {
                name: "lying peer, good G4, batched",
                peer: Some(Fault::WrongBytes { offset: 4096 + 100 }),
                g4: G4Has::Good,
                g4_fault: None,
                blocks: 3,
            },
            Case {
                name: "dead peer, good G4",
                peer: None,
                g4: G4Has::Good,
                g4_fault: None,
                blocks: 1,
            },
            Case {
                name: "oversized peer (3 GiB), G4 absent",
                peer: Some(Fault::Oversized {
                    bytes: gib3,
                    content_length: true,
                }),
                g4: G4Has::Absent,
                g4_fault: None,
                blocks: 1,
            },
            Case {
                name: "oversized chunked peer, G4 absent",
                peer: Some(Fault::Oversized {
                    bytes: gib3,
                    content_length: false,
                }),
                g4: G4Has::Absent,
                g4_fault: None,
                blocks: 1,
            },
            Case {
                name: "truncated peer, hung G4",
                peer: Some(Fault::Truncate {
                    keep_bytes: 6000,
                    content_length: false,
                }),
                g4: G4Has::Faulted("hung"),
                g4_fault: Some(Fault::NoAnswer),
                blocks: 1,
            },
            Case {
                name: "lying peer, lying G4 (changing ETag)",
                peer: Some(Fault::WrongBytes { offset: 4096 + 7 }),
                g4: G4Has::Faulted("lying"),
                g4_fault: Some(Fault::WrongBytes { offset: 4096 + 7 }),
                blocks: 2,
            },
            Case {
                name: "peer cut, G4 cut mid-GET",
                peer: Some(Fault::CutAfter { bytes: 6000 }),
                g4: G4Has::Faulted("cut"),
                g4_fault: Some(Fault::CutAfter { bytes: 5000 }),
                blocks: 1,
            },
        ];
        let mut failures = Vec::new();
        let mut seed = 0u64;
        for case in &cases {
            let keys: Vec<(BlockHeader, Vec<u8>)> = (0..case.blocks)
                .map(|_| {
                    seed += 1;
                    block(seed)
                })
                .collect();
            for (h, p) in &keys {
                a.offload(&id, h, p, None, Hints::default()).unwrap();
                if case.g4 != G4Has::Absent {
                    direct.put(&id, h, p).unwrap();
                }
            }
            match &case.peer {
                Some(f) => peer_proxy.set(FaultRule::new(f.clone())),
                None => peer_proxy.clear(),
            }
            match &case.g4_fault {
                Some(f) => g4_proxy.set(FaultRule::new(f.clone()).with_changing_etag()),
                None => g4_proxy.clear(),
            }
            let peer_sent_before = peer_proxy.counters().body_bytes_sent.load(SeqCst);
            let peer_faulted_before = peer_proxy.counters().faulted.load(SeqCst);
            let g4_faulted_before = g4_proxy.counters().faulted.load(SeqCst);
            // A fresh B per case: no peer marked down or quarantined by
            // the case before.
            let db = tempfile::tempdir().unwrap();
            let mut cb = NodeConfig::new(G3Config::new(db.path().join("g3"), 64 << 20));
            let to = if case.peer.is_none() {
                &dead_addr
            } else {
                &peer_addr
            };
            cb.peer = Some(peer_setup(
                "b",
                vec![PeerInfo::new("a", to.clone()).unwrap()],
            ));
            cb.g4 = Some(g4_through(&server, &g4_proxy.endpoint()));
            cb.fetch_deadline_ms = FETCH_MS;
            cb.lookup_remote_deadline_ms = LOOKUP_MS;
            let b = Node::open(cb).unwrap();
            let hwm0 = vm_hwm_kib();
            let r = run_case(&b, case, &keys);
            let grew_mib = vm_hwm_kib().saturating_sub(hwm0) >> 10;
            let sent_mib =
                (peer_proxy.counters().body_bytes_sent.load(SeqCst) - peer_sent_before) >> 20;
            let r = r.and_then(|()| {
                // The faults really struck (else the case proves nothing).
                if case.peer.is_some()
                    && peer_proxy.counters().faulted.load(SeqCst) == peer_faulted_before
                {
                    return Err("no request reached the faulty peer".into());
                }
                if case.g4_fault.is_some()
                    && g4_proxy.counters().faulted.load(SeqCst) == g4_faulted_before
                {
                    return Err("no request reached the faulty G4".into());
                }
                if grew_mib >= 256 {
                    return Err(format!("peak memory grew {grew_mib} MiB"));
                }
                if sent_mib >= 64 {
                    return Err(format!("{sent_mib} MiB taken from the peer"));
                }
                // A lying or failing read never deletes the shared copy.
                for (h, _) in &keys {
                    if case.g4 != G4Has::Absent && !direct.contains(&id, &h.key).unwrap() {
                        return Err("the G4 object was deleted".into());
                    }
                }
                Ok(())
            });
            let pm = b.figures().peer.unwrap_or_default();
            eprintln!(
                "fall-through case '{}': {:?} (peak +{grew_mib} MiB; peer fetches {} corrupt {} timeout {} unavailable {})",
                case.name, r, pm.fetches, pm.corrupt, pm.timeout, pm.unavailable
            );
            if let Err(e) = r {
                failures.push(format!("{}: {e}", case.name));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
        drop(a);
    }

    /// Runs `f` on a thread and waits at most `bound` (a hang is reported,
    /// not waited out; the thread is left behind).
    fn within<T: Send + 'static>(
        bound: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<(T, Duration), String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = Instant::now();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(bound)
            .map(|v| (v, t.elapsed()))
            .map_err(|_| format!("no answer within {bound:?} (hung)"))
    }

    /// The mount's fall-through under faults (issue #15): B's FUSE mount
    /// (the node's fetch, import and evict hooks, as kvtierd wires it)
    /// opening blocks only peer A holds, A behind the fault proxy, G4
    /// holding the good copy or nothing. Each open answers within the
    /// fetch deadline with the exact block (G4's copy) or ENOENT/EIO,
    /// never wrong bytes; an import (`write` of a block file) of a name
    /// only the hung peer holds completes in time; after each fault the
    /// mount still serves a local block and lists its directory.
    #[test]
    fn mount_open_and_import_fall_through_faulty_peers_in_time() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !std::path::Path::new("/dev/fuse").exists() {
            eprintln!("SKIP mount_open_and_import_...: needs root and /dev/fuse");
            return;
        }
        let Some(server) = S3Server::start("kvtier-mount-fall-through").unwrap() else {
            eprintln!(
                "SKIP mount_open_and_import_...: weed (SeaweedFS) not installed (scripts/setup.sh)"
            );
            return;
        };
        let direct = G4Store::open(server.g4_config("fall-through")).unwrap();
        let da = tempfile::tempdir().unwrap();
        let mut ca = NodeConfig::new(G3Config::new(da.path().join("g3"), 64 << 20));
        ca.peer = Some(peer_setup("a", vec![]));
        let a = Node::open(ca).unwrap();
        let peer_proxy = FaultProxy::start(&format!("http://{}", a.peer_addr().unwrap())).unwrap();
        let peer_addr = peer_proxy
            .endpoint()
            .trim_start_matches("http://")
            .to_string();
        let id = ns().id();
        // (name, peer fault, G4 holds the good copy)
        let cases: [(&str, Fault, bool); 6] = [
            ("hung peer, G4 absent", Fault::NoAnswer, false),
            ("hung peer, good G4", Fault::NoAnswer, true),
            (
                "slow peer, G4 absent",
                Fault::SlowBody {
                    chunk_bytes: 1024,
                    delay_ms: 200,
                },
                false,
            ),
            (
                "peer dying mid-transfer, good G4",
                Fault::CutAfter { bytes: 6000 },
                true,
            ),
            (
                "lying peer, G4 absent",
                Fault::WrongBytes { offset: 4096 + 100 },
                false,
            ),
            (
                "lying peer, good G4",
                Fault::WrongBytes { offset: 4096 + 9 },
                true,
            ),
        ];
        let bound = Duration::from_millis(FETCH_MS + SLACK_MS);
        let mut failures = Vec::new();
        for (n, (name, fault, g4_good)) in cases.iter().enumerate() {
            let seed = 100 + 10 * n as u64;
            let (h, p) = block(seed);
            let (hi, pi) = block(seed + 1);
            let (hl, pl) = block(seed + 2);
            for (h, p) in [(&h, &p), (&hi, &pi)] {
                a.offload(&id, h, p, None, Hints::default()).unwrap();
            }
            if *g4_good {
                direct.put(&id, &h, &p).unwrap();
            }
            peer_proxy.set(FaultRule::new(fault.clone()));
            let faulted_before = peer_proxy.counters().faulted.load(SeqCst);
            let db = tempfile::tempdir().unwrap();
            let mut cb = NodeConfig::new(G3Config::new(db.path().join("g3"), 64 << 20));
            cb.peer = Some(peer_setup(
                "b",
                vec![PeerInfo::new("a", peer_addr.clone()).unwrap()],
            ));
            cb.g4 = Some(g4_through(&server, &server.endpoint()));
            cb.fetch_deadline_ms = FETCH_MS;
            cb.lookup_remote_deadline_ms = LOOKUP_MS;
            let b = Node::open(cb).unwrap();
            // A block B holds itself: the mount must keep serving it.
            b.offload(&id, &hl, &pl, None, Hints::default()).unwrap();
            let mnt = db.path().join("mnt");
            let section = kvtier_daemon::edges::mount::MountSection {
                dir: mnt.clone(),
                passthrough: kvtier_daemon::edges::mount::PassthroughMode::Off,
                verify_on_open: true,
                ..Default::default()
            };
            let hooks = kvtier_daemon::edges::mount::MountHooks {
                fetch: Some(b.fetch_hook()),
                import: Some(b.import_hook(std::sync::Arc::new(|_: &BlockHeader| {}))),
                evict: Some(b.evict_hook()),
            };
            let mount = kvtier_daemon::edges::mount::start_with_hooks(
                &section,
                b.g3().clone(),
                hooks,
                std::sync::Arc::new(kvtier_daemon::edges::access::Policy::open()),
            )
            .unwrap();
            let path = |k: &BlockKey| mnt.join(kvtier_client::block_path(&id, k));
            let want = kvtier_client::encode_block(&h, &p);
            let r = (|| -> Result<String, String> {
                let pth = path(&h.key);
                let (got, took) =
                    within(bound + Duration::from_secs(5), move || std::fs::read(pth))?;
                if took > bound {
                    return Err(format!("open+read took {took:?} (bound {bound:?})"));
                }
                let outcome = match got {
                    Ok(bytes) if bytes == want && *g4_good => format!("G4 copy in {took:?}"),
                    Ok(bytes) if bytes == want => {
                        return Err("a hit though no good copy was reachable".into())
                    }
                    Ok(_) => return Err("WRONG BYTES served by the mount".into()),
                    Err(e) if *g4_good => return Err(format!("{e} though G4 holds a good copy")),
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::EIO)) => {
                        format!("{e} in {took:?}")
                    }
                    Err(e) => return Err(format!("unexpected error {e}")),
                };
                if peer_proxy.counters().faulted.load(SeqCst) == faulted_before {
                    return Err("no request reached the faulty peer".into());
                }
                // Import of a name only the (faulty) peer holds.
                let pth = path(&hi.key);
                let bytes = kvtier_client::encode_block(&hi, &pi);
                let (wrote, took) = within(bound + Duration::from_secs(5), move || {
                    std::fs::write(pth, bytes)
                })?;
                if took > bound {
                    return Err(format!("import took {took:?} (bound {bound:?})"));
                }
                match wrote {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                    Err(e) => return Err(format!("import failed: {e}")),
                }
                // The mount keeps serving: a local block, a listing.
                let pth = path(&hl.key);
                let (local, took) = within(bound, move || std::fs::read(pth))?;
                if local.map_err(|e| format!("local block after the fault: {e}"))?
                    != kvtier_client::encode_block(&hl, &pl)
                {
                    return Err("local block read wrong after the fault".into());
                }
                if took > Duration::from_millis(SLACK_MS) {
                    return Err(format!("local block took {took:?} after the fault"));
                }
                let dir = path(&hl.key).parent().unwrap().to_path_buf();
                let (listed, _) = within(bound, move || std::fs::read_dir(dir).map(|d| d.count()))?;
                listed.map_err(|e| format!("listing after the fault: {e}"))?;
                if *g4_good && !direct.contains(&id, &h.key).unwrap() {
                    return Err("the G4 object was deleted".into());
                }
                Ok(outcome)
            })();
            eprintln!("mount fall-through case '{name}': {r:?}");
            if let Err(e) = r {
                failures.push(format!("{name}: {e}"));
            }
            drop(mount);
            let _ = b.shutdown(Duration::from_secs(1));
        }
        assert!(failures.is_empty(), "{failures:#?}");
        drop(a);
    }

    fn run_case(b: &Node, case: &Case, keys: &[(BlockHeader, Vec<u8>)]) -> Result<(), String> {
        let id = ns().id();
        let chain: Vec<BlockKey> = keys.iter().map(|(h, _)| h.key).collect();
        let t = Instant::now();
        let tiers = b.lookup(&id, &chain).map_err(|e| format!("lookup: {e}"))?;
        let took = t.elapsed();
        if took > Duration::from_millis(LOOKUP_MS + SLACK_MS) {
            return Err(format!("lookup took {took:?}"));
        }
        if tiers.contains(&Tier::G3) {
            return Err(format!("lookup says G3 for blocks B never had: {tiers:?}"));
        }
        let expect_hit = case.g4 == G4Has::Good;
        let t = Instant::now();
        if keys.len() > 1 {
            let _ = b.prepare_onboard(&id, &chain);
        }
        let mut buf = AlignedBuf::rounded((BLOCK + 8192) as usize).unwrap();
        for (h, p) in keys {
            let got = b
                .read_into(&id, &h.key, buf.as_mut_slice())
                .map_err(|e| format!("read: {e}"))?;
            match got {
                Lookup::Hit((gh, tier)) => {
                    let bytes = &buf.as_slice()[4096..4096 + p.len()];
                    if gh.key != h.key || bytes != &p[..] {
                        return Err(format!("WRONG BYTES served (from {tier:?})"));
                    }
                    if !expect_hit {
                        return Err(format!("a hit from {tier:?} with no good copy anywhere"));
                    }
                    // Every peer here is faulty or gone: the good copy is G4's.
                    if tier != Tier::G4 {
                        return Err(format!("served from {tier:?}, not G4"));
                    }
                }
                Lookup::Miss(r) => {
                    if expect_hit {
                        return Err(format!("a miss ({r:?}) though G4 holds a good copy"));
                    }
                }
            }
        }
        let took = t.elapsed();
        // Each block gets its own fetch deadline; a batch fetches at once.
        let bound = Duration::from_millis(FETCH_MS * keys.len() as u64 + SLACK_MS);
        if took > bound {
            return Err(format!("onboard took {took:?} (bound {bound:?})"));
        }
        Ok(())
    }
}
