"""The one compile cache (`musebench.kernels.compilation`): keys, single builds, capture refusal.

CPU only and compiles nothing: `build` is a counter here. Which kernel modules use the cache is
checked by scanning their source: no module-level dict or functools cache of compiled kernels
is left in musebench/kernels/.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass")

from musebench.kernels import compilation  # noqa: E402

KERNELS = Path(__file__).resolve().parents[2] / "musebench" / "kernels"


class _KernelA:
    pass


class _KernelB:
    pass


def _counting():
    calls = []

    def build():
        calls.append(1)
        return object()

    return build, calls


def test_key_is_kernel_arch_dump_folder_and_sorted_config():
    key = compilation.kernel_key(_KernelA, arch="sm_90a", ptx_dir=None, tp=8, enable_pdl=True)
    assert key == (f"{__name__}._KernelA", "sm_90a", None, (("enable_pdl", True), ("tp", 8)))
    assert key == compilation.kernel_key(_KernelA, arch="sm_90a", ptx_dir=None, enable_pdl=True, tp=8)
    assert key != compilation.kernel_key(_KernelB, arch="sm_90a", ptx_dir=None, tp=8, enable_pdl=True)
    assert key != compilation.kernel_key(_KernelA, arch="sm_100a", ptx_dir=None, tp=8, enable_pdl=True)
    assert key != compilation.kernel_key(_KernelA, arch="sm_90a", ptx_dir="/tmp/x", tp=8, enable_pdl=True)


def test_each_variant_is_built_once_and_clear_forgets():
    cache = compilation.CompileCache()
    build, calls = _counting()
    a = compilation.kernel_key(_KernelA, arch=None, ptx_dir=None, tp=2)
    b = compilation.kernel_key(_KernelB, arch=None, ptx_dir=None, tp=2)
    first = cache.compiled(a, build)
    assert cache.compiled(a, build) is first and len(calls) == 1
    assert cache.compiled(b, build) is not first and len(calls) == 2
    assert a in cache and cache.keys() == {a, b}
    cache.clear(_KernelA)
    assert a not in cache and b in cache
    assert cache.compiled(a, build) is not first and len(calls) == 3
    cache.clear()
    assert len(cache) == 0


def test_concurrent_requests_build_once():
    cache = compilation.CompileCache()
    build, calls = _counting()
    key = compilation.kernel_key(_KernelA, arch=None, ptx_dir=None)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.compiled(key, build))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1


def test_a_new_variant_is_refused_during_capture_a_cached_one_is_not(monkeypatch):
    cache = compilation.CompileCache()
    build, calls = _counting()
    cached = compilation.kernel_key(_KernelA, arch=None, ptx_dir=None)
    compiled = cache.compiled(cached, build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cache.compiled(cached, build) is compiled
    with pytest.raises(RuntimeError, match="compile the B kernels before CUDA graph capture"):
        cache.compiled(compilation.kernel_key(_KernelB, arch=None, ptx_dir=None), build, what="the B kernels")
    assert len(calls) == 1 and len(cache) == 1


def test_a_failed_build_caches_nothing():
    cache = compilation.CompileCache()

    def broken():
        raise ValueError("bad knob")

    key = compilation.kernel_key(_KernelA, arch=None, ptx_dir=None)
    with pytest.raises(ValueError):
        cache.compiled(key, broken)
    assert key not in cache


def test_kernel_modules_keep_no_cache_of_their_own():
    """Every compile_* goes through `compilation.compiled`: no module-level dict and no functools
    cache is left in a kernel module."""
    found = []
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "compilation.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Dict) and not value.keys:
                found.append(f"{path.name}:{node.lineno}: module-level empty dict")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for decorator in node.decorator_list:
                    text = ast.unparse(decorator)
                    if "cache" in text:
                        found.append(f"{path.name}:{node.lineno}: {text}")
    assert not found, found
    uses = [path.name for path in KERNELS.glob("*.py") if "compilation.compiled(" in path.read_text()]
    assert {"approx.py", "ep_tail.py", "routing.py", "tp_tail.py"} <= set(uses)
