"""kvtier as a secondary tier of vLLM 0.33.0's own tiered offloading
(``OffloadingConnector`` + ``TieringOffloadingSpec``, the tier loaded by
``module_path``): vLLM's real Scheduler, its TieringOffloadingManager
with its CPU primary tier, and kvtier's KvtierTierManager behind it,
driven by vllm_engine.Engine on CPU (a tiny local Llama config,
``load_format="dummy"``) against real kvtierd processes.

vLLM's CPU-primary worker refuses to start without CUDA and copies
between GPU and CPU with CUDA kernels on CUDA streams: here (only) that
copy is a CPU copy of the same copy plan (``CpuCopy``). The scheduler, the
tiering manager, its CPU tier and the kvtier tier are vLLM's and kvtier's
own code."""

from __future__ import annotations

import ctypes
import json
import pathlib

import numpy as np
import pytest
from conftest import support
from vllm_engine import BLOCK_SIZE, LAYERS, Engine

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import TransferResult
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu import spec as cpu_spec

PROMPT = [100 + i for i in range(4 * BLOCK_SIZE + 5)]  # 4 full blocks and a tail
CACHED = 4 * BLOCK_SIZE


class CpuCopy(gpu_worker.SingleDirectionOffloadingHandler):
    """vLLM's GPU<->CPU transfer handler with its copy done on the CPU:
    the same per-group copy plan (``_fill_direct_ops``: which page of which
    block goes where), each copy a memmove, finished when submitted."""

    def __init__(self, gpu_tensors, cpu_tensors, blocks_per_chunk, layer_refs_per_group, gpu_to_cpu,
                 canonical_layout=False, host_memory_is_pinned=True):
        assert not canonical_layout
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.gpu_to_cpu = gpu_to_cpu
        self.layer_refs_per_group = layer_refs_per_group
        self.src_blocks_per_chunk = 1 if gpu_to_cpu else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if gpu_to_cpu else 1
        self._canonical_copy_plans = None
        self._fill_group_ops = self._fill_direct_ops
        self._finished: list[TransferResult] = []

    def transfer_async(self, job_id, src_spec, dst_spec) -> bool:
        # The loop of SingleDirectionOffloadingHandler.transfer_async.
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        gpu_spec = src_spec if self.gpu_to_cpu else dst_spec
        n = self._estimate_max_copy_ops(gpu_spec.group_sizes)
        all_src, all_dst, all_sizes = (np.empty(n, np.int64) for _ in range(3))
        src_off = dst_off = op = nbytes = 0
        for g, (size, idx) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices)):
            if size == 0:
                continue
            s_skip = idx % self.src_blocks_per_chunk
            d_skip = idx % self.dst_blocks_per_chunk
            s_end = src_off + cdiv(size + s_skip, self.src_blocks_per_chunk)
            d_end = dst_off + cdiv(size + d_skip, self.dst_blocks_per_chunk)
            op, b = self._fill_group_ops(
                g, group_src=src_blocks[src_off:s_end], group_dst=dst_blocks[dst_off:d_end], group_size=size,
                src_skip_count=s_skip, dst_skip_count=d_skip, all_src=all_src, all_dst=all_dst,
                all_sizes=all_sizes, op_idx=op)
            nbytes += b
            src_off, dst_off = s_end, d_end
        assert src_off == len(src_blocks) and dst_off == len(dst_blocks)
        for s, d, z in zip(all_src[:op], all_dst[:op], all_sizes[:op]):
            ctypes.memmove(int(d), int(s), int(z))
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                             transfer_time=0.0))
        return True

    def get_finished(self):
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids) -> None:
        return

    def shutdown(self) -> None:
        self.src_tensors.clear()
        self.dst_tensors.clear()


class _CudaAlike:
    """The CPU platform, saying CUDA-alike to CPUOffloadingSpec.get_worker's
    start-up check only."""

    def __init__(self, real) -> None:
        self._real = real

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture(autouse=True)
def cpu_copy(monkeypatch):
    monkeypatch.setattr(gpu_worker, "SingleDirectionOffloadingHandler", CpuCopy)
    monkeypatch.setattr(cpu_spec, "current_platform", _CudaAlike(cpu_spec.current_platform))


@pytest.fixture
def g3_daemon():
    # No G4: a corrupt G3 copy has nowhere to be repaired from.
    d = support.Daemon(g4=False)
    yield d
    d.close()


def documented_config() -> dict:
    """The --kv-transfer-config of docs/OPERATIONS.md's "vLLM's own
    tiering" (the block after its ``<!-- tested: ... -->`` line)."""
    doc = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "OPERATIONS.md").read_text()
    at = doc.index("<!-- tested: client/python/tests_engines/test_vllm_tier.py")
    block = doc[at:].split("```")[1]
    return json.loads(block.split("--kv-transfer-config '", 1)[1].split("'", 1)[0])


