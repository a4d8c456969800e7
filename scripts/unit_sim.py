#!/usr/bin/env python3
"""Runs kvtierd the way systemd would run deploy/systemd/kvtierd.service, and
checks what an operator expects of the unit on a host:

  1. the FUSE view kvtierd mounts is visible in the host's mount table;
  2. a worker uid in the unit's socket group reaches the socket (a full
     `kvtier stats` hello, not just a connect);
  3. the data kvtierd writes is readable by nobody else (UMask=);
  4. the stop signal unmounts and ends the daemon within TimeoutStopSec.

This machine's PID 1 is not systemd (and a booted systemd-nspawn container
cannot use FUSE without the host's cooperation), so the unit's execution
environment is reproduced from systemd.exec(5) rather than booted:

  * every directive that systemd.exec documents as giving the service its own
    mount namespace (ProtectSystem=, ProtectHome=, PrivateTmp=, ...) runs the
    daemon under `unshare --mount --propagation slave`: systemd turns every
    mount in such a namespace into a slave, so a mount made inside never
    reaches the host (systemd.exec, MountFlags=);
  * User=/Group= become the process's credentials, and Group= the group of
    RuntimeDirectory=, created with RuntimeDirectoryMode=;
  * UMask=, NoNewPrivileges= and CapabilityBoundingSet= through setpriv and
    the shell's umask;
  * KillSignal= and TimeoutStopSec= for the stop.

What it does not reproduce: Restart=always (needs a real service
manager) and DeviceAllow= (a cgroup device filter; /dev/fuse is allowed).

Usage: unit_sim.py UNIT KVTIERD KVTIER
Prints one line per check and `unit: N passed, M failed`; exits non-zero on a
failure.
"""
import grp
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

# systemd.exec(5): settings that set up a file system namespace for the
# unit's processes (and so turn its mounts into slaves of the host's).
MOUNT_NS_SETTINGS = {
    "ProtectSystem": lambda v: v.lower() not in ("no", "false", "0", ""),
    "ProtectHome": lambda v: v.lower() not in ("no", "false", "0", ""),
    "PrivateTmp": lambda v: v.lower() in ("yes", "true", "1", "disconnected"),
    "PrivateDevices": lambda v: v.lower() in ("yes", "true", "1"),
    "PrivateMounts": lambda v: v.lower() in ("yes", "true", "1"),
    "ProtectKernelTunables": lambda v: v.lower() in ("yes", "true", "1"),
    "ProtectKernelModules": lambda v: v.lower() in ("yes", "true", "1"),
    "ProtectKernelLogs": lambda v: v.lower() in ("yes", "true", "1"),
    "ProtectControlGroups": lambda v: v.lower() not in ("no", "false", "0", ""),
    "ProtectClock": lambda v: v.lower() in ("yes", "true", "1"),
    "ProtectHostname": lambda v: v.lower() in ("yes", "true", "1"),
    "ProtectProc": lambda v: v.lower() not in ("default", ""),
    "ProcSubset": lambda v: v.lower() not in ("all", ""),
    "ReadOnlyPaths": bool,
    "ReadWritePaths": bool,
    "InaccessiblePaths": bool,
    "ExecPaths": bool,
    "NoExecPaths": bool,
    "TemporaryFileSystem": bool,
    "BindPaths": bool,
    "BindReadOnlyPaths": bool,
    "RootDirectory": bool,
    "RootImage": bool,
    "MountFlags": bool,
    "MountAPIVFS": lambda v: v.lower() in ("yes", "true", "1"),
    "StateDirectory": lambda v: False,  # a directory, not a namespace
}


def parse_unit(path):
    service = {}
    section = None
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            if section != "Service" or "=" not in line:
                continue
            k, v = line.split("=", 1)
            service.setdefault(k.strip(), []).append(v.strip())
    return service


def last(service, key, default=None):
    vals = service.get(key)
    return vals[-1] if vals else default


