"""Closed-form accounting of parallel layouts: weight bytes per GPU, communication per local
token, per-request cache bytes and the requests that fit. Pure arithmetic over a `ModelConfig`
(nothing is built or allocated); `benchmarks/parallel_memory.py` prints K3's table from it.

Layouts (`Layout(tp=T, ep=R)`): attention is data parallel in all of them (every rank keeps its
own requests and their whole cache); `tp` shards the projections `apply_tp_subgroup` selects
(rows of each, by default `tp_subgroup.DEFAULT_PROJECTIONS`: the KDA/MLA projections reading the
hidden state, both output projections, the shared experts); `ep` splits the routed experts
(`apply_dep`). Everything else is replicated.

Precisions (`Precision`): a storage format for the routed experts, the attention projections
(every nn.Linear of a KDA or MLA layer) and the shared experts; the rest is bf16, except what
the loader keeps in fp32 (decay rates A_log / dt_bias, the router weight and its bias). Bytes
per matrix of R rows x C columns (`matrix_bytes`):
    bf16 2RC; fp32 4RC;
    mxfp4  R (C/2 + C/32): two E2M1 codes a byte, one E8M0 scale per 32 (what K3 ships and
           `Mxfp4Experts` holds);
    nvfp4  R (C/2 + C/16) + 4: E2M1 codes, one E4M3 scale per 16, one fp32 scale per tensor;
    fp8    RC + 4 ceil(R/128) ceil(C/128): E4M3 with fp32 scales per 128 x 128 block.

Communication, bytes one rank sends per local token (activations in bf16 unless stated):
- TP subgroup of T (`tp_subgroup_layer_bytes`), equal token counts: per gather group of input
  width `in` (the projections reading one tensor share one gather) (T-1) * in, plus per
  selected projection of output width `out` (T-1)/T * out; for one square projection of width H
  alone that is the issue's ((T-1) + (T-1)/T) * H (`tp_subgroup_pair_bytes`);
- DEP over R ranks (`dep_layer_bytes`), per MoE layer: dispatch and combine carry one row a
  (token, remote rank holding one of its experts) pair, rows of the experts' width (K3: the
  latent width 3584), at most min(K, R-1) rows a token (<= K: dispatch + combine <= 2 K rows,
  the issue's bound); the dispatch also carries K fp32 weights + K int32 ids a row (and one fp32
  scale with an FP8 payload); `expected=True` gives the mean under uniform routing,
  (R-1) (1 - C(E - E/R, K) / C(E, K)) rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from ..model.config import ModelConfig
from .tp_subgroup import DEFAULT_PROJECTIONS, KDA_READS_HIDDEN, MLA_READS_HIDDEN

GB = 10**9
FORMATS = ("bf16", "fp32", "mxfp4", "nvfp4", "fp8")


def matrix_bytes(rows: int, cols: int, fmt: str) -> int:
    """Bytes of one rows x cols weight stored in `fmt` (see the module docstring)."""
    if fmt == "bf16":
        return 2 * rows * cols
    if fmt == "fp32":
        return 4 * rows * cols
    if fmt == "mxfp4":
        return rows * (cols // 2 + cols // 32)
    if fmt == "nvfp4":
        return rows * (cols // 2 + cols // 16) + 4
    if fmt == "fp8":
        return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)
    raise ValueError(f"unknown format {fmt!r}; known: {FORMATS}")


@attrs.frozen
class Precision:
    """Storage formats: routed experts, attention projections, shared experts (the rest bf16,
    decay rates and the router fp32)."""

    name: str
    routed: str
    attention: str = "bf16"
    shared: str = "bf16"


# (a) what K3 checkpoints store and the loader keeps: MXFP4 routed experts, bf16 elsewhere.
CHECKPOINT = Precision("checkpoint: MXFP4 experts, BF16 rest", routed="mxfp4")
# (b) NVFP4 routed experts, FP8 attention projections, BF16 shared experts.
NVFP4_FP8 = Precision(
    "NVFP4 experts, FP8 attention, BF16 shared", routed="nvfp4", attention="fp8", shared="bf16"
)


@attrs.frozen
class Layout:
    """tp: TP-subgroup size of the selected projections; ep: DEP size of the routed experts."""

    name: str
    tp: int = 1
    ep: int = 1


@attrs.frozen
class Matrix:
    """One weight: `count` copies (experts) of rows x cols (cols 1 for a vector).

    group: "attention" (a KDA/MLA nn.Linear), "routed", "shared", "fp32" (decay rates, router),
    "other" (bf16: embedding, head, norms, conv, latent projections, dense MLP).
    tp_sharded: rows split over the TP subgroup (a selected projection).
    """

    name: str
    group: str
    rows: int
    cols: int = 1
    count: int = 1
    tp_sharded: bool = False


def _selected(kind: str, name: str, projections: Iterable[str]) -> bool:
    chosen = set(projections)
    return name in chosen or f"{kind}.{name}" in chosen


def _attention_projections(config: ModelConfig, kind: str) -> list[tuple[str, int, int]]:
    """(name, in, out) of the nn.Linear children of a KDA or MLA layer."""
    h = config.hidden_size
    if kind == "kda":
        c = config.kda
        proj, dim = c.projection_size, c.head_dim
        out = [("q_proj", h, proj), ("k_proj", h, proj), ("v_proj", h, proj)]
        out += [("f_a_proj", h, dim), ("f_b_proj", dim, proj), ("b_proj", h, c.num_heads)]
        if c.full_rank_output_gate:
            out.append(("g_proj", h, proj))
        else:
            out += [("g_a_proj", h, dim), ("g_b_proj", dim, proj)]
        return [*out, ("o_proj", proj, h)]
    c = config.mla
    q_out, v_out = c.num_heads * c.qk_head_dim, c.num_heads * c.v_head_dim
    if c.q_lora_rank is None:
        out = [("q_proj", h, q_out)]
    else:
        out = [("q_a_proj", h, c.q_lora_rank), ("q_b_proj", c.q_lora_rank, q_out)]
    out.append(("kv_a_proj_with_mqa", h, c.latent_width))
    out.append(("kv_b_proj", c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)))
    if c.output_gate:
        out.append(("g_proj", h, v_out))
    return [*out, ("o_proj", v_out, h)]


def _glu(prefix: str, group: str, h: int, inter: int, sharded: bool) -> list[Matrix]:
    return [
        Matrix(f"{prefix}.gate_proj", group, inter, h, tp_sharded=sharded),
        Matrix(f"{prefix}.up_proj", group, inter, h, tp_sharded=sharded),
        Matrix(f"{prefix}.down_proj", group, h, inter, tp_sharded=sharded),
    ]


def model_matrices(
    config: ModelConfig, projections: Iterable[str] = DEFAULT_PROJECTIONS
) -> list[Matrix]:
    """Every weight of `KimiForCausalLM(config)` (as `weight_map.tensor_specs` lists them),
    grouped for precision and marked for the TP subgroup's `projections`."""
    projections = tuple(projections)
    h = config.hidden_size
    out = [Matrix("embed_tokens", "other", config.vocab_size, h)]
    for i in range(config.num_layers):
        p = f"layers.{i}"
        out += [Matrix(f"{p}.input_layernorm", "other", h), Matrix(f"{p}.post_norm", "other", h)]
        if config.uses_attn_res:
            out += [Matrix(f"{p}.attn_res.{n}", "other", h) for n in ("sa_norm", "sa_proj")]
            out += [Matrix(f"{p}.attn_res.{n}", "other", h) for n in ("mlp_norm", "mlp_proj")]
        kind = config.layer_kinds[i]
        for name, fan_in, fan_out in _attention_projections(config, kind):
            sharded = _selected(kind, name, projections) and name != "kv_b_proj"
            out.append(Matrix(f"{p}.{name}", "attention", fan_out, fan_in, tp_sharded=sharded))
        if kind == "kda":
            c = config.kda
            out.append(Matrix(f"{p}.conv_weight", "other", c.conv_channels, c.conv_kernel))
            out += [Matrix(f"{p}.A_log", "fp32", c.num_heads)]
            out += [Matrix(f"{p}.dt_bias", "fp32", c.projection_size)]
            out.append(Matrix(f"{p}.o_norm", "other", c.head_dim))
        else:
            c = config.mla
            if c.q_lora_rank is not None:
                out.append(Matrix(f"{p}.q_a_layernorm", "other", c.q_lora_rank))
            out.append(Matrix(f"{p}.kv_a_layernorm", "other", c.kv_lora_rank))
        if config.mlp_kinds[i] == "dense":
            sharded = _selected("mlp", "dense_mlp", projections)
            out += _glu(f"{p}.mlp", "other", h, config.dense_intermediate_size, sharded)
            continue
        m = config.moe
        width, inter = m.latent_size or h, m.expert_intermediate_size
        out += [
            Matrix(f"{p}.gate", "fp32", m.num_experts, h),
            Matrix(f"{p}.gate.bias", "fp32", m.num_experts),
            Matrix(f"{p}.experts.w1", "routed", inter, width, count=m.num_experts),
            Matrix(f"{p}.experts.w2", "routed", width, inter, count=m.num_experts),
            Matrix(f"{p}.experts.w3", "routed", inter, width, count=m.num_experts),
        ]
        if m.latent_size is not None:
            out.append(Matrix(f"{p}.routed_expert_down_proj", "other", width, h))
            out.append(Matrix(f"{p}.routed_expert_up_proj", "other", h, width))
            if m.latent_norm:
                out.append(Matrix(f"{p}.routed_expert_norm", "other", width))
        if m.num_shared_experts:
            sharded = _selected("mlp", "shared_experts", projections)
            out += _glu(f"{p}.shared_experts", "shared", h, inter * m.num_shared_experts, sharded)
    out.append(Matrix("norm", "other", h))
    if config.uses_attn_res:
        out += [
            Matrix("output_attn_res.norm", "other", h),
            Matrix("output_attn_res.proj", "other", h),
        ]
    if not config.tie_word_embeddings:
        out.append(Matrix("lm_head", "other", config.vocab_size, h))
    return out


