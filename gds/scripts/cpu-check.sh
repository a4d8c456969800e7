#!/usr/bin/env bash
# The GPU run's scripts on CPU, as scripts/test.sh (CI) runs them, so they
# cannot rot between the rare GPU runs:
#   1. device-check.sh --prepare: the folder a GPU run carries, stripped,
#      and its size with the checkout checked against the 64 MiB limit;
#   2. a venv-from-venv setup like the GPU machine's: venv A holds torch in
#      its own site-packages (as /opt/torch/.venv does there), and `python3`
#      on PATH is A's interpreter; a venv made from A, even with
#      --system-site-packages, cannot import torch (asserted: the trap the
#      old scripts fell into). Every step below runs with A first on PATH,
#      so the scripts must find torch through their own install path (the
#      wheel beside A's interpreter, no venv);
#   3. device-check.sh --prebuilt --device cpu;
#   4. ttft-check.sh --device cpu (a tiny random Llama, a few hundred
#      tokens): kvtier's bytes, the logits, the route;
#   5. negative controls, each of which must fail: the onboard landing in a
#      scratch buffer (--fault onboard-elsewhere), an interpreter without
#      torch, --device cuda on a machine without a GPU (a failure with its
#      reason, never a skip), and gpu-run.sh here (it fails, says why in its
#      last line, and leaves what $OUT may hold).
# Needs: CI's workspace test build (target/debug), the wheel
# scripts/test-python.sh built (target/wheels/test-python), and the engines'
# venv (torch, transformers for CPU; scripts/engines-venv.sh).
#
# What the size check proves, honestly: it sizes a dev-profile build (what
# CI has built; a release build would add many minutes to CI), with the
# same files, the same stripping and the same accounting (the folder plus
# the checkout's files that travel) as the release folder a GPU run
# carries. It does not size that release folder: --prepare checks the size
# of what it actually built every time it runs, so the release build made
# for a GPU run is checked there, before any device time is spent.
# Measured once (docs/OPERATIONS.md): dev 44.6 MiB, release 40.1 MiB, both
# with the checkout.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
t0=$SECONDS
say() { echo "-- [$((SECONDS - t0))s] cpu-check: $*"; }
fail() { echo "cpu-check: FAIL: $*" >&2; exit 1; }
W="$ROOT/target/cpu-check"
rm -rf "$W" && mkdir -p "$W"
export KVTIER_DEVICE_WORK="$W/work"
EV=${KVTIER_ENGINES_VENV:-$ROOT/target/engines-venv}
whl=$(ls "${CARGO_TARGET_DIR:-$ROOT/target}"/wheels/test-python/kvtier-*.whl 2>/dev/null | head -1 || true)
[ -n "$whl" ] || fail "no wheel in target/wheels/test-python (scripts/test-python.sh builds it)"

say "1. device-check.sh --prepare (dev profile, CI's build; stripped; size with the checkout <= 64 MiB)"
PROFILE=dev PREPARE_FROM_WORKSPACE_BUILD=${PREPARE_FROM_WORKSPACE_BUILD:-1} WHEEL="$whl" gds/scripts/device-check.sh --prepare \
  > "$W/prepare.log" 2>&1 || { cat "$W/prepare.log"; fail "--prepare"; }
grep '^carry:' "$W/prepare.log"
# The check itself fails on an over-size folder.
big="$W/big-dc" && mkdir -p "$big" && head -c $((64 << 20)) /dev/zero > "$big/ballast"
if KVTIER_DEVICE_CHECK_DIR="$big" gds/scripts/device-check.sh --size-check > "$W/big.log" 2>&1; then
  fail "--size-check passed a 64 MiB folder"
fi
rm -rf "$big"

