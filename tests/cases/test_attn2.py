"""The attn2 family on CPU: refusals before launch, the rank-identity expectation (a rank's columns
of a 16-KV-head output, what the CPU model gives a rank), the accuracy verdict, the roofline's
bytes, and fault injection proving the checks fail: a flipped bit, a worse output, a NaN. The
CLI: tp 32 refused with the reason (exit 2), a run without a GPU reported skipped."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from musebench import attn2_layout as lay
from musebench.cases import FAMILIES
from musebench.cases import attn2 as fam
from musebench.cases.attn2_inputs import for_rank, make_problem
from musebench.cli import main
from musebench.cpu.attn2 import attn2_model
from musebench.harness import checks
from musebench.stock.attn2 import attn2_reference, stock_attn2


def test_registered():
    assert FAMILIES["attn2"] is fam


@pytest.mark.parametrize("kw, message", [
    (dict(tp=32), "16 KV heads cannot be split 32 ways"),
    (dict(tp=3), "tp 2, 4, 8 or 16"),
    (dict(tp=8, tokens=7), "outside \\[8, max_model_len"),
    (dict(tp=8, tokens=5000), "outside \\[8, max_model_len"),
    (dict(tp=8, window=4096), "window 4096 outside"),
    (dict(tp=8, window=-1), "window -1 outside"),
    (dict(tp=8, inputs="adversarial"), "inputs must be among"),
])
def test_refusals_before_launch(kw, message):
    case = fam.Attn2Case(**{"tokens": 100, **kw})
    with pytest.raises(ValueError, match=message):
        fam.check_case(case)


def test_rank_identity_expectation_is_what_a_rank_computes():
    """The model of a rank's launch (its heads only) equals its columns of the 16-head launch, at
    every tp: what `expected` asks of the GPU holds for the algorithm."""
    case = fam.Attn2Case(tp=4, tokens=40, max_model_len=128)
    whole_problem = make_problem("random", 40, 128)
    whole = attn2_model(whole_problem, num_splits=2)
    want = fam.expected_from_whole(case, whole)
    for rank in range(case.tp):
        got = attn2_model(for_rank(whole_problem, rank, case.tp), num_splits=2)
        assert checks.compare_bits(got, fam.out_rows(want[rank][fam.OUT]))[0] == 0
        guards = torch.cat([want[rank][fam.OUT][: fam.GUARD_ROWS], want[rank][fam.OUT][-fam.GUARD_ROWS:]])
        assert checks.still_poisoned(guards)


def test_guard_rows_catch_a_store_past_the_launch_rows():
    """The runner's buffer has GUARD_ROWS poisoned rows each side of the 8 the launch gets; a
    value written into either guard (a store with a wrong request index or row stride) fails the
    bitwise check, and the launch's view is the contiguous middle."""
    whole = attn2_model(make_problem("random", 24, 64), num_splits=1)
    want = fam.expected_from_whole(fam.Attn2Case(tp=16, tokens=24, max_model_len=64), whole)[3][fam.OUT]
    assert want.shape[0] == 2 * fam.GUARD_ROWS + 8
    middle = fam.out_rows(want)
    assert middle.is_contiguous() and middle.data_ptr() == want[fam.GUARD_ROWS:].data_ptr()
    for row in (fam.GUARD_ROWS - 1, fam.GUARD_ROWS + 8):  # just before, just after
        got = want.clone()
        got[row, 5] = middle[0, 5]
        mismatches, _, first = checks.compare_bits(got, want)
        assert mismatches == 1 and first is not None


def test_pages_before_the_window_hold_poison_and_are_not_read():
    """With a window, every page wholly before the first key a row sees holds poison (NaN or
    +-3e38) through its table entry; the FP64 reference and the CPU model (the kernel's algorithm)
    stay finite, so a kernel that read such a page would show NaN or a wrong value."""
    from musebench import attn2_layout as lay

    problem = make_problem("random", 3000, 4096, window=512, num_kv_heads=1)
    first_page = lay.visible_keys(3000, 512)[0] // lay.PAGE_TOKENS
    assert first_page >= 100
    for logical in range(first_page):
        page = problem.kv_cache[int(problem.page_table[0, logical])].float()
        assert bool(((~torch.isfinite(page)) | (page.abs() >= 1e38)).all()), logical
    visible = problem.kv_cache[int(problem.page_table[0, first_page])].float()
    assert bool(torch.isfinite(visible).all() & (visible.abs() < 1e38).all())  # the window's first page is real
    _, exact = attn2_reference(problem)
    assert bool(torch.isfinite(exact).all())
    assert bool(torch.isfinite(attn2_model(problem, num_splits=4).float()).all())


