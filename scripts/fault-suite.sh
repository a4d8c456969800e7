#!/usr/bin/env bash
# The long fault suites (issue 15): each part is a function that adds to
# PASSED / FAILED (scenarios) and SKIPPED (with why). Last line:
# "N passed, N failed"; exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
PASSED=0
FAILED=0
SKIPPED=()
LOG_DIR=${KVTIER_FAULT_LOG_DIR:-$(mktemp -d -t kvtier-fault-suite.XXXXXX)}

# "P F": the tests passed and failed in a cargo test log, from its
# "test result:" lines (with --nocapture a test's output lands between
# its "test NAME ..." and its "ok", so those lines cannot be counted).
test_results() {
  awk '/^test result:/ { for (i = 2; i <= NF; i++) { if ($i == "passed;") p += $(i - 1); if ($i == "failed;") f += $(i - 1) } }
       END { print p + 0, f + 0 }' "$1"
}

# G4 against a hostile object store: the proxy fault matrix (5 rounds,
# 4 MiB blocks), a server killed mid-GET, a silent endpoint, no metadata
# contact without credentials = "instance", and a real kvtierd + mount in
# front of a hung endpoint. Scenarios are counted from PASS/FAIL lines.
g4_faults() {
  if [ ! -x .venv/bin/weed ] && [ -z "${KVTIER_WEED:-}" ]; then
    SKIPPED+=("g4 fault matrix: no .venv/bin/weed (run scripts/setup.sh)")
  fi
  local log="$LOG_DIR/g4_faults.log"
  KVTIER_FAULT_LONG=1 cargo test -p kvtier-daemon --test g4_faults -- \
    --nocapture --test-threads=1 >"$log" 2>&1
  local rc=$?
  local p f
  p=$(grep -c 'PASS g4 fault' "$log")
  f=$(grep -c 'FAIL g4 fault' "$log")
  # The tests of the file, one scenario each (the matrix test too).
  local tp tf
  read -r tp tf < <(test_results "$log")
  PASSED=$((PASSED + p + tp))
  FAILED=$((FAILED + f + tf))
  if [ "$rc" -ne 0 ] && [ $((f + tf)) -eq 0 ]; then
    echo "g4_faults: cargo test failed without a scenario failure; see $log"
    FAILED=$((FAILED + 1))
  fi
  log="$LOG_DIR/e2e_g4_hung.log"
  if cargo test -q -p kvtier --test e2e_g4_hung -- --nocapture >"$log" 2>&1; then
    PASSED=$((PASSED + 1))
    grep -q '^SKIP' "$log" && SKIPPED+=("e2e_g4_hung mount part: $(grep -m1 '^SKIP' "$log")")
  else
    echo "e2e_g4_hung failed; see $log"
    FAILED=$((FAILED + 1))
  fi
  echo "g4 faults: see $LOG_DIR"
}

# G4 outages (tests/e2e_g4_outage.rs, issue 28), long variant: a real
# kvtierd started while SeaweedFS is down, then two outages while healthy
# (every request 503 through the fault proxy, then the server stopped);
# each time the uploads are given up, and every block must reach the
# bucket after the store returns, with /healthz ok, and no restart. One
# scenario per PASS line plus the test itself. (The long variants of the
# size-limit and fetch-budget tests run in g4_faults above: 64 MiB
# hostile objects.)
g4_outage() {
  if [ ! -x .venv/bin/weed ] && [ -z "${KVTIER_WEED:-}" ]; then
    SKIPPED+=("g4 outage: no .venv/bin/weed (run scripts/setup.sh)")
    return
  fi
  local log="$LOG_DIR/e2e_g4_outage.log"
  KVTIER_FAULT_LONG=1 cargo test -p kvtier --test e2e_g4_outage -- --nocapture >"$log" 2>&1
  local rc=$?
  local p
  p=$(grep -c '^PASS g4 outage' "$log")
  if [ "$rc" -eq 0 ]; then
    PASSED=$((PASSED + p + 1))
  else
    echo "e2e_g4_outage failed; see $log"
    PASSED=$((PASSED + p))
    FAILED=$((FAILED + 1))
  fi
}

