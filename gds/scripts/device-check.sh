#!/usr/bin/env bash
# GPU check for kvtier-gds: device-memory round trips with checksums and
# guard bytes (TwoHop, and Direct GDS when the driver has it), then
# `kvtier bench gds` into device, pinned and host memory, then the Python
# package's round trip into device memory beside a plain pinned copy.
# Prints a summary whose last line says what ran, what failed and what did
# not run, and writes it all as JSON ($OUT/device-check.json).
#
#   gds/scripts/device-check.sh --prepare   # here (network, cargo cache):
#       build kvtierd, kvtier, kvtier-gds's test binaries and the Python
#       wheel, stripped, into target/device-check/ (bin/, wheel/), and check
#       that it and the checkout fit the 64 MiB a GPU run can carry
#   gds/scripts/device-check.sh --prebuilt [--device cuda|cpu|auto]
#       on the GPU machine (carry target/device-check; no network): run them
#   gds/scripts/device-check.sh --size-check  # the size check alone
#   gds/scripts/device-check.sh             # both, building with --offline
#
# --device cuda (default where nvidia-smi lists a GPU): every step must run
# on the GPU; a missing driver, torch without CUDA or an emulated
# destination is a failure with its reason, never a skip. --device cpu (CI):
# the bench into host memory and emulated device memory, and the Python
# round trip with CPU tensors through the same pipeline
# (KVTIER_PY_HOST_VIA_GDS=1); the test binaries are not run (cargo test runs
# them), and the last line says so.
#
# The Python steps use $PYTHON or `python3` on PATH as it is, with the wheel
# installed beside it (python-beside.sh: no venv, since on the GPU machine
# python3 is itself a venv interpreter and a venv made from it loses torch).
#
# Env: PROFILE (release|dev, default release; --prepare), WHEEL (--prepare:
# use this wheel instead of building one, e.g. the one scripts/test-python.sh
# built), PREPARE_FROM_WORKSPACE_BUILD=1 (--prepare, dev: take the binaries
# from `cargo test --workspace --no-run`, which CI has built already),
# BLOCKS (default 256; 16 on cpu), BLOCK_SIZE (default 2MiB), ROUNDS
# (default 3; 1 on cpu), PY_BLOCKS (default 64; 8 on cpu), OUT (results,
# default target/device-work/results), DEADLINE (epoch seconds: steps get
# no more than what is left, and those past it are reported not run).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
DC=${KVTIER_DEVICE_CHECK_DIR:-$ROOT/target/device-check}
WORK=${KVTIER_DEVICE_WORK:-$ROOT/target/device-work}
PROFILE=${PROFILE:-release}
# What a GPU run can carry: the checkout and the carried paths together.
CARRY_LIMIT_BYTES=$((64 << 20))
mode=all device=auto
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare|--prebuilt|--size-check) mode=$1; shift ;;
    --device) device=$2; shift 2 ;;
    *) echo "usage: $0 [--prepare|--prebuilt|--size-check] [--device cuda|cpu|auto]" >&2; exit 2 ;;
  esac
done

# The binaries a cargo JSON stream built: "bin NAME PATH" for kvtierd and
# kvtier, "test NAME PATH" for kvtier-gds's test harnesses.
artifacts() {
  python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name = m["target"]["name"]
    if m["profile"]["test"]:
        if m["manifest_path"].endswith("/gds/Cargo.toml"):
            print("test", name, m["executable"])
    elif "bin" in m["target"]["kind"] and name in ("kvtierd", "kvtier"):
        print("bin", name, m["executable"])
'
}

# Sizes what a GPU run carries: target/device-check plus the checkout's
# files that travel (tracked, and untracked but not ignored).
size_check() {
  local dc_bytes tree_bytes=0 total
  dc_bytes=$(du -sb "$DC" | cut -f1)
  if git rev-parse --git-dir >/dev/null 2>&1; then
    tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
      | awk '{s += $1} END {print s + 0}')
  fi
  total=$((dc_bytes + tree_bytes))
  echo "carry: target/device-check $((dc_bytes >> 10)) KiB + checkout $((tree_bytes >> 10)) KiB = $((total >> 10)) KiB of $((CARRY_LIMIT_BYTES >> 10)) KiB"
  ls -l "$DC"/bin "$DC"/wheel
  if [ "$total" -gt "$CARRY_LIMIT_BYTES" ]; then
    echo "FAIL: what a GPU run carries is over 64 MiB" >&2
    return 1
  fi
}

