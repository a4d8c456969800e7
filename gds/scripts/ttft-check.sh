#!/usr/bin/env bash
# What loading KV from kvtier beats recomputing it by, with kvtier's own
# bytes proven: a randomly initialised transformers Llama prefills a prompt,
# its KV is offloaded to a kvtierd on local disk, then time to first token
# with the KV onboarded into a NaN-filled destination is set against a full
# prefill, beside a plain copy of the same bytes (pinned host -> device on a
# GPU), at each prompt size (gds/scripts/ttft_check.py says exactly what is
# timed and checked).
#
#   gds/scripts/device-check.sh --prepare      # builds kvtierd + the wheel
#                                              # into target/device-check/
#   gds/scripts/ttft-check.sh [--device cuda|cpu|auto] [--route any|two_hop|direct]
#                             [--fault onboard-elsewhere]
#
# --device: cuda (the GPU run; a machine without torch's CUDA fails, it
# never skips), cpu (CI: a tiny model, host memory standing in for HBM
# through the same kvtier-gds pipeline), auto (default: cuda where
# nvidia-smi lists a GPU). --route two_hop sets KVTIER_GDS=off (the pinned
# bounce path); direct wants GPUDirect Storage (cuFile, its compatibility
# mode included: the JSON's cufile_mode says which). --fault
# onboard-elsewhere is the negative control: the onboard lands in a scratch
# buffer, and this check must fail.
#
# The interpreter is $PYTHON or `python3` on PATH, used as it is (no venv:
# see python-beside.sh), with the wheel installed beside it.
#
# Env: PROMPT_TOKENS (comma list; default 8192,32768,131072 on cuda, 400
# on cpu), ROUNDS (default 3 on cuda, 2 on cpu), OUT (results folder,
# default target/device-work/results), TTFT_TIMEOUT (seconds, default 240).
# Writes $OUT/ttft-<device>-<route>[-<fault>].jsonl: one JSON line per size,
# then the summary line; prints them, then one last line saying what ran,
# what failed and what did not run. Exit 0 only when it all passed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$(pwd)
DC=${KVTIER_DEVICE_CHECK_DIR:-$ROOT/target/device-check}
WORK=${KVTIER_DEVICE_WORK:-$ROOT/target/device-work}
device=auto route=any fault=
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --route) route=$2; shift 2 ;;
    --fault) fault=$2; shift 2 ;;
    *) echo "usage: $0 [--device cuda|cpu|auto] [--route any|two_hop|direct] [--fault onboard-elsewhere]" >&2; exit 2 ;;
  esac
done
if [ "$device" = auto ]; then
  device=cpu
  nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && device=cuda
fi
case "$device" in cuda|cpu) ;; *) echo "--device: cuda, cpu or auto" >&2; exit 2 ;; esac
if [ "$device" = cuda ]; then tokens=${PROMPT_TOKENS:-8192,32768,131072} rounds=${ROUNDS:-3}
else tokens=${PROMPT_TOKENS:-400} rounds=${ROUNDS:-2}; fi
out=${OUT:-$WORK/results}
tag="ttft-$device-$route${fault:+-$fault}"
mkdir -p "$out" "$WORK"
jsonl="$out/$tag.jsonl"
: > "$jsonl"
json_str() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr '\n\t' '  ')"; }

# shellcheck source=gds/scripts/python-beside.sh
. "$ROOT/gds/scripts/python-beside.sh"
whl=$(ls "$DC"/wheel/kvtier-*.whl 2>/dev/null | head -1)
if [ ! -x "$DC/bin/kvtierd" ]; then
  KV_PY_WHY="no $DC/bin/kvtierd: run gds/scripts/device-check.sh --prepare (and carry target/device-check)"
elif kv_python "$device" "$WORK/pysite" "$whl"; then
  KV_PY_WHY=""
fi
if [ -n "$KV_PY_WHY" ]; then
  printf '{"check": "ttft", "ok": false, "device": "%s", "failed": [{"tokens": null, "why": %s}], "ran": [], "not_run": []}\n' \
    "$device" "$(json_str "$KV_PY_WHY")" | tee "$jsonl"
  echo "ttft-check: FAIL ($device, route $route) ran: nothing; not run: $tokens tokens, because: $KV_PY_WHY"
  exit 1
fi
echo "ttft: $KV_PY_INFO" >&2
case "$route" in
  two_hop) export KVTIER_GDS=off ;;
  direct) unset KVTIER_GDS ;;
esac
[ "$device" = cpu ] && export KVTIER_PY_HOST_VIA_GDS=1
rm -rf "$WORK/ttft"
t0=$SECONDS
timeout --kill-after=10 "${TTFT_TIMEOUT:-240}" "$KV_PY" gds/scripts/ttft_check.py \
  --kvtierd "$DC/bin/kvtierd" --work "$WORK/ttft" --device "$device" --tokens "$tokens" \
  --rounds "$rounds" --route "$route" ${fault:+--fault "$fault"} | tee "$jsonl"
rc=${PIPESTATUS[0]}
rm -rf "$WORK/ttft"
# The last line: what ran, what failed, what did not (a timeout or a crash
# leaves the sizes that completed and says where it stopped).
"$KV_PY" - "$jsonl" "$rc" "$((SECONDS - t0))" "$device" "$route" "$tokens" "$fault" <<'PY'
import json, sys
path, rc, secs, device, route, tokens, fault = sys.argv[1:]
lines = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
head = f"({device}, route {route}{', fault ' + fault if fault else ''})"
summ = lines[-1] if lines and lines[-1].get("check") == "ttft" else None
sizes = {l["tokens"]: l for l in lines if "ttft_kvtier_ms" in l}
def ran(l):
    return (f"{l['tokens']} tokens (ttft kvtier {l['ttft_kvtier_ms']} ms vs recompute {l['ttft_recompute_ms']} ms, "
            f"x{l['speedup_vs_recompute']}; onboard {l['onboard_gbps']} GB/s {'/'.join(l['onboard_routes'])} vs "
            f"{l['baseline']} {l['baseline_gbps']} GB/s)")
if summ is None:
    why = f"timed out after {secs}s" if rc in ("124", "137") else f"exited {rc} without a summary"
    print(f"ttft-check: FAIL {head} {why}; ran: {', '.join(ran(l) for l in sizes.values()) or 'nothing'}; "
          f"not run: {tokens} tokens after the last completed size")
    sys.exit(0)
ok = summ["ok"] and rc == "0"
failed = "; ".join(f"{f['tokens']} tokens: {f['why']}" if f["tokens"] else f["why"] for f in summ["failed"])
not_run = "; ".join(f"{n['tokens']} tokens ({n['why']})" for n in summ["not_run"]) or "none"
print(f"ttft-check: {'OK' if ok else 'FAIL'} {head} ran: {', '.join(ran(l) for l in sizes.values()) or 'nothing'}"
      + (f"; failed: {failed}" if failed else "") + f"; not run: {not_run}"
      + (f"; cufile: {summ['cufile_mode']}" if summ.get("cufile_mode") else ""))
PY
exit "$rc"
