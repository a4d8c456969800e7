"""``python -m kvtier.bench``: onboard/offload throughput from Python beside
the Rust client on the same blocks in the same run, and beside raw O_DIRECT.

Method (the same for every path, so a quotient measures the path and not
the setup): one daemon; one set of source buffers (numpy, 2 MiB by default)
and one set of destination buffers; per round and path a fresh namespace,
offload of all blocks in requests of --depth, with --drop-caches the page
cache dropped (root), onboard in one shuffled order shared by all paths, then
the round's blocks evicted. The paths, in alternating order each round:

- python: ``Client.offload`` / ``Client.onboard_into`` called from Python;
- rust: the same requests, same client, same buffers, made by kvtier-client
  in one Rust loop with no Python between requests (``_rust_client_round``):
  the baseline of ``*_gbps_vs_baseline``;
- pool: ``offload_pool`` / ``onboard_pool`` (offsets only);
- ``kvtier bench io`` (its own process and blocks): the raw O_DIRECT
  baseline of the same sizes and depth, and the Rust client as the CLI
  measures it (``rust_cli_*``), as a cross-check.

--warmup rounds run first and are not counted (first-touch page faults of
the buffers and the region, the daemon's first files); medians of --rounds.

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
from kvtier import _kvtier


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
    # The workspace build next to this package (a checkout's editable
    # install) or above the current directory (a checkout the user is in,
    # with the package installed elsewhere), then $PATH.
    here = pathlib.Path(__file__).resolve()
    cwd = pathlib.Path.cwd().resolve()
    roots = [os.environ.get("CARGO_TARGET_DIR")] + [
        str(p / "target") for p in [*here.parents, cwd, *cwd.parents]
    ]
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


def drop_page_cache() -> bool:
    """As ``kvtier bench io`` does before its onboard (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def batches(n: int, depth: int):
    return [(i, min(i + depth, n)) for i in range(0, n, depth)]


def timed(call, ns, keys, items, depth):
    """Runs call(ns, keys[i:j], items[i:j]) per request of `depth` blocks;
    returns (seconds, blocks that failed)."""
    t = time.perf_counter()
    bad = 0
    for i, j in batches(len(keys), depth):
        bad += sum(not r for r in call(ns, keys[i:j], items[i:j]))
    return time.perf_counter() - t, bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", default="2MiB", type=parse_size)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per round")
    ap.add_argument("--depth", type=int, default=8, help="blocks per request")
    ap.add_argument("--rounds", type=int, default=5, help="counted rounds (medians)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--socket", help="a running kvtierd (default: start one in a temp dir)")
    ap.add_argument("--dir", help="where to put the started daemon and the O_DIRECT baseline file")
    ap.add_argument("--kvtier", help="the kvtier CLI (default: the workspace build or $PATH)")
    ap.add_argument("--kvtierd", help="kvtierd (default: the workspace build or $PATH)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="sync and drop the page cache before each onboard, as kvtier bench io does (root; "
                         "slow on a busy machine, and every process there loses its cache)")
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
                raise SystemExit(
                    "no kvtierd found ($CARGO_TARGET_DIR, target/ above this package or the current "
                    "directory, $PATH): pass --socket of a running one or --kvtierd PATH"
                )
            proc = start_daemon(kvtierd, tmp)
            sock = str(tmp / "kvtierd.sock")
        cli = find_binary("kvtier", a.kvtier)
        layout = kvtier.Layout.with_block_bytes(a.block_size)
        salt = os.urandom(8)
        bs, n = a.block_size, a.blocks
        # One region for every copying path: room for one request.
        client = kvtier.Client(socket=sock, timeout_ms=30_000, region_bytes=max(64 << 20, (a.depth + 1) * (bs + 8192)))
        rng = np.random.default_rng(1)
        bufs = [rng.integers(0, 256, bs, dtype=np.uint8) for _ in range(n)]
        outs = [np.zeros(bs, np.uint8) for _ in range(n)]
        pclient = kvtier.Client(socket=sock, timeout_ms=30_000, region_bytes=1 << 20)
        pool = pclient.alloc_pool(n * kvtier.Pool.slot_bytes(bs))
        pool.array(bs)[:] = np.stack(bufs)
        slots = list(range(n))

        def rust(op):
            return lambda ns, keys, items, depth: _kvtier._rust_client_round(client, ns, op, keys, items, depth)

        def py(call):
            return lambda ns, keys, items, depth: timed(call, ns, keys, items, depth)

        paths = {
            # (client, offload, onboard, sources, destinations for an order):
            # buffer i receives block perm[i]; a pool block returns to its slot.
            "python": (client, py(client.offload), py(client.onboard_into), bufs, lambda perm: outs),
            "rust": (client, rust("offload"), rust("onboard"), bufs, lambda perm: outs),
            "pool": (pclient, py(pclient.offload_pool), py(pclient.onboard_pool), slots,
                     lambda perm: [slots[i] for i in perm]),
        }
        rounds = {p: ([], []) for p in paths}
        cold = True
        cli_off, cli_on, od_w, od_r = [], [], [], []
        for rnd in range(a.warmup + a.rounds):
            counted = rnd >= a.warmup
            perm = np.random.default_rng(100 + rnd).permutation(n).tolist()
            order = list(paths) if rnd % 2 == 0 else list(reversed(paths))
            for p in order:
                c, off_fn, on_fn, src, dst = paths[p]
                ns = kvtier.Namespace(f"kvtier-bench/{p}/{rnd}", layout, tenant_salt=salt)
                tokens = np.arange(n * layout.tokens_per_block, dtype=np.uint32)
                keys = ns.hash_chain(tokens)
                secs, bad = off_fn(ns, keys, src, a.depth)
                if bad:
                    raise SystemExit(f"{p}: offload failed for {bad} blocks")
                off = gbps(bs * n, secs)
                if a.drop_caches:
                    cold &= drop_page_cache()
                # Onboard in a shuffled order: destination i gets block perm[i].
                secs, bad = on_fn(ns, [keys[i] for i in perm], dst(perm), a.depth)
                if bad:
                    raise SystemExit(f"{p}: onboard missed {bad} blocks it had just stored")
                on = gbps(bs * n, secs)
                # Every block byte-exact (outside the timing), then the
                # destinations' first page cleared: the next path must land
                # its own bytes.
                for i in range(n):
                    got = outs[i] if p != "pool" else np.frombuffer(pool.block(perm[i], bs), np.uint8)
                    if not np.array_equal(got, bufs[perm[i]]):
                        raise SystemExit(f"{p}: onboarded block {perm[i]} differs")
                    if p != "pool":
                        outs[i][:4096] = 0
                c.evict(ns, keys)
                if counted:
                    rounds[p][0].append(off)
                    rounds[p][1].append(on)
            if cli and counted:
                r = subprocess.run(
                    [cli, "bench", "io", "--socket", sock, "--dir", str(tmp), "--block-size", str(bs),
                     "--blocks", str(n), "--depth", str(a.depth), "--clients", "1", "--rounds", "1", "--json"],
                    capture_output=True, text=True, timeout=600,
                )
                if r.returncode != 0:
                    raise SystemExit(f"kvtier bench io failed: {r.stderr[-2000:]}")
                j = json.loads(r.stdout)
                cli_off += j["offload_gbps_rounds"]
                cli_on += j["onboard_gbps_rounds"]
                od_w += j["baseline_write_gbps_rounds"]
                od_r += j["baseline_read_gbps_rounds"]
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        q = lambda x, b: (x / b) if (x is not None and b) else None  # noqa: E731
        py_off, py_on = rounds["python"]
        rs_off, rs_on = rounds["rust"]
        pl_off, pl_on = rounds["pool"]
        # Paired quotients: round by round, then their median (drift between
        # rounds cancels within a pair).
        pair = lambda xs, bs_: med([x / b for x, b in zip(xs, bs_) if b])  # noqa: E731
        requests = len(batches(n, a.depth))
        doc = {
            "bench": "python",
            "block_bytes": bs,
            "blocks": n,
            "depth": a.depth,
            "rounds": a.rounds,
            "warmup_rounds": a.warmup,
            "clients": 1,
            "mode": "shm",
            "cold_page_cache": cold and a.drop_caches,
            "python_offload_gbps": med(py_off),
            "python_onboard_gbps": med(py_on),
            "rust_offload_gbps": med(rs_off),
            "rust_onboard_gbps": med(rs_on),
            "python_pool_offload_gbps": med(pl_off),
            "python_pool_onboard_gbps": med(pl_on),
            "rust_cli_offload_gbps": med(cli_off),
            "rust_cli_onboard_gbps": med(cli_on),
            "odirect_write_gbps": med(od_w),
            "odirect_read_gbps": med(od_r),
            "offload_gbps_vs_baseline": q(med(py_off), med(rs_off)),
            "onboard_gbps_vs_baseline": q(med(py_on), med(rs_on)),
            "offload_paired_gbps_vs_baseline": pair(py_off, rs_off),
            "onboard_paired_gbps_vs_baseline": pair(py_on, rs_on),
            "pool_offload_gbps_vs_baseline": q(med(pl_off), med(rs_off)),
            "pool_onboard_gbps_vs_baseline": q(med(pl_on), med(rs_on)),
            "offload_rust_cli_gbps_vs_baseline": q(med(py_off), med(cli_off)),
            "onboard_rust_cli_gbps_vs_baseline": q(med(py_on), med(cli_on)),
            "offload_odirect_gbps_vs_baseline": q(med(py_off), med(od_w)),
            "onboard_odirect_gbps_vs_baseline": q(med(py_on), med(od_r)),
            "rust_offload_odirect_gbps_vs_baseline": q(med(rs_off), med(od_w)),
            "rust_onboard_odirect_gbps_vs_baseline": q(med(rs_on), med(od_r)),
            # What Python adds per request (ms): (python - rust) time / requests.
            "python_offload_overhead_ms_per_request": med(
                [(bs * n / 1e9 / p - bs * n / 1e9 / r) * 1e3 / requests for p, r in zip(py_off, rs_off)]),
            "python_onboard_overhead_ms_per_request": med(
                [(bs * n / 1e9 / p - bs * n / 1e9 / r) * 1e3 / requests for p, r in zip(py_on, rs_on)]),
            "python_offload_gbps_rounds": py_off,
            "python_onboard_gbps_rounds": py_on,
            "rust_offload_gbps_rounds": rs_off,
            "rust_onboard_gbps_rounds": rs_on,
            "python_pool_offload_gbps_rounds": pl_off,
            "python_pool_onboard_gbps_rounds": pl_on,
            "rust_cli_offload_gbps_rounds": cli_off,
            "rust_cli_onboard_gbps_rounds": cli_on,
            "baselines": {
                "offload_gbps_vs_baseline": "the Rust client: the same requests on the same buffers, client and daemon, "
                                            "from one Rust loop (medians over rounds)",
                "onboard_gbps_vs_baseline": "as offload_gbps_vs_baseline",
                "offload_paired_gbps_vs_baseline": "median of the per-round quotients python / rust",
                "onboard_paired_gbps_vs_baseline": "median of the per-round quotients python / rust",
                "pool_offload_gbps_vs_baseline": "the Rust client (copying) vs Python through the shared-memory pool",
                "pool_onboard_gbps_vs_baseline": "the Rust client (copying) vs Python through the shared-memory pool",
                "offload_rust_cli_gbps_vs_baseline": "kvtier bench io (1 client, its own process and blocks)",
                "onboard_rust_cli_gbps_vs_baseline": "kvtier bench io (1 client, its own process and blocks)",
                "offload_odirect_gbps_vs_baseline": "raw O_DIRECT writes of the same sizes and depth beside the daemon's dir",
                "onboard_odirect_gbps_vs_baseline": "raw O_DIRECT reads of the same sizes and depth",
                "rust_offload_odirect_gbps_vs_baseline": "raw O_DIRECT writes (the Rust client's share of the disk)",
                "rust_onboard_odirect_gbps_vs_baseline": "raw O_DIRECT reads (the Rust client's share of the disk)",
            },
        }
        if not cli:
            doc["note"] = "no kvtier CLI found: O_DIRECT and rust_cli baselines missing (pass --kvtier)"
        if a.json:
            print(json.dumps(doc))
        else:
            for k, v in doc.items():
                if not isinstance(v, (list, dict)):
                    print(f"{k:44} {v:.3f}" if isinstance(v, float) else f"{k:44} {v}")
        return 0
    finally:
        if proc:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
