"""The CUDA path of onboard_into / offload, in host mode: with
KVTIER_PY_HOST_VIA_GDS=1 host buffers take the device path (kvtier-gds's
pipeline: block files passed by the daemon, overlapped io_uring reads,
blake3 streamed over every chunk, asynchronous copies; a gather with
asynchronous copies for offload), host memory standing in for HBM, as CI
runs it without a GPU. gds/scripts/device-check.sh runs the same calls
into real device memory when a GPU is there."""

import numpy as np
import pytest

import kvtier

from conftest import BLOCK, flip_on_disk

ENV = "KVTIER_PY_HOST_VIA_GDS"


def segments(buf):
    """A block as three uneven segments (per-layer views, say)."""
    return [buf[:1000], buf[1000 : 1000 + 8192], buf[1000 + 8192 :]]


def test_device_path_round_trips_segmented_blocks_and_says_its_route(daemon, client, ns, monkeypatch):
    rng = np.random.default_rng(7)
    n = 140  # more than one fd-passing request (128 blocks) carries
    keys = ns.hash_chain(list(range(16 * n)))
    data = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]
    monkeypatch.setenv(ENV, "1")
    assert all(client.offload(ns, keys, [segments(d) for d in data]))
    out = [np.zeros(BLOCK, np.uint8) for _ in range(n)]
    res = client.onboard_into(ns, keys, [segments(o) for o in out])
    assert all(res), [r for r in res if not r][:3]
    assert {r.route for r in res} == {"two_hop"}, res[:2]
    assert all(r.tier == "g3" and r.nbytes == BLOCK for r in res)
    assert all((o == d).all() for o, d in zip(out, data))
    # The host path reads the same bytes and says no route.
    monkeypatch.delenv(ENV)
    back = [np.zeros(BLOCK, np.uint8)]
    r = client.onboard_into(ns, keys[:1], back)
    assert r[0] and r[0].route is None and (back[0] == data[0]).all()


def test_device_path_verifies_every_byte_and_reports_a_corrupt_block(start_daemon, ns, monkeypatch):
    # A file per block: the device path reads the block file kvtierd hands
    # over as it is and must find the bad byte itself (a slotted block is
    # verified by kvtierd before its copy is handed over).
    daemon = start_daemon(config='[g3]\nslot_max = "0"\n')
    client = kvtier.Client(socket=daemon.socket, timeout_ms=5000)
    keys = ns.hash_chain(list(range(16 * 4)))
    data = [np.full(BLOCK, i + 1, np.uint8) for i in range(4)]
    assert all(client.offload(ns, keys, data))
    flip_on_disk(daemon, keys[2], BLOCK - 3)  # in the block's last chunk
    monkeypatch.setenv(ENV, "1")
    out = [np.zeros(BLOCK, np.uint8) for _ in range(4)]
    res = client.onboard_into(ns, keys, out)
    assert [r.ok for r in res] == [True, True, False, True], res
    assert res[2].reason == "corrupt" and res[2].route is None, res[2]
    assert all((out[i] == data[i]).all() for i in (0, 1, 3))
    # Reported to the daemon, which re-verifies and repairs (from G4) or
    # drops its copy: later reads miss or give the block's own bytes.
    got = np.zeros(BLOCK, np.uint8)
    r = client.onboard_into(ns, keys[2:3], [got])[0]
    assert not r or (got == data[2]).all(), r


def test_device_path_checks_buffers_before_a_byte_moves(client, ns, monkeypatch):
    keys = ns.hash_chain(list(range(16)))
    assert client.offload(ns, keys, [np.ones(BLOCK, np.uint8)])[0]
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(kvtier.BufferError, match="read-only"):
        client.onboard_into(ns, keys, [bytes(BLOCK)])
    with pytest.raises(kvtier.BufferError, match="bytes"):
        client.onboard_into(ns, keys, [np.zeros(BLOCK - 1, np.uint8)])
    with pytest.raises(kvtier.BufferError, match="format"):
        client.onboard_into(ns, keys, [np.empty(BLOCK // 8, dtype=object)])
