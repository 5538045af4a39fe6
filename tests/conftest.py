"""Shared fixtures. GPU tests carry @pytest.mark.gpu and skip where torch sees no CUDA device."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


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
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    strays = [line.strip() for line in out.splitlines() if f"musebench-{job}" in line]
    assert not strays, f"stray processes of job {job}: {strays}"
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith(f"musebench-{job}-")]
    assert not leftovers, f"stray mailboxes of job {job}: {leftovers}"
