#!/usr/bin/env bash
# Boots a real systemd (Debian bookworm, made with mmdebstrap) in a
# systemd-nspawn container, installs deploy/systemd/kvtierd.service in it
# exactly as shipped, and checks what an operator relies on:
#   1. the FUSE view the service mounts is in the mount table of the
#      container's PID 1 (the "host" of the unit), not hidden in a private
#      namespace, and the service shares PID 1's mount namespace;
#   2. a worker uid in group `kvtier` reaches the socket (a `kvtier stats`
#      answer); a uid outside the group is refused;
#   3. a SIGKILL of the daemon is restarted by systemd (Restart=always),
#      and the new daemon serves and mounts again;
#   4. `systemctl stop` unmounts and ends the daemon.
# scripts/unit_sim.py (run by .ci/run through scripts/check-deploy.sh)
# reproduces the unit's namespaces without a service manager; this script is
# the real thing, and slower: the first run downloads about 100 MB of Debian
# packages (3-4 minutes; the root file system is kept in
# target/systemd-boot/rootfs for later runs, about 30 s each).
#
# Needs: root, /dev/fuse, the Debian mirror, and
#   apt-get install mmdebstrap systemd-container
# Works where PID 1 is not systemd and cgroups are v1/hybrid (nspawn runs
# with --keep-unit --register=no: no host systemd or D-Bus is asked for a
# scope or a machine registration).
# Usage: scripts/systemd-boot-check.sh [KVTIERD [KVTIER]]
#   (default: target/debug/kvtierd and target/debug/kvtier)
#   KVTIER_UNIT=path checks another unit file (default: the shipped one).
#   KVTIER_BOOT_DIR=dir keeps the root file system there (default:
#   target/systemd-boot).
set -euo pipefail
cd "$(dirname "$0")/.."
kvtierd=$(realpath "${1:-target/debug/kvtierd}")
kvtier=$(realpath "${2:-$(dirname "$kvtierd")/kvtier}")
for b in "$kvtierd" "$kvtier"; do
  [ -x "$b" ] || { echo "systemd-boot-check: $b not built (cargo build -p kvtier-daemon -p kvtier-tools)" >&2; exit 1; }
