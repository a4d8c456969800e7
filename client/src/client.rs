//! The blocking client inference workers link to talk to `kvtierd`.
//!
//! **Fail open.** The data-path calls ([`NsHandle::lookup`],
//! [`NsHandle::offload`], [`NsHandle::onboard_into`]) never return an error
//! and never hang: every call runs under the configured deadline, and a
//! dead daemon, a timeout, a refused request, a corrupt block or a storage
//! failure comes back as a [`Miss`] with its [`MissCause`], so the engine
//! simply recomputes. After a failure the connection is dropped and the next
//! call reconnects by itself: at once when the daemon was gone (a refused
//! connect costs microseconds, and a restarted daemon is reached on the
//! next call), at most once per [`ClientConfig::reconnect_backoff_ms`]
//! after a timeout or a refusal by a daemon that is there. A kept
//! connection that a daemon restart cut is retried once on a fresh one
//! within the call's deadline, so the first call after a restart succeeds.
//!
//! **Integrity.** The client verifies what it onboards itself, whatever the
//! mode: it decodes and validates the block header the daemon placed in the
//! shared region (or reads it from the passed file), checks that it names
//! the requested key and namespace and agrees with the reply, copies the
//! payload into the caller's buffer, and compares the checksum of the bytes *in
//! the caller's buffer* with the header's checksum. Bytes that fail are a
//! `Miss(Corrupt)`, and the caller's buffer content is then unspecified.
//! This check is the only hash of the payload on the shared-region path
//! (the daemon checks the header it places there, not the payload), so a
//! block the daemon served that fails it is reported to the daemon, which
//! re-verifies, quarantines and repairs its copy, and is onboarded once
//! more within the same call.
//!
//! Bulk bytes go through a sealed shared region (see [`crate::shm`]); the
//! socket carries only small frames.

use crate::block::{padded_len, BlockHeader, HEADER_BYTES};
use crate::error::{Error, Result};
use crate::events::KvEvent;
use crate::key::BlockKey;
use crate::namespace::{Namespace, NamespaceId};
use crate::proto::{
    self, BlockStat, ItemStatus, ListEntry, OffloadItem, OnboardItem, OnboardMode, Request,
    Response, FDS_MAX, KEYS_MAX, LOOKUP_NAMESPACES_MAX,
};
use crate::shm::Region;
use crate::types::{Hints, Tier};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod pool;
pub use pool::{Pool, PoolBlock};

/// A refused connect (`EACCES`) with what the caller lacks appended (the
/// path that refused, its owner, group and mode, the caller's uid and
/// groups: [`crate::access_hint`]); any other error as it is.
fn explain_denied(sock: &Path, e: std::io::Error) -> std::io::Error {
    if e.kind() != std::io::ErrorKind::PermissionDenied {
        return e;
    }
    match crate::access_hint::access_hint(sock) {
        Some(hint) => std::io::Error::new(e.kind(), format!("{e}; {hint}")),
        None => e,
    }
}

/// Where a list page ends: pass it back as `after`.
pub type ListCursor = (NamespaceId, BlockKey);

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The daemon's socket.
    pub socket: PathBuf,
    /// Size of the shared region (bounds one batch's bytes).
    pub region_bytes: u64,
    /// Deadline of every call.
    pub timeout_ms: u64,
    /// Onboard by reading the block file from a passed fd instead of having
    /// the daemon copy into the region.
    pub direct_read: bool,
    /// Minimum pause between reconnect attempts after a timeout or a
    /// refusal (a daemon that is gone is tried again on the next call).
    pub reconnect_backoff_ms: u64,
}

impl ClientConfig {
    /// Defaults: 64 MiB region, 2 s deadline, shared-region onboard.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        ClientConfig {
            socket: socket.into(),
            region_bytes: 64 << 20,
            timeout_ms: 2000,
            direct_read: false,
            reconnect_backoff_ms: 50,
        }
    }
}

/// Why a data-path call missed. More variants may come: match with a `_` arm.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissCause {
    /// Not stored.
    Absent,
    /// Stored but failed verification (in the daemon or in this client).
    Corrupt,
    /// The daemon is unreachable or went away.
    Unavailable,
    /// The deadline passed.
    Timeout,
    /// The daemon refused the request (limits, invalid input, protocol).
    Refused,
    /// The store is full.
    NoSpace,
    /// Any other storage failure.
    Storage,
    /// The caller's buffer or the shared region is too small for the block.
    TooLarge,
}

impl MissCause {
    /// The cause's stable name (`absent`, `no_space`, ...), as the Python
    /// package and the tools print it.
    pub fn name(self) -> &'static str {
        match self {
            MissCause::Absent => "absent",
            MissCause::Corrupt => "corrupt",
            MissCause::Unavailable => "unavailable",
            MissCause::Timeout => "timeout",
            MissCause::Refused => "refused",
            MissCause::NoSpace => "no_space",
            MissCause::Storage => "storage",
            MissCause::TooLarge => "too_large",
        }
    }
}

/// A miss, with what caused it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Miss {
    /// The class.
    pub cause: MissCause,
    /// Details for logs.
    pub detail: String,
}

impl Miss {
    pub(crate) fn new(cause: MissCause, detail: impl Into<String>) -> Self {
        Miss {
            cause,
            detail: detail.into(),
        }
    }

    pub(crate) fn from_error(e: &Error) -> Self {
        let cause = match e {
            Error::Timeout { .. } => MissCause::Timeout,
            Error::Unavailable { .. } | Error::Io { .. } => MissCause::Unavailable,
            Error::Format { .. } => MissCause::Corrupt,
            _ => MissCause::Refused,
        };
        Miss::new(cause, e.to_string())
    }

    pub(crate) fn from_status(s: ItemStatus) -> Self {
        let cause = match s {
            ItemStatus::Absent => MissCause::Absent,
            ItemStatus::Corrupt => MissCause::Corrupt,
            ItemStatus::Unavailable => MissCause::Unavailable,
            ItemStatus::NoSpace => MissCause::NoSpace,
            ItemStatus::Invalid | ItemStatus::LimitReached => MissCause::Refused,
            _ => MissCause::Storage,
        };
        Miss::new(cause, format!("daemon: {s:?}"))
    }
}

/// Result of a lookup: the cached prefix and where each block of it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupResult {
    /// Tier of each block of the cached prefix.
    pub tiers: Vec<Tier>,
    /// Set when the lookup itself failed (the prefix is then empty).
    pub miss: Option<Miss>,
}

impl LookupResult {
    /// Number of leading blocks that are cached.
    pub fn prefix_len(&self) -> usize {
        self.tiers.len()
    }
}

/// One block to offload.
#[derive(Debug, Clone, Copy)]
pub struct OffloadBlock<'a> {
    /// Its key.
    pub key: BlockKey,
    /// The previous block of its chain.
    pub parent: Option<BlockKey>,
    /// The bytes (exactly the namespace layout's block size).
    pub payload: &'a [u8],
    /// Hints.
    pub hints: Hints,
}

/// Outcome of offloading one block. More variants may come: match with a `_` arm.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OffloadOutcome {
    /// Stored and durable.
    Stored,
    /// Stored and durable, but its pin hint was refused: the daemon's pin
    /// budget is spent, so the block is evicted like any other. Pin fewer
    /// blocks, unpin others, or give G3 more capacity (the budget is half
    /// of it).
    StoredUnpinned,
    /// Already there; nothing written.
    AlreadyPresent,
    /// Not stored.
    Failed(Miss),
}

impl OffloadOutcome {
    /// The outcome a daemon's per-item status means.
    pub(crate) fn from_status(s: ItemStatus) -> Self {
        match s {
            ItemStatus::Ok => OffloadOutcome::Stored,
            ItemStatus::StoredUnpinned => OffloadOutcome::StoredUnpinned,
            ItemStatus::AlreadyPresent => OffloadOutcome::AlreadyPresent,
            s => OffloadOutcome::Failed(Miss::from_status(s)),
        }
    }

    /// Newly stored by this offload (pinned as asked or not).
    pub fn is_stored(&self) -> bool {
        matches!(
            self,
            OffloadOutcome::Stored | OffloadOutcome::StoredUnpinned
        )
    }
}

/// Outcome of onboarding one block. More variants may come: match with a `_` arm.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Onboarded {
    /// The verified payload is in the caller's buffer.
    Hit {
        /// Where it came from.
        tier: Tier,
        /// Bytes written at the start of the buffer.
        payload_len: u64,
    },
    /// Not served: recompute.
    Miss(Miss),
}

impl Onboarded {
    /// Whether the block was served.
    pub fn is_hit(&self) -> bool {
        matches!(self, Onboarded::Hit { .. })
    }
}

struct Conn {
    sock: UnixStream,
    region: Option<Arc<Region>>,
    next_req: u32,
    /// The read/write timeout the socket has now (shortened under a call
    /// deadline, see [`Client::within_deadline`]).
    io_timeout: Duration,
}

impl Conn {
    fn new(sock: UnixStream, region: Option<Arc<Region>>) -> Conn {
        Conn {
            io_timeout: sock.read_timeout().ok().flatten().unwrap_or(Duration::ZERO),
            sock,
            region,
            next_req: 1,
        }
    }
}

