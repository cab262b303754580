"""GET /metrics: the engine's serving metrics in Prometheus' text format (version 0.0.4).

Histograms of time to first token and inter-token latency are folded from the engine's own
samples (`EngineMetrics.ttfts` / `itls`), each sample once: `ServerMetrics.fold` moves the
samples recorded since the previous fold into the histograms and drops them from the engine's
lists, so that a long-running server's lists stay short (the app folds every few seconds and at
every scrape; an engine whose metrics were reset starts afresh). Gauges come from the
load snapshot (running and queued requests, outstanding tokens, device pages) and the engine's
prefix hit rate; counters from the engine (tokens, steps) and from the cache's statistics (hits
and traffic of the host tier, L2), and from the server itself (responses by status).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence

from tokenspeed.runtime.load import LoadSnapshot
from tokenspeed.runtime.metrics import EngineMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "tokenspeed_"

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = PREFIX + name
        self.help = help_text
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe_many(self, values: Sequence[float]) -> None:
        for value in values:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
        self.count += len(values)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_number(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def _drain(samples: list[float]) -> list[float]:
    """The samples in the list now, removed from it (the engine's thread may append meanwhile:
    those stay for the next fold)."""
    n = len(samples)
    taken = samples[:n]
    del samples[:n]
    return taken


class ServerMetrics:
    """Folds the engine's samples and renders the exposition; `responses` counts HTTP answers
    by status (the app's middleware adds to it)."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS
        )
        self.itl = Histogram(
            "inter_token_latency_seconds", "Time between two tokens of a request.", ITL_BUCKETS
        )
        self.responses: Counter[int] = Counter()

    def fold(self, engine: EngineMetrics) -> None:
        """Move the engine's new latency samples into the histograms."""
        self.ttft.observe_many(_drain(engine.ttfts))
        self.itl.observe_many(_drain(engine.itls))

    def render(self, engine: EngineMetrics, load: LoadSnapshot, cache) -> str:
        """cache: the cache's `CacheStats` (None: omitted)."""
        self.fold(engine)
        lines = [*self.ttft.render(), *self.itl.render()]
        gauge = _writer(lines, "gauge")
        counter = _writer(lines, "counter")
        gauge("requests_running", "Requests admitted (prefilling or decoding).", load.running)
        gauge("requests_waiting", "Requests queued for admission (the queue depth).", load.waiting)
        gauge(
            "outstanding_tokens",
            "Prompt tokens still to compute plus tokens still to generate (at most).",
            load.outstanding_tokens,
        )
        gauge(
            "cache_pages",
            "Device-tier pages by state (used: held; cached: evictable; free).",
            {"used": load.used_pages, "cached": load.cached_pages, "free": load.free_pages},
            label="state",
        )
        gauge("cache_pages_total", "Usable device-tier pages.", load.total_pages)
        gauge("prefix_hit_rate", "Prompt tokens served from the prefix cache.", engine.hit_rate)
        counter("prompt_tokens_total", "Prompt tokens of admitted requests.", engine.prompt_tokens)
        counter(
            "prefix_cached_tokens_total",
            "Prompt tokens served from the prefix cache.",
            engine.cached_tokens,
        )
        counter("prefill_tokens_total", "Tokens computed by prefill.", engine.prefill_tokens)
        counter("decode_tokens_total", "Rows of decode steps.", engine.decode_tokens)
        counter("engine_steps_total", "Engine forwards.", engine.steps)
        if cache is not None:
            c = cache.counters
            counter(
                "l2_hit_tokens_total", "Prompt tokens loaded from the host tier.", c.l2_hit_tokens
            )
            counter("l2_bytes_loaded_total", "Host -> device bytes of L2 hits.", c.bytes_loaded)
            counter(
                "l2_objects_published_total",
                "Objects written through to L2 at turn ends.",
                c.objects_published,
            )
            counter(
                "l2_written_back_total",
                "Objects written back to L2 on eviction.",
                {"page": c.pages_written_back, "checkpoint": c.checkpoints_written_back},
                label="kind",
            )
            counter(
                "l2_fetch_failures_total",
                "L2 hits lost to unreadable objects.",
                c.l2_fetch_failures,
            )
            if cache.l2 is not None:
                l2 = cache.l2
                counter("l2_puts_total", "Objects stored in L2.", l2.puts)
                counter("l2_put_bytes_total", "Bytes stored in L2.", l2.put_bytes)
                counter("l2_get_bytes_total", "Bytes read from L2.", l2.get_bytes)
                counter(
                    "l2_gets_total",
                    "L2 reads by outcome.",
                    {"hit": l2.hits, "miss": l2.misses},
                    label="result",
                )
                counter("l2_errors_total", "L2 backend failures.", l2.errors)
        counter(
            "http_responses_total",
            "HTTP responses by status.",
            {str(k): v for k, v in sorted(self.responses.items())},
            label="status",
        )
        return "\n".join(lines) + "\n"


def _writer(lines: list[str], kind: str):
    def write(name: str, help_text: str, value, label: str | None = None) -> None:
        name = PREFIX + name
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        if isinstance(value, dict):
            for key, v in value.items():
                lines.append(f'{name}{{{label}="{key}"}} {_number(v)}')
        else:
            lines.append(f"{name} {_number(value)}")

    return write


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
