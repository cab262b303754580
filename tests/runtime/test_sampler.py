"""The sampler: greedy and filtered sampling, per-request seeds, logprobs, draft acceptance."""

import math

import pytest
import torch

from tokenspeed.runtime import SamplingParams
from tokenspeed.runtime.sampler import Sampler, _filter, accept_draft, apply_penalties

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


def _penalized_reference(logits, counts, prompt, presence, frequency, repetition):
    """The penalty formulas written out token by token (vLLM's, OpenAI's)."""
    out = logits.clone()
    for r in range(out.shape[0]):
        for t in range(out.shape[1]):
            value, count = out[r, t], counts[r][t]
            if count > 0 or t in prompt[r]:
                value = value / repetition[r] if value > 0 else value * repetition[r]
            value = value - frequency[r] * count
            if count > 0:
                value = value - presence[r]
            out[r, t] = value
    return out


def test_penalties_change_the_logits_as_the_formulas_say():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0, -2.5], [1.0, 1.0, -1.0, 4.0, 0.0, 2.0]])
    counts = [[0, 2, 1, 0, 0, 3], [1, 0, 0, 0, 0, 0]]
    prompt = [{0, 3}, {2, 5}]
    presence, frequency, repetition = [0.5, -1.0], [0.25, 2.0], [1.5, 0.8]
    got = apply_penalties(
        logits,
        torch.tensor(counts, dtype=torch.float32),
        torch.tensor([[t in p for t in range(6)] for p in prompt]),
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )
    want = _penalized_reference(logits, counts, prompt, presence, frequency, repetition)
    assert torch.equal(got, want)
    assert got[0, 0] == 2.0 / 1.5 and got[0, 1] == -1.0 * 1.5 - 0.5 - 0.5  # prompt; output x2
    assert got[1, 2] == -1.0 * 0.8 and got[1, 4] == 0.0  # prompt only; untouched
    # Penalties that are off leave a row exactly as it was.
    off = apply_penalties(
        logits,
        torch.tensor(counts, dtype=torch.float32),
        torch.ones(2, 6, dtype=torch.bool),
        torch.zeros(2),
        torch.zeros(2),
        torch.ones(2),
    )
    assert torch.equal(off, logits)


def test_the_sampler_counts_the_tokens_it_sampled_on_its_own():
    """The engine never tells the sampler what it sampled (multi-step decoding keeps the tokens
    on the device): penalties follow the tokens the sampler itself drew, request by request,
    and the prompt's tokens count for the repetition penalty."""
    logits = torch.tensor([[0.0, 4.0, 3.9, 3.0, 2.0, -1.0, 3.5, 1.0]])
    sampler = Sampler()
    freq = SamplingParams(temperature=0, frequency_penalty=0.6)
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    sampler.register("f", freq, [7])
    sampler.register("r", rep, [2])
    batch = logits.repeat(3, 1)
    plain = []
    counts = {"f": [0] * 8, "r": [0] * 8}
    for _ in range(6):
        out = sampler.sample(batch, [freq, GREEDY, rep], ["f", "g", "r"]).tokens.tolist()
        want_f = _penalized_reference(logits, [counts["f"]], [{7}], [0.0], [0.6], [1.0])
        want_r = _penalized_reference(logits, [counts["r"]], [{2}], [0.0], [0.0], [2.0])
        assert out[0] == int(want_f.argmax()) and out[2] == int(want_r.argmax())
        counts["f"][out[0]] += 1
        counts["r"][out[2]] += 1
        plain.append(out[1])
    assert plain == [1] * 6  # the row without penalties is untouched
    assert counts["f"][1] >= 2 and counts["f"][2] >= 1  # it moved on from 1, and came back
    assert counts["r"][2] == 0  # in the prompt: 3.9 / 2 loses to 3.5
    assert torch.equal(batch, logits.repeat(3, 1))  # the caller's logits are left alone
    sampler.forget("f")
    sampler.register("f", freq, [7])  # a new request of the same id starts afresh
    assert sampler.sample(logits, [freq], ["f"]).tokens.tolist() == [1]


def test_rows_without_penalties_sample_exactly_as_before():
    """A seeded row draws the same tokens, and gets the same logprobs, whether or not a
    penalised or min_tokens row shares its batch."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=3, logprobs=2)
    alone = Sampler(seed=1)
    alone.register("s", seeded)
    want = [alone.sample(logits[1:2], [seeded], ["s"]) for _ in range(4)]
    mixed = Sampler(seed=1, eos_token_ids=[0])
    penalized = SamplingParams(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.3)
    delayed = SamplingParams(temperature=0, min_tokens=3)
    mixed.register("s", seeded)
    mixed.register("p", penalized, [1, 2, 3])
    mixed.register("m", delayed)
    for w in want:
        got = mixed.sample(logits, [penalized, seeded, delayed], ["p", "s", "m"])
        assert got.tokens[1] == w.tokens[0]
        assert torch.equal(got.logprobs[1:2], w.logprobs)
        assert got.top_logprobs[1] == w.top_logprobs[0]


def test_min_tokens_masks_eos_and_stop_token_ids_until_enough_tokens():
    eos, stop = 2, 5
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 3.0, 8.0]])  # EOS, then the stop id, lead
    sampler = Sampler(eos_token_ids=[eos])
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop])
    sampler.register("a", params)
    got = [sampler.sample(logits, [params], ["a"]).tokens.item() for _ in range(5)]
    assert got == [4, 4, 4, eos, eos]
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)  # as vLLM: masked
    sampler.register("b", ignoring)
    assert [sampler.sample(logits, [ignoring], ["b"]).tokens.item() for _ in range(3)] == [
        stop,
        stop,
        eos,
    ]
    # Sampled rows too: with EOS and the stop id masked, neither is ever drawn.
    hot = SamplingParams(temperature=5.0, max_tokens=40, min_tokens=40, stop_token_ids=[stop])
    sampler.register("c", hot)
    drawn = {sampler.sample(logits, [hot], ["c"]).tokens.item() for _ in range(40)}
    assert drawn and not drawn & {eos, stop}
    assert sampler.sample(logits, [GREEDY], ["d"]).tokens.item() == eos


def test_penalties_need_the_request_registered():
    with pytest.raises(ValueError, match="register"):
        Sampler().sample(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], ["x"])
    with pytest.raises(ValueError, match="register"):
        Sampler().sample(torch.zeros(1, 4), [SamplingParams(min_tokens=1)])
