"""The sampler: greedy and filtered sampling, per-request seeds, logprobs, draft acceptance."""

import math

import pytest
import torch

from tokenspeed.runtime import SamplingParams
from tokenspeed.runtime.sampler import Sampler, _filter, accept_draft

GREEDY = SamplingParams(temperature=0)


def test_top_k_keeps_the_k_largest_and_top_p_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    top_k = torch.tensor([2, 0, 0])
    top_p = torch.tensor([1.0, 0.6, 0.75])
    kept = torch.isfinite(_filter(logits, top_k, top_p)).tolist()
    assert kept[0] == [True, True, False, False, False]  # top 2
    assert kept[1] == [True, True, False, False, False]  # 0.5 < 0.6 <= 0.5 + 0.2
    assert kept[2] == [True, True, True, False, False]  # 0.7 < 0.75 <= 0.85


def test_greedy_rows_take_the_argmax_and_filters_narrow_sampling():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [
        GREEDY,
        SamplingParams(temperature=1.0, top_k=1),  # only the argmax survives
        SamplingParams(temperature=5.0, top_p=1e-6),  # only the most likely token
        GREEDY,
    ]
    out = Sampler(seed=1).sample(logits, params)
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).repeat(4000, 1)
    tokens = Sampler(seed=3).sample(logits, [SamplingParams(temperature=1.0)] * 4000).tokens
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_a_seeded_request_draws_the_same_tokens_whatever_its_batch():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(5))
    seeded = SamplingParams(temperature=1.0, seed=11)
    alone = Sampler(seed=0)
    alone.register("r", seeded)
    first = [alone.sample(logits[1:2], [seeded], ["r"]).tokens.item() for _ in range(5)]
    batched = Sampler(seed=99)
    batched.register("r", seeded)
    other = SamplingParams(temperature=1.0)
    got = [
        batched.sample(logits, [other, seeded, other], ["a", "r", "b"]).tokens[1].item()
        for _ in range(5)
    ]
    assert got == first


def test_logprobs_are_the_log_softmax_of_the_chosen_and_the_top_tokens():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0, logprobs=3), GREEDY]
    out = Sampler().sample(logits, params)
    logp = logits.log_softmax(-1)
    token = int(logits[0].argmax())
    assert math.isclose(float(out.logprobs[0]), float(logp[0, token]), rel_tol=1e-6)
    values, ids = logp[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(values.tolist())
    assert out.top_logprobs[1] == []  # the row that did not ask


def test_accept_draft_keeps_the_agreeing_prefix_then_the_targets_token():
    assert accept_draft([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_draft([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # first disagreement
    assert accept_draft([5], [4, 1]) == [4]
    assert accept_draft([], [3]) == [3]
    with pytest.raises(ValueError, match="len\\(draft\\) \\+ 1"):
        accept_draft([1, 2], [1, 2])


def test_top_p_applies_to_what_top_k_left():
    """With both filters, the nucleus is taken from the top-k tokens renormalised, as vLLM and
    Hugging Face do. Before, it was taken from the whole distribution: top_k=2, top_p=0.6 kept
    both tokens (0.5 < 0.6), where the renormalised first token alone (0.71) reaches 0.6."""
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 2))
    kept = torch.isfinite(_filter(logits, torch.tensor([2, 3]), torch.tensor([0.6, 0.9])))
    assert kept.tolist() == [
        [True, False, False, False, False],  # 0.71 >= 0.6
        [True, True, True, False, False],  # 0.59, 0.82 < 0.9 <= 1.0 (top-k's three)
    ]


def test_top_p_of_one_keeps_every_token():
    """top_p=1.0 turns the filter off. Before, the fp32 running sum of probabilities reached 1.0
    before the last tokens (it always does when one token dominates, and on most rows of a 160k
    vocabulary), and the tokens after that point were masked out."""
    logits = torch.tensor([[30.0, 0.0, 0.0, -1.0], [1.0, 2.0, 3.0, 4.0]])
    kept = torch.isfinite(_filter(logits, torch.tensor([0, 0]), torch.tensor([1.0, 1.0])))
    assert kept.all()
    big = torch.randn(4, 163840, generator=torch.Generator().manual_seed(0)) * 5
    assert torch.isfinite(_filter(big, torch.zeros(4, dtype=torch.long), torch.ones(4))).all()
