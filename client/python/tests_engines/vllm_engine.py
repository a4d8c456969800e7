"""vLLM 0.33.0's own engine core loop on CPU, without a model: the real
Scheduler (with its KV cache manager and the scheduler-side connector)
and the real worker-side connector, driven step by step as vLLM's engine
core and GPU model runner drive them (schedule -> handle_preemptions ->
bind metadata -> start_load_kv -> "forward" -> wait_for_save ->
get_transfer_results / get_block_ids_with_load_errors ->
build_connector_worker_meta -> update_from_output). The model is a tiny
local Llama config with ``load_format="dummy"`` (nothing fetched); the
"forward" writes each scheduled token's KV as a function of the prompt
prefix, so a loaded block is checkable against a recomputed one."""

from __future__ import annotations

import json
import pathlib
import time

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
NUM_BLOCKS = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_HEADS, HEAD_SIZE = 1, 32
EOS = 2

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_SIZE, "num_hidden_layers": len(LAYERS), "vocab_size": 1024,
    "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": EOS,
}

# A tiny DeepSeek-V2 config: vLLM's MLA (one latent vector per token,
# the same on every tensor-parallel rank).
KV_LORA_RANK, ROPE_DIM = 24, 8
MLA_HEAD = KV_LORA_RANK + ROPE_DIM
TINY_DEEPSEEK = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 8,
    "num_key_value_heads": 8, "num_hidden_layers": len(LAYERS), "vocab_size": 1024,
    "kv_lora_rank": KV_LORA_RANK, "qk_rope_head_dim": ROPE_DIM,
    "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "first_k_dense_replace": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": EOS,
}

_hash_ready = False


