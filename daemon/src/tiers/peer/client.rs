//! One verified block fetch from one peer.
//!
//! The body is consumed as it arrives: the first 4096 bytes are decoded as
//! the header (namespace and key must be the ones asked for, the length must
//! fit `block_bytes_max`), the payload is hashed incrementally into a buffer
//! sized from the header, the padding must be zero and the stream must end
//! exactly at the header's file length. Only then is a [`PeerFetch::Hit`]
//! returned; every other path is a [`PeerMiss`] value.

use super::auth::{PeerKey, Target, NONCE_HEADER, PROOF_HEADER, TARGET_HEADER};

static PROOF_WARN: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(10_000);
use super::holdings::{HoldingsDigest, HOLDINGS_PATH};
use super::unix_ms_now;
use super::wire::block_url_path;
use crate::base::error::Result;
use crate::base::tier::Block;
use bytes::Buf;
use http_body_util::{BodyExt, Empty};
use hyper::{header, Request, StatusCode};
use hyper_util::rt::TokioIo;
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Client settings.
#[derive(Clone)]
pub struct PeerClientConfig {
    /// Shared secret, identical on every node (at least 16 bytes).
    pub secret: Vec<u8>,
    /// Longest wait for the TCP connection (also bounded by the deadline).
    pub connect_timeout_ms: u64,
    /// Largest block file accepted from a peer; larger is treated as a lie.
    pub block_bytes_max: u64,
}

impl std::fmt::Debug for PeerClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerClientConfig")
            .field("secret", &"<redacted>")
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("block_bytes_max", &self.block_bytes_max)
            .finish()
    }
}

impl PeerClientConfig {
    /// Defaults with the given secret: 500 ms connect, 256 MiB blocks.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        PeerClientConfig {
            secret: secret.into(),
            connect_timeout_ms: 500,
            block_bytes_max: 256 << 20,
        }
    }
}

/// Why a peer did not deliver a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerMiss {
    /// The peer answered that it does not hold the block.
    Absent,
    /// The peer could not be reached, refused (busy, auth) or broke off.
    Unavailable,
    /// The peer sent bytes that failed verification.
    Corrupt,
    /// The deadline passed first.
    Timeout,
}

impl PeerMiss {
    /// The tier-level miss reason.
    pub fn reason(self) -> crate::base::tier::MissReason {
        use crate::base::tier::MissReason;
        match self {
            PeerMiss::Absent => MissReason::Absent,
            PeerMiss::Corrupt => MissReason::Corrupt,
            PeerMiss::Unavailable => MissReason::Unavailable,
            PeerMiss::Timeout => MissReason::Timeout,
        }
    }
}

/// A fetch's outcome.
// `Hit` is the common case and is moved once; boxing it would add an
// allocation per fetched block for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum PeerFetch {
    /// Verified block.
    Hit(Block),
    /// Nothing usable, and why.
    Miss(PeerMiss),
}

/// Client-side counters (shared by every fetch of one client).
#[derive(Debug, Default)]
pub struct PeerMetrics {
    fetches: AtomicU64,
    hits: AtomicU64,
    bytes: AtomicU64,
    absent: AtomicU64,
    unavailable: AtomicU64,
    corrupt: AtomicU64,
    timeout: AtomicU64,
    skipped: AtomicU64,
    connections: AtomicU64,
    /// Holdings digests fetched / refused or unreachable (set.rs).
    pub(crate) holdings_refreshed: AtomicU64,
    pub(crate) holdings_failed: AtomicU64,
    /// Lookup answers per peer block: from a digest (held / not held), or
    /// from a header probe (no digest, or a negative confirmed).
    pub(crate) lookup_digest_held: AtomicU64,
    pub(crate) lookup_digest_not_held: AtomicU64,
    pub(crate) lookup_probes: AtomicU64,
    /// Fetches a digest said the peer held that it answered absent
    /// (a false positive, or a block evicted since the digest).
    pub(crate) holdings_false_positives: AtomicU64,
}

