"""Read Hugging Face `config.json` layouts of Kimi Linear and Kimi K3 into a `ModelConfig`.

Three spellings exist in the wild and all are read:
- the original Kimi Linear release: `linear_attn_config` with 1-based `kda_layers` /
  `full_attn_layers`, `first_k_dense_replace`, `num_experts`, `num_experts_per_token`, ...;
- transformers' native `kimi_linear` (what `save_pretrained` writes): `layer_types`,
  `mlp_layer_types`, `linear_num_heads`, ... next to the original MoE names;
- Kimi K3: `model_type: kimi_k3` with the text model nested under `text_config`, adding
  `attn_res_block_size`, `routed_expert_hidden_size`, `latent_moe_use_norm`, `mla_use_output_gate`,
  `linear_attn_config.gate_lower_bound` / `use_full_rank_gate` and SiTU (`hidden_act: situ`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import ActivationConfig, ConfigError, KdaConfig, MlaConfig, ModelConfig, MoeConfig

_MISSING = object()


def load_config_json(path_or_dict: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The raw config dict from a checkpoint directory, a config.json path or a dict."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        raw = json.loads(path.read_bytes())
    except ValueError as exc:  # JSONDecodeError, or bytes that are not text
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object")
    return raw


def text_config_of(raw: Mapping[str, Any]) -> dict[str, Any]:
    """K3 nests the language model under `text_config`; Kimi Linear does not."""
    text = raw.get("text_config")
    if isinstance(text, Mapping):
        merged = dict(text)
        # Token ids and embedding tying may sit at the top level only.
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if key not in merged and key in raw:
                merged[key] = raw[key]
        return merged
    return dict(raw)


class _Reader:
    """Looks keys up under several spellings and names the missing one in errors."""

    def __init__(self, cfg: Mapping[str, Any]):
        self.cfg = cfg

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        for name in names:
            if name in self.cfg and self.cfg[name] is not None:
                return self.cfg[name]
        if default is _MISSING:
            raise ConfigError(f"config.json lacks {' / '.join(names)}")
        return default


def _layer_kinds(cfg: _Reader, linear: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    layer_types = cfg.get("layer_types", default=None)
    if layer_types is not None:
        mapping = {"linear_attention": "kda", "full_attention": "mla"}
        unknown = sorted({t for t in layer_types if t not in mapping})
        if unknown:
            raise ConfigError(f"layer_types has unsupported entries {unknown}")
        kinds = tuple(mapping[t] for t in layer_types)
    elif "kda_layers" in linear or "full_attn_layers" in linear:
        kinds_by_layer: list[str | None] = [None] * num_layers
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            for one_based in linear.get(key, ()):
                if not 1 <= one_based <= num_layers:
                    raise ConfigError(
                        f"linear_attn_config.{key} names layer {one_based}, outside 1..{num_layers}"
                    )
                if kinds_by_layer[one_based - 1] is not None:
                    raise ConfigError(
                        f"linear_attn_config assigns layer {one_based} more than once"
                    )
                kinds_by_layer[one_based - 1] = kind
        absent = [i + 1 for i, k in enumerate(kinds_by_layer) if k is None]
        if absent:
            raise ConfigError(
                f"layers {absent} are in neither linear_attn_config.kda_layers nor full_attn_layers"
            )
        kinds = tuple(kinds_by_layer)  # type: ignore[arg-type]
    else:
        raise ConfigError("config.json lacks layer_types and linear_attn_config layer lists")
    if len(kinds) != num_layers:
        raise ConfigError(
            f"layer_types has {len(kinds)} entries but num_hidden_layers is {num_layers}"
        )
    return kinds


def _mlp_kinds(cfg: _Reader, num_layers: int, has_experts: bool) -> tuple[str, ...]:
    mlp_types = cfg.get("mlp_layer_types", default=None)
    if mlp_types is not None:
        mapping = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        unknown = sorted({t for t in mlp_types if t not in mapping})
        if unknown:
            raise ConfigError(f"mlp_layer_types has unsupported entries {unknown}")
        kinds = tuple(mapping[t] for t in mlp_types)
        if len(kinds) != num_layers:
            raise ConfigError(
                f"mlp_layer_types has {len(kinds)} entries but num_hidden_layers is {num_layers}"
            )
        return kinds
    if not has_experts:
        return ("dense",) * num_layers
    first_dense = cfg.get("first_k_dense_replace", default=0)
    freq = cfg.get("moe_layer_freq", default=1)
    return tuple(
        "moe" if i >= first_dense and i % freq == 0 else "dense" for i in range(num_layers)
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def from_hf_config(path_or_dict: str | Path | Mapping[str, Any]) -> ModelConfig:
    """Build a `ModelConfig` from a Kimi Linear or Kimi K3 checkpoint's config.json."""
    raw = load_config_json(path_or_dict)
    try:
        return _from_raw(raw)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        # A value of the wrong kind (a string where a list of layers goes, say) fails in the
        # reading code before any check of ours names it.
        raise ConfigError(f"config.json has a value of the wrong type or form: {exc}") from exc


