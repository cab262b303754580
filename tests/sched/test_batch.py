import pytest

from tests.sched.fake_cache import make_request
from tokenspeed.sched.batch import DecodeBatch, PrefillBatch, PrefillChunk, StepPlan, pad_batch_size


def test_pad_batch_size():
    sizes = (1, 2, 4, 8, 16)
    assert [pad_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="exceeds the largest captured size 16"):
        pad_batch_size(17, sizes)
    with pytest.raises(ValueError, match="positive"):
        pad_batch_size(0, sizes)


def test_plan_sizes():
    a, b = make_request("a", 100), make_request("b", 50)
    batch = PrefillBatch((PrefillChunk(a, 0, 64, (64,)), PrefillChunk(b, 32, 50, is_last=True)))
    assert batch.num_tokens == 64 + 18 and batch.num_requests == 2
    assert not batch.chunks[0].is_last and batch.chunks[1].is_last
    a.num_output = 1
    dec = DecodeBatch((a, b), padded_size=4, steps=3)
    assert dec.size == 2 and dec.history_lens == (101, 50)
    assert StepPlan(prefill=None, decode=None).empty
    assert not StepPlan(prefill=batch, decode=None).empty
