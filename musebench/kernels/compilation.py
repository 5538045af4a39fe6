"""What every kernel module shares to compile and call its kernels (host side of device code).

- `compiled(key, build)`: the one compile cache of the process. `kernel_key(kernel_class,
  arch=..., ptx_dir=..., **config)` names a variant by exactly its compile-time values (the
  kernel class, its compile-time configuration, the target and the PTX dump folder; never a
  runtime value such as the rank); `build()` compiles it on the first request, and the result
  serves every later one. `clear()` empties it (tests), `CACHE` is the cache itself.
- `refuse_during_capture(what)`: compiling inside CUDA-graph capture would allocate and
  synchronize; the cache calls this before compiling a new variant, so a variant first asked
  for during capture is refused (compile before capture).
- `compiler(arch, ptx_dir)`: `cute.compile` keeping the cubin (for `kernels.occupancy`), for a
  target (`sm_90a`, `sm_100a`; compiles with no GPU present) and, with `ptx_dir`, keeping the PTX
  there (the compile tests read it). The DSL keeps an artifact by writing it to a file and
  reading it back into `compiled.artifacts`; those files go to `ptx_dir` when given, else to
  `dump_dir()`, never to the current directory (the DSL's default).
- `dump_dir()`: `$MUSEBENCH_CACHE_DIR/cute/pid<N>`, else `~/.cache/musebench/cute/pid<N>`: one
  folder per process, created on use and removed at exit.
- `fake_flat(dtype, divisibility, align)`: a 1-D fake tensor with a symbolic extent, so one
  compiled variant serves every size that is a multiple of `divisibility`.
- `cute_view` / `cute_flat`: torch tensors as CuTe tensors at call time; `from_dlpack` exports
  with stream -1 in CuTe DSL 4.8 (no producer synchronization), so it is safe under capture and
  allocates no device memory.
"""

from __future__ import annotations

import atexit
import os
import shutil
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import cutlass.cute as cute
import torch
from cutlass.base_dsl.compiler import DumpDir
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor


def refuse_during_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"compile {what} before CUDA graph capture")


CACHE_DIR_ENV = "MUSEBENCH_CACHE_DIR"


def dump_dir() -> str:
    """The folder compiles write their kept artifacts into when the caller names none (created).

    `$MUSEBENCH_CACHE_DIR/cute/pid<N>` if that variable is set and non-empty, else
    `~/.cache/musebench/cute/pid<N>`: one folder per process, removed when it exits. Files there
    are scratch (the DSL reads each back into memory as soon as it is written), but processes
    compiling at once (torchrun ranks) must never read back a file another is still writing.
    """
    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "musebench"
    path = Path(root) / "cute" / f"pid{os.getpid()}"
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return str(path)


def kernel_name(kernel: type) -> str:
    """`module.Class` of a kernel class: the first element of its cache keys."""
    return f"{kernel.__module__}.{kernel.__qualname__}"


def kernel_key(kernel: type, *, arch: str | None, ptx_dir: str | None, **config: Hashable) -> tuple:
    """The cache key of one compiled variant: (kernel, arch, ptx_dir, config sorted by name).

    `config` holds exactly the kernel's compile-time values, normalised by the caller (bools as
    bool, floats as float) so that equal variants have equal keys; runtime arguments stay out.
    """
    return (kernel_name(kernel), arch, ptx_dir, tuple(sorted(config.items())))


class CompileCache:
    """Compiled kernels of this process, by `kernel_key`; a variant is compiled once."""

    def __init__(self) -> None:
        self._entries: dict[tuple, Any] = {}
        self._lock = threading.RLock()  # virtual ranks bind from threads: compile each variant once

    def compiled(self, key: tuple, build: Callable[[], Any], *, what: str | None = None) -> Any:
        """The variant `key`, compiled by `build()` on first use; RuntimeError where that first use
        happens during CUDA-graph capture (`what` names the kernels in the message)."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                refuse_during_capture(what or key[0])
                found = self._entries[key] = build()
            return found

    def keys(self) -> frozenset[tuple]:
        with self._lock:
            return frozenset(self._entries)

    def clear(self, kernel: type | None = None) -> None:
        """Forget every variant, or only those of `kernel` (the next request compiles again)."""
        with self._lock:
            if kernel is None:
                self._entries.clear()
            else:
                name = kernel_name(kernel)
                for key in [key for key in self._entries if key[0] == name]:
                    del self._entries[key]

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


CACHE = CompileCache()


def compiled(key: tuple, build: Callable[[], Any], *, what: str | None = None) -> Any:
    """`CACHE.compiled`: the one compile cache every kernel module uses."""
    return CACHE.compiled(key, build, what=what)


def clear(kernel: type | None = None) -> None:
    """`CACHE.clear`: forget compiled variants (for tests)."""
    CACHE.clear(kernel)


def compiler(arch: str | None, ptx_dir: str | None):
    # the cubin stays with the compiled function: the occupancy query (kernels.occupancy) loads it
    options = [cute.KeepCUBIN(True)]
    if arch is not None:
        options.append(cute.GPUArch(arch))
    if ptx_dir is not None:
        options.append(cute.KeepPTX(True))
    # always a dump folder: without one the DSL writes the kept files into the current directory
    options.append(DumpDir(ptx_dir if ptx_dir is not None else dump_dir()))
    return cute.compile[tuple(options)]


def fake_flat(dtype, divisibility: int, align: int):
    return make_fake_compact_tensor(dtype, (cute.sym_int32(divisibility=divisibility),), assumed_align=align)


def cute_view(tensor: torch.Tensor, align: int) -> cute.Tensor:
    return from_dlpack(tensor.detach(), assumed_align=align)


def cute_flat(tensor: torch.Tensor, align: int, divisibility: int) -> cute.Tensor:
    return cute_view(tensor.view(-1), align).mark_compact_shape_dynamic(mode=0, divisibility=divisibility)


def nvdisasm() -> str | None:
    """The nvdisasm binary (PATH, or the nvidia-cuda-nvdisasm wheel's), for the scripts that count
    a kernel's SASS (scripts/attn2-sass.py, scripts/qkv-front-sass.py); None where there is none."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia.cu13  # noqa: F401  (the pip wheel's binaries)
    except ImportError:
        return None
    path = Path(next(iter(nvidia.cu13.__path__))) / "bin" / "nvdisasm"
    return str(path) if path.exists() else None
