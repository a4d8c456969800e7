"""What kvtier's vLLM connector costs vLLM 0.33.0's scheduler for a cached
prompt: the time spent inside the scheduler-side connector (lookup,
prepare_load, building the step's metadata, completing the load) while
vLLM's real Scheduler runs one request whose every full chunk is in
kvtierd for every tensor-parallel rank, through to its end (the workers
load on every rank: vllm_engine.Engine). Beside it, in the same
invocation and interleaved (A B A B ...), the baseline: the same engine
with the connector's lookups as they were before batching, one request
to kvtierd per chunk per rank (``PerChunkManager`` below).

    target/engines-venv/bin/python client/python/tests_engines/bench_vllm_scheduler.py \\
        --tokens 32768 --tp 8 --rounds 5 --json

Starts its own kvtierd (target/debug/kvtierd, G3 only, in a temp dir),
stores the prompt's chunks once for every rank, then measures. One JSON
document on stdout with ``--json`` (docs/BENCHMARKS.md), progress on
stderr. Not a test: the suite runs it at a tiny size for its JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from conftest import support  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, make_offload_key  # noqa: E402
from vllm_engine import BLOCK_SIZE, Engine  # noqa: E402

import kvtier  # noqa: E402
from kvtier.integrations._common import connector_key  # noqa: E402
from kvtier.integrations.vllm import KvtierOffloadingManager  # noqa: E402

TARGET_CONNECTOR_MS = 5.0

# The scheduler-side connector's hooks (KvtierConnector's, i.e. vLLM's
# OffloadingConnector's scheduler role): what the engine core calls.
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
)


class PerChunkManager(KvtierOffloadingManager):
    """The baseline: the manager before batching (main at 4e0f403): one
    kvtierd lookup per chunk per rank, no per-step answers, pins and
    unpins on the scheduler's thread."""

    def _pin(self, keys, pin, kvkeys=None):
        try:
            ks = [connector_key(k) for k in keys]
            for ns in self.namespaces:
                if pin:
                    self.client.pin(ns, ks, ttl_ms=120_000)
                else:
                    self.client.unpin(ns, ks)
        except Exception:
            pass

    @property
    def lock(self):
        return contextlib.nullcontext()

    def lookup(self, key, req_context):
        self.counters.add("lookups")
        pending = False
        try:
            k = connector_key(key)
            for ns in self.namespaces:
                self.counters.add("lookup_requests")
                found = self.client.lookup(ns, [k])
                if found.prefix_len != 1:
                    self.counters.add("lookup_misses")
                    return LookupResult.MISS
                if self.prefetcher is not None:
                    tier = found.tiers[0] if found.tiers else None
                    pending |= self.prefetcher.pending(ns, k, tier)
        except Exception:
            self.counters.add("lookup_misses")
            return LookupResult.MISS
        if pending:
            return LookupResult.HIT_PENDING
        self.counters.add("lookup_hits")
        return LookupResult.HIT


