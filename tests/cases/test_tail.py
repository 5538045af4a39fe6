"""What the tail families share (`cases.tail`), on CPU with fakes: the bench baselines a process
bench times (which paths, in which order of collectives, with which outputs), the one-shot
all-reduce's mailbox, and the one-shot check that fails a row whose all-reduce computes garbage."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from musebench.cases import ep_tail, tail, tp_tail
from musebench.cases.tail_inputs import EDGE_PADDING_ROWS, TailCase, make_tail_inputs
from musebench.harness.case import MailboxSpec, RunOptions
from musebench.harness.driver import _BaselineComms, mailbox_specs
from musebench.stock.all_reduce import rank_order_sum
from tests._processes import spawned_ranks

EP, TP = TailCase(mode="ep", tp=2, tokens=3), TailCase(mode="tp", tp=2, tokens=3)


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo group of this process alone (world size 1): the check's gather runs for real."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FakeAllReduce:
    """Stands in for `OneShotAllReduce` (no GPU here): with one rank, the right result is the
    rank-order sum of its own input; `garbage` makes it write something else."""

    made: list = []

    def __init__(self, box, garbage: bool = False, fault: str | None = None) -> None:
        self.box, self.garbage, self.fault, self.calls = box, garbage, fault, 0

    @classmethod
    def from_mailbox(cls, box, **knobs):
        made = cls(box, **FakeAllReduce.behaviour)
        made.knobs = knobs
        FakeAllReduce.made.append(made)
        return made

    def run(self, source: torch.Tensor, out: torch.Tensor) -> None:
        self.calls += 1
        out.copy_(torch.zeros_like(source) if self.garbage else rank_order_sum([source]))

    def check_fault(self) -> None:
        if self.fault is not None:
            raise RuntimeError(self.fault)


@dataclass
class FakeCollectives:
    group: object = "nccl-group"

    def symmetric_buffer(self, shape, device):
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)


@pytest.fixture
def fakes(monkeypatch):
    import musebench.kernels.oneshot_allreduce as oneshot
    import musebench.stock.triton_finalize as triton_finalize

    FakeAllReduce.made, FakeAllReduce.behaviour = [], {}
    monkeypatch.setattr(oneshot, "OneShotAllReduce", FakeAllReduce)

    def finalize(rows, norm_weight, out, **knobs):  # a deterministic stand-in for the Triton kernel
        out.copy_(rows.gemm2_permuted[: out.shape[0], : out.shape[1]])

    monkeypatch.setattr(triton_finalize, "triton_finalize", finalize)
    return FakeAllReduce


def _baselines(case: TailCase, comms):
    inputs = make_tail_inputs(case)
    runner = tail.runner(case, None, inputs, 0, RunOptions(backend="cpu"))
    family = ep_tail if case.mode == "ep" else tp_tail
    return family.baselines(case, inputs, 0, runner, comms)


def _comms(collectives=None, box="the one-shot mailbox"):
    return _BaselineComms(collectives, {tail.ONE_SHOT_MAILBOX: box} if box is not None else {}, 123)


def test_the_one_shot_mailbox_holds_the_tp_tails_k_partials():
    for case in (EP, TP):
        spec = tail.baseline_mailboxes(case, 8)[tail.ONE_SHOT_MAILBOX]
        assert spec == MailboxSpec(slots=2, rows=8 * case.top_k + EDGE_PADDING_ROWS, width=4096)


def test_a_process_bench_allocates_it_beside_the_cases_mailboxes_and_a_check_does_not():
    cases = [EP, TP]
    assert tail.ONE_SHOT_MAILBOX not in mailbox_specs(cases, 8)
    specs = mailbox_specs(cases, 8, bench=True)
    assert set(specs) == {"ep", "tp_route", "tp_token", tail.ONE_SHOT_MAILBOX}  # EP and TP share one shape


def test_virtual_ranks_time_the_finalize_alone(fakes):
    assert list(_baselines(EP, None)) == ["finalize"]


def test_processes_sharing_a_gpu_time_the_one_shot_and_not_nccl(fakes):
    ep = _baselines(EP, _comms())
    assert list(ep) == ["finalize", "finalize+one-shot(own)"]
    tp = _baselines(TP, _comms())
    assert list(tp) == ["finalize", "one-shot(own)+finalize"]
    for path in (ep["finalize+one-shot(own)"], tp["one-shot(own)+finalize"]):
        assert path.collective and path.check is not None and path.outputs
        assert "own implementation of the published algorithm" in path.note
    assert [made.box for made in fakes.made] == ["the one-shot mailbox"] * 2
    assert all(made.knobs == {"timeout_ns": 123} for made in fakes.made)  # the bench's bound on its waits


def test_one_process_per_gpu_adds_nccl_and_symmetric_memory(fakes):
    assert list(_baselines(EP, _comms(FakeCollectives()))) == [
        "finalize", "finalize+one-shot(own)", "finalize+nccl", "finalize+symm_mem"]
    assert list(_baselines(TP, _comms(FakeCollectives()))) == [
        "finalize", "one-shot(own)+finalize", "nccl+finalize", "symm_mem+finalize"]
    assert list(_baselines(EP, _comms(FakeCollectives(), box=None))) == ["finalize", "finalize+nccl", "finalize+symm_mem"]


def test_the_comms_of_processes_sharing_a_gpu_have_no_group():
    assert _comms().group is None and _comms(FakeCollectives()).group == "nccl-group"


@pytest.mark.parametrize("case", [EP, TP], ids=["ep", "tp"])
def test_a_correct_one_shot_passes_its_check(case, fakes, one_process_group):
    name, path = next((name, path) for name, path in _baselines(case, _comms()).items() if "one-shot" in name)
    path.call()
    assert fakes.made[0].calls == 1
    assert path.check() is None


@pytest.mark.parametrize("case", [EP, TP], ids=["ep", "tp"])
def test_a_one_shot_that_computes_garbage_fails_its_check(case, fakes, one_process_group):
    fakes.behaviour = {"garbage": True}
    path = next(path for name, path in _baselines(case, _comms()).items() if "one-shot" in name)
    path.call()
    problem = path.check()
    assert problem is not None and "differ from the rank-order sum" in problem


def test_a_one_shot_fault_record_fails_its_check(fakes, one_process_group):
    fakes.behaviour = {"fault": "one-shot all-reduce: rank 0 timed out waiting for rank 1 (mailbox slot 1, row 0, generation 2)"}
    path = _baselines(EP, _comms())["finalize+one-shot(own)"]
    path.call()
    assert "rank 0 timed out waiting for rank 1" in path.check()


def test_the_tp_one_shot_reduces_the_4096_columns_the_finalize_reads(fakes, one_process_group):
    """Edge rows are wider than 4096 (garbage beyond) and end in padding rows: the one-shot takes
    the first 4096 columns of every row, which its mailbox holds."""
    case = TailCase(mode="tp", tp=2, tokens=8, inputs="edge")
    path = _baselines(case, _comms())["one-shot(own)+finalize"]
    rows = path.outputs[tail.OUT]
    assert rows.shape[1] == 4096 and rows.shape[0] <= tail.baseline_mailboxes(case, 8)[tail.ONE_SHOT_MAILBOX].rows
    path.call()
    assert path.check() is None


def test_the_one_shot_check_gathers_over_the_comms_case_group(fakes, monkeypatch):
    """A job of several case groups: the one-shot's check gathers over the rank's case group (the
    comms' host_group), not the job (whose rank-order sum adds every group's inputs)."""
    seen = []
    real = tail.one_shot_check
    monkeypatch.setattr(tail, "one_shot_check", lambda *args: seen.append(args[3:]) or real(*args))
    comms = _BaselineComms(None, {tail.ONE_SHOT_MAILBOX: "box"}, 123, host_group="group 1's gloo group")
    _baselines(EP, comms)
    _baselines(TP, comms)
    assert seen == [("group 1's gloo group",)] * 2


def _rank_checking_its_group(rank: int, port: int, answers) -> None:
    """Rank `rank` of 4 (spawned), groups {0, 1} and {2, 3}: its all-reduce summed its own group."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    first = rank // 2 * 2
    inputs = [torch.full((8,), float(r + 1), dtype=torch.bfloat16) for r in range(4)]
    out = rank_order_sum(inputs[first:first + 2])
    answers.put((rank, tail.one_shot_check(FakeAllReduce(None), inputs[rank], out, group)(),
                 tail.one_shot_check(FakeAllReduce(None), inputs[rank], out)()))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_groups_one_shot_passes_its_check_where_the_jobs_sum_would_fail_it():
    answers = spawned_ranks(_rank_checking_its_group, 4, lambda rank, port, answers: (rank, port, answers))
    got = {rank: (grouped, whole) for rank, grouped, whole in answers}
    assert all(grouped is None for grouped, _ in got.values()), got
    assert all("differ from the rank-order sum" in whole for _, whole in got.values()), got
