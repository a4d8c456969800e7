"""What the connectors share: counters, fail-open logging, settings, keys."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Optional, Sequence

import kvtier

logger = logging.getLogger("kvtier.integrations")

# A kvtier key is 1..=64 bytes; an engine key longer than that is hashed
# (blake2b-256) so it still names one block.
KEY_BYTES_MAX = 64

# kvtierd's default `g3.slot_max`: blocks up to it share slab files, so a
# read by passed fd gets a copy kvtierd made (no fd into a shared file) and
# the shared region is the cheaper route; larger blocks have files of their
# own, which a passed fd reads in place (docs/OPERATIONS.md, `slots/`).
G3_SLOT_MAX_DEFAULT_BYTES = 4 << 20

# At most one warning per this many seconds per (connector, what): a dead
# daemon must not flood the engine's log at one line per block.
WARN_INTERVAL_S = 10.0


class KvtierConfigError(kvtier.Error, ValueError):
    """A connector's configuration cannot work (the message says what to set)."""


class Counters:
    """Thread-safe event counters of one connector instance.

    Names: ``lookups``, ``lookup_hits``, ``lookup_misses``, ``loads``,
    ``load_blocks``, ``load_failures``, ``load_bytes``, ``stores``,
    ``store_blocks``, ``store_unpinned`` (stored, but the pin hint was
    refused: the daemon's pin budget is spent), ``store_already_present``,
    ``store_failures``, ``store_bytes`` (payload bytes stored), ``errors``
    (exceptions caught instead of raised into the
    engine), and for prefetch (:class:`Prefetcher`): ``prefetches`` (calls),
    ``prefetch_blocks`` (queued), ``prefetch_already_present``,
    ``prefetch_limited`` (the daemon's or the connector's bound),
    ``prefetch_absent``, ``prefetch_failures``, ``prefetch_landed``,
    ``prefetch_expired`` (the deadline passed: loaded from the remote tier
    directly); ``hint_errors`` (a request hint that could not be read,
    ignored). ``snapshot()`` gives a plain dict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def add_many(self, counts: Mapping[str, int]) -> None:
        """Several counters under one lock acquisition (a hot path folds its
        counts and adds them at once)."""
        with self._lock:
            for name, n in counts.items():
                if n:
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


def connector_keys(keys: Sequence[bytes | str]) -> list[bytes]:
    """:func:`connector_key` of each key; keys that are all non-empty bytes
    of at most ``KEY_BYTES_MAX`` (vLLM's offload keys) are their own
    kvtier keys and are checked without a Python step per key."""
    if keys and set(map(type, keys)) == {bytes}:
        lens = set(map(len, keys))
        if min(lens) > 0 and max(lens) <= KEY_BYTES_MAX:
            return list(keys)  # type: ignore[arg-type]
    return [connector_key(k) for k in keys]


def setting(extra: Optional[Mapping[str, Any]], name: str, default: Any = None) -> Any:
    """``kvtier_<name>`` from an engine's extra config, else ``default``."""
    if not extra:
        return default
    return extra.get(f"kvtier_{name}", default)


# Largest shared region a connector asks for by default (the daemon's own
# bound, server.region_bytes_max, is 4 GiB by default).
REGION_BYTES_DEFAULT_MAX = 1 << 30


def make_client(extra: Optional[Mapping[str, Any]], region_bytes: Optional[int] = None) -> kvtier.Client:
    """A client from ``kvtier_socket`` (default: $KVTIER_SOCKET, then the
    daemon's default path), ``kvtier_timeout_ms`` (default 2000) and
    ``kvtier_region_bytes`` (the shared region blocks move through: one
    onboard carries as many blocks as fit; default ``region_bytes``, else
    the client's 64 MiB) and ``kvtier_direct_read`` (default false: G3
    blocks are read by this process over file descriptors the daemon
    passes, straight into the engine's buffers, instead of through the
    shared region; the client verifies every byte either way)."""
    timeout_ms = int(setting(extra, "timeout_ms", 2000))
    if timeout_ms <= 0:
        raise KvtierConfigError(f"kvtier_timeout_ms must be positive, got {timeout_ms}")
    kw: dict = {}
    region = setting(extra, "region_bytes", region_bytes)
    if region is not None:
        kw["region_bytes"] = _bounded_int(region, "kvtier_region_bytes", 1 << 40)
        if kw["region_bytes"] == 0:
            raise KvtierConfigError("kvtier_region_bytes must be positive")
    direct = setting(extra, "direct_read")
    if direct is not None:
        kw["direct_read"] = _flag(direct, "kvtier_direct_read")
    return kvtier.Client(socket=setting(extra, "socket"), timeout_ms=timeout_ms, **kw)


def describe(client: kvtier.Client, namespaces: Iterable, engine: str, fail: FailOpen) -> None:
    """Tells kvtierd which engine and model each namespace belongs to
    (``client.describe``: shown by ``kvtier stats``, ``kvtier ls`` and the
    daemon's ``kvtier_client_*`` metrics). Never raises: a daemon that is
    down or predates descriptions only leaves the namespace unlabelled."""
    for ns in namespaces:
        try:
            client.describe(ns, engine)
        except Exception as e:
            logger.warning(
                "kvtier %s: namespace %s not described to kvtierd (%s: %s); "
                "kvtier stats and ls show its id only",
                fail.connector, ns.id, type(e).__name__, e,
            )
            return


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


# -- hints ------------------------------------------------------------------

# The daemon's hint fields: priority is a u8, expected_reuse a u16.
PRIORITY_MAX = 255
EXPECTED_REUSE_MAX = 65535


@dataclass(frozen=True)
class BlockHints:
    """What a connector tells kvtierd about a block it offloads
    (``client.offload(..., priority, pinned, ephemeral, expected_reuse)``)."""

    priority: int = 0
    pinned: bool = False
    ephemeral: bool = False
    expected_reuse: int = 0

    def kwargs(self) -> dict:
        return {
            "priority": self.priority,
            "pinned": self.pinned,
            "ephemeral": self.ephemeral,
            "expected_reuse": self.expected_reuse,
        }

    def with_reuse(self, seen: int) -> "BlockHints":
        """These hints with ``expected_reuse`` at least ``seen``."""
        seen = min(max(seen, 0), EXPECTED_REUSE_MAX)
        return self if seen <= self.expected_reuse else replace(self, expected_reuse=seen)


def _bounded_int(value: Any, name: str, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} must be an integer 0..={hi}, got {value!r}")
    n = int(value)
    if not 0 <= n <= hi:
        raise ValueError(f"{name} must be 0..={hi}, got {n}")
    return n


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)) and str(value).lower() in ("0", "1", "true", "false"):
        return str(value).lower() in ("1", "true")
    raise ValueError(f"{name} must be true or false, got {value!r}")


