"""The one transport decision: a launch layout and a request give the mailboxes' transport, or a refusal.

Transports (what carries a rank's stores into its peers' mailboxes):

- `cpu-local`: the CPU model, virtual ranks (threads of one process) sharing host tensors;
- `shm`: the CPU model, processes on one host mapping POSIX shared-memory files;
- `local`: the cute backend, virtual ranks on one GPU, plain device pointers;
- `ipc`: cute processes sharing GPUs, CUDA IPC handles; a peer on this rank's GPU is opened
  through torch, a peer on another GPU on this rank's own device (`IPC_OPEN_MODES`);
- `unicast`: cute processes on a GPU each, torch SymmetricMemory peer pointers;
- `multicast`: cute processes on a GPU each whose mailboxes torch SymmetricMemory also maps
  through one NVLink multicast object per mailbox (GB200 racks): a `multimem.st` reaches every
  rank; the rest of the protocol (the TP tail's route pushes) keeps the unicast peer pointers.
  Granted only where the policy allows multicast and the driver reports it (below), never run as
  unicast where it cannot be had.

Across hosts (`Layout.hosts` > 1: torchrun nodes) a cute launch maps its peers through
SymmetricMemory, which needs fabric handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED on
every GPU: an NVLink fabric of several hosts); CUDA IPC works only among the processes of one
physical host, so `ipc` across nodes is granted and its allocation names any pair of ranks on
different hosts (`musebench.comm.device`). Every pair a transport cannot map is refused by the
allocation, collectively, before any kernel launches.

`decide(layout, request, multicast)` is the only place that picks one; the CLI's checks, the
virtual and process launchers, the ranks' mailbox allocation and `musebench env`'s table all call
it. A request it cannot honour raises `TransportRefused` (a ValueError) with one line naming what
is missing; nothing falls back silently. `auto` picks the layout's transport: cpu-local, shm,
local, then unicast for one process per GPU, ipc where processes share GPUs.

The diagnostics MUSEBENCH_PEER_MAPPING (`auto` | `symmetric` | `ipc`: what `auto` means for a
cute process launch) and MUSEBENCH_IPC_OPEN (`auto` | `this-device`: open every IPC peer on this
rank's device; how one GPU tests the path peers on other GPUs take) are read here and nowhere
else.

`decide` never creates a multicast object: `multicast_support` reads the environment's policy, then
(only when the policy allows it) the driver's device attributes (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, and
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED across hosts), never creating a multicast
object: a program using NVLink multicast on a shared host can take every GPU on it out of
service. TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0 and NVSHMEM_DISABLE_NVLS=1 each
forbid it for musebench as a whole. The only code that creates one (`comm.device`'s multicast
allocation) runs behind a `multicast` verdict and reads the policy again itself.

Importing this module imports neither torch nor cuda-python; `layout_here` and
`multicast_support` import them when they probe the machine, and work without a GPU, a driver or
cuda-python (saying so in the reason).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "BACKENDS",
    "IPC_OPEN_MODES",
    "LAUNCHERS",
    "MULTICAST_SWITCHES",
    "PEER_MAPPINGS",
    "REQUESTS",
    "TRANSPORTS",
    "Layout",
    "MulticastSupport",
    "Transport",
    "TransportRefused",
    "decide",
    "layout_here",
    "multicast_policy",
    "multicast_support",
]

BACKENDS = ("cpu", "cute")
LAUNCHERS = ("virtual", "torchrun")
TRANSPORTS = ("cpu-local", "shm", "local", "ipc", "unicast", "multicast")
REQUESTS = ("auto", "local", "ipc", "unicast", "multicast")
IPC_OPEN_MODES = ("auto", "this-device")
PEER_MAPPINGS = ("auto", "symmetric", "ipc")
_PEER_MAPPING_REQUEST = {"symmetric": "unicast", "ipc": "ipc"}

MULTICAST_ATTRIBUTE = "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"
FABRIC_ATTRIBUTE = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"

# (variable, whether its value forbids multicast). Matching is case-insensitive after stripping,
# and errs towards forbidding: any value a user could mean as "disable" counts.
_FALSE_WORDS = frozenset({"0", "false", "no", "off", "n", "f"})
MULTICAST_SWITCHES: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", lambda value: value.strip().lower() not in _FALSE_WORDS | {""}),
    ("NCCL_NVLS_ENABLE", lambda value: value.strip().lower() in _FALSE_WORDS),
    ("NVSHMEM_DISABLE_NVLS", lambda value: value.strip().lower() not in _FALSE_WORDS | {""}),
)

MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off(environ: dict | None = None) -> None:
    """Keep NCCL, SymmetricMemory and NVSHMEM from creating a multicast object for a path that never
    asked for one: every switch the environment leaves unset gets its forbidding value; where the
    policy forbids multicast (any one switch does, `multicast_policy`), every switch is set to its
    forbidding value, overriding one that allows it (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 with
    NCCL_NVLS_ENABLE=1 must not let NCCL build NVLS multicast for a baseline's all-reduce)."""
    environ = os.environ if environ is None else environ
    forbidden = bool(multicast_policy(environ))
    for name, value in MULTICAST_OFF.items():
        if forbidden:
            environ[name] = value
        else:
            environ.setdefault(name, value)


class TransportRefused(ValueError):
    """A transport request this layout or machine cannot honour; `reason` says what is missing."""

    def __init__(self, request: str, reason: str) -> None:
        super().__init__(f"transport {request}: {reason}")
        self.request = request
        self.reason = reason


@dataclass(frozen=True)
class Layout:
    """How a run's ranks sit on this machine: what the transport decision reads.

    backend: "cpu" (the CPU model) | "cute"; launcher: "virtual" (every rank a thread of one
    process) | "torchrun" (a process per rank); tp: ranks; local_world: processes on this host (1
    for virtual ranks); gpus: CUDA GPUs visible to a process; hosts: distinct hosts the ranks span;
    peer_access: every pair of visible GPUs can access each other's memory (True where fewer than
    two GPUs are visible, and for the cpu backend, which moves nothing between GPUs);
    symmetric_memory: torch.distributed._symmetric_memory imports; fabric: every visible GPU
    reports CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED (SymmetricMemory maps peers on other
    hosts through fabric handles; read for cute process launches across hosts only).
    """

    backend: str
    launcher: str
    tp: int
    local_world: int = 1
    gpus: int = 0
    hosts: int = 1
    peer_access: bool = True
    symmetric_memory: bool = True
    fabric: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.tp < 1 or self.local_world < 1 or self.hosts < 1 or self.gpus < 0:
            raise ValueError(f"a layout needs tp, local_world and hosts >= 1 and gpus >= 0: {self}")
        if self.launcher == "virtual" and (self.local_world != 1 or self.hosts != 1):
            raise ValueError(f"virtual ranks are threads of one process on one host: {self}")

    @property
    def shares_gpus(self) -> bool:
        """More processes on this host than GPUs: some GPU holds several ranks."""
        return self.local_world > self.gpus

    @property
    def gpus_used(self) -> int:
        """GPUs this host's ranks run on (a process per GPU, round-robin; virtual ranks: one)."""
        if self.launcher == "virtual":
            return min(self.gpus, 1)
        return min(self.local_world, self.gpus)


@dataclass(frozen=True)
class MulticastSupport:
    """Whether NVLink multicast may and can be used here, and why (one line).

    forbidden_by: the policy variables that forbid it ("VAR=value"); per_gpu: the driver's
    CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED per GPU, None where it was not read.
    """

    supported: bool
    reason: str
    forbidden_by: tuple[str, ...] = ()
    per_gpu: tuple[bool, ...] | None = None


@dataclass(frozen=True)
class Transport:
    """The transport a layout's mailboxes use.

    name: one of TRANSPORTS; ipc_open (ipc only): "auto" opens a peer on this rank's GPU through
    torch and a peer on another GPU on this rank's device, "this-device" opens every peer on this
    rank's device; peers: how peer mailboxes are reached, in words.
    """

    name: str
    peers: str
    ipc_open: str | None = None


# --------------------------------------------------------------------------------------------
# Multicast: policy and support, probed without creating a multicast object
# --------------------------------------------------------------------------------------------


def multicast_policy(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The policy variables that forbid NVLink multicast here, as "VAR=value" (empty: allowed)."""
    environ = os.environ if environ is None else environ
    return tuple(f"{name}={environ[name]}" for name, forbids in MULTICAST_SWITCHES
                 if name in environ and forbids(environ[name]))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def query_device_attribute(device_count: int, attribute: str) -> list[bool]:
    """A CUdevice_attribute (by name) of each device ordinal through the driver; raises when it
    cannot ask (ImportError without cuda-python). Reads the attribute only: no context, no
    allocation, no multicast object."""
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python before 12.6 named the module this way

    def checked(result: tuple):
        error, *values = result
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {error}")
        return values[0] if values else None

    checked(driver.cuInit(0))
    which = getattr(driver.CUdevice_attribute, attribute)
    return [bool(checked(driver.cuDeviceGetAttribute(which, checked(driver.cuDeviceGet(ordinal)))))
            for ordinal in range(device_count)]


def _ordinals(flags: Sequence[bool]) -> str:
    return ", ".join(str(index) for index, ok in enumerate(flags) if not ok)


def multicast_support(
    gpus: int,
    *,
    hosts: int = 1,
    environ: Mapping[str, str] | None = None,
    active_nvlinks: Sequence[int | None] | None = None,
    query: Callable[[int, str], list[bool]] | None = None,
) -> MulticastSupport:
    """Whether NVLink multicast may and can be used by ranks on `gpus` GPUs of each of `hosts` hosts.

    In order, the first that fails gives the reason: the policy variables (MULTICAST_SWITCHES);
    at least two GPUs; the fabric's active NVLinks per GPU where known (`active_nvlinks`, from
    `nvidia-smi nvlink --status`); the driver's CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED on every
    GPU; across hosts, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED (multicast over an MNNVL
    fabric binds fabric handles). `query(device_count, attribute name)` (`query_device_attribute`
    when None) is called only when the policy allows multicast and the GPUs are there; it reads
    attributes and creates nothing. Never raises.
    """
    forbidden_by = multicast_policy(environ)
    if forbidden_by:
        return MulticastSupport(False, f"multicast is forbidden here: {', '.join(forbidden_by)} (a multicast object on "
                                       "a shared host can take every GPU on it out of service)", forbidden_by)
    if gpus < 1 or gpus * hosts < 2:
        return MulticastSupport(False, f"no NVLink multicast: needs at least two CUDA GPUs ({gpus} visible)")
    if active_nvlinks is not None and any(count == 0 for count in active_nvlinks):
        idle = [index for index, count in enumerate(active_nvlinks) if count == 0]
        return MulticastSupport(False, "no NVLink multicast: no active NVLink on GPU "
                                       f"{', '.join(map(str, idle))} (nvidia-smi nvlink --status)")
    query = query_device_attribute if query is None else query
    try:
        per_gpu = tuple(query(gpus, MULTICAST_ATTRIBUTE))
    except ImportError:
        return MulticastSupport(False, "multicast support unknown: cuda-python is not installed, so "
                                       f"{MULTICAST_ATTRIBUTE} cannot be read")
    except Exception as exc:
        return MulticastSupport(False, "multicast support unknown: the CUDA driver could not be asked "
                                       f"({_one_line(exc)})")
    if not per_gpu or not all(per_gpu):
        return MulticastSupport(False, f"no NVLink multicast: device attribute {MULTICAST_ATTRIBUTE} is 0 on GPU "
                                       f"{_ordinals(per_gpu)}", per_gpu=per_gpu)
    if hosts > 1:
        try:
            fabric = query(gpus, FABRIC_ATTRIBUTE)
        except Exception as exc:
            return MulticastSupport(False, f"multicast across hosts unknown: {FABRIC_ATTRIBUTE} could not be read "
                                           f"({_one_line(exc)})", per_gpu=per_gpu)
        if not all(fabric):
            return MulticastSupport(False, f"no multicast across hosts: device attribute {FABRIC_ATTRIBUTE} is 0 "
                                           f"on GPU {_ordinals(fabric)} (needs an NVLink fabric of several hosts)",
                                    per_gpu=per_gpu)
    return MulticastSupport(True, f"every GPU reports {MULTICAST_ATTRIBUTE}=1", per_gpu=per_gpu)


# --------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------


def _environment_choice(environ: Mapping[str, str], name: str, choices: Sequence[str], request: str) -> str:
    value = environ.get(name, "auto")
    if value not in choices:
        raise TransportRefused(request, f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def decide(layout: Layout, request: str = "auto", multicast: MulticastSupport | None = None,
           environ: Mapping[str, str] | None = None) -> Transport:
    """The transport of `layout`'s mailboxes for `request` (one of REQUESTS); TransportRefused if none.

    `multicast` is probed (`multicast_support`) only when multicast is requested and not given.
    `environ` (os.environ when None) supplies the policy variables and the MUSEBENCH_PEER_MAPPING /
    MUSEBENCH_IPC_OPEN diagnostics. Pure apart from that probe: the same layout, request and
    environment give the same answer on every rank.
    """
    environ = os.environ if environ is None else environ
    if request not in REQUESTS:
        raise TransportRefused(request, f"unknown transport; choose from {', '.join(REQUESTS)}")
    if request == "multicast":
        return _multicast(layout, multicast, environ)
    if layout.backend == "cpu":
        return _cpu_transport(layout, request)
    if layout.gpus < 1:
        raise TransportRefused(request, "the cute backend needs a CUDA GPU (none visible)")
    if layout.launcher == "virtual":
        if request not in ("auto", "local"):
            raise TransportRefused(request, "virtual ranks share one process and one GPU (transport local); "
                                            f"{request} maps peers between processes: use --launcher torchrun")
        return Transport("local", peers="plain device pointers of one process")
    if request == "local":
        raise TransportRefused(request, "local is for virtual ranks in one process; processes map their peers "
                                        "through ipc or unicast")
    asked = request  # what a refusal names
    forced = _environment_choice(environ, "MUSEBENCH_PEER_MAPPING", PEER_MAPPINGS, asked)
    if forced != "auto":
        wanted = _PEER_MAPPING_REQUEST[forced]
        if request not in ("auto", wanted):
            raise TransportRefused(asked, f"MUSEBENCH_PEER_MAPPING={forced} asks for {wanted}")
        request = wanted
    if request == "auto":
        request = "ipc" if layout.shares_gpus else "unicast"
    if request == "unicast":
        return _unicast(layout, asked)
    return _ipc(layout, _environment_choice(environ, "MUSEBENCH_IPC_OPEN", IPC_OPEN_MODES, asked), asked)


def _multicast(layout: Layout, multicast: MulticastSupport | None, environ: Mapping[str, str]) -> Transport:
    """Multicast where the machine and the layout allow it, else TransportRefused: what the machine
    lacks first (policy, driver attribute, fabric across hosts: no flag fixes those), then the
    layout (one process per GPU of the cute backend), then the unicast peers it also needs."""
    if multicast is None:
        multicast = multicast_support(layout.gpus, hosts=layout.hosts, environ=environ)
    if not multicast.supported:
        raise TransportRefused("multicast", multicast.reason)
    if layout.backend == "cpu":
        raise TransportRefused("multicast", "the CPU model moves data through host memory: multicast needs the cute "
                                            "backend")
    if layout.launcher == "virtual":
        raise TransportRefused("multicast", "virtual ranks share one GPU: multicast needs one process per GPU "
                                            "(--launcher torchrun)")
    if layout.shares_gpus:
        raise TransportRefused("multicast", f"multicast needs one process per GPU: {layout.local_world} processes "
                                            f"share {layout.gpus} GPU(s)")
    _unicast(layout, "multicast")  # the route pushes and the polls keep the peer pointers
    return Transport("multicast", peers="torch SymmetricMemory: one NVLink multicast mapping per mailbox "
                                        "(multimem stores), peer pointers besides")


def _cpu_transport(layout: Layout, request: str) -> Transport:
    if request != "auto":
        raise TransportRefused(request, f"the CPU model moves data through host memory: {request} needs the cute "
                                        "backend")
    if layout.launcher == "virtual":
        return Transport("cpu-local", peers="host tensors shared by the rank threads")
    if layout.hosts > 1:
        raise TransportRefused(request, f"the CPU model's shared memory needs every rank on one host ({layout.hosts} "
                                        "hosts)")
    return Transport("shm", peers="POSIX shared-memory files mapped by every process")


def _unicast(layout: Layout, asked: str) -> Transport:
    name = "unicast" if asked in ("auto", "unicast") else asked
    if layout.shares_gpus:
        raise TransportRefused(asked, f"{name} needs one process per GPU: {layout.local_world} processes share "
                                      f"{layout.gpus} GPU(s) (transport ipc maps peers there)")
    if not layout.peer_access:
        raise TransportRefused(asked, f"{name} needs peer access between every pair of GPUs: ranks on GPUs "
                                      "without it cannot map each other's mailboxes")
    if not layout.symmetric_memory:
        raise TransportRefused(asked, f"{name} needs torch SymmetricMemory (torch.distributed._symmetric_memory "
                                      "does not import)")
    if layout.hosts > 1 and not layout.fabric:
        raise TransportRefused(asked, f"{name} across hosts ({layout.hosts}) needs an NVLink fabric: device "
                                      f"attribute {FABRIC_ATTRIBUTE} is 0 here (SymmetricMemory maps peers on "
                                      "other hosts through fabric handles)")
    return Transport("unicast", peers="torch SymmetricMemory peer pointers")


def _ipc(layout: Layout, open_mode: str, asked: str) -> Transport:
    if layout.gpus_used > 1 and not layout.peer_access:
        raise TransportRefused(asked, f"processes on {layout.gpus_used} GPUs need peer access between every pair: "
                                      "a peer on another GPU is opened on the rank's own device")
    if open_mode == "this-device":
        peers = "CUDA IPC handles, every peer opened on this rank's device (MUSEBENCH_IPC_OPEN=this-device)"
    else:
        peers = "CUDA IPC handles: peers on this GPU through torch, peers on another GPU opened on this rank's device"
    return Transport("ipc", peers=peers, ipc_open=open_mode)


# --------------------------------------------------------------------------------------------
# This machine's layout
# --------------------------------------------------------------------------------------------


def visible_gpus() -> int:
    """CUDA GPUs torch sees (0 without torch's CUDA or a GPU)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def peer_access_everywhere(gpus: int) -> bool:
    """Whether every ordered pair of the `gpus` visible GPUs has peer access.

    Asked of the driver (cuDeviceCanAccessPeer: no context is created, so a rank may ask before it
    picks its GPU), through torch without cuda-python; False where neither can answer.
    """
    if gpus < 2:
        return True
    pairs = [(i, j) for i in range(gpus) for j in range(gpus) if i != j]
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            import torch

            return all(torch.cuda.can_device_access_peer(i, j) for i, j in pairs)
        except Exception:
            return False
    try:
        (error,) = driver.cuInit(0)
        if error != driver.CUresult.CUDA_SUCCESS:
            return False
        devices = []
        for ordinal in range(gpus):
            error, device = driver.cuDeviceGet(ordinal)
            if error != driver.CUresult.CUDA_SUCCESS:
                return False
            devices.append(device)
        for i, j in pairs:
            error, can = driver.cuDeviceCanAccessPeer(devices[i], devices[j])
            if error != driver.CUresult.CUDA_SUCCESS or not can:
                return False
    except Exception:
        return False
    return True


def fabric_everywhere(gpus: int) -> bool:
    """Whether every visible GPU reports CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED (False
    without a GPU, cuda-python or a driver). Reads an attribute: creates nothing."""
    if gpus < 1:
        return False
    try:
        return all(query_device_attribute(gpus, FABRIC_ATTRIBUTE))
    except Exception:
        return False


def symmetric_memory_imports() -> bool:
    """Whether torch.distributed._symmetric_memory is importable (torch with distributed support)."""
    try:
        import torch.distributed

        found = importlib.util.find_spec("torch.distributed._symmetric_memory")
        return bool(torch.distributed.is_available() and found)
    except Exception:
        return False


def layout_here(backend: str, launcher: str, tp: int, environ: Mapping[str, str] | None = None,
                hosts: int = 1, local_world: int | None = None) -> Layout:
    """This machine's layout for `tp` ranks of `backend` under `launcher`.

    Virtual ranks: one process. torchrun: `local_world` processes on this host when given (a
    launcher of several nodes: its --nproc-per-node), else inside a job (RANK and WORLD_SIZE set:
    a rank, or a launcher under srun/torchrun) LOCAL_WORLD_SIZE, otherwise the standalone launch,
    tp processes on this host. `hosts` is how many distinct hosts the ranks of one group sit on:
    the caller counts them from host names (the ranks gather theirs over the process group, the
    launchers of several nodes exchange theirs before launching), never from LOCAL_WORLD_SIZE (two
    launchers on one machine are two nodes of one host). The GPUs are counted always (multicast's
    reason needs them); their peer access and SymmetricMemory are probed for cute process launches
    on two GPUs or more (or across hosts), the fabric attribute for cute process launches across
    hosts only.
    """
    environ = os.environ if environ is None else environ
    if launcher == "virtual":
        local_world = 1
    elif local_world is None:
        local_world = tp
        if "RANK" in environ and "WORLD_SIZE" in environ:
            local_world = int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"]))
    gpus = visible_gpus()
    probe = backend == "cute" and launcher == "torchrun"
    return Layout(backend=backend, launcher=launcher, tp=tp, local_world=local_world, gpus=gpus, hosts=hosts,
                  peer_access=peer_access_everywhere(gpus) if probe else True,
                  symmetric_memory=symmetric_memory_imports() if probe and (gpus >= 2 or hosts > 1) else True,
                  fabric=fabric_everywhere(gpus) if probe and hosts > 1 else False)
