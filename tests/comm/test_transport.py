"""The one transport decision, on the CPU: every layout x request, the diagnostics, the multicast probe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from musebench.comm import transport
from musebench.comm.transport import Layout, MulticastSupport, TransportRefused, decide, multicast_support

MC_YES = MulticastSupport(True, "every GPU reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED=1")
MC_FORBIDDEN = MulticastSupport(False, "multicast is forbidden here: NCCL_NVLS_ENABLE=0 (...)", ("NCCL_NVLS_ENABLE=0",))

CPU = "the CPU model moves data through host memory"
VIRTUAL_PEERS = "virtual ranks share one process and one GPU"
LOCAL_ONLY = "local is for virtual ranks"
ONE_PER_GPU = "unicast needs one process per GPU"
NO_PEERS = "need peer access between every pair"
UNICAST_NO_PEERS = "unicast needs peer access between every pair of GPUs"
NO_FABRIC = "needs an NVLink fabric: device attribute CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0"

LAYOUTS = {
    # the CPU model: threads of one process, processes of one host, processes of two hosts
    "cpu-virtual": Layout("cpu", "virtual", 4),
    "cpu-processes": Layout("cpu", "torchrun", 4, local_world=4),
    "cpu-two-hosts": Layout("cpu", "torchrun", 8, local_world=4, hosts=2),
    # cute virtual ranks on one GPU, and where no GPU is visible
    "cute-virtual": Layout("cute", "virtual", 4, gpus=1),
    "cute-virtual-no-gpu": Layout("cute", "virtual", 4, gpus=0),
    # cute processes: all on one GPU; a GPU each (with and without peer access, SymmetricMemory);
    # two per GPU (with and without peer access); two hosts
    "cute-one-gpu": Layout("cute", "torchrun", 4, local_world=4, gpus=1),
    "cute-distinct": Layout("cute", "torchrun", 4, local_world=4, gpus=4),
    "cute-distinct-no-peers": Layout("cute", "torchrun", 4, local_world=4, gpus=4, peer_access=False),
    "cute-distinct-no-symm": Layout("cute", "torchrun", 4, local_world=4, gpus=4, symmetric_memory=False),
    "cute-two-per-gpu": Layout("cute", "torchrun", 4, local_world=4, gpus=2),
    "cute-two-per-gpu-no-peers": Layout("cute", "torchrun", 4, local_world=4, gpus=2, peer_access=False),
    "cute-two-hosts": Layout("cute", "torchrun", 8, local_world=4, gpus=4, hosts=2),
    # two hosts on an NVLink fabric (GB200 racks); two torchrun nodes sharing one GPU each
    "cute-fabric": Layout("cute", "torchrun", 8, local_world=4, gpus=4, hosts=2, fabric=True),
    "cute-two-nodes-one-gpu": Layout("cute", "torchrun", 4, local_world=2, gpus=1, hosts=2),
}

# layout -> request -> the transport's name, or ("refused", a substring of the reason). Multicast
# is asked with a machine that supports it (MC_YES): granted where the layout has one process per
# GPU with unicast peers, else the layout's own reason.
EXPECTED = {
    "cpu-virtual": {"auto": "cpu-local", "local": ("refused", CPU), "ipc": ("refused", CPU),
                    "unicast": ("refused", CPU), "multicast": ("refused", f"{CPU}: multicast needs the cute backend")},
    "cpu-processes": {"auto": "shm", "local": ("refused", CPU), "ipc": ("refused", CPU), "unicast": ("refused", CPU),
                      "multicast": ("refused", CPU)},
    "cpu-two-hosts": {"auto": ("refused", "the CPU model's shared memory needs every rank on one host (2 hosts)"),
                      "local": ("refused", CPU), "ipc": ("refused", CPU), "unicast": ("refused", CPU),
                      "multicast": ("refused", CPU)},
    "cute-virtual": {"auto": "local", "local": "local", "ipc": ("refused", VIRTUAL_PEERS),
                     "unicast": ("refused", VIRTUAL_PEERS),
                     "multicast": ("refused", "virtual ranks share one GPU: multicast needs one process per GPU")},
    "cute-virtual-no-gpu": {"auto": ("refused", "the cute backend needs a CUDA GPU"),
                            "local": ("refused", "the cute backend needs a CUDA GPU"),
                            "ipc": ("refused", "the cute backend needs a CUDA GPU"),
                            "unicast": ("refused", "the cute backend needs a CUDA GPU"),
                            "multicast": ("refused", "virtual ranks share one GPU")},
    "cute-one-gpu": {"auto": "ipc", "local": ("refused", LOCAL_ONLY), "ipc": "ipc",
                     "unicast": ("refused", f"{ONE_PER_GPU}: 4 processes share 1 GPU(s)"),
                     "multicast": ("refused", "multicast needs one process per GPU: 4 processes share 1 GPU(s)")},
    "cute-distinct": {"auto": "unicast", "local": ("refused", LOCAL_ONLY), "ipc": "ipc", "unicast": "unicast",
                      "multicast": "multicast"},
    "cute-distinct-no-peers": {"auto": ("refused", UNICAST_NO_PEERS), "local": ("refused", LOCAL_ONLY),
                               "ipc": ("refused", NO_PEERS), "unicast": ("refused", UNICAST_NO_PEERS),
                               "multicast": ("refused", "multicast needs peer access between every pair")},
    "cute-distinct-no-symm": {"auto": ("refused", "unicast needs torch SymmetricMemory"),
                              "local": ("refused", LOCAL_ONLY), "ipc": "ipc",
                              "unicast": ("refused", "unicast needs torch SymmetricMemory"),
                              "multicast": ("refused", "multicast needs torch SymmetricMemory")},
    "cute-two-per-gpu": {"auto": "ipc", "local": ("refused", LOCAL_ONLY), "ipc": "ipc",
                         "unicast": ("refused", f"{ONE_PER_GPU}: 4 processes share 2 GPU(s)"),
                         "multicast": ("refused", "4 processes share 2 GPU(s)")},
    "cute-two-per-gpu-no-peers": {"auto": ("refused", NO_PEERS), "local": ("refused", LOCAL_ONLY),
                                  "ipc": ("refused", NO_PEERS), "unicast": ("refused", ONE_PER_GPU),
                                  "multicast": ("refused", "4 processes share 2 GPU(s)")},
    "cute-two-hosts": {"auto": ("refused", f"unicast across hosts (2) {NO_FABRIC}"),
                       "local": ("refused", LOCAL_ONLY), "ipc": "ipc",
                       "unicast": ("refused", f"unicast across hosts (2) {NO_FABRIC}"),
                       "multicast": ("refused", f"multicast across hosts (2) {NO_FABRIC}")},
    "cute-fabric": {"auto": "unicast", "local": ("refused", LOCAL_ONLY), "ipc": "ipc", "unicast": "unicast",
                    "multicast": "multicast"},
    "cute-two-nodes-one-gpu": {"auto": "ipc", "local": ("refused", LOCAL_ONLY), "ipc": "ipc",
                               "unicast": ("refused", f"{ONE_PER_GPU}: 2 processes share 1 GPU(s)"),
                               "multicast": ("refused", "multicast needs one process per GPU")},
}

CASES = [(name, request, expected) for name, row in EXPECTED.items() for request, expected in row.items()]


def test_the_table_covers_every_layout_and_request():
    assert set(EXPECTED) == set(LAYOUTS)
    assert all(set(row) == set(transport.REQUESTS) for row in EXPECTED.values())


@pytest.mark.parametrize(("layout", "request_name", "expected"), CASES, ids=[f"{n}-{r}" for n, r, _ in CASES])
def test_every_layout_and_request(layout, request_name, expected):
    if isinstance(expected, str):
        chosen = decide(LAYOUTS[layout], request_name, multicast=MC_YES, environ={})
        assert chosen.name == expected
        assert chosen.peers
        assert (chosen.ipc_open == "auto") if expected == "ipc" else chosen.ipc_open is None
        return
    with pytest.raises(TransportRefused) as refused:
        decide(LAYOUTS[layout], request_name, multicast=MC_YES, environ={})
    assert expected[1] in refused.value.reason, refused.value.reason
    assert str(refused.value).startswith(f"transport {request_name}: ")
    assert "\n" not in str(refused.value)
    assert isinstance(refused.value, ValueError)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_multicast_where_the_machine_cannot_is_refused_with_the_machine_reason(layout):
    with pytest.raises(TransportRefused, match="multicast is forbidden here: NCCL_NVLS_ENABLE=0"):
        decide(LAYOUTS[layout], "multicast", multicast=MC_FORBIDDEN, environ={})


def test_multicast_is_granted_only_where_machine_and_layout_have_it():
    """Multicast is never run as unicast: granted as itself, or refused."""
    granted = []
    for name, layout in LAYOUTS.items():
        try:
            chosen = decide(layout, "multicast", multicast=MC_YES, environ={})
        except TransportRefused:
            continue
        assert chosen.name == "multicast" and "multicast" in chosen.peers
        granted.append(name)
    assert granted == ["cute-distinct", "cute-fabric"]


def test_the_lent_gpus_refuse_multicast_by_policy_before_any_probe(monkeypatch):
    """The lent H200s (one or several, one process per GPU) run with every multicast switch set:
    the refusal is the policy's, and the driver is never asked."""
    def must_not_query(count, attribute):
        raise AssertionError("the driver was asked although multicast is forbidden")

    monkeypatch.setattr(transport, "query_device_attribute", must_not_query)
    for gpus in (1, 2, 4, 8):
        layout = Layout("cute", "torchrun", gpus, local_world=gpus, gpus=gpus)
        with pytest.raises(TransportRefused, match="multicast is forbidden here: TORCH_SYMM_MEM_DISABLE_MULTICAST=1"):
            decide(layout, "multicast", environ=dict(transport.MULTICAST_OFF))


