import math

import pytest

from tokenspeed.sim.cluster.records import (
    RequestRecord,
    hit_rate_series,
    percentile,
    summarize,
)


def _rec(rid, arrival, first, finish, out, cached=0, prefilled=100, start=None, **kw):
    return RequestRecord(
        rid=rid,
        session="s",
        kind="main",
        arrival=arrival,
        prompt_tokens=100,
        output_tokens=out,
        first_token=first,
        finish=finish,
        generated=out,
        cached_tokens=cached,
        prefilled_tokens=prefilled,
        prefill_start=arrival if start is None else start,
        **kw,
    )


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([0, 10], 90) == pytest.approx(9.0)
    assert math.isnan(percentile([], 90))


def test_scores_follow_their_definitions():
    recs = [
        _rec(0, 0.0, 1.0, 11.0, 11, cached=90),  # ITL 1.0 s
        _rec(1, 0.0, 2.0, 7.0, 11, cached=50),  # ITL 0.5 s
        _rec(2, 5.0, 5.5, 20.0, 30, cached=0, prefill_end=5.2, transfer_start=5.4),
        _rec(3, 6.0, None, 8.0, 0, abort_reason="client gone"),
    ]
    recs[3].generated = 0
    s = summarize(recs, start=0.0, num_gpus=2, events=10, wall_s=2.0)
    assert s.requests_issued == 4 and s.requests_finished == 3 and s.requests_aborted == 1
    # Drain included: the window ends when the last request finished (20 s).
    assert s.makespan_s == 20.0
    assert s.throughput_per_gpu == pytest.approx((11 + 11 + 30) / 20.0 / 2)
    itl = sorted([1.0, 0.5, 14.5 / 29])
    assert s.p90_interactivity == pytest.approx(1.0 / percentile(itl, 90))
    assert s.ttft_mean_s == pytest.approx((1.0 + 2.0 + 0.5) / 3)
    # Token-weighted hit rate over every prefill admission, aborted requests included.
    assert s.hit_rate == pytest.approx(140 / 400)
    assert s.pinned_mean_s == pytest.approx(0.2)
    assert s.events_per_s == 5.0


def test_hit_rate_over_time_buckets_by_admission():
    recs = [
        _rec(0, 0.0, 1, 2, 2, cached=50, start=10.0),
        _rec(1, 0.0, 1, 2, 2, cached=100, start=70.0),
        _rec(2, 0.0, 1, 2, 2, cached=0, start=75.0),
    ]
    assert hit_rate_series(recs, start=0.0, bucket_s=60.0) == [(0.0, 0.5), (60.0, 0.5)]
