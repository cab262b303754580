"""A backend that raises or returns nonsense costs hits, never a request or wrong bytes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from tokenspeed.cache import KeyChain, LocalHostCache, ObjectKind
from tokenspeed.cache.keys import as_page_keys
from tokenspeed.cache.l2.base import HostObject
from tokenspeed.cache.l2.guarded import GuardedL2

from ..helpers import (
    live_state_matches,
    make_manager,
    pages_match,
    prefix_seed,
    tiny_geometry,
    token_stream,
    write_live_state,
    write_pages,
)

P = 4


class FlakyL2(LocalHostCache):
    """A local tier whose calls start raising (or lying about sizes) on demand."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=1 << 20)
        self.mode = "ok"

    def _maybe_fail(self) -> None:
        if self.mode == "raise":
            raise ConnectionError("backend exploded")

    def contains(self, kind, keys):
        self._maybe_fail()
        return super().contains(kind, keys)

    def prefix_present(self, kind, keys):
        self._maybe_fail()
        return super().prefix_present(kind, keys)

    def last_present(self, kind, keys):
        self._maybe_fail()
        return super().last_present(kind, keys)

    def put(self, objects: Sequence[HostObject]) -> int:
        self._maybe_fail()
        return super().put(objects)

    def stats(self):
        self._maybe_fail()
        return super().stats()

    def get_present(self, kind, keys, positions):
        self._maybe_fail()
        return super().get_present(kind, keys, positions)

    def get(self, kind, keys, positions):
        self._maybe_fail()
        out = super().get(kind, keys, positions)
        if self.mode == "short":  # a buggy backend returning truncated payloads
            return [None if p is None else p[:-1] for p in out]
        return out


