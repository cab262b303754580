"""Acceptance of drafted tokens: exact match, speculative (rejection) sampling, and the
benchmark-only forced acceptance length."""

import random

import pytest
import torch

from tokenspeed.runtime import SamplingParams
from tokenspeed.runtime.sampler import accept_draft as sampler_accept_draft
from tokenspeed.runtime.spec import (
    accept_draft,
    forced_acceptance,
    greedy_accept,
    rejection_accept,
    target_probs,
    verify,
)

GREEDY = SamplingParams(temperature=0)


def test_accept_draft_moved_and_still_reachable_from_the_sampler():
    assert sampler_accept_draft is accept_draft
    assert accept_draft([5, 6, 7], [5, 9, 7, 8]) == [5, 9]


def test_greedy_acceptance_lengths_for_oracle_and_always_wrong_drafts():
    target = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7]])
    oracle = greedy_accept(target[:, :3].clone(), target)
    assert oracle.num_emitted.tolist() == [4, 4]
    assert oracle.tokens.tolist() == [[4, 5, 6, 7]] * 2
    wrong = greedy_accept(target[:, :3] + 1, target)
    assert wrong.num_emitted.tolist() == [1, 1] and wrong.num_accepted.tolist() == [0, 0]
    assert wrong.to_lists() == [[4], [4]]
    assert wrong.tokens.tolist() == [[4, -1, -1, -1]] * 2


def test_greedy_acceptance_is_accept_draft_row_by_row_with_padding():
    rng = random.Random(0)
    k, rows = 4, 200
    draft = torch.tensor([[rng.randrange(3) for _ in range(k)] for _ in range(rows)])
    target = torch.tensor([[rng.randrange(3) for _ in range(k + 1)] for _ in range(rows)])
    counts = [rng.randrange(k + 1) for _ in range(rows)]
    got = greedy_accept(draft, target, counts).to_lists()
    for b in range(rows):
        n = counts[b]
        want = accept_draft(draft[b, :n].tolist(), target[b, : n + 1].tolist())
        assert got[b] == want, b


def _categorical(probs: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, n, replacement=True, generator=gen)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# The 0.999 quantile of chi-square with 5 degrees of freedom.
CHI2_5_999 = 20.52


