"""The implementation under test (`--impl`): resolved from a module path before anything
launches; musebench's own API, a re-export of it and a wrong-on-one-rank module are found the
same way; modules that cannot serve a run are refused with the reason."""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("cutlass")

from musebench.harness.impl import DEFAULT_IMPL, ImplError, load_impl  # noqa: E402


def test_musebench_and_its_reexport_resolve_to_the_same_modules():
    own, again = load_impl(DEFAULT_IMPL), load_impl("tests.impls.reexport")
    assert own.tail is again.tail and own.routing() is again.routing()
    assert own.tail.__name__ == "musebench.kernels.tail" and own.own_mailboxes


def test_a_package_with_its_own_tail_module_is_found():
    impl = load_impl("tests.impls.flip_rank1")
    assert impl.tail.__name__ == "tests.impls.flip_rank1.tail"
    assert impl.routing().__name__ == "musebench.kernels.routing"


@pytest.mark.parametrize("path, message", [
    ("no.such.module", "no such module"),
    ("json", "provides none of the seeds' modules"),
])
def test_a_module_that_cannot_serve_is_refused(path, message):
    with pytest.raises(ImplError, match=message):
        load_impl(path)


def test_a_module_that_allocates_its_own_mailboxes_needs_processes(monkeypatch):
    """vLLM's tails take a process group and allocate their mailboxes themselves."""
    foreign = types.ModuleType("foreign_impl")
    foreign.tail = types.ModuleType("foreign_impl.tail")

    class MoETail:  # the seeds' signature: no mailbox argument
        def __init__(self, group, *, tp, rank, device, capacity=8, enable_pdl=True):
            pass

    foreign.tail.MoETail = MoETail
    monkeypatch.setitem(sys.modules, "foreign_impl", foreign)
    impl = load_impl("foreign_impl")
    assert not impl.own_mailboxes
    with pytest.raises(ImplError, match="allocates its own mailboxes over a process group: use --launcher torchrun"):
        impl.require_process_group("virtual")
    impl.require_process_group("torchrun")


def test_a_family_the_module_lacks_is_refused():
    routing_only = load_impl("musebench")
    empty = type(routing_only)("x", None, routing_only.routing())
    with pytest.raises(ImplError, match="provides no MoE tail module"):
        empty.require_tail()
