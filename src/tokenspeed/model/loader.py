"""Load a Hugging Face layout checkpoint (config.json + safetensors shards [+ index json]) of Kimi
Linear or Kimi K3 into `KimiForCausalLM`.

All problems are collected before anything is loaded, and reported together: missing tensors,
unexpected tensors and tensors of the wrong shape, each by its checkpoint name, and shard files that
are missing, unreadable or lack a tensor the index places in them. Tensors whose values turn out
unusable (integer data for a floating-point parameter, say) are collected while loading and
reported together before the model is built.

A checkpoint whose config ties the LM head to the embedding (`tie_word_embeddings`) may store
`lm_head.weight` anyway (transformers' `save_pretrained` of KimiLinearForCausalLM does, as do
exports that keep the redundant copy). A copy equal to the embedding is loaded tied, quietly; one
that differs is used as the head, untied, with a warning: transformers does not tie weights a
checkpoint stores with different values, and its Kimi Linear model never ties at all.

`load_checkpoint_into` loads into a model already built (on the meta device, say) whose tensors
may hold only slices of the checkpoint's, given as (dim, start, stop) per parameter name; it
reads exactly those bytes with a minimal safetensors reader and reports them (`ReadStats`).
`load_checkpoint`'s own path (safetensors' `safe_open`) is unchanged by it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError, safe_open

from .config import ConfigError, ModelConfig
from .hf_config import from_hf_config, load_config_json, text_config_of
from .kimi import KimiForCausalLM
from .layers.moe import use_mxfp4_experts
from .weight_map import (
    FP32_SUFFIXES,
    TensorSpec,
    check_part_shape,
    combine_parts,
    lm_head_spec,
    tensor_specs,
)

logger = logging.getLogger("tokenspeed.model")

INDEX_FILE = "model.safetensors.index.json"
# Multimodal parts of K3 checkpoints that the text model does not use.
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; lists every offending tensor by name."""

    def __init__(self, missing=(), unexpected=(), mis_shaped=(), other=()):
        self.missing, self.unexpected = sorted(missing), sorted(unexpected)
        self.mis_shaped, self.other = sorted(mis_shaped), list(other)
        lines = ["checkpoint does not match the model:"]
        for title, items in (
            ("missing tensors", self.missing),
            ("unexpected tensors", self.unexpected),
            ("mis-shaped tensors", self.mis_shaped),
            ("other problems", self.other),
        ):
            if items:
                more = [f"... and {len(items) - 50} more"] if len(items) > 50 else []
                lines.append(f"  {title} ({len(items)}):")
                lines.extend(f"    {item}" for item in items[:50] + more)
        super().__init__("\n".join(lines))


def normalize_name(name: str) -> str:
    """Checkpoint name -> the text-model name (K3 wraps it in `language_model.`)."""
    for prefix, replacement in (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("language_model.", "model."),
    ):
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


