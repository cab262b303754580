"""A request as the scheduler sees it, and the lifecycle it moves through.

    WAITING -> PREFILLING -> (TRANSFERRING, P/D only) -> DECODING -> FINISHED
         ^         |                                        |
         +---------+--------------- preempt ----------------+        any live state -> ABORTED

Preemption sends a request back to WAITING with its cache published (the scheduler does that
through its cache port), never dropped; its generated tokens become part of the prompt it
re-prefills. Every transition goes through `Request.move`, which rejects the ones the diagram does
not have, so a scheduler bug surfaces as an exception at the faulty step rather than as a
silently lost request.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from typing import Any

import attrs


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


_S = RequestState
ALLOWED_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.WAITING: frozenset({_S.PREFILLING, _S.ABORTED}),
    # A one-token answer finishes straight out of prefill; aggregated mode skips the transfer.
    _S.PREFILLING: frozenset({_S.TRANSFERRING, _S.DECODING, _S.FINISHED, _S.WAITING, _S.ABORTED}),
    _S.TRANSFERRING: frozenset({_S.DECODING, _S.WAITING, _S.ABORTED}),
    _S.DECODING: frozenset({_S.FINISHED, _S.WAITING, _S.ABORTED}),
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
}
TERMINAL_STATES = frozenset({_S.FINISHED, _S.ABORTED})


class LifecycleError(RuntimeError):
    """A transition the lifecycle does not allow (a scheduler or caller bug)."""


@attrs.define(eq=False, slots=True)
class Request:
    """Scheduling state of one request (one turn of a conversation).

    `keys` are the cache keys of the request's pages (for the real cache a `PageKeys` array or a
    growing `KeyBuffer`), opaque here and handed to the cache port: the scheduler only takes
    their length and slices. A caller that knows the output in advance (the simulator) may list
    the output pages too.
    `num_computed` counts tokens whose cache exists on the rank currently holding the request
    (prefix hit plus prefilled chunks, plus decoded tokens while decoding).
    """

    rid: Hashable
    prompt_len: int
    max_new_tokens: int
    keys: Sequence[Hashable] | Any = ()
    session: Hashable | None = None
    state: RequestState = RequestState.WAITING
    num_computed: int = 0
    num_cached: int = 0  # prefix reused at the last prefill admission
    num_output: int = 0  # tokens generated so far (the first comes out of prefill)
    preemptions: int = 0
    abort_reason: str | None = None
    prefill_rank: int | None = None
    decode_rank: int | None = None

    def __attrs_post_init__(self) -> None:
        # Checked once, here: the scheduler moves these counters on every step, unchecked.
        try:
            hash(self.rid)
        except TypeError:
            raise ValueError(f"request id must be hashable, got {self.rid!r}") from None
        try:
            hash(self.session)  # the router keys conversation affinity by it
        except TypeError:
            raise ValueError(
                f"request {self.rid!r}: session must be hashable, got {self.session!r}"
            ) from None
        self._check_int("prompt_len", minimum=1)
        self._check_int("max_new_tokens", minimum=1)
        for name in ("num_computed", "num_cached", "num_output", "preemptions"):
            self._check_int(name, minimum=0)
        for name in ("prefill_rank", "decode_rank"):
            if getattr(self, name) is not None:
                self._check_int(name, minimum=0, optional=True)
        if not isinstance(self.state, RequestState):
            raise ValueError(
                f"request {self.rid!r}: state must be a RequestState, got {self.state!r}"
            )
        if self.abort_reason is not None and not isinstance(self.abort_reason, str):
            raise ValueError(
                f"request {self.rid!r}: abort_reason must be a string or None, got "
                f"{self.abort_reason!r}"
            )
        if self.num_output > self.max_new_tokens:
            raise ValueError(
                f"request {self.rid!r}: num_output ({self.num_output}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if self.num_computed > self.prefill_target:
            raise ValueError(
                f"request {self.rid!r}: num_computed ({self.num_computed}) exceeds the sequence "
                f"({self.prompt_len} prompt + {self.num_output} output tokens)"
            )
        if self.num_cached > self.num_computed:
            raise ValueError(
                f"request {self.rid!r}: num_cached ({self.num_cached}) exceeds num_computed "
                f"({self.num_computed})"
            )

    def _check_int(self, name: str, *, minimum: int, optional: bool = False) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int):
            kind = "an integer or None" if optional else "an integer"
            raise ValueError(f"request {self.rid!r}: {name} must be {kind}, got {value!r}")
        if value < minimum:
            bound = "positive" if minimum == 1 else f">= {minimum}"
            raise ValueError(f"request {self.rid!r}: {name} must be {bound}, got {value}")

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence so far: prompt plus generated output."""
        return self.prompt_len + self.num_output

    @property
    def prefill_target(self) -> int:
        """Tokens a prefill must cover: the prompt, plus any output kept across a preemption."""
        return self.prompt_len + self.num_output

    @property
    def prefill_remaining(self) -> int:
        return max(self.prefill_target - self.num_computed, 0)

    @property
    def output_remaining(self) -> int:
        return self.max_new_tokens - self.num_output

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    def move(self, new: RequestState) -> None:
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise LifecycleError(
                f"request {self.rid!r}: {self.state.value} -> {new.value} is not a lifecycle step"
            )
        self.state = new

    def preempt(self) -> None:
        """Back to WAITING; generated tokens stay and are re-prefilled with the prompt."""
        self.move(RequestState.WAITING)
        self.preemptions += 1
        self.num_computed = 0
        self.num_cached = 0

    def abort(self, reason: str) -> None:
        # Checked first: an abort always carries a reason, which callers report.
        if not isinstance(reason, str) or not reason:
            raise ValueError(
                f"request {self.rid!r}: abort reason must be a non-empty string, got {reason!r}"
            )
        self.move(RequestState.ABORTED)
        self.abort_reason = reason
