"""Sampling helpers stated the way workload papers and aiperf state them: mean and median."""

from __future__ import annotations

import math

import attrs
import numpy as np


@attrs.frozen
class LogNormal:
    """A lognormal given by its mean and median (mean > median > 0), optionally clipped to
    [low, high] (0 <= low <= high, low finite). `sample_int` never returns less than ceil(low): a
    token count needs low >= 1."""

    mean: float
    median: float
    low: float = 1.0
    high: float = math.inf

    def __attrs_post_init__(self) -> None:
        moments = (self.mean, self.median)
        if any(isinstance(m, bool) or not isinstance(m, int | float) for m in moments) or not (
            math.inf > self.mean > self.median > 0
        ):
            raise ValueError(
                f"lognormal needs finite mean > median > 0, got {self.mean!r}, {self.median!r}"
            )
        bounds = (self.low, self.high)
        if any(isinstance(b, bool) or not isinstance(b, int | float) for b in bounds) or not (
            0 <= self.low <= self.high and math.isfinite(self.low)
        ):
            raise ValueError(
                f"lognormal needs clip bounds 0 <= low <= high with a finite low, got "
                f"low={self.low!r}, high={self.high!r}"
            )

    @property
    def mu(self) -> float:
        return math.log(self.median)

    @property
    def sigma(self) -> float:
        # mean = exp(mu + sigma^2 / 2) and median = exp(mu).
        return math.sqrt(2.0 * math.log(self.mean / self.median))

    def sample(self, rng: np.random.Generator) -> float:
        return float(min(max(rng.lognormal(self.mu, self.sigma), self.low), self.high))

    def sample_int(self, rng: np.random.Generator) -> int:
        return max(round(self.sample(rng)), math.ceil(self.low))
