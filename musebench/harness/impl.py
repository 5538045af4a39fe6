"""The implementation under test (`--impl`): a module that provides the seeds' API.

`musebench` (the default) is this package's kernels; any importable module path works that
provides the seeds' modules, found as `<path>.kernels.tail` / `.kernels.routing` (musebench's
layout), `<path>.cutedsl.moe.tail` / `.cutedsl.moe.routing` (vLLM's
`vllm.models.muse_spark.nvidia.specialized_decode`), or `<path>.tail` / `<path>.routing` (a flat
module, as the tests' re-export and fault modules are). Case families build a rank's runner only
through these names (`MoETail`, `TpTail`, `bind`, `BoundTail.run`; `routing.route`,
`prepare`, `metadata_size`), so the same harness checks musebench's kernels and the production
ones.

musebench's own API goes beyond the seeds' and the harness uses that where the module has it:
mailboxes given by the harness (`mailbox=` / `routes=` / `tokens=`: virtual ranks share one GPU
without a process group, and `comm.transport` decides unicast / IPC), the spin bound
(`timeout_ns=`), the single-launch EP tail (`single_launch=`), the TP stock's SM count (`nsm=`),
and `check_fault()` / `launch_demands(m)` / `run_publisher` on the bound tail. A module without
them (vLLM's) allocates its own mailboxes over the process group, so it needs the process
launcher: `require_process_group` says so before anything launches.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any

DEFAULT_IMPL = "musebench"
_LAYOUTS = (("kernels.tail", "kernels.routing"), ("cutedsl.moe.tail", "cutedsl.moe.routing"), ("tail", "routing"))


class ImplError(ValueError):
    """The implementation module cannot serve this run (raised before anything launches)."""


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and (name == error.name or name.startswith(error.name + ".")):
            return None
        raise


@dataclass(frozen=True)
class Impl:
    """The seeds' modules of one implementation: `tail` and `routing` (either may be None when the
    module provides only one of them; a case of the other family then refuses)."""

    path: str
    tail: ModuleType | None
    routing_module: ModuleType | None

    @property
    def own_mailboxes(self) -> bool:
        """Whether its tails take the harness's mailboxes (musebench's extension of the seeds)."""
        return self.tail is not None and "mailbox" in inspect.signature(self.tail.MoETail).parameters

    def require_tail(self) -> ModuleType:
        if self.tail is None:
            raise ImplError(f"--impl {self.path} provides no MoE tail module (tail, cutedsl.moe.tail or kernels.tail)")
        return self.tail

    def routing(self) -> ModuleType:
        if self.routing_module is None:
            raise ImplError(f"--impl {self.path} provides no routing module (routing, cutedsl.moe.routing or "
                            "kernels.routing)")
        return self.routing_module

    def require_process_group(self, launcher: str) -> None:
        """ImplError where the module's tails need a process group the launcher does not have."""
        if self.tail is not None and not self.own_mailboxes and launcher == "virtual":
            raise ImplError(f"--impl {self.path} allocates its own mailboxes over a process group: "
                            "use --launcher torchrun")

    def _extras(self, cls: Any, **candidates: Any) -> dict[str, Any]:
        accepted = inspect.signature(cls).parameters
        return {key: value for key, value in candidates.items() if key in accepted and value is not None}

    def ep_tail(self, case: Any, rank: int, box: Any, inputs: Any, options: Any) -> Any:
        """This rank's EP tail bound to the case's post-expert norm (compiles; before capture)."""
        import torch

        tail = self.require_tail()
        device = torch.device("cuda", torch.cuda.current_device())
        extras = self._extras(tail.MoETail, mailbox=box, timeout_ns=int(options.timeout_s * 1e9),
                              single_launch=options.ep_launch == "single")
        if options.ep_launch == "single" and "single_launch" not in extras:
            raise ImplError(f"--impl {self.path} has no single-launch EP tail")
        capacity = box.capacity if box is not None else max(case.tokens, 1)
        moe = tail.MoETail(_group(box), tp=case.tp, rank=rank, device=device, capacity=capacity, **extras)
        return _Bound(moe, _bind(moe, case, inputs, device), _weight_dtype(case))

    def tp_tail(self, case: Any, rank: int, routes: Any, tokens: Any, inputs: Any, options: Any) -> Any:
        """This rank's TP tail bound to the case's norm, compiled for the case's token count."""
        import torch

        tail = self.require_tail()
        device = torch.device("cuda", torch.cuda.current_device())
        capacity = tokens.capacity if tokens is not None else max(case.tokens, 1)
        extras = self._extras(tail.TpTail, routes=routes, tokens=tokens, timeout_ns=int(options.timeout_s * 1e9),
                              nsm=options.nsm)
        batches = (max(1, min(case.tokens, capacity)),)
        moe = tail.TpTail(_group(routes), tp=case.tp, rank=rank, device=device, capacity=capacity, batches=batches,
                          **extras)
        return _Bound(moe, _bind(moe, case, inputs, device), _weight_dtype(case))