thread_local! {
    /// The deadline of the call this thread is in, when one was set by
    /// [`Client::within_deadline`]: every exchange of the call, however
    /// many parts a large batch is cut into, ends by then.
    static CALL_DEADLINE: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// Whether a failure starts the reconnect back-off. A daemon that is gone
/// (nothing listening, the connection broken or reset: `Unavailable`)
/// costs the next call one refused connect, microseconds, and a daemon
/// that came back is reached at once; without that the first calls after
/// every restart missed for nothing. A daemon that is there but hung or
/// refusing (a timeout, an error reply, a protocol failure) would make
/// every call wait out its deadline or redo the hello: those back off.
/// What sending a request came to.
enum Sent {
    /// Sent, with this request id.
    Id(u32),
    /// The daemon had refused the connection (its error frame).
    Refused(Response),
}

fn backs_off(e: &Error) -> bool {
    !matches!(e, Error::Unavailable { .. })
}

/// A connection to `kvtierd` that reconnects by itself. Calls on one
/// `Client` are serialised; open one per worker thread for parallelism.
pub struct Client {
    cfg: ClientConfig,
    conn: Mutex<Option<Conn>>,
    /// When a call last failed in a way the back-off applies to.
    last_failure: Mutex<Option<Instant>>,
    /// A region that outlives connections (set by [`Client::alloc_pool`]):
    /// every (re)connect hands the daemon this one instead of a fresh one.
    pub(crate) persistent_region: Mutex<Option<Arc<Region>>>,
    /// The daemon refused `LookupMany` as an unknown op (one older than
    /// the client, met in a rolling upgrade): lookups go one namespace at a
    /// time from then on, instead of a refused request and a reconnect each.
    lookup_many_refused: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Client({})", self.cfg.socket.display())
    }
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn io_to_error(socket: &Path, op: &'static str, timeout_ms: u64, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            Error::Timeout { op, timeout_ms }
        }
        _ => Error::Unavailable {
            socket: socket.to_path_buf(),
            source: e,
        },
    }
}

impl Client {
    /// Connects now (so that a wrong path is reported at once) with default
    /// settings. Later failures reconnect by themselves.
    pub fn connect(socket: impl AsRef<Path>) -> Result<Client> {
        let c = Client::with_config(ClientConfig::new(socket.as_ref()));
        c.ensure_connected()?;
        Ok(c)
    }

