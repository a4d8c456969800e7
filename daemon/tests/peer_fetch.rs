#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Peer server and client over real TCP on 127.0.0.1, serving temp dirs.

use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{encode_block, BlockHeader, BlockKey, KvLayout, Namespace, NamespaceId};
use kvtier_daemon::peer::auth::PeerKey;
use kvtier_daemon::peer::wire::block_url_path;
use kvtier_daemon::peer::{
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

fn auth(secret: &[u8], path: &str, range: &str, unix_ms: u64) -> (&'static str, String) {
    (
        "Authorization",
        PeerKey::from_secret(secret)
            .unwrap()
            .sign("GET", path, range, unix_ms),
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
    let wrong = auth(b"another-secret-0123456789", &path, "", now);
    assert_eq!(raw(&addr, &path, &[wrong]).await.0, 401);
    let stale = auth(SECRET, &path, "", now - 120_000);
    assert_eq!(raw(&addr, &path, &[stale]).await.0, 401);
    let future = auth(SECRET, &path, "", now + 120_000);
    assert_eq!(raw(&addr, &path, &[future]).await.0, 401);
    // Signed for another block: refused for this one.
    let other = auth(
        SECRET,
        &block_url_path(&ns.id(), &BlockKey::from_u64(6)),
        "",
        now,
    );
    assert_eq!(raw(&addr, &path, &[other]).await.0, 401);
    // Signed without a range, replayed with one: refused.
    let no_range = auth(SECRET, &path, "", now);
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
    let (st, body) = raw(&addr, &path, &[auth(SECRET, &path, "", now)]).await;
    assert_eq!((st, body.len()), (200, file.len()));
    assert_eq!(body, file);
    let range = "bytes=4090-4105";
    let (st, body) = raw(
        &addr,
        &path,
        &[auth(SECRET, &path, range, now), ("Range", range.into())],
    )
    .await;
    assert_eq!(st, 206);
    assert_eq!(body, &file[4090..4106]);
    let past = format!("bytes={}-", file.len());
    let (st, _) = raw(
        &addr,
        &path,
        &[auth(SECRET, &path, &past, now), ("Range", past.clone())],
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
        let (st, body) = raw(&addr, path, &[auth(SECRET, sign_path, "", now)]).await;
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
    assert_eq!(raw(&addr, &p, &[auth(SECRET, &p, "", now)]).await.0, 404);
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
    let (k, v) = auth(SECRET, &path, "", unix_ms_now());
    hog.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{k}: {v}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut first = [0u8; 12];
    hog.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");

    let t = Instant::now();
    let (st, _) = raw(&addr, &path, &[auth(SECRET, &path, "", unix_ms_now())]).await;
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
    let r = kvtier_daemon::peer::bench::loopback_compare(dir.path(), 4, 256 << 10, 2)
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
    let r = kvtier_daemon::peer::bench::loopback_compare(dir.path(), n, 2 << 20, 7)
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
