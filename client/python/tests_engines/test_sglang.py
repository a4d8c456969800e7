"""kvtier's HiCache L3 backend through SGLang 0.5.23's own classes: built by
SGLang's StorageBackendFactory as a ``dynamic`` backend from the module path
and class name, registered on SGLang's real MHA / MLA host pools (CPU
tensors, as SGLang's own storage backend unit tests build them), and called
as HiCacheController calls it with ``interface_v1``: batch_exists for the
prefix, batch_set_v1 / batch_get_v1 over host page indices. The fault tests
(issue 32) run it under SGLang's own HiCache controller, built on CPU as
its scheduler builds it, whose threads store, query and load."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

import pytest
import torch
from conftest import Daemon, support
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo, PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from kvtier.integrations.sglang import KvtierHiCacheStorage

PAGE = 4
LAYERS = 4
SIZE = 256


def storage_config(socket: str, mla: bool = False, tp_rank: int = 0, tp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="test/qwen",
        extra_config={
            "backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KvtierHiCacheStorage",
            "interface_v1": 1,
            "kvtier_socket": socket,
            "kvtier_timeout_ms": 1000,
        },
    )


def mha_device_pool() -> MHATokenToKVPool:
    return MHATokenToKVPool(SIZE, PAGE, torch.float16, 2, 32, LAYERS, "cpu", False)


def mha_host(layout: str, kv: MHATokenToKVPool | None = None) -> MHATokenToKVPoolHost:
    if kv is None:
        kv = mha_device_pool()
    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
        device_capacity_tokens=kv.size if kv.host_capacity_tokens is None else kv.host_capacity_tokens,
        start_layer=kv.start_layer, end_layer=kv.end_layer,
        write_back_staging=kv.hicache_write_back_staging,
    )


def mla_host() -> MLATokenToKVPoolHost:
    kv = MLATokenToKVPool(SIZE, PAGE, torch.float16, 64, 16, LAYERS, "cpu", False)
    return MLATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first", pin_memory=False,
        device_capacity_tokens=kv.size if kv.host_capacity_tokens is None else kv.host_capacity_tokens,
        start_layer=kv.start_layer, end_layer=kv.end_layer, target_layer_num=kv.layer_num,
        override_kv_cache_dim=kv.kv_cache_dim,
    )


def backend(cfg, host) -> KvtierHiCacheStorage:
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)  # as HiCacheController does after creating it
    return b


def page_bytes(host, pages: list[int]) -> list[bytes]:
    """Every byte of each page, read through the pool's own pointers."""
    import ctypes

    ptrs, sizes = host.get_page_buffer_meta(indices(pages))
    per = len(ptrs) // len(pages)
    return [
        b"".join(ctypes.string_at(ptrs[j], sizes[j]) for j in range(i * per, (i + 1) * per))
        for i in range(len(pages))
    ]


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64) for p in pages])


