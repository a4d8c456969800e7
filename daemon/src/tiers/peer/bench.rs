//! Measurement helpers for `kvtier bench crossnode`: a raw TCP loopback
//! transfer of the same block files (the baseline) and a timed series of
//! verified peer fetches. Both report bytes, seconds and GB/s; the bench
//! interleaves them and writes the `_vs_baseline` quotient.

use super::client::{PeerClient, PeerFetch};
use super::server::{PeerServer, PeerServerConfig};
use super::source::DirSource;
use crate::base::error::{Error, Result};
use kvtier_client::{encode_block, BlockHeader, BlockKey, KvLayout, Namespace, NamespaceId};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Blocks of a bench, by namespace and key.
pub type BlockIds = Vec<(NamespaceId, BlockKey)>;

/// One timed transfer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transfer {
    /// Bytes moved.
    pub bytes: u64,
    /// Wall time.
    pub seconds: f64,
    /// Per-block latencies are not kept; this is bytes / seconds / 1e9.
    pub gbps: f64,
}

impl Transfer {
    fn new(bytes: u64, d: Duration) -> Self {
        let seconds = d.as_secs_f64().max(1e-9);
        Transfer {
            bytes,
            seconds,
            gbps: bytes as f64 / seconds / 1e9,
        }
    }
}

/// Baseline: sends each file over one plain TCP loopback connection (read
/// from the file in `chunk_bytes` pieces, written to the socket; the
/// receiver reads each file into its own buffer) and times the whole run.
/// Blocking; uses one sender thread.
pub fn raw_tcp_transfer(files: &[PathBuf], chunk_bytes: usize) -> Result<Transfer> {
    let io = |op: &'static str, p: &str, e| Error::io(op, p.to_string(), e);
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| io("binding", "127.0.0.1:0", e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| io("reading", "listener", e))?;
    let mut lens = Vec::with_capacity(files.len());
    for f in files {
        lens.push(
            std::fs::metadata(f)
                .map_err(|e| Error::io("stat", f, e))?
                .len(),
        );
    }
    let sender_files = files.to_vec();
    let chunk = chunk_bytes.max(4096);
    let start = Instant::now();
    let sender = std::thread::spawn(move || -> Result<()> {
        let (mut sock, _) = listener
            .accept()
            .map_err(|e| Error::io("accepting", "baseline", e))?;
        let _ = sock.set_nodelay(true);
        let mut buf = vec![0u8; chunk];
        for f in &sender_files {
            let mut file = std::fs::File::open(f).map_err(|e| Error::io("opening", f, e))?;
            loop {
                let n = file
                    .read(&mut buf)
                    .map_err(|e| Error::io("reading", f, e))?;
                if n == 0 {
                    break;
                }
                sock.write_all(&buf[..n])
                    .map_err(|e| Error::io("sending", "baseline", e))?;
            }
        }
        Ok(())
    });
    let mut sock = TcpStream::connect(addr).map_err(|e| io("connecting", "baseline", e))?;
    let mut total = 0u64;
    for len in &lens {
        let mut dst = vec![0u8; *len as usize];
        sock.read_exact(&mut dst)
            .map_err(|e| io("receiving", "baseline", e))?;
        total += len;
        std::hint::black_box(&dst);
    }
    let elapsed = start.elapsed();
    sender.join().map_err(|_| Error::Peer {
        peer: addr.to_string(),
        detail: "baseline sender thread panicked".into(),
    })??;
    Ok(Transfer::new(total, elapsed))
}

/// Fetches every block from the peer at `address`, one after another, each
/// verified; fails on the first miss (a bench must not time misses).
pub async fn peer_fetch(
    client: &PeerClient,
    address: &str,
    blocks: &[(NamespaceId, BlockKey)],
    timeout_per_block: Duration,
) -> Result<Transfer> {
    let start = Instant::now();
    let mut total = 0u64;
    for (ns, key) in blocks {
        match client
            .fetch(address, ns, key, Instant::now() + timeout_per_block)
            .await
        {
            PeerFetch::Hit(b) => total += b.header.file_len(),
            PeerFetch::Miss(m) => {
                return Err(Error::Peer {
                    peer: address.to_string(),
                    detail: format!("bench fetch of {ns}/{key:?} missed: {m:?}"),
                })
            }
        }
    }
    Ok(Transfer::new(total, start.elapsed()))
}

