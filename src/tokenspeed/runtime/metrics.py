"""Engine-wide serving metrics: time to first token, inter-token latency, prefix hit rate."""

from __future__ import annotations

import attrs


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@attrs.define
class EngineMetrics:
    """Counters since the engine started (seconds on a monotonic clock)."""

    steps: int = 0
    prefill_tokens: int = 0  # tokens computed by prefill chunks
    decode_tokens: int = 0  # rows of decode steps
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_tokens: int = 0  # of those, served from the prefix cache
    busy_seconds: float = 0.0
    queue_depth: int = 0
    ttfts: list[float] = attrs.Factory(list)
    itls: list[float] = attrs.Factory(list)

    def record_step(self, plan, seconds: float, steps: int = 1) -> None:
        """A plan's forwards: one, or `steps` decode steps of a multi-step run."""
        self.steps += steps
        self.busy_seconds += seconds
        if plan.prefill is not None:
            self.prefill_tokens += plan.prefill.num_tokens
        if plan.decode is not None:
            self.decode_tokens += plan.decode.size * steps

    def record_admission(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def record_ttft(self, seconds: float) -> None:
        self.ttfts.append(seconds)

    def record_itl(self, seconds: float) -> None:
        self.itls.append(seconds)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, float | None]:
        p90_itl = percentile(self.itls, 90)
        return {
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "prefix_hit_rate": self.hit_rate,
            "ttft_mean_s": sum(self.ttfts) / len(self.ttfts) if self.ttfts else None,
            "ttft_p90_s": percentile(self.ttfts, 90),
            "itl_p90_s": p90_itl,
            "p90_interactivity_tok_s": 1.0 / p90_itl if p90_itl else None,
            "queue_depth": self.queue_depth,
        }
