"""The qkv_front family (`front`): the QKV + o-gate projection fused with qk-norm, RoPE and the
KV-cache insert, on virtual ranks of one GPU (each rank its own weight shard, no mailboxes).

Every rank projects the same x bf16 [T, 8192] through its own weight [N, 8192] (N = 1152 kv,
kv = 16 / tp) with `cute_ops.launch_qkv_front` of the implementation under test, the tap variant
(the kernel's BF16 projection before the epilogue). Outputs per rank: `out` [T, N], `tap` [T, N]
and `kv_cache`, the whole cache buffer [GUARD_PAGES + PAGES + GUARD_PAGES, kv, 16, 128] (the
driver poisons all three before each call). The launch gets the PAGES pages between the guards
(`pool`), so a write just outside the cache it was given (a negative slot taken as a slot, an
index past the last page) lands in a guard page and fails the bitwise check like any stray write.

Checks, raw bits: at bind, the launch without the tap (what a deployment runs: PDL, no tap) and,
where the implementation's launch takes `enable_pdl`, the build without PDL write the same out and
cache bits as the tap launch (`check_variants_agree`), so what `expected` checks of the tap launch
holds of them. A bench case (`FrontCase.bench`, `musebench bench front`) calls the deployment's
launch itself: its `tail µs` column times that launch, its outputs are out and the cache (the tap
launch is the part `with tap`, timed apart; the build without PDL the baseline `front without
PDL`, whose cell carries the PDL build's ratio to it, measured in the same run). With cold weights
(`FrontCase.cold_copies`, `bench front --cold-weights`) the baseline `cold weights` times the
deployment's launch with each of the graph's calls reading its own copy of the weight
(`cold_copies` = --calls copies, at least COLD_L2_FACTOR L2s of weight between two reads of a
copy): what a deployment sees, where every layer's weight is another, beside the tail column's
one weight (L2-resident at N 1152 and 2304); every copy's launch is checked once to write the
tail launch's bits (`check_cold_copies_agree`). Beside it `torch matmul, cold weights` times cuBLAS
alone (torch.matmul into `torch matmul`'s qkv buffer) with call j reading the same copy j mod
cold_copies: cold against cold, the comparison issue 16 asks for ("faster than cuBLAS's GEMM
alone"), where `torch matmul` reads its one weight from L2 at N 1152 and 2304 as the tail does.
Its cell's ratio is the `cold weights` µs over it (`BASELINE_RATIO_OF`: below 1, the cold fused
launch beats cold cuBLAS), every other cell's the tail over it. `read floor` times a plain streaming
read of the weight's bytes (`stock.read_floor`; one buffer, every call: as the tail reads its one
weight) and, with cold weights, `read floor, cold weights` the same read with call j reading the
next of cold_copies buffers (its ratio `cold weights` over it): what the hardware gives for the
kernel's bytes, timed the same way in the same run. Then
(`expected`): the tap equals the tap of an independent launch (the projection is
bitwise repeatable; the driver's repeated calls and rank identity check the rest); out and the
cache equal `stock.qkv_front.qkv_epilogue_reference` applied to that projection with the GPU's
rsqrt.approx (`approximations`), the cache's untouched cells the poison (nothing written outside
the slots, guard pages included; negative slots skipped). The projection's max and mean error against the FP64
product (in BF16 epsilons of sum |x w|: `stock.qkv_front.ProjectionError`) must each be at most
cuBLAS's (torch bf16 matmul) on the same inputs, up to the margins of two summation orders
(`projection_verdict`): both go into the row's stock path, side by side, and a worse projection
is the case's error.

Inputs (`make_inputs`): random (x and weights N(0, 1), a random table) or adversarial: a zero
row (rsqrt of eps), huge (2^60) and subnormal (2^-130) activations, -0.0, positions 0 and
max_pos - 1, duplicate slots (their tokens carry equal x and positions, so either write order
gives the same bits), negative slots; NoPE cases carry no table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from musebench import config
from musebench.harness import checks
from musebench.harness.case import Expected, MailboxSpec, RunOptions
from musebench.stock.read_floor import READ_FLOOR  # a plain read of the weight's bytes, the same buffer every call

name = "qkv_front"
faults = ("flip", "silent")
NO_TAP, WITH_TAP = "no tap", "with tap"  # parts: the other launch of a check case / of a bench case
PARTS = (NO_TAP, WITH_TAP)
NO_PDL = "front without PDL"  # the bench's baseline: the deployment's launch built without PDL
VIRTUAL_STOCK = PROCESS_STOCK = "unfused"  # torch matmul (cuBLAS), then the Triton stock epilogue
MATMUL = "torch matmul"  # cuBLAS alone, the unfused path's first kernel
ROOFLINE_TB_PER_S = 4.2  # H200 HBM3e: the weight-read roofline's bandwidth
COLD = "cold weights"  # the bench's baseline: the deployment's launch, every call reading another weight copy
COLD_MATMUL = "torch matmul, cold weights"  # cuBLAS alone, every call reading the next of COLD's copies
COLD_READ_FLOOR = f"{READ_FLOOR}, cold weights"  # a plain read of the next of cold_copies buffers of the weight's bytes
# The cold cells' ratios: the cold launch over each (cold against cold), not the one-weight tail's.
BASELINE_RATIO_OF = {COLD_MATMUL: COLD, COLD_READ_FLOOR: COLD}
L2_BYTES = 50 * 1024 * 1024  # H200 L2 (the weights of N 1152 and 2304 fit)
COLD_L2_FACTOR = 4  # a cold call's copy was last read at least this many L2s of weight ago
# The cold copies a cold run may hold on the GPU: a cold-weights bench holds two sets of --calls
# (the weight copies and `read floor, cold weights`'s buffers, 2 x calls x weight), read-floor.py's
# cold reads one (calls x bytes); `check_cold_calls` counts them.
COLD_MAX_BYTES = 16 * 1024 ** 3
OUT, TAP, CACHE = "out", "tap", "kv_cache"
INPUT_FAMILIES = ("random", "adversarial")
TP_KV_HEADS = {4: 4, 8: 2, 16: 1}  # tp -> KV heads per rank (Muse Spark: 16 KV heads)
MAX_POS = 4096
PAGES = 8  # 128 slots: every case's slots fit, other pages stay untouched
GUARD_PAGES = 1  # poisoned pages on each side of the launch's cache (slot -1 of page 0 lies in the first)
HIDDEN = config.HIDDEN_SIZE
EPS = config.RMS_NORM_EPS
MAX_TOKENS = 16


def kv_heads_for(tp: int) -> int:
    """KV heads per rank at `tp`; ValueError naming the supported tps otherwise."""
    if tp not in TP_KV_HEADS:
        raise ValueError(f"qkv_front runs at tp {', '.join(map(str, TP_KV_HEADS))} (N = 4608, 2304, 1152), "
                         f"got tp {tp}")
    return TP_KV_HEADS[tp]


@dataclass(frozen=True)
class FrontCase:
    tp: int
    tokens: int
    rope: bool = True
    inputs: str = "random"
    seed: int = 0
    bench: bool = False  # the call is the deployment's launch (no tap, PDL), not the tap launch
    cold_copies: int = 0  # a bench case's `cold weights` baseline: weight copies rotated (0: none)
    family: str = "qkv_front"

    def label(self) -> str:
        launch = " deployed launch" if self.bench else ""
        launch += f" cold weights x{self.cold_copies}" if self.cold_copies else ""
        return (f"qkv_front tp={self.tp} b={self.tokens} {'rope' if self.rope else 'nope'} {self.inputs} "
                f"seed={self.seed}{launch}")


Case = FrontCase


@dataclass(frozen=True)
class FrontInputs:
    x: torch.Tensor  # bf16 [T, 8192], every rank's
    weights: list[torch.Tensor]  # bf16 [N, 8192] per rank
    positions: torch.Tensor  # int64 [T]
    cos_sin: torch.Tensor | None  # fp32 [MAX_POS, 64]
    slots: torch.Tensor  # int64 [T]


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def make_inputs(case: FrontCase) -> FrontInputs:
    """Every rank's inputs, deterministic in the case (seed included)."""
    if case.inputs not in INPUT_FAMILIES:
        raise ValueError(f"qkv_front inputs must be one of {INPUT_FAMILIES}, got {case.inputs!r}")
    if not 1 <= case.tokens <= MAX_TOKENS:
        raise ValueError(f"qkv_front takes 1 to {MAX_TOKENS} tokens, got {case.tokens}")
    kv = kv_heads_for(case.tp)
    n = 1152 * kv
    g = _generator("qkv_front", case.tokens, case.inputs, case.seed)
    tokens = case.tokens
    x = torch.randn(tokens, HIDDEN, generator=g)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=g)
    slots = torch.randperm(PAGES * 16, generator=g)[:tokens].long()
    if case.inputs == "adversarial":
        x[0] = 0.0  # rsqrt of eps on every head
        positions[0] = 0
        if tokens > 1:
            x[1, ::2] = 2.0 ** 60  # huge
            x[1, 1::2] = -0.0
            positions[1] = MAX_POS - 1
        if tokens > 2:
            x[2] = 2.0 ** -130 * torch.sign(x[2])  # subnormal activations
            slots[2] = -1  # not inserted
        if tokens > 4:
            x[4], positions[4], slots[4] = x[3], positions[3], slots[3]  # a duplicate slot, equal rows
    weights = []
    for rank in range(case.tp):
        gw = _generator("qkv_front weight", kv, rank, case.seed)
        w = torch.randn(n, HIDDEN, generator=gw) * HIDDEN ** -0.5
        weights.append(w.bfloat16().contiguous())
    cos_sin = None
    if case.rope:
        angles = torch.randn(MAX_POS, 32, generator=g)
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float().contiguous()
    return FrontInputs(x.bfloat16().contiguous(), weights, positions, cos_sin, slots)


