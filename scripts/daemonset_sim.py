#!/usr/bin/env python3
"""Starts kvtierd the way the kubelet would start the DaemonSet in
deploy/kubernetes/kvtierd-daemonset.yaml, and checks that it comes up.

No cluster here, so the pod's execution environment is reproduced from the
manifest and the image's Dockerfile:

  * the container's uid and gid: securityContext.runAsUser/runAsGroup of the
    container, else of the pod, else the Dockerfile's last USER (as the
    container runtime does);
  * every hostPath volume of type DirectoryOrCreate is created by the kubelet
    as root, mode 0755, before the container starts: here under a temporary
    root, with the ConfigMap's kvtierd.toml rewritten to those paths (the
    mount paths are mapped to the host paths the volumes name);
  * privileged keeps every capability; otherwise the bounding set is the
    runtime's default set plus securityContext.capabilities.add.

Then it checks the daemon starts, answers a `kvtier stats` on the socket,
and mounts its FUSE view when the manifest enables [mount].

Usage: daemonset_sim.py MANIFEST DOCKERFILE KVTIERD KVTIER
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

# The capabilities containerd / docker grant a non-privileged container.
DEFAULT_CAPS = ["chown", "dac_override", "fsetid", "fowner", "mknod", "net_raw",
                "setgid", "setuid", "setfcap", "setpcap", "net_bind_service",
                "sys_chroot", "kill", "audit_write"]


def mounted(path):
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def main():
    if len(sys.argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    manifest, dockerfile = sys.argv[1], sys.argv[2]
    kvtierd, kvtier = os.path.realpath(sys.argv[3]), os.path.realpath(sys.argv[4])
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("skip DaemonSet simulation: needs root and /dev/fuse")
        return 0
    docs = [d for d in yaml.safe_load_all(open(manifest)) if d]
    cm = next(d for d in docs if d.get("kind") == "ConfigMap")
    ds = next(d for d in docs if d.get("kind") == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    image_user = None
    for line in open(dockerfile):
        if line.strip().upper().startswith("USER "):
            image_user = line.split()[1]
    psc, csc = pod.get("securityContext") or {}, ctr.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    if uid is None:
        uid = int(image_user.split(":")[0]) if image_user else 0
    if gid is None:
        gid = int(image_user.split(":")[1]) if image_user and ":" in image_user else uid
    privileged = bool(csc.get("privileged"))
    caps = None if privileged else DEFAULT_CAPS + [
        c.lower().removeprefix("cap_") for c in (csc.get("capabilities") or {}).get("add", [])]

    tmp = tempfile.mkdtemp(prefix="kvtier-ds-")
    os.chmod(tmp, 0o755)
    host = lambda p: os.path.join(tmp, "host", p.lstrip("/"))
    volumes = {v["name"]: v for v in pod["volumes"]}
    path_map = {}  # container path -> simulated host path
    for vm in ctr["volumeMounts"]:
        v = volumes[vm["name"]]
        if "hostPath" in v:
            hp = v["hostPath"]
            if hp.get("type") == "CharDevice":
                path_map[vm["mountPath"]] = hp["path"]
                continue
            # The kubelet creates DirectoryOrCreate paths as root, 0755.
            os.makedirs(host(hp["path"]), exist_ok=True)
            os.chmod(host(hp["path"]), 0o755)
            path_map[vm["mountPath"]] = host(hp["path"])
    toml = cm["data"]["kvtierd.toml"]
    # Longest container paths first, so /var/lib/kvtier/g3 maps inside
    # /var/lib/kvtier.
    for cpath in sorted(path_map, key=len, reverse=True):
        toml = toml.replace(f'"{cpath}', f'"{path_map[cpath]}')
    # No object store or fixed port here: G4 off, metrics on any port.
    lines, section = [], None
    for line in toml.splitlines():
        s = line.strip()
        if s.startswith("["):
            section = s
        if section == "[g4]" and s and not s.startswith("["):
            continue
        if section == "[metrics]" and s.startswith("addr"):
            line = 'addr = "127.0.0.1:0"'
        lines.append(line)
        if s == "[g4]":
            lines.append('url = ""')
    cfg = os.path.join(tmp, "kvtierd.toml")
    open(cfg, "w").write("\n".join(lines) + "\n")
    os.chmod(cfg, 0o644)
    sock = next(l.split("=", 1)[1].strip().strip('"') for l in lines
                if l.strip().startswith("socket ="))
    mnt, section = None, None
    for l in lines:
        s = l.strip()
        if s.startswith("["):
            section = s
        elif section == "[mount]" and s.startswith("dir ="):
            mnt = s.split("=", 1)[1].strip().strip('"') or None

    setpriv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    if caps is not None:
        setpriv += ["--bounding-set=-all," + ",".join("+" + c for c in caps),
                    "--inh-caps=-all"]
    argv = [kvtierd if a == "/usr/local/bin/kvtierd" else a for a in ctr.get("args", [])]
    argv = [cfg if a == "/etc/kvtier/kvtierd.toml" else a for a in argv]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/var/lib/kvtier"}
    log = open(os.path.join(tmp, "kvtierd.log"), "w+")
    proc = subprocess.Popen(setpriv + [kvtierd] + argv, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    results = []

    def check(name, ok, detail=""):
        results.append(ok)
        print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"))

    try:
        up = False
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(sock) and subprocess.run(
                    [kvtier, "stats", "--socket", sock], capture_output=True).returncode == 0:
                up = True
                break
            time.sleep(0.2)
        log.seek(0)
        check(f"kvtierd starts as the pod would run it (uid {uid}, "
              f"{'privileged' if privileged else 'unprivileged'})", up, log.read()[-1500:])
        if up and mnt:
            deadline = time.time() + 30
            while time.time() < deadline and not mounted(mnt):
                time.sleep(0.2)
            check("the FUSE view is mounted", mounted(mnt))
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if mnt and mounted(mnt):
            subprocess.run(["umount", "-l", mnt])
        shutil.rmtree(tmp, ignore_errors=True)
    failed = results.count(False)
    print(f"daemonset: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