def test_multicast_is_probed_when_not_given_and_the_policy_is_read_first(monkeypatch):
    def must_not_query(count, attribute):
        raise AssertionError("the driver was asked although multicast is forbidden")

    monkeypatch.setattr(transport, "query_device_attribute", must_not_query)
    forbidding = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
    with pytest.raises(TransportRefused) as refused:
        decide(LAYOUTS["cute-distinct"], "multicast", environ=forbidding)
    assert refused.value.reason.startswith("multicast is forbidden here: TORCH_SYMM_MEM_DISABLE_MULTICAST=1, "
                                           "NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1")
    monkeypatch.setattr(transport, "query_device_attribute", lambda count, attribute: [False] * count)
    with pytest.raises(TransportRefused, match="CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0 on GPU 0, 1, 2, 3"):
        decide(LAYOUTS["cute-distinct"], "multicast", environ={})
    monkeypatch.setattr(transport, "query_device_attribute", lambda count, attribute: [True] * count)
    assert decide(LAYOUTS["cute-distinct"], "multicast", environ={}).name == "multicast"
    # across hosts the fabric attribute is read too
    fabric_off = lambda count, attribute: [attribute != transport.FABRIC_ATTRIBUTE] * count  # noqa: E731
    monkeypatch.setattr(transport, "query_device_attribute", fabric_off)
    with pytest.raises(TransportRefused, match="CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0"):
        decide(LAYOUTS["cute-fabric"], "multicast", environ={})


