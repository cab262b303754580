"""`SamplingParams`: how to pick tokens for one request, with the conventions vLLM users know."""

from __future__ import annotations

import math

import attrs
from attrs import field, frozen

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily: dividing logits by less overflows fp32 into NaNs."""


class SamplingError(ValueError):
    """Sampling parameters that cannot be honoured; the message names the field."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise SamplingError(message)


def _finite(value) -> bool:
    """A real number that fits a float and is not inf or NaN (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the float range
        return False


def is_int(value) -> bool:
    """An int that is not a bool: True is an int to Python but never a count or an id here."""
    return isinstance(value, int) and not isinstance(value, bool)


def _tuple(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str | int):
        return (value,)
    return tuple(value)


@frozen(kw_only=True)
class SamplingParams:
    """temperature 0 (or below 1e-5) is greedy. top_k <= 0 (or >= the vocabulary) and top_p 1.0
    disable those filters. max_tokens counts generated tokens. stop: strings that end the output
    (not included in it); stop_token_ids: token ids that end it (included in token_ids, like
    EOS). ignore_eos keeps generating past the model's EOS. seed makes a sampled request
    reproducible whatever it is batched with. logprobs: also return the log-probability of each
    sampled token (from the model's logits, before penalties, temperature and filters, as vLLM's
    default) and of the top `logprobs`.

    As in vLLM: n: completions per prompt (`LLM.generate` returns them in one `RequestOutput`;
    completion i of a seeded request uses seed + i; an `Engine` request is one completion).
    presence_penalty, frequency_penalty in [-2, 2]: subtracted from the logit of each token
    already in the output, once (presence) and once per occurrence (frequency). repetition_penalty
    > 0 (1.0: off): the logit of each token in the prompt or the output is divided by it when
    positive, multiplied by it otherwise. min_tokens: until the output has that many tokens, EOS
    (even with ignore_eos) and stop_token_ids cannot be sampled, and no stop string ends it (a
    stop string counts once it ends in the text of a later token).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default=(), converter=_tuple)
    stop_token_ids: tuple[int, ...] = field(default=(), converter=_tuple)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        _check(
            _finite(self.temperature) and self.temperature >= 0,
            f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        _check(
            _finite(self.top_p) and 0 < self.top_p <= 1,
            f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            is_int(self.top_k) and -(1 << 63) <= self.top_k < (1 << 63),
            f"SamplingParams.top_k must be an int in [-2^63, 2^63), got {self.top_k!r}",
        )
        _check(
            is_int(self.max_tokens) and self.max_tokens >= 1,
            f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}",
        )
        _check(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"SamplingParams.stop_token_ids must hold token ids, got {self.stop_token_ids!r}",
        )
        _check(
            self.seed is None or (is_int(self.seed) and -(1 << 63) <= self.seed < (1 << 64)),
            f"SamplingParams.seed must be None or an int in [-2^63, 2^64), got {self.seed!r}",
        )
        _check(
            self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0),
            f"SamplingParams.logprobs must be None or an int >= 0, got {self.logprobs!r}",
        )
        _check(
            is_int(self.n) and self.n >= 1,
            f"SamplingParams.n must be an int >= 1, got {self.n!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _finite(value) and -2 <= value <= 2,
                f"SamplingParams.{name} must be a number in [-2, 2], got {value!r}",
            )
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "SamplingParams.repetition_penalty must be a finite number > 0 (1.0: off), "
            f"got {self.repetition_penalty!r}",
        )
        _check(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"SamplingParams.min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
            f"got {self.min_tokens!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether presence, frequency or repetition penalties change this request's logits."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def evolve(self, **changes) -> SamplingParams:
        return attrs.evolve(self, **changes)
