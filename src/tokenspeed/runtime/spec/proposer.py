"""What the engine asks of a draft proposer, and the n-gram proposer behind that interface."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from .ngram import NgramProposer


class Proposer(Protocol):
    """Drafts for the engine's speculating requests.

    `propose(rid, tokens, k)`: up to k tokens likely to follow `tokens`, the request's whole
    history so far (prompt then outputs; the list only grows between calls for one request, a
    preemption included). `forget(rid)`: the request ended."""

    def propose(self, rid: Hashable, tokens: Sequence[int], k: int) -> list[int]: ...

    def forget(self, rid: Hashable) -> None: ...


class NgramDrafts:
    """`NgramProposer` behind the `Proposer` interface: each request's index is brought up to
    date with the tokens appended since the last call (O(new tokens)), then asked."""

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.ngram = NgramProposer(k=k, min_n=min_n, max_n=max_n)
        self._indexed: dict[Hashable, int] = {}

    def propose(self, rid: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        seen = self._indexed.get(rid)
        if seen is None:
            self.ngram.add(rid, tokens)
        elif len(tokens) > seen:
            self.ngram.extend(rid, tokens[seen:])
        self._indexed[rid] = len(tokens)
        return self.ngram.propose(rid, k)[:k] if k > 0 else []

    def forget(self, rid: Hashable) -> None:
        self.ngram.remove(rid)
        self._indexed.pop(rid, None)
