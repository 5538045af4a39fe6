"""The hardware's approximate instructions, elementwise on CUDA float32 tensors.

`ex2.approx.f32`, `div.full.f32` and `rsqrt.approx.ftz.f32` are not correctly rounded, and no torch
operator is guaranteed to compile to them, so the references take their bits from these tiny
CuTe DSL kernels. One thread per element, 256 threads per block, one instruction from
`musebench.kernels.ptx` per element; compiled lazily once per (op, device architecture) and
cached. Test helpers: they allocate their output.

`hardware_approximations()` bundles them as the `musebench.numerics.Approximations` that the
callers above the references (the harness, the GPU tests) inject into them: the references
never import this device code.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor

from musebench.kernels import compilation, division, ptx
from musebench.numerics import PRECISE, Approximations

THREADS = 256
UNARY_OPS = ("ex2_approx_f32", "rsqrt_approx_ftz_f32")
BINARY_OPS = ("div_full_f32", "fast_quotient_f32", "quotient_rn_f32")


class _ElementwiseKernel:
    """out[i] = op(a[i]) or op(a[i], b[i]) for i < n."""

    def __init__(self, *, op: str) -> None:
        if op not in UNARY_OPS + BINARY_OPS:
            raise ValueError(f"op must be one of {UNARY_OPS + BINARY_OPS}, got {op!r}")
        self.op = op
        self.binary = op in BINARY_OPS

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor, n: Int32, stream: cuda.CUstream) -> None:
        self.kernel(a, b, out, n).launch(
            grid=((n + THREADS - 1) // THREADS, 1, 1), block=(THREADS, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor, n: Int32) -> None:
        block, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        i = block * THREADS + tidx
        if i < n:
            if cutlass.const_expr(self.op == "ex2_approx_f32"):
                out[i] = ptx.ex2_approx_f32(Float32(a[i]))
            if cutlass.const_expr(self.op == "rsqrt_approx_ftz_f32"):
                out[i] = ptx.rsqrt_approx_ftz_f32(Float32(a[i]))
            if cutlass.const_expr(self.op == "div_full_f32"):
                out[i] = ptx.div_full_f32(Float32(a[i]), Float32(b[i]))
            if cutlass.const_expr(self.op == "fast_quotient_f32"):
                x, y = Float32(a[i]), Float32(b[i])
                out[i] = division.fast_quotient(x, y, division.fast_reciprocal(y))
            if cutlass.const_expr(self.op == "quotient_rn_f32"):
                out[i] = division.quotients_rn([Float32(a[i])], [Float32(b[i])])[0]


def compile_elementwise(op: str, *, arch: str | None = None, ptx_dir: str | None = None) -> Any:
    """The compiled kernel for `op` (cached by op, arch and ptx_dir; never during capture)."""

    def build() -> Any:
        # not kernels.compilation.compiler: no occupancy query needs the cubin of these helpers
        options = []
        if arch is not None:
            options.append(cute.GPUArch(arch))
        if ptx_dir is not None:
            from cutlass.base_dsl.compiler import DumpDir

            options.extend([cute.KeepPTX(True), DumpDir(ptx_dir)])
        compiler = cute.compile[tuple(options)] if options else cute.compile
        flat = make_fake_compact_tensor(Float32, (cute.sym_int32(),), assumed_align=4)
        return compiler(_ElementwiseKernel(op=op), flat, flat, flat, Int32(1), cuda.CUstream(0))

    key = compilation.kernel_key(_ElementwiseKernel, arch=arch, ptx_dir=ptx_dir, op=op)
    return compilation.compiled(key, build, what="the approximation kernels")


def _arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def _flat(t: torch.Tensor) -> cute.Tensor:
    return from_dlpack(t.detach(), assumed_align=4).mark_compact_shape_dynamic(mode=0)


def _apply(op: str, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    tensors = (a,) if b is None else (a, b)
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_cuda:
            raise TypeError(f"{op} takes CUDA float32 tensors")
    if b is not None:
        a, b = torch.broadcast_tensors(a, b)
    shape = a.shape
    a = a.contiguous().reshape(-1)
    b = b.contiguous().reshape(-1) if b is not None else a
    out = torch.empty_like(a)
    if a.numel():
        with torch.cuda.device(a.device):
            compiled = compile_elementwise(op, arch=_arch_of(a.device))
            stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
            compiled(_flat(a), _flat(b), _flat(out), Int32(a.numel()), stream)
    return out.reshape(shape)


def ex2_approx_f32(x: torch.Tensor) -> torch.Tensor:
    """`ex2.approx.f32` of every element (CUDA float32 in, same shape out)."""
    return _apply("ex2_approx_f32", x)


def rsqrt_approx_ftz_f32(x: torch.Tensor) -> torch.Tensor:
    """`rsqrt.approx.ftz.f32` of every element (CUDA float32 in, same shape out)."""
    return _apply("rsqrt_approx_ftz_f32", x)


def div_full_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`div.full.f32` of a / b elementwise, broadcast (CUDA float32 in, broadcast shape out)."""
    return _apply("div_full_f32", a, b)


def fast_quotient_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`kernels.division`'s fast path of a / b elementwise, unguarded (its bits equal IEEE division
    where both operands are `division.in_fast_range`; outside, anything): the probe of its GPU test."""
    return _apply("fast_quotient_f32", a, b)


def quotient_rn_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`kernels.division.quotients_rn` of a / b elementwise (one-element lists): IEEE division's
    bits for every operand, the fast path inside its range, `div.rn.f32` outside."""
    return _apply("quotient_rn_f32", a, b)


def _rsqrt_hardware(x: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda:
        raise RuntimeError("the hardware rsqrt.approx.f32 needs a CUDA tensor")
    return torch.rsqrt(x)


def hardware_approximations() -> Approximations:
    """The approximate instructions' own bits on the current CUDA device, for the references.

    rsqrt: torch's CUDA rsqrt is `rsqrt.approx.f32` (measured, H200: 2^24 random inputs, 0
    mismatches); the EP stock's `rsqrt.approx.ftz.f32` gives the same bits wherever the eps rule
    (`musebench.numerics.check_eps`) lets the argument go. ex2 and div.full come from the kernels
    above (no torch operator has their bits).
    """
    return Approximations(name="hardware", rsqrt=_rsqrt_hardware, ex2=ex2_approx_f32, div_full=div_full_f32)


def approximations_for(device: torch.device | str) -> Approximations:
    """PRECISE on CPU, the hardware's instructions on CUDA."""
    return hardware_approximations() if torch.device(device).type == "cuda" else PRECISE
