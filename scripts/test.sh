#!/usr/bin/env bash
# The whole test suite, from a clean clone on a fresh Debian machine with Rust.
# Installs what the tests need (fuse3, attr, the S3 test server), then runs
# formatting, lints and every test. Used by .ci/run and the README.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
step() { echo "== [$((SECONDS - t0))s] $*"; }
trap 'echo "== [$((SECONDS - t0))s] done (rc=$?)"' EXIT
# The disk first: the suite needs about 25 GB (the engines' venv 9.4 GB,
# the Rust targets, the peers' build, a Debian root for the systemd check);
# a run that stops on ENOSPC in the middle of a compile says little.
df -h . /tmp 2>/dev/null || true
# No incremental compilation: a clean clone builds once, and the incremental
# caches beside the debug build were gigabytes that no later build reads.
export CARGO_INCREMENTAL=0
./scripts/setup.sh
# The engines' venv (torch, vLLM, SGLang, LMCache; minutes of downloads on
# a cold machine) installs in the background, at low priority, while the
# Rust steps use the CPUs; the Python step waits for it.
mkdir -p target
nice -n 19 ./scripts/engines-venv.sh > target/engines-venv.out 2>&1 &
engines_venv_pid=$!
step "cargo fmt --check"
cargo fmt --all -- --check
# Clippy and the test build in one compile: clippy-driver (what `cargo
# clippy` runs) stands in for rustc on the workspace's own crates, so the
# lints of `cargo clippy --workspace --all-targets -- -D warnings` fail the
# build while it also produces the test binaries, and the dependencies are
# compiled once instead of checked and then built (minutes on 2 cores).
# `cargo test` builds every target `--all-targets` checks (the workspace has
# no benches or examples). Exported so that every later cargo of this run
# (the Python package's build) sees the same compiler and reuses the build.
clippy_driver="$(rustc --print sysroot)/bin/clippy-driver"
if [ -x "$clippy_driver" ]; then
  export RUSTC_WORKSPACE_WRAPPER="$clippy_driver"
  export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
  step "cargo clippy (-D warnings) and the test build, in one compile"
else
  step "cargo clippy (no clippy-driver beside rustc: a separate pass)"
  cargo clippy --workspace --all-targets -- -D warnings
  step "cargo test build"
fi
# The workspace test build also builds kvtierd and kvtier; the end-to-end
# suites use those binaries instead of rebuilding them with other features.
export KVTIER_TEST_PREBUILT_BINS=1
cargo test --workspace --no-run
# The Dynamo oracle (outside the workspace: dynamo-kv-router pins tokio
# =1.52.4) compiles in its own target dir beside the workspace's test run,
# which waits on daemons and disks more than it computes. Not linted by
# clippy-driver: it is a test oracle, not product code.
step "Dynamo oracle build (background, tests/dynamo-oracle: Dynamo's own crates, own lock file and target dir)"
cargo fmt --manifest-path tests/dynamo-oracle/Cargo.toml --all -- --check
nice -n 10 env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS cargo test --manifest-path tests/dynamo-oracle/Cargo.toml --no-run \
  > target/dynamo-oracle-build.out 2>&1 &
oracle_build_pid=$!
# The peers of `kvtier bench peers` (tools/peers: foyer, own lock file and
# target dir, so foyer never enters the product's build) compile the same
# way, beside the oracle's build (niced); Mooncake's wheel
# installs beside them.
# The suite runs it at a tiny size, where only its checks count (lost
# blocks, the JSON contract), not its figures: foyer's crate graph builds
# unoptimised here, which takes minutes less than the opt-level 2 that
# tools/peers/Cargo.toml sets for measuring.
step "bench peers build (background, tools/peers: foyer; Mooncake's venv)"
cargo fmt --manifest-path tools/peers/Cargo.toml --all -- --check
peers_cargo=(env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS cargo --config 'profile.dev.package."*".opt-level=0')
( nice -n 10 "${peers_cargo[@]}" test --manifest-path tools/peers/Cargo.toml --no-run \
  && { nice -n 10 ./scripts/peers-venv.sh \
       || echo "warning: Mooncake's venv did not install; bench peers reports Mooncake skipped"; } \
) > target/peers-build.out 2>&1 &
peers_build_pid=$!
step "cargo test"
cargo test --workspace --no-fail-fast -- --test-threads=2
step "Dynamo oracle tests"
if ! wait "$oracle_build_pid"; then
  echo "the Dynamo oracle failed to build:" >&2
  cat target/dynamo-oracle-build.out >&2
  exit 1
