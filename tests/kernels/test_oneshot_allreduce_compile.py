"""The one-shot all-reduce compiles for sm_90a and sm_100a (no GPU needed), and its PTX says so.

Read off the emitted PTX, every variant (tp 2, 3, 8, 32; BF16 and FP32; PDL on and off):

- publish: one `st.relaxed.sys.global.v4.u32` per rank (strong stores into peers' memory), of the
  scrubbed words, after the generation is shared (one `bar.sync`);
- bounded waits: the one loop that polls holds tp `ld.volatile.global.v4.u32` and reads
  `%globaltimer`; nothing else loops;
- the sum: per element one chain of tp `add.rn.f32` from +0.0 over the slots in rank order, no
  other float arithmetic, nothing `.ftz` or packed; BF16 ends in 4 `cvt.rn.bf16x2.f32`;
- re-arm: exactly tp sentinel stores; one fault `atom.cas`; the generation protocol's one read,
  one release arrival and the acq_rel fence before the advance;
- PDL: `griddepcontrol.wait` before the input load, `.launch_dependents` after every store;
- ptxas (sm_90a, -O3): no spills.
"""

from __future__ import annotations

import functools
import tempfile

import pytest

from tests._ptxas import assemble, assert_no_spills

pytest.importorskip("cutlass")

from musebench.comm import protocol  # noqa: E402
from musebench.kernels import compilation  # noqa: E402
from musebench.kernels import oneshot_allreduce as oneshot  # noqa: E402
from tests.kernels.test_ep_tail_compile import (  # noqa: E402
    Origins,
    _operands,
    _ptx_text,
    assert_bounded_polling,
    assert_rounding_is_explicit,
    chains,
    count,
    instructions,
    loops,
    opcodes,
)

ARCHS = ("sm_90a", "sm_100a")
TPS = (2, 3, 8, 32)
WIDTH, CAPACITY = 4096, 8
SENTINEL_U32 = protocol.SENTINEL_BF16X2

_DUMP = tempfile.mkdtemp(prefix="musebench-ptx-")


@functools.lru_cache(maxsize=None)
def one_shot_ptx(arch: str, tp: int, dtype: str, pdl: bool = True) -> str:
    return _ptx_text(oneshot.compile_one_shot(tp=tp, capacity=CAPACITY, width=WIDTH, dtype=dtype, enable_pdl=pdl,
                                              timeout_ns=1_000_000_000, arch=arch, ptx_dir=_DUMP))


GRID = [pytest.param(arch, tp, dtype, id=f"{arch}-tp{tp}-{dtype}") for arch in ARCHS for tp in TPS
        for dtype in oneshot.DTYPES]