/// Writes `n` blocks of `block_bytes` payload into a [`DirSource`] layout
/// under `dir`; returns their ids and file paths.
pub fn write_blocks(dir: &Path, n: usize, block_bytes: u64) -> Result<(BlockIds, Vec<PathBuf>)> {
    let ns = Namespace::new(
        "bench",
        KvLayout::with_block_bytes(block_bytes)?,
        "",
        b"bench".to_vec(),
    )?;
    let src = DirSource::new(dir);
    let mut ids = Vec::with_capacity(n);
    let mut paths = Vec::with_capacity(n);
    for i in 0..n {
        let key = BlockKey::from_u64(0xb0_0000 + i as u64);
        let payload: Vec<u8> = (0..block_bytes)
            .map(|j| (j as u8) ^ (i as u8).wrapping_mul(37))
            .collect();
        let h = BlockHeader::for_payload(&ns, key, &payload, 1);
        paths.push(src.write_block(&ns.id(), &key, &encode_block(&h, &payload))?);
        ids.push((ns.id(), key));
    }
    Ok((ids, paths))
}

/// Medians of an in-process loopback comparison.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoopbackComparison {
    /// Median peer-fetch GB/s (verified).
    pub peer_gbps: f64,
    /// Median raw TCP GB/s, same bytes.
    pub raw_gbps: f64,
    /// Bytes per round.
    pub bytes_per_round: u64,
    /// Rounds of each.
    pub rounds: usize,
}

