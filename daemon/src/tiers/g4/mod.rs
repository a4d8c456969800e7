//! G4: the shared tier on any S3-compatible object store (or a local/network
//! filesystem, or memory for tests), over the `object_store` crate.
//!
//! Object name: `<prefix>/blocks/<block_path(ns, key)>`, the same scheme as
//! G3 and the mount; `<prefix>/nodes/` is reserved for peer heartbeats.
//! Objects are whole block files (header + payload), so any node verifies
//! what it fetched (header checksum, payload checksum, namespace and key).
//!
//! Roles: [`config`] builds the store, [`uploader`] is the asynchronous
//! write-through queue, `fetch` the single-flight onboard path, `exists`
//! the existence cache, [`sweeper`] capacity/TTL lifecycle, [`scrub`] keeps
//! credentials out of messages.
//!
//! Threading: a `G4Store` owns a small tokio runtime (or uses a given
//! handle). The `BlockTier` methods and the other sync methods hand the work
//! to the G4 runtime and wait, so they may be called from any thread except
//! G4's own runtime threads (an `OnUploaded` callback must not call them:
//! it would wait on the runtime it occupies). Async callers use the
//! `*_async` methods instead of blocking their executor.

pub mod breaker;
mod census;
pub mod config;
mod exists;
mod fetch;
pub mod lifecycle;
mod probe;
pub mod scrub;
pub mod stats;
pub mod sweeper;
pub mod uploader;

pub use breaker::BreakerState;
pub use census::G4Count;
pub use config::{G4Config, G4Credentials};
pub(crate) use probe::jittered;
pub use stats::{G4Stats, G4StatsSnapshot};
pub use sweeper::SweepReport;
pub use uploader::{BlockSource, EnqueueOutcome, OnUploaded, UploadOutcome};

use crate::base::error::{Error, Result};
use crate::base::tier::{Block, BlockTier, Lookup, PutOutcome};
use bytes::Bytes;
use exists::ExistsCache;
use kvtier_client::{block_path, BlockHeader, BlockKey, NamespaceId};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutPayload, WriteMultipart};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::runtime::{Handle, Runtime};

/// The G4 tier. Cheap to share behind an `Arc`.
pub struct G4Store {
    inner: Arc<Inner>,
    handle: Handle,
    runtime: Option<Runtime>,
}

pub(crate) struct Inner {
    pub(crate) store: Arc<dyn ObjectStore>,
    /// `<prefix>/blocks`.
    pub(crate) blocks_root: Path,
    /// `<prefix>/lifecycle`: every node's lifecycle view.
    pub(crate) lifecycle_root: Path,
    /// This node's id in those views.
    node_id: String,
    /// Why the last sweep deleted nothing for want of agreement (`None`:
    /// agreed, or no sweep yet).
    pub(crate) lifecycle_conflict: Mutex<Option<String>>,
    pub(crate) cfg: G4Config,
    secrets: Vec<String>,
    pub(crate) stats: G4Stats,
    exists: Mutex<ExistsCache>,
    pub(crate) inflight: Mutex<fetch::InflightMap>,
    pub(crate) uploads: uploader::Queue,
    /// Cleared when the store rejects `PutMode::Create` as unsupported; puts
    /// then check with HEAD first (same outcome for identical content).
    conditional_put: AtomicBool,
    pub(crate) handle: Handle,
    /// Told of the sweeper's deletions (the node publishes `Removed`).
    pub(crate) on_deleted: Mutex<Option<DeletedHook>>,
    pub(crate) breaker: breaker::Breaker,
    /// Why the start-up check failed (`None`: passed or not run yet).
    startup_problem: Mutex<Option<String>>,
    /// G4's block count from listings (`census`).
    pub(crate) census: census::Census,
    /// Body bytes fetches may still reserve, in 4 KiB pages
    /// (`fetch_buffer_bytes_max`), shared by every fetch.
    pub(crate) fetch_budget: Arc<tokio::sync::Semaphore>,
    /// Told when G4 answers again (breaker closed, start-up check passed).
    recovered: Mutex<Option<RecoveredHook>>,
}

