"""`KdaStateKeeper` over a real `CacheManager` (tiny geometry, CPU tensors) and its port.

No model: a "forward" here is writing a known KDA state into the request's live slot
(`write_live_state`), so every checkpoint slot can be checked against the state it must hold.
"""

import pytest
import torch

from tests.cache.helpers import live_state_matches, make_manager, state_content, write_live_state
from tokenspeed.cache import KeyChain
from tokenspeed.runtime.kda_keeper import KdaStateKeeper
from tokenspeed.sched import Request
from tokenspeed.sched.cache_adapter import CacheManagerPort

P = 4  # tiny_geometry's page size


def _setup(checkpoints=8):
    cache = make_manager(checkpoints=checkpoints)
    port = CacheManagerPort(cache)
    return cache, port, KdaStateKeeper(port)


def _request(rid, seed, tokens=12):
    chain = KeyChain(P)
    chain.append_tokens([seed * 1000 + t for t in range(tokens)])
    return Request(rid, tokens, 4, keys=chain.keys)


def _admit(port, rid, tokens=12, seed=0):
    """A request holding pages for `tokens` tokens (its keys known), nothing cached before."""
    req = _request(rid, seed, tokens)
    assert port.acquire(req, tokens - 1) == 0
    assert port.reserve(req, tokens)
    return req


def _resumes_from(cache, port, rid, seed, state_seed) -> int:
    """Admit a new request with the tokens of `seed`: the prefix it hits, after checking that
    its live state was restored to the state of `state_seed` (the checkpoint it hit)."""
    req = _request(rid, seed)
    hit = port.acquire(req, req.prompt_len - 1)
    assert live_state_matches(cache, port.handle(rid), state_seed)
    return hit


def _slot_holds(cache, slot, seed) -> bool:
    conv, rec = state_content(cache.geometry, seed)
    storage = cache.storage
    return torch.equal(storage.ckpt_conv[:, slot], conv) and torch.equal(
        storage.ckpt_recurrent[:, slot], rec
    )


def _live(port, cache, rid, seed):
    write_live_state(cache, port.handle(rid), seed)


def test_a_stashed_state_is_what_save_state_writes():
    cache, port, keeper = _setup()
    req = _admit(port, "a")
    _live(port, cache, "a", seed=4)
    keeper.stash("a", 4)  # a prefill piece ended at 4
    _live(port, cache, "a", seed=12)  # the next piece moved the live state on
    slot = port.checkpoint(req, 4, turn_end=False, from_live=False)
    assert slot is not None
    keeper.save_state(req, 4, slot)
    assert _slot_holds(cache, slot, seed=4) and not _slot_holds(cache, slot, seed=12)
    assert port.has_checkpoint("a", 4)
    cache.check_integrity()


def test_the_stash_lives_until_cleared():
    cache, port, keeper = _setup()
    req = _admit(port, "a")
    _live(port, cache, "a", seed=4)
    keeper.stash("a", 4)
    keeper.clear_stash()
    slot = port.checkpoint(req, 4, turn_end=False, from_live=False)
    with pytest.raises(RuntimeError, match="no KDA state kept"):
        keeper.save_state(req, 4, slot)
    assert not port.has_checkpoint("a", 4)


def test_a_boundary_without_a_free_slot_is_kept_for_the_turn_end():
    cache, port, keeper = _setup(checkpoints=1)
    x, y = _admit(port, "x", seed=1), _admit(port, "y", seed=2)
    _live(port, cache, "x", seed=10)
    keeper.keep_boundary("x", 4)  # x's rolling checkpoint pins the only slot
    assert port.has_checkpoint("x", 4)
    _live(port, cache, "y", seed=20)
    keeper.keep_boundary("y", 8)  # no slot for y: the keeper holds the state
    assert not port.has_checkpoint("y", 8)
    _live(port, cache, "y", seed=21)  # y decodes on past its boundary
    port.release(x)  # x's checkpoint is unpinned: the turn end of y can take its slot
    slot = port.checkpoint(y, 8, turn_end=True, from_live=False)
    assert slot is not None
    keeper.save_state(y, 8, slot)
    assert _slot_holds(cache, slot, seed=20)
    assert port.has_checkpoint("y", 8)
    cache.check_integrity()


def test_a_checkpoint_at_a_later_boundary_drops_the_kept_state():
    cache, port, keeper = _setup(checkpoints=1)
    x, y = _admit(port, "x", seed=1), _admit(port, "y", seed=2)
    _live(port, cache, "x", seed=10)
    keeper.keep_boundary("x", 4)
    _live(port, cache, "y", seed=20)
    keeper.keep_boundary("y", 8)  # kept: no slot
    port.release(x)
    _live(port, cache, "y", seed=30)
    keeper.keep_boundary("y", 12)  # a slot now: a rolling checkpoint, the kept state goes
    assert port.has_checkpoint("y", 12)
    with pytest.raises(RuntimeError, match="no KDA state kept"):
        keeper.save_state(y, 8, slot=0)  # (no checkpoint at 8: nothing to discard either)
    assert port.has_checkpoint("y", 12)
    cache.check_integrity()


