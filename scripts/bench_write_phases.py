#!/usr/bin/env python3
"""Phase breakdown of one durable block write on this filesystem (issue #17).

Times, per block, each step G3's offload pays, beside the raw baseline that
`kvtier bench io` measures ("raw durable writes": O_DIRECT pwrites of every
block into ONE preallocated file, `depth` in flight, ONE fdatasync at the
end), for several ways of making a block file durable:

  raw        bench io's baseline (tools/src/bench/common.rs RawFile::write_all)
  fresh      G3 today: create a temp file (O_DIRECT), write, fdatasync
             (O_DSYNC for files of one chunk or less), rename into a shard
             directory, then one fsync per shard directory per group
  fresh_late fresh files, but no per-file flush: write all files of a
             group, rename them, then fdatasync every file at once (in
             parallel threads) and fsync the directories once
  recycled   files that already exist at full size with written extents
             (an evicted block's file): open, overwrite in place, fdatasync,
             rename into place, directory fsync per group
  recycled_ack  what G3's recycled write waits for before its ack
             (daemon/src/tiers/g3/recycle.rs): open an existing file, overwrite
             (O_DSYNC at <= 1 MiB, else fdatasync), rename; no directory
             fsync
  recycled_ack_fdatasync  recycled_ack with fdatasync instead of O_DSYNC at
             every size (is O_DSYNC still the cheaper flush for one-chunk
             files once they are overwrites in place?)

Usage: scripts/bench_write_phases.py DIR [--size 2MiB] [--blocks 64]
       [--threads 8] [--group 8] [--rounds 3] [--modes raw,recycled_ack,...]
Prints one JSON line per (mode, round) and a summary of medians.
"""

import argparse
import json
import mmap
import os
import statistics
import threading
import time

CHUNK = 1 << 20
PARALLEL_DIRS = False


def parse_size(s):
    s = s.strip()
    for suf, m in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * m)
    return int(s)


