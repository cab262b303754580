"""Bad forward inputs raise errors that name the problem."""

import numpy as np
import pytest
import torch

from tokenspeed.model import (
    BatchError,
    DecoderState,
    ForwardBatch,
    PagedKda,
    PagedMla,
    PagedState,
)
from tokenspeed.model.generate import greedy_generate


def test_token_ids_outside_the_vocabulary(tiny_model):
    ids = torch.tensor([5, 512, 7, -1])
    with pytest.raises(BatchError, match=r"token ids \[-1, 512\] are outside the vocabulary"):
        tiny_model(ids, ForwardBatch.build([4]), tiny_model.empty_state())


def test_empty_sequences():
    with pytest.raises(BatchError, match=r"requests \[1\] have no new tokens"):
        ForwardBatch.build([3, 0, 2])
    # A batch of no requests is valid (an idle rank's step; tests/model/test_empty_forward.py).
    assert ForwardBatch.build([]).batch_size == 0


def test_layout_and_state_must_agree(tiny_model):
    with pytest.raises(BatchError, match="input_ids has 3 tokens but the batch layout has 4"):
        tiny_model(torch.tensor([1, 2, 3]), ForwardBatch.build([4]), tiny_model.empty_state())
    with pytest.raises(BatchError, match="state holds 2 requests but the batch has 1"):
        tiny_model(torch.tensor([1]), ForwardBatch.build([1]), tiny_model.empty_state(2))
    with pytest.raises(BatchError, match="prefix_lens=.5."):
        tiny_model(torch.tensor([1]), ForwardBatch.build([1], [5]), tiny_model.empty_state())
    with pytest.raises(BatchError, match="must be 1-D"):
        tiny_model(
            torch.ones(1, 2, dtype=torch.long), ForwardBatch.build([2]), tiny_model.empty_state()
        )


def test_mismatched_lengths():
    with pytest.raises(BatchError, match="2 seq_lens but 1 prefix_lens"):
        ForwardBatch.build([1, 2], [0])
    with pytest.raises(BatchError, match="negative prefix"):
        ForwardBatch.build([1], [-2])


def test_concat_of_nothing():
    with pytest.raises(ValueError, match="at least one state"):
        DecoderState.concat([])


def _prefilled(model, lengths):
    """The state after a real prefill of `lengths` tokens per request (and its batch of one new
    token each), so that only the field a test breaks is wrong."""
    ids = torch.arange(3, 3 + sum(lengths))
    state = model(ids, ForwardBatch.build(lengths), model.empty_state(len(lengths))).state
    return state, ForwardBatch.build([1] * len(lengths), state.num_tokens)


def test_kda_state_must_hold_one_row_per_request(tiny_model):
    kda = tiny_model.config.kda_layers[0]
    state, batch = _prefilled(tiny_model, [3, 2])
    ids = torch.tensor([5, 6])
    three = DecoderState.empty(tiny_model.config, 3)
    broken = state.clone()
    broken.kda[kda].conv = three.kda[kda].conv
    with pytest.raises(
        BatchError,
        match=rf"state.kda\[{kda}\].conv has shape \(3, 192, 3\) but "
        rf"the batch needs \(2, 192, 3\)",
    ):
        tiny_model(ids, batch, broken)
    broken = state.clone()
    broken.kda[kda].recurrent = broken.kda[kda].recurrent[:1]
    with pytest.raises(
        BatchError,
        match=rf"state.kda\[{kda}\].recurrent has shape "
        rf"\(1, 4, 16, 16\) but the batch needs \(2, 4, 16, 16\)",
    ):
        tiny_model(ids, batch, broken)
    broken = state.clone()
    del broken.kda[kda]
    with pytest.raises(BatchError, match=rf"no KDA state for layers \[{kda}\]"):
        tiny_model(ids, batch, broken)