def fill_random(host, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in ("kv_buffer", "k_buffer"):
        buf = getattr(host, name, None)
        if isinstance(buf, torch.Tensor):
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
            return
    raise AssertionError("no host buffer found")


KEYS = [f"{i:064x}" for i in range(1, 7)]


@pytest.mark.parametrize("kind", ["mha-page_first", "mha-layer_first", "mla"])
def test_set_exists_get_round_trip(daemon, kind):
    mla = kind == "mla"
    host = mla_host() if mla else mha_host(kind.split("-", 1)[1])
    fill_random(host, 1)
    b = backend(storage_config(daemon.socket, mla=mla), host)
    assert isinstance(b, KvtierHiCacheStorage)
    assert (b.ns.rank is None) == mla  # the TP rank is in the namespace unless MLA
    assert b.batch_exists(KEYS[:4]) == 0
    src = [2, 3, 4, 5]
    want = page_bytes(host, src)
    extra = HiCacheStorageExtraInfo(prefix_keys=[])
    assert b.batch_set_v1(KEYS[:4], indices(src), extra) == [True] * 4
    assert b.batch_exists(KEYS) == 4  # the cached prefix, in pages
    assert b.exists(KEYS[0]) and not b.exists(KEYS[5])
    dst = [10, 11, 12, 13]
    assert page_bytes(host, dst) != want
    assert b.batch_get_v1(KEYS[:4], indices(dst)) == [True] * 4
    assert page_bytes(host, dst) == want
    # A missing page is False, not an exception; its neighbours still load.
    assert b.batch_get_v1([KEYS[0], KEYS[5]], indices([20, 21])) == [True, False]
    c = b.counters.snapshot()
    assert c["store_blocks"] == 4 and c["load_blocks"] == 5 and c["load_failures"] == 1
    assert c["store_bytes"] == 4 * b.ns.block_bytes  # what was stored, not 0


def test_clear_evicts_the_pages_it_stored():
    d = Daemon(g4=False)  # no S3 copy to find after the eviction
    try:
        host = mha_host("page_first")
        fill_random(host, 5)
        b = backend(storage_config(d.socket), host)
        assert b.batch_set_v1(KEYS[:3], indices([1, 2, 3])) == [True] * 3
        assert b.batch_exists(KEYS[:3]) == 3
        b.clear()
        assert b.batch_exists(KEYS[:3]) == 0
    finally:
        d.close()


def test_tp_ranks_do_not_share_mha_pages_but_mla_does(daemon):
    host = mha_host("page_first")
    fill_random(host, 2)
    r0 = backend(storage_config(daemon.socket, tp_rank=0, tp_size=2), host)
    r1 = backend(storage_config(daemon.socket, tp_rank=1, tp_size=2), host)
    assert r0.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert r0.batch_exists(KEYS[:2]) == 2 and r1.batch_exists(KEYS[:2]) == 0
    mhost = mla_host()
    fill_random(mhost, 3)
    m0 = backend(storage_config(daemon.socket, mla=True, tp_rank=0, tp_size=2), mhost)
    m1 = backend(storage_config(daemon.socket, mla=True, tp_rank=1, tp_size=2), mhost)
    # Rank 1 is not MLA's storage writer: its set is a no-op success.
    assert m1.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert m1.batch_exists(KEYS[:2]) == 0
    assert m0.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert m1.batch_exists(KEYS[:2]) == 2


def test_mla_pages_are_one_copy_whatever_the_tp_size(daemon):
    """MLA's KV does not depend on the TP size: a deployment at TP 4 finds
    (and reads back byte for byte) what one at TP 2 stored; MHA's pages,
    split by heads, do not carry over."""
    mhost = mla_host()
    fill_random(mhost, 5)
    tp2 = backend(storage_config(daemon.socket, mla=True, tp_rank=0, tp_size=2), mhost)
    assert tp2.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    want = page_bytes(mhost, [1, 2])
    for rank in range(4):
        tp4 = backend(storage_config(daemon.socket, mla=True, tp_rank=rank, tp_size=4), mhost)
        assert tp4.ns.id == tp2.ns.id
        assert tp4.batch_exists(KEYS[:2]) == 2
        ptrs, sizes = mhost.get_page_buffer_meta(indices([3, 4]))
        for p, n in zip(ptrs, sizes):
            ctypes.memset(int(p), 0, int(n))
        assert tp4.batch_get_v1(KEYS[:2], indices([3, 4])) == [True, True]
        assert page_bytes(mhost, [3, 4]) == want
    host = mha_host("page_first")
    fill_random(host, 6)
    m2 = backend(storage_config(daemon.socket, tp_rank=0, tp_size=2), host)
    m4 = backend(storage_config(daemon.socket, tp_rank=0, tp_size=4), host)
    assert m2.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert m4.ns.id != m2.ns.id and m4.batch_exists(KEYS[:2]) == 0


def test_dead_daemon_means_recompute(daemon):
    host = mha_host("page_first")
    fill_random(host, 4)
    b = backend(storage_config(daemon.socket), host)
    assert b.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    daemon.kill9()
    assert b.batch_exists(KEYS[:2]) == 0
    assert b.batch_get_v1(KEYS[:2], indices([3, 4])) == [False, False]
    assert b.batch_set_v1(KEYS[2:4], indices([3, 4])) == [False, False]
    c = b.counters.snapshot()
    assert c["load_failures"] == 2 and c["store_failures"] == 2
    daemon.start()
    assert b.batch_exists(KEYS[:2]) == 2


# -- SGLang's own HiCache controller --------------------------------------
#
# The tests below run kvtier under the controller SGLang 0.5.23's scheduler
# builds for a plain MHA model with --enable-hierarchical-cache
# --hicache-storage-backend dynamic (hybrid_pool_assembler's
# _PlainKvStrategy -> build_kv_only_stack): a HybridCacheController, which
# is a HiCacheController, over a HostPoolGroup holding the KV host pool.
# Its own threads do the storage I/O; SGLang's code, not the test, decides
# how much of a prompt is loaded and how much is recomputed.

PROMPT = [1000 + i for i in range(6 * PAGE)]  # six pages
PROMPT_PAGES = len(PROMPT) // PAGE


@pytest.fixture(scope="module")
def sglang_page_hash():
    """SGLang's page hash (get_storage_hash_str, what the controller's hit
    query keys pages by) is a C++ extension SGLang builds on first use
    with torch's cpp_extension, which runs ``ninja`` from PATH: the
    engines' venv has it in its bin directory, not on a bare PATH. Built
    once per machine (~/.cache/torch_extensions)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        get_storage_hash_str([1] * PAGE, None, page_size=PAGE)
        yield


class Engine:
    """One SGLang server's HiCache, as its scheduler builds it, on CPU.

    The controller is constructed for real: it creates kvtier's backend
    itself (StorageBackendFactory, ``dynamic``) from the extra config a
    server gets from --hicache-storage-backend-extra-config, registers
    the host pool on it, picks the zero-copy get/set for ``interface_v1``
    and starts its prefetch, prefetch-I/O, prefetch-sync and backup
    threads. Nothing in SGLang is patched: without CUDA, SGLang's device
    module is torch.cpu, whose Stream and Event the controller uses as
    they are. The TP/PP/DCP widths a launched server publishes are given
    for the construction with get_parallel().override (one rank).

    The test plays only the scheduler's radix cache between the
    controller's queues (UnifiedRadixCache._drain_storage_control_queues_impl
    in SGLang 0.5.23): see :meth:`prefetch`."""

    def __init__(self, socket: str):
        self.kv = mha_device_pool()
        self.host = mha_host("page_first", self.kv)
        allocator = PagedTokenToKVPoolAllocator(SIZE, PAGE, torch.float16, "cpu", self.kv, need_sort=False)
        group = HostPoolGroup([
            build_pool_entry(
                name=PoolName.KV, host_pool=self.host, device_pool=self.kv,
                layer_mapping={i: i for i in range(LAYERS)}, transfer_layer_id_max=LAYERS,
                is_anchor=True,
            )
        ])
        extra = dict(storage_config(socket).extra_config)
        with get_parallel().override(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_rank=0, attn_dcp_size=1
        ):
            self.cc = HybridCacheController(
                allocator, group, PAGE, None, load_cache_event=threading.Event(),
                storage_backend="dynamic", prefetch_threshold=PAGE, model_name="test/qwen",
                storage_backend_extra_config=extra, transfer_layer_id_max=LAYERS,
            )
        assert isinstance(self.cc, HiCacheController)
        self.backend = self.cc.storage_backend
        assert isinstance(self.backend, KvtierHiCacheStorage)
        assert self.cc.page_get_func == self.cc._page_get_zero_copy  # interface_v1

    def store(self, tokens: list[int], pages: list[bytes], first_page: int = 0, chain: bool = False) -> None:
        """SGLang's write-through to storage of pages already in the host
        pool: ``write_storage``, then its backup thread (``_page_backup``:
        ``batch_set_v1``) until the backup ack. ``pages`` are the KV of
        ``tokens``' pages from ``first_page`` on. ``chain``: with the
        page hashes before them as ``prefix_keys``, what SGLang's radix
        cache passes with ``hicache_storage_pass_prefix_keys: true``."""
        idx = self.host.alloc(len(pages) * PAGE)
        assert idx is not None
        write_pages(self.host, idx, pages)
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        op_id = self.cc.write_storage(
            idx, tokens[first_page * PAGE : (first_page + len(pages)) * PAGE],
            hash_value=hashes[first_page : first_page + len(pages)],
            prefix_keys=hashes[:first_page] if chain else None,
        )
        done = self.cc.ack_backup_queue.get(timeout=20)
        assert done.id == op_id and done.completed_tokens == len(pages) * PAGE
        self.host.free(idx)

    def prefetch(self, rid: str, tokens: list[int], before_get=None) -> PrefetchOperation:
        """One request's prefetch from storage through the controller's
        own path: ``prefetch`` queues it; its prefetch thread runs the hit
        query (``_storage_hit_query``: kvtier's ``batch_exists``) and posts
        the verdict on ``prefetch_hit_queue``. Here the test does what the
        radix cache does with a verdict at or over the threshold: host
        pages for the hit from the controller's ``allocate_storage_hit``,
        the operation to ``prefetch_buffer``. The prefetch-I/O thread
        (``_page_transfer``: ``_page_get_zero_copy``, kvtier's
        ``batch_get_v1``) ends the prefix at the first page that did not
        load, and its acks, through the sync thread, set
        ``completed_tokens``: all SGLang inserts into its tree; it
        recomputes the rest of the prompt. ``before_get`` runs between
        the hit query and the get."""
        op = self.cc.prefetch(CacheRequestHandle(rid, 0), tokens)
        assert self.cc.prefetch_hit_queue.get(timeout=20) is op
        if op.storage_hit_count < self.cc.prefetch_threshold:
            return op  # the radix cache revokes it: nothing to load
        idx, n = self.cc.allocate_storage_hit(
            op, op.storage_hit_count, allow_partial=True,
            min_tokens=self.cc.prefetch_threshold, evict_host=lambda need: 0,
        )
        assert idx is not None and n == op.storage_hit_count
        op.hash_value = op.hash_value[: n // PAGE]
        op.host_indices = idx
        if before_get is not None:
            before_get()
        self.cc.prefetch_buffer.put(op)
        while True:
            ack = self.cc.ack_prefetch_queue.get(timeout=20)
            assert ack.operation is op
            if ack.completed_tokens is not None:
                assert ack.completed_tokens >= op.completed_tokens
                op.completed_tokens = ack.completed_tokens
            if ack.completed_req:
                return op

    def loaded(self, op: PrefetchOperation) -> list[bytes]:
        """The bytes of the pages the prefetch completed, in the host pool."""
        pages = op.completed_tokens // PAGE
        return page_bytes_at(self.host, op.host_indices[: pages * PAGE]) if pages else []

    def alive(self) -> bool:
        threads = (self.cc.prefetch_thread, self.cc.prefetch_io_aux_thread,
                   self.cc.prefetch_sync_thread, self.cc.backup_thread)
        return all(t.is_alive() for t in threads)

    def close(self) -> None:
        self.cc.detach_storage_backend()


def page_bytes_at(host, idx: torch.Tensor) -> list[bytes]:
    ptrs, sizes = host.get_page_buffer_meta(idx)
    n = len(idx) // PAGE
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


def prompt_kv(engine: Engine, seed: int) -> list[bytes]:
    """The KV pages of PROMPT (any bytes: kvtier moves them as they are),
    the same on every engine for a seed, as a recompute gives them."""
    nbytes = engine.backend.ns.block_bytes
    g = torch.Generator().manual_seed(seed)
    return [
        bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).numpy())
        for _ in range(PROMPT_PAGES)
    ]


@pytest.fixture
def engines(sglang_page_hash):
    started: list[Engine] = []

    def start(socket: str) -> Engine:
        e = Engine(socket)
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


def sglang_errors(caplog) -> list[str]:
    """What SGLang logged at ERROR: the controller catches an exception
    from the storage backend (``batch_exists`` in the prefetch thread,
    ``batch_get_v1`` in ``_page_transfer``) and logs it with
    logger.exception, so a connector that raised shows here."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("sglang") and r.levelno >= logging.ERROR]


def test_sglang_controller_loads_a_stored_prompt_instead_of_recomputing(engines, caplog):
    d = Daemon(g4=False)
    try:
        writer = engines(d.socket)
        kv = prompt_kv(writer, 1)
        writer.store(PROMPT, kv)
        reader = engines(d.socket)  # another server (or this one restarted): an empty host pool
        op = reader.prefetch("r1", PROMPT)
        assert op.storage_hit_count == len(PROMPT)
        assert op.completed_tokens == len(PROMPT)  # nothing to recompute
        assert reader.loaded(op) == kv
        assert reader.backend.counters.snapshot()["load_blocks"] == PROMPT_PAGES
        assert not sglang_errors(caplog)
    finally:
        d.close()


def stop_cleanly(d) -> None:
    """Stops kvtierd as a service manager does (SIGTERM: it shuts down
    cleanly and trusts its index at the next start)."""
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=20) == 0


