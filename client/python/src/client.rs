//! `Client`: the fail-open client, Pythonic. Every call releases the GIL;
//! data-path calls return per-block values (a miss has a reason), misuse
//! raises a `kvtier.Error` subclass before anything is sent.

use crate::buffers::{all_blocks, BlockSpans, Held, Place};
use crate::errors::{argument_error, from_client, Arg, PoolError, UnavailableError};
use crate::ns::{keys_from, keys_from_until, Namespace};
use crate::results::{BlockResult, Lookup};
use kvtier_client::proto::ItemStatus;
use kvtier_client::{
    BlockKey, Client as RsClient, ClientConfig, EventStream, Hints, NsHandle, Pool as RsPool,
    PoolBlock,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The socket `Client(socket=None)` uses: `$KVTIER_SOCKET`, else the
/// daemon's default (`$XDG_STATE_HOME/kvtier/kvtierd.sock`, else
/// `~/.local/state/kvtier/kvtierd.sock`), as the `kvtier` CLI does.
pub(crate) fn default_socket() -> PathBuf {
    if let Some(s) = std::env::var_os("KVTIER_SOCKET").filter(|v| !v.is_empty()) {
        return PathBuf::from(s);
    }
    let dir = if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        PathBuf::from(x).join("kvtier")
    } else if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        PathBuf::from(h).join(".local/state/kvtier")
    } else {
        PathBuf::from("./kvtier-data")
    };
    dir.join("kvtierd.sock")
}

struct State {
    pid: u32,
    /// None once closed.
    inner: Option<Arc<RsClient>>,
}

/// The bounds of `Client(...)`'s arguments: a region smaller than a page
/// holds no block (every call would miss `too_large`), and a deadline
/// past a day is a mistake (and must stay representable as an Instant).
const REGION_BYTES_MIN: u64 = 4096;
const REGION_BYTES_MAX: u64 = 1 << 40;
const TIMEOUT_MS_MAX: u64 = 86_400_000;

/// A connection to the node's kvtierd.
///
/// Client(socket=None, timeout_ms=2000, region_bytes=64 MiB, direct_read=False)
///
/// socket=None reads $KVTIER_SOCKET (else the daemon's default path), as the
/// `kvtier` CLI does. It connects on first use and reconnects by itself.
///
/// Fail open: lookup, offload and onboard_into never raise for a missing
/// block, a dead daemon or a timeout; every call ends within timeout_ms
/// and each block's result says why it missed. They raise (kvtier.Error
/// subclasses) only for misuse: a buffer of the wrong size, a read-only
/// buffer for onboard, a bad key.
///
/// Threads: a Client may be shared between threads; its calls are
/// serialised on one connection (each releases the GIL). For parallel I/O
/// open one Client per thread. After os.fork() the child opens its own
/// connection on first use (it never shares the parent's socket).
///
/// Buffers: anything with the buffer protocol (numpy arrays, bytearray,
/// memoryview), DLPack tensors (CPU torch tensors), objects with
/// __cuda_array_interface__, raw (ptr, nbytes) pairs (a third element
/// "cuda:N" marks device memory), or, for one block in several places
/// (layer-separate KV), a list of any of these as its segments.
#[pyclass(module = "kvtier", name = "Client", frozen)]
pub(crate) struct Client {
    cfg: ClientConfig,
    state: Mutex<State>,
    /// Pools by the Rust client (per process) that owns them.
    pools: Mutex<Vec<(usize, RsPool)>>,
}

/// A namespace argument (a wrong type is a kvtier.ArgumentTypeError).
type NsArg<'py> = Arg<PyRef<'py, Namespace>>;

fn hints(priority: u8, pinned: bool, ephemeral: bool, expected_reuse: u16) -> Hints {
    Hints {
        priority,
        pinned,
        ephemeral,
        expected_reuse,
    }
}

