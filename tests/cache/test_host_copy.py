"""Host-to-device copies of step inputs: right values, and on CUDA no wait for the stream."""

import pytest
import torch

from tokenspeed.cache.host_copy import copy_into, to_device


def test_on_the_cpu_they_are_plain_copies():
    src = torch.arange(6, dtype=torch.int32)
    assert torch.equal(to_device(src, "cpu"), src)
    dst = torch.zeros(6, dtype=torch.int32)
    copy_into(dst, src)
    assert torch.equal(dst, src)


@pytest.mark.gpu
def test_on_cuda_the_host_does_not_wait_for_queued_work():
    busy = torch.cuda.Event()
    torch.cuda._sleep(200_000_000)  # a kernel spinning for a few hundred milliseconds
    busy.record()
    src = torch.arange(1000, dtype=torch.int64)
    out = to_device(src, "cuda")
    dst = torch.empty(1000, dtype=torch.int64, device="cuda")
    copy_into(dst, src + 1)
    assert not busy.query()  # both returned while the spinning kernel still ran
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), src) and torch.equal(dst.cpu(), src + 1)