FAULTS = ["corrupt", "corrupt-then-restart", "corrupt-then-crash-restart", "killed-after-hit-query"]


@pytest.mark.parametrize("fault", FAULTS)
def test_sglang_controller_recomputes_pages_that_fail_after_its_hit_query(engines, caplog, fault):
    """Issue 32 under SGLang's own controller: a prompt stored, then every
    block file corrupted (kvtierd running, restarted cleanly, or killed and
    started again on the same data), or kvtierd killed between the
    controller's hit query and its get. The request goes on: the
    controller completes none of the prompt's pages (SGLang recomputes it
    all), nothing raises into it, its threads live on; the recomputed KV
    it writes through again is what the next server loads."""
    d = Daemon(g4=False)  # no G4: a corrupt G3 copy has nowhere to be repaired from
    try:
        writer = engines(d.socket)
        kv = prompt_kv(writer, 2)
        writer.store(PROMPT, kv)
        before_get = None
        if fault.startswith("corrupt"):
            assert support.corrupt_every_block_file(d) == PROMPT_PAGES
        if fault == "corrupt-then-restart":
            stop_cleanly(d)
            d.start()
        if fault == "corrupt-then-crash-restart":
            d.restart()
        if fault == "killed-after-hit-query":
            before_get = d.kill9
        reader = engines(d.socket)
        op = reader.prefetch("r1", PROMPT, before_get)
        assert op.completed_tokens == 0, "a page that did not load was completed"
        assert not sglang_errors(caplog)
        c = reader.backend.counters.snapshot()
        if fault == "corrupt-then-crash-restart" and op.storage_hit_count < len(PROMPT):
            # After a crash kvtierd verifies, at start, the files its index
            # had not committed yet (how many is the group commit's timing)
            # and quarantines the bad ones: the hit query stops at the
            # first of them, and the get of the pages before it fails.
            hit_pages = op.storage_hit_count // PAGE
            assert c.get("load_failures", 0) == hit_pages, (op.storage_hit_count, c)
            if hit_pages == 0:
                assert c.get("loads", 0) == 0, c
        else:
            # kvtier said every page was there: the fault is after that,
            # and the get the controller ran failed every page.
            assert op.storage_hit_count == len(PROMPT)
            assert c["load_failures"] == PROMPT_PAGES, c
        assert c.get("load_blocks", 0) == 0, c
        assert reader.alive()
        if fault == "killed-after-hit-query":
            d.start()
        # SGLang recomputed the prompt and writes it through to storage;
        # the next server loads it, byte for byte.
        reader.store(PROMPT, kv)
        nxt = engines(d.socket)
        op = nxt.prefetch("r2", PROMPT)
        assert op.completed_tokens == len(PROMPT)
        assert nxt.loaded(op) == kv
        assert not sglang_errors(caplog)
    finally:
        d.close()


