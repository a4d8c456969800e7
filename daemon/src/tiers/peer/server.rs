//! The peer server: HTTP/1.1 over TCP, serving block files to other nodes.
//!
//! Order of checks for every request, cheapest and least revealing first:
//! method (405), signature (401), path (404/400, pure parsing), a transfer
//! permit (503 at once when all are taken), then the source is opened (404
//! when absent) and the file is streamed in `chunk_bytes` pieces through a
//! bounded channel, so memory per transfer is bounded by
//! `chunk_bytes * CHANNEL_CHUNKS` whatever the block size.

use super::auth::{AuthFault, PeerKey};
use super::replay::{Refused, ReplayCache};
use super::source::PeerSource;
use super::unix_ms_now;
use super::wire::{parse_block_path, parse_range, ByteRange, PathFault, RangeRequest};
use crate::base::error::{Error, Result};
use crate::base::http_gate::{self, Gate, GateLimits, Ticket};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::{header, Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::io::{Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

/// Chunks buffered between the file reader and the socket, per transfer.
const CHANNEL_CHUNKS: usize = 4;

/// Peer server settings.
#[derive(Clone)]
pub struct PeerServerConfig {
    /// Address to bind. Defaults to `127.0.0.1:0`; a multi-node deployment
    /// sets the node's private address explicitly. Never `0.0.0.0` unless
    /// an operator writes it.
    pub bind: SocketAddr,
    /// Shared secret (at least 16 bytes), identical on every node.
    pub secret: Vec<u8>,
    /// Largest accepted difference between a request's timestamp and this
    /// node's clock.
    pub clock_skew_ms: u64,
    /// Concurrent block transfers; more get 503 immediately.
    pub transfers_max: usize,
    /// Open connections; more are closed on accept.
    pub connections_max: usize,
    /// Bytes read from the file per chunk.
    pub chunk_bytes: usize,
    /// Time allowed to receive a request's headers.
    pub header_read_timeout_ms: u64,
    /// Time allowed for a new connection's first byte.
    pub first_byte_timeout_ms: u64,
    /// Signatures remembered within the skew window to refuse replays
    /// (about 48 bytes each); past it, signed requests get 503 until some
    /// go stale.
    pub replay_cache_max: usize,
    /// Longest a transfer may wait for the receiver to take the next chunk
    /// before the server gives up on it.
    pub send_stall_timeout_ms: u64,
    /// Largest holdings digest served (`GET /v1/holdings`); 0 serves none
    /// (peers then probe per block).
    pub holdings_bytes_max: u64,
    /// How long a built digest is served before the next request rebuilds
    /// it (building walks the whole index).
    pub holdings_cache_ms: u64,
    /// TEST-ONLY: flip the first payload byte of every block sent, to
    /// simulate a lying peer. Off by default; never set it in production.
    pub corrupt_responses_for_tests: bool,
    /// This node's id: requests must be signed for it (empty: requests
    /// signed for no node, as a client that never heard of this one signs).
    pub node_id: String,
    /// This start's epoch, larger than every earlier start's (the node
    /// records it in its data directory); requests must be signed for it.
    /// `None`: a random one.
    pub epoch: Option<u64>,
}

impl std::fmt::Debug for PeerServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerServerConfig")
            .field("bind", &self.bind)
            .field("secret", &"<redacted>")
            .field("clock_skew_ms", &self.clock_skew_ms)
            .field("transfers_max", &self.transfers_max)
            .field("connections_max", &self.connections_max)
            .field("chunk_bytes", &self.chunk_bytes)
            .field(
                "corrupt_responses_for_tests",
                &self.corrupt_responses_for_tests,
            )
            .finish()
    }
}

