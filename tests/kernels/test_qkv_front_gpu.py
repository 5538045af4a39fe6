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


def test_pdl_and_no_pdl_give_the_same_bits_eagerly_and_in_a_graph():
    """enable_pdl changes the launch, never the bits: out, tap and the whole cache buffer equal
    between the two builds, eagerly and as the second kernel of a captured graph (after a kernel
    that writes x, so the PDL build's wait is what orders the read)."""
    for tp in (16, 8, 4):
        case = front.FrontCase(tp=tp, tokens=7, inputs="adversarial")
        inputs = front.make_inputs(case)
        copies = front._device_copies(case, inputs, 0, torch.device("cuda"))
        o = copies["outputs"]
        results = {}
        for pdl in (True, False):
            for t in o.values():
                checks.poison(t)
            cute_ops.launch_qkv_front(copies["x"], copies["weight"], copies["positions"], copies["cos_sin"],
                                      copies["slots"], front.pool(o[front.CACHE]), o[front.CACHE].shape[1],
                                      o[front.OUT], tap=o[front.TAP], enable_pdl=pdl)
            torch.cuda.synchronize()
            results[pdl] = {k: v.cpu().view(torch.int16) for k, v in o.items()}
        for name in o:
            assert torch.equal(results[True][name], results[False][name]), (tp, name)
        source = copies["x"].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            copies["x"].copy_(source)  # the preceding kernel writes x
            cute_ops.launch_qkv_front(copies["x"], copies["weight"], copies["positions"], copies["cos_sin"],
                                      copies["slots"], front.pool(o[front.CACHE]), o[front.CACHE].shape[1],
                                      o[front.OUT], tap=o[front.TAP])
        copies["x"].zero_()
        for t in o.values():
            checks.poison(t)
        graph.replay()
        torch.cuda.synchronize()
        for name in o:
            assert torch.equal(o[name].cpu().view(torch.int16), results[False][name]), (tp, name, "graph")


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
def test_the_trace_keeps_the_bits_and_times_every_cta(pdl):
    """The traced build (`kernels.qkv_front` trace: an experiment, scripts/trace-qkv-front.py)
    writes the untraced build's out, tap and cache bits, and one row per CTA: every CTA's SM below
    the device's count, its clocks in order (entry <= waited <= streamed <= reduced <= end), its
    globaltimer end after its entry; every row written (the buffer starts at -1)."""
    from musebench.kernels import qkv_front

    for tp in (16, 4):
        case = front.FrontCase(tp=tp, tokens=5, inputs="adversarial")
        inputs = front.make_inputs(case)
        copies = front._device_copies(case, inputs, 0, torch.device("cuda"))
        o = copies["outputs"]
        kv = o[front.CACHE].shape[1]
        trace = torch.full((qkv_front.CTAS[kv], qkv_front.TRACE_WORDS), -1, dtype=torch.int64, device="cuda")
        results = []
        for traced in (None, trace):
            for t in o.values():
                checks.poison(t)
            qkv_front.launch(copies["x"], copies["weight"], copies["positions"], copies["cos_sin"], copies["slots"],
                             front.pool(o[front.CACHE]), o[front.OUT], tap=o[front.TAP], enable_pdl=pdl, trace=traced)
            torch.cuda.synchronize()
            results.append({k: v.cpu().view(torch.int16) for k, v in o.items()})
        for name in o:
            assert torch.equal(results[0][name], results[1][name]), (tp, name)
        rows = [dict(zip(qkv_front.TRACE_FIELDS, row)) for row in trace.cpu().tolist()]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for i, r in enumerate(rows):
            assert 0 <= r["smid"] < sms, (tp, i, r)
            clocks = [r[f] for f in ("clock_entry", "clock_waited", "clock_streamed", "clock_reduced", "clock_end")]
            assert clocks == sorted(clocks) and clocks[0] > 0, (tp, i, r)
            assert r["globaltimer_end"] >= r["globaltimer_entry"] > 0, (tp, i, r)


