"""kvtier under vLLM 0.33.0's real Scheduler and worker connector
(vllm_engine.Engine: the engine core's step loop on CPU, a tiny local
Llama config, ``load_format="dummy"``): a stored prefix is loaded, and a
load that fails after the scheduler's lookup said HIT (every block file
corrupt, or the daemon killed between lookup and load) is recomputed by
the scheduler while the engine goes on. Before KvtierConnector, vLLM's
``assert transfer_result.success`` ended the engine there."""

from __future__ import annotations

import pytest
from conftest import support
from vllm_engine import BLOCK_SIZE, Engine

PROMPT = [100 + i for i in range(4 * BLOCK_SIZE + 5)]  # 4 full blocks and a tail
CACHED = 4 * BLOCK_SIZE


@pytest.fixture
def g3_daemon():
    # No G4: a corrupt G3 copy has nowhere to be repaired from.
    d = support.Daemon(g4=False)
    yield d
    d.close()


def store_prompt(tmp_path, socket) -> None:
    e = Engine(tmp_path, socket)
    e.add("writer", PROMPT)
    e.run("writer")
    assert e.computed["writer"] == len(PROMPT)
    c = e.counters()
    assert c.get("store_blocks", 0) >= CACHED // BLOCK_SIZE
    assert c["store_bytes"] == c["store_blocks"] * e.spec.chunk_bytes  # what was stored, not 0
    e.shutdown()


def test_a_stored_prefix_is_loaded_not_recomputed(tmp_path, g3_daemon):
    store_prompt(tmp_path, g3_daemon.socket)
    e = Engine(tmp_path, g3_daemon.socket)
    # Host KV caches are read over passed fds unless the deployment says
    # otherwise (BENCHMARKS.md, vllm_scheduler: the read in about half the
    # time of the shared region's).
    assert e.worker.connector_worker.worker.client.direct_read is True
    e.add("reader", PROMPT)
    e.run("reader")
    assert e.finished["reader"]
    # Only the tail past the cached blocks was computed.
    assert e.computed["reader"] == len(PROMPT) - CACHED
    c = e.counters()
    assert c.get("lookup_hits", 0) >= 1 and c.get("load_blocks") == CACHED // BLOCK_SIZE, c
    e.shutdown()


@pytest.mark.parametrize("restart", [None, "clean", "kill9"], ids=["in-place", "after-restart", "after-kill9"])
def test_corrupt_blocks_are_recomputed_and_the_engine_goes_on(tmp_path, g3_daemon, restart):
    store_prompt(tmp_path, g3_daemon.socket)
    assert support.corrupt_every_block_file(g3_daemon) >= CACHED // BLOCK_SIZE
    if restart:
        g3_daemon.restart(clean=restart == "clean")
    e = Engine(tmp_path, g3_daemon.socket)
    e.add("reader", PROMPT)
    e.run("reader")
    c = e.counters()
    quarantined = [p for p in (g3_daemon.dir / "g3" / "quarantine").glob("*") if p.is_file()]
    if restart == "kill9" and c.get("lookup_hits", 0) == 0:
        # After an unclean stop kvtierd verifies, at open, the files its
        # index had not committed yet: those corrupt copies are quarantined
        # before any lookup (how many the index held by then is the group
        # commit's timing; the first block, at least, was not served).
        assert quarantined, c
    else:
        # The scheduler's lookup said HIT (after a clean restart kvtierd
        # trusts its index and verifies payloads on read; its scrub's first
        # pass is an hour away), the load came back corrupt and was
        # reported; the scheduler recomputed the whole prompt.
        assert c.get("lookup_hits", 0) >= 1 and c.get("load_failures", 0) >= 1, c
        assert c.get("load_errors_reported", 0) >= 1, c
        assert quarantined, "the reported corrupt copies were not quarantined"
    assert c.get("load_blocks", 0) == 0, c
    assert e.finished["reader"]
    assert e.computed["reader"] == len(PROMPT)
    # The engine goes on with other requests.
    e.add("next", [7] * (2 * BLOCK_SIZE + 1))
    e.run("next")
    assert e.finished["next"]
    e.shutdown()


def test_daemon_killed_between_lookup_and_load_is_a_recompute(tmp_path, g3_daemon):
    store_prompt(tmp_path, g3_daemon.socket)
    e = Engine(tmp_path, g3_daemon.socket)
    killed = []

    def kill_after_lookup(so):
        if so.kv_connector_metadata.load_jobs and not killed:
            g3_daemon.kill9()
            killed.append(True)

    e.before_load = kill_after_lookup
    e.add("reader", PROMPT)
    e.run("reader")
    assert killed, "the scheduler never scheduled a load"
    c = e.counters()
    assert c.get("lookup_hits", 0) >= 1 and c.get("load_errors_reported", 0) >= 1, c
    assert e.finished["reader"] and e.computed["reader"] == len(PROMPT)
    # kvtierd back: the engine keeps using it.
    g3_daemon.start()
    e.add("next", [9] * (2 * BLOCK_SIZE + 1))
    e.run("next")
    assert e.finished["next"]
    e.shutdown()