    /// A client that connects on first use.
    pub fn with_config(cfg: ClientConfig) -> Client {
        Client {
            cfg,
            conn: Mutex::new(None),
            last_failure: Mutex::new(None),
            persistent_region: Mutex::new(None),
            lookup_many_refused: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The settings.
    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// A handle for one namespace.
    pub fn namespace(&self, ns: &Namespace) -> NsHandle<'_> {
        NsHandle {
            client: self,
            ns: ns.clone(),
            id: ns.id(),
        }
    }

    /// Connects if not connected.
    pub fn ensure_connected(&self) -> Result<()> {
        let mut g = self.conn.lock().map_err(|_| poisoned())?;
        if g.is_none() {
            *g = Some(self.open()?);
        }
        Ok(())
    }

    fn open(&self) -> Result<Conn> {
        // A call whose deadline has passed is not the daemon's failure:
        // checked before the back-off bookkeeping.
        self.io_timeout("connect")?;
        if let Ok(lf) = self.last_failure.lock() {
            if let Some(t) = *lf {
                if t.elapsed() < Duration::from_millis(self.cfg.reconnect_backoff_ms) {
                    return Err(Error::Unavailable {
                        socket: self.cfg.socket.clone(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::NotConnected,
                            "reconnect backoff after a failure",
                        ),
                    });
                }
            }
        }
        let r = self.open_now();
        if let Ok(mut lf) = self.last_failure.lock() {
            *lf = match &r {
                Err(e) if backs_off(e) => Some(Instant::now()),
                _ => None,
            };
        }
        r
    }

    /// Runs `f` (any number of this client's calls: a batch of any size
    /// cut into protocol parts, a lookup then a load) under one deadline,
    /// `timeout_ms` from now: each exchange's socket timeout is what is
    /// left of it, and a part that would start after it fails with
    /// [`Error::Timeout`] (a data call's parts then miss `Timeout`) without
    /// touching the connection. Nested calls keep the outer deadline.
    pub fn within_deadline<T>(&self, f: impl FnOnce() -> T) -> T {
        self.within_deadline_since(Instant::now(), f)
    }

    /// [`Self::within_deadline`] with the deadline `timeout_ms` after
    /// `start`: a caller that did work of its own for this call first
    /// (converting a million keys from Python objects) counts it in.
    pub fn within_deadline_since<T>(&self, start: Instant, f: impl FnOnce() -> T) -> T {
        if CALL_DEADLINE.get().is_some() {
            return f();
        }
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                CALL_DEADLINE.set(None);
            }
        }
        // An Instant too far ahead to represent is no deadline at all.
        CALL_DEADLINE.set(start.checked_add(Duration::from_millis(self.cfg.timeout_ms)));
        let _reset = Reset;
        f()
    }

    /// The timeout of the next read or write: `timeout_ms`, or what is
    /// left of the call's deadline when that is sooner (an error once it
    /// has passed).
    fn io_timeout(&self, op: &'static str) -> Result<Duration> {
        let full = Duration::from_millis(self.cfg.timeout_ms.max(1));
        match CALL_DEADLINE.get() {
            None => Ok(full),
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Ok(left.min(full)),
                _ => Err(Error::Timeout {
                    op,
                    timeout_ms: self.cfg.timeout_ms,
                }),
            },
        }
    }

    /// A new connection to the daemon with the deadline on every read and
    /// write (`op` names it in errors).
    fn dial(&self, op: &'static str) -> Result<UnixStream> {
        let sock = &self.cfg.socket;
        let t = self.io_timeout(op)?;
        let stream = UnixStream::connect(sock).map_err(|e| Error::Unavailable {
            socket: sock.clone(),
            source: explain_denied(sock, e),
        })?;
        let io = |e| io_to_error(sock, op, self.cfg.timeout_ms, e);
        stream.set_read_timeout(Some(t)).map_err(io)?;
        stream.set_write_timeout(Some(t)).map_err(io)?;
        Ok(stream)
    }

    fn open_now(&self) -> Result<Conn> {
        let stream = self.dial("connect")?;
        let persistent = self
            .persistent_region
            .lock()
            .map_err(|_| poisoned())?
            .clone();
        let region = if let Some(r) = persistent {
            Some(r)
        } else if self.cfg.region_bytes > 0 {
            Some(Arc::new(Region::create(self.cfg.region_bytes).map_err(
                |e| Error::Io {
                    path: PathBuf::from("memfd"),
                    source: e,
                },
            )?))
        } else {
            None
        };
        let hello = Request::Hello {
            shm_bytes: region.as_ref().map(|r| r.len() as u64).unwrap_or(0),
            pid: std::process::id(),
        };
        let fds: Vec<i32> = region.iter().map(|r| r.fd().as_raw_fd()).collect();
        let mut conn = Conn::new(stream, region);
        let (resp, _) = self.exchange(&mut conn, &hello, &fds)?;
        match resp {
            Response::Hello { .. } => Ok(conn),
            Response::Error { code, message } => Err(Error::Remote { code, message }),
            other => Err(Error::Protocol {
                reason: format!("unexpected hello reply {other:?}"),
            }),
        }
    }

    fn exchange(
        &self,
        conn: &mut Conn,
        req: &Request,
        fds: &[i32],
    ) -> Result<(Response, Vec<OwnedFd>)> {
        match self.send_req(conn, req, fds)? {
            Sent::Id(id) => self.recv_reply(conn, req.op(), id),
            Sent::Refused(r) => Ok((r, Vec::new())),
        }
    }

    /// Sends one request frame; its id, or the refusal a daemon that
    /// closed the connection without reading left for us.
    fn send_req(&self, conn: &mut Conn, req: &Request, fds: &[i32]) -> Result<Sent> {
        let id = conn.next_req;
        conn.next_req = conn.next_req.wrapping_add(1);
        let frame = req.encode(id);
        let op = req.op();
        if let Err(e) = proto::send_frame(conn.sock.as_raw_fd(), &frame, fds) {
            // A daemon that refuses a connection (not a tenant, busy)
            // answers one error frame and closes without reading: the
            // refusal is still readable and says more than EPIPE.
            let mut f = Vec::new();
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                if let Ok(body) = proto::recv_frame(conn.sock.as_raw_fd(), &mut f) {
                    if let Ok((_, r @ Response::Error { .. })) = Response::decode(&body, op) {
                        return Ok(Sent::Refused(r));
                    }
                }
            }
            return Err(io_to_error(
                &self.cfg.socket,
                Request::op_name(op),
                self.cfg.timeout_ms,
                e,
            ));
        }
        Ok(Sent::Id(id))
    }

    /// Reads the reply to request `id` (of op `op`), the next frame on
    /// the connection: the daemon answers a connection's requests in the
    /// order they came.
    fn recv_reply(&self, conn: &mut Conn, op: u8, id: u32) -> Result<(Response, Vec<OwnedFd>)> {
        let sock = &self.cfg.socket;
        let tmo = self.cfg.timeout_ms;
        let name = Request::op_name(op);
        let mut got_fds = Vec::new();
        let body = proto::recv_frame(conn.sock.as_raw_fd(), &mut got_fds).map_err(|e| match e {
            proto::RecvError::Closed => Error::Unavailable {
                socket: sock.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "daemon closed the connection",
                ),
            },
            proto::RecvError::TooLarge(n) => Error::Protocol {
                reason: format!("reply frame of {n} bytes"),
            },
            // Too many passed fds (closed by the receive).
            proto::RecvError::Io(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                Error::Protocol {
                    reason: e.to_string(),
                }
            }
            proto::RecvError::Io(e) => io_to_error(sock, name, tmo, e),
        })?;
        let (rid, resp) = Response::decode(&body, op)?;
        // Refusals at accept carry request id 0.
        if rid != id && !(rid == 0 && matches!(resp, Response::Error { .. })) {
            return Err(Error::Protocol {
                reason: format!("reply to request {rid}, expected {id}"),
            });
        }
        Ok((resp, got_fds))
    }

    /// Shortens the connection's socket timeouts to what is left of the
    /// call's deadline (`op` names a deadline already past).
    fn fit_timeout(&self, conn: &mut Conn, op: &'static str) -> Result<()> {
        let t = self.io_timeout(op)?;
        if t != conn.io_timeout {
            conn.sock
                .set_read_timeout(Some(t))
                .and_then(|()| conn.sock.set_write_timeout(Some(t)))
                .map_err(|e| io_to_error(&self.cfg.socket, "timeout", self.cfg.timeout_ms, e))?;
            conn.io_timeout = t;
        }
        Ok(())
    }

    /// Runs one request (connecting first if needed); a failure drops the
    /// connection so the next call starts fresh. `f` runs with the region
    /// and the reply while the connection is still held.
    ///
    /// A connection kept from an earlier call may have been cut by a
    /// daemon restart (the first send then fails with a broken pipe, or
    /// the reply never comes): when such a kept connection fails as
    /// `Unavailable`, the request is built again and sent once more on a
    /// fresh connection, within the same deadline. Every request is safe
    /// to repeat (blocks are immutable and content-addressed; pins, leases
    /// and evictions converge), and a daemon that is really gone costs the
    /// retry one refused connect.
    pub(crate) fn call<T>(
        &self,
        mut build: impl FnMut(Option<&Region>) -> Result<Request>,
        f: impl FnOnce(Option<&Region>, Response, Vec<OwnedFd>) -> Result<T>,
    ) -> Result<T> {
        let (mut g, mut kept) = self.connection()?;
        loop {
            let Some(conn) = g.as_mut() else {
                return Err(poisoned());
            };
            let req = build(conn.region.as_deref())?;
            // Past the call's deadline nothing is sent, and the connection
            // (idle, in step) stays.
            self.io_timeout(Request::op_name(req.op()))?;
            if let Err(e) = self.fit_timeout(conn, Request::op_name(req.op())) {
                *g = None;
                return Err(e);
            }
            match self.exchange(conn, &req, &[]) {
                Ok((Response::Error { code, message }, _)) => {
                    // The daemon closes the connection after an error reply.
                    *g = None;
                    return Err(Error::Remote { code, message });
                }
                Ok((resp, fds)) => return f(conn.region.as_deref(), resp, fds),
                Err(e) => {
                    *g = None;
                    if kept && matches!(e, Error::Unavailable { .. }) {
                        // Once: the fresh connection's failure stands.
                        kept = false;
                        *g = Some(self.open()?);
                        continue;
                    }
                    self.note_failure(&e);
                    return Err(e);
                }
            }
        }
    }

    /// The connection (opened if there is none), and whether it was kept
    /// from an earlier call (a daemon restart may have cut it).
    fn connection(&self) -> Result<(std::sync::MutexGuard<'_, Option<Conn>>, bool)> {
        let mut g = self.conn.lock().map_err(|_| poisoned())?;
        let kept = g.is_some();
        if g.is_none() {
            *g = Some(self.open()?);
        }
        Ok((g, kept))
    }

    /// Starts the back-off after a failure that calls for one.
    fn note_failure(&self, e: &Error) {
        if backs_off(e) {
            if let Ok(mut lf) = self.last_failure.lock() {
                *lf = Some(Instant::now());
            }
        }
    }

    /// Runs `count` requests on one connection with two in flight:
    /// request `i + 1` is sent before reply `i` is read, so the daemon
    /// works on it (its disk reads) while `f` handles reply `i` (the
    /// client's copy and check). Request `i + 2` is built only after
    /// `f(i)` returned, so it may reuse what request `i` used (half of the
    /// shared region). A connection kept from an earlier call that a
    /// daemon restart cut is replaced once, as in [`Client::call`], when
    /// no reply was handled yet. Any error drops the connection (a reply
    /// may still be in flight); the requests before it were handled.
    pub(crate) fn call_pipelined(
        &self,
        count: usize,
        mut build: impl FnMut(usize, Option<&Region>) -> Result<Request>,
        mut f: impl FnMut(usize, Option<&Region>, Response) -> Result<()>,
    ) -> Result<()> {
        let (mut g, mut kept) = self.connection()?;
        loop {
            let Some(conn) = g.as_mut() else {
                return Err(poisoned());
            };
            let mut done = 0;
            match self.pipeline(conn, count, &mut build, &mut f, &mut done) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    *g = None;
                    if kept && done == 0 && matches!(e, Error::Unavailable { .. }) {
                        kept = false;
                        *g = Some(self.open()?);
                        continue;
                    }
                    self.note_failure(&e);
                    return Err(e);
                }
            }
        }
    }

    fn pipeline(
        &self,
        conn: &mut Conn,
        count: usize,
        build: &mut impl FnMut(usize, Option<&Region>) -> Result<Request>,
        f: &mut impl FnMut(usize, Option<&Region>, Response) -> Result<()>,
        done: &mut usize,
    ) -> Result<()> {
        let mut in_flight: std::collections::VecDeque<(u8, u32)> = Default::default();
        let mut next = 0;
        while *done < count {
            while next < count && next < *done + 2 {
                let req = build(next, conn.region.as_deref())?;
                self.fit_timeout(conn, Request::op_name(req.op()))?;
                match self.send_req(conn, &req, &[])? {
                    Sent::Id(id) => in_flight.push_back((req.op(), id)),
                    Sent::Refused(Response::Error { code, message }) => {
                        return Err(Error::Remote { code, message })
                    }
                    Sent::Refused(r) => return Err(unexpected(r)),
                }
                next += 1;
            }
            let Some((op, id)) = in_flight.pop_front() else {
                return Err(poisoned());
            };
            self.fit_timeout(conn, Request::op_name(op))?;
            match self.recv_reply(conn, op, id)? {
                // The daemon closes the connection after an error reply.
                (Response::Error { code, message }, _) => {
                    return Err(Error::Remote { code, message })
                }
                (resp, _) => f(*done, conn.region.as_deref(), resp)?,
            }
            *done += 1;
        }
        Ok(())
    }

    /// Daemon statistics (the JSON document `kvtier stats` prints).
    pub fn stats(&self) -> Result<serde_json::Value> {
        self.call(
            |_| Ok(Request::Stats),
            |_, r, _| match r {
                Response::Stats { json } => {
                    serde_json::from_str(&json).map_err(|e| Error::Protocol {
                        reason: format!("stats JSON: {e}"),
                    })
                }
                other => Err(unexpected(other)),
            },
        )
    }

    /// One page of stored blocks, in (namespace, key) order.
    pub fn list(
        &self,
        ns: Option<NamespaceId>,
        after: Option<(NamespaceId, BlockKey)>,
        limit: u32,
    ) -> Result<(Vec<ListEntry>, Option<ListCursor>)> {
        self.call(
            |_| {
                Ok(Request::List {
                    ns,
                    after,
                    limit: limit.clamp(1, KEYS_MAX as u32),
                })
            },
            |_, r, _| match r {
                Response::List { entries, next } => Ok((entries, next)),
                other => Err(unexpected(other)),
            },
        )
    }

    /// Releases leases.
    pub fn release(&self, leases: &[u64]) -> Result<()> {
        for chunk in leases.chunks(KEYS_MAX) {
            self.call(
                |_| {
                    Ok(Request::Release {
                        leases: chunk.to_vec(),
                    })
                },
                |_, _, _| Ok(()),
            )?;
        }
        Ok(())
    }

    /// The longest cached prefix of `chain` in each of `nss` (the same
    /// chain under several namespaces: a tensor-parallel group's ranks),
    /// one request per `KEYS_MAX` keys whatever the number of namespaces
    /// (at most [`LOOKUP_NAMESPACES_MAX`]). Results in `nss` order; a
    /// failed request is a miss with its cause in each, as
    /// [`NsHandle::lookup`].
    pub fn lookup_many(&self, nss: &[NamespaceId], chain: &[BlockKey]) -> Vec<LookupResult> {
        let miss = |e: &Error| LookupResult {
            tiers: Vec::new(),
            miss: Some(Miss::from_error(e)),
        };
        if nss.is_empty() || nss.len() > LOOKUP_NAMESPACES_MAX {
            let e = Error::Protocol {
                reason: format!(
                    "lookup_many takes 1..={LOOKUP_NAMESPACES_MAX} namespaces, got {}",
                    nss.len()
                ),
            };
            return nss.iter().map(|_| miss(&e)).collect();
        }
        let one_by_one = || nss.iter().map(|ns| self.lookup_id(*ns, chain)).collect();
        if self
            .lookup_many_refused
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return one_by_one();
        }
        let mut out: Vec<LookupResult> = nss
            .iter()
            .map(|_| LookupResult {
                tiers: Vec::new(),
                miss: None,
            })
            .collect();
        // Namespaces whose prefix covers every part so far: only they are
        // asked about the next part.
        let mut open: Vec<usize> = (0..nss.len()).collect();
        for part in chain.chunks(KEYS_MAX) {
            if open.is_empty() {
                break;
            }
            let ask: Vec<NamespaceId> = open.iter().map(|&i| nss[i]).collect();
            let r = self.call(
                |_| {
                    Ok(Request::LookupMany {
                        nss: ask.clone(),
                        keys: part.to_vec(),
                    })
                },
                |_, r, _| match r {
                    Response::LookupMany { tiers }
                        if tiers.len() == ask.len()
                            && tiers.iter().all(|t| t.len() <= part.len()) =>
                    {
                        Ok(tiers)
                    }
                    other => Err(unexpected(other)),
                },
            );
            match r {
                Ok(tiers) => {
                    let mut still = Vec::with_capacity(open.len());
                    for (&i, t) in open.iter().zip(tiers) {
                        if t.len() == part.len() {
                            still.push(i);
                        }
                        out[i].tiers.extend(t);
                    }
                    open = still;
                }
                // A daemon older than the op (it answers "unknown op" and
                // closes the connection): the same answer, one namespace at
                // a time, now and from then on.
                Err(Error::Remote { code, message })
                    if code == proto::code::MALFORMED && message.contains("unknown op") =>
                {
                    self.lookup_many_refused
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    return one_by_one();
                }
                Err(e) => {
                    for &i in &open {
                        out[i] = miss(&e);
                    }
                    break;
                }
            }
        }
        out
    }

    /// Longest cached prefix of `chain` in the namespace `ns` (by id), with
    /// the tier of each block: [`NsHandle::lookup`].
    pub fn lookup_id(&self, ns: NamespaceId, chain: &[BlockKey]) -> LookupResult {
        let mut tiers = Vec::new();
        for part in chain.chunks(KEYS_MAX) {
            let r = self.call(
                |_| {
                    Ok(Request::Lookup {
                        ns,
                        keys: part.to_vec(),
                    })
                },
                |_, r, _| match r {
                    Response::Lookup { tiers } if tiers.len() <= part.len() => Ok(tiers),
                    other => Err(unexpected(other)),
                },
            );
            match r {
                Ok(t) => {
                    let full = t.len() == part.len();
                    tiers.extend(t);
                    if !full {
                        break;
                    }
                }
                Err(e) => {
                    return LookupResult {
                        tiers: Vec::new(),
                        miss: Some(Miss::from_error(&e)),
                    }
                }
            }
        }
        LookupResult { tiers, miss: None }
    }

    /// Metadata of keys in a namespace known only by id (tools).
    pub fn stat_ids(&self, ns: NamespaceId, keys: &[BlockKey]) -> Result<Vec<Option<BlockStat>>> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(KEYS_MAX) {
            out.extend(self.call(
                |_| {
                    Ok(Request::Stat {
                        ns,
                        keys: part.to_vec(),
                    })
                },
                |_, r, _| match r {
                    Response::Stat { entries } if entries.len() == part.len() => Ok(entries),
                    other => Err(unexpected(other)),
                },
            )?);
        }
        Ok(out)
    }

    /// Evicts keys of `ns` from `tier`: G3, G4 or both (`All` deletes a
    /// block everywhere this node reaches). Leased or pinned G3 copies are
    /// refused (`LimitReached`). With tenants configured this is an admin
    /// operation.
    pub fn evict_ids(
        &self,
        ns: NamespaceId,
        keys: &[BlockKey],
        tier: crate::proto::EvictTier,
    ) -> Result<Vec<ItemStatus>> {
        self.items_ids(keys, |keys| Request::Evict { ns, keys, tier })
    }

    /// Verifies keys of `ns` on the daemon's side; with `repair`, a bad G3
    /// copy is quarantined and replaced from G4 or a peer (verified). Per
    /// key: Ok, Repaired, Corrupt (dropped: no good copy anywhere), Absent.
    pub fn verify_on_daemon(
        &self,
        ns: NamespaceId,
        keys: &[BlockKey],
        repair: bool,
    ) -> Result<Vec<ItemStatus>> {
        self.items_ids(keys, |keys| Request::Verify { ns, keys, repair })
    }

    /// Reports blocks of `ns` that failed this client's verification
    /// after a passed-fd read (the direct-read onboard does so by itself).
    /// The daemon re-verifies its own copy: only a real mismatch
    /// quarantines and repairs it. Per key: Repaired, Corrupt (confirmed,
    /// no good copy anywhere: dropped), Ok (the daemon's copy verifies:
    /// nothing done), Absent.
    pub fn report_corrupt(&self, ns: NamespaceId, keys: &[BlockKey]) -> Result<Vec<ItemStatus>> {
        self.items_ids(keys, |keys| Request::ReportCorrupt { ns, keys })
    }

    /// Tells the daemon which engine and model `ns` belongs to (shown by
    /// `kvtier stats`, `kvtier ls` and `/metrics`; never part of a block's
    /// identity). `model` is cut to what the wire carries
    /// ([`proto::description_model`]); `engine` must be 1..=32 bytes of
    /// `[a-z0-9._-]`. Ok, Invalid (a namespace this caller may not use) or
    /// LimitReached (the daemon keeps its most descriptions). A daemon
    /// that predates the request answers with an error.
    pub fn describe(&self, ns: NamespaceId, engine: &str, model: &str) -> Result<ItemStatus> {
        let model = proto::description_model(model);
        proto::check_description(engine, &model)?;
        let st = self.call(
            |_| {
                Ok(Request::Describe {
                    ns,
                    engine: engine.to_string(),
                    model: model.clone(),
                })
            },
            |_, r, _| match r {
                Response::Items { status } if status.len() == 1 => Ok(status),
                other => Err(unexpected(other)),
            },
        )?;
        Ok(st[0])
    }

    fn items_ids(
        &self,
        keys: &[BlockKey],
        mk: impl Fn(Vec<BlockKey>) -> Request,
    ) -> Result<Vec<ItemStatus>> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(KEYS_MAX) {
            out.extend(self.call(
                |_| Ok(mk(part.to_vec())),
                |_, r, _| match r {
                    Response::Items { status } if status.len() == part.len() => Ok(status),
                    other => Err(unexpected(other)),
                },
            )?);
        }
        Ok(out)
    }

    /// Re-checksums stored blocks end to end (`kvtier verify`): each block
    /// file is passed over a direct-read fd and fully decoded here (header,
    /// length, padding, payload checksum), and must name `ns` and its key.
    /// Per key: `Ok(payload_len)` or why it failed.
    pub fn verify_ids(
        &self,
        ns: NamespaceId,
        keys: &[BlockKey],
    ) -> Result<Vec<std::result::Result<u64, String>>> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(FDS_MAX) {
            let (items, fds) = self.call(
                |_| {
                    Ok(Request::Onboard {
                        ns,
                        mode: OnboardMode::DirectFd,
                        lease_ttl_ms: self.cfg.timeout_ms.clamp(1, u32::MAX as u64) as u32,
                        items: part
                            .iter()
                            .map(|k| OnboardItem {
                                key: *k,
                                shm_offset: 0,
                                shm_len: 0,
                            })
                            .collect(),
                    })
                },
                |_, r, fds| match r {
                    Response::Onboard { items } if items.len() == part.len() => Ok((items, fds)),
                    other => Err(unexpected(other)),
                },
            )?;
            let files: Vec<std::fs::File> = fds.into_iter().map(std::fs::File::from).collect();
            let mut leases = Vec::new();
            for (k, it) in part.iter().zip(&items) {
                if it.lease_id != 0 {
                    leases.push(it.lease_id);
                }
                if it.status != ItemStatus::Ok {
                    out.push(Err(format!("daemon: {:?}", it.status)));
                    continue;
                }
                let Some(f) = files.get(it.fd_index as usize) else {
                    out.push(Err("no file descriptor passed".into()));
                    continue;
                };
                if it.payload_len > crate::block::PAYLOAD_BYTES_MAX {
                    out.push(Err(format!("payload length {}", it.payload_len)));
                    continue;
                }
                let len = HEADER_BYTES as u64 + padded_len(it.payload_len);
                let mut buf = vec![0u8; len as usize];
                if let Err(e) = f.read_exact_at(&mut buf, it.file_offset) {
                    out.push(Err(format!("reading: {e}")));
                    continue;
                }
                out.push(match crate::block::decode_block(&buf) {
                    Ok((h, _)) if h.key == *k && h.namespace_id() == ns => Ok(h.payload_len),
                    Ok(_) => Err("header names another block".into()),
                    Err(e) => Err(e.to_string()),
                });
            }
            let _ = self.release(&leases);
        }
        Ok(out)
    }

    /// Opens a separate connection that streams KV events.
    pub fn subscribe_events(&self) -> Result<EventStream> {
        let stream = self.dial("subscribe")?;
        let c = Client::with_config(ClientConfig {
            region_bytes: 0,
            ..self.cfg.clone()
        });
        let mut conn = Conn::new(stream, None);
        let hello = Request::Hello {
            shm_bytes: 0,
            pid: std::process::id(),
        };
        c.exchange(&mut conn, &hello, &[])?;
        match c.exchange(&mut conn, &Request::Subscribe, &[])?.0 {
            Response::Subscribed => Ok(EventStream {
                sock: conn.sock,
                socket: self.cfg.socket.clone(),
            }),
            other => Err(unexpected(other)),
        }
    }
}

