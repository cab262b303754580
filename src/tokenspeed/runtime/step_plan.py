"""How many model forwards a scheduler plan takes, and how a prefill is cut into them.

Pure functions over `tokenspeed.sched` plans, shared by the engine that runs a plan and by the
ranks that must agree beforehand on how many forwards a step takes (`LockstepEngine`).
"""

from __future__ import annotations

import itertools

from tokenspeed.sched.batch import PrefillBatch, StepPlan


def prefill_pieces(batch: PrefillBatch) -> list[list[tuple[int, int]]]:
    """Each chunk's pieces [(start, end)]: the chunk cut at the checkpoint positions strictly
    inside it, so that the KDA state at each of them is live once and can be stashed for the
    scheduler's save_state. Round r of a prefill runs every chunk's piece r in one forward."""
    pieces = []
    for chunk in batch.chunks:
        cuts = sorted(p for p in chunk.checkpoints if chunk.start < p < chunk.end)
        pieces.append(list(itertools.pairwise([chunk.start, *cuts, chunk.end])))
    return pieces


def is_multi_step(plan: StepPlan) -> bool:
    """Whether the plan's decode runs as a multi-step run (no prefill pending)."""
    return plan.decode is not None and plan.prefill is None and plan.decode.steps > 1


def forwards_in(plan: StepPlan) -> int:
    """Model forwards running `plan` issues: one per round of prefill pieces, then one decode
    forward, or `plan.decode.steps` of them in a multi-step run (0: an empty plan)."""
    n = 0
    if plan.prefill is not None:
        n += max((len(p) for p in prefill_pieces(plan.prefill)), default=0)
    if plan.decode is not None:
        n += plan.decode.steps if is_multi_step(plan) else 1
    return n
