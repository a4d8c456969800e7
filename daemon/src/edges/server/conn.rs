//! One client connection: handshake, then request/reply until the client
//! leaves, errs, idles out, or subscribes (then it is an event stream).

use super::clients::{Description, NsCounts};
use super::onboard::{read_all, Ranges, ReadJob};
use super::quota::Res;
use super::Shared;
use crate::base::backend::{OffloadBlock, PrefetchCaller};
use crate::base::error::Error;
use crate::base::tier::{Lookup, MissReason, PutOutcome};
use crate::edges::access::Grant;
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::proto::{
    self, code, ItemStatus, OnboardMode, OnboardResult, RecvError, Request, Response, KEYS_MAX,
};
use kvtier_client::shm::Region;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId, Tier};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Corrupt reports the daemon's copy contradicts: one line a second.
static REPORT_LOG: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(1000);

fn send(fd: RawFd, resp: &Response, op: u8, req_id: u32, fds: &[RawFd]) -> bool {
    proto::send_frame(fd, &resp.encode(op, req_id), fds).is_ok()
}

fn send_err(fd: RawFd, req_id: u32, c: u16, message: impl Into<String>) {
    let _ = send(
        fd,
        &Response::Error {
            code: c,
            message: message.into(),
        },
        0,
        req_id,
        &[],
    );
}

pub(super) fn refuse_busy(s: &UnixStream, max: usize, kept: usize) {
    let why = if kept == 0 {
        format!("the daemon serves at most {max} connections")
    } else {
        format!(
            "the daemon serves at most {max} connections, {kept} of them kept for admins \
             ([access] admin_connections_reserved)"
        )
    };
    refuse(s, code::BUSY, why);
}

/// Answers a connection that will not be served with one error frame.
pub(super) fn refuse(s: &UnixStream, c: u16, message: String) {
    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
    send_err(s.as_raw_fd(), 0, c, message);
}

/// The connected process's uid and gid, as the kernel recorded them at
/// connect (`SO_PEERCRED`): a client cannot claim another identity.
pub(super) fn peer_cred(s: &UnixStream) -> Option<(u32, u32)> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket fd and a ucred-sized out buffer with its length.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut c as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    (r == 0 && len as usize == std::mem::size_of::<libc::ucred>()).then_some((c.uid, c.gid))
}

/// Who a connection serves.
pub(super) struct Caller {
    pub uid: u32,
    /// Whose shares it draws on ([`Grant::account`]): its tenant's, or its
    /// uid's.
    pub account: u32,
    pub grant: Grant,
}

fn err_kind(e: &Error) -> (&'static str, ItemStatus) {
    match e {
        Error::NoSpace { .. } => ("no_space", ItemStatus::NoSpace),
        Error::LimitReached { .. } => ("limit", ItemStatus::LimitReached),
        Error::InvalidInput { .. } | Error::Client(_) => ("invalid", ItemStatus::Invalid),
        Error::Corrupt { .. } => ("corrupt", ItemStatus::Corrupt),
        Error::ParentAbsent { .. } => ("parent_absent", ItemStatus::Absent),
        Error::Timeout { .. } => ("timeout", ItemStatus::Timeout),
        Error::Io { .. } => ("io", ItemStatus::Failed),
        _ => ("storage", ItemStatus::Failed),
    }
}

/// The wire status of a miss. `Timeout` reaches only clients that
/// announced it: every reply passes [`Response::for_features`].
fn miss_status(m: MissReason) -> ItemStatus {
    match m {
        MissReason::Absent => ItemStatus::Absent,
        MissReason::Corrupt => ItemStatus::Corrupt,
        MissReason::Timeout => ItemStatus::Timeout,
        _ => ItemStatus::Unavailable,
    }
}

struct Conn<'a> {
    sh: &'a Shared,
    who: Caller,
    fd: RawFd,
    region: Option<Region>,
    leases: Vec<u64>,
    /// Per lease, when leased bytes are bounded per uid: its bytes and
    /// when the backend lets it lapse.
    leased_bytes: std::collections::HashMap<u64, (u64, std::time::Instant)>,
    hello: HelloSlot,
    /// The hello's `FEATURE_*` bits: which statuses this client decodes.
    features: u8,
}

/// The uid's slot for a connection that has not completed its hello
/// (`Res::Hello`), given back once: at the hello, or when the connection
/// ends before it.
pub(super) struct HelloSlot {
    sh: std::sync::Arc<Shared>,
    uid: u32,
    held: bool,
}

impl HelloSlot {
    pub(super) fn new(sh: std::sync::Arc<Shared>, uid: u32) -> Self {
        HelloSlot {
            sh,
            uid,
            held: true,
        }
    }

    fn release(&mut self) {
        if std::mem::take(&mut self.held) {
            self.sh.quotas.give(self.uid, Res::Hello, 1);
        }
    }
}

impl Drop for HelloSlot {
    fn drop(&mut self) {
        self.release();
    }
}

pub(super) fn serve(sh: &Shared, s: UnixStream, who: Caller, hello: HelloSlot) {
    let idle = Duration::from_millis(sh.limits.idle_timeout_ms.max(1));
    let io = Duration::from_millis(sh.limits.io_timeout_ms.max(1));
    if s.set_read_timeout(Some(idle)).is_err() || s.set_write_timeout(Some(io)).is_err() {
        return;
    }
    let mut c = Conn {
        sh,
        who,
        fd: s.as_raw_fd(),
        region: None,
        leases: Vec::new(),
        leased_bytes: std::collections::HashMap::new(),
        hello,
        features: 0,
    };
    c.run();
    sh.quotas.give(c.who.account, Res::Lease, c.leases.len());
    let bytes = c.leased_bytes.drain().map(|(_, (b, _))| b).sum();
    sh.quotas.give_lease_bytes(c.who.account, bytes);
    for l in c.leases.drain(..) {
        sh.backend.release(l);
    }
}

