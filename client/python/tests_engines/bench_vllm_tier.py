"""kvtier's vLLM tier (``KvtierTierManager``) beside vLLM 0.33.0's own
``fs`` tier, each as the one secondary tier of vLLM's
``TieringOffloadingSpec`` behind its CPU tier, through vLLM's real
Scheduler and TieringOffloadingManager (vllm_engine.Engine on CPU, the
GPU<->CPU copy a CPU copy: test_vllm_tier.CpuCopy), on the same disk,
the same prompts, interleaved (A B A B ...) in one invocation:

- store: an engine runs the prompts and its CPU tier cascades every
  chunk to the tier (timed to the last chunk stored; one chunk of
  another prompt first, untimed, in each phase);
- load: a new engine (an empty CPU tier; kvtierd restarted too) runs the
  same prompts, every full chunk a hit from the tier (timed to the last
  prompt finished);
- the scheduler's time in each phase (in all, its steps, per step), hits
  after the restart,
  disk used per round and after all rounds against kvtier's G3 capacity
  (``--g3-capacity``, below what the rounds store together; fs has no
  capacity setting);
- then one prompt stored in each, every block file corrupted, and a new
  engine's run: how many tokens' KV vLLM took from a corrupt file.

    target/engines-venv/bin/python client/python/tests_engines/bench_vllm_tier.py \\
        --prompts 8 --tokens 2048 --rounds 3 --json

Starts its own kvtierd (target/debug/kvtierd, or $KVTIER_TEST_KVTIERD; G3
only) in a temp dir; the fs tier's root is a temp dir on the same
filesystem. One JSON document
on stdout with ``--json`` (docs/BENCHMARKS.md, vllm_tier), progress on
stderr. Not a test: the suite runs it at a tiny size for its JSON. The
page cache is not dropped (reads may be warm for both tiers alike)."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vllm_engine  # noqa: E402
from conftest import support  # noqa: E402
from test_vllm_tier import CpuCopy, _CudaAlike, settle  # noqa: E402
from vllm.v1.kv_offload.cpu import gpu_worker  # noqa: E402
from vllm.v1.kv_offload.cpu import spec as cpu_spec  # noqa: E402
from vllm_engine import BLOCK_SIZE, LAYERS, Engine  # noqa: E402

CHUNK_TOKENS = 256  # TieringOffloadingSpec's block_size: tokens per chunk


# kvtier's load route (--direct-read): None, the tier's default.
DIRECT_READ = None


def tier(kind: str, socket: str, where: str) -> dict:
    if kind == "kvtier":
        t = {"type": "KvtierTierManager", "module_path": "kvtier.integrations.vllm_tier", "socket": socket,
             "timeout_ms": 30000, "tenant_salt": where}
        if DIRECT_READ is not None:
            t["direct_read"] = DIRECT_READ
        return t
    return {"type": "fs", "root_dir": where}


def engine(tmp: pathlib.Path, socket: str, kind: str, where: str, num_blocks: int, max_len: int) -> Engine:
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30, "block_size": CHUNK_TOKENS,
             "secondary_tiers": [tier(kind, socket, where)]}
    e = Engine(tmp, socket, connector="OffloadingConnector", policy="fail", num_blocks=num_blocks,
               max_model_len=max_len, **extra)
    # The scheduler's own time per step.
    e.sched_s = []
    schedule = e.scheduler.schedule

    def timed():
        t0 = time.perf_counter()
        out = schedule()
        e.sched_s.append(time.perf_counter() - t0)
        return out

    e.scheduler.schedule = timed
    return e


def run_all(e: Engine, prompts: dict) -> None:
    for rid, p in prompts.items():
        e.add(rid, p)
    deadline = time.monotonic() + 600
    while not all(r in e.finished for r in prompts) or e.scheduler.has_requests():
        assert time.monotonic() < deadline, "prompts did not finish"
        if not e.step():
            time.sleep(0.001)


def disk_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def bad_tokens(e: Engine, req_id: str) -> dict:
    """Counts, when ``req_id`` is first scheduled, the tokens before what
    the engine computes whose KV is not what the prompt's writer computed
    (KV vLLM took from a bad chunk)."""
    seen: dict = {}
    forward = e._forward

    def check(so) -> None:
        n = so.num_scheduled_tokens.get(req_id)
        if n is not None and "loaded" not in seen:
            req = e.scheduler.requests[req_id]
            start = req.num_computed_tokens - n
            block_ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            bad = 0
            for pos in range(start):
                b, off = block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                for li, layer in enumerate(LAYERS):
                    want = float(req.all_token_ids[0] * 10_000 + pos * 10 + li)
                    if not bool((e.kv[layer][b, :, off] == want).all()):
                        bad += 1
                        break
            seen.update(loaded=start, bad=bad)
        forward(so)

    e._forward = check
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per phase")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per prompt (full chunks plus a tail of 5)")
    ap.add_argument("--kv-heads", type=int, default=16, help="KV heads (chunk bytes: 2 layers x 2 x heads x 32 x 4 "
                    "x 256 tokens; 16: 2 MiB)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each (interleaved)")
    ap.add_argument("--g3-capacity", default="384MiB", help="kvtierd's G3 capacity (below what the rounds store "
                    "together: kvtier keeps to it, fs has no bound)")
    ap.add_argument("--direct-read", choices=["auto", "fd", "region"], default="auto",
                    help="kvtier's load route: the tier's default (auto), passed fds, or the shared region")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    gpu_worker.SingleDirectionOffloadingHandler = CpuCopy
    cpu_spec.current_platform = _CudaAlike(cpu_spec.current_platform)
    vllm_engine.KV_HEADS = args.kv_heads
    global DIRECT_READ
    DIRECT_READ = {"auto": None, "fd": True, "region": False}[args.direct_read]
    chunks = args.tokens // CHUNK_TOKENS
    tokens = chunks * CHUNK_TOKENS + 5
    max_len = tokens + 64
    num_blocks = (max_len // BLOCK_SIZE + 2) * args.prompts
    chunk_bytes = len(LAYERS) * 2 * args.kv_heads * vllm_engine.HEAD_SIZE * 4 * CHUNK_TOKENS

    work = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-bench-tier-"))
    d = support.Daemon(g4=False, g3_capacity=args.g3_capacity)
    fs_root = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-bench-fs-", dir=d.dir.parent))
    res: dict = {k: {"store_s": [], "load_s": [], "store_sched_ms": [], "load_sched_ms": [], "store_steps": [],
                     "load_steps": [], "hit_tokens": [], "disk_bytes": []} for k in ("kvtier", "fs")}
    try:
        for r in range(args.rounds):
            order = ("kvtier", "fs") if r % 2 == 0 else ("fs", "kvtier")
            for kind in order:
                # One namespace (one fs root) for every round, as a
                # deployment has: each round's prompts are new chunks in it.
                where = "bench" if kind == "kvtier" else str(fs_root / "bench")
                prompts = {f"{kind}{r}-p{i}": [(1 + r * 64 + i) * 7] + [100 + (i * 31 + j) % 900
                                                                          for j in range(tokens - 1)]
                           for i in range(args.prompts)}
                # One chunk first, untimed, in each phase (the engine's and
                # the tier's first request: connections, directories).
                warm = [3 + r] + [50 + j % 900 for j in range(CHUNK_TOKENS + 4)]
                e = engine(work, d.socket, kind, where, num_blocks, max_len)
                run_all(e, {"warm": warm})
                settle(e)
                store_dir = d.dir / "g3" if kind == "kvtier" else pathlib.Path(where)
                disk_before = disk_bytes(store_dir)
                e.sched_s.clear()
                t0 = time.perf_counter()
                run_all(e, prompts)
                settle(e)
                store_s = time.perf_counter() - t0
                store_sched, store_steps = sum(e.sched_s) * 1e3, len(e.sched_s)
                e.shutdown()
                used = disk_bytes(store_dir) - disk_before
                # vLLM restarted (an empty CPU tier), kvtierd too.
                d.restart(clean=True)
                e = engine(work, d.socket, kind, where, num_blocks, max_len)
                run_all(e, {"warm-again": warm})
                e.sched_s.clear()
                t0 = time.perf_counter()
                run_all(e, {k + "-again": v for k, v in prompts.items()})
                load_s = time.perf_counter() - t0
                hit = sum(len(p) - e.computed[k + "-again"] for k, p in prompts.items())
                res[kind]["load_sched_ms"].append(sum(e.sched_s) * 1e3)
                res[kind]["load_steps"].append(len(e.sched_s))
                e.shutdown()
                res[kind]["store_s"].append(store_s)
                res[kind]["load_s"].append(load_s)
                res[kind]["store_sched_ms"].append(store_sched)
                res[kind]["store_steps"].append(store_steps)
                res[kind]["hit_tokens"].append(hit)
                res[kind]["disk_bytes"].append(used)
                print(f"round {r} {kind}: store {store_s:.2f} s, load {load_s:.2f} s, hit {hit} tokens, "
                      f"disk {used >> 20} MiB", file=sys.stderr)
        # What each holds after every round (kvtier's G3 its capacity at
        # most; vLLM's fs tier has no capacity setting).
        total = {"kvtier": disk_bytes(d.dir / "g3"), "fs": disk_bytes(fs_root / "bench")}
        # A corrupt file: one prompt stored in each, every block file of
        # it flipped, a new engine runs it.
        corrupt: dict = {}
        for kind in ("kvtier", "fs"):
            where = "corrupt" if kind == "kvtier" else str(fs_root / "corrupt")
            p = [999] + [100 + j % 900 for j in range(tokens - 1)]
            e = engine(work, d.socket, kind, where, num_blocks, max_len)
            run_all(e, {"w": p})
            settle(e)
            e.shutdown()
            if kind == "kvtier":
                n = support.corrupt_every_block_file(d)
            else:
                n = 0
                for f in pathlib.Path(where).rglob("*.bin"):
                    with open(f, "r+b") as fh:
                        fh.seek(17)
                        b = fh.read(1)
                        fh.seek(17)
                        fh.write(bytes([b[0] ^ 0xFF]))
                    n += 1
            e = engine(work, d.socket, kind, where, num_blocks, max_len)
            seen = bad_tokens(e, "r")
            run_all(e, {"r": p})
            corrupt[kind] = {"files_corrupted": n, "tokens_loaded": seen.get("loaded", 0),
                             "tokens_served_corrupt": seen.get("bad", 0), "tokens_recomputed": e.computed["r"]}
            e.shutdown()
    finally:
        d.close()
        shutil.rmtree(fs_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    med = {k: {m: statistics.median(v) for m, v in res[k].items()} for k in res}
    nbytes = args.prompts * chunks * chunk_bytes

    def gbps(kind: str, phase: str) -> float:
        return nbytes / med[kind][f"{phase}_s"] / 1e9

    doc = {
        "bench": "vllm_tier",
        "prompts": args.prompts, "tokens": tokens, "chunk_bytes": chunk_bytes, "chunks": args.prompts * chunks,
        "rounds": args.rounds, "direct_read": args.direct_read, "g3_capacity": args.g3_capacity, "page_cache": "warm (not dropped)",
        "store_gbps": gbps("kvtier", "store"), "baseline_store_gbps": gbps("fs", "store"),
        "store_gbps_vs_baseline": gbps("kvtier", "store") / gbps("fs", "store"),
        "load_gbps": gbps("kvtier", "load"), "baseline_load_gbps": gbps("fs", "load"),
        "load_gbps_vs_baseline": gbps("kvtier", "load") / gbps("fs", "load"),
        "store_s_range": [min(res["kvtier"]["store_s"]), max(res["kvtier"]["store_s"])],
        "baseline_store_s_range": [min(res["fs"]["store_s"]), max(res["fs"]["store_s"])],
        "load_s_range": [min(res["kvtier"]["load_s"]), max(res["kvtier"]["load_s"])],
        "baseline_load_s_range": [min(res["fs"]["load_s"]), max(res["fs"]["load_s"])],
        # The scheduler's time in each phase, its steps, and per step (a
        # tier that finishes its jobs sooner has fewer idle, cheap steps).
        **{f"{pre}{ph}_{m}": v for kind, pre in (("kvtier", ""), ("fs", "baseline_")) for ph in ("store", "load")
           for m, v in (("sched_ms", med[kind][f"{ph}_sched_ms"]), ("steps", med[kind][f"{ph}_steps"]),
                        ("sched_ms_per_step", med[kind][f"{ph}_sched_ms"] / max(1, med[kind][f"{ph}_steps"])))},
        "hit_tokens_after_restart": med["kvtier"]["hit_tokens"],
        "baseline_hit_tokens_after_restart": med["fs"]["hit_tokens"],
        "cacheable_tokens": args.prompts * chunks * CHUNK_TOKENS,
        "disk_bytes": med["kvtier"]["disk_bytes"], "baseline_disk_bytes": med["fs"]["disk_bytes"],
        "stored_bytes_all_rounds": args.rounds * (nbytes + chunk_bytes),
        "disk_bytes_all_rounds": total["kvtier"], "baseline_disk_bytes_all_rounds": total["fs"],
        "corrupt": corrupt["kvtier"], "baseline_corrupt": corrupt["fs"],
    }
    if args.json:
        print(json.dumps(doc))
    else:
        for k, v in doc.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
