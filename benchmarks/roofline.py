"""The roofline of an offline generation workload, from the model config and the run's schedule.

Roofline time = (sum over decode forwards of the bytes the forward must stream) / copy bandwidth
              + (sum over prefill forwards of their FLOPs) / matmul rate.

Bytes of a decode forward of B rows whose histories hold c_1..c_B tokens (`decode_bytes`):
every weight outside the routed experts once (attention / KDA projections, router, shared
experts, latent projections, dense MLPs, norms, the LM head), the routed experts the forward
selects (ESTIMATED, not counted: under uniform routing of B tokens x top-k of E experts a MoE
layer selects E * (1 - (1 - k/E)^B) distinct experts on average; skewed routing selects fewer,
tokens whose choices overlap less than at random more; `all_experts` prices every expert, the
most a forward can read), B embedding rows, every KDA
layer's state read and written per row (fp32 recurrent state + conv window), and every MLA
layer's cache rows: the c_i + 1 rows each row attends to, plus its new row written.

FLOPs of a prefill forward (`prefill_flops`): 2 x the active parameters per token (all but the
embedding and LM head, with top-k routed experts per MoE layer), the LM head for the rows that
sample, MLA attention in its MHA form, causal (2 x heads x (qk + v head dims) per attended
position), and the KDA chunked delta rule, an ESTIMATE: per token and head
6*K*V + 2*C*(3*K + 2*V) for chunk C = 64 (state update, inter- and intra-chunk products; the
triangular solve and element-wise gates left out).

Not in the roofline (as the benchmark's definition has it; `decode_flops` and
`prefill_weight_bytes` give them for comparison): decode FLOPs and the weight reads of prefill.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

KDA_CHUNK = 64


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a `ModelConfig` by the part of the model they belong to (all layers
    together, except `expert`: ONE routed expert of one MoE layer)."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    attention: int  # KDA and MLA layers: projections, conv, gates, their norms
    norms: int  # per-layer norms, attention-residual mixes, the final norm
    dense_mlp: int
    router: int
    shared_experts: int
    latent: int  # latent MoE: down / up projections and the latent norm
    expert: int
    num_moe_layers: int
    num_experts: int
    top_k: int

    @property
    def total(self) -> int:
        """Every parameter (all routed experts), as `named_parameters` counts them."""
        routed = self.expert * self.num_experts * self.num_moe_layers
        return self.embedding + self.lm_head + self.streamed + routed

    @property
    def streamed(self) -> int:
        """Read whole by every forward: all but the embedding, the LM head and routed experts."""
        return (
            self.attention
            + self.norms
            + self.dense_mlp
            + self.router
            + self.shared_experts
            + self.latent
        )

    @property
    def active_per_token(self) -> int:
        """Matmul parameters one token runs through: all but the embedding, the LM head and
        the norms, with top-k routed experts per MoE layer."""
        routed = self.expert * self.top_k * self.num_moe_layers
        return self.streamed - self.norms + routed


def kda_layer_params(hidden: int, kda) -> int:
    heads, dim, proj = kda.num_heads, kda.head_dim, kda.projection_size
    gate = proj * hidden if kda.full_rank_output_gate else dim * hidden + proj * dim
    return (
        3 * proj * hidden  # q, k, v
        + kda.conv_channels * kda.conv_kernel
        + dim * hidden
        + proj * dim  # f_a, f_b (the decay gate's low rank)
        + heads
        + proj  # A_log, dt_bias
        + heads * hidden  # b_proj
        + gate
        + dim  # o_norm
        + hidden * proj  # o_proj
    )


def mla_layer_params(hidden: int, mla) -> int:
    q_out = mla.num_heads * mla.qk_head_dim
    # q_proj, or q_a, its norm and q_b
    q = q_out * hidden if mla.q_lora_rank is None else mla.q_lora_rank * (hidden + 1 + q_out)
    kv = (
        mla.latent_width * hidden
        + mla.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
        + mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank  # kv_b
    )
    out = mla.num_heads * mla.v_head_dim * hidden
    gate = out if mla.output_gate else 0
    return q + kv + gate + out


def param_counts(config) -> ParamCounts:
    """`config`: a `tokenspeed.model.ModelConfig`."""
    hidden = config.hidden_size
    attention = sum(
        kda_layer_params(hidden, config.kda)
        if kind == "kda"
        else mla_layer_params(hidden, config.mla)
        for kind in config.layer_kinds
    )
    per_layer_norms = 2 * hidden + (4 * hidden if config.uses_attn_res else 0)
    norms = (
        config.num_layers * per_layer_norms + hidden + (2 * hidden if config.uses_attn_res else 0)
    )
    num_dense = config.mlp_kinds.count("dense")
    num_moe = config.mlp_kinds.count("moe")
    moe = config.moe
    router = shared = latent = expert = experts = top_k = 0
    if num_moe:
        width = moe.latent_size or hidden
        inter = moe.expert_intermediate_size
        router = num_moe * moe.num_experts * hidden
        shared = num_moe * 3 * hidden * inter * moe.num_shared_experts
        if moe.latent_size is not None:
            latent = num_moe * (2 * hidden * width + (width if moe.latent_norm else 0))
        expert, experts, top_k = 3 * width * inter, moe.num_experts, moe.top_k
    vocab = config.vocab_size * hidden
    return ParamCounts(
        embedding=vocab,
        lm_head=0 if config.tie_word_embeddings else vocab,
        attention=attention,
        norms=norms,
        dense_mlp=num_dense * 3 * hidden * config.dense_intermediate_size,
        router=router,
        shared_experts=shared,
        latent=latent,
        expert=expert,
        num_moe_layers=num_moe,
        num_experts=experts,
        top_k=top_k,
    )


def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts that `tokens` tokens, each routed to `top_k` of `num_experts`
    uniformly at random, select: E * (1 - (1 - k/E)^B)."""
    if tokens <= 0 or num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class CacheBytes:
    """Bytes per request per layer of the cache a decode forward streams: one MLA row (one
    token of one MLA layer), one KDA layer's conv window and recurrent state."""

    mla_row: int
    kda_conv: int
    kda_recurrent: int

    @classmethod
    def of(cls, config, dtype_bytes: int = 2, recurrent_bytes: int = 4) -> CacheBytes:
        """The engine's defaults: MLA rows and conv windows in the model dtype, fp32 state."""
        kda = config.kda
        return cls(
            mla_row=config.mla.latent_width * dtype_bytes,
            kda_conv=kda.conv_channels * (kda.conv_kernel - 1) * dtype_bytes,
            kda_recurrent=kda.num_heads * kda.head_dim * kda.head_dim * recurrent_bytes,
        )


