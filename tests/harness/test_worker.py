"""The worker's exit status: a collective's failure is a consequence (COLLECTIVE_FAILED_EXIT), any
other error the rank's own (RANK_FAILED_EXIT), so the launchers name the rank that caused it."""

from __future__ import annotations

import pytest


def _raised_in(filename: str, error: BaseException) -> BaseException:
    namespace: dict = {}
    exec(compile("def collective(error):\n    raise error\n", filename, "exec"), namespace)
    try:
        namespace["collective"](error)
    except BaseException as caught:
        return caught
    raise AssertionError("nothing raised")


def test_a_collectives_failure_is_a_consequence_and_a_local_error_is_not():
    import torch.distributed as dist

    from musebench.harness.worker import collective_failed

    c10d = "/site-packages/torch/distributed/distributed_c10d.py"
    assert collective_failed(_raised_in(c10d, RuntimeError("[gloo] Connection reset by peer")))
    assert collective_failed(_raised_in("/x/musebench/harness/driver.py", dist.DistBackendError("nccl")))
    # a rank's own errors (they once exited 3 too, and the launchers waited for a cause elsewhere)
    assert not collective_failed(_raised_in("/x/musebench/harness/driver.py", RuntimeError("CUDA out of memory")))
    assert not collective_failed(_raised_in(c10d, ValueError("bad group")))
    assert not collective_failed(_raised_in("/x/musebench/harness/driver.py", ValueError("two shapes")))


@pytest.mark.parametrize("error, code", [(ValueError("mailbox 'x' is asked for with two shapes"), 1),
                                         ("collective", 3)])
def test_the_worker_exits_with_the_code_its_error_calls_for(monkeypatch, tmp_path, error, code):
    import json

    from musebench.harness import driver, worker
    from musebench.harness.case import RunOptions
    from musebench.harness.launch import spec_to_json
    from musebench.cases.tail_inputs import TailCase
    from musebench.harness.nodes import COLLECTIVE_FAILED_EXIT

    if error == "collective":
        error = _raised_in("/site-packages/torch/distributed/distributed_c10d.py", RuntimeError("Connection closed"))

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(driver, "run_rank", fail)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_to_json([TailCase(mode="ep", tp=2, tokens=1)], RunOptions(launcher="torchrun"))))
    monkeypatch.setattr("musebench.harness.nodes.die_with_parent", lambda sig=None: None)
    assert worker.main([str(spec), str(tmp_path / "rows.jsonl")]) == code
    assert COLLECTIVE_FAILED_EXIT == 3
