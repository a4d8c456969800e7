"""kvtier's HiCache L3 backend through SGLang 0.5.23's own classes: built by
SGLang's StorageBackendFactory as a ``dynamic`` backend from the module path
and class name, registered on SGLang's real MHA / MLA host pools (CPU
tensors, as SGLang's own storage backend unit tests build them), and called
as HiCacheController calls it with ``interface_v1``: batch_exists for the
prefix, batch_set_v1 / batch_get_v1 over host page indices."""

from __future__ import annotations

import ctypes

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

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


def mha_host(layout: str) -> MHATokenToKVPoolHost:
    kv = MHATokenToKVPool(SIZE, PAGE, torch.float16, 2, 32, LAYERS, "cpu", False)
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
    from conftest import Daemon

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


def corrupt_g3(d) -> int:
    """Flips one payload byte of every block file under the daemon's G3."""
    n = 0
    for p in (d.dir / "g3").rglob("*"):
        if p.is_file() and p.stat().st_size > 4096:
            with open(p, "r+b") as f:
                f.seek(4096 + 17)
                b = f.read(1)
                f.seek(4096 + 17)
                f.write(bytes([b[0] ^ 0xFF]))
            n += 1
    return n


@pytest.mark.parametrize("fault", ["corrupt", "killed"])
def test_controller_recomputes_pages_that_fail_after_exists(fault):
    """HiCacheController's own zero-copy get (``_page_get_zero_copy``, what
    its prefetch thread runs after ``batch_exists``): pages that exist but
    come back corrupt, or whose daemon died between the two, end the hit
    there (a recompute), and SGLang goes on."""
    from types import SimpleNamespace

    from conftest import Daemon
    from sglang.srt.managers.cache_controller import HiCacheController

    d = Daemon(g4=False)  # no S3 copy to repair a corrupt page from
    try:
        host = mha_host("page_first")
        fill_random(host, 7)
        b = backend(storage_config(d.socket), host)
        assert b.batch_set_v1(KEYS[:3], indices([1, 2, 3])) == [True] * 3
        assert b.batch_exists(KEYS[:3]) == 3  # the controller's prefetch query
        if fault == "corrupt":
            assert corrupt_g3(d) >= 3
        else:
            d.kill9()
        controller = SimpleNamespace(storage_backend=b)
        op = SimpleNamespace(request_id="r1")
        hits = HiCacheController._page_get_zero_copy(
            controller, op, KEYS[:3], indices([4, 5, 6]), HiCacheStorageExtraInfo(prefix_keys=[]))
        assert hits == 0
        c = b.counters.snapshot()
        assert c["load_failures"] == 3 and c.get("load_blocks", 0) == 0, c
    finally:
        d.close()


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


@pytest.mark.parametrize("extra", ["swa", "mamba"])
def test_hybrid_pools_are_refused_at_start_up(daemon, extra):
    """SGLang's hybrid models hand the storage backend their extra host
    pools (a HostPoolGroup's PoolEntries) through
    register_mem_host_pool_v2, as HybridCacheController.attach_storage_backend
    does, and then call on_host_pools_registered: kvtier refuses there,
    with a kvtier.Error naming the pool, rather than failing (or raising
    NotImplementedError) at the first v2 transfer. The KV pool alone is
    accepted."""
    import kvtier
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    kv, side = mha_host("page_first"), mha_host("page_first")
    name = PoolName.SWA if extra == "swa" else PoolName.MAMBA
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, kv, None, lambda i: i, is_primary_index_anchor=True),
        PoolEntry(name, side, None, lambda i: i),
    ])
    b = backend(storage_config(daemon.socket), kv)
    with pytest.raises(kvtier.Error, match=f"hybrid host pool '{name.value}'"):
        for entry in group.entries:
            b.register_mem_host_pool_v2(entry.host_pool, entry.name)
        b.on_host_pools_registered()
    only_kv = backend(storage_config(daemon.socket), kv)
    only_kv.register_mem_host_pool_v2(kv, PoolName.KV)
    only_kv.on_host_pools_registered()
