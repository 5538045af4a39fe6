"""The balanced QKV front on a GPU (H200): bit for bit the cluster kernel's out, tap and whole cache
buffer (int16 views: mismatch count and first index), at N = 1152, 2304, 4608, tokens 1, 2, 8, 16,
RoPE and NoPE, every CTA width, PDL or not, eagerly and over repeated graph replays (the counters
re-arm themselves: the workspace's counters are 0 after every launch). Skips without a CUDA GPU
of SM >= 90."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs a CUDA GPU with SM >= 90", allow_module_level=True)

from musebench import cute_ops, qkv_front_plan  # noqa: E402
from musebench.cases import qkv_front as front  # noqa: E402
from musebench.harness import checks  # noqa: E402
from musebench.kernels import qkv_front_balanced  # noqa: E402
from musebench.kernels.approx import hardware_approximations  # noqa: E402


def bit_mismatches(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int | None]:
    """(mismatching elements, flat index of the first or None) of two bf16 tensors' int16 views."""
    differ = (got.view(torch.int16) != want.view(torch.int16)).flatten()
    count = int(differ.sum())
    return count, (int(differ.nonzero()[0]) if count else None)


def assert_same_bits(got: dict, want: dict, what: str) -> None:
    for name in want:
        count, first = bit_mismatches(got[name], want[name])
        assert count == 0, f"{what}: {name} has {count} mismatching elements, the first at flat index {first}"


def copies_for(case, inputs):
    return front._device_copies(case, inputs, 0, torch.device("cuda"))


def launch(copies, **keywords):
    o = copies["outputs"]
    cute_ops.launch_qkv_front(copies["x"], copies["weight"], copies["positions"], copies["cos_sin"], copies["slots"],
                              front.pool(o[front.CACHE]), o[front.CACHE].shape[1], o[front.OUT], tap=copies["tap"],
                              **keywords)


def outputs_of(copies, **keywords) -> dict[str, torch.Tensor]:
    """One eager launch from poisoned outputs (out, tap, the whole cache buffer with its guard pages)."""
    o = copies["outputs"]
    for t in (o[front.OUT], o[front.CACHE], copies["tap"]):
        checks.poison(t)
    launch(copies, **keywords)
    torch.cuda.synchronize()
    return {front.OUT: o[front.OUT].cpu(), front.TAP: copies["tap"].cpu(), front.CACHE: o[front.CACHE].cpu()}


def counters_are_zero(workspace: torch.Tensor, kv: int) -> bool:
    layout = qkv_front_plan.workspace_layout(kv)
    return not workspace[layout.group_counters: layout.total].any()


@pytest.mark.parametrize("tp", [16, 8, 4])
@pytest.mark.parametrize("tokens", [1, 2, 8, 16])
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("family", ["random", "adversarial"])
def test_balanced_equals_cluster_bit_for_bit(tp, tokens, rope, family):
    """out, tap and the whole poisoned cache buffer: the balanced plan's bits are the cluster
    plan's, and both equal the reference epilogue on the tap (so nothing is written outside the
    slots: every other byte of the buffer, guard pages included, keeps its poison)."""
    case = front.FrontCase(tp=tp, tokens=tokens, rope=rope, inputs=family)
    inputs = front.make_inputs(case)
    copies = copies_for(case, inputs)
    kv = copies["outputs"][front.CACHE].shape[1]
    workspace = cute_ops.qkv_front_workspace(kv, "cuda")
    cluster = outputs_of(copies)
    balanced = outputs_of(copies, plan="balanced", workspace=workspace)
    assert_same_bits(balanced, cluster, f"tp {tp}, {tokens} tokens")
    want = front.expected_from_projection(case, inputs, cluster[front.TAP].cuda(), hardware_approximations())
    assert_same_bits(balanced, want, "the reference on the tap")
    assert counters_are_zero(workspace, kv)


@pytest.mark.parametrize("tp", [16, 8, 4])
@pytest.mark.parametrize("warps", qkv_front_plan.UNIT_WARPS)
def test_every_cta_width_and_both_pdl_forms_give_the_cluster_bits(tp, warps):
    case = front.FrontCase(tp=tp, tokens=7, inputs="adversarial")
    inputs = front.make_inputs(case)
    copies = copies_for(case, inputs)
    o = copies["outputs"]
    kv = o[front.CACHE].shape[1]
    cluster = outputs_of(copies)
    workspace = cute_ops.qkv_front_workspace(kv, "cuda")
    for pdl in (True, False):
        for t in (o[front.OUT], o[front.CACHE], copies["tap"]):
            checks.poison(t)
        qkv_front_balanced.launch(copies["x"], copies["weight"], copies["positions"], copies["cos_sin"],
                                  copies["slots"], front.pool(o[front.CACHE]), o[front.OUT], tap=copies["tap"],
                                  enable_pdl=pdl, workspace=workspace, warps=warps)
        torch.cuda.synchronize()
        got = {front.OUT: o[front.OUT].cpu(), front.TAP: copies["tap"].cpu(), front.CACHE: o[front.CACHE].cpu()}
        assert_same_bits(got, cluster, f"tp {tp}, {warps} warps, pdl {pdl}")
        assert counters_are_zero(workspace, kv)


