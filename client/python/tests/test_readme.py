"""The README's first ```python block runs as is against a real kvtierd."""

import os
import re
import subprocess
import sys

from conftest import REPO


def first_python_block() -> str:
    text = (REPO / "README.md").read_text()
    m = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no ```python block"
    return m.group(1)


def test_readme_example_runs(daemon, tmp_path):
    code = first_python_block()
    assert "kvtier.Client()" in code
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    env = dict(os.environ, KVTIER_SOCKET=daemon.socket)
    for _ in range(2):  # the second run finds the first run's blocks cached
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
