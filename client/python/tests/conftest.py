"""Fixtures: a real kvtierd per test (temp G3 dir, file:// G4), started from
the workspace build (target/<profile>/kvtierd, or $KVTIER_TEST_KVTIERD)."""

from __future__ import annotations

import array
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest

import kvtier

REPO = pathlib.Path(__file__).resolve().parents[3]


def kvtierd_bin() -> str:
    env = os.environ.get("KVTIER_TEST_KVTIERD")
    if env:
        return env
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    for profile in ("debug", "release"):
        p = target / profile / "kvtierd"
        if p.exists():
            return str(p)
    raise RuntimeError(
        f"no kvtierd under {target}: run `cargo build -p kvtier-daemon` or set KVTIER_TEST_KVTIERD"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """A running kvtierd in a temp dir; kill9() and restart() keep its data."""

    def __init__(
        self,
        config: str | None = None,
        g4: bool | str = True,
        g3_capacity: str = "256MiB",
        prepare=None,
    ) -> None:
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-py-"))
        if prepare is not None:
            # Seeds the data directories (g3/, g4/) before the first start.
            prepare(self.dir)
        self.socket = str(self.dir / "kvtierd.sock")
        self.metrics_port = free_port()
        self.args = [
            kvtierd_bin(),
            "--socket", self.socket,
            "--g3-dir", str(self.dir / "g3"),
            "--g3-capacity", g3_capacity,
            "--metrics-addr", f"127.0.0.1:{self.metrics_port}",
            # A str is G4's URL (an S3 endpoint the config describes).
            "--g4", g4 if isinstance(g4, str) else f"file://{self.dir / 'g4'}" if g4 else "",
        ]
        if config is not None:
            cfg = self.dir / "kvtierd.toml"
            cfg.write_text(config)
            self.args += ["--config", str(cfg)]
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        env = dict(os.environ, RUST_LOG="warn")
        self.proc = subprocess.Popen(self.args, env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket)
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("kvtierd did not listen within 20 s")

    def metrics(self) -> str:
        """The daemon's /metrics exposition."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``
        (0 when none)."""
        import re

        total = 0.0
        for line in self.metrics().splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            have = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
        return total

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """A clean stop (SIGTERM, as systemd stops it)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)

    def restart(self, clean: bool = False) -> None:
        """kill -9 (or, with ``clean``, a clean stop) and start again on
        the same data."""
        if clean:
            self.stop()
        else:
            self.kill9()
        self.start()

    def close(self) -> None:
        self.kill9()
        shutil.rmtree(self.dir, ignore_errors=True)


def g3_blocks(g3_dir: pathlib.Path):
    """Yields ``(path, offset, ns_id_hex, key_hex)`` for every block on a
    G3 directory's disk: each file under ``blocks/<ns>/<shard>/<key>``
    (offset 0), and each slot of ``slots/<pages>.slab`` whose header names
    a block (the daemon's g3/slots.rs: a block of ``pages * 4096`` bytes
    at each multiple of that length; docs/FORMAT.md gives the header)."""
    blocks = g3_dir / "blocks"
    if blocks.is_dir():
        for p in blocks.rglob("*"):
            if p.is_file() and len(p.relative_to(blocks).parts) == 3:
                yield p, 0, p.relative_to(blocks).parts[0], p.name
    slots = g3_dir / "slots"
    if slots.is_dir():
        for p in sorted(slots.glob("*.slab")):
            slot_bytes = int(p.name[: -len(".slab")]) * 4096
            with open(p, "rb") as f:
                size = p.stat().st_size
                for at in range(0, size - slot_bytes + 1, slot_bytes):
                    f.seek(at)
                    head = f.read(4096)
                    if head[:8] != b"KVTIERB\x01":
                        continue
                    k = head[48]
                    yield p, at, head[16:32].hex(), head[56 : 56 + k].hex()


def flip_at(path: pathlib.Path, at: int) -> None:
    """Flips the byte at ``at`` of ``path``."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def flip_on_disk(daemon: "Daemon", key: bytes, at: int) -> None:
    """Flips the payload byte ``at`` of ``key``'s G3 block (its file or
    its slab slot: corruption at rest, under the daemon's feet)."""
    (found,) = [(p, o) for p, o, _, k in g3_blocks(daemon.dir / "g3") if k == key.hex()]
    flip_at(found[0], found[1] + 4096 + at)  # the payload follows the header page


def corrupt_every_block_file(daemon: "Daemon", ns_id: str | None = None) -> int:
    """Flips one payload byte of every block on the daemon's G3 (block
    files and slab slots, or only namespace ``ns_id``'s: not its index,
    which is another fault); returns how many."""
    n = 0
    assert (daemon.dir / "g3").is_dir()
    for p, at, ns, _ in list(g3_blocks(daemon.dir / "g3")):
        if ns_id is None or ns == ns_id:
            flip_at(p, at + 4096 + 17)
            n += 1
    return n


@pytest.fixture
def daemon():
    d = Daemon()
    yield d
    d.close()


@pytest.fixture
def start_daemon():
    started: list[Daemon] = []

    def start(**kw) -> Daemon:
        d = Daemon(**kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


BLOCK = 256 * 1024


@pytest.fixture
def ns():
    return kvtier.Namespace("py-test/model", kvtier.Layout.with_block_bytes(BLOCK), tenant_salt=b"py")


@pytest.fixture
def client(daemon):
    return kvtier.Client(socket=daemon.socket, timeout_ms=5000)


class Proxy:
    """A Unix-socket proxy between a client and kvtierd that forwards bytes
    and passed fds (SCM_RIGHTS), records every byte the client sends
    (``sent``), and holds every reply ``reply_delay_s`` (a slow daemon)."""

    def __init__(self, target: str, path: str, reply_delay_s: float = 0.0) -> None:
        self.target, self.path, self.reply_delay_s = target, path, reply_delay_s
        self.sent = bytearray()
        self.lock = threading.Lock()
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(path)
        self.srv.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            d = socket.socket(socket.AF_UNIX)
            d.connect(self.target)
            threading.Thread(target=self._pump, args=(c, d, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(d, c, False), daemon=True).start()

    def _pump(self, src, dst, from_client):
        fds_space = socket.CMSG_SPACE(253 * 4)
        try:
            while True:
                data, anc, _flags, _ = src.recvmsg(1 << 20, fds_space)
                if not data:
                    break
                fds = array.array("i")
                for lvl, typ, cd in anc:
                    if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                        fds.frombytes(cd[: len(cd) - (len(cd) % 4)])
                if from_client:
                    with self.lock:
                        self.sent += data
                elif self.reply_delay_s:
                    time.sleep(self.reply_delay_s)
                cms = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if fds else []
                dst.sendmsg([data], cms)
                for fd in fds:
                    os.close(fd)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def reset(self):
        with self.lock:
            n = len(self.sent)
            self.sent.clear()
        return n

    def close(self):
        self.srv.close()
