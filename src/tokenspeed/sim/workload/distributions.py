"""Sampling helpers stated the way workload papers and aiperf state them: mean and median."""

from __future__ import annotations

import math

import attrs
import numpy as np


@attrs.frozen
class LogNormal:
    """A lognormal given by its mean and median (mean > median > 0), optionally clipped."""

    mean: float
    median: float
    low: float = 1.0
    high: float = math.inf

    def __attrs_post_init__(self) -> None:
        if not math.inf > self.mean > self.median > 0:
            raise ValueError(
                f"lognormal needs finite mean > median > 0, got {self.mean}, {self.median}"
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
