"""The tests of scripts/ run a script as a process or load it as a module (its file name has a
dash, so it cannot be imported by name): `run_script` and `script_module`, used by
tests/test_scripts.py and tests/scripts/."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def run_script(filename: str, args: list[str], timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`python3 scripts/filename args` from the repository root with this checkout on PYTHONPATH
    (plus `env`), its output captured as text; subprocess.TimeoutExpired after `timeout` s.
    This machine may have no GPU: a script that reaches its GPU work ends there."""
    return subprocess.run([sys.executable, str(SCRIPTS / filename), *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=timeout)


@contextlib.contextmanager
def script_module(filename: str, name: str) -> Iterator[object]:
    """scripts/`filename` executed as module `name` (its `main` not run), registered in
    sys.modules while in use (a dataclass looks its module up while the class is built) and
    removed after."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
