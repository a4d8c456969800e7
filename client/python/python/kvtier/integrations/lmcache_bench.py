"""kvtier's LMCache plugin beside LMCache's own ``local_disk`` backend, in
one run, through LMCache's StorageManager (built from its config as an
engine builds it: LocalCPUBackend, LocalDiskBackend and the kvtier plugin
side by side), on the same disk::

    python -m kvtier.integrations.lmcache_bench --socket /run/kvtier/kvtierd.sock \\
        --dir /nvme/lmcache-bench --chunks 64 --chunk-mib 16 --rounds 3 --json

kvtierd's G3 must be on the filesystem of ``--dir`` (the same disk), which
is where ``local_disk`` writes. Each round writes a fresh set of chunks to
each backend (``StorageManager.batched_put`` with ``location``, timed until
every chunk is readable and the filesystem is synced: both are durable),
drops the page cache (``--cold``, as root), then reads them back
(``StorageManager.batched_get`` with ``location``, what a retrieve runs)
and checks every byte. The backends alternate (A B, then B A) and the
medians of the rounds are reported, with kvtier over local_disk as
``*_vs_baseline`` (higher is better; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

KVTIER = "kvtier"
LOCAL_DISK = "LocalDiskBackend"

# A chunk's KV shape: `chunk_mib` layers of 1 MiB each (K and V of 256
# tokens x 8 heads x 128 dims of bf16).
TOKENS = 256
HEADS = 8
HEAD_DIM = 128


def _syncfs(path: str) -> None:
    """Flushes the filesystem holding ``path`` (both backends' writes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _drop_caches() -> bool:
    """Drops the page cache (root only); False when it could not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _manager(args, disk_dir: str):
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    chunk_bytes = args.chunk_mib << 20
    batch_gib = args.chunks * chunk_bytes / (1 << 30)
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=TOKENS,
        local_cpu=True,
        # The batch being put, the batch read back, and LMCache's
        # write-back of it into the CPU cache, with room to spare.
        max_local_cpu_size=4 * batch_gib + 0.25,
        local_disk=f"file://{disk_dir}/",
        max_local_disk_size=2 * batch_gib * args.rounds + 1,
        storage_plugins=[KVTIER],
        extra_config={
            "storage_plugin.kvtier.module_path": "kvtier.integrations.lmcache",
            "storage_plugin.kvtier.class_name": "KvtierStorageBackend",
            "kvtier_socket": args.socket,
            "kvtier_timeout_ms": 60_000,
            "kvtier_model": "lmcache-bench",
            "kvtier_direct_read": args.direct_read,
        },
    )
    metadata = LMCacheMetadata(
        model_name="bench/lmcache", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.bfloat16,
        kv_shape=(args.chunk_mib, 2, TOKENS, HEADS, HEAD_DIM), chunk_size=TOKENS,
    )
    return StorageManager(config, metadata, EventManager()), metadata


def _keys(round_: int, backend: str, n: int, nonce: int):
    import torch
    from lmcache.utils import CacheEngineKey

    tag = 0 if backend == KVTIER else 1
    return [
        CacheEngineKey("bench/lmcache", 1, 0, hash((nonce, round_, tag, i)), torch.bfloat16)
        for i in range(n)
    ]


def _fill(manager, metadata, n: int, seed: int) -> tuple[list, list]:
    """n memory objects of random bytes (from the manager's allocator) and
    a digest of each."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat

    objs = manager.batched_allocate(metadata.get_shapes(), metadata.get_dtypes(), n, MemoryFormat.KV_2LTD)
    if objs is None:
        raise SystemExit("LMCache's CPU allocator had no room for the batch: lower --chunks or --chunk-mib")
    g = torch.Generator().manual_seed(seed)
    digests = []
    for o in objs:
        b = o.tensor.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
        digests.append(hashlib.blake2b(b.numpy().tobytes(), digest_size=16).digest())
    return objs, digests


def _put(manager, backend_name: str, keys, objs, disk_dir: str, deadline_s: float) -> float:
    backend = manager.storage_backends[backend_name]
    t0 = time.perf_counter()
    manager.batched_put(keys, objs, location=backend_name)
    # local_disk writes in the background: done when every chunk is found.
    end = time.monotonic() + deadline_s
    while not all(backend.contains(k) for k in keys):
        if time.monotonic() > end:
            raise SystemExit(f"{backend_name}: chunks not stored within {deadline_s} s")
        time.sleep(0.001)
    _syncfs(disk_dir)
    return time.perf_counter() - t0


def _get(manager, backend_name: str, keys, digests) -> float:
    import torch

    t0 = time.perf_counter()
    got = manager.batched_get(keys, location=backend_name)
    took = time.perf_counter() - t0
    try:
        for o, d in zip(got, digests):
            if o is None:
                raise SystemExit(f"{backend_name}: a chunk came back None")
            have = hashlib.blake2b(o.tensor.view(torch.uint8).numpy().tobytes(), digest_size=16)
            if have.digest() != d:
                raise SystemExit(f"{backend_name}: a chunk came back with other bytes")
    finally:
        for o in got:
            if o is not None:
                o.ref_count_down()
    return took


def run(args) -> dict[str, Any]:
    disk_dir = tempfile.mkdtemp(prefix="lmcache-bench-", dir=args.dir)
    manager, metadata = _manager(args, disk_dir)
    if KVTIER not in manager.storage_backends or LOCAL_DISK not in manager.storage_backends:
        raise SystemExit(f"LMCache built {list(manager.storage_backends)}: need {KVTIER} and {LOCAL_DISK}")
    nbytes = args.chunks * (args.chunk_mib << 20)
    rounds: list[dict[str, float]] = []
    cold = args.cold
    nonce = time.time_ns()
    try:
        for r in range(args.rounds):
            # batched_get writes what it read back into LMCache's CPU cache;
            # left there, two rounds fill it, and local_disk's put (which
            # allocates without evicting) then never stores its chunks.
            l1 = manager.storage_backends.get("LocalCPUBackend")
            if l1 is not None:
                l1.clear()
            order = [KVTIER, LOCAL_DISK] if r % 2 == 0 else [LOCAL_DISK, KVTIER]
            row: dict[str, float] = {}
            digests = {}
            keys = {b: _keys(r, b, args.chunks, nonce) for b in order}
            for b in order:
                objs, digests[b] = _fill(manager, metadata, args.chunks, seed=r * 2 + (b == KVTIER))
                row[f"{b}_put_s"] = _put(manager, b, keys[b], objs, disk_dir, args.deadline_s)
            if cold and not _drop_caches():
                cold = False
            for b in order:
                row[f"{b}_get_s"] = _get(manager, b, keys[b], digests[b])
            rounds.append(row)
            if not args.json:
                print(
                    f"round {r + 1}: put kvtier {nbytes / row[f'{KVTIER}_put_s'] / 1e9:.2f} GB/s, "
                    f"local_disk {nbytes / row[f'{LOCAL_DISK}_put_s'] / 1e9:.2f}; get kvtier "
                    f"{nbytes / row[f'{KVTIER}_get_s'] / 1e9:.2f}, local_disk "
                    f"{nbytes / row[f'{LOCAL_DISK}_get_s'] / 1e9:.2f}",
                    file=sys.stderr,
                )
    finally:
        try:
            manager.close()
        except Exception:
            pass
        shutil.rmtree(disk_dir, ignore_errors=True)

    def gbps(key: str) -> dict[str, float]:
        v = [nbytes / row[key] / 1e9 for row in rounds]
        return {"median": statistics.median(v), "min": min(v), "max": max(v)}

    out: dict[str, Any] = {
        "bench": "lmcache",
        "chunks": args.chunks,
        "chunk_bytes": args.chunk_mib << 20,
        "rounds": args.rounds,
        "cold": cold,
        "disk_dir": args.dir,
        "direct_read": args.direct_read,
    }
    for op in ("put", "get"):
        k, base = gbps(f"{KVTIER}_{op}_s"), gbps(f"{LOCAL_DISK}_{op}_s")
        out[f"{op}_gbps"] = k["median"]
        out[f"{op}_gbps_range"] = [k["min"], k["max"]]
        out[f"baseline_{op}_gbps"] = base["median"]
        out[f"baseline_{op}_gbps_range"] = [base["min"], base["max"]]
        out[f"{op}_gbps_vs_baseline"] = k["median"] / base["median"]
    out["baseline"] = "LMCache local_disk (LocalDiskBackend), same StorageManager, same filesystem"
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvtier.integrations.lmcache_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", default=os.environ.get("KVTIER_SOCKET"), help="kvtierd's socket (G3 on --dir's disk)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where local_disk writes (kvtierd's G3 disk)")
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="drop the page cache before the reads (needs root; the JSON says whether it was)")
    p.add_argument("--deadline-s", type=float, default=600.0)
    p.add_argument("--direct-read", action=argparse.BooleanOptionalAction, default=True,
                   help="kvtier_direct_read (the plugin's default): G3 reads over passed fds into "
                        "LMCache's buffers; --no-direct-read: through the shared region")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = p.parse_args(argv)
    if not args.socket:
        p.error("--socket (or $KVTIER_SOCKET) is required")
    if not 1 <= args.chunks <= 4096 or not 1 <= args.chunk_mib <= 256 or not 1 <= args.rounds <= 100:
        p.error("--chunks 1..=4096, --chunk-mib 1..=256, --rounds 1..=100")
    res = run(args)
    if args.json:
        print(json.dumps(res))
    else:
        for op in ("put", "get"):
            print(
                f"{op}: kvtier {res[f'{op}_gbps']:.2f} GB/s, local_disk {res[f'baseline_{op}_gbps']:.2f} GB/s "
                f"({res[f'{op}_gbps_vs_baseline']:.2f}x), medians of {res['rounds']} rounds, "
                f"{'cold' if res['cold'] else 'warm'} page cache"
            )


if __name__ == "__main__":
    main()