/// A copy of [`PeerMetrics`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerMetricsSnapshot {
    /// Fetches attempted.
    pub fetches: u64,
    /// Verified hits.
    pub hits: u64,
    /// Block-file bytes of verified hits.
    pub bytes: u64,
    /// Misses: peer does not hold the block.
    pub absent: u64,
    /// Misses: peer down, busy, refused or broke off.
    pub unavailable: u64,
    /// Misses: peer sent bytes that failed verification.
    pub corrupt: u64,
    /// Misses: deadline passed.
    pub timeout: u64,
    /// Peers not asked because they were marked down or lying.
    pub skipped: u64,
    /// Holdings digests fetched from peers.
    pub holdings_refreshed: u64,
    /// Holdings digest fetches that failed (unreachable, refused, corrupt).
    pub holdings_failed: u64,
    /// Lookup answers "held" taken from a digest (no probe sent).
    pub lookup_digest_held: u64,
    /// Lookup answers "not held" taken from a digest.
    pub lookup_digest_not_held: u64,
    /// Header probes sent by lookups.
    pub lookup_probes: u64,
    /// Fetches of blocks a digest listed that the peer did not have.
    pub holdings_false_positives: u64,
    /// Peers with a usable digest now (gauge).
    pub holdings_peers: u64,
    /// Encoded bytes of the usable digests held now (gauge).
    pub holdings_bytes: u64,
    /// Age of the oldest usable digest, ms since it was fetched (gauge).
    pub holdings_age_ms_max: u64,
}

impl PeerMetrics {
    /// Current values.
    pub fn snapshot(&self) -> PeerMetricsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PeerMetricsSnapshot {
            fetches: g(&self.fetches),
            hits: g(&self.hits),
            bytes: g(&self.bytes),
            absent: g(&self.absent),
            unavailable: g(&self.unavailable),
            corrupt: g(&self.corrupt),
            timeout: g(&self.timeout),
            skipped: g(&self.skipped),
            holdings_refreshed: g(&self.holdings_refreshed),
            holdings_failed: g(&self.holdings_failed),
            lookup_digest_held: g(&self.lookup_digest_held),
            lookup_digest_not_held: g(&self.lookup_digest_not_held),
            lookup_probes: g(&self.lookup_probes),
            holdings_false_positives: g(&self.holdings_false_positives),
            holdings_peers: 0,
            holdings_bytes: 0,
            holdings_age_ms_max: 0,
        }
    }

    pub(crate) fn count_skip(&self) {
        self.skipped.fetch_add(1, Ordering::Relaxed);
    }

    fn count(&self, outcome: &PeerFetch) {
        let c = match outcome {
            PeerFetch::Hit(b) => {
                self.bytes.fetch_add(b.header.file_len(), Ordering::Relaxed);
                &self.hits
            }
            PeerFetch::Miss(PeerMiss::Absent) => &self.absent,
            PeerFetch::Miss(PeerMiss::Unavailable) => &self.unavailable,
            PeerFetch::Miss(PeerMiss::Corrupt) => &self.corrupt,
            PeerFetch::Miss(PeerMiss::Timeout) => &self.timeout,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// Fetches blocks from peers. Cheap to clone; clones share counters.
#[derive(Clone)]
pub struct PeerClient {
    key: PeerKey,
    cfg: Arc<PeerClientConfig>,
    metrics: Arc<PeerMetrics>,
    idle: Arc<Mutex<HashMap<String, Vec<Conn>>>>,
    /// Peers whose last answer refused us (401) or lacked the proof of
    /// our secret: when, and the status (`/healthz`).
    refusals: Arc<Mutex<HashMap<String, (std::time::Instant, u16)>>>,
    /// Who each peer address said it is (node id, epoch of its start):
    /// requests are signed for it (auth.rs).
    targets: Arc<Mutex<HashMap<String, Target>>>,
}

/// Peers with a refusal newer than this are reported by `/healthz`.
const REFUSAL_REPORTED_FOR: Duration = Duration::from_secs(60);
/// Peer addresses whose refusals are remembered.
const REFUSALS_MAX: usize = 256;

impl std::fmt::Debug for PeerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerClient")
            .field("cfg", &self.cfg)
            .finish()
    }
}