@dataclass(frozen=True)
class DecodeForward:
    """One decode forward: contexts[i] = tokens already in row i's history (its prefix)."""

    contexts: tuple[int, ...]


@dataclass(frozen=True)
class PrefillForward:
    """One prefill step: chunks (start, end, samples) compute tokens [start, end) of a prompt;
    samples: the chunk ends the prompt, so its last row goes through the LM head."""

    chunks: tuple[tuple[int, int, bool], ...]

    @property
    def tokens(self) -> int:
        return sum(end - start for start, end, _ in self.chunks)


EXPERTS_KEY = "routed experts (selected, ESTIMATE: uniform routing)"


def decode_bytes(
    config,
    contexts: Sequence[int],
    cache: CacheBytes,
    weight_bytes: int = 2,
    all_experts: bool = False,
) -> dict[str, float]:
    """Bytes one decode forward must stream, by part (see the module docstring).
    all_experts: every routed expert of every MoE layer read (the most routing can ask for)
    instead of the uniform-routing estimate."""
    p = param_counts(config)
    rows = len(contexts)
    hits = p.num_experts if all_experts else distinct_experts(p.num_experts, p.top_k, rows)
    num_kda = len(config.kda_layers)
    num_mla = len(config.mla_layers)
    return {
        EXPERTS_KEY: p.num_moe_layers * hits * p.expert * weight_bytes,
        "shared experts": p.shared_experts * weight_bytes,
        "router + latent projections": (p.router + p.latent) * weight_bytes,
        "attention / KDA weights": p.attention * weight_bytes,
        "dense MLPs": p.dense_mlp * weight_bytes,
        "norms": p.norms * weight_bytes,
        "LM head": (p.lm_head or p.embedding) * weight_bytes,
        "embedding rows": rows * config.hidden_size * weight_bytes,
        "KDA states (read + write)": 2 * rows * num_kda * (cache.kda_conv + cache.kda_recurrent),
        "MLA cache rows (read c+1, write 1)": num_mla
        * cache.mla_row
        * (sum(c + 1 for c in contexts) + rows),
    }


