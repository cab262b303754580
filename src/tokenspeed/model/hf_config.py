"""Read Hugging Face `config.json` layouts of Kimi Linear and Kimi K3 into a `ModelConfig`.

Three spellings exist in the wild and all are read:
- the original Kimi Linear release: `linear_attn_config` with 1-based `kda_layers` /
  `full_attn_layers`, `first_k_dense_replace`, `num_experts`, `num_experts_per_token`, ...;
- transformers' native `kimi_linear` (what `save_pretrained` writes): `layer_types`,
  `mlp_layer_types`, `linear_num_heads`, ... next to the original MoE names;
- Kimi K3: `model_type: kimi_k3` with the text model nested under `text_config`, adding
  `attn_res_block_size`, `routed_expert_hidden_size`, `latent_moe_use_norm`, `mla_use_output_gate`,
  `linear_attn_config.gate_lower_bound` / `use_full_rank_gate` and SiTU (`hidden_act: situ`).

`fp8_config_of` reads an FP8 block-scaled `quantization_config` (DeepSeek / Kimi FP8 releases).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .config import ActivationConfig, ConfigError, KdaConfig, MlaConfig, ModelConfig, MoeConfig

_MISSING = object()

# What config.json says of a checkpoint this reader takes; anything else (a Llama, a DeepSeek)
# would fail on some missing Kimi field with a message that names no model.
SUPPORTED_MODEL_TYPES = ("kimi_linear", "kimi_k3")
SUPPORTED_ARCHITECTURES = ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration")


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

    def flag(self, *names: str, default: bool) -> bool:
        """A true/false switch; `bool()` of the JSON string "false" would be True."""
        value = self.get(*names, default=default)
        if isinstance(value, bool):
            return value
        if value in (0, 1) and isinstance(value, int):  # 0 / 1 as some exporters write them
            return bool(value)
        raise TypeError(f"{' / '.join(names)} must be true or false, got {value!r}")

    def number(self, *names: str, default: Any = _MISSING) -> Any:
        """A float field; `float()` would read true as 1.0 and the string "2" as 2.0."""
        value = self.get(*names, default=default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{' / '.join(names)} must be a number, got {value!r}")
        return float(value)


def _kinds_from_lists(linear: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """Layer kinds from linear_attn_config's 1-based `kda_layers` / `full_attn_layers`."""
    kinds_by_layer: list[str | None] = [None] * num_layers
    for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
        for one_based in linear.get(key, ()):
            if not isinstance(one_based, int) or isinstance(one_based, bool):
                raise TypeError(
                    f"linear_attn_config.{key} must list layer numbers, got {one_based!r}"
                )
            if not 1 <= one_based <= num_layers:
                raise ConfigError(
                    f"linear_attn_config.{key} names layer {one_based}, outside 1..{num_layers}"
                )
            if kinds_by_layer[one_based - 1] is not None:
                raise ConfigError(f"linear_attn_config assigns layer {one_based} more than once")
            kinds_by_layer[one_based - 1] = kind
    absent = [i + 1 for i, k in enumerate(kinds_by_layer) if k is None]
    if absent:
        raise ConfigError(
            f"layers {absent} are in neither linear_attn_config.kda_layers nor full_attn_layers"
        )
    return tuple(kinds_by_layer)  # type: ignore[arg-type]


