"""The engine connectors' suite: runs in the engines' venv
(scripts/engines-venv.sh) against real kvtierd processes, reusing the
package suite's daemon fixtures (tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location(
    "kvtier_py_test_support", pathlib.Path(__file__).resolve().parents[1] / "tests" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
support = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(support)

Daemon = support.Daemon
# Daemons a test starts itself (its own config), closed after it.
start_daemon = support.start_daemon


@pytest.fixture
def daemon():
    d = Daemon()
    yield d
    d.close()


@pytest.fixture(scope="module")
def hdaemon():
    """One kvtierd for a whole module (CI time: each test uses its own
    keys), with G4 admission ``after-first-reuse`` so that which blocks
    reach G4 at store time shows which hints arrived."""
    d = Daemon(config='[g4]\nadmission = "after-first-reuse"\n')
    yield d
    d.close()
