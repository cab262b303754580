"""What a workload is: sessions (conversations) made of turns, whatever produced them.

A turn appends `new_tokens` tokens to its conversation and asks for `output_tokens` tokens; its
prompt is the whole conversation so far (every earlier turn's new tokens and output, then its own
new tokens), as a chat client replays it. Content identity comes from trace blocks: `blocks` lists
one id per `block_size` tokens of the new tokens (the last block may be partial); equal ids mean
equal content, so sessions that start with the same ids share a prefix. Tokens without a block id
(outputs, a trace's un-hashed tail) are unique to their session.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Protocol

import attrs


@attrs.frozen(kw_only=True)
class Turn:
    new_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()
    delay_s: float = 0.0  # after the previous turn's last token (tool call or human think time)
    # Subagents launched when this turn's response is complete; the next turn waits for them.
    subagents: tuple[Session, ...] = ()

    def __attrs_post_init__(self) -> None:
        counts = (self.new_tokens, self.output_tokens)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in counts):
            raise ValueError(
                f"a turn's new_tokens and output_tokens must be integers, got "
                f"{self.new_tokens!r} and {self.output_tokens!r}"
            )
        if self.new_tokens <= 0 or self.output_tokens <= 0:
            raise ValueError(
                f"a turn needs new_tokens > 0 and output_tokens > 0, got "
                f"{self.new_tokens} and {self.output_tokens}"
            )
        if (
            isinstance(self.delay_s, bool)
            or not isinstance(self.delay_s, int | float)
            or not 0 <= self.delay_s < math.inf
        ):
            raise ValueError(f"delay_s must be finite and >= 0, got {self.delay_s!r}")


@attrs.frozen(kw_only=True)
class Session:
    sid: str
    turns: tuple[Turn, ...]
    start_s: float | None = None  # open-loop arrival of the first turn; None: when a slot frees
    group: int | None = None
    kind: str = "main"  # "main" or "subagent"

    def __attrs_post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"session {self.sid} has no turns")
        # A timed session is pushed on the event heap at start_s: a NaN would break the heap's
        # order and a negative time would run the clock backwards, both silently.
        start = self.start_s
        if start is not None and (
            isinstance(start, bool)
            or not isinstance(start, int | float)
            or not 0 <= start < math.inf
        ):
            raise ValueError(
                f"session {self.sid}: start_s must be finite and >= 0 or None, got {start!r}"
            )

    @property
    def num_requests(self) -> int:
        """Requests this session issues, its subagents' included."""
        return sum(1 + sum(s.num_requests for s in t.subagents) for t in self.turns)


class SessionSource(Protocol):
    """Where a simulation takes its sessions from, in order."""

    block_size: int

    def __iter__(self) -> Iterator[Session]: ...


@attrs.frozen(kw_only=True)
class TraceIssue:
    """A malformed trace line that was skipped."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def check_block_size(block_size: object) -> None:
    """Raise ValueError unless `block_size` (tokens per trace block) is a positive integer."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def _block_size(instance: object, attribute: attrs.Attribute, value: object) -> None:
    check_block_size(value)


@attrs.frozen(kw_only=True)
class Workload:
    """A finite, loaded workload (a trace); generators are `SessionSource`s of their own."""

    sessions: tuple[Session, ...]
    block_size: int = attrs.field(default=512, validator=_block_size)
    name: str = "trace"
    issues: tuple[TraceIssue, ...] = ()  # lines skipped while loading

    def __attrs_post_init__(self) -> None:
        # A timed workload starts sessions only at their times: one without a time would never run.
        untimed = [s.sid for s in self.sessions if s.start_s is None]
        if untimed and len(untimed) < len(self.sessions):
            raise ValueError(
                f"sessions must all have start_s or none: {len(untimed)} of {len(self.sessions)} "
                f"lack it (e.g. {untimed[0]!r})"
            )

    def __iter__(self) -> Iterator[Session]:
        return iter(self.sessions)

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def timed(self) -> bool:
        """Sessions arrive at recorded times (open loop) rather than when a slot frees."""
        return any(s.start_s is not None for s in self.sessions)

    @classmethod
    def of(cls, sessions: Sequence[Session], **kw: object) -> Workload:
        return cls(sessions=tuple(sessions), **kw)
