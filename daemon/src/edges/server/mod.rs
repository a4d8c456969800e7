//! The local server: a Unix socket speaking [`kvtier_client::proto`], one
//! thread per connection, bulk bytes through each client's shared region.
//!
//! Isolation: every connection has its own thread, its own socket timeouts
//! (idle for the next request, `io_timeout_ms` for sending a reply) and its
//! own bounded lease list, so a slow, stuck or dead client only ever holds
//! its own thread. The number of connections is bounded (`max_connections`;
//! the next one gets a `BUSY` error frame). A malformed or oversized frame
//! gets an error reply and closes that connection only.
//!
//! Shutdown: [`ShutdownHandle::trigger`] stops the accept loop, requests in
//! flight finish (up to `drain_timeout_ms`), then the backend is flushed.

mod bind;
pub mod clients;
mod conn;
mod follow;
mod onboard;
mod quota;

use crate::base::backend::Backend;
pub use quota::UidLimits;

use crate::base::error::{Error, Result};
use crate::base::events::EventBus;
use crate::edges::access::Policy;
use crate::edges::metrics::Metrics;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The gid of `server.socket_group`: a group name known to this host, or a
/// numeric gid (containers often have no name for the workers' group).
pub fn socket_gid(group: &str) -> Result<u32> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    match nix::unistd::Group::from_name(group) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(Error::Config {
            key: "server.socket_group".into(),
            problem: format!(
                "no group named {group:?} on this host (create it, or give a numeric gid)"
            ),
        }),
        Err(e) => Err(Error::Config {
            key: "server.socket_group".into(),
            problem: format!("looking up group {group:?}: {e}"),
        }),
    }
}

/// Default of [`ServerLimits::onboard_reads_in_flight_max`]: the G3
/// engine's default ring pool (`g3.io_depth`), so one request can keep the
/// disk as busy as the store allows.
pub const ONBOARD_READS_IN_FLIGHT_DEFAULT: usize = 16;
/// Largest accepted `server.onboard_reads_in_flight_max`.
pub const ONBOARD_READS_IN_FLIGHT_MAX: usize = 256;

/// Bounds of the server.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// A connection that sends no request for this long is closed.
    pub idle_timeout_ms: u64,
    /// A connection must complete its hello within this long (a silent
    /// connection holds a slot only this long, not `idle_timeout_ms`).
    pub hello_timeout_ms: u64,
    /// Deadline for sending one reply.
    pub io_timeout_ms: u64,
    /// Largest shared region a client may register.
    pub region_bytes_max: u64,
    /// Leases one connection may hold.
    pub leases_per_conn_max: usize,
    /// Block reads one onboard request runs at once (server/onboard.rs).
    pub onboard_reads_in_flight_max: usize,
    /// G3's slotted hits of a request read as one batch on the
    /// connection's thread (server/onboard.rs).
    pub onboard_batch_reads: bool,
    /// How long shutdown waits for requests in flight.
    pub drain_timeout_ms: u64,
    /// Longest lease (told to clients in the hello reply; the backend
    /// enforces it).
    pub lease_ttl_max_ms: u32,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_connections: 1024,
            idle_timeout_ms: 600_000,
            hello_timeout_ms: 5_000,
            io_timeout_ms: 5_000,
            region_bytes_max: 4 << 30,
            leases_per_conn_max: 4096,
            onboard_reads_in_flight_max: ONBOARD_READS_IN_FLIGHT_DEFAULT,
            onboard_batch_reads: true,
            drain_timeout_ms: 10_000,
            lease_ttl_max_ms: 30_000,
        }
    }
}

pub(crate) struct Shared {
    pub backend: Arc<dyn Backend>,
    pub metrics: Metrics,
    pub bus: EventBus,
    pub limits: ServerLimits,
    pub shutdown: Arc<AtomicBool>,
    pub conns: AtomicUsize,
    pub in_flight: AtomicUsize,
    pub next_session: AtomicU64,
    pub policy: Arc<Policy>,
    pub quotas: quota::Quotas,
    /// Per-namespace figures and descriptions (clients.rs).
    pub clients: Arc<clients::ClientStats>,
}

