"""Dynamo's nvext hints into kvtier's (kvtier.integrations.dynamo), and its
pin_prefix against a real kvtierd."""

import time

import numpy as np
import pytest

import kvtier
from conftest import BLOCK
from kvtier.integrations._common import BlockHints, parse_hints
from kvtier.integrations.dynamo import hints_payload, pin_prefix, transfer_params, ttl_seconds

TPB = 16  # tokens per block of Layout.with_block_bytes


def test_nvext_fields_map_to_kvtier_hints_and_bad_ones_name_the_field():
    nvext = {
        "agent_hints": {"priority": 7, "speculative_prefill": True, "osl": 512, "latency_sensitivity": 1.2},
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
        "greed_sampling": True,
    }
    got = hints_payload(nvext, prompt_tokens=64, reasoning=True)
    assert got == {"priority": 7, "expected_reuse": 1, "pinned": True, "ephemeral_from_token": 64}
    # What the connectors read: the payload of a kvtier.hints action, or
    # kv_transfer_params with the prefix; both give the same hints.
    h, rest = parse_hints(got, "", BlockHints())
    assert h == BlockHints(priority=7, pinned=True, ephemeral=False, expected_reuse=1)
    assert rest == {"ephemeral_from_token": 64}
    assert parse_hints(transfer_params(nvext, prompt_tokens=64, reasoning=True), "kvtier_", BlockHints()) == (h, rest)
    # Without reasoning the decode tokens may be the next turn's prefix.
    assert "ephemeral_from_token" not in hints_payload(nvext, prompt_tokens=64)
    assert hints_payload(None) == {} and hints_payload({"agent_hints": {"osl": 10}}) == {}
    assert hints_payload({"agent_hints": {"speculative_prefill": False}}) == {}
    # Direction and range of priorities.
    assert hints_payload({"agent_hints": {"priority": 999}})["priority"] == 255
    assert hints_payload({"agent_hints": {"priority": -3}})["priority"] == 0
    assert hints_payload({"agent_hints": {"priority": -3}}, priority_order="lower_first")["priority"] == 3
    assert hints_payload({"agent_hints": {"priority": 0}}, priority_order="lower_first")["priority"] == 0
    for bad, field in [
        ({"agent_hints": {"priority": "high"}}, "agent_hints.priority"),
        ({"agent_hints": {"speculative_prefill": "yes"}}, "speculative_prefill"),
        ({"agent_hints": [1]}, "nvext.agent_hints"),
        ({"cache_control": {"type": "persistent"}}, "cache_control.type"),
    ]:
        with pytest.raises(ValueError, match=field):
            hints_payload(bad)
    with pytest.raises(ValueError, match="priority_order"):
        hints_payload({}, priority_order="up")
    with pytest.raises(ValueError, match="prompt_tokens"):
        hints_payload({"agent_hints": {}}, prompt_tokens=-1, reasoning=True)


def test_cache_control_ttl_is_read_as_dynamo_reads_it():
    # Dynamo: integer seconds or 5m / 1h, clamped to [300, 3600] s,
    # anything unrecognised is 300 s.
    cases = {"600": 600, 600: 600, "5m": 300, "1h": 3600, "2h": 3600, "10s": 300, "45m": 2700,
             "1d": 300, "soon": 300, None: 300, True: 300, " 900 ": 900}
    assert {k: ttl_seconds(k) for k in cases} == cases


def wait_for_g4(daemon, n):
    deadline = time.monotonic() + 20
    while sum(1 for p in (daemon.dir / "g4").rglob("*") if p.is_file() and "#" not in p.name and "blocks" in p.parts) < n:
        assert time.monotonic() < deadline, "never written through to G4"
        time.sleep(0.05)


def test_pin_prefix_pins_the_router_keys_for_the_ttl_from_any_tier(daemon, client):
    ns = kvtier.Namespace("py-dynamo/model", kvtier.Layout.with_block_bytes(BLOCK), tenant_salt=b"py",
                          hash_mode="dynamo")
    tokens = list(range(1000, 1000 + TPB * 4))
    keys = ns.hash_chain(tokens)
    assert len(keys) == 4 and all(len(k) == 8 for k in keys)  # Dynamo sequence hashes
    rng = np.random.default_rng(5)
    data = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(4)]
    h, _ = parse_hints(hints_payload({"agent_hints": {"priority": 9, "speculative_prefill": True}}), "",
                       BlockHints())
    assert all(client.offload(ns, keys, data, **h.kwargs()))
    wait_for_g4(daemon, 4)
    # The last two only in G4: the daemon brings them back to pin them.
    assert client.evict(ns, keys[2:]) == ["ok", "ok"]
    assert client.lookup(ns, keys).tiers == ["g3", "g3", "g4", "g4"]
    before = time.time() * 1000
    got = pin_prefix(client, ns, tokens + [1, 2, 3], ttl="10m")  # a partial block is not a key
    assert got == {"status": "ok", "nodes_pinned": 4, "absent": 0, "limited": 0, "ttl_s": 600}
    assert client.lookup(ns, keys).tiers == ["g3"] * 4
    for s in client.stat(ns, keys):
        assert before + 598_000 <= s["pinned_until_unix_ms"] <= time.time() * 1000 + 601_000
    assert client.evict(ns, keys) == ["limit_reached"] * 4
    other = ns.hash_chain(list(range(TPB)))
    assert pin_prefix(client, ns, list(range(TPB)))["absent"] == len(other) == 1
    out = [np.zeros(BLOCK, np.uint8) for _ in range(4)]
    # (The first read of a promoted block reports the tier it came from.)
    assert all(client.onboard_into(ns, keys, out))
    assert all(np.array_equal(a, b) for a, b in zip(data, out))
    assert pin_prefix(client, ns, [1, 2]) == {"status": "ok", "nodes_pinned": 0, "absent": 0, "limited": 0,
                                              "ttl_s": 300}


def test_pin_prefix_with_the_daemon_down_is_an_error_answer_not_an_exception(tmp_path):
    ns = kvtier.Namespace("m", kvtier.Layout.with_block_bytes(BLOCK), hash_mode="dynamo")
    dead = kvtier.Client(socket=str(tmp_path / "none.sock"), timeout_ms=500)
    got = pin_prefix(dead, ns, list(range(TPB)))
    assert got["status"] == "error" and "kvtier pin_prefix failed" in got["message"]