# G3 power loss (daemon/tests/g3_power_loss.rs): KVTIER_POWER_LOSS_ITERS
# iterations (default 1000; 4 scenarios round robin, seeds from
# KVTIER_POWER_LOSS_SEED) of crash + recovery + checks, then the mutation
# check (each durability site removed in turn) with a larger budget; the
# same through the real client, socket, server and node
# (daemon/tests/acked: KVTIER_ACKED_POWER_LOSS_ITERS, default 200) and its
# mutation check. One scenario per test that passes.
g3_power_loss() {
  local iters=${KVTIER_POWER_LOSS_ITERS:-1000}
  local log="$LOG_DIR/g3_power_loss.log"
  KVTIER_POWER_LOSS_ITERS=$iters KVTIER_MUTATION_ITERS=${KVTIER_MUTATION_ITERS:-1200} \
    KVTIER_MUTATION_SAFE_ITERS=${KVTIER_MUTATION_SAFE_ITERS:-60} \
    KVTIER_ACKED_POWER_LOSS_ITERS=${KVTIER_ACKED_POWER_LOSS_ITERS:-200} \
    KVTIER_ACKED_MUTATION_ITERS=${KVTIER_ACKED_MUTATION_ITERS:-480} \
    KVTIER_ACKED_MUTATION_SAFE_ITERS=${KVTIER_ACKED_MUTATION_SAFE_ITERS:-24} \
    cargo test -p kvtier-daemon --test g3_power_loss -- --nocapture --test-threads=2 \
    --skip simulation_short >"$log" 2>&1
  local rc=$?
  local p f
  read -r p f < <(test_results "$log")
  PASSED=$((PASSED + p))
  FAILED=$((FAILED + f))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "g3_power_loss: cargo test failed without a test failure; see $log"
    FAILED=$((FAILED + 1))
  fi
  grep -E '^(acked )?power loss:|caught at|not load-bearing' "$log"
}

# The deterministic simulation (daemon/tests/sim, run by g3_power_loss's
# simulation_short): KVTIER_SIM_SEEDS seeds (default 2000), each a
# scenario; its "sim: N passed, N failed" line is added to the totals.
simulation() {
  local seeds=${KVTIER_SIM_SEEDS:-2000}
  local log="$LOG_DIR/simulation.log"
  KVTIER_SIM_SEEDS=$seeds cargo test -p kvtier-daemon --test g3_power_loss simulation_short \
    -- --nocapture >"$log" 2>&1
  local rc=$?
  local line p f
  line=$(grep -m1 -E '^sim: [0-9]+ passed, [0-9]+ failed' "$log")
  p=$(echo "$line" | sed -E 's/^sim: ([0-9]+) passed.*/\1/')
  f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed$/\1/')
  if [ -z "$line" ]; then
    echo "simulation: no result line; see $log"
    p=0
    f=1
  fi
  PASSED=$((PASSED + p))
  FAILED=$((FAILED + f))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "simulation: cargo test failed without a seed failure; see $log"
    FAILED=$((FAILED + 1))
  fi
  grep -E '^sim: seeds|^sim FAILED' "$log" | head -20
}

# The node's peer fall-through under faults (daemon/tests/peer_fetch.rs
# fall_through, the node's cases and the mount's): one scenario per case
# line.
peer_fall_through() {
  if [ ! -x .venv/bin/weed ] && [ -z "${KVTIER_WEED:-}" ]; then
    SKIPPED+=("peer fall-through: no .venv/bin/weed (run scripts/setup.sh)")
    return
  fi
  local log="$LOG_DIR/peer_fall_through.log"
  cargo test -p kvtier-daemon --test peer_fetch fall_through -- --nocapture >"$log" 2>&1
  local rc=$?
  local p f
  # The node's cases and the mount's (root and /dev/fuse; else SKIP).
  p=$(grep -cE "^(mount )?fall-through case .*: Ok" "$log")
  f=$(grep -cE "^(mount )?fall-through case .*: Err" "$log")
  grep -q '^SKIP mount_open' "$log" && SKIPPED+=("mount fall-through: $(grep -m1 '^SKIP mount_open' "$log")")
  PASSED=$((PASSED + p))
  FAILED=$((FAILED + f))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "peer fall-through: cargo test failed without a case failure; see $log"
    FAILED=$((FAILED + 1))
  fi
}