/// Called when G4 recovers by itself: the breaker closed again, or the
/// start-up check passed after failing (from a G4 runtime thread: keep it
/// short, never wait on G4 from it).
pub type RecoveredHook = Arc<dyn Fn() + Send + Sync>;

/// Bytes per permit of the fetch budget.
pub(crate) const BUDGET_PAGE_BYTES: u64 = 4096;

/// Receives the blocks the sweeper deleted, one call per namespace and
/// batch.
pub type DeletedHook = Arc<dyn Fn(NamespaceId, Vec<BlockKey>) + Send + Sync>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves no broken invariant (caches).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl G4Store {
    /// Calls `hook` with the blocks each sweep deletes (TTL and capacity).
    pub fn set_on_deleted(&self, hook: DeletedHook) {
        *lock(&self.inner.on_deleted) = Some(hook);
    }

    /// Calls `hook` each time G4 recovers by itself (the breaker closes
    /// after being open, or the start-up check passes after failing): the
    /// node re-queues the uploads lost meanwhile.
    pub fn set_on_recovered(&self, hook: RecoveredHook) {
        self.inner.breaker.set_on_closed(hook.clone());
        *lock(&self.inner.recovered) = Some(hook);
    }

    /// Calls `hook` each time G4 goes down (the breaker opens): the node
    /// counts its backlog at once rather than at its next scan.
    pub fn set_on_outage(&self, hook: RecoveredHook) {
        self.inner.breaker.set_on_opened(hook);
    }

    /// Records the backlog of blocks not yet safe in G4, as the node's
    /// last scan found it (exported as `kvtier_g4_backlog_*`).
    pub fn set_backlog(&self, blocks: u64, bytes: u64, oldest_unix_ms: u64) {
        let st = &self.inner.stats;
        st.backlog_blocks.store(blocks, Ordering::Relaxed);
        st.backlog_bytes.store(bytes, Ordering::Relaxed);
        st.backlog_oldest_unix_ms
            .store(oldest_unix_ms, Ordering::Relaxed);
        stats::inc(&st.backlog_scans);
    }

    /// Counts blocks the backlog scan re-queued.
    pub fn count_requeued(&self, n: u64) {
        self.inner
            .stats
            .backlog_requeued
            .fetch_add(n, Ordering::Relaxed);
    }

    /// Opens G4 as configured, on a runtime of its own (2 worker threads),
    /// and starts the sweeper when capacity or TTL is set.
    pub fn open(cfg: G4Config) -> Result<Self> {
        let (store, prefix) = cfg.build_store()?;
        Self::with_store(store, prefix, cfg)
    }

    /// Like [`G4Store::open`] over an existing store (tests wrap stores to
    /// count or fail requests). `prefix` is where kvtier's objects live.
    pub fn with_store(store: Arc<dyn ObjectStore>, prefix: Path, cfg: G4Config) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvtier-g4")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the G4 runtime", "", e))?;
        let mut s = Self::with_handle(store, prefix, cfg, rt.handle().clone())?;
        s.runtime = Some(rt);
        Ok(s)
    }

    /// Like [`G4Store::with_store`] on a runtime the caller owns.
    pub fn with_handle(
        store: Arc<dyn ObjectStore>,
        prefix: Path,
        cfg: G4Config,
        handle: Handle,
    ) -> Result<Self> {
        cfg.validate()?;
        let inner = Arc::new(Inner {
            store,
            blocks_root: prefix.clone().join("blocks"),
            lifecycle_root: prefix.clone().join("lifecycle"),
            node_id: cfg
                .node_id
                .clone()
                .unwrap_or_else(|| format!("node-{:016x}", rand::random::<u64>())),
            lifecycle_conflict: Mutex::new(None),
            secrets: cfg.secrets(),
            stats: G4Stats::default(),
            exists: Mutex::new(ExistsCache::new(
                cfg.exists_cache_entries,
                Duration::from_millis(cfg.exists_ttl_ms),
                Duration::from_millis(cfg.exists_negative_ttl_ms),
            )),
            inflight: Mutex::new(Default::default()),
            uploads: uploader::Queue::new(cfg.upload_queue_max),
            conditional_put: AtomicBool::new(true),
            handle: handle.clone(),
            on_deleted: Mutex::new(None),
            breaker: breaker::Breaker::new(
                cfg.breaker_failures_max,
                Duration::from_millis(cfg.breaker_open_ms),
                Duration::from_millis(cfg.breaker_open_max_ms),
                Duration::from_millis(cfg.request_timeout_ms),
            ),
            startup_problem: Mutex::new(None),
            census: census::Census::default(),
            fetch_budget: Arc::new(tokio::sync::Semaphore::new(
                cfg.fetch_buffer_bytes_max.div_ceil(BUDGET_PAGE_BYTES) as usize,
            )),
            recovered: Mutex::new(None),
            cfg,
        });
        inner.stats.startup_check_ok.store(2, Ordering::Relaxed);
        if inner.cfg.capacity_bytes.is_some() || inner.cfg.ttl_ms.is_some() {
            sweeper::spawn_background(&inner);
        }
        lifecycle::spawn_publisher(&inner);
        census::spawn_at_start(&inner);
        probe::spawn(&inner);
        Ok(G4Store {
            inner,
            handle,
            runtime: None,
        })
    }

    /// Checks, within `startup_check_timeout_ms`, that the store answers
    /// and accepts the credentials (one HEAD under the prefix: 200 or 404
    /// pass, 401/403, errors and silence fail). A failure is not fatal: G4
    /// runs degraded (reads are misses, uploads retry) and says why in the
    /// log, `kvtier_g4_startup_check{state}` and `/healthz`.
    pub async fn startup_check_async(&self) -> std::result::Result<(), String> {
        let inner = &self.inner;
        let problem = inner.check_store().await;
        inner.set_startup_problem(problem.clone());
        match problem {
            None => Ok(()),
            Some(p) => {
                tracing::warn!(url = %inner.cfg.url, problem = %p, "G4 degraded at start");
                Err(p)
            }
        }
    }

    /// [`G4Store::startup_check_async`] from a sync thread.
    pub fn startup_check(&self) -> std::result::Result<(), String> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let me = G4Store {
            inner: self.inner.clone(),
            handle: self.handle.clone(),
            runtime: None,
        };
        self.handle.spawn(async move {
            let _ = tx.send(me.startup_check_async().await);
        });
        rx.recv()
            .unwrap_or_else(|_| Err("the G4 runtime shut down".into()))
    }

    /// Why G4 is degraded now (empty: healthy): the start-up check's
    /// problem, and an open circuit breaker.
    pub fn health(&self) -> Vec<String> {
        let mut v: Vec<String> = lock(&self.inner.startup_problem).iter().cloned().collect();
        v.extend(
            lock(&self.inner.lifecycle_conflict)
                .iter()
                .map(|c| format!("G4 lifecycle not agreed: {c}")),
        );
        match self.inner.breaker.state() {
            BreakerState::Closed => {}
            s => {
                v.push(format!(
                "G4 circuit breaker {}: the store failed {} calls in a row; G4 reads are misses \
                 until a probe succeeds",
                if s == BreakerState::Open { "open" } else { "half-open" },
                self.inner.cfg.breaker_failures_max
            ))
            }
        }
        v
    }

    /// The circuit breaker's state.
    pub fn breaker_state(&self) -> BreakerState {
        self.inner.breaker.state()
    }

    /// The configuration in use.
    pub fn config(&self) -> &G4Config {
        &self.inner.cfg
    }

    /// Blocks and bytes in G4 (last listing plus this node's uploads
    /// since); `None` until the listing at start has finished.
    pub fn count(&self) -> Option<G4Count> {
        self.inner.census.count(&self.inner)
    }

    /// The live counters.
    pub fn stats(&self) -> G4StatsSnapshot {
        self.inner.stats.snapshot()
    }

    /// The object path of a block (`<prefix>/blocks/<ns>/<shard>/<key>`).
    pub fn object_path(&self, ns: &NamespaceId, key: &BlockKey) -> Path {
        self.inner.path(ns, key)
    }

    /// The underlying store (benchmarks compare against it).
    pub fn object_store(&self) -> Arc<dyn ObjectStore> {
        self.inner.store.clone()
    }

    /// The runtime handle G4 work runs on.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Runs `fut` on the G4 runtime and waits for it from any thread.
    fn block_on<T: Send + 'static>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().unwrap_or(Err(Error::ObjectStore {
            op,
            location: String::new(),
            detail: "the G4 runtime shut down".into(),
        }))
    }

    /// Stores a block synchronously, create-if-absent (the existing object
    /// wins). The write-through path is [`G4Store::enqueue`]; this is for
    /// direct puts and tests.
    pub async fn put_async(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        payload: &[u8],
    ) -> Result<PutOutcome> {
        header.verify_payload(payload)?;
        if header.namespace_id() != *ns {
            return Err(Error::InvalidInput {
                what: "block header",
                reason: format!("header namespace is not {ns}"),
            });
        }
        let file = Bytes::from(kvtier_client::encode_block(header, payload));
        let loc = self.inner.path(ns, &header.key);
        self.inner.put_file(&loc, file).await
    }

    /// Fetches and verifies a block: the onboard fall-through. Concurrent
    /// fetches of one block share one GET. Absent, corrupt, failing or
    /// late (past `deadline`) are all misses, never errors.
    pub async fn fetch_async(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        deadline: Duration,
    ) -> Lookup<Block> {
        fetch::fetch(&self.inner, ns, key, deadline).await
    }

    /// [`G4Store::fetch_async`] from a sync thread.
    pub fn fetch(&self, ns: &NamespaceId, key: &BlockKey, deadline: Duration) -> Lookup<Block> {
        let (inner, ns2, key2) = (self.inner.clone(), *ns, *key);
        self.block_on("get", async move {
            Ok(fetch::fetch(&inner, &ns2, &key2, deadline).await)
        })
        .unwrap_or(Lookup::Miss(crate::base::tier::MissReason::Unavailable))
    }

    /// Reads only the 4096-byte header with a ranged GET and validates it
    /// (checksum, namespace, key): what a lookup needs to learn a block's
    /// size and layout without transferring the payload.
    pub async fn fetch_header_async(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        deadline: Duration,
    ) -> Lookup<BlockHeader> {
        fetch::fetch_header(&self.inner, ns, key, deadline).await
    }

    /// A ranged GET of `range` within the payload, after validating the
    /// header. The payload checksum covers the whole payload, so these bytes
    /// are NOT verified: a caller that serves them must verify the full block
    /// (or accept a torn-read risk) before handing them to a model.
    pub async fn fetch_payload_range_unverified_async(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        range: std::ops::Range<u64>,
        deadline: Duration,
    ) -> Lookup<Vec<u8>> {
        fetch::fetch_range(&self.inner, ns, key, range, deadline).await
    }

    /// Whether G4 holds the block, answered from the existence cache when
    /// fresh, else by one HEAD.
    pub async fn contains_async(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        self.inner.contains(ns, key).await
    }

    /// The cached answer only (`None`: unknown or expired). Never does I/O:
    /// for lookups that must not wait on the network.
    pub fn contains_cached(&self, ns: &NamespaceId, key: &BlockKey) -> Option<bool> {
        let loc = self.inner.path(ns, key);
        lock(&self.inner.exists).get(loc.as_ref())
    }

    /// Deletes a block; `false` when it was not there.
    pub async fn delete_async(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        self.inner.delete(&self.inner.path(ns, key)).await
    }

    /// Queues a block for asynchronous upload (see [`uploader`]).
    pub fn enqueue(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        hints: kvtier_client::Hints,
    ) -> EnqueueOutcome {
        uploader::enqueue(&self.inner, ns, key, hints)
    }

    /// Starts the upload workers: `source` reads a block file (from G3) at
    /// upload time, `on_uploaded` learns each outcome. Jobs queued before
    /// this call wait for it. A second call is refused.
    pub fn start_uploader(
        &self,
        source: Arc<dyn BlockSource>,
        on_uploaded: Option<OnUploaded>,
    ) -> Result<()> {
        uploader::start(&self.inner, source, on_uploaded)
    }

    /// Waits until the upload queue is empty and nothing is in flight;
    /// `false` when `timeout` passed first.
    pub fn flush(&self, timeout: Duration) -> bool {
        let inner = self.inner.clone();
        self.block_on("flush", async move {
            Ok(uploader::flush(&inner, timeout).await)
        })
        .unwrap_or(false)
    }

    /// The lifecycle views of every node using the bucket that have not
    /// expired (this node's included; see [`lifecycle`]).
    pub fn lifecycle_views(&self) -> Result<Vec<lifecycle::LifecycleView>> {
        let inner = self.inner.clone();
        self.block_on("lifecycle views", async move {
            lifecycle::read_live(&inner)
                .await?
                .map_err(|why| Error::ObjectStore {
                    op: "read lifecycle views",
                    location: inner.lifecycle_root.to_string(),
                    detail: why,
                })
        })
    }

    /// Runs one sweep now (the background sweeper runs the same).
    pub async fn sweep_once_async(&self) -> Result<SweepReport> {
        sweeper::sweep_once(&self.inner).await
    }

    /// [`G4Store::sweep_once_async`] from a sync thread.
    pub fn sweep_once(&self) -> Result<SweepReport> {
        let inner = self.inner.clone();
        self.block_on("sweep", async move { sweeper::sweep_once(&inner).await })
    }
}

