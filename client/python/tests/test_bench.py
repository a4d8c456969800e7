"""`python -m kvtier.bench` runs at a tiny size and keeps the JSON contract
(it never asserts a speed)."""

import json
import subprocess
import sys

from conftest import kvtierd_bin


def test_bench_json_contract():
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "--json", "--block-size", "64KiB", "--blocks", "4",
         "--depth", "2", "--rounds", "2", "--warmup", "1", "--kvtierd", kvtierd_bin()],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for k in ("onboard_gbps_vs_baseline", "offload_gbps_vs_baseline",
              "onboard_odirect_gbps_vs_baseline", "offload_odirect_gbps_vs_baseline",
              "pool_onboard_gbps_vs_baseline", "pool_offload_gbps_vs_baseline"):
        assert isinstance(doc[k], float) and doc[k] > 0, (k, doc.get("note"))
    assert len(doc["python_onboard_gbps_rounds"]) == 2
    # The Rust client ran the same requests in the same rounds (warm-up not counted).
    for k in ("rust_onboard_gbps_rounds", "rust_offload_gbps_rounds", "python_pool_offload_gbps_rounds"):
        assert len(doc[k]) == 2 and all(x > 0 for x in doc[k]), k
    for k in ("offload_paired_gbps_vs_baseline", "onboard_paired_gbps_vs_baseline",
              "offload_rust_cli_gbps_vs_baseline", "onboard_rust_cli_gbps_vs_baseline"):
        assert isinstance(doc[k], float) and doc[k] > 0, k
    assert all(k.endswith("_vs_baseline") or "vs_baseline" not in k for k in doc)


def test_rust_baseline_rejects_what_it_cannot_measure(daemon):
    import numpy as np
    import pytest

    import kvtier
    from kvtier import _kvtier

    c = kvtier.Client(socket=daemon.socket)
    ns = kvtier.Namespace("bench-test", kvtier.Layout.with_block_bytes(4096))
    keys = ns.hash_chain(list(range(32)))
    bufs = [np.full(4096, i + 1, np.uint8) for i in range(2)]
    with pytest.raises(kvtier.BufferError, match="op"):
        _kvtier._rust_client_round(c, ns, "fetch", keys, bufs, 2)
    with pytest.raises(kvtier.BufferError, match="contiguous host"):
        _kvtier._rust_client_round(c, ns, "offload", keys, [[b[:2048], b[2048:]] for b in bufs], 2)
    secs, failed = _kvtier._rust_client_round(c, ns, "offload", keys, bufs, 1)
    assert failed == 0 and secs > 0
    outs = [np.zeros(4096, np.uint8) for _ in range(2)]
    secs, failed = _kvtier._rust_client_round(c, ns, "onboard", keys[::-1], outs, 2)
    assert failed == 0
    assert (outs[0] == 2).all() and (outs[1] == 1).all()
    ns2 = kvtier.Namespace("bench-test-nochain", kvtier.Layout.with_block_bytes(4096))
    _, failed = _kvtier._rust_client_round(c, ns2, "offload", ns2.hash_chain(list(range(32))), bufs, 2, chain=False)
    assert failed == 0


def test_bench_finds_the_workspace_build_from_any_directory_of_the_checkout(tmp_path):
    """The package installed outside the checkout (a copy, as pip installs
    it), run from a directory inside the checkout with no binary on $PATH:
    it finds target/<profile>/kvtierd above the current directory (before,
    only above the package's own files: \"no kvtierd\")."""
    import os
    import pathlib
    import shutil

    import kvtier

    site = tmp_path / "site"
    shutil.copytree(pathlib.Path(kvtier.__file__).parent, site / "kvtier", symlinks=False)
    repo = pathlib.Path(kvtierd_bin()).resolve().parents[2]  # <checkout>/target/<profile>/kvtierd
    cwd = repo / "docs" if (repo / "docs").is_dir() else repo
    env = {k: v for k, v in os.environ.items() if k != "CARGO_TARGET_DIR"}
    env.update(PYTHONPATH=str(site), PATH="/usr/bin:/bin")
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.bench", "--json", "--block-size", "64KiB", "--blocks", "2",
         "--depth", "1", "--rounds", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=300, cwd=cwd, env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["python_onboard_gbps"] > 0


def test_bench_runs_outside_any_checkout_with_the_binaries_on_path(tmp_path):
    """`python -m kvtier.bench` from a directory that is no checkout, the
    package copied as pip installs it: kvtierd and kvtier from $PATH; with
    neither there, a one-line error that says what to pass, no traceback."""
    import os
    import pathlib
    import shutil

    import kvtier

    site = tmp_path / "site"
    shutil.copytree(pathlib.Path(kvtier.__file__).parent, site / "kvtier", symlinks=False)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    daemon_bin = pathlib.Path(kvtierd_bin()).resolve()
    for name in ("kvtierd", "kvtier"):
        (bindir / name).symlink_to(daemon_bin.parent / name)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CARGO_TARGET_DIR"}
    args = [sys.executable, "-m", "kvtier.bench", "--json", "--block-size", "64KiB", "--blocks", "2",
            "--depth", "1", "--rounds", "1", "--warmup", "0"]
    env.update(PYTHONPATH=str(site), PATH=f"{bindir}:/usr/bin:/bin")
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=away, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["python_onboard_gbps"] > 0
    assert "note" not in doc, doc.get("note")  # the CLI baselines ran: kvtier was found on $PATH
    env.update(PATH="/usr/bin:/bin")
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=away, env=env)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "--kvtierd" in r.stderr, r.stderr[-2000:]
