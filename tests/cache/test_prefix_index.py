"""`PrefixIndex`: the hybrid rule over both tiers, and when a match taken earlier is reused.

(More hybrid-rule cases, through allocation and the bytes restored, are in test_manager.py.)"""

from __future__ import annotations

from tokenspeed.cache import CheckpointKind, KeyChain, LocalHostCache
from tokenspeed.cache.prefix_index import PrefixIndex

from .helpers import make_manager, prefix_seed, token_stream, write_live_state, write_pages

P = 4


def _computed(cache, rid, tokens, checkpoints, *, publish=False):
    """`tokens` allocated, their pages written and checkpointed at `checkpoints`, released."""
    keys = KeyChain(P).append_tokens(tokens)
    h = cache.allocate(rid, keys, len(tokens))
    write_pages(cache, h, 0, len(tokens) // P)
    for length in checkpoints:
        write_live_state(cache, h, prefix_seed(tokens[:length]))
        cache.checkpoint(h, length, kind=CheckpointKind.TURN_END)
    if publish:
        cache.publish(h)
    cache.release(h)
    return keys


def test_the_manager_matches_through_its_prefix_index():
    cache = make_manager()
    assert isinstance(cache._index, PrefixIndex)
    tokens = token_stream(1, 33)
    keys = _computed(cache, "a", tokens, [16])
    m = cache._index.match(keys, 33)
    # Pages become matchable with the checkpoint that ends them: [0, 16) here.
    assert (m.num_tokens, m.mla_covered_tokens, m.checkpoint_tier) == (16, 16, "l1")
    via_manager = cache.match(keys, 33)
    assert via_manager.num_tokens == 16 and via_manager.sources.tolist() == m.sources.tolist()


def test_a_disabled_index_matches_nothing():
    cache = make_manager(prefix_caching=False)
    tokens = token_stream(2, 33)
    keys = _computed(cache, "a", tokens, [16, 32])
    m = cache.match(keys, 33)
    assert (m.num_tokens, m.mla_covered_tokens, len(m.sources)) == (0, 0, 0)


def test_a_match_is_reused_only_while_nothing_changed():
    cache = make_manager()
    tokens = token_stream(3, 33)
    keys = _computed(cache, "a", tokens, [16])
    index = cache._index
    m = index.match(keys, 33)
    assert index.usable(m, keys, 33) is m  # nothing changed: the same object, no new walk
    _computed(cache, "b", tokens, [32])  # a deeper checkpoint of the same prefix
    fresh = index.usable(m, keys, 33)
    assert fresh is not m and fresh.num_tokens == 32
    # Another prompt (other keys in scope) is never answered by this match.
    other = KeyChain(P).append_tokens(token_stream(4, 33))
    assert index.usable(fresh, other, 33).num_tokens == 0


def test_a_match_from_another_manager_is_never_reused():
    a, b = make_manager(), make_manager()
    tokens = token_stream(5, 33)
    keys = _computed(a, "x", tokens, [32])
    foreign = a.match(keys, 33)
    assert foreign.num_tokens == 32
    assert b._index.usable(foreign, keys, 33).num_tokens == 0


def test_pages_and_checkpoint_found_in_the_host_tier_only():
    l2 = LocalHostCache(capacity_bytes=1 << 20)
    writer, reader = make_manager(l2=l2), make_manager(l2=l2)
    tokens = token_stream(6, 33)
    keys = _computed(writer, "a", tokens, [32], publish=True)
    m = reader.match(keys, 33)
    assert (m.num_tokens, m.l1_tokens, m.l2_tokens, m.checkpoint_tier) == (32, 0, 32, "l2")
    assert (m.sources < 0).all()  # every page comes from L2
    l2.close()