fn status_name(s: ItemStatus) -> String {
    let d = format!("{s:?}");
    let mut out = String::new();
    for (i, c) in d.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

impl Client {
    /// The client for this process: a child after fork() gets a fresh one
    /// (the parent's socket and region stay the parent's).
    pub(crate) fn inner(&self) -> PyResult<Arc<RsClient>> {
        let mut g = self
            .state
            .lock()
            .map_err(|_| UnavailableError::new_err("client state poisoned"))?;
        let me = std::process::id();
        if g.pid != me && g.inner.is_some() {
            let old = g
                .inner
                .replace(Arc::new(RsClient::with_config(self.cfg.clone())));
            // The parent's connection may be mid-call in a thread that does
            // not exist here: leave its state alone rather than drop it.
            std::mem::forget(old);
            g.pid = me;
        }
        match &g.inner {
            Some(c) => Ok(c.clone()),
            None => Python::attach(|py| Err(crate::errors::closed_error(py))),
        }
    }

    /// One per-key control call (pin, unpin, evict) without the GIL; the
    /// statuses by name.
    fn per_key(
        &self,
        py: Python<'_>,
        ns: &Namespace,
        keys: &Bound<'_, PyAny>,
        op: impl FnOnce(
                &kvtier_client::NsHandle<'_>,
                &[BlockKey],
            ) -> kvtier_client::Result<Vec<ItemStatus>>
            + Send,
    ) -> PyResult<Vec<String>> {
        // The call's deadline counts the keys' conversion too.
        let t0 = std::time::Instant::now();
        let keys = keys_from(keys)?;
        let c = self.inner()?;
        let nsr = ns.inner.clone();
        let r = py
            .detach(move || c.within_deadline_since(t0, || op(&c.namespace(&nsr), &keys)))
            .map_err(from_client)?;
        Ok(r.into_iter().map(status_name).collect())
    }

    /// The shape offload and onboard_into share: keys and buffers checked
    /// and their views held before anything is sent (misuse raises), device
    /// buffers routed to gpu.rs, host buffers handed to `host` without the
    /// GIL as raw spans (plain integers; the views stay held on this
    /// stack until the call returns).
    #[allow(clippy::too_many_arguments)]
    fn data_call<R: Send>(
        &self,
        py: Python<'_>,
        ns: &Namespace,
        keys: &Bound<'_, PyAny>,
        bufs: &Bound<'_, PyAny>,
        writable: bool,
        device: impl FnOnce(&[BlockKey], &[BlockSpans]) -> PyResult<Vec<BlockResult>>,
        host: impl FnOnce(&NsHandle<'_>, &[BlockKey], &[BlockSpans]) -> Vec<R> + Send,
        result: fn(&R) -> BlockResult,
    ) -> PyResult<Vec<BlockResult>> {
        // The call's deadline counts the keys' conversion too.
        let t0 = std::time::Instant::now();
        let keys = keys_from(keys)?;
        let bb = ns.inner.layout.block_bytes() as usize;
        let mut held = Held::default();
        let blocks = all_blocks(bufs, writable, bb, keys.len(), &mut held)?;
        if blocks.iter().any(|b| b.place != Place::Host) || crate::gpu::host_via_gds() {
            return device(&keys, &blocks);
        }
        let c = self.inner()?;
        let nsr = ns.inner.clone();
        let out =
            py.detach(|| c.within_deadline_since(t0, || host(&c.namespace(&nsr), &keys, &blocks)));
        drop(held);
        Ok(out.iter().map(result).collect())
    }
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (socket=None, timeout_ms=Arg(2000), region_bytes=Arg(67_108_864), direct_read=Arg(false)))]
    fn new(
        py: Python<'_>,
        socket: Option<Arg<PathBuf>>,
        timeout_ms: Arg<u64>,
        region_bytes: Arg<u64>,
        direct_read: Arg<bool>,
    ) -> PyResult<Self> {
        let (timeout_ms, region_bytes) = (timeout_ms.0, region_bytes.0);
        if !(1..=TIMEOUT_MS_MAX).contains(&timeout_ms) {
            return Err(argument_error(
                py,
                format!("timeout_ms={timeout_ms}: pass 1..={TIMEOUT_MS_MAX} (a day)"),
            ));
        }
        if !(REGION_BYTES_MIN..=REGION_BYTES_MAX).contains(&region_bytes) {
            return Err(argument_error(
                py,
                format!(
                    "region_bytes={region_bytes}: pass {REGION_BYTES_MIN}..={REGION_BYTES_MAX}; \
                     the shared region bounds one call's bytes, so make it at least a few \
                     blocks (default 64 MiB)"
                ),
            ));
        }
        let mut cfg = ClientConfig::new(socket.map(|s| s.0).unwrap_or_else(default_socket));
        cfg.timeout_ms = timeout_ms;
        cfg.region_bytes = region_bytes;
        cfg.direct_read = direct_read.0;
        Ok(Client {
            state: Mutex::new(State {
                pid: std::process::id(),
                inner: Some(Arc::new(RsClient::with_config(cfg.clone()))),
            }),
            pools: Mutex::new(Vec::new()),
            cfg,
        })
    }

    /// The daemon's socket path.
    #[getter]
    fn socket(&self) -> String {
        self.cfg.socket.display().to_string()
    }

    /// The deadline of every call, in milliseconds.
    #[getter]
    fn timeout_ms(&self) -> u64 {
        self.cfg.timeout_ms
    }

    /// The bytes of the shared region blocks move through.
    #[getter]
    fn region_bytes(&self) -> u64 {
        self.cfg.region_bytes
    }

    /// Whether G3 blocks are read by this process over file descriptors
    /// the daemon passes (straight into the caller's buffers) rather than
    /// through the shared region.
    #[getter]
    fn direct_read(&self) -> bool {
        self.cfg.direct_read
    }

    /// close(): drops the connection and the shared region (a Pool already
    /// handed out stays mapped while its views live). Every later call
    /// raises kvtier.ClosedError; closing twice is fine. Also the end of a
    /// `with kvtier.Client(...) as c:` block.
    fn close(&self) {
        let old = match self.state.lock() {
            Ok(mut g) => g.inner.take(),
            Err(_) => None,
        };
        if let Ok(mut p) = self.pools.lock() {
            p.clear();
        }
        // A call in flight on another thread holds its own reference and
        // finishes; the connection closes when the last one goes.
        drop(old);
    }

    /// Whether close() was called.
    #[getter]
    fn closed(&self) -> bool {
        self.state.lock().map(|g| g.inner.is_none()).unwrap_or(true)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }

    /// Connects now (otherwise the first call does); raises
    /// kvtier.UnavailableError when the daemon cannot be reached.
    fn connect(&self, py: Python<'_>) -> PyResult<()> {
        let c = self.inner()?;
        py.detach(move || c.within_deadline(|| c.ensure_connected()))
            .map_err(from_client)
    }

    /// lookup(ns, keys) -> Lookup
    ///
    /// The longest cached prefix of the key chain `keys` (as hash_chain
    /// returns), with the tier of each of its blocks. A dead daemon or a
    /// timeout is an empty prefix with a reason, never an exception.
    fn lookup(&self, py: Python<'_>, ns: NsArg<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Lookup> {
        let ns = &*ns.0;
        // The call's deadline counts the keys' conversion too.
        let t0 = std::time::Instant::now();
        let keys = keys_from_until(
            keys,
            t0.checked_add(Duration::from_millis(self.cfg.timeout_ms)),
        )?;
        let c = self.inner()?;
        let ns = ns.inner.clone();
        let r = py.detach(move || c.within_deadline_since(t0, || c.namespace(&ns).lookup(&keys)));
        Ok(Lookup::from(&r))
    }

    /// lookup_many(namespaces, keys) -> list[Lookup]
    ///
    /// The longest cached prefix of the chain `keys` in each of
    /// `namespaces` (1 to 64 of them: e.g. every tensor-parallel rank's
    /// namespace of one model, which share their keys), in one request
    /// to the daemon instead of one per namespace. One Lookup per
    /// namespace, in order; misses as lookup's.
    fn lookup_many(
        &self,
        py: Python<'_>,
        namespaces: Arg<Vec<PyRef<'_, Namespace>>>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Lookup>> {
        let n = namespaces.0.len();
        if n == 0 || n > kvtier_client::proto::LOOKUP_NAMESPACES_MAX {
            return Err(crate::errors::argument_error(
                py,
                format!(
                    "lookup_many takes 1..={} namespaces, got {n}",
                    kvtier_client::proto::LOOKUP_NAMESPACES_MAX
                ),
            ));
        }
        let ids: Vec<_> = namespaces.0.iter().map(|ns| ns.inner.id()).collect();
        // The call's deadline counts the keys' conversion too.
        let t0 = std::time::Instant::now();
        let keys = keys_from_until(
            keys,
            t0.checked_add(Duration::from_millis(self.cfg.timeout_ms)),
        )?;
        let c = self.inner()?;
        let r = py.detach(move || c.within_deadline_since(t0, || c.lookup_many(&ids, &keys)));
        Ok(r.iter().map(Lookup::from).collect())
    }

    /// offload(ns, keys, bufs, parent=None, *, priority=0, pinned=False, ephemeral=False, expected_reuse=0) -> list[BlockResult]
    ///
    /// Stores blocks: bufs[i] holds keys[i]'s exactly ns.block_bytes bytes
    /// (one buffer or a list of segments). keys form a chain: block i's
    /// parent is keys[i-1], the first one's is `parent` (the last cached
    /// block before them, or None). Hints: priority (0-255, higher kept
    /// longer), pinned, ephemeral (reasoning tokens: never written below
    /// G3, evicted first), expected_reuse. Each result is "stored",
    /// "already_present" or a miss with its reason.
    #[pyo3(signature = (ns, keys, bufs, parent=None, *, priority=Arg(0), pinned=Arg(false), ephemeral=Arg(false), expected_reuse=Arg(0)))]
    #[allow(clippy::too_many_arguments)]
    fn offload(
        &self,
        py: Python<'_>,
        ns: NsArg<'_>,
        keys: &Bound<'_, PyAny>,
        bufs: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
        priority: Arg<u8>,
        pinned: Arg<bool>,
        ephemeral: Arg<bool>,
        expected_reuse: Arg<u16>,
    ) -> PyResult<Vec<BlockResult>> {
        let ns = &*ns.0;
        let parent = parent.map(crate::ns::key_from).transpose()?;
        let h = hints(priority.0, pinned.0, ephemeral.0, expected_reuse.0);
        self.data_call(
            py,
            ns,
            keys,
            bufs,
            false,
            |keys, blocks| crate::gpu::offload_device(py, self, ns, keys, parent, blocks, h),
            |nsh, keys, blocks| {
                // A segmented block is gathered into one contiguous copy
                // (the client's copy into the region follows); a contiguous
                // block is read where it lies.
                let gathered: Vec<Vec<u8>> = blocks
                    .iter()
                    .map(|b| match b.spans.len() {
                        1 => Vec::new(),
                        _ => {
                            let mut g = Vec::with_capacity(b.len());
                            for s in &b.spans {
                                // SAFETY: live host views held by data_call.
                                g.extend_from_slice(unsafe { s.host() });
                            }
                            g
                        }
                    })
                    .collect();
                let payloads: Vec<&[u8]> = blocks
                    .iter()
                    .zip(&gathered)
                    // SAFETY: as above.
                    .map(|(b, g)| unsafe { b.contiguous() }.unwrap_or(g))
                    .collect();
                nsh.offload_chain(parent, keys, &payloads, h)
            },
            BlockResult::offloaded,
        )
    }

    /// onboard_into(ns, keys, bufs) -> list[BlockResult]
    ///
    /// Reads keys[i] into bufs[i] (writable, exactly ns.block_bytes bytes:
    /// one buffer or a list of segments), verifying every byte (blake3) in
    /// the destination. A hit says its tier; a miss says why (then that
    /// buffer's content is unspecified: recompute it).
    fn onboard_into(
        &self,
        py: Python<'_>,
        ns: NsArg<'_>,
        keys: &Bound<'_, PyAny>,
        bufs: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<BlockResult>> {
        let ns = &*ns.0;
        self.data_call(
            py,
            ns,
            keys,
            bufs,
            true,
            |keys, blocks| crate::gpu::onboard_device(py, self, ns, keys, blocks),
            |nsh, keys, blocks| {
                // A segmented block lands in a contiguous scratch copy of
                // the client's own, is verified there, then scattered.
                let mut scratch: Vec<Vec<u8>> = blocks
                    .iter()
                    .map(|b| match b.spans.len() {
                        1 => Vec::new(),
                        _ => vec![0u8; b.len()],
                    })
                    .collect();
                let res = {
                    let mut dsts: Vec<&mut [u8]> = blocks
                        .iter()
                        .zip(scratch.iter_mut())
                        // SAFETY: live, writable host views held by
                        // data_call; distinct buffers are the caller's
                        // promise, as in C.
                        .map(|(b, s)| unsafe { b.contiguous_mut() }.unwrap_or(s))
                        .collect();
                    nsh.onboard_into(keys, &mut dsts)
                };
                for ((b, s), r) in blocks.iter().zip(&mut scratch).zip(&res) {
                    if !s.is_empty() && r.is_hit() {
                        let _ = b.each_segment(s, |sp, part| {
                            // SAFETY: as above.
                            unsafe { sp.host_mut() }.copy_from_slice(part);
                            Ok::<(), std::convert::Infallible>(())
                        });
                    }
                }
                res
            },
            BlockResult::onboarded,
        )
    }

    /// pin(ns, keys, ttl_ms=600000) -> list[str]
    ///
    /// Keeps keys from eviction for ttl_ms (the daemon caps it). Per key:
    /// "ok", "absent", ... Raises kvtier.UnavailableError when the daemon
    /// cannot be reached.
    #[pyo3(signature = (ns, keys, ttl_ms=Arg(600_000)))]
    fn pin(
        &self,
        py: Python<'_>,
        ns: NsArg<'_>,
        keys: &Bound<'_, PyAny>,
        ttl_ms: Arg<u32>,
    ) -> PyResult<Vec<String>> {
        let ttl_ms = ttl_ms.0;
        if ttl_ms == 0 {
            return Err(argument_error(
                py,
                "ttl_ms=0 would pin for no time: pass at least 1 (the daemon caps it), or unpin",
            ));
        }
        self.per_key(py, &ns.0, keys, move |h, k| h.pin(k, ttl_ms))
    }

    /// prefetch(ns, keys, deadline_ms=10000, stream=0) -> list[str]
    ///
    /// "This chain will be needed within deadline_ms": the daemon fetches
    /// the blocks that are not local (from peers or G4) into G3 in the
    /// background. Returns at once; per key "ok" (queued),
    /// "already_present" (local), "limit_reached" (no room in the daemon's
    /// queue or this uid's share) or "absent" (the daemon has no remote
    /// tier). A later prefetch with the same non-zero stream (a request or
    /// session id) drops the queued keys it no longer names.
    #[pyo3(signature = (ns, keys, deadline_ms=Arg(10_000), stream=Arg(0)))]
    fn prefetch(
        &self,
        py: Python<'_>,
        ns: NsArg<'_>,
        keys: &Bound<'_, PyAny>,
        deadline_ms: Arg<u32>,
        stream: Arg<u64>,
    ) -> PyResult<Vec<String>> {
        let (deadline_ms, stream) = (deadline_ms.0, stream.0);
        self.per_key(py, &ns.0, keys, move |h, k| {
            h.prefetch(k, deadline_ms, stream)
        })
    }

    /// describe(ns, engine) -> str
    ///
    /// Tells the daemon which engine (1..=32 bytes of [a-z0-9._-]) the
    /// namespace belongs to, with the namespace's model (cut to 256
    /// bytes): `kvtier stats`, `kvtier ls` and /metrics show them beside
    /// the namespace id. Never part of a block's identity. "ok",
    /// "invalid" (a namespace this caller may not use) or "limit_reached"
    /// (the daemon keeps its most descriptions). Raises kvtier.Error for a
    /// bad engine name or a daemon that predates the request.
    fn describe(&self, py: Python<'_>, ns: NsArg<'_>, engine: &str) -> PyResult<String> {
        let c = self.inner()?;
        let nsr = ns.0.inner.clone();
        let engine = engine.to_string();
        let st = py
            .detach(move || c.within_deadline(|| c.namespace(&nsr).describe(&engine)))
            .map_err(from_client)?;
        Ok(status_name(st))
    }

    /// unpin(ns, keys) -> list[str]: removes pins ("ok" or "absent" per key).
    fn unpin(
        &self,
        py: Python<'_>,
        ns: NsArg<'_>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<String>> {
        self.per_key(py, &ns.0, keys, |h, k| h.unpin(k))
    }

    /// evict(ns, keys) -> list[str]: removes blocks from this node ("ok",
    /// "absent", or "limit_reached" for a leased or pinned block).
    fn evict(
        &self,
        py: Python<'_>,
        ns: NsArg<'_>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<String>> {
        self.per_key(py, &ns.0, keys, |h, k| h.evict(k))
    }

    /// stat(ns, keys) -> list[dict | None]
    ///
    /// Metadata per key (None when not stored): tier, nbytes, blake3 (hex),
    /// created_unix_ms, pinned (bool), pinned_until_unix_ms (None when not
    /// pinned or pinned forever, as `kvtier stat --json`), leases.
    fn stat<'py>(
        &self,
        py: Python<'py>,
        ns: NsArg<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let ns = &*ns.0;
        // The call's deadline counts the keys' conversion too.
        let t0 = std::time::Instant::now();
        let keys = keys_from(keys)?;
        let c = self.inner()?;
        let nsr = ns.inner.clone();
        let r = py
            .detach(move || c.within_deadline_since(t0, || c.namespace(&nsr).stat(&keys)))
            .map_err(from_client)?;
        let out = PyList::empty(py);
        for s in r {
            match s {
                None => out.append(py.None())?,
                Some(s) => {
                    let d = PyDict::new(py);
                    d.set_item("tier", s.tier.name())?;
                    d.set_item("nbytes", s.payload_len)?;
                    // The payload checksum: its function ("xxh3-128", or
                    // "blake3" for a block format 1 wrote) and the hex.
                    d.set_item("checksum_algo", s.payload_sum.algo().name())?;
                    d.set_item("checksum", s.payload_sum.to_hex())?;
                    d.set_item("created_unix_ms", s.created_unix_ms)?;
                    // As `kvtier stat --json` says it: "pinned", and the
                    // end of the pin (None when not pinned or pinned
                    // without end: the daemon's u64::MAX is no time).
                    let pinned = s.pinned_until_unix_ms != 0;
                    d.set_item("pinned", pinned)?;
                    d.set_item(
                        "pinned_until_unix_ms",
                        (pinned && s.pinned_until_unix_ms != u64::MAX)
                            .then_some(s.pinned_until_unix_ms),
                    )?;
                    d.set_item("leases", s.leases)?;
                    out.append(d)?;
                }
            }
        }
        Ok(out)
    }

    /// stats() -> dict: the daemon's statistics (what `kvtier stats` prints).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.inner()?;
        let v = py
            .detach(move || c.within_deadline(|| c.stats()))
            .map_err(from_client)?;
        py.import("json")?.call_method1("loads", (v.to_string(),))
    }

    /// events(timeout_ms=None) -> iterator of dict
    ///
    /// KV events (blocks stored / removed, per tier) as the dicts of their
    /// JSON form. With timeout_ms the iteration ends after that long
    /// without an event; it also ends when the daemon goes away. Ctrl-C
    /// interrupts the wait.
    #[pyo3(signature = (timeout_ms=None))]
    fn events(&self, py: Python<'_>, timeout_ms: Option<Arg<u64>>) -> PyResult<Events> {
        let timeout_ms = timeout_ms.map(|t| t.0);
        let c = self.inner()?;
        let s = py
            .detach(move || c.subscribe_events())
            .map_err(from_client)?;
        Ok(Events {
            stream: Mutex::new(Some(s)),
            idle: timeout_ms.map(Duration::from_millis),
        })
    }

    /// alloc_pool(nbytes) -> Pool
    ///
    /// A shared-memory pool of nbytes (rounded up to 4096) inside this
    /// client's region: blocks placed in its slots (Pool.block(i,
    /// block_bytes), Pool.array(block_bytes)) are offloaded and onboarded
    /// with offload_pool / onboard_pool by offset only: no payload byte is
    /// copied by the client or sent over the socket. The daemon counts it
    /// against its per-client region limit (server.region_bytes_max) and
    /// refuses more (kvtier.PoolError). One pool per client; it stays
    /// mapped while any view of it lives. Not inherited across fork().
    fn alloc_pool(&self, py: Python<'_>, nbytes: Arg<u64>) -> PyResult<Pool> {
        let nbytes = nbytes.0;
        let c = self.inner()?;
        let c2 = c.clone();
        let pool = py
            .detach(move || c2.within_deadline(|| c2.alloc_pool(nbytes)))
            .map_err(|e| {
                PoolError::new_err(format!(
                    "pool of {nbytes} bytes refused: {e} (the daemon's per-client limit is \
                 server.region_bytes_max, counting region_bytes + the pool)"
                ))
            })?;
        if let Ok(mut g) = self.pools.lock() {
            g.push((Arc::as_ptr(&c) as usize, pool.clone()));
        }
        Ok(Pool { inner: pool })
    }

    /// offload_pool(ns, keys, slots, parent=None, *, priority=0, pinned=False, ephemeral=False, expected_reuse=0) -> list[BlockResult]
    ///
    /// Like offload, for blocks already in this client's pool: keys[i] is
    /// in slot slots[i] (slots of Pool.slot_bytes(ns.block_bytes)). Only
    /// offsets are sent.
    #[pyo3(signature = (ns, keys, slots, parent=None, *, priority=Arg(0), pinned=Arg(false), ephemeral=Arg(false), expected_reuse=Arg(0)))]
    #[allow(clippy::too_many_arguments)]
    fn offload_pool(
        &self,
        py: Python<'_>,
        ns: NsArg<'_>,
        keys: &Bound<'_, PyAny>,
        slots: Arg<Vec<u64>>,
        parent: Option<&Bound<'_, PyAny>>,
        priority: Arg<u8>,
        pinned: Arg<bool>,
        ephemeral: Arg<bool>,
        expected_reuse: Arg<u16>,
    ) -> PyResult<Vec<BlockResult>> {
        let ns = &*ns.0;
        // The call's deadline counts the keys' conversion too.
        let t0 = std::time::Instant::now();
        let keys = keys_from(keys)?;
        let parent = parent.map(crate::ns::key_from).transpose()?;
        let (c, pool, offs) = self.pool_args(ns, &keys, &slots.0)?;
        let nsr = ns.inner.clone();
        let h = hints(priority.0, pinned.0, ephemeral.0, expected_reuse.0);
        let out = py.detach(move || {
            let mut p = parent;
            let items: Vec<PoolBlock> = keys
                .iter()
                .zip(&offs)
                .map(|(k, o)| {
                    let b = PoolBlock {
                        key: *k,
                        parent: p,
                        slot_offset: *o,
                        hints: h,
                    };
                    p = Some(*k);
                    b
                })
                .collect();
            c.within_deadline_since(t0, || c.namespace(&nsr).offload_pool(&pool, &items))
        });
        Ok(out.iter().map(BlockResult::offloaded).collect())
    }

    /// onboard_pool(ns, keys, slots) -> list[BlockResult]
    ///
    /// Like onboard_into, into this client's pool: the daemon writes keys[i]
    /// into slot slots[i] and the client verifies it there.
    fn onboard_pool(
        &self,
        py: Python<'_>,
        ns: NsArg<'_>,
        keys: &Bound<'_, PyAny>,
        slots: Arg<Vec<u64>>,
    ) -> PyResult<Vec<BlockResult>> {
        let ns = &*ns.0;
        // The call's deadline counts the keys' conversion too.
        let t0 = std::time::Instant::now();
        let keys = keys_from(keys)?;
        let (c, pool, offs) = self.pool_args(ns, &keys, &slots.0)?;
        let nsr = ns.inner.clone();
        let out = py.detach(move || {
            c.within_deadline_since(t0, || c.namespace(&nsr).onboard_pool(&pool, &keys, &offs))
        });
        Ok(out.iter().map(BlockResult::onboarded).collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "Client(socket={:?}, timeout_ms={})",
            self.cfg.socket.display().to_string(),
            self.cfg.timeout_ms
        )
    }
}

