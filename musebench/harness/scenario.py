"""Scenario files (`scenarios/*.toml`): named runs of tail cases, validated before anything runs.

Format: an optional `[defaults]` table and one `[[run]]` table per run; a run's keys override the
defaults. Keys (lists may be given as a single value):

    name      str          label of the run
    kernel    "tail"       (routing joins when its kernel lands)
    modes     ["ep","tp"]
    tp        [int]        each 2..32; one job per tp
    tokens    [int]        each 1..capacity
    capacity  int          mailbox capacity in tokens (default 8)
    weights   ["bf16","fp32"]
    norm      ["before","after"]
    inputs    ["random","adversarial"]
    seeds     [int]
    launcher  "virtual" | "torchrun"
    backend   "auto" | "cpu" | "cute"
    transport "auto" | "unicast" | "multicast"
    iters, warmup  int;  timeout  float seconds;  nsm  int

An unknown key, a wrong type or a value out of range is a `ScenarioError` naming the file, the
run and the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from musebench.harness.cases import INPUT_FAMILIES, MODES, NORM_ORDERS, WEIGHT_DTYPES

MIN_TP, MAX_TP = 2, 32
DEFAULT_CAPACITY = 8

_LIST_KEYS = {
    "modes": (str, MODES),
    "tp": (int, None),
    "tokens": (int, None),
    "weights": (str, tuple(WEIGHT_DTYPES)),
    "norm": (str, NORM_ORDERS),
    "inputs": (str, INPUT_FAMILIES),
    "seeds": (int, None),
}
_SCALAR_KEYS = {
    "name": str,
    "kernel": str,
    "capacity": int,
    "launcher": str,
    "backend": str,
    "transport": str,
    "iters": int,
    "warmup": int,
    "timeout": (int, float),
    "nsm": int,
}
_CHOICES = {
    "kernel": ("tail",),
    "launcher": ("virtual", "torchrun"),
    "backend": ("auto", "cpu", "cute"),
    "transport": ("auto", "unicast", "multicast"),
}
_DEFAULTS: dict[str, Any] = {
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
    "iters": 3,
    "warmup": 1,
    "timeout": 10.0,
}


class ScenarioError(ValueError):
    pass


@dataclass(frozen=True)
class ScenarioRun:
    """One validated run of a scenario file."""

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


def validate_tp(tp: int) -> None:
    if not MIN_TP <= tp <= MAX_TP:
        raise ValueError(f"tp must be in {MIN_TP}..{MAX_TP}, got {tp}")


def validate_tokens(tokens: tuple[int, ...], capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    bad = [m for m in tokens if not 1 <= m <= capacity]
    if bad:
        raise ValueError(f"tokens must be in 1..{capacity} (the mailbox capacity), got {bad}")
    if not tokens:
        raise ValueError("no tokens given")


def _check_value(where: str, key: str, value: Any) -> Any:
    if key in _LIST_KEYS:
        kind, choices = _LIST_KEYS[key]
        items = value if isinstance(value, list) else [value]
        for item in items:
            if not isinstance(item, kind) or isinstance(item, bool):
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


def _run_from(where: str, table: dict[str, Any], defaults: dict[str, Any], source: str, index: int) -> ScenarioRun:
    unknown = sorted(set(table) - set(_LIST_KEYS) - set(_SCALAR_KEYS))
    if unknown:
        raise ScenarioError(f"{where}: unknown key {unknown[0]!r}")
    merged = {**_DEFAULTS, **defaults, **table}
    values = {key: _check_value(where, key, merged[key]) for key in merged if key in _LIST_KEYS or key in _SCALAR_KEYS}
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
        nsm=values.get("nsm"),
    )


def load_scenario(path: str | Path) -> list[ScenarioRun]:
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
    bad = sorted(set(defaults) - set(_LIST_KEYS) - set(_SCALAR_KEYS))
    if bad:
        raise ScenarioError(f"{path} [defaults]: unknown key {bad[0]!r}")
    runs = data.get("run", [])
    if not isinstance(runs, list) or not runs:
        raise ScenarioError(f"{path}: no [[run]] tables")
    return [_run_from(f"{path} run {i + 1}", table, defaults, str(path), i + 1) for i, table in enumerate(runs)]
