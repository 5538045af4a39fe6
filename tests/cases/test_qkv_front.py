"""The qkv_front family's inputs and checks on CPU: the adversarial draw, the expected out and
cache from a projection (the reference), and fault injection proving the checks fail: a flipped
bit of out, a write outside the slots, a projection worse than cuBLAS's."""

from __future__ import annotations

import pytest
import torch

from musebench import numerics as nx
from musebench.cases import qkv_front as front
from musebench.harness import checks


def small_case(**kw):
    return front.FrontCase(tp=16, tokens=kw.pop("tokens", 6), **kw)


def test_inputs_are_deterministic_and_adversarial():
    case = small_case(inputs="adversarial")
    a, b = front.make_inputs(case), front.make_inputs(case)
    assert torch.equal(a.x.view(torch.int16), b.x.view(torch.int16))
    assert not a.x[0].any() and a.positions[0] == 0 and a.positions[1] == front.MAX_POS - 1
    assert a.slots[2] == -1 and a.slots[4] == a.slots[3] and torch.equal(a.x[4], a.x[3])
    assert len(a.weights) == 16 and a.weights[0].shape == (1152, 8192)
    assert front.make_inputs(small_case(rope=False)).cos_sin is None


@pytest.mark.parametrize("tp", [2, 3, 32])
def test_other_tps_are_refused(tp):
    with pytest.raises(ValueError, match="tp 4, 8, 16"):
        front.kv_heads_for(tp)


def _projection(inputs):
    return (inputs.x.float() @ inputs.weights[0].float().t()).bfloat16()


def _got(case, inputs, projection):
    """What a correct kernel writes: the reference's out and cache (from the poisoned cache)."""
    return front.expected_from_projection(case, inputs, projection, nx.PRECISE)


def _mismatches(got, want):
    return sum(checks.compare_bits(got[k], want[k])[0] for k in want)


@pytest.mark.parametrize("rope", [True, False])
def test_a_correct_output_passes_and_faults_fail(rope):
    case = small_case(inputs="adversarial", rope=rope)
    inputs = front.make_inputs(case)
    projection = _projection(inputs)
    want = _got(case, inputs, projection)
    got = {k: v.clone() for k, v in want.items()}
    assert _mismatches(got, want) == 0
    flipped = {k: v.clone() for k, v in want.items()}
    checks.flip_one_bit(flipped[front.OUT], index=5)
    assert _mismatches(flipped, want) == 1
    stray = {k: v.clone() for k, v in want.items()}
    free_page = 7 if int(inputs.slots.max()) // 16 != 7 else 0
    front.pool(stray[front.CACHE])[free_page, 0, 3, 0] = 1.0  # a write outside the slots
    assert _mismatches(stray, want) == 1
    # a write into a negative slot's would-be cell: row 2 is skipped, so nothing may land anywhere else
    cache = want[front.CACHE]
    written = ~checks.poison(torch.empty_like(cache)).view(torch.int16).eq(cache.view(torch.int16))
    assert int(written.any(dim=-1).sum()) == len({s for s in inputs.slots.tolist() if s >= 0})


def _fake_launch(write_negative_slots: bool):
    """A CPU stand-in for launch_qkv_front writing the reference's bits (out, tap, the slots'
    K | V); with `write_negative_slots`, a kernel that takes slot -1 as page -1, row 15: a write
    just before the cache it was given."""
    from musebench.stock.qkv_front import qkv_epilogue_reference

    def launch(x, weight, positions, cos_sin, slots, kv_cache, kv, out, tap=None):
        projection = (x.float() @ weight.float().t()).bfloat16()
        got, cache = qkv_epilogue_reference(projection, positions, cos_sin, slots, kv_cache, kv, eps=front.EPS)
        out.copy_(got)
        kv_cache.copy_(cache)
        if tap is not None:
            tap.copy_(projection)
        if write_negative_slots:
            before = torch.as_strided(kv_cache, (1, *kv_cache.shape[1:]), kv_cache.stride(),
                                      kv_cache.storage_offset() - kv_cache.stride(0))
            for t in (slots < 0).nonzero().flatten().tolist():
                page, row = divmod(int(slots[t]), 16)
                assert page == -1
                before[0, :, row, :64] = got[t, 512 * kv: 576 * kv].view(kv, 64)  # its k heads
        return out

    return launch


