"""Engine metrics: percentiles and the per-request interactivity, as the simulator has them."""

import pytest

from tokenspeed.runtime.metrics import EngineMetrics, percentile
from tokenspeed.sim.cluster.records import percentile as sim_percentile


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [0.5, 4.0, 1.0, 2.5, 9.0, 0.1, 7.0]])
def test_percentiles_are_the_simulators(values, q):
    assert percentile(values, q) == pytest.approx(sim_percentile(values, q))


def test_percentile_of_nothing_is_none():
    assert percentile([], 90) is None


def test_p90_interactivity_is_one_over_the_p90_of_per_request_mean_itls():
    metrics = EngineMetrics()
    metrics.record_finished(10.0, 11.0, 11)  # 10 tokens/s
    metrics.record_finished(0.0, 1.0, 3)  # 2 tokens/s
    metrics.record_finished(5.0, 5.0, 4)  # all at once: no interactivity
    metrics.record_finished(5.0, 6.0, 1)  # one token: none either
    metrics.record_finished(None, None, 0)  # no token at all
    assert metrics.request_itls == [0.1, 0.5]
    p90 = 0.1 + 0.9 * (0.5 - 0.1)
    assert metrics.summary()["p90_interactivity_tok_s"] == pytest.approx(1 / p90)