fn poisoned() -> Error {
    Error::Protocol {
        reason: "client state poisoned by a panic in another thread".into(),
    }
}

pub(crate) fn unexpected(r: Response) -> Error {
    Error::Protocol {
        reason: format!("unexpected reply {r:?}"),
    }
}

/// A stream of KV events from the daemon.
#[derive(Debug)]
pub struct EventStream {
    sock: UnixStream,
    socket: PathBuf,
}

impl EventStream {
    /// The next event, or `Ok(None)` when none arrived within `timeout`.
    /// An error means the stream is over (daemon gone); subscribe again.
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<KvEvent>> {
        let io = |e: std::io::Error| Error::Unavailable {
            socket: self.socket.clone(),
            source: e,
        };
        self.sock
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io)?;
        // Peek first so a timeout never splits a frame.
        let mut b = [0u8; 1];
        // SAFETY: valid fd and a one-byte buffer.
        let n = unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                b.as_mut_ptr() as *mut libc::c_void,
                1,
                libc::MSG_PEEK,
            )
        };
        let peeked = if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        };
        match peeked {
            Ok(0) => {
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "daemon closed the event stream",
                )))
            }
            Ok(_) => {}
            // A signal (a stop and continue, SIGSTOP/SIGCONT, makes a recv
            // with a timeout fail with EINTR even without a handler) is no
            // event yet, not the end of the stream.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(io(e)),
        }
        self.sock
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(io)?;
        let mut fds = Vec::new();
        let body = proto::recv_frame(self.sock.as_raw_fd(), &mut fds).map_err(|e| match e {
            proto::RecvError::Io(e) => io(e),
            other => Error::Protocol {
                reason: format!("event stream: {other:?}"),
            },
        })?;
        match Response::decode(&body, proto::OP_SUBSCRIBE)?.1 {
            Response::Event(e) => Ok(Some(e)),
            other => Err(unexpected(other)),
        }
    }
}

/// Block files the daemon opened for this client ([`NsHandle::open_direct`]):
/// per key a [`DirectBlock`] or why it missed. Hand it back to
/// [`NsHandle::finish_direct`] when the bytes are read.
#[derive(Debug)]
pub struct DirectBlocks {
    files: Vec<std::fs::File>,
    /// Per key, in request order.
    pub items: Vec<std::result::Result<DirectBlock, Miss>>,
    leases: Vec<u64>,
    /// Keys whose header failed here (reported by `finish_direct`).
    corrupt: Vec<BlockKey>,
}

impl DirectBlocks {
    /// The open block file `b` is in.
    pub fn file(&self, b: &DirectBlock) -> &std::fs::File {
        &self.files[b.file]
    }
}

