# Sourced by the deploy checks: `check NAME COMMAND...` runs the command,
# prints `ok   NAME` or `FAIL NAME` with its output indented, and counts
# into $passed and $failed.
passed=0 failed=0
check() { # name, command...
  local name=$1; shift
  if out=$("$@" 2>&1); then
    passed=$((passed + 1)); echo "ok   $name"
  else
    failed=$((failed + 1)); echo "FAIL $name"; echo "$out" | sed 's/^/     /'
  fi
}
