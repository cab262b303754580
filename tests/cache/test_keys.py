"""Chained page keys: content-addressed, prefix-dependent, incremental, trace-block aware."""

from __future__ import annotations

import hashlib
import struct
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.cache import CacheConfigError, KeyChain, page_keys_for_blocks, page_keys_for_tokens
from tokenspeed.cache.keys import (
    KEY_DTYPE,
    KeyBuffer,
    as_key_int,
    as_page_keys,
    key_at,
    keys_equal,
    keys_from_ints,
    keys_to_ints,
)

ints = keys_to_ints


def test_keys_name_the_whole_prefix():
    arr = page_keys_for_tokens([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert arr.dtype == KEY_DTYPE
    a = ints(arr)
    b = ints(page_keys_for_tokens([9, 2, 3, 4, 5, 6, 7, 8], 4))
    assert len(a) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second page, different history
    assert a == ints(page_keys_for_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9], 4))  # partial page: no key
    assert all(isinstance(k, int) and 0 <= k < 1 << 128 for k in a)


def test_salt_separates_key_spaces():
    tokens = list(range(8))
    assert ints(page_keys_for_tokens(tokens, 4, salt=b"model-a")) != ints(
        page_keys_for_tokens(tokens, 4, salt=b"model-b")
    )


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 200_000), min_size=0, max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=5),
)
def test_incremental_appends_give_the_same_keys(tokens, cuts):
    chain = KeyChain(4)
    new = []
    prev = 0
    for cut in [*sorted(min(c, len(tokens)) for c in cuts), len(tokens)]:
        new += ints(chain.append_tokens(tokens[prev:cut]))
        prev = cut
    assert new == chain.keys.tolist() == ints(page_keys_for_tokens(tokens, 4))
    assert chain.num_tokens == len(tokens)


def test_trace_blocks_map_to_pages():
    # A 512-token block spans 8 pages of 64: eight keys, chained like any others.
    keys = ints(page_keys_for_blocks([10, 11], 1024, block_size=512, page_size=64))
    assert len(keys) == 16 and len(set(keys)) == 16
    # Equal block ids = equal content: two sessions sharing block 10 share its 8 page keys.
    other = ints(page_keys_for_blocks([10, 12], 1024, block_size=512, page_size=64))
    assert other[:8] == keys[:8] and other[8:] != keys[8:]
    # A partial last block yields keys for its full pages only.
    partial = ints(page_keys_for_blocks([10, 11], 512 + 100, block_size=512, page_size=64))
    assert partial == keys[:9]


def test_blocks_grow_incrementally_across_turns():
    chain = KeyChain(64)
    turn1 = ints(chain.append_blocks([1, 2, 3], 1300, 512))  # 20 full pages, 20 tokens pending
    assert len(turn1) == 20 and chain.num_tokens == 1300
    turn2 = ints(chain.append_blocks([4], 300, 512))
    assert len(chain.keys) == 25  # 1600 tokens
    assert turn1 + turn2 == chain.keys.tolist()
    fork = chain.fork()
    fork.append_blocks([5], 64, 512)
    assert len(fork.keys) == 26 and len(chain.keys) == 25
    again = KeyChain(64)
    again.append_blocks([1, 2, 3], 1300, 512)
    again.append_blocks([4], 300, 512)
    assert keys_equal(again.keys, chain.keys)  # deterministic: no re-hashing needed to agree


def test_tokens_and_blocks_never_collide():
    assert ints(page_keys_for_tokens(list(range(64)), 64)) != ints(
        page_keys_for_blocks([0], 64, block_size=64, page_size=64)
    )


def test_bad_block_arguments():
    with pytest.raises(CacheConfigError):
        KeyChain(0)
    with pytest.raises(CacheConfigError):
        KeyChain(True)  # a bool is not a page size
    with pytest.raises(CacheConfigError):
        KeyChain(64).append_blocks([1, 2], 100, 512)  # 2 ids cannot describe 100 tokens
    with pytest.raises(CacheConfigError):
        KeyChain(64).append_blocks([1], 100, 0)