/// Stops a running server from another thread or a signal handler task.
#[derive(Debug, Clone)]
pub struct ShutdownHandle(Arc<AtomicBool>);

impl ShutdownHandle {
    /// Asks the server to stop.
    pub fn trigger(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    /// Whether stop was asked.
    pub fn is_triggered(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// A bound server.
pub struct Server {
    listener: UnixListener,
    /// Removed when the server stops or is dropped (a failed start).
    socket_file: bind::SocketFile,
    path: PathBuf,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Server({})", self.path.display())
    }
}

/// Socket file settings.
#[derive(Debug, Clone)]
pub struct SocketOptions {
    /// Path of the socket.
    pub path: PathBuf,
    /// Permission bits (default 0o660).
    pub mode: u32,
    /// Group that owns the socket, if any.
    pub group: Option<String>,
}

static ACCEPT_WARN: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(1000);
static DENIED_WARN: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(1000);

use kvtier_client::proto::code as proto_code;

impl Server {
    /// Binds the socket (replacing a stale one, refusing a live one).
    pub fn bind(
        sock: &SocketOptions,
        backend: Arc<dyn Backend>,
        metrics: Metrics,
        bus: EventBus,
        limits: ServerLimits,
    ) -> Result<Server> {
        let path = &sock.path;
        let gid = match &sock.group {
            Some(g) => Some(socket_gid(g)?),
            None => None,
        };
        let (listener, socket_file) = bind::bind_private(path, sock.mode, gid)?;
        backend.attach_events(bus.clone());
        metrics.set_bus(bus.clone());
        let client_stats = Arc::new(clients::ClientStats::new());
        match clients::ClientCollector::new(client_stats.clone()) {
            Ok(c) => metrics.register_collector(Box::new(c)),
            Err(e) => tracing::warn!(error = %e, "per-namespace client metrics not exported"),
        }
        Ok(Server {
            listener,
            socket_file,
            path: path.clone(),
            shared: Arc::new(Shared {
                backend,
                metrics,
                bus,
                limits,
                shutdown: Arc::new(AtomicBool::new(false)),
                conns: AtomicUsize::new(0),
                in_flight: AtomicUsize::new(0),
                next_session: AtomicU64::new(1),
                policy: Arc::new(Policy::open()),
                quotas: quota::Quotas::new(UidLimits::default()),
                clients: client_stats,
            }),
        })
    }

    /// Sets who may use what ([`crate::edges::access`]) and the per-uid shares.
    /// Call before [`Server::run`]; without it the server is single-tenant
    /// with no per-uid shares.
    pub fn set_access(&mut self, policy: Arc<Policy>, uid_limits: UidLimits) -> Result<()> {
        let sh = Arc::get_mut(&mut self.shared).ok_or_else(|| Error::Config {
            key: "server".into(),
            problem: "access set after the server started".into(),
        })?;
        sh.policy = policy;
        sh.quotas = quota::Quotas::new(uid_limits);
        Ok(())
    }

    /// A handle that stops [`Server::run`].
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle(self.shared.shutdown.clone())
    }

    /// Accepts connections until shut down, drains, flushes the backend.
    pub fn run(mut self) -> Result<()> {
        let fd = self.listener.as_raw_fd();
        self.listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the socket", &self.path, e))?;
        while !self.shared.shutdown.load(Ordering::SeqCst) {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, 100) };
            loop {
                match self.listener.accept() {
                    Ok((s, _)) => self.spawn(s),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        // EMFILE/ENFILE leave the listener readable: poll
                        // would return at once and the loop would spin and
                        // flood the log. Back off and warn once a second.
                        crate::warn_limited!(ACCEPT_WARN, "accept failed: {e}");
                        std::thread::sleep(Duration::from_millis(50));
                        break;
                    }
                }
            }
        }
        tracing::info!("shutting down: no new connections, draining requests in flight");
        self.socket_file.remove();
        let deadline = Instant::now() + Duration::from_millis(self.shared.limits.drain_timeout_ms);
        while self.shared.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.shared.backend.flush()?;
        tracing::info!("backend flushed; bye");
        Ok(())
    }

    fn spawn(&self, s: UnixStream) {
        let _ = s.set_nonblocking(false);
        // Who is calling: the kernel's word (SO_PEERCRED), not the client's.
        let Some((uid, gid)) = conn::peer_cred(&s) else {
            self.shared.metrics.errors.with_label_values(&["io"]).inc();
            return;
        };
        let Some(grant) = self.shared.policy.grant(uid, gid) else {
            self.shared
                .metrics
                .errors
                .with_label_values(&["denied"])
                .inc();
            crate::warn_limited!(
                DENIED_WARN,
                "refused a client of uid {uid} gid {gid}: no tenant names it"
            );
            conn::refuse(
                &s,
                proto_code::DENIED,
                format!(
                    "uid {uid} (gid {gid}) is not a tenant of this daemon; \
                     an administrator adds it under [[tenants]] in the config"
                ),
            );
            return;
        };
        // Shares are its tenant's (every uid of a tenant draws on one), or
        // its uid's.
        let account = grant.account(uid);
        // Before the hello nothing is known of the caller but its uid: a
        // uid's unauthenticated connections are few and short-lived.
        if !self.take_share(&s, account, quota::Res::Hello, |n| {
            format!("uid {uid} has {n} connections waiting for their hello; send hello first")
        }) {
            return;
        }
        let hello_taken = conn::HelloSlot::new(self.shared.clone(), account);
        if !self.take_share(&s, account, quota::Res::Conn, |n| {
            format!("uid {uid} holds its share of {n} connections; close some")
        }) {
            return;
        }
        // The last few connections are kept for admins: no mix of users
        // locks root's `kvtier stats` or `kvtier events` out.
        let max = self.shared.limits.max_connections;
        let cap = if grant.may_use_reserve() {
            max
        } else {
            max.saturating_sub(self.shared.quotas.limits().admin_connections_reserved)
        };
        let n = self.shared.conns.fetch_add(1, Ordering::SeqCst) + 1;
        if n > cap {
            self.shared.conns.fetch_sub(1, Ordering::SeqCst);
            self.shared.quotas.give(account, quota::Res::Conn, 1);
            self.shared
                .metrics
                .errors
                .with_label_values(&["busy"])
                .inc();
            conn::refuse_busy(&s, max, max - cap);
            return;
        }
        self.shared.metrics.connections.inc();
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name("kvtier-conn".into())
            .stack_size(512 << 10)
            .spawn(move || {
                conn::serve(
                    &shared,
                    s,
                    conn::Caller {
                        uid,
                        account,
                        grant,
                    },
                    hello_taken,
                );
                shared.conns.fetch_sub(1, Ordering::SeqCst);
                shared.quotas.give(account, quota::Res::Conn, 1);
                shared.metrics.connections.dec();
            });
        if spawned.is_err() {
            self.shared.conns.fetch_sub(1, Ordering::SeqCst);
            self.shared.quotas.give(account, quota::Res::Conn, 1);
            self.shared.metrics.connections.dec();
        }
    }

    /// Takes one of `uid`'s share of `res`; past it the connection is
    /// refused `BUSY` with `why(limit)`.
    fn take_share(
        &self,
        s: &UnixStream,
        uid: u32,
        res: quota::Res,
        why: impl FnOnce(usize) -> String,
    ) -> bool {
        if self.shared.quotas.take(uid, res) {
            return true;
        }
        self.shared
            .metrics
            .errors
            .with_label_values(&["busy"])
            .inc();
        conn::refuse(s, proto_code::BUSY, why(self.shared.quotas.limit_of(res)));
        false
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
