#!/usr/bin/env bash
# Runs every kvtier benchmark and regenerates the table that opens
# docs/BENCHMARKS.md (machine, date and command in it): a compact table
# (scripts/bench_table.py; at most 40 rows), and every figure of the run
# with its per-round range in table-full.md beside the JSON. Every figure
# is a ratio to a baseline measured in the same invocation
# (../shared/BENCH.md).
#
#   scripts/bench-table.sh            # full: 5 rounds, 256 MiB per round
#   scripts/bench-table.sh --quick    # 5 rounds, 32 MiB per round (~15 min here)
#   scripts/bench-table.sh --tiny     # contract check only (CI): 1 round, tiny
#                                     # sizes, table written to --out, not the docs
# Options: --out DIR (JSON and table; default target/bench-table),
#   --bin DIR (kvtier and kvtierd; default target/release),
#   --no-docs (leave docs/BENCHMARKS.md alone), --only LIST (comma list of
#   io,io_flush,io_fd,checksum,g3,fs,g4,crossnode,peers,replay).
#
# Build first: cargo build --release -p kvtier-daemon -p kvtier-tools
# Root is needed for cold reads (page cache dropped) and bench fs (FUSE).
# Peers: only with a release foyer (cargo build --release --manifest-path
# tools/peers/Cargo.toml); a debug one would flatter kvtier.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=full out=target/bench-table bin=target/release docs=1 only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) mode=quick ;;
    --tiny) mode=tiny; docs=0 ;;
    --full) mode=full ;;
    --out) out="$2"; shift ;;
    --bin) bin="$2"; shift ;;
    --no-docs) docs=0 ;;
    --only) only="$2"; shift ;;
    *) echo "usage: $0 [--quick|--tiny|--full] [--out DIR] [--bin DIR] [--no-docs] [--only LIST]" >&2; exit 2 ;;
  esac
  shift
done
kvtier="$bin/kvtier"
[ -x "$kvtier" ] && [ -x "$bin/kvtierd" ] || { echo "no $kvtier / $bin/kvtierd: build them first" >&2; exit 2; }
case $mode in
  full)  sizes="64KiB 256KiB 2MiB 16MiB"; clients="1 4 16"; rounds=5; bytes=$((256 << 20)); small=0 ;;
  quick) sizes="64KiB 256KiB 2MiB 16MiB"; clients="1 4 16"; rounds=5; bytes=$((32 << 20)); small=0 ;;
  tiny)  sizes="64KiB"; clients="1 2"; rounds=1; bytes=$((1 << 20)); small=1 ;;
