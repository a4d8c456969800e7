#!/usr/bin/env bash
# The whole test suite, from a clean clone on a fresh Debian machine with Rust.
# Installs what the tests need (fuse3, attr, the S3 test server), then runs
# formatting, lints and every test. Used by .ci/run and the README.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
# The workspace test build also builds kvtierd and kvtier; the end-to-end
# suites use those binaries instead of rebuilding them with other features.
KVTIER_TEST_PREBUILT_BINS=1 cargo test --workspace --no-fail-fast -- --test-threads=2
echo "== deployment artefacts (systemd unit, container build file, Kubernetes manifest)"
./scripts/check-deploy.sh target/debug/kvtierd