@pytest.mark.parametrize("write_negative_slots", [False, True])
def test_a_write_at_a_negative_slot_fails_the_cache_check(write_negative_slots):
    """The runner's cache sits between poisoned guard pages that are part of the checked output:
    a kernel writing slot -1 just before the cache it was given fails the bitwise check."""
    case = small_case(inputs="adversarial", tokens=3)  # token 2's slot is -1
    inputs = front.make_inputs(case)
    runner = front.FrontRunner(_fake_launch(write_negative_slots), case,
                               **front._device_copies(case, inputs, 0, torch.device("cpu")))
    for t in runner.outputs.values():
        checks.poison(t)
    runner.call()
    want = _got(case, inputs, _projection(inputs))
    assert (_mismatches(runner.outputs, want) > 0) == write_negative_slots


def test_the_launch_without_the_tap_must_write_the_tap_launchs_bits():
    """bind's check of the deployment's variant: a stand-in whose no-tap launch flips one bit of
    out (or writes one cache cell more) is refused, naming the rank; an agreeing one passes."""
    case = small_case(inputs="adversarial", tokens=3)
    inputs = front.make_inputs(case)
    copies = front._device_copies(case, inputs, 0, torch.device("cpu"))
    front.check_variants_agree(front.FrontRunner(_fake_launch(False), case, **copies), rank=3)
    faithful = _fake_launch(False)

    def flips_out(*args, tap=None):
        out = faithful(*args, tap=tap)
        if tap is None:
            checks.flip_one_bit(out, index=7)
        return out

    with pytest.raises(ValueError, match="rank 3: the launch without the tap wrote 1 elements of out"):
        front.check_variants_agree(front.FrontRunner(flips_out, case, **copies), rank=3)
    with pytest.raises(ValueError, match="rank 3: the launch without the tap wrote 1 elements of kv_cache"):
        front.check_variants_agree(front.FrontRunner(_fake_launch_no_tap_writes_more(), case, **copies), rank=3)


def _fake_launch_no_tap_writes_more():
    faithful = _fake_launch(False)

    def launch(x, weight, positions, cos_sin, slots, kv_cache, kv, out, tap=None):
        faithful(x, weight, positions, cos_sin, slots, kv_cache, kv, out, tap=tap)
        if tap is None:
            kv_cache[-1, 0, 15, 127] = 0.0  # a cell no slot reaches
        return out

    return launch