def test_sglang_controller_keeps_the_pages_before_the_first_corrupt_one(engines, caplog):
    """The prompt's last three pages stored, every block file corrupted,
    then its first three stored: kvtier's hit query finds all six, and the
    controller completes the first three and stops before the corrupt
    ones (SGLang recomputes from there)."""
    d = Daemon(g4=False)
    try:
        writer = engines(d.socket)
        kv = prompt_kv(writer, 3)
        writer.store(PROMPT, kv[3:], first_page=3)
        assert support.corrupt_every_block_file(d) == 3
        writer.store(PROMPT, kv[:3])
        reader = engines(d.socket)
        op = reader.prefetch("r1", PROMPT)
        assert op.storage_hit_count == len(PROMPT)
        assert op.completed_tokens == 3 * PAGE
        assert reader.loaded(op) == kv[:3]
        assert not sglang_errors(caplog)
    finally:
        d.close()


def test_a_chat_under_g3_pressure_keeps_a_reachable_prefix_through_sglangs_controller(engines, caplog):
    """A chat's turns backed up through SGLang's controller with their
    chain (``prefix_keys``, as SGLang passes them with
    ``hicache_storage_pass_prefix_keys: true``): each turn's first page is
    stored under the turn before's last, so under G3 pressure kvtier
    evicts the chat from its end and SGLang's own hit query still finds a
    prefix. Without the chain every turn is a chain of its own and the
    backend says so (a warning once, ``stores_without_prefix_keys``)."""
    d = Daemon(g4=False, g3_capacity="1MiB")
    try:
        e = engines(d.socket)
        turns, per_turn = 4, 3
        chat = [5000 + i for i in range(turns * per_turn * PAGE)]
        kv = [bytes([t]) * e.backend.ns.block_bytes for t in range(turns * per_turn)]
        for t in range(turns):
            e.store(chat, kv[t * per_turn : (t + 1) * per_turn], first_page=t * per_turn, chain=True)
        assert e.backend.counters.snapshot().get("stores_without_prefix_keys", 0) == 0
        hashes = get_storage_hash_str(chat, None, page_size=PAGE)
        held = lambda: [e.backend.batch_exists([h]) == 1 for h in hashes]  # noqa: E731
        assert held() == [True] * len(hashes)
        # Pressure: other prompts stored after it (without their chain),
        # until G3's eviction has taken some of the chat.
        for other in range(200):
            toks = [90_000 + other * 1000 + i for i in range(2 * PAGE)]
            e.store(toks, [bytes([other % 256]) * e.backend.ns.block_bytes] * 2)
            after = held()
            if not all(after):
                break
        assert e.backend.counters.snapshot()["stores_without_prefix_keys"] == other + 1
        assert any("hicache_storage_pass_prefix_keys" in r.getMessage() for r in caplog.records)
        n = after.index(False) if False in after else len(after)
        assert not any(after[n:]), f"the chat's chain has holes: {after}"
        assert 0 < n < len(after), after
        # SGLang's own hit query finds that prefix.
        op = engines(d.socket).prefetch("r", chat)
        assert op.storage_hit_count == n * PAGE
    finally:
        d.close()