def test_an_unknown_request_is_refused():
    with pytest.raises(TransportRefused, match="unknown transport; choose from auto, local, ipc, unicast, multicast"):
        decide(LAYOUTS["cute-distinct"], "nvshmem", environ={})


# --------------------------------------------------------------------------------------------
# The diagnostics read here and nowhere else
# --------------------------------------------------------------------------------------------


def test_peer_mapping_forces_what_auto_means_for_cute_processes():
    distinct = LAYOUTS["cute-distinct"]
    assert decide(distinct, environ={"MUSEBENCH_PEER_MAPPING": "ipc"}).name == "ipc"
    assert decide(distinct, "ipc", environ={"MUSEBENCH_PEER_MAPPING": "ipc"}).name == "ipc"
    assert decide(distinct, environ={"MUSEBENCH_PEER_MAPPING": "symmetric"}).name == "unicast"
    assert decide(distinct, environ={"MUSEBENCH_PEER_MAPPING": "auto"}).name == "unicast"
    with pytest.raises(TransportRefused, match="MUSEBENCH_PEER_MAPPING=ipc asks for ipc"):
        decide(distinct, "unicast", environ={"MUSEBENCH_PEER_MAPPING": "ipc"})
    with pytest.raises(TransportRefused, match=ONE_PER_GPU):  # forced, and impossible: refused, not ignored
        decide(LAYOUTS["cute-one-gpu"], environ={"MUSEBENCH_PEER_MAPPING": "symmetric"})
    with pytest.raises(TransportRefused, match="MUSEBENCH_PEER_MAPPING must be one of auto, symmetric, ipc"):
        decide(distinct, environ={"MUSEBENCH_PEER_MAPPING": "multicast"})
    # virtual ranks and the CPU model map no peers between processes: the variable does not apply
    assert decide(LAYOUTS["cute-virtual"], environ={"MUSEBENCH_PEER_MAPPING": "ipc"}).name == "local"
    assert decide(LAYOUTS["cpu-processes"], environ={"MUSEBENCH_PEER_MAPPING": "ipc"}).name == "shm"


