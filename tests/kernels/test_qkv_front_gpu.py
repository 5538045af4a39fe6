"""The QKV front on a GPU (H200): the epilogue and cache bitwise vs the reference on the kernel's
own projection (tap), the projection repeatable, independent of the token padding and at most
cuBLAS's error, the cache untouched outside the slots. Skips without a CUDA GPU of SM >= 90."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs a CUDA GPU with SM >= 90", allow_module_level=True)

from musebench import cute_ops  # noqa: E402
from musebench.cases import qkv_front as front  # noqa: E402
from musebench.harness import checks  # noqa: E402
from musebench.kernels.approx import hardware_approximations  # noqa: E402


def run(case, inputs, rank=0):
    dev = torch.device("cuda")
    copies = front._device_copies(case, inputs, rank, dev)
    o = copies["outputs"]
    for t in o.values():
        checks.poison(t)
    cute_ops.launch_qkv_front(copies["x"], copies["weight"], copies["positions"], copies["cos_sin"],
                              copies["slots"], front.pool(o[front.CACHE]), o[front.CACHE].shape[1], o[front.OUT],
                              tap=o[front.TAP])
    torch.cuda.synchronize()
    return copies, {k: v.cpu() for k, v in o.items()}


@pytest.mark.parametrize("tp", [16, 8, 4])
@pytest.mark.parametrize("tokens", [1, 2, 5, 16])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("family", ["random", "adversarial"])
def test_epilogue_bitwise_and_projection_as_accurate_as_cublas(tp, tokens, rope, family):
    case = front.FrontCase(tp=tp, tokens=tokens, rope=rope, inputs=family)
    inputs = front.make_inputs(case)
    copies, got = run(case, inputs)
    want = front.expected_from_projection(case, inputs, got[front.TAP].cuda(), hardware_approximations())
    for name in (front.OUT, front.CACHE):
        count, ulp, first = checks.compare_bits(got[name], want[name])
        assert count == 0, f"{name}: {count} mismatches, max ulp {ulp}, first {first}"
    cublas = torch.matmul(copies["x"], copies["weight"].t())
    line, ok = front.projection_verdict(got[front.TAP], cublas, inputs.x, inputs.weights[0])
    assert ok, line
    _, again = run(case, inputs)
    assert torch.equal(again[front.TAP].view(torch.int16), got[front.TAP].view(torch.int16))


def test_projection_is_independent_of_the_padding():
    case16 = front.FrontCase(tp=8, tokens=16)
    inputs = front.make_inputs(case16)
    _, full = run(case16, inputs)
    for tokens in (1, 3, 8):
        case = front.FrontCase(tp=8, tokens=tokens)
        sub = front.FrontInputs(inputs.x[:tokens].contiguous(), inputs.weights, inputs.positions[:tokens].contiguous(),
                                inputs.cos_sin, inputs.slots[:tokens].contiguous())
        _, got = run(case, sub)
        assert torch.equal(got[front.TAP].view(torch.int16), full[front.TAP][:tokens].view(torch.int16))


def test_graph_capture_replays():
    case = front.FrontCase(tp=8, tokens=4)
    inputs = front.make_inputs(case)
    copies, eager = run(case, inputs)
    o = copies["outputs"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_ops.launch_qkv_front(copies["x"], copies["weight"], copies["positions"], copies["cos_sin"],
                                  copies["slots"], front.pool(o[front.CACHE]), 2, o[front.OUT], tap=o[front.TAP])
    for t in o.values():
        checks.poison(t)
    graph.replay()
    torch.cuda.synchronize()
    for name in eager:
        assert torch.equal(o[name].cpu().view(torch.int16), eager[name].view(torch.int16)), name


def test_a_heads_projection_does_not_depend_on_n():
    """8 CTAs per head at every N: one head's weight rows give the same bits at tp 16, 8 and 4
    (a kv = 2 / 4 weight made of copies of the kv = 1 weight's q, k, v and gate blocks)."""
    case1 = front.FrontCase(tp=16, tokens=5)
    inputs1 = front.make_inputs(case1)
    _, one = run(case1, inputs1)
    w1 = inputs1.weights[0]
    blocks = {"q": w1[:512], "k": w1[512:576], "v": w1[576:640], "gate": w1[640:]}
    for tp, kv in ((8, 2), (4, 4)):
        wide = torch.cat([blocks[name].repeat(kv, 1) for name in ("q", "k", "v", "gate")]).contiguous()
        case = front.FrontCase(tp=tp, tokens=5)
        inputs = front.FrontInputs(inputs1.x, [wide], inputs1.positions, inputs1.cos_sin, inputs1.slots)
        _, got = run(case, inputs)
        tap = got[front.TAP].view(torch.int16)
        want = one[front.TAP].view(torch.int16)
        q, k = 512 * kv, 64 * kv
        for copy in range(kv):
            assert torch.equal(tap[:, 512 * copy: 512 * (copy + 1)], want[:, :512]), (tp, "q", copy)
            assert torch.equal(tap[:, q + 64 * copy: q + 64 * (copy + 1)], want[:, 512:576]), (tp, "k", copy)
            assert torch.equal(tap[:, q + k + 64 * copy: q + k + 64 * (copy + 1)], want[:, 576:640]), (tp, "v", copy)
            gate = q + 2 * k
            assert torch.equal(tap[:, gate + 512 * copy: gate + 512 * (copy + 1)], want[:, 640:]), (tp, "gate", copy)