def test_decoded_checkpoints_only_rows_that_reached_a_page_boundary():
    cache, port, keeper = _setup()
    _admit(port, "a", seed=1)
    b = _admit(port, "b", seed=2)
    _live(port, cache, "a", seed=5)
    _live(port, cache, "b", seed=6)
    keeper.decoded(["a", "b"], [5, 7])  # b computed token 7: its history ends at 8
    assert not any(port.has_checkpoint("a", n) for n in (4, 8))
    assert port.has_checkpoint("b", 8)
    port.release(b)  # the rolling checkpoint stays as b's turn end
    assert _resumes_from(cache, port, "b2", seed=2, state_seed=6) == 8


def test_crossings_of_a_multi_step_run_are_checkpointed_from_their_copies():
    cache, port, keeper = _setup()
    a = _admit(port, "a", seed=1)
    _admit(port, "b", seed=2)
    _live(port, cache, "a", seed=7)
    _live(port, cache, "b", seed=8)
    crossings = keeper.crossings(["a", "b"], [3, 6])  # a's history ends at 4 now
    assert [(i, pos) for i, pos, _ in crossings] == [(0, 4)]
    _live(port, cache, "a", seed=9)  # the run goes on before its tokens are known
    _, pos, state = crossings[0]
    keeper.keep_boundary("a", pos, state)
    assert port.has_checkpoint("a", 4)
    port.release(a)
    assert _resumes_from(cache, port, "a2", seed=1, state_seed=7) == 4
    cache.check_integrity()


def test_a_failed_write_withdraws_the_checkpoint():
    cache, port, keeper = _setup()
    req = _admit(port, "a")
    _live(port, cache, "a", seed=4)
    keeper.stash("a", 4)
    slot = port.checkpoint(req, 4, turn_end=False, from_live=False)
    assert port.has_checkpoint("a", 4)

    def failing(slot, state):
        raise RuntimeError("injected: copy failed")

    port.write_checkpoint_state = failing
    with pytest.raises(RuntimeError, match="copy failed"):
        keeper.save_state(req, 4, slot)
    assert not port.has_checkpoint("a", 4)
    cache.check_integrity()


def test_a_failed_write_of_a_rolling_checkpoint_withdraws_it():
    cache, port, keeper = _setup()
    _admit(port, "a")
    _live(port, cache, "a", seed=4)
    [(_, pos, state)] = keeper.crossings(["a"], [3])
    port.write_checkpoint_state = lambda slot, state: (_ for _ in ()).throw(RuntimeError("copy"))
    with pytest.raises(RuntimeError, match="copy"):
        keeper.keep_boundary("a", pos, state)
    assert not port.has_checkpoint("a", 4)
    cache.check_integrity()


def test_a_missing_state_raises_and_discards_the_checkpoint():
    cache, port, keeper = _setup()
    req = _admit(port, "a")
    _live(port, cache, "a", seed=4)
    keeper.stash("a", 8)  # a state elsewhere is not the one asked for
    slot = port.checkpoint(req, 4, turn_end=False, from_live=False)
    with pytest.raises(RuntimeError, match="no KDA state kept for request 'a' at position 4"):
        keeper.save_state(req, 4, slot)
    assert not port.has_checkpoint("a", 4)
    cache.check_integrity()


def test_forget_drops_everything_kept_of_a_request_and_nothing_of_others():
    cache, port, keeper = _setup(checkpoints=1)
    x, y = _admit(port, "x", seed=1), _admit(port, "y", seed=2)
    _live(port, cache, "x", seed=10)
    keeper.keep_boundary("x", 4)  # pins the only slot
    _live(port, cache, "y", seed=20)
    keeper.keep_boundary("y", 8)  # kept by the keeper
    keeper.stash("y", 4)
    keeper.stash("x", 8)
    keeper.forget("y")
    port.release(x)  # frees the slot for the checkpoints below
    slot = port.checkpoint(y, 8, turn_end=True, from_live=False)
    with pytest.raises(RuntimeError, match="no KDA state kept"):
        keeper.save_state(y, 8, slot)
    assert not port.has_checkpoint("y", 8)
    slot = port.checkpoint(y, 4, turn_end=False, from_live=False)
    with pytest.raises(RuntimeError, match="no KDA state kept"):
        keeper.save_state(y, 4, slot)
    # x's stash survived y's forget.
    z = _admit(port, "x", seed=1)  # x again, same keys: its state at 8 is still stashed
    slot = port.checkpoint(z, 8, turn_end=False, from_live=False)
    keeper.save_state(z, 8, slot)
    assert _slot_holds(cache, slot, seed=10)
    cache.check_integrity()