def _causal_positions(start: int, end: int) -> int:
    """Sum over tokens t in [start, end) of the positions t attends to (t + 1)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def prefill_flops(config, chunks: Iterable[tuple[int, int, bool]]) -> dict[str, float]:
    """FLOPs of one prefill step, by part (see the module docstring)."""
    p = param_counts(config)
    chunks = list(chunks)
    tokens = sum(end - start for start, end, _ in chunks)
    sampled = sum(1 for _, _, samples in chunks if samples)
    mla, kda = config.mla, config.kda
    attended = sum(_causal_positions(start, end) for start, end, _ in chunks)
    k = v = kda.head_dim
    per_head = 6 * k * v + 2 * KDA_CHUNK * (3 * k + 2 * v)
    return {
        "weights (2 x active params per token)": 2.0 * p.active_per_token * tokens,
        "LM head (sampling rows)": 2.0 * config.vocab_size * config.hidden_size * sampled,
        "MLA attention (causal)": 2.0
        * len(config.mla_layers)
        * mla.num_heads
        * (mla.qk_head_dim + mla.v_head_dim)
        * attended,
        "KDA chunked recurrence (ESTIMATE)": float(
            len(config.kda_layers) * kda.num_heads * per_head * tokens
        ),
    }


def decode_flops(config, contexts: Sequence[int]) -> float:
    """FLOPs of one decode forward (not in the roofline): weights, LM head, absorbed MLA
    attention over c + 1 positions, the KDA recurrent step (6*K*V per head)."""
    p = param_counts(config)
    rows = len(contexts)
    mla, kda = config.mla, config.kda
    positions = sum(c + 1 for c in contexts)
    attn = 2 * mla.num_heads * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim) * positions
    return (
        2.0 * rows * (p.active_per_token + config.vocab_size * config.hidden_size)
        + len(config.mla_layers) * attn
        + len(config.kda_layers) * kda.num_heads * 6 * kda.head_dim**2 * rows
    )


@dataclass
class Roofline:
    """The roofline of a schedule (a list of DecodeForward / PrefillForward)."""

    copy_bandwidth: float  # bytes/s
    matmul_rate: float  # FLOP/s
    decode_bytes: dict[str, float] = field(default_factory=dict)
    prefill_flops: dict[str, float] = field(default_factory=dict)
    decode_forwards: int = 0
    decode_rows: int = 0
    prefill_steps: int = 0
    prefill_tokens: int = 0
    decode_flops: float = 0.0  # not in the roofline
    prefill_weight_bytes: float = 0.0  # not in the roofline

    @property
    def decode_s(self) -> float:
        return sum(self.decode_bytes.values()) / self.copy_bandwidth

    @property
    def prefill_s(self) -> float:
        return sum(self.prefill_flops.values()) / self.matmul_rate

    @property
    def seconds(self) -> float:
        return self.decode_s + self.prefill_s


def _add(into: dict[str, float], parts: dict[str, float]) -> None:
    for key, value in parts.items():
        into[key] = into.get(key, 0.0) + value


def roofline(
    config,
    forwards: Iterable[DecodeForward | PrefillForward],
    copy_bandwidth: float,
    matmul_rate: float,
    cache: CacheBytes | None = None,
    weight_bytes: int = 2,
    all_experts: bool = False,
) -> Roofline:
    """all_experts: as `decode_bytes` takes it."""
    cache = cache or CacheBytes.of(config, weight_bytes)
    p = param_counts(config)
    out = Roofline(copy_bandwidth, matmul_rate)
    for fwd in forwards:
        if isinstance(fwd, DecodeForward):
            if not fwd.contexts:
                continue
            parts = decode_bytes(config, fwd.contexts, cache, weight_bytes, all_experts)
            _add(out.decode_bytes, parts)
            out.decode_forwards += 1
            out.decode_rows += len(fwd.contexts)
            out.decode_flops += decode_flops(config, fwd.contexts)
        else:
            _add(out.prefill_flops, prefill_flops(config, fwd.chunks))
            out.prefill_steps += 1
            out.prefill_tokens += fwd.tokens
            out.prefill_weight_bytes += (p.total - p.embedding) * weight_bytes
    return out


# ---------------------------------------------------------------------- measured rates


def _seconds_per_call(fn, device: torch.device, iters: int, warmup: int = 20) -> float:
    for _ in range(warmup):  # clocks up, caches and cuBLAS heuristics settled
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 50) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (bytes read + bytes written counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    seconds = _seconds_per_call(lambda: dst.copy_(src), device, iters)
    return 2 * nbytes / seconds


def matmul_rate(
    device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16, iters: int = 50
) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOPs)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _seconds_per_call(lambda: torch.mm(a, b, out=out), device, iters)
    return 2 * n**3 / seconds