def _from_raw(raw: dict[str, Any]) -> ModelConfig:
    text = text_config_of(raw)
    cfg = _Reader(text)
    linear = text.get("linear_attn_config") or {}

    router = cfg.get("moe_router_activation_func", default="sigmoid")
    if router != "sigmoid":
        raise ConfigError(f"moe_router_activation_func {router!r} is not supported (sigmoid only)")
    if not cfg.get("mla_use_nope", default=True):
        raise ConfigError("mla_use_nope=false (rotary MLA) is not supported; Kimi MLA is NoPE")
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", default=heads)
    if kv_heads != heads:
        raise ConfigError(
            f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) for MLA"
        )

    num_layers = cfg.get("num_hidden_layers")
    num_experts = cfg.get("num_experts", "num_local_experts", "n_routed_experts", default=None)
    lower_bound = linear.get("gate_lower_bound", cfg.get("linear_lower_bound", default=None))
    kda = KdaConfig(
        num_heads=linear.get("num_heads", cfg.get("linear_num_heads", default=None)),
        head_dim=linear.get("head_dim", cfg.get("linear_head_dim", default=None)),
        conv_kernel=linear.get(
            "short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", default=4)
        ),
        gate="lower_bound" if lower_bound is not None else "softplus",
        gate_lower_bound=-5.0 if lower_bound is None else float(lower_bound),
        full_rank_output_gate=bool(linear.get("use_full_rank_gate", False)),
    )
    mla = MlaConfig(
        num_heads=heads,
        q_lora_rank=cfg.get("q_lora_rank", default=None),
        kv_lora_rank=cfg.get("kv_lora_rank"),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim"),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
        v_head_dim=cfg.get("v_head_dim"),
        output_gate=bool(cfg.get("mla_use_output_gate", default=False)),
    )
    moe = None
    if num_experts:
        latent = cfg.get("routed_expert_hidden_size", default=None)
        moe = MoeConfig(
            num_experts=num_experts,
            top_k=cfg.get("num_experts_per_token", "num_experts_per_tok"),
            expert_intermediate_size=cfg.get("moe_intermediate_size"),
            num_shared_experts=cfg.get("num_shared_experts", "n_shared_experts", default=0),
            latent_size=latent,
            latent_norm=bool(latent) and bool(cfg.get("latent_moe_use_norm", default=False)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", default=1.0)),
            num_groups=cfg.get("num_expert_group", "n_group", default=1),
            topk_groups=cfg.get("topk_group", default=1),
            renormalize=bool(cfg.get("moe_renormalize", "norm_topk_prob", default=True)),
        )
    act = cfg.get("hidden_act", default="silu")
    if act not in ("silu", "situ"):
        raise ConfigError(f"hidden_act {act!r} is not supported (silu or situ)")
    if act == "situ":
        activation = ActivationConfig(
            kind="situ",
            situ_beta=float(cfg.get("activation_situ_beta", default=4.0)),
            situ_linear_beta=cfg.get("activation_situ_linear_beta", default=None),
        )
    else:
        activation = ActivationConfig(kind="silu")
    return ModelConfig(
        name=str(raw.get("model_type", "kimi_linear")),
        vocab_size=cfg.get("vocab_size"),
        hidden_size=cfg.get("hidden_size"),
        layer_kinds=_layer_kinds(cfg, linear, num_layers),
        mlp_kinds=_mlp_kinds(cfg, num_layers, bool(num_experts)),
        dense_intermediate_size=cfg.get("intermediate_size"),
        kda=kda,
        mla=mla,
        moe=moe,
        activation=activation,
        attn_res_block_size=cfg.get("attn_res_block_size", default=None),
        rms_norm_eps=float(cfg.get("rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", default=False)),
        bos_token_id=cfg.get("bos_token_id", default=None),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id", default=None)),
        pad_token_id=cfg.get("pad_token_id", default=None),
        max_position_embeddings=cfg.get(
            "max_position_embeddings", "model_max_length", default=1 << 20
        ),
    )


def to_hf_config(config: ModelConfig, layout: str = "k3") -> dict[str, Any]:
    """A config.json dict for `config` in the original release layout.

    layout "kimi_linear" writes a flat Kimi Linear config; "k3" nests it under `text_config`
    with `model_type: kimi_k3`, as K3 checkpoints do.
    """
    if layout not in ("k3", "kimi_linear"):
        raise ConfigError(f"layout must be 'k3' or 'kimi_linear', got {layout!r}")
    kda, mla, moe = config.kda, config.mla, config.moe
    linear: dict[str, Any] = {
        "num_heads": kda.num_heads,
        "head_dim": kda.head_dim,
        "short_conv_kernel_size": kda.conv_kernel,
        "kda_layers": [i + 1 for i in config.kda_layers],
        "full_attn_layers": [i + 1 for i in config.mla_layers],
        "use_full_rank_gate": kda.full_rank_output_gate,
    }
    if kda.gate == "lower_bound":
        linear["gate_lower_bound"] = kda.gate_lower_bound
    text: dict[str, Any] = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.dense_intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": mla.output_gate,
        "linear_attn_config": linear,
        "mlp_layer_types": ["sparse" if k == "moe" else "dense" for k in config.mlp_kinds],
        "hidden_act": config.activation.kind,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if config.eos_token_ids else None,
        "pad_token_id": config.pad_token_id,
        "max_position_embeddings": config.max_position_embeddings,
    }
    if config.activation.kind == "situ":
        text["activation_situ_beta"] = config.activation.situ_beta
        text["activation_situ_linear_beta"] = config.activation.situ_linear_beta
    if config.attn_res_block_size is not None:
        text["attn_res_block_size"] = config.attn_res_block_size
    if moe is not None:
        text.update(
            num_experts=moe.num_experts,
            num_experts_per_token=moe.top_k,
            num_shared_experts=moe.num_shared_experts,
            moe_intermediate_size=moe.expert_intermediate_size,
            moe_renormalize=moe.renormalize,
            moe_router_activation_func="sigmoid",
            routed_scaling_factor=moe.routed_scaling_factor,
            num_expert_group=moe.num_groups,
            topk_group=moe.topk_groups,
        )
        if moe.latent_size is not None:
            text["routed_expert_hidden_size"] = moe.latent_size
            text["latent_moe_use_norm"] = moe.latent_norm
    if layout == "kimi_linear":
        return text
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": config.pad_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
