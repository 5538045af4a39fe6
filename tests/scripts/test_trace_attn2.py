"""scripts/trace-attn2.py on the CPU: its summary of traced rows (phases, spans, the gap to the
combine, the overlap with the previous launch, the SMs by their split CTAs) on hand-made rows whose
numbers are known, and its option refusals (exit 2 before any GPU work)."""

from __future__ import annotations

import pytest

from tests.scripts.conftest import run_script, script_module


@pytest.fixture(scope="module")
def trace():
    """The script as a module (`conftest.script_module`)."""
    with script_module("trace-attn2.py", "trace_attn2") as module:
        yield module


def split_row(sm: int, entry: int, chain_start: int, chain_end: int, end: int) -> dict:
    """A split CTA's row at 1 cycle a ns: entered at `entry` (ns), waited 100 ns, its chain from
    `chain_start` to `chain_end`, its partial written by `end`."""
    return dict(smid=sm, globaltimer_entry=entry, globaltimer_end=end, clock_entry=0, clock_waited=100,
                clock_prologue=chain_start - entry, clock_chained=chain_end - entry, clock_written=end - entry)


def combine_row(sm: int, entry: int, waited: int, end: int) -> dict:
    return dict(smid=sm, globaltimer_entry=entry, globaltimer_end=end, clock_entry=0, clock_waited=waited - entry,
                clock_loaded=waited - entry + 100, clock_merged=waited - entry + 200, clock_end=end - entry)


def launch(offset: int) -> dict:
    """SM 0 holds two split CTAs (4 pages each), SM 1 one (2 pages); one combine CTA."""
    split = [split_row(0, offset + 0, offset + 1000, offset + 5000, offset + 5100),
             split_row(0, offset + 0, offset + 1200, offset + 6000, offset + 6100),
             split_row(1, offset + 0, offset + 1000, offset + 3000, offset + 3100)]
    combine = [combine_row(2, offset + 5500, offset + 6600, offset + 7000)]
    return dict(split=split, combine=combine, split_pages=[4, 4, 2])


def test_sms_by_their_load(trace):
    got = trace.sm_loads(launch(0)["split"], [4, 4, 2], 1.0)
    assert got == {"1": dict(sms=1, last_chain_end_ns=dict(median_ns=3000, max_ns=3000), pages_per_us_median=1.0),
                   "2": dict(sms=1, last_chain_end_ns=dict(median_ns=6000, max_ns=6000), pages_per_us_median=1.6)}


def test_the_summary_of_two_launches(trace):
    table = trace.summarize([launch(0), launch(8000)])
    assert table["cycles_per_ns"]["split"] == pytest.approx(1.0) and table["cycles_per_ns"]["combine"] == pytest.approx(1.0)
    assert table["split"]["chain"] == dict(median_ns=4000, max_ns=4800)
    assert table["split"]["ctas_by_ctas_on_the_sm"] == {"1": 1, "2": 2}
    assert table["split"]["sms_by_ctas_on_the_sm"]["2"]["pages_per_us_median"] == 1.6
    assert table["split_span_ns"] == dict(median=6100, max=6100)
    assert table["launch_span_ns"] == dict(median=7000, max=7000)
    assert table["gap_split_end_to_combine_waited_ns"] == dict(median=500, max=500)
    assert table["launch_period_ns"] == dict(median=8000, max=8000)
    assert table["overlap_with_previous_ns"] == dict(median=-1000, max=-1000)  # 1 us idle between the launches
    text = trace.render(8, 131072, dict(table, tp=8, seq_len=131072))
    assert "2 an SM: 1 SMs, last chain end 6.00 (max 6.00) µs, 1.6 pages/µs" in text


@pytest.mark.parametrize("args, reason", [
    (["--tp", "3"], "--tp"), (["--lengths", "4"], "--lengths"), (["--calls", "2"], "--calls"),
    (["--rows", "/nonexistent/rows.json"], "--rows"), (["--json", "/nonexistent/t.json"], "--json"),
])
def test_bad_options_exit_2_with_the_reason(args, reason):
    done = run_script("trace-attn2.py", args, timeout=300)
    assert done.returncode == 2 and reason in done.stderr