@pytest.mark.parametrize("tp", [16, 8, 4])
@pytest.mark.parametrize("pdl", [True, False])
def test_positions_and_slots_outside_the_tables_stay_inside_them(tp, pdl):
    """The kernel's bounds (cute_ops.launch_qkv_front): positions -5, max_pos and 2^40 read row 0
    / max_pos - 1 of a table set between NaN-poisoned guard rows (a read outside would bring NaN or
    another row's bits into q and k), slots pages x 16, 2^40 and -1 insert nothing (the whole
    poisoned buffer, guard pages included, keeps its poison outside the in-range slots); out and
    the cache equal the reference with bounds "kernel" on the kernel's own projection."""
    tokens = 8
    case = front.FrontCase(tp=tp, tokens=tokens)
    inputs = front.make_inputs(case)
    capacity = front.PAGES * 16
    positions = torch.tensor([-5, front.MAX_POS, 2 ** 40, 0, front.MAX_POS - 1, 7, -(2 ** 40), 3])
    slots = torch.tensor([capacity, 2 ** 40, -1, 0, capacity - 1, 17, capacity + 16, 40])
    guard = 4
    table = torch.full((front.MAX_POS + 2 * guard, 64), float("nan"))
    table[guard: guard + front.MAX_POS] = inputs.cos_sin
    inputs = front.FrontInputs(inputs.x, inputs.weights, positions, inputs.cos_sin, slots)
    dev = torch.device("cuda")
    copies = front._device_copies(case, inputs, 0, dev)
    table = table.to(dev)
    cos_sin = table[guard: guard + front.MAX_POS]
    assert cos_sin.is_contiguous() and cos_sin.data_ptr() % 16 == 0
    o = copies["outputs"]
    for t in o.values():
        checks.poison(t)
    cute_ops.launch_qkv_front(copies["x"], copies["weight"], copies["positions"], cos_sin, copies["slots"],
                              front.pool(o[front.CACHE]), o[front.CACHE].shape[1], o[front.OUT], tap=o[front.TAP],
                              enable_pdl=pdl)
    torch.cuda.synchronize()
    got = {k: v.cpu() for k, v in o.items()}
    from musebench.stock.qkv_front import qkv_epilogue_reference

    kv = o[front.CACHE].shape[1]
    buffer = checks.poison(front.cache_buffer(kv, dev))
    out, cache = qkv_epilogue_reference(o[front.TAP], copies["positions"], inputs.cos_sin.to(dev), copies["slots"],
                                        front.pool(buffer), kv, eps=front.EPS,
                                        approximations=hardware_approximations(), bounds="kernel")
    front.pool(buffer).copy_(cache)
    for name, want in ((front.OUT, out.cpu()), (front.CACHE, buffer.cpu())):
        count, ulp, first = checks.compare_bits(got[name], want)
        assert count == 0, f"{name}: {count} mismatches, max ulp {ulp}, first {first}"
    assert not torch.isnan(got[front.OUT].float()).any()
    # the in-range slots (0, capacity - 1, 17, 40) were written; every other cell holds the poison
    written = {0, capacity - 1, 17, 40}
    cells = got[front.CACHE][front.GUARD_PAGES: front.GUARD_PAGES + front.PAGES]
    for slot in range(capacity):
        cell = cells[slot // 16, :, slot % 16]
        assert checks.still_poisoned(cell) == (slot not in written), slot
    for page in (0, -1):
        assert checks.still_poisoned(got[front.CACHE][page]), "a guard page was written"


def test_a_bench_case_binds_and_its_deployed_launch_matches_expected():
    """The bench's case: bind checks the three forms agree, its call (no tap, PDL) writes out and
    the cache buffer `expected` holds (no tap), and its baselines include the build without PDL
    and the read floor."""
    from musebench.harness.case import RunOptions

    case = front.FrontCase(tp=8, tokens=5, inputs="adversarial", bench=True)
    inputs = front.make_inputs(case)
    options = RunOptions(backend="cute", impl="musebench")
    runner = front.bind(case, "musebench", 0, {}, inputs, options)
    want = front.expected(case, inputs, options, hardware_approximations()).per_rank[0]
    assert set(want) == set(runner.outputs) == {front.OUT, front.CACHE}
    for t in runner.outputs.values():
        checks.poison(t)
    runner.call()
    torch.cuda.synchronize()
    for name, tensor in runner.outputs.items():
        count, _, first = checks.compare_bits(tensor.cpu(), want[name])
        assert count == 0, (name, first)
    assert set(front.baselines(case, inputs, 0, runner, None)) == {front.VIRTUAL_STOCK, front.MATMUL, front.NO_PDL,
                                                                    front.READ_FLOOR}


def test_a_cold_bench_row_times_the_cold_launch_and_cold_cublas_on_the_same_copies():
    """`bench front --cold-weights` through the driver (tp 8, 7 copies of 37.7 MB): the row has
    `cold weights` and `torch matmul, cold weights`, the latter's ratio the cold launch over it;
    the cold cuBLAS call on copy j writes torch.matmul's bits on the weight (the copies are the
    weight's) and reads the cold launch's copies."""
    from musebench.harness.case import RunOptions
    from musebench.harness.driver import run_virtual
    from musebench.harness.measure import BenchOptions

    bench = BenchOptions(calls=7, replays=5)
    case = front.FrontCase(tp=8, tokens=4, bench=True, cold_copies=front.cold_copies_for(8, bench.calls))
    (row,) = run_virtual([case], RunOptions(backend="cute", impl="musebench"), measurement="bench", bench=bench)
    assert row.passed, (row.error, row.first_mismatch, row.notes)
    assert row.baselines_us[front.COLD] > 0 and row.baselines_us[front.COLD_MATMUL] > 0
    assert row.baseline_ratio_of == {front.COLD_MATMUL: front.COLD, front.COLD_READ_FLOOR: front.COLD}
    assert row.baseline_ratios[front.COLD_MATMUL] == row.baselines_us[front.COLD] / row.baselines_us[front.COLD_MATMUL]

    inputs = front.make_inputs(case)
    runner = front.bind(case, "musebench", 0, {}, inputs, RunOptions(backend="cute", impl="musebench"))
    paths = front.baselines(case, inputs, 0, runner, None)
    cold, cold_matmul = paths[front.COLD].call, paths[front.COLD_MATMUL].call
    assert cold_matmul.copies is cold.copies
    want = torch.matmul(runner.x, runner.weight.t()).view(torch.int16)
    for turn in range(case.cold_copies):
        checks.poison(cold_matmul.out)
        cold_matmul()
        torch.cuda.synchronize()
        assert torch.equal(cold_matmul.out.view(torch.int16), want), f"copy {turn}"
