"""The n-gram (prompt-lookup) proposer: draft what followed the last time the history's suffix
appeared.

Given a request's token history x_0..x_{L-1}, for n from max_n down to min_n: find the most
recent earlier occurrence of the last n tokens (one that ends before L) and propose the up to k
tokens that followed it (never past the history's end). The first n that matches wins; no match
for any n proposes nothing. Deterministic: the same history gives the same proposal.

Each request keeps an incremental index (`NgramIndex`): for every n, the n-grams of its history
-> where their most recent occurrence ended. Appending a token adds max_n - min_n + 1 entries;
proposing is max_n - min_n + 1 lookups and a slice of at most k tokens. Nothing rescans the
history, so a step costs O(k) however long the request is (the first `extend` of a long prompt
indexes it once, in bulk). Memory: about 100 bytes per token per n (Python dicts of ints).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs


def _check_sizes(min_n: int, max_n: int, k: int) -> None:
    for name, value in (("min_n", min_n), ("max_n", max_n), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if min_n > max_n:
        raise ValueError(f"min_n ({min_n}) exceeds max_n ({max_n})")


class NgramIndex:
    """One request's history and its n-gram index (n in min_n..max_n).

    Keys are the n-grams' hashes (ints; tuple hashing of ints is deterministic in CPython);
    a lookup confirms the tokens themselves, so a hash collision costs a missed proposal,
    never a wrong one.
    """

    def __init__(self, min_n: int = 1, max_n: int = 3, tokens: Iterable[int] = ()):
        _check_sizes(min_n, max_n, 1)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n -> hash of an n-gram -> the end (exclusive) of its most recent indexed occurrence.
        # An n-gram is indexed once a token follows it: the one ending at the history's end is
        # the suffix looked up, and must not find itself.
        self._ends: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the history (accepted tokens only: the history never shrinks)."""
        new = [int(t) for t in tokens]
        if not new:
            return
        old = len(self.tokens)
        self.tokens.extend(new)
        history = self.tokens
        last = len(history)
        for n, ends in self._ends.items():
            # n-grams ending at old .. last - 1 (exclusive ends): each now has a token after it.
            first = max(n, old)
            if first >= last:
                continue
            if last - first > 64:  # bulk: the tuples are built in C (zip of slices)
                grams = zip(*(history[first - n + j : last - n + j] for j in range(n)), strict=True)
                ends.update(zip(map(hash, grams), range(first, last), strict=True))
            else:
                for end in range(first, last):
                    ends[hash(tuple(history[end - n : end]))] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the history's
        longest matching suffix (max_n down to min_n); [] when none matches."""
        _check_sizes(self.min_n, self.max_n, k)
        history = self.tokens
        size = len(history)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = history[size - n :]
            end = self._ends[n].get(hash(tuple(suffix)))
            if end is not None and history[end - n : end] == suffix:
                return history[end : min(end + k, size)]
        return []


@attrs.define
class NgramProposer:
    """Prompt-lookup drafting for many requests: one `NgramIndex` each.

    add(rid, prompt) once, extend(rid, accepted tokens) after every step, propose(rid) before a
    verify step, remove(rid) when the request ends. propose_batch gives the engine padded
    drafts [B, k] with their lengths (rows with no match propose 0 tokens).
    """

    k: int = 4
    min_n: int = 1
    max_n: int = 3
    _indexes: dict[object, NgramIndex] = attrs.field(factory=dict, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        _check_sizes(self.min_n, self.max_n, self.k)

    def add(self, request_id: object, tokens: Iterable[int] = ()) -> None:
        if request_id in self._indexes:
            raise KeyError(f"request {request_id!r} is already tracked")
        self._indexes[request_id] = NgramIndex(self.min_n, self.max_n, tokens)

    def extend(self, request_id: object, tokens: Iterable[int]) -> None:
        self._indexes[request_id].extend(tokens)

    def remove(self, request_id: object) -> None:
        self._indexes.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._indexes

    def propose(self, request_id: object, k: int | None = None) -> list[int]:
        return self._indexes[request_id].propose(self.k if k is None else k)

    def propose_batch(
        self, request_ids: Sequence[object], k: int | None = None, pad: int = 0
    ) -> tuple[list[list[int]], list[int]]:
        """(drafts padded with `pad` to k tokens each, the number proposed per request)."""
        k = self.k if k is None else k
        drafts, counts = [], []
        for rid in request_ids:
            draft = self.propose(rid, k)
            counts.append(len(draft))
            drafts.append(draft + [pad] * (k - len(draft)))
        return drafts, counts
