#!/usr/bin/env python3
"""Runs the documentation's examples that can run on a CI machine.

A fenced block is run when the line just before its opening fence is one of:

  <!-- ci: run -->               a shell block, run with bash -euo pipefail
  <!-- ci: run with kvtierd --> the same, with a kvtierd of its own running
                                 and KVTIER_SOCKET naming its socket
  <!-- ci: check-config -->      a TOML block, checked by
                                 `kvtierd --check-config --config BLOCK`

Everything else (systemctl, kubectl, docker, real S3 credentials, engines)
stays unmarked and is not run. Each block runs in a fresh directory with
HOME and XDG_STATE_HOME inside it, the built kvtierd and kvtier first on
PATH, and a deadline of 60 s.

Usage: doc_examples.py BIN_DIR FILE.md...
  (BIN_DIR holds kvtierd and kvtier, e.g. target/debug)
Prints one line per block and `docs: N passed, M failed`; exits 1 on a
failure, 2 when a file has no marked block (a marker lost in an edit).

Commands that cannot run here are linted instead: a `weed` (SeaweedFS)
server command must bind an address (`-ip.bind=`; weed's default is
0.0.0.0) and turn telemetry off (`-master.telemetry=false`; on by default).
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

MARK = re.compile(r"^<!--\s*ci:\s*(run with kvtierd|run|check-config)\s*-->\s*$")
DEADLINE_S = 60


def blocks(path):
    """(line, kind, text) of every marked fenced block in `path`."""
    lines = open(path).read().split("\n")
    out = []
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i].strip())
        if m and i + 1 < len(lines) and lines[i + 1].lstrip().startswith("```"):
            fence = lines[i + 1].strip()[:3]
            body = []
            j = i + 2
            while j < len(lines) and not lines[j].strip().startswith(fence):
                body.append(lines[j])
                j += 1
            out.append((i + 2, m.group(1), "\n".join(body) + "\n"))
            i = j
        i += 1
    return out


WEED = re.compile(r"^\s*weed\s+(mini|server|master|s3)\b")


def lint_weed(path):
    """(line, problem) for each `weed` server command in `path` that binds
    every address or reports telemetry (continuation lines joined)."""
    lines = open(path).read().split("\n")
    out = []
    for i, l in enumerate(lines):
        if not WEED.match(l):
            continue
        cmd, j = l, i
        while cmd.rstrip().endswith("\\") and j + 1 < len(lines):
            j += 1
            cmd = cmd.rstrip()[:-1] + " " + lines[j]
        if "-ip.bind=" not in cmd or "-ip.bind=0.0.0.0" in cmd:
            out.append((i + 1, "weed without -ip.bind=ADDRESS binds 0.0.0.0"))
        if "-master.telemetry=false" not in cmd:
            out.append((i + 1, "weed without -master.telemetry=false reports to seaweedfs.com"))
    return out


def start_kvtierd(bins, work, env):
    sock = os.path.join(work, "kvtierd.sock")
    log = open(os.path.join(work, "kvtierd.log"), "w")
    p = subprocess.Popen(
        [os.path.join(bins, "kvtierd"), "--socket", sock, "--g3-dir",
         os.path.join(work, "daemon-g3"), "--g3-capacity", "256MiB",
         "--metrics-addr", ""],
        env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    deadline = time.time() + 30
    while time.time() < deadline and p.poll() is None:
        if os.path.exists(sock):
            r = subprocess.run([os.path.join(bins, "kvtier"), "stats", "--socket", sock],
                               capture_output=True, env=env)
            if r.returncode == 0:
                return p, sock
        time.sleep(0.2)
    p.kill()
    raise RuntimeError("kvtierd did not start: " + open(log.name).read()[-1500:])


def run_block(bins, kind, text):
    work = tempfile.mkdtemp(prefix="kvtier-doc-")
    env = {
        "PATH": f"{bins}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": work,
        "XDG_STATE_HOME": os.path.join(work, "state"),
        "LANG": "C.UTF-8",
    }
    daemon = None
    try:
        if kind == "check-config":
            cfg = os.path.join(work, "block.toml")
            open(cfg, "w").write(text)
            argv = [os.path.join(bins, "kvtierd"), "--check-config", "--config", cfg]
        else:
            if kind == "run with kvtierd":
                daemon, sock = start_kvtierd(bins, work, env)
                env["KVTIER_SOCKET"] = sock
            argv = ["bash", "-euo", "pipefail", "-c", text]
        r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                           timeout=DEADLINE_S, start_new_session=True)
        return r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    except (subprocess.TimeoutExpired, RuntimeError) as e:
        return False, str(e)[-2000:]
    finally:
        if daemon is not None:
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        shutil.rmtree(work, ignore_errors=True)


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    bins = os.path.realpath(sys.argv[1])
    passed = failed = 0
    for path in sys.argv[2:]:
        for line, problem in lint_weed(path):
            failed += 1
            print(f"FAIL {path}:{line} (lint): {problem}")
        found = blocks(path)
        if not found:
            print(f"FAIL {path}: no marked example (<!-- ci: run -->)")
            return 2
        for line, kind, text in found:
            ok, out = run_block(bins, kind, text)
            name = f"{path}:{line} ({kind})"
            if ok:
                passed += 1
                print(f"ok   {name}")
            else:
                failed += 1
                print(f"FAIL {name}")
                print("\n".join("     " + l for l in out.splitlines()))
    print(f"docs: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
