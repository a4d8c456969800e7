//! A fault-injecting HTTP proxy in front of the real test S3 server
//! ([`super::s3::S3Server`]): loopback only, one upstream connection per
//! request, the `Host` header passed through unchanged (so SigV4
//! signatures made for the proxy's address still verify upstream).
//!
//! A [`FaultRule`] applies to requests whose path contains its filter
//! (by default `/blocks/`: block objects, not readiness probes or peer
//! heartbeats), for its first `count` matches or for all of them. Body
//! faults apply to successful GETs only. Counters tell tests what the
//! client actually sent and received ([`ProxyCounters`]).

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = UnsyncBoxBody<Bytes, BoxError>;

/// One kind of misbehaviour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Forward faithfully.
    None,
    /// Read the request and never answer (the connection stays open).
    NoAnswer,
    /// Answer this status (500, 503, ...) with an S3-style error body.
    Status(u16),
    /// Send the body `chunk_bytes` at a time, `delay_ms` apart.
    SlowBody {
        /// Bytes per chunk.
        chunk_bytes: usize,
        /// Pause before each chunk.
        delay_ms: u64,
    },
    /// Send only the first `keep_bytes` of the body. With
    /// `content_length` the original length is declared and the connection
    /// breaks after the kept bytes; without, the body is sent chunked and
    /// ends cleanly, short.
    Truncate {
        /// Bytes sent.
        keep_bytes: usize,
        /// Keep the original Content-Length header.
        content_length: bool,
    },
    /// Flip the byte at `offset` of the body (the payload starts at 4096).
    WrongBytes {
        /// Offset into the body.
        offset: usize,
    },
    /// Serve `bytes` zero bytes instead of the object, declared in
    /// Content-Length or (without `content_length`) chunked.
    Oversized {
        /// Bytes served.
        bytes: u64,
        /// Declare the length.
        content_length: bool,
    },
    /// A different ETag on every response (as if the object were replaced
    /// between HEAD and GET, or between two GETs).
    EtagChanges,
    /// Send `bytes` of the body, then break the connection (a server
    /// killed mid-GET).
    CutAfter {
        /// Bytes sent before the cut.
        bytes: usize,
    },
}

/// Which requests a fault hits.
#[derive(Debug, Clone)]
pub struct FaultRule {
    /// The fault.
    pub fault: Fault,
    /// Requests whose path contains this (default `/blocks/`).
    pub path_contains: String,
    /// Only these methods (empty: all).
    pub methods: Vec<String>,
    /// The first `count` matching requests; `None`: all of them.
    pub count: Option<u64>,
    /// Only every `every`-th matching request (1: each; 2: every other,
    /// the rest forwarded faithfully): a fault "at a rate".
    pub every: u64,
    /// Also give every faulted response a fresh ETag (with
    /// [`Fault::EtagChanges`] that is the whole fault).
    pub change_etag: bool,
}

impl FaultRule {
    /// `fault` on every block-object request.
    pub fn new(fault: Fault) -> Self {
        FaultRule {
            fault,
            path_contains: "/blocks/".into(),
            methods: Vec::new(),
            count: None,
            every: 1,
            change_etag: false,
        }
    }

    /// Only the first `n` matching requests.
    pub fn times(mut self, n: u64) -> Self {
        self.count = Some(n);
        self
    }

    /// Only requests with this method (`GET`, `HEAD`, `PUT`...).
    pub fn method(mut self, m: &str) -> Self {
        self.methods.push(m.to_string());
        self
    }

    /// Fresh ETags on faulted responses too.
    pub fn with_changing_etag(mut self) -> Self {
        self.change_etag = true;
        self
    }

    /// Only every `n`-th matching request.
    pub fn every(mut self, n: u64) -> Self {
        self.every = n.max(1);
        self
    }
}

/// What went through the proxy.
#[derive(Debug, Default)]
pub struct ProxyCounters {
    /// Requests received.
    pub requests: AtomicU64,
    /// GET requests received.
    pub gets: AtomicU64,
    /// HEAD requests received.
    pub heads: AtomicU64,
    /// PUT requests received.
    pub puts: AtomicU64,
    /// DELETE requests received.
    pub deletes: AtomicU64,
    /// Requests a fault was applied to.
    pub faulted: AtomicU64,
    /// Body bytes sent to clients.
    pub body_bytes_sent: AtomicU64,
}

struct State {
    rule: Option<FaultRule>,
    matched: u64,
    etag_n: u64,
}

struct Shared {
    upstream: SocketAddr,
    state: Mutex<State>,
    counters: ProxyCounters,
}

/// The running proxy; stops on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .finish()
    }
}

