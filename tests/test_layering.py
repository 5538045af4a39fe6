"""musebench's import layering, read off the source (AST), plus one live import check.

Layers, bottom up: config level (config, layout, numerics, routing_metadata, attn2_layout,
tp_dispatch) and the stock references (stock/*) import nothing from kernels/, cpu/ (the kernels'
models), cute_ops (the seeds' API, which launches them), cases/, harness/ or the CLI (the
references must not depend on the device code they check: the GPU's approximate instructions are
injected from above, `kernels.approx.hardware_approximations`); kernels/ imports nothing from
stock/, cpu/, cases/, harness/ or the CLI; comm/ imports nothing from harness/ or kernels/; and no module-level import cycle.

The graph keeps module-level imports (run at import time; `if TYPE_CHECKING:` blocks excluded)
apart from imports inside functions (run at call time). The layer rules count both; the cycle
rule counts module-level imports, and a second cycle rule counts both. A rule instance that
fails because of code outside the numerics work is marked xfail(strict=True) with its reason:
when that code is fixed the xfail turns into a failure, and the mark goes.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "musebench"

CONFIG_LEVEL = ("musebench.config", "musebench.layout", "musebench.numerics", "musebench.routing_metadata",
                "musebench.attn2_layout",
                "musebench.tp_dispatch")
# What the references check (kernels/, their CPU models under cpu/, the seeds' API in cute_ops that
# launches them) and what runs the checks (cases/, harness/, the CLI): a reference imports none of it.
ABOVE_CONFIG = ("musebench.kernels", "musebench.cpu", "musebench.cute_ops", "musebench.cases", "musebench.harness",
                "musebench.cli")
ABOVE_KERNELS = ("musebench.stock", "musebench.cpu", "musebench.cases", "musebench.harness", "musebench.cli")
ABOVE_COMM = ("musebench.harness", "musebench.kernels")
# The case families sit under the driver: they take the protocol and the checks, never what runs them.
ABOVE_CASES = ("musebench.harness.driver", "musebench.harness.launch", "musebench.harness.worker",
               "musebench.harness.jobs", "musebench.cli")
# The harness's lower modules (what the families import) never reach back up to the families.
HARNESS_BELOW_CASES = ("musebench.harness.case", "musebench.harness.measure", "musebench.harness.checks",
                       "musebench.harness.results")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> set[str]:
    """The musebench modules an import statement loads (a `from X import name` loads X.name when
    that is a module, else X)."""
    known = modules()
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = module.split(".")
        if not modules()[module].name == "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    found = set()
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            found.add(f"{base}.{alias.name}")
        elif base in known:
            found.add(base)
    return found


@lru_cache(maxsize=None)
def imports() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """module -> (musebench modules imported at module level, those imported inside functions)."""
    graph = {}
    for module, path in modules().items():
        top: set[str] = set()
        inner: set[str] = set()

        def visit(node: ast.AST, in_function: bool, into_top=top, into_inner=inner, module=module) -> None:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                (into_inner if in_function else into_top).update(_targets(node, module))
                return
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.orelse:
                    visit(child, in_function)
                return
            nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, nested)

        visit(ast.parse(path.read_text(), str(path)), False)
        top.discard(module)
        inner.discard(module)
        graph[module] = (frozenset(top), frozenset(inner - top))
    return graph


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _bad_imports(module: str, forbidden: tuple[str, ...]) -> list[str]:
    top, inner = imports()[module]
    return sorted(f"{target} (module level)" for target in top if _under(target, forbidden)) + sorted(
        f"{target} (inside a function)" for target in inner if _under(target, forbidden))


def _cycle_members(with_function_imports: bool) -> dict[str, list[str]]:
    """module -> the other members of its strongly connected component, for components > 1."""
    graph = {m: set(top) | (set(inner) if with_function_imports else set()) for m, (top, inner) in imports().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    members: dict[str, list[str]] = {}
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                for w in component:
                    members[w] = sorted(set(component) - {w})

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return members


def _xfail(params: list[str], known: dict[str, str]) -> list:
    return [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=known[p])) if p in known else p for p in params]


def _modules_under(*prefixes: str) -> list[str]:
    return [m for m in modules() if _under(m, prefixes)]


# Rule instances that fail today, each with its reason (none: every rule holds).
KNOWN_CONFIG_LEVEL: dict[str, str] = {}
KNOWN_KERNELS: dict[str, str] = {}
KNOWN_COMM: dict[str, str] = {}
KNOWN_MODULE_CYCLES: dict[str, str] = {}
KNOWN_FUNCTION_CYCLES: dict[str, str] = {}


@pytest.mark.parametrize("module", _xfail(_modules_under("musebench.stock", *CONFIG_LEVEL), KNOWN_CONFIG_LEVEL))
def test_references_and_config_level_import_nothing_above_them(module):
    assert _bad_imports(module, ABOVE_CONFIG) == []


@pytest.mark.parametrize("module", _xfail(_modules_under("musebench.kernels"), KNOWN_KERNELS))
def test_kernels_import_neither_stock_nor_harness_nor_cli(module):
    assert _bad_imports(module, ABOVE_KERNELS) == []


@pytest.mark.parametrize("module", _xfail(_modules_under("musebench.comm"), KNOWN_COMM))
def test_comm_imports_neither_harness_nor_kernels(module):
    assert _bad_imports(module, ABOVE_COMM) == []


@pytest.mark.parametrize("module", _modules_under("musebench.cases"))
def test_case_families_import_nothing_that_runs_them(module):
    assert _bad_imports(module, ABOVE_CASES) == []


@pytest.mark.parametrize("module", HARNESS_BELOW_CASES)
def test_the_protocol_and_the_checks_import_no_family_and_no_driver(module):
    assert _bad_imports(module, ("musebench.cases", *ABOVE_CASES)) == []


@pytest.mark.parametrize("module", _xfail(sorted(modules()), KNOWN_MODULE_CYCLES))
def test_no_module_level_import_cycle(module):
    assert _cycle_members(with_function_imports=False).get(module, []) == []


@pytest.mark.parametrize("module", _xfail(sorted(modules()), KNOWN_FUNCTION_CYCLES))
def test_no_import_cycle_through_imports_inside_functions(module):
    assert _cycle_members(with_function_imports=True).get(module, []) == []


def test_the_checker_sees_imports_at_both_levels():
    """The graph is not vacuous: known edges of each kind are found."""
    top, inner = imports()["musebench.stock.tp"]
    assert "musebench.numerics" in top and "musebench.tp_dispatch" in top
    top, inner = imports()["musebench.harness.driver"]
    assert "musebench.kernels.approx" in inner and "musebench.harness.measure" in top
    top, _ = imports()["musebench.kernels.ep_tail"]
    assert "musebench.layout" not in top  # under `if TYPE_CHECKING:` only
    assert _under("musebench.kernels.approx", ABOVE_CONFIG) and not _under("musebench.kernelsx", ABOVE_CONFIG)


def test_a_reference_may_not_reach_the_kernels_through_the_api_or_the_models():
    """cute_ops imports the kernels inside its functions and cpu/ models them: a reference that
    imported either would depend on what it checks, so the rule names them (and the families)."""
    for above in ("musebench.cute_ops", "musebench.cpu.attn2", "musebench.cpu.tail", "musebench.cases.qkv_front"):
        assert _under(above, ABOVE_CONFIG), above
    for above in ("musebench.cpu.attn2", "musebench.cases.attn2", "musebench.stock.attn2"):
        assert _under(above, ABOVE_KERNELS), above
    assert "musebench.stock.attn2" in _modules_under("musebench.stock")  # the new references are ruled too
    assert "musebench.stock.qkv_front" in _modules_under("musebench.stock")
    assert "musebench.stock.triton_qkv_epilogue" in _modules_under("musebench.stock")
    assert "musebench.stock.all_reduce" in _modules_under("musebench.stock")
    assert "musebench.stock.read_floor" in _modules_under("musebench.stock")
    assert "musebench.attn2_layout" in _modules_under("musebench.stock", *CONFIG_LEVEL)


def test_importing_the_references_loads_no_kernel_code():
    """Every module under musebench/stock and musebench.numerics, imported in a fresh interpreter,
    leaves musebench.kernels (and cutlass) unloaded."""
    names = sorted(_modules_under("musebench.stock")) + ["musebench.numerics"]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'musebench.kernels' or m.startswith('musebench.kernels.')"
            " or m == 'cutlass' or m.startswith('musebench.harness')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
