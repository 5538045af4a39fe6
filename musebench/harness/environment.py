"""The environment probe: what this machine can run, and which mailbox transport each launch gets.

Contract:

- `probe()` returns a JSON-native dict with the keys `torch`, `cutlass_dsl`, `cuda_python`,
  `gpus`, `p2p`, `multicast`, `fabric`, `transports` and `backends` (each described at the
  function that builds it). It never raises for a missing GPU, driver, package or tool: each is
  reported as absent, with the reason where one is known.
- Multicast is never exercised: `multicast_status` reports `musebench.comm.transport.multicast_support`
  (the environment's policy, then, only when it allows multicast and there are at least two GPUs,
  the driver's CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED; no multicast object is ever created).
- `transports(info)` maps each launch layout to the transports its ranks' mailboxes can use,
  preferred first, each one what `musebench.comm.transport.decide` answers for that layout (the
  one place the transport is decided): `virtual` (virtual ranks in one process), `shared_gpu`
  (processes sharing one GPU), `distinct_gpus` (one process per GPU), `shared_gpus` (more
  processes than GPUs); the note gives the refusals' reasons.
- `backends` says which kernel backends can run: "cpu" always; "cute" when a CUDA GPU of SM 90 or
  newer is present and `import cutlass` succeeds.

Neither torch nor cutlass is imported at module import time. `probe()` imports both, and on a
machine with a GPU it initializes CUDA in the calling process (device properties and peer access
need a context); a launcher that forks workers after probing must use the spawn start method.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from musebench.comm import transport as _transport
from musebench.comm.transport import MULTICAST_SWITCHES

__all__ = [
    "MULTICAST_SWITCHES",
    "backends",
    "cutlass_status",
    "fabric",
    "gpus",
    "multicast_policy",
    "multicast_status",
    "p2p_matrix",
    "probe",
    "render_probe",
    "torch_status",
    "transports",
]

CUTE_MIN_SM = 90  # the CuTe DSL kernels use Hopper instructions (TMA, wgmma, distributed shared memory)

_NVIDIA_SMI_TIMEOUT_S = 10


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _import_torch() -> Any | None:
    try:
        import torch
    except Exception:
        return None
    return torch


# --------------------------------------------------------------------------------------------
# Software
# --------------------------------------------------------------------------------------------


def torch_status() -> dict[str, Any]:
    """torch's version, the CUDA it was built with, whether it sees a GPU, and SymmetricMemory.

    Keys: version, cuda_build (None for a CPU build), cuda_available, device_count,
    symmetric_memory (torch.distributed._symmetric_memory is importable), error (import failure).
    """
    status: dict[str, Any] = {
        "version": _distribution_version("torch"),
        "cuda_build": None,
        "cuda_available": False,
        "device_count": 0,
        "symmetric_memory": False,
        "error": None,
    }
    try:
        import torch
    except Exception as exc:
        status["error"] = _one_line(exc)
        return status
    status["version"] = torch.__version__
    status["cuda_build"] = torch.version.cuda
    try:
        status["cuda_available"] = bool(torch.cuda.is_available())
        status["device_count"] = torch.cuda.device_count() if status["cuda_available"] else 0
    except Exception as exc:  # a driver/runtime mismatch surfaces here, not at import
        status["error"] = _one_line(exc)
    try:
        status["symmetric_memory"] = bool(
            torch.distributed.is_available() and importlib.util.find_spec("torch.distributed._symmetric_memory")
        )
    except Exception:
        status["symmetric_memory"] = False
    return status


def cutlass_status(try_import: bool = True) -> dict[str, Any]:
    """The CuTe DSL's installed version (package metadata) and whether `import cutlass` works.

    Keys: version (None when nvidia-cutlass-dsl is not installed), importable (None when the
    import was not tried), error (the import's failure, one line).
    """
    status: dict[str, Any] = {
        "version": _distribution_version("nvidia-cutlass-dsl"),
        "importable": None,
        "error": None,
    }
    if not try_import:
        return status
    try:
        importlib.import_module("cutlass")
        status["importable"] = True
    except (Exception, SystemExit) as exc:  # the DSL's import can fail in native loading, not only ImportError
        status["importable"] = False
        status["error"] = _one_line(exc)
    return status


# --------------------------------------------------------------------------------------------
# GPUs and their links
# --------------------------------------------------------------------------------------------


def gpus() -> list[dict[str, Any]]:
    """The CUDA GPUs torch sees, in torch's index order; [] without torch, CUDA or a GPU.

    Each entry: index, name, capability ("9.0"), sm (90), sm_count, memory_bytes, uuid.
    """
    torch = _import_torch()
    if torch is None:
        return []
    try:
        if not torch.cuda.is_available():
            return []
        count = torch.cuda.device_count()
    except Exception:
        return []
    found = []
    for index in range(count):
        try:
            props = torch.cuda.get_device_properties(index)
        except Exception as exc:
            found.append({"index": index, "name": None, "error": _one_line(exc)})
            continue
        uuid = getattr(props, "uuid", None)
        found.append(
            {
                "index": index,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "sm": props.major * 10 + props.minor,
                "sm_count": props.multi_processor_count,
                "memory_bytes": int(props.total_memory),
                "uuid": str(uuid) if uuid is not None else None,
            }
        )
    return found


def p2p_matrix(device_count: int) -> list[list[bool | None]]:
    """matrix[i][j]: whether GPU i can access GPU j's memory directly; None on the diagonal."""
    if device_count < 2:
        return [[None] * device_count for _ in range(device_count)]
    torch = _import_torch()
    matrix: list[list[bool | None]] = []
    for i in range(device_count):
        row: list[bool | None] = []
        for j in range(device_count):
            if i == j:
                row.append(None)
                continue
            try:
                row.append(bool(torch.cuda.can_device_access_peer(i, j)))
            except Exception:
                row.append(False)
        matrix.append(row)
    return matrix


def multicast_policy(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Whether the environment allows NVLink multicast: {"allowed": bool, "forbidden_by": ["VAR=value", ...]}."""
    forbidden_by = list(_transport.multicast_policy(environ))
    return {"allowed": not forbidden_by, "forbidden_by": forbidden_by}


def _query_multicast_attribute(device_count: int) -> list[bool]:
    """CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED for each device ordinal; raises when it cannot ask."""
    return _transport.query_device_attribute(device_count, _transport.MULTICAST_ATTRIBUTE)


def multicast_status(
    device_count: int,
    environ: Mapping[str, str] | None = None,
    query: Callable[[int], list[bool]] = _query_multicast_attribute,
    active_nvlinks: list[int | None] | None = None,
) -> dict[str, Any]:
    """`musebench.comm.transport.multicast_support` for this host's GPUs, as a JSON-native dict.

    Keys: allowed, forbidden_by (the policy); supported (True/False when every GPU's attribute was
    read, None when it was not: forbidden, fewer than two GPUs, no active NVLink, or the query
    failed); per_gpu (the attribute per GPU, or None); usable (multicast may and can be used);
    note (the reason, one line). `query` is called only when multicast is allowed and there are at
    least two GPUs.
    """
    support = _transport.multicast_support(device_count, environ=environ, active_nvlinks=active_nvlinks,
                                           query=lambda count, attribute: query(count))
    per_gpu = list(support.per_gpu) if support.per_gpu is not None else None
    return {
        "allowed": not support.forbidden_by,
        "forbidden_by": list(support.forbidden_by),
        "supported": (bool(per_gpu) and all(per_gpu)) if per_gpu is not None else None,
        "per_gpu": per_gpu,
        "usable": support.supported,
        "note": support.reason,
    }


def fabric_handles(device_count: int,
                   query: Callable[[int, str], list[bool]] | None = None) -> dict[str, Any]:
    """CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED per GPU: whether SymmetricMemory can map
    mailboxes (and bind multicast) across hosts. Keys: per_gpu (None where not read), usable,
    note. Reads an attribute only; never raises."""
    if device_count < 1:
        return {"per_gpu": None, "usable": False, "note": "no CUDA GPU"}
    query = _transport.query_device_attribute if query is None else query
    try:
        per_gpu = [bool(flag) for flag in query(device_count, _transport.FABRIC_ATTRIBUTE)]
    except Exception as exc:
        return {"per_gpu": None, "usable": False, "note": f"{_transport.FABRIC_ATTRIBUTE} not read ({_one_line(exc)})"}
    usable = bool(per_gpu) and all(per_gpu)
    note = (f"every GPU reports {_transport.FABRIC_ATTRIBUTE}=1: peers on other hosts can be mapped" if usable else
            f"{_transport.FABRIC_ATTRIBUTE} is 0 on GPU {', '.join(str(i) for i, ok in enumerate(per_gpu) if not ok)}"
            ": mailboxes cannot span hosts")
    return {"per_gpu": per_gpu, "usable": usable, "note": note}


_NVLINK_GPU_LINE = re.compile(r"^GPU\s+\d+:.*\(UUID:\s*(?P<uuid>[^)]+)\)")
_NVLINK_ACTIVE_LINE = re.compile(r"^\s*Link\s+\d+:\s*[\d.]+\s*[GM]B/s")


def _parse_nvlink_status(text: str) -> dict[str, int]:
    """Active NVLink count per GPU UUID (lower-case, without the "GPU-" prefix) from `nvidia-smi nvlink --status`."""
    counts: dict[str, int] = {}
    current: str | None = None
    for line in text.splitlines():
        gpu = _NVLINK_GPU_LINE.match(line)
        if gpu:
            current = _normal_uuid(gpu.group("uuid"))
            counts[current] = 0
        elif current is not None and _NVLINK_ACTIVE_LINE.match(line):
            counts[current] += 1
    return counts


def _normal_uuid(uuid: str) -> str:
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def fabric(gpu_list: list[dict[str, Any]], query_nvidia_smi: bool = True) -> dict[str, Any]:
    """Active NVLink links per GPU, read from `nvidia-smi nvlink --status` when that tool exists.

    Keys: source ("nvidia-smi" or None), active_nvlinks (a count per entry of `gpu_list`, None
    where unknown; None as a whole when nothing was read; all 0 when nvidia-smi lists no NVLink
    at all), note, handles (`fabric_handles`: whether mailboxes and multicast can span hosts).
    nvidia-smi numbers GPUs by PCI
    order regardless of CUDA_VISIBLE_DEVICES, so its rows are matched to torch's by UUID.
    """
    result: dict[str, Any] = {"source": None, "active_nvlinks": None, "note": "",
                              "handles": fabric_handles(len(gpu_list))}
    if not gpu_list:
        result["note"] = "no CUDA GPU"
        return result
    if not query_nvidia_smi:
        result["note"] = "not queried"
        return result
    executable = shutil.which("nvidia-smi")
    if executable is None:
        result["note"] = "nvidia-smi not found"
        return result
    try:
        completed = subprocess.run(
            [executable, "nvlink", "--status"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        result["note"] = f"nvidia-smi failed ({_one_line(exc)})"
        return result
    if completed.returncode != 0:
        detail = (completed.stderr or completed.stdout).strip().splitlines()
        result["note"] = f"nvidia-smi nvlink exited {completed.returncode}" + (f": {detail[0]}" if detail else "")
        return result
    by_uuid = _parse_nvlink_status(completed.stdout)
    result["source"] = "nvidia-smi"
    if not by_uuid:
        # nvidia-smi prints nothing at all for GPUs without NVLink (a lone or PCIe-only GPU).
        result["active_nvlinks"] = [0] * len(gpu_list)
        result["note"] = "nvidia-smi lists no NVLink"
        return result
    result["active_nvlinks"] = [
        by_uuid.get(_normal_uuid(gpu["uuid"])) if gpu.get("uuid") else None for gpu in gpu_list
    ]
    if any(count is None for count in result["active_nvlinks"]):
        result["note"] = "some GPUs not matched by UUID"
    return result


# --------------------------------------------------------------------------------------------
# What can run
# --------------------------------------------------------------------------------------------


def _missing_peer_pairs(p2p: list[list[bool | None]]) -> list[tuple[int, int]]:
    return [(i, j) for i, row in enumerate(p2p) for j, ok in enumerate(row) if i != j and not ok]


def _transports_of(layout: _transport.Layout, requests: tuple[str, ...],
                   multicast: _transport.MulticastSupport) -> tuple[list[str], str]:
    """(transports `decide` grants the layout, auto's first; a note: what auto's maps, and why
    each other request is refused)."""
    granted: list[str] = []
    notes: list[str] = []
    for request in ("auto", *requests):
        try:
            chosen = _transport.decide(layout, request, multicast=multicast)
        except _transport.TransportRefused as refusal:
            notes.append(refusal.reason if request == "auto" else f"{request}: {refusal.reason}")
            continue
        if chosen.name not in granted:
            granted.append(chosen.name)
            if request == "auto":
                notes.insert(0, chosen.peers)
    return granted, "; ".join(notes)


def transports(info: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Transports per launch layout, preferred first, from a `probe()` dict (probed now when None).

    Each layout maps to {"layout": description, "launcher": "virtual"|"torchrun",
    "transports": [...], "note": how auto's transport maps peers and why the others are refused}.
    Each entry is `musebench.comm.transport.decide` over that layout. Only `gpus`, `p2p`,
    `multicast` and `torch.symmetric_memory` of `info` are read.
    """
    if info is None:
        gpu_list = gpus()
        info = {
            "gpus": gpu_list,
            "p2p": p2p_matrix(len(gpu_list)),
            "multicast": multicast_status(len(gpu_list)),
            "torch": torch_status(),
        }
    gpu_count = len(info.get("gpus") or [])
    has_gpu = gpu_count > 0
    backend = "cute" if has_gpu else "cpu"
    status = info.get("multicast") or {}
    multicast = _transport.MulticastSupport(supported=bool(status.get("usable")),
                                            reason=str(status.get("note") or "multicast support not probed"))
    peer_access = not _missing_peer_pairs(info.get("p2p") or [])
    symmetric_memory = bool((info.get("torch") or {}).get("symmetric_memory"))

    def layout(launcher: str, tp: int, local_world: int, gpus_seen: int) -> _transport.Layout:
        return _transport.Layout(backend=backend, launcher=launcher, tp=tp, local_world=local_world, gpus=gpus_seen,
                                 peer_access=peer_access if gpus_seen >= 2 else True,
                                 symmetric_memory=symmetric_memory)

    table: dict[str, dict[str, Any]] = {}
    names, note = _transports_of(layout("virtual", 2, 1, min(gpu_count, 1)), (), multicast)
    table["virtual"] = {"layout": "virtual ranks in one process", "launcher": "virtual", "transports": names,
                        "note": note if has_gpu else f"{note} (CPU model; no CUDA GPU)"}
    names, note = _transports_of(layout("torchrun", 2, 2, min(gpu_count, 1)), (), multicast)
    table["shared_gpu"] = {
        "layout": "processes sharing one GPU" if has_gpu else "processes on the host (CPU model)",
        "launcher": "torchrun", "transports": names, "note": note if has_gpu else f"{note} (no CUDA GPU)",
    }
    several = f"needs at least two CUDA GPUs ({gpu_count} present)"
    if gpu_count >= 2:  # the layouts below exist only with two GPUs or more
        names, note = _transports_of(layout("torchrun", gpu_count, gpu_count, gpu_count), ("ipc", "multicast"),
                                     multicast)
    else:
        names, note = [], several
    table["distinct_gpus"] = {"layout": "processes on distinct GPUs", "launcher": "torchrun", "transports": names,
                              "note": note}
    if gpu_count >= 2:
        names, note = _transports_of(layout("torchrun", 2 * gpu_count, 2 * gpu_count, gpu_count), (), multicast)
    else:
        names, note = [], several
    table["shared_gpus"] = {"layout": "processes sharing several GPUs", "launcher": "torchrun", "transports": names,
                            "note": note}
    return table


def backends(info: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Which kernel backends can run: {"cpu": {...}, "cute": {...}}, each {"available", "reason"}."""
    gpu_list = info.get("gpus") or []
    cutlass = info.get("cutlass_dsl") or {}
    hopper = [gpu for gpu in gpu_list if (gpu.get("sm") or 0) >= CUTE_MIN_SM]
    if not gpu_list:
        cute = {"available": False, "reason": "no CUDA GPU"}
    elif not hopper:
        capabilities = ", ".join(sorted({str(gpu.get("capability")) for gpu in gpu_list}))
        cute = {"available": False, "reason": f"needs SM {CUTE_MIN_SM // 10}.{CUTE_MIN_SM % 10}+, found {capabilities}"}
    elif cutlass.get("importable") is not True:
        why = cutlass.get("error") or ("nvidia-cutlass-dsl not installed" if not cutlass.get("version") else "import not tried")
        cute = {"available": False, "reason": f"import cutlass failed: {why}"}
    else:
        cute = {"available": True, "reason": f"{len(hopper)} GPU(s) of SM {CUTE_MIN_SM // 10}.{CUTE_MIN_SM % 10}+, cutlass-dsl {cutlass.get('version')}"}
    return {"cpu": {"available": True, "reason": "CPU model, always available"}, "cute": cute}


def probe(try_cutlass_import: bool = True, query_nvidia_smi: bool = True) -> dict[str, Any]:
    """Everything musebench needs to know about this machine, as a JSON-native dict (see module doc)."""
    gpu_list = gpus()
    info: dict[str, Any] = {
        "torch": torch_status(),
        "cutlass_dsl": cutlass_status(try_cutlass_import),
        "cuda_python": _distribution_version("cuda-bindings", "cuda-python"),
        "gpus": gpu_list,
        "p2p": p2p_matrix(len(gpu_list)),
        "fabric": fabric(gpu_list, query_nvidia_smi),
    }
    info["multicast"] = multicast_status(len(gpu_list), active_nvlinks=info["fabric"]["active_nvlinks"])
    info["transports"] = transports(info)
    info["backends"] = backends(info)
    return info


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _yes_no(value: Any) -> Text:
    if value is None:
        return Text("—", style="dim")
    return Text("yes", style="green") if value else Text("no", style="red")


def _gib(value: Any) -> str:
    return f"{value / 2**30:.1f}" if isinstance(value, (int, float)) else "—"


def render_probe(info: Mapping[str, Any], console: Console) -> None:
    """Print a `probe()` dict as rich tables: software, GPUs, P2P, multicast/fabric, transports, backends.

    Reads only what is present, so a probe dict loaded from JSON of an older musebench renders too.
    """
    torch_info = info.get("torch") or {}
    cutlass = info.get("cutlass_dsl") or {}
    software = Table(title=Text("software"), header_style="bold")
    software.add_column("component")
    software.add_column("version")
    software.add_column("detail")
    software.add_row(
        Text("torch"),
        Text(str(torch_info.get("version") or "—")),
        Text(
            f"CUDA build {torch_info.get('cuda_build') or 'none'}; "
            f"CUDA available: {'yes' if torch_info.get('cuda_available') else 'no'}; "
            f"SymmetricMemory: {'yes' if torch_info.get('symmetric_memory') else 'no'}"
            + (f"; {torch_info['error']}" if torch_info.get("error") else "")
        ),
    )
    importable = cutlass.get("importable")
    cutlass_detail = {True: "import cutlass: ok", False: f"import cutlass: failed ({cutlass.get('error')})", None: "import not tried"}
    software.add_row(
        Text("cutlass-dsl"), Text(str(cutlass.get("version") or "not installed")), Text(cutlass_detail.get(importable, ""))
    )
    software.add_row(Text("cuda-python"), Text(str(info.get("cuda_python") or "not installed")), Text(""))
    console.print(software)

    gpu_list = info.get("gpus") or []
    if gpu_list:
        gpu_table = Table(title=Text("GPUs"), header_style="bold")
        for column, justify in (("#", "right"), ("name", "left"), ("SM", "right"), ("SMs", "right"), ("GiB", "right")):
            gpu_table.add_column(column, justify=justify)
        for gpu in gpu_list:
            gpu_table.add_row(
                Text(str(gpu.get("index"))),
                Text(str(gpu.get("name") or gpu.get("error") or "—")),
                Text(str(gpu.get("capability") or "—")),
                Text(str(gpu.get("sm_count") or "—")),
                Text(_gib(gpu.get("memory_bytes"))),
            )
        console.print(gpu_table)
    else:
        console.print(Text("GPUs: no CUDA GPU visible", style="yellow"))

    p2p = info.get("p2p") or []
    if len(p2p) >= 2:
        p2p_table = Table(title=Text("P2P access (row reads column)"), header_style="bold")
        p2p_table.add_column("")
        for j in range(len(p2p)):
            p2p_table.add_column(str(j), justify="center")
        for i, row in enumerate(p2p):
            cells = [Text("·", style="dim") if ok is None else Text("✓", style="green") if ok else Text("✗", style="red") for ok in row]
            p2p_table.add_row(Text(str(i)), *cells)
        console.print(p2p_table)

    multicast = info.get("multicast") or {}
    fabric_info = info.get("fabric") or {}
    links = Table(title=Text("multicast and fabric"), header_style="bold")
    links.add_column("item")
    links.add_column("value")
    links.add_column("detail")
    links.add_row(Text("multicast allowed"), _yes_no(multicast.get("allowed")), Text(", ".join(multicast.get("forbidden_by") or [])))
    links.add_row(Text("multicast supported"), _yes_no(multicast.get("supported")), Text(str(multicast.get("note") or "")))
    nvlinks = fabric_info.get("active_nvlinks")
    links.add_row(
        Text("active NVLinks per GPU"),
        Text(" ".join("?" if n is None else str(n) for n in nvlinks) if nvlinks else "—"),
        Text(str(fabric_info.get("note") or fabric_info.get("source") or "")),
    )
    handles = fabric_info.get("handles") or {}
    links.add_row(Text("fabric handles (across hosts)"), _yes_no(handles.get("usable") if handles else None),
                  Text(str(handles.get("note") or "")))
    console.print(links)

    transport_table = Table(title=Text("mailbox transports by launch layout"), header_style="bold")
    transport_table.add_column("layout")
    transport_table.add_column("launcher")
    transport_table.add_column("transports")
    transport_table.add_column("note")
    for entry in (info.get("transports") or {}).values():
        names = entry.get("transports") or []
        transport_table.add_row(
            Text(str(entry.get("layout", ""))),
            Text(str(entry.get("launcher", ""))),
            Text(", ".join(names), style="green") if names else Text("none", style="red"),
            Text(str(entry.get("note") or "")),
        )
    console.print(transport_table)

    backend_table = Table(title=Text("backends"), header_style="bold")
    backend_table.add_column("backend")
    backend_table.add_column("runs")
    backend_table.add_column("reason")
    for name, entry in (info.get("backends") or {}).items():
        backend_table.add_row(Text(name), _yes_no(entry.get("available")), Text(str(entry.get("reason") or "")))
    console.print(backend_table)
