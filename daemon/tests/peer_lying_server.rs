//! A lying peer (issue #14): a server that answers a header probe, or a 404,
//! with an endless body is cut off by the size cap long before the deadline,
//! instead of being read until time runs out; a server that cannot prove
//! the secret is not believed. And the peer listener against hostile
//! clients: a silent, idle or trickling connection is cut at the header
//! deadline; past `connections_max` held by authenticated peers a
//! connection is closed at once (and counted), and slots come back when
//! the holders go.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvtier_client::{BlockKey, KvLayout, Namespace};
use kvtier_daemon::tiers::peer::{PeerClient, PeerClientConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Serves every request on one connection with `status` and a chunked body
/// that never ends; counts the body bytes it managed to send.
async fn endless_server(status: &'static str) -> (String, Arc<AtomicU64>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let sent = Arc::new(AtomicU64::new(0));
    let counter = sent.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut req = vec![0u8; 8192];
                let _ = s.read(&mut req).await;
                let head = format!("HTTP/1.1 {status}\r\ntransfer-encoding: chunked\r\n\r\n");
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![b'x'; 64 << 10];
                let frame = [
                    format!("{:x}\r\n", chunk.len()).into_bytes(),
                    chunk,
                    b"\r\n".to_vec(),
                ]
                .concat();
                loop {
                    if s.write_all(&frame).await.is_err() {
                        return;
                    }
                    counter.fetch_add(64 << 10, Ordering::Relaxed);
                }
            });
        }
    });
    (addr, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_probe_and_404_bodies_are_cut_off_by_size() {
    let ns = Namespace::new("m", KvLayout::with_block_bytes(4096).unwrap(), "", "t").unwrap();
    let key = BlockKey::from_u64(1);
    let client = PeerClient::new(PeerClientConfig::new(vec![7u8; 32])).unwrap();
    for status in ["206 Partial Content", "404 Not Found"] {
        let (addr, sent) = endless_server(status).await;
        let start = Instant::now();
        let deadline = start + Duration::from_secs(10);
        let found = client.probe(&addr, &ns.id(), &key, deadline).await;
        let took = start.elapsed();
        assert!(!found, "{status}: a lying peer's probe was believed");
        assert!(
            took < Duration::from_secs(5),
            "{status}: cut by the deadline ({took:?}), not by the size cap"
        );
        // Give the server a moment to notice the closed connection.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mib = sent.load(Ordering::Relaxed) >> 20;
        assert!(mib < 64, "{status}: {mib} MiB sent before the cut");
    }
}

/// Serves one well-formed block file for every request, as a process that
/// took a peer's address without the shared secret would: status 200, a
/// correct block, and an optional forged proof header.
async fn impostor(file: Vec<u8>, proof: Option<&'static str>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let file = file.clone();
            tokio::spawn(async move {
                let mut req = vec![0u8; 8192];
                let _ = s.read(&mut req).await;
                let extra = proof
                    .map(|p| format!("x-kvtier-proof: {p}\r\n"))
                    .unwrap_or_default();
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n{extra}\r\n",
                    file.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(&file).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_cannot_prove_the_secret_is_not_believed() {
    use kvtier_client::{encode_block, BlockHeader};
    use kvtier_daemon::tiers::peer::PeerFetch;
    let ns = Namespace::new("m", KvLayout::with_block_bytes(4096).unwrap(), "", "t").unwrap();
    let key = BlockKey::from_u64(9);
    let payload = vec![0x5a; 4096];
    let h = BlockHeader::for_payload(&ns, key, &payload, 0);
    let file = encode_block(&h, &payload);
    let client = PeerClient::new(PeerClientConfig::new(vec![7u8; 32])).unwrap();
    let forged = "00000000000000000000000000000000000000000000000000000000000000ff";
    for proof in [None, Some(forged)] {
        let addr = impostor(file.clone(), proof).await;
        let deadline = Instant::now() + Duration::from_secs(5);
        let got = client.fetch(&addr, &ns.id(), &key, deadline).await;
        assert!(
            !matches!(got, PeerFetch::Hit(_)),
            "proof {proof:?}: an impostor's block was accepted"
        );
        assert!(!client.probe(&addr, &ns.id(), &key, deadline).await);
    }
}

// ---- the peer listener against hostile clients ---------------------------

/// Whether the server closed `s` (EOF or reset) within `within`.
async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let end = Instant::now() + within;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // An error response (408, 400) before the close.
            Ok(Ok(_)) => continue,
        }
    }
}

async fn listener_under_test(
    header_read_timeout_ms: u64,
    connections_max: usize,
) -> (kvtier_daemon::tiers::peer::PeerServer, tempfile::TempDir) {
    use kvtier_daemon::tiers::peer::{DirSource, PeerServer, PeerServerConfig};
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = PeerServerConfig::new(vec![7u8; 32]);
    cfg.header_read_timeout_ms = header_read_timeout_ms;
    cfg.connections_max = connections_max;
    cfg.transfers_max = connections_max.min(16);
    let server = PeerServer::start(cfg, Arc::new(DirSource::new(dir.path())))
        .await
        .unwrap();
    (server, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_client_that_trickles_or_stays_silent_is_cut_at_the_header_deadline() {
    let (server, _dir) = listener_under_test(300, 64).await;
    let addr = server.local_addr();
    // Silent: connects and sends nothing.
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    // Idle after one answered request (keep-alive).
    let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /nope HTTP/1.1\r\nHost: p\r\n\r\n")
        .await
        .unwrap();
    // Trickling: a request line and headers, one byte every 50 ms; each
    // byte comes well inside any per-read timeout, the head never ends.
    let mut trickle = tokio::net::TcpStream::connect(addr).await.unwrap();
    let start = Instant::now();
    let head = b"GET /v1/blocks/x/y HTTP/1.1\r\nHost: p\r\nX-Pad: ".repeat(4);
    let mut cut = false;
    for b in head.iter() {
        if trickle.write_all(&[*b]).await.is_err() {
            cut = true;
            break;
        }
        if closed_within(&mut trickle, Duration::from_millis(50)).await {
            cut = true;
            break;
        }
    }
    let took = start.elapsed();
    assert!(cut, "a trickling peer client kept its connection {took:?}");
    assert!(took < Duration::from_secs(3), "cut only after {took:?}");
    assert!(
        closed_within(&mut silent, Duration::from_secs(3)).await,
        "a silent connection was held past the header deadline"
    );
    assert!(
        closed_within(&mut idle, Duration::from_secs(3)).await,
        "an idle keep-alive connection was held past the header deadline"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_listener_closes_connections_past_its_cap_and_serves_again_after() {
    let (server, _dir) = listener_under_test(30_000, 4).await;
    let addr = server.local_addr();
    // Four peers that proved the secret (a signed request each, answered,
    // kept alive) hold every slot; silent connections would not: they are
    // evicted for newcomers (tests/e2e_security.rs).
    let key = kvtier_daemon::tiers::peer::auth::PeerKey::from_secret(&[7u8; 32]).unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let req = format!(
            "GET /nope HTTP/1.1\r\nHost: p\r\nAuthorization: {}\r\n\r\n",
            key.sign("GET", "/nope", "", &server.target(), now)
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 404"), "{:?}", &buf[..n]);
        held.push(s);
    }
    // Past the cap: closed at once, counted, the held ones untouched.
    for i in 0..8 {
        let mut extra = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(
            closed_within(&mut extra, Duration::from_secs(2)).await,
            "connection {i} past the cap was kept"
        );
    }
    assert_eq!(
        server.metrics().connections_refused.load(Ordering::Relaxed),
        8
    );
    for h in &mut held {
        assert!(!closed_within(h, Duration::from_millis(1)).await);
    }
    drop(held);
    // Slots come back once the holders are gone: a request is answered.
    let t = Instant::now();
    loop {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /nope HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut out)).await;
        if out.starts_with(b"HTTP/1.1 ") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "not served again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
