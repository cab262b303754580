"""Batch plans the schedulers hand to their caller (an engine step loop or the simulator).

A plan names requests and token ranges only; the caller runs it and reports back through the
scheduler's `complete` method. Plans hold references to the live `Request` objects; the caller
gets page tables and state slots from its cache port by request id.
"""

from __future__ import annotations

import attrs

from tokenspeed.sched.request import Request


def pad_batch_size(batch_size: int, sizes: tuple[int, ...]) -> int:
    """Smallest captured graph size that holds `batch_size` rows (`sizes` ascending)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    for size in sizes:
        if size >= batch_size:
            return size
    raise ValueError(f"batch_size {batch_size} exceeds the largest captured size {sizes[-1]}")


@attrs.frozen
class PrefillChunk:
    """Compute tokens [start, end) of `request`'s sequence, then snapshot KDA state at each of
    `checkpoints`.

    Tokens [0, start) are already cached on this rank (prefix hit or earlier chunks).
    """

    request: Request
    start: int
    end: int
    checkpoints: tuple[int, ...] = ()
    # The chunk completes the prefill; its forward also samples the next output token. Fixed at
    # planning time (the request's own counters move on once the chunk completes).
    is_last: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@attrs.frozen
class PrefillBatch:
    chunks: tuple[PrefillChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_requests(self) -> int:
        return len(self.chunks)


@attrs.frozen
class DecodeBatch:
    """Decode steps over `requests`, run at the captured graph size `padded_size`.

    The simulator, which knows each output length, runs up to `steps` and may stop early. An
    engine runs one step, or with multi-step decoding all `steps` back to back and then reports
    them one by one (an EOS can end a row at any of them). Rows past len(requests) are padding:
    the runner points them at a throwaway page and state slot.
    """

    requests: tuple[Request, ...]
    padded_size: int
    steps: int = 1  # consecutive steps the batch may run unchanged (pages reserved for all)

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def history_lens(self) -> tuple[int, ...]:
        """Cached tokens each row attends to this step (its sequence so far)."""
        return tuple(r.seq_len for r in self.requests)


@attrs.frozen
class StepPlan:
    """One forward of an aggregated rank: prefill chunks and decode rows side by side."""

    prefill: PrefillBatch | None
    decode: DecodeBatch | None

    @property
    def empty(self) -> bool:
        return self.prefill is None and self.decode is None