def cache_buffer(kv: int, device: torch.device | str) -> torch.Tensor:
    """An uninitialised cache buffer bf16 [GUARD_PAGES + PAGES + GUARD_PAGES, kv, 16, 128]."""
    return torch.empty(PAGES + 2 * GUARD_PAGES, kv, 16, 128, dtype=torch.bfloat16, device=device)


def pool(buffer: torch.Tensor) -> torch.Tensor:
    """The cache a launch is given: the PAGES pages of `buffer` between its guard pages (a
    contiguous view, 16-byte aligned: a page is kv x 4 KB)."""
    return buffer[GUARD_PAGES: GUARD_PAGES + PAGES]


def mailboxes(case: FrontCase, capacity: int) -> dict[str, MailboxSpec]:
    return {}


def _launcher(impl: Any) -> Any:
    """The implementation's `launch_qkv_front` (musebench: `musebench.cute_ops`; ImplError, a
    ValueError, where it has none)."""
    from musebench.harness.impl import cute_ops_with

    return cute_ops_with(impl, "launch_qkv_front").launch_qkv_front


def takes_pdl(launch: Any) -> bool:
    """Whether an implementation's launch_qkv_front takes `enable_pdl` (musebench's extension)."""
    import inspect

    try:
        parameters = inspect.signature(launch).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "enable_pdl" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


