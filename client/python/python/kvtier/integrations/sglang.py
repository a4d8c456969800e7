"""kvtier as SGLang's HiCache L3 storage (SGLang 0.5.23, ``HiCacheStorage``).

Load it through SGLang's dynamic backend::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
      --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
        "kvtier_socket": "/run/kvtier/kvtierd.sock"}'

``hicache_storage_pass_prefix_keys: true`` makes SGLang hand each backup
its chain (the page hashes before it): a later turn's first page is stored
under the turn before's last, so kvtier keeps a chat one chain and evicts
it from its end. Without it every backup batch is a chain of its own
(counted as ``stores_without_prefix_keys``, and a warning once).

``interface_v1: 1`` makes SGLang call ``batch_get_v1`` / ``batch_set_v1``
with host-pool page indices: kvtier reads and writes the host pool's pages
where they are (``get_page_buffer_meta``'s pointers as raw segments), with
no copy of its own for a page that is one run of memory (MLA, and MHA's
K and V when laid out back to back).

Keys: SGLang's page hashes (hex strings) as kvtier keys (their bytes,
``hash_mode="opaque"``). The namespace holds the model, the host pool's
layout, dtype and page size, the PP stage, and the TP size and rank
unless the model is MLA (MLA's KV is the same on every TP rank and at
every TP size: one copy, which only the storage writer stores, read by
every rank and by deployments at another TP size).

Hybrid models (Mamba state, sliding-window attention, DSA indexers,
draft pools): SGLang's HybridCacheController registers each extra host
pool (``register_mem_host_pool_v2``) and moves it with the v2 interface
(``batch_exists_v2`` with each pool's ``all_pages`` / ``trailing_pages``
hit policy, ``batch_set_v2``, ``batch_get_v2``). Each extra pool has a
namespace of its own (the KV namespace's fields plus ``pool=<name>`` and
the pool's class, layout, dtype), one pool page a block, moved in place
like the KV pages.

Fail open: ``batch_exists`` answers 0 and the get/set calls answer False
for a page they could not move (a miss, a timeout, a dead daemon), and
the v2 calls likewise per pool; SGLang then recomputes. Nothing raises
into the scheduler; ``counters`` counts.

Hints (docs/OPERATIONS.md, "Engines"): SGLang 0.5.23's HiCache controller
gives the storage backend page hashes and the chain before them
(``HiCacheStorageExtraInfo.prefix_keys``), not the request's priority,
id, or which pages are decode or reasoning tokens. So the hints are the
deployment's (``kvtier_priority``, ``kvtier_pinned``, ``kvtier_ephemeral``,
``kvtier_expected_reuse`` in the extra config), overridden by the same
``kvtier_*`` names in ``extra_info.extra_info`` when a caller sets them,
plus ``expected_reuse`` for a page that several prefetch queries
(``batch_exists``) missed on before it was stored (a shared prefix).

Prefetch: ``batch_exists`` is SGLang's prefetch query; the pages it finds
on a peer or G4 are prefetched into G3 there (one stream per chain, so a
query of the same chain again supersedes), and the ``batch_get_v1`` that
follows reads them from G3. Bounded and fail open (``_common.Prefetcher``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

import kvtier

from ._common import (
    Counters,
    FailOpen,
    KvtierConfigError,
    Prefetcher,
    ReuseTracker,
    base_hints,
    coalesce,
    connector_key,
    describe,
    make_client,
    offload_grouped,
    parse_hints,
    setting,
    stream_id,
    tenant_salt,
)

SGLANG_VERSION = "0.5.23"

# Keys this backend stored that clear() evicts (kvtier has no namespace-wide
# delete); older keys beyond this many are left to kvtier's own eviction.
CLEAR_TRACKED_KEYS_MAX = 1 << 20

# Batches get_stats keeps per figure until SGLang collects them.
STATS_OPS_MAX = 4096

# kvtier's block sizes are multiples of this many bytes; a hybrid pool's
# page that is not (a Mamba state: any size) is stored with zero bytes
# after it up to the next multiple, dropped again on load.
BLOCK_BYTES_ALIGN = 32


def page_key(key: str) -> bytes:
    """SGLang's page hash (hex) as a kvtier key: its bytes when it is hex
    of at most 64 bytes, else the string's own bytes (hashed when long)."""
    try:
        raw = bytes.fromhex(key)
        if 0 < len(raw) <= 64:
            return raw
    except ValueError:
        pass
    return connector_key(key)


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 backend on kvtierd. SGLang constructs it as
    ``KvtierHiCacheStorage(storage_config, kwargs)`` and then calls
    ``register_mem_pool_host(host_pool)``.

    Extra-config keys: ``kvtier_socket``, ``kvtier_timeout_ms`` (2000),
    ``kvtier_model`` (default SGLang's model name), ``kvtier_tenant_salt``;
    hints and prefetch as in the module's doc (``kvtier_priority``, ...,
    ``kvtier_prefetch``, ``kvtier_prefetch_deadline_ms``,
    ``kvtier_prefetch_inflight_max``)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.extra = dict(storage_config.extra_config or {})
        self.counters = Counters()
        self.fail = FailOpen("sglang", self.counters)
        self.client = make_client(self.extra)
        self.hints = base_hints(self.extra)
        self.reuse = ReuseTracker()
        self.prefetcher = Prefetcher(self.client, self.counters, self.fail, self.extra)
        self.is_mla = storage_config.is_mla_model
        self.writer = storage_config.is_storage_writer
        self.ns: Optional[kvtier.Namespace] = None
        self.segments_per_page = 0
        self.page_size = 0
        # (pool name, key): None for a KV page, else the extra pool's name.
        self._stored: dict[tuple[Optional[str], bytes], None] = {}
        self._stored_lock = threading.Lock()
        # Per-batch figures for get_stats (StorageMetrics' field names).
        self._ops: dict[str, list] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []
        }
        self._ops_lock = threading.Lock()
        self._warned_prefix = False
        # The hybrid models' extra host pools (register_mem_host_pool_v2),
        # by SGLang's pool name.
        self._pools: dict[str, _ExtraPool] = {}
        self._pools_lock = threading.Lock()

    # -- setup ------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.page_size = int(mem_pool_host.page_size)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(
            torch.arange(self.page_size, dtype=torch.int64)
        )
        if not ptrs:
            raise KvtierConfigError(
                f"SGLang's {type(mem_pool_host).__name__} gives no page pointers "
                "(get_page_buffer_meta): use an MHA or MLA host pool"
            )
        self.segments_per_page = len(ptrs)
        block_bytes = int(sum(sizes))
        if block_bytes > kvtier.BLOCK_BYTES_MAX:
            raise KvtierConfigError(
                f"one HiCache page is {block_bytes} bytes, over kvtier's "
                f"{kvtier.BLOCK_BYTES_MAX}: lower --page-size"
            )
        layout = getattr(mem_pool_host, "layout", "unknown")
        dtype = str(getattr(mem_pool_host, "dtype", "unknown")).replace("torch.", "")
        kind = "mla" if self.is_mla else "mha"
        # MLA's latent KV is the same on every TP rank whatever the TP
        # size: its namespace leaves the TP size out, so a deployment at
        # another TP size finds the same pages (one copy, the writer's).
        self.ns = self._namespace(f"{kind}/{layout}/{dtype}", block_bytes, sharded=not self.is_mla)
        describe(self.client, [self.ns], "sglang", self.fail)

    def _namespace(self, what: str, block_bytes: int, sharded: bool) -> kvtier.Namespace:
        """The namespace of one host pool's pages: the model, ``what`` (the
        pool's kind, layout, dtype), SGLang's page size (the tokens a page
        hash covers), the PP / CP / DCP position, and the TP size and rank
        when the pool's bytes differ by TP rank (``sharded``)."""
        c = self.storage_config
        model = setting(self.extra, "model", c.model_name or "unknown-model")
        tp = f"/tp={c.tp_size}" if sharded else ""
        desc = (
            f"{model}#sglang/{what}/page={self.page_size}"
            f"{tp}/pp={c.pp_rank}of{c.pp_size}"
            f"/cp={c.attn_cp_rank}of{c.attn_cp_size}/dcp={c.dcp_rank}of{c.dcp_size}"
        )
        if c.should_split_heads and sharded:
            desc += f"/tplcm={c.tp_lcm_size}"
        return kvtier.Namespace(
            desc,
            kvtier.Layout.with_block_bytes(block_bytes),
            "",
            tenant_salt(self.extra),
            hash_mode="opaque",
            rank=int(c.tp_rank) if sharded else None,
        )

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """SGLang's hybrid models (Mamba state, sliding-window attention,
        DSA indexers, draft pools) register each extra host pool here
        (HybridCacheController.attach_storage_backend, and later sidecars
        through register_host_pool_entry). Each pool gets a kvtier
        namespace of its own (the KV namespace's fields plus
        ``pool=<name>``, the pool's class, layout, dtype), so its blocks
        never mix with the KV pages or another pool's under the same page
        hash; one page of the pool (``get_page_buffer_meta``'s segments
        for the pool's own page) is one block. Mamba state and MHA-shaped
        pools are per TP rank; the other pools of an MLA model are one
        copy, like its KV. A pool that gives no page pointers, or whose
        page is over kvtier's block limit, is refused here (start-up),
        naming it. The KV pool itself is the one
        ``register_mem_pool_host`` had."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        if name == PoolName.KV.value:
            return
        if self.ns is None:
            raise KvtierConfigError(
                f"SGLang registered the hybrid host pool {name!r} before the KV pool "
                "(register_mem_pool_host)"
            )
        page = int(getattr(host_pool, "page_size", 1) or 1)
        try:
            ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        except Exception as e:
            raise KvtierConfigError(
                f"SGLang's hybrid host pool {name!r} ({type(host_pool).__name__}) gives no "
                f"page pointers (get_page_buffer_meta: {type(e).__name__}: {e})"
            ) from e
        if not ptrs:
            raise KvtierConfigError(
                f"SGLang's hybrid host pool {name!r} ({type(host_pool).__name__}) gives no "
                "page pointers (get_page_buffer_meta)"
            )
        page_bytes = int(sum(int(n) for n in sizes))
        block_bytes = -(-page_bytes // BLOCK_BYTES_ALIGN) * BLOCK_BYTES_ALIGN
        if block_bytes > kvtier.BLOCK_BYTES_MAX:
            raise KvtierConfigError(
                f"one page of SGLang's hybrid host pool {name!r} is {page_bytes} bytes, "
                f"over kvtier's {kvtier.BLOCK_BYTES_MAX}: lower --page-size"
            )
        # Mamba state is TP-sharded even when the KV is MLA (SGLang backs it
        # up on every rank); an MHA-shaped pool (SWA, an MHA draft) is
        # split by heads.
        sharded = (
            not self.is_mla
            or name == PoolName.MAMBA.value
            or isinstance(host_pool, MHATokenToKVPoolHost)
        )
        layout = getattr(host_pool, "layout", "unknown")
        dtype = str(getattr(host_pool, "dtype", "unknown")).replace("torch.", "")
        ns = self._namespace(
            f"pool={name}/{type(host_pool).__name__}/{layout}/{dtype}/slots={page}",
            block_bytes,
            sharded,
        )
        with self._pools_lock:
            self._pools[name] = _ExtraPool(
                name, host_pool, ns, page, len(ptrs), sharded, block_bytes - page_bytes
            )
        describe(self.client, [ns], "sglang", self.fail)

    def _page_buffers(self, n: int, host_indices: torch.Tensor) -> list:
        """The raw (ptr, nbytes) segments of ``n`` KV pages at ``host_indices``."""
        assert self.mem_pool_host is not None
        return _page_buffers(self.mem_pool_host, n, host_indices, self.page_size, self.segments_per_page)

    # -- the v1 (zero-copy) interface SGLang's controller calls -----------

    def batch_exists(
        self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> int:
        if not keys or self.ns is None:
            return 0
        self.counters.add("lookups")
        ks = [page_key(k) for k in keys]
        try:
            found = self.client.lookup(self.ns, ks)
        except Exception as e:
            self.fail.error("batch_exists", e)
            return 0
        if found.reason not in (None, "absent"):
            self.fail.warn(f"lookup {found.reason}", found.detail)
        hit = int(found.prefix_len)
        self.counters.add("lookup_hits", hit)
        self.counters.add("lookup_misses", len(keys) - hit)
        for k in ks[hit:]:
            self.reuse.seen(k)
        if hit:
            # The pages SGLang is about to read: those on a peer or G4 are
            # fetched into G3 now, all at once, ahead of batch_get_v1.
            prefix = extra_info.prefix_keys if extra_info is not None else None
            chain = page_key(prefix[0]) if prefix else ks[0]
            self.prefetcher.request(
                self.ns, ks[:hit], list(found.tiers)[:hit], stream_id(b"sglang", chain, ks[0])
            )
        return hit

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        if not keys:
            return []
        self.counters.add("loads")
        try:
            assert self.ns is not None, "register_mem_pool_host was not called"
            bufs = self._page_buffers(len(keys), host_indices)
            ks = [page_key(k) for k in keys]
            t0 = time.perf_counter()
            res = self.client.onboard_into(self.ns, ks, bufs)
            took = time.perf_counter() - t0
        except Exception as e:
            self.counters.add("load_failures", len(keys))
            self.fail.error("batch_get_v1", e)
            return [False] * len(keys)
        got = [r for r in res if r.ok]
        self._record("prefetch_pgs", "prefetch_bandwidth", len(got), sum(r.nbytes for r in got), took)
        out = []
        for k, r in zip(ks, res):
            self.prefetcher.loaded(self.ns, k, r.tier if r.ok else None)
            out.append(bool(r.ok))
            if r.ok:
                self.counters.add("load_blocks")
                self.counters.add(f"load_blocks_{r.tier}")
                self.counters.add("load_bytes", r.nbytes)
            else:
                self.counters.add("load_failures")
                if r.reason != "absent":
                    self.fail.warn(f"load {r.reason}", r.detail)
        return out

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        if not keys:
            return []
        if not self.writer:
            # MLA: another rank stores the same bytes.
            return [True] * len(keys)
        self.counters.add("stores")
        try:
            assert self.ns is not None, "register_mem_pool_host was not called"
            bufs = self._page_buffers(len(keys), host_indices)
            ks = [page_key(k) for k in keys]
            prefix = extra_info.prefix_keys if extra_info is not None else None
            if prefix is None:
                self._no_prefix_keys()
            parent = page_key(prefix[-1]) if prefix else None
            t0 = time.perf_counter()
            res = offload_grouped(self.client, self.ns, ks, bufs, self._hints(ks, extra_info), parent)
            took = time.perf_counter() - t0
        except Exception as e:
            self.counters.add("store_failures", len(keys))
            self.fail.error("batch_set_v1", e)
            return [False] * len(keys)
        stored = sum(1 for r in res if r.status in ("stored", "stored_unpinned"))
        self._record("backup_pgs", "backup_bandwidth", stored, stored * self.ns.block_bytes, took)
        out = []
        for k, r in zip(ks, res):
            ok = r.status in ("stored", "stored_unpinned", "already_present")
            out.append(ok)
            if r.status in ("stored", "stored_unpinned"):
                if r.status == "stored_unpinned":
                    # Stored, but the daemon's pin budget refused the pin.
                    self.counters.add("store_unpinned")
                self.counters.add("store_blocks")
                self.counters.add("store_bytes", self.ns.block_bytes)
                self._remember(k)
            elif r.status == "already_present":
                self.counters.add("store_already_present")
            else:
                self.counters.add("store_failures")
                self.fail.warn(f"store {r.reason}", r.detail)
        return out

    def _no_prefix_keys(self) -> None:
        """SGLang passes a backup's chain (``prefix_keys``) only with
        ``hicache_storage_pass_prefix_keys: true`` in the storage backend's
        extra config; without it every backup batch (a later turn's new
        pages) is stored as a chain of its own, and kvtier's leaves-first
        eviction takes a chat's earlier turn ends first. Counted, and said
        once."""
        self.counters.add("stores_without_prefix_keys")
        if not self._warned_prefix:
            self._warned_prefix = True
            logging.getLogger("kvtier.sglang").warning(
                "kvtier sglang: SGLang passes no prefix_keys: add \"hicache_storage_pass_prefix_keys\": "
                "true to --hicache-storage-backend-extra-config so that a later turn's pages are stored "
                "under the turn before (else each backup is a chain of its own, and kvtier evicts each "
                "turn's end first)"
            )

    def _hints(self, ks: list[bytes], extra_info: Optional[HiCacheStorageExtraInfo]) -> list:
        base = self.hints
        given = extra_info.extra_info if extra_info is not None else None
        if given:
            try:
                base, _ = parse_hints(given, "kvtier_", base)
            except ValueError as e:  # a bad hint is ignored, never a failed store
                self.counters.add("hint_errors")
                self.fail.warn("hints ignored", e)
        return [base.with_reuse(self.reuse.others(k)) for k in ks]

    def _remember(self, key: bytes, pool: Optional[str] = None) -> None:
        with self._stored_lock:
            self._stored[(pool, key)] = None
            if len(self._stored) > CLEAR_TRACKED_KEYS_MAX:
                self._stored.pop(next(iter(self._stored)))

    def clear(self) -> None:
        """Evicts the pages this backend stored (SGLang's
        /clear_hicache_storage_backend), the extra pools' too; other
        engines' pages stay."""
        with self._stored_lock:
            stored = list(self._stored)
            self._stored.clear()
        if not stored or self.ns is None:
            return
        by_ns: dict = {}
        for pool, key in stored:
            ns = self.ns if pool is None else self._pools[pool].ns
            by_ns.setdefault(ns.id, (ns, []))[1].append(key)
        try:
            for ns, keys in by_ns.values():
                for i in range(0, len(keys), 1024):
                    self.client.evict(ns, keys[i : i + 1024])
        except Exception as e:
            self.fail.error("clear", e)

    def get_stats(self):
        """SGLang's storage metrics since the last call (its
        ``--enable-storage-metrics`` histograms ``sglang:prefetch_pgs``,
        ``backup_pgs``, ``prefetch_bandwidth``, ``backup_bandwidth``, in
        GB/s per batch); the connector's cumulative ``counters`` stay on
        ``self.counters``."""
        # Imported here: SGLang's metrics module is heavy, and only a
        # server run with --enable-storage-metrics asks.
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        with self._ops_lock:
            for name, ops in self._ops.items():
                getattr(out, name).extend(ops)
                ops.clear()
        return out

    def _record(self, pgs: str, bw: str, pages: int, nbytes: int, seconds: float) -> None:
        """One batch for :meth:`get_stats` (bounded: the oldest batches
        are dropped when SGLang does not collect)."""
        with self._ops_lock:
            for name, v in ((pgs, pages), (bw, nbytes / max(seconds, 1e-9) / 1e9)):
                ops = self._ops[name]
                ops.append(v)
                if len(ops) > STATS_OPS_MAX:
                    del ops[: len(ops) - STATS_OPS_MAX]

    # -- the v2 interface: a hybrid model's extra pools beside the KV -------

    def _pool(self, name) -> "_ExtraPool":
        pool = self._pools.get(_pool_name(name))
        if pool is None:
            raise KvtierConfigError(f"SGLang's host pool {_pool_name(name)!r} was not registered")
        return pool

    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        """The KV prefix (``batch_exists``), cut to where every extra pool
        can serve it: an ``all_pages`` pool must hold every page of the
        prefix, a ``trailing_pages`` pool (Mamba state: 1 page, SWA: its
        window) the last ``len(transfer.keys)`` pages before a stop point,
        so a trailing pool leaves the set of prefix lengths it can restore
        (``restorable_prefix_pages``), not only the longest. A pool kvtier
        cannot ask (daemon gone, timeout) or a policy it does not know
        serves nothing: a miss, never an exception."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            try:
                boundary, pool_restorable = self._pool_hits(keys[:kv_pages], transfer)
            except Exception as e:
                self.fail.error(f"batch_exists_v2 {_pool_name(transfer.name)}", e)
                boundary, pool_restorable = 0, set()
            self.counters.add("pool_lookups")
            if boundary:
                hits[transfer.name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _pool_hits(self, keys: List[str], transfer: PoolTransfer) -> tuple[int, set]:
        """One pool's verdict on the KV prefix ``keys``: its longest
        restorable prefix and every restorable prefix length (in pages)."""
        pool = self._pool(transfer.name)
        ks = [page_key(k) for k in keys]
        policy = _policy(transfer.hit_policy)
        if policy == PoolHitPolicy.ALL_PAGES.value:
            found = self.client.lookup(pool.ns, ks) if ks else None
            if found is not None and found.reason not in (None, "absent"):
                self.fail.warn(f"lookup {found.reason}", found.detail)
            boundary = int(found.prefix_len) if found is not None else 0
            return boundary, set(range(1, boundary + 1))
        if policy == PoolHitPolicy.TRAILING_PAGES.value:
            # Which pages the pool holds, each on its own (a trailing pool
            # holds windows, not a prefix): one stat request.
            held = [s is not None for s in self.client.stat(pool.ns, ks)] if ks else []
            window = max(1, len(transfer.keys) if transfer.keys else 1)
            ok = {n for n in range(1, len(ks) + 1) if all(held[max(0, n - window) : n])}
            return max(ok, default=0), ok
        # block_groups (DeepSeek V4's compressed pools) is not stored by
        # kvtier: the pool serves nothing, and SGLang recomputes.
        self.fail.warn(f"hit policy {policy!r} of pool {pool.name!r} unsupported", "a miss")
        return 0, set()

    def batch_get_v2(
        self,
        transfers: List[PoolTransfer],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> dict:
        """Each transfer's pages from its pool's namespace into the pool's
        host pages (zero copy, as ``batch_get_v1``): per pool name, one
        bool per key, False for a page that did not load (absent,
        corrupt, daemon gone), never an exception."""
        out: dict = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if not keys:
                out[transfer.name] = []
                continue
            self.counters.add("pool_loads")
            try:
                pool = self._pool(transfer.name)
                bufs = pool.buffers(len(keys), transfer.host_indices, load=True)
                res = self.client.onboard_into(pool.ns, [page_key(k) for k in keys], bufs)
            except Exception as e:
                self.counters.add("pool_load_failures", len(keys))
                self.fail.error(f"batch_get_v2 {_pool_name(transfer.name)}", e)
                out[transfer.name] = [False] * len(keys)
                continue
            ok = []
            for r in res:
                ok.append(bool(r.ok))
                if r.ok:
                    self.counters.add("pool_load_blocks")
                    self.counters.add("pool_load_bytes", r.nbytes)
                else:
                    self.counters.add("pool_load_failures")
                    if r.reason != "absent":
                        self.fail.warn(f"load {r.reason}", r.detail)
            out[transfer.name] = ok
        return out

    def batch_set_v2(
        self,
        transfers: List[PoolTransfer],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> dict:
        """Each transfer's host pages into its pool's namespace. A page's
        parent is the page before it (``extra_info.prefix_keys``' last, as
        SGLang groups them so that prefix_keys + keys is one chain); a
        page whose parent this pool does not hold (a trailing window's
        first page) is stored as the start of a chain of its own. An MLA
        model's replicated pools are stored by the storage writer only."""
        out: dict = {}
        prefix = extra_info.prefix_keys if extra_info is not None else None
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if not keys:
                out[transfer.name] = []
                continue
            try:
                pool = self._pool(transfer.name)
                if not pool.sharded and not self.writer:
                    out[transfer.name] = [True] * len(keys)  # another rank stores it
                    continue
                self.counters.add("pool_stores")
                bufs = pool.buffers(len(keys), transfer.host_indices, load=False)
                ks = [page_key(k) for k in keys]
                hints = self._hints(ks, extra_info)
                parent = page_key(prefix[-1]) if prefix else None
                res = offload_grouped(self.client, pool.ns, ks, bufs, hints, parent)
                if parent is not None and res and res[0].reason == "absent":
                    self.counters.add("pool_store_parent_absent")
                    res = offload_grouped(self.client, pool.ns, ks, bufs, hints)
            except Exception as e:
                self.counters.add("pool_store_failures", len(keys))
                self.fail.error(f"batch_set_v2 {_pool_name(transfer.name)}", e)
                out[transfer.name] = [False] * len(keys)
                continue
            ok = []
            for k, r in zip(ks, res):
                good = r.status in ("stored", "stored_unpinned", "already_present")
                ok.append(good)
                if r.status in ("stored", "stored_unpinned"):
                    self._remember(k, pool.name)
                    self.counters.add("pool_store_blocks")
                    self.counters.add("pool_store_bytes", pool.ns.block_bytes)
                elif not good:
                    self.counters.add("pool_store_failures")
                    self.fail.warn(f"store {r.reason}", r.detail)
            out[transfer.name] = ok
        return out

    # -- the generic (copying) interface, for callers without interface_v1 --

    def _tensor_bytes(self, t: torch.Tensor) -> np.ndarray:
        return t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy()

    def get(
        self,
        key: str,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> torch.Tensor | None:
        if self.ns is None or target_location is None:
            return None
        try:
            dst = target_location.view(torch.uint8).reshape(-1)
            res = self.client.onboard_into(self.ns, [page_key(key)], [dst.numpy()])
        except Exception as e:
            self.fail.error("get", e)
            return None
        return target_location if res[0].ok else None

    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> List[torch.Tensor | None] | int:
        """One onboard for the batch (the daemon reads its blocks
        together), not one per key."""
        locs = list(target_locations or [None] * len(keys))
        out: List[torch.Tensor | None] = [None] * len(keys)
        want = [i for i, loc in enumerate(locs) if loc is not None]
        if self.ns is None or not want:
            return out
        try:
            res = self.client.onboard_into(
                self.ns,
                [page_key(keys[i]) for i in want],
                [locs[i].view(torch.uint8).reshape(-1).numpy() for i in want],
            )
        except Exception as e:
            self.fail.error("batch_get", e)
            return out
        for i, r in zip(want, res):
            if r.ok:
                out[i] = locs[i]
        return out

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        if self.ns is None or value is None:
            return False
        if not self.writer:
            return True
        try:
            res = self.client.offload(self.ns, [page_key(key)], [self._tensor_bytes(value)])
        except Exception as e:
            self.fail.error("set", e)
            return False
        return res[0].status in ("stored", "stored_unpinned", "already_present")

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        vals = values or [None] * len(keys)
        return all([self.set(k, v) for k, v in zip(keys, vals)])


def _pool_name(name) -> str:
    """SGLang's pool name (a ``PoolName``, a str enum, or its value)."""
    return str(getattr(name, "value", name))


def _policy(policy) -> str:
    return str(getattr(policy, "value", policy))


def _page_buffers(host_pool, n: int, host_indices, page_size: int, per: int) -> list:
    """The raw (ptr, nbytes) segments of ``n`` pages of ``host_pool`` at
    ``host_indices`` (``page_size`` slots a page, ``per`` segments a page),
    each page's adjacent segments merged."""
    if host_indices is None or len(host_indices) != n * page_size:
        got = "no" if host_indices is None else len(host_indices)
        raise KvtierConfigError(f"{got} host indices for {n} pages of {page_size} slots")
    ptrs, sizes = host_pool.get_page_buffer_meta(host_indices)
    if len(ptrs) != n * per:
        raise KvtierConfigError(
            f"the host pool gave {len(ptrs)} buffers for {n} pages, expected {n * per}"
        )
    bufs = []
    for i in range(n):
        segs = coalesce([(int(ptrs[j]), int(sizes[j])) for j in range(i * per, (i + 1) * per)])
        bufs.append(segs[0] if len(segs) == 1 else segs)
    return bufs


class _ExtraPool:
    """One of a hybrid model's extra host pools and its kvtier namespace."""

    def __init__(
        self, name: str, host: Any, ns: kvtier.Namespace, page_size: int,
        segments_per_page: int, sharded: bool, pad_bytes: int,
    ):
        self.name = name
        self.host = host
        self.ns = ns
        self.page_size = page_size  # the pool's slots a page (Mamba: 1)
        self.segments_per_page = segments_per_page
        self.sharded = sharded  # stored per TP rank (else one copy, the storage writer's)
        # A page's tail up to kvtier's block alignment: zeros stored after
        # each page; on load read into scratch that nothing reads.
        self.pad_bytes = pad_bytes
        self._pad_zeros = np.zeros(max(pad_bytes, 1), dtype=np.uint8)
        self._pad_scratch = np.zeros(max(pad_bytes, 1), dtype=np.uint8)

    def buffers(self, n: int, host_indices, load: bool) -> list:
        bufs = _page_buffers(self.host, n, host_indices, self.page_size, self.segments_per_page)
        if not self.pad_bytes:
            return bufs
        pad = (int((self._pad_scratch if load else self._pad_zeros).ctypes.data), self.pad_bytes)
        return [(list(b) if isinstance(b, list) else [b]) + [pad] for b in bufs]