def tier_config(socket: str, direct_read=None) -> dict:
    """The documented kv_connector_extra_config at a test's size, on the
    test's kvtierd; ``direct_read`` set when not None."""
    extra = documented_config()["kv_connector_extra_config"]
    [t] = extra["secondary_tiers"]
    t.update(socket=socket, timeout_ms=10000)
    if direct_read is not None:
        t["direct_read"] = direct_read
    return {**extra, "cpu_bytes_to_use": 64 << 20}


def engine(tmp_path, socket: str, direct_read=None) -> Engine:
    cfg = documented_config()
    assert (cfg["kv_connector"], cfg["kv_role"]) == ("OffloadingConnector", "kv_both")
    # vLLM's default load-failure policy: the tier's failed chunks are
    # recomputed before vLLM's GPU load, never a failed GPU load.
    e = Engine(tmp_path, socket, connector="OffloadingConnector", policy="fail",
               **tier_config(socket, direct_read))
    # Unset: chunks up to 4 MiB (these) load through the shared region.
    want = bool(direct_read)
    assert all(c.direct_read == want for c in tier(e).load_clients), want
    return e


# Both load routes: the shared region (the default for chunks up to
# kvtierd's default slot_max) and passed fds (chunks above it).
ROUTES = pytest.mark.parametrize("direct_read", [None, True], ids=["region", "fd"])


def manager(e: Engine):
    return e.scheduler.connector.connector_scheduler.manager


def tier(e: Engine):
    [t] = manager(e).secondary_tiers
    return t


def settle(e: Engine) -> None:
    """Steps until the tiering manager has nothing in flight (a cascade to
    kvtier outlives the request that wrote the chunk)."""
    for _ in range(2000):
        if not manager(e).has_pending_work():
            return
        e.step()
        import time

        time.sleep(0.005)
    raise AssertionError("the tiering manager kept work in flight")


def expect_loaded_kv(e: Engine, req_id: str) -> dict:
    """Checks, when ``req_id`` is first scheduled, that the KV of every
    token before what the engine computes is the KV its prompt's writer
    computed (what the load brought in); returns what was checked."""
    seen: dict = {}
    forward = e._forward

    def check(so) -> None:
        n = so.num_scheduled_tokens.get(req_id)
        if n is not None and "tokens" not in seen:
            req = e.scheduler.requests[req_id]
            start = req.num_computed_tokens - n
            block_ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for pos in range(start):
                b, off = block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                for li, layer in enumerate(LAYERS):
                    want = float(req.all_token_ids[0] * 10_000 + pos * 10 + li)
                    got = e.kv[layer][b, :, off]
                    assert bool((got == want).all()), f"token {pos} layer {li}: {got.flatten()[:4]} != {want}"
            seen["tokens"] = start
        forward(so)

    e._forward = check
    return seen


