"""A store written by block format 1 (blake3 checksums) opens with today's
build (format 2, XXH3-128), every acknowledged block byte-equal, on G3 and
from G4, over both read routes; old blocks stay checked; new blocks are
written in format 2.

The store is tests/fixtures/format1/store.tar.gz: what main 0d64c11 wrote
(its make.py, run with that build), ended by kill -9."""

import importlib.util
import pathlib
import tarfile

import pytest

import kvtier

from conftest import flip_on_disk

FIXTURE = pathlib.Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "format1"


def _maker():
    spec = importlib.util.spec_from_file_location("format1_make", FIXTURE / "make.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


MAKE = _maker()


def unpack(*members):
    def prepare(d: pathlib.Path) -> None:
        with tarfile.open(FIXTURE / "store.tar.gz") as t:
            t.extractall(d, members=[m for m in t.getmembers() if m.name.split("/")[0] in members])

    return prepare


def chains():
    """(namespace, keys, payloads) of every block the fixture holds."""
    out = []
    for n, ns in enumerate(MAKE.namespaces()):
        tpb = ns.layout.tokens_per_block
        keys = ns.hash_chain(list(range(n * 1000, n * 1000 + tpb * 6)))
        out.append((ns, keys, [MAKE.payload(n, i) for i in range(len(keys))]))
    return out


def onboard_all(c, tier):
    for ns, keys, want in chains():
        bufs = [bytearray(MAKE.BLOCK) for _ in keys]
        got = c.onboard_into(ns, keys, bufs)
        assert [r.status for r in got] == ["hit"] * len(keys), got
        assert {r.tier for r in got} == {tier}, got
        assert [bytes(b) for b in bufs] == want


@pytest.mark.parametrize("direct_read", [False, True])
def test_a_g3_directory_format_1_wrote_opens_with_every_block_byte_equal(start_daemon, direct_read):
    d = start_daemon(g4=False, prepare=unpack("g3"))
    c = kvtier.Client(socket=d.socket, timeout_ms=5000, direct_read=direct_read)
    onboard_all(c, "g3")
    ns, keys, _ = chains()[0]
    assert all(s["checksum_algo"] == "blake3" and len(s["checksum"]) == 64 for s in c.stat(ns, keys))
    # New blocks beside the old ones are written in format 2.
    more = ns.hash_chain(list(range(5000, 5000 + ns.layout.tokens_per_block)))
    assert all(c.offload(ns, more, [bytes(range(256)) * (MAKE.BLOCK // 256)]))
    (st,) = c.stat(ns, more)
    assert st["checksum_algo"] == "xxh3-128" and len(st["checksum"]) == 32
    c.close()
    # Both formats survive a kill -9 and a clean restart.
    for clean in (False, True):
        d.restart(clean=clean)
        c = kvtier.Client(socket=d.socket, timeout_ms=5000, direct_read=direct_read)
        onboard_all(c, "g3")
        out = bytearray(MAKE.BLOCK)
        assert c.onboard_into(ns, more, [out])[0].ok and bytes(out) == bytes(range(256)) * (MAKE.BLOCK // 256)
        c.close()


def test_g4_objects_format_1_wrote_are_read_verified_and_promoted(start_daemon):
    d = start_daemon(prepare=unpack("g4"))
    c = kvtier.Client(socket=d.socket, timeout_ms=5000)
    onboard_all(c, "g4")
    # Promoted to G3 on the way: the next onboard is a G3 hit, same bytes.
    onboard_all(c, "g3")


def test_a_corrupt_format_1_block_is_a_miss_never_wrong_bytes(start_daemon):
    d = start_daemon(g4=False, prepare=unpack("g3"))
    ns, keys, want = chains()[0]
    flip_on_disk(d, keys[2], 100)
    c = kvtier.Client(socket=d.socket, timeout_ms=5000)
    bufs = [bytearray(MAKE.BLOCK) for _ in keys]
    got = c.onboard_into(ns, keys, bufs)
    assert [r.ok for r in got[:2]] == [True, True]
    assert not got[2].ok and got[2].reason in ("corrupt", "absent"), got[2]
    assert [bytes(b) for b in bufs[:2]] == want[:2]