esac
rm -rf "$out"; mkdir -p "$out/json" "$out/work"
work="$(cd "$out/work" && pwd)"
manifest="$out/manifest.tsv"
: > "$manifest"
foyer=tools/peers/target/release/kvtier-bench-foyer
# G4 and crossnode start a local S3 server (SeaweedFS, scripts/setup.sh).
if [ -z "${KVTIER_WEED:-}" ] && [ -x .venv/bin/weed ]; then export KVTIER_WEED="$PWD/.venv/bin/weed"; fi
want() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }
bytes_of() { case "$1" in *KiB) echo $(( ${1%KiB} << 10 ));; *MiB) echo $(( ${1%MiB} << 20 ));; esac; }
# blocks SIZE MIN: a round's blocks (bytes per round, at least MIN)
blocks() { local n=$(( bytes / $(bytes_of "$1") )); [ "$n" -lt "$2" ] && n=$2; echo "$n"; }
# run NAME BENCH VARIANT SIZE CLIENTS -- ARGS...: one invocation, its JSON
# (or its error) recorded in the manifest. Env for kvtierd goes before.
run() {
  local name=$1 bench=$2 variant=$3 size=$4 nclients=$5; shift 6
  local f="$out/json/$name.json" t0=$SECONDS
  echo "== $name: kvtier $*" >&2
  if nice -n 0 "$@" > "$f" 2> "$out/json/$name.err"; then
    printf '%s\t%s\t%s\t%s\t%s\tok\t%s\n' "$name" "$bench" "$variant" "$size" "$nclients" "$((SECONDS - t0))" >> "$manifest"
  else
    printf '%s\t%s\t%s\t%s\t%s\tfailed\t%s\n' "$name" "$bench" "$variant" "$size" "$nclients" "$((SECONDS - t0))" >> "$manifest"
    tail -3 "$out/json/$name.err" >&2
  fi
}
# skip BENCH VARIANT SIZE CLIENTS WHY: a bench this run could not run,
# named in the table (never silently absent).
skip() {
  printf '%s\t%s\t%s\t%s\t%s\tskipped\t0\t%s\n' "$1-skipped" "$1" "$2" "$3" "$4" "$5" >> "$manifest"
}
start=$(date -u +%Y-%m-%dT%H:%MZ)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for s in $sizes; do
  for c in $clients; do
    n=$(blocks "$s" $((c * 2)))
    depth=8; [ "$small" = 1 ] && depth=2
    if want io; then
      run "io-$s-c$c" io per_block "$s" "$c" -- "$kvtier" bench io --block-size "$s" --blocks "$n" \
        --depth $depth --clients "$c" --rounds $rounds --dir "$work" --json
    fi
    # The opt-in group data flush (one syncfs per window), right after the
    # default run above (same size, same clients).
    if want io_flush && [ "$c" = "$(echo $clients | cut -d' ' -f2)" ]; then
      run "io-group-$s-c$c" io group "$s" "$c" -- env KVTIERD_G3_DATA_FLUSH=group \
        "$kvtier" bench io --block-size "$s" --blocks "$n" --depth $depth --clients "$c" \
        --rounds $rounds --dir "$work" --json
    fi
    if want io_fd && [ "$c" = "$(echo $clients | cut -d' ' -f2)" ]; then
      run "io-fd-$s-c$c" io direct_fd "$s" "$c" -- "$kvtier" bench io --block-size "$s" \
        --blocks "$n" --depth $depth --clients "$c" --rounds $rounds --dir "$work" --direct-read --json
    fi
    if want peers && [ ! -x "$foyer" ] && [ "$s$c" = "$(echo $sizes | cut -d' ' -f1)$(echo $clients | cut -d' ' -f1)" ]; then
      skip peers "kvtier/foyer" all all "no release foyer at $foyer (cargo build --release --manifest-path tools/peers/Cargo.toml)"
    fi
    if want peers && [ -x "$foyer" ]; then
      run "peers-$s-c$c" peers "kvtier/foyer" "$s" "$c" -- "$kvtier" bench peers --dir "$work/peers" \
        --foyer-bin "$foyer" --block-size "$s" --blocks "$n" --clients "$c" --depth 4 \
        --rounds $rounds --skip mooncake --json
    fi
  done
  n=$(blocks "$s" 16)
  if want checksum; then
    run "checksum-$s" checksum one_core "$s" - -- "$kvtier" bench checksum --sizes "$s" \
      --bytes-per-round $(( bytes * 4 )) --rounds $rounds --json
  fi
  if want g3; then
    run "g3-$s" g3 per_block "$s" - -- "$kvtier" bench g3 --dir "$work" --block-size "$s" --blocks "$n" \
      --depth 8 --rounds $rounds --lookup-blocks 1000 --recovery-blocks 64 --pool-blocks 16 \
      --clean-restart-blocks 1000 --json
  fi
  if want fs; then
    run "fs-$s" fs mount "$s" - -- "$kvtier" bench fs --dir "$work" --block-size "$s" --blocks "$n" \
      --rounds $rounds --json
  fi
  if want crossnode; then
    run "crossnode-$s" crossnode peer_fetch "$s" - -- "$kvtier" bench crossnode --block-size "$s" \
      --blocks "$n" --rounds $rounds --json
  fi
done
if want g4; then
  n=8; [ "$small" = 1 ] && n=2
  for r in $(seq 1 $rounds); do
    run "g4-r$r" g4 object_store "2MiB,16MiB" - -- "$kvtier" bench g4 --blocks $n --json
  done
fi
trace=../shared/workloads/mooncake/conversation_trace.jsonl
[ -f "$trace" ] || trace=/work/shared/workloads/mooncake/conversation_trace.jsonl
if want replay && [ ! -f "$trace" ]; then
  skip replay real_kvtierd 64KiB 1 "no Mooncake trace at $trace"
fi
if want replay && [ -f "$trace" ]; then
  reqs=2000; [ "$small" = 1 ] && reqs=50
  run "replay-64KiB" replay real_kvtierd 64KiB 1 -- "$kvtier" bench replay --trace "$trace" \
    --max-requests $reqs --block-size 64KiB --capacity-fraction 0.1 --dir "$work" --json
fi
end=$(date -u +%Y-%m-%dT%H:%MZ)
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
machine="$(nproc) vCPU, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(df -T "$work" | awk 'NR==2 {print $1 " " $2}'), kernel $(uname -r)"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
python3 scripts/bench_table.py --out "$out" --mode "$mode" --start "$start" --end "$end" \
  --machine "$machine" --load "$load_before -> $load_after" --commit "$commit" \
  --command "scripts/bench-table.sh${mode:+ --$mode}" \
  $([ "$docs" = 1 ] && echo --docs docs/BENCHMARKS.md)
rc=$?
rm -rf "$work"
exit $rc
