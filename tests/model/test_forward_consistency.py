"""One forward, many step shapes: prefill, extend, decode and verify must agree exactly enough
that a served request gets the tokens it would get from a single pass over its whole text."""

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.model import DecoderState, ForwardBatch

TOL = 1e-4


def _tokens(n, seed=0, vocab=512):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model, ids, seq_lens, state):
    batch = ForwardBatch.build(seq_lens, state.num_tokens)
    return model(ids, batch, state)


def _assert_states_close(a: DecoderState, b: DecoderState):
    assert a.num_tokens == b.num_tokens
    for layer in a.kda:
        assert torch.allclose(a.kda[layer].conv, b.kda[layer].conv, atol=TOL)
        assert torch.allclose(a.kda[layer].recurrent, b.kda[layer].recurrent, atol=TOL)
    for layer in a.mla:
        for x, y in zip(a.mla[layer], b.mla[layer], strict=True):
            assert x.shape == y.shape
            assert torch.allclose(x, y, atol=TOL)


def test_prefill_then_decodes_equals_one_forward(model):
    ids = _tokens(90)
    full = _run(model, ids, [90], model.empty_state())
    out = _run(model, ids[:70], [70], model.empty_state())
    logits, state = [out.logits], out.state
    for t in range(70, 90):
        out = _run(model, ids[t : t + 1], [1], state)
        logits.append(out.logits)
        state = out.state
    assert (torch.cat(logits) - full.logits).abs().max() <= TOL
    _assert_states_close(state, full.state)


def test_chunked_prefill_at_arbitrary_boundaries_ends_in_the_same_state(model):
    ids = _tokens(150, seed=1)
    full = _run(model, ids, [150], model.empty_state())
    for cuts in ([1, 63, 64, 22], [100, 50], [7, 7, 7, 129]):
        state, pos, logits = model.empty_state(), 0, []
        for n in cuts:
            out = _run(model, ids[pos : pos + n], [n], state)
            state, pos = out.state, pos + n
            logits.append(out.logits)
        assert (torch.cat(logits) - full.logits).abs().max() <= TOL
        _assert_states_close(state, full.state)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(cuts=st.sets(st.integers(1, 47), max_size=7))
def test_prefill_cut_anywhere_ends_in_the_same_state(model, cuts):
    # Any set of cut points in a 48-token prompt: pieces of 1..4 tokens take the recurrent
    # KDA and absorbed MLA forms, longer ones the chunked and expanded forms.
    ids = _tokens(48, seed=5)
    full = _run(model, ids, [48], model.empty_state())
    bounds = [0, *sorted(cuts), 48]
    state, logits = model.empty_state(), []
    for start, end in itertools.pairwise(bounds):
        out = _run(model, ids[start:end], [end - start], state)
        state = out.state
        logits.append(out.logits)
    assert (torch.cat(logits) - full.logits).abs().max() <= TOL
    _assert_states_close(state, full.state)


def test_packed_batch_equals_each_sequence_alone(model):
    lengths = [33, 1, 70, 4, 12]
    seqs = [_tokens(n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = _run(model, torch.cat(seqs), lengths, model.empty_state(len(lengths)))
    alone = [_run(model, s, [len(s)], model.empty_state()) for s in seqs]
    assert (packed.logits - torch.cat([a.logits for a in alone])).abs().max() <= TOL
    for got, want in zip(packed.state.split(), alone, strict=True):
        _assert_states_close(got, want.state)


def test_packed_extension_of_cached_prefixes_of_different_lengths(model):
    # Two requests with cached prefixes of different lengths extend together, mixing a decode
    # (1 token) with an extension (9 tokens), against each request run alone in one pass.
    a, b = _tokens(40, seed=20), _tokens(25, seed=21)
    sa = _run(model, a[:30], [30], model.empty_state()).state
    sb = _run(model, b[:16], [16], model.empty_state()).state
    both = DecoderState.concat([sa, sb])
    out = _run(model, torch.cat([a[30:31], b[16:25]]), [1, 9], both)
    ref_a = _run(model, a[:31], [31], model.empty_state())
    ref_b = _run(model, b[:25], [25], model.empty_state())
    assert (out.logits[:1] - ref_a.logits[30:31]).abs().max() <= TOL
    assert (out.logits[1:] - ref_b.logits[16:25]).abs().max() <= TOL


def test_verify_of_four_tokens_equals_four_decodes(model):
    ids = _tokens(60, seed=2)
    prefix = _run(model, ids[:50], [50], model.empty_state()).state
    verify = _run(model, ids[50:54], [4], prefix.clone())
    state, logits = prefix, []
    for t in range(50, 54):
        out = _run(model, ids[t : t + 1], [1], state)
        state = out.state
        logits.append(out.logits)
    assert (verify.logits - torch.cat(logits)).abs().max() <= TOL
    _assert_states_close(verify.state, state)


def test_batched_verify_with_uneven_prefixes(model):
    seqs = [_tokens(n, seed=30 + n) for n in (20, 45, 9)]
    states = [_run(model, s[:-4], [len(s) - 4], model.empty_state()).state for s in seqs]
    out = _run(model, torch.cat([s[-4:] for s in seqs]), [4, 4, 4], DecoderState.concat(states))
    for i, s in enumerate(seqs):
        ref = _run(model, s, [len(s)], model.empty_state()).logits[-4:]
        assert (out.logits[4 * i : 4 * i + 4] - ref).abs().max() <= TOL


def test_forward_does_not_modify_the_state_passed_in(model):
    ids = _tokens(10, seed=4)
    state = _run(model, ids[:6], [6], model.empty_state()).state
    before = state.clone()
    _run(model, ids[6:], [4], state)
    _assert_states_close(state, before)
    assert all(x.shape[0] == 6 for rows in state.mla.values() for x in rows)