def _publish(cache, tokens):
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate("w", keys, len(tokens))
    write_pages(cache, h, 0, len(tokens) // P)
    write_live_state(cache, h, prefix_seed(tokens[:32]))
    cache.checkpoint(h, 32)
    cache.release(h, publish=True)
    return keys


def test_raising_backend_degrades_to_misses_and_dropped_writes():
    l2 = FlakyL2()
    cache = make_manager(l2=l2)
    tokens = token_stream(1, 33)
    keys = _publish(cache, tokens)
    cache.evict(pages=100, checkpoints=100)
    l2.mode = "raise"
    m = cache.match(keys, 33)  # no exception
    assert m.num_tokens == 0
    h = cache.allocate("r", keys, 33)
    assert h.num_cached_tokens == 0 and live_state_matches(cache, h, None)
    write_pages(cache, h, 0, 8)
    write_live_state(cache, h, prefix_seed(tokens[:32]))
    cache.checkpoint(h, 32)
    assert cache.publish(h) == 0
    cache.release(h)
    cache.evict(pages=100, checkpoints=100)  # write-back fails too: dropped
    assert cache.stats().counters.l2_errors >= 4
    cache.check_integrity()
    l2.mode = "ok"  # the backend recovers: hits come back
    h = cache.allocate("r2", keys, 33)
    assert h.num_cached_tokens == 32 and pages_match(cache, h, 0, 8)
    cache.release(h)


def test_wrong_sized_payloads_are_never_used():
    l2 = FlakyL2()
    cache = make_manager(l2=l2)
    keys = _publish(cache, token_stream(2, 33))
    cache.evict(pages=100, checkpoints=100)
    l2.mode = "short"
    h = cache.allocate("r", keys, 33)
    assert h.num_cached_tokens == 0
    assert cache.stats().counters.l2_errors >= 1
    cache.release(h)
    cache.check_integrity()


def test_guard_answers_safely_for_every_call():
    l2 = FlakyL2()
    l2.bind(tiny_geometry(), metadata_only=False)
    errors = []
    guard = GuardedL2(l2, lambda: errors.append(1))
    l2.mode = "raise"
    assert guard.contains(ObjectKind.PAGE, [1, 2]).tolist() == [False, False]
    assert guard.prefix_present(ObjectKind.PAGE, [1]) == 0
    assert guard.last_present(ObjectKind.PAGE, [1]) == -1
    assert guard.put([HostObject(ObjectKind.PAGE, 1, 0, 1, torch.zeros(1, dtype=torch.uint8))]) == 0
    assert guard.get(ObjectKind.PAGE, [1], [0]) == [None]
    assert guard.get_present(ObjectKind.PAGE, [1, 2], [0, 1]).tolist() == [False, False]
    assert len(errors) == 6
    l2.mode = "ok"  # a backend answering the wrong number of flags is also a miss
    l2.get_present = lambda kind, keys, positions: [True]
    assert guard.get_present(ObjectKind.PAGE, [1, 2], [0, 1]).tolist() == [False, False]


class _Repeating(LocalHostCache):
    """Returns a fixed list of payloads (shared objects repeated, as metadata-only tiers do)."""

    def __init__(self, answer) -> None:
        super().__init__(capacity_bytes=1 << 20)
        self.answer = answer

    def get(self, kind, keys, positions):
        return list(self.answer)


def test_get_checks_each_payload_also_when_objects_repeat():
    g = tiny_geometry()
    good = torch.zeros(g.mla_page_bytes, dtype=torch.uint8)
    bad = torch.zeros(g.mla_page_bytes - 1, dtype=torch.uint8)
    for answer, expect, errors_expected in (
        ([good, good, good], [good, good, good], 0),  # all distinct objects fine: passed through
        ([good, bad, good, bad, None], [good, None, good, None, None], 2),  # one error per bad
    ):
        inner = _Repeating(answer)
        inner.bind(g, metadata_only=False)
        errors = []
        guard = GuardedL2(inner, lambda errors=errors: errors.append(1))
        got = guard.get(ObjectKind.PAGE, list(range(len(answer))), list(range(len(answer))))
        assert [x is y for x, y in zip(got, expect, strict=True)] == [True] * len(expect)
        assert len(errors) == errors_expected
    with_none = _Repeating([good, None])
    with_none.bind(g, metadata_only=False)
    errors = []
    assert (
        GuardedL2(with_none, lambda: errors.append(1)).get(ObjectKind.PAGE, [1, 2], [0, 1])
        == [
            good,
            None,
        ]
        and not errors
    )


def test_stats_survive_a_backend_whose_stats_raise():
    l2 = FlakyL2()
    cache = make_manager(l2=l2)
    _publish(cache, token_stream(3, 33))
    assert cache.stats().l2.puts > 0
    l2.mode = "raise"
    stats = cache.stats()  # no exception: the L2 part is unknown, the error is counted
    assert stats.l2 is None and stats.counters.l2_errors == 1
    assert stats.pages.total == cache.stats().pages.total
    cache.check_integrity()


class _Nonsense(LocalHostCache):
    """Answers every question with `answer`, whatever it was asked."""

    def __init__(self, answer) -> None:
        super().__init__(capacity_bytes=1 << 20)
        self.answer = answer

    def contains(self, kind, keys):
        return self.answer

    def prefix_present(self, kind, keys):
        return self.answer

    def last_present(self, kind, keys):
        return self.answer

    def presence_version(self):
        return self.answer

    def put(self, objects):
        return self.answer

    def put_many(self, kind, keys, positions, payloads=None, *, chain=False):
        return self.answer

    def get(self, kind, keys, positions):
        return self.answer

    def get_present(self, kind, keys, positions):
        return self.answer


class _Unconvertible:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("cannot be an array")

    def __len__(self):
        raise RuntimeError("no length either")


@pytest.mark.parametrize("answer", [7, -3, 1.5, True, "x", object(), _Unconvertible(), [True] * 3])
def test_nonsense_answers_are_safe_and_counted(answer):
    l2 = _Nonsense(answer)
    l2.bind(tiny_geometry(), metadata_only=False)
    errors = []
    guard = GuardedL2(l2, lambda: errors.append(1))
    page = HostObject(ObjectKind.PAGE, 1, 0, 1, torch.zeros(1, dtype=torch.uint8))
    calls = [
        (lambda: guard.contains(ObjectKind.PAGE, [1, 2]).tolist(), [False, False]),
        (lambda: guard.prefix_present(ObjectKind.PAGE, [1, 2]), 0),
        (lambda: guard.last_present(ObjectKind.PAGE, [1, 2]), -1),
        (lambda: guard.put([page]), 0),
        (lambda: guard.put_many(ObjectKind.PAGE, as_page_keys([1, 2]), [0, 1]), 0),
        (lambda: guard.get(ObjectKind.PAGE, [1, 2], [0, 1]), [None, None]),
        (lambda: guard.get_present(ObjectKind.PAGE, [1, 2], [0, 1]).tolist(), [False, False]),
    ]
    if type(answer) is not int:  # any int is a version
        calls.append((guard.presence_version, None))
    for call, safe in calls:
        before = len(errors)
        assert call() == safe
        assert len(errors) == before + 1  # every refused answer is counted


def test_integer_answers_of_numpy_type_are_taken():
    l2 = _Nonsense(np.int64(1))
    l2.bind(tiny_geometry(), metadata_only=False)
    errors = []
    guard = GuardedL2(l2, lambda: errors.append(1))
    assert guard.prefix_present(ObjectKind.PAGE, [1, 2]) == 1
    assert guard.last_present(ObjectKind.PAGE, [1, 2]) == 1
    assert guard.presence_version() == 1
    assert not errors
