"""Compiles leave no files in the current directory: the DSL's kept artifacts (the cubin the
occupancy query loads, the PTX the compile tests read) go to the caller's `ptx_dir` or to
`compilation.dump_dir()`, and stay in memory on the compiled function. CPU only (sm_90a target).

The kernel is this file's own one-thread store, so every test compiles afresh (the kernel modules'
caches would hand back a variant compiled before the working directory changed).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

from musebench.kernels import compilation  # noqa: E402

STORED = 7


class _StoreKernel:
    """One thread writes STORED to out[0]: the smallest kernel that has a cubin."""

    @cute.jit
    def __call__(self, out: cute.Tensor, stream: cuda.CUstream):
        self.kernel(out).launch(grid=(1, 1, 1), block=(1, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Tensor):
        out[0] = Int32(STORED)


def _compile(ptx_dir: str | None):
    fake = compilation.fake_flat(cutlass.Int32, 1, 4)
    return compilation.compiler("sm_90a", ptx_dir)(_StoreKernel(), fake, cuda.CUstream(0))


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def test_compile_writes_nothing_to_cwd_and_dumps_into_the_cache_dir(cwd, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(compilation.CACHE_DIR_ENV, str(cache))
    compiled = _compile(None)
    assert _files(cwd) == []
    own = cache / "cute" / f"pid{os.getpid()}"  # one folder per process: ranks never read each other's files
    assert compilation.dump_dir() == str(own)
    assert [p.suffix for p in own.iterdir()] == [".cubin"]
    # the occupancy query loads the cubin from memory, not from the dump
    assert isinstance(compiled.__cubin__, bytes) and compiled.__cubin__[:4] == b"\x7fELF"


def test_default_cache_dir_is_under_home(cwd, tmp_path, monkeypatch):
    monkeypatch.delenv(compilation.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _compile(None)
    assert _files(cwd) == []
    assert compilation.dump_dir() == str(tmp_path / "home" / ".cache" / "musebench" / "cute" / f"pid{os.getpid()}")
    assert any(p.suffix == ".cubin" for p in Path(compilation.dump_dir()).iterdir())


def test_ptx_dir_takes_the_dumps(cwd, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(compilation.CACHE_DIR_ENV, str(cache))
    ptx_dir = tmp_path / "ptx"
    ptx_dir.mkdir()
    compiled = _compile(str(ptx_dir))
    assert _files(cwd) == []
    assert not cache.exists()
    assert sorted(p.suffix for p in ptx_dir.iterdir()) == [".cubin", ".ptx"]
    assert ".target sm_90a" in compiled.artifacts.PTX
    assert os.fspath(ptx_dir) not in compiled.artifacts.PTX  # the text, not the path, is kept
