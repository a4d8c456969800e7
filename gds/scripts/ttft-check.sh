#!/usr/bin/env bash
# GPU check: what loading KV from kvtier beats recomputing it by. A randomly
# initialised transformers Llama (16 layers, GQA 8x128, bf16) prefills a
# long prompt, its KV is offloaded to a kvtierd on local NVMe, then time to
# first token with the KV onboarded into GPU memory is set against a full
# prefill, beside a pinned host->device copy of the same bytes, in the same
# run (gds/scripts/ttft_check.py). Needs torch + transformers on the GPU
# machine (no network: nothing is installed there).
# Budget: about 3 minutes on one H200 with the binaries prebuilt.
#
#   gds/scripts/device-check.sh --prepare   # here: builds kvtierd + the wheel
#                                           # into target/device-check/
#   gds/scripts/ttft-check.sh               # on the GPU machine (carry
#                                           # target/device-check)
#
# Env: PROMPT_TOKENS (default 8192), ROUNDS (default 3), OUT (results dir,
# default target/device-check/results).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
DC="$ROOT/target/device-check"
out=${OUT:-$DC/results}
mkdir -p "$out" "$DC/tmp"
whl=$(ls "$DC"/wheel/kvtier-*.whl 2>/dev/null | head -1)
if [ ! -x "$DC/bin/kvtierd" ] || [ -z "$whl" ]; then
  echo "FAIL: no $DC/bin/kvtierd or wheel: run gds/scripts/device-check.sh --prepare first" >&2
  exit 1
fi
rm -rf "$DC/ttftenv" && python3 -m venv --system-site-packages "$DC/ttftenv" \
  && "$DC/ttftenv/bin/pip" install -q --no-index --no-deps "$whl" || { echo "FAIL: wheel install" >&2; exit 1; }
rm -rf "$DC/tmp/ttft"
timeout 480 "$DC/ttftenv/bin/python" gds/scripts/ttft_check.py "$DC/bin/kvtierd" "$DC/tmp/ttft" \
  "${PROMPT_TOKENS:-8192}" "${ROUNDS:-3}" | tee "$out/ttft.json"
rc=${PIPESTATUS[0]}
rm -rf "$DC/tmp/ttft"
exit "$rc"
