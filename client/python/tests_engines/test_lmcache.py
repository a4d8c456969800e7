"""kvtier's LMCache plugin through LMCache 0.5.6's own classes: the
plugin is loaded by LMCache's storage_plugin_launcher from the config's
module path and class name, with a real LocalCPUBackend allocating the
memory objects (on a host-memory allocator, as LMCache's CPU tests use),
and called as LMCache's storage manager calls a backend: batched_contains
for the prefix, batched_submit_put_task, get_blocking. The engine tests
run LMCache's real engine instead: an ``LMCacheEngine`` built on CPU (its
standalone mode's mock GPU connector, here with the KV in host memory)
from the documented YAML config, whose ``post_init`` builds the real
``StorageManager`` with kvtier as its plugin backend; a store, then a
lookup and a retrieve of the same tokens, as LMCache's vLLM adapter runs
them."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import pytest
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


# docs/OPERATIONS.md's LMCache config (the file LMCACHE_CONFIG_FILE names),
# at a test's size.
LMCACHE_YAML = """\
chunk_size: {chunk}
local_cpu: true
max_local_cpu_size: 0.05
storage_plugins: ["kvtier"]
extra_config:
  storage_plugin.kvtier.module_path: kvtier.integrations.lmcache
  storage_plugin.kvtier.class_name: KvtierStorageBackend
  kvtier_socket: {socket}
  kvtier_timeout_ms: 1000
