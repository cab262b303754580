"""Read an EAGLE3 drafter from a Hugging Face layout directory (config.json + safetensors).

config.json is what EAGLE3 drafters ship (SpecForge's and the EAGLE authors' exports):
`architectures` LlamaForCausalLMEagle3 (SGLang's name) or Eagle3LlamaForCausalLM (vLLM's),
hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, rms_norm_eps,
rope_theta (or transformers 5's `rope_parameters`), rope_scaling, vocab_size, draft_vocab_size,
optionally target_hidden_size and `eagle_config.eagle_aux_hidden_state_layer_ids` (also read at
the top level). The tensors: fc.weight, midlayer.self_attn.{q,k,v,o}_proj.weight,
midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight, d2t (int64 [draft_vocab]),
t2d (bool [vocab]), and optionally embed_tokens.weight (else the target's embedding is shared).
A `model.` prefix on the names is accepted. d2t and t2d may be left out only together, and only
when the draft vocabulary is the whole target vocabulary (the identity map).

Every problem is collected and reported at once (`CheckpointError`, as the target's loader).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .config import ConfigError
from .eagle3 import Eagle3Config, Eagle3Drafter, RopeScaling, vocab_map_problem
from .hf_config import load_config_json
from .kimi import KimiForCausalLM
from .loader import CheckpointError, CheckpointIndex, resolve_dtype

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EMBEDDING = "embed_tokens.weight"
VOCAB_MAP = ("d2t", "t2d")
_MISSING = object()


def _get(raw: Mapping[str, Any], name: str, default: Any = _MISSING) -> Any:
    value = raw.get(name)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"EAGLE3 config.json lacks {name}")
        return default
    return value


def _rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_theta` / `rope_scaling` or transformers 5's
    `rope_parameters`."""
    params = raw.get("rope_parameters")
    params = params if isinstance(params, Mapping) else {}
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type") else None)
    if not scaling:
        return theta, None
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ConfigError(
            f"rope_scaling type {kind!r} is not supported for EAGLE3 drafters (default, linear, "
            "llama3)"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    given = {k: scaling[k] for k in keys if scaling.get(k) is not None}
    if "factor" not in given:
        raise ConfigError(f"rope_scaling ({kind}) lacks factor")
    try:
        return theta, RopeScaling(rope_type=kind, **given)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"rope_scaling {dict(scaling)}: {err}") from None


