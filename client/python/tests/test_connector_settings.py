"""The settings every engine connector shares (kvtier.integrations._common
.make_client): each reaches the client, and a bad one is refused with a
message that names it, before the engine starts."""

import numpy as np
import pytest

import kvtier
from conftest import Daemon, flip_on_disk
from kvtier.integrations._common import KvtierConfigError, make_client


def test_each_setting_reaches_the_client(daemon):
    c = make_client({"kvtier_socket": daemon.socket, "kvtier_timeout_ms": 1234,
                     "kvtier_region_bytes": 8 << 20, "kvtier_direct_read": "true"})
    assert (c.socket, c.timeout_ms, c.region_bytes, c.direct_read) == (daemon.socket, 1234, 8 << 20, True)
    c = make_client({"kvtier_socket": daemon.socket}, region_bytes=16 << 20)
    assert (c.timeout_ms, c.region_bytes, c.direct_read) == (2000, 16 << 20, False)


@pytest.mark.parametrize("direct", [False, True], ids=["region", "direct-read"])
def test_both_read_paths_round_trip_and_a_corrupt_block_is_a_miss(direct):
    daemon = Daemon(g4=False)  # no G4: a corrupt G3 copy has no good copy to be repaired from
    try:
        _round_trip_and_corrupt(daemon, direct)
    finally:
        daemon.close()


def _round_trip_and_corrupt(daemon, direct: bool) -> None:
    c = make_client({"kvtier_socket": daemon.socket, "kvtier_direct_read": direct})
    ns = kvtier.Namespace("connector-settings", kvtier.Layout.with_block_bytes(64 << 10))
    keys = ns.hash_chain(list(range(3 * 16)))
    data = [np.random.default_rng(i).integers(0, 256, 64 << 10, dtype=np.uint8) for i in range(3)]
    assert all(r.ok for r in c.offload(ns, keys, data))
    assert c.direct_read is direct
    outs = [np.zeros(64 << 10, np.uint8) for _ in keys]
    res = c.onboard_into(ns, keys, outs)
    assert all(r.ok for r in res) and all((o == d).all() for o, d in zip(outs, data))
    flip_on_disk(daemon, keys[1], 4000)
    outs = [np.zeros(64 << 10, np.uint8) for _ in keys]
    res = c.onboard_into(ns, keys, outs)
    assert res[0].ok and (outs[0] == data[0]).all()
    assert not res[1].ok and res[1].reason == "corrupt", res[1]
    # The chain's tail is still served: one bad block costs only itself.
    assert res[2].ok and (outs[2] == data[2]).all(), res[2]


@pytest.mark.parametrize(
    "extra",
    [{"kvtier_direct_read": "yes"}, {"kvtier_direct_read": 2}, {"kvtier_region_bytes": 0},
     {"kvtier_timeout_ms": 0}],
)
def test_a_bad_setting_is_refused_with_its_name(daemon, extra):
    with pytest.raises((KvtierConfigError, ValueError), match=next(iter(extra))):
        make_client({"kvtier_socket": daemon.socket, **extra})
