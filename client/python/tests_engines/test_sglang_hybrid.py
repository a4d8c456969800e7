"""kvtier under SGLang 0.5.23's own HybridCacheController for a hybrid
model (issue 43 item 6): besides its KV pages, the model keeps a Mamba
state (one slot per checkpoint, ``trailing_pages`` with a window of one
page), a sliding-window attention pool (``trailing_pages``, a window of
SWA_WINDOW pages) and a sparse-attention indexer that rides on the KV
pages' host indices (``all_pages``, ``indices_from_pool=KV``, as
DeepSeek's DSA indexer). The host pools are SGLang's own classes
(MHATokenToKVPoolHost, MambaPoolHost) on CPU tensors, grouped in a
HostPoolGroup as hybrid_pool_assembler builds one; the controller creates
kvtier's backend itself from the ``dynamic`` extra config, registers
every pool through ``register_mem_host_pool_v2`` and moves the extra
pools with ``batch_exists_v2`` / ``batch_set_v2`` / ``batch_get_v2`` from
its own threads. The test plays only the radix cache between the
controller's queues (as test_sglang.py's Engine does), including the
extra pools' PoolTransfers it hands the controller."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch
from conftest import Daemon, support
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel
from test_sglang import sglang_errors, sglang_page_hash, storage_config  # noqa: F401 (fixture)

from kvtier.integrations.sglang import KvtierHiCacheStorage

corrupt_every_block_file = support.corrupt_every_block_file

PAGE = 4
LAYERS = 4
SIZE = 256
SWA_WINDOW = 2  # pages
MAMBA_SLOTS = 16

PROMPT = [3000 + i for i in range(6 * PAGE)]  # six pages
PROMPT_PAGES = len(PROMPT) // PAGE

# The hybrid model: KV of 4 layers (2 heads of 32), an SWA pool of 2
# layers (1 head of 16), a Mamba state of 3 layers (fp32 temporal 4x8,
# fp16 conv 6x4), an indexer of 2 layers (1 head of 8) per KV slot.
EXTRA = (PoolName.SWA, PoolName.MAMBA, PoolName.INDEXER)


def mha_pair(heads: int, dim: int, layers: int) -> tuple[MHATokenToKVPool, MHATokenToKVPoolHost]:
    dev = MHATokenToKVPool(SIZE, PAGE, torch.float16, heads, dim, layers, "cpu", False)
    host = MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first", pin_memory=False,
        device_capacity_tokens=dev.size if dev.host_capacity_tokens is None else dev.host_capacity_tokens,
        start_layer=dev.start_layer, end_layer=dev.end_layer,
        write_back_staging=dev.hicache_write_back_staging,
    )
    return dev, host


def mamba_host() -> MambaPoolHost:
    info = MambaStateBufferInfo(
        temporal=torch.zeros(3, MAMBA_SLOTS, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(3, MAMBA_SLOTS, 6, 4, dtype=torch.float16),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False, layout="page_first")


def read_pages(host, idx: torch.Tensor, page: int) -> list[bytes]:
    """Every byte of each page of ``host`` at ``idx`` (``page`` slots a
    page), through the pool's own pointers."""
    n = len(idx) // page
    if n == 0:
        return []
    ptrs, sizes = host.get_page_buffer_meta(idx)
    per = len(ptrs) // n
    return [
        b"".join(ctypes.string_at(int(ptrs[j]), int(sizes[j])) for j in range(i * per, (i + 1) * per))
        for i in range(n)
    ]


def write_pages(host, idx: torch.Tensor, pages: list[bytes]) -> None:
    ptrs, sizes = host.get_page_buffer_meta(idx)
    per = len(ptrs) // len(pages)
    for i, data in enumerate(pages):
        off = 0
        for j in range(i * per, (i + 1) * per):
            ctypes.memmove(int(ptrs[j]), data[off : off + int(sizes[j])], int(sizes[j]))
            off += int(sizes[j])
        assert off == len(data)


def page_bytes(host, page: int) -> int:
    _, sizes = host.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
    return int(sum(int(s) for s in sizes))


def rand_pages(n: int, nbytes: int, seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return [bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).numpy()) for _ in range(n)]


