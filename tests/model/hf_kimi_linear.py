"""Build tiny random Kimi Linear checkpoints with transformers (the reference nobody here wrote).

transformers binds fla's Triton kernels at import time when fla is importable, and those fail
without a GPU driver; the modeling module is therefore imported with fla hidden, after which
fla is importable again for the op tests.
"""

from __future__ import annotations

import importlib
import sys

import torch

_MISSING = object()


def hf_kimi_linear():
    """The transformers `kimi_linear` modeling module, bound to its torch code paths."""
    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    if name in sys.modules:
        return sys.modules[name]
    saved = sys.modules.get("fla", _MISSING)
    sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        return importlib.import_module(name)
    finally:
        if saved is _MISSING:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved


def tiny_hf_config(**overrides):
    from transformers import KimiLinearConfig

    options = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        linear_head_dim=16,
        linear_num_heads=4,
        routed_scaling_factor=2.446,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        # MLA at 0-based 3 and 5 (1-based 4 and 6, the last), as Kimi Linear places them.
        layer_types=[
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
    )
    options.update(overrides)
    return KimiLinearConfig(**options)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace transformers' tiny init (std 0.02, unit norms, zero router bias) with weights
    large enough that every part of the model moves the logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("A_log"):
            param.copy_(torch.rand(param.shape, generator=gen) * 2.0)
        elif name.endswith("dt_bias"):
            param.copy_(noise * 0.5 - 2.0)
        elif "norm" in name:
            param.copy_(1.0 + 0.2 * noise)
        elif param.dim() >= 2:
            param.copy_(noise / param.shape[-1] ** 0.5)
        else:
            param.copy_(noise * 0.5)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def save_tiny_kimi_linear(path, seed: int = 0, **overrides):
    """Save a tiny random KimiLinearForCausalLM with save_pretrained; returns the HF model."""
    module = hf_kimi_linear()
    torch.manual_seed(seed)
    model = module.KimiLinearForCausalLM(tiny_hf_config(**overrides)).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model