def _reference_keys(appends: list, page_size: int) -> list[int]:
    """Page keys spelled out: split the content into pages, encode each page's pieces (a block
    piece `B (id, start, end)`, a token piece `T count tokens`), chain the hashes."""
    pieces: list = []  # flattened content: ("b", id, start, end) / ("t", token) per token run
    for kind, data, n, size in appends:
        if kind == "t":
            pieces += [("t", t) for t in data]
        else:
            for b, block in enumerate(data):
                length = min(size, n - b * size)
                pieces += [("b", block, i) for i in range(length)]
    prev = hashlib.blake2b(b"tokenspeed-root", digest_size=16).digest()
    keys = []
    for p in range(len(pieces) // page_size):
        page = pieces[p * page_size : (p + 1) * page_size]
        parts, i = [], 0
        while i < len(page):
            j = i
            if page[i][0] == "t":
                while j < len(page) and page[j][0] == "t":
                    j += 1
                toks = [x[1] for x in page[i:j]]
                parts.append(b"T" + struct.pack("<I", len(toks)) + array("q", toks).tobytes())
            else:
                block, start = page[i][1], page[i][2]
                while (
                    j < len(page)
                    and page[j][0] == "b"
                    and page[j][1] == block
                    and (page[j][2] == start + (j - i))
                ):
                    j += 1
                parts.append(b"B" + struct.pack("<qII", block, start, start + (j - i)))
            i = j
        prev = hashlib.blake2b(prev + b"".join(parts), digest_size=16).digest()
        keys.append(int.from_bytes(prev, "little"))
    return keys


_append = st.one_of(
    st.tuples(st.just("t"), st.lists(st.integers(0, 9), max_size=12)),
    st.tuples(st.just("b"), st.integers(0, 40)),
)


@settings(max_examples=150, deadline=None)
@given(
    appends=st.lists(_append, max_size=8),
    block_ids=st.lists(st.integers(-3, 3), min_size=8),
    block_size=st.sampled_from([6, 8]),  # pages straddle blocks, or a block is two whole pages
)
def test_block_appends_match_the_spelled_out_pieces(appends, block_ids, block_size):
    """The one-pass `append_blocks` gives the keys of the content written out page by page
    (pages straddling blocks and token runs, a block id repeated, partial last blocks)."""
    chain, spelled = KeyChain(4), []
    ids = iter(block_ids * 10)
    for kind, arg in appends:
        if kind == "t":
            chain.append_tokens(arg)
            spelled.append(("t", arg, len(arg), 0))
        else:
            blocks = [next(ids) for _ in range(-(-arg // block_size))]
            chain.append_blocks(blocks, arg, block_size)
            spelled.append(("b", blocks, arg, block_size))
    assert chain.keys.tolist() == _reference_keys(spelled, 4)


# ------------------------------------------------------------------------ representation
def test_a_key_is_its_digest_read_little_endian():
    tokens = list(range(8))
    digest = hashlib.blake2b(
        hashlib.blake2b(b"tokenspeed-root", digest_size=16).digest()
        + b"T"
        + struct.pack("<I", 4)
        + array("q", tokens[:4]).tobytes(),
        digest_size=16,
    ).digest()
    keys = page_keys_for_tokens(tokens, 4)
    assert keys[0].tobytes() == digest
    assert key_at(keys, 0) == int.from_bytes(digest, "little")
    assert int(keys["lo"][0]) == int.from_bytes(digest[:8], "little")
    assert int(keys["hi"][0]) == int.from_bytes(digest[8:], "little")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, (1 << 128) - 1), max_size=20))
def test_int_conversions_round_trip(values):
    arr = keys_from_ints(values)
    assert arr.dtype == KEY_DTYPE and len(arr) == len(values)
    assert keys_to_ints(arr) == values
    assert [key_at(arr, i) for i in range(len(values))] == values
    assert as_page_keys(values).tobytes() == arr.tobytes()
    assert as_page_keys(arr) is arr


def test_keys_outside_128_bits_are_refused():
    for bad in ([-1], [1 << 128]):
        with pytest.raises(CacheConfigError):
            keys_from_ints(bad)


def test_keys_must_be_integers_numpy_ones_included():
    assert keys_to_ints(keys_from_ints([np.uint64(7), np.int64(9)])) == [7, 9]
    assert as_key_int(np.uint64(5)) == 5 and type(as_key_int(np.uint64(5))) is int
    for bad in (True, 1.0, "1", None):
        with pytest.raises(CacheConfigError, match="page keys must be integers"):
            as_key_int(bad)


def test_key_buffer_grows_and_its_views_stay_as_they_were():
    buf = KeyBuffer()
    buf.extend(keys_from_ints(range(10)))
    first = buf[:10]
    for start in range(10, 200, 10):  # several regrowths
        buf.extend(keys_from_ints(range(start, start + 10)))
    assert len(buf) == 200 and buf.tolist() == list(range(200))
    assert keys_to_ints(first) == list(range(10))  # a view taken before the growth
    assert buf[5] == 5 and buf[-1] == 199 and list(buf)[:3] == [0, 1, 2]
    with pytest.raises(IndexError):
        buf[200]
    assert not buf.array.flags.writeable
    copy = buf.copy()
    copy.extend([500])
    assert len(copy) == 201 and len(buf) == 200
    assert keys_equal(as_page_keys(buf), buf.array) and not keys_equal(buf, copy)


def test_a_buffer_over_read_only_keys_shares_them_until_it_grows():
    chain = KeyChain(4)
    chain.append_tokens(list(range(40)))
    view = chain.keys[:]  # read-only
    buf = KeyBuffer.over(view)
    assert buf.array.base is view.base and len(buf) == 10  # no copy
    buf.extend(keys_from_ints([99]))
    assert len(buf) == 11 and buf[10] == 99 and len(view) == 10  # the shared keys untouched
    mine = keys_from_ints([1, 2, 3])  # writeable: copied at once
    over_mine = KeyBuffer.over(mine)
    mine[0] = (7, 0)
    assert over_mine.tolist() == [1, 2, 3]
