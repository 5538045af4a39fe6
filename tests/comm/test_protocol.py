"""The Lamport protocol's constants: written once (musebench/comm/protocol.py), and what they mean.

The scan reads every module of musebench/ and scripts/ as source (AST, nothing imported): no
module but protocol.py assigns a protocol name, imports one from anywhere but protocol.py, or
builds a mailbox shape from LAMPORT_GENERATIONS. The protocol's names are protocol.py's own
module-level assignments, so a constant added there is covered at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from musebench import config
from musebench.comm import protocol

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "musebench" / "comm" / "protocol.py"
MODULE = "musebench.comm.protocol"


def _protocol_names() -> set[str]:
    tree = ast.parse(PROTOCOL.read_text())
    return {target.id for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def _assigned(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _assigned(element)]
    if isinstance(target, ast.Starred):
        return _assigned(target.value)
    return []


def _named(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def violations(source: str, names: set[str]) -> list[str]:
    """Where `source` (a module other than protocol.py) defines a protocol name itself."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            targets = [node.target]
        for target in targets:
            for name in _assigned(target):
                if name in names:
                    found.append(f"line {node.lineno}: assigns {name}")
        if isinstance(node, ast.ImportFrom) and node.module != MODULE:
            for alias in node.names:
                if (alias.asname or alias.name) in names or alias.name in names:
                    found.append(f"line {node.lineno}: imports {alias.name} from {node.module}, not {MODULE}")
        if isinstance(node, ast.Tuple) and node.elts and _named(node.elts[0]) == "LAMPORT_GENERATIONS":
            found.append(f"line {node.lineno}: builds a mailbox shape (use {MODULE}'s shape functions)")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and "LAMPORT_GENERATIONS" in (
                _named(node.left), _named(node.right)):
            found.append(f"line {node.lineno}: sizes a mailbox by hand (math.prod of a protocol shape)")
    return found


def _modules() -> list[Path]:
    paths = sorted((ROOT / "musebench").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    return [path for path in paths if path != PROTOCOL]


def test_no_module_but_protocol_defines_a_protocol_constant():
    names = _protocol_names()
    assert {"LAMPORT_GENERATIONS", "SENTINEL_BF16X2", "NEXT_STAGE", "FAULT_CLEAR", "STAGE_WORDS"} <= names
    modules = _modules()
    assert any(path.name == "ep_tail.py" for path in modules) and any(path.name == "lamport.py" for path in modules)
    found = {str(path.relative_to(ROOT)): hits for path in modules if (hits := violations(path.read_text(), names))}
    assert not found, f"protocol names defined outside {PROTOCOL.relative_to(ROOT)}: {found}"


@pytest.mark.parametrize("source", [
    "LAMPORT_GENERATIONS = 3",
    "class K:\n    FAULT_CLEAR: int = -1",
    "def f():\n    STAGE_WORDS, x = 2, 0",
    "from musebench.comm.lamport import SENTINEL_BF16_BITS",
    "from musebench.kernels.ep_tail import NEXT_STAGE as STAGE",
    "shape = (LAMPORT_GENERATIONS, tp, capacity, width)",
    "words = protocol.LAMPORT_GENERATIONS * tp * capacity * width",
])
def test_the_scan_catches_a_second_definition(source):
    assert violations(source, _protocol_names())


def test_the_scan_accepts_imports_and_uses():
    source = ("from musebench.comm.protocol import FAULT_CLEAR, NEXT_STAGE\nfrom musebench.comm import protocol\n"
              "x = (NEXT_STAGE + 1) % protocol.LAMPORT_GENERATIONS\nshape = protocol.ep_mailbox_shape(2, 4, 8)\n")
    assert violations(source, _protocol_names()) == []


def test_protocol_imports_nothing_heavy():
    imports = [node for node in ast.walk(ast.parse(PROTOCOL.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in imports)


def test_the_sentinels_are_bf16_negative_zero():
    half = torch.tensor([-0.0], dtype=torch.bfloat16).view(torch.int16)
    assert int(half) == protocol.SENTINEL_BF16_BITS and int(half) & 0xFFFF == protocol.SENTINEL_BF16
    pair = torch.tensor([-0.0, -0.0], dtype=torch.bfloat16).view(torch.int32)
    assert int(pair) == protocol.SENTINEL_WORD32_BITS and int(pair) & 0xFFFFFFFF == protocol.SENTINEL_BF16X2


def test_stage_and_fault_words_are_distinct_and_in_range():
    assert protocol.LAMPORT_GENERATIONS == 3
    assert protocol.NEXT_STAGE != protocol.ARRIVAL_COUNT == protocol.ACTIVE_STAGE
    assert {protocol.NEXT_STAGE, protocol.ARRIVAL_COUNT} == set(range(protocol.STAGE_WORDS))
    fields = (protocol.FAULT_RANK, protocol.FAULT_PEER, protocol.FAULT_WHERE, protocol.FAULT_GENERATION)
    assert sorted(fields) == list(range(protocol.FAULT_WORDS))
    assert protocol.STAGE_WORD_BYTES == protocol.FAULT_WORD_BYTES == torch.int32.itemsize
    # the token slot follows every route of a token and fits the TP encoding token * FAULT_SLOTS + slot
    assert config.TOP_K <= protocol.TOKEN_SLOT < protocol.FAULT_SLOTS
    assert protocol.FAULT_CLEAR < 0  # no rank


def test_mailbox_shapes():
    assert protocol.mailbox_shape(2, 5, 7) == (3, 2, 5, 7)
    assert protocol.ep_mailbox_shape(8, 4, 4096) == (3, 8, 4, 4096)
    assert protocol.tp_route_mailbox_shape(4, 3, 4096, 8) == (3, 4, 24, 4096)
    assert protocol.tp_token_mailbox_shape(3, 4096, fp32_rows=True) == (3, 1, 3, 8192)
    assert protocol.tp_token_mailbox_shape(3, 4096, fp32_rows=False) == (3, 1, 3, 4096)


def test_a_fault_record_reads_back_as_rank_peer_where_generation():
    from musebench.comm import protocol

    clear = [protocol.FAULT_CLEAR] * protocol.FAULT_WORDS
    assert protocol.read_fault_record(clear) is None
    words = list(clear)
    words[protocol.FAULT_RANK], words[protocol.FAULT_PEER] = 3, 1
    words[protocol.FAULT_WHERE], words[protocol.FAULT_GENERATION] = 37, 2
    assert protocol.read_fault_record(words) == (3, 1, 37, 2)
    with pytest.raises(ValueError, match="a fault record has 4 words, got 3"):
        protocol.read_fault_record(words[:3])