def eagle3_config_from_hf(raw: Mapping[str, Any] | str | Path) -> Eagle3Config:
    """An `Eagle3Config` from a drafter's config.json (a dict, the file or its directory)."""
    raw = load_config_json(raw)
    arch = raw.get("architectures")
    if arch is not None:
        names = arch if isinstance(arch, list) else [arch]
        if not any(name in SUPPORTED_ARCHITECTURES for name in names):
            raise ConfigError(
                f"config.json architectures {names} is not an EAGLE3 drafter (expected one of "
                f"{list(SUPPORTED_ARCHITECTURES)})"
            )
    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise ConfigError(f"EAGLE3 drafters have one decoder layer; num_hidden_layers is {layers}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (EAGLE3 drafters use silu)")
    hidden = _get(raw, "hidden_size")
    heads = _get(raw, "num_attention_heads")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
            raise ConfigError("hidden_size and num_attention_heads must be positive integers")
        if hidden % heads:
            raise ConfigError(
                f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}): "
                "give head_dim"
            )
        head_dim = hidden // heads
    vocab = _get(raw, "vocab_size")
    eagle = raw.get("eagle_config")
    eagle = eagle if isinstance(eagle, Mapping) else {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
    if aux is not None and not isinstance(aux, list | tuple):
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids must be a list, got {aux!r}")
    norm_first = raw.get("norm_before_residual", eagle.get("norm_before_residual", False))
    if not isinstance(norm_first, bool):
        raise ConfigError(f"norm_before_residual must be true or false, got {norm_first!r}")
    theta, scaling = _rope(raw)
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=_get(raw, "intermediate_size"),
        num_heads=heads,
        num_kv_heads=_get(raw, "num_key_value_heads", heads),
        head_dim=head_dim,
        vocab_size=vocab,
        draft_vocab_size=_get(raw, "draft_vocab_size", vocab),
        target_hidden_size=_get(raw, "target_hidden_size", hidden),
        rms_norm_eps=_get(raw, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_get(raw, "max_position_embeddings", 1 << 20),
        aux_layer_ids=aux,
        norm_before_residual=norm_first,
    )


def eagle3_to_hf_config(config: Eagle3Config, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json `eagle3_config_from_hf` reads back to `config`."""
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if config.rope_scaling is not None:
        s = config.rope_scaling
        raw["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor}
        if s.rope_type == "llama3":
            raw["rope_scaling"].update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
    eagle: dict[str, Any] = {"use_aux_hidden_state": True}
    if config.aux_layer_ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = list(config.aux_layer_ids)
    if config.norm_before_residual:
        raw["norm_before_residual"] = True
    raw["eagle_config"] = eagle
    return raw


def eagle3_tensor_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor of a drafter (embed_tokens.weight included)."""
    h, c = config.hidden_size, config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attn = "midlayer.self_attn."
    mlp = "midlayer.mlp."
    return {
        EMBEDDING: (c.vocab_size, h),
        "fc.weight": (h, c.num_aux * c.target_hidden_size),
        f"{attn}q_proj.weight": (q, 2 * h),
        f"{attn}k_proj.weight": (kv, 2 * h),
        f"{attn}v_proj.weight": (kv, 2 * h),
        f"{attn}o_proj.weight": (h, q),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        f"{mlp}gate_proj.weight": (c.intermediate_size, h),
        f"{mlp}up_proj.weight": (c.intermediate_size, h),
        f"{mlp}down_proj.weight": (h, c.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
        "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }


def target_problems(config: Eagle3Config, target: KimiForCausalLM) -> list[str]:
    """What makes the drafter unusable with `target` (vocabulary, widths, capture points)."""
    problems = []
    tc = target.config
    if config.vocab_size != tc.vocab_size:
        problems.append(
            f"the drafter's vocab_size is {config.vocab_size} but the target's is "
            f"{tc.vocab_size}: it drafts for another tokenizer"
        )
    if config.target_hidden_size != tc.hidden_size:
        problems.append(
            f"the drafter reads target states {config.target_hidden_size} wide "
            f"(target_hidden_size) but the target's hidden_size is {tc.hidden_size}"
        )
    try:
        config.capture_points(tc.num_layers)
    except ConfigError as err:
        problems.append(str(err))
    return problems


def _strip(name: str) -> str:
    return name.removeprefix("model.")


def _dtype_problems(name: str, tensor: torch.Tensor) -> list[str]:
    kind = str(tensor.dtype).removeprefix("torch.")
    if name == "d2t":
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            return [f"d2t: dtype {kind}, expected an integer tensor (int64 offsets)"]
        return []
    if name == "t2d":
        if tensor.dtype == torch.bool:
            return []
        if tensor.dtype.is_floating_point or bool(((tensor != 0) & (tensor != 1)).any()):
            return [f"t2d: dtype {kind} with values other than 0 / 1, expected a bool mask"]
        return []
    if not tensor.dtype.is_floating_point:
        return [f"{name}: dtype {kind}, expected a floating-point tensor"]
    if tensor.element_size() == 1:
        return [f"{name}: dtype {kind}: FP8 drafter weights are not supported"]
    return []


def _mapping_problems(config: Eagle3Config, d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    ids = torch.arange(config.draft_vocab_size) + d2t
    problem = vocab_map_problem(ids, config.vocab_size, config.draft_vocab_size)
    if problem:
        return [problem]
    if int(t2d.sum()) != config.draft_vocab_size or not bool(t2d[ids].all()):
        return [
            f"t2d marks {int(t2d.sum())} target ids but d2t maps the {config.draft_vocab_size} "
            "draft ids onto others: the two do not describe one draft vocabulary"
        ]
    return []


def load_eagle3(
    path: str | Path,
    target: KimiForCausalLM | None = None,
    dtype: torch.dtype | str | None = "auto",
    device: torch.device | str = "cpu",
    strict: bool = True,
) -> Eagle3Drafter:
    """Build the drafter stored under `path`.

    target: the model it drafts for: checked against (vocabulary, hidden width, capture points)
    and, when the checkpoint has no embed_tokens.weight, the source of the shared embedding
    (required then). dtype: "auto" takes the checkpoint's (`torch_dtype`), else fp32. strict:
    tensors the drafter does not have are an error.
    Raises ConfigError for a config.json that is not an EAGLE3 drafter, CheckpointError listing
    every missing, unexpected, mis-shaped or unusable tensor and every mismatch with `target`.
    """
    root = Path(path)
    raw = load_config_json(root)
    config = eagle3_config_from_hf(raw)
    dtype = resolve_dtype(dtype, raw)
    other = target_problems(config, target) if target is not None else []

    index = CheckpointIndex.open(root)
    stored, problems = index.shapes()
    other += problems
    names: dict[str, str] = {}  # drafter name -> normalised name in the index
    for normal in stored:
        name = _strip(normal)
        if name in names:
            other.append(f"{names[name]} and {normal}: both name {name}")
        names[name] = normal
    expected = eagle3_tensor_shapes(config)
    optional = set()
    if target is not None:
        optional.add(EMBEDDING)
    if config.draft_vocab_size == config.vocab_size:
        optional.update(VOCAB_MAP)
        if sum(n in names for n in VOCAB_MAP) == 1:
            other.append("d2t and t2d come together: the checkpoint has only one of them")
    if target is not None and EMBEDDING not in names:
        width = target.config.hidden_size
        if width != config.hidden_size:
            other.append(
                f"{EMBEDDING} is missing and the target's embedding is {width} wide, not the "
                f"drafter's hidden_size {config.hidden_size}: it cannot be shared"
            )
    missing = [n for n in expected if n not in names and n not in optional]
    if EMBEDDING in missing:
        missing.remove(EMBEDDING)
        other.append(
            f"{EMBEDDING} is missing: the drafter has no embedding of its own; pass the target "
            "model to share its embedding"
        )
    unexpected = sorted(set(names) - set(expected)) if strict else []
    mis_shaped = [
        f"{names[n]}: shape {list(stored[names[n]])}, expected {list(shape)}"
        for n, shape in expected.items()
        if n in names and tuple(stored[names[n]]) != shape
    ]
    if missing or unexpected or mis_shaped or other:
        raise CheckpointError(missing, unexpected, mis_shaped, other)

    tensors: dict[str, torch.Tensor] = {}
    handles = {}
    try:
        for name in expected:
            if name not in names:
                continue
            file, key = index.entries[names[name]]
            try:
                if file not in handles:
                    handles[file] = safe_open(root / file, "pt", device="cpu")
                tensor = handles[file].get_tensor(key)
            except (OSError, SafetensorError) as err:
                problems.append(f"{key}: unreadable from {file} ({err})")
                continue
            found = _dtype_problems(name, tensor)
            problems += found
            if not found:
                tensors[name] = tensor
    finally:
        handles.clear()
    if problems:
        raise CheckpointError(other=problems)
    if "d2t" in tensors:
        d2t, t2d = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
        mapping = _mapping_problems(config, d2t, t2d)
        if mapping:
            raise CheckpointError(other=mapping)
        tensors["d2t"], tensors["t2d"] = d2t, t2d

    with torch.device("meta"):
        drafter = Eagle3Drafter(config)
    state = {}
    for name, tensor in tensors.items():
        float_weight = name not in VOCAB_MAP
        state[name] = tensor.to(device=device, dtype=dtype if float_weight else tensor.dtype)
    if "d2t" not in state:  # the identity map (the draft vocabulary is the whole vocabulary)
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64, device=device)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool, device=device)
    shared = EMBEDDING not in state
    missing_keys = drafter.load_state_dict(state, strict=False, assign=True).missing_keys
    if set(missing_keys) != ({EMBEDDING} if shared else set()):  # pragma: no cover (a bug)
        raise RuntimeError(f"drafter tensors left unloaded: {missing_keys}")
    if shared:
        drafter.share_embedding(target.model.embed_tokens)
    return drafter.eval()
