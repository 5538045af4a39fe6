"""The environment probe: runs without a GPU, honours the multicast switches, maps layouts to transports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from musebench.harness import environment
from musebench.harness.environment import (
    _parse_nvlink_status,
    backends,
    multicast_policy,
    multicast_status,
    probe,
    render_probe,
    transports,
)

MULTICAST_VARIABLES = ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS")


@pytest.fixture
def multicast_env_clear(monkeypatch):
    for name in MULTICAST_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def fake_gpu(index: int, sm: int = 90) -> dict:
    return {
        "index": index,
        "name": "NVIDIA H200",
        "capability": f"{sm // 10}.{sm % 10}",
        "sm": sm,
        "sm_count": 132,
        "memory_bytes": 143771 * 2**20,
        "uuid": f"00000000-0000-0000-0000-{index:012x}",
    }


def fake_info(gpu_count: int, *, p2p: bool = True, multicast_usable: bool = False, sm: int = 90) -> dict:
    return {
        "torch": {"symmetric_memory": True},
        "cutlass_dsl": {"version": "4.8.1", "importable": True, "error": None},
        "gpus": [fake_gpu(i, sm) for i in range(gpu_count)],
        "p2p": [[None if i == j else p2p for j in range(gpu_count)] for i in range(gpu_count)],
        "multicast": {"usable": multicast_usable, "note": "" if multicast_usable else "forbidden"},
    }


def test_probe_without_gpu_is_json_and_renders(multicast_env_clear):
    info = probe()
    assert json.loads(json.dumps(info)) == info
    assert info["torch"]["version"]
    assert info["cutlass_dsl"]["importable"] in (True, False)
    if not info["gpus"]:
        assert info["p2p"] == []
        assert info["transports"]["virtual"]["transports"] == ["cpu-local"]
        assert info["transports"]["shared_gpu"]["transports"] == ["shm"]
        assert info["transports"]["distinct_gpus"]["transports"] == []
        assert info["backends"]["cute"]["available"] is False
        assert info["multicast"]["supported"] is None
    assert info["backends"]["cpu"]["available"] is True

    console = Console(record=True, width=200)
    render_probe(info, console)
    text = console.export_text()
    assert "mailbox transports by launch layout" in text
    assert "backends" in text


def test_probe_reports_multicast_forbidden(monkeypatch, multicast_env_clear):
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    info = probe(try_cutlass_import=False, query_nvidia_smi=False)
    assert info["multicast"]["allowed"] is False
    assert info["multicast"]["usable"] is False
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in info["multicast"]["forbidden_by"]
    assert "multicast" not in info["transports"]["distinct_gpus"]["transports"]


@pytest.mark.parametrize(
    ("environ", "allowed"),
    [
        ({}, True),
        ({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}, False),
        ({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}, True),
        ({"NCCL_NVLS_ENABLE": "0"}, False),
        ({"NCCL_NVLS_ENABLE": "1"}, True),
        ({"NVSHMEM_DISABLE_NVLS": "1"}, False),
        ({"NVSHMEM_DISABLE_NVLS": "true"}, False),
    ],
)
def test_multicast_policy(environ, allowed):
    assert multicast_policy(environ)["allowed"] is allowed


def test_multicast_support_is_not_queried_when_forbidden():
    def must_not_query(device_count):
        raise AssertionError("queried the driver although multicast is forbidden")

    status = multicast_status(8, environ={"NCCL_NVLS_ENABLE": "0"}, query=must_not_query)
    assert status["allowed"] is False and status["supported"] is None and status["usable"] is False


def test_multicast_support_query_when_allowed():
    status = multicast_status(4, environ={}, query=lambda count: [True] * count)
    assert status["usable"] is True
    status = multicast_status(4, environ={}, query=lambda count: [True, False, True, True])
    assert status["supported"] is False and status["usable"] is False

    def broken(count):
        raise RuntimeError("no driver")

    status = multicast_status(4, environ={}, query=broken)
    assert status["supported"] is None and "no driver" in status["note"]


def test_transports_by_layout():
    single = transports(fake_info(1))
    assert single["virtual"]["transports"] == ["local"]
    assert single["shared_gpu"]["transports"] == ["ipc"]
    assert single["distinct_gpus"]["transports"] == []

    assert transports(fake_info(8))["distinct_gpus"]["transports"] == ["unicast", "ipc"]
    # multicast where usable; where not, the note gives the machine's reason
    fabric = transports(fake_info(8, multicast_usable=True))["distinct_gpus"]
    assert fabric["transports"] == ["unicast", "ipc", "multicast"]
    forbidden = transports(fake_info(8))["distinct_gpus"]
    assert forbidden["transports"] == ["unicast", "ipc"] and "multicast: forbidden" in forbidden["note"]
    no_peer = transports(fake_info(2, p2p=False, multicast_usable=True))["distinct_gpus"]
    assert no_peer["transports"] == [] and "peer access" in no_peer["note"]

    assert single["shared_gpus"]["transports"] == [] and "two CUDA GPUs" in single["shared_gpus"]["note"]
    assert transports(fake_info(2))["shared_gpus"]["transports"] == ["ipc"]
    spread_without_peers = transports(fake_info(2, p2p=False))["shared_gpus"]
    assert spread_without_peers["transports"] == [] and "peer access" in spread_without_peers["note"]


def test_backends_need_hopper_and_cutlass():
    assert backends(fake_info(1))["cute"]["available"] is True
    assert backends(fake_info(1, sm=80))["cute"]["available"] is False
    info = fake_info(1)
    info["cutlass_dsl"] = {"version": "4.8.1", "importable": False, "error": "ImportError: boom"}
    assert "boom" in backends(info)["cute"]["reason"]
    assert backends(fake_info(0))["cute"]["available"] is False


def test_render_probe_with_gpus():
    info = fake_info(2, multicast_usable=True)
    info["multicast"].update(allowed=True, forbidden_by=[], supported=True)
    info["fabric"] = {"source": "nvidia-smi", "active_nvlinks": [18, 18], "note": ""}
    info["transports"] = transports(info)
    info["backends"] = backends(info)
    console = Console(record=True, width=200)
    render_probe(info, console)
    text = console.export_text()
    assert "NVIDIA H200" in text and "P2P access" in text and "unicast, ipc" in text


def test_parse_nvlink_status():
    text = (
        "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)\n"
        "\t Link 0: 26.562 GB/s\n"
        "\t Link 1: <inactive>\n"
        "\t Link 2: 26.562 GB/s\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000001)\n"
        "\t Link 0: <inactive>\n"
    )
    assert _parse_nvlink_status(text) == {
        "00000000-0000-0000-0000-000000000000": 2,
        "00000000-0000-0000-0000-000000000001": 0,
    }


def test_fabric_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(environment.shutil, "which", lambda name: None)
    result = environment.fabric([fake_gpu(0)])
    assert result["active_nvlinks"] is None and "not found" in result["note"]


def test_environment_module_does_not_import_torch():
    code = "import sys, musebench.harness.environment; print('torch' in sys.modules, 'cutlass' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert result.stdout.strip() == "False False"


def test_fabric_counts_zero_when_nvidia_smi_lists_no_nvlink(monkeypatch):
    class Completed:
        returncode, stdout, stderr = 0, "", ""

    monkeypatch.setattr(environment.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(environment.subprocess, "run", lambda *args, **kwargs: Completed())
    result = environment.fabric([fake_gpu(0), fake_gpu(1)])
    result.pop("handles")
    assert result == {"source": "nvidia-smi", "active_nvlinks": [0, 0], "note": "nvidia-smi lists no NVLink"}


def test_fabric_handles_say_whether_mailboxes_can_span_hosts():
    asked: list[str] = []
    rack = environment.fabric_handles(4, query=lambda count, attribute: asked.append(attribute) or [True] * count)
    assert rack["usable"] is True and asked == ["CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"]
    node = environment.fabric_handles(2, query=lambda count, attribute: [True, False])
    assert node["usable"] is False and node["note"].endswith("is 0 on GPU 1: mailboxes cannot span hosts")

    def no_driver(count, attribute):
        raise RuntimeError("CUDA driver call failed: CUDA_ERROR_NO_DEVICE")

    unknown = environment.fabric_handles(2, query=no_driver)
    assert unknown["per_gpu"] is None and "CUDA_ERROR_NO_DEVICE" in unknown["note"]
    assert environment.fabric_handles(0)["note"] == "no CUDA GPU"
