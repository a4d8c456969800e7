#!/usr/bin/env bash
# Quickstart: build kvtierd and the kvtier tool, then show an
# offload / lookup / onboard round trip. `kvtier demo` starts kvtierd on the
# embedded default in a temporary directory unless one already runs on
# $KVTIER_SOCKET (or the default socket).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x target/debug/kvtierd ] || [ ! -x target/debug/kvtier ]; then
  # Said up front: a cold build prints nothing useful for minutes otherwise.
  echo "== building kvtierd and kvtier (cargo build, debug profile): 10 to 20 min on a 2-core machine the first time, seconds after" >&2
fi
t0=$SECONDS
# cargo's own progress (it prints a line per crate compiled) on stderr.
if ! cargo build -p kvtier-daemon --bin kvtierd -p kvtier-tools --bin kvtier; then
  echo "demo: the build failed (above)" >&2
  exit 1
fi
echo "== built in $((SECONDS - t0)) s; running kvtier demo" >&2
exec ./target/debug/kvtier demo "$@"
