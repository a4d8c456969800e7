"""kvtier's LMCache storage plugin through LMCache 0.5.6's own classes: the
plugin is loaded by LMCache's storage_plugin_launcher from the config's
module path and class name, with a real LocalCPUBackend allocating the
memory objects (on a host-memory allocator, as LMCache's CPU tests use),
and called as LMCache's storage manager calls a backend: batched_contains
for the prefix, batched_submit_put_task, get_blocking."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import storage_plugin_launcher
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from kvtier.integrations.lmcache import KvtierStorageBackend

CHUNK = 16
SHAPE = (4, 2, CHUNK, 2, 64)  # layers, K/V, tokens, kv heads, head dim


def setup(socket: str, **extra):
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05,
        storage_plugins=["kvtier"],
        extra_config={
            "storage_plugin.kvtier.module_path": "kvtier.integrations.lmcache",
            "storage_plugin.kvtier.class_name": "KvtierStorageBackend",
            "kvtier_socket": socket,
            "kvtier_timeout_ms": 1000,
            **extra,
        },
    )
    metadata = LMCacheMetadata(
        model_name="test/mistral", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=SHAPE, chunk_size=CHUNK,
    )
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu", memory_allocator=HostMemoryAllocator(32 << 20))
    backends: OrderedDict = OrderedDict()
    loop = asyncio.new_event_loop()
    storage_plugin_launcher(config, metadata, loop, cpu, "cpu", backends)
    return backends["kvtier"], cpu, metadata


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("test/mistral", 1, 0, (i * 0x9E3779B97F4A7C15) - (1 << 63), torch.bfloat16)


def filled(cpu, metadata, seed: int):
    obj = cpu.allocate(metadata.get_shapes(), metadata.get_dtypes(), MemoryFormat.KV_2LTD)
    g = torch.Generator().manual_seed(seed)
    obj.tensor.view(torch.uint8).copy_(
        torch.randint(0, 256, obj.tensor.view(torch.uint8).shape, dtype=torch.uint8, generator=g)
    )
    return obj


def test_put_contains_get_round_trip(daemon):
    b, cpu, md = setup(daemon.socket)
    assert isinstance(b, KvtierStorageBackend)
    ks = [key(i) for i in range(4)]
    assert b.batched_contains(ks) == 0
    objs = [filled(cpu, md, i) for i in range(3)]
    done = []
    assert b.batched_submit_put_task(ks[:3], objs, on_complete_callback=done.append) is None
    assert done == ks[:3]
    assert b.batched_contains(ks) == 3 and b.contains(ks[0]) and not b.contains(ks[3])
    assert b.counters.get("store_bytes") == 3 * b.chunk_bytes  # what was stored, not 0
    for k, want in zip(ks[:3], objs):
        got = b.get_blocking(k)
        assert got is not None and got.data_ptr != want.data_ptr
        assert torch.equal(got.tensor.view(torch.uint8), want.tensor.view(torch.uint8))
        got.ref_count_down()
    assert b.get_blocking(ks[3]) is None
    assert b.remove(ks[0])
    c = b.counters.snapshot()
    assert c["store_blocks"] == 3 and c["load_blocks"] == 3 and c["load_failures"] == 1


def test_dead_daemon_is_a_miss(daemon):
    b, cpu, md = setup(daemon.socket)
    ks = [key(100 + i) for i in range(2)]
    assert b.batched_submit_put_task(ks[:1], [filled(cpu, md, 7)]) is None
    daemon.kill9()
    assert b.batched_contains(ks) == 0
    assert b.get_blocking(ks[0]) is None
    assert b.batched_submit_put_task(ks[1:], [filled(cpu, md, 8)]) is None
    c = b.counters.snapshot()
    assert c["load_failures"] == 1 and c["store_failures"] == 1
    daemon.start()
    assert b.batched_contains(ks) == 1


def test_storage_manager_recomputes_chunks_that_fail_after_contains():
    """LMCache's StorageManager.batched_get (what the cache engine's
    retrieve calls after the lookup's batched_contains) over the plugin:
    chunks that are contained but come back corrupt, or whose daemon died
    between the two, are None (LMCache recomputes from the first), never
    an exception; nothing is written back to the CPU cache."""
    from types import SimpleNamespace

    from conftest import Daemon
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    from test_sglang import corrupt_g3

    for fault in ("corrupt", "killed"):
        d = Daemon(g4=False)  # no S3 copy to repair a corrupt chunk from
        try:
            backend, cpu, metadata = setup(d.socket)
            keys = [key(1000 + i) for i in range(3)]
            objs = [filled(cpu, metadata, 50 + i) for i in range(3)]
            backend.batched_submit_put_task(keys, objs)
            deadline = time.monotonic() + 30
            while backend.batched_contains(keys) != 3:
                assert time.monotonic() < deadline, "chunks never stored"
            if fault == "corrupt":
                assert corrupt_g3(d) >= 3
            else:
                d.kill9()
            manager = SimpleNamespace(
                get_active_storage_backends=lambda location: [("kvtier", backend)],
                storage_backends={"kvtier": backend},
            )
            got = StorageManager.batched_get(manager, keys)
            assert got == [None, None, None], (fault, got)
            c = backend.counters.snapshot()
            assert c.get("load_blocks", 0) == 0, (fault, c)
        finally:
            d.close()


def test_a_bad_kvtier_setting_refuses_to_start(daemon):
    """LMCache's plugin launcher logs and swallows every Exception from a
    plugin (the engine then runs without kvtier): a bad kvtier setting
    must stop the start-up instead, as it does under vLLM and SGLang."""
    import pytest

    from kvtier.integrations.lmcache import KvtierStartupError

    for bad in ({"kvtier_priority": 999}, {"kvtier_timeout_ms": "soon"}, {"kvtier_expected_reuse": -1}):
        with pytest.raises(KvtierStartupError, match="kvtier"):
            setup(daemon.socket, **bad)


def test_batched_get_is_one_onboard_with_the_reads_together(daemon):
    """LMCache's StorageManager.batched_get (a retrieve's read of the
    chunks its lookup found) over the plugin: one onboard request for the
    whole batch (the daemon reads its chunks together), counted by the
    daemon itself; the chunks come back exact, and the daemon's
    per-namespace figures carry LMCache's engine and model."""
    from types import SimpleNamespace

    from lmcache.v1.storage_backend.storage_manager import StorageManager

    backend, cpu, metadata = setup(daemon.socket)
    keys = [key(2000 + i) for i in range(8)]
    objs = [filled(cpu, metadata, 80 + i) for i in range(8)]
    want = [o.tensor.view(torch.uint8).clone() for o in objs]
    before = daemon.metric("kvtier_requests_total", op="offload")
    backend.batched_submit_put_task(keys, objs)
    assert daemon.metric("kvtier_requests_total", op="offload") - before == 1  # the put too
    assert backend.batched_contains(keys) == 8
    manager = SimpleNamespace(
        get_active_storage_backends=lambda location: [("kvtier", backend)],
        storage_backends={"kvtier": backend},
    )
    before = daemon.metric("kvtier_requests_total", op="onboard")
    got = StorageManager.batched_get(manager, keys)
    assert daemon.metric("kvtier_requests_total", op="onboard") - before == 1
    assert all(g is not None for g in got)
    for g, w in zip(got, want):
        assert torch.equal(g.tensor.view(torch.uint8), w)
        g.ref_count_down()
    # A missing chunk in the middle: the ones before it still load, in the
    # same single request.
    before = daemon.metric("kvtier_requests_total", op="onboard")
    got = backend.batched_get_blocking([keys[0], key(9999), keys[1]])
    assert daemon.metric("kvtier_requests_total", op="onboard") - before == 1
    assert got[0] is not None and got[1] is None and got[2] is not None
    for g in (got[0], got[2]):
        g.ref_count_down()
    ns = backend._namespace(keys[0])
    labels = {"namespace": ns.id, "engine": "lmcache"}
    assert daemon.metric("kvtier_client_onboard_blocks_total", result="hit", **labels) == 10
    assert daemon.metric("kvtier_client_onboard_blocks_total", result="miss", **labels) == 1
    assert daemon.metric("kvtier_client_offload_bytes_total", **labels) == 8 * backend.chunk_bytes
    assert daemon.metric("kvtier_client_lookup_blocks_total", result="hit", **labels) == 8


def test_bench_runs_tiny_and_keeps_the_json_contract(daemon, tmp_path):
    """``python -m kvtier.integrations.lmcache_bench`` (kvtier beside
    LMCache's local_disk through LMCache's StorageManager) at a tiny size,
    from another directory: one JSON document on stdout, each comparison
    with its value, its baseline and their quotient under a key ending in
    ``_vs_baseline`` (and nothing else so named). Never a speed."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvtier.integrations.lmcache_bench", "--socket", daemon.socket,
         "--dir", str(daemon.dir), "--chunks", "2", "--chunk-mib", "1", "--rounds", "1",
         "--no-cold", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    doc = json.loads(out.stdout)
    assert doc["bench"] == "lmcache" and doc["cold"] is False and doc["chunks"] == 2
    assert sorted(k for k in doc if "vs_baseline" in k) == ["get_gbps_vs_baseline", "put_gbps_vs_baseline"]
    for op in ("put", "get"):
        v, b = doc[f"{op}_gbps"], doc[f"baseline_{op}_gbps"]
        assert v > 0 and b > 0
        assert abs(doc[f"{op}_gbps_vs_baseline"] - v / b) < 1e-9