@dataclass
class FrontRunner:
    """One rank's QKV front call on its device copies of the inputs: the tap launch (a check
    case) or the deployment's launch, no tap and PDL (a bench case); `tap` is the tap launch's
    buffer (in `outputs` only where the call writes it)."""

    launch: Any
    case: FrontCase
    x: torch.Tensor
    weight: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor | None
    slots: torch.Tensor
    outputs: dict[str, torch.Tensor]
    tap: torch.Tensor

    def launch_with(self, *, tap: bool, pdl: bool = True) -> None:
        """One launch into `outputs`' out and cache; with `tap`, the projection into `tap`;
        `pdl` False: the build without PDL (passed only then: the default launch is PDL)."""
        o = self.outputs
        extra = {} if pdl else {"enable_pdl": False}
        self.launch(self.x, self.weight, self.positions, self.cos_sin, self.slots, pool(o[CACHE]), o[CACHE].shape[1],
                    o[OUT], tap=self.tap if tap else None, **extra)

    def call(self) -> None:
        self.launch_with(tap=not self.case.bench)

    def check_fault(self) -> None:
        return None

    def parts(self) -> dict:
        if self.case.bench:
            return {WITH_TAP: lambda: self.launch_with(tap=True)}
        return {NO_TAP: lambda: self.launch_with(tap=False)}

    def launch_demands(self) -> list:
        return []


