"""`SpeculativeConfig`: how an engine speculates (docs/spec.md, section 5)."""

from __future__ import annotations

from attrs import field, frozen

from ..sampling_params import is_int

# A verify step feeds the target at most this many tokens per row (the last token and k drafts):
# KDA's recurrent form and its fused decode kernel take 1..4 (`RECURRENT_MAX_TOKENS`).
MAX_VERIFY_TOKENS = 4
METHODS = ("ngram", "eagle3")


class SpeculativeConfigError(ValueError):
    """A speculative-decoding configuration that cannot work; the message names the field."""


def _int_in(lo: int, hi: int | None):
    def check(instance, attribute, value) -> None:
        if value is None and attribute.name == "forced_acceptance":
            return
        if not is_int(value) or value < lo or (hi is not None and value > hi):
            bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise SpeculativeConfigError(
                f"SpeculativeConfig.{attribute.name} must be an integer in {bound}, got {value!r}"
            )

    return check


@frozen(kw_only=True)
class SpeculativeConfig:
    """Speculative decoding of an engine's decode rows.

    method: "ngram" (prompt lookup over the request's own history: no weights; min_n..max_n
        token n-grams, longest first) or "eagle3" (an EAGLE3 drafter at `draft_model`, a
        checkpoint directory in the Hugging Face layout; the engine loads it against its model
        and refuses one that cannot draft for it).
    num_steps: k, the tokens drafted per request and step (1..3: a verify step feeds the target
        the last token and k drafts, at most 4 tokens per row).
    forced_acceptance: BENCHMARK ONLY. Accept exactly this many drafts (0..num_steps) per row and
        step whatever the target says (rows with fewer drafts are padded with filler drafts),
        so that the engine can be timed at a fixed acceptance length. The OUTPUT IS NOT THE
        MODEL'S. None (the default): real verification.
    """

    method: str = "ngram"
    num_steps: int = field(default=3, validator=_int_in(1, MAX_VERIFY_TOKENS - 1))
    min_n: int = field(default=1, validator=_int_in(1, None))
    max_n: int = field(default=3, validator=_int_in(1, None))
    draft_model: str | None = None
    forced_acceptance: int | None = field(default=None, validator=_int_in(0, None))

    def __attrs_post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"SpeculativeConfig.method must be one of {METHODS}, got {self.method!r}"
            )
        if self.min_n > self.max_n:
            raise SpeculativeConfigError(
                f"SpeculativeConfig.min_n ({self.min_n}) exceeds max_n ({self.max_n})"
            )
        if self.method == "eagle3" and not self.draft_model:
            raise SpeculativeConfigError("SpeculativeConfig.draft_model is required for eagle3")
        if self.method == "ngram" and self.draft_model is not None:
            raise SpeculativeConfigError("SpeculativeConfig.draft_model is for eagle3 only")
        if self.forced_acceptance is not None and self.forced_acceptance > self.num_steps:
            raise SpeculativeConfigError(
                f"SpeculativeConfig.forced_acceptance ({self.forced_acceptance}) exceeds "
                f"num_steps ({self.num_steps})"
            )