impl Client {
    fn pool_args(
        &self,
        ns: &Namespace,
        keys: &[BlockKey],
        slots: &[u64],
    ) -> PyResult<(Arc<RsClient>, RsPool, Vec<u64>)> {
        let c = self.inner()?;
        let pool = self
            .pool_of(&c)?
            .ok_or_else(|| PoolError::new_err("this client has no pool in this process: call alloc_pool first (a pool is not inherited across fork())"))?;
        if slots.len() != keys.len() {
            return Err(PoolError::new_err(format!(
                "{} slots for {} keys: pass one slot per key",
                slots.len(),
                keys.len()
            )));
        }
        let slot = RsPool::slot_bytes(ns.inner.layout.block_bytes());
        let n = pool.len() / slot;
        let offs = slots
            .iter()
            .map(|&s| {
                if s >= n {
                    Err(PoolError::new_err(format!("slot {s} is outside the pool: it holds {n} slots of {slot} bytes for this namespace's blocks")))
                } else {
                    Ok(s * slot)
                }
            })
            .collect::<PyResult<Vec<u64>>>()?;
        Ok((c, pool, offs))
    }

    fn pool_of(&self, c: &Arc<RsClient>) -> PyResult<Option<RsPool>> {
        let g = self
            .pools
            .lock()
            .map_err(|_| PoolError::new_err("pool state poisoned"))?;
        Ok(g.iter()
            .find(|(o, _)| *o == Arc::as_ptr(c) as usize)
            .map(|(_, p)| p.clone()))
    }
}

