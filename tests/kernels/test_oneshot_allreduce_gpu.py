"""The one-shot all-reduce across processes sharing one GPU (CUDA IPC mailboxes), as H200 users run
the published algorithm: every rank gets bitwise the rank-order sum of every rank's input
(`stock.all_reduce.rank_order_sum`), over calls that rotate the three generations and over 100
CUDA-graph replays; a rank that never calls makes its peers record a fault naming it within the
timeout (no hang). Timings here mean nothing (the processes time-slice one GPU); only bits do.

Each test spawns tp processes (a gloo group over a file store, every rank on GPU 0), each writes its
verdict as JSON; the parent waits a bounded time and kills what is left.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

WIDTH, CAPACITY = 4096, 8
JOIN_S = 300.0  # interpreter, torch, CuTe DSL import and one compile per process, on a loaded host
POISON_BITS = {torch.bfloat16: 0x7FBF, torch.float32: 0x7FBFFFFF}  # a NaN no sum of finite inputs gives


def _inputs(rank: int, call: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input for call `call`: Gaussian values of a few magnitudes, with -0.0, +0.0,
    subnormals and (FP32) the 32-bit sentinel word 0x80008000 in fixed places."""
    g = torch.Generator().manual_seed(1_000 * rank + call)
    x = torch.randn(m, WIDTH, generator=g) * torch.tensor([1.0, 1e-3, 1e3, 1e-30]).repeat(WIDTH // 4)
    x[:, 0] = -0.0
    x[:, 1] = 0.0
    if dtype == torch.bfloat16:
        x = x.to(torch.bfloat16)
        x.view(torch.int16)[:, 2] = 0x0001  # the smallest BF16 subnormal
        return x
    x.view(torch.int32)[:, 2] = 0x80008000 - (1 << 32)  # the sentinel word: travels as -0.0
    x.view(torch.int32)[:, 3] = 0x00000001  # the smallest FP32 subnormal
    return x


def _want(tp: int, call: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    from musebench.stock.all_reduce import rank_order_sum

    return rank_order_sum([_inputs(r, call, m, dtype) for r in range(tp)])


def _worker(rank: int, tp: int, store: str, out_dir: str, scenario: str, dtype_name: str) -> None:
    import torch.distributed as dist

    from musebench.comm import mailboxes
    from musebench.harness.case import MailboxSpec
    from musebench.kernels.oneshot_allreduce import OneShotAllReduce, row_words
    from musebench.stock.all_reduce import mismatches

    verdict: dict = {"rank": rank}
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    try:
        spec = MailboxSpec(slots=tp, rows=CAPACITY, width=row_words(WIDTH, dtype_name))
        boxes = mailboxes.allocate_process({"one_shot": spec}, rank, tp, SimpleNamespace(name="ipc", ipc_open="auto"),
                                           f"oneshot-{uuid.uuid4().hex[:8]}")
        timeout_ns = 300_000_000 if scenario == "missing" else 5_000_000_000
        all_reduce = OneShotAllReduce.from_mailbox(boxes["one_shot"], dtype=dtype_name, timeout_ns=timeout_ns)
        dist.barrier()  # every rank compiled and warmed up before any rank spins on a peer
        device = torch.device("cuda", 0)
        wrong = []
        if scenario == "sum":
            call = 0
            for m in (1, 3, 8, 8, 2):  # five calls: every generation used, then reused
                source = _inputs(rank, call, m, dtype).to(device)
                out = torch.empty(m, WIDTH, dtype=dtype, device=device)
                out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).fill_(POISON_BITS[dtype])
                all_reduce.run(source, out)
                all_reduce.check_fault()
                count, first = mismatches(out.cpu(), _want(tp, call, m, dtype))
                if count:
                    wrong.append(f"call {call} m {m}: {count} words differ, first at {first}")
                call += 1
        elif scenario == "graph":
            m = 4
            source = torch.empty(m, WIDTH, dtype=dtype, device=device)
            out = torch.empty(m, WIDTH, dtype=dtype, device=device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                all_reduce.run(source, out)
            for replay in range(100):
                source.copy_(_inputs(rank, replay, m, dtype))
                out.view(torch.int16).fill_(POISON_BITS[torch.bfloat16])
                graph.replay()
                torch.cuda.synchronize()
                count, first = mismatches(out.cpu(), _want(tp, replay, m, dtype))
                if count:
                    wrong.append(f"replay {replay}: {count} words differ, first at {first}")
            all_reduce.check_fault()
        elif scenario == "missing":
            if rank != tp - 1:  # the last rank never calls: its peers must give up and say so
                source = _inputs(rank, 0, 2, dtype).to(device)
                out = torch.empty_like(source)
                started = time.monotonic()
                all_reduce.run(source, out)
                torch.cuda.synchronize()
                verdict["elapsed_s"] = time.monotonic() - started
                try:
                    all_reduce.check_fault()
                    verdict["fault"] = None
                except RuntimeError as error:
                    verdict["fault"] = str(error)
        verdict["wrong"] = wrong
        dist.barrier()
        mailboxes.close(boxes)
    except Exception as error:  # the parent reports it, naming the rank
        verdict["error"] = f"{type(error).__name__}: {error}"
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(verdict))
        dist.destroy_process_group()


def _run(tp: int, scenario: str, dtype: str, tmp_path: Path, monkeypatch) -> list[dict]:
    """Every rank's verdict; the processes are ended within JOIN_S whatever happens."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # expandable segments cannot be exported
    store = tmp_path / "store"
    context = mp.start_processes(_worker, args=(tp, str(store), str(tmp_path), scenario, dtype), nprocs=tp,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{scenario}: ranks still running after {JOIN_S:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(10)
    verdicts = []
    for rank in range(tp):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no verdict"
        verdicts.append(json.loads(path.read_text()))
    for verdict in verdicts:
        assert "error" not in verdict, f"rank {verdict['rank']}: {verdict['error']}"
    return verdicts


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_gets_bitwise_the_rank_order_sum(tp, dtype, tmp_path, monkeypatch):
    for verdict in _run(tp, "sum", dtype, tmp_path, monkeypatch):
        assert verdict["wrong"] == [], (verdict["rank"], verdict["wrong"])


@pytest.mark.parametrize("tp", [2, 4])
def test_a_hundred_graph_replays_stay_bitwise(tp, tmp_path, monkeypatch):
    for verdict in _run(tp, "graph", "bf16", tmp_path, monkeypatch):
        assert verdict["wrong"] == [], (verdict["rank"], verdict["wrong"][:3])


@pytest.mark.parametrize("tp", [2, 4])
def test_a_missing_rank_is_a_fault_record_within_the_timeout(tp, tmp_path, monkeypatch):
    for verdict in _run(tp, "missing", "bf16", tmp_path, monkeypatch)[: tp - 1]:
        rank = verdict["rank"]
        assert verdict["fault"] is not None, f"rank {rank} did not report the missing rank"
        assert f"rank {rank} timed out waiting for rank {tp - 1}" in verdict["fault"]
        assert "generation 0" in verdict["fault"]
        assert verdict["elapsed_s"] < 5.0  # the 0.3 s bound and the launch, not a hang
