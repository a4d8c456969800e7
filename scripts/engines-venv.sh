#!/usr/bin/env bash
# The venv the engine connector tests (client/python/tests_engines) run in:
# torch 2.14.1 with its CUDA wheels (it imports without a GPU), vllm 0.33.0,
# sglang 0.5.23 and lmcache 0.5.6, and the small packages their interface
# modules import, all pinned in scripts/engines-requirements.txt and
# installed with --no-deps (the engines' full dependency sets are neither
# needed nor installable together). Created once and cached under
# target/engines-venv (or $KVTIER_ENGINES_VENV); recreated when the
# requirements change. Prints the venv's path. Measured on a 2-core machine:
# about 4 min and 9.4 GB cold, instant when cached.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVTIER_ENGINES_VENV:-$PWD/target/engines-venv}"
REQ=scripts/engines-requirements.txt
STAMP="$VENV/.kvtier-requirements-$(sha256sum "$REQ" | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # --no-compile: byte-compiling ~34k files of which the tests import a
  # few is CPU the Rust build running beside it needs; --no-cache-dir: a
  # second 4 GB copy of the wheels helps nobody on a fresh machine.
  "$VENV/bin/pip" install -q --no-deps --no-compile --no-cache-dir -r "$REQ" >&2
  touch "$STAMP"
fi
echo "$VENV"
