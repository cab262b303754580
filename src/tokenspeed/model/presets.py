"""Named model configurations.

`tiny` has K3's structure at toy width (KDA with the lower-bound gate and a full-rank output gate,
gated MLA with a q LoRA, attention residuals, a latent MoE with a shared expert, SiTU, a dense
first layer) so CPU tests exercise every K3 part; the other presets carry the real shapes and are
only instantiated on machines that can hold them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .config import ActivationConfig, ConfigError, KdaConfig, MlaConfig, ModelConfig, MoeConfig


def mla_every(period: int, num_layers: int, also_last: bool = True) -> tuple[str, ...]:
    """Layer kinds with MLA at 1-based layers period, 2*period, ... (and the last one)."""
    kinds = ["mla" if (i + 1) % period == 0 else "kda" for i in range(num_layers)]
    if also_last:
        kinds[-1] = "mla"
    return tuple(kinds)


def dense_first(num_dense: int, num_layers: int) -> tuple[str, ...]:
    return tuple("dense" if i < num_dense else "moe" for i in range(num_layers))


def tiny(kda_gate: str = "lower_bound") -> ModelConfig:
    """K3 at toy width: 9 layers (MLA at 1-based 4, 8 and 9), AttnRes blocks of 4."""
    layers = 9
    return ModelConfig(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        layer_kinds=mla_every(4, layers),
        mlp_kinds=dense_first(1, layers),
        dense_intermediate_size=128,
        kda=KdaConfig(
            num_heads=4,
            head_dim=16,
            gate=kda_gate,
            gate_lower_bound=-5.0,
            full_rank_output_gate=True,
        ),
        mla=MlaConfig(
            num_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,  # 16: the smallest width the MLA kernels tile
            v_head_dim=16,
            output_gate=True,
        ),
        moe=MoeConfig(
            num_experts=16,
            top_k=4,
            expert_intermediate_size=32,
            num_shared_experts=1,
            latent_size=32,
            latent_norm=True,
            routed_scaling_factor=1.0,
        ),
        activation=ActivationConfig(kind="situ", situ_beta=4.0, situ_linear_beta=25.0),
        attn_res_block_size=4,
        bos_token_id=1,
        eos_token_ids=(2,),
        pad_token_id=0,
    )


def kimi_linear_48b_a3b() -> ModelConfig:
    layers = 27
    return ModelConfig(
        name="kimi-linear-48b-a3b",
        vocab_size=163840,
        hidden_size=2304,
        layer_kinds=mla_every(4, layers),
        mlp_kinds=dense_first(1, layers),
        dense_intermediate_size=9216,
        kda=KdaConfig(num_heads=32, head_dim=128, gate="softplus"),
        mla=MlaConfig(
            num_heads=32,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoeConfig(
            num_experts=256,
            top_k=8,
            expert_intermediate_size=1024,
            num_shared_experts=1,
            routed_scaling_factor=2.446,
        ),
        activation=ActivationConfig(kind="silu"),
        bos_token_id=163584,
        eos_token_ids=(163586,),
        pad_token_id=163839,
    )


def kimi_k3() -> ModelConfig:
    layers = 93
    return ModelConfig(
        name="kimi-k3",
        vocab_size=163840,
        hidden_size=7168,
        layer_kinds=mla_every(4, layers),
        mlp_kinds=dense_first(1, layers),
        dense_intermediate_size=33792,
        kda=KdaConfig(
            num_heads=96,
            head_dim=128,
            gate="lower_bound",
            gate_lower_bound=-5.0,
            full_rank_output_gate=True,
        ),
        mla=MlaConfig(
            num_heads=96,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            output_gate=True,
        ),
        moe=MoeConfig(
            num_experts=896,
            top_k=16,
            expert_intermediate_size=3072,
            num_shared_experts=2,
            latent_size=3584,
            latent_norm=True,
            routed_scaling_factor=1.0,
        ),
        activation=ActivationConfig(kind="situ", situ_beta=4.0, situ_linear_beta=25.0),
        attn_res_block_size=12,
        bos_token_id=163584,
        eos_token_ids=(163586,),
        pad_token_id=163839,
    )


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": tiny,
    "kimi-linear-48b-a3b": kimi_linear_48b_a3b,
    "kimi-k3": kimi_k3,
}


def get_preset(name: str, **options) -> ModelConfig:
    """A named configuration; options go to the preset (e.g. get_preset("tiny", kda_gate=...))."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None
    # Bind first: a TypeError from the call itself could come from inside the factory.
    try:
        inspect.signature(factory).bind(**options)
    except TypeError:
        known = sorted(inspect.signature(factory).parameters)
        raise ConfigError(f"preset {name!r} takes options {known}, got {sorted(options)}") from None
    return factory(**options)