def _device_copies(case: FrontCase, inputs: FrontInputs, rank: int, device: torch.device) -> dict[str, Any]:
    kv = kv_heads_for(case.tp)
    n = 1152 * kv
    tap = torch.empty(case.tokens, n, dtype=torch.bfloat16, device=device)
    outputs = {OUT: torch.empty(case.tokens, n, dtype=torch.bfloat16, device=device), CACHE: cache_buffer(kv, device)}
    if not case.bench:
        outputs[TAP] = tap
    return dict(
        x=inputs.x.to(device), weight=inputs.weights[rank].to(device), positions=inputs.positions.to(device),
        cos_sin=inputs.cos_sin.to(device) if inputs.cos_sin is not None else None, slots=inputs.slots.to(device),
        outputs=outputs, tap=tap,
    )


def check_variants_agree(runner: FrontRunner, rank: int) -> None:
    """One eager launch of each form from poisoned outputs: the launch without the tap (PDL) and,
    where the launch takes `enable_pdl`, the one without the tap built without PDL must write the
    bits of out and of the whole cache buffer the tap launch writes (the tap launch is the one the
    checks see). ValueError naming the rank, the form, the output and the first mismatch."""
    o = runner.outputs

    def written(**form: bool) -> dict[str, torch.Tensor]:
        for t in (*o.values(), runner.tap):
            checks.poison(t)
        runner.launch_with(**form)
        return {name: o[name].clone() for name in (OUT, CACHE)}

    with_tap = written(tap=True)
    forms = {"the launch without the tap": dict(tap=False)}
    if takes_pdl(runner.launch):
        forms["the launch without the tap or PDL"] = dict(tap=False, pdl=False)
    for what, form in forms.items():
        for name, got in written(**form).items():
            count, _, first = checks.compare_bits(got, with_tap[name], rank=rank)
            if count:
                raise ValueError(f"rank {rank}: {what} wrote {count} elements of {name} other than the launch "
                                 f"with it (first: {first})")


def bind(case: FrontCase, impl: Any, rank: int, boxes: dict[str, Any], inputs: FrontInputs,
         options: RunOptions) -> FrontRunner:
    """This rank's runner; one eager call of each variant compiles both (before any capture) and
    checks that they agree (`check_variants_agree`)."""
    device = torch.device("cuda", torch.cuda.current_device())
    runner = FrontRunner(_launcher(impl), case, **_device_copies(case, inputs, rank, device))
    check_variants_agree(runner, rank)
    return runner


def expected_from_projection(case: FrontCase, inputs: FrontInputs, projection: torch.Tensor,
                             approximations: Any) -> dict[str, torch.Tensor]:
    """One rank's expected out and kv_cache (CPU) given its BF16 projection [T, N]: the stock
    epilogue on it; the cache is the whole buffer (`cache_buffer`), poisoned everywhere the slots
    do not reach, the guard pages included."""
    from musebench.stock.qkv_front import qkv_epilogue_reference

    kv = kv_heads_for(case.tp)
    device = projection.device
    buffer = checks.poison(cache_buffer(kv, device))
    cos_sin = inputs.cos_sin.to(device) if inputs.cos_sin is not None else None
    out, cache = qkv_epilogue_reference(projection, inputs.positions.to(device), cos_sin, inputs.slots.to(device),
                                        pool(buffer), kv, eps=EPS, approximations=approximations)
    pool(buffer).copy_(cache)
    return {OUT: out.cpu(), CACHE: buffer.cpu()}


# The projection's rule: the kernel's max and mean error (stock.qkv_front.ProjectionError) each at
# most cuBLAS's, up to the noise of two FP32 summation orders, and no unbounded element cuBLAS
# lacks. Why these margins: two honest orders differ only where the FP32 sum lies within its
# accumulation error of a BF16 rounding boundary, and there swapping the two neighbours moves that
# element's error by at most twice that accumulation error. On the harness's random inputs (CPU
# model, T = 16, N = 1152, split orders 2..16 and a sequential one) that moves the mean by at
# most 6e-8 relative and the max by 0 (its element is a well-conditioned one, a flip there would
# move it by about 1e-3 relative). A worse summation costs far more: BF16-rounded split-K partials
# raise both by about 60%, one output 2 BF16 ULPs off at the max element raises the max by 100%+
# (tests/cases/test_qkv_front.py injects both).
PROJECTION_MAX_MARGIN = 2.0 ** -7  # relative: a rounding flip at the max element fits, 1 ULP does not
PROJECTION_MEAN_MARGIN = 2.0 ** -12  # relative: 4000x the orders' noise


