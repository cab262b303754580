"""Uneven collectives on CPU ranks, the byte log, and a dead rank failing its peers in time."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

from tokenspeed.parallel.comm import CommLog, all_gather_rows, all_reduce_, all_to_all_rows
from tokenspeed.parallel.dims import ParallelDims
from tokenspeed.parallel.groups import ParallelGroups

from .harness import run_ranks, run_ranks_status


def _rows(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 100 * rank


def _exchange(rank, world):
    groups = ParallelGroups.build(ParallelDims(world_size=world, tp=world))
    group = groups["tp"]
    counts = [3, 0, 2, 1][:world]  # uneven, one rank with no rows
    log = CommLog()
    gathered, sizes = all_gather_rows(_rows(rank, counts[rank]), group, log)
    # Rank r sends (r + j) % 2 + j rows to rank j.
    send = [(rank + j) % 2 + j for j in range(world)]
    x = torch.cat([torch.full((n, 2), float(10 * rank + j)) for j, n in enumerate(send)])
    got, recv = all_to_all_rows(x, send, group, log)
    total = all_reduce_(torch.tensor([float(rank)]), group, log)
    return gathered, sizes, got, recv, float(total), dict(log.sent)


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_gather_and_all_to_all(world):
    results = run_ranks(_exchange, world)
    counts = [3, 0, 2, 1][:world]
    expected = torch.cat([_rows(r, counts[r]) for r in range(world)])
    for rank, (gathered, sizes, got, recv, total, sent) in enumerate(results):
        assert sizes == counts and torch.equal(gathered, expected)
        assert recv == [(s + rank) % 2 + rank for s in range(world)]
        want = torch.cat([torch.full((recv[s], 2), float(10 * s + rank)) for s in range(world)])
        assert torch.equal(got, want)
        assert total == sum(range(world))
        assert sent["all_gather"] == (world - 1) * counts[rank] * 3 * 4
        others = sum((rank + j) % 2 + j for j in range(world) if j != rank)
        assert sent["all_to_all"] == others * 2 * 4


def _die_or_reduce(rank, world):
    groups = ParallelGroups.build(
        ParallelDims(world_size=world, tp=world), timeout=timedelta(seconds=10)
    )
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        all_reduce_(torch.ones(4), groups["tp"])
    except Exception as exc:
        return ("raised", time.monotonic() - start, str(exc))
    return ("returned", time.monotonic() - start, "")


def test_a_dead_rank_makes_the_others_fail_in_bounded_time():
    results = run_ranks_status(_die_or_reduce, 3, timeout=90, fresh=True)
    assert results[1][0] == "died"
    for rank in (0, 2):
        status, (what, seconds, message) = results[rank]
        assert status == "ok" and what == "raised", results[rank]
        assert seconds < 30, (seconds, message)
        # gloo names the broken connection to the dead peer (or the deadline that passed).
        assert "peer" in message or "timed out" in message.lower(), message
