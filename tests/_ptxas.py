"""ptxas on kept PTX, for the compile tests' register and spill assertions (no GPU needed).

`assemble(ptx, arch, tmp_path)` runs `ptxas -O3 -v` and returns its report (stderr). It skips
the calling test, saying why, where ptxas is not on PATH or is older than the PTX's `.version`
(CuTe DSL 4.8.0 emits PTX 9.4; `make test-dsl-compat` runs where the PATH's ptxas reads 9.0): what
it cannot assemble says nothing about the kernel. Any other ptxas error fails the test.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

NO_SPILLS = re.compile(r"\b0 bytes spill stores, 0 bytes spill loads")


def assemble(ptx: str, arch: str, tmp_path: Path, name: str = "kernel") -> str:
    """ptxas's `-v` report of `ptx` assembled for `arch` (skip or fail as the module says)."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not on PATH")
    source = tmp_path / f"{name}.ptx"
    source.write_text(ptx)
    result = subprocess.run([ptxas, f"-arch={arch}", "-O3", "-v", str(source), "-o", str(tmp_path / f"{name}.cubin")],
                            capture_output=True, text=True)
    if "Unsupported .version" in result.stderr:
        pytest.skip(f"the ptxas on PATH is older than this CuTe DSL's PTX: {result.stderr.strip().splitlines()[0]}")
    assert result.returncode == 0, result.stderr
    return result.stderr


def assert_no_spills(report: str) -> None:
    assert NO_SPILLS.search(report), report
