import itertools

from tokenspeed.cache import KeyChain
from tokenspeed.cache.keys import keys_to_ints
from tokenspeed.sim.cluster.sessions import Conversation, PrefixChains
from tokenspeed.workload import AgentXWorkload, Session, Turn


def _fresh_keys(session: Session, turns: int, page: int = 64) -> list[list[int]]:
    """Page keys of each turn's prompt + output, hashed from scratch (no memo, no reuse)."""
    ids = itertools.count(1)
    chain = KeyChain(page)
    out = []
    for t in session.turns[:turns]:
        blocks = list(t.blocks) + [
            -next(ids) for _ in range(-(-t.new_tokens // 512) - len(t.blocks))
        ]
        chain.append_blocks(blocks, t.new_tokens, 512)
        chain.append_blocks(
            [-next(ids) for _ in range(-(-t.output_tokens // 512))], t.output_tokens, 512
        )
        out.append(chain.keys.tolist())
    return out


def test_turns_extend_the_history_and_match_fresh_hashing():
    session = AgentXWorkload(seed=2).session(0)
    conv, prefixes, ids = Conversation(session), PrefixChains(64, 512), itertools.count(1)
    reqs = []
    for _ in range(4):
        reqs.append(conv.next_request(len(reqs), prefixes, ids))
        conv.index += 1
    expected = _fresh_keys(session, 4)
    assert [keys_to_ints(r.keys) for r in reqs] == expected
    for prev, cur in itertools.pairwise(reqs):
        # A turn's prompt is the previous prompt + output + new tokens: keys extend, never change.
        assert keys_to_ints(cur.keys[: len(prev.keys)]) == keys_to_ints(prev.keys)
        assert (
            cur.prompt_len
            == prev.prompt_len + prev.max_new_tokens + session.turns[reqs.index(cur)].new_tokens
        )


def test_shared_prefix_memo_gives_identical_keys_and_is_reused():
    gen = AgentXWorkload(seed=9)
    memo = PrefixChains(64, 512)
    ids = itertools.count(1)
    firsts = [Conversation(gen.session(i)).next_request(i, memo, ids) for i in range(12)]
    alone = [
        Conversation(gen.session(i)).next_request(i, PrefixChains(64, 512), itertools.count(1))
        for i in range(12)
    ]
    for a, b in zip(firsts, alone, strict=True):
        assert a.prompt_len == b.prompt_len
        # Up to the first fresh (output / un-hashed) id the keys are the same content.
        n = (a.prompt_len // 512) * 8
        assert keys_to_ints(a.keys[:n]) == keys_to_ints(b.keys[:n])
    # Every session starts with the same 63 shared blocks: same keys for those 504 pages.
    assert len({r.keys[:504].tobytes() for r in firsts}) == 1
    assert memo._chains  # shared boundaries were remembered


def test_outputs_and_unhashed_tails_are_unique_content():
    s = Session(sid="x", turns=(Turn(new_tokens=1000, output_tokens=600, blocks=(7,)),))
    ids = itertools.count(1)
    a = Conversation(s).next_request(0, PrefixChains(64, 512), ids)
    b = Conversation(s).next_request(1, PrefixChains(64, 512), ids)
    assert keys_to_ints(a.keys[:8]) == keys_to_ints(b.keys[:8])  # block 7: 512 identical tokens
    # The un-hashed tail and the output differ.
    tails = zip(keys_to_ints(a.keys[8:]), keys_to_ints(b.keys[8:]), strict=True)
    assert all(x != y for x, y in tails)
    assert len(a.keys) == (1000 + 600) // 64
