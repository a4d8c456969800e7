#!/usr/bin/env bash
# The Python package's suite (client/python): installs maturin, pytest, numpy
# and hypothesis into ./.venv, builds and installs the package from the
# checkout with one pip command (a dev-profile build into the workspace's
# target dir, so it reuses what `cargo test --workspace` compiled), and runs
# pytest against real kvtierd processes (target/debug/kvtierd).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q 'maturin>=1.7,<2' pytest numpy hypothesis
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
[ -x "$CARGO_TARGET_DIR/debug/kvtierd" ] || cargo build -q -p kvtier-daemon --bin kvtierd
[ -x "$CARGO_TARGET_DIR/debug/kvtier" ] || cargo build -q -p kvtier-tools --bin kvtier
# One build, the user's way (pip's PEP 517 build through maturin), into a
# wheel that both venvs install: the package is abi3, and every PEP 517
# build pays about 30 s for its isolated build environment.
wheels="$CARGO_TARGET_DIR/wheels/test-python"
rm -rf "$wheels"
MATURIN_PEP517_ARGS="--profile dev" .venv/bin/pip wheel -q --no-deps -w "$wheels" ./client/python
whl="$(ls "$wheels"/kvtier-*.whl)"
.venv/bin/pip install -q --force-reinstall --no-deps "$whl"
# The engine connectors' suite runs in the engines' venv (vLLM, SGLang,
# LMCache at pinned versions; scripts/engines-venv.sh caches it). A venv
# that cannot be installed fails the run: these tests never skip.
EV="$(./scripts/engines-venv.sh)"
"$EV/bin/python" -m pip install -q --force-reinstall --no-deps "$whl"
cd client/python
rc=0
../../.venv/bin/python -m pytest -q -p no:cacheprovider tests || rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: the Python suite is missing" >&2
  exit 1
fi
erc=0
"$EV/bin/python" -m pytest -q -p no:cacheprovider tests_engines || erc=$?
if [ "$erc" = 5 ]; then
  echo "pytest collected no tests: the engine connector suite is missing" >&2
  exit 1
fi
[ "$rc" = 0 ] || exit "$rc"
exit "$erc"
