"""Random weights drawn on the device, for benchmarks of models too large for the host."""

import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import fill_random_on_device


def _empty_tiny() -> KimiForCausalLM:
    with torch.device("meta"):
        model = KimiForCausalLM(get_preset("tiny"))
    return model.to_empty(device="cpu")  # uninitialised memory, as on a GPU


def test_fill_random_on_device_is_seeded_and_fills_everything():
    a = fill_random_on_device(_empty_tiny(), std=0.02, seed=7)
    b = fill_random_on_device(_empty_tiny(), std=0.02, seed=7)
    c = fill_random_on_device(_empty_tiny(), std=0.02, seed=8)
    named = dict(a.named_parameters())
    for name, p in named.items():
        assert torch.equal(p, dict(b.named_parameters())[name]), name
        if "norm" in name:
            assert torch.all(p == 1), name
    weight = named["model.embed_tokens.weight"]
    assert abs(weight.std().item() - 0.02) < 0.002
    assert not torch.equal(weight, dict(c.named_parameters())["model.embed_tokens.weight"])
    assert all(torch.all(buf == 0) for buf in a.buffers())