def timed(obj, names, calls: list[str] | None = None) -> list[float]:
    """Wraps ``obj``'s methods ``names`` (those it has); returns the list
    each call's seconds are appended to (and ``calls`` each call's name)."""
    spent: list[float] = []
    for name in names:
        real = getattr(obj, name, None)
        if real is None:
            continue

        def wrap(*a, _real=real, _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                spent.append(time.perf_counter() - t0)
                if calls is not None:
                    calls.append(_name)

        setattr(obj, name, wrap)
    return spent


def timed_connector(e: Engine) -> list[float]:
    """The scheduler-side connector's hooks, timed."""
    return timed(e.scheduler.connector, HOOKS)


# kvtier's OffloadingManager methods (what kvtier adds inside the hooks
# above; the rest of the hooks' time is vLLM's own OffloadingConnector
# scheduler code, which runs every step whatever the manager).
MANAGER_METHODS = (
    "lookup",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "take_events",
    "on_new_request",
    "on_request_finished",
    "on_schedule_end",
)


def timed_manager(e: Engine, calls: list[str] | None = None) -> list[float]:
    """kvtier's manager methods, timed."""
    return timed(e.scheduler.connector.connector_scheduler.manager, MANAGER_METHODS, calls)


def wrapper_overhead_s(n: int = 20_000) -> float:
    """What one :func:`timed` wrapper adds to a call as the hook timed
    around it sees it (calibrated on a no-op): the manager's wrappers sit
    inside the hooks' (2048 lookups per 32K-token prompt), so the hooks'
    figure holds this much of the bench itself per manager call."""

    class Noop:
        def f(self, *a) -> None:
            return None

    o = Noop()
    bare = o.f
    t0 = time.perf_counter()
    for _ in range(n):
        bare(1, 2)
    t1 = time.perf_counter()
    timed(o, ("f",), [])
    wrapped = o.f
    t2 = time.perf_counter()
    for _ in range(n):
        wrapped(1, 2)
    t3 = time.perf_counter()
    return max(0.0, ((t3 - t2) - (t1 - t0)) / n)


# Manager methods vLLM calls on every step, whatever happened in it.
EVERY_STEP = {"on_schedule_end", "take_events"}


def counted_steps(e: Engine, spent: list[float], manager_calls: list[str]) -> dict:
    """Counts the engine's steps; an idle one scheduled no token and asked
    the manager nothing beyond what every step asks (the engine polling
    while a load runs): its hook time is summed apart."""
    out = {"steps": 0, "idle_steps": 0, "idle_s": 0.0}
    real = e.step

    def step() -> bool:
        at, mat = len(spent), len(manager_calls)
        scheduled = real()
        out["steps"] += 1
        if not scheduled and not set(manager_calls[mat:]) - EVERY_STEP:
            out["idle_steps"] += 1
            out["idle_s"] += sum(spent[at:])
        return scheduled

    e.step = step
    return out


def timed_loads(e: Engine) -> list[tuple[float, float]]:
    """(start, end) of each read the workers' transfer threads run."""
    spans: list[tuple[float, float]] = []
    for w in e.workers:
        worker = w.connector_worker.worker
        real = worker._run_loads

        def run(_real=real) -> None:
            t0 = time.perf_counter()
            try:
                _real()
            finally:
                spans.append((t0, time.perf_counter()))

        worker._run_loads = run
    return spans


# Connector settings from the command line (--direct-read).
EXTRA: dict = {}


def engine(tmp: pathlib.Path, socket: str, tp: int, tokens: int, per_chunk: bool) -> Engine:
    blocks = tokens // BLOCK_SIZE + 16
    e = Engine(tmp, socket, tp=tp, num_blocks=blocks, max_model_len=tokens + 64,
               kvtier_timeout_ms=60_000, kvtier_prefetch=False, **EXTRA)
    if per_chunk:
        cs = e.scheduler.connector.connector_scheduler
        m = cs.manager
        m.shutdown()
        cs.manager = PerChunkManager(m.client, m.namespaces, m.enable_events, m.counters, m.fail,
                                     m.hints, m.prefetcher, m.chunk_tokens)
    return e


def store_prompt(e: Engine, socket: str, prompt: list[int]) -> int:
    """Stores every full chunk of ``prompt`` for every rank (what the
    engine's workers would have offloaded); returns the chunk count."""
    req = e.request("store", prompt)
    nss = e.scheduler.connector.connector_scheduler.manager.namespaces
    keys = [connector_key(make_offload_key(h, 0)) for h in req.block_hashes]
    rng = np.random.default_rng(7)
    c = kvtier.Client(socket=socket, timeout_ms=600_000)
    for ns in nss:
        for at in range(0, len(keys), 512):
            part = keys[at:at + 512]
            bufs = [rng.integers(0, 255, ns.block_bytes, dtype=np.uint8) for _ in part]
            res = c.offload(ns, part, bufs, keys[at - 1] if at else None)
            bad = [r for r in res if not r.ok]
            if bad:
                raise SystemExit(f"storing the prompt failed: {bad[0]!r}")
    c.close()
    return len(keys)


# The warm-up request: a short prompt of its own, stored like the measured
# one. A serving engine has run requests before the one measured: the
# first request through a fresh connector pays one-time costs (vLLM's own
# `_bounding_group_ids` cached property, 12 ms at 4K tokens / TP 2 here;
# the first thread of the manager's pin pool, 9 ms) that no later prompt
# pays.
WARM_PROMPT = [7 + (i % 50) for i in range(4 * BLOCK_SIZE + 3)]


def one_round(tmp, socket, tp, tokens, prompt, per_chunk: bool, i: int) -> dict:
    e = engine(tmp, socket, tp, tokens, per_chunk)
    spent = timed_connector(e)
    manager_calls: list[str] = []
    in_manager = timed_manager(e, manager_calls)
    tag = "base" if per_chunk else "kvtier"
    e.add(f"warm-{tag}-{i}", WARM_PROMPT)
    e.run(f"warm-{tag}-{i}", timeout_s=600)
    spent.clear()
    in_manager.clear()
    manager_calls.clear()
    steps = counted_steps(e, spent, manager_calls)
    loads = timed_loads(e)
    before = e.counters()
    rid = f"{tag}-{i}"
    e.add(rid, prompt)
    e.run(rid, timeout_s=600)
    c = e.counters()
    out = {
        "connector_ms": sum(spent) * 1000.0,
        "manager_ms": sum(in_manager) * 1000.0,
        # Hooks' time on the steps that were not idle.
        "busy_connector_ms": (sum(spent) - steps["idle_s"]) * 1000.0,
        # The bench's own manager wrappers inside the hooks' figure.
        "timing_overhead_ms": wrapper_overhead_s() * len(manager_calls) * 1000.0,
        "steps": steps["steps"],
        "idle_steps": steps["idle_steps"],
        "idle_connector_ms": steps["idle_s"] * 1000.0,
        # From the first rank's read starting to the last one's end.
        "load_ms": (max(b for _, b in loads) - min(a for a, _ in loads)) * 1000.0 if loads else 0.0,
        "lookup_requests": c.get("lookup_requests", 0) - before.get("lookup_requests", 0),
        "loaded_chunks": c.get("load_blocks", 0) - before.get("load_blocks", 0),
        "computed_tokens": e.computed[rid],
    }
    e.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="prompt length (a multiple of 16 plus a tail)")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each (interleaved)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--direct-read", action=argparse.BooleanOptionalAction, default=None,
                    help="kvtier_direct_read: the workers read G3 blocks over passed fds; "
                         "--no-direct-read: through the shared region; unset: the connector's default "
                         "(passed fds for chunks above 4 MiB)")
    args = ap.parse_args()
    if args.direct_read is not None:
        EXTRA["kvtier_direct_read"] = args.direct_read
    if args.tokens < 2 * BLOCK_SIZE or args.tp < 1 or args.rounds < 1:
        ap.error("--tokens >= 32, --tp >= 1, --rounds >= 1")
    logging.disable(logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    prompt = [100 + (i % 900) for i in range(args.tokens + 5)]  # full chunks and a 5-token tail
    d = support.Daemon(g4=False)
    # Room for every rank's chunks (the test daemon's default is 256 MiB).
    d.args[d.args.index("--g3-capacity") + 1] = "4GiB"
    d.restart()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    try:
        print(f"storing {args.tokens} tokens for {args.tp} ranks ...", file=sys.stderr)
        chunks = store_prompt(engine(tmp, d.socket, args.tp, args.tokens, False), d.socket, prompt)
        store_prompt(engine(tmp, d.socket, args.tp, args.tokens, False), d.socket, WARM_PROMPT)
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for i in range(args.rounds):
            for per_chunk in (False, True):
                r = one_round(tmp, d.socket, args.tp, args.tokens, prompt, per_chunk, i)
                if r["loaded_chunks"] != chunks or r["computed_tokens"] != len(prompt) - chunks * BLOCK_SIZE:
                    raise SystemExit(f"the prompt was not loaded from kvtier: {r} ({chunks} chunks)")
                runs[per_chunk].append(r)
                print(f"round {i + 1}/{args.rounds} {'per-chunk' if per_chunk else 'batched'}: "
                      f"{r['connector_ms']:.2f} ms (kvtier's manager {r['manager_ms']:.2f} ms), "
                      f"{r['lookup_requests']} lookup requests, {r['steps']} steps "
                      f"({r['idle_steps']} idle: {r['idle_connector_ms']:.2f} ms; the others "
                      f"{r['busy_connector_ms']:.2f} ms), bench wrappers ~{r['timing_overhead_ms']:.2f} ms, "
                      f"load {r['load_ms']:.0f} ms", file=sys.stderr)
    finally:
        d.close()

    def summary(rs: list[dict]) -> tuple[float, list[float], int]:
        ms = [r["connector_ms"] for r in rs]
        return statistics.median(ms), [min(ms), max(ms)], int(statistics.median(r["lookup_requests"] for r in rs))

    ms, ms_range, lookups = summary(runs[False])
    base_ms, base_range, base_lookups = summary(runs[True])
    mgr = [r["manager_ms"] for r in runs[False]]
    base_mgr = [r["manager_ms"] for r in runs[True]]
    doc = {
        "bench": "vllm_scheduler",
        "vllm": "0.33.0",
        "tokens": args.tokens,
        "tp": args.tp,
        "direct_read": "auto" if args.direct_read is None else args.direct_read,
        "chunks": chunks,
        "rounds": args.rounds,
        "connector_ms": round(ms, 3),
        "connector_ms_range": [round(x, 3) for x in ms_range],
        "baseline_connector_ms": round(base_ms, 3),
        "baseline_connector_ms_range": [round(x, 3) for x in base_range],
        # Of connector_ms: the time inside kvtier's manager (lookups, pins,
        # store checks, events); the rest is vLLM's own connector code.
        "manager_ms": round(statistics.median(mgr), 3),
        "manager_ms_range": [round(min(mgr), 3), round(max(mgr), 3)],
        "baseline_manager_ms": round(statistics.median(base_mgr), 3),
        # The engine's steps while the prompt ran (median), those that were
        # idle (nothing scheduled, the manager asked nothing: polling while
        # the workers load) and the hooks' time on them; the workers' read
        # of the prompt, from the first rank's start to the last's end.
        "busy_connector_ms": round(statistics.median(r["busy_connector_ms"] for r in runs[False]), 3),
        "timing_overhead_ms": round(statistics.median(r["timing_overhead_ms"] for r in runs[False]), 3),
        "steps": int(statistics.median(r["steps"] for r in runs[False])),
        "idle_steps": int(statistics.median(r["idle_steps"] for r in runs[False])),
        "idle_connector_ms": round(statistics.median(r["idle_connector_ms"] for r in runs[False]), 3),
        "load_ms": round(statistics.median(r["load_ms"] for r in runs[False]), 3),
        "lookup_requests_per_prompt": lookups,
        "baseline_lookup_requests_per_prompt": base_lookups,
        "prompts_per_s": round(1000.0 / ms, 3) if ms > 0 else None,
        "baseline_prompts_per_s": round(1000.0 / base_ms, 3) if base_ms > 0 else None,
        "prompts_per_s_vs_baseline": round(base_ms / ms, 3) if ms > 0 else None,
        "target_connector_ms": TARGET_CONNECTOR_MS,
        "meets_target": ms <= TARGET_CONNECTOR_MS,
        "baseline": "the connector's lookups before batching: one kvtierd request per chunk per rank",
    }
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"vLLM scheduler, {args.tokens}-token cached prompt ({chunks} chunks) at TP {args.tp}, "
              f"median of {args.rounds}:")
        print(f"  kvtier connector:   {ms:9.2f} ms  (range {ms_range[0]:.2f}-{ms_range[1]:.2f}), "
              f"{lookups} lookup requests")
        print(f"  per-chunk baseline: {base_ms:9.2f} ms  (range {base_range[0]:.2f}-{base_range[1]:.2f}), "
              f"{base_lookups} lookup requests")
        print(f"  of which kvtier's manager: {doc['manager_ms']:.2f} ms "
              f"(baseline {doc['baseline_manager_ms']:.2f} ms); the rest is vLLM's connector code")
        print(f"  {doc['steps']} steps, {doc['idle_steps']} of them idle while the workers load "
              f"({doc['idle_connector_ms']:.2f} ms of hooks, the other steps {doc['busy_connector_ms']:.2f} ms); "
              f"the load took {doc['load_ms']:.0f} ms; the bench's wrappers ~{doc['timing_overhead_ms']:.2f} ms")
        print(f"  target <= {TARGET_CONNECTOR_MS} ms: {'met' if doc['meets_target'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