@pytest.mark.parametrize("deterministic_proposer", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(deterministic_proposer):
    """The first emitted token of 20k rows is distributed as p_0, whatever q is: drafts drawn
    from a deliberately different q (or a fixed token, a point mass)."""
    n, vocab, k = 20_000, 6, 2
    p = torch.tensor([[0.05, 0.30, 0.10, 0.25, 0.20, 0.10], [0.3, 0.1, 0.1, 0.2, 0.2, 0.1]])
    p = torch.cat([p, torch.full((1, vocab), 1 / vocab)])  # [k + 1, V]
    q = torch.tensor([[0.40, 0.05, 0.30, 0.05, 0.10, 0.10], [0.1, 0.5, 0.1, 0.1, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(1234)
    if deterministic_proposer:
        draft = torch.tensor([[1, 0]]).expand(n, k).clone()  # p_0(1) = 0.3: often rejected
        draft_probs = None
    else:
        draft = torch.stack([_categorical(q[j], n, gen) for j in range(k)], dim=1)
        draft_probs = q.expand(n, k, vocab)
    out = rejection_accept(draft, p.expand(n, k + 1, vocab), draft_probs, generators=gen)
    first = out.tokens[:, 0]
    counts = torch.bincount(first, minlength=vocab).float()
    assert _chi_square(counts, p[0]) < CHI2_5_999
    assert 0.5 * float((counts / n - p[0]).abs().sum()) < 0.02
    # Tokens follow the accepted drafts; nothing is emitted past num_emitted.
    assert bool((out.num_emitted >= 1).all()) and bool((out.num_emitted <= k + 1).all())
    emitted = torch.arange(k + 1).unsqueeze(0) < out.num_emitted.unsqueeze(1)
    assert bool((out.tokens[emitted] >= 0).all()) and bool((out.tokens[~emitted] == -1).all())
    kept = torch.arange(k + 1).unsqueeze(0) < out.num_accepted.unsqueeze(1)
    assert torch.equal(out.tokens[:, :k][kept[:, :k]], draft[kept[:, :k]])


def test_the_bonus_token_is_drawn_from_the_last_distribution():
    n, vocab = 20_000, 6
    p = torch.tensor([[0.2, 0.1, 0.1, 0.2, 0.2, 0.2], [0.05, 0.05, 0.5, 0.1, 0.1, 0.2]])
    draft = torch.full((n, 1), 0)
    # p_0 = q_0 = a point mass at 0: always accepted, so the second token is the bonus from p_1.
    p0 = torch.zeros(vocab)
    p0[0] = 1.0
    probs = torch.stack([p0, p[1]]).expand(n, 2, vocab)
    out = rejection_accept(draft, probs, generators=torch.Generator().manual_seed(5))
    assert bool((out.num_emitted == 2).all())
    counts = torch.bincount(out.tokens[:, 1], minlength=vocab).float()
    assert _chi_square(counts, p[1]) < CHI2_5_999


def test_equal_target_and_draft_distributions_accept_everything():
    n, vocab, k = 500, 5, 3
    q = torch.softmax(torch.randn(k, vocab, generator=torch.Generator().manual_seed(0)), -1)
    gen = torch.Generator().manual_seed(2)
    draft = torch.stack([_categorical(q[j], n, gen) for j in range(k)], dim=1)
    p = torch.cat([q, q[:1]]).expand(n, k + 1, vocab)
    out = rejection_accept(draft, p, q.expand(n, k, vocab), generators=gen)
    assert bool((out.num_emitted == k + 1).all())


def test_greedy_targets_make_rejection_sampling_exact_match():
    rng = random.Random(1)
    rows, k, vocab = 100, 3, 4
    logits = torch.randn(rows, k + 1, vocab, generator=torch.Generator().manual_seed(3))
    draft = torch.tensor([[rng.randrange(vocab) for _ in range(k)] for _ in range(rows)])
    probs = target_probs(logits, [GREEDY] * rows)
    sampled = rejection_accept(draft, probs, generators=torch.Generator().manual_seed(0))
    greedy = greedy_accept(draft, logits.argmax(-1))
    assert torch.equal(sampled.tokens, greedy.tokens)
    assert torch.equal(verify(draft, logits, [GREEDY] * rows).tokens, greedy.tokens)


def test_a_seeded_row_does_not_depend_on_its_batch():
    vocab, k = 8, 3
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(4, k + 1, vocab, generator=gen), -1)
    draft = torch.randint(0, vocab, (4, k), generator=gen)

    def seeded(seed):
        return torch.Generator().manual_seed(seed)

    alone = rejection_accept(draft[2:3], p[2:3], generators=[seeded(99)])
    batch = rejection_accept(draft, p, generators=[seeded(1), None, seeded(99), seeded(3)])
    assert torch.equal(batch.tokens[2], alone.tokens[0])
    again = rejection_accept(draft[2:3], p[2:3], generators=[seeded(99)])
    assert torch.equal(again.tokens, alone.tokens)


def test_rows_with_fewer_drafts_emit_at_most_their_count_plus_one():
    vocab = 4
    p = torch.zeros(3, 4, vocab)
    p[..., 2] = 1.0  # the target always says 2
    draft = torch.full((3, 3), 2)
    out = rejection_accept(draft, p, num_draft=[3, 1, 0])
    assert out.num_emitted.tolist() == [4, 2, 1]
    assert out.to_lists() == [[2, 2, 2, 2], [2, 2], [2]]


def test_forced_acceptance_gives_exactly_the_forced_length():
    gen = torch.Generator().manual_seed(0)
    draft = torch.randint(0, 50, (6, 4), generator=gen)
    target = torch.randint(50, 100, (6, 5), generator=gen)  # never agrees with the draft
    out = forced_acceptance(draft, target, 2)
    assert out.num_accepted.tolist() == [2] * 6
    assert torch.equal(out.tokens[:, :2], draft[:, :2])
    assert torch.equal(out.tokens[:, 2], target[:, 2])
    assert bool((out.tokens[:, 3:] == -1).all())
    # Rows with fewer drafts accept them all.
    assert forced_acceptance(draft, target, 3, [4, 1, 0, 3, 3, 2]).num_accepted.tolist() == [
        3,
        1,
        0,
        3,
        3,
        2,
    ]
    logits = torch.randn(6, 5, 100, generator=gen)
    via_verify = verify(draft, logits, [SamplingParams(temperature=0.7)] * 6, forced_length=4)
    assert via_verify.num_accepted.tolist() == [4] * 6
    with pytest.raises(ValueError, match="0..4"):
        forced_acceptance(draft, target, 5)


def test_target_probs_follow_the_sampling_params():
    logits = torch.randn(3, 2, 10, generator=torch.Generator().manual_seed(4))
    params = [GREEDY, SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=2)]
    probs = target_probs(logits, params)
    assert torch.equal(probs[0].argmax(-1), logits[0].argmax(-1))
    assert torch.equal(probs[0].max(-1).values, torch.ones(2))
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.5, -1))
    assert ((probs[2] > 0).sum(-1) == 2).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 2))


def test_mixed_batch_verify():
    """A greedy row verifies by exact match, a sampled row by rejection sampling; both emit
    valid lengths."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 3, 16, generator=gen)
    draft = logits[:, :2].argmax(-1)  # the greedy row's oracle draft
    out = verify(
        draft,
        logits,
        [GREEDY, SamplingParams(temperature=1.0, seed=1)],
        generators=[None, torch.Generator().manual_seed(1)],
    )
    assert out.num_emitted[0] == 3 and out.tokens[0].tolist() == logits[0].argmax(-1).tolist()
    assert 1 <= int(out.num_emitted[1]) <= 3


def test_inconsistent_shapes_are_refused():
    draft = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="target must be"):
        greedy_accept(draft, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_draft must be in"):
        greedy_accept(draft, torch.zeros(2, 4, dtype=torch.int64), [4, 0])
    with pytest.raises(ValueError, match="target_probs must be"):
        rejection_accept(draft, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_accept(draft, torch.zeros(2, 4, 5), torch.zeros(2, 3, 6))
    with pytest.raises(ValueError, match="logits must be"):
        verify(draft, torch.zeros(2, 3, 5), [GREEDY] * 2)
    with pytest.raises(ValueError, match="sampling params"):
        verify(draft, torch.zeros(2, 4, 5), [GREEDY])
