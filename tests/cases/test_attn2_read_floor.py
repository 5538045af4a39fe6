"""attn2's `read floor` bench column (cases/attn2.py `baselines`): on CPU, a plain read of
bytes_moved(case) bytes from one buffer every call beside SDPA, its ratio the kernel's over it,
its sum checked before timing (a reader that skipped 16 bytes fails the case); on a GPU a bench
attn row carries it with a positive time (its buffer on the KV cache's device) and a short read
fails the row. (Apart from
tests/cases/test_attn2.py, which covers the rest of the family.)"""

from __future__ import annotations

import pytest

from musebench.cases import attn2 as fam
from musebench.cases.attn2_inputs import for_rank


def _paths(case):
    """The case's baselines on CPU over rank 0's share of its inputs (no kernel: the runner holds
    the problem only)."""
    problem = for_rank(fam.make_inputs(case), 0, case.tp)
    runner = fam.Attn2Runner(ops=None, problem=problem, workspace=None, outputs={})
    return fam.baselines(case, None, 0, runner, None)


@pytest.mark.parametrize("tp, tokens, window", [(16, 40, 0), (8, 200, 0), (16, 300, 64)])
def test_the_read_floor_reads_the_kernels_bytes_from_one_buffer_every_call(emulated_read_floor, tp, tokens, window):
    case = fam.Attn2Case(tp=tp, tokens=tokens, max_model_len=512, window=window)
    paths = _paths(case)
    assert list(paths) == [fam.VIRTUAL_STOCK, fam.READ_FLOOR]
    floor = paths[fam.READ_FLOOR].call
    assert len(floor.buffers) == 1 and floor.buffers[0].numel() * 4 == fam.bytes_moved(case)
    assert [w.data_ptr() for w in emulated_read_floor] == [floor.buffers[0].data_ptr()]  # checked once
    emulated_read_floor.clear()
    for _ in range(3):
        floor()
    assert [w.data_ptr() for w in emulated_read_floor] == [floor.buffers[0].data_ptr()] * 3
    assert not hasattr(fam, "BASELINE_RATIO_OF")  # its ratio: the kernel over it, as SDPA's


def test_a_read_floor_that_skips_bytes_fails_the_case_before_timing(monkeypatch):
    """Fault injection: the reader over each buffer less its last 16 bytes makes `baselines`
    raise (the case's error, naming the read floor and the case)."""
    from musebench.stock import read_floor
    from tests._read_floor import emulated_triton_read

    monkeypatch.setattr(read_floor, "triton_read", lambda w, p, c: emulated_triton_read(w[:-4], p, c))
    case = fam.Attn2Case(tp=16, tokens=40, max_model_len=512)
    with pytest.raises(RuntimeError, match=r"^read floor of attn2 tp=16 L=40 .* did not read every byte once"):
        _paths(case)


def _bench_job(**kw):
    from musebench.harness.jobs import make_attn2_job
    from musebench.harness.measure import BenchOptions

    return make_attn2_job(name="attn2 floor", tp=16, lengths=(2048,), max_model_len=4096, windows=(0,),
                          inputs=("random",), seeds=(0,), measurement="bench", bench=BenchOptions(calls=5, replays=3),
                          enforce_accuracy=False, **kw)


@pytest.mark.gpu
def test_bench_attn_times_the_read_floor_beside_the_kernel(monkeypatch):
    """On a GPU: a bench attn row passes and carries `read floor` with a positive time, its ratio
    the kernel's µs over it; the floor's buffer lies on the KV cache's device."""
    from musebench.harness.jobs import run_job

    pytest.importorskip("triton")
    real, seen = fam.baselines, []

    def spied(case, inputs, rank, runner, comms):
        paths = real(case, inputs, rank, runner, comms)
        seen.append((paths[fam.READ_FLOOR].call, runner.problem.kv_cache.device))
        return paths

    monkeypatch.setattr(fam, "baselines", spied)
    (row,) = run_job(_bench_job())
    assert row.passed, row.error
    assert seen and all(floor.buffers[0].device == device and device.type == "cuda" for floor, device in seen)
    assert row.baselines_us[fam.READ_FLOOR] > 0
    assert row.baseline_ratios[fam.READ_FLOOR] == pytest.approx(row.tail_us / row.baselines_us[fam.READ_FLOOR])


@pytest.mark.gpu
def test_bench_attn_refuses_a_read_floor_with_a_wrong_sum(monkeypatch):
    """On a GPU: the compiled reader made to read 16 bytes short fails the row, naming the read
    floor, and no floor time is reported."""
    from musebench.harness.jobs import run_job
    from musebench.stock import read_floor

    pytest.importorskip("triton")
    real = read_floor.triton_read
    monkeypatch.setattr(read_floor, "triton_read", lambda w, p, c: real(w[:-4], p, c))
    (row,) = run_job(_bench_job())
    assert not row.passed and "read floor" in row.error and "did not read every byte" in row.error
    assert fam.READ_FLOOR not in row.baselines_us
