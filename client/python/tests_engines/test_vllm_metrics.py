"""vLLM 0.33.0's real Scheduler and worker connector (vllm_engine.Engine)
seen from the daemon: the connector describes its namespaces (engine
``vllm``, the namespace's model), and the daemon's per-namespace metrics
count the prompt's stores and loads under those labels."""

from __future__ import annotations

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
