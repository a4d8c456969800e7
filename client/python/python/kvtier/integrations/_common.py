"""What the connectors share: counters, fail-open logging, settings, keys."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Mapping, Optional

import kvtier

logger = logging.getLogger("kvtier.integrations")

# A kvtier key is 1..=64 bytes; an engine key longer than that is hashed
# (blake2b-256) so it still names one block.
KEY_BYTES_MAX = 64

# At most one warning per this many seconds per (connector, what): a dead
# daemon must not flood the engine's log at one line per block.
WARN_INTERVAL_S = 10.0


class KvtierConfigError(kvtier.Error, ValueError):
    """A connector's configuration cannot work (the message says what to set)."""


class Counters:
    """Thread-safe event counters of one connector instance.

    Names: ``lookups``, ``lookup_hits``, ``lookup_misses``, ``loads``,
    ``load_blocks``, ``load_failures``, ``load_bytes``, ``stores``,
    ``store_blocks``, ``store_already_present``, ``store_failures``,
    ``store_bytes``, ``errors`` (exceptions caught instead of raised into the
    engine). ``snapshot()`` gives a plain dict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def get(self, name: str) -> int:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class FailOpen:
    """Counts and logs (rate limited) what a connector swallows."""

    def __init__(self, connector: str, counters: Counters) -> None:
        self.connector = connector
        self.counters = counters
        self._lock = threading.Lock()
        self._last_warn: dict[str, float] = {}

    def warn(self, what: str, detail: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last_warn.get(what)
            if last is not None and now - last < WARN_INTERVAL_S:
                return
            self._last_warn[what] = now
        logger.warning(
            "kvtier %s: %s (%s); the engine recomputes these blocks "
            "(further warnings of this kind suppressed for %.0f s)",
            self.connector,
            what,
            detail,
            WARN_INTERVAL_S,
        )

    def error(self, what: str, exc: BaseException) -> None:
        self.counters.add("errors")
        self.warn(what, f"{type(exc).__name__}: {exc}")


def connector_key(key: bytes | str) -> bytes:
    """An engine's block key as a kvtier key: its bytes (a str as UTF-8),
    or their blake2b-256 when longer than 64 bytes."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise KvtierConfigError("an empty block key cannot name a kvtier block")
    if len(raw) > KEY_BYTES_MAX:
        return hashlib.blake2b(raw, digest_size=32).digest()
    return raw


def setting(extra: Optional[Mapping[str, Any]], name: str, default: Any = None) -> Any:
    """``kvtier_<name>`` from an engine's extra config, else ``default``."""
    if not extra:
        return default
    return extra.get(f"kvtier_{name}", default)


def make_client(extra: Optional[Mapping[str, Any]]) -> kvtier.Client:
    """A client from ``kvtier_socket`` (default: $KVTIER_SOCKET, then the
    daemon's default path) and ``kvtier_timeout_ms`` (default 2000)."""
    timeout_ms = int(setting(extra, "timeout_ms", 2000))
    if timeout_ms <= 0:
        raise KvtierConfigError(f"kvtier_timeout_ms must be positive, got {timeout_ms}")
    return kvtier.Client(socket=setting(extra, "socket"), timeout_ms=timeout_ms)


def tenant_salt(extra: Optional[Mapping[str, Any]]) -> bytes:
    salt = setting(extra, "tenant_salt", "")
    return salt.encode() if isinstance(salt, str) else bytes(salt)


def coalesce(segments: list) -> list:
    """Merges raw (ptr, nbytes[, device]) segments that are adjacent in
    memory, so a block lying in one run is one segment (no scratch copy)."""
    out: list = []
    for seg in segments:
        if (
            out
            and isinstance(seg, tuple)
            and isinstance(out[-1], tuple)
            and len(seg) == len(out[-1])
            and seg[2:] == out[-1][2:]
            and out[-1][0] + out[-1][1] == seg[0]
        ):
            prev = out[-1]
            out[-1] = (prev[0], prev[1] + seg[1], *prev[2:])
        else:
            out.append(seg)
    return out
