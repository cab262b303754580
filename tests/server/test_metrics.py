"""The Prometheus exposition: histograms fold each engine sample once, across scrapes and
across a reset of the engine's metrics."""

from tokenspeed.runtime.load import LoadSnapshot
from tokenspeed.runtime.metrics import EngineMetrics
from tokenspeed.server.metrics import ServerMetrics

IDLE = LoadSnapshot(0, 0, 0, 0, 10, 0, 0, 10)


def values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_histograms_count_each_sample_once():
    metrics, engine = ServerMetrics(), EngineMetrics()
    engine.ttfts += [0.003, 0.03, 3.0]
    first = values(metrics.render(engine, IDLE, None))
    assert first["tokenspeed_time_to_first_token_seconds_count"] == 3
    assert first['tokenspeed_time_to_first_token_seconds_bucket{le="0.005"}'] == 1
    assert first['tokenspeed_time_to_first_token_seconds_bucket{le="0.04"}'] == 2
    assert first['tokenspeed_time_to_first_token_seconds_bucket{le="+Inf"}'] == 3
    assert abs(first["tokenspeed_time_to_first_token_seconds_sum"] - 3.033) < 1e-9
    engine.ttfts.append(0.5)
    assert (
        values(metrics.render(engine, IDLE, None))["tokenspeed_time_to_first_token_seconds_count"]
        == 4
    )
    fresh = EngineMetrics()  # Engine.reset_metrics(): new lists
    fresh.ttfts.append(0.001)
    after = values(metrics.render(fresh, IDLE, None))
    assert after["tokenspeed_time_to_first_token_seconds_count"] == 5
    assert after['tokenspeed_cache_pages{state="free"}'] == 10
    assert "tokenspeed_l2_puts_total" not in after  # no cache stats given


def test_folding_drops_the_samples_from_the_engine():
    """A long-running server keeps its engine's sample lists short: each fold (every few
    seconds, and every scrape) moves the samples into the histograms."""
    metrics, engine = ServerMetrics(), EngineMetrics()
    engine.ttfts += [0.1] * 1000
    engine.itls += [0.01] * 5000
    metrics.fold(engine)
    assert engine.ttfts == [] and engine.itls == []
    engine.itls.append(0.02)
    got = values(metrics.render(engine, IDLE, None))
    assert got["tokenspeed_time_to_first_token_seconds_count"] == 1000
    assert got["tokenspeed_inter_token_latency_seconds_count"] == 5001
    assert engine.itls == []