def parse_hints(
    params: Optional[Mapping[str, Any]], prefix: str, base: BlockHints
) -> tuple[BlockHints, dict]:
    """Hints named ``<prefix>priority``, ``<prefix>pinned``,
    ``<prefix>ephemeral``, ``<prefix>expected_reuse`` in ``params`` over
    ``base``; also returns the other ``<prefix>*`` entries (without the
    prefix) for engine-specific ones (``session``, ``ephemeral_from_token``).
    Raises ValueError naming the bad entry (callers count and ignore it:
    a bad hint never fails a request)."""
    if not params:
        return base, {}
    h = base
    rest: dict = {}
    for name, value in params.items():
        if not isinstance(name, str) or not name.startswith(prefix):
            continue
        field = name[len(prefix) :]
        full = f"{prefix}{field}"
        if field == "priority":
            h = replace(h, priority=_bounded_int(value, full, PRIORITY_MAX))
        elif field == "pinned":
            h = replace(h, pinned=_flag(value, full))
        elif field == "ephemeral":
            h = replace(h, ephemeral=_flag(value, full))
        elif field == "expected_reuse":
            h = replace(h, expected_reuse=_bounded_int(value, full, EXPECTED_REUSE_MAX))
        else:
            rest[field] = value
    return h, rest


def base_hints(extra: Optional[Mapping[str, Any]]) -> BlockHints:
    """The deployment's hints (``kvtier_priority``, ``kvtier_pinned``,
    ``kvtier_ephemeral``, ``kvtier_expected_reuse`` in the extra config);
    a bad value is a :class:`KvtierConfigError` at startup."""
    try:
        h, _ = parse_hints(extra, "kvtier_", BlockHints())
    except ValueError as e:
        raise KvtierConfigError(f"{e} (in the connector's extra config)") from None
    return h


