"""`python -m kvtier.bench` runs at a tiny size and keeps the JSON contract
(it never asserts a speed)."""

import json
import subprocess
import sys

from conftest import kvtierd_bin


def test_bench_json_contract():
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "--json", "--block-size", "64KiB", "--blocks", "4",
         "--depth", "2", "--rounds", "2", "--kvtierd", kvtierd_bin()],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for k in ("onboard_gbps_vs_baseline", "offload_gbps_vs_baseline",
              "onboard_odirect_gbps_vs_baseline", "offload_odirect_gbps_vs_baseline",
              "pool_onboard_gbps_vs_baseline", "pool_offload_gbps_vs_baseline"):
        assert isinstance(doc[k], float) and doc[k] > 0, (k, doc.get("note"))
    assert len(doc["python_onboard_gbps_rounds"]) == 2
    assert all(k.endswith("_vs_baseline") or "vs_baseline" not in k for k in doc)
