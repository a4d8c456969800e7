"""The shared-memory pool: blocks move by offset only."""

import numpy as np
import pytest

import kvtier

from conftest import BLOCK, Proxy


def test_pool_offload_sends_no_payload_bytes(daemon, ns, tmp_path):
    proxy = Proxy(daemon.socket, str(tmp_path / "proxy.sock"))
    c = kvtier.Client(socket=proxy.path, timeout_ms=5000, region_bytes=1 << 20)
    n = 8
    pool = c.alloc_pool(n * kvtier.Pool.slot_bytes(BLOCK))
    assert pool.num_slots(BLOCK) == n and pool.nbytes >= n * BLOCK
    arr = pool.array(BLOCK)
    assert arr.shape == (n, BLOCK) and arr.flags.writeable
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (n, BLOCK), dtype=np.uint8)
    arr[:] = data
    keys = ns.hash_chain(list(range(16 * n)))
    proxy.reset()
    res = c.offload_pool(ns, keys, list(range(n)))
    assert all(r.status == "stored" for r in res), res
    sent = bytes(proxy.sent)
    payload_total = n * BLOCK
    # Only a small request frame crossed the socket: offsets, not bytes.
    assert len(sent) < 16 * 1024, len(sent)
    assert len(sent) < payload_total // 100
    for row in data:
        assert row[1000:1064].tobytes() not in sent
    # The stored blocks are the pool's bytes: read them back elsewhere.
    plain = kvtier.Client(socket=daemon.socket)
    out = [np.zeros(BLOCK, np.uint8) for _ in range(n)]
    assert all(plain.onboard_into(ns, keys, out))
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    # Onboard into other slots of the pool: again offsets only.
    arr[:] = 0
    proxy.reset()
    got = c.onboard_pool(ns, keys[:4], [7, 6, 5, 4])
    assert all(got), got
    assert len(proxy.sent) < 16 * 1024
    for i, s in enumerate([7, 6, 5, 4]):
        assert np.array_equal(arr[s], data[i])
        assert pool.block(s, BLOCK).tobytes() == data[i].tobytes()
    proxy.close()


def test_pool_limits_and_misuse(start_daemon, ns):
    d = start_daemon(config='[server]\nregion_bytes_max = "8MiB"\n')
    c = kvtier.Client(socket=d.socket, region_bytes=1 << 20)
    with pytest.raises(kvtier.PoolError, match="region_bytes_max"):
        c.alloc_pool(16 << 20)
    with pytest.raises(kvtier.PoolError, match="no pool"):
        c.onboard_pool(ns, ns.hash_chain(list(range(16))), [0])
    pool = c.alloc_pool(4 << 20)
    with pytest.raises(kvtier.PoolError, match="already has a pool"):
        c.alloc_pool(4096)
    n = pool.num_slots(BLOCK)
    keys = ns.hash_chain(list(range(16)))
    with pytest.raises(kvtier.PoolError, match="outside the pool"):
        c.offload_pool(ns, keys, [n])
    with pytest.raises(kvtier.PoolError, match="one slot per key"):
        c.offload_pool(ns, keys, [0, 1])
    with pytest.raises(kvtier.PoolError):
        pool.block(n, BLOCK)
    # The pool survives a daemon restart: the client reconnects with it.
    pool.block(0, BLOCK)[:] = b"\x05" * BLOCK
    assert c.offload_pool(ns, keys, [0])[0]
    d.restart()
    pool.block(1, BLOCK)[:] = b"\x00" * BLOCK
    # The first call after a restart finds the kept socket dead and is
    # sent again on a fresh connection, with the same pool.
    got = c.onboard_pool(ns, keys, [1])
    assert got[0], got
    assert pool.block(1, BLOCK).tobytes() == b"\x05" * BLOCK