def _format(matrix: Matrix, precision: Precision) -> str:
    if matrix.group == "fp32":
        return "fp32"
    if matrix.cols == 1:
        return "bf16"  # vectors (norms) stay bf16 whatever the matrices' format
    return {
        "routed": precision.routed,
        "attention": precision.attention,
        "shared": precision.shared,
    }.get(matrix.group, "bf16")


def _local(matrix: Matrix, layout: Layout) -> tuple[int, int]:
    """(rows, count) of the matrix on one rank of `layout`."""
    rows, count = matrix.rows, matrix.count
    if matrix.tp_sharded and layout.tp > 1:
        if rows % layout.tp:
            raise ValueError(f"tp={layout.tp} does not divide {matrix.name}'s {rows} rows")
        rows //= layout.tp
    if matrix.group == "routed" and layout.ep > 1:
        if count % layout.ep:
            raise ValueError(f"ep={layout.ep} does not divide {matrix.name}'s {count} experts")
        count //= layout.ep
    return rows, count


def weight_numel(config: ModelConfig, layout: Layout, **kwargs) -> int:
    """Weights (elements, unpacked) one rank of `layout` holds."""
    total = 0
    for m in model_matrices(config, **kwargs):
        rows, count = _local(m, layout)
        total += rows * m.cols * count
    return total


