"""MLA at tensor-parallel size > 1 under vLLM 0.33.0's real Scheduler and
worker connectors (vllm_engine.Engine with a tiny local DeepSeek-V2
config: vLLM's ``replicated_layout``, every rank holding the same latent
KV): kvtier stores each chunk once (rank 0 writes, vLLM's own
store-writer rule, under one namespace without rank or TP size), and
every rank, at any TP size, loads that copy."""

from __future__ import annotations

import pytest
from conftest import support
from vllm_engine import BLOCK_SIZE, LAYERS, Engine

CHUNKS = 4
PROMPT = [500 + i for i in range(CHUNKS * BLOCK_SIZE + 5)]


@pytest.fixture
def g3_daemon():
    d = support.Daemon(g4=False)
    yield d
    d.close()


def block_files(d) -> int:
    """Blocks on G3's disk (files and slab slots, not the index)."""
    return sum(1 for _ in support.g3_blocks(d.dir / "g3"))


def test_mla_is_stored_once_and_every_rank_at_any_tp_size_loads_it(tmp_path, g3_daemon):
    w = Engine(tmp_path, g3_daemon.socket, tp=2, mla=True)
    spec = w.workers[1].connector_worker.spec
    assert spec.replicated_layout and len(spec.namespaces) == 1 and spec.namespaces[0].rank is None
    w.add("writer", PROMPT)
    w.run("writer")
    assert w.counters(0).get("store_blocks") == CHUNKS
    assert w.counters(1).get("store_blocks", 0) == 0  # rank 1 does not store its identical copy
    assert block_files(g3_daemon) == CHUNKS  # one copy (per rank it was CHUNKS * 2)
    w.shutdown()

    for tp in (2, 4):
        e = Engine(tmp_path, g3_daemon.socket, tp=tp, mla=True)
        assert e.workers[0].connector_worker.spec.namespaces[0].id == spec.namespaces[0].id
        rid = f"reader-tp{tp}"
        e.add(rid, PROMPT)
        e.run(rid)
        # Every full chunk was loaded, on every rank; only the tail computed.
        assert e.computed[rid] == len(PROMPT) - CHUNKS * BLOCK_SIZE, e.computed
        for rank in range(tp):
            c = e.counters(rank)
            assert c.get("load_blocks") == CHUNKS and c.get("load_failures", 0) == 0, (rank, c)
            for layer in LAYERS:
                assert e.kvs[rank][layer].equal(e.kvs[0][layer]), (rank, layer)
        # The loaded rows are the writer's: each position's value.
        got = set(e.kvs[0][LAYERS[1]][:, :, 0].flatten().tolist())
        want = {float(PROMPT[0] * 10_000 + pos * 10 + 1) for pos in range(CHUNKS * BLOCK_SIZE)}
        assert want <= got
        # A lookup asks one namespace: one lookup request per scheduling pass.
        assert e.counters().get("lookup_requests", 0) >= 1
        e.shutdown()
    assert block_files(g3_daemon) == CHUNKS


def test_mha_at_tp_2_keeps_a_copy_per_rank(tmp_path, g3_daemon):
    """The contrast: MHA's ranks hold different heads, each its own copy."""
    w = Engine(tmp_path, g3_daemon.socket, tp=2)
    spec = w.workers[0].connector_worker.spec
    assert not spec.replicated_layout and [ns.rank for ns in spec.namespaces] == [0, 1]
    w.add("writer", PROMPT)
    w.run("writer")
    assert w.counters(0).get("store_blocks") == CHUNKS and w.counters(1).get("store_blocks") == CHUNKS
    assert block_files(g3_daemon) == CHUNKS * 2
    w.shutdown()