/// One block of a direct read: its header (checked against the request and
/// the reply, its payload not yet verified) and where its payload is.
#[derive(Debug, Clone)]
pub struct DirectBlock {
    file: usize,
    /// Offset of the payload in the file (4096-aligned for G3 files).
    pub payload_offset: u64,
    /// The block's header: `payload_len` and `payload_sum` to verify.
    pub header: BlockHeader,
    /// Where the daemon found it.
    pub tier: Tier,
}

impl DirectBlock {
    /// The hit this block is once its payload is verified.
    pub fn hit(&self) -> Onboarded {
        Onboarded::Hit {
            tier: self.tier,
            payload_len: self.header.payload_len,
        }
    }
}

/// A namespace bound to a client: the calls engines make.
#[derive(Debug)]
pub struct NsHandle<'a> {
    pub(crate) client: &'a Client,
    pub(crate) ns: Namespace,
    pub(crate) id: NamespaceId,
}

pub(crate) fn slot_bytes(payload_len: u64) -> u64 {
    HEADER_BYTES as u64 + padded_len(payload_len)
}

/// An shm onboard reply of at least this many payload bytes is landed
/// (copied and verified) by two threads: at 4 MiB the copy and checksum take
/// about a millisecond, well above a scoped thread's start.
const PARALLEL_LAND_BYTES: u64 = 4 << 20;

/// Where an shm onboard leaves each payload.
pub(crate) enum Landing<'a, 'b> {
    /// Copied out of the staging area into the caller's buffers, and
    /// verified there (where the engine reads it).
    Copy(&'a mut [&'b mut [u8]]),
    /// Left in its pool slot and verified in place.
    Pool(&'a Pool),
}

/// One miss per block of a call that failed as a whole.
pub(crate) fn missed(e: &Error, n: usize) -> Vec<Onboarded> {
    let m = Miss::from_error(e);
    vec![Onboarded::Miss(m); n]
}

/// One failed outcome per block of an offload refused as a whole.
fn missed_offloads(e: &Error, n: usize) -> Vec<OffloadOutcome> {
    vec![OffloadOutcome::Failed(Miss::from_error(e)); n]
}

/// The blocks of a chain: block i's parent is block i-1, `first_parent`
/// for the first. The one place a key list becomes parent links, so every
/// offload of a chain records the same parents.
fn chain_blocks<'p>(
    first_parent: Option<BlockKey>,
    keys: &[BlockKey],
    payloads: &[&'p [u8]],
    hints: Hints,
) -> Vec<OffloadBlock<'p>> {
    let mut parent = first_parent;
    let mut blocks = Vec::with_capacity(keys.len());
    for (k, p) in keys.iter().zip(payloads) {
        blocks.push(OffloadBlock {
            key: *k,
            parent,
            payload: p,
            hints,
        });
        parent = Some(*k);
    }
    blocks
}

impl<'a> NsHandle<'a> {
    /// The namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// Its id.
    pub fn id(&self) -> NamespaceId {
        self.id
    }

    /// Keys of every full block of `tokens`.
    pub fn hash_chain(&self, tokens: &[u32]) -> Vec<BlockKey> {
        self.ns.hash_chain(tokens)
    }

    /// Keys of the full blocks of `tokens` following the block `parent`
    /// ([`Namespace::hash_chain_after`]).
    pub fn hash_chain_after(
        &self,
        parent: Option<BlockKey>,
        tokens: &[u32],
    ) -> Result<Vec<BlockKey>> {
        self.ns.hash_chain_after(parent, tokens)
    }

    /// Tells the daemon this namespace is `engine`'s, for its model
    /// ([`Client::describe`] with the namespace's model id).
    pub fn describe(&self, engine: &str) -> Result<ItemStatus> {
        self.client.describe(self.id, engine, &self.ns.model)
    }

    /// Longest cached prefix of `chain`, with the tier of each block.
    pub fn lookup(&self, chain: &[BlockKey]) -> LookupResult {
        self.client.lookup_id(self.id, chain)
    }