def test_a_flipped_bit_fails_rank_identity():
    whole = attn2_model(make_problem("random", 24, 64), num_splits=1)
    want = fam.expected_from_whole(fam.Attn2Case(tp=16, tokens=24, max_model_len=64), whole)[5][fam.OUT]
    got = want.clone()
    checks.flip_one_bit(got, index=17)
    assert checks.compare_bits(got, want)[0] == 1


def test_accuracy_verdict_passes_the_model_and_fails_faults():
    problem = make_problem("random", 40, 128, num_kv_heads=1)
    _, exact = attn2_reference(problem)
    stock = stock_attn2(problem)
    mine = exact.to(torch.bfloat16)  # correctly rounded: as accurate as anything can be
    line, ok = fam.accuracy_verdict(mine, stock, exact)
    assert ok and "attn2 max" in line and "stock max" in line
    worse = (stock.double() * (1 + 2.0**-6)).to(torch.bfloat16)  # every element off by ~2 ULP more
    assert not fam.accuracy_verdict(worse, stock, exact)[1]
    nan = mine.clone()
    nan[3, 5] = float("nan")
    line, ok = fam.accuracy_verdict(nan, stock, exact)
    assert not ok and "non-finite 1" in line
    one_bad = mine.clone()
    one_bad[0, 0] = one_bad[0, 0] * 2 + 1  # the max alone worse
    assert not fam.accuracy_verdict(one_bad, stock, exact)[1]


def test_roofline_bytes():
    case = fam.Attn2Case(tp=8, tokens=131072, max_model_len=131072)
    assert fam.bytes_moved(case) == 131072 * 2 * 128 * 2  # 67 MB: K + V of 2 KV heads
    assert fam.roofline_us(case) == pytest.approx(16.0, rel=0.01)
    windowed = fam.Attn2Case(tp=16, tokens=131072, max_model_len=131072, window=2048)
    assert fam.bytes_moved(windowed) == 129 * 4096  # the window's 2055 keys straddle 129 pages