def model_dir(tmp: pathlib.Path, tp: int = 1, mla: bool = False) -> str:
    if mla:
        d = tmp / "tiny-deepseek"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(TINY_DEEPSEEK))
        return str(d)
    # vLLM checks that the attention heads split over the TP ranks; the KV
    # cache this engine registers is its own (KV_HEADS per rank).
    d = tmp / f"tiny-llama-tp{tp}"
    d.mkdir(exist_ok=True)
    heads = max(TINY_LLAMA["num_attention_heads"], tp)
    (d / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_attention_heads": heads}))
    return str(d)


class Engine:
    """One vLLM engine (scheduler + one worker) with a KV connector. With
    ``tp`` > 1 the scheduler plans for that many tensor-parallel ranks and
    the worker here is rank 0 (the other ranks' workers are not run).
    ``num_blocks`` sizes the "GPU" KV cache, ``max_model_len`` the longest
    prompt; ``workers=False`` builds the scheduler alone (for measuring
    it: no step can finish a transfer then)."""

    def __init__(self, tmp: pathlib.Path, socket: str, connector: str = "KvtierConnector",
                 policy: str = "recompute", tp: int = 1, num_blocks: int = NUM_BLOCKS,
                 max_model_len: int = 2048, workers: bool = True, mla: bool = False, **extra) -> None:
        global _hash_ready
        if not _hash_ready:
            init_none_hash(sha256)
            _hash_ready = True
        extra_config = {"kvtier_socket": socket, "kvtier_timeout_ms": 2000, **extra}
        if connector == "OffloadingConnector":
            # vLLM's TieringOffloadingSpec when the test names it.
            extra_config.setdefault("spec_name", "KvtierOffloadingSpec")
            if extra_config["spec_name"] == "KvtierOffloadingSpec":
                extra_config["spec_module_path"] = "kvtier.integrations.vllm"
        self.mla = mla
        model = ModelConfig(model=model_dir(tmp, tp, mla), dtype="float32", skip_tokenizer_init=True,
                            max_model_len=max_model_len, seed=0)
        self.config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                             max_model_len=max_model_len, is_encoder_decoder=False),
            parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                           distributed_executor_backend="mp" if tp > 1 else None),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector,
                kv_connector_module_path="kvtier.integrations.vllm" if connector != "OffloadingConnector" else None,
                kv_role="kv_both", kv_connector_extra_config=extra_config, kv_load_failure_policy=policy,
            ),
            device_config=DeviceConfig("cpu"),
            load_config=LoadConfig(load_format="dummy"),
        )
        if mla:
            spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=MLA_HEAD,
                                    dtype=torch.float32)
        else:
            spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                     dtype=torch.float32)
        self.page_bytes = spec.page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            # One backing allocation, layer-outermost (as vLLM's allocator).
            kv_cache_tensors=[
                KVCacheTensor(size=self.page_bytes * num_blocks * len(LAYERS), layers=list(LAYERS),
                              layer_stride=self.page_bytes * num_blocks, block_stride=self.page_bytes)
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
            # MLA: every TP rank holds the whole (latent) KV.
            kv_tp_replicas=tp if mla else 1,
        )
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config, kv_cache_config=self.kv_cache_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK_SIZE,
        )
        # One worker-side connector per tensor-parallel rank (vLLM's
        # workers each build theirs with parallel_config.rank set), each
        # with its own "GPU" KV cache: per layer (blocks, K/V, block_size,
        # heads, head), manager blocks first as vLLM's connectors view it,
        # on the CPU. Their outputs are merged as vLLM's executor merges
        # them (KVOutputAggregator), so a transfer is done when every rank
        # reported it.
        self.workers = []
        self.kvs: list[dict[str, torch.Tensor]] = []
        for rank in range(tp if workers else 0):
            self.config.parallel_config.rank = rank
            w = KVConnectorFactory.create_connector(
                config=self.config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_cache_config)
            shape = (num_blocks, BLOCK_SIZE, MLA_HEAD) if mla else (num_blocks, 2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
            kv = {n: torch.zeros(shape, dtype=torch.float32) for n in LAYERS}
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kvs.append(kv)
        self.config.parallel_config.rank = 0
        if workers:
            self.worker, self.kv = self.workers[0], self.kvs[0]
        self.aggregator = KVOutputAggregator(tp)
        # Prompt tokens the "model" computed per request (prefill work).
        self.computed: dict[str, int] = {}
        self.finished: dict[str, list[int]] = {}
        # The kv_connector_stats payloads of the scheduler's stats, one per
        # step that had any (what vLLM's Prometheus logger observes).
        self.connector_stats: list[dict] = []
        self.steps = 0
        # Called with each SchedulerOutput between the scheduler's lookup
        # and the worker's load (to kill the daemon there).
        self.before_load = None

    @property
    def spec(self):
        """The worker's KvtierOffloadingSpec (its counters: loads, stores)."""
        return self.worker.connector_worker.spec

    def counters(self, rank: int = 0) -> dict:
        """The scheduler's (lookups) and one rank's worker counters together."""
        out = dict(self.scheduler.connector.connector_scheduler.manager.counters.snapshot())
        for k, v in self.workers[rank].connector_worker.spec.counters.snapshot().items():
            out[k] = out.get(k, 0) + v
        return out

    @staticmethod
    def request(req_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
        """A vLLM Request of ``prompt`` (its block hashes computed)."""
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                       block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
        req = self.request(req_id, prompt, max_tokens)
        self.scheduler.add_request(req)
        self.computed[req_id] = 0
        return req

    def _forward(self, so) -> None:
        """Writes the KV of every scheduled token: a value derived from the
        token position and the prompt's first token (what a model's
        prefix-dependent KV looks like, enough to tell blocks apart)."""
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            # schedule() has already advanced num_computed_tokens past them.
            start = req.num_computed_tokens - n
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for pos in range(start, start + n):
                b, off = block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                for li, layer in enumerate(LAYERS):
                    for kv in self.kvs:
                        v = float(req.all_token_ids[0] * 10_000 + pos * 10 + li)
                        if self.mla:
                            kv[layer][b, off] = v
                        else:
                            kv[layer][b, :, off] = v
            # Prefill work only (decode steps add one token each).
            self.computed[req_id] += max(0, min(start + n, req.num_prompt_tokens) - start)

    def step(self) -> bool:
        """One engine step; whether it scheduled any token."""
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        if self.before_load is not None:
            self.before_load(so)
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
        self._forward(so)
        ids = [r for r in so.num_scheduled_tokens]
        # A request whose prompt is fully computed samples one token.
        sampled = []
        for r in ids:
            req = self.scheduler.requests[r]
            sampled.append([7] if req.num_computed_tokens >= req.num_prompt_tokens else [])
        outs = []
        for w in self.workers:
            w.wait_for_save()
            tr = w.get_transfer_results(so.finished_req_ids)
            kvo = KVConnectorOutput(
                finished_sending=tr.finished_sending, finished_recving=tr.finished_recving,
                failed_recving=tr.failed_recving, invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            )
            w.clear_connector_metadata()
            outs.append(ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=sampled, kv_connector_output=kvo))
        out = self.aggregator.aggregate(outs, 0)
        for eco in self.scheduler.update_from_output(so, out).values():
            st = eco.scheduler_stats
            if st is not None and st.kv_connector_stats:
                self.connector_stats.append(st.kv_connector_stats)
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.new_token_ids
        self.steps += 1
        return bool(so.num_scheduled_tokens)

    def run(self, req_id: str, timeout_s: float = 120) -> None:
        """Steps until the request has finished and the scheduler holds
        nothing more (its stores done: vLLM keeps a finished request's
        blocks until the connector's store of them completes)."""
        deadline = time.monotonic() + timeout_s
        while req_id not in self.finished or self.scheduler.has_requests():
            assert time.monotonic() < deadline, f"{req_id} did not finish within {timeout_s} s"
            if not self.step():
                time.sleep(0.01)  # only transfers in flight

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()

