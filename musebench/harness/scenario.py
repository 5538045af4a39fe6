"""Scenario files (`scenarios/*.toml`): named runs of tail and routing cases, validated before anything runs.

Format: an optional `[defaults]` table and one `[[run]]` table per run; a run's keys override the
defaults. `kernel` picks the run's kind and with it the keys it takes. Keys (lists may be given as
a single value):

    every run
    name      str          label of the run
    kernel    "tail" | "routing"   (default "tail")
    tp        [int]        each 2..32; one job per tp
    inputs    ["random","adversarial"]
    seeds     [int]
    backend   "auto" | "cpu" | "cute"

    kernel = "tail" (the EP and TP tails; defaults in `_TAIL_DEFAULTS`)
    modes     ["ep","tp"]
    tokens    [int]        each 1..capacity
    capacity  int          mailbox capacity in tokens (default 8)
    weights   ["bf16","fp32"]
    norm      ["before","after"]
    launcher  "virtual" | "torchrun"
    transport "auto" | "local" | "ipc" | "unicast" | "multicast"   (musebench.comm.transport decides or refuses)
    ep_launch "two" | "single"   the cute EP tail as two kernels (default) or one
    iters, warmup  int;  timeout  float seconds;  nsm  int

    kernel = "routing" (`musebench routing`'s options; defaults in `_ROUTING_DEFAULTS`: tp 8,
    tokens 1..8, tile 8, renormalize true, inputs random and adversarial, seed 0, backend auto)
    tokens       [int]     each 1..8 (the decode batch)
    tile         [int]     GEMM tile sizes of the metadata, each 1..256
    renormalize  [bool]    true: weights renormalized over the top-8; false: raw scores x scale

A routing run runs on virtual ranks of one GPU (every rank routes for its own expert range) and
needs a GPU with SM >= 90 and CuTe DSL: `backend = "auto"` skips it elsewhere (reported as
skipped, never as passed), `"cpu"` always skips it (routing has no CPU model), `"cute"` refuses to
start without one.

`[defaults]` may hold the keys of both kinds; each run takes the ones its kernel has. A key of
the other kind written in a run itself (`weights` in a routing run, `tile` in a tail run), an
unknown key, a wrong type or a value out of range is a `ScenarioError` naming the file, the run
and the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from musebench import config
from musebench.comm.transport import REQUESTS
from musebench.cases.tail_inputs import EP_LAUNCHES, INPUT_FAMILIES, MODES, NORM_ORDERS, ROUTING_INPUT_FAMILIES, WEIGHT_DTYPES
from musebench.routing_metadata import TILE_N_MAX

MIN_TP, MAX_TP = 2, 32
DEFAULT_CAPACITY = 8
ROUTING_MAX_TOKENS = config.MAX_DECODE_TOKENS  # the routing kernel: one warp per token

_LIST_KEYS = {
    "modes": (str, MODES),
    "tp": (int, None),
    "tokens": (int, None),
    "weights": (str, tuple(WEIGHT_DTYPES)),
    "norm": (str, NORM_ORDERS),
    "inputs": (str, INPUT_FAMILIES),
    "seeds": (int, None),
    "tile": (int, None),
    "renormalize": (bool, None),
}
_SCALAR_KEYS = {
    "name": str,
    "kernel": str,
    "capacity": int,
    "launcher": str,
    "backend": str,
    "transport": str,
    "ep_launch": str,
    "iters": int,
    "warmup": int,
    "timeout": (int, float),
    "nsm": int,
}
_CHOICES = {
    "kernel": ("tail", "routing"),
    "launcher": ("virtual", "torchrun"),
    "backend": ("auto", "cpu", "cute"),
    "transport": REQUESTS,
    "ep_launch": EP_LAUNCHES,
}
_COMMON_KEYS = frozenset({"name", "kernel", "tp", "inputs", "seeds", "backend"})
_KERNEL_KEYS = {
    "tail": _COMMON_KEYS | {"modes", "tokens", "capacity", "weights", "norm", "launcher", "transport", "iters",
                            "warmup", "timeout", "nsm", "ep_launch"},
    "routing": _COMMON_KEYS | {"tokens", "tile", "renormalize"},
}
_TAIL_DEFAULTS: dict[str, Any] = {
    "kernel": "tail",
    "modes": ["ep", "tp"],
    "tp": [8],
    "tokens": list(range(1, 9)),
    "capacity": DEFAULT_CAPACITY,
    "weights": ["bf16", "fp32"],
    "norm": ["before", "after"],
    "inputs": ["random"],
    "seeds": [0],
    "launcher": "virtual",
    "backend": "auto",
    "transport": "auto",
    "ep_launch": "two",
    "iters": 3,
    "warmup": 1,
    "timeout": 10.0,
}
# what `musebench routing` runs with no options
_ROUTING_DEFAULTS: dict[str, Any] = {
    "kernel": "routing",
    "tp": [8],
    "tokens": list(range(1, ROUTING_MAX_TOKENS + 1)),
    "tile": [8],
    "renormalize": [True],
    "inputs": ["random", "adversarial"],
    "seeds": [0],
    "backend": "auto",
}


# Keys that are gone, with why: a file that still names one fails with the reason, not "unknown key".
_REMOVED_KEYS = {
    "stock": "runs are checked against musebench's bitwise references (stock/) only: the flashinfer stock option "
             "was removed, since FlashInfer's stock kernels need SM100 with NVLink multicast and never ran here",
}


class ScenarioError(ValueError):
    pass


def _refuse_removed(where: str, table: dict[str, Any]) -> None:
    for key in sorted(set(table) & set(_REMOVED_KEYS)):
        raise ScenarioError(f"{where}: key {key!r} was removed: {_REMOVED_KEYS[key]}")


@dataclass(frozen=True)
class ScenarioRun:
    """One validated tail run of a scenario file."""

    source: str
    name: str
    kernel: str
    modes: tuple[str, ...]
    tp: tuple[int, ...]
    tokens: tuple[int, ...]
    capacity: int
    weights: tuple[str, ...]
    norm: tuple[str, ...]
    inputs: tuple[str, ...]
    seeds: tuple[int, ...]
    launcher: str
    backend: str
    transport: str
    iters: int
    warmup: int
    timeout: float
    nsm: int | None
    ep_launch: str = "two"


@dataclass(frozen=True)
class RoutingScenarioRun:
    """One validated routing run of a scenario file (`kernel = "routing"`)."""

    source: str
    name: str
    kernel: str
    tp: tuple[int, ...]
    tokens: tuple[int, ...]
    tile: tuple[int, ...]
    renormalize: tuple[bool, ...]
    inputs: tuple[str, ...]
    seeds: tuple[int, ...]
    backend: str


def validate_tp(tp: int) -> None:
    if not MIN_TP <= tp <= MAX_TP:
        raise ValueError(f"tp must be in {MIN_TP}..{MAX_TP}, got {tp}")


def _validate_token_counts(tokens: tuple[int, ...], most: int, bound: str) -> None:
    bad = [m for m in tokens if not 1 <= m <= most]
    if bad:
        raise ValueError(f"tokens must be in 1..{most} ({bound}), got {bad}")
    if not tokens:
        raise ValueError("no tokens given")


def validate_tokens(tokens: tuple[int, ...], capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    _validate_token_counts(tokens, capacity, "the mailbox capacity")


def validate_routing_tokens(tokens: tuple[int, ...]) -> None:
    _validate_token_counts(tokens, ROUTING_MAX_TOKENS, "the routing kernel's batch")


def validate_tiles(tiles: tuple[int, ...]) -> None:
    bad = [tile for tile in tiles if not 1 <= tile <= TILE_N_MAX]
    if bad:
        raise ValueError(f"tile must be in 1..{TILE_N_MAX}, got {bad}")


def _check_value(where: str, key: str, value: Any) -> Any:
    if key in _LIST_KEYS:
        kind, choices = _LIST_KEYS[key]
        items = value if isinstance(value, list) else [value]
        for item in items:
            # bool is an int subclass: true is not a tp, and 1 is not a renormalize flag
            if not isinstance(item, kind) or (kind is not bool and isinstance(item, bool)):
                raise ScenarioError(f"{where}: {key} must hold {kind.__name__} values, got {item!r}")
            if choices is not None and item not in choices:
                raise ScenarioError(f"{where}: {key} value {item!r} is not one of {', '.join(choices)}")
        if not items:
            raise ScenarioError(f"{where}: {key} is empty")
        return tuple(items)
    kind = _SCALAR_KEYS[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ScenarioError(f"{where}: {key} has the wrong type ({type(value).__name__})")
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ScenarioError(f"{where}: {key} {value!r} is not one of {', '.join(_CHOICES[key])}")
    return value


def _run_from(where: str, table: dict[str, Any], defaults: dict[str, Any], source: str,
              index: int) -> ScenarioRun | RoutingScenarioRun:
    _refuse_removed(where, table)
    unknown = sorted(set(table) - set(_LIST_KEYS) - set(_SCALAR_KEYS))
    if unknown:
        raise ScenarioError(f"{where}: unknown key {unknown[0]!r}")
    kernel = _check_value(where, "kernel", table.get("kernel", defaults.get("kernel", "tail")))
    foreign = sorted(set(table) - _KERNEL_KEYS[kernel])
    if foreign:
        other = "routing" if kernel == "tail" else "tail"
        raise ScenarioError(f"{where}: key {foreign[0]!r} belongs to {other} runs; a kernel = {kernel!r} run takes "
                            f"{', '.join(sorted(_KERNEL_KEYS[kernel]))}")
    # [defaults] may serve both kinds: a run takes the defaults its kernel has
    own_defaults = {key: value for key, value in defaults.items() if key in _KERNEL_KEYS[kernel]}
    base = _TAIL_DEFAULTS if kernel == "tail" else _ROUTING_DEFAULTS
    merged = {**base, **own_defaults, **table}
    values = {key: _check_value(where, key, merged[key]) for key in merged}
    if kernel == "routing":
        return _routing_run_from(where, values, source, index)
    try:
        for tp in values["tp"]:
            validate_tp(tp)
        validate_tokens(values["tokens"], values["capacity"])
    except ValueError as error:
        raise ScenarioError(f"{where}: {error}") from None
    if values["iters"] < 1 or values["warmup"] < 0 or values["timeout"] <= 0:
        raise ScenarioError(f"{where}: iters must be >= 1, warmup >= 0 and timeout > 0")
    return ScenarioRun(
        source=source, name=values.get("name", f"run {index}"), kernel=values["kernel"], modes=values["modes"],
        tp=values["tp"], tokens=values["tokens"], capacity=values["capacity"], weights=values["weights"],
        norm=values["norm"], inputs=values["inputs"], seeds=values["seeds"], launcher=values["launcher"],
        backend=values["backend"], transport=values["transport"], iters=values["iters"], warmup=values["warmup"], timeout=float(values["timeout"]),
        nsm=values.get("nsm"), ep_launch=values["ep_launch"],
    )


def _routing_run_from(where: str, values: dict[str, Any], source: str, index: int) -> RoutingScenarioRun:
    try:
        for tp in values["tp"]:
            validate_tp(tp)
        validate_routing_tokens(values["tokens"])
        validate_tiles(values["tile"])
        if set(values["inputs"]) - set(ROUTING_INPUT_FAMILIES):
            raise ValueError(f"routing inputs must be among {', '.join(ROUTING_INPUT_FAMILIES)}, got {list(values['inputs'])}")
    except ValueError as error:
        raise ScenarioError(f"{where}: {error}") from None
    return RoutingScenarioRun(
        source=source, name=values.get("name", f"run {index}"), kernel="routing", tp=values["tp"],
        tokens=values["tokens"], tile=values["tile"], renormalize=values["renormalize"], inputs=values["inputs"],
        seeds=values["seeds"], backend=values["backend"],
    )


def load_scenario(path: str | Path) -> list[ScenarioRun | RoutingScenarioRun]:
    """The runs of one scenario file, validated; ScenarioError on any defect."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenario file") from None
    except tomllib.TOMLDecodeError as error:
        raise ScenarioError(f"{path}: not valid TOML: {error}") from None
    unknown = sorted(set(data) - {"defaults", "run"})
    if unknown:
        raise ScenarioError(f"{path}: unknown table {unknown[0]!r} (expected [defaults] and [[run]])")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ScenarioError(f"{path}: [defaults] must be a table")
    _refuse_removed(f"{path} [defaults]", defaults)
    bad = sorted(set(defaults) - set(_LIST_KEYS) - set(_SCALAR_KEYS))
    if bad:
        raise ScenarioError(f"{path} [defaults]: unknown key {bad[0]!r}")
    for key, value in defaults.items():  # checked here too: a default no run takes is still read
        _check_value(f"{path} [defaults]", key, value)
    runs = data.get("run", [])
    if not isinstance(runs, list) or not runs:
        raise ScenarioError(f"{path}: no [[run]] tables")
    return [_run_from(f"{path} run {i + 1}", table, defaults, str(path), i + 1) for i, table in enumerate(runs)]
