"""kvtier's vLLM OffloadingSpec through vLLM 0.33.0's own classes: the spec
is built by vLLM's OffloadingSpecFactory from the module path, and the
manager and worker are driven in the order vLLM's offloading connector
calls them (scheduler: lookup, prepare_store, complete_store, take_events,
prepare_load, complete_load; worker: submit_store / submit_load, wait,
get_finished), with CPU tensors standing in for the GPU KV cache."""

from __future__ import annotations

import hashlib

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtier.integrations.vllm import KvtierOffloadingSpec

PAGE = 8192  # bytes of one layer's KV per GPU block
LAYERS = 2
NUM_BLOCKS = 12


def make_config(socket: str, bpc: int = 1, rank: int = 0, world: int = 1) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=PAGE * LAYERS,
        enable_kv_cache_events=True,
        extra_config={
            "spec_name": "KvtierOffloadingSpec",
            "spec_module_path": "kvtier.integrations.vllm",
            "kvtier_socket": socket,
            "kvtier_timeout_ms": 1000,
        },
        engine_id="engine-0",
        model=OffloadingModelConfig(name="test/llama", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def kv_caches(seed: int) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=g) for _ in range(LAYERS)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in ts],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(LAYERS)]],
    )
    return caches, ts


def keys(n: int, salt: bytes = b"") -> list:
    return [make_offload_key(hashlib.sha256(salt + bytes([i])).digest(), 0) for i in range(n)]


def run_job(worker, submit, job_id: int, *args):
    assert submit(job_id, *args)
    worker.wait({job_id})
    done = worker.get_finished()
    assert [r.job_id for r in done] == [job_id]
    return done[0]


def test_factory_builds_the_spec_from_the_module_path(daemon):
    spec = OffloadingSpecFactory.create_spec(make_config(daemon.socket))
    assert isinstance(spec, KvtierOffloadingSpec)


def test_store_then_load_round_trip_and_events(daemon):
    spec = OffloadingSpecFactory.create_spec(make_config(daemon.socket))
    manager = spec.get_manager()
    caches, ts = kv_caches(1)
    worker = spec.get_worker(caches)
    ctx = ReqContext(req_id="r1")
    ks = keys(4)
    with manager.lock:
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in ks] == [LookupResult.MISS] * 4
        out = manager.prepare_store(ks, ctx)
    assert out is not None and out.keys_to_store == ks and out.evicted_keys == []
    src = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4], block_indices=[0])
    res = run_job(worker, worker.submit_store, 1, src, out.store_spec)
    assert res.success and res.transfer_size == 4 * PAGE * LAYERS
    with manager.lock:
        manager.complete_store(ks, ctx)
        events = list(manager.take_events())
    assert len(events) == 1
    assert events[0].keys == ks and not events[0].removed and events[0].medium == Medium.STORAGE
    assert spec.counters.get("store_blocks") == 4

    # A second engine (a restart) sees the blocks: kvtierd is the index.
    spec2 = OffloadingSpecFactory.create_spec(make_config(daemon.socket))
    manager2 = spec2.get_manager()
    caches2, ts2 = kv_caches(2)
    worker2 = spec2.get_worker(caches2)
    ctx2 = ReqContext(req_id="r2")
    with manager2.lock:
        manager2.on_new_request(ctx2)
        assert [manager2.lookup(k, ctx2) for k in ks] == [LookupResult.HIT] * 4
        assert manager2.prepare_store(ks, ctx2).keys_to_store == []
        load_spec = manager2.prepare_load(ks[:3], ctx2)
    dst = GPULoadStoreSpec([7, 5, 9], group_sizes=[3], block_indices=[0])
    assert run_job(worker2, worker2.submit_load, 2, load_spec, dst).success
    with manager2.lock:
        manager2.complete_load(ks[:3], ctx2)
    for layer in range(LAYERS):
        for src_block, dst_block in [(1, 7), (2, 5), (3, 9)]:
            assert torch.equal(ts2[layer][dst_block], ts[layer][src_block])
    assert spec2.counters.get("load_blocks") == 3
    worker.shutdown()
    worker2.shutdown()


def test_chunks_of_two_blocks_with_a_partial_first_chunk(daemon):
    spec = OffloadingSpecFactory.create_spec(make_config(daemon.socket, bpc=2))
    manager = spec.get_manager()
    caches, ts = kv_caches(3)
    worker = spec.get_worker(caches)
    ctx = ReqContext(req_id="r")
    ks = keys(2, b"bpc2")
    out = manager.prepare_store(ks, ctx)
    src = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4], block_indices=[0])
    assert run_job(worker, worker.submit_store, 1, src, out.store_spec).success
    manager.complete_store(ks, ctx)
    # Load from logical block 1 on (the GPU already holds block 0): the
    # first chunk is partial; its first slot is read into padding.
    load_spec = manager.prepare_load(ks, ctx)
    dst = GPULoadStoreSpec([8, 9, 10], group_sizes=[3], block_indices=[1])
    assert run_job(worker, worker.submit_load, 2, load_spec, dst).success
    for layer in range(LAYERS):
        for s, d in [(2, 8), (3, 9), (4, 10)]:
            assert torch.equal(ts[layer][d], ts[layer][s])
    worker.shutdown()


def test_tp_ranks_are_separate_namespaces(daemon):
    specs = [OffloadingSpecFactory.create_spec(make_config(daemon.socket, rank=r, world=2)) for r in (0, 1)]
    ids = {s.namespaces[s.config.parallel.rank].id for s in specs}
    assert len(ids) == 2
    caches, _ = kv_caches(4)
    ks = keys(1, b"tp")
    manager = specs[0].get_manager()  # the scheduler: rank 0's config
    ctx = ReqContext(req_id="r")
    out = manager.prepare_store(ks, ctx)
    w0 = specs[0].get_worker(caches)
    src = GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0])
    assert run_job(w0, w0.submit_store, 1, src, out.store_spec).success
    # Only rank 0 stored: not a hit until every rank has the block.
    assert manager.lookup(ks[0], ctx) == LookupResult.MISS
    w1 = specs[1].get_worker(caches)
    assert run_job(w1, w1.submit_store, 1, src, out.store_spec).success
    assert manager.lookup(ks[0], ctx) == LookupResult.HIT
    w0.shutdown()
    w1.shutdown()


def test_dead_daemon_is_a_miss_never_an_exception(daemon):
    spec = OffloadingSpecFactory.create_spec(make_config(daemon.socket))
    manager = spec.get_manager()
    caches, _ = kv_caches(5)
    worker = spec.get_worker(caches)
    ctx = ReqContext(req_id="r")
    ks = keys(2, b"dead")
    out = manager.prepare_store(ks, ctx)
    daemon.kill9()
    assert manager.lookup(ks[0], ctx) == LookupResult.MISS
    assert manager.prepare_store(keys(2, b"other"), ctx) is None
    # A store that cannot happen is not a failure vLLM sees: those blocks
    # are just not cached.
    src = GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0])
    assert run_job(worker, worker.submit_store, 1, src, out.store_spec).success
    manager.complete_store(ks, ctx)
    assert list(manager.take_events()) == []
    c = spec.counters.snapshot()
    assert c["store_failures"] == 2 and c["lookup_misses"] >= 1 and c["errors"] >= 1
    # The daemon comes back: the client reconnects by itself.
    daemon.start()
    assert manager.lookup(ks[0], ctx) == LookupResult.MISS
    out = manager.prepare_store(ks, ctx)
    assert out is not None and out.keys_to_store == ks
    worker.shutdown()