def _layer_kinds(cfg: _Reader, linear: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    layer_types = cfg.get("layer_types", default=None)
    has_lists = "kda_layers" in linear or "full_attn_layers" in linear
    if layer_types is not None:
        mapping = {"linear_attention": "kda", "full_attention": "mla"}
        unknown = sorted({t for t in layer_types if t not in mapping})
        if unknown:
            raise ConfigError(f"layer_types has unsupported entries {unknown}")
        kinds = tuple(mapping[t] for t in layer_types)
        if len(kinds) != num_layers:
            raise ConfigError(
                f"layer_types has {len(kinds)} entries but num_hidden_layers is {num_layers}"
            )
        # A config carrying both plans (one edited, the other not) is ambiguous: taking
        # either silently runs some layers as the wrong kind of attention.
        if has_lists:
            listed = _kinds_from_lists(linear, num_layers)
            if listed != kinds:
                pairs = enumerate(zip(kinds, listed, strict=True))
                differ = [i + 1 for i, (a, b) in pairs if a != b]
                raise ConfigError(
                    f"layer_types and linear_attn_config.kda_layers / full_attn_layers disagree "
                    f"about 1-based layers {differ}"
                )
        return kinds
    if has_lists:
        return _kinds_from_lists(linear, num_layers)
    raise ConfigError("config.json lacks layer_types and linear_attn_config layer lists")


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
    if not isinstance(first_dense, int) or isinstance(first_dense, bool) or first_dense < 0:
        raise ConfigError(
            f"first_k_dense_replace must be a non-negative integer, got {first_dense!r}"
        )
    # 0 would divide by zero below; a negative period is no layer plan.
    if not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
        raise ConfigError(f"moe_layer_freq must be a positive integer, got {freq!r}")
    return tuple(
        "moe" if i >= first_dense and i % freq == 0 else "dense" for i in range(num_layers)
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    ids = tuple(value) if isinstance(value, list | tuple) else (value,)
    # No int(): it would read 2.7 as token 2 and "5" as token 5.
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
        raise TypeError(f"eos_token_id must be an integer or a list of integers, got {value!r}")
    return ids


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


def check_model_type(raw: Mapping[str, Any]) -> None:
    """Refuse a config.json of another model: its `model_type` (or, without one, its
    `architectures`) must name Kimi Linear or Kimi K3. A config with neither is read as is."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures")
    if model_type is not None:
        if model_type in SUPPORTED_MODEL_TYPES:
            return
        found = f"model_type {model_type!r}"
    elif architectures is not None:
        if isinstance(architectures, list) and set(architectures) & set(SUPPORTED_ARCHITECTURES):
            return
        found = f"architectures {architectures!r}"
    else:
        return
    if model_type is not None and architectures is not None:
        found += f" (architectures {architectures!r})"
    raise ConfigError(
        f"config.json is of another model, {found}: tokenspeed serves Kimi Linear and Kimi K3 "
        f"checkpoints (model_type {' or '.join(map(repr, SUPPORTED_MODEL_TYPES))}, "
        f"architectures {' or '.join(SUPPORTED_ARCHITECTURES)})"
    )


def _from_raw(raw: dict[str, Any]) -> ModelConfig:
    check_model_type(raw)
    text = text_config_of(raw)
    cfg = _Reader(text)
    linear = text.get("linear_attn_config") or {}

    router = cfg.get("moe_router_activation_func", default="sigmoid")
    if router != "sigmoid":
        raise ConfigError(f"moe_router_activation_func {router!r} is not supported (sigmoid only)")
    if not cfg.flag("mla_use_nope", default=True):
        raise ConfigError("mla_use_nope=false (rotary MLA) is not supported; Kimi MLA is NoPE")
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", default=heads)
    if kv_heads != heads:
        raise ConfigError(
            f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) for MLA"
        )

    num_layers = cfg.get("num_hidden_layers")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ConfigError(f"num_hidden_layers must be a positive integer, got {num_layers!r}")
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
        full_rank_output_gate=_Reader(linear).flag("use_full_rank_gate", default=False),
    )
    mla = MlaConfig(
        num_heads=heads,
        q_lora_rank=cfg.get("q_lora_rank", default=None),
        kv_lora_rank=cfg.get("kv_lora_rank"),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim"),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
        v_head_dim=cfg.get("v_head_dim"),
        output_gate=cfg.flag("mla_use_output_gate", default=False),
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
            latent_norm=bool(latent) and cfg.flag("latent_moe_use_norm", default=False),
            routed_scaling_factor=cfg.number("routed_scaling_factor", default=1.0),
            num_groups=cfg.get("num_expert_group", "n_group", default=1),
            topk_groups=cfg.get("topk_group", default=1),
            renormalize=cfg.flag("moe_renormalize", "norm_topk_prob", default=True),
        )
    act = cfg.get("hidden_act", default="silu")
    if act not in ("silu", "situ"):
        raise ConfigError(f"hidden_act {act!r} is not supported (silu or situ)")
    if act == "situ":
        # Absent (or null) keys mean what K3's own modeling code makes of them: it reads both
        # with getattr(config, key, None) and runs SituAndMul(beta or 1.0, linear_beta), so
        # no linear beta leaves `up` uncapped and no beta is 1. K3's config.json sets 4 and 25
        # (ActivationConfig's defaults), and `to_hf_config` always writes both, None as null.
        activation = ActivationConfig(
            kind="situ",
            situ_beta=cfg.number("activation_situ_beta", default=1.0),
            situ_linear_beta=cfg.number("activation_situ_linear_beta", default=None),
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
        rms_norm_eps=cfg.number("rms_norm_eps", default=1e-5),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", default=False),
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


# --- FP8 block-scaled checkpoints --------------------------------------------------------------

# Prefixes K3 checkpoints wrap the text model's names in, and the text model's spelling.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("language_model.", "model."),
)


def normalize_name(name: str) -> str:
    """Checkpoint name -> the text-model name (K3 wraps it in `language_model.`)."""
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


@attrs.frozen
class Fp8Config:
    """An FP8 block-scaled checkpoint's `quantization_config`: e4m3 weights with one fp32
    `weight_scale_inv` per `block_size` = (B0 rows, B1 columns) block, activations quantised on
    the fly ("dynamic"); `ignored` modules (`ignored_layers` / `modules_to_not_convert`) are
    stored unquantised."""

    block_size: tuple[int, int]
    ignored: tuple[str, ...] = ()

    def ignores(self, *modules: str) -> bool:
        """Whether any of `modules` (qualified names, e.g. the checkpoint's and ours) is in the
        ignored list: an entry names a module or one of its parents, or a trailing part of its
        name (`kv_b_proj`, `self_attn.o_proj`), whole dotted components only (`layers.1` is not
        `layers.10`)."""
        for module in modules:
            wrapped = f".{normalize_name(module)}."
            if any(f".{normalize_name(entry)}." in wrapped for entry in self.ignored):
                return True
        return False


def quantization_config_of(raw: Mapping[str, Any]) -> Any:
    """The checkpoint's `quantization_config` (top level, or K3's text_config), None if none."""
    return raw.get("quantization_config") or text_config_of(raw).get("quantization_config")


def fp8_config_of(raw: Mapping[str, Any]) -> Fp8Config | None:
    """The `Fp8Config` of a config.json whose quantization_config has quant_method "fp8"; None
    for any other (or no) quantization. Refuses, naming the field, what the loader cannot read
    right: fmt other than e4m3, static activation scales, per-tensor scales (no
    weight_block_size), a weight_block_size that is not two positive ints, an ignored list that
    is not a list of names."""
    quant = quantization_config_of(raw)
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return None
    where = "config.json quantization_config (quant_method fp8)"
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}: fmt {fmt!r} is not supported (e4m3 only)")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"{where}: activation_scheme {scheme!r} is not supported (dynamic only: activations "
            "are quantised on the fly, static input scales are not read)"
        )
    block = quant.get("weight_block_size")
    if block is None:
        raise ConfigError(
            f"{where}: no weight_block_size; per-tensor FP8 scales (weight_scale) are not "
            "supported, block-scaled FP8 (weight_block_size [128, 128] and weight_scale_inv) is"
        )
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"{where}: weight_block_size must be two positive ints [rows, columns], got {block!r}"
        )
    ignored: list[str] = []
    for key in ("ignored_layers", "modules_to_not_convert"):
        names = quant.get(key)
        if names is None:
            continue
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"{where}: {key} must be a list of module names, got {names!r}")
        ignored += names
    return Fp8Config(block_size=(block[0], block[1]), ignored=tuple(ignored))