def _weight_dtype(case: Any) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[case.weight_dtype]


def _bind(tail: Any, case: Any, inputs: Any, device: Any) -> Any:
    """`tail.bind(norm)`, compiling only the case's route-weight dtype where the module can
    (musebench's `weight_dtypes=`; the seeds' bind compiles both)."""
    norm = post_expert_norm(case, inputs, device)
    if "weight_dtypes" in inspect.signature(tail.bind).parameters:
        return tail.bind(norm, weight_dtypes=(_weight_dtype(case),))
    return tail.bind(norm)


class _Bound:
    """A bound tail with musebench's extras looked up on the bound tail, then on its owner."""

    def __init__(self, owner: Any, bound: Any, weight_dtype: Any) -> None:
        self.owner, self.bound, self.weight_dtype = owner, bound, weight_dtype

    def run(self, unfinalized: Any, out: Any) -> None:
        self.bound.run(unfinalized, out)

    def launch_demands(self, m: int) -> list:
        """The case's launches (its own route-weight dtype's publisher) for the co-residency check."""
        demands = getattr(self.bound, "launch_demands", None)
        if demands is None:
            return []
        try:
            return demands(m, weight_dtype=self.weight_dtype)
        except TypeError:  # a module whose launch_demands takes m alone
            return demands(m)

    def __getattr__(self, name: str) -> Any:  # check_fault, launch_demands, run_publisher where present
        for holder in (self.bound, self.owner):
            if hasattr(holder, name):
                return getattr(holder, name)
        raise AttributeError(name)


def _group(box: Any) -> Any:
    """The process group a tail without given mailboxes allocates over (None with given ones)."""
    if box is not None:
        return None
    import torch.distributed as dist

    return dist.group.WORLD


def post_expert_norm(case: Any, inputs: Any, device: Any) -> Any:
    """The seeds' `norm` argument for a tail case: the post-expert RMSNorm it was drawn with."""
    from musebench.layout import PostExpertNorm

    return PostExpertNorm(hidden_size=case.width, variance_size_override=None, variance_epsilon=case.eps,
                          fused_gain_center=case.gain_center, applies_weight_before_norm=case.weight_before_norm,
                          has_weight=True, weight=inputs.norm_weight.to(device))


def _resolve(root: ModuleType, path: str, dotted: str) -> ModuleType | None:
    """`path.dotted` as a submodule, else as attributes of the root (a module re-exporting them)."""
    found = _import(f"{path}.{dotted}") if hasattr(root, "__path__") else None
    if found is not None:
        return found
    holder: Any = root
    for part in dotted.split("."):
        holder = getattr(holder, part, None)
        if holder is None:
            return None
    return holder if isinstance(holder, ModuleType) else None


def load_impl(path: str = DEFAULT_IMPL) -> Impl:
    """The implementation at module `path`; ImplError (before anything launches) if it cannot be
    imported or provides neither a tail nor a routing module."""
    root = _import(path)
    if root is None:
        raise ImplError(f"--impl {path}: no such module")
    for tail_name, routing_name in _LAYOUTS:
        tail, routing = _resolve(root, path, tail_name), _resolve(root, path, routing_name)
        if tail is not None or routing is not None:
            return Impl(path, tail, routing)
    raise ImplError(f"--impl {path} provides none of the seeds' modules (tail / routing under kernels., "
                    "cutedsl.moe. or the module itself)")


CUTE_OPS_LAYOUTS = ("cute_ops", "runtime.cute_ops", "")  # musebench's, vLLM's specialized_decode's, flat


def cute_ops_with(impl: Any, *names: str) -> ModuleType:
    """The implementation's runtime entry points (the seeds' `cute_ops`): the first of
    `<path>.cute_ops`, `<path>.runtime.cute_ops` and `<path>` itself that has every one of `names`
    (`impl`: an `Impl` or a module path). ImplError naming what is missing, before anything
    launches (the attention families and their jobs ask it)."""
    path = getattr(impl, "path", impl)
    for layout in CUTE_OPS_LAYOUTS:
        module = _import(f"{path}.{layout}" if layout else path)
        if module is not None and all(hasattr(module, name) for name in names):
            return module
    raise ImplError(f"--impl {path} provides no {' / '.join(names)} (cute_ops)")
