"""Speculative decoding, the engine-independent parts: the n-gram (prompt-lookup) proposer and
the acceptance rules of a verify step (greedy, rejection sampling, and the benchmark-only forced
acceptance). The EAGLE3 drafter is a model (`tokenspeed.model.eagle3`). docs/spec.md."""

from .acceptance import (
    Acceptance,
    accept_draft,
    forced_acceptance,
    greedy_accept,
    rejection_accept,
    target_probs,
    verify,
)
from .config import MAX_VERIFY_TOKENS, SpeculativeConfig, SpeculativeConfigError
from .ngram import NgramIndex, NgramProposer
from .proposer import NgramDrafts, Proposer

__all__ = [
    "MAX_VERIFY_TOKENS",
    "Acceptance",
    "NgramDrafts",
    "NgramIndex",
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "accept_draft",
    "forced_acceptance",
    "greedy_accept",
    "rejection_accept",
    "target_probs",
    "verify",
]