/// In-process comparison: writes `n` blocks under `dir`, serves them with a
/// [`PeerServer`] on loopback and alternates raw-TCP and peer-fetch rounds
/// (A B A B ...), returning medians. Page-cache warm on both sides.
pub async fn loopback_compare(
    dir: &Path,
    n: usize,
    block_bytes: u64,
    rounds: usize,
) -> Result<LoopbackComparison> {
    let (ids, paths) = write_blocks(dir, n, block_bytes)?;
    let secret = b"bench-secret-not-for-production".to_vec();
    let server = PeerServer::start(
        PeerServerConfig::new(secret.clone()),
        Arc::new(DirSource::new(dir)),
    )
    .await?;
    let client = PeerClient::new(super::client::PeerClientConfig::new(secret))?;
    let addr = server.local_addr().to_string();
    let (mut peer, mut raw) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    for _ in 0..rounds.max(1) {
        let p = paths.clone();
        let r = tokio::task::spawn_blocking(move || raw_tcp_transfer(&p, 1 << 20))
            .await
            .map_err(|e| Error::Peer {
                peer: "baseline".into(),
                detail: e.to_string(),
            })??;
        raw.push(r.gbps);
        let f = peer_fetch(&client, &addr, &ids, Duration::from_secs(30)).await?;
        bytes = f.bytes;
        peer.push(f.gbps);
    }
    Ok(LoopbackComparison {
        peer_gbps: median(&mut peer),
        raw_gbps: median(&mut raw),
        bytes_per_round: bytes,
        rounds: rounds.max(1),
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Where one block's time goes on the peer path, in microseconds per block
/// (means over the blocks), each stage measured alone in the same run so
/// that the shares can be compared. Page cache as the caller left it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Breakdown {
    /// Blocks measured.
    pub blocks: usize,
    /// Reading the block file into memory (the server's read).
    pub file_read_us: f64,
    /// The payload checksum (XXH3-128) of the block file's bytes (one
    /// verification).
    pub checksum_us: f64,
    /// One memcpy of the block file's bytes (one copy).
    pub memcpy_us: f64,
    /// A fresh TCP connect to the peer server (what a pooled connection
    /// saves).
    pub tcp_connect_us: f64,
    /// A signed header-only GET on a pooled connection: one request round
    /// trip, the server's auth and open, 4 KiB of body.
    pub request_round_trip_us: f64,
    /// Raw TCP of the same files (the baseline), per block.
    pub raw_tcp_us: f64,
    /// A whole verified peer fetch, one block after another, per block.
    pub peer_fetch_us: f64,
    /// Peer fetches of `concurrent` blocks at once, per block.
    pub peer_fetch_concurrent_us: f64,
    /// Fetches in flight in `peer_fetch_concurrent_us`.
    pub concurrent: usize,
    /// New connections the client opened during the measured fetches
    /// (0 when every fetch reused a pooled connection).
    pub connections_opened: u64,
}

/// Measures [`Breakdown`] against the peer server at `address` serving
/// `ids` whose block files are `files` (same order).
pub async fn breakdown(
    client: &PeerClient,
    address: &str,
    ids: &[(NamespaceId, BlockKey)],
    files: &[PathBuf],
    concurrent: usize,
) -> Result<Breakdown> {
    let n = ids.len().min(files.len()).max(1);
    let per = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
    let t = Instant::now();
    let mut bodies = Vec::with_capacity(n);
    for f in files.iter().take(n) {
        bodies.push(std::fs::read(f).map_err(|e| Error::io("reading", f, e))?);
    }
    let file_read_us = per(t.elapsed());
    let t = Instant::now();
    for b in &bodies {
        std::hint::black_box(kvtier_client::PayloadSum::of(b));
    }
    let checksum_us = per(t.elapsed());
    let mut dst = vec![0u8; bodies.iter().map(Vec::len).max().unwrap_or(0)];
    let t = Instant::now();
    for b in &bodies {
        dst[..b.len()].copy_from_slice(b);
        std::hint::black_box(&dst);
    }
    let memcpy_us = per(t.elapsed());
    drop(bodies);
    let t = Instant::now();
    for _ in 0..n {
        let s = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|e| Error::io("connecting", address.to_string(), e))?;
        drop(s);
    }
    let tcp_connect_us = per(t.elapsed());
    let deadline = || Instant::now() + Duration::from_secs(30);
    // Warm the pool, then count connections opened while measuring.
    client
        .probe(address, &ids[0].0, &ids[0].1, deadline())
        .await;
    let opened0 = client.connections_opened();
    let t = Instant::now();
    for (ns, key) in ids.iter().take(n) {
        if !client.probe(address, ns, key, deadline()).await {
            return Err(Error::Peer {
                peer: address.to_string(),
                detail: format!("bench probe of {ns}/{key:?} said absent"),
            });
        }
    }
    let request_round_trip_us = per(t.elapsed());
    let p = files.to_vec();
    let raw = tokio::task::spawn_blocking(move || raw_tcp_transfer(&p, 1 << 20))
        .await
        .map_err(|e| Error::Peer {
            peer: "baseline".into(),
            detail: e.to_string(),
        })??;
    let raw_tcp_us = raw.seconds * 1e6 / files.len().max(1) as f64;
    let f = peer_fetch(client, address, &ids[..n], Duration::from_secs(30)).await?;
    let peer_fetch_us = f.seconds * 1e6 / n as f64;
    let t = Instant::now();
    {
        use futures::StreamExt;
        let misses = futures::stream::iter(ids.iter().take(n))
            .map(|(ns, key)| client.fetch(address, ns, key, deadline()))
            .buffer_unordered(concurrent.max(1))
            .filter(|r| futures::future::ready(matches!(r, PeerFetch::Miss(_))))
            .count()
            .await;
        if misses > 0 {
            return Err(Error::Peer {
                peer: address.to_string(),
                detail: format!("{misses} concurrent bench fetches missed"),
            });
        }
    }
    let peer_fetch_concurrent_us = per(t.elapsed());
    Ok(Breakdown {
        blocks: n,
        file_read_us,
        checksum_us,
        memcpy_us,
        tcp_connect_us,
        request_round_trip_us,
        raw_tcp_us,
        peer_fetch_us,
        peer_fetch_concurrent_us,
        concurrent: concurrent.max(1),
        connections_opened: client.connections_opened() - opened0,
    })
}