@pytest.mark.parametrize("tp", [16, 8, 4])
def test_graph_replays_give_the_same_bits_and_rearm_the_counters(tp):
    """The balanced launch captured after a kernel that writes x (its PDL wait orders the read),
    replayed 5 times from poisoned outputs: every replay the cluster plan's bits, the counters 0
    after each; the shared workspace (no workspace passed) serves after its eager allocation."""
    case = front.FrontCase(tp=tp, tokens=16, inputs="adversarial")
    inputs = front.make_inputs(case)
    copies = copies_for(case, inputs)
    o = copies["outputs"]
    kv = o[front.CACHE].shape[1]
    cluster = outputs_of(copies)
    outputs_of(copies, plan="balanced")  # eager: compiles and allocates the shared workspace
    shared = qkv_front_balanced.shared_workspace(kv, torch.device("cuda", torch.cuda.current_device()))
    source = copies["x"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copies["x"].copy_(source)
        launch(copies, plan="balanced")
    for replay in range(5):
        copies["x"].zero_()
        for t in (o[front.OUT], o[front.CACHE], copies["tap"]):
            checks.poison(t)
        graph.replay()
        torch.cuda.synchronize()
        got = {front.OUT: o[front.OUT].cpu(), front.TAP: copies["tap"].cpu(), front.CACHE: o[front.CACHE].cpu()}
        assert_same_bits(got, cluster, f"tp {tp}, replay {replay}")
        assert counters_are_zero(shared, kv), replay


def test_the_bit_check_catches_a_flipped_bit():
    """Fault injection: one flipped bit of the balanced plan's out (or of a cache cell) is one
    mismatch at its index, and assert_same_bits fails naming it."""
    case = front.FrontCase(tp=16, tokens=3)
    inputs = front.make_inputs(case)
    copies = copies_for(case, inputs)
    kv = copies["outputs"][front.CACHE].shape[1]
    cluster = outputs_of(copies)
    balanced = outputs_of(copies, plan="balanced", workspace=cute_ops.qkv_front_workspace(kv, "cuda"))
    assert_same_bits(balanced, cluster, "before the fault")
    checks.flip_one_bit(balanced[front.OUT], index=77)
    assert bit_mismatches(balanced[front.OUT], cluster[front.OUT]) == (1, 77)
    with pytest.raises(AssertionError, match="out has 1 mismatching elements, the first at flat index 77"):
        assert_same_bits(balanced, cluster, "after the fault")
    cache = balanced[front.CACHE]
    cache.view(-1)[5] = cache.view(-1)[5] + 1  # a stray write into a poisoned guard cell
    assert bit_mismatches(cache, cluster[front.CACHE]) == (1, 5)


def test_a_head_s_partials_sum_in_slice_order():
    """The workspace after a launch holds each warp's FP32 partial; the rank-order sum of a head's
    8 slices, rounded once, is the tap (the order the cluster kernel's CTA 0 adds)."""
    case = front.FrontCase(tp=16, tokens=5)
    inputs = front.make_inputs(case)
    copies = copies_for(case, inputs)
    workspace = cute_ops.qkv_front_workspace(1, "cuda")
    got = outputs_of(copies, plan="balanced", workspace=workspace)
    partials = workspace[: qkv_front_plan.workspace_layout(1).projection].view(torch.float32).cpu()
    partials = partials.view(18, 8, 8, 32, 4)  # [head, n-tile, slice, lane, fragment]
    head, tile = 3, 5
    total = partials[head, tile, 0].clone()
    for r in range(1, 8):
        total = total + partials[head, tile, r]  # FP32 adds in slice order, each rounded
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(4):
            row, column = g + 8 * (i // 2), head * 64 + 8 * tile + 2 * t + i % 2
            if row < 5:
                want = total[lane, i].to(torch.bfloat16)
                assert got[front.TAP][row, column].view(torch.int16) == want.view(torch.int16), (lane, i)
