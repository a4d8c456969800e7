#!/usr/bin/env bash
# The whole test suite, from a clean clone on a fresh Debian machine with Rust.
# Installs what the tests need (fuse3, attr, the S3 test server), then runs
# formatting, lints and every test. Used by .ci/run and the README.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# The engines' venv (torch, vLLM, SGLang, LMCache; minutes of downloads on
# a cold machine) installs in the background while the Rust steps use the
# CPUs; the Python step waits for it.
mkdir -p target
./scripts/engines-venv.sh > target/engines-venv.out 2>&1 &
engines_venv_pid=$!
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
# The workspace test build also builds kvtierd and kvtier; the end-to-end
# suites use those binaries instead of rebuilding them with other features.
KVTIER_TEST_PREBUILT_BINS=1 cargo test --workspace --no-fail-fast -- --test-threads=2
echo "== Dynamo oracle (tests/dynamo-oracle: Dynamo's own crates, own lock file and target dir)"
# Outside the workspace: dynamo-kv-router pins tokio =1.52.4. Its tests run
# the kvtier and kvtierd binaries the workspace test build just made.
cargo fmt --manifest-path tests/dynamo-oracle/Cargo.toml --all -- --check
KVTIER_BIN_DIR="$PWD/target/debug" cargo test --manifest-path tests/dynamo-oracle/Cargo.toml -- --test-threads=2
echo "== deployment artefacts (systemd unit, container build file, Kubernetes manifest)"
./scripts/check-deploy.sh target/debug/kvtierd
echo "== python package (client/python: pytest against real kvtierd)"
if ! wait "$engines_venv_pid"; then
  echo "the engines' venv (scripts/engines-venv.sh) failed to install:" >&2
  cat target/engines-venv.out >&2
  exit 1
fi
./scripts/test-python.sh
