"""kvtier as a secondary tier of vLLM 0.33's own tiered offloading.

vLLM's ``OffloadingConnector`` with ``spec_name: TieringOffloadingSpec``
keeps a CPU primary tier and ordered secondary tiers; an out-of-tree tier
is loaded by class name and module path (no fork)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KvtierTierManager",
          "module_path": "kvtier.integrations.vllm_tier",
          "socket": "/run/kvtier/kvtierd.sock"}]}}'

Behind vLLM's CPU tier: a chunk vLLM writes to its CPU tier is cascaded
here (``submit_store``), and a chunk found here is promoted into a CPU slot
(``submit_load``) before vLLM copies it to the GPU. One kvtier block is one
primary-tier chunk (every rank's pages of it, as vLLM's CPU tier lays it
out), named by vLLM's ``OffloadKey`` (``hash_mode="opaque"``).

- ``lookup`` never blocks the scheduler: the keys a step asks are sent to
  kvtierd in one lookup per request from a background thread (vLLM's own
  ``AsyncLookupManager``, as the ``fs`` tier does), ``RETRY`` meanwhile.
- Stores and loads run on their own threads, each with its own
  connection: a store reads the chunk where it lies in vLLM's CPU buffer,
  a load is copied into the CPU slot from the connection's shared region,
  or, for chunks above kvtierd's default ``g3.slot_max`` (4 MiB, which
  have files of their own), read by this process over the file
  descriptors kvtierd passes straight into the slot (``direct_read``;
  every byte verified either way).
- Each chunk is stored under the chunk before it in its request
  (``ReqContext``'s key positions), so a chat's later turns continue its
  earlier ones and kvtier evicts it from its end. A parent kvtierd holds
  nowhere (its store failed or was dropped) makes the store a chain of
  its own.
- A load reports per chunk (``JobResult.successful_keys``): a corrupt or
  absent chunk, a daemon gone, a deadline passed fail only those chunks;
  vLLM recomputes them and keeps the others. A failed chunk is a miss for
  the rest of its request (no retried promotion).
- Fail open: a dead daemon is a miss on lookup and a failed store job
  (vLLM's back-pressure detector sees it); never an exception into vLLM.

Tier settings (beside ``type`` and ``module_path``): ``socket`` (default
$KVTIER_SOCKET), ``timeout_ms`` (2000), ``region_bytes``, ``direct_read``
(unset: true for chunks above 4 MiB), ``model`` (default the served model), ``tenant_salt`` (""),
``priority`` / ``pinned`` / ``ephemeral`` / ``expected_reuse`` (the
deployment's hints), ``locality`` ("LOCAL"), ``enable_kv_events`` (false:
stored chunks as vLLM's own ``STORAGE`` events), ``io_threads`` (4: load
and store threads each, a connection each; a request's stores stay on one
thread, in order), and vLLM's ``backpressure``. Per request, ``kv_transfer_params`` entries
``kvtier_priority`` etc. override the hints.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

import kvtier

from ._common import (
    BlockHints,
    G3_SLOT_MAX_DEFAULT_BYTES,
    Counters,
    FailOpen,
    KvtierConfigError,
    base_hints,
    connector_keys,
    describe,
    make_client,
    offload_grouped,
    parse_hints,
)
from .vllm import KvtierOffloadingManager, namespace_model

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("kvtier.vllm_tier")

# This tier's own counters as vLLM metrics (beside the tiering manager's
# read/write bytes and times, job failures and lookup hits per tier, which
# it computes from what this tier reports): name -> (counter, help).
TIER_STATS = {
    "vllm:kv_offload_kvtier_tier_load_failed_chunks": (
        "load_failed_chunks", "Chunks a kvtier tier load did not bring (corrupt, absent, daemon gone, deadline): "
        "vLLM recomputes them."),
    "vllm:kv_offload_kvtier_tier_store_failed_chunks": (
        "store_failed_chunks", "Chunks a kvtier tier store did not store (no space, daemon gone, deadline)."),
    "vllm:kv_offload_kvtier_tier_store_parent_absent": (
        "store_parent_absent", "Store jobs whose first chunk's parent kvtierd held nowhere (stored as a chain of "
        "its own)."),
}


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup state machine over one kvtierd lookup per
    request per step (the keys come in chain order: the prefix kvtierd
    holds is the hits)."""

    def __init__(self, tier: "KvtierTierManager", tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        tier = self._tier
        got = tier.lookup_client.lookup(tier.ns, connector_keys(keys))
        n = got.prefix_len
        if got.reason not in (None, "absent"):
            tier.fail.warn(f"lookup {got.reason}", got.detail)
        return [i < n for i in range(len(keys))]


class _RequestHints:
    __slots__ = ("hints",)

    def __init__(self, hints: BlockHints) -> None:
        self.hints = hints


class KvtierTierManager(SecondaryTierManager):
    """vLLM ``SecondaryTierManager`` whose chunks live in kvtierd (NVMe + S3,
    shared by every engine on the node, kept across restarts)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    # The chain-key helpers of the scheduler-side manager (the request's
    # chunk keys from vLLM's key positions, each chunk's parent): the same
    # functions over the same attributes (chunk_tokens, chain_groups,
    # _chunk_suffix).
    _request_keys = KvtierOffloadingManager._request_keys
    _store_parent = KvtierOffloadingManager._store_parent

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Optional["BackpressureDetector"] = None,
        socket: Optional[str] = None,
        timeout_ms: int = 2000,
        region_bytes: Optional[int] = None,
        direct_read: Optional[bool] = None,
        model: Optional[str] = None,
        tenant_salt: str = "",
        priority: int = 0,
        pinned: bool = False,
        ephemeral: bool = False,
        expected_reuse: int = 0,
        locality: Optional[str] = "LOCAL",
        enable_kv_events: bool = False,
        io_threads: int = 4,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        settings: dict[str, Any] = {
            "kvtier_socket": socket,
            "kvtier_timeout_ms": timeout_ms,
            "kvtier_tenant_salt": tenant_salt,
            "kvtier_priority": priority,
            "kvtier_pinned": pinned,
            "kvtier_ephemeral": ephemeral,
            "kvtier_expected_reuse": expected_reuse,
        }
        if region_bytes is not None:
            settings["kvtier_region_bytes"] = region_bytes
        if model is not None:
            settings["kvtier_model"] = model
        self.counters = Counters()
        self.fail = FailOpen("vllm tier", self.counters)
        self.hints = base_hints(settings)
        nbytes = self.block_size_bytes
        if not 0 < nbytes <= kvtier.BLOCK_BYTES_MAX:
            raise KvtierConfigError(
                f"a primary-tier chunk is {nbytes} bytes, outside kvtier's 1..={kvtier.BLOCK_BYTES_MAX}: "
                "lower block_size (tokens per offloaded chunk)"
            )
        config = offloading_spec.config
        salt = settings["kvtier_tenant_salt"]
        # One block is one CPU-tier chunk: every rank's pages (and vLLM's
        # alignment padding) in one payload, so no rank in the namespace;
        # "/tier" keeps it apart from KvtierConnector's per-rank chunks.
        self.ns = kvtier.Namespace(
            namespace_model(config, settings) + "/tier",
            kvtier.Layout.with_block_bytes(nbytes),
            "",
            salt.encode() if isinstance(salt, str) else bytes(salt),
            hash_mode="opaque",
        )
        if direct_read is None:
            # A block up to kvtierd's g3.slot_max lives in a shared slab:
            # by fd kvtierd hands out a sealed copy it made and verified
            # (no fd into a shared file), a copy and a check more than the
            # shared region costs (bench_vllm_tier, 2 MiB chunks: load
            # 0.73x of vLLM's fs tier by fd, 1.15x through the region).
            direct_read = nbytes > G3_SLOT_MAX_DEFAULT_BYTES
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or not 1 <= io_threads <= 64:
            raise KvtierConfigError(f"io_threads must be 1..=64, got {io_threads!r}")
        # Lookups on their own connection; loads and stores on io_threads
        # threads each, every thread with its own connection (a store in
        # flight never delays a load or the next step's lookups, and jobs
        # of several requests move together).
        self.lookup_client = make_client(settings)
        self.load_clients = [
            make_client({**settings, "kvtier_direct_read": bool(direct_read)}) for _ in range(io_threads)
        ]
        self.store_clients = [make_client(settings) for _ in range(io_threads)]
        describe(self.lookup_client, [self.ns], "vllm-tier", self.fail)
        # Chain keys (see _request_keys): tokens per chunk of each KV group.
        bpc = offloading_spec.blocks_per_chunk
        self.chunk_tokens = {g.group_id: g.tokens_per_block * bpc for g in config.groups}
        self.chain_groups = {
            g.group_id for g in config.groups if getattr(g, "sliding_window_size_in_chunks", None) is None
        }
        self._chunk_suffix = {
            g.to_bytes(4, "big", signed=False): (g, t) for g, t in self.chunk_tokens.items() if t > 0
        }
        self._flat = primary_kv_view.cast("B")

        self.events: Optional[list[OffloadingEvent]] = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                log.warning(
                    "kvtier tier %s: enable_kv_events is set but vLLM's KV cache events are off; "
                    "no events are published", tier_type,
                )
        self._loaders = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvtier-tier-load{i}") for i in range(io_threads)
        ]
        self._storers = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvtier-tier-store{i}") for i in range(io_threads)
        ]
        self._next_loader = 0
        # Finished jobs, from the I/O threads: (job id, is load, keys,
        # per-key ok, seconds, bytes moved).
        self._done: "queue.SimpleQueue[tuple[JobId, bool, list[OffloadKey], list[bool], float, int]]" = (
            queue.SimpleQueue()
        )
        self._futures: dict[JobId, Future] = {}
        self._futures_lock = threading.Lock()
        self._stats_sent: dict[str, int] = {}
        self._lookups = _Lookups(self, tier_type)

    # -- scheduler-thread API -------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        hints = self.hints
        params = req_context.kv_transfer_params
        if params:
            try:
                hints, _ = parse_hints(params, "kvtier_", self.hints)
            except ValueError as e:
                self.counters.add("hint_errors")
                self.fail.warn("bad request hint", e)
        req_context.set_state(_RequestHints(hints))
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # kvtierd's recency is what it serves (an onboard is a use); a
        # chunk vLLM's CPU tier answers is not read from kvtier, and a
        # round trip per touch would cost the scheduler for nothing.
        return

    def _views(self, chunk_ids) -> list[memoryview]:
        bs = self.block_size_bytes
        flat = self._flat
        return [flat[int(c) * bs : (int(c) + 1) * bs] for c in chunk_ids]

    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        try:
            ctx = job_metadata.req_context
            rh = ctx.get_state(_RequestHints)
            hints = [rh.hints if rh is not None else self.hints] * len(keys)
            bufs = self._views(job_metadata.chunk_ids)
            # A job's chunks come in no particular order (the tiering
            # manager collects them in a set): stored in chain order, per
            # KV group, so each one's parent is stored before it and a job
            # of consecutive chunks is one offload.
            unknown = 1 << 62
            order = sorted(
                range(len(keys)),
                key=lambda i: (get_offload_group_idx(keys[i]), ctx.get_offload_key_position(keys[i]) or unknown),
            )
            keys = [keys[i] for i in order]
            bufs = [bufs[i] for i in order]
            parents = [self._store_parent(k, ctx) for k in keys]
        except Exception as e:
            self.fail.error("submit_store", e)
            self._done.put((job_id, False, keys, [False] * len(keys), 0.0, 0))
            return
        # A request's store jobs on one thread, in order: a job's first
        # chunk continues the job before it.
        i = hash(ctx.req_id) % len(self._storers)
        client = self.store_clients[i]
        self._submit(self._storers[i], job_id, lambda: self._store(client, job_id, keys, bufs, hints, parents))

    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        try:
            bufs = self._views(job_metadata.chunk_ids)
        except Exception as e:
            self.fail.error("submit_load", e)
            self._done.put((job_id, True, keys, [False] * len(keys), 0.0, 0))
            return
        i = self._next_loader = (self._next_loader + 1) % len(self._loaders)
        client = self.load_clients[i]
        self._submit(self._loaders[i], job_id, lambda: self._load(client, job_id, keys, bufs))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while True:
            try:
                job_id, is_load, keys, ok, took, moved = self._done.get_nowait()
            except queue.Empty:
                break
            with self._futures_lock:
                self._futures.pop(job_id, None)
            success = all(ok)
            result = JobResult(job_id=job_id, success=success, transfer_time=took, transfer_bytes=moved)
            if is_load:
                if not success:
                    good = [k for k, o in zip(keys, ok) if o]
                    result.successful_keys = tuple(good) if good else None
                    # A chunk that failed to load is a miss for the rest of
                    # its request: vLLM recomputes it instead of promoting
                    # it again (vLLM's failed-load livelock).
                    self._lookups.mark_miss([k for k, o in zip(keys, ok) if not o])
            elif self.events is not None:
                stored = [k for k, o in zip(keys, ok) if o]
                if stored:
                    self.events.append(
                        OffloadingEvent(keys=stored, medium=self.medium, removed=False, locality=self.locality)
                    )
            out.append(result)
        return out

    def has_pending_work(self) -> bool:
        with self._futures_lock:
            return bool(self._futures)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    def drain_jobs(self) -> None:
        with self._futures_lock:
            pending = list(self._futures.values())
        wait(pending)

    def shutdown(self) -> None:
        self._lookups.shutdown()
        for pool in self._loaders + self._storers:
            pool.shutdown(wait=True)
        for c in [self.lookup_client, *self.load_clients, *self.store_clients]:
            c.close()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict:
        return {name: OffloadingCounterMetadata(documentation=doc) for name, (_, doc) in TIER_STATS.items()}

    def get_stats(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        snap = self.counters.snapshot()
        stats = OffloadingConnectorStats()
        for name, (counter, _) in TIER_STATS.items():
            d = snap.get(counter, 0) - self._stats_sent.get(counter, 0)
            if d > 0:
                stats.increase_counter(name, d)
        self._stats_sent = snap
        return None if stats.is_empty() else stats

    # -- I/O threads ----------------------------------------------------

    def _submit(self, pool: ThreadPoolExecutor, job_id: JobId, fn) -> None:
        with self._futures_lock:
            self._futures[job_id] = pool.submit(fn)

    def _load(self, client: kvtier.Client, job_id: JobId, keys: list[OffloadKey], bufs: list[memoryview]) -> None:
        t0 = time.perf_counter()
        ok = [False] * len(keys)
        try:
            res = client.onboard_into(self.ns, connector_keys(keys), bufs)
            ok = [bool(r) for r in res]
            for r in res:
                if not r:
                    self.counters.add(f"load_failed_{r.reason}")
                    self.fail.warn(f"load {r.reason}", r.detail)
        except Exception as e:
            self.fail.error("load", e)
        n = sum(ok)
        self.counters.add_many({"load_chunks": len(keys), "load_failed_chunks": len(keys) - n})
        self._done.put((job_id, True, keys, ok, time.perf_counter() - t0, n * self.block_size_bytes))

    def _store(
        self,
        client: kvtier.Client,
        job_id: JobId,
        keys: list[OffloadKey],
        bufs: list[memoryview],
        hints: list[BlockHints],
        parents: list[Optional[bytes]],
    ) -> None:
        t0 = time.perf_counter()
        ok = [False] * len(keys)
        try:
            kvkeys = connector_keys(keys)
            res = offload_grouped(client, self.ns, kvkeys, bufs, hints, parents=parents)
            if parents[0] is not None and res and res[0].reason == "absent":
                # kvtierd holds the parent nowhere (its store failed, was
                # dropped under back-pressure, or was evicted): a chain of
                # its own, as a lookup from this chunk finds it.
                self.counters.add("store_parent_absent")
                res = offload_grouped(client, self.ns, kvkeys, bufs, hints)
            ok = [r.status in ("stored", "stored_unpinned", "already_present") for r in res]
            for r, o in zip(res, ok):
                if not o:
                    self.counters.add(f"store_failed_{r.reason}")
                    self.fail.warn(f"store {r.reason}", r.detail)
        except Exception as e:
            self.fail.error("store", e)
        n = sum(ok)
        self.counters.add_many({"store_chunks": n, "store_failed_chunks": len(keys) - n})
        self._done.put((job_id, False, keys, ok, time.perf_counter() - t0, n * self.block_size_bytes))