def test_a_page_over_kvtiers_block_limit_is_refused_at_registration(daemon, monkeypatch):
    """SGLang's page (``--page-size`` tokens of every layer's K and V) is
    one kvtier block: a host pool whose page is over kvtier's block limit
    is refused when SGLang registers it, with a kvtier.Error that says to
    lower --page-size, not at the first store. The limit (1 GiB) is
    lowered here to a real MHA host pool's page: a page over the real one
    would need over a GiB of host memory."""
    import kvtier

    assert kvtier.BLOCK_BYTES_MAX == 1 << 30  # docs/OPERATIONS.md: "at most 1 GiB"
    host = mha_host("page_first")
    _, sizes = host.get_page_buffer_meta(indices([0]))
    page = int(sum(sizes))
    cfg = storage_config(daemon.socket)
    monkeypatch.setattr(kvtier, "BLOCK_BYTES_MAX", page)
    assert backend(cfg, host).ns.block_bytes == page  # at the limit: accepted
    monkeypatch.setattr(kvtier, "BLOCK_BYTES_MAX", page - 1)
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    with pytest.raises(kvtier.Error, match=f"one HiCache page is {page} bytes.*lower --page-size"):
        b.register_mem_pool_host(host)


def test_generic_batch_get_is_one_onboard(daemon):
    """SGLang's generic (copying) ``batch_get``, for callers without
    interface_v1: one onboard request per batch, counted by the daemon
    (it was one per page); the pages land exact, a missing one is None."""
    host = mha_host("page_first")
    fill_random(host, 11)
    b = backend(storage_config(daemon.socket), host)
    assert b.batch_set_v1(KEYS[:4], indices([1, 2, 3, 4])) == [True] * 4
    want = page_bytes(host, [1, 2, 3, 4])
    dst = [torch.zeros(b.ns.block_bytes, dtype=torch.uint8) for _ in range(5)]
    before = daemon.metric("kvtier_requests_total", op="onboard")
    got = b.batch_get(KEYS[:4] + [KEYS[5]], dst)
    assert daemon.metric("kvtier_requests_total", op="onboard") - before == 1
    assert got[4] is None and all(g is not None for g in got[:4])
    assert [bytes(g.numpy()) for g in got[:4]] == want


