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


@pytest.mark.parametrize("direct_read", [None, True], ids=["default-region", "fd"])
def test_a_stored_prefix_is_loaded_not_recomputed(tmp_path, g3_daemon, direct_read):
    store_prompt(tmp_path, g3_daemon.socket)
    extra = {} if direct_read is None else {"kvtier_direct_read": direct_read}
    e = Engine(tmp_path, g3_daemon.socket, **extra)
    # Host KV caches of chunks up to kvtierd's default slot_max (these)
    # come through the shared region unless the deployment says otherwise
    # (BENCHMARKS.md, vllm_scheduler: slotted chunks by fd are sealed
    # copies); larger chunks over passed fds.
    assert e.worker.connector_worker.worker.client.direct_read is bool(direct_read)
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
        # After an unclean stop kvtierd verifies, at open, the blocks its
        # index had not committed yet (how many it held by then is the
        # group commit's timing): a corrupt file is quarantined, a corrupt
        # slab slot is a write the crash cut short (left free, counted in
        # kvtier_g3_recovered_at_open{found="slots_torn"}). Either way the
        # first block was not offered: nothing loaded (asserted below).
        assert c.get("lookup_misses", 0) >= 1, c
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


# -- chains (issue 43) ---------------------------------------------------------

# A chat through vLLM's scheduler: each turn's prompt is the turn before,
# the engine's 2 answer tokens and the user's next 46 tokens, so every turn
# adds 3 full blocks (turn k: 48k + 5 prompt tokens).
TURNS = 4
USER_TOKENS = 46


def chat(e: Engine, chat_id: int, turns: int = TURNS) -> list[int]:
    """Runs a chat's turns through the engine; the last turn's prompt and
    answer (every token whose KV was stored)."""
    prompt = [200 + chat_id * 1000 + i for i in range(3 * BLOCK_SIZE + 5)]
    for t in range(turns):
        rid = f"chat{chat_id}-turn{t}"
        e.add(rid, prompt)
        e.run(rid)
        prompt = prompt + e.finished[rid] + [
            300 + chat_id * 1000 + t * 100 + i for i in range(USER_TOKENS)
        ]
    return prompt[: -USER_TOKENS]


def held(e: Engine, socket: str, tokens: list[int]) -> list[bool]:
    """Per full block of ``tokens``: whether kvtier holds its chunk (each
    key asked on its own, so a hole shows)."""
    import kvtier
    from kvtier.integrations._common import connector_keys
    from vllm.v1.kv_offload.base import make_offload_key

    req = Engine.request("probe", tokens)
    keys = connector_keys([make_offload_key(h, 0) for h in req.block_hashes])
    ns = e.spec.namespaces[0]
    c = kvtier.Client(socket=socket, timeout_ms=5000)
    return [c.lookup(ns, [k]).prefix_len == 1 for k in keys]


def test_a_chat_under_g3_pressure_keeps_a_reachable_prefix_and_loses_its_tail_first(tmp_path):
    """Each later turn's first chunk is stored under the turn before's last
    one (KvtierOffloadingManager hands the worker each chunk's parent from
    vLLM's key positions), so kvtier keeps the chat one chain and its
    leaves-first eviction takes the chat from its end: what it holds of
    the chat is a prefix. Stored as new roots (before issue 43), every
    turn's end was a leaf; the end of turn 1 went first and left turns
    2-4 held and unreachable."""
    import kvtier

    d = support.Daemon(g4=False, g3_capacity="1MiB")
    try:
        e = Engine(tmp_path, d.socket)
        tokens = chat(e, 1)
        before = held(e, d.socket, tokens)
        assert before == [True] * (TURNS * 3), before
        # Pressure: other blocks of the model stored after the chat, two
        # at a time, until G3's eviction has taken some of the chat.
        ns = e.spec.namespaces[0]
        c = kvtier.Client(socket=d.socket, timeout_ms=5000)
        payload = bytes(ns.block_bytes)
        for i in range(400):
            keys = [(10**9 + 2 * i + j).to_bytes(8, "big") for j in range(2)]
            assert all(r.ok for r in c.offload(ns, keys, [payload, payload]))
            after = held(e, d.socket, tokens)
            if not all(after):
                break
        e.shutdown()
    finally:
        d.close()
    n = after.index(False) if False in after else len(after)
    assert not any(after[n:]), f"the chat's chain has holes: {after}"
    assert 0 < n < len(after), f"pressure evicted {len(after) - n} of the chat's {len(after)} blocks: {after}"


def test_a_failed_chunk_fails_itself_and_what_follows_not_the_load(tmp_path, g3_daemon):
    """One corrupt chunk in the middle of a stored prompt: the load job
    reports only that chunk's block and those after it (vLLM's scheduler
    recomputes from there), not every block of the job; the chunks before
    it are loaded."""
    store_prompt(tmp_path, g3_daemon.socket)
    from kvtier.integrations._common import connector_keys
    from vllm.v1.kv_offload.base import make_offload_key

    req = Engine.request("probe", PROMPT)
    keys = connector_keys([make_offload_key(h, 0) for h in req.block_hashes])
    e = Engine(tmp_path, g3_daemon.socket)
    ns = e.spec.namespaces[0]
    # The third chunk's bytes (its file or its slab slot).
    [(path, at)] = [
        (p, o)
        for p, o, n, k in support.g3_blocks(g3_daemon.dir / "g3")
        if n == ns.id and k.startswith(keys[2].hex())
    ]
    support.flip_at(path, at + 4096 + 17)
    e.add("reader", PROMPT)
    e.run("reader")
    c_ = e.counters()
    assert c_.get("load_failures") == 1 and c_.get("load_blocks") == 3, c_
    assert c_.get("load_errors_reported", 0) == 1, c_
    # The scheduler recomputed from the corrupt chunk on: 2 chunks loaded
    # and kept, the rest computed (all of it before issue 43).
    assert e.computed["reader"] == len(PROMPT) - 2 * BLOCK_SIZE, e.computed
    e.shutdown()
