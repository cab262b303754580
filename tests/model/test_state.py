"""DecoderState helpers at their edges: empty batches, models without one kind of layer."""

import pytest
import torch

from tokenspeed.model import DecoderState, ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights


def test_select_names_one_request_and_refuses_one_outside_the_batch():
    state = DecoderState.empty(get_preset("tiny"), 3)
    layer = next(iter(state.kda))
    state.kda[layer].conv[2] = 1.0
    assert torch.equal(state.kda[layer].select(-1).conv, state.kda[layer].select(2).conv)
    assert state.kda[layer].select(-1).conv.shape[0] == 1
    with pytest.raises(IndexError):  # was an empty (0-row) state
        state.kda[layer].select(3)


@pytest.mark.parametrize("bad", [-1, True, 2.0])
def test_empty_refuses_a_batch_size_that_is_no_count(bad):
    with pytest.raises(ValueError, match=f"batch_size must be a non-negative integer, got {bad}"):
        DecoderState.empty(get_preset("tiny"), bad)


def test_an_empty_batch_splits_concats_and_clones():
    cfg = get_preset("tiny")
    empty = DecoderState.empty(cfg, 0)
    assert empty.split() == [] and empty.clone().batch_size == 0
    two = DecoderState.concat([empty, DecoderState.empty(cfg, 2)])
    assert two.batch_size == 2 and all(len(rows) == 2 for rows in two.mla.values())


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_models_with_one_kind_of_layer_split_and_concat_their_state(kind):
    cfg = get_preset("tiny").evolve(layer_kinds=(kind,) * 9)
    model = init_random_weights(KimiForCausalLM(cfg), seed=0).eval()
    out = model(torch.tensor([5, 6, 7, 8]), ForwardBatch.build([3, 1]), model.empty_state(2))
    parts = out.state.split()
    assert [p.num_tokens for p in parts] == [[3], [1]]
    again = DecoderState.concat(parts).clone()
    assert again.num_tokens == [3, 1]
    step = model(torch.tensor([9, 10]), ForwardBatch.build([1, 1], [3, 1]), again)
    assert step.logits.shape == (2, cfg.vocab_size)
