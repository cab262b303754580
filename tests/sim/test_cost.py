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


_SECONDS = [[1, 2], [3, 4]]
_GOOD_TABLE = {
    "prefill": {"tokens": [1024, 16384], "mean_context": [0, 131072], "seconds": _SECONDS},
    "decode": {"padded_rows": [1, 128], "mean_history": [4096, 200000], "seconds": _SECONDS},
}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        # A NaN or infinite entry would make every time after it NaN and the run "succeed".
        (
            {**_GOOD_TABLE, "decode": {**_GOOD_TABLE["decode"], "seconds": [[1, "NaN"], [3, 4]]}},
            r"decode: cost table seconds\[0\]\[1\] must be finite and >= 0, got nan",
        ),
        (
            {**_GOOD_TABLE, "prefill": {**_GOOD_TABLE["prefill"], "seconds": [[1, 2], [-3, 4]]}},
            r"prefill: cost table seconds\[1\]\[0\] must be finite and >= 0, got -3",
        ),
        (
            {**_GOOD_TABLE, "decode": {**_GOOD_TABLE["decode"], "mean_history": [1, "Infinity"]}},
            "axis must hold finite numbers",
        ),
        ({**_GOOD_TABLE, "transfer_latency_s": "NaN"}, "transfer_latency_s must be finite"),
        # Wrong shapes are reported, not TypeErrors.
        ([1, 2], "a cost table is a JSON object, got list"),
        ({**_GOOD_TABLE, "prefill": 5}, "prefill: cost table section must be an object"),
        (
            {**_GOOD_TABLE, "prefill": {**_GOOD_TABLE["prefill"], "seconds": 5}},
            "'seconds' must be a list",
        ),
        ({**_GOOD_TABLE, "load_bytes_per_s": "fast"}, "'load_bytes_per_s' must be a number"),
    ],
)
def test_table_model_rejects_bad_tables_naming_the_file(tmp_path, table, message):
    path = tmp_path / "cost.json"
    # NaN / Infinity are written as the bare JSON extensions Python's json module reads.
    path.write_text(json.dumps(table).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity"))
    with pytest.raises(ValueError, match=rf"cost.json: .*{message}"):
        TableCostModel.from_file(path)


def test_cost_values_must_be_finite():
    with pytest.raises(ValueError, match="seconds"):
        Grid((1.0,), (0.0,), ((float("inf"),),))
    with pytest.raises(ValueError, match="decode_base_s must be finite"):
        LinearCostModel(decode_base_s=float("nan"))
    with pytest.raises(ValueError, match="prefill_per_token_s must be finite"):
        LinearCostModel(prefill_per_token_s=float("inf"))
    assert LinearCostModel(load_bytes_per_s=float("inf")).load_time(10**12) == 0  # free copies


@pytest.mark.parametrize(
    "field", ["decode_base_s", "prefill_per_pair_s", "transfer_bytes_per_s", "load_bytes_per_s"]
)
@pytest.mark.parametrize("value", [True, "1", None])
def test_linear_model_rejects_bools_and_non_numbers(field, value):
    """True used to pass as 1 (a 1 byte/s link, say); a string escaped as a TypeError."""
    with pytest.raises(ValueError, match=field):
        LinearCostModel(**{field: value})


def test_table_model_nested_too_deeply_is_reported_naming_the_file(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text("[" * 100_000 + "]" * 100_000)  # the JSON decoder recurses per level
    with pytest.raises(ValueError, match="cost.json: .*nested too deeply"):
        TableCostModel.from_file(path)
