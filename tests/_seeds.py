"""Signature checks against the seeds' documented API (`../shared/seeds/`).

A seed signature is written in the tests as a literal list of (name, kind, default). musebench
may add parameters after the seed's, keyword-only and with a default, so a call written for the
seed's API works unchanged; it may not rename, reorder, retype or drop one.
"""

from __future__ import annotations

import inspect

EMPTY = inspect.Parameter.empty
POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
KW = inspect.Parameter.KEYWORD_ONLY


def parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def assert_seed_signature(function, seed: list[tuple[str, object, object]], *, extras: tuple[str, ...] = ()) -> None:
    """The seed's parameters first, exactly; then only `extras`, each keyword-only with a default."""
    got = parameters(function)
    assert got[: len(seed)] == seed, f"{function.__qualname__}: {got[: len(seed)]} != the seed's {seed}"
    added = got[len(seed):]
    assert tuple(name for name, _, _ in added) == extras, f"{function.__qualname__}: extra parameters {added}"
    for name, kind, default in added:
        assert kind is KW and default is not EMPTY, f"{function.__qualname__}: extra {name} must be keyword-only with a default"
