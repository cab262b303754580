"""Random operation sequences against `CacheManager`, checking integrity and bytes after every step.

Two machines:
- `RealCacheMachine`: tensors on CPU, a background copy thread, a small local L2 that evicts.
  A shadow model knows which prefixes were ever checkpointed; page contents are a function of the
  page key and KDA state a function of the token prefix, so every hit is checked byte for byte and
  every held page is re-checked after every step (an in-use page evicted and reused would change).
- `SharedL2Machine`: two metadata-only managers (ranks) sharing one metadata-only L2, the
  simulator's configuration, checking the hybrid rule and integrity on both.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from tokenspeed.cache import (
    BudgetTooSmallError,
    CacheFullError,
    CheckpointKind,
    CheckpointPolicy,
    InvalidRequestError,
    KeyChain,
    LocalHostCache,
    ObjectKind,
    RequestReleasedError,
)

from .helpers import (
    live_state_matches,
    make_manager,
    pages_match,
    prefix_seed,
    tiny_geometry,
    token_stream,
    write_checkpoint_slot,
    write_live_state,
    write_pages,
)

P = 4
STREAM = 48  # tokens per session stream (12 pages)
SHARED = token_stream(99, 12)  # a 3-page prefix every session shares (a system prompt)
SESSIONS = [token_stream(s, STREAM, shared=SHARED if s < 3 else ()) for s in range(4)]
KEYS = [KeyChain(P).append_tokens(tokens) for tokens in SESSIONS]


class _Req:
    def __init__(self, handle, session: int, computed: int) -> None:
        self.handle = handle
        self.session = session
        self.computed = computed  # tokens whose pages and state the "forward" has written
        self.written = computed // P  # pages [0, written) hold their content


class RealCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        g = tiny_geometry(P)
        self.g = g
        # L2 holds more than L1 (so hits come from both tiers) but still evicts.
        self.l2 = LocalHostCache(capacity_bytes=30 * g.mla_page_bytes + 6 * g.kda_state_bytes)
        self.cache = make_manager(
            g,
            pages=20,
            live=3,
            checkpoints=4,
            l2=self.l2,
            async_loads=True,
            policy=CheckpointPolicy(interval_pages=2, max_per_path=3),
        )
        self.live: dict[int, _Req] = {}
        self.released = []
        self.checkpointed: set[int] = set()  # prefix keys that ever got a checkpoint
        self.history: dict[int, int] = {}  # session -> tokens of its last turn
        self.next_id = 0

    def teardown(self) -> None:
        self.cache.close()

    # ----------------------------------------------------------------------------- rules
    @rule(
        target=requests,
        session=st.integers(0, len(SESSIONS) - 1),
        prompt=st.integers(1, STREAM - 8),
        reserve=st.none() | st.integers(1, STREAM),
    )
    def allocate(self, session, prompt, reserve):
        rid = self.next_id
        self.next_id += 1
        keys = KEYS[session]
        before = self.cache.stats()
        try:
            h = self.cache.allocate(rid, keys, prompt, reserve_tokens=reserve)
        except (CacheFullError, BudgetTooSmallError):
            after = self.cache.stats()
            assert (after.pages, after.live_slots, after.requests) == (
                before.pages,
                before.live_slots,
                before.requests,
            )
            return rid  # a handle-less id: later rules on it are no-ops
        h.load.synchronize()
        hit = h.num_cached_tokens
        assert hit % P == 0 and hit <= max(prompt - 1, 0)
        if hit:
            # The hybrid rule: a hit ends exactly where a complete checkpoint was taken.
            assert keys[hit // P - 1] in self.checkpointed
        assert pages_match(self.cache, h, 0, hit // P), "hit pages differ from what was written"
        seed = prefix_seed(SESSIONS[session][:hit]) if hit else None
        assert live_state_matches(self.cache, h, seed), "restored KDA state differs"
        self.live[rid] = _Req(h, session, hit)
        return rid

    @rule(session=st.integers(0, len(SESSIONS) - 1), new=st.integers(1, 20), data=st.data())
    def turn(self, session, new, data):
        """A whole turn: allocate the session's history plus new tokens, compute the rest with
        checkpoints where the policy asks, publish, release (what the engine does per turn)."""
        prompt = self.history.get(session, 0) + new
        if prompt > STREAM:
            prompt = new  # the conversation starts over (a context reset)
        rid = self.next_id
        self.next_id += 1
        try:
            h = self.cache.allocate(rid, KEYS[session], prompt)
        except (CacheFullError, BudgetTooSmallError):
            return
        h.load.synchronize()
        hit = h.num_cached_tokens
        if hit:
            assert KEYS[session][hit // P - 1] in self.checkpointed
        assert pages_match(self.cache, h, 0, hit // P)
        assert live_state_matches(
            self.cache, h, prefix_seed(SESSIONS[session][:hit]) if hit else None
        )
        tokens = SESSIONS[session]
        write_pages(self.cache, h, hit // P, prompt // P)
        for length, kind in self.cache.checkpoint_points(hit, prompt, turn_end=True):
            # A chunked prefill hands the state at each point to the cache.
            slot = self.cache.checkpoint(h, length, kind=kind, from_live=False)
            if slot is not None:
                write_checkpoint_slot(self.cache, slot, prefix_seed(tokens[:length]))
            if self.cache._ckpts.get(KEYS[session][length // P - 1]) is not None:
                self.checkpointed.add(KEYS[session][length // P - 1])
        write_live_state(self.cache, h, prefix_seed(tokens[:prompt]))
        if data.draw(st.booleans(), label="publish"):
            self.cache.publish(h)
        self.cache.release(h)
        self.history[session] = prompt

    @rule(rid=requests, n=st.integers(1, 12))
    def compute(self, rid, n):
        """The forward computes n more tokens: extend, write pages and live state."""
        r = self.live.get(rid)
        if r is None:
            return
        target = min(r.computed + n, STREAM)
        if target <= r.computed:
            return
        h = r.handle
        keys = KEYS[r.session]
        new_keys = keys[len(h.page_keys) : target // P]
        try:
            self.cache.extend(h, max(target, h.num_tokens), new_keys)
        except CacheFullError:
            return
        full = target // P
        write_pages(self.cache, h, r.written, full)
        r.written = max(r.written, full)
        r.computed = target
        write_live_state(self.cache, h, prefix_seed(SESSIONS[r.session][:target]))

    @rule(rid=requests, kind=st.sampled_from(list(CheckpointKind)), back=st.integers(0, 2))
    def checkpoint(self, rid, kind, back):
        r = self.live.get(rid)
        if r is None:
            return
        aligned = r.computed // P * P - back * P
        if aligned <= 0:
            return
        h = r.handle
        if aligned == r.computed:
            slot = self.cache.checkpoint(h, aligned, kind=kind)
        else:
            # The live state moved on: the runner writes the state at `aligned` itself.
            slot = self.cache.checkpoint(h, aligned, kind=kind, from_live=False)
            if slot is not None:
                write_checkpoint_slot(self.cache, slot, prefix_seed(SESSIONS[r.session][:aligned]))
        key = KEYS[r.session][aligned // P - 1]
        if slot is not None or self.cache._ckpts.get(key) is not None:
            self.checkpointed.add(key)

    @rule(rid=requests)
    def publish(self, rid):
        r = self.live.get(rid)
        if r is not None:
            self.cache.publish(r.handle)

    @rule(rid=consumes(requests), publish=st.booleans())
    def release(self, rid, publish):
        r = self.live.pop(rid, None)
        if r is None:
            return
        self.cache.release(r.handle, publish=publish)
        self.released.append(r.handle)

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def misuse_released(self, data):
        h = data.draw(st.sampled_from(self.released))
        before = self.cache.stats()
        with pytest.raises(RequestReleasedError):
            self.cache.release(h)
        with pytest.raises(RequestReleasedError):
            self.cache.extend(h, h.num_tokens + 1)
        with pytest.raises(RequestReleasedError):
            self.cache.checkpoint(h, P)
        assert self.cache.stats().pages == before.pages

    @rule(rid=requests, shrink=st.integers(1, 4))
    def bad_input(self, rid, shrink):
        r = self.live.get(rid)
        if r is None:
            return
        h = r.handle
        before = (list(h.page_ids), h.num_tokens, self.cache.stats().pages)
        if h.num_tokens > shrink:
            with pytest.raises(InvalidRequestError):
                self.cache.extend(h, h.num_tokens - shrink)
        with pytest.raises(InvalidRequestError):
            self.cache.checkpoint(h, P + 1)  # not page-aligned
        with pytest.raises(InvalidRequestError):
            self.cache.checkpoint(h, (h.num_tokens // P + 1) * P)  # beyond the reservation
        assert (list(h.page_ids), h.num_tokens, self.cache.stats().pages) == before

    @rule(pages=st.integers(0, 20), checkpoints=st.integers(0, 4))
    def evict(self, pages, checkpoints):
        self.cache.evict(pages=pages, checkpoints=checkpoints)

    @rule(session=st.integers(0, len(SESSIONS) - 1), first=st.integers(0, STREAM // P - 1))
    def lose_l2_pages(self, session, first):
        """L2 loses pages (evicted by another writer, a restarted owner): hits must shrink."""
        self.l2.remove(ObjectKind.PAGE, KEYS[session][first : first + 3])

    @rule(session=st.integers(0, len(SESSIONS) - 1), prompt=st.integers(1, STREAM))
    def match(self, session, prompt):
        m = self.cache.match(KEYS[session], prompt)
        assert m.num_tokens % P == 0 and m.num_tokens < prompt
        assert m.mla_covered_tokens >= m.num_tokens
        assert m.l1_tokens + m.l2_tokens == m.num_tokens
        if m.hit:
            assert KEYS[session][m.num_tokens // P - 1] in self.checkpointed

    # ------------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self):
        self.cache.check_integrity()

    @invariant()
    def held_pages_keep_their_bytes(self):
        for r in self.live.values():
            assert pages_match(self.cache, r.handle, 0, r.written), "a held page was overwritten"

    @invariant()
    def occupancy_adds_up(self):
        s = self.cache.stats()
        for pool in (s.pages, s.checkpoints, s.live_slots):
            assert pool.free + pool.used + pool.cached == pool.total
            assert min(pool.free, pool.used, pool.cached) >= 0
        assert s.live_slots.used == len(self.live)


class SharedL2Machine(RuleBasedStateMachine):
    """Two metadata-only ranks, one shared metadata-only L2 (the simulator's shape)."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        g = tiny_geometry(P)
        self.l2 = LocalHostCache(
            capacity_bytes=12 * g.mla_page_bytes + 4 * g.kda_state_bytes, metadata_only=True
        )
        self.ranks = [
            make_manager(g, pages=16, live=3, checkpoints=3, l2=self.l2, metadata_only=True)
            for _ in range(2)
        ]
        self.live: dict[int, tuple[int, object, int]] = {}
        self.checkpointed: set[int] = set()
        self.next_id = 0

    @rule(
        target=requests,
        rank=st.integers(0, 1),
        session=st.integers(0, len(SESSIONS) - 1),
        prompt=st.integers(1, STREAM - 4),
    )
    def allocate(self, rank, session, prompt):
        rid = self.next_id
        self.next_id += 1
        try:
            h = self.ranks[rank].allocate(rid, KEYS[session], prompt)
        except (CacheFullError, BudgetTooSmallError):
            return rid
        if h.num_cached_tokens:
            assert KEYS[session][h.num_cached_tokens // P - 1] in self.checkpointed
        self.live[rid] = (rank, h, session)
        return rid

    @rule(rid=requests, n=st.integers(1, 16), kind=st.sampled_from(list(CheckpointKind)))
    def compute_and_checkpoint(self, rid, n, kind):
        if rid not in self.live:
            return
        rank, h, session = self.live[rid]
        target = min(h.num_tokens + n, STREAM)
        try:
            self.ranks[rank].extend(h, target, KEYS[session][len(h.page_keys) : target // P])
        except CacheFullError:
            return
        aligned = target // P * P
        if aligned:
            self.ranks[rank].checkpoint(h, aligned, kind=kind)
            if self.ranks[rank]._ckpts.get(KEYS[session][aligned // P - 1]) is not None:
                self.checkpointed.add(KEYS[session][aligned // P - 1])

    @rule(rid=consumes(requests), publish=st.booleans())
    def release(self, rid, publish):
        if rid in self.live:
            rank, h, _ = self.live.pop(rid)
            self.ranks[rank].release(h, publish=publish)

    @rule(rank=st.integers(0, 1), pages=st.integers(0, 16), checkpoints=st.integers(0, 3))
    def evict(self, rank, pages, checkpoints):
        self.ranks[rank].evict(pages=pages, checkpoints=checkpoints)

    @invariant()
    def integrity(self):
        for cache in self.ranks:
            cache.check_integrity()


_settings = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
RealCacheMachine.TestCase.settings = settings(_settings, max_examples=200, stateful_step_count=60)
SharedL2Machine.TestCase.settings = settings(_settings, max_examples=200, stateful_step_count=60)

TestRealCache = RealCacheMachine.TestCase
TestSharedL2 = SharedL2Machine.TestCase
