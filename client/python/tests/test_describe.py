"""``Client.describe``: a namespace's engine and model told to the daemon
(OP_DESCRIBE), shown by ``kvtier stats`` (``Client.stats()``'s
``namespaces``) and the daemon's per-namespace metrics; bad names are a
``kvtier.Error`` before anything is sent."""

from __future__ import annotations

import pytest

import kvtier


def test_describe_labels_the_namespace_in_stats_and_metrics(daemon):
    c = kvtier.Client(socket=daemon.socket)
    ns = kvtier.Namespace("org/model-7b", kvtier.Layout.with_block_bytes(8192), "", b"t")
    assert c.describe(ns, "vllm") == "ok"
    [n] = [n for n in c.stats()["namespaces"] if n["id"] == ns.id]
    assert (n["engine"], n["model"]) == ("vllm", "org/model-7b")
    assert c.lookup(ns, [b"k1", b"k2"]).prefix_len == 0
    labels = {"namespace": ns.id, "engine": "vllm", "model": "org/model-7b"}
    assert daemon.metric("kvtier_client_lookups_total", **labels) == 1
    assert daemon.metric("kvtier_client_lookup_blocks_total", result="miss", **labels) == 2
    # Described again (another engine): the old labels are gone.
    assert c.describe(ns, "sglang") == "ok"
    assert daemon.metric("kvtier_client_lookups_total", **labels) == 0
    assert daemon.metric("kvtier_client_lookups_total", namespace=ns.id, engine="sglang") == 1


def test_a_long_model_is_cut_and_bad_engines_are_refused(daemon):
    c = kvtier.Client(socket=daemon.socket)
    long = kvtier.Namespace("é" * 300, kvtier.Layout.with_block_bytes(8192), "", b"t")
    assert c.describe(long, "lmcache") == "ok"
    [n] = [n for n in c.stats()["namespaces"] if n["id"] == long.id]
    assert n["model"] == "é" * 128  # 256 bytes, cut at a character boundary
    for bad in ("", "VLLM", "has space", "x" * 33):
        with pytest.raises(kvtier.Error):
            c.describe(long, bad)
