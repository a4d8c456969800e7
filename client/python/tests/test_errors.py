"""Misuse raises typed kvtier.Error subclasses with actionable messages."""

import numpy as np
import pytest

import kvtier

from conftest import BLOCK


def test_wrong_sizes_and_counts(client, ns):
    keys = ns.hash_chain(list(range(32)))
    with pytest.raises(kvtier.BufferError, match=f"holds 10 bytes.*{BLOCK}"):
        client.offload(ns, keys[:1], [bytearray(10)])
    with pytest.raises(kvtier.BufferError, match="1 buffers for 2 keys"):
        client.onboard_into(ns, keys, [bytearray(BLOCK)])
    with pytest.raises(kvtier.BufferError, match="segments summing|as segments"):
        client.onboard_into(ns, keys[:1], [[bytearray(BLOCK // 2), bytearray(10)]])
    with pytest.raises(kvtier.BufferError, match="list with one buffer per key"):
        client.onboard_into(ns, keys[:1], 5)


def test_read_only_and_non_contiguous(client, ns):
    keys = ns.hash_chain(list(range(16)))
    with pytest.raises(kvtier.BufferError, match="read-only"):
        client.onboard_into(ns, keys, [bytes(BLOCK)])
    ro = np.zeros(BLOCK, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(kvtier.BufferError, match="read-only"):
        client.onboard_into(ns, keys, [ro])
    # A read-only buffer is fine to offload from.
    assert client.offload(ns, keys, [ro])[0]
    strided = np.zeros(BLOCK * 2, np.uint8)[::2]
    with pytest.raises(kvtier.BufferError, match="not C-contiguous"):
        client.offload(ns, keys, [strided])
    with pytest.raises(kvtier.BufferError, match="not a buffer"):
        client.offload(ns, keys, [object()])
    with pytest.raises(kvtier.BufferError, match="null pointer"):
        client.offload(ns, keys, [(0, BLOCK)])


def test_bad_keys_and_namespaces(client, ns):
    with pytest.raises(kvtier.InvalidKeyError):
        client.lookup(ns, [b"x" * 65])
    with pytest.raises(kvtier.InvalidKeyError):
        client.lookup(ns, [b""])
    with pytest.raises(kvtier.InvalidKeyError):
        client.lookup(ns, [-1])
    with pytest.raises(kvtier.InvalidKeyError, match="list of keys"):
        client.lookup(ns, b"abc")
    with pytest.raises(kvtier.NamespaceError, match="hash_mode"):
        kvtier.Namespace("m", ns.layout, hash_mode="md5")
    with pytest.raises(kvtier.NamespaceError, match="dtype"):
        kvtier.Layout(1, 1, 1, dtype="f64")
    with pytest.raises(kvtier.NamespaceError):
        kvtier.Layout(0, 1, 1)
    with pytest.raises(kvtier.NamespaceError, match="token"):
        ns.hash_chain([-1, 2])
    with pytest.raises(kvtier.NamespaceError, match="format"):
        ns.hash_chain(np.zeros(16, np.float32))
    assert issubclass(kvtier.BufferError, kvtier.Error)


class FakeCudaArray:
    """Device memory as CuPy/Numba describe it."""

    __cuda_array_interface__ = {"data": (0x7F0000000000, False), "shape": (BLOCK,), "typestr": "|u1", "version": 3}


def test_device_buffers_without_gpu_name_what_is_missing(client, ns):
    keys = ns.hash_chain(list(range(16)))
    try:
        import kvtier._kvtier as native  # noqa: F401
    except ImportError:
        pytest.skip("no native module")
    for buf in (FakeCudaArray(), (0x7F0000000000, BLOCK, "cuda:0")):
        with pytest.raises(kvtier.DeviceError, match="device buffer was given.*(CUDA|cuda|driver)"):
            client.onboard_into(ns, keys, [buf])
        with pytest.raises(kvtier.DeviceError):
            client.offload(ns, keys, [buf])


def test_dead_daemon_is_a_miss_not_an_exception(tmp_path, ns):
    c = kvtier.Client(socket=str(tmp_path / "none.sock"), timeout_ms=300)
    keys = ns.hash_chain(list(range(32)))
    assert c.lookup(ns, keys).reason == "unavailable"
    assert [r.reason for r in c.offload(ns, keys, [bytearray(BLOCK)] * 2)] == ["unavailable"] * 2
    assert not any(c.onboard_into(ns, keys, [bytearray(BLOCK), bytearray(BLOCK)]))
    with pytest.raises(kvtier.UnavailableError, match="kvtierd running"):
        c.stats()


def test_socket_default_reads_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_SOCKET", str(tmp_path / "x.sock"))
    assert kvtier.Client().socket == str(tmp_path / "x.sock")
    assert kvtier.default_socket() == str(tmp_path / "x.sock")
    monkeypatch.delenv("KVTIER_SOCKET")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert kvtier.Client().socket == str(tmp_path / "kvtier" / "kvtierd.sock")


def test_help_reads_well():
    doc = kvtier.Client.__doc__
    assert "KVTIER_SOCKET" in doc and "Fail open" in doc
    assert "verifying every byte" in kvtier.Client.onboard_into.__doc__


def test_namespace_tenant_salt_takes_str_as_utf8_and_says_what_else_is_wrong(ns):
    # A str salt is its UTF-8 bytes, as the engine integrations read
    # kvtier_tenant_salt (it raised a plain TypeError before issue 43).
    a = kvtier.Namespace("m", ns.layout, tenant_salt="tenant-é")
    b = kvtier.Namespace("m", ns.layout, tenant_salt="tenant-é".encode())
    assert a.id == b.id != kvtier.Namespace("m", ns.layout).id
    with pytest.raises(kvtier.ArgumentTypeError, match="tenant_salt must be bytes or str, not int") as e:
        kvtier.Namespace("m", ns.layout, tenant_salt=5)
    assert isinstance(e.value, TypeError) and isinstance(e.value, kvtier.Error)