def projection_verdict(projection: torch.Tensor, cublas: torch.Tensor, x: torch.Tensor,
                       weight: torch.Tensor) -> tuple[str, bool]:
    """(line, ok): the kernel's and cuBLAS's errors vs the FP64 product, side by side (in BF16
    epsilons of sum |x w|, stock.qkv_front.ProjectionError); ok when the kernel has no unbounded
    element cuBLAS lacks and its max and mean are each at most cuBLAS's times 1 + the margin above."""
    from musebench.stock.qkv_front import fp64_projection, projection_error, term_magnitudes

    x, weight = x.cpu(), weight.cpu()
    exact, magnitudes = fp64_projection(x, weight), term_magnitudes(x, weight)
    mine = projection_error(projection.cpu(), exact, magnitudes)
    theirs = projection_error(cublas.cpu(), exact, magnitudes)
    ok = (mine.unbounded <= theirs.unbounded and mine.max <= theirs.max * (1 + PROJECTION_MAX_MARGIN)
          and mine.mean <= theirs.mean * (1 + PROJECTION_MEAN_MARGIN))
    line = f"projection vs FP64 (BF16 eps of sum|xw|): kernel {mine}, cuBLAS {theirs}"
    return line, ok


def expected(case: FrontCase, inputs: FrontInputs, options: RunOptions, approximations: Any) -> Expected:
    """Per rank: the tap of an independent launch, out and the cache from the reference epilogue on
    it. ValueError (the case's error) where the projection is less accurate than cuBLAS's."""
    device = torch.device("cuda", torch.cuda.current_device())
    launch = _launcher(options.impl)
    per_rank, lines, worse = [], [], []
    for rank in range(case.tp):
        copies = _device_copies(case, inputs, rank, device)
        o = copies["outputs"]
        checks.poison(o[CACHE])
        launch(copies["x"], copies["weight"], copies["positions"], copies["cos_sin"], copies["slots"], pool(o[CACHE]),
               o[CACHE].shape[1], o[OUT], tap=copies["tap"])
        torch.cuda.synchronize()
        projection = copies["tap"].clone()
        cublas = torch.matmul(copies["x"], copies["weight"].t())
        line, ok = projection_verdict(projection, cublas, inputs.x, inputs.weights[rank])
        lines.append(f"rank {rank}: {line}")
        if not ok:
            worse.append(rank)
        want = expected_from_projection(case, inputs, projection, approximations)
        if not case.bench:  # a bench case's call writes no tap
            want[TAP] = projection.cpu()
        per_rank.append(want)
    if worse:
        raise ValueError(f"the projection is less accurate than cuBLAS's on ranks {worse}: {lines[worse[0]]}")
    return Expected(per_rank, f"tap + torch stock epilogue; {lines[0]}")