def test_ipc_open_mode_travels_with_the_decision():
    one_gpu = LAYOUTS["cute-one-gpu"]
    assert decide(one_gpu, environ={}).ipc_open == "auto"
    chosen = decide(one_gpu, environ={"MUSEBENCH_IPC_OPEN": "this-device"})
    assert chosen.name == "ipc" and chosen.ipc_open == "this-device" and "this-device" in chosen.peers
    with pytest.raises(TransportRefused, match="MUSEBENCH_IPC_OPEN must be one of auto, this-device, got 'exporter'"):
        decide(one_gpu, environ={"MUSEBENCH_IPC_OPEN": "exporter"})
    assert decide(LAYOUTS["cute-distinct"], environ={"MUSEBENCH_IPC_OPEN": "exporter"}).name == "unicast"


def test_the_decision_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("MUSEBENCH_PEER_MAPPING", "ipc")
    assert decide(LAYOUTS["cute-distinct"]).name == "ipc"


# --------------------------------------------------------------------------------------------
# The multicast probe
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("environ", "forbidden"), [
    ({}, False),
    ({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}, True),
    ({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}, False),
    ({"NCCL_NVLS_ENABLE": "0"}, True),
    ({"NCCL_NVLS_ENABLE": "1"}, False),
    ({"NVSHMEM_DISABLE_NVLS": "1"}, True),
    ({"NVSHMEM_DISABLE_NVLS": " TRUE "}, True),
])
def test_the_policy_variables(environ, forbidden):
    assert bool(transport.multicast_policy(environ)) is forbidden


