"""Shared model fixtures: small random models of both families."""

import pytest

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.config import ActivationConfig
from tokenspeed.model.init import init_random_weights


def kimi_linear_like():
    """Tiny without K3's additions: softplus gate, low-rank gates, no AttnRes, SiLU, no latent."""
    tiny = get_preset("tiny", kda_gate="softplus")
    return tiny.evolve(
        kda=tiny.kda.__class__(num_heads=4, head_dim=16, gate="softplus"),
        mla=tiny.mla.__class__(
            num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
        ),
        moe=tiny.moe.__class__(
            num_experts=16,
            top_k=4,
            expert_intermediate_size=32,
            num_shared_experts=1,
            routed_scaling_factor=2.446,
        ),
        activation=ActivationConfig(kind="silu"),
        attn_res_block_size=None,
    )


CONFIGS = {
    "tiny-lower-bound": lambda: get_preset("tiny"),
    "tiny-softplus": lambda: get_preset("tiny", kda_gate="softplus"),
    "kimi-linear-like": kimi_linear_like,
}


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def model(request) -> KimiForCausalLM:
    return init_random_weights(KimiForCausalLM(CONFIGS[request.param]()), seed=3).eval()


@pytest.fixture(scope="session")
def tiny_model() -> KimiForCausalLM:
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=5).eval()
