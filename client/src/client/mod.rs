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

mod direct;
mod event_stream;
mod ns;
mod outcome;
mod pool;
pub use direct::{DirectBlock, DirectBlocks};
pub use event_stream::EventStream;
pub use ns::NsHandle;
pub(crate) use ns::{missed, slot_bytes, Landing};
pub use outcome::{LookupResult, Miss, MissCause, OffloadBlock, OffloadOutcome, Onboarded};
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
            features: proto::FEATURES,
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
            features: proto::FEATURES,
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
