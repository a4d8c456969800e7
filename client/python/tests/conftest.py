"""Fixtures: a real kvtierd per test (temp G3 dir, file:// G4), started from
the workspace build (target/<profile>/kvtierd, or $KVTIER_TEST_KVTIERD)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
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

    def __init__(self, config: str | None = None, g4: bool = True) -> None:
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-py-"))
        self.socket = str(self.dir / "kvtierd.sock")
        self.args = [
            kvtierd_bin(),
            "--socket", self.socket,
            "--g3-dir", str(self.dir / "g3"),
            "--g3-capacity", "256MiB",
            "--metrics-addr", f"127.0.0.1:{free_port()}",
            "--g4", f"file://{self.dir / 'g4'}" if g4 else "",
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

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        self.kill9()
        self.start()

    def close(self) -> None:
        self.kill9()
        shutil.rmtree(self.dir, ignore_errors=True)


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