@pytest.mark.parametrize("arch, tp, dtype", GRID)
def test_one_shot_ptx(arch, tp, dtype):
    ptx = one_shot_ptx(arch, tp, dtype)
    ops = opcodes(ptx)

    # PDL: the input is read after the wait; the next kernel launches after every store.
    assert count(ptx, "griddepcontrol.wait") == count(ptx, "griddepcontrol.launch_dependents") == 1
    assert ops.index("griddepcontrol.wait") < ops.index("ld.global.v4.u32")
    assert ops.index("griddepcontrol.launch_dependents") > max(i for i, op in enumerate(ops) if op.startswith("st."))

    # Publish: one strong system-scope store per rank, after the barrier that shares the generation.
    assert count(ptx, "st.relaxed.sys.global.v4.u32") == tp
    assert count(ptx, "bar.sync") == 1
    barrier = ops.index("bar.sync")
    assert all(i > barrier for i, op in enumerate(ops) if op == "st.relaxed.sys.global.v4.u32")
    assert not any(op.startswith("multimem") for op in ops)

    # Bounded waits: one polling loop, tp volatile loads and the timer in it; no other loop.
    assert_bounded_polling(ptx)
    every_loop = loops(ptx)
    assert len(every_loop) == 1
    assert sum(1 for line in every_loop[0] if line.startswith("ld.volatile.global.v4.u32")) == tp
    assert count(ptx, "ld.volatile.global.v4.u32") == tp
    first_poll = ops.index("ld.volatile.global.v4.u32")
    assert max(i for i, op in enumerate(ops) if op == "st.relaxed.sys.global.v4.u32") < first_poll

    # The generation protocol: one read of NEXT_STAGE and one release arrival before the barrier;
    # the fence and the advance (two word stores) after every data store.
    assert count(ptx, "ld.volatile.global.u32") == 1 and count(ptx, "atom.release.gpu.global.add.u32") == 1
    assert ops.index("ld.volatile.global.u32") < ops.index("atom.release.gpu.global.add.u32") < barrier
    fence = ops.index("fence.acq_rel.gpu")
    assert count(ptx, "fence.acq_rel.gpu") == 1
    assert fence > max(i for i, op in enumerate(ops) if op.startswith(("st.global.v4", "atom.relaxed")))
    assert [op for op in ops[fence:] if op.startswith("st.")] == ["st.global.u32", "st.global.u32"]

    # Rank-order sums from +0.0, add.rn only.
    assert_rounding_is_explicit(ptx, approximate=set())
    assert not any(op.startswith(("fma.", "mul.", "rsqrt", "div.", "sub.")) for op in ops if ".f32" in op)
    lanes = 8 if dtype == "bf16" else 4
    assert count(ptx, "add.rn.f32") == lanes * tp
    assert count(ptx, "cvt.rn.bf16x2.f32") == (4 if dtype == "bf16" else 0)
    origins = Origins(ptx)
    sums = chains(ptx, "add.rn.f32", link=1)
    assert len(sums) == lanes
    slot_bytes = CAPACITY * WIDTH * oneshot.ELEMENT_BYTES[dtype]
    for chain in sums:
        assert len(chain) == tp and origins.value(chain[0][1]) == 0, "each sum starts from +0.0"
        if dtype == "bf16":
            placed = [origins.element(args[2], through_mul=False) for args in chain]
            offsets = [offset for _, offset, _ in placed]
            assert len({element for _, _, element in placed}) == 1, "one element per chain"
        else:
            offsets = [origins.word[args[2]][1] for args in chain]
            assert len({origins.word[args[2]][2] for args in chain}) == 1, "one word per chain"
        assert [offset // slot_bytes for offset in offsets] == list(range(tp)), "ranks must be added in order"

    # One fault CAS; exactly the tp fragments read get the sentinel back.
    assert count(ptx, "atom.relaxed.gpu.global.cas.b32") == 1
    rearm = [line for line in instructions(ptx) if line.startswith("st.global.v4.u32")
             and all(origins.value(reg.strip()) == SENTINEL_U32 for reg in _operands(line)[1].strip("{}").split(","))]
    assert len(rearm) == tp


@pytest.mark.parametrize("arch", ARCHS)
def test_without_pdl_there_is_no_griddepcontrol(arch):
    ptx = one_shot_ptx(arch, 2, "bf16", pdl=False)
    assert count(ptx, "griddepcontrol.wait") == count(ptx, "griddepcontrol.launch_dependents") == 0


@pytest.mark.parametrize("tp, dtype", [(2, "bf16"), (8, "bf16"), (8, "fp32"), (32, "bf16"), (32, "fp32")])
def test_ptxas_assembles_without_spills(tp, dtype, tmp_path):
    assert_no_spills(assemble(one_shot_ptx("sm_90a", tp, dtype), "sm_90a", tmp_path, "oneshot"))


def test_the_compile_cache_is_keyed_by_every_knob_and_not_the_rank():
    knobs = dict(tp=2, capacity=4, width=WIDTH, dtype="bf16", arch="sm_90a")
    first = oneshot.compile_one_shot(**knobs)
    assert oneshot.compile_one_shot(**knobs) is first
    for change in (dict(tp=3), dict(capacity=5), dict(dtype="fp32"), dict(enable_pdl=False), dict(timeout_ns=5)):
        assert oneshot.compile_one_shot(**{**knobs, **change}) is not first, change
    assert not any("rank" in str(key) for key in compilation.CACHE.keys() if "OneShot" in key[0])


@pytest.mark.parametrize("bad, match", [
    (dict(dtype="fp16"), "dtype"),
    (dict(width=4000), "multiple"),
    (dict(tp=0), "tp"),
    (dict(capacity=0), "capacity"),
    (dict(timeout_ns=0), "timeout_ns"),
    (dict(threads=100), "threads"),
])
def test_a_bad_configuration_is_refused_before_compiling(bad, match):
    with pytest.raises(ValueError, match=match):
        oneshot.compile_one_shot(**{**dict(tp=2, capacity=4, width=WIDTH, dtype="bf16", arch="sm_90a"), **bad})


def test_mailbox_shape_is_the_protocols():
    assert oneshot.mailbox_shape(4, 64, 4096, "bf16") == (protocol.LAMPORT_GENERATIONS, 4, 64, 4096)
    assert oneshot.mailbox_shape(4, 8, 4096, "fp32") == (protocol.LAMPORT_GENERATIONS, 4, 8, 8192)


def test_a_fault_record_decodes_to_rank_peer_slot_row_and_generation():
    assert oneshot.decode_fault([protocol.FAULT_CLEAR] * 4, 8) is None
    fault = oneshot.decode_fault([1, 3, 3 * 8 + 5, 2], 8)
    assert (fault.rank, fault.peer, fault.slot, fault.row, fault.generation) == (1, 3, 3, 5, 2)
    assert "rank 1 timed out waiting for rank 3" in fault.message() and "generation 2" in fault.message()
    with pytest.raises(ValueError):
        oneshot.decode_fault([1, 2], 8)


def test_the_host_object_refuses_memory_it_cannot_use_before_compiling():
    import torch

    tp, capacity = 2, 4
    memory = dict(mailbox=torch.full(oneshot.mailbox_shape(tp, capacity, WIDTH, "bf16"), -32768, dtype=torch.int16),
                  peer_mailboxes=torch.zeros(tp, dtype=torch.int64), stage=torch.zeros(2, dtype=torch.int32),
                  fault=torch.full((4,), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="CUDA"):  # host memory: no kernel can store into it
        oneshot.OneShotAllReduce(rank=0, tp=tp, capacity=capacity, width=WIDTH, **memory)
    with pytest.raises(ValueError, match="rank 2 outside"):
        oneshot.OneShotAllReduce(rank=2, tp=tp, capacity=capacity, width=WIDTH, **memory)
    with pytest.raises(ValueError, match="dtype"):
        oneshot.OneShotAllReduce(rank=0, tp=tp, capacity=capacity, width=WIDTH, dtype="fp16", **memory)
