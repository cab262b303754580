"""The engine's request record: one growing token list, read in place.

Before, `all_ids` built prompt + outputs anew on every access (a 200k-token prompt cost a copy per
row per step); the record now keeps one list that only grows, and the output ids are a view of it.
"""

import pytest

from tokenspeed.runtime import Engine, EngineConfig, RequestError, SamplingParams
from tokenspeed.runtime.request_record import TokenTail

from .conftest import tokens


def test_token_tail_reads_the_list_in_place():
    history = [1, 2, 3]
    tail = TokenTail(history, 2)
    assert len(tail) == 1 and tail[0] == tail[-1] == 3
    history += [4, 5]  # the list grows: the view sees it without being rebuilt
    assert len(tail) == 3 and list(tail) == [3, 4, 5] and tail[-1] == 5
    assert tail[:] == [3, 4, 5] and tail[1:] == [4, 5] and tail[:-1] == [3, 4]
    assert tail[::-1] == [5, 4, 3] and tail[::2] == [3, 5]
    with pytest.raises(IndexError):
        tail[3]
    with pytest.raises(IndexError):
        tail[-4]
    assert TokenTail(history, 5)[:] == [] and len(TokenTail(history, 5)) == 0


def test_the_record_keeps_one_token_list_that_grows(tiny):
    engine = Engine(tiny, None, EngineConfig(page_size=16, max_num_seqs=2, max_model_len=200))
    prompt = tokens(40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", prompt, params)
    record = engine._records["a"]
    history = record.tokens
    assert history == prompt and history is not prompt  # the caller's list is not grown
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        if "a" in engine._records:
            # The very same list object, grown by each output: no rebuild on access.
            assert record.tokens is history and record.tokens is record.tokens
            assert history[len(prompt) :] == record.output_ids[:]
    assert len(history) == len(prompt) + 6 and history[:40] == prompt
    assert history[40:] == outs[-1].token_ids and record.output_ids[:] == outs[-1].token_ids
    assert outs[-1].prompt_token_ids == prompt


def test_an_engine_request_is_one_completion(tiny):
    """n > 1 is LLM.generate's to expand (n requests, merged); the engine refuses it rather than
    silently returning one completion."""
    engine = Engine(tiny, None, EngineConfig(page_size=16, max_num_seqs=2, max_model_len=200))
    with pytest.raises(RequestError, match=r"n=3, but an engine request is one completion"):
        engine.add_request("a", tokens(10, seed=1), SamplingParams(n=3, max_tokens=4))
    assert not engine.has_unfinished()
