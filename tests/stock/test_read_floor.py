"""stock/read_floor.py: the byte-count contract, the fixed configuration against the H200 sweep
it was chosen from, FloorRead's buffers and rotation (call j reads buffer j mod count), its sum
check passing a reader that read every byte and failing one that skipped 16 bytes or wrote
nothing; on a GPU the compiled reader checked whole and caught 16 bytes short."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from musebench.stock import read_floor
from tests._read_floor import emulated_triton_read

RECORD = pathlib.Path(__file__).resolve().parents[2] / "records" / "2026-12-02-h200-081ea38-read-floor.json"


@pytest.mark.parametrize("nbytes, reason", [
    (0, "positive multiple of 16"), (-16, "positive multiple of 16"), (24, "positive multiple of 16"),
    (16.0, "positive multiple of 16"), (True, "positive multiple of 16"), ((1 << 32) + 16, "int32 word offsets"),
])
def test_a_byte_count_the_reader_cannot_read_exactly_is_refused(nbytes, reason):
    with pytest.raises(ValueError, match=reason):
        read_floor.check_nbytes(nbytes)
    with pytest.raises(ValueError, match=reason):
        read_floor.FloorRead(nbytes, torch.device("cpu"))


def test_a_floor_reads_at_least_one_buffer():
    with pytest.raises(ValueError, match="at least one buffer"):
        read_floor.FloorRead(64, torch.device("cpu"), count=0)


def test_the_fixed_configuration_is_within_3_percent_of_the_sweeps_best_everywhere():
    """FLOOR_CONFIG against the record it was chosen from: at every (bytes, state) of the H200
    sweep its median is within 3 % of the best configuration's (the docstring's numbers)."""
    record = json.loads(RECORD.read_text())
    fields = record["triton_grid_fields"]
    config = read_floor.FLOOR_CONFIG
    mine = (config.programs_per_sm, config.num_warps, config.loads_in_flight)
    assert len(record["triton_grid"]) == 10
    for point, rows in record["triton_grid"].items():
        rows = [dict(zip(fields, row)) for row in rows]
        best = min(row["us_median"] for row in rows)
        (chosen,) = [row for row in rows if (row["programs_per_sm"], row["num_warps"], row["loads_in_flight"]) == mine]
        assert chosen["us_median"] <= 1.03 * best, point
    assert config.chunk_words == 4 * 8 * 32 * 4 and config.name() == "triton 4/SM x 8 warps x 4 loads"


def test_the_wrapped_sum_check_fails_a_reader_that_skipped_a_word():
    words = torch.randint(-2 ** 31, 2 ** 31, (1000,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    total = read_floor.words_total(words)
    partials = torch.zeros(3, dtype=torch.int32)
    emulated_triton_read(words, partials, read_floor.ReaderConfig(3, 1, 1))
    read_floor.check_partials(partials, total, "whole")
    emulated_triton_read(words[:-1], partials, read_floor.ReaderConfig(3, 1, 1))
    with pytest.raises(RuntimeError, match="one short: .* did not read every byte once"):
        read_floor.check_partials(partials, total, "one short")


def test_a_floor_allocates_count_random_buffers_and_reads_them_in_turn(emulated_read_floor):
    """count separate buffers of nbytes random words; check reads each once, then call j reads
    buffer j mod count (the rotation restarts after the check); count 1 reads one buffer always."""
    floor = read_floor.FloorRead(4096 + 16, torch.device("cpu"), count=3)
    assert [b.numel() * 4 for b in floor.buffers] == [4112] * 3 and floor.partials.shape == (3, 4)
    assert len({b.data_ptr() for b in floor.buffers}) == 3 and all(b.dtype == torch.int32 for b in floor.buffers)
    assert not torch.equal(floor.buffers[0], floor.buffers[1]) and int(floor.buffers[0].ne(0).sum()) > 1000
    floor.check("rotation")
    assert [w.data_ptr() for w in emulated_read_floor] == [b.data_ptr() for b in floor.buffers]
    emulated_read_floor.clear()
    for _ in range(7):
        floor()
    assert [w.data_ptr() for w in emulated_read_floor] == [floor.buffers[j % 3].data_ptr() for j in range(7)]
    one = read_floor.FloorRead(256, torch.device("cpu"))
    emulated_read_floor.clear()
    for _ in range(3):
        one()
    assert {w.data_ptr() for w in emulated_read_floor} == {one.buffers[0].data_ptr()}


def test_the_floors_check_fails_a_reader_that_skipped_16_bytes_or_wrote_nothing(monkeypatch):
    """Fault injection: a reader over each buffer less its last vector, and one that never writes
    its partials, both fail `FloorRead.check`, naming the path and the buffer."""
    floor = read_floor.FloorRead(8192, torch.device("cpu"), count=2)
    monkeypatch.setattr(read_floor, "triton_read", emulated_triton_read)
    floor.check("whole")
    monkeypatch.setattr(read_floor, "triton_read", lambda w, p, c: emulated_triton_read(w[:-4], p, c))
    with pytest.raises(RuntimeError, match=r"short, 8192 B, buffer 0 of 2: .* did not read every byte once"):
        floor.check("short")
    monkeypatch.setattr(read_floor, "triton_read", lambda w, p, c: None)
    with pytest.raises(RuntimeError, match="did not read every byte once"):
        floor.check("never written")


@pytest.mark.gpu
def test_the_compiled_floor_reads_every_byte_and_a_short_read_is_caught(monkeypatch):
    """On a GPU: FLOOR_CONFIG's compiled reader over 64 MiB + 16 B (a partial last chunk), two
    buffers, checked whole; its rotation under a CUDA graph; the reader 16 bytes short fails."""
    pytest.importorskip("triton")
    floor = read_floor.FloorRead((64 << 20) + 16, torch.device("cuda"), count=2)
    floor.check("whole")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        floor()
        floor()
    floor.partials.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for j in range(2):
        read_floor.check_partials(floor.partials[j], floor.totals[j], f"replayed buffer {j}")
    real = read_floor.triton_read
    monkeypatch.setattr(read_floor, "triton_read", lambda w, p, c: real(w[:-4], p, c))
    with pytest.raises(RuntimeError, match="did not read every byte once"):
        floor.check("16 bytes short")
