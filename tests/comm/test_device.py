"""Device mailbox helpers that need no GPU: the IPC peers' opening and the peer-access grant."""

from __future__ import annotations

import types

import pytest
import torch

from musebench.comm import device


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


def test_a_bad_ipc_open_mode_is_refused_before_the_collective(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_gather_object", lambda *args, **kwargs: pytest.fail("gathered"))
    with pytest.raises(ValueError, match="open_mode must be one of auto, this-device, got 'exporter'"):
        device.ipc_device_group(0, 2, 3, 2, 8, torch.device("cpu"), open_mode="exporter")


class _Handle:
    """A stand-in for cudaIpcMemHandle_t: 64 bytes at a real address."""

    def __init__(self) -> None:
        import ctypes

        self.buffer = ctypes.create_string_buffer(device.IPC_HANDLE_BYTES)

    def getPtr(self) -> int:
        import ctypes

        return ctypes.addressof(self.buffer)


class _IpcRuntime(_Runtime):
    """cuda.bindings.runtime and .driver for the raw IPC export and open, recording the calls."""

    def __init__(self) -> None:
        super().__init__("ok")
        self.cudaIpcMemLazyEnablePeerAccess = 1
        self.cudaIpcMemHandle_t = _Handle
        self.opened: list[bytes] = []

    def cudaSetDevice(self, index):
        self.calls.append(("set", index))
        return (0,)

    def cuMemGetAddressRange(self, address):
        self.calls.append(("range", address))
        return (0, 0x7000, 1 << 20)

    def cudaIpcGetMemHandle(self, base):
        self.calls.append(("export", base))
        handle = _Handle()
        handle.buffer.raw = bytes(range(device.IPC_HANDLE_BYTES))
        return (0, handle)

    def cudaIpcOpenMemHandle(self, handle, flags):
        import ctypes

        self.opened.append(ctypes.string_at(handle.getPtr(), device.IPC_HANDLE_BYTES))
        self.calls.append(("open", flags))
        return (0, 0x9000 + 0x1000 * len(self.opened))

    def cudaIpcCloseMemHandle(self, base):
        self.calls.append(("close", base))
        return (0,)


def _patch_ipc(monkeypatch) -> tuple[_IpcRuntime, list[int]]:
    import cuda.bindings

    runtime = _IpcRuntime()
    restored = _patch(monkeypatch, runtime, can_access=True)
    monkeypatch.setattr(cuda.bindings, "driver", runtime, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "cuda.bindings.driver", runtime)
    return runtime, restored


def test_an_export_names_the_allocation_and_the_words_offset_in_it(monkeypatch):
    runtime, _ = _patch_ipc(monkeypatch)
    words = types.SimpleNamespace(data_ptr=lambda: 0x7000 + 4096, device=types.SimpleNamespace(index=1))
    export = device.export_words(words)
    assert export == device.IpcExport(device=1, handle=bytes(range(64)), offset=4096)
    assert runtime.calls == [("range", 0x7000 + 4096), ("export", 0x7000)]


def test_a_peer_is_opened_on_this_device_with_lazy_peer_access_and_closed_once(monkeypatch):
    runtime, restored = _patch_ipc(monkeypatch)
    mapping = device.IpcMapping(1)
    export = device.IpcExport(device=0, handle=bytes(range(64)), offset=4096)
    assert mapping.open(export) == 0xA000 + 4096
    assert runtime.opened == [bytes(range(64))]
    assert runtime.calls == [("set", 1), ("open", 1)]
    assert restored == [0]  # torch's device restored
    mapping.close()
    mapping.close()
    assert runtime.calls[-2:] == [("set", 1), ("close", 0xA000)]


@pytest.mark.parametrize("mode", ["auto", "this-device"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_peers_on_this_gpu_go_through_torch_and_others_are_opened_here(monkeypatch, mode, gpus):
    """ipc_device_group's choice per peer, on stand-ins: rank 1 of 4, ranks 0 and 1 on this GPU
    (CPU tensors stand in: device index None), ranks 2 and 3 on GPU 1 (gpus 2) or on this one."""
    import torch.distributed as dist
    import torch.multiprocessing.reductions as reductions

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    here = None
    other = 1 if gpus == 2 else here
    peer_words = {peer: torch.zeros(4, dtype=torch.int16) for peer in (0, 2, 3)}
    rebuilt: list[int] = []

    def rebuild(peer):
        rebuilt.append(peer)
        return peer_words[peer]

    monkeypatch.setattr(reductions, "reduce_tensor", lambda words: (rebuild, (1,)))
    shared = [(here, (rebuild, (0,))), None, (other, (rebuild, (2,))), (other, (rebuild, (3,)))]
    exports = [device.IpcExport(here, b"0" * 64, 0), None, device.IpcExport(other, b"2" * 64, 8),
               device.IpcExport(other, b"3" * 64, 16)]
    gathers: list[str] = []

    def gather(out, mine, group=None):
        gathers.append("raw" if isinstance(mine, device.IpcExport) else "torch")
        out[:] = shared if gathers[-1] == "torch" else exports
        out[1] = mine

    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(device, "export_words", lambda words: device.IpcExport(here, b"1" * 64, 0))
    granted: list[tuple] = []
    monkeypatch.setattr(device, "enable_peer_access", lambda a, b: granted.append((a, b)))
    opened: list[bytes] = []

    def open_here(self, export):
        opened.append(export.handle[:1])
        return 0x1000 * len(opened) + export.offset

    monkeypatch.setattr(device.IpcMapping, "open", open_here)
    monkeypatch.setattr(device.IpcMapping, "close", lambda self: None)
    box = device.ipc_device_group(1, 4, 3, 2, 8, torch.device("cpu"), open_mode=mode)
    table = box.peer_table.tolist()
    assert table[1] == box.words.data_ptr()
    if gpus == 1 and mode == "auto":  # the layout measured on one GPU: torch alone, no raw export
        assert gathers == ["torch"] and rebuilt == [0, 2, 3] and opened == [] and granted == []
        assert table == [peer_words[0].data_ptr(), box.words.data_ptr()] + [peer_words[p].data_ptr() for p in (2, 3)]
        return
    assert gathers == ["torch", "raw"]
    assert granted == ([(here, 1)] if gpus == 2 else [])  # once per other GPU
    if mode == "auto":
        assert rebuilt == [0] and opened == [b"2", b"3"]
        assert table[0] == peer_words[0].data_ptr() and table[2:] == [0x1000 + 8, 0x2000 + 16]
    else:
        assert rebuilt == [] and opened == [b"0", b"2", b"3"]
        assert table[0] == 0x1000 and table[2:] == [0x2000 + 8, 0x3000 + 16]
