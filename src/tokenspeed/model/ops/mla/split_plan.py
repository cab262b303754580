"""MLA decode split planner: a pure function from history lengths to a kernel launch plan.

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

import array
import itertools
from collections.abc import Iterable, Sequence

import attrs
import torch


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a host `src`; on CUDA staged through pinned memory and issued without
    waiting for the stream (a host preparing the next decode step must not stall on this one)."""
    if dst.is_cuda and not src.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


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
        """Zeroed buffers, all views of one int32 block in field order, so that the planner
        refills them with one host-to-device copy per step instead of one per field."""
        sizes = (max_batch, max_batch + 1) + (max_splits,) * 4
        block = torch.zeros(sum(sizes), dtype=torch.int32, device=device)
        return cls(*block.split(sizes))

    def block(self) -> torch.Tensor | None:
        """The one int32 block the fields are consecutive views of, in field order (as
        `allocate` makes them); None for buffers put together otherwise."""
        fields = attrs.astuple(self, recurse=False)
        first = fields[0]
        ptr = first.data_ptr()
        for t in fields:
            same = t.device == first.device and t.untyped_storage().data_ptr() == (
                first.untyped_storage().data_ptr()
            )
            if not (same and t.dtype == torch.int32 and t.is_contiguous() and t.data_ptr() == ptr):
                return None
            ptr += t.numel() * t.element_size()
        total = sum(t.numel() for t in fields)
        return first.as_strided((total,), (1,), first.storage_offset())

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


def _int32(values: Iterable[int]) -> torch.Tensor:
    """A host int32 tensor of `values`; through `array` because `torch.tensor` of a Python list
    takes ~3x longer, and the planner runs on the host before every decode step."""
    packed = array.array("i", values)
    if not packed:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer(packed, dtype=torch.int32)


def min_split_capacity(max_batch: int, parallelism: int) -> int:
    """Split slots that always suffice, for any lengths l and the target t this module picks:
    sum(ceil(l / t)) <= sum(l) / t + rows <= parallelism + rows."""
    return parallelism + max_batch


def launch_order(split_lens: Sequence[int]) -> list[int]:
    """Split slots longest first (ties and unused, zero-length slots in slot order): the order
    the decode kernel's programs take them in, so that the longest splits start in the first
    wave instead of forming the tail."""
    # reverse=True keeps equal keys in their original order, as a stable sort does.
    return sorted(range(len(split_lens)), key=split_lens.__getitem__, reverse=True)


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
    num_splits = [-(-length // target) for length in history_lens]
    indptr = [0, *itertools.accumulate(num_splits)]
    rows: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    for row, (length, n) in enumerate(zip(history_lens, num_splits, strict=True)):
        rows += [row] * n
        starts += range(0, n * target, target)
        lens += [target] * (n - 1)
        lens.append(length - (n - 1) * target)
    slot = len(lens)
    unused = [0] * (max_splits - slot)
    padded_rows = max_batch - len(history_lens)
    num_splits += [0] * padded_rows
    indptr += [slot] * padded_rows
    rows += unused
    starts += unused
    lens += unused
    fields = (num_splits, indptr, rows, starts, lens, launch_order(lens))
    block = out.block()
    if block is not None:  # one copy (one pinned staging buffer) for the whole plan
        _copy_into(block, _int32(itertools.chain(*fields)))
    else:
        for tensor, values in zip(attrs.astuple(out, recurse=False), fields, strict=True):
            _copy_into(tensor, _int32(values))
    return SplitPlan(target_len=target, total_splits=slot, buffers=out)
