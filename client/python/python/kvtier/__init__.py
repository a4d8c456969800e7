"""kvtier: the node-local KV-cache tier (NVMe + S3) for LLM engines.

Quick start (a kvtierd must be running; Client() reads $KVTIER_SOCKET)::

    import numpy as np, kvtier
    ns = kvtier.Namespace("my-model", kvtier.Layout.llama3_8b(16), tenant_salt=b"t")
    client = kvtier.Client()
    keys = ns.hash_chain(np.arange(64, dtype=np.int32))
    bufs = [np.zeros(ns.block_bytes, np.uint8) for _ in keys]
    hit = client.lookup(ns, keys).prefix_len
    client.onboard_into(ns, keys[:hit], bufs[:hit])      # misses are values
    client.offload(ns, keys[hit:], bufs[hit:], parent=keys[hit - 1] if hit else None)

Misses (absent, corrupt, daemon unavailable, timeout, ...) come back as
results with a ``reason``; misuse raises a :class:`kvtier.Error` subclass.
See ``help(kvtier.Client)`` and docs/PYTHON.md.
"""

from ._kvtier import (
    BLOCK_BYTES_MAX,
    ArgumentError,
    ArgumentTypeError,
    ClosedError,
    BlockResult,
    BufferError,
    Client,
    DeviceError,
    Error,
    Events,
    InvalidKeyError,
    Layout,
    Lookup,
    Namespace,
    NamespaceError,
    Pool,
    PoolError,
    UnavailableError,
    __version__,
    default_socket,
)

__all__ = [
    "BLOCK_BYTES_MAX",
    "ArgumentError",
    "ArgumentTypeError",
    "ClosedError",
    "BlockResult",
    "BufferError",
    "Client",
    "DeviceError",
    "Error",
    "Events",
    "InvalidKeyError",
    "Layout",
    "Lookup",
    "Namespace",
    "NamespaceError",
    "Pool",
    "PoolError",
    "UnavailableError",
    "__version__",
    "default_socket",
    "pool_block",
    "pool_array",
]

_HEADER_BYTES = 4096


def pool_block(pool: Pool, slot: int, block_bytes: int) -> memoryview:
    """A writable memoryview of the payload of ``slot`` in ``pool`` for
    blocks of ``block_bytes`` (what offload_pool sends and onboard_pool
    fills). It keeps the pool mapped while it lives."""
    n = pool.num_slots(block_bytes)
    if not 0 <= slot < n:
        raise PoolError(
            f"slot {slot} is outside the pool: it holds {n} slots of "
            f"{Pool.slot_bytes(block_bytes)} bytes for blocks of {block_bytes} bytes"
        )
    at = slot * Pool.slot_bytes(block_bytes) + _HEADER_BYTES
    return memoryview(pool)[at : at + block_bytes]


def pool_array(pool: Pool, block_bytes: int):
    """The payloads of every slot of ``pool`` as one writable numpy array of
    shape (num_slots, block_bytes), dtype uint8 (rows are strided: each slot
    starts with a header page). Needs numpy."""
    import numpy as np

    n = pool.num_slots(block_bytes)
    base = np.frombuffer(pool, dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(
        base[_HEADER_BYTES:],
        shape=(n, block_bytes),
        strides=(Pool.slot_bytes(block_bytes), 1),
        writeable=True,
    )
    return view


# Convenience methods on Pool (the native class is frozen; these are plain
# functions bound as methods).
Pool.block = pool_block  # type: ignore[attr-defined]
Pool.array = pool_array  # type: ignore[attr-defined]
