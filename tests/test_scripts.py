"""The Python scripts under scripts/ load on a CPU-only host (their GPU work runs only as __main__)."""

from __future__ import annotations

import pathlib
import runpy

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


def test_there_are_scripts_to_check():
    assert {path.name for path in SCRIPTS} >= {"profile-routing.py", "profile-tail.py"}


@pytest.mark.parametrize("path", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_a_script_loads_without_a_gpu(path):
    namespace = runpy.run_path(str(path), run_name="musebench_script_check")
    assert callable(namespace.get("main")), f"{path.name} has no main()"
