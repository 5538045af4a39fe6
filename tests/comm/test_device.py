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
    monkeypatch.setattr(device, "group_places", lambda rank, tp, where, group=None: (group, [
        device.RankPlace(r, r, "node", 0 if r < 2 or gpus == 1 else 1, (True, True)) for r in range(4)]))
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


# ---------------------------------------------------------------------------------------------
# SymmetricMemory mailboxes (unicast, multicast) on stand-ins: the binding and every refusal.

OFFSET = 64  # the words' offset in a rank's allocation (the same in every rank's: symmetric)
PEER_BASE = 0x7F00_0000_0000
MULTICAST_BASE = 0x7E00_0000_0000


class _SymmetricHandle:
    """A stand-in for torch's SymmetricMemory handle: every rank's allocation base, and the
    multicast mapping's (0: none)."""

    def __init__(self, buffer_ptrs, multicast_ptr=0):
        self.buffer_ptrs = buffer_ptrs
        self.multicast_ptr = multicast_ptr


class _SymmetricMemory:
    """A stand-in for torch.distributed._symmetric_memory: `empty` gives a CPU tensor, the
    rendezvous maps this rank's allocation at words - OFFSET and every peer's at PEER_BASE + ...;
    `multicast_ptr` is given; `fail` makes the rendezvous raise."""

    def __init__(self, rank, tp, multicast_ptr=0, null_peer=None, fail=None):
        self.rank, self.tp, self.multicast_ptr, self.null_peer, self.fail = rank, tp, multicast_ptr, null_peer, fail
        self.calls: list[str] = []

    def empty(self, *shape, dtype, device):
        self.calls.append("empty")
        return torch.empty(shape, dtype=dtype, device=device)

    def rendezvous(self, words, group):
        self.calls.append("rendezvous")
        if self.fail:
            raise RuntimeError(self.fail)
        bases = [PEER_BASE + 0x1_0000_0000 * peer for peer in range(self.tp)]
        bases[self.rank] = words.data_ptr() - OFFSET
        if self.null_peer is not None:
            bases[self.null_peer] = 0
        return _SymmetricHandle(bases, self.multicast_ptr)


def _places(tp, hosts=1, devices=None, peer_access=True):
    """tp ranks over `hosts` hosts, consecutive ranks on one host, GPU = rank on its host."""
    per_host = tp // hosts
    devices = devices or [r % per_host for r in range(tp)]
    return [device.RankPlace(r, 10 + r, f"node{r // per_host}", devices[r],
                             tuple(True if d == devices[r] else peer_access for d in range(per_host)))
            for r in range(tp)]


def _scripted_gather(rank, places, peer_outcomes=None):
    """All-gather as rank `rank` sees it: its own object in its place, the scripted peers' besides."""
    def gather(obj):
        if isinstance(obj, device.RankPlace):
            return [obj if r == rank else place for r, place in enumerate(places)]
        outcomes = peer_outcomes or {}
        return [obj if r == rank else outcomes.get(r, obj) for r in range(len(places))]
    return gather


def _allocate(rank, tp, memory, gather, places, multicast=False):
    return device.allocate_symmetric(rank, tp, 3, 2, 8, torch.device("cpu"), place=places[rank], multicast=multicast,
                                     symmetric_memory=memory, group="group", gather=gather,
                                     synchronize=lambda where: None)


def _peer_outcome(rank, tp, multicast=0):
    bases = [PEER_BASE + 0x1_0000_0000 * peer + OFFSET for peer in range(tp)]
    return device.MappingOutcome(peers=tuple(bases), multicast=multicast)


@pytest.mark.parametrize("multicast", [False, True], ids=["unicast", "multicast"])
def test_a_symmetric_mailbox_binds_every_peer_and_the_multicast_mapping_at_the_words_offset(multicast):
    tp, rank = 4, 2
    places = _places(tp, hosts=2)  # two hosts: SymmetricMemory's to map (fabric handles)
    memory = _SymmetricMemory(rank, tp, multicast_ptr=MULTICAST_BASE if multicast else 0)
    peers = {r: _peer_outcome(r, tp, MULTICAST_BASE + OFFSET if multicast else 0) for r in range(tp)}
    box = _allocate(rank, tp, memory, _scripted_gather(rank, places, peers), places, multicast=multicast)
    expected = [PEER_BASE + 0x1_0000_0000 * peer + OFFSET for peer in range(tp)]
    expected[rank] = box.words.data_ptr()
    assert box.peer_table.tolist() == expected
    assert box.multicast == (MULTICAST_BASE + OFFSET if multicast else 0)
    assert box.transport == ("multicast" if multicast else "unicast")
    assert tuple(box.words.shape) == (3, 3, 2, 8) and bool((box.words == -32768).all())
    assert box.stage.tolist() == [0, 0] and box.fault.tolist() == [-1] * 4
    assert memory.calls == ["empty", "rendezvous"]