def test_mla_rows_must_match_each_requests_prefix(tiny_model):
    mla = tiny_model.config.mla_layers[0]
    state, batch = _prefilled(tiny_model, [3, 2])
    ids = torch.tensor([5, 6])
    broken = state.clone()
    broken.mla[mla][1] = broken.mla[mla][1][:1]  # a row lost: attends at the wrong positions
    with pytest.raises(
        BatchError,
        match=rf"state.mla\[{mla}\]\[1\] has shape \(1, 48\) but the "
        rf"batch needs \(2, 48\) \(one row per token",
    ):
        tiny_model(ids, batch, broken)
    broken = state.clone()
    broken.mla[mla][0] = torch.cat([broken.mla[mla][0]] * 2)
    with pytest.raises(BatchError, match=r"has shape \(6, 48\) but the batch needs \(3, 48\)"):
        tiny_model(ids, batch, broken)
    broken = state.clone()
    broken.mla[mla] = broken.mla[mla][:1]
    with pytest.raises(
        BatchError,
        match=rf"state.mla\[{mla}\] holds rows of 1 requests but the "
        rf"batch has 2",
    ):
        tiny_model(ids, batch, broken)
    broken = state.clone()
    broken.mla[mla][0] = broken.mla[mla][0][:, :40]
    with pytest.raises(BatchError, match=r"has shape \(3, 40\) but the batch needs \(3, 48\)"):
        tiny_model(ids, batch, broken)
    assert tiny_model(ids, batch, state).logits.shape == (2, tiny_model.config.vocab_size)


def test_a_batch_without_host_prefix_lens_is_checked_against_its_context_lens(tiny_model):
    """A graph runner's batch layout (prefix_lens None) over an explicit state: a mismatch is a
    BatchError, not a TypeError from formatting the message."""
    state, built = _prefilled(tiny_model, [3])
    batch = ForwardBatch(
        seq_lens=built.seq_lens,
        prefix_lens=None,
        cu_seqlens=built.cu_seqlens,
        positions=built.positions,
        token_request=built.token_request,
        context_lens=built.context_lens + 1,
    )
    with pytest.raises(
        BatchError, match=r"tokens per request but the batch says prefix_lens=\[4\]"
    ):
        tiny_model(torch.tensor([5]), batch, state)


def _paged(model, slots, table, page=4):
    cfg = model.config
    return PagedState(
        kda={
            i: PagedKda(
                torch.zeros(4, cfg.kda.conv_channels, cfg.kda.conv_kernel - 1),
                torch.zeros(4, cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.head_dim),
                torch.tensor(slots),
            )
            for i in cfg.kda_layers
        },
        mla={
            i: PagedMla(torch.zeros(8, page, cfg.mla.latent_width), torch.tensor(table))
            for i in cfg.mla_layers
        },
    )


def test_paged_state_must_cover_the_batch(tiny_model):
    kda, mla = tiny_model.config.kda_layers[0], tiny_model.config.mla_layers[0]
    batch = ForwardBatch.build([1, 1], [3, 6])  # request 1 reaches 7 tokens: two pages of 4
    ids = torch.tensor([5, 6])
    with pytest.raises(
        BatchError,
        match=rf"state.kda\[{kda}\].slots has shape \(1,\) but the "
        rf"batch needs \(2,\)",
    ):
        tiny_model(ids, batch, _paged(tiny_model, [1], [[1, 0], [2, 3]]))
    with pytest.raises(
        BatchError,
        match=rf"state.mla\[{mla}\].page_table has shape \(1, 2\) but "
        rf"the batch needs one row per request: \(2, pages\)",
    ):
        tiny_model(ids, batch, _paged(tiny_model, [1, 2], [[1, 0]]))
    with pytest.raises(
        BatchError,
        match=rf"state.mla\[{mla}\].page_table holds 1 pages of 4 "
        rf"tokens \(4 tokens\) but a request reaches 7",
    ):
        tiny_model(ids, batch, _paged(tiny_model, [1, 2], [[1], [2]]))
    tiny_model(ids, batch, _paged(tiny_model, [1, 2], [[1, 0], [2, 3]]))


@pytest.mark.parametrize("bad", [2.0, "2", True])
def test_greedy_generate_refuses_non_integer_arguments(tiny_model, bad):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        greedy_generate(tiny_model, [[5, 6]], bad)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] must be an integer"):
        greedy_generate(tiny_model, [[5, bad]], 2)
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\] must be an integer"):
        greedy_generate(tiny_model, [[5, 6]], 2, stop_token_ids=[bad])


def test_greedy_generate_takes_numpy_and_tensor_integers(tiny_model):
    want = greedy_generate(tiny_model, [[5, 6, 7]], 3)
    assert greedy_generate(tiny_model, [np.array([5, 6, 7])], np.int64(3)) == want
    assert greedy_generate(tiny_model, torch.tensor([[5, 6, 7]]), torch.tensor(3)) == want
