"""Round trips through a real kvtierd, byte-exact, with every buffer kind."""

import ctypes
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier

from conftest import BLOCK


def payloads(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def test_numpy_roundtrip_lookup_and_tiers(client, ns):
    keys = ns.hash_chain(np.arange(16 * 4, dtype=np.int64))
    assert len(keys) == 4 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert client.lookup(ns, keys).prefix_len == 0
    data = payloads(4)
    res = client.offload(ns, keys[:3], data[:3])
    assert [r.status for r in res] == ["stored"] * 3 and all(res)
    again = client.offload(ns, keys[:1], data[:1])
    assert again[0].status == "already_present" and again[0]
    found = client.lookup(ns, keys)
    assert found.prefix_len == 3 and len(found) == 3 and found.tiers == ["g3"] * 3
    assert found.reason is None
    out = [np.zeros(BLOCK, np.uint8) for _ in range(4)]
    got = client.onboard_into(ns, keys, out)
    assert [r.ok for r in got] == [True, True, True, False]
    assert got[0].tier == "g3" and got[0].nbytes == BLOCK
    assert got[3].status == "miss" and got[3].reason == "absent" and not got[3]
    for a, b in zip(data[:3], out[:3]):
        assert np.array_equal(a, b)


def test_bytearray_memoryview_and_raw_pointer(client, ns):
    keys = ns.hash_chain(list(range(16 * 3)))
    data = payloads(3, seed=1)
    src = [bytearray(data[0].tobytes()), memoryview(data[1].tobytes()), (data[2].ctypes.data, BLOCK)]
    assert all(client.offload(ns, keys, src))
    dst_ba = bytearray(BLOCK)
    dst_mv = memoryview(bytearray(BLOCK))
    raw = (ctypes.c_uint8 * BLOCK)()
    got = client.onboard_into(ns, keys, [dst_ba, dst_mv, (ctypes.addressof(raw), BLOCK)])
    assert all(got), got
    assert bytes(dst_ba) == data[0].tobytes()
    assert dst_mv.tobytes() == data[1].tobytes()
    assert bytes(raw) == data[2].tobytes()


class DlpackOnly:
    """Exposes a numpy array through DLPack alone (as a CPU torch tensor does)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, *args, **kw):
        return self.a.__dlpack__(*args, **kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_cpu_tensors_and_float_arrays(client, ns):
    keys = ns.hash_chain(list(range(32)))
    data = payloads(2, seed=2)
    f16 = data[1].view(np.float16).reshape(128, -1)  # any dtype, any shape
    assert all(client.offload(ns, keys, [DlpackOnly(data[0]), f16]))
    out0 = np.zeros(BLOCK, np.uint8)
    out1 = np.zeros(BLOCK // 4, np.float32)
    assert all(client.onboard_into(ns, keys, [DlpackOnly(out0), out1]))
    assert np.array_equal(out0, data[0])
    assert out1.tobytes() == data[1].tobytes()


def test_hash_modes_and_keys(client):
    lay = kvtier.Layout.with_block_bytes(4096)
    b3 = kvtier.Namespace("m", lay, tenant_salt=b"s")
    dy = kvtier.Namespace("m", lay, tenant_salt=b"s", hash_mode="dynamo")
    op = kvtier.Namespace("m", lay, tenant_salt=b"s", hash_mode="opaque", rank=1)
    toks = np.arange(48, dtype=np.uint32)
    assert b3.hash_chain(toks) == b3.hash_chain(list(range(48)))
    assert b3.hash_chain(toks) == b3.hash_chain(toks.astype(np.int32))
    assert [len(k) for k in dy.hash_chain(toks)] == [8, 8, 8]
    assert op.hash_chain(toks) == [] and op.rank == 1 and op.hash_mode == "opaque"
    assert len({b3.id, dy.id, op.id}) == 3
    # Opaque keys are the engine's: ints and bytes.
    keys = [12345, (2**64 - 1), b"engine-key"]
    data = [bytes([i]) * 4096 for i in range(3)]
    assert all(client.offload(op, keys, data))
    out = [bytearray(4096) for _ in range(3)]
    assert all(client.onboard_into(op, keys, out))
    assert [bytes(o) for o in out] == data


def test_pin_unpin_evict_stat_stats_events(client, ns):
    keys = ns.hash_chain(list(range(32)))
    events = client.events(timeout_ms=3000)
    data = payloads(2, seed=3)
    assert all(client.offload(ns, keys, data))
    ev = next(events)
    assert isinstance(ev, dict)
    events.close()
    st0 = client.stat(ns, keys + [b"\x01" * 32])
    assert st0[0]["nbytes"] == BLOCK and st0[0]["tier"] == "g3" and st0[2] is None
    assert len(st0[0]["checksum"]) == 32 and st0[0]["checksum_algo"] == "xxh3-128"
    assert client.pin(ns, keys[:1], ttl_ms=60_000) == ["ok"]
    assert client.stat(ns, keys[:1])[0]["pinned_until_unix_ms"] > 0
    assert client.evict(ns, keys[:1]) == ["limit_reached"]
    assert client.unpin(ns, keys[:1]) == ["ok"]
    assert client.evict(ns, keys[:1]) == ["ok"]
    # Evicting the chain's first block takes its G3 descendants along, so
    # the second one is already gone from G3 ("absent"), unless it was
    # not yet linked when the first went ("ok").
    assert client.evict(ns, keys[1:]) in (["ok"], ["absent"])
    # G3 holds neither now; G4 may hold none, the first, or both (its
    # write-through runs in the background, one upload at a time).
    after = client.lookup(ns, keys)
    assert after.prefix_len <= 2 and all(t == "g4" for t in after.tiers), after
    s = client.stats()
    assert isinstance(s, dict) and "tiers" in s


def split(block, cuts):
    cuts = sorted(set(c for c in cuts if 0 < c < block))
    edges = [0] + cuts + [block]
    return [(a, b) for a, b in zip(edges, edges[1:])]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cuts_in=st.lists(st.integers(1, BLOCK - 1), max_size=6),
    cuts_out=st.lists(st.integers(1, BLOCK - 1), max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_scatter_gather_equals_contiguous(client, ns, cuts_in, cuts_out, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, BLOCK, dtype=np.uint8)
    key = kvtier.Namespace("sg", ns.layout, tenant_salt=seed.to_bytes(8, "little")).hash_chain(list(range(16)))
    sg_ns = kvtier.Namespace("sg", ns.layout, tenant_salt=seed.to_bytes(8, "little"))
    # Gather: the block is offloaded from scattered segments of other arrays.
    segs = [data[a:b].copy() for a, b in split(BLOCK, cuts_in)]
    assert all(client.offload(sg_ns, key, [segs]))
    # Contiguous onboard gives the same bytes.
    whole = np.zeros(BLOCK, np.uint8)
    assert all(client.onboard_into(sg_ns, key, [whole]))
    assert np.array_equal(whole, data)
    # Scatter: onboard into segments placed in separate arrays.
    outs = [np.zeros(b - a, np.uint8) for a, b in split(BLOCK, cuts_out)]
    assert all(client.onboard_into(sg_ns, key, [outs]))
    assert np.array_equal(np.concatenate(outs), data)


def test_layer_separate_segments(client):
    lay = kvtier.Layout(layers=4, kv_heads=2, head_dim=64, dtype="f16", tokens_per_block=16, layer_separate=True)
    ns = kvtier.Namespace("layers", lay)
    key = ns.hash_chain(list(range(16)))
    layers = [np.full(lay.layer_bytes, i + 1, np.uint8) for i in range(4)]
    assert all(client.offload(ns, key, [layers]))
    out = [np.zeros(lay.layer_bytes, np.uint8) for _ in range(4)]
    assert all(client.onboard_into(ns, key, [out]))
    assert all(np.array_equal(a, b) for a, b in zip(layers, out))


def test_prefetch_brings_an_evicted_chain_back_before_its_request(daemon, client, ns):
    keys = ns.hash_chain(list(range(16 * 3)))
    data = payloads(3, seed=9)
    assert all(client.offload(ns, keys, data))
    # Written through to G4 (file:// here): then evicted from G3, the chain
    # is one fetch away.
    deadline = time.monotonic() + 20
    while True:
        uploaded = [p for p in (daemon.dir / "g4").rglob("*") if p.is_file() and "#" not in p.name]
        if sum(1 for p in uploaded if "blocks" in p.parts) >= 3:
            break
        assert time.monotonic() < deadline, "never written through to G4"
        time.sleep(0.05)
    assert client.evict(ns, keys) == ["ok"] * 3
    assert client.lookup(ns, keys).tiers == ["g4"] * 3
    assert client.prefetch(ns, keys, deadline_ms=20_000, stream=5) == ["ok"] * 3
    deadline = time.monotonic() + 20
    while client.lookup(ns, keys).tiers != ["g3"] * 3:
        assert time.monotonic() < deadline, client.lookup(ns, keys).tiers
        time.sleep(0.05)
    out = [np.zeros(BLOCK, np.uint8) for _ in range(3)]
    got = client.onboard_into(ns, keys, out)
    assert [r.tier for r in got] == ["g3"] * 3
    for a, b in zip(data, out):
        assert np.array_equal(a, b)
    assert client.prefetch(ns, keys) == ["already_present"] * 3
    with pytest.raises(kvtier.ArgumentError):
        client.prefetch(ns, keys, deadline_ms=-1)


def test_pins_past_the_budget_are_stored_unpinned(start_daemon, ns):
    # G3 of 4 MiB: its pin budget (half) holds 7 blocks of 256 KiB (+4 KiB
    # header each). Past it a pinned offload is stored but answered
    # "stored_unpinned", never a plain "stored" (issue 27).
    d = start_daemon(g4=False)
    d.kill9()
    d.args[d.args.index("--g3-capacity") + 1] = "4MiB"
    d.start()
    client = kvtier.Client(socket=d.socket, timeout_ms=5000)
    statuses = []
    for i in range(10):
        key = ns.hash_chain(np.arange(16 * i, 16 * i + 16, dtype=np.int64))
        r = client.offload(ns, key, payloads(1, seed=i), pinned=True)[0]
        assert r.ok, r
        statuses.append(r.status)
    assert statuses == ["stored"] * 7 + ["stored_unpinned"] * 3, statuses
