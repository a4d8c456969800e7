"""Time to first token: KV onboarded from kvtier into GPU memory vs
recomputing it (a randomly initialised transformers Llama; no weights, no
network). Run by gds/scripts/ttft-check.sh on a GPU machine; prints one
JSON line.

Recompute: one prefill of the whole N-token prompt, then the first token.
kvtier: the KV of the first N-1 tokens (offloaded once, after a prefill)
is onboarded from kvtierd into device memory, rearranged into the model's
cache, and one decode step of the last prompt token gives the first token.
The same run also times a plain pinned host -> device copy of the same
bytes (the floor any loading path has) and checks both paths' first-token
logits agree.

    python ttft_check.py KVTIERD WORKDIR [PROMPT_TOKENS] [ROUNDS]
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time


def main() -> int:
    kvtierd, work = sys.argv[1], pathlib.Path(sys.argv[2])
    prompt_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    try:
        import torch
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    except Exception as e:  # reported, not raised: the caller notes a skip
        print(json.dumps({"skip": f"torch/transformers unavailable: {e}"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"skip": "no CUDA device"}))
        return 0
    import kvtier

    work.mkdir(parents=True, exist_ok=True)
    sock = str(work / "kvtierd.sock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [kvtierd, "--socket", sock, "--g3-dir", str(work / "g3"), "--g3-capacity", "64GiB",
         "--metrics-addr", f"127.0.0.1:{port}", "--g4", ""],
        env=dict(os.environ, RUST_LOG="warn"), stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                print(json.dumps({"error": "kvtierd did not start"}))
                return 1
            time.sleep(0.05)
        time.sleep(0.2)
        return run(torch, DynamicCache, LlamaConfig, LlamaForCausalLM, kvtier, sock, prompt_tokens, rounds)
    finally:
        proc.kill()
        proc.wait()


def layer_kv(cache, layer: int):
    """(K, V) of one layer of a transformers cache, across versions."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def run(torch, DynamicCache, LlamaConfig, LlamaForCausalLM, kvtier, sock, n_prompt, rounds) -> int:
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    layers, heads, kv_heads, head_dim = 16, 16, 8, 128
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=heads * head_dim, intermediate_size=5632,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max(4096, n_prompt + 16),
    )
    model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    tpb = 64  # tokens per kvtier block: 16 layers x K,V x 8 heads x 64 x 128 x 2 B = 4 MiB
    n_blocks = (n_prompt - 1) // tpb
    n_cached = n_blocks * tpb
    n_prompt = n_cached + 1
    ids = torch.randint(0, cfg.vocab_size, (1, n_prompt), device=dev)
    ns = kvtier.Namespace("ttft-check/llama-random", kvtier.Layout(layers, kv_heads, head_dim, "bf16", tpb))
    keys = ns.hash_chain(ids[0, :n_cached].tolist())
    assert len(keys) == n_blocks
    client = kvtier.Client(socket=sock, timeout_ms=30000)
    # Block layout: [layer][K|V][kv_head][token][head_dim], bf16.
    staging = torch.empty((n_blocks, layers, 2, kv_heads, tpb, head_dim), dtype=torch.bfloat16, device=dev)
    assert staging[0].numel() * 2 == ns.block_bytes, (staging[0].numel() * 2, ns.block_bytes)
    block_bytes = ns.block_bytes

    def sync():
        torch.cuda.synchronize(dev)

    with torch.inference_mode():
        # Warm up kernels, then offload the KV of the first n_cached tokens.
        out = model(ids[:, :n_cached], use_cache=True)
        for l in range(layers):
            k, v = layer_kv(out.past_key_values, l)
            staging[:, l, 0] = k[0].reshape(kv_heads, n_blocks, tpb, head_dim).permute(1, 0, 2, 3)
            staging[:, l, 1] = v[0].reshape(kv_heads, n_blocks, tpb, head_dim).permute(1, 0, 2, 3)
        sync()
        bufs = [(staging[b].data_ptr(), block_bytes, "cuda:0") for b in range(n_blocks)]
        res = client.offload(ns, keys, bufs)
        stored = sum(1 for r in res if r.status in ("stored", "already_present"))
        if stored != n_blocks:
            print(json.dumps({"error": f"offload stored {stored}/{n_blocks}", "detail": [r.detail for r in res if not r.ok][:3]}))
            return 1
        del out

        def recompute():
            sync(); t0 = time.perf_counter()
            logits = model(ids, use_cache=True).logits[0, -1].float()
            sync()
            return time.perf_counter() - t0, logits

        def from_kvtier():
            sync(); t0 = time.perf_counter()
            got = client.onboard_into(ns, keys, bufs)
            if not all(r.ok for r in got):
                raise RuntimeError(f"onboard missed: {[r.reason for r in got if not r.ok][:3]}")
            # Device buffers take kvtier-gds's pipeline; its route is the record.
            routes.update(r.route for r in got)
            t1 = time.perf_counter()
            cache = DynamicCache()
            for l in range(layers):
                k = staging[:, l, 0].permute(1, 0, 2, 3).reshape(1, kv_heads, n_cached, head_dim)
                v = staging[:, l, 1].permute(1, 0, 2, 3).reshape(1, kv_heads, n_cached, head_dim)
                cache.update(k.contiguous(), v.contiguous(), l)
            pos = torch.tensor([[n_cached]], device=dev)
            logits = model(ids[:, n_cached:], past_key_values=cache, position_ids=pos,
                           cache_position=pos[0], use_cache=True).logits[0, -1].float()
            sync()
            return time.perf_counter() - t0, t1 - t0, logits

        host = torch.empty(staging.shape, dtype=torch.bfloat16).pin_memory()
        host.copy_(staging)

        def h2d():
            sync(); t0 = time.perf_counter()
            staging.copy_(host, non_blocking=True)
            sync()
            return time.perf_counter() - t0

        routes = set()
        recompute(); from_kvtier(); h2d()  # warm up
        rec, kvt, onb, cpy = [], [], [], []
        for _ in range(rounds):
            t, ref = recompute(); rec.append(t)
            t, o, got = from_kvtier(); kvt.append(t); onb.append(o)
            cpy.append(h2d())
        cos = torch.nn.functional.cosine_similarity(ref, got, dim=0).item()
        same_top = int(ref.argmax()) == int(got.argmax())

    total = n_blocks * block_bytes
    r, k, o, c = (statistics.median(x) for x in (rec, kvt, onb, cpy))
    print(json.dumps({
        "model": f"llama random {layers}L h{heads * head_dim} kv{kv_heads}x{head_dim} bf16",
        "prompt_tokens": n_prompt, "kv_bytes": total, "blocks": n_blocks, "block_bytes": block_bytes,
        "rounds": rounds,
        "ttft_recompute_ms": round(r * 1e3, 2),
        "ttft_kvtier_ms": round(k * 1e3, 2),
        "onboard_ms": round(o * 1e3, 2),
        "onboard_gbps": round(total / o / 1e9, 2),
        "pinned_h2d_ms": round(c * 1e3, 2),
        "pinned_h2d_gbps": round(total / c / 1e9, 2),
        "speedup_vs_recompute": round(r / k, 2),
        "logits_cosine": round(cos, 4), "same_first_token": same_top,
        "onboard_routes": sorted(routes),
    }))
    return 0 if cos > 0.98 and routes <= {"two_hop", "direct"} else 1


if __name__ == "__main__":
    sys.exit(main())
