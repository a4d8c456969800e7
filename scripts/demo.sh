#!/usr/bin/env bash
# Quickstart: build kvtierd and the kvtier tool, then show an
# offload / lookup / onboard round trip. `kvtier demo` starts kvtierd on the
# embedded default in a temporary directory unless one already runs on
# $KVTIER_SOCKET (or the default socket).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p kvtier-daemon --bin kvtierd -p kvtier-tools --bin kvtier
exec ./target/debug/kvtier demo "$@"
