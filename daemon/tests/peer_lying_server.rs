//! A lying peer (issue #14): a server that answers a header probe, or a 404,
//! with an endless body is cut off by the size cap long before the deadline,
//! instead of being read until time runs out.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvtier_client::{BlockKey, KvLayout, Namespace};
use kvtier_daemon::peer::{PeerClient, PeerClientConfig};
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
    use kvtier_daemon::peer::PeerFetch;
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
