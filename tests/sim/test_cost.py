import json

import pytest

from tokenspeed.sim.cost import Grid, LinearCostModel, TableCostModel, attention_pairs


def test_attention_pairs_count_causal_pairs():
    # 3 new tokens after 10 cached: they see 11, 12 and 13 keys.
    assert attention_pairs([(10, 13)]) == 11 + 12 + 13
    assert attention_pairs([(0, 1), (5, 6)]) == 1 + 6


def test_linear_model_grows_with_work():
    m = LinearCostModel()
    assert m.prefill_time([(0, 1000)]) < m.prefill_time([(0, 2000)])
    # The same new tokens cost more after a long cached prefix (attention).
    assert m.prefill_time([(0, 4000)]) < m.prefill_time([(100_000, 104_000)])
    assert m.decode_step_time(8, 8, 10_000) < m.decode_step_time(8, 8, 1_000_000)
    # Padding rows cost like real rows; they read no history.
    assert m.decode_step_time(5, 8, 1000) == m.decode_step_time(8, 8, 1000)
    assert m.transfer_time(50_000_000_000) == pytest.approx(1.0 + m.transfer_latency_s)
    assert m.load_time(100_000_000_000) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="transfer_bytes_per_s"):
        LinearCostModel(transfer_bytes_per_s=0)
    with pytest.raises(ValueError, match="decode_base_s"):
        LinearCostModel(decode_base_s=-1)


def test_grid_is_exact_on_points_and_bilinear_between():
    g = Grid((1.0, 3.0), (0.0, 10.0), ((1.0, 2.0), (3.0, 6.0)))
    assert g(1, 0) == 1 and g(3, 10) == 6
    assert g(2, 5) == pytest.approx((1 + 2 + 3 + 6) / 4)
    assert g(5, 0) == pytest.approx(5.0)  # linear extension past the last point
    with pytest.raises(ValueError, match="strictly increasing"):
        Grid((2.0, 1.0), (0.0,), ((1.0,), (2.0,)))
    with pytest.raises(ValueError, match="needs 2 entries"):
        Grid((1.0,), (0.0, 1.0), ((1.0,),))


def test_table_model_from_measured_json(tmp_path):
    table = {
        "prefill": {
            "tokens": [1024, 16384],
            "mean_context": [0, 100000],
            "seconds": [[0.02, 0.08], [0.3, 1.2]],
        },
        "decode": {
            "padded_rows": [1, 64],
            "mean_history": [1000, 100000],
            "seconds": [[0.010, 0.012], [0.015, 0.040]],
        },
        "transfer_bytes_per_s": 25e9,
    }
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(table))
    m = TableCostModel.from_file(path)
    assert m.prefill_time([(0, 1024)]) == pytest.approx(0.02)
    assert m.prefill_time([(100_000, 116_384)]) == pytest.approx(1.2)
    assert m.decode_step_time(64, 64, 64 * 100_000) == pytest.approx(0.040)
    assert m.transfer_time(25_000_000_000) == pytest.approx(1.0 + m.transfer_latency_s)
    path.write_text(json.dumps({"prefill": table["prefill"]}))
    with pytest.raises(ValueError, match="'decode' section"):
        TableCostModel.from_file(path)


def test_arithmetic_run_ends_are_the_listed_series_exactly():
    import bisect

    from tokenspeed.sim.cost import ArithmeticEnds, LinearCostModel, decode_run_ends

    model = LinearCostModel()
    ends = decode_run_ends(model, 30, 32, 123_456, 500)
    assert isinstance(ends, ArithmeticEnds) and len(ends) == 500
    first = model.decode_step_time(30, 32, 123_456)
    growth = model.decode_per_history_token_s * 30
    listed = [k * first + growth * k * (k - 1) / 2 for k in range(1, 501)]
    assert list(ends) == listed and ends[-1] == listed[-1]  # the same floats, bit for bit
    for t in (0.0, listed[0], listed[7] - 1e-12, listed[7], listed[-1] + 1.0):
        assert bisect.bisect_left(ends, t) == bisect.bisect_left(listed, t)
    stepwise, total = [], 0.0  # and the model's step times, summed one by one
    for i in range(500):
        total += model.decode_step_time(30, 32, 123_456 + i * 30)
        stepwise.append(total)
    assert max(abs(a - b) for a, b in zip(ends, stepwise, strict=True)) < 1e-9 * total