def weight_bytes(config: ModelConfig, layout: Layout, precision: Precision, **kwargs) -> int:
    """Bytes of the weights one rank of `layout` holds in `precision`."""
    total = 0
    for m in model_matrices(config, **kwargs):
        rows, count = _local(m, layout)
        total += count * matrix_bytes(rows, m.cols, _format(m, precision))
    return total


# -- communication ------------------------------------------------------------------------------


def tp_subgroup_pair_bytes(width: int, tp: int, nbytes: int = 2) -> float:
    """The issue's closed form: ((T-1) + (T-1)/T) * H * bytes per local token for one
    projection of width H -> H with a gather of its own."""
    return ((tp - 1) + (tp - 1) / tp) * width * nbytes


def tp_subgroup_projection_bytes(fan_in: int, fan_out: int, tp: int, nbytes: int = 2) -> float:
    """One projection with a gather of its own: (T-1) in + (T-1)/T out elements a local token."""
    return ((tp - 1) * fan_in + (tp - 1) / tp * fan_out) * nbytes


def tp_subgroup_layer_bytes(
    config: ModelConfig,
    layer: int,
    tp: int,
    nbytes: int = 2,
    projections: Iterable[str] = DEFAULT_PROJECTIONS,
    share_gather: bool = True,
) -> float:
    """Bytes one rank sends per local token in `layer` under a TP subgroup of `tp` (equal token
    counts): one gather per input shared by its readers (`share_gather`), one all-to-all per
    selected projection (as `apply_tp_subgroup` logs them)."""
    if tp == 1:
        return 0.0
    projections = tuple(projections)
    kind = config.layer_kinds[layer]
    reads_hidden = KDA_READS_HIDDEN if kind == "kda" else MLA_READS_HIDDEN
    # (gather key, in, out) per selected projection; projections sharing a key share a gather.
    chosen = [
        ("hidden" if name in reads_hidden and share_gather else name, fan_in, fan_out)
        for name, fan_in, fan_out in _attention_projections(config, kind)
        if _selected(kind, name, projections) and name != "kv_b_proj"
    ]
    h = config.hidden_size
    block = "dense_mlp" if config.mlp_kinds[layer] == "dense" else "shared_experts"
    if block == "dense_mlp":
        inter = config.dense_intermediate_size
    elif config.moe.num_shared_experts:
        inter = config.moe.expert_intermediate_size * config.moe.num_shared_experts
    else:
        inter = 0
    if inter and _selected("mlp", block, projections):
        key = "mlp_in" if share_gather else "gate_proj"
        chosen += [(key, h, inter), (key if share_gather else "up_proj", h, inter)]
        chosen.append(("down_proj", inter, h))
    gathers = {key: fan_in for key, fan_in, _ in chosen}
    elements = sum((tp - 1) * width for width in gathers.values())
    elements += sum((tp - 1) / tp * fan_out for _, _, fan_out in chosen)
    return elements * nbytes


