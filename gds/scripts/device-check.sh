#!/usr/bin/env bash
# GPU check for kvtier-gds: device-memory round trips with checksums and
# guard bytes (TwoHop, and Direct GDS when the driver has it), then
# `kvtier bench gds` into device, pinned and host memory, then the Python
# package's round trip into device memory (torch or cupy, where present)
# beside a plain pinned copy. Prints a summary.
# Budget: under 8 minutes on one H200 with the binaries prebuilt.
#
#   gds/scripts/device-check.sh --prepare   # here (network, cargo cache):
#                                           # build test binaries + kvtier
#                                           # into target/device-check/
#   gds/scripts/device-check.sh --prebuilt  # on the GPU machine (carry
#                                           # target/device-check; no
#                                           # network): run them from there
#   gds/scripts/device-check.sh             # both, building with --offline
#
# Env: PROFILE (dev|release, default dev: dependencies are optimised in dev
# too), BLOCKS (default 256), BLOCK_SIZE (default 2MiB), ROUNDS (default 3),
# OUT (where results go; default target/device-check/results).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
DC="$ROOT/target/device-check"
PROFILE=${PROFILE:-dev}
BLOCKS=${BLOCKS:-256}
BLOCK_SIZE=${BLOCK_SIZE:-2MiB}
ROUNDS=${ROUNDS:-3}
mode=${1:-all}