def _read_index(index_path: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name)."""
    try:
        with index_path.open() as f:
            index = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(other=[f"{index_path.name}: unreadable ({err})"]) from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(file, str) for file in weight_map.values()
    ):
        raise CheckpointError(
            other=[f"{index_path.name}: needs a 'weight_map' of tensor name -> shard file name"]
        )
    return weight_map


@attrs.frozen
class CheckpointIndex:
    """Which file holds each tensor: normalised name -> (file, name inside the file).

    unreadable: problems with shard files found while listing them (missing, truncated, not
    safetensors, a tensor stored twice), reported by `shapes` with the rest.
    """

    root: Path
    entries: dict[str, tuple[str, str]]
    ignored: tuple[str, ...]
    unreadable: tuple[str, ...] = ()

    @classmethod
    def open(cls, root: str | Path) -> CheckpointIndex:
        root = Path(root)
        index_path = root / INDEX_FILE
        unreadable = []
        if index_path.is_file():
            weight_map = _read_index(index_path)
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(other=[f"no *.safetensors files in {root}"])
            weight_map = {}
            for file in files:
                try:
                    with safe_open(file, "pt") as handle:
                        for name in handle.keys():  # noqa: SIM118 (a handle, not a dict)
                            # Which copy would win is an accident of file names.
                            if name in weight_map:
                                unreadable.append(
                                    f"{name}: in both {weight_map[name]} and {file.name}"
                                )
                            weight_map[name] = file.name
                except (OSError, SafetensorError) as err:
                    unreadable.append(f"{file.name}: unreadable ({err})")
        entries, ignored = {}, []
        for name, file in weight_map.items():
            normal = normalize_name(name)
            if normal.startswith(IGNORED_PREFIXES) or name.startswith(IGNORED_PREFIXES):
                ignored.append(name)
                continue
            if normal in entries:
                # Two spellings of one tensor (`language_model.model.x` and `model.x`): loading
                # either would silently drop the other.
                unreadable.append(f"{entries[normal][1]} and {name}: both name {normal}")
            entries[normal] = (file, name)
        return cls(root=root, entries=entries, ignored=tuple(ignored), unreadable=tuple(unreadable))

    def shapes(self) -> tuple[dict[str, tuple[int, ...]], list[str]]:
        """Shape of every tensor that can be read, from the safetensors headers only, and the
        problems that kept the others out (a tensor kept out is then reported missing too)."""
        by_file: dict[str, list[str]] = {}
        for normal, (file, _) in self.entries.items():
            by_file.setdefault(file, []).append(normal)
        shapes, problems = {}, list(self.unreadable)
        for file, names in by_file.items():
            path = self.root / file
            if not path.is_file():
                problems.append(
                    f"{file}: no such file (the index places {len(names)} tensors there)"
                )
                continue
            try:
                with safe_open(path, "pt") as handle:
                    stored = set(handle.keys())
                    for normal in names:
                        name = self.entries[normal][1]
                        if name not in stored:
                            problems.append(f"{name}: not in {file}, where the index places it")
                            continue
                        shapes[normal] = tuple(handle.get_slice(name).get_shape())
            except (OSError, SafetensorError) as err:
                problems.append(f"{file}: unreadable ({err})")
        return shapes, problems


@attrs.frozen
class _Plan:
    """For each spec, the checkpoint names of its parts."""

    sources: dict[str, list[str]]


def _plan(
    specs: Iterable[TensorSpec],
    index: CheckpointIndex,
    strict: bool,
    shapes: tuple[dict[str, tuple[int, ...]], list[str]] | None = None,
) -> _Plan:
    """shapes: `index.shapes()` when not given (the sliced loader reads its own headers)."""
    shapes, file_problems = index.shapes() if shapes is None else shapes
    missing, mis_shaped, used, sources = [], [], set(), {}
    for spec in specs:
        names = []
        for candidates in spec.parts:
            found = next((n for n in candidates if n in shapes), None)
            if found is None:
                missing.append(candidates[0])
                continue
            used.add(found)
            names.append(found)
            if not check_part_shape(spec, shapes[found]):
                mis_shaped.append(
                    f"{found}: shape {list(shapes[found])}, expected {list(spec.part_shape)}"
                )
        sources[spec.target] = names
    unexpected = sorted(set(shapes) - used) if strict else []
    if missing or mis_shaped or unexpected or file_problems:
        raise CheckpointError(missing, unexpected, mis_shaped, file_problems)
    return _Plan(sources)


def expert_format_of(raw: dict) -> str:
    """The routed experts' storage in a checkpoint's config.json: "dense" (no quantisation) or
    "mxfp4" (compressed-tensors `mxfp4-pack-quantized`, as K3 ships); any other quantisation
    is refused, naming its format."""
    quant = raw.get("quantization_config") or text_config_of(raw).get("quantization_config")
    if not quant:
        return "dense"
    from .ops.moe.mxfp4 import is_mxfp4_config  # imports Triton: only when needed

    if is_mxfp4_config(quant):
        return "mxfp4"
    fmt = quant.get("format") or quant.get("quant_method")
    raise CheckpointError(
        other=[
            f"quantized checkpoints ({fmt}) are not supported; the loader reads bf16/fp32 "
            "exports and MXFP4 routed experts (mxfp4-pack-quantized)"
        ]
    )


def resolve_dtype(dtype: torch.dtype | str | None, raw: dict) -> torch.dtype:
    """`dtype` as given, or the checkpoint's own (`dtype` / `torch_dtype`), else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        text = text_config_of(raw)
        # K3 may give the dtype only inside text_config, under either spelling.
        stored = (
            raw.get("dtype")
            or raw.get("torch_dtype")
            or text.get("dtype")
            or text.get("torch_dtype")
            or "float32"
        )
        if not isinstance(stored, str) or stored not in _DTYPES:
            raise ConfigError(
                f"config.json dtype {stored!r} is not supported: pass a dtype, one of "
                f"{sorted(_DTYPES)}"
            )
        return _DTYPES[stored]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


@attrs.frozen
class WeightFootprint:
    """What a model's weights take once loaded: `num_params` parameters, `nbytes` bytes in
    `dtype` (decay rates and the router in fp32, packed MXFP4 experts as stored)."""

    config: ModelConfig
    dtype: torch.dtype
    experts: str  # "dense" or "mxfp4"
    num_params: int
    nbytes: int


