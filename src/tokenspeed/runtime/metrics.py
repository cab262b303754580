"""Engine-wide serving metrics: time to first token, inter-token latency, prefix hit rate.

Interactivity is scored as the simulator scores it (`tokenspeed.sim.cluster.records`), so that
engine runs and simulated ones compare: a finished (not aborted) request with two tokens or more
has an interactivity of 1 / its mean inter-token latency (first token to last), and P90
interactivity is the value 90% of those requests reach or beat, 1 / the P90 of their mean ITLs.
`itl_p90_s` stays per token. Percentiles interpolate linearly between samples, as the
simulator's do.
"""

from __future__ import annotations

import attrs


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]), the simulator's; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


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
    itls: list[float] = attrs.Factory(list)  # one per token after a request's first
    request_itls: list[float] = attrs.Factory(list)  # one per finished request: its mean ITL
    # Speculative decoding (docs/spec.md): verify rows (a request with drafts in a step), the
    # tokens they emitted, and per draft position j the drafts proposed and accepted there.
    spec_verify_rows: int = 0
    spec_emitted_tokens: int = 0
    spec_proposed: list[int] = attrs.Factory(list)
    spec_accepted: list[int] = attrs.Factory(list)

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

    def record_run_itls(self, prev, first_token_time, last_token_time, new: int) -> None:
        """A multi-step run's `new` tokens of one request reached the host together: each gets
        an equal share of the time since the request's previous token (`prev`; None when the
        run's first token was the request's first, a TTFT) as its inter-token latency (the
        first would get it all and the rest about nothing, which makes P90 ITL meaningless)."""
        if prev is None:
            prev, new = first_token_time, new - 1
        for _ in range(new):
            self.record_itl((last_token_time - prev) / new)

    def record_finished(self, first_token_time, last_token_time, tokens: int) -> None:
        """A request that finished (not aborted) with `tokens` output tokens. Its mean ITL is
        what a user of it saw; one token, or all tokens at once, has none (as in the sim)."""
        if tokens > 1 and first_token_time is not None and last_token_time > first_token_time:
            self.request_itls.append((last_token_time - first_token_time) / (tokens - 1))

    def record_verify(self, num_draft: int, num_emitted: int) -> None:
        """One request's verify step: `num_draft` drafts, `num_emitted` tokens emitted (the
        accepted drafts and one more; tokens after a stop inside them still count)."""
        grow = num_draft - len(self.spec_proposed)
        if grow > 0:
            self.spec_proposed.extend([0] * grow)
            self.spec_accepted.extend([0] * grow)
        self.spec_verify_rows += 1
        self.spec_emitted_tokens += num_emitted
        for j in range(num_draft):
            self.spec_proposed[j] += 1
            self.spec_accepted[j] += j < num_emitted - 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify row (1 .. k + 1); None before any."""
        if not self.spec_verify_rows:
            return None
        return self.spec_emitted_tokens / self.spec_verify_rows

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position j: the fraction of drafts proposed there that were accepted."""
        return [
            a / p if p else 0.0 for a, p in zip(self.spec_accepted, self.spec_proposed, strict=True)
        ]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, float | list[float] | None]:
        p90_request_itl = percentile(self.request_itls, 90)
        return {
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "prefix_hit_rate": self.hit_rate,
            "ttft_mean_s": sum(self.ttfts) / len(self.ttfts) if self.ttfts else None,
            "ttft_p90_s": percentile(self.ttfts, 90),
            "itl_p90_s": percentile(self.itls, 90),  # per token
            # Per request, as AgentX and the simulator score it (see the module docstring).
            "p90_interactivity_tok_s": 1.0 / p90_request_itl if p90_request_itl else None,
            "queue_depth": self.queue_depth,
            # Only once a step speculated: plain engines report what they always did.
            **(
                {
                    "spec_mean_acceptance_length": self.mean_acceptance_length,
                    "spec_acceptance_rates": self.acceptance_rates,
                }
                if self.spec_verify_rows
                else {}
            ),
        }