"""


class Engine:
    """A real LMCacheEngine on CPU over kvtierd: the config read from the
    documented YAML, ``post_init`` building LMCache's StorageManager (its
    LocalCPUBackend and the kvtier plugin, through the plugin launcher),
    and LMCache's mock GPU connector (its standalone mode's) with the
    engine's KV in host memory (``kv``, [K/V, layers, tokens, hidden]):
    a store copies the tokens' KV out of it, a retrieve copies what it
    loaded back into it, so a test sees exactly which tokens LMCache
    loaded and with which bytes."""

    def __init__(self, socket: str, cfg_dir, tokens: int, extra_yaml: str = "") -> None:
        import multiprocessing
        import os

        from lmcache.v1.cache_engine import LMCacheEngine
        from lmcache.v1.gpu_connector import MockGPUConnector
        from lmcache.v1.token_database import ChunkedTokenDatabase

        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage report from a test

        class HostKV(MockGPUConnector):
            def __init__(self) -> None:
                super().__init__(SHAPE)
                layers, kv, _, heads, dim = SHAPE
                self.kv = torch.zeros((kv, layers, tokens, heads * dim), dtype=torch.bfloat16)

            def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
                for o, s, e in zip(memory_objs, starts, ends):
                    o.tensor.copy_(self.kv[:, :, s:e])

            def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
                for o, s, e in zip(memory_objs, starts, ends):
                    self.kv[:, :, s:e].copy_(o.tensor)

        path = cfg_dir / "lmcache.yaml"
        path.write_text(LMCACHE_YAML.format(chunk=CHUNK, socket=socket) + extra_yaml)
        config = LMCacheEngineConfig.from_file(str(path))
        metadata = LMCacheMetadata(
            model_name="test/mistral", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=SHAPE, chunk_size=CHUNK,
        )
        self.gpu = HostKV()
        # LMCacheEngine sets the whole process's multiprocessing start
        # method to spawn; the other tests of this process keep theirs.
        method = multiprocessing.get_start_method(allow_none=True)
        try:
            self.engine = LMCacheEngine(
                config, metadata, ChunkedTokenDatabase(config, metadata), self.gpu,
                lambda tensor, rank: None, lambda obj, rank: obj,
            )
        finally:
            multiprocessing.set_start_method(method, force=True)
        self.engine.post_init()
        self.manager = self.engine.storage_manager
        assert list(self.manager.storage_backends) == ["LocalCPUBackend", "kvtier"]
        self.kvtier = self.manager.storage_backends["kvtier"]
        assert isinstance(self.kvtier, KvtierStorageBackend)

    def forget_cpu_copies(self) -> None:
        """Empties LMCache's CPU cache (as a restarted engine's is, or one
        that evicted the chunks): a store keeps its chunks there too, and a
        lookup or retrieve would find them there without asking kvtier."""
        self.engine.clear(locations=["LocalCPUBackend"])
        assert not self.manager.storage_backends["LocalCPUBackend"].get_keys()

    def keys(self, tokens):
        return [k for _, _, k in self.engine.token_database.process_tokens(tokens=tokens)]

    def close(self) -> None:
        self.engine.close()


def random_kv(e: Engine, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    e.gpu.kv.copy_(torch.randn(e.gpu.kv.shape, generator=g).to(torch.bfloat16))
    return e.gpu.kv.clone()


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


def test_a_bad_kvtier_setting_refuses_to_start(daemon):
    """LMCache's plugin launcher logs and swallows every Exception from a
    plugin (the engine then runs without kvtier): a bad kvtier setting
    must stop the start-up instead, as it does under vLLM and SGLang."""
    from kvtier.integrations.lmcache import KvtierStartupError

    for bad in ({"kvtier_priority": 999}, {"kvtier_timeout_ms": "soon"}, {"kvtier_expected_reuse": -1}):
        with pytest.raises(KvtierStartupError, match="kvtier"):
            setup(daemon.socket, **bad)


def test_a_bad_kvtier_setting_ends_the_engines_process(daemon, tmp_path):
    """LMCache's real engine with a bad ``kvtier_*`` value in its YAML: the
    start-up fails with KvtierStartupError and the process ends. LMCache
    0.5.6's StorageManager has started its non-daemon event-loop thread
    by then; left running, it kept the refused process alive for ever
    (issue 43: rc 124 at 300 s)."""
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).resolve().parent
    script = (
        "import sys, pathlib\n"
        f"sys.path.insert(0, {str(here)!r})\n"
        "import test_lmcache\n"
        f"test_lmcache.Engine({daemon.socket!r}, pathlib.Path({str(tmp_path)!r}), 64,\n"
        "    extra_yaml='  kvtier_priority: 999\\n')\n"
        "print('STARTED')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    assert "STARTED" not in out.stdout
    assert out.returncode != 0, out.stdout + out.stderr
    assert "KvtierStartupError" in out.stderr and "priority" in out.stderr, out.stderr[-3000:]


def serve(e: Engine, tokens, req: str):
    """LMCache's steps for a request, as its vLLM adapter runs them: the
    scheduler's lookup (pinning what it found under the request's id),
    then the worker's retrieve (reading those chunks from the location
    the lookup found them in, without asking again) into the engine's KV,
    then the unpin. The lookup's hit tokens and the retrieve's mask."""
    hit = e.engine.lookup(tokens, lookup_id=req, pin=True)
    mask = e.engine.retrieve(tokens, req_id=req)
    e.engine.lookup_unpin(req)
    return hit, mask


@pytest.mark.parametrize("fault", ["corrupt", "corrupt_restart", "killed"])
def test_lmcache_engine_recomputes_chunks_kvtier_cannot_load(fault):
    """LMCache's engine stores a prompt's chunks in kvtier; the lookup of
    the same prompt finds every one, then, before the retrieve reads them,
    every block file is corrupt ("corrupt"; the same and kvtierd restarted
    on its data dir: "corrupt_restart"), or kvtierd is killed ("killed").
    The retrieve's mask loads none of the tokens (LMCache recomputes them),
    nothing raises and not a byte reaches the engine's KV; the same prompt
    served again (after the restart, or with the daemon still dead) loads
    nothing either; and the engine carries on: the recomputed KV, stored
    again, is loaded by the next request byte for byte."""
    from conftest import Daemon, support

    n = 3 * CHUNK
    d = Daemon(g4=False)  # no S3 copy to repair a corrupt chunk from
    e = None
    try:
        e = Engine(d.socket, d.dir, n)
        tokens = torch.arange(n) + 7
        want = random_kv(e, 1)
        e.engine.store(tokens)
        assert e.kvtier.counters.get("store_blocks") == 3
        e.forget_cpu_copies()
        assert e.engine.lookup(tokens, lookup_id="req-1", pin=True) == n
        if fault in ("corrupt", "corrupt_restart"):
            assert support.corrupt_every_block_file(d) == 3
        if fault == "corrupt_restart":
            d.restart()
        if fault == "killed":
            d.kill9()
        e.gpu.kv.zero_()
        mask = e.engine.retrieve(tokens, req_id="req-1")
        e.engine.lookup_unpin("req-1")
        assert mask.shape == (n,) and not mask.any(), (fault, mask)
        assert not e.gpu.kv.any()  # not one corrupt byte loaded
        c = e.kvtier.counters.snapshot()
        assert c.get("load_blocks", 0) == 0 and c["load_failures"] == 3, c

        # The same prompt again. (A restarted kvtierd may already have
        # checked and dropped the corrupt files: then the lookup misses.)
        hit, mask = serve(e, tokens, "req-2")
        assert not mask.any() and not e.gpu.kv.any(), (fault, hit)
        assert e.kvtier.counters.get("load_blocks") == 0

        # The engine recomputed the KV (here: the same bytes) and goes on.
        if fault == "killed":
            d.start()
        e.gpu.kv.copy_(want)
        e.engine.store(tokens)
        e.forget_cpu_copies()
        e.gpu.kv.zero_()
        hit, mask = serve(e, tokens, "req-3")
        assert hit == n and mask.all() and torch.equal(e.gpu.kv, want), fault
    finally:
        if e is not None:
            e.close()
        d.close()


def test_a_retrieve_is_one_onboard_with_the_reads_together(daemon, tmp_path):
    """LMCache's engine over the plugin: a store is one offload request,
    and the retrieve of the 8 chunks its lookup found (StorageManager's
    batched_get) one onboard request (the daemon reads the chunks
    together), both counted by the daemon itself; the KV comes back exact,
    and the daemon's per-namespace figures carry LMCache's engine and
    model."""
    n = 8 * CHUNK
    e = Engine(daemon.socket, tmp_path, n)
    try:
        # The plugin reads over passed fds unless told otherwise (the fast
        # path for LMCache's host memory; BENCHMARKS.md, lmcache).
        assert e.kvtier.client.direct_read is True
        tokens = torch.arange(n) + 5000
        want = random_kv(e, 2)
        before = daemon.metric("kvtier_requests_total", op="offload")
        e.engine.store(tokens)
        assert daemon.metric("kvtier_requests_total", op="offload") - before == 1
        e.forget_cpu_copies()
        e.gpu.kv.zero_()
        before = daemon.metric("kvtier_requests_total", op="onboard")
        hit, mask = serve(e, tokens, "req")
        assert daemon.metric("kvtier_requests_total", op="onboard") - before == 1
        assert hit == n and mask.all() and torch.equal(e.gpu.kv, want)
        # A chunk never stored in the middle of StorageManager's batch: the
        # others still load, in the same single request.
        keys = e.keys(tokens)
        absent = e.keys(torch.arange(CHUNK) + 99_000)[0]
        e.forget_cpu_copies()
        before = daemon.metric("kvtier_requests_total", op="onboard")
        got = e.manager.batched_get([keys[0], absent, keys[1]], location="kvtier")
        assert daemon.metric("kvtier_requests_total", op="onboard") - before == 1
        assert got[0] is not None and got[1] is None and got[2] is not None
        for g in (got[0], got[2]):
            g.ref_count_down()
        ns = e.kvtier._namespace(keys[0])
        labels = {"namespace": ns.id, "engine": "lmcache"}
        chunk_bytes = e.kvtier.chunk_bytes
        assert daemon.metric("kvtier_client_onboard_blocks_total", result="hit", **labels) == 10
        assert daemon.metric("kvtier_client_onboard_blocks_total", result="miss", **labels) == 1
        assert daemon.metric("kvtier_client_offload_bytes_total", **labels) == 8 * chunk_bytes
        assert daemon.metric("kvtier_client_lookup_blocks_total", result="hit", **labels) == 8
    finally:
        e.close()


def test_kvtier_transfers_are_in_lmcache_stats(daemon, tmp_path):
    """LMCache's own stats (LMCStatsMonitor, which its remote backends feed
    and its stats logger exports as lmcache:num_remote_*, and
    lmcache:remote_time_to_get/put) carry kvtier's transfers: a store is
    one write request with the chunks' bytes, a retrieve one read request;
    a retrieve that loads nothing (the daemon gone) reads no bytes."""
    from lmcache.observability import LMCStatsMonitor

    n = 4 * CHUNK
    e = Engine(daemon.socket, tmp_path, n)
    try:
        stats = LMCStatsMonitor.GetOrCreate()

        def figures():
            return (
                stats.interval_remote_write_requests, stats.interval_remote_write_bytes,
                len(stats.interval_remote_time_to_put), stats.interval_remote_read_requests,
                stats.interval_remote_read_bytes, len(stats.interval_remote_time_to_get),
            )

        tokens = torch.arange(n) + 300
        random_kv(e, 3)
        w0, wb0, wt0, r0, rb0, rt0 = figures()
        e.engine.store(tokens)
        e.forget_cpu_copies()
        hit, mask = serve(e, tokens, "req")
        assert hit == n and mask.all()
        w, wb, wt, r, rb, rt = figures()
        nbytes = 4 * e.kvtier.chunk_bytes
        assert (w - w0, wb - wb0, wt - wt0) == (1, nbytes, 1)
        assert (r - r0, rb - rb0, rt - rt0) == (1, nbytes, 1)

        e.forget_cpu_copies()
        assert e.engine.lookup(tokens, lookup_id="req-2", pin=True) == n
        daemon.kill9()
        assert not e.engine.retrieve(tokens, req_id="req-2").any()
        e.engine.lookup_unpin("req-2")
        assert figures()[3:5] == (r, rb)
    finally:
        e.close()


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


def test_a_chat_under_g3_pressure_keeps_a_reachable_prefix_through_lmcaches_engine():
    """A chat through LMCache's real engine as its vLLM adapter drives it:
    each turn looks the whole prompt up (LMCache's local CPU backend has
    the turns before, so kvtier is asked only for the new chunks) and
    stores only the new chunks (the store's mask skips the saved ones).
    The plugin learns the chunk order from LMCache's lookups and stores a
    turn's first chunk under the turn before's last, so under G3 pressure
    kvtier evicts the chat from its end: what it holds is a prefix (before
    issue 43 each turn was a chain of its own and the end of turn 1 went
    first)."""
    import kvtier
    from conftest import Daemon

    from kvtier.integrations.lmcache import chunk_key

    turns, per_turn = 4, 2
    n = turns * per_turn * CHUNK
    d = Daemon(g4=False, g3_capacity="1MiB")
    e = None
    try:
        e = Engine(d.socket, d.dir, n + 4 * CHUNK)
        random_kv(e, 5)
        chat = torch.arange(n) + 11
        for t in range(turns):
            upto = (t + 1) * per_turn * CHUNK
            e.engine.lookup(chat[:upto], lookup_id=f"turn{t}")
            mask = torch.ones(upto, dtype=torch.bool)
            mask[: t * per_turn * CHUNK] = False
            e.engine.store(chat[:upto], mask=mask)
        assert e.kvtier.counters.get("store_blocks") == turns * per_turn
        keys = e.keys(chat)
        ns = e.kvtier._namespace(keys[0])
        c = kvtier.Client(socket=d.socket, timeout_ms=5000)
        held = lambda: [c.lookup(ns, [chunk_key(k)]).prefix_len == 1 for k in keys]  # noqa: E731
        assert held() == [True] * len(keys)
        # Pressure: other prompts stored after it, until G3's eviction has
        # taken some of the chat.
        for other in range(100):
            toks = torch.arange(2 * CHUNK) + 50_000 + 1000 * other
            e.engine.store(toks)
            after = held()
            if not all(after):
                break
        k = after.index(False) if False in after else len(after)
        assert not any(after[k:]), f"the chat's chain has holes: {after}"
        assert 0 < k < len(after), after
    finally:
        if e is not None:
            e.close()
        d.close()