impl FaultProxy {
    /// Starts a proxy on 127.0.0.1 in front of `upstream`
    /// (`http://127.0.0.1:port`, loopback only).
    pub fn start(upstream: &str) -> std::io::Result<FaultProxy> {
        let up: SocketAddr = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .parse()
            .map_err(|e| std::io::Error::other(format!("upstream {upstream}: {e}")))?;
        if !up.ip().is_loopback() {
            return Err(std::io::Error::other(
                "the fault proxy only forwards to loopback",
            ));
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream: up,
            state: Mutex::new(State {
                rule: None,
                matched: 0,
                etag_n: 0,
            }),
            counters: ProxyCounters::default(),
        });
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("fault-proxy".into())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(serve(listener, sh, rx));
                rt.shutdown_background();
            })?;
        Ok(FaultProxy {
            addr,
            shared,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:<port>`: point G4's endpoint here.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sets the fault (replacing any); counts of matches restart.
    pub fn set(&self, rule: FaultRule) {
        let mut s = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        s.rule = Some(rule);
        s.matched = 0;
    }

    /// Forward faithfully from now on.
    pub fn clear(&self) {
        let mut s = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        s.rule = None;
    }

    /// The counters.
    pub fn counters(&self) -> &ProxyCounters {
        &self.shared.counters
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = &mut stop => return,
        };
        let Ok((stream, _)) = accepted else { continue };
        let sh = shared.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let sh = sh.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(sh, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn full(b: impl Into<Bytes>) -> Body {
    http_body_util::Full::new(b.into())
        .map_err(|e| -> BoxError { match e {} })
        .boxed_unsync()
}

fn status(code: StatusCode, msg: &str) -> Response<Body> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>Injected</Code><Message>{msg}</Message></Error>"
    );
    let mut r = Response::new(full(body));
    *r.status_mut() = code;
    r
}

/// The fault for this request, if any (and counts the match).
fn pick(sh: &Shared, method: &str, path: &str) -> (Fault, bool) {
    let mut s = sh.state.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rule) = s.rule.clone() else {
        return (Fault::None, false);
    };
    if !path.contains(&rule.path_contains)
        || !(rule.methods.is_empty() || rule.methods.iter().any(|m| m == method))
    {
        return (Fault::None, false);
    }
    s.matched += 1;
    let n = s.matched;
    if rule.count.is_some_and(|c| n > c) || !(n - 1).is_multiple_of(rule.every) {
        return (Fault::None, false);
    }
    let etag = rule.change_etag || rule.fault == Fault::EtagChanges;
    if etag {
        s.etag_n += 1;
    }
    sh.counters.faulted.fetch_add(1, SeqCst);
    (rule.fault, etag)
}

async fn handle(sh: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let c = &sh.counters;
    c.requests.fetch_add(1, SeqCst);
    let method = req.method().as_str().to_string();
    match method.as_str() {
        "GET" => c.gets.fetch_add(1, SeqCst),
        "HEAD" => c.heads.fetch_add(1, SeqCst),
        "PUT" => c.puts.fetch_add(1, SeqCst),
        "DELETE" => c.deletes.fetch_add(1, SeqCst),
        _ => 0,
    };
    let (fault, new_etag) = pick(&sh, &method, req.uri().path());
    match fault {
        Fault::NoAnswer => {
            // Hold the request (and its connection) until the client gives up.
            futures::future::pending::<()>().await;
            unreachable!()
        }
        Fault::Status(code) => {
            let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return status(code, "injected by the fault proxy");
        }
        _ => {}
    }
    let resp = match forward(&sh, req).await {
        Ok(r) => r,
        Err(e) => return status(StatusCode::BAD_GATEWAY, &format!("upstream: {e}")),
    };
    let ok_get = method == "GET" && resp.status().is_success();
    let (mut parts, body) = resp.into_parts();
    if new_etag {
        let n = sh.state.lock().map(|s| s.etag_n).unwrap_or(0);
        if let Ok(v) = hyper::header::HeaderValue::from_str(&format!("\"changed-{n}\"")) {
            parts.headers.insert(hyper::header::ETAG, v);
        }
    }
    let counted = |s: futures::stream::BoxStream<'static, Result<Bytes, BoxError>>,
                   sh: Arc<Shared>| {
        s.map(move |r| {
            if let Ok(b) = &r {
                sh.counters
                    .body_bytes_sent
                    .fetch_add(b.len() as u64, SeqCst);
            }
            r.map(Frame::data)
        })
    };
    let upstream = body
        .into_data_stream()
        .map(|r| r.map_err(|e| -> BoxError { Box::new(e) }))
        .boxed();
    let stream: futures::stream::BoxStream<'static, Result<Bytes, BoxError>> = if !ok_get {
        upstream
    } else {
        match fault {
            Fault::SlowBody {
                chunk_bytes,
                delay_ms,
            } => rechunk(upstream, chunk_bytes.max(1))
                .then(move |r| async move {
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    r
                })
                .boxed(),
            Fault::Truncate {
                keep_bytes,
                content_length,
            } => {
                if !content_length {
                    parts.headers.remove(hyper::header::CONTENT_LENGTH);
                }
                let cut = limit(upstream, keep_bytes);
                if content_length {
                    cut.chain(futures::stream::once(async {
                        Err::<Bytes, BoxError>("truncated by the fault proxy".into())
                    }))
                    .boxed()
                } else {
                    cut
                }
            }
            Fault::CutAfter { bytes } => limit(upstream, bytes)
                .chain(futures::stream::once(async {
                    Err::<Bytes, BoxError>("cut by the fault proxy".into())
                }))
                .boxed(),
            Fault::WrongBytes { offset } => flip(upstream, offset),
            Fault::Oversized {
                bytes,
                content_length,
            } => {
                parts.headers.remove(hyper::header::CONTENT_LENGTH);
                if content_length {
                    if let Ok(v) = hyper::header::HeaderValue::from_str(&bytes.to_string()) {
                        parts.headers.insert(hyper::header::CONTENT_LENGTH, v);
                    }
                }
                zeros(bytes)
            }
            _ => upstream,
        }
    };
    Response::from_parts(
        parts,
        BodyExt::boxed_unsync(StreamBody::new(counted(stream, sh.clone()))),
    )
}

async fn forward(sh: &Shared, req: Request<Incoming>) -> Result<Response<Incoming>, BoxError> {
    let stream = tokio::net::TcpStream::connect(sh.upstream).await?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send.send_request(req).await?)
}

type ByteStream = futures::stream::BoxStream<'static, Result<Bytes, BoxError>>;

/// Re-cuts a body into chunks of at most `n` bytes.
fn rechunk(s: ByteStream, n: usize) -> ByteStream {
    s.flat_map(move |r| {
        let parts: Vec<Result<Bytes, BoxError>> = match r {
            Err(e) => vec![Err(e)],
            Ok(b) => (0..b.len())
                .step_by(n)
                .map(|i| Ok(b.slice(i..(i + n).min(b.len()))))
                .collect(),
        };
        futures::stream::iter(parts)
    })
    .boxed()
}

/// The first `n` bytes of a body.
fn limit(s: ByteStream, n: usize) -> ByteStream {
    futures::stream::unfold((s, n), |(mut s, left)| async move {
        if left == 0 {
            return None;
        }
        match s.next().await? {
            Err(e) => Some((Err(e), (s, 0))),
            Ok(b) => {
                let take = b.len().min(left);
                Some((Ok(b.slice(..take)), (s, left - take)))
            }
        }
    })
    .boxed()
}

/// Flips the byte at `offset`.
fn flip(s: ByteStream, offset: usize) -> ByteStream {
    futures::stream::unfold((s, 0usize), move |(mut s, pos)| async move {
        match s.next().await? {
            Err(e) => Some((Err(e), (s, pos))),
            Ok(b) => {
                let end = pos + b.len();
                let out = if (pos..end).contains(&offset) {
                    let mut v = b.to_vec();
                    v[offset - pos] ^= 0x5a;
                    Bytes::from(v)
                } else {
                    b
                };
                Some((Ok(out), (s, end)))
            }
        }
    })
    .boxed()
}

/// `n` zero bytes, generated lazily 64 KiB at a time.
fn zeros(n: u64) -> ByteStream {
    let chunk = Bytes::from(vec![0u8; 64 << 10]);
    futures::stream::unfold(n, move |left| {
        let chunk = chunk.clone();
        async move {
            if left == 0 {
                return None;
            }
            let take = left.min(chunk.len() as u64) as usize;
            Some((Ok(chunk.slice(..take)), left - take as u64))
        }
    })
    .boxed()
}

/// A TCP endpoint that accepts connections and never answers (for a G4
/// endpoint, or anything else, that hangs). Loopback; stops on drop.
pub struct SilentEndpoint {
    addr: SocketAddr,
    /// Connections accepted.
    pub accepted: Arc<AtomicU64>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SilentEndpoint {
    /// Binds 127.0.0.1 on a free port.
    pub fn start() -> std::io::Result<SilentEndpoint> {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.set_nonblocking(true)?;
        let addr = l.local_addr()?;
        let accepted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (a, st) = (accepted.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !st.load(SeqCst) {
                match l.accept() {
                    Ok((s, _)) => {
                        a.fetch_add(1, SeqCst);
                        held.push(s);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(SilentEndpoint {
            addr,
            accepted,
            stop,
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for SilentEndpoint {
    fn drop(&mut self) {
        self.stop.store(true, SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
