"""ForwardBatch: the host views of its layout agree with the device tensors."""

import torch

from tokenspeed.model import ForwardBatch


def test_host_layout_matches_device_tensors():
    batch = ForwardBatch.build([3, 1, 5], prefix_lens=[0, 7, 2])
    assert torch.equal(batch.cu_seqlens_host, batch.cu_seqlens.cpu())
    assert batch.cu_seqlens_host.dtype == torch.int64
    assert list(batch.segments()) == [(0, slice(0, 3)), (1, slice(3, 4)), (2, slice(4, 9))]
    assert batch.total_lens == (3, 8, 7)