impl Conn<'_> {
    fn error(&self, kind: &str) {
        self.sh.metrics.errors.with_label_values(&[kind]).inc();
    }

    /// Reads and decodes one request; `None` closes the connection (after
    /// an error reply where one is owed).
    fn next(&mut self, fds: &mut Vec<OwnedFd>) -> Option<(u32, Request)> {
        // The first frame (the hello) within `hello_timeout_ms`, the next
        // ones within `idle_timeout_ms`.
        let wait_ms = if self.hello.held {
            self.sh.limits.hello_timeout_ms
        } else {
            self.sh.limits.idle_timeout_ms
        };
        let idle = Duration::from_millis(wait_ms.max(1));
        let io = Duration::from_millis(self.sh.limits.io_timeout_ms.max(1));
        if proto::set_recv_timeout(self.fd, idle).is_err() {
            return None;
        }
        let body = match proto::recv_frame_timed(self.fd, fds, Some(io)) {
            Ok(b) => b,
            Err(RecvError::Closed) => return None,
            Err(RecvError::TooLarge(n)) => {
                self.error("too_large");
                send_err(
                    self.fd,
                    0,
                    code::TOO_LARGE,
                    format!("frame of {n} bytes; limit {}", proto::FRAME_BYTES_MAX),
                );
                return None;
            }
            Err(RecvError::Io(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                // Too many passed fds (already closed by the receive).
                self.error("malformed");
                send_err(self.fd, 0, code::MALFORMED, e.to_string());
                return None;
            }
            Err(RecvError::Io(e)) => {
                if e.kind() == std::io::ErrorKind::TimedOut {
                    self.error("timeout");
                } else {
                    self.error("io");
                }
                return None;
            }
        };
        match Request::decode(&body) {
            Ok(r) => Some(r),
            Err(e) => {
                self.error("malformed");
                let req_id = body
                    .get(4..8)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .unwrap_or(0);
                let c = if body.first() != Some(&proto::PROTOCOL_VERSION) {
                    code::VERSION
                } else {
                    code::MALFORMED
                };
                send_err(self.fd, req_id, c, e.to_string());
                None
            }
        }
    }

    fn run(&mut self) {
        let mut fds = Vec::new();
        let Some((id, hello)) = self.next(&mut fds) else {
            return;
        };
        let Request::Hello {
            shm_bytes,
            pid,
            features,
        } = hello
        else {
            self.error("malformed");
            send_err(
                self.fd,
                id,
                code::MALFORMED,
                "the first request must be hello",
            );
            return;
        };
        if shm_bytes > 0 && !self.adopt_region(id, shm_bytes, &mut fds) {
            return;
        }
        fds.clear();
        self.hello.release();
        self.features = features;
        let session_id = self.sh.next_session.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(session_id, pid, features, shm_bytes, "client connected");
        let hello = Response::Hello {
            version: proto::PROTOCOL_VERSION,
            session_id,
            keys_max: KEYS_MAX as u32,
            lease_ttl_max_ms: self.sh.limits.lease_ttl_max_ms,
        };
        if !send(self.fd, &hello, proto::OP_HELLO, id, &[]) {
            return;
        }
        loop {
            fds.clear();
            let Some((id, req)) = self.next(&mut fds) else {
                return;
            };
            if !fds.is_empty() {
                self.error("malformed");
                send_err(self.fd, id, code::MALFORMED, "unexpected file descriptors");
                return;
            }
            let op = req.op();
            if self.sh.shutdown.load(Ordering::SeqCst) {
                send_err(
                    self.fd,
                    id,
                    code::SHUTTING_DOWN,
                    "the daemon is shutting down",
                );
                return;
            }
            if matches!(req, Request::Subscribe) {
                self.events(id);
                return;
            }
            let name = Request::op_name(op);
            self.sh.metrics.requests.with_label_values(&[name]).inc();
            self.sh.in_flight.fetch_add(1, Ordering::SeqCst);
            self.sh
                .metrics
                .queue_depth
                .with_label_values(&["in_flight_requests"])
                .inc();
            let t = Instant::now();
            let (resp, files) = self.handle(req);
            self.sh
                .metrics
                .latency
                .with_label_values(&[name])
                .observe(t.elapsed().as_secs_f64());
            self.sh.in_flight.fetch_sub(1, Ordering::SeqCst);
            self.sh
                .metrics
                .queue_depth
                .with_label_values(&["in_flight_requests"])
                .dec();
            let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
            let is_err = matches!(resp, Response::Error { .. });
            // An older client fails its whole reply on a status code it
            // does not know: it gets the older code instead.
            let resp = resp.for_features(self.features);
            if !send(self.fd, &resp, op, id, &raw) {
                self.error("io");
                return;
            }
            if is_err {
                return;
            }
        }
    }

    /// The hello's shared region: within the limit, its fd present and a
    /// sealed memfd of the announced size. `false`: refused (the caller
    /// was told why) and the connection ends.
    fn adopt_region(&mut self, id: u32, shm_bytes: u64, fds: &mut Vec<OwnedFd>) -> bool {
        if shm_bytes > self.sh.limits.region_bytes_max {
            self.error("limit");
            send_err(
                self.fd,
                id,
                code::TOO_LARGE,
                format!(
                    "region of {shm_bytes} bytes; limit {}",
                    self.sh.limits.region_bytes_max
                ),
            );
            return false;
        }
        let Some(fd) = fds.pop() else {
            self.error("malformed");
            send_err(
                self.fd,
                id,
                code::NO_REGION,
                "hello announced a region but carried no fd",
            );
            return false;
        };
        match Region::adopt(fd, shm_bytes) {
            Ok(r) => {
                self.region = Some(r);
                true
            }
            Err(e) => {
                self.error("malformed");
                send_err(
                    self.fd,
                    id,
                    code::NO_REGION,
                    format!("shared region refused: {e}"),
                );
                false
            }
        }
    }

    fn no_region() -> Response {
        Response::Error {
            code: code::NO_REGION,
            message: "this connection registered no shared region".into(),
        }
    }

    fn status_of(&self, e: &Error) -> ItemStatus {
        let (kind, st) = err_kind(e);
        self.error(kind);
        tracing::debug!(error = %e, "item failed");
        st
    }

    /// The tiers of `keys`' cached prefix in `ns` (empty when the backend
    /// failed: a miss, counted).
    /// One namespace's lookup (its decoy when the caller may not use
    /// it), counted in the metrics and in the namespace's figures.
    fn lookup(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Vec<Tier> {
        let m = &self.sh.metrics;
        let ns = self.ns_for(ns);
        let tiers = match self.sh.backend.lookup_why(&ns, keys) {
            Ok((mut tiers, why)) => {
                tiers.truncate(keys.len());
                for t in &tiers {
                    m.hits.with_label_values(&[t.name()]).inc();
                }
                if tiers.len() < keys.len() {
                    m.misses
                        .with_label_values(&[reason_name(why)])
                        .inc_by((keys.len() - tiers.len()) as u64);
                }
                tiers
            }
            Err(e) => {
                self.status_of(&e);
                m.misses.with_label_values(&["unavailable"]).inc();
                Vec::new()
            }
        };
        let found = tiers.len() as u64;
        self.sh.clients.count(
            &ns,
            false,
            NsCounts {
                lookups: 1,
                lookup_hit_blocks: found,
                lookup_miss_blocks: keys.len() as u64 - found,
                ..Default::default()
            },
        );
        tiers
    }

    fn handle(&mut self, req: Request) -> (Response, Vec<std::fs::File>) {
        let b = &self.sh.backend;
        let resp = match req {
            Request::Hello { .. } | Request::Subscribe => Response::Error {
                code: code::MALFORMED,
                message: "hello/subscribe are only valid first".into(),
            },
            // A namespace the caller may not use runs as its decoy: a
            // namespace nothing is stored under, so the answer and its cost
            // are those of an unknown namespace's miss (access.rs).
            Request::Lookup { ns, keys } => Response::Lookup {
                tiers: self.lookup(&ns, &keys),
            },
            // Each namespace exactly as its own Lookup (decoy included):
            // one frame instead of one per tensor-parallel rank.
            Request::LookupMany { nss, keys } => Response::LookupMany {
                tiers: nss.iter().map(|ns| self.lookup(ns, &keys)).collect(),
            },
            Request::Describe { ns, engine, model } => self.handle_describe(ns, engine, model),
            Request::Offload { ns, items } => self.handle_offload(ns, items),
            Request::Onboard {
                ns,
                mode,
                lease_ttl_ms,
                items,
            } => return self.handle_onboard(ns, mode, lease_ttl_ms, items),
            Request::Release { leases } => self.handle_release(&leases),
            Request::Pin { ns, ttl_ms, keys } => self.handle_pin(ns, ttl_ms, keys),
            Request::Prefetch {
                ns,
                deadline_ms,
                stream,
                keys,
            } => {
                let ns = self.ns_for(&ns);
                let caller = PrefetchCaller {
                    uid: self.who.uid,
                    stream,
                };
                Response::Items {
                    status: b.prefetch(caller, &ns, &keys, deadline_ms),
                }
            }
            Request::Unpin { ns, keys } => {
                let ns = self.ns_for(&ns);
                Response::Items {
                    status: keys
                        .iter()
                        .map(|k| match b.unpin(&ns, k) {
                            Ok(true) => {
                                self.sh.quotas.unpin(self.who.account, &ns, k);
                                ItemStatus::Ok
                            }
                            Ok(false) => ItemStatus::Absent,
                            Err(e) => self.status_of(&e),
                        })
                        .collect(),
                }
            }
            // Deleting is an operator's act: with [[tenants]], a tenant's
            // engine may not remove blocks (other tenants' workers share
            // its prefixes' G4 copies, and eviction is the node's policy).
            Request::Evict { .. } if !self.who.grant.is_admin() => {
                self.error("denied");
                Response::Error {
                    code: code::DENIED,
                    message: format!(
                        "evict needs an admin uid (uid {} is a tenant); see [access] admin_uids",
                        self.who.uid
                    ),
                }
            }
            Request::Verify { ns, keys, repair } => self.handle_verify(ns, &keys, repair),
            // A client's word that a block it read over a passed fd is
            // corrupt: never trusted (a tenant must not be able to remove
            // blocks others use). The daemon re-reads and verifies its own
            // copy; only a real mismatch quarantines it, and it is then
            // repaired from G4 or a peer at once (node/repair.rs).
            Request::ReportCorrupt { ns, keys } => self.handle_report_corrupt(ns, keys),
            // Last key first: a chain's keys come in chain order, and an
            // evicted block takes its descendants on G3 along (they could
            // not be reached), so its children, asked for in the same
            // request, are evicted before it and answer `ok`, not `absent`.
            Request::Evict { ns, keys, tier } => {
                let ns = self.ns_for(&ns);
                let mut status: Vec<ItemStatus> = keys
                    .iter()
                    .rev()
                    .map(|k| match b.evict_tier(&ns, k, tier) {
                        Ok(crate::base::backend::EvictOutcome::Evicted) => ItemStatus::Ok,
                        Ok(crate::base::backend::EvictOutcome::Absent) => ItemStatus::Absent,
                        Ok(crate::base::backend::EvictOutcome::Busy) => ItemStatus::LimitReached,
                        Err(e) => self.status_of(&e),
                    })
                    .collect();
                status.reverse();
                Response::Items { status }
            }
            Request::Stat { ns, keys } => {
                let mut entries = Vec::with_capacity(keys.len());
                let ns = self.ns_for(&ns);
                for k in &keys {
                    match b.stat(&ns, k) {
                        Ok(s) => entries.push(s),
                        Err(e) => {
                            self.status_of(&e);
                            entries.push(None);
                        }
                    }
                }
                Response::Stat { entries }
            }
            Request::Stats if !self.who.grant.is_admin() => {
                self.error("denied");
                Response::Error {
                    code: code::DENIED,
                    message: format!(
                        "daemon-wide stats need an admin uid (uid {} is a tenant); \
                         see [access] admin_uids",
                        self.who.uid
                    ),
                }
            }
            Request::Stats => Response::Stats {
                json: self.stats_json(),
            },
            Request::List { ns, after, limit } => match self.list(ns, after, limit as usize) {
                Ok(entries) => {
                    let next = if entries.len() == limit as usize {
                        entries.last().map(|e| (e.ns, e.key))
                    } else {
                        None
                    };
                    Response::List { entries, next }
                }
                Err(e) => Response::Error {
                    code: code::INTERNAL,
                    message: e.to_string(),
                },
            },
        };
        (resp, Vec::new())
    }

    /// Offload: the items the caller may store, checked one by one, go to
    /// the store as one batch (their durable steps shared).
    fn handle_offload(&mut self, ns: NamespaceId, items: Vec<proto::OffloadItem>) -> Response {
        let Some(region) = self.region.as_ref() else {
            return Self::no_region();
        };
        if !self.who.grant.may(&ns) {
            // Refused whatever the store holds: nothing learned.
            self.error("denied");
            return Response::Items {
                status: vec![ItemStatus::Invalid; items.len()],
            };
        }
        // Each namespace costs directories on the disk: one uid
        // holds blocks in a bounded number of them.
        let backend = &self.sh.backend;
        if !self
            .sh
            .quotas
            .namespace(self.who.account, &ns, |n| backend.holds_namespace(n))
        {
            return Response::Items {
                status: vec![ItemStatus::LimitReached; items.len()],
            };
        }
        // Invalid items are answered here; the valid ones go to
        // the store as one batch, so their durable steps are
        // shared (one directory fsync and index commit).
        let mut status = Vec::with_capacity(items.len());
        let mut batch = Vec::with_capacity(items.len());
        let mut at = Vec::with_capacity(items.len());
        for it in &items {
            match self.offload_item(region, &ns, it) {
                Ok(b) => {
                    at.push(status.len());
                    batch.push(b);
                    status.push(ItemStatus::Ok);
                }
                Err(st) => status.push(st),
            }
        }
        // A pin hint counts against the account's pinned bytes;
        // past them the block is stored unpinned.
        let pin_refused = self.charge_pin_hints(&ns, &mut batch);
        let outcomes = self.sh.backend.offload_batch(&ns, &batch);
        let mut stored = NsCounts::default();
        for (((i, b), r), refused) in at.into_iter().zip(&batch).zip(outcomes).zip(pin_refused) {
            if b.hints.pinned && !matches!(r, Ok(PutOutcome::Stored)) {
                self.sh.quotas.unpin(self.who.account, &ns, &b.header.key);
            }
            status[i] = match r {
                Ok(PutOutcome::Stored) if refused => {
                    self.sh.metrics.offload_bytes.inc_by(b.header.payload_len);
                    stored.offload_blocks += 1;
                    stored.offload_bytes += b.header.payload_len;
                    ItemStatus::StoredUnpinned
                }
                Ok(PutOutcome::Stored) => {
                    self.sh.metrics.offload_bytes.inc_by(b.header.payload_len);
                    stored.offload_blocks += 1;
                    stored.offload_bytes += b.header.payload_len;
                    ItemStatus::Ok
                }
                Ok(PutOutcome::StoredUnpinned) => {
                    self.sh.metrics.offload_bytes.inc_by(b.header.payload_len);
                    ItemStatus::StoredUnpinned
                }
                Ok(PutOutcome::AlreadyPresent) => ItemStatus::AlreadyPresent,
                Err(e) => self.status_of(&e),
            };
        }
        if stored.offload_blocks > 0 {
            self.sh.clients.count(&ns, true, stored);
        }
        Response::Items { status }
    }

    /// Onboard, within the account's share of onboards in flight.
    fn handle_onboard(
        &mut self,
        ns: NamespaceId,
        mode: OnboardMode,
        lease_ttl_ms: u32,
        items: Vec<proto::OnboardItem>,
    ) -> (Response, Vec<std::fs::File>) {
        let uid = self.who.account;
        if !self.sh.quotas.take(uid, Res::Onboard) {
            self.error("limit");
            let limit = self.sh.quotas.limit_of(Res::Onboard);
            tracing::debug!(uid, limit, "onboard refused: the uid's share is in flight");
            let items = items.iter().map(|_| limited_result()).collect();
            return (Response::Onboard { items }, Vec::new());
        }
        let ns = self.ns_for(&ns);
        let out = self.onboard(ns, mode, lease_ttl_ms, items);
        self.sh.quotas.give(uid, Res::Onboard, 1);
        if let (Response::Onboard { items }, _) = &out {
            let hits = items.iter().filter(|r| r.status == ItemStatus::Ok);
            let hit_blocks = hits.clone().count() as u64;
            self.sh.clients.count(
                &ns,
                false,
                NsCounts {
                    onboard_hit_blocks: hit_blocks,
                    onboard_miss_blocks: items.len() as u64 - hit_blocks,
                    onboard_bytes: hits.map(|r| r.payload_len).sum(),
                    ..Default::default()
                },
            );
        }
        out
    }

    /// A client's word that blocks it read are corrupt: re-verified, never
    /// trusted (see the match arm in [`Self::handle`]).
    fn handle_report_corrupt(&mut self, ns: NamespaceId, keys: Vec<BlockKey>) -> Response {
        let b = &self.sh.backend;
        let ns = self.ns_for(&ns);
        self.sh.clients.count(
            &ns,
            false,
            NsCounts {
                reported_corrupt_blocks: keys.len() as u64,
                ..Default::default()
            },
        );
        Response::Items {
            status: keys
                .iter()
                .map(|k| {
                    let st = match b.report_corrupt(&ns, k) {
                        Ok(crate::base::backend::VerifyOutcome::Ok) => ItemStatus::Ok,
                        Ok(crate::base::backend::VerifyOutcome::Repaired(_)) => {
                            ItemStatus::Repaired
                        }
                        Ok(crate::base::backend::VerifyOutcome::Dropped) => ItemStatus::Corrupt,
                        Ok(crate::base::backend::VerifyOutcome::Absent) => ItemStatus::Absent,
                        Err(e) => self.status_of(&e),
                    };
                    // A report the daemon's copy contradicts (intact,
                    // absent) costs a client nothing to send: a
                    // line a second, not one per key.
                    if matches!(st, ItemStatus::Repaired | ItemStatus::Corrupt) {
                        tracing::warn!(uid = self.who.uid, %ns, key = %k, outcome = ?st,
                            "a client reported a corrupt block (read over a passed fd or placed in its region); re-verified");
                    } else {
                        crate::warn_limited!(REPORT_LOG, uid = self.who.uid, %ns, key = %k, outcome = ?st,
                            "a client reported a corrupt block its copy contradicts; re-verified");
                    }
                    st
                })
                .collect(),
        }
    }

    /// Pin, each key within the account's pinned bytes.
    fn handle_pin(&mut self, ns: NamespaceId, ttl_ms: u32, keys: Vec<BlockKey>) -> Response {
        let b = &self.sh.backend;
        let ns = self.ns_for(&ns);
        let uid = self.who.account;
        Response::Items {
            status: keys
                .iter()
                .map(|k| {
                    let bytes = self.pin_bytes(&ns, k);
                    let still = |n: &NamespaceId, k: &BlockKey| self.still_pinned(n, k);
                    if !self.sh.quotas.pin(uid, &ns, k, Some(ttl_ms), bytes, still) {
                        self.error("limit");
                        return ItemStatus::LimitReached;
                    }
                    let st = match b.pin(&ns, k, ttl_ms) {
                        Ok(Lookup::Hit(())) => ItemStatus::Ok,
                        Ok(Lookup::Miss(r)) => miss_status(r),
                        Err(e) => self.status_of(&e),
                    };
                    if st != ItemStatus::Ok {
                        self.sh.quotas.unpin(uid, &ns, k);
                    }
                    st
                })
                .collect(),
        }
    }

    /// Describe: the engine and model of a namespace the caller may use
    /// (a tenant cannot relabel another tenant's).
    fn handle_describe(&mut self, ns: NamespaceId, engine: String, model: String) -> Response {
        let st = if !self.who.grant.may(&ns) {
            // Only a namespace the caller may use: a tenant cannot
            // relabel another tenant's.
            self.error("denied");
            ItemStatus::Invalid
        } else {
            match self.sh.clients.describe(&ns, Description { engine, model }) {
                Ok(()) => ItemStatus::Ok,
                Err(_) => {
                    self.error("limit");
                    ItemStatus::LimitReached
                }
            }
        };
        Response::Items { status: vec![st] }
    }

    /// Release this connection's leases (only its own).
    fn handle_release(&mut self, leases: &[u64]) -> Response {
        let b = &self.sh.backend;
        let status = leases
            .iter()
            .map(|l| {
                // Only this connection's leases: ids are sequential,
                // so releasing another client's would be a guess away.
                let before = self.leases.len();
                self.leases.retain(|x| x != l);
                if self.leases.len() == before {
                    return ItemStatus::Absent;
                }
                self.sh.quotas.give(self.who.account, Res::Lease, 1);
                self.forget_bytes(*l);
                if b.release(*l) {
                    ItemStatus::Ok
                } else {
                    ItemStatus::Absent
                }
            })
            .collect();
        Response::Items { status }
    }

    /// Verify (and with `repair`, repair) stored blocks.
    fn handle_verify(&mut self, ns: NamespaceId, keys: &[BlockKey], repair: bool) -> Response {
        let b = &self.sh.backend;
        let ns = self.ns_for(&ns);
        Response::Items {
            status: keys
                .iter()
                .map(|k| match b.verify(&ns, k, repair) {
                    Ok(crate::base::backend::VerifyOutcome::Ok) => ItemStatus::Ok,
                    Ok(crate::base::backend::VerifyOutcome::Repaired(_)) => ItemStatus::Repaired,
                    Ok(crate::base::backend::VerifyOutcome::Dropped) => ItemStatus::Corrupt,
                    Ok(crate::base::backend::VerifyOutcome::Absent) => ItemStatus::Absent,
                    Err(e) => self.status_of(&e),
                })
                .collect(),
        }
    }

    /// The namespace a request for `ns` runs against (itself, or its decoy
    /// when this caller may not use it).
    fn ns_for(&self, ns: &NamespaceId) -> NamespaceId {
        let e = self.sh.policy.effective(&self.who.grant, ns);
        if e != *ns {
            self.error("denied");
        }
        e
    }

    /// One list page. All namespaces for an admin; a tenant's listing
    /// without a namespace walks only its own namespaces, in id order, so
    /// the cursor pages exactly as over the whole store.
    fn list(
        &self,
        ns: Option<NamespaceId>,
        after: Option<(NamespaceId, BlockKey)>,
        limit: usize,
    ) -> crate::base::error::Result<Vec<proto::ListEntry>> {
        let b = &self.sh.backend;
        let Some(mine) = self.who.grant.namespaces() else {
            return b.list(ns, after, limit);
        };
        if let Some(n) = ns {
            if !mine.contains(&n) {
                self.error("denied");
                return Ok(Vec::new());
            }
            return b.list(Some(n), after, limit);
        }
        let mut out = Vec::new();
        for n in mine {
            if out.len() >= limit {
                break;
            }
            let from = match after {
                Some((an, _)) if *n < an => continue,
                Some((an, ak)) if *n == an => Some((an, ak)),
                _ => None,
            };
            out.extend(b.list(Some(*n), from, limit - out.len())?);
        }
        Ok(out)
    }

    /// Validates one offload item against the region: the block to store,
    /// or the status to answer.
    fn offload_item<'r>(
        &self,
        region: &'r Region,
        ns: &NamespaceId,
        it: &proto::OffloadItem,
    ) -> std::result::Result<OffloadBlock<'r>, ItemStatus> {
        // Decode a private copy of the header: the client can rewrite the
        // region at any time.
        let mut hb = [0u8; HEADER_BYTES];
        let invalid = || {
            self.error("invalid");
            ItemStatus::Invalid
        };
        // A page not in memory (never populated, punched out) would be faulted in, and
        // charged, to the daemon: refused like an out-of-bounds offset.
        if !region.populated(it.shm_offset, HEADER_BYTES) || !region.read(it.shm_offset, &mut hb) {
            return Err(invalid());
        }
        let Ok(header) = BlockHeader::decode(&hb) else {
            return Err(invalid());
        };
        if header.namespace_id() != *ns {
            return Err(invalid());
        }
        let at = it.shm_offset + HEADER_BYTES as u64;
        let len = header.payload_len as usize;
        let Some(payload) = region.slice(at, len).filter(|_| region.populated(at, len)) else {
            return Err(invalid());
        };
        Ok(OffloadBlock {
            header,
            payload,
            parent: it.parent,
            hints: it.hints,
        })
    }

    fn onboard(
        &mut self,
        ns: NamespaceId,
        mode: OnboardMode,
        lease_ttl_ms: u32,
        items: Vec<proto::OnboardItem>,
    ) -> (Response, Vec<std::fs::File>) {
        let b = self.sh.backend.clone();
        if mode == OnboardMode::Shm && self.region.is_none() {
            return (
                Response::Error {
                    code: code::NO_REGION,
                    message: "shared-region onboard without a region".into(),
                },
                Vec::new(),
            );
        }
        let keys: Vec<BlockKey> = items.iter().map(|it| it.key).collect();
        let known = b.prepare_onboard(&ns, &keys);
        let region = self.region.take();
        let mut files = Vec::new();
        let mut out: Vec<OnboardResult> = Vec::with_capacity(items.len());
        // Items are checked and leased in order; their reads are gathered
        // and run together (onboard.rs). The gathered reads run first
        // whenever an item would see their outcome: its lease is refused
        // for the limit (a failed read gives its lease back, as it did
        // when items were read one by one), or its destination overlaps
        // one of theirs.
        let mut pending: Vec<(usize, ReadJob<'_>)> = Vec::new();
        let mut ranges = Ranges::default();
        for (i, it) in items.iter().enumerate() {
            out.push(empty_result());
            if let Some(reason) = known.get(i).copied().flatten() {
                self.sh
                    .metrics
                    .misses
                    .with_label_values(&[reason_name(reason)])
                    .inc();
                out[i].status = miss_status(reason);
                continue;
            }
            // Lease first so the block cannot go away between the read and
            // the client's use of it.
            if lease_ttl_ms > 0 {
                let mut leased = self.lease_item(&ns, &it.key, lease_ttl_ms);
                if matches!(leased, Err(ItemStatus::LimitReached)) && !pending.is_empty() {
                    self.run_reads(&ns, std::mem::take(&mut pending), &mut out, &mut files);
                    ranges.clear();
                    leased = self.lease_item(&ns, &it.key, lease_ttl_ms);
                }
                match leased {
                    Ok(l) => out[i].lease_id = l,
                    Err(st) => {
                        if st == ItemStatus::LimitReached {
                            self.error("limit");
                        }
                        out[i].status = st;
                        continue;
                    }
                }
            }
            let job = match mode {
                OnboardMode::Shm => {
                    let dst = region
                        .as_ref()
                        .filter(|reg| reg.populated(it.shm_offset, it.shm_len as usize))
                        .and_then(|reg| reg.slice_mut(it.shm_offset, it.shm_len as usize));
                    let Some(dst) = dst else {
                        self.error("invalid");
                        out[i].status = ItemStatus::Invalid;
                        self.drop_lease(&mut out[i]);
                        continue;
                    };
                    let len = it.shm_len;
                    if ranges.overlaps(it.shm_offset, len) {
                        self.run_reads(&ns, std::mem::take(&mut pending), &mut out, &mut files);
                        ranges.clear();
                    }
                    ranges.add(it.shm_offset, len);
                    ReadJob::Shm { key: it.key, dst }
                }
                OnboardMode::DirectFd => ReadJob::Fd { key: it.key },
            };
            pending.push((i, job));
        }
        self.run_reads(&ns, pending, &mut out, &mut files);
        self.region = region;
        (Response::Onboard { items: out }, files)
    }

    /// Leases one onboard item within the connection's and the uid's
    /// budgets; the item's status when it cannot be. A refusal for the
    /// limit is not counted here: the caller may retry once after the
    /// gathered reads gave their failed leases back, and counts the one
    /// that stands.
    fn lease_item(
        &mut self,
        ns: &NamespaceId,
        key: &BlockKey,
        ttl_ms: u32,
    ) -> std::result::Result<u64, ItemStatus> {
        if self.leases.len() >= self.sh.limits.leases_per_conn_max
            || !self.sh.quotas.take(self.who.account, Res::Lease)
        {
            return Err(ItemStatus::LimitReached);
        }
        match self.sh.backend.lease(ns, key, ttl_ms) {
            Ok(Lookup::Hit(l)) => {
                if !self.charge_bytes(ns, key, l, ttl_ms) {
                    self.sh.backend.release(l);
                    self.sh.quotas.give(self.who.account, Res::Lease, 1);
                    return Err(ItemStatus::LimitReached);
                }
                self.leases.push(l);
                Ok(l)
            }
            Ok(Lookup::Miss(reason)) => {
                self.sh.quotas.give(self.who.account, Res::Lease, 1);
                self.sh
                    .metrics
                    .misses
                    .with_label_values(&[reason_name(reason)])
                    .inc();
                Err(miss_status(reason))
            }
            // The store's lease budget: counted by the caller, as above.
            Err(Error::LimitReached { .. }) => {
                self.sh.quotas.give(self.who.account, Res::Lease, 1);
                Err(ItemStatus::LimitReached)
            }
            Err(e) => {
                self.sh.quotas.give(self.who.account, Res::Lease, 1);
                Err(self.status_of(&e))
            }
        }
    }

    /// Charges lease `l`'s bytes to the uid's share when leased bytes are
    /// bounded per uid; false past the share (after giving back what this
    /// connection's lapsed leases held).
    fn charge_bytes(&mut self, ns: &NamespaceId, key: &BlockKey, l: u64, ttl_ms: u32) -> bool {
        if self.sh.quotas.lease_bytes_bounded().is_none() {
            return true;
        }
        let bytes = match self.sh.backend.stat(ns, key) {
            Ok(Some(st)) => HEADER_BYTES as u64 + st.payload_len,
            _ => HEADER_BYTES as u64,
        };
        let uid = self.who.account;
        if !self.sh.quotas.take_lease_bytes(uid, bytes) {
            let now = std::time::Instant::now();
            let lapsed: Vec<u64> = self
                .leased_bytes
                .iter()
                .filter(|(_, (_, until))| *until <= now)
                .map(|(id, _)| *id)
                .collect();
            for id in lapsed {
                self.forget_bytes(id);
            }
            if !self.sh.quotas.take_lease_bytes(uid, bytes) {
                return false;
            }
        }
        let ttl = u64::from(ttl_ms.min(self.sh.limits.lease_ttl_max_ms));
        let until = std::time::Instant::now() + Duration::from_millis(ttl);
        self.leased_bytes.insert(l, (bytes, until));
        true
    }

    /// What a pin of `key` is charged (header + payload; 0 when pinned
    /// bytes are not bounded).
    fn pin_bytes(&self, ns: &NamespaceId, key: &BlockKey) -> u64 {
        if !self.sh.quotas.pin_bytes_bounded() {
            return 0;
        }
        match self.sh.backend.stat(ns, key) {
            Ok(Some(st)) => HEADER_BYTES as u64 + st.payload_len,
            _ => HEADER_BYTES as u64,
        }
    }

    /// Whether `key` is still pinned (or cannot be told: kept counted).
    fn still_pinned(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        match self.sh.backend.stat(ns, key) {
            Ok(Some(st)) => st.pinned_until_unix_ms != 0,
            Ok(None) => false,
            Err(_) => true,
        }
    }

    /// Charges the pin hints of `batch` to the caller's pinned bytes; a
    /// hint past them is dropped (the block is stored unpinned). Which
    /// were dropped, in batch order.
    fn charge_pin_hints(&self, ns: &NamespaceId, batch: &mut [OffloadBlock<'_>]) -> Vec<bool> {
        let bounded = self.sh.quotas.pin_bytes_bounded();
        batch
            .iter_mut()
            .map(|b| {
                if !b.hints.pinned || !bounded {
                    return false;
                }
                let bytes = HEADER_BYTES as u64 + b.header.payload_len;
                let still = |n: &NamespaceId, k: &BlockKey| self.still_pinned(n, k);
                let ok =
                    self.sh
                        .quotas
                        .pin(self.who.account, ns, &b.header.key, None, bytes, still);
                if !ok {
                    self.error("limit");
                    b.hints.pinned = false;
                }
                !ok
            })
            .collect()
    }

    /// Gives back the bytes lease `l` was charged, if any.
    fn forget_bytes(&mut self, l: u64) {
        if let Some((b, _)) = self.leased_bytes.remove(&l) {
            self.sh.quotas.give_lease_bytes(self.who.account, b);
        }
    }

    /// Gives back the lease of an item that is not served.
    fn drop_lease(&mut self, r: &mut OnboardResult) {
        if r.lease_id != 0 {
            self.sh.quotas.give(self.who.account, Res::Lease, 1);
            self.forget_bytes(r.lease_id);
            self.sh.backend.release(r.lease_id);
            self.leases.retain(|x| *x != r.lease_id);
            r.lease_id = 0;
        }
    }

    /// Reads the gathered items together and records their outcomes in
    /// request order (fd indexes follow it too).
    fn run_reads(
        &mut self,
        ns: &NamespaceId,
        pending: Vec<(usize, ReadJob<'_>)>,
        out: &mut [OnboardResult],
        files: &mut Vec<std::fs::File>,
    ) {
        if pending.is_empty() {
            return;
        }
        let (at, jobs): (Vec<usize>, Vec<ReadJob<'_>>) = pending.into_iter().unzip();
        let b = self.sh.backend.clone();
        let m = self.sh.metrics.clone();
        let got = read_all(
            &*b,
            ns,
            jobs,
            self.sh.limits.onboard_reads_in_flight_max,
            self.sh.limits.onboard_batch_reads,
        );
        for (i, g) in at.into_iter().zip(got) {
            let Some(r) = out.get_mut(i) else { continue };
            match g {
                Ok(Lookup::Hit((h, tier, off, file))) => {
                    if let Some(f) = file {
                        r.fd_index = files.len() as u32;
                        files.push(f);
                    }
                    r.status = ItemStatus::Ok;
                    r.tier = tier;
                    r.payload_len = h.payload_len;
                    r.payload_sum = h.payload_sum;
                    r.file_offset = off;
                    m.hits.with_label_values(&[tier.name()]).inc();
                    m.onboard_bytes.inc_by(h.payload_len);
                }
                Ok(Lookup::Miss(reason)) => {
                    m.misses.with_label_values(&[reason_name(reason)]).inc();
                    r.status = miss_status(reason);
                }
                Err(e) => r.status = self.status_of(&e),
            }
            if r.status != ItemStatus::Ok {
                self.drop_lease(r);
            }
        }
    }

    fn stats_json(&self) -> String {
        let s = self.sh.backend.stats();
        let tiers: serde_json::Map<String, serde_json::Value> = s
            .tiers
            .iter()
            .map(|t| {
                (
                    t.tier.name().to_string(),
                    serde_json::json!({
                        // null: not yet known (G4 before its first listing).
                        "blocks": t.known.then_some(t.blocks),
                        "bytes": t.known.then_some(t.bytes),
                        // null: unbounded (a G4 without capacity_bytes).
                        "capacity_bytes": (t.capacity_bytes > 0).then_some(t.capacity_bytes),
                    }),
                )
            })
            .collect();
        serde_json::json!({
            "backend": self.sh.backend.name(),
            "tiers": tiers,
            "evictions": s.evictions,
            "quarantined": s.quarantined,
            "leases_held": s.leases_held,
            "pins_held": s.pins_held,
            "connections": self.sh.conns.load(Ordering::Relaxed),
            "in_flight_requests": self.sh.in_flight.load(Ordering::Relaxed),
            "event_subscribers": self.sh.bus.subscribers(),
            "events_published": self.sh.bus.published(),
            // A string: ids derived from a node id use all 64 bits, which
            // a JSON number loses above 2^53 in most readers (jq, JS).
            "events_dynamo_worker_id": self.sh.bus.dynamo_worker().map(|w| w.to_string()),
            "events_dynamo_skipped_blocks": self.sh.bus.dynamo_skipped_blocks(),
            "namespaces": self.sh.clients.json(),
        })
        .to_string()
    }

    fn events(&mut self, id: u32) {
        let uid = self.who.account;
        if !self.sh.quotas.take(uid, Res::Sub) {
            self.error("busy");
            let max = self.sh.quotas.limit_of(Res::Sub);
            send_err(
                self.fd,
                id,
                code::BUSY,
                format!(
                    "uid {} (or its tenant) holds its share of {max} event subscriptions",
                    self.who.uid
                ),
            );
            return;
        }
        self.subscribed(id);
        self.sh.quotas.give(uid, Res::Sub, 1);
    }

    fn subscribed(&mut self, id: u32) {
        // The last few slots are kept for admins (root's `kvtier events`,
        // a router's relay).
        let kept = if self.who.grant.may_use_reserve() {
            0
        } else {
            self.sh.quotas.limits().admin_subscribers_reserved
        };
        let max = crate::base::events::SUBSCRIBERS_MAX;
        let Some(sub) = self.sh.bus.subscribe_within(max.saturating_sub(kept)) else {
            self.error("busy");
            let why = if kept == 0 {
                format!("all {max} event subscriptions are taken")
            } else {
                format!(
                    "all {max} event subscriptions are taken, {kept} of them kept for admins \
                     ([access] admin_subscribers_reserved)"
                )
            };
            send_err(self.fd, id, code::BUSY, why);
            return;
        };
        self.sh
            .metrics
            .queue_depth
            .with_label_values(&["event_subscribers"])
            .inc();
        if send(self.fd, &Response::Subscribed, proto::OP_SUBSCRIBE, id, &[]) {
            self.event_loop(&sub);
        }
        self.sh
            .metrics
            .queue_depth
            .with_label_values(&["event_subscribers"])
            .dec();
    }

    fn event_loop(&self, sub: &crate::base::events::Subscription) {
        super::follow::serve(self.fd, sub, &self.who.grant, &self.sh.shutdown);
    }
}

/// The result of an onboard item refused for the caller's share.
fn limited_result() -> OnboardResult {
    OnboardResult {
        status: ItemStatus::LimitReached,
        ..empty_result()
    }
}

/// An onboard item's result before it is served (absent until it is).
fn empty_result() -> OnboardResult {
    OnboardResult {
        status: ItemStatus::Absent,
        tier: Tier::G3,
        lease_id: 0,
        payload_len: 0,
        payload_sum: kvtier_client::PayloadSum::from_bytes([0; 32]),
        fd_index: u32::MAX,
        file_offset: 0,
    }
}

/// The `reason` label of `kvtier_misses_total`. A late tier stays
/// `unavailable` there, as the metric has always counted it ("could not
/// answer in time"); only the wire status tells it apart.
fn reason_name(r: MissReason) -> &'static str {
    match r {
        MissReason::Absent => "absent",
        MissReason::Corrupt => "corrupt",
        _ => "unavailable",
    }
}
