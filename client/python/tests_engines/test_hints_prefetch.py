"""Hints and prefetch end to end through the engines' own classes against
one real kvtierd (G4 = file://, admission ``after-first-reuse``: a block is
written to G4 at store time only when the engine hinted reuse or a pin, and
never when it is ephemeral, so which blocks reach G4 shows which hints
arrived).

- hints: vLLM's per-request ``kv_transfer_params`` and ``kv_hints``
  envelope, SGLang's and LMCache's reuse tracker and LMCache's
  ``request_configs`` decide which blocks reach G4;
- prefetch: a chain on G4 only (evicted from G3) is prefetched at the
  engine's lookup and is on G3 before the load, which then reads G3."""

from __future__ import annotations

import time

import pytest
import torch
from lmcache.utils import CacheEngineKey
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from test_lmcache import filled
from test_lmcache import key as lm_key
from test_lmcache import setup as lm_setup
from test_sglang import backend as sg_backend
from test_sglang import fill_random, indices, mha_host, page_bytes, storage_config
from test_vllm import kv_caches, keys, make_config, run_job
from vllm_engine import BLOCK_SIZE, Engine
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import kvtier
from kvtier.integrations.lmcache import chunk_key
from kvtier.integrations.vllm import connector_key

# The module's daemon is conftest's ``hdaemon`` (one for all these tests).
WAIT_S = 20


def g4_blocks(d) -> int:
    return sum(
        1 for p in (d.dir / "g4").rglob("*") if p.is_file() and "#" not in p.name and "blocks" in p.parts
    )


def wait_until(cond, what: str):
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def tiers(client, ns, ks) -> list:
    """Where each key is now: its tier, or None."""
    out = []
    for k in ks:
        found = client.lookup(ns, [k])
        out.append(found.tiers[0] if found.prefix_len == 1 else None)
    return out


def to_g4_only(d, client, ns, ks, before: int) -> None:
    """Waits for ``ks`` to be written to G4, then evicts them from G3."""
    wait_until(lambda: g4_blocks(d) >= before + len(ks), "never written to G4")
    assert client.evict(ns, ks) == ["ok"] * len(ks)
    assert tiers(client, ns, ks) == ["g4"] * len(ks)


def vllm_spec(socket: str, **extra):
    cfg = make_config(socket)
    cfg.extra_config.update(extra)
    return OffloadingSpecFactory.create_spec(cfg)


def vllm_store(spec, worker, ks, ctx, job_id: int):
    manager = spec.get_manager()
    manager.on_new_request(ctx)
    for i, k in enumerate(ks):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    out = manager.prepare_store(ks, ctx)
    assert out is not None and out.keys_to_store == ks
    src = GPULoadStoreSpec(list(range(1, len(ks) + 1)), group_sizes=[len(ks)], block_indices=[0])
    assert run_job(worker, worker.submit_store, job_id, src, out.store_spec).success
    manager.complete_store(ks, ctx)
    return out