impl PeerServerConfig {
    /// Defaults (loopback, ephemeral port) with the given secret.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        PeerServerConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            secret: secret.into(),
            clock_skew_ms: 30_000,
            transfers_max: 16,
            connections_max: 256,
            chunk_bytes: 1 << 20,
            header_read_timeout_ms: 5_000,
            first_byte_timeout_ms: 2_000,
            replay_cache_max: 1 << 19,
            send_stall_timeout_ms: 10_000,
            holdings_bytes_max: 4 << 20,
            holdings_cache_ms: 1_000,
            corrupt_responses_for_tests: false,
            node_id: String::new(),
            epoch: None,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |key: &str, problem: &str| {
            Err(Error::Config {
                key: format!("peer.{key}"),
                problem: problem.into(),
            })
        };
        if self.transfers_max == 0 || self.transfers_max > 4096 {
            return bad("transfers_max", "must be 1 to 4096");
        }
        if self.connections_max < self.transfers_max || self.connections_max > 65_536 {
            return bad(
                "connections_max",
                "must be at least transfers_max and at most 65536",
            );
        }
        if self.replay_cache_max == 0 {
            return bad("replay_cache_max", "must be at least 1");
        }
        if self.first_byte_timeout_ms == 0 {
            return bad("first_byte_timeout_ms", "must be positive");
        }
        if self.chunk_bytes < 4096 || self.chunk_bytes > (16 << 20) {
            return bad("chunk_bytes", "must be 4 KiB to 16 MiB");
        }
        if self.holdings_bytes_max != 0
            && !(super::holdings::DIGEST_BYTES_MIN..=(64 << 20)).contains(&self.holdings_bytes_max)
        {
            return bad(
                "holdings_bytes_max",
                "must be 0 (no digest) or 4096 to 67108864 (64 MiB)",
            );
        }
        Ok(())
    }
}

/// Server-side counters.
#[derive(Debug, Default)]
pub struct PeerServerMetrics {
    /// Requests answered, any status.
    pub requests: AtomicU64,
    /// Transfers started (200/206).
    pub transfers: AtomicU64,
    /// Body bytes queued for sending.
    pub bytes_sent: AtomicU64,
    /// 401 answers.
    pub unauthorized: AtomicU64,
    /// 400/404/405/416 answers to malformed or unknown requests.
    pub rejected: AtomicU64,
    /// 404 answers for well-formed requests of absent blocks.
    pub absent: AtomicU64,
    /// 503 answers (transfer limit reached).
    pub busy: AtomicU64,
    /// Connections closed on accept (every slot held by a connection that
    /// sent a signed request).
    pub connections_refused: AtomicU64,
    /// Connections closed before a signed request to make room for a new
    /// one (silent, or unauthenticated).
    pub connections_evicted: AtomicU64,
    /// Connections accepted and served.
    pub connections: AtomicU64,
    /// Ranged requests (a lookup's header probe asks for bytes 0-4095).
    pub ranged: AtomicU64,
    /// Holdings digests served.
    pub holdings_served: AtomicU64,
    /// Holdings digests built (at most one per `holdings_cache_ms`).
    pub holdings_built: AtomicU64,
}

struct State {
    key: PeerKey,
    cfg: PeerServerConfig,
    source: Arc<dyn PeerSource>,
    transfers: Arc<Semaphore>,
    metrics: Arc<PeerServerMetrics>,
    /// The last digest built and when (one build at a time).
    holdings: tokio::sync::Mutex<Option<(std::time::Instant, Bytes)>>,
    /// Signatures accepted within the skew window (replays refused).
    replay: ReplayCache,
    /// Who requests must be signed for: this node, this start.
    me: super::auth::Target,
    /// `me` as the header every answer carries.
    me_header: header::HeaderValue,
}

/// A running peer server. Dropping it stops accepting and closes every open
/// connection.
pub struct PeerServer {
    local_addr: SocketAddr,
    me: super::auth::Target,
    shutdown: watch::Sender<bool>,
    accept: JoinHandle<()>,
    metrics: Arc<PeerServerMetrics>,
}

impl std::fmt::Debug for PeerServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerServer")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

type RespBody = BoxBody<Bytes, std::io::Error>;

impl PeerServer {
    /// Binds `cfg.bind` and starts serving `source` on the current tokio
    /// runtime.
    pub async fn start(cfg: PeerServerConfig, source: Arc<dyn PeerSource>) -> Result<PeerServer> {
        cfg.validate()?;
        let key = PeerKey::from_secret(&cfg.secret)?;
        let listener = TcpListener::bind(cfg.bind)
            .await
            .map_err(|e| Error::Config {
                key: "peer.bind".into(),
                problem: format!("cannot listen on {}: {e}", cfg.bind),
            })?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the address of", cfg.bind.to_string(), e))?;
        let metrics = Arc::new(PeerServerMetrics::default());
        let (shutdown, rx) = watch::channel(false);
        let me = super::auth::Target {
            node: cfg.node_id.clone(),
            // Never 0: that is a client's "not known yet".
            epoch: cfg.epoch.unwrap_or_else(rand::random::<u64>).max(1),
        };
        let me_header =
            header::HeaderValue::from_str(&me.to_header()).map_err(|_| Error::Config {
                key: "peer.node_id".into(),
                problem: format!("{:?} cannot be a header value", me.node),
            })?;
        let state = Arc::new(State {
            key,
            transfers: Arc::new(Semaphore::new(cfg.transfers_max)),
            replay: ReplayCache::new(cfg.replay_cache_max, cfg.clock_skew_ms),
            me: me.clone(),
            me_header,
            cfg,
            source,
            metrics: metrics.clone(),
            holdings: tokio::sync::Mutex::new(None),
        });
        let accept = tokio::spawn(accept_loop(listener, state, rx));
        Ok(PeerServer {
            local_addr,
            me,
            shutdown,
            accept,
            metrics,
        })
    }

