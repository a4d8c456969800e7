"""Time to first token: KV onboarded from kvtier vs recomputing it, with a
randomly initialised transformers Llama (no weights, no network). Run by
gds/scripts/ttft-check.sh: on a GPU (`--device cuda`) into device memory,
or on CPU (`--device cpu`, how CI runs it) into host memory standing in for
HBM through the same kvtier-gds pipeline (KVTIER_PY_HOST_VIA_GDS=1).

For each prompt size (`--tokens 8192,32768,131072`, as far as memory
allows):
- recompute: one prefill of the whole N-token prompt, then the first token;
- kvtier: the KV of the prompt's whole blocks (the first
  floor((N-1)/B)*B tokens, B tokens per block; offloaded once, after a
  prefill) is onboarded from kvtierd into the destination, rearranged into
  the model's cache, and the remaining 1 to B tokens are prefilled on top
  of it, which gives the first token;
- baseline: a plain copy of the same bytes into the same destination, from
  pinned host memory on a GPU (the floor any loading path has), from host
  memory on CPU.
Before every onboard (and every baseline copy) the destination is filled
with NaN and the block files' pages are dropped from the page cache, both
outside the timed region; after it, every byte of the destination is
compared with the KV that was offloaded, and the first-token logits with
the recompute's. An onboard that lands nothing therefore fails (NaN KV,
NaN logits, and the byte comparison says how many blocks differ).

Prints one JSON line per size as it completes, then a summary line
{"check": "ttft", "ok": ..., "ran": [...], "failed": [...], "not_run": [...]}
last. Exits 0 only when every size either ran and passed or was not run
for memory (a GPU that cannot fit a size says so), and at least one ran.

    python ttft_check.py --kvtierd PATH --work DIR [--device cuda|cpu]
        [--tokens 8192,32768,131072] [--rounds 3] [--route any|two_hop|direct]
        [--model default|tiny] [--fault onboard-elsewhere]

--route: the route every onboarded block must report (two_hop: pinned
bounce buffers, ttft-check.sh sets KVTIER_GDS=off for it; direct:
GPUDirect Storage, cuFile's compatibility mode included, said in
`cufile_mode`). --fault onboard-elsewhere is the negative control: the
onboard runs for real but into a scratch buffer, so its results say hit
and nothing lands in the destination; the check must fail.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import socket
import statistics
import subprocess
import sys
import time


class CheckFailed(Exception):
    """A size ran and its result is wrong (bytes, logits, route, misses)."""


def log(msg: str) -> None:
    print(f"ttft: {msg}", file=sys.stderr, flush=True)


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvtierd", required=True)
    p.add_argument("--work", required=True, type=pathlib.Path)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokens", default="8192,32768,131072")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--route", choices=["any", "two_hop", "direct"], default="any")
    p.add_argument("--model", choices=["default", "tiny"], default=None)
    p.add_argument("--fault", choices=["onboard-elsewhere"], default=None)
    a = p.parse_args()
    a.sizes = [int(t) for t in a.tokens.split(",") if t.strip()]
    a.model = a.model or ("default" if a.device == "cuda" else "tiny")
    return a


# (layers, attention heads, kv heads, head_dim, intermediate, vocab, tokens per block)
MODELS = {
    # 16 layers, GQA 8x128, bf16: 64 KiB of KV per token, 4 MiB blocks of 64 tokens.
    "default": (16, 16, 8, 128, 5632, 32000, 64),
    # CI's CPU run: 2 layers, GQA 2x64: 1 KiB per token, 32 KiB blocks of 32 tokens.
    "tiny": (2, 4, 2, 64, 512, 1024, 32),
}


def cufile_mode() -> str:
    """Whether cuFile reads can be true GPUDirect (the nvidia-fs kernel
    module is loaded and compat mode not forced) or run in compatibility
    mode (cuFile's own bounce buffers; still the `direct` route to kvtier)."""
    nvfs = os.path.exists("/proc/driver/nvidia-fs")
    try:
        nvfs = nvfs or any(line.startswith("nvidia_fs ") for line in open("/proc/modules", errors="replace"))
    except OSError:
        pass
    cfg = os.environ.get("CUFILE_ENV_PATH_JSON", "/etc/cufile.json")
    forced = False
    try:
        forced = re.search(r'"force_compat_mode"\s*:\s*true', open(cfg).read()) is not None
    except OSError:
        pass
    if nvfs and not forced:
        return "nvidia-fs (true GPUDirect Storage)"
    why = f"force_compat_mode in {cfg}" if forced else "no nvidia-fs kernel module"
    return f"compat ({why}: cuFile reads through its own bounce buffers)"


def start_kvtierd(kvtierd: str, work: pathlib.Path) -> tuple[subprocess.Popen, str]:
    work.mkdir(parents=True, exist_ok=True)
    sock = str(work / "kvtierd.sock")
    proc = subprocess.Popen(
        [kvtierd, "--socket", sock, "--g3-dir", str(work / "g3"), "--g3-capacity", "24GiB",
         "--metrics-addr", "", "--g4", ""],
        env=dict(os.environ, RUST_LOG="warn"), stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            return proc, sock
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"kvtierd did not start (exit {proc.poll()})")
            time.sleep(0.05)


def drop_page_cache(g3: pathlib.Path) -> bool:
    """Drops the block files' pages (written back first), so an onboard
    reads the disk; False where the kernel refused."""
    ok = True
    for f in g3.rglob("*"):
        if not f.is_file():
            continue
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def layer_kv(cache, layer: int):
    """(K, V) of one layer of a transformers cache, across versions."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def main() -> int:
    a = parse()
    summary = {
        "check": "ttft", "ok": False, "device": a.device, "model": a.model, "route_expected": a.route,
        "kvtier_gds_env": os.environ.get("KVTIER_GDS", ""), "fault": a.fault,
        "ran": [], "failed": [], "not_run": [],
    }
    try:
        import torch
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    except Exception as e:  # a failure with its reason, never a skip
        summary["failed"].append({"tokens": None, "why": f"torch/transformers not importable: {e!r}"})
        emit(summary)
        return 1
    summary["torch"] = torch.__version__
    if a.device == "cuda" and not torch.cuda.is_available():
        summary["failed"].append({"tokens": None, "why": "torch.cuda.is_available() is False"})
        emit(summary)
        return 1
    if a.device == "cpu" and os.environ.get("KVTIER_PY_HOST_VIA_GDS") != "1":
        # Host tensors take kvtier-gds's pipeline only with this set.
        os.environ["KVTIER_PY_HOST_VIA_GDS"] = "1"
    if a.route == "direct":
        summary["cufile_mode"] = cufile_mode()
    import kvtier

    summary["kvtier"] = os.path.dirname(kvtier.__file__)
    try:
        proc, sock = start_kvtierd(a.kvtierd, a.work)
    except Exception as e:
        summary["failed"].append({"tokens": None, "why": str(e)})
        emit(summary)
        return 1
    try:
        run_all(a, torch, DynamicCache, LlamaConfig, LlamaForCausalLM, kvtier, sock, summary)
    finally:
        proc.kill()
        proc.wait()
    summary["ok"] = not summary["failed"] and bool(summary["ran"])
    emit(summary)
    return 0 if summary["ok"] else 1


def run_all(a, torch, DynamicCache, LlamaConfig, LlamaForCausalLM, kvtier, sock, summary) -> None:
    dev = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    layers, heads, kv_heads, head_dim, inter, vocab, tpb = MODELS[a.model]
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max(4096, max(a.sizes) + 16),
        attn_implementation="sdpa",
    )
    t = time.perf_counter()
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    summary["model_desc"] = f"llama random {layers}L h{heads * head_dim} kv{kv_heads}x{head_dim} bf16, {tpb} tokens per block"
    log(f"model built in {time.perf_counter() - t:.1f}s on {dev}")
    client = kvtier.Client(socket=sock, timeout_ms=120_000)
    shape = dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, tpb=tpb)
    for n in sorted(a.sizes):
        if dev.type == "cuda":
            kv = ((n - 1) // tpb) * tpb * layers * 2 * kv_heads * head_dim * 2
            free = torch.cuda.mem_get_info(dev)[0]
            # staging, the prefill's cache, the rebuilt cache, the
            # recompute's cache, and room for activations.
            need = 4 * kv + (2 << 30)
            if need > free:
                why = f"needs about {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB free"
                summary["not_run"].append({"tokens": n, "why": why})
                log(f"{n} tokens not run: {why}")
                continue
        try:
            r = one_size(a, torch, DynamicCache, model, kvtier, client, dev, n, shape)
        except CheckFailed as e:
            summary["failed"].append({"tokens": n, "why": str(e)})
            emit({"tokens": n, "ok": False, "why": str(e)})
            log(f"{n} tokens FAILED: {e}")
        except getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError) as e:
            why = f"out of memory: {str(e).splitlines()[0]}"
            summary["not_run"].append({"tokens": n, "why": why})
            log(f"{n} tokens not run: {why}")
        else:
            summary["ran"].append(n)
            emit(r)
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def one_size(a, torch, DynamicCache, model, kvtier, client, dev, n, shape) -> dict:
    layers, kv_heads, head_dim, tpb = shape["layers"], shape["kv_heads"], shape["head_dim"], shape["tpb"]
    n_blocks = (n - 1) // tpb
    if n_blocks < 1:
        raise CheckFailed(f"{n} tokens is less than one block of {tpb} and a token")
    n_cached = n_blocks * tpb
    # The whole prompt; the tokens past the last whole block (1 to tpb) are
    # prefilled on top of the onboarded KV, as an engine does.
    n_prompt = n
    g = torch.Generator(device="cpu").manual_seed(n)
    ids = torch.randint(0, model.config.vocab_size, (1, n_prompt), generator=g).to(dev)
    ns = kvtier.Namespace(f"ttft-check/{a.model}", kvtier.Layout(layers, kv_heads, head_dim, "bf16", tpb),
                          tenant_salt=os.urandom(8))
    keys = ns.hash_chain(ids[0, :n_cached].tolist())
    assert len(keys) == n_blocks
    # Block layout: [layer][K|V][kv_head][token][head_dim], bf16.
    staging = torch.empty((n_blocks, layers, 2, kv_heads, tpb, head_dim), dtype=torch.bfloat16, device=dev)
    block_bytes = ns.block_bytes
    if staging[0].numel() * 2 != block_bytes:
        raise CheckFailed(f"staging block {staging[0].numel() * 2} B != namespace block {block_bytes} B")
    cuda = dev.type == "cuda"

    def bufs_of(t):
        if cuda:
            return [(t[b].data_ptr(), block_bytes, f"cuda:{dev.index or 0}") for b in range(n_blocks)]
        return [(t[b].data_ptr(), block_bytes) for b in range(n_blocks)]

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    g3 = a.work / "g3"
    with torch.inference_mode():
        t = time.perf_counter()
        out = model(ids[:, :n_cached], use_cache=True, logits_to_keep=1)
        for l in range(layers):
            k, v = layer_kv(out.past_key_values, l)
            staging[:, l, 0] = k[0].reshape(kv_heads, n_blocks, tpb, head_dim).permute(1, 0, 2, 3)
            staging[:, l, 1] = v[0].reshape(kv_heads, n_blocks, tpb, head_dim).permute(1, 0, 2, 3)
        del out
        sync()
        # The reference: the KV as offloaded, in host memory (pinned on a
        # GPU: the baseline copies from it).
        ref = torch.empty(staging.shape, dtype=torch.bfloat16, pin_memory=cuda)
        ref.copy_(staging)
        if torch.isnan(ref).any():
            raise CheckFailed("the prefill's KV holds NaN: the NaN fill could not tell a missed onboard")
        bufs = bufs_of(staging)
        res = client.offload(ns, keys, bufs)
        stored = sum(1 for r in res if r.status in ("stored", "stored_unpinned", "already_present"))
        if stored != n_blocks:
            raise CheckFailed(f"offload stored {stored}/{n_blocks}: {[r.detail for r in res if not r.ok][:3]}")
        log(f"{n_prompt} tokens: prefill + offload of {n_blocks} blocks in {time.perf_counter() - t:.1f}s")
        # The negative control's onboard lands in a scratch buffer.
        scratch = torch.empty_like(staging) if a.fault == "onboard-elsewhere" else None
        onboard_bufs = bufs_of(scratch) if scratch is not None else bufs
        chunk = max(1, (256 << 20) // block_bytes)

        def clear():
            staging.fill_(float("nan"))
            sync()

        def differing_blocks() -> int:
            bad = 0
            for i in range(0, n_blocks, chunk):
                j = min(n_blocks, i + chunk)
                want = ref[i:j].to(dev, non_blocking=True) if cuda else ref[i:j]
                bad += int((staging[i:j].view(torch.int16) != want.view(torch.int16)).flatten(1).any(1).sum())
            return bad

        routes: set = set()
        fallbacks: set = set()
        cache_dropped = []

        def recompute():
            sync()
            t0 = time.perf_counter()
            logits = model(ids, use_cache=True, logits_to_keep=1).logits[0, -1].float()
            sync()
            return time.perf_counter() - t0, logits

        def from_kvtier():
            clear()
            cache_dropped.append(drop_page_cache(g3))
            t0 = time.perf_counter()
            got = client.onboard_into(ns, keys, onboard_bufs)
            t1 = time.perf_counter()
            missed = [(i, r.reason, r.detail) for i, r in enumerate(got) if not r.ok]
            if missed:
                raise CheckFailed(f"onboard missed {len(missed)}/{n_blocks} blocks: {missed[:3]}")
            routes.update(r.route for r in got)
            fallbacks.update(r.detail for r in got if r.detail)
            cache = DynamicCache()
            for l in range(layers):
                k = staging[:, l, 0].permute(1, 0, 2, 3).reshape(1, kv_heads, n_cached, head_dim)
                v = staging[:, l, 1].permute(1, 0, 2, 3).reshape(1, kv_heads, n_cached, head_dim)
                cache.update(k.contiguous(), v.contiguous(), l)
            pos = torch.arange(n_cached, n_prompt, device=dev)
            logits = model(ids[:, n_cached:], past_key_values=cache, position_ids=pos[None],
                           cache_position=pos, use_cache=True, logits_to_keep=1).logits[0, -1].float()
            sync()
            t2 = time.perf_counter()
            del cache
            bad = differing_blocks()
            if bad:
                raise CheckFailed(f"the destination after onboard differs from the offloaded KV in {bad}/{n_blocks} "
                                  "blocks (it was NaN-filled before the onboard: the onboard did not land them)")
            return t2 - t0, t1 - t0, logits

        def baseline():
            clear()
            t0 = time.perf_counter()
            staging.copy_(ref, non_blocking=cuda)
            sync()
            dt = time.perf_counter() - t0
            if differing_blocks():
                raise CheckFailed("the baseline copy did not land the reference bytes")
            return dt

        def agree(ref_logits, got_logits) -> tuple[float, bool]:
            if not torch.isfinite(got_logits).all():
                raise CheckFailed("first-token logits after the kvtier onboard are not finite")
            cos = torch.nn.functional.cosine_similarity(ref_logits, got_logits, dim=0).item()
            if not cos >= 0.98:
                raise CheckFailed(f"first-token logits after the kvtier onboard disagree with recompute: cosine {cos:.4f}")
            return cos, int(ref_logits.argmax()) == int(got_logits.argmax())

        agree(recompute()[1], from_kvtier()[2])  # warm up, checked too
        baseline()
        rec, kvt, onb, cpy, coss, same = [], [], [], [], [], []
        for _ in range(a.rounds):
            tr, ref_logits = recompute()
            tk, to, got_logits = from_kvtier()
            cos, st = agree(ref_logits, got_logits)
            rec.append(tr); kvt.append(tk); onb.append(to); coss.append(cos); same.append(st)
            cpy.append(baseline())
        bad_routes = {r for r in routes if r not in {"two_hop", "direct"}}
        if bad_routes or not routes:
            raise CheckFailed(f"onboard did not take kvtier-gds's pipeline: routes {sorted(map(str, routes))}")
        if a.route != "any" and routes != {a.route}:
            raise CheckFailed(f"expected every block on route {a.route}, got {sorted(routes)}; "
                              f"fallbacks: {sorted(fallbacks)[:3]}")

    total = n_blocks * block_bytes
    r, k, o, c = (statistics.median(x) for x in (rec, kvt, onb, cpy))
    return {
        "tokens": n_prompt, "tokens_onboarded": n_cached, "ok": True, "device": str(dev),
        "kv_bytes": total, "blocks": n_blocks, "block_bytes": block_bytes, "rounds": a.rounds,
        "ttft_recompute_ms": round(r * 1e3, 3),
        "ttft_kvtier_ms": round(k * 1e3, 3),
        "speedup_vs_recompute": round(r / k, 3),
        "onboard_ms": round(o * 1e3, 3),
        "onboard_gbps": round(total / o / 1e9, 3),
        "baseline": "pinned_h2d" if cuda else "host_copy",
        "baseline_ms": round(c * 1e3, 3),
        "baseline_gbps": round(total / c / 1e9, 3),
        "onboard_vs_baseline": round(c / o, 3),
        "onboard_routes": sorted(routes),
        "fallbacks": sorted(fallbacks)[:3],
        "bytes_verified": f"every onboard: destination NaN-filled before, all {total} bytes compared after",
        "page_cache_dropped": all(cache_dropped),
        "logits_cosine_min": round(min(coss), 5),
        "same_first_token": all(same),
        "ttft_recompute_ms_rounds": [round(x * 1e3, 3) for x in rec],
        "ttft_kvtier_ms_rounds": [round(x * 1e3, 3) for x in kvt],
    }


if __name__ == "__main__":
    sys.exit(main())