prepare() {
  set -e
  local offline=() tmp
  [ "$mode" = all ] && offline=(--offline)
  tmp=$(mktemp)
  echo "== building kvtierd, kvtier and kvtier-gds's test binaries (profile $PROFILE, cuda feature on)"
  if [ "$PROFILE" = dev ] && [ "${PREPARE_FROM_WORKSPACE_BUILD:-0}" = 1 ]; then
    # CI's test build: already built, so this only lists it.
    cargo test "${offline[@]}" --workspace --no-run --message-format=json | artifacts > "$tmp"
  else
    cargo build "${offline[@]}" --profile "$PROFILE" -p kvtier-daemon -p kvtier-tools --bins \
      --message-format=json | artifacts > "$tmp"
    cargo test "${offline[@]}" --profile "$PROFILE" -p kvtier-gds --no-run \
      --message-format=json | artifacts >> "$tmp"
  fi
  rm -rf "$DC" && mkdir -p "$DC/bin" "$DC/wheel"
  while read -r kind name exe; do
    if [ "$kind" = bin ]; then cp "$exe" "$DC/bin/$name"; else cp "$exe" "$DC/bin/test-$name"; fi
  done < "$tmp"
  rm -f "$tmp"
  for b in kvtierd kvtier test-gpu test-host_pipeline; do
    [ -x "$DC/bin/$b" ] || { echo "FAIL: the build gave no $b" >&2; return 1; }
  done
  # The Python package: a wheel installed offline on the GPU machine.
  if [ -n "${WHEEL:-}" ]; then
    cp "$WHEEL" "$DC/wheel/"
  else
    local mat
    mat=$(command -v maturin || true)
    [ -x .venv/bin/maturin ] && mat=$ROOT/.venv/bin/maturin
    if [ -z "$mat" ]; then
      echo "FAIL: no maturin (scripts/test-python.sh installs it into .venv) and no WHEEL given" >&2
      return 1
    fi
    (cd client/python && CARGO_TARGET_DIR="$ROOT/target" "$mat" build --profile "$PROFILE" \
      "${offline[@]}" --out "$DC/wheel" -q)
  fi
  ls "$DC"/wheel/kvtier-*.whl >/dev/null
  # Symbols and debug info are most of these binaries.
  strip "$DC"/bin/*
  (cd "$DC" && sha256sum bin/* wheel/* > MANIFEST.sha256 && echo "profile $PROFILE, built $(date -u +%FT%TZ) from $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')" > BUILD)
  size_check
  set +e
}

prebuilt() {
  if [ "$device" = auto ]; then
    device=cpu
    nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && device=cuda
  fi
  case "$device" in cuda|cpu) ;; *) echo "--device: cuda, cpu or auto" >&2; exit 2 ;; esac
  local cpu=0
  [ "$device" = cpu ] && cpu=1
  local blocks=${BLOCKS:-$([ $cpu = 1 ] && echo 16 || echo 256)}
  local rounds=${ROUNDS:-$([ $cpu = 1 ] && echo 1 || echo 3)}
  local py_blocks=${PY_BLOCKS:-$([ $cpu = 1 ] && echo 8 || echo 64)}
  local out=${OUT:-$WORK/results}
  local logs="$WORK/device-check-logs"
  rm -rf "$logs" && mkdir -p "$out" "$logs"
  local sum="$logs/summary.txt" steps="$logs/steps.tsv"
  : > "$sum"
  : > "$steps"
  note() { echo "$*" | tee -a "$sum"; }
  # record STATUS NAME DETAIL: STATUS ok | fail | not_run.
  record() { printf '%s\t%s\t%s\n' "$1" "$2" "$(printf '%s' "$3" | tr '\t\n' '  ' | sed 's/ *$//')" >> "$steps"; }
  # The seconds a step may take: its own limit, or what is left before
  # DEADLINE (less a reserve for the summary), whichever is less.
  budget() {
    local own=$1 left
    [ -z "${DEADLINE:-}" ] && { echo "$own"; return; }
    left=$((DEADLINE - $(date +%s) - 10))
    [ "$left" -lt "$own" ] && own=$left
    echo "$own"
  }
  if [ ! -x "$DC/bin/kvtier" ] || [ ! -x "$DC/bin/kvtierd" ]; then
    echo "device-check: FAIL ($device) ran: nothing; failed: no prebuilt binaries in $DC/bin (run --prepare first, and carry target/device-check); not run: every step"
    return 1
  fi
  export KVTIER_TEST_TMPDIR="$WORK/tmp"
  rm -rf "$KVTIER_TEST_TMPDIR" && mkdir -p "$KVTIER_TEST_TMPDIR"
  note "== device-check $(date -u +%FT%TZ) on $(hostname), device $device, $(cat "$DC/BUILD" 2>/dev/null)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$sum"
  else
    note "nvidia-smi: absent"
  fi
  if [ -e /proc/driver/nvidia-fs ] || grep -q '^nvidia_fs ' /proc/modules 2>/dev/null; then
    note "nvidia-fs: loaded (cuFile can read NVMe straight into HBM)"
  else
    note "nvidia-fs: not loaded (cuFile, where it opens, runs in compatibility mode)"
  fi
  local t
  if [ $cpu = 1 ]; then
    record not_run "gds test binaries" "cpu mode: cargo test runs them"
  else
    for t in "$DC"/bin/test-*; do
      [ -x "$t" ] || continue
      local name=${t##*/test-} lim
      lim=$(budget 60)
      if [ "$lim" -le 0 ]; then record not_run "tests/$name" "out of time (DEADLINE)"; continue; fi
      echo "== tests: $name"
      if KVTIER_REQUIRE_GPU=1 timeout --kill-after=5 "$lim" "$t" --test-threads=1 --nocapture >"$logs/test-$name.log" 2>&1; then
        note "PASS tests/$name ($(grep -c '\.\.\. ok' "$logs/test-$name.log") ok)"
        record ok "tests/$name" "$(grep -c '\.\.\. ok' "$logs/test-$name.log") ok"
      else
        note "FAIL tests/$name (log: test-$name.log)"
        record fail "tests/$name" "$(grep -E 'panicked|FAILED|error' "$logs/test-$name.log" | head -3)"
        tail -30 "$logs/test-$name.log"
      fi
      grep -E "SKIP|NOTE|h2d pinned|Direct fell back|probe:" "$logs/test-$name.log" | sort -u | tee -a "$sum"
      # What a test left out (the Direct plan where cuFile is absent) is
      # said in the last line too.
      local skipped
      while read -r skipped; do
        record not_run "tests/$name part" "$skipped"
      done < <(grep -oE "SKIP: .*" "$logs/test-$name.log" | sort -u)
    done
  fi
  local common=(bench gds --blocks "$blocks" --block-size "${BLOCK_SIZE:-2MiB}" --rounds "$rounds" --dir "$KVTIER_TEST_TMPDIR" --json)
  local variants=("device" "device --no-gds" "device --no-gds --lanes 4" "device --skip-direct-verify" "pinned --lanes 4" "host --lanes 4")
  [ $cpu = 1 ] && variants=("device --lanes 2" "host --lanes 2")
  local variant
  for variant in "${variants[@]}"; do
    local tag=${variant// /} lim
    lim=$(budget 40)
    if [ "$lim" -le 0 ]; then record not_run "bench --dest $variant" "out of time (DEADLINE)"; continue; fi
    echo "== kvtier bench gds --dest $variant"
    # shellcheck disable=SC2086
    if ! timeout --kill-after=5 "$lim" "$DC/bin/kvtier" "${common[@]}" --dest $variant >"$logs/bench-$tag.json" 2>"$logs/bench-$tag.err"; then
      note "FAIL bench --dest $variant: $(tail -3 "$logs/bench-$tag.err")"
      record fail "bench --dest $variant" "$(tail -3 "$logs/bench-$tag.err")"
      continue
    fi
    local why
    why=$(python3 - "$logs/bench-$tag.json" "$variant" "$device" <<'PY' 2>&1 | tee -a "$sum" | tail -1
import json, sys
r = json.load(open(sys.argv[1]))
variant, device = sys.argv[2], sys.argv[3]
keys = ["route", "fallbacks", "onboard_gbps", "onboard_gbps_baseline", "onboard_gbps_vs_baseline",
        "h2d_pinned_gbps", "device_onboard_gbps_baseline", "device_onboard_gbps_vs_baseline",
        "checksum_one_core_gbps", "page_cache_dropped", "dest_emulated", "capabilities"]
print("bench --dest %-16s " % variant + " ".join(
    "%s=%s" % (k, round(r[k], 3) if isinstance(r[k], float) else r[k]) for k in keys if k in r))
# On a GPU machine an emulated destination means the GPU was not used.
if device == "cuda" and variant.split()[0] in ("device", "pinned") and r.get("dest_emulated"):
    print(f"FAIL: the destination was emulated on a GPU machine ({r.get('capabilities')})")
PY
    )
    case "$why" in
      FAIL*) record fail "bench --dest $variant" "${why#FAIL: }" ;;
      *) record ok "bench --dest $variant" "" ;;
    esac
  done
  echo "== python: kvtier round trip into $device memory (torch)"
  local whl lim
  whl=$(ls "$DC"/wheel/kvtier-*.whl 2>/dev/null | head -1)
  # shellcheck source=gds/scripts/python-beside.sh
  . "$ROOT/gds/scripts/python-beside.sh"
  lim=$(budget 90)
  if [ "$lim" -le 0 ]; then
    record not_run "python $device round trip" "out of time (DEADLINE)"
  elif ! kv_python "$device" "$WORK/pysite" "$whl"; then
    note "FAIL python $device round trip: $KV_PY_WHY"
    record fail "python $device round trip" "$KV_PY_WHY"
  else
    note "python: $KV_PY_INFO"
    if timeout --kill-after=5 "$lim" "$KV_PY" gds/scripts/device_check_py.py "$DC/bin/kvtierd" "$KVTIER_TEST_TMPDIR/py" \
        "$py_blocks" 2097152 "$device" >"$logs/python-device.json" 2>"$logs/python-device.err" \
        && grep -q '"roundtrip_device": "ok"' "$logs/python-device.json"; then
      note "python $device: $(cat "$logs/python-device.json")"
      record ok "python $device round trip" ""
    else
      note "FAIL python $device round trip: $(tail -5 "$logs/python-device.err")"
      record fail "python $device round trip" "$(tail -3 "$logs/python-device.err")"
    fi
  fi
  rm -rf "$KVTIER_TEST_TMPDIR"
  # The JSON of it all, and the last line: what ran, failed, did not run.
  local last
  last=$(python3 - "$logs" "$device" "$out/device-check.json" <<'PY'
import glob, json, os, sys
logs, device, dest = sys.argv[1:]
steps = [l.rstrip("\n").split("\t") for l in open(os.path.join(logs, "steps.tsv")) if l.strip()]
doc = {"check": "device", "device": device,
       "ran": [n for s, n, _ in steps if s == "ok"],
       "failed": [{"step": n, "why": d} for s, n, d in steps if s == "fail"],
       "not_run": [{"step": n, "why": d} for s, n, d in steps if s == "not_run"],
       "bench": {}, "python": None}
doc["ok"] = not doc["failed"] and bool(doc["ran"])
for f in sorted(glob.glob(os.path.join(logs, "bench-*.json"))):
    try: doc["bench"][os.path.basename(f)[6:-5]] = json.load(open(f))
    except ValueError: pass
try: doc["python"] = json.load(open(os.path.join(logs, "python-device.json")))
except (OSError, ValueError): pass
json.dump(doc, open(dest, "w"), indent=1)
print(f"device-check: {'OK' if doc['ok'] else 'FAIL'} ({device}) ran: {', '.join(doc['ran']) or 'nothing'}"
      + "".join(f"; failed: {f['step']} ({f['why']})" for f in doc["failed"])
      + "; not run: " + ("; ".join(f"{n['step']} ({n['why']})" for n in doc["not_run"]) or "none"))
sys.exit(0 if doc["ok"] else 1)
PY
  )
  local rc=$?
  cp "$sum" "$out/device-check-summary.txt"
  echo
  echo "== summary"
  cat "$sum"
  echo "$last"
  return $rc
}

case "$mode" in
  --prepare) prepare ;;
  --prebuilt) prebuilt ;;
  --size-check) size_check ;;
  all) prepare && prebuilt ;;
esac