    /// The bound address (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Who requests must be signed for: this node, this start (auth.rs).
    pub fn target(&self) -> super::auth::Target {
        self.me.clone()
    }

    /// Counters.
    pub fn metrics(&self) -> &Arc<PeerServerMetrics> {
        &self.metrics
    }
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        self.accept.abort();
    }
}

static ACCEPT_WARN: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(1000);

async fn accept_loop(listener: TcpListener, state: Arc<State>, shutdown: watch::Receiver<bool>) {
    // Slots are earned by a request that passes the signature check; until
    // then a connection may be evicted for a newer one (http_gate.rs).
    let gate = Gate::new(GateLimits {
        connections_max: state.cfg.connections_max,
        pending_per_addr_max: (state.cfg.connections_max / 4).max(1),
    });
    let first_byte = Duration::from_millis(state.cfg.first_byte_timeout_ms);
    loop {
        gate.room().await;
        let (stream, from) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                crate::warn_limited!(ACCEPT_WARN, "peer server accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some((ticket, mut evicted)) = gate.admit(from.ip()) else {
            state
                .metrics
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        state.metrics.connections.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let mut shutdown = shutdown.clone();
        let gate = gate.clone();
        tokio::spawn(async move {
            let ticket = Arc::new(ticket);
            if !http_gate::first_byte(&stream, first_byte, &mut evicted).await {
                note_evictions(&state, &gate);
                return;
            }
            let svc_state = state.clone();
            let svc_ticket = ticket.clone();
            let svc = hyper::service::service_fn(move |req| {
                let st = svc_state.clone();
                let t = svc_ticket.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(&st, req, &t).await) }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_millis(state.cfg.header_read_timeout_ms));
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                _ = conn => {}
                _ = &mut evicted => note_evictions(&state, &gate),
                _ = shutdown.wait_for(|stop| *stop) => {}
            }
        });
    }
}

/// Copies the gate's eviction count into the server's counters.
fn note_evictions(state: &State, gate: &Gate) {
    let (evicted, _) = gate.counts();
    state
        .metrics
        .connections_evicted
        .fetch_max(evicted, Ordering::Relaxed);
}