class HybridEngine:
    """One SGLang server's HiCache for the hybrid model, on CPU: a
    HostPoolGroup of the KV pool (the anchor) and the three extra pools,
    under a HybridCacheController constructed for real with kvtier as
    its ``dynamic`` storage backend."""

    def __init__(self, socket: str):
        self.kv_dev, self.kv = mha_pair(2, 32, LAYERS)
        self.swa_dev, self.swa = mha_pair(1, 16, 2)
        self.idx_dev, self.indexer = mha_pair(1, 8, 2)
        self.mamba = mamba_host()
        allocator = PagedTokenToKVPoolAllocator(SIZE, PAGE, torch.float16, "cpu", self.kv_dev, need_sort=False)

        def entry(name, host, dev, anchor=False):
            return build_pool_entry(
                name=name, host_pool=host, device_pool=dev,
                layer_mapping={i: i for i in range(LAYERS)}, transfer_layer_id_max=LAYERS,
                is_anchor=anchor,
            )

        group = HostPoolGroup([
            entry(PoolName.KV, self.kv, self.kv_dev, anchor=True),
            entry(PoolName.SWA, self.swa, self.swa_dev),
            entry(PoolName.MAMBA, self.mamba, None),
            entry(PoolName.INDEXER, self.indexer, self.idx_dev),
        ])
        extra = dict(storage_config(socket).extra_config)
        extra["hicache_storage_pass_prefix_keys"] = True
        with get_parallel().override(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_rank=0, attn_dcp_size=1
        ):
            self.cc = HybridCacheController(
                allocator, group, PAGE, None, load_cache_event=threading.Event(),
                storage_backend="dynamic", prefetch_threshold=PAGE, model_name="test/hybrid",
                storage_backend_extra_config=extra, transfer_layer_id_max=LAYERS,
            )
        self.backend = self.cc.storage_backend
        assert isinstance(self.backend, KvtierHiCacheStorage)

    def data(self, seed: int, pages: int = PROMPT_PAGES) -> dict:
        """Any bytes for a prompt's pages, the same for a seed: KV and
        indexer per page, the SWA window and the Mamba state at its end."""
        return {
            PoolName.KV: rand_pages(pages, page_bytes(self.kv, PAGE), seed),
            PoolName.INDEXER: rand_pages(pages, page_bytes(self.indexer, PAGE), seed + 1),
            PoolName.SWA: rand_pages(SWA_WINDOW, page_bytes(self.swa, PAGE), seed + 2),
            PoolName.MAMBA: rand_pages(1, page_bytes(self.mamba, 1), seed + 3),
        }

    def store(self, tokens: list[int], data: dict, first_page: int = 0, states: bool = True) -> int:
        """SGLang's write-through of ``tokens``' pages from ``first_page``
        on (``write_storage`` with the extra pools' transfers, then its
        backup thread until the ack), the page hashes before them as
        ``prefix_keys``. ``states``: the SWA window and the Mamba state at
        the last page go with them (a checkpoint), else only the indexer."""
        kv = data[PoolName.KV]
        n = len(kv)
        idx = self.kv.alloc(n * PAGE)
        write_pages(self.kv, idx, kv)
        write_pages(self.indexer, idx, data[PoolName.INDEXER])
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)[first_page : first_page + n]
        prefix = get_storage_hash_str(tokens, None, page_size=PAGE)[:first_page]
        extra = [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]
        owned = []
        if states:
            swa_idx = self.swa.alloc(SWA_WINDOW * PAGE)
            write_pages(self.swa, swa_idx, data[PoolName.SWA])
            m_idx = self.mamba.alloc(1)
            write_pages(self.mamba, m_idx, data[PoolName.MAMBA])
            owned = [(self.swa, swa_idx), (self.mamba, m_idx)]
            extra += [
                PoolTransfer(name=PoolName.SWA, host_indices=swa_idx, keys=hashes[-SWA_WINDOW:],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES),
                PoolTransfer(name=PoolName.MAMBA, host_indices=m_idx, keys=hashes[-1:],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES),
            ]
        op_id = self.cc.write_storage(
            idx, tokens[first_page * PAGE : (first_page + n) * PAGE], hash_value=hashes,
            prefix_keys=prefix, extra_pools=extra,
        )
        done = self.cc.ack_backup_queue.get(timeout=20)
        assert done.id == op_id
        self.kv.free(idx)
        for host, i in owned:
            host.free(i)
        return done.completed_tokens

    def prefetch(self, rid: str, tokens: list[int], before_get=None) -> tuple[PrefetchOperation, dict]:
        """One request's prefetch through the controller: the hit query
        (``batch_exists_v2`` with the extra pools' transfers), then what
        the radix cache does with a hit (UnifiedRadixCache's
        ``allocate_storage_hit`` and ``_alloc_prefetch_aux_staging``: host
        slots for the KV, the SWA window and the Mamba state), then the
        controller's I/O thread (``batch_get_v1`` for KV,
        ``batch_get_v2`` for the indexer beside it and for the trailing
        pools after it) until the last ack. Returns the operation and the
        extra pools' loaded page counts SGLang acked (``pool_hits``)."""
        transfers = [
            PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV),
            PoolTransfer(name=PoolName.SWA, keys=[""] * SWA_WINDOW, hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(name=PoolName.MAMBA, keys=[""], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ]
        op = self.cc.prefetch(CacheRequestHandle(rid, 0), tokens, prefix_keys=[], extra_pools=transfers)
        assert self.cc.prefetch_hit_queue.get(timeout=20) is op
        if op.storage_hit_count < self.cc.prefetch_threshold:
            return op, {}
        idx, n = self.cc.allocate_storage_hit(
            op, op.storage_hit_count, allow_partial=True,
            min_tokens=self.cc.prefetch_threshold, evict_host=lambda need: 0,
        )
        assert idx is not None and n == op.storage_hit_count
        op.hash_value = op.hash_value[: n // PAGE]
        op.host_indices = idx
        for t in transfers:
            if t.indices_from_pool is None:
                host = self.cc.mem_pool_host.entry_map[t.name].host_pool
                t.host_indices = host.alloc(min(len(t.keys), n // PAGE) * host.page_size)
        if before_get is not None:
            before_get()
        self.cc.prefetch_buffer.put(op)
        pool_hits: dict = {}
        while True:
            ack = self.cc.ack_prefetch_queue.get(timeout=20)
            assert ack.operation is op
            if ack.completed_tokens is not None:
                op.completed_tokens = ack.completed_tokens
            if ack.pool_hits is not None:
                pool_hits.update(ack.pool_hits)
            if ack.completed_req:
                return op, pool_hits

    def loaded(self, op: PrefetchOperation) -> dict:
        """What the prefetch put in each host pool."""
        pages = op.completed_tokens // PAGE
        kv_idx = op.host_indices[: pages * PAGE]
        out = {PoolName.KV: read_pages(self.kv, kv_idx, PAGE), PoolName.INDEXER: read_pages(self.indexer, kv_idx, PAGE)}
        for t in op.pool_transfers:
            if t.name == PoolName.SWA:
                out[PoolName.SWA] = read_pages(self.swa, t.host_indices, PAGE)
            if t.name == PoolName.MAMBA:
                out[PoolName.MAMBA] = read_pages(self.mamba, t.host_indices, 1)
        return out

    def alive(self) -> bool:
        threads = (self.cc.prefetch_thread, self.cc.prefetch_io_aux_thread,
                   self.cc.prefetch_sync_thread, self.cc.backup_thread)
        return all(t.is_alive() for t in threads)

    def close(self) -> None:
        self.cc.detach_storage_backend()


@pytest.fixture
def engines(sglang_page_hash):  # noqa: F811
    started: list[HybridEngine] = []

    def start(socket: str) -> HybridEngine:
        e = HybridEngine(socket)
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


@pytest.fixture
def d():
    daemon = Daemon(g4=False)  # no G4: a corrupt G3 copy has nowhere to be repaired from
    yield daemon
    daemon.close()


def corrupt_namespace(daemon: Daemon, ns) -> int:
    """Flips one payload byte of every G3 block file of namespace ``ns``;
    returns how many."""
    return corrupt_every_block_file(daemon, ns.id)


def test_extra_pools_round_trip_beside_the_kv_pages(engines, d, caplog):
    """A prompt stored through the controller with its indexer
    (all_pages), SWA window and Mamba state (trailing_pages); another
    server's controller (empty host pools) finds the whole prompt and
    loads every pool byte for byte: nothing to recompute. Each pool has a
    namespace of its own (no block of one is another's)."""
    writer = engines(d.socket)
    b = writer.backend
    ids = {b.ns.id} | {b._pools[p.value].ns.id for p in EXTRA}
    assert len(ids) == 1 + len(EXTRA)  # one namespace per pool
    # A Mamba state of 528 bytes is a block of 544 (kvtier's blocks are
    # multiples of 32 bytes: zeros after it, not loaded back).
    assert page_bytes(writer.mamba, 1) == 528
    assert b._pools[PoolName.MAMBA.value].ns.block_bytes == 544
    data = writer.data(1)
    assert writer.store(PROMPT, data) == len(PROMPT)
    c = b.counters.snapshot()
    # 6 indexer pages + 2 SWA pages + 1 Mamba state, beside 6 KV pages.
    assert c["store_blocks"] == PROMPT_PAGES and c["pool_store_blocks"] == PROMPT_PAGES + SWA_WINDOW + 1, c
    reader = engines(d.socket)
    op, pool_hits = reader.prefetch("r1", PROMPT)
    assert op.storage_hit_count == len(PROMPT)
    assert op.completed_tokens == len(PROMPT)
    assert pool_hits[PoolName.SWA.value] == SWA_WINDOW and pool_hits[PoolName.MAMBA.value] == 1
    assert reader.loaded(op) == data
    assert not sglang_errors(caplog)


def test_trailing_pools_end_the_hit_at_the_last_stored_state(engines, d, caplog):
    """trailing_pages: the prompt's first three pages stored with the
    SWA window and Mamba state at page 3, its last three without a state
    (a backup that was not a checkpoint). kvtier holds all six KV and
    indexer pages, but the prefix the model can resume from ends at page
    3: SGLang's hit is three pages, and it loads the state stored there.
    all_pages: with the indexer's pages gone (the KV pages kept) no
    prefix is usable: no hit."""
    writer = engines(d.socket)
    head, tail = writer.data(2, pages=3), writer.data(3, pages=3)
    writer.store(PROMPT, head)
    writer.store(PROMPT, tail, first_page=3, states=False)
    assert writer.backend.batch_exists(get_storage_hash_str(PROMPT, None, page_size=PAGE)) == PROMPT_PAGES
    reader = engines(d.socket)
    op, pool_hits = reader.prefetch("r1", PROMPT)
    assert op.storage_hit_count == 3 * PAGE and op.completed_tokens == 3 * PAGE
    assert pool_hits[PoolName.MAMBA.value] == 1
    assert reader.loaded(op) == head
    # all_pages: the indexer pages evicted, the KV kept: no usable prefix.
    hashes = get_storage_hash_str(PROMPT, None, page_size=PAGE)
    from kvtier.integrations.sglang import page_key

    writer.backend.client.evict(writer.backend._pools[PoolName.INDEXER.value].ns, [page_key(h) for h in hashes])
    op, _ = engines(d.socket).prefetch("r2", PROMPT)
    assert op.storage_hit_count == 0 and op.completed_tokens == 0
    assert not sglang_errors(caplog)


@pytest.mark.parametrize("pool", [PoolName.MAMBA, PoolName.SWA, PoolName.INDEXER])
def test_a_corrupt_extra_pool_block_is_a_miss_and_sglang_goes_on(engines, d, caplog, pool):
    """Every block of one extra pool corrupted on G3 after the store: the
    controller's hit query finds them (kvtier verifies on read), the load
    of that pool fails page by page (``batch_get_v2`` answers False, or
    the indexer's KV batch stops), nothing raises into SGLang's threads,
    and they live on; SGLang recomputes, writes through again, and the
    next server loads every pool byte for byte."""
    writer = engines(d.socket)
    data = writer.data(4)
    writer.store(PROMPT, data)
    ns = writer.backend._pools[pool.value].ns
    want = {PoolName.MAMBA: 1, PoolName.SWA: SWA_WINDOW, PoolName.INDEXER: PROMPT_PAGES}[pool]
    assert corrupt_namespace(d, ns) == want
    reader = engines(d.socket)
    op, pool_hits = reader.prefetch("r1", PROMPT)
    assert op.storage_hit_count == len(PROMPT)
    c = reader.backend.counters.snapshot()
    if pool == PoolName.INDEXER:
        # The indexer loads beside each KV batch: the batch's hit is the
        # shorter of the two, so nothing is completed and the trailing
        # pools are not read.
        assert op.completed_tokens == 0
        assert c["pool_load_failures"] == PROMPT_PAGES, c
    else:
        assert op.completed_tokens == len(PROMPT)  # the KV and indexer pages loaded
        assert pool_hits[pool.value] == 0, pool_hits  # SGLang does not take the bad state
        assert c["pool_load_failures"] == want, c
    assert not sglang_errors(caplog)
    assert reader.alive()
    reader.store(PROMPT, data)  # the recompute, written through again
    nxt = engines(d.socket)
    op, _ = nxt.prefetch("r2", PROMPT)
    assert op.completed_tokens == len(PROMPT)
    assert nxt.loaded(op) == data
    assert not sglang_errors(caplog)


class KillAfterFirstLookup:
    """kvtier's client, as the backend holds it, that kills kvtierd (the
    real process, kill -9) right after the first lookup answered: the
    daemon goes between the KV pages' query and the extra pools'."""

    def __init__(self, client, daemon: Daemon):
        self._client, self._daemon = client, daemon

    def lookup(self, *a, **kw):
        out = self._client.lookup(*a, **kw)
        self._daemon.kill9()
        return out

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_kvtierd_stopped_mid_run_is_a_miss_not_an_exception(engines, d, caplog):
    """kvtierd killed while the server runs, at each step: between the
    controller's hit query and its loads (the KV pages and the indexer
    beside them fail: nothing completed), between the KV query and the
    extra pools' query (no usable prefix), before a write-through (SGLang's
    backup ends with 0 tokens), before a hit query (a miss). The v2 calls
    answer False / 0 for every page, nothing raises into SGLang's threads,
    and once kvtierd is back the server stores and loads the pools again."""
    e = engines(d.socket)
    data = e.data(5)
    e.store(PROMPT, data)
    op, _ = e.prefetch("r0", PROMPT, before_get=d.kill9)
    assert op.storage_hit_count == len(PROMPT) and op.completed_tokens == 0
    c = e.backend.counters.snapshot()
    assert c["pool_load_failures"] == PROMPT_PAGES, c  # the indexer, beside the KV batch
    d.start()
    b = e.backend
    hashes = get_storage_hash_str(PROMPT, None, page_size=PAGE)
    real = b.client
    b.client = KillAfterFirstLookup(real, d)
    try:
        res = b.batch_exists_v2(hashes, [
            PoolTransfer(name=PoolName.SWA, keys=[""] * SWA_WINDOW, hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV),
        ])
    finally:
        b.client = real
    assert res.kv_hit_pages == 0 and res.restorable_prefix_pages == []
    op, _ = e.prefetch("r1", PROMPT)
    assert op.storage_hit_count == 0 and op.completed_tokens == 0
    other = [9000 + i for i in range(len(PROMPT))]
    assert e.store(other, data) == 0
    idx = e.kv.alloc(PAGE)
    m_idx = e.mamba.alloc(1)
    got = b.batch_get_v2([
        PoolTransfer(name=PoolName.INDEXER, host_indices=idx, keys=hashes[:1]),
        PoolTransfer(name=PoolName.MAMBA, host_indices=m_idx, keys=hashes[-1:]),
    ])
    assert got == {PoolName.INDEXER: [False], PoolName.MAMBA: [False]}
    assert b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=m_idx, keys=hashes[-1:])]) == {
        PoolName.MAMBA: [False]
    }
    c = b.counters.snapshot()
    assert c["pool_store_failures"] >= 1, c
    assert not sglang_errors(caplog)
    assert e.alive()
    d.start()
    assert e.store(other, data) == len(other)
    nxt = engines(d.socket)
    op, pool_hits = nxt.prefetch("r2", other)
    assert op.completed_tokens == len(other) and pool_hits[PoolName.MAMBA.value] == 1
    assert nxt.loaded(op) == data
    assert not sglang_errors(caplog)


def test_clear_evicts_the_extra_pools_pages_too(engines, d):
    """SGLang's /clear_hicache_storage_backend (the backend's ``clear``):
    the pages this server stored go from every pool's namespace, not
    only the KV pages'."""
    e = engines(d.socket)
    e.store(PROMPT, e.data(6))
    b = e.backend
    from kvtier.integrations.sglang import page_key

    keys = [page_key(h) for h in get_storage_hash_str(PROMPT, None, page_size=PAGE)]
    held = lambda ns: sum(s is not None for s in b.client.stat(ns, keys))  # noqa: E731
    pools = [b.ns] + [b._pools[p.value].ns for p in EXTRA]
    assert [held(ns) for ns in pools] == [PROMPT_PAGES, SWA_WINDOW, 1, PROMPT_PAGES]
    b.clear()
    assert [held(ns) for ns in pools] == [0, 0, 0, 0]
