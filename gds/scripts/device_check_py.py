"""Python round trip into CUDA device memory (run by device-check.sh):
kvtier.Client.onboard_into / offload with torch device tensors against a
real kvtierd through kvtier-gds's pipeline (the route each result reports:
two_hop or direct), verified byte for byte, a block corrupted on disk
refused on that path, and the onboard throughput into device memory beside
a plain pinned host-to-device copy of the same bytes (the PCIe baseline).
Prints one JSON document.

DEVICE cpu (CI): torch CPU tensors take the same pipeline with
KVTIER_PY_HOST_VIA_GDS=1 (host memory standing in for HBM), and the
baseline is a plain host copy. DEVICE cuda without torch's CUDA is an
error, never a skip.

usage: python device_check_py.py KVTIERD WORKDIR [BLOCKS] [BLOCK_BYTES] [DEVICE]
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import kvtier


def block_at(g3: pathlib.Path, key_hex: str):
    """(path, offset) of a block's bytes on G3's disk: its file under
    blocks/, or its slot in slots/<pages>.slab (the slot's header names
    it; docs/FORMAT.md, "G3 slabs"); None when neither holds it."""
    files = list(g3.glob(f"blocks/*/*/{key_hex}"))
    if files:
        return files[0], 0
    for slab in g3.glob("slots/*.slab"):
        slot_bytes = int(slab.name[: -len(".slab")]) * 4096
        with open(slab, "rb") as f:
            for off in range(0, slab.stat().st_size - slot_bytes + 1, slot_bytes):
                f.seek(off)
                head = f.read(4096)
                if head[:8] == b"KVTIERB\x01" and head[56 : 56 + head[48]].hex() == key_hex:
                    return slab, off
    return None


def start(kvtierd, d):
    sock = os.path.join(d, "kvtierd.sock")
    p = subprocess.Popen([kvtierd, "--socket", sock, "--g3-dir", os.path.join(d, "g3"), "--g3-capacity", "8GiB",
                          "--metrics-addr", "", "--g4", ""], stdout=subprocess.DEVNULL)
    for _ in range(1000):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            return p, sock
        except OSError:
            time.sleep(0.02)
    raise SystemExit("kvtierd did not start")


def main():
    kvtierd, work = sys.argv[1], sys.argv[2]
    blocks = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    bb = int(sys.argv[4]) if len(sys.argv) > 4 else 2 << 20
    device = sys.argv[5] if len(sys.argv) > 5 else "cuda"
    import torch as m

    if device == "cuda" and not m.cuda.is_available():
        raise SystemExit(f"torch {m.__version__}: torch.cuda.is_available() is False")
    if device == "cpu":
        os.environ["KVTIER_PY_HOST_VIA_GDS"] = "1"
    os.makedirs(work, exist_ok=True)
    proc, sock = start(kvtierd, work)
    try:
        ns = kvtier.Namespace("device-check/python", kvtier.Layout.with_block_bytes(bb), tenant_salt=os.urandom(8))
        c = kvtier.Client(socket=sock, timeout_ms=30_000)
        keys = ns.hash_chain(list(range(16 * blocks)))
        host = [os.urandom(bb) for _ in range(blocks)]
        assert all(c.offload(ns, keys, host)), "offload from host"

        dev = [m.empty(bb, dtype=m.uint8, device=device) for _ in range(blocks)]
        sync = m.cuda.synchronize if device == "cuda" else (lambda: None)
        to_bytes = lambda t: t.cpu().numpy().tobytes()  # noqa: E731
        pinned = m.empty(bb, dtype=m.uint8, pin_memory=device == "cuda")

        def pinned_copy(dst):
            dst.copy_(pinned, non_blocking=False)

        # Round trip 1: host -> kvtier -> device, byte for byte, through
        # kvtier-gds's pipeline (the result's route says which way).
        res = c.onboard_into(ns, keys, dev)
        sync()
        assert all(res), res[:3]
        assert all(to_bytes(d) == h for d, h in zip(dev, host)), "device bytes differ"
        routes = sorted({r.route for r in res})
        assert set(routes) <= {"two_hop", "direct"}, f"device onboard did not take the gds pipeline: {routes}"
        fallbacks = sorted({r.detail for r in res if r.detail})[:3]
        # Round trip 2: device -> kvtier -> host, with a segmented block.
        ns2 = kvtier.Namespace("device-check/python2", ns.layout, tenant_salt=os.urandom(8))
        k2 = ns2.hash_chain(list(range(16 * 2)))
        assert all(c.offload(ns2, k2, [dev[0], [dev[1][: bb // 2], dev[1][bb // 2 :]]])), "offload from device"
        back = [bytearray(bb), bytearray(bb)]
        assert all(c.onboard_into(ns2, k2, back))
        assert bytes(back[0]) == host[0] and bytes(back[1]) == host[1], "device offload bytes differ"

        # Throughput: onboard into device memory vs a plain pinned H2D copy.
        rounds_on, rounds_base = [], []
        for _ in range(3):
            t = time.perf_counter()
            for i in range(0, blocks, 8):
                assert all(c.onboard_into(ns, keys[i : i + 8], dev[i : i + 8]))
            sync()
            rounds_on.append(blocks * bb / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            for d in dev:
                pinned_copy(d)
            sync()
            rounds_base.append(blocks * bb / (time.perf_counter() - t) / 1e9)
        # A block corrupted on disk is a corrupt miss on the device path
        # too (every byte verified), and the others still land.
        at = block_at(pathlib.Path(work, "g3"), keys[1].hex())
        assert at is not None, "block 1 not found on G3's disk"
        with open(at[0], "r+b") as f:
            f.seek(at[1] + 4096 + bb // 2)
            b = f.read(1)
            f.seek(at[1] + 4096 + bb // 2)
            f.write(bytes([b[0] ^ 0xFF]))
        res = c.onboard_into(ns, keys[:3], dev[:3])
        sync()
        assert [r.ok for r in res] == [True, False, True] and res[1].reason == "corrupt", res
        corrupt_miss = "ok"

        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        print(json.dumps({
            "library": "torch",
            "device": device,
            "blocks": blocks,
            "block_bytes": bb,
            "roundtrip_device": "ok",
            "python_device_routes": routes,
            "python_device_fallbacks": fallbacks,
            "corrupt_block_on_device_path": corrupt_miss,
            "python_device_onboard_gbps": med(rounds_on),
            "baseline": "pinned_h2d" if device == "cuda" else "host_copy",
            "pinned_h2d_gbps": med(rounds_base),
            "python_device_onboard_gbps_vs_baseline": med(rounds_on) / med(rounds_base),
            "python_device_onboard_gbps_rounds": rounds_on,
            "pinned_h2d_gbps_rounds": rounds_base,
        }))
        return 0
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
