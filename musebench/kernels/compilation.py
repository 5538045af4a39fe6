"""What every kernel module shares to compile and call its kernels (host side of device code).

- `refuse_during_capture(what)`: compiling inside CUDA-graph capture would allocate and
  synchronize; every `compile_*` calls this before compiling a new variant.
- `compiler(arch, ptx_dir)`: `cute.compile` keeping the cubin (for `kernels.occupancy`), for a
  target (`sm_90a`, `sm_100a`; compiles with no GPU present) and, with `ptx_dir`, keeping the PTX
  there (the compile tests read it). The DSL keeps an artifact by writing it to a file and
  reading it back into `compiled.artifacts`; those files go to `ptx_dir` when given, else to
  `dump_dir()`, never to the current directory (the DSL's default).
- `dump_dir()`: `$MUSEBENCH_CACHE_DIR/cute`, else `~/.cache/musebench/cute`; created on use.
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
from pathlib import Path

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