def connector_stats(e: Engine) -> dict:
    """The scheduler's kv_connector_stats of every step, summed (what
    vLLM's Prometheus logger observes), and their Prometheus text under
    the metrics TieringOffloadingSpec declares (vLLM's and the tier's)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    total = OffloadingConnectorStats()
    for d in e.connector_stats:
        total.aggregate(OffloadingConnectorStats(data=d))
    reg = CollectorRegistry()
    types = {c: functools.partial(c, registry=reg) for c in (Counter, Gauge, Histogram)}
    prom = OffloadingConnector.build_prom_metrics(e.config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    for d in e.connector_stats:
        prom.observe(d, 0)
    return {"values": total.reduce(), "text": generate_latest(reg).decode()}


def store_prompt(tmp_path, socket: str, prompt=PROMPT) -> None:
    e = engine(tmp_path, socket)
    e.add("writer", prompt)
    e.run("writer")
    assert e.computed["writer"] == len(prompt)
    settle(e)
    assert tier(e).counters.get("store_failed_chunks") == 0, tier(e).counters.snapshot()
    e.shutdown()


@ROUTES
def test_a_prompt_stored_through_vllms_tiering_hits_from_kvtier_after_restarts(tmp_path, g3_daemon, direct_read):
    store_prompt(tmp_path, g3_daemon.socket)
    # vLLM and kvtierd restarted: vLLM's CPU tier is empty, kvtier kept it.
    g3_daemon.restart(clean=True)
    e = engine(tmp_path, g3_daemon.socket, direct_read)
    checked = expect_loaded_kv(e, "reader")
    e.add("reader", PROMPT)
    e.run("reader")
    assert e.finished["reader"]
    # Only the tail past the 4 stored chunks was computed, and the KV of
    # the 4 is what the writer computed.
    assert e.computed["reader"] == len(PROMPT) - CACHED, e.computed
    assert checked["tokens"] == CACHED
    c = tier(e).counters.snapshot()
    assert c["load_chunks"] == CACHED // BLOCK_SIZE and c.get("load_failed_chunks", 0) == 0, c
    # vLLM's tiering metrics carry what the tier reported.
    got = connector_stats(e)["values"]
    read = sum(v for k, v in got.items() if k.startswith("vllm:kv_offload_tiering_read_bytes:"))
    assert read == CACHED // BLOCK_SIZE * tier(e).block_size_bytes, got
    e.shutdown()


@ROUTES
def test_corrupt_block_files_are_recomputed_and_the_engine_goes_on(tmp_path, g3_daemon, direct_read):
    store_prompt(tmp_path, g3_daemon.socket)
    assert support.corrupt_every_block_file(g3_daemon) >= CACHED // BLOCK_SIZE
    e = engine(tmp_path, g3_daemon.socket, direct_read)
    e.add("reader", PROMPT)
    e.run("reader")
    # The tier's lookup said HIT, every chunk's load came back corrupt and
    # was reported failed: vLLM recomputed the whole prompt.
    assert tier(e).counters.get("load_failed_chunks") >= CACHED // BLOCK_SIZE
    assert e.finished["reader"] and e.computed["reader"] == len(PROMPT), e.computed
    stats = connector_stats(e)
    assert stats["values"]["vllm:kv_offload_kvtier_tier_load_failed_chunks"] >= CACHED // BLOCK_SIZE, stats
    assert "vllm:kv_offload_kvtier_tier_load_failed_chunks_total{" in stats["text"]
    assert [p for p in (g3_daemon.dir / "g3" / "quarantine").glob("*") if p.is_file()]
    # The engine goes on.
    e.add("next", [7] * (2 * BLOCK_SIZE + 1))
    e.run("next")
    assert e.finished["next"]
    e.shutdown()


@ROUTES
def test_one_corrupt_chunk_fails_only_itself(tmp_path, g3_daemon, direct_read):
    """A load job's chunks report one by one (``successful_keys``): the
    third chunk corrupt, vLLM keeps the two before it and recomputes from
    the third on."""
    store_prompt(tmp_path, g3_daemon.socket)
    from vllm.v1.kv_offload.base import make_offload_key

    e = engine(tmp_path, g3_daemon.socket, direct_read)
    key = make_offload_key(Engine.request("probe", PROMPT).block_hashes[2], 0)
    [(path, at)] = [
        (p, o)
        for p, o, n, k in support.g3_blocks(g3_daemon.dir / "g3")
        if n == tier(e).ns.id and k.startswith(key.hex())
    ]
    support.flip_at(path, at + 4096 + 17)
    checked = expect_loaded_kv(e, "reader")
    e.add("reader", PROMPT)
    e.run("reader")
    c = tier(e).counters.snapshot()
    assert c["load_failed_chunks"] == 1, c
    # Each chunk read from kvtier once: the two good chunks before the bad
    # one were reported loaded, not failed with the job and promoted again.
    assert c["load_chunks"] == CACHED // BLOCK_SIZE, c
    assert e.computed["reader"] == len(PROMPT) - 2 * BLOCK_SIZE, e.computed
    assert checked["tokens"] == 2 * BLOCK_SIZE
    e.shutdown()


def test_daemon_killed_between_lookup_and_load_is_a_recompute(tmp_path, g3_daemon):
    store_prompt(tmp_path, g3_daemon.socket)
    e = engine(tmp_path, g3_daemon.socket)
    lookups = tier(e)._lookups
    batch_lookup = lookups.batch_lookup
    killed = []

    def lookup_then_kill(keys, req_context):
        hits = list(batch_lookup(keys, req_context))
        if any(hits) and not killed:
            # kvtierd answered the lookup (HIT), and dies before the load.
            g3_daemon.kill9()
            killed.append(True)
        return hits

    lookups.batch_lookup = lookup_then_kill
    e.add("reader", PROMPT)
    e.run("reader")
    assert killed, "the tier's lookup never found the stored chunks"
    assert tier(e).counters.get("load_failed_chunks") >= CACHED // BLOCK_SIZE
    assert e.finished["reader"] and e.computed["reader"] == len(PROMPT), e.computed
    # kvtierd back: the engine keeps using it.
    g3_daemon.start()
    e.add("next", [9] * (2 * BLOCK_SIZE + 1))
    e.run("next")
    assert e.finished["next"]
    e.shutdown()


def test_two_vllm_instances_share_one_kvtierd(tmp_path, g3_daemon):
    a = engine(tmp_path, g3_daemon.socket)
    b = engine(tmp_path, g3_daemon.socket)
    other = [500 + i for i in range(3 * BLOCK_SIZE + 2)]
    a.add("a-writes", PROMPT)
    a.run("a-writes")
    b.add("b-writes", other)
    b.run("b-writes")
    settle(a)
    settle(b)
    # Each reads what the other stored (its own CPU tier never held it).
    a_checked = expect_loaded_kv(a, "a-reads")
    b_checked = expect_loaded_kv(b, "b-reads")
    a.add("a-reads", other)
    a.run("a-reads")
    b.add("b-reads", PROMPT)
    b.run("b-reads")
    assert a.computed["a-reads"] == len(other) - 3 * BLOCK_SIZE, a.computed
    assert b.computed["b-reads"] == len(PROMPT) - CACHED, b.computed
    assert a_checked["tokens"] == 3 * BLOCK_SIZE and b_checked["tokens"] == CACHED
    a.shutdown()
    b.shutdown()


def test_a_later_turn_is_stored_under_the_turn_before(tmp_path, g3_daemon):
    """Each store carries its chunk's parent (ReqContext's key positions):
    a chat's second turn's first new chunk hangs under the first turn's
    last one in kvtier (kvtierd's stored events say so), so the chat is
    one chain that kvtier evicts from its end; and the tier announces what
    it stored as vLLM's own storage tiers do (STORAGE, LOCAL)."""
    import time

    import kvtier
    from vllm.v1.kv_offload.base import make_offload_key

    events = kvtier.Client(socket=g3_daemon.socket, timeout_ms=5000).events(timeout_ms=200)
    e = engine(tmp_path, g3_daemon.socket)
    tier(e).events = []  # enable_kv_events (vLLM's KV events config is off here)
    # What vLLM's scheduler publishes each step (its ZMQ publisher is off).
    published: list = []
    e.scheduler.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    turn1 = [200 + i for i in range(3 * BLOCK_SIZE + 5)]
    e.add("turn1", turn1)
    e.run("turn1")
    turn2 = turn1 + e.finished["turn1"] + [300 + i for i in range(46)]
    e.add("turn2", turn2)
    e.run("turn2")
    settle(e)
    keys = [make_offload_key(h, 0) for h in Engine.request("probe", turn2).block_hashes]
    assert len(keys) == 6
    parent_of: dict = {}
    end = time.monotonic() + 30
    while not all(k.hex() in parent_of for k in keys):
        assert time.monotonic() < end, f"announced: {parent_of}"
        ev = next(events, None)
        stored = ev["data"].get("stored") if ev is not None and isinstance(ev["data"], dict) else None
        if stored is None:
            continue
        p = stored["parent_hash"]
        for b in stored["blocks"]:
            parent_of[b["block_hash"]] = p
            p = b["block_hash"]
    events.close()
    assert [parent_of[k.hex()] for k in keys] == [None] + [k.hex() for k in keys[:-1]], parent_of
    e.step()  # the events of the last stores' completion
    storage = [ev for ev in published if getattr(ev, "medium", None) == "STORAGE"]
    assert len(storage) == len(keys), published
    assert all(type(ev).__name__ == "BlockStored" and ev.locality == "LOCAL" for ev in storage), storage
    e.shutdown()


def test_the_fs_comparison_bench_runs_tiny_and_keeps_the_json_contract(tmp_path, monkeypatch, capsys):
    """bench_vllm_tier.py (docs/BENCHMARKS.md, vllm_tier) at a tiny size,
    in this process (vLLM imported once): one JSON document, kvtier's
    figures beside vLLM's fs tier's from the same invocation, every stored
    chunk a hit after the restarts, and kvtier serving no corrupt KV.
    Never a speed."""
    import logging
    import sys

    import bench_vllm_tier
    import vllm_engine

    # What the bench sets for its run, put back after it.
    monkeypatch.setattr(vllm_engine, "KV_HEADS", vllm_engine.KV_HEADS)
    monkeypatch.setattr(sys, "argv", ["bench_vllm_tier.py", "--prompts", "2", "--tokens", "512", "--kv-heads", "1",
                                      "--rounds", "1", "--json"])
    monkeypatch.chdir(tmp_path)
    try:
        assert bench_vllm_tier.main() == 0
    finally:
        logging.disable(logging.NOTSET)
    doc = json.loads(capsys.readouterr().out)
    assert doc["bench"] == "vllm_tier" and doc["chunks"] == 4
    for m in ("store_gbps", "load_gbps"):
        assert doc[m] > 0 and doc[f"baseline_{m}"] > 0
        assert abs(doc[f"{m}_vs_baseline"] - doc[m] / doc[f"baseline_{m}"]) < 1e-9
    assert doc["hit_tokens_after_restart"] == doc["baseline_hit_tokens_after_restart"] == doc["cacheable_tokens"]
    assert doc["disk_bytes"] > 0 and doc["baseline_disk_bytes"] > 0
    assert doc["corrupt"]["tokens_served_corrupt"] == 0
    assert doc["corrupt"]["tokens_recomputed"] == doc["tokens"]