    /// Offloads blocks (batched through the shared region). Never fails as a
    /// whole: each block gets its outcome.
    pub fn offload(&self, blocks: &[OffloadBlock<'_>]) -> Vec<OffloadOutcome> {
        self.offload_with(blocks, &[])
    }

    /// Offloads the full blocks of `tokens`, `payloads[i]` being block i's
    /// KV. `first_parent` is the key of the block before `tokens[0]` (the
    /// last key of an earlier call), None for a chain's start: the keys are
    /// the namespace's hash chain continued after it
    /// ([`Namespace::hash_chain_after`]), so a token list offloaded in
    /// parts gets exactly the keys and parents of hashing it whole. In a
    /// dynamo-mode namespace each block's header also carries its Dynamo
    /// routing facts (parent, tokens_hash, token ids), so the daemon can
    /// announce it to a Dynamo router, now, after a restart and from G4.
    /// Returns the keys and the outcomes (one per full block with a
    /// payload); a parent that cannot be a key of the namespace's mode gets
    /// no keys and a refused outcome per payload.
    pub fn offload_tokens(
        &self,
        first_parent: Option<BlockKey>,
        tokens: &[u32],
        payloads: &[&[u8]],
        hints: Hints,
    ) -> (Vec<BlockKey>, Vec<OffloadOutcome>) {
        // Dynamo mode: one pass gives both the keys and the routing facts.
        let refused = |e: &Error| (Vec::new(), missed_offloads(e, payloads.len()));
        let dynamo = match self.ns.hash_mode {
            crate::HashMode::Dynamo => match self.ns.dynamo_blocks_after(first_parent, tokens) {
                Ok(b) => Some(b),
                Err(e) => return refused(&e),
            },
            _ => None,
        };
        let keys: Vec<BlockKey> = match &dynamo {
            Some(blocks) => blocks
                .iter()
                .map(|b| BlockKey::from_u64(b.sequence_hash))
                .collect(),
            None => match self.ns.hash_chain_after(first_parent, tokens) {
                Ok(k) => k,
                Err(e) => return refused(&e),
            },
        };
        let n = keys.len().min(payloads.len());
        let mut metas = Vec::with_capacity(n);
        if let Some(blocks) = &dynamo {
            let bt = self.ns.layout.tokens_per_block as usize;
            let mut parent = first_parent.and_then(|k| k.as_u64());
            for (i, b) in blocks.iter().take(n).enumerate() {
                metas.push(Some(crate::block::DynamoMeta {
                    parent,
                    tokens_hash: b.tokens_hash,
                    token_ids: tokens[i * bt..(i + 1) * bt].to_vec(),
                }));
                parent = Some(b.sequence_hash);
            }
        }
        let blocks = chain_blocks(first_parent, &keys[..n], payloads, hints);
        let out = self.offload_with(&blocks, &metas);
        (keys[..n].to_vec(), out)
    }

    /// [`Self::offload`] with block i's header carrying `dynamo[i]` when
    /// given.
    fn offload_with(
        &self,
        blocks: &[OffloadBlock<'_>],
        dynamo: &[Option<crate::block::DynamoMeta>],
    ) -> Vec<OffloadOutcome> {
        let mut out = Vec::with_capacity(blocks.len());
        let region_len = self.client.cfg.region_bytes.div_ceil(4096) * 4096;
        let mut i = 0;
        while i < blocks.len() {
            // Pack as many blocks as fit in the region.
            let mut end = i;
            let mut used = 0u64;
            while end < blocks.len() && end - i < KEYS_MAX {
                let s = slot_bytes(blocks[end].payload.len() as u64);
                if used + s > region_len {
                    break;
                }
                used += s;
                end += 1;
            }
            if end == i {
                out.push(OffloadOutcome::Failed(Miss::new(
                    MissCause::TooLarge,
                    "block larger than the shared region",
                )));
                i += 1;
                continue;
            }
            let batch = &blocks[i..end];
            let r = self.client.call(
                |region| {
                    let region = region.ok_or_else(|| Error::Protocol {
                        reason: "client has no shared region".into(),
                    })?;
                    let mut items = Vec::with_capacity(batch.len());
                    let mut off = 0u64;
                    let created = now_ms();
                    for (j, b) in batch.iter().enumerate() {
                        let mut h = BlockHeader::for_payload(&self.ns, b.key, b.payload, created);
                        if let Some(Some(m)) = dynamo.get(i + j) {
                            h = h.with_dynamo(m.clone());
                        }
                        let mut hb = [0u8; HEADER_BYTES];
                        h.encode_into(&mut hb);
                        region.write(off, &hb);
                        region.write(off + HEADER_BYTES as u64, b.payload);
                        items.push(OffloadItem {
                            shm_offset: off,
                            parent: b.parent,
                            hints: b.hints,
                        });
                        off += slot_bytes(b.payload.len() as u64);
                    }
                    Ok(Request::Offload { ns: self.id, items })
                },
                |_, r, _| match r {
                    Response::Items { status } if status.len() == batch.len() => Ok(status),
                    other => Err(unexpected(other)),
                },
            );
            match r {
                Ok(status) => out.extend(status.into_iter().map(OffloadOutcome::from_status)),
                Err(e) => {
                    let m = Miss::from_error(&e);
                    out.extend(batch.iter().map(|_| OffloadOutcome::Failed(m.clone())));
                }
            }
            i = end;
        }
        out
    }

    /// Offloads a chain: block i's parent is block i-1 (`first_parent` for
    /// the first).
    pub fn offload_chain(
        &self,
        first_parent: Option<BlockKey>,
        keys: &[BlockKey],
        payloads: &[&[u8]],
        hints: Hints,
    ) -> Vec<OffloadOutcome> {
        self.offload(&chain_blocks(first_parent, keys, payloads, hints))
    }

    /// Onboards `keys[i]` into `bufs[i]` (each at least the block's payload
    /// size), verifying every byte (see the module docs). Never fails as a
    /// whole: each key gets its outcome.
    pub fn onboard_into(&self, keys: &[BlockKey], bufs: &mut [&mut [u8]]) -> Vec<Onboarded> {
        let n = keys.len().min(bufs.len());
        let mut out: Vec<Onboarded> = Vec::with_capacity(keys.len());
        let slot = slot_bytes(self.ns.layout.block_bytes());
        let region_len = self.client.cfg.region_bytes.div_ceil(4096) * 4096;
        let direct = self.client.cfg.direct_read;
        let per_batch = if direct {
            FDS_MAX
        } else {
            ((region_len / slot.max(1)) as usize).min(KEYS_MAX)
        };
        if per_batch == 0 {
            for _ in 0..keys.len() {
                out.push(Onboarded::Miss(Miss::new(
                    MissCause::TooLarge,
                    "block larger than the shared region",
                )));
            }
            return out;
        }
        // More blocks than the region holds: two requests in flight, each
        // in half of the region (a block per half at least).
        if !direct && n > per_batch && per_batch >= 2 {
            let mut out =
                self.onboard_shm_pipelined(&keys[..n], &mut bufs[..n], slot, per_batch / 2);
            for _ in n..keys.len() {
                out.push(Onboarded::Miss(Miss::new(
                    MissCause::TooLarge,
                    "no buffer given for this key",
                )));
            }
            return out;
        }
        let mut i = 0;
        while i < n {
            let end = (i + per_batch).min(n);
            let res = if direct {
                let mut res = self.onboard_direct(&keys[i..end], &mut bufs[i..end]);
                self.retry_in_region(&keys[i..end], &mut bufs[i..end], &mut res, slot, region_len);
                res
            } else {
                self.onboard_shm(&keys[i..end], &mut bufs[i..end], slot)
            };
            out.extend(res);
            i = end;
        }
        for _ in n..keys.len() {
            out.push(Onboarded::Miss(Miss::new(
                MissCause::TooLarge,
                "no buffer given for this key",
            )));
        }
        out
    }

    /// Validates a header the daemon produced against the request and reply.
    pub(crate) fn check_header(
        &self,
        hb: &[u8],
        key: &BlockKey,
        it: &proto::OnboardResult,
        cap: usize,
    ) -> std::result::Result<BlockHeader, Miss> {
        let h =
            BlockHeader::decode(hb).map_err(|e| Miss::new(MissCause::Corrupt, e.to_string()))?;
        if h.key != *key
            || h.namespace_digest != self.ns.digest()
            || h.payload_len != it.payload_len
            || h.payload_sum != it.payload_sum
        {
            return Err(Miss::new(
                MissCause::Corrupt,
                format!("header for {key} disagrees with the request or reply"),
            ));
        }
        if h.payload_len as usize > cap {
            return Err(Miss::new(
                MissCause::TooLarge,
                format!("block of {} bytes, buffer of {cap}", h.payload_len),
            ));
        }
        Ok(h)
    }

    fn onboard_shm(&self, keys: &[BlockKey], bufs: &mut [&mut [u8]], slot: u64) -> Vec<Onboarded> {
        let offsets: Vec<u64> = (0..keys.len() as u64).map(|j| j * slot).collect();
        self.onboard_shm_at(keys, &offsets, slot, Landing::Copy(bufs))
            .unwrap_or_else(|e| missed(&e, keys.len()))
    }

    /// One shm-mode onboard request, for the staging area and the pool
    /// alike: the daemon places `keys[j]` (header page, then payload) in the
    /// region at `offsets[j]`; each hit's header is validated against the
    /// request and the reply, and its payload lands as `landing` says and
    /// is verified (its checksum) where it lands. An error (no region, a failed
    /// call, a reply of the wrong length) is the caller's to turn into
    /// misses.
    ///
    /// The daemon leaves a payload's checksum to this check (it reads G3
    /// blocks straight into the region, checking only their headers), so
    /// a block that the daemon served and that fails here is reported
    /// (`OP_REPORT_CORRUPT`: the daemon re-verifies its copy, quarantines
    /// it and repairs it from G4 or a peer) and, where the daemon repaired
    /// it or found its own copy good, onboarded once more in the same call.
    pub(crate) fn onboard_shm_at(
        &self,
        keys: &[BlockKey],
        offsets: &[u64],
        slot: u64,
        mut landing: Landing<'_, '_>,
    ) -> Result<Vec<Onboarded>> {
        let all: Vec<usize> = (0..keys.len()).collect();
        let (mut out, failed) = self.onboard_shm_once(keys, offsets, &all, slot, &mut landing)?;
        if failed.is_empty() {
            return Ok(out);
        }
        let bad: Vec<BlockKey> = failed.iter().map(|&j| keys[j]).collect();
        let Ok(status) = self.client.report_corrupt(self.id, &bad) else {
            return Ok(out);
        };
        let again: Vec<usize> = failed
            .iter()
            .zip(&status)
            .filter(|(_, st)| matches!(st, ItemStatus::Repaired | ItemStatus::Ok))
            .map(|(&j, _)| j)
            .collect();
        if again.is_empty() {
            return Ok(out);
        }
        let ks: Vec<BlockKey> = again.iter().map(|&j| keys[j]).collect();
        let os: Vec<u64> = again.iter().map(|&j| offsets[j]).collect();
        if let Ok((got, _)) = self.onboard_shm_once(&ks, &os, &again, slot, &mut landing) {
            for (&j, o) in again.iter().zip(got) {
                out[j] = o;
            }
        }
        Ok(out)
    }

    /// One shm onboard request: `keys[i]` lands as item `dest[i]` of
    /// `landing`. The outcomes, and the items (of `landing`) that the
    /// daemon served and this client's check refused.
    fn onboard_shm_once(
        &self,
        keys: &[BlockKey],
        offsets: &[u64],
        dest: &[usize],
        slot: u64,
        landing: &mut Landing<'_, '_>,
    ) -> Result<(Vec<Onboarded>, Vec<usize>)> {
        let pool = match &*landing {
            Landing::Pool(p) => Some(*p),
            Landing::Copy(_) => None,
        };
        self.client.call(
            |region| self.shm_request(region, pool, keys, offsets, slot),
            |region, r, _| self.shm_reply(region, r, keys, offsets, dest, landing),
        )
    }

    /// The onboard request that places `keys[j]` at `offsets[j]` of the
    /// region (the pool's, when `pool` is given).
    fn shm_request(
        &self,
        region: Option<&Region>,
        pool: Option<&Pool>,
        keys: &[BlockKey],
        offsets: &[u64],
        slot: u64,
    ) -> Result<Request> {
        let region = region.ok_or_else(|| Error::Protocol {
            reason: "client has no shared region".into(),
        })?;
        if let Some(p) = pool {
            p.check_region(region)?;
        }
        // The daemon writes these ranges: their pages must be this
        // process's (charged to its memory cgroup, see shm.rs); it
        // refuses ranges with holes. A no-op once populated.
        for &o in offsets {
            region.populate(o, slot as usize);
        }
        let items = keys
            .iter()
            .zip(offsets)
            .map(|(k, &o)| OnboardItem {
                key: *k,
                shm_offset: o,
                shm_len: slot,
            })
            .collect();
        Ok(Request::Onboard {
            ns: self.id,
            mode: OnboardMode::Shm,
            lease_ttl_ms: 0,
            items,
        })
    }

    /// An shm onboard reply landed: the outcomes, and the items (of
    /// `landing`) that the daemon served and this client's check refused.
    fn shm_reply(
        &self,
        region: Option<&Region>,
        r: Response,
        keys: &[BlockKey],
        offsets: &[u64],
        dest: &[usize],
        landing: &mut Landing<'_, '_>,
    ) -> Result<(Vec<Onboarded>, Vec<usize>)> {
        let Response::Onboard { items } = r else {
            return Err(unexpected(r));
        };
        if items.len() != keys.len() {
            return Err(Error::Protocol {
                reason: "onboard reply length".into(),
            });
        }
        let region = region.ok_or_else(poisoned)?;
        let got = self.land_all(region, keys, &items, offsets, dest, landing);
        let mut failed = Vec::new();
        let out = got
            .into_iter()
            .zip(&items)
            .zip(dest)
            .map(|((r, it), &j)| match r {
                Ok(o) => o,
                Err(m) => {
                    if it.status == ItemStatus::Ok && m.cause == MissCause::Corrupt {
                        failed.push(j);
                    }
                    Onboarded::Miss(m)
                }
            })
            .collect();
        Ok((out, failed))
    }

    /// Onboards more blocks than the region holds at once into `bufs`:
    /// requests of `half` blocks each, alternating between the region's
    /// two halves, two in flight on the connection
    /// ([`Client::call_pipelined`]), so the daemon reads one half while
    /// this client copies and checks the other. Blocks this client's check
    /// refused are reported and, where the daemon repaired them or found
    /// its copy good, onboarded once more, as [`Self::onboard_shm_at`].
    fn onboard_shm_pipelined(
        &self,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
        slot: u64,
        half: usize,
    ) -> Vec<Onboarded> {
        let n = keys.len().min(bufs.len());
        let half = half.max(1);
        let count = n.div_ceil(half);
        let range = |b: usize| b * half..((b + 1) * half).min(n);
        let offsets = |b: usize| -> Vec<u64> {
            let base = (b % 2) as u64 * half as u64 * slot;
            range(b)
                .map(|j| base + (j - b * half) as u64 * slot)
                .collect()
        };
        let mut out: Vec<Option<Onboarded>> = vec![None; n];
        let mut failed: Vec<usize> = Vec::new();
        let res = self.client.call_pipelined(
            count,
            |b, region| self.shm_request(region, None, &keys[range(b)], &offsets(b), slot),
            |b, region, r| {
                let rg = range(b);
                let dest: Vec<usize> = (0..rg.len()).collect();
                let mut landing = Landing::Copy(&mut bufs[rg.clone()]);
                let (got, bad) = self.shm_reply(
                    region,
                    r,
                    &keys[rg.clone()],
                    &offsets(b),
                    &dest,
                    &mut landing,
                )?;
                for (j, o) in got.into_iter().enumerate() {
                    out[rg.start + j] = Some(o);
                }
                failed.extend(bad.into_iter().map(|j| rg.start + j));
                Ok(())
            },
        );
        let gone = res.err().map(|e| Miss::from_error(&e));
        let mut out: Vec<Onboarded> = out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Onboarded::Miss(gone.clone().unwrap_or_else(|| {
                        Miss::new(MissCause::Unavailable, "onboard request not answered")
                    }))
                })
            })
            .collect();
        if failed.is_empty() {
            return out;
        }
        let bad: Vec<BlockKey> = failed.iter().map(|&j| keys[j]).collect();
        let Ok(status) = self.client.report_corrupt(self.id, &bad) else {
            return out;
        };
        for (&j, st) in failed.iter().zip(&status) {
            if !matches!(st, ItemStatus::Repaired | ItemStatus::Ok) {
                continue;
            }
            let mut one = [&mut *bufs[j]];
            if let Some(o) = self
                .onboard_shm_at(&keys[j..=j], &[0], slot, Landing::Copy(&mut one))
                .ok()
                .and_then(|mut v| v.pop())
            {
                out[j] = o;
            }
        }
        out
    }

    /// Lands every item of an shm onboard reply (`items[i]` for `keys[i]`
    /// at `offsets[i]`, into item `dest[i]` of `landing`). A reply of at
    /// least [`PARALLEL_LAND_BYTES`] is landed by this thread and one
    /// scoped helper, half the items each: the copy and the checksum pass
    /// are the client's whole share of an onboard, and while they run the
    /// connection, and so the daemon's reads for this client, wait.
    fn land_all(
        &self,
        region: &Region,
        keys: &[BlockKey],
        items: &[proto::OnboardResult],
        offsets: &[u64],
        dest: &[usize],
        landing: &mut Landing<'_, '_>,
    ) -> Vec<std::result::Result<Onboarded, Miss>> {
        let copy = matches!(landing, Landing::Copy(_));
        // Each item's destination: its own buffer (copy), or its pool slot.
        let mut dsts: Vec<Option<&mut [u8]>> = match landing {
            Landing::Copy(bufs) => {
                let mut by_dest: Vec<Option<&mut [u8]>> =
                    bufs.iter_mut().map(|b| Some(&mut **b)).collect();
                dest.iter()
                    .map(|&j| by_dest.get_mut(j).and_then(Option::take))
                    .collect()
            }
            Landing::Pool(_) => dest.iter().map(|_| None).collect(),
        };
        let one = |i: usize, dst: Option<&mut [u8]>| {
            self.land(region, &keys[i], &items[i], offsets[i], copy, dst)
        };
        let bytes: u64 = items
            .iter()
            .filter(|it| it.status == ItemStatus::Ok)
            .map(|it| it.payload_len)
            .sum();
        let n = items.len().min(keys.len()).min(offsets.len());
        if bytes < PARALLEL_LAND_BYTES || n < 2 {
            return (0..n).zip(dsts).map(|(i, d)| one(i, d)).collect();
        }
        let half = n / 2;
        let (a, b) = dsts.split_at_mut(half);
        std::thread::scope(|s| {
            let helper = s.spawn(|| {
                (half..n)
                    .zip(b.iter_mut())
                    .map(|(i, d)| one(i, d.take()))
                    .collect::<Vec<_>>()
            });
            let mut out: Vec<_> = (0..half)
                .zip(a.iter_mut())
                .map(|(i, d)| one(i, d.take()))
                .collect();
            match helper.join() {
                Ok(rest) => out.extend(rest),
                Err(_) => out.extend((half..n).map(|_| {
                    Err(Miss::new(
                        MissCause::Corrupt,
                        "verification thread panicked",
                    ))
                })),
            }
            out
        })
    }

    /// One item of an shm onboard reply: its header checked, its payload
    /// landed and verified: copied into `dst` and checked there (`copy`),
    /// or checked in its pool slot in the region.
    fn land(
        &self,
        region: &Region,
        key: &BlockKey,
        it: &proto::OnboardResult,
        at: u64,
        copy: bool,
        dst: Option<&mut [u8]>,
    ) -> std::result::Result<Onboarded, Miss> {
        if it.status != ItemStatus::Ok {
            return Err(Miss::from_status(it.status));
        }
        let mut hb = [0u8; HEADER_BYTES];
        if !region.read(at, &mut hb) {
            return Err(Miss::new(MissCause::Corrupt, "offset"));
        }
        let cap = match (&dst, copy) {
            (Some(d), true) => d.len(),
            (None, true) => 0,
            (_, false) => self.ns.layout.block_bytes() as usize,
        };
        let h = self.check_header(&hb, key, it, cap)?;
        let (at, len) = (at + HEADER_BYTES as u64, h.payload_len as usize);
        let Some(src) = region.slice(at, len) else {
            return Err(Miss::new(MissCause::TooLarge, "region"));
        };
        let verified = match dst {
            Some(d) if copy => h.copy_verified(src, &mut d[..len]),
            _ => h.verify_payload(src),
        };
        verified.map_err(|e| Miss::new(MissCause::Corrupt, e.to_string()))?;
        Ok(Onboarded::Hit {
            tier: it.tier,
            payload_len: h.payload_len,
        })
    }

    /// The blocks an fd onboard missed for a storage failure (the G3 copy
    /// could not be opened or read, or a block fetched from a peer or G4
    /// could not be written to G3 to be passed as a file) are asked for
    /// once more through the shared region, where the daemon serves
    /// another tier's verified copy instead: a failing or full G3 costs
    /// the fd path no hit the region path would give.
    fn retry_in_region(
        &self,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
        res: &mut [Onboarded],
        slot: u64,
        region_len: u64,
    ) {
        let retry: Vec<usize> = res
            .iter()
            .enumerate()
            .filter(|(_, o)| {
                matches!(o, Onboarded::Miss(m) if matches!(m.cause, MissCause::Storage | MissCause::NoSpace))
            })
            .map(|(j, _)| j)
            .collect();
        let per_batch = ((region_len / slot.max(1)) as usize).min(KEYS_MAX);
        if retry.is_empty() || per_batch == 0 {
            return;
        }
        for part in retry.chunks(per_batch) {
            let ks: Vec<BlockKey> = part.iter().map(|&j| keys[j]).collect();
            let mut by_index: Vec<Option<&mut [u8]>> =
                bufs.iter_mut().map(|b| Some(&mut **b)).collect();
            let mut bs: Vec<&mut [u8]> = part
                .iter()
                .filter_map(|&j| by_index.get_mut(j).and_then(Option::take))
                .collect();
            if bs.len() != ks.len() {
                return;
            }
            for (&j, o) in part.iter().zip(self.onboard_shm(&ks, &mut bs, slot)) {
                // A second miss keeps the first one's cause (what failed).
                if o.is_hit() {
                    res[j] = o;
                }
            }
        }
    }

    fn onboard_direct(&self, keys: &[BlockKey], bufs: &mut [&mut [u8]]) -> Vec<Onboarded> {
        let caps: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let d = self.open_direct(keys, &caps);
        // Each item read from its file into its buffer and verified there;
        // Err(true) marks a corrupt copy, to be reported.
        let one = |j: usize, buf: &mut [u8]| -> std::result::Result<Onboarded, (Miss, bool)> {
            let b = d.items[j].as_ref().map_err(|m| (m.clone(), false))?;
            let dst = &mut buf[..b.header.payload_len as usize];
            d.file(b)
                .read_exact_at(dst, b.payload_offset)
                .map_err(|e| (Miss::new(MissCause::Storage, e.to_string()), false))?;
            b.header
                .verify_payload(dst)
                .map(|()| b.hit())
                .map_err(|e| (Miss::new(MissCause::Corrupt, e.to_string()), true))
        };
        let n = d.items.len().min(bufs.len());
        let bytes: u64 = d
            .items
            .iter()
            .filter_map(|it| it.as_ref().ok())
            .map(|b| b.header.payload_len)
            .sum();
        let results: Vec<_> = if bytes < PARALLEL_LAND_BYTES || n < 2 {
            bufs.iter_mut()
                .take(n)
                .enumerate()
                .map(|(j, b)| one(j, b))
                .collect()
        } else {
            // Two readers, half the blocks each: one thread's checksum pass
            // runs while the other's read waits on the disk, and the disk
            // sees two reads at once (as the shm path lands with two).
            let half = n / 2;
            let (a, b) = bufs[..n].split_at_mut(half);
            std::thread::scope(|s| {
                let helper = s.spawn(|| {
                    b.iter_mut()
                        .enumerate()
                        .map(|(j, buf)| one(half + j, buf))
                        .collect::<Vec<_>>()
                });
                let mut out: Vec<_> = a
                    .iter_mut()
                    .enumerate()
                    .map(|(j, buf)| one(j, buf))
                    .collect();
                match helper.join() {
                    Ok(rest) => out.extend(rest),
                    Err(_) => out.extend((half..n).map(|_| {
                        Err((
                            Miss::new(MissCause::Storage, "reader thread panicked"),
                            false,
                        ))
                    })),
                }
                out
            })
        };
        let mut corrupt = Vec::new();
        let mut out = Vec::with_capacity(keys.len());
        for (j, r) in results.into_iter().enumerate() {
            out.push(match r {
                Ok(hit) => hit,
                Err((m, bad)) => {
                    if bad {
                        corrupt.push(keys[j]);
                    }
                    Onboarded::Miss(m)
                }
            });
        }
        // Items past the buffers given (none when called by onboard_into).
        for it in d.items.iter().skip(n) {
            out.push(Onboarded::Miss(match it {
                Err(m) => m.clone(),
                Ok(_) => Miss::new(MissCause::TooLarge, "no buffer given for this key"),
            }));
        }
        self.finish_direct(d, &corrupt);
        out
    }

    /// Asks the daemon for the block files of `keys` (at most
    /// [`FDS_MAX`]; more are misses), each leased until
    /// [`Self::finish_direct`] or the call's deadline, and checks each
    /// header against the request and the reply, and its payload against
    /// `caps[i]` (the bytes the caller can take for key i). The payload is
    /// neither read nor verified: the caller reads
    /// `header.payload_len` bytes at `payload_offset` of [`DirectBlocks::file`]
    /// (the GPU crate with its own pipeline, say) and must compare their
    /// checksum with `header.payload_sum` before using them (the daemon
    /// hands fds out unverified). A failed call is a miss for every key.
    pub fn open_direct(&self, keys: &[BlockKey], caps: &[usize]) -> DirectBlocks {
        let n = keys.len().min(FDS_MAX).min(caps.len());
        let mut d = DirectBlocks {
            files: Vec::new(),
            items: Vec::with_capacity(keys.len()),
            leases: Vec::new(),
            corrupt: Vec::new(),
        };
        let r = if n == 0 {
            Ok((Vec::new(), Vec::new()))
        } else {
            self.client.call(
                |_| {
                    let items = keys[..n]
                        .iter()
                        .map(|k| OnboardItem {
                            key: *k,
                            shm_offset: 0,
                            shm_len: 0,
                        })
                        .collect();
                    Ok(Request::Onboard {
                        ns: self.id,
                        mode: OnboardMode::DirectFd,
                        lease_ttl_ms: self.client.cfg.timeout_ms.min(u32::MAX as u64) as u32,
                        items,
                    })
                },
                |_, r, fds| match r {
                    Response::Onboard { items } if items.len() == n => Ok((items, fds)),
                    other => Err(unexpected(other)),
                },
            )
        };
        let items = match r {
            Ok((items, fds)) => {
                d.files = fds.into_iter().map(std::fs::File::from).collect();
                items
            }
            Err(e) => {
                d.items = missed(&e, keys.len())
                    .into_iter()
                    .map(|o| match o {
                        Onboarded::Miss(m) => Err(m),
                        Onboarded::Hit { .. } => Err(Miss::new(MissCause::Refused, "no reply")),
                    })
                    .collect();
                return d;
            }
        };
        for (j, it) in items.iter().enumerate() {
            if it.lease_id != 0 {
                d.leases.push(it.lease_id);
            }
            let got = self.open_one(&d.files, &keys[j], it, caps[j]);
            if let Err(m) = &got {
                if m.cause == MissCause::Corrupt && it.status == ItemStatus::Ok {
                    d.corrupt.push(keys[j]);
                }
            }
            d.items.push(got);
        }
        for _ in n..keys.len() {
            d.items.push(Err(Miss::new(
                MissCause::TooLarge,
                "more keys than one direct read takes, or no buffer for this key",
            )));
        }
        d
    }

    /// One item of a direct-read reply: its fd and its header, checked.
    fn open_one(
        &self,
        files: &[std::fs::File],
        key: &BlockKey,
        it: &proto::OnboardResult,
        cap: usize,
    ) -> std::result::Result<DirectBlock, Miss> {
        if it.status != ItemStatus::Ok {
            return Err(Miss::from_status(it.status));
        }
        let file = it.fd_index as usize;
        let Some(f) = files.get(file) else {
            return Err(Miss::new(MissCause::Refused, "missing fd"));
        };
        let mut hb = vec![0u8; HEADER_BYTES];
        f.read_exact_at(&mut hb, it.file_offset)
            .map_err(|e| Miss::new(MissCause::Storage, e.to_string()))?;
        let header = self.check_header(&hb, key, it, cap)?;
        Ok(DirectBlock {
            file,
            payload_offset: it.file_offset + HEADER_BYTES as u64,
            header,
            tier: it.tier,
        })
    }

    /// Ends a direct read: gives the leases back, and reports to the daemon
    /// the blocks whose header (found by [`Self::open_direct`]) or payload
    /// (`corrupt`: found by the caller's verification) failed, so that it
    /// re-verifies, quarantines and repairs them. Best effort: leases time
    /// out anyway, and the misses stand whatever the answer.
    pub fn finish_direct(&self, d: DirectBlocks, corrupt: &[BlockKey]) {
        let _ = self.client.release(&d.leases);
        let mut all = d.corrupt;
        all.extend_from_slice(corrupt);
        if !all.is_empty() {
            self.report_corrupt(&all);
        }
    }

    /// Tells the daemon that blocks read over a passed fd failed this
    /// client's verification: the daemon re-verifies its copy and, on a
    /// real mismatch, quarantines and repairs it, so the corrupt copy is
    /// not served again (the daemon hands fds out unverified). Best
    /// effort: the miss stands whatever the answer (a later onboard reads
    /// the repaired copy).
    fn report_corrupt(&self, keys: &[BlockKey]) {
        let _ = self.client.report_corrupt(self.id, keys);
    }

    fn keys_op(
        &self,
        keys: &[BlockKey],
        mk: impl Fn(Vec<BlockKey>) -> Request,
    ) -> Result<Vec<ItemStatus>> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(KEYS_MAX) {
            out.extend(self.client.call(
                |_| Ok(mk(part.to_vec())),
                |_, r, _| match r {
                    Response::Items { status } if status.len() == part.len() => Ok(status),
                    other => Err(unexpected(other)),
                },
            )?);
        }
        Ok(out)
    }

    /// Pins keys for `ttl_ms` (the daemon caps it): they are not evicted.
    pub fn pin(&self, keys: &[BlockKey], ttl_ms: u32) -> Result<Vec<ItemStatus>> {
        self.keys_op(keys, |keys| Request::Pin {
            ns: self.id,
            ttl_ms,
            keys,
        })
    }

    /// "This chain will be needed within `deadline_ms`": the daemon fetches
    /// the blocks that are not local (from peers or G4) into G3 in the
    /// background, so the request that follows finds them local. Returns at
    /// once; per key `Ok` (queued), `AlreadyPresent` (local), `LimitReached`
    /// (no room in the daemon's queue or this uid's share; also every key
    /// past the first `KEYS_MAX`, which one prefetch does not carry) or
    /// `Absent` (the daemon has no remote tier). A later prefetch with the
    /// same non-zero `stream` (a request or session id of the caller's
    /// choosing) drops the queued keys it no longer names; 0 never does.
    pub fn prefetch(
        &self,
        keys: &[BlockKey],
        deadline_ms: u32,
        stream: u64,
    ) -> Result<Vec<ItemStatus>> {
        // One frame: split in two, the second part would supersede the first.
        let (sent, rest) = keys.split_at(keys.len().min(KEYS_MAX));
        let mut out = self.keys_op(sent, |keys| Request::Prefetch {
            ns: self.id,
            deadline_ms,
            stream,
            keys,
        })?;
        out.extend(std::iter::repeat_n(ItemStatus::LimitReached, rest.len()));
        Ok(out)
    }

    /// Removes pins.
    pub fn unpin(&self, keys: &[BlockKey]) -> Result<Vec<ItemStatus>> {
        self.keys_op(keys, |keys| Request::Unpin { ns: self.id, keys })
    }

    /// Evicts keys from the node's disk (leased or pinned keys are
    /// refused); G4 keeps its copies. See [`Self::evict_from`].
    pub fn evict(&self, keys: &[BlockKey]) -> Result<Vec<ItemStatus>> {
        self.evict_from(keys, crate::proto::EvictTier::G3)
    }

    /// Evicts keys from `tier` ([`Client::evict_ids`]).
    pub fn evict_from(
        &self,
        keys: &[BlockKey],
        tier: crate::proto::EvictTier,
    ) -> Result<Vec<ItemStatus>> {
        self.client.evict_ids(self.id, keys, tier)
    }

    /// Metadata of keys.
    pub fn stat(&self, keys: &[BlockKey]) -> Result<Vec<Option<BlockStat>>> {
        self.client.stat_ids(self.id, keys)
    }
}

