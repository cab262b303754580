"""Collectives over uneven row counts, and a record of the bytes they move.

Ranks of a data-parallel attention layout hold different numbers of tokens (zero included), so
every exchange of token rows first agrees on the counts. `CommLog` counts the payload bytes each
rank sends, per named exchange, for the transforms' accounting.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .groups import Group


class CommLog:
    """Payload bytes this rank sent, by exchange name (counts exchanged to size them aside)."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, name: str, nbytes: int) -> None:
        self.sent[name] += nbytes
        self.calls[name] += 1

    def total(self) -> int:
        return sum(self.sent.values())

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()


def gather_counts(count: int, group: Group, device: torch.device | str = "cpu") -> list[int]:
    """Every group member's `count`, in group order. `device`: where the group's backend takes
    tensors (the data's device: NCCL needs CUDA tensors, gloo takes CPU ones)."""
    if group.size == 1:
        return [count]
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(group.size)]
    dist.all_gather(out, mine, group=group.handle)
    return [int(t) for t in out]


def all_gather_rows(
    x: torch.Tensor, group: Group, log: CommLog | None = None, name: str = "all_gather"
) -> tuple[torch.Tensor, list[int]]:
    """x: [n_i, ...] on member i -> ([sum n, ...] in group order, [n_0, n_1, ...]). Every member
    takes part, with no rows too."""
    counts = gather_counts(x.shape[0], group, x.device)
    if group.size == 1:
        return x, counts
    if sum(counts) == 0:  # every member idle: the counts were the whole exchange
        return x.new_empty((0, *x.shape[1:])), counts
    if log is not None:
        log.record(name, (group.size - 1) * x.numel() * x.element_size())
    most = max(counts)
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in range(group.size)]
    dist.all_gather(out, padded.contiguous(), group=group.handle)
    return torch.cat([t[:n] for t, n in zip(out, counts, strict=True)]), counts


def all_to_all_rows(
    x: torch.Tensor,
    send_counts: Sequence[int],
    group: Group,
    log: CommLog | None = None,
    name: str = "all_to_all",
) -> tuple[torch.Tensor, list[int]]:
    """Send rows [sum(send_counts[:j]), +send_counts[j]) of x to member j; returns the rows
    received, grouped by sender in group order, and how many came from each."""
    send_counts = [int(c) for c in send_counts]
    if group.size == 1:
        return x, send_counts
    mine = torch.tensor(send_counts, dtype=torch.int64, device=x.device)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=group.handle)
    recv_counts = theirs.tolist()  # the one host sync: the receive buffer's size
    if log is not None:
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        log.record(name, (sum(send_counts) - send_counts[group.index]) * row)
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group.handle)
    return out, recv_counts


def all_reduce_(
    x: torch.Tensor, group: Group, log: CommLog | None = None, name: str = "all_reduce"
) -> torch.Tensor:
    """Sum x over the group in place (and return it)."""
    if group.size > 1:
        if log is not None:
            # A ring all-reduce sends 2 (T-1)/T of the tensor per rank.
            log.record(name, 2 * (group.size - 1) * x.numel() * x.element_size() // group.size)
        dist.all_reduce(x, group=group.handle)
    return x