done
for t in mmdebstrap systemd-nspawn nsenter; do
  command -v $t >/dev/null || { echo "systemd-boot-check: needs $t (apt-get install mmdebstrap systemd-container)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "systemd-boot-check: run as root" >&2; exit 1; }
[ -c /dev/fuse ] || { echo "systemd-boot-check: no /dev/fuse" >&2; exit 1; }

work=${KVTIER_BOOT_DIR:-target/systemd-boot}
rootfs=$work/rootfs
mkdir -p "$work"
if [ ! -x "$rootfs/usr/lib/systemd/systemd" ]; then
  echo "== building a Debian bookworm root file system with systemd (mmdebstrap, minutes)"
  rm -rf "$rootfs"
  mmdebstrap --variant=minbase --include=systemd,systemd-sysv,fuse3,dbus,util-linux \
    bookworm "$rootfs" > "$work/mmdebstrap.log" 2>&1 \
    || { tail -20 "$work/mmdebstrap.log" >&2; exit 1; }
fi

echo "== installing kvtierd, its unit and a config into the container"
install -m 0755 "$kvtierd" "$kvtier" "$rootfs/usr/local/bin/"
install -m 0644 "${KVTIER_UNIT:-deploy/systemd/kvtierd.service}" "$rootfs/etc/systemd/system/kvtierd.service"
mkdir -p "$rootfs/etc/kvtier" "$rootfs/mnt/kv"
cat > "$rootfs/etc/kvtier/kvtierd.toml" <<'EOF'
[server]
socket = "/run/kvtier/kvtierd.sock"
socket_group = "kvtier"
[g3]
dir = "/var/lib/kvtier/g3"
capacity = "64MiB"
[g4]
url = "file:///var/lib/kvtier/g4"
[metrics]
addr = ""
[mount]
dir = "/mnt/kv"
allow_other = true
EOF
in_root() { chroot "$rootfs" "$@"; }
in_root getent group kvtier >/dev/null || in_root groupadd --system kvtier
in_root id worker >/dev/null 2>&1 || in_root useradd --no-create-home --groups kvtier worker
in_root id outsider >/dev/null 2>&1 || in_root useradd --no-create-home outsider
# A fresh machine-id each boot, and no getty on the console.
: > "$rootfs/etc/machine-id"
in_root systemctl mask console-getty.service >/dev/null 2>&1 || true
# allow_other for a non-root reader of the mount.
grep -qx user_allow_other "$rootfs/etc/fuse.conf" 2>/dev/null || echo user_allow_other >> "$rootfs/etc/fuse.conf"

echo "== booting systemd in systemd-nspawn"
log=$work/boot.log
systemd-nspawn -D "$rootfs" -b --register=no --keep-unit --console=pipe \
  --bind=/dev/fuse --machine=kvtier-boot-check > "$log" 2>&1 &
nspawn=$!
finish() {
  if kill -0 "$nspawn" 2>/dev/null; then
    [ -n "${ct:-}" ] && nsenter -t "$ct" -a systemctl poweroff >/dev/null 2>&1 || kill -TERM "$nspawn" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$nspawn" 2>/dev/null || true
  fi
  wait "$nspawn" 2>/dev/null || true
}
trap finish EXIT
. scripts/check-lib.sh
wait_for() { # seconds, command...: until the command succeeds
  local n=$(($1 * 4)); shift
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  "$@"
}
ct=""
for _ in $(seq 240); do
  ct=$(pgrep -P "$nspawn" | head -1 || true)
  [ -n "$ct" ] && [ "$(cat /proc/"$ct"/comm 2>/dev/null)" = systemd ] && break
  kill -0 "$nspawn" 2>/dev/null || { echo "systemd-nspawn exited:" >&2; cat "$log" >&2; exit 1; }
  sleep 0.25
done
[ -n "$ct" ] || { echo "no container init found" >&2; cat "$log" >&2; exit 1; }
in_ct() { nsenter -t "$ct" -a "$@"; }
booted() { s=$(in_ct systemctl is-system-running 2>/dev/null || true); [ "$s" = running ] || [ "$s" = degraded ]; }
check "systemd booted in the container (is-system-running)" wait_for 120 booted

main_pid() { in_ct systemctl show -p MainPID --value kvtierd; }
serving() { in_ct env KVTIER_SOCKET=/run/kvtier/kvtierd.sock kvtier stats >/dev/null; }
mounted() { in_ct findmnt -n -o FSTYPE /mnt/kv | grep -q '^fuse'; }
in_ct systemctl start kvtierd || true
check "systemctl start kvtierd: active and serving" wait_for 60 serving
if ! serving; then in_ct journalctl -u kvtierd --no-pager | tail -30; fi

check "the FUSE view is in PID 1's mount table (findmnt /mnt/kv)" wait_for 30 mounted
same_ns() { [ "$(in_ct readlink /proc/1/ns/mnt)" = "$(in_ct readlink /proc/"$(main_pid)"/ns/mnt)" ]; }
check "kvtierd shares PID 1's mount namespace" same_ns
listing() { in_ct runuser -u worker -- ls /mnt/kv >/dev/null; }
check "a worker lists the mount" listing
worker() { in_ct runuser -u worker -- env KVTIER_SOCKET=/run/kvtier/kvtierd.sock kvtier stats; }
check "a worker uid in group kvtier reaches the socket (kvtier stats)" worker
outsider() { ! in_ct runuser -u outsider -- env KVTIER_SOCKET=/run/kvtier/kvtierd.sock kvtier stats; }
check "a uid outside group kvtier is refused" outsider
rundir() { [ "$(in_ct stat -c '%U:%G %a' /run/kvtier)" = "root:kvtier 750" ]; }
check "/run/kvtier is root:kvtier 0750 (RuntimeDirectory=, Group=)" rundir

pid0=$(main_pid)
in_ct sh -c "kill -KILL $pid0"  # the shell's kill: minbase has no procps
restarted() { p=$(main_pid); [ "$p" != 0 ] && [ "$p" != "$pid0" ] && serving && mounted; }
check "SIGKILL: systemd restarts kvtierd (Restart=always), serving and mounted again" wait_for 60 restarted
nrestarts() { [ "$(in_ct systemctl show -p NRestarts --value kvtierd)" -ge 1 ]; }
check "systemd counted the restart (NRestarts >= 1)" nrestarts

in_ct systemctl stop kvtierd || true
stopped() { ! mounted && [ "$(main_pid)" = 0 ] && [ "$(in_ct systemctl is-active kvtierd || true)" = inactive ]; }
check "systemctl stop: unmounted, daemon ended, unit inactive" wait_for 70 stopped

echo "systemd boot: $passed passed, $failed failed"
[ "$failed" = 0 ]