def offload_grouped(
    client: kvtier.Client,
    ns,
    keys: list,
    bufs: list,
    hints: Sequence[BlockHints],
    parent=None,
    parents: Optional[Sequence] = None,
) -> list:
    """``client.offload`` of the chain ``keys`` (``keys[0]``'s parent is
    ``parent``) whose hints differ: one call per run of equal hints, in
    chain order, each run's parent the key before it, so every block is
    recorded under its own parent however the hints change. ``parents``,
    when given, is each key's own parent (None: a root): a run also ends
    where a key does not continue the key before it (a store of chunks
    that are not one contiguous piece of a chain). Results back in
    ``keys`` order."""
    if parents is not None and len(parents) != len(keys):
        raise ValueError(f"{len(parents)} parents for {len(keys)} keys")
    out: list = []
    start = 0
    while start < len(keys):
        end = start + 1
        while (
            end < len(keys)
            and hints[end] == hints[start]
            and (parents is None or parents[end] == keys[end - 1])
        ):
            end += 1
        if parents is not None:
            run_parent = parents[start]
        else:
            run_parent = parent if start == 0 else keys[start - 1]
        out.extend(client.offload(ns, keys[start:end], bufs[start:end], run_parent, **hints[start].kwargs()))
        start = end
    return out


# Keys whose lookups the reuse tracker remembers (least recently seen
# forgotten first): 64 Ki keys of at most 64 bytes, a few MiB.
REUSE_TRACKED_KEYS_MAX = 1 << 16


class ReuseTracker:
    """How many distinct requests looked a block up before it was stored:
    a block of a shared system prompt or document that several requests
    missed on is worth ``expected_reuse`` when one of them stores it.
    Bounded (``REUSE_TRACKED_KEYS_MAX``) and thread-safe."""

    def __init__(self, max_keys: int = REUSE_TRACKED_KEYS_MAX) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, tuple[int, Any]] = OrderedDict()

    def seen(self, key: bytes, request: Any = None) -> None:
        """``request`` looked ``key`` up (a repeat by the same request,
        e.g. a scheduler retry, does not count again; None always counts)."""
        self.seen_many((key,), request)

    def seen_many(self, keys: Iterable[bytes], request: Any = None) -> None:
        """:meth:`seen` for each of ``keys`` (one lock for all: a prompt's
        whole chain is noted at once)."""
        with self._lock:
            seen = self._seen
            for key in keys:
                n, last = seen.pop(key, (0, object()))
                if request is None or request != last:
                    n += 1
                seen[key] = (n, request)
            while len(seen) > self.max_keys:
                seen.popitem(last=False)

    def others(self, key: bytes) -> int:
        """Requests beyond the first that looked ``key`` up."""
        with self._lock:
            n, _ = self._seen.get(key, (0, None))
        return max(0, n - 1)


# -- prefetch ----------------------------------------------------------------

# Prefetches a connector keeps track of at once (blocks asked for and not
# yet seen on G3 nor expired); past it a block found below G3 is loaded
# from there directly, as without prefetch.
PREFETCH_INFLIGHT_MAX = 4096
PREFETCH_DEADLINE_MS = 10_000


