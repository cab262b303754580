"""The n-gram (prompt-lookup) proposer."""

import random

import pytest

from tokenspeed.runtime.spec import NgramIndex, NgramProposer


def brute_force(history, k, min_n, max_n):
    """The definition, by scanning: the most recent earlier occurrence of the longest suffix."""
    size = len(history)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = history[size - n :]
        for end in range(size - 1, n - 1, -1):
            if history[end - n : end] == suffix:
                return history[end : min(end + k, size)]
    return []


def test_finds_the_continuation_of_a_repeat():
    index = NgramIndex(1, 3, [1, 2, 3, 4, 9, 8, 1, 2, 3])
    assert index.propose(3) == [4, 9, 8]


def test_the_most_recent_occurrence_wins():
    index = NgramIndex(2, 2, [1, 2, 5, 1, 2, 6, 1, 2])
    assert index.propose(2) == [6, 1]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    history = [7, 1, 2, 8, 3, 1, 2, 9, 7, 1, 2]
    assert NgramIndex(1, 3, history).propose(1) == [8]  # (7, 1, 2) matched
    assert NgramIndex(1, 2, history).propose(1) == [9]  # only (1, 2): its latest occurrence


def test_no_match_proposes_nothing():
    assert NgramIndex(1, 3, [1, 2, 3, 4]).propose(4) == []
    assert NgramIndex(2, 3, [1, 2, 1, 3]).propose(4) == []  # unigram 1 repeats, no bigram
    assert NgramIndex(1, 3, []).propose(4) == []
    assert NgramIndex(1, 3, [5]).propose(4) == []


def test_respects_k_and_the_end_of_the_history():
    history = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert NgramIndex(1, 2, history).propose(3) == [3, 4, 5]
    assert NgramIndex(1, 2, history).propose(1) == [3]
    # A repeat near the end: the continuation stops at the history's last token.
    assert NgramIndex(1, 1, [4, 5, 4]).propose(5) == [5, 4]
    assert NgramIndex(1, 1, [4, 4, 4]).propose(5) == [4]


def test_appending_tokens_updates_the_index_incrementally():
    index = NgramIndex(1, 3, [1, 2, 3])
    assert index.propose(2) == []
    sizes = {n: len(ends) for n, ends in index._ends.items()}
    index.extend([9])
    # One new n-gram per n (the one the new token follows), nothing re-indexed.
    assert {n: len(ends) for n, ends in index._ends.items()} == {n: sizes[n] + 1 for n in sizes}
    index.extend([1, 2])
    assert index.propose(3) == [3, 9, 1]
    index.extend([3])
    assert index.propose(3) == [9, 1, 2]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_proposals_equal_the_definition(seed):
    """Random histories over a small vocabulary, grown in random chunks (a bulk first chunk
    included): after every chunk the proposal is the brute-force scan's."""
    rng = random.Random(seed)
    min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4)])
    history = [rng.randrange(4) for _ in range(rng.randrange(0, 150))]
    index = NgramIndex(min_n, max_n, history)
    for _ in range(60):
        assert index.propose(5) == brute_force(history, 5, min_n, max_n)
        chunk = [rng.randrange(4) for _ in range(rng.choice([1, 1, 2, 4, 80]))]
        history += chunk
        index.extend(chunk)
    assert index.tokens == history


def test_a_fresh_index_and_a_grown_one_agree():
    rng = random.Random(3)
    history = [rng.randrange(6) for _ in range(500)]
    grown = NgramIndex(1, 3)
    for t in history:
        grown.extend([t])
    fresh = NgramIndex(1, 3, history)
    assert fresh._ends == grown._ends
    assert fresh.propose(4) == grown.propose(4)


def test_the_proposer_tracks_requests_and_pads_its_batch():
    proposer = NgramProposer(k=3, min_n=1, max_n=2)
    proposer.add("a", [1, 2, 3, 1, 2])
    proposer.add("b", [5, 6, 7])
    assert "a" in proposer and proposer.propose("a") == [3, 1, 2]
    drafts, counts = proposer.propose_batch(["a", "b"], pad=0)
    assert drafts == [[3, 1, 2], [0, 0, 0]] and counts == [3, 0]
    proposer.extend("b", [5])
    assert proposer.propose("b", k=2) == [6, 7]
    with pytest.raises(KeyError, match="already tracked"):
        proposer.add("a")
    proposer.remove("a")
    assert "a" not in proposer


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(0, 2, 1), (3, 2, 1), (1, 2, 0), (1, True, 2)])
def test_bad_sizes_are_refused(min_n, max_n, k):
    with pytest.raises(ValueError):
        NgramProposer(k=k, min_n=min_n, max_n=max_n)
