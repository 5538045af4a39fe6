"""The CLI on a GPU: the default backend is cute for both tails, and every row is ✓."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from musebench.cli import main

pytestmark = pytest.mark.gpu


def test_tail_defaults_to_the_cute_kernels_on_a_gpu(tmp_path):
    out = tmp_path / "tail.json"
    result = CliRunner().invoke(main, ["tail", "--tp", "4", "--tokens", "1,8", "--weights", "bf16", "--norm", "after",
                                       "--iters", "1", "--warmup", "0", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {case["backend"] for case in data["cases"]} == {"cute"}
    assert {case["kernel"] for case in data["cases"]} == {"ep_tail", "tp_tail"}


def test_bench_tail_rows_carry_their_correctness(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", "tail", "--tp", "2", "--tokens", "1", "--calls", "5", "--replays", "5",
                                       "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    cases = json.loads(out.read_text())["cases"]
    assert all(case["passed"] and case["tail_us"] > 0 for case in cases)
    # EP rows time the publisher alone too; the tail timed after it (mailboxes re-armed) still passes
    ep = [case for case in cases if case["mode"] == "ep"]
    assert ep and all(case["kernels_us"]["publisher"] > 0 and case["kernels_us"]["single launch"] > 0 for case in ep)


def test_routing_with_an_injected_flip_exits_1_naming_the_rank(tmp_path):
    out = tmp_path / "routing.json"
    result = CliRunner().invoke(main, ["routing", "--tp", "2", "--tokens", "2", "--inputs", "random",
                                       "--inject", "flip:1", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    cases = json.loads(out.read_text())["cases"]
    assert cases and all(not case["passed"] and case["first_mismatch"]["rank"] == 1 for case in cases)


@pytest.mark.parametrize("launcher", ["virtual", "torchrun"])
def test_an_implementation_that_reexports_musebench_passes(tmp_path, launcher):
    out = tmp_path / "impl.json"
    result = CliRunner().invoke(main, ["tail", "--tp", "2", "--tokens", "1,8", "--weights", "bf16", "--norm", "before",
                                       "--iters", "1", "--warmup", "0", "--launcher", launcher,
                                       "--impl", "tests.impls.reexport", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert all(case["passed"] for case in json.loads(out.read_text())["cases"])


def test_an_implementation_wrong_on_one_rank_fails_naming_it(tmp_path):
    out = tmp_path / "impl.json"
    result = CliRunner().invoke(main, ["tail", "--tp", "2", "--tokens", "2", "--weights", "bf16", "--norm", "before",
                                       "--iters", "1", "--warmup", "0", "--impl", "tests.impls.flip_rank1",
                                       "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    cases = json.loads(out.read_text())["cases"]
    assert cases and all(not case["passed"] and case["first_mismatch"]["rank"] == 1 for case in cases)
    assert "first at rank 1" in result.output
