"""asyncio API: the same calls as :class:`kvtier.Client`, awaitable.

Each call runs the blocking client (which releases the GIL) on a thread
of the loop's default executor, so the event loop never blocks. The same
fail-open rules hold: misses are values, misuse raises.

    import kvtier, kvtier.aio
    client = kvtier.aio.Client()
    found = await client.lookup(ns, keys)
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, AsyncIterator, Optional

from . import _kvtier


class Client:
    """An asyncio wrapper over :class:`kvtier.Client` (same arguments).

    ``async with kvtier.aio.Client(...) as c:`` closes it at the end of the
    block; ``await c.close()`` does the same."""

    def __init__(self, socket: Optional[str] = None, timeout_ms: int = 2000, **kw: Any) -> None:
        self.sync = _kvtier.Client(socket=socket, timeout_ms=timeout_ms, **kw)

    @property
    def socket(self) -> str:
        """The daemon's socket path."""
        return self.sync.socket

    @property
    def timeout_ms(self) -> int:
        """The deadline of every call, in milliseconds."""
        return self.sync.timeout_ms

    @property
    def region_bytes(self) -> int:
        """The bytes of the shared region blocks move through."""
        return self.sync.region_bytes

    @property
    def direct_read(self) -> bool:
        """Whether G3 blocks are read over passed file descriptors."""
        return self.sync.direct_read

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self.sync.closed

    async def close(self) -> None:
        """See :meth:`kvtier.Client.close` (instant: it drops the connection)."""
        self.sync.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.sync.close()

    def __repr__(self) -> str:
        return f"kvtier.aio.{self.sync!r}"

    async def _run(self, fn, *args, **kw):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(fn, *args, **kw))

    async def connect(self) -> None:
        """See :meth:`kvtier.Client.connect`."""
        return await self._run(self.sync.connect)

    async def lookup(self, ns, keys):
        """See :meth:`kvtier.Client.lookup`."""
        return await self._run(self.sync.lookup, ns, keys)

    async def lookup_many(self, namespaces, keys):
        """See :meth:`kvtier.Client.lookup_many`."""
        return await self._run(self.sync.lookup_many, namespaces, keys)

    async def offload(self, ns, keys, bufs, parent=None, **hints):
        """See :meth:`kvtier.Client.offload`."""
        return await self._run(self.sync.offload, ns, keys, bufs, parent, **hints)

    async def onboard_into(self, ns, keys, bufs):
        """See :meth:`kvtier.Client.onboard_into`."""
        return await self._run(self.sync.onboard_into, ns, keys, bufs)

    async def offload_pool(self, ns, keys, slots, parent=None, **hints):
        """See :meth:`kvtier.Client.offload_pool`."""
        return await self._run(self.sync.offload_pool, ns, keys, slots, parent, **hints)

    async def onboard_pool(self, ns, keys, slots):
        """See :meth:`kvtier.Client.onboard_pool`."""
        return await self._run(self.sync.onboard_pool, ns, keys, slots)

    async def pin(self, ns, keys, ttl_ms: int = 600_000):
        """See :meth:`kvtier.Client.pin`."""
        return await self._run(self.sync.pin, ns, keys, ttl_ms)

    async def describe(self, ns, engine: str):
        """See :meth:`kvtier.Client.describe`."""
        return await self._run(self.sync.describe, ns, engine)

    async def prefetch(self, ns, keys, deadline_ms: int = 10_000, stream: int = 0):
        """See :meth:`kvtier.Client.prefetch`."""
        return await self._run(self.sync.prefetch, ns, keys, deadline_ms, stream)

    async def unpin(self, ns, keys):
        """See :meth:`kvtier.Client.unpin`."""
        return await self._run(self.sync.unpin, ns, keys)

    async def evict(self, ns, keys):
        """See :meth:`kvtier.Client.evict`."""
        return await self._run(self.sync.evict, ns, keys)

    async def stat(self, ns, keys):
        """See :meth:`kvtier.Client.stat`."""
        return await self._run(self.sync.stat, ns, keys)

    async def stats(self) -> dict:
        """See :meth:`kvtier.Client.stats`."""
        return await self._run(self.sync.stats)

    async def alloc_pool(self, nbytes: int):
        """See :meth:`kvtier.Client.alloc_pool`."""
        return await self._run(self.sync.alloc_pool, nbytes)

    async def events(self, timeout_ms: Optional[int] = None) -> AsyncIterator[dict]:
        """KV events as an async iterator (see :meth:`kvtier.Client.events`)."""
        it = await self._run(self.sync.events, timeout_ms)
        _end = object()
        try:
            while True:
                ev = await self._run(next, it, _end)
                if ev is _end:
                    return
                yield ev
        finally:
            it.close()