def test_v_written_unnormed_into_the_cache():
    case = small_case(tokens=2)
    inputs = front.make_inputs(case)
    projection = _projection(inputs)
    want = _got(case, inputs, projection)
    slot = int(inputs.slots[0])
    v = projection[0, 9 * 64: 10 * 64]
    assert torch.equal(front.pool(want[front.CACHE])[slot // 16, 0, slot % 16, 64:].view(torch.int16),
                       v.view(torch.int16))


def test_projection_verdict_fails_a_worse_projection():
    case = small_case(tokens=3)
    inputs = front.make_inputs(case)
    exact = inputs.x.double() @ inputs.weights[0].double().t()
    good = exact.bfloat16()
    line, ok = front.projection_verdict(good, good, inputs.x, inputs.weights[0])
    assert ok and "cuBLAS max" in line
    worse = good.clone()
    worse[0, 0] = float(worse[0, 0]) + 0.5
    assert front.projection_verdict(worse, good, inputs.x, inputs.weights[0])[1] is False


def _fp32_sum(inputs, slices, order=None, bf16_partials=False):
    """A model GEMM of rank 0's projection: exact products of 16 k summed to FP32, chained in FP32
    over `slices` equal K slices, the slices added in `order` (BF16-rounded first if asked)."""
    x, w = inputs.x.double(), inputs.weights[0].double()
    tokens, n = x.shape[0], w.shape[0]
    parts = torch.einsum("tck,nck->tnc", x.view(tokens, 512, 16), w.view(n, 512, 16)).float()
    per = 512 // slices
    sums = []
    for s in range(slices):
        acc = torch.zeros(tokens, n)
        for c in range(s * per, (s + 1) * per):
            acc = acc + parts[:, :, c]
        sums.append(acc.bfloat16().float() if bf16_partials else acc)
    order = order or list(range(slices))
    total = sums[order[0]]
    for s in order[1:]:
        total = total + sums[s]
    return total.bfloat16()


@pytest.fixture(scope="module", params=["random", "adversarial"])
def projection_inputs(request):
    return front.make_inputs(front.FrontCase(tp=16, tokens=8, inputs=request.param))


def test_projection_verdict_passes_equally_good_summation_orders(projection_inputs):
    """Two honest FP32 orders (the kernel's 8 slices in rank order, others) pass against each
    other both ways: the margins cover their rounding flips (the rule is not a coin toss)."""
    inputs = projection_inputs
    orders = {"8 slices": _fp32_sum(inputs, 8), "8 reversed": _fp32_sum(inputs, 8, list(range(7, -1, -1))),
              "4 slices": _fp32_sum(inputs, 4), "16 slices": _fp32_sum(inputs, 16), "sequential": _fp32_sum(inputs, 1)}
    assert not torch.equal(orders["8 slices"].view(torch.int16), orders["sequential"].view(torch.int16))
    for mine_name, mine in orders.items():
        for theirs_name, theirs in orders.items():
            line, ok = front.projection_verdict(mine, theirs, inputs.x, inputs.weights[0])
            assert ok, f"{mine_name} vs {theirs_name}: {line}"


def test_projection_verdict_fails_injected_faults(projection_inputs):
    """Faults a kernel could make fail against an honest FP32 order: BF16-rounded split-K
    partials, one output 2 BF16 ULPs off at the element of the largest error, a NaN, a nonzero
    output of the zero row (adversarial: row 0 is all zeros)."""
    from musebench.stock.qkv_front import fp64_projection, term_magnitudes

    inputs = projection_inputs
    honest = _fp32_sum(inputs, 8)
    assert front.projection_verdict(_fp32_sum(inputs, 8, bf16_partials=True), honest, inputs.x,
                                    inputs.weights[0])[1] is False
    exact = fp64_projection(inputs.x, inputs.weights[0])
    error = (honest.double() - exact).abs() / term_magnitudes(inputs.x, inputs.weights[0]).clamp_min(1e-300)
    t, n = divmod(int(error.argmax()), exact.shape[1])
    off = honest.clone()
    value = float(off[t, n])
    ulp = max(2.0 ** (torch.tensor(abs(value)).log2().floor().item() - 7), 2.0 ** -133)  # subnormal rows too
    off[t, n] = value + 2 * ulp * (1 if value >= exact[t, n] else -1)
    assert front.projection_verdict(off, honest, inputs.x, inputs.weights[0])[1] is False
    nan = honest.clone()
    nan[1, 3] = float("nan")
    line, ok = front.projection_verdict(nan, honest, inputs.x, inputs.weights[0])
    assert not ok and "unbounded 1" in line
    if inputs.x[0].abs().max() == 0:
        stray = honest.clone()
        stray[0, 5] = 2.0 ** -100
        assert front.projection_verdict(stray, honest, inputs.x, inputs.weights[0])[1] is False


def test_bytes_moved_is_the_weight_and_the_roofline_reads_it_at_4_2_tb_per_s():
    assert front.bytes_moved(front.FrontCase(tp=8, tokens=1)) == 2304 * 8192 * 2
    for tp, us in ((16, 4.49), (8, 8.99), (4, 17.98)):
        assert round(front.roofline_us(front.FrontCase(tp=tp, tokens=1)), 2) == us


def test_a_bench_row_carries_the_roofline():
    from musebench.harness.case import RunOptions
    from musebench.harness.driver import new_row

    row = new_row(front.FrontCase(tp=8, tokens=4), RunOptions(), "local", 1, "bench")
    assert row.roofline_us == front.roofline_us(front.FrontCase(tp=8, tokens=4))
    assert front.VIRTUAL_STOCK == "unfused" and front.MATMUL == "torch matmul"


def test_cli_without_a_gpu_reports_skipped(tmp_path, no_gpu):
    """`musebench front` where the kernel cannot run: the run is reported skipped with the reason
    (as `attn` and `routing`), not refused with advice to pass a --backend it does not have."""
    import json

    from click.testing import CliRunner

    from musebench.cli import main

    path = tmp_path / "front.json"
    result = CliRunner().invoke(main, ["front", "--tp", "16", "--tokens", "1", "--json", str(path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (skipped,) = json.loads(path.read_text())["skipped"]
    assert skipped["kernel"] == "qkv_front" and "GPU" in skipped["reason"]


@pytest.mark.parametrize("command", [["bench", "front"], ["bench", "attn"]])
def test_bench_without_a_gpu_exits_2_without_advising_a_cpu_backend(no_gpu, command):
    from click.testing import CliRunner

    from musebench.cli import main

    result = CliRunner().invoke(main, command, catch_exceptions=False)
    assert result.exit_code == 2
    assert "needs a CUDA GPU with SM >= 90 and CuTe DSL (no such GPU here); it has no CPU model" in result.output
    assert "--backend" not in result.output



def _fake_launch_with_pdl(flip_without_pdl: bool):
    """A stand-in taking musebench's `enable_pdl`, recording each launch's (tap?, pdl); with
    `flip_without_pdl`, its build without PDL flips one bit of out."""
    faithful = _fake_launch(False)
    seen = []

    def launch(x, weight, positions, cos_sin, slots, kv_cache, kv, out, tap=None, enable_pdl=True):
        seen.append((tap is not None, enable_pdl))
        faithful(x, weight, positions, cos_sin, slots, kv_cache, kv, out, tap=tap)
        if flip_without_pdl and not enable_pdl:
            checks.flip_one_bit(out, index=5)
        return out

    launch.seen = seen
    return launch


def test_the_build_without_pdl_must_write_the_tap_launchs_bits():
    """Where the launch takes enable_pdl, bind also launches the build without PDL and refuses
    (naming the rank) one whose bits differ; a launch without the keyword is not asked for it."""
    case = small_case(inputs="adversarial", tokens=3)
    inputs = front.make_inputs(case)
    copies = front._device_copies(case, inputs, 0, torch.device("cpu"))
    good = _fake_launch_with_pdl(False)
    front.check_variants_agree(front.FrontRunner(good, case, **copies), rank=2)
    assert good.seen == [(True, True), (False, True), (False, False)]
    with pytest.raises(ValueError, match="rank 2: the launch without the tap or PDL wrote 1 elements of out"):
        front.check_variants_agree(front.FrontRunner(_fake_launch_with_pdl(True), case, **copies), rank=2)
    assert front.takes_pdl(good) and not front.takes_pdl(_fake_launch(False))


def test_a_bench_case_calls_the_deployed_launch_and_times_the_tap_apart():
    """`musebench bench front`'s cases: the call (the tail column) is the launch without the tap,
    with PDL; its outputs are out and the cache (no tap: expected has none either); the tap launch
    is the part `with tap`. A check case calls the tap launch, with `no tap` as its part."""
    case = small_case(tokens=3, bench=True)
    inputs = front.make_inputs(case)
    copies = front._device_copies(case, inputs, 0, torch.device("cpu"))
    assert set(copies["outputs"]) == {front.OUT, front.CACHE}
    launch = _fake_launch_with_pdl(False)
    runner = front.FrontRunner(launch, case, **copies)
    runner.call()
    assert launch.seen == [(False, True)]
    assert list(runner.parts()) == [front.WITH_TAP]
    runner.parts()[front.WITH_TAP]()
    assert launch.seen[-1] == (True, True)
    check = small_case(tokens=3)
    assert set(front._device_copies(check, inputs, 0, torch.device("cpu"))["outputs"]) == {
        front.OUT, front.CACHE, front.TAP}
    checked = front.FrontRunner(launch, check, **front._device_copies(check, inputs, 0, torch.device("cpu")))
    checked.call()
    assert launch.seen[-1] == (True, True) and list(checked.parts()) == [front.NO_TAP]
    assert set(front.PARTS) == {front.NO_TAP, front.WITH_TAP}
    assert "deployed launch" in front.row_fields(case, None)["mode"] and "deployed" in case.label()
    assert "deployed" not in front.row_fields(check, None)["mode"]


def test_bench_jobs_build_bench_cases(monkeypatch):
    from musebench.harness import jobs

    kwargs = dict(name="f", tp=16, tokens=(1, 2), rope=(True,), inputs=("random",), seeds=(0,), check_machine=False)
    assert all(c.bench for c in jobs.make_front_job(**kwargs, measurement="bench").cases)
    assert not any(c.bench for c in jobs.make_front_job(**kwargs).cases)


def test_cold_weights_copies_keep_every_copy_out_of_l2_or_are_refused():
    """One copy per call of the graph: calls - 1 other copies between two reads of one copy must be
    at least COLD_L2_FACTOR L2s (13, 7, 4 calls at tp 16, 8, 4); more than COLD_MAX_BYTES of copies
    is refused too."""
    for tp, least in ((16, 13), (8, 7), (4, 4)):
        size = front.bytes_moved(front.FrontCase(tp=tp, tokens=1))
        assert (least - 1) * size >= front.COLD_L2_FACTOR * front.L2_BYTES > (least - 2) * size
        assert front.cold_copies_for(tp, least) == least
        with pytest.raises(ValueError, match=f"needs --calls >= {least} .* got --calls {least - 1}"):
            front.cold_copies_for(tp, least - 1)
    with pytest.raises(ValueError, match="GiB"):
        front.cold_copies_for(4, 1000)


def test_the_cold_bytes_cap_counts_the_weight_copies_and_the_cold_floors_buffers():
    """A cold-weights bench holds two sets of copies (the weight's and `read floor, cold weights`'s
    buffers): at tp 4 (75.5 MB) the most calls whose two sets fit COLD_MAX_BYTES pass, one more is
    refused, though one set of it would fit."""
    size = front.bytes_moved(front.FrontCase(tp=4, tokens=1))
    most = front.COLD_MAX_BYTES // (2 * size)
    assert (most + 1) * size <= front.COLD_MAX_BYTES < 2 * (most + 1) * size  # one set would fit
    assert front.cold_copies_for(4, most) == most
    with pytest.raises(ValueError, match=rf"^--cold-weights .* at tp 4: --calls {most + 1} would hold .* \(2 x "
                                         rf"{most + 1} x 75.5 MB; at most 16 GiB\)"):
        front.cold_copies_for(4, most + 1)
    front.check_cold_calls(size, most + 1, "one set")  # the script's single set: within the cap
    with pytest.raises(ValueError, match=r"^one set: --calls 1000 would hold"):
        front.check_cold_calls(size, 1000, "one set")


def test_cold_weights_need_a_bench_job_and_enough_calls():
    from musebench.harness import jobs
    from musebench.harness.measure import BenchOptions

    kwargs = dict(name="f", tp=16, tokens=(1,), rope=(True,), inputs=("random",), seeds=(0,), check_machine=False)
    with pytest.raises(ValueError, match="needs a bench job"):
        jobs.make_front_job(**kwargs, cold_weights=True)
    with pytest.raises(ValueError, match="--calls >= 13"):
        jobs.make_front_job(**kwargs, measurement="bench", bench=BenchOptions(calls=12), cold_weights=True)
    job = jobs.make_front_job(**kwargs, measurement="bench", bench=BenchOptions(calls=20), cold_weights=True)
    assert [c.cold_copies for c in job.cases] == [20] and "cold weights x20" in job.cases[0].label()
    plain = jobs.make_front_job(**kwargs, measurement="bench", bench=BenchOptions(calls=20))
    assert [c.cold_copies for c in plain.cases] == [0]


@pytest.mark.parametrize("argv", [["--tp", "16", "--calls", "12"], ["--tp", "4,8", "--calls", "6"]])
def test_bench_front_cold_weights_with_too_few_calls_exits_2_before_anything_launches(no_gpu, argv):
    """The refusal comes from the options alone (here no GPU exists; the option is refused first)."""
    from click.testing import CliRunner

    from musebench.cli import main

    result = CliRunner().invoke(main, ["bench", "front", "--cold-weights", *argv], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "--cold-weights reads one weight copy per call" in result.output
    assert "needs a CUDA GPU" not in result.output


def test_cold_launch_reads_a_copy_of_its_own_per_captured_call_and_checks_every_copy():
    """`cold_launch(runner, k)`: k calls read k distinct copies (never the runner's weight), into
    the runner's outputs; a copy whose launch writes other bits than the launch on the weight is
    refused, naming the copy (fault injection: a corrupted copy, a launch that ignores nothing)."""
    case = small_case(tokens=3, bench=True, cold_copies=4)
    inputs = front.make_inputs(case)
    copies = front._device_copies(case, inputs, 0, torch.device("cpu"))
    faithful = _fake_launch(False)
    read = []

    def launch(x, weight, *args, **kwargs):
        read.append(weight.data_ptr())
        return faithful(x, weight, *args, **kwargs)

    runner = front.FrontRunner(launch, case, **copies)
    call = front.cold_launch(runner, 4)
    assert len(read) == 5  # the check: the weight, then every copy
    read.clear()
    for _ in range(4):
        call()
    assert sorted(read) == sorted(c.data_ptr() for c in call.copies) and len(set(read)) == 4
    assert runner.weight.data_ptr() not in read
    bad = [c.clone() for c in call.copies]
    bad[2][7, 100] = -bad[2][7, 100] if bad[2][7, 100] != 0 else 1.0
    with pytest.raises(ValueError, match="weight copy 2 wrote .* elements of out"):
        front.check_cold_copies_agree(runner, bad)
    front.check_cold_copies_agree(runner, [c.clone() for c in call.copies])


def test_the_cold_weights_baseline_is_there_only_with_copies(monkeypatch, emulated_read_floor):
    import musebench.stock.triton_qkv_epilogue as triton_stock

    monkeypatch.setattr(triton_stock, "triton_qkv_epilogue", lambda *a, **k: None)
    inputs = front.make_inputs(small_case(tokens=2))
    for copies, want in ((0, False), (13, True)):
        case = small_case(tokens=2, bench=True, cold_copies=copies)
        runner = front.FrontRunner(_fake_launch(False), case,
                                   **front._device_copies(case, inputs, 0, torch.device("cpu")))
        paths = front.baselines(case, inputs, 0, runner, None)
        assert (front.COLD in paths) == want and (front.COLD_MATMUL in paths) == want
        assert (front.COLD_READ_FLOOR in paths) == want and front.READ_FLOOR in paths
        assert front.NO_PDL not in paths  # the stand-in takes no enable_pdl


@pytest.fixture
def cold_front_baselines(monkeypatch, emulated_read_floor):
    """`_cold_front_baselines` with the read floor's reader emulated."""
    return lambda copies=4: _cold_front_baselines(monkeypatch, copies)


def _cold_front_baselines(monkeypatch, copies=4):
    """A cold bench case's baselines on CPU (the fake launch, the Triton epilogue stubbed; the
    caller emulates the read floor's reader), and a log of the weights every torch.matmul call
    reads and the buffer it writes."""
    import musebench.stock.triton_qkv_epilogue as triton_stock

    monkeypatch.setattr(triton_stock, "triton_qkv_epilogue", lambda *a, **k: None)
    case = small_case(tokens=2, bench=True, cold_copies=copies)
    inputs = front.make_inputs(case)
    runner = front.FrontRunner(_fake_launch(False), case, **front._device_copies(case, inputs, 0, torch.device("cpu")))
    paths = front.baselines(case, inputs, 0, runner, None)
    matmuls = []
    real = torch.matmul

    def counting_matmul(a, b, *, out=None):
        matmuls.append((b, out))
        return real(a, b, out=out)

    monkeypatch.setattr(torch, "matmul", counting_matmul)
    return paths, matmuls


def _assert_cold_matmul_rotates(paths, matmuls, copies):
    """The cold cuBLAS baseline's `copies` calls read each of the cold launch's copies once (the
    same storage, no second set), as transposed views made once (the same objects the next round:
    nothing made per call), into one qkv buffer."""
    cold, cold_matmul = paths[front.COLD].call, paths[front.COLD_MATMUL].call
    assert cold_matmul.copies is cold.copies
    for _ in range(2 * copies):
        cold_matmul()
    read = [b for b, _ in matmuls]
    pointers = [b.data_ptr() for b in read[:copies]]
    assert sorted(pointers) == sorted(c.data_ptr() for c in cold.copies), "not every cold copy read once a round"
    assert all(b.shape == cold.copies[0].t().shape and b.stride() == (1, front.HIDDEN) for b in read)
    assert [id(b) for b in read[:copies]] == [id(b) for b in read[copies:]], "a weight view made per call"
    assert len({id(out) for _, out in matmuls}) == 1, "another out buffer per call"


def test_the_cold_matmul_reads_the_cold_launchs_copies_in_turn(cold_front_baselines):
    paths, matmuls = cold_front_baselines()
    _assert_cold_matmul_rotates(paths, matmuls, 4)
    assert matmuls[0][1] is not paths[front.COLD].call.copies[0]  # it writes a qkv buffer, not a weight


def test_a_cold_matmul_stuck_on_one_copy_is_caught(monkeypatch, cold_front_baselines):
    """Fault injection: a rotation that always hands out copy 0 fails the check above."""
    monkeypatch.setattr(front.WeightRotation, "next", lambda self: self.copies[0])
    paths, matmuls = cold_front_baselines()
    with pytest.raises(AssertionError, match="not every cold copy"):
        _assert_cold_matmul_rotates(paths, matmuls, 4)


def test_a_cold_matmul_making_a_view_per_call_is_caught(cold_front_baselines):
    """Fault injection: a call that transposes its copy at every call fails the check above."""
    from musebench.cases.tail import Baseline

    paths, matmuls = cold_front_baselines()
    copies = paths[front.COLD].call.copies
    rotation, x, qkv = front.WeightRotation(copies), torch.zeros(2, front.HIDDEN, dtype=torch.bfloat16), \
        torch.empty(2, 1152, dtype=torch.bfloat16)

    def per_call() -> None:
        torch.matmul(x, rotation.next().t(), out=qkv)

    per_call.copies = copies
    paths[front.COLD_MATMUL] = Baseline(per_call)
    with pytest.raises(AssertionError, match="view made per call"):
        _assert_cold_matmul_rotates(paths, matmuls, 4)


def test_the_cold_ratios_pair_cold_with_cold():
    """The cold cuBLAS and cold read floor cells' ratios are the cold launch over them; the others
    (the one-buffer read floor's included) stay the tail's."""
    assert front.BASELINE_RATIO_OF == {front.COLD_MATMUL: front.COLD, front.COLD_READ_FLOOR: front.COLD}
    from musebench.harness.results import CaseResult
    from musebench.harness.report import baseline_legend

    row = CaseResult(kernel="qkv_front", backend="cute", mode="rope", tp=16, tokens=1, weight_dtype="bf16",
                     norm="qk", inputs="random", seed=0, launcher="virtual", transport="local", stock="torch",
                     tail_us=8.0, baselines_us={front.READ_FLOOR: 4.0, front.COLD: 10.0, front.COLD_READ_FLOOR: 6.25})
    from musebench.harness.driver import ratios_of

    row.baseline_ratio_of = ratios_of(front, row.baselines_us)
    assert row.baseline_ratios == {front.READ_FLOOR: 2.0, front.COLD: 0.8, front.COLD_READ_FLOOR: 1.6}
    assert "but read floor, cold weights: cold weights / it" in baseline_legend([row])


def _front_floor_paths(copies: int, bench: bool = True):
    """A bench case's baselines on CPU (the fake launch, the Triton epilogue stubbed; the caller
    emulates or breaks the read floor's reader), and its runner."""
    case = small_case(tokens=1, bench=bench, cold_copies=copies)
    inputs = front.make_inputs(case)
    runner = front.FrontRunner(_fake_launch(False), case, **front._device_copies(case, inputs, 0, torch.device("cpu")))
    return front.baselines(case, inputs, 0, runner, None), runner


def test_the_read_floors_read_the_weights_bytes_one_buffer_or_the_cold_copies_count(monkeypatch,
                                                                                    emulated_read_floor):
    """`read floor` reads one buffer of the weight's bytes at every call; `read floor, cold
    weights` as many separate buffers of that size as the cold weights have copies, call j the
    buffer j mod cold_copies; both checked once before timing (every buffer read once)."""
    import musebench.stock.triton_qkv_epilogue as triton_stock

    monkeypatch.setattr(triton_stock, "triton_qkv_epilogue", lambda *a, **k: None)
    paths, runner = _front_floor_paths(copies=4)
    size = front.bytes_moved(small_case())
    assert size == runner.weight.numel() * 2 == 1152 * 8192 * 2
    assert [w.numel() * 4 for w in emulated_read_floor] == [size] * 5  # the checks: 1 + 4 buffers, once each
    floor, cold = paths[front.READ_FLOOR].call, paths[front.COLD_READ_FLOOR].call
    assert len(floor.buffers) == 1 and len(cold.buffers) == 4 == len(paths[front.COLD].call.copies)
    assert len({b.data_ptr() for b in cold.buffers}) == 4 and all(b.numel() * 4 == size for b in cold.buffers)
    emulated_read_floor.clear()
    for _ in range(3):
        floor()
    for _ in range(8):
        cold()
    read = [w.data_ptr() for w in emulated_read_floor]
    assert read[:3] == [floor.buffers[0].data_ptr()] * 3
    assert read[3:] == [cold.buffers[j % 4].data_ptr() for j in range(8)]
    assert list(paths)[-1] == front.COLD_READ_FLOOR and list(paths).index(front.READ_FLOOR) < list(paths).index(front.COLD)


def test_a_read_floor_that_skips_bytes_fails_the_case_before_timing(monkeypatch):
    """Fault injection: a reader that skips each buffer's last 16 bytes makes `baselines` raise
    (the case's error, naming the path) instead of timing a floor that read less."""
    import musebench.stock.triton_qkv_epilogue as triton_stock
    from musebench.stock import read_floor
    from tests._read_floor import emulated_triton_read

    monkeypatch.setattr(triton_stock, "triton_qkv_epilogue", lambda *a, **k: None)
    monkeypatch.setattr(read_floor, "triton_read", lambda w, p, c: emulated_triton_read(w[:-4], p, c))
    with pytest.raises(RuntimeError, match=r"^read floor of qkv_front .*buffer 0 of 1: .* did not read every byte"):
        _front_floor_paths(copies=0)
    reads = []

    def cold_only_short(words, partials, config):  # the one-buffer floor's check reads right, the cold floor's short
        reads.append(words)
        emulated_triton_read(words if len(reads) == 1 else words[:-4], partials, config)

    monkeypatch.setattr(read_floor, "triton_read", cold_only_short)
    with pytest.raises(RuntimeError, match=r"^read floor, cold weights of qkv_front .*buffer 0 of 4"):
        _front_floor_paths(copies=4)


@pytest.mark.gpu
@pytest.mark.parametrize("cold", [False, True])
def test_bench_front_times_the_read_floor_beside_the_kernel(cold):
    """On a GPU: a bench front row (tp 16, 1 token; with cold weights over 13 copies) passes and
    carries `read floor` (and `read floor, cold weights`) with a positive time and its ratio."""
    from musebench.harness.jobs import make_front_job, run_job
    from musebench.harness.measure import BenchOptions

    pytest.importorskip("triton")
    job = make_front_job(name="front floor", tp=16, tokens=(1,), rope=(True,), inputs=("random",), seeds=(0,),
                         measurement="bench", bench=BenchOptions(calls=13, replays=3), cold_weights=cold)
    (row,) = run_job(job)
    assert row.passed, row.error
    assert row.baselines_us[front.READ_FLOOR] > 0 and row.baseline_ratios[front.READ_FLOOR] > 0
    if cold:
        assert row.baselines_us[front.COLD_READ_FLOOR] > 0
        assert row.baseline_ratios[front.COLD_READ_FLOOR] == pytest.approx(
            row.baselines_us[front.COLD] / row.baselines_us[front.COLD_READ_FLOOR])
    else:
        assert front.COLD_READ_FLOOR not in row.baselines_us


@pytest.mark.gpu
def test_bench_front_refuses_a_read_floor_with_a_wrong_sum(monkeypatch):
    """On a GPU: the compiled reader made to read 16 bytes short fails the bench row, naming the
    read floor, and no floor time is reported."""
    from musebench.harness.jobs import make_front_job, run_job
    from musebench.harness.measure import BenchOptions
    from musebench.stock import read_floor

    pytest.importorskip("triton")
    real = read_floor.triton_read
    monkeypatch.setattr(read_floor, "triton_read", lambda w, p, c: real(w[:-4], p, c))
    job = make_front_job(name="front floor short", tp=16, tokens=(1,), rope=(True,), inputs=("random",), seeds=(0,),
                         measurement="bench", bench=BenchOptions(calls=5, replays=3))
    (row,) = run_job(job)
    assert not row.passed and "read floor" in row.error and "did not read every byte" in row.error
    assert front.READ_FLOOR not in row.baselines_us
