"""Shared by the tests of scripts/: a script loaded as a module by its path (its name has a dash)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def run_script(filename: str, args: list[str], timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`python3 scripts/filename args` from the repository root with this checkout on PYTHONPATH
    (plus `env`), its output captured."""
    return subprocess.run([sys.executable, str(SCRIPTS / filename), *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=timeout)


@contextlib.contextmanager
def script_module(filename: str, name: str) -> Iterator[object]:
    """scripts/`filename` executed as module `name`, registered in sys.modules while in use (a
    dataclass looks its module up while the class is built) and removed after."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
