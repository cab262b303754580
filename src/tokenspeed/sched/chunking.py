"""Where a prefill chunk may end and which prefix lengths get a KDA checkpoint (pure functions).

A prefix is reusable only up to a length with both MLA pages and a KDA state snapshot (the hybrid
prefix rule, docs/design.md). So a chunk that the token budget cuts short ends on a checkpoint
boundary (a multiple of the checkpoint interval) when one fits, else on a page boundary: the state
at a chunk end is the live state, free to snapshot, and an arbitrary cut would leave a prefix that
no later turn could reuse. Only a request's final chunk ends off the page grid, at its prompt end.
"""

from __future__ import annotations


def chunk_end(start: int, target: int, budget: int, *, page_size: int, interval: int) -> int:
    """End of the next chunk of a prefill covering [start, target) with `budget` tokens left.

    `start` is page-aligned (hits and earlier chunk ends always are). Returns `start` when nothing
    aligned fits, meaning the request waits for the next batch.
    """
    if budget <= 0 or start >= target:
        return start
    if target - start <= budget:
        return target
    limit = start + budget
    aligned = limit - limit % interval
    if aligned > start:
        return aligned
    aligned = limit - limit % page_size
    return aligned if aligned > start else start


def checkpoint_positions(
    start: int, end: int, target: int, *, page_size: int, interval: int
) -> tuple[int, ...]:
    """Prefix lengths in (start, end] at which to snapshot KDA state after computing [start, end).

    Every interval boundary the chunk reaches; the chunk's own end when the prefill continues
    after it (a cut chunk ends on the page grid, and the next turn or a preempted retry may resume
    there); and, on the final chunk, the prompt's last full page (the turn-end checkpoint).
    """
    last = end if end < target else target - target % page_size
    positions = list(range((start // interval + 1) * interval, last + 1, interval))
    if last > start and (not positions or positions[-1] != last):
        positions.append(last)
    return tuple(positions)
