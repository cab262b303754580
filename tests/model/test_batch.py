"""ForwardBatch: the host views of its layout agree with the device tensors."""

import numpy as np
import pytest
import torch

from tokenspeed.model import BatchError, ForwardBatch


def test_host_layout_matches_device_tensors():
    batch = ForwardBatch.build([3, 1, 5], prefix_lens=[0, 7, 2])
    assert torch.equal(batch.cu_seqlens_host, batch.cu_seqlens.cpu())
    assert batch.cu_seqlens_host.dtype == torch.int64
    assert list(batch.segments()) == [(0, slice(0, 3)), (1, slice(3, 4)), (2, slice(4, 9))]
    assert batch.total_lens == (3, 8, 7)


@pytest.mark.parametrize("bad", [2.5, 2.0, "2", True, torch.tensor(True), torch.tensor(2.0)])
def test_lengths_must_be_integers(bad):
    """int() would truncate 2.5 to 2, parse "2" and take True for 1: a wrong layout, silently."""
    with pytest.raises(BatchError, match=r"seq_lens\[1\] must be an integer"):
        ForwardBatch.build([3, bad])
    with pytest.raises(BatchError, match=r"prefix_lens\[0\] must be an integer"):
        ForwardBatch.build([3], [bad])


def test_lengths_must_be_a_sequence():
    with pytest.raises(BatchError, match="seq_lens must be a sequence of integers, got 3"):
        ForwardBatch.build(3)
    with pytest.raises(BatchError, match="prefix_lens must be a sequence of integers"):
        ForwardBatch.build([1, 1], "00")


def test_numpy_and_tensor_integers_are_lengths():
    batch = ForwardBatch.build(np.array([3, 1]), torch.tensor([0, 7]))
    assert batch.seq_lens == (3, 1) and batch.prefix_lens == (0, 7)
    assert all(type(n) is int for n in (*batch.seq_lens, *batch.prefix_lens))


def test_a_batch_of_no_requests():
    """An idle rank still runs the step (its collectives must line up with the other ranks')."""
    for batch in (ForwardBatch.build([]), ForwardBatch.build([], prefix_lens=[])):
        assert batch.batch_size == 0 and batch.num_tokens == 0
        assert batch.cu_seqlens.tolist() == [0] and torch.equal(
            batch.cu_seqlens_host, torch.zeros(1, dtype=torch.int64)
        )
        for t in (batch.positions, batch.token_request, batch.context_lens):
            assert t.shape == (0,) and t.dtype == torch.int64
        assert batch.last_token_indices.shape == (0,)
        assert batch.total_lens == () and list(batch.segments()) == []
        assert batch.uniform_len is None  # no common length: the per-request paths, run 0 times


def test_requests_without_new_tokens_are_still_refused():
    for lens in ([0], [3, 0, 2], [-1]):
        with pytest.raises(BatchError, match="have no new tokens"):
            ForwardBatch.build(lens)
    with pytest.raises(BatchError, match="0 seq_lens but 1 prefix_lens"):
        ForwardBatch.build([], [0])


def test_uniform_len():
    assert ForwardBatch.build([2, 2, 2]).uniform_len == 2
    assert ForwardBatch.build([1]).uniform_len == 1
    assert ForwardBatch.build([1, 2]).uniform_len is None
