"""kvtier as a vLLM KV offloading backend (vLLM 0.33.0, ``vllm.v1.kv_offload``).

Load it by module path from vLLM's OffloadingConnector::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm",
        "kvtier_socket": "/run/kvtier/kvtierd.sock"}}'

vLLM's ``OffloadingSpecFactory`` imports ``spec_module_path`` and builds
``spec_name(config)``; the scheduler uses :class:`KvtierOffloadingManager`
and each worker a :class:`KvtierOffloadingWorker`.

Keys: vLLM's ``OffloadKey`` (block hash + KV-cache group index) is the kvtier
key as is (``hash_mode="opaque"``). The namespace is built from the model
name, vLLM's KV layout (dtype, cache layout, tokens per block, blocks per
chunk, TP/PP sizes) and the worker's rank (``Namespace(rank=...)``, a TLV
extension: it never changes other namespaces' identity nor the tenant salt).
MLA at TP > 1 (vLLM's ``replicated_layout``: every rank holds the same
latent KV) is stored once: one namespace without rank or TP size, written
by rank 0 only (vLLM's own store-writer rule) and read by every rank, so
a deployment at another TP size finds the same blocks.
One kvtier block is one offload chunk of one worker: ``blocks_per_chunk``
GPU blocks of ``worker_kv_bytes_per_block`` bytes each, every tensor's page
of a GPU block back to back (zero padded when a KV group's pages are
smaller than that, as for hybrid models).

Fail open: the manager never raises; a dead daemon is a MISS on lookup and
``None`` (cannot store) on prepare_store. Stores that fail are counted and
dropped (the blocks are simply not cached). A load that fails after a HIT
(a corrupt block, the daemon died between lookup and load) cannot be told
to vLLM through the OffloadingSpec interface: 0.33's OffloadingConnector
asserts ``transfer_result.success`` and the engine dies. Load the
connector this module ships instead, :class:`KvtierConnector` (vLLM's
OffloadingConnector with this spec, plus load-error reporting)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
      "kv_connector_module_path": "kvtier.integrations.vllm",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"kvtier_socket": "/run/kvtier/kvtierd.sock"}}'

A failed load is then reported through vLLM's own failure interface
(``get_block_ids_with_load_errors``; ``failed_recving`` for models with
several KV cache groups) and the scheduler recomputes those blocks. Under
the plain OffloadingConnector a failed load still fails the transfer
(never reported as loaded: the engine stops rather than compute on wrong
KV). The manager pins blocks from prepare_load to complete_load so
eviction cannot cause a failed load.

Hints (docs/OPERATIONS.md, "Engines"): vLLM 0.33 hands the offloading
manager a ``ReqContext`` with the request id, its ``kv_transfer_params``
and the orchestrator's ``kv_hints`` envelope, not the request's
``priority`` nor its prompt length. Per request, ``kv_transfer_params``
entries ``kvtier_priority`` / ``kvtier_pinned`` / ``kvtier_ephemeral`` /
``kvtier_expected_reuse`` / ``kvtier_ephemeral_from_token`` (chunks ending
past that token, e.g. the prompt length: decode and reasoning tokens, are
ephemeral), or a ``kv_hints`` action of type ``kvtier.hints`` with the
same names without the prefix, override the deployment's ``kvtier_*``
defaults. A chunk that *k* > 1 requests needed before one stored it (a
shared system prompt) gets ``expected_reuse`` *k* - 1: a request needs
its prompt's every chunk, those it looks up and those before them that
vLLM's GPU prefix cache gave it (requests arriving together take the
first one's blocks there and never miss on them in kvtier).

Prefetch: when the scheduler's lookup finds a chunk on a peer or G4 (not
G3), the manager asks kvtierd to prefetch it and answers ``HIT_PENDING``;
vLLM defers the request and looks again, and the chunk is a HIT once on
G3 (or when the prefetch's deadline passes: then it loads from where it
is). Bounded and fail open (``_common.Prefetcher``).
"""

from __future__ import annotations

import bisect
import logging
import operator
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import Any, Optional

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    Locality,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
    get_offload_group_idx,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.config import OffloadingConfig

import kvtier

from ._common import (
    G3_SLOT_MAX_DEFAULT_BYTES,
    BlockHints,
    Counters,
    FailOpen,
    KvtierConfigError,
    Prefetcher,
    ReuseTracker,
    base_hints,
    coalesce,
    connector_key,
    connector_keys,
    describe,
    make_client,
    offload_grouped,
    parse_hints,
    setting,
    tenant_salt,
)

# How long a block stays pinned between prepare_load and complete_load at
# most (a crashed engine's pins expire by themselves).
LOAD_PIN_TTL_MS = 120_000
# Pin and unpin calls queued for the pinning thread at most.
PIN_QUEUE_MAX = 1024

VLLM_VERSION = "0.33.0"

# The kv_hints action this connector reads (payload: priority, pinned,
# ephemeral, expected_reuse, ephemeral_from_token).
KV_HINTS_ACTION = "kvtier.hints"


log = logging.getLogger("kvtier.vllm")

# kvtier's scheduler-side counters as vLLM's own connector metrics: metric
# name -> (Counters name, help). vLLM's Prometheus logger exports them as
# counters (``..._total``) beside its ``vllm:kv_offload_load_bytes`` etc.,
# which KvtierOffloadingWorker's transfer sizes and times feed.
MANAGER_STATS = {
    "vllm:kv_offload_kvtier_lookups": ("lookups", "Offload keys the scheduler looked up in kvtier."),
    "vllm:kv_offload_kvtier_lookup_hits": ("lookup_hits", "kvtier lookups that found the key on every rank."),
    "vllm:kv_offload_kvtier_lookup_misses": (
        "lookup_misses", "kvtier lookups that missed (absent, or the daemon unavailable)."),
    "vllm:kv_offload_kvtier_lookup_pending": (
        "lookup_pending", "kvtier lookups answered HIT_PENDING while the key is prefetched to G3."),
    "vllm:kv_offload_kvtier_prefetch_blocks": ("prefetch_blocks", "Keys kvtier was asked to prefetch."),
    "vllm:kv_offload_kvtier_errors": ("errors", "Scheduler-side kvtier errors the connector failed open on."),
}


