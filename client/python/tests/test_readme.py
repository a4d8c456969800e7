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


def test_the_install_line_before_the_example_installs_what_it_imports():
    # A reader copies the `pip install` line above the block and then runs
    # the block: every module it imports besides kvtier and the standard
    # library must be on that line (the issue-32 trial met a README whose
    # example needed numpy while no install line said so).
    text = (REPO / "README.md").read_text()
    block_at = text.index("```python\n")
    install = re.findall(r"`pip install ([^`]*)`", text[:block_at])
    assert install, "no `pip install ...` line before README.md's first python block"
    packages = install[-1].split()
    assert "./client/python" in packages, install[-1]
    imported = set()
    for line in first_python_block().splitlines():
        m = re.match(r"\s*(?:import|from)\s+(.+)", line)
        if m:
            head = m.group(1).split(" import ")[0]
            for part in head.split(","):
                imported.add(part.strip().split(" as ")[0].split(".")[0])
    third_party = {m for m in imported - {"kvtier"} if m not in sys.stdlib_module_names}
    assert third_party, "the example imports nothing besides kvtier: update this test"
    missing = sorted(third_party - set(packages))
    assert not missing, f"README's install line `pip install {install[-1]}` lacks {missing}"