def test_a_unicast_mailbox_ignores_a_multicast_mapping():
    tp, rank = 2, 0
    places = _places(tp)
    memory = _SymmetricMemory(rank, tp, multicast_ptr=MULTICAST_BASE)
    box = _allocate(rank, tp, memory, _scripted_gather(rank, places, {1: _peer_outcome(1, tp)}), places)
    assert box.multicast == 0 and box.transport == "unicast"


def test_gpus_of_one_host_without_peer_access_are_refused_before_anything_is_allocated():
    places = _places(4, peer_access=False)
    memory = _SymmetricMemory(0, 4)
    with pytest.raises(device.PeerMappingRefused) as refused:
        _allocate(0, 4, memory, _scripted_gather(0, places), places)
    assert "rank 10 (host node0, GPU 0) cannot map rank 11 (host node0, GPU 1): GPU 0 has no peer access to GPU 1" \
        in str(refused.value)
    assert len(refused.value.pairs) == 12 and memory.calls == []


def test_a_null_peer_pointer_on_another_rank_is_refused_on_this_one_naming_the_pair():
    tp, rank = 4, 0
    places = _places(tp, hosts=2)
    broken = _peer_outcome(3, tp)
    broken = device.MappingOutcome(peers=broken.peers[:1] + (0,) + broken.peers[2:])
    gather = _scripted_gather(rank, places, {1: _peer_outcome(1, tp), 2: _peer_outcome(2, tp), 3: broken})
    with pytest.raises(device.PeerMappingRefused) as refused:
        _allocate(rank, tp, _SymmetricMemory(rank, tp), gather, places)
    assert [pair.message() for pair in refused.value.pairs] == [
        "rank 13 (host node1, GPU 1) cannot map rank 11 (host node0, GPU 1): SymmetricMemory gave a null peer pointer"]


def test_a_null_peer_pointer_here_is_refused():
    tp, rank = 2, 1
    places = _places(tp, hosts=2, devices=[0, 0])
    gather = _scripted_gather(rank, places, {0: _peer_outcome(0, tp)})
    with pytest.raises(device.PeerMappingRefused, match=r"rank 11 \(host node1, GPU 0\) cannot map rank 10 "):
        _allocate(rank, tp, _SymmetricMemory(rank, tp, null_peer=0), gather, places)


def test_a_failed_rendezvous_is_gathered_and_refused_by_every_rank():
    tp = 2
    places = _places(tp)
    failed = device.MappingOutcome(error="RuntimeError: no fabric handle")
    with pytest.raises(device.PeerMappingRefused, match=r"rank 11 \(host node0, GPU 1\): SymmetricMemory rendezvous "
                                                        r"failed \(RuntimeError: no fabric handle\)"):
        _allocate(0, tp, _SymmetricMemory(0, tp), _scripted_gather(0, places, {1: failed}), places)
    with pytest.raises(device.PeerMappingRefused, match=r"rank 11 .*rendezvous failed \(RuntimeError: cannot import"):
        _allocate(1, tp, _SymmetricMemory(1, tp, fail="cannot import the peer's handle\nmore"),
                  _scripted_gather(1, places, {0: _peer_outcome(0, tp)}), places)