def test_each_probe_reason():
    def never(count, attribute):
        raise AssertionError("queried")

    forbidden = multicast_support(8, environ={"NCCL_NVLS_ENABLE": "0"}, query=never)
    assert not forbidden.supported and forbidden.forbidden_by == ("NCCL_NVLS_ENABLE=0",)
    assert forbidden.reason.startswith("multicast is forbidden here: NCCL_NVLS_ENABLE=0")
    for gpus in (0, 1):
        alone = multicast_support(gpus, environ={}, query=never)
        assert not alone.supported and alone.reason == f"no NVLink multicast: needs at least two CUDA GPUs ({gpus} visible)"
    no_links = multicast_support(2, environ={}, active_nvlinks=[18, 0], query=never)
    assert not no_links.supported and "no active NVLink on GPU 1" in no_links.reason

    def no_cuda_python(count, attribute):
        raise ImportError("No module named 'cuda'")

    unknown = multicast_support(2, environ={}, query=no_cuda_python)
    assert not unknown.supported and "cuda-python is not installed" in unknown.reason

    def no_driver(count, attribute):
        raise RuntimeError("CUDA driver call failed: CUDA_ERROR_NO_DEVICE")

    unknown = multicast_support(2, environ={}, query=no_driver)
    assert not unknown.supported and "could not be asked (RuntimeError: CUDA driver call failed" in unknown.reason
    partial = multicast_support(4, environ={}, query=lambda count, attribute: [True, False, True, False])
    assert not partial.supported and partial.per_gpu == (True, False, True, False)
    assert partial.reason == "no NVLink multicast: device attribute CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0 on GPU 1, 3"
    supported = multicast_support(4, environ={}, active_nvlinks=[18] * 4, query=lambda count, attribute: [True] * count)
    assert supported.supported and supported.per_gpu == (True,) * 4


def test_across_hosts_the_fabric_handles_are_asked_for():
    asked: list[str] = []

    def attributes(count, attribute):
        asked.append(attribute)
        return [attribute == transport.MULTICAST_ATTRIBUTE] * count

    single_host = multicast_support(4, environ={}, query=attributes)
    assert single_host.supported and asked == [transport.MULTICAST_ATTRIBUTE]
    two_hosts = multicast_support(4, hosts=2, environ={}, query=attributes)
    assert not two_hosts.supported and "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0" in two_hosts.reason
    assert multicast_support(4, hosts=2, environ={}, query=lambda count, attribute: [True] * count).supported


def test_the_probe_without_cuda_python_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    support = multicast_support(2, environ={})
    assert not support.supported and "cuda-python is not installed" in support.reason


def test_the_real_probe_never_raises_here():
    """This machine's answer, whatever it has (no GPU, no driver): a reason, never an exception."""
    for gpus in (0, 2, 8):
        support = multicast_support(gpus, environ={})
        assert support.reason and "\n" not in support.reason


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


def test_a_layout_refuses_what_cannot_exist():
    with pytest.raises(ValueError, match="virtual ranks are threads of one process"):
        Layout("cute", "virtual", 4, local_world=4, gpus=1)
    with pytest.raises(ValueError, match="backend must be one of cpu, cute"):
        Layout("triton", "virtual", 4)
    with pytest.raises(ValueError, match="launcher must be one of virtual, torchrun"):
        Layout("cpu", "srun", 4)
    with pytest.raises(ValueError, match="hosts >= 1"):
        Layout("cpu", "torchrun", 4, local_world=4, hosts=0)