def test_the_sdpa_baseline_times_the_attention_alone():
    """The stock column times SDPA (flash) and nothing else: no copy of its output."""
    from torch.profiler import profile

    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    keys, values = (torch.randn(1, 2, 100, 64, dtype=torch.bfloat16) for _ in range(2))
    call = fam.sdpa_call(q, keys, values)
    with profile() as trace:
        call()
    names = {event.name for event in trace.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names and "aten::copy_" not in names


def _run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("args, message", [
    (["attn", "--tp", "32"], "16 KV heads cannot be split 32 ways"),
    (["attn", "--tp", "6"], "tp 2, 4, 8 or 16"),
    (["attn", "--lengths", "5"], "outside [8, max_model_len"),
    (["attn", "--window", "4096"], "window 4096 outside"),
    (["attn", "--inputs", "adversarial"], "choose from"),
    (["bench", "attn", "--tp", "32"], "16 KV heads cannot be split 32 ways"),
    (["bench", "attn", "--lengths", "200000"], "outside [8, max_model_len"),
])
def test_cli_refusals_exit_2(args, message):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_cli_without_a_gpu_reports_skipped(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the run would run")
    path = tmp_path / "attn.json"
    result = _run("attn", "--tp", "16", "--lengths", "8", "--window", "0", "--inputs", "random", "--json", str(path))
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert report["skipped"][0]["kernel"] == "attn2" and "GPU" in report["skipped"][0]["reason"]


def test_bench_rows_hold_measured_times_and_carry_the_roofline_apart(gpu_with_dsl, monkeypatch, tmp_path):
    """`bench attn`'s timing columns are what was timed (attn2, SDPA flash); the computed HBM
    roofline is the row's roofline_us, never a 'baseline' beside the measured ones."""
    from musebench.harness import jobs, measure
    from musebench.harness.driver import new_row

    def fake_run_jobs(job_list):
        rows = []
        for job in job_list:
            for case in job.cases:
                row = new_row(case, job.options, "local", 1, "bench")
                row.tail_us, row.stock_us, row.baselines_us = 20.0, 10.0, {fam.VIRTUAL_STOCK: 10.0}
                rows.append(row)
        return rows

    monkeypatch.setattr(jobs, "run_jobs", fake_run_jobs)
    monkeypatch.setattr(measure, "bench_empty_kernel", lambda options: 1.0)
    path = tmp_path / "bench.json"
    result = _run("bench", "attn", "--tp", "8", "--lengths", "512", "--window", "0", "--json", str(path))
    assert result.exit_code == 0, result.output
    (row,) = json.loads(path.read_text())["cases"]
    assert row["baselines_us"] == {fam.VIRTUAL_STOCK: 10.0}
    assert row["roofline_us"] == pytest.approx(fam.roofline_us(fam.Attn2Case(tp=8, tokens=512, max_model_len=131072)))


# (max_model_len, lengths, windows): the split kernel at 4096 with the window; one split (max_model_len
# <= SHORT_MAX_LEN, with a 32-key window too); the small split plans (128: 4 splits, 2 with a 64-key window;
# 256: 8; 2048: 64, with a 100-key window: 4)
GPU_JOB_PLANS = [(4096, (17, 2049), (0, 2048)), (64, (17, 64), (0, 32)), (128, (17, 128), (0, 64)),
                 (256, (129, 256), (0,)), (2048, (17, 2048), (0, 100))]


def _check_gpu_job_plans(plan_splits: dict) -> None:
    """Each job plan's split count at every tp is `plan_splits`' (the `attn2_plan_splits` fixture)."""
    for max_model_len, lengths, windows in GPU_JOB_PLANS:
        for window in windows:
            got = {lay.splits(max_model_len, window, heads) for heads in (1, 2, 4, 8)}
            assert got == {plan_splits[max_model_len, window]}, (max_model_len, window)
            fam.check_case(fam.Attn2Case(tp=16, tokens=min(lengths), max_model_len=max_model_len, window=window))
    assert max(n for n, _, _ in GPU_JOB_PLANS if plan_splits[n, 0] == 1) == lay.SHORT_MAX_LEN


def test_gpu_job_plans_are_the_plans_named(attn2_plan_splits):
    """The GPU job test below runs the plan kinds it names (computed here, on the CPU, where it
    runs): one split at 64 (SHORT_MAX_LEN), window or not; split plans from 128 on, at every tp."""
    _check_gpu_job_plans(attn2_plan_splits)


def test_gpu_job_plans_check_can_fail(monkeypatch, attn2_plan_splits):
    """Fault injection: the old threshold (128) puts max_model_len 128 back on one split, and the
    check above refuses it."""
    monkeypatch.setattr(lay, "SHORT_MAX_LEN", 128)
    with pytest.raises(AssertionError, match="128, 0"):
        _check_gpu_job_plans(attn2_plan_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("max_model_len, lengths, windows", GPU_JOB_PLANS)
@pytest.mark.parametrize("inject", [None, "flip:1"])
def test_job_on_the_gpu_passes_and_a_flipped_bit_fails(inject, max_model_len, lengths, windows):
    """The whole family through the one driver at tp 16 (1 KV head a rank) on each plan kind (one
    split, the small split plans, the split kernel and the window); a flipped bit of rank 1's
    output must fail its row."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from musebench.harness.case import Faults
    from musebench.harness.jobs import make_attn2_job, run_job

    # the plan kind this case is for (without a window): one split at 64, 4 at 128, 8 at 256, 64 at 2048, 128 at 4096
    assert lay.splits(max_model_len, 0, 1) == {64: 1, 128: 4, 256: 8, 2048: 64, 4096: 128}[max_model_len]
    faults = Faults.parse([inject]) if inject else Faults()
    job = make_attn2_job(name="attn2 gpu test", tp=16, lengths=lengths, max_model_len=max_model_len, windows=windows,
                         inputs=("random",), seeds=(0,), faults=faults)
    rows = run_job(job)
    for row in rows:
        print(f"\n{row.tokens} {row.norm}: passed={row.passed} error={row.error} {row.stock_path}")
    assert len(rows) == len(lengths) * len(windows)
    if inject:
        assert not any(row.passed for row in rows)
    else:
        assert all(row.passed for row in rows), [row.error for row in rows]
