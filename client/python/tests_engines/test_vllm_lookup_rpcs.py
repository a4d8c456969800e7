"""What vLLM 0.33.0's real Scheduler costs kvtierd per prompt, counted at
the daemon (``kvtier_requests_total`` by op on its metrics port), not
timed: the scheduler's manager asks one chunk key at a time, and the
connector answers a scheduling pass from ONE lookup request for all the
prompt's chunks and all tensor-parallel ranks (it was one request per
chunk per rank); the worker loads a request's chunks with one onboard
(kvtierd reads its blocks in flight together), not one per block."""

from __future__ import annotations

import re
import urllib.request

import pytest
from conftest import support
from vllm_engine import BLOCK_SIZE, Engine

CHUNKS = 8
PROMPT = [300 + i for i in range(CHUNKS * BLOCK_SIZE + 3)]  # 8 full chunks and a tail


@pytest.fixture
def g3_daemon():
    d = support.Daemon(g4=False)
    yield d
    d.close()


def requests_by_op(d) -> dict[str, int]:
    addr = d.args[d.args.index("--metrics-addr") + 1]
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=30).read().decode()
    out: dict[str, int] = {}
    for m in re.finditer(r'^kvtier_requests_total\{op="([a-z_]+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = int(float(m.group(2)))
    return out


def lookup_requests(d) -> int:
    c = requests_by_op(d)
    return c.get("lookup", 0) + c.get("lookup_many", 0)


@pytest.mark.parametrize("tp", [1, 4])
def test_one_lookup_request_per_scheduling_pass_for_all_chunks_and_ranks(tmp_path, g3_daemon, tp):
    w = Engine(tmp_path, g3_daemon.socket, tp=tp)
    w.add("writer", PROMPT)
    w.run("writer")
    for rank in range(tp):
        assert w.counters(rank).get("store_blocks", 0) == CHUNKS
    w.shutdown()

    e = Engine(tmp_path, g3_daemon.socket, tp=tp)
    assert len(e.scheduler.connector.connector_scheduler.manager.namespaces) == tp
    passes = []
    conn = e.scheduler.connector
    real = conn.get_num_new_matched_tokens

    def counted(*a, **kw):
        passes.append(1)
        return real(*a, **kw)

    conn.get_num_new_matched_tokens = counted
    before = requests_by_op(g3_daemon)
    e.add("reader", PROMPT)
    e.run("reader")
    after = requests_by_op(g3_daemon)
    c = e.counters()
    # Every chunk was loaded (on rank 0's worker), only the tail computed.
    assert c.get("load_blocks") == CHUNKS and e.computed["reader"] == len(PROMPT) - CHUNKS * BLOCK_SIZE, c
    assert c.get("lookups", 0) >= CHUNKS, c  # vLLM asked key by key ...
    lookups = sum(after.get(op, 0) - before.get(op, 0) for op in ("lookup", "lookup_many"))
    # ... and kvtierd was asked once per scheduling pass (was CHUNKS * tp).
    assert passes and lookups == len(passes), (lookups, len(passes), c)
    # The load: one onboard request per rank for the request's chunks
    # (one job), not one per chunk.
    for rank in range(tp):
        assert e.counters(rank).get("loads") == 1 and e.counters(rank).get("load_blocks") == CHUNKS
    assert after.get("onboard", 0) - before.get("onboard", 0) == tp, (before, after)
    e.shutdown()  # waits for the pinning thread
    # The load's chunks were pinned and unpinned (off the scheduler's
    # thread), one request per rank each.
    done = requests_by_op(g3_daemon)
    for op in ("pin", "unpin"):
        assert done.get(op, 0) - before.get(op, 0) == tp, (op, before, done)


def test_lookups_still_answer_each_key_when_the_daemon_dies(tmp_path, g3_daemon):
    """The batched answer fails open: with kvtierd gone every key is a
    miss and the request is computed."""
    e = Engine(tmp_path, g3_daemon.socket, tp=2)
    g3_daemon.kill9()
    e.add("reader", PROMPT)
    e.run("reader")
    assert e.finished["reader"] and e.computed["reader"] == len(PROMPT)
    assert e.counters().get("lookup_hits", 0) == 0
    e.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_one_onboard_per_step_for_all_the_requests_it_loads(tmp_path, g3_daemon, tp):
    """Several requests whose chunks are cached, scheduled in one step:
    vLLM submits one load job per request; the worker reads them with one
    onboard (kvtierd reads its blocks in flight together), per rank."""
    chunks = 4
    prompts = {f"p{i}": [1000 * (i + 1) + j for j in range(chunks * BLOCK_SIZE + 3)] for i in range(3)}
    w = Engine(tmp_path, g3_daemon.socket, tp=tp)
    for rid, p in prompts.items():
        w.add(rid, p)
    for rid in prompts:
        w.run(rid)
    for rank in range(tp):
        assert w.counters(rank).get("store_blocks", 0) == chunks * len(prompts)
    w.shutdown()

    e = Engine(tmp_path, g3_daemon.socket, tp=tp)
    before = requests_by_op(g3_daemon)
    for rid, p in prompts.items():
        e.add(f"again-{rid}", p)
    for rid in prompts:
        e.run(f"again-{rid}")
    after = requests_by_op(g3_daemon)
    for rid, p in prompts.items():
        assert e.computed[f"again-{rid}"] == len(p) - chunks * BLOCK_SIZE, e.computed
    for rank in range(tp):
        c = e.counters(rank)
        assert c.get("loads") == len(prompts) and c.get("load_blocks") == chunks * len(prompts), c
        assert c.get("load_batches") == 1, c
    assert after.get("onboard", 0) - before.get("onboard", 0) == tp, (before, after)
    e.shutdown()


def test_scheduler_bench_runs_tiny_and_keeps_the_json_contract(tmp_path):
    """bench_vllm_scheduler.py (docs/BENCHMARKS.md, vllm_scheduler) at a
    tiny size: one JSON document, kvtier's connector time beside the
    per-chunk baseline's from the same invocation, the manager's share of
    each, one lookup request per prompt against one per chunk per rank.
    Never a speed."""
    import json
    import pathlib
    import subprocess
    import sys

    bench = pathlib.Path(__file__).resolve().parent / "bench_vllm_scheduler.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--tokens", "256", "--tp", "2", "--rounds", "1", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    doc = json.loads(out.stdout)
    assert doc["bench"] == "vllm_scheduler" and doc["tp"] == 2 and doc["chunks"] == 256 // BLOCK_SIZE
    assert doc["lookup_requests_per_prompt"] == 1
    assert doc["baseline_lookup_requests_per_prompt"] == doc["chunks"] * 2
    assert 0 < doc["manager_ms"] <= doc["connector_ms"]
    assert 0 < doc["baseline_manager_ms"] <= doc["baseline_connector_ms"]
    assert abs(doc["prompts_per_s_vs_baseline"] - doc["baseline_connector_ms"] / doc["connector_ms"]) < 0.01
    # Where the hooks' time went: the engine's steps, the idle ones (the
    # workers loading) apart, the workers' read, the bench's own wrappers.
    assert doc["steps"] >= doc["idle_steps"] >= 0 and doc["steps"] >= 1
    assert 0 <= doc["idle_connector_ms"] <= doc["connector_ms"]
    assert doc["load_ms"] > 0 and doc["timing_overhead_ms"] >= 0


@pytest.mark.parametrize("tp", [1, 2])
def test_each_chunk_key_is_converted_once_per_request_and_once_per_rank(tmp_path, g3_daemon, monkeypatch, tp):
    """The scheduler converts a prompt's chunk keys to kvtier keys once
    (its lookup, the load's pins and unpins reuse that list; they were
    converted three times), and each rank's worker once for its load:
    vLLM asks a 32K-token prompt's 2048 chunks one call at a time."""
    import kvtier.integrations.vllm as kv

    w = Engine(tmp_path, g3_daemon.socket, tp=tp)
    w.add("writer", PROMPT)
    w.run("writer")
    w.shutdown()

    converted = []
    real_one = kv.connector_key
    real_many = getattr(kv, "connector_keys", lambda ks: [real_one(k) for k in ks])

    def one(k):
        converted.append(1)
        return real_one(k)

    def many(ks):
        converted.append(len(ks))
        return real_many(ks)

    monkeypatch.setattr(kv, "connector_key", one)
    monkeypatch.setattr(kv, "connector_keys", many, raising=False)
    e = Engine(tmp_path, g3_daemon.socket, tp=tp)
    e.add("reader", PROMPT)
    e.run("reader")
    e.shutdown()
    for rank in range(tp):
        assert e.counters(rank).get("load_blocks") == CHUNKS
    assert sum(converted) == CHUNKS * (1 + tp), converted


def test_lookup_counts_have_one_lookup_per_call(tmp_path, g3_daemon):
    """The manager folds a step's lookup counts into its counters when
    vLLM's lock region ends (not two locked updates per call): the
    totals, and what get_stats reports to vLLM, still count every call
    by its answer, and a lookup outside a region is counted at once."""
    from vllm.v1.kv_offload.base import LookupResult

    w = Engine(tmp_path, g3_daemon.socket, tp=2)
    w.add("writer", PROMPT)
    w.run("writer")
    w.shutdown()

    e = Engine(tmp_path, g3_daemon.socket, tp=2)
    m = e.scheduler.connector.connector_scheduler.manager
    answers = []
    real = m.lookup

    def counted(key, ctx):
        got = real(key, ctx)
        answers.append(got)
        return got

    m.lookup = counted
    e.add("reader", PROMPT)
    e.run("reader")
    c = e.counters()
    hits = answers.count(LookupResult.HIT)
    assert hits >= CHUNKS, answers
    assert c.get("lookups") == len(answers), (c, len(answers))
    assert c.get("lookup_hits") == hits, c
    assert c.get("lookup_misses", 0) == answers.count(LookupResult.MISS), c
    # What vLLM's stats carried during the run, and what is left to send.
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    total = OffloadingConnectorStats()
    for d in e.connector_stats:
        total.aggregate(OffloadingConnectorStats(data=d))
    rest = m.get_stats()
    if rest is not None:
        total.aggregate(rest)
    got = total.reduce()
    assert got["vllm:kv_offload_kvtier_lookups"] == len(answers), got
    assert got["vllm:kv_offload_kvtier_lookup_hits"] == hits, got

    # Outside vLLM's region (no step to end): in the counters at once.
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    before = m.counters.get("lookups")
    assert m.lookup(make_offload_key(b"\x01" * 32, 0), ReqContext(req_id="alone")) is LookupResult.MISS
    assert m.counters.get("lookups") == before + 1
    assert m.counters.get("lookup_misses") == c.get("lookup_misses", 0) + 1
    e.shutdown()