/// The iterator `Client.events()` returns.
#[pyclass(module = "kvtier", frozen)]
pub(crate) struct Events {
    stream: Mutex<Option<EventStream>>,
    idle: Option<Duration>,
}

#[pymethods]
impl Events {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let start = Instant::now();
        loop {
            // The lock is taken without the GIL: a thread waiting for it
            // must not hold the GIL the waiting holder needs to return.
            let got: Result<Option<String>, ()> = py.detach(|| {
                let Ok(mut g) = self.stream.lock() else {
                    return Err(());
                };
                let Some(s) = g.as_mut() else {
                    return Err(());
                };
                match s.next_timeout(Duration::from_millis(100)) {
                    Ok(Some(ev)) => Ok(Some(ev.to_json().to_string())),
                    Ok(None) => Ok(None),
                    Err(_) => {
                        *g = None;
                        Err(())
                    }
                }
            });
            match got {
                Ok(Some(txt)) => return py.import("json")?.call_method1("loads", (txt,)).map(Some),
                Ok(None) => {}
                Err(()) => return Ok(None),
            }
            py.check_signals()?;
            if self.idle.is_some_and(|d| start.elapsed() >= d) {
                return Ok(None);
            }
        }
    }

    /// Ends the subscription.
    fn close(&self) {
        if let Ok(mut g) = self.stream.lock() {
            *g = None;
        }
    }
}

