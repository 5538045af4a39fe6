"""Shared fixtures. GPU tests carry @pytest.mark.gpu and skip where torch sees no CUDA device."""

from __future__ import annotations

import os
import uuid

import pytest

from tests._processes import job_mailboxes, job_processes


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_configure(config):
    """Under xdist, each worker's torch gets its share of the cores: 16 workers each running 16
    intra-op threads starve the CPU, and the GPU tests' host work (inputs, launches) with it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def job_id(monkeypatch):
    """A fresh launcher job id for this test; after it, no process or mailbox of the job may remain."""
    job = "t" + uuid.uuid4().hex[:11]
    monkeypatch.setenv("MUSEBENCH_JOB_ID", job)
    yield job
    assert_no_strays(job)


def assert_no_strays(job: str) -> None:
    strays = job_processes(job)
    assert not strays, f"stray processes of job {job}: {strays}"
    leftovers = job_mailboxes(job)
    assert not leftovers, f"stray mailboxes of job {job}: {leftovers}"


# What the routing jobs see of the machine (`harness.jobs`): no GPU, a GPU without CuTe DSL, or a
# GPU that can run the routing kernel (runner rows then come from the test).
@pytest.fixture
def no_gpu(monkeypatch):
    from musebench.harness import jobs

    monkeypatch.setattr(jobs, "_gpu_name", lambda: None)


@pytest.fixture
def gpu_without_dsl(monkeypatch):
    from musebench.harness import jobs

    monkeypatch.setattr(jobs, "_gpu_name", lambda: "Fake H200")
    monkeypatch.setattr(jobs, "_dsl_imports", lambda: False)


@pytest.fixture
def gpu_with_dsl(monkeypatch):
    from musebench.harness import jobs

    monkeypatch.setattr(jobs, "_gpu_name", lambda: "Fake H200")
    monkeypatch.setattr(jobs, "_dsl_imports", lambda: True)


@pytest.fixture
def emulated_read_floor(monkeypatch):
    """`stock.read_floor.triton_read` replaced by `tests._read_floor.emulated_triton_read` (the
    reader's partials in torch: the families' `read floor` paths build and check on CPU); returns
    the list of the words every read read (in order), for the test to inspect or clear."""
    from musebench.stock import read_floor
    from tests._read_floor import emulated_triton_read

    reads: list = []
    monkeypatch.setattr(read_floor, "triton_read", lambda w, p, c: emulated_triton_read(w, p, c, reads))
    return reads


@pytest.fixture
def attn2_plan_splits() -> dict:
    """The split count each (max_model_len, window) of the attn2 GPU tests' cases runs at every tp,
    written out (not computed) so the CPU checks of those cases' plans
    (tests/test_attn2_layout.py, tests/cases/test_attn2.py) hold `attn2_layout.splits` to it."""
    return {(64, 0): 1, (64, 32): 1, (128, 0): 4, (128, 64): 2, (256, 0): 8, (2048, 0): 64, (2048, 100): 4,
            (4096, 0): 128, (4096, 2048): 64}