def stream_id(*parts: Any) -> int:
    """A non-zero 63-bit prefetch stream from what names a request or a
    chain (a later prefetch on the same stream supersedes the earlier)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\x00")
    return (int.from_bytes(h.digest(), "big") >> 1) | 1


class Prefetcher:
    """Asks kvtierd to bring blocks that a lookup found on a peer or G4 into
    G3 (``client.prefetch``) so the load that follows is a G3 read. Bounded
    (``kvtier_prefetch_inflight_max`` blocks tracked, each for at most
    ``kvtier_prefetch_deadline_ms``) and fail open: a prefetch that fails
    or is refused is counted and logged (rate limited), and the block is
    then loaded from where it is. ``kvtier_prefetch: false`` turns it off."""

    def __init__(self, client: kvtier.Client, counters: Counters, fail: FailOpen, extra: Optional[Mapping[str, Any]]) -> None:
        self.client = client
        self.counters = counters
        self.fail = fail
        try:
            self.enabled = _flag(setting(extra, "prefetch", True), "kvtier_prefetch")
            self.deadline_ms = _bounded_int(
                setting(extra, "prefetch_deadline_ms", PREFETCH_DEADLINE_MS),
                "kvtier_prefetch_deadline_ms",
                3_600_000,
            )
            self.inflight_max = _bounded_int(
                setting(extra, "prefetch_inflight_max", PREFETCH_INFLIGHT_MAX),
                "kvtier_prefetch_inflight_max",
                1 << 24,
            )
        except ValueError as e:
            raise KvtierConfigError(f"{e} (in the connector's extra config)") from None
        if self.deadline_ms == 0:
            raise KvtierConfigError("kvtier_prefetch_deadline_ms must be positive")
        self._lock = threading.Lock()
        # (namespace id, key) -> monotonic expiry.
        self._pending: OrderedDict[tuple[str, bytes], float] = OrderedDict()

    def pending(self, ns, key: bytes, tier: Optional[str]) -> bool:
        """For a block a lookup found on ``tier``: True while a prefetch of
        it is in flight (the caller may wait for it), False when it is on
        G3 or should be loaded from where it is."""
        return self.pending_many(ns, [key], [tier])[0]

    def pending_many(self, ns, keys: Sequence[bytes], tiers: Sequence[Optional[str]]) -> list[bool]:
        """:meth:`pending` of each key, with one prefetch call for all the
        keys below G3 not yet in flight."""
        out = [False] * len(keys)
        if not self.enabled:
            return out
        if not self._pending and tiers.count("g3") + tiers.count(None) == len(tiers):
            # Every key on G3 and nothing in flight (a cached prompt's
            # common case): nothing to track or ask, without a Python step
            # per key (a 32K-token prompt is 2048 keys per rank).
            return out
        now = time.monotonic()
        ask: list[int] = []
        with self._lock:
            for i, (key, tier) in enumerate(zip(keys, tiers)):
                pk = (ns.id, key)
                expiry = self._pending.get(pk)
                if tier == "g3" or tier is None:
                    if expiry is not None:
                        del self._pending[pk]
                        self.counters.add("prefetch_landed")
                elif expiry is None:
                    ask.append(i)
                elif now < expiry:
                    out[i] = True
                else:
                    del self._pending[pk]
                    self.counters.add("prefetch_expired")
        if ask:
            queued = set(self.request(ns, [keys[i] for i in ask], [tiers[i] for i in ask], stream=0))
            for i in ask:
                out[i] = keys[i] in queued
        return out

    def loaded(self, ns, key: bytes, tier: Optional[str]) -> None:
        """The engine loaded ``key`` (from ``tier``): no longer tracked; a
        tracked one read from G3 counts as ``prefetch_landed``."""
        if not self.enabled:
            return
        with self._lock:
            if self._pending.pop((ns.id, key), None) is not None and tier == "g3":
                self.counters.add("prefetch_landed")

    def request(self, ns, keys: Sequence[bytes], tiers: Iterable[Optional[str]], stream: int) -> list[bytes]:
        """Prefetches those of ``keys`` whose tier is below G3 (one call);
        returns the keys queued. Never raises."""
        if not self.enabled:
            return []
        want = [k for k, t in zip(keys, tiers) if t not in (None, "g3")]
        if not want:
            return []
        nsid = ns.id
        with self._lock:
            # Forget what expired unseen (a request that went away): the
            # deadline is one value, so the oldest entries expire first.
            now = time.monotonic()
            while self._pending and next(iter(self._pending.values())) <= now:
                self._pending.popitem(last=False)
                self.counters.add("prefetch_expired")
            room = self.inflight_max - len(self._pending)
        if room < len(want):
            self.counters.add("prefetch_limited", len(want) - max(room, 0))
            self.fail.warn("prefetch limit", f"{self.inflight_max} blocks in flight (kvtier_prefetch_inflight_max)")
            want = want[: max(room, 0)]
            if not want:
                return []
        self.counters.add("prefetches")
        try:
            statuses = self.client.prefetch(ns, want, deadline_ms=self.deadline_ms, stream=stream)
        except Exception as e:
            self.counters.add("prefetch_failures", len(want))
            self.fail.error("prefetch failed", e)
            return []
        queued = []
        expiry = time.monotonic() + self.deadline_ms / 1000.0
        with self._lock:
            for k, st in zip(want, statuses):
                if st == "ok":
                    queued.append(k)
                    self._pending[(nsid, k)] = expiry
                    self._pending.move_to_end((nsid, k))
                elif st == "already_present":
                    self.counters.add("prefetch_already_present")
                elif st == "limit_reached":
                    self.counters.add("prefetch_limited")
                    self.fail.warn("prefetch limit_reached", "the daemon's prefetch queue is full")
                elif st == "absent":
                    self.counters.add("prefetch_absent")
                else:
                    self.counters.add("prefetch_failures")
                    self.fail.warn(f"prefetch {st}", "the daemon refused a prefetch")
        self.counters.add("prefetch_blocks", len(queued))
        return queued
