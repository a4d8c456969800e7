"""One definition of a chain (issue 27): however a token list is split into
offloads, and however the hints change inside a batch, the keys are those of
hashing the whole list and every block is announced under its true parent.
The daemon's own stored events are the judge.

Examples: 25 here; `KVTIER_HYPOTHESIS_EXAMPLES=500 pytest tests/test_chains.py`
for a longer run."""

from __future__ import annotations

import itertools
import os
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.integrations._common import BlockHints, offload_grouped

BLOCK_BYTES = 4096
TOKENS = 16
EXAMPLES = int(os.environ.get("KVTIER_HYPOTHESIS_EXAMPLES", "25"))
_salts = itertools.count()


def stored_parents(events, want: int, deadline_s: float = 30.0) -> dict:
    """Parent of every block the daemon announced on G3 (a stored event's
    first block hangs under its parent_hash, each later one under the block
    before it), until `want` blocks were seen."""
    parent_of: dict = {}
    end = time.monotonic() + deadline_s
    while len(parent_of) < want:
        assert time.monotonic() < end, f"only {len(parent_of)} of {want} blocks announced"
        ev = next(events, None)
        if ev is None or ev.get("storage_tier") != "Disk":
            continue
        stored = ev["data"].get("stored") if isinstance(ev["data"], dict) else None
        if stored is None:
            continue
        p = stored["parent_hash"]
        for b in stored["blocks"]:
            parent_of[b["block_hash"]] = p
            p = b["block_hash"]
    return parent_of


hints_st = st.sampled_from(
    [BlockHints(), BlockHints(priority=3), BlockHints(ephemeral=True), BlockHints(expected_reuse=2)]
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    blocks=st.integers(min_value=1, max_value=10),
    cuts=st.lists(st.integers(min_value=1, max_value=9), max_size=4),
    hints=st.lists(hints_st, min_size=10, max_size=10),
    mode=st.sampled_from(["blake3", "dynamo"]),
    chained_parent=st.booleans(),
)
def test_parts_and_changing_hints_give_the_whole_chain(daemon, blocks, cuts, hints, mode, chained_parent):
    ns = kvtier.Namespace(
        "py-chains/model",
        kvtier.Layout.with_block_bytes(BLOCK_BYTES),
        tenant_salt=f"chains-{next(_salts)}".encode(),
        hash_mode=mode,
    )
    client = kvtier.Client(socket=daemon.socket, timeout_ms=5000)
    events = client.events(timeout_ms=200)
    # An earlier prefix stored first, so the token list continues a chain.
    head_tokens = list(range(100, 100 + TOKENS)) if chained_parent else []
    head = ns.hash_chain(head_tokens)
    if head:
        assert all(client.offload(ns, head, [bytes(BLOCK_BYTES)]))
    tokens = list(range(1000, 1000 + blocks * TOKENS))
    whole = ns.hash_chain(head_tokens + tokens)[len(head):]
    assert len(whole) == blocks
    # Hash the tokens in parts, each after the last key of the part before.
    at = sorted({c for c in cuts if c < blocks} | {0, blocks})
    keys: list = []
    for a, b in zip(at, at[1:]):
        parent = keys[-1] if keys else (head[-1] if head else None)
        keys += ns.hash_chain(tokens[a * TOKENS : b * TOKENS], parent=parent)
    assert keys == whole
    # Offload them as one batch whose hints change block by block.
    bufs = [bytes([i + 1]) * BLOCK_BYTES for i in range(blocks)]
    res = offload_grouped(client, ns, keys, bufs, hints[:blocks], head[-1] if head else None)
    assert [bool(r) for r in res] == [True] * blocks, res
    parent_of = stored_parents(events, blocks + len(head))
    chain = head + keys
    for i, k in enumerate(chain):
        want = chain[i - 1].hex() if i else None
        assert parent_of[k.hex()] == want, f"block {i} announced under {parent_of[k.hex()]}, not {want}"
    events.close()


def test_the_issue_repro_offload_grouped_parents(daemon):
    """99 -> a0 -> a1 -> a2 -> a3 with hints A, B, A, B: a1's parent was
    stored as 99 and a2's as a0."""
    ns = kvtier.Namespace("py-chains/repro", kvtier.Layout.with_block_bytes(BLOCK_BYTES), tenant_salt=b"repro")
    client = kvtier.Client(socket=daemon.socket, timeout_ms=5000)
    events = client.events(timeout_ms=200)
    root = b"\x99" * 32
    assert all(client.offload(ns, [root], [bytes(BLOCK_BYTES)]))
    keys = [bytes([0xA0 + i]) * 32 for i in range(4)]
    a, b = BlockHints(), BlockHints(priority=5)
    res = offload_grouped(client, ns, keys, [bytes([i]) * BLOCK_BYTES for i in range(4)], [a, b, a, b], root)
    assert all(res)
    parent_of = stored_parents(events, 5)
    chain = [root] + keys
    assert [parent_of[k.hex()] for k in keys] == [c.hex() for c in chain[:-1]]
    events.close()


def test_hash_chain_parent_of_the_wrong_mode_is_an_error():
    ns = kvtier.Namespace("py-chains/m", kvtier.Layout.with_block_bytes(BLOCK_BYTES), hash_mode="dynamo")
    try:
        ns.hash_chain(list(range(32)), parent=b"\x01" * 32)
    except kvtier.Error:
        pass
    else:
        raise AssertionError("a 32-byte parent was taken in dynamo mode")
