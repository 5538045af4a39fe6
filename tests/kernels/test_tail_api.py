"""The seeds' tail API (`../shared/seeds/moe_tail.txt`) in `musebench.kernels.tail`.

CPU: every seed name with the seed's signature (musebench's extras keyword-only, with defaults);
the documented refusals, raised before anything compiles or launches (the tails are built over
CPU `DeviceMailbox`es, which every check accepts until a kernel would need the GPU); the compile
functions return compiled kernels for sm_90a, the very objects the kernel modules' caches hold
(so `select` hands out what the internal runners launch). One or two compiles per function:
they take 0.4-1 s each on this host.

GPU (`-m gpu`): virtual ranks over `local_device_group` mailboxes, bound through `bind` with a
`layout.PostExpertNorm`, bitwise against the stock references (EP: `ep_tail_reference`; TP:
`tp_rank_output` of `tp_tail_reference` on the stock's path for each m), with changing m and
route-weight dtypes call to call; graph capture and replay of `BoundTail.run`; a missing rank
reported by `check_fault`; the EP publisher and reduction run apart.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

pytest.importorskip("cutlass")

from musebench import config, tp_dispatch  # noqa: E402
from musebench.comm.device import FAULT_CLEAR, local_device_group  # noqa: E402
from musebench.cases.tail_inputs import TailCase, make_tail_inputs  # noqa: E402
from musebench.kernels import ep_tail, tail, tp_tail  # noqa: E402
from musebench.layout import PostExpertNorm, UnfinalizedMoEOutput  # noqa: E402
from tests._seeds import EMPTY, KW, POS, assert_seed_signature  # noqa: E402

P, K = config.MOE_POOLED_WIDTH, config.TOP_K
CAPACITY = 8
NSM = 132  # the H200's SM count: what the stock's dispatch reads on the CPU tests
ARCH = "sm_90a"
SEED_TIMEOUT = tail.SPIN_TIMEOUT_NS
CAP = tail.MAILBOX_CAPACITY


# ---------------------------------------------------------------------------------------------
# Names and signatures, as the seed documents them.


SEED_FUNCTIONS = {
    tail.tail_constants: ([("norm", POS, EMPTY)], ()),
    tail.tail_weight: ([("norm", POS, EMPTY), ("device", POS, EMPTY)], ()),
    tail.tp_split: ([("m", POS, EMPTY), ("tp", POS, EMPTY), ("nsm", POS, EMPTY)], ()),
    tail._check_tail_args: ([("capacity", POS, EMPTY), ("unfinalized", POS, EMPTY), ("out", POS, EMPTY)], ("wide_rows",)),
    tail.compile_publisher: (
        [("constants", POS, EMPTY), ("weight_dtype", POS, EMPTY), ("tp", KW, EMPTY), ("rank", KW, EMPTY),
         ("capacity", KW, EMPTY), ("enable_pdl", KW, EMPTY)],
        ("single_launch", "timeout_ns", "transport", "arch", "ptx_dir"),
    ),
    tail.compile_reduce: (
        [("tp", KW, EMPTY), ("capacity", KW, EMPTY), ("enable_pdl", KW, EMPTY)],
        ("rank", "timeout_ns", "arch", "ptx_dir"),
    ),
    tail.compile_tp_tail: (
        [("constants", POS, EMPTY), ("weight_dtype", POS, EMPTY), ("tp", KW, EMPTY), ("rank", KW, EMPTY),
         ("split", KW, EMPTY), ("slots", KW, EMPTY), ("route_peers", KW, EMPTY), ("generations", KW, EMPTY),
         ("enable_pdl", KW, EMPTY), ("timeout_ns", KW, SEED_TIMEOUT)],
        ("capacity", "variant", "token_width", "transport", "arch", "ptx_dir"),
    ),
    tail.MoETail.__init__: (
        [("self", POS, EMPTY), ("group", POS, EMPTY), ("tp", KW, EMPTY), ("rank", KW, EMPTY), ("device", KW, EMPTY),
         ("capacity", KW, CAP), ("enable_pdl", KW, True)],
        ("timeout_ns", "single_launch", "mailbox", "transport"),
    ),
    tail.MoETail.select: ([("self", POS, EMPTY), ("constants", POS, EMPTY), ("weight_dtype", POS, EMPTY), ("m", POS, EMPTY)], ()),
    tail.MoETail.bind: ([("self", POS, EMPTY), ("norm", POS, EMPTY)], ("weight_dtypes",)),
    tail.MoETail.launch: (
        [("self", POS, EMPTY), ("kernel", POS, EMPTY), ("weight_view", POS, EMPTY), ("unfinalized", POS, EMPTY),
         ("out", POS, EMPTY)],
        (),
    ),
    tail.TpTail.__init__: (
        [("self", POS, EMPTY), ("group", POS, EMPTY), ("tp", KW, EMPTY), ("rank", KW, EMPTY), ("device", KW, EMPTY),
         ("capacity", KW, CAP), ("batches", KW, (8,)), ("enable_pdl", KW, True), ("timeout_ns", KW, SEED_TIMEOUT)],
        ("nsm", "routes", "tokens", "transport"),
    ),
    tail.TpTail.split: ([("self", POS, EMPTY), ("m", POS, EMPTY)], ()),
    tail.TpTail.select: ([("self", POS, EMPTY), ("constants", POS, EMPTY), ("weight_dtype", POS, EMPTY), ("m", POS, EMPTY)], ()),
    tail.TpTail.bind: ([("self", POS, EMPTY), ("norm", POS, EMPTY)], ("weight_dtypes",)),
    tail.TpTail.launch: (
        [("self", POS, EMPTY), ("kernel", POS, EMPTY), ("weight_view", POS, EMPTY), ("unfinalized", POS, EMPTY),
         ("out", POS, EMPTY)],
        (),
    ),
    tail.BoundTail.__init__: ([("self", POS, EMPTY), ("tail", POS, EMPTY), ("constants", POS, EMPTY), ("weight", POS, EMPTY)], ()),
    tail.BoundTail.run: ([("self", POS, EMPTY), ("unfinalized", POS, EMPTY), ("out", POS, EMPTY)], ()),
}


@pytest.mark.parametrize("function", list(SEED_FUNCTIONS), ids=lambda f: f.__qualname__)
def test_seed_signatures(function):
    seed, extras = SEED_FUNCTIONS[function]
    assert_seed_signature(function, seed, extras=extras)


def test_seed_constants_and_types():
    assert tail.ROUTE_WEIGHT_DTYPES == (torch.bfloat16, torch.float32)
    assert tail.MAILBOX_CAPACITY == config.MAX_DECODE_TOKENS
    assert isinstance(tail.SPIN_TIMEOUT_NS, int) and tail.SPIN_TIMEOUT_NS > 0
    assert issubclass(tail.TailConstants, tuple)
    assert tail.TailConstants._fields == ("eps", "gain_center", "weight_before_norm")
    # the harness's bound objects answer what it asks of them
    for name in ("run", "run_publisher", "run_reduce", "check_fault", "launch_demands"):
        assert callable(getattr(tail.BoundTail, name))
    for name in ("check_fault", "launch_demands"):
        assert callable(getattr(tail.MoETail, name)) and callable(getattr(tail.TpTail, name))


def test_the_unfinalized_output_reads_as_the_seed_names_it():
    weights = torch.zeros(2, K)
    unfinalized = UnfinalizedMoEOutput(torch.zeros(1, P, dtype=torch.bfloat16), weights, torch.zeros(2, K, dtype=torch.int32))
    assert unfinalized.expert_weights is weights


# ---------------------------------------------------------------------------------------------
# The norm: constants and weight.


def norm(**overrides) -> PostExpertNorm:
    attributes = dict(hidden_size=P, variance_epsilon=1e-8, fused_gain_center=1.0, applies_weight_before_norm=True,
                      weight=torch.linspace(-1, 1, P))
    attributes.update(overrides)
    return PostExpertNorm(**attributes)


def test_tail_constants_of_a_norm():
    assert tail.tail_constants(norm()) == tail.TailConstants(eps=1e-8, gain_center=1.0, weight_before_norm=True)
    assert tail.tail_constants(norm(applies_weight_before_norm=False, fused_gain_center=0.0, variance_epsilon=1e-6)) == (
        1e-6, 0.0, False)
    assert {f for f in PostExpertNorm.__dataclass_fields__} == {
        "hidden_size", "variance_size_override", "variance_epsilon", "fused_gain_center", "applies_weight_before_norm",
        "has_weight", "weight"}


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_size": 8192}, "spans 8192 columns"),  # the hidden width, not the pooled one
    ({"hidden_size": 2048}, "spans 2048 columns"),
    ({"variance_size_override": 1024}, "variance over 1024 columns"),
    ({"variance_size_override": P}, "variance over 4096 columns"),  # any override, even the full width
    ({"variance_epsilon": 0.0}, "eps"),  # musebench's one eps rule: 2^-126 <= eps <= FP32 max
    ({"variance_epsilon": 2.0**-130}, "eps"),  # subnormal: the stocks' rsqrt instructions differ there
    ({"variance_epsilon": float("nan")}, "eps"),
    ({"variance_epsilon": 1e39}, "eps"),
])
def test_tail_constants_refuse_other_norms(overrides, message):
    with pytest.raises(ValueError, match=message):
        tail.tail_constants(norm(**overrides))


def test_tail_weight():
    weight = tail.tail_weight(norm(), "cpu")
    assert weight.dtype == torch.bfloat16 and weight.shape == (P,) and weight.is_contiguous()
    assert torch.equal(weight, torch.linspace(-1, 1, P).to(torch.bfloat16))
    assert torch.equal(tail.tail_weight(norm(has_weight=False, weight=None), "cpu"), torch.ones(P, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"must be \[4096\]"):
        tail.tail_weight(norm(weight=torch.zeros(P + 8)), "cpu")


@pytest.mark.parametrize("tp", [2, 3, 4, 8])  # expert-owner and token-owner regions, the extension (3)
def test_tp_split_is_the_stock_dispatch(tp):
    for m in range(0, 65):
        assert tail.tp_split(m, tp, NSM) == tp_dispatch.tp_stock_path(m, tp, NSM).split
    with pytest.raises(ValueError):
        tail.tp_split(1, 1, NSM)


# ---------------------------------------------------------------------------------------------
# _check_tail_args: refusals before anything launches (all CPU tensors: the device check is last).


def _args(m: int = 2, **overrides):
    args = {
        "rows": torch.zeros(3, P, dtype=torch.bfloat16),
        "weights": torch.zeros(m, K, dtype=torch.float32),
        "index": torch.zeros(m, K, dtype=torch.int32),
        "out": torch.zeros(m, P, dtype=torch.bfloat16),
    }
    args.update(overrides)
    return UnfinalizedMoEOutput(args["rows"], args["weights"], args["index"]), args["out"]


BAD_TAIL_ARGS = [
    ("out dtype", _args(out=torch.zeros(2, P, dtype=torch.float32)), "out must be torch.bfloat16"),
    ("out width", _args(out=torch.zeros(2, 2048, dtype=torch.bfloat16)), r"out must be \[m, 4096\]"),
    ("out 1-D", _args(out=torch.zeros(2 * P, dtype=torch.bfloat16)), r"out must be \[m, 4096\]"),
    ("out strided", _args(out=torch.zeros(2, 2 * P, dtype=torch.bfloat16)[:, ::2]), "out must be contiguous"),
    ("m > capacity", _args(9), "9 tokens exceed the tail's capacity of 8"),
    ("rows dtype", _args(rows=torch.zeros(3, P)), "gemm2_permuted must be torch.bfloat16"),
    ("rows width", _args(rows=torch.zeros(3, 2 * P, dtype=torch.bfloat16)), r"gemm2_permuted must be \[rows, 4096\]"),
    ("rows 3-D", _args(rows=torch.zeros(1, 3, P, dtype=torch.bfloat16)), r"gemm2_permuted must be \[rows, 4096\]"),
    ("rows strided", _args(rows=torch.zeros(P, 3, dtype=torch.bfloat16).t()), "gemm2_permuted must be contiguous"),
    ("weights shape", _args(weights=torch.zeros(2, 4)), r"expert_weights must be \[2, 8\]"),
    ("weights rows", _args(weights=torch.zeros(3, K)), r"expert_weights must be \[2, 8\]"),
    ("weights dtype", _args(weights=torch.zeros(2, K, dtype=torch.float16)), "expert_weights must be bfloat16 or float32"),
    ("weights dtype", _args(weights=torch.zeros(2, K, dtype=torch.float64)), "expert_weights must be bfloat16 or float32"),
    ("weights strided", _args(weights=torch.zeros(K, 2).t()), "expert_weights must be contiguous"),
    ("index dtype", _args(index=torch.zeros(2, K, dtype=torch.int64)), "expanded_idx_to_permuted_idx must be torch.int32"),
    ("index shape", _args(index=torch.zeros(2, 4, dtype=torch.int32)), r"expanded_idx_to_permuted_idx must be \[2, 8\]"),
    ("all valid, on the CPU", _args(), "must be on out's CUDA device"),
]


@pytest.mark.parametrize("what, args, message", BAD_TAIL_ARGS, ids=[w for w, _, _ in BAD_TAIL_ARGS])
def test_check_tail_args_refuses(what, args, message):
    unfinalized, out = args
    with pytest.raises(ValueError, match=message):
        tail._check_tail_args(CAPACITY, unfinalized, out)


# ---------------------------------------------------------------------------------------------
# The tails over CPU mailboxes: construction checks, refusals before launch, select, faults.


def ep_tail_on_cpu(tp: int = 2, rank: int = 0, **kwargs) -> tail.MoETail:
    box = local_device_group(tp, tp, CAPACITY, P, "cpu")[rank]
    return tail.MoETail(None, tp=tp, rank=rank, device="cpu", capacity=CAPACITY, mailbox=box, **kwargs)


def tp_tail_on_cpu(tp: int = 2, rank: int = 0, **kwargs) -> tail.TpTail:
    routes = local_device_group(tp, tp, CAPACITY * K, P, "cpu")[rank]
    tokens = local_device_group(tp, 1, CAPACITY, 2 * P, "cpu")[rank]
    kwargs.setdefault("batches", (1, 8))
    kwargs.setdefault("nsm", NSM)
    return tail.TpTail(None, tp=tp, rank=rank, device="cpu", capacity=CAPACITY, routes=routes, tokens=tokens, **kwargs)


def test_moe_tail_construction_refusals():
    box = local_device_group(2, 2, CAPACITY, P, "cpu")[0]
    with pytest.raises(ValueError, match="at least two ranks"):
        tail.MoETail(None, tp=1, rank=0, device="cpu", capacity=CAPACITY, mailbox=box)
    with pytest.raises(ValueError, match="rank 2 outside"):
        tail.MoETail(None, tp=2, rank=2, device="cpu", capacity=CAPACITY, mailbox=box)
    with pytest.raises(ValueError, match="is rank 0 of 2; this tail is rank 1 of 2"):
        tail.MoETail(None, tp=2, rank=1, device="cpu", capacity=CAPACITY, mailbox=box)
    with pytest.raises(ValueError, match=r"holds \[2, 8, 4096\]"):
        tail.MoETail(None, tp=2, rank=0, device="cpu", capacity=4, mailbox=box)
    with pytest.raises(ValueError, match="DeviceMailbox"):
        tail.MoETail(None, tp=2, rank=0, device="cpu", capacity=CAPACITY, mailbox=box.words)
    with pytest.raises(ValueError, match="timeout_ns"):
        tail.MoETail(None, tp=2, rank=0, device="cpu", capacity=CAPACITY, mailbox=box, timeout_ns=0)


def test_tp_tail_construction_refusals():
    with pytest.raises(ValueError, match="batches"):
        tp_tail_on_cpu(batches=(9,))
    with pytest.raises(ValueError, match="batches"):
        tp_tail_on_cpu(batches=())
    with pytest.raises(ValueError, match="nsm"):
        tp_tail_on_cpu(nsm=0)
    routes = local_device_group(2, 2, CAPACITY * K, P, "cpu")[0]
    with pytest.raises(ValueError, match="both the route and the token mailboxes"):
        tail.TpTail(None, tp=2, rank=0, device="cpu", capacity=CAPACITY, nsm=NSM, routes=routes)
    tokens = local_device_group(2, 1, CAPACITY, 2 * P, "cpu")[0]
    with pytest.raises(ValueError, match="tokens holds"):
        tail.TpTail(None, tp=2, rank=0, device="cpu", capacity=CAPACITY, nsm=NSM, routes=routes,
                    tokens=local_device_group(2, 1, CAPACITY, 3 * P, "cpu")[0])
    with pytest.raises(ValueError, match="routes holds"):
        tail.TpTail(None, tp=2, rank=0, device="cpu", capacity=CAPACITY, nsm=NSM, routes=tokens, tokens=tokens)


@pytest.mark.parametrize("local_world, gpus, want", [(2, 2, "unicast"), (4, 2, "ipc")])  # a GPU each; shared GPUs
def test_without_mailboxes_the_tails_allocate_over_the_group(monkeypatch, local_world, gpus, want):
    """The process path: every mailbox from the transport `comm.transport.decide` picks, over the
    given group, with the shapes the kernels take (CPU mailboxes stand in for the collective ones)."""
    from musebench.comm import transport

    calls = []

    def allocator(kind):
        def allocate(rank, tp, slots, capacity, width, device, group=None, **kwargs):
            calls.append((kind, rank, tp, slots, capacity, width, group))
            return local_device_group(tp, slots, capacity, width, "cpu")[rank]
        return allocate

    layout = transport.Layout(backend="cute", launcher="torchrun", tp=2, local_world=local_world, gpus=gpus)
    monkeypatch.setattr(transport, "layout_here", lambda *args, **kwargs: layout)
    monkeypatch.setattr(tail.comm_device, "symmetric_device_group", allocator("unicast"))
    monkeypatch.setattr(tail.comm_device, "ipc_device_group", allocator("ipc"))
    group = object()
    tail.MoETail(group, tp=2, rank=1, device="cpu", capacity=CAPACITY)
    tail.TpTail(group, tp=2, rank=1, device="cpu", capacity=CAPACITY, nsm=NSM)
    assert calls == [(want, 1, 2, 2, CAPACITY, P, group),  # EP: [tp, capacity, P]
                     (want, 1, 2, 2, CAPACITY * K, P, group),  # TP routes: [tp, 8 capacity, P]
                     (want, 1, 2, 1, CAPACITY, 2 * P, group)]  # TP tokens: [1, capacity, 2P]


def test_a_multicast_request_allocates_multicast_mailboxes_and_the_tails_publish_by_multicast(monkeypatch):
    """transport="multicast" (musebench's extra): decide's verdict (a rack stood in for) reaches
    the allocation as multicast=True, and a mailbox with a multicast address makes the EP
    publisher and the TP tail's publish multicast; without one they stay unicast."""
    from musebench.comm import transport

    calls = []

    def allocate(rank, tp, slots, capacity, width, device, group=None, multicast=False):
        calls.append(multicast)
        box = local_device_group(tp, slots, capacity, width, "cpu")[rank]
        box.multicast = 0x7E00_0000_0000 if multicast else 0
        return box

    layout = transport.Layout(backend="cute", launcher="torchrun", tp=2, local_world=2, gpus=2)
    monkeypatch.setattr(transport, "layout_here", lambda *args, **kwargs: layout)
    monkeypatch.setattr(transport, "multicast_support",
                        lambda *args, **kwargs: transport.MulticastSupport(True, "stood in for"))
    monkeypatch.setattr(tail.comm_device, "symmetric_device_group", allocate)
    ep = tail.MoETail(object(), tp=2, rank=1, device="cpu", capacity=CAPACITY, transport="multicast")
    tp_group = tail.TpTail(object(), tp=2, rank=1, device="cpu", capacity=CAPACITY, nsm=NSM, transport="multicast")
    assert calls == [True, True, True] and ep.transport == tp_group.transport == "multicast"
    calls.clear()
    ep = tail.MoETail(object(), tp=2, rank=1, device="cpu", capacity=CAPACITY)
    tp_group = tail.TpTail(object(), tp=2, rank=1, device="cpu", capacity=CAPACITY, nsm=NSM)
    assert calls == [False, False, False] and ep.transport == tp_group.transport == "unicast"


def test_a_multicast_request_where_the_policy_forbids_it_allocates_nothing(monkeypatch):
    from musebench.comm import transport

    for name, value in transport.MULTICAST_OFF.items():
        monkeypatch.setenv(name, value)
    layout = transport.Layout(backend="cute", launcher="torchrun", tp=2, local_world=2, gpus=2)
    monkeypatch.setattr(transport, "layout_here", lambda *args, **kwargs: layout)
    monkeypatch.setattr(tail.comm_device, "symmetric_device_group", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(transport.TransportRefused, match="multicast is forbidden here"):
        tail.MoETail(object(), tp=2, rank=1, device="cpu", capacity=CAPACITY, transport="multicast")


WIDE_ROWS = [  # the TP tail's rows: wider than P is taken (the first P columns are read)
    (_args(rows=torch.zeros(3, P + 8, dtype=torch.bfloat16)), "must be on out's CUDA device"),  # passed every layout check
    (_args(rows=torch.zeros(3, 2 * P, dtype=torch.bfloat16)), "must be on out's CUDA device"),
    (_args(rows=torch.zeros(3, P + 4, dtype=torch.bfloat16)), r"width >= 4096\], width a multiple of 8"),
    (_args(rows=torch.zeros(3, P - 8, dtype=torch.bfloat16)), r"width >= 4096\]"),
]


@pytest.mark.parametrize("args, message", WIDE_ROWS, ids=["P+8", "2P", "P+4", "P-8"])
def test_wide_rows_for_the_tp_tail_only(args, message):
    unfinalized, out = args
    with pytest.raises(ValueError, match=message):
        tail._check_tail_args(CAPACITY, unfinalized, out, wide_rows=True)
    with pytest.raises(ValueError, match=r"gemm2_permuted must be \[rows, 4096\]"):
        tail._check_tail_args(CAPACITY, unfinalized, out)  # the seed's rule, and the EP tail's


@pytest.mark.parametrize("make", [ep_tail_on_cpu, tp_tail_on_cpu], ids=["ep", "tp"])
def test_run_refuses_before_compiling_or_launching(make):
    group = make()
    bound = tail.BoundTail(group, tail.tail_constants(norm()), tail.tail_weight(norm(), "cpu"))
    caches = group._publishers if isinstance(group, tail.MoETail) else group._kernels
    refusals = BAD_TAIL_ARGS
    if isinstance(group, tail.TpTail):  # its rows may be wider than P
        tp_rows = {"rows 3-D": r"gemm2_permuted must be \[rows, width >= 4096\]"}
        refusals = [(what, args, tp_rows.get(what, message)) for what, args, message in BAD_TAIL_ARGS
                    if what != "rows width"] + [("wide rows", *bad) for bad in WIDE_ROWS]
    for _, (unfinalized, out), message in refusals:
        with pytest.raises(ValueError, match=message):
            bound.run(unfinalized, out)
    assert not caches, "a refused call compiled a kernel"
    # b = 0 does nothing at all: no check, no kernel
    bound.run(*_args(0, weights=torch.zeros(0, K, dtype=torch.float16)))
    assert not caches


def test_run_publisher_and_reduce_only_on_a_two_launch_ep_tail():
    args = _args()
    for group in (tp_tail_on_cpu(), ep_tail_on_cpu(single_launch=True)):
        bound = tail.BoundTail(group, tail.tail_constants(norm()), tail.tail_weight(norm(), "cpu"))
        with pytest.raises(ValueError, match="two launches"):
            bound.run_publisher(*args)
        with pytest.raises(ValueError, match="two launches"):
            bound.run_reduce(args[1])
    bound = tail.BoundTail(ep_tail_on_cpu(), tail.tail_constants(norm()), tail.tail_weight(norm(), "cpu"))
    with pytest.raises(ValueError, match="must be on out's CUDA device"):
        bound.run_publisher(*args)
    with pytest.raises(ValueError, match=r"out must be \[b <= 8, 4096\]"):
        bound.run_reduce(torch.zeros(9, P, dtype=torch.bfloat16))


def test_bind_refusals_come_before_any_compile():
    group = ep_tail_on_cpu()
    with pytest.raises(ValueError, match="spans 8192"):
        group.bind(norm(hidden_size=8192))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        group.bind(norm(), weight_dtypes=(torch.float16,))
    with pytest.raises(ValueError, match="at least one"):
        group.bind(norm(), weight_dtypes=())
    assert not group._publishers
    with pytest.raises(ValueError, match="bind a layer first"):
        group.launch_demands(1)
    bound = tail.BoundTail(tp_tail_on_cpu(), tail.tail_constants(norm()), tail.tail_weight(norm(), "cpu"))
    assert bound.launch_demands(0) == []  # nothing launches for an empty batch


def test_moe_tail_select_compiles_once_per_constants_and_dtype():
    group = ep_tail_on_cpu(tp=2, rank=1)
    constants = tail.tail_constants(norm())
    kernel = group.select(constants, torch.bfloat16, 1)
    assert group.select(constants, torch.bfloat16, 8) is kernel, "every m takes the same publisher"
    assert group.select(tail.TailConstants(*constants), torch.bfloat16, 3) is kernel
    # the kernel module's cache holds the same object: the runner EpTail launches it
    same = ep_tail.compile_publisher(width=P, top_k=K, tp=2, rank=1, capacity=CAPACITY, weight_before_norm=True,
                                     weight_dtype="bf16", eps=1e-8, gain_center=1.0, transport="unicast",
                                     enable_pdl=True)
    assert same is kernel
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        group.select(constants, torch.float16, 1)


def test_tp_tail_split_path_and_select():
    group = tp_tail_on_cpu(tp=4)
    for m in range(1, CAPACITY + 1):
        assert group.split(m) == tail.tp_split(m, 4, NSM)
        assert group.path(m) == tp_dispatch.tp_stock_path(m, 4, NSM)
    assert group.slots == 2 and group.generations is group.routes.stage
    constants = tail.tail_constants(norm(applies_weight_before_norm=False))
    kernel = group.select(constants, torch.float32, 2)  # expert-owner S = 16, two routes per owner
    # the same stock path at another m takes the same kernel; the cache holds it per variant
    same_path = [m for m in range(1, CAPACITY + 1) if group.path(m) == group.path(2)]
    assert all(group.select(constants, torch.float32, m) is kernel for m in same_path)
    with pytest.raises(ValueError, match="outside 1..8"):
        group.select(constants, torch.float32, 0)
    with pytest.raises(ValueError, match="outside 1..8"):
        group.select(constants, torch.float32, 9)


@pytest.mark.parametrize("make, words, message", [
    (ep_tail_on_cpu, [1, 0, 2 * CAPACITY + 5, 2], r"rank 1 timed out waiting for rank 0 \(mailbox slot 2, token 5, generation 2\)"),
    (tp_tail_on_cpu, [0, 1, 3 * 16 + 8, 1], r"rank 0 timed out waiting for rank 1 \(the row of token 3, generation 1\)"),
], ids=["ep", "tp"])
def test_check_fault_names_rank_peer_slot_and_generation(make, words, message):
    group = make()
    group.check_fault()  # a clear record
    fault = group.mailbox.fault if isinstance(group, tail.MoETail) else group.routes.fault
    fault.copy_(torch.tensor(words, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=message):
        group.check_fault()
    fault.fill_(FAULT_CLEAR)


# ---------------------------------------------------------------------------------------------
# Compiles (sm_90a, no GPU): each compile function returns a compiled kernel.


CONSTANTS = tail.TailConstants(eps=1e-8, gain_center=1.0, weight_before_norm=True)


def _compiled(kernel) -> bool:
    return callable(kernel) and bool(getattr(kernel, "kernel_info", None))


def test_compile_publisher():
    kernel = tail.compile_publisher(CONSTANTS, torch.float32, tp=2, rank=0, capacity=CAPACITY, enable_pdl=True, arch=ARCH)
    assert _compiled(kernel)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        tail.compile_publisher(CONSTANTS, torch.float16, tp=2, rank=0, capacity=CAPACITY, enable_pdl=True, arch=ARCH)


def test_compile_reduce():
    kernel = tail.compile_reduce(tp=4, capacity=CAPACITY, enable_pdl=True, arch=ARCH)
    assert _compiled(kernel)
    assert tail.compile_reduce(tp=4, capacity=CAPACITY, enable_pdl=True, arch=ARCH) is kernel


def test_compile_tp_tail_maps_the_seeds_arguments():
    # the seed's arguments alone: the single-launch token-owner kernel, rounded products
    kernel = tail.compile_tp_tail(CONSTANTS, torch.bfloat16, tp=2, rank=1, split=8, slots=4, route_peers=(0, 1),
                                  generations=2 * 4 * 16, enable_pdl=True, arch=ARCH)
    assert _compiled(kernel)
    seeds_variant = tp_tail.TpVariant(split=8, combine=tp_tail.ROUNDED_PRODUCTS, delivery=tp_tail.SCRUBBED)
    assert kernel is tp_tail.compile_tp_tail(tp=2, capacity=8, token_width=2 * P, variant=seeds_variant,
                                             weight_before_norm=True, weight_dtype="bf16", eps=1e-8, gain_center=1.0,
                                             arch=ARCH)
    # rank is a runtime argument: every rank of the group takes the same kernel
    assert tail.compile_tp_tail(CONSTANTS, torch.bfloat16, tp=2, rank=0, split=8, slots=4, route_peers=(0, 1),
                                generations=2 * 4 * 16, enable_pdl=True, arch=ARCH) is kernel
    expert_owner = tp_tail.TpVariant.from_path(tp_dispatch.tp_stock_path(3, 2, NSM))
    with pytest.raises(ValueError, match="contradicts"):
        tail.compile_tp_tail(CONSTANTS, torch.bfloat16, tp=2, rank=0, split=8, slots=4, route_peers=(0, 1),
                             generations=1, enable_pdl=True, variant=expert_owner, arch=ARCH)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        tail.compile_tp_tail(CONSTANTS, torch.float16, tp=2, rank=0, split=8, slots=4, route_peers=(0, 1),
                             generations=1, enable_pdl=True, arch=ARCH)
    with pytest.raises(ValueError, match="rank 2 outside"):
        tail.compile_tp_tail(CONSTANTS, torch.bfloat16, tp=2, rank=2, split=8, slots=4, route_peers=(0, 1),
                             generations=1, enable_pdl=True, arch=ARCH)


# ---------------------------------------------------------------------------------------------
# GPU: virtual ranks through the seeds' API.

POISON_BITS = 0x7FA5  # a BF16 NaN the conversion never produces
SHORT_TIMEOUT_NS = 200_000_000
HOLD_NS = 1_000_000_000


def _norm_of(case: TailCase, weight: torch.Tensor) -> PostExpertNorm:
    return PostExpertNorm(hidden_size=case.width, variance_epsilon=case.eps, fused_gain_center=case.gain_center,
                          applies_weight_before_norm=case.weight_before_norm, weight=weight)


def _poisoned(m: int) -> torch.Tensor:
    return torch.full((m, P), POISON_BITS, dtype=torch.int16, device="cuda").view(torch.bfloat16)


def _launch(bound, streams, per_rank, outs, **kwargs) -> None:
    from tests._streams import launch_ranks

    launch_ranks(bound, streams, per_rank, outs, **kwargs)


def _want(case: TailCase, per_rank, weight: torch.Tensor, nsm: int) -> list[torch.Tensor]:
    from musebench.kernels.approx import hardware_approximations

    on_gpu = [u.to("cuda") for u in per_rank]
    common = dict(eps=case.eps, gain_center=case.gain_center, weight_before_norm=case.weight_before_norm,
                  approximations=hardware_approximations())
    if case.mode == "ep":
        from musebench.stock.ep import ep_tail_reference

        return [ep_tail_reference(on_gpu, weight.cuda(), **common)] * case.tp
    from musebench.stock.tp import tp_rank_output, tp_tail_reference

    reference, path = tp_tail_reference(on_gpu, weight.cuda(), nsm=nsm, **common)
    return [tp_rank_output(reference, path, rank) for rank in range(case.tp)]


def _assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    from tests._bits import assert_raw_bits_equal

    assert_raw_bits_equal(got, want, what, poison_bits=POISON_BITS)


def virtual_group(mode: str, tp: int, *, batches=tuple(range(1, CAPACITY + 1)), **kwargs):
    """tp ranks' executor-level tails on the current GPU over `local_device_group` mailboxes."""
    if mode == "ep":
        boxes = local_device_group(tp, tp, CAPACITY, P, "cuda")
        return [tail.MoETail(None, tp=tp, rank=r, device="cuda", capacity=CAPACITY, mailbox=boxes[r], **kwargs)
                for r in range(tp)]
    routes = local_device_group(tp, tp, CAPACITY * K, P, "cuda")
    tokens = local_device_group(tp, 1, CAPACITY, 2 * P, "cuda")
    return [tail.TpTail(None, tp=tp, rank=r, device="cuda", capacity=CAPACITY, batches=batches, routes=routes[r],
                        tokens=tokens[r], **kwargs) for r in range(tp)]


# Regimes: EP tp 2 and 4 in two launches, tp 3 as one launch; TP tp 2 and 4 (expert-owner, exact
# delivery), tp 8 (expert-owner, then token-owner XP = 8 at m = 8), tp 3 (the extension). Calls
# change m (8, 1, 5, 3), the route-weight dtype and the input family on one bound layer; the edge
# family brings missing routes, NaN rows and weights, overflow and, TP, rows wider than P.
GPU_GROUPS = [("ep", 2, {}), ("ep", 4, {}), ("ep", 3, {"single_launch": True}),
              ("tp", 2, {}), ("tp", 3, {}), ("tp", 4, {}), ("tp", 8, {})]


@pytest.mark.gpu
@pytest.mark.parametrize("mode, tp, kwargs", GPU_GROUPS, ids=[f"{m}-tp{t}{'-single' if k else ''}" for m, t, k in GPU_GROUPS])
@pytest.mark.parametrize("norm_order", ["before", "after"])
def test_bound_tails_of_virtual_ranks_are_the_stock(mode, tp, kwargs, norm_order):
    groups = virtual_group(mode, tp, **kwargs)
    weight = make_tail_inputs(TailCase(mode=mode, tp=tp, tokens=1)).norm_weight
    case = TailCase(mode=mode, tp=tp, tokens=1, norm=norm_order)
    bound = [group.bind(_norm_of(case, weight)) for group in groups]
    streams = [torch.cuda.Stream() for _ in range(tp)]
    torch.cuda.synchronize()
    calls = [(8, "bf16", "random"), (1, "fp32", "adversarial"), (5, "bf16", "adversarial"), (3, "fp32", "edge")]
    for call, (m, dtype, family) in enumerate(calls):
        case = dataclasses.replace(case, tokens=m, weight_dtype=dtype, inputs=family, seed=call)
        inputs = make_tail_inputs(case)
        outs = [_poisoned(m) for _ in range(tp)]
        _launch(bound, streams, [u.to("cuda") for u in inputs.per_rank], outs)
        torch.cuda.synchronize()
        want = _want(case, inputs.per_rank, weight, getattr(groups[0], "nsm", 0))
        for rank in range(tp):
            _assert_bits(outs[rank], want[rank], f"{case.label()} call {call} rank {rank}")
    for group in groups:
        group.check_fault()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_bound_tail_run_is_graph_capturable(mode):
    tp, m = 2, 8
    groups = virtual_group(mode, tp, batches=(m,))
    case = TailCase(mode=mode, tp=tp, tokens=m)
    first = make_tail_inputs(case)
    bound = [group.bind(_norm_of(case, first.norm_weight), weight_dtypes=(torch.bfloat16,)) for group in groups]
    # static inputs with room for every route's row (an EP rank's row count changes with the seed)
    static = [UnfinalizedMoEOutput(torch.zeros(m * K, P, dtype=torch.bfloat16, device="cuda"),
                                   torch.zeros(m, K, dtype=torch.bfloat16, device="cuda"),
                                   torch.full((m, K), -1, dtype=torch.int32, device="cuda")) for _ in range(tp)]

    def load(per_rank) -> None:
        for target, source in zip(static, per_rank):
            target.gemm2_permuted[: source.gemm2_permuted.shape[0]].copy_(source.gemm2_permuted)
            target.route_weights.copy_(source.route_weights)
            target.expanded_idx_to_permuted_idx.copy_(source.expanded_idx_to_permuted_idx)

    load(first.per_rank)
    outs = [_poisoned(m) for _ in range(tp)]
    streams = [torch.cuda.Stream() for _ in range(tp)]
    _launch(bound, streams, static, outs)  # eager first: nothing left to compile or load
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # measured inside the capture: entering it allocates a few bytes of torch's own
        # (scripts/capture-allocations.py traced them to the `with` line on the H200)
        allocated = torch.cuda.memory_allocated()
        for _ in range(2):
            _launch(bound, streams, static, outs)
        during = torch.cuda.memory_allocated()
    assert during == allocated, "run allocated during capture"
    for replay in range(3):
        inputs = make_tail_inputs(case.with_seed(replay + 1))
        load(inputs.per_rank)
        for out in outs:
            out.view(torch.int16).fill_(POISON_BITS)
        graph.replay()
        torch.cuda.synchronize()
        want = _want(case, inputs.per_rank, first.norm_weight, getattr(groups[0], "nsm", 0))
        for rank in range(tp):
            _assert_bits(outs[rank], want[rank], f"{mode} replay {replay} rank {rank}")
    for group in groups:
        group.check_fault()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_a_missing_rank_is_named_by_check_fault(mode):
    tp, m, missing = 2, 3, 1
    groups = virtual_group(mode, tp, batches=(m,), timeout_ns=SHORT_TIMEOUT_NS)
    case = TailCase(mode=mode, tp=tp, tokens=m)
    inputs = make_tail_inputs(case)
    bound = [group.bind(_norm_of(case, inputs.norm_weight)) for group in groups]
    outs = [_poisoned(m) for _ in range(tp)]
    started = time.monotonic()
    _launch(bound, [torch.cuda.Stream() for _ in range(tp)], [u.to("cuda") for u in inputs.per_rank], outs,
            skip=(missing,), hold_ns=HOLD_NS)
    torch.cuda.synchronize()
    assert time.monotonic() - started < 30.0
    with pytest.raises(RuntimeError, match=f"rank 0 timed out waiting for rank {missing}"):
        bound[0].check_fault()


@pytest.mark.gpu
def test_publisher_and_reduction_apart_equal_the_call():
    tp, m = 2, 4
    groups = virtual_group("ep", tp)
    case = TailCase(mode="ep", tp=tp, tokens=m, weight_dtype="fp32")
    inputs = make_tail_inputs(case)
    bound = [group.bind(_norm_of(case, inputs.norm_weight)) for group in groups]
    per_rank = [u.to("cuda") for u in inputs.per_rank]
    outs = [_poisoned(m) for _ in range(tp)]
    streams = [torch.cuda.Stream() for _ in range(tp)]
    for rank in range(tp):  # every publisher before any reduction: a serializing profiler's order
        with torch.cuda.stream(streams[rank]):
            bound[rank].run_publisher(per_rank[rank], outs[rank])
    for rank in range(tp):
        with torch.cuda.stream(streams[rank]):
            bound[rank].run_reduce(outs[rank])
    torch.cuda.synchronize()
    want = _want(case, inputs.per_rank, inputs.norm_weight, 0)
    for rank in range(tp):
        _assert_bits(outs[rank], want[rank], f"apart, rank {rank}")
    assert bound[0].launch_demands(m)[0].ctas == m


@pytest.mark.gpu
def test_inputs_on_another_device_are_refused_before_launch():
    group = virtual_group("ep", 2)[0]
    bound = group.bind(norm())
    unfinalized, _ = _args()
    with pytest.raises(ValueError, match="must be on out's CUDA device"):
        bound.run(unfinalized, torch.zeros(2, P, dtype=torch.bfloat16, device="cuda"))