impl Drop for G4Store {
    fn drop(&mut self) {
        // Dropping a runtime inside async code panics; background shutdown
        // never blocks. Queued uploads are abandoned: G3 still holds those
        // blocks unmarked and re-queues them on restart.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl BlockTier for G4Store {
    fn name(&self) -> &'static str {
        "g4"
    }

    fn put(&self, ns: &NamespaceId, header: &BlockHeader, payload: &[u8]) -> Result<PutOutcome> {
        header.verify_payload(payload)?;
        let file = Bytes::from(kvtier_client::encode_block(header, payload));
        let loc = self.inner.path(ns, &header.key);
        if header.namespace_id() != *ns {
            return Err(Error::InvalidInput {
                what: "block header",
                reason: format!("header namespace is not {ns}"),
            });
        }
        let inner = self.inner.clone();
        self.block_on("put", async move { inner.put_file(&loc, file).await })
    }

    fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<Block>> {
        Ok(self.fetch(
            ns,
            key,
            Duration::from_millis(self.inner.cfg.fetch_deadline_ms),
        ))
    }

    fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        let (inner, ns, key) = (self.inner.clone(), *ns, *key);
        self.block_on("head", async move { inner.contains(&ns, &key).await })
    }

    fn delete(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        let inner = self.inner.clone();
        let loc = inner.path(ns, key);
        self.block_on("delete", async move { inner.delete(&loc).await })
    }
}