prepare() {
  set -e
  local offline=()
  [ "$mode" = all ] && offline=(--offline)
  echo "== building kvtier-gds test binaries and kvtier (profile $PROFILE, cuda feature on)"
  rm -rf "$DC/bin" && mkdir -p "$DC/bin"
  cargo build "${offline[@]}" --profile "$PROFILE" -p kvtier-tools --bin kvtier
  local dir=debug
  [ "$PROFILE" = release ] && dir=release
  cp "target/$dir/kvtier" "$DC/bin/kvtier"
  cargo test "${offline[@]}" --profile "$PROFILE" -p kvtier-gds --no-run \
      --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" "$DC/bin/test-$name"; done
  # The Python package (a wheel, installed offline on the GPU machine) and
  # the kvtierd its round trip talks to.
  cargo build "${offline[@]}" --profile "$PROFILE" -p kvtier-daemon --bin kvtierd
  cp "target/$dir/kvtierd" "$DC/bin/kvtierd"
  rm -rf "$DC/wheel" && mkdir -p "$DC/wheel"
  if command -v maturin >/dev/null || [ -x .venv/bin/maturin ]; then
    local mat=maturin
    [ -x .venv/bin/maturin ] && mat=.venv/bin/maturin
    (cd client/python && CARGO_TARGET_DIR="$ROOT/target" "$mat" build --profile "$PROFILE" --out "$DC/wheel" -q) \
      || echo "warning: python wheel not built; the python device check will be skipped" >&2
  else
    echo "warning: maturin absent (./scripts/test-python.sh installs it into .venv); no python wheel" >&2
  fi
  # Debug info is the bulk of these binaries; the carry limit is 64 MiB.
  for f in "$DC"/bin/*; do strip --strip-debug "$f" 2>/dev/null || true; done
  ls -la "$DC/bin"
  du -sh "$DC"
  set +e
}

prebuilt() {
  local out=${OUT:-$DC/results}
  mkdir -p "$out"
  local sum="$out/summary.txt"
  : > "$sum"
  note() { echo "$*" | tee -a "$sum"; }
  [ -x "$DC/bin/kvtier" ] || { echo "no prebuilt binaries in $DC/bin: run --prepare first" >&2; exit 2; }
  export KVTIER_TEST_TMPDIR="$DC/tmp"
  mkdir -p "$KVTIER_TEST_TMPDIR"
  note "== device-check $(date -u +%FT%TZ) on $(hostname)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$sum"
  else
    note "nvidia-smi: absent"
  fi
  ls /usr/local/cuda*/lib64/libcufile.so* /usr/lib/x86_64-linux-gnu/libcufile.so* 2>/dev/null | head -3 | tee -a "$sum"
  local fail=0
  for t in "$DC"/bin/test-*; do
    local name=${t##*/test-}
    echo "== tests: $name"
    if KVTIER_REQUIRE_GPU=1 timeout 180 "$t" --test-threads=1 --nocapture >"$out/test-$name.log" 2>&1; then
      note "PASS tests/$name ($(grep -c '\.\.\. ok' "$out/test-$name.log") ok)"
    else
      fail=1
      note "FAIL tests/$name (log: $out/test-$name.log)"
      tail -30 "$out/test-$name.log"
    fi
    grep -E "SKIP|NOTE|h2d pinned|Direct fell back|probe:" "$out/test-$name.log" | sort -u | tee -a "$sum"
  done
  local common=(bench gds --blocks "$BLOCKS" --block-size "$BLOCK_SIZE" --rounds "$ROUNDS" --dir "$DC/tmp" --json)
  for variant in "device" "device --no-gds" "device --no-gds --lanes 4" "device --skip-direct-verify" "pinned --lanes 4" "host --lanes 4"; do
    local tag=${variant// /}
    echo "== kvtier bench gds --dest $variant"
    # shellcheck disable=SC2086
    if ! timeout 150 "$DC/bin/kvtier" "${common[@]}" --dest $variant >"$out/bench-$tag.json" 2>"$out/bench-$tag.err"; then
      fail=1
      note "FAIL bench --dest $variant: $(tail -3 "$out/bench-$tag.err")"
    elif ! command -v python3 >/dev/null; then
      note "bench --dest $variant: $(cat "$out/bench-$tag.json")"
    else
      python3 - "$out/bench-$tag.json" "$variant" <<'PY' | tee -a "$sum"
import json, sys
r = json.load(open(sys.argv[1]))
keys = ["route", "fallbacks", "onboard_gbps", "onboard_gbps_baseline", "onboard_gbps_vs_baseline",
        "h2d_pinned_gbps", "device_onboard_gbps_baseline", "device_onboard_gbps_vs_baseline",
        "blake3_one_core_gbps", "page_cache_dropped", "dest_emulated"]
print("bench --dest %-16s " % sys.argv[2] + " ".join(
    "%s=%s" % (k, round(r[k], 3) if isinstance(r[k], float) else r[k]) for k in keys if k in r))
PY
    fi
  done
  echo "== python: kvtier round trip into device memory (torch or cupy)"
  local whl
  whl=$(ls "$DC"/wheel/kvtier-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    note "SKIP python device check: no wheel in $DC/wheel"
  elif ! python3 -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    note "SKIP python device check: needs CPython >= 3.11"
  else
    # --system-site-packages: torch / cupy come from the machine (no network).
    rm -rf "$DC/pyenv" && python3 -m venv --system-site-packages "$DC/pyenv" \
      && "$DC/pyenv/bin/pip" install -q --no-index --no-deps "$whl" \
      && if timeout 240 "$DC/pyenv/bin/python" gds/scripts/device_check_py.py "$DC/bin/kvtierd" "$DC/tmp/py" \
            "${PY_BLOCKS:-64}" 2097152 >"$out/python-device.json" 2>"$out/python-device.err"; then
           note "python device: $(cat "$out/python-device.json")"
           grep -q '"skip"' "$out/python-device.json" || grep -q '"roundtrip_device": "ok"' "$out/python-device.json" || fail=1
         else
           fail=1
           note "FAIL python device check: $(tail -5 "$out/python-device.err")"
         fi
  fi
  rm -rf "$KVTIER_TEST_TMPDIR"
  echo
  echo "== summary"
  cat "$sum"
  [ $fail = 0 ] && echo "device-check: OK" || echo "device-check: FAILURES"
  return $fail
}

case "$mode" in
  --prepare) prepare ;;
  --prebuilt) prebuilt ;;
  all) prepare && prebuilt ;;
  *) echo "usage: $0 [--prepare|--prebuilt]" >&2; exit 2 ;;
esac