# The cluster in network namespaces (tests/e2e_cluster.rs, issue 18): all
# scenarios (peer and G4 paths, a peer killed mid-transfer, partition and
# heal, a node joining and leaving, a corrupt peer), one per PASS/FAIL line.
cluster() {
  if [ ! -x .venv/bin/weed ] && [ -z "${KVTIER_WEED:-}" ]; then
    SKIPPED+=("cluster: no .venv/bin/weed (run scripts/setup.sh)")
    return
  fi
  local log="$LOG_DIR/e2e_cluster.log"
  KVTIER_CLUSTER_LONG=1 cargo test -p kvtier --test e2e_cluster -- --nocapture >"$log" 2>&1
  local rc=$?
  local p f
  p=$(grep -c '^PASS cluster' "$log")
  f=$(grep -c '^FAIL cluster' "$log")
  PASSED=$((PASSED + p))
  FAILED=$((FAILED + f))
  if grep -q '^skipped: e2e_cluster' "$log"; then
    SKIPPED+=("$(grep -m1 '^skipped: e2e_cluster' "$log")")
  fi
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "cluster: cargo test failed without a scenario failure; see $log"
    FAILED=$((FAILED + 1))
  fi
  grep -E '^(PASS|FAIL) cluster' "$log"
}

# G3 power loss under the real kernel (daemon/tests/g3_fuse_power_loss.rs):
# G3 in a FUSE filesystem that drops what was not made durable
# (kvtier_fs::faultfs), KVTIER_FUSE_POWER_LOSS_ITERS iterations (default
# 200, each a scenario; a failure stops the run at that iteration) and the
# mutation check (one scenario). Needs root and /dev/fuse.
g3_fuse_power_loss() {
  if [ "$(id -u)" -ne 0 ] || [ ! -e /dev/fuse ]; then
    SKIPPED+=("g3 power loss through FUSE: needs root and /dev/fuse")
    return
  fi
  local iters=${KVTIER_FUSE_POWER_LOSS_ITERS:-200}
  local log="$LOG_DIR/g3_fuse_power_loss.log"
  KVTIER_FUSE_POWER_LOSS_ITERS=$iters KVTIER_FUSE_MUTATION_ITERS=${KVTIER_FUSE_MUTATION_ITERS:-200} \
    cargo test -p kvtier-daemon --test g3_fuse_power_loss -- --nocapture --test-threads=1 \
    --skip promotions_through >"$log" 2>&1
  local rc=$?
  local p=0 f=0 line
  line=$(grep -m1 -E '^fuse power loss: [0-9]+ passed' "$log")
  if [ -n "$line" ]; then
    p=$(echo "$line" | sed -E 's/^fuse power loss: ([0-9]+) passed.*/\1/')
  else
    # The iteration that failed; those before it passed.
    p=$(grep -m1 -oE "^iteration [0-9]+ \(replay" "$log" | sed -E 's/iteration ([0-9]+).*/\1/')
    p=${p:-0}
    f=1
  fi
  if grep -qE '^fuse mutation check: [0-9]+ sites caught' "$log"; then
    p=$((p + 1))
  else
    f=$((f + 1))
  fi
  PASSED=$((PASSED + p))
  FAILED=$((FAILED + f))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "g3_fuse_power_loss: cargo test failed without a scenario failure; see $log"
    FAILED=$((FAILED + 1))
  fi
  grep -E '^fuse power loss:|caught at|^SKIP' "$log"
}

