"""Model configuration: one frozen, validated attrs tree for Kimi Linear and Kimi K3.

Field names follow what the layers need, not any checkpoint's spelling; `hf_config.py` translates
checkpoint `config.json` layouts into this tree and `presets.py` holds named configurations.
"""

from __future__ import annotations

import math
from typing import Literal

import attrs
from attrs import field, frozen

LayerKind = Literal["kda", "mla"]
MlpKind = Literal["dense", "moe"]
KdaGate = Literal["softplus", "lower_bound"]
Activation = Literal["silu", "situ"]


class ConfigError(ValueError):
    """A configuration that cannot describe a working model; the message names the field."""


def _name(instance, attribute) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{_name(instance, attribute)} must be a positive integer, got {value!r}")


def _optional_positive(instance, attribute, value) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def _non_negative(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(
            f"{_name(instance, attribute)} must be a non-negative integer, got {value!r}"
        )


def _positive_float(instance, attribute, value) -> None:
    # NaN passes `value <= 0`, and an infinite scale or epsilon turns every output into NaN.
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(
            f"{_name(instance, attribute)} must be a finite positive number, got {value!r}"
        )


def _optional_positive_float(instance, attribute, value) -> None:
    if value is not None:
        _positive_float(instance, attribute, value)


def _bool(instance, attribute, value) -> None:
    # A switch given as 1 or "false" would be read by truthiness: "false" turns a part on.
    if not isinstance(value, bool):
        raise ConfigError(f"{_name(instance, attribute)} must be True or False, got {value!r}")


def _optional_token_id(instance, attribute, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{_name(instance, attribute)} must be an integer, got {value!r}")


def _token_ids(instance, attribute, value) -> None:
    bad = [v for v in value if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise ConfigError(f"{_name(instance, attribute)} must hold integers, got {bad!r}")


def _one_of(*choices):
    def check(instance, attribute, value) -> None:
        if value not in choices:
            raise ConfigError(
                f"{_name(instance, attribute)} must be one of {choices}, got {value!r}"
            )

    return check


@frozen(kw_only=True)
class KdaConfig:
    """Kimi Delta Attention: per-head K x V recurrent state with a per-key-channel decay gate.

    gate: "softplus" is g = -exp(A_log) * softplus(f + dt_bias) (Kimi Linear);
    "lower_bound" is g = gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) (K3).
    full_rank_output_gate: the output gate is one hidden -> H*V projection (K3) instead of the
    low-rank hidden -> head_dim -> H*V pair (Kimi Linear).
    """

    num_heads: int = field(validator=_positive)
    head_dim: int = field(validator=_positive)
    conv_kernel: int = field(default=4, validator=_positive)
    gate: KdaGate = field(default="softplus", validator=_one_of("softplus", "lower_bound"))
    gate_lower_bound: float = -5.0
    full_rank_output_gate: bool = field(default=False, validator=_bool)

    def __attrs_post_init__(self) -> None:
        bound = self.gate_lower_bound
        if not isinstance(bound, int | float) or isinstance(bound, bool):
            raise ConfigError(f"kda.gate_lower_bound must be a number, got {bound!r}")
        if self.gate == "lower_bound" and not -math.inf < bound < 0:
            raise ConfigError(
                f"kda.gate_lower_bound must be negative and finite for the lower-bound gate, "
                f"got {self.gate_lower_bound}"
            )

    @property
    def projection_size(self) -> int:
        """Width of each of q, k, v: H * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the short conv (q, k and v stacked): 3 * H * head_dim."""
        return 3 * self.projection_size


@frozen(kw_only=True)
class MlaConfig:
    """Multi-head latent attention without RoPE (the rope slice is a shared, unrotated key part)."""

    num_heads: int = field(validator=_positive)
    kv_lora_rank: int = field(validator=_positive)
    qk_nope_head_dim: int = field(validator=_positive)
    qk_rope_head_dim: int = field(validator=_positive)
    v_head_dim: int = field(validator=_positive)
    q_lora_rank: int | None = field(default=None, validator=_optional_positive)
    output_gate: bool = field(default=False, validator=_bool)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Width of one cached row per token: normalised latent + shared key part (576 for K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5


@frozen(kw_only=True)
class MoeConfig:
    """Routed experts with a sigmoid router; optionally run at a latent width (K3's latent MoE).

    latent_size: None runs experts at the hidden width (Kimi Linear); otherwise hidden is
    down-projected to latent_size before the experts and up-projected after (K3: 3584), with an
    RMSNorm on the combined latent output when latent_norm is set.
    """

    num_experts: int = field(validator=_positive)
    top_k: int = field(validator=_positive)
    expert_intermediate_size: int = field(validator=_positive)
    num_shared_experts: int = field(default=0, validator=_non_negative)
    latent_size: int | None = field(default=None, validator=_optional_positive)
    latent_norm: bool = field(default=False, validator=_bool)
    routed_scaling_factor: float = field(default=1.0, validator=_positive_float)
    num_groups: int = field(default=1, validator=_positive)
    topk_groups: int = field(default=1, validator=_positive)
    renormalize: bool = field(default=True, validator=_bool)

    def __attrs_post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"moe.top_k ({self.top_k}) exceeds moe.num_experts ({self.num_experts})"
            )
        if self.num_experts % self.num_groups:
            raise ConfigError(
                f"moe.num_groups ({self.num_groups}) must divide moe.num_experts "
                f"({self.num_experts})"
            )
        if self.topk_groups > self.num_groups:
            raise ConfigError(
                f"moe.topk_groups ({self.topk_groups}) exceeds moe.num_groups ({self.num_groups})"
            )
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and per_group < 2:
            raise ConfigError(
                "moe.num_groups leaves fewer than 2 experts per group; group scores use the "
                "top-2 experts of each group"
            )
        if self.top_k > self.topk_groups * per_group:
            raise ConfigError(
                f"moe.top_k ({self.top_k}) exceeds the experts reachable through "
                f"moe.topk_groups ({self.topk_groups} groups of {per_group})"
            )
        if self.latent_norm and self.latent_size is None:
            raise ConfigError("moe.latent_norm needs moe.latent_size")


@frozen(kw_only=True)
class ActivationConfig:
    """GLU activation. SiTU: beta*tanh(g/beta)*sigmoid(g) times linear_beta*tanh(u/linear_beta)."""

    kind: Activation = field(default="silu", validator=_one_of("silu", "situ"))
    situ_beta: float = field(default=4.0, validator=_positive_float)
    # None leaves `up` uncapped; 0 would divide by zero (NaN outputs).
    situ_linear_beta: float | None = field(default=25.0, validator=_optional_positive_float)


def _kinds(choices: tuple[str, ...]):
    def check(instance, attribute, value) -> None:
        if not isinstance(value, tuple) or not value:
            raise ConfigError(f"{_name(instance, attribute)} must be a non-empty tuple")
        bad = sorted({v for v in value if v not in choices})
        if bad:
            raise ConfigError(
                f"{_name(instance, attribute)} has unknown kinds {bad}; allowed: {choices}"
            )

    return check


@frozen(kw_only=True)
class ModelConfig:
    """A whole decoder: which layer is KDA or MLA, which MLP is dense or MoE, and their shapes.

    layer_kinds[i] / mlp_kinds[i] describe 0-based layer i. attn_res_block_size None means plain
    residual connections (Kimi Linear); an integer turns on attention residuals with a bank entry
    closed every that many layers (K3: 12).
    """

    vocab_size: int = field(validator=_positive)
    hidden_size: int = field(validator=_positive)
    layer_kinds: tuple[LayerKind, ...] = field(converter=tuple, validator=_kinds(("kda", "mla")))
    mlp_kinds: tuple[MlpKind, ...] = field(converter=tuple, validator=_kinds(("dense", "moe")))
    dense_intermediate_size: int = field(validator=_positive)
    kda: KdaConfig
    mla: MlaConfig
    moe: MoeConfig | None = None
    activation: ActivationConfig = field(factory=ActivationConfig)
    attn_res_block_size: int | None = field(default=None, validator=_optional_positive)
    rms_norm_eps: float = field(default=1e-5, validator=_positive_float)
    tie_word_embeddings: bool = field(default=False, validator=_bool)
    bos_token_id: int | None = field(default=None, validator=_optional_token_id)
    eos_token_ids: tuple[int, ...] = field(default=(), converter=tuple, validator=_token_ids)
    pad_token_id: int | None = field(default=None, validator=_optional_token_id)
    max_position_embeddings: int = field(default=1 << 20, validator=_positive)
    name: str = field(default="custom", eq=False)  # informational; not part of equality

    def __attrs_post_init__(self) -> None:
        if len(self.layer_kinds) != len(self.mlp_kinds):
            raise ConfigError(
                f"layer_kinds has {len(self.layer_kinds)} entries but mlp_kinds has "
                f"{len(self.mlp_kinds)}; both need one per layer"
            )
        if "moe" in self.mlp_kinds and self.moe is None:
            raise ConfigError("mlp_kinds names 'moe' layers but moe is None")
        for token_field in ("bos_token_id", "pad_token_id"):
            value = getattr(self, token_field)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{token_field} {value} is outside the vocabulary")
        for value in self.eos_token_ids:
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"eos_token_ids entry {value} is outside the vocabulary")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "mla")

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    def evolve(self, **changes) -> ModelConfig:
        """A copy with some fields replaced (validated again)."""
        return attrs.evolve(self, **changes)


__all__ = [
    "ActivationConfig",
    "ConfigError",
    "KdaConfig",
    "MlaConfig",
    "ModelConfig",
    "MoeConfig",
]
