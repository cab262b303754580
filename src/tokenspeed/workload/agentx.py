"""AgentX-style agentic workload generator (defaults: aiperf 0.13 agentic-code).

A session is one coding agent's conversation. Its first turn carries the initial context: a
prefix shared by every session (system prompt and tools), a prefix shared within one of
`num_groups` Zipf-popular groups (a repository), and session-specific context. Each later turn
appends lognormal new tokens (tool results, user messages) and asks for a short lognormal output,
after an agentic delay (a tool call, ~seconds) or a human one (~tens of seconds). A session ends
when its prompt would pass `max_prompt_tokens` (forced retire) or at a reset whose probability
grows with the context; a first context too long for the cap is cut to the longest prompt under
it (an agent starts from what fits), so no prompt ever reaches the cap. Now and then a turn
launches a burst of subagents: short sessions that start from a fresh context (the shared prefix
plus a task of their own) and run while the parent waits; the parent's next turn comes after the
last of them has answered.

Session i depends only on (seed, i): streams are reproducible and can be cut anywhere.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import attrs
import numpy as np

from tokenspeed.workload.distributions import LogNormal
from tokenspeed.workload.model import Session, Turn, Workload

# Block-id namespaces (ids are 64-bit ints; equal ids mean equal content).
_GROUP_BASE = 1 << 32
_SESSION_BASE = 1 << 40
_SESSION_SPAN = 1 << 22  # block ids per session: 2M blocks = 1G tokens, far above any session


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    # A bool would pass as 0 or 1 (a probability of one, say); a string would fail the range
    # comparison with a TypeError that does not name the field.
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fraction(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not _is_real(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not _is_real(value) or not 0 < value < math.inf:
        raise ValueError(f"{attribute.name} must be finite and positive, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not _is_real(value) or not 0 <= value < math.inf:
        raise ValueError(f"{attribute.name} must be finite and >= 0, got {value!r}")


def _positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _non_negative_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative integer, got {value!r}")


def _at_least_one(instance: object, attribute: attrs.Attribute, value: float) -> None:
    # A geometric number of turns with this mean: success probability 1 / mean must be in (0, 1].
    if not _is_real(value) or not 1 <= value < math.inf:
        raise ValueError(f"{attribute.name} must be finite and >= 1, got {value!r}")


def _distribution(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, LogNormal):
        raise ValueError(f"{attribute.name} must be a LogNormal, got {value!r}")


def _token_count(instance: object, attribute: attrs.Attribute, value: object) -> None:
    # sample_int clips to ceil(low): low >= 1 keeps every draw a turn of at least one token (a
    # lower clip could draw a zero-token turn, which `Turn` rejects mid-generation).
    _distribution(instance, attribute, value)
    if not value.low >= 1:
        raise ValueError(
            f"{attribute.name} is a token count: its distribution needs low >= 1, got "
            f"low={value.low!r}"
        )


# aiperf 0.13 agentic-code defaults (read from the manifest it writes); subagents are this
# module's own.
_SESSION_CONTEXT = LogNormal(10_000, 5_000)
_NEW_TOKENS = LogNormal(3_500, 1_800)
_OUTPUT_TOKENS = LogNormal(500, 300)
_AGENTIC_DELAY_S = LogNormal(2.5, 1.8, low=0.01)
_HUMAN_DELAY_S = LogNormal(40.0, 25.0, low=0.01)
_SUBAGENT_CONTEXT = LogNormal(8_000, 4_000)


@attrs.frozen(kw_only=True)
class AgentXConfig:
    """Shape of the generated sessions. Token counts are tokens; delays seconds."""

    shared_prefix_tokens: int = attrs.field(default=32_000, validator=_non_negative_int)
    group_prefix_tokens: int = attrs.field(default=20_000, validator=_non_negative_int)
    num_groups: int = attrs.field(default=50, validator=_positive_int)
    group_zipf_alpha: float = attrs.field(default=1.2, validator=_positive)
    session_context: LogNormal = attrs.field(default=_SESSION_CONTEXT, validator=_token_count)
    new_tokens: LogNormal = attrs.field(default=_NEW_TOKENS, validator=_token_count)
    output_tokens: LogNormal = attrs.field(default=_OUTPUT_TOKENS, validator=_token_count)
    agentic_fraction: float = attrs.field(default=0.7, validator=_fraction)
    agentic_delay_s: LogNormal = attrs.field(default=_AGENTIC_DELAY_S, validator=_distribution)
    human_delay_s: LogNormal = attrs.field(default=_HUMAN_DELAY_S, validator=_distribution)
    max_prompt_tokens: int = attrs.field(default=200_000, validator=_positive_int)
    reset_probability: float = attrs.field(default=0.02, validator=_fraction)
    reset_context_scaling: float = attrs.field(default=2.0, validator=_non_negative)
    subagent_probability: float = attrs.field(default=0.03, validator=_fraction)
    subagents_per_burst: tuple[int, int] = attrs.field(default=(2, 4), converter=tuple)
    subagent_context: LogNormal = attrs.field(default=_SUBAGENT_CONTEXT, validator=_token_count)
    subagent_turns_mean: float = attrs.field(default=4.0, validator=_at_least_one)
    max_turns: int | None = attrs.field(default=None)
    block_size: int = attrs.field(default=512, validator=_positive_int)

    @subagents_per_burst.validator
    def _check_burst(self, attribute: attrs.Attribute, value: tuple[int, int]) -> None:
        if len(value) != 2 or not all(map(_is_int, value)) or not 1 <= value[0] <= value[1]:
            raise ValueError(
                f"subagents_per_burst must be integers (low, high) with 1 <= low <= high, got "
                f"{value}"
            )

    @max_turns.validator
    def _check_max_turns(self, attribute: attrs.Attribute, value: int | None) -> None:
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"max_turns must be an integer >= 1 or None, got {value!r}")

    def __attrs_post_init__(self) -> None:
        # A first prompt is the prefixes, in whole blocks, plus at least one token of its own,
        # and every prompt stays under the cap.
        prefixes = self.prefix_tokens
        if self.max_prompt_tokens < prefixes + 2:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) leaves no room after the shared "
                f"and group prefixes ({self.shared_prefix_tokens} + {self.group_prefix_tokens}, "
                f"{prefixes} tokens in whole blocks of {self.block_size})"
            )

    @property
    def prefix_tokens(self) -> int:
        """Tokens of the shared and group prefixes, each rounded up to whole blocks."""
        blocks = self.whole_blocks(self.shared_prefix_tokens)
        return (blocks + self.whole_blocks(self.group_prefix_tokens)) * self.block_size

    def first_context(self, prefix_tokens: int, sampled: int) -> int:
        """A first turn's own context after `prefix_tokens` of prefix: the sample, cut so that
        the first prompt stays under `max_prompt_tokens`."""
        return min(sampled, self.max_prompt_tokens - 1 - prefix_tokens)

    def whole_blocks(self, tokens: int) -> int:
        """Shared prefixes are whole trace blocks (a partial block is only ever a prompt's tail)."""
        return math.ceil(tokens / self.block_size)


class _Blocks:
    """Hands out fresh block ids in one session's namespace."""

    def __init__(self, index: int) -> None:
        self._next = _SESSION_BASE + index * _SESSION_SPAN

    def take(self, tokens: int, block_size: int) -> tuple[int, ...]:
        n = math.ceil(tokens / block_size)
        ids = tuple(range(self._next, self._next + n))
        self._next += n
        return ids


class AgentXWorkload:
    """An endless, reproducible stream of AgentX-style sessions."""

    def __init__(self, config: AgentXConfig | None = None, *, seed: int = 0) -> None:
        if not _is_int(seed) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.config = config or AgentXConfig()
        self.seed = seed
        self.block_size = self.config.block_size
        cfg = self.config
        ranks = np.arange(1, cfg.num_groups + 1, dtype=np.float64)
        weights = ranks**-cfg.group_zipf_alpha
        self._group_p = weights / weights.sum()
        self._shared = tuple(range(cfg.whole_blocks(cfg.shared_prefix_tokens)))
        self.name = f"agentx(seed={seed})"

    def __iter__(self) -> Iterator[Session]:
        return (self.session(i) for i in itertools.count())

    def take(self, n: int) -> Workload:
        """The first n sessions as a finite workload."""
        return Workload.of(
            [self.session(i) for i in range(n)], block_size=self.block_size, name=self.name
        )

    def session(self, index: int) -> Session:
        cfg = self.config
        rng = np.random.default_rng([self.seed, index])
        blocks = _Blocks(index)
        group = int(rng.choice(cfg.num_groups, p=self._group_p))
        group_blocks = cfg.whole_blocks(cfg.group_prefix_tokens)
        group_ids = tuple(_GROUP_BASE + group * _SESSION_SPAN + j for j in range(group_blocks))
        prefix = self._shared + group_ids
        own = cfg.first_context(len(prefix) * cfg.block_size, cfg.session_context.sample_int(rng))
        first_tokens = len(prefix) * cfg.block_size + own
        turns = [
            Turn(
                new_tokens=first_tokens,
                output_tokens=cfg.output_tokens.sample_int(rng),
                blocks=prefix + blocks.take(own, cfg.block_size),
            )
        ]
        context = first_tokens + turns[0].output_tokens
        sid = f"s{index}"
        while cfg.max_turns is None or len(turns) < cfg.max_turns:
            new = cfg.new_tokens.sample_int(rng)
            if context + new >= cfg.max_prompt_tokens:
                break  # forced retire: the next prompt would not fit
            ratio = (context + new) / cfg.max_prompt_tokens
            p_reset = cfg.reset_probability * (1.0 + (cfg.reset_context_scaling - 1.0) * ratio)
            if rng.random() < p_reset:
                break
            delay = self._delay(rng)
            out = cfg.output_tokens.sample_int(rng)
            subagents = ()
            if rng.random() < cfg.subagent_probability:
                low, high = cfg.subagents_per_burst
                count = int(rng.integers(low, high + 1))
                subagents = tuple(
                    self._subagent(rng, blocks, f"{sid}.t{len(turns)}.a{j}") for j in range(count)
                )
            turns.append(
                Turn(
                    new_tokens=new,
                    output_tokens=out,
                    delay_s=delay,
                    blocks=blocks.take(new, cfg.block_size),
                    subagents=subagents,
                )
            )
            context += new + out
        return Session(sid=sid, turns=tuple(turns), group=group)

    def _delay(self, rng: np.random.Generator) -> float:
        cfg = self.config
        if rng.random() < cfg.agentic_fraction:
            return cfg.agentic_delay_s.sample(rng)
        return cfg.human_delay_s.sample(rng)

    def _subagent(self, rng: np.random.Generator, blocks: _Blocks, sid: str) -> Session:
        """A short session from a fresh context: the shared prefix plus its own task."""
        cfg = self.config
        shared = len(self._shared) * cfg.block_size
        task = cfg.first_context(shared, cfg.subagent_context.sample_int(rng))
        first = Turn(
            new_tokens=shared + task,
            output_tokens=cfg.output_tokens.sample_int(rng),
            blocks=self._shared + blocks.take(task, cfg.block_size),
        )
        turns = [first]
        context = first.new_tokens + first.output_tokens
        n_turns = int(rng.geometric(1.0 / cfg.subagent_turns_mean))
        for _ in range(n_turns - 1):
            new = cfg.new_tokens.sample_int(rng)
            if context + new >= cfg.max_prompt_tokens:
                break
            out = cfg.output_tokens.sample_int(rng)
            turns.append(
                Turn(
                    new_tokens=new,
                    output_tokens=out,
                    delay_s=cfg.agentic_delay_s.sample(rng),
                    blocks=blocks.take(new, cfg.block_size),
                )
            )
            context += new + out
        return Session(sid=sid, turns=tuple(turns), kind="subagent")
