"""Device mailbox helpers that need no GPU: the peer mapping choice and the peer-access grant."""

from __future__ import annotations

import types

import pytest
import torch

from musebench.comm import device


def test_one_process_per_gpu_maps_peers_through_symmetric_memory(monkeypatch):
    monkeypatch.delenv("MUSEBENCH_PEER_MAPPING", raising=False)
    assert device.peer_mapping(local_world=2, gpus=2) == "symmetric"
    assert device.peer_mapping(local_world=4, gpus=2) == "ipc"  # two processes per GPU
    assert device.peer_mapping(local_world=4, gpus=1) == "ipc"


def test_the_mapping_can_be_forced_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("MUSEBENCH_PEER_MAPPING", "ipc")
    assert device.peer_mapping(local_world=2, gpus=2) == "ipc"
    monkeypatch.setenv("MUSEBENCH_PEER_MAPPING", "multicast")
    with pytest.raises(ValueError, match="MUSEBENCH_PEER_MAPPING"):
        device.peer_mapping(local_world=2, gpus=2)


class _Runtime:
    """A stand-in for cuda.bindings.runtime that records the calls."""

    def __init__(self, enable_error: str) -> None:
        self.cudaError_t = types.SimpleNamespace(cudaSuccess="ok", cudaErrorPeerAccessAlreadyEnabled="already")
        self.calls: list[tuple] = []
        self.enable_error = enable_error

    def cudaSetDevice(self, index):
        self.calls.append(("set", index))
        return ("ok",)

    def cudaDeviceEnablePeerAccess(self, peer, flags):
        self.calls.append(("enable", peer, flags))
        return (self.enable_error,)

    def cudaGetLastError(self):
        return ("ok",)


def _patch(monkeypatch, runtime: _Runtime, can_access: bool) -> list[int]:
    import cuda.bindings

    restored: list[int] = []
    monkeypatch.setattr(cuda.bindings, "runtime", runtime, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "cuda.bindings.runtime", runtime)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: can_access)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: restored.append(index))
    return restored


@pytest.mark.parametrize("status", ["ok", "already"])
def test_peer_access_is_granted_from_this_device_and_the_device_restored(monkeypatch, status):
    runtime = _Runtime(status)
    restored = _patch(monkeypatch, runtime, can_access=True)
    device.enable_peer_access(1, 0)
    assert runtime.calls == [("set", 1), ("enable", 0, 0)]
    assert restored == [0]


def test_a_pair_without_peer_access_or_a_failed_grant_is_an_error(monkeypatch):
    _patch(monkeypatch, _Runtime("ok"), can_access=False)
    with pytest.raises(RuntimeError, match="no peer access"):
        device.enable_peer_access(0, 1)
    restored = _patch(monkeypatch, _Runtime("cudaErrorInvalidDevice"), can_access=True)
    with pytest.raises(RuntimeError, match="failed"):
        device.enable_peer_access(0, 1)
    assert restored == [0]
