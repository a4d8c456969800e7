#!/usr/bin/env python3
"""One round of Mooncake Store with SSD offload for `kvtier bench peers`.

Starts `mooncake_master` (from the `mooncake-transfer-engine-non-cuda`
wheel) on loopback with its HTTP metadata server and offload on, joins it
as one store client over TCP with a memory segment smaller than the round's
data and SSD offload into `--dir`, puts every block (`--inflight` threads),
then reads every block back. A put that returned 0 but whose block is not
read back with its exact bytes is lost. Mooncake has no restart that keeps
a client's offloaded keys (its master forgets a client's segments when the
client goes away), so its gets run in the same process after the puts:
more lenient than the restart kvtier and foyer get.

Prints one JSON line with the keys `kvtier bench peers` reads.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time


def read_payloads(n, size):
    """The round's blocks, from `kvtier bench peers` on stdin (its
    common::noise, generated once in Rust rather than again in Python)."""
    out = []
    for _ in range(n):
        b = sys.stdin.buffer.read(size)
        if len(b) != size:
            raise RuntimeError(f"stdin ended: {len(out)} of {n} blocks")
        out.append(b)
    return out


def version():
    try:
        from importlib.metadata import version as v

        return v("mooncake-transfer-engine-non-cuda")
    except Exception:
        return "unknown"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(v, p):
    if not v:
        return 0.0
    s = sorted(v)
    import math

    rank = math.ceil(p / 100.0 * len(s))
    return s[min(max(rank, 1), len(s)) - 1]


def wait_port(port, proc, timeout_s):
    t = time.time()
    while time.time() - t < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited at start ({proc.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"mooncake_master did not listen on {port} in {timeout_s} s")


def run_threads(n, fn):
    errs = []

    def wrap(w):
        try:
            fn(w)
        except Exception as e:  # reported, not swallowed
            errs.append(e)

    ts = [threading.Thread(target=wrap, args=(w,)) for w in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--block-bytes", type=int, default=2 << 20)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    import mooncake
    from mooncake.store import MooncakeDistributedStore

    pkg = os.path.dirname(mooncake.__file__)
    work = os.path.join(os.path.abspath(a.dir), "mooncake")
    shutil.rmtree(work, ignore_errors=True)
    ssd = os.path.join(work, "ssd")
    os.makedirs(ssd)
    rpc, meta = free_port(), free_port()
    master = subprocess.Popen(
        [
            os.path.join(pkg, "mooncake_master"),
            f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={meta}",
            "--enable_offload=true",
            "--metrics_port=" + str(free_port()),
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(work, "master.log"), "w"),
    )
    try:
        wait_port(rpc, master, 20)
        wait_port(meta, master, 20)
        payloads = read_payloads(a.blocks, a.block_bytes)
        total = a.blocks * a.block_bytes
        store = MooncakeDistributedStore()
        # A memory segment of half the round's data: the other half must go
        # through the SSD offload to be kept.
        seg = max(total // 2, 16 << 20)
        rc = store.setup(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": f"http://127.0.0.1:{meta}/metadata",
                "global_segment_size": seg,
                "local_buffer_size": max(64 << 20, a.block_bytes * a.inflight * 2),
                "protocol": "tcp",
                "rdma_devices": "",
                "master_server_addr": f"127.0.0.1:{rpc}",
                "enable_ssd_offload": True,
                "ssd_offload_path": ssd,
            }
        )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        prefix = f"peers-{a.seed}-"
        put_lat, acked = [], [0]
        lock = threading.Lock()

        def put(w):
            mine, n = [], 0
            for i in range(w, a.blocks, a.inflight):
                t = time.perf_counter()
                r = store.put(prefix + str(i), payloads[i])
                mine.append((time.perf_counter() - t) * 1e6)
                n += r == 0
            with lock:
                put_lat.extend(mine)
                acked[0] += n

        t = time.perf_counter()
        run_threads(a.inflight, put)
        put_s = time.perf_counter() - t
        # Let the offload queue drain before reading (lenient to Mooncake).
        time.sleep(1.0)
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            cold = True
        except OSError:
            cold = False
        get_lat, lost, got = [], [0], [0]

        def get(w):
            mine, n, b = [], 0, 0
            for i in range(w, a.blocks, a.inflight):
                t = time.perf_counter()
                v = store.get(prefix + str(i))
                us = (time.perf_counter() - t) * 1e6
                if v == payloads[i]:
                    mine.append(us)
                    b += len(v)
                else:
                    n += 1
            with lock:
                get_lat.extend(mine)
                lost[0] += n
                got[0] += b

        t = time.perf_counter()
        run_threads(a.inflight, get)
        get_s = time.perf_counter() - t
        store.close()
        not_acked = a.blocks - acked[0]
        print(
            json.dumps(
                {
                    "system": "mooncake",
                    "mooncake_version": version(),
                    "blocks": a.blocks,
                    "block_bytes": a.block_bytes,
                    "inflight": a.inflight,
                    "global_segment_bytes": seg,
                    "acknowledged": acked[0],
                    "lost_blocks": max(lost[0] - not_acked, 0),
                    "put_gbps": acked[0] * a.block_bytes / put_s / 1e9 if put_s > 0 else 0.0,
                    "put_p50_us": percentile(put_lat, 50),
                    "put_p99_us": percentile(put_lat, 99),
                    "get_gbps": got[0] / get_s / 1e9 if get_s > 0 else 0.0,
                    "get_p50_us": percentile(get_lat, 50),
                    "get_p99_us": percentile(get_lat, 99),
                    "cold_page_cache": cold,
                }
            )
        )
        sys.stdout.flush()
    finally:
        master.terminate()
        try:
            master.wait(timeout=5)
        except subprocess.TimeoutExpired:
            master.kill()
        shutil.rmtree(work, ignore_errors=True)
    # The store's native threads may hold the interpreter at exit.
    os._exit(0)


if __name__ == "__main__":
    main()
