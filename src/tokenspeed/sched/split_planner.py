"""MLA decode split planner (DESIGN.md section 4): a pure function from history lengths to a plan.

Decode attention over long histories is split along the sequence ("split-KV"), each split computing
a partial output with its log-sum-exp, merged afterwards. A fixed split count per request wastes
the GPU on mixed batches (a 2k history gets as many splits as a 200k one). Instead one target chunk
length is derived from the whole batch and the parallelism budget (roughly the number of
concurrent split programs the GPU runs well), and each request gets ceil(len / target) splits, so
every split but a request's last has exactly the target length.

The metadata has a fixed capacity (`max_batch` rows, `max_splits` splits) whatever the batch, so a
CUDA graph captured once can replay any plan: unused rows have zero splits and unused split slots
have zero length. Pass `out=` (from `SplitPlanBuffers.allocate`) to write into captured buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from tokenspeed.cache.host_copy import copy_into


@attrs.frozen
class SplitPlanBuffers:
    """Fixed-capacity int32 metadata.

    num_splits  [max_batch]      splits of each row (0 for padded rows)
    split_indptr[max_batch + 1]  row i owns split slots [split_indptr[i], split_indptr[i + 1])
    split_row   [max_splits]     owning row of each split slot (0 for unused slots)
    split_start [max_splits]     first history token of the split
    split_len   [max_splits]     tokens in the split (0 for unused slots)
    split_order [max_splits]     the slots in launch order: longest first, unused slots last
                                 (`launch_order`; the kernel's program i takes slot
                                 split_order[i], so the long splits do not form the tail)
    """

    num_splits: torch.Tensor
    split_indptr: torch.Tensor
    split_row: torch.Tensor
    split_start: torch.Tensor
    split_len: torch.Tensor
    split_order: torch.Tensor

    @classmethod
    def allocate(
        cls, max_batch: int, max_splits: int, device: torch.device | str = "cpu"
    ) -> SplitPlanBuffers:
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        return cls(
            num_splits=zeros(max_batch),
            split_indptr=zeros(max_batch + 1),
            split_row=zeros(max_splits),
            split_start=zeros(max_splits),
            split_len=zeros(max_splits),
            split_order=zeros(max_splits),
        )

    @property
    def max_batch(self) -> int:
        return self.num_splits.numel()

    @property
    def max_splits(self) -> int:
        return self.split_len.numel()


@attrs.frozen
class SplitPlan:
    target_len: int  # every split but a row's last has exactly this many tokens
    total_splits: int  # used split slots
    buffers: SplitPlanBuffers


def min_split_capacity(max_batch: int, parallelism: int) -> int:
    """Split slots that always suffice, for any lengths l and the target t this module picks:
    sum(ceil(l / t)) <= sum(l) / t + rows <= parallelism + rows."""
    return parallelism + max_batch


def launch_order(split_lens: Sequence[int]) -> list[int]:
    """Split slots longest first (ties and unused, zero-length slots in slot order): the order
    the decode kernel's programs take them in, so that the longest splits start in the first
    wave instead of forming the tail."""
    return sorted(range(len(split_lens)), key=lambda slot: -split_lens[slot])


def target_split_len(total_tokens: int, parallelism: int, granularity: int) -> int:
    """Smallest multiple of `granularity` with at most `parallelism` full splits over the batch."""
    per_split = -(-total_tokens // parallelism)
    return max(granularity, -(-per_split // granularity) * granularity)


def plan_decode_splits(
    history_lens: Sequence[int],
    *,
    parallelism: int,
    max_batch: int,
    max_splits: int,
    granularity: int = 64,
    out: SplitPlanBuffers | None = None,
) -> SplitPlan:
    """Plan split-KV decode attention for one batch.

    history_lens: cached tokens of each real row (padding rows are not listed).
    parallelism: how many splits the batch should be cut into, roughly (e.g. SMs x programs per SM).
    granularity: split lengths are multiples of it (the cache page size keeps splits page-aligned).
    """
    if parallelism <= 0 or granularity <= 0:
        raise ValueError("parallelism and granularity must be positive")
    if len(history_lens) > max_batch:
        raise ValueError(f"{len(history_lens)} rows exceed max_batch={max_batch}")
    if max_splits < min_split_capacity(max_batch, parallelism):
        raise ValueError(
            f"max_splits={max_splits} cannot hold every plan; need at least "
            f"parallelism + max_batch = {min_split_capacity(max_batch, parallelism)}"
        )
    if any(n <= 0 for n in history_lens):
        raise ValueError("every decode row attends to at least one cached token")
    if out is None:
        out = SplitPlanBuffers.allocate(max_batch, max_splits)
    elif out.max_batch != max_batch or out.max_splits != max_splits:
        raise ValueError("out buffers do not match max_batch / max_splits")

    target = target_split_len(sum(history_lens), parallelism, granularity)
    num_splits = [0] * max_batch
    indptr = [0] * (max_batch + 1)
    rows = [0] * max_splits
    starts = [0] * max_splits
    lens = [0] * max_splits
    slot = 0
    for row, length in enumerate(history_lens):
        n = -(-length // target)
        num_splits[row] = n
        for i in range(n):
            rows[slot] = row
            starts[slot] = i * target
            lens[slot] = min(target, length - i * target)
            slot += 1
        indptr[row + 1] = slot
    for row in range(len(history_lens), max_batch):
        indptr[row + 1] = slot

    for tensor, values in (
        (out.num_splits, num_splits),
        (out.split_indptr, indptr),
        (out.split_row, rows),
        (out.split_start, starts),
        (out.split_len, lens),
        (out.split_order, launch_order(lens)),
    ):
        copy_into(tensor, torch.tensor(values, dtype=torch.int32))
    return SplitPlan(target_len=target, total_splits=slot, buffers=out)