impl Inner {
    pub(crate) fn path(&self, ns: &NamespaceId, key: &BlockKey) -> Path {
        let mut p = self.blocks_root.clone();
        for part in block_path(ns, key).split('/') {
            p = p.join(part);
        }
        p
    }

    /// One HEAD under the prefix within `startup_check_timeout_ms` (200 or
    /// 404 pass), then the credentials: why G4 cannot work, or `None`.
    pub(crate) async fn check_store(&self) -> Option<String> {
        let probe = self.blocks_root.clone().join(".kvtier-startup-probe");
        let t = Duration::from_millis(self.cfg.startup_check_timeout_ms);
        let problem = match self.cfg.endpoint_problem() {
            // Every request would fail the same way: say why, send none.
            Some(p) => Some(p),
            None => match tokio::time::timeout(t, self.store.head(&probe)).await {
                Err(_) => Some(format!(
                    "G4 store did not answer within g4.startup_check_timeout_ms ({} ms): \
                 check g4.url / g4.endpoint and the network",
                    self.cfg.startup_check_timeout_ms
                )),
                Ok(Ok(_)) | Ok(Err(object_store::Error::NotFound { .. })) => None,
                Ok(Err(e)) => Some(format!(
                    "G4 start-up check failed: {}",
                    self.err("head", &probe, &e)
                )),
            },
        };
        problem.or_else(|| self.cfg.credentials_problem())
    }