def test_layout_here_reads_the_launch(monkeypatch):
    probed: list[int] = []
    monkeypatch.setattr(transport, "visible_gpus", lambda: 4)
    monkeypatch.setattr(transport, "peer_access_everywhere", lambda gpus: probed.append(gpus) or False)
    monkeypatch.setattr(transport, "symmetric_memory_imports", lambda: True)
    virtual = transport.layout_here("cute", "virtual", 8, environ={})
    assert (virtual.local_world, virtual.hosts, virtual.gpus, virtual.peer_access) == (1, 1, 4, True) and probed == []
    standalone = transport.layout_here("cute", "torchrun", 8, environ={})
    assert (standalone.local_world, standalone.hosts, standalone.peer_access) == (8, 1, False) and probed == [4]
    in_job = transport.layout_here("cpu", "torchrun", 8, environ={"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    # hosts come from host names (the caller's count), never from WORLD_SIZE / LOCAL_WORLD_SIZE
    assert (in_job.local_world, in_job.hosts, in_job.peer_access) == (4, 1, True) and probed == [4]
    across = transport.layout_here("cpu", "torchrun", 8, environ={"RANK": "5", "WORLD_SIZE": "8"}, hosts=2,
                                   local_world=4)
    assert (across.local_world, across.hosts) == (4, 2)
    assert decide(in_job, environ={}).name == "shm"  # two nodes of one host share its memory
    with pytest.raises(TransportRefused, match="every rank on one host"):
        decide(across, environ={})


def test_layout_here_reads_the_fabric_attribute_for_cute_processes_across_hosts_only(monkeypatch):
    asked: list[str] = []
    monkeypatch.setattr(transport, "visible_gpus", lambda: 4)
    monkeypatch.setattr(transport, "peer_access_everywhere", lambda gpus: True)
    monkeypatch.setattr(transport, "symmetric_memory_imports", lambda: True)
    monkeypatch.setattr(transport, "query_device_attribute", lambda count, attribute: asked.append(attribute) or [True] * count)
    one_host = transport.layout_here("cute", "torchrun", 4, environ={"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert one_host.fabric is False and asked == []
    # hosts come from the ranks' gathered host names, never from LOCAL_WORLD_SIZE
    two_hosts = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert transport.layout_here("cute", "torchrun", 8, environ=two_hosts).fabric is False and asked == []
    assert transport.layout_here("cpu", "torchrun", 8, environ=two_hosts, hosts=2).fabric is False and asked == []
    rack = transport.layout_here("cute", "torchrun", 8, environ=two_hosts, hosts=2)
    assert rack.fabric is True and asked == [transport.FABRIC_ATTRIBUTE]
    assert decide(rack, environ={}).name == "unicast"
    monkeypatch.setattr(transport, "query_device_attribute", lambda count, attribute: [True, False, True, True])
    no_fabric = transport.layout_here("cute", "torchrun", 8, environ=two_hosts, hosts=2)
    assert no_fabric.fabric is False
    with pytest.raises(TransportRefused, match=f"unicast across hosts \\(2\\) {NO_FABRIC}"):
        decide(no_fabric, environ={})

    def no_driver(count, attribute):
        raise ImportError("no cuda-python")

    monkeypatch.setattr(transport, "query_device_attribute", no_driver)
    assert transport.fabric_everywhere(4) is False and transport.fabric_everywhere(0) is False


def test_peer_access_needs_no_probe_below_two_gpus_and_is_false_where_nothing_answers():
    assert transport.peer_access_everywhere(0) is True and transport.peer_access_everywhere(1) is True
    try:
        import torch

        if torch.cuda.device_count() >= 2:
            pytest.skip("this machine has GPUs to ask")
    except ImportError:
        pass
    assert transport.peer_access_everywhere(2) is False  # no driver here: not confirmed, so not granted


def test_importing_the_module_imports_neither_torch_nor_cuda_python():
    code = "import sys, musebench.comm.transport; print('torch' in sys.modules, 'cuda' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert result.stdout.strip() == "False False"


@pytest.mark.parametrize("environ, expected", [
    ({}, {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}),
    # one forbidding switch forbids multicast for musebench as a whole: an allowing one is overridden
    ({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "1"},
     {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}),
    ({"NVSHMEM_DISABLE_NVLS": "yes", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"},
     {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}),
    # an environment that allows multicast explicitly keeps its word; the unset switches go off
    ({"NCCL_NVLS_ENABLE": "1"}, {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "1",
                                 "NVSHMEM_DISABLE_NVLS": "1"}),
])
def test_keep_multicast_off_sets_every_switch_where_one_forbids(environ, expected):
    from musebench.comm.transport import keep_multicast_off

    keep_multicast_off(environ)
    assert environ == expected