def cold_copies_needed(nbytes: int) -> int:
    """Calls of a graph (one copy each, a copy read once a replay) a cold rotation over copies of
    `nbytes` bytes needs so that COLD_L2_FACTOR L2s of other copies lie between two reads of one
    copy: ceil(COLD_L2_FACTOR x L2_BYTES / nbytes) + 1. The one rule of `check_cold_calls`."""
    return -(-COLD_L2_FACTOR * L2_BYTES // nbytes) + 1


def check_cold_calls(nbytes: int, calls: int, what: str, copy_sets: int = 1) -> None:
    """The one refusal of a cold rotation (one copy of `nbytes` bytes per call of a graph of
    `calls` calls, in `copy_sets` sets held at once): ValueError, its message starting with the
    caller's context `what`, where calls < cold_copies_needed(nbytes) (fewer than COLD_L2_FACTOR
    L2s of other copies between two reads of one copy: the run would time warm reads) or where
    copy_sets x calls x nbytes exceeds COLD_MAX_BYTES. Called by `cold_copies_for` and by
    scripts/read-floor.py's option check."""
    needed = cold_copies_needed(nbytes)
    if calls < needed:
        raise ValueError(f"{what}: a copy of {nbytes / 1e6:.1f} MB a call needs --calls >= {needed} so that "
                         f"{COLD_L2_FACTOR} x the {L2_BYTES >> 20} MiB L2 of other copies lie between two reads of "
                         f"one copy, got --calls {calls}")
    held = copy_sets * calls * nbytes
    if held > COLD_MAX_BYTES:
        raise ValueError(f"{what}: --calls {calls} would hold {held / 1e9:.1f} GB of copies ({copy_sets} x "
                         f"{calls} x {nbytes / 1e6:.1f} MB; at most {COLD_MAX_BYTES >> 30} GiB); use fewer --calls")


def cold_copies_for(tp: int, calls: int) -> int:
    """The weight copies of a cold-weights bench at `tp` with `calls` calls per graph: one per call
    (a copy is read once a replay, `calls` - 1 other copies after its last read). ValueError, with
    the reason (`check_cold_calls`), where that is fewer than COLD_L2_FACTOR L2s of weight (too few
    calls to evict a copy: the option would time warm launches) or where the two sets it holds
    (the weight copies and `read floor, cold weights`'s buffers) exceed COLD_MAX_BYTES."""
    check_cold_calls(1152 * kv_heads_for(tp) * HIDDEN * 2, calls,
                     f"--cold-weights reads one weight copy per call of the graph at tp {tp}", copy_sets=2)
    return calls


def check_cold_copies_agree(runner: FrontRunner, copies: list[torch.Tensor]) -> None:
    """One eager deployment launch per weight copy from poisoned outputs, each compared bitwise
    with the launch on the runner's own weight (out and the whole cache buffer): the cold path
    times the tail's work. ValueError naming the copy, the output and the first mismatch."""
    o = runner.outputs

    def written(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        for t in o.values():
            checks.poison(t)
        runner.launch(runner.x, weight, runner.positions, runner.cos_sin, runner.slots, pool(o[CACHE]),
                      o[CACHE].shape[1], o[OUT])
        return {name: o[name].clone() for name in (OUT, CACHE)}

    want = written(runner.weight)
    for index, weight in enumerate(copies):
        for name, got in written(weight).items():
            count, _, first = checks.compare_bits(got, want[name])
            if count:
                raise ValueError(f"cold weights: the launch on weight copy {index} wrote {count} elements of {name} "
                                 f"other than the launch on the weight (first: {first})")


def bytes_moved(case: FrontCase) -> int:
    """The weight one rank streams: N x 8192 x 2 bytes (the roofline's numerator)."""
    return 1152 * kv_heads_for(case.tp) * HIDDEN * 2


def row_fields(case: FrontCase, options: RunOptions) -> dict[str, Any]:
    mode = ("rope" if case.rope else "nope") + (", deployed launch (no tap, PDL)" if case.bench else "")
    mode += f", cold weights: {case.cold_copies} copies" if case.cold_copies else ""
    return dict(kernel=name, mode=mode, tp=case.tp, tokens=case.tokens,
                weight_dtype="bf16", norm="qk", inputs=case.inputs, seed=case.seed, stock="torch")


def variants(case: FrontCase, options: RunOptions) -> dict[str, RunOptions]:
    return {}


def roofline_us(case: FrontCase) -> float:
    """The weight-read roofline of a call: bytes_moved / 4.2 TB/s, in µs (4.5, 9.0, 18.0 µs for
    N = 1152, 2304, 4608)."""
    return bytes_moved(case) / (ROOFLINE_TB_PER_S * 1e6)


def baselines(case: FrontCase, inputs: FrontInputs, rank: int, runner: FrontRunner, comms: Any) -> dict:
    """The unfused path (`unfused`): torch.matmul (cuBLAS) into its own qkv buffer, then
    `stock.triton_qkv_epilogue` (the stock epilogue's arithmetic, in place, and the cache
    insert into a cache of its own); and `torch matmul` alone. Both run once eagerly here (Triton
    compiles before any capture). Not checked bitwise: cuBLAS's summation order is its own.
    A bench case whose launch takes `enable_pdl` adds `front without PDL`: the deployment's launch
    built without PDL, into the runner's outputs (bind checked its bits equal the PDL build's);
    its cell's ratio is the PDL build's time over it, both timed in this run. A bench case with
    `cold_copies` adds `cold weights`: the deployment's launch, call j of the graph (its capture
    included) reading copy j mod cold_copies, each copy checked first (`check_cold_copies_agree`);
    its cell's ratio is the one-weight tail over it. With it `torch matmul, cold weights`
    (`cold_matmul`): `torch matmul` with call j reading the same copy j mod cold_copies (the
    copies of `cold weights`, not a second set), into the qkv buffer above, unchecked like it;
    its cell's ratio is `cold weights` over it (BASELINE_RATIO_OF: the fused launch against
    cuBLAS alone, both reading weights from HBM). `read floor` (`stock.read_floor.FloorRead`): a
    plain streaming read of the weight's bytes (`bytes_moved`), one buffer allocated here, read by
    every call (as the tail reads its one weight: from L2 at N 1152 and 2304); its ratio is the
    tail over it. With cold weights, `read floor, cold weights`: the same read with call j reading
    buffer j mod cold_copies of cold_copies separate buffers of the weight's size (allocated like
    the cold weight copies); its ratio is `cold weights` over it (BASELINE_RATIO_OF). Each floor's
    sum is checked once here, before any timing (RuntimeError, the case's error, where the reader
    skipped a byte)."""
    from musebench.cases.tail import Baseline
    from musebench.stock import read_floor
    from musebench.stock.triton_qkv_epilogue import triton_qkv_epilogue

    qkv = torch.empty_like(runner.outputs[OUT])
    cache = torch.zeros_like(pool(runner.outputs[CACHE]))

    def matmul() -> None:
        torch.matmul(runner.x, runner.weight.t(), out=qkv)

    def unfused() -> None:
        matmul()
        triton_qkv_epilogue(qkv, runner.positions, runner.cos_sin, runner.slots, cache, eps=EPS)

    unfused()
    paths = {VIRTUAL_STOCK: Baseline(unfused), MATMUL: Baseline(matmul)}
    if case.bench and takes_pdl(runner.launch):
        paths[NO_PDL] = Baseline(lambda: runner.launch_with(tap=False, pdl=False))
    paths[READ_FLOOR] = Baseline(read_floor.checked_floor(bytes_moved(case), runner.weight.device,
                                                          f"{READ_FLOOR} of {case.label()}"))
    if case.bench and case.cold_copies:
        cold = cold_launch(runner, case.cold_copies)
        paths[COLD] = Baseline(cold)
        paths[COLD_MATMUL] = Baseline(cold_matmul(runner.x, cold.copies, qkv))
        paths[COLD_READ_FLOOR] = Baseline(read_floor.checked_floor(bytes_moved(case), runner.weight.device,
                                                                   f"{COLD_READ_FLOOR} of {case.label()}",
                                                                   count=case.cold_copies))
    return paths


class WeightRotation:
    """The next weight copy of a cold path: copy j mod len(copies) at its j-th call (0-based),
    counted per rotation (each cold path its own: a path's warm-up call reads copy 0 and its
    captured calls the next ones, so in a graph of len(copies) calls every captured call reads
    a copy of its own)."""

    def __init__(self, copies: list[torch.Tensor]) -> None:
        self.copies = copies
        self.turn = 0

    def next(self) -> torch.Tensor:
        weight = self.copies[self.turn % len(self.copies)]
        self.turn += 1
        return weight


def cold_launch(runner: FrontRunner, count: int) -> Any:
    """A call that launches the deployment's launch into the runner's outputs on the next of
    `count` copies of its weight (checked first: `check_cold_copies_agree`): captured `count`
    times in a graph, each captured launch reads a copy of its own."""
    copies = [runner.weight.clone() for _ in range(count)]
    check_cold_copies_agree(runner, copies)
    rotation = WeightRotation(copies)
    o = runner.outputs

    def call() -> None:
        runner.launch(runner.x, rotation.next(), runner.positions, runner.cos_sin, runner.slots, pool(o[CACHE]),
                      o[CACHE].shape[1], o[OUT])

    call.copies = copies
    return call


def cold_matmul(x: torch.Tensor, copies: list[torch.Tensor], qkv: torch.Tensor) -> Any:
    """A call that runs torch.matmul(x, W.t(), out=qkv) (cuBLAS alone) on the next of `copies`
    (a `WeightRotation` of its own over the cold launch's copies: bf16 [N, 8192] each, x bf16
    [T, 8192], qkv bf16 [T, N]); the transposed views are made here, so a call allocates nothing
    (graph-capturable). The bench does not check its result (cuBLAS's summation order is its
    own); `call.copies` and `call.out` (qkv) are there for tests."""
    rotation = WeightRotation([w.t() for w in copies])

    def call() -> None:
        torch.matmul(x, rotation.next(), out=qkv)

    call.copies, call.out = copies, qkv
    return call