def test_vllm_request_hints_decide_what_reaches_g4(hdaemon):
    spec = vllm_spec(hdaemon.socket)
    manager = spec.get_manager()
    caches, _ = kv_caches(11)
    worker = spec.get_worker(caches)
    client = kvtier.Client(socket=hdaemon.socket, timeout_ms=5000)
    ns = spec.namespaces[0]
    before = g4_blocks(hdaemon)

    # Stored first, so an upload they should not get would be queued ahead
    # of the ones awaited below.
    plain = keys(2, b"plain")
    vllm_store(spec, worker, plain, ReqContext(req_id="plain"), 1)
    # Reuse expected for the request, ephemeral past token 32 (the prompt):
    # chunks ending at 16 and 32 go to G4, those ending at 48 and 64 never.
    tail = keys(4, b"tail")
    ctx = ReqContext(
        req_id="tail", kv_transfer_params={"kvtier_expected_reuse": 3, "kvtier_ephemeral_from_token": 32,
                                           "kvtier_priority": 7},
    )
    out = vllm_store(spec, worker, tail, ctx, 2)
    assert [(h.ephemeral, h.expected_reuse, h.priority) for h in out.store_spec.hints] == [
        (False, 3, 7), (False, 3, 7), (True, 3, 7), (True, 3, 7)]
    # The orchestrator's kv_hints envelope (e.g. Dynamo) carries the same.
    env = KvHintsEnvelope(
        protocol_version="1", message_id="m1",
        actions=[KvHintAction(action_id="a1", action_type="kvtier.hints", action_version="1",
                              payload={"expected_reuse": 1})],
    )
    pinned = keys(1, b"envelope")
    vllm_store(spec, worker, pinned, ReqContext(req_id="env", kv_hints=env), 3)
    # A chunk two requests missed on (a shared system prompt) is stored
    # with expected_reuse, with no hint from either request.
    shared = keys(1, b"shared")
    a, b = ReqContext(req_id="a"), ReqContext(req_id="b")
    assert manager.lookup(shared[0], a) == LookupResult.MISS
    assert manager.lookup(shared[0], a) == LookupResult.MISS  # a retry: same request
    assert manager.lookup(shared[0], b) == LookupResult.MISS
    out = vllm_store(spec, worker, shared, b, 4)
    assert out.store_spec.hints[0].expected_reuse == 1
    # A bad hint is ignored and counted, never a failed request.
    bad = keys(1, b"bad")
    vllm_store(spec, worker, bad, ReqContext(req_id="bad", kv_transfer_params={"kvtier_priority": 999}), 5)
    assert spec.counters.get("hint_errors") == 1

    expected = tail[:2] + pinned + shared
    wait_until(lambda: g4_blocks(hdaemon) >= before + len(expected), "hinted chunks never reached G4")
    everything = plain + tail + pinned + shared + bad
    assert [k for k, t in zip(everything, tiers(client, ns, everything)) if t != "g3"] == []
    assert client.evict(ns, everything) == ["ok"] * len(everything)
    assert tiers(client, ns, everything) == [
        None, None, "g4", "g4", None, None, "g4", "g4", None]
    assert g4_blocks(hdaemon) == before + len(expected)
    worker.shutdown()


def test_vllm_a_system_prompt_shared_by_requests_arriving_together_is_hinted_reuse(tmp_path, hdaemon):
    """The docs' example through vLLM's own scheduler: four requests with
    one system prompt (4 chunks) and a tail each, added together. The
    first computes the prompt; the other three take its blocks from vLLM's
    GPU prefix cache in the same step and look up only their tails, so
    they never missed on the prompt in kvtier, and it was stored with
    ``expected_reuse`` 0 (issue 43): under after-first-reuse it stayed off
    G4. Its chunks now carry 3 (three more requests needed them) and reach
    G4 at store time; each tail, needed by one request, carries 0 and does
    not."""
    e = Engine(tmp_path, hdaemon.socket)
    manager = e.scheduler.connector.connector_scheduler.manager
    ns = manager.namespaces[0]
    stores: list[tuple[str, list[bytes], list[int]]] = []
    prepare = manager.prepare_store

    def recorded(ks, ctx):
        out = prepare(ks, ctx)
        if out is not None and out.keys_to_store:
            stores.append((ctx.req_id, [connector_key(k) for k in out.keys_to_store],
                           [h.expected_reuse for h in out.store_spec.hints]))
        return out

    manager.prepare_store = recorded
    before = g4_blocks(hdaemon)
    system = [500 + i for i in range(4 * BLOCK_SIZE)]
    ids = [f"sys{r}" for r in range(4)]
    for r, req_id in enumerate(ids):
        e.add(req_id, system + [700 + 20 * r + j for j in range(BLOCK_SIZE + 3)])
    for req_id in ids:
        e.run(req_id)
    e.shutdown()
    assert [(r, reuse) for r, _, reuse in stores] == [
        ("sys0", [3, 3, 3, 3, 0]), ("sys1", [0]), ("sys2", [0]), ("sys3", [0])]
    prompt = stores[0][1][:4]
    tails = [stores[0][1][4]] + [ks[0] for _, ks, _ in stores[1:]]
    wait_until(lambda: g4_blocks(hdaemon) >= before + len(prompt), "the shared prompt never reached G4")
    # Off G3, the prompt is still served (from G4); the tails are gone.
    client = kvtier.Client(socket=hdaemon.socket, timeout_ms=5000)
    assert client.evict(ns, prompt + tails) == ["ok"] * 8
    assert tiers(client, ns, prompt + tails) == ["g4"] * 4 + [None] * 4
    assert g4_blocks(hdaemon) == before + len(prompt)