    /// Records the start-up check's outcome (`/healthz`, the gauge).
    /// This node's id in the bucket's lifecycle views.
    pub(crate) fn node_id(&self) -> String {
        self.node_id.clone()
    }

    pub(crate) fn set_startup_problem(&self, problem: Option<String>) {
        self.stats
            .startup_check_ok
            .store(u64::from(problem.is_none()), Ordering::Relaxed);
        *lock(&self.startup_problem) = problem;
    }

    /// The start-up check's problem now, if any.
    pub(crate) fn startup_problem(&self) -> Option<String> {
        lock(&self.startup_problem).clone()
    }

    /// Tells the node G4 answers again.
    pub(crate) fn notify_recovered(&self) {
        stats::inc(&self.stats.recoveries);
        let hook = lock(&self.recovered).clone();
        if let Some(hook) = hook {
            hook();
        }
    }

    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.request_timeout_ms)
    }

    /// Deadline for a read request's response headers.
    pub(crate) fn response_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.response_timeout_ms)
    }

    /// The error for a call the open breaker refused.
    pub(crate) fn breaker_refused(&self, op: &'static str, loc: &Path) -> Error {
        Error::ObjectStore {
            op,
            location: loc.to_string(),
            detail: "G4 circuit breaker open (the store keeps failing); retried later".into(),
        }
    }

    /// HEAD with the breaker and the response deadline: `Ok(present)`.
    async fn head_checked(&self, loc: &Path) -> Result<bool> {
        Ok(self.head_size_checked(loc).await?.is_some())
    }

    /// HEAD with the breaker and the response deadline: the object's size
    /// when present.
    async fn head_size_checked(&self, loc: &Path) -> Result<Option<u64>> {
        if !self.breaker.allow(&self.stats) {
            return Err(self.breaker_refused("head", loc));
        }
        let r = tokio::time::timeout(self.response_timeout(), self.store.head(loc)).await;
        let out = match r {
            Err(_) => Err(Error::Timeout {
                op: "head",
                timeout_ms: self.cfg.response_timeout_ms,
            }),
            Ok(Ok(m)) => Ok(Some(m.size)),
            Ok(Err(object_store::Error::NotFound { .. })) => Ok(None),
            Ok(Err(e)) => Err(self.err("head", loc, &e)),
        };
        self.breaker.record(&self.stats, out.is_ok());
        out
    }

    /// Counts an object this node deleted (the census subtracts it).
    pub(crate) fn count_deleted(&self, blocks: u64, bytes: u64) {
        self.stats
            .deleted_blocks
            .fetch_add(blocks, Ordering::Relaxed);
        self.stats.deleted_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A typed error for a failed store call, without credentials.
    pub(crate) fn err(&self, op: &'static str, loc: &Path, e: &object_store::Error) -> Error {
        let hint = match e {
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => {
                "access denied: check the G4 credentials (access key, secret, session token) \
                 and the bucket policy; "
            }
            _ => "",
        };
        Error::ObjectStore {
            op,
            location: loc.to_string(),
            detail: format!("{hint}{}", self.scrub(&e.to_string())),
        }
    }

    pub(crate) fn timed_out(&self, op: &'static str) -> Error {
        Error::Timeout {
            op,
            timeout_ms: self.cfg.request_timeout_ms,
        }
    }

    pub(crate) fn scrub(&self, s: &str) -> String {
        scrub::scrub(s, &self.secrets)
    }

    /// The `(namespace, key)` of a block object's path.
    pub(crate) fn parse_block_path(&self, loc: &Path) -> Option<(NamespaceId, BlockKey)> {
        let parts: Vec<_> = loc.parts().collect();
        let [.., ns, _shard, key] = parts.as_slice() else {
            return None;
        };
        Some((
            NamespaceId::from_hex(ns.as_ref()).ok()?,
            BlockKey::from_hex(key.as_ref()).ok()?,
        ))
    }

    pub(crate) fn notify_deleted(&self, deleted: &[Path]) {
        let Some(hook) = lock(&self.on_deleted).clone() else {
            return;
        };
        let mut by_ns: std::collections::BTreeMap<NamespaceId, Vec<BlockKey>> = Default::default();
        for p in deleted {
            if let Some((ns, key)) = self.parse_block_path(p) {
                by_ns.entry(ns).or_default().push(key);
            }
        }
        for (ns, keys) in by_ns {
            hook(ns, keys);
        }
    }

    pub(crate) fn set_exists(&self, loc: &Path, present: bool) {
        lock(&self.exists).set(loc.as_ref(), present);
    }

    async fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        let loc = self.path(ns, key);
        if let Some(b) = lock(&self.exists).get(loc.as_ref()) {
            stats::inc(&self.stats.exists_cache_hits);
            return Ok(b);
        }
        stats::inc(&self.stats.exists_heads);
        let present = self.head_checked(&loc).await?;
        self.set_exists(&loc, present);
        Ok(present)
    }

    pub(crate) async fn delete(&self, loc: &Path) -> Result<bool> {
        // S3 reports success for absent keys: HEAD tells whether it was there.
        let size = self.head_size_checked(loc).await?;
        if let Some(size) = size {
            match tokio::time::timeout(self.timeout(), self.store.delete(loc)).await {
                Err(_) => return Err(self.timed_out("delete")),
                Ok(Ok(())) | Ok(Err(object_store::Error::NotFound { .. })) => {}
                Ok(Err(e)) => return Err(self.err("delete", loc, &e)),
            }
            self.count_deleted(1, size);
        }
        self.set_exists(loc, false);
        Ok(size.is_some())
    }

    /// Uploads a whole block file, create-if-absent.
    pub(crate) async fn put_file(&self, loc: &Path, file: Bytes) -> Result<PutOutcome> {
        if !self.breaker.allow(&self.stats) {
            return Err(self.breaker_refused("put", loc));
        }
        let fut = self.put_file_inner(loc, file);
        let r = match tokio::time::timeout(self.timeout(), fut).await {
            Err(_) => Err(self.timed_out("put")),
            Ok(r) => r,
        };
        self.breaker.record(&self.stats, r.is_ok());
        let out = r?;
        self.set_exists(loc, true);
        Ok(out)
    }

    async fn put_file_inner(&self, loc: &Path, file: Bytes) -> Result<PutOutcome> {
        let multipart = file.len() as u64 >= self.cfg.multipart_threshold_bytes;
        if multipart || !self.conditional_put.load(Ordering::Relaxed) {
            // Multipart completion has no create-if-absent in object_store:
            // check first. A race can overwrite an object with the same
            // content-addressed block (identical payload), which is harmless.
            match self.store.head(loc).await {
                Ok(_) => return Ok(PutOutcome::AlreadyPresent),
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.err("head", loc, &e)),
            }
        }
        if multipart {
            let up = self
                .store
                .put_multipart(loc)
                .await
                .map_err(|e| self.err("put", loc, &e))?;
            let mut w =
                WriteMultipart::new_with_chunk_size(up, self.cfg.multipart_part_bytes as usize);
            w.put(file);
            return match w.finish().await {
                Ok(_) => Ok(PutOutcome::Stored),
                Err(e) => Err(self.err("put", loc, &e)),
            };
        }
        let mode = if self.conditional_put.load(Ordering::Relaxed) {
            PutMode::Create
        } else {
            PutMode::Overwrite
        };
        match self
            .store
            .put_opts(loc, PutPayload::from(file.clone()), mode.into())
            .await
        {
            Ok(_) => Ok(PutOutcome::Stored),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(PutOutcome::AlreadyPresent),
            Err(object_store::Error::NotImplemented { .. })
            | Err(object_store::Error::NotSupported { .. }) => {
                tracing::warn!("G4 store has no conditional put; falling back to HEAD + PUT");
                self.conditional_put.store(false, Ordering::Relaxed);
                Box::pin(self.put_file_inner(loc, file)).await
            }
            Err(e) => Err(self.err("put", loc, &e)),
        }
    }
}
