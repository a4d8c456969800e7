"""vLLM 0.33.0's real Scheduler and worker connector (vllm_engine.Engine)
seen from outside: the daemon's per-namespace metrics count the prompt's
stores and loads under the namespace the connector described (engine
``vllm``, the namespace's model), and vLLM's own connector stats (the
scheduler's ``kv_connector_stats``, which its Prometheus logger observes)
carry kvtier's transfers and lookups."""

from __future__ import annotations

import functools

from test_vllm_scheduler import CACHED, PROMPT, store_prompt
from vllm_engine import BLOCK_SIZE, Engine


def test_the_daemon_counts_vllms_blocks_under_its_namespace(tmp_path, daemon):
    store_prompt(tmp_path, daemon.socket)
    e = Engine(tmp_path, daemon.socket)
    e.add("reader", PROMPT)
    e.run("reader")
    assert e.computed["reader"] == len(PROMPT) - CACHED
    ns = e.spec.namespaces[0]
    labels = {"namespace": ns.id, "engine": "vllm"}
    chunks = CACHED // BLOCK_SIZE
    assert daemon.metric("kvtier_client_offload_blocks_total", **labels) >= chunks
    assert daemon.metric("kvtier_client_onboard_blocks_total", result="hit", **labels) == chunks
    assert daemon.metric("kvtier_client_onboard_bytes_total", **labels) == chunks * e.spec.chunk_bytes
    assert daemon.metric("kvtier_client_lookup_blocks_total", result="hit", **labels) >= chunks
    e.shutdown()


def test_vllms_connector_stats_carry_kvtiers_transfers_and_lookups(tmp_path, daemon):
    """The scheduler's stats of a cached prompt's run hold the loaded
    bytes (from KvtierOffloadingWorker's transfer sizes and times) and
    kvtier's lookup counters (KvtierOffloadingManager.get_stats), and
    vLLM's Prometheus metrics for the connector export them under the
    names KvtierOffloadingSpec declares."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    from kvtier.integrations.vllm import KvtierConnector

    store_prompt(tmp_path, daemon.socket)
    e = Engine(tmp_path, daemon.socket)
    e.add("reader", PROMPT)
    e.run("reader")
    assert e.computed["reader"] == len(PROMPT) - CACHED
    total = OffloadingConnectorStats()
    for d in e.connector_stats:
        total.aggregate(OffloadingConnectorStats(data=d))
    got = total.reduce()
    chunks = CACHED // BLOCK_SIZE
    assert got["vllm:kv_offload_load_bytes"] == chunks * e.spec.chunk_bytes, got
    assert got["vllm:kv_offload_kvtier_lookup_hits"] >= chunks, got
    assert got["vllm:kv_offload_kvtier_lookups"] >= got["vllm:kv_offload_kvtier_lookup_hits"], got

    reg = CollectorRegistry()
    types = {c: functools.partial(c, registry=reg) for c in (Counter, Gauge, Histogram)}
    prom = KvtierConnector.build_prom_metrics(e.config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    for d in e.connector_stats:
        prom.observe(d, 0)
    text = generate_latest(reg).decode()
    hits = [ln for ln in text.splitlines() if ln.startswith("vllm:kv_offload_kvtier_lookup_hits_total{")]
    assert hits and float(hits[0].split()[-1]) == got["vllm:kv_offload_kvtier_lookup_hits"], text
    e.shutdown()