def test_vllm_lookup_prefetches_a_g4_chain_before_the_load(hdaemon):
    writer = vllm_spec(hdaemon.socket, kvtier_expected_reuse=1)
    caches, ts = kv_caches(12)
    worker = writer.get_worker(caches)
    client = kvtier.Client(socket=hdaemon.socket, timeout_ms=5000)
    ns = writer.namespaces[0]
    ks = keys(3, b"prefetch-vllm")
    before = g4_blocks(hdaemon)
    vllm_store(writer, worker, ks, ReqContext(req_id="w"), 1)
    to_g4_only(hdaemon, client, ns, ks, before)

    # Another engine (or a restart) serves a request with that prefix.
    spec = vllm_spec(hdaemon.socket)
    manager = spec.get_manager()
    caches2, ts2 = kv_caches(13)
    reader = spec.get_worker(caches2)
    ctx = ReqContext(req_id="r")
    manager.on_new_request(ctx)
    assert [manager.lookup(k, ctx) for k in ks] == [LookupResult.HIT_PENDING] * 3
    assert spec.counters.get("prefetch_blocks") == 3
    # vLLM defers the request and looks again until the chain is HIT.
    wait_until(lambda: [manager.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 3, "prefetch never landed")
    assert tiers(client, ns, ks) == ["g3"] * 3
    assert spec.counters.get("prefetch_landed") == 3
    load = manager.prepare_load(ks, ctx)
    dst = GPULoadStoreSpec([7, 8, 9], group_sizes=[3], block_indices=[0])
    assert run_job(reader, reader.submit_load, 2, load, dst).success
    manager.complete_load(ks, ctx)
    assert spec.counters.get("load_blocks_g3") == 3 and spec.counters.get("load_blocks_g4") == 0
    for layer in range(len(ts)):
        for s, d in [(1, 7), (2, 8), (3, 9)]:
            assert torch.equal(ts2[layer][d], ts[layer][s])
    worker.shutdown()
    reader.shutdown()


def test_vllm_prefetch_off_or_over_its_bound_is_a_plain_hit(hdaemon):
    writer = vllm_spec(hdaemon.socket, kvtier_expected_reuse=1)
    caches, _ = kv_caches(14)
    w = writer.get_worker(caches)
    client = kvtier.Client(socket=hdaemon.socket, timeout_ms=5000)
    ks = keys(2, b"prefetch-bounds")
    before = g4_blocks(hdaemon)
    vllm_store(writer, w, ks, ReqContext(req_id="w"), 1)
    to_g4_only(hdaemon, client, writer.namespaces[0], ks, before)
    # Off: a chunk on G4 is a HIT, loaded from G4 as without prefetch.
    off = vllm_spec(hdaemon.socket, kvtier_prefetch=False)
    ctx = ReqContext(req_id="off")
    assert [off.get_manager().lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 2
    assert off.counters.get("prefetches") == 0
    # Over the connector's bound: counted, and a plain HIT.
    one = vllm_spec(hdaemon.socket, kvtier_prefetch_inflight_max=1)
    ctx = ReqContext(req_id="one")
    assert [one.get_manager().lookup(k, ctx) for k in ks] == [LookupResult.HIT_PENDING, LookupResult.HIT]
    assert one.counters.get("prefetch_limited") == 1
    w.shutdown()


def test_sglang_batch_exists_prefetches_and_reuse_is_hinted(hdaemon):
    host = mha_host("page_first")
    fill_random(host, 21)
    cfg = storage_config(hdaemon.socket)
    b = sg_backend(cfg, host)
    client = kvtier.Client(socket=hdaemon.socket, timeout_ms=5000)
    hashes = [f"{i:064x}" for i in range(0xA100, 0xA103)]
    before = g4_blocks(hdaemon)
    # Two prefetch queries of the chain miss (two requests with the same
    # prefix): the pages are then stored with expected_reuse, so written
    # to G4 at once under after-first-reuse.
    assert b.batch_exists(hashes) == 0
    assert b.batch_exists(hashes) == 0
    assert all(b.batch_set_v1(hashes, indices([1, 2, 3])))
    ks = [bytes.fromhex(h) for h in hashes]
    to_g4_only(hdaemon, client, b.ns, ks, before)

    # A new request with that prefix: SGLang's prefetch thread asks
    # batch_exists, which prefetches into G3 ahead of batch_get_v1.
    b2 = sg_backend(storage_config(hdaemon.socket), host)
    assert b2.batch_exists(hashes, HiCacheStorageExtraInfo(prefix_keys=None)) == 3
    assert b2.counters.get("prefetch_blocks") == 3
    wait_until(lambda: tiers(client, b.ns, ks) == ["g3"] * 3, "prefetch never landed")
    want = page_bytes(host, [1, 2, 3])
    assert all(b2.batch_get_v1(hashes, indices([5, 6, 7])))
    assert b2.counters.get("load_blocks_g3") == 3
    assert b2.counters.get("prefetch_landed") == 3
    assert page_bytes(host, [5, 6, 7]) == want


def test_lmcache_request_configs_and_prefetch_at_lookup(hdaemon):
    backend, cpu, metadata = lm_setup(hdaemon.socket)
    client = kvtier.Client(socket=hdaemon.socket, timeout_ms=5000)
    plain = [lm_key(300 + i) for i in range(2)]
    hinted = [
        CacheEngineKey(
            "test/mistral", 1, 0, lm_key(310 + i).chunk_hash, torch.bfloat16,
            request_configs={"lmcache.kvtier.expected_reuse": 2},
        )
        for i in range(2)
    ]
    ns = backend._namespace(plain[0])
    assert backend._namespace(hinted[0]) is ns  # hints are not namespace tags
    before = g4_blocks(hdaemon)
    objs = [filled(cpu, metadata, 40 + i) for i in range(4)]
    want = [bytes(o.tensor.view(torch.uint8).numpy()) for o in objs]
    backend.batched_submit_put_task(plain + hinted, objs)
    ks = [chunk_key(k) for k in hinted]
    to_g4_only(hdaemon, client, ns, ks, before)
    everything = [chunk_key(k) for k in plain] + ks
    assert client.evict(ns, everything[:2]) == ["ok"] * 2
    assert tiers(client, ns, everything) == [None, None, "g4", "g4"]
    assert g4_blocks(hdaemon) == before + 2

    # LMCache's lookup before a retrieve prefetches the chunks on G4.
    assert backend.batched_contains(hinted) == 2
    assert backend.counters.get("prefetch_blocks") == 2
    wait_until(lambda: tiers(client, ns, ks) == ["g3"] * 2, "prefetch never landed")
    got = backend.batched_get_blocking(hinted)
    assert all(o is not None for o in got)
    assert backend.counters.get("load_blocks_g3") == 2
    assert backend.counters.get("prefetch_landed") == 2
    assert [bytes(o.tensor.view(torch.uint8).numpy()) for o in got] == want[2:]
    for o in got:
        o.ref_count_down()


def test_hint_parsing_bounds_and_reuse_tracker():
    from kvtier.integrations._common import (
        BlockHints,
        KvtierConfigError,
        ReuseTracker,
        base_hints,
        parse_hints,
        stream_id,
    )

    h, rest = parse_hints(
        {"kvtier_priority": "9", "kvtier_ephemeral": True, "kvtier_session": "s", "other": 1},
        "kvtier_", BlockHints(expected_reuse=2),
    )
    assert h == BlockHints(priority=9, ephemeral=True, expected_reuse=2) and rest == {"session": "s"}
    for bad in ({"kvtier_priority": 256}, {"kvtier_priority": True}, {"kvtier_pinned": "maybe"},
                {"kvtier_expected_reuse": -1}):
        with pytest.raises(ValueError, match="kvtier_"):
            parse_hints(bad, "kvtier_", BlockHints())
    with pytest.raises(KvtierConfigError, match="kvtier_priority must be 0..=255"):
        base_hints({"kvtier_priority": 300})
    assert BlockHints(expected_reuse=5).with_reuse(2).expected_reuse == 5
    assert BlockHints().with_reuse(1 << 20).expected_reuse == 65535
    t = ReuseTracker(max_keys=2)
    for req in ("a", "a", "b", "c"):
        t.seen(b"k", req)
    assert t.others(b"k") == 2  # a retry by the same request counts once
    t.seen(b"x")
    t.seen(b"y")  # over the bound: the least recently seen key is forgotten
    assert t.others(b"k") == 0
    assert stream_id(b"a") != stream_id(b"b") and all(stream_id(i) > 0 for i in range(100))


def test_prefetch_against_a_dead_daemon_is_counted_never_raised(tmp_path):
    from kvtier.integrations._common import Counters, FailOpen, Prefetcher

    client = kvtier.Client(socket=str(tmp_path / "nobody.sock"), timeout_ms=200)
    counters = Counters()
    p = Prefetcher(client, counters, FailOpen("test", counters), {})
    ns = kvtier.Namespace("dead", kvtier.Layout.with_block_bytes(4096), hash_mode="opaque")
    assert p.request(ns, [b"k1", b"k2"], ["g4", "g3"], stream=1) == []
    assert not p.pending(ns, b"k3", "peer")
    assert counters.get("prefetch_failures") == 2 and counters.get("errors") == 2