class LoadErrors:
    """Loads that failed after a HIT, kept for :class:`KvtierConnector` to
    report to vLLM's scheduler: the GPU block ids (single KV group) and
    the job ids (mapped to requests for several groups). Written by the
    worker's transfer thread, taken by the engine's step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._block_ids: set[int] = set()
        self._job_ids: set[int] = set()

    def add(self, job_id: int, block_ids: Iterable[int]) -> None:
        with self._lock:
            self._job_ids.add(job_id)
            self._block_ids.update(block_ids)

    def take_block_ids(self) -> set[int]:
        with self._lock:
            out, self._block_ids = self._block_ids, set()
            return out

    def take_job_ids(self) -> set[int]:
        with self._lock:
            out, self._job_ids = self._job_ids, set()
            return out


class KvtierLoadStoreSpec(LoadStoreSpec):
    """Where offloaded chunks live in kvtier: their keys, in the order the
    scheduler pairs them with GPU blocks (by KV group, then chunk order)."""

    def __init__(
        self,
        keys: list[OffloadKey],
        hints: Optional[list[BlockHints]] = None,
        parents: Optional[list[Optional[bytes]]] = None,
    ):
        self.keys = keys
        # Per key, for stores: what the scheduler knew of its request.
        self.hints = hints
        # Per key, for stores: the kvtier key of the chunk before it in its
        # request's chain (None: the chain's first chunk, or not known).
        self.parents = parents

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.keys)} keys)"


def _group_order(keys: Iterable[OffloadKey]) -> list[OffloadKey]:
    # The scheduler lists GPU blocks group by group; keep each group's chunk
    # order (a stable sort by group index).
    return sorted(keys, key=get_offload_group_idx)


def namespace_model(config: OffloadingConfig, extra: Any) -> str:
    """The namespace's model string: the model and vLLM's KV layout, so two
    deployments share blocks exactly when their bytes are interchangeable."""
    model = setting(extra, "model", config.model.name)
    groups = ",".join(str(g.tokens_per_block) for g in config.groups)
    p = config.parallel
    # MLA at TP > 1 (vLLM's replicated_layout): every rank's bytes are the
    # same and do not depend on the TP size: one copy, shared by any TP.
    tp = "replicated" if config.replicated_layout else str(p.tp_size)
    return (
        f"{model}#vllm/{config.model.dtype}/{config.kv_cache_layout or 'default'}"
        f"/canonical={int(config.canonical_layout)}/tpb={groups}"
        f"/bpc={config.cache.blocks_per_chunk}/tp={tp}/pp={p.pp_size}"
        f"/pcp={p.pcp_size}/dcp={p.dcp_size}"
    )


class KvtierOffloadingSpec(OffloadingSpec):
    """vLLM ``OffloadingSpec`` whose blocks live in kvtierd (NVMe + S3).

    ``kv_connector_extra_config`` keys: ``kvtier_socket`` (default
    $KVTIER_SOCKET), ``kvtier_timeout_ms`` (2000), ``kvtier_model`` (default
    the served model), ``kvtier_tenant_salt`` (""); default hints
    ``kvtier_priority`` (0), ``kvtier_pinned``, ``kvtier_ephemeral``,
    ``kvtier_expected_reuse`` (0); prefetch ``kvtier_prefetch`` (true),
    ``kvtier_prefetch_deadline_ms`` (10000), ``kvtier_prefetch_inflight_max``
    (4096)."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.chunk_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        if self.chunk_bytes <= 0:
            raise KvtierConfigError(
                "vLLM reported worker_kv_bytes_per_block=0 (no KV cache tensors): "
                "kvtier needs a KV cache with a known size per block"
            )
        if self.chunk_bytes > kvtier.BLOCK_BYTES_MAX:
            raise KvtierConfigError(
                f"an offload chunk is {self.chunk_bytes} bytes, over kvtier's "
                f"{kvtier.BLOCK_BYTES_MAX}: lower blocks_per_chunk"
            )
        self.counters = Counters()
        self.fail = FailOpen("vllm", self.counters)
        self.hints = base_hints(self.extra_config)
        layout = kvtier.Layout.with_block_bytes(self.chunk_bytes)
        model = namespace_model(config, self.extra_config)
        salt = tenant_salt(self.extra_config)
        # MLA at TP > 1: vLLM's OffloadingConnectorWorker stores from rank
        # 0 only when the spec says the layout is replicated; every rank
        # loads that one copy, and a lookup asks one namespace.
        self.replicated_layout = bool(config.replicated_layout)
        if self.replicated_layout:
            self.namespaces = [kvtier.Namespace(model, layout, "", salt, hash_mode="opaque")]
        else:
            self.namespaces = [
                kvtier.Namespace(model, layout, "", salt, hash_mode="opaque", rank=r)
                for r in range(max(1, config.parallel.world_size))
            ]
        self._manager: Optional[KvtierOffloadingManager] = None
        self._worker: Optional[KvtierOffloadingWorker] = None
        # Set by KvtierConnector, which reports failed loads to vLLM; None
        # under the plain OffloadingConnector (a failed load fails its job).
        self.load_errors: Optional[LoadErrors] = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            client = make_client(self.extra_config)
            describe(client, self.namespaces, "vllm", self.fail)
            self._manager = KvtierOffloadingManager(
                client,
                self.namespaces,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                counters=self.counters,
                fail=self.fail,
                hints=self.hints,
                prefetcher=Prefetcher(client, self.counters, self.fail, self.extra_config),
                chunk_tokens={
                    g.group_id: g.tokens_per_block * self.blocks_per_chunk for g in self.config.groups
                },
                pin_client=make_client(self.extra_config),
                chain_groups={
                    g.group_id for g in self.config.groups
                    if getattr(g, "sliding_window_size_in_chunks", None) is None
                },
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(
                kv_caches,
                # Host buffers are read over passed fds by default for
                # chunks above kvtierd's default slot_max (each block from
                # its own file straight into vLLM's buffer); smaller chunks
                # live in shared slabs, which kvtierd passes as a sealed
                # copy, so they come through the shared region (the
                # 32K-token / TP 8 read: 0.78-0.96 s through the region,
                # 1.27 s by fd; BENCHMARKS.md vllm_scheduler). CUDA buffers
                # take the GPU path either way.
                client=make_client({
                    "kvtier_direct_read": self.chunk_bytes > G3_SLOT_MAX_DEFAULT_BYTES,
                    **(self.extra_config or {}),
                }),
                ns=self.namespaces[0 if self.replicated_layout else self.config.parallel.rank],
                worker_block_bytes=self.config.worker_kv_bytes_per_block,
                blocks_per_chunk=self.blocks_per_chunk,
                counters=self.counters,
                fail=self.fail,
                load_errors=self.load_errors,
            )
        return self._worker

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict:
        """kvtier's scheduler-side counters (:data:`MANAGER_STATS`), which
        :meth:`KvtierOffloadingManager.get_stats` reports, as vLLM metrics."""
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata

        return {name: OffloadingCounterMetadata(documentation=doc) for name, (_, doc) in MANAGER_STATS.items()}


class _RequestHints:
    """One request's hints, parsed once in on_new_request."""

    __slots__ = ("hints", "ephemeral_from_token")

    def __init__(self, hints: BlockHints, ephemeral_from_token: Optional[int]) -> None:
        self.hints = hints
        self.ephemeral_from_token = ephemeral_from_token


class _ScheduleRegion:
    """The manager's ``lock`` (vLLM enters it around each scheduler step,
    and around each hook outside one): when the outermost region ends, the
    lookup answers cached for that step are dropped, so every scheduling
    pass asks kvtierd afresh and a HIT stays valid until the step's
    prepare_load, and the lookups the step counted reach the counters.
    The manager is entered from the scheduler thread only, so no mutex is
    needed."""

    def __init__(self, on_release) -> None:
        self.depth = 0
        self._on_release = on_release

    def __enter__(self) -> "_ScheduleRegion":
        self.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self.depth -= 1
        if self.depth <= 0:
            self.depth = 0
            self._on_release()


class _RequestKeys:
    """One request's chunk keys, per KV group in chain order, and each as
    a kvtier key (``connector_key``), kept in the request's ``ReqContext``
    state: built from vLLM's key positions when the request is first
    looked up and extended with the keys vLLM adds, so a scheduling pass,
    the load's pins and its unpins convert no key twice."""

    __slots__ = ("npos", "chains", "kvkeys", "ends", "noted")

    def __init__(self) -> None:
        # How many of the context's key positions are folded in (vLLM only
        # adds positions: a new key goes to the end of the dict).
        self.npos = 0
        # KV group -> its chunk keys in chain order, their kvtier keys and
        # their end tokens.
        self.chains: dict[int, list[OffloadKey]] = {}
        self.kvkeys: dict[int, list[bytes]] = {}
        self.ends: dict[int, list[int]] = {}
        # KV groups whose chunks the reuse tracker was told this request
        # needs (at its first lookup).
        self.noted: set[int] = set()


class _PinnedLoad:
    """A request's load pinned by prepare_load (vLLM runs one load per
    request at a time): its keys and their kvtier keys, which its
    complete_load unpins without converting them again."""

    __slots__ = ("keys", "kvkeys")

    def __init__(self, keys: Optional[list[OffloadKey]], kvkeys: Optional[list[bytes]]) -> None:
        self.keys = keys
        self.kvkeys = kvkeys


class _PromptAnswers:
    """What one batched lookup learned of a request's chunk keys: a key of
    the looked-up chains is a HIT, HIT_PENDING or MISS; a key past the
    first miss (or not in them) is not known and is asked on its own."""

    __slots__ = ("known", "asked", "expires")

    def __init__(self) -> None:
        self.known: dict[OffloadKey, LookupResult] = {}
        # Every key a batched request covered (known or past its miss).
        self.asked: set[OffloadKey] = set()
        self.expires = _monotonic() + ANSWERS_TTL_S


_monotonic = time.monotonic
# A key's last 4 bytes: vLLM's KV group index (``get_offload_group_idx``).
_last4 = operator.itemgetter(slice(-4, None))
_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_HIT_PENDING = LookupResult.HIT_PENDING

# A request's batched answers are trusted for at most this long even if
# vLLM never released the manager's lock region (belt and braces: 0.33
# releases it at the end of every step), and at most this many requests'
# answers are kept.
ANSWERS_TTL_S = 1.0
ANSWERS_REQUESTS_MAX = 1024


class KvtierOffloadingManager(OffloadingManager):
    """Scheduler side: kvtierd is the index (no local copy of it), so every
    engine on the node, and every restart, sees the same blocks.

    Lookups: vLLM asks one key at a time; the first lookup of a request in
    a scheduling step takes all its chunk keys (from the ``ReqContext``
    the scheduler filled before looking up) and asks kvtierd once, for
    every chunk and every rank (``lookup_many``: one request, whatever
    the tensor-parallel size); the step's other lookups of that request
    are answered from it: a dict look-up each, their counts folded into
    the counters when the step's region ends (vLLM asks a 32K-token
    prompt's 2048 chunks one by one)."""

    def __init__(
        self,
        client: kvtier.Client,
        namespaces: list[kvtier.Namespace],
        enable_events: bool,
        counters: Counters,
        fail: FailOpen,
        hints: Optional[BlockHints] = None,
        prefetcher: Optional[Prefetcher] = None,
        chunk_tokens: Optional[dict[int, int]] = None,
        pin_client: Optional[kvtier.Client] = None,
        chain_groups: Optional[set[int]] = None,
    ) -> None:
        self.client = client
        # KV groups whose chunks are stored under their parent (full
        # attention: a prefix chain). A sliding-window group's early chunks
        # are never stored, so its chunks stay roots (kvtierd refuses a
        # block whose parent it holds nowhere). None: every group.
        self.chain_groups = chain_groups
        # Pins go through their own connection on their own thread.
        self.pin_client = pin_client or client
        self._pinner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-vllm-pin")
        self._pins_lock = threading.Lock()
        self._pins_queued = 0
        self.namespaces = namespaces
        self.enable_events = enable_events
        self.counters = counters
        self.fail = fail
        self.hints = hints or BlockHints()
        self.prefetcher = prefetcher
        # Tokens per offload chunk of each KV group: which of a request's
        # keys are chunk keys (its chain), not partial-tail boundaries.
        self.chunk_tokens = chunk_tokens or {}
        self.reuse = ReuseTracker()
        self._storing: set[OffloadKey] = set()
        self._events: list[OffloadingEvent] = []
        self._answers: "OrderedDict[str, _PromptAnswers]" = OrderedDict()
        # Lookups answered and not yet in the counters: hits, misses,
        # pending (each is also one of ``lookups``).
        self._hits = 0
        self._misses = 0
        self._pending = 0
        # A key's last 4 bytes (its KV group) -> (group, tokens per chunk).
        self._chunk_suffix = {
            g.to_bytes(4, "big", signed=False): (g, t) for g, t in self.chunk_tokens.items() if t > 0
        }
        self._region = _ScheduleRegion(self._end_region)

    @property
    def lock(self) -> _ScheduleRegion:
        return self._region

    def _end_region(self) -> None:
        self._flush_lookup_counts()
        self._answers.clear()

    def _flush_lookup_counts(self) -> None:
        h, m, p = self._hits, self._misses, self._pending
        if h or m or p:
            self._hits = self._misses = self._pending = 0
            self.counters.add_many(
                {"lookups": h + m + p, "lookup_hits": h, "lookup_misses": m, "lookup_pending": p}
            )

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        ans = self._answers.get(req_context.req_id)
        got = ans.known.get(key) if ans is not None else None
        if got is None or _monotonic() > ans.expires:  # type: ignore[union-attr]
            got = self._lookup_slow(key, req_context, ans)
        if got is _HIT:
            self._hits += 1
        elif got is _MISS:
            self._misses += 1
            self.reuse.seen(connector_key(key), req_context.req_id)
        else:
            self._pending += 1
        if self._region.depth == 0:
            # Called outside vLLM's lock region: nothing would fold it in.
            self._flush_lookup_counts()
        return got

    def _lookup_slow(
        self, key: OffloadKey, req_context: ReqContext, ans: Optional[_PromptAnswers]
    ) -> LookupResult:
        """A key the step's answers do not hold: the request's chain from
        it in one request (the pass's first lookup), else on its own."""
        if ans is not None and _monotonic() > ans.expires:
            ans = None
        got = None
        if ans is None or key not in ans.asked:
            ans = self._lookup_prompt(key, req_context, ans)
            got = ans.known.get(key) if ans is not None else None
        if got is None:
            # Asked in a batch but past its first miss (a sliding window
            # scans from the end), or the batch failed: on its own.
            got = self._lookup_one(key, req_context)
        return got

    def _request_keys(self, req_context: ReqContext) -> Optional[_RequestKeys]:
        """The request's :class:`_RequestKeys`, extended with the keys
        vLLM added since (None when the context holds no positions)."""
        positions = getattr(req_context, "_offload_key_positions", None)
        if not positions:
            return None
        rk = req_context.get_state(_RequestKeys)
        if rk is not None and rk.npos == len(positions):
            return rk
        if rk is None or rk.npos > len(positions):
            rk = _RequestKeys()
            req_context.set_state(rk)
        # vLLM adds a chunk's key when its hash is known, in chain order
        # per group; a partial-tail boundary (not a multiple of a chunk)
        # is not a chunk key. Checked, not assumed: a group whose keys
        # came out of order is sorted.
        suffix = self._chunk_suffix
        new_keys = list(islice(positions.keys(), rk.npos, None))
        new_ends = list(islice(positions.values(), rk.npos, None))
        rk.npos = len(positions)
        added: dict[int, tuple[list[int], list[OffloadKey]]] = {}
        if len(suffix) == 1:
            # One KV group (most models): the new keys are the next chunk
            # keys of it, ending 1, 2, 3 ... chunks in, checked without a
            # Python step per key (a 32K-token prompt has 2048).
            ((sfx, (g, tokens)),) = suffix.items()
            first = new_ends[0] if new_ends else 0
            if (
                first % tokens == 0
                and new_ends == list(range(first, first + tokens * len(new_ends), tokens))
                and set(map(_last4, new_keys)) == {sfx}
            ):
                added[g] = (new_ends, new_keys)
        if not added:
            for k, end in zip(new_keys, new_ends):
                gt = suffix.get(k[-4:])
                if gt is not None and end % gt[1] == 0:
                    a = added.get(gt[0])
                    if a is None:
                        a = added[gt[0]] = ([], [])
                    a[0].append(end)
                    a[1].append(k)
        for g, (ends, keys) in added.items():
            old = rk.ends.get(g)
            if old is None:
                old = rk.ends[g] = []
                rk.chains[g] = []
                rk.kvkeys[g] = []
            old.extend(ends)
            rk.chains[g].extend(keys)
            rk.kvkeys[g].extend(connector_keys(keys))
            if (len(old) > len(ends) and old[-len(ends) - 1] >= ends[0]) or ends != sorted(ends):
                order = sorted(range(len(old)), key=old.__getitem__)
                rk.ends[g] = [old[i] for i in order]
                rk.chains[g] = [rk.chains[g][i] for i in order]
                rk.kvkeys[g] = [rk.kvkeys[g][i] for i in order]
        return rk

    def _chain_at(self, key: OffloadKey, req_context: ReqContext) -> tuple[Optional[_RequestKeys], int, int]:
        """(the request's keys, ``key``'s KV group, its index in that
        group's chain); index -1 when ``key`` is not a chunk key (a
        partial-tail boundary) or the context has no positions."""
        rk = self._request_keys(req_context)
        if rk is None:
            return None, 0, -1
        g = get_offload_group_idx(key)
        chain = rk.chains.get(g)
        tokens = self.chunk_tokens.get(g)
        end = req_context.get_offload_key_position(key)
        if not chain or not tokens or end is None or end % tokens != 0:
            return rk, g, -1
        # Chunk keys end at 1, 2, 3 ... chunks: the index from the position,
        # checked (a chain with a gap is searched).
        i = end // tokens - 1
        if not (0 <= i < len(chain) and chain[i] == key):
            try:
                i = chain.index(key)
            except ValueError:
                return rk, g, -1
        return rk, g, i

    def _lookup_prompt(
        self, key: OffloadKey, req_context: ReqContext, ans: Optional[_PromptAnswers]
    ) -> Optional[_PromptAnswers]:
        """One request for the request's chunk keys from ``key`` on (its
        KV group's chain: kvtier answers a chain's cached prefix) in
        every rank's namespace, kept for this scheduling step (added to
        ``ans``, the step's answers so far). None when ``key`` is not a
        chunk key or the lookup failed (then it is asked on its own)."""
        rk, g, i = self._chain_at(key, req_context)
        if rk is None or i < 0:
            return ans
        chain = rk.chains[g][i:]
        if ans is None:
            ans = _PromptAnswers()
        ans.asked.update(chain)
        self._answers[req_context.req_id] = ans
        self._answers.move_to_end(req_context.req_id)
        while len(self._answers) > ANSWERS_REQUESTS_MAX:
            self._answers.popitem(last=False)
        try:
            ks = rk.kvkeys[g][i:]
            self.counters.add("lookup_requests")
            if len(self.namespaces) == 1:
                found = [self.client.lookup(self.namespaces[0], ks)]
            else:
                found = self.client.lookup_many(self.namespaces, ks)
            for f in found:
                if f.reason not in (None, "absent"):
                    self.fail.warn(f"lookup {f.reason}", f.detail)
            prefix = min(f.prefix_len for f in found)
            self._note_reuse(rk, g, i, prefix, req_context)
            pending = None
            if self.prefetcher is not None and prefix:
                for ns, f in zip(self.namespaces, found):
                    flags = self.prefetcher.pending_many(ns, ks[:prefix], list(f.tiers)[:prefix])
                    if any(flags):
                        pending = flags if pending is None else [a or b for a, b in zip(pending, flags)]
            if pending is None:
                ans.known.update(dict.fromkeys(chain[:prefix], _HIT))
            else:
                for k, p in zip(chain, pending):
                    ans.known[k] = _HIT_PENDING if p else _HIT
            if prefix < len(chain):
                # Absent from at least one rank. Keys past it are not
                # known (a sliding window asks them from the end).
                ans.known[chain[prefix]] = _MISS
        except Exception as e:  # fail open: asked one by one (each a miss if the daemon is gone)
            self.fail.error("lookup failed", e)
        return ans

    def _note_reuse(self, rk: _RequestKeys, g: int, i: int, held: int, req_context: ReqContext) -> None:
        """Tells the reuse tracker, once per request, which chunks of its
        chain (KV group ``g``) it needs that kvtier does not hold: those
        past the ``held`` ones kvtier has from index ``i`` (vLLM's first
        lookup), and those before ``i``, which vLLM's GPU prefix cache
        served. Requests that share a system prompt and arrive together
        look up only past it (the first one's blocks are theirs in the same
        step, before it stores them), so counting misses alone gave the
        prompt ``expected_reuse`` 0 (issue 43). Chunks kvtier holds are
        loaded, never stored: not noted, so a cached prompt costs nothing
        here (a 2048-chunk prompt noted whole costs about 1 ms)."""
        if g in rk.noted:
            return
        rk.noted.add(g)
        kvkeys = rk.kvkeys[g]
        need = kvkeys[:i]
        need.extend(islice(kvkeys, i + held, None))
        if need:
            self.reuse.seen_many(need, req_context.req_id)

    def _lookup_one(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """One key in every rank's namespace, one request."""
        try:
            k = connector_key(key)
            self.counters.add("lookup_requests")
            if len(self.namespaces) == 1:
                found = [self.client.lookup(self.namespaces[0], [k])]
            else:
                found = self.client.lookup_many(self.namespaces, [k])
            pending = False
            for ns, f in zip(self.namespaces, found):
                if f.prefix_len != 1:
                    if f.reason not in (None, "absent"):
                        self.fail.warn(f"lookup {f.reason}", f.detail)
                    return LookupResult.MISS
                if self.prefetcher is not None:
                    pending |= self.prefetcher.pending(ns, k, f.tiers[0] if f.tiers else None)
        except Exception as e:  # fail open: a miss
            self.fail.error("lookup failed", e)
            return LookupResult.MISS
        # On a peer or G4 and being prefetched: vLLM looks again later,
        # and loads it from G3 then.
        return LookupResult.HIT_PENDING if pending else LookupResult.HIT

    def _request_hints(self, req_context: ReqContext) -> _RequestHints:
        got = req_context.get_state(_RequestHints)
        if got is not None:
            return got
        hints, eph_from = self.hints, None
        try:
            hints, rest = parse_hints(req_context.kv_transfer_params, "kvtier_", hints)
            eph_from = rest.get("ephemeral_from_token")
            envelope = req_context.kv_hints
            for action in envelope.actions if envelope is not None else ():
                if action.action_type == KV_HINTS_ACTION:
                    hints, rest = parse_hints(action.payload, "", hints)
                    eph_from = rest.get("ephemeral_from_token", eph_from)
            if eph_from is not None:
                eph_from = int(eph_from)
                if eph_from < 0:
                    raise ValueError(f"ephemeral_from_token must be >= 0, got {eph_from}")
        except (ValueError, TypeError, AttributeError) as e:
            # A bad hint is ignored, never a failed request.
            self.counters.add("hint_errors")
            self.fail.warn("request hints ignored", f"request {req_context.req_id}: {e}")
            hints, eph_from = self.hints, None
        got = _RequestHints(hints, eph_from)
        req_context.set_state(got)
        return got

    def _key_hints(self, key: OffloadKey, req_context: ReqContext) -> BlockHints:
        rh = self._request_hints(req_context)
        h = rh.hints.with_reuse(self.reuse.others(connector_key(key)))
        if rh.ephemeral_from_token is not None and not h.ephemeral:
            end = req_context.get_offload_key_position(key)
            if end is not None and end > rh.ephemeral_from_token:
                h = BlockHints(h.priority, h.pinned, True, h.expected_reuse)
        return h

    def _pin(self, keys: list[OffloadKey], pin: bool, kvkeys: Optional[list[bytes]] = None) -> None:
        """Pins (or unpins) ``keys`` (``kvkeys``: the same as kvtier keys,
        when known) on every rank, off the scheduler's thread: a pin only
        narrows the window in which eviction could fail a load (which is
        then recomputed), so the scheduler never waits for one. In order
        (one thread, its own connection); past ``PIN_QUEUE_MAX`` queued,
        dropped and counted (a dropped pin's keys are merely unprotected,
        a dropped unpin expires by its TTL)."""
        if not keys:
            return
        ks = kvkeys if kvkeys is not None else connector_keys(keys)
        with self._pins_lock:
            if self._pins_queued >= PIN_QUEUE_MAX:
                self.counters.add("pins_dropped")
                return
            self._pins_queued += 1
        try:
            self._pinner.submit(self._pin_now, ks, pin)
        except RuntimeError:  # shut down
            with self._pins_lock:
                self._pins_queued -= 1

    def _pin_now(self, ks: list[bytes], pin: bool) -> None:
        try:
            for ns in self.namespaces:
                if pin:
                    self.pin_client.pin(ns, ks, ttl_ms=LOAD_PIN_TTL_MS)
                else:
                    self.pin_client.unpin(ns, ks)
        except Exception as e:  # a pin is an optimisation
            self.fail.error("pin" if pin else "unpin", e)
        finally:
            with self._pins_lock:
                self._pins_queued -= 1

    def shutdown(self) -> None:
        self._pinner.shutdown(wait=True)

    def _load_kvkeys(self, ordered: list[OffloadKey], req_context: ReqContext) -> Optional[list[bytes]]:
        """``ordered``'s kvtier keys from the request's chain when they are
        one run of it (a load of one KV group: vLLM loads the chunks past
        the GPU's hit, in chain order), else None (converted afresh)."""
        rk, g, i = self._chain_at(ordered[0], req_context)
        if rk is None or i < 0:
            return None
        n = len(ordered)
        if rk.chains[g][i:i + n] != ordered:
            return None
        return rk.kvkeys[g][i:i + n]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        # One KV group: vLLM's keys are in chain order already (the sort is
        # for several groups, whose GPU blocks vLLM lists group by group).
        ordered = list(keys) if len(self._chunk_suffix) == 1 else _group_order(keys)
        kvkeys = None
        if ordered:
            kvkeys = self._load_kvkeys(ordered, req_context)
            if kvkeys is None:
                kvkeys = connector_keys(ordered)
            self._pin(ordered, True, kvkeys)
        req_context.set_state(_PinnedLoad(ordered, kvkeys))
        return KvtierLoadStoreSpec(ordered)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        pinned = req_context.get_state(_PinnedLoad)
        if pinned is not None and pinned.keys is not None:
            ordered, kvkeys = pinned.keys, pinned.kvkeys
            pinned.keys = pinned.kvkeys = None
            # vLLM completes the load it prepared: the same keys, as a set.
            if len(ordered) == len(keys) and (
                keys.issuperset(ordered) if isinstance(keys, (set, frozenset)) else set(keys) == set(ordered)
            ):
                self._pin(ordered, False, kvkeys)
                return
        self._pin(list(keys), False)

    def _present(self, keys: list[OffloadKey]) -> list[bool]:
        """Whether every rank holds each key (raises when the daemon is gone)."""
        if not keys:
            return []
        ks = connector_keys(keys)
        present = [True] * len(keys)
        for ns in self.namespaces:
            for i, st in enumerate(self.client.stat(ns, ks)):
                if st is None:
                    present[i] = False
        return present

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> Optional[PrepareStoreOutput]:
        keys = list(keys)
        try:
            present = self._present(keys)
        except Exception as e:  # cannot store now: vLLM keeps going without
            self.fail.error("prepare_store", e)
            return None
        new = [k for k, p in zip(keys, present) if not p and k not in self._storing]
        self._storing.update(new)
        ordered = _group_order(new)
        hints = [self._key_hints(k, req_context) for k in ordered]
        parents = [self._store_parent(k, req_context) for k in ordered]
        return PrepareStoreOutput(
            keys_to_store=ordered, store_spec=KvtierLoadStoreSpec(ordered, hints, parents), evicted_keys=[]
        )

    def _store_parent(self, key: OffloadKey, req_context: ReqContext) -> Optional[bytes]:
        """The kvtier key of the chunk before ``key`` in its request's
        chain (its KV group's chunk keys, from vLLM's key positions): a
        later turn's first chunk continues the turn before, so kvtier
        keeps the chat one chain (evicted from its tail). A partial-tail
        boundary key continues the last full chunk before it. None for a
        chain's first chunk, or when the position is not known."""
        g = get_offload_group_idx(key)
        if self.chain_groups is not None and g not in self.chain_groups:
            return None
        rk = self._request_keys(req_context)
        end = req_context.get_offload_key_position(key)
        tokens = self.chunk_tokens.get(g)
        if rk is None or end is None or not tokens:
            return None
        # The end token of the chunk before: one chunk back for a chunk
        # key, the last whole chunk for a partial-tail boundary.
        before = end - tokens if end % tokens == 0 else (end // tokens) * tokens
        ends = rk.ends.get(g)
        if before <= 0 or not ends:
            return None
        i = before // tokens - 1
        if not (i < len(ends) and ends[i] == before):
            i = bisect.bisect_left(ends, before)
            if i >= len(ends) or ends[i] != before:
                return None
        return rk.kvkeys[g][i]

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        keys = list(keys)
        self._storing.difference_update(keys)
        if not (success and self.enable_events and keys):
            return
        try:
            # Announce only what kvtierd holds: a block whose store failed
            # (no space, dead daemon) must not reach a KV-aware router.
            stored = [k for k, p in zip(keys, self._present(keys)) if p]
        except Exception as e:
            self.fail.error("complete_store", e)
            return
        if stored:
            self._events.append(
                OffloadingEvent(
                    keys=stored, medium=Medium.STORAGE, removed=False, locality=Locality.LOCAL
                )
            )

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request_hints(req_context)
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        yield from events

    def reset_cache(self) -> None:
        # kvtier is shared by every engine on the node: a reset of this
        # engine's cache forgets in-flight bookkeeping, not others' blocks.
        self._storing.clear()

    def get_stats(self):
        """What the connector counted since the last call, as vLLM's
        ``OffloadingConnectorStats`` (the scheduler folds it into its
        ``kv_connector_stats``: Prometheus and the periodic log); None when
        nothing changed."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        self._flush_lookup_counts()
        snap = self.counters.snapshot()
        sent = getattr(self, "_stats_sent", {})
        stats = OffloadingConnectorStats()
        for name, (counter, _) in MANAGER_STATS.items():
            d = snap.get(counter, 0) - sent.get(counter, 0)
            if d > 0:
                stats.increase_counter(name, d)
        self._stats_sent = snap
        return None if stats.is_empty() else stats


class _Job:
    __slots__ = ("job_id", "future", "nbytes", "seconds", "load_block_ids", "chunks", "failed_chunks")

    def __init__(self, job_id: int, nbytes: int, load_block_ids: Optional[list[int]] = None) -> None:
        self.job_id = job_id
        self.future: Optional[Future] = None
        self.nbytes = nbytes
        self.seconds: Optional[float] = None
        # For a load: the GPU blocks it fills (reported when it fails).
        self.load_block_ids = load_block_ids
        # For a load: per chunk (key order), its KV group and the GPU
        # blocks it fills; and the chunks that failed (None: all of them,
        # or not known).
        self.chunks: Optional[list[tuple[int, list[int]]]] = None
        self.failed_chunks: Optional[list[int]] = None

    def failed_block_ids(self) -> list[int]:
        """The GPU blocks a failed load reports: in each KV group, those of
        its first failed chunk and of every chunk after it (the chunks
        before it loaded and are a valid prefix: vLLM recomputes from the
        first bad block on, not the whole load)."""
        all_ids = self.load_block_ids or []
        if self.chunks is None or self.failed_chunks is None:
            return list(all_ids)
        first: dict[int, int] = {}
        for i in self.failed_chunks:
            g = self.chunks[i][0]
            first[g] = min(first.get(g, i), i)
        return [b for i, (g, ids) in enumerate(self.chunks) if g in first and i >= first[g] for b in ids]


class KvtierOffloadingWorker(OffloadingWorker):
    """Worker side: moves chunks between the GPU KV cache and kvtierd on
    one background thread (submissions never block the forward pass).
    Loads submitted while the thread is busy (several requests' loads of
    one step) are read together: one onboard for all their chunks, whose
    reads kvtierd runs in flight together."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        client: kvtier.Client,
        ns: kvtier.Namespace,
        worker_block_bytes: int,
        blocks_per_chunk: int,
        counters: Counters,
        fail: FailOpen,
        load_errors: Optional[LoadErrors] = None,
    ) -> None:
        self.client = client
        self.ns = ns
        self.load_errors = load_errors
        self.block_bytes = worker_block_bytes
        self.bpc = blocks_per_chunk
        self.counters = counters
        self.fail = fail
        # Per KV group: (tensor, row stride in bytes, page bytes) of each
        # distinct tensor the group's layers live in.
        self.groups: list[list[tuple[torch.Tensor, int, int]]] = []
        for refs in kv_caches.group_data_refs:
            seen: dict[int, tuple[torch.Tensor, int, int]] = {}
            for ref in refs:
                if ref.tensor_idx in seen:
                    continue
                t = kv_caches.tensors[ref.tensor_idx]
                stride = t.tensor.stride(0) * t.tensor.element_size()
                seen[ref.tensor_idx] = (t.tensor, stride, t.page_size_bytes)
            pages = list(seen.values())
            total = sum(p for _, _, p in pages)
            if total > worker_block_bytes:
                raise KvtierConfigError(
                    f"a KV group's pages are {total} bytes per block, more than vLLM's "
                    f"worker_kv_bytes_per_block={worker_block_bytes}"
                )
            self.groups.append(pages)
        self.is_cuda = any(t.is_cuda for g in self.groups for t, _, _ in g)
        self._zeros = np.zeros(worker_block_bytes, np.uint8)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-vllm")
        self._jobs: deque[_Job] = deque()
        # Loads submitted and not yet read: (job, keys, buffers).
        self._loads: list[tuple[_Job, list[bytes], list]] = []
        # Inside batch(): loads wait for its end.
        self._holding = False
        self._lock = threading.Lock()

    # -- the layout of one chunk ------------------------------------------

    def _page_segments(self, g: int, block_id: int) -> list:
        segs: list = []
        for t, stride, page in self.groups[g]:
            ptr = t.data_ptr() + block_id * stride
            segs.append((ptr, page, f"cuda:{t.device.index or 0}") if t.is_cuda else (ptr, page))
        return segs

    def _chunk_buffers(self, keys: list[OffloadKey], gpu: GPULoadStoreSpec, load: bool) -> list:
        """One segment list per key: each chunk slot's pages, zero padded
        to ``block_bytes`` per slot; slots without a GPU block (a partial
        first or last chunk) read into / write from padding."""
        block_ids = [int(b) for b in gpu.block_ids]
        bufs: list = []
        at_key = 0
        at_block = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if size == 0:
                continue
            skip = first % self.bpc
            nkeys = -(-(size + skip) // self.bpc)
            for c in range(nkeys):
                segs: list = []
                for slot in range(self.bpc):
                    j = c * self.bpc + slot - skip
                    if 0 <= j < size:
                        pages = self._page_segments(g, block_ids[at_block + j])
                        segs += pages
                        pad = self.block_bytes - sum(s[1] for s in pages)
                    else:
                        pad = self.block_bytes
                    if pad:
                        segs.append(np.empty(pad, np.uint8) if load else self._zeros[:pad])
                segs = coalesce(segs)
                bufs.append(segs[0] if len(segs) == 1 else segs)
            at_key += nkeys
            at_block += size
        if at_key != len(keys) or at_block != len(block_ids):
            raise KvtierConfigError(
                f"the scheduler paired {len(keys)} chunks with {len(block_ids)} GPU blocks "
                f"in groups {list(gpu.group_sizes)}: expected {at_key} chunks"
            )
        return bufs

    def _chunk_blocks(self, gpu: GPULoadStoreSpec) -> list[tuple[int, list[int]]]:
        """Per chunk, in the order of :meth:`_chunk_buffers`: its KV group
        and the GPU block ids it fills."""
        block_ids = [int(b) for b in gpu.block_ids]
        out: list[tuple[int, list[int]]] = []
        at_block = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if size == 0:
                continue
            skip = first % self.bpc
            for c in range(-(-(size + skip) // self.bpc)):
                js = range(max(0, c * self.bpc - skip), min(size, (c + 1) * self.bpc - skip))
                out.append((g, [block_ids[at_block + j] for j in js]))
            at_block += size
        return out

    # -- jobs -------------------------------------------------------------

    def _submit(self, job_id: int, fn, nbytes: int, load_block_ids: Optional[list[int]] = None) -> bool:
        job = _Job(job_id, nbytes, load_block_ids)

        def timed() -> bool:
            t0 = time.perf_counter()
            ok = fn()
            job.seconds = time.perf_counter() - t0
            return ok

        with self._lock:
            job.future = self._pool.submit(timed)
            self._jobs.append(job)
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        try:
            keys = list(dst_spec.keys)  # type: ignore[attr-defined]
            hints = getattr(dst_spec, "hints", None) or [BlockHints()] * len(keys)
            # Each chunk under its own parent: a later turn's first chunk
            # under the turn before's last (None: unknown, a root).
            parents = getattr(dst_spec, "parents", None) or [None] * len(keys)
            bufs = self._chunk_buffers(keys, src_spec, load=False)
            # The model may still be writing these pages on the GPU: the
            # copy thread waits for what the compute stream has queued.
            ready = None
            if self.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
        except Exception as e:
            self.fail.error("submit_store", e)
            return self._submit(job_id, lambda: True, 0)

        def run() -> bool:
            try:
                if ready is not None:
                    ready.synchronize()
                res = offload_grouped(
                    self.client, self.ns, connector_keys(keys), bufs, hints, parents=parents
                )
                # Counted per job, not per block: one lock, and the GIL
                # held the least (the scheduler shares this process).
                n: dict[str, int] = {}
                for r in res:
                    status = r.status
                    n[status] = n.get(status, 0) + 1
                    if status not in ("stored", "stored_unpinned", "already_present"):
                        self.fail.warn(f"store {r.reason}", r.detail)
                stored = n.get("stored", 0) + n.get("stored_unpinned", 0)
                self.counters.add_many({
                    "stores": 1,
                    # Stored, but the daemon's pin budget refused the pin.
                    "store_unpinned": n.get("stored_unpinned", 0),
                    "store_blocks": stored,
                    "store_bytes": stored * self.ns.block_bytes,
                    "store_already_present": n.get("already_present", 0),
                    "store_failures": len(res) - stored - n.get("already_present", 0),
                })
            except Exception as e:
                self.counters.add("store_failures", len(keys))
                self.fail.error("store", e)
            # A store that did not happen only means those blocks are not
            # cached: never a failure vLLM has to handle.
            return True

        return self._submit(job_id, run, len(keys) * self.block_bytes * self.bpc)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        keys = list(src_spec.keys)  # type: ignore[attr-defined]
        block_ids = [int(b) for b in dst_spec.block_ids]
        try:
            bufs = self._chunk_buffers(keys, dst_spec, load=True)
            chunks = self._chunk_blocks(dst_spec)
        except Exception as e:
            self.fail.error("submit_load", e)
            return self._submit(job_id, lambda: False, 0, block_ids)
        job = _Job(job_id, len(keys) * self.block_bytes * self.bpc, block_ids)
        job.chunks = chunks if len(chunks) == len(keys) else None
        job.future = Future()
        with self._lock:
            # Loads wait here until the transfer thread is free (or, inside
            # batch(), until the step's loads are all submitted); it then
            # reads every queued load's chunks with one onboard (kvtierd
            # runs the reads of one request together).
            self._loads.append((job, connector_keys(keys), bufs))
            self._jobs.append(job)
            if self._holding:
                return True
        self._kick()
        return True

    def _kick(self) -> None:
        """Starts a read of the queued loads on the transfer thread."""
        try:
            self._pool.submit(self._run_loads)
        except RuntimeError as e:  # shut down: the queued loads fail
            with self._lock:
                batch, self._loads = self._loads, []
            for job, _, _ in batch:
                assert job.future is not None
                job.future.set_result(False)
            if batch:
                self.fail.error("submit_load", e)

    def batch(self) -> "_LoadBatch":
        """Loads submitted inside ``with worker.batch():`` are read together
        when it ends (KvtierConnector wraps each step's submissions)."""
        return _LoadBatch(self)

    def _run_loads(self) -> None:
        """Every queued load in one onboard call (a no-op when an earlier
        call took them); each job's outcome is its own chunks'."""
        with self._lock:
            batch, self._loads = self._loads, []
        if not batch:
            return
        t0 = time.perf_counter()
        keys = [k for _, ks, _ in batch for k in ks]
        bufs = [b for _, _, bs in batch for b in bs]
        self.counters.add("loads", len(batch))
        self.counters.add("load_batches")
        try:
            res = self.client.onboard_into(self.ns, keys, bufs)
            err = None
        except Exception as e:
            res, err = None, e
        seconds = time.perf_counter() - t0
        # Counted per batch, not per block (a 32K-token prompt is 2048
        # blocks per rank): one lock, and the GIL held the least (vLLM's
        # scheduler may share this process).
        n: dict[str, int] = {"load_blocks": 0, "load_bytes": 0, "load_failures": 0}
        done: list[tuple[_Job, bool]] = []
        at = 0
        for job, ks, _ in batch:
            ok = True
            if res is None:
                ok = False
                n["load_failures"] += len(ks)
                self.fail.error("load", err)
            else:
                job.failed_chunks = []
                for i, r in enumerate(res[at:at + len(ks)]):
                    if r.ok:
                        n["load_blocks"] += 1
                        tier = f"load_blocks_{r.tier}"
                        n[tier] = n.get(tier, 0) + 1
                        n["load_bytes"] += r.nbytes
                    else:
                        ok = False
                        job.failed_chunks.append(i)
                        n["load_failures"] += 1
                        self.fail.warn(f"load {r.reason}", r.detail)
            at += len(ks)
            job.seconds = seconds
            done.append((job, ok))
        # Before the jobs complete: whoever sees a job done sees its counts.
        self.counters.add_many(n)
        for job, ok in done:
            assert job.future is not None
            job.future.set_result(ok)

    def get_finished(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        with self._lock:
            # In submission order, as vLLM's CPU worker reports them.
            while self._jobs and self._jobs[0].future is not None and self._jobs[0].future.done():
                job = self._jobs.popleft()
                out.append(self._result(job))
        return out

    def _result(self, job: _Job) -> TransferResult:
        assert job.future is not None
        try:
            ok = bool(job.future.result())
        except Exception as e:  # run() catches; this is belt and braces
            self.fail.error("transfer", e)
            ok = False
        if not ok and job.load_block_ids is not None and self.load_errors is not None:
            # KvtierConnector reports these blocks to the scheduler, which
            # recomputes them: to vLLM's job bookkeeping the transfer is
            # over (its OffloadingConnector asserts success). Only the
            # failed chunks and those after them: the ones before loaded.
            self.load_errors.add(job.job_id, job.failed_block_ids())
            self.counters.add("load_errors_reported")
            ok = True
        return TransferResult(
            job_id=job.job_id, success=ok, transfer_size=job.nbytes, transfer_time=job.seconds
        )

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            held = bool(self._loads) and self._holding
        if held:  # a sync load inside batch(): read what is queued now
            self._kick()
        with self._lock:
            futures = [j.future for j in self._jobs if j.job_id in job_ids and j.future]
        for f in futures:
            try:
                f.result()
            except Exception as e:
                self.fail.error("wait", e)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class _LoadBatch:
    """See :meth:`KvtierOffloadingWorker.batch`."""

    def __init__(self, worker: KvtierOffloadingWorker) -> None:
        self.worker = worker

    def __enter__(self) -> "_LoadBatch":
        with self.worker._lock:
            self.worker._holding = True
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.worker._lock:
            self.worker._holding = False
            queued = bool(self.worker._loads)
        if queued:
            self.worker._kick()


class KvtierConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` with :class:`KvtierOffloadingSpec`,
    plus what 0.33.0's lacks: a load that fails after a HIT (a corrupt
    block, the daemon gone between lookup and load) is reported to the
    scheduler, which recomputes those blocks (with
    ``kv_load_failure_policy="recompute"``; with vLLM's default ``"fail"``
    the request fails and the engine goes on). Single KV cache group: the
    job's GPU block ids through ``get_block_ids_with_load_errors``; several
    groups (hybrid models, whose block ids are per group): the request
    through ``failed_recving``.

    ``--kv-transfer-config '{"kv_connector": "KvtierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role":
    "kv_both", "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"kvtier_socket": ...}}'``; the extra
    config takes the same ``kvtier_*`` keys as the spec."""

    def __init__(self, vllm_config, role, kv_cache_config):
        ktc = vllm_config.kv_transfer_config
        extra = ktc.kv_connector_extra_config
        extra.setdefault("spec_name", KvtierOffloadingSpec.__name__)
        extra.setdefault("spec_module_path", __name__)
        multi_group = len(kv_cache_config.kv_cache_groups) > 1
        if multi_group and int(extra.get("sync_load_budget_bytes", 0) or 0) > 0:
            # A sync load of a hybrid model has no request to fail and no
            # unique block ids to report: it could not fail open.
            raise KvtierConfigError(
                "KvtierConnector: sync_load_budget_bytes > 0 is not supported for models with "
                "several KV cache groups (a failed sync load could not be recomputed)"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        self._multi_group = multi_group
        self._load_errors: Optional[LoadErrors] = None
        if role == KVConnectorRole.WORKER:
            assert self.connector_worker is not None
            spec = self.connector_worker.spec
            if not isinstance(spec, KvtierOffloadingSpec):
                raise KvtierConfigError(
                    f"KvtierConnector runs kvtier's spec, not {type(spec).__name__}: leave "
                    "spec_name / spec_module_path unset"
                )
            self._load_errors = spec.load_errors = LoadErrors()
        elif ktc.kv_load_failure_policy != "recompute":
            log.warning(
                "kvtier: kv_load_failure_policy=%r: a block that fails to load (corrupt, daemon "
                "gone) fails its request; set \"kv_load_failure_policy\": \"recompute\" to "
                "recompute it instead", ktc.kv_load_failure_policy,
            )

    def start_load_kv(self, forward_context, **kwargs) -> None:
        # The step's loads (one job per request) are read with one onboard.
        w = self.connector_worker.worker if self.connector_worker is not None else None
        if isinstance(w, KvtierOffloadingWorker):
            with w.batch():
                super().start_load_kv(forward_context, **kwargs)
        else:
            super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]):
        worker = self.connector_worker
        # Which request each load job serves, before vLLM forgets it.
        jobs = dict(worker._load_jobs) if (worker is not None and self._multi_group) else {}
        res = super().get_transfer_results(finished_req_ids)
        if self._multi_group and self._load_errors is not None:
            self._load_errors.take_block_ids()  # not unique across groups
            failed = {jobs.get(j) for j in self._load_errors.take_job_ids()} - {None}
            res.failed_recving |= failed
            res.finished_recving |= failed
        return res

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._load_errors is None:
            return set()
        if self._multi_group:
            return set()  # reported per request in get_transfer_results
        self._load_errors.take_job_ids()
        return self._load_errors.take_block_ids()
