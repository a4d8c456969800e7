#!/usr/bin/env bash
# The venv `kvtier bench peers` runs Mooncake Store from: the non-CUDA wheel
# mooncake-transfer-engine-non-cuda (its mooncake_master and store.so; needs
# libibverbs1 from apt even for TCP, see scripts/setup.sh). Created once
# under target/peers-venv; the bench finds it there (or
# $KVTIER_BENCH_MOONCAKE_PYTHON). A failed install leaves Mooncake reported
# as skipped with the reason, not a failed bench. Measured on a 2-core
# machine: about 20 s and 185 MB cold, instant when cached.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$PWD/target/peers-venv"
PIN="mooncake-transfer-engine-non-cuda==0.3.13.post1"
STAMP="$VENV/.kvtier-$PIN"
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-compile --no-cache-dir "$PIN" >&2
  touch "$STAMP"
fi
echo "$VENV"