fn plain(status: StatusCode, msg: &'static str) -> Response<RespBody> {
    let mut r = Response::new(
        Full::new(Bytes::from_static(msg.as_bytes()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

/// Answers one request; an authenticated request's answer carries the
/// server's proof (auth.rs), whatever its status.
async fn handle(st: &State, req: Request<Incoming>, ticket: &Ticket) -> Response<RespBody> {
    let auth = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let nonce = req
        .headers()
        .get(super::auth::NONCE_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|n| n.len() <= 64)
        .map(str::to_owned);
    let mut r = handle_inner(st, req, ticket).await;
    // Who to sign for: this node, this start (auth.rs); a refusal names
    // it only to a request signed with the secret for another target.
    if r.status() != StatusCode::UNAUTHORIZED {
        r.headers_mut()
            .insert(super::auth::TARGET_HEADER, st.me_header.clone());
    }
    if r.status() != StatusCode::UNAUTHORIZED {
        if let (Some(a), Some(n)) = (auth, nonce) {
            let proof = st.key.prove(&n, &a, r.status().as_u16());
            if let Ok(v) = header::HeaderValue::from_str(&proof) {
                r.headers_mut().insert(super::auth::PROOF_HEADER, v);
            }
        }
    }
    r
}

async fn handle_inner(st: &State, req: Request<Incoming>, ticket: &Ticket) -> Response<RespBody> {
    st.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let reject = |status, msg| {
        st.metrics.rejected.fetch_add(1, Ordering::Relaxed);
        plain(status, msg)
    };
    if req.method() != Method::GET {
        return reject(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    let path = req.uri().path();
    let range_hdr = match req.headers().get(header::RANGE).map(|v| v.to_str()) {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(_)) => return reject(StatusCode::BAD_REQUEST, "bad range header\n"),
    };
    let auth = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let now = unix_ms_now();
    let verified = st.key.verify(
        auth,
        "GET",
        path,
        range_hdr.unwrap_or(""),
        &st.me,
        now,
        st.cfg.clock_skew_ms,
    );
    let verified = match verified.map(|s| st.replay.admit(&s, now)) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(Refused::Replayed)) => Err(AuthFault::Replayed),
        Ok(Err(Refused::Full)) => {
            st.metrics.busy.fetch_add(1, Ordering::Relaxed);
            return plain(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many signed requests in the replay window\n",
            );
        }
        Err(f) => Err(f),
    };
    if let Err(fault) = verified {
        st.metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
        let msg = match fault {
            AuthFault::Missing => "authorization required\n",
            AuthFault::Malformed => "malformed authorization\n",
            AuthFault::Stale => "stale timestamp: check clock sync\n",
            AuthFault::BadSignature => "bad signature: check the shared secret\n",
            AuthFault::Replayed => "replayed request: each signature is accepted once\n",
            AuthFault::OtherTarget => {
                "signed for another node or an earlier start of this one: sign for x-kvtier-node\n"
            }
        };
        let mut r = plain(StatusCode::UNAUTHORIZED, msg);
        if fault == AuthFault::OtherTarget {
            r.headers_mut()
                .insert(super::auth::TARGET_HEADER, st.me_header.clone());
        }
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("kvtier-hmac"),
        );
        return r;
    }
    // A peer that holds the secret: its connection keeps its slot.
    ticket.served();
    if req.uri().query().is_some() {
        return reject(StatusCode::BAD_REQUEST, "no query strings\n");
    }
    if path == super::holdings::HOLDINGS_PATH {
        return holdings(st).await;
    }
    if range_hdr.is_some() {
        st.metrics.ranged.fetch_add(1, Ordering::Relaxed);
    }
    let (ns, key) = match parse_block_path(path) {
        Ok(v) => v,
        Err(PathFault::NotFound) => return reject(StatusCode::NOT_FOUND, "not found\n"),
        Err(PathFault::Malformed) => {
            return reject(StatusCode::BAD_REQUEST, "malformed block path\n")
        }
    };
    let Ok(permit) = st.transfers.clone().try_acquire_owned() else {
        st.metrics.busy.fetch_add(1, Ordering::Relaxed);
        let mut r = plain(StatusCode::SERVICE_UNAVAILABLE, "busy\n");
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return r;
    };
    // The store may block (index lookups, a cold directory): keep it off
    // the async workers.
    let source = st.source.clone();
    let opened = tokio::task::spawn_blocking(move || source.open_block(&ns, &key))
        .await
        .unwrap_or_else(|e| {
            Err(Error::Peer {
                peer: "self".into(),
                detail: format!("open task failed: {e}"),
            })
        });
    let (file, len) = match opened {
        Ok(Some(f)) => f,
        Ok(None) => {
            st.metrics.absent.fetch_add(1, Ordering::Relaxed);
            return plain(StatusCode::NOT_FOUND, "block not held\n");
        }
        Err(e) => {
            tracing::warn!("peer server: opening {ns}/{key:?}: {e}");
            return plain(StatusCode::INTERNAL_SERVER_ERROR, "store error\n");
        }
    };
    let (range, status) = match parse_range(range_hdr, len) {
        RangeRequest::Whole => (ByteRange { start: 0, end: len }, StatusCode::OK),
        RangeRequest::Partial(r) => (r, StatusCode::PARTIAL_CONTENT),
        RangeRequest::Unsatisfiable => {
            let mut r = reject(
                StatusCode::RANGE_NOT_SATISFIABLE,
                "range outside the block\n",
            );
            if let Ok(v) = header::HeaderValue::from_str(&format!("bytes */{len}")) {
                r.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            return r;
        }
        RangeRequest::Malformed => {
            return reject(StatusCode::BAD_REQUEST, "one bytes= range only\n")
        }
    };
    st.metrics.transfers.fetch_add(1, Ordering::Relaxed);
    let body = stream_file(st, file, range, permit);
    let mut r = Response::new(body);
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_LENGTH,
        header::HeaderValue::from(range.end - range.start),
    );
    h.insert(
        header::ACCEPT_RANGES,
        header::HeaderValue::from_static("bytes"),
    );
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/octet-stream"),
    );
    if status == StatusCode::PARTIAL_CONTENT {
        if let Ok(v) =
            header::HeaderValue::from_str(&format!("bytes {}-{}/{len}", range.start, range.end - 1))
        {
            h.insert(header::CONTENT_RANGE, v);
        }
    }
    r
}

/// The holdings digest, rebuilt when the cached one is older than
/// `holdings_cache_ms` (404 when this node publishes none).
async fn holdings(st: &State) -> Response<RespBody> {
    if st.cfg.holdings_bytes_max == 0 {
        return plain(StatusCode::NOT_FOUND, "no holdings digest published\n");
    }
    let mut cached = st.holdings.lock().await;
    let fresh = cached
        .as_ref()
        .is_some_and(|(t, _)| t.elapsed() < Duration::from_millis(st.cfg.holdings_cache_ms));
    if !fresh {
        let source = st.source.clone();
        let max = st.cfg.holdings_bytes_max;
        let built = tokio::task::spawn_blocking(move || source.holdings(max))
            .await
            .unwrap_or_else(|e| {
                Err(Error::Peer {
                    peer: "self".into(),
                    detail: format!("holdings task failed: {e}"),
                })
            });
        match built {
            Ok(Some(d)) => {
                st.metrics.holdings_built.fetch_add(1, Ordering::Relaxed);
                *cached = Some((std::time::Instant::now(), Bytes::from(d.encode())));
            }
            Ok(None) => {
                return plain(StatusCode::NOT_FOUND, "no holdings digest published\n");
            }
            Err(e) => {
                tracing::warn!("peer server: building the holdings digest: {e}");
                return plain(StatusCode::INTERNAL_SERVER_ERROR, "store error\n");
            }
        }
    }
    let Some((_, body)) = cached.as_ref() else {
        return plain(StatusCode::INTERNAL_SERVER_ERROR, "store error\n");
    };
    st.metrics.holdings_served.fetch_add(1, Ordering::Relaxed);
    let mut r = Response::new(
        Full::new(body.clone())
            .map_err(|never| match never {})
            .boxed(),
    );
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/octet-stream"),
    );
    r
}