def test_multicast_without_a_multicast_mapping_on_any_rank_is_refused():
    tp, rank = 2, 0
    places = _places(tp)
    here_none = _SymmetricMemory(rank, tp, multicast_ptr=0)
    with pytest.raises(device.PeerMappingRefused, match=r"rank 10 .*no multicast mapping \(multicast_ptr is 0\)"):
        _allocate(rank, tp, here_none, _scripted_gather(rank, places, {1: _peer_outcome(1, tp, MULTICAST_BASE)}),
                  places, multicast=True)
    with pytest.raises(device.PeerMappingRefused, match=r"rank 11 .*no multicast mapping"):
        _allocate(rank, tp, _SymmetricMemory(rank, tp, multicast_ptr=MULTICAST_BASE),
                  _scripted_gather(rank, places, {1: _peer_outcome(1, tp, 0)}), places, multicast=True)


def test_ipc_refuses_ranks_on_different_hosts_and_allows_one_host():
    two_hosts = _places(4, hosts=2, devices=[0, 0, 0, 0])
    pairs = device.unmappable_pairs(two_hosts, "ipc")
    assert len(pairs) == 8 and all(pair.reason == "CUDA IPC handles do not cross hosts" for pair in pairs)
    assert device.unmappable_pairs(two_hosts, "unicast") == []  # SymmetricMemory's to judge (fabric)
    assert device.unmappable_pairs(_places(4, devices=[0, 0, 0, 0]), "ipc") == []


def test_a_refusal_names_at_most_eight_pairs_and_counts_the_rest():
    refused = device.PeerMappingRefused("ipc", device.unmappable_pairs(_places(8, hosts=2, devices=[0] * 8), "ipc"))
    assert str(refused).startswith("ipc mailboxes cannot be mapped: rank 10 (host node0, GPU 0) cannot map rank 14")
    assert str(refused).endswith("; and 24 more")


def test_the_multicast_allocation_reads_the_policy_first_and_allocates_nothing_where_it_forbids(monkeypatch):
    """The lent GPUs' environment: even called directly (past decide), no group is resolved and
    no SymmetricMemory allocation or rendezvous happens."""
    from musebench.comm.transport import MULTICAST_OFF, TransportRefused

    for name, value in MULTICAST_OFF.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(device, "resolve_group", lambda group: pytest.fail("a group was resolved"))
    monkeypatch.setattr(device, "enable_symmetric_memory", lambda group: pytest.fail("SymmetricMemory was used"))
    with pytest.raises(TransportRefused, match="multicast is forbidden here: TORCH_SYMM_MEM_DISABLE_MULTICAST=1"):
        device.symmetric_device_group(0, 2, 3, 2, 8, torch.device("cpu"), multicast=True)


def test_a_unicast_allocation_turns_every_multicast_switch_off_first(monkeypatch):
    from musebench.comm.transport import MULTICAST_OFF

    for name in MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)

    class Stop(Exception):
        pass

    def stop(group):
        raise Stop

    monkeypatch.setattr(device, "resolve_group", stop)
    with pytest.raises(Stop):
        device.symmetric_device_group(0, 2, 3, 2, 8, torch.device("cpu"))
    import os

    assert {name: os.environ[name] for name in MULTICAST_OFF} == MULTICAST_OFF


def test_a_group_of_global_ranks_is_created_once_by_its_members_alone(monkeypatch):
    import torch.distributed as dist

    created: list[tuple] = []
    monkeypatch.setattr(device, "_GROUPS", {})
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 5)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kwargs: created.append((tuple(ranks), kwargs)) or "g")
    assert device.resolve_group([6, 4, 5, 7]) == "g" and device.resolve_group((4, 5, 6, 7)) == "g"
    assert created == [((4, 5, 6, 7), {"use_local_synchronization": True})]
    with pytest.raises(ValueError, match="global rank 5 is not in the group"):
        device.resolve_group([0, 1])
    with pytest.raises(ValueError, match="distinct global ranks"):
        device.resolve_group([4, 5, 5])
    process_group = object()
    assert device.resolve_group(process_group) is process_group  # a ProcessGroup (anything else) as is


def test_a_group_that_is_not_the_asked_rank_of_tp_is_refused(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [4, 5, 6, 7])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert device.check_group("g", 1, 4) == (4, 5, 6, 7)
    with pytest.raises(ValueError, match=r"this process is rank 1 of a group of 4 \(global ranks \[4, 5, 6, 7\]\); "
                                         r"the mailbox was asked for rank 0 of 4"):
        device.check_group("g", 0, 4)
    with pytest.raises(ValueError, match="asked for rank 1 of 8"):
        device.check_group("g", 1, 8)
