"""Bad forward inputs raise errors that name the problem."""

import pytest
import torch

from tokenspeed.model import BatchError, DecoderState, ForwardBatch


def test_token_ids_outside_the_vocabulary(tiny_model):
    ids = torch.tensor([5, 512, 7, -1])
    with pytest.raises(BatchError, match=r"token ids \[-1, 512\] are outside the vocabulary"):
        tiny_model(ids, ForwardBatch.build([4]), tiny_model.empty_state())


def test_empty_sequences():
    with pytest.raises(BatchError, match=r"requests \[1\] have no new tokens"):
        ForwardBatch.build([3, 0, 2])
    with pytest.raises(BatchError, match="at least one request"):
        ForwardBatch.build([])


def test_layout_and_state_must_agree(tiny_model):
    with pytest.raises(BatchError, match="input_ids has 3 tokens but the batch layout has 4"):
        tiny_model(torch.tensor([1, 2, 3]), ForwardBatch.build([4]), tiny_model.empty_state())
    with pytest.raises(BatchError, match="state holds 2 requests but the batch has 1"):
        tiny_model(torch.tensor([1]), ForwardBatch.build([1]), tiny_model.empty_state(2))
    with pytest.raises(BatchError, match="prefix_lens=.5."):
        tiny_model(torch.tensor([1]), ForwardBatch.build([1], [5]), tiny_model.empty_state())
    with pytest.raises(BatchError, match="must be 1-D"):
        tiny_model(torch.ones(1, 2, dtype=torch.long), ForwardBatch.build([2]),
                   tiny_model.empty_state())


def test_mismatched_lengths():
    with pytest.raises(BatchError, match="2 seq_lens but 1 prefix_lens"):
        ForwardBatch.build([1, 2], [0])
    with pytest.raises(BatchError, match="negative prefix"):
        ForwardBatch.build([1], [-2])


def test_concat_of_nothing():
    with pytest.raises(ValueError, match="at least one state"):
        DecoderState.concat([])
