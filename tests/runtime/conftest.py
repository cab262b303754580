"""Engine fixtures: the tiny model, and a reference of what each request alone must produce."""

import pytest
import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.generate import greedy_generate
from tokenspeed.model.init import init_random_weights


@pytest.fixture(scope="session")
def tiny():
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=21).eval()


def tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding of one request alone, through the model's own forward."""
    return greedy_generate(model, [prompt], max_tokens, stop_token_ids=())[0]