def test_get_stats_feeds_sglangs_storage_metrics(daemon):
    """``get_stats()`` (what SGLang's radix cache hands its
    StorageMetricsCollector with --enable-storage-metrics) carries each
    batch's pages and GB/s since the last call, not None; the daemon's
    /metrics counts the same pages under this namespace, labelled sglang."""
    from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector

    host = mha_host("page_first")
    fill_random(host, 12)
    b = backend(storage_config(daemon.socket), host)
    assert b.batch_set_v1(KEYS[:3], indices([1, 2, 3])) == [True] * 3
    assert b.batch_get_v1(KEYS[:3], indices([5, 6, 7])) == [True] * 3
    s = b.get_stats()
    assert isinstance(s, StorageMetrics)
    assert s.backup_pgs == [3] and s.prefetch_pgs == [3]
    assert s.backup_bandwidth[0] > 0 and s.prefetch_bandwidth[0] > 0
    StorageMetricsCollector(labels={"model_name": "test"}).log_storage_metrics(s)
    assert b.get_stats().prefetch_pgs == []  # drained
    labels = {"namespace": b.ns.id, "engine": "sglang"}
    assert daemon.metric("kvtier_client_offload_blocks_total", **labels) == 3
    assert daemon.metric("kvtier_client_onboard_blocks_total", result="hit", **labels) == 3
    assert daemon.metric("kvtier_client_onboard_bytes_total", **labels) == 3 * b.ns.block_bytes
