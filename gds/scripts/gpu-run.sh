#!/usr/bin/env bash
# The GPU run in one command, for a GPU machine lent briefly and without
# network (docs/OPERATIONS.md, "The GPU run"):
#
#   here:  PROFILE=release gds/scripts/device-check.sh --prepare
#          (stripped release kvtierd, kvtier, kvtier-gds's test binaries
#          and the wheel in target/device-check/, checked to fit 64 MiB
#          with the checkout)
#   there: gds/scripts/gpu-run.sh      (carry target/device-check)
#
# Steps, each under its own timeout, the whole under GPU_RUN_BUDGET_S
# (default 450 s, inside the 8 minutes a run may take):
#   1. ttft two_hop: gds/scripts/ttft-check.sh --device cuda --route two_hop
#      (KVTIER_GDS=off: pinned bounce buffers), 8K, 32K and 128K tokens as
#      memory allows                                           (<= 170 s)
#   2. device-check: gds/scripts/device-check.sh --prebuilt --device cuda
#      (gds test binaries with KVTIER_REQUIRE_GPU=1, `kvtier bench gds`
#      variants, the Python round trip into device memory)      (<= 150 s)
#   3. ttft direct: the same TTFT check through GPUDirect Storage, where
#      step 2's bench found cuFile (`gds: present`; compatibility mode
#      counts, and cufile_mode says so); else reported not run with the
#      probe's reason                                            (the rest)
# Any skip on the GPU machine is a failure with its reason. Results under
# $OUT (at most 8 files: gpu-run.json, gpu-run.log, device-check.json,
# device-check-summary.txt, ttft-cuda-two_hop.jsonl, ttft-cuda-direct.jsonl,
# logs.tar.gz); the last line says what ran, what failed, what did not run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$(pwd)
out=${OUT:-$ROOT/target/device-work/gpu-run}
WORK=${KVTIER_DEVICE_WORK:-$ROOT/target/device-work}
export KVTIER_DEVICE_WORK=$WORK
mkdir -p "$out" "$WORK"
t_start=$(date +%s)
end=$((t_start + ${GPU_RUN_BUDGET_S:-450}))
steps="$WORK/gpu-run-steps.tsv"
: > "$steps"
left() { echo $((end - $(date +%s))); }
# step NAME LIMIT CMD...: runs CMD under min(LIMIT, what is left), records
# its exit status, seconds and last line.
step() {
  local name=$1 lim=$2 t0 rc last
  shift 2
  [ "$(left)" -lt "$lim" ] && lim=$(($(left) - 5))
  if [ "$lim" -le 10 ]; then
    printf '%s\tnot_run\t0\tout of time (GPU_RUN_BUDGET_S)\n' "$name" >> "$steps"
    return
  fi
  echo "== [$(($(date +%s) - t_start))s] $name (limit ${lim}s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$lim" "$@" > "$WORK/step.log" 2>&1 &
  wait $! ; rc=$?
  cat "$WORK/step.log"
  last=$(grep -E '^(device-check|ttft-check): ' "$WORK/step.log" | tail -1)
  [ -z "$last" ] && last="exited $rc$( [ $rc = 124 ] && echo " (timed out after ${lim}s)"): $(tail -2 "$WORK/step.log" | tr '\n' ' ')"
  printf '%s\t%s\t%s\t%s\n' "$name" "$([ $rc = 0 ] && echo ok || echo fail)" "$(($(date +%s) - t0))" "$last" >> "$steps"
}

main() {
echo "== gpu-run $(date -u +%FT%TZ) on $(hostname); $(cat target/device-check/BUILD 2>/dev/null || echo 'no target/device-check/BUILD')"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 || echo "nvidia-smi: failed or absent"
echo "python3: $(command -v python3) ($(python3 --version 2>&1)); disk: $(df -h . | tail -1)"
export OUT=$out

TTFT_TIMEOUT=160 step "ttft two_hop" 170 gds/scripts/ttft-check.sh --device cuda --route two_hop
DEADLINE=$(( $(date +%s) + 145 )) step "device-check" 150 gds/scripts/device-check.sh --prebuilt --device cuda
caps=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["bench"]["device"]["capabilities"])' \
  "$out/device-check.json" 2>/dev/null)
case "$caps" in
  *"gds: present"*)
    TTFT_TIMEOUT=$(($(left) - 15)) step "ttft direct" "$(left)" gds/scripts/ttft-check.sh --device cuda --route direct ;;
  "") printf 'ttft direct\tnot_run\t0\tno capabilities from device-check bench --dest device (see device-check.json)\n' >> "$steps" ;;
  *) printf 'ttft direct\tnot_run\t0\tGPUDirect Storage absent: %s\n' "$caps" >> "$steps" ;;
esac

logs=(gpu-run-steps.tsv)
[ -d "$WORK/device-check-logs" ] && logs+=(device-check-logs)
tar -czf "$out/logs.tar.gz" -C "$WORK" "${logs[@]}"
python3 - "$steps" "$out/gpu-run.json" "$(($(date +%s) - t_start))" <<'PY'
import json, sys
steps = [l.rstrip("\n").split("\t", 3) for l in open(sys.argv[1]) if l.strip()]
doc = {"run": "gpu-run", "seconds": int(sys.argv[3]),
       "steps": [{"step": n, "status": s, "seconds": int(t), "last_line": d} for n, s, t, d in steps]}
doc["ok"] = all(s == "ok" or (n == "ttft direct" and s == "not_run") for n, s, _, _ in steps)
json.dump(doc, open(sys.argv[2], "w"), indent=1)
ran = [n for n, s, _, _ in steps if s == "ok"]
failed = [f"{n} ({d})" for n, s, _, d in steps if s == "fail"]
not_run = [f"{n} ({d})" for n, s, _, d in steps if s == "not_run"]
print("\n".join(f"   {n}: {d}" for n, _, _, d in steps))
print(f"gpu-run: {'OK' if doc['ok'] else 'FAIL'} in {doc['seconds']}s; ran: {', '.join(ran) or 'nothing'}"
      + (f"; failed: {'; '.join(failed)}" if failed else "") + f"; not run: {'; '.join(not_run) or 'none'}")
sys.exit(0 if doc["ok"] else 1)
PY
}
main 2>&1 | tee "$out/gpu-run.log"
exit "${PIPESTATUS[0]}"
