"""The pieces strung together as the engine will (docs/spec.md, section 4), on one request over a
`DecoderState`: greedy speculative decoding emits exactly what plain greedy decoding does, with
an oracle proposer (long accepts), a corrupted one (partial accepts), the n-gram proposer and the
EAGLE3 drafter (fed the target's auxiliary states at the alignment the docs give)."""

import pytest
import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.eagle3 import Eagle3Drafter, PagedDraftKv
from tokenspeed.model.eagle3_writer import init_random_eagle3
from tokenspeed.model.generate import greedy_generate
from tokenspeed.model.init import init_random_weights
from tokenspeed.runtime.spec import NgramIndex, greedy_accept

from .helpers import drafter_config

K = 3


@pytest.fixture(scope="module")
def target():
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=21).eval()


def speculate(target, prompt, max_tokens, propose, on_kept=None):
    """Greedy speculative decoding of one request. propose(emitted) -> up to K drafts;
    on_kept(ids, aux, prefix) sees the rows the target kept (for the drafter). Returns the
    emitted tokens and the accepted-draft count per verify step."""
    points = (2, 4, 6)
    ids = torch.tensor(prompt)
    out = target(
        ids, ForwardBatch.build([len(ids)]), target.empty_state(), aux_hidden_layers=points
    )
    state, seen = out.state, len(prompt)
    emitted = [int(out.logits[-1].argmax())]
    if on_kept is not None:  # the drafter's rows 0..L-1: tokens x_1..x_L, target states h_0..
        on_kept(torch.tensor([*prompt[1:], emitted[-1]]), out.aux_hidden, 0)
    accepts = []
    while len(emitted) < max_tokens:
        draft = propose(emitted)[:K]
        inputs = torch.tensor([emitted[-1], *draft])
        before = state.clone()
        batch = ForwardBatch.build([len(inputs)], [seen])
        verified = target(inputs, batch, state, aux_hidden_layers=points)
        choice = verified.logits.argmax(-1)
        result = greedy_accept(
            torch.tensor([draft + [0] * (K - len(draft))]),
            torch.cat([choice, choice.new_zeros(K + 1 - len(inputs))])[None],
            [len(draft)],
        )
        kept = int(result.num_emitted[0])  # inputs kept in the state: last token + accepted
        new = result.to_lists()[0]
        accepts.append(kept - 1)
        state = verified.state
        if kept < len(inputs):
            # Roll back (the engine: kda_decode_rollback over the verify's step states; here the
            # state before the verify, advanced over the kept inputs only).
            state = target(inputs[:kept], ForwardBatch.build([kept], [seen]), before).state
        if on_kept is not None:  # the kept rows' states (causal: as the verify computed them)
            on_kept(torch.tensor(new), verified.aux_hidden[:kept], seen)
        seen += kept
        emitted += new
    return emitted[:max_tokens], accepts


def test_oracle_and_corrupted_drafts_give_the_greedy_output(target):
    prompt = list(range(5, 25))
    want = greedy_generate(target, [prompt], 24, stop_token_ids=())[0]

    def oracle(emitted):
        return want[len(emitted) : len(emitted) + K]

    got, accepts = speculate(target, prompt, 24, oracle)
    assert got == want
    assert max(accepts) == K

    def corrupted(emitted):
        draft = oracle(emitted)
        if len(emitted) % 2 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % 512  # accept exactly one
        return draft

    got, accepts = speculate(target, prompt, 24, corrupted)
    assert got == want
    assert 1 in accepts


def test_ngram_proposals_give_the_greedy_output(target):
    prompt = [7, 8, 9, 10, 11] * 6
    want = greedy_generate(target, [prompt], 20, stop_token_ids=())[0]
    index = NgramIndex(1, 3, prompt)
    proposed = []

    def propose(emitted):
        index.extend(emitted[len(index) - len(prompt) :])
        proposed.append(index.propose(K))
        return proposed[-1]

    got, _ = speculate(target, prompt, 20, propose)
    assert got == want
    # Drafts were proposed (a random model rarely repeats itself, so they are rejected: the
    # oracle test covers the accepting side).
    assert sum(map(len, proposed)) > 0


def test_eagle3_drafts_give_the_greedy_output(target):
    # aux_layer_ids: capture points 2, 4, 6, the ones `speculate` asks for.
    config = drafter_config(aux_layer_ids=(1, 3, 5))
    drafter = init_random_eagle3(Eagle3Drafter(config, target.model.embed_tokens), seed=3)
    kv = PagedDraftKv.contiguous(config, 1, 128)
    pending = {}

    def on_kept(ids, aux, prefix):
        pending.update(ids=ids, aux=aux, prefix=prefix)

    def propose(emitted):
        n = len(pending["ids"])
        batch = ForwardBatch.build([n], [pending["prefix"]])
        return drafter.propose(pending["ids"], pending["aux"], batch, kv, K).tokens[0].tolist()

    prompt = list(range(30, 50))
    want = greedy_generate(target, [prompt], 16, stop_token_ids=())[0]
    assert config.capture_points(target.config.num_layers) == (2, 4, 6)
    got, _ = speculate(target, prompt, 16, propose, on_kept)
    assert got == want