say "2. venv-from-venv like the GPU machine's"
base=$("$EV/bin/python" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
"$base" -c 'import torch' 2>/dev/null && fail "$base imports torch itself: the setup would prove nothing"
# Without pip of their own (seconds, not tens of them): A reaches the
# engines venv's pip through the same .pth as torch.
"$base" -m venv --without-pip "$W/torchvenv"
# torch in A's own site-packages (a .pth, rather than 800 MB of copies).
site_a=$("$W/torchvenv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site_ev=$("$EV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site_ev" > "$site_a/engines-torch.pth"
"$W/torchvenv/bin/python" -c 'import torch' || fail "venv A cannot import torch"
"$W/torchvenv/bin/python" -m venv --without-pip --system-site-packages "$W/venv-from-a"
if "$W/venv-from-a/bin/python" -c 'import torch' 2>/dev/null; then
  fail "a venv made from venv A imports torch: the setup is not the GPU machine's"
fi
export PATH="$W/torchvenv/bin:$PATH"
unset PYTHON
[ "$(command -v python3)" = "$W/torchvenv/bin/python3" ] || fail "python3 is not venv A's"

say "3. device-check.sh --prebuilt --device cpu"
OUT="$W/dc" gds/scripts/device-check.sh --prebuilt --device cpu > "$W/dc.log" 2>&1 \
  || { cat "$W/dc.log"; fail "device-check --device cpu"; }
tail -1 "$W/dc.log"
tail -1 "$W/dc.log" | grep -q '^device-check: OK (cpu) ran: bench --dest device --lanes 2, bench --dest host --lanes 2, python cpu round trip; not run: gds test binaries' \
  || fail "device-check's last line: $(tail -1 "$W/dc.log")"
grep -q "kvtier from $W/work/pysite/kvtier" "$W/dc.log" || fail "device-check did not use the wheel beside venv A's python3"

say "4. ttft-check.sh --device cpu"
OUT="$W/ttft" PROMPT_TOKENS=${PROMPT_TOKENS:-300} ROUNDS=${ROUNDS:-2} \
  gds/scripts/ttft-check.sh --device cpu > "$W/ttft.log" 2>&1 || { cat "$W/ttft.log"; fail "ttft-check --device cpu"; }
tail -1 "$W/ttft.log"
"$W/torchvenv/bin/python" - "$W/ttft/ttft-cpu-any.jsonl" <<'PY' || fail "ttft JSON"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
summ, sizes = lines[-1], lines[:-1]
assert summ["check"] == "ttft" and summ["ok"] and summ["ran"] and not summ["failed"], summ
assert "/work/pysite/kvtier" in summ["kvtier"], summ["kvtier"]
for s in sizes:
    assert s["ok"] and s["onboard_routes"] == ["two_hop"] and s["logits_cosine_min"] >= 0.98, s
    assert s["kv_bytes"] == s["blocks"] * s["block_bytes"] > 0 and s["ttft_kvtier_ms"] > 0, s
PY
grep -q "^ttft-check: OK (cpu, route any) ran: " "$W/ttft.log" || fail "ttft-check's last line"

say "5a. negative control: an onboard that lands nothing must fail"
if OUT="$W/ttft-fault" PROMPT_TOKENS=${PROMPT_TOKENS:-300} ROUNDS=1 \
    gds/scripts/ttft-check.sh --device cpu --fault onboard-elsewhere > "$W/ttft-fault.log" 2>&1; then
  cat "$W/ttft-fault.log"; fail "ttft-check passed an onboard that landed nothing"
fi
tail -1 "$W/ttft-fault.log"
grep -q "^ttft-check: FAIL (cpu, route any, fault onboard-elsewhere) ran: nothing; failed: .*differs from the offloaded KV" \
  "$W/ttft-fault.log" || { cat "$W/ttft-fault.log"; fail "the fault's failure does not name the bytes"; }

say "5b. an interpreter without torch fails, with its reason"
if PYTHON="$base" OUT="$W/ttft-notorch" gds/scripts/ttft-check.sh --device cpu > "$W/notorch.log" 2>&1; then
  fail "ttft-check passed without torch"
fi
grep -q "^ttft-check: FAIL (cpu, route any) ran: nothing; not run: .*cannot import torch" "$W/notorch.log" \
  || { cat "$W/notorch.log"; fail "no torch: $(tail -1 "$W/notorch.log")"; }

say "5c. --device cuda without a GPU fails, never skips"
if OUT="$W/ttft-cuda" gds/scripts/ttft-check.sh --device cuda > "$W/cuda.log" 2>&1; then
  fail "ttft-check --device cuda passed on a machine without a GPU"
fi
grep -q "torch.cuda.is_available() is False" "$W/cuda.log" || { cat "$W/cuda.log"; fail "cuda: $(tail -1 "$W/cuda.log")"; }

say "5d. gpu-run.sh without a GPU: fails, says why, leaves at most 8 files under \$OUT"
if BLOCKS=4 PY_BLOCKS=2 OUT="$W/gpu-run" GPU_RUN_BUDGET_S=120 gds/scripts/gpu-run.sh > "$W/gpu-run.log" 2>&1; then
  fail "gpu-run.sh passed without a GPU"
fi
tail -1 "$W/gpu-run.log"
tail -1 "$W/gpu-run.log" | grep -q '^gpu-run: FAIL in [0-9]*s; ran: .*failed: ttft two_hop (ttft-check: FAIL .*torch.cuda.is_available() is False.*); device-check (device-check: FAIL (cuda)' \
  || { cat "$W/gpu-run.log"; fail "gpu-run's last line"; }
"$W/torchvenv/bin/python" - "$W/gpu-run" <<'PY' || fail "gpu-run's \$OUT"
import json, os, re, sys
files = sorted(os.listdir(sys.argv[1]))
assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
assert all(os.path.isfile(os.path.join(sys.argv[1], f)) for f in files), files
doc = json.load(open(os.path.join(sys.argv[1], "gpu-run.json")))
assert doc["ok"] is False and [s["step"] for s in doc["steps"]] == ["ttft two_hop", "device-check", "ttft direct"], doc
dc = json.load(open(os.path.join(sys.argv[1], "device-check.json")))
assert any("emulated" in f["why"] for f in dc["failed"]), dc["failed"]
PY
say "OK"