def mounted(path):
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    unit, kvtierd, kvtier = sys.argv[1], os.path.realpath(sys.argv[2]), os.path.realpath(sys.argv[3])
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("skip unit simulation: needs root and /dev/fuse")
        return 0
    svc = parse_unit(unit)
    results = []

    def check(name, ok, detail=""):
        results.append(ok)
        print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"))

    ns_settings = [k for k, pred in MOUNT_NS_SETTINGS.items()
                   if k in svc and pred(last(svc, k, ""))]
    user = last(svc, "User", "root")
    group = last(svc, "Group")
    # Workers join group kvtier (the unit's header and OPERATIONS.md say
    # so), whatever the unit does with it.
    worker_group = "kvtier"
    created_group = False
    try:
        grp.getgrnam(worker_group)
    except KeyError:
        # The install step the docs give (groupadd --system kvtier).
        subprocess.run(["groupadd", "--system", worker_group], check=True)
        created_group = True
    worker_gid = grp.getgrnam(worker_group).gr_gid
    uid = pwd.getpwnam(user).pw_uid if not user.isdigit() else int(user)
    gid = (grp.getgrnam(group).gr_gid if group and not group.isdigit()
           else int(group) if group else pwd.getpwuid(uid).pw_gid)

    tmp = tempfile.mkdtemp(prefix="kvtier-unit-")
    os.chmod(tmp, 0o755)
    run_root = os.path.join(tmp, "run")  # stands for /run
    os.makedirs(run_root)
    runtime = os.path.join(run_root, last(svc, "RuntimeDirectory", "kvtier"))
    # systemd creates RuntimeDirectory= owned by User:Group with the mode.
    os.makedirs(runtime)
    os.chown(runtime, uid, gid)
    os.chmod(runtime, int(last(svc, "RuntimeDirectoryMode", "0755"), 8))
    mnt = os.path.join(tmp, "mnt")
    os.makedirs(mnt)
    data = os.path.join(tmp, "data")
    os.makedirs(data)
    os.chown(data, uid, gid)
    sock = os.path.join(runtime, "kvtierd.sock")
    cfg = os.path.join(tmp, "kvtierd.toml")
    with open(cfg, "w") as f:
        # The config the docs' worked example ends with: socket in the
        # runtime directory, mount on, G4 off (nothing to reach here).
        f.write(f"""[server]
socket = "{sock}"
socket_mode = "0660"
socket_group = "{worker_group}"
[g3]
dir = "{data}/g3"
capacity = "64MiB"
[g4]
url = ""
[metrics]
addr = "127.0.0.1:0"
[mount]
dir = "{mnt}"
allow_other = true
""")

    exec_start = last(svc, "ExecStart").split()
    argv = [kvtierd if a == "/usr/local/bin/kvtierd" else a for a in exec_start]
    argv = [cfg if a == "/etc/kvtier/kvtierd.toml" else a for a in argv]
    setpriv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    if last(svc, "NoNewPrivileges", "no").lower() in ("yes", "true", "1"):
        setpriv.append("--no-new-privs")
    caps = last(svc, "CapabilityBoundingSet")
    if caps:
        wanted = ",".join("+" + c.lower().removeprefix("cap_") for c in caps.split())
        setpriv += [f"--bounding-set=-all,{wanted}", f"--inh-caps=-all"]
    umask = last(svc, "UMask", "0022")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    for e in svc.get("Environment", []):
        for kv in e.split():
            k, _, v = kv.partition("=")
            env[k] = v.strip('"')
    inner = " ".join(f"'{a}'" for a in setpriv + argv)
    cmd = ["sh", "-c", f"umask {umask}; exec {inner}"]
    if ns_settings:
        cmd = ["unshare", "--mount", "--propagation", "slave"] + cmd
    log = open(os.path.join(tmp, "kvtierd.log"), "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(sock):
                r = subprocess.run([kvtier, "stats", "--socket", sock],
                                   capture_output=True)
                if r.returncode == 0:
                    break
            time.sleep(0.2)
        log.seek(0)
        started = proc.poll() is None and os.path.exists(sock)
        check("kvtierd starts under the unit", started, log.read()[-2000:])
        if not started:
            return 1
        # The daemon logs `G3 mounted` once the mount is up (or fails).
        deadline = time.time() + 30
        while time.time() < deadline and not mounted(mnt):
            time.sleep(0.2)
        check("the FUSE view is visible on the host", mounted(mnt),
              f"not in the host's mount table; namespace settings: {ns_settings}")
        worker = subprocess.run(
            ["setpriv", "--reuid=65534", f"--regid=65534", f"--groups={worker_gid}",
             kvtier, "stats", "--socket", sock],
            capture_output=True, text=True)
        check("a worker uid in the socket group reaches the socket",
              worker.returncode == 0, worker.stderr.strip()[-500:])
        stranger = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             kvtier, "stats", "--socket", sock],
            capture_output=True, text=True)
        check("a uid outside the socket group is refused", stranger.returncode != 0,
              "a uid outside the group reached the socket")
        # The refusal says what is missing: the path, its group, and ours.
        said = stranger.stderr
        check("the refusal names the group the uid lacks",
              "permission denied on" in said and f"group {worker_group} ({worker_gid})" in said
              and "uid 65534" in said, said.strip()[-500:])
        readable = []
        for root, dirs, files in os.walk(data):
            for n in dirs + files:
                p = os.path.join(root, n)
                m = os.lstat(p).st_mode
                if not stat.S_ISLNK(m) and m & 0o077:
                    readable.append(f"{p} {oct(m & 0o777)}")
        check("nothing under g3.dir is open to group or others", not readable,
              "; ".join(readable[:5]))
        sig = getattr(signal, last(svc, "KillSignal", "SIGTERM"))
        proc.send_signal(sig)
        timeout = float(last(svc, "TimeoutStopSec", "90").rstrip("s"))
        try:
            proc.wait(timeout=timeout)
            stopped = True
        except subprocess.TimeoutExpired:
            stopped = False
        check("the stop signal ends kvtierd in TimeoutStopSec", stopped)
        check("the stop unmounts the view", not mounted(mnt), "still mounted after stop")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if mounted(mnt):
            subprocess.run(["umount", "-l", mnt])
        shutil.rmtree(tmp, ignore_errors=True)
        if created_group:
            subprocess.run(["groupdel", worker_group])
    failed = results.count(False)
    print(f"unit: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