def aligned(n):
    m = mmap.mmap(-1, n)
    m.write(os.urandom(4096) * (n // 4096))
    return m


class Phases:
    def __init__(self):
        self.lock = threading.Lock()
        self.t = {}

    def add(self, name, secs):
        with self.lock:
            self.t.setdefault(name, []).append(secs * 1e6)


def write_chunks(fd, buf, n, dsync_each=False):
    off = 0
    while off < n:
        k = min(CHUNK, n - off)
        os.pwrite(fd, memoryview(buf)[:k], off)
        off += k


def run_parallel(jobs, threads, fn):
    it = iter(range(len(jobs)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            fn(jobs[i])

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def mode_raw(d, size, blocks, threads, group, buf, ph, rnd):
    path = os.path.join(d, "raw.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)

    def one(i):
        t = time.perf_counter()
        write_chunks_at(fd, buf, size, i * size)
        ph.add("write", time.perf_counter() - t)

    t0 = time.perf_counter()
    run_parallel(list(range(blocks)), threads, one)
    t = time.perf_counter()
    os.fdatasync(fd)
    ph.add("final_fdatasync", time.perf_counter() - t)
    el = time.perf_counter() - t0
    os.close(fd)
    return el


def write_chunks_at(fd, buf, n, base):
    off = 0
    while off < n:
        k = min(CHUNK, n - off)
        os.pwrite(fd, memoryview(buf)[:k], base + off)
        off += k


def shard_of(i):
    return "%02x" % (i % 8)


def mode_fresh(d, size, blocks, threads, group, buf, ph, rnd, late=False, recycled=False,
               nodir=False, fdatasync_always=False):
    tmp = os.path.join(d, "tmp")
    free = os.path.join(d, "free")
    bl = os.path.join(d, "blocks-%d-%s" % (rnd, "r" if recycled else ("l" if late else "f")))
    os.makedirs(tmp, exist_ok=True)
    os.makedirs(bl, exist_ok=True)
    for s in range(8):
        os.makedirs(os.path.join(bl, shard_of(s)), exist_ok=True)
    dfd = os.open(bl, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    if recycled:
        # Untimed: files of full size with written extents (evicted files).
        os.makedirs(free, exist_ok=True)
        for i in range(blocks):
            p = os.path.join(free, "%d-%d" % (rnd, i))
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
            write_chunks(fd, buf, size)
            os.close(fd)
        os.sync()
    dsync = (size <= CHUNK and not late and (not recycled or nodir)
             and not fdatasync_always)
    groups = [list(range(g, min(g + group, blocks))) for g in range(0, blocks, group)]
    commit_lock = threading.Lock()

    def one_group(g):
        fds = []
        fl_lock = threading.Lock()

        def one_file(i):
            src = os.path.join(free if recycled else tmp, "%d-%d" % (rnd, i))
            t = time.perf_counter()
            if recycled:
                fl = os.O_WRONLY | os.O_DIRECT
                if dsync:
                    fl |= os.O_DSYNC
                fd = os.open(src, fl)
                ph.add("open_existing", time.perf_counter() - t)
            else:
                fl = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT
                if dsync:
                    fl |= os.O_DSYNC
                fd = os.open(src, fl)
                ph.add("create", time.perf_counter() - t)
            t = time.perf_counter()
            write_chunks(fd, buf, size)
            ph.add("write_o_dsync" if dsync else "write", time.perf_counter() - t)
            if not late and not dsync:
                t = time.perf_counter()
                os.fdatasync(fd)
                ph.add("fdatasync", time.perf_counter() - t)
            if late:
                with fl_lock:
                    fds.append(fd)
            else:
                os.close(fd)
            t = time.perf_counter()
            os.rename(src, os.path.join(bl, shard_of(i), "b%d" % i))
            ph.add("rename", time.perf_counter() - t)

        # The files of one request in parallel (G3: up to io_depth threads).
        run_parallel(g, len(g), one_file)
        if late:
            t = time.perf_counter()
            # fdatasync of every file of the group, in parallel.
            ts = [threading.Thread(target=os.fdatasync, args=(fd,)) for fd in fds]
            for x in ts:
                x.start()
            for x in ts:
                x.join()
            ph.add("fdatasync_group_parallel", time.perf_counter() - t)
            for fd in fds:
                os.close(fd)
        if nodir:
            return
        with commit_lock:
            t = time.perf_counter()
            dirs = [os.path.join(bl, s) for s in sorted({shard_of(i) for i in g})]
            if recycled:
                dirs.append(free)

            def fsync_dir(p):
                dfd = os.open(p, os.O_RDONLY)
                os.fsync(dfd)
                os.close(dfd)
            if PARALLEL_DIRS:
                # Every directory still gets its own fsync; issued at once,
                # a journaling filesystem commits them together.
                ts = [threading.Thread(target=fsync_dir, args=(p,)) for p in dirs]
                for x in ts:
                    x.start()
                for x in ts:
                    x.join()
            else:
                for p in dirs:
                    fsync_dir(p)
            ph.add("dir_fsyncs_per_group", time.perf_counter() - t)

    t0 = time.perf_counter()
    # `threads` concurrent requests (bench io: --clients).
    run_parallel(groups, threads, one_group)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--size", default="2MiB")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--threads", type=int, default=4, help="concurrent requests (clients); raw uses threads*group writers")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parallel-dirs", action="store_true",
                    help="fsync a group's directories at once instead of one after another")
    ap.add_argument("--modes", default="raw,fresh,fresh_late,recycled,recycled_ack",
                    help="comma-separated; raw is always run (the ratios' baseline)")
    a = ap.parse_args()
    global PARALLEL_DIRS
    PARALLEL_DIRS = a.parallel_dirs
    size = (parse_size(a.size) + 4096 + 4095) // 4096 * 4096  # header + payload
    buf = aligned(min(size, CHUNK) if size >= 4096 else 4096)
    work = os.path.join(a.dir, "wphases-%d" % os.getpid())
    os.makedirs(work)
    summary = {}
    for rnd in range(a.rounds):
        modes = ["raw"] + [m for m in a.modes.split(",") if m and m != "raw"]
        for mode in modes:
            ph = Phases()
            if mode == "raw":
                el = mode_raw(work, size, a.blocks, a.threads * a.group, a.group, buf, ph, rnd)
            else:
                el = mode_fresh(work, size, a.blocks, a.threads, a.group, buf, ph, rnd,
                                late=(mode == "fresh_late"),
                                recycled=mode.startswith("recycled"),
                                nodir=mode.startswith("recycled_ack"),
                                fdatasync_always=(mode == "recycled_ack_fdatasync"))
            gbps = size * a.blocks / el / 1e9
            rec = {"mode": mode, "round": rnd, "file_bytes": size, "blocks": a.blocks,
                   "threads": a.threads, "group": a.group, "gbps": round(gbps, 3),
                   "phases_p50_us": {k: round(statistics.median(v), 1) for k, v in ph.t.items()}}
            print(json.dumps(rec), flush=True)
            summary.setdefault(mode, []).append(rec)
    print("summary (median of rounds):")
    raw = statistics.median(r["gbps"] for r in summary["raw"])
    for mode, rs in summary.items():
        g = statistics.median(r["gbps"] for r in rs)
        ph = {}
        for r in rs:
            for k, v in r["phases_p50_us"].items():
                ph.setdefault(k, []).append(v)
        print(json.dumps({"mode": mode, "gbps": round(g, 3), "vs_raw": round(g / raw, 2),
                          "gbps_rounds": [r["gbps"] for r in rs],
                          "phases_p50_us": {k: statistics.median(v) for k, v in ph.items()}}))
    os.system("rm -rf '%s'" % work)


if __name__ == "__main__":
    main()
