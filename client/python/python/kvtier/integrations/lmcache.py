"""kvtier as an LMCache storage plugin (LMCache 0.5.6, ``StoragePluginInterface``).

Enable it in LMCache's config (``LMCACHE_CONFIG_FILE``)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    storage_plugins: ["kvtier"]
    extra_config:
      storage_plugin.kvtier.module_path: kvtier.integrations.lmcache
      storage_plugin.kvtier.class_name: KvtierStorageBackend
      kvtier_socket: /run/kvtier/kvtierd.sock

LMCache's ``storage_plugin_launcher`` imports the module and builds
``KvtierStorageBackend(config=..., metadata=..., local_cpu_backend=...,
loop=..., dst_device=...)``.

Keys: a ``CacheEngineKey``'s ``chunk_hash`` is the kvtier key (its
two's-complement bytes); the namespace holds the rest of the key (model,
world size, dtype, tags) plus the KV shape of a chunk, and the worker id as
the namespace's rank. Memory objects move without a copy of the
connector's own: kvtier reads from and writes into the memory object's
pinned host memory (``MemoryObj.data_ptr``) as a raw segment; a get
allocates its memory object from LMCache's local CPU backend, as LMCache's
other backends do.

Only full chunks are stored (LMCache's default ``save_unfull_chunk: false``):
a kvtier namespace has one block size, and a chunk's shape is then known
from the metadata alone. A shorter chunk is skipped and counted
(``store_skipped_partial``).

Fail open: ``contains`` answers False and ``get_blocking`` None for a
miss, a timeout or a dead daemon; LMCache recomputes. Puts that fail are
counted and dropped.

Stats: besides ``counters``, each offload and onboard goes into LMCache's
``LMCStatsMonitor`` as its remote backends' transfers do (a write or read
request with its bytes, and its time), so LMCache's own
``lmcache:num_remote_{read,write}_{requests,bytes}`` and
``lmcache:remote_time_to_{get,put}`` show kvtier's traffic.

Hints (docs/OPERATIONS.md, "Engines"): LMCache 0.5.6 gives a storage plugin
``CacheEngineKey``s, whose ``request_configs`` carry the request's
``lmcache.*`` settings (from vLLM's ``kv_transfer_params``); not the
request's priority, nor which chunks are decode or reasoning tokens. The
hints are the deployment's (``kvtier_priority``, ``kvtier_pinned``,
``kvtier_ephemeral``, ``kvtier_expected_reuse`` in ``extra_config``),
overridden per request by ``lmcache.kvtier.priority`` /
``.pinned`` / ``.ephemeral`` / ``.expected_reuse`` in its
``request_configs``, plus ``expected_reuse`` for a chunk that several
lookups missed on before it was stored (a shared prefix).

Prefetch: LMCache looks a request's chunks up (``batched_contains`` /
``batched_async_contains``, its lookup before a retrieve) and then
retrieves them; the hit chunks found on a peer or G4 are prefetched into
G3 at the lookup (one stream per lookup), so the retrieve reads G3.
Bounded and fail open (``_common.Prefetcher``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence

import torch
from lmcache.observability import LMCStatsMonitor
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

import kvtier

from ._common import (
    REGION_BYTES_DEFAULT_MAX,
    BlockHints,
    Counters,
    FailOpen,
    KvtierConfigError,
    Prefetcher,
    ReuseTracker,
    base_hints,
    connector_key,
    describe,
    make_client,
    offload_grouped,
    parse_hints,
    setting,
    stream_id,
    tenant_salt,
)

LMCACHE_VERSION = "0.5.6"

# Cached namespaces (one per model / world size / dtype / tags / worker).
NAMESPACES_MAX = 1024

# Chunks one onboard reads together when the shared region can hold them
# (the daemon's onboard_reads_in_flight default is 16).
READS_TOGETHER_CHUNKS = 16

# The request_configs prefix of per-request hints.
HINTS_PREFIX = "lmcache.kvtier."


def chunk_key(key: CacheEngineKey) -> bytes:
    """The kvtier key of a chunk: ``chunk_hash`` as two's-complement bytes."""
    h = int(key.chunk_hash)
    return connector_key(h.to_bytes(max(1, (h.bit_length() + 8) // 8), "big", signed=True))


class KvtierStartupError(BaseException):
    """A kvtier setting in LMCache's config that cannot work (the message
    says what to set). A BaseException, not an Exception, on purpose:
    LMCache 0.5.6's storage_plugin_launcher catches every Exception from a
    plugin's constructor, logs it and runs without the plugin, so a typo
    would silently turn kvtier off; this one reaches the engine, which
    refuses to start (as vLLM and SGLang do on a bad kvtier setting)."""


def _stop_loop(loop: Optional[asyncio.AbstractEventLoop]) -> None:
    """Stops LMCache's storage-manager event loop (from any thread; one
    whose run_forever has not begun yet stops as soon as it does)."""
    if loop is None or loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # closed meanwhile
        pass


# Chunk successions a plugin remembers (the least recently learned
# forgotten first): 64 Ki pairs of keys, a few MiB.
CHAIN_PAIRS_MAX = 1 << 16


class ChunkChains:
    """Which chunk comes before which, learned from the chunk lists LMCache
    looks up and puts (a request's chunks in token order): a put's first
    chunk is then stored under the chunk before it, so a later turn
    continues the turn before in kvtier and a chat stays one chain
    (evicted from its end). Bounded, thread-safe; a pair not learned (or
    forgotten) leaves the chunk a root, as before."""

    def __init__(self, max_pairs: int = CHAIN_PAIRS_MAX) -> None:
        self.max_pairs = max_pairs
        self._lock = threading.Lock()
        self._before: "OrderedDict[tuple, CacheEngineKey]" = OrderedDict()

    @staticmethod
    def _id(key: CacheEngineKey) -> tuple:
        return (key.model_name, key.world_size, key.worker_id, str(key.dtype), key.tags, int(key.chunk_hash))

    def learn(self, keys: Sequence[CacheEngineKey]) -> None:
        if len(keys) < 2:
            return
        with self._lock:
            for a, b in zip(keys, keys[1:]):
                try:
                    i = self._id(b)
                except (AttributeError, TypeError, ValueError):  # not a chunk key
                    continue
                self._before.pop(i, None)
                self._before[i] = a
            while len(self._before) > self.max_pairs:
                self._before.popitem(last=False)

    def before(self, key: CacheEngineKey) -> Optional[CacheEngineKey]:
        try:
            i = self._id(key)
        except (AttributeError, TypeError, ValueError):
            return None
        with self._lock:
            return self._before.get(i)


class KvtierStorageBackend(StoragePluginInterface):
    """LMCache storage backend on kvtierd."""

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Optional[LMCacheEngineConfig] = None,
        metadata: Optional[LMCacheMetadata] = None,
        local_cpu_backend: Any = None,
        loop: Optional[asyncio.AbstractEventLoop] = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        try:
            self._configure(config, metadata, local_cpu_backend)
        except (kvtier.Error, ValueError, TypeError) as e:  # KvtierConfigError and bad values
            # LMCache 0.5.6's StorageManager started its event loop on a
            # non-daemon thread before building its backends: left
            # running, it keeps the refused engine's process alive for
            # ever. Stopped here, the process ends with the error.
            _stop_loop(loop)
            raise KvtierStartupError(f"kvtier LMCache plugin: {e}") from e

    def _configure(
        self, config: Optional[LMCacheEngineConfig], metadata: Optional[LMCacheMetadata], local_cpu_backend: Any
    ) -> None:
        if config is None or metadata is None:
            raise KvtierConfigError("KvtierStorageBackend needs LMCache's config and metadata")
        if local_cpu_backend is None:
            raise KvtierConfigError(
                "KvtierStorageBackend allocates retrieved chunks from LMCache's local CPU "
                "backend: keep it enabled (it is, unless the engine disables it)"
            )
        self.extra = dict(config.extra_config or {})
        self.counters = Counters()
        self.fail = FailOpen("lmcache", self.counters)
        self.shapes = list(metadata.get_shapes())
        self.dtypes = list(metadata.get_dtypes())
        self.fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        self.chunk_bytes = sum(
            int(torch.Size(s).numel()) * torch.tensor([], dtype=d).element_size()
            for s, d in zip(self.shapes, self.dtypes)
        )
        if self.chunk_bytes > kvtier.BLOCK_BYTES_MAX:
            raise KvtierConfigError(
                f"an LMCache chunk is {self.chunk_bytes} bytes, over kvtier's "
                f"{kvtier.BLOCK_BYTES_MAX}: lower chunk_size"
            )
        # A shared region that holds a batch of READS_TOGETHER_CHUNKS
        # chunks, so one onboard reads them together (the 64 MiB default
        # holds three 16 MiB chunks); kvtier_region_bytes overrides.
        slot = -(-self.chunk_bytes // 4096) * 4096 + 4096
        region = min(max(64 << 20, READS_TOGETHER_CHUNKS * slot), REGION_BYTES_DEFAULT_MAX)
        # Reads over passed fds by default: LMCache's chunks are host
        # memory this process owns, so each chunk is read from its file
        # straight into its memory object (two readers per batch, each
        # byte hashed once, here) instead of landing in the shared region
        # and being copied out: 1.01-1.27x of LMCache's local_disk on get
        # against 0.55-0.89x through the region (BENCHMARKS.md, lmcache).
        # kvtier_direct_read: false turns it off.
        self.client = make_client({"kvtier_direct_read": True, **self.extra}, region_bytes=region)
        self.hints = base_hints(self.extra)
        self.reuse = ReuseTracker()
        self.prefetcher = Prefetcher(self.client, self.counters, self.fail, self.extra)
        self.layout = kvtier.Layout.with_block_bytes(self.chunk_bytes)
        self.salt = tenant_salt(self.extra)
        self.model = setting(self.extra, "model")
        self._ns: dict[tuple, kvtier.Namespace] = {}
        self._ns_lock = threading.Lock()
        self.chains = ChunkChains()
        self._observe_lookups(local_cpu_backend)

    def _observe_lookups(self, local_cpu_backend: Any) -> None:
        """LMCache asks its backends in order and hands the next one only
        the keys the one before missed, so a later turn's lookup reaches
        this plugin without the turn before's chunks, and a put holds only
        the new chunks: neither says which chunk the first new one
        continues. The local CPU backend, asked first, sees each lookup's
        whole chunk list: its ``batched_contains`` is wrapped (the call
        goes on unchanged) so that the chunk order reaches
        :attr:`chains`."""
        orig = getattr(local_cpu_backend, "batched_contains", None)
        if orig is None or getattr(orig, "_kvtier_observed", False):
            return
        chains = self.chains

        def batched_contains(keys, *args, **kwargs):
            chains.learn(keys)
            return orig(keys, *args, **kwargs)

        batched_contains._kvtier_observed = True  # type: ignore[attr-defined]
        local_cpu_backend.batched_contains = batched_contains

    def __str__(self) -> str:
        return "KvtierStorageBackend"

    # -- keys -------------------------------------------------------------

    def _namespace(self, key: CacheEngineKey) -> kvtier.Namespace:
        ident = (key.model_name, key.world_size, key.worker_id, str(key.dtype), key.tags)
        with self._ns_lock:
            ns = self._ns.get(ident)
            if ns is None:
                shape = ";".join("x".join(str(d) for d in s) for s in self.shapes)
                model = (
                    f"{self.model or key.model_name}#lmcache/{str(key.dtype).replace('torch.', '')}"
                    f"/ws={key.world_size}/shape={shape}/fmt={self.fmt.name}"
                )
                adapter = "" if not key.tags else repr(key.tags)
                ns = kvtier.Namespace(
                    model, self.layout, adapter, self.salt, hash_mode="opaque",
                    rank=int(key.worker_id),
                )
                if len(self._ns) >= NAMESPACES_MAX:
                    self._ns.pop(next(iter(self._ns)))
                self._ns[ident] = ns
                describe(self.client, [ns], "lmcache", self.fail)
            return ns

    def _hints(self, key: CacheEngineKey) -> BlockHints:
        """The deployment's hints, overridden by the request's
        ``lmcache.kvtier.*`` request configs (a bad one is ignored)."""
        if not key.request_configs:
            return self.hints
        try:
            h, _ = parse_hints(key.request_configs, HINTS_PREFIX, self.hints)
            return h
        except ValueError as e:
            self.counters.add("hint_errors")
            self.fail.warn("request hints ignored", e)
            return self.hints

    @staticmethod
    def _buf(obj: MemoryObj) -> tuple:
        return (int(obj.data_ptr), int(obj.get_size()))

    # -- lookups ----------------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(
        self, keys: List[CacheEngineKey], pin: bool = False, lookup_id: Optional[str] = None
    ) -> int:
        if not keys:
            return 0
        self.counters.add("lookups")
        self.chains.learn(keys)
        try:
            # Keys of one lookup share a namespace except across workers.
            hit = 0
            while hit < len(keys):
                ns = self._namespace(keys[hit])
                run = []
                for k in keys[hit:]:
                    if self._namespace(k) is not ns:
                        break
                    run.append(k)
                ks = [chunk_key(k) for k in run]
                found = self.client.lookup(ns, ks)
                if found.reason not in (None, "absent"):
                    self.fail.warn(f"lookup {found.reason}", found.detail)
                n = int(found.prefix_len)
                if pin and n:
                    self.client.pin(ns, ks[:n])
                for k in ks[n:]:
                    self.reuse.seen(k, lookup_id)
                if n:
                    # LMCache retrieves what it found next: bring the chunks
                    # on a peer or G4 into G3 first.
                    self.prefetcher.request(
                        ns, ks[:n], list(found.tiers)[:n],
                        stream_id(b"lmcache", lookup_id if lookup_id is not None else ks[0], ns.id),
                    )
                hit += found.prefix_len
                if found.prefix_len < len(run):
                    break
        except Exception as e:
            self.fail.error("contains", e)
            hit = 0
        self.counters.add("lookup_hits", hit)
        self.counters.add("lookup_misses", len(keys) - hit)
        return hit

    async def batched_async_contains(
        self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False
    ) -> int:
        return await asyncio.get_running_loop().run_in_executor(
            None, self.batched_contains, keys, pin, lookup_id
        )

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        # Puts are synchronous: none is ever in flight.
        return False

    # -- puts -------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: List[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
    ) -> Optional[List[Future]]:
        self.counters.add("stores")
        # The full chunks, in order, by namespace run: each run is one
        # offload (the daemon shares its durable steps: one directory
        # fsync and index commit), its chunks recorded as the chain they
        # are (a put is a request's chunks in token order).
        self.chains.learn(list(keys))
        full = []
        for key, obj in zip(keys, objs):
            if int(obj.get_size()) != self.chunk_bytes:
                self.counters.add("store_skipped_partial")
            else:
                full.append((key, obj))
        start = 0
        while start < len(full):
            try:
                ns = self._namespace(full[start][0])
                end = start + 1
                while end < len(full) and self._namespace(full[end][0]) is ns:
                    end += 1
            except Exception as e:
                self.counters.add("store_failures", len(full) - start)
                self.fail.error("put", e)
                return None
            self._put_run(ns, full[start:end], on_complete_callback)
            start = end
        return None

    def _put_run(self, ns: kvtier.Namespace, run: list, on_complete_callback) -> None:
        """One offload of ``run`` ((key, memory object) pairs of ``ns``)."""
        try:
            cks = [chunk_key(k) for k, _ in run]
            hints = [self._hints(k).with_reuse(self.reuse.others(ck)) for (k, _), ck in zip(run, cks)]
            bufs = [self._buf(o) for _, o in run]
            # The chunk before the run's first (a later turn's first chunk
            # continues the turn before), when LMCache's lookups showed it.
            before = self.chains.before(run[0][0])
            parent = (
                chunk_key(before) if before is not None and self._namespace(before) is ns else None
            )
            t0 = time.perf_counter()
            results = offload_grouped(self.client, ns, cks, bufs, hints, parent)
            if parent is not None and results and results[0].reason == "absent":
                # kvtierd holds that chunk nowhere (its store failed, or it
                # is only in LMCache's CPU cache): stored as a chain of its
                # own, as LMCache finds it after its other backends' hits.
                self.counters.add("store_parent_absent")
                results = offload_grouped(self.client, ns, cks, bufs, hints)
            took = time.perf_counter() - t0
        except Exception as e:
            self.counters.add("store_failures", len(run))
            self.fail.error("put", e)
            return
        stored = sum(r.status in ("stored", "stored_unpinned") for r in results)
        self._lmcache_stats("put", stored * self.chunk_bytes, took)
        for (key, _), res in zip(run, results):
            if res.status in ("stored", "stored_unpinned"):
                if res.status == "stored_unpinned":
                    # Stored, but the daemon's pin budget refused the pin.
                    self.counters.add("store_unpinned")
                self.counters.add("store_blocks")
                self.counters.add("store_bytes", self.chunk_bytes)
            elif res.status == "already_present":
                self.counters.add("store_already_present")
            else:
                self.counters.add("store_failures")
                self.fail.warn(f"store {res.reason}", res.detail)
                continue
            if on_complete_callback is not None:
                try:
                    on_complete_callback(key)
                except Exception as e:
                    self.fail.error("on_complete_callback", e)

    # -- gets -------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """The chunks of ``keys`` (None for one that could not be read):
        their memory objects allocated first, then one onboard per
        namespace run (one for a whole lookup), so the daemon reads every
        chunk of the batch together rather than one after another."""
        out: List[Optional[MemoryObj]] = [None] * len(keys)
        if not keys:
            return out
        self.counters.add("loads")
        objs: List[Optional[MemoryObj]] = []
        for _ in keys:
            try:
                obj = self.local_cpu_backend.allocate(self.shapes, self.dtypes, self.fmt)
            except Exception as e:
                self.fail.error("allocate", e)
                obj = None
            if obj is None:
                # LMCache uses the prefix before the first None: the rest
                # would be read for nothing.
                self.counters.add("load_failures", len(keys) - len(objs))
                self.fail.warn("no CPU memory for a retrieved chunk", "local_cpu_backend.allocate")
                break
            objs.append(obj)
        start = 0
        while start < len(objs):
            ns = self._namespace(keys[start])
            end = start + 1
            while end < len(objs) and self._namespace(keys[end]) is ns:
                end += 1
            self._onboard_run(ns, keys[start:end], objs[start:end], out, start)
            start = end
        return out

    def _onboard_run(
        self,
        ns: kvtier.Namespace,
        keys: List[CacheEngineKey],
        objs: List[MemoryObj],
        out: List[Optional[MemoryObj]],
        at: int,
    ) -> None:
        """One onboard of chunks of one namespace into ``objs``; each hit
        goes to ``out[at + i]``, each miss's memory object is freed."""
        cks = [chunk_key(k) for k in keys]
        try:
            t0 = time.perf_counter()
            res = self.client.onboard_into(ns, cks, [self._buf(o) for o in objs])
            took = time.perf_counter() - t0
        except Exception as e:
            for obj in objs:
                obj.ref_count_down()
            self.counters.add("load_failures", len(objs))
            self.fail.error("get", e)
            return
        self._lmcache_stats("get", sum(int(r.nbytes) for r in res if r.ok), took)
        for i, (ck, obj, r) in enumerate(zip(cks, objs, res)):
            self.prefetcher.loaded(ns, ck, r.tier if r.ok else None)
            if not r.ok:
                obj.ref_count_down()
                self.counters.add("load_failures")
                if r.reason != "absent":
                    self.fail.warn(f"load {r.reason}", r.detail)
                continue
            self.counters.add("load_blocks")
            self.counters.add(f"load_blocks_{r.tier}")
            self.counters.add("load_bytes", r.nbytes)
            out[at + i] = obj

    def _lmcache_stats(self, op: str, nbytes: int, seconds: float) -> None:
        """One kvtier request that completed, in LMCache's own stats
        (``LMCStatsMonitor``, which LMCache's remote backends feed and its
        stats logger exports): its time in ``lmcache:remote_time_to_get`` /
        ``_put`` (ms), and, when it moved chunks, one request and their
        bytes in ``lmcache:num_remote_read_*`` / ``num_remote_write_*``.
        Never an error to the engine."""
        try:
            # Looked up per call: LMCache replaces the singleton when an
            # engine is destroyed and another built.
            stats = LMCStatsMonitor.GetOrCreate()
            if op == "get":
                stats.update_interval_remote_time_to_get(seconds * 1000)
                if nbytes:
                    stats.update_interval_remote_read_metrics(nbytes)
            else:
                stats.update_interval_remote_time_to_put(seconds * 1000)
                if nbytes:
                    stats.update_interval_remote_write_metrics(nbytes)
        except Exception as e:
            self.fail.error("LMCache stats", e)

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """The chunks of the longest prefix of ``keys`` that could be read."""
        objs = await asyncio.get_running_loop().run_in_executor(None, self.batched_get_blocking, keys)
        out: list[MemoryObj] = []
        for i, obj in enumerate(objs):
            if obj is None:
                for rest in objs[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(obj)
        return out

    # -- pins and removal -------------------------------------------------

    def _per_key(self, key: CacheEngineKey, op: str) -> bool:
        try:
            ns = self._namespace(key)
            st = getattr(self.client, op)(ns, [chunk_key(key)])
            return st[0] == "ok"
        except Exception as e:
            self.fail.error(op, e)
            return False

    def pin(self, key: CacheEngineKey) -> bool:
        return self._per_key(key, "pin")

    def unpin(self, key: CacheEngineKey) -> bool:
        return self._per_key(key, "unpin")

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self._per_key(key, "evict")

    def get_allocator_backend(self):
        return self.local_cpu_backend

    def close(self) -> None:
        return None
