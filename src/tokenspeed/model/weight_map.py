"""Where each of our parameters lives in a Hugging Face Kimi checkpoint, and how to assemble it.

Most parameters map one-to-one by name. The exceptions:
- KDA's q/k/v short-conv weights are three checkpoint tensors [P, 1, W], stacked here as
  `conv_weight` [3P, W];
- routed experts are E tensors per projection (`experts.{e}.w1.weight` ...), stacked here as
  [E, out, in]; MXFP4 checkpoints (compressed-tensors `mxfp4-pack-quantized`, as K3 ships)
  store `experts.{e}.w1.weight_packed` [out, in/2] and `.weight_scale` [out, in/32] uint8
  instead, stacked here as `experts.w1_packed` / `experts.w1_scale` and kept packed;
- MoE layers sit under `block_sparse_moe.` in checkpoints and under `mlp.` here; the dense
  layer is `mlp.` in release checkpoints but transformers' `save_pretrained` writes it under
  `block_sparse_moe.` too, so both are accepted;
- AttnRes weights are `<site>_res_norm.weight` / `<site>_res_proj.weight` in checkpoints;
- `A_log` is [1, 1, H, 1] (Kimi Linear) or [H] zero-padded to head_dim (K3); here it is [H];
- FP8 block-scaled checkpoints (`quant_method: fp8`) store a linear weight `W` as e4m3 with
  `W_scale_inv` (`<module>.weight_scale_inv`) beside it; `fp8_role` says which of our
  parameters may come so (see `loader.py`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import attrs
import torch

from .config import ConfigError, ModelConfig

# Parameters that stay fp32 whatever dtype the model is loaded in (decay rates, router).
FP32_SUFFIXES = ("A_log", "dt_bias", "mlp.gate.weight", "mlp.gate.e_score_correction_bias")


# Linear weights of the decoder layers that an FP8 block-scaled checkpoint may store as e4m3 with
# block scales: the attention projections (KDA and MLA), the dense MLP, the shared experts and
# the latent MoE projections. They stay FP8 (`layers.fp8_linear.Fp8Linear`), except MLA's
# kv_b_proj: only its weight is read (split into the absorbed w_uk / w_uv, or expanded for
# prefill), so it is dequantised at load, as are FP8 routed experts (stacked dense `Experts`).
_FP8_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn|mlp|mlp\.shared_experts)\.\w+_proj(_with_mqa)?\.weight"
)
_FP8_DEQUANTIZED = re.compile(
    r"model\.layers\.\d+\.(self_attn\.kv_b_proj\.weight|mlp\.experts\.w[123])"
)
SCALE_SUFFIX = "_scale_inv"


def fp8_role(target: str) -> str | None:
    """How our parameter `target` is loaded from an FP8 block-scaled checkpoint that stores it
    in e4m3: "linear" (kept FP8, its module an `Fp8Linear`), "dequantize" (dequantised to the
    model's dtype at load) or None (never stored FP8: embeddings, norms, router, convs ...)."""
    if _FP8_DEQUANTIZED.fullmatch(target):
        return "dequantize"
    if _FP8_LINEAR.fullmatch(target):
        return "linear"
    return None


def scale_name(weight_name: str) -> str:
    """The block scales' name beside an FP8 weight: `x.weight` -> `x.weight_scale_inv`."""
    return weight_name + SCALE_SUFFIX


@attrs.frozen
class TensorSpec:
    """One of our parameters and the checkpoint tensors it is assembled from.

    parts: for each source tensor, the accepted checkpoint names (first found wins);
    part_shape: the shape each source must have; combine: how parts become the target
    ("copy" one tensor, "stack" along a new dim 0, "cat" along dim 0 after dropping the
    middle singleton of conv weights, "a_log" the per-head decay rates); packed: uint8 codes
    (MXFP4), loaded as stored, never cast to the model's dtype.
    """

    target: str
    shape: tuple[int, ...]
    parts: tuple[tuple[str, ...], ...]
    part_shape: tuple[int, ...]
    combine: str = "copy"
    packed: bool = False

    @property
    def keep_fp32(self) -> bool:
        return self.target.endswith(FP32_SUFFIXES)


def _copy(target: str, shape, *names: str) -> TensorSpec:
    shape = tuple(shape)
    return TensorSpec(target, shape, (tuple(names) or (target,),), shape)


def _kda_specs(p: str, config: ModelConfig) -> Iterator[TensorSpec]:
    c, hidden = config.kda, config.hidden_size
    proj, dim, heads = c.projection_size, c.head_dim, c.num_heads
    for name in ("q_proj", "k_proj", "v_proj"):
        yield _copy(f"{p}.{name}.weight", (proj, hidden))
    yield TensorSpec(
        f"{p}.conv_weight",
        (3 * proj, c.conv_kernel),
        tuple((f"{p}.{x}_conv1d.weight",) for x in "qkv"),
        (proj, 1, c.conv_kernel),
        combine="cat",
    )
    yield _copy(f"{p}.f_a_proj.weight", (dim, hidden))
    yield _copy(f"{p}.f_b_proj.weight", (proj, dim))
    yield TensorSpec(f"{p}.A_log", (heads,), ((f"{p}.A_log",),), (heads,), combine="a_log")
    yield _copy(f"{p}.dt_bias", (proj,))
    yield _copy(f"{p}.b_proj.weight", (heads, hidden))
    if c.full_rank_output_gate:
        yield _copy(f"{p}.g_proj.weight", (proj, hidden))
    else:
        yield _copy(f"{p}.g_a_proj.weight", (dim, hidden))
        yield _copy(f"{p}.g_b_proj.weight", (proj, dim))
    yield _copy(f"{p}.o_norm.weight", (dim,))
    yield _copy(f"{p}.o_proj.weight", (hidden, proj))


def _mla_specs(p: str, config: ModelConfig) -> Iterator[TensorSpec]:
    c, hidden = config.mla, config.hidden_size
    q_out = c.num_heads * c.qk_head_dim
    if c.q_lora_rank is None:
        yield _copy(f"{p}.q_proj.weight", (q_out, hidden))
    else:
        yield _copy(f"{p}.q_a_proj.weight", (c.q_lora_rank, hidden))
        yield _copy(f"{p}.q_a_layernorm.weight", (c.q_lora_rank,))
        yield _copy(f"{p}.q_b_proj.weight", (q_out, c.q_lora_rank))
    yield _copy(f"{p}.kv_a_proj_with_mqa.weight", (c.latent_width, hidden))
    yield _copy(f"{p}.kv_a_layernorm.weight", (c.kv_lora_rank,))
    yield _copy(
        f"{p}.kv_b_proj.weight",
        (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
    )
    if c.output_gate:
        yield _copy(f"{p}.g_proj.weight", (c.num_heads * c.v_head_dim, hidden))
    yield _copy(f"{p}.o_proj.weight", (hidden, c.num_heads * c.v_head_dim))


def _glu_specs(p: str, ckpt: tuple[str, ...], hidden: int, inter: int) -> Iterator[TensorSpec]:
    """A gated MLP under our prefix `p`, found under any of the checkpoint prefixes `ckpt`."""
    for name, shape in (
        ("gate_proj", (inter, hidden)),
        ("up_proj", (inter, hidden)),
        ("down_proj", (hidden, inter)),
    ):
        yield _copy(f"{p}.{name}.weight", shape, *(f"{c}.{name}.weight" for c in ckpt))


def _moe_specs(p: str, config: ModelConfig, expert_format: str) -> Iterator[TensorSpec]:
    m, hidden = config.moe, config.hidden_size
    ck = p.replace(".mlp", ".block_sparse_moe")
    width, inter, experts = m.latent_size or hidden, m.expert_intermediate_size, m.num_experts
    if expert_format == "mxfp4":
        # One scale per 32 columns: other widths would floor the expected shapes below and
        # fail later, as a bare ValueError from building the experts.
        for what, dim in (("expert width", width), ("moe.expert_intermediate_size", inter)):
            if dim % 32:
                raise ConfigError(
                    f"MXFP4 routed experts need widths that are multiples of 32; {what} is {dim}"
                )
    yield _copy(f"{p}.gate.weight", (experts, hidden), f"{ck}.gate.weight")
    yield _copy(
        f"{p}.gate.e_score_correction_bias", (experts,), f"{ck}.gate.e_score_correction_bias"
    )
    for name, shape in (("w1", (inter, width)), ("w2", (width, inter)), ("w3", (inter, width))):
        if expert_format == "dense":
            stored = (("", "weight", shape, False),)
        else:  # MXFP4: two E2M1 codes a byte, one E8M0 scale per 32 columns
            rows, cols = shape
            stored = (
                ("_packed", "weight_packed", (rows, cols // 2), True),
                ("_scale", "weight_scale", (rows, cols // 32), True),
            )
        for suffix, theirs, part_shape, packed in stored:
            yield TensorSpec(
                f"{p}.experts.{name}{suffix}",
                (experts, *part_shape),
                tuple((f"{ck}.experts.{e}.{name}.{theirs}",) for e in range(experts)),
                part_shape,
                combine="stack",
                packed=packed,
            )
    if m.latent_size is not None:
        yield _copy(
            f"{p}.routed_expert_down_proj.weight",
            (width, hidden),
            f"{ck}.routed_expert_down_proj.weight",
        )
        yield _copy(
            f"{p}.routed_expert_up_proj.weight",
            (hidden, width),
            f"{ck}.routed_expert_up_proj.weight",
        )
        if m.latent_norm:
            yield _copy(
                f"{p}.routed_expert_norm.weight", (width,), f"{ck}.routed_expert_norm.weight"
            )
    if m.num_shared_experts:
        yield from _glu_specs(
            f"{p}.shared_experts",
            (f"{ck}.shared_experts",),
            hidden,
            inter * m.num_shared_experts,
        )


def _attn_res_specs(ours: str, theirs: str, hidden: int) -> Iterator[TensorSpec]:
    yield _copy(f"{ours}.norm.weight", (hidden,), f"{theirs}_norm.weight")
    yield _copy(f"{ours}.proj.weight", (1, hidden), f"{theirs}_proj.weight")


EXPERT_FORMATS = ("dense", "mxfp4")


def tensor_specs(config: ModelConfig, expert_format: str = "dense") -> list[TensorSpec]:
    """Every parameter and buffer of `KimiForCausalLM(config)` with its checkpoint sources;
    expert_format "mxfp4": the routed experts as `layers.moe.Mxfp4Experts` holds them."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
    hidden = config.hidden_size
    specs = [_copy("model.embed_tokens.weight", (config.vocab_size, hidden))]
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        specs.append(_copy(f"{p}.input_layernorm.weight", (hidden,)))
        specs.append(_copy(f"{p}.post_attention_layernorm.weight", (hidden,)))
        if config.uses_attn_res:
            specs += _attn_res_specs(f"{p}.self_attention_res", f"{p}.self_attention_res", hidden)
            specs += _attn_res_specs(f"{p}.mlp_res", f"{p}.mlp_res", hidden)
        if config.layer_kinds[i] == "kda":
            specs += _kda_specs(f"{p}.self_attn", config)
        else:
            specs += _mla_specs(f"{p}.self_attn", config)
        if config.mlp_kinds[i] == "moe":
            specs += _moe_specs(f"{p}.mlp", config, expert_format)
        else:
            specs += _glu_specs(
                f"{p}.mlp",
                (f"{p}.mlp", f"{p}.block_sparse_moe"),
                hidden,
                config.dense_intermediate_size,
            )
    specs.append(_copy("model.norm.weight", (hidden,)))
    if config.uses_attn_res:
        specs += _attn_res_specs("model.output_attn_res", "model.output_attn_res", hidden)
    if not config.tie_word_embeddings:
        specs.append(lm_head_spec(config))
    return specs


def lm_head_spec(config: ModelConfig) -> TensorSpec:
    """The LM head. A tied model has none of its own, but checkpoints may store one anyway
    (the loader reads it then, to see whether it is the embedding)."""
    return _copy("lm_head.weight", (config.vocab_size, config.hidden_size))


def combine_parts(spec: TensorSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    """Assemble the checkpoint tensors of `spec` into our parameter's layout."""
    if spec.combine == "copy":
        return parts[0]
    if spec.combine == "stack":
        return torch.stack(parts)
    if spec.combine == "cat":
        return torch.cat([p.reshape(p.shape[0], -1) for p in parts])
    if spec.combine == "a_log":
        return parts[0].reshape(-1)[: spec.shape[0]]
    raise ValueError(f"unknown combine {spec.combine!r}")


def split_parts(spec: TensorSpec, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of `combine_parts`: our parameter -> checkpoint tensors, in part order."""
    if spec.combine in ("copy", "a_log"):
        return [tensor.reshape(spec.part_shape)]
    if spec.combine == "stack":
        return list(tensor.unbind(0))
    if spec.combine == "cat":
        return [p.reshape(spec.part_shape) for p in tensor.chunk(len(spec.parts))]
    raise ValueError(f"unknown combine {spec.combine!r}")


def check_part_shape(spec: TensorSpec, shape: tuple[int, ...]) -> bool:
    """Whether a checkpoint tensor of `shape` can be a part of `spec`."""
    if spec.combine == "a_log":
        # [H], [1, 1, H, 1], or K3's [head_dim] with zero padding beyond H (checked on load).
        numel = 1
        for n in shape:
            numel *= n
        return numel >= spec.shape[0] and sum(n > 1 for n in shape) <= 1
    if spec.combine == "cat" and len(shape) == 2:
        return shape == (spec.part_shape[0], spec.part_shape[-1])
    return tuple(shape) == spec.part_shape