def weight_footprint(
    config: ModelConfig, dtype: torch.dtype, experts: str = "dense"
) -> WeightFootprint:
    """The weights' size, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = KimiForCausalLM(config)
        if experts == "mxfp4":
            use_mxfp4_experts(model)
    num_params = nbytes = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        num_params += tensor.numel()
        if not tensor.dtype.is_floating_point:
            size = tensor.element_size()
        elif name.endswith(FP32_SUFFIXES):
            size = 4
        else:
            size = dtype.itemsize
        nbytes += tensor.numel() * size
    return WeightFootprint(config, dtype, experts, num_params, nbytes)


def checkpoint_footprint(path: str | Path, dtype: torch.dtype | str | None = "auto"):
    """The `WeightFootprint` of loading the checkpoint at `path` in `dtype` (as
    `load_checkpoint` would), from its config.json alone: no shard is read."""
    raw = load_config_json(Path(path))
    experts = expert_format_of(raw)
    config = from_hf_config(raw)
    return weight_footprint(config, resolve_dtype(dtype, raw), experts)


def _a_log_padding_problems(spec: TensorSpec, name: str, stored: torch.Tensor) -> list[str]:
    """K3 stores A_log [head_dim] zero-padded beyond the H heads: anything else is refused."""
    padding = stored.reshape(-1)[spec.shape[0] :]
    if padding.numel() and bool(padding.ne(0).any()):
        return [
            f"{name}: has {stored.numel()} entries for {spec.shape[0]} heads and the extra ones "
            "are not zero padding"
        ]
    return []


def _check_parts(
    spec: TensorSpec,
    names: list[str],
    parts: list[torch.Tensor],
    dtype: torch.dtype,
    problems: list[str],
) -> torch.dtype:
    """Append to `problems` what makes `parts` unusable for `spec`; returns the dtype the
    assembled tensor is loaded in."""
    if spec.packed:
        bad = [n for n, t in zip(names, parts, strict=True) if t.dtype != torch.uint8]
        problems += [f"{n}: packed MXFP4 must be uint8" for n in bad]
        return torch.uint8
    # A cast would turn integer data into floats silently; such a tensor is not the weight the
    # parameter expects.
    problems += [
        f"{n}: dtype {str(t.dtype).removeprefix('torch.')}, expected a floating-point tensor"
        for n, t in zip(names, parts, strict=True)
        if not t.dtype.is_floating_point
    ]
    # FP8 weights are stored scaled (a `weight_scale` / `weight_scale_inv` beside them); a
    # plain cast reads them without their scales, as wrong weights.
    problems += [
        f"{n}: dtype {str(t.dtype).removeprefix('torch.')}: FP8 weights need their scales, "
        "which the loader does not apply (bf16/fp16/fp32 weights and MXFP4 routed experts only)"
        for n, t in zip(names, parts, strict=True)
        if t.dtype.is_floating_point and t.element_size() == 1
    ]
    return torch.float32 if spec.keep_fp32 else dtype


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype | str | None = "auto",
    device: torch.device | str = "cpu",
    config: ModelConfig | None = None,
    strict: bool = True,
) -> KimiForCausalLM:
    """Build `KimiForCausalLM` from a checkpoint directory.

    dtype: the model's dtype ("auto" takes the checkpoint's); decay rates and the router stay
    fp32, and MXFP4 routed experts stay packed (`layers.moe.Mxfp4Experts`, never upcast).
    strict: unexpected tensors are an error (multimodal towers are always skipped).
    A tied config with a stored `lm_head.weight` that differs from the embedding loads untied
    (the returned model's config has tie_word_embeddings=False), as transformers loads it.
    Raises CheckpointError listing missing, unexpected and mis-shaped tensors by name.
    """
    root = Path(path)
    raw = load_config_json(root)
    experts = expert_format_of(raw)
    config = config or from_hf_config(raw)
    dtype = resolve_dtype(dtype, raw)
    index = CheckpointIndex.open(root)
    specs = tensor_specs(config, experts)
    # A tied head stored anyway is read (and shape-checked) like any tensor; whether it is the
    # embedding is known only from its values, after loading.
    stored_tied_head = config.tie_word_embeddings and "lm_head.weight" in index.entries
    if stored_tied_head:
        specs.append(lm_head_spec(config))
    plan = _plan(specs, index, strict)

    tensors: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    handles = {}
    try:
        for spec in specs:
            parts, known_problems = [], len(problems)
            for name in plan.sources[spec.target]:
                file, stored = index.entries[name]
                try:
                    if file not in handles:
                        handles[file] = safe_open(root / file, "pt", device="cpu")
                    parts.append(handles[file].get_tensor(stored))
                except (OSError, SafetensorError) as err:  # e.g. the file changed since _plan
                    problems.append(f"{name}: unreadable from {file} ({err})")
            if len(parts) < len(plan.sources[spec.target]):
                continue
            if spec.combine == "a_log":
                problems += _a_log_padding_problems(spec, plan.sources[spec.target][0], parts[0])
            target_dtype = _check_parts(spec, plan.sources[spec.target], parts, dtype, problems)
            if len(problems) > known_problems:
                continue  # reported; combining parts of mixed FP8 / float dtypes would raise
            tensors[spec.target] = combine_parts(spec, parts).to(device=device, dtype=target_dtype)
    finally:
        handles.clear()
    if problems:
        raise CheckpointError(other=problems)

    if stored_tied_head:
        head = tensors.pop("lm_head.weight")
        # Compared as loaded (in the model's dtype): a difference the cast rounds away would
        # make no difference to the model either.
        if not torch.equal(head, tensors["model.embed_tokens.weight"]):
            logger.warning(
                "%s: lm_head.weight differs from model.embed_tokens.weight although the config "
                "sets tie_word_embeddings; loading them untied with the stored head, as "
                "transformers does (the model's config says tie_word_embeddings=False)",
                root,
            )
            config = config.evolve(tie_word_embeddings=False)
            tensors["lm_head.weight"] = head
    if config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = KimiForCausalLM(config)
        if experts == "mxfp4":
            use_mxfp4_experts(model)
    model.load_state_dict(tensors, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
