"""Engine fixtures: the tiny model, a reference of what each request alone must produce, the
multi-rank scenario's single-rank reference, and the rank processes of a module stopped after it."""

import pytest
import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.generate import greedy_generate
from tokenspeed.model.init import init_random_weights


def tiny_model() -> KimiForCausalLM:
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=21).eval()


@pytest.fixture(scope="session")
def tiny():
    return tiny_model()


def tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding of one request alone, through the model's own forward."""
    return greedy_generate(model, [prompt], max_tokens, stop_token_ids=())[0]


@pytest.fixture(scope="session")
def steady():
    """`steady_model()`, shared by a session's tests. (A model of its own: an engine on a GPU
    moves `tiny` there, and its CUDA stream cannot be copied.)"""
    return steady_model()


def steady_model() -> KimiForCausalLM:
    """`tiny` whose routers always pick the same experts: the score correction bias of expert e
    is 2e, larger than any spread of the sigmoid scores, so no two experts ever tie."""
    model = tiny_model()
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert gates
    with torch.no_grad():
        for gate in gates:
            bias = gate.e_score_correction_bias
            bias.copy_(2.0 * torch.arange(len(bias), dtype=bias.dtype))
    return model


@pytest.fixture(scope="session")
def multirank_single() -> dict:
    """test_multirank's scenario on the single-rank engine: the reference of test_multirank and
    test_multirank_dcp (one run for both), with that engine's page count (less the null page)
    and MLA page bytes."""
    from tokenspeed import LLM

    from .test_multirank import OPTIONS, scenario

    with LLM("tiny", **OPTIONS) as llm:
        got = scenario(llm)
        got["pages"] = llm.engine.cache.sizes.num_pages - 1
        got["mla_page_bytes"] = llm.engine.cache.geometry.mla_page_bytes
    return got


@pytest.fixture(scope="module", autouse=True)
def _rank_pool():
    """The warm rank processes a module's `run_ranks` calls started (tests/parallel/harness.py)
    serve that module only: stopped (by PID) after its last test."""
    yield
    from ..parallel.harness import stop_pool  # here: decode_worker.py imports this module

    stop_pool()