/// Idle connections kept per peer address.
const IDLE_PER_PEER_MAX: usize = 4;
/// Peer addresses with idle connections kept.
const IDLE_PEERS_MAX: usize = 256;

struct AbortOnDrop(tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl PeerClient {
    /// A client; fails when the secret is too short.
    pub fn new(cfg: PeerClientConfig) -> Result<Self> {
        Ok(PeerClient {
            key: PeerKey::from_secret(&cfg.secret)?,
            cfg: Arc::new(cfg),
            metrics: Arc::new(PeerMetrics::default()),
            idle: Arc::new(Mutex::new(HashMap::new())),
            refusals: Arc::new(Mutex::new(HashMap::new())),
            targets: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// Peers that refused us in the last minute (a different
    /// `peer.secret`, clocks apart) and have not answered since:
    /// `(address, HTTP status)`, sorted.
    pub fn refusing_peers(&self) -> Vec<(String, u16)> {
        let Ok(r) = self.refusals.lock() else {
            return Vec::new();
        };
        let mut v: Vec<(String, u16)> = r
            .iter()
            .filter(|(_, (t, _))| t.elapsed() < REFUSAL_REPORTED_FOR)
            .map(|(a, (_, s))| (a.clone(), *s))
            .collect();
        v.sort();
        v
    }

    fn note_answer(&self, address: &str, refused: bool, status: u16) {
        let Ok(mut r) = self.refusals.lock() else {
            return;
        };
        if !refused {
            r.remove(address);
            return;
        }
        if r.len() >= REFUSALS_MAX && !r.contains_key(address) {
            r.retain(|_, (t, _)| t.elapsed() < REFUSAL_REPORTED_FOR);
            if r.len() >= REFUSALS_MAX {
                return;
            }
        }
        r.insert(address.to_string(), (std::time::Instant::now(), status));
    }

    /// Counters.
    pub fn metrics(&self) -> &Arc<PeerMetrics> {
        &self.metrics
    }

    /// TCP connections this client (and its clones) opened so far; the
    /// rest of the requests reused a pooled one.
    pub fn connections_opened(&self) -> u64 {
        self.metrics.connections.load(Ordering::Relaxed)
    }

    /// Fetches `(ns, key)` from the peer at `address` (`host:port`), giving
    /// up at `deadline`. Never returns unverified bytes.
    pub async fn fetch(
        &self,
        address: &str,
        ns: &NamespaceId,
        key: &BlockKey,
        deadline: Instant,
    ) -> PeerFetch {
        self.metrics.fetches.fetch_add(1, Ordering::Relaxed);
        let outcome = match tokio::time::timeout_at(
            tokio::time::Instant::from_std(deadline),
            self.fetch_inner(address, ns, key, deadline),
        )
        .await
        {
            Ok(o) => o,
            Err(_) => PeerFetch::Miss(PeerMiss::Timeout),
        };
        self.metrics.count(&outcome);
        if let PeerFetch::Miss(m) = &outcome {
            tracing::debug!("peer {address}: {ns}/{key:?}: {m:?}");
        }
        outcome
    }

    /// Opens a fresh HTTP/1.1 connection within the connect budget.
    async fn connect(&self, address: &str, deadline: Instant) -> Result<Conn, PeerMiss> {
        let connect_budget = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(self.cfg.connect_timeout_ms));
        let stream =
            match tokio::time::timeout(connect_budget, tokio::net::TcpStream::connect(address))
                .await
            {
                Ok(Ok(s)) => s,
                Ok(Err(_)) => return Err(PeerMiss::Unavailable),
                Err(_) if Instant::now() >= deadline => return Err(PeerMiss::Timeout),
                Err(_) => return Err(PeerMiss::Unavailable),
            };
        self.metrics.connections.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let (sender, conn) =
            hyper::client::conn::http1::handshake::<_, Empty<bytes::Bytes>>(TokioIo::new(stream))
                .await
                .map_err(|_| PeerMiss::Unavailable)?;
        let driver = AbortOnDrop(tokio::spawn(async move {
            let _ = conn.await;
        }));
        Ok(Conn {
            sender,
            _driver: driver,
        })
    }

    fn take_idle(&self, address: &str) -> Option<Conn> {
        let mut pool = self.idle.lock().ok()?;
        let list = pool.get_mut(address)?;
        while let Some(c) = list.pop() {
            if !c.sender.is_closed() {
                return Some(c);
            }
        }
        None
    }

    fn put_idle(&self, address: &str, conn: Conn) {
        if let Ok(mut pool) = self.idle.lock() {
            if !pool.contains_key(address) && pool.len() >= IDLE_PEERS_MAX {
                return;
            }
            let list = pool.entry(address.to_string()).or_default();
            if list.len() < IDLE_PER_PEER_MAX {
                list.push(conn);
            }
        }
    }

    async fn fetch_inner(
        &self,
        address: &str,
        ns: &NamespaceId,
        key: &BlockKey,
        deadline: Instant,
    ) -> PeerFetch {
        use PeerFetch::Miss;
        let path = block_url_path(ns, key);
        let nonce = PeerKey::nonce();
        let (mut conn, resp, auth) = match self
            .send_signed(address, &path, None, &nonce, deadline)
            .await
        {
            Ok(v) => v,
            Err(m) => return Miss(m),
        };
        if !self.server_proved(address, &resp, &nonce, &auth) {
            return Miss(PeerMiss::Unavailable);
        }
        match resp.status() {
            StatusCode::OK => {}
            StatusCode::NOT_FOUND => {
                // Drain the short body so the connection can be reused.
                // Capped: a peer that answers 404 with a huge body is cut
                // off (the collect fails past the limit) instead of read.
                let short = http_body_util::Limited::new(resp.into_body(), 4096);
                if let Ok(Ok(_)) =
                    tokio::time::timeout(Duration::from_millis(100), short.collect()).await
                {
                    self.put_idle(address, conn);
                }
                return Miss(PeerMiss::Absent);
            }
            s => {
                if s == StatusCode::UNAUTHORIZED {
                    tracing::warn!(
                        "peer {address} refused our signature: check peer.secret and clock sync"
                    );
                }
                return Miss(PeerMiss::Unavailable);
            }
        }
        let declared_len = resp
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let mut body = resp.into_body();
        let mut rx = Receiver::new(ns, key, self.cfg.block_bytes_max, declared_len);
        loop {
            match body.frame().await {
                None => break,
                Some(Err(_)) => return Miss(PeerMiss::Unavailable),
                Some(Ok(frame)) => {
                    if let Ok(mut data) = frame.into_data() {
                        while data.has_remaining() {
                            let chunk = data.chunk();
                            let n = chunk.len();
                            if rx.feed(chunk).is_err() {
                                return Miss(PeerMiss::Corrupt);
                            }
                            data.advance(n);
                        }
                    }
                }
            }
        }
        match rx.finish() {
            Ok(block) => {
                drop(body);
                // Connections are recycled only after a complete, verified
                // response, so a reused connection never carries leftovers.
                conn.sender.ready().await.ok();
                if !conn.sender.is_closed() {
                    self.put_idle(address, conn);
                }
                PeerFetch::Hit(block)
            }
            Err(()) => Miss(PeerMiss::Corrupt),
        }
    }
}

impl PeerClient {
    /// Asks the peer at `address` whether it holds `(ns, key)` with one
    /// ranged GET of the 4096-byte header (no payload moves). `true` only
    /// when the header decodes and names this namespace and key. A hint for
    /// lookups: the bytes are verified when the block is fetched. Not
    /// counted in the fetch counters.
    pub async fn probe(
        &self,
        address: &str,
        ns: &NamespaceId,
        key: &BlockKey,
        deadline: Instant,
    ) -> bool {
        tokio::time::timeout_at(
            tokio::time::Instant::from_std(deadline),
            self.probe_inner(address, ns, key, deadline),
        )
        .await
        .unwrap_or(false)
    }

    async fn probe_inner(
        &self,
        address: &str,
        ns: &NamespaceId,
        key: &BlockKey,
        deadline: Instant,
    ) -> bool {
        let path = block_url_path(ns, key);
        let range = format!("bytes=0-{}", HEADER_BYTES - 1);
        let nonce = PeerKey::nonce();
        let Ok((conn, resp, auth)) = self
            .send_signed(address, &path, Some(&range), &nonce, deadline)
            .await
        else {
            return false;
        };
        if !self.server_proved(address, &resp, &nonce, &auth) {
            return false;
        }
        let status = resp.status();
        // The probe asked for the header only: a body past twice its size is
        // a lying peer, cut off rather than buffered.
        let capped = http_body_util::Limited::new(resp.into_body(), 2 * HEADER_BYTES);
        let Ok(body) = capped.collect().await else {
            return false;
        };
        let body = body.to_bytes();
        if body.len() <= HEADER_BYTES {
            self.put_idle(address, conn);
        }
        if status != StatusCode::PARTIAL_CONTENT && status != StatusCode::OK {
            return false;
        }
        body.len() >= HEADER_BYTES
            && BlockHeader::decode(&body[..HEADER_BYTES])
                .is_ok_and(|h| h.namespace_id() == *ns && h.key == *key)
    }
}

impl PeerClient {
    /// Fetches the peer's holdings digest (`GET /v1/holdings`), at most
    /// `bytes_max` bytes, checked (proof of the secret, length, version,
    /// blake3 trailer). `Absent` when the peer publishes none (an older
    /// kvtierd, or `holdings_bytes_max = 0` there).
    pub async fn holdings(
        &self,
        address: &str,
        bytes_max: u64,
        deadline: Instant,
    ) -> std::result::Result<HoldingsDigest, PeerMiss> {
        match tokio::time::timeout_at(
            tokio::time::Instant::from_std(deadline),
            self.holdings_inner(address, bytes_max, deadline),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(PeerMiss::Timeout),
        }
    }

    async fn holdings_inner(
        &self,
        address: &str,
        bytes_max: u64,
        deadline: Instant,
    ) -> std::result::Result<HoldingsDigest, PeerMiss> {
        let path = HOLDINGS_PATH;
        let nonce = PeerKey::nonce();
        let (conn, resp, auth) = self
            .send_signed(address, path, None, &nonce, deadline)
            .await?;
        if !self.server_proved(address, &resp, &nonce, &auth) {
            return Err(PeerMiss::Unavailable);
        }
        let status = resp.status();
        let cap = if status == StatusCode::OK {
            bytes_max as usize
        } else {
            4096
        };
        let Ok(body) = http_body_util::Limited::new(resp.into_body(), cap)
            .collect()
            .await
        else {
            return Err(PeerMiss::Unavailable);
        };
        self.put_idle(address, conn);
        match status {
            StatusCode::OK => {}
            StatusCode::NOT_FOUND => return Err(PeerMiss::Absent),
            _ => return Err(PeerMiss::Unavailable),
        }
        HoldingsDigest::decode(&body.to_bytes(), bytes_max).map_err(|f| {
            tracing::warn!("peer {address}: holdings digest refused: {f:?}");
            PeerMiss::Corrupt
        })
    }
}

impl PeerClient {
    /// Sends one signed `GET path` (with `range`) to `address` on a pooled
    /// or fresh connection, signed for the node and epoch the peer last
    /// named; the connection, the answer and the `Authorization` sent.
    /// A peer that answers 401 naming another node or epoch (it restarted,
    /// or it is the first request to it), with the proof of our secret, is
    /// asked once more, signed for what it named.
    async fn send_signed(
        &self,
        address: &str,
        path: &str,
        range: Option<&str>,
        nonce: &str,
        deadline: Instant,
    ) -> std::result::Result<(Conn, hyper::Response<hyper::body::Incoming>, String), PeerMiss> {
        let mut idle = self.take_idle(address);
        let mut signed_again = false;
        loop {
            // A pooled connection the peer has closed meanwhile fails on
            // first use; that is not the peer being down, so retry fresh.
            let reused = idle.is_some();
            let mut conn = match idle.take() {
                Some(c) => c,
                None => self.connect(address, deadline).await?,
            };
            if conn.sender.ready().await.is_err() {
                if reused {
                    continue;
                }
                return Err(PeerMiss::Unavailable);
            }
            let to = self.target_of(address);
            let auth = self
                .key
                .sign("GET", path, range.unwrap_or(""), &to, unix_ms_now());
            let mut req = Request::get(path)
                .header(header::HOST, address)
                .header(header::AUTHORIZATION, auth.as_str())
                .header(NONCE_HEADER, nonce);
            if let Some(r) = range {
                req = req.header(header::RANGE, r);
            }
            let req = req.body(Empty::new()).map_err(|_| PeerMiss::Unavailable)?;
            let resp = match conn.sender.send_request(req).await {
                Ok(r) => r,
                Err(_) if reused => continue,
                Err(_) => return Err(PeerMiss::Unavailable),
            };
            let named = resp
                .headers()
                .get(TARGET_HEADER)
                .and_then(|v| v.to_str().ok())
                .and_then(Target::parse);
            let proved = || {
                let proof = resp
                    .headers()
                    .get(PROOF_HEADER)
                    .and_then(|v| v.to_str().ok());
                self.key
                    .check_proof(proof, nonce, &auth, resp.status().as_u16())
            };
            match named {
                Some(t) if t != to => {
                    // Believed only with the proof (a 401 carries none:
                    // the next request, signed for it, proves it or not).
                    let retry = resp.status() == StatusCode::UNAUTHORIZED && !signed_again;
                    if retry || proved() {
                        self.set_target(address, t);
                    }
                    if retry {
                        signed_again = true;
                        // The short refusal read, the connection serves
                        // the request signed again.
                        let short = http_body_util::Limited::new(resp.into_body(), 4096);
                        if let Ok(Ok(_)) =
                            tokio::time::timeout(Duration::from_millis(100), short.collect()).await
                        {
                            idle = Some(conn);
                        }
                        continue;
                    }
                }
                _ => {}
            }
            return Ok((conn, resp, auth));
        }
    }

    /// The node and epoch requests to `address` are signed for (none
    /// known: the empty target, which the peer answers naming itself).
    fn target_of(&self, address: &str) -> Target {
        self.targets
            .lock()
            .ok()
            .and_then(|t| t.get(address).cloned())
            .unwrap_or_default()
    }

    fn set_target(&self, address: &str, t: Target) {
        if let Ok(mut m) = self.targets.lock() {
            if m.len() >= IDLE_PEERS_MAX && !m.contains_key(address) {
                m.clear();
            }
            m.insert(address.to_string(), t);
        }
    }

    /// Whether the answer carries the proof that the server holds the
    /// shared secret (auth.rs); an answer without it is not believed.
    fn server_proved<B>(
        &self,
        address: &str,
        resp: &hyper::Response<B>,
        nonce: &str,
        auth: &str,
    ) -> bool {
        let proof = resp
            .headers()
            .get(PROOF_HEADER)
            .and_then(|v| v.to_str().ok());
        let ok = self
            .key
            .check_proof(proof, nonce, auth, resp.status().as_u16());
        let status = resp.status();
        self.note_answer(
            address,
            !ok || status == StatusCode::UNAUTHORIZED,
            status.as_u16(),
        );
        if !ok {
            crate::warn_limited!(
                PROOF_WARN,
                "peer {address} answered {} without a valid proof of the shared secret: \
                 not a kvtier peer with our peer.secret (or an older kvtierd); ignored",
                resp.status()
            );
        }
        ok
    }
}

/// One HTTP/1.1 connection to a peer and the task driving it.
struct Conn {
    sender: hyper::client::conn::http1::SendRequest<Empty<bytes::Bytes>>,
    _driver: AbortOnDrop,
}

/// Incremental verifier of one block file stream.
struct Receiver<'a> {
    ns: &'a NamespaceId,
    key: &'a BlockKey,
    block_bytes_max: u64,
    declared_len: Option<u64>,
    head: Vec<u8>,
    header: Option<BlockHeader>,
    payload: Vec<u8>,
    hasher: kvtier_client::SumHasher,
    received: u64,
}

impl<'a> Receiver<'a> {
    fn new(
        ns: &'a NamespaceId,
        key: &'a BlockKey,
        block_bytes_max: u64,
        declared_len: Option<u64>,
    ) -> Self {
        Receiver {
            ns,
            key,
            block_bytes_max,
            declared_len,
            head: Vec::with_capacity(HEADER_BYTES),
            header: None,
            payload: Vec::new(),
            hasher: kvtier_client::SumHasher::new(kvtier_client::SumAlgo::Xxh3_128),
            received: 0,
        }
    }

    fn feed(&mut self, mut data: &[u8]) -> std::result::Result<(), ()> {
        self.received += data.len() as u64;
        if self.header.is_none() {
            let take = (HEADER_BYTES - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.head.len() < HEADER_BYTES {
                return Ok(());
            }
            let h = BlockHeader::decode(&self.head).map_err(|_| ())?;
            let file_len = h.file_len();
            if h.namespace_id() != *self.ns
                || h.key != *self.key
                || file_len > self.block_bytes_max
                || self.declared_len.is_some_and(|d| d != file_len)
            {
                return Err(());
            }
            self.payload = Vec::with_capacity(h.payload_len as usize);
            self.hasher = h.payload_hasher();
            self.header = Some(h);
        }
        let Some(h) = &self.header else {
            return Ok(());
        };
        if self.received > h.file_len() {
            return Err(());
        }
        let want = (h.payload_len as usize).saturating_sub(self.payload.len());
        let (payload, padding) = data.split_at(want.min(data.len()));
        self.hasher.update(payload);
        self.payload.extend_from_slice(payload);
        if padding.iter().any(|&b| b != 0) {
            return Err(());
        }
        Ok(())
    }

    fn finish(self) -> std::result::Result<Block, ()> {
        let h = self.header.ok_or(())?;
        if self.received != h.file_len()
            || self.payload.len() as u64 != h.payload_len
            || self.hasher.finish() != h.payload_sum
        {
            return Err(());
        }
        Ok(Block {
            header: h,
            payload: self.payload,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_client::{encode_block, KvLayout, Namespace};

    fn block(bytes: u64) -> (NamespaceId, BlockKey, Vec<u8>, Vec<u8>) {
        let ns = Namespace::new(
            "m",
            KvLayout::with_block_bytes(bytes).unwrap(),
            "",
            b"t".to_vec(),
        )
        .unwrap();
        let key = BlockKey::from_u64(7);
        let payload: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
        let h = BlockHeader::for_payload(&ns, key, &payload, 1);
        (ns.id(), key, encode_block(&h, &payload), payload)
    }

    fn run(
        ns: &NamespaceId,
        key: &BlockKey,
        file: &[u8],
        split: usize,
    ) -> std::result::Result<Block, ()> {
        let mut r = Receiver::new(ns, key, 1 << 30, Some(file.len() as u64));
        for c in file.chunks(split) {
            r.feed(c)?;
        }
        r.finish()
    }

    #[test]
    fn receiver_accepts_exact_file_in_any_split() {
        let (ns, key, file, payload) = block(10_016);
        for split in [1, 7, 4096, 5000, 1 << 20] {
            let b = run(&ns, &key, &file, split).unwrap();
            assert_eq!(b.payload, payload);
        }
    }

    #[test]
    fn receiver_rejects_every_lie() {
        let (ns, key, file, _) = block(10_016);
        // Flipped byte anywhere: header, payload, padding.
        for at in [0, 100, HEADER_BYTES, HEADER_BYTES + 9_999, file.len() - 1] {
            let mut f = file.clone();
            f[at] ^= 1;
            assert!(run(&ns, &key, &f, 4096).is_err(), "flip at {at}");
        }
        // Truncated, extended.
        assert!(run(&ns, &key, &file[..file.len() - 1], 4096).is_err());
        let mut long = file.clone();
        long.push(0);
        assert!(run(&ns, &key, &long, 4096).is_err());
        // Right bytes, wrong key or namespace.
        assert!(run(&ns, &BlockKey::from_u64(8), &file, 4096).is_err());
        assert!(run(&NamespaceId([9; 16]), &key, &file, 4096).is_err());
        // Size bound.
        let mut r = Receiver::new(&ns, &key, 4096, None);
        assert!(r.feed(&file).is_err());
    }
}