fi
# Its tests run the kvtier and kvtierd binaries the workspace build made.
KVTIER_BIN_DIR="$PWD/target/debug" env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS \
  cargo test --manifest-path tests/dynamo-oracle/Cargo.toml -- --test-threads=2
step "kvtier bench peers at a tiny size (tools/peers: kvtier, foyer, Mooncake)"
if ! wait "$peers_build_pid"; then
  echo "the bench peers build failed:" >&2
  cat target/peers-build.out >&2
  exit 1
fi
KVTIER_BIN_DIR="$PWD/target/debug" "${peers_cargo[@]}" test --manifest-path tools/peers/Cargo.toml
step "bench table at a tiny size (scripts/bench-table.sh --tiny: io, the group flush variant, checksum, g3; JSON contract, 0 lost)"
./scripts/bench-table.sh --tiny --bin target/debug --out target/bench-table-tiny --only io,io_flush,checksum,g3
# kvtierd as it ships: the daemon built alone, without the testkit/bench
# features the test crates turned on above (cargo unifies features within
# one run). Fails if product code needs test or bench scaffolding; the
# deployment checks below, the systemd boot and the Python suites then run
# this very binary.
step "kvtierd as shipped (cargo build -p kvtier-daemon --bin kvtierd: no testkit/bench features)"
cargo build -p kvtier-daemon --bin kvtierd
step "deployment artefacts (systemd unit, container build file, Kubernetes manifest)"
./scripts/check-deploy.sh target/debug/kvtierd
step "the systemd unit under a booted systemd (Debian in systemd-nspawn; the first run builds its root file system, about a minute)"
./scripts/systemd-boot-check.sh target/debug/kvtierd target/debug/kvtier
step "documentation examples (README.md, docs/OPERATIONS.md: the blocks marked <!-- ci: ... -->)"
python3 scripts/doc_examples.py target/debug README.md docs/OPERATIONS.md
# The check can fail: a marked block that fails is reported as a failure.
printf '<!-- ci: run -->\n```sh\nkvtierd --no-such-flag\n```\n' > target/doc-example-fails.md
if python3 scripts/doc_examples.py target/debug target/doc-example-fails.md > /dev/null; then
  echo "scripts/doc_examples.py passed a failing example" >&2
  exit 1
fi
printf '```\nweed mini -dir=x\n```\n<!-- ci: run -->\n```sh\ntrue\n```\n' > target/doc-weed-fails.md
if python3 scripts/doc_examples.py target/debug target/doc-weed-fails.md > /dev/null; then
  echo "scripts/doc_examples.py passed a weed command that binds 0.0.0.0 with telemetry on" >&2
  exit 1
fi
step "python package (client/python: pytest against real kvtierd)"
if ! wait "$engines_venv_pid"; then
  echo "the engines' venv (scripts/engines-venv.sh) failed to install:" >&2
  cat target/engines-venv.out >&2
  exit 1
fi
./scripts/test-python.sh
# The GPU run's scripts on CPU (the GPU run itself needs a lent machine; see
# docs/OPERATIONS.md, "The GPU run"): the carried folder's size with the
# checkout, a venv-from-venv setup like the GPU machine's, device-check and
# ttft-check with --device cpu, and negative controls that must fail.
step "GPU run scripts on CPU (gds/scripts/cpu-check.sh)"
./gds/scripts/cpu-check.sh
