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

FP8 block-scaled checkpoints (config.json `quantization_config: {"quant_method": "fp8",
"weight_block_size": [B0, B1], ...}`, as DeepSeek / Kimi FP8 releases ship): a linear weight
`W` of the decoder layers stored as float8_e4m3fn comes with `W_scale_inv` fp32
[ceil(out/B0), ceil(in/B1)]. The attention projections, dense MLP, shared experts and latent
MoE projections stay FP8 (`layers.fp8_linear.Fp8Linear`, in place of the `nn.Linear`); MLA's
kv_b_proj (used only through its weight) and FP8 routed experts are dequantised to the model's
dtype at load. Modules in `ignored_layers` / `modules_to_not_convert` are read as stored
(unquantised); an FP8 weight of one is refused, as are FP8 weights without scales, scales
without an FP8 weight (or of the wrong shape, or where no FP8 weight may be), scales without an
fp8 quantization_config, and malformed quantization_configs (`hf_config.fp8_config_of`).
Only `load_checkpoint` reads them; the sliced loader refuses them.
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
from .hf_config import (
    Fp8Config,
    fp8_config_of,
    from_hf_config,
    load_config_json,
    normalize_name,
    quantization_config_of,
    text_config_of,
)
from .kimi import KimiForCausalLM
from .layers.fp8_linear import FP8_DTYPE, dequantize_fp8_blockwise, scale_shape, use_fp8_linears
from .layers.moe import use_mxfp4_experts
from .weight_map import (
    FP32_SUFFIXES,
    SCALE_SUFFIX,
    TensorSpec,
    check_part_shape,
    combine_parts,
    fp8_role,
    lm_head_spec,
    scale_name,
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
    """For each spec, the checkpoint names of its parts; `scales`: for the specs with FP8 block
    scales beside some part, each part's scale name (None for a part without)."""

    sources: dict[str, list[str]]
    scales: dict[str, list[str | None]] = attrs.field(factory=dict)


def _plan(
    specs: Iterable[TensorSpec],
    index: CheckpointIndex,
    strict: bool,
    shapes: tuple[dict[str, tuple[int, ...]], list[str]] | None = None,
    fp8: Fp8Config | None = None,
) -> _Plan:
    """shapes: `index.shapes()` when not given (the sliced loader reads its own headers).
    fp8: the checkpoint's FP8 quantization (block scales `<weight>_scale_inv` are then read
    beside the weights that may be FP8, and shape-checked; without it any is refused)."""
    shapes, file_problems = index.shapes() if shapes is None else shapes
    file_problems = list(file_problems)
    missing, mis_shaped, used, sources, scales = [], [], set(), {}, {}
    for spec in specs:
        names, part_scales = [], []
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
            scale = scale_name(found)
            part_scales.append(scale if scale in shapes else None)
            if scale not in shapes:
                continue
            used.add(scale)
            if fp8_role(spec.target) is None:
                file_problems.append(
                    f"{scale}: FP8 block scales are read for the decoder layers' linear "
                    f"projections and routed experts only, not for {found}"
                )
            elif fp8 is None:
                file_problems.append(
                    f"{scale}: FP8 block scales, but config.json has no quantization_config "
                    "with quant_method 'fp8' (and weight_block_size) to read them by"
                )
            else:
                want = scale_shape(*spec.part_shape, fp8.block_size)
                if tuple(shapes[scale]) != want:
                    mis_shaped.append(
                        f"{scale}: shape {list(shapes[scale])}, expected {list(want)} (one scale "
                        f"per block of {found} {list(spec.part_shape)}, weight_block_size "
                        f"{list(fp8.block_size)})"
                    )
        sources[spec.target] = names
        if any(part_scales):
            scales[spec.target] = part_scales
    unexpected = sorted(set(shapes) - used) if strict else []
    if missing or mis_shaped or unexpected or file_problems:
        raise CheckpointError(missing, unexpected, mis_shaped, file_problems)
    return _Plan(sources, scales)


def expert_format_of(raw: dict) -> str:
    """The routed experts' storage in a checkpoint's config.json: "dense" (no quantisation, or
    FP8 block-scaled: FP8 routed experts are dequantised at load) or "mxfp4" (compressed-tensors
    `mxfp4-pack-quantized`, as K3 ships); any other quantisation is refused, naming its format,
    and so is a malformed FP8 one (`hf_config.fp8_config_of`)."""
    quant = quantization_config_of(raw)
    if not quant:
        return "dense"
    if fp8_config_of(raw) is not None:
        return "dense"
    if not isinstance(quant, dict):
        raise CheckpointError(other=[f"config.json quantization_config {quant!r} is not an object"])
    from .ops.moe.mxfp4 import is_mxfp4_config  # imports Triton: only when needed

    if is_mxfp4_config(quant):
        return "mxfp4"
    fmt = quant.get("format") or quant.get("quant_method")
    raise CheckpointError(
        other=[
            f"quantized checkpoints ({fmt}) are not supported; the loader reads bf16/fp32 "
            "exports, FP8 block-scaled checkpoints (quant_method fp8, weight_block_size) and "
            "MXFP4 routed experts (mxfp4-pack-quantized)"
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
    `dtype` (decay rates and the router in fp32, packed MXFP4 experts as stored, FP8 linear
    weights in one byte plus their fp32 block scales)."""

    config: ModelConfig
    dtype: torch.dtype
    experts: str  # "dense" or "mxfp4"
    num_params: int
    nbytes: int
    fp8: Fp8Config | None = None


def fp8_linear_modules(model: torch.nn.Module, fp8: Fp8Config) -> dict[str, tuple[int, int]]:
    """The linear modules of `model` an FP8 checkpoint of `fp8` stores in FP8 and that stay FP8
    (`weight_map.fp8_role` "linear", not in its ignored list) -> block size."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or fp8_role(f"{name}.weight") != "linear":
            continue
        # The checkpoint spells MoE layers `block_sparse_moe.`: either may be listed.
        if not fp8.ignores(name, name.replace(".mlp.", ".block_sparse_moe.")):
            out[name] = fp8.block_size
    return out


def weight_footprint(
    config: ModelConfig,
    dtype: torch.dtype,
    experts: str = "dense",
    fp8: Fp8Config | None = None,
) -> WeightFootprint:
    """The weights' size, counted on the meta device (nothing is allocated); fp8: an FP8
    block-scaled checkpoint's quantization (its projections counted in FP8)."""
    with torch.device("meta"):
        model = KimiForCausalLM(config)
        if experts == "mxfp4":
            use_mxfp4_experts(model)
        if fp8 is not None:
            use_fp8_linears(model, fp8_linear_modules(model, fp8))
    num_params = nbytes = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        num_params += tensor.numel()
        if not tensor.dtype.is_floating_point or tensor.dtype == FP8_DTYPE:
            size = tensor.element_size()
        elif name.endswith(FP32_SUFFIXES) or name.endswith(SCALE_SUFFIX):
            size = 4
        else:
            size = dtype.itemsize
        nbytes += tensor.numel() * size
    return WeightFootprint(config, dtype, experts, num_params, nbytes, fp8)


def checkpoint_footprint(path: str | Path, dtype: torch.dtype | str | None = "auto"):
    """The `WeightFootprint` of loading the checkpoint at `path` in `dtype` (as
    `load_checkpoint` would), from its config.json alone: no shard is read (an FP8 checkpoint's
    projections are counted as FP8 unless its config lists them as ignored)."""
    raw = load_config_json(Path(path))
    experts = expert_format_of(raw)
    config = from_hf_config(raw)
    return weight_footprint(config, resolve_dtype(dtype, raw), experts, fp8_config_of(raw))


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
    # plain cast reads them without their scales, as wrong weights. (`load_checkpoint` reads
    # the FP8 weights of block-scaled FP8 checkpoints with their scales first: `_fp8_parts`.)
    problems += [
        f"{n}: dtype {str(t.dtype).removeprefix('torch.')}: FP8 weights need their scales, "
        "which the loader does not apply (bf16/fp16/fp32 weights and MXFP4 routed experts only)"
        for n, t in zip(names, parts, strict=True)
        if t.dtype.is_floating_point and t.element_size() == 1
    ]
    return torch.float32 if spec.keep_fp32 else dtype


def _fp8_parts(
    spec: TensorSpec,
    names: list[str],
    parts: list[torch.Tensor],
    scales: list[torch.Tensor | None],
    fp8: Fp8Config | None,
    problems: list[str],
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
    """FP8 parts of `spec` with their block scales (`scales`, None where a part has none):
    returns (parts with the "dequantize" ones dequantised to fp32, (e4m3 weight, fp32 scales)
    when the spec's module stays FP8). Appends to `problems` what is wrong instead: an FP8
    weight without scales, scales beside a weight that is not FP8, e5m2, an FP8 weight of an
    ignored module or of one that may not be FP8."""
    out, kept, dequantised = list(parts), None, False
    role = fp8_role(spec.target)
    for i, (name, part, scale) in enumerate(zip(names, parts, scales, strict=True)):
        stored = str(part.dtype).removeprefix("torch.")
        is_fp8 = part.dtype.is_floating_point and part.element_size() == 1
        if scale is not None and not is_fp8:
            problems.append(
                f"{name}: dtype {stored} with block scales {scale_name(name)} beside it; the "
                "scales go with float8_e4m3fn weights"
            )
            continue
        if not is_fp8 or (scale is None and fp8 is None):
            continue  # not FP8, or FP8 in a checkpoint that is not: `_check_parts` says so
        if role is None:
            problems.append(
                f"{name}: dtype {stored}; only the decoder layers' linear projections and routed "
                "experts may be stored in FP8"
            )
        elif scale is None:
            problems.append(f"{name}: dtype {stored} without its block scales {scale_name(name)}")
        elif part.dtype != FP8_DTYPE:
            problems.append(f"{name}: dtype {stored}; FP8 weights must be float8_e4m3fn (e4m3)")
        elif not scale.dtype.is_floating_point or scale.element_size() < 2:
            sdtype = str(scale.dtype).removeprefix("torch.")
            problems.append(
                f"{scale_name(name)}: dtype {sdtype}; block scales must be float32 (or another "
                "float dtype of 16 bits or more)"
            )
        elif fp8.ignores(name.removesuffix(".weight"), spec.target.removesuffix(".weight")):
            problems.append(
                f"{name}: stored in FP8, but config.json's quantization_config lists its module "
                "in ignored_layers / modules_to_not_convert (ignored modules are stored "
                "unquantised)"
            )
        elif role == "linear":
            kept = (part, scale.float())
        else:
            out[i] = dequantize_fp8_blockwise(part, scale, fp8.block_size)
            dequantised = True
    if dequantised and any(t.dtype != out[0].dtype for t in out):
        out = [t.float() for t in out]  # dequantised experts beside unquantised ones
    return out, kept


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype | str | None = "auto",
    device: torch.device | str = "cpu",
    config: ModelConfig | None = None,
    strict: bool = True,
) -> KimiForCausalLM:
    """Build `KimiForCausalLM` from a checkpoint directory.

    dtype: the model's dtype ("auto" takes the checkpoint's); decay rates and the router stay
    fp32, MXFP4 routed experts stay packed (`layers.moe.Mxfp4Experts`, never upcast), and the
    FP8 projections of a block-scaled FP8 checkpoint stay FP8 (`layers.fp8_linear.Fp8Linear`).
    strict: unexpected tensors are an error (multimodal towers are always skipped).
    A tied config with a stored `lm_head.weight` that differs from the embedding loads untied
    (the returned model's config has tie_word_embeddings=False), as transformers loads it.
    Raises CheckpointError listing missing, unexpected and mis-shaped tensors by name.
    """
    root = Path(path)
    raw = load_config_json(root)
    experts = expert_format_of(raw)
    fp8 = fp8_config_of(raw)
    config = config or from_hf_config(raw)
    dtype = resolve_dtype(dtype, raw)
    index = CheckpointIndex.open(root)
    specs = tensor_specs(config, experts)
    # A tied head stored anyway is read (and shape-checked) like any tensor; whether it is the
    # embedding is known only from its values, after loading.
    stored_tied_head = config.tie_word_embeddings and "lm_head.weight" in index.entries
    if stored_tied_head:
        specs.append(lm_head_spec(config))
    plan = _plan(specs, index, strict, fp8=fp8)

    tensors: dict[str, torch.Tensor] = {}
    fp8_modules: dict[str, tuple[int, int]] = {}
    problems: list[str] = []
    handles = {}

    def read(name: str) -> torch.Tensor | None:
        file, stored = index.entries[name]
        try:
            if file not in handles:
                handles[file] = safe_open(root / file, "pt", device="cpu")
            return handles[file].get_tensor(stored)
        except (OSError, SafetensorError) as err:  # e.g. the file changed since _plan
            problems.append(f"{name}: unreadable from {file} ({err})")
            return None

    try:
        for spec in specs:
            known_problems = len(problems)
            names = plan.sources[spec.target]
            parts = [read(name) for name in names]
            scale_names = plan.scales.get(spec.target, [None] * len(names))
            scales = [None if s is None else read(s) for s in scale_names]
            if len(problems) > known_problems:
                continue
            if spec.combine == "a_log":
                problems += _a_log_padding_problems(spec, names[0], parts[0])
            parts, kept = _fp8_parts(spec, names, parts, scales, fp8, problems)
            if len(problems) > known_problems:
                continue  # reported; _check_parts would report FP8 parts again
            if kept is not None:  # stays FP8: an Fp8Linear's buffers, as stored
                module = spec.target.removesuffix(".weight")
                tensors[spec.target] = kept[0].to(device=device)
                tensors[scale_name(spec.target)] = kept[1].to(device=device)
                fp8_modules[module] = fp8.block_size
                continue
            target_dtype = _check_parts(spec, names, parts, dtype, problems)
            if len(problems) > known_problems:
                continue  # reported; combining parts of mixed FP8 / float dtypes would raise
            tensors[spec.target] = combine_parts(spec, parts).to(device=device, dtype=target_dtype)
    finally:
        handles.clear()
    if problems:
        raise CheckpointError(other=problems)
    if fp8_modules:
        logger.info(
            "%s: %d linear projections in FP8 (e4m3, blocks %s)",
            root,
            len(fp8_modules),
            list(fp8.block_size),
        )

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
        use_fp8_linears(model, fp8_modules)
    model.load_state_dict(tensors, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