def dep_rows_per_token(config: ModelConfig, ep: int, expected: bool = False) -> float:
    """Rows a token is dispatched as (and combined from) in one MoE layer under DEP over `ep`
    ranks: at most min(K, ep-1) (one per remote rank holding any of its K experts); with
    `expected`, the mean under uniform routing."""
    if ep == 1:
        return 0.0
    m = config.moe
    if not expected:
        return float(min(m.top_k, ep - 1))
    e, k, per = m.num_experts, m.top_k, m.num_experts // ep
    missed = math.comb(e - per, k) / math.comb(e, k)  # a given rank holds none of the K
    return (ep - 1) * (1 - missed)


def dep_layer_bytes(
    config: ModelConfig,
    ep: int,
    payload_bytes: int = 2,
    combine_bytes: int = 2,
    expected: bool = False,
    metadata: bool = True,
) -> tuple[float, float]:
    """(dispatch, combine) bytes one rank sends per local token per MoE layer under DEP."""
    rows = dep_rows_per_token(config, ep, expected)
    m = config.moe
    width = m.latent_size or config.hidden_size
    meta = 8 * m.top_k + (4 if payload_bytes == 1 else 0) if metadata else 0
    return rows * (width * payload_bytes + meta), rows * width * combine_bytes


def comm_bytes_per_token(
    config: ModelConfig,
    layout: Layout,
    payload_bytes: int = 2,
    expected: bool = False,
) -> float:
    """Bytes one rank sends per local token in one forward through every layer."""
    total = sum(tp_subgroup_layer_bytes(config, i, layout.tp) for i in range(config.num_layers))
    moe_layers = sum(kind == "moe" for kind in config.mlp_kinds)
    total += moe_layers * sum(dep_layer_bytes(config, layout.ep, payload_bytes, 2, expected))
    return total


