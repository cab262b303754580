from tokenspeed.cache._exhaust import exhaust


def test_exhaust_runs_every_side_effect_and_keeps_nothing():
    seen = {}
    assert exhaust(map(seen.__setitem__, "abc", range(3))) is None
    assert seen == {"a": 0, "b": 1, "c": 2}
    gen = (seen.pop(k) for k in "ab")
    exhaust(gen)
    assert seen == {"c": 2} and next(gen, None) is None
