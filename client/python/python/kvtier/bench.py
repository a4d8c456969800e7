"""``python -m kvtier.bench``: onboard/offload throughput from Python beside
the Rust client on the same daemon, block size and batch depth, in the same
run, and beside raw O_DIRECT (the Rust client's figures and the O_DIRECT
baseline come from ``kvtier bench io`` run against the same daemon, rounds
interleaved A B A B; medians reported).

Output contract (shared/BENCH.md): with --json, one JSON document on stdout;
each comparison has its value, its baseline and their quotient under a key
ending in ``_vs_baseline`` (higher is better).

    python -m kvtier.bench --json                      # 2 MiB blocks, starts kvtierd
    python -m kvtier.bench --socket /run/kvtier/kvtierd.sock --blocks 256
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket as socketlib
import statistics
import subprocess
import sys
import tempfile
import time

import kvtier


def parse_size(s: str) -> int:
    s = s.strip()
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def find_binary(name: str, explicit: str | None) -> str | None:
    if explicit:
        return explicit
    here = pathlib.Path(__file__).resolve()
    roots = [os.environ.get("CARGO_TARGET_DIR")] + [str(p / "target") for p in here.parents]
    for r in roots:
        if not r:
            continue
        for prof in ("release", "debug"):
            p = pathlib.Path(r) / prof / name
            if p.exists():
                return str(p)
    return shutil.which(name)


def start_daemon(kvtierd: str, d: pathlib.Path) -> subprocess.Popen:
    sock = d / "kvtierd.sock"
    p = subprocess.Popen(
        [kvtierd, "--socket", str(sock), "--g3-dir", str(d / "g3"), "--g3-capacity", "8GiB",
         "--metrics-addr", "", "--g4", ""],
        stdout=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="warn"),
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socketlib.socket(socketlib.AF_UNIX) as s:
                s.connect(str(sock))
            return p
        except OSError:
            time.sleep(0.02)
    p.kill()
    raise SystemExit("kvtierd did not start")


def gbps(nbytes: int, secs: float) -> float:
    return nbytes / max(secs, 1e-9) / 1e9


def py_round(client, ns, rnd: int, blocks: int, depth: int, np, bufs, out):
    """One Python round: offload `blocks` fresh blocks in batches of `depth`,
    then onboard them; returns (offload GB/s, onboard GB/s)."""
    keys = ns.hash_chain(np.arange(rnd * blocks * 16, (rnd + 1) * blocks * 16, dtype=np.uint32) + (1 << 30))
    bb = ns.block_bytes
    t = time.perf_counter()
    for i in range(0, blocks, depth):
        r = client.offload(ns, keys[i : i + depth], bufs[i : i + depth])
        if not all(r):
            raise SystemExit(f"offload failed: {r[0]!r}")
    off = gbps(bb * blocks, time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(0, blocks, depth):
        r = client.onboard_into(ns, keys[i : i + depth], out[i : i + depth])
        if not all(r):
            raise SystemExit(f"onboard failed: {r[0]!r}")
    on = gbps(bb * blocks, time.perf_counter() - t)
    if not all((a == b).all() for a, b in zip(bufs[:2], out[:2])):
        raise SystemExit("onboarded bytes differ")
    return off, on


def pool_round(client, pool, ns, rnd: int, blocks: int, depth: int, np):
    """The same round through the shared-memory pool (offsets only)."""
    keys = ns.hash_chain(np.arange(rnd * blocks * 16, (rnd + 1) * blocks * 16, dtype=np.uint32) + (1 << 31))
    bb = ns.block_bytes
    t = time.perf_counter()
    for i in range(0, blocks, depth):
        r = client.offload_pool(ns, keys[i : i + depth], list(range(i, min(i + depth, blocks))))
        if not all(r):
            raise SystemExit(f"pool offload failed: {r[0]!r}")
    off = gbps(bb * blocks, time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(0, blocks, depth):
        r = client.onboard_pool(ns, keys[i : i + depth], list(range(i, min(i + depth, blocks))))
        if not all(r):
            raise SystemExit(f"pool onboard failed: {r[0]!r}")
    on = gbps(bb * blocks, time.perf_counter() - t)
    return off, on


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", default="2MiB", type=parse_size)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per round")
    ap.add_argument("--depth", type=int, default=8, help="blocks per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--socket", help="a running kvtierd (default: start one in a temp dir)")
    ap.add_argument("--dir", help="where to put the started daemon and the O_DIRECT baseline file")
    ap.add_argument("--kvtier", help="the kvtier CLI (default: the workspace build or $PATH)")
    ap.add_argument("--kvtierd", help="kvtierd (default: the workspace build or $PATH)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import numpy as np

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-pybench-", dir=a.dir))
    proc = None
    try:
        sock = a.socket
        if not sock:
            kvtierd = find_binary("kvtierd", a.kvtierd)
            if not kvtierd:
                raise SystemExit("no kvtierd: pass --socket or --kvtierd")
            proc = start_daemon(kvtierd, tmp)
            sock = str(tmp / "kvtierd.sock")
        cli = find_binary("kvtier", a.kvtier)
        ns = kvtier.Namespace("kvtier-bench/python", kvtier.Layout.with_block_bytes(a.block_size), tenant_salt=os.urandom(8))
        client = kvtier.Client(socket=sock, timeout_ms=30_000, region_bytes=max(64 << 20, (a.depth + 1) * (a.block_size + 8192)))
        rng = np.random.default_rng(1)
        bufs = [rng.integers(0, 256, a.block_size, dtype=np.uint8) for _ in range(a.blocks)]
        out = [np.zeros(a.block_size, np.uint8) for _ in range(a.blocks)]
        pclient = kvtier.Client(socket=sock, timeout_ms=30_000, region_bytes=1 << 20)
        pool = pclient.alloc_pool(a.blocks * kvtier.Pool.slot_bytes(a.block_size))
        pool.array(a.block_size)[:] = np.stack(bufs)
        py_off, py_on, rs_off, rs_on, od_r, od_w, pl_off, pl_on = [], [], [], [], [], [], [], []
        for rnd in range(a.rounds):
            o, n = py_round(client, ns, rnd, a.blocks, a.depth, np, bufs, out)
            py_off.append(o)
            py_on.append(n)
            o, n = pool_round(pclient, pool, ns, rnd, a.blocks, a.depth, np)
            pl_off.append(o)
            pl_on.append(n)
            if cli:
                r = subprocess.run(
                    [cli, "bench", "io", "--socket", sock, "--dir", str(tmp), "--block-size", str(a.block_size),
                     "--blocks", str(a.blocks), "--depth", str(a.depth), "--clients", "1", "--rounds", "1", "--json"],
                    capture_output=True, text=True, timeout=600,
                )
                if r.returncode != 0:
                    raise SystemExit(f"kvtier bench io failed: {r.stderr[-2000:]}")
                j = json.loads(r.stdout)
                rs_off += j["offload_gbps_rounds"]
                rs_on += j["onboard_gbps_rounds"]
                od_w += j["baseline_write_gbps_rounds"]
                od_r += j["baseline_read_gbps_rounds"]
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        q = lambda x, b: (x / b) if (x is not None and b) else None  # noqa: E731
        doc = {
            "bench": "python",
            "block_bytes": a.block_size,
            "blocks": a.blocks,
            "depth": a.depth,
            "rounds": a.rounds,
            "clients": 1,
            "mode": "shm",
            "python_offload_gbps": med(py_off),
            "python_onboard_gbps": med(py_on),
            "rust_offload_gbps": med(rs_off),
            "rust_onboard_gbps": med(rs_on),
            "odirect_write_gbps": med(od_w),
            "odirect_read_gbps": med(od_r),
            "python_pool_offload_gbps": med(pl_off),
            "python_pool_onboard_gbps": med(pl_on),
            "python_pool_offload_gbps_rounds": pl_off,
            "python_pool_onboard_gbps_rounds": pl_on,
            "pool_offload_gbps_vs_baseline": q(med(pl_off), med(rs_off)),
            "pool_onboard_gbps_vs_baseline": q(med(pl_on), med(rs_on)),
            "python_offload_gbps_rounds": py_off,
            "python_onboard_gbps_rounds": py_on,
            "rust_offload_gbps_rounds": rs_off,
            "rust_onboard_gbps_rounds": rs_on,
            "offload_gbps_vs_baseline": q(med(py_off), med(rs_off)),
            "onboard_gbps_vs_baseline": q(med(py_on), med(rs_on)),
            "offload_odirect_gbps_vs_baseline": q(med(py_off), med(od_w)),
            "onboard_odirect_gbps_vs_baseline": q(med(py_on), med(od_r)),
            "baselines": {
                "offload_gbps_vs_baseline": "the Rust client (kvtier bench io, 1 client, same daemon, depth, block size)",
                "onboard_gbps_vs_baseline": "the Rust client (kvtier bench io, 1 client, same daemon, depth, block size)",
                "offload_odirect_gbps_vs_baseline": "raw O_DIRECT writes of the same sizes and depth beside the daemon's dir",
                "onboard_odirect_gbps_vs_baseline": "raw O_DIRECT reads of the same sizes and depth",
                "pool_offload_gbps_vs_baseline": "the Rust client (copying) vs Python through the shared-memory pool (offsets only)",
                "pool_onboard_gbps_vs_baseline": "the Rust client (copying) vs Python through the shared-memory pool (offsets only)",
            },
        }
        if not cli:
            doc["note"] = "no kvtier CLI found: Rust and O_DIRECT baselines missing (pass --kvtier)"
        if a.json:
            print(json.dumps(doc))
        else:
            for k, v in doc.items():
                if not isinstance(v, (list, dict)):
                    print(f"{k:40} {v:.3f}" if isinstance(v, float) else f"{k:40} {v}")
        return 0
    finally:
        if proc:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
