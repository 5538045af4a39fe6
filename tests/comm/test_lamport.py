"""The Lamport mailbox primitives: arming, publishing, bounded polling, re-arming, shm mapping."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from musebench.comm import lamport, protocol


def test_local_group_is_armed_and_shared():
    boxes = lamport.local_group(tp=3, slots=3, capacity=2, width=16)
    assert all(bool((box.own == protocol.SENTINEL_BF16_BITS).all()) for box in boxes)
    payload = torch.ones(2, 16, dtype=torch.int16)
    lamport.publish(boxes[0].words[2][0, 0], payload)
    assert torch.equal(boxes[2].own[0, 0], payload)  # rank 0's store landed in rank 2's memory


def test_publish_refuses_the_sentinel():
    boxes = lamport.local_group(tp=2, slots=2, capacity=1, width=8)
    payload = torch.full((1, 8), protocol.SENTINEL_BF16_BITS, dtype=torch.int16)
    with pytest.raises(AssertionError, match="scrub"):
        lamport.publish(boxes[0].words[1][0, 0], payload)


def test_poll_returns_once_every_word_landed():
    boxes = lamport.local_group(tp=2, slots=2, capacity=1, width=8)
    for slot in range(2):
        lamport.publish(boxes[1].own[1, slot], torch.zeros(1, 8, dtype=torch.int16))
    got = lamport.poll(boxes[1].own[1], deadline=time.monotonic() + 1, rank=1, generation=1)
    assert bool((got == 0).all())


def test_poll_timeout_names_rank_peer_slot_and_generation():
    boxes = lamport.local_group(tp=4, slots=4, capacity=2, width=8)
    region = boxes[0].own[2]
    for slot in (0, 1, 3):
        lamport.publish(region[slot], torch.zeros(2, 8, dtype=torch.int16))
    started = time.monotonic()
    with pytest.raises(lamport.MailboxTimeout) as raised:
        lamport.poll(region, deadline=started + 0.2, started=started, rank=0, generation=2)
    record = raised.value.record
    assert (record.rank, record.peer, record.slot, record.generation) == (0, 2, 2, 2)
    assert time.monotonic() - started < 2.0
    assert "rank 0 timed out" in str(raised.value) and "rank 2" in str(raised.value)


def test_partially_landed_row_is_not_consumed():
    boxes = lamport.local_group(tp=2, slots=2, capacity=1, width=8)
    region = boxes[0].own[0]
    region[0].fill_(1)
    region[1, 0, :7].fill_(1)  # the last word of slot 1 has not landed
    with pytest.raises(lamport.MailboxTimeout) as raised:
        lamport.poll(region, deadline=time.monotonic() + 0.05, rank=0, generation=0)
    assert raised.value.record.slot == 1


def test_rearm_restores_the_sentinel():
    boxes = lamport.local_group(tp=2, slots=2, capacity=1, width=8)
    boxes[0].own.fill_(3)
    lamport.rearm(boxes[0].own[1])
    assert bool((boxes[0].own[1] == protocol.SENTINEL_BF16_BITS).all())
    assert bool((boxes[0].own[0] == 3).all())


def test_shm_group_maps_peers_and_cleans_up():
    job = "t" + uuid.uuid4().hex[:10]
    for rank in range(2):
        lamport.shm_create(job, "ep", rank, slots=2, capacity=1, width=8)
    boxes = [lamport.shm_open(job, "ep", rank, tp=2, slots=2, capacity=1, width=8) for rank in range(2)]
    lamport.publish(boxes[0].words[1][0, 0], torch.full((1, 8), 5, dtype=torch.int16))
    assert bool((boxes[1].own[0, 0] == 5).all())
    for box in boxes:
        box.close()
    import os

    assert not [n for n in os.listdir("/dev/shm") if job in n]


def test_shm_open_reports_a_missing_peer():
    job = "t" + uuid.uuid4().hex[:10]
    lamport.shm_create(job, "ep", 0, slots=2, capacity=1, width=8)
    try:
        with pytest.raises(RuntimeError, match="rank 1"):
            lamport.shm_open(job, "ep", 0, tp=2, slots=2, capacity=1, width=8)
    finally:
        import os

        os.unlink(lamport.shm_path(job, "ep", 0))