/// A body fed by a reader task through a bounded channel.
struct ChannelBody {
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
    remaining: u64,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, std::io::Error>>> {
        self.rx.poll_recv(cx).map(|o| {
            o.map(|r| {
                r.map(|b| {
                    self.remaining = self.remaining.saturating_sub(b.len() as u64);
                    Frame::data(b)
                })
            })
        })
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.remaining)
    }
}

fn stream_file(
    st: &State,
    file: std::fs::File,
    range: ByteRange,
    permit: OwnedSemaphorePermit,
) -> RespBody {
    let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
    let chunk = st.cfg.chunk_bytes as u64;
    let corrupt_at = st
        .cfg
        .corrupt_responses_for_tests
        .then_some(kvtier_client::block::HEADER_BYTES as u64);
    let stall = Duration::from_millis(st.cfg.send_stall_timeout_ms);
    let metrics = st.metrics.clone();
    let file = Arc::new(file);
    tokio::spawn(async move {
        // The permit lives as long as the transfer does.
        let _permit = permit;
        let mut off = range.start;
        while off < range.end {
            let n = chunk.min(range.end - off) as usize;
            let f = file.clone();
            let read = tokio::task::spawn_blocking(move || read_chunk(&f, off, n))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            let item = match read {
                Ok(mut buf) => {
                    if let Some(at) = corrupt_at {
                        if (off..off + n as u64).contains(&at) {
                            buf[(at - off) as usize] ^= 0xff;
                        }
                    }
                    Ok(Bytes::from(buf))
                }
                Err(e) => Err(e),
            };
            let failed = item.is_err();
            match tokio::time::timeout(stall, tx.send(item)).await {
                Ok(Ok(())) if !failed => {}
                _ => return,
            }
            metrics.bytes_sent.fetch_add(n as u64, Ordering::Relaxed);
            off += n as u64;
        }
    });
    ChannelBody {
        rx,
        remaining: range.end - range.start,
    }
    .boxed()
}

/// Reads exactly `n` bytes at `off` into a fresh buffer. `read_to_end`
/// fills spare capacity without zeroing it first, which matters at
/// loopback speeds.
fn read_chunk(file: &std::fs::File, off: u64, n: usize) -> std::io::Result<Vec<u8>> {
    let mut f = file;
    f.seek(SeekFrom::Start(off))?;
    let mut buf = Vec::with_capacity(n);
    f.take(n as u64).read_to_end(&mut buf)?;
    if buf.len() != n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "block file ended at {} of {} bytes",
                off + buf.len() as u64,
                off + n as u64
            ),
        ));
    }
    Ok(buf)
}
