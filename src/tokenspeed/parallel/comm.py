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


def gather_counts(count: int, group: Group, device: torch.device | str) -> list[int]:
    """Every group member's `count`, in group order (one host sync). `device`: where the
    group's backend takes tensors (the data's device: NCCL needs CUDA tensors, gloo CPU ones)."""
    if group.size == 1:
        return [count]
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(out, mine, group=group.handle)
    return torch.cat(out).tolist()


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


def exchange_counts(send_counts: torch.Tensor, group: Group) -> torch.Tensor:
    """send_counts: int64 [G], rows this member sends each member -> int64 [G], rows each
    member sends this one (one all-to-all of G int64; no host sync)."""
    if group.size == 1:
        return send_counts
    theirs = torch.empty_like(send_counts)
    dist.all_to_all_single(theirs, send_counts.contiguous(), group=group.handle)
    return theirs


def all_to_all_rows(
    x: torch.Tensor,
    send_counts: Sequence[int] | torch.Tensor,
    group: Group,
    log: CommLog | None = None,
    name: str = "all_to_all",
    *,
    recv_counts: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Send rows [sum(send_counts[:j]), +send_counts[j]) of x to member j; returns the rows
    received, grouped by sender in group order, and how many came from each.

    recv_counts: how many rows each member sends this one, when the caller knows (no exchange
    of counts then); else they are exchanged first (`exchange_counts`, one host sync for both
    lists). send_counts may be an int64 tensor on x's device (counts computed there)."""
    if recv_counts is None and group.size > 1:
        if not isinstance(send_counts, torch.Tensor):
            send_counts = torch.tensor(list(send_counts), dtype=torch.int64, device=x.device)
        both = torch.cat([send_counts, exchange_counts(send_counts, group)]).tolist()
        send, recv = both[: group.size], both[group.size :]
    else:
        send = send_counts.tolist() if isinstance(send_counts, torch.Tensor) else send_counts
        send = [int(c) for c in send]
        recv = send if recv_counts is None else [int(c) for c in recv_counts]
    if group.size == 1:
        return x, send
    if log is not None:
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        log.record(name, (sum(send) - send[group.index]) * row)
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.handle)
    return out, recv


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