/// The async API (feature `async`): the blocking client driven from
/// tokio's blocking pool, so an async engine never blocks its reactor.
#[cfg(feature = "async")]
pub mod nonblocking {
    use super::*;
    use std::sync::Arc;

    /// An async handle over a shared [`Client`].
    #[derive(Debug, Clone)]
    pub struct AsyncClient {
        inner: Arc<Client>,
    }

    impl AsyncClient {
        /// Wraps a client.
        pub fn new(client: Client) -> Self {
            AsyncClient {
                inner: Arc::new(client),
            }
        }

        /// See [`NsHandle::lookup`].
        pub async fn lookup(&self, ns: Namespace, chain: Vec<BlockKey>) -> LookupResult {
            let c = self.inner.clone();
            let r = tokio::task::spawn_blocking(move || c.namespace(&ns).lookup(&chain)).await;
            r.unwrap_or_else(|_| LookupResult {
                tiers: Vec::new(),
                miss: Some(Miss::new(MissCause::Unavailable, "task failed")),
            })
        }

        /// See [`NsHandle::offload`]; blocks are (key, parent, payload).
        pub async fn offload(
            &self,
            ns: Namespace,
            blocks: Vec<(BlockKey, Option<BlockKey>, Vec<u8>)>,
            hints: Hints,
        ) -> Vec<OffloadOutcome> {
            let c = self.inner.clone();
            let n = blocks.len();
            let r = tokio::task::spawn_blocking(move || {
                let bs: Vec<OffloadBlock<'_>> = blocks
                    .iter()
                    .map(|(k, p, b)| OffloadBlock {
                        key: *k,
                        parent: *p,
                        payload: b,
                        hints,
                    })
                    .collect();
                c.namespace(&ns).offload(&bs)
            })
            .await;
            r.unwrap_or_else(|_| {
                vec![OffloadOutcome::Failed(Miss::new(MissCause::Unavailable, "task failed")); n]
            })
        }

        /// See [`NsHandle::onboard_into`]; returns a fresh buffer per key.
        pub async fn onboard(
            &self,
            ns: Namespace,
            keys: Vec<BlockKey>,
        ) -> Vec<(Onboarded, Vec<u8>)> {
            let c = self.inner.clone();
            let n = keys.len();
            let r = tokio::task::spawn_blocking(move || {
                let len = ns.layout.block_bytes() as usize;
                let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
                let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                let res = c.namespace(&ns).onboard_into(&keys, &mut refs);
                res.into_iter().zip(bufs).collect::<Vec<_>>()
            })
            .await;
            r.unwrap_or_else(|_| {
                (0..n)
                    .map(|_| {
                        (
                            Onboarded::Miss(Miss::new(MissCause::Unavailable, "task failed")),
                            Vec::new(),
                        )
                    })
                    .collect()
            })
        }
    }
}
