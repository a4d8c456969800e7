# shellcheck shell=bash
# Sourced by device-check.sh and ttft-check.sh: the interpreter that holds
# torch, with the kvtier wheel installed beside it (no venv).
#
# On the GPU machine `python3` is itself a venv interpreter
# (/opt/torch/.venv/bin/python3) and torch lives in that venv's
# site-packages. A venv made from it, even with --system-site-packages,
# links the *base* interpreter's site-packages, where torch is not: so no
# venv is made. The wheel is installed with that interpreter's `pip install
# --no-deps --no-index --target SITE` and SITE is put first on PYTHONPATH;
# the checks then run under the very interpreter that holds torch.
#
#   kv_python DEVICE SITE WHEEL   # DEVICE: cuda | cpu
#
# Interpreter: $PYTHON, else `python3` on PATH. On success: KV_PY is the
# interpreter, PYTHONPATH starts with SITE (exported), KV_PY_INFO says which
# torch and kvtier were found, returns 0. On failure: KV_PY_WHY says
# exactly why (no interpreter, Python < 3.11, torch not importable and from
# where it was looked for, CUDA not available to torch, the wheel not
# installable (no pip), kvtier imported from somewhere else), returns 1.

# shellcheck disable=SC2034 # KV_PY, KV_PY_WHY, KV_PY_INFO are for the caller
kv_python() {
  local device=$1 site=$2 whl=$3 out
  KV_PY=${PYTHON:-$(command -v python3 || true)}
  KV_PY_WHY="" KV_PY_INFO=""
  if [ -z "$KV_PY" ]; then
    KV_PY_WHY="no python3 on PATH and PYTHON unset"
    return 1
  fi
  # torch first: nothing is installed into an interpreter that cannot run
  # the check.
  if ! out=$("$KV_PY" - "$device" 2>&1 <<'PY'
import sys
if sys.version_info < (3, 11):
    raise SystemExit(f"Python {sys.version.split()[0]} < 3.11 (the kvtier wheel is abi3 for CPython >= 3.11)")
try:
    import torch
except Exception as e:
    raise SystemExit(f"cannot import torch: {e!r}; sys.prefix={sys.prefix} sys.path={sys.path}")
cuda = torch.cuda.is_available()
if sys.argv[1] == "cuda" and not cuda:
    raise SystemExit(f"torch {torch.__version__} ({torch.__file__}): torch.cuda.is_available() is False "
                     f"(torch.version.cuda={torch.version.cuda})")
print(f"torch {torch.__version__} from {torch.__file__}, cuda available: {cuda}")
PY
  ); then
    KV_PY_WHY="$KV_PY: $(echo "$out" | tail -3 | tr '\n' ' ')"
    return 1
  fi
  KV_PY_INFO="$KV_PY ($out)"
  if [ -z "$whl" ] || [ ! -f "$whl" ]; then
    KV_PY_WHY="no kvtier wheel (${whl:-none given}): run gds/scripts/device-check.sh --prepare"
    return 1
  fi
  rm -rf "$site" && mkdir -p "$site"
  # --no-index: the GPU machine has no network, and nothing else is needed
  # (torch is the machine's own). Its python3 has pip (the device README
  # installs carried wheels the same way).
  if ! out=$(PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 "$KV_PY" -m pip install -q \
      --no-deps --no-index --no-compile --no-cache-dir --target "$site" "$whl" 2>&1); then
    KV_PY_WHY="$KV_PY -m pip install --no-deps --no-index --target $site $whl: $(echo "$out" | tail -3 | tr '\n' ' ')"
    return 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  # The kvtier that imports must be this wheel's, not one installed in the
  # interpreter's own site-packages.
  if ! out=$("$KV_PY" - "$site" 2>&1 <<'PY'
import os, sys
import kvtier
where = os.path.realpath(kvtier.__file__)
if not where.startswith(os.path.realpath(sys.argv[1]) + os.sep):
    raise SystemExit(f"kvtier imported from {where}, not from {sys.argv[1]}")
print(f"kvtier from {where}")
PY
  ); then
    KV_PY_WHY="$(echo "$out" | tail -3 | tr '\n' ' ')"
    return 1
  fi
  KV_PY_INFO="$KV_PY_INFO; $out"
  return 0
}
