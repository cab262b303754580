"""What the simulator records per request, and the AgentX-style scores computed from it.

Scores (docs/sim.md defines each):
- output tokens/s per GPU, including the drain: finished output tokens / (end of the last request
  - start) / GPUs;
- interactivity of a request = 1 / its mean inter-token latency; "P90 interactivity" is the
  interactivity that 90% of requests reach or beat (1 / P90 of ITL);
- TTFT mean and P90 (arrival to first token at the client);
- prefill cache hit rate: prompt tokens reused / prompt tokens prefilled (token-weighted);
- queue time per stage: prefill queue (arrival to first chunk), decode admission (arrival to
  destination reserved), pinned (prefill done to transfer start), decode queue (first token to
  first decode step).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import attrs


@attrs.define(slots=True)
class RequestRecord:
    rid: Hashable
    session: str
    kind: str
    arrival: float
    prompt_tokens: int
    output_tokens: int  # as asked by the workload
    prefill_start: float | None = None  # first chunk scheduled (first admission)
    prefill_end: float | None = None
    decode_admitted: float | None = None
    transfer_start: float | None = None
    first_token: float | None = None
    first_decode_step: float | None = None
    finish: float | None = None
    cached_tokens: int = 0  # prefix reused, summed over its prefill admissions
    prefilled_tokens: int = 0  # prefill targets, summed over its prefill admissions
    generated: int = 0
    preemptions: int = 0
    abort_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None and self.abort_reason is None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@attrs.frozen(kw_only=True)
class Summary:
    requests_issued: int
    requests_finished: int
    requests_aborted: int
    preemptions: int
    output_tokens: int
    makespan_s: float
    num_gpus: int
    throughput_per_gpu: float  # output tokens / s / GPU, drain included
    p90_interactivity: float  # tokens / s / user
    median_interactivity: float
    ttft_mean_s: float
    ttft_p90_s: float
    hit_rate: float
    prefill_queue_mean_s: float
    decode_admission_mean_s: float
    pinned_mean_s: float
    decode_queue_mean_s: float
    events: int
    wall_s: float  # of the event loop
    cpu_s: float  # process CPU time of the event loop (one core: the loop is single-threaded)

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else math.nan

    def as_dict(self) -> dict:
        d = attrs.asdict(self)
        d["events_per_s"] = self.events_per_s
        return d


def summarize(
    records: Sequence[RequestRecord],
    *,
    start: float,
    num_gpus: int,
    events: int,
    wall_s: float,
    cpu_s: float = 0.0,
) -> Summary:
    done = [r for r in records if r.finished]
    end = max((r.finish for r in records if r.finish is not None), default=start)
    makespan = max(end - start, 0.0)
    out = sum(r.generated for r in done)
    itl = [
        (r.finish - r.first_token) / (r.generated - 1)
        for r in done
        if r.generated > 1 and r.first_token is not None and r.finish > r.first_token
    ]
    ttft = [r.first_token - r.arrival for r in done if r.first_token is not None]
    prefilled = sum(r.prefilled_tokens for r in records)
    return Summary(
        requests_issued=len(records),
        requests_finished=len(done),
        requests_aborted=sum(r.abort_reason is not None for r in records),
        preemptions=sum(r.preemptions for r in records),
        output_tokens=out,
        makespan_s=makespan,
        num_gpus=num_gpus,
        throughput_per_gpu=out / makespan / num_gpus if makespan > 0 else 0.0,
        p90_interactivity=1.0 / percentile(itl, 90) if itl else math.nan,
        median_interactivity=1.0 / percentile(itl, 50) if itl else math.nan,
        ttft_mean_s=_mean(ttft),
        ttft_p90_s=percentile(ttft, 90),
        hit_rate=sum(r.cached_tokens for r in records) / prefilled if prefilled else 0.0,
        prefill_queue_mean_s=_mean(
            [r.prefill_start - r.arrival for r in records if r.prefill_start is not None]
        ),
        decode_admission_mean_s=_mean(
            [r.decode_admitted - r.arrival for r in records if r.decode_admitted is not None]
        ),
        pinned_mean_s=_mean(
            [
                r.transfer_start - r.prefill_end
                for r in records
                if r.transfer_start is not None and r.prefill_end is not None
            ]
        ),
        decode_queue_mean_s=_mean(
            [
                r.first_decode_step - r.first_token
                for r in records
                if r.first_decode_step is not None and r.first_token is not None
            ]
        ),
        events=events,
        wall_s=wall_s,
        cpu_s=cpu_s,
    )


def hit_rate_series(
    records: Sequence[RequestRecord], *, start: float, bucket_s: float
) -> list[tuple[float, float]]:
    """(bucket start, hit rate of the prefills admitted in it) over time."""
    cached: dict[int, int] = {}
    total: dict[int, int] = {}
    for r in records:
        if r.prefill_start is None or not r.prefilled_tokens:
            continue
        b = int((r.prefill_start - start) // bucket_s)
        cached[b] = cached.get(b, 0) + r.cached_tokens
        total[b] = total.get(b, 0) + r.prefilled_tokens
    return [(start + b * bucket_s, cached[b] / total[b]) for b in sorted(total)]