# -- per-request cache and the requests that fit -----------------------------------------------


@attrs.frozen
class RequestCache:
    """Bytes one request keeps at `tokens` tokens: its FP8 MLA latent cache (latent_width
    bytes a token per MLA layer), a drafter's FP8 KV (`drafter_layers` MLA-style layers at the
    target's latent width), `kda_checkpoints` BF16 KDA checkpoints (conv window + recurrent
    state of every KDA layer); `live_kda` the running request's live KDA state as the engine
    holds it (conv in bf16, recurrent fp32), reported apart (not in `total`)."""

    tokens: int
    mla: int
    drafter: int
    kda_checkpoints: int
    live_kda: int

    @property
    def total(self) -> int:
        return self.mla + self.drafter + self.kda_checkpoints


def kda_state_elements(config: ModelConfig) -> tuple[int, int]:
    """(conv, recurrent) elements of one request's state in one KDA layer."""
    c = config.kda
    return c.conv_channels * (c.conv_kernel - 1), c.num_heads * c.head_dim * c.head_dim


def request_cache(
    config: ModelConfig,
    tokens: int = 200_000,
    drafter_layers: int = 1,
    kda_checkpoints: int = 2,
) -> RequestCache:
    latent = config.mla.latent_width  # 1 byte each in FP8
    conv, recurrent = kda_state_elements(config)
    kda_layers = len(config.kda_layers)
    return RequestCache(
        tokens=tokens,
        mla=tokens * latent * len(config.mla_layers),
        drafter=tokens * latent * drafter_layers,
        kda_checkpoints=kda_checkpoints * kda_layers * (conv + recurrent) * 2,
        live_kda=kda_layers * (2 * conv + 4 * recurrent),
    )


def requests_that_fit(
    weights: int, per_request: int, gpu_bytes: int = 298 * GB, reserved: int = 40 * GB
) -> int:
    """Requests whose cache fits beside the weights and `reserved` (activations, workspace);
    0 when the weights alone do not fit."""
    free = gpu_bytes - reserved - weights
    return max(0, free // per_request)


# -- K3's table -----------------------------------------------------------------------------------

LAYOUTS = (
    Layout("replicated"),
    Layout("TP2 subgroups", tp=2),
    Layout("TP4 subgroups", tp=4),
    Layout("TP8 subgroups", tp=8),
    Layout("DEP8", ep=8),
    Layout("DEP16", ep=16),
    Layout("DEP32", ep=32),
    Layout("DEP8 + TP8 subgroups", tp=8, ep=8),
    Layout("DEP32 + TP4 subgroups", tp=4, ep=32),
)
PRECISIONS = (CHECKPOINT, NVFP4_FP8)


@attrs.frozen
class Row:
    layout: Layout
    precision: Precision
    weight_bytes: int
    comm_per_layer: float  # bf16 payloads, bound, mean over all layers
    comm_per_layer_fp8: float  # FP8 dispatch payload, bound
    comm_per_layer_expected: float  # bf16, mean under uniform routing
    requests: int


def table(
    config: ModelConfig,
    layouts: Iterable[Layout] = LAYOUTS,
    precisions: Iterable[Precision] = PRECISIONS,
    tokens: int = 200_000,
    gpu_bytes: int = 298 * GB,
    reserved: int = 40 * GB,
) -> list[Row]:
    """One row per (layout, precision): weight bytes per GPU, communication bytes per local
    token per layer (mean over the layers), requests of `tokens` tokens that fit per GPU."""
    per_request = request_cache(config, tokens).total
    layers = config.num_layers
    rows = []
    for layout in layouts:
        for precision in precisions:
            weights = weight_bytes(config, layout, precision)
            rows.append(
                Row(
                    layout,
                    precision,
                    weights,
                    comm_bytes_per_token(config, layout) / layers,
                    comm_bytes_per_token(config, layout, payload_bytes=1) / layers,
                    comm_bytes_per_token(config, layout, expected=True) / layers,
                    requests_that_fit(weights, per_request, gpu_bytes, reserved),
                )
            )
    return rows