/// A shared-memory pool (Client.alloc_pool): a writable buffer
/// (memoryview(pool), numpy.frombuffer(pool, numpy.uint8)) whose slots hold
/// blocks that move by offset only.
///
/// Slot i of a namespace with block_bytes b starts at i *
/// Pool.slot_bytes(b); its payload (the block's bytes) is at +4096 (a
/// header page comes first). Pool.block(i, b) and Pool.array(b) give the
/// payload views.
#[pyclass(module = "kvtier", frozen)]
pub(crate) struct Pool {
    pub(crate) inner: RsPool,
}

#[pymethods]
impl Pool {
    /// Bytes of the pool.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.len()
    }

    /// Bytes of one slot for blocks of block_bytes (a 4096-byte header page,
    /// then the payload padded to 4096).
    #[staticmethod]
    fn slot_bytes(block_bytes: u64) -> u64 {
        RsPool::slot_bytes(block_bytes)
    }

    /// Slots for blocks of block_bytes.
    fn num_slots(&self, block_bytes: u64) -> u64 {
        self.inner.len() / RsPool::slot_bytes(block_bytes)
    }

    /// Address of the pool's first byte (to register it with CUDA, say).
    #[getter]
    fn ptr(&self) -> usize {
        self.inner.as_ptr() as usize
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let p = slf.get();
        let len = p.inner.len();
        let ptr = p.inner.as_ptr();
        // SAFETY: the mapping lives as long as `p.inner` (an Arc of the
        // region), which the view keeps alive through its reference to
        // `slf`; FillInfo takes that reference.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut std::ffi::c_void,
                len as pyo3::ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __repr__(&self) -> String {
        format!("Pool(nbytes={})", self.inner.len())
    }
}
