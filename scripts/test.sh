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
cargo test --workspace --no-fail-fast -- --test-threads=2