# Promotions crash-tested through the node
# (daemon/tests/faultfs_support/node_promotion.rs, in the g3_fuse_power_loss
# binary): a real Node with G3 in
# faultfs and G4 the real test S3 server; KVTIER_NODE_POWER_LOSS_ITERS
# iterations (default 100), each a scenario.
node_promotion_power_loss() {
  if [ "$(id -u)" -ne 0 ] || [ ! -e /dev/fuse ]; then
    SKIPPED+=("node promotion power loss: needs root and /dev/fuse")
    return
  fi
  if [ ! -x .venv/bin/weed ] && [ -z "${KVTIER_WEED:-}" ]; then
    SKIPPED+=("node promotion power loss: no .venv/bin/weed (run scripts/setup.sh)")
    return
  fi
  local iters=${KVTIER_NODE_POWER_LOSS_ITERS:-100}
  local log="$LOG_DIR/node_promotion_power_loss.log"
  KVTIER_NODE_POWER_LOSS_ITERS=$iters \
    cargo test -p kvtier-daemon --test g3_fuse_power_loss promotions_through -- --nocapture >"$log" 2>&1
  local rc=$?
  local p=0 f=0 line
  line=$(grep -m1 -E '^node promotion power loss: [0-9]+ passed' "$log")
  if [ -n "$line" ]; then
    p=$(echo "$line" | sed -E 's/^node promotion power loss: ([0-9]+) passed.*/\1/')
  else
    p=$(grep -m1 -oE "^iteration [0-9]+ \(replay" "$log" | sed -E 's/iteration ([0-9]+).*/\1/')
    p=${p:-0}
    f=1
  fi
  PASSED=$((PASSED + p))
  FAILED=$((FAILED + f))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "node_promotion_power_loss: cargo test failed without a scenario failure; see $log"
    FAILED=$((FAILED + 1))
  fi
  grep -E '^node promotion power loss:|^SKIP' "$log"
}

# One owner per G3 directory and corrupt copies found and repaired
# (tests/e2e_g3_safety.rs, issue 28): the default-run cases, then the
# ignored long variants (KVTIER_G3_SAFETY_ROUNDS rounds, default 5: kill
# -9 under load with a refused second daemon; corrupt fd reads repaired
# from G4), and the recovery walk's symlink and other-filesystem cases.
# One scenario per test, plus one per PASS/FAIL round line.
g3_safety() {
  local log="$LOG_DIR/g3_safety.log"
  KVTIER_G3_SAFETY_ROUNDS=${KVTIER_G3_SAFETY_ROUNDS:-5} \
    cargo test -p kvtier --test e2e_g3_safety -- --include-ignored --nocapture \
    --test-threads=1 >"$log" 2>&1
  local rc=$?
  local p f tp tf
  # Round lines may share a line with a test's name (--nocapture).
  p=$(grep -c 'PASS g3 safety' "$log")
  f=$(grep -c 'FAIL g3 safety' "$log")
  read -r tp tf < <(test_results "$log")
  p=$((p + tp))
  f=$((f + tf))
  log="$LOG_DIR/g3_walk.log"
  cargo test -p kvtier-daemon --lib g3:: -- --nocapture >"$log" 2>&1
  local rc2=$?
  read -r tp tf < <(test_results "$log")
  p=$((p + tp))
  f=$((f + tf))
  PASSED=$((PASSED + p))
  FAILED=$((FAILED + f))
  if { [ "$rc" -ne 0 ] || [ "$rc2" -ne 0 ]; } && [ "$f" -eq 0 ]; then
    echo "g3_safety: cargo test failed without a test failure; see $LOG_DIR"
    FAILED=$((FAILED + 1))
  fi
  grep -oE '(PASS|FAIL) g3 safety.*' "$LOG_DIR/g3_safety.log"
}

g4_faults
g3_safety
g4_outage
g3_power_loss
g3_fuse_power_loss
node_promotion_power_loss
simulation
peer_fall_through
cluster

for s in "${SKIPPED[@]+"${SKIPPED[@]}"}"; do
  echo "skipped: $s"
done
echo "$PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
